/* store_pg.c -- the PostgreSQL store: libpq in non-blocking mode, every socket on the host's loop.
 * A small pool of connections (store_pg_pool.c) runs operations (claims are one FOR UPDATE
 * SKIP LOCKED statement, settles are coalesced through unnest), transactions borrow a
 * connection, and one more connection LISTENs for the NOTIFY that every enqueue sends, so idle
 * dispatchers wake at once.
 *
 * Lost connections are dropped and replaced on demand with backoff; the listener reconnects in
 * the background. Only open() blocks (connect and rb_pg_migrate).
 *
 * Enqueueing from plain SQL, in any language (defaults fill the rest; the AFTER INSERT trigger
 * of migration 2 sends the NOTIFY at commit, so idle dispatchers wake at once):
 *   INSERT INTO relaybus_deliveries (topic, payload, max_attempts) VALUES ('mail', '{"to":1}', 5);
 * docs/stores.md has the whole schema. */
#include <ctype.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <libpq-fe.h>
#include "stores/store.h"
#include "util/alloc.h"
#include "util/buf.h"
#include "util/clock.h"
#include "util/fifo.h"
#include "util/timer.h"
#include "util/text.h"
#include "stores/pg/store_pg.h"
#include "stores/pg/store_pg_schema.h"
#include "stores/pg/store_pg_impl.h"
#include "plugin/plugin.h"
#include "util/check.h"
#include "util/hmap.h"

const char pg_closed_msg[] = "postgresql: store closed";


/* ---- small helpers ---------------------------------------------------------------------- */

static void quiet_notice(void *arg, const char *msg) { (void)arg; (void)msg; }

/* Decimal bigint ids only; anything else names no delivery. */

/* Array literals ({"a","b"}, {1,2}) are written into rb_bufs (zeroed, they are empty). */

static void sb_sep(rb_buf *b) { rb_buf_add(b, b->len ? "," : "{", 1); }

static void sb_text(rb_buf *b, const char *s)
{
    sb_sep(b);
    if (!s) { rb_buf_add(b, "NULL", 4); return; }
    rb_buf_add(b, "\"", 1);
    for (const char *p = s; *p;) {
        size_t run = strcspn(p, "\"\\");     /* copied a run at a time, not byte by byte */
        rb_buf_add(b, p, run);
        p += run;
        if (*p) {
            rb_buf_add(b, "\\", 1);
            rb_buf_add(b, p++, 1);
        }
    }
    rb_buf_add(b, "\"", 1);
}

static void sb_num(rb_buf *b, double v, int integer)
{
    char tmp[40];
    /* Whole numbers (most delays are 0) skip the slow floating-point formatting. */
    if (!integer && isfinite(v) && fabs(v) < 1e15 && v == (double)(long long)v) integer = 1;
    int n = integer ? snprintf(tmp, sizeof tmp, "%lld", (long long)v)
                    : snprintf(tmp, sizeof tmp, "%.17g", v);
    sb_sep(b);
    rb_buf_add(b, tmp, (size_t)n);
}

/* Closes the array and hands over its text ("{}" when empty), or NULL when out of memory. */
static char *sb_array(rb_buf *b)
{
    if (!b->len) rb_buf_add(b, "{", 1);
    rb_buf_add(b, "}", 1);
    if (b->failed) { rb_buf_free(b); return NULL; }
    return b->data;
}

/* ---- operations ------------------------------------------------------------------------- */

pg_op *pg_op_new(pg_store *s, pg_done_fn done, void *ud)
{
    pg_op *op = rb_calloc(1, sizeof *op);
    if (!op) return NULL;
    op->s = s;
    op->stmt = -1;
    op->done = done;
    op->ud = ud;
    return op;
}

void pg_op_clear_params(pg_op *op)
{
    for (int i = 0; i < op->nparams; i++) free(op->params[i]);
    free(op->params);
    op->params = NULL;
    op->nparams = 0;
}

int pg_op_alloc_params(pg_op *op, int n)
{
    pg_op_clear_params(op);
    if (n == 0) return 1;
    op->params = rb_calloc((size_t)n, sizeof *op->params);
    if (!op->params) return 0;
    op->nparams = n;
    return 1;
}

/* Sets param i to a copy of v (NULL stays NULL); 0 when out of memory. */
int pg_op_param(pg_op *op, int i, const char *v)
{
    if (!v) return 1;
    op->params[i] = rb_strdup(v);
    return op->params[i] != NULL;
}

static int op_param_num(pg_op *op, int i, double v, int integer)
{
    char tmp[40];
    snprintf(tmp, sizeof tmp, integer ? "%.0f" : "%.17g", v);
    return pg_op_param(op, i, tmp);
}

void pg_op_free(pg_op *op)
{
    if (!op) return;
    pg_op_clear_params(op);
    free(op->sql_owned);
    free(op->map);
    free(op->saved_err);
    free(op->ids);
    free(op);
}

/* Fails every operation of a detached list. */
void pg_fail_list(pg_op *list, const char *err)
{
    while (list) {
        pg_op *next = list->next;
        list->next = NULL;
        list->done(list, NULL, err);
        list = next;
    }
}

/* Callbacks may close the store; it is freed only when the outermost entry unwinds. */
static void store_free(pg_store *s);

void pg_store_enter(pg_store *s) { s->depth++; }

void pg_store_leave(pg_store *s)
{
    RB_ASSERT(s->depth > 0);
    if (--s->depth > 0) return;
    while (s->graveyard) {
        pg_conn *c = s->graveyard;
        s->graveyard = c->next;
        free(c);
    }
    if (s->closed) store_free(s);
}

static void op_submit(pg_store *s, pg_op *op)
{
    if (s->closed) { op->done(op, NULL, pg_closed_msg); return; }
    RB_FIFO_PUSH(&s->ops, op);
    pg_pump(s);
}

/* op_submit from the API: the store is entered, so a callback that closes it frees it only
 * once this call unwinds. */
static void op_submit_now(pg_store *s, pg_op *op)
{
    pg_store_enter(s);
    op_submit(s, op);
    pg_store_leave(s);
}

/* ---- results ---------------------------------------------------------------------------- */

static const char *val(const PGresult *r, int row, int col)
{
    return PQgetisnull(r, row, col) ? NULL : PQgetvalue(r, row, col);
}

/* A count or attempt number from a row: in int range (a hand-written row may hold anything). */
static int int_field(const PGresult *r, int i, int col)
{
    const char *v = val(r, i, col);
    long long x = v ? strtoll(v, NULL, 10) : 0;
    return x < INT_MIN ? INT_MIN : x > INT_MAX ? INT_MAX : (int)x;
}

/* An epoch time from date_part: 'infinity' and NaN become 0 (no time), never a poisoned double. */
static double time_field(const PGresult *r, int i, int col)
{
    const char *v = val(r, i, col);
    double x = v ? rb_decimal_read(v, NULL) : 0;
    return isfinite(x) ? x : 0;
}

/* The columns of a claimed delivery's row and of a record's (RECORD_COLS): COLS, then the
 * claim's c_settled (NULL in a record), the group, and a record's history. */
