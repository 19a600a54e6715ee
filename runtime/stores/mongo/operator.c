/* operator.c -- the MongoDB store's counts per topic and status, for the dashboard: one
 * aggregation grouped by both, folded into one row per topic here; and the counts of pending
 * deliveries per topic among the earliest due, for the dispatcher's check for topics nobody
 * handles. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "stores/mongo/mstore.h"
#include "util/alloc.h"

typedef struct topic_row {
    char *topic;
    int64_t n[RB_STATUS_COUNT];
    double first_pending;       /* the earliest run_at of its pending deliveries; 0: none */
} topic_row;

typedef struct topics_job {
    mjob j;
    double now;                 /* topic stats: the store's clock when they were read */
    topic_row *rows;
    size_t nrows, cap;
    rb_rowset *rs;
    size_t scan_max;        /* pending topics: at most this many deliveries; 0: topic stats */
} topics_job;

static int by_topic(const void *a, const void *b)
{
    return strcmp(((const topic_row *)a)->topic, ((const topic_row *)b)->topic);
}

static topic_row *row_for(topics_job *q, const char *topic)
{
    for (size_t i = 0; i < q->nrows; i++)
        if (!strcmp(q->rows[i].topic, topic)) return &q->rows[i];
    if (q->nrows >= RB_TOPIC_STATS_MAX) return NULL;
    if (q->nrows == q->cap) {
        size_t cap = q->cap ? q->cap * 2 : 16;
        topic_row *g = rb_realloc(q->rows, cap * sizeof *g);
        if (!g) return NULL;
        q->rows = g;
        q->cap = cap;
    }
    topic_row *r = &q->rows[q->nrows];
    memset(r, 0, sizeof *r);
    if (!(r->topic = rb_strdup(topic))) return NULL;
    q->nrows++;
    return r;
}

/* The rows as a rowset of topic and the counts of the first ncounts statuses, and with all
 * of them the age of the oldest due pending one (topic stats). */
static rb_rowset *to_rowset(topics_job *q, int ncounts)
{
    static const char *const names[] = {"topic", "pending", "processing", "completed", "buried",
                                        "cancelled", "oldest_due_age"};
    int ages = ncounts == RB_STATUS_COUNT;
    int ncols = 1 + ncounts + ages;
    rb_rowset *rs = rb_calloc(1, sizeof *rs);
    if (!rs) return NULL;
    rs->names = rb_calloc((size_t)ncols + 1, sizeof *rs->names);
    rs->vals = rb_calloc(q->nrows * (size_t)ncols + 1, sizeof *rs->vals);
    if (!rs->names || !rs->vals) { rb_rowset_free(rs); return NULL; }
    rs->ncols = ncols;
    for (int c = 0; c < ncols; c++)
        if (!(rs->names[c] = rb_strdup(names[c]))) { rb_rowset_free(rs); return NULL; }
    for (size_t i = 0; i < q->nrows; i++) {
        rb_value *v = &rs->vals[i * (size_t)ncols];
        v[0].type = RB_VTEXT;
        v[0].s = q->rows[i].topic;          /* moved into the rowset */
        v[0].len = strlen(q->rows[i].topic);
        q->rows[i].topic = NULL;
        for (int c = 0; c < ncounts; c++) { v[c + 1].type = RB_VINT; v[c + 1].i = q->rows[i].n[c]; }
        if (ages) {
            double first = q->rows[i].first_pending;
            v[ncols - 1].type = RB_VFLOAT;
            v[ncols - 1].f = first > 0 && q->now > first ? q->now - first : 0;
        }
        rs->nrows++;
    }
    return rs;
}

/* The pipeline: all documents grouped by topic and status, or (pending topics) the earliest
 * due pending ones, at most scan_max, grouped by topic: through the {status, run_at} index on
 * MongoDB; FerretDB pushes down only _id lookups, so there every pending document is read. */
static bson_t *topics_pipeline(const topics_job *q, int ferretdb)
{
    if (!q->scan_max && ferretdb)       /* (FerretDB 1.x has no $min: first_pending reads it) */
        return BCON_NEW("pipeline", "[", "{", "$group", "{", "_id", "{", "t", BCON_UTF8("$topic"),
                        "s", BCON_UTF8("$status"), "}", "n", "{", "$sum", BCON_INT32(1), "}",
                        "}", "}", "]");
    if (!q->scan_max)
        return BCON_NEW("pipeline", "[", "{", "$group", "{", "_id", "{", "t", BCON_UTF8("$topic"),
                        "s", BCON_UTF8("$status"), "}", "n", "{", "$sum", BCON_INT32(1), "}",
                        "r", "{", "$min", BCON_UTF8("$run_at"), "}", "}", "}", "]");
    return BCON_NEW("pipeline", "[",
                    "{", "$match", "{", "status", BCON_UTF8("pending"), "}", "}",
                    "{", "$sort", "{", "run_at", BCON_INT32(1), "}", "}",
                    "{", "$limit", BCON_INT64((int64_t)q->scan_max), "}",
                    "{", "$group", "{", "_id", "{", "t", BCON_UTF8("$topic"),
                    "s", BCON_UTF8("$status"), "}", "n", "{", "$sum", BCON_INT32(1), "}", "}", "}",
                    "]");
}

