/* store_faults.c -- the fault-injecting store wrapper of store_faults.h.
 *
 * Each call becomes one operation record (fop) that lives until its caller has been
 * answered. The inner store is called with a numeric operation id as its callback data, not
 * a pointer: the id is looked up in a process-wide table, so a callback called twice finds no
 * operation (and is counted) instead of touching freed memory. An answer is taken over first
 * (records and rows owned, ids, stats and documents copied), so it can be held for a late
 * delivery, handed to the loop thread, or dropped, whatever the inner store does next. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "store_faults.h"
#include "util/check.h"
#include "util/alloc.h"
#include "util/timer.h"
#include "util/list.h"
#include "util/hmap.h"

static const char *const op_names[RB_FOP_COUNT] = {
    "enqueue", "claim", "settle", "get", "list", "stats", "kick", "purge", "lease_acquire",
    "lease_extend", "lease_release", "begin", "tx_enqueue", "tx_exec", "tx_query", "tx_doc",
    "commit", "rollback",
};
static const char *const kind_names[RB_FAULT_KINDS] = {"fail", "lost", "late"};

const char *rb_fault_op_name(rb_fault_op op)
{
    return (unsigned)op < RB_FOP_COUNT ? op_names[op] : NULL;
}

int rb_fault_op_parse(const char *name)
{
    for (int i = 0; name && i < RB_FOP_COUNT; i++)
        if (strcmp(op_names[i], name) == 0) return i;
    return -1;
}

const char *rb_fault_kind_name(rb_fault_kind kind)
{
    return (unsigned)kind < RB_FAULT_KINDS ? kind_names[kind] : NULL;
}

void rb_faults_options_init(rb_faults_options *o, uint64_t seed)
{
    memset(o, 0, sizeof *o);
    o->seed = seed;
    o->max_delay = 0.05;
    o->stuck_after = 30;
}

/* ---- structures ------------------------------------------------------------------------- */
typedef enum { F_NONE, F_FAIL, F_LOST, F_CLOSED } fault;

typedef struct faults_store faults_store;
typedef struct fop fop;

/* A transaction of the wrapper: the inner store's, and whose it is. */
typedef struct faults_tx {
    rb_tx *inner;
    faults_store *fs;
    int enqueued;           /* tx_enqueue was called: a commit wakes local dispatchers */
} faults_tx;

struct fop {
    uint64_t id;
    faults_store *fs;
    rb_fault_op op;
    fault fault;
    double delay;           /* > 0: the answer is delivered this much later */
    double sent_at;         /* monotonic */
    int in_inner;           /* the inner store has not answered (or its answer is in transit) */
    int orphan;             /* the caller was answered at close: drop the inner store's answer */
    int notify;             /* a successful answer wakes this process's dispatchers */
    int hold, ready;        /* the script holds the answer; the inner store has given it */
    const rb_claim_req *req;/* claim: the caller's request, for the script (during the call) */
    /* the caller */
    rb_store_cb cb;
    void *ud;
    rb_settle_op *ops;      /* settle: the caller's array; commit: its complete op */
    size_t nops;
    /* the answer, held until delivered */
    char *err;              /* owned, or err_static */
    const char *err_static;
    char **ids;
    unsigned char *kept;    /* enqueue: the inner store's kept flags (or NULL) */
    rb_delivery **recs;
    size_t n;
    rb_claim_result claim;  /* claim: the answer but its records (which are recs, n) */
    int64_t count;
    rb_stats st;
    int acquired;
    double expires_at;
    rb_tx *itx;             /* begin: the inner store's transaction */
    int leased;             /* begin_leased: no transaction and no error is a lost lease */
    rb_settle_op lease;     /* begin_leased: the inner store's copy (the caller's may be gone
                             * when a fault answered first); id and token are the caller's,
                             * which the inner store copies before it answers */
    faults_tx *ftx;         /* begin: the wrapper's, made when the answer arrived */
    rb_rowset *rs;
    char *doc;
    rb_timer timer;
    fop *prev, *next;       /* the store's operations not yet answered to their callers */
    rb_hnode map_node;      /* in the id table */
    fop *foreign_next;      /* answers that arrived on another thread */
};

struct faults_store {
    rb_store base;
    rb_store_vtable vt;     /* the inner store's name and flags, our functions */
    rb_store *inner;
    rb_faults_options opt;
    uint64_t serial;        /* high bits of this store's operation ids */
    uint64_t seq;
    uint64_t rng;
    uint64_t current_call;  /* id of the operation whose inner call is on the stack */
    pthread_t loop_thread;
    int closed;
    int inner_closed;       /* we closed the owned inner store */
    int wakeup_set;
    int refs;               /* 1 while open, + operations and transactions alive */
    fop *waiting;
    fop *foreign;           /* guarded by reg_mu */
    ev_async async;
    long calls[RB_FOP_COUNT];
    long injected[RB_FAULT_KINDS][RB_FOP_COUNT];
    long sync_answers, held, twice, wrong_thread, multiline, err_with_result, unanswered;
    rb_fault_script script;
    /* the inner store's in-process hooks, which the wrapper passes on and keeps calling */
    void (*inner_wakeup)(void *ud);
    void (*inner_cancelled)(void *ud, const char *id, const char *token);
    void (*inner_schedules)(void *ud);
    void *inner_hooks_ud;
    faults_store *next_live;
};

/* ---- the process-wide table of operations in the inner stores ---------------------------- */
/* Callbacks may (wrongly) arrive on any thread, so the table and the counters a foreign
 * thread touches are guarded by one mutex. */
static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;
static rb_hmap map;        /* of fop.map_node, by id */
static faults_store *live;
static uint64_t next_serial = 1;

#define SERIAL_SHIFT (sizeof(uintptr_t) * 8 - 16)

/* Under reg_mu. Returns -1 when out of memory. */
static int map_add(fop *o)
{
    return rb_hmap_add(&map, &o->map_node, rb_hash_u64(o->id));
}

/* Under reg_mu: removes and returns the operation, or NULL. */
static fop *map_take(uint64_t id)
{
    for (rb_hnode *n = rb_hmap_first(&map, rb_hash_u64(id)); n; n = rb_hmap_next(n)) {
        fop *o = RB_HMAP_ENTRY(n, fop, map_node);
        if (o->id == id) {
            rb_hmap_remove(&map, n);
            return o;
        }
    }
    return NULL;
}

