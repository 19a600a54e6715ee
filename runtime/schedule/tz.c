/* tz.c -- time zones from TZif files (RFC 8536), with their footer's POSIX TZ rule. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "schedule/civil.h"
#include "schedule/tz.h"
#include "util/alloc.h"
#include "util/check.h"
#include "util/text.h"

#define TZIF_MAX (1 << 20)          /* the largest file read; real ones are under 4 KiB */
#define DEFAULT_DIR "/usr/share/zoneinfo"

/* A day of a rule: Jn (1-365, no February 29), n (0-365) or Mm.w.d, and a local time (s). */
typedef struct rule_date {
    char kind;                      /* 'J', 'N' or 'M' */
    int n, m, w, d;
    int32_t time;
} rule_date;

struct rb_tz {
    size_t ntrans;
    int64_t *trans;                 /* transition instants, ascending */
    int32_t *after;                 /* the offset from each transition on */
    int32_t before;                 /* before the first transition (or always, without any) */
    /* past the last transition: the footer's rule, else the last offset stays */
    int has_rule, has_dst;
    int32_t std_off, dst_off;
    rule_date start, end;
};

/* ---- the POSIX TZ rule (footer) ---------------------------------------------------------- */

static int parse_name(const char **p)
{
    const char *s = *p;
    if (*s == '<') {
        const char *e = strchr(s, '>');
        if (!e || e - s < 4) return -1;
        *p = e + 1;
        return 0;
    }
    while ((*s >= 'A' && *s <= 'Z') || (*s >= 'a' && *s <= 'z')) s++;
    if (s - *p < 3) return -1;
    *p = s;
    return 0;
}

/* [+-]hh[:mm[:ss]] into *secs; hours up to 167 (RFC 8536's extension for rule times). */
static int parse_hms(const char **p, int32_t *secs)
{
    const char *s = *p;
    int sign = 1;
    if (*s == '+' || *s == '-') sign = *s++ == '-' ? -1 : 1;
    int part[3] = {0, 0, 0}, i = 0;
    for (;;) {
        if (*s < '0' || *s > '9') return -1;
        int v = 0, digits = 0;
        while (*s >= '0' && *s <= '9' && digits < 3) v = v * 10 + (*s++ - '0'), digits++;
        if (i == 0 ? v > 167 : v > 59) return -1;
        part[i++] = v;
        if (i == 3 || *s != ':') break;
        s++;
    }
    *secs = sign * (part[0] * 3600 + part[1] * 60 + part[2]);
    *p = s;
    return 0;
}

static int parse_int(const char **p, int lo, int hi, int *out)
{
    const char *s = *p;
    int v = 0, digits = 0;
    while (*s >= '0' && *s <= '9' && digits < 4) v = v * 10 + (*s++ - '0'), digits++;
    if (!digits || v < lo || v > hi) return -1;
    *out = v;
    *p = s;
    return 0;
}

static int parse_date(const char **p, rule_date *r)
{
    const char *s = *p;
    int ok;
    if (*s == 'M') {
        s++;
        r->kind = 'M';
        ok = parse_int(&s, 1, 12, &r->m) == 0 && *s++ == '.' && parse_int(&s, 1, 5, &r->w) == 0 &&
             *s++ == '.' && parse_int(&s, 0, 6, &r->d) == 0;
    } else if (*s == 'J') {
        s++;
        r->kind = 'J';
        ok = parse_int(&s, 1, 365, &r->n) == 0;
    } else {
        r->kind = 'N';
        ok = parse_int(&s, 0, 365, &r->n) == 0;
    }
    r->time = 7200;
    if (ok && *s == '/') {
        s++;
        ok = parse_hms(&s, &r->time) == 0;
    }
    *p = s;
    return ok ? 0 : -1;
}

/* "std offset [dst [offset] [,start[/time],end[/time]]]"; 0, or -1 when it is no such rule. */
static int parse_rule(rb_tz *tz, const char *s)
{
    int32_t off;
    if (parse_name(&s) != 0 || parse_hms(&s, &off) != 0) return -1;
    tz->std_off = -off;
    tz->has_rule = 1;
    if (!*s) return 0;
    if (parse_name(&s) != 0) return -1;
    tz->has_dst = 1;
    tz->dst_off = tz->std_off + 3600;
    if (*s && *s != ',') {
        if (parse_hms(&s, &off) != 0) return -1;
        tz->dst_off = -off;
    }
    const char *rules = *s ? s : ",M3.2.0,M11.1.0";    /* POSIX's default: the US rule */
    if (*rules++ != ',' || parse_date(&rules, &tz->start) != 0 || *rules++ != ',' ||
        parse_date(&rules, &tz->end) != 0 || *rules)
        return -1;
    return 0;
}

