/* dispatcher_runs.c -- one run of a delivery: start, lease renewals, the local deadline, abort,
 * finish and its settle. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "dispatch/dispatcher_impl.h"
#include "util/alloc.h"
#include "util/timer.h"
#include "util/log.h"
#include "util/text.h"
#include "util/list.h"
#include "util/check.h"

/* ---- pools ------------------------------------------------------------------------------- */
/* Runs and settle requests come and go with every delivery: finished ones are kept for reuse
 * instead of going back to malloc. Per thread, so taking and returning one needs no lock (the
 * registry and the wake list are per store): dispatchers on different threads, each with its
 * own loop and stores, share nothing. */
#define POOL_MAX 1024
typedef struct pooled { struct pooled *next; } pooled;
typedef struct pool { pooled *head; size_t n; } pool;
static _Thread_local pool run_pool, settle_pool;
static _Thread_local int pools_kept;    /* this thread frees its pools when it ends */
static pthread_key_t pools_key;
static pthread_once_t pools_once = PTHREAD_ONCE_INIT;

/* Called when a thread that pooled something ends: its pools would be unreachable. */
static void pools_free(void *unused)
{
    (void)unused;
    pool *ps[] = {&run_pool, &settle_pool};
    for (size_t i = 0; i < 2; i++) {
        while (ps[i]->head) {
            pooled *x = ps[i]->head;
            ps[i]->head = x->next;
            free(x);
        }
        ps[i]->n = 0;
    }
    pools_kept = 0;
}

static void pools_key_create(void)
{
    if (pthread_key_create(&pools_key, pools_free) != 0) pools_key = (pthread_key_t)-1;
}

static const unsigned char state_moves[] = {
    [RUN_WAITING] = 1u << RUN_BEGINNING | 1u << RUN_RUNNING | 1u << RUN_SETTLING | 1u << RUN_SETTLED,
    [RUN_BEGINNING] = 1u << RUN_RUNNING | 1u << RUN_SETTLING | 1u << RUN_SETTLED,
    [RUN_RUNNING] = 1u << RUN_SETTLING | 1u << RUN_SETTLED,
    [RUN_SETTLING] = 1u << RUN_SETTLED,
    [RUN_SETTLED] = 0,
};

void disp_set_state(rb_run *run, run_state to)
{
    RB_ASSERT(state_moves[run->state] & (1u << to));
    run->state = to;
}

static void *pool_get(pool *p, size_t size)
{
    pooled *x = p->head;
    if (!x) return rb_calloc(1, size);
    p->head = x->next;
    RB_ASSERT(p->n > 0);
    p->n--;
    memset(x, 0, size);
    return x;
}

static void pool_put(pool *p, void *x)
{
    if (!pools_kept) {
        pthread_once(&pools_once, pools_key_create);
        pools_kept = pools_key != (pthread_key_t)-1 &&
                     pthread_setspecific(pools_key, &run_pool) == 0;
    }
    if (p->n >= POOL_MAX || !pools_kept) {
        free(x);
        return;
    }
    ((pooled *)x)->next = p->head;
    p->head = x;
    p->n++;
}


void *disp_pool_get(int which, size_t size)
{
    return pool_get(which == POOL_RUNS ? &run_pool : &settle_pool, size);
}

void disp_pool_put(int which, void *x) { pool_put(which == POOL_RUNS ? &run_pool : &settle_pool, x); }

/* What a final write of `kind` that was written makes of the run. */
rb_outcome disp_outcome_of(const rb_run *run, rb_settle_kind kind)
{
    switch (kind) {
    case RB_OP_COMPLETE: return RB_OUT_COMPLETED;
    case RB_OP_RELEASE: return RB_OUT_RELEASED;
    case RB_OP_BURY: return run->aborted == RB_ABORT_TIMEOUT ? RB_OUT_TIMEOUT : RB_OUT_BURIED;
    default: return run->aborted == RB_ABORT_TIMEOUT ? RB_OUT_TIMEOUT : RB_OUT_RETRIED;
    }
}

void disp_set_outcome(rb_run *run, rb_outcome o, const char *error)
{
    run->outcome = o;
    free(run->outcome_error);
    run->outcome_error = error ? rb_strdup(error) : NULL;
}