/* Under reg_mu: the live wrapper an unknown id belonged to (for counting), or NULL. */
static faults_store *live_find(uint64_t id)
{
    uint64_t serial = id >> SERIAL_SHIFT;
    for (faults_store *fs = live; fs; fs = fs->next_live)
        if (fs->serial == serial) return fs;
    return NULL;
}

/* ---- the PRNG (splitmix64): one stream per wrapper, from its seed ------------------------ */
static double rnd(faults_store *fs)
{
    uint64_t x = (fs->rng += 0x9E3779B97F4A7C15ULL);
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    x ^= x >> 31;
    return (double)(x >> 11) * 0x1.0p-53;
}

/* ---- operation records ------------------------------------------------------------------- */
static void fs_unref(faults_store *fs);

static int inner_usable(const faults_store *fs)
{
    return !fs->inner_closed && !(fs->opt.inner_gone && *fs->opt.inner_gone);
}

static void set_err(fop *o, const char *msg)
{
    free(o->err);
    o->err = NULL;
    o->err_static = NULL;
    if (!msg) return;
    o->err = rb_strdup(msg);
    if (!o->err) o->err_static = "out of memory (keeping a store's error)";
}

static const char *err_of(const fop *o) { return o->err ? o->err : o->err_static; }

static void set_injected_err(fop *o, const char *what)
{
    char msg[96];
    snprintf(msg, sizeof msg, "injected fault: %s %s", op_names[o->op], what);
    set_err(o, msg);
}

static void ignore_done(void *ud, const char *err) { (void)ud; (void)err; }

/* Frees what the answer carries; a begun inner transaction is rolled back. */
static void drop_results(fop *o)
{
    faults_store *fs = o->fs;
    free(o->kept);
    o->kept = NULL;
    if (o->ids) {
        for (size_t i = 0; i < o->n; i++) free(o->ids[i]);
        free(o->ids);
        o->ids = NULL;
    }
    if (o->recs) {
        rb_delivery_list_free(o->recs, o->n);
        o->recs = NULL;
    }
    o->n = 0;
    rb_rowset_free(o->rs);
    o->rs = NULL;
    free(o->doc);
    o->doc = NULL;
    if (o->ftx) {
        o->itx = o->ftx->inner;
        free(o->ftx);
        o->ftx = NULL;
        fs_unref(fs);
    }
    if (o->itx) {
        if (inner_usable(fs)) fs->inner->vt->rollback(o->itx, ignore_done, NULL);
        o->itx = NULL;
    }
}

static void fop_free(fop *o)
{
    faults_store *fs = o->fs;
    drop_results(o);
    free(o->err);
    free(o);
    fs_unref(fs);
}

static void unlink_waiting(fop *o)
{
    faults_store *fs = o->fs;
    RB_LIST_REMOVE(&fs->waiting, o);
}

/* The answers of a transaction's operations (deliver's part for them); frees o. */
static void deliver_tx(fop *o, void *ud, const char *err)
{
    switch (o->op) {
    case RB_FOP_BEGIN: {
        rb_tx_cb cb = o->cb.tx;
        faults_tx *ftx = err ? NULL : o->ftx;
        o->ftx = NULL;
        fop_free(o);
        cb(ud, err, (rb_tx *)ftx);
        break;
    }
    case RB_FOP_TX_QUERY: {
        rb_rows_cb cb = o->cb.rows;
        rb_rowset *rs = o->rs;
        o->rs = NULL;
        fop_free(o);
        cb(ud, err, rs);
        break;
    }
    case RB_FOP_TX_DOC: {
        rb_doc_cb cb = o->cb.doc;
        char *doc = o->doc;
        int64_t count = err ? 0 : o->count;
        o->doc = NULL;
        fop_free(o);
        cb(ud, err, doc, count);
        free(doc);
        break;
    }
    default: {      /* RB_FOP_COMMIT, RB_FOP_ROLLBACK */
        rb_done_cb cb = o->cb.done;
        if (err && o->ops) {
            o->ops->applied = 0;
            o->ops->lease_expires_at = 0;
        }
        fop_free(o);
        cb(ud, err);
        break;
    }
    }
}

/* Answers the caller with what the record holds, then frees it. The caller may do anything
 * in its callback (more operations, close): nothing of o is touched after it. */
static void deliver(fop *o)
{
    faults_store *fs = o->fs;
    unlink_waiting(o);
    /* The message outlives o: it is freed after the callback. */
    char *err_owned = o->err;
    const char *err = err_of(o);
    o->err = NULL;
    if (err) drop_results(o);
    void *ud = o->ud;
    fs->refs++;     /* fs outlives the callback even if the caller closes it there */
    if (fs->script.answered) fs->script.answered(fs->script.ud, o->op);
    switch (o->op) {
    case RB_FOP_ENQUEUE:
    case RB_FOP_TX_ENQUEUE:
        o->cb.ids(ud, err, err ? NULL : o->ids, err ? NULL : o->kept, err ? 0 : o->n);
        fop_free(o);
        break;
    case RB_FOP_CLAIM: {
        rb_claim_cb cb = o->cb.claim;
        rb_claim_result res = o->claim;
        res.recs = o->recs;
        res.n = o->n;
        o->recs = NULL;
        o->n = 0;
        fop_free(o);
        cb(ud, err, err ? NULL : &res);     /* ownership of the records passes */
        break;
    }
    case RB_FOP_GET:
    case RB_FOP_LIST: {
        rb_records_cb cb = o->cb.records;
        rb_delivery **recs = o->recs;
        size_t n = o->n;
        o->recs = NULL;
        o->n = 0;
        fop_free(o);
        cb(ud, err, recs, n);   /* ownership passes */
        break;
    }
    case RB_FOP_SETTLE: {
        rb_done_cb cb = o->cb.done;
        if (err)
            for (size_t i = 0; i < o->nops; i++) o->ops[i].applied = 0;
        fop_free(o);
        cb(ud, err);
        break;
    }
    case RB_FOP_STATS:
        o->cb.stats(ud, err, err ? NULL : &o->st);
        fop_free(o);
        break;
    case RB_FOP_KICK:
    case RB_FOP_PURGE:
    case RB_FOP_TX_EXEC: {
        rb_count_cb cb = o->cb.count;
        int64_t count = err ? 0 : o->count;
        fop_free(o);
        cb(ud, err, count);
        break;
    }
    case RB_FOP_LEASE_ACQUIRE:
    case RB_FOP_LEASE_EXTEND:
    case RB_FOP_LEASE_RELEASE: {
        rb_lease_cb cb = o->cb.lease;
        int acquired = err ? 0 : o->acquired;
        double expires = err ? 0 : o->expires_at;
        fop_free(o);
        cb(ud, err, acquired, expires);
        break;
    }
    case RB_FOP_BEGIN:
    case RB_FOP_TX_QUERY:
    case RB_FOP_TX_DOC:
    case RB_FOP_COMMIT:
    case RB_FOP_ROLLBACK:
        deliver_tx(o, ud, err);
        break;
    default:
        fop_free(o);
        break;
    }
    free(err_owned);
    fs_unref(fs);
}

