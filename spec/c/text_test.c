/* text_test.c -- runtime/util/text.c (one-line messages, UTF-8 checks and cleaning, URL and message
 * redaction, decimals read back) and runtime/util/clock.c (the clocks, rb_valid_seconds, rb_lease_margin). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <jansson.h>
#include "harness.h"
#include "util/buf.h"
#include "util/text.h"

/* ---- rb_decimal_read ------------------------------------------------------------------------ */
/* The same bits and the same end as strtod, for what servers write and for hostile text. */
static void decimal_read_matches(const char *text)
{
    char *e1 = NULL, *e2 = NULL;
    double a = rb_decimal_read(text, &e1), b = strtod(text, &e2);
    if (isnan(b)) assert_true(isnan(a));
    else if (memcmp(&a, &b, sizeof a) != 0) fail_msg("rb_decimal_read(\"%s\") = %.17g, strtod %.17g", text, a, b);
    assert_ptr_equal(e1, e2);
}

static void decimal_read_gives_strtods_bits(void **state)
{
    (void)state;
    static const char *const fixed[] = {
        "0", "-0", "1", "-1", "0.5", ".5", "5.", "1764755123.123456", "1764755123.1234567",
        "9007199254740991", "9007199254740992", "9007199254740993", "123456789012345678901",
        "0.0000000000000000000001", "0.00000000000000000000001", "1e22", "1.5e-3", "-2.5E+10",
        "Infinity", "-Infinity", "NaN", "", "-", ".", "-.", "..1", "1..2", "1.2.3", " 1", "+1",
        "12abc", "0x1p3", "4503599627370496.5", "0.1", "0.3", "2.2250738585072014e-308",
        "99999999999999999999", "1.7976931348623157e308",
    };
    for (size_t i = 0; i < sizeof fixed / sizeof *fixed; i++) decimal_read_matches(fixed[i]);
    /* random decimals of every length around the fast path's bounds */
    srand(42);
    char text[64];
    for (int n = 0; n < 200000; n++) {
        int len = 1 + rand() % 24, dot = rand() % (len + 1), k = 0;
        if (rand() % 4 == 0) text[k++] = '-';
        for (int i = 0; i < len; i++) {
            if (i == dot) text[k++] = '.';
            text[k++] = (char)('0' + rand() % 10);
        }
        text[k] = '\0';
        decimal_read_matches(text);
    }
}

/* ---- rb_one_line ------------------------------------------------------------------------------ */
static void one_line_collapses_whitespace_and_escapes_controls(void **state)
{
    (void)state;
    char out[128];
    assert_string_equal(rb_one_line(out, sizeof out, "  a\n\n b\t\r\vc \f "), "a b c");
    assert_string_equal(rb_one_line(out, sizeof out, "bell\a esc\x1b[31m del\x7f"),
                        "bell\\x07 esc\\x1b[31m del\\x7f");
    assert_string_equal(rb_one_line(out, sizeof out, NULL), "");
    assert_string_equal(rb_one_line(out, sizeof out, "\n\n"), "");
    /* UTF-8 stays as it is; a byte that is no UTF-8 becomes U+FFFD */
    assert_string_equal(rb_one_line(out, sizeof out, "caf\xc3\xa9"), "caf\xc3\xa9");
    assert_string_equal(rb_one_line(out, sizeof out, "bad\xfftopic\xc3"), "bad\xef\xbf\xbdtopic\xef\xbf\xbd");
    rb_one_line(out, sizeof out, "\xe2\x82\xac\x80\xed\xa0\x80");    /* a lone continuation, a surrogate */
    assert_true(rb_utf8_valid(out, strlen(out)));
    assert_string_equal(out, "\xe2\x82\xac\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd");
    /* cut short, a character is never split */
    char small[5];
    assert_string_equal(rb_one_line(small, sizeof small, "ab\xe2\x82\xac"), "ab");
}

