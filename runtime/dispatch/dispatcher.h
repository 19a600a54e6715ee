/* dispatcher.h -- claims due deliveries, runs them through handlers, keeps their leases and
 * settles them with fenced writes.
 *
 * The dispatcher knows nothing of Lua. A handler is three callbacks: start (begin running this
 * delivery; call rb_run_finish when it ends), abort (the run must stop now: wake every pending
 * wait) and settled (the run is over and about to be freed). The Lua binding implements them
 * with coroutines; a C host can implement them with plain functions. */
#ifndef RB_DISPATCHER_H
#define RB_DISPATCHER_H

#include <ev.h>
#include "stores/store.h"

typedef struct rb_dispatcher rb_dispatcher;
typedef struct rb_run rb_run;

typedef enum {
    RB_ABORT_NONE = 0,
    RB_ABORT_LEASE,     /* the lease was lost or ran out: nothing is written */
    RB_ABORT_TIMEOUT,   /* the handler's timeout passed: settled as a failure "timeout" */
    RB_ABORT_SHUTDOWN,  /* stop() gave up waiting: released, attempt not counted */
    RB_ABORT_CANCELLED  /* the delivery was cancelled (rb_store vtable cancel): nothing is written */
} rb_abort_reason;

const char *rb_abort_reason_name(rb_abort_reason r);

/* ---- lifecycle events: what a dispatcher reports, for metrics and observers ---- */
typedef enum {
    RB_EV_CLAIM,        /* a claim came back: n deliveries (0 when nothing was due) */
    RB_EV_CLAIMED,      /* a delivery was claimed for a run */
    RB_EV_STARTED,      /* its handler started: start_delay is set */
    RB_EV_SETTLED,      /* the run is over: outcome and duration are set */
    RB_EV_RENEWED       /* a lease renewal was written */
} rb_event_kind;

typedef enum {
    RB_OUT_COMPLETED, RB_OUT_RETRIED, RB_OUT_BURIED, RB_OUT_RELEASED,
    RB_OUT_LEASE_LOST,  /* nothing was written: the lease was gone */
    RB_OUT_TIMEOUT,     /* the handler's timeout passed (then retried or buried) */
    RB_OUT_ABANDONED,   /* the final write was never confirmed (a stop's timeout, a store that
                         * refused it to the end of the lease): the lease decides */
    RB_OUT_CANCELLED,   /* nothing was written: the delivery was cancelled while it ran */
    RB_OUT_COUNT
} rb_outcome;
const char *rb_outcome_name(rb_outcome o);  /* "completed", "retried", ... */

typedef struct rb_event {
    rb_event_kind kind;
    const rb_delivery *delivery;    /* NULL for RB_EV_CLAIM */
    size_t n;                       /* RB_EV_CLAIM: deliveries it returned */
    rb_outcome outcome;             /* RB_EV_SETTLED */
    double duration;                /* RB_EV_SETTLED: s from the handler's start (0 if none) */
    double start_delay;             /* RB_EV_STARTED: s from run_at to the handler's start */
    const char *error;              /* RB_EV_SETTLED: the text written as last_error, or NULL */
} rb_event;
/* Called on the loop thread, inside the dispatcher: it must not free the dispatcher or call
 * into it except for the rb_run_* getters. */
typedef void (*rb_event_fn)(rb_dispatcher *d, const rb_event *ev, void *ud);

typedef struct rb_handler_def {
    void (*start)(rb_run *run, void *ud);
    void (*abort)(rb_run *run, rb_abort_reason reason, void *ud);
    void (*settled)(rb_run *run, void *ud);
    void (*free)(void *ud);          /* optional: called when the dispatcher is freed */
    void *ud;
    int transactional;               /* run inside a store transaction committed with completion */
    double timeout;                  /* s; 0 = none */
    /* Lanes. concurrency > 0: at most that many runs of this topic at once, claimed on their
     * own, so a backlog of other topics does not hold them back; priority: when slots free up,
     * lanes of a higher priority claim first (topics without a concurrency of their own share
     * the lane of their priority). All within the dispatcher's concurrency. */
    int concurrency;
    int priority;
} rb_handler_def;

