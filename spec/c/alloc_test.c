/* alloc_test.c -- the allocation-failure run, as Lua's own testes do it: for each N of a range,
 * the Nth allocation of the core fails (rb_alloc_fail_nth) and a full cycle runs (open a store,
 * enqueue 20, start a dispatcher, drain, stop, free). No N may crash, hang or leak, and every
 * delivery must end completed (only after its handler returned) or claimable again once its
 * lease has run out: none lost, none written twice. A fifth of them run in a transactional
 * handler that writes a row of its own: the row is there exactly when the delivery is
 * completed.
 *
 * Each N runs in a child process of its own: its pools, registries and caches start empty, so
 * allocations a long-lived process would have made once are counted (and failed) too, and a
 * crash names its N. The child reports one line on a pipe; under LeakSanitizer it checks for
 * leaks before it exits. RB_ALLOC_FROM / RB_ALLOC_TO narrow the range (default 1..400);
 * RB_ALLOC_ONE=N runs one cycle in the test's own process, for a debugger. The cycles run on
 * SQLite here, on PostgreSQL in alloc_pg_test (this file built with ALLOC_PG), so that the
 * two programs run side by side. */
#include <errno.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/wait.h>
#include "harness.h"
#include "util/log.h"

#define T "work"
#define TX "tx"                         /* a transactional handler's topic */
#define DELIVERIES 20
#define TX_EVERY 4                      /* every 4th delivery goes to TX */
#define LEASE 0.15

typedef struct cycle {
    struct ev_loop *loop;
    rb_store *store;
    rb_dispatcher *d;
    int nret;
    char returned[4 * DELIVERIES][24];  /* ids whose handler returned ok (repeats kept) */
    int stopped, quiet;
    int retries;                        /* calls made again after a failure */
    ev_timer tick;
} cycle;

static cycle C;
static const char *store_url = "sqlite::memory:";
static int pg;              /* the cycles run on PostgreSQL (RELAYBUS_TEST_PG) */

static void noop(struct ev_loop *l, ev_timer *w, int ev) { (void)l; (void)w; (void)ev; }

static void step_until(int *flag, double timeout)
{
    double end = rb_monotonic() + timeout;
    while (!*flag && rb_monotonic() < end) ev_run(C.loop, EVRUN_ONCE);
}

/* ---- the handler ------------------------------------------------------------------------------
 * By id % 4: returns ok inside start; returns ok a little later; fails its first attempt with
 * a message (retried at once: backoff 0), then returns ok; completes explicitly (ctx:complete),
 * then returns ok (or fails when the complete was not applied). */
typedef struct later { ev_timer t; rb_run *run; } later;

static void returned(rb_run *run)
{
    if (C.nret < 4 * DELIVERIES)
        snprintf(C.returned[C.nret++], sizeof C.returned[0], "%s", rb_run_delivery(run)->id);
}

static void on_later(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    later *l = w->data;
    rb_run *run = l->run;
    l->run = NULL;
    returned(run);
    rb_run_finish(run, 1, NULL);
}

/* A complete that was not applied fails the run, like a webhook's refused settle: so a
 * delivery completed although its explicit complete said no would be the dispatcher's doing. */
static void on_completed(void *ud, const char *err, int applied)
{
    (void)err;
    rb_run *run = ud;
    if (applied) {
        returned(run);
        rb_run_finish(run, 1, NULL);
    } else {
        rb_run_finish(run, 0, "the complete was not applied");
    }
}

static double no_backoff(int attempts, void *ud) { (void)attempts; (void)ud; return 0; }

static void h_start(rb_run *run, void *ud)
{
    (void)ud;
    const rb_delivery *rec = rb_run_delivery(run);
    int mode = atoi(rec->id) % 4;
    if (mode == 2 && rec->attempts == 1) {
        rb_run_finish(run, 0, "the first attempt fails, with a message of some length");
        return;
    }
    if (mode == 3) {
        rb_run_settle(run, RB_OP_COMPLETE, 0, NULL, on_completed, run);
        return;
    }
    if (mode != 1) {
        returned(run);
        rb_run_finish(run, 1, NULL);
        return;
    }
    later *l = calloc(1, sizeof *l);
    if (!l) { returned(run); rb_run_finish(run, 1, NULL); return; }
    l->run = run;
    ev_timer_init(&l->t, on_later, 0.002, 0);
    l->t.data = l;
    ev_timer_start(C.loop, &l->t);
    rb_run_set_data(run, l);
}

