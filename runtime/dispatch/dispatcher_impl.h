/* dispatcher_impl.h -- what the dispatcher's files share (not installed): its structures, the
 * run states, and the functions one file calls in another. The dispatcher is one object in
 * four files:
 *   dispatcher.c           options, lifecycle (new, handle, start, stop, free), events, wake-ups
 *   dispatcher_claim.c     lanes and claiming: batches sized to the free slots, claiming ahead
 *   dispatcher_runs.c      one run: start, renewals, deadline, abort, finish
 *   dispatcher_shared.c    what the dispatchers on one store share: the registry of their
 *                          unsettled runs, the wake list, what their claims learnt
 *   dispatcher_settle.c    settle writes coalesced per loop iteration, explicit settles
 *   retention.c            completed deliveries deleted once older than the retention
 *   ticks.c                the ticks of the store's durable schedules, fired once each
 *   every.c                rb_dispatcher_every: a job run once per interval across processes
 * Names shared between them start with disp_ (hidden from the library's users). */
#ifndef RB_DISPATCHER_IMPL_H
#define RB_DISPATCHER_IMPL_H
#include <stddef.h>
#include "dispatch/dispatcher.h"
#include "util/timer.h"
#include "util/fifo.h"
#include "util/hmap.h"

#pragma GCC visibility push(hidden)

/* Settle texts (last_error) are made valid UTF-8 and kept at most this long: a remote body or
 * a handler's error must neither fail a store's write nor bloat its row. */
#define ERROR_MAX 2000
/* A final write the store refused is tried again after this, doubling up to the most. */
#define RETRY_FIRST 0.05
#define RETRY_MOST 5.0

/* ---- structures ------------------------------------------------------------------------- */
typedef struct handler_entry {
    char *topic;
    rb_handler_def def;
    size_t lane;
} handler_entry;

/* Topics claimed together (dispatcher.h: rb_handler_def's concurrency and priority). Without
 * those options a dispatcher has one lane of all its topics, and claims as it always did. */
typedef struct lane {
    const char **topics;
    size_t ntopics;
    size_t limit;               /* runs of the lane at once */
    int priority;
    int own;                    /* one topic with a concurrency of its own */
    size_t nactive, nsettling;  /* as the dispatcher's, for this lane's runs */
    int backlog;                /* its last claim came back full */
    int claimed;                /* it has claimed before: last_n means something */
    size_t last_n;              /* what its last claim brought */
    int blocked;                /* kept from claiming by other lanes' claims in flight */
    /* Claimed ahead (dispatcher_claim.c): runs claimed beyond the free slots wait here, in
     * claim order, and start as slots free. */
    struct rb_run *ahead_head, *ahead_tail;
    size_t nahead;              /* runs waiting for a slot: queued here, or parked */
    double run_time;            /* moving average of its handlers' run time (s); < 0 unknown */
    double last_end;            /* monotonic s when one of its handlers last ended */
    /* How much it may claim ahead at most, learnt from hand-backs (dispatcher_claim.c,
     * disp_note_hand_back): halved by each claim whose runs could not start within their
     * lease, grown by its slots per claim once a lease passed without one. */
    size_t ahead_cap;
    double cut_at;              /* monotonic s when ahead_cap was last halved; 0 never */
    double grown_at;            /* monotonic s when ahead_cap last grew */
} lane;

/* A run's states, and the only moves between them (set_state checks each in debug builds, in
 * the manner of SQLite's pager states):
 *   WAITING   -> BEGINNING | RUNNING | SETTLING | SETTLED   (parked, claimed ahead, or just claimed)
 *   BEGINNING -> RUNNING | SETTLING | SETTLED               (transactional: BEGIN in flight)
 *   RUNNING   -> SETTLING | SETTLED                         (the handler runs)
 *   SETTLING  -> SETTLED                                    (the final write is in flight)
 * SETTLED is final; a run moves to it from anywhere only when freed with its dispatcher. */
typedef enum {
    RUN_WAITING,        /* parked behind an earlier unsettled run of the same delivery, or
                         * claimed ahead and waiting for a slot */
    RUN_BEGINNING,      /* transactional: waiting for the store transaction */
    RUN_RUNNING,        /* the handler runs */
    RUN_SETTLING,       /* the handler ended; its settle write is in flight */
    RUN_SETTLED         /* done; freed when no store operation refers to it any more */
} run_state;

typedef struct settle_req settle_req;