static void on_late(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    fop *o = w->data;
    o->fs->held--;
    deliver(o);
}

/* Delivers now, or after the drawn delay. */
static void schedule(fop *o)
{
    faults_store *fs = o->fs;
    if (o->hold && !fs->closed) {
        o->ready = 1;           /* answered by rb_faults_release, or "store closed" at close */
        return;
    }
    if (o->delay > 0 && !fs->closed) {
        fs->injected[RB_FAULT_LATE][o->op]++;
        fs->held++;
        rb_timer_init(&o->timer, on_late, o->delay, 0);
        o->timer.w.data = o;
        rb_timer_start(fs->base.loop, &o->timer);
        return;
    }
    deliver(o);
}

/* The inner store's answer is in o (on the loop thread): apply the drawn fault. */
static void answered(fop *o)
{
    faults_store *fs = o->fs;
    o->in_inner = 0;
    if (o->id == fs->current_call) fs->sync_answers++;
    if (err_of(o) && strchr(err_of(o), '\n')) fs->multiline++;
    if (!err_of(o) && o->op == RB_FOP_BEGIN && o->itx) {
        o->ftx = rb_malloc(sizeof *o->ftx);
        if (o->ftx) {
            *o->ftx = (faults_tx){o->itx, fs, 0};
            o->itx = NULL;
            fs->refs++;
        } else {
            set_err(o, "out of memory");
        }
    }
    if (o->orphan) {
        fop_free(o);
        return;
    }
    const char *err = err_of(o);
    if (!err && o->notify && !fs->closed) rb_store_notify_local(&fs->base);
    int ends_tx = o->op == RB_FOP_COMMIT || o->op == RB_FOP_ROLLBACK;
    if (o->fault == F_CLOSED) {
        set_err(o, "store closed");
    } else if (o->fault == F_FAIL && ends_tx) {
        fs->injected[RB_FAULT_FAIL][o->op]++;
        set_injected_err(o, "failed");
    } else if (o->fault == F_LOST && !err) {
        fs->injected[RB_FAULT_LOST][o->op]++;
        drop_results(o);
        set_injected_err(o, "answer lost");
    }
    if (err_of(o)) drop_results(o);
    schedule(o);
}

static void on_async(struct ev_loop *loop, ev_async *w, int revents)
{
    (void)loop; (void)revents;
    faults_store *fs = w->data;
    pthread_mutex_lock(&reg_mu);
    fop *list = fs->foreign;
    fs->foreign = NULL;
    pthread_mutex_unlock(&reg_mu);
    /* oldest first */
    fop *rev = NULL;
    while (list) {
        fop *next = list->foreign_next;
        list->foreign_next = rev;
        rev = list;
        list = next;
    }
    fs->refs++;
    while (rev) {
        fop *next = rev->foreign_next;
        answered(rev);
        rev = next;
    }
    fs_unref(fs);
}

/* ---- callbacks the inner store calls ------------------------------------------------------ */
/* Finds the operation of an answer; NULL when it is unknown (a second callback: counted). */
static fop *take(void *ud)
{
    uint64_t id = (uint64_t)(uintptr_t)ud;
    pthread_mutex_lock(&reg_mu);
    fop *o = map_take(id);
    if (!o) {
        faults_store *fs = live_find(id);
        if (fs) fs->twice++;
    }
    pthread_mutex_unlock(&reg_mu);
    return o;
}

/* The answer is in o: go on here on the loop thread, or hand it over to it. */
static void arrived(fop *o, const char *err, int has_results)
{
    faults_store *fs = o->fs;
    set_err(o, err);
    if (err && has_results) {
        pthread_mutex_lock(&reg_mu);
        fs->err_with_result++;
        pthread_mutex_unlock(&reg_mu);
    }
    if (!pthread_equal(pthread_self(), fs->loop_thread)) {
        pthread_mutex_lock(&reg_mu);
        fs->wrong_thread++;
        o->foreign_next = fs->foreign;
        fs->foreign = o;
        pthread_mutex_unlock(&reg_mu);
        ev_async_send(fs->base.loop, &fs->async);
        return;
    }
    answered(o);
}

static void on_ids(void *ud, const char *err, char **ids, const unsigned char *kept, size_t n)
{
    fop *o = take(ud);
    if (!o) return;
    if (!err && n && kept) {
        if ((o->kept = rb_malloc(n))) memcpy(o->kept, kept, n);
        else err = "out of memory (copying the ids of an enqueue)";
    }
    if (!err && n) {
        o->ids = rb_calloc(n, sizeof *o->ids);
        for (size_t i = 0; o->ids && i < n; i++) {
            if (!(o->ids[i] = rb_strdup(ids[i] ? ids[i] : ""))) {
                o->n = i;
                drop_results(o);
                err = "out of memory (copying the ids of an enqueue)";
                break;
            }
        }
        if (!o->ids) err = "out of memory (copying the ids of an enqueue)";
        else if (!err) o->n = n;
    }
    arrived(o, err, err && ids && n);
}

static void on_records(void *ud, const char *err, rb_delivery **recs, size_t n)
{
    fop *o = take(ud);
    if (!o) return;     /* a repeated answer: its records may be the ones already passed on */
    int has = recs && n;
    if (err) rb_delivery_list_free(recs, n);
    else {
        o->recs = recs;
        o->n = n;
    }
    arrived(o, err, err && has);
}

static void on_claim(void *ud, const char *err, rb_claim_result *res)
{
    fop *o = take(ud);
    if (!o) return;     /* a repeated answer: its records may be the ones already passed on */
    int has = res != NULL;
    if (err) {
        if (res) rb_delivery_list_free(res->recs, res->n);
    } else if (res) {
        o->claim = *res;
        o->recs = res->recs;
        o->n = res->n;
    }
    arrived(o, err, err && has);
}

static void on_done(void *ud, const char *err)
{
    fop *o = take(ud);
    if (o) arrived(o, err, 0);
}

