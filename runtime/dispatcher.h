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
#include "store.h"

typedef struct rb_dispatcher rb_dispatcher;
typedef struct rb_run rb_run;

typedef enum {
    RB_ABORT_NONE = 0,
    RB_ABORT_LEASE,     /* the lease was lost or ran out: nothing is written */
    RB_ABORT_TIMEOUT,   /* the handler's timeout passed: settled as a failure "timeout" */
    RB_ABORT_SHUTDOWN   /* stop() gave up waiting: released, attempt not counted */
} rb_abort_reason;

const char *rb_abort_reason_name(rb_abort_reason r);

typedef struct rb_handler_def {
    void (*start)(rb_run *run, void *ud);
    void (*abort)(rb_run *run, rb_abort_reason reason, void *ud);
    void (*settled)(rb_run *run, void *ud);
    void (*free)(void *ud);          /* optional: called when the dispatcher is freed */
    void *ud;
    int transactional;               /* run inside a store transaction committed with completion */
    double timeout;                  /* s; 0 = none */
} rb_handler_def;

typedef struct rb_dispatcher_options {
    double lease_duration;           /* s, default 30 */
    double shutdown_timeout;         /* s, default 30 */
    double poll_interval;            /* s, default 1 */
    int concurrency;                 /* default 64 */
    /* s until the retry after `attempts` failed attempts; NULL = min(2^attempts, 3600) */
    double (*backoff)(int attempts, void *ud);
    void *backoff_ud;
    /* called once when the dispatcher has fully stopped (after stop's timeout at the latest) */
    void (*on_stopped)(rb_dispatcher *d, void *ud);
    void *on_stopped_ud;
} rb_dispatcher_options;

void rb_dispatcher_options_init(rb_dispatcher_options *o);

rb_dispatcher *rb_dispatcher_new(rb_store *store, const rb_dispatcher_options *o);
/* Returns 0, or -1 when the topic already has a handler or the dispatcher has started. */
int rb_dispatcher_handle(rb_dispatcher *d, const char *topic, const rb_handler_def *h);
void rb_dispatcher_start(rb_dispatcher *d);
/* Stops as CONTRACT.md's Shutdown section says; timeout < 0 means shutdown_timeout.
 * done(ud) is called once, when the stop has ended (at the timeout at the latest). */
void rb_dispatcher_stop(rb_dispatcher *d, double timeout, void (*done)(void *ud), void *ud);
int rb_dispatcher_running(const rb_dispatcher *d);   /* started and not fully stopped */
int rb_dispatcher_stopping(const rb_dispatcher *d);
size_t rb_dispatcher_active(const rb_dispatcher *d); /* runs not yet settled */
rb_store *rb_dispatcher_store(const rb_dispatcher *d);
/* Claims now instead of waiting for the poll (an enqueue in this process, a NOTIFY). */
void rb_dispatcher_wake(rb_dispatcher *d);
/* Frees a dispatcher that is not running (never started, or stopped). */
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
/* The transaction of a transactional run, or NULL. */
rb_tx *rb_run_tx(const rb_run *run);
void *rb_run_get_data(const rb_run *run);
void rb_run_set_data(rb_run *run, void *data);

/* The handler ended. ok: returned normally; otherwise error is its message (copied). The
 * dispatcher then settles as the contract's outcome table says. Call exactly once. */
void rb_run_finish(rb_run *run, int ok, const char *error);

/* Explicit settle from the handler (ctx:complete() and friends), fenced. cb gets
 * applied = 1 when written, 0 with err when the lease is lost or the run was aborted.
 * After one succeeds, the handler's own return is ignored. kind RB_OP_EXTEND renews the
 * lease (delay = duration, <= 0 for lease_duration). */
typedef void (*rb_run_settle_cb)(void *ud, const char *err, int applied);
void rb_run_settle(rb_run *run, rb_settle_kind kind, double delay, const char *reason,
                   rb_run_settle_cb cb, void *ud);

/* Monotonic clock in seconds (CLOCK_MONOTONIC; independent of the loop's cached time). */
double rb_monotonic(void);

/* Grace between an abort and the interruption of Lua code that keeps running (s). */
#define RB_ABORT_GRACE 0.1

#endif