static double default_backoff(int attempts, void *ud)
{
    (void)ud;
    double s = pow(2.0, attempts);
    return s > 3600 ? 3600 : s;
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

/* A transactional run on a store whose transaction holds the whole store (SQLite): nobody can
 * take its lease while its transaction is open, so it need not give up at its local deadline
 * while it waits for the write lock: the begin extends the lease, fenced, once it holds it. */
static int begins_leased(const rb_run *run)
{
    return run->h->def.transactional && run->store->vt->begin_leased != NULL;
}

/* The run's transaction holds the store: its lease cannot be lost while it does. */
int disp_tx_holds_store(const rb_run *run)
{
    const rb_store_vtable *vt = run->store->vt;
    return run->tx && vt->tx_holds && vt->tx_holds(run->tx);
}

/* The lease is the run's until at least `from` + length (less the margin). */
void disp_lease_held_from(rb_run *run, double from, double length, double margin)
{
    run->lease_deadline = fmax(run->lease_deadline, from + length - margin);
    disp_arm_deadline(run);
}

/* ---- the run's clocks ----------------------------------------------------------------------
 * A run keeps three clocks: its deadline (the earliest of lease, timeout and shutdown, where
 * the run is aborted), its next lease renewal, and the next try of a final write the store
 * refused. One timer serves them, set for the earliest that is on: ten thousand sleeping
 * handlers keep ten thousand timers, not thirty thousand (160 bytes less a run, and a smaller
 * heap in libev). */
static void arm_clocks(rb_run *run)
{
    rb_dispatcher *d = run->d;
    double due = fmin(run->renew_at, run->retry_at);
    if (run->deadline_armed) due = fmin(due, run_effective_deadline(run));
    rb_timer_stop(d->loop, &run->timer);
    if (due == INFINITY) return;
    ev_now_update(d->loop);
    double wait = due - rb_monotonic();
    rb_timer_set(&run->timer, wait > 0 ? wait : 0, 0);
    rb_timer_start(d->loop, &run->timer);
}

void disp_arm_deadline(rb_run *run)
{
    run->deadline_armed = 1;
    arm_clocks(run);
}

void disp_stop_renewals(rb_run *run)
{
    run->renew_at = INFINITY;
    arm_clocks(run);
}

/* Deadline and renewals end: the handler has ended, or was aborted. */
static void stop_run_clocks(rb_run *run)
{
    run->deadline_armed = 0;
    run->renew_at = INFINITY;
    arm_clocks(run);
}

void disp_stop_clocks(rb_run *run)
{
    run->retry_at = INFINITY;
    stop_run_clocks(run);
}

/* A run whose transaction held the store renewed without writing: once an error ended that
 * transaction early (and the store could not take the lock back), the lease the table holds
 * may be over already, so the run stops now. */
static int lost_its_store(const rb_run *run)
{
    return run->tx && run->store->vt->tx_holds && !disp_tx_holds_store(run);
}

rb_abort_reason rb_run_check(rb_run *run)
{
    if (!run->aborted && run->state == RUN_RUNNING) {
        if (lost_its_store(run)) disp_run_abort(run, RB_ABORT_LEASE);
        else if (rb_monotonic() >= run_effective_deadline(run))
            disp_run_abort(run, deadline_reason(run));
    }
    return run->aborted;
}


static void on_lost_looked_up(void *ud, const char *err, rb_delivery **recs, size_t n)
{
    rb_run *run = ud;
    int cancelled = !err && n == 1 && recs[0]->status == RB_CANCELLED;
    rb_delivery_list_free(recs, n);
    run->renewing = 0;
    if (run->state == RUN_RUNNING || run->state == RUN_BEGINNING)
        disp_run_abort(run, cancelled ? RB_ABORT_CANCELLED : RB_ABORT_LEASE);
    disp_run_release_ref(run);
}

/* The store refused the run's lease: it ran out and another took it, or the delivery was
 * cancelled (an operator in another process; this one heard at once). One read tells which,
 * for the handler's ctx.signal.reason; the writes are refused either way meanwhile, and
 * renewals wait for the answer. */
void disp_run_lost(rb_run *run)
{
    if (run->aborted || !run->store->vt->cancel) {
        disp_run_abort(run, RB_ABORT_LEASE);
        return;
    }
    run->refs++;
    run->renewing = 1;
    run->store->vt->get(run->store, run->rec->id, on_lost_looked_up, run);
}

void disp_on_renewed(settle_req *r, const char *err)
{
    rb_run *run = r->run;
    run->renewing = 0;
    if ((run->state != RUN_RUNNING && run->state != RUN_BEGINNING) || run->aborted) return;
    if (err) {
        /* The store could not be asked: keep the old deadline; the next tick tries again. */
        static rb_log_limit lim;
        rb_log_limited_d(&lim, RB_LOG_WARN, run->rec->id, run->rec->topic,
                         "lease renewal of %s failed: %s", run->rec->id, err);
        return;
    }
    if (!r->op.applied) {
        disp_run_lost(run);
        return;
    }
    if (run->d->listeners) {
        rb_event ev = {.kind = RB_EV_RENEWED, .delivery = run->rec};
        disp_emit(run->d, &ev);
    }
    /* never earlier than an extension the handler asked for */
    disp_lease_held_from(run, r->sent_at, run->d->opt.lease_duration, run->d->margin);
}

static void renew_tick(rb_run *run)
{
    /* (a transactional run renews while its transaction begins too: a run that waited for its
     * slot may be due at once) */
    if ((run->state != RUN_RUNNING && run->state != RUN_BEGINNING) || run->aborted ||
        run->renewing)
        return;
    /* A process that was frozen past its deadline must abort, not renew. */
    if (rb_run_check(run)) return;
    if (disp_tx_holds_store(run)) {
        /* Its renewal would wait behind its own transaction, and needs no write: nobody can
         * claim while the transaction holds the store, and its end keeps the lease. */
        if (run->d->listeners) {
            rb_event ev = {.kind = RB_EV_RENEWED, .delivery = run->rec};
            disp_emit(run->d, &ev);
        }
        disp_lease_held_from(run, rb_monotonic(), run->d->opt.lease_duration, run->d->margin);
        return;
    }
    settle_req *r = disp_settle_new(run, RB_OP_EXTEND, run->d->opt.lease_duration, NULL, disp_on_renewed);
    if (!r) return;
    run->renewing = 1;
    disp_settle_enqueue(run->d, r);
}

static void retry_due(rb_run *run)
{
    settle_req *again = run->retry;
    run->retry = NULL;
    if (again) disp_settle_enqueue(run->d, again);
}

/* The run's timer: whichever clocks are due act, the deadline first (a process frozen past
 * it aborts the run, it does not renew), then the timer is set for what is left. A clock's
 * act may settle the run; the reference held here keeps it until the end. */
static void on_run_timer(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    rb_run *run = w->data;
    double now = rb_monotonic();
    run->refs++;
    if (run->deadline_armed && now >= run_effective_deadline(run)) {
        run->deadline_armed = 0;
        rb_abort_reason why = deadline_reason(run);
        /* (a run waiting for the write lock keeps waiting: its begin checks the lease) */
        int waits = run->state == RUN_BEGINNING && why == RB_ABORT_LEASE && begins_leased(run);
        if ((run->state == RUN_RUNNING || run->state == RUN_BEGINNING) && !waits)
            disp_run_abort(run, why);
    }
    if (run->state != RUN_SETTLED && now >= run->renew_at) {
        double every = run->d->opt.lease_duration / 3;
        run->renew_at += every;
        if (run->renew_at <= now) run->renew_at = now + every;
        renew_tick(run);
    }
    if (run->state != RUN_SETTLED && now >= run->retry_at) {
        run->retry_at = INFINITY;
        retry_due(run);
    }
    if (run->state != RUN_SETTLED) arm_clocks(run);
    disp_run_release_ref(run);
}

/* A run whose handler has ended and whose settle write is in flight no longer occupies a
 * handler slot: counting it apart lets the next claim go out while the settles commit. */
void disp_set_settling(rb_run *run)
{
    if (run->state == RUN_SETTLING) return;
    disp_set_state(run, RUN_SETTLING);
    run->d->nsettling++;
    run->d->lanes[run->h->lane].nsettling++;
    if (disp_live(run->d)) {
        run->d->want_claim = 1;     /* the next claim may overlap these settles */
        disp_request_flush(run->d);
    }
}

rb_run *disp_run_new(rb_dispatcher *d, handler_entry *h, rb_delivery *rec, double claimed_at)
{
    rb_run *run = pool_get(&run_pool, sizeof *run);
    if (!run) return NULL;
    run->d = d;
    run->store = d->store;
    run->h = h;
    run->rec = rec;
    run->claimed_at = claimed_at;
    run->lease_deadline = claimed_at + d->opt.lease_duration - d->margin;
    run->outcome = RB_OUT_ABANDONED;    /* until a write says otherwise */
    run->timeout_deadline = INFINITY;
    run->shutdown_deadline = INFINITY;
    rb_timer_init(&run->timer, on_run_timer, 0, 0);
    run->timer.w.data = run;
    run->renew_at = run->retry_at = INFINITY;
    /* list of unsettled runs */
    RB_LIST_PUSH(&d->runs, run);
    d->nactive++;
    d->lanes[h->lane].nactive++;
    return run;
}

void disp_run_free(rb_run *run)
{
    free(run->outcome_error);
    free(run->settle_error);
    rb_delivery_free(run->rec);
    pool_put(&run_pool, run);
}

void disp_run_release_ref(rb_run *run)
{
    RB_ASSERT(run->refs > 0);
    if (--run->refs == 0 && run->state == RUN_SETTLED) disp_run_free(run);
}

void disp_run_abort(rb_run *run, rb_abort_reason reason)
{
    if (run->aborted) return;
    run->aborted = reason;
    static rb_log_limit lost;
    if (reason == RB_ABORT_LEASE && !run->settled_explicitly)
        rb_log_limited_d(&lost, RB_LOG_INFO, run->rec->id, run->rec->topic, "run of %s (%s) lost"
                         " its lease: nothing of it is written, the delivery runs again",
                         run->rec->id, run->rec->topic);
    else if (reason == RB_ABORT_CANCELLED)
        rb_log_limited_d(&lost, RB_LOG_INFO, run->rec->id, run->rec->topic, "run of %s (%s) was"
                         " cancelled: nothing more of it is written", run->rec->id, run->rec->topic);
    stop_run_clocks(run);
    if (run->state == RUN_RUNNING && run->h->def.abort)
        run->h->def.abort(run, reason, run->h->def.ud);
}

/* run has left the registry: the run parked behind it (a later claim of the same delivery)
 * takes its place there and waits for a slot. That run may belong to another dispatcher on
 * the same store (the registry is the store's): it is counted and started on its own. */
void disp_hand_on_parked(rb_run *run)
{
    rb_run *parked = run->parked;
    run->parked = NULL;
    if (!parked) return;
    rb_dispatcher *pd = parked->d;
    disp_count_waiting(pd, parked, -1);
    if (disp_active_add(pd->store, parked) != 0) {
        disp_run_settled(parked);    /* out of memory: the lease expires, another takes it */
    } else if (disp_winding_down(pd)) {
        disp_set_settling(parked);   /* never started: hand the claim back */
        disp_write_final(parked, RB_OP_RELEASE, 0, NULL);
    } else {
        disp_unparked(pd, parked);   /* it starts when a slot is free */
    }
}

/* d is freed: its runs leave the chains of runs parked behind the registry's runs, and the
 * other dispatchers' runs parked behind its own move up (disp_hand_on_parked), so none is
 * left pointing at a freed run or waiting behind one that will never settle. */
void disp_unlink_parked(rb_dispatcher *d)
{
    for (rb_run *run = d->runs; run; run = run->next) {
        rb_run *head = disp_active_find(d->store, run->rec->id);
        if (!head) continue;
        for (rb_run **pp = &head->parked; *pp;) {
            rb_run *p = *pp;
            if (p->d == d) {
                *pp = p->parked;
                p->parked = NULL;
            } else {
                pp = &p->parked;
            }
        }
    }
}

/* The run is over: tell the host, free its slot, start a parked successor. */
void disp_run_settled(rb_run *run)
{
    rb_dispatcher *d = run->d;
    if (run->state == RUN_SETTLED) return;
    int was_running = run->state == RUN_SETTLING || run->state == RUN_RUNNING;
    lane *ln = &d->lanes[run->h->lane];
    if (run->state == RUN_SETTLING) {
        RB_ASSERT(d->nsettling > 0);
        d->nsettling--;
        RB_ASSERT(ln->nsettling > 0);
        ln->nsettling--;
    }
    RB_ASSERT(ln->nactive > 0);
    ln->nactive--;
    disp_set_state(run, RUN_SETTLED);
    disp_stop_clocks(run);
    if (d->listeners) {
        rb_event ev = {.kind = RB_EV_SETTLED, .delivery = run->rec, .outcome = run->outcome,
                       .duration = run->started_at ? rb_monotonic() - run->started_at : 0,
                       .error = run->outcome_error};
        disp_emit(d, &ev);
    }
    if (was_running && run->h->def.settled) run->h->def.settled(run, run->h->def.ud);
    disp_active_remove(d->store, run);
    RB_LIST_REMOVE(&d->runs, run);
    RB_ASSERT(d->nactive > 0);
    d->nactive--;
    disp_hand_on_parked(run);
    run->refs++;
    disp_run_release_ref(run);
    if (disp_winding_down(d)) disp_check_stop_done(d);
    else {
        d->want_claim = 1;
        disp_request_flush(d);
    }
}

/* A final write the store refused (unreachable, read-only, full disk) is tried again, fenced
 * so a repeat is harmless, after a delay that doubles: a store that refuses everything costs
 * a few writes a second, not one per loop iteration. Past the run's lease the delivery is
 * left to it: the lease expires and the delivery runs again elsewhere. */
static void on_final_write(settle_req *r, const char *err)
{
    rb_run *run = r->run;
    static rb_log_limit refused, left;
    /* (a run that rb_dispatcher_free detached is not tried again: its dispatcher is gone) */
    if (err && !run->abandoned && run->state != RUN_SETTLED &&
        rb_monotonic() + run->retry_delay < run->lease_deadline) {
        if (run->retry_delay == 0)
            rb_log_limited(&refused, RB_LOG_WARN, "settling %s failed (%s); trying again",
                           run->rec->id, err);
        run->retry_delay = run->retry_delay ? fmin(run->retry_delay * 2, RETRY_MOST) : RETRY_FIRST;
        settle_req *again = disp_settle_new(run, r->op.kind, r->op.delay, r->op.error, on_final_write);
        if (again) {
            again->solo = r->solo;
            run->retry = again;
            run->retry_at = rb_monotonic() + run->retry_delay;
            arm_clocks(run);
            return;
        }
    }
    if (err)
        rb_log_limited_d(&left, RB_LOG_WARN, run->rec->id, run->rec->topic,
                         "delivery %s left to its lease: %s", run->rec->id, err);
    else if (r->op.applied)
        disp_set_outcome(run, disp_outcome_of(run, r->op.kind), r->op.error);
    else
        disp_set_outcome(run, RB_OUT_LEASE_LOST, NULL);     /* taken over meanwhile */
    disp_run_settled(run);
}

void disp_write_final(rb_run *run, rb_settle_kind kind, double delay, const char *error)
{
    settle_req *r = disp_settle_new(run, kind, delay, error, on_final_write);
    if (!r) {
        disp_run_settled(run);   /* out of memory: the lease expires and the delivery runs again */
        return;
    }
    disp_settle_enqueue(run->d, r);
}

/* A backoff function's answer is clamped into [0, RB_MAX_SECONDS]: an infinite delay waits
 * the longest, it does not retry at once; NaN falls back to the default rule. */
static double backoff_for(rb_dispatcher *d, int attempts)
{
    double s = d->opt.backoff ? d->opt.backoff(attempts, d->opt.backoff_ud)
                              : default_backoff(attempts, NULL);
    if (rb_valid_seconds(s)) return s;
    static rb_log_limit lim;
    rb_log_limited(&lim, RB_LOG_WARN, "backoff(%d) gave %g s; using %s", attempts, s,
                   isnan(s) ? "the default" : s < 0 ? "0" : "the longest delay (100 years)");
    if (isnan(s)) return default_backoff(attempts, NULL);
    return s < 0 ? 0 : RB_MAX_SECONDS;
}

double rb_run_backoff(const rb_run *run) { return backoff_for(run->d, run->rec->attempts); }

/* The outcome table (docs/lua.md "Outcomes"), for a run that has no explicit settle. */
static void settle_outcome(rb_run *run, int ok, const char *error)
{
    if (run->abandoned || run->aborted == RB_ABORT_LEASE || run->aborted == RB_ABORT_CANCELLED) {
        disp_set_outcome(run, run->abandoned ? RB_OUT_ABANDONED
                              : run->aborted == RB_ABORT_CANCELLED ? RB_OUT_CANCELLED
                              : RB_OUT_LEASE_LOST, NULL);
        disp_run_settled(run);           /* the lease is gone: nothing is written */
        return;
    }
    if (run->aborted == RB_ABORT_SHUTDOWN) {
        disp_write_final(run, RB_OP_RELEASE, 0, NULL);
        return;
    }
    if (run->aborted == RB_ABORT_TIMEOUT) {
        ok = 0;
        error = "timeout";
    }
    if (ok) {
        disp_write_final(run, RB_OP_COMPLETE, 0, NULL);
    } else if (run->rec->attempts >= run->rec->max_attempts) {
        static rb_log_limit buried;
        rb_log_limited_d(&buried, RB_LOG_INFO, run->rec->id, run->rec->topic,
                         "delivery %s (%s) buried after %d attempts: %s", run->rec->id,
                         run->rec->topic, run->rec->attempts, error ? error : "error");
        disp_write_final(run, RB_OP_BURY, 0, error ? error : "error");
    } else {
        double delay = backoff_for(run->d, run->rec->attempts);
        static rb_log_limit timeouts;
        /* (a raise is logged by the binding that ran the handler, with its message) */
        if (run->aborted == RB_ABORT_TIMEOUT)
            rb_log_limited_d(&timeouts, RB_LOG_INFO, run->rec->id, run->rec->topic,
                             "run of %s (%s) passed its timeout; retried in %g s", run->rec->id,
                             run->rec->topic, delay);
        disp_write_final(run, RB_OP_RESCHEDULE, delay, error ? error : "error");
    }
}

/* A transaction given up on is rolled back with this: every store operation takes a callback
 * (store.h), and PostgreSQL and MongoDB call it unconditionally. */
static void on_abandoned_rollback(void *ud, const char *err) { (void)ud; (void)err; }

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
        disp_set_outcome(run, RB_OUT_COMPLETED, NULL);
        disp_run_settled(run);           /* committed together with the completion */
    } else if (f->ok && !err) {
        disp_run_abort(run, RB_ABORT_LEASE);  /* completion not applied: the lease was lost */
        disp_set_outcome(run, RB_OUT_LEASE_LOST, NULL);
        disp_run_settled(run);
    } else {
        static rb_log_limit lim;
        if (err) rb_log_limited(&lim, RB_LOG_WARN, "transaction of %s failed: %s", run->rec->id, err);
        /* A failed commit counts as a failure of the run; a rollback then settles as usual. */
        settle_outcome(run, 0, f->ok ? (err ? err : "commit failed") : f->error);
    }
    free(f->error);
    free(f);
    disp_run_release_ref(run);
}