static void on_count(void *ud, const char *err, int64_t count)
{
    fop *o = take(ud);
    if (!o) return;
    o->count = count;
    arrived(o, err, 0);
}

static void on_stats(void *ud, const char *err, const rb_stats *st)
{
    fop *o = take(ud);
    if (!o) return;
    if (st) o->st = *st;
    else if (!err) err = "stats answered without stats";
    arrived(o, err, 0);
}

static void on_lease(void *ud, const char *err, int acquired, double expires_at)
{
    fop *o = take(ud);
    if (!o) return;
    o->acquired = acquired;
    o->expires_at = expires_at;
    arrived(o, err, 0);
}

static void on_tx(void *ud, const char *err, rb_tx *tx)
{
    fop *o = take(ud);
    if (!o) return;
    o->itx = tx;    /* rolled back by drop_results when err is set */
    if (!err && !tx && !o->leased) err = "begin answered without a transaction";
    arrived(o, err, err && tx);
}

static void on_rows(void *ud, const char *err, rb_rowset *rs)
{
    fop *o = take(ud);
    if (!o) return;
    o->rs = rs;
    arrived(o, err, err && rs);
}

static void on_doc(void *ud, const char *err, const char *doc, int64_t count)
{
    fop *o = take(ud);
    if (!o) return;
    o->count = count;
    if (!err && doc && !(o->doc = rb_strdup(doc))) err = "out of memory (copying a document)";
    arrived(o, err, 0);
}

/* ---- starting an operation ------------------------------------------------------------------ */
/* A new record for a call, with its fault drawn; NULL when out of memory. */
static fop *fop_new(faults_store *fs, rb_fault_op op, void *ud)
{
    fop *o = rb_calloc(1, sizeof *o);
    if (!o) return NULL;
    o->fs = fs;
    fs->refs++;
    o->op = op;
    o->ud = ud;
    o->sent_at = rb_monotonic();
    o->id = (fs->serial << SERIAL_SHIFT) | (++fs->seq & (((uint64_t)1 << SERIAL_SHIFT) - 1));
    fs->calls[op]++;
    /* Three draws always, whatever the rates: the seed alone fixes the decisions. */
    double r_fault = rnd(fs), r_late = rnd(fs), r_delay = rnd(fs);
    const rb_fault_rates *rt = &fs->opt.rates[op];
    if (fs->closed || !inner_usable(fs)) o->fault = F_CLOSED;
    else if (r_fault < rt->fail) o->fault = F_FAIL;
    else if (r_fault < rt->fail + rt->lost) o->fault = F_LOST;
    if (r_late < rt->late)
        o->delay = fs->opt.min_delay + (fs->opt.max_delay - fs->opt.min_delay) * (1.0 - r_delay);
    RB_LIST_PUSH(&fs->waiting, o);
    return o;
}

/* Whether o goes to the inner store. When it does not, it is answered here: "store closed"
 * at once, an injected failure now or later. */
static int goes_inner(fop *o)
{
    faults_store *fs = o->fs;
    if (fs->script.call && o->fault != F_CLOSED) {
        rb_fault_call call = {.op = o->op, .claim = o->req, .ops = o->ops, .nops = o->nops};
        rb_fault_plan plan = {0};
        fs->script.call(fs->script.ud, &call, &plan);
        if (plan.delay > 0) o->delay = plan.delay;
        o->hold = plan.hold;
        if (plan.refuse) {
            o->hold = 0;
            o->fault = F_NONE;
            set_err(o, plan.refuse);
            schedule(o);
            return 0;
        }
    }
    if (o->fault == F_CLOSED) {
        set_err(o, "store closed");
        deliver(o);
        return 0;
    }
    if (o->fault == F_FAIL) {
        o->fs->injected[RB_FAULT_FAIL][o->op]++;
        set_injected_err(o, "failed");
        schedule(o);
        return 0;
    }
    return 1;
}

/* Around the inner call: o is registered, and fs kept alive through the call (a synchronous
 * answer may close the wrapper). Returns the id to hand to the inner store (0 when out of
 * memory: o was answered with an error and must not be used). */
static void *call_begin(fop *o, uint64_t *saved)
{
    faults_store *fs = o->fs;
    pthread_mutex_lock(&reg_mu);
    int rc = map_add(o);
    pthread_mutex_unlock(&reg_mu);
    if (rc != 0) {
        set_err(o, "out of memory");
        deliver(o);
        return NULL;
    }
    o->in_inner = 1;
    fs->refs++;
    *saved = fs->current_call;
    fs->current_call = o->id;
    return (void *)(uintptr_t)o->id;
}

static void call_end(faults_store *fs, uint64_t saved)
{
    fs->current_call = saved;
    fs_unref(fs);
}

#define FS(s) ((faults_store *)(s))

/* Forwards `call` (which uses the id `ID`) when o is to reach the inner store. */
#define FORWARD(fs, o, call) do {                                   \
        uint64_t saved_;                                            \
        void *ID = call_begin((o), &saved_);                        \
        if (ID) { call; call_end((fs), saved_); }                   \
    } while (0)

/* ---- the vtable ----------------------------------------------------------------------------- */
static void fw_enqueue(rb_store *s, const rb_enqueue_item *items, size_t n, rb_ids_cb cb,
                       void *ud)
{
    faults_store *fs = FS(s);
    fop *o = fop_new(fs, RB_FOP_ENQUEUE, ud);
    if (!o) { cb(ud, "out of memory", NULL, NULL, 0); return; }
    o->cb.ids = cb;
    o->notify = 1;
    if (goes_inner(o)) FORWARD(fs, o, fs->inner->vt->enqueue(fs->inner, items, n, on_ids, ID));
}

static void fw_claim(rb_store *s, const rb_claim_req *req, rb_claim_cb cb, void *ud)
{
    faults_store *fs = FS(s);
    fop *o = fop_new(fs, RB_FOP_CLAIM, ud);
    if (!o) { cb(ud, "out of memory", NULL); return; }
    o->cb.claim = cb;
    o->req = req;
    int forward = goes_inner(o);
    if (forward) o->req = NULL;     /* (not kept past the call) */
    if (forward) FORWARD(fs, o, fs->inner->vt->claim(fs->inner, req, on_claim, ID));
}

