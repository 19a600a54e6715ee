/* store_pg_pool.c -- the PostgreSQL store's connections: each a non-blocking libpq connection
 * whose socket is an ev_io on the host's loop, the pool that hands waiting operations to idle
 * connections and opens more (with backoff after failures), and the listener, one more
 * connection that LISTENs for the NOTIFY every enqueue sends. The operations themselves and
 * what their results mean are store_pg.c's. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <libpq-fe.h>
#include "stores/store.h"
#include "util/alloc.h"
#include "util/check.h"
#include "util/clock.h"
#include "util/fifo.h"
#include "util/timer.h"
#include "util/text.h"
#include "stores/pg/store_pg_schema.h"
#include "stores/pg/store_pg_impl.h"

static void conn_lost(pg_conn *c, const char *why);
static void conn_send(pg_conn *c);
static void listen_connect(pg_store *s);
static void listen_schedule(pg_store *s);
static void conn_notice(void *arg, const PGresult *r);

static int is_fatal(const PGresult *r)
{
    const char *sev = PQresultErrorField(r, PG_DIAG_SEVERITY_NONLOCALIZED);
    return sev && (strcmp(sev, "FATAL") == 0 || strcmp(sev, "PANIC") == 0);
}

/* ---- connections ------------------------------------------------------------------------ */

/* Watches the socket for `events`. Idle connections do not keep the loop alive (ev_unref),
 * so a host's ev_run can end while the pool sits idle. */
static void conn_watch(pg_conn *c, int events)
{
    struct ev_loop *loop = c->s->base.loop;
    int fd = c->pq ? PQsocket(c->pq) : -1;
    int want_ref = c->cur != NULL || (c->connecting && !c->listen);
    if (c->io_on && c->io.fd == fd && c->io_events == events && c->io_ref == want_ref) return;
    if (c->io_on) {
        if (!c->io_ref) ev_ref(loop);
        ev_io_stop(loop, &c->io);
        c->io_on = 0;
    }
    if (fd < 0 || !events) return;
    ev_io_set(&c->io, fd, events);
    ev_io_start(loop, &c->io);
    c->io_on = 1;
    c->io_events = events;
    c->io_ref = want_ref;
    if (!want_ref) ev_unref(loop);
}

static void conn_timer_stop(pg_conn *c)
{
    if (!c->timer_on) return;
    ev_ref(c->s->base.loop);
    rb_timer_stop(c->s->base.loop, &c->timeout);
    c->timer_on = 0;
}

/* Unlinks the connection, closes it, and leaves the struct for pg_store_leave to free (a
 * callback of ours may still be on the stack). */
void pg_conn_bury(pg_conn *c)
{
    pg_store *s = c->s;
    if (c->dead) return;
    if (s->listen == c) {
        s->listen = NULL;
        if (s->listen_epoch & 1) s->listen_epoch++;     /* LISTEN is no longer in force */
    }
    for (pg_conn **pp = &s->conns; *pp; pp = &(*pp)->next)
        if (*pp == c) { *pp = c->next; break; }
    conn_watch(c, 0);
    ev_io_stop(s->base.loop, &c->io);   /* also drops an event fed by pg_conn_break */
    conn_timer_stop(c);
    if (c->pq) PQfinish(c->pq);
    c->pq = NULL;
    if (c->res) PQclear(c->res);
    c->res = NULL;
    free(c->err);
    c->err = NULL;
    c->dead = 1;
    c->next = s->graveyard;
    s->graveyard = c;
}

static void conn_io_cb(struct ev_loop *loop, ev_io *w, int revents);

static void conn_timeout_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    pg_conn *c = w->data;
    pg_store *s = c->s;
    pg_store_enter(s);
    c->timer_on = 0;
    ev_ref(loop);           /* the timer stopped itself; balance its ev_unref */
    conn_lost(c, "timeout expired while connecting");
    pg_store_leave(s);
}