/* A run aborted while waiting returns at once (the shutdown's abort, a lost lease). */
static void h_abort(rb_run *run, rb_abort_reason reason, void *ud)
{
    (void)reason; (void)ud;
    later *l = rb_run_get_data(run);
    if (l && l->run) {
        ev_timer_stop(C.loop, &l->t);
        l->run = NULL;
        rb_run_finish(run, 0, "aborted");
    }
}

static void h_settled(rb_run *run, void *ud)
{
    (void)ud;
    later *l = rb_run_get_data(run);
    if (l) {
        ev_timer_stop(C.loop, &l->t);
        free(l);
        rb_run_set_data(run, NULL);
    }
}

/* The transactional handler writes one row of its own (the delivery's id) in the run's
 * transaction: committed with the completion, or not at all. */
static void on_effect(void *ud, const char *err, int64_t count)
{
    (void)count;
    rb_run *run = ud;
    if (err) {
        rb_run_finish(run, 0, err);
        return;
    }
    returned(run);
    rb_run_finish(run, 1, NULL);
}

static void tx_start(rb_run *run, void *ud)
{
    (void)ud;
    rb_tx *tx = rb_run_tx(run);
    if (!tx) { rb_run_finish(run, 0, "no transaction"); return; }
    char sql[160];
    snprintf(sql, sizeof sql, "INSERT INTO %s_fx (id) VALUES ('%s')", C.store->table,
             rb_run_delivery(run)->id);
    C.store->vt->tx_exec(tx, sql, NULL, 0, on_effect, run);
}

static void on_stopped(rb_dispatcher *d, void *ud) { (void)d; (void)ud; C.stopped++; }
static void on_quiet(rb_dispatcher *d, void *ud) { (void)d; (void)ud; C.quiet++; }
static void on_done(void *ud) { (*(int *)ud)++; }

/* ---- store calls that may fail -------------------------------------------------------------- */
typedef struct answer { int done; int failed; char ids[DELIVERIES][24]; size_t n; rb_stats st; } answer;

static void on_ids(void *ud, const char *err, char **ids, const unsigned char *kept, size_t n)
{
    (void)kept;
    answer *a = ud;
    a->done = 1;
    a->failed = err != NULL;
    for (size_t i = 0; !err && i < n && i < DELIVERIES; i++)
        snprintf(a->ids[i], sizeof a->ids[i], "%s", ids[i]);
    a->n = err ? 0 : n;
}

static void on_claimed(void *ud, const char *err, rb_claim_result *res)
{
    answer *a = ud;
    a->done = 1;
    a->failed = err != NULL;
    a->n = res ? res->n : 0;
    if (res) rb_delivery_list_free(res->recs, res->n);
}

static void on_one(void *ud, const char *err, rb_delivery **recs, size_t n)
{
    rb_delivery **out = ud;
    if (!err && n) { *out = recs[0]; recs[0] = NULL; }
    rb_delivery_list_free(recs, n);
    if (!*out) *out = (rb_delivery *)-1;    /* answered: no such delivery */
}

static void on_stats(void *ud, const char *err, const rb_stats *st)
{
    answer *a = ud;
    a->done = 1;
    a->failed = err != NULL;
    if (st) a->st = *st;
}

static int is_returned(const char *id)
{
    for (int i = 0; i < C.nret; i++)
        if (strcmp(C.returned[i], id) == 0) return 1;
    return 0;
}

typedef struct sql_wait { int done; int failed; rb_tx *tx; char ids[DELIVERIES][24]; int n; } sql_wait;

static void on_begun(void *ud, const char *err, rb_tx *tx)
{
    sql_wait *w = ud;
    w->done = 1;
    w->failed = err != NULL;
    w->tx = tx;
}

static void on_exec(void *ud, const char *err, int64_t count)
{
    (void)count;
    sql_wait *w = ud;
    w->done = 1;
    w->failed = err != NULL;
}

