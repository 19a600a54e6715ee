/* cron.c -- cron expressions (cron.h). */
#include <ctype.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include "schedule/civil.h"
#include "schedule/cron.h"
#include "util/check.h"
#include "util/text.h"

typedef struct field_def {
    const char *what;
    int lo, hi;
    const char *const *names;   /* names of lo, lo + 1, ... (NULL: numbers only) */
} field_def;

static const char *const month_names[] = {"JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL",
                                          "AUG", "SEP", "OCT", "NOV", "DEC", NULL};
static const char *const dow_names[] = {"SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT", NULL};

enum { F_SEC, F_MIN, F_HOUR, F_DOM, F_MONTH, F_DOW };
static const field_def fields[] = {
    [F_SEC] = {"seconds", 0, 59, NULL},   [F_MIN] = {"minutes", 0, 59, NULL},
    [F_HOUR] = {"hours", 0, 23, NULL},    [F_DOM] = {"day of month", 1, 31, NULL},
    [F_MONTH] = {"month", 1, 12, month_names}, [F_DOW] = {"day of week", 0, 7, dow_names},
};

static const struct { const char *name, *fields; } macros[] = {
    {"@yearly", "0 0 1 1 *"}, {"@annually", "0 0 1 1 *"}, {"@monthly", "0 0 1 * *"},
    {"@weekly", "0 0 * * 0"}, {"@daily", "0 0 * * *"},    {"@midnight", "0 0 * * *"},
    {"@hourly", "0 * * * *"},
};

/* A number or a name of field f at *p. */
static int read_value(const char **p, const field_def *f, int *out)
{
    const char *s = *p;
    if (isdigit((unsigned char)*s)) {
        int v = 0, digits = 0;
        while (isdigit((unsigned char)*s) && digits < 3) v = v * 10 + (*s++ - '0'), digits++;
        if (isdigit((unsigned char)*s)) return -1;
        *out = v;
        *p = s;
        return v >= f->lo && v <= f->hi ? 0 : -1;
    }
    for (int i = 0; f->names && f->names[i]; i++)
        if (strncasecmp(s, f->names[i], 3) == 0 && !isalpha((unsigned char)s[3])) {
            *out = f->lo + i;
            *p = s + 3;
            return 0;
        }
    return -1;
}

/* One field's text (len bytes at s) into the bits *bits; *star when it starts with * or ?. */
static int parse_field(const char *s, size_t len, int which, uint64_t *bits, int *star,
                       char *err, size_t errlen)
{
    const field_def *f = &fields[which];
    char text[RB_CRON_TEXT_MAX];
    snprintf(text, sizeof text, "%.*s", (int)len, s);
    const char *p = text;
    *bits = 0;
    *star = *p == '*' || (*p == '?' && (which == F_DOM || which == F_DOW));
    for (;;) {
        int lo = f->lo, hi = f->hi, step = 1;
        const char *item = p;
        if (*p == '*' || (*p == '?' && (which == F_DOM || which == F_DOW))) {
            p++;
            if (which == F_DOW) hi = 6;
        } else {
            if (read_value(&p, f, &lo) != 0) goto bad;
            hi = lo;
            if (*p == '-') {
                p++;
                if (read_value(&p, f, &hi) != 0) goto bad;
                if (hi < lo) {
                    snprintf(err, errlen, "the %s field's range '%.*s' runs backwards", f->what,
                             (int)(p - item), item);
                    return -1;
                }
            } else if (*p == '/') {
                if (which == F_DOW && lo == 7) lo = 0;      /* 7/N: from Sunday, as 0/N */
                hi = which == F_DOW ? 6 : f->hi;
            }
        }
        if (*p == '/') {
            p++;
            int n = 0, digits = 0;
            while (isdigit((unsigned char)*p) && digits < 3) n = n * 10 + (*p++ - '0'), digits++;
            if (!digits || n < 1 || n > f->hi - f->lo + 1 || isdigit((unsigned char)*p)) goto bad;
            step = n;
        }
        for (int v = lo; v <= hi; v += step) *bits |= (uint64_t)1 << (which == F_DOW ? v % 7 : v);
        if (*p == 0) return 0;
        if (*p++ != ',') goto bad;
    }
bad:
    snprintf(err, errlen, "the %s field '%s' is not a list of *, N, N-M with an optional /STEP, "
             "from %d to %d", f->what, text, f->lo, which == F_DOW ? 7 : f->hi);
    return -1;
}

/* Whether some day of an allowed month is an allowed day of the month (February has 29). */
static int some_day(const rb_cron *c)
{
    if (!c->dom_star && !c->dow_star) return 1;     /* either matches: any weekday does */
    for (int m = 1; m <= 12; m++)
        if (c->month >> m & 1)
            for (int d = 1; d <= rb_days_in_month(2000, m); d++)
                if (c->dom >> d & 1) return 1;
    return 0;
}

