/* admin.c -- the MongoDB store's reads and maintenance: get, list, stats, kick, purge, and
 * the operator's bury one and remove one (operator.c has topic_stats). */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "stores/mongo/mstore.h"
#include "util/alloc.h"

/* ---- get, list -------------------------------------------------------------------------- */
typedef struct rec_job {
    mjob j;
    char *id, *status, *topic, *after;
    char *key, *prefix, *errtext;   /* a list's search, or NULL */
    int newest;                 /* a viewer's page: by _id, newest first, older than after */
    size_t limit;
    rb_delivery **recs;
    size_t nrecs;
} rec_job;

static void recs_from_docs(rec_job *q, bson_t **docs, size_t n)
{
    q->recs = rb_calloc(n ? n : 1, sizeof *q->recs);
    for (size_t i = 0; q->recs && i < n; i++) {
        rb_delivery *r = mg_record_from(docs[i], NULL);
        if (r) q->recs[q->nrecs++] = r;
    }
    if (!q->recs) mg_fail(&q->j, "out of memory");
}

static void get_work(mjob *j, mongoc_client_t *c)
{
    rec_job *q = (rec_job *)j;
    int ok, failed = 0;
    bson_t *sel = mg_oid_sel(q->id, &ok);
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->base.table);
    bson_t *d = ok ? mg_find_one(j, cl, sel, NULL, &failed) : NULL;   /* not an id: not found */
    mongoc_collection_destroy(cl);
    bson_destroy(sel);
    if (!failed) recs_from_docs(q, d ? &d : NULL, d ? 1 : 0);
    if (d) bson_destroy(d);
}

/* A regular expression that matches `text` literally, after `head` ("^" for a prefix). */
static char *literal_regex(const char *head, const char *text)
{
    size_t n = strlen(text), k = strlen(head);
    char *re = rb_malloc(k + 2 * n + 1);
    if (!re) return NULL;
    memcpy(re, head, k);
    for (const char *p = text; *p; p++) {
        if (strchr("\\^$.|?*+()[]{}", *p)) re[k++] = '\\';
        re[k++] = *p;
    }
    re[k] = 0;
    return re;
}

/* Adds {field: {$regex: re}}; 0 when out of memory. */
static int add_regex(bson_t *f, const char *field, const char *head, const char *text)
{
    char *re = literal_regex(head, text);
    if (!re) return 0;
    bson_t r;
    BSON_APPEND_DOCUMENT_BEGIN(f, field, &r);
    BSON_APPEND_UTF8(&r, "$regex", re);
    bson_append_document_end(f, &r);
    free(re);
    return 1;
}

static void list_work(mjob *j, mongoc_client_t *c)
{
    rec_job *q = (rec_job *)j;
    bson_t f = BSON_INITIALIZER, opts = BSON_INITIALIZER, sort;
    if (q->status) BSON_APPEND_UTF8(&f, "status", q->status);
    if (q->topic) BSON_APPEND_UTF8(&f, "topic", q->topic);
    if (q->key) BSON_APPEND_UTF8(&f, "key", q->key);
    /* no stored string holds bytes that are not UTF-8: nothing matches them (and the server
     * would refuse the expression, quoting them) */
    if ((q->prefix && !bson_utf8_validate(q->prefix, strlen(q->prefix), false)) ||
        (q->errtext && !bson_utf8_validate(q->errtext, strlen(q->errtext), false))) {
        bson_destroy(&f);
        bson_destroy(&opts);
        recs_from_docs(q, NULL, 0);
        return;
    }
    if ((q->prefix && !add_regex(&f, "topic", "^", q->prefix)) ||
        (q->errtext && !add_regex(&f, "last_error", "", q->errtext))) {
        bson_destroy(&f);
        bson_destroy(&opts);
        mg_fail(j, "out of memory");
        return;
    }
    if (q->newest && q->after) {
        bson_oid_t oid;
        bson_t lt;
        if (!mg_parse_oid(q->after, &oid)) {     /* no id of this store: an empty page */
            bson_destroy(&f);
            bson_destroy(&opts);
            recs_from_docs(q, NULL, 0);
            return;
        }
        BSON_APPEND_DOCUMENT_BEGIN(&f, "_id", &lt);
        BSON_APPEND_OID(&lt, "$lt", &oid);
        bson_append_document_end(&f, &lt);
    }
    BSON_APPEND_DOCUMENT_BEGIN(&opts, "sort", &sort);
    if (q->newest) {
        BSON_APPEND_INT32(&sort, "_id", -1);
    } else {
        BSON_APPEND_INT32(&sort, "created_at", 1);
        BSON_APPEND_INT32(&sort, "_id", 1);
    }
    bson_append_document_end(&opts, &sort);
    BSON_APPEND_INT64(&opts, "limit", (int64_t)(q->limit ? q->limit : 100));
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->base.table);
    bson_t **docs = NULL;
    size_t n = 0;
    if (mg_find_docs(j, cl, &f, &opts, NULL, &docs, &n) == 0) recs_from_docs(q, docs, n);
    mg_docs_free(docs, n);
    mongoc_collection_destroy(cl);
    bson_destroy(&f);
    bson_destroy(&opts);
}

