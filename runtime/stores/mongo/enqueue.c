/* enqueue.c -- the MongoDB store's enqueue: one unordered insert of the batch. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "stores/mongo/mstore.h"
#include "util/alloc.h"

static void enq_free(enq_job *q)
{
    for (size_t i = 0; i < q->n; i++) {
        free((char *)q->items[i].topic);
        free((char *)q->items[i].payload);
        free((char *)q->items[i].key);
        if (q->ids) free(q->ids[i]);
    }
    free(q->items);
    free(q->ids);
    free(q);
}

/* Whether the payload can be stored: converted once here to say why not, and again when the
 * document is made (a pass over the text; the insert costs more). */
static int payload_check(const mstore *s, const char *json, char *why, size_t whylen)
{
    bson_t tmp = BSON_INITIALIZER;
    int ok = mg_payload_append(&tmp, json, s->ferretdb, why, whylen);
    bson_destroy(&tmp);
    return ok;
}

bson_t *mg_delivery_doc(const mstore *s, const rb_enqueue_item *it, double now, char hex[25])
{
    bson_t *d = bson_new();
    bson_oid_t oid;
    bson_oid_init(&oid, NULL);
    bson_oid_to_string(&oid, hex);
    BSON_APPEND_OID(d, "_id", &oid);
    BSON_APPEND_UTF8(d, "topic", it->topic);
    char why[200];
    mg_payload_append(d, it->payload ? it->payload : "null", s->ferretdb, why, sizeof why);  /* checked */
    if (it->key) {
        BSON_APPEND_UTF8(d, "key", it->key);
        char *dd = mg_dedupe_value(it->topic, it->key);
        if (dd) BSON_APPEND_UTF8(d, "dedupe", dd);
        free(dd);
    }
    BSON_APPEND_UTF8(d, "status", "pending");
    BSON_APPEND_INT32(d, "attempts", 0);
    BSON_APPEND_INT32(d, "max_attempts", it->max_attempts > 0 ? it->max_attempts : 25);
    BSON_APPEND_INT64(d, "fence", 0);
    BSON_APPEND_INT64(d, "v", 0);
    BSON_APPEND_DOUBLE(d, "run_at", it->run_at > 0 ? it->run_at : now + it->delay);
    BSON_APPEND_DOUBLE(d, "created_at", now);
    BSON_APPEND_DOUBLE(d, "lease_expires_at", 0);
    BSON_APPEND_NULL(d, "lease_token");
    return d;
}

/* The id of the live delivery holding this topic and key, or NULL. */
char *mg_dedupe_holder(mjob *j, mongoc_collection_t *cl, const rb_enqueue_item *it,
                       mongoc_client_session_t *cs, int *failed)
{
    bson_t f = BSON_INITIALIZER;
    char *dd = mg_dedupe_value(it->topic, it->key);
    BSON_APPEND_UTF8(&f, "dedupe", dd ? dd : "");
    free(dd);
    bson_t *d = mg_find_one(j, cl, &f, cs, failed);
    bson_destroy(&f);
    char hex[25], *id = NULL;
    if (d && mg_doc_oid(d, hex) && !(id = rb_strdup(hex))) {
        mg_fail(j, "out of memory");
        *failed = 1;
    }
    if (d) bson_destroy(d);
    return id;
}

/* An earlier item of the same batch with this topic and key, or -1. */
long mg_same_key_before(const rb_enqueue_item *items, size_t i)
{
    if (!items[i].key) return -1;
    for (size_t k = 0; k < i; k++)
        if (items[k].key && strcmp(items[k].key, items[i].key) == 0 &&
            strcmp(items[k].topic, items[i].topic) == 0)
            return (long)k;
    return -1;
}

/* Undo for "all or none": deletes what this batch inserted. */
static void enq_undo(mongoc_collection_t *cl, bson_t **docs, const int *inserted, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (!inserted[i] || !docs[i]) continue;
        bson_t sel = BSON_INITIALIZER;
        bson_iter_t it;
        if (bson_iter_init_find(&it, docs[i], "_id")) bson_append_iter(&sel, "_id", -1, &it);
        mongoc_collection_delete_one(cl, &sel, NULL, NULL, NULL);
        bson_destroy(&sel);
    }
}

