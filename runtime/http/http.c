/* http.c -- the HTTP transport: one libcurl multi handle per rb_http, driven by the host's
 * libev loop. curl tells us which sockets to watch (one ev_io each) and when to wake it (one
 * ev_timer); we call curl_multi_socket_action on events and collect finished transfers.
 * Redirects are followed here, not by curl, hop by hop on the same easy handle, so each hop's
 * headers are chosen anew (curl would send a caller's custom headers to any host). Also the
 * HMAC and the constant-time comparison webhooks need, from OpenSSL, which curl loads anyway.
 * This file is the HTTP plugin (plugin.h); what requests and responses may hold is
 * http_text.c. */
#include <ctype.h>
#include <pthread.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <curl/curl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include "http/http.h"
#include "util/alloc.h"
#include "util/buf.h"
#include "util/timer.h"
#include "util/clock.h"
#include "util/text.h"
#include "plugin/plugin.h"
#include "util/check.h"

#define DEFAULT_TIMEOUT 30.0
#define DEFAULT_MAX_BODY ((size_t)16 << 20)

/* Open transfers sit on a circular list with a sentinel, so one can unlink itself without
 * knowing which list holds it (cut_all moves them to a private list while it ends them). */
typedef struct tlink { struct tlink *prev, *next; } tlink;

struct rb_http {
    struct ev_loop *loop;
    CURLM *multi;
    rb_timer timer;
    tlink open;
    size_t active;
};

struct rb_http_transfer {
    tlink node;                  /* first member: a tlink* is a transfer* */
    rb_http *h;
    CURL *easy;
    rb_http_cb cb;
    void *ud;
    /* the request, owned: a redirect builds the next hop from it */
    char *method;                /* NULL: GET, or POST with a body */
    char *url;                   /* this hop's */
    char *body;                  /* NULL: no body */
    size_t body_len;
    char **headers;              /* the caller's lines */
    size_t nheaders;
    struct curl_slist *req_headers;     /* this hop's lines, as sent */
    double timeout, deadline;    /* the whole request's; deadline on the monotonic clock */
    size_t max_body;
    int truncate, follow;
    /* redirects */
    int hops;
    int foreign;                 /* a hop left the first origin: credentials stay behind */
    int body_dropped;            /* a 301/302/303 turned the request into a GET */
    char *origin;                /* "scheme://host:port" of the first URL */
    char *user, *password;       /* the first URL's user-info, for hops within its origin */
    /* this hop's response */
    int body_started, discarding;   /* discarding: the body of a redirect we follow */
    size_t discarded;
    int body_exceeded, headers_exceeded, oom;
    rb_http_response resp;
    rb_http_header_parser hp;
    rb_buf body_in;              /* this hop's response body as it arrives; resp.body at the end */
    char fail[200];              /* why a redirect could not be followed */
    char errbuf[CURL_ERROR_SIZE];
};

/* One watched socket; curl keeps the pointer for us with curl_multi_assign. */
typedef struct sockw {
    ev_io io;
    rb_http *h;
} sockw;

static void check_done(rb_http *h);

/* ---- lists ---- */

static void list_init(tlink *l) { l->prev = l->next = l; }
static int list_empty(const tlink *l) { return l->next == l; }

static void list_push(tlink *l, tlink *n)
{
    n->prev = l->prev;
    n->next = l;
    l->prev->next = n;
    l->prev = n;
}

static void list_unlink(tlink *n)
{
    n->prev->next = n->next;
    n->next->prev = n->prev;
    list_init(n);
}

/* Moves every node of src to dst (empty), leaving src empty. */
static void list_move_all(tlink *src, tlink *dst)
{
    list_init(dst);
    if (list_empty(src)) return;
    dst->next = src->next;
    dst->prev = src->prev;
    dst->next->prev = dst;
    dst->prev->next = dst;
    list_init(src);
}

/* ---- the loop glue ---- */

static void on_socket_event(struct ev_loop *loop, ev_io *w, int revents)
{
    (void)loop;
    sockw *s = (sockw *)w;
    rb_http *h = s->h;
    int flags = (revents & EV_READ ? CURL_CSELECT_IN : 0) |
                (revents & EV_WRITE ? CURL_CSELECT_OUT : 0);
    int running;
    /* s may be freed inside this call (CURL_POLL_REMOVE): do not touch it afterwards */
    curl_multi_socket_action(h->multi, w->fd, flags, &running);
    check_done(h);
}

