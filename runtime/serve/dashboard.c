/* dashboard.c -- see dashboard.h. libmicrohttpd runs in its external-event mode with epoll:
 * its epoll descriptor is one ev_io on our loop, its timeouts one rb_timer, and every call
 * into it (MHD_run) is made from the loop. A request that needs the store is suspended
 * (MHD_suspend_connection) until the store's callback, which resumes it and asks for a run. */
#include <arpa/inet.h>
#include <assert.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <microhttpd.h>
#include <jansson.h>

#include "util/alloc.h"
#include "util/buf.h"
#include "util/clock.h"
#include "serve/dashboard.h"
#include "util/log.h"
#include "util/text.h"
#include "util/timer.h"
#include "dashboard_assets.h"
#include "util/list.h"
#include "plugin/plugin.h"
#include "util/check.h"

/* Slow clients: a byte every few seconds keeps MHD's idle timeout from firing, so each
 * request head has a deadline of its own, counted from the accept (or from the end of the
 * connection's last answer), and each answer one from the end of its head. Past
 * MAX_CONNECTIONS, the connection that has waited longest for its head is closed to make
 * room: a client that sends its request at once (a scrape) gets in beside any number of slow
 * ones, from any number of addresses. MHD's own limit is higher, so that it goes on accepting
 * while those closed are on their way out. */
#define MAX_CONNECTIONS 256
#define MHD_CONNECTIONS (MAX_CONNECTIONS + 64)
#define PER_IP_CONNECTIONS 64
#define CONNECTION_TIMEOUT 15       /* s a connection may sit idle */
#define HEAD_TIMEOUT 10.0           /* s for a request line and headers */
#define ANSWER_TIMEOUT 60.0         /* s from the end of the head to the end of the answer */
#define MEMORY_LIMIT (32 * 1024)    /* per connection: request line and headers */
#define MAX_ID 64
#define DEFAULT_LIMIT 50
#define BURY_REASON "buried from the dashboard"
#define CANCEL_REASON "cancelled from the dashboard"
/* Per-topic counts scan the whole table (SQLite runs that on the loop thread): at most once
 * per this many seconds unless an action changed them. */
#define TOPICS_CACHE 10.0

typedef struct req req;
typedef struct sock sock;

/* A queue of connections in the order of their deadlines (each queue's deadlines are a fixed
 * time after their joining, so joining at the tail keeps the order). */
typedef struct sockq { sock *head, *tail; size_t n; } sockq;

/* One connection MHD accepted (its socket context), from accept to close. */
struct sock {
    struct MHD_Connection *conn;
    int fd;
    double deadline;            /* monotonic s */
    sockq *on;                  /* d->heads, d->answers, or NULL */
    int cut;                    /* shut down, not closed by MHD yet */
    sock *prev, *next;
};

/* The store's stats and per-topic counts, shared by /metrics and /api/stats for `cache` s. */
/* need_topics: a waiter wants /api/stats; /metrics alone skips the per-topic scan (a full
 * one: 1 s on a million SQLite rows). */
typedef struct snap_fetch { rb_dashboard *d; rb_stats st; int need_topics; } snap_fetch;

struct rb_dashboard {
    struct ev_loop *loop;
    rb_store *store;
    struct MHD_Daemon *mhd;
    ev_io io;
    rb_timer tick;
    char *token;
    size_t token_len;
    const rb_metrics *metrics;
    double cache;
    int loopback;
    int port;
    char host[80];              /* as the URL and the Host check spell it */
    char url[128];
    req *reqs;                  /* every request MHD has open with us */
    int queries;                /* store calls in flight */
    /* the cached snapshot */
    rb_stats st;
    rb_rowset *topics;
    double snap_at;             /* monotonic s; 0 = none */
    double topics_at;           /* monotonic s of d->topics; 0 = none */
    snap_fetch *fetching;       /* in flight, or NULL */
    req *waiting;               /* requests waiting for it */
    int in_run;                 /* inside MHD_run: no nested run */
    sockq heads;                /* connections waiting for (the rest of) a request head */
    sockq answers;              /* connections whose request is being answered */
    size_t nsocks;              /* connections open */
    size_t ncut;                /* of them, cut and on their way out */
};

enum { R_NEW, R_WAIT, R_READY };
enum { W_NONE, W_METRICS, W_STATS, W_HEALTH };

struct req {
    rb_dashboard *d;            /* NULL once the dashboard is freed */
    struct MHD_Connection *conn;
    req *prev, *next;           /* on d->reqs */
    req *wait_next;             /* on d->waiting */
    int phase;
    int wants;                  /* W_*: what the snapshot is for */
    int suspended, inflight, closed, body_seen;
    unsigned status;
    const char *ctype;
    rb_buf body;
    const char *allow;          /* 405: the Allow header */
    int auth_challenge;         /* 401: WWW-Authenticate */
    size_t limit;               /* list: the page size asked for */
    char audit[512];            /* an action: what it does, for its audit line with the outcome */
};

/* ---- connections and their deadlines ---------------------------------------------------- */
static void sockq_remove(sock *k)
{
    sockq *q = k->on;
    if (!q) return;
    if (k->prev) k->prev->next = k->next; else q->head = k->next;
    if (k->next) k->next->prev = k->prev; else q->tail = k->prev;
    k->prev = k->next = NULL;
    k->on = NULL;
    RB_ASSERT(q->n > 0);
    q->n--;
}

static void sockq_push(sockq *q, sock *k, double deadline)
{
    sockq_remove(k);
    k->deadline = deadline;
    k->prev = q->tail;
    k->next = NULL;
    if (q->tail) q->tail->next = k; else q->head = k;
    q->tail = k;
    q->n++;
    k->on = q;
}

/* Closes the connection under MHD: its next read sees the end and it closes it the MHD way
 * (on_completed, then on_connection). MHD has no call that closes one from outside. */
static void sock_cut(rb_dashboard *d, sock *k)
{
    sockq_remove(k);
    if (k->cut || k->fd < 0) return;
    k->cut = 1;
    d->ncut++;
    shutdown(k->fd, SHUT_RDWR);
}

static sock *sock_of(struct MHD_Connection *conn)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