/* Days since 1970 of rule day r in year y. */
static int64_t rule_day(const rule_date *r, int64_t y)
{
    int64_t jan1 = rb_days_from_civil(y, 1, 1);
    if (r->kind == 'J') return jan1 + r->n - 1 + (rb_leap_year(y) && r->n >= 60);
    if (r->kind == 'N') return jan1 + r->n;
    int64_t first = rb_days_from_civil(y, r->m, 1);
    int day = 1 + (r->d - rb_weekday(first) + 7) % 7 + (r->w - 1) * 7;
    while (day > rb_days_in_month(y, r->m)) day -= 7;
    return first + day - 1;
}

static int32_t rule_offset(const rb_tz *tz, int64_t t)
{
    if (!tz->has_dst) return tz->std_off;
    int64_t y;
    int m, d;
    rb_civil_from_days(rb_floor_div(t + tz->std_off, RB_DAY), &y, &m, &d);
    /* the start is given in standard time, the end in daylight time */
    int64_t start = rule_day(&tz->start, y) * RB_DAY + tz->start.time - tz->std_off;
    int64_t end = rule_day(&tz->end, y) * RB_DAY + tz->end.time - tz->dst_off;
    int dst = start < end ? t >= start && t < end : !(t >= end && t < start);
    return dst ? tz->dst_off : tz->std_off;
}

/* ---- the TZif file ------------------------------------------------------------------------ */

