/* schedule.h -- durable schedules' ticks: when the next one falls, and its key.
 *
 * A schedule (rb_schedule, store.h) is kept in the store; every dispatcher on the store reads
 * them and fires each due tick once (dispatch/ticks.c). This file is the arithmetic both
 * the definer (store:schedule) and the dispatchers use: no store and no loop here. */
#ifndef RB_SCHEDULE_H
#define RB_SCHEDULE_H

#include <stddef.h>

/* A schedule's name: 1 to RB_SCHEDULE_NAME_MAX bytes of UTF-8 without a NUL byte. */
#define RB_SCHEDULE_NAME_MAX 200
int rb_schedule_name_valid(const char *name, size_t len);

/* The shortest `every`, s (a cron's finest is a second too). */
#define RB_SCHEDULE_EVERY_MIN 1.0

/* The first tick strictly after `after` (epoch s) into *next, for a schedule of `cron` in
 * zone `timezone` (NULL: UTC), or of `every` s (cron NULL) on the grid anchor + k * every,
 * k >= 1. 0, or -1 with a one-line message in err: a cron or zone that is not one, an every
 * out of range, both or neither given, no tick before the year 9999. */
int rb_schedule_next(const char *cron, double every, const char *timezone, double anchor,
                     double after, double *next, char *err, size_t errlen);

/* The dedupe key of the tick due at `due`: "NAME@2026-12-07T04:30:00Z" (with milliseconds
 * when `due` has a fraction), into out (cap bytes). */
void rb_schedule_tick_key(char *out, size_t cap, const char *name, double due);

#endif
