/* store.h -- the store interface: one vtable of asynchronous operations.
 *
 * The dispatcher and the Lua binding drive every store (SQLite, PostgreSQL, MongoDB) through
 * this table and never know which one it is. Every operation takes a callback that is invoked
 * on the loop thread exactly once. A store MAY invoke it before the operation returns (SQLite
 * does), so callers must cope with a synchronous completion. Data handed to a callback is valid
 * only during the callback unless the signature says ownership passes (rb_delivery lists do).
 *
 * Errors are one-line messages without a trailing newline; `err == NULL` means success.
 * Fenced operations (rb_settle_op) never report a lost lease as an error: they set
 * `applied = 0`, an ordinary outcome. An error means the outcome is not known: the store may
 * not have been asked at all, or the connection may have been lost after the write was sent
 * (then it may have been made). Fenced writes are safe to send again. */
#ifndef RB_STORE_H
#define RB_STORE_H

#include <stddef.h>
#include <stdint.h>
#include <ev.h>
#include "stores/delivery.h"
#include "util/clock.h"

typedef struct rb_store rb_store;
typedef struct rb_tx rb_tx;

/* --- values and rows for tx:exec / tx:query (SQL stores) ------------------------------- */
typedef enum { RB_VNULL, RB_VINT, RB_VFLOAT, RB_VBOOL, RB_VTEXT } rb_value_type;
typedef struct rb_value {
    rb_value_type type;
    int64_t i;          /* RB_VINT, RB_VBOOL (0/1) */
    double f;           /* RB_VFLOAT */
    const char *s;      /* RB_VTEXT (not owned in params; owned by the rowset in results) */
    size_t len;         /* RB_VTEXT length */
} rb_value;

typedef struct rb_rowset {
    int ncols;
    char **names;       /* ncols column names */
    size_t nrows;
    rb_value *vals;     /* nrows * ncols, row-major */
} rb_rowset;
void rb_rowset_free(rb_rowset *rs);

/* --- requests -------------------------------------------------------------------------- */
/* A group's name: 1 to RB_GROUP_MAX bytes of UTF-8 without a NUL byte (rb_group_valid). */
#define RB_GROUP_MAX 512
int rb_group_valid(const char *group, size_t len);

typedef struct rb_enqueue_item {
    const char *topic;
    const char *payload;    /* JSON text, already validated by the caller */
    const char *key;        /* dedupe key, or NULL */
    int replace;            /* with a key: a pending delivery of the topic and key gets this
                             * payload, run_at and max_attempts (its group stays) and keeps its
                             * id; a running one is left alone (kept) */
    const char *group;      /* ordered group, or NULL: a claim takes a delivery of a group only
                             * while no other of it is processing under a live lease and none
                             * with a smaller id is pending or processing */
    double run_at;          /* epoch s; 0 = now (+ delay) */
    double delay;           /* s, added to the store's now when run_at == 0 */
    int max_attempts;       /* >= 1 */
    /* Dependencies (NULL, or nafter ids of this store, at most RB_AFTER_MAX): the delivery is
     * held (pending, not due) until every one of them completed, then due at its run_at; when
     * one is buried or cancelled it is cancelled, with "dependency ID was buried" (or
     * cancelled) as its last_error, and so are the ones after it. An id that is no delivery,
     * one not enqueued before it (so no cycle can form), more than RB_AFTER_MAX of them, or a
     * chain deeper than RB_AFTER_DEPTH_MAX fails the enqueue. Not with group or replace. */
    const char *const *after;
    size_t nafter;
} rb_enqueue_item;
#define RB_AFTER_MAX 1000
/* The longest chain of dependencies (a delivery after one after one...): a cancel goes down it
 * in one write, and stores bound how deep that may recurse. */
#define RB_AFTER_DEPTH_MAX 100

/* A topic's limits, across every process: a claim starts a delivery of it only while fewer than
 * `concurrency` of it run under live leases, and while fewer than `rate` of it started in the
 * last `per` seconds (a sliding window). 0 in concurrency or rate: that limit is off. A limited
 * delivery waits pending: no attempt is counted. */