static void on_timer(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop;
    (void)revents;
    rb_http *h = w->data;
    int running;
    curl_multi_socket_action(h->multi, CURL_SOCKET_TIMEOUT, 0, &running);
    check_done(h);
}

/* CURLMOPT_TIMERFUNCTION: curl must not be re-entered from here, so only arm the timer. */
static int set_timer(CURLM *multi, long timeout_ms, void *userp)
{
    (void)multi;
    rb_http *h = userp;
    rb_timer_stop(h->loop, &h->timer);
    if (timeout_ms >= 0) {
        rb_timer_set(&h->timer, timeout_ms / 1000.0, 0.);
        rb_timer_start(h->loop, &h->timer);
    }
    return 0;
}

/* CURLMOPT_SOCKETFUNCTION: start, change or stop the ev_io of one socket. */
static int set_socket(CURL *easy, curl_socket_t fd, int what, void *userp, void *socketp)
{
    (void)easy;
    rb_http *h = userp;
    sockw *s = socketp;
    if (what == CURL_POLL_REMOVE) {
        if (s) {
            ev_io_stop(h->loop, &s->io);
            curl_multi_assign(h->multi, fd, NULL);
            free(s);
        }
        return 0;
    }
    if (!s) {
        s = rb_calloc(1, sizeof *s);
        if (!s) return -1;      /* curl fails the transfer: an error, not a crash */
        s->h = h;
        ev_init(&s->io, on_socket_event);
        curl_multi_assign(h->multi, fd, s);
    }
    int events = (what & CURL_POLL_IN ? EV_READ : 0) | (what & CURL_POLL_OUT ? EV_WRITE : 0);
    ev_io_stop(h->loop, &s->io);
    ev_io_set(&s->io, fd, events);
    ev_io_start(h->loop, &s->io);
    return 0;
}

/* ---- the transport ---- */

/* curl_global_init is not thread-safe: once per process, whichever runtime comes first. */
static void curl_init(void) { curl_global_init(CURL_GLOBAL_DEFAULT); }

static void global_init_once(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, curl_init);
}

rb_http *rb_http_new(struct ev_loop *loop)
{
    global_init_once();
    rb_http *h = rb_calloc(1, sizeof *h);
    if (!h) return NULL;
    h->multi = curl_multi_init();
    if (!h->multi) {
        free(h);
        return NULL;
    }
    h->loop = loop;
    list_init(&h->open);
    rb_timer_init(&h->timer, on_timer, 0, 0);
    h->timer.w.data = h;
    curl_multi_setopt(h->multi, CURLMOPT_SOCKETFUNCTION, set_socket);
    curl_multi_setopt(h->multi, CURLMOPT_SOCKETDATA, h);
    curl_multi_setopt(h->multi, CURLMOPT_TIMERFUNCTION, set_timer);
    curl_multi_setopt(h->multi, CURLMOPT_TIMERDATA, h);
    return h;
}

size_t rb_http_active(rb_http *h) { return h ? h->active : 0; }

/* ---- receiving ---- */

static int followable(long status)
{
    return status == 301 || status == 302 || status == 303 || status == 307 || status == 308;
}

/* The value of the first header named `name` in r, or NULL. */
static const char *find_header(const rb_http_response *r, const char *name)
{
    size_t n = strlen(name);
    for (size_t i = 0; i < r->nheaders; i++)
        if (strncasecmp(r->headers[i], name, n) == 0 && r->headers[i][n] == ':')
            return r->headers[i] + n + 2;
    return NULL;
}

/* The absolute URL a Location names, relative ones resolved against base (free() it); NULL
 * when it is no URL. Any scheme is read, so the caller can name the one it refuses. */
static char *resolve_location(const char *base, const char *location)
{
    CURLU *u = curl_url();
    char *full = NULL, *copy = NULL;
    if (u && curl_url_set(u, CURLUPART_URL, base, 0) == CURLUE_OK &&
        curl_url_set(u, CURLUPART_URL, location, CURLU_NON_SUPPORT_SCHEME) == CURLUE_OK &&
        curl_url_get(u, CURLUPART_URL, &full, 0) == CURLUE_OK && full)
        copy = rb_strdup(full);
    curl_free(full);
    curl_url_cleanup(u);
    return copy;
}

