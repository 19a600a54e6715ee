/* http_receiver.c -- a small HTTP/1.1 server on libev that the specs start as a child:
 * `http_receiver PORTFILE` listens on a free 127.0.0.1 port, writes it to PORTFILE (or, for
 * "-", prints "PORT PID") and answers the test paths listed above dispatch(). */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>
#include <ev.h>

#define MAX_REQUEST (8 << 20)

typedef struct buf { char *p; size_t len, cap; } buf;

typedef struct conn {
    ev_io io;
    ev_timer slow;
    int fd;
    buf in, out;
    size_t out_off;
    int busy;        /* a request is being answered: parse no more until it is written */
    int hanging;     /* /hang: never answer */
    int close_after; /* Connection: close, or HTTP/1.0 */
    ev_timer later;  /* /push with delay: the answer waiting in `deferred` */
    buf deferred;
    int deferred_status;
    long push_stream; /* index in push_streams while an answer is deferred, else -1 */
} conn;

typedef struct request {
    char method[16], path[1024];
    const char *headers;    /* raw header block, "Name: value\r\n" lines */
    size_t headers_len;
    const char *body;
    size_t body_len;
} request;

/* Counts of POSTs to /count per X-Relaybus-Id. */
typedef struct count { char *id; long n; } count;
static count *counts;
static size_t ncounts;
static long hangs_open, hangs_total, connections;
static buf last_echo;   /* the latest /echo answer, served again by GET /last */

static void conn_update(struct ev_loop *loop, conn *c);

/* ---- buffers ---- */

static int buf_add(buf *b, const char *s, size_t n)
{
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) return -1;
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
    return 0;
}

