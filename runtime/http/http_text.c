/* http_text.c -- the HTTP client's texts, apart from its transport (http.c, on libcurl): what
 * a request may hold, the response's header lines, HTTP-dates and Retry-After. Plain C on
 * strings, so the Lua binding checks a request without loading the transport. */
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include "http/http.h"
#include "util/alloc.h"
#include "util/text.h"

/* ---- what a request may hold ---- */

/* RFC 9110 tchar: any VCHAR except delimiters. */
static int is_tchar(unsigned char c)
{
    if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return 1;
    return c && strchr("!#$%&'*+-.^_`|~", c) != NULL;
}

int rb_http_valid_header_name(const char *s, size_t n)
{
    if (n == 0) return 0;
    for (size_t i = 0; i < n; i++)
        if (!is_tchar((unsigned char)s[i])) return 0;
    return 1;
}

int rb_http_valid_method(const char *s, size_t n)
{
    return n <= 32 && rb_http_valid_header_name(s, n);
}

int rb_http_valid_header_value(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (s[i] == '\r' || s[i] == '\n' || s[i] == '\0') return 0;
    return 1;
}

int rb_http_valid_url_text(const char *url, size_t n)
{
    if (n == 0) return 0;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)url[i] <= 0x20 || url[i] == 0x7f) return 0;
    return 1;
}

/* Length of a header line's name: up to ':' (a value follows) or ';' (curl: empty value). */
static size_t header_name_len(const char *line) { return strcspn(line, ":;"); }

int rb_http_header_is(const char *line, const char *name)
{
    size_t n = header_name_len(line);
    return n == strlen(name) && strncasecmp(line, name, n) == 0;
}

int rb_http_check(const rb_http_request *req, char *err, size_t errlen)
{
    if (req->method && !rb_http_valid_method(req->method, strlen(req->method))) {
        snprintf(err, errlen, "invalid method: a method is 1 to 32 token characters (RFC 9110)");
        return -1;
    }
    if (!req->url || !*req->url) {
        snprintf(err, errlen, "missing url");
        return -1;
    }
    if (!rb_http_valid_url_text(req->url, strlen(req->url))) {
        snprintf(err, errlen, "invalid url: control characters and spaces must be "
                              "percent-encoded");
        return -1;
    }
    for (size_t i = 0; i < req->nheaders; i++) {
        const char *line = req->headers[i];
        size_t n = header_name_len(line);
        char name[64];
        rb_one_line(name, n + 1 < sizeof name ? n + 1 : sizeof name, line);
        if (!line[n] || !rb_http_valid_header_name(line, n)) {
            snprintf(err, errlen, "invalid header name '%s': a name is token characters "
                                  "(RFC 9110)", name);
            return -1;
        }
        const char *v = line + n + 1;
        if (!rb_http_valid_header_value(v, strlen(v)) ||
            (line[n] == ';' && v[strspn(v, " \t")] != '\0')) {
            snprintf(err, errlen, "invalid value of header '%s': CR, LF and NUL are not "
                                  "allowed", name);
            return -1;
        }
        if (rb_http_header_is(line, "content-length") ||
            rb_http_header_is(line, "transfer-encoding")) {
            snprintf(err, errlen, "header '%s' is the transport's: it frames the body itself",
                     name);
            return -1;
        }
    }
    return 0;
}

/* ---- reading what a server sends ---- */

static int is_ows(char c) { return c == ' ' || c == '\t'; }

/* s[0..*n) without its leading and trailing spaces and tabs. */
static const char *trim_ows(const char *s, size_t *n)
{
    while (*n > 0 && is_ows(s[0])) s++, (*n)--;
    while (*n > 0 && is_ows(s[*n - 1])) (*n)--;
    return s;
}

/* The same for a field value, whose CR, LF and NUL become spaces: at its ends they go too. */
static int value_space(char c) { return is_ows(c) || c == '\r' || c == '\n' || c == '\0'; }

static const char *trim_value(const char *s, size_t *n)
{
    while (*n > 0 && value_space(s[0])) s++, (*n)--;
    while (*n > 0 && value_space(s[*n - 1])) (*n)--;
    return s;
}

/* Copies a field value; CR, LF and NUL become spaces (RFC 9110 5.5). */
static void copy_value(char *dst, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = s[i] == '\r' || s[i] == '\n' || s[i] == '\0' ? ' ' : s[i];
}

static void clear_headers(rb_http_response *r)
{
    for (size_t i = 0; i < r->nheaders; i++) free(r->headers[i]);
    r->nheaders = 0;
}

void rb_http_response_clear(rb_http_response *r)
{
    clear_headers(r);
    free(r->headers);
    free(r->body);
    free(r->redirect_url);
    memset(r, 0, sizeof *r);
}