struct rb_run {
    rb_dispatcher *d;
    rb_store *store;            /* d's, for what arrives after rb_dispatcher_free detached it */
    handler_entry *h;
    rb_delivery *rec;
    run_state state;
    rb_abort_reason aborted;
    rb_outcome outcome;         /* what the run came to, for the settled event */
    int refs;                   /* holds on it: store operations in flight, callbacks running */
    unsigned char settled_explicitly;   /* a ctx settle call was written: the return is ignored */
    unsigned char abandoned;    /* the stop timed out: write nothing more */
    unsigned char renewing;     /* a renewal is in flight */
    unsigned char deadline_armed;       /* the deadline is one of the timer's clocks (below) */
    double retry_delay;         /* s until the next try of a final write the store refused */
    double claimed_at;          /* monotonic s when its lease began here */
    size_t claim_ahead;         /* the room ahead its claim asked for; 0 also when parked */
    double started_at;          /* monotonic s when the handler started; 0 before */
    char *outcome_error;        /* the last_error it wrote, owned */
    /* An explicit settle the store could not take fails the run, as a raise with this text:
     * returning after a ctx:bury() that was not written must not complete the delivery. */
    char *settle_error;
    double lease_deadline;      /* monotonic: local end of the lease (with margin) */
    double timeout_deadline;    /* monotonic: the handler's timeout, or INFINITY */
    double shutdown_deadline;   /* monotonic: set by stop's abort phase, or INFINITY */
    /* One timer serves the run's three clocks (dispatcher_runs.c, "the run's clocks"): set
     * for the earliest of its deadline (while deadline_armed), its next renewal and the next
     * try of a refused final write; INFINITY where a clock is off. */
    rb_timer timer;
    double renew_at;            /* monotonic */
    double retry_at;            /* monotonic: the next try of a final write the store refused */
    settle_req *retry;          /* that write, made and waiting for the timer */
    rb_tx *tx;
    void *data;
    rb_run *parked;             /* a newer claim of this delivery waiting for us to settle */
    rb_run *ahead_next;         /* claimed ahead: the next in its lane's queue */
    rb_run *prev, *next;        /* the dispatcher's list of unsettled runs */
    rb_hnode active;            /* in the store's registry of unsettled runs (by delivery id) */
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
    int solo;                   /* sent in a store call of its own (a batch with it failed) */
    settle_req *next;
};

typedef struct listener {
    rb_event_fn fn;
    void *ud;
    struct listener *next;
} listener;

typedef struct stop_waiter {
    void (*done)(void *ud);
    void *ud;
    struct stop_waiter *next;
} stop_waiter;

/* A dispatcher's lifecycle. NEW -> RUNNING (start) -> STOPPING (stop) -> STOPPED (its runs
 * settled, or the stop's timeout, or free); RUNNING -> STOPPED directly when freed running;
 * NEW -> CANCELLED when stopped before it started (it can never start then). The order
 * matters: from STOPPING on, it claims nothing more. */
typedef enum {
    DISP_NEW,
    DISP_RUNNING,
    DISP_STOPPING,
    DISP_STOPPED,
    DISP_CANCELLED,
} disp_phase;

