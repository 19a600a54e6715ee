/* store_mongo.c -- the MongoDB store on libmongoc: deliveries in one collection, named leases
 * in <table>_leases, write tickets in <table>_tickets. libmongoc blocks, so every operation is
 * a job run by a small thread pool; results return to the loop through an ev_async.
 *
 * Compare-and-set. FerretDB 1.x (the test server) applies findAndModify and update as a read,
 * an in-memory change and an unconditional write by _id, so two clients can both "win" the
 * same document; and it pushes only a filter of exactly {_id: X} down to SQLite (any other
 * filter scans the collection). Its unique indexes, _id's included, are real. So every change
 * of an existing delivery or lease is: read it (version v), insert the ticket "<doc>:<v+1>"
 * into <table>_tickets (only one writer can), then write it by _id. A writer whose ticket
 * insert fails lost the race. On MongoDB the write also filters on v, which is atomic there.
 * A ticket whose write never landed (a crash between the two) is removed by the next writer
 * once it is STALE_TICKET_S old; tickets older than TICKET_TTL_S are pruned.
 *
 * Time: expiry and due-ness use the server's clock (hello's localTime, kept as an offset from
 * ours and refreshed every CLOCK_REFRESH_S); FerretDB has no $$NOW nor pipeline updates.
 * Payloads are stored as their JSON text (exact round trip), after checking BSON could hold
 * them. Dedupe keys live in a `dedupe` field (topic and key) that only pending and processing
 * deliveries carry, under a unique sparse index. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <mongoc/mongoc.h>
#include "store.h"

#define NWORKERS 3
#define CLOCK_REFRESH_S 30.0
#define STALE_TICKET_S 60.0
#define TICKET_TTL_S 3600.0
#define PRUNE_EVERY_S 300.0     /* a ticket outlives TICKET_TTL_S by this much at most */
#define BATCH_ROUND 500         /* kick/purge rows per round */
#define ERRLEN 320
#define VC_BUCKETS 4096
#define VC_MAX 200000           /* cached versions kept at most (then the cache starts over) */
#define VC_TTL_S 600.0          /* well inside TICKET_TTL_S: an older one is read again */

typedef struct mstore mstore;
typedef struct mjob mjob;

struct rb_tx {
    mstore *s;                  /* NULL once the store closed under it */
    mongoc_client_t *client;    /* popped from the pool for the transaction's lifetime */
    mongoc_client_session_t *cs;
    int enqueued;               /* wake local dispatchers once this commits */
    rb_tx *prev, *next;
};

struct mjob {
    mjob *next;
    mstore *s;
    rb_tx *tx;                              /* tx operations run on the tx's client */
    void (*work)(mjob *j, mongoc_client_t *c);  /* worker thread */
    void (*done)(mjob *j, const char *err);     /* loop thread; frees the job */
    char err[ERRLEN];
};

struct mstore {
    rb_store base;
    mongoc_uri_t *uri;
    mongoc_client_pool_t *pool;
    char *db, *leases, *tickets, *queue;
    int ferret;                 /* the server is FerretDB */
    int replset;                /* transactions possible */
    pthread_t threads[NWORKERS];
    int nthreads;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    mjob *queue_head, *queue_tail;  /* waiting for a worker (mu) */
    mjob *done_head, *done_tail;    /* finished, waiting for the loop (mu) */
    int stopping;                   /* workers exit (mu) */
    double clock_offset;            /* server time - our wall time (mu) */
    double clock_checked;           /* monotonic s of the last refresh (mu) */
    double pruned_at;               /* monotonic s of the last ticket prune (mu) */
    ev_async async;
    size_t pending;                 /* jobs whose callback is still due (loop thread) */
    int closing;                    /* loop thread */
    rb_tx *txs;                     /* open transactions (loop thread) */
    struct vce *vc[VC_BUCKETS];     /* FerretDB: versions our own claims wrote (mu) */
    size_t vc_n;
};

static const rb_store_vtable mongo_vtable;
static const char *const STORE_CLOSED = "mongodb: store closed";

/* ---- small helpers --------------------------------------------------------------------- */
static double mono_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static char *dupstr(const char *s)
{
    return s ? strdup(s) : NULL;
}

/* Messages are one line: server texts may carry newlines. */
static void one_line(char *s)
{
    for (; *s; s++)
        if (*s == '\n' || *s == '\r') *s = ' ';
}

static void jfail(mjob *j, const char *fmt, ...)
{
    va_list ap;
    int n = snprintf(j->err, sizeof j->err, "mongodb: ");
    va_start(ap, fmt);
    vsnprintf(j->err + n, sizeof j->err - (size_t)n, fmt, ap);
    va_end(ap);
    one_line(j->err);
}

static void jfail_bson(mjob *j, const char *what, const bson_error_t *e)
{
    jfail(j, "%s: %s", what, e->message[0] ? e->message : "unknown error");
}

static double store_now(mstore *s)
{
    pthread_mutex_lock(&s->mu);
    double off = s->clock_offset;
    pthread_mutex_unlock(&s->mu);
    return rb_wall_time() + off;
}

/* ---- versions our claims wrote (FerretDB) ------------------------------------------------
 * A settle must know the version it changes; a claim just wrote it. Kept per delivery and
 * lease token, a settle takes the ticket "<doc>:<v+1>" without reading the document first.
 * That stays safe when the cache is stale: whoever changed the delivery since took that very
 * ticket (versions grow by one per write, each through its ticket), so ours fails and the
 * settle is not applied, as with a read. Entries expire well before tickets are pruned.
 * The claim also notes the generation of the queue entry it left for the delivery (see "the
 * ready queue"), so that a settle which ends the delivery removes that entry at once instead
 * of leaving it for a later claim to read, look up and remove. */
typedef struct vce {
    struct vce *next;
    char id[25], token[33];
    int64_t v, attempts;
    int64_t qg;                 /* generation of the delivery's queue entry, or -1 */
    double at;                  /* monotonic s of the write */
} vce;

static unsigned vc_hash(const char *id)
{
    unsigned h = 2166136261u;
    for (; *id; id++) h = (h ^ (unsigned char)*id) * 16777619u;
    return h % VC_BUCKETS;
}

static void vc_drop_locked(mstore *s, const char *id)
{
    for (vce **p = &s->vc[vc_hash(id)]; *p; p = &(*p)->next)
        if (strcmp((*p)->id, id) == 0) {
            vce *e = *p;
            *p = e->next;
            free(e);
            s->vc_n--;
            return;
        }
}

static void vc_clear_locked(mstore *s)
{
    for (size_t b = 0; b < VC_BUCKETS; b++)
        while (s->vc[b]) {
            vce *e = s->vc[b];
            s->vc[b] = e->next;
            free(e);
        }
    s->vc_n = 0;
}

static void vc_drop(mstore *s, const char *id)
{
    if (!s->ferret || !id) return;
    pthread_mutex_lock(&s->mu);
    vc_drop_locked(s, id);
    pthread_mutex_unlock(&s->mu);
}

static void vc_put(mstore *s, const char *id, const char *token, int64_t v, int64_t attempts,
                   int64_t qg)
{
    if (!s->ferret || !id || !token || strlen(id) != 24 || strlen(token) > 32) return;
    vce *e = calloc(1, sizeof *e);
    pthread_mutex_lock(&s->mu);
    vc_drop_locked(s, id);
    if (s->vc_n >= VC_MAX) vc_clear_locked(s);
    if (e) {
        memcpy(e->id, id, 25);
        snprintf(e->token, sizeof e->token, "%s", token);
        e->v = v;
        e->attempts = attempts;
        e->qg = qg;
        e->at = mono_now();
        unsigned h = vc_hash(id);
        e->next = s->vc[h];
        s->vc[h] = e;
        s->vc_n++;
    }
    pthread_mutex_unlock(&s->mu);
}

/* The document as our last write left it (the fields a settle needs), or NULL; *qg: the
 * generation of its queue entry, or -1. */
static bson_t *vc_doc(mstore *s, const char *id, const char *token, int64_t *qg)
{
    bson_t *d = NULL;
    bson_oid_t oid;
    *qg = -1;
    if (!s->ferret || !id || !token || strlen(id) != 24 || !bson_oid_is_valid(id, 24)) return NULL;
    pthread_mutex_lock(&s->mu);
    for (vce *e = s->vc[vc_hash(id)]; e; e = e->next)
        if (strcmp(e->id, id) == 0) {
            if (strcmp(e->token, token) == 0 && mono_now() - e->at < VC_TTL_S) {
                d = bson_new();
                bson_oid_init_from_string(&oid, id);
                BSON_APPEND_OID(d, "_id", &oid);
                BSON_APPEND_UTF8(d, "status", "processing");
                BSON_APPEND_UTF8(d, "lease_token", token);
                BSON_APPEND_INT64(d, "v", e->v);
                BSON_APPEND_INT64(d, "attempts", e->attempts);
                *qg = e->qg;
            }
            break;
        }
    pthread_mutex_unlock(&s->mu);
    return d;
}

static mongoc_collection_t *coll(mstore *s, mongoc_client_t *c, const char *name)
{
    return mongoc_client_get_collection(c, s->db, name);
}

/* ---- reading documents ----------------------------------------------------------------- */
static const char *doc_str(const bson_t *d, const char *k)
{
    bson_iter_t it;
    if (bson_iter_init_find(&it, d, k) && BSON_ITER_HOLDS_UTF8(&it)) return bson_iter_utf8(&it, NULL);
    return NULL;
}

static double doc_num(const bson_t *d, const char *k)
{
    bson_iter_t it;
    if (!bson_iter_init_find(&it, d, k)) return 0;
    switch (bson_iter_type(&it)) {
    case BSON_TYPE_DOUBLE: return bson_iter_double(&it);
    case BSON_TYPE_INT32: return bson_iter_int32(&it);
    case BSON_TYPE_INT64: return (double)bson_iter_int64(&it);
    case BSON_TYPE_DATE_TIME: return bson_iter_date_time(&it) / 1000.0;
    default: return 0;
    }
}

static int64_t doc_int(const bson_t *d, const char *k)
{
    bson_iter_t it;
    if (!bson_iter_init_find(&it, d, k)) return 0;
    switch (bson_iter_type(&it)) {
    case BSON_TYPE_INT32: return bson_iter_int32(&it);
    case BSON_TYPE_INT64: return bson_iter_int64(&it);
    case BSON_TYPE_DOUBLE: return (int64_t)bson_iter_double(&it);
    default: return 0;
    }
}

static int doc_oid(const bson_t *d, char hex[25])
{
    bson_iter_t it;
    if (!bson_iter_init_find(&it, d, "_id") || !BSON_ITER_HOLDS_OID(&it)) return 0;
    bson_oid_to_string(bson_iter_oid(&it), hex);
    return 1;
}

/* A record from a stored delivery; `token` overrides the stored lease token when non-NULL. */
static rb_delivery *record_from(const bson_t *d, const char *token)
{
    char hex[25];
    if (!doc_oid(d, hex)) return NULL;
    const char *payload = doc_str(d, "payload");
    rb_delivery *r = rb_delivery_new(hex, doc_str(d, "topic"), payload ? payload : "null",
                                     doc_str(d, "key"), doc_str(d, "last_error"),
                                     token ? token : doc_str(d, "lease_token"));
    if (!r) return NULL;
    int st = rb_status_parse(doc_str(d, "status"));
    r->status = st < 0 ? RB_PENDING : (rb_status)st;
    r->attempts = (int)doc_int(d, "attempts");
    r->max_attempts = (int)doc_int(d, "max_attempts");
    r->fence = doc_int(d, "fence");
    r->run_at = doc_num(d, "run_at");
    r->created_at = doc_num(d, "created_at");
    r->lease_expires_at = doc_num(d, "lease_expires_at");
    return r;
}

static int parse_oid(const char *id, bson_oid_t *oid)
{
    if (!id || strlen(id) != 24 || !bson_oid_is_valid(id, 24)) return 0;
    bson_oid_init_from_string(oid, id);
    return 1;
}

/* The dedupe field: topic and key, length-prefixed so no pair can collide. */
static char *dedupe_value(const char *topic, const char *key)
{
    size_t n = strlen(topic) + strlen(key) + 24;
    char *v = malloc(n);
    if (v) snprintf(v, n, "%zu:%s%s", strlen(topic), topic, key);
    return v;
}

/* Per-op outcomes of a bulk write: codes[i] is the server's error code for op i, 0 if none.
 * Returns the number of write errors, or -1 when the reply carries none (the whole bulk
 * failed: network, server selection). */