/* Starts an asynchronous connect; NULL (with err) when libpq refuses at once. */
static pg_conn *conn_start_connect(pg_store *s, int listen, char *err, size_t errlen)
{
    pg_conn *c = rb_calloc(1, sizeof *c);
    if (!c) { snprintf(err, errlen, "postgresql: out of memory"); return NULL; }
    c->s = s;
    c->listen = listen;
    c->pq = PQconnectStartParams(s->kw, s->vals, 1);
    if (!c->pq || PQstatus(c->pq) == CONNECTION_BAD) {
        rb_pg_one_line(err, errlen, c->pq ? PQerrorMessage(c->pq) : "out of memory");
        if (c->pq) PQfinish(c->pq);
        free(c);
        return NULL;
    }
    PQsetNoticeReceiver(c->pq, conn_notice, c);
    c->connecting = 1;
    ev_init(&c->io, conn_io_cb);
    c->io.data = c;
    rb_timer_init(&c->timeout, conn_timeout_cb, PG_CONNECT_TIMEOUT, 0);
    c->timeout.w.data = c;
    rb_timer_start(s->base.loop, &c->timeout);
    ev_unref(s->base.loop);
    c->timer_on = 1;
    if (listen) s->listen = c;
    else { c->next = s->conns; s->conns = c; }
    conn_watch(c, EV_WRITE);    /* libpq: poll for writing first */
    return c;
}

/* A connection libpq could not use: handled from the loop, never inside the caller's call. */
void pg_conn_break(pg_conn *c)
{
    c->broken = 1;
    ev_feed_event(c->s->base.loop, &c->io, EV_READ);
}

static void conn_flush(pg_conn *c)
{
    int r = PQflush(c->pq);
    if (r < 0) { pg_conn_break(c); return; }
    conn_watch(c, r ? EV_READ | EV_WRITE : EV_READ);
}

void pg_conn_start_op(pg_conn *c, pg_op *op)
{
    op->next = NULL;
    c->cur = op;
    conn_send(c);
}

/* What a connection's flags never combine to: the listener runs only its LISTEN and holds no
 * transaction; a statement is in flight only on a connection that is up; a PREPARE waits only
 * for a statement; a transaction's statements wait only on its connection. */
static void conn_check(const pg_conn *c)
{
    RB_ASSERT(!(c->listen && c->tx));
    RB_ASSERT(!c->cur || (!c->connecting && !c->dead));
    RB_ASSERT(!c->preparing || c->cur);
    RB_ASSERT(RB_FIFO_EMPTY(&c->q) || c->tx);
    RB_ASSERT(!c->tx || c->tx->conn == c);
}

static void conn_send(pg_conn *c)
{
    pg_op *op = c->cur;
    conn_check(c);
    pg_store *s = c->s;
    const char *const *params = (const char *const *)op->params;
    int ok;
    if (op->stmt >= 0 && !(c->prepared & (1u << op->stmt))) {
        c->preparing = 1;
        ok = PQsendPrepare(c->pq, rb_pg_stmt_names[op->stmt], s->stmt_sql[op->stmt], 0, NULL);
    } else if (op->stmt >= 0) {
        c->preparing = 0;
        ok = PQsendQueryPrepared(c->pq, rb_pg_stmt_names[op->stmt], op->nparams, params, NULL, NULL, 0);
    } else {
        c->preparing = 0;
        ok = PQsendQueryParams(c->pq, op->sql, op->nparams, NULL, params, NULL, NULL, 0);
    }
    if (!ok) { pg_conn_break(c); return; }
    op->sent = 1;
    conn_flush(c);
}

/* The next statement for an idle connection: its transaction's, or the pool's. */
static void conn_next(pg_conn *c)
{
    conn_check(c);
    if (c->cur || c->dead || c->connecting) return;
    if (c->tx) {
        pg_op *op;
        RB_FIFO_POP(&c->q, &op);
        if (op) pg_conn_start_op(c, op);
        else conn_watch(c, EV_READ);
    } else {
        conn_watch(c, EV_READ);
        pg_pump(c->s);
    }
}

/* libpq hands an error that arrives on an idle connection to the notice receiver; a FATAL
 * there (terminated, shutting down) means the server is closing this connection. */
static void conn_notice(void *arg, const PGresult *r)
{
    pg_conn *c = arg;
    if (!is_fatal(r)) return;
    const char *m = PQresultErrorField(r, PG_DIAG_MESSAGE_PRIMARY);
    snprintf(c->fatal, sizeof c->fatal, "%s", m && *m ? m : "the server closed the connection");
}

