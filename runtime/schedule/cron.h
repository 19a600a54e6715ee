/* cron.h -- cron expressions: parsing, and the next tick in a time zone.
 *
 * Five fields (minute hour day-of-month month day-of-week), or six with seconds first. Each
 * field is a list of `*`, `N`, `N-M`, each with an optional `/STEP` (`N/STEP`: from N to the
 * end); months and weekdays also by name (JAN-DEC, SUN-SAT, any case); weekday 7 is Sunday;
 * `?` is `*` in the two day fields. As in Vixie cron, when both day fields are restricted
 * (neither starts with `*` or `?`) a day matches either, else both. `@yearly` (`@annually`),
 * `@monthly`, `@weekly`, `@daily` (`@midnight`) and `@hourly` stand for their five fields.
 *
 * Ticks are wall-clock times of the zone. One that a change to daylight saving time skips
 * fires at the moment the clock jumps (once, however many of its times the gap held); one that
 * the change back repeats fires at its first occurrence only. */
#ifndef RB_CRON_H
#define RB_CRON_H

#include <stddef.h>
#include <stdint.h>
#include "schedule/tz.h"

typedef struct rb_cron {
    uint64_t sec, min;      /* bits 0-59 */
    uint32_t hour;          /* bits 0-23 */
    uint32_t dom;           /* bits 1-31 */
    uint32_t month;         /* bits 1-12 */
    uint32_t dow;           /* bits 0-6, 0 = Sunday */
    int dom_star, dow_star; /* the day field started with * or ? */
} rb_cron;

#define RB_CRON_TEXT_MAX 256

/* 0, or -1 with a one-line message in err (naming the field and what is wrong with it). An
 * expression that can never fire (February 30) is refused too. */
int rb_cron_parse(rb_cron *c, const char *spec, char *err, size_t errlen);

/* The first tick of c strictly after instant `after` (epoch s) in zone tz; -1 when there is
 * none in the ten years after it. */
int64_t rb_cron_next(const rb_cron *c, const rb_tz *tz, int64_t after);

#endif
