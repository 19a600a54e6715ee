/* tx.c -- the MongoDB store's transactions (replica sets only): a client and session held for
 * the transaction's lifetime, its enqueues, its document operations, a fenced completion. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "stores/mongo/mstore.h"
#include "util/alloc.h"
#include "util/list.h"

typedef struct tx_job {
    mjob j;
    rb_tx *tx;
    rb_doc_op op;
    char *collection;
    bson_t *filter, *doc;
    char *found_json;
    int64_t count;
    rb_settle_op *complete;
    int commit;                 /* commit (1) or abort (0) */
} tx_job;

/* An operation of the transaction failed: it can only roll back now, and its commit fails
 * with this first error, whether or not the caller looked at it (store.h, commit). */
void mg_tx_doom(rb_tx *tx, const char *why)
{
    if (!tx->doomed[0]) snprintf(tx->doomed, sizeof tx->doomed, "%s", why);
}

static void tx_unlink(mstore *s, rb_tx *tx)
{
    RB_LIST_REMOVE(&s->txs, tx);
}

static void tx_release(rb_tx *tx)
{
    if (tx->cs) mongoc_client_session_destroy(tx->cs);   /* aborts a transaction still open */
    if (tx->client && tx->s) mongoc_client_pool_push(tx->s->pool, tx->client);
    tx->cs = NULL;
    tx->client = NULL;
}

static void begin_work(mjob *j, mongoc_client_t *c)
{
    (void)c;
    tx_job *q = (tx_job *)j;
    rb_tx *tx = q->tx;
    bson_error_t e;
    tx->client = mongoc_client_pool_pop(j->s->pool);
    tx->cs = mongoc_client_start_session(tx->client, NULL, &e);
    if (!tx->cs || !mongoc_client_session_start_transaction(tx->cs, NULL, &e)) {
        mg_fail_bson(j, "begin", &e);
        tx_release(tx);
    }
}

static void begin_done(mjob *j, const char *err)
{
    tx_job *q = (tx_job *)j;
    if (err) {
        free(q->tx);
        j->cb.tx(j->ud, err, NULL);
    } else {
        mstore *s = j->s;
        RB_LIST_PUSH(&s->txs, q->tx);
        j->cb.tx(j->ud, NULL, q->tx);
    }
    free(q);
}

void mg_begin(rb_store *st, rb_tx_cb cb, void *ud)
{
    mstore *s = (mstore *)st;
    if (!s->replset) {
        cb(ud, "mongodb: transactions need a MongoDB replica set (this server is standalone"
               " or FerretDB, which has no multi-document transactions)", NULL);
        return;
    }
    tx_job *q = mg_job_new(s, sizeof *q, begin_work, begin_done, (rb_store_cb){.tx = cb}, ud);
    rb_tx *tx = rb_calloc(1, sizeof *tx);
    if (!q || !tx) {
        free(q); free(tx);
        cb(ud, MG_OOM, NULL);
        return;
    }
    tx->s = s;
    q->tx = tx;
    mg_submit(s, &q->j);
}

/* Enqueue inside a transaction: a duplicate-key error would abort the whole transaction, so
 * dedupe is check-then-insert here; the unique index still guards against a concurrent one. */
static void tx_enq_work(mjob *j, mongoc_client_t *c)
{
    enq_job *q = (enq_job *)j;
    mongoc_client_session_t *cs = j->tx->cs;
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->base.table);
    double now = mg_now(j->s);
    q->ids = rb_calloc(q->n, sizeof *q->ids);
    for (size_t i = 0; q->ids && i < q->n && !j->err[0]; i++) {
        long k = mg_same_key_before(q->items, i);
        if (k >= 0) {
            if (!(q->ids[i] = rb_strdup(q->ids[k]))) mg_fail(j, "out of memory");
            continue;
        }
        int failed = 0;
        char *holder = q->items[i].key ? mg_dedupe_holder(j, cl, &q->items[i], cs, &failed) : NULL;
        if (failed || holder) {
            q->ids[i] = holder;
            continue;
        }
        char hex[25];
        bson_t *d = mg_delivery_doc(q->j.s, &q->items[i], now, hex), opts = BSON_INITIALIZER;
        bson_error_t e;
        if (!mongoc_client_session_append(cs, &opts, &e) ||
            !mongoc_collection_insert_one(cl, d, &opts, NULL, &e))
            mg_fail_bson(j, "enqueue", &e);
        else if (!(q->ids[i] = rb_strdup(hex))) mg_fail(j, "out of memory");
        bson_destroy(&opts);
        bson_destroy(d);
    }
    if (!q->ids) mg_fail(j, "out of memory");
    mongoc_collection_destroy(cl);
}