static void rec_done(mjob *j, const char *err)
{
    rec_job *q = (rec_job *)j;
    mg_answer_records(j, err, q->recs, q->nrecs);
    free(q->id); free(q->status); free(q->topic); free(q->after);
    free(q->key); free(q->prefix); free(q->errtext);
    free(q);
}

void mg_get(rb_store *st, const char *id, rb_records_cb cb, void *ud)
{
    rec_job *q = mg_job_new((mstore *)st, sizeof *q, get_work, rec_done, (rb_store_cb){.records = cb}, ud);
    if (!q) {
        cb(ud, MG_OOM, NULL, 0);
        return;
    }
    if (!(q->id = rb_strdup(id ? id : ""))) {
        rec_done(&q->j, MG_OOM);
        return;
    }
    mg_submit((mstore *)st, &q->j);
}

void mg_list(rb_store *st, const rb_list_req *req, rb_records_cb cb, void *ud)
{
    rec_job *q = mg_job_new((mstore *)st, sizeof *q, list_work, rec_done, (rb_store_cb){.records = cb}, ud);
    if (!q) {
        cb(ud, MG_OOM, NULL, 0);
        return;
    }
    q->status = mg_dupstr(req ? req->status : NULL);
    q->topic = mg_dupstr(req ? req->topic : NULL);
    q->limit = req ? req->limit : 0;
    q->newest = req && req->newest_first;
    q->after = mg_dupstr(q->newest ? req->after : NULL);
    q->key = mg_dupstr(req ? req->key : NULL);
    q->prefix = mg_dupstr(req ? req->topic_prefix : NULL);
    q->errtext = mg_dupstr(req ? req->error_text : NULL);
    if ((req && req->status && !q->status) || (req && req->topic && !q->topic) ||
        (q->newest && req->after && !q->after) || (req && req->key && !q->key) ||
        (req && req->topic_prefix && !q->prefix) || (req && req->error_text && !q->errtext)) {
        rec_done(&q->j, MG_OOM);
        return;
    }
    mg_submit((mstore *)st, &q->j);
}

/* ---- stats ------------------------------------------------------------------------------ */
typedef struct stats_job {
    mjob j;
    rb_stats st;
} stats_job;

static int stats_by_status(stats_job *q, mongoc_collection_t *cl)
{
    bson_t *pipe = BCON_NEW("pipeline", "[", "{", "$group", "{", "_id", BCON_UTF8("$status"),
                            "n", "{", "$sum", BCON_INT32(1), "}", "}", "}", "]");
    mongoc_cursor_t *cur = mongoc_collection_aggregate(cl, MONGOC_QUERY_NONE, pipe, NULL, NULL);
    const bson_t *d;
    bson_error_t e;
    while (mongoc_cursor_next(cur, &d)) {
        const char *st = mg_doc_str(d, "_id");
        int64_t n = mg_doc_int(d, "n");
        switch (rb_status_parse(st)) {
        case RB_PENDING: q->st.pending = n; break;
        case RB_PROCESSING: q->st.processing = n; break;
        case RB_COMPLETED: q->st.completed = n; break;
        case RB_BURIED: q->st.buried = n; break;
        case RB_CANCELLED: q->st.cancelled = n; break;
        default: break;
        }
    }
    int failed = mongoc_cursor_error(cur, &e);
    if (failed) mg_fail_bson(&q->j, "stats", &e);
    mongoc_cursor_destroy(cur);
    bson_destroy(pipe);
    return failed ? -1 : 0;
}

/* The earliest moment a due delivery became due, among pending (run_at) or expired (lease). */
static int stats_oldest(stats_job *q, mongoc_collection_t *cl, const char *status,
                        const char *field, double now, double *oldest)
{
    bson_t f = BSON_INITIALIZER, opts = BSON_INITIALIZER, sort;
    BSON_APPEND_UTF8(&f, "status", status);
    mg_append_range(&f, field, "$lte", now);
    BSON_APPEND_DOCUMENT_BEGIN(&opts, "sort", &sort);
    BSON_APPEND_INT32(&sort, field, 1);
    bson_append_document_end(&opts, &sort);
    BSON_APPEND_INT64(&opts, "limit", 1);
    bson_t **v = NULL;
    size_t n = 0;
    int failed = mg_find_docs(&q->j, cl, &f, &opts, NULL, &v, &n) < 0;
    for (size_t i = 0; i < n; i++) {
        if (i == 0 && mg_doc_num(v[i], field) < *oldest) *oldest = mg_doc_num(v[i], field);
        bson_destroy(v[i]);
    }
    free(v);
    bson_destroy(&f);
    bson_destroy(&opts);
    return failed ? -1 : 0;
}