struct rb_dispatcher {
    rb_store *store;
    struct ev_loop *loop;
    rb_dispatcher_options opt;
    double margin;              /* safety margin subtracted from the lease locally */
    handler_entry *handlers;
    size_t nhandlers;
    lane *lanes;                /* by priority, highest first; made at start */
    size_t nlanes;
    const char **lane_topics;   /* the lanes' topics, in one array */
    const char **topics;
    disp_phase phase;           /* its lifecycle: only disp_set_phase moves it */
    int backlog;                /* the last claim came back full: more is probably due */
    struct claim_ctx *claims;   /* claims in flight, detached by rb_dispatcher_free */
    size_t nactive;             /* unsettled runs, parked ones included */
    size_t nsettling;           /* of those, runs whose handler ended (settle in flight) */
    size_t nahead;              /* of those, runs waiting for a slot: claimed ahead, or parked */
    rb_timer ahead_timer;       /* the next hand-back of a run claimed ahead */
    double ahead_due;           /* monotonic: the earliest hand-back due; INFINITY none */
    int starting_ahead, start_ahead_again;  /* disp_start_ahead runs (it is not re-entered) */
    int stop_held;              /* > 0: a loop over runs still uses d, the stop cannot end */
    double claim_time;          /* moving average of a claim's round trip (s); < 0 unknown */
    rb_run *runs;               /* list of unsettled runs */
    RB_FIFO(settle_req) queue;  /* settle writes waiting for the flush */
    size_t queued;
    settle_req **carry;         /* during a flush: the batch for the next claim to carry */
    size_t ncarry;
    ev_prepare flush_watcher;   /* flushes settle writes and pending claims each iteration */
    rb_idle spin_watcher;       /* keeps the loop from blocking while work is queued */
    rb_timer poll_timer;
    rb_timer claim_retry_timer;
    rb_timer grace_timer;       /* stop: 4/5 of the timeout */
    rb_timer hard_timer;        /* stop: the timeout */
    stop_waiter *waiters;
    stop_waiter spare_waiter;   /* a stop's done that no waiter could be allocated for */
    int flushing;
    int want_claim;
    int woken_while_claiming;   /* a wake-up came while claims were in flight */
    int poll_is_net;            /* the poll timer ends a sleep quiet_until allowed */
    unsigned net_polls;         /* such polls so far; claims sent by the one now carry its number */
    unsigned claiming_at_net;   /* 0 when the claims sent now are not such a poll's */
    unsigned net_counted;       /* the last such poll whose claims found unannounced deliveries */
    int unannounced;            /* such polls since the store's last notification */
    int quiet;                  /* on_quiet was called */
    listener *listeners;        /* of lifecycle events */
    rb_timer unhandled_timer;   /* the one check for topics nobody here handles */
    struct disp_retention *retention;   /* retention.c, while running; NULL when off */
    struct disp_schedules *schedules;   /* ticks.c, while running; NULL without them */
    struct rb_every_run *every_jobs;    /* every.c: the jobs of rb_dispatcher_every */
    rb_idle quiet_watcher;      /* calls on_quiet from the loop, with nothing of d on the stack */
    rb_dispatcher *next_on_store;
};

typedef struct claim_ctx {
    rb_dispatcher *d;           /* NULL once the dispatcher was freed under the claim */
    double sent_at;
    size_t limit;
    size_t ahead;               /* of limit, the room beyond the lane's slots (claiming ahead) */
    size_t lane;
    unsigned at_net;            /* sent by that poll (its number), or 0 */
    struct claim_ctx *prev, *next;  /* the dispatcher's claims in flight (list.h) */
} claim_ctx;

/* retention.c: started with the dispatcher (0, or -1 out of memory), stopped at its stop */
typedef struct disp_retention disp_retention;
int disp_retention_start(rb_dispatcher *d);
void disp_retention_stop(rb_dispatcher *d);

/* ticks.c: started with the dispatcher (0, or -1 out of memory), stopped at its stop */
typedef struct disp_schedules disp_schedules;
int disp_schedules_start(rb_dispatcher *d);
void disp_schedules_stop(rb_dispatcher *d);
void disp_schedules_changed(rb_dispatcher *d);   /* read them again now (or after this round) */

/* every.c: the jobs start with the dispatcher, stop waiting at its stop, go with it */
void disp_every_start(rb_dispatcher *d);
void disp_every_stop(rb_dispatcher *d);
void disp_every_free(rb_dispatcher *d);

/* dispatcher.c */
void disp_emit(rb_dispatcher *d, const rb_event *ev);
void disp_check_stop_done(rb_dispatcher *d);
void disp_maybe_quiet(rb_dispatcher *d);

/* dispatcher_claim.c */
int disp_make_lanes(rb_dispatcher *d);
void disp_init_ahead(rb_dispatcher *d);
void disp_start_ahead(rb_dispatcher *d);
void disp_release_ahead(rb_dispatcher *d);
void disp_count_waiting(rb_dispatcher *d, rb_run *run, int n);
void disp_unparked(rb_dispatcher *d, rb_run *run);
void disp_note_run_time(rb_dispatcher *d, size_t lane, double seconds);
void disp_note_hand_back(rb_dispatcher *d, const rb_run *run);
void disp_maybe_claim(rb_dispatcher *d);
handler_entry *disp_find_handler(rb_dispatcher *d, const char *topic);
void disp_on_poll(struct ev_loop *loop, ev_timer *w, int revents);
void disp_on_poll_timer(struct ev_loop *loop, ev_timer *w, int revents);

