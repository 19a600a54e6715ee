/* settle.c -- the MongoDB store's settle: each op is a fenced write through a ticket (tickets.c),
 * and on FerretDB the version our claim cached (vcache.c) spares the read before it. And a
 * run's progress, fenced by its lease in one update. */
#include <stdlib.h>
#include <string.h>
#include "stores/mongo/mstore.h"
#include "util/alloc.h"
#include "util/log.h"

typedef struct settle_job {
    mjob j;
    rb_settle_op *ops;
    size_t n;
} settle_job;

/* The runs of limited topics among round[0..m) have ended, written or not (limits.c): their
 * slots go, so the next may start before the lease would have ended. A failure only keeps a
 * slot until its lease ends, and j's outcome stays what it was. */
static void give_back_slots(mjob *j, mongoc_client_t *c, rb_settle_op **round, size_t m)
{
    char kept[ERRLEN];
    memcpy(kept, j->err, sizeof kept);
    for (size_t i = 0; i < m; i++) {
        if (round[i]->kind == RB_OP_EXTEND || !round[i]->token) continue;
        char *topic = mg_limits_ended(j->s, round[i]->token);
        if (!topic) continue;
        char *tok = (char *)round[i]->token;
        j->err[0] = 0;
        if (mg_limits_give_back(j, c, topic, &tok, 1) < 0)
            rb_log(RB_LOG_WARN, "mongodb: limits: %s (the slot ends with its lease)", j->err);
        else
            j->released = 1;    /* another of the topic may start: a dispatcher here claims */
        free(topic);
    }
    memcpy(j->err, kept, sizeof kept);
}

/* One round: ops on distinct deliveries, each read, then written through its ticket. The
 * round holds its deliveries (busy.c) from the read until the version cache has the write, so
 * that another job of ours on one of them (a renewal beside ctx:extend_lease) waits instead of
 * taking its ticket. */