/* An obs-fold line: its text joins the previous header's value, after one space. */
static int continue_header(rb_http_header_parser *p, rb_http_response *r, const char *line,
                           size_t len)
{
    const char *v = trim_value(line, &len);
    if (!p->continuable || r->nheaders == 0 || len == 0) return 0;
    char *prev = r->headers[r->nheaders - 1];
    size_t pl = strlen(prev);
    int sep = prev[pl - 1] != ' ';        /* "Name: " has no value yet */
    if (p->bytes + len + 1 > RB_HTTP_MAX_HEADER_BYTES) return -2;
    char *grown = rb_realloc(prev, pl + (size_t)sep + len + 1);
    if (!grown) return -1;
    if (sep) grown[pl++] = ' ';
    copy_value(grown + pl, v, len);
    grown[pl + len] = '\0';
    r->headers[r->nheaders - 1] = grown;
    p->bytes += len + (size_t)sep;
    return 0;
}

int rb_http_header_line(rb_http_header_parser *p, rb_http_response *r, const char *line,
                        size_t len)
{
    while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) len--;
    if (len == 0) {
        p->continuable = 0;
        return 0;
    }
    if (len >= 5 && memcmp(line, "HTTP/", 5) == 0) {
        clear_headers(r);           /* 100 Continue, or a redirect: only the last counts */
        p->bytes = 0;
        p->continuable = 0;
        return 0;
    }
    if (is_ows(line[0])) return continue_header(p, r, line, len);
    const char *colon = memchr(line, ':', len);
    size_t nl = colon ? (size_t)(colon - line) : 0;
    p->continuable = 0;
    if (!colon || !rb_http_valid_header_name(line, nl)) return 0;
    size_t vl = len - nl - 1;
    const char *v = trim_value(colon + 1, &vl);
    size_t total = nl + 2 + vl;
    if (r->nheaders >= RB_HTTP_MAX_HEADERS || p->bytes + total > RB_HTTP_MAX_HEADER_BYTES)
        return -2;
    if (r->nheaders == p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 16;
        char **hs = rb_realloc(r->headers, cap * sizeof *hs);
        if (!hs) return -1;
        r->headers = hs;
        p->cap = cap;
    }
    char *copy = rb_malloc(total + 1);
    if (!copy) return -1;
    memcpy(copy, line, nl);
    memcpy(copy + nl, ": ", 2);
    copy_value(copy + nl + 2, v, vl);
    copy[total] = '\0';
    r->headers[r->nheaders++] = copy;
    p->bytes += total;
    p->continuable = 1;
    return 0;
}

/* ---- HTTP-dates and Retry-After ---- */

static const char *const day_names[7] = {"Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"};
static const char *const long_day_names[7] = {"Sunday", "Monday", "Tuesday", "Wednesday",
                                              "Thursday", "Friday", "Saturday"};
static const char *const month_names[12] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun",
                                            "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};

/* Days since 1970-01-01 of a proleptic Gregorian date, and back (H. Hinnant's algorithms). */
static int64_t days_from_civil(int64_t y, unsigned m, unsigned d)
{
    y -= m <= 2;
    int64_t era = (y >= 0 ? y : y - 399) / 400;
    unsigned yoe = (unsigned)(y - era * 400);
    unsigned doy = (153 * (m > 2 ? m - 3 : m + 9) + 2) / 5 + d - 1;
    unsigned doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + (int64_t)doe - 719468;
}

static void civil_from_days(int64_t z, int64_t *y, unsigned *m, unsigned *d)
{
    z += 719468;
    int64_t era = (z >= 0 ? z : z - 146096) / 146097;
    unsigned doe = (unsigned)(z - era * 146097);
    unsigned yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    unsigned doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    unsigned mp = (5 * doy + 2) / 153;
    *d = doy - (153 * mp + 2) / 5 + 1;
    *m = mp < 10 ? mp + 3 : mp - 9;
    *y = (int64_t)yoe + era * 400 + (*m <= 2);
}

static unsigned days_in_month(int64_t y, unsigned m)
{
    static const unsigned char n[12] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    int leap = y % 4 == 0 && (y % 100 != 0 || y % 400 == 0);
    return m == 2 && leap ? 29 : n[m - 1];
}

/* A cursor over the text of a date; each reader advances it only on a match. */
typedef struct cursor { const char *p, *end; } cursor;

static int read_lit(cursor *c, const char *s)
{
    size_t n = strlen(s);
    if ((size_t)(c->end - c->p) < n || memcmp(c->p, s, n) != 0) return 0;
    c->p += n;
    return 1;
}

static int read_digits(cursor *c, int n, int *out)
{
    if (c->end - c->p < n) return 0;
    int v = 0;
    for (int i = 0; i < n; i++) {
        if (c->p[i] < '0' || c->p[i] > '9') return 0;
        v = v * 10 + (c->p[i] - '0');
    }
    c->p += n;
    *out = v;
    return 1;
}

static int read_name(cursor *c, const char *const *names, int count, int *out)
{
    for (int i = 0; i < count; i++)
        if (read_lit(c, names[i])) {
            *out = i;
            return 1;
        }
    return 0;
}