static void fw_settle(rb_store *s, rb_settle_op *ops, size_t n, rb_done_cb cb, void *ud)
{
    faults_store *fs = FS(s);
    fop *o = fop_new(fs, RB_FOP_SETTLE, ud);
    if (!o) {
        for (size_t i = 0; i < n; i++) ops[i].applied = 0;
        cb(ud, "out of memory");
        return;
    }
    o->cb.done = cb;
    o->ops = ops;
    o->nops = n;
    if (goes_inner(o)) FORWARD(fs, o, fs->inner->vt->settle(fs->inner, ops, n, on_done, ID));
}

/* Split in its two calls, each with its own fault: the dispatcher's path that hands a claim
 * the settles to carry runs under faults, while the inner store answers them apart. */
static void fw_claim_settle(rb_store *s, const rb_claim_req *req, rb_claim_cb cb, void *ud,
                            rb_settle_op *ops, size_t n, rb_done_cb settle_cb, void *settle_ud)
{
    fw_settle(s, ops, n, settle_cb, settle_ud);
    fw_claim(s, req, cb, ud);
}

static void fw_get(rb_store *s, const char *id, rb_records_cb cb, void *ud)
{
    faults_store *fs = FS(s);
    fop *o = fop_new(fs, RB_FOP_GET, ud);
    if (!o) { cb(ud, "out of memory", NULL, 0); return; }
    o->cb.records = cb;
    if (goes_inner(o)) FORWARD(fs, o, fs->inner->vt->get(fs->inner, id, on_records, ID));
}

static void fw_list(rb_store *s, const rb_list_req *req, rb_records_cb cb, void *ud)
{
    faults_store *fs = FS(s);
    fop *o = fop_new(fs, RB_FOP_LIST, ud);
    if (!o) { cb(ud, "out of memory", NULL, 0); return; }
    o->cb.records = cb;
    if (goes_inner(o)) FORWARD(fs, o, fs->inner->vt->list(fs->inner, req, on_records, ID));
}

static void fw_stats(rb_store *s, rb_stats_cb cb, void *ud)
{
    faults_store *fs = FS(s);
    fop *o = fop_new(fs, RB_FOP_STATS, ud);
    if (!o) { cb(ud, "out of memory", NULL); return; }
    o->cb.stats = cb;
    if (goes_inner(o)) FORWARD(fs, o, fs->inner->vt->stats(fs->inner, on_stats, ID));
}

static void fw_kick(rb_store *s, rb_kick_mode mode, const char *id, const char *topic,
                    rb_count_cb cb, void *ud)
{
    faults_store *fs = FS(s);
    fop *o = fop_new(fs, RB_FOP_KICK, ud);
    if (!o) { cb(ud, "out of memory", 0); return; }
    o->cb.count = cb;
    if (goes_inner(o)) FORWARD(fs, o, fs->inner->vt->kick(fs->inner, mode, id, topic, on_count, ID));
}

static void fw_purge(rb_store *s, const char *status, const char *topic, double older_than,
                     size_t limit, rb_count_cb cb, void *ud)
{
    faults_store *fs = FS(s);
    fop *o = fop_new(fs, RB_FOP_PURGE, ud);
    if (!o) { cb(ud, "out of memory", 0); return; }
    o->cb.count = cb;
    if (goes_inner(o))
        FORWARD(fs, o, fs->inner->vt->purge(fs->inner, status, topic, older_than, limit, on_count, ID));
}

static void fw_lease(rb_store *s, rb_lease_op kind, const char *name, const char *token,
                     double duration, rb_lease_cb cb, void *ud)
{
    static const rb_fault_op fops[] = {[RB_LEASE_ACQUIRE] = RB_FOP_LEASE_ACQUIRE,
                                       [RB_LEASE_EXTEND] = RB_FOP_LEASE_EXTEND,
                                       [RB_LEASE_RELEASE] = RB_FOP_LEASE_RELEASE};
    faults_store *fs = FS(s);
    fop *o = fop_new(fs, fops[kind], ud);
    if (!o) { cb(ud, "out of memory", 0, 0); return; }
    o->cb.lease = cb;
    if (goes_inner(o))
        FORWARD(fs, o, fs->inner->vt->lease(fs->inner, kind, name, token, duration, on_lease, ID));
}

static void fw_begin(rb_store *s, rb_tx_cb cb, void *ud)
{
    faults_store *fs = FS(s);
    fop *o = fop_new(fs, RB_FOP_BEGIN, ud);
    if (!o) { cb(ud, "out of memory", NULL); return; }
    o->cb.tx = cb;
    if (goes_inner(o)) FORWARD(fs, o, fs->inner->vt->begin(fs->inner, on_tx, ID));
}

static void fw_begin_leased(rb_store *s, rb_settle_op *lease, rb_tx_cb cb, void *ud)
{
    faults_store *fs = FS(s);
    fop *o = fop_new(fs, RB_FOP_BEGIN, ud);
    if (!o) { lease->applied = 0; cb(ud, "out of memory", NULL); return; }
    o->cb.tx = cb;
    o->leased = 1;
    o->lease = *lease;
    if (goes_inner(o))
        FORWARD(fs, o, fs->inner->vt->begin_leased(fs->inner, &o->lease, on_tx, ID));
}

#define FTX(tx) ((faults_tx *)(tx))

static int fw_tx_holds(rb_tx *tx)
{
    faults_store *fs = FTX(tx)->fs;
    return FTX(tx)->inner && fs->inner->vt->tx_holds(FTX(tx)->inner);
}

static void fw_tx_enqueue(rb_tx *tx, const rb_enqueue_item *items, size_t n, rb_ids_cb cb,
                          void *ud)
{
    faults_store *fs = FTX(tx)->fs;
    fop *o = fop_new(fs, RB_FOP_TX_ENQUEUE, ud);
    if (!o) { cb(ud, "out of memory", NULL, NULL, 0); return; }
    o->cb.ids = cb;
    FTX(tx)->enqueued = 1;
    if (goes_inner(o))
        FORWARD(fs, o, fs->inner->vt->tx_enqueue(FTX(tx)->inner, items, n, on_ids, ID));
}

static void fw_tx_exec(rb_tx *tx, const char *sql, const rb_value *params, size_t n,
                       rb_count_cb cb, void *ud)
{
    faults_store *fs = FTX(tx)->fs;
    fop *o = fop_new(fs, RB_FOP_TX_EXEC, ud);
    if (!o) { cb(ud, "out of memory", 0); return; }
    o->cb.count = cb;
    if (goes_inner(o))
        FORWARD(fs, o, fs->inner->vt->tx_exec(FTX(tx)->inner, sql, params, n, on_count, ID));
}