static int settle_round(mjob *j, mongoc_client_t *c, rb_settle_op **round, size_t m)
{
    mg_busy *held = rb_calloc(m, sizeof *held);
    if (!held) {
        mg_fail(j, "out of memory");
        return -1;
    }
    for (size_t i = 0; i < m; i++) held[i].key = round[i]->id;
    mg_busy_take(j->s, held, m);
    double now = mg_now(j->s);      /* after any wait for another job's write */
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->base.table);
    cas_op *cas = rb_calloc(m, sizeof *cas);
    rb_settle_op **mine = rb_calloc(m, sizeof *mine);
    int64_t *att = rb_calloc(m, sizeof *att), *qg = rb_calloc(m, sizeof *qg);
    double *ext = rb_calloc(m, sizeof *ext);   /* EXTEND: the expiry written */
    size_t k = 0;
    int r = (cas && mine && att && qg && ext) ? 0 : -1;
    for (size_t i = 0; r == 0 && i < m; i++) {
        int ok, failed = 0;
        int64_t g = -1;
        bson_t *sel = mg_oid_sel(round[i]->id, &ok);
        bson_t *d = ok ? mg_vc_doc(j->s, round[i]->id, round[i]->token, &g) : NULL;
        if (d && mg_settle_needs_doc(round[i])) {
            /* a failure's error joins the document's errors: that needs all of it */
            bson_destroy(d);
            d = NULL;
        }
        if (ok && !d) d = mg_find_one(j, cl, sel, NULL, &failed);
        bson_destroy(sel);
        if (failed) r = -1;
        else if (d && mg_holds_lease(d, round[i]->token)) {
            mg_cas_init(j->s, &cas[k], d, "d", mg_upd_settle(d, round[i], now));
            ext[k] = mg_extended(d, "lease_expires_at", now, round[i]->delay);
            att[k] = mg_doc_int(d, "attempts");
            qg[k] = g;
            mine[k++] = round[i];
        }
        if (d) bson_destroy(d);
    }
    mongoc_collection_destroy(cl);
    if (r == 0) r = mg_cas_run(j, c, j->s->base.table, cas, k, now);
    mongoc_collection_t *qc = NULL;
    qbatch qb;
    for (size_t i = 0; r == 0 && i < k; i++) {
        mine[i]->applied = cas[i].won;
        if (cas[i].won && mine[i]->kind == RB_OP_EXTEND) {
            mine[i]->lease_expires_at = ext[i];
            mg_vc_put(j->s, mine[i]->id, mine[i]->token, cas[i].old_v + 1, att[i], qg[i], ext[i]);
            continue;
        }
        mg_vc_drop(j->s, mine[i]->id);
        /* Settled for good: the entry our claim left goes now (FerretDB; qg is known only
         * there). A kick writes a new entry of another generation first, so this one is never
         * a live delivery's last; one missed here is removed by the claim that reads it. */
        if (cas[i].won && qg[i] >= 0 &&
            (mine[i]->kind == RB_OP_COMPLETE || mine[i]->kind == RB_OP_BURY)) {
            if (!qc) mg_qb_init(&qb, qc = mg_coll(j->s, c, j->s->queue));
            mg_qb_drop(&qb, mine[i]->id, qg[i]);
        }
    }
    if (qc) {
        mg_qb_run(j, &qb, 0);
        mongoc_collection_destroy(qc);
    }
    /* settled for good: the deliveries after them (deps.c) */
    char **gone = r == 0 ? rb_calloc(k ? k : 1, sizeof *gone) : NULL;
    size_t ngone = 0;
    for (size_t i = 0; gone && i < k; i++)
        if (cas[i].won && (mine[i]->kind == RB_OP_COMPLETE || mine[i]->kind == RB_OP_BURY))
            gone[ngone++] = (char *)mine[i]->id;

    for (size_t i = 0; r < 0 && i < k; i++) mg_vc_drop(j->s, mine[i]->id);
    mg_busy_give(j->s, held, m);     /* last: the version cache is up to date now */
    free(held);
    if (ngone) mg_deps_after_write(j, c, MG_DEPS_SETTLED, gone, ngone);
    free(gone);
    give_back_slots(j, c, round, m);
    if (cas) mg_cas_free(cas, k);
    free(mine);
    free(att);
    free(qg);
    free(ext);
    if (r < 0 && !j->err[0]) mg_fail(j, "out of memory");
    return r;
}

/* The ids of the round being built: a small open-addressing set, since a batch holds hundreds
 * of ops and comparing each with all before it cost more than the round (as store_pg.c). */
typedef struct idset {
    const char **slot;
    size_t cap;                 /* a power of two, at least twice the ops */
} idset;

static int idset_init(idset *set, size_t n)
{
    set->cap = 16;
    while (set->cap < 2 * n) set->cap *= 2;
    set->slot = rb_calloc(set->cap, sizeof *set->slot);
    return set->slot != NULL;
}

/* 1: id was added; 0: the round has it already. */
static int idset_add(idset *set, const char *id)
{
    size_t h = 2166136261u;
    for (const char *p = id; *p; p++) h = (h ^ (unsigned char)*p) * 16777619u;
    for (h &= set->cap - 1; set->slot[h]; h = (h + 1) & (set->cap - 1))
        if (strcmp(set->slot[h], id) == 0) return 0;
    set->slot[h] = id;
    return 1;
}

/* The next round: the first op not yet run of each delivery (an op without id always). */
static size_t next_round(settle_job *q, char *done, idset *set, rb_settle_op **round)
{
    size_t m = 0;
    memset(set->slot, 0, set->cap * sizeof *set->slot);
    for (size_t i = 0; i < q->n; i++) {
        if (done[i] || (q->ops[i].id && !idset_add(set, q->ops[i].id))) continue;
        round[m++] = &q->ops[i];
        done[i] = 1;
    }
    return m;
}

