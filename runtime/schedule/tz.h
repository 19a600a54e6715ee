/* tz.h -- a time zone of the system's tz database: the offset from UTC at any instant.
 *
 * Read from the zone's TZif file (RFC 8536) under $TZDIR or /usr/share/zoneinfo: its
 * transitions, and past the last one the POSIX TZ rule in its footer. No process-wide state:
 * glibc's localtime reads the one zone of $TZ, and changing that under an embedding host is
 * not ours to do. */
#ifndef RB_TZ_H
#define RB_TZ_H

#include <stddef.h>
#include <stdint.h>

typedef struct rb_tz rb_tz;

/* The longest zone name taken (the database's longest is about 30). */
#define RB_TZ_NAME_MAX 64

/* Loads zone `name` ("UTC" without a file; NULL is UTC too). NULL with a one-line message in
 * err when the name is not a zone of the database: empty, too long, with a "." path part or
 * a character outside [A-Za-z0-9/_+-], no such file, or a file that is no TZif. */
rb_tz *rb_tz_load(const char *name, char *err, size_t errlen);
void rb_tz_free(rb_tz *tz);

/* The zone's offset from UTC at instant t (epoch s), in s: local time = t + offset. */
int32_t rb_tz_offset(const rb_tz *tz, int64_t t);

#endif
