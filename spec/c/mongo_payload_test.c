/* mongo_payload_test.c -- runtime/stores/mongo/payload.c without a server: JSON text to the BSON value
 * and back, exact; what stays text; the BSON an outside writer may store that FerretDB cannot
 * (NaN, infinities, decimals) and bytes that are not UTF-8; rb_json_float (text.c). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "harness.h"
#include "stores/mongo/mstore.h"
#include "util/text.h"

/* The payload of a document made by mg_payload_append, read back; *fmt gets payload_format. */
static char *round_trip(const char *json, int ferretdb, char fmt[8])
{
    bson_t d = BSON_INITIALIZER;
    char why[200];
    assert_true(mg_payload_append(&d, json, ferretdb, why, sizeof why));
    snprintf(fmt, 8, "%s", mg_doc_str(&d, "payload_format"));
    char *back = mg_payload_json(&d);
    bson_destroy(&d);
    assert_non_null(back);
    return back;
}

static void check(const char *json, const char *want, const char *want_fmt, int ferretdb)
{
    char fmt[8];
    char *back = round_trip(json, ferretdb, fmt);
    assert_string_equal(back, want);
    assert_string_equal(fmt, want_fmt);
    free(back);
}

static void native_numbers_are_exact(void **state)
{
    (void)state;
    check("{\"max\": 9223372036854775807, \"min\": -9223372036854775808, \"one\": 1.0}",
          "{\"max\":9223372036854775807,\"min\":-9223372036854775808,\"one\":1.0}", "bson", 0);
    check("[0.1, 1e15, 1e300, 5e-324, -0.0, 0.0, 12345678.123456789, 9223372036854775808.0]",
          "[0.1,1000000000000000.0,1e+300,5e-324,-0.0,0.0,12345678.12345679,9.223372036854776e+18]",
          "bson", 0);
    check("42", "42", "bson", 0);
    check("\"caf\\u00e9 \\\"q\\\" \\\\ \\n \\u0000 \\u007f\"",
          "\"caf\xc3\xa9 \\\"q\\\" \\\\ \\u000a \\u0000 \\u007f\"", "bson", 0);
    check("{\"a\": [[], {}, [1, [2]]], \"e\": {}}", "{\"a\":[[],{},[1,[2]]],\"e\":{}}", "bson", 0);
    check("null", "null", "bson", 0);
    /* extended JSON in a payload is the application's data, not a type */
    check("{\"x\": {\"$numberLong\": \"5\"}}", "{\"x\": {\"$numberLong\": \"5\"}}", "json", 0);
}

static void what_mongodb_cannot_hold_stays_text(void **state)
{
    (void)state;
    const char *texts[] = {"{\"$set\": 1}", "{\"a.b\": 1}",
                           "[123456789012345678901234567890]", "{\"ok\": [{\"$x\": 1}]}"};
    for (size_t i = 0; i < sizeof texts / sizeof *texts; i++) check(texts[i], texts[i], "json", 0);
    char deep[400] = "";
    for (int i = 0; i < 95; i++) strcat(deep, "[");
    strcat(deep, "1");
    for (int i = 0; i < 95; i++) strcat(deep, "]");
    check(deep, deep, "json", 0);
    /* FerretDB: arrays in arrays and -0.0 */
    check("[[1]]", "[[1]]", "json", 1);
    check("{\"z\": -0.0}", "{\"z\": -0.0}", "json", 1);
    check("{\"a\": [{\"b\": [1]}]}", "{\"a\":[{\"b\":[1]}]}", "bson", 1);
}

static void what_is_not_json_is_refused(void **state)
{
    (void)state;
    /* a key with NUL too: Jansson, and so relaybus.json, cannot bring one back */
    const char *bad[] = {"NaN", "{\"x\": Infinity}", "\"\xff\"", "[1,", "", "1e400", "{\"k\\u0000\": 1}"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        bson_t d = BSON_INITIALIZER;
        char why[200] = "";
        assert_false(mg_payload_append(&d, bad[i], 0, why, sizeof why));
        assert_true(why[0] != 0);
        bson_destroy(&d);
    }
}

/* ---- what an outside writer may store --------------------------------------------------- */
static char *read_doc(bson_t *d)
{
    char *s = mg_payload_json(d);
    bson_destroy(d);
    assert_non_null(s);
    return s;
}