/* Cuts every connection past its deadline; returns the seconds until the next deadline. */
static double cut_late(rb_dashboard *d)
{
    double now = rb_monotonic(), next = INFINITY;
    sockq *qs[] = {&d->heads, &d->answers};
    for (int i = 0; i < 2; i++) {
        while (qs[i]->head && qs[i]->head->deadline <= now) sock_cut(d, qs[i]->head);
        if (qs[i]->head && qs[i]->head->deadline - now < next) next = qs[i]->head->deadline - now;
    }
    return next;
}

static void on_connection(void *cls, struct MHD_Connection *conn, void **socket_context,
                          enum MHD_ConnectionNotificationCode code)
{
    rb_dashboard *d = cls;
    if (code == MHD_CONNECTION_NOTIFY_CLOSED) {
        sock *k = *socket_context;
        *socket_context = NULL;
        if (!k) return;
        sockq_remove(k);
        RB_ASSERT(d->nsocks > 0);
        d->nsocks--;
        if (k->cut) { RB_ASSERT(d->ncut > 0); d->ncut--; }
        free(k);
        return;
    }
    sock *k = rb_calloc(1, sizeof *k);
    if (!k) return;     /* untracked: MHD's idle timeout and limits still hold it */
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    k->conn = conn;
    k->fd = ci ? ci->connect_fd : -1;
    *socket_context = k;
    d->nsocks++;
    sockq_push(&d->heads, k, rb_monotonic() + HEAD_TIMEOUT);
    /* over the limit: the one that has waited longest for its head goes (this one, when no
     * other is waiting) */
    if (d->nsocks - d->ncut > MAX_CONNECTIONS && d->heads.head) sock_cut(d, d->heads.head);
}

/* ---- small helpers ---------------------------------------------------------------------- */
static void schedule_run(rb_dashboard *d, double after)
{
    rb_timer_stop(d->loop, &d->tick);
    rb_timer_set(&d->tick, after, 0);
    rb_timer_start(d->loop, &d->tick);
}

static void req_unlink(req *r)
{
    rb_dashboard *d = r->d;
    if (!d) return;
    RB_LIST_REMOVE(&d->reqs, r);
}

static void req_free(req *r)
{
    req_unlink(r);
    rb_buf_free(&r->body);
    free(r);
}

static void respond_text(req *r, unsigned status, const char *ctype, const char *text)
{
    rb_buf_free(&r->body);
    rb_buf_puts(&r->body, text);
    r->status = status;
    r->ctype = ctype;
    r->phase = R_READY;
}

static json_t *jtext(const char *s)
{
    if (!s) return json_null();
    char *c = rb_text_clean(s, strlen(s), 1 << 20);
    json_t *j = c ? json_string(c) : NULL;
    free(c);
    return j ? j : json_null();
}

/* Takes `obj` (a new reference) as the response. */
static void respond_json(req *r, unsigned status, json_t *obj)
{
    rb_buf_free(&r->body);
    char *text = obj ? json_dumps(obj, JSON_COMPACT) : NULL;
    json_decref(obj);
    r->ctype = "application/json";
    if (!text) {
        r->status = 500;
        rb_buf_puts(&r->body, "{\"error\":\"out of memory\"}");
    } else {
        r->status = status;
        rb_buf_puts(&r->body, text);
        free(text);
    }
    r->phase = R_READY;
}

static void respond_error(req *r, unsigned status, const char *msg)
{
    respond_json(r, status, json_pack("{s:o}", "error", jtext(msg)));
}

/* The store's answer came: back to MHD with the response. */
static void req_done(req *r)
{
    r->phase = R_READY;
    rb_dashboard *d = r->d;
    if (r->suspended && d) {
        r->suspended = 0;
        MHD_resume_connection(r->conn);
        schedule_run(d, 0);
    }
}

/* A store callback's first words: 1 when r is still wanted. */
static int op_back(req *r)
{
    r->inflight = 0;
    if (r->d) { RB_ASSERT(r->d->queries > 0); r->d->queries--; }
    if (r->closed || !r->d) { req_free(r); return 0; }
    return 1;
}

static int op_start(req *r)
{
    rb_dashboard *d = r->d;
    if (d->queries >= RB_DASHBOARD_MAX_QUERIES) {
        respond_error(r, 503, "busy: too many store queries in flight, try again");
        return 0;
    }
    d->queries++;
    r->inflight = 1;
    r->phase = R_WAIT;
    return 1;
}

static int valid_id(const char *id)
{
    size_t n = 0;
    for (const char *p = id; *p; p++, n++) {
        unsigned char c = (unsigned char)*p;
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
              c == '-' || c == '_'))
            return 0;
    }
    return n >= 1 && n <= MAX_ID;
}

/* Constant time in the length of the token: no timing tells how much of a guess was right. */
static int token_ok(const rb_dashboard *d, const char *header)
{
    static const char prefix[] = "Bearer ";
    if (!header || strncmp(header, prefix, sizeof prefix - 1) != 0) return 0;
    const unsigned char *given = (const unsigned char *)header + sizeof prefix - 1;
    size_t glen = strlen((const char *)given);
    unsigned diff = glen != d->token_len;
    for (size_t i = 0; i < d->token_len; i++)
        diff |= (unsigned)(given[i < glen ? i : 0] ^ (unsigned char)d->token[i]);
    return diff == 0 && glen > 0;
}

/* ---- JSON of deliveries and stats ------------------------------------------------------- */
static json_t *time_or_null(double t) { return t > 0 && isfinite(t) ? json_real(t) : json_null(); }

/* A JSON text the store keeps (progress, errors) as a value; null when absent or not JSON. */
static json_t *stored_json(const char *text)
{
    json_t *v = text ? json_loads(text, JSON_DECODE_ANY, NULL) : NULL;
    return v ? v : json_null();
}

