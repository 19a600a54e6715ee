/* topics.c -- what operators set per topic, kept in <table>_topics (one document per topic,
 * _id the topic): a pause (paused_at, epoch s, or null). Each claim reads the pauses of the
 * topics it asks for first, so a pause reaches every process's next claim. */
#include <stdlib.h>
#include <string.h>
#include "stores/mongo/mstore.h"
#include "util/alloc.h"

typedef struct pause_job {
    mjob j;
    char *topic;
    int paused;         /* pause: 1, resume: 0 */
    int64_t changed;
    rb_rowset *rs;      /* paused(): the rows */
} pause_job;

static bson_t *paused_filter(void)
{
    return BCON_NEW("paused_at", "{", "$ne", BCON_NULL, "}");
}

int mg_split_paused(mjob *j, mongoc_client_t *c, char **topics, size_t *n, size_t *npaused)
{
    *npaused = 0;
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->topics);
    bson_t f = BSON_INITIALIZER, in;
    mg_append_in(&f, "_id", topics, *n);
    BSON_APPEND_DOCUMENT_BEGIN(&f, "paused_at", &in);
    BSON_APPEND_NULL(&in, "$ne");
    bson_append_document_end(&f, &in);
    bson_t **docs = NULL;
    size_t nd = 0;
    int r = mg_find_docs(j, cl, &f, NULL, NULL, &docs, &nd);
    bson_destroy(&f);
    mongoc_collection_destroy(cl);
    if (r < 0) return -1;
    for (size_t d = 0; d < nd; d++) {
        const char *t = mg_doc_str(docs[d], "_id");
        for (size_t i = 0; t && i < *n; i++)
            if (strcmp(topics[i], t) == 0) {
                char *p = topics[i];        /* to the end, past the ones still claimed */
                topics[i] = topics[--*n];
                topics[*n] = p;
                ++*npaused;
                break;
            }
    }
    mg_docs_free(docs, nd);
    return 0;
}

/* pause: sets paused_at where it is not set, making the document if there is none (its
 * insert fails on the _id index when another made it paused meanwhile: nothing changed).
 * resume: clears it where set. */
static void pause_work(mjob *j, mongoc_client_t *c)
{
    pause_job *q = (pause_job *)j;
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->topics);
    bson_t *sel = q->paused ? BCON_NEW("_id", BCON_UTF8(q->topic), "paused_at", BCON_NULL)
                            : BCON_NEW("_id", BCON_UTF8(q->topic), "paused_at", "{", "$ne",
                                       BCON_NULL, "}");
    bson_t *upd = q->paused
                      ? BCON_NEW("$set", "{", "paused_at", BCON_DOUBLE(mg_now(j->s)), "}")
                      : BCON_NEW("$set", "{", "paused_at", BCON_NULL, "}");
    bson_t *opts = q->paused ? BCON_NEW("upsert", BCON_BOOL(true)) : NULL;
    bson_t reply;
    bson_error_t e;
    if (mongoc_collection_update_one(cl, sel, upd, opts, &reply, &e))
        q->changed = mg_doc_int(&reply, "modifiedCount") + mg_doc_int(&reply, "upsertedCount");
    else if (e.code != 11000)
        mg_fail_bson(j, q->paused ? "pause" : "resume", &e);
    bson_destroy(&reply);
    bson_destroy(sel);
    bson_destroy(upd);
    if (opts) bson_destroy(opts);
    mongoc_collection_destroy(cl);
}

static rb_rowset *paused_rowset(bson_t *const *docs, size_t n)
{
    rb_rowset *rs = rb_calloc(1, sizeof *rs);
    if (!rs) return NULL;
    rs->names = rb_calloc(3, sizeof *rs->names);
    rs->vals = rb_calloc(2 * n + 1, sizeof *rs->vals);
    if (!rs->names || !rs->vals) { rb_rowset_free(rs); return NULL; }
    rs->ncols = 2;
    if (!(rs->names[0] = rb_strdup("topic")) || !(rs->names[1] = rb_strdup("paused_at"))) {
        rb_rowset_free(rs);
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        const char *t = mg_doc_str(docs[i], "_id");
        if (!t) continue;       /* (an _id that is no string: not a topic) */
        rb_value *v = &rs->vals[rs->nrows * 2];
        if (!(v[0].s = rb_strdup(t))) { rb_rowset_free(rs); return NULL; }
        v[0].type = RB_VTEXT;
        v[0].len = strlen(t);
        v[1].type = RB_VFLOAT;
        v[1].f = mg_doc_num(docs[i], "paused_at");
        rs->nrows++;
    }
    return rs;
}

static void paused_work(mjob *j, mongoc_client_t *c)
{
    pause_job *q = (pause_job *)j;
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->topics);
    bson_t *f = paused_filter();
    bson_t *opts = BCON_NEW("sort", "{", "_id", BCON_INT32(1), "}",
                            "limit", BCON_INT64(RB_TOPIC_STATS_MAX));
    bson_t **docs = NULL;
    size_t n = 0;
    if (mg_find_docs(j, cl, f, opts, NULL, &docs, &n) == 0 && !(q->rs = paused_rowset(docs, n)))
        mg_fail(j, "out of memory");
    mg_docs_free(docs, n);
    bson_destroy(f);
    bson_destroy(opts);
    mongoc_collection_destroy(cl);
}

static void pause_done(mjob *j, const char *err)
{
    pause_job *q = (pause_job *)j;
    /* a resumed topic's deliveries may be due: a dispatcher here claims at once */
    if (!err && !q->paused && q->changed && !j->s->closing) rb_store_notify_local(&j->s->base);
    j->cb.count(j->ud, err, err ? 0 : q->changed);
    free(q->topic);
    free(q);
}

static void paused_done(mjob *j, const char *err)
{
    pause_job *q = (pause_job *)j;
    rb_rowset *rs = err ? NULL : q->rs;
    if (err) rb_rowset_free(q->rs);
    rb_rows_cb cb = j->cb.rows;
    void *ud = j->ud;
    free(q);
    cb(ud, err, rs);
}

void mg_pause(rb_store *st, const char *topic, int paused, rb_count_cb cb, void *ud)
{
    pause_job *q = mg_job_new((mstore *)st, sizeof *q, pause_work, pause_done,
                              (rb_store_cb){.count = cb}, ud);
    if (!q || !(q->topic = rb_strdup(topic ? topic : ""))) {
        free(q);
        cb(ud, MG_OOM, 0);
        return;
    }
    q->paused = paused != 0;
    mg_submit((mstore *)st, &q->j);
}

void mg_paused(rb_store *st, rb_rows_cb cb, void *ud)
{
    pause_job *q = mg_job_new((mstore *)st, sizeof *q, paused_work, paused_done,
                              (rb_store_cb){.rows = cb}, ud);
    if (!q) { cb(ud, MG_OOM, NULL); return; }
    mg_submit((mstore *)st, &q->j);
}