/* FerretDB: the earliest run_at of each topic's pending deliveries, one sorted read each. */
static int first_pending(mjob *j, mongoc_collection_t *cl, topics_job *q)
{
    for (size_t i = 0; i < q->nrows; i++) {
        topic_row *r = &q->rows[i];
        if (!r->n[RB_PENDING]) continue;
        bson_t *f = BCON_NEW("topic", BCON_UTF8(r->topic), "status", BCON_UTF8("pending"));
        bson_t *opts = BCON_NEW("sort", "{", "run_at", BCON_INT32(1), "}", "limit", BCON_INT64(1),
                                "projection", "{", "run_at", BCON_INT32(1), "}");
        bson_t **docs = NULL;
        size_t n = 0;
        int rc = mg_find_docs(j, cl, f, opts, NULL, &docs, &n);
        if (rc == 0 && n == 1) {
            double first = mg_doc_num(docs[0], "run_at");
            if (isfinite(first) && first > 0) r->first_pending = first;
        }
        mg_docs_free(docs, n);
        bson_destroy(f);
        bson_destroy(opts);
        if (rc < 0) return -1;
    }
    return 0;
}

static void topics_work(mjob *j, mongoc_client_t *c)
{
    topics_job *q = (topics_job *)j;
    q->now = mg_now(j->s);
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->base.table);
    bson_t *pipe = topics_pipeline(q, j->s->ferretdb);
    mongoc_cursor_t *cur = mongoc_collection_aggregate(cl, MONGOC_QUERY_NONE, pipe, NULL, NULL);
    const bson_t *d;
    bson_error_t e;
    int oom = 0;
    while (!oom && mongoc_cursor_next(cur, &d)) {
        bson_iter_t it, sub;
        const char *t = NULL, *st = NULL;
        if (bson_iter_init_find(&it, d, "_id") && BSON_ITER_HOLDS_DOCUMENT(&it) &&
            bson_iter_recurse(&it, &sub)) {
            while (bson_iter_next(&sub)) {
                if (!strcmp(bson_iter_key(&sub), "t") && BSON_ITER_HOLDS_UTF8(&sub)) t = bson_iter_utf8(&sub, NULL);
                if (!strcmp(bson_iter_key(&sub), "s") && BSON_ITER_HOLDS_UTF8(&sub)) st = bson_iter_utf8(&sub, NULL);
            }
        }
        int k = st ? rb_status_parse(st) : -1;
        if (!t || k < 0) continue;
        topic_row *r = row_for(q, t);
        if (!r) { if (q->nrows < RB_TOPIC_STATS_MAX) oom = 1; continue; }
        r->n[k] += mg_doc_int(d, "n");
        if (k == RB_PENDING && !q->scan_max) {
            double first = mg_doc_num(d, "r");
            if (isfinite(first) && first > 0 && (r->first_pending == 0 || first < r->first_pending))
                r->first_pending = first;
        }
    }
    if (mongoc_cursor_error(cur, &e)) mg_fail_bson(j, "topic stats", &e);
    else if (oom) mg_fail(j, "out of memory");
    else if (!q->scan_max && j->s->ferretdb && first_pending(j, cl, q) < 0) {
        /* (failed: the error is the job's) */
    } else {
        if (q->nrows) qsort(q->rows, q->nrows, sizeof *q->rows, by_topic);   /* rows is NULL when none */
        if (!(q->rs = to_rowset(q, q->scan_max ? 1 : RB_STATUS_COUNT))) mg_fail(j, "out of memory");
    }
    mongoc_cursor_destroy(cur);
    bson_destroy(pipe);
    mongoc_collection_destroy(cl);
}

static void topics_done(mjob *j, const char *err)
{
    topics_job *q = (topics_job *)j;
    rb_rowset *rs = err ? NULL : q->rs;
    if (err) rb_rowset_free(q->rs);
    for (size_t i = 0; i < q->nrows; i++) free(q->rows[i].topic);
    free(q->rows);
    rb_rows_cb cb = j->cb.rows;
    void *ud = j->ud;
    free(q);
    cb(ud, err, rs);
}

static void submit_topics(rb_store *st, size_t scan_max, rb_rows_cb cb, void *ud)
{
    topics_job *q = mg_job_new((mstore *)st, sizeof *q, topics_work, topics_done,
                               (rb_store_cb){.rows = cb}, ud);
    if (!q) { cb(ud, MG_OOM, NULL); return; }
    q->scan_max = scan_max;
    mg_submit((mstore *)st, &q->j);
}

void mg_topic_stats(rb_store *st, rb_rows_cb cb, void *ud) { submit_topics(st, 0, cb, ud); }

void mg_pending_topics(rb_store *st, size_t scan_max, rb_rows_cb cb, void *ud)
{
    submit_topics(st, rb_scan_bound(scan_max), cb, ud);
}