static void one_line_is_cut_to_its_buffer_never_inside_an_escape(void **state)
{
    (void)state;
    char out[8];
    memset(out, 'X', sizeof out);
    assert_string_equal(rb_one_line(out, sizeof out, "abcdefghijkl"), "abcdefg");
    assert_string_equal(rb_one_line(out, sizeof out, "abcde\x01z"), "abcde");    /* \x01 needs 4 */
    assert_string_equal(rb_one_line(out, 1, "abc"), "");
    char untouched[2] = "Q";
    rb_one_line(untouched, 0, "abc");
    assert_int_equal(untouched[0], 'Q');
    /* a space is not written when the word after it does not fit */
    assert_string_equal(rb_one_line(out, sizeof out, "abcdef gh"), "abcdef");
}

/* ---- UTF-8 ------------------------------------------------------------------------------------ */
static void utf8_valid_accepts_utf8_and_nothing_else(void **state)
{
    (void)state;
    static const struct { const char *s; size_t len; int ok; } cases[] = {
        {"", 0, 1}, {"ascii", 5, 1}, {"\xc3\xa9", 2, 1}, {"\xe2\x82\xac", 3, 1},
        {"\xf0\x9f\x98\x80", 4, 1}, {"\xf4\x8f\xbf\xbf", 4, 1},         /* U+10FFFF */
        {"\xed\x9f\xbf", 3, 1},                                         /* U+D7FF */
        {"a\0b", 3, 1},                                                 /* NUL is UTF-8 */
        {"\xc0\x80", 2, 0}, {"\xc1\xbf", 2, 0},                         /* overlong 2 */
        {"\xe0\x80\x80", 3, 0}, {"\xe0\x9f\xbf", 3, 0},                 /* overlong 3 */
        {"\xf0\x80\x80\x80", 4, 0}, {"\xf0\x8f\xbf\xbf", 4, 0},         /* overlong 4 */
        {"\xed\xa0\x80", 3, 0}, {"\xed\xbf\xbf", 3, 0},                 /* surrogates */
        {"\xf4\x90\x80\x80", 4, 0}, {"\xf5\x80\x80\x80", 4, 0},         /* > U+10FFFF */
        {"\xff", 1, 0}, {"\xfe", 1, 0}, {"\x80", 1, 0}, {"a\xbf", 2, 0},
        {"\xc3", 1, 0}, {"\xe2\x82", 2, 0}, {"\xf0\x9f\x98", 3, 0},     /* cut short */
        {"\xc3\x28", 2, 0}, {"\xe2\x28\xa1", 3, 0},                     /* bad continuation */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (rb_utf8_valid(cases[i].s, cases[i].len) != cases[i].ok)
            fail_msg("case %zu: rb_utf8_valid gave %d", i, !cases[i].ok);
}

static void text_clean_replaces_what_is_not_utf8(void **state)
{
    (void)state;
    char *t = rb_text_clean("ok \xff\xc3\xa9 \xc0\x80!", 10, 100);
    assert_non_null(t);
    assert_string_equal(t, "ok \xef\xbf\xbd\xc3\xa9 \xef\xbf\xbd\xef\xbf\xbd!");
    free(t);
    t = rb_text_clean("a\0b", 3, 100);          /* a NUL becomes U+FFFD */
    assert_string_equal(t, "a\xef\xbf\xbd" "b");
    free(t);
    t = rb_text_clean("", 0, 100);
    assert_string_equal(t, "");
    free(t);
}

static void text_clean_cuts_at_a_character_boundary(void **state)
{
    (void)state;
    char *t = rb_text_clean("abcdef", 6, 4);
    assert_string_equal(t, "abcd [truncated]");
    free(t);
    /* four euro signs (3 bytes each) in 10 bytes: three fit, never half of one */
    t = rb_text_clean("\xe2\x82\xac\xe2\x82\xac\xe2\x82\xac\xe2\x82\xac", 12, 10);
    assert_string_equal(t, "\xe2\x82\xac\xe2\x82\xac\xe2\x82\xac [truncated]");
    free(t);
    t = rb_text_clean("abc", 3, 3);             /* exactly max: not cut */
    assert_string_equal(t, "abc");
    free(t);
    t = rb_text_clean("abc", 3, 0);
    assert_string_equal(t, " [truncated]");
    free(t);
}

/* Whatever the bytes, the result is valid UTF-8 without NUL, at most max bytes plus the mark. */
static void text_clean_of_random_bytes_is_always_valid(void **state)
{
    (void)state;
    unsigned seed = 12345;
    char buf[64];
    for (int round = 0; round < 20000; round++) {
        size_t len = (size_t)(rand_r(&seed) % (int)sizeof buf);
        for (size_t i = 0; i < len; i++) {
            int r = rand_r(&seed);
            /* mostly bytes that start or continue sequences */
            buf[i] = (char)(r % 3 ? 0x80 + (r >> 8) % 0x80 : (r >> 8) % 0x100);
        }
        size_t max = (size_t)(rand_r(&seed) % 80);
        char *t = rb_text_clean(buf, len, max);
        assert_non_null(t);
        size_t n = strlen(t);
        if (!rb_utf8_valid(t, n)) fail_msg("round %d: not UTF-8", round);
        if (n > max + strlen(" [truncated]")) fail_msg("round %d: %zu bytes for max %zu", round, n, max);
        if (rb_utf8_valid(buf, len) && !memchr(buf, 0, len) && len <= max &&
            (n != len || memcmp(t, buf, len) != 0))
            fail_msg("round %d: valid text was changed", round);
        free(t);
    }
}

/* Whatever the bytes (NUL, quotes, control bytes, DEL, broken UTF-8), rb_json_string writes a
 * JSON string that Jansson reads back: valid UTF-8 as it was, each bad byte as U+FFFD. */
static void json_string_of_any_bytes_reads_back(void **state)
{
    (void)state;
    unsigned seed = 777;
    char buf[48];
    for (int round = 0; round < 20000; round++) {
        size_t len = (size_t)(rand_r(&seed) % (int)sizeof buf);
        for (size_t i = 0; i < len; i++) {
            int r = rand_r(&seed);
            static const char nasty[] = {'"', '\\', 0, 0x7f, '\n', 0x1f, '/'};
            buf[i] = r % 4 == 0 ? nasty[(r >> 8) % (int)sizeof nasty]
                   : r % 4 == 1 ? (char)(0x80 + (r >> 8) % 0x80) : (char)((r >> 8) % 0x100);
        }
        rb_buf b = {0};
        rb_json_string(&b, buf, len);
        assert_false(rb_buf_failed(&b));
        assert_int_equal(strlen(b.data), b.len);        /* no NUL reaches the text */
        json_error_t jerr;
        json_t *j = json_loadb(b.data, b.len, JSON_DECODE_ANY | JSON_ALLOW_NUL, &jerr);
        if (!j || !json_is_string(j)) fail_msg("round %d: not a JSON string: %s (%s)", round, b.data, jerr.text);
        const char *back = json_string_value(j);
        size_t blen = json_string_length(j);
        if (rb_utf8_valid(buf, len) && (blen != len || memcmp(back, buf, len) != 0))
            fail_msg("round %d: valid UTF-8 did not read back as it was", round);
        if (!rb_utf8_valid(back, blen)) fail_msg("round %d: read back as invalid UTF-8", round);
        json_decref(j);
        rb_buf_free(&b);
    }
    rb_buf b = {0};
    rb_json_string(&b, "a\"b\\c\x01\x7f\xff\xc3\xa9", 10);
    assert_string_equal(b.data, "\"a\\\"b\\\\c\\u0001\\u007f\\ufffd\xc3\xa9\"");
    rb_buf_free(&b);
}

static void text_clean_out_of_memory_is_null(void **state)
{
    (void)state;
    long before = rb_alloc_fail_nth(1);
    char *t = rb_text_clean("abc", 3, 10);
    long after = rb_alloc_fail_nth(0);
    assert_null(t);
    assert_int_equal(after - before, 1);
}

/* ---- redaction -------------------------------------------------------------------------------- */
static void redact_url_hides_passwords_and_secret_parameters(void **state)
{
    (void)state;
    static const char *const cases[][2] = {
        {"postgresql://ada:s3cret@db:5432/app", "postgresql://ada:***@db:5432/app"},
        {"postgresql://ada@db/app", "postgresql://ada@db/app"},
        {"mongodb://u:p%40ss@h/db?authSource=admin", "mongodb://u:***@h/db?authSource=admin"},
        {"postgres://u:pa/ss@h/db", "postgres://u:***@h/db"},         /* an unescaped '/' */
        {"postgres://u:a@b@h/db", "postgres://u:***@h/db"},           /* the last '@' */
        {"https://x/hook?token=abc&x=1", "https://x/hook?token=***&x=1"},
        {"https://x/h?api_key=k1&sig=s2&page=3#f", "https://x/h?api_key=***&sig=***&page=3#f"},
        {"https://x/h?SessionId=zz", "https://x/h?SessionId=***"},
        {"host=db password=hunter2 user=ada", "host=db password=*** user=ada"},
        {"host=db password='a b\\' c' user=ada", "host=db password=*** user=ada"},
        {"postgresql://u@db/app?options=-c%20password%3Dx", "postgresql://u@db/app?options=***"},
        {"host=db options='-c app.k=v w' user=ada", "host=db options=*** user=ada"},
        {"sqlite:/tmp/app.db", "sqlite:/tmp/app.db"},
        {"", ""},
    };
    char out[200];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        rb_redact_url(out, sizeof out, cases[i][0]);
        if (strcmp(out, cases[i][1]) != 0)
            fail_msg("rb_redact_url(%s) = %s, not %s", cases[i][0], out, cases[i][1]);
    }
    assert_string_equal(rb_redact_url(out, sizeof out, NULL), "");
    /* cut to its buffer, terminated, the password never shown in part */
    char small[16];
    rb_redact_url(small, sizeof small, "postgresql://ada:s3cretpassword@db/app");
    assert_int_equal(strlen(small), sizeof small - 1);
    assert_null(strstr(small, "s3c"));
}

