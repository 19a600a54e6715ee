/* schedules.c -- durable schedules (store.h, rb_schedule), kept in <table>_schedules: one
 * document per schedule, _id its name, next_at and fired_at in epoch s.
 *
 * A tick is fired without a transaction (the servers this store runs on have none to give):
 * once the schedule is seen to be as the dispatcher read it, the dispatcher takes the tick's
 * ticket ("tick:<name>:<due>" in <table>_tickets: only one can), enqueues its delivery under
 * its dedupe key, then moves next_at on while it is still the tick's. Dispatchers racing for
 * one tick fire it once: the others lose the ticket. (Without it, the key alone deduped
 * only while the first delivery was live: on DocumentDB a tick ran to its end between the
 * two dispatchers' enqueues, and fired twice.) A process that dies after it took the ticket
 * leaves next_at as it was; 60 s later the next dispatcher passes the ticket and fires the
 * tick, which its key dedupes if the first delivery is live. So no tick is lost, and one is
 * enqueued twice only when a dispatcher stalled for over 60 s between its ticket and its
 * move of next_at, and the tick's first run ended meanwhile. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "stores/mongo/mstore.h"
#include "util/alloc.h"

typedef struct sched_job {
    mjob j;
    char *name, *topic, *payload, *cron, *timezone, *key;
    double every, next_at, due;
    rb_enqueue_item tick;       /* a fire's delivery (its strings the job's) */
    int64_t count;
    rb_rowset *rs;
} sched_job;

static void sched_free(sched_job *q)
{
    free(q->name);
    free(q->topic);
    free(q->payload);
    free(q->cron);
    free(q->timezone);
    free(q->key);
    free(q);
}

static sched_job *sched_new(mstore *s, void (*work)(mjob *, mongoc_client_t *),
                            void (*done)(mjob *, const char *), rb_store_cb cb, void *ud)
{
    return mg_job_new(s, sizeof(sched_job), work, done, cb, ud);
}

static int same_text(const char *a, const char *b) { return a == b || (a && b && !strcmp(a, b)); }

/* ---- schedule: make or replace ------------------------------------------------------------ */
static void schedule_work(mjob *j, mongoc_client_t *c)
{
    sched_job *q = (sched_job *)j;
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->schedules);
    bson_t *sel = BCON_NEW("_id", BCON_UTF8(q->name));
    int failed = 0;
    bson_t *old = mg_find_one(j, cl, sel, NULL, &failed);
    double next_at = q->next_at;
    if (old && same_text(mg_doc_str(old, "cron"), q->cron) &&
        same_text(mg_doc_str(old, "timezone"), q->timezone) &&
        (q->cron ? !bson_has_field(old, "every") || mg_doc_num(old, "every") == 0
                 : mg_doc_num(old, "every") == q->every))
        next_at = mg_doc_num(old, "next_at");
    if (!failed) {
        bson_t doc = BSON_INITIALIZER;
        BSON_APPEND_UTF8(&doc, "_id", q->name);
        BSON_APPEND_UTF8(&doc, "topic", q->topic);
        BSON_APPEND_UTF8(&doc, "payload", q->payload);
        if (q->cron) BSON_APPEND_UTF8(&doc, "cron", q->cron);
        else BSON_APPEND_DOUBLE(&doc, "every", q->every);
        if (q->timezone) BSON_APPEND_UTF8(&doc, "timezone", q->timezone);
        BSON_APPEND_DOUBLE(&doc, "next_at", next_at);
        if (old && bson_has_field(old, "fired_at"))
            BSON_APPEND_DOUBLE(&doc, "fired_at", mg_doc_num(old, "fired_at"));
        bson_t *opts = BCON_NEW("upsert", BCON_BOOL(true));
        bson_error_t e;
        if (!mongoc_collection_replace_one(cl, sel, &doc, opts, NULL, &e))
            mg_fail_bson(j, "schedule", &e);
        q->count = !old;
        bson_destroy(opts);
        bson_destroy(&doc);
    }
    if (old) bson_destroy(old);
    bson_destroy(sel);
    mongoc_collection_destroy(cl);
}

static void count_done(mjob *j, const char *err)
{
    sched_job *q = (sched_job *)j;
    j->cb.count(j->ud, err, err ? 0 : q->count);
    sched_free(q);
}

