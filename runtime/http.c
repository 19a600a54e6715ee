/* http.c -- the HTTP transport: one libcurl multi handle per rb_http, driven by the host's
 * libev loop. curl tells us which sockets to watch (one ev_io each) and when to wake it (one
 * ev_timer); we call curl_multi_socket_action on events and collect finished transfers. */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <curl/curl.h>
#include "http.h"

#define DEFAULT_TIMEOUT 30.0
#define DEFAULT_MAX_BODY ((size_t)16 << 20)

/* Open transfers sit on a circular list with a sentinel, so one can unlink itself without
 * knowing which list holds it (cut_all moves them to a private list while it ends them). */
typedef struct tlink { struct tlink *prev, *next; } tlink;

struct rb_http {
    struct ev_loop *loop;
    CURLM *multi;
    ev_timer timer;
    tlink open;
    size_t active;
};

struct rb_http_transfer {
    tlink node;                  /* first member: a tlink* is a transfer* */
    rb_http *h;
    CURL *easy;
    rb_http_cb cb;
    void *ud;
    struct curl_slist *req_headers;
    double timeout;
    size_t max_body;
    int body_exceeded;
    rb_http_response resp;
    size_t body_cap, headers_cap;
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
    ev_timer_stop(h->loop, &h->timer);
    if (timeout_ms >= 0) {
        ev_timer_set(&h->timer, timeout_ms / 1000.0, 0.);
        ev_timer_start(h->loop, &h->timer);
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
        s = calloc(1, sizeof *s);
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

static void global_init_once(void)
{
    static int done;
    if (!done) {
        curl_global_init(CURL_GLOBAL_DEFAULT);
        done = 1;
    }
}

rb_http *rb_http_new(struct ev_loop *loop)
{
    global_init_once();
    rb_http *h = calloc(1, sizeof *h);
    if (!h) return NULL;
    h->multi = curl_multi_init();
    if (!h->multi) {
        free(h);
        return NULL;
    }
    h->loop = loop;
    list_init(&h->open);
    ev_init(&h->timer, on_timer);
    h->timer.data = h;
    curl_multi_setopt(h->multi, CURLMOPT_SOCKETFUNCTION, set_socket);
    curl_multi_setopt(h->multi, CURLMOPT_SOCKETDATA, h);
    curl_multi_setopt(h->multi, CURLMOPT_TIMERFUNCTION, set_timer);
    curl_multi_setopt(h->multi, CURLMOPT_TIMERDATA, h);
    return h;
}

size_t rb_http_active(rb_http *h) { return h ? h->active : 0; }

/* ---- receiving ---- */

static size_t on_body(char *data, size_t size, size_t n, void *ud)
{
    rb_http_transfer *t = ud;
    size_t len = size * n;
    rb_http_response *r = &t->resp;
    if (len > t->max_body - r->body_len) {
        t->body_exceeded = 1;
        return 0;               /* curl ends the transfer with CURLE_WRITE_ERROR */
    }
    if (r->body_len + len + 1 > t->body_cap) {
        size_t cap = t->body_cap ? t->body_cap : 4096;
        while (cap < r->body_len + len + 1) cap *= 2;
        char *b = realloc(r->body, cap);
        if (!b) return 0;
        r->body = b;
        t->body_cap = cap;
    }
    memcpy(r->body + r->body_len, data, len);
    r->body_len += len;
    r->body[r->body_len] = '\0';
    return len;
}

static void clear_headers(rb_http_response *r)
{
    for (size_t i = 0; i < r->nheaders; i++) free(r->headers[i]);
    r->nheaders = 0;
}

static int add_header(rb_http_transfer *t, const char *line, size_t len)
{
    rb_http_response *r = &t->resp;
    if (r->nheaders == t->headers_cap) {
        size_t cap = t->headers_cap ? t->headers_cap * 2 : 16;
        char **hs = realloc(r->headers, cap * sizeof *hs);
        if (!hs) return -1;
        r->headers = hs;
        t->headers_cap = cap;
    }
    char *copy = malloc(len + 1);
    if (!copy) return -1;
    memcpy(copy, line, len);
    copy[len] = '\0';
    r->headers[r->nheaders++] = copy;
    return 0;
}

/* Header lines arrive for every response (100 Continue, redirects): a status line starts a
 * new response, so only the final one's headers remain. */
static size_t on_header(char *data, size_t size, size_t n, void *ud)
{
    rb_http_transfer *t = ud;
    size_t len = size * n, total = len;
    while (len > 0 && (data[len - 1] == '\n' || data[len - 1] == '\r')) len--;
    if (len >= 5 && strncmp(data, "HTTP/", 5) == 0) {
        clear_headers(&t->resp);
        return total;
    }
    if (len == 0 || !memchr(data, ':', len)) return total;
    return add_header(t, data, len) == 0 ? total : 0;
}

/* ---- starting ---- */

static int check_url(const char *url, char *err, size_t errlen)
{
    if (!url || !*url) {
        snprintf(err, errlen, "missing url");
        return -1;
    }
    CURLU *u = curl_url();
    char *scheme = NULL;
    int ok = u && curl_url_set(u, CURLUPART_URL, url, 0) == CURLUE_OK &&
             curl_url_get(u, CURLUPART_SCHEME, &scheme, 0) == CURLUE_OK;
    if (!ok)
        snprintf(err, errlen, "invalid url: %.200s", url);
    else if (strcasecmp(scheme, "http") != 0 && strcasecmp(scheme, "https") != 0) {
        snprintf(err, errlen, "unsupported scheme: %.50s", scheme);
        ok = 0;
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

/* Request headers. "Expect:" stops curl from waiting for 100-continue on big bodies, and
 * "Content-Type:" stops it from labelling a body as a form the caller never said it was. */
static int set_request_headers(rb_http_transfer *t, const rb_http_request *req)
{
    int has_type = 0;
    if (append_header(t, "Expect:") != 0) return -1;
    for (size_t i = 0; i < req->nheaders; i++) {
        if (strncasecmp(req->headers[i], "content-type", 12) == 0 &&
            (req->headers[i][12] == ':' || req->headers[i][12] == ';'))
            has_type = 1;
        if (append_header(t, req->headers[i]) != 0) return -1;
    }
    return has_type ? 0 : append_header(t, "Content-Type:");
}

static void set_method_and_body(CURL *e, const rb_http_request *req)
{
    const char *method = req->method ? req->method : (req->body ? "POST" : "GET");
    if (req->body || strcasecmp(method, "POST") == 0) {
        curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)req->body_len);
        curl_easy_setopt(e, CURLOPT_COPYPOSTFIELDS, req->body ? req->body : "");
    }
    if (strcasecmp(method, "HEAD") == 0)
        curl_easy_setopt(e, CURLOPT_NOBODY, 1L);
    else if (strcasecmp(method, "GET") != 0 || req->body)
        curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, method);
}

static void set_options(rb_http_transfer *t, const rb_http_request *req)
{
    CURL *e = t->easy;
    curl_easy_setopt(e, CURLOPT_URL, req->url);
    curl_easy_setopt(e, CURLOPT_PRIVATE, t);
    curl_easy_setopt(e, CURLOPT_ERRORBUFFER, t->errbuf);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(e, CURLOPT_REDIR_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(e, CURLOPT_FOLLOWLOCATION, req->follow_redirects ? 1L : 0L);
    curl_easy_setopt(e, CURLOPT_MAXREDIRS, 10L);
    curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, (long)(t->timeout * 1000));
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, t);
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, t);
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, t->req_headers);
    curl_easy_setopt(e, CURLOPT_USERAGENT, "relaybus");
    set_method_and_body(e, req);
}