static void fw_tx_query(rb_tx *tx, const char *sql, const rb_value *params, size_t n,
                        rb_rows_cb cb, void *ud)
{
    faults_store *fs = FTX(tx)->fs;
    fop *o = fop_new(fs, RB_FOP_TX_QUERY, ud);
    if (!o) { cb(ud, "out of memory", NULL); return; }
    o->cb.rows = cb;
    if (goes_inner(o))
        FORWARD(fs, o, fs->inner->vt->tx_query(FTX(tx)->inner, sql, params, n, on_rows, ID));
}

static void fw_tx_doc(rb_tx *tx, rb_doc_op op, const char *collection, const char *filter_json,
                      const char *doc_json, rb_doc_cb cb, void *ud)
{
    faults_store *fs = FTX(tx)->fs;
    fop *o = fop_new(fs, RB_FOP_TX_DOC, ud);
    if (!o) { cb(ud, "out of memory", NULL, 0); return; }
    o->cb.doc = cb;
    if (goes_inner(o))
        FORWARD(fs, o, fs->inner->vt->tx_doc(FTX(tx)->inner, op, collection, filter_json,
                                              doc_json, on_doc, ID));
}

/* Commit and rollback end the transaction whatever is injected: a drawn failure (or a closed
 * wrapper) rolls the inner transaction back and then reports the error. */
static void end_tx(rb_tx *tx, rb_settle_op *complete, rb_done_cb cb, void *ud, int commit)
{
    faults_tx *ftx = FTX(tx);
    faults_store *fs = ftx->fs;
    rb_tx *itx = ftx->inner;
    int enqueued = ftx->enqueued;
    free(ftx);
    if (complete) {
        complete->applied = 0;
        complete->lease_expires_at = 0;
    }
    if (!commit && !cb) {
        /* Nobody waits for this rollback: forward it as it came (a store must accept a rollback
         * without callback), drawing as for any call so the seed keeps its sequence. */
        fs->calls[RB_FOP_ROLLBACK]++;
        for (int i = 0; i < 3; i++) (void)rnd(fs);
        if (inner_usable(fs)) fs->inner->vt->rollback(itx, NULL, NULL);
        fs_unref(fs);
        return;
    }
    fop *o = fop_new(fs, commit ? RB_FOP_COMMIT : RB_FOP_ROLLBACK, ud);
    fs_unref(fs);   /* the transaction's reference; o holds its own */
    if (!o) {
        if (inner_usable(fs)) fs->inner->vt->rollback(itx, ignore_done, NULL);
        if (cb) cb(ud, "out of memory");
        return;
    }
    o->cb.done = cb;
    o->ops = complete;
    o->notify = commit && enqueued;
    if (!inner_usable(fs)) {
        set_err(o, "store closed");     /* the inner transaction went with its store */
        deliver(o);
        return;
    }
    if (commit && (o->fault == F_NONE || o->fault == F_LOST))
        FORWARD(fs, o, fs->inner->vt->commit(itx, complete, on_done, ID));
    else
        FORWARD(fs, o, fs->inner->vt->rollback(itx, on_done, ID));
}

static void fw_commit(rb_tx *tx, rb_settle_op *complete, rb_done_cb cb, void *ud)
{
    end_tx(tx, complete, cb, ud, 1);
}

static void fw_rollback(rb_tx *tx, rb_done_cb cb, void *ud)
{
    end_tx(tx, NULL, cb, ud, 0);
}

static void fw_set_wakeup(rb_store *s, void (*fn)(void *ud), void *ud)
{
    faults_store *fs = FS(s);
    if (!inner_usable(fs) || fs->closed) return;
    fs->wakeup_set = fn != NULL;
    fs->inner->vt->set_wakeup(fs->inner, fn, ud);
}

/* ---- lifetime ------------------------------------------------------------------------------- */
static void fs_free(faults_store *fs)
{
    pthread_mutex_lock(&reg_mu);
    for (faults_store **pp = &live; *pp; pp = &(*pp)->next_live)
        if (*pp == fs) { *pp = fs->next_live; break; }
    pthread_mutex_unlock(&reg_mu);
    ev_ref(fs->base.loop);
    ev_async_stop(fs->base.loop, &fs->async);
    rb_store_release_dispatch(&fs->base);
    free(fs->base.table);
    free(fs);
}

static void fs_unref(faults_store *fs)
{
    if (--fs->refs == 0) fs_free(fs);
}

static void fw_close(rb_store *s)
{
    faults_store *fs = FS(s);
    if (fs->closed) return;
    fs->closed = 1;
    if (fs->wakeup_set && inner_usable(fs) && !fs->opt.own_inner)
        fs->inner->vt->set_wakeup(fs->inner, NULL, NULL);
    if (inner_usable(fs) && fs->inner->local_wakeup_ud == fs) {   /* the inner's hooks back */
        fs->inner->local_wakeup = fs->inner_wakeup;
        fs->inner->local_cancelled = fs->inner_cancelled;
        fs->inner->local_schedules = fs->inner_schedules;
        fs->inner->local_wakeup_ud = fs->inner_hooks_ud;
    }
    fs->refs++;
    /* Every caller still waiting hears "store closed" now; an inner store's answer that
     * comes later is dropped. */
    fop *o;
    while ((o = fs->waiting) != NULL) {
        if (rb_timer_active(&o->timer)) {
            rb_timer_stop(fs->base.loop, &o->timer);
            fs->held--;
        }
        if (!o->in_inner) {
            set_err(o, "store closed");
            deliver(o);
            continue;
        }
        unlink_waiting(o);
        /* A record of its own answers the caller; o stays for the inner store's answer. */
        fop *answer = rb_calloc(1, sizeof *answer);
        if (!answer) {
            o->fault = F_CLOSED;    /* answered "store closed" when the inner store answers */
            continue;
        }
        answer->fs = fs;
        fs->refs++;
        answer->op = o->op;
        answer->cb = o->cb;
        answer->ud = o->ud;
        answer->ops = o->ops;
        answer->nops = o->nops;
        answer->err_static = "store closed";
        o->orphan = 1;
        deliver(answer);
    }
    if (fs->opt.own_inner && inner_usable(fs)) {
        fs->inner->vt->close(fs->inner);
        fs->inner_closed = 1;
        /* store.h: operations in flight are answered before close returns */
        pthread_mutex_lock(&reg_mu);
        for (size_t i = 0; i < map.nbuckets; i++)
            for (rb_hnode *n = map.buckets[i]; n; n = n->next)
                if (RB_HMAP_ENTRY(n, fop, map_node)->fs == fs) fs->unanswered++;
        pthread_mutex_unlock(&reg_mu);
    }
    fs_unref(fs);   /* the reference taken above */
    fs_unref(fs);   /* the open store's */
}

