/* schedule_test.c -- durable schedules' arithmetic (runtime/schedule/): time zones read from the
 * system's tz database agree with known offsets, before, between and past its transitions;
 * files that are not TZif, or are cut or flipped, are refused without a read past their end;
 * cron expressions parse as cron(8) reads them, are refused with the field named, and their
 * ticks are right across a change to summer time and back, a leap day and the day rule; an
 * `every` keeps to its grid; tick keys name the tick. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>
#include <cmocka.h>
#include "schedule/civil.h"
#include "schedule/cron.h"
#include "schedule/schedule.h"
#include "schedule/tz.h"

/* epoch s of a UTC date and time */
static int64_t utc(int y, int mo, int d, int h, int mi, int s)
{
    return rb_days_from_civil(y, mo, d) * RB_DAY + h * 3600 + mi * 60 + s;
}

static rb_tz *zone(const char *name)
{
    char err[300];
    rb_tz *tz = rb_tz_load(name, err, sizeof err);
    if (!tz) fail_msg("%s: %s", name, err);
    return tz;
}

static void civil_round_trips(void **state)
{
    (void)state;
    for (int64_t z = -800000; z <= 800000; z += 7) {
        int64_t y;
        int m, d;
        rb_civil_from_days(z, &y, &m, &d);
        assert_int_equal(rb_days_from_civil(y, m, d), z);
        assert_true(d >= 1 && d <= rb_days_in_month(y, m));
    }
    assert_int_equal(rb_weekday(0), 4);                          /* 1970-01-01: Thursday */
    assert_int_equal(rb_weekday(rb_days_from_civil(2026, 12, 7)), 1);   /* a Monday */
    assert_int_equal(rb_weekday(rb_days_from_civil(1969, 12, 31)), 3);
}

static void offsets_are_the_zones(void **state)
{
    (void)state;
    rb_tz *b = zone("Europe/Berlin");
    assert_int_equal(rb_tz_offset(b, utc(2026, 1, 15, 12, 0, 0)), 3600);
    assert_int_equal(rb_tz_offset(b, utc(2026, 7, 15, 12, 0, 0)), 7200);
    /* the change of 2026-03-29 at 01:00 UTC, to the second */
    assert_int_equal(rb_tz_offset(b, utc(2026, 3, 29, 0, 59, 59)), 3600);
    assert_int_equal(rb_tz_offset(b, utc(2026, 3, 29, 1, 0, 0)), 7200);
    /* past the file's transitions: the footer's rule */
    assert_int_equal(rb_tz_offset(b, utc(2150, 7, 1, 0, 0, 0)), 7200);
    assert_int_equal(rb_tz_offset(b, utc(2150, 12, 1, 0, 0, 0)), 3600);
    assert_int_equal(rb_tz_offset(b, utc(1800, 1, 1, 0, 0, 0)), 3208);    /* local mean time */
    rb_tz_free(b);
    rb_tz *s = zone("Australia/Sydney");    /* the south: summer across the new year */
    assert_int_equal(rb_tz_offset(s, utc(2026, 1, 15, 0, 0, 0)), 39600);
    assert_int_equal(rb_tz_offset(s, utc(2026, 7, 15, 0, 0, 0)), 36000);
    assert_int_equal(rb_tz_offset(s, utc(2200, 1, 15, 0, 0, 0)), 39600);
    assert_int_equal(rb_tz_offset(s, utc(2200, 7, 15, 0, 0, 0)), 36000);
    rb_tz_free(s);
    rb_tz *c = zone("Pacific/Chatham");
    assert_int_equal(rb_tz_offset(c, utc(2026, 7, 1, 0, 0, 0)), 45900);   /* +12:45 */
    rb_tz_free(c);
    rb_tz *u = zone(NULL);
    assert_int_equal(rb_tz_offset(u, 0), 0);
    rb_tz_free(u);
    u = zone("UTC");
    assert_int_equal(rb_tz_offset(u, utc(2026, 7, 1, 0, 0, 0)), 0);
    rb_tz_free(u);
}

