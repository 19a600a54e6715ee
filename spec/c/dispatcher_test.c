/* dispatcher_test.c -- the run state machine of dispatcher.h with C handlers: start, finish
 * (ok, error, inside start, after an abort), settled; explicit settles and the return they make
 * ignored; deadlines (timeout, lease) seen by rb_run_check; a lost lease. Each test drives a
 * real store and checks what it holds afterwards. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "harness.h"

#define T "work"

/* One delivery through a handler; returns its id (static buffer). */
static const char *one(th_env *e, th_handler *h, int max_attempts, const rb_dispatcher_options *o)
{
    static char id[24];
    th_ids ids = th_enqueue(e, T, 1, 0, max_attempts);
    snprintf(id, sizeof id, "%s", ids.id[0]);
    th_ids_free(&ids);
    th_dispatcher(e, o);
    th_handle(e, h, T);
    rb_dispatcher_start(e->d);
    return id;
}

static void returns_ok_completes(void **state)
{
    th_env *e = th_env_of(state);
    th_handler *h = th_new_handler(e);
    h->on_start = th_start_later;
    h->delay = 0.01;
    const char *id = one(e, h, 0, NULL);
    TH_RUN_UNTIL(e, h->settles == 1, 10);
    assert_int_equal(h->starts, 1);
    assert_int_equal(h->settles, 1);
    assert_int_equal(h->aborts, 0);
    int s = th_find_event(e, 'S', id, 0);
    assert_true(s >= 0);
    assert_true(th_find_event(e, 'D', id, s) > s);
    rb_delivery *d = th_get(e, id);
    assert_non_null(d);
    assert_int_equal(d->status, RB_COMPLETED);
    assert_int_equal(d->attempts, 1);
    assert_null(d->last_error);
    assert_null(d->lease_token);
    rb_delivery_free(d);
    assert_int_equal(e->spy->kinds[RB_OP_COMPLETE], 1);
    assert_int_equal(rb_dispatcher_active(e->d), 0);
}

static double backoff_100(int attempts, void *ud)
{
    (void)ud;
    return 100 + attempts;
}

static void error_reschedules_after_backoff(void **state)
{
    th_env *e = th_env_of(state);
    rb_dispatcher_options o;
    th_options(e, &o);
    o.backoff = backoff_100;
    th_handler *h = th_new_handler(e);
    h->on_start = th_start_fail;
    double before = rb_wall_time();
    const char *id = one(e, h, 3, &o);
    TH_RUN_UNTIL(e, h->settles == 1, 10);
    assert_int_equal(h->settles, 1);
    rb_delivery *d = th_get(e, id);
    assert_int_equal(d->status, RB_PENDING);
    assert_int_equal(d->attempts, 1);
    assert_non_null(d->last_error);
    assert_string_equal(d->last_error, "boom");
    /* backoff(1) = 101 s from the store's now */
    assert_true(d->run_at >= before + 101 - 2);
    assert_true(d->run_at <= rb_wall_time() + 101 + 2);
    assert_null(d->lease_token);
    rb_delivery_free(d);
    assert_int_equal(e->spy->kinds[RB_OP_RESCHEDULE], 1);
}

static void error_at_max_attempts_buries(void **state)
{
    th_env *e = th_env_of(state);
    th_handler *h = th_new_handler(e);
    h->on_start = th_start_fail;
    const char *id = one(e, h, 1, NULL);
    TH_RUN_UNTIL(e, h->settles == 1, 10);
    rb_delivery *d = th_get(e, id);
    assert_int_equal(d->status, RB_BURIED);
    assert_int_equal(d->attempts, 1);
    assert_string_equal(d->last_error, "boom");
    rb_delivery_free(d);
    assert_int_equal(e->spy->kinds[RB_OP_BURY], 1);
}