static void stats_work(mjob *j, mongoc_client_t *c)
{
    stats_job *q = (stats_job *)j;
    double now = mg_now(j->s), oldest = INFINITY;
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->base.table);
    bson_t f = BSON_INITIALIZER;
    bson_error_t e;
    mg_append_due(&f, now);
    if (stats_by_status(q, cl) == 0) {
        int64_t due = mongoc_collection_count_documents(cl, &f, NULL, NULL, NULL, &e);
        bson_t sf = BSON_INITIALIZER;   /* processing, its lease over (or none) */
        BSON_APPEND_UTF8(&sf, "status", "processing");
        mg_append_range(&sf, "lease_expires_at", "$lte", now);
        int64_t stalled = due < 0 ? 0 : mongoc_collection_count_documents(cl, &sf, NULL, NULL, NULL, &e);
        bson_destroy(&sf);
        if (due < 0 || stalled < 0) mg_fail_bson(j, "stats", &e);
        else if (stats_oldest(q, cl, "pending", "run_at", now, &oldest) == 0 &&
                 stats_oldest(q, cl, "processing", "lease_expires_at", now, &oldest) == 0) {
            q->st.due = due;
            q->st.oldest_due_age = isfinite(oldest) && due > 0 ? now - oldest : 0;
            q->st.stalled = stalled;
        }
    }
    bson_destroy(&f);
    mongoc_collection_destroy(cl);
}

static void stats_done(mjob *j, const char *err)
{
    stats_job *q = (stats_job *)j;
    j->cb.stats(j->ud, err, err ? NULL : &q->st);
    free(q);
}

void mg_stats(rb_store *st, rb_stats_cb cb, void *ud)
{
    stats_job *q = mg_job_new((mstore *)st, sizeof *q, stats_work, stats_done,
                              (rb_store_cb){.stats = cb}, ud);
    if (q) mg_submit((mstore *)st, &q->j);
    else cb(ud, MG_OOM, NULL);
}

/* ---- kick, purge ------------------------------------------------------------------------ */
typedef struct count_job {
    mjob j;
    rb_kick_mode mode;
    char *id, *status;
    char *topic;                /* kick all buried: of this topic only, or NULL */
    char *reason;               /* bury or cancel one */
    char *token;                /* cancel one: the lease of the run it cancelled */
    char *cancel_status;        /* cancel_all: pending or processing only, or NULL: both */
    char **runs;                /* cancel_all: id and lease token of each run it cancelled */
    size_t nruns;
    double older_than;
    size_t limit;
    int64_t count;
} count_job;

/* When a kicked delivery falls due: now, or, when an operator buried it while it ran, when
 * that run's lease ends (mg_upd_end_live kept it): the run never outlives it. */
static double kick_due(const bson_t *cur, double now)
{
    double lease_end = mg_doc_num(cur, "lease_expires_at");
    return lease_end > now ? lease_end : now;
}

/* gprev: the live delivery of its group it is held behind (groups.c), or NULL */
static bson_t *upd_kick(const bson_t *cur, double now, int with_dedupe, const char *gprev)
{
    bson_t *u = bson_new(), set, un;
    BSON_APPEND_DOCUMENT_BEGIN(u, "$set", &set);
    BSON_APPEND_UTF8(&set, "status", "pending");
    BSON_APPEND_INT32(&set, "attempts", 0);
    BSON_APPEND_DOUBLE(&set, "run_at", gprev ? MG_HELD_RUN_AT : kick_due(cur, now));
    if (gprev) {
        BSON_APPEND_DOUBLE(&set, "held_run_at", kick_due(cur, now));
        BSON_APPEND_UTF8(&set, "gprev", gprev);
    }
    /* kept until it is over: a bury and kick again keep the wait */
    BSON_APPEND_DOUBLE(&set, "lease_expires_at", kick_due(cur, now) > now ? kick_due(cur, now) : 0);
    BSON_APPEND_INT64(&set, "v", mg_doc_int(cur, "v") + 1);
    const char *key = mg_doc_str(cur, "key"), *topic = mg_doc_str(cur, "topic");
    if (with_dedupe && key && topic) {
        char *dd = mg_dedupe_value(topic, key);
        if (dd) BSON_APPEND_UTF8(&set, "dedupe", dd);
        free(dd);
    }
    bson_append_document_end(u, &set);
    BSON_APPEND_DOCUMENT_BEGIN(u, "$unset", &un);
    BSON_APPEND_UTF8(&un, "settled_at", "");
    /* a kicked one runs whatever its dependencies (deps.c): held no more, unless behind
     * the live one of its group */
    BSON_APPEND_UTF8(&un, "waiting", "");
    BSON_APPEND_UTF8(&un, "after", "");
    BSON_APPEND_UTF8(&un, "kick_at", "");
    if (!gprev) {
        BSON_APPEND_UTF8(&un, "held_run_at", "");
        BSON_APPEND_UTF8(&un, "gprev", "");
    }
    bson_append_document_end(u, &un);
    return u;
}