static void redact_secrets_hides_a_url_secret_wherever_a_message_quotes_it(void **state)
{
    (void)state;
    const char *url = "postgresql://ada:p%40ss%2Fword@db:5432/app?sslpassword=k3y";
    char out[300];
    rb_redact_secrets(out, sizeof out, "auth failed for p%40ss%2Fword", url);
    assert_string_equal(out, "auth failed for ***");
    rb_redact_secrets(out, sizeof out, "auth failed for p@ss/word", url);     /* decoded */
    assert_null(strstr(out, "p@ss/word"));
    rb_redact_secrets(out, sizeof out, "invalid port number: \"word@db\"", url);   /* a piece */
    assert_null(strstr(out, "word"));
    rb_redact_secrets(out, sizeof out, "key k3y rejected", url);
    assert_string_equal(out, "key *** rejected");
    /* a message cut inside the secret, at its end */
    rb_redact_secrets(out, sizeof out, "password is p@s", url);
    assert_null(strstr(out, "p@s"));
    /* pieces under 3 bytes stay: the message must stay readable */
    rb_redact_secrets(out, sizeof out, "db is up", "postgresql://u:db@h/x");
    assert_string_equal(out, "db is up");
    rb_redact_secrets(out, sizeof out, NULL, url);
    assert_string_equal(out, "");
    rb_redact_secrets(out, sizeof out, "no url", NULL);
    assert_string_equal(out, "no url");
    /* libpq's options: each setting's value, not its name */
    rb_redact_secrets(out, sizeof out, "invalid value for parameter \"app.k\": \"hunter2\"",
                      "postgresql://u@db/app?options=-c%20app.k%3Dhunter2");
    assert_string_equal(out, "invalid value for parameter \"app.k\": \"***\"");
}