static size_t on_body(char *data, size_t size, size_t n, void *ud)
{
    rb_http_transfer *t = ud;
    size_t len = size * n;
    rb_http_response *r = &t->resp;
    if (!t->body_started) {
        long status = 0;
        curl_easy_getinfo(t->easy, CURLINFO_RESPONSE_CODE, &status);
        t->body_started = 1;
        t->discarding = t->follow && followable(status) && find_header(r, "location");
    }
    if (t->discarding) {
        /* the body of a redirect we follow is nobody's; a long one is not worth reading */
        t->discarded += len;
        return t->discarded > t->max_body ? 0 : len;
    }
    int cut = 0;
    if (len > t->max_body - t->body_in.len) {
        if (!t->truncate) {
            t->body_exceeded = 1;
            return 0;           /* curl ends the transfer with CURLE_WRITE_ERROR */
        }
        len = t->max_body - t->body_in.len;
        cut = 1;
    }
    rb_buf_add(&t->body_in, data, len);
    if (rb_buf_failed(&t->body_in)) {
        t->oom = 1;
        return 0;
    }
    if (cut) {
        r->truncated = 1;       /* stop reading: the start is all the caller wants */
        return 0;
    }
    return size * n;
}

static size_t on_header(char *data, size_t size, size_t n, void *ud)
{
    rb_http_transfer *t = ud;
    size_t len = size * n;
    int rc = rb_http_header_line(&t->hp, &t->resp, data, len);
    if (rc == -1) t->oom = 1;
    if (rc == -2) t->headers_exceeded = 1;
    return rc == 0 ? len : 0;
}

/* ---- starting ---- */

static int is_http_scheme(const char *scheme)
{
    return strcasecmp(scheme, "http") == 0 || strcasecmp(scheme, "https") == 0;
}

/* "scheme://host:port" of u, lower-cased, with the scheme's default port; NULL on failure. */
static char *origin_of(CURLU *u)
{
    char *scheme = NULL, *host = NULL, *port = NULL, *o = NULL;
    if (curl_url_get(u, CURLUPART_SCHEME, &scheme, 0) == CURLUE_OK &&
        curl_url_get(u, CURLUPART_HOST, &host, 0) == CURLUE_OK &&
        curl_url_get(u, CURLUPART_PORT, &port, CURLU_DEFAULT_PORT) == CURLUE_OK) {
        size_t n = strlen(scheme) + strlen(host) + strlen(port) + 5;
        if ((o = rb_malloc(n))) {
            snprintf(o, n, "%s://%s:%s", scheme, host, port);
            for (char *p = o; *p; p++) *p = (char)tolower((unsigned char)*p);
        }
    }
    curl_free(scheme);
    curl_free(host);
    curl_free(port);
    return o;
}

/* A copy of one part of u (free() it), or NULL when u has none. */
static char *url_part(CURLU *u, CURLUPart what)
{
    char *s = NULL, *copy = NULL;
    if (curl_url_get(u, what, &s, 0) == CURLUE_OK && s) copy = rb_strdup(s);
    curl_free(s);
    return copy;
}

/* Parses the first URL: http or https only; keeps its origin and user-info for redirects. */
static int check_url(rb_http_transfer *t, char *err, size_t errlen)
{
    CURLU *u = curl_url();
    char *scheme = NULL;
    int ok = u && curl_url_set(u, CURLUPART_URL, t->url, 0) == CURLUE_OK &&
             curl_url_get(u, CURLUPART_SCHEME, &scheme, 0) == CURLUE_OK;
    if (!ok) {
        char shown[256], line[256];
        rb_redact_url(shown, sizeof shown, t->url);
        snprintf(err, errlen, "invalid url: %s", rb_one_line(line, 200, shown));
    } else if (!is_http_scheme(scheme)) {
        char line[64];
        snprintf(err, errlen, "unsupported scheme: %s", rb_one_line(line, 50, scheme));
        ok = 0;
    } else if (!(t->origin = origin_of(u))) {
        snprintf(err, errlen, "invalid url: no host");
        ok = 0;
    } else {
        t->user = url_part(u, CURLUPART_USER);
        t->password = url_part(u, CURLUPART_PASSWORD);
    }
    curl_free(scheme);
    curl_url_cleanup(u);
    return ok ? 0 : -1;
}