static void buf_addf(buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void buf_addf(buf *b, const char *fmt, ...)
{
    char tmp[2048];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n > 0) buf_add(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

static void buf_add_json_string(buf *b, const char *s, size_t n)
{
    buf_add(b, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch == '"' || ch == '\\') {
            char esc[2] = {'\\', (char)ch};
            buf_add(b, esc, 2);
        } else if (ch < 0x20) {
            buf_addf(b, "\\u%04x", ch);
        } else {
            buf_add(b, (const char *)&s[i], 1);
        }
    }
    buf_add(b, "\"", 1);
}

/* ---- request parsing ---- */

/* The value of header `name` in the raw block, or NULL; *len set. */
static const char *header_value(const request *r, const char *name, size_t *len)
{
    size_t nl = strlen(name);
    const char *p = r->headers, *end = r->headers + r->headers_len;
    while (p < end) {
        const char *eol = memmem(p, (size_t)(end - p), "\r\n", 2);
        if (!eol) eol = end;
        if ((size_t)(eol - p) > nl && strncasecmp(p, name, nl) == 0 && p[nl] == ':') {
            const char *v = p + nl + 1;
            while (v < eol && (*v == ' ' || *v == '\t')) v++;
            *len = (size_t)(eol - v);
            return v;
        }
        p = eol + 2;
    }
    return NULL;
}

/* Returns bytes consumed by one complete request, 0 when more is needed, -1 when malformed. */
static long parse_request(conn *c, request *r)
{
    char *head_end = memmem(c->in.p, c->in.len, "\r\n\r\n", 4);
    if (!head_end) return c->in.len > 65536 ? -1 : 0;
    char version[16] = "";
    if (sscanf(c->in.p, "%15s %1023s %15s", r->method, r->path, version) != 3) return -1;
    const char *first_eol = strstr(c->in.p, "\r\n");
    r->headers = first_eol + 2;
    r->headers_len = (size_t)(head_end + 2 - r->headers);
    size_t vlen;
    const char *cl = header_value(r, "Content-Length", &vlen);
    long body_len = cl ? strtol(cl, NULL, 10) : 0;
    if (body_len < 0 || body_len > MAX_REQUEST) return -1;
    size_t head_len = (size_t)(head_end + 4 - c->in.p);
    if (c->in.len < head_len + (size_t)body_len) return 0;
    r->body = head_end + 4;
    r->body_len = (size_t)body_len;
    const char *conn_hdr = header_value(r, "Connection", &vlen);
    c->close_after = strcmp(version, "HTTP/1.0") == 0 ||
                     (conn_hdr && vlen == 5 && strncasecmp(conn_hdr, "close", 5) == 0);
    return (long)(head_len + (size_t)body_len);
}

/* ---- responses ---- */

static void respond(conn *c, int status, const char *extra_headers, const char *body,
                    size_t body_len)
{
    buf_addf(&c->out, "HTTP/1.1 %d X\r\nContent-Length: %zu\r\n%s%s\r\n", status, body_len,
             extra_headers ? extra_headers : "", c->close_after ? "Connection: close\r\n" : "");
    buf_add(&c->out, body, body_len);
}

static void respond_buf(conn *c, int status, buf *body)
{
    respond(c, status, "Content-Type: application/json\r\n", body->p ? body->p : "", body->len);
    free(body->p);
}

/* The request as JSON: {"method":, "path":, "body":, "headers": {lower-cased name: value}}. */
static void echo_json(buf *b, const request *r)
{
    buf_add(b, "{\"method\":", 10);
    buf_add_json_string(b, r->method, strlen(r->method));
    buf_add(b, ",\"path\":", 8);
    buf_add_json_string(b, r->path, strlen(r->path));
    buf_add(b, ",\"body\":", 8);
    buf_add_json_string(b, r->body, r->body_len);
    buf_add(b, ",\"headers\":{", 12);
    const char *p = r->headers, *end = r->headers + r->headers_len;
    int first = 1;
    while (p < end) {
        const char *eol = memmem(p, (size_t)(end - p), "\r\n", 2);
        if (!eol) eol = end;
        const char *colon = memchr(p, ':', (size_t)(eol - p));
        if (colon) {
            char name[256];
            size_t nl = (size_t)(colon - p) < sizeof name - 1 ? (size_t)(colon - p) : sizeof name - 1;
            for (size_t i = 0; i < nl; i++) name[i] = (char)tolower((unsigned char)p[i]);
            const char *v = colon + 1;
            while (v < eol && *v == ' ') v++;
            if (!first) buf_add(b, ",", 1);
            first = 0;
            buf_add_json_string(b, name, nl);
            buf_add(b, ":", 1);
            buf_add_json_string(b, v, (size_t)(eol - v));
        }
        p = eol + 2;
    }
    buf_add(b, "}}", 2);
}

static void answer_echo(conn *c, const request *r)
{
    buf b = {0};
    echo_json(&b, r);
    last_echo.len = 0;
    buf_add(&last_echo, b.p, b.len);
    respond_buf(c, 200, &b);
}

static void record_count(const request *r)
{
    size_t len;
    const char *v = header_value(r, "X-Relaybus-Id", &len);
    if (!v) v = "", len = 0;
    for (size_t i = 0; i < ncounts; i++)
        if (strlen(counts[i].id) == len && strncmp(counts[i].id, v, len) == 0) {
            counts[i].n++;
            return;
        }
    count *cs = realloc(counts, (ncounts + 1) * sizeof *cs);
    if (!cs) return;
    counts = cs;
    counts[ncounts].id = strndup(v, len);
    counts[ncounts].n = 1;
    if (counts[ncounts].id) ncounts++;
}

static void answer_counts(conn *c)
{
    buf b = {0};
    buf_add(&b, "{", 1);
    for (size_t i = 0; i < ncounts; i++) {
        if (i) buf_add(&b, ",", 1);
        buf_add_json_string(&b, counts[i].id, strlen(counts[i].id));
        buf_addf(&b, ":%ld", counts[i].n);
    }
    buf_add(&b, "}", 1);
    respond_buf(c, 200, &b);
}

static void answer_big(conn *c, long n)
{
    if (n < 0 || n > (1L << 30)) n = 0;
    char *body = malloc((size_t)n + 1);
    if (!body) {
        respond(c, 500, NULL, "no memory", 9);
        return;
    }
    memset(body, 'x', (size_t)n);
    respond(c, 200, "Content-Type: application/octet-stream\r\n", body, (size_t)n);
    free(body);
}

/* ---- /push: an RFC 8935 receiver ----
 * POST /push/STREAM[?fail=S&reject=S&delay=MS] records the body (a SET) and answers 202 with
 * no body, except: a body containing S of fail=S gets 503 on its first arrival only; one
 * containing S of reject=S always gets 400 with {"err":"invalid_request","description":...};
 * with delay=MS the answer comes MS ms later, and a second request for the same STREAM (the
 * path before '?') arriving while one is unanswered counts as an overlap.
 * GET /pushes returns {"overlaps":N,"log":[{"path":,"body":,"status":},...]} in arrival order. */
typedef struct push_body { char *body; size_t len; long n; } push_body;
typedef struct push_stream { char *path; long inflight; } push_stream;
typedef struct push_entry { char *path, *body; size_t body_len; int status; } push_entry;
static push_body *push_bodies;
static size_t npush_bodies;
static push_stream *push_streams;
static size_t npush_streams;
static push_entry *push_log;
static size_t npush_log;
static long push_overlaps;

/* The value of query parameter `name` (up to '&'), copied into out; 0 when absent. */
static int query_param(const char *query, const char *name, char *out, size_t cap)
{
    size_t nl = strlen(name);
    const char *p = query;
    while (p && *p) {
        if (strncmp(p, name, nl) == 0 && p[nl] == '=') {
            const char *v = p + nl + 1, *e = strchr(v, '&');
            size_t len = e ? (size_t)(e - v) : strlen(v);
            if (len >= cap) len = cap - 1;
            memcpy(out, v, len);
            out[len] = '\0';
            return 1;
        }
        p = strchr(p, '&');
        if (p) p++;
    }
    return 0;
}

static long push_arrivals(const request *r)
{
    for (size_t i = 0; i < npush_bodies; i++)
        if (push_bodies[i].len == r->body_len && memcmp(push_bodies[i].body, r->body, r->body_len) == 0)
            return push_bodies[i].n++;
    push_body *pb = realloc(push_bodies, (npush_bodies + 1) * sizeof *pb);
    if (!pb) return 0;
    push_bodies = pb;
    push_bodies[npush_bodies].body = strndup(r->body, r->body_len);
    push_bodies[npush_bodies].len = r->body_len;
    push_bodies[npush_bodies].n = 1;
    if (push_bodies[npush_bodies].body) npush_bodies++;
    return 0;
}

static long push_stream_index(const char *path, size_t len)
{
    for (size_t i = 0; i < npush_streams; i++)
        if (strlen(push_streams[i].path) == len && strncmp(push_streams[i].path, path, len) == 0)
            return (long)i;
    push_stream *ps = realloc(push_streams, (npush_streams + 1) * sizeof *ps);
    if (!ps) return -1;
    push_streams = ps;
    push_streams[npush_streams].path = strndup(path, len);
    push_streams[npush_streams].inflight = 0;
    if (!push_streams[npush_streams].path) return -1;
    return (long)npush_streams++;
}

static int body_contains(const request *r, const char *needle)
{
    return needle[0] && memmem(r->body, r->body_len, needle, strlen(needle)) != NULL;
}

static void on_push_later(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)revents;
    conn *c = w->data;
    if (c->push_stream >= 0) push_streams[c->push_stream].inflight--;
    c->push_stream = -1;
    buf_add(&c->out, c->deferred.p ? c->deferred.p : "", c->deferred.len);
    c->deferred.len = 0;
    conn_update(loop, c);
}