static json_t *delivery_json(const rb_delivery *dv, int full)
{
    json_t *o = json_object();
    if (!o) return NULL;
    json_object_set_new(o, "id", jtext(dv->id));
    json_object_set_new(o, "topic", jtext(dv->topic));
    json_object_set_new(o, "status", json_string(rb_status_name(dv->status)));
    json_object_set_new(o, "attempts", json_integer(dv->attempts));
    json_object_set_new(o, "max_attempts", json_integer(dv->max_attempts));
    json_object_set_new(o, "fence", json_integer(dv->fence));
    json_object_set_new(o, "run_at", time_or_null(dv->run_at));
    json_object_set_new(o, "created_at", time_or_null(dv->created_at));
    json_object_set_new(o, "lease_expires_at",
                        dv->status == RB_PROCESSING ? time_or_null(dv->lease_expires_at) : json_null());
    json_object_set_new(o, "key", jtext(dv->key));
    json_object_set_new(o, "group", jtext(dv->group));
    json_object_set_new(o, "last_error", jtext(dv->last_error));
    json_object_set_new(o, "settled_at", time_or_null(dv->settled_at));
    json_object_set_new(o, "waiting", json_integer(dv->waiting));
    if (full) {
        /* The payload as stored, as text: the page pretty-prints it; numbers keep every digit. */
        json_object_set_new(o, "payload", jtext(dv->payload));
        json_object_set_new(o, "progress", stored_json(dv->progress));
        json_object_set_new(o, "errors", stored_json(dv->errors));
    }
    return o;
}

static json_t *topics_json(const rb_rowset *rs)
{
    json_t *a = json_array();
    if (!rs || !a) return a;
    for (size_t i = 0; i < rs->nrows; i++) {
        const rb_value *v = &rs->vals[i * (size_t)rs->ncols];
        if (rs->ncols < 1 + RB_STATUS_COUNT) break;
        json_t *o = json_object();
        json_object_set_new(o, "topic", v[0].type == RB_VTEXT ? jtext(v[0].s) : json_null());
        for (int c = 1; c <= RB_STATUS_COUNT; c++) {
            int64_t n = v[c].type == RB_VINT ? v[c].i : v[c].type == RB_VFLOAT ? (int64_t)v[c].f
                      : v[c].type == RB_VTEXT ? strtoll(v[c].s, NULL, 10) : 0;
            /* null: not counted per topic (the store's table is large) */
            json_object_set_new(o, rb_status_name((rb_status)(c - 1)),
                                v[c].type == RB_VNULL ? json_null() : json_integer(n));
        }
        json_array_append_new(a, o);
    }
    return a;
}

/* /metrics: the store's gauges (NULL st: the store did not answer, relaybus_store_up 0 and
 * none of its counts) and the process's own. A store down is no failed scrape. */
static void answer_metrics(req *r, const rb_stats *st)
{
    rb_dashboard *d = r->d;
    rb_buf_free(&r->body);
    rb_metrics_write_store(&r->body, st, st ? d->topics : NULL);
    rb_metrics_write(d->metrics, &r->body);
    r->status = rb_buf_failed(&r->body) ? 500 : 200;
    r->ctype = "text/plain; version=0.0.4; charset=utf-8";
    r->phase = R_READY;
}

static void answer_snapshot(req *r)
{
    rb_dashboard *d = r->d;
    if (r->wants == W_METRICS) {
        answer_metrics(r, &d->st);
        return;
    }
    if (r->wants == W_HEALTH) {
        respond_json(r, 200, json_pack("{s:b}", "ok", 1));
        return;
    }
    json_t *o = json_pack("{s:{s:I,s:I,s:I,s:I,s:I},s:b,s:I,s:I,s:f,s:o,s:f,s:b}",
        "deliveries", "pending", (json_int_t)d->st.pending, "processing",
        (json_int_t)d->st.processing, "completed", (json_int_t)d->st.completed, "buried",
        (json_int_t)d->st.buried, "cancelled", (json_int_t)d->st.cancelled,
        "completed_estimated", d->st.completed_estimated != 0, "due", (json_int_t)d->st.due,
        "stalled", (json_int_t)d->st.stalled, "oldest_due_age",
        d->st.oldest_due_age, "topics", topics_json(d->topics), "time", rb_wall_time(),
        "read_only", d->token == NULL);
    if (o) {
        if (d->metrics) {
            rb_metrics_totals t;
            rb_metrics_totals_get(d->metrics, &t);
            json_object_set_new(o, "runs", json_pack("{s:I,s:I,s:I,s:I}", "completed",
                (json_int_t)t.completed, "failed", (json_int_t)t.failed, "active",
                (json_int_t)t.active, "claims", (json_int_t)t.claims));
        } else {
            json_object_set_new(o, "runs", json_null());
        }
    }
    respond_json(r, 200, o);
}

/* Answers every request waiting for the snapshot: with it, or with err (502; /healthz 503,
 * /metrics its own gauges and relaybus_store_up 0). */
static void answer_waiting(rb_dashboard *d, const char *err)
{
    req *w = d->waiting;
    d->waiting = NULL;
    while (w) {
        req *next = w->wait_next;
        w->wait_next = NULL;
        w->inflight = 0;
        if (w->closed) { req_free(w); w = next; continue; }
        if (!err) answer_snapshot(w);
        else if (w->wants == W_METRICS) answer_metrics(w, NULL);
        else respond_error(w, w->wants == W_HEALTH ? 503 : 502, err);
        req_done(w);
        w = next;
    }
}

static void snapshot_fail(rb_dashboard *d, const char *err) { answer_waiting(d, err); }
static void snapshot_ready(rb_dashboard *d) { answer_waiting(d, NULL); }

static void on_topic_stats(void *ud, const char *err, rb_rowset *rs)
{
    snap_fetch *f = ud;
    rb_dashboard *d = f->d;
    if (!d) { rb_rowset_free(rs); free(f); return; }
    RB_ASSERT(d->queries > 0);
    d->queries--;
    d->fetching = NULL;
    if (err) {
        static rb_log_limit lim;
        rb_log_limited(&lim, RB_LOG_WARN, "dashboard: topic stats failed: %s", err);
        free(f);
        snapshot_fail(d, err);
        return;
    }
    d->st = f->st;
    if (f->need_topics) {
        rb_rowset_free(d->topics);
        d->topics = rs;
    }
    if (f->need_topics) d->topics_at = rb_monotonic();
    free(f);
    d->snap_at = rb_monotonic();
    snapshot_ready(d);
}

static void on_stats(void *ud, const char *err, const rb_stats *st)
{
    snap_fetch *f = ud;
    rb_dashboard *d = f->d;
    if (!d) { free(f); return; }
    if (err) {
        static rb_log_limit lim;
        rb_log_limited(&lim, RB_LOG_WARN, "dashboard: stats failed: %s", err);
        RB_ASSERT(d->queries > 0);
        d->queries--;
        d->fetching = NULL;
        free(f);
        snapshot_fail(d, err);
        return;
    }
    f->st = *st;
    if (f->need_topics && d->store->vt->topic_stats) {
        d->store->vt->topic_stats(d->store, on_topic_stats, f);
    } else {
        on_topic_stats(f, NULL, NULL);
    }
}