static void bad_zone_names_are_refused(void **state)
{
    (void)state;
    const char *bad[] = {"", "/etc/passwd", "../etc/passwd", "Europe/../../etc/passwd",
                         "Europe//Berlin", "Europe/", ".hidden", "Europe/Berlin\n", "Mars/Base",
                         "Europe", "Europe/Berlin Europe/Paris", "localtime", "right/UTC",
                         "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char err[300] = "";
        rb_tz *tz = rb_tz_load(bad[i], err, sizeof err);
        if (tz) fail_msg("zone '%s' was taken", bad[i]);
        assert_non_null(strstr(err, "timezone"));
        assert_null(strchr(err, '\n'));
    }
}

/* A copy of a real zone's file, cut at every length and with bytes flipped, under a TZDIR of
 * its own: each is refused or read, never read past (ASan), and a zone read gives offsets
 * within a day. */
static void damaged_files_are_refused(void **state)
{
    (void)state;
    FILE *f = fopen("/usr/share/zoneinfo/America/New_York", "rb");
    assert_non_null(f);
    static unsigned char real[1 << 16];
    size_t len = fread(real, 1, sizeof real, f);
    fclose(f);
    assert_true(len > 100);
    char dir[] = "/tmp/rb_tzdir_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char path[300];
    snprintf(path, sizeof path, "%s/Bad", dir);
    setenv("TZDIR", dir, 1);
    unsigned seed = 7;
    for (size_t round = 0; round < len + 400; round++) {
        unsigned char buf[1 << 16];
        size_t n = round <= len ? round : len;
        memcpy(buf, real, n);
        if (round > len)
            for (int k = 0; k < 3; k++) buf[rand_r(&seed) % n] ^= (unsigned char)(1 + rand_r(&seed) % 255);
        f = fopen(path, "wb");
        fwrite(buf, 1, n, f);
        fclose(f);
        char err[300];
        rb_tz *tz = rb_tz_load("Bad", err, sizeof err);
        if (!tz) {
            assert_non_null(strstr(err, "Bad"));
            continue;
        }
        for (int64_t t = -4000000000LL; t < 8000000000LL; t += 123456789) {
            int32_t off = rb_tz_offset(tz, t);
            (void)off;      /* any value: a flipped byte may be an offset */
        }
        rb_tz_free(tz);
    }
    unlink(path);
    rmdir(dir);
    unsetenv("TZDIR");
}