/* Kicks (or deletes) the given documents; returns how many changed, -1 on failure. A kicked
 * delivery whose topic and key another live delivery holds now goes back without its key's
 * dedupe rather than not at all. */
static void free_held(char **held, size_t n)
{
    for (size_t i = 0; i < n; i++) free(held[i]);
    free(held);
}

/* The grouped ones among docs[0..n) flagged as being kicked (kick_at, groups.c), each
 * through the versioned write, and read again (their version changed); one whose flag lost
 * to another write is left out (docs[i] NULL: not kicked now). -1: j failed. */
static int flag_kicks(mjob *j, mongoc_client_t *c, bson_t **docs, size_t n, double now)
{
    cas_op *ops = rb_calloc(n ? n : 1, sizeof *ops);
    size_t *at = rb_calloc(n ? n : 1, sizeof *at), m = 0;
    int r = ops && at ? 0 : -1;
    if (r < 0) mg_fail(j, MG_OOM);
    for (size_t i = 0; r == 0 && i < n; i++) {
        if (!docs[i] || !bson_has_field(docs[i], "group")) continue;
        mg_cas_init(j->s, &ops[m], docs[i], "d", BCON_NEW("$set", "{", "kick_at", BCON_DOUBLE(now),
                    "v", BCON_INT64(mg_doc_int(docs[i], "v") + 1), "}"));
        at[m++] = i;
    }
    if (r == 0 && m) r = mg_cas_run(j, c, j->s->base.table, ops, m, now);
    mongoc_collection_t *cl = r == 0 && m ? mg_coll(j->s, c, j->s->base.table) : NULL;
    for (size_t x = 0; x < m; x++) {
        size_t i = at[x];
        char hex[25];
        int failed = 0;
        bson_t *again = r == 0 && ops[x].won && mg_doc_oid(docs[i], hex)
                            ? mg_find_by_id(j, cl, hex, &failed) : NULL;
        if (failed) r = -1;
        bson_destroy(docs[i]);
        docs[i] = again;        /* (NULL: lost, or gone meanwhile) */
        mg_cas_clear(&ops[x]);
    }
    if (cl) mongoc_collection_destroy(cl);
    free(ops);
    free(at);
    return r;
}

/* A kicked delivery of a group joins it again at its tail, like a new one (groups.c): held[i]
 * (malloc'd) the live one before it, or NULL when it is due. -1: j failed. */
static int kick_groups(mjob *j, mongoc_client_t *c, bson_t **docs, size_t n, double now,
                       char **held)
{
    for (size_t i = 0; i < n; i++) held[i] = NULL;
    if (flag_kicks(j, c, docs, n, now) < 0) return -1;
    const char **groups = rb_calloc(n, sizeof *groups);
    char **ids = rb_calloc(n, sizeof *ids), **prev = rb_calloc(n, sizeof *prev);
    int r = groups && ids && prev ? 0 : -1, any = 0;
    if (r < 0) mg_fail(j, MG_OOM);
    for (size_t i = 0; r == 0 && i < n; i++) {
        char hex[25];
        if (!docs[i] || !(groups[i] = mg_doc_str(docs[i], "group")) || !mg_doc_oid(docs[i], hex))
            continue;
        if (!(ids[i] = rb_strdup(hex))) { mg_fail(j, MG_OOM); r = -1; }
        any = 1;
    }
    long *item = r == 0 ? rb_calloc(n ? n : 1, sizeof *item) : NULL;
    if (r == 0 && !item) { mg_fail(j, MG_OOM); r = -1; }
    if (r == 0 && any) r = mg_groups_link(j, c, groups, ids, n, prev, item);
    for (size_t i = 0; any && r == 0 && i < n; i++) {
        if (!prev[i]) continue;
        int ours = item[i] >= 0;    /* kicked in this batch too: live once its kick lands */
        if (ours && !(held[i] = rb_strdup(prev[i]))) { mg_fail(j, MG_OOM); r = -1; }
        if (!ours) r = mg_group_live_prev(j, c, groups[i], ids[i], prev[i], &held[i]);
        /* one linked behind it while it was flagged comes after it: it waits instead for
         * what was before it */
        int after = r == 0 && held[i] && !ours ? mg_group_reaches(j, c, held[i], ids[i]) : 0;
        if (after < 0) r = -1;
        if (after > 0) {
            free(held[i]);
            held[i] = NULL;
            r = mg_group_live_prev(j, c, groups[i], ids[i], ids[i], &held[i]);
        }
        if (r == 0 && held[i]) r = mg_deps_mark(j, c, &held[i], 1, ids[i], now);
    }
    for (size_t i = 0; i < n; i++) {
        if (ids) free(ids[i]);
        if (prev) free(prev[i]);
    }
    free(ids); free(prev); free(groups); free(item);
    return r;
}