/* /metrics, /api/stats and /healthz: from the cache while it is fresh, else after one fetch
 * that every request waiting meanwhile shares (a burst of scrapes costs the store one query).
 * The counts per topic (a scan of the table) are fetched again every TOPICS_CACHE at most. */
static void want_snapshot(req *r, int wants)
{
    rb_dashboard *d = r->d;
    r->wants = wants;
    double now = rb_monotonic();
    int topics_ok = d->topics_at > 0 && now - d->topics_at < TOPICS_CACHE;
    int need_topics = wants != W_HEALTH && !topics_ok;
    if (d->snap_at > 0 && now - d->snap_at < d->cache && !need_topics) {
        answer_snapshot(r);
        return;
    }
    if (d->fetching && need_topics) d->fetching->need_topics = 1;
    if (!d->fetching) {
        if (d->queries >= RB_DASHBOARD_MAX_QUERIES) {
            respond_error(r, 503, "busy: too many store queries in flight, try again");
            return;
        }
        snap_fetch *f = rb_calloc(1, sizeof *f);
        if (!f) { respond_error(r, 500, "out of memory"); return; }
        f->d = d;
        f->need_topics = need_topics;
        d->fetching = f;
        d->queries++;
        r->phase = R_WAIT;
        r->inflight = 1;
        r->wait_next = d->waiting;
        d->waiting = r;
        d->store->vt->stats(d->store, on_stats, f);
        return;
    }
    r->phase = R_WAIT;
    r->inflight = 1;
    r->wait_next = d->waiting;
    d->waiting = r;
}

/* ---- the store's answers ---------------------------------------------------------------- */
static void on_list(void *ud, const char *err, rb_delivery **recs, size_t n)
{
    req *r = ud;
    if (!op_back(r)) { rb_delivery_list_free(recs, n); return; }
    if (err) { respond_error(r, 502, err); rb_delivery_list_free(recs, n); req_done(r); return; }
    json_t *a = json_array();
    for (size_t i = 0; i < n && a; i++) json_array_append_new(a, delivery_json(recs[i], 0));
    json_t *next = n > 0 && n >= r->limit ? jtext(recs[n - 1]->id) : json_null();
    rb_delivery_list_free(recs, n);
    respond_json(r, 200, json_pack("{s:o,s:o}", "deliveries", a ? a : json_array(), "next", next));
    req_done(r);
}

static void on_get(void *ud, const char *err, rb_delivery **recs, size_t n)
{
    req *r = ud;
    if (!op_back(r)) { rb_delivery_list_free(recs, n); return; }
    if (err) respond_error(r, 502, err);
    else if (n == 0) respond_error(r, 404, "no such delivery");
    else respond_json(r, 200, delivery_json(recs[0], 1));
    rb_delivery_list_free(recs, n);
    req_done(r);
}

/* An action's answer. Its audit line says what it changed, whether the caller still waits
 * for the answer or not. */
static void on_count(req *r, const char *err, int64_t count, const char *none)
{
    if (err) rb_log(RB_LOG_WARN, "dashboard: %s: failed: %s", r->audit, err);
    else rb_log(RB_LOG_INFO, "dashboard: %s: %lld changed", r->audit, (long long)count);
    if (!op_back(r)) return;
    r->d->snap_at = 0;      /* the counts changed: the next stats are fresh */
    r->d->topics_at = 0;
    if (err) respond_error(r, 502, err);
    else if (count == 0 && none) respond_error(r, 409, none);
    else respond_json(r, 200, json_pack("{s:b,s:I}", "ok", 1, "count", (json_int_t)count));
    req_done(r);
}

static void on_kick_one(void *ud, const char *err, int64_t n) { on_count(ud, err, n, "not buried or cancelled (or no such delivery)"); }
static void on_kick_all(void *ud, const char *err, int64_t n) { on_count(ud, err, n, NULL); }
static void on_cancel_all(void *ud, const char *err, int64_t n) { on_count(ud, err, n, NULL); }
static void on_delete_all(void *ud, const char *err, int64_t n) { on_count(ud, err, n, NULL); }
static void on_bury(void *ud, const char *err, int64_t n) { on_count(ud, err, n, "not pending or processing (or no such delivery)"); }
static void on_remove(void *ud, const char *err, int64_t n) { on_count(ud, err, n, "not completed, buried or cancelled (or no such delivery)"); }

/* /api/schedules: the store's schedules, as store:schedules() gives them (columns of
 * vt->schedules) */
static json_t *row_value(const rb_value *v)
{
    switch (v->type) {
    case RB_VTEXT: return jtext(v->s);
    case RB_VFLOAT: return isfinite(v->f) ? json_real(v->f) : json_null();
    case RB_VINT: return json_integer((json_int_t)v->i);
    default: return json_null();
    }
}

static void on_schedules(void *ud, const char *err, rb_rowset *rs)
{
    req *r = ud;
    if (!op_back(r)) { rb_rowset_free(rs); return; }
    if (err) { respond_error(r, 502, err); rb_rowset_free(rs); req_done(r); return; }
    json_t *a = json_array();
    for (size_t i = 0; a && rs && i < rs->nrows; i++) {
        const rb_value *v = &rs->vals[i * (size_t)rs->ncols];
        json_t *o = json_object();
        for (int c = 0; o && c < rs->ncols; c++) {
            if (v[c].type == RB_VNULL) continue;
            /* (the payload as its JSON text, as a delivery's is given) */
            json_object_set_new(o, rs->names[c], row_value(&v[c]));
        }
        if (o) json_array_append_new(a, o);
    }
    rb_rowset_free(rs);
    respond_json(r, 200, json_pack("{s:o}", "schedules", a ? a : json_array()));
    req_done(r);
}

/* ---- routing ---------------------------------------------------------------------------- */
static const char *arg(req *r, const char *name)
{
    const char *v = MHD_lookup_connection_value(r->conn, MHD_GET_ARGUMENT_KIND, name);
    return v && *v ? v : NULL;
}