static void answer_push(struct ev_loop *loop, conn *c, const request *r)
{
    const char *q = strchr(r->path, '?');
    size_t plen = q ? (size_t)(q - r->path) : strlen(r->path);
    char fail[256] = "", reject[256] = "", delay[32] = "";
    if (q) {
        query_param(q + 1, "fail", fail, sizeof fail);
        query_param(q + 1, "reject", reject, sizeof reject);
        query_param(q + 1, "delay", delay, sizeof delay);
    }
    long before = push_arrivals(r);
    int status = 202;
    const char *body = "";
    if (body_contains(r, reject)) {
        status = 400;
        body = "{\"err\":\"invalid_request\",\"description\":\"rejected by the test receiver\"}";
    } else if (before == 0 && body_contains(r, fail)) {
        status = 503;
        body = "unavailable";
    }
    push_entry *pl = realloc(push_log, (npush_log + 1) * sizeof *pl);
    if (pl) {
        push_log = pl;
        push_log[npush_log].path = strndup(r->path, plen);
        push_log[npush_log].body = strndup(r->body, r->body_len);
        push_log[npush_log].body_len = r->body_len;
        push_log[npush_log].status = status;
        if (push_log[npush_log].path && push_log[npush_log].body) npush_log++;
    }
    const char *ctype = status == 400 ? "Content-Type: application/json\r\n" : NULL;
    long ms = delay[0] ? strtol(delay, NULL, 10) : 0;
    if (ms <= 0) {
        respond(c, status, ctype, body, strlen(body));
        return;
    }
    long si = push_stream_index(r->path, plen);
    if (si >= 0) {
        if (push_streams[si].inflight > 0) push_overlaps++;
        push_streams[si].inflight++;
    }
    c->push_stream = si;
    /* build the answer in `out`, then move it aside until the timer fires */
    buf saved = c->out;
    c->out = c->deferred;
    c->out.len = 0;
    respond(c, status, ctype, body, strlen(body));
    c->deferred = c->out;
    c->out = saved;
    ev_timer_set(&c->later, ms / 1000.0, 0.);
    ev_timer_start(loop, &c->later);
}

