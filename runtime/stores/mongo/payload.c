/* payload.c -- the MongoDB store's payloads: the JSON text the runtime speaks, a BSON value in
 * the delivery document (docs/stores.md "The delivery document").
 *
 * Writing: the text is parsed with Jansson (the parser relaybus.json uses, so both read a text
 * alike) and its tree appended as `payload` with `payload_format: "bson"`: objects as
 * documents, arrays as arrays, integers as int64, reals as doubles (strtod: every bit). Not
 * libbson's JSON parser: it reads {"$numberLong": "1"} or {"$oid": ...} in a payload as
 * extended JSON and would change the value. What MongoDB cannot hold as it is (a key with a
 * leading '$' or a '.'; nesting near its limit of 100; an integer beyond int64; on a
 * FerretDB server also an array in an array and -0.0) is stored as before, the JSON text as a string with `payload_format: "json"`.
 *
 * Reading: a string without `payload_format: "bson"` is JSON text (older documents have no
 * format field); anything else is walked back to JSON text here, numbers written the way
 * relaybus.json writes them (text.h); BSON types JSON has no counterpart for become their
 * relaxed Extended JSON. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <jansson.h>
#include "stores/mongo/mstore.h"
#include "util/alloc.h"
#include "util/buf.h"
#include "util/text.h"

#define NATIVE_DEPTH 90     /* MongoDB refuses documents nested deeper than 100 levels */
#define READ_DEPTH 1000     /* relaybus.json's limit: anything deeper could not be decoded */

/* ---- JSON text to BSON ----------------------------------------------------------------- */
/* MongoDB field names: none starting with '$' or holding '.' (allowed since MongoDB 5.0 but
 * neither queryable nor updatable as paths), no NUL (BSON keys are C strings; Jansson refuses
 * such a key before this). */
static int field_name_ok(const char *k, size_t len)
{
    return len > 0 ? k[0] != '$' && !memchr(k, '.', len) && !memchr(k, 0, len) : 1;
}

/* What FerretDB (1.24) cannot hold as it is: an array in an array (refused, code 2) and
 * -0.0 (stored as 0.0). */
static int ferretdb_cannot(const json_t *v, const json_t *parent)
{
    return (json_is_array(v) && json_is_array(parent)) ||
           (json_is_real(v) && json_real_value(v) == 0 && signbit(json_real_value(v)));
}

/* Appends v (in parent, NULL at the top) under key; 0 when it cannot be native (the caller
 * keeps the text instead). */
static int append_json(bson_t *b, const char *key, size_t klen, json_t *v, const json_t *parent,
                       int depth, int ferretdb)
{
    bson_t child;
    int ok = 1;
    if (depth > NATIVE_DEPTH || (ferretdb && ferretdb_cannot(v, parent))) return 0;
    switch (json_typeof(v)) {
    case JSON_OBJECT: {
        const char *k;
        json_t *m;
        if (!bson_append_document_begin(b, key, (int)klen, &child)) return 0;
        json_object_foreach(v, k, m) {
            size_t kl = json_object_iter_key_len(json_object_key_to_iter(k));
            if (!(ok = field_name_ok(k, kl) && append_json(&child, k, kl, m, v, depth + 1, ferretdb)))
                break;
        }
        return bson_append_document_end(b, &child) && ok;
    }
    case JSON_ARRAY: {
        char buf[16];
        const char *k;
        if (!bson_append_array_begin(b, key, (int)klen, &child)) return 0;
        for (size_t i = 0; ok && i < json_array_size(v); i++) {
            size_t kl = bson_uint32_to_string((uint32_t)i, &k, buf, sizeof buf);
            ok = append_json(&child, k, kl, json_array_get(v, i), v, depth + 1, ferretdb);
        }
        return bson_append_array_end(b, &child) && ok;
    }
    case JSON_STRING:
        return bson_append_utf8(b, key, (int)klen, json_string_value(v), (int)json_string_length(v));
    case JSON_INTEGER: return bson_append_int64(b, key, (int)klen, json_integer_value(v));
    case JSON_REAL: return bson_append_double(b, key, (int)klen, json_real_value(v));
    case JSON_TRUE: return bson_append_bool(b, key, (int)klen, true);
    case JSON_FALSE: return bson_append_bool(b, key, (int)klen, false);
    default: return bson_append_null(b, key, (int)klen);
    }
}

/* Integers beyond int64 make Jansson refuse a text that relaybus.json reads (as floats): the
 * text form keeps them exactly. */
static int big_integer(const json_error_t *e)
{
    return json_error_code(e) == json_error_numeric_overflow && strncmp(e->text, "too big", 7) == 0;
}

/* Appends the JSON text under `key` as BSON (its text, as a string, when it cannot be
 * native) and says which under `format_key` ("bson" or "json"); 0 when it is not JSON. */
int mg_json_append(bson_t *d, const char *key, const char *format_key, const char *json,
                   int ferretdb)
{
    json_error_t e;
    json_t *v = json_loads(json, JSON_DECODE_ANY | JSON_ALLOW_NUL, &e);
    bson_t tmp = BSON_INITIALIZER;
    int native = v && append_json(&tmp, key, strlen(key), v, NULL, 1, ferretdb);
    json_decref(v);
    if (native) bson_concat(d, &tmp);
    bson_destroy(&tmp);
    if (!native && !v && !big_integer(&e)) return 0;
    if (!native) BSON_APPEND_UTF8(d, key, json);
    BSON_APPEND_UTF8(d, format_key, native ? "bson" : "json");
    return 1;
}