static void on_rows(void *ud, const char *err, rb_rowset *rs)
{
    sql_wait *w = ud;
    w->done = 1;
    w->failed = err != NULL || !rs;
    for (size_t r = 0; rs && r < rs->nrows && w->n < DELIVERIES; r++) {
        const rb_value *v = &rs->vals[r * (size_t)rs->ncols];
        if (v->type == RB_VTEXT) snprintf(w->ids[w->n++], sizeof w->ids[0], "%s", v->s);
    }
    rb_rowset_free(rs);
}

static void on_end(void *ud, const char *err)
{
    sql_wait *w = ud;
    w->done = 1;
    w->failed = err != NULL;
}

/* One statement in a transaction of its own; 0 when it went through. rows: the first column
 * of each row, for a query. */
static int sql(const char *text, sql_wait *rows)
{
    sql_wait b = {0}, x = {0}, c = {0};
    C.store->vt->begin(C.store, on_begun, &b);
    step_until(&b.done, 10);
    if (b.failed || !b.tx) return -1;
    if (rows) C.store->vt->tx_query(b.tx, text, NULL, 0, on_rows, rows);
    else C.store->vt->tx_exec(b.tx, text, NULL, 0, on_exec, &x);
    sql_wait *w = rows ? rows : &x;
    step_until(&w->done, 10);
    if (w->failed) {
        C.store->vt->rollback(b.tx, on_end, &c);
        step_until(&c.done, 10);
        return -1;
    }
    C.store->vt->commit(b.tx, NULL, on_end, &c);
    step_until(&c.done, 10);
    return c.failed ? -1 : 0;
}

static int effects(const char *id, const sql_wait *rows)
{
    int k = 0;
    for (int i = 0; i < rows->n; i++) k += strcmp(rows->ids[i], id) == 0;
    return k;
}

/* ---- one cycle, in the child ------------------------------------------------------------------- */
/* PostgreSQL: the table of a slot (one per child running at once) is emptied before the
 * cycle, with no failure armed, so cycles after the first need no schema work. */
static int empty_slot(const rb_store_options *so, char *err, size_t errlen)
{
    C.store = rb_store_open(C.loop, store_url, so, err, errlen);
    if (!C.store) return -1;
    char text[200];
    const char *const stmts[] = {"DELETE FROM %s", "CREATE TABLE IF NOT EXISTS %s_fx (id TEXT)",
                                 "DELETE FROM %s_fx"};
    int rc = 0;
    for (size_t i = 0; rc == 0 && i < sizeof stmts / sizeof stmts[0]; i++) {
        snprintf(text, sizeof text, stmts[i], so->table);
        rc = sql(text, NULL);
    }
    C.store->vt->close(C.store);
    C.store = NULL;
    if (rc) snprintf(err, errlen, "cannot empty %s", so->table);
    return rc;
}