enum {
    COL_ID, COL_TOPIC, COL_PAYLOAD, COL_KEY, COL_LAST_ERROR, COL_LEASE_TOKEN, COL_STATUS,
    COL_ATTEMPTS, COL_MAX_ATTEMPTS, COL_FENCE, COL_RUN_AT, COL_CREATED_AT, COL_LEASE_EXPIRES_AT,
    COL_SETTLED, COL_GROUP, CLAIM_COLS,
    COL_SETTLED_AT = CLAIM_COLS, COL_PROGRESS, COL_ERRORS, COL_WAITING, RECORD_NCOLS
};

rb_delivery *rb_pg_row_delivery(const PGresult *r, int i)
{
    if (PQnfields(r) < CLAIM_COLS || i < 0 || i >= PQntuples(r)) return NULL;
    int history = PQnfields(r) >= RECORD_NCOLS;
    rb_delivery_texts t = {.id = val(r, i, COL_ID), .topic = val(r, i, COL_TOPIC),
                           .payload = val(r, i, COL_PAYLOAD), .key = val(r, i, COL_KEY),
                           .group = val(r, i, COL_GROUP), .last_error = val(r, i, COL_LAST_ERROR),
                           .lease_token = val(r, i, COL_LEASE_TOKEN),
                           .progress = history ? val(r, i, COL_PROGRESS) : NULL,
                           .errors = history ? val(r, i, COL_ERRORS) : NULL};
    rb_delivery *d = rb_delivery_make(&t);
    if (!d) return NULL;
    if (history) {
        d->settled_at = time_field(r, i, COL_SETTLED_AT);
        d->waiting = int_field(r, i, COL_WAITING);
    }
    int st = rb_status_parse(val(r, i, COL_STATUS));
    d->status = st < 0 ? RB_PENDING : (rb_status)st;
    d->attempts = int_field(r, i, COL_ATTEMPTS);
    d->max_attempts = int_field(r, i, COL_MAX_ATTEMPTS);
    const char *fence = val(r, i, COL_FENCE);
    d->fence = fence ? strtoll(fence, NULL, 10) : 0;
    d->run_at = time_field(r, i, COL_RUN_AT);
    d->created_at = time_field(r, i, COL_CREATED_AT);
    d->lease_expires_at = time_field(r, i, COL_LEASE_EXPIRES_AT);
    return d;
}

/* How long a claim that waited for a claim slot and got it keeps the dispatchers on this store at
 * one claim in flight (rb_claim_result.crowded_until): long enough that a few processes settle at one
 * claim each, which then all find a slot, before they try two again. */
#define CROWDED_HOLD 10.0

/* The claim function's answer (store_pg_schema.c, migration 7) holds four kinds of rows, told
 * apart by c_settled, in this order: the results of the writes it carried (pg_claim_settle),
 * the deliveries it claimed, then its own reports. */
typedef enum {
    CLAIM_ROW_WRITE,        /* c_settled > 0: the write of that ordinal, applied when
                             * c_lease_expires_at (its new expiry) is not NULL */
    CLAIM_ROW_DELIVERY,     /* c_settled NULL: a claimed delivery (rb_pg_row_delivery) */
    CLAIM_ROW_NEXT_DUE,     /* c_settled 0: c_run_at is the seconds until the earliest live
                             * delivery falls due, NULL when none is live (only when asked,
                             * and when the claim took fewer than it might) */
    CLAIM_ROW_WAITED,       /* c_settled -1: the claim got its claim slot only after waiting */
} claim_row_kind;


static claim_row_kind claim_row(const PGresult *res, int i)
{
    if (PQgetisnull(res, i, COL_SETTLED)) return CLAIM_ROW_DELIVERY;
    int k = atoi(PQgetvalue(res, i, COL_SETTLED));
    return k > 0 ? CLAIM_ROW_WRITE : k == 0 ? CLAIM_ROW_NEXT_DUE : CLAIM_ROW_WAITED;
}

/* The records of rows [first, end) of res into *recs (NULL when there are none); -1 when out
 * of memory. */
static int rows_records(const PGresult *res, int first, int end, rb_delivery ***recs)
{
    size_t n = end > first ? (size_t)(end - first) : 0;
    *recs = NULL;
    if (!n) return 0;
    if (!(*recs = rb_calloc(n, sizeof **recs))) return -1;
    for (size_t i = 0; i < n; i++) {
        if (!((*recs)[i] = rb_pg_row_delivery(res, first + (int)i))) {
            rb_delivery_list_free(*recs, i);
            *recs = NULL;
            return -1;
        }
    }
    return 0;
}

/* Calls a records callback with the rows of res (ownership passes). */
static void deliver_records(pg_op *op, PGresult *res, const char *err)
{
    rb_delivery **recs = NULL;
    if (!err && rows_records(res, 0, PQntuples(res), &recs) != 0) err = "postgresql: out of memory";
    if (err) op->cb.records(op->ud, err, NULL, 0);
    else op->cb.records(op->ud, NULL, recs, (size_t)PQntuples(res));
}

/* Answers a claim from the rows of res from `first` on (the carried writes' results come
 * before): its deliveries, and what its reports say. The next-due report counts only when
 * the listener was listening from the claim's making to its answer: a NOTIFY missed
 * meanwhile could be of a delivery due sooner. */
static void answer_claim(pg_op *op, PGresult *res, int first, const char *err)
{
    pg_store *s = op->s;
    rb_claim_result r = {.listener = s->listen_epoch};
    int end = PQntuples(res);
    for (int i = end - 1; !err && i >= first && PQnfields(res) >= CLAIM_COLS; i--) {
        claim_row_kind kind = claim_row(res, i);
        if (kind == CLAIM_ROW_DELIVERY || kind == CLAIM_ROW_WRITE) break;
        end = i;
        if (kind == CLAIM_ROW_WAITED) {
            r.crowded_until = rb_monotonic() + CROWDED_HOLD;
        } else if (!op->heard_epoch || op->heard_epoch != s->listen_epoch) {
            continue;
        } else if (PQgetisnull(res, i, COL_RUN_AT)) {
            r.quiet_until = INFINITY;       /* nothing live: only a NOTIFY brings work */
        } else {
            /* (+-Infinity: a run_at of 'infinity' or '-infinity'; beyond 100 years: as none) */
            double in = strtod(PQgetvalue(res, i, COL_RUN_AT), NULL);
            if (in >= RB_MAX_SECONDS) r.quiet_until = INFINITY;
            else if (in > 0) r.quiet_until = op->made_at + in;
        }
    }
    /* (what the server sent is checked, not asserted: a claim function of another version
     * may answer in another order) */
    for (int i = first; !err && i < end && PQnfields(res) >= CLAIM_COLS; i++)
        if (claim_row(res, i) != CLAIM_ROW_DELIVERY)
            err = "postgresql: the claim function returned its rows out of order";
    if (!err && rows_records(res, first, end, &r.recs) != 0) err = "postgresql: out of memory";
    if (err) {
        op->cb.claim(op->ud, err, NULL);
        return;
    }
    r.n = (size_t)(end - first);
    op->cb.claim(op->ud, NULL, &r);
}

static void claim_done(pg_op *op, PGresult *res, const char *err)
{
    answer_claim(op, res, 0, err);
    pg_op_free(op);
}

static void records_done(pg_op *op, PGresult *res, const char *err)
{
    deliver_records(op, res, err);
    pg_op_free(op);
}