int mg_payload_append(bson_t *d, const char *json, int ferretdb, char *why, size_t whylen)
{
    json_error_t e;
    json_t *v = json_loads(json, JSON_DECODE_ANY | JSON_ALLOW_NUL, &e);
    bson_t tmp = BSON_INITIALIZER;
    int native = v && append_json(&tmp, "payload", 7, v, NULL, 1, ferretdb);
    json_decref(v);
    if (native) {
        bson_concat(d, &tmp);
        BSON_APPEND_UTF8(d, "payload_format", "bson");
    }
    bson_destroy(&tmp);
    if (native) return 1;
    if (!v && !big_integer(&e)) {
        snprintf(why, whylen, "invalid JSON at line %d, column %d: %.150s", e.line, e.column, e.text);
        return 0;
    }
    BSON_APPEND_UTF8(d, "payload", json);
    BSON_APPEND_UTF8(d, "payload_format", "json");
    return 1;
}

/* ---- BSON to JSON text ----------------------------------------------------------------- */
typedef struct {
    rb_buf out;
    int too_deep;               /* nested beyond READ_DEPTH: the text is dropped */
} jbuf;

static void jb_put(jbuf *b, const char *s, size_t n)
{
    if (!b->too_deep) rb_buf_add(&b->out, s, n);
}

/* A JSON string of s[0..len): what is not UTF-8 (an outside writer's bytes) becomes U+FFFD,
 * one per byte, so the text is always JSON. */
static void jb_string(jbuf *b, const char *s, size_t len)
{
    if (!b->too_deep) rb_json_string(&b->out, s, len);
}

/* A value JSON has no counterpart for (a date, an ObjectId, a decimal, binary, NaN...) as
 * MongoDB's relaxed Extended JSON of it: {"$date": ...}, {"$oid": ...}, ... */
static void jb_extended(jbuf *b, const bson_iter_t *it)
{
    bson_t tmp = BSON_INITIALIZER;
    size_t len = 0;
    char *s = bson_append_iter(&tmp, "v", 1, it) ? bson_as_relaxed_extended_json(&tmp, &len) : NULL;
    /* libbson writes { "v" : X } */
    if (s && len > 10 && strncmp(s, "{ \"v\" : ", 8) == 0) jb_put(b, s + 8, len - 10);
    else jb_put(b, "null", 4);
    bson_free(s);
    bson_destroy(&tmp);
}

static void jb_value(jbuf *b, const bson_iter_t *it, int depth);

static void jb_container(jbuf *b, const bson_iter_t *it, int is_array, int depth)
{
    bson_iter_t in;
    if (depth > READ_DEPTH) {
        b->too_deep = 1;
        return;
    }
    jb_put(b, is_array ? "[" : "{", 1);
    int first = 1;
    if (bson_iter_recurse(it, &in)) {
        while (bson_iter_next(&in) && !b->too_deep && !b->out.failed) {
            if (!first) jb_put(b, ",", 1);
            first = 0;
            if (!is_array) {
                jb_string(b, bson_iter_key(&in), bson_iter_key_len(&in));
                jb_put(b, ":", 1);
            }
            jb_value(b, &in, depth + 1);
        }
    }
    jb_put(b, is_array ? "]" : "}", 1);
}

static void jb_value(jbuf *b, const bson_iter_t *it, int depth)
{
    char num[RB_NUM_TEXT];
    size_t n;
    uint32_t len;
    const char *s;
    switch (bson_iter_type(it)) {
    case BSON_TYPE_DOUBLE:
        if ((n = rb_json_float(num, bson_iter_double(it)))) jb_put(b, num, n);
        else jb_extended(b, it);    /* NaN, infinities: {"$numberDouble": "NaN"} */
        break;
    case BSON_TYPE_INT32: jb_put(b, num, rb_json_int(num, bson_iter_int32(it))); break;
    case BSON_TYPE_INT64: jb_put(b, num, rb_json_int(num, bson_iter_int64(it))); break;
    case BSON_TYPE_UTF8:
        s = bson_iter_utf8(it, &len);
        jb_string(b, s, len);
        break;
    case BSON_TYPE_BOOL: bson_iter_bool(it) ? jb_put(b, "true", 4) : jb_put(b, "false", 5); break;
    case BSON_TYPE_NULL: jb_put(b, "null", 4); break;
    case BSON_TYPE_DOCUMENT: jb_container(b, it, 0, depth); break;
    case BSON_TYPE_ARRAY: jb_container(b, it, 1, depth); break;
    default: jb_extended(b, it); break;
    }
}

char *mg_payload_json(const bson_t *d)
{
    bson_iter_t it;
    if (!bson_iter_init_find(&it, d, "payload")) return rb_strdup("null");
    return mg_json_field(d, "payload", "payload_format");
}

/* The JSON text of field `key` (NULL when absent: the caller tells that from no memory by
 * looking first), read as mg_json_append wrote it, or as BSON that any writer put there. */
char *mg_json_field(const bson_t *d, const char *key, const char *format_key)
{
    bson_iter_t it;
    if (!bson_iter_init_find(&it, d, key)) return NULL;
    const char *fmt = mg_doc_str(d, format_key);
    if (BSON_ITER_HOLDS_UTF8(&it) && !(fmt && strcmp(fmt, "bson") == 0))
        return rb_strdup(bson_iter_utf8(&it, NULL));    /* the text form, older documents' too */
    jbuf b = {0};
    jb_value(&b, &it, 1);
    if (!b.too_deep && !b.out.failed) return b.out.data;
    rb_buf_free(&b.out);
    return b.too_deep ? rb_strdup("null") : NULL;   /* too deep for any reader: null */
}
