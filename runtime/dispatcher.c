/* dispatcher.c -- the claim / run / renew / settle cycle, on the host's libev loop.
 *
 * A dispatcher claims due deliveries in batches sized to its free slots, starts one run per
 * delivery through the topic's handler, renews each lease every third of its duration and
 * keeps a local deadline on the monotonic clock (measured from just before the claim or
 * renewal was sent, less a safety margin) so a run is aborted before the store's expiry lets
 * anyone else claim it. Settle writes made during one loop iteration are coalesced into one
 * fenced store call, flushed from an ev_prepare watcher just before the loop blocks. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "dispatcher.h"
#include "log.h"

/* ---- the registry of unsettled runs of this process ------------------------------------ */
/* Keyed by (store, id): a delivery is never started again here while an earlier run of it has
 * not settled (a lease that expired under a frozen process, then reclaimed by us). */
typedef struct active_entry {
    const rb_store *store;
    const char *id;             /* points into the run's record */
    rb_run *run;
    struct active_entry *next;
} active_entry;

static active_entry **active_buckets;
static size_t active_nbuckets, active_count;

static size_t hash_id(const rb_store *s, const char *id)
{
    size_t h = (size_t)s * 31u;
    for (const unsigned char *p = (const unsigned char *)id; *p; p++) h = h * 131u + *p;
    return h;
}

static void active_grow(void)
{
    size_t n = active_nbuckets ? active_nbuckets * 2 : 256;
    active_entry **b = calloc(n, sizeof *b);
    if (!b) return;     /* keep the old table; chains just get longer */
    for (size_t i = 0; i < active_nbuckets; i++) {
        for (active_entry *e = active_buckets[i], *next; e; e = next) {
            next = e->next;
            size_t k = hash_id(e->store, e->id) % n;
            e->next = b[k];
            b[k] = e;
        }
    }
    free(active_buckets);
    active_buckets = b;
    active_nbuckets = n;
}

static rb_run *active_find(const rb_store *s, const char *id)
{
    if (!active_nbuckets) return NULL;
    for (active_entry *e = active_buckets[hash_id(s, id) % active_nbuckets]; e; e = e->next)
        if (e->store == s && strcmp(e->id, id) == 0) return e->run;
    return NULL;
}

static int active_add(const rb_store *s, const char *id, rb_run *run)
{
    if (active_count >= active_nbuckets) active_grow();
    if (!active_nbuckets) return -1;
    active_entry *e = malloc(sizeof *e);
    if (!e) return -1;
    size_t k = hash_id(s, id) % active_nbuckets;
    *e = (active_entry){s, id, run, active_buckets[k]};
    active_buckets[k] = e;
    active_count++;
    return 0;
}

static void active_remove(const rb_store *s, const char *id, rb_run *run)
{
    if (!active_nbuckets) return;
    for (active_entry **pp = &active_buckets[hash_id(s, id) % active_nbuckets]; *pp;
         pp = &(*pp)->next) {
        if ((*pp)->run == run) {
            active_entry *e = *pp;
            *pp = e->next;
            free(e);
            active_count--;
            return;
        }
    }
}

/* ---- structures ------------------------------------------------------------------------- */
typedef struct handler_entry {
    char *topic;
    rb_handler_def def;
} handler_entry;

typedef enum {
    RUN_WAITING,        /* parked behind an earlier unsettled run of the same delivery */
    RUN_BEGINNING,      /* transactional: waiting for the store transaction */
    RUN_RUNNING,        /* the handler runs */
    RUN_SETTLING,       /* the handler ended; its settle write is in flight */
    RUN_SETTLED         /* done; freed when no store operation refers to it any more */
} run_state;

typedef struct settle_req settle_req;

struct rb_run {
    rb_dispatcher *d;
    handler_entry *h;
    rb_delivery *rec;
    run_state state;
    rb_abort_reason aborted;
    int settled_explicitly;     /* a ctx settle call was written: the return is ignored */
    int abandoned;              /* the stop timed out: write nothing more */
    int refs;                   /* store operations in flight that point at this run */
    int renewing;
    double lease_deadline;      /* monotonic: local end of the lease (with margin) */
    double timeout_deadline;    /* monotonic: the handler's timeout, or INFINITY */
    double shutdown_deadline;   /* monotonic: set by stop's abort phase, or INFINITY */
    ev_timer deadline_timer;
    ev_timer renew_timer;
    rb_tx *tx;
    void *data;
    rb_run *parked;             /* a newer claim of this delivery waiting for us to settle */
    rb_run *prev, *next;        /* the dispatcher's list of unsettled runs */
};

typedef void (*settle_done_fn)(settle_req *r, const char *err);
struct settle_req {
    rb_settle_op op;
    rb_run *run;
    settle_done_fn done;
    double sent_at;
    rb_run_settle_cb ucb;       /* explicit settles: the caller's callback */
    void *uud;
    char *error_copy;           /* owned copy of op.error */
    settle_req *next;
};

typedef struct stop_waiter {
    void (*done)(void *ud);
    void *ud;
    struct stop_waiter *next;
} stop_waiter;