/* Grouped deliveries about to be deleted are marked gone first: a later one of the group
 * then need not wait for them (groups.c). -1: j failed. */
static int delete_groups(mjob *j, mongoc_client_t *c, bson_t *const *docs, size_t n)
{
    char **ids = rb_calloc(n ? n : 1, sizeof *ids);
    size_t m = 0;
    int r = ids ? 0 : -1;
    for (size_t i = 0; r == 0 && i < n; i++) {
        char hex[25];
        if (!docs[i] || !bson_has_field(docs[i], "group") || !mg_doc_oid(docs[i], hex)) continue;
        if (!(ids[m] = rb_strdup(hex))) r = -1;
        else m++;
    }
    if (r < 0) mg_fail(j, MG_OOM);
    if (r == 0 && m) r = mg_groups_gone(j, c, ids, m);
    free_held(ids, m);
    return r;
}

static int64_t kick_docs(mjob *j, mongoc_client_t *c, bson_t **docs, size_t n, int del, double now)
{
    cas_op *ops = rb_calloc(n ? n : 1, sizeof *ops);
    char **held = rb_calloc(n ? n : 1, sizeof *held);
    if (!ops || !held) {
        free(ops);
        free(held);
        mg_fail(j, "out of memory");
        return -1;
    }
    if (!del && kick_groups(j, c, docs, n, now, held) < 0) {
        free(ops);
        free_held(held, n);
        return -1;
    }
    if (del && delete_groups(j, c, docs, n) < 0) {
        free(ops);
        free_held(held, n);
        return -1;
    }
    int64_t won = 0;
    if (!del && j->s->ferret && n) {   /* a kicked delivery is live again: its entry first */
        mongoc_collection_t *qc = mg_coll(j->s, c, j->s->queue);
        qbatch qb;
        char hex[25];
        mg_qb_init(&qb, qc);
        /* Generation: the time in microseconds. Claims count on from it by one, so no earlier
         * entry of the delivery (which a settle or a claim may be removing by id) has it. */
        for (size_t i = 0; i < n; i++)      /* (a held one's release writes its entry) */
            if (docs[i] && !held[i] && mg_doc_oid(docs[i], hex))
                mg_qb_put(&qb, hex, mg_doc_str(docs[i], "topic"), (int64_t)(now * 1e6),
                          kick_due(docs[i], now), now);
        int r = mg_qb_run(j, &qb, 1);
        mongoc_collection_destroy(qc);
        if (r < 0) {
            free(ops);
            free_held(held, n);
            return -1;
        }
    }
    char **look = rb_calloc(n ? n : 1, sizeof *look);   /* held ones kicked: looked at after */
    size_t nlook = 0;
    if (!look) {
        free(ops);
        free_held(held, n);
        mg_fail(j, "out of memory");
        return -1;
    }
    for (int pass = 0; pass < 2 && n; pass++) {
        size_t k = 0;
        for (size_t i = 0; i < n; i++) {
            if (!docs[i]) continue;
            mg_cas_init(j->s, &ops[k++], docs[i], "d",
                        del ? NULL : upd_kick(docs[i], now, pass == 0, held[i]));
        }
        if (mg_cas_run(j, c, j->s->base.table, ops, k, now) < 0) {
            mg_cas_free(ops, k);
            free_held(held, n);
            free_held(look, nlook);
            return -1;
        }
        /* the entries again now that they are live (mg_requeue says why), one batch */
        mongoc_collection_t *qc = !del && j->s->ferret ? mg_coll(j->s, c, j->s->queue) : NULL;
        qbatch qb;
        if (qc) mg_qb_init(&qb, qc);
        for (size_t i = 0, m = 0; qc && i < n; i++) {
            char hex[25];
            if (!docs[i]) continue;
            if (ops[m++].won && !held[i] && mg_doc_oid(docs[i], hex))
                mg_qb_put(&qb, hex, mg_doc_str(docs[i], "topic"), MG_REQUEUE_AFTER_G(now),
                          kick_due(docs[i], now), now);
        }
        int qr = qc ? mg_qb_run(j, &qb, 1) : 0;
        if (qc) mongoc_collection_destroy(qc);
        if (qr < 0) {
            mg_cas_free(ops, k);    /* (frees the array too) */
            free_held(held, n);
            free_held(look, nlook);
            return -1;
        }
        size_t m = 0;
        for (size_t i = 0; i < n; i++) {
            if (!docs[i]) continue;
            if (ops[m].won) won++;
            char hex[25];
            if (ops[m].won && held[i] && mg_doc_oid(docs[i], hex) && (look[nlook] = rb_strdup(hex)))
                nlook++;
            if (ops[m].won || ops[m].code != 11000) {   /* done with it, unless dedupe refused */
                bson_destroy(docs[i]);
                docs[i] = NULL;
            }
            m++;
        }
        for (size_t i = 0; i < k; i++) mg_cas_clear(&ops[i]);
        memset(ops, 0, n * sizeof *ops);
    }
    free(ops);
    free_held(held, n);
    /* the one it is held behind may have settled before the kick landed (groups.c) */
    if (nlook) mg_deps_after_write(j, c, MG_DEPS_EVAL, look, nlook);
    free_held(look, nlook);
    return won;
}

