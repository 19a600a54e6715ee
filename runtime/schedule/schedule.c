/* schedule.c -- durable schedules' ticks (schedule.h). */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include "schedule/civil.h"
#include "schedule/cron.h"
#include "schedule/schedule.h"
#include "schedule/tz.h"
#include "util/clock.h"
#include "util/text.h"

int rb_schedule_name_valid(const char *name, size_t len)
{
    return name && len >= 1 && len <= RB_SCHEDULE_NAME_MAX && rb_utf8_valid(name, len) &&
           memchr(name, 0, len) == NULL;
}

int rb_schedule_next(const char *cron, double every, const char *timezone, double anchor,
                     double after, double *next, char *err, size_t errlen)
{
    if (cron ? every != 0 : every == 0) {
        snprintf(err, errlen, "a schedule takes either cron or every");
        return -1;
    }
    if (!isfinite(after) || !isfinite(anchor)) {
        snprintf(err, errlen, "a schedule's times must be finite");
        return -1;
    }
    if (!cron) {
        if (timezone) {
            snprintf(err, errlen, "timezone goes with cron; every counts seconds");
            return -1;
        }
        if (!(every >= RB_SCHEDULE_EVERY_MIN && every <= RB_MAX_SECONDS)) {
            snprintf(err, errlen, "every must be a number of seconds from 1 to 100 years");
            return -1;
        }
        double k = floor((after - anchor) / every) + 1;
        *next = anchor + (k < 1 ? 1 : k) * every;
        if (*next <= after) *next += every;     /* the division's rounding */
    } else {
        rb_cron c;
        if (rb_cron_parse(&c, cron, err, errlen) != 0) return -1;
        rb_tz *tz = rb_tz_load(timezone, err, errlen);
        if (!tz) return -1;
        int64_t t = rb_cron_next(&c, tz, (int64_t)floor(after));
        rb_tz_free(tz);
        *next = (double)t;
    }
    if (!(*next > 0 && *next <= RB_MAX_EPOCH)) {
        snprintf(err, errlen, "the schedule has no tick left before the year 9999");
        return -1;
    }
    return 0;
}

void rb_schedule_tick_key(char *out, size_t cap, const char *name, double due)
{
    double whole = floor(due);
    int64_t secs = (int64_t)whole, day = rb_floor_div(secs, RB_DAY), sod = secs - day * RB_DAY;
    int64_t y;
    int m, d;
    rb_civil_from_days(day, &y, &m, &d);
    int ms = (int)lround((due - whole) * 1000);
    if (ms >= 1000) ms = 999;
    char frac[8] = "";
    if (ms) snprintf(frac, sizeof frac, ".%03d", ms);
    snprintf(out, cap, "%s@%04lld-%02d-%02dT%02d:%02d:%02d%sZ", name, (long long)y, m, d,
             (int)(sod / 3600), (int)(sod / 60 % 60), (int)(sod % 60), frac);
}