void rb_run_finish(rb_run *run, int ok, const char *error)
{
    if (run->state != RUN_RUNNING) return;
    disp_note_run_time(run->d, run->h->lane, rb_monotonic() - run->started_at);
    disp_set_settling(run);
    stop_run_clocks(run);
    /* A run that reached its deadline without noticing is aborted now (frozen process). */
    if (!run->aborted && rb_monotonic() >= run_effective_deadline(run))
        run->aborted = deadline_reason(run);
    if (run->settle_error && !run->settled_explicitly) {
        ok = 0;
        error = run->settle_error;
    }
    if (run->tx) {
        rb_tx *tx = run->tx;
        run->tx = NULL;
        finish_ctx *f = rb_calloc(1, sizeof *f);
        if (!f) {
            run->d->store->vt->rollback(tx, on_abandoned_rollback, NULL);
            disp_run_settled(run);
            return;
        }
        f->run = run;
        f->ok = ok && !run->aborted && !run->settled_explicitly;
        f->error = error ? rb_strdup(error) : NULL;
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
        disp_run_settled(run);
        return;
    }
    settle_outcome(run, ok, error);
}

/* The handler starts now; its timeout counts from here (not from a wait for its transaction). */
static void begin_handler(rb_run *run)
{
    rb_dispatcher *d = run->d;
    disp_set_state(run, RUN_RUNNING);
    run->started_at = rb_monotonic();
    if (run->h->def.timeout > 0) {
        run->timeout_deadline = run->started_at + run->h->def.timeout;
        disp_arm_deadline(run);
    }
    if (d->listeners) {
        double late = rb_wall_time() - run->rec->run_at;
        rb_event ev = {.kind = RB_EV_STARTED, .delivery = run->rec, .start_delay = late > 0 ? late : 0};
        disp_emit(d, &ev);
    }
    run->h->def.start(run, run->h->def.ud);
}