static void kick_work(mjob *j, mongoc_client_t *c)
{
    count_job *q = (count_job *)j;
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->base.table);
    for (;;) {
        double now = mg_now(j->s);
        bson_t f = BSON_INITIALIZER, opts = BSON_INITIALIZER;
        int ok = 1;
        if (q->mode == RB_KICK_ONE) {
            bson_oid_t oid;
            ok = mg_parse_oid(q->id, &oid);
            if (ok) BSON_APPEND_OID(&f, "_id", &oid);
        } else {
            BSON_APPEND_UTF8(&f, "status", "buried");
            if (q->topic) BSON_APPEND_UTF8(&f, "topic", q->topic);
        }
        BSON_APPEND_INT64(&opts, "limit", BATCH_ROUND);
        bson_t **docs = NULL;
        size_t n = 0;
        int r = ok ? mg_find_docs(j, cl, &f, &opts, NULL, &docs, &n) : 0;
        bson_destroy(&f);
        bson_destroy(&opts);
        size_t live = 0;
        for (size_t i = 0; i < n; i++) {
            const char *st = mg_doc_str(docs[i], "status");
            /* (kicking one requeues a cancelled delivery too) */
            if (!st || (strcmp(st, "buried") != 0 &&
                        (q->mode != RB_KICK_ONE || strcmp(st, "cancelled") != 0))) {
                bson_destroy(docs[i]);
                docs[i] = NULL;
            } else {
                live++;
            }
        }
        int64_t won = (r == 0 && live) ? kick_docs(j, c, docs, n, 0, now) : 0;
        mg_docs_free(docs, n);    /* kick_docs NULLed what it consumed; bson_destroy skips NULL */
        if (r < 0 || won < 0) break;
        q->count += won;
        if (q->mode == RB_KICK_ONE || n < BATCH_ROUND || won == 0) break;
    }
    mongoc_collection_destroy(cl);
}

static void purge_work(mjob *j, mongoc_client_t *c)
{
    count_job *q = (count_job *)j;
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->base.table);
    for (;;) {
        double now = mg_now(j->s);
        size_t want = BATCH_ROUND;
        if (q->limit && q->limit - (size_t)q->count < want) want = q->limit - (size_t)q->count;
        bson_t f = BSON_INITIALIZER, opts = BSON_INITIALIZER;
        BSON_APPEND_UTF8(&f, "status", q->status);
        if (q->topic) BSON_APPEND_UTF8(&f, "topic", q->topic);
        mg_append_range(&f, "settled_at", "$lte", now - q->older_than);
        BSON_APPEND_INT64(&opts, "limit", (int64_t)want);
        bson_t **docs = NULL;
        size_t n = 0;
        int r = mg_find_docs(j, cl, &f, &opts, NULL, &docs, &n);
        bson_destroy(&f);
        bson_destroy(&opts);
        int64_t won = (r == 0 && n) ? kick_docs(j, c, docs, n, 1, now) : 0;
        mg_docs_free(docs, n);
        if (r < 0 || won < 0) break;
        q->count += won;
        if (n < want || won == 0 || (q->limit && (size_t)q->count >= q->limit)) break;
    }
    mongoc_collection_destroy(cl);
}

/* The operator's bury or cancel one (status "buried", "cancelled") and remove one settled
 * (status "remove"): one document by id, when its status allows, through the same versioned
 * write as every other change. 0 when that write lost to another change of the document (a
 * renewal, a claim) made between the read and the write: the caller reads it again. */