static void outside_values_have_a_defined_json_form(void **state)
{
    (void)state;
    bson_t *d = bson_new(), p;
    BSON_APPEND_DOCUMENT_BEGIN(d, "payload", &p);
    BSON_APPEND_DOUBLE(&p, "nan", NAN);
    BSON_APPEND_DOUBLE(&p, "inf", -INFINITY);
    BSON_APPEND_INT32(&p, "i32", -7);
    BSON_APPEND_DATE_TIME(&p, "when", 1700000000000);
    bson_decimal128_t dec;
    bson_decimal128_from_string("1.10", &dec);
    BSON_APPEND_DECIMAL128(&p, "dec", &dec);
    bson_append_utf8(&p, "bad", 3, "a\xff" "b", 3);
    bson_append_document_end(d, &p);
    char *s = read_doc(d);
    assert_string_equal(s, "{\"nan\":{ \"$numberDouble\" : \"NaN\" },"
                           "\"inf\":{ \"$numberDouble\" : \"-Infinity\" },\"i32\":-7,"
                           "\"when\":{ \"$date\" : \"2023-11-14T22:13:20Z\" },"
                           "\"dec\":{ \"$numberDecimal\" : \"1.10\" },\"bad\":\"a\\ufffdb\"}");
    free(s);
    /* an older document: the JSON text as a string, no payload_format */
    d = BCON_NEW("payload", BCON_UTF8("{\"n\": 1}"));
    s = read_doc(d);
    assert_string_equal(s, "{\"n\": 1}");
    free(s);
    /* a string scalar written natively says so */
    d = BCON_NEW("payload", BCON_UTF8("text"), "payload_format", BCON_UTF8("bson"));
    s = read_doc(d);
    assert_string_equal(s, "\"text\"");
    free(s);
    /* anything but a string is the value, with or without payload_format */
    d = BCON_NEW("payload", "{", "n", BCON_INT64(5), "}");
    s = read_doc(d);
    assert_string_equal(s, "{\"n\":5}");
    free(s);
    d = bson_new();
    s = read_doc(d);
    assert_string_equal(s, "null");
    free(s);
}

static void nesting_beyond_what_json_readers_take_reads_as_null(void **state)
{
    (void)state;
    bson_t *levels[1100];
    levels[0] = bson_new();
    BSON_APPEND_INT32(levels[0], "x", 1);
    for (int i = 1; i < 1100; i++) {
        levels[i] = bson_new();
        BSON_APPEND_DOCUMENT(levels[i], i == 1099 ? "payload" : "a", levels[i - 1]);
        bson_destroy(levels[i - 1]);
    }
    char *s = read_doc(levels[1099]);
    assert_string_equal(s, "null");
    free(s);
}

static void json_float_is_shortest_and_always_a_float(void **state)
{
    (void)state;
    char b[RB_NUM_TEXT];
    assert_int_equal(rb_json_float(b, NAN), 0);
    assert_int_equal(rb_json_float(b, INFINITY), 0);
    rb_json_float(b, 1.0);
    assert_string_equal(b, "1.0");
    rb_json_float(b, -0.0);
    assert_string_equal(b, "-0.0");
    rb_json_float(b, 0.1);
    assert_string_equal(b, "0.1");
    rb_json_float(b, 1.0 / 3);
    assert_true(strtod(b, NULL) == 1.0 / 3);
    rb_json_int(b, INT64_MIN);
    assert_string_equal(b, "-9223372036854775808");
}

int main(void)
{
#define TEST(name, fn) {name, fn, NULL, NULL, NULL}
    const struct CMUnitTest tests[] = {
        TEST("native payloads: int64 as int64, doubles to the last bit and still doubles, strings, [] and {}",
             native_numbers_are_exact),
        TEST("keys with '$' or '.', deep nesting, big integers (and on FerretDB nested arrays, -0.0) stay text",
             what_mongodb_cannot_hold_stays_text),
        TEST("what is not JSON (or a key with NUL) is refused with a reason", what_is_not_json_is_refused),
        TEST("NaN, infinities, dates, decimals, bytes not UTF-8, older text payloads: a defined JSON form",
             outside_values_have_a_defined_json_form),
        TEST("nesting beyond 1000 levels reads as null, without recursing further",
             nesting_beyond_what_json_readers_take_reads_as_null),
        TEST("rb_json_float: shortest, always a float; NaN and infinities refused",
             json_float_is_shortest_and_always_a_float),
    };
    return cmocka_run_group_tests_name("mongo_payload", tests, NULL, NULL);
}