typedef struct rb_limit {
    int64_t rate;           /* starts per window, 1 .. RB_LIMIT_MAX, or 0 */
    double per;             /* the window, s: > 0 and at most RB_MAX_SECONDS (with rate) */
    int64_t concurrency;    /* at most this many running, 1 .. RB_LIMIT_MAX, or 0 */
} rb_limit;
#define RB_LIMIT_MAX 1000000000
#define RB_LIMIT_PER_MIN 0.001  /* a shorter window would hold nothing back */
/* Whether lim holds limits a store takes: at least one on, each in its range. */
int rb_limit_valid(const rb_limit *lim);

/* The statuses an operation on many takes: a live one ("pending", "processing": cancel_all)
 * and a settled one ("completed", "buried", "cancelled": purge). 1 when status is one. */
int rb_live_status(const char *status);
int rb_settled_status(const char *status);

/* A durable schedule (store:schedule): kept in the store by name; every dispatcher on the
 * store fires its ticks (dispatch/ticks.c), each once, as a delivery of `topic` whose key is
 * the tick's (schedule/schedule.h computes the ticks). */
typedef struct rb_schedule {
    const char *name;       /* rb_schedule_name_valid */
    const char *topic;
    const char *payload;    /* JSON text, already validated by the caller */
    const char *cron;       /* a cron expression (schedule/cron.h), or NULL with every */
    double every;           /* s, or 0 with cron */
    const char *timezone;   /* cron's zone, or NULL: UTC */
    double next_at;         /* epoch s: the first tick */
} rb_schedule;
#define RB_SCHEDULES_MAX 10000

typedef struct rb_claim_req {
    const char *const *topics;  /* only these topics are claimed */
    size_t ntopics;
    size_t limit;               /* at most this many deliveries */
    double lease_duration;      /* s; expiry = store's now + lease_duration */
} rb_claim_req;

/* A fenced write: changes the row only while it is `processing` with lease_token == token. */
typedef enum {
    RB_OP_COMPLETE,     /* -> completed, lease cleared */
    RB_OP_RESCHEDULE,   /* -> pending, run_at = now + delay, last_error = error (attempt counted) */
    RB_OP_BURY,         /* -> buried, last_error = error */
    RB_OP_RELEASE,      /* -> pending, run_at = now + delay, attempts - 1 (attempt not counted) */
    RB_OP_EXTEND        /* lease_expires_at = now + delay; stays processing */
} rb_settle_kind;

typedef struct rb_settle_op {
    rb_settle_kind kind;
    const char *id;
    const char *token;
    double delay;           /* RESCHEDULE/RELEASE: s until run_at; EXTEND: new lease length */
    const char *error;      /* RESCHEDULE/BURY: last_error (may be NULL) */
    /* results, filled by the store before the callback */
    int applied;            /* 1: the row changed; 0: lease lost (status or token differ) */
    double lease_expires_at;/* EXTEND: the new expiry (epoch s) when applied */
} rb_settle_op;

#define RB_SEARCH_MAX 1024
typedef struct rb_list_req {
    const char *status;     /* NULL = any */
    const char *topic;      /* NULL = any */
    /* a search (NULL = any): the key exactly, a topic that starts with topic_prefix, a
     * last_error that contains error_text (bytes compared as they are); callers keep each
     * to RB_SEARCH_MAX bytes (a regular expression of a megabyte stalls a MongoDB server) */
    const char *key, *topic_prefix, *error_text;
    size_t limit;           /* 0 = default 100 */
    /* Pages for a viewer: newest first (by id: the most recently enqueued first) instead of
     * oldest first; with `after` (the last id of the previous page) only those older than it.
     * An `after` that is no id of this store gives an empty page. */
    int newest_first;
    const char *after;      /* NULL = from the newest; only with newest_first */
} rb_list_req;

typedef struct rb_stats {
    int64_t pending, processing, completed, buried, cancelled, due;
    double oldest_due_age;  /* s; 0 when nothing is due */
    int64_t stalled;        /* of the processing: those whose lease is over (their worker died
                             * or froze; the next claim takes them over) */
    int completed_estimated;/* 1: `completed` is an estimate (SQLite and PostgreSQL: a table
                             * of more than 100,000 rows) */
} rb_stats;

/* What the store's lease call does with a named lease (see the vtable's lease). */
typedef enum rb_lease_op { RB_LEASE_ACQUIRE, RB_LEASE_EXTEND, RB_LEASE_RELEASE } rb_lease_op;
/* topic_stats' rows: columns topic (text), pending, processing, completed, buried, cancelled
 * (ints; completed NULL where the store counts them only in a small table: SQLite and
 * PostgreSQL above 100,000 rows), oldest_due_age (float: s since the earliest run_at of its pending deliveries,
 * 0 when none is due),
 * one row per topic, ordered by topic, at most RB_TOPIC_STATS_MAX rows. */