static int append_header(rb_http_transfer *t, const char *line)
{
    struct curl_slist *next = curl_slist_append(t->req_headers, line);
    if (!next) return -1;       /* the list so far is freed with the transfer */
    t->req_headers = next;
    return 0;
}

/* What a request to another origin keeps of the caller's headers: nothing that could be a
 * credential (Authorization, Cookie, an API key under any name). */
static int kept_across_origins(const char *line)
{
    return rb_http_header_is(line, "content-type") || rb_http_header_is(line, "accept") ||
           rb_http_header_is(line, "user-agent");
}

static int describes_body(const char *line)
{
    static const char *const names[] = {"content-type", "content-length", "content-encoding",
                                        "content-language", "content-location",
                                        "transfer-encoding", NULL};
    for (int i = 0; names[i]; i++)
        if (rb_http_header_is(line, names[i])) return 1;
    return 0;
}

/* This hop's request headers. "Expect:" stops curl from waiting for 100-continue on big
 * bodies, and "Content-Type:" stops it from labelling a body as a form the caller never said
 * it was. */
static int build_headers(rb_http_transfer *t)
{
    int has_type = 0;
    curl_slist_free_all(t->req_headers);
    t->req_headers = NULL;
    if (append_header(t, "Expect:") != 0) return -1;
    for (size_t i = 0; i < t->nheaders; i++) {
        const char *line = t->headers[i];
        if (t->foreign && !kept_across_origins(line)) continue;
        if (!t->body && t->body_dropped && describes_body(line)) continue;
        if (rb_http_header_is(line, "content-type")) has_type = 1;
        if (append_header(t, line) != 0) return -1;
    }
    return has_type ? 0 : append_header(t, "Content-Type:");
}

static void set_method_and_body(rb_http_transfer *t)
{
    CURL *e = t->easy;
    const char *method = t->method ? t->method : (t->body ? "POST" : "GET");
    if (t->body || strcasecmp(method, "POST") == 0) {
        curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)t->body_len);
        curl_easy_setopt(e, CURLOPT_POSTFIELDS, t->body ? t->body : "");
    }
    if (strcasecmp(method, "HEAD") == 0)
        curl_easy_setopt(e, CURLOPT_NOBODY, 1L);
    else if (strcasecmp(method, "GET") != 0 || t->body)
        curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, method);
}

/* Sets every option of the easy handle for the transfer's current URL, method and body: the
 * first hop and each redirect alike. curl never follows a redirect itself, so the headers of
 * each hop are ours to choose. */
static int configure_hop(rb_http_transfer *t)
{
    CURL *e = t->easy;
    curl_easy_reset(e);
    if (build_headers(t) != 0) return -1;
    double left_ms = (t->deadline - rb_monotonic()) * 1000;
    long ms = left_ms < 1 ? 1 : left_ms > (double)LONG_MAX ? LONG_MAX : (long)ceil(left_ms);
    curl_easy_setopt(e, CURLOPT_URL, t->url);
    curl_easy_setopt(e, CURLOPT_PRIVATE, t);
    curl_easy_setopt(e, CURLOPT_ERRORBUFFER, t->errbuf);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(e, CURLOPT_FOLLOWLOCATION, 0L);
    curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, ms);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, t);
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, t);
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, t->req_headers);
    curl_easy_setopt(e, CURLOPT_USERAGENT, "relaybus");
    set_method_and_body(t);
    return 0;
}

static void transfer_free(rb_http_transfer *t)
{
    if (t->easy) curl_easy_cleanup(t->easy);
    curl_slist_free_all(t->req_headers);
    for (size_t i = 0; i < t->nheaders; i++) free(t->headers[i]);
    free(t->headers);
    free(t->method);
    free(t->url);
    free(t->body);
    free(t->origin);
    free(t->user);
    free(t->password);
    rb_http_response_clear(&t->resp);
    rb_buf_free(&t->body_in);
    free(t);
}

