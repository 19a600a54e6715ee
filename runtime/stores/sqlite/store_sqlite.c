/* store_sqlite.c -- the SQLite store, the embedded default: deliveries, named leases and
 * application transactions on one WAL connection (its file, schema and SQL text are in
 * store_sqlite_schema.c). Every operation is a small queued job run on the loop thread;
 * SQLITE_BUSY is retried from a timer, never waited out. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/stat.h>
#include <sqlite3.h>
#include "stores/store.h"
#include "stores/sqlite/store_sqlite_schema.h"
#include "util/alloc.h"
#include "util/check.h"
#include "util/fifo.h"
#include "util/text.h"
#include "util/timer.h"

#define BUSY_TIMEOUT_MS 5       /* the longest sqlite3 itself may block the loop on a lock */
#define RETRY_FIRST     0.002   /* s: first retry after SQLITE_BUSY, doubling ... */
#define RETRY_MAX       0.01    /* ... up to this (latency once the lock frees) ... */
/* After a transaction ends, the next one here waits this long, so other processes' retries
 * can take the single write lock in between: SQLite itself has no fairness, and a process
 * running transactional handlers back to back would otherwise starve every other worker. */
#define TX_GAP          0.003
#define RETRY_GIVE_UP   30.0    /* ... until the job fails */
#define LIST_DEFAULT    100
#define PUMP_BATCH      256     /* jobs run in one go before the loop gets a turn */


/* --- the store and its jobs ------------------------------------------------------------- */
typedef struct rb_sqlite rb_sqlite;
typedef struct job job;
typedef enum { JOB_DONE, JOB_BUSY } job_rc;
/* T_ONE's kinds (job.which): an operator's act on one delivery */
enum { ONE_DELETE, ONE_BURY, ONE_CANCEL };

typedef struct job_type {
    job_rc (*run)(rb_sqlite *s, job *j);        /* the SQL work; never calls the callback */
    void (*report)(job *j, const char *err);    /* calls the callback, takes owned results */
} job_type;

typedef struct strnode { struct strnode *next; char text[]; } strnode;
typedef RB_FIFO(job) queue;

struct job {
    job *next;
    const job_type *type;
    rb_sqlite *s;
    rb_tx *tx;              /* the user transaction it belongs to, or NULL */
    void *ud;
    rb_store_cb cb;
    strnode *strs;          /* copies of the caller's strings, freed with the job */
    int oom;                /* a copy failed: the job reports "out of memory" */
    double busy_since;      /* monotonic s of the first SQLITE_BUSY, 0 before */
    /* arguments */
    rb_enqueue_item *items; size_t nitems;
    const char **topics; size_t ntopics;
    const char **active; size_t nactive;    /* claim: the topics not paused */
    rb_settle_op *ops; size_t nops;     /* the caller's array: results are written into it */
    rb_value *params; size_t nparams;
    const char *id, *status, *topic, *name, *token, *sql;
    const char *after; int newest;      /* a list page */
    const char *key, *prefix, *errtext; /* a list's search */
    size_t limit;
    double num;             /* lease duration, purge age */
    rb_limit lim;           /* a topic's limits to set */
    rb_schedule sch;        /* a schedule to set; a fire's due (num) and next (sch.next_at) */
    int which;              /* statement, kick mode */
    int stage;              /* commit: 1 once the completion is written */
    /* results */
    char (*idbuf)[24]; char **idp;
    unsigned char *kept;    /* enqueue: the items that found a live delivery and left it */
    rb_delivery **recs; size_t nrecs;
    rb_stats st;
    rb_rowset *rows;
    rb_tx *new_tx;
    int64_t count;
    int acquired; double expires_at;
    int notify;             /* deliveries became due: wake the local dispatcher */
    int failed;
    char err[256];
};

struct rb_tx {
    rb_sqlite *s;
    int enqueued;
    /* begin_leased: the run's lease, extended when the transaction began and kept by its
     * rollback (a copy: the run may be gone before the transaction ends) */
    rb_settle_op lease;
    char lease_id[24];
    char *lease_token;
    /* the first statement of it that failed: the commit fails with this */
    int doomed;
    char why[256];
    /* a run's transaction that an error ended early and that could not take the lock and
     * the lease again at once: it no longer holds the store (sq_tx_holds) */
    int lost;
};

struct rb_sqlite {
    rb_store base;
    sqlite3 *db;
    sqlite3_stmt *stmts[ST_COUNT];
    /* claim's selects, built for claim_ntopics topics: [1] for one topic (a limited topic's
     * own), [0] for the others */
    sqlite3_stmt *claim_sel[2];
    size_t claim_ntopics[2];
    queue q;                    /* everything outside a transaction, begins included */
    queue txq;                  /* operations of the open transaction */
    /* Transactions waiting to begin. Apart from q, so that between two transactions every
     * other operation waiting (the renewals of runs that wait for their turn) goes first. */
    queue beginq;
    rb_tx *tx;                  /* the open transaction: it holds the connection */
    rb_timer retry;
    double retry_delay;
    double tx_ended_at;     /* monotonic s when the last transaction ended */
    int pumping, retry_armed, closed;
    int grouping;           /* running a group commit: each job is a savepoint in it */
    /* Jobs of q that may still run before the next begin: those waiting when the last
     * transaction ended (the renewals of runs that wait go first, and a stream of new jobs
     * cannot keep a transaction from beginning). */
    long q_pass;
    int user_sql;           /* a user's statement is being prepared or run (the authorizer) */
    const char *refused;    /* why the authorizer refused it */
};

/* --- small helpers ---------------------------------------------------------------------- */
/* A duration from the caller, kept in range: NaN or negative is 0, too long is the longest
 * (callers validate; this only keeps REAL columns sane). */
static double sane_secs(double x) { return x > 0 ? (x < RB_MAX_SECONDS ? x : RB_MAX_SECONDS) : 0; }

/* The boot id bound as a parameter: NULL when unknown (the wall clock times leases then). */
static void bind_boot(sqlite3_stmt *st, int i)
{
    const char *b = rb_boot_id();
    if (*b) sqlite3_bind_text(st, i, b, -1, SQLITE_STATIC);
    else sqlite3_bind_null(st, i);
}

static int is_busy(int rc) { return (rc & 0xff) == SQLITE_BUSY || (rc & 0xff) == SQLITE_LOCKED; }

static int parse_id(const char *text, sqlite3_int64 *out)
{
    if (!rb_decimal_id(text)) return 0;
    *out = strtoll(text, NULL, 10);     /* (18 digits at most: within int64) */
    return 1;
}

static void set_err(job *j, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(j->err, sizeof j->err, fmt, ap);
    va_end(ap);
    j->failed = 1;
}

/* Remembers the first failure of a run, while sqlite3_errmsg still describes it. */
static void note_error(rb_sqlite *s, job *j, int rc)
{
    if (j->err[0]) return;
    const char *msg = sqlite3_errmsg(s->db);
    snprintf(j->err, sizeof j->err, "sqlite: %s", msg && *msg ? msg : sqlite3_errstr(rc));
}

/* Copies a string into the job (NULL stays NULL); len (size_t)-1 means NUL-terminated. */
static const char *keep_n(job *j, const char *str, size_t len)
{
    if (!str) return NULL;
    if (len == (size_t)-1) len = strlen(str);
    strnode *n = rb_malloc(sizeof *n + len + 1);
    if (!n) { j->oom = 1; return NULL; }
    memcpy(n->text, str, len);
    n->text[len] = 0;
    n->next = j->strs;
    j->strs = n;
    return n->text;
}
static const char *keep(job *j, const char *str) { return keep_n(j, str, (size_t)-1); }


static int prepare_sql(rb_sqlite *s, job *j, const char *tmpl, unsigned flags,
                       sqlite3_stmt **out)
{
    char *sql = rb_sqlite_expand(tmpl, s->base.table);
    if (!sql) return SQLITE_NOMEM;
    int rc = sqlite3_prepare_v3(s->db, sql, -1, flags, out, NULL);
    free(sql);
    if (rc != SQLITE_OK) note_error(s, j, rc);
    return rc;
}

/* The cached statement `which`, prepared on first use. */
static int prep(rb_sqlite *s, job *j, int which, sqlite3_stmt **out)
{
    if (!s->stmts[which]) {
        int rc = prepare_sql(s, j, rb_sqlite_stmt_sql[which], SQLITE_PREPARE_PERSISTENT, &s->stmts[which]);
        if (rc != SQLITE_OK) return rc;
    }
    *out = s->stmts[which];
    return SQLITE_OK;
}

/* Binding errors are ignored on purpose: an absent parameter number (SQLITE_RANGE) is how the
 * shared numbering skips what a statement does not use. */
static void bind_text(sqlite3_stmt *st, int i, const char *v)
{
    if (v) sqlite3_bind_text(st, i, v, -1, SQLITE_STATIC);
    else sqlite3_bind_null(st, i);
}

/* Steps once; ROW and DONE are outcomes, anything else an error to remember. */
static int step(rb_sqlite *s, job *j, sqlite3_stmt *st)
{
    int rc = sqlite3_step(st);
    if (rc != SQLITE_ROW && rc != SQLITE_DONE) note_error(s, j, rc);
    return rc;
}

/* Runs a statement that returns no rows to completion; SQLITE_OK on success. */
static int run_to_done(rb_sqlite *s, job *j, sqlite3_stmt *st)
{
    int rc;
    while ((rc = step(s, j, st)) == SQLITE_ROW) {}
    sqlite3_reset(st);
    sqlite3_clear_bindings(st);
    return rc == SQLITE_DONE ? SQLITE_OK : rc;
}

static int exec_sql(rb_sqlite *s, job *j, const char *sql)
{
    int rc = sqlite3_exec(s->db, sql, NULL, NULL, NULL);
    if (rc != SQLITE_OK) note_error(s, j, rc);
    return rc;
}

/* A job's write scope: its own BEGIN IMMEDIATE transaction, or a savepoint inside the user
 * transaction it belongs to (so a failed tx_enqueue leaves nothing half-written). */
/* A job inside a transaction (the user's, or a group commit's) is a savepoint in it. */
static int in_savepoint(const rb_sqlite *s, const job *j) { return j->tx || s->grouping; }

static int scope_begin(rb_sqlite *s, job *j)
{
    return exec_sql(s, j, in_savepoint(s, j) ? "SAVEPOINT rb_job" : "BEGIN IMMEDIATE");
}

static int scope_end(rb_sqlite *s, job *j, int rc)
{
    if (rc == SQLITE_OK) {
        rc = exec_sql(s, j, in_savepoint(s, j) ? "RELEASE rb_job" : "COMMIT");
        if (rc == SQLITE_OK) return rc;
    }
    if (in_savepoint(s, j)) sqlite3_exec(s->db, "ROLLBACK TO rb_job; RELEASE rb_job", NULL, NULL, NULL);
    else if (!sqlite3_get_autocommit(s->db)) sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
    return rc;
}

/* 1 while a busy job may still be retried (starting its clock on the first busy). */
static int may_retry(job *j)
{
    double now = rb_monotonic();
    if (j->busy_since == 0) j->busy_since = now;
    return now - j->busy_since < RETRY_GIVE_UP;
}

/* Turns a run's final sqlite code into the job's outcome. Work inside a user transaction is not
 * retryable: only the whole transaction could be. */
static job_rc conclude(job *j, int rc, int retryable)
{
    if (rc == SQLITE_OK || rc == SQLITE_DONE || rc == SQLITE_ROW) return JOB_DONE;
    if (is_busy(rc) && retryable) {
        if (may_retry(j)) return JOB_BUSY;
        set_err(j, "sqlite: database is locked (gave up after %.0f s)", RETRY_GIVE_UP);
        return JOB_DONE;
    }
    if (!j->err[0]) snprintf(j->err, sizeof j->err, "sqlite: %s", sqlite3_errstr(rc));
    j->failed = 1;
    return JOB_DONE;
}

/* --- records ---------------------------------------------------------------------------- */
static const char *col_text(sqlite3_stmt *st, int i)
{
    if (sqlite3_column_type(st, i) == SQLITE_NULL) return NULL;
    return (const char *)sqlite3_column_text(st, i);
}

/* A count written by hand past int is shown as the largest (as the claim compares it). */
static int clamp_int(sqlite3_int64 v) { return v > INT_MAX ? INT_MAX : v < INT_MIN ? INT_MIN : (int)v; }

/* The columns of COLS and RECORD_COLS, in their order. */
enum {
    COL_ID, COL_TOPIC, COL_PAYLOAD, COL_KEY, COL_STATUS, COL_ATTEMPTS, COL_MAX_ATTEMPTS, COL_FENCE,
    COL_RUN_AT, COL_CREATED_AT, COL_LEASE_TOKEN, COL_LEASE_EXPIRES_AT, COL_LAST_ERROR, COL_GROUP,
    COL_SETTLED_AT, COL_PROGRESS, COL_ERRORS, COL_WAITING, RECORD_NCOLS
};