static int read_time(cursor *c, int *hh, int *mm, int *ss)
{
    return read_digits(c, 2, hh) && read_lit(c, ":") && read_digits(c, 2, mm) &&
           read_lit(c, ":") && read_digits(c, 2, ss);
}

typedef struct civil { int year, month, day, hh, mm, ss; } civil;

/* "Sun, 06 Nov 1994 08:49:37 GMT" */
static int read_imf_fixdate(cursor c, civil *t)
{
    int wd;
    return read_name(&c, day_names, 7, &wd) && read_lit(&c, ", ") &&
           read_digits(&c, 2, &t->day) && read_lit(&c, " ") &&
           read_name(&c, month_names, 12, &t->month) && read_lit(&c, " ") &&
           read_digits(&c, 4, &t->year) && read_lit(&c, " ") &&
           read_time(&c, &t->hh, &t->mm, &t->ss) && read_lit(&c, " GMT") && c.p == c.end;
}

/* "Sunday, 06-Nov-94 08:49:37 GMT": t->year gets the two digits */
static int read_rfc850_date(cursor c, civil *t)
{
    int wd;
    return read_name(&c, long_day_names, 7, &wd) && read_lit(&c, ", ") &&
           read_digits(&c, 2, &t->day) && read_lit(&c, "-") &&
           read_name(&c, month_names, 12, &t->month) && read_lit(&c, "-") &&
           read_digits(&c, 2, &t->year) && read_lit(&c, " ") &&
           read_time(&c, &t->hh, &t->mm, &t->ss) && read_lit(&c, " GMT") && c.p == c.end;
}

/* "Sun Nov  6 08:49:37 1994" */
static int read_asctime_date(cursor c, civil *t)
{
    int wd;
    if (!(read_name(&c, day_names, 7, &wd) && read_lit(&c, " ") &&
          read_name(&c, month_names, 12, &t->month) && read_lit(&c, " ")))
        return 0;
    if (!(read_digits(&c, 2, &t->day) || (read_lit(&c, " ") && read_digits(&c, 1, &t->day))))
        return 0;
    return read_lit(&c, " ") && read_time(&c, &t->hh, &t->mm, &t->ss) && read_lit(&c, " ") &&
           read_digits(&c, 4, &t->year) && c.p == c.end;
}

/* The year of an epoch time; times that are not finite count as 1970. */
static int64_t year_of(double epoch)
{
    if (!(epoch > -1e13 && epoch < 1e13)) epoch = 0;
    int64_t y;
    unsigned m, d;
    civil_from_days((int64_t)floor(epoch / 86400), &y, &m, &d);
    return y;
}

int rb_http_parse_date(const char *s, size_t n, double now, double *epoch)
{
    cursor c = {s, s + n};
    civil t;
    if (!read_imf_fixdate(c, &t) && !read_asctime_date(c, &t)) {
        if (!read_rfc850_date(c, &t)) return 0;
        /* RFC 9110: a two-digit year more than 50 years ahead is in the past century */
        int64_t this_year = year_of(now);
        int64_t y = this_year - this_year % 100 + t.year;
        if (y > this_year + 50) y -= 100;
        if (y < 0 || y > 9999) return 0;    /* a `now` out of the years of HTTP-dates */
        t.year = (int)y;
    }
    unsigned month = (unsigned)t.month + 1;
    if (t.day < 1 || (unsigned)t.day > days_in_month(t.year, month) || t.hh > 23 ||
        t.mm > 59 || t.ss > 60)
        return 0;
    *epoch = (double)days_from_civil(t.year, month, (unsigned)t.day) * 86400 + t.hh * 3600 +
             t.mm * 60 + t.ss;
    return 1;
}

#define FIRST_DATE (-62167219200.0)     /* 0000-01-01T00:00:00Z */
#define LAST_DATE 253402300799.0        /* 9999-12-31T23:59:59Z */

int rb_http_retry_after(const char *value, double now, double *seconds)
{
    if (!value) return 0;
    size_t n = strlen(value);
    const char *s = trim_ows(value, &n);
    if (n == 0) return 0;
    double d;
    if (strspn(s, "0123456789") >= n) {
        /* delta-seconds: saturate rather than overflow; a huge one is the longest delay */
        d = 0;
        for (size_t i = 0; i < n; i++)
            if (d <= RB_HTTP_MAX_RETRY_AFTER) d = d * 10 + (s[i] - '0');
    } else {
        double at;
        if (!rb_http_parse_date(s, n, now, &at)) return 0;
        d = at - now;
    }
    if (!(d > 0)) d = 0;            /* a date in the past, or a `now` that is not a number */
    if (d > RB_HTTP_MAX_RETRY_AFTER) d = RB_HTTP_MAX_RETRY_AFTER;
    *seconds = d;
    return 1;
}