/* The handler ends inside start: the run is still whole until start returns. */
static void finish_inside(th_handler *h, th_run *r)
{
    rb_run *run = r->run;
    char id[24];
    snprintf(id, sizeof id, "%s", r->id);
    th_finish(r, 1, NULL);
    /* the run's record is still readable: nothing was freed under the handler */
    assert_string_equal(rb_run_delivery(run)->id, id);
    h->ctx = (void *)(intptr_t)(h->settles + 1);    /* settles seen when start returned, + 1 */
}

static void finishing_inside_start_completes(void **state)
{
    th_env *e = th_env_of(state);
    th_handler *h = th_new_handler(e);
    h->on_start = finish_inside;
    const char *id = one(e, h, 0, NULL);
    TH_RUN_UNTIL(e, h->settles == 1, 10);
    assert_int_equal(h->starts, 1);
    assert_int_equal(h->settles, 1);
    assert_int_equal((intptr_t)h->ctx, 1);   /* settled came after start had returned */
    assert_int_equal(th_status(e, id), RB_COMPLETED);
    /* finish twice is ignored: nothing more is written */
    assert_int_equal(e->spy->settle_writes, 1);
}

/* ---- explicit settles ----------------------------------------------------------------------- */
typedef struct explicit_case {
    rb_settle_kind kind;
    double delay;
    const char *reason;
    int finish_ok;              /* what the handler returns after the settle was applied */
    rb_status status;           /* then the delivery is */
    int attempts;
    const char *last_error;
    double run_at_from_now;     /* pending: run_at - now, about */
} explicit_case;

typedef struct explicit_ctx {
    const explicit_case *c;
    th_settle_result first, second;
    th_run *r;
} explicit_ctx;

static void explicit_applied(void *ud, const char *err, int applied)
{
    explicit_ctx *x = ud;
    th_settle_cb(&x->first, err, applied);
    /* a second explicit settle is refused; the return is then ignored */
    rb_run_settle(x->r->run, RB_OP_COMPLETE, 0, NULL, th_settle_cb, &x->second);
    th_finish(x->r, x->c->finish_ok, x->c->finish_ok ? NULL : "ignored");
}

static void explicit_start(th_handler *h, th_run *r)
{
    explicit_ctx *x = h->ctx;
    x->r = r;
    rb_run_settle(r->run, x->c->kind, x->c->delay, x->c->reason, explicit_applied, x);
}

static void explicit_settle(void **state, const explicit_case *c)
{
    th_env *e = th_env_of(state);
    explicit_ctx x = {.c = c};
    th_handler *h = th_new_handler(e);
    h->on_start = explicit_start;
    h->ctx = &x;
    const char *id = one(e, h, 5, NULL);
    TH_RUN_UNTIL(e, h->settles == 1, 10);
    assert_int_equal(x.first.called, 1);
    assert_int_equal(x.first.applied, 1);
    assert_string_equal(x.first.err, "");
    assert_int_equal(x.second.called, 1);
    assert_int_equal(x.second.applied, 0);
    /* complete and bury keep the run going without a lease; a release or reschedule hands
     * the delivery back, so the run is aborted and a second settle says so */
    assert_string_equal(x.second.err, c->kind == RB_OP_RELEASE || c->kind == RB_OP_RESCHEDULE
                                          ? "aborted" : "already settled");
    rb_delivery *d = th_get(e, id);
    assert_int_equal(d->status, c->status);
    assert_int_equal(d->attempts, c->attempts);
    if (c->last_error) assert_string_equal(d->last_error ? d->last_error : "(null)", c->last_error);
    else assert_null(d->last_error);
    if (c->status == RB_PENDING) {
        double ahead = d->run_at - rb_wall_time();
        assert_true(ahead > c->run_at_from_now - 3 && ahead < c->run_at_from_now + 1);
    }
    rb_delivery_free(d);
    /* the explicit write and nothing for the return */
    assert_int_equal(e->spy->settle_writes, 1);
    assert_int_equal(e->spy->kinds[c->kind], 1);
}