typedef struct rb_dispatcher_options {
    double lease_duration;           /* s, default 30 */
    double shutdown_timeout;         /* s, default 30 */
    double poll_interval;            /* s, default 1: see listen_poll_interval */
    int concurrency;                 /* default 64 */
    /* s until the retry after `attempts` failed attempts; NULL = min(2^attempts, 3600) */
    double (*backoff)(int attempts, void *ud);
    void *backoff_ud;
    /* called once when the dispatcher has fully stopped (after stop's timeout at the latest) */
    void (*on_stopped)(rb_dispatcher *d, void *ud);
    void *on_stopped_ud;
    /* called once, from the loop, when a stopped dispatcher has nothing left in flight (runs
     * abandoned at the stop's timeout have settled too): the host may free it then */
    void (*on_quiet)(rb_dispatcher *d, void *ud);
    void *on_quiet_ud;
    /* lifecycle events (optional; more listeners with rb_dispatcher_on_event) */
    rb_event_fn on_event;
    void *on_event_ud;
    /* Claiming ahead (docs/lua.md "Claiming ahead"): at most this many times the slots are
     * claimed beyond them for handlers faster than a claim's round trip; 0 never. Default 4. */
    int claim_ahead;
    /* s, default 30. While the store wakes the dispatcher for every delivery that becomes due
     * sooner (PostgreSQL with its LISTEN in force), an idle dispatcher claims when the next
     * delivery falls due (each claim reads when), or after this long at most (or after
     * poll_interval, if that is longer). Otherwise it claims every poll_interval. */
    double listen_poll_interval;
    /* s, default 604800 (7 days); 0 off. Completed deliveries older than this are deleted, in
     * batches of 1,000, by one process at a time (the named lease "relaybus.retention"; docs/
     * c.md "Retention"). Buried deliveries are kept. */
    double retention;
} rb_dispatcher_options;

void rb_dispatcher_options_init(rb_dispatcher_options *o);
#define RB_MIN_LEASE 0.01
#define RB_MAX_CONCURRENCY 1000000
#define RB_MAX_CLAIM_AHEAD 100
/* 0 when every option is in range (durations finite, within clock.h's limits); else -1 with
 * the reason in err. */
int rb_dispatcher_options_check(const rb_dispatcher_options *o, char *err, size_t errlen);

/* NULL when the options are out of range (rb_dispatcher_options_check), the store has no claim
 * or settle operation, or out of memory. */
rb_dispatcher *rb_dispatcher_new(rb_store *store, const rb_dispatcher_options *o);
/* Registers h (copied) for topic (copied). Returns 0, or -1 when the dispatcher has started,
 * the topic already has a handler, h or h->start is NULL, or memory ran out. */
int rb_dispatcher_handle(rb_dispatcher *d, const char *topic, const rb_handler_def *h);
/* Begins claiming. Does nothing once started, or once stopped (a stop before the start too):
 * a dispatcher runs at most once. Its store must be open. */
int rb_dispatcher_start(rb_dispatcher *d);  /* 0, or -1 out of memory (nothing started) */
/* Stops claiming at once; waits up to 4/5 of timeout for running handlers, then aborts the
 * rest (RB_ABORT_SHUTDOWN) and releases each as it ends, without counting the attempt. At
 * timeout the stop ends: runs still unsettled are abandoned to their leases (RB_OUT_ABANDONED)
 * and on_stopped is called. timeout < 0 means shutdown_timeout; a later stop can only shorten
 * it. done(ud), when given, is called once when the stop has ended (at once if the dispatcher
 * never started or has stopped). A dispatcher stopped before its start never runs. */
void rb_dispatcher_stop(rb_dispatcher *d, double timeout, void (*done)(void *ud), void *ud);
int rb_dispatcher_running(const rb_dispatcher *d);   /* started and not fully stopped */
int rb_dispatcher_stopping(const rb_dispatcher *d);
size_t rb_dispatcher_active(const rb_dispatcher *d); /* runs not yet settled */
/* of those, runs waiting for a slot: claimed ahead of the slots, or parked */
size_t rb_dispatcher_ahead(const rb_dispatcher *d);
rb_store *rb_dispatcher_store(const rb_dispatcher *d);
/* Adds (or removes) a listener of lifecycle events. on returns 0, or -1 out of memory. */
int rb_dispatcher_on_event(rb_dispatcher *d, rb_event_fn fn, void *ud);
void rb_dispatcher_off_event(rb_dispatcher *d, rb_event_fn fn, void *ud);
/* Aborts every run whose local deadline has passed, now (a host that could not step its loop
 * in time calls it first thing: nothing then runs on a lease that is gone). */
void rb_dispatcher_check_deadlines(rb_dispatcher *d);
/* Claims now instead of waiting for the poll (an enqueue in this process, a NOTIFY). */
void rb_dispatcher_wake(rb_dispatcher *d);
/* Frees a dispatcher. One still running is stopped at once (its runs abandoned). Its store
 * must still be open unless the dispatcher is quiet (on_quiet) or never started. */
void rb_dispatcher_free(rb_dispatcher *d);