static int parse(rb_cron *c, const char *spec, char *err, size_t errlen)
{
    char e[400];
    memset(c, 0, sizeof *c);
    if (!spec || strlen(spec) >= RB_CRON_TEXT_MAX) {
        snprintf(err, errlen, "cron must be a text of at most %d bytes", RB_CRON_TEXT_MAX - 1);
        return -1;
    }
    const char *text = spec + strspn(spec, " \t");
    for (size_t i = 0; i < sizeof macros / sizeof macros[0]; i++) {
        size_t n = strlen(macros[i].name);
        if (strncasecmp(text, macros[i].name, n) == 0 && !text[n + strspn(text + n, " \t")]) {
            text = macros[i].fields;
            break;
        }
    }
    const char *start[7];
    size_t len[7];
    int n = 0;
    for (const char *p = text; *p;) {
        p += strspn(p, " \t");
        if (!*p) break;
        if (n == 7) break;
        start[n] = p;
        len[n] = strcspn(p, " \t");
        p += len[n++];
    }
    if (n != 5 && n != 6) {
        snprintf(err, errlen, "cron '%s' has %s%d fields; it takes 5 (minute hour day month "
                 "weekday) or 6 (seconds first)", spec, n > 6 ? "more than " : "", n > 6 ? 6 : n);
        return -1;
    }
    uint64_t bits[6];
    int star[6];
    bits[F_SEC] = 1;        /* five fields: at second 0 */
    star[F_SEC] = 0;
    for (int i = 0; i < n; i++) {
        int which = i + (n == 5);
        if (parse_field(start[i], len[i], which, &bits[which], &star[which], e, sizeof e) != 0) {
            snprintf(err, errlen, "cron '%s': %s", spec, e);
            return -1;
        }
    }
    c->sec = bits[F_SEC];
    c->min = bits[F_MIN];
    c->hour = (uint32_t)bits[F_HOUR];
    c->dom = (uint32_t)bits[F_DOM];
    c->month = (uint32_t)bits[F_MONTH];
    c->dow = (uint32_t)bits[F_DOW];
    c->dom_star = star[F_DOM];
    c->dow_star = star[F_DOW];
    if (!some_day(c)) {
        snprintf(err, errlen, "cron '%s' never fires: no month it names has such a day", spec);
        return -1;
    }
    return 0;
}

static int day_matches(const rb_cron *c, int dom, int dow)
{
    int by_dom = c->dom >> dom & 1, by_dow = c->dow >> dow & 1;
    if (!c->dom_star && !c->dow_star) return by_dom || by_dow;
    return by_dom && by_dow;
}

/* The first local civil time (s since 1970-01-01 00:00 local) at or after L that c names;
 * -1 when none within ten years. */
static int64_t next_local(const rb_cron *c, int64_t L)
{
    int64_t limit = L + (int64_t)3653 * RB_DAY;
    while (L < limit) {
        int64_t day = rb_floor_div(L, RB_DAY), sod = L - day * RB_DAY;
        int64_t y;
        int m, d;
        rb_civil_from_days(day, &y, &m, &d);
        int h = (int)(sod / 3600), mi = (int)(sod / 60 % 60), s = (int)(sod % 60);
        if (!(c->month >> m & 1))
            L = rb_days_from_civil(m == 12 ? y + 1 : y, m == 12 ? 1 : m + 1, 1) * RB_DAY;
        else if (!day_matches(c, d, rb_weekday(day)))
            L = (day + 1) * RB_DAY;
        else if (!(c->hour >> h & 1))
            L = day * RB_DAY + (h + 1) * 3600;
        else if (!(c->min >> mi & 1))
            L = day * RB_DAY + h * 3600 + (mi + 1) * 60;
        else if (!(c->sec >> s & 1))
            L++;
        else
            return L;
    }
    return -1;
}

/* The instant at which the zone's clock shows local time L: the earlier of two (a time the
 * change back repeats), or the moment the clock jumps over L (a time a change skips). */
static int64_t local_to_utc(const rb_tz *tz, int64_t L)
{
    /* the offsets a day either side bracket any change near L (zones change at most once a
     * day, and local time is within a day of UTC) */
    int32_t a = rb_tz_offset(tz, L - RB_DAY), b = rb_tz_offset(tz, L + RB_DAY);
    int64_t u1 = L - a, u2 = L - b;
    int ok1 = rb_tz_offset(tz, u1) == a, ok2 = rb_tz_offset(tz, u2) == b;
    if (ok1 && ok2) return u1 < u2 ? u1 : u2;
    if (ok1) return u1;
    if (ok2 || a == b) return u2;
    /* skipped: the first instant at the later offset b, between u2 (still at a) and u1 */
    int64_t lo = u2 < u1 ? u2 : u1, hi = u2 < u1 ? u1 : u2;
    while (hi - lo > 1) {
        int64_t mid = lo + (hi - lo) / 2;
        if (rb_tz_offset(tz, mid) == b) hi = mid;
        else lo = mid;
    }
    return hi;
}

int64_t rb_cron_next(const rb_cron *c, const rb_tz *tz, int64_t after)
{
    RB_ASSERT(c && tz);
    /* local time just after `after`, by after's own offset: a change to summer time right
     * after it must not hide the gap's times (they fire at the jump) */
    int64_t L = after + rb_tz_offset(tz, after) + 1;
    /* Each round moves L on; only local times the change back repeats (their first
     * occurrence is before `after`) take more than one. */
    for (int round = 0; round < 100000; round++) {
        int64_t M = next_local(c, L);
        if (M < 0) return -1;
        int64_t u = local_to_utc(tz, M);
        if (u > after) return u;
        L = M + 1;
    }
    return -1;
}

int rb_cron_parse(rb_cron *c, const char *spec, char *err, size_t errlen)
{
    char why[600];
    if (parse(c, spec, why, sizeof why) == 0) return 0;
    rb_one_line(err, errlen, why);      /* a spec given with a line break in it */
    return -1;
}