static void answer_pushes(conn *c)
{
    buf b = {0};
    buf_addf(&b, "{\"overlaps\":%ld,\"log\":[", push_overlaps);
    for (size_t i = 0; i < npush_log; i++) {
        if (i) buf_add(&b, ",", 1);
        buf_add(&b, "{\"path\":", 8);
        buf_add_json_string(&b, push_log[i].path, strlen(push_log[i].path));
        buf_add(&b, ",\"body\":", 8);
        buf_add_json_string(&b, push_log[i].body, push_log[i].body_len);
        buf_addf(&b, ",\"status\":%d}", push_log[i].status);
    }
    buf_add(&b, "]}", 2);
    respond_buf(c, 200, &b);
}

/* ---- /respond: an answer made to order ----
 * /respond?status=N&h=LINE&body=TEXT answers N with each h (repeatable) sent as a raw header
 * line and TEXT as the body, all percent-decoded: so a spec can send any Location, Retry-After,
 * folded or malformed header line, or bytes that are not UTF-8. */
static int hex_digit(char ch)
{
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
}

static void buf_add_decoded(buf *b, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        char ch = s[i];
        if (ch == '%' && i + 2 < n && hex_digit(s[i + 1]) >= 0 && hex_digit(s[i + 2]) >= 0) {
            ch = (char)(hex_digit(s[i + 1]) * 16 + hex_digit(s[i + 2]));
            i += 2;
        } else if (ch == '+') {
            ch = ' ';
        }
        buf_add(b, &ch, 1);
    }
}

static void answer_respond(conn *c, const request *r)
{
    const char *q = strchr(r->path, '?');
    int status = 200;
    buf hdrs = {0}, body = {0};
    for (const char *p = q ? q + 1 : ""; *p;) {
        size_t len = strcspn(p, "&");
        const char *eq = memchr(p, '=', len);
        if (eq) {
            size_t nl = (size_t)(eq - p);
            const char *v = eq + 1;
            size_t vl = len - nl - 1;
            if (nl == 6 && strncmp(p, "status", 6) == 0) {
                status = atoi(v);
            } else if (nl == 1 && p[0] == 'h') {
                buf_add_decoded(&hdrs, v, vl);
                buf_add(&hdrs, "\r\n", 2);
            } else if (nl == 4 && strncmp(p, "body", 4) == 0) {
                buf_add_decoded(&body, v, vl);
            }
        }
        p += len;
        if (*p) p++;
    }
    buf_addf(&c->out, "HTTP/1.1 %d X\r\nContent-Length: %zu\r\n", status, body.len);
    buf_add(&c->out, hdrs.p ? hdrs.p : "", hdrs.len);
    if (c->close_after) buf_add(&c->out, "Connection: close\r\n", 19);
    buf_add(&c->out, "\r\n", 2);
    buf_add(&c->out, body.p ? body.p : "", body.len);
    free(hdrs.p);
    free(body.p);
}