/* A row of COLS, or of RECORD_COLS (the history too). */
static rb_delivery *read_delivery(sqlite3_stmt *st)
{
    char id[24];
    snprintf(id, sizeof id, "%lld", (long long)sqlite3_column_int64(st, COL_ID));
    const char *topic = col_text(st, COL_TOPIC), *payload = col_text(st, COL_PAYLOAD);
    int history = sqlite3_column_count(st) >= RECORD_NCOLS;
    rb_delivery_texts t = {.id = id, .topic = topic ? topic : "",
                           .payload = payload ? payload : "null", .key = col_text(st, COL_KEY),
                           .group = col_text(st, COL_GROUP),
                           .last_error = col_text(st, COL_LAST_ERROR),
                           .lease_token = col_text(st, COL_LEASE_TOKEN),
                           .progress = history ? col_text(st, COL_PROGRESS) : NULL,
                           .errors = history ? col_text(st, COL_ERRORS) : NULL};
    rb_delivery *d = rb_delivery_make(&t);
    if (!d) return NULL;
    if (history) {
        d->settled_at = sqlite3_column_double(st, COL_SETTLED_AT);
        d->waiting = clamp_int(sqlite3_column_int64(st, COL_WAITING));
    }
    const char *status = col_text(st, COL_STATUS);
    int code = rb_status_parse(status);
    d->status = code < 0 ? RB_BURIED : (rb_status)code;
    d->attempts = clamp_int(sqlite3_column_int64(st, COL_ATTEMPTS));
    d->max_attempts = clamp_int(sqlite3_column_int64(st, COL_MAX_ATTEMPTS));
    d->fence = sqlite3_column_int64(st, COL_FENCE);
    d->run_at = sqlite3_column_double(st, COL_RUN_AT);
    d->created_at = sqlite3_column_double(st, COL_CREATED_AT);
    d->lease_expires_at = sqlite3_column_double(st, COL_LEASE_EXPIRES_AT);
    return d;
}

static void free_records(job *j)
{
    rb_delivery_list_free(j->recs, j->nrecs);
    j->recs = NULL;
    j->nrecs = 0;
}

static int push_record(job *j, rb_delivery *d)
{
    rb_delivery **grown = d ? rb_realloc(j->recs, (j->nrecs + 1) * sizeof *grown) : NULL;
    if (!grown) { rb_delivery_free(d); return SQLITE_NOMEM; }
    j->recs = grown;
    j->recs[j->nrecs++] = d;
    return SQLITE_OK;
}

/* Steps st to the end, appending every row as a record; resets st. */
static int collect_records(rb_sqlite *s, job *j, sqlite3_stmt *st)
{
    int rc;
    while ((rc = step(s, j, st)) == SQLITE_ROW)
        if ((rc = push_record(j, read_delivery(st))) != SQLITE_OK) break;
    sqlite3_reset(st);
    sqlite3_clear_bindings(st);
    if (rc == SQLITE_NOMEM) note_error(s, j, rc);
    return rc == SQLITE_DONE ? SQLITE_OK : rc;
}

/* --- enqueue ---------------------------------------------------------------------------- */
/* The id of a pending or processing delivery with the item's topic and key, or 0; *pending
 * whether it is pending. */
static int find_by_key(rb_sqlite *s, job *j, const rb_enqueue_item *it, sqlite3_int64 *found,
                       int *pending)
{
    sqlite3_stmt *st;
    int rc = prep(s, j, ST_ENQ_FIND, &st);
    if (rc != SQLITE_OK) return rc;
    bind_text(st, 1, it->topic);
    bind_text(st, 2, it->key);
    *found = 0;
    *pending = 0;
    rc = step(s, j, st);
    if (rc == SQLITE_ROW) {
        *found = sqlite3_column_int64(st, 0);
        *pending = sqlite3_column_int(st, 1);
    }
    sqlite3_reset(st);
    sqlite3_clear_bindings(st);
    return rc == SQLITE_ROW || rc == SQLITE_DONE ? SQLITE_OK : rc;
}

/* A pending delivery found by its key gets the item's payload, run_at and max_attempts. */
static int replace_one(rb_sqlite *s, job *j, const rb_enqueue_item *it, sqlite3_int64 id,
                       double run_at)
{
    sqlite3_stmt *st;
    int rc = prep(s, j, ST_ENQ_REPLACE, &st);
    if (rc != SQLITE_OK) return rc;
    sqlite3_bind_int64(st, 1, id);
    bind_text(st, 2, it->payload);
    sqlite3_bind_double(st, 3, run_at);
    sqlite3_bind_int(st, 4, it->max_attempts > 0 ? it->max_attempts : 1);
    if ((rc = run_to_done(s, j, st)) == SQLITE_OK) j->notify = 1;
    return rc;
}

/* A new delivery's dependencies (it->after): held behind the live ones, or cancelled when
 * one was buried or cancelled; an id that is no delivery fails the enqueue. */
static int enqueue_after(rb_sqlite *s, job *j, const rb_enqueue_item *it, sqlite3_int64 id,
                         double now)
{
    sqlite3_int64 live[RB_AFTER_MAX], depth = 0;
    size_t nlive = 0;
    char why[128] = "";
    int rc = SQLITE_OK;
    if (it->nafter > RB_AFTER_MAX) {
        set_err(j, "sqlite: after: more than %d dependencies", RB_AFTER_MAX);
        return SQLITE_ERROR;
    }
    for (size_t i = 0; rc == SQLITE_OK && i < it->nafter; i++) {
        sqlite3_int64 dep;
        if (!parse_id(it->after[i], &dep)) {
            char shown[48];     /* the caller's bytes, as one line of text */
            set_err(j, "sqlite: after: '%s' is no id of this store",
                    rb_one_line(shown, sizeof shown, it->after[i]));
            return SQLITE_ERROR;
        }
        sqlite3_stmt *st;
        if ((rc = prep(s, j, ST_DEP_STATUS, &st)) != SQLITE_OK) return rc;
        sqlite3_bind_int64(st, 1, dep);
        rc = step(s, j, st);
        char status[16] = "";
        sqlite3_int64 dep_depth = 0;
        if (rc == SQLITE_ROW) {
            snprintf(status, sizeof status, "%s", col_text(st, 0) ? col_text(st, 0) : "");
            dep_depth = sqlite3_column_int64(st, 1);
        }
        sqlite3_reset(st);
        if (rc != SQLITE_ROW && rc != SQLITE_DONE) return rc;
        rc = SQLITE_OK;
        if (!status[0]) {
            set_err(j, "sqlite: after: no delivery %lld", (long long)dep);
            return SQLITE_ERROR;
        }
        if (dep >= id) {        /* itself, or one after it: a cycle could form */
            set_err(j, "sqlite: after: delivery %lld was not enqueued before this one",
                    (long long)dep);
            return SQLITE_ERROR;
        }
        if (!strcmp(status, "buried") || !strcmp(status, "cancelled")) {
            if (!why[0]) snprintf(why, sizeof why, "dependency %lld was %s", (long long)dep, status);
        } else if (strcmp(status, "completed") != 0) {
            int seen = 0;
            for (size_t k = 0; k < nlive; k++) seen |= live[k] == dep;
            if (!seen) live[nlive++] = dep;
            if (dep_depth + 1 > depth) depth = dep_depth + 1;
        }
    }
    if (depth > RB_AFTER_DEPTH_MAX) {
        set_err(j, "sqlite: after: a chain of more than %d dependencies", RB_AFTER_DEPTH_MAX);
        return SQLITE_ERROR;
    }
    sqlite3_stmt *st;
    if (why[0]) {
        if ((rc = prep(s, j, ST_DEP_CANCEL, &st)) != SQLITE_OK) return rc;
        sqlite3_bind_int64(st, 1, id);
        sqlite3_bind_double(st, 2, now);
        bind_text(st, 3, why);
        return run_to_done(s, j, st);
    }
    if (!nlive) return SQLITE_OK;
    for (size_t k = 0; rc == SQLITE_OK && k < nlive; k++) {
        if ((rc = prep(s, j, ST_DEP_ADD, &st)) != SQLITE_OK) return rc;
        sqlite3_bind_int64(st, 1, id);
        sqlite3_bind_int64(st, 2, live[k]);
        if ((rc = run_to_done(s, j, st)) != SQLITE_OK) return rc;
        if ((rc = prep(s, j, ST_DEP_MARK, &st)) != SQLITE_OK) return rc;
        sqlite3_bind_int64(st, 1, live[k]);
        rc = run_to_done(s, j, st);
    }
    if (rc == SQLITE_OK && (rc = prep(s, j, ST_DEP_HOLD, &st)) == SQLITE_OK) {
        sqlite3_bind_int64(st, 1, id);
        sqlite3_bind_int64(st, 2, (sqlite3_int64)nlive);
        sqlite3_bind_int64(st, 3, depth);
        rc = run_to_done(s, j, st);
    }
    return rc;
}

/* Adds one item (or finds the live delivery of its key, which a replace changes when it is
 * pending); its id into id, and *kept whether a live one was left as it was. */
static int enqueue_one(rb_sqlite *s, job *j, const rb_enqueue_item *it, double now, char *id,
                       unsigned char *kept)
{
    sqlite3_int64 found = 0;
    int pending = 0;
    int rc = it->key ? find_by_key(s, j, it, &found, &pending) : SQLITE_OK;
    if (rc != SQLITE_OK) return rc;
    double run_at = isfinite(it->run_at) && it->run_at > 0 ? it->run_at
                                                           : now + sane_secs(it->delay);
    *kept = found && !(it->replace && pending);
    if (found && it->replace && pending && (rc = replace_one(s, j, it, found, run_at)) != SQLITE_OK)
        return rc;
    if (!found) {
        sqlite3_stmt *st;
        if ((rc = prep(s, j, ST_ENQ_INSERT, &st)) != SQLITE_OK) return rc;
        bind_text(st, 1, it->topic);
        bind_text(st, 2, it->payload);
        bind_text(st, 3, it->key);
        sqlite3_bind_int(st, 4, it->max_attempts > 0 ? it->max_attempts : 1);
        sqlite3_bind_double(st, 5, run_at);
        sqlite3_bind_double(st, 6, now);
        bind_text(st, 7, it->group);
        if ((rc = run_to_done(s, j, st)) != SQLITE_OK) return rc;
        found = sqlite3_last_insert_rowid(s->db);
        j->notify = 1;
        if (it->nafter && (rc = enqueue_after(s, j, it, found, now)) != SQLITE_OK) return rc;
    }
    snprintf(id, 24, "%lld", (long long)found);
    return SQLITE_OK;
}

/* Answers a tx job whose transaction is over (or was rolled back under it) with an error. */
static int tx_gone(rb_sqlite *s, job *j)
{
    if (j->tx != s->tx) { set_err(j, "sqlite: the transaction is already finished"); return 1; }
    if (sqlite3_get_autocommit(s->db)) {
        set_err(j, "sqlite: the transaction was rolled back by an earlier error");
        return 1;
    }
    return 0;
}

/* A statement of the user's transaction failed: the transaction can only roll back now, and
 * its commit fails with this first error, whether or not the caller looked at it. */
static void retake_lease(rb_sqlite *s, job *j);

static void doom_tx(rb_sqlite *s, job *j)
{
    rb_tx *tx = s->tx;
    if (!j->failed || !tx || j->tx != tx) return;
    if (!tx->doomed) {
        tx->doomed = 1;
        snprintf(tx->why, sizeof tx->why, "%s", j->err);
    }
    retake_lease(s, j);
}

static job_rc run_enqueue(rb_sqlite *s, job *j)
{
    if (j->tx && tx_gone(s, j)) return JOB_DONE;
    j->notify = 0;
    int rc = scope_begin(s, j);
    double now = rb_wall_time();
    for (size_t i = 0; rc == SQLITE_OK && i < j->nitems; i++)
        rc = enqueue_one(s, j, &j->items[i], now, j->idbuf[i], &j->kept[i]);
    rc = scope_end(s, j, rc);
    if (rc == SQLITE_OK && j->tx && j->notify) {
        j->tx->enqueued = 1;    /* the wake-up waits for the user's commit */
        j->notify = 0;
    }
    job_rc jr = conclude(j, rc, !j->tx);
    if (j->tx) doom_tx(s, j);
    return jr;
}

/* --- claim ------------------------------------------------------------------------------ */
/* A candidate, and the limited topic (index into the claim's limited list) it counts for, -1
 * for none. */
typedef struct cand { sqlite3_int64 id; int bury; int limited; } cand;

/* A limited topic among a claim's: how many of it the claim may still start, and whether its
 * starts are recorded (a rate). */
typedef struct limited { const char *topic; size_t allow; int rate; } limited;

/* A grouped candidate may run when it is its group's head (no delivery of the group with a
 * smaller id is pending or processing) and no other of the group holds a live lease (one an
 * operator kicked back ahead of a running one waits for it). So a claim takes at most one of
 * a group, and claims run one at a time on the file. The busy groups (a running one under a
 * live lease; a candidate's own lease is over, so it is not among them) are read once per
 * claim from "{t}_group_running" (LEASE_OVER reads g's columns): when every group is busy a
 * claim steps over the whole grouped backlog, at one look-up in that set per row. */
#define GROUP_HEAD_FREE \
    "(group_name NOT IN (SELECT g.group_name FROM \"{t}\" AS g WHERE g.group_name IS NOT NULL" \
    "  AND g.status = 'processing' AND NOT " LEASE_OVER("?3", "?4", "?1") ")" \
    " AND NOT EXISTS (SELECT 1 FROM \"{t}\" AS g WHERE g.group_name = \"{t}\".group_name" \
    "  AND g.status IN ('pending','processing') AND g.id < \"{t}\".id))"

/* Claim's candidate query for n topics, rebuilt only when n changes (one cached for a single
 * topic, one for more). */
static int claim_select(rb_sqlite *s, job *j, size_t n, sqlite3_stmt **out)
{
    int slot = n == 1;
    if (s->claim_sel[slot] && s->claim_ntopics[slot] == n) { *out = s->claim_sel[slot]; return SQLITE_OK; }
    sqlite3_finalize(s->claim_sel[slot]);
    s->claim_sel[slot] = NULL;
    size_t cap = 2048 + n * 8;
    char *sql = rb_malloc(cap);
    if (!sql) return SQLITE_NOMEM;
    size_t len = (size_t)snprintf(sql, cap,
        "SELECT id, CAST(attempts AS INTEGER) >= CAST(max_attempts AS INTEGER) FROM \"{t}\""
        " WHERE status IN ('pending','processing') AND run_at <= ?1"
        " AND " NO_LIVE_LEASE("?3", "?4", "?1")
        " AND (group_name IS NULL OR " GROUP_HEAD_FREE ")"
        /* a topic written by hand as a BLOB is claimed as the text it is shown as */
        " AND CAST(topic AS TEXT) IN (");
    for (size_t i = 0; i < n; i++)
        len += (size_t)snprintf(sql + len, cap - len, "%s?%zu", i ? "," : "", i + 5);
    snprintf(sql + len, cap - len, ") ORDER BY run_at, id LIMIT ?2");
    int rc = prepare_sql(s, j, sql, SQLITE_PREPARE_PERSISTENT, &s->claim_sel[slot]);
    free(sql);
    if (rc != SQLITE_OK) return rc;
    s->claim_ntopics[slot] = n;
    *out = s->claim_sel[slot];
    return SQLITE_OK;
}