/* ---- clock.c ---------------------------------------------------------------------------------- */
static void valid_seconds_is_finite_and_in_range(void **state)
{
    (void)state;
    assert_true(rb_valid_seconds(0));
    assert_true(rb_valid_seconds(1e-9));
    assert_true(rb_valid_seconds(RB_MAX_SECONDS));
    assert_false(rb_valid_seconds(RB_MAX_SECONDS * 1.0001));
    assert_false(rb_valid_seconds(-1e-9));
    assert_false(rb_valid_seconds(NAN));
    assert_false(rb_valid_seconds(INFINITY));
    assert_false(rb_valid_seconds(-INFINITY));
}

static void lease_margin_is_a_tenth_within_bounds(void **state)
{
    (void)state;
    static const double cases[][2] = {
        {0.01, 0.005}, {0.3, 0.15}, {0.4, 0.2}, {1, 0.2}, {2, 0.2}, {3, 0.3}, {10, 1},
        {30, 3}, {50, 5}, {3600, 5}, {RB_MAX_SECONDS, 5},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        double m = rb_lease_margin(cases[i][0]);
        if (fabs(m - cases[i][1]) > 1e-9)
            fail_msg("rb_lease_margin(%g) = %g, not %g", cases[i][0], m, cases[i][1]);
        assert_true(m <= cases[i][0] / 2);
    }
}