#define RB_TOPIC_STATS_MAX 10000

/* pending_topics' bound as the stores take it: 1 to INT32_MAX. */
static inline size_t rb_scan_bound(size_t scan_max)
{
    return scan_max < 1 ? 1 : scan_max > INT32_MAX ? INT32_MAX : scan_max;
}

/* --- callbacks ------------------------------------------------------------------------- */
typedef void (*rb_done_cb)(void *ud, const char *err);
/* ids: n strings, valid during the callback. kept: NULL, or n flags, nonzero where the item
 * found a live delivery of its topic and key and left it as it was (a dedupe, or a replace of
 * one already running): ids[i] is that one's. */
typedef void (*rb_ids_cb)(void *ud, const char *err, char **ids, const unsigned char *kept,
                          size_t n);
/* recs: ownership of the array and of each record passes to the callee
 * (free with rb_delivery_list_free or rb_delivery_free + free(recs)) */
typedef void (*rb_records_cb)(void *ud, const char *err, rb_delivery **recs, size_t n);

/* What a claim answers: the records it claimed, and what it read of the table that tells its
 * dispatchers when to claim next and how many claims to keep in flight. */
typedef struct rb_claim_result {
    /* n claimed records: ownership of the array and of each record passes to the callee
     * (rb_delivery_list_free) */
    rb_delivery **recs;
    size_t n;
    /* The monotonic time (clock.h) before which no delivery this claim could have claimed
     * falls due unless a wake-up (set_wakeup) comes; INFINITY when none is live; 0 when
     * unknown. Only a store that wakes its dispatchers for every delivery that becomes due
     * sooner says more than 0 (PostgreSQL while its LISTEN is in force). */
    double quiet_until;
    /* A store whose claims wait in the server for a claim slot (PostgreSQL's claim slots,
     * docs/stores.md), when this claim waited for its slot: the monotonic time until which
     * the dispatchers on the store keep one claim in flight instead of claim_parallelism (a
     * waiting claim holds its snapshot, and with it old row versions every claim steps over);
     * 0 when it did not wait. */
    double crowded_until;
    /* The listener whose notifications quiet_until counts on (PostgreSQL: its LISTEN's epoch,
     * a new one after each reconnect); 0 without one. Dispatchers that found its
     * notifications lost ignore quiet_until until the listener changes. */
    unsigned listener;
} rb_claim_result;
/* err: NULL and res the answer (lent for the call; its records are the callee's), or one
 * line and res NULL */
typedef void (*rb_claim_cb)(void *ud, const char *err, rb_claim_result *res);
typedef void (*rb_count_cb)(void *ud, const char *err, int64_t count);
typedef void (*rb_stats_cb)(void *ud, const char *err, const rb_stats *st);
/* acquired: 1 when the caller now holds the lease (or it was extended/released), 0 otherwise */
typedef void (*rb_lease_cb)(void *ud, const char *err, int acquired, double expires_at);
typedef void (*rb_tx_cb)(void *ud, const char *err, rb_tx *tx);
/* rs: ownership passes to the callee (rb_rowset_free) */
typedef void (*rb_rows_cb)(void *ud, const char *err, rb_rowset *rs);
/* doc: JSON text of the found document or NULL (mongo find_one) */
typedef void (*rb_doc_cb)(void *ud, const char *err, const char *doc_json, int64_t count);

/* The caller's callback of any operation, as a store keeps it until the answer. */
typedef union rb_store_cb {
    rb_ids_cb ids;
    rb_records_cb records;
    rb_claim_cb claim;
    rb_done_cb done;
    rb_count_cb count;
    rb_stats_cb stats;
    rb_lease_cb lease;
    rb_tx_cb tx;
    rb_rows_cb rows;
    rb_doc_cb doc;
} rb_store_cb;

/* --- the vtable -------------------------------------------------------------------------- */
typedef enum { RB_KICK_ONE, RB_KICK_BURIED } rb_kick_mode;
typedef enum { RB_DOC_INSERT_ONE, RB_DOC_UPDATE_ONE, RB_DOC_DELETE_ONE, RB_DOC_FIND_ONE } rb_doc_op;

