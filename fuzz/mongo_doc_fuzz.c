/* mongo_doc_fuzz.c -- libFuzzer target for what the MongoDB store reads from the server and
 * from its URL: a document (a delivery written by hand, a field of another type, NaN times)
 * becomes a record with an id of 24 hex digits, a known status, counts in range and finite
 * times, or NULL; a bulk write's reply gives per-op codes only for ops that exist; the
 * dialect option leaves the URL no longer and without the option; a payload's JSON text
 * stored (payload.c) reads back as the same value, the text form byte for byte, and any
 * payload a document holds reads as JSON. Never a crash.
 * Input: 'U' then a URL; 'P' then a payload's JSON text (a second byte of '1': for a FerretDB
 * server); else the bytes of one BSON document. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <jansson.h>
#include "stores/mongo/mstore.h"

#define CHECK(c) do { if (!(c)) __builtin_trap(); } while (0)

static void check_record(const bson_t *d)
{
    rb_delivery *r = mg_record_from(d, NULL);
    if (!r) return;
    CHECK(strlen(r->id) == 24 && strspn(r->id, "0123456789abcdef") == 24);
    CHECK(r->status >= RB_PENDING && r->status < RB_STATUS_COUNT);
    CHECK(r->attempts >= 0 && r->max_attempts >= 0);
    CHECK(isfinite(r->run_at) && isfinite(r->created_at) && isfinite(r->lease_expires_at));
    CHECK(r->payload != NULL);
    rb_delivery_free(r);
}

/* Any stored payload but the text form (a string without payload_format "bson") reads as
 * JSON; Jansson parses what relaybus.json parses. */
static void check_payload_read(const bson_t *d)
{
    bson_iter_t it;
    const char *fmt = mg_doc_str(d, "payload_format");
    if (bson_iter_init_find(&it, d, "payload") && BSON_ITER_HOLDS_UTF8(&it) &&
        !(fmt && strcmp(fmt, "bson") == 0))
        return;
    char *s = mg_payload_json(d);
    if (!s) return;                                     /* out of memory */
    json_t *j = json_loads(s, JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL);
    CHECK(j != NULL);
    json_decref(j);
    free(s);
}

/* The text stored and read back: the same value (Jansson compares), the text form as it was. */
static void check_payload(const char *text, int ferretdb)
{
    bson_t d = BSON_INITIALIZER;
    char why[200];
    if (!mg_payload_append(&d, text, ferretdb, why, sizeof why)) {
        CHECK(why[0] != 0);
        bson_destroy(&d);
        return;
    }
    const char *fmt = mg_doc_str(&d, "payload_format");
    CHECK(fmt && (strcmp(fmt, "bson") == 0 || strcmp(fmt, "json") == 0));
    char *back = mg_payload_json(&d);
    if (back && strcmp(fmt, "json") == 0) {
        CHECK(strcmp(back, text) == 0);
    } else if (back) {
        json_t *a = json_loads(text, JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL);
        json_t *b = json_loads(back, JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL);
        CHECK(a && b && json_equal(a, b));
        json_decref(a);
        json_decref(b);
    }
    free(back);
    bson_destroy(&d);
}

static void check_bulk_reply(const bson_t *d)
{
    int codes[8];
    for (size_t i = 0; i < 8; i++) codes[i] = -7;
    int n = mg_bulk_write_errors(d, codes, 4);
    CHECK(n == -1 || n >= 1);
    for (size_t i = 4; i < 8; i++) CHECK(codes[i] == -7);  /* nothing past n */
}

static void check_url(const char *url)
{
    char *out = NULL, err[ERRLEN] = "";
    mg_dialect d;
    if (!mg_url_take_dialect(url, &out, &d, err, sizeof err)) {
        CHECK(!out && err[0]);
        return;
    }
    CHECK(out && strlen(out) <= strlen(url));
    CHECK(d == MG_DETECT || d == MG_MONGODB || d == MG_FERRETDB);
    const char *scheme = strstr(out, "://"), *q = strchr(scheme ? scheme + 3 : out, '?');
    for (const char *p = q ? q + 1 : NULL; p && *p;) {     /* the options, as the parser splits them */
        size_t n = strcspn(p, "&;");
        CHECK(n < 8 || strncasecmp(p, "dialect=", 8) != 0);
        p += n;
        if (*p) p++;
    }
    free(out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size && data[0] == 'U') {
        char *url = malloc(size);
        if (!url) return 0;
        memcpy(url, data + 1, size - 1);
        url[size - 1] = '\0';
        check_url(url);
        free(url);
        return 0;
    }
    if (size && data[0] == 'P') {
        int ferretdb = size > 1 && data[1] == '1';
        size_t off = ferretdb ? 2 : 1;
        char *text = malloc(size - off + 1);
        if (!text) return 0;
        memcpy(text, data + off, size - off);
        text[size - off] = '\0';                        /* the store gets C strings */
        check_payload(text, ferretdb);
        free(text);
        return 0;
    }
    bson_t *d = bson_new_from_data(data, size);
    if (!d) return 0;
    if (bson_validate(d, BSON_VALIDATE_NONE, NULL)) {   /* libmongoc checks what it reads */
        check_record(d);
        check_payload_read(d);
        check_bulk_reply(d);
    }
    bson_destroy(d);
    return 0;
}