void pg_count_done(pg_op *op, PGresult *res, const char *err)
{
    if (err) op->cb.count(op->ud, err, 0);
    else op->cb.count(op->ud, NULL, strtoll(PQcmdTuples(res), NULL, 10));
    pg_op_free(op);
}

static void stats_done(pg_op *op, PGresult *res, const char *err)
{
    if (!err && (PQntuples(res) != 1 || PQnfields(res) < 9)) err = "postgresql: stats returned no row";
    if (err) { op->cb.stats(op->ud, err, NULL); pg_op_free(op); return; }
    rb_stats st = {
        .pending = strtoll(PQgetvalue(res, 0, 0), NULL, 10),
        .processing = strtoll(PQgetvalue(res, 0, 1), NULL, 10),
        .completed = strtoll(PQgetvalue(res, 0, 2), NULL, 10),
        .buried = strtoll(PQgetvalue(res, 0, 3), NULL, 10),
        .cancelled = strtoll(PQgetvalue(res, 0, 4), NULL, 10),
        .due = strtoll(PQgetvalue(res, 0, 5), NULL, 10),
        .oldest_due_age = strtod(PQgetvalue(res, 0, 6), NULL),
        .stalled = strtoll(PQgetvalue(res, 0, 7), NULL, 10),
        .completed_estimated = PQgetvalue(res, 0, 8)[0] == 't',
    };
    op->cb.stats(op->ud, NULL, &st);
    pg_op_free(op);
}

static void lease_done(pg_op *op, PGresult *res, const char *err)
{
    if (err) op->cb.lease(op->ud, err, 0, 0);
    else if (PQntuples(res) < 1) op->cb.lease(op->ud, NULL, 0, 0);
    else op->cb.lease(op->ud, NULL, 1, strtod(PQgetvalue(res, 0, 0), NULL));
    pg_op_free(op);
}

/* ---- enqueue ---------------------------------------------------------------------------- */

/* hold: let the enqueue hold a grouped delivery behind its group's live one (ENQ_GROUPED in
 * store_pg_schema.c); not inside a user's transaction, whose end it would have to wait for. */
static int enqueue_params(pg_op *op, const rb_enqueue_item *items, size_t n, int hold)
{
    rb_buf a[7] = {{0}};
    for (size_t i = 0; i < n; i++) {
        sb_text(&a[0], items[i].topic);
        sb_text(&a[1], items[i].payload);
        sb_text(&a[2], items[i].key);
        sb_num(&a[3], items[i].run_at, 0);
        sb_num(&a[4], items[i].delay, 0);
        sb_num(&a[5], items[i].max_attempts, 1);
        sb_text(&a[6], items[i].group);
    }
    rb_buf replace = {0};
    for (size_t i = 0; i < n; i++) {
        sb_sep(&replace);
        rb_buf_add(&replace, items[i].replace ? "t" : "f", 1);
    }
    /* dependencies: per item its ids joined by commas (each checked: the cast to bigint
     * would fail the whole statement on one that is not an id) */
    int with_after = 0;
    for (size_t i = 0; i < n; i++) with_after |= items[i].nafter > 0;
    rb_buf after = {0};
    for (size_t i = 0; with_after && i < n; i++) {
        rb_buf ids = {0};
        for (size_t k = 0; k < items[i].nafter; k++) {
            if (!rb_decimal_id(items[i].after[k])) {
                rb_one_line(op->bad_after, sizeof op->bad_after, items[i].after[k]);
                rb_buf_free(&ids);
                rb_buf_free(&after);
                return 0;
            }
            if (k) rb_buf_add(&ids, ",", 1);
            rb_buf_puts(&ids, items[i].after[k]);
        }
        if (ids.failed) { rb_buf_free(&ids); rb_buf_free(&after); return 0; }
        sb_text(&after, items[i].nafter ? ids.data : NULL);
        rb_buf_free(&ids);
    }
    int ok = pg_op_alloc_params(op, with_after ? 10 : 9);
    char *text = sb_array(&replace);
    if (!text || !ok) { free(text); ok = 0; }
    else op->params[8] = text;
    if (with_after) {
        char *list = sb_array(&after);
        if (!list || !ok) { free(list); ok = 0; }
        else op->params[9] = list;
    }
    for (int i = 0; i < 7; i++) {
        char *text = sb_array(&a[i]);
        if (!text || !ok) { free(text); ok = 0; continue; }
        op->params[i] = text;
    }
    ok = ok && pg_op_param(op, 7, hold ? "true" : "false");
    op->stmt = with_after ? ST_ENQ_AFTER : ST_ENQ;
    op->expect = n;
    /* Once the rows are committed the answer must not fail for want of memory: the caller
     * would enqueue them again. */
    if (ok && !(op->ids = rb_calloc(1, n * (sizeof *op->ids + 1)))) ok = 0;
    if (ok) op->kept = (unsigned char *)(op->ids + n);
    return ok;
}

static void enqueue_done(pg_op *op, PGresult *res, const char *err)
{
    pg_store *s = op->s;
    size_t n = err ? 0 : (size_t)PQntuples(res);
    if (!err && n != op->expect) err = "postgresql: enqueue returned a different number of ids";
    if (!err && n && PQnfields(res) < 2) err = "postgresql: enqueue returned too few columns";
    if (err) { op->cb.ids(op->ud, err, NULL, NULL, 0); pg_op_free(op); return; }
    char **ids = op->ids;       /* n == op->expect ids fit */
    unsigned char *kept = op->kept;
    for (size_t i = 0; i < n; i++) {
        ids[i] = PQgetvalue(res, (int)i, 0);
        kept[i] = PQgetvalue(res, (int)i, 1)[0] == 't';
    }
    if (op->tx) op->tx->enqueued = 1;  /* wakes this process when the transaction commits */
    int local = !op->tx;
    op->cb.ids(op->ud, NULL, ids, kept, n);
    if (local && !s->closed) rb_store_notify_local(&s->base);
    pg_op_free(op);
}

/* Builds an enqueue operation, or reports why it cannot be built; NULL then. */
pg_op *pg_enqueue_op(pg_store *s, const rb_enqueue_item *items, size_t n, int hold, rb_ids_cb cb,
                     void *ud)
{
    if (n == 0) { cb(ud, NULL, NULL, NULL, 0); return NULL; }
    pg_op *op = pg_op_new(s, enqueue_done, ud);
    if (op) op->cb.ids = cb;
    if (!op || !enqueue_params(op, items, n, hold)) {
        char msg[120] = "postgresql: out of memory";
        if (op && op->bad_after[0])
            snprintf(msg, sizeof msg, "postgresql: after: '%s' is no id of this store", op->bad_after);
        pg_op_free(op);
        cb(ud, msg, NULL, NULL, 0);
        return NULL;
    }
    return op;
}

static void pg_enqueue(rb_store *bs, const rb_enqueue_item *items, size_t n, rb_ids_cb cb, void *ud)
{
    pg_store *s = (pg_store *)bs;
    pg_op *op = pg_enqueue_op(s, items, n, 1, cb, ud);
    if (!op) return;
    op_submit_now(s, op);
}

/* ---- claim and settle ------------------------------------------------------------------- */