static void get_list(req *r)
{
    rb_dashboard *d = r->d;
    rb_list_req lr = {.newest_first = 1};
    lr.status = arg(r, "status");
    lr.topic = arg(r, "topic");
    lr.key = arg(r, "key");
    lr.topic_prefix = arg(r, "topic_prefix");
    lr.error_text = arg(r, "error");
    lr.after = arg(r, "after");
    const char *lim = arg(r, "limit");
    if (lr.status && rb_status_parse(lr.status) < 0) { respond_error(r, 400, "unknown status"); return; }
    if ((lr.key && strlen(lr.key) > RB_SEARCH_MAX) ||
        (lr.topic_prefix && strlen(lr.topic_prefix) > RB_SEARCH_MAX) ||
        (lr.error_text && strlen(lr.error_text) > RB_SEARCH_MAX)) {
        respond_error(r, 400, "a search text is longer than 1024 bytes");
        return;
    }
    if (lr.after && !valid_id(lr.after)) { respond_error(r, 400, "bad after: not an id"); return; }
    size_t limit = DEFAULT_LIMIT;
    if (lim) {
        char *end;
        long long v = strtoll(lim, &end, 10);
        if (*end || v < 1 || v > RB_DASHBOARD_MAX_LIMIT) {
            char msg[80];
            snprintf(msg, sizeof msg, "limit must be a whole number from 1 to %d",
                     RB_DASHBOARD_MAX_LIMIT);
            respond_error(r, 400, msg);
            return;
        }
        limit = (size_t)v;
    }
    if (lr.topic && strlen(lr.topic) > 1024) { respond_error(r, 400, "topic too long"); return; }
    lr.limit = limit;
    r->limit = limit;
    if (!op_start(r)) return;
    d->store->vt->list(d->store, &lr, on_list, r);
}

static int allowed(req *r);
static void not_supported(req *r);

/* A bulk action takes only its own parameters, each with a value: a mistyped one ("topci=b")
 * or an empty topic must not widen it to every delivery. */
typedef struct arg_check { const char *const *known; int empty_ok; char bad[80]; } arg_check;

static enum MHD_Result check_arg(void *cls, enum MHD_ValueKind kind, const char *key,
                                 const char *value)
{
    (void)kind;
    arg_check *c = cls;
    int known = 0;
    for (const char *const *k = c->known; *k; k++) known |= !strcmp(*k, key);
    if (!known || (!c->empty_ok && (!value || !*value))) {
        char shown[40];
        snprintf(c->bad, sizeof c->bad, "%s parameter '%s'", known ? "empty" : "unknown",
                 rb_one_line(shown, sizeof shown, key));
        return MHD_NO;
    }
    return MHD_YES;
}

/* 1 when the request's query holds only `known` parameters, each with a value (unless
 * empty_ok); else 0, and answered 400. */
static int only_args(req *r, const char *const *known, int empty_ok)
{
    arg_check c = {known, empty_ok, ""};
    MHD_get_connection_values(r->conn, MHD_GET_ARGUMENT_KIND, check_arg, &c);
    if (!c.bad[0]) return 1;
    respond_error(r, 400, c.bad);
    return 0;
}

static const char *const bulk_args[] = {"status", "topic", NULL};

/* A bulk action's topic: NULL for any; 0 (answered) when it is too long or a parameter is
 * not one of status and topic. */
/* " of topic \"T\"" for an audit line (empty without a topic): quoted and escaped as JSON,
 * so no topic can break the line or pass for another's words; cut at 60 bytes of topic
 * (escaped, at most 6 characters each: out needs AUDIT_TOPIC). */
#define AUDIT_TOPIC 400
static const char *audit_topic(char *out, size_t cap, const char *topic)
{
    assert(cap >= AUDIT_TOPIC);
    out[0] = 0;
    if (!topic) return out;
    rb_buf b;
    rb_buf_init(&b);
    size_t len = strlen(topic);
    rb_json_string(&b, topic, len > 60 ? 60 : len);
    if (!rb_buf_failed(&b))
        snprintf(out, cap, " of topic %.*s%s", (int)b.len, b.data, len > 60 ? " [cut]" : "");
    rb_buf_free(&b);
    return out;
}

static int bulk_topic(req *r, const char **topic)
{
    if (!only_args(r, bulk_args, 0)) return 0;
    *topic = arg(r, "topic");
    if (*topic && strlen(*topic) > 1024) { respond_error(r, 400, "topic too long"); return 0; }
    return 1;
}

/* POST /api/deliveries/cancel?[status=pending|processing][&topic=T]: every live delivery of
 * them cancelled. */
static void cancel_all(req *r)
{
    rb_dashboard *d = r->d;
    if (!allowed(r)) return;
    const char *status = arg(r, "status"), *topic;
    if (status && !rb_live_status(status)) {
        respond_error(r, 400, "cancel takes status=pending or status=processing (or none: both)");
        return;
    }
    if (!bulk_topic(r, &topic)) return;
    if (!d->store->vt->cancel_all) { not_supported(r); return; }
    if (!op_start(r)) return;
    char of[AUDIT_TOPIC];
    snprintf(r->audit, sizeof r->audit, "cancel every %s delivery%s",
             status ? status : "pending or processing", audit_topic(of, sizeof of, topic));
    d->store->vt->cancel_all(d->store, status, topic, "cancelled from the dashboard",
                             on_cancel_all, r);
}

/* DELETE /api/deliveries?status=completed|buried|cancelled[&topic=T]: every settled delivery
 * of them deleted. */
static void delete_all(req *r)
{
    rb_dashboard *d = r->d;
    if (!allowed(r)) return;
    const char *status = arg(r, "status"), *topic;
    if (!rb_settled_status(status)) {
        respond_error(r, 400, "delete takes status=completed, buried or cancelled");
        return;
    }
    if (!bulk_topic(r, &topic)) return;
    if (!op_start(r)) return;
    char of[AUDIT_TOPIC];
    snprintf(r->audit, sizeof r->audit, "delete every %s delivery%s", status,
             audit_topic(of, sizeof of, topic));
    d->store->vt->purge(d->store, status, topic, 0, 0, on_delete_all, r);
}

/* Actions: 403 read-only, 401 without the right token. 1 when allowed. */
static int allowed(req *r)
{
    rb_dashboard *d = r->d;
    if (!d->token) {
        respond_error(r, 403, "read-only: start the dashboard with a token to allow actions");
        return 0;
    }
    const char *h = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, "Authorization");
    if (!token_ok(d, h)) {
        respond_error(r, 401, "this action needs Authorization: Bearer TOKEN");
        r->auth_challenge = 1;
        return 0;
    }
    return 1;
}