/* ---- operations forwarded as they are ------------------------------------------------------ */
static void pt_topic_stats(rb_store *s, rb_rows_cb cb, void *ud)
{
    faults_store *fs = FS(s);
    if (!inner_usable(fs) || fs->closed) { cb(ud, "store closed", NULL); return; }
    fs->inner->vt->topic_stats(fs->inner, cb, ud);
}
static void pt_pending_topics(rb_store *s, size_t scan_max, rb_rows_cb cb, void *ud)
{
    faults_store *fs = FS(s);
    if (!inner_usable(fs) || fs->closed) { cb(ud, "store closed", NULL); return; }
    fs->inner->vt->pending_topics(fs->inner, scan_max, cb, ud);
}
static void pt_bury(rb_store *s, const char *id, const char *reason, rb_count_cb cb, void *ud)
{
    faults_store *fs = FS(s);
    if (!inner_usable(fs) || fs->closed) { cb(ud, "store closed", 0); return; }
    fs->inner->vt->bury(fs->inner, id, reason, cb, ud);
}
static void pt_cancel(rb_store *s, const char *id, const char *reason, rb_count_cb cb, void *ud)
{
    faults_store *fs = FS(s);
    if (!inner_usable(fs) || fs->closed) { cb(ud, "store closed", 0); return; }
    fs->inner->vt->cancel(fs->inner, id, reason, cb, ud);
}
static void pt_remove(rb_store *s, const char *id, rb_count_cb cb, void *ud)
{
    faults_store *fs = FS(s);
    if (!inner_usable(fs) || fs->closed) { cb(ud, "store closed", 0); return; }
    fs->inner->vt->remove(fs->inner, id, cb, ud);
}
static void pt_progress(rb_store *s, rb_tx *tx, const char *id, const char *token,
                        const char *json, rb_count_cb cb, void *ud)
{
    faults_store *fs = FS(s);
    if (!inner_usable(fs) || fs->closed) { cb(ud, "store closed", 0); return; }
    fs->inner->vt->progress(fs->inner, tx ? FTX(tx)->inner : NULL, id, token, json, cb, ud);
}
static void pt_pause(rb_store *s, const char *topic, int paused, rb_count_cb cb, void *ud)
{
    faults_store *fs = FS(s);
    if (!inner_usable(fs) || fs->closed) { cb(ud, "store closed", 0); return; }
    fs->inner->vt->pause(fs->inner, topic, paused, cb, ud);
}
static void pt_paused(rb_store *s, rb_rows_cb cb, void *ud)
{
    faults_store *fs = FS(s);
    if (!inner_usable(fs) || fs->closed) { cb(ud, "store closed", NULL); return; }
    fs->inner->vt->paused(fs->inner, cb, ud);
}

static void pt_cancel_all(rb_store *s, const char *status, const char *topic, const char *reason,
                          rb_count_cb cb, void *ud)
{
    faults_store *fs = FS(s);
    if (!inner_usable(fs) || fs->closed) { cb(ud, "store closed", 0); return; }
    fs->inner->vt->cancel_all(fs->inner, status, topic, reason, cb, ud);
}
static void pt_schedule(rb_store *s, const rb_schedule *sch, rb_count_cb cb, void *ud)
{
    faults_store *fs = FS(s);
    if (!inner_usable(fs) || fs->closed) { cb(ud, "store closed", 0); return; }
    fs->inner->vt->schedule(fs->inner, sch, cb, ud);
}
static void pt_unschedule(rb_store *s, const char *name, rb_count_cb cb, void *ud)
{
    faults_store *fs = FS(s);
    if (!inner_usable(fs) || fs->closed) { cb(ud, "store closed", 0); return; }
    fs->inner->vt->unschedule(fs->inner, name, cb, ud);
}
static void pt_schedules(rb_store *s, rb_rows_cb cb, void *ud)
{
    faults_store *fs = FS(s);
    if (!inner_usable(fs) || fs->closed) { cb(ud, "store closed", NULL); return; }
    fs->inner->vt->schedules(fs->inner, cb, ud);
}
static void pt_schedule_fire(rb_store *s, const char *name, double due, double next,
                             const rb_enqueue_item *tick, rb_count_cb cb, void *ud)
{
    faults_store *fs = FS(s);
    if (!inner_usable(fs) || fs->closed) { cb(ud, "store closed", 0); return; }
    fs->inner->vt->schedule_fire(fs->inner, name, due, next, tick, cb, ud);
}

/* The inner store's in-process word (a local enqueue, a cancelled run) reaches whoever
 * listens on the wrapper, and whoever listened on the inner store before. */
static void fw_local_wakeup(void *ud)
{
    faults_store *fs = ud;
    if (fs->inner_wakeup) fs->inner_wakeup(fs->inner_hooks_ud);
    if (!fs->closed) rb_store_notify_local(&fs->base);
}

static void fw_local_cancelled(void *ud, const char *id, const char *token)
{
    faults_store *fs = ud;
    if (fs->inner_cancelled) fs->inner_cancelled(fs->inner_hooks_ud, id, token);
    if (!fs->closed) rb_store_cancelled(&fs->base, id, token);
}

static void fw_local_schedules(void *ud)
{
    faults_store *fs = ud;
    if (fs->inner_schedules) fs->inner_schedules(fs->inner_hooks_ud);
    if (!fs->closed) rb_store_schedules_changed(&fs->base);
}

void rb_faults_set_script(rb_store *s, const rb_fault_script *script)
{
    RB_ASSERT(rb_store_is_faults(s));
    FS(s)->script = script ? *script : (rb_fault_script){0};
}

int rb_faults_ready(rb_store *s)
{
    RB_ASSERT(rb_store_is_faults(s));
    int k = 0;
    for (fop *o = FS(s)->waiting; o; o = o->next) k += o->hold && o->ready;
    return k;
}

int rb_faults_release(rb_store *s)
{
    RB_ASSERT(rb_store_is_faults(s));
    faults_store *fs = FS(s);
    int k = 0;
    fs->refs++;
    for (fop *o = fs->waiting; o && !fs->closed;) {
        if (o->hold && o->ready) {
            deliver(o);     /* (unlinks o; the caller may start more) */
            k++;
            o = fs->waiting;
        } else {
            o = o->next;
        }
    }
    fs_unref(fs);
    return k;
}