/* The transfer keeps its own copy of the request: a redirect sends it again. */
static int copy_request(rb_http_transfer *t, const rb_http_request *req)
{
    if (req->method && !(t->method = rb_strdup(req->method))) return -1;
    if (!(t->url = rb_strdup(req->url))) return -1;
    if (req->body) {
        if (!(t->body = rb_malloc(req->body_len ? req->body_len : 1))) return -1;
        memcpy(t->body, req->body, req->body_len);
        t->body_len = req->body_len;
    }
    if (req->nheaders) {
        if (!(t->headers = rb_calloc(req->nheaders, sizeof *t->headers))) return -1;
        for (; t->nheaders < req->nheaders; t->nheaders++)
            if (!(t->headers[t->nheaders] = rb_strdup(req->headers[t->nheaders]))) return -1;
    }
    return 0;
}

rb_http_transfer *rb_http_start(rb_http *h, const rb_http_request *req, rb_http_cb cb, void *ud,
                                char *err, size_t errlen)
{
    if (rb_http_check(req, err, errlen) != 0) return NULL;
    rb_http_transfer *t = rb_calloc(1, sizeof *t);
    if (!t || copy_request(t, req) != 0) {
        snprintf(err, errlen, "out of memory");
        if (t) transfer_free(t);
        return NULL;
    }
    if (check_url(t, err, errlen) != 0) {
        transfer_free(t);
        return NULL;
    }
    t->h = h;
    t->cb = cb;
    t->ud = ud;
    t->timeout = req->timeout > 0 ? req->timeout : DEFAULT_TIMEOUT;
    if (t->timeout > RB_MAX_SECONDS) t->timeout = RB_MAX_SECONDS;
    t->deadline = rb_monotonic() + t->timeout;
    t->max_body = req->max_body > 0 ? req->max_body : DEFAULT_MAX_BODY;
    t->truncate = req->truncate_body;
    t->follow = req->follow_redirects;
    if (!(t->easy = curl_easy_init()) || configure_hop(t) != 0) {
        snprintf(err, errlen, "out of memory");
        transfer_free(t);
        return NULL;
    }
    CURLMcode mc = curl_multi_add_handle(h->multi, t->easy);
    if (mc != CURLM_OK) {
        snprintf(err, errlen, "%s", curl_multi_strerror(mc));
        transfer_free(t);
        return NULL;
    }
    list_push(&h->open, &t->node);
    h->active++;
    return t;
}

/* ---- redirects ---- */

/* The URL of the next hop: the Location resolved against this hop's URL, http or https only;
 * the user-info stays behind once the chain has left the first origin, and a hop within it
 * carries the first URL's. NULL with t->fail set when it cannot be used. */
static char *next_url(rb_http_transfer *t, const char *location)
{
    char *resolved = resolve_location(t->url, location);
    CURLU *u = curl_url();
    char *scheme = NULL, *full = NULL, *next = NULL, *origin = NULL;
    if (!resolved || !u ||
        curl_url_set(u, CURLUPART_URL, resolved, CURLU_NON_SUPPORT_SCHEME) != CURLUE_OK ||
        curl_url_get(u, CURLUPART_SCHEME, &scheme, 0) != CURLUE_OK) {
        snprintf(t->fail, sizeof t->fail, "redirect to an invalid URL");
    } else if (!is_http_scheme(scheme)) {
        char line[64];
        snprintf(t->fail, sizeof t->fail, "redirect to an unsupported scheme: %s",
                 rb_one_line(line, 50, scheme));
    } else if (!(origin = origin_of(u))) {
        snprintf(t->fail, sizeof t->fail, "redirect to an invalid URL");
    } else {
        if (strcmp(origin, t->origin) != 0) t->foreign = 1;
        char *user = url_part(u, CURLUPART_USER);
        if (t->foreign) {
            curl_url_set(u, CURLUPART_USER, NULL, 0);
            curl_url_set(u, CURLUPART_PASSWORD, NULL, 0);
        } else if (!user && t->user) {
            curl_url_set(u, CURLUPART_USER, t->user, 0);
            if (t->password) curl_url_set(u, CURLUPART_PASSWORD, t->password, 0);
        }
        free(user);
        if (curl_url_get(u, CURLUPART_URL, &full, 0) != CURLUE_OK || !full ||
            !rb_http_valid_url_text(full, strlen(full)))
            snprintf(t->fail, sizeof t->fail, "redirect to an invalid URL");
        else if (!(next = rb_strdup(full)))
            snprintf(t->fail, sizeof t->fail, "out of memory");
    }
    free(resolved);
    free(origin);
    curl_free(full);
    curl_free(scheme);
    curl_url_cleanup(u);
    return next;
}