static void cron_is_read_as_cron_reads_it(void **state)
{
    (void)state;
    rb_cron c;
    char err[400];
    assert_int_equal(rb_cron_parse(&c, "*/15 0-6/2 1,15 JAN-mar mon-FRI", err, sizeof err), 0);
    assert_true(c.sec == 1);
    assert_true(c.min == ((1ull << 0) | (1ull << 15) | (1ull << 30) | (1ull << 45)));
    assert_true(c.hour == ((1u << 0) | (1u << 2) | (1u << 4) | (1u << 6)));
    assert_true(c.dom == ((1u << 1) | (1u << 15)));
    assert_true(c.month == ((1u << 1) | (1u << 2) | (1u << 3)));
    assert_true(c.dow == 0x3e);
    assert_false(c.dom_star || c.dow_star);
    assert_int_equal(rb_cron_parse(&c, "5/20 * * * * 7", err, sizeof err), 0);    /* 6 fields */
    assert_true(c.sec == ((1ull << 5) | (1ull << 25) | (1ull << 45)));
    assert_true(c.dow == 1);                                /* 7 is Sunday */
    assert_int_equal(rb_cron_parse(&c, "  @Daily ", err, sizeof err), 0);
    assert_true(c.min == 1 && c.hour == 1 && c.dom_star && c.dow_star);
    assert_int_equal(rb_cron_parse(&c, "0 0 ? * 1", err, sizeof err), 0);
    assert_true(c.dom_star && !c.dow_star);
    struct { const char *spec, *says; } bad[] = {
        {"", "0 fields"}, {"* * * *", "4 fields"}, {"* * * * * * *", "more than 6"},
        {"60 * * * *", "minutes"}, {"* 24 * * *", "hours"}, {"* * 0 * *", "day of month"},
        {"* * 32 * *", "day of month"}, {"* * * 13 *", "month"}, {"* * * * 8", "day of week"},
        {"*/0 * * * *", "minutes"}, {"*/61 * * * *", "minutes"}, {"5-1 * * * *", "backwards"},
        {"1,,2 * * * *", "minutes"}, {"? * * * *", "minutes"}, {"* * * JANUARY *", "month"},
        {"-1 * * * *", "minutes"}, {"1-2-3 * * * *", "minutes"}, {"0 0 30 2 *", "never fires"},
        {"0 0 31 4,6,9,11 *", "never fires"}, {"@often", "fields"}, {"99999999999 * * * *", "minutes"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = 0;
        if (rb_cron_parse(&c, bad[i].spec, err, sizeof err) == 0) fail_msg("'%s' was taken", bad[i].spec);
        if (!strstr(err, bad[i].says)) fail_msg("'%s': %s", bad[i].spec, err);
        assert_null(strchr(err, '\n'));
    }
    char huge[600];
    memset(huge, '1', sizeof huge - 1);
    huge[sizeof huge - 1] = 0;
    assert_int_equal(rb_cron_parse(&c, huge, err, sizeof err), -1);
    assert_int_equal(rb_cron_parse(&c, NULL, err, sizeof err), -1);
}

static int64_t next_of(const char *spec, const char *zone_name, int64_t after)
{
    rb_cron c;
    char err[400];
    if (rb_cron_parse(&c, spec, err, sizeof err) != 0) fail_msg("%s", err);
    rb_tz *tz = zone(zone_name);
    int64_t t = rb_cron_next(&c, tz, after);
    rb_tz_free(tz);
    return t;
}

static void ticks_fall_where_the_clock_says(void **state)
{
    (void)state;
    /* strictly after */
    assert_int_equal(next_of("0 * * * *", NULL, utc(2026, 1, 1, 5, 0, 0)), utc(2026, 1, 1, 6, 0, 0));
    assert_int_equal(next_of("0 * * * *", NULL, utc(2026, 1, 1, 4, 59, 59)), utc(2026, 1, 1, 5, 0, 0));
    /* 02:30 in Berlin: winter, summer, the day the clock jumps over it (fires at the jump,
     * 03:00 local), and the day it comes twice (fires at the first) */
    assert_int_equal(next_of("30 2 * * *", "Europe/Berlin", utc(2026, 1, 10, 0, 0, 0)), utc(2026, 1, 10, 1, 30, 0));
    assert_int_equal(next_of("30 2 * * *", "Europe/Berlin", utc(2026, 7, 10, 0, 0, 0)), utc(2026, 7, 10, 0, 30, 0));
    assert_int_equal(next_of("30 2 * * *", "Europe/Berlin", utc(2026, 3, 28, 12, 0, 0)), utc(2026, 3, 29, 1, 0, 0));
    assert_int_equal(next_of("30 2 * * *", "Europe/Berlin", utc(2026, 3, 29, 1, 0, 0)), utc(2026, 3, 30, 0, 30, 0));
    assert_int_equal(next_of("30 2 * * *", "Europe/Berlin", utc(2026, 10, 24, 12, 0, 0)), utc(2026, 10, 25, 0, 30, 0));
    assert_int_equal(next_of("30 2 * * *", "Europe/Berlin", utc(2026, 10, 25, 0, 30, 0)), utc(2026, 10, 26, 1, 30, 0));
    /* every 20 minutes of 02:xx: the jump gives one tick, at 03:00; the hour that comes twice
     * fires once */
    int64_t t = utc(2026, 3, 29, 0, 0, 0);
    t = next_of("*/20 2 * * *", "Europe/Berlin", t);
    assert_int_equal(t, utc(2026, 3, 29, 1, 0, 0));
    assert_int_equal(next_of("*/20 2 * * *", "Europe/Berlin", t), utc(2026, 3, 30, 0, 0, 0));
    t = utc(2026, 10, 24, 23, 59, 0);
    int64_t want[] = {utc(2026, 10, 25, 0, 0, 0), utc(2026, 10, 25, 0, 20, 0),
                      utc(2026, 10, 25, 0, 40, 0), utc(2026, 10, 26, 1, 0, 0)};
    for (int i = 0; i < 4; i++) assert_int_equal(t = next_of("*/20 2 * * *", "Europe/Berlin", t), want[i]);
    /* the last second before the jump: the gap's times fire at the jump, not a day later */
    assert_int_equal(next_of("0-59 59 1,2 * * *", "Europe/Berlin", utc(2026, 3, 29, 0, 59, 59)),
                     utc(2026, 3, 29, 1, 0, 0));
    assert_int_equal(next_of("59 * * * * *", "Europe/Berlin", utc(2026, 3, 29, 0, 59, 59)),
                     utc(2026, 3, 29, 1, 0, 0));
    /* 7/N counts from Sunday */
    rb_cron w;
    char werr[300];
    assert_int_equal(rb_cron_parse(&w, "0 0 * * 7/2", werr, sizeof werr), 0);
    assert_true(w.dow == ((1u << 0) | (1u << 2) | (1u << 4) | (1u << 6)));
    /* Sydney's midnight in its summer */
    assert_int_equal(next_of("0 0 * * *", "Australia/Sydney", utc(2026, 1, 1, 0, 0, 0)), utc(2026, 1, 1, 13, 0, 0));
    /* February 29 */
    assert_int_equal(next_of("0 0 29 2 *", NULL, utc(2026, 1, 1, 0, 0, 0)), utc(2028, 2, 29, 0, 0, 0));
    assert_int_equal(next_of("0 0 29 2 *", NULL, utc(2096, 3, 1, 0, 0, 0)), utc(2104, 2, 29, 0, 0, 0));
    /* both day fields: either; one: both */
    assert_int_equal(next_of("0 0 13 * FRI", NULL, utc(2026, 12, 1, 0, 0, 0)), utc(2026, 12, 4, 0, 0, 0));
    assert_int_equal(next_of("0 0 * 12 FRI", NULL, utc(2026, 11, 1, 0, 0, 0)), utc(2026, 12, 4, 0, 0, 0));
    assert_int_equal(next_of("0 0 1 * *", NULL, utc(2026, 12, 7, 0, 0, 0)), utc(2027, 1, 1, 0, 0, 0));
    /* seconds */
    assert_int_equal(next_of("*/10 * * * * *", NULL, utc(2026, 1, 1, 0, 0, 5)), utc(2026, 1, 1, 0, 0, 10));
    assert_int_equal(next_of("59 59 23 31 12 *", NULL, utc(2026, 1, 1, 0, 0, 0)), utc(2026, 12, 31, 23, 59, 59));
    /* a sequence of ticks only moves on, and each is a time the expression names */
    rb_cron c;
    char err[300];
    assert_int_equal(rb_cron_parse(&c, "7 */3 * * MON,THU", err, sizeof err), 0);
    rb_tz *ny = zone("America/New_York");
    t = utc(2026, 1, 1, 0, 0, 0);
    for (int i = 0; i < 500; i++) {
        int64_t n = rb_cron_next(&c, ny, t);
        assert_true(n > t);
        int64_t local = n + rb_tz_offset(ny, n), day = rb_floor_div(local, RB_DAY);
        assert_int_equal(local % 3600 / 60, 7);
        assert_int_equal((local - day * RB_DAY) / 3600 % 3, 0);
        int wd = rb_weekday(day);
        assert_true(wd == 1 || wd == 4);
        t = n;
    }
    rb_tz_free(ny);
}

static void every_keeps_its_grid(void **state)
{
    (void)state;
    double next;
    char err[300];
    assert_int_equal(rb_schedule_next(NULL, 10, NULL, 100, 100, &next, err, sizeof err), 0);
    assert_true(next == 110);
    /* missed ticks: one fire, then the grid from now */
    assert_int_equal(rb_schedule_next(NULL, 10, NULL, 100, 1000.5, &next, err, sizeof err), 0);
    assert_true(next == 1010);
    assert_int_equal(rb_schedule_next(NULL, 10, NULL, 100, 1000, &next, err, sizeof err), 0);
    assert_true(next == 1010);
    assert_int_equal(rb_schedule_next("0 0 * * *", 0, NULL, 0, 0.5, &next, err, sizeof err), 0);
    assert_true(next == 86400);
    struct { const char *cron; double every; const char *tz; const char *says; } bad[] = {
        {NULL, 0, NULL, "either"}, {"* * * * *", 5, NULL, "either"}, {NULL, 0.5, NULL, "every"},
        {NULL, -1, NULL, "every must"}, {NULL, 1e300, NULL, "every"}, {NULL, 5, "UTC", "timezone"},
        {"* * * * *", 0, "Nowhere/Land", "Nowhere/Land"}, {"bad", 0, NULL, "fields"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = 0;
        assert_int_equal(rb_schedule_next(bad[i].cron, bad[i].every, bad[i].tz, 0, 0, &next, err,
                                          sizeof err), -1);
        if (!strstr(err, bad[i].says)) fail_msg("%zu: %s", i, err);
    }
    double nan = 0.0 / 0.0;
    assert_int_equal(rb_schedule_next(NULL, nan, NULL, 0, 0, &next, err, sizeof err), -1);
    assert_int_equal(rb_schedule_next(NULL, 5, NULL, 0, nan, &next, err, sizeof err), -1);
    assert_int_equal(rb_schedule_next(NULL, 5, NULL, 0, 1.0 / 0.0, &next, err, sizeof err), -1);
    /* no tick before the year 9999 */
    assert_int_equal(rb_schedule_next(NULL, 5, NULL, 0, 253402300799.0, &next, err, sizeof err), -1);
}

static void tick_keys_name_the_tick(void **state)
{
    (void)state;
    char key[300];
    rb_schedule_tick_key(key, sizeof key, "nightly", (double)utc(2026, 12, 7, 4, 30, 0));
    assert_string_equal(key, "nightly@2026-12-07T04:30:00Z");
    rb_schedule_tick_key(key, sizeof key, "hb", (double)utc(2026, 12, 7, 4, 30, 0) + 0.25);
    assert_string_equal(key, "hb@2026-12-07T04:30:00.250Z");
    rb_schedule_tick_key(key, sizeof key, "hb", (double)utc(2026, 12, 7, 4, 30, 0) + 0.9999);
    assert_string_equal(key, "hb@2026-12-07T04:30:00.999Z");
    assert_true(rb_schedule_name_valid("a", 1));
    assert_false(rb_schedule_name_valid("", 0));
    assert_false(rb_schedule_name_valid("a\0b", 3));
    assert_false(rb_schedule_name_valid("\xff", 1));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(civil_round_trips),
        cmocka_unit_test(offsets_are_the_zones),
        cmocka_unit_test(bad_zone_names_are_refused),
        cmocka_unit_test(damaged_files_are_refused),
        cmocka_unit_test(cron_is_read_as_cron_reads_it),
        cmocka_unit_test(ticks_fall_where_the_clock_says),
        cmocka_unit_test(every_keeps_its_grid),
        cmocka_unit_test(tick_keys_name_the_tick),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
