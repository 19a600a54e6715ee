/* store_pg_tx.c -- the PostgreSQL store's application transactions: a transaction borrows a
 * connection of the pool for its life; its statements queue on that connection. */
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <libpq-fe.h>
#include "stores/pg/store_pg_impl.h"
#include "stores/pg/store_pg_schema.h"
#include "util/alloc.h"
#include "util/text.h"

/* ---- transactions ----------------------------------------------------------------------- */

/* Ends a transaction's life: the connection returns to the pool, the struct is freed. */
static void tx_free(rb_tx *tx)
{
    pg_store *s = tx->s;
    pg_tx_unbind(tx);
    if (s)
        for (rb_tx **pp = &s->txs; *pp; pp = &(*pp)->next)
            if (*pp == tx) { *pp = tx->next; break; }
    free(tx);
}

/* Runs a statement on the transaction's connection, after those already queued there. */
static void tx_submit(rb_tx *tx, pg_op *op)
{
    if (!tx->s) { op->done(op, NULL, pg_closed_msg); return; }
    if (tx->ended) {    /* the server is out of the transaction: nothing may autocommit */
        op->done(op, NULL, tx->doomed);
        return;
    }
    if (!tx->conn) {
        op->done(op, NULL, tx->err[0] ? tx->err : "postgresql: the transaction's connection was lost");
        return;
    }
    pg_conn *c = tx->conn;
    op->sent = 0;
    if (c->cur) RB_FIFO_PUSH(&c->q, op);
    else pg_conn_start_op(c, op);
}

static void begin_done(pg_op *op, PGresult *res, const char *err)
{
    (void)res;
    rb_tx *tx = op->tx;
    rb_tx_cb cb = op->cb.tx;
    void *ud = op->ud;
    pg_op_free(op);
    if (err) { tx_free(tx); cb(ud, err, NULL); return; }
    cb(ud, NULL, tx);
}

void pg_begin(rb_store *bs, rb_tx_cb cb, void *ud)
{
    pg_store *s = (pg_store *)bs;
    pg_op *op = pg_op_new(s, begin_done, ud);
    rb_tx *tx = rb_calloc(1, sizeof *tx);
    if (!op || !tx) { free(op); free(tx); cb(ud, "postgresql: out of memory", NULL); return; }
    tx->s = s;
    op->tx = tx;
    op->sql = "BEGIN";
    op->cb.tx = cb;
    pg_store_enter(s);
    if (s->closed) op->done(op, NULL, pg_closed_msg);
    else { RB_FIFO_PUSH(&s->begins, op); pg_pump(s); }
    pg_store_leave(s);
}

/* ---- what a statement of the transaction does to it -------------------------------------
 * A statement that failed dooms the transaction: PostgreSQL refuses every later statement
 * anyway, and the commit then fails with the statement's own error, not "current transaction
 * is aborted". A statement that ended the transaction on the server (one the check below
 * missed) leaves the connection in autocommit: nothing more of the transaction is sent. */
static void doom(rb_tx *tx, const char *why)
{
    if (!tx->doomed[0]) snprintf(tx->doomed, sizeof tx->doomed, "%s", why);
}

void pg_tx_statement_done(rb_tx *tx, pg_conn *c, const char *err)
{
    if (err) { doom(tx, err); return; }
    if (PQtransactionStatus(c->pq) == PQTRANS_IDLE) {
        tx->doomed[0] = 0;
        doom(tx, "postgresql: a statement ended the transaction: relaybus ends it (return, or "
                 "raise to roll back)");
        tx->ended = 1;
    }
}

/* 1 when the statement's first word (past spaces, comments and semicolons) controls the
 * transaction: BEGIN, START, COMMIT, END, ROLLBACK, ABORT, SAVEPOINT, RELEASE or PREPARE
 * TRANSACTION. Only one statement goes in a call (the extended protocol refuses more). */
static const char *skip_blank(const char *p)
{
    for (;;) {
        while (*p == ';' || isspace((unsigned char)*p)) p++;
        if (p[0] == '-' && p[1] == '-') {
            while (*p && *p != '\n') p++;
        } else if (p[0] == '/' && p[1] == '*') {
            int depth = 0;      /* PostgreSQL's block comments nest */
            do {
                if (p[0] == '/' && p[1] == '*') { depth++; p += 2; }
                else if (p[0] == '*' && p[1] == '/') { depth--; p += 2; }
                else if (*p) p++;
                else return p;
            } while (depth > 0);
        } else {
            return p;
        }
    }
}