/* The claim's parameters: $1-$4 of ST_CLAIM (its $5-$9, the settles it carries, stay NULL
 * unless settle_round fills them). 0 when out of memory. */
static int claim_params(pg_op *op, const rb_claim_req *req)
{
    rb_buf topics = {0};
    for (size_t i = 0; i < req->ntopics; i++) sb_text(&topics, req->topics[i]);
    char *arr = sb_array(&topics);
    if (!arr || !pg_op_alloc_params(op, 9)) { free(arr); return 0; }
    op->params[0] = arr;
    /* One token for the whole batch, as on SQLite: the fence is (id, token), and a token
     * drawn per row cost the server a strong random number per row. */
    char token[33];
    rb_random_token(token);
    op->stmt = ST_CLAIM;
    op->made_at = rb_monotonic();
    op->heard_epoch = op->s->listen_epoch & 1 ? op->s->listen_epoch : 0;
    return op_param_num(op, 1, (double)req->limit, 1) &&
           op_param_num(op, 2, req->lease_duration, 0) &&
           pg_op_param(op, 3, token);
}

static void pg_claim(rb_store *bs, const rb_claim_req *req, rb_claim_cb cb, void *ud)
{
    pg_store *s = (pg_store *)bs;
    if (req->ntopics == 0 || req->limit == 0) {
        rb_claim_result none = {.listener = s->listen_epoch};
        cb(ud, NULL, &none);
        return;
    }
    pg_op *op = pg_op_new(s, claim_done, ud);
    if (!op || !claim_params(op, req)) {
        pg_op_free(op);
        cb(ud, "postgresql: out of memory", NULL);
        return;
    }
    op->cb.claim = cb;
    op_submit_now(s, op);
}

/* Prepares the next round of fenced writes: as many ops as can share one UPDATE (no id twice,
 * so each sees the previous one's effect, as if applied in order), as five arrays in
 * op->params[first .. first + 5). With first 0 the op becomes an ST_SETTLE of its own; above,
 * the caller has made room (a claim carrying them). 0 when none are left.
 * Ids already in the round live in a small open-addressing set of numbers made for the
 * round (a batch holds hundreds of ops, and comparing each with all before it cost more than
 * building the statement); not util/hmap.h, whose members are records that outlive a call. */
static int settle_round(pg_op *op, int first)
{
    /* Nothing left (the usual answer after the last round): said without allocating, so a
     * batch whose writes were all applied is never reported as failed. */
    if (op->round_end >= op->nsops) return 0;
    rb_buf a[5] = {{0}};
    size_t k = 0, i = op->round_end;
    size_t cap = 16;
    while (cap < 2 * (op->nsops - i)) cap *= 2;
    unsigned long long *seen = rb_calloc(cap, sizeof *seen);   /* id + 1; 0 is empty */
    free(op->map);
    op->map = rb_malloc(sizeof *op->map * (op->nsops - i + 1));
    if (!op->map || !seen) { free(seen); return -1; }
    for (; i < op->nsops; i++) {
        rb_settle_op *so = &op->sops[i];
        if (!rb_decimal_id(so->id) || !so->token) continue;     /* names nothing: not applied */
        unsigned long long key = strtoull(so->id, NULL, 10) + 1;
        size_t h = (size_t)rb_hash_u64(key) & (cap - 1);
        while (seen[h] && seen[h] != key) h = (h + 1) & (cap - 1);
        if (seen[h]) break;                                 /* twice: the next round */
        seen[h] = key;
        op->map[k++] = i;
        sb_sep(&a[0]);
        rb_buf_add(&a[0], so->id, strlen(so->id));
        sb_text(&a[1], so->token);
        sb_num(&a[2], so->kind, 1);
        sb_num(&a[3], so->delay, 0);
        sb_text(&a[4], so->kind == RB_OP_RESCHEDULE || so->kind == RB_OP_BURY ? so->error : NULL);
    }
    free(seen);
    op->round_end = i;
    op->nmap = k;
    int ok = k > 0 && (first > 0 || pg_op_alloc_params(op, 5));
    for (int j = 0; j < 5; j++) {
        char *text = sb_array(&a[j]);
        if (ok && text) op->params[first + j] = text;
        else { free(text); ok = 0; }
    }
    if (first == 0) op->stmt = ST_SETTLE;
    return k == 0 ? 0 : ok ? 1 : -1;
}

int pg_settle_round(pg_op *op) { return settle_round(op, 0); }

/* Records the result of the write numbered `ord` (1-based, in the round) of op. */
static void settle_result(pg_op *op, const char *ord_text, const char *expires_text)
{
    long ord = strtol(ord_text, NULL, 10);
    if (ord < 1 || (size_t)ord > op->nmap) return;
    rb_settle_op *so = &op->sops[op->map[ord - 1]];
    so->applied = 1;
    so->lease_expires_at = so->kind == RB_OP_EXTEND ? strtod(expires_text, NULL) : 0;
}

void pg_settle_apply(pg_op *op, const PGresult *res)
{
    for (int r = 0; r < PQntuples(res); r++)
        settle_result(op, PQgetvalue(res, r, 0), PQgetvalue(res, r, 1));
}

static void settle_done(pg_op *op, PGresult *res, const char *err)
{
    if (!err) {
        pg_settle_apply(op, res);
        int more = pg_settle_round(op);
        if (more > 0) { op->sent = 0; op_submit(op->s, op); return; }
        if (more < 0) err = "postgresql: out of memory";
    }
    op->cb.done(op->ud, err);
    pg_op_free(op);
}

/* A settle op for ops[0..n) that starts at round `from`: NULL out of memory. */
static pg_op *settle_op_new(pg_store *s, rb_settle_op *ops, size_t n, size_t from, rb_done_cb cb,
                            void *ud)
{
    pg_op *op = pg_op_new(s, settle_done, ud);
    if (!op) return NULL;
    op->cb.done = cb;
    op->sops = ops;
    op->nsops = n;
    op->round_end = from;
    return op;
}

/* Sends the rounds of op's writes from op->round_end on; cb(ud, err) when all are done. */
static void settle_rest(pg_store *s, rb_settle_op *ops, size_t n, size_t from, rb_done_cb cb,
                        void *ud)
{
    pg_op *op = settle_op_new(s, ops, n, from, cb, ud);
    int r = op ? pg_settle_round(op) : -1;
    if (r <= 0) {
        pg_op_free(op);
        cb(ud, r < 0 ? "postgresql: out of memory" : NULL);
        return;
    }
    op_submit_now(s, op);
}

static void pg_settle(rb_store *bs, rb_settle_op *ops, size_t n, rb_done_cb cb, void *ud)
{
    for (size_t i = 0; i < n; i++) { ops[i].applied = 0; ops[i].lease_expires_at = 0; }
    settle_rest((pg_store *)bs, ops, n, 0, cb, ud);
}

/* The claim that carried settles: its first rows are the writes' results (c_settled, the
 * 14th column, not NULL), the rest the deliveries. The writes' further rounds, if any, go out
 * as a settle of their own. When the statement failed the writes are sent again alone: the
 * failure may be the claim's (a topic the server refuses, a timeout), and a claim that keeps
 * failing must not take the settles of healthy runs down with it. */