rb_store_vtable *rb_faults_vtable(rb_store *s)
{
    RB_ASSERT(rb_store_is_faults(s));
    return &FS(s)->vt;
}

rb_store *rb_faults_wrap(rb_store *inner, const rb_faults_options *o, char *err, size_t errlen)
{
    if (!inner || !o) {
        snprintf(err, errlen, "faults: no store to wrap");
        return NULL;
    }
    for (int i = 0; i < RB_FOP_COUNT; i++) {
        const rb_fault_rates *r = &o->rates[i];
        if (!(r->fail >= 0 && r->lost >= 0 && r->late >= 0 && r->fail + r->lost <= 1 &&
              r->late <= 1)) {
            snprintf(err, errlen, "faults: rates of %s must be in [0, 1], fail + lost <= 1",
                     op_names[i]);
            return NULL;
        }
    }
    if (!(o->max_delay >= 0 && o->max_delay <= 3600)) {
        snprintf(err, errlen, "faults: max_delay must be in [0, 3600] s");
        return NULL;
    }
    if (!(o->min_delay >= 0 && o->min_delay <= o->max_delay)) {
        snprintf(err, errlen, "faults: min_delay must be in [0, max_delay]");
        return NULL;
    }
    faults_store *fs = rb_calloc(1, sizeof *fs);
    if (!fs || !(fs->base.table = rb_strdup(inner->table ? inner->table : ""))) {
        free(fs);
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    const rb_store_vtable *ivt = inner->vt;
    fs->opt = *o;
    if (!(fs->opt.stuck_after > 0)) fs->opt.stuck_after = 30;
    fs->inner = inner;
    fs->rng = o->seed;
    fs->refs = 1;
    fs->loop_thread = pthread_self();
    fs->vt = (rb_store_vtable){
        .name = ivt->name,
        .tx_exclusive = ivt->tx_exclusive,
        .claim_parallelism = ivt->claim_parallelism,
        .enqueue = ivt->enqueue ? fw_enqueue : NULL,
        .claim = ivt->claim ? fw_claim : NULL,
        .settle = ivt->settle ? fw_settle : NULL,
        .claim_settle = ivt->claim_settle ? fw_claim_settle : NULL,
        .get = ivt->get ? fw_get : NULL,
        .list = ivt->list ? fw_list : NULL,
        .stats = ivt->stats ? fw_stats : NULL,
        .kick = ivt->kick ? fw_kick : NULL,
        .purge = ivt->purge ? fw_purge : NULL,
        .lease = ivt->lease ? fw_lease : NULL,
        .begin = ivt->begin ? fw_begin : NULL,
        .tx_enqueue = ivt->tx_enqueue ? fw_tx_enqueue : NULL,
        .tx_exec = ivt->tx_exec ? fw_tx_exec : NULL,
        .tx_query = ivt->tx_query ? fw_tx_query : NULL,
        .tx_doc = ivt->tx_doc ? fw_tx_doc : NULL,
        .commit = ivt->commit ? fw_commit : NULL,
        .rollback = ivt->rollback ? fw_rollback : NULL,
        .set_wakeup = ivt->set_wakeup ? fw_set_wakeup : NULL,
        .close = fw_close,
        .begin_leased = ivt->begin_leased ? fw_begin_leased : NULL,
        .tx_holds = ivt->tx_holds ? fw_tx_holds : NULL,
        .topic_stats = ivt->topic_stats ? pt_topic_stats : NULL,
        .pending_topics = ivt->pending_topics ? pt_pending_topics : NULL,
        .bury = ivt->bury ? pt_bury : NULL,
        .cancel = ivt->cancel ? pt_cancel : NULL,
        .remove = ivt->remove ? pt_remove : NULL,
        .progress = ivt->progress ? pt_progress : NULL,
        .pause = ivt->pause ? pt_pause : NULL,
        .paused = ivt->paused ? pt_paused : NULL,
        .cancel_all = ivt->cancel_all ? pt_cancel_all : NULL,
        .schedule = ivt->schedule ? pt_schedule : NULL,
        .unschedule = ivt->unschedule ? pt_unschedule : NULL,
        .schedules = ivt->schedules ? pt_schedules : NULL,
        .schedule_fire = ivt->schedule_fire ? pt_schedule_fire : NULL,
    };
    fs->base.vt = &fs->vt;
    fs->base.loop = inner->loop;
    fs->inner_wakeup = inner->local_wakeup;
    fs->inner_cancelled = inner->local_cancelled;
    fs->inner_schedules = inner->local_schedules;
    fs->inner_hooks_ud = inner->local_wakeup_ud;
    inner->local_wakeup = fw_local_wakeup;
    inner->local_cancelled = fw_local_cancelled;
    inner->local_schedules = fw_local_schedules;
    inner->local_wakeup_ud = fs;
    ev_async_init(&fs->async, on_async);
    fs->async.data = fs;
    ev_async_start(fs->base.loop, &fs->async);
    ev_unref(fs->base.loop);    /* the hand-over watcher alone does not keep the loop running */
    pthread_mutex_lock(&reg_mu);
    fs->serial = next_serial++ & 0xffff;
    fs->next_live = live;
    live = fs;
    pthread_mutex_unlock(&reg_mu);
    return &fs->base;
}

int rb_store_is_faults(const rb_store *s) { return s && s->vt && s->vt->close == fw_close; }


int rb_faults_stats(rb_store *s, rb_fault_stats *st)
{
    if (!rb_store_is_faults(s)) return -1;
    faults_store *fs = FS(s);
    memset(st, 0, sizeof *st);
    st->seed = fs->opt.seed;
    memcpy(st->calls, fs->calls, sizeof st->calls);
    memcpy(st->injected, fs->injected, sizeof st->injected);
    st->sync_answers = fs->sync_answers;
    st->held = fs->held;
    st->multiline = fs->multiline;
    st->unanswered = fs->unanswered;
    double now = rb_monotonic();
    for (fop *o = fs->waiting; o; o = o->next) {
        st->waiting++;
        if (o->in_inner) {
            st->in_inner++;
            if (now - o->sent_at > fs->opt.stuck_after) st->stuck++;
        }
    }
    pthread_mutex_lock(&reg_mu);
    st->twice = fs->twice;
    st->wrong_thread = fs->wrong_thread;
    st->err_with_result = fs->err_with_result;
    pthread_mutex_unlock(&reg_mu);
    return 0;
}
