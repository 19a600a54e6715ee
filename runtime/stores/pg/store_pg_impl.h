/* store_pg_impl.h -- what the PostgreSQL store's files share (not installed): its structures
 * and the calls its files make into one another. The store is store_pg.c (operations and
 * their results, open and close), store_pg_pool.c (connections, the pool, the LISTEN
 * connection), store_pg_tx.c (application transactions) and store_pg_schema.c (SQL,
 * migrations). */
#ifndef RB_STORE_PG_IMPL_H
#define RB_STORE_PG_IMPL_H
#include <libpq-fe.h>
#include "stores/store.h"
#include "util/fifo.h"
#include "util/timer.h"
#include "stores/pg/store_pg_schema.h"

#pragma GCC visibility push(hidden)

#define PG_MAX_CONNS 20         /* connections per store, the listener aside */
#define PG_MAX_TX 16            /* transactions at once; more wait in a queue */
#define PG_OP_CONNS 4           /* connections for ordinary operations (never taken by tx) */
#define PG_CONNECT_TIMEOUT 10.0
#define PG_BACKOFF_MIN 0.05
#define PG_BACKOFF_MAX 2.0
#define PG_MAX_TABLE 56         /* 63 (NAMEDATALEN - 1) less the longest suffix, "_leases" */
#define ERRLEN 512


/* ---- types ------------------------------------------------------------------------------ */
typedef struct pg_store pg_store;
typedef struct pg_conn pg_conn;
typedef struct pg_op pg_op;


/* Called once per statement: res on success, err (one line) on failure. */
typedef void (*pg_done_fn)(pg_op *op, PGresult *res, const char *err);

struct pg_op {
    pg_op *next;
    pg_store *s;
    int stmt;                   /* prepared statement, or -1: send `sql` */
    const char *sql;            /* static text or sql_owned */
    char *sql_owned;
    int nparams;
    char **params;              /* owned; NULL entries are SQL NULL */
    int sent;                   /* reached libpq: no longer safe to retry elsewhere */
    int deadlocks;              /* times PostgreSQL broke a deadlock by aborting it */
    pg_done_fn done;
    rb_store_cb cb;
    void *ud;
    /* settle, a claim that carries settles, and commit */
    rb_done_cb settle_cb;       /* the carried settles' callback and its argument */
    void *settle_ud;
    rb_settle_op *sops;
    size_t nsops, round_end, *map, nmap;
    rb_tx *tx;
    int in_tx;                  /* a statement of the transaction (user's or tx_enqueue) */
    int phase;
    char *saved_err;
    size_t expect;              /* enqueue: ids expected */
    char bad_after[48];         /* enqueue: a dependency that is no id (the op is not sent) */
    char **ids;                 /* enqueue: room for them, made before the statement is sent */
    unsigned char *kept;        /* enqueue: the kept flags, in the block of ids (after them) */
    /* claim: when it was made, and the listener's epoch then if it was listening (else 0):
     * the answer's next-due row counts only if every NOTIFY since could have been heard */
    double made_at;
    unsigned heard_epoch;
};

struct pg_conn {
    pg_conn *next;
    pg_store *s;
    PGconn *pq;
    ev_io io;
    rb_timer timeout;           /* connect timeout */
    int io_events, io_on, io_ref, timer_on;
    int connecting, listen, broken, dead, listen_pending;
    int listen_failed;          /* the LISTEN's answer was an error (it may come in pieces) */
    char fatal[200];            /* a FATAL received while idle: the server is hanging up */
    pg_op *cur;                 /* the statement in flight */
    int preparing;              /* cur waits for its PREPARE */
    PGresult *res;
    char *err;
    int deadlock;               /* err is a deadlock's (SQLSTATE 40P01) */
    unsigned prepared;          /* bit per statement */
    rb_tx *tx;                  /* the transaction holding this connection */
    RB_FIFO(pg_op) q;           /* the transaction's statements waiting */
};

struct rb_tx {
    rb_tx *next;
    pg_store *s;                /* NULL once the store closed */
    pg_conn *conn;              /* NULL when not bound or lost */
    int enqueued;
    int user_sql;               /* a user's statement ran: the session is reset at the end */
    int ended;                  /* a statement ended it on the server: nothing more is sent */
    char err[ERRLEN];           /* why the connection was lost */
    char doomed[ERRLEN];        /* the first statement of it that failed: the commit fails */
};