static void claim_settle_done(pg_op *op, PGresult *res, const char *err)
{
    int first = 0;
    if (!err && PQnfields(res) < CLAIM_COLS)
        err = "postgresql: the claim function returned too few columns";
    if (err) {
        settle_rest(op->s, op->sops, op->nsops, 0, op->settle_cb, op->settle_ud);
    } else {
        for (; first < PQntuples(res) && claim_row(res, first) == CLAIM_ROW_WRITE; first++)
            settle_result(op, PQgetvalue(res, first, COL_SETTLED),
                          PQgetvalue(res, first, COL_LEASE_EXPIRES_AT));
        if (op->round_end >= op->nsops) op->settle_cb(op->settle_ud, NULL);
        else settle_rest(op->s, op->sops, op->nsops, op->round_end, op->settle_cb, op->settle_ud);
    }
    answer_claim(op, res, first, err);
    pg_op_free(op);
}

/* One statement for a claim and the fenced writes of the batch before it. */
static void pg_claim_settle(rb_store *bs, const rb_claim_req *req, rb_claim_cb cb, void *ud,
                            rb_settle_op *ops, size_t n, rb_done_cb settle_cb, void *settle_ud)
{
    pg_store *s = (pg_store *)bs;
    for (size_t i = 0; i < n; i++) { ops[i].applied = 0; ops[i].lease_expires_at = 0; }
    pg_op *op = req->ntopics && req->limit ? pg_op_new(s, claim_settle_done, ud) : NULL;
    int r = -1;
    if (op && claim_params(op, req)) {
        op->sops = ops;
        op->nsops = n;
        r = settle_round(op, 4);
    }
    /* nothing to claim or to carry, or out of memory: each goes its own way */
    if (r <= 0) {
        pg_op_free(op);
        pg_settle(bs, ops, n, settle_cb, settle_ud);
        pg_claim(bs, req, cb, ud);
        return;
    }
    op->cb.claim = cb;
    op->settle_cb = settle_cb;
    op->settle_ud = settle_ud;
    op_submit_now(s, op);
}

/* ---- get, list, stats, kick, purge -------------------------------------------------------- */

/* Builds an ad hoc operation: `nparams` parameters filled by the caller. */
static pg_op *op_adhoc(pg_store *s, const char *sql, int nparams, pg_done_fn done, void *ud)
{
    pg_op *op = pg_op_new(s, done, ud);
    if (!op) return NULL;
    op->sql = sql;
    if (!pg_op_alloc_params(op, nparams)) { pg_op_free(op); return NULL; }
    return op;
}

static void pg_get(rb_store *bs, const char *id, rb_records_cb cb, void *ud)
{
    pg_store *s = (pg_store *)bs;
    if (!rb_decimal_id(id)) { cb(ud, NULL, NULL, 0); return; }
    pg_op *op = op_adhoc(s, NULL, 1, records_done, ud);
    if (!op || !pg_op_param(op, 0, id)) { pg_op_free(op); cb(ud, "postgresql: out of memory", NULL, 0); return; }
    op->stmt = ST_GET;
    op->cb.records = cb;
    op_submit_now(s, op);
}

static void pg_list(rb_store *bs, const rb_list_req *req, rb_records_cb cb, void *ud)
{
    pg_store *s = (pg_store *)bs;
    const char *after = req->newest_first ? req->after : NULL;
    if (after && !rb_decimal_id(after)) { cb(ud, NULL, NULL, 0); return; }   /* an empty page */
    pg_op *op = op_adhoc(s, req->newest_first ? s->sql_list_page : s->sql_list, 7,
                         records_done, ud);
    if (!op || !pg_op_param(op, 0, req->status) || !pg_op_param(op, 1, req->topic) ||
        !op_param_num(op, 2, req->limit ? (double)req->limit : 100, 1) ||
        !pg_op_param(op, 3, after) || !pg_op_param(op, 4, req->key) ||
        !pg_op_param(op, 5, req->topic_prefix) || !pg_op_param(op, 6, req->error_text)) {
        pg_op_free(op);
        cb(ud, "postgresql: out of memory", NULL, 0);
        return;
    }
    op->cb.records = cb;
    op_submit_now(s, op);
}

static void pg_stats(rb_store *bs, rb_stats_cb cb, void *ud)
{
    pg_store *s = (pg_store *)bs;
    pg_op *op = op_adhoc(s, s->sql_stats, 0, stats_done, ud);
    if (!op) { cb(ud, "postgresql: out of memory", NULL); return; }
    op->cb.stats = cb;
    op_submit_now(s, op);
}

static void pg_kick(rb_store *bs, rb_kick_mode mode, const char *id, const char *topic,
                    rb_count_cb cb, void *ud)
{
    pg_store *s = (pg_store *)bs;
    if (mode == RB_KICK_ONE && !rb_decimal_id(id)) { cb(ud, NULL, 0); return; }
    pg_op *op = op_adhoc(s, s->sql_kick, 2, pg_count_done, ud);
    if (!op || !pg_op_param(op, 0, mode == RB_KICK_ONE ? id : NULL) ||
        !pg_op_param(op, 1, mode == RB_KICK_ONE ? NULL : topic)) {
        pg_op_free(op);
        cb(ud, "postgresql: out of memory", 0);
        return;
    }
    op->cb.count = cb;
    op_submit_now(s, op);
}

static void pg_purge(rb_store *bs, const char *status, const char *topic, double older_than,
                     size_t limit, rb_count_cb cb, void *ud)
{
    pg_store *s = (pg_store *)bs;
    if (!rb_settled_status(status)) {
        cb(ud, "postgresql: purge deletes only completed, buried or cancelled deliveries", 0);
        return;
    }
    pg_op *op = op_adhoc(s, s->sql_purge, 4, pg_count_done, ud);
    if (!op || !pg_op_param(op, 0, status) || !op_param_num(op, 1, older_than, 0) ||
        (limit && !op_param_num(op, 2, (double)limit, 1)) || !pg_op_param(op, 3, topic)) {
        pg_op_free(op);
        cb(ud, "postgresql: out of memory", 0);
        return;
    }
    op->cb.count = cb;
    op_submit_now(s, op);
}

/* ---- named leases ----------------------------------------------------------------------- */

static void pg_lease(rb_store *base, rb_lease_op kind, const char *name, const char *token,
                     double duration, rb_lease_cb cb, void *ud)
{
    static const int stmts[] = {[RB_LEASE_ACQUIRE] = ST_LACQ, [RB_LEASE_EXTEND] = ST_LEXT,
                                [RB_LEASE_RELEASE] = ST_LREL};
    pg_store *s = (pg_store *)base;
    int stmt = stmts[kind];
    pg_op *op = op_adhoc(s, NULL, stmt == ST_LREL ? 2 : 3, lease_done, ud);
    if (!op || !pg_op_param(op, 0, name) || !pg_op_param(op, 1, token) ||
        (stmt != ST_LREL && !op_param_num(op, 2, duration, 0))) {
        pg_op_free(op);
        cb(ud, "postgresql: out of memory", 0, 0);
        return;
    }
    op->stmt = stmt;
    op->cb.lease = cb;
    op_submit_now(s, op);
}

/* ---- close ------------------------------------------------------------------------------ */