/* One count of a limited topic's statement (ST_RUNNING or ST_STARTS) into *n. */
static int topic_count(rb_sqlite *s, job *j, int which, const char *topic, double now,
                       double boot_now, double since, int64_t *n)
{
    sqlite3_stmt *st;
    int rc = prep(s, j, which, &st);
    if (rc != SQLITE_OK) return rc;
    bind_text(st, 1, topic);
    if (which == ST_RUNNING) {
        bind_boot(st, 2);
        sqlite3_bind_double(st, 3, boot_now);
        sqlite3_bind_double(st, 4, now);
    } else {
        sqlite3_bind_double(st, 2, since);
    }
    rc = step(s, j, st);
    *n = rc == SQLITE_ROW ? sqlite3_column_int64(st, 0) : 0;
    sqlite3_reset(st);
    sqlite3_clear_bindings(st);
    return rc == SQLITE_ROW ? SQLITE_OK : rc;
}

/* How many of a limited topic the claim may start now: under its concurrency less those
 * running under live leases, under its rate less its starts in the window (whose older
 * starts go). */
static int topic_allowance(rb_sqlite *s, job *j, const char *topic, int64_t rate, double per,
                           int64_t running_max, double now, double boot_now, size_t *allow)
{
    int64_t left = INT64_MAX, n = 0;
    int rc = SQLITE_OK;
    if (running_max > 0 &&
        (rc = topic_count(s, j, ST_RUNNING, topic, now, boot_now, 0, &n)) == SQLITE_OK)
        left = running_max - n;
    if (rc == SQLITE_OK && rate > 0) {
        sqlite3_stmt *st;
        if ((rc = prep(s, j, ST_STARTS_TRIM, &st)) == SQLITE_OK) {
            bind_text(st, 1, topic);
            sqlite3_bind_double(st, 2, now - per);
            rc = run_to_done(s, j, st);
        }
        if (rc == SQLITE_OK &&
            (rc = topic_count(s, j, ST_STARTS, topic, now, boot_now, now - per, &n)) == SQLITE_OK &&
            rate - n < left)
            left = rate - n;
    }
    *allow = left > 0 ? (size_t)left : 0;
    return rc;
}

/* The claim's topics, read once inside the claim's write transaction (a pause or a limit
 * committed before it is seen): the paused ones leave j->active, and the limited ones go
 * from it into *lims, with what each may start, so the claim asks for each apart. */
static int claim_topics(rb_sqlite *s, job *j, double now, double boot_now, limited **lims,
                        size_t *nlims)
{
    *lims = NULL;
    *nlims = 0;
    j->nactive = 0;
    for (size_t i = 0; i < j->ntopics; i++) j->active[j->nactive++] = j->topics[i];
    typedef struct { const char *topic; int64_t rate, running; double per; } row;
    row *rows = rb_calloc(j->ntopics + 1, sizeof *rows);
    limited *l = rb_calloc(j->ntopics + 1, sizeof *l);
    sqlite3_stmt *st = NULL;
    int rc = rows && l ? prep(s, j, ST_CLAIM_TOPICS, &st) : SQLITE_NOMEM;
    size_t n = 0;
    if (rc == SQLITE_OK) {
        sqlite3_bind_int64(st, 1, RB_TOPIC_STATS_MAX);
        while ((rc = step(s, j, st)) == SQLITE_ROW) {
            const char *t = col_text(st, 0);
            for (size_t i = 0; t && i < j->nactive; i++) {
                if (strcmp(j->active[i], t) != 0) continue;
                if (!sqlite3_column_int(st, 1))     /* not paused: limited */
                    rows[n++] = (row){j->active[i], sqlite3_column_int64(st, 2),
                                      sqlite3_column_int64(st, 4), sqlite3_column_double(st, 3)};
                j->active[i] = j->active[--j->nactive];
                break;
            }
        }
        sqlite3_reset(st);
        if (rc == SQLITE_DONE) rc = SQLITE_OK;
    }
    RB_ASSERT(j->nactive + n <= j->ntopics);
    for (size_t k = 0; rc == SQLITE_OK && k < n; k++) {
        l[k] = (limited){rows[k].topic, 0, rows[k].rate > 0};
        rc = topic_allowance(s, j, rows[k].topic, rows[k].rate, rows[k].per, rows[k].running,
                             now, boot_now, &l[k].allow);
    }
    free(rows);
    if (rc != SQLITE_OK) { free(l); return rc; }
    *lims = l;
    *nlims = n;
    return SQLITE_OK;
}

/* Appends the due candidates of `topics` (at most `limit`) to *c (all of them read before any
 * update touches the table), counting for limited topic `lim` (-1: none). */
static int claim_candidates(rb_sqlite *s, job *j, const char **topics, size_t ntopics,
                            size_t limit, int lim, double now, double boot_now, cand **c,
                            size_t *n)
{
    if (!ntopics || !limit) return SQLITE_OK;
    sqlite3_stmt *st;
    int rc = claim_select(s, j, ntopics, &st);
    if (rc != SQLITE_OK) return rc;
    sqlite3_bind_double(st, 1, now);
    sqlite3_bind_int64(st, 2, limit > INT32_MAX ? INT32_MAX : (sqlite3_int64)limit);
    bind_boot(st, 3);
    sqlite3_bind_double(st, 4, boot_now);
    for (size_t i = 0; i < ntopics; i++) bind_text(st, (int)i + 5, topics[i]);
    while ((rc = step(s, j, st)) == SQLITE_ROW) {
        cand *grown = rb_realloc(*c, (*n + 1) * sizeof **c);
        if (!grown) { rc = SQLITE_NOMEM; break; }
        *c = grown;
        (*c)[*n] = (cand){sqlite3_column_int64(st, 0), sqlite3_column_int(st, 1), lim};
        (*n)++;
    }
    sqlite3_reset(st);
    sqlite3_clear_bindings(st);
    return rc == SQLITE_DONE ? SQLITE_OK : rc;
}

/* A start of a topic with a rate, in its window's record. */
static int record_start(rb_sqlite *s, job *j, const char *topic, double now)
{
    sqlite3_stmt *st;
    int rc = prep(s, j, ST_START_ADD, &st);
    if (rc != SQLITE_OK) return rc;
    bind_text(st, 1, topic);
    sqlite3_bind_double(st, 2, now);
    return run_to_done(s, j, st);
}

static int claim_bury(rb_sqlite *s, job *j, sqlite3_int64 id, double now)
{
    sqlite3_stmt *st;
    int rc = prep(s, j, ST_CLAIM_BURY, &st);
    if (rc != SQLITE_OK) return rc;
    sqlite3_bind_double(st, 1, now);
    sqlite3_bind_int64(st, 2, id);
    return run_to_done(s, j, st);
}

static int claim_take(rb_sqlite *s, job *j, sqlite3_int64 id, const char *token, double expires,
                      double boot_until)
{
    sqlite3_stmt *st;
    int rc = prep(s, j, ST_CLAIM_TAKE, &st);
    if (rc != SQLITE_OK) return rc;
    sqlite3_bind_text(st, 1, token, -1, SQLITE_STATIC);
    sqlite3_bind_double(st, 2, expires);
    sqlite3_bind_int64(st, 3, id);
    bind_boot(st, 4);
    sqlite3_bind_double(st, 5, boot_until);
    /* The claimed row is read back by a second statement: UPDATE ... RETURNING would gather
     * its one row in a temporary b-tree, which costs more than the lookup. */
    if ((rc = run_to_done(s, j, st)) != SQLITE_OK || (rc = prep(s, j, ST_GET, &st)) != SQLITE_OK)
        return rc;
    sqlite3_bind_int64(st, 1, id);
    return collect_records(s, j, st);
}

static job_rc run_claim(rb_sqlite *s, job *j)
{
    free_records(j);    /* left over from an attempt that hit SQLITE_BUSY */
    if (!j->ntopics || !j->limit) return JOB_DONE;
    char token[33];
    rb_random_token(token);
    cand *c = NULL;
    size_t n = 0, nlims = 0;
    limited *lims = NULL;
    int rc = scope_begin(s, j);
    /* After the lock wait, so the lease is not shortened; the dispatcher times its local
     * deadline from `mono` (read first: it never runs ahead of the store's lease). */
    double mono = rb_monotonic(), now = rb_wall_time(), boot_now = rb_boot_time();
    if (rc == SQLITE_OK) rc = claim_topics(s, j, now, boot_now, &lims, &nlims);
    if (rc == SQLITE_OK)
        rc = claim_candidates(s, j, j->active, j->nactive, j->limit, -1, now, boot_now, &c, &n);
    for (size_t k = 0; rc == SQLITE_OK && k < nlims && n < j->limit; k++) {
        size_t want = j->limit - n < lims[k].allow ? j->limit - n : lims[k].allow;
        rc = claim_candidates(s, j, &lims[k].topic, 1, want, (int)k, now, boot_now, &c, &n);
    }
    for (size_t i = 0; rc == SQLITE_OK && i < n; i++) {
        rc = c[i].bury ? claim_bury(s, j, c[i].id, now)
                       : claim_take(s, j, c[i].id, token, now + j->num, boot_now + j->num);
        if (rc == SQLITE_OK && !c[i].bury && c[i].limited >= 0 && lims[c[i].limited].rate)
            rc = record_start(s, j, lims[c[i].limited].topic, now);
    }
    free(c);
    free(lims);
    rc = scope_end(s, j, rc);
    if (rc != SQLITE_OK) free_records(j);
    for (size_t i = 0; rc == SQLITE_OK && i < j->nrecs; i++) j->recs[i]->claimed_at = mono;
    return conclude(j, rc, 1);
}

/* --- settle ----------------------------------------------------------------------------- */
static int settle_stmt(rb_settle_kind kind)
{
    switch (kind) {
    case RB_OP_COMPLETE: return ST_COMPLETE;
    case RB_OP_RESCHEDULE: return ST_RESCHEDULE;
    case RB_OP_BURY: return ST_BURY;
    case RB_OP_RELEASE: return ST_RELEASE;
    case RB_OP_EXTEND: return ST_EXTEND;
    }
    return -1;
}

/* One fenced write: the row changes only while processing under op->token. */
static int settle_one(rb_sqlite *s, job *j, rb_settle_op *op, double now)
{
    sqlite3_int64 id;
    int which = settle_stmt(op->kind);
    op->applied = 0;
    if (which < 0 || !op->token || !parse_id(op->id, &id)) return SQLITE_OK;
    sqlite3_stmt *st;
    int rc = prep(s, j, which, &st);
    if (rc != SQLITE_OK) return rc;
    double delay = sane_secs(op->delay);
    sqlite3_bind_double(st, 1, now);
    sqlite3_bind_int64(st, 2, id);
    bind_text(st, 3, op->token);
    sqlite3_bind_double(st, 4, delay);
    bind_text(st, 5, op->error);
    if (which == ST_EXTEND) {
        bind_boot(st, 6);
        sqlite3_bind_double(st, 7, rb_boot_time());
    }
    if ((rc = run_to_done(s, j, st)) != SQLITE_OK) return rc;
    op->applied = sqlite3_changes(s->db) > 0;
    if (op->applied && op->kind == RB_OP_EXTEND) op->lease_expires_at = now + delay;
    return SQLITE_OK;
}

static job_rc run_settle(rb_sqlite *s, job *j)
{
    int rc = scope_begin(s, j);
    double now = rb_wall_time();
    for (size_t i = 0; rc == SQLITE_OK && i < j->nops; i++)
        rc = settle_one(s, j, &j->ops[i], now);
    rc = scope_end(s, j, rc);
    if (rc != SQLITE_OK)
        for (size_t i = 0; i < j->nops; i++) j->ops[i].applied = 0;
    return conclude(j, rc, 1);
}

/* A run's progress: in the run's transaction when it has one (it holds the file's one write
 * lock, so nothing else could be written before its end), else on its own. */
static job_rc run_progress(rb_sqlite *s, job *j)
{
    sqlite3_int64 id;
    j->count = 0;
    if (j->tx && tx_gone(s, j)) return JOB_DONE;
    if (!parse_id(j->id, &id)) return JOB_DONE;
    sqlite3_stmt *st;
    int rc = prep(s, j, ST_PROGRESS, &st);
    if (rc == SQLITE_OK) {
        sqlite3_bind_int64(st, 2, id);
        bind_text(st, 3, j->token);
        bind_text(st, 4, j->sql);
        rc = run_to_done(s, j, st);
    }
    if (rc == SQLITE_OK) j->count = sqlite3_changes(s->db);
    return conclude(j, rc, 1);
}

/* --- reads: get, list, stats ------------------------------------------------------------ */
static job_rc run_get(rb_sqlite *s, job *j)
{
    free_records(j);
    sqlite3_int64 id;
    if (!parse_id(j->id, &id)) return JOB_DONE;     /* no such delivery */
    sqlite3_stmt *st;
    int rc = prep(s, j, ST_GET, &st);
    if (rc == SQLITE_OK) {
        sqlite3_bind_int64(st, 1, id);
        rc = collect_records(s, j, st);
    }
    return conclude(j, rc, 1);
}