static void explicit_complete_ignores_an_error_return(void **state)
{
    static const explicit_case c = {RB_OP_COMPLETE, 0, NULL, 0, RB_COMPLETED, 1, NULL, 0};
    explicit_settle(state, &c);
}

static void explicit_reschedule_ignores_the_return(void **state)
{
    static const explicit_case c = {RB_OP_RESCHEDULE, 50, "later", 1, RB_PENDING, 1, "later", 50};
    explicit_settle(state, &c);
}

static void explicit_bury_ignores_the_return(void **state)
{
    static const explicit_case c = {RB_OP_BURY, 0, "bad", 1, RB_BURIED, 1, "bad", 0};
    explicit_settle(state, &c);
}

static void explicit_release_gives_the_attempt_back(void **state)
{
    static const explicit_case c = {RB_OP_RELEASE, 30, NULL, 0, RB_PENDING, 0, NULL, 30};
    explicit_settle(state, &c);
}

/* Extending renews the lease; the return still settles. */
typedef struct extend_ctx {
    th_settle_result res;
    double deadline_before, deadline_after, expires_before, expires_after;
    th_run *r;
    th_env *e;
} extend_ctx;

static void extend_applied(void *ud, const char *err, int applied)
{
    extend_ctx *x = ud;
    th_settle_cb(&x->res, err, applied);
    x->deadline_after = rb_run_deadline(x->r->run);
}

static void extend_start(th_handler *h, th_run *r)
{
    extend_ctx *x = h->ctx;
    x->r = r;
    x->deadline_before = rb_run_deadline(r->run);
    x->expires_before = rb_run_delivery(r->run)->lease_expires_at;
    rb_run_settle(r->run, RB_OP_EXTEND, 60, NULL, extend_applied, x);
}

static void explicit_extend_renews_and_the_return_settles(void **state)
{
    th_env *e = th_env_of(state);
    rb_dispatcher_options o;
    th_options(e, &o);
    o.lease_duration = 5;
    extend_ctx x = {.e = e};
    th_handler *h = th_new_handler(e);
    h->on_start = extend_start;
    h->ctx = &x;
    const char *id = one(e, h, 0, &o);
    TH_RUN_UNTIL(e, x.res.called, 10);
    assert_int_equal(x.res.applied, 1);
    /* the local deadline moved to about 60 s less the margin; the store's expiry too */
    assert_true(x.deadline_after > x.deadline_before + 40);
    rb_delivery *d = th_get(e, id);
    assert_int_equal(d->status, RB_PROCESSING);
    assert_true(d->lease_expires_at > rb_wall_time() + 50);
    rb_delivery_free(d);
    th_finish(x.r, 1, NULL);
    TH_RUN_UNTIL(e, h->settles == 1, 10);
    assert_int_equal(th_status(e, id), RB_COMPLETED);
    assert_int_equal(e->spy->kinds[RB_OP_EXTEND], 1);
    assert_int_equal(e->spy->kinds[RB_OP_COMPLETE], 1);
}

/* ---- deadlines ------------------------------------------------------------------------------- */
typedef struct check_ctx {
    rb_abort_reason before, first, second;
    int aborts_inside_check;
    th_settle_result after;
    double deadline, started;
} check_ctx;

/* A handler that computes past its deadline without yielding, then asks the clock. */
static void spin_past_deadline(th_handler *h, th_run *r)
{
    check_ctx *x = h->ctx;
    x->started = rb_monotonic();
    x->deadline = rb_run_deadline(r->run);
    x->before = rb_run_check(r->run);
    while (rb_monotonic() <= x->deadline) {}
    int aborts = h->aborts;
    x->first = rb_run_check(r->run);
    x->aborts_inside_check = h->aborts - aborts;
    x->second = rb_run_check(r->run);
    rb_run_settle(r->run, RB_OP_COMPLETE, 0, NULL, th_settle_cb, &x->after);
    th_finish(r, 1, NULL);
}