/* ---- /reflect: a receiver that quotes the request back in its error ----
 * /reflect?status=N&pad=K&h=NAME&from=A&len=L&enc=E answers N (default 400) with K dots, then
 * bytes A.. (from 0, L of them, default all) of the value of request header NAME, written as
 * E: raw (default), json (a JSON string's inside: \" \\ \/ escaped, controls and every
 * non-ASCII character as \uXXXX, surrogate pairs above U+FFFF) or pct (each byte outside
 * A-Z a-z 0-9 - . _ ~ as %XX). Without h, the whole request as JSON, as /echo gives it. */
static void add_json_escaped(buf *b, const unsigned char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        unsigned c = s[i], cp = c, k = 1;
        if (c >= 0xf0) {
            k = 4;
            cp = c & 0x07;
        } else if (c >= 0xe0) {
            k = 3;
            cp = c & 0x0f;
        } else if (c >= 0xc0) {
            k = 2;
            cp = c & 0x1f;
        }
        if (i + k > n) {
            k = 1;
            cp = c;
        }
        for (unsigned j = 1; j < k; j++) cp = (cp << 6) | (s[i + j] & 0x3f);
        i += k;
        if (cp == '"' || cp == '\\' || cp == '/') {
            char esc[2] = {'\\', (char)cp};
            buf_add(b, esc, 2);
        } else if (cp >= 0x20 && cp < 0x7f) {
            char ch = (char)cp;
            buf_add(b, &ch, 1);
        } else if (cp >= 0x10000) {
            cp -= 0x10000;
            buf_addf(b, "\\u%04x\\u%04x", 0xd800 + (cp >> 10), 0xdc00 + (cp & 0x3ff));
        } else {
            buf_addf(b, "\\u%04x", cp);
        }
    }
}

static void answer_reflect(conn *c, const request *r)
{
    const char *q = strchr(r->path, '?');
    q = q ? q + 1 : "";
    char v[64], name[128] = "", enc[16] = "raw";
    int status = query_param(q, "status", v, sizeof v) ? atoi(v) : 400;
    long pad = query_param(q, "pad", v, sizeof v) ? strtol(v, NULL, 10) : 0;
    long from = query_param(q, "from", v, sizeof v) ? strtol(v, NULL, 10) : 0;
    long len = query_param(q, "len", v, sizeof v) ? strtol(v, NULL, 10) : -1;
    query_param(q, "h", name, sizeof name);
    query_param(q, "enc", enc, sizeof enc);
    buf b = {0};
    for (long i = 0; i < pad && i < (1L << 20); i++) buf_add(&b, ".", 1);
    if (!name[0]) {
        echo_json(&b, r);
    } else {
        size_t vl = 0;
        const char *hv = header_value(r, name, &vl);
        if (!hv) hv = "";
        size_t a = from < 0 ? 0 : (size_t)from > vl ? vl : (size_t)from;
        size_t n = len < 0 || (size_t)len > vl - a ? vl - a : (size_t)len;
        const unsigned char *p = (const unsigned char *)hv + a;
        if (strcmp(enc, "json") == 0) {
            add_json_escaped(&b, p, n);
        } else if (strcmp(enc, "pct") == 0) {
            for (size_t i = 0; i < n; i++) {
                if (isalnum(p[i]) || strchr("-._~", p[i])) buf_add(&b, (const char *)&p[i], 1);
                else buf_addf(&b, "%%%02X", p[i]);
            }
        } else {
            buf_add(&b, (const char *)p, n);
        }
    }
    respond(c, status, "Content-Type: text/plain\r\n", b.p ? b.p : "", b.len);
    free(b.p);
}

static void on_slow(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)revents;
    conn *c = w->data;
    respond(c, 200, NULL, "slow", 4);
    conn_update(loop, c);
}

/* Answers one parsed request; leaves c->busy set while an answer is still to come.
 *   /status/N        answers N                /retry-after/N  503 with Retry-After: N
 *   /hang            never answers            /big/N          N bytes of body
 *   /slow/MS         200 after MS ms          /echo           the request as JSON
 *   /count           counts POSTs per X-Relaybus-Id; GET /counts returns {id: n}
 *   /last            the latest /echo answer  /repeat         a header sent twice
 *   /redirect/N      302 to /status/N      /loop           302 to itself
 *   /chain/N         302 to /chain/N-1, and /chain/0 answers 200: N redirects
 *   /respond?...     an answer made to order (status=, h=, body=; see answer_respond)
 *   /stats           {hangs_open, hangs_total, connections}: cuts and connection reuse
 *   /push/STREAM     an RFC 8935 receiver (202; fail=, reject=, delay=); GET /pushes: the log
 *   /reflect?...     an error quoting a request header or the request (see answer_reflect) */
