/* tickets.c -- the MongoDB store's compare-and-set through write tickets.
 *
 * FerretDB 1.x (the test server) applies findAndModify and update as a read, an in-memory
 * change and an unconditional write by _id, so two clients can both "win" the same document;
 * and it pushes only a filter of exactly {_id: X} down to SQLite (any other filter scans the
 * collection). Its unique indexes, _id's included, are real. So every change of an existing
 * delivery or lease is: read it (version v), insert the ticket "<doc>:<v+1>" into
 * <table>_tickets (only one writer can), then write it by _id. A writer whose ticket insert
 * fails lost the race. On MongoDB the write also filters on v, which is atomic there.
 * A ticket whose write never landed (a crash between the two) is passed by the next writer
 * once it is STALE_TICKET_S old, through the ticket "<doc>:<v+1>.<k>" (never removed and taken
 * again: see cas_ticket_stale); tickets older than TICKET_TTL_S are pruned (jobs.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "stores/mongo/mstore.h"
#include "util/alloc.h"

void mg_cas_init(mstore *s, cas_op *op, const bson_t *cur, const char *prefix, bson_t *update)
{
    bson_iter_t it;
    char idtxt[120] = "";
    bson_init(&op->sel);
    if (bson_iter_init_find(&it, cur, "_id")) {
        bson_append_iter(&op->sel, "_id", -1, &it);
        if (BSON_ITER_HOLDS_OID(&it)) bson_oid_to_string(bson_iter_oid(&it), idtxt);
        else if (BSON_ITER_HOLDS_UTF8(&it)) snprintf(idtxt, sizeof idtxt, "%s", bson_iter_utf8(&it, NULL));
    }
    op->old_v = mg_doc_int(cur, "v");
    bson_copy_to(&op->sel, &op->filter);
    if (!s->ferret) BSON_APPEND_INT64(&op->filter, "v", op->old_v);
    snprintf(op->owner, sizeof op->owner, "%s:%s", prefix, idtxt);
    snprintf(op->ticket, sizeof op->ticket, "%s:%lld", op->owner, (long long)(op->old_v + 1));
    op->update = update;
    op->won = 0;
    op->code = 0;
}

void mg_cas_clear(cas_op *op)
{
    bson_destroy(&op->sel);
    bson_destroy(&op->filter);
    if (op->update) bson_destroy(op->update);
    op->update = NULL;
}

void mg_cas_free(cas_op *ops, size_t n)
{
    for (size_t i = 0; i < n; i++) mg_cas_clear(&ops[i]);
    free(ops);
}

/* A ticket whose write never landed (its writer died between the two) would block its
 * document for good. It is never removed so that it can be taken again: FerretDB deletes by a
 * filter as a read (of a snapshot, and only {_id: X} is pushed down, so it scans the tickets)
 * and then an unconditional delete by _id, so two writers removing the same stale ticket at
 * once could remove the fresh one a third took in between, and a fourth, which read the
 * document before the third wrote it, took the same ticket again: two writes of one version
 * (both claims "won": two runs of one delivery, same fence). Instead, once the ticket is
 * STALE_TICKET_S old and the document still has the version it was taken against, a writer
 * passes it: it takes the next ticket of that version, "<doc>:<v+1>.<k>", which again only
 * one writer can, so versions still grow by one per write, each through one ticket. Passed
 * tickets go with the TTL prune. 1: op->ticket is such a ticket. */
static int cas_ticket_stale(mongoc_collection_t *docs, mongoc_collection_t *tk, const cas_op *op,
                            double now)
{
    bson_t tsel = BSON_INITIALIZER;
    const bson_t *d;
    int stale = 0;
    BSON_APPEND_UTF8(&tsel, "_id", op->ticket);
    mongoc_cursor_t *cur = mongoc_collection_find_with_opts(tk, &tsel, NULL, NULL);
    if (mongoc_cursor_next(cur, &d)) stale = mg_doc_num(d, "at") < now - STALE_TICKET_S;
    mongoc_cursor_destroy(cur);
    bson_destroy(&tsel);
    if (stale) {
        int64_t v = -1;
        cur = mongoc_collection_find_with_opts(docs, &op->sel, NULL, NULL);
        if (mongoc_cursor_next(cur, &d)) v = mg_doc_int(d, "v");
        mongoc_cursor_destroy(cur);
        stale = v == op->old_v;     /* else its write landed, or another one since */
    }
    return stale;
}

#define TICKET_PASSES 16    /* dead writers of one version in a row, at most */

/* The ticket was taken: pass it if it is stale (see above); op->won when a next one was won. */
static void cas_pass_stale(mongoc_collection_t *docs, mongoc_collection_t *tk, cas_op *op,
                           double now)
{
    for (int k = 1; k <= TICKET_PASSES && cas_ticket_stale(docs, tk, op, now); k++) {
        bson_t t = BSON_INITIALIZER;
        bson_error_t e;
        snprintf(op->ticket, sizeof op->ticket, "%s:%lld.%d", op->owner, (long long)(op->old_v + 1), k);
        BSON_APPEND_UTF8(&t, "_id", op->ticket);
        BSON_APPEND_UTF8(&t, "d", op->owner);
        BSON_APPEND_DOUBLE(&t, "at", now);
        int ok = mongoc_collection_insert_one(tk, &t, NULL, NULL, &e);
        bson_destroy(&t);
        if (ok) {
            op->won = 1;
            return;
        }
        if (e.code != 11000) return;    /* lost this time; a ticket that landed is passed later */
    }
}