static void check_past_timeout_aborts_and_fails_the_run(void **state)
{
    th_env *e = th_env_of(state);
    check_ctx x = {0};
    th_handler *h = th_new_handler(e);
    h->on_start = spin_past_deadline;
    h->ctx = &x;
    h->def.timeout = 0.05;
    const char *id = one(e, h, 0, NULL);
    TH_RUN_UNTIL(e, h->settles == 1, 10);
    assert_int_equal(x.before, RB_ABORT_NONE);
    assert_true(x.deadline >= x.started && x.deadline <= x.started + 0.06);
    assert_int_equal(x.first, RB_ABORT_TIMEOUT);
    assert_int_equal(x.aborts_inside_check, 1);     /* the abort callback, from the check */
    assert_int_equal(x.second, RB_ABORT_TIMEOUT);
    assert_int_equal(h->aborts, 1);                  /* once */
    assert_int_equal(x.after.called, 1);
    assert_int_equal(x.after.applied, 0);
    assert_string_equal(x.after.err, "aborted");
    rb_delivery *d = th_get(e, id);
    assert_int_equal(d->status, RB_PENDING);        /* as a raise: retried */
    assert_string_equal(d->last_error, "timeout");
    assert_int_equal(d->attempts, 1);
    rb_delivery_free(d);
}

static void check_past_lease_aborts_and_writes_nothing(void **state)
{
    th_env *e = th_env_of(state);
    rb_dispatcher_options o;
    th_options(e, &o);
    o.lease_duration = 0.5;     /* local deadline: 0.5 - margin 0.2 */
    check_ctx x = {0};
    th_handler *h = th_new_handler(e);
    h->on_start = spin_past_deadline;
    h->ctx = &x;
    const char *id = one(e, h, 0, &o);
    TH_RUN_UNTIL(e, h->settles == 1, 10);
    assert_int_equal(x.before, RB_ABORT_NONE);
    assert_true(x.deadline <= x.started + 0.31);
    assert_int_equal(x.first, RB_ABORT_LEASE);
    assert_int_equal(x.aborts_inside_check, 1);
    assert_int_equal(e->spy->settle_writes, 0);     /* the lease is gone: nothing is written */
    rb_delivery *d = th_get(e, id);
    assert_int_equal(d->status, RB_PROCESSING);     /* left to its lease */
    assert_int_equal(d->attempts, 1);
    rb_delivery_free(d);
}

/* The timeout aborts a waiting handler; finishing afterwards settles as "timeout". */
static void finish_after_timeout_abort_retries(void **state)
{
    th_env *e = th_env_of(state);
    th_handler *h = th_new_handler(e);
    h->on_abort = th_abort_finish;
    h->def.timeout = 0.1;
    double t0 = rb_monotonic();
    const char *id = one(e, h, 0, NULL);
    TH_RUN_UNTIL(e, h->settles == 1, 10);
    double took = rb_monotonic() - t0;
    assert_int_equal(h->aborts, 1);
    int a = th_find_event(e, 'A', id, 0);
    assert_true(a >= 0);
    assert_int_equal(e->ev[a].reason, RB_ABORT_TIMEOUT);
    assert_true(th_find_event(e, 'D', id, a) > a);
    assert_true(took >= 0.1);
    rb_delivery *d = th_get(e, id);
    assert_int_equal(d->status, RB_PENDING);
    assert_string_equal(d->last_error, "timeout");
    rb_delivery_free(d);
    assert_int_equal(e->spy->kinds[RB_OP_COMPLETE], 0);
}

static void on_stolen(void *ud, const char *err) { (void)err; *(int *)ud = 1; }

/* Someone takes the lease away (here: the row is released under the run's token); the next
 * renewal is not applied, the run is aborted with "lease" and its return writes nothing. */