static int bulk_write_errors(const bson_t *reply, int *codes, size_t n)
{
    bson_iter_t it, arr;
    int found = 0;
    for (size_t i = 0; i < n; i++) codes[i] = 0;
    if (!bson_iter_init_find(&it, reply, "writeErrors") || !BSON_ITER_HOLDS_ARRAY(&it) ||
        !bson_iter_recurse(&it, &arr))
        return -1;
    while (bson_iter_next(&arr)) {
        bson_iter_t e, f;
        if (!BSON_ITER_HOLDS_DOCUMENT(&arr) || !bson_iter_recurse(&arr, &e)) continue;
        int64_t idx = -1, code = 1;
        while (bson_iter_next(&e)) {
            if (strcmp(bson_iter_key(&e), "index") == 0) idx = bson_iter_as_int64(&e);
            else if (strcmp(bson_iter_key(&e), "code") == 0) code = bson_iter_as_int64(&e);
        }
        (void)f;
        if (idx >= 0 && (size_t)idx < n) {
            codes[idx] = code ? (int)code : 1;
            found++;
        }
    }
    return found ? found : -1;
}

/* Runs a bulk. 1: all applied; 0: some ops failed (codes filled); -1: the bulk failed. */
static int bulk_run(mjob *j, mongoc_bulk_operation_t *b, int *codes, size_t n, const char *what)
{
    bson_t reply;
    bson_error_t e;
    int ok = mongoc_bulk_operation_execute(b, &reply, &e) != 0;
    int r = 1;
    if (ok) {
        for (size_t i = 0; i < n; i++) codes[i] = 0;
    } else if (bulk_write_errors(&reply, codes, n) > 0) {
        r = 0;
    } else {
        jfail_bson(j, what, &e);
        r = -1;
    }
    bson_destroy(&reply);
    mongoc_bulk_operation_destroy(b);
    return r;
}

static mongoc_bulk_operation_t *unordered_bulk(mongoc_collection_t *cl)
{
    bson_t opts = BSON_INITIALIZER;
    BSON_APPEND_BOOL(&opts, "ordered", false);
    mongoc_bulk_operation_t *b = mongoc_collection_create_bulk_operation_with_opts(cl, &opts);
    bson_destroy(&opts);
    return b;
}

/* ---- compare-and-set through tickets (see the top of the file) ------------------------- */
typedef struct cas_op {
    bson_t sel;             /* {_id: X} */
    bson_t filter;          /* sel, plus v on MongoDB (atomic there) */
    char ticket[200];       /* "<doc>:<v+1>" */
    char owner[140];        /* "<doc>", the ticket's `d` */
    int64_t old_v;
    bson_t *update;         /* owned; NULL deletes the document */
    int won;                /* out: the change was written */
    int code;               /* out: server error code of the write, 0 if none */
} cas_op;

static void cas_init(mstore *s, cas_op *op, const bson_t *cur, const char *prefix, bson_t *update)
{
    bson_iter_t it;
    char idtxt[120] = "";
    bson_init(&op->sel);
    if (bson_iter_init_find(&it, cur, "_id")) {
        bson_append_iter(&op->sel, "_id", -1, &it);
        if (BSON_ITER_HOLDS_OID(&it)) bson_oid_to_string(bson_iter_oid(&it), idtxt);
        else if (BSON_ITER_HOLDS_UTF8(&it)) snprintf(idtxt, sizeof idtxt, "%s", bson_iter_utf8(&it, NULL));
    }
    op->old_v = doc_int(cur, "v");
    bson_copy_to(&op->sel, &op->filter);
    if (!s->ferret) BSON_APPEND_INT64(&op->filter, "v", op->old_v);
    snprintf(op->owner, sizeof op->owner, "%s:%s", prefix, idtxt);
    snprintf(op->ticket, sizeof op->ticket, "%s:%lld", op->owner, (long long)(op->old_v + 1));
    op->update = update;
    op->won = 0;
    op->code = 0;
}

static void cas_free(cas_op *ops, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        bson_destroy(&ops[i].sel);
        bson_destroy(&ops[i].filter);
        if (ops[i].update) bson_destroy(ops[i].update);
    }
    free(ops);
}

/* A ticket whose write never landed blocks its document for good: remove it once it is old
 * and the document still has the version it was taken against. */
static void cas_clear_stale(mstore *s, mongoc_collection_t *docs, mongoc_collection_t *tk,
                            const cas_op *op, double now)
{
    bson_t tsel = BSON_INITIALIZER, *t = NULL;
    const bson_t *d;
    BSON_APPEND_UTF8(&tsel, "_id", op->ticket);
    mongoc_cursor_t *cur = mongoc_collection_find_with_opts(tk, &tsel, NULL, NULL);
    if (mongoc_cursor_next(cur, &d)) t = bson_copy(d);
    mongoc_cursor_destroy(cur);
    if (t && doc_num(t, "at") < now - STALE_TICKET_S) {
        int64_t v = -1;
        cur = mongoc_collection_find_with_opts(docs, &op->sel, NULL, NULL);
        if (mongoc_cursor_next(cur, &d)) v = doc_int(d, "v");
        mongoc_cursor_destroy(cur);
        if (v == op->old_v) {
            bson_t del = BSON_INITIALIZER;
            BSON_APPEND_UTF8(&del, "_id", op->ticket);
            BSON_APPEND_DOUBLE(&del, "at", doc_num(t, "at"));
            mongoc_collection_delete_one(tk, &del, NULL, NULL, NULL);
            bson_destroy(&del);
        }
    }
    if (t) bson_destroy(t);
    bson_destroy(&tsel);
    (void)s;
}