struct rb_dispatcher {
    rb_store *store;
    struct ev_loop *loop;
    rb_dispatcher_options opt;
    double margin;              /* safety margin subtracted from the lease locally */
    handler_entry *handlers;
    size_t nhandlers;
    const char **topics;
    int started, stopping, stopped;
    int backlog;                /* the last claim came back full: more is probably due */
    struct claim_ctx *claims;   /* claims in flight, detached by rb_dispatcher_free */
    size_t nactive;             /* unsettled runs, parked ones included */
    size_t nsettling;           /* of those, runs whose handler ended (settle in flight) */
    rb_run *runs;               /* list of unsettled runs */
    settle_req *queue_head, **queue_tail;   /* settle writes waiting for the flush */
    size_t queued;
    ev_prepare flush_watcher;   /* flushes settle writes and pending claims each iteration */
    ev_idle spin_watcher;       /* keeps the loop from blocking while work is queued */
    ev_timer poll_timer;
    ev_timer claim_retry_timer;
    ev_timer grace_timer;       /* stop: 4/5 of the timeout */
    ev_timer hard_timer;        /* stop: the timeout */
    stop_waiter *waiters;
    int flushing;
    int want_claim;
    rb_dispatcher *next_on_store;
};

/* ---- time ------------------------------------------------------------------------------ */
double rb_monotonic(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

const char *rb_abort_reason_name(rb_abort_reason r)
{
    switch (r) {
    case RB_ABORT_LEASE: return "lease";
    case RB_ABORT_TIMEOUT: return "timeout";
    case RB_ABORT_SHUTDOWN: return "shutdown";
    default: return NULL;
    }
}

void rb_dispatcher_options_init(rb_dispatcher_options *o)
{
    memset(o, 0, sizeof *o);
    o->lease_duration = 30;
    o->shutdown_timeout = 30;
    o->poll_interval = 1;
    o->concurrency = 64;
}

static double default_backoff(int attempts, void *ud)
{
    (void)ud;
    double s = pow(2.0, attempts);
    return s > 3600 ? 3600 : s;
}

/* ---- local wake-ups: every dispatcher on a store hears this process's enqueues ---------- */
static rb_dispatcher *wake_list;

static void on_local_enqueue(void *ud)
{
    rb_store *s = ud;
    for (rb_dispatcher *d = wake_list; d; d = d->next_on_store)
        if (d->store == s) rb_dispatcher_wake(d);
}

static void wake_list_add(rb_dispatcher *d)
{
    d->next_on_store = wake_list;
    wake_list = d;
    d->store->local_wakeup = on_local_enqueue;
    d->store->local_wakeup_ud = d->store;
}

static void wake_list_remove(rb_dispatcher *d)
{
    for (rb_dispatcher **pp = &wake_list; *pp; pp = &(*pp)->next_on_store) {
        if (*pp == d) {
            *pp = d->next_on_store;
            break;
        }
    }
}

static void on_store_notify(void *ud) { on_local_enqueue(ud); }

/* ---- forward declarations ---------------------------------------------------------------- */
static void maybe_claim(rb_dispatcher *d);
static void request_flush(rb_dispatcher *d);
static void run_abort(rb_run *run, rb_abort_reason reason);
static void run_settled(rb_run *run);
static void run_start(rb_run *run);
static void check_stop_done(rb_dispatcher *d);
static void write_final(rb_run *run, rb_settle_kind kind, double delay, const char *error);

/* ---- pools ------------------------------------------------------------------------------- */
/* Runs and settle requests come and go with every delivery: finished ones are kept for reuse
 * instead of going back to malloc. Per thread, since each loop runs on its own thread. */
#define POOL_MAX 1024
typedef struct pooled { struct pooled *next; } pooled;
typedef struct pool { pooled *head; size_t n; } pool;
static _Thread_local pool run_pool, settle_pool;

static void *pool_get(pool *p, size_t size)
{
    pooled *x = p->head;
    if (!x) return calloc(1, size);
    p->head = x->next;
    p->n--;
    memset(x, 0, size);
    return x;
}

static void pool_put(pool *p, void *x)
{
    if (p->n >= POOL_MAX) {
        free(x);
        return;
    }
    ((pooled *)x)->next = p->head;
    p->head = x;
    p->n++;
}

/* ---- settle queue ------------------------------------------------------------------------ */
static settle_req *settle_new(rb_run *run, rb_settle_kind kind, double delay, const char *error,
                              settle_done_fn done)
{
    settle_req *r = pool_get(&settle_pool, sizeof *r);
    if (!r) return NULL;
    r->run = run;
    r->done = done;
    r->op.kind = kind;
    r->op.id = run->rec->id;
    r->op.token = run->rec->lease_token;
    r->op.delay = delay;
    if (error) {
        r->error_copy = strdup(error);
        r->op.error = r->error_copy;
    }
    run->refs++;
    return r;
}

static void settle_free(settle_req *r)
{
    free(r->error_copy);
    pool_put(&settle_pool, r);
}

static void settle_enqueue(rb_dispatcher *d, settle_req *r)
{
    r->sent_at = rb_monotonic();
    r->next = NULL;
    *d->queue_tail = r;
    d->queue_tail = &r->next;
    d->queued++;
    request_flush(d);
}

typedef struct settle_batch {
    rb_dispatcher *d;
    size_t n;
    settle_req **reqs;
    rb_settle_op *ops;
} settle_batch;

static void run_release_ref(rb_run *run);

static void on_batch_settled(void *ud, const char *err)
{
    settle_batch *b = ud;
    for (size_t i = 0; i < b->n; i++) {
        settle_req *r = b->reqs[i];
        r->op.applied = err ? 0 : b->ops[i].applied;
        r->op.lease_expires_at = b->ops[i].lease_expires_at;
        rb_run *run = r->run;
        r->done(r, err);
        settle_free(r);
        run_release_ref(run);
    }
    free(b->reqs);
    free(b->ops);
    free(b);
}

static void flush_settles(rb_dispatcher *d)
{
    if (!d->queued) return;
    settle_batch *b = calloc(1, sizeof *b);
    size_t n = d->queued;
    if (b) {
        b->reqs = malloc(n * sizeof *b->reqs);
        b->ops = malloc(n * sizeof *b->ops);
    }
    if (!b || !b->reqs || !b->ops) {
        if (b) { free(b->reqs); free(b->ops); free(b); }
        return;     /* out of memory: try again next iteration */
    }
    b->d = d;
    b->n = n;
    size_t i = 0;
    for (settle_req *r = d->queue_head; r; r = r->next) {
        b->reqs[i] = r;
        b->ops[i] = r->op;
        i++;
    }
    d->queue_head = NULL;
    d->queue_tail = &d->queue_head;
    d->queued = 0;
    d->store->vt->settle(d->store, b->ops, n, on_batch_settled, b);
}

static void on_flush(struct ev_loop *loop, ev_prepare *w, int revents)
{
    (void)loop; (void)revents;
    rb_dispatcher *d = w->data;
    d->flushing = 1;
    flush_settles(d);
    if (d->want_claim) {
        d->want_claim = 0;
        maybe_claim(d);
    }
    d->flushing = 0;
    /* Work queued by the callbacks above is flushed next iteration, without blocking. */
    if (d->queued || d->want_claim) ev_idle_start(d->loop, &d->spin_watcher);
    else ev_idle_stop(d->loop, &d->spin_watcher);
}

static void on_spin(struct ev_loop *loop, ev_idle *w, int revents)
{
    (void)loop; (void)w; (void)revents;
}

static void request_flush(rb_dispatcher *d)
{
    if (!d->flushing) ev_idle_start(d->loop, &d->spin_watcher);
}

/* ---- runs --------------------------------------------------------------------------------- */
static double run_effective_deadline(const rb_run *run)
{
    double t = run->lease_deadline;
    if (run->timeout_deadline < t) t = run->timeout_deadline;
    if (run->shutdown_deadline < t) t = run->shutdown_deadline;
    return t;
}

double rb_run_deadline(const rb_run *run) { return run_effective_deadline(run); }
const rb_delivery *rb_run_delivery(const rb_run *run) { return run->rec; }
rb_dispatcher *rb_run_dispatcher(const rb_run *run) { return run->d; }
rb_abort_reason rb_run_aborted(const rb_run *run) { return run->aborted; }
rb_tx *rb_run_tx(const rb_run *run) { return run->tx; }
void *rb_run_get_data(const rb_run *run) { return run->data; }
void rb_run_set_data(rb_run *run, void *data) { run->data = data; }

/* Why the deadline was reached: the earliest of the three clocks decides. */
static rb_abort_reason deadline_reason(const rb_run *run)
{
    if (run->shutdown_deadline <= run->lease_deadline &&
        run->shutdown_deadline <= run->timeout_deadline)
        return RB_ABORT_SHUTDOWN;
    if (run->timeout_deadline <= run->lease_deadline) return RB_ABORT_TIMEOUT;
    return RB_ABORT_LEASE;
}

static void arm_deadline(rb_run *run)
{
    rb_dispatcher *d = run->d;
    ev_now_update(d->loop);
    double wait = run_effective_deadline(run) - rb_monotonic();
    ev_timer_stop(d->loop, &run->deadline_timer);
    ev_timer_set(&run->deadline_timer, wait > 0 ? wait : 0, 0);
    ev_timer_start(d->loop, &run->deadline_timer);
}

rb_abort_reason rb_run_check(rb_run *run)
{
    if (!run->aborted && run->state == RUN_RUNNING &&
        rb_monotonic() >= run_effective_deadline(run))
        run_abort(run, deadline_reason(run));
    return run->aborted;
}

static void on_deadline(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    rb_run *run = w->data;
    /* The timer may fire a little early relative to our own clock reading; re-arm then. */
    if (rb_monotonic() < run_effective_deadline(run)) {
        arm_deadline(run);
        return;
    }
    if (run->state == RUN_RUNNING || run->state == RUN_BEGINNING)
        run_abort(run, deadline_reason(run));
}

static void on_renewed(settle_req *r, const char *err)
{
    rb_run *run = r->run;
    run->renewing = 0;
    if (run->state != RUN_RUNNING || run->aborted) return;
    if (err) {
        /* The store could not be asked: keep the old deadline; the next tick tries again. */
        rb_log(RB_LOG_WARN, "lease renewal of %s failed: %s", run->rec->id, err);
        return;
    }
    if (!r->op.applied) {
        run_abort(run, RB_ABORT_LEASE);
        return;
    }
    run->lease_deadline = r->sent_at + run->d->opt.lease_duration - run->d->margin;
    arm_deadline(run);
}

static void on_renew_tick(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    rb_run *run = w->data;
    if (run->state != RUN_RUNNING || run->aborted || run->renewing) return;
    /* A process that was frozen past its deadline must abort, not renew. */
    if (rb_run_check(run)) return;
    settle_req *r = settle_new(run, RB_OP_EXTEND, run->d->opt.lease_duration, NULL, on_renewed);
    if (!r) return;
    run->renewing = 1;
    settle_enqueue(run->d, r);
}

/* A run whose handler has ended and whose settle write is in flight no longer occupies a
 * handler slot: counting it apart lets the next claim go out while the settles commit. */
static void set_settling(rb_run *run)
{
    if (run->state == RUN_SETTLING) return;
    run->state = RUN_SETTLING;
    run->d->nsettling++;
    if (!run->d->stopping) {
        run->d->want_claim = 1;     /* the next claim may overlap these settles */
        request_flush(run->d);
    }
}

static rb_run *run_new(rb_dispatcher *d, handler_entry *h, rb_delivery *rec, double claimed_at)
{
    rb_run *run = pool_get(&run_pool, sizeof *run);
    if (!run) return NULL;
    run->d = d;
    run->h = h;
    run->rec = rec;
    run->lease_deadline = claimed_at + d->opt.lease_duration - d->margin;
    run->timeout_deadline = INFINITY;
    run->shutdown_deadline = INFINITY;
    ev_init(&run->deadline_timer, on_deadline);
    run->deadline_timer.data = run;
    double every = d->opt.lease_duration / 3;
    ev_timer_init(&run->renew_timer, on_renew_tick, every, every);
    run->renew_timer.data = run;
    /* list of unsettled runs */
    run->next = d->runs;
    if (d->runs) d->runs->prev = run;
    d->runs = run;
    d->nactive++;
    return run;
}

static void run_free(rb_run *run)
{
    rb_delivery_free(run->rec);
    pool_put(&run_pool, run);
}

static void run_release_ref(rb_run *run)
{
    if (--run->refs == 0 && run->state == RUN_SETTLED) run_free(run);
}

static void run_abort(rb_run *run, rb_abort_reason reason)
{
    if (run->aborted) return;
    run->aborted = reason;
    ev_timer_stop(run->d->loop, &run->renew_timer);
    ev_timer_stop(run->d->loop, &run->deadline_timer);
    if (run->state == RUN_RUNNING && run->h->def.abort)
        run->h->def.abort(run, reason, run->h->def.ud);
}

/* The run is over: tell the host, free its slot, start a parked successor. */
static void run_settled(rb_run *run)
{
    rb_dispatcher *d = run->d;
    if (run->state == RUN_SETTLED) return;
    int was_running = run->state == RUN_SETTLING || run->state == RUN_RUNNING;
    if (run->state == RUN_SETTLING) d->nsettling--;
    run->state = RUN_SETTLED;
    ev_timer_stop(d->loop, &run->renew_timer);
    ev_timer_stop(d->loop, &run->deadline_timer);
    if (was_running && run->h->def.settled) run->h->def.settled(run, run->h->def.ud);
    active_remove(d->store, run->rec->id, run);
    if (run->prev) run->prev->next = run->next;
    else d->runs = run->next;
    if (run->next) run->next->prev = run->prev;
    d->nactive--;
    rb_run *parked = run->parked;
    run->parked = NULL;
    if (parked) {
        if (active_add(d->store, parked->rec->id, parked) != 0) {
            run_settled(parked);    /* out of memory: the lease expires, another takes it */
        } else if (parked->d->stopping) {
            set_settling(parked);   /* never started: hand the claim back */
            write_final(parked, RB_OP_RELEASE, 0, NULL);
        } else {
            run_start(parked);
        }
    }
    run->refs++;
    run_release_ref(run);
    if (d->stopping) check_stop_done(d);
    else {
        d->want_claim = 1;
        request_flush(d);
    }
}

static void on_final_write(settle_req *r, const char *err)
{
    rb_run *run = r->run;
    if (err && !run->abandoned && rb_monotonic() < run->lease_deadline) {
        /* The store could not be reached: the write is fenced, so trying again is safe. */
        rb_log(RB_LOG_WARN, "settling %s failed (%s); retrying", run->rec->id, err);
        settle_req *again = settle_new(run, r->op.kind, r->op.delay, r->op.error, on_final_write);
        if (again) {
            settle_enqueue(run->d, again);
            return;
        }
    }
    if (err)
        rb_log(RB_LOG_WARN, "delivery %s left to its lease: %s", run->rec->id, err);
    run_settled(run);
}

static void write_final(rb_run *run, rb_settle_kind kind, double delay, const char *error)
{
    settle_req *r = settle_new(run, kind, delay, error, on_final_write);
    if (!r) {
        run_settled(run);   /* out of memory: the lease expires and the delivery runs again */
        return;
    }
    settle_enqueue(run->d, r);
}

static double backoff_for(rb_dispatcher *d, int attempts)
{
    double s = d->opt.backoff ? d->opt.backoff(attempts, d->opt.backoff_ud)
                              : default_backoff(attempts, NULL);
    return (s >= 0 && isfinite(s)) ? s : 0;
}

/* The outcome table of the contract, for a run that has no explicit settle. */
static void settle_outcome(rb_run *run, int ok, const char *error)
{
    if (run->abandoned || run->aborted == RB_ABORT_LEASE) {
        run_settled(run);           /* the lease is gone: nothing is written */
        return;
    }
    if (run->aborted == RB_ABORT_SHUTDOWN) {
        write_final(run, RB_OP_RELEASE, 0, NULL);
        return;
    }
    if (run->aborted == RB_ABORT_TIMEOUT) {
        ok = 0;
        error = "timeout";
    }
    if (ok) {
        write_final(run, RB_OP_COMPLETE, 0, NULL);
    } else if (run->rec->attempts >= run->rec->max_attempts) {
        write_final(run, RB_OP_BURY, 0, error ? error : "error");
    } else {
        write_final(run, RB_OP_RESCHEDULE, backoff_for(run->d, run->rec->attempts),
                    error ? error : "error");
    }
}

typedef struct finish_ctx {
    rb_run *run;
    int ok;
    char *error;
    rb_settle_op complete;
} finish_ctx;

static void on_tx_ended(void *ud, const char *err)
{
    finish_ctx *f = ud;
    rb_run *run = f->run;
    if (f->ok && !err && f->complete.applied) {
        run_settled(run);           /* committed together with the completion */
    } else if (f->ok && !err) {
        run_abort(run, RB_ABORT_LEASE);  /* completion not applied: the lease was lost */
        run_settled(run);
    } else {
        if (err) rb_log(RB_LOG_WARN, "transaction of %s failed: %s", run->rec->id, err);
        /* A failed commit counts as a failure of the run; a rollback then settles as usual. */
        settle_outcome(run, 0, f->ok ? (err ? err : "commit failed") : f->error);
    }
    free(f->error);
    free(f);
    run_release_ref(run);
}

void rb_run_finish(rb_run *run, int ok, const char *error)
{
    if (run->state != RUN_RUNNING) return;
    set_settling(run);
    ev_timer_stop(run->d->loop, &run->renew_timer);
    ev_timer_stop(run->d->loop, &run->deadline_timer);
    /* A run that reached its deadline without noticing is aborted now (frozen process). */
    if (!run->aborted && rb_monotonic() >= run_effective_deadline(run))
        run->aborted = deadline_reason(run);
    if (run->tx) {
        rb_tx *tx = run->tx;
        run->tx = NULL;
        finish_ctx *f = calloc(1, sizeof *f);
        if (!f) {
            run->d->store->vt->rollback(tx, NULL, NULL);
            run_settled(run);
            return;
        }
        f->run = run;
        f->ok = ok && !run->aborted && !run->settled_explicitly;
        f->error = error ? strdup(error) : NULL;
        run->refs++;
        if (f->ok) {
            f->complete = (rb_settle_op){.kind = RB_OP_COMPLETE, .id = run->rec->id,
                                         .token = run->rec->lease_token};
            run->d->store->vt->commit(tx, &f->complete, on_tx_ended, f);
        } else {
            /* roll back, then settle as the outcome table says */
            run->d->store->vt->rollback(tx, on_tx_ended, f);
        }
        return;
    }
    if (run->settled_explicitly) {
        run_settled(run);
        return;
    }
    settle_outcome(run, ok, error);
}

static void on_tx_begun(void *ud, const char *err, rb_tx *tx)
{
    rb_run *run = ud;
    rb_dispatcher *d = run->d;
    if (err || run->abandoned || run->aborted ||
        rb_monotonic() >= run_effective_deadline(run)) {
        if (tx) d->store->vt->rollback(tx, NULL, NULL);
        if (err) rb_log(RB_LOG_WARN, "cannot begin a transaction for %s: %s", run->rec->id, err);
        set_settling(run);
        if (!run->aborted && rb_monotonic() >= run_effective_deadline(run))
            run->aborted = deadline_reason(run);
        /* A transaction that cannot begin fails the run: retried with backoff, and its
         * last_error tells why (e.g. MongoDB without a replica set). */
        settle_outcome(run, 0, err ? err : "transaction could not begin");
        run_release_ref(run);
        return;
    }
    run->tx = tx;
    run->state = RUN_RUNNING;
    run->h->def.start(run, run->h->def.ud);
    run_release_ref(run);
}

static void run_start(rb_run *run)
{
    rb_dispatcher *d = run->d;
    if (rb_monotonic() >= run->lease_deadline) {
        /* Parked until its lease ran out: it is no longer ours to run. */
        set_settling(run);
        run_settled(run);
        return;
    }
    if (run->h->def.timeout > 0)
        run->timeout_deadline = rb_monotonic() + run->h->def.timeout;
    arm_deadline(run);
    ev_timer_start(d->loop, &run->renew_timer);
    if (run->h->def.transactional) {
        run->state = RUN_BEGINNING;
        run->refs++;
        d->store->vt->begin(d->store, on_tx_begun, run);
        return;
    }
    run->state = RUN_RUNNING;
    run->h->def.start(run, run->h->def.ud);
}

/* ---- explicit settles from the handler --------------------------------------------------- */
static void on_explicit_written(settle_req *r, const char *err)
{
    rb_run *run = r->run;
    if (err) {
        r->ucb(r->uud, err, 0);
        return;
    }
    if (!r->op.applied) {
        if (run->state == RUN_RUNNING) run_abort(run, RB_ABORT_LEASE);
        r->ucb(r->uud, "lease lost", 0);
        return;
    }
    if (r->op.kind == RB_OP_EXTEND) {
        run->lease_deadline = r->sent_at + r->op.delay - run->d->margin;
        if (run->state == RUN_RUNNING && !run->aborted) arm_deadline(run);
    } else {
        run->settled_explicitly = 1;
        ev_timer_stop(run->d->loop, &run->renew_timer);
    }
    r->ucb(r->uud, NULL, 1);
}

void rb_run_settle(rb_run *run, rb_settle_kind kind, double delay, const char *reason,
                   rb_run_settle_cb cb, void *ud)
{
    if (run->state != RUN_RUNNING || rb_run_check(run)) {
        cb(ud, "aborted", 0);
        return;
    }
    if (run->settled_explicitly) {
        cb(ud, "already settled", 0);
        return;
    }
    if (run->tx && kind != RB_OP_EXTEND) {
        cb(ud, "a transactional handler settles by returning (complete) or raising (retry)", 0);
        return;
    }
    if (run->tx && run->d->store->vt->tx_exclusive) {
        /* The renewal would wait behind the handler's own transaction; the renew timer keeps
         * the lease instead (its writes are queued, not awaited). */
        cb(ud, "extend_lease is not available in a transactional handler on this store", 0);
        return;
    }
    if (kind == RB_OP_EXTEND && delay <= 0) delay = run->d->opt.lease_duration;
    if (kind == RB_OP_RESCHEDULE && !reason) reason = "rescheduled";
    if (kind == RB_OP_BURY && !reason) reason = "buried";
    settle_req *r = settle_new(run, kind, delay < 0 ? 0 : delay, reason, on_explicit_written);
    if (!r) {
        cb(ud, "out of memory", 0);
        return;
    }
    r->ucb = cb;
    r->uud = ud;
    settle_enqueue(run->d, r);
}

/* ---- claiming ------------------------------------------------------------------------------ */
static handler_entry *find_handler(rb_dispatcher *d, const char *topic)
{
    for (size_t i = 0; i < d->nhandlers; i++)
        if (strcmp(d->handlers[i].topic, topic) == 0) return &d->handlers[i];
    return NULL;
}

#define CLAIM_MAX 1000          /* deliveries per claim statement */

typedef struct claim_ctx {
    rb_dispatcher *d;           /* NULL once the dispatcher was freed under the claim */
    double sent_at;
    size_t limit;
    struct claim_ctx *next;     /* the dispatcher's claims in flight */
} claim_ctx;

/* Claims in flight, and (*slots) the handler slots they may fill: at most a few. */
static int claims_in_flight(const rb_dispatcher *d, size_t *slots)
{
    int n = 0;
    size_t sum = 0;
    for (const claim_ctx *c = d->claims; c; c = c->next, n++) sum += c->limit;
    if (slots) *slots = sum;
    return n;
}

static void claim_unlink(rb_dispatcher *d, claim_ctx *c)
{
    for (claim_ctx **p = &d->claims; *p; p = &(*p)->next)
        if (*p == c) { *p = c->next; return; }
}

static void on_claimed(void *ud, const char *err, rb_delivery **recs, size_t n)
{
    claim_ctx *c = ud;
    rb_dispatcher *d = c->d;
    if (!d) {
        /* The dispatcher was freed meanwhile: the deliveries are left to their leases. */
        for (size_t i = 0; !err && i < n; i++) rb_delivery_free(recs[i]);
        free(recs);
        free(c);
        return;
    }
    claim_unlink(d, c);
    d->backlog = !err && n >= c->limit;
    double sent_at = c->sent_at;
    free(c);
    if (err) {
        rb_log(RB_LOG_WARN, "claim failed: %s", err);
        if (d->stopping) { check_stop_done(d); return; }   /* may end (and free) d */
        ev_timer_stop(d->loop, &d->claim_retry_timer);
        ev_timer_set(&d->claim_retry_timer, d->opt.poll_interval, 0);
        ev_timer_start(d->loop, &d->claim_retry_timer);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        handler_entry *h = find_handler(d, recs[i]->topic);
        rb_run *run = h ? run_new(d, h, recs[i], sent_at) : NULL;
        if (!run) {
            rb_delivery_free(recs[i]);  /* left to its lease: another claim will take it */
            continue;
        }
        rb_run *earlier = active_find(d->store, run->rec->id);
        if (earlier) {
            /* Never overlap with our own unsettled run: start when it has settled. */
            run->state = RUN_WAITING;
            while (earlier->parked) earlier = earlier->parked;
            earlier->parked = run;
            continue;
        }
        if (active_add(d->store, run->rec->id, run) != 0) {
            set_settling(run);
            run_settled(run);
            continue;
        }
        if (d->stopping) {
            /* The claim crossed a stop: hand the delivery back without using an attempt. */
            set_settling(run);
            write_final(run, RB_OP_RELEASE, 0, NULL);
            continue;
        }
        run_start(run);
    }
    free(recs);
    /* Last: ending the stop calls the host, which may free d. */
    if (d->stopping) { check_stop_done(d); return; }
    /* A full batch means more may be due: claim again at the end of this iteration. */
    if (d->backlog) {
        d->want_claim = 1;
        request_flush(d);
    }
}

static int claim_one(rb_dispatcher *d)
{
    int parallel = d->store->vt->claim_parallelism > 1 ? d->store->vt->claim_parallelism : 1;
    size_t reserved;
    int claiming = claims_in_flight(d, &reserved);
    if (claiming >= parallel) return 0;
    /* A second claim beside one in flight only pays during a backlog; when little is due it
     * would only double the polling. */
    if (claiming > 0 && !d->backlog) return 0;
    size_t concurrency = (size_t)d->opt.concurrency;
    size_t busy = d->nactive - d->nsettling + reserved;
    if (busy >= concurrency) return 0;
    size_t free_slots = concurrency - busy;
    /* With claims side by side each fills a share of the slots, so one batch is answered
     * while the one before it runs. */
    size_t batch = (concurrency + (size_t)parallel - 1) / (size_t)parallel;
    if (batch > CLAIM_MAX) batch = CLAIM_MAX;
    if (free_slots > batch) free_slots = batch;
    /* Wait for a worthwhile batch unless we are idle: one claim per freed slot would cost a
     * round trip per delivery. */
    size_t low_water = concurrency / 4;
    if (low_water > CLAIM_MAX / 2) low_water = CLAIM_MAX / 2;
    if (low_water > batch) low_water = batch;
    if (busy > 0 && free_slots < low_water) return 0;
    claim_ctx *c = malloc(sizeof *c);
    if (!c) return 0;
    c->d = d;
    c->sent_at = rb_monotonic();
    c->limit = free_slots;
    c->next = d->claims;
    d->claims = c;
    rb_claim_req req = {d->topics, d->nhandlers, free_slots, d->opt.lease_duration};
    d->store->vt->claim(d->store, &req, on_claimed, c);
    return 1;
}

static void maybe_claim(rb_dispatcher *d)
{
    if (!d->started || d->stopping || !d->nhandlers) return;
    while (d->started && !d->stopping) {
        int before = claims_in_flight(d, NULL);
        if (!claim_one(d)) break;
        /* Answered at once (SQLite may be synchronous): the next claim waits for this
         * iteration's settles to be flushed, or a backlog would be claimed in one go. */
        if (claims_in_flight(d, NULL) <= before) break;
    }
}

static void on_poll(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    maybe_claim(w->data);
}

void rb_dispatcher_wake(rb_dispatcher *d)
{
    if (!d->started || d->stopping) return;
    d->want_claim = 1;
    request_flush(d);
}

/* ---- lifecycle ------------------------------------------------------------------------------ */
rb_dispatcher *rb_dispatcher_new(rb_store *store, const rb_dispatcher_options *o)
{
    rb_dispatcher *d = calloc(1, sizeof *d);
    if (!d) return NULL;
    d->store = store;
    d->loop = store->loop;
    if (o) d->opt = *o;
    else rb_dispatcher_options_init(&d->opt);
    if (!(d->opt.lease_duration > 0)) d->opt.lease_duration = 30;
    if (!(d->opt.shutdown_timeout >= 0)) d->opt.shutdown_timeout = 30;
    if (!(d->opt.poll_interval > 0)) d->opt.poll_interval = 1;
    if (d->opt.concurrency < 1) d->opt.concurrency = 64;
    /* The margin covers clock-rate differences, the grace before Lua is interrupted and the
     * time the settle write needs; it must leave most of the lease usable. */
    double m = d->opt.lease_duration * 0.1;
    if (m < 0.2) m = 0.2;
    if (m > 5) m = 5;
    if (m > d->opt.lease_duration * 0.5) m = d->opt.lease_duration * 0.5;
    d->margin = m;
    d->queue_tail = &d->queue_head;
    ev_prepare_init(&d->flush_watcher, on_flush);
    d->flush_watcher.data = d;
    ev_idle_init(&d->spin_watcher, on_spin);
    ev_timer_init(&d->poll_timer, on_poll, d->opt.poll_interval, d->opt.poll_interval);
    d->poll_timer.data = d;
    ev_init(&d->claim_retry_timer, on_poll);
    d->claim_retry_timer.data = d;
    return d;
}

int rb_dispatcher_handle(rb_dispatcher *d, const char *topic, const rb_handler_def *h)
{
    if (d->started || find_handler(d, topic) || !h || !h->start) return -1;
    handler_entry *hs = realloc(d->handlers, (d->nhandlers + 1) * sizeof *hs);
    if (!hs) return -1;
    d->handlers = hs;
    const char **ts = realloc(d->topics, (d->nhandlers + 1) * sizeof *ts);
    if (!ts) return -1;
    d->topics = ts;
    handler_entry *e = &d->handlers[d->nhandlers];
    e->topic = strdup(topic);
    if (!e->topic) return -1;
    e->def = *h;
    /* realloc may have moved the handlers: rebuild the topic pointers */
    d->nhandlers++;
    for (size_t i = 0; i < d->nhandlers; i++) d->topics[i] = d->handlers[i].topic;
    return 0;
}

void rb_dispatcher_start(rb_dispatcher *d)
{
    if (d->started) return;
    d->started = 1;
    ev_prepare_start(d->loop, &d->flush_watcher);
    ev_timer_start(d->loop, &d->poll_timer);
    wake_list_add(d);
    if (d->store->vt->set_wakeup) d->store->vt->set_wakeup(d->store, on_store_notify, d->store);
    d->want_claim = 1;
    request_flush(d);
}

int rb_dispatcher_running(const rb_dispatcher *d) { return d->started && !d->stopped; }
int rb_dispatcher_stopping(const rb_dispatcher *d) { return d->stopping && !d->stopped; }
size_t rb_dispatcher_active(const rb_dispatcher *d) { return d->nactive; }
rb_store *rb_dispatcher_store(const rb_dispatcher *d) { return d->store; }

static void finish_stop(rb_dispatcher *d)
{
    if (d->stopped) return;
    d->stopped = 1;
    ev_timer_stop(d->loop, &d->grace_timer);
    ev_timer_stop(d->loop, &d->hard_timer);
    ev_timer_stop(d->loop, &d->poll_timer);
    ev_timer_stop(d->loop, &d->claim_retry_timer);
    /* Runs still unsettled are abandoned with their lease: it expires and another process
     * runs them again. Their late endings write nothing. */
    for (rb_run *run = d->runs; run; run = run->next) {
        run->abandoned = 1;
        ev_timer_stop(d->loop, &run->renew_timer);
        if (!run->aborted) run_abort(run, RB_ABORT_SHUTDOWN);
    }
    wake_list_remove(d);
    if (d->store->vt->set_wakeup) {
        int others = 0;
        for (rb_dispatcher *o = wake_list; o; o = o->next_on_store)
            if (o->store == d->store) others = 1;
        if (!others) d->store->vt->set_wakeup(d->store, NULL, NULL);
    }
    stop_waiter *w = d->waiters;
    d->waiters = NULL;
    if (d->opt.on_stopped) d->opt.on_stopped(d, d->opt.on_stopped_ud);
    while (w) {
        stop_waiter *next = w->next;
        w->done(w->ud);
        free(w);
        w = next;
    }
}

static void check_stop_done(rb_dispatcher *d)
{
    if (d->stopping && !d->stopped && d->nactive == 0 && !d->claims) finish_stop(d);
}

static void on_grace_over(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    rb_dispatcher *d = w->data;
    double now = rb_monotonic();
    for (rb_run *run = d->runs; run; run = run->next) {
        run->shutdown_deadline = now;
        if (run->state == RUN_RUNNING || run->state == RUN_BEGINNING) {
            if (run->state == RUN_RUNNING) run_abort(run, RB_ABORT_SHUTDOWN);
            else run->aborted = RB_ABORT_SHUTDOWN;
        }
    }
}

static void on_hard_timeout(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    finish_stop(w->data);
}

void rb_dispatcher_stop(rb_dispatcher *d, double timeout, void (*done)(void *ud), void *ud)
{
    if (timeout < 0) timeout = d->opt.shutdown_timeout;
    if (done) {
        if (d->stopped || !d->started) {
            d->stopped = 1;
            done(ud);
            return;
        }
        stop_waiter *w = malloc(sizeof *w);
        if (w) {
            *w = (stop_waiter){done, ud, d->waiters};
            d->waiters = w;
        }
    }
    if (!d->started) {
        d->stopped = 1;
        return;
    }
    if (d->stopped) return;
    if (d->stopping) {
        /* A later stop may only shorten the timeout. */
        double left = ev_timer_remaining(d->loop, &d->hard_timer);
        if (timeout >= left) return;
    }
    d->stopping = 1;
    ev_now_update(d->loop);     /* the loop's cached time may be stale: time from now */
    ev_timer_stop(d->loop, &d->poll_timer);
    ev_timer_stop(d->loop, &d->grace_timer);
    ev_timer_stop(d->loop, &d->hard_timer);
    ev_timer_init(&d->grace_timer, on_grace_over, timeout * 0.8, 0);
    d->grace_timer.data = d;
    ev_timer_init(&d->hard_timer, on_hard_timeout, timeout, 0);
    d->hard_timer.data = d;
    ev_timer_start(d->loop, &d->grace_timer);
    ev_timer_start(d->loop, &d->hard_timer);
    check_stop_done(d);
}

void rb_dispatcher_free(rb_dispatcher *d)
{
    if (!d) return;
    if (d->started && !d->stopped) finish_stop(d);
    ev_prepare_stop(d->loop, &d->flush_watcher);
    ev_idle_stop(d->loop, &d->spin_watcher);
    ev_timer_stop(d->loop, &d->poll_timer);
    ev_timer_stop(d->loop, &d->claim_retry_timer);
    ev_timer_stop(d->loop, &d->grace_timer);
    ev_timer_stop(d->loop, &d->hard_timer);
    wake_list_remove(d);
    /* Claims still in flight answer later: they find no dispatcher and free their records. */
    for (claim_ctx *c = d->claims; c; c = c->next) c->d = NULL;
    /* Runs still referenced by in-flight store operations are detached, not freed: their
     * callbacks still arrive. The settle queue is dropped (leases expire). */
    for (settle_req *r = d->queue_head, *next; r; r = next) {
        next = r->next;
        rb_run *run = r->run;
        settle_free(r);
        run->refs--;
    }
    for (rb_run *run = d->runs, *next; run; run = next) {
        next = run->next;
        active_remove(d->store, run->rec->id, run);
        ev_timer_stop(d->loop, &run->renew_timer);
        ev_timer_stop(d->loop, &run->deadline_timer);
        run->state = RUN_SETTLED;
        if (run->refs == 0) run_free(run);
    }
    for (size_t i = 0; i < d->nhandlers; i++) {
        if (d->handlers[i].def.free) d->handlers[i].def.free(d->handlers[i].def.ud);
        free(d->handlers[i].topic);
    }
    free(d->handlers);
    free(d->topics);
    free(d);
}