static void lease_lost_at_renewal_aborts_and_writes_nothing(void **state)
{
    th_env *e = th_env_of(state);
    rb_dispatcher_options o;
    th_options(e, &o);
    o.lease_duration = 0.6;     /* renewed every 0.2 s */
    th_handler *h = th_new_handler(e);
    h->on_abort = th_abort_finish;
    const char *id = one(e, h, 0, &o);
    TH_RUN_UNTIL(e, h->starts == 1, 10);
    th_run *r = th_live_run(h, id);
    assert_non_null(r);
    /* released for later, so no claim here takes it meanwhile */
    rb_settle_op steal = {.kind = RB_OP_RELEASE, .id = id, .delay = 1000,
                          .token = rb_run_delivery(r->run)->lease_token};
    int done = 0;
    e->spy->real->vt->settle(e->spy->real, &steal, 1, on_stolen, &done);
    TH_RUN_UNTIL(e, done, 10);
    assert_int_equal(steal.applied, 1);
    TH_RUN_UNTIL(e, h->settles == 1, 10);
    assert_int_equal(h->aborts, 1);
    assert_int_equal(e->ev[th_find_event(e, 'A', id, 0)].reason, RB_ABORT_LEASE);
    assert_int_equal(e->spy->kinds[RB_OP_COMPLETE], 0);
    assert_true(e->spy->kinds[RB_OP_EXTEND] >= 1);
    rb_delivery *d = th_get(e, id);
    assert_int_equal(d->status, RB_PENDING);        /* as the thief left it */
    assert_int_equal(d->attempts, 0);
    rb_delivery_free(d);
}

/* The lease is renewed while the handler runs: it outlives several lease durations. */
static void a_long_run_keeps_its_lease(void **state)
{
    th_env *e = th_env_of(state);
    rb_dispatcher_options o;
    th_options(e, &o);
    /* renewed every 0.5 s; each renewal has a second to come back before the run's local
     * deadline, which a loaded CI machine's PostgreSQL needs (0.6 s leases failed there) */
    o.lease_duration = 1.5;
    th_handler *h = th_new_handler(e);
    h->on_start = th_start_later;
    h->delay = 2.0;
    const char *id = one(e, h, 0, &o);
    TH_RUN_UNTIL(e, h->settles == 1, 10);
    assert_int_equal(h->aborts, 0);
    assert_true(e->spy->kinds[RB_OP_EXTEND] >= 3);
    rb_delivery *d = th_get(e, id);
    assert_int_equal(d->status, RB_COMPLETED);
    assert_int_equal(d->attempts, 1);
    rb_delivery_free(d);
}

/* ---- transactional runs ------------------------------------------------------------------ */
typedef struct tx_wait { int done; char err[200]; int64_t count; } tx_wait;
typedef struct tx_wait_tx { tx_wait w; rb_tx *tx; } tx_wait_tx;

static void on_tx(void *ud, const char *err, rb_tx *tx)
{
    tx_wait_tx *b = ud;
    b->w.done = 1;
    snprintf(b->w.err, sizeof b->w.err, "%s", err ? err : "");
    b->tx = tx;
}

static void on_count(void *ud, const char *err, int64_t n)
{
    tx_wait *w = ud;
    w->done = 1;
    snprintf(w->err, sizeof w->err, "%s", err ? err : "");
    w->count = n;
}

static void on_rows(void *ud, const char *err, rb_rowset *rs)
{
    tx_wait *w = ud;
    w->done = 1;
    snprintf(w->err, sizeof w->err, "%s", err ? err : "");
    if (rs && rs->nrows == 1 && rs->ncols == 1) {
        const rb_value *v = &rs->vals[0];
        w->count = v->type == RB_VTEXT ? atoll(v->s) : v->type == RB_VFLOAT ? (int64_t)v->f : v->i;
    }
    rb_rowset_free(rs);
}

static void on_ended(void *ud, const char *err)
{
    tx_wait *w = ud;
    w->done = 1;
    snprintf(w->err, sizeof w->err, "%s", err ? err : "");
}

