/* jobs.c -- the MongoDB store's jobs on the blocking-job pool (runtime/util/jobpool.h): each
 * worker holds a client of libmongoc's pool; before a job, a worker refreshes the server's
 * clock when it is CLOCK_REFRESH_S old (and now and then prunes old tickets). */
#include <stdio.h>
#include <stdlib.h>
#include "stores/mongo/mstore.h"
#include "util/alloc.h"
#include "util/clock.h"

static void refresh_clock(mstore *s, mongoc_client_t *c);

double mg_now(mstore *s)
{
    pthread_mutex_lock(&s->mu);
    double off = s->clock_offset;
    pthread_mutex_unlock(&s->mu);
    return rb_monotonic() + off;    /* a step of our wall clock changes nothing */
}

static void *thread_start(void *ud)
{
    mstore *s = ud;
    return mongoc_client_pool_pop(s->pool);
}

static void thread_stop(void *ud, void *ctx)
{
    mstore *s = ud;
    mongoc_client_pool_push(s->pool, ctx);
}

static void job_run(rb_job *pj, void *ctx)
{
    mjob *j = (mjob *)pj;
    mstore *s = j->s;
    pthread_mutex_lock(&s->mu);
    int stale = rb_monotonic() - s->clock_checked > CLOCK_REFRESH_S;
    if (stale) s->clock_checked = rb_monotonic();   /* one worker refreshes */
    pthread_mutex_unlock(&s->mu);
    if (stale) refresh_clock(s, ctx);
    j->work(j, j->tx ? j->tx->client : ctx);
}

static void job_done(rb_job *pj, int ran)
{
    mjob *j = (mjob *)pj;
    const char *err = !ran ? MG_STORE_CLOSED : j->err[0] ? j->err : NULL;
    if (err && j->tx) mg_tx_doom(j->tx, err);
    /* (before done, which frees the job; a closing store wakes no one) */
    if (ran && j->released && !j->s->closing) rb_store_notify_local(&j->s->base);
    j->done(j, err);
}

void mg_answer_records(mjob *j, const char *err, rb_delivery **recs, size_t n)
{
    if (err) {
        rb_delivery_list_free(recs, n);
        j->cb.records(j->ud, err, NULL, 0);
    } else {
        j->cb.records(j->ud, NULL, recs, n);
    }
}

void mg_submit(mstore *s, mjob *j)
{
    rb_jobpool_submit(s->jobs, &j->pj);
}

void *mg_job_new(mstore *s, size_t size, void (*work)(mjob *, mongoc_client_t *),
                 void (*done)(mjob *, const char *), rb_store_cb cb, void *ud)
{
    mjob *j = rb_calloc(1, size);
    if (!j) return NULL;
    j->pj.work = job_run;
    j->pj.done = job_done;
    j->s = s;
    j->work = work;
    j->done = done;
    j->cb = cb;
    j->ud = ud;
    return j;
}

int mg_jobs_start(mstore *s, char *err, size_t errlen)
{
    rb_jobpool_conf conf = {NWORKERS, thread_start, thread_stop, s};
    char why[200];
    s->jobs = rb_jobpool_new(s->base.loop, &conf, why, sizeof why);
    if (!s->jobs) snprintf(err, errlen, "mongodb: %s", why);
    return s->jobs != NULL;
}

/* ---- server clock and housekeeping ------------------------------------------------------ */
static int hello(mongoc_client_t *c, bson_t *reply, bson_error_t *e)
{
    bson_t cmd = BSON_INITIALIZER;
    BSON_APPEND_INT32(&cmd, "hello", 1);
    int ok = mongoc_client_command_simple(c, "admin", &cmd, NULL, reply, e);
    bson_destroy(&cmd);
    return ok;
}

int mg_read_clock(mstore *s, mongoc_client_t *c, bson_t *reply, bson_error_t *e)
{
    double t0 = rb_monotonic();
    if (!hello(c, reply, e)) return 0;
    double t1 = rb_monotonic();
    bson_iter_t it;
    if (bson_iter_init_find(&it, reply, "localTime") && BSON_ITER_HOLDS_DATE_TIME(&it)) {
        double server = bson_iter_date_time(&it) / 1000.0;
        pthread_mutex_lock(&s->mu);
        s->clock_offset = server - (t0 + t1) / 2;
        s->clock_checked = rb_monotonic();
        pthread_mutex_unlock(&s->mu);
    }
    return 1;
}

static void prune_tickets(mstore *s, mongoc_client_t *c)
{
    mongoc_collection_t *tk = mg_coll(s, c, s->tickets);
    bson_t f = BSON_INITIALIZER, lt;
    BSON_APPEND_DOCUMENT_BEGIN(&f, "at", &lt);
    BSON_APPEND_DOUBLE(&lt, "$lt", mg_now(s) - TICKET_TTL_S);
    bson_append_document_end(&f, &lt);
    mongoc_collection_delete_many(tk, &f, NULL, NULL, NULL);
    bson_destroy(&f);
    mongoc_collection_destroy(tk);
}

/* Failures here are ignored: the old offset stays good and pruning can wait. Pruning is
 * rarer than the clock refresh: FerretDB cannot use the `at` index (it pushes no such filter
 * down), so each prune reads every ticket, two per delivery of the last hour; a ticket that
 * stays a few minutes past its TTL is harmless (its version is long past). */
static void refresh_clock(mstore *s, mongoc_client_t *c)
{
    bson_t reply;
    bson_error_t e;
    mg_read_clock(s, c, &reply, &e);
    bson_destroy(&reply);
    pthread_mutex_lock(&s->mu);
    int prune = s->pruned_at == 0 || rb_monotonic() - s->pruned_at >= PRUNE_EVERY_S;
    if (prune) s->pruned_at = rb_monotonic();
    pthread_mutex_unlock(&s->mu);
    if (prune) {
        prune_tickets(s, c);
        mg_groups_prune(s, c);
    }
}