/* ---- one run of one delivery ---- */
const rb_delivery *rb_run_delivery(const rb_run *run);
rb_dispatcher *rb_run_dispatcher(const rb_run *run);
/* Monotonic seconds (rb_monotonic) at which this run must have stopped. */
double rb_run_deadline(const rb_run *run);
rb_abort_reason rb_run_aborted(const rb_run *run);
/* Checks the clock now (a frozen process, a handler that never yielded): aborts the run when
 * its deadline has passed. Returns the abort reason, RB_ABORT_NONE while it may go on. */
rb_abort_reason rb_run_check(rb_run *run);
/* Seconds until a retry of this run's attempt, as the dispatcher's backoff gives them (the
 * delay a raise would get). */
double rb_run_backoff(const rb_run *run);
/* The transaction of a transactional run, or NULL. */
rb_tx *rb_run_tx(const rb_run *run);
void *rb_run_get_data(const rb_run *run);
void rb_run_set_data(rb_run *run, void *data);

/* The handler ended. ok: returned normally; otherwise error is its message (copied). The
 * dispatcher then settles as docs/lua.md's outcome table says (completed; retried with
 * backoff or buried at max_attempts; nothing after a lost lease; released after a shutdown
 * abort), unless an explicit settle was written. Call exactly once. */
void rb_run_finish(rb_run *run, int ok, const char *error);

/* Explicit settle from the handler (ctx:complete() and friends), fenced. cb gets
 * applied = 1 when written; else 0 with err: "lease lost", "aborted" (the run is aborted or
 * past its deadline, or was aborted while the write waited to go out), "already settled", a
 * refusal for transactional runs (they settle by finishing; on SQLite they cannot extend),
 * "out of memory", or the store's error (then the write becomes the run's final one, tried
 * again when the handler ends). cb may run before rb_run_settle returns. After a settle
 * succeeds the handler's own return is ignored; a written release or reschedule also aborts
 * the run (RB_ABORT_LEASE), since another worker may take the delivery. kind RB_OP_EXTEND
 * renews the lease (delay = duration, <= 0 for lease_duration) and never shortens it. */
typedef void (*rb_run_settle_cb)(void *ud, const char *err, int applied);
void rb_run_settle(rb_run *run, rb_settle_kind kind, double delay, const char *reason,
                   rb_run_settle_cb cb, void *ud);
/* Stores `json` (JSON text) as the delivery's progress, fenced by the run's lease (inside the
 * run's transaction on a store whose transactions hold it whole: seen at its commit).
 * cb(ud, err, applied): applied 0 with "lease lost" when the lease is gone (the run is then
 * aborted), "aborted" once the run has ended or been aborted. */
void rb_run_progress(rb_run *run, const char *json, rb_run_settle_cb cb, void *ud);

/* Grace between an abort and the interruption of Lua code that keeps running (s). */
#define RB_ABORT_GRACE 0.1

/* ---- every: a function run once per interval across processes (every.c; docs/c.md) ---- */
typedef struct rb_every_run rb_every_run;
struct rb_lease;
typedef struct rb_every_def {
    /* Required: a run begins. Call rb_every_finish(run, ...) exactly once, now or later. */
    void (*start)(rb_every_run *run, void *ud);
    /* The run's lease reached its deadline while it ran: it must stop now (another process
     * may take the name). Called at most once per run, only while it runs. */
    void (*abort)(rb_every_run *run, void *ud);
    void (*free)(void *ud);     /* when the job is freed (with its dispatcher, or after) */
    void *ud;
} rb_every_def;
#define RB_EVERY_NAME_MAX 249   /* bytes: its lease, "every:NAME", within a lease name's 255 */
/* 1 when name is 1 to RB_EVERY_NAME_MAX bytes of UTF-8 (no NUL: it is a C string). */
int rb_every_valid_name(const char *name);
/* Registers a job (def copied, name copied) started by the dispatcher's start and ended by its
 * stop. 0, or -1 when the dispatcher has started (or stopped), name is not valid, interval is
 * not above 0 and at most 100 years, def or def->start is NULL, the store has no named leases,
 * or memory ran out. */
int rb_dispatcher_every(rb_dispatcher *d, const char *name, double interval, const rb_every_def *def);
const char *rb_every_name(const rb_every_run *run);
/* The run's lease (lent for the run): extending it lets the run go on past the interval. */
struct rb_lease *rb_every_lease(rb_every_run *run);
/* Monotonic s at which the run must have stopped: its lease's deadline (later once extended). */
double rb_every_deadline(const rb_every_run *run);
/* The dispatcher, or NULL once it was freed (the run goes on to its finish all the same). */
rb_dispatcher *rb_every_dispatcher(const rb_every_run *run);
/* The run ended: ok, or error (logged as "every 'NAME' failed: ERROR"). Exactly once. */
void rb_every_finish(rb_every_run *run, int ok, const char *error);

#endif