/* List's query for the filters given; the status hints let the partial indexes serve it. */
static void list_sql(const job *j, char *sql, size_t cap)
{
    const char *hint = "";
    if (j->status && (!strcmp(j->status, "pending") || !strcmp(j->status, "processing")))
        hint = " AND status IN ('pending','processing')";
    else if (j->status && !strcmp(j->status, "buried"))
        hint = " AND status IN ('completed','buried') AND status = 'buried'";
    else if (j->status && !strcmp(j->status, "completed"))
        hint = " AND status IN ('completed','buried')";
    else if (j->status && !strcmp(j->status, "cancelled"))
        hint = " AND status = 'cancelled'";
    snprintf(sql, cap, "SELECT " RECORD_COLS " FROM \"{t}\" WHERE 1%s%s%s%s%s%s%s ORDER BY id%s"
             " LIMIT ?3", hint, j->status ? " AND status = ?1" : "",
             j->topic ? " AND topic = ?2" : "", j->newest && j->after ? " AND id < ?4" : "",
             j->key ? " AND key = ?5" : "",
             j->prefix ? " AND substr(topic, 1, length(?6)) = ?6" : "",
             j->errtext ? " AND instr(last_error, ?7) > 0" : "", j->newest ? " DESC" : "");
}

static job_rc run_list(rb_sqlite *s, job *j)
{
    free_records(j);
    sqlite3_int64 after = 0;
    if (j->newest && j->after && !parse_id(j->after, &after)) return JOB_DONE;  /* empty page */
    char sql[1024];
    list_sql(j, sql, sizeof sql);
    sqlite3_stmt *st = NULL;
    int rc = prepare_sql(s, j, sql, 0, &st);
    if (rc == SQLITE_OK) {
        bind_text(st, 1, j->status);
        bind_text(st, 2, j->topic);
        sqlite3_bind_int64(st, 3, j->limit > INT32_MAX ? INT32_MAX : (sqlite3_int64)j->limit);
        if (j->newest && j->after) sqlite3_bind_int64(st, 4, after);
        bind_text(st, 5, j->key);
        bind_text(st, 6, j->prefix);
        bind_text(st, 7, j->errtext);
        rc = collect_records(s, j, st);
    }
    sqlite3_finalize(st);
    if (rc != SQLITE_OK) free_records(j);
    return conclude(j, rc, 1);
}

static job_rc run_stats(rb_sqlite *s, job *j)
{
    sqlite3_stmt *st;
    int rc = prep(s, j, ST_STATS, &st);
    if (rc != SQLITE_OK) return conclude(j, rc, 1);
    double now = rb_wall_time();
    sqlite3_bind_double(st, 1, now);
    bind_boot(st, 2);
    sqlite3_bind_double(st, 3, rb_boot_time());
    rc = step(s, j, st);
    if (rc == SQLITE_ROW) {
        j->st.pending = sqlite3_column_int64(st, 0);
        j->st.processing = sqlite3_column_int64(st, 1);
        j->st.completed = sqlite3_column_int64(st, 2);
        j->st.buried = sqlite3_column_int64(st, 3);
        j->st.cancelled = sqlite3_column_int64(st, 4);
        j->st.due = sqlite3_column_int64(st, 5);
        double oldest = sqlite3_column_double(st, 6);
        j->st.oldest_due_age = j->st.due && now > oldest ? now - oldest : 0;
        j->st.stalled = sqlite3_column_int64(st, 7);
        if (j->st.completed < 0) {      /* a large table: its rows (the id span) less the others */
            int64_t rest = sqlite3_column_int64(st, 8) - j->st.pending - j->st.processing -
                           j->st.buried - j->st.cancelled;
            j->st.completed = rest > 0 ? rest : 0;
            j->st.completed_estimated = 1;
        }
    }
    sqlite3_reset(st);
    sqlite3_clear_bindings(st);
    return conclude(j, rc, 1);
}

/* --- kick, purge ------------------------------------------------------------------------ */
static job_rc run_kick(rb_sqlite *s, job *j)
{
    sqlite3_int64 id = 0;
    j->count = 0;
    if (j->which == RB_KICK_ONE && !parse_id(j->id, &id)) return JOB_DONE;
    sqlite3_stmt *st;
    int rc = prep(s, j, j->which == RB_KICK_ONE ? ST_KICK_ONE : ST_KICK_BURIED, &st);
    if (rc == SQLITE_OK) {
        sqlite3_bind_double(st, 1, rb_wall_time());
        if (j->which == RB_KICK_ONE) sqlite3_bind_int64(st, 2, id);
        else bind_text(st, 5, j->topic);
        bind_boot(st, 3);
        sqlite3_bind_double(st, 4, rb_boot_time());
        rc = run_to_done(s, j, st);
    }
    if (rc == SQLITE_OK) j->count = sqlite3_changes(s->db);
    j->notify = j->count > 0;
    return conclude(j, rc, 1);
}

static int add_row(rb_rowset *rs, sqlite3_stmt *st);
static rb_rowset *new_rowset(sqlite3_stmt *st);

/* The lease a cancel of delivery `id` takes away (its token into j->token; a pending one
 * has none), read before the cancel in the same transaction. */
static int cancelled_lease(rb_sqlite *s, job *j, sqlite3_int64 id)
{
    sqlite3_stmt *st;
    int rc = prep(s, j, ST_CANCEL_FIND, &st);
    if (rc != SQLITE_OK) return rc;
    sqlite3_bind_int64(st, 2, id);
    j->token = NULL;
    rc = step(s, j, st);
    if (rc == SQLITE_ROW && sqlite3_column_int(st, 0)) {
        const char *t = (const char *)sqlite3_column_text(st, 1);
        if (t && !(j->token = keep(j, t))) rc = SQLITE_NOMEM;
    }
    sqlite3_reset(st);
    sqlite3_clear_bindings(st);
    return rc == SQLITE_ROW || rc == SQLITE_DONE ? SQLITE_OK : rc;
}

/* An operator's act on one delivery by id (which: ONE_DELETE, ONE_BURY, ONE_CANCEL). */
static job_rc run_one(rb_sqlite *s, job *j)
{
    static const int stmt[] = {[ONE_DELETE] = ST_DELETE_ONE, [ONE_BURY] = ST_BURY_ONE,
                               [ONE_CANCEL] = ST_CANCEL_ONE};
    RB_ASSERT(j->which >= ONE_DELETE && j->which <= ONE_CANCEL);
    sqlite3_int64 id = 0;
    j->count = 0;
    if (!parse_id(j->id, &id)) return JOB_DONE;
    if (j->which == ONE_CANCEL) {
        /* the dispatchers know the id as the store writes it ("12", not "+12" or "012") */
        char canonical[24];
        snprintf(canonical, sizeof canonical, "%lld", (long long)id);
        if (!(j->id = keep(j, canonical))) return conclude(j, SQLITE_NOMEM, 0);
    }
    int rc = scope_begin(s, j);
    if (rc == SQLITE_OK && j->which == ONE_CANCEL) rc = cancelled_lease(s, j, id);
    sqlite3_stmt *st;
    if (rc == SQLITE_OK && (rc = prep(s, j, stmt[j->which], &st)) == SQLITE_OK) {
        sqlite3_bind_double(st, 1, rb_wall_time());
        sqlite3_bind_int64(st, 2, id);
        bind_text(st, 3, j->name);
        rc = run_to_done(s, j, st);
    }
    if (rc == SQLITE_OK) j->count = sqlite3_changes(s->db);
    rc = scope_end(s, j, rc);
    return conclude(j, rc, 1);
}

/* Cancels every live delivery of j->status (NULL: both) and j->topic (NULL: any); the leases
 * of the running ones go to j->rows, for report_cancel_all to tell this process's dispatchers. */
static job_rc run_cancel_all(rb_sqlite *s, job *j)
{
    j->count = 0;
    if (j->rows) { rb_rowset_free(j->rows); j->rows = NULL; }   /* a busy retry starts anew */
    sqlite3_stmt *st = NULL;
    int rc = scope_begin(s, j);
    if (rc == SQLITE_OK && (rc = prep(s, j, ST_CANCEL_ALL_RUNS, &st)) == SQLITE_OK) {
        bind_text(st, 1, j->topic);
        bind_text(st, 4, j->status);
        if (!(j->rows = new_rowset(st))) rc = SQLITE_NOMEM;
        while (rc == SQLITE_OK && (rc = step(s, j, st)) == SQLITE_ROW) rc = add_row(j->rows, st);
        if (rc == SQLITE_DONE) rc = SQLITE_OK;
        sqlite3_reset(st);
        sqlite3_clear_bindings(st);
    }
    if (rc == SQLITE_OK && (rc = prep(s, j, ST_CANCEL_ALL, &st)) == SQLITE_OK) {
        bind_text(st, 1, j->topic);
        sqlite3_bind_double(st, 2, rb_wall_time());
        bind_text(st, 3, j->name);
        bind_text(st, 4, j->status);
        rc = run_to_done(s, j, st);
    }
    if (rc == SQLITE_OK) j->count = sqlite3_changes(s->db);
    rc = scope_end(s, j, rc);
    if (rc != SQLITE_OK) {
        j->count = 0;
        if (rc == SQLITE_NOMEM) note_error(s, j, rc);
        rb_rowset_free(j->rows);
        j->rows = NULL;
    }
    return conclude(j, rc, 1);
}

/* Rows per topic: ?1 at most RB_TOPIC_STATS_MAX of them, ?2 (pending topics) j->limit. */
static job_rc run_topic_rows(rb_sqlite *s, job *j, int which)
{
    if (j->rows) { rb_rowset_free(j->rows); j->rows = NULL; }   /* a busy retry starts anew */
    sqlite3_stmt *st = NULL;
    int rc = prep(s, j, which, &st);
    if (rc == SQLITE_OK && !(j->rows = new_rowset(st))) rc = SQLITE_NOMEM;
    if (rc == SQLITE_OK) {
        sqlite3_bind_int64(st, 1, RB_TOPIC_STATS_MAX);
        if (which == ST_PENDING_TOPICS) sqlite3_bind_int64(st, 2, (sqlite3_int64)j->limit);
        if (which == ST_TOPIC_STATS || which == ST_TOPIC_STATS_LARGE)
            sqlite3_bind_double(st, 2, rb_wall_time());
        while ((rc = step(s, j, st)) == SQLITE_ROW)
            if ((rc = add_row(j->rows, st)) != SQLITE_OK) break;
        if (rc == SQLITE_DONE) rc = SQLITE_OK;
    }
    if (st) { sqlite3_reset(st); sqlite3_clear_bindings(st); }
    if (rc == SQLITE_NOMEM) note_error(s, j, rc);
    if (rc != SQLITE_OK && j->rows) { rb_rowset_free(j->rows); j->rows = NULL; }
    return conclude(j, rc, 1);
}

/* Per topic: counted whole in a small table, without the completed in a large one. */
static job_rc run_topic_stats(rb_sqlite *s, job *j)
{
    sqlite3_stmt *st;
    int rc = prep(s, j, ST_ID_SPAN, &st);
    if (rc != SQLITE_OK) return conclude(j, rc, 1);
    rc = step(s, j, st);
    int64_t span = rc == SQLITE_ROW ? sqlite3_column_int64(st, 0) : 0;
    sqlite3_reset(st);
    if (rc != SQLITE_ROW) return conclude(j, rc, 1);
    return run_topic_rows(s, j, span > ESTIMATE_ABOVE_ROWS ? ST_TOPIC_STATS_LARGE : ST_TOPIC_STATS);
}
static job_rc run_pending_topics(rb_sqlite *s, job *j) { return run_topic_rows(s, j, ST_PENDING_TOPICS); }
static job_rc run_paused(rb_sqlite *s, job *j) { return run_topic_rows(s, j, ST_PAUSED); }

/* Pause (which 1) or resume (0) j->topic. */
static job_rc run_pause(rb_sqlite *s, job *j)
{
    j->count = 0;
    sqlite3_stmt *st;
    int rc = prep(s, j, j->which ? ST_PAUSE : ST_RESUME, &st);
    if (rc == SQLITE_OK) {
        bind_text(st, 1, j->topic);
        if (j->which) sqlite3_bind_double(st, 2, rb_wall_time());
        rc = run_to_done(s, j, st);
    }
    if (rc == SQLITE_OK) j->count = sqlite3_changes(s->db);
    /* a resumed topic's deliveries may be due: a dispatcher here claims at once */
    if (rc == SQLITE_OK && !j->which && j->count) j->notify = 1;
    return conclude(j, rc, 1);
}

/* Sets (which 1) or clears (0) j->topic's limits. A limit cleared or raised may let this
 * process's dispatchers start more at once. */
static job_rc run_limit(rb_sqlite *s, job *j)
{
    j->count = 0;
    sqlite3_stmt *st;
    int rc = prep(s, j, j->which ? ST_LIMIT_SET : ST_LIMIT_CLEAR, &st);
    if (rc == SQLITE_OK) {
        bind_text(st, 1, j->topic);
        if (j->which && j->lim.rate > 0) {
            sqlite3_bind_int64(st, 2, j->lim.rate);
            sqlite3_bind_double(st, 3, j->lim.per);
        }
        if (j->which && j->lim.concurrency > 0) sqlite3_bind_int64(st, 4, j->lim.concurrency);
        rc = run_to_done(s, j, st);
    }
    if (rc == SQLITE_OK) {
        j->count = 1;
        j->notify = 1;
    }
    return conclude(j, rc, 1);
}

static job_rc run_limits(rb_sqlite *s, job *j) { return run_topic_rows(s, j, ST_LIMITS); }
static job_rc run_schedules(rb_sqlite *s, job *j) { return run_topic_rows(s, j, ST_SCHEDULES); }