void mg_tx_enqueue(rb_tx *tx, const rb_enqueue_item *items, size_t n, rb_ids_cb cb, void *ud)
{
    char err[ERRLEN];
    if (!tx->s) {
        cb(ud, MG_STORE_CLOSED, NULL, NULL, 0);
        return;
    }
    for (size_t i = 0; i < n; i++)
        if (items[i].replace || items[i].nafter || items[i].group) {
            /* (a transaction needs a replica set, where nothing here has run: docs/stores.md) */
            cb(ud, items[i].replace ? "mongodb: replace in a transaction is not supported on this store yet"
                   : items[i].group ? "mongodb: a group in a transaction is not supported on this store yet"
                                    : "mongodb: after in a transaction is not supported on this store yet",
               NULL, NULL, 0);
            return;
        }
    enq_job *q = mg_enq_prepare(tx->s, items, n, tx_enq_work, cb, ud, err, sizeof err);
    if (!q) {
        cb(ud, err, NULL, NULL, 0);
        return;
    }
    q->j.tx = tx;
    mg_submit(tx->s, &q->j);
}

static int64_t reply_count(const bson_t *reply, const char *field)
{
    return mg_doc_int(reply, field);
}

static void tx_doc_find(tx_job *q, mongoc_collection_t *cl)
{
    int failed = 0;
    bson_t *d = mg_find_one(&q->j, cl, q->filter, q->tx->cs, &failed);
    if (d) {
        q->found_json = bson_as_relaxed_extended_json(d, NULL);
        q->count = 1;
        bson_destroy(d);
    }
}

static void tx_doc_work(mjob *j, mongoc_client_t *c)
{
    tx_job *q = (tx_job *)j;
    mongoc_collection_t *cl = mongoc_client_get_collection(c, j->s->db, q->collection);
    bson_t opts = BSON_INITIALIZER, reply = BSON_INITIALIZER;
    bson_error_t e;
    int ok = mongoc_client_session_append(q->tx->cs, &opts, &e);
    if (ok) {
        bson_destroy(&reply);
        switch (q->op) {
        case RB_DOC_INSERT_ONE:
            ok = mongoc_collection_insert_one(cl, q->doc, &opts, &reply, &e);
            q->count = ok ? reply_count(&reply, "insertedCount") : 0;
            break;
        case RB_DOC_UPDATE_ONE:
            ok = mongoc_collection_update_one(cl, q->filter, q->doc, &opts, &reply, &e);
            q->count = ok ? reply_count(&reply, "modifiedCount") : 0;
            break;
        case RB_DOC_DELETE_ONE:
            ok = mongoc_collection_delete_one(cl, q->filter, &opts, &reply, &e);
            q->count = ok ? reply_count(&reply, "deletedCount") : 0;
            break;
        case RB_DOC_FIND_ONE:
        default:
            bson_init(&reply);
            tx_doc_find(q, cl);
            break;
        }
    }
    if (!ok) mg_fail_bson(j, "collection", &e);
    bson_destroy(&reply);
    bson_destroy(&opts);
    mongoc_collection_destroy(cl);
}

static void tx_doc_done(mjob *j, const char *err)
{
    tx_job *q = (tx_job *)j;
    j->cb.doc(j->ud, err, err ? NULL : q->found_json, err ? 0 : q->count);
    if (q->filter) bson_destroy(q->filter);
    if (q->doc) bson_destroy(q->doc);
    bson_free(q->found_json);
    free(q->collection);
    free(q);
}