static int cycle_run(long n, int slot, char *report, size_t cap)
{
    C.loop = ev_loop_new(EVFLAG_AUTO);
    ev_timer_init(&C.tick, noop, 0.002, 0.002);
    ev_timer_start(C.loop, &C.tick);
    rb_log_set_level(RB_LOG_OFF);
    char err[300] = "", table[64];
    snprintf(table, sizeof table, "ct_alloc_%ld_%d", (long)getppid(), slot);
    rb_store_options so = {table, 1};
    if (pg && empty_slot(&so, err, sizeof err) != 0)
        return snprintf(report, cap, "FAIL before the cycle: %s", err), 1;
    long before = rb_alloc_fail_nth(n);

    for (int i = 0; i < 3 && !C.store; i++) {
        C.store = rb_store_open(C.loop, store_url, pg ? &so : NULL, err, sizeof err);
        if (!C.store) C.retries++;
    }
    if (!C.store) return snprintf(report, cap, "FAIL cannot open the store: %s", err), 1;

    char create[160];
    snprintf(create, sizeof create, "CREATE TABLE IF NOT EXISTS %s_fx (id TEXT)", C.store->table);
    int made = -1;
    for (int i = 0; i < 3 && made != 0; i++) {
        if (i) C.retries++;
        made = sql(create, NULL);
    }
    if (made != 0) return snprintf(report, cap, "FAIL cannot create the effects table"), 1;

    answer enq = {0};
    rb_enqueue_item items[DELIVERIES];
    for (int i = 0; i < DELIVERIES; i++)
        items[i] = (rb_enqueue_item){.topic = i % TX_EVERY == 0 ? TX : T, .payload = "{}",
                                     .max_attempts = 25};
    for (int i = 0; i < 3 && enq.n != DELIVERIES; i++) {
        if (i) C.retries++;
        enq = (answer){0};
        C.store->vt->enqueue(C.store, items, DELIVERIES, on_ids, &enq);
        step_until(&enq.done, 10);
    }
    if (enq.n != DELIVERIES) return snprintf(report, cap, "FAIL enqueue failed twice"), 1;

    rb_dispatcher_options o;
    rb_dispatcher_options_init(&o);
    o.lease_duration = LEASE;
    o.poll_interval = 0.02;
    o.on_stopped = on_stopped;
    o.on_quiet = on_quiet;
    o.backoff = no_backoff;
    for (int i = 0; i < 3 && !C.d; i++) {
        C.d = rb_dispatcher_new(C.store, &o);
        if (!C.d) C.retries++;
    }
    rb_handler_def h = {.start = h_start, .abort = h_abort, .settled = h_settled};
    rb_handler_def htx = {.start = tx_start, .transactional = 1};
    int handled = -1, handled_tx = -1;
    for (int i = 0; i < 3 && handled != 0; i++) {
        handled = rb_dispatcher_handle(C.d, T, &h);
        if (handled) C.retries++;
    }
    for (int i = 0; i < 3 && handled_tx != 0; i++) {
        handled_tx = rb_dispatcher_handle(C.d, TX, &htx);
        if (handled_tx) C.retries++;
    }
    handled |= handled_tx;
    if (!C.d || handled) return snprintf(report, cap, "FAIL no dispatcher or handler"), 1;
    /* a start that runs out of memory starts nothing and may be tried again */
    int started = -1;
    for (int i = 0; i < 3 && started != 0; i++) {
        started = rb_dispatcher_start(C.d);
        if (started) C.retries++;
    }
    if (started) return snprintf(report, cap, "FAIL the dispatcher would not start"), 1;

    /* drain: until all are completed, or a while (deliveries left to a lease come back) */
    double end = rb_monotonic() + 3;
    for (;;) {
        answer st = {0};
        C.store->vt->stats(C.store, on_stats, &st);
        step_until(&st.done, 10);
        if (!st.failed && st.st.completed == DELIVERIES) break;
        if (rb_monotonic() > end) break;
        double t = rb_monotonic() + 0.01;
        while (rb_monotonic() < t) ev_run(C.loop, EVRUN_ONCE);
    }

    int done = 0;
    rb_dispatcher_stop(C.d, 1.0, on_done, &done);
    step_until(&done, 5);
    int done_called = done;
    step_until(&C.quiet, 5);
    int stopped = C.stopped, quiet = C.quiet;
    rb_dispatcher_free(C.d);
    C.d = NULL;
    long fired = rb_alloc_fail_nth(0) - before;

    /* what the store holds: completed only after a return; the rest claimable after its lease;
     * a transactional delivery's row there exactly when it is completed */
    int completed = 0, open = 0, bad = 0;
    char why[200] = "";
    sql_wait fx = {0};
    char query[160];
    snprintf(query, sizeof query, "SELECT id FROM %s_fx", C.store->table);
    if (sql(query, &fx) != 0) {
        bad++;
        snprintf(why, sizeof why, "cannot read the effects");
    }
    for (int i = 0; i < DELIVERIES; i++) {
        rb_delivery *rec = NULL;
        C.store->vt->get(C.store, enq.ids[i], on_one, &rec);
        while (!rec) ev_run(C.loop, EVRUN_ONCE);
        if (rec == (rb_delivery *)-1) {
            bad++;
            snprintf(why, sizeof why, "delivery %s is gone", enq.ids[i]);
            continue;
        }
        if (strcmp(rec->topic, TX) == 0 && effects(rec->id, &fx) != (rec->status == RB_COMPLETED)) {
            bad++;
            snprintf(why, sizeof why, "%s is %s with %d rows of its own", rec->id,
                     rb_status_name(rec->status), effects(rec->id, &fx));
        }
        if (rec->status == RB_COMPLETED) {
            completed++;
            if (!is_returned(rec->id)) {
                bad++;
                snprintf(why, sizeof why, "%s completed but its handler never returned", rec->id);
            }
        } else if (rec->status == RB_PENDING || rec->status == RB_PROCESSING) {
            open++;
        } else {
            bad++;
            snprintf(why, sizeof why, "%s is %s (%s)", rec->id, rb_status_name(rec->status),
                     rec->last_error ? rec->last_error : "");
        }
        rb_delivery_free(rec);
    }
    size_t claimable = 0;
    if (open) {
        double t = rb_monotonic() + LEASE + 0.05;
        while (rb_monotonic() < t) ev_run(C.loop, EVRUN_ONCE);
        const char *topics[] = {T, TX};
        rb_claim_req req = {topics, 2, DELIVERIES, 30};
        answer cl = {0};
        C.store->vt->claim(C.store, &req, on_claimed, &cl);
        step_until(&cl.done, 10);
        claimable = cl.n;
    }
    answer st = {0};
    C.store->vt->stats(C.store, on_stats, &st);
    step_until(&st.done, 10);
    int64_t total = st.st.pending + st.st.processing + st.st.completed + st.st.buried;
    C.store->vt->close(C.store);
    ev_timer_stop(C.loop, &C.tick);
    ev_loop_destroy(C.loop);

    int ok = !bad && (size_t)open == claimable && done_called == 1 && stopped == 1 && quiet == 1 &&
             total == DELIVERIES;
    if (!why[0] && (size_t)open != claimable)
        snprintf(why, sizeof why, "%d deliveries open but %zu claimable after the lease", open,
                 claimable);
    if (!why[0] && done_called != 1) snprintf(why, sizeof why, "the stop's done came %d times", done_called);
    if (!why[0] && (stopped != 1 || quiet != 1))
        snprintf(why, sizeof why, "on_stopped %d times, on_quiet %d times", stopped, quiet);
    if (!why[0] && total != DELIVERIES)
        snprintf(why, sizeof why, "the store holds %lld deliveries, not %d", (long long)total,
                 DELIVERIES);
    snprintf(report, cap, "%s fired=%ld completed=%d open=%d retries=%d %s", ok ? "OK" : "FAIL",
             fired, completed, open, C.retries, why);
    return ok ? 0 : 1;
}