static void the_clocks_move_forward_together(void **state)
{
    (void)state;
    double m0 = rb_monotonic(), b0 = rb_boot_time(), w0 = rb_wall_time();
    assert_true(fabs(w0 - (double)time(NULL)) < 2);
    assert_true(b0 >= m0 - 0.001);      /* the boot clock also counts suspended time */
    double last = m0;
    for (int i = 0; i < 100000; i++) {
        double m = rb_monotonic();
        if (m < last) fail_msg("rb_monotonic went back: %f after %f", m, last);
        last = m;
    }
    struct timespec ts = {0, 20000000};
    nanosleep(&ts, NULL);
    assert_true(rb_monotonic() - m0 >= 0.02);
    assert_true(rb_boot_time() - b0 >= 0.02);
    const char *id = rb_boot_id();
    assert_non_null(id);
    assert_true(strlen(id) == 36 || strlen(id) == 0);
    assert_string_equal(id, rb_boot_id());
}

int main(void)
{
#define TEST(name, fn) {name, fn, NULL, NULL, NULL}
    const struct CMUnitTest tests[] = {
        TEST("rb_one_line collapses whitespace and escapes control bytes",
             one_line_collapses_whitespace_and_escapes_controls),
        TEST("rb_one_line is cut to its buffer, never inside an escape",
             one_line_is_cut_to_its_buffer_never_inside_an_escape),
        TEST("rb_utf8_valid accepts UTF-8 and nothing else (overlong, surrogates, cut short)",
             utf8_valid_accepts_utf8_and_nothing_else),
        TEST("rb_text_clean replaces each byte that is not UTF-8, and NUL, by U+FFFD",
             text_clean_replaces_what_is_not_utf8),
        TEST("rb_text_clean cuts at a character boundary and says so",
             text_clean_cuts_at_a_character_boundary),
        TEST("rb_text_clean of random bytes is always valid UTF-8 within max",
             text_clean_of_random_bytes_is_always_valid),
        TEST("rb_text_clean out of memory is NULL", text_clean_out_of_memory_is_null),
        TEST("rb_json_string of any bytes is a JSON string that reads back",
             json_string_of_any_bytes_reads_back),
        TEST("rb_redact_url hides passwords and secret parameters, also cut short",
             redact_url_hides_passwords_and_secret_parameters),
        TEST("rb_redact_secrets hides a URL's secret wherever a message quotes it",
             redact_secrets_hides_a_url_secret_wherever_a_message_quotes_it),
        TEST("rb_valid_seconds: finite and from 0 to 100 years", valid_seconds_is_finite_and_in_range),
        TEST("rb_lease_margin: a tenth, at least 0.2 s, at most 5 s, never over half",
             lease_margin_is_a_tenth_within_bounds),
        TEST("the monotonic, boot and wall clocks move forward together",
             the_clocks_move_forward_together),
        TEST("rb_decimal_read gives strtod's bits and end, fast path or not",
             decimal_read_gives_strtods_bits),
    };
    return cmocka_run_group_tests_name("text", tests, NULL, NULL);
}