/* A schedule made, changed or removed: this process's dispatchers read them again. */
static void changed_done(mjob *j, const char *err)
{
    sched_job *q = (sched_job *)j;
    if (!err && (j->work == schedule_work || q->count) && !j->s->closing)
        rb_store_schedules_changed(&j->s->base);
    count_done(j, err);
}

void mg_schedule(rb_store *st, const rb_schedule *sch, rb_count_cb cb, void *ud)
{
    sched_job *q = sched_new((mstore *)st, schedule_work, changed_done, (rb_store_cb){.count = cb}, ud);
    if (q) {
        q->name = rb_strdup(sch->name);
        q->topic = rb_strdup(sch->topic);
        q->payload = rb_strdup(sch->payload);
        q->cron = mg_dupstr(sch->cron);
        q->timezone = mg_dupstr(sch->timezone);
        q->every = sch->every;
        q->next_at = sch->next_at;
    }
    if (!q || !q->name || !q->topic || !q->payload || (sch->cron && !q->cron) ||
        (sch->timezone && !q->timezone)) {
        if (q) sched_free(q);
        cb(ud, MG_OOM, 0);
        return;
    }
    mg_submit((mstore *)st, &q->j);
}

/* ---- unschedule ------------------------------------------------------------------------------ */
static void unschedule_work(mjob *j, mongoc_client_t *c)
{
    sched_job *q = (sched_job *)j;
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->schedules);
    bson_t *sel = BCON_NEW("_id", BCON_UTF8(q->name));
    bson_t reply;
    bson_error_t e;
    if (mongoc_collection_delete_one(cl, sel, NULL, &reply, &e))
        q->count = mg_doc_int(&reply, "deletedCount");
    else
        mg_fail_bson(j, "unschedule", &e);
    bson_destroy(&reply);
    bson_destroy(sel);
    mongoc_collection_destroy(cl);
}

void mg_unschedule(rb_store *st, const char *name, rb_count_cb cb, void *ud)
{
    sched_job *q = sched_new((mstore *)st, unschedule_work, changed_done, (rb_store_cb){.count = cb}, ud);
    if (!q || !(q->name = rb_strdup(name ? name : ""))) {
        if (q) sched_free(q);
        cb(ud, MG_OOM, 0);
        return;
    }
    mg_submit((mstore *)st, &q->j);
}

/* ---- schedules: the list ------------------------------------------------------------------- */
static const char *const COLS[] = {"name", "topic", "payload", "cron", "every", "timezone",
                                   "next_at", "fired_at"};
#define NCOLS 8

static int put_text(rb_value *v, const char *s)
{
    if (!s) return 1;       /* RB_VNULL */
    if (!(v->s = rb_strdup(s))) return 0;
    v->type = RB_VTEXT;
    v->len = strlen(s);
    return 1;
}

static void put_num(rb_value *v, const bson_t *d, const char *field)
{
    if (!bson_has_field(d, field)) return;
    v->type = RB_VFLOAT;
    v->f = mg_doc_num(d, field);
}

static rb_rowset *schedules_rowset(bson_t *const *docs, size_t n)
{
    rb_rowset *rs = rb_calloc(1, sizeof *rs);
    if (!rs) return NULL;
    rs->names = rb_calloc(NCOLS, sizeof *rs->names);
    rs->vals = rb_calloc(NCOLS * n + 1, sizeof *rs->vals);
    if (!rs->names || !rs->vals) { rb_rowset_free(rs); return NULL; }
    rs->ncols = NCOLS;
    for (int c = 0; c < NCOLS; c++)
        if (!(rs->names[c] = rb_strdup(COLS[c]))) { rb_rowset_free(rs); return NULL; }
    for (size_t i = 0; i < n; i++) {
        const bson_t *d = docs[i];
        const char *name = mg_doc_str(d, "_id");
        if (!name) continue;    /* (an _id that is no string: not a schedule) */
        rb_value *v = &rs->vals[rs->nrows * NCOLS];
        rs->nrows++;            /* counted first: the rowset frees what the row holds */
        if (!put_text(&v[0], name) || !put_text(&v[1], mg_doc_str(d, "topic")) ||
            !put_text(&v[2], mg_doc_str(d, "payload")) || !put_text(&v[3], mg_doc_str(d, "cron")) ||
            !put_text(&v[5], mg_doc_str(d, "timezone"))) {
            rb_rowset_free(rs);
            return NULL;
        }
        put_num(&v[4], d, "every");
        put_num(&v[6], d, "next_at");
        put_num(&v[7], d, "fired_at");
    }
    return rs;
}