/* Makes or replaces j->sch; count 1 when made. */
static job_rc run_schedule(rb_sqlite *s, job *j)
{
    j->count = 0;
    sqlite3_stmt *st;
    int rc = scope_begin(s, j);
    if (rc == SQLITE_OK && (rc = prep(s, j, ST_SCHEDULE_FIND, &st)) == SQLITE_OK) {
        bind_text(st, 1, j->sch.name);
        if ((rc = step(s, j, st)) == SQLITE_DONE) j->count = 1;
        if (rc == SQLITE_ROW || rc == SQLITE_DONE) rc = SQLITE_OK;
        sqlite3_reset(st);
    }
    if (rc == SQLITE_OK && (rc = prep(s, j, ST_SCHEDULE_SET, &st)) == SQLITE_OK) {
        bind_text(st, 1, j->sch.name);
        bind_text(st, 2, j->sch.topic);
        bind_text(st, 3, j->sch.payload);
        bind_text(st, 4, j->sch.cron);
        if (!j->sch.cron) sqlite3_bind_double(st, 5, j->sch.every);
        bind_text(st, 6, j->sch.timezone);
        sqlite3_bind_double(st, 7, j->sch.next_at);
        sqlite3_bind_double(st, 8, rb_wall_time());
        rc = run_to_done(s, j, st);
    }
    rc = scope_end(s, j, rc);
    return conclude(j, rc, 1);
}

static job_rc run_unschedule(rb_sqlite *s, job *j)
{
    j->count = 0;
    sqlite3_stmt *st;
    int rc = prep(s, j, ST_UNSCHEDULE, &st);
    if (rc == SQLITE_OK) {
        bind_text(st, 1, j->sch.name);
        rc = run_to_done(s, j, st);
    }
    if (rc == SQLITE_OK) j->count = sqlite3_changes(s->db);
    return conclude(j, rc, 1);
}

/* A tick: next_at moves on and the tick's delivery is added, in one write transaction, or
 * neither (another process fired it first: count 0). */
static job_rc run_schedule_fire(rb_sqlite *s, job *j)
{
    j->count = 0;
    j->notify = 0;
    sqlite3_stmt *st;
    double now = rb_wall_time();
    int rc = scope_begin(s, j);
    if (rc == SQLITE_OK && (rc = prep(s, j, ST_SCHEDULE_FIRE, &st)) == SQLITE_OK) {
        bind_text(st, 1, j->sch.name);
        sqlite3_bind_double(st, 2, j->num);
        sqlite3_bind_double(st, 3, j->sch.next_at);
        sqlite3_bind_double(st, 4, now);
        bind_text(st, 5, j->items[0].topic);
        bind_text(st, 6, j->items[0].payload);
        rc = run_to_done(s, j, st);
    }
    if (rc == SQLITE_OK && (j->count = sqlite3_changes(s->db)) == 1)
        rc = enqueue_one(s, j, &j->items[0], now, j->idbuf[0], &j->kept[0]);
    rc = scope_end(s, j, rc);
    if (rc != SQLITE_OK) j->count = 0;
    return conclude(j, rc, 1);
}

static job_rc run_purge(rb_sqlite *s, job *j)
{
    j->count = 0;
    if (!rb_settled_status(j->status)) {
        set_err(j, "sqlite: purge takes status completed, buried or cancelled, not '%s'",
                j->status ? j->status : "(none)");
        return JOB_DONE;
    }
    sqlite3_stmt *st;
    int rc = prep(s, j, strcmp(j->status, "cancelled") ? ST_PURGE : ST_PURGE_CANCELLED, &st);
    if (rc == SQLITE_OK) {
        bind_text(st, 1, j->status);
        sqlite3_bind_double(st, 2, rb_wall_time() - sane_secs(j->num));
        sqlite3_bind_int64(st, 3, j->limit ? (sqlite3_int64)(j->limit > INT32_MAX ? INT32_MAX
                                                                               : j->limit) : -1);
        bind_text(st, 4, j->topic);
        rc = run_to_done(s, j, st);
    }
    if (rc == SQLITE_OK) j->count = sqlite3_changes(s->db);
    return conclude(j, rc, 1);
}

/* --- named leases ----------------------------------------------------------------------- */
static job_rc run_lease(rb_sqlite *s, job *j)
{
    sqlite3_stmt *st;
    double now = rb_wall_time(), duration = sane_secs(j->num);
    j->acquired = 0;
    j->expires_at = 0;
    int rc = prep(s, j, j->which, &st);
    if (rc == SQLITE_OK) {
        bind_text(st, 1, j->name);
        bind_text(st, 2, j->token);
        if (j->which != ST_LEASE_RELEASE) {
            sqlite3_bind_double(st, 3, now);
            sqlite3_bind_double(st, 4, duration);
            bind_boot(st, 5);
            sqlite3_bind_double(st, 6, rb_boot_time());
        }
        rc = run_to_done(s, j, st);
    }
    if (rc == SQLITE_OK) j->acquired = sqlite3_changes(s->db) > 0;
    if (j->acquired && j->which != ST_LEASE_RELEASE) j->expires_at = now + duration;
    return conclude(j, rc, 1);
}

/* --- transactions ----------------------------------------------------------------------- */
static long queue_length(const queue *q);

static void end_tx(rb_sqlite *s)
{
    free(s->tx->lease_token);
    free(s->tx);
    s->tx = NULL;
    s->tx_ended_at = rb_monotonic();
    s->q_pass = queue_length(&s->q);
}

/* A run's transaction (begin_leased) first extends the run's lease, fenced: holding the write
 * lock, it cannot be taken over from here on, however long the run waited for the lock. Its
 * own writes go under the savepoint rb_run, so a rollback can keep the lease. */
static job_rc run_begin(rb_sqlite *s, job *j)
{
    rb_settle_op *lease = j->ops ? &(rb_settle_op){.kind = RB_OP_EXTEND, .id = j->id,
                                                   .token = j->token, .delay = j->num} : NULL;
    int rc = exec_sql(s, j, "BEGIN IMMEDIATE");
    if (rc != SQLITE_OK) return conclude(j, rc, 1);
    if (lease) {
        rc = settle_one(s, j, lease, rb_wall_time());
        if (rc == SQLITE_OK && lease->applied) rc = exec_sql(s, j, "SAVEPOINT rb_run");
        j->ops->applied = rc == SQLITE_OK && lease->applied;
        if (!j->ops->applied) {
            sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
            return conclude(j, rc, 0);  /* taken over meanwhile: nothing begins, no error */
        }
    }
    rb_tx *tx = rb_calloc(1, sizeof *tx);
    if (tx && lease && !(tx->lease_token = rb_strdup(lease->token))) { free(tx); tx = NULL; }
    if (!tx) {
        sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
        if (lease) j->ops->applied = 0;
        set_err(j, "sqlite: out of memory");
        return JOB_DONE;
    }
    tx->s = s;
    if (lease) {
        snprintf(tx->lease_id, sizeof tx->lease_id, "%s", lease->id);
        tx->lease = (rb_settle_op){.kind = RB_OP_EXTEND, .id = tx->lease_id,
                                   .token = tx->lease_token, .delay = lease->delay};
    }
    s->tx = j->new_tx = tx;     /* from now on only this transaction's jobs run */
    return JOB_DONE;
}

/* --- what a user's statement may not do -------------------------------------------------
 * The connection is relaybus's: a user's statement must not end or split its transaction
 * (relaybus commits or rolls back, with the completion), nor change the connection for what
 * runs after it (PRAGMA query_only, an attached database, a temporary table named like the
 * deliveries table). SQLite asks the authorizer while it prepares a statement, and again if
 * it prepares it anew while stepping; it is on only for the user's statements. Read-only
 * PRAGMAs that look a schema up stay allowed. */
static const char *const readable_pragmas[] = {
    "table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo",
    "foreign_key_list", "foreign_key_check", "collation_list", "function_list", "module_list",
    "pragma_list", "database_list", "integrity_check", "quick_check", "compile_options", NULL};

static const char temp_refused[] = "temporary tables, views, indexes and triggers are refused "
    "inside a transaction: they would outlive it on relaybus's connection";

/* An object made in (or a write to the catalog of) the temp schema, however it is named:
 * CREATE TABLE temp.x reports SQLITE_CREATE_TABLE in "temp", and CREATE TRIGGER temp.t ON a
 * main table reports its table's schema but writes sqlite_temp_master. */
static int touches_temp(int action, const char *a1, const char *db)
{
    if (a1 && (sqlite3_stricmp(a1, "sqlite_temp_master") == 0 ||
               sqlite3_stricmp(a1, "sqlite_temp_schema") == 0))
        return action == SQLITE_INSERT || action == SQLITE_UPDATE || action == SQLITE_DELETE;
    if (!db || sqlite3_stricmp(db, "temp") != 0) return 0;
    switch (action) {
    case SQLITE_CREATE_TABLE: case SQLITE_CREATE_INDEX: case SQLITE_CREATE_VIEW:
    case SQLITE_CREATE_TRIGGER: case SQLITE_CREATE_VTABLE:
    case SQLITE_DROP_TABLE: case SQLITE_DROP_INDEX: case SQLITE_DROP_VIEW:
    case SQLITE_DROP_TRIGGER: case SQLITE_DROP_VTABLE: case SQLITE_ALTER_TABLE:
        return 1;
    default:
        return 0;
    }
}

static int user_authorizer(void *ud, int action, const char *a1, const char *a2,
                           const char *db, const char *trigger)
{
    (void)a2; (void)trigger;
    rb_sqlite *s = ud;
    if (!s->user_sql) return SQLITE_OK;
    if (touches_temp(action, a1, db)) {
        s->refused = temp_refused;
        return SQLITE_DENY;
    }
    switch (action) {
    case SQLITE_TRANSACTION:
    case SQLITE_SAVEPOINT:
        s->refused = "BEGIN, COMMIT, ROLLBACK, SAVEPOINT and RELEASE are refused inside a "
                     "transaction: relaybus ends it (return, or raise to roll back)";
        return SQLITE_DENY;
    case SQLITE_PRAGMA:
        for (const char *const *p = readable_pragmas; *p; p++)
            if (a1 && sqlite3_stricmp(a1, *p) == 0) return SQLITE_OK;
        s->refused = "PRAGMA is refused inside a transaction: it would change relaybus's "
                     "connection (a read-only PRAGMA such as table_info is allowed)";
        return SQLITE_DENY;
    case SQLITE_ATTACH:
    case SQLITE_DETACH:
        s->refused = "ATTACH and DETACH are refused inside a transaction: they would change "
                     "relaybus's connection";
        return SQLITE_DENY;
    case SQLITE_CREATE_TEMP_TABLE: case SQLITE_CREATE_TEMP_INDEX:
    case SQLITE_CREATE_TEMP_TRIGGER: case SQLITE_CREATE_TEMP_VIEW:
        s->refused = temp_refused;
        return SQLITE_DENY;
    default:
        return SQLITE_OK;
    }
}

/* A user statement's outcome: the authorizer's refusal says why in its own words. */
static int user_rc(rb_sqlite *s, job *j, int rc)
{
    if ((rc & 0xff) == SQLITE_AUTH && s->refused) set_err(j, "sqlite: %s", s->refused);
    else if (rc != SQLITE_OK && rc != SQLITE_DONE && rc != SQLITE_ROW) note_error(s, j, rc);
    s->refused = NULL;
    return rc;
}

/* Prepares one user statement and binds its parameters. */
static int user_stmt(rb_sqlite *s, job *j, sqlite3_stmt **out)
{
    const char *tail = NULL;
    s->user_sql = 1;
    int rc = user_rc(s, j, sqlite3_prepare_v2(s->db, j->sql, -1, out, &tail));
    s->user_sql = 0;
    if (rc != SQLITE_OK) return rc;
    if (!*out) { set_err(j, "sqlite: empty statement"); return SQLITE_MISUSE; }
    while (tail && (*tail == ' ' || *tail == '\t' || *tail == '\n' || *tail == '\r' ||
                    *tail == ';')) tail++;
    if (tail && *tail) { set_err(j, "sqlite: exec and query take a single statement"); return SQLITE_MISUSE; }
    int want = sqlite3_bind_parameter_count(*out);
    if ((size_t)want != j->nparams) {
        set_err(j, "sqlite: the statement takes %d parameters, %zu given", want, j->nparams);
        return SQLITE_MISUSE;
    }
    for (size_t i = 0; i < j->nparams; i++) {
        const rb_value *v = &j->params[i];
        int k = (int)i + 1;
        switch (v->type) {
        case RB_VNULL: sqlite3_bind_null(*out, k); break;
        case RB_VINT: case RB_VBOOL: sqlite3_bind_int64(*out, k, v->i); break;
        case RB_VFLOAT: sqlite3_bind_double(*out, k, v->f); break;
        case RB_VTEXT: sqlite3_bind_text(*out, k, v->s, (int)v->len, SQLITE_STATIC); break;
        }
    }
    return SQLITE_OK;
}

/* Steps a user statement (the authorizer on: SQLite may prepare it anew here). */
static int user_step(rb_sqlite *s, job *j, sqlite3_stmt *st)
{
    s->user_sql = 1;
    int rc = user_rc(s, j, sqlite3_step(st));
    s->user_sql = 0;
    return rc;
}

/* A user statement's end: a failure dooms the transaction (doom_tx). */
static job_rc conclude_user(rb_sqlite *s, job *j, sqlite3_stmt *st, int rc)
{
    sqlite3_finalize(st);
    job_rc jr = conclude(j, rc, 0);
    doom_tx(s, j);
    return jr;
}

static job_rc run_exec(rb_sqlite *s, job *j)
{
    if (tx_gone(s, j)) return JOB_DONE;
    sqlite3_stmt *st = NULL;
    sqlite3_int64 before = sqlite3_total_changes64(s->db);
    int rc = user_stmt(s, j, &st);
    if (rc == SQLITE_OK) {
        while ((rc = user_step(s, j, st)) == SQLITE_ROW) {}
        if (rc == SQLITE_DONE) rc = SQLITE_OK;
    }
    /* changes() is stale after statements that change nothing, so trust it only if the
     * total moved. */
    if (rc == SQLITE_OK)
        j->count = sqlite3_total_changes64(s->db) != before ? sqlite3_changes64(s->db) : 0;
    return conclude_user(s, j, st, rc);
}