/* Inserts docs[i] for every i with want[i]; inserted[i] tells which landed, dup[i] which hit
 * the dedupe index. -1: the bulk failed as a whole. */
static int enq_insert(mjob *j, mongoc_collection_t *cl, bson_t **docs, const int *want,
                      int *inserted, int *dup, size_t n)
{
    size_t *map = rb_malloc(n * sizeof *map), m = 0;
    int *codes = rb_malloc(n * sizeof *codes);
    if (!map || !codes) {
        free(map); free(codes);
        mg_fail(j, "out of memory");
        return -1;
    }
    mongoc_bulk_operation_t *b = mg_unordered_bulk(cl);
    for (size_t i = 0; i < n; i++)
        if (want[i]) {
            map[m++] = i;
            mongoc_bulk_operation_insert(b, docs[i]);
        }
    int r = m ? mg_bulk_run(j, b, codes, m, "enqueue") : 1;
    if (!m) mongoc_bulk_operation_destroy(b);
    for (size_t k = 0; r >= 0 && k < m; k++) {
        inserted[map[k]] = codes[k] == 0;
        dup[map[k]] = codes[k] == 11000;
        if (codes[k] && codes[k] != 11000) {
            mg_fail(j, "enqueue: the server refused a delivery (code %d)", codes[k]);
            r = -1;
        }
    }
    free(map);
    free(codes);
    return r < 0 ? -1 : 0;
}

/* FerretDB: the ready queue's entries of the deliveries to insert, written before them so
 * that a delivery never lacks one. */
static int enq_entries(enq_job *q, mongoc_client_t *c, const int *want, double now)
{
    mongoc_collection_t *qc = mg_coll(q->j.s, c, q->j.s->queue);
    qbatch qb;
    mg_qb_init(&qb, qc);
    for (size_t i = 0; i < q->n; i++)
        if (want[i]) {
            const rb_enqueue_item *it = &q->items[i];
            mg_qb_put(&qb, q->ids[i], it->topic, 0, it->run_at > 0 ? it->run_at : now + it->delay, now);
        }
    int r = mg_qb_run(&q->j, &qb, 1);
    mongoc_collection_destroy(qc);
    return r;
}

/* Plain (non-transactional) enqueue: one unordered insert; dedupe conflicts resolve to the
 * holder's id, retried when the holder settled in between. */
static void enq_work(mjob *j, mongoc_client_t *c)
{
    enq_job *q = (enq_job *)j;
    size_t n = q->n;
    double now = mg_now(j->s);
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->base.table);
    bson_t **docs = rb_calloc(n, sizeof *docs);
    int *want = rb_calloc(n, sizeof *want), *ins = rb_calloc(n, sizeof *ins), *dup = rb_calloc(n, sizeof *dup);
    q->ids = rb_calloc(n, sizeof *q->ids);
    if (!docs || !want || !ins || !dup || !q->ids) {
        mg_fail(j, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        char hex[25];
        if (mg_same_key_before(q->items, i) >= 0) continue;
        docs[i] = mg_delivery_doc(q->j.s, &q->items[i], now, hex);
        want[i] = 1;
        if (!(q->ids[i] = rb_strdup(hex))) {
            mg_fail(j, "out of memory");
            goto out;
        }
    }
    if (j->s->ferret && enq_entries(q, c, want, now) < 0) goto out;
    for (int round = 0; round < 5; round++) {
        int *got = rb_calloc(n, sizeof *got);
        if (!got || enq_insert(j, cl, docs, want, got, dup, n) < 0) {
            free(got);
            enq_undo(cl, docs, ins, n);
            goto out;
        }
        int again = 0;
        for (size_t i = 0; i < n; i++) {
            if (got[i]) ins[i] = 1;
            want[i] = 0;
            if (!dup[i]) continue;
            int failed = 0;
            char *holder = mg_dedupe_holder(j, cl, &q->items[i], NULL, &failed);
            if (failed) {
                free(got);
                enq_undo(cl, docs, ins, n);
                goto out;
            }
            if (holder) {
                free(q->ids[i]);
                q->ids[i] = holder;
            } else {
                want[i] = again = 1;   /* the holder settled meanwhile: insert after all */
            }
        }
        free(got);
        if (!again) break;
    }
    for (size_t i = 0; i < n; i++) {
        long k = mg_same_key_before(q->items, i);
        if (k >= 0 && !(q->ids[i] = rb_strdup(q->ids[k]))) {
            mg_fail(j, "out of memory");
            enq_undo(cl, docs, ins, n);
            break;
        }
    }
out:
    for (size_t i = 0; docs && i < n; i++)
        if (docs[i]) bson_destroy(docs[i]);
    free(docs); free(want); free(ins); free(dup);
    mongoc_collection_destroy(cl);
}

