/* harness.h -- what the C tests (spec/c/NAME_test.c, cmocka) share: a private ev_loop, a real
 * store (SQLite in memory or in a temp file, PostgreSQL through RELAYBUS_TEST_PG) behind a
 * test double that counts and can delay or refuse calls, blocking helpers over the store's
 * callbacks, a recording C handler and a per-test leak check under LeakSanitizer.
 *
 * Every test gets a th_env from th_setup (its cmocka state) and takes it with th_env_of, which
 * skips the test when its store is not available (fails it when CI=true, as the busted
 * matrix does). th_teardown frees what the test left and runs the leak check. */
#ifndef TH_HARNESS_H
#define TH_HARNESS_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include <ev.h>
#include "dispatch/dispatcher.h"
#include "stores/store.h"
#include "alloc_faults.h"      /* util/alloc.h, and the failure to inject */
#include "store_faults.h"
#include "util/clock.h"

typedef enum { TH_SQLITE_MEMORY, TH_SQLITE_FILE, TH_POSTGRESQL } th_kind;
extern th_kind th_sqlite_memory, th_sqlite_file, th_postgresql;

/* One test entry per store kind: "sqlite: NAME", "postgresql: NAME"... */
#define TH_TEST(kind, name, fn) \
    { #kind ": " name, fn, th_setup, th_teardown, &th_##kind }

/* ---- the store double: a real store behind the fault-injecting wrapper -------------------
 * (testing/store_faults.h, no drawn faults), whose script (below) counts the calls and refuses,
 * delays or holds them as the test sets. */
#define TH_MAX_CALLS 4096

typedef struct th_spy {
    rb_store *store;            /* the wrapper: what the dispatcher is given */
    rb_store_vtable *vt;        /* its vtable (a test may change its flags) */
    rb_store *real;
    /* settle calls: how many, with how many writes each, and when */
    int settle_calls;
    size_t settle_writes;
    size_t batch[TH_MAX_CALLS];
    double batch_at[TH_MAX_CALLS];
    int kinds[5];               /* writes per rb_settle_kind */
    int refuse_settles;         /* refuse this many settle calls; -1: every one */
    int refuse_batches;         /* refuse every call with more than one write */
    char refuse_id[24];         /* refuse every call with a write of this delivery */
    double settle_delay;        /* pass the settles' answers on this much later (s) */
    int refused;
    int refuse_begins;          /* answer this many begins with an error; -1: every one */
    double begin_delay;         /* pass begins' answers on this much later (s) */
    int begins;                 /* begin calls */
    int purges;                 /* purge calls */
    /* claim calls */
    int claim_calls;
    int claims_in_flight, max_claims_in_flight;
    size_t claim_limit[TH_MAX_CALLS];
    int refuse_claims;          /* answer this many claims with an error; -1: every one */
    int hold_claims;            /* keep the answers until th_spy_answer_claims */
    double claim_delay;         /* or answer claims this long after they came (s) ... */
    int delay_claims;           /* ... this many of them (-1: every one) */
} th_spy;

/* Answers every held claim the real store has answered; returns how many. */
int th_spy_answer_claims(th_spy *p);
/* How many held claims the real store has answered (ready for th_spy_answer_claims). */
int th_spy_held(const th_spy *p);

/* ---- the environment of one test --------------------------------------------------------- */
#define TH_MAX_EVENTS 16384

typedef struct th_event {
    char what;                  /* S start, A abort, D settled, P on_stopped, Q on_quiet,
                                 * W a stop's done, F handler freed, U settled unstarted */
    rb_abort_reason reason;
    char id[24];
} th_event;

typedef struct th_env {
    th_kind kind;
    int unavailable;            /* the store could not be had: th_env_of skips or fails */
    char why[512];
    struct ev_loop *loop;
    ev_timer tick;              /* keeps every loop iteration short */
    th_spy *spy;
    rb_store *store;            /* == spy->store */
    char path[256];             /* the SQLite file (TH_SQLITE_FILE) */
    rb_dispatcher *d;           /* freed by teardown if the test leaves it */
    int stopped, quiet, stop_done;
    int free_in_quiet;          /* on_quiet frees d */
    int nevents;
    th_event ev[TH_MAX_EVENTS];
    struct th_handler *handlers[8];   /* th_new_handler's, freed after the dispatcher */
    int nhandlers;
    int warnings;               /* lines the runtime logged */
    char last_warning[512];
} th_env;

int th_setup(void **state);
int th_teardown(void **state);
th_env *th_env_of(void **state);

/* Runs loop iterations until cond holds or timeout s pass. */
int th_step(th_env *e, double end);
#define TH_RUN_UNTIL(e, cond, timeout) do { \
        double th_end_ = rb_monotonic() + (timeout); \
        while (!(cond) && th_step((e), th_end_)) {} \
    } while (0)