/* Appends the current row of st to the rowset (text and blobs copied). */
static int add_row(rb_rowset *rs, sqlite3_stmt *st)
{
    size_t base = rs->nrows * (size_t)rs->ncols;
    rb_value *grown = rb_realloc(rs->vals, (base + rs->ncols + 1) * sizeof *grown);
    if (!grown) return SQLITE_NOMEM;
    rs->vals = grown;
    for (int c = 0; c < rs->ncols; c++) {
        rb_value *v = &rs->vals[base + c];
        memset(v, 0, sizeof *v);
        int type = sqlite3_column_type(st, c);
        if (type == SQLITE_INTEGER) { v->type = RB_VINT; v->i = sqlite3_column_int64(st, c); }
        else if (type == SQLITE_FLOAT) { v->type = RB_VFLOAT; v->f = sqlite3_column_double(st, c); }
        else if (type == SQLITE_NULL) v->type = RB_VNULL;
        else {
            const void *src = type == SQLITE_BLOB ? sqlite3_column_blob(st, c)
                                                  : (const void *)sqlite3_column_text(st, c);
            size_t len = (size_t)sqlite3_column_bytes(st, c);
            char *copy = rb_malloc(len + 1);
            if (!copy) {    /* the row is not counted yet: free its copies here */
                for (int k = 0; k < c; k++)
                    if (rs->vals[base + k].type == RB_VTEXT) free((char *)rs->vals[base + k].s);
                return SQLITE_NOMEM;
            }
            if (len) memcpy(copy, src, len);
            copy[len] = 0;
            v->type = RB_VTEXT; v->s = copy; v->len = len;
        }
    }
    rs->nrows++;
    return SQLITE_OK;
}

static rb_rowset *new_rowset(sqlite3_stmt *st)
{
    rb_rowset *rs = rb_calloc(1, sizeof *rs);
    if (!rs) return NULL;
    int n = sqlite3_column_count(st);
    rs->names = rb_calloc((size_t)n + 1, sizeof *rs->names);
    if (!rs->names) { free(rs); return NULL; }
    for (int c = 0; c < n; c++) {
        const char *name = sqlite3_column_name(st, c);
        rs->names[c] = rb_strdup(name ? name : "?");
        rs->ncols = c + 1;
        if (!rs->names[c]) { rs->ncols = c; rb_rowset_free(rs); return NULL; }
    }
    return rs;
}

static job_rc run_query(rb_sqlite *s, job *j)
{
    if (tx_gone(s, j)) return JOB_DONE;
    sqlite3_stmt *st = NULL;
    int rc = user_stmt(s, j, &st);
    if (rc == SQLITE_OK && !(j->rows = new_rowset(st))) rc = SQLITE_NOMEM;
    if (rc == SQLITE_OK) {
        while ((rc = user_step(s, j, st)) == SQLITE_ROW)
            if ((rc = add_row(j->rows, st)) != SQLITE_OK) break;
        if (rc == SQLITE_DONE) rc = SQLITE_OK;
    }
    if (rc == SQLITE_NOMEM) note_error(s, j, rc);
    return conclude_user(s, j, st, rc);
}

/* Rolls back whatever is open and ends the transaction. */
static void abandon_tx(rb_sqlite *s)
{
    if (!sqlite3_get_autocommit(s->db)) sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
    end_tx(s);
}

/* An error SQLite answers by rolling the whole transaction back (INSERT OR ROLLBACK, a
 * trigger's RAISE(ROLLBACK), a full disk) ended a run's transaction under it, and with it the
 * write lock and the lease extended at its begin: the run's deadline, moved on while the lock
 * was held, is past the lease the table holds. Take the lock and the lease again at once, in
 * the same job (the transaction stays doomed: nothing of it commits); failing that, the
 * transaction no longer holds the store and the run is aborted at its next check. */
static void retake_lease(rb_sqlite *s, job *j)
{
    rb_tx *tx = s->tx;
    if (!tx->lease_token || tx->lost || !sqlite3_get_autocommit(s->db)) return;
    rb_settle_op keep = tx->lease;
    if (sqlite3_exec(s->db, "BEGIN IMMEDIATE", NULL, NULL, NULL) == SQLITE_OK) {
        if (settle_one(s, j, &keep, rb_wall_time()) == SQLITE_OK && keep.applied &&
            sqlite3_exec(s->db, "SAVEPOINT rb_run", NULL, NULL, NULL) == SQLITE_OK)
            return;
        sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
    }
    tx->lost = 1;
}

/* Ends the open transaction without its writes. A run's transaction keeps the run's lease: its
 * writes roll back to the savepoint taken after the lease was extended, the lease is extended
 * to now + its length, and that commits. Nobody could take the lease while the lock was held,
 * so the settle that follows (a retry, a burial) finds it even past the lease's first end. */
static void undo_tx(rb_sqlite *s, job *j)
{
    rb_tx *tx = s->tx;
    if (tx->lease_token && !sqlite3_get_autocommit(s->db) &&
        sqlite3_exec(s->db, "ROLLBACK TO rb_run; RELEASE rb_run", NULL, NULL, NULL) == SQLITE_OK) {
        rb_settle_op keep = tx->lease;
        if (settle_one(s, j, &keep, rb_wall_time()) == SQLITE_OK &&
            sqlite3_exec(s->db, "COMMIT", NULL, NULL, NULL) == SQLITE_OK) {
            end_tx(s);
            return;
        }
    }
    abandon_tx(s);
}

static job_rc run_commit(rb_sqlite *s, job *j)
{
    rb_settle_op *op = j->ops;
    if (op && !j->stage) op->applied = 0;
    if (tx_gone(s, j)) { if (j->tx == s->tx) abandon_tx(s); return JOB_DONE; }
    if (s->tx->doomed) {    /* a statement failed: nothing of it commits */
        char why[sizeof s->tx->why];
        memcpy(why, s->tx->why, sizeof why);
        undo_tx(s, j);
        set_err(j, "%s", why);
        return JOB_DONE;
    }
    if (op && !j->stage) {
        int rc = settle_one(s, j, op, rb_wall_time());
        if (rc != SQLITE_OK || !op->applied) {     /* lease lost: nothing commits */
            abandon_tx(s);
            return conclude(j, rc, 0);
        }
        j->stage = 1;   /* a retried COMMIT must not write the completion twice */
    }
    int rc = exec_sql(s, j, "COMMIT");
    if (is_busy(rc) && may_retry(j)) return JOB_BUSY;  /* the transaction stays open */
    j->notify = rc == SQLITE_OK && s->tx->enqueued;
    if (rc != SQLITE_OK && op) op->applied = 0;
    abandon_tx(s);
    return conclude(j, rc, 0);
}

static job_rc run_rollback(rb_sqlite *s, job *j)
{
    if (j->tx != s->tx) { set_err(j, "sqlite: the transaction is already finished"); return JOB_DONE; }
    undo_tx(s, j);
    j->err[0] = 0;      /* rolled back: whatever the kept lease met is for its settle to find */
    return JOB_DONE;
}

/* --- reporting ---------------------------------------------------------------------------- */
static void report_done(job *j, const char *err) { if (j->cb.done) j->cb.done(j->ud, err); }

static void report_ids(job *j, const char *err)
{
    if (j->cb.ids) j->cb.ids(j->ud, err, err ? NULL : j->idp, err ? NULL : j->kept, err ? 0 : j->nitems);
}

static void report_records(job *j, const char *err)
{
    rb_delivery **recs = err ? NULL : j->recs;
    size_t n = err ? 0 : j->nrecs;
    if (recs) { j->recs = NULL; j->nrecs = 0; }     /* ownership passes to the callback */
    if (j->cb.records) j->cb.records(j->ud, err, recs, n);
    else rb_delivery_list_free(recs, n);
}

/* SQLite wakes no dispatcher for what falls due later: a claim says nothing of when to claim
 * next (quiet_until 0) and never waits for a claim slot. */
static void report_claim(job *j, const char *err)
{
    rb_claim_result res = {.recs = err ? NULL : j->recs, .n = err ? 0 : j->nrecs};
    if (res.recs) { j->recs = NULL; j->nrecs = 0; }     /* ownership passes to the callback */
    if (j->cb.claim) j->cb.claim(j->ud, err, err ? NULL : &res);
    else rb_delivery_list_free(res.recs, res.n);
}

static void report_count(job *j, const char *err)
{
    if (j->cb.count) j->cb.count(j->ud, err, err ? 0 : j->count);
}

static void report_stats(job *j, const char *err)
{
    if (j->cb.stats) j->cb.stats(j->ud, err, err ? NULL : &j->st);
}

static void report_lease(job *j, const char *err)
{
    if (j->cb.lease) j->cb.lease(j->ud, err, err ? 0 : j->acquired, err ? 0 : j->expires_at);
}

static void report_tx(job *j, const char *err)
{
    if (j->cb.tx) j->cb.tx(j->ud, err, err ? NULL : j->new_tx);
}

static void report_rows(job *j, const char *err)
{
    rb_rowset *rs = err ? NULL : j->rows;
    if (rs) j->rows = NULL;
    if (j->cb.rows) j->cb.rows(j->ud, err, rs);
    else rb_rowset_free(rs);
}

static const job_type T_ENQUEUE = {run_enqueue, report_ids};
static const job_type T_CLAIM = {run_claim, report_claim};
static const job_type T_SETTLE = {run_settle, report_done};
static const job_type T_GET = {run_get, report_records};
static const job_type T_LIST = {run_list, report_records};
static const job_type T_STATS = {run_stats, report_stats};
static const job_type T_KICK = {run_kick, report_count};
static const job_type T_PURGE = {run_purge, report_count};
/* A cancel that took a run's lease tells this process's dispatchers before its caller. */
static void report_one(job *j, const char *err)
{
    if (!err && j->which == ONE_CANCEL && j->count && j->token)
        rb_store_cancelled(&j->s->base, j->id, j->token);
    report_count(j, err);
}

static const job_type T_ONE = {run_one, report_one};

/* This process's dispatchers hear of the runs a cancel_all took the leases of first. */
static void report_cancel_all(job *j, const char *err)
{
    for (size_t i = 0; !err && j->rows && i < j->rows->nrows; i++) {
        const rb_value *v = &j->rows->vals[i * (size_t)j->rows->ncols];
        char id[24];
        snprintf(id, sizeof id, "%lld", (long long)v[0].i);
        if (v[1].type == RB_VTEXT) rb_store_cancelled(&j->s->base, id, v[1].s);
    }
    report_count(j, err);
}
static const job_type T_CANCEL_ALL = {run_cancel_all, report_cancel_all};
static const job_type T_PROGRESS = {run_progress, report_count};
static const job_type T_TOPIC_STATS = {run_topic_stats, report_rows};
static const job_type T_PENDING_TOPICS = {run_pending_topics, report_rows};
static const job_type T_PAUSE = {run_pause, report_count};
static const job_type T_PAUSED = {run_paused, report_rows};
static const job_type T_LIMIT = {run_limit, report_count};
static const job_type T_LIMITS = {run_limits, report_rows};
/* A schedule made, changed or removed: this process's dispatchers read them again. */
static void report_schedules_changed(job *j, const char *err)
{
    if (!err && (j->type->run == run_schedule || j->count)) rb_store_schedules_changed(&j->s->base);
    report_count(j, err);
}
static const job_type T_SCHEDULE = {run_schedule, report_schedules_changed};
static const job_type T_UNSCHEDULE = {run_unschedule, report_schedules_changed};
static const job_type T_SCHEDULES = {run_schedules, report_rows};
static const job_type T_SCHEDULE_FIRE = {run_schedule_fire, report_count};
static const job_type T_LEASE = {run_lease, report_lease};
static const job_type T_BEGIN = {run_begin, report_tx};
static const job_type T_EXEC = {run_exec, report_count};
static const job_type T_QUERY = {run_query, report_rows};
static const job_type T_COMMIT = {run_commit, report_done};
static const job_type T_ROLLBACK = {run_rollback, report_done};

/* --- the queue ---------------------------------------------------------------------------- */
static void free_job(job *j)
{
    for (strnode *n = j->strs, *next; n; n = next) { next = n->next; free(n); }
    free_records(j);
    rb_rowset_free(j->rows);
    free(j->items); free(j->topics); free(j->active);
    free(j->params); free(j->idbuf); free(j->idp); free(j->kept);
    free(j);
}

/* Reports the outcome and frees the job. The job is already off every queue, so whatever the
 * callback does to the store (another operation, even close) finds consistent state. */
static void finish(job *j, const char *err)
{
    if (!err && j->notify && !j->s->closed) rb_store_notify_local(&j->s->base);
    j->type->report(j, err);
    free_job(j);
}

static queue *queue_of(rb_sqlite *s, job *j)
{
    return j->tx ? &s->txq : j->type == &T_BEGIN ? &s->beginq : &s->q;
}

/* While a transaction is open only its jobs run; the others wait their turn. Leftover jobs of
 * a finished transaction run (and fail) before anything else, and every other waiting job
 * before the next transaction begins. */
static job *next_job(rb_sqlite *s)
{
    if (s->tx || s->txq.head) return s->txq.head;
    if (s->beginq.head && (!s->q.head || s->q_pass <= 0)) return s->beginq.head;
    return s->q.head;
}

static long queue_length(const queue *q)
{
    long n = 0;
    for (const job *j = q->head; j; j = j->next) n++;
    return n;
}

static void destroy(rb_sqlite *s);