static void enq_done(mjob *j, const char *err)
{
    enq_job *q = (enq_job *)j;
    if (!err && j->tx) j->tx->enqueued = 1;     /* not visible before the commit */
    else if (!err) rb_store_notify_local(&j->s->base);
    j->cb.ids(j->ud, err, err ? NULL : q->ids, NULL, err ? 0 : q->n);
    enq_free(q);
}

enq_job *mg_enq_prepare(mstore *s, const rb_enqueue_item *items, size_t n,
                        void (*work)(mjob *, mongoc_client_t *), rb_ids_cb cb, void *ud,
                        char *err, size_t errlen)
{
    enq_job *q = mg_job_new(s, sizeof *q, work, enq_done, (rb_store_cb){.ids = cb}, ud);
    if (!q || !(q->items = rb_calloc(n ? n : 1, sizeof *q->items))) {
        free(q);
        snprintf(err, errlen, MG_OOM);
        return NULL;
    }
    q->n = n;
    for (size_t i = 0; i < n; i++) {
        char why[200];
        const char *payload = items[i].payload ? items[i].payload : "null";
        if (!items[i].topic) {
            snprintf(err, errlen, "mongodb: enqueue: delivery %zu has no topic", i + 1);
        } else if (items[i].group) {
            /* (a claim here filters its candidates after the find, so blocked members of a
             * group would crowd out the heads of others: groups wait for a store that can
             * keep a group's head in the document, docs/stores.md) */
            snprintf(err, errlen, "mongodb: ordered groups are not supported on this store yet");
        } else if (items[i].replace) {
            snprintf(err, errlen, "mongodb: replace is not supported on this store yet");
        } else if (items[i].nafter) {
            snprintf(err, errlen, "mongodb: after (dependencies) is not supported on this store yet");
        } else if (!payload_check(s, payload, why, sizeof why)) {
            snprintf(err, errlen, "mongodb: payload cannot be stored: %s", why);
            mg_one_line(err, errlen);
        } else {
            q->items[i] = items[i];
            q->items[i].topic = rb_strdup(items[i].topic);
            q->items[i].payload = rb_strdup(payload);
            q->items[i].key = mg_dupstr(items[i].key);
            if (q->items[i].topic && q->items[i].payload && (q->items[i].key || !items[i].key))
                continue;
            snprintf(err, errlen, MG_OOM);
            i++;                /* its copies are freed with the others */
        }
        q->n = i;
        enq_free(q);
        return NULL;
    }
    return q;
}

void mg_enqueue(rb_store *st, const rb_enqueue_item *items, size_t n, rb_ids_cb cb, void *ud)
{
    mstore *s = (mstore *)st;
    char err[ERRLEN];
    if (n == 0) {
        cb(ud, NULL, NULL, NULL, 0);
        return;
    }
    enq_job *q = mg_enq_prepare(s, items, n, enq_work, cb, ud, err, sizeof err);
    if (q) mg_submit(s, &q->j);
    else cb(ud, err, NULL, NULL, 0);
}
