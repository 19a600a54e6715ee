/* store_faults.h -- a store that wraps a real store and injects faults at its interface, for
 * tests: operations that fail, answers that are lost after the write happened, answers that
 * come late. It also checks the inner store against store.h's callback contract.
 *
 * Every operation of the wrapper is forwarded to the inner store. Per operation a seeded PRNG
 * draws (always three numbers, so a seed gives the same sequence of decisions whatever the
 * rates) whether to
 *   fail  -- answer with an error without asking the inner store (nothing happened);
 *   lost  -- ask the inner store, let the operation take effect, then answer with an error
 *            instead of its result (the write happened but the caller does not know);
 *   late  -- deliver the answer (real or injected) after a delay in (min_delay, max_delay] seconds.
 * These are only errors and delays the contract allows a real store: a store may fail or be
 * slow at any time, and a connection may drop after a write committed. Two operations end a
 * transaction whatever happens (store.h: commit and rollback free the rb_tx), so for them
 * "fail" rolls the inner transaction back and reports an error; nothing is left open.
 *
 * A rollback without callback (nobody waits for it) is forwarded as it came, without faults.
 *
 * Injected errors read "injected fault: OP failed" and "injected fault: OP answer lost".
 *
 * Contract checks on the inner store (counted, see rb_fault_stats): a callback called a
 * second time (never passed on), a callback on another thread than the one that made the
 * wrapper (handed over to the loop thread through an ev_async, then passed on), an error that
 * is not one line, an error that came with results, and operations never answered (stuck
 * longer than stuck_after seconds when counted; unanswered after the inner store's close when
 * the wrapper owns it).
 *
 * Closing the wrapper answers every operation still waiting with "store closed" (as store.h
 * requires) and frees the answers held for later. The inner store is closed too only when the
 * wrapper owns it (own_inner); otherwise its owner closes it, after the wrapper. Answers the
 * inner store gives after the wrapper closed are dropped (records freed, a begun transaction
 * rolled back). */
#ifndef RB_STORE_FAULTS_H
#define RB_STORE_FAULTS_H

#include <stdint.h>
#include "stores/store.h"

typedef enum {
    RB_FOP_ENQUEUE, RB_FOP_CLAIM, RB_FOP_SETTLE, RB_FOP_GET, RB_FOP_LIST, RB_FOP_STATS,
    RB_FOP_KICK, RB_FOP_PURGE, RB_FOP_LEASE_ACQUIRE, RB_FOP_LEASE_EXTEND, RB_FOP_LEASE_RELEASE,
    RB_FOP_BEGIN, RB_FOP_TX_ENQUEUE, RB_FOP_TX_EXEC, RB_FOP_TX_QUERY, RB_FOP_TX_DOC,
    RB_FOP_COMMIT, RB_FOP_ROLLBACK,
    RB_FOP_COUNT
} rb_fault_op;

typedef enum { RB_FAULT_FAIL, RB_FAULT_LOST, RB_FAULT_LATE, RB_FAULT_KINDS } rb_fault_kind;

/* "enqueue", "claim", ... "rollback" (the vtable's names); parse returns -1 for others. */
const char *rb_fault_op_name(rb_fault_op op);
int rb_fault_op_parse(const char *name);
const char *rb_fault_kind_name(rb_fault_kind kind);     /* "fail", "lost", "late" */

typedef struct rb_fault_rates {
    double fail, lost, late;    /* probabilities; fail + lost <= 1 */
} rb_fault_rates;

typedef struct rb_faults_options {
    uint64_t seed;
    rb_fault_rates rates[RB_FOP_COUNT];
    double max_delay;           /* s; late answers wait up to this (default 0.05) */
    double min_delay;           /* s; and more than this (default 0; at most max_delay) */
    double stuck_after;         /* s; an unanswered operation older than this counts as
                                   stuck when the stats are read (default 30) */
    int own_inner;              /* closing the wrapper closes the inner store */
    /* When non-NULL: *inner_gone becomes nonzero once the inner store's owner closed it.
     * From then on the wrapper never touches the inner store and answers "store closed". */
    const int *inner_gone;
} rb_faults_options;

/* No faults, max_delay 0.05 s, stuck_after 30 s, the inner store not owned. */
void rb_faults_options_init(rb_faults_options *o, uint64_t seed);

/* Wraps `inner` (any store, on its loop; call on the loop's thread). The wrapper's vtable
 * has the inner store's name, flags and optional operations. NULL with a message in err
 * on failure (out of memory, bad rates). */
rb_store *rb_faults_wrap(rb_store *inner, const rb_faults_options *o, char *err, size_t errlen);

typedef struct rb_fault_stats {
    uint64_t seed;
    long calls[RB_FOP_COUNT];
    long injected[RB_FAULT_KINDS][RB_FOP_COUNT];
    long sync_answers;          /* the inner store answered before its call returned */
    long waiting;               /* operations whose caller has not been answered yet */
    long in_inner;              /* of those, the ones the inner store has not answered */
    long held;                  /* answers held for a late delivery */
    /* contract violations of the inner store */
    long twice;                 /* a callback called again (dropped) */
    long wrong_thread;          /* a callback on another thread */
    long multiline;             /* an error message with a newline */
    long err_with_result;       /* an error that came with records, rows or a transaction */
    long stuck;                 /* unanswered for longer than stuck_after, now */
    long unanswered;            /* unanswered when the owned inner store had closed */
} rb_fault_stats;

/* ---- a test's script ------------------------------------------------------------------------
 * Beside the drawn faults, a test may decide what becomes of each call itself (the C tests'
 * exact sequences: refuse the next settle, hold every claim's answer until the test lets it
 * go, answer begins late) and count what was asked. script.call sees every call of the
 * operations above before the draw and fills *plan; script.answered hears each caller being
 * answered. Both run on the loop's thread; either may be NULL. The operations the wrapper
 * does not inject faults into (topic_stats, pending_topics, bury, cancel, remove, progress,
 * pause, paused) are forwarded to the inner store as they are, unseen by the script. */
typedef struct rb_fault_call {
    rb_fault_op op;
    const rb_claim_req *claim;      /* a claim's request */
    rb_settle_op *ops;              /* a settle's writes (the caller's array) */
    size_t nops;
} rb_fault_call;

typedef struct rb_fault_plan {
    const char *refuse;     /* non-NULL: answered with this error (copied), the inner store not
                             * asked; a settle's writes are then not applied */
    double delay;           /* > 0: the answer comes this much later (s), in place of a drawn one */
    int hold;               /* the inner store's answer waits for rb_faults_release */
} rb_fault_plan;

typedef struct rb_fault_script {
    void *ud;
    void (*call)(void *ud, const rb_fault_call *call, rb_fault_plan *plan);
    void (*answered)(void *ud, rb_fault_op op);
} rb_fault_script;

/* Sets (or with NULL clears) the script of wrapper s; copied. */
void rb_faults_set_script(rb_store *s, const rb_fault_script *script);
/* Answers every held call the inner store has answered; returns how many. */
int rb_faults_release(rb_store *s);
/* How many held calls the inner store has answered (rb_faults_release would answer them). */
int rb_faults_ready(rb_store *s);
/* The wrapper's own vtable: a test may change its flags (claim_parallelism) or leave out an
 * optional operation (set it NULL) before the store is used. */
rb_store_vtable *rb_faults_vtable(rb_store *s);

/* Fills *st; returns -1 when s is not a fault-injecting wrapper. */
int rb_faults_stats(rb_store *s, rb_fault_stats *st);
int rb_store_is_faults(const rb_store *s);

#endif