/* A transactional run's begin in flight. */
typedef struct begin_ctx {
    rb_run *run;
    int leased;             /* begin_leased: `lease` is extended once the write lock is held */
    rb_settle_op lease;
} begin_ctx;

/* The run never started its handler and its transaction cannot begin for it: a run that lost
 * its lease writes nothing; one that ran out of time (its deadline passed while it waited)
 * hands the delivery back without counting the attempt, fenced (when it was taken over
 * meanwhile the release changes nothing). */
static void not_begun(rb_run *run, const char *err)
{
    disp_set_settling(run);
    if (!err && !run->abandoned && run->aborted != RB_ABORT_SHUTDOWN &&
        (run->aborted == RB_ABORT_LEASE || run->aborted == RB_ABORT_CANCELLED ||
         rb_monotonic() >= run_effective_deadline(run))) {
        disp_write_final(run, RB_OP_RELEASE, 0, NULL);
        return;
    }
    static rb_log_limit lim;
    if (err) rb_log_limited(&lim, RB_LOG_WARN, "cannot begin a transaction for %s: %s", run->rec->id, err);
    /* A transaction that cannot begin fails the run: retried with backoff, and its
     * last_error tells why (e.g. MongoDB without a replica set). */
    settle_outcome(run, 0, err ? err : "transaction could not begin");
}

