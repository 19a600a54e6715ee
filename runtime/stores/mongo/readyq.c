/* readyq.c -- the MongoDB store's ready queue (FerretDB only).
 * FerretDB pushes down to SQLite only a filter of exactly {_id: X}, and a LIMIT only when the
 * find has no filter and no sort; anything else decodes every document of the collection in
 * Go, so a claim that searched the deliveries for due ones cost time in proportion to all of
 * them, completed ones included. There, <table>_queue holds entries {_id: "<delivery>:<g>",
 * d: delivery id, t: topic, g: generation, at: not before (epoch s), c: created}, and a claim
 * reads only the head of it (find {} with a limit: O(limit)), then each delivery by _id.
 *
 * The invariant: every live (pending or processing) delivery has at least one entry. An entry
 * is written before its delivery (enqueue, kick), and one is removed only when its delivery
 * is settled (completed, buried), gone for QUEUE_ORPHAN_S, or when its successor (the same
 * delivery, generation g + 1, inserted at the tail) is in place: a claim moves the entries of
 * what it claimed, and of what it could not use when the head it read was full, to the tail.
 * The settle that completes or buries a delivery this process claimed removes the entry that
 * claim left (its generation is kept with the claimed version); any other leftover is removed
 * by the claim that reads it and finds the delivery settled.
 * Successors with the same id make concurrent moves collapse into one entry. The deliveries
 * stay the truth: an entry is only a hint of where to look, so duplicates and leftovers cost
 * a read, never a double claim (the tickets still decide). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "stores/mongo/mstore.h"
#include "util/alloc.h"
#include "util/check.h"

/* Entry ids are "<24 hex>:<generation>". Deletions are collected as ids and sent after the
 * inserts, minus any id the same batch inserts: a successor may carry the id of an entry this
 * batch also drops (a duplicate of the delivery read earlier, left by a process killed
 * between the insert and the delete of a move), and sending both would leave the delivery
 * with no entry at all, so no claim would ever find it again. */
void mg_qb_init(qbatch *b, mongoc_collection_t *qc)
{
    memset(b, 0, sizeof *b);
    b->qc = qc;
    b->ins = mg_unordered_bulk(qc);
}

static int qid_push(qid **v, size_t *n, size_t *cap, const char *id)
{
    if (*n == *cap) {
        size_t nc = *cap ? *cap * 2 : 32;
        qid *g = rb_realloc(*v, nc * sizeof **v);
        if (!g) return 0;
        *v = g;
        *cap = nc;
    }
    RB_ASSERT(*n < *cap && strlen(id) < sizeof(qid));   /* an entry id is "<24 hex>:<g>" */
    snprintf((*v)[(*n)++], sizeof(qid), "%s", id);
    return 1;
}

static int qid_cmp(const void *a, const void *b) { return strcmp(a, b); }

static void qentry_add(mongoc_bulk_operation_t *bk, const char *hex, const char *topic, int64_t g,
                       double at, double now)
{
    bson_t e = BSON_INITIALIZER;
    char id[64];
    snprintf(id, sizeof id, "%s:%lld", hex, (long long)g);
    BSON_APPEND_UTF8(&e, "_id", id);
    BSON_APPEND_UTF8(&e, "d", hex);
    BSON_APPEND_UTF8(&e, "t", topic ? topic : "");
    BSON_APPEND_INT64(&e, "g", g);
    BSON_APPEND_DOUBLE(&e, "at", at);
    BSON_APPEND_DOUBLE(&e, "c", now);
    mongoc_bulk_operation_insert(bk, &e);
    bson_destroy(&e);
}

void mg_qb_put(qbatch *b, const char *hex, const char *topic, int64_t g, double at, double now)
{
    char id[64];
    snprintf(id, sizeof id, "%s:%lld", hex ? hex : "", (long long)g);
    if (!qid_push(&b->ins_ids, &b->nins, &b->cap_ins, id)) { b->oom = 1; return; }
    qentry_add(b->ins, hex, topic, g, at, now);
}

/* Removes the entry "<hex>:<g>". */
void mg_qb_drop(qbatch *b, const char *hex, int64_t g)
{
    char id[64];
    snprintf(id, sizeof id, "%s:%lld", hex, (long long)g);
    if (!qid_push(&b->del_ids, &b->ndel, &b->cap_del, id)) b->oom = 1;
}

void mg_qb_del(qbatch *b, const bson_t *entry)
{
    const char *id = mg_doc_str(entry, "_id");
    if (id && !qid_push(&b->del_ids, &b->ndel, &b->cap_del, id)) b->oom = 1;
}

/* Moves an entry to the tail: its successor first, then (qb_run) the entry itself. */
void mg_qb_move(qbatch *b, const bson_t *entry, double at, double now)
{
    mg_qb_put(b, mg_doc_str(entry, "d"), mg_doc_str(entry, "t"), mg_doc_int(entry, "g") + 1, at, now);
    mg_qb_del(b, entry);
}

/* Inserts, then deletes only when every insert landed (or its id was there already). Returns
 * 0, or -1 with j->err set when `report`. */