typedef struct rb_store_vtable {
    const char *name;   /* "sqlite", "postgresql", "mongodb" */
    /* 1 when an open transaction holds the whole store (SQLite's single connection): every
     * other operation waits for it to end, so a caller inside the transaction must not wait
     * for one. */
    int tx_exclusive;
    /* How many claims of one dispatcher may be in flight at once (0 counts as 1). Above 1 when
     * the server runs statements side by side: while one batch runs here, the next claim is
     * already being answered, so neither side waits for the other during a backlog. */
    int claim_parallelism;

    void (*enqueue)(rb_store *s, const rb_enqueue_item *items, size_t n, rb_ids_cb cb, void *ud);
    /* Claims due deliveries of the given topics: pending with run_at <= now, or processing
     * with lease_expires_at <= now. Each gets status processing, attempts + 1, fence + 1, a new
     * lease token and expiry now + lease. A delivery whose attempts would pass max_attempts is
     * buried (last_error "max attempts exceeded", unless it already has one) instead and not
     * returned. Earliest due first: by run_at (PostgreSQL orders an expired processing
     * delivery by its lease's expiry instead). */
    void (*claim)(rb_store *s, const rb_claim_req *req, rb_claim_cb cb, void *ud);
    /* Applies n fenced writes, ideally in one round trip; fills each op's results. ops (and
     * the strings they point at) must stay valid until cb: the results are written into them. */
    void (*settle)(rb_store *s, rb_settle_op *ops, size_t n, rb_done_cb cb, void *ud);
    /* Optional (may be NULL): settle(ops, n) and then claim(req) in one round trip (PostgreSQL:
     * one statement, so the claim sees the writes: a delivery they release may be claimed
     * again). settle_cb and cb are each called once, in either order, with the results settle
     * and claim would give; a failure of the claim alone never fails the writes. */
    void (*claim_settle)(rb_store *s, const rb_claim_req *req, rb_claim_cb cb, void *ud,
                         rb_settle_op *ops, size_t n, rb_done_cb settle_cb, void *settle_ud);

    void (*get)(rb_store *s, const char *id, rb_records_cb cb, void *ud);
    void (*list)(rb_store *s, const rb_list_req *req, rb_records_cb cb, void *ud);
    void (*stats)(rb_store *s, rb_stats_cb cb, void *ud);
    /* RB_KICK_ONE: the buried or cancelled delivery `id`; RB_KICK_BURIED: all buried, or all
     * buried of `topic` when it is not NULL. -> pending, attempts 0,
     * due now, or when the lease that `bury` kept ends if that is later (no new run while
     * the buried run may still act).
     * A buried delivery whose topic and key a live delivery holds again: PostgreSQL leaves it
     * buried (not counted), MongoDB requeues it without its dedupe, SQLite requeues it. */
    void (*kick)(rb_store *s, rb_kick_mode mode, const char *id, const char *topic,
                 rb_count_cb cb, void *ud);
    /* Deletes deliveries of `status` (completed, buried or cancelled) settled more than
     * older_than s ago, of `topic` only when it is not NULL, at most `limit` of them (0 = no
     * limit). */
    void (*purge)(rb_store *s, const char *status, const char *topic, double older_than,
                  size_t limit, rb_count_cb cb, void *ud);
    /* For operators (the dashboard). Counts per topic and status (see RB_TOPIC_STATS_MAX). */
    void (*topic_stats)(rb_store *s, rb_rows_cb cb, void *ud);
    /* Buries delivery `id` now when it is pending or processing (a running handler's lease
     * is taken away: its later writes are not applied, though the lease's expiry is kept for
     * kick), last_error = reason (may be NULL).
     * count: 1 when buried, 0 when no such live delivery. */
    void (*bury)(rb_store *s, const char *id, const char *reason, rb_count_cb cb, void *ud);
    /* Cancels delivery `id` when it is pending or processing: -> cancelled, settled now,
     * last_error = reason (may be NULL), its lease's token cleared (a running handler's later
     * writes are not applied; the expiry stays for kick, as after bury). Dispatchers running
     * it hear of it through rb_store_cancelled: in this process at once, on PostgreSQL in the
     * others by NOTIFY; elsewhere their next renewal finds the lease gone.
     * count: 1 when cancelled, 0 when no such live delivery. */
    void (*cancel)(rb_store *s, const char *id, const char *reason, rb_count_cb cb, void *ud);
    /* Deletes delivery `id` when it is settled (completed, buried or cancelled).
     * count: 1 deleted, 0 otherwise. */
    void (*remove)(rb_store *s, const char *id, rb_count_cb cb, void *ud);

    /* Named leases. `token` identifies the holder. acquire succeeds when the name is free,
     * expired (store clock) or already held under this token; extend only while the token
     * matches and the lease has not expired (it never shortens it); release while the token
     * matches, expired or not: a successor holds another token, so a late release never
     * revokes it. (The handles of leases.h refuse extend and release past their own deadline
     * without asking the store.) */
    void (*lease)(rb_store *s, rb_lease_op op, const char *name, const char *token,
                  double duration, rb_lease_cb cb, void *ud);    /* duration: not for release */

    /* Transactions: the application's writes and deliveries commit together. */
    void (*begin)(rb_store *s, rb_tx_cb cb, void *ud);
    void (*tx_enqueue)(rb_tx *tx, const rb_enqueue_item *items, size_t n, rb_ids_cb cb, void *ud);
    /* SQL stores; NULL in stores without SQL. Placeholders are the store's native ones, bound
     * by position: PostgreSQL's $1, $2...; SQLite's ?, ?NNN, :name, @name and $name, each
     * distinct one numbered in order of first appearance unless it is ?NNN (so $1, $2 mean
     * there what they mean on PostgreSQL only when they first appear in that order). */
    void (*tx_exec)(rb_tx *tx, const char *sql, const rb_value *params, size_t nparams,
                    rb_count_cb cb, void *ud);
    void (*tx_query)(rb_tx *tx, const char *sql, const rb_value *params, size_t nparams,
                     rb_rows_cb cb, void *ud);
    /* Document stores; NULL in SQL stores. JSON texts (MongoDB extended JSON). */
    void (*tx_doc)(rb_tx *tx, rb_doc_op op, const char *collection, const char *filter_json,
                   const char *doc_json, rb_doc_cb cb, void *ud);
    /* Commits. With `complete` non-NULL, first applies that fenced write inside the
     * transaction; when it is not applied (lease lost) the transaction rolls back and
     * complete->applied is 0; complete must stay valid until cb. The rb_tx is freed by commit
     * and rollback, whatever their outcome; cb may be NULL for rollback.
     * A statement of the transaction that failed (tx_exec, tx_query, tx_enqueue, tx_doc)
     * dooms it, whether or not its caller looked at the error: commit then rolls back and
     * fails with that statement's error. Statements that would end the transaction or change
     * the session beyond it (BEGIN, COMMIT, ROLLBACK, SAVEPOINT, RELEASE; on SQLite also
     * PRAGMA, ATTACH, DETACH and temporary objects) are refused, and doom it too. */
    void (*commit)(rb_tx *tx, rb_settle_op *complete, rb_done_cb cb, void *ud);
    void (*rollback)(rb_tx *tx, rb_done_cb cb, void *ud);

    /* Optional (may be NULL): calls fn(ud) on the loop when another connection or process
     * enqueued something due (PostgreSQL LISTEN/NOTIFY). Pass fn NULL to stop. */
    void (*set_wakeup)(rb_store *s, void (*fn)(void *ud), void *ud);

    /* Closes connections and frees the store. Operations still in flight get their callback
     * with an error before close returns: "store closed" on SQLite, "postgresql: store closed"
     * and "mongodb: store closed" (every message ends in "store closed"). MongoDB first waits
     * for the calls its worker threads have in progress. */
    void (*close)(rb_store *s);

    /* Optional (last, so hosts built against the vtable before it keep their offsets). Counts
     * per topic of pending deliveries among at most scan_max of them (1 to INT32_MAX; others
     * are clamped), the earliest due: columns topic (text) and pending (int), by topic, at
     * most RB_TOPIC_STATS_MAX rows. Where the store's due index serves that order (PostgreSQL,
     * SQLite, MongoDB; not FerretDB, which reads every pending document) the cost is bounded
     * by scan_max whatever the size of the table. Counts that add up to scan_max are lower
     * bounds. The dispatcher's check for topics nobody handles uses it (else topic_stats). */
    void (*pending_topics)(rb_store *s, size_t scan_max, rb_rows_cb cb, void *ud);

    /* Optional, for stores whose transaction holds the whole store (tx_exclusive): while it is
     * open nobody else can write, so nobody can take a lease over. begin_leased begins a
     * transaction for a run that holds `lease` (an RB_OP_EXTEND: id, token, delay = the
     * lease's length; valid until cb, the store keeps a copy). Once the write lock is held the
     * lease is extended inside the
     * transaction, fenced: when it is no longer the run's (taken over while the run waited
     * for the lock) nothing begins and cb gets neither error nor tx (lease->applied 0). A
     * rollback of such a transaction, and a commit that fails, discard its other writes but
     * keep the lease extended to now + delay, so the run's settle after them still finds it.
     * tx_holds answers at once: 1 while tx still holds the store (an error inside it may have
     * ended it early, releasing the lock), so the run's lease cannot be lost meanwhile. */
    void (*begin_leased)(rb_store *s, rb_settle_op *lease, rb_tx_cb cb, void *ud);
    int (*tx_holds)(rb_tx *tx);

    /* Optional (NULL: no progress here). Stores `json` (JSON text) as the progress of delivery
     * `id`, fenced as a settle: only while it is processing under `token`. `tx`: the run's
     * transaction, or NULL; a store whose transactions hold it whole (SQLite) writes inside
     * it, the others apart at once. count: 1 when written, 0 when the lease is gone. */
    void (*progress)(rb_store *s, rb_tx *tx, const char *id, const char *token,
                     const char *json, rb_count_cb cb, void *ud);
    /* Optional (NULL: the store cannot pause). Pauses (paused 1) or resumes (0) `topic`,
     * durably, for every process on the store: no claim takes a delivery of a paused topic.
     * count: 1 when the topic's state
     * changed, 0 when it already was so. PostgreSQL's resume wakes idle dispatchers. */
    void (*pause)(rb_store *s, const char *topic, int paused, rb_count_cb cb, void *ud);
    /* Optional with pause: the paused topics, columns topic (text) and paused_at (float,
     * epoch s), by topic, at most RB_TOPIC_STATS_MAX rows. */
    void (*paused)(rb_store *s, rb_rows_cb cb, void *ud);
    /* Optional: sets (lim non-NULL) or clears (NULL) the limits of a topic, durably, for every
     * process on the store (rb_limit). count: 1. */
    void (*limit)(rb_store *s, const char *topic, const rb_limit *lim, rb_count_cb cb, void *ud);
    /* Optional with limit: the limited topics, columns topic (text), rate (int or NULL), per
     * (float s or NULL), concurrency (int or NULL), by topic, at most RB_TOPIC_STATS_MAX rows. */
    void (*limits)(rb_store *s, rb_rows_cb cb, void *ud);
    /* Optional: cancels every live delivery of `status` ("pending" or "processing"; NULL:
     * both) and of `topic` (NULL: any), as cancel does one: last_error = reason, a running
     * one's lease taken (its dispatchers hear of it as after cancel; MongoDB: at their next
     * renewal). count: how many were cancelled. */
    void (*cancel_all)(rb_store *s, const char *status, const char *topic, const char *reason,
                       rb_count_cb cb, void *ud);
    /* Optional: durable schedules (rb_schedule). schedule makes or replaces schedule
     * `sch->name`; a replacement with the same cron, every and timezone keeps its next_at, so
     * processes that define their schedules at each start do not move their ticks.
     * count: 1 made, 0 replaced. */
    void (*schedule)(rb_store *s, const rb_schedule *sch, rb_count_cb cb, void *ud);
    /* count: 1 removed, 0 when there was none of that name */
    void (*unschedule)(rb_store *s, const char *name, rb_count_cb cb, void *ud);
    /* columns name, topic, payload (text), cron (text or NULL), every (float or NULL),
     * timezone (text or NULL), next_at (float, epoch s), fired_at (float or NULL: when a tick
     * was last fired), by name, at most RB_SCHEDULES_MAX rows */
    void (*schedules)(rb_store *s, rb_rows_cb cb, void *ud);
    /* Fires the tick of schedule `name` due at `due`: while its next_at is `due` and its
     * topic and payload are tick's, sets next_at to `next` and enqueues tick (whose key names
     * the tick), in one transaction where the store has them (MongoDB: a look at the schedule,
     * the enqueue, then the move, so a failure between them can fire a tick twice, never lose
     * one: stores/mongo/schedules.c). count: 1 fired, 0 when
     * another process fired it first or the schedule changed meanwhile. */
    void (*schedule_fire)(rb_store *s, const char *name, double due, double next,
                          const rb_enqueue_item *tick, rb_count_cb cb, void *ud);
} rb_store_vtable;