/* ---- the parent -------------------------------------------------------------------------------- */
typedef struct result { int ok, fired, crashed, hung, leaked; char line[400]; } result;

typedef struct child {
    long n;
    int slot;
    pid_t pid;
    int fd;
    double started;
} child;

static long child_n;

static void on_crash(int sig)
{
    char line[80];
    int len = snprintf(line, sizeof line, "# N=%ld: signal %d in the child, at:\n", child_n, sig);
    if (write(2, line, (size_t)len) < 0) {}
    void *frames[32];
    backtrace_symbols_fd(frames, backtrace(frames, 32), 2);
    signal(sig, SIG_DFL);
    raise(sig);
}

static int child_start(child *c, long n, int slot)
{
    int fds[2];
    if (pipe(fds) != 0) return -1;
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
        close(fds[0]);
        close(fds[1]);
        return -1;
    }
    if (pid == 0) {
        child_n = n;
        /* cmocka's handlers would catch a crash here and go on running tests in the child:
         * the child prints where it crashed and dies of it */
        int sigs[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
        for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) signal(sigs[i], on_crash);
        close(fds[0]);
        char report[400];
        int rc = cycle_run(n, slot, report, sizeof report);
        int leaked = th_leak_check();
        char line[460];
        int len = snprintf(line, sizeof line, "%s%s\n", report, leaked ? " LEAK" : "");
        if (write(fds[1], line, (size_t)len) < 0) {}
        _exit(rc || leaked ? 1 : 0);
    }
    close(fds[1]);
    *c = (child){n, slot, pid, fds[0], rb_monotonic()};
    return 0;
}