/* The application's own table, beside the deliveries: "<deliveries table>_fx". */
static const char *fx(th_env *e)
{
    static char name[96];
    snprintf(name, sizeof name, "%s_fx", e->store->table);
    return name;
}

/* Runs one statement in a transaction of its own; returns its count (rows, or changes). */
static int64_t in_tx(th_env *e, const char *sql, int query)
{
    rb_store *s = e->spy->real;
    tx_wait_tx b = {{0}, NULL};
    s->vt->begin(s, on_tx, &b);
    TH_RUN_UNTIL(e, b.w.done, 10);
    if (b.w.err[0] || !b.tx) fail_msg("begin: %s", b.w.err);
    tx_wait w = {0};
    if (query) s->vt->tx_query(b.tx, sql, NULL, 0, on_rows, &w);
    else s->vt->tx_exec(b.tx, sql, NULL, 0, on_count, &w);
    TH_RUN_UNTIL(e, w.done, 10);
    if (w.err[0]) fail_msg("%s: %s", sql, w.err);
    tx_wait c = {0};
    s->vt->commit(b.tx, NULL, on_ended, &c);
    TH_RUN_UNTIL(e, c.done, 10);
    if (c.err[0]) fail_msg("commit: %s", c.err);
    return w.count;
}

static int64_t fx_rows(th_env *e)
{
    char sql[160];
    snprintf(sql, sizeof sql, "SELECT count(*) FROM %s", fx(e));
    return in_tx(e, sql, 1);
}

typedef struct tx_ctx { int ok; th_env *e; tx_wait w; } tx_ctx;

static void on_inserted(void *ud, const char *err, int64_t n)
{
    th_run *r = ud;
    tx_ctx *x = r->h->ctx;
    snprintf(x->w.err, sizeof x->w.err, "%s", err ? err : "");
    x->w.count = n;
    th_finish(r, x->ok && !err, x->ok ? (err ? err : NULL) : "boom");
}

static void insert_in_the_run(th_handler *h, th_run *r)
{
    tx_ctx *x = h->ctx;
    rb_tx *tx = rb_run_tx(r->run);
    assert_non_null(tx);
    /* explicit settles other than extend are refused in a transactional run */
    th_settle_result res = {0};
    rb_run_settle(r->run, RB_OP_COMPLETE, 0, NULL, th_settle_cb, &res);
    assert_int_equal(res.called, 1);
    assert_int_equal(res.applied, 0);
    assert_non_null(strstr(res.err, "transactional"));
    char sql[160];
    snprintf(sql, sizeof sql, "INSERT INTO %s VALUES ('%s')", fx(x->e), r->id);
    x->e->store->vt->tx_exec(tx, sql, NULL, 0, on_inserted, r);     /* the run's store's transaction */
}

static void transactional(void **state, int ok)
{
    th_env *e = th_env_of(state);
    char sql[160];
    snprintf(sql, sizeof sql, "CREATE TABLE %s (id TEXT)", fx(e));
    in_tx(e, sql, 0);
    rb_dispatcher_options o;
    th_options(e, &o);
    o.backoff = backoff_100;
    static tx_ctx x;
    x = (tx_ctx){.ok = ok, .e = e};
    th_handler *h = th_new_handler(e);
    h->on_start = insert_in_the_run;
    h->ctx = &x;
    h->def.transactional = 1;
    const char *id = one(e, h, 5, &o);
    TH_RUN_UNTIL(e, h->settles == 1, 10);
    assert_int_equal(h->settles, 1);
    assert_string_equal(x.w.err, "");
    assert_int_equal(x.w.count, 1);
    rb_delivery *d = th_get(e, id);
    if (ok) {
        assert_int_equal(d->status, RB_COMPLETED);
        assert_int_equal(fx_rows(e), 1);            /* committed together */
    } else {
        assert_int_equal(d->status, RB_PENDING);
        assert_string_equal(d->last_error, "boom");
        assert_int_equal(fx_rows(e), 0);            /* rolled back */
    }
    rb_delivery_free(d);
    /* the completion went with the commit, not through a settle call */
    assert_int_equal(e->spy->kinds[RB_OP_COMPLETE], 0);
}

