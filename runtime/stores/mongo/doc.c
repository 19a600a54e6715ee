/* doc.c -- the MongoDB store's small helpers: errors, reading documents, finds, bulk writes. */
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include "stores/mongo/mstore.h"
#include "util/alloc.h"
#include "util/text.h"

/* ---- small helpers --------------------------------------------------------------------- */
char *mg_dupstr(const char *s)
{
    return s ? rb_strdup(s) : NULL;
}

/* Messages are one line: server texts may carry newlines. In place, in a buffer of cap. */
void mg_one_line(char *s, size_t cap)
{
    char tmp[ERRLEN];
    rb_one_line(tmp, cap < sizeof tmp ? cap : sizeof tmp, s);
    memcpy(s, tmp, strlen(tmp) + 1);
}

void mg_fail(mjob *j, const char *fmt, ...)
{
    va_list ap;
    int n = snprintf(j->err, sizeof j->err, "mongodb: ");
    va_start(ap, fmt);
    vsnprintf(j->err + n, sizeof j->err - (size_t)n, fmt, ap);
    va_end(ap);
    mg_one_line(j->err, sizeof j->err);
}

void mg_fail_bson(mjob *j, const char *what, const bson_error_t *e)
{
    mg_fail(j, "%s: %s", what, e->message[0] ? e->message : "unknown error");
}

mongoc_collection_t *mg_coll(mstore *s, mongoc_client_t *c, const char *name)
{
    return mongoc_client_get_collection(c, s->db, name);
}

/* ---- reading documents ----------------------------------------------------------------- */
const char *mg_doc_str(const bson_t *d, const char *k)
{
    bson_iter_t it;
    if (bson_iter_init_find(&it, d, k) && BSON_ITER_HOLDS_UTF8(&it)) return bson_iter_utf8(&it, NULL);
    return NULL;
}

double mg_doc_num(const bson_t *d, const char *k)
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

int64_t mg_doc_int(const bson_t *d, const char *k)
{
    bson_iter_t it;
    if (!bson_iter_init_find(&it, d, k)) return 0;
    switch (bson_iter_type(&it)) {
    case BSON_TYPE_INT32: return bson_iter_int32(&it);
    case BSON_TYPE_INT64: return bson_iter_int64(&it);
    case BSON_TYPE_DOUBLE: {
        /* a document written by hand may hold any double: the cast of one out of range (or
         * NaN) is undefined */
        double v = bson_iter_double(&it);
        return v == v && fabs(v) < 9.2e18 ? (int64_t)v : 0;
    }
    default: return 0;
    }
}

int mg_doc_oid(const bson_t *d, char hex[25])
{
    bson_iter_t it;
    if (!bson_iter_init_find(&it, d, "_id") || !BSON_ITER_HOLDS_OID(&it)) return 0;
    bson_oid_to_string(bson_iter_oid(&it), hex);
    return 1;
}

/* A record's counts and times as the rest of relaybus expects them whatever a document written
 * by hand holds: counts in [0, INT_MAX], finite times (else 0, as for a missing field). */
static int doc_count(const bson_t *d, const char *k)
{
    int64_t v = mg_doc_int(d, k);
    return v < 0 ? 0 : v > INT_MAX ? INT_MAX : (int)v;
}

static double doc_time(const bson_t *d, const char *k)
{
    double v = mg_doc_num(d, k);
    return isfinite(v) ? v : 0;
}

/* A record from a stored delivery; `token` overrides the stored lease token when non-NULL. */
rb_delivery *mg_record_from(const bson_t *d, const char *token)
{
    char hex[25];
    if (!mg_doc_oid(d, hex)) return NULL;
    char *payload = mg_payload_json(d);
    char *progress = mg_json_field(d, "progress", "progress_format");
    char *errors = mg_json_field(d, "errors", "errors_format");
    rb_delivery_texts t = {.id = hex, .topic = mg_doc_str(d, "topic"), .payload = payload,
                           .key = mg_doc_str(d, "key"), .group = mg_doc_str(d, "group"),
                           .last_error = mg_doc_str(d, "last_error"),
                           .lease_token = token ? token : mg_doc_str(d, "lease_token"),
                           .progress = progress, .errors = errors};
    rb_delivery *r = payload ? rb_delivery_make(&t) : NULL;
    free(payload);
    free(progress);
    free(errors);
    if (!r) return NULL;
    r->settled_at = doc_time(d, "settled_at");
    int st = rb_status_parse(mg_doc_str(d, "status"));
    r->status = st < 0 ? RB_PENDING : (rb_status)st;
    r->attempts = doc_count(d, "attempts");
    r->max_attempts = doc_count(d, "max_attempts");
    r->fence = mg_doc_int(d, "fence");
    bson_iter_t held;
    /* a held delivery (deps.c) shows its own run_at, and how many it waits for */
    if (bson_iter_init_find(&held, d, "held_run_at")) {
        r->run_at = doc_time(d, "held_run_at");
        r->waiting = (int)mg_doc_int(d, "waiting");
    } else {
        r->run_at = doc_time(d, "run_at");
    }
    r->created_at = doc_time(d, "created_at");
    r->lease_expires_at = doc_time(d, "lease_expires_at");
    return r;
}