/* The child's result once it has ended (1), or 0 while it runs; a child past 30 s is killed. */
static int child_reap(child *c, result *r)
{
    int status = 0;
    pid_t got = waitpid(c->pid, &status, WNOHANG);
    if (got == 0 && rb_monotonic() < c->started + 30) return 0;
    memset(r, 0, sizeof *r);
    if (got == 0) {
        kill(c->pid, SIGKILL);
        waitpid(c->pid, &status, 0);
        r->hung = 1;
    }
    ssize_t k = read(c->fd, r->line, sizeof r->line - 1);
    r->line[k > 0 ? k : 0] = 0;
    r->line[strcspn(r->line, "\n")] = 0;
    close(c->fd);
    r->crashed = !r->hung && WIFSIGNALED(status);
    r->leaked = strstr(r->line, " LEAK") != NULL;
    r->ok = !r->hung && WIFEXITED(status) && WEXITSTATUS(status) == 0 &&
            strncmp(r->line, "OK", 2) == 0;
    r->fired = strstr(r->line, "fired=1") != NULL;
    if (r->crashed) {
        char tail[40];
        snprintf(tail, sizeof tail, " (killed by signal %d)", WTERMSIG(status));
        strncat(r->line, tail, sizeof r->line - strlen(r->line) - 1);
    }
    return 1;
}

static result run_child(long n)
{
    child c;
    result r = {0};
    if (child_start(&c, n, 15) != 0) {
        snprintf(r.line, sizeof r.line, "fork: %s", strerror(errno));
        return r;
    }
    while (!child_reap(&c, &r)) {
        struct timespec ts = {0, 2000000};
        nanosleep(&ts, NULL);
    }
    return r;
}

static long env_long(const char *name, long def)
{
    const char *v = getenv(name);
    return v && *v ? strtol(v, NULL, 10) : def;
}

static long last_fired;     /* the highest N whose failure fired so far, on this store */

/* The store of the test (its cmocka state): SQLite in memory, or PostgreSQL when
 * RELAYBUS_TEST_PG is set (skipped otherwise, failed when CI=true). */
static void use_store(void **state)
{
    th_kind kind = state && *state ? *(th_kind *)*state : TH_SQLITE_MEMORY;
    int want_pg = kind == TH_POSTGRESQL;
    if (want_pg != pg) last_fired = 0;
    pg = want_pg;
    if (!pg) {
        store_url = "sqlite::memory:";
        return;
    }
    store_url = getenv("RELAYBUS_TEST_PG");
    if (store_url && *store_url) return;
    const char *ci = getenv("CI");
    if (ci && (!strcmp(ci, "true") || !strcmp(ci, "1")))
        fail_msg("RELAYBUS_TEST_PG is not set (and CI=true)");
    print_message("# skipped: RELAYBUS_TEST_PG is not set\n");
    skip();
}

/* The range RB_ALLOC_FROM..RB_ALLOC_TO (default 1..400), in four tests of a quarter each. The
 * cycles mostly wait (for a lease to run out, after a failure that left a delivery to it), so
 * RB_ALLOC_JOBS of them (default 4) run at once. */