static void not_supported(req *r)
{
    respond_error(r, 501, "this store does not support that operation");
}

static void route(req *r, const char *method, const char *url)
{
    rb_dashboard *d = r->d;
    int get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
    int post = !strcmp(method, "POST");
    int del = !strcmp(method, "DELETE");
    if (!strcmp(url, "/") || !strcmp(url, "/app.js") || !strcmp(url, "/app.css")) {
        if (!get) { r->allow = "GET, HEAD"; respond_error(r, 405, "method not allowed"); return; }
        if (!strcmp(url, "/")) respond_text(r, 200, "text/html; charset=utf-8", dashboard_html);
        else if (!strcmp(url, "/app.js"))
            respond_text(r, 200, "text/javascript; charset=utf-8", dashboard_js);
        else respond_text(r, 200, "text/css; charset=utf-8", dashboard_css);
        return;
    }
    if (!strcmp(url, "/metrics") || !strcmp(url, "/api/stats") || !strcmp(url, "/healthz")) {
        if (!get) { r->allow = "GET, HEAD"; respond_error(r, 405, "method not allowed"); return; }
        want_snapshot(r, url[1] == 'm' ? W_METRICS : url[1] == 'h' ? W_HEALTH : W_STATS);
        return;
    }
    if (!strcmp(url, "/api/deliveries")) {
        if (del) {
            delete_all(r);
            return;
        }
        if (!get) { r->allow = "GET, HEAD, DELETE"; respond_error(r, 405, "method not allowed"); return; }
        get_list(r);
        return;
    }
    if (!strcmp(url, "/api/deliveries/cancel")) {
        if (!post) { r->allow = "POST"; respond_error(r, 405, "method not allowed"); return; }
        cancel_all(r);
        return;
    }
    if (!strcmp(url, "/api/schedules")) {
        if (!get) { r->allow = "GET, HEAD"; respond_error(r, 405, "method not allowed"); return; }
        if (!d->store->vt->schedules) { not_supported(r); return; }
        if (!op_start(r)) return;
        d->store->vt->schedules(d->store, on_schedules, r);
        return;
    }
    if (!strcmp(url, "/api/deliveries/kick")) {
        if (!post) { r->allow = "POST"; respond_error(r, 405, "method not allowed"); return; }
        if (!allowed(r)) return;
        /* (an empty topic is every topic here, as documented before cancel and delete came) */
        if (!only_args(r, bulk_args, 1)) return;
        const char *status = arg(r, "status");
        if (!status || strcmp(status, "buried") != 0) {
            respond_error(r, 400, "kick takes status=buried");
            return;
        }
        const char *topic = arg(r, "topic");
        if (!op_start(r)) return;
        char of[AUDIT_TOPIC];
        snprintf(r->audit, sizeof r->audit, "kick every buried delivery%s",
                 audit_topic(of, sizeof of, topic));
        d->store->vt->kick(d->store, RB_KICK_BURIED, NULL, topic, on_kick_all, r);
        return;
    }
    static const char prefix[] = "/api/deliveries/";
    if (strncmp(url, prefix, sizeof prefix - 1) != 0) { respond_error(r, 404, "not found"); return; }
    char id[MAX_ID + 2];
    const char *rest = url + sizeof prefix - 1;
    const char *slash = strchr(rest, '/');
    size_t idlen = slash ? (size_t)(slash - rest) : strlen(rest);
    if (idlen == 0 || idlen > MAX_ID) { respond_error(r, 400, "bad delivery id"); return; }
    memcpy(id, rest, idlen);
    id[idlen] = 0;
    if (!valid_id(id)) { respond_error(r, 400, "bad delivery id"); return; }
    const char *action = slash ? slash + 1 : NULL;
    if (!action) {
        if (get) {
            if (!op_start(r)) return;
            d->store->vt->get(d->store, id, on_get, r);
        } else if (del) {
            if (!allowed(r)) return;
            if (!d->store->vt->remove) { not_supported(r); return; }
            if (!op_start(r)) return;
            snprintf(r->audit, sizeof r->audit, "delete delivery %s", id);
            d->store->vt->remove(d->store, id, on_remove, r);
        } else {
            r->allow = "GET, HEAD, DELETE";
            respond_error(r, 405, "method not allowed");
        }
        return;
    }
    int kick = !strcmp(action, "kick"), bury = !strcmp(action, "bury");
    int cancel = !strcmp(action, "cancel");
    if (!kick && !bury && !cancel) { respond_error(r, 404, "not found"); return; }
    if (!post) { r->allow = "POST"; respond_error(r, 405, "method not allowed"); return; }
    if (!allowed(r)) return;
    if ((bury && !d->store->vt->bury) || (cancel && !d->store->vt->cancel)) {
        not_supported(r);
        return;
    }
    if (!op_start(r)) return;
    snprintf(r->audit, sizeof r->audit, "%s delivery %s", action, id);
    if (kick) d->store->vt->kick(d->store, RB_KICK_ONE, id, NULL, on_kick_one, r);
    else if (bury) d->store->vt->bury(d->store, id, BURY_REASON, on_bury, r);
    else d->store->vt->cancel(d->store, id, CANCEL_REASON, on_bury, r);
}

/* On a loopback address only a Host that names it: a page of another site that resolves its
 * own name to 127.0.0.1 (DNS rebinding) gets 421, not the data. */
static int host_ok(rb_dashboard *d, struct MHD_Connection *conn)
{
    if (!d->loopback) return 1;
    const char *h = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Host");
    if (!h) return 0;
    char want[128];
    snprintf(want, sizeof want, "%s:%d", d->host, d->port);
    if (!strcmp(h, want)) return 1;
    snprintf(want, sizeof want, "localhost:%d", d->port);
    if (!strcmp(h, want)) return 1;
    snprintf(want, sizeof want, "127.0.0.1:%d", d->port);
    if (!strcmp(h, want)) return 1;
    snprintf(want, sizeof want, "[::1]:%d", d->port);
    return !strcmp(h, want);
}