int mg_parse_oid(const char *id, bson_oid_t *oid)
{
    if (!id || strlen(id) != 24 || !bson_oid_is_valid(id, 24)) return 0;
    bson_oid_init_from_string(oid, id);
    return 1;
}

/* The dedupe field: topic and key, length-prefixed so no pair can collide. */
char *mg_dedupe_value(const char *topic, const char *key)
{
    size_t n = strlen(topic) + strlen(key) + 24;
    char *v = rb_malloc(n);
    if (v) snprintf(v, n, "%zu:%s%s", strlen(topic), topic, key);
    return v;
}

/* Per-op outcomes of a bulk write: codes[i] is the server's error code for op i, 0 if none.
 * Returns the number of write errors, or -1 when the reply carries none (the whole bulk
 * failed: network, server selection). */
int mg_bulk_write_errors(const bson_t *reply, int *codes, size_t n)
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
int mg_bulk_run(mjob *j, mongoc_bulk_operation_t *b, int *codes, size_t n, const char *what)
{
    bson_t reply;
    bson_error_t e;
    int ok = mongoc_bulk_operation_execute(b, &reply, &e) != 0;
    int r = 1;
    if (ok) {
        for (size_t i = 0; i < n; i++) codes[i] = 0;
    } else if (mg_bulk_write_errors(&reply, codes, n) > 0) {
        r = 0;
    } else {
        mg_fail_bson(j, what, &e);
        r = -1;
    }
    bson_destroy(&reply);
    mongoc_bulk_operation_destroy(b);
    return r;
}

mongoc_bulk_operation_t *mg_unordered_bulk(mongoc_collection_t *cl)
{
    bson_t opts = BSON_INITIALIZER;
    BSON_APPEND_BOOL(&opts, "ordered", false);
    mongoc_bulk_operation_t *b = mongoc_collection_create_bulk_operation_with_opts(cl, &opts);
    bson_destroy(&opts);
    return b;
}

/* ---- finding documents ----------------------------------------------------------------- */
/* Runs a find; returns copies of the documents in *out (NULL-safe), or -1 with j->err. */
int mg_find_docs(mjob *j, mongoc_collection_t *cl, const bson_t *filter, const bson_t *opts,
                 mongoc_client_session_t *cs, bson_t ***out, size_t *nout)
{
    bson_t o = BSON_INITIALIZER;
    bson_error_t e;
    if (opts) bson_concat(&o, opts);
    if (cs && !mongoc_client_session_append(cs, &o, &e)) {
        bson_destroy(&o);
        mg_fail_bson(j, "find", &e);
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
            bson_t **nv = rb_realloc(v, cap * sizeof *nv);
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
        mg_fail_bson(j, "find", &e);
        return -1;
    }
    *out = v;
    *nout = n;
    return 0;
}

void mg_docs_free(bson_t **v, size_t n)
{
    for (size_t i = 0; i < n; i++) bson_destroy(v[i]);
    free(v);
}

/* One document by its selector, or NULL (*failed set on error). */
bson_t *mg_find_one(mjob *j, mongoc_collection_t *cl, const bson_t *sel,
                    mongoc_client_session_t *cs, int *failed)
{
    bson_t **v = NULL, opts = BSON_INITIALIZER;
    size_t n = 0;
    BSON_APPEND_INT64(&opts, "limit", 1);
    *failed = mg_find_docs(j, cl, sel, &opts, cs, &v, &n) < 0;
    bson_destroy(&opts);
    bson_t *d = n ? v[0] : NULL;
    for (size_t i = 1; i < n; i++) bson_destroy(v[i]);
    free(v);
    return d;
}

void mg_lost_wait(int round)
{
    int shift = round < 6 ? round : 6;
    struct timespec ts = {0, (long)(1000000L << shift)};     /* 1, 2, 4 ... 64 ms */
    nanosleep(&ts, NULL);
}

bson_t *mg_find_by_id(mjob *j, mongoc_collection_t *cl, const char *id, int *failed)
{
    int ok;
    *failed = 0;
    bson_t *sel = mg_oid_sel(id, &ok);
    bson_t *d = ok ? mg_find_one(j, cl, sel, NULL, failed) : NULL;
    bson_destroy(sel);
    return d;
}

bson_t *mg_oid_sel(const char *id, int *ok)
{
    bson_oid_t oid;
    bson_t *sel = bson_new();
    *ok = mg_parse_oid(id, &oid);
    if (*ok) BSON_APPEND_OID(sel, "_id", &oid);
    return sel;
}

void mg_append_in(bson_t *f, const char *field, char *const *vals, size_t n)
{
    bson_t in, arr;
    BSON_APPEND_DOCUMENT_BEGIN(f, field, &in);
    BSON_APPEND_ARRAY_BEGIN(&in, "$in", &arr);
    for (size_t i = 0; i < n; i++) {
        char k[16];
        const char *key;
        bson_uint32_to_string((uint32_t)i, &key, k, sizeof k);
        bson_append_utf8(&arr, key, -1, vals[i], -1);
    }
    bson_append_array_end(&in, &arr);
    bson_append_document_end(f, &in);
}