struct pg_store {
    rb_store base;
    const char *kw[9], *vals[9];    /* connection parameters */
    char *conninfo;
    char *stmt_sql[ST_COUNT];
    char *sql_list, *sql_stats, *sql_kick, *sql_purge;
    char *sql_list_page, *sql_bury_one, *sql_cancel_one, *sql_progress, *sql_delete_one, *sql_topic_stats, *sql_pending_topics;
    char *sql_pause, *sql_resume, *sql_paused, *sql_limit_set, *sql_limit_clear, *sql_limits;
    char *sql_schedule_set, *sql_unschedule, *sql_schedules, *sql_schedule_fire;
    char *sql_cancel_all, *sql_table_large, *sql_topic_stats_large;
    pg_conn *conns;             /* pool: connecting and ready */
    pg_conn *graveyard;         /* freed when no callback is on the stack */
    RB_FIFO(pg_op) ops;         /* ordinary operations waiting for a connection */
    RB_FIFO(pg_op) begins;      /* transactions waiting for a connection of their own */
    rb_tx *txs;
    rb_timer retry;             /* the pool's next connect attempt */
    int retry_on;
    double backoff, retry_at;
    pg_conn *listen;
    /* Odd while the listener's LISTEN is in force (it answered and the connection lives):
     * each start and end of that moves it on, so a claim made in one such period knows
     * whether it still lasts when the answer comes. */
    unsigned listen_epoch;
    rb_timer listen_timer;
    int listen_timer_on;
    double listen_backoff;
    void (*wake_fn)(void *ud);
    void *wake_ud;
    int depth, closed;
};



extern const char pg_closed_msg[];

/* store_pg.c, for store_pg_tx.c and store_pg_pool.c */
/* The connections, the pool and the listener (store_pg_pool.c). */
void pg_pool_init(pg_store *s);
int pg_pool_adopt(pg_store *s, PGconn *pq);    /* open()'s connection, as the pool's first */
void pg_pump(pg_store *s);
void pg_conn_break(pg_conn *c);
void pg_conn_start_op(pg_conn *c, pg_op *op);
void pg_conn_bury(pg_conn *c);
void pg_listen_stop(pg_store *s);
void pg_set_wakeup(rb_store *bs, void (*fn)(void *ud), void *ud);
void pg_tx_unbind(rb_tx *tx);

/* The operations (store_pg.c). */
void pg_fail_list(pg_op *list, const char *err);
void pg_store_enter(pg_store *s);
pg_op *pg_enqueue_op(pg_store *s, const rb_enqueue_item *items, size_t n, int hold, rb_ids_cb cb,
                     void *ud);
int pg_op_alloc_params(pg_op *op, int n);
void pg_op_clear_params(pg_op *op);
void pg_op_free(pg_op *op);
pg_op *pg_op_new(pg_store *s, pg_done_fn done, void *ud);
int pg_op_param(pg_op *op, int i, const char *v);
void pg_settle_apply(pg_op *op, const PGresult *res);
int pg_settle_round(pg_op *op);
void pg_store_leave(pg_store *s);
void pg_count_done(pg_op *op, PGresult *res, const char *err);
/* A statement of the transaction ended, on c (before its callback): remembers a failure. */
void pg_tx_statement_done(rb_tx *tx, pg_conn *c, const char *err);

/* store_pg_tx.c, for store_pg.c (the vtable) */
void pg_begin(rb_store *bs, rb_tx_cb cb, void *ud);
void pg_commit(rb_tx *tx, rb_settle_op *complete, rb_done_cb cb, void *ud);
void pg_rollback(rb_tx *tx, rb_done_cb cb, void *ud);
void pg_tx_enqueue(rb_tx *tx, const rb_enqueue_item *items, size_t n, rb_ids_cb cb, void *ud);
void pg_tx_exec(rb_tx *tx, const char *sql, const rb_value *params, size_t nparams, rb_count_cb cb, void *ud);
void pg_tx_query(rb_tx *tx, const char *sql, const rb_value *params, size_t nparams, rb_rows_cb cb, void *ud);
void pg_rows_done(pg_op *op, PGresult *res, const char *err);

#pragma GCC visibility pop
#endif