/* dispatcher_runs.c */
rb_outcome disp_outcome_of(const rb_run *run, rb_settle_kind kind);
void disp_set_outcome(rb_run *run, rb_outcome o, const char *error);
void disp_active_remove(rb_store *s, rb_run *run);
void disp_run_free(rb_run *run);
void disp_arm_deadline(rb_run *run);
/* The run's transaction holds the whole store (SQLite): nobody can take its lease meanwhile. */
int disp_tx_holds_store(const rb_run *run);
/* The lease is the run's until at least from + length - margin: the deadline moves there. */
void disp_lease_held_from(rb_run *run, double from, double length, double margin);
void disp_stop_renewals(rb_run *run);
void disp_stop_clocks(rb_run *run);
void disp_set_state(rb_run *run, run_state to);
void *disp_pool_get(int which, size_t size);
void disp_pool_put(int which, void *x);
enum { POOL_RUNS, POOL_SETTLES };

/* What the dispatchers on one store share (rb_store.dispatch), on its loop's thread. */
typedef struct disp_shared {
    rb_hmap registry;           /* their unsettled runs, by delivery id (rb_run.active) */
    rb_dispatcher *dispatchers; /* the started ones: a local enqueue or a notification wakes them */
    int unhandled_checked;      /* the check for topics nobody here handles was made */
    /* The store's notifications were taken as lost (dispatcher_claim.c, found_unannounced):
     * claims' quiet_until is ignored while they name this listener (rb_claim_result). */
    int deaf;
    unsigned deaf_listener;
    double crowded_until;       /* the latest a claim's answer asked for (rb_claim_result) */
} disp_shared;

/* The store's shared state, NULL when it has none (yet, or any more). */
disp_shared *disp_shared_of(const rb_store *s);
/* The same, made when missing; NULL when out of memory. */
disp_shared *disp_shared_get(rb_store *s);
/* Lets the registry's table go once no dispatcher is started on the store and none of their
 * runs is unsettled; the rest is freed with the store (rb_store_release_dispatch). */
void disp_shared_release(rb_store *s);
/* 1 when the dispatchers took the notifications of this listener as lost. */
int disp_deaf_to(const disp_shared *sh, unsigned listener);
rb_run *disp_active_find(const rb_store *s, const char *id);
int disp_active_add(rb_store *s, rb_run *run);
rb_run *disp_run_new(rb_dispatcher *d, handler_entry *h, rb_delivery *rec, double claimed_at);
void disp_run_start(rb_run *run);
void disp_run_abort(rb_run *run, rb_abort_reason reason);
void disp_run_settled(rb_run *run);
void disp_hand_on_parked(rb_run *run);
void disp_unlink_parked(rb_dispatcher *d);
void disp_run_release_ref(rb_run *run);
void disp_set_settling(rb_run *run);
void disp_write_final(rb_run *run, rb_settle_kind kind, double delay, const char *error);
void disp_on_renewed(settle_req *r, const char *err);
void disp_run_lost(rb_run *run);        /* its lease was refused: abort, cancelled or lost */

/* dispatcher_settle.c */
settle_req *disp_settle_new(rb_run *run, rb_settle_kind kind, double delay, const char *error,
                            settle_done_fn done);
void disp_settle_free(settle_req *r);
void disp_settle_enqueue(rb_dispatcher *d, settle_req *r);
void disp_request_flush(rb_dispatcher *d);
void disp_on_flush(struct ev_loop *loop, ev_prepare *w, int revents);
void disp_on_spin(struct ev_loop *loop, ev_idle *w, int revents);
/* Sends the claim req with the settle batch this flush set aside, when there is one and the
 * store takes both at once (claim_settle); 0 when the caller must send the claim itself. */
int disp_claim_carrying(rb_dispatcher *d, const rb_claim_req *req, rb_claim_cb cb, void *ud);

#pragma GCC visibility pop
/* The lifecycle (dispatcher.c): the one way to move it, checked against its transitions. */
void disp_set_phase(rb_dispatcher *d, disp_phase to);
/* Claims and starts runs. */
static inline int disp_live(const rb_dispatcher *d) { return d->phase == DISP_RUNNING; }
/* Was started (running, stopping or stopped since). */
static inline int disp_started(const rb_dispatcher *d)
{
    return d->phase == DISP_RUNNING || d->phase == DISP_STOPPING || d->phase == DISP_STOPPED;
}
/* Asked to stop, or stopped: claims nothing more. */
static inline int disp_winding_down(const rb_dispatcher *d) { return d->phase >= DISP_STOPPING; }
/* Stopped for good (after running, or before it started). */
static inline int disp_ended(const rb_dispatcher *d)
{
    return d->phase == DISP_STOPPED || d->phase == DISP_CANCELLED;
}

#endif