/* An idle connection is alive unless the server said goodbye (a FATAL, or end of file waiting
 * in the socket). One non-blocking read, so an operation is not handed to a connection that
 * died while idle (after a server restart, all of them did). */
static int conn_alive(pg_conn *c)
{
    if (!PQconsumeInput(c->pq)) return 0;
    PGresult *r;
    while (!PQisBusy(c->pq) && (r = PQgetResult(c->pq))) PQclear(r);
    return !c->fatal[0] && PQstatus(c->pq) != CONNECTION_BAD;
}

static const char *conn_why(pg_conn *c) { return c->fatal[0] ? c->fatal : PQerrorMessage(c->pq); }

static void conn_keep_result(pg_conn *c, PGresult *r)
{
    ExecStatusType st = PQresultStatus(r);
    if (st == PGRES_FATAL_ERROR || st == PGRES_BAD_RESPONSE || st == PGRES_NONFATAL_ERROR) {
        if (!c->err) {
            const char *state = PQresultErrorField(r, PG_DIAG_SQLSTATE);
            c->deadlock = state && strcmp(state, "40P01") == 0;
            c->err = rb_pg_result_error(r);
        }
        PQclear(r);
        return;
    }
    if (c->res) PQclear(c->res);
    c->res = r;
}

/* Hands the finished statement to its operation, then gives the connection more work. A
 * statement of its own transaction that PostgreSQL aborted to break a deadlock wrote nothing
 * and let the other side through: it goes again, first in line, up to PG_DEADLOCK_TRIES in
 * all, rather than fail its caller (an operator's cancel beside a claim that settles the head
 * of the same group takes their two locks in the other order). */
#define PG_DEADLOCK_TRIES 3
static void conn_finish_op(pg_conn *c)
{
    pg_store *s = c->s;
    pg_op *op = c->cur;
    PGresult *res = c->res;
    char *err = c->err;
    int deadlock = err && c->deadlock;
    conn_check(c);
    RB_ASSERT(op != NULL);
    c->cur = NULL;
    c->res = NULL;
    c->err = NULL;
    c->deadlock = 0;
    conn_watch(c, EV_READ);
    if (deadlock && !op->in_tx && !op->tx && op->deadlocks + 1 < PG_DEADLOCK_TRIES && !s->closed) {
        op->deadlocks++;
        op->sent = 0;
        if (res) PQclear(res);
        free(err);
        RB_FIFO_PUSH_FRONT_LIST(&s->ops, op, op);
        if (c->fatal[0] || PQstatus(c->pq) == CONNECTION_BAD) { conn_lost(c, conn_why(c)); return; }
        conn_next(c);
        return;
    }
    if (!err && !res) err = rb_strdup("postgresql: no result");
    if (op->in_tx && op->tx) pg_tx_statement_done(op->tx, c, err);
    op->done(op, err ? NULL : res, err);
    if (res) PQclear(res);
    free(err);
    if (s->closed || c->dead) return;
    if (c->fatal[0] || PQstatus(c->pq) == CONNECTION_BAD) { conn_lost(c, conn_why(c)); return; }
    conn_next(c);
}

/* A PREPARE finished: send the statement itself (1), or fail the operation (0). */
static int conn_prepared(pg_conn *c)
{
    if (c->res) PQclear(c->res);
    c->res = NULL;
    if (c->err) { c->preparing = 0; conn_finish_op(c); return 0; }
    c->prepared |= 1u << c->cur->stmt;
    conn_send(c);
    return 1;
}

static void conn_read(pg_conn *c)
{
    if (!PQconsumeInput(c->pq)) { conn_lost(c, conn_why(c)); return; }
    if (c->io_events & EV_WRITE) {      /* libpq: after reading, flush what is left */
        conn_flush(c);
        if (c->broken) return;
    }
    while (c->cur && !c->broken && !PQisBusy(c->pq)) {
        PGresult *r = PQgetResult(c->pq);
        if (r) { conn_keep_result(c, r); continue; }
        if (c->preparing) {
            if (!conn_prepared(c)) return;
            continue;
        }
        conn_finish_op(c);
        return;     /* the connection may be serving someone else now */
    }
    if (!c->cur && !conn_alive(c)) conn_lost(c, conn_why(c));
}