static enum MHD_Result queue(req *r)
{
    size_t len = r->body.len;
    char *data = r->body.data;
    r->body.data = NULL;
    rb_buf_free(&r->body);
    struct MHD_Response *resp = data
        ? MHD_create_response_from_buffer(len, data, MHD_RESPMEM_MUST_FREE)
        : MHD_create_response_from_buffer(0, (void *)"", MHD_RESPMEM_PERSISTENT);
    if (!resp) { free(data); return MHD_NO; }
    MHD_add_response_header(resp, "Content-Type", r->ctype ? r->ctype : "text/plain");
    MHD_add_response_header(resp, "Cache-Control", "no-store");
    MHD_add_response_header(resp, "X-Content-Type-Options", "nosniff");
    MHD_add_response_header(resp, "X-Frame-Options", "DENY");
    MHD_add_response_header(resp, "Referrer-Policy", "no-referrer");
    MHD_add_response_header(resp, "Content-Security-Policy",
                            "default-src 'none'; script-src 'self'; style-src 'self';"
                            " connect-src 'self'; img-src 'self'; base-uri 'none';"
                            " form-action 'none'; frame-ancestors 'none'");
    if (r->allow) MHD_add_response_header(resp, "Allow", r->allow);
    if (r->auth_challenge) MHD_add_response_header(resp, "WWW-Authenticate", "Bearer");
    if (r->status == 503) MHD_add_response_header(resp, "Retry-After", "1");
    enum MHD_Result rc = MHD_queue_response(r->conn, r->status, resp);
    MHD_destroy_response(resp);
    return rc;
}

/* A %00 anywhere in the URL is refused: MHD decodes it in place, and the path or argument
 * would be read cut short at it ("/api/deliveries/1%00" as id 1, "topic=t%00x" as "t"). The
 * raw URL is seen here, before decoding; what this returns is the request's first con_cls. */
static char url_has_nul, id_has_nul;
static void *on_uri(void *cls, const char *uri, struct MHD_Connection *conn)
{
    (void)cls;
    (void)conn;
    const char *query = uri ? strchr(uri, '?') : NULL;
    for (const char *p = uri; p && (p = strchr(p, '%')) != NULL; p++)
        if (p[1] == '0' && p[2] == '0')
            return strncmp(uri, "/api/deliveries/", 16) == 0 && (!query || p < query)
                       ? (void *)&id_has_nul : (void *)&url_has_nul;
    return NULL;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version,
                                  const char *upload_data, size_t *upload_size, void **con_cls)
{
    (void)version;
    (void)upload_data;
    rb_dashboard *d = cls;
    req *r = *con_cls;
    int nul = r == (void *)&url_has_nul ? 1 : r == (void *)&id_has_nul ? 2 : 0;
    if (nul) r = NULL;
    if (!r) {
        sock *k = sock_of(conn);
        if (k) sockq_push(&d->answers, k, rb_monotonic() + ANSWER_TIMEOUT);
        r = rb_calloc(1, sizeof *r);
        if (!r) return MHD_NO;
        r->d = d;
        r->conn = conn;
        rb_buf_init(&r->body);
        RB_LIST_PUSH(&d->reqs, r);
        *con_cls = r;
        /* No request here has a body: refuse one before reading it. */
        const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Content-Length");
        const char *te = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Transfer-Encoding");
        if ((cl && strcmp(cl, "0") != 0) || te) {
            r->body_seen = 1;
            respond_error(r, 413, "requests here carry no body");
        } else if (nul) {
            respond_error(r, 400, nul == 2 ? "bad delivery id" : "a URL here cannot hold %00");
        }
        return MHD_YES;
    }
    if (*upload_size) {         /* a body after all: drop it, the answer is 413 */
        *upload_size = 0;
        if (!r->body_seen) { r->body_seen = 1; respond_error(r, 413, "requests here carry no body"); }
        return MHD_YES;
    }
    if (r->phase == R_READY) return queue(r);
    if (r->phase == R_WAIT) {   /* resumed before its answer: wait on */
        MHD_suspend_connection(conn);
        r->suspended = 1;
        return MHD_YES;
    }
    if (!host_ok(d, conn)) respond_error(r, 421, "wrong Host for this server");
    else route(r, method, url);
    if (r->phase == R_READY) return queue(r);
    MHD_suspend_connection(conn);
    r->suspended = 1;
    return MHD_YES;
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode code)
{
    rb_dashboard *d = cls;
    /* answered, the connection kept alive: the next request's head is timed from here */
    sock *k = code == MHD_REQUEST_TERMINATED_COMPLETED_OK ? sock_of(conn) : NULL;
    if (k && k->on) sockq_push(&d->heads, k, rb_monotonic() + HEAD_TIMEOUT);
    req *r = *con_cls;
    *con_cls = NULL;
    if (!r || r == (void *)&url_has_nul || r == (void *)&id_has_nul) return;
    r->closed = 1;
    r->suspended = 0;
    if (!r->inflight) req_free(r);  /* else the store's callback (or the snapshot) frees it */
}

static void mhd_log(void *cls, const char *fmt, va_list ap)
{
    (void)cls;
    char line[256];
    vsnprintf(line, sizeof line, fmt, ap);
    static rb_log_limit lim;
    rb_log_limited(&lim, RB_LOG_WARN, "dashboard: %s", line);
}

/* ---- the loop --------------------------------------------------------------------------- */
static void run_mhd(rb_dashboard *d)
{
    if (d->in_run) return;
    d->in_run = 1;
    MHD_run(d->mhd);
    d->in_run = 0;
    MHD_UNSIGNED_LONG_LONG ms = 0;
    double after = 1.0;         /* idle connections are timed out within a second */
    if (MHD_get_timeout(d->mhd, &ms) == MHD_YES && ms / 1000.0 < after) after = ms / 1000.0;
    double late = cut_late(d);
    if (late < after) after = late;
    schedule_run(d, after);
}

static void on_io(struct ev_loop *loop, ev_io *w, int revents)
{
    (void)loop;
    (void)revents;
    run_mhd(w->data);
}

static void on_tick(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop;
    (void)revents;
    run_mhd(w->data);
}

/* ---- life ------------------------------------------------------------------------------- */
void rb_dashboard_options_init(rb_dashboard_options *o)
{
    memset(o, 0, sizeof *o);
    o->listen = RB_DASHBOARD_LISTEN;
    o->cache = 1;
}