static int cas_take_tickets(mjob *j, mongoc_collection_t *docs, mongoc_collection_t *tk,
                            cas_op *ops, size_t n, double now, int *codes)
{
    mongoc_bulk_operation_t *b = unordered_bulk(tk);
    for (size_t i = 0; i < n; i++) {
        bson_t t = BSON_INITIALIZER;
        BSON_APPEND_UTF8(&t, "_id", ops[i].ticket);
        BSON_APPEND_UTF8(&t, "d", ops[i].owner);
        BSON_APPEND_DOUBLE(&t, "at", now);
        mongoc_bulk_operation_insert(b, &t);
        bson_destroy(&t);
    }
    int r = bulk_run(j, b, codes, n, "write ticket");
    if (r < 0) return -1;
    for (size_t i = 0; i < n; i++) {
        ops[i].won = codes[i] == 0;
        if (codes[i] == 11000) cas_clear_stale(j->s, docs, tk, &ops[i], now);
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
            jfail_bson(j, "write", &e);
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
    if (j->s->ferret) {
        if (cas_write_each(j, docs, ops, n, codes) < 0) return -1;
        cas_refused(tk, ops, n, codes);
        return 0;
    }
    size_t *map = malloc((n ? n : 1) * sizeof *map), m = 0;
    int *wcodes = malloc((n ? n : 1) * sizeof *wcodes);
    if (!map || !wcodes) {
        free(map); free(wcodes);
        jfail(j, "out of memory");
        return -1;
    }
    mongoc_bulk_operation_t *b = unordered_bulk(docs);
    for (size_t i = 0; i < n; i++) {
        if (!ops[i].won) continue;
        map[m++] = i;
        if (ops[i].update) mongoc_bulk_operation_update_one(b, &ops[i].filter, ops[i].update, false);
        else mongoc_bulk_operation_remove_one(b, &ops[i].filter);
    }
    int r = 0;
    if (m) {
        r = bulk_run(j, b, wcodes, m, "write");
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
static int cas_run(mjob *j, mongoc_client_t *c, const char *docs_name, cas_op *ops, size_t n,
                   double now)
{
    if (!n) return 0;
    mstore *s = j->s;
    int *codes = calloc(n, sizeof *codes);
    if (!codes) {
        jfail(j, "out of memory");
        return -1;
    }
    mongoc_collection_t *docs = coll(s, c, docs_name), *tk = coll(s, c, s->tickets);
    int r = cas_take_tickets(j, docs, tk, ops, n, now, codes);
    if (r == 0) r = cas_write(j, docs, tk, ops, n, codes);
    mongoc_collection_destroy(docs);
    mongoc_collection_destroy(tk);
    free(codes);
    return r;
}

/* ---- finding documents ----------------------------------------------------------------- */
/* Runs a find; returns copies of the documents in *out (NULL-safe), or -1 with j->err. */
static int find_docs(mjob *j, mongoc_collection_t *cl, const bson_t *filter, const bson_t *opts,
                     mongoc_client_session_t *cs, bson_t ***out, size_t *nout)
{
    bson_t o = BSON_INITIALIZER;
    bson_error_t e;
    if (opts) bson_concat(&o, opts);
    if (cs && !mongoc_client_session_append(cs, &o, &e)) {
        bson_destroy(&o);
        jfail_bson(j, "find", &e);
        return -1;
    }
    mongoc_cursor_t *cur = mongoc_collection_find_with_opts(cl, filter, &o, NULL);
    bson_destroy(&o);
    const bson_t *d;
    size_t n = 0, cap = 0;
    bson_t **v = NULL;
    while (mongoc_cursor_next(cur, &d)) {
        if (n == cap) {
            cap = cap ? cap * 2 : 16;
            bson_t **nv = realloc(v, cap * sizeof *nv);
            if (!nv) break;
            v = nv;
        }
        v[n++] = bson_copy(d);
    }
    int failed = mongoc_cursor_error(cur, &e);
    mongoc_cursor_destroy(cur);
    if (failed) {
        for (size_t i = 0; i < n; i++) bson_destroy(v[i]);
        free(v);
        jfail_bson(j, "find", &e);
        return -1;
    }
    *out = v;
    *nout = n;
    return 0;
}

static void docs_free(bson_t **v, size_t n)
{
    for (size_t i = 0; i < n; i++) bson_destroy(v[i]);
    free(v);
}

/* One document by its selector, or NULL (*failed set on error). */
static bson_t *find_one(mjob *j, mongoc_collection_t *cl, const bson_t *sel,
                        mongoc_client_session_t *cs, int *failed)
{
    bson_t **v = NULL, opts = BSON_INITIALIZER;
    size_t n = 0;
    BSON_APPEND_INT64(&opts, "limit", 1);
    *failed = find_docs(j, cl, sel, &opts, cs, &v, &n) < 0;
    bson_destroy(&opts);
    bson_t *d = n ? v[0] : NULL;
    for (size_t i = 1; i < n; i++) bson_destroy(v[i]);
    free(v);
    return d;
}

/* ---- the ready queue (FerretDB only) ----------------------------------------------------
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
#define QUEUE_ORPHAN_S 60.0
#define QUEUE_READ_MAX 600

/* Entry ids are "<24 hex>:<generation>". Deletions are collected as ids and sent after the
 * inserts, minus any id the same batch inserts: a successor may carry the id of an entry this
 * batch also drops (a duplicate of the delivery read earlier, left by a process killed
 * between the insert and the delete of a move), and sending both would leave the delivery
 * with no entry at all, so no claim would ever find it again. */
typedef char qid[64];

typedef struct qbatch {
    mongoc_bulk_operation_t *ins;
    mongoc_collection_t *qc;
    size_t nins, ndel, cap_ins, cap_del;
    qid *ins_ids, *del_ids;
    int oom;
} qbatch;

static void qb_init(qbatch *b, mongoc_collection_t *qc)
{
    memset(b, 0, sizeof *b);
    b->qc = qc;
    b->ins = unordered_bulk(qc);
}

static int qid_push(qid **v, size_t *n, size_t *cap, const char *id)
{
    if (*n == *cap) {
        size_t nc = *cap ? *cap * 2 : 32;
        qid *g = realloc(*v, nc * sizeof **v);
        if (!g) return 0;
        *v = g;
        *cap = nc;
    }
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

static void qb_put(qbatch *b, const char *hex, const char *topic, int64_t g, double at, double now)
{
    char id[64];
    snprintf(id, sizeof id, "%s:%lld", hex ? hex : "", (long long)g);
    if (!qid_push(&b->ins_ids, &b->nins, &b->cap_ins, id)) { b->oom = 1; return; }
    qentry_add(b->ins, hex, topic, g, at, now);
}

/* Removes the entry "<hex>:<g>". */
static void qb_drop(qbatch *b, const char *hex, int64_t g)
{
    char id[64];
    snprintf(id, sizeof id, "%s:%lld", hex, (long long)g);
    if (!qid_push(&b->del_ids, &b->ndel, &b->cap_del, id)) b->oom = 1;
}

static void qb_del(qbatch *b, const bson_t *entry)
{
    const char *id = doc_str(entry, "_id");
    if (id && !qid_push(&b->del_ids, &b->ndel, &b->cap_del, id)) b->oom = 1;
}

/* Moves an entry to the tail: its successor first, then (qb_run) the entry itself. */
static void qb_move(qbatch *b, const bson_t *entry, double at, double now)
{
    qb_put(b, doc_str(entry, "d"), doc_str(entry, "t"), doc_int(entry, "g") + 1, at, now);
    qb_del(b, entry);
}

/* Inserts, then deletes only when every insert landed (or its id was there already). Returns
 * 0, or -1 with j->err set when `report`. */
static int qb_run(mjob *j, qbatch *b, int report)
{
    int ok = !b->oom;
    if (!ok && report) jfail(j, "out of memory");
    if (ok && b->nins) {
        int *codes = calloc(b->nins, sizeof *codes);
        char keep[ERRLEN];
        memcpy(keep, j->err, sizeof keep);
        if (!codes) {
            mongoc_bulk_operation_destroy(b->ins);
            ok = 0;
            if (report) jfail(j, "out of memory");
        } else {
            int r = bulk_run(j, b->ins, codes, b->nins, "queue");
            if (r < 0) ok = 0;
            for (size_t i = 0; r >= 0 && i < b->nins; i++)
                if (codes[i] && codes[i] != 11000) {
                    ok = 0;
                    if (report) jfail(j, "queue: the server refused an entry (code %d)", codes[i]);
                }
            free(codes);
        }
        if (!report) memcpy(j->err, keep, sizeof keep);
    } else {
        mongoc_bulk_operation_destroy(b->ins);
    }
    if (ok && b->ndel) {
        if (b->nins) qsort(b->ins_ids, b->nins, sizeof *b->ins_ids, qid_cmp);
        mongoc_bulk_operation_t *del = unordered_bulk(b->qc);
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

/* ---- the job queue and the loop side ---------------------------------------------------- */
static void refresh_clock(mstore *s, mongoc_client_t *c);

static void *worker_main(void *arg)
{
    mstore *s = arg;
    mongoc_client_t *c = mongoc_client_pool_pop(s->pool);
    for (;;) {
        pthread_mutex_lock(&s->mu);
        while (!s->stopping && !s->queue_head) pthread_cond_wait(&s->cv, &s->mu);
        if (s->stopping) {
            pthread_mutex_unlock(&s->mu);
            break;
        }
        mjob *j = s->queue_head;
        s->queue_head = j->next;
        if (!s->queue_head) s->queue_tail = NULL;
        int stale = mono_now() - s->clock_checked > CLOCK_REFRESH_S;
        if (stale) s->clock_checked = mono_now();   /* one worker refreshes */
        pthread_mutex_unlock(&s->mu);

        if (stale) refresh_clock(s, c);
        j->next = NULL;
        j->work(j, j->tx ? j->tx->client : c);

        pthread_mutex_lock(&s->mu);
        if (s->done_tail) s->done_tail->next = j;
        else s->done_head = j;
        s->done_tail = j;
        pthread_mutex_unlock(&s->mu);
        ev_async_send(s->base.loop, &s->async);
    }
    mongoc_client_pool_push(s->pool, c);
    return NULL;
}

static void job_finish(mstore *s, mjob *j, const char *err)
{
    if (--s->pending == 0) ev_unref(s->base.loop);  /* idle: do not keep the loop alive */
    j->done(j, err);
}

static void on_async(struct ev_loop *loop, ev_async *w, int revents)
{
    (void)loop; (void)revents;
    mstore *s = w->data;
    pthread_mutex_lock(&s->mu);
    mjob *j = s->done_head;
    s->done_head = s->done_tail = NULL;
    pthread_mutex_unlock(&s->mu);
    while (j) {
        mjob *next = j->next;
        job_finish(s, j, j->err[0] ? j->err : NULL);
        j = next;
    }
}

static void submit(mstore *s, mjob *j)
{
    if (s->pending++ == 0) ev_ref(s->base.loop);   /* a result is due: keep the loop running */
    if (s->closing) {
        job_finish(s, j, STORE_CLOSED);
        return;
    }
    pthread_mutex_lock(&s->mu);
    if (s->queue_tail) s->queue_tail->next = j;
    else s->queue_head = j;
    s->queue_tail = j;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static void *job_new(mstore *s, size_t size, void (*work)(mjob *, mongoc_client_t *),
                     void (*done)(mjob *, const char *))
{
    mjob *j = calloc(1, size);
    if (!j) return NULL;
    j->s = s;
    j->work = work;
    j->done = done;
    return j;
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

static int read_clock(mstore *s, mongoc_client_t *c, bson_t *reply, bson_error_t *e)
{
    double t0 = rb_wall_time();
    if (!hello(c, reply, e)) return 0;
    double t1 = rb_wall_time();
    bson_iter_t it;
    if (bson_iter_init_find(&it, reply, "localTime") && BSON_ITER_HOLDS_DATE_TIME(&it)) {
        double server = bson_iter_date_time(&it) / 1000.0;
        pthread_mutex_lock(&s->mu);
        s->clock_offset = server - (t0 + t1) / 2;
        s->clock_checked = mono_now();
        pthread_mutex_unlock(&s->mu);
    }
    return 1;
}

static void prune_tickets(mstore *s, mongoc_client_t *c)
{
    mongoc_collection_t *tk = coll(s, c, s->tickets);
    bson_t f = BSON_INITIALIZER, lt;
    BSON_APPEND_DOCUMENT_BEGIN(&f, "at", &lt);
    BSON_APPEND_DOUBLE(&lt, "$lt", store_now(s) - TICKET_TTL_S);
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
    read_clock(s, c, &reply, &e);
    bson_destroy(&reply);
    pthread_mutex_lock(&s->mu);
    int prune = s->pruned_at == 0 || mono_now() - s->pruned_at >= PRUNE_EVERY_S;
    if (prune) s->pruned_at = mono_now();
    pthread_mutex_unlock(&s->mu);
    if (prune) prune_tickets(s, c);
}

/* ---- enqueue ---------------------------------------------------------------------------- */
typedef struct enq_job {
    mjob j;
    rb_enqueue_item *items;
    size_t n;
    char **ids;
    rb_ids_cb cb;
    void *ud;
} enq_job;

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

/* BSON's own parser decides what BSON can hold: keys with NUL, numbers out of range. */
static int payload_check(const char *json, char *why, size_t whylen)
{
    size_t len = strlen(json);
    char *w = malloc(len + 8);
    if (!w) {
        snprintf(why, whylen, "out of memory");
        return 0;
    }
    snprintf(w, len + 8, "{\"v\":%s}", json);
    bson_error_t e;
    bson_t *b = bson_new_from_json((const uint8_t *)w, -1, &e);
    free(w);
    if (!b) {
        snprintf(why, whylen, "%.190s", e.message);
        return 0;
    }
    bson_destroy(b);
    return 1;
}

static bson_t *delivery_doc(const rb_enqueue_item *it, double now, char hex[25])
{
    bson_t *d = bson_new();
    bson_oid_t oid;
    bson_oid_init(&oid, NULL);
    bson_oid_to_string(&oid, hex);
    BSON_APPEND_OID(d, "_id", &oid);
    BSON_APPEND_UTF8(d, "topic", it->topic);
    BSON_APPEND_UTF8(d, "payload", it->payload ? it->payload : "null");
    if (it->key) {
        BSON_APPEND_UTF8(d, "key", it->key);
        char *dd = dedupe_value(it->topic, it->key);
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
static char *dedupe_holder(mjob *j, mongoc_collection_t *cl, const rb_enqueue_item *it,
                           mongoc_client_session_t *cs, int *failed)
{
    bson_t f = BSON_INITIALIZER;
    char *dd = dedupe_value(it->topic, it->key);
    BSON_APPEND_UTF8(&f, "dedupe", dd ? dd : "");
    free(dd);
    bson_t *d = find_one(j, cl, &f, cs, failed);
    bson_destroy(&f);
    char hex[25], *id = NULL;
    if (d && doc_oid(d, hex)) id = strdup(hex);
    if (d) bson_destroy(d);
    return id;
}

/* An earlier item of the same batch with this topic and key, or -1. */
static long same_key_before(const rb_enqueue_item *items, size_t i)
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
    size_t *map = malloc(n * sizeof *map), m = 0;
    int *codes = malloc(n * sizeof *codes);
    if (!map || !codes) {
        free(map); free(codes);
        jfail(j, "out of memory");
        return -1;
    }
    mongoc_bulk_operation_t *b = unordered_bulk(cl);
    for (size_t i = 0; i < n; i++)
        if (want[i]) {
            map[m++] = i;
            mongoc_bulk_operation_insert(b, docs[i]);
        }
    int r = m ? bulk_run(j, b, codes, m, "enqueue") : 1;
    if (!m) mongoc_bulk_operation_destroy(b);
    for (size_t k = 0; r >= 0 && k < m; k++) {
        inserted[map[k]] = codes[k] == 0;
        dup[map[k]] = codes[k] == 11000;
        if (codes[k] && codes[k] != 11000) {
            jfail(j, "enqueue: the server refused a delivery (code %d)", codes[k]);
            r = -1;
        }
    }
    free(map);
    free(codes);
    return r < 0 ? -1 : 0;
}

/* Plain (non-transactional) enqueue: one unordered insert; dedupe conflicts resolve to the
 * holder's id, retried when the holder settled in between. */
static void enq_work(mjob *j, mongoc_client_t *c)
{
    enq_job *q = (enq_job *)j;
    size_t n = q->n;
    double now = store_now(j->s);
    mongoc_collection_t *cl = coll(j->s, c, j->s->base.table);
    bson_t **docs = calloc(n, sizeof *docs);
    int *want = calloc(n, sizeof *want), *ins = calloc(n, sizeof *ins), *dup = calloc(n, sizeof *dup);
    q->ids = calloc(n, sizeof *q->ids);
    if (!docs || !want || !ins || !dup || !q->ids) {
        jfail(j, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        char hex[25];
        if (same_key_before(q->items, i) >= 0) continue;
        docs[i] = delivery_doc(&q->items[i], now, hex);
        q->ids[i] = strdup(hex);
        want[i] = 1;
    }
    if (j->s->ferret) {     /* the queue entries first: a delivery never lacks one */
        mongoc_collection_t *qc = coll(j->s, c, j->s->queue);
        qbatch qb;
        qb_init(&qb, qc);
        for (size_t i = 0; i < n; i++)
            if (want[i]) {
                const rb_enqueue_item *it = &q->items[i];
                qb_put(&qb, q->ids[i], it->topic, 0, it->run_at > 0 ? it->run_at : now + it->delay, now);
            }
        int r = qb_run(j, &qb, 1);
        mongoc_collection_destroy(qc);
        if (r < 0) goto out;
    }
    for (int round = 0; round < 5; round++) {
        int *got = calloc(n, sizeof *got);
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
            char *holder = dedupe_holder(j, cl, &q->items[i], NULL, &failed);
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
        long k = same_key_before(q->items, i);
        if (k >= 0) q->ids[i] = strdup(q->ids[k]);
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
    q->cb(q->ud, err, err ? NULL : q->ids, err ? 0 : q->n);
    enq_free(q);
}

/* Copies and checks the items; NULL with `err` filled when one cannot be stored. */
static enq_job *enq_prepare(mstore *s, const rb_enqueue_item *items, size_t n,
                            void (*work)(mjob *, mongoc_client_t *), char *err, size_t errlen)
{
    enq_job *q = job_new(s, sizeof *q, work, enq_done);
    if (!q || !(q->items = calloc(n ? n : 1, sizeof *q->items))) {
        free(q);
        snprintf(err, errlen, "mongodb: out of memory");
        return NULL;
    }
    q->n = n;
    for (size_t i = 0; i < n; i++) {
        char why[200];
        const char *payload = items[i].payload ? items[i].payload : "null";
        if (!items[i].topic) {
            snprintf(err, errlen, "mongodb: enqueue: delivery %zu has no topic", i + 1);
        } else if (!payload_check(payload, why, sizeof why)) {
            snprintf(err, errlen, "mongodb: payload cannot be stored as BSON: %s", why);
            one_line(err);
        } else {
            q->items[i] = items[i];
            q->items[i].topic = strdup(items[i].topic);
            q->items[i].payload = strdup(payload);
            q->items[i].key = dupstr(items[i].key);
            continue;
        }
        q->n = i;
        enq_free(q);
        return NULL;
    }
    return q;
}

static void m_enqueue(rb_store *st, const rb_enqueue_item *items, size_t n, rb_ids_cb cb, void *ud)
{
    mstore *s = (mstore *)st;
    char err[ERRLEN];
    if (n == 0) {
        cb(ud, NULL, NULL, 0);
        return;
    }
    enq_job *q = enq_prepare(s, items, n, enq_work, err, sizeof err);
    if (!q) {
        cb(ud, err, NULL, 0);
        return;
    }
    q->cb = cb;
    q->ud = ud;
    submit(s, &q->j);
}

/* ---- claim ------------------------------------------------------------------------------ */
typedef struct claim_job {
    mjob j;
    char **topics;
    size_t ntopics, limit;
    double lease;
    rb_delivery **recs;
    size_t nrecs;
    rb_records_cb cb;
    void *ud;
} claim_job;

static void append_range(bson_t *b, const char *field, const char *op, double v)
{
    bson_t r;
    BSON_APPEND_DOCUMENT_BEGIN(b, field, &r);
    BSON_APPEND_DOUBLE(&r, op, v);
    bson_append_document_end(b, &r);
}

/* Due: pending with run_at <= now, or processing with an expired lease. */
static void append_due(bson_t *f, double now)
{
    bson_t or, a, b;
    BSON_APPEND_ARRAY_BEGIN(f, "$or", &or);
    BSON_APPEND_DOCUMENT_BEGIN(&or, "0", &a);
    BSON_APPEND_UTF8(&a, "status", "pending");
    append_range(&a, "run_at", "$lte", now);
    bson_append_document_end(&or, &a);
    BSON_APPEND_DOCUMENT_BEGIN(&or, "1", &b);
    BSON_APPEND_UTF8(&b, "status", "processing");
    append_range(&b, "lease_expires_at", "$lte", now);
    bson_append_document_end(&or, &b);
    bson_append_array_end(f, &or);
}

static void append_topics(bson_t *f, char **topics, size_t n)
{
    bson_t in, arr;
    BSON_APPEND_DOCUMENT_BEGIN(f, "topic", &in);
    BSON_APPEND_ARRAY_BEGIN(&in, "$in", &arr);
    for (size_t i = 0; i < n; i++) {
        char k[16];
        const char *key;
        bson_uint32_to_string((uint32_t)i, &key, k, sizeof k);
        bson_append_utf8(&arr, key, -1, topics[i], -1);
    }
    bson_append_array_end(&in, &arr);
    bson_append_document_end(f, &in);
}

/* The update that takes a delivery out of `processing` (or buries a due one). */
static bson_t *upd_leave(const bson_t *cur, const char *status, double now)
{
    bson_t *u = bson_new(), set;
    BSON_APPEND_DOCUMENT_BEGIN(u, "$set", &set);
    BSON_APPEND_UTF8(&set, "status", status);
    BSON_APPEND_NULL(&set, "lease_token");
    BSON_APPEND_DOUBLE(&set, "lease_expires_at", 0);
    BSON_APPEND_INT64(&set, "v", doc_int(cur, "v") + 1);
    if (strcmp(status, "completed") == 0 || strcmp(status, "buried") == 0)
        BSON_APPEND_DOUBLE(&set, "settled_at", now);
    bson_append_document_end(u, &set);
    return u;
}

/* Adds to the update's $set (kept open by the caller via a rebuilt doc) a field. */
static bson_t *upd_with(bson_t *u, const char *field, const char *str, double num, int isnum)
{
    /* Rebuild: $set gets the extra field; other operators are copied as they are. */
    bson_t *n = bson_new();
    bson_iter_t it;
    bson_iter_init(&it, u);
    while (bson_iter_next(&it)) {
        if (strcmp(bson_iter_key(&it), "$set") == 0) {
            bson_t set, old;
            uint32_t len;
            const uint8_t *data;
            bson_iter_document(&it, &len, &data);
            bson_init_static(&old, data, len);
            BSON_APPEND_DOCUMENT_BEGIN(n, "$set", &set);
            bson_concat(&set, &old);
            if (isnum) BSON_APPEND_DOUBLE(&set, field, num);
            else if (str) BSON_APPEND_UTF8(&set, field, str);
            else BSON_APPEND_NULL(&set, field);
            bson_append_document_end(n, &set);
        } else {
            bson_append_iter(n, NULL, 0, &it);
        }
    }
    bson_destroy(u);
    return n;
}

static bson_t *upd_unset_dedupe(bson_t *u)
{
    bson_t un;
    BSON_APPEND_DOCUMENT_BEGIN(u, "$unset", &un);
    BSON_APPEND_UTF8(&un, "dedupe", "");
    bson_append_document_end(u, &un);
    return u;
}

static bson_t *upd_bury(const bson_t *cur, const char *error, double now)
{
    bson_t *u = upd_leave(cur, "buried", now);
    if (error) u = upd_with(u, "last_error", error, 0, 0);
    return upd_unset_dedupe(u);
}

static bson_t *upd_claim(const bson_t *cur, const char *token, double now, double lease)
{
    bson_t *u = bson_new(), set;
    BSON_APPEND_DOCUMENT_BEGIN(u, "$set", &set);
    BSON_APPEND_UTF8(&set, "status", "processing");
    BSON_APPEND_UTF8(&set, "lease_token", token);
    BSON_APPEND_DOUBLE(&set, "lease_expires_at", now + lease);
    BSON_APPEND_INT32(&set, "attempts", (int32_t)doc_int(cur, "attempts") + 1);
    BSON_APPEND_INT64(&set, "fence", doc_int(cur, "fence") + 1);
    BSON_APPEND_INT64(&set, "v", doc_int(cur, "v") + 1);
    bson_append_document_end(u, &set);
    return u;
}

static int claim_exceeds(const bson_t *d)
{
    return doc_int(d, "attempts") + 1 > doc_int(d, "max_attempts");
}

static rb_delivery *claimed_record(const bson_t *d, const char *token, double now, double lease)
{
    rb_delivery *r = record_from(d, token);
    if (!r) return NULL;
    r->status = RB_PROCESSING;
    r->attempts++;
    r->fence++;
    r->lease_expires_at = now + lease;
    return r;
}

static int claim_candidates(claim_job *q, mongoc_collection_t *cl, double now, bson_t ***docs,
                            size_t *n)
{
    bson_t f = BSON_INITIALIZER, opts = BSON_INITIALIZER, sort;
    append_topics(&f, q->topics, q->ntopics);
    append_due(&f, now);
    BSON_APPEND_DOCUMENT_BEGIN(&opts, "sort", &sort);
    BSON_APPEND_INT32(&sort, "run_at", 1);
    BSON_APPEND_INT32(&sort, "_id", 1);
    bson_append_document_end(&opts, &sort);
    BSON_APPEND_INT64(&opts, "limit", (int64_t)q->limit);
    int r = find_docs(&q->j, cl, &f, &opts, NULL, docs, n);
    bson_destroy(&f);
    bson_destroy(&opts);
    return r;
}

/* ---- claim on FerretDB: from the head of the queue (see "the ready queue") ------------- */
static int topic_wanted(const claim_job *q, const char *t)
{
    for (size_t i = 0; t && i < q->ntopics; i++)
        if (strcmp(q->topics[i], t) == 0) return 1;
    return 0;
}

typedef struct qcand {
    bson_t *doc;
    const bson_t *entry;
} qcand;

static int qcand_cmp(const void *a, const void *b)
{
    const qcand *x = a, *y = b;
    double ra = doc_num(x->doc, "run_at"), rb = doc_num(y->doc, "run_at");
    if (ra != rb) return ra < rb ? -1 : 1;
    char hx[25] = "", hy[25] = "";
    doc_oid(x->doc, hx);
    doc_oid(y->doc, hy);
    return strcmp(hx, hy);
}

static void claim_work_queue(claim_job *q, mongoc_client_t *c)
{
    mjob *j = &q->j;
    mstore *s = j->s;
    double now = store_now(s);
    size_t want = q->limit * 2 + 16;
    if (want > QUEUE_READ_MAX) want = QUEUE_READ_MAX;
    mongoc_collection_t *qc = coll(s, c, s->queue), *cl = coll(s, c, s->base.table);
    bson_t f = BSON_INITIALIZER, opts = BSON_INITIALIZER;
    BSON_APPEND_INT64(&opts, "limit", (int64_t)want);   /* no filter, no sort: a SQL LIMIT */
    BSON_APPEND_INT64(&opts, "batchSize", (int64_t)want);   /* one round trip, no getMore */
    bson_t **ents = NULL;
    size_t n = 0, nc = 0, nkept = 0;
    int r = find_docs(j, qc, &f, &opts, NULL, &ents, &n);
    bson_destroy(&f);
    bson_destroy(&opts);
    qcand *cands = calloc(n ? n : 1, sizeof *cands);
    const char **kept = calloc(n ? n : 1, sizeof *kept);
    if (r == 0 && (!cands || !kept)) {
        jfail(j, "out of memory");
        r = -1;
    }
    if (r < 0) goto out;
    int full = n >= want;     /* more may wait behind: what cannot be used now moves back */
    qbatch qb;
    qb_init(&qb, qc);
    for (size_t i = 0; i < n && nc < q->limit; i++) {
        const bson_t *e = ents[i];
        const char *hex = doc_str(e, "d"), *t = doc_str(e, "t");
        double at = doc_num(e, "at");
        bson_oid_t oid;
        int dup = 0;
        if (!hex || !parse_oid(hex, &oid)) {
            qb_del(&qb, e);
            continue;
        }
        for (size_t k = 0; k < nkept && !dup; k++) dup = strcmp(kept[k], hex) == 0;
        if (dup) {              /* another entry of this delivery came first: it stands */
            qb_del(&qb, e);
            continue;
        }
        kept[nkept++] = hex;
        if (!topic_wanted(q, t) || at > now) {
            if (full) qb_move(&qb, e, at, now);
            continue;
        }
        bson_t sel = BSON_INITIALIZER;
        int failed = 0;
        BSON_APPEND_OID(&sel, "_id", &oid);
        bson_t *d = find_one(j, cl, &sel, NULL, &failed);
        bson_destroy(&sel);
        if (failed) {
            r = -1;
            break;
        }
        if (!d) {               /* not inserted yet, or its enqueue failed, or purged */
            if (doc_num(e, "c") < now - QUEUE_ORPHAN_S) qb_del(&qb, e);
            continue;
        }
        const char *st = doc_str(d, "status");
        if (st && strcmp(st, "pending") == 0) {
            double run_at = doc_num(d, "run_at");
            if (run_at <= now) {
                cands[nc].doc = d;
                cands[nc++].entry = e;
                continue;
            }
            qb_move(&qb, e, run_at, now);   /* fixed until it is due: later reads skip it */
        } else if (st && strcmp(st, "processing") == 0) {
            if (doc_num(d, "lease_expires_at") <= now) {
                cands[nc].doc = d;
                cands[nc++].entry = e;
                continue;
            }
            if (full) qb_move(&qb, e, 0, now);
        } else {
            qb_del(&qb, e);     /* settled: a kick writes a new entry */
        }
        bson_destroy(d);
    }
    if (r == 0 && nc) {
        qsort(cands, nc, sizeof *cands, qcand_cmp);
        cas_op *ops = calloc(nc, sizeof *ops);
        char (*tokens)[33] = calloc(nc, sizeof *tokens);
        q->recs = calloc(nc, sizeof *q->recs);
        if (!ops || !tokens || !q->recs) {
            jfail(j, "out of memory");
            free(ops);
            r = -1;
        } else {
            for (size_t i = 0; i < nc; i++) {
                bson_t *d = cands[i].doc;
                rb_random_token(tokens[i]);
                bson_t *u = claim_exceeds(d)
                                ? upd_bury(d, doc_str(d, "last_error") ? NULL : "max attempts exceeded", now)
                                : upd_claim(d, tokens[i], now, q->lease);
                cas_init(s, &ops[i], d, "d", u);
            }
            if (cas_run(j, c, s->base.table, ops, nc, now) == 0) {
                for (size_t i = 0; i < nc; i++) {
                    if (!ops[i].won) continue;      /* the winner moves the entry */
                    if (claim_exceeds(cands[i].doc)) {
                        qb_del(&qb, cands[i].entry);
                        continue;
                    }
                    /* Back to the tail, where an expired lease will be found again. */
                    qb_move(&qb, cands[i].entry, 0, now);
                    char hex[25];
                    if (doc_oid(cands[i].doc, hex))
                        vc_put(s, hex, tokens[i], ops[i].old_v + 1, doc_int(cands[i].doc, "attempts") + 1,
                               doc_int(cands[i].entry, "g") + 1);
                    rb_delivery *rec = claimed_record(cands[i].doc, tokens[i], now, q->lease);
                    if (rec) q->recs[q->nrecs++] = rec;
                }
            }
            cas_free(ops, nc);
        }
        free(tokens);
    }
    qb_run(j, &qb, 0);      /* an entry not moved stays where it was: nothing is lost */
out:
    for (size_t i = 0; cands && i < nc; i++) bson_destroy(cands[i].doc);
    free(cands);
    free(kept);
    docs_free(ents, n);
    mongoc_collection_destroy(qc);
    mongoc_collection_destroy(cl);
}

static void claim_work(mjob *j, mongoc_client_t *c)
{
    claim_job *q = (claim_job *)j;
    if (j->s->ferret) {
        claim_work_queue(q, c);
        return;
    }
    double now = store_now(j->s);
    mongoc_collection_t *cl = coll(j->s, c, j->s->base.table);
    bson_t **docs = NULL;
    size_t n = 0;
    int r = claim_candidates(q, cl, now, &docs, &n);
    mongoc_collection_destroy(cl);
    if (r < 0 || n == 0) return;
    cas_op *ops = calloc(n, sizeof *ops);
    char (*tokens)[33] = calloc(n, sizeof *tokens);
    q->recs = calloc(n, sizeof *q->recs);
    if (!ops || !tokens || !q->recs) {
        jfail(j, "out of memory");
        free(ops); free(tokens);
        docs_free(docs, n);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        rb_random_token(tokens[i]);
        bson_t *u = claim_exceeds(docs[i])
                        ? upd_bury(docs[i], doc_str(docs[i], "last_error") ? NULL : "max attempts exceeded", now)
                        : upd_claim(docs[i], tokens[i], now, q->lease);
        cas_init(j->s, &ops[i], docs[i], "d", u);
    }
    if (cas_run(j, c, j->s->base.table, ops, n, now) == 0) {
        for (size_t i = 0; i < n; i++)
            if (ops[i].won && !claim_exceeds(docs[i])) {
                rb_delivery *rec = claimed_record(docs[i], tokens[i], now, q->lease);
                if (rec) q->recs[q->nrecs++] = rec;
            }
    }
    cas_free(ops, n);
    free(tokens);
    docs_free(docs, n);
}

static void claim_done(mjob *j, const char *err)
{
    claim_job *q = (claim_job *)j;
    if (err) {
        rb_delivery_list_free(q->recs, q->nrecs);
        q->cb(q->ud, err, NULL, 0);
    } else {
        q->cb(q->ud, NULL, q->recs, q->nrecs);   /* ownership passes */
    }
    for (size_t i = 0; i < q->ntopics; i++) free(q->topics[i]);
    free(q->topics);
    free(q);
}

static void m_claim(rb_store *st, const rb_claim_req *req, rb_records_cb cb, void *ud)
{
    mstore *s = (mstore *)st;
    if (req->limit == 0 || req->ntopics == 0) {
        cb(ud, NULL, NULL, 0);
        return;
    }
    claim_job *q = job_new(s, sizeof *q, claim_work, claim_done);
    if (!q || !(q->topics = calloc(req->ntopics, sizeof *q->topics))) {
        free(q);
        cb(ud, "mongodb: out of memory", NULL, 0);
        return;
    }
    q->ntopics = req->ntopics;
    for (size_t i = 0; i < req->ntopics; i++) q->topics[i] = strdup(req->topics[i]);
    q->limit = req->limit;
    q->lease = req->lease_duration;
    q->cb = cb;
    q->ud = ud;
    submit(s, &q->j);
}

/* ---- settle ----------------------------------------------------------------------------- */
typedef struct settle_job {
    mjob j;
    rb_settle_op *ops;
    size_t n;
    rb_done_cb cb;
    void *ud;
} settle_job;

static bson_t *upd_settle(const bson_t *cur, const rb_settle_op *op, double now)
{
    switch (op->kind) {
    case RB_OP_COMPLETE:
        return upd_unset_dedupe(upd_leave(cur, "completed", now));
    case RB_OP_BURY:
        return upd_bury(cur, op->error, now);
    case RB_OP_RESCHEDULE: {
        bson_t *u = upd_with(upd_leave(cur, "pending", now), "run_at", NULL, now + op->delay, 1);
        return op->error ? upd_with(u, "last_error", op->error, 0, 0) : u;
    }
    case RB_OP_RELEASE: {
        bson_t *u = upd_with(upd_leave(cur, "pending", now), "run_at", NULL, now + op->delay, 1);
        int64_t a = doc_int(cur, "attempts");
        return upd_with(u, "attempts", NULL, (double)(a > 0 ? a - 1 : 0), 1);
    }
    case RB_OP_EXTEND:
    default: {
        bson_t *u = bson_new(), set;
        BSON_APPEND_DOCUMENT_BEGIN(u, "$set", &set);
        BSON_APPEND_DOUBLE(&set, "lease_expires_at", now + op->delay);
        BSON_APPEND_INT64(&set, "v", doc_int(cur, "v") + 1);
        bson_append_document_end(u, &set);
        return u;
    }
    }
}

/* The fence: the delivery is processing under this token. */
static int holds_lease(const bson_t *d, const char *token)
{
    const char *st = doc_str(d, "status"), *tk = doc_str(d, "lease_token");
    return d && st && tk && token && strcmp(st, "processing") == 0 && strcmp(tk, token) == 0;
}

static bson_t *oid_sel(const char *id, int *ok)
{
    bson_oid_t oid;
    bson_t *sel = bson_new();
    *ok = parse_oid(id, &oid);
    if (*ok) BSON_APPEND_OID(sel, "_id", &oid);
    return sel;
}

/* One round: ops[idx[0..m)] touch distinct deliveries. */
static int settle_round(mjob *j, mongoc_client_t *c, rb_settle_op **round, size_t m, double now)
{
    mongoc_collection_t *cl = coll(j->s, c, j->s->base.table);
    cas_op *cas = calloc(m, sizeof *cas);
    rb_settle_op **mine = calloc(m, sizeof *mine);
    int64_t *att = calloc(m, sizeof *att), *qg = calloc(m, sizeof *qg);
    size_t k = 0;
    int r = (cas && mine && att && qg) ? 0 : -1;
    for (size_t i = 0; r == 0 && i < m; i++) {
        int ok, failed = 0;
        int64_t g = -1;
        bson_t *sel = oid_sel(round[i]->id, &ok);
        bson_t *d = ok ? vc_doc(j->s, round[i]->id, round[i]->token, &g) : NULL;
        if (ok && !d) d = find_one(j, cl, sel, NULL, &failed);
        bson_destroy(sel);
        if (failed) r = -1;
        else if (d && holds_lease(d, round[i]->token)) {
            cas_init(j->s, &cas[k], d, "d", upd_settle(d, round[i], now));
            att[k] = doc_int(d, "attempts");
            qg[k] = g;
            mine[k++] = round[i];
        }
        if (d) bson_destroy(d);
    }
    mongoc_collection_destroy(cl);
    if (r == 0) r = cas_run(j, c, j->s->base.table, cas, k, now);
    mongoc_collection_t *qc = NULL;
    qbatch qb;
    for (size_t i = 0; r == 0 && i < k; i++) {
        mine[i]->applied = cas[i].won;
        if (cas[i].won && mine[i]->kind == RB_OP_EXTEND) {
            mine[i]->lease_expires_at = now + mine[i]->delay;
            vc_put(j->s, mine[i]->id, mine[i]->token, cas[i].old_v + 1, att[i], qg[i]);
            continue;
        }
        vc_drop(j->s, mine[i]->id);
        /* Settled for good: the entry our claim left goes now (FerretDB; qg is known only
         * there). A kick writes a new entry of another generation first, so this one is never
         * a live delivery's last; one missed here is removed by the claim that reads it. */
        if (cas[i].won && qg[i] >= 0 &&
            (mine[i]->kind == RB_OP_COMPLETE || mine[i]->kind == RB_OP_BURY)) {
            if (!qc) qb_init(&qb, qc = coll(j->s, c, j->s->queue));
            qb_drop(&qb, mine[i]->id, qg[i]);
        }
    }
    if (qc) {
        qb_run(j, &qb, 0);
        mongoc_collection_destroy(qc);
    }
    for (size_t i = 0; r < 0 && i < k; i++) vc_drop(j->s, mine[i]->id);
    if (cas) cas_free(cas, k);
    free(mine);
    free(att);
    free(qg);
    if (r < 0 && !j->err[0]) jfail(j, "out of memory");
    return r;
}

/* Ops on one delivery run in order, one per round; ops on distinct ones share a round. */
static void settle_work(mjob *j, mongoc_client_t *c)
{
    settle_job *q = (settle_job *)j;
    char *done = calloc(q->n, 1);
    rb_settle_op **round = calloc(q->n, sizeof *round);
    if (!done || !round) {
        jfail(j, "out of memory");
        free(done); free(round);
        return;
    }
    for (size_t i = 0; i < q->n; i++) q->ops[i].applied = 0;
    for (size_t left = q->n; left > 0;) {
        size_t m = 0;
        for (size_t i = 0; i < q->n; i++) {
            if (done[i]) continue;
            int clash = 0;
            for (size_t k = 0; k < m && !clash; k++)
                clash = q->ops[i].id && round[k]->id && strcmp(round[k]->id, q->ops[i].id) == 0;
            if (clash) continue;
            round[m++] = &q->ops[i];
            done[i] = 1;
        }
        left -= m;
        if (settle_round(j, c, round, m, store_now(j->s)) < 0) break;
    }
    free(done);
    free(round);
}

static void settle_done(mjob *j, const char *err)
{
    settle_job *q = (settle_job *)j;
    q->cb(q->ud, err);
    free(q);
}

static void m_settle(rb_store *st, rb_settle_op *ops, size_t n, rb_done_cb cb, void *ud)
{
    mstore *s = (mstore *)st;
    if (n == 0) {
        cb(ud, NULL);
        return;
    }
    settle_job *q = job_new(s, sizeof *q, settle_work, settle_done);
    if (!q) {
        cb(ud, "mongodb: out of memory");
        return;
    }
    q->ops = ops;
    q->n = n;
    q->cb = cb;
    q->ud = ud;
    submit(s, &q->j);
}

/* ---- get, list -------------------------------------------------------------------------- */
typedef struct rec_job {
    mjob j;
    char *id, *status, *topic;
    size_t limit;
    rb_delivery **recs;
    size_t nrecs;
    rb_records_cb cb;
    void *ud;
} rec_job;

static void recs_from_docs(rec_job *q, bson_t **docs, size_t n)
{
    q->recs = calloc(n ? n : 1, sizeof *q->recs);
    for (size_t i = 0; q->recs && i < n; i++) {
        rb_delivery *r = record_from(docs[i], NULL);
        if (r) q->recs[q->nrecs++] = r;
    }
    if (!q->recs) jfail(&q->j, "out of memory");
}

static void get_work(mjob *j, mongoc_client_t *c)
{
    rec_job *q = (rec_job *)j;
    int ok, failed = 0;
    bson_t *sel = oid_sel(q->id, &ok);
    mongoc_collection_t *cl = coll(j->s, c, j->s->base.table);
    bson_t *d = ok ? find_one(j, cl, sel, NULL, &failed) : NULL;   /* not an id: not found */
    mongoc_collection_destroy(cl);
    bson_destroy(sel);
    if (!failed) recs_from_docs(q, d ? &d : NULL, d ? 1 : 0);
    if (d) bson_destroy(d);
}

static void list_work(mjob *j, mongoc_client_t *c)
{
    rec_job *q = (rec_job *)j;
    bson_t f = BSON_INITIALIZER, opts = BSON_INITIALIZER, sort;
    if (q->status) BSON_APPEND_UTF8(&f, "status", q->status);
    if (q->topic) BSON_APPEND_UTF8(&f, "topic", q->topic);
    BSON_APPEND_DOCUMENT_BEGIN(&opts, "sort", &sort);
    BSON_APPEND_INT32(&sort, "created_at", 1);
    BSON_APPEND_INT32(&sort, "_id", 1);
    bson_append_document_end(&opts, &sort);
    BSON_APPEND_INT64(&opts, "limit", (int64_t)(q->limit ? q->limit : 100));
    mongoc_collection_t *cl = coll(j->s, c, j->s->base.table);
    bson_t **docs = NULL;
    size_t n = 0;
    if (find_docs(j, cl, &f, &opts, NULL, &docs, &n) == 0) recs_from_docs(q, docs, n);
    docs_free(docs, n);
    mongoc_collection_destroy(cl);
    bson_destroy(&f);
    bson_destroy(&opts);
}

static void rec_done(mjob *j, const char *err)
{
    rec_job *q = (rec_job *)j;
    if (err) {
        rb_delivery_list_free(q->recs, q->nrecs);
        q->cb(q->ud, err, NULL, 0);
    } else {
        q->cb(q->ud, NULL, q->recs, q->nrecs);
    }
    free(q->id); free(q->status); free(q->topic);
    free(q);
}

static void m_get(rb_store *st, const char *id, rb_records_cb cb, void *ud)
{
    rec_job *q = job_new((mstore *)st, sizeof *q, get_work, rec_done);
    if (!q) {
        cb(ud, "mongodb: out of memory", NULL, 0);
        return;
    }
    q->id = dupstr(id ? id : "");
    q->cb = cb;
    q->ud = ud;
    submit((mstore *)st, &q->j);
}

static void m_list(rb_store *st, const rb_list_req *req, rb_records_cb cb, void *ud)
{
    rec_job *q = job_new((mstore *)st, sizeof *q, list_work, rec_done);
    if (!q) {
        cb(ud, "mongodb: out of memory", NULL, 0);
        return;
    }
    q->status = dupstr(req ? req->status : NULL);
    q->topic = dupstr(req ? req->topic : NULL);
    q->limit = req ? req->limit : 0;
    q->cb = cb;
    q->ud = ud;
    submit((mstore *)st, &q->j);
}

/* ---- stats ------------------------------------------------------------------------------ */
typedef struct stats_job {
    mjob j;
    rb_stats st;
    rb_stats_cb cb;
    void *ud;
} stats_job;

static int stats_by_status(stats_job *q, mongoc_collection_t *cl)
{
    bson_t *pipe = BCON_NEW("pipeline", "[", "{", "$group", "{", "_id", BCON_UTF8("$status"),
                            "n", "{", "$sum", BCON_INT32(1), "}", "}", "}", "]");
    mongoc_cursor_t *cur = mongoc_collection_aggregate(cl, MONGOC_QUERY_NONE, pipe, NULL, NULL);
    const bson_t *d;
    bson_error_t e;
    while (mongoc_cursor_next(cur, &d)) {
        const char *st = doc_str(d, "_id");
        int64_t n = doc_int(d, "n");
        switch (rb_status_parse(st)) {
        case RB_PENDING: q->st.pending = n; break;
        case RB_PROCESSING: q->st.processing = n; break;
        case RB_COMPLETED: q->st.completed = n; break;
        case RB_BURIED: q->st.buried = n; break;
        default: break;
        }
    }
    int failed = mongoc_cursor_error(cur, &e);
    if (failed) jfail_bson(&q->j, "stats", &e);
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
    append_range(&f, field, "$lte", now);
    BSON_APPEND_DOCUMENT_BEGIN(&opts, "sort", &sort);
    BSON_APPEND_INT32(&sort, field, 1);
    bson_append_document_end(&opts, &sort);
    BSON_APPEND_INT64(&opts, "limit", 1);
    bson_t **v = NULL;
    size_t n = 0;
    int failed = find_docs(&q->j, cl, &f, &opts, NULL, &v, &n) < 0;
    for (size_t i = 0; i < n; i++) {
        if (i == 0 && doc_num(v[i], field) < *oldest) *oldest = doc_num(v[i], field);
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
    double now = store_now(j->s), oldest = INFINITY;
    mongoc_collection_t *cl = coll(j->s, c, j->s->base.table);
    bson_t f = BSON_INITIALIZER;
    bson_error_t e;
    append_due(&f, now);
    if (stats_by_status(q, cl) == 0) {
        int64_t due = mongoc_collection_count_documents(cl, &f, NULL, NULL, NULL, &e);
        if (due < 0) jfail_bson(j, "stats", &e);
        else if (stats_oldest(q, cl, "pending", "run_at", now, &oldest) == 0 &&
                 stats_oldest(q, cl, "processing", "lease_expires_at", now, &oldest) == 0) {
            q->st.due = due;
            q->st.oldest_due_age = isfinite(oldest) && due > 0 ? now - oldest : 0;
        }
    }
    bson_destroy(&f);
    mongoc_collection_destroy(cl);
}

static void stats_done(mjob *j, const char *err)
{
    stats_job *q = (stats_job *)j;
    q->cb(q->ud, err, err ? NULL : &q->st);
    free(q);
}

static void m_stats(rb_store *st, rb_stats_cb cb, void *ud)
{
    stats_job *q = job_new((mstore *)st, sizeof *q, stats_work, stats_done);
    if (!q) {
        cb(ud, "mongodb: out of memory", NULL);
        return;
    }
    q->cb = cb;
    q->ud = ud;
    submit((mstore *)st, &q->j);
}

/* ---- kick, purge ------------------------------------------------------------------------ */
typedef struct count_job {
    mjob j;
    rb_kick_mode mode;
    char *id, *status;
    double older_than;
    size_t limit;
    int64_t count;
    rb_count_cb cb;
    void *ud;
} count_job;

static bson_t *upd_kick(const bson_t *cur, double now, int with_dedupe)
{
    bson_t *u = bson_new(), set, un;
    BSON_APPEND_DOCUMENT_BEGIN(u, "$set", &set);
    BSON_APPEND_UTF8(&set, "status", "pending");
    BSON_APPEND_INT32(&set, "attempts", 0);
    BSON_APPEND_DOUBLE(&set, "run_at", now);
    BSON_APPEND_INT64(&set, "v", doc_int(cur, "v") + 1);
    const char *key = doc_str(cur, "key"), *topic = doc_str(cur, "topic");
    if (with_dedupe && key && topic) {
        char *dd = dedupe_value(topic, key);
        if (dd) BSON_APPEND_UTF8(&set, "dedupe", dd);
        free(dd);
    }
    bson_append_document_end(u, &set);
    BSON_APPEND_DOCUMENT_BEGIN(u, "$unset", &un);
    BSON_APPEND_UTF8(&un, "settled_at", "");
    bson_append_document_end(u, &un);
    return u;
}

/* Kicks (or deletes) the given documents; returns how many changed, -1 on failure. A kicked
 * delivery whose topic and key another live delivery holds now goes back without its key's
 * dedupe rather than not at all. */
static int64_t kick_docs(mjob *j, mongoc_client_t *c, bson_t **docs, size_t n, int del, double now)
{
    cas_op *ops = calloc(n ? n : 1, sizeof *ops);
    if (!ops) {
        jfail(j, "out of memory");
        return -1;
    }
    int64_t won = 0;
    if (!del && j->s->ferret && n) {   /* a kicked delivery is live again: its entry first */
        mongoc_collection_t *qc = coll(j->s, c, j->s->queue);
        qbatch qb;
        char hex[25];
        qb_init(&qb, qc);
        /* Generation: the time in microseconds. Claims count on from it by one, so no earlier
         * entry of the delivery (which a settle or a claim may be removing by id) has it. */
        for (size_t i = 0; i < n; i++)
            if (docs[i] && doc_oid(docs[i], hex))
                qb_put(&qb, hex, doc_str(docs[i], "topic"), (int64_t)(now * 1e6), 0, now);
        int r = qb_run(j, &qb, 1);
        mongoc_collection_destroy(qc);
        if (r < 0) {
            free(ops);
            return -1;
        }
    }
    for (int pass = 0; pass < 2 && n; pass++) {
        size_t k = 0;
        for (size_t i = 0; i < n; i++) {
            if (!docs[i]) continue;
            cas_init(j->s, &ops[k++], docs[i], "d", del ? NULL : upd_kick(docs[i], now, pass == 0));
        }
        if (cas_run(j, c, j->s->base.table, ops, k, now) < 0) {
            cas_free(ops, k);
            return -1;
        }
        size_t m = 0;
        for (size_t i = 0; i < n; i++) {
            if (!docs[i]) continue;
            if (ops[m].won) won++;
            if (ops[m].won || ops[m].code != 11000) {   /* done with it, unless dedupe refused */
                bson_destroy(docs[i]);
                docs[i] = NULL;
            }
            m++;
        }
        for (size_t i = 0; i < k; i++) {
            bson_destroy(&ops[i].sel);
            bson_destroy(&ops[i].filter);
            if (ops[i].update) bson_destroy(ops[i].update);
        }
        memset(ops, 0, n * sizeof *ops);
    }
    free(ops);
    return won;
}

static void kick_work(mjob *j, mongoc_client_t *c)
{
    count_job *q = (count_job *)j;
    mongoc_collection_t *cl = coll(j->s, c, j->s->base.table);
    for (;;) {
        double now = store_now(j->s);
        bson_t f = BSON_INITIALIZER, opts = BSON_INITIALIZER;
        int ok = 1;
        if (q->mode == RB_KICK_ONE) {
            bson_oid_t oid;
            ok = parse_oid(q->id, &oid);
            if (ok) BSON_APPEND_OID(&f, "_id", &oid);
        } else {
            BSON_APPEND_UTF8(&f, "status", "buried");
        }
        BSON_APPEND_INT64(&opts, "limit", BATCH_ROUND);
        bson_t **docs = NULL;
        size_t n = 0;
        int r = ok ? find_docs(j, cl, &f, &opts, NULL, &docs, &n) : 0;
        bson_destroy(&f);
        bson_destroy(&opts);
        size_t live = 0;
        for (size_t i = 0; i < n; i++) {
            const char *st = doc_str(docs[i], "status");
            if (!st || strcmp(st, "buried") != 0) {
                bson_destroy(docs[i]);
                docs[i] = NULL;
            } else {
                live++;
            }
        }
        int64_t won = (r == 0 && live) ? kick_docs(j, c, docs, n, 0, now) : 0;
        docs_free(docs, n);    /* kick_docs NULLed what it consumed; bson_destroy skips NULL */
        if (r < 0 || won < 0) break;
        q->count += won;
        if (q->mode == RB_KICK_ONE || n < BATCH_ROUND || won == 0) break;
    }
    mongoc_collection_destroy(cl);
}

static void purge_work(mjob *j, mongoc_client_t *c)
{
    count_job *q = (count_job *)j;
    mongoc_collection_t *cl = coll(j->s, c, j->s->base.table);
    for (;;) {
        double now = store_now(j->s);
        size_t want = BATCH_ROUND;
        if (q->limit && q->limit - (size_t)q->count < want) want = q->limit - (size_t)q->count;
        bson_t f = BSON_INITIALIZER, opts = BSON_INITIALIZER;
        BSON_APPEND_UTF8(&f, "status", q->status);
        append_range(&f, "settled_at", "$lte", now - q->older_than);
        BSON_APPEND_INT64(&opts, "limit", (int64_t)want);
        bson_t **docs = NULL;
        size_t n = 0;
        int r = find_docs(j, cl, &f, &opts, NULL, &docs, &n);
        bson_destroy(&f);
        bson_destroy(&opts);
        int64_t won = (r == 0 && n) ? kick_docs(j, c, docs, n, 1, now) : 0;
        docs_free(docs, n);
        if (r < 0 || won < 0) break;
        q->count += won;
        if (n < want || won == 0 || (q->limit && (size_t)q->count >= q->limit)) break;
    }
    mongoc_collection_destroy(cl);
}

static void count_done(mjob *j, const char *err)
{
    count_job *q = (count_job *)j;
    q->cb(q->ud, err, err ? 0 : q->count);
    free(q->id);
    free(q->status);
    free(q);
}

static void m_kick(rb_store *st, rb_kick_mode mode, const char *id, rb_count_cb cb, void *ud)
{
    count_job *q = job_new((mstore *)st, sizeof *q, kick_work, count_done);
    if (!q) {
        cb(ud, "mongodb: out of memory", 0);
        return;
    }
    q->mode = mode;
    q->id = dupstr(id ? id : "");
    q->cb = cb;
    q->ud = ud;
    submit((mstore *)st, &q->j);
}

static void m_purge(rb_store *st, const char *status, double older_than, size_t limit,
                    rb_count_cb cb, void *ud)
{
    if (!status || (strcmp(status, "completed") != 0 && strcmp(status, "buried") != 0)) {
        cb(ud, "mongodb: purge: status must be completed or buried", 0);
        return;
    }
    count_job *q = job_new((mstore *)st, sizeof *q, purge_work, count_done);
    if (!q) {
        cb(ud, "mongodb: out of memory", 0);
        return;
    }
    q->status = strdup(status);
    q->older_than = older_than;
    q->limit = limit;
    q->cb = cb;
    q->ud = ud;
    submit((mstore *)st, &q->j);
}

/* ---- named leases ----------------------------------------------------------------------- */
typedef enum { LEASE_ACQUIRE, LEASE_EXTEND, LEASE_RELEASE } lease_kind;

typedef struct lease_job {
    mjob j;
    lease_kind kind;
    char *name, *token;
    double duration;
    int acquired;
    double expires;
    rb_lease_cb cb;
    void *ud;
} lease_job;

static bson_t *upd_lease(const bson_t *cur, const char *token, double expires)
{
    bson_t *u = bson_new(), set;
    BSON_APPEND_DOCUMENT_BEGIN(u, "$set", &set);
    if (token) BSON_APPEND_UTF8(&set, "token", token);
    else BSON_APPEND_NULL(&set, "token");
    BSON_APPEND_DOUBLE(&set, "expires_at", expires);
    BSON_APPEND_INT64(&set, "v", doc_int(cur, "v") + 1);
    bson_append_document_end(u, &set);
    return u;
}

/* A name never held: insert it (atomic through the _id index). */
static void lease_insert(lease_job *q, mongoc_collection_t *cl, double now)
{
    bson_t d = BSON_INITIALIZER;
    bson_error_t e;
    BSON_APPEND_UTF8(&d, "_id", q->name);
    BSON_APPEND_UTF8(&d, "token", q->token);
    BSON_APPEND_DOUBLE(&d, "expires_at", now + q->duration);
    BSON_APPEND_INT64(&d, "v", 0);
    if (mongoc_collection_insert_one(cl, &d, NULL, NULL, &e)) {
        q->acquired = 1;
        q->expires = now + q->duration;
    } else if (e.code != 11000) {
        jfail_bson(&q->j, "lease", &e);
    }
    bson_destroy(&d);
}

/* Which change the request makes to the current lease document; NULL: none (not held). */
static bson_t *lease_change(lease_job *q, const bson_t *cur, double now, double *expires)
{
    const char *holder = doc_str(cur, "token");
    double exp = doc_num(cur, "expires_at");
    int mine = holder && strcmp(holder, q->token) == 0;
    switch (q->kind) {
    case LEASE_ACQUIRE:
        if (holder && exp > now && !mine) return NULL;
        *expires = now + q->duration;
        return upd_lease(cur, q->token, *expires);
    case LEASE_EXTEND:
        if (!mine || exp <= now) return NULL;
        *expires = now + q->duration;
        return upd_lease(cur, q->token, *expires);
    case LEASE_RELEASE:
    default:
        /* Kept, not deleted: its version must keep growing for the tickets. */
        if (!mine) return NULL;
        *expires = 0;
        return upd_lease(cur, NULL, 0);
    }
}

static void lease_work(mjob *j, mongoc_client_t *c)
{
    lease_job *q = (lease_job *)j;
    double now = store_now(j->s);
    mongoc_collection_t *cl = coll(j->s, c, j->s->leases);
    bson_t sel = BSON_INITIALIZER;
    BSON_APPEND_UTF8(&sel, "_id", q->name);
    int failed = 0;
    bson_t *cur = find_one(j, cl, &sel, NULL, &failed);
    double expires = 0;
    bson_t *u = (cur && !failed) ? lease_change(q, cur, now, &expires) : NULL;
    if (!failed && !cur && q->kind == LEASE_ACQUIRE) {
        lease_insert(q, cl, now);
    } else if (u) {
        cas_op op;
        cas_init(j->s, &op, cur, "l", u);
        if (cas_run(j, c, j->s->leases, &op, 1, now) == 0 && op.won) {
            q->acquired = 1;
            q->expires = expires;
        }
        bson_destroy(&op.sel);
        bson_destroy(&op.filter);
        bson_destroy(u);
    }
    if (cur) bson_destroy(cur);
    bson_destroy(&sel);
    mongoc_collection_destroy(cl);
}

static void lease_done(mjob *j, const char *err)
{
    lease_job *q = (lease_job *)j;
    q->cb(q->ud, err, err ? 0 : q->acquired, q->expires);
    free(q->name);
    free(q->token);
    free(q);
}

static void lease_submit(rb_store *st, lease_kind kind, const char *name, const char *token,
                         double duration, rb_lease_cb cb, void *ud)
{
    if (!name || !token) {
        cb(ud, "mongodb: lease: name and token are required", 0, 0);
        return;
    }
    lease_job *q = job_new((mstore *)st, sizeof *q, lease_work, lease_done);
    if (!q) {
        cb(ud, "mongodb: out of memory", 0, 0);
        return;
    }
    q->kind = kind;
    q->name = strdup(name);
    q->token = strdup(token);
    q->duration = duration;
    q->cb = cb;
    q->ud = ud;
    submit((mstore *)st, &q->j);
}

static void m_lease_acquire(rb_store *s, const char *name, const char *token, double duration,
                            rb_lease_cb cb, void *ud)
{
    lease_submit(s, LEASE_ACQUIRE, name, token, duration, cb, ud);
}

static void m_lease_extend(rb_store *s, const char *name, const char *token, double duration,
                           rb_lease_cb cb, void *ud)
{
    lease_submit(s, LEASE_EXTEND, name, token, duration, cb, ud);
}

static void m_lease_release(rb_store *s, const char *name, const char *token, rb_lease_cb cb,
                            void *ud)
{
    lease_submit(s, LEASE_RELEASE, name, token, 0, cb, ud);
}

/* ---- transactions (replica sets only) --------------------------------------------------- */
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
    union { rb_tx_cb tx; rb_doc_cb doc; rb_done_cb done; } cb;
    void *ud;
} tx_job;

static void tx_unlink(mstore *s, rb_tx *tx)
{
    if (tx->prev) tx->prev->next = tx->next;
    else if (s->txs == tx) s->txs = tx->next;
    if (tx->next) tx->next->prev = tx->prev;
    tx->prev = tx->next = NULL;
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
        jfail_bson(j, "begin", &e);
        tx_release(tx);
    }
}

static void begin_done(mjob *j, const char *err)
{
    tx_job *q = (tx_job *)j;
    if (err) {
        free(q->tx);
        q->cb.tx(q->ud, err, NULL);
    } else {
        mstore *s = j->s;
        q->tx->next = s->txs;
        if (s->txs) s->txs->prev = q->tx;
        s->txs = q->tx;
        q->cb.tx(q->ud, NULL, q->tx);
    }
    free(q);
}

static void m_begin(rb_store *st, rb_tx_cb cb, void *ud)
{
    mstore *s = (mstore *)st;
    if (!s->replset) {
        cb(ud, "mongodb: transactions need a MongoDB replica set (this server is standalone"
               " or FerretDB, which has no multi-document transactions)", NULL);
        return;
    }
    tx_job *q = job_new(s, sizeof *q, begin_work, begin_done);
    rb_tx *tx = calloc(1, sizeof *tx);
    if (!q || !tx) {
        free(q); free(tx);
        cb(ud, "mongodb: out of memory", NULL);
        return;
    }
    tx->s = s;
    q->tx = tx;
    q->cb.tx = cb;
    q->ud = ud;
    submit(s, &q->j);
}

/* Enqueue inside a transaction: a duplicate-key error would abort the whole transaction, so
 * dedupe is check-then-insert here; the unique index still guards against a concurrent one. */
static void tx_enq_work(mjob *j, mongoc_client_t *c)
{
    enq_job *q = (enq_job *)j;
    mongoc_client_session_t *cs = j->tx->cs;
    mongoc_collection_t *cl = coll(j->s, c, j->s->base.table);
    double now = store_now(j->s);
    q->ids = calloc(q->n, sizeof *q->ids);
    for (size_t i = 0; q->ids && i < q->n && !j->err[0]; i++) {
        long k = same_key_before(q->items, i);
        if (k >= 0) {
            q->ids[i] = strdup(q->ids[k]);
            continue;
        }
        int failed = 0;
        char *holder = q->items[i].key ? dedupe_holder(j, cl, &q->items[i], cs, &failed) : NULL;
        if (failed || holder) {
            q->ids[i] = holder;
            continue;
        }
        char hex[25];
        bson_t *d = delivery_doc(&q->items[i], now, hex), opts = BSON_INITIALIZER;
        bson_error_t e;
        if (!mongoc_client_session_append(cs, &opts, &e) ||
            !mongoc_collection_insert_one(cl, d, &opts, NULL, &e))
            jfail_bson(j, "enqueue", &e);
        else q->ids[i] = strdup(hex);
        bson_destroy(&opts);
        bson_destroy(d);
    }
    if (!q->ids) jfail(j, "out of memory");
    mongoc_collection_destroy(cl);
}

static void m_tx_enqueue(rb_tx *tx, const rb_enqueue_item *items, size_t n, rb_ids_cb cb, void *ud)
{
    char err[ERRLEN];
    if (!tx->s) {
        cb(ud, STORE_CLOSED, NULL, 0);
        return;
    }
    enq_job *q = enq_prepare(tx->s, items, n, tx_enq_work, err, sizeof err);
    if (!q) {
        cb(ud, err, NULL, 0);
        return;
    }
    q->j.tx = tx;
    q->j.done = enq_done;
    q->cb = cb;
    q->ud = ud;
    submit(tx->s, &q->j);
}

static int64_t reply_count(const bson_t *reply, const char *field)
{
    return doc_int(reply, field);
}

static void tx_doc_find(tx_job *q, mongoc_collection_t *cl)
{
    int failed = 0;
    bson_t *d = find_one(&q->j, cl, q->filter, q->tx->cs, &failed);
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
    if (!ok) jfail_bson(j, "collection", &e);
    bson_destroy(&reply);
    bson_destroy(&opts);
    mongoc_collection_destroy(cl);
}

static void tx_doc_done(mjob *j, const char *err)
{
    tx_job *q = (tx_job *)j;
    q->cb.doc(q->ud, err, err ? NULL : q->found_json, err ? 0 : q->count);
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
        one_line(err);
    }
    return b;
}

static void m_tx_doc(rb_tx *tx, rb_doc_op op, const char *collection, const char *filter_json,
                     const char *doc_json, rb_doc_cb cb, void *ud)
{
    char err[ERRLEN] = "";
    if (!tx->s) {
        cb(ud, STORE_CLOSED, NULL, 0);
        return;
    }
    if (!collection || !*collection) {
        cb(ud, "mongodb: collection name is empty", NULL, 0);
        return;
    }
    tx_job *q = job_new(tx->s, sizeof *q, tx_doc_work, tx_doc_done);
    if (!q) {
        cb(ud, "mongodb: out of memory", NULL, 0);
        return;
    }
    q->j.tx = q->tx = tx;
    q->op = op;
    q->collection = strdup(collection);
    q->cb.doc = cb;
    q->ud = ud;
    if (op != RB_DOC_INSERT_ONE) q->filter = parse_json(filter_json, "filter", err, sizeof err);
    if (!err[0] && (op == RB_DOC_INSERT_ONE || op == RB_DOC_UPDATE_ONE))
        q->doc = parse_json(doc_json, "document", err, sizeof err);
    if (err[0]) {
        q->j.done = tx_doc_done;
        tx_doc_done(&q->j, err);
        return;
    }
    submit(tx->s, &q->j);
}

/* The fenced completion inside the transaction: the version filter and a ticket make it
 * conflict with any concurrent change of the delivery. 1: applied; 0: lease lost; -1: error. */
static int tx_complete(tx_job *q, mongoc_client_t *c)
{
    mjob *j = &q->j;
    mongoc_client_session_t *cs = q->tx->cs;
    rb_settle_op *op = q->complete;
    double now = store_now(j->s);
    int ok, failed = 0, r = 0;
    bson_t *sel = oid_sel(op->id, &ok);
    mongoc_collection_t *cl = coll(j->s, c, j->s->base.table), *tk = coll(j->s, c, j->s->tickets);
    bson_t *d = ok ? find_one(j, cl, sel, cs, &failed) : NULL;
    if (failed) r = -1;
    else if (d && holds_lease(d, op->token)) {
        cas_op cop;
        bson_t opts = BSON_INITIALIZER, t = BSON_INITIALIZER, reply;
        bson_error_t e;
        cas_init(j->s, &cop, d, "d", upd_settle(d, op, now));
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
            if (r < 0) jfail_bson(j, "commit", &e);
        }
        if (sent) bson_destroy(&reply);     /* update_one always initialises it */
        bson_destroy(&opts);
        bson_destroy(&t);
        bson_destroy(&cop.sel);
        bson_destroy(&cop.filter);
        bson_destroy(cop.update);
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
    if (commit && q->complete) {
        int r = tx_complete(q, c);
        q->complete->applied = r == 1;
        if (r != 1) commit = 0;
    }
    if (commit) {
        bson_t reply;
        if (!mongoc_client_session_commit_transaction(q->tx->cs, &reply, &e))
            jfail_bson(j, "commit", &e);
        bson_destroy(&reply);
    } else if (!mongoc_client_session_abort_transaction(q->tx->cs, &e) && !j->err[0]) {
        jfail_bson(j, "rollback", &e);
    }
    if (q->complete && j->err[0]) q->complete->applied = 0;
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
    q->cb.done(q->ud, err);
    free(q);
}

static void tx_end(rb_tx *tx, int commit, rb_settle_op *complete, rb_done_cb cb, void *ud)
{
    if (complete) complete->applied = 0;
    if (!tx->s) {
        free(tx);
        cb(ud, STORE_CLOSED);
        return;
    }
    tx_job *q = job_new(tx->s, sizeof *q, end_work, end_done);
    if (!q) {
        tx_unlink(tx->s, tx);
        tx_release(tx);
        free(tx);
        cb(ud, "mongodb: out of memory");
        return;
    }
    q->j.tx = q->tx = tx;
    q->commit = commit;
    q->complete = complete;
    q->cb.done = cb;
    q->ud = ud;
    submit(tx->s, &q->j);
}

static void m_commit(rb_tx *tx, rb_settle_op *complete, rb_done_cb cb, void *ud)
{
    tx_end(tx, 1, complete, cb, ud);
}

static void m_rollback(rb_tx *tx, rb_done_cb cb, void *ud)
{
    tx_end(tx, 0, NULL, cb, ud);
}

/* ---- open and close --------------------------------------------------------------------- */
static void close_jobs(mstore *s)
{
    pthread_mutex_lock(&s->mu);
    mjob *done = s->done_head, *queued = s->queue_head;
    s->done_head = s->done_tail = s->queue_head = s->queue_tail = NULL;
    pthread_mutex_unlock(&s->mu);
    for (mjob *next; done; done = next) {     /* ran: their results stand */
        next = done->next;
        job_finish(s, done, done->err[0] ? done->err : NULL);
    }
    for (mjob *next; queued; queued = next) { /* never ran */
        next = queued->next;
        job_finish(s, queued, STORE_CLOSED);
    }
}

static void store_free(mstore *s)
{
    if (s->pool) mongoc_client_pool_destroy(s->pool);
    if (s->uri) mongoc_uri_destroy(s->uri);
    free(s->db);
    free(s->leases);
    free(s->tickets);
    free(s->queue);
    free(s->base.table);
    vc_clear_locked(s);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}

static void m_close(rb_store *st)
{
    mstore *s = (mstore *)st;
    if (!s || s->closing) return;
    s->closing = 1;
    pthread_mutex_lock(&s->mu);
    s->stopping = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < s->nthreads; i++) pthread_join(s->threads[i], NULL);
    close_jobs(s);
    while (s->txs) {          /* the caller still owns each rb_tx: leave it dead, not freed */
        rb_tx *tx = s->txs;
        tx_unlink(s, tx);
        tx_release(tx);
        tx->s = NULL;
    }
    ev_ref(s->base.loop);     /* undo the unref made when the watcher started */
    ev_async_stop(s->base.loop, &s->async);
    store_free(s);
}

/* libmongoc logs connection trouble (and, in Debian's build, debug chatter) to stderr on its
 * own; the store reports failures through its errors instead, so only errors pass. */
static void mongoc_log_quiet(mongoc_log_level_t level, const char *domain, const char *message,
                             void *ud)
{
    if (level <= MONGOC_LOG_LEVEL_ERROR) mongoc_log_default_handler(level, domain, message, ud);
}

static pthread_once_t mongoc_once = PTHREAD_ONCE_INIT;
static void mongoc_global_init(void)
{
    mongoc_init();
    mongoc_log_set_handler(mongoc_log_quiet, NULL);
}

/* One index per command: FerretDB 1.24 panics when one createIndexes names two or more
 * indexes that already exist (it deletes from the list it is walking). */
static int create_index(mongoc_client_t *c, const char *db, const char *collname, bson_t *index,
                        char *err, size_t errlen)
{
    bson_t cmd = BSON_INITIALIZER, arr, reply;
    bson_error_t e;
    BSON_APPEND_UTF8(&cmd, "createIndexes", collname);
    BSON_APPEND_ARRAY_BEGIN(&cmd, "indexes", &arr);
    BSON_APPEND_DOCUMENT(&arr, "0", index);
    bson_append_array_end(&cmd, &arr);
    mongoc_database_t *d = mongoc_client_get_database(c, db);
    int ok = mongoc_database_write_command_with_opts(d, &cmd, NULL, &reply, &e);
    if (!ok) {
        snprintf(err, errlen, "mongodb: cannot create indexes on %s.%s: %.200s", db, collname, e.message);
        one_line(err);
    }
    mongoc_database_destroy(d);
    bson_destroy(&reply);
    bson_destroy(&cmd);
    bson_destroy(index);
    return ok;
}

/* FerretDB: a deliveries collection from before the queue existed gets an entry for each live
 * delivery, once (the one full scan), when the queue collection is made. */
static int queue_backfill(mstore *s, mongoc_client_t *c, char *err, size_t errlen)
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
        mongoc_collection_t *cl = coll(s, c, s->base.table);
        bson_t *f = BCON_NEW("status", "{", "$in", "[", BCON_UTF8("pending"), BCON_UTF8("processing"), "]", "}");
        mongoc_cursor_t *cur = ok ? mongoc_collection_find_with_opts(cl, f, NULL, NULL) : NULL;
        const bson_t *doc;
        mjob j;
        memset(&j, 0, sizeof j);
        j.s = s;
        qbatch qb;
        qb_init(&qb, qc = coll(s, c, s->queue));
        double now = store_now(s);
        while (cur && mongoc_cursor_next(cur, &doc)) {
            char hex[25];
            if (doc_oid(doc, hex)) qb_put(&qb, hex, doc_str(doc, "topic"), 0, 0, now);
        }
        if (cur && mongoc_cursor_error(cur, &e)) ok = 0;
        if (cur) mongoc_cursor_destroy(cur);
        if (qb_run(&j, &qb, 1) < 0 && ok) {
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
        one_line(err);
    }
    mongoc_database_destroy(d);
    return ok;
}

/* Claims sort by run_at among due statuses; purges look for old settled ones; dedupe is unique
 * among live deliveries only (sparse: completed and buried ones drop the field). FerretDB
 * accepts and ignores sparse, but its SQLite index skips missing fields anyway. */
static int migrate(mstore *s, mongoc_client_t *c, char *err, size_t errlen)
{
    const char *t = s->base.table;
    return create_index(c, s->db, t, BCON_NEW("key", "{", "status", BCON_INT32(1), "run_at", BCON_INT32(1), "}",
                                              "name", BCON_UTF8("status_run_at")), err, errlen) &&
           create_index(c, s->db, t, BCON_NEW("key", "{", "dedupe", BCON_INT32(1), "}",
                                              "name", BCON_UTF8("dedupe"), "unique", BCON_BOOL(true),
                                              "sparse", BCON_BOOL(true)), err, errlen) &&
           create_index(c, s->db, t, BCON_NEW("key", "{", "status", BCON_INT32(1), "settled_at", BCON_INT32(1), "}",
                                              "name", BCON_UTF8("status_settled_at")), err, errlen) &&
           create_index(c, s->db, s->tickets, BCON_NEW("key", "{", "at", BCON_INT32(1), "}",
                                                       "name", BCON_UTF8("at")), err, errlen) &&
           (!s->ferret || queue_backfill(s, c, err, errlen));
}

/* Pings through hello (the server's clock too) and learns what the server is. */
static int probe(mstore *s, mongoc_client_t *c, const char *uri, char *err, size_t errlen)
{
    bson_t reply, cmd = BSON_INITIALIZER;
    bson_error_t e;
    if (!read_clock(s, c, &reply, &e)) {
        snprintf(err, errlen, "mongodb: cannot reach the server at %.120s: %.160s", uri, e.message);
        one_line(err);
        bson_destroy(&reply);
        return 0;
    }
    const char *msg = doc_str(&reply, "msg");
    bson_iter_t it;
    s->replset = bson_iter_init_find(&it, &reply, "setName") || (msg && strcmp(msg, "isdbgrid") == 0);
    bson_destroy(&reply);
    BSON_APPEND_INT32(&cmd, "buildInfo", 1);
    if (mongoc_client_command_simple(c, "admin", &cmd, NULL, &reply, &e))
        s->ferret = bson_iter_init_find(&it, &reply, "ferretdbVersion");
    bson_destroy(&reply);
    bson_destroy(&cmd);
    if (s->ferret) s->replset = 0;
    return 1;
}

static mongoc_uri_t *parse_uri(const char *uri, char *err, size_t errlen)
{
    bson_error_t e;
    mongoc_uri_t *u = mongoc_uri_new_with_error(uri, &e);
    if (!u) {
        snprintf(err, errlen, "mongodb: bad URL: %.200s", e.message);
        one_line(err);
        return NULL;
    }
    /* An unreachable server must fail in seconds, not libmongoc's default 30. */
    if (!mongoc_uri_has_option(u, MONGOC_URI_SERVERSELECTIONTIMEOUTMS))
        mongoc_uri_set_option_as_int32(u, MONGOC_URI_SERVERSELECTIONTIMEOUTMS, 5000);
    if (!mongoc_uri_has_option(u, MONGOC_URI_CONNECTTIMEOUTMS))
        mongoc_uri_set_option_as_int32(u, MONGOC_URI_CONNECTTIMEOUTMS, 5000);
    /* A server that stops answering must fail an operation well within a lease, not after
     * libmongoc's default of five minutes; the worker thread is then free again. */
    if (!mongoc_uri_has_option(u, MONGOC_URI_SOCKETTIMEOUTMS))
        mongoc_uri_set_option_as_int32(u, MONGOC_URI_SOCKETTIMEOUTMS, 20000);
    if (!mongoc_uri_has_option(u, MONGOC_URI_APPNAME))
        mongoc_uri_set_appname(u, "relaybus");
    return u;
}

static mstore *store_new(struct ev_loop *loop, const rb_store_options *opts)
{
    mstore *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    const char *table = opts && opts->table ? opts->table : "relaybus_deliveries";
    size_t n = strlen(table) + 16;
    s->base.vt = &mongo_vtable;
    s->base.loop = loop;
    s->base.table = strdup(table);
    s->leases = malloc(n);
    s->tickets = malloc(n);
    s->queue = malloc(n);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    if (!s->base.table || !s->leases || !s->tickets || !s->queue) {
        store_free(s);
        return NULL;
    }
    snprintf(s->leases, n, "%s_leases", table);
    snprintf(s->tickets, n, "%s_tickets", table);
    snprintf(s->queue, n, "%s_queue", table);
    s->clock_checked = mono_now();
    return s;
}

static int start_workers(mstore *s, char *err, size_t errlen)
{
    for (int i = 0; i < NWORKERS; i++) {
        int rc = pthread_create(&s->threads[i], NULL, worker_main, s);
        if (rc != 0) {
            snprintf(err, errlen, "mongodb: cannot start a worker thread: %s", strerror(rc));
            return 0;
        }
        s->nthreads++;
    }
    ev_async_init(&s->async, on_async);
    s->async.data = s;
    ev_async_start(s->base.loop, &s->async);
    ev_unref(s->base.loop);   /* an idle store does not keep the loop running */
    return 1;
}

static void stop_workers(mstore *s)
{
    pthread_mutex_lock(&s->mu);
    s->stopping = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < s->nthreads; i++) pthread_join(s->threads[i], NULL);
}

rb_store *rb_mongo_open(struct ev_loop *loop, const char *uri, const rb_store_options *opts,
                        char *err, size_t errlen)
{
    pthread_once(&mongoc_once, mongoc_global_init);
    char warm[33];
    rb_random_token(warm);  /* opens its urandom fd here, before worker threads share it */
    mstore *s = store_new(loop, opts);
    if (!s) {
        snprintf(err, errlen, "mongodb: out of memory");
        return NULL;
    }
    bson_error_t e;
    const char *db;
    if (!(s->uri = parse_uri(uri, err, errlen))) goto fail;
    db = mongoc_uri_get_database(s->uri);
    s->db = strdup(db && *db ? db : "relaybus");
    if (!(s->pool = mongoc_client_pool_new_with_error(s->uri, &e))) {
        snprintf(err, errlen, "mongodb: %.200s", e.message);
        goto fail;
    }
    mongoc_client_pool_set_error_api(s->pool, MONGOC_ERROR_API_VERSION_2);
    mongoc_client_t *c = mongoc_client_pool_pop(s->pool);
    int ok = probe(s, c, uri, err, errlen) &&
             (!opts || !opts->migrate || migrate(s, c, err, errlen));
    mongoc_client_pool_push(s->pool, c);
    if (!ok) goto fail;
    if (!start_workers(s, err, errlen)) {
        stop_workers(s);
        goto fail;
    }
    return &s->base;
fail:
    one_line(err);
    store_free(s);
    return NULL;
}

static const rb_store_vtable mongo_vtable = {
    .name = "mongodb",
    .enqueue = m_enqueue,
    .claim = m_claim,
    .settle = m_settle,
    .get = m_get,
    .list = m_list,
    .stats = m_stats,
    .kick = m_kick,
    .purge = m_purge,
    .lease_acquire = m_lease_acquire,
    .lease_extend = m_lease_extend,
    .lease_release = m_lease_release,
    .begin = m_begin,
    .tx_enqueue = m_tx_enqueue,
    .tx_exec = NULL,
    .tx_query = NULL,
    .tx_doc = m_tx_doc,
    .commit = m_commit,
    .rollback = m_rollback,
    .set_wakeup = NULL,
    .close = m_close,
};