static int cas_take_tickets(mjob *j, mongoc_collection_t *docs, mongoc_collection_t *tk,
                            cas_op *ops, size_t n, double now, int *codes)
{
    mongoc_bulk_operation_t *b = mg_unordered_bulk(tk);
    for (size_t i = 0; i < n; i++) {
        bson_t t = BSON_INITIALIZER;
        BSON_APPEND_UTF8(&t, "_id", ops[i].ticket);
        BSON_APPEND_UTF8(&t, "d", ops[i].owner);
        BSON_APPEND_DOUBLE(&t, "at", now);
        mongoc_bulk_operation_insert(b, &t);
        bson_destroy(&t);
    }
    int r = mg_bulk_run(j, b, codes, n, "write ticket");
    if (r < 0) return -1;
    for (size_t i = 0; i < n; i++) {
        ops[i].won = codes[i] == 0;
        if (codes[i] == 11000) cas_pass_stale(docs, tk, &ops[i], now);
        else if (codes[i]) ops[i].code = codes[i];  /* refused, not lost to another writer */
    }
    return 0;
}

static void cas_drop_tickets(mongoc_collection_t *tk, cas_op *ops, size_t n, const int *failed)
{
    for (size_t i = 0; i < n; i++) {
        if (!failed[i]) continue;
        bson_t del = BSON_INITIALIZER;
        BSON_APPEND_UTF8(&del, "_id", ops[i].ticket);
        mongoc_collection_delete_one(tk, &del, NULL, NULL, NULL);
        bson_destroy(&del);
    }
}

/* FerretDB 1.24 keeps every statement of an update command holding a SQLite connection until
 * the whole command ends (a defer inside its loop): a bulk of k updates pins k of its 100
 * pooled connections, and two such bulks at once deadlock the server for good. So there each
 * write is a command of its own. -1: the store could not be asked; else codes[i] per op. */
static int cas_write_each(mjob *j, mongoc_collection_t *docs, cas_op *ops, size_t n, int *codes)
{
    for (size_t i = 0; i < n; i++) {
        bson_error_t e;
        codes[i] = 0;
        if (!ops[i].won) continue;
        int ok = ops[i].update
                     ? mongoc_collection_update_one(docs, &ops[i].filter, ops[i].update, NULL, NULL, &e)
                     : mongoc_collection_delete_one(docs, &ops[i].filter, NULL, NULL, &e);
        if (ok) continue;
        if (e.domain != MONGOC_ERROR_SERVER && e.domain != MONGOC_ERROR_WRITE_CONCERN) {
            mg_fail_bson(j, "write", &e);
            return -1;
        }
        codes[i] = e.code ? (int)e.code : 1;
        /* FerretDB reports a unique index broken by an update as InternalError. */
        if (strstr(e.message, "UNIQUE constraint failed")) codes[i] = 11000;
    }
    return 0;
}

static void cas_refused(mongoc_collection_t *tk, cas_op *ops, size_t n, int *codes)
{
    for (size_t i = 0; i < n; i++) {
        if (!codes[i]) continue;
        ops[i].won = 0;
        ops[i].code = codes[i];
    }
    cas_drop_tickets(tk, ops, n, codes);
}

/* Applies ops whose tickets were won; a write the server refused (e.g. the dedupe index)
 * gives its ticket back at once, since the document did not change. */
static int cas_write(mjob *j, mongoc_collection_t *docs, mongoc_collection_t *tk,
                     cas_op *ops, size_t n, int *codes)
{
    if (j->s->ferretdb) {       /* the server, not the dialect: see cas_write_each */
        if (cas_write_each(j, docs, ops, n, codes) < 0) return -1;
        cas_refused(tk, ops, n, codes);
        return 0;
    }
    size_t *map = rb_malloc((n ? n : 1) * sizeof *map), m = 0;
    int *wcodes = rb_malloc((n ? n : 1) * sizeof *wcodes);
    if (!map || !wcodes) {
        free(map); free(wcodes);
        mg_fail(j, "out of memory");
        return -1;
    }
    mongoc_bulk_operation_t *b = mg_unordered_bulk(docs);
    for (size_t i = 0; i < n; i++) {
        if (!ops[i].won) continue;
        map[m++] = i;
        if (ops[i].update) mongoc_bulk_operation_update_one(b, &ops[i].filter, ops[i].update, false);
        else mongoc_bulk_operation_remove_one(b, &ops[i].filter);
    }
    int r = 0;
    if (m) {
        r = mg_bulk_run(j, b, wcodes, m, "write");
        if (r == 0) {
            for (size_t i = 0; i < n; i++) codes[i] = 0;
            for (size_t k = 0; k < m; k++) codes[map[k]] = wcodes[k];
            cas_refused(tk, ops, n, codes);
        }
    } else {
        mongoc_bulk_operation_destroy(b);
    }
    free(map);
    free(wcodes);
    return r < 0 ? -1 : 0;
}

/* 0: ops[i].won tells which changes were written; -1: the store could not be asked. */
int mg_cas_run(mjob *j, mongoc_client_t *c, const char *docs_name, cas_op *ops, size_t n,
               double now)
{
    if (!n) return 0;
    mstore *s = j->s;
    int *codes = rb_calloc(n, sizeof *codes);
    if (!codes) {
        mg_fail(j, "out of memory");
        return -1;
    }
    mongoc_collection_t *docs = mg_coll(s, c, docs_name), *tk = mg_coll(s, c, s->tickets);
    int r = cas_take_tickets(j, docs, tk, ops, n, now, codes);
    if (r == 0) r = cas_write(j, docs, tk, ops, n, codes);
    mongoc_collection_destroy(docs);
    mongoc_collection_destroy(tk);
    free(codes);
    return r;
}