/* The common head of every store; each store file embeds it first in its own struct. */
struct rb_store {
    const rb_store_vtable *vt;
    struct ev_loop *loop;
    char *table;                /* deliveries table / collection name */
    /* In-process wake-up: enqueue calls it so a local dispatcher starts at once. */
    void (*local_wakeup)(void *ud);
    void *local_wakeup_ud;
    /* The run of delivery `id` under lease `token` was cancelled:
     * the dispatcher layer aborts it. Called through rb_store_cancelled. */
    void (*local_cancelled)(void *ud, const char *id, const char *token);
    /* A schedule was made, changed or removed (here, or on PostgreSQL in any process): the
     * dispatcher layer reads the schedules again. Called through rb_store_schedules_changed. */
    void (*local_schedules)(void *ud);
    /* The dispatcher layer's state for the dispatchers on this store (dispatch/
     * dispatcher_impl.h, disp_shared: the registry of their unsettled runs, the list a local
     * enqueue wakes, what their claims learnt of the store): opaque here, made by the first
     * dispatcher started, kept while the store lives (what a dispatcher learnt holds for the
     * next), and freed by dispatch_free from the store's close (rb_store_release_dispatch).
     * On the loop's thread only; per store, so runtimes on other threads share nothing. */
    void *dispatch;
    void (*dispatch_free)(void *dispatch);
};