/* Resumes the queue from the loop after `delay` s. */
static void schedule(rb_sqlite *s, double delay)
{
    rb_timer_set(&s->retry, delay, 0);
    rb_timer_start(s->base.loop, &s->retry);
    s->retry_armed = 1;
}

static void arm_retry(rb_sqlite *s)
{
    s->retry_delay = s->retry_delay ? fmin(s->retry_delay * 2, RETRY_MAX) : RETRY_FIRST;
    schedule(s, s->retry_delay);
}

/* Group commit: single enqueues waiting side by side (tasks and handlers that enqueue, each
 * waiting for its own) commit in one transaction, each job a savepoint in it, so one job's
 * failure is its own. A commit costs an fsync: 64 writers then pay one, not 64. */
#define GROUP_MAX 256

static int groupable(const rb_sqlite *s, const job *j)
{
    return j && j->type == &T_ENQUEUE && !j->tx && !s->tx && !s->txq.head;
}

/* Puts the jobs of list (linked by next) back at the head of the queue, in order. */
static void requeue_front(rb_sqlite *s, job *list)
{
    if (!list) return;
    job *last = list;
    while (last->next) last = last->next;
    RB_FIFO_PUSH_FRONT_LIST(&s->q, list, last);
}

/* Runs the enqueues at the head of the queue as one transaction and finishes them; JOB_BUSY
 * (nothing run, nothing taken off the queue) when the write lock is not to be had now. */
static job_rc run_group(rb_sqlite *s)
{
    job *first = s->q.head;
    int rc = sqlite3_exec(s->db, "BEGIN IMMEDIATE", NULL, NULL, NULL);
    if (is_busy(rc) && may_retry(first)) return JOB_BUSY;
    job *done = NULL, **tail = &done;
    size_t n = 0;
    s->grouping = rc == SQLITE_OK;
    while (n < GROUP_MAX && groupable(s, s->q.head)) {
        job *j;
        RB_FIFO_POP(&s->q, &j);
        s->q_pass--;
        j->err[0] = 0;
        j->failed = 0;
        if (rc != SQLITE_OK) set_err(j, "sqlite: %s", sqlite3_errmsg(s->db));
        else if (j->type->run(s, j) == JOB_BUSY && !j->failed)  /* not under our lock, but */
            set_err(j, "sqlite: database is busy");
        if (rc == SQLITE_OK && sqlite3_get_autocommit(s->db)) {
            /* j's error made SQLite roll the whole transaction back (SQLITE_FULL, an I/O
             * error, out of memory): a later job's savepoint would begin and commit a
             * transaction of its own, and the commit fail for all. j has its error; the jobs
             * before it wrote nothing and go back to the head to run again. */
            s->grouping = 0;
            if (!j->failed) set_err(j, "sqlite: the transaction was rolled back");
            *tail = NULL;
            requeue_front(s, done);
            finish(j, j->err);
            return JOB_DONE;
        }
        *tail = j;
        tail = &j->next;
        n++;
    }
    *tail = NULL;
    s->grouping = 0;
    if (rc == SQLITE_OK && (rc = sqlite3_exec(s->db, "COMMIT", NULL, NULL, NULL)) != SQLITE_OK) {
        char why[200];
        snprintf(why, sizeof why, "%s", sqlite3_errmsg(s->db));
        if (!sqlite3_get_autocommit(s->db)) sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
        if (is_busy(rc) && may_retry(first)) {
            requeue_front(s, done);     /* nothing was written: they run again */
            return JOB_BUSY;
        }
        for (job *j = done; j; j = j->next)
            if (!j->failed) set_err(j, "sqlite: commit failed: %s", why);
    }
    for (job *j = done, *next; j; j = next) {
        next = j->next;
        finish(j, j->failed ? j->err : NULL);
    }
    return JOB_DONE;
}

/* Runs queued jobs in order until the queue is empty, a transaction waits for its owner, or
 * the database is busy (then a timer resumes). Callbacks that issue operations only append to
 * the queue: the outer loop runs them, and after a batch lets the event loop have a turn. */
static void pump(rb_sqlite *s)
{
    if (s->pumping || s->retry_armed || s->closed) return;
    s->pumping = 1;
    job *j;
    int ran = 0;
    while (!s->closed && (j = next_job(s)) != NULL) {
        if (++ran > PUMP_BATCH) { schedule(s, 0); break; }
        if (j->type == &T_BEGIN && !s->tx) {
            double wait = s->tx_ended_at + TX_GAP - rb_monotonic();
            if (wait > 0) { schedule(s, wait); break; }
        }
        if (groupable(s, j) && groupable(s, j->next)) {
            if (run_group(s) == JOB_BUSY) { arm_retry(s); break; }
            s->retry_delay = 0;
            continue;
        }
        j->err[0] = 0;
        j->failed = 0;
        if (j->type->run(s, j) == JOB_BUSY) { arm_retry(s); break; }
        s->retry_delay = 0;
        job *popped;
        RB_FIFO_POP(queue_of(s, j), &popped);
        if (queue_of(s, j) == &s->q) s->q_pass--;
        finish(j, j->failed ? j->err : NULL);
    }
    s->pumping = 0;
    if (s->closed) destroy(s);  /* a callback closed the store: free it now it is unused */
}

static void on_retry(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    rb_sqlite *s = w->data;
    s->retry_armed = 0;
    pump(s);
}

static void submit(rb_sqlite *s, job *j)
{
    if (s->closed) { finish(j, "store closed"); return; }
    if (j->oom) { finish(j, "sqlite: out of memory"); return; }
    RB_FIFO_PUSH(queue_of(s, j), j);
    /* An enqueue waits for the end of this loop iteration, when the enqueues that others make
     * meanwhile can commit with it (group commit); inside pump it joins the run at once. */
    if (groupable(s, j) && !s->pumping) {
        if (!s->retry_armed) schedule(s, 0);
        return;
    }
    pump(s);
}

static job *new_job(rb_sqlite *s, rb_tx *tx, const job_type *type, void *ud)
{
    job *j = rb_calloc(1, sizeof *j);
    if (!j) return NULL;
    j->type = type;
    j->s = s;
    j->tx = tx;
    j->ud = ud;
    return j;
}

/* --- the vtable ------------------------------------------------------------------------- */
#define OOM "sqlite: out of memory"

/* Copies n items into j (j->oom when out of memory). */
static void keep_items(job *j, const rb_enqueue_item *items, size_t n)
{
    j->nitems = n;
    j->items = rb_calloc(n + 1, sizeof *j->items);
    j->idbuf = rb_calloc(n + 1, sizeof *j->idbuf);
    j->idp = rb_calloc(n + 1, sizeof *j->idp);
    j->kept = rb_calloc(n + 1, 1);
    if (!j->items || !j->idbuf || !j->idp || !j->kept) { j->oom = 1; return; }
    for (size_t i = 0; i < n; i++) {
        j->items[i] = items[i];
        j->items[i].topic = keep(j, items[i].topic);
        j->items[i].payload = keep(j, items[i].payload ? items[i].payload : "null");
        j->items[i].key = keep(j, items[i].key);
        j->items[i].group = keep(j, items[i].group);
        if (items[i].nafter) {
            /* the list of ids, then each id (keep_n copies bytes; a node's text is aligned as
             * malloc's memory, past its one pointer) */
            const char **after = (const char **)keep_n(j, (const char *)items[i].after,
                                                       items[i].nafter * sizeof *after);
            for (size_t k = 0; after && k < items[i].nafter; k++) after[k] = keep(j, after[k]);
            j->items[i].after = after;
        }
        j->idp[i] = j->idbuf[i];
    }
}

static job *enqueue_job(rb_sqlite *s, rb_tx *tx, const rb_enqueue_item *items, size_t n,
                        rb_ids_cb cb, void *ud)
{
    job *j = new_job(s, tx, &T_ENQUEUE, ud);
    if (!j) { cb(ud, OOM, NULL, NULL, 0); return NULL; }
    j->cb.ids = cb;
    keep_items(j, items, n);
    return j;
}

static void sq_enqueue(rb_store *base, const rb_enqueue_item *items, size_t n, rb_ids_cb cb,
                       void *ud)
{
    rb_sqlite *s = (rb_sqlite *)base;
    job *j = enqueue_job(s, NULL, items, n, cb, ud);
    if (j) submit(s, j);
}

static void sq_claim(rb_store *base, const rb_claim_req *req, rb_claim_cb cb, void *ud)
{
    rb_sqlite *s = (rb_sqlite *)base;
    job *j = new_job(s, NULL, &T_CLAIM, ud);
    if (!j) { cb(ud, OOM, NULL); return; }
    j->cb.claim = cb;
    j->limit = req->limit;
    j->num = sane_secs(req->lease_duration);
    j->ntopics = req->ntopics;
    j->topics = rb_calloc(req->ntopics + 1, sizeof *j->topics);
    j->active = rb_calloc(req->ntopics + 1, sizeof *j->active);
    if (!j->topics || !j->active) j->oom = 1;
    for (size_t i = 0; j->topics && i < req->ntopics; i++)
        j->topics[i] = keep(j, req->topics[i] ? req->topics[i] : "");
    submit(s, j);
}

/* The ops array (and its strings) must stay valid until the callback: results go into it. */
static void sq_settle(rb_store *base, rb_settle_op *ops, size_t n, rb_done_cb cb, void *ud)
{
    rb_sqlite *s = (rb_sqlite *)base;
    job *j = new_job(s, NULL, &T_SETTLE, ud);
    if (!j) { cb(ud, OOM); return; }
    j->cb.done = cb;
    j->ops = ops;
    j->nops = n;
    submit(s, j);
}

static void sq_get(rb_store *base, const char *id, rb_records_cb cb, void *ud)
{
    rb_sqlite *s = (rb_sqlite *)base;
    job *j = new_job(s, NULL, &T_GET, ud);
    if (!j) { cb(ud, OOM, NULL, 0); return; }
    j->cb.records = cb;
    j->id = keep(j, id);
    submit(s, j);
}

static void sq_list(rb_store *base, const rb_list_req *req, rb_records_cb cb, void *ud)
{
    rb_sqlite *s = (rb_sqlite *)base;
    job *j = new_job(s, NULL, &T_LIST, ud);
    if (!j) { cb(ud, OOM, NULL, 0); return; }
    j->cb.records = cb;
    j->status = keep(j, req ? req->status : NULL);
    j->topic = keep(j, req ? req->topic : NULL);
    j->limit = req && req->limit ? req->limit : LIST_DEFAULT;
    j->newest = req && req->newest_first;
    j->after = keep(j, req && req->newest_first ? req->after : NULL);
    j->key = keep(j, req ? req->key : NULL);
    j->prefix = keep(j, req ? req->topic_prefix : NULL);
    j->errtext = keep(j, req ? req->error_text : NULL);
    submit(s, j);
}

static void sq_stats(rb_store *base, rb_stats_cb cb, void *ud)
{
    rb_sqlite *s = (rb_sqlite *)base;
    job *j = new_job(s, NULL, &T_STATS, ud);
    if (!j) { cb(ud, OOM, NULL); return; }
    j->cb.stats = cb;
    submit(s, j);
}

static void sq_kick(rb_store *base, rb_kick_mode mode, const char *id, const char *topic,
                    rb_count_cb cb, void *ud)
{
    rb_sqlite *s = (rb_sqlite *)base;
    job *j = new_job(s, NULL, &T_KICK, ud);
    if (!j) { cb(ud, OOM, 0); return; }
    j->cb.count = cb;
    j->which = mode;
    j->id = keep(j, id);
    j->topic = keep(j, topic);
    submit(s, j);
}

static void sq_purge(rb_store *base, const char *status, const char *topic, double older_than,
                     size_t limit, rb_count_cb cb, void *ud)
{
    rb_sqlite *s = (rb_sqlite *)base;
    job *j = new_job(s, NULL, &T_PURGE, ud);
    if (!j) { cb(ud, OOM, 0); return; }
    j->cb.count = cb;
    j->status = keep(j, status);
    j->topic = keep(j, topic);
    j->num = older_than;
    j->limit = limit;
    submit(s, j);
}

/* A job of rows per topic (topic stats, the paused topics). */
static void submit_rows(rb_store *base, const job_type *type, rb_rows_cb cb, void *ud)
{
    rb_sqlite *s = (rb_sqlite *)base;
    job *j = new_job(s, NULL, type, ud);
    if (!j) { cb(ud, OOM, NULL); return; }
    j->cb.rows = cb;
    submit(s, j);
}

static void sq_topic_stats(rb_store *base, rb_rows_cb cb, void *ud)
{
    submit_rows(base, &T_TOPIC_STATS, cb, ud);
}

static void sq_pending_topics(rb_store *base, size_t scan_max, rb_rows_cb cb, void *ud)
{
    rb_sqlite *s = (rb_sqlite *)base;
    job *j = new_job(s, NULL, &T_PENDING_TOPICS, ud);
    if (!j) { cb(ud, OOM, NULL); return; }
    j->cb.rows = cb;
    j->limit = rb_scan_bound(scan_max);
    submit(s, j);
}

static void sq_pause(rb_store *base, const char *topic, int paused, rb_count_cb cb, void *ud)
{
    rb_sqlite *s = (rb_sqlite *)base;
    job *j = new_job(s, NULL, &T_PAUSE, ud);
    if (!j) { cb(ud, OOM, 0); return; }
    j->cb.count = cb;
    j->which = paused != 0;
    j->topic = keep(j, topic ? topic : "");
    submit(s, j);
}

static void sq_paused(rb_store *base, rb_rows_cb cb, void *ud)
{
    submit_rows(base, &T_PAUSED, cb, ud);
}