static void dispatch(struct ev_loop *loop, conn *c, const request *r)
{
    long n = 0;
    char hdr[64];
    c->busy = 1;
    if (sscanf(r->path, "/status/%ld", &n) == 1) {
        respond(c, (int)n, NULL, "status", 6);
    } else if (sscanf(r->path, "/retry-after/%ld", &n) == 1) {
        snprintf(hdr, sizeof hdr, "Retry-After: %ld\r\n", n);
        respond(c, 503, hdr, "busy", 4);
    } else if (strcmp(r->path, "/hang") == 0) {
        c->hanging = 1;
        hangs_open++;
        hangs_total++;
    } else if (sscanf(r->path, "/big/%ld", &n) == 1) {
        answer_big(c, n);
    } else if (sscanf(r->path, "/slow/%ld", &n) == 1) {
        ev_timer_set(&c->slow, n / 1000.0, 0.);
        ev_timer_start(loop, &c->slow);
    } else if (strcmp(r->path, "/echo") == 0) {
        answer_echo(c, r);
    } else if (strcmp(r->path, "/count") == 0) {
        if (strcmp(r->method, "POST") == 0) record_count(r);
        respond(c, 200, NULL, "ok", 2);
    } else if (strcmp(r->path, "/counts") == 0) {
        answer_counts(c);
    } else if (strcmp(r->path, "/stats") == 0) {
        buf b = {0};
        buf_addf(&b, "{\"hangs_open\":%ld,\"hangs_total\":%ld,\"connections\":%ld}",
                 hangs_open, hangs_total, connections);
        respond_buf(c, 200, &b);
    } else if (sscanf(r->path, "/redirect/%ld", &n) == 1) {
        snprintf(hdr, sizeof hdr, "Location: /status/%ld\r\n", n);
        respond(c, 302, hdr, "moved", 5);
    } else if (strcmp(r->path, "/loop") == 0) {
        respond(c, 302, "Location: /loop\r\n", "again", 5);
    } else if (sscanf(r->path, "/chain/%ld", &n) == 1) {
        if (n <= 0) {
            respond(c, 200, NULL, "end", 3);
        } else {
            snprintf(hdr, sizeof hdr, "Location: /chain/%ld\r\n", n - 1);
            respond(c, 302, hdr, "next", 4);
        }
    } else if (strncmp(r->path, "/respond", 8) == 0 && (r->path[8] == '?' || !r->path[8])) {
        answer_respond(c, r);
    } else if (strcmp(r->path, "/last") == 0) {
        respond(c, 200, "Content-Type: application/json\r\n", last_echo.len ? last_echo.p : "{}",
                last_echo.len ? last_echo.len : 2);
    } else if (strncmp(r->path, "/push/", 6) == 0 && strcmp(r->method, "POST") == 0) {
        answer_push(loop, c, r);
    } else if (strcmp(r->path, "/pushes") == 0) {
        answer_pushes(c);
    } else if (strncmp(r->path, "/reflect", 8) == 0 && (r->path[8] == '?' || !r->path[8])) {
        answer_reflect(c, r);
    } else if (strcmp(r->path, "/repeat") == 0) {
        respond(c, 200, "X-Multi: a\r\nX-Multi: b\r\n", "ok", 2);
    } else {
        respond(c, 404, NULL, "not found", 9);
    }
}

/* ---- connections ---- */

static void conn_close(struct ev_loop *loop, conn *c)
{
    if (c->hanging) hangs_open--;
    ev_io_stop(loop, &c->io);
    ev_timer_stop(loop, &c->slow);
    ev_timer_stop(loop, &c->later);
    if (c->push_stream >= 0) push_streams[c->push_stream].inflight--;
    free(c->deferred.p);
    close(c->fd);
    free(c->in.p);
    free(c->out.p);
    free(c);
}