int mg_qb_run(mjob *j, qbatch *b, int report)
{
    int ok = !b->oom;
    if (!ok && report) mg_fail(j, "out of memory");
    if (ok && b->nins) {
        int *codes = rb_calloc(b->nins, sizeof *codes);
        char keep[ERRLEN];
        memcpy(keep, j->err, sizeof keep);
        if (!codes) {
            mongoc_bulk_operation_destroy(b->ins);
            ok = 0;
            if (report) mg_fail(j, "out of memory");
        } else {
            int r = mg_bulk_run(j, b->ins, codes, b->nins, "queue");
            if (r < 0) ok = 0;
            for (size_t i = 0; r >= 0 && i < b->nins; i++)
                if (codes[i] && codes[i] != 11000) {
                    ok = 0;
                    if (report) mg_fail(j, "queue: the server refused an entry (code %d)", codes[i]);
                }
            free(codes);
        }
        if (!report) memcpy(j->err, keep, sizeof keep);
    } else {
        mongoc_bulk_operation_destroy(b->ins);
    }
    if (ok && b->ndel) {
        if (b->nins) qsort(b->ins_ids, b->nins, sizeof *b->ins_ids, qid_cmp);
        mongoc_bulk_operation_t *del = mg_unordered_bulk(b->qc);
        size_t n = 0;
        for (size_t i = 0; i < b->ndel; i++) {
            if (b->nins && bsearch(b->del_ids[i], b->ins_ids, b->nins, sizeof *b->ins_ids, qid_cmp))
                continue;       /* the batch's own successor: it stays */
            bson_t sel = BSON_INITIALIZER;
            BSON_APPEND_UTF8(&sel, "_id", b->del_ids[i]);
            mongoc_bulk_operation_remove_one(del, &sel);
            bson_destroy(&sel);
            n++;
        }
        if (n) {
            bson_t reply;
            bson_error_t e;
            mongoc_bulk_operation_execute(del, &reply, &e);   /* a leftover costs a read later */
            bson_destroy(&reply);
        }
        mongoc_bulk_operation_destroy(del);
    }
    free(b->ins_ids);
    free(b->del_ids);
    b->ins = NULL;
    b->ins_ids = b->del_ids = NULL;
    return ok ? 0 : -1;
}

/* FerretDB: a deliveries collection from before the queue existed gets an entry for each live
 * delivery, once (the one full scan), when the queue collection is made. */
int mg_queue_backfill(mstore *s, mongoc_client_t *c, char *err, size_t errlen)
{
    bson_error_t e;
    memset(&e, 0, sizeof e);
    mongoc_database_t *d = mongoc_client_get_database(c, s->db);
    int has = mongoc_database_has_collection(d, s->queue, &e);
    int ok = 1;
    if (!has && e.code == 0) {
        mongoc_collection_t *qc = mongoc_database_create_collection(d, s->queue, NULL, &e);
        if (qc) mongoc_collection_destroy(qc);
        else if (e.code != 48) ok = 0;  /* 48: another process made it meanwhile */
        mongoc_collection_t *cl = mg_coll(s, c, s->base.table);
        bson_t *f = BCON_NEW("status", "{", "$in", "[", BCON_UTF8("pending"), BCON_UTF8("processing"), "]", "}");
        mongoc_cursor_t *cur = ok ? mongoc_collection_find_with_opts(cl, f, NULL, NULL) : NULL;
        const bson_t *doc;
        mjob j;
        memset(&j, 0, sizeof j);
        j.s = s;
        qbatch qb;
        mg_qb_init(&qb, qc = mg_coll(s, c, s->queue));
        double now = mg_now(s);
        while (cur && mongoc_cursor_next(cur, &doc)) {
            char hex[25];
            if (mg_doc_oid(doc, hex)) mg_qb_put(&qb, hex, mg_doc_str(doc, "topic"), 0, 0, now);
        }
        if (cur && mongoc_cursor_error(cur, &e)) ok = 0;
        if (cur) mongoc_cursor_destroy(cur);
        if (mg_qb_run(&j, &qb, 1) < 0 && ok) {
            ok = 0;
            snprintf(e.message, sizeof e.message, "%s", j.err);
        }
        mongoc_collection_destroy(qc);
        mongoc_collection_destroy(cl);
        bson_destroy(f);
    } else if (!has) {
        ok = 0;
    }
    if (!ok) {
        snprintf(err, errlen, "mongodb: cannot create the queue %s.%s: %.200s", s->db, s->queue, e.message);
        mg_one_line(err, errlen);
    }
    mongoc_database_destroy(d);
    return ok;
}

int mg_requeue(mjob *j, mongoc_client_t *c, const char *hex, const char *topic, double at,
               double now, int after)
{
    mongoc_collection_t *qc = mg_coll(j->s, c, j->s->queue);
    qbatch qb;
    mg_qb_init(&qb, qc);
    mg_qb_put(&qb, hex, topic, after ? MG_REQUEUE_AFTER_G(now) : (int64_t)(now * 1e6), at, now);
    int r = mg_qb_run(j, &qb, 1);
    mongoc_collection_destroy(qc);
    return r;
}