/* After a hop has ended: when it was a redirect to follow, starts the next hop on the same
 * easy handle and returns 1. Returns 0 when the transfer ends here, with t->fail set when the
 * redirect could not be followed. */
static int next_hop(rb_http_transfer *t, CURLcode rc)
{
    if (!t->follow || (rc != CURLE_OK && !(rc == CURLE_WRITE_ERROR && t->discarding)))
        return 0;
    long status = 0;
    curl_easy_getinfo(t->easy, CURLINFO_RESPONSE_CODE, &status);
    const char *location = find_header(&t->resp, "location");
    if (!followable(status) || !location) {
        if (t->discarding)
            snprintf(t->fail, sizeof t->fail, "HTTP %ld redirect without a usable Location",
                     status);
        return 0;
    }
    if (t->hops >= RB_HTTP_MAX_REDIRECTS) {
        snprintf(t->fail, sizeof t->fail, "more than %d redirects", RB_HTTP_MAX_REDIRECTS);
        return 0;
    }
    if (rb_monotonic() >= t->deadline) {
        snprintf(t->fail, sizeof t->fail, "timed out after %g s", t->timeout);
        return 0;
    }
    char *url = next_url(t, location);
    if (!url) return 0;
    free(t->url);
    t->url = url;
    t->hops++;
    /* 307 and 308 repeat the request; the others continue as a GET without a body */
    if (status != 307 && status != 308 &&
        !(t->method && strcasecmp(t->method, "HEAD") == 0)) {
        free(t->method);
        free(t->body);
        t->method = t->body = NULL;
        t->body_len = 0;
        t->body_dropped = 1;
    }
    rb_http_response_clear(&t->resp);
    memset(&t->hp, 0, sizeof t->hp);
    rb_buf_free(&t->body_in);
    t->discarded = 0;
    t->body_started = t->discarding = 0;
    t->errbuf[0] = '\0';
    curl_multi_remove_handle(t->h->multi, t->easy);
    CURLMcode mc = CURLM_OK;
    if (configure_hop(t) != 0 || (mc = curl_multi_add_handle(t->h->multi, t->easy)) != CURLM_OK) {
        snprintf(t->fail, sizeof t->fail, "%s",
                 mc != CURLM_OK ? curl_multi_strerror(mc) : "out of memory");
        return 0;
    }
    return 1;
}

/* ---- finishing ---- */

/* Takes a transfer out of curl and of the open list; it is then ours alone. */
static void detach(rb_http_transfer *t)
{
    curl_multi_remove_handle(t->h->multi, t->easy);
    list_unlink(&t->node);
    RB_ASSERT(t->h->active > 0);
    t->h->active--;
}

static void describe_error(rb_http_transfer *t, CURLcode rc, char *msg, size_t len)
{
    long oserr = 0;
    curl_easy_getinfo(t->easy, CURLINFO_OS_ERRNO, &oserr);
    const char *detail = t->errbuf[0] ? t->errbuf : curl_easy_strerror(rc);
    char raw[CURL_ERROR_SIZE + 64];
    if (t->body_exceeded)
        snprintf(raw, sizeof raw, "response body exceeds %zu bytes", t->max_body);
    else if (t->headers_exceeded)
        snprintf(raw, sizeof raw, "response headers exceed %d lines or %zu bytes",
                 RB_HTTP_MAX_HEADERS, RB_HTTP_MAX_HEADER_BYTES);
    else if (t->oom)
        snprintf(raw, sizeof raw, "out of memory");
    else if (rc == CURLE_OPERATION_TIMEDOUT)
        snprintf(raw, sizeof raw, "timed out after %g s", t->timeout);
    else if (rc == CURLE_COULDNT_CONNECT && oserr == ECONNREFUSED)
        snprintf(raw, sizeof raw, "connection refused");
    else if (oserr == ECONNRESET)
        snprintf(raw, sizeof raw, "connection reset");
    else if (rc == CURLE_GOT_NOTHING)
        snprintf(raw, sizeof raw, "empty reply from server");
    else if (rc == CURLE_SSL_CONNECT_ERROR || rc == CURLE_PEER_FAILED_VERIFICATION ||
             rc == CURLE_SSL_CACERT_BADFILE || rc == CURLE_SSL_CERTPROBLEM)
        snprintf(raw, sizeof raw, "TLS: %s", detail);
    else {
        snprintf(raw, sizeof raw, "%s", detail);
        /* curl capitalises ("Could not resolve host"); our messages read as one clause */
        if (isupper((unsigned char)raw[0]) && islower((unsigned char)raw[1]))
            raw[0] = (char)tolower((unsigned char)raw[0]);
    }
    /* one line, no trailing period */
    rb_one_line(msg, len, raw);
    size_t n = strlen(msg);
    while (n > 0 && msg[n - 1] == '.') msg[--n] = '\0';
}