static void store_free(pg_store *s)
{
    for (int i = 0; i < ST_COUNT; i++) free(s->stmt_sql[i]);
    free(s->sql_list);
    free(s->sql_list_page);
    free(s->sql_bury_one);
    free(s->sql_cancel_one);
    free(s->sql_cancel_all);
    free(s->sql_table_large);
    free(s->sql_topic_stats_large);
    free(s->sql_progress);
    free(s->sql_delete_one);
    free(s->sql_topic_stats);
    free(s->sql_pending_topics);
    free(s->sql_schedule_set);
    free(s->sql_unschedule);
    free(s->sql_schedules);
    free(s->sql_schedule_fire);
    free(s->sql_pause);
    free(s->sql_resume);
    free(s->sql_paused);
    free(s->sql_limit_set);
    free(s->sql_limit_clear);
    free(s->sql_limits);
    free(s->sql_stats);
    free(s->sql_kick);
    free(s->sql_purge);
    free(s->conninfo);
    rb_store_release_dispatch(&s->base);
    free(s->base.table);
    free(s);
}

static void pg_close(rb_store *bs)
{
    pg_store *s = (pg_store *)bs;
    if (s->closed) return;
    pg_store_enter(s);
    s->closed = 1;
    if (s->retry_on) rb_timer_stop(s->base.loop, &s->retry);
    s->retry_on = 0;
    pg_listen_stop(s);
    /* Transactions the caller still holds end with "store closed" at commit or rollback. */
    for (rb_tx *tx = s->txs; tx; tx = tx->next) tx->s = NULL;
    s->txs = NULL;
    pg_op *failed = NULL, **tail = &failed;
    while (s->conns) {
        pg_conn *c = s->conns;
        if (c->cur) { *tail = c->cur; tail = &c->cur->next; c->cur->next = NULL; c->cur = NULL; }
        RB_FIFO_TAKE_ALL(&c->q, tail);
        while (*tail) tail = &(*tail)->next;
        if (c->tx) c->tx->conn = NULL;
        c->tx = NULL;
        pg_conn_bury(c);
    }
    RB_FIFO_TAKE_ALL(&s->ops, tail);
    while (*tail) tail = &(*tail)->next;
    RB_FIFO_TAKE_ALL(&s->begins, tail);
    pg_fail_list(failed, pg_closed_msg);
    pg_store_leave(s);
}

/* ---- open (blocking) ------------------------------------------------------------------- */

/* The statements, with the table named in the schema where open found it. */
static int build_sql(pg_store *s, const char *schema)
{
    const char *t = s->base.table;
#define Q(tpl) rb_pg_subst_qualified((tpl), schema, t)
    for (int i = 0; i < ST_COUNT; i++)
        if (!(s->stmt_sql[i] = Q(rb_pg_stmt_templates[i]))) return 0;
    return (s->sql_list = Q(rb_pg_sql_list)) && (s->sql_stats = Q(rb_pg_sql_stats)) &&
           (s->sql_kick = Q(rb_pg_sql_kick)) && (s->sql_purge = Q(rb_pg_sql_purge)) &&
           (s->sql_list_page = Q(rb_pg_sql_list_page)) &&
           (s->sql_bury_one = Q(rb_pg_sql_bury_one)) &&
           (s->sql_cancel_one = Q(rb_pg_sql_cancel_one)) &&
           (s->sql_cancel_all = Q(rb_pg_sql_cancel_all)) &&
           (s->sql_table_large = Q(rb_pg_sql_table_large)) &&
           (s->sql_topic_stats_large = Q(rb_pg_sql_topic_stats_large)) &&
           (s->sql_progress = Q(rb_pg_sql_progress)) &&
           (s->sql_delete_one = Q(rb_pg_sql_delete_one)) &&
           (s->sql_topic_stats = Q(rb_pg_sql_topic_stats)) &&
           (s->sql_pending_topics = Q(rb_pg_sql_pending_topics)) &&
           (s->sql_pause = Q(rb_pg_sql_pause)) && (s->sql_resume = Q(rb_pg_sql_resume)) &&
           (s->sql_paused = Q(rb_pg_sql_paused)) && (s->sql_limit_set = Q(rb_pg_sql_limit_set)) &&
           (s->sql_limit_clear = Q(rb_pg_sql_limit_clear)) && (s->sql_limits = Q(rb_pg_sql_limits)) &&
           (s->sql_schedule_set = Q(rb_pg_sql_schedule_set)) &&
           (s->sql_unschedule = Q(rb_pg_sql_unschedule)) &&
           (s->sql_schedules = Q(rb_pg_sql_schedules)) &&
           (s->sql_schedule_fire = Q(rb_pg_sql_schedule_fire));
#undef Q
}

/* ---- for operators: topic stats, bury one, delete one, pauses ------------------------ */
/* A statement of rows per topic whose one parameter is RB_TOPIC_STATS_MAX, their limit. */
static void topic_rows(pg_store *s, const char *sql, rb_rows_cb cb, void *ud)
{
    pg_op *op = op_adhoc(s, sql, 1, pg_rows_done, ud);
    if (!op || !op_param_num(op, 0, RB_TOPIC_STATS_MAX, 1)) {
        pg_op_free(op);
        cb(ud, "postgresql: out of memory", NULL);
        return;
    }
    op->cb.rows = cb;
    op_submit_now(s, op);
}

/* The table's size is known: the counts per topic of its form (rb_pg_sql_topic_stats). */
static void table_large_done(pg_op *op, PGresult *res, const char *err)
{
    pg_store *s = op->s;
    rb_rows_cb cb = op->cb.rows;
    void *ud = op->ud;
    int large = !err && PQntuples(res) == 1 && PQgetvalue(res, 0, 0)[0] == 't';
    if (err) {
        cb(ud, err, NULL);
        pg_op_free(op);
        return;
    }
    pg_op_free(op);
    topic_rows(s, large ? s->sql_topic_stats_large : s->sql_topic_stats, cb, ud);
}

static void pg_topic_stats(rb_store *bs, rb_rows_cb cb, void *ud)
{
    pg_store *s = (pg_store *)bs;
    pg_op *op = op_adhoc(s, s->sql_table_large, 0, table_large_done, ud);
    if (!op) { cb(ud, "postgresql: out of memory", NULL); return; }
    op->cb.rows = cb;
    op_submit_now(s, op);
}

static void pg_pending_topics(rb_store *bs, size_t scan_max, rb_rows_cb cb, void *ud)
{
    pg_store *s = (pg_store *)bs;
    pg_op *op = op_adhoc(s, s->sql_pending_topics, 2, pg_rows_done, ud);
    if (!op || !op_param_num(op, 0, (double)rb_scan_bound(scan_max), 1) ||
        !op_param_num(op, 1, RB_TOPIC_STATS_MAX, 1)) {
        pg_op_free(op);
        cb(ud, "postgresql: out of memory", NULL);
        return;
    }
    op->cb.rows = cb;
    op_submit_now(s, op);
}