static void conn_ready(pg_conn *c);
static void listen_io(pg_conn *c, int revents);

static void conn_connect_step(pg_conn *c)
{
    switch (PQconnectPoll(c->pq)) {
    case PGRES_POLLING_READING: conn_watch(c, EV_READ); break;
    case PGRES_POLLING_WRITING: conn_watch(c, EV_WRITE); break;
    case PGRES_POLLING_OK: conn_ready(c); break;
    default: conn_lost(c, PQerrorMessage(c->pq)); break;
    }
}

static void conn_io_cb(struct ev_loop *loop, ev_io *w, int revents)
{
    (void)loop;
    pg_conn *c = w->data;
    pg_store *s = c->s;
    pg_store_enter(s);
    if (c->dead) {
        /* nothing: buried while its event was pending */
    } else if (c->broken) {
        conn_lost(c, conn_why(c));
    } else if (c->connecting) {
        conn_connect_step(c);
    } else if (c->listen) {
        listen_io(c, revents);
    } else {
        if (revents & EV_WRITE) conn_flush(c);
        if ((revents & EV_READ) && !c->broken && !c->dead) conn_read(c);
    }
    pg_store_leave(s);
}

/* ---- the pool --------------------------------------------------------------------------- */

static void retry_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    pg_store *s = w->data;
    pg_store_enter(s);
    s->retry_on = 0;
    pg_pump(s);
    pg_store_leave(s);
}

static void backoff_bump(pg_store *s)
{
    s->backoff = s->backoff > 0 ? s->backoff * 2 : PG_BACKOFF_MIN;
    if (s->backoff > PG_BACKOFF_MAX) s->backoff = PG_BACKOFF_MAX;
    s->retry_at = ev_now(s->base.loop) + s->backoff;
}

/* Counts the pool: all, connecting, bound to a transaction, idle and free for anything. */
static void pool_count(pg_store *s, int *all, int *connecting, int *tx, int *idle)
{
    *all = *connecting = *tx = *idle = 0;
    for (pg_conn *c = s->conns; c; c = c->next) {
        (*all)++;
        if (c->connecting) (*connecting)++;
        else if (c->tx) (*tx)++;
        else if (!c->cur && !c->broken) (*idle)++;
    }
}

/* With no connection to serve them, waiting operations fail now rather than hang. */
static void fail_waiting(pg_store *s, const char *err)
{
    pg_op *ops, *begins;
    RB_FIFO_TAKE_ALL(&s->ops, &ops);
    RB_FIFO_TAKE_ALL(&s->begins, &begins);
    pg_fail_list(ops, err);
    pg_fail_list(begins, err);
}

static void maybe_connect(pg_store *s)
{
    int all, connecting, ntx, idle;
    pool_count(s, &all, &connecting, &ntx, &idle);
    if (connecting || all >= PG_MAX_CONNS) return;     /* one connect at a time */
    int need = (s->ops.head && all - ntx < PG_OP_CONNS) || (s->begins.head && ntx < PG_MAX_TX);
    if (!need) return;
    double now = ev_now(s->base.loop);
    if (now < s->retry_at) {
        if (!s->retry_on) {
            rb_timer_set(&s->retry, s->retry_at - now, 0);
            rb_timer_start(s->base.loop, &s->retry);
            s->retry_on = 1;
        }
        return;
    }
    char err[ERRLEN];
    if (!conn_start_connect(s, 0, err, sizeof err)) {
        backoff_bump(s);
        if (!idle) fail_waiting(s, err);
    }
}

static void tx_bind(pg_store *s, pg_conn *c, rb_tx *tx)
{
    tx->conn = c;
    c->tx = tx;
    tx->next = s->txs;
    s->txs = tx;
}

