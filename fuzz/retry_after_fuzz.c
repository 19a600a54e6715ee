/* retry_after_fuzz.c -- libFuzzer target for the dates of http.c: Retry-After, HTTP-date
 * parsing and formatting. Checks that every value gives a finite delay within [0, 30 days] or
 * none, that a parsed date lies within years 0 to 9999, and that formatting a time and parsing
 * it back gives that time, also as a Retry-After. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "http/http.h"

#define CHECK(c) do { if (!(c)) __builtin_trap(); } while (0)

#define FIRST_DATE (-62167219200.0)     /* 0000-01-01T00:00:00Z */
#define LAST_DATE 253402300799.0        /* 9999-12-31T23:59:59Z */

/* The other way round, here alone: epoch (whole seconds, years 0 to 9999) as an IMF-fixdate
 * ("Sun, 06 Nov 1994 08:49:37 GMT") in out (at least 30 bytes); 0, or -1 out of range. The
 * calendar is libc's gmtime_r, not the parser's own arithmetic, so the round trip checks one
 * against the other. */
static int format_date(double epoch, char *out, size_t cap)
{
    static const char *const day_names[7] = {"Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"};
    static const char *const month_names[12] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun",
                                                "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};
    if (!(epoch >= FIRST_DATE && epoch <= LAST_DATE) || cap < 30) return -1;
    time_t t = (time_t)floor(epoch);
    struct tm tm;
    if (!gmtime_r(&t, &tm)) return -1;
    snprintf(out, cap, "%s, %02d %s %04d %02d:%02d:%02d GMT", day_names[tm.tm_wday], tm.tm_mday,
             month_names[tm.tm_mon], tm.tm_year + 1900, tm.tm_hour, tm.tm_min, tm.tm_sec);
    return 0;
}

static uint64_t read_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = v << 8 | p[i];
    return v;
}

static void check_value(const char *s, size_t n, double now)
{
    double secs = -1;
    if (rb_http_retry_after(s, now, &secs)) {
        CHECK(isfinite(secs));
        CHECK(secs >= 0 && secs <= RB_HTTP_MAX_RETRY_AFTER);
    }
    double at;
    if (rb_http_parse_date(s, n, now, &at)) {
        CHECK(isfinite(at) && at == floor(at));
        CHECK(at >= FIRST_DATE && at <= LAST_DATE + 1);  /* 23:59:60 of the last day */
        char out[64];
        /* a second 60 reads as the next minute's 00; either way the time formats and reads
         * back as itself */
        if (at <= LAST_DATE) {
            CHECK(format_date(at, out, sizeof out) == 0);
            double back;
            CHECK(rb_http_parse_date(out, strlen(out), now, &back) && back == at);
        }
    }
}

/* A time from 8 bytes, anywhere from year 0 to 9999, formatted and parsed back. */
static void check_round_trip(uint64_t bits, uint64_t more)
{
    double span = LAST_DATE - FIRST_DATE + 1;
    double t = FIRST_DATE + (double)(bits % (uint64_t)span);
    char out[64];
    CHECK(format_date(t, out, sizeof out) == 0);
    CHECK(strlen(out) == 29);
    double back;
    CHECK(rb_http_parse_date(out, strlen(out), t, &back));
    CHECK(back == t);
    /* as a Retry-After d seconds after `now`: exactly d when within the clamp */
    double d = (double)(more % (uint64_t)(2 * RB_HTTP_MAX_RETRY_AFTER));
    double secs;
    CHECK(rb_http_retry_after(out, t - d, &secs));
    CHECK(secs == (d > RB_HTTP_MAX_RETRY_AFTER ? RB_HTTP_MAX_RETRY_AFTER : d));
    /* a date already past is a delay of 0 */
    CHECK(rb_http_retry_after(out, t + 1 + d, &secs) && secs == 0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    double now = 1700000000;
    if (size >= 16) {
        check_round_trip(read_u64(data), read_u64(data + 8));
        /* any double as `now`, NaN and infinities included */
        uint64_t bits = read_u64(data);
        memcpy(&now, &bits, sizeof now);
    }
    char out[64];
    if (format_date(now, out, sizeof out) == 0) CHECK(strlen(out) == 29);
    char *s = malloc(size + 1);
    if (!s) return 0;
    memcpy(s, data, size);
    s[size] = 0;
    check_value(s, size, now);
    check_value(s, size, 1700000000);
    if (size >= 16) check_value(s + 16, size - 16, now);
    free(s);
    return 0;
}