/* Ops on one delivery run in order, one per round; ops on distinct ones share a round. */
static void settle_work(mjob *j, mongoc_client_t *c)
{
    settle_job *q = (settle_job *)j;
    char *done = rb_calloc(q->n, 1);
    rb_settle_op **round = rb_calloc(q->n, sizeof *round);
    idset set = {NULL, 0};
    if (!done || !round || !idset_init(&set, q->n)) {
        mg_fail(j, "out of memory");
        free(done); free(round);
        return;
    }
    for (size_t i = 0; i < q->n; i++) q->ops[i].applied = 0;
    for (size_t left = q->n; left > 0;) {
        size_t m = next_round(q, done, &set, round);
        left -= m;
        if (settle_round(j, c, round, m) < 0) break;
    }
    free(set.slot);
    free(done);
    free(round);
}

static void settle_done(mjob *j, const char *err)
{
    j->cb.done(j->ud, err);
    free(j);
}

void mg_settle(rb_store *st, rb_settle_op *ops, size_t n, rb_done_cb cb, void *ud)
{
    mstore *s = (mstore *)st;
    if (n == 0) {
        cb(ud, NULL);
        return;
    }
    settle_job *q = mg_job_new(s, sizeof *q, settle_work, settle_done, (rb_store_cb){.done = cb}, ud);
    if (!q) {
        cb(ud, MG_OOM);
        return;
    }
    q->ops = ops;
    q->n = n;
    mg_submit(s, &q->j);
}

/* ---- progress ------------------------------------------------------------------------------ */
typedef struct progress_job {
    mjob j;
    char *id, *token, *json;
    int64_t written;
} progress_job;

/* One update whose filter is the lease: { _id, status processing, lease_token }. It leaves the
 * document's version alone (the field is no settle's business, and the version cache of the
 * run's claim stays right); on FerretDB 1.x, whose updates are no atomic compare-and-set, a
 * progress racing a takeover may land after it, on the progress field alone. */
static void progress_work(mjob *j, mongoc_client_t *c)
{
    progress_job *q = (progress_job *)j;
    bson_oid_t oid;
    if (!mg_parse_oid(q->id, &oid)) return;
    bson_t *sel = BCON_NEW("_id", BCON_OID(&oid), "status", BCON_UTF8("processing"),
                           "lease_token", BCON_UTF8(q->token));
    bson_t upd = BSON_INITIALIZER, set;
    BSON_APPEND_DOCUMENT_BEGIN(&upd, "$set", &set);
    int ok = mg_json_append(&set, "progress", "progress_format", q->json, j->s->ferretdb);
    bson_append_document_end(&upd, &set);
    if (!ok) {
        mg_fail(j, "progress: not JSON");
    } else {
        mongoc_collection_t *cl = mg_coll(j->s, c, j->s->base.table);
        bson_t reply;
        bson_error_t e;
        if (mongoc_collection_update_one(cl, sel, &upd, NULL, &reply, &e))
            q->written = mg_doc_int(&reply, "matchedCount") > 0;
        else
            mg_fail_bson(j, "progress", &e);
        bson_destroy(&reply);
        mongoc_collection_destroy(cl);
    }
    bson_destroy(&upd);
    bson_destroy(sel);
}

static void progress_done(mjob *j, const char *err)
{
    progress_job *q = (progress_job *)j;
    j->cb.count(j->ud, err, err ? 0 : q->written);
    free(q->id);
    free(q->token);
    free(q->json);
    free(q);
}

void mg_progress(rb_store *st, rb_tx *tx, const char *id, const char *token, const char *json,
                 rb_count_cb cb, void *ud)
{
    (void)tx;       /* written apart, at once, like every fenced write here */
    progress_job *q = mg_job_new((mstore *)st, sizeof *q, progress_work, progress_done,
                                 (rb_store_cb){.count = cb}, ud);
    if (!q) {
        cb(ud, MG_OOM, 0);
        return;
    }
    q->id = rb_strdup(id ? id : "");
    q->token = rb_strdup(token ? token : "");
    q->json = rb_strdup(json ? json : "null");
    if (!q->id || !q->token || !q->json) {
        progress_done(&q->j, MG_OOM);
        return;
    }
    mg_submit((mstore *)st, &q->j);
}