static void schedules_work(mjob *j, mongoc_client_t *c)
{
    sched_job *q = (sched_job *)j;
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->schedules);
    bson_t f = BSON_INITIALIZER;
    bson_t *opts = BCON_NEW("sort", "{", "_id", BCON_INT32(1), "}",
                            "limit", BCON_INT64(RB_SCHEDULES_MAX));
    bson_t **docs = NULL;
    size_t n = 0;
    if (mg_find_docs(j, cl, &f, opts, NULL, &docs, &n) == 0 && !(q->rs = schedules_rowset(docs, n)))
        mg_fail(j, "out of memory");
    mg_docs_free(docs, n);
    bson_destroy(&f);
    bson_destroy(opts);
    mongoc_collection_destroy(cl);
}

static void rows_done(mjob *j, const char *err)
{
    sched_job *q = (sched_job *)j;
    rb_rowset *rs = err ? NULL : q->rs;
    if (err) rb_rowset_free(q->rs);
    rb_rows_cb cb = j->cb.rows;
    void *ud = j->ud;
    sched_free(q);
    cb(ud, err, rs);
}

void mg_schedules(rb_store *st, rb_rows_cb cb, void *ud)
{
    sched_job *q = sched_new((mstore *)st, schedules_work, rows_done, (rb_store_cb){.rows = cb}, ud);
    if (!q) { cb(ud, MG_OOM, NULL); return; }
    mg_submit((mstore *)st, &q->j);
}

/* ---- fire: the enqueue, then next_at moved on -------------------------------------------------- */
static void advance_work(mjob *j, mongoc_client_t *c)
{
    sched_job *q = (sched_job *)j;
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->schedules);
    bson_t *sel = BCON_NEW("_id", BCON_UTF8(q->name), "next_at", BCON_DOUBLE(q->due),
                           "topic", BCON_UTF8(q->topic), "payload", BCON_UTF8(q->payload));
    bson_t *upd = BCON_NEW("$set", "{", "next_at", BCON_DOUBLE(q->next_at), "fired_at",
                           BCON_DOUBLE(mg_now(j->s)), "}");
    bson_t reply;
    bson_error_t e;
    if (mongoc_collection_update_one(cl, sel, upd, NULL, &reply, &e))
        q->count = mg_doc_int(&reply, "modifiedCount");
    else
        mg_fail_bson(j, "schedule fire", &e);
    bson_destroy(&reply);
    bson_destroy(sel);
    bson_destroy(upd);
    mongoc_collection_destroy(cl);
}

/* The tick's delivery is in (or another dispatcher's was, found by its key: that one may
 * have died before its second write): next_at moves on. */
static void on_tick_enqueued(void *ud, const char *err, char **ids, const unsigned char *kept,
                             size_t n)
{
    (void)ids; (void)kept;
    sched_job *q = ud;
    const char *why = err ? err : q->j.s->closing ? MG_STORE_CLOSED : n != 1 ? "mongodb: the "
                      "tick's enqueue gave no id" : NULL;
    if (why) {
        rb_count_cb cb = q->j.cb.count;
        void *cud = q->j.ud;
        char copy[ERRLEN];
        snprintf(copy, sizeof copy, "%s", why);
        sched_free(q);
        cb(cud, copy, 0);
        return;
    }
    mg_submit(q->j.s, &q->j);
}