static void one_op(pg_store *s, const char *sql, const char *id, const char *reason, int np,
                   rb_count_cb cb, void *ud)
{
    if (!rb_decimal_id(id)) { cb(ud, NULL, 0); return; }
    pg_op *op = op_adhoc(s, sql, np, pg_count_done, ud);
    if (!op || !pg_op_param(op, 0, id) || (np > 1 && !pg_op_param(op, 1, reason))) {
        pg_op_free(op);
        cb(ud, "postgresql: out of memory", 0);
        return;
    }
    op->cb.count = cb;
    op_submit_now(s, op);
}

static void pg_bury(rb_store *bs, const char *id, const char *reason, rb_count_cb cb, void *ud)
{
    pg_store *s = (pg_store *)bs;
    one_op(s, s->sql_bury_one, id, reason, 2, cb, ud);
}

/* This process's dispatchers hear of the run it cancelled at once (the NOTIFY tells the
 * others, and this one again: aborting an aborted run does nothing). */
static void cancel_done(pg_op *op, PGresult *res, const char *err)
{
    if (!err && PQntuples(res) == 1 && !PQgetisnull(res, 0, 1))
        rb_store_cancelled(&op->s->base, PQgetvalue(res, 0, 0), PQgetvalue(res, 0, 1));
    if (err) op->cb.count(op->ud, err, 0);
    else op->cb.count(op->ud, NULL, PQntuples(res));
    pg_op_free(op);
}

static void pg_cancel(rb_store *bs, const char *id, const char *reason, rb_count_cb cb, void *ud)
{
    pg_store *s = (pg_store *)bs;
    if (!rb_decimal_id(id)) { cb(ud, NULL, 0); return; }
    pg_op *op = op_adhoc(s, s->sql_cancel_one, 3, cancel_done, ud);
    if (!op || !pg_op_param(op, 0, id) || !pg_op_param(op, 1, reason) ||
        !pg_op_param(op, 2, s->base.table)) {
        pg_op_free(op);
        cb(ud, "postgresql: out of memory", 0);
        return;
    }
    op->cb.count = cb;
    op_submit_now(s, op);
}

/* The runs a cancel_all took the leases of: this process's dispatchers hear of them at once
 * (the NOTIFY tells the others). count: the deliveries it cancelled. */
static void cancel_all_done(pg_op *op, PGresult *res, const char *err)
{
    int n = err ? 0 : PQntuples(res);
    for (int i = 0; i < n; i++)
        if (!PQgetisnull(res, i, 1))
            rb_store_cancelled(&op->s->base, PQgetvalue(res, i, 0), PQgetvalue(res, i, 1));
    op->cb.count(op->ud, err, n);
    pg_op_free(op);
}

static void pg_cancel_all(rb_store *bs, const char *status, const char *topic,
                          const char *reason, rb_count_cb cb, void *ud)
{
    pg_store *s = (pg_store *)bs;
    if (status && !rb_live_status(status)) {
        cb(ud, "postgresql: cancel takes status pending or processing", 0);
        return;
    }
    pg_op *op = op_adhoc(s, s->sql_cancel_all, 4, cancel_all_done, ud);
    if (!op || !pg_op_param(op, 0, status) || !pg_op_param(op, 1, topic) ||
        !pg_op_param(op, 2, reason) || !pg_op_param(op, 3, s->base.table)) {
        pg_op_free(op);
        cb(ud, "postgresql: out of memory", 0);
        return;
    }
    op->cb.count = cb;
    op_submit_now(s, op);
}

static void pg_progress(rb_store *bs, rb_tx *tx, const char *id, const char *token,
                        const char *json, rb_count_cb cb, void *ud)
{
    (void)tx;       /* written apart, at once: the run's transaction holds no lock on the row */
    pg_store *s = (pg_store *)bs;
    if (!rb_decimal_id(id)) { cb(ud, NULL, 0); return; }
    pg_op *op = op_adhoc(s, s->sql_progress, 3, pg_count_done, ud);
    if (!op || !pg_op_param(op, 0, id) || !pg_op_param(op, 1, token) || !pg_op_param(op, 2, json)) {
        pg_op_free(op);
        cb(ud, "postgresql: out of memory", 0);
        return;
    }
    op->cb.count = cb;
    op_submit_now(s, op);
}

static void pg_remove(rb_store *bs, const char *id, rb_count_cb cb, void *ud)
{
    pg_store *s = (pg_store *)bs;
    one_op(s, s->sql_delete_one, id, NULL, 1, cb, ud);
}

static void pg_pause(rb_store *bs, const char *topic, int paused, rb_count_cb cb, void *ud)
{
    pg_store *s = (pg_store *)bs;
    pg_op *op = op_adhoc(s, paused ? s->sql_pause : s->sql_resume, paused ? 1 : 2,
                         pg_count_done, ud);
    if (!op || !pg_op_param(op, 0, topic ? topic : "") ||
        (!paused && !pg_op_param(op, 1, s->base.table))) {
        pg_op_free(op);
        cb(ud, "postgresql: out of memory", 0);
        return;
    }
    op->cb.count = cb;
    op_submit_now(s, op);
}

static void pg_paused(rb_store *bs, rb_rows_cb cb, void *ud)
{
    topic_rows((pg_store *)bs, ((pg_store *)bs)->sql_paused, cb, ud);
}

static void pg_limit(rb_store *bs, const char *topic, const rb_limit *lim, rb_count_cb cb, void *ud)
{
    pg_store *s = (pg_store *)bs;
    if (lim && !rb_limit_valid(lim)) { cb(ud, "postgresql: limit: bad limits", 0); return; }
    pg_op *op = op_adhoc(s, lim ? s->sql_limit_set : s->sql_limit_clear, lim ? 5 : 2,
                         pg_count_done, ud);
    int ok = op && pg_op_param(op, 0, topic ? topic : "") &&
             pg_op_param(op, lim ? 4 : 1, s->base.table);
    if (ok && lim && lim->rate > 0)
        ok = op_param_num(op, 1, (double)lim->rate, 1) && op_param_num(op, 2, lim->per, 0);
    if (ok && lim && lim->concurrency > 0) ok = op_param_num(op, 3, (double)lim->concurrency, 1);
    if (!ok) {
        pg_op_free(op);
        cb(ud, "postgresql: out of memory", 0);
        return;
    }
    op->cb.count = cb;
    op_submit_now(s, op);
}

static void pg_limits(rb_store *bs, rb_rows_cb cb, void *ud)
{
    topic_rows((pg_store *)bs, ((pg_store *)bs)->sql_limits, cb, ud);
}

/* ---- schedules ---------------------------------------------------------------------------- */

/* count: 1 when the row says the schedule was made */
static void schedule_set_done(pg_op *op, PGresult *res, const char *err)
{
    int64_t made = !err && PQntuples(res) == 1 && strcmp(PQgetvalue(res, 0, 0), "1") == 0;
    if (!err && !op->s->closed) rb_store_schedules_changed(&op->s->base);
    op->cb.count(op->ud, err, made);
    pg_op_free(op);
}

/* count: the deliveries the fire enqueued (1, or 0 when another process fired the tick) */
static void fire_done(pg_op *op, PGresult *res, const char *err)
{
    int64_t n = err ? 0 : PQntuples(res);
    if (n && !op->s->closed) rb_store_notify_local(&op->s->base);
    op->cb.count(op->ud, err, n);
    pg_op_free(op);
}