/* Gives waiting operations to idle connections, and opens one more when they are too few. */
void pg_pump(pg_store *s)
{
    if (s->closed) return;
    int all, connecting, ntx, idle;
    pool_count(s, &all, &connecting, &ntx, &idle);
    for (pg_conn *c = s->conns; c && (s->ops.head || s->begins.head); c = c->next) {
        if (c->connecting || c->cur || c->tx || c->broken || c->dead) continue;
        if (!conn_alive(c)) { pg_conn_break(c); continue; }
        if (s->ops.head) {
            pg_op *op;
            RB_FIFO_POP(&s->ops, &op);
            pg_conn_start_op(c, op);
        } else if (ntx < PG_MAX_TX) {
            pg_op *op;
            RB_FIFO_POP(&s->begins, &op);
            tx_bind(s, c, op->tx);
            ntx++;
            pg_conn_start_op(c, op);
        } else {
            break;
        }
    }
    maybe_connect(s);
}

static void conn_ready(pg_conn *c)
{
    pg_store *s = c->s;
    c->connecting = 0;
    conn_timer_stop(c);
    PQsetnonblocking(c->pq, 1);
    if (c->listen) {
        s->listen_backoff = 0;
        char sql[100];
        snprintf(sql, sizeof sql, "LISTEN \"%s\"", s->base.table);
        if (!PQsendQuery(c->pq, sql)) { pg_conn_break(c); return; }
        c->listen_pending = 1;
        conn_flush(c);
        return;
    }
    s->backoff = 0;
    s->retry_at = 0;
    conn_watch(c, EV_READ);
    pg_pump(s);
}

void pg_tx_unbind(rb_tx *tx)
{
    if (!tx->conn) return;
    tx->conn->tx = NULL;
    tx->conn = NULL;
}

/* A connection failed (connecting, or in use). Its statements fail; one never sent goes back
 * to the pool's queue; a transaction on it is lost. */
static void conn_lost(pg_conn *c, const char *why)
{
    pg_store *s = c->s;
    char err[ERRLEN];
    rb_pg_one_line(err, sizeof err, why && *why ? why : "connection lost");
    if (c->listen) {
        int was_connecting = c->connecting, was_listening = s->listen_epoch & 1;
        pg_conn_bury(c);
        if (was_connecting) listen_schedule(s);
        else listen_connect(s);     /* a ready listener lost: try again at once */
        /* Dispatchers sleeping until the next delivery falls due claim now, and (their answer
         * telling no more) poll every poll_interval until it is back. */
        if (was_listening && s->wake_fn) s->wake_fn(s->wake_ud);
        return;
    }
    int was_connecting = c->connecting;
    pg_op *failed = NULL, **tail = &failed;
    pg_op *cur = c->cur;
    c->cur = NULL;
    if (cur && !cur->sent && !cur->tx) {
        RB_FIFO_PUSH_FRONT_LIST(&s->ops, cur, cur);   /* never reached the server: safe elsewhere */
    } else if (cur) {
        *tail = cur;
        tail = &cur->next;
    }
    RB_FIFO_TAKE_ALL(&c->q, tail);
    if (c->tx) {
        snprintf(c->tx->err, sizeof c->tx->err, "%s", err);
        pg_tx_unbind(c->tx);
    }
    pg_conn_bury(c);
    if (was_connecting) {
        backoff_bump(s);
        int all, connecting, ntx, idle;
        pool_count(s, &all, &connecting, &ntx, &idle);
        if (!idle) fail_waiting(s, err);
    }
    pg_fail_list(failed, err);
    pg_pump(s);
}

/* ---- LISTEN ----------------------------------------------------------------------------- */

static void listen_timer_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)revents;
    pg_store *s = w->data;
    pg_store_enter(s);
    s->listen_timer_on = 0;
    ev_ref(loop);
    if (s->wake_fn && !s->listen && !s->closed) listen_connect(s);
    pg_store_leave(s);
}

/* The listener's next attempt, after a failed one: backoff, doubling up to a limit. */
static void listen_schedule(pg_store *s)
{
    if (s->closed || !s->wake_fn || s->listen || s->listen_timer_on) return;
    s->listen_backoff = s->listen_backoff > 0 ? s->listen_backoff * 2 : PG_BACKOFF_MIN;
    if (s->listen_backoff > PG_BACKOFF_MAX) s->listen_backoff = PG_BACKOFF_MAX;
    rb_timer_set(&s->listen_timer, s->listen_backoff, 0);
    rb_timer_start(s->base.loop, &s->listen_timer);
    ev_unref(s->base.loop);     /* a listener alone does not keep the host's loop running */
    s->listen_timer_on = 1;
}