static bson_t *parse_json(const char *json, const char *what, char *err, size_t errlen)
{
    bson_error_t e;
    bson_t *b = bson_new_from_json((const uint8_t *)(json ? json : "{}"), -1, &e);
    if (!b) {
        snprintf(err, errlen, "mongodb: invalid %s: %.200s", what, e.message);
        mg_one_line(err, errlen);
    }
    return b;
}

void mg_tx_doc(rb_tx *tx, rb_doc_op op, const char *collection, const char *filter_json,
               const char *doc_json, rb_doc_cb cb, void *ud)
{
    char err[ERRLEN] = "";
    if (!tx->s) {
        cb(ud, MG_STORE_CLOSED, NULL, 0);
        return;
    }
    if (!collection || !*collection) {
        cb(ud, "mongodb: collection name is empty", NULL, 0);
        return;
    }
    tx_job *q = mg_job_new(tx->s, sizeof *q, tx_doc_work, tx_doc_done, (rb_store_cb){.doc = cb}, ud);
    if (!q) {
        cb(ud, MG_OOM, NULL, 0);
        return;
    }
    q->j.tx = q->tx = tx;
    q->op = op;
    q->collection = rb_strdup(collection);
    if (!q->collection) snprintf(err, sizeof err, MG_OOM);
    else if (op != RB_DOC_INSERT_ONE) q->filter = parse_json(filter_json, "filter", err, sizeof err);
    if (!err[0] && (op == RB_DOC_INSERT_ONE || op == RB_DOC_UPDATE_ONE))
        q->doc = parse_json(doc_json, "document", err, sizeof err);
    if (err[0]) {
        mg_tx_doom(tx, err);
        q->j.done = tx_doc_done;
        tx_doc_done(&q->j, err);
        return;
    }
    mg_submit(tx->s, &q->j);
}

/* The fenced completion inside the transaction: the version filter and a ticket make it
 * conflict with any concurrent change of the delivery. 1: applied; 0: lease lost; -1: error. */
static int tx_complete(tx_job *q, mongoc_client_t *c)
{
    mjob *j = &q->j;
    mongoc_client_session_t *cs = q->tx->cs;
    rb_settle_op *op = q->complete;
    double now = mg_now(j->s);
    int ok, failed = 0, r = 0;
    bson_t *sel = mg_oid_sel(op->id, &ok);
    mongoc_collection_t *cl = mg_coll(j->s, c, j->s->base.table), *tk = mg_coll(j->s, c, j->s->tickets);
    bson_t *d = ok ? mg_find_one(j, cl, sel, cs, &failed) : NULL;
    if (failed) r = -1;
    else if (d && mg_holds_lease(d, op->token)) {
        cas_op cop;
        bson_t opts = BSON_INITIALIZER, t = BSON_INITIALIZER, reply;
        bson_error_t e;
        mg_cas_init(j->s, &cop, d, "d", mg_upd_settle(d, op, now));
        BSON_APPEND_UTF8(&t, "_id", cop.ticket);
        BSON_APPEND_UTF8(&t, "d", cop.owner);
        BSON_APPEND_DOUBLE(&t, "at", now);
        int sent = 0;
        if (mongoc_client_session_append(cs, &opts, &e) &&
            mongoc_collection_insert_one(tk, &t, &opts, NULL, &e) &&
            (sent = 1) && mongoc_collection_update_one(cl, &cop.filter, cop.update, &opts, &reply, &e)) {
            r = reply_count(&reply, "modifiedCount") == 1;
        } else {
            r = e.code == 11000 || e.code == 112 ? 0 : -1;   /* duplicate ticket, write conflict */
            if (r < 0) mg_fail_bson(j, "commit", &e);
        }
        if (sent) bson_destroy(&reply);     /* update_one always initialises it */
        bson_destroy(&opts);
        bson_destroy(&t);
        mg_cas_clear(&cop);
    }
    if (d) bson_destroy(d);
    bson_destroy(sel);
    mongoc_collection_destroy(cl);
    mongoc_collection_destroy(tk);
    return r;
}