static int one_round(mjob *j, mongoc_client_t *c)
{
    count_job *q = (count_job *)j;
    int bury = strcmp(q->status, "remove") != 0;
    int ok, failed = 0;
    bson_t *sel = mg_oid_sel(q->id, &ok);
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->base.table);
    bson_t *d = ok ? mg_find_one(j, cl, sel, NULL, &failed) : NULL;
    mongoc_collection_destroy(cl);
    bson_destroy(sel);
    if (!d) return 1;
    const char *st = mg_doc_str(d, "status");
    int fits = st && (bury ? (!strcmp(st, "pending") || !strcmp(st, "processing"))
                           : (!strcmp(st, "completed") || !strcmp(st, "buried") ||
                              !strcmp(st, "cancelled")));
    if (!fits) { bson_destroy(d); return 1; }
    double now = mg_now(j->s);
    if (!bury) {
        int64_t won = kick_docs(j, c, &d, 1, 1, now);
        if (d) bson_destroy(d);
        if (won > 0) q->count = won;
        return 1;
    }
    cas_op op;
    memset(&op, 0, sizeof op);
    mg_cas_init(j->s, &op, d, "d", mg_upd_end_live(d, q->status, q->reason, now));
    int done = 1;
    if (mg_cas_run(j, c, j->s->base.table, &op, 1, now) == 0) {
        done = op.won;
        if (op.won) {
            char self[25];
            if (mg_doc_oid(d, self)) {      /* buried or cancelled: the ones after it (deps.c) */
                char *gone = self;
                mg_deps_after_write(j, c, MG_DEPS_SETTLED, &gone, 1);
            }
            q->count = 1;
            const char *token = mg_doc_str(d, "lease_token");
            char hex[25];
            /* the dispatchers know the id as the store writes it (lower-case hex) */
            if (!strcmp(q->status, "cancelled") && !strcmp(st, "processing") && token &&
                mg_doc_oid(d, hex)) {
                free(q->id);
                q->id = rb_strdup(hex);
                q->token = rb_strdup(token);
                if (!q->id || !q->token) mg_fail(j, "out of memory");
            }
        }
    }
    mg_cas_clear(&op);
    bson_destroy(d);
    return done;
}

#define ONE_ROUNDS 10

/* cancel_all: the live deliveries of q->cancel_status (NULL: both) and q->topic, a batch at
 * a time, each cancelled by one_round (its document read again by id, and written as any
 * other change). This process's dispatchers hear of the runs it cancelled at its end; the
 * others' at their next renewal. */
static void cancel_all_work(mjob *j, mongoc_client_t *c)
{
    count_job *q = (count_job *)j;
    int64_t total = 0;
    for (;;) {
        mongoc_collection_t *cl = mg_coll(j->s, c, j->s->base.table);
        bson_t f = BSON_INITIALIZER, in, arr, opts = BSON_INITIALIZER, proj;
        if (q->cancel_status) {
            BSON_APPEND_UTF8(&f, "status", q->cancel_status);
        } else {
            BSON_APPEND_DOCUMENT_BEGIN(&f, "status", &in);
            BSON_APPEND_ARRAY_BEGIN(&in, "$in", &arr);
            BSON_APPEND_UTF8(&arr, "0", "pending");
            BSON_APPEND_UTF8(&arr, "1", "processing");
            bson_append_array_end(&in, &arr);
            bson_append_document_end(&f, &in);
        }
        if (q->topic) BSON_APPEND_UTF8(&f, "topic", q->topic);
        BSON_APPEND_INT64(&opts, "limit", BATCH_ROUND);
        BSON_APPEND_DOCUMENT_BEGIN(&opts, "projection", &proj);
        BSON_APPEND_INT32(&proj, "_id", 1);
        bson_append_document_end(&opts, &proj);
        bson_t **docs = NULL;
        size_t n = 0;
        int r = mg_find_docs(j, cl, &f, &opts, NULL, &docs, &n);
        bson_destroy(&f);
        bson_destroy(&opts);
        mongoc_collection_destroy(cl);
        int64_t won = 0;
        for (size_t i = 0; r == 0 && i < n && !j->err[0]; i++) {
            char hex[25];
            if (!mg_doc_oid(docs[i], hex)) continue;
            free(q->id);
            if (!(q->id = rb_strdup(hex))) { mg_fail(j, "out of memory"); break; }
            q->count = 0;
            for (int round = 0; round < ONE_ROUNDS && !one_round(j, c); round++) {}
            won += q->count;
            if (q->token) {     /* a run it took the lease of: told at the end (count_done) */
                char **more = rb_realloc(q->runs, (q->nruns + 1) * 2 * sizeof *more);
                if (more) {
                    q->runs = more;
                    q->runs[2 * q->nruns] = q->id;
                    q->runs[2 * q->nruns + 1] = q->token;
                    q->nruns++;
                    q->id = NULL;
                } else {
                    free(q->token);     /* its renewal tells it instead */
                }
                q->token = NULL;
            }
        }
        mg_docs_free(docs, n);
        total += won;
        if (r < 0 || j->err[0] || n < BATCH_ROUND || won == 0) break;
    }
    q->count = total;
}
static void one_work(mjob *j, mongoc_client_t *c)
{
    for (int round = 0; round < ONE_ROUNDS && !one_round(j, c); round++) {}
}