static void pg_schedule(rb_store *bs, const rb_schedule *sch, rb_count_cb cb, void *ud)
{
    pg_store *s = (pg_store *)bs;
    pg_op *op = op_adhoc(s, s->sql_schedule_set, 8, schedule_set_done, ud);
    int ok = op && pg_op_param(op, 0, sch->name) && pg_op_param(op, 1, sch->topic) &&
             pg_op_param(op, 2, sch->payload) && pg_op_param(op, 3, sch->cron) &&
             (sch->cron || op_param_num(op, 4, sch->every, 0)) &&
             pg_op_param(op, 5, sch->timezone) && op_param_num(op, 6, sch->next_at, 0) &&
             pg_op_param(op, 7, s->base.table);
    if (!ok) {
        pg_op_free(op);
        cb(ud, "postgresql: out of memory", 0);
        return;
    }
    op->cb.count = cb;
    op_submit_now(s, op);
}

/* count: 1 when one was removed */
static void unschedule_done(pg_op *op, PGresult *res, const char *err)
{
    int64_t n = err ? 0 : PQntuples(res);
    if (n && !op->s->closed) rb_store_schedules_changed(&op->s->base);
    op->cb.count(op->ud, err, n);
    pg_op_free(op);
}

static void pg_unschedule(rb_store *bs, const char *name, rb_count_cb cb, void *ud)
{
    pg_store *s = (pg_store *)bs;
    pg_op *op = op_adhoc(s, s->sql_unschedule, 2, unschedule_done, ud);
    if (!op || !pg_op_param(op, 0, name ? name : "") || !pg_op_param(op, 1, s->base.table)) {
        pg_op_free(op);
        cb(ud, "postgresql: out of memory", 0);
        return;
    }
    op->cb.count = cb;
    op_submit_now(s, op);
}

static void pg_schedules(rb_store *bs, rb_rows_cb cb, void *ud)
{
    topic_rows((pg_store *)bs, ((pg_store *)bs)->sql_schedules, cb, ud);
}

static void pg_schedule_fire(rb_store *bs, const char *name, double due, double next,
                             const rb_enqueue_item *tick, rb_count_cb cb, void *ud)
{
    pg_store *s = (pg_store *)bs;
    pg_op *op = op_adhoc(s, s->sql_schedule_fire, 7, fire_done, ud);
    int ok = op && pg_op_param(op, 0, name) && op_param_num(op, 1, due, 0) &&
             op_param_num(op, 2, next, 0) && pg_op_param(op, 3, tick->topic) &&
             pg_op_param(op, 4, tick->payload) && pg_op_param(op, 5, tick->key) &&
             op_param_num(op, 6, tick->max_attempts, 1);
    if (!ok) {
        pg_op_free(op);
        cb(ud, "postgresql: out of memory", 0);
        return;
    }
    op->cb.count = cb;
    op_submit_now(s, op);
}

static const rb_store_vtable pg_vtable = {
    .name = "postgresql",
    .claim_parallelism = 2,
    .enqueue = pg_enqueue,
    .claim = pg_claim,
    .settle = pg_settle,
    .claim_settle = pg_claim_settle,
    .get = pg_get,
    .list = pg_list,
    .stats = pg_stats,
    .kick = pg_kick,
    .topic_stats = pg_topic_stats,
    .pending_topics = pg_pending_topics,
    .bury = pg_bury,
    .cancel = pg_cancel,
    .cancel_all = pg_cancel_all,
    .progress = pg_progress,
    .remove = pg_remove,
    .purge = pg_purge,
    .lease = pg_lease,
    .begin = pg_begin,
    .tx_enqueue = pg_tx_enqueue,
    .tx_exec = pg_tx_exec,
    .tx_query = pg_tx_query,
    .tx_doc = NULL,
    .commit = pg_commit,
    .rollback = pg_rollback,
    .set_wakeup = pg_set_wakeup,
    .close = pg_close,
    .pause = pg_pause,
    .paused = pg_paused,
    .limit = pg_limit,
    .limits = pg_limits,
    .schedule = pg_schedule,
    .unschedule = pg_unschedule,
    .schedules = pg_schedules,
    .schedule_fire = pg_schedule_fire,
};

/* Our defaults come before the URL, whose own settings win (libpq keeps the last value).
 * jit=off: a claim on a large table is estimated expensive (the planner cannot know how many
 * due rows match the topics), which crosses jit_above_cost, and compiling it then costs far
 * more than the claim (docs/performance.md, "jit off"). */
static void set_params(pg_store *s)
{
    static const char *const keys[] = {"connect_timeout", "application_name", "client_encoding",
                                       "keepalives_idle", "keepalives_interval", "keepalives_count",
                                       "options"};
    static const char *const defaults[] = {"10", "relaybus", "UTF8", "30", "10", "3", "-c jit=off"};
    int n = 0;
    for (; n < 7; n++) { s->kw[n] = keys[n]; s->vals[n] = defaults[n]; }
    s->kw[n] = "dbname";
    s->vals[n++] = s->conninfo;
    s->kw[n] = s->vals[n] = NULL;
}

rb_store *rb_pg_open(struct ev_loop *loop, const char *conninfo, const rb_store_options *opts,
                     char *err, size_t errlen)
{
    const char *table = opts && opts->table ? opts->table : "relaybus_deliveries";
    int want_migrate = opts ? opts->migrate : 1;
    if (!rb_valid_identifier(table) || strlen(table) > PG_MAX_TABLE) {
        snprintf(err, errlen, "postgresql: invalid table name '%.80s' (letters, digits and _, "
                 "at most %d characters)", table, PG_MAX_TABLE);
        return NULL;
    }
    pg_store *s = rb_calloc(1, sizeof *s);
    if (!s) { snprintf(err, errlen, "postgresql: out of memory"); return NULL; }
    s->base.vt = &pg_vtable;
    s->base.loop = loop;
    s->base.table = rb_strdup(table);
    s->conninfo = rb_strdup(conninfo ? conninfo : "");
    pg_pool_init(s);
    if (!s->base.table || !s->conninfo) {
        snprintf(err, errlen, "postgresql: out of memory");
        store_free(s);
        return NULL;
    }
    set_params(s);
    PGconn *pq = PQconnectdbParams(s->kw, s->vals, 1);
    if (!pq || PQstatus(pq) != CONNECTION_OK) {
        rb_pg_one_line(err, errlen, pq ? PQerrorMessage(pq) : "out of memory");
        PQfinish(pq);
        store_free(s);
        return NULL;
    }
    PQsetNoticeProcessor(pq, quiet_notice, NULL);
    char schema[256];
    if (!rb_pg_check_names(pq, table, err, errlen) ||
        !(want_migrate ? rb_pg_migrate(pq, table, err, errlen) : rb_pg_check_schema(pq, table, err, errlen)) ||
        !rb_pg_table_schema(pq, table, schema, sizeof schema, err, errlen) ||
        !build_sql(s, schema) || !pg_pool_adopt(s, pq)) {
        if (!err[0]) snprintf(err, errlen, "postgresql: out of memory");
        PQfinish(pq);
        store_free(s);
        return NULL;
    }
    return &s->base;
}

/* Its table for plugin.h: the command and the Lua module load it from relaybus_pg.so. */
const rb_store_plugin rb_plugin_pg = { rb_pg_open };