static int word_is(const char *p, const char *word, const char **end)
{
    size_t n = strlen(word);
    if (strncasecmp(p, word, n) != 0) return 0;
    if (isalnum((unsigned char)p[n]) || p[n] == '_' || p[n] == '$') return 0;
    *end = p + n;
    return 1;
}

static int controls_transaction(const char *sql)
{
    static const char *const words[] = {"BEGIN", "START", "COMMIT", "END", "ROLLBACK", "ABORT",
                                        "SAVEPOINT", "RELEASE", NULL};
    const char *p = skip_blank(sql), *end;
    for (const char *const *w = words; *w; w++)
        if (word_is(p, *w, &end)) return 1;
    return word_is(p, "PREPARE", &end) && word_is(skip_blank(end), "TRANSACTION", &end);
}

void pg_tx_enqueue(rb_tx *tx, const rb_enqueue_item *items, size_t n, rb_ids_cb cb, void *ud)
{
    pg_store *s = tx->s;
    if (!s) { cb(ud, pg_closed_msg, NULL, NULL, 0); return; }
    pg_op *op = pg_enqueue_op(s, items, n, 0, cb, ud);
    if (!op) return;
    op->tx = tx;
    op->in_tx = 1;
    pg_store_enter(s);
    tx_submit(tx, op);
    pg_store_leave(s);
}

/* Parameters travel as text with no declared type, so the server infers each from context
 * (as in node-postgres): '5' fits an integer column, a text one, or substr's argument. */
static int bind_values(pg_op *op, const rb_value *params, size_t n)
{
    if (!pg_op_alloc_params(op, (int)n)) return 0;
    for (size_t i = 0; i < n; i++) {
        const rb_value *v = &params[i];
        char tmp[40];
        const char *text = tmp;
        switch (v->type) {
        case RB_VNULL: text = NULL; break;
        case RB_VINT: snprintf(tmp, sizeof tmp, "%lld", (long long)v->i); break;
        case RB_VFLOAT:
            if (isnan(v->f)) text = "NaN";
            else if (isinf(v->f)) text = v->f > 0 ? "Infinity" : "-Infinity";
            else snprintf(tmp, sizeof tmp, "%.17g", v->f);
            break;
        case RB_VBOOL: text = v->i ? "true" : "false"; break;
        case RB_VTEXT:
            op->params[i] = rb_strndup(v->s ? v->s : "", v->len);
            if (!op->params[i]) return 0;
            continue;
        }
        if (!pg_op_param(op, (int)i, text)) return 0;
    }
    return 1;
}

static const char refused_msg[] = "postgresql: BEGIN, COMMIT, ROLLBACK, SAVEPOINT and RELEASE "
    "are refused inside a transaction: relaybus ends it (return, or raise to roll back)";

static pg_op *tx_sql_op(rb_tx *tx, const char *sql, const rb_value *params, size_t nparams,
                        pg_done_fn done, void *ud)
{
    pg_op *op = pg_op_new(tx->s, done, ud);
    if (!op) return NULL;
    op->tx = tx;
    op->in_tx = 1;
    tx->user_sql = 1;
    op->sql = op->sql_owned = rb_strdup(sql ? sql : "");
    if (!op->sql_owned || !bind_values(op, params, nparams)) { pg_op_free(op); return NULL; }
    return op;
}

void pg_tx_exec(rb_tx *tx, const char *sql, const rb_value *params, size_t nparams,
                       rb_count_cb cb, void *ud)
{
    pg_store *s = tx->s;
    if (!s) { cb(ud, pg_closed_msg, 0); return; }
    if (sql && controls_transaction(sql)) { doom(tx, refused_msg); cb(ud, refused_msg, 0); return; }
    pg_op *op = tx_sql_op(tx, sql, params, nparams, pg_count_done, ud);
    if (!op) { cb(ud, "postgresql: out of memory", 0); return; }
    op->cb.count = cb;
    pg_store_enter(s);
    tx_submit(tx, op);
    pg_store_leave(s);
}