static void listen_connect(pg_store *s)
{
    if (s->closed || !s->wake_fn || s->listen || s->listen_timer_on) return;
    char err[ERRLEN];
    if (!conn_start_connect(s, 1, err, sizeof err)) listen_schedule(s);
}

void pg_listen_stop(pg_store *s)
{
    if (s->listen) pg_conn_bury(s->listen);
    if (s->listen_timer_on) {
        ev_ref(s->base.loop);
        rb_timer_stop(s->base.loop, &s->listen_timer);
        s->listen_timer_on = 0;
    }
}

/* Notifications are hints: any number of them since the last read is one wake-up. After a
 * (re)connect, wake once too: NOTIFYs sent while the listener was away are lost. */
/* "cancel ID TOKEN" (rb_pg_sql_cancel_one): the run of ID under TOKEN was cancelled;
 * "schedules": a schedule was made, changed or removed. Other payloads (the empty one of an
 * enqueue) only wake. */
static void notified(pg_store *s, const char *payload)
{
    char id[24], token[65];
    if (payload && sscanf(payload, "cancel %23[0-9] %64[0-9a-f]", id, token) == 2)
        rb_store_cancelled(&s->base, id, token);
    else if (payload && strcmp(payload, "schedules") == 0)
        rb_store_schedules_changed(&s->base);
}

static void listen_io(pg_conn *c, int revents)
{
    pg_store *s = c->s;
    if (revents & EV_WRITE) {
        conn_flush(c);
        if (c->broken) return;
    }
    if (!(revents & EV_READ)) return;
    if (!PQconsumeInput(c->pq)) { conn_lost(c, conn_why(c)); return; }
    int wake = 0;
    PGresult *r;
    while (!PQisBusy(c->pq) && (r = PQgetResult(c->pq))) {
        c->listen_failed |= PQresultStatus(r) != PGRES_COMMAND_OK;
        PQclear(r);
    }
    if (c->listen_pending && !PQisBusy(c->pq)) {
        c->listen_pending = 0;
        wake = 1;
        /* (refused, as on a standby: notifications are not heard, dispatchers keep polling) */
        /* (a new listener: claims name it, and its notifications may well arrive) */
        if (!c->listen_failed && !(s->listen_epoch & 1)) s->listen_epoch++;
    }
    PGnotify *n;
    while ((n = PQnotifies(c->pq))) {
        wake = 1;
        notified(s, n->extra);
        PQfreemem(n);
    }
    if (c->fatal[0] || PQstatus(c->pq) == CONNECTION_BAD) { conn_lost(c, conn_why(c)); return; }
    if (wake && s->wake_fn) s->wake_fn(s->wake_ud);
}

void pg_set_wakeup(rb_store *bs, void (*fn)(void *ud), void *ud)
{
    pg_store *s = (pg_store *)bs;
    pg_store_enter(s);
    s->wake_fn = fn;
    s->wake_ud = ud;
    if (fn) listen_connect(s);
    else { pg_listen_stop(s); s->listen_backoff = 0; }
    pg_store_leave(s);
}


/* ---- the pool's start --------------------------------------------------------------------- */

/* The pool's timers, before anything else of the store runs. */
void pg_pool_init(pg_store *s)
{
    rb_timer_init(&s->retry, retry_cb, 0, 0);
    s->retry.w.data = s;
    rb_timer_init(&s->listen_timer, listen_timer_cb, 0, 0);
    s->listen_timer.w.data = s;
}

/* Wraps open()'s blocking connection as the pool's first. */
int pg_pool_adopt(pg_store *s, PGconn *pq)
{
    pg_conn *c = rb_calloc(1, sizeof *c);
    if (!c) return 0;
    c->s = s;
    c->pq = pq;
    ev_init(&c->io, conn_io_cb);
    c->io.data = c;
    rb_timer_init(&c->timeout, conn_timeout_cb, 0, 0);
    c->timeout.w.data = c;
    PQsetnonblocking(pq, 1);
    PQsetNoticeReceiver(pq, conn_notice, c);
    c->next = s->conns;
    s->conns = c;
    conn_watch(c, EV_READ);
    return 1;
}