static void end_work(mjob *j, mongoc_client_t *c)
{
    tx_job *q = (tx_job *)j;
    bson_error_t e;
    int commit = q->commit;
    if (commit && q->tx->doomed[0]) {  /* an operation failed: nothing of it commits */
        snprintf(j->err, sizeof j->err, "%s", q->tx->doomed);  /* already "mongodb: ..." */
        commit = 0;
    }
    if (commit && q->complete) {
        int r = tx_complete(q, c);
        q->complete->applied = r == 1;
        if (r != 1) commit = 0;
    }
    if (commit) {
        bson_t reply;
        if (!mongoc_client_session_commit_transaction(q->tx->cs, &reply, &e))
            mg_fail_bson(j, "commit", &e);
        bson_destroy(&reply);
    } else if (!mongoc_client_session_abort_transaction(q->tx->cs, &e) && !j->err[0]) {
        mg_fail_bson(j, "rollback", &e);
    }
    if (q->complete && j->err[0]) q->complete->applied = 0;
    if (q->complete && !q->complete->applied && q->complete->token)
        free(mg_limits_ended(j->s, q->complete->token));   /* the run ended: forgotten here */
    if (q->complete && q->complete->applied) {
        /* completed for good: the deliveries after it (deps.c, groups.c) and its limit's slot
         * (limits.c), as a settle outside a transaction does */
        char *id = (char *)q->complete->id;
        mg_deps_after_write(j, c, MG_DEPS_SETTLED, &id, 1);
        char *topic = q->complete->token ? mg_limits_ended(j->s, q->complete->token) : NULL;
        if (topic) {
            char kept[ERRLEN], *tok = (char *)q->complete->token;
            memcpy(kept, j->err, sizeof kept);
            if (mg_limits_give_back(j, c, topic, &tok, 1) == 0) j->released = 1;
            memcpy(j->err, kept, sizeof kept);
            free(topic);
        }
    }
}

static void end_done(mjob *j, const char *err)
{
    tx_job *q = (tx_job *)j;
    rb_tx *tx = q->tx;
    mstore *s = tx->s;
    if (s) {
        tx_unlink(s, tx);
        tx_release(tx);
    }
    int wake = s && !err && q->commit && tx->enqueued && (!q->complete || q->complete->applied);
    free(tx);
    if (wake) rb_store_notify_local(&s->base);
    if (j->cb.done) j->cb.done(j->ud, err);     /* a rollback may come without callback */
    free(q);
}

static void tx_end(rb_tx *tx, int commit, rb_settle_op *complete, rb_done_cb cb, void *ud)
{
    if (complete) complete->applied = 0;
    if (!tx->s) {
        free(tx);
        if (cb) cb(ud, MG_STORE_CLOSED);
        return;
    }
    tx_job *q = mg_job_new(tx->s, sizeof *q, end_work, end_done, (rb_store_cb){.done = cb}, ud);
    if (!q) {
        tx_unlink(tx->s, tx);
        tx_release(tx);
        free(tx);
        if (cb) cb(ud, MG_OOM);
        return;
    }
    q->j.tx = q->tx = tx;
    q->commit = commit;
    q->complete = complete;
    mg_submit(tx->s, &q->j);
}

void mg_commit(rb_tx *tx, rb_settle_op *complete, rb_done_cb cb, void *ud)
{
    tx_end(tx, 1, complete, cb, ud);
}

void mg_rollback(rb_tx *tx, rb_done_cb cb, void *ud)
{
    tx_end(tx, 0, NULL, cb, ud);
}

void mg_tx_close_all(mstore *s)
{
    while (s->txs) {          /* the caller still owns each rb_tx: leave it dead, not freed */
        rb_tx *tx = s->txs;
        tx_unlink(s, tx);
        tx_release(tx);
        tx->s = NULL;
    }
}