static rb_rowset *result_rowset(const PGresult *r)
{
    rb_rowset *rs = rb_calloc(1, sizeof *rs);
    if (!rs) return NULL;
    rs->ncols = PQnfields(r);
    rs->nrows = (size_t)PQntuples(r);
    rs->names = rb_calloc((size_t)rs->ncols + 1, sizeof *rs->names);
    rs->vals = rb_calloc(rs->nrows * (size_t)rs->ncols + 1, sizeof *rs->vals);
    if (!rs->names || !rs->vals) { rs->ncols = 0; rs->nrows = 0; rb_rowset_free(rs); return NULL; }
    int ok = 1;
    for (int c = 0; c < rs->ncols; c++)
        if (!(rs->names[c] = rb_strdup(PQfname(r, c)))) ok = 0;
    for (size_t i = 0; i < rs->nrows; i++) {
        for (int c = 0; c < rs->ncols; c++) {
            rb_value *v = &rs->vals[i * (size_t)rs->ncols + (size_t)c];
            if (PQgetisnull(r, (int)i, c)) { v->type = RB_VNULL; continue; }
            const char *text = PQgetvalue(r, (int)i, c);
            switch (PQftype(r, c)) {
            case 20: case 21: case 23:          /* int8, int2, int4 */
                v->type = RB_VINT; v->i = strtoll(text, NULL, 10); break;
            case 700: case 701: case 1700:      /* float4, float8, numeric */
                v->type = RB_VFLOAT; v->f = strtod(text, NULL); break;
            case 16:                            /* bool */
                v->type = RB_VBOOL; v->i = text[0] == 't'; break;
            default:
                v->len = (size_t)PQgetlength(r, (int)i, c);
                v->s = rb_strndup(text, v->len);
                if (v->s) v->type = RB_VTEXT; else ok = 0;
                break;
            }
        }
    }
    if (!ok) { rb_rowset_free(rs); return NULL; }
    return rs;
}

void pg_rows_done(pg_op *op, PGresult *res, const char *err)
{
    rb_rowset *rs = NULL;
    if (!err && !(rs = result_rowset(res))) err = "postgresql: out of memory";
    op->cb.rows(op->ud, err, rs);
    pg_op_free(op);
}

void pg_tx_query(rb_tx *tx, const char *sql, const rb_value *params, size_t nparams,
                        rb_rows_cb cb, void *ud)
{
    pg_store *s = tx->s;
    if (!s) { cb(ud, pg_closed_msg, NULL); return; }
    if (sql && controls_transaction(sql)) { doom(tx, refused_msg); cb(ud, refused_msg, NULL); return; }
    pg_op *op = tx_sql_op(tx, sql, params, nparams, pg_rows_done, ud);
    if (!op) { cb(ud, "postgresql: out of memory", NULL); return; }
    op->cb.rows = cb;
    pg_store_enter(s);
    tx_submit(tx, op);
    pg_store_leave(s);
}

/* Commit runs up to three statements: the fenced completion, then COMMIT, or ROLLBACK when
 * the completion failed or was not applied. */
enum { PH_SETTLE, PH_COMMIT, PH_ROLLBACK };

static void tx_step(pg_op *op, int phase, const char *sql)
{
    pg_op_clear_params(op);
    op->stmt = -1;
    op->sql = sql;
    op->phase = phase;
    tx_submit(op->tx, op);
}

static void reset_done(pg_op *op, PGresult *res, const char *err)
{
    (void)res;
    pg_conn *c = op->ud;
    pg_op_free(op);
    if (err && !c->dead) pg_conn_break(c);  /* its session is unknown: not used again */
}

/* A user's statement may have changed the session beyond its transaction (SET, a temporary
 * table, LISTEN, PREPARE, an advisory lock): the connection goes back to the pool as it came.
 * DISCARD ALL is the connection's statement until answered, so whatever the pool gives it next
 * waits for it; it also drops relaybus's prepared statements, prepared again on next use. */
static void reset_session(rb_tx *tx)
{
    pg_conn *c = tx->conn;
    if (!tx->user_sql || !c || c->cur || c->dead || c->broken) return;
    pg_op *op = pg_op_new(tx->s, reset_done, c);
    if (!op) { pg_conn_break(c); return; }
    op->sql = "DISCARD ALL";
    c->prepared = 0;
    pg_conn_start_op(c, op);
}