static void count_done(mjob *j, const char *err)
{
    count_job *q = (count_job *)j;
    /* a cancel tells this process's dispatchers before its caller (on the loop's thread) */
    if (!err && q->token) rb_store_cancelled(&j->s->base, q->id, q->token);
    for (size_t i = 0; i < q->nruns; i++) {
        if (!err) rb_store_cancelled(&j->s->base, q->runs[2 * i], q->runs[2 * i + 1]);
        free(q->runs[2 * i]);
        free(q->runs[2 * i + 1]);
    }
    free(q->runs);
    j->cb.count(j->ud, err, err ? 0 : q->count);
    free(q->token);
    free(q->topic);
    free(q->id);
    free(q->reason);
    free(q->status);
    free(q->cancel_status);
    free(q);
}

void mg_kick(rb_store *st, rb_kick_mode mode, const char *id, const char *topic,
             rb_count_cb cb, void *ud)
{
    count_job *q = mg_job_new((mstore *)st, sizeof *q, kick_work, count_done, (rb_store_cb){.count = cb}, ud);
    if (!q) {
        cb(ud, MG_OOM, 0);
        return;
    }
    q->mode = mode;
    q->topic = mode == RB_KICK_BURIED ? mg_dupstr(topic) : NULL;
    if (!(q->id = rb_strdup(id ? id : "")) || (mode == RB_KICK_BURIED && topic && !q->topic)) {
        count_done(&q->j, MG_OOM);
        return;
    }
    mg_submit((mstore *)st, &q->j);
}

void mg_purge(rb_store *st, const char *status, const char *topic, double older_than,
              size_t limit, rb_count_cb cb, void *ud)
{
    if (!rb_settled_status(status)) {
        cb(ud, "mongodb: purge: status must be completed, buried or cancelled", 0);
        return;
    }
    count_job *q = mg_job_new((mstore *)st, sizeof *q, purge_work, count_done, (rb_store_cb){.count = cb}, ud);
    if (!q) {
        cb(ud, MG_OOM, 0);
        return;
    }
    q->older_than = older_than;
    q->limit = limit;
    q->topic = mg_dupstr(topic);
    if (!(q->status = rb_strdup(status)) || (topic && !q->topic)) {
        count_done(&q->j, MG_OOM);
        return;
    }
    mg_submit((mstore *)st, &q->j);
}

static void one_op(rb_store *st, const char *what, const char *id, const char *reason,
                   rb_count_cb cb, void *ud)
{
    count_job *q = mg_job_new((mstore *)st, sizeof *q, one_work, count_done, (rb_store_cb){.count = cb}, ud);
    if (!q) {
        cb(ud, MG_OOM, 0);
        return;
    }
    q->status = rb_strdup(what);
    q->id = rb_strdup(id ? id : "");
    q->reason = mg_dupstr(reason);
    if (!q->status || !q->id || (reason && !q->reason)) {
        count_done(&q->j, MG_OOM);
        return;
    }
    mg_submit((mstore *)st, &q->j);
}

void mg_cancel_all(rb_store *st, const char *status, const char *topic, const char *reason,
                   rb_count_cb cb, void *ud)
{
    if (status && !rb_live_status(status)) {
        cb(ud, "mongodb: cancel takes status pending or processing", 0);
        return;
    }
    count_job *q = mg_job_new((mstore *)st, sizeof *q, cancel_all_work, count_done,
                              (rb_store_cb){.count = cb}, ud);
    if (!q) {
        cb(ud, MG_OOM, 0);
        return;
    }
    q->status = rb_strdup("cancelled");
    q->cancel_status = mg_dupstr(status);
    q->topic = mg_dupstr(topic);
    q->reason = mg_dupstr(reason);
    if (!q->status || (status && !q->cancel_status) || (topic && !q->topic) ||
        (reason && !q->reason)) {
        count_done(&q->j, MG_OOM);
        return;
    }
    mg_submit((mstore *)st, &q->j);
}

void mg_bury(rb_store *st, const char *id, const char *reason, rb_count_cb cb, void *ud)
{
    one_op(st, "buried", id, reason, cb, ud);
}

void mg_cancel(rb_store *st, const char *id, const char *reason, rb_count_cb cb, void *ud)
{
    one_op(st, "cancelled", id, reason, cb, ud);
}

void mg_remove(rb_store *st, const char *id, rb_count_cb cb, void *ud)
{
    one_op(st, "remove", id, NULL, cb, ud);
}
