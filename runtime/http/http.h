/* http.h -- the HTTP transport: libcurl's multi interface driven by the host's libev loop.
 *
 * No thread and no blocking call: curl's sockets are ev_io watchers and its timeout one
 * ev_timer. A transfer ends with exactly one callback, unless it is cancelled first with
 * rb_http_cancel (then never). Connections are reused across transfers of one transport.
 * Also the parsing the transport does on what a server sends (header lines, Retry-After,
 * HTTP-dates), exposed so it can be tested and fuzzed on its own. */
#ifndef RB_HTTP_H
#define RB_HTTP_H

#include <stddef.h>
#include <ev.h>

typedef struct rb_http rb_http;
typedef struct rb_http_transfer rb_http_transfer;

/* At most this many redirects are followed for one request. */
#define RB_HTTP_MAX_REDIRECTS 10
/* The longest delay a Retry-After gives: 30 days, in s. */
#define RB_HTTP_MAX_RETRY_AFTER 2592000.0

typedef struct rb_http_request {
    const char *method;             /* NULL = "GET", or "POST" when body is set; a token */
    const char *url;                /* http or https; no control character or space */
    const char *const *headers;     /* "Name: value" lines ("Name;" sends an empty value) */
    size_t nheaders;
    const char *body;               /* may be NULL */
    size_t body_len;
    double timeout;                 /* s for the whole request, redirects included; 0 = 30 */
    size_t max_body;                /* response body limit in bytes; 0 = 16 MiB */
    int truncate_body;              /* a body over max_body: keep its start, stop reading and
                                     * answer (resp.truncated) instead of failing */
    /* Follow 301, 302, 303, 307 and 308 to http(s) URLs, at most RB_HTTP_MAX_REDIRECTS
     * times. 307/308 repeat the method and body; 301/302/303 continue as GET without a body
     * (a HEAD stays a HEAD). Once a hop leaves the request's origin (scheme, host and port),
     * the URL's user-info and every header of the caller except Content-Type, Accept and
     * User-Agent are dropped for the rest of the chain. 0 by default. */
    int follow_redirects;
} rb_http_request;

typedef struct rb_http_response {
    long status;
    char **headers;                 /* "Name: value" lines of the final response */
    size_t nheaders;
    char *body;
    size_t body_len;
    int truncated;                  /* the body was cut at max_body (truncate_body) */
    char *redirect_url;             /* a 3xx's Location as an absolute URL, or NULL */
} rb_http_response;

/* err: one-line message for failures below HTTP ("connection refused", "timed out", ...);
 * resp is valid only during the callback. */
typedef void (*rb_http_cb)(void *ud, const char *err, const rb_http_response *resp);

rb_http *rb_http_new(struct ev_loop *loop);
/* Returns NULL (and calls nothing) when the request is invalid (rb_http_check), the URL
 * cannot be used (not http or https, no host), curl refuses the transfer or memory ran out;
 * err filled with one line that never holds the URL's password. The callback comes from the
 * loop, never before rb_http_start returns. */
rb_http_transfer *rb_http_start(rb_http *h, const rb_http_request *req, rb_http_cb cb, void *ud,
                                char *err, size_t errlen);
/* Stops a transfer; its callback is never called. */
void rb_http_cancel(rb_http_transfer *t);
/* Ends every open transfer, calling each callback with err = reason. */
void rb_http_cut_all(rb_http *h, const char *reason);
size_t rb_http_active(rb_http *h);
void rb_http_free(rb_http *h);

/* ---- what a request may hold: nothing that could end a line or a field early ---- */

/* 1 when s[0..n) is an HTTP token (RFC 9110 tchar) of 1 to 32 characters. */
int rb_http_valid_method(const char *s, size_t n);
/* 1 when s[0..n) is a token: a field name. */
int rb_http_valid_header_name(const char *s, size_t n);
/* 1 when s[0..n) holds no CR, LF or NUL: a field value. */
int rb_http_valid_header_value(const char *s, size_t n);
/* 1 when url[0..n) is non-empty and holds no control character, space or DEL. */
int rb_http_valid_url_text(const char *url, size_t n);
/* 0 when the method, the header lines and the URL's text are valid (above), and no header
 * is Content-Length or Transfer-Encoding (the transport frames the body itself); else -1
 * with one line in err, naming what is wrong but never quoting a value or the URL. */
int rb_http_check(const rb_http_request *req, char *err, size_t errlen);
/* 1 when the header line ("Name: value", or curl's "Name;" for an empty value) names `name`,
 * in any case. */
int rb_http_header_is(const char *line, const char *name);

/* ---- parsing what a server sends ---- */

/* Limits on the header lines kept of one response (curl already caps one line at 100 KiB). */
#define RB_HTTP_MAX_HEADERS 1000
#define RB_HTTP_MAX_HEADER_BYTES ((size_t)256 << 10)

/* The state of reading one transfer's header lines; zero it before the first. */
typedef struct rb_http_header_parser {
    size_t cap;                     /* room in the response's header array */
    size_t bytes;                   /* bytes kept for the current response */
    int continuable;                /* the last line was kept: an obs-fold line extends it */
} rb_http_header_parser;

/* Adds one header line of a response as curl hands it over (line ending included or not) to
 * r: a status line starts a new response, dropping the headers so far; a line that continues
 * the previous one (obs-fold) is joined to it with a space; a line without a token name and a
 * colon is ignored. Stored
 * lines are "Name: value" with the value's surrounding spaces and tabs taken off and any CR,
 * LF or NUL in it replaced by a space. Returns 0; -1 when out of memory; -2 when the response
 * would exceed RB_HTTP_MAX_HEADERS lines or RB_HTTP_MAX_HEADER_BYTES. */
int rb_http_header_line(rb_http_header_parser *p, rb_http_response *r, const char *line,
                        size_t len);
/* Frees r's headers, body and redirect_url and zeroes it. */
void rb_http_response_clear(rb_http_response *r);

/* Epoch seconds of an HTTP-date (RFC 9110: IMF-fixdate, or the obsolete RFC 850 and asctime
 * forms; a two-digit year is placed in the century that puts it at most 50 years after
 * `now`). Returns 1 and sets *epoch, or 0 when s[0..n) is not an HTTP-date. */
int rb_http_parse_date(const char *s, size_t n, double now, double *epoch);
/* The delay a Retry-After value asks for, in s from `now` (epoch s): delta-seconds (1*DIGIT)
 * or an HTTP-date, clamped to [0, RB_HTTP_MAX_RETRY_AFTER]; surrounding spaces and tabs are
 * ignored. Returns 1 and sets *seconds, or 0 when value is NULL or neither form. */
int rb_http_retry_after(const char *value, double now, double *seconds);

#endif