static void sq_limit(rb_store *base, const char *topic, const rb_limit *lim, rb_count_cb cb,
                     void *ud)
{
    rb_sqlite *s = (rb_sqlite *)base;
    if (lim && !rb_limit_valid(lim)) { cb(ud, "sqlite: limit: bad limits", 0); return; }
    job *j = new_job(s, NULL, &T_LIMIT, ud);
    if (!j) { cb(ud, OOM, 0); return; }
    j->cb.count = cb;
    j->which = lim != NULL;
    if (lim) j->lim = *lim;
    j->topic = keep(j, topic ? topic : "");
    submit(s, j);
}

static void sq_limits(rb_store *base, rb_rows_cb cb, void *ud)
{
    submit_rows(base, &T_LIMITS, cb, ud);
}

static void sq_cancel_all(rb_store *base, const char *status, const char *topic,
                          const char *reason, rb_count_cb cb, void *ud)
{
    rb_sqlite *s = (rb_sqlite *)base;
    if (status && !rb_live_status(status)) {
        cb(ud, "sqlite: cancel takes status pending or processing", 0);
        return;
    }
    job *j = new_job(s, NULL, &T_CANCEL_ALL, ud);
    if (!j) { cb(ud, OOM, 0); return; }
    j->cb.count = cb;
    j->status = keep(j, status);
    j->topic = keep(j, topic);
    j->name = keep(j, reason);
    submit(s, j);
}

static void sq_schedule(rb_store *base, const rb_schedule *sch, rb_count_cb cb, void *ud)
{
    rb_sqlite *s = (rb_sqlite *)base;
    job *j = new_job(s, NULL, &T_SCHEDULE, ud);
    if (!j) { cb(ud, OOM, 0); return; }
    j->cb.count = cb;
    j->sch = *sch;
    j->sch.name = keep(j, sch->name);
    j->sch.topic = keep(j, sch->topic);
    j->sch.payload = keep(j, sch->payload);
    j->sch.cron = keep(j, sch->cron);
    j->sch.timezone = keep(j, sch->timezone);
    submit(s, j);
}

static void sq_unschedule(rb_store *base, const char *name, rb_count_cb cb, void *ud)
{
    rb_sqlite *s = (rb_sqlite *)base;
    job *j = new_job(s, NULL, &T_UNSCHEDULE, ud);
    if (!j) { cb(ud, OOM, 0); return; }
    j->cb.count = cb;
    j->sch.name = keep(j, name ? name : "");
    submit(s, j);
}

static void sq_schedules(rb_store *base, rb_rows_cb cb, void *ud)
{
    submit_rows(base, &T_SCHEDULES, cb, ud);
}

static void sq_schedule_fire(rb_store *base, const char *name, double due, double next,
                             const rb_enqueue_item *tick, rb_count_cb cb, void *ud)
{
    rb_sqlite *s = (rb_sqlite *)base;
    job *j = new_job(s, NULL, &T_SCHEDULE_FIRE, ud);
    if (!j) { cb(ud, OOM, 0); return; }
    j->cb.count = cb;
    j->sch.name = keep(j, name);
    j->num = due;
    j->sch.next_at = next;
    keep_items(j, tick, 1);
    submit(s, j);
}

static void one_op(rb_store *base, int which, const char *id, const char *reason,
                   rb_count_cb cb, void *ud)
{
    rb_sqlite *s = (rb_sqlite *)base;
    job *j = new_job(s, NULL, &T_ONE, ud);
    if (!j) { cb(ud, OOM, 0); return; }
    j->cb.count = cb;
    j->which = which;
    j->id = keep(j, id);
    j->name = keep(j, reason);
    submit(s, j);
}

static void sq_bury(rb_store *base, const char *id, const char *reason, rb_count_cb cb, void *ud)
{
    one_op(base, ONE_BURY, id, reason, cb, ud);
}

static void sq_progress(rb_store *base, rb_tx *tx, const char *id, const char *token,
                        const char *json, rb_count_cb cb, void *ud)
{
    rb_sqlite *s = (rb_sqlite *)base;
    job *j = new_job(s, tx, &T_PROGRESS, ud);
    if (!j) { cb(ud, OOM, 0); return; }
    j->cb.count = cb;
    j->id = keep(j, id);
    j->token = keep(j, token);
    j->sql = keep(j, json);     /* (the text to store) */
    submit(s, j);
}

static void sq_cancel(rb_store *base, const char *id, const char *reason, rb_count_cb cb, void *ud)
{
    one_op(base, ONE_CANCEL, id, reason, cb, ud);
}

static void sq_remove(rb_store *base, const char *id, rb_count_cb cb, void *ud)
{
    one_op(base, ONE_DELETE, id, NULL, cb, ud);
}

static void sq_lease(rb_store *base, rb_lease_op kind, const char *name, const char *token,
                     double duration, rb_lease_cb cb, void *ud)
{
    static const int stmts[] = {[RB_LEASE_ACQUIRE] = ST_LEASE_ACQUIRE,
                                [RB_LEASE_EXTEND] = ST_LEASE_EXTEND,
                                [RB_LEASE_RELEASE] = ST_LEASE_RELEASE};
    rb_sqlite *s = (rb_sqlite *)base;
    job *j = new_job(s, NULL, &T_LEASE, ud);
    if (!j) { cb(ud, OOM, 0, 0); return; }
    j->cb.lease = cb;
    j->which = stmts[kind];
    j->name = keep(j, name ? name : "");
    j->token = keep(j, token ? token : "");
    j->num = kind == RB_LEASE_RELEASE ? 0 : duration;
    submit(s, j);
}

static void sq_begin(rb_store *base, rb_tx_cb cb, void *ud)
{
    rb_sqlite *s = (rb_sqlite *)base;
    job *j = new_job(s, NULL, &T_BEGIN, ud);
    if (!j) { cb(ud, OOM, NULL); return; }
    j->cb.tx = cb;
    submit(s, j);
}

static void sq_begin_leased(rb_store *base, rb_settle_op *lease, rb_tx_cb cb, void *ud)
{
    rb_sqlite *s = (rb_sqlite *)base;
    job *j = new_job(s, NULL, &T_BEGIN, ud);
    if (!j) { lease->applied = 0; cb(ud, OOM, NULL); return; }
    j->cb.tx = cb;
    j->ops = lease;     /* its result goes there; id and token are copied, as every job's */
    j->nops = 1;
    j->id = keep(j, lease->id);
    j->token = keep(j, lease->token);
    j->num = lease->delay;
    submit(s, j);
}

/* Still inside its transaction: an error SQLite answered by rolling back all of it (a full
 * disk, INSERT OR ROLLBACK) ended it early, and with it the write lock. */
static int sq_tx_holds(rb_tx *tx)
{
    rb_sqlite *s = tx->s;
    return s->tx == tx && !s->closed && !tx->lost && !sqlite3_get_autocommit(s->db);
}

static void sq_tx_enqueue(rb_tx *tx, const rb_enqueue_item *items, size_t n, rb_ids_cb cb,
                          void *ud)
{
    job *j = enqueue_job(tx->s, tx, items, n, cb, ud);
    if (j) submit(tx->s, j);
}

static job *stmt_job(rb_tx *tx, const job_type *type, const char *sql, const rb_value *params,
                     size_t n, void *ud)
{
    job *j = new_job(tx->s, tx, type, ud);
    if (!j) return NULL;
    j->sql = keep(j, sql ? sql : "");
    j->nparams = n;
    j->params = rb_calloc(n + 1, sizeof *j->params);
    if (!j->params) { j->oom = 1; return j; }
    for (size_t i = 0; i < n; i++) {
        j->params[i] = params[i];
        if (params[i].type == RB_VTEXT)
            j->params[i].s = keep_n(j, params[i].s ? params[i].s : "", params[i].s ? params[i].len : 0);
    }
    return j;
}

static void sq_tx_exec(rb_tx *tx, const char *sql, const rb_value *params, size_t n,
                       rb_count_cb cb, void *ud)
{
    job *j = stmt_job(tx, &T_EXEC, sql, params, n, ud);
    if (!j) { cb(ud, OOM, 0); return; }
    j->cb.count = cb;
    submit(tx->s, j);
}

static void sq_tx_query(rb_tx *tx, const char *sql, const rb_value *params, size_t n,
                        rb_rows_cb cb, void *ud)
{
    job *j = stmt_job(tx, &T_QUERY, sql, params, n, ud);
    if (!j) { cb(ud, OOM, NULL); return; }
    j->cb.rows = cb;
    submit(tx->s, j);
}

/* No memory for the job that ends a transaction: it ends now all the same, rolled back, or
 * it would hold the connection, and with it every other operation of the store, for ever. */
static void end_tx_now(rb_tx *tx)
{
    rb_sqlite *s = tx->s;
    if (s->tx != tx) return;        /* already over: its jobs report that */
    abandon_tx(s);
    pump(s);                        /* what waited for the transaction runs */
}

/* complete (when given) must stay valid until the callback: its result goes into it. */
static void sq_commit(rb_tx *tx, rb_settle_op *complete, rb_done_cb cb, void *ud)
{
    job *j = new_job(tx->s, tx, &T_COMMIT, ud);
    if (!j) {
        if (complete) complete->applied = 0;
        end_tx_now(tx);
        cb(ud, OOM);
        return;
    }
    j->cb.done = cb;
    j->ops = complete;
    submit(tx->s, j);
}

/* cb may be NULL: callers that wait for nothing roll back without one. */
static void sq_rollback(rb_tx *tx, rb_done_cb cb, void *ud)
{
    job *j = new_job(tx->s, tx, &T_ROLLBACK, ud);
    if (!j) {
        end_tx_now(tx);
        if (cb) cb(ud, NULL);       /* rolled back */
        return;
    }
    j->cb.done = cb;
    submit(tx->s, j);
}

static void destroy(rb_sqlite *s)
{
    rb_timer_stop(s->base.loop, &s->retry);
    for (int i = 0; i < ST_COUNT; i++) sqlite3_finalize(s->stmts[i]);
    sqlite3_finalize(s->claim_sel[0]);
    sqlite3_finalize(s->claim_sel[1]);
    if (s->tx) free(s->tx->lease_token);
    free(s->tx);    /* closing the connection rolls an open transaction back */
    sqlite3_close_v2(s->db);
    rb_store_release_dispatch(&s->base);
    free(s->base.table);
    free(s);
}

/* Fails every queued job; callbacks that issue more operations get "store closed" at once. */
static void fail_queue(queue *q)
{
    job *j;
    for (;;) {
        RB_FIFO_POP(q, &j);
        if (!j) break;
        finish(j, "store closed");
    }
}

static void sq_close(rb_store *base)
{
    rb_sqlite *s = (rb_sqlite *)base;
    if (s->closed) return;
    s->closed = 1;
    rb_timer_stop(s->base.loop, &s->retry);
    s->retry_armed = 0;
    fail_queue(&s->txq);
    fail_queue(&s->q);
    fail_queue(&s->beginq);
    if (!s->pumping) destroy(s);    /* else pump frees it once the running callback returns */
}

static const rb_store_vtable sqlite_vt = {
    .name = "sqlite",
    .tx_exclusive = 1,
    .enqueue = sq_enqueue,
    .claim = sq_claim,
    .settle = sq_settle,
    .get = sq_get,
    .list = sq_list,
    .stats = sq_stats,
    .kick = sq_kick,
    .purge = sq_purge,
    .topic_stats = sq_topic_stats,
    .pending_topics = sq_pending_topics,
    .bury = sq_bury,
    .cancel = sq_cancel,
    .cancel_all = sq_cancel_all,
    .progress = sq_progress,
    .remove = sq_remove,
    .lease = sq_lease,
    .begin = sq_begin,
    .tx_enqueue = sq_tx_enqueue,
    .tx_exec = sq_tx_exec,
    .tx_query = sq_tx_query,
    .tx_doc = NULL,
    .commit = sq_commit,
    .rollback = sq_rollback,
    .set_wakeup = NULL,
    .close = sq_close,
    .begin_leased = sq_begin_leased,
    .tx_holds = sq_tx_holds,
    .pause = sq_pause,
    .paused = sq_paused,
    .limit = sq_limit,
    .limits = sq_limits,
    .schedule = sq_schedule,
    .unschedule = sq_unschedule,
    .schedules = sq_schedules,
    .schedule_fire = sq_schedule_fire,
};

rb_store *rb_sqlite_open(struct ev_loop *loop, const char *path, const rb_store_options *opts,
                         char *err, size_t errlen)
{
    const char *table = opts && opts->table ? opts->table : "relaybus_deliveries";
    int want_migrate = opts ? opts->migrate : 1;
    if (!rb_valid_identifier(table)) {
        snprintf(err, errlen, "invalid table name '%s' (letters, digits and _ only)", table);
        return NULL;
    }
    /* sqlite:PATH names a file, never an SQLite URI filename (which this SQLite may or may
     * not interpret, depending on how it was built). */
    char *local = NULL;
    if (strncmp(path, "file:", 5) == 0) {
        size_t n = strlen(path) + 3;
        if (!(local = rb_malloc(n))) {
            snprintf(err, errlen, OOM);
            return NULL;
        }
        snprintf(local, n, "./%s", path);
        path = local;
    }
    int memory = strcmp(path, ":memory:") == 0;
    rb_sqlite *s = rb_calloc(1, sizeof *s);
    if (!s || !(s->base.table = rb_strdup(table))) {
        free(s);
        free(local);
        snprintf(err, errlen, OOM);
        return NULL;
    }
    s->base.vt = &sqlite_vt;
    s->base.loop = loop;
    rb_timer_init(&s->retry, on_retry, 0, 0);
    s->retry.w.data = s;
    if (rb_sqlite_open_file(path, table, want_migrate, memory, &s->db, err, errlen) != 0) {
        free(s->base.table);
        free(s);
        free(local);
        return NULL;
    }
    free(local);
    sqlite3_busy_timeout(s->db, BUSY_TIMEOUT_MS);
    sqlite3_set_authorizer(s->db, user_authorizer, s);
    return &s->base;
}