static void on_tx_begun(void *ud, const char *err, rb_tx *tx)
{
    begin_ctx *b = ud;
    rb_run *run = b->run;
    int lost = b->leased && !err && !tx;    /* taken over while it waited for the lock */
    free(b);
    if (run->state == RUN_SETTLED) {
        /* detached by rb_dispatcher_free: its dispatcher is gone, the transaction too */
        if (tx) run->store->vt->rollback(tx, on_abandoned_rollback, NULL);
        disp_run_release_ref(run);
        return;
    }
    rb_dispatcher *d = run->d;
    if (lost) {
        /* Another claim holds it now and counted its own attempt: nothing is written. */
        disp_set_settling(run);
        disp_set_outcome(run, RB_OUT_LEASE_LOST, NULL);
        disp_run_settled(run);
        disp_run_release_ref(run);
        return;
    }
    int late = !begins_leased(run) && rb_monotonic() >= run_effective_deadline(run);
    if (err || run->abandoned || run->aborted || late) {
        if (tx) d->store->vt->rollback(tx, on_abandoned_rollback, NULL);
        not_begun(run, err);
        disp_run_release_ref(run);
        return;
    }
    run->tx = tx;
    /* begin_leased extended the lease inside the transaction, however long the wait was */
    if (begins_leased(run)) disp_lease_held_from(run, rb_monotonic(), d->opt.lease_duration, d->margin);
    begin_handler(run);
    disp_run_release_ref(run);
}