static void a_transactional_run_commits_its_writes_with_its_completion(void **state)
{
    transactional(state, 1);
}

static void a_failing_transactional_run_rolls_its_writes_back(void **state)
{
    transactional(state, 0);
}

static void a_transaction_that_cannot_begin_fails_the_run_unstarted(void **state)
{
    th_env *e = th_env_of(state);
    rb_dispatcher_options o;
    th_options(e, &o);
    o.backoff = backoff_100;
    e->spy->refuse_begins = 1;
    th_handler *h = th_new_handler(e);
    h->def.transactional = 1;
    const char *id = one(e, h, 5, &o);
    rb_delivery *d = NULL;
    TH_RUN_UNTIL(e, e->spy->kinds[RB_OP_RESCHEDULE] == 1, 10);
    th_run_for(e, 0.05);
    d = th_get(e, id);
    assert_int_equal(d->status, RB_PENDING);
    assert_int_equal(d->attempts, 1);
    assert_string_equal(d->last_error, "begin refused by the test");
    rb_delivery_free(d);
    assert_int_equal(h->starts, 0);
    print_message("# settled callbacks for the run that never started: %d\n",
                  h->unstarted_settles);
}

#define BOTH(name, fn) TH_TEST(sqlite_memory, name, fn), TH_TEST(postgresql, name, fn)

int main(void)
{
    const struct CMUnitTest tests[] = {
        BOTH("a run that returns completes its delivery, then settles", returns_ok_completes),
        BOTH("a run that fails is retried after backoff(attempts)", error_reschedules_after_backoff),
        BOTH("a run that fails at max_attempts buries its delivery", error_at_max_attempts_buries),
        BOTH("a run that finishes inside start completes", finishing_inside_start_completes),
        BOTH("ctx complete: the error return is ignored", explicit_complete_ignores_an_error_return),
        BOTH("ctx reschedule: the return is ignored", explicit_reschedule_ignores_the_return),
        BOTH("ctx bury: the return is ignored", explicit_bury_ignores_the_return),
        BOTH("ctx release: the attempt is not counted", explicit_release_gives_the_attempt_back),
        BOTH("ctx extend renews the lease and the return still settles",
             explicit_extend_renews_and_the_return_settles),
        BOTH("rb_run_check past the timeout aborts once, and the run is retried",
             check_past_timeout_aborts_and_fails_the_run),
        BOTH("rb_run_check past the lease aborts, and nothing is written",
             check_past_lease_aborts_and_writes_nothing),
        BOTH("finish after a timeout abort retries with last_error timeout",
             finish_after_timeout_abort_retries),
        BOTH("a lease lost at renewal aborts the run, and its return writes nothing",
             lease_lost_at_renewal_aborts_and_writes_nothing),
        BOTH("a run longer than its lease keeps it by renewals", a_long_run_keeps_its_lease),
        BOTH("a transactional run commits its writes with its completion",
             a_transactional_run_commits_its_writes_with_its_completion),
        BOTH("a failing transactional run rolls its writes back and is retried",
             a_failing_transactional_run_rolls_its_writes_back),
        BOTH("a transaction that cannot begin fails the run, which never starts",
             a_transaction_that_cannot_begin_fails_the_run_unstarted),
        TH_TEST(sqlite_file, "a run that returns completes its delivery, then settles",
                returns_ok_completes),
        TH_TEST(sqlite_file, "a transactional run commits its writes with its completion",
                a_transactional_run_commits_its_writes_with_its_completion),
    };
    return cmocka_run_group_tests_name("dispatcher", tests, NULL, NULL);
}