/* Inserts the ticket `id` (1: taken); *stale when another holds it since STALE_TICKET_S. */
static int tick_ticket(mjob *j, mongoc_collection_t *tk, const char *id, const char *owner,
                       double now, int *stale)
{
    bson_t *t = BCON_NEW("_id", BCON_UTF8(id), "d", BCON_UTF8(owner), "at", BCON_DOUBLE(now));
    bson_error_t e;
    int took = mongoc_collection_insert_one(tk, t, NULL, NULL, &e);
    bson_destroy(t);
    *stale = 0;
    if (took) return 1;
    if (e.code != 11000) {
        mg_fail_bson(j, "schedule fire: ticket", &e);
        return 0;
    }
    bson_t *sel = BCON_NEW("_id", BCON_UTF8(id));
    int failed = 0;
    bson_t *held = mg_find_one(j, tk, sel, NULL, &failed);
    *stale = held && mg_doc_num(held, "at") < now - STALE_TICKET_S;
    if (held) bson_destroy(held);
    bson_destroy(sel);
    return 0;
}

/* Of the dispatchers that found a tick due, the one that inserts its ticket (tickets.c: an
 * insert with a unique _id, which only one can) fires it. A ticket 60 s old whose tick is
 * still due (its holder died before next_at moved) is passed as a write's is: by the one
 * that inserts the next ticket "<ticket>.<k>", so dispatchers passing it at once fire it
 * once. 1: fire. */
static int take_tick(mjob *j, mongoc_client_t *c, sched_job *q)
{
    size_t n = strlen(q->name) + 64;
    char *id = rb_malloc(n), *owner = rb_malloc(n);
    if (!id || !owner) {
        free(id); free(owner);
        mg_fail(j, MG_OOM);
        return 0;
    }
    snprintf(owner, n, "tick:%s", q->name);
    snprintf(id, n, "tick:%s:%.17g", q->name, q->due);
    double now = mg_now(j->s);
    mongoc_collection_t *tk = mg_coll(j->s, c, j->s->tickets);
    int stale, fire = tick_ticket(j, tk, id, owner, now, &stale);
    size_t base = strlen(id);
    for (int k = 1; !fire && stale && k <= 16; k++) {   /* 16 dead holders in a row at most */
        snprintf(id + base, n - base, ".%d", k);
        fire = tick_ticket(j, tk, id, owner, now, &stale);
    }
    mongoc_collection_destroy(tk);
    free(id);
    free(owner);
    return fire;
}

/* The schedule as the dispatcher read it (its next_at the tick's, its topic and payload)? */
static void check_work(mjob *j, mongoc_client_t *c)
{
    sched_job *q = (sched_job *)j;
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->schedules);
    bson_t *sel = BCON_NEW("_id", BCON_UTF8(q->name), "next_at", BCON_DOUBLE(q->due),
                           "topic", BCON_UTF8(q->topic), "payload", BCON_UTF8(q->payload));
    int failed = 0;
    bson_t *doc = mg_find_one(j, cl, sel, NULL, &failed);
    q->count = doc != NULL;
    if (doc) bson_destroy(doc);
    bson_destroy(sel);
    mongoc_collection_destroy(cl);
    if (q->count) q->count = take_tick(j, c, q);
}

/* Still due: the enqueue, then the move of next_at (advance_work); else nothing to fire. */
static void check_done(mjob *j, const char *err)
{
    sched_job *q = (sched_job *)j;
    if (err || !q->count || j->s->closing) {
        count_done(j, err ? err : j->s->closing ? MG_STORE_CLOSED : NULL);
        return;
    }
    q->count = 0;
    j->work = advance_work;
    j->done = count_done;
    mg_enqueue(&j->s->base, &q->tick, 1, on_tick_enqueued, q);
}

void mg_schedule_fire(rb_store *st, const char *name, double due, double next,
                      const rb_enqueue_item *tick, rb_count_cb cb, void *ud)
{
    sched_job *q = sched_new((mstore *)st, check_work, check_done, (rb_store_cb){.count = cb}, ud);
    if (q) {
        q->name = rb_strdup(name);
        q->topic = rb_strdup(tick->topic);
        q->payload = rb_strdup(tick->payload);
        q->key = rb_strdup(tick->key);
        q->due = due;
        q->next_at = next;
        q->tick = *tick;
        q->tick.topic = q->topic;
        q->tick.payload = q->payload;
        q->tick.key = q->key;
        q->tick.group = NULL;
    }
    if (!q || !q->name || !q->topic || !q->payload || !q->key) {
        if (q) sched_free(q);
        cb(ud, MG_OOM, 0);
        return;
    }
    mg_submit((mstore *)st, &q->j);
}