/* Ends a detached transfer: the callback, then the memory. */
static void finish(rb_http_transfer *t, CURLcode rc, const char *reason)
{
    char msg[CURL_ERROR_SIZE + 64];
    const char *err = reason;
    if (!err && t->fail[0]) {
        err = t->fail;
    } else if (!err && rc != CURLE_OK && !(rc == CURLE_WRITE_ERROR && t->resp.truncated)) {
        describe_error(t, rc, msg, sizeof msg);
        err = msg;
    }
    if (!err) {
        curl_easy_getinfo(t->easy, CURLINFO_RESPONSE_CODE, &t->resp.status);
        const char *location = find_header(&t->resp, "location");
        if (t->resp.status >= 300 && t->resp.status <= 399 && location)
            t->resp.redirect_url = resolve_location(t->url, location);
        /* the body passes to the response; callers may rely on a string even when empty */
        t->resp.body = t->body_in.data ? t->body_in.data : rb_calloc(1, 1);
        t->resp.body_len = t->body_in.len;
        rb_buf_init(&t->body_in);
    }
    t->cb(t->ud, err, err ? NULL : &t->resp);
    transfer_free(t);
}

/* Handles one message at a time: a callback may cancel another finished transfer, and
 * curl_multi_remove_handle drops that transfer's queued message with it. */
static void check_done(rb_http *h)
{
    CURLMsg *m;
    int left;
    while ((m = curl_multi_info_read(h->multi, &left))) {
        if (m->msg != CURLMSG_DONE) continue;
        CURLcode rc = m->data.result;
        rb_http_transfer *t = NULL;
        curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, (char **)&t);
        if (!t) continue;
        if (next_hop(t, rc)) continue;      /* a redirect: the same transfer goes on */
        detach(t);
        finish(t, rc, NULL);
    }
}

void rb_http_cancel(rb_http_transfer *t)
{
    if (!t) return;
    detach(t);
    transfer_free(t);
}

/* Transfers started by a callback during the cut are not on the private list: they live on. */
void rb_http_cut_all(rb_http *h, const char *reason)
{
    tlink cut;
    list_move_all(&h->open, &cut);
    while (!list_empty(&cut)) {
        rb_http_transfer *t = (rb_http_transfer *)cut.next;
        detach(t);
        finish(t, CURLE_OK, reason ? reason : "cut");
    }
}

/* Must not be called from a transfer's callback. Open transfers are cancelled silently. */
void rb_http_free(rb_http *h)
{
    if (!h) return;
    while (!list_empty(&h->open)) rb_http_cancel((rb_http_transfer *)h->open.next);
    rb_timer_stop(h->loop, &h->timer);
    curl_multi_cleanup(h->multi);   /* closes pooled connections; CURL_POLL_REMOVE frees sockw */
    free(h);
}

/* ---- what webhooks need of OpenSSL ---- */
static int hmac_sha256(const void *key, size_t klen, const void *data, size_t dlen,
                       unsigned char out[32])
{
    unsigned int len = 0;
    if (klen > INT_MAX) return -1;
    if (!HMAC(EVP_sha256(), key, (int)klen, data, dlen, out, &len) || len != 32) return -1;
    return 0;
}

static int equal_in_constant_time(const void *a, const void *b, size_t n)
{
    return CRYPTO_memcmp(a, b, n) == 0;
}

/* Its table for plugin.h: the command and the Lua module load it from relaybus_http.so. */
const rb_http_plugin rb_plugin_http = {
    rb_http_new, rb_http_start, rb_http_cancel, rb_http_free, hmac_sha256,
    equal_in_constant_time,
};