/* Parses the next buffered request when the previous one has been answered. */
static int conn_process(struct ev_loop *loop, conn *c)
{
    while (!c->busy && c->in.len > 0) {
        request r;
        long used = parse_request(c, &r);
        if (used < 0) return -1;
        if (used == 0) return 0;
        dispatch(loop, c, &r);
        memmove(c->in.p, c->in.p + used, c->in.len - (size_t)used);
        c->in.len -= (size_t)used;
    }
    return 0;
}

/* Writes what it can; returns -1 when the connection should close. */
static int conn_flush(conn *c)
{
    while (c->out_off < c->out.len) {
        ssize_t n = write(c->fd, c->out.p + c->out_off, c->out.len - c->out_off);
        if (n < 0) return errno == EAGAIN || errno == EINTR ? 0 : -1;
        c->out_off += (size_t)n;
    }
    if (c->out.len > 0 && c->out_off == c->out.len) {
        c->out.len = c->out_off = 0;
        c->busy = 0;
        if (c->close_after) return -1;
    }
    return 0;
}

/* After any change: write, then parse what is buffered, then watch for what is needed. */
static void conn_update(struct ev_loop *loop, conn *c)
{
    for (;;) {
        if (conn_flush(c) < 0) { conn_close(loop, c); return; }
        if (c->busy) break;
        size_t before = c->in.len;
        if (conn_process(loop, c) < 0) { conn_close(loop, c); return; }
        if (c->in.len == before && c->out.len == 0) break;
    }
    int events = EV_READ | (c->out_off < c->out.len ? EV_WRITE : 0);
    if (events != (c->io.events & (EV_READ | EV_WRITE))) {
        ev_io_stop(loop, &c->io);
        ev_io_set(&c->io, c->fd, events);
        ev_io_start(loop, &c->io);
    }
}

static void on_conn(struct ev_loop *loop, ev_io *w, int revents)
{
    conn *c = (conn *)w;
    if (revents & EV_READ) {
        char tmp[65536];
        ssize_t n = read(c->fd, tmp, sizeof tmp);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
            conn_close(loop, c);
            return;
        }
        if (n > 0 && (c->in.len + (size_t)n > MAX_REQUEST + 65536 ||
                      buf_add(&c->in, tmp, (size_t)n) < 0)) {
            conn_close(loop, c);
            return;
        }
    }
    conn_update(loop, c);
}

static void on_accept(struct ev_loop *loop, ev_io *w, int revents)
{
    (void)revents;
    int fd = accept4(w->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;
    conn *c = calloc(1, sizeof *c);
    if (!c) {
        close(fd);
        return;
    }
    connections++;
    c->fd = fd;
    ev_io_init(&c->io, on_conn, fd, EV_READ);
    ev_init(&c->slow, on_slow);
    c->slow.data = c;
    ev_init(&c->later, on_push_later);
    c->later.data = c;
    c->push_stream = -1;
    ev_io_start(loop, &c->io);
}

/* ---- start-up ---- */

static int listen_loopback(int *port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t alen = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) < 0 || listen(fd, 512) < 0 ||
        getsockname(fd, (struct sockaddr *)&a, &alen) < 0)
        return -1;
    *port = ntohs(a.sin_port);
    return fd;
}

/* Written under a temporary name, then renamed: a reader never sees half a port. PORTFILE
 * "-" prints "PORT PID" on stdout instead, for a spec that reads it through io.popen. */
static int write_portfile(const char *path, int port)
{
    if (strcmp(path, "-") == 0) {
        printf("%d %ld\n", port, (long)getpid());
        return fflush(stdout) == 0 ? 0 : -1;
    }
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) return -1;
    fprintf(f, "%d\n", port);
    if (fclose(f) != 0) return -1;
    return rename(tmp, path);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: http_receiver PORTFILE|-\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    /* a spec that dies without stopping us must not leave a server behind */
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    int port;
    int fd = listen_loopback(&port);
    if (fd < 0 || write_portfile(argv[1], port) < 0) {
        perror("http_receiver");
        return 1;
    }
    struct ev_loop *loop = ev_default_loop(0);
    ev_io lw;
    ev_io_init(&lw, on_accept, fd, EV_READ);
    ev_io_start(loop, &lw);
    ev_run(loop, 0);
    return 0;
}
