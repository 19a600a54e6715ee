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
 * `applied = 0`, an ordinary outcome. An error means the store could not be asked at all. */
#ifndef RB_STORE_H
#define RB_STORE_H

#include <stddef.h>
#include <stdint.h>
#include <ev.h>
#include "delivery.h"

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
typedef struct rb_enqueue_item {
    const char *topic;
    const char *payload;    /* JSON text, already validated by the caller */
    const char *key;        /* dedupe key, or NULL */
    double run_at;          /* epoch s; 0 = now (+ delay) */
    double delay;           /* s, added to the store's now when run_at == 0 */
    int max_attempts;       /* >= 1 */
} rb_enqueue_item;

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

typedef struct rb_list_req {
    const char *status;     /* NULL = any */
    const char *topic;      /* NULL = any */
    size_t limit;           /* 0 = default 100 */
} rb_list_req;

typedef struct rb_stats {
    int64_t pending, processing, completed, buried, due;
    double oldest_due_age;  /* s; 0 when nothing is due */
} rb_stats;

/* --- callbacks ------------------------------------------------------------------------- */
typedef void (*rb_done_cb)(void *ud, const char *err);
/* ids: n strings, valid during the callback */
typedef void (*rb_ids_cb)(void *ud, const char *err, char **ids, size_t n);
/* recs: ownership of the array and of each record passes to the callee
 * (free with rb_delivery_list_free or rb_delivery_free + free(recs)) */
typedef void (*rb_records_cb)(void *ud, const char *err, rb_delivery **recs, size_t n);
typedef void (*rb_count_cb)(void *ud, const char *err, int64_t count);
typedef void (*rb_stats_cb)(void *ud, const char *err, const rb_stats *st);
/* acquired: 1 when the caller now holds the lease (or it was extended/released), 0 otherwise */
typedef void (*rb_lease_cb)(void *ud, const char *err, int acquired, double expires_at);
typedef void (*rb_tx_cb)(void *ud, const char *err, rb_tx *tx);
/* rs: ownership passes to the callee (rb_rowset_free) */
typedef void (*rb_rows_cb)(void *ud, const char *err, rb_rowset *rs);
/* doc: JSON text of the found document or NULL (mongo find_one) */
typedef void (*rb_doc_cb)(void *ud, const char *err, const char *doc_json, int64_t count);

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
     * returned. Oldest run_at first. */
    void (*claim)(rb_store *s, const rb_claim_req *req, rb_records_cb cb, void *ud);
    /* Applies n fenced writes, ideally in one round trip; fills each op's results. */
    void (*settle)(rb_store *s, rb_settle_op *ops, size_t n, rb_done_cb cb, void *ud);

    void (*get)(rb_store *s, const char *id, rb_records_cb cb, void *ud);
    void (*list)(rb_store *s, const rb_list_req *req, rb_records_cb cb, void *ud);
    void (*stats)(rb_store *s, rb_stats_cb cb, void *ud);
    /* RB_KICK_ONE: the buried delivery `id`; RB_KICK_BURIED: all buried. -> pending, attempts 0 */
    void (*kick)(rb_store *s, rb_kick_mode mode, const char *id, rb_count_cb cb, void *ud);
    /* Deletes deliveries of `status` (completed or buried) settled more than older_than s ago,
     * at most `limit` of them (0 = no limit). */
    void (*purge)(rb_store *s, const char *status, double older_than, size_t limit,
                  rb_count_cb cb, void *ud);

    /* Named leases. `token` identifies the holder. acquire succeeds when the name is free or
     * expired (store clock); extend and release only while token matches and not expired
     * (release: token matches, regardless of expiry is NOT allowed -- it must not revoke a
     * successor, and a successor has a different token, so token match is the condition). */
    void (*lease_acquire)(rb_store *s, const char *name, const char *token, double duration,
                          rb_lease_cb cb, void *ud);
    void (*lease_extend)(rb_store *s, const char *name, const char *token, double duration,
                         rb_lease_cb cb, void *ud);
    void (*lease_release)(rb_store *s, const char *name, const char *token,
                          rb_lease_cb cb, void *ud);

    /* Transactions: the application's writes and deliveries commit together. */
    void (*begin)(rb_store *s, rb_tx_cb cb, void *ud);
    void (*tx_enqueue)(rb_tx *tx, const rb_enqueue_item *items, size_t n, rb_ids_cb cb, void *ud);
    /* SQL stores; NULL in stores without SQL. Placeholders are the store's native ones. */
    void (*tx_exec)(rb_tx *tx, const char *sql, const rb_value *params, size_t nparams,
                    rb_count_cb cb, void *ud);
    void (*tx_query)(rb_tx *tx, const char *sql, const rb_value *params, size_t nparams,
                     rb_rows_cb cb, void *ud);
    /* Document stores; NULL in SQL stores. JSON texts (MongoDB extended JSON). */
    void (*tx_doc)(rb_tx *tx, rb_doc_op op, const char *collection, const char *filter_json,
                   const char *doc_json, rb_doc_cb cb, void *ud);
    /* Commits. With `complete` non-NULL, first applies that fenced write inside the
     * transaction; when it is not applied (lease lost) the transaction rolls back and
     * complete->applied is 0. The rb_tx is freed by commit and rollback. */
    void (*commit)(rb_tx *tx, rb_settle_op *complete, rb_done_cb cb, void *ud);
    void (*rollback)(rb_tx *tx, rb_done_cb cb, void *ud);

    /* Optional (may be NULL): calls fn(ud) on the loop when another connection or process
     * enqueued something due (PostgreSQL LISTEN/NOTIFY). Pass fn NULL to stop. */
    void (*set_wakeup)(rb_store *s, void (*fn)(void *ud), void *ud);

    /* Closes connections and frees the store. Operations still in flight get their callback
     * with an error ("store closed") before close returns. */
    void (*close)(rb_store *s);
} rb_store_vtable;

/* The common head of every store; each store file embeds it first in its own struct. */
struct rb_store {
    const rb_store_vtable *vt;
    struct ev_loop *loop;
    char *table;                /* deliveries table / collection name */
    /* In-process wake-up: enqueue calls it so a local dispatcher starts at once. */
    void (*local_wakeup)(void *ud);
    void *local_wakeup_ud;
};

typedef struct rb_store_options {
    const char *table;      /* NULL = "relaybus_deliveries" */
    int migrate;            /* create or upgrade the schema on open */
} rb_store_options;

/* Opens the store a URL names (sqlite:, postgres[ql]://, mongodb://). Blocking. On failure
 * returns NULL with a one-line message in err. */
rb_store *rb_store_open(struct ev_loop *loop, const char *url, const rb_store_options *opts,
                        char *err, size_t errlen);

/* Per-store constructors, called by rb_store_open after it parsed the scheme. */
rb_store *rb_sqlite_open(struct ev_loop *loop, const char *path, const rb_store_options *opts,
                         char *err, size_t errlen);
rb_store *rb_pg_open(struct ev_loop *loop, const char *conninfo, const rb_store_options *opts,
                     char *err, size_t errlen);
rb_store *rb_mongo_open(struct ev_loop *loop, const char *uri, const rb_store_options *opts,
                        char *err, size_t errlen);

/* Helpers shared by the stores (store.c). */
int rb_valid_identifier(const char *name);          /* [A-Za-z_][A-Za-z0-9_]{0,62} */
void rb_random_token(char out[33]);                 /* 128 random bits, hex */
double rb_wall_time(void);                          /* epoch s */
void rb_store_notify_local(rb_store *s);            /* call after a commit that added deliveries */

#endif