/* The transaction is over: free it, tell the caller, wake local dispatchers after a commit
 * that enqueued. */
static void commit_finish(pg_op *op, const char *err, int committed)
{
    rb_tx *tx = op->tx;
    pg_store *s = tx->s;
    if (s && !s->closed) reset_session(tx);
    int wake = committed && tx->enqueued && s && !s->closed;
    rb_done_cb cb = op->cb.done;
    void *ud = op->ud;
    if (!committed && op->sops) op->sops->applied = 0;
    tx_free(tx);
    op->tx = NULL;
    char *saved = err ? rb_strdup(err) : NULL;
    pg_op_free(op);
    if (cb) cb(ud, err ? (saved ? saved : "postgresql: commit failed") : NULL);
    free(saved);
    if (wake && !s->closed) rb_store_notify_local(&s->base);
}

static void commit_done(pg_op *op, PGresult *res, const char *err)
{
    switch (op->phase) {
    case PH_SETTLE:
        if (!err) pg_settle_apply(op, res);
        if (err) op->saved_err = rb_strdup(err);
        if (err || !op->sops->applied) tx_step(op, PH_ROLLBACK, "ROLLBACK");
        else tx_step(op, PH_COMMIT, "COMMIT");
        return;
    case PH_COMMIT:
        /* COMMIT of a transaction an earlier statement broke answers ROLLBACK, not an error. */
        if (!err && strcmp(PQcmdStatus(res), "COMMIT") != 0)
            err = "postgresql: the transaction was rolled back (an earlier statement failed)";
        commit_finish(op, err, err == NULL);
        return;
    default:
        /* The rollback's own outcome does not matter: a lost connection rolls back too. */
        commit_finish(op, op->saved_err, 0);
        return;
    }
}

void pg_commit(rb_tx *tx, rb_settle_op *complete, rb_done_cb cb, void *ud)
{
    pg_store *s = tx->s;
    if (complete) { complete->applied = 0; complete->lease_expires_at = 0; }
    if (!s) { free(tx); cb(ud, pg_closed_msg); return; }
    pg_op *op = pg_op_new(s, commit_done, ud);
    if (!op) {      /* cannot even ask: drop the connection, which rolls back */
        if (tx->conn) pg_conn_break(tx->conn);
        tx_free(tx);
        cb(ud, "postgresql: out of memory");
        return;
    }
    op->cb.done = cb;
    op->tx = tx;
    pg_store_enter(s);
    if (tx->doomed[0]) {    /* a statement failed: nothing of it commits */
        op->saved_err = rb_strdup(tx->doomed);
        tx_step(op, PH_ROLLBACK, "ROLLBACK");
    } else if (complete) {
        op->sops = complete;
        op->nsops = 1;
        int r = pg_settle_round(op);
        op->phase = PH_SETTLE;
        if (r > 0) tx_submit(tx, op);
        else if (r == 0) tx_step(op, PH_ROLLBACK, "ROLLBACK");    /* names no lease */
        else { op->saved_err = rb_strdup("postgresql: out of memory"); tx_step(op, PH_ROLLBACK, "ROLLBACK"); }
    } else {
        tx_step(op, PH_COMMIT, "COMMIT");
    }
    pg_store_leave(s);
}

static void rollback_done(pg_op *op, PGresult *res, const char *err)
{
    (void)res; (void)err;
    op->phase = PH_ROLLBACK;
    commit_finish(op, NULL, 0);
}

/* cb may be NULL: callers that wait for nothing roll back without one. */
void pg_rollback(rb_tx *tx, rb_done_cb cb, void *ud)
{
    pg_store *s = tx->s;
    if (!s) { free(tx); if (cb) cb(ud, NULL); return; }
    pg_op *op = pg_op_new(s, rollback_done, ud);
    if (!op) {      /* dropping the connection rolls back */
        if (tx->conn) pg_conn_break(tx->conn);
        tx_free(tx);
        if (cb) cb(ud, NULL);
        return;
    }
    op->cb.done = cb;
    op->tx = tx;
    op->sql = "ROLLBACK";
    pg_store_enter(s);
    tx_submit(tx, op);
    pg_store_leave(s);
}