/* Frees the dispatcher layer's state of s (rb_store.dispatch): every store's close calls it. */
void rb_store_release_dispatch(rb_store *s);

typedef struct rb_store_options {
    const char *table;      /* NULL = "relaybus_deliveries" */
    int migrate;            /* create or upgrade the schema on open */
} rb_store_options;

typedef enum { RB_STORE_SQLITE = 1, RB_STORE_PG, RB_STORE_MONGO } rb_store_kind;

/* What a store URL names, without opening or connecting: sqlite:PATH (*path points at PATH
 * inside url; sqlite://... is refused as ambiguous), postgresql:// or postgres://, mongodb://
 * or mongodb+srv://. Returns the kind, or 0 with a one-line message in err that shows the
 * URL only redacted. */
rb_store_kind rb_store_parse_url(const char *url, const char **path, char *err, size_t errlen);

/* Opens the store a URL names (see rb_store_parse_url). Blocking. On failure returns NULL
 * with a one-line message in err, in which no secret of the URL appears (rb_redact_secrets). */
rb_store *rb_store_open(struct ev_loop *loop, const char *url, const rb_store_options *opts,
                        char *err, size_t errlen);

/* Per-store constructors, called by rb_store_open after it parsed the scheme. */
rb_store *rb_sqlite_open(struct ev_loop *loop, const char *path, const rb_store_options *opts,
                         char *err, size_t errlen);