static int parse_listen(const char *listen, char *host, size_t hcap, char *port, size_t pcap)
{
    const char *colon = strrchr(listen, ':');
    if (!colon || !colon[1]) return 0;
    size_t hl = (size_t)(colon - listen);
    const char *h = listen;
    if (hl >= 2 && h[0] == '[' && h[hl - 1] == ']') { h++; hl -= 2; }
    if (hl == 0 || hl >= hcap || strlen(colon + 1) >= pcap) return 0;
    memcpy(host, h, hl);
    host[hl] = 0;
    strcpy(port, colon + 1);
    for (const char *p = port; *p; p++) if (*p < '0' || *p > '9') return 0;
    return atoi(port) <= 65535;
}

rb_dashboard *rb_dashboard_new(struct ev_loop *loop, rb_store *store,
                               const rb_dashboard_options *o, char *err, size_t errlen)
{
    rb_dashboard_options defaults;
    if (!o) { rb_dashboard_options_init(&defaults); o = &defaults; }
    const char *listen = o->listen && *o->listen ? o->listen : RB_DASHBOARD_LISTEN;
    char host[64], port[8], shown[96];
    rb_one_line(shown, sizeof shown, listen);
    if (!parse_listen(listen, host, sizeof host, port, sizeof port)) {
        snprintf(err, errlen, "dashboard: listen must be HOST:PORT, not '%s'", shown);
        return NULL;
    }
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV}, *ai = NULL;
    int gai = getaddrinfo(host, port, &hints, &ai);
    if (gai != 0 || !ai) {
        snprintf(err, errlen, "dashboard: cannot resolve '%s': %s", shown, gai_strerror(gai));
        return NULL;
    }
    rb_dashboard *d = rb_calloc(1, sizeof *d);
    if (!d) { freeaddrinfo(ai); snprintf(err, errlen, "dashboard: out of memory"); return NULL; }
    d->loop = loop;
    d->store = store;
    d->metrics = o->metrics;
    d->cache = o->cache > 0 && o->cache < 3600 ? o->cache : 1;
    if (o->token && *o->token) {
        d->token = rb_strdup(o->token);
        d->token_len = strlen(o->token);
        if (!d->token) { free(d); freeaddrinfo(ai); snprintf(err, errlen, "dashboard: out of memory"); return NULL; }
    }
    struct sockaddr_storage sa;
    memcpy(&sa, ai->ai_addr, ai->ai_addrlen);
    int v6 = ai->ai_family == AF_INET6;
    freeaddrinfo(ai);
    if (v6) {
        const struct in6_addr *a = &((struct sockaddr_in6 *)&sa)->sin6_addr;
        d->loopback = IN6_IS_ADDR_LOOPBACK(a);
        char text[INET6_ADDRSTRLEN];
        inet_ntop(AF_INET6, a, text, sizeof text);
        snprintf(d->host, sizeof d->host, "[%s]", text);
    } else {
        const struct in_addr *a = &((struct sockaddr_in *)&sa)->sin_addr;
        d->loopback = (ntohl(a->s_addr) >> 24) == 127;
        inet_ntop(AF_INET, a, d->host, sizeof d->host);
    }
    unsigned flags = MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG |
                     (v6 ? MHD_USE_IPv6 : 0);
    d->mhd = MHD_start_daemon(flags, 0, NULL, NULL, on_request, d,
                              MHD_OPTION_EXTERNAL_LOGGER, mhd_log, d,
                              MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa,
                              MHD_OPTION_CONNECTION_LIMIT, (unsigned)MHD_CONNECTIONS,
                              MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)PER_IP_CONNECTIONS,
                              MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)CONNECTION_TIMEOUT,
                              MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)MEMORY_LIMIT,
                              MHD_OPTION_NOTIFY_COMPLETED, on_completed, d,
                              MHD_OPTION_NOTIFY_CONNECTION, on_connection, d,
                              MHD_OPTION_URI_LOG_CALLBACK, on_uri, d,
                              MHD_OPTION_END);
    if (!d->mhd) {
        snprintf(err, errlen, "dashboard: cannot listen on %s (in use, or not an address of"
                 " this host)", shown);
        free(d->token);
        free(d);
        return NULL;
    }
    const union MHD_DaemonInfo *pi = MHD_get_daemon_info(d->mhd, MHD_DAEMON_INFO_BIND_PORT);
    d->port = pi ? pi->port : atoi(port);
    snprintf(d->url, sizeof d->url, "http://%s:%d/", d->host, d->port);
    const union MHD_DaemonInfo *ei = MHD_get_daemon_info(d->mhd, MHD_DAEMON_INFO_EPOLL_FD);
    ev_io_init(&d->io, on_io, ei ? ei->epoll_fd : -1, EV_READ);
    d->io.data = d;
    ev_io_start(loop, &d->io);
    rb_timer_init(&d->tick, on_tick, 0, 0);
    d->tick.w.data = d;
    schedule_run(d, 0);
    return d;
}

const char *rb_dashboard_url(const rb_dashboard *d) { return d->url; }
int rb_dashboard_port(const rb_dashboard *d) { return d->port; }

void rb_dashboard_free(rb_dashboard *d)
{
    if (!d) return;
    ev_io_stop(d->loop, &d->io);
    rb_timer_stop(d->loop, &d->tick);
    /* Waiters of the snapshot have no callback of their own: they go with the connections.
     * Suspended connections go back to MHD so that its stop closes them (on_completed frees
     * each request then); a request whose store call is in flight is freed by that call's
     * callback, which finds r->d NULL. */
    for (req *w = d->waiting, *next; w; w = next) { next = w->wait_next; w->wait_next = NULL; w->inflight = 0; }
    d->waiting = NULL;
    if (d->fetching) d->fetching->d = NULL;
    for (req *r = d->reqs; r; r = r->next)
        if (r->suspended) { r->suspended = 0; MHD_resume_connection(r->conn); }
    for (req *r = d->reqs, *next; r; r = next) {
        next = r->next;
        r->prev = r->next = NULL;
        r->d = NULL;
    }
    d->reqs = NULL;
    MHD_stop_daemon(d->mhd);
    rb_rowset_free(d->topics);
    free(d->token);
    free(d);
}

/* Its table for plugin.h: the command and the Lua module load it from relaybus_serve.so. */
const rb_serve_plugin rb_plugin_serve = {
    rb_dashboard_options_init, rb_dashboard_new, rb_dashboard_url, rb_dashboard_port,
    rb_dashboard_free,
};