static void allocation_failures(void **state, int quarter)
{
    use_store(state);
    long lo = env_long("RB_ALLOC_FROM", 1), hi = env_long("RB_ALLOC_TO", 400);
    long jobs = env_long("RB_ALLOC_JOBS", 4);
    if (jobs < 1) jobs = 1;
    if (jobs > 16) jobs = 16;
    /* Under AddressSanitizer a fork costs 30 ms: there the PostgreSQL cycles, slower, take
     * every third N (the plain build's run takes them all). */
    long stride = env_long("RB_ALLOC_STRIDE", pg && th_lsan_active() ? 3 : 1);
    if (stride < 1) stride = 1;
    long span = (hi - lo + 1 + 3) / 4;
    long from = lo + quarter * span, to = from + span - 1;
    if (to > hi) to = hi;
    if (from > to) skip();
    if (from > last_fired + (40 + jobs) * stride && last_fired > 0) {
        print_message("# N=%ld..%ld not run: the last cycle to reach its Nth allocation was "
                      "N=%ld\n", from, to, last_fired);
        return;
    }
    int bad = 0, fired = 0, leaks = 0, running = 0;
    child kids[16];
    double t0 = rb_monotonic();
    long next = from;
    if (last_fired < from - 1) last_fired = from - 1;
    while (next <= to || running) {
        /* 40 Ns in a row past every allocation a cycle makes: the rest would not fail either */
        if (next - last_fired > (40 + jobs) * stride && next <= to) {
            print_message("# N=%ld..%ld not run: the last cycle to reach its Nth allocation "
                          "was N=%ld\n", next, to, last_fired);
            to = next - 1;
        }
        while (next <= to && running < jobs) {
            int slot = 0;       /* a slot no running child has */
            for (int busy = 1; busy; slot += busy) {
                busy = 0;
                for (int i = 0; i < running; i++) busy |= kids[i].slot == slot;
            }
            if (child_start(&kids[running], next, slot) != 0) fail_msg("fork: %s", strerror(errno));
            running++;
            next += stride;
        }
        for (int i = 0; i < running; i++) {
            result r;
            if (!child_reap(&kids[i], &r)) continue;
            long n = kids[i].n;
            if (getenv("RB_ALLOC_VERBOSE"))
                print_message("# N=%ld %.3f s: %s\n", n, rb_monotonic() - kids[i].started, r.line);
            fired += r.fired;
            if (r.fired && n > last_fired) last_fired = n;
            leaks += r.leaked;
            if (!r.ok) {
                bad++;
                print_message("# N=%ld: %s%s%s\n", n, r.hung ? "hung " : "",
                              r.crashed ? "crashed " : "", r.line[0] ? r.line : "(no report)");
            }
            kids[i--] = kids[--running];
        }
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    print_message("# N=%ld..%ld%s: the failure fired in %d cycles, %d failed (%d leaked), %.1f s\n",
                  from, to, stride > 1 ? " (in steps)" : "", fired, bad, leaks,
                  rb_monotonic() - t0);
    assert_int_equal(bad, 0);
}

static void alloc_q1(void **state) { allocation_failures(state, 0); }
static void alloc_q2(void **state) { allocation_failures(state, 1); }
static void alloc_q3(void **state) { allocation_failures(state, 2); }
static void alloc_q4(void **state) { allocation_failures(state, 3); }

/* The cycle itself, with no failure: it passes, so a failure above is the failure's doing. */
static void the_cycle_passes_without_a_failure(void **state)
{
    use_store(state);
    result r = run_child(0);
    if (!r.ok) fail_msg("%s", r.line);
    assert_false(r.fired);
}

#define CYCLES(kind, store) \
    {store ": a full cycle with no allocation failing keeps every delivery", \
     the_cycle_passes_without_a_failure, NULL, NULL, &th_##kind}, \
    {store ": allocation N fails, first quarter of N = 1..400: no crash, leak or lost delivery", \
     alloc_q1, NULL, NULL, &th_##kind}, \
    {store ": allocation N fails, second quarter", alloc_q2, NULL, NULL, &th_##kind}, \
    {store ": allocation N fails, third quarter", alloc_q3, NULL, NULL, &th_##kind}, \
    {store ": allocation N fails, last quarter", alloc_q4, NULL, NULL, &th_##kind}

int main(void)
{
    /* RB_ALLOC_ONE=N: that one cycle, in this process (for a debugger) */
    if (getenv("RB_ALLOC_ONE")) {
#ifdef ALLOC_PG
        pg = 1;
        store_url = getenv("RELAYBUS_TEST_PG");
        if (!store_url) return fprintf(stderr, "RELAYBUS_TEST_PG is not set\n"), 2;
#endif
        char report[400];
        int rc = cycle_run(env_long("RB_ALLOC_ONE", 0), 0, report, sizeof report);
        printf("%s\n", report);
        return rc;
    }
    const struct CMUnitTest tests[] = {
#ifdef ALLOC_PG
        CYCLES(postgresql, "postgresql"),
#else
        CYCLES(sqlite_memory, "sqlite_memory"),
#endif
    };
    return cmocka_run_group_tests_name("alloc", tests, NULL, NULL);
}