void disp_run_start(rb_run *run)
{
    rb_dispatcher *d = run->d;
    if (run->aborted == RB_ABORT_CANCELLED) {
        /* cancelled while it waited for its slot: it never starts, and its lease is gone */
        disp_set_settling(run);
        disp_set_outcome(run, RB_OUT_CANCELLED, NULL);
        disp_run_settled(run);
        return;
    }
    if (rb_monotonic() >= run->lease_deadline) {
        /* Claimed too late to run (the answer came after the local deadline, or it was parked
         * until then): hand it back, fenced and without using an attempt. If the lease was
         * taken over meanwhile, the release changes nothing. It claims less ahead for a
         * while: more was claimed than could start in time (disp_note_hand_back). */
        disp_note_hand_back(d, run);
        disp_set_settling(run);
        disp_write_final(run, RB_OP_RELEASE, 0, NULL);
        return;
    }
    /* Renewals count from the claim, not the start: a run claimed ahead may have waited. */
    run->renew_at = run->claimed_at + d->opt.lease_duration / 3;
    disp_arm_deadline(run);
    if (run->h->def.transactional) {
        begin_ctx *b = rb_calloc(1, sizeof *b);
        if (!b) {
            disp_set_settling(run);
            disp_write_final(run, RB_OP_RELEASE, 0, NULL);  /* out of memory: hand it back */
            return;
        }
        b->run = run;
        disp_set_state(run, RUN_BEGINNING);
        run->refs++;
        if (begins_leased(run)) {
            b->leased = 1;
            b->lease = (rb_settle_op){.kind = RB_OP_EXTEND, .id = run->rec->id,
                                      .token = run->rec->lease_token, .delay = d->opt.lease_duration};
            d->store->vt->begin_leased(d->store, &b->lease, on_tx_begun, b);
        } else {
            d->store->vt->begin(d->store, on_tx_begun, b);
        }
        return;
    }
    begin_handler(run);
}