void th_run_for(th_env *e, double seconds);

void th_record(th_env *e, char what, rb_abort_reason reason, const char *id);
/* Index of the first event `what` (for id, or any when NULL) at or after `from`; -1 if none. */
int th_find_event(const th_env *e, char what, const char *id, int from);
int th_count_events(const th_env *e, char what, const char *id);

/* Options with the recording on_stopped / on_quiet, and a short poll. */
void th_options(th_env *e, rb_dispatcher_options *o);
rb_dispatcher *th_dispatcher(th_env *e, const rb_dispatcher_options *o);
/* Stops e->d and runs the loop until the stop is done (and quiet, when quiet is set). */
void th_stop(th_env *e, double timeout);

/* ---- blocking helpers on the real store (not counted by the spy) ------------------------- */
typedef struct th_ids { size_t n; char **id; } th_ids;
th_ids th_enqueue(th_env *e, const char *topic, size_t n, double delay, int max_attempts);
void th_ids_free(th_ids *ids);
rb_delivery *th_get(th_env *e, const char *id);        /* free with rb_delivery_free */
rb_stats th_stats(th_env *e);
/* Claims directly, as another worker would; returns how many (records freed). */
size_t th_claim(th_env *e, const char *topic, size_t limit, double lease);
/* The delivery's status, -1 when it is not there. */
int th_status(th_env *e, const char *id);

/* ---- a recording C handler ---------------------------------------------------------------- */
typedef struct th_handler th_handler;
typedef struct th_run th_run;

struct th_run {                 /* the handler's view of one run (rb_run_get_data) */
    th_handler *h;
    rb_run *run;
    char id[24];
    int attempts;
    ev_timer timer;             /* th_finish_after */
    int ok;
    char error[128];
    th_run *prev, *next;        /* the handler's live runs */
};

struct th_handler {
    rb_handler_def def;         /* topic's callbacks: the recorders below */
    th_env *env;
    /* what the handler does; NULL start keeps the run going until the test finishes it */
    void (*on_start)(th_handler *h, th_run *r);
    void (*on_abort)(th_handler *h, th_run *r, rb_abort_reason reason);
    void (*on_settled)(th_handler *h, th_run *r);
    void *ctx;
    double delay;               /* for th_start_later */
    int starts, aborts, settles, running, max_running, freed;
    int unstarted_settles;      /* settled callbacks for runs never started */
    th_run *live;
    int nlive;
};

/* A handler owned by e (it outlives the test function, for teardown's free). */
th_handler *th_new_handler(th_env *e);
/* Registers h for topic on e->d (def.timeout, def.transactional as set by the caller). */
void th_handle(th_env *e, th_handler *h, const char *topic);
void th_finish(th_run *r, int ok, const char *error);
void th_finish_after(th_run *r, double delay, int ok, const char *error);
th_run *th_live_run(th_handler *h, const char *id);

/* Ready-made behaviours. */
void th_start_ok(th_handler *h, th_run *r);             /* finishes ok inside start */
void th_start_fail(th_handler *h, th_run *r);           /* finishes with "boom" inside start */
void th_start_later(th_handler *h, th_run *r);          /* finishes ok after h->delay */
void th_abort_finish(th_handler *h, th_run *r, rb_abort_reason reason); /* ok, at once */

/* ---- explicit settles --------------------------------------------------------------------- */
typedef struct th_settle_result { int called, applied; char err[128]; } th_settle_result;
void th_settle_cb(void *ud, const char *err, int applied);

/* ---- leaks ---------------------------------------------------------------------------------- */
/* 1 when LeakSanitizer runs in this process with detect_leaks on. */
int th_lsan_active(void);
/* Runs LeakSanitizer's check now (reports to stderr); 1 when it found a leak. */
int th_leak_check(void);

#endif