static void transfer_free(rb_http_transfer *t)
{
    if (t->easy) curl_easy_cleanup(t->easy);
    curl_slist_free_all(t->req_headers);
    clear_headers(&t->resp);
    free(t->resp.headers);
    free(t->resp.body);
    free(t);
}

rb_http_transfer *rb_http_start(rb_http *h, const rb_http_request *req, rb_http_cb cb, void *ud,
                                char *err, size_t errlen)
{
    if (check_url(req->url, err, errlen) != 0) return NULL;
    rb_http_transfer *t = calloc(1, sizeof *t);
    if (!t || !(t->easy = curl_easy_init()) || set_request_headers(t, req) != 0) {
        snprintf(err, errlen, "out of memory");
        if (t) transfer_free(t);
        return NULL;
    }
    t->h = h;
    t->cb = cb;
    t->ud = ud;
    t->timeout = req->timeout > 0 ? req->timeout : DEFAULT_TIMEOUT;
    t->max_body = req->max_body > 0 ? req->max_body : DEFAULT_MAX_BODY;
    set_options(t, req);
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

/* ---- finishing ---- */

/* Takes a transfer out of curl and of the open list; it is then ours alone. */
static void detach(rb_http_transfer *t)
{
    curl_multi_remove_handle(t->h->multi, t->easy);
    list_unlink(&t->node);
    t->h->active--;
}

/* One line, newlines folded, no trailing period or spaces. */
static void one_line(char *s)
{
    for (char *p = s; *p; p++)
        if (*p == '\n' || *p == '\r') *p = ' ';
    size_t n = strlen(s);
    while (n > 0 && (s[n - 1] == ' ' || s[n - 1] == '.')) s[--n] = '\0';
}

static void describe_error(rb_http_transfer *t, CURLcode rc, char *msg, size_t len)
{
    long oserr = 0;
    curl_easy_getinfo(t->easy, CURLINFO_OS_ERRNO, &oserr);
    const char *detail = t->errbuf[0] ? t->errbuf : curl_easy_strerror(rc);
    if (t->body_exceeded)
        snprintf(msg, len, "response body exceeds %zu bytes", t->max_body);
    else if (rc == CURLE_OPERATION_TIMEDOUT)
        snprintf(msg, len, "timed out after %g s", t->timeout);
    else if (rc == CURLE_COULDNT_CONNECT && oserr == ECONNREFUSED)
        snprintf(msg, len, "connection refused");
    else if (oserr == ECONNRESET)
        snprintf(msg, len, "connection reset");
    else if (rc == CURLE_GOT_NOTHING)
        snprintf(msg, len, "empty reply from server");
    else if (rc == CURLE_SSL_CONNECT_ERROR || rc == CURLE_PEER_FAILED_VERIFICATION ||
             rc == CURLE_SSL_CACERT_BADFILE || rc == CURLE_SSL_CERTPROBLEM)
        snprintf(msg, len, "TLS: %s", detail);
    else {
        snprintf(msg, len, "%s", detail);
        /* curl capitalises ("Could not resolve host"); our messages read as one clause */
        if (isupper((unsigned char)msg[0]) && islower((unsigned char)msg[1]))
            msg[0] = (char)tolower((unsigned char)msg[0]);
    }
    one_line(msg);
}

/* Ends a detached transfer: the callback, then the memory. */
static void finish(rb_http_transfer *t, CURLcode rc, const char *reason)
{
    char msg[CURL_ERROR_SIZE + 64];
    const char *err = reason;
    if (!err && rc != CURLE_OK) {
        describe_error(t, rc, msg, sizeof msg);
        err = msg;
    }
    if (!err) curl_easy_getinfo(t->easy, CURLINFO_RESPONSE_CODE, &t->resp.status);
    if (!t->resp.body) t->resp.body = calloc(1, 1);    /* callers may rely on a string */
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
    ev_timer_stop(h->loop, &h->timer);
    curl_multi_cleanup(h->multi);   /* closes pooled connections; CURL_POLL_REMOVE frees sockw */
    free(h);
}