static uint32_t be32(const unsigned char *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static int64_t be64(const unsigned char *p) { return (int64_t)((uint64_t)be32(p) << 32 | be32(p + 4)); }

typedef struct tzif_counts { uint32_t isut, isstd, leap, time, type, chars; } tzif_counts;

static int read_header(const unsigned char *p, size_t len, tzif_counts *c)
{
    if (len < 44 || memcmp(p, "TZif", 4) != 0) return -1;
    c->isut = be32(p + 20);
    c->isstd = be32(p + 24);
    c->leap = be32(p + 28);
    c->time = be32(p + 32);
    c->type = be32(p + 36);
    c->chars = be32(p + 40);
    return c->type >= 1 && c->type <= 256 && c->time <= TZIF_MAX && c->leap <= TZIF_MAX &&
                   c->chars <= TZIF_MAX && c->isut <= 256 && c->isstd <= 256 ? 0 : -1;
}

static size_t block_size(const tzif_counts *c, int wide)
{
    size_t tsize = wide ? 8 : 4;
    return c->time * tsize + c->time + c->type * 6 + c->chars + c->leap * (tsize + 4) + c->isstd +
           c->isut;
}

/* The transitions and offsets of the data block at p (its header counts c). */
static int read_block(rb_tz *tz, const unsigned char *p, const tzif_counts *c, int wide)
{
    size_t tsize = wide ? 8 : 4;
    const unsigned char *times = p, *idx = p + c->time * tsize, *types = idx + c->time;
    tz->ntrans = c->time;
    tz->trans = rb_calloc(c->time + 1, sizeof *tz->trans);
    tz->after = rb_calloc(c->time + 1, sizeof *tz->after);
    if (!tz->trans || !tz->after) return -1;
    for (uint32_t i = 0; i < c->time; i++) {
        if (idx[i] >= c->type) return -1;
        tz->trans[i] = wide ? be64(times + i * 8) : (int32_t)be32(times + i * 4);
        tz->after[i] = (int32_t)be32(types + idx[i] * 6);
        if (i && tz->trans[i] <= tz->trans[i - 1]) return -1;
    }
    tz->before = (int32_t)be32(types);
    return 0;
}

static int parse_tzif(rb_tz *tz, const unsigned char *p, size_t len)
{
    tzif_counts c;
    if (read_header(p, len, &c) != 0) return -1;
    size_t v1 = 44 + block_size(&c, 0);
    if (v1 > len) return -1;
    if (p[4] < '2') return read_block(tz, p + 44, &c, 0);
    const unsigned char *h2 = p + v1;
    if (read_header(h2, len - v1, &c) != 0) return -1;
    size_t v2 = 44 + block_size(&c, 1);
    if (v2 > len - v1 || read_block(tz, h2 + 44, &c, 1) != 0) return -1;
    /* the footer: "\n" rule "\n" (an empty rule: none) */
    const char *f = (const char *)h2 + v2, *end = (const char *)p + len;
    if (f < end && *f == '\n') {
        const char *nl = memchr(f + 1, '\n', (size_t)(end - f - 1));
        if (nl && nl > f + 1) {
            char rule[128];
            size_t n = (size_t)(nl - f - 1);
            if (n >= sizeof rule) return -1;
            memcpy(rule, f + 1, n);
            rule[n] = 0;
            if (parse_rule(tz, rule) != 0) return -1;
        }
    }
    return 0;
}

/* The message in err as one line (a name given with a line break in it). */
static void one_line(char *err, size_t errlen)
{
    char tmp[512];
    snprintf(tmp, sizeof tmp, "%s", err);
    rb_one_line(err, errlen, tmp);
}

static int valid_name(const char *name)
{
    size_t n = strlen(name);
    if (!n || n > RB_TZ_NAME_MAX || name[0] == '/') return 0;
    for (const char *s = name; *s; s++)
        if (!((*s >= 'A' && *s <= 'Z') || (*s >= 'a' && *s <= 'z') || (*s >= '0' && *s <= '9') ||
              *s == '/' || *s == '_' || *s == '+' || *s == '-' || *s == '.'))
            return 0;
    /* no part "." or ".." (nor any starting with a dot): the name stays inside the database */
    for (const char *s = name; s; s = strchr(s, '/')) {
        if (*s == '/') s++;
        if (*s == '.' || *s == '/' || !*s) return 0;
    }
    return 1;
}

rb_tz *rb_tz_load(const char *name, char *err, size_t errlen)
{
    rb_tz *tz = rb_calloc(1, sizeof *tz);
    if (!tz) { snprintf(err, errlen, "out of memory"); return NULL; }
    if (!name || strcmp(name, "UTC") == 0) return tz;      /* offset 0, no transitions */
    /* "localtime" is whichever zone each host has; the "right/" zones count leap seconds,
     * which epoch times do not */
    if (!valid_name(name) || !strcmp(name, "localtime") || !strncmp(name, "right/", 6)) {
        snprintf(err, errlen, "timezone '%.*s' is not a name of the tz database (like "
                 "Europe/Berlin)", RB_TZ_NAME_MAX, name);
        one_line(err, errlen);
        free(tz);
        return NULL;
    }
    const char *dir = getenv("TZDIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir && *dir ? dir : DEFAULT_DIR, name);
    FILE *f = fopen(path, "rb");
    unsigned char *buf = f ? rb_malloc(TZIF_MAX) : NULL;
    size_t len = buf ? fread(buf, 1, TZIF_MAX, f) : 0;
    int bad = !f ? errno : 0;
    if (f) fclose(f);
    if (!f || !buf || parse_tzif(tz, buf, len) != 0) {
        if (!f && bad == ENOENT)
            snprintf(err, errlen, "timezone '%s' is not in the tz database (%s)", name,
                     dir && *dir ? dir : DEFAULT_DIR);
        else if (!f)
            snprintf(err, errlen, "timezone '%s': %s", name, strerror(bad));
        else if (!buf)
            snprintf(err, errlen, "out of memory");
        else
            snprintf(err, errlen, "timezone '%s': not a tz database file", name);
        free(buf);
        rb_tz_free(tz);
        one_line(err, errlen);
        return NULL;
    }
    free(buf);
    return tz;
}

void rb_tz_free(rb_tz *tz)
{
    if (!tz) return;
    free(tz->trans);
    free(tz->after);
    free(tz);
}

int32_t rb_tz_offset(const rb_tz *tz, int64_t t)
{
    RB_ASSERT(tz);
    if (!tz->ntrans || t < tz->trans[0]) return tz->ntrans || !tz->has_rule ? tz->before
                                                                            : rule_offset(tz, t);
    if (t >= tz->trans[tz->ntrans - 1] && tz->has_rule) return rule_offset(tz, t);
    size_t lo = 0, hi = tz->ntrans;     /* the last transition <= t: in [lo, hi) */
    while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        if (tz->trans[mid] <= t) lo = mid;
        else hi = mid;
    }
    return tz->after[lo];
}