rb_store *rb_pg_open(struct ev_loop *loop, const char *conninfo, const rb_store_options *opts,
                     char *err, size_t errlen);
rb_store *rb_mongo_open(struct ev_loop *loop, const char *uri, const rb_store_options *opts,
                        char *err, size_t errlen);

/* Tunes glibc's malloc for SQLite's pattern of taking and freeing 64 KiB per written row (a
 * higher trim threshold: without it each such free gave memory back to the kernel, and every
 * brk() down flushed the TLB on all CPUs: drains ran 3-7x slower on a busy machine). It
 * changes the whole process, so the library never does it by itself: the relaybus command
 * does; a host that runs SQLite drains may. Once per process; not when MALLOC_* or
 * GLIBC_TUNABLES already tune malloc. */
void rb_tune_malloc(void);

/* Helpers shared by the stores (store.c). */
int rb_valid_identifier(const char *name);          /* [A-Za-z_][A-Za-z0-9_]{0,62} */
/* An id as the SQL stores write them: [1-9][0-9]{0,17}. " 2", "+2" and "02" are no ids. */
int rb_decimal_id(const char *id);
void rb_random_token(char out[33]);                 /* 128 random bits, hex */
void rb_store_notify_local(rb_store *s);            /* call after a commit that added deliveries */
/* call when a cancel took delivery `id` (as the store writes ids) out of processing, under
 * lease `token` */
void rb_store_cancelled(rb_store *s, const char *id, const char *token);
/* call when a schedule of s was made, changed or removed */
void rb_store_schedules_changed(rb_store *s);

#endif
