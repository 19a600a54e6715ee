/* civil.h -- the proleptic Gregorian calendar in days since 1970-01-01, without time zones
 * (Howard Hinnant's algorithms, http://howardhinnant.github.io/date_algorithms.html). The
 * cron search walks local civil time with these; tz.c finds its rules' days with them. */
#ifndef RB_CIVIL_H
#define RB_CIVIL_H

#include <stdint.h>

#define RB_DAY 86400

static inline int64_t rb_floor_div(int64_t a, int64_t b)
{
    return a / b - (a % b != 0 && (a < 0) != (b < 0));
}

/* Days since 1970-01-01 of year y, month m (1-12), day d (1-31). */
static inline int64_t rb_days_from_civil(int64_t y, int m, int d)
{
    y -= m <= 2;
    int64_t era = rb_floor_div(y, 400);
    int64_t yoe = y - era * 400;
    int64_t doy = (153 * (m > 2 ? m - 3 : m + 9) + 2) / 5 + d - 1;
    int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + doe - 719468;
}

/* The date of day z (days since 1970-01-01). */
static inline void rb_civil_from_days(int64_t z, int64_t *y, int *m, int *d)
{
    z += 719468;
    int64_t era = rb_floor_div(z, 146097);
    int64_t doe = z - era * 146097;
    int64_t yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    int64_t doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    int64_t mp = (5 * doy + 2) / 153;
    *d = (int)(doy - (153 * mp + 2) / 5 + 1);
    *m = (int)(mp < 10 ? mp + 3 : mp - 9);
    *y = yoe + era * 400 + (*m <= 2);
}

/* 0 = Sunday ... 6 = Saturday, of day z (1970-01-01 was a Thursday). */
static inline int rb_weekday(int64_t z) { return (int)(((z % 7) + 11) % 7); }

static inline int rb_leap_year(int64_t y) { return (y % 4 == 0 && y % 100 != 0) || y % 400 == 0; }

static inline int rb_days_in_month(int64_t y, int m)
{
    static const int days[12] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    return m == 2 && rb_leap_year(y) ? 29 : days[m - 1];
}

#endif
