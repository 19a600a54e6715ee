/* harness.c -- the shared parts of the C tests (harness.h): environments on a private loop,
 * the counting store double, blocking store helpers, the recording handler, leak checks. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "harness.h"
#include "util/log.h"

th_kind th_sqlite_memory = TH_SQLITE_MEMORY, th_sqlite_file = TH_SQLITE_FILE,
        th_postgresql = TH_POSTGRESQL;

/* ---- leaks -------------------------------------------------------------------------------- */
/* Present only in a binary built with AddressSanitizer or LeakSanitizer. */
extern int __lsan_do_recoverable_leak_check(void) __attribute__((weak));

static int leak_reported;   /* a leak was reported: later checks would report it again */

/* The value of the last "detect_leaks=" in opts (the sanitizers read flags in order), or -1. */
static int last_detect_leaks(const char *opts)
{
    int v = -1;
    for (const char *p = opts; p && (p = strstr(p, "detect_leaks=")); p += 13) v = p[13] == '1';
    return v;
}

int th_lsan_active(void)
{
    if (!__lsan_do_recoverable_leak_check) return 0;
    /* LSAN_OPTIONS is read after ASAN_OPTIONS: its setting wins; leaks are on by default */
    int l = last_detect_leaks(getenv("LSAN_OPTIONS")), a = last_detect_leaks(getenv("ASAN_OPTIONS"));
    return l >= 0 ? l : a != 0;
}

int th_leak_check(void)
{
    if (leak_reported || !__lsan_do_recoverable_leak_check) return 0;
    if (__lsan_do_recoverable_leak_check()) {
        leak_reported = 1;
        return 1;
    }
    return 0;
}

/* ---- the store double ------------------------------------------------------------------- */
/* The wrapper's script: counts each call and says what becomes of it, as the test set. */
static void spy_call(void *ud, const rb_fault_call *call, rb_fault_plan *plan)
{
    th_spy *p = ud;
    switch (call->op) {
    case RB_FOP_CLAIM:
        if (p->claim_calls < TH_MAX_CALLS) p->claim_limit[p->claim_calls] = call->claim->limit;
        p->claim_calls++;
        if (++p->claims_in_flight > p->max_claims_in_flight)
            p->max_claims_in_flight = p->claims_in_flight;
        if (p->refuse_claims != 0) {
            if (p->refuse_claims > 0) p->refuse_claims--;
            plan->refuse = "claim refused by the test";
        } else if (p->claim_delay > 0 && p->delay_claims != 0) {
            if (p->delay_claims > 0) p->delay_claims--;
            plan->delay = p->claim_delay;
        } else {
            plan->hold = p->hold_claims;
        }
        break;
    case RB_FOP_SETTLE: {
        if (p->settle_calls < TH_MAX_CALLS) {
            p->batch[p->settle_calls] = call->nops;
            p->batch_at[p->settle_calls] = rb_monotonic();
        }
        p->settle_calls++;
        p->settle_writes += call->nops;
        int mine = 0;
        for (size_t i = 0; i < call->nops; i++) {
            if ((unsigned)call->ops[i].kind < 5) p->kinds[call->ops[i].kind]++;
            mine |= p->refuse_id[0] && call->ops[i].id && strcmp(call->ops[i].id, p->refuse_id) == 0;
        }
        if (p->refuse_settles != 0 || (p->refuse_batches && call->nops > 1) || mine) {
            if (p->refuse_settles > 0) p->refuse_settles--;
            p->refused++;
            plan->refuse = "refused by the test";
        }
        plan->delay = p->settle_delay;
        break;
    }
    case RB_FOP_BEGIN:
        p->begins++;
        if (p->refuse_begins != 0) {
            if (p->refuse_begins > 0) p->refuse_begins--;
            plan->refuse = "begin refused by the test";
        }
        plan->delay = p->begin_delay;
        break;
    case RB_FOP_PURGE:
        p->purges++;
        break;
    default:
        break;
    }
}

static void spy_answered(void *ud, rb_fault_op op)
{
    th_spy *p = ud;
    if (op == RB_FOP_CLAIM) p->claims_in_flight--;
}

int th_spy_answer_claims(th_spy *p) { return rb_faults_release(p->store); }
int th_spy_held(const th_spy *p) { return rb_faults_ready(p->store); }

/* The real store behind the wrapper (which owns it, and closes it with itself), counted. */
static th_spy *spy_new(rb_store *real)
{
    th_spy *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    rb_faults_options o;
    rb_faults_options_init(&o, 1);
    o.own_inner = 1;
    char err[256];
    if (!(p->store = rb_faults_wrap(real, &o, err, sizeof err))) {
        fprintf(stderr, "# the store double: %s\n", err);
        free(p);
        return NULL;
    }
    p->real = real;
    p->vt = rb_faults_vtable(p->store);
    rb_faults_set_script(p->store, &(rb_fault_script){.ud = p, .call = spy_call,
                                                      .answered = spy_answered});
    return p;
}

/* ---- environments ------------------------------------------------------------------------- */
static void on_tick(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)w; (void)revents;
}

static void log_sink(rb_log_level level, const char *line, void *ud)
{
    (void)level;
    th_env *e = ud;
    e->warnings++;
    snprintf(e->last_warning, sizeof e->last_warning, "%s", line);
    if (getenv("TH_VERBOSE")) fprintf(stderr, "# relaybus: %s\n", line);
}

static int ci(void)
{
    const char *v = getenv("CI");
    return v && (strcmp(v, "true") == 0 || strcmp(v, "1") == 0);
}

static rb_store *open_real(th_env *e)
{
    char err[400] = "";
    rb_store *s = NULL;
    if (e->kind == TH_SQLITE_MEMORY) {
        s = rb_store_open(e->loop, "sqlite::memory:", NULL, err, sizeof err);
    } else if (e->kind == TH_SQLITE_FILE) {
        const char *tmp = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
        snprintf(e->path, sizeof e->path, "%s/relaybus-ctest-XXXXXX", tmp);
        int fd = mkstemp(e->path);
        if (fd < 0) {
            snprintf(e->why, sizeof e->why, "mkstemp: %s", strerror(errno));
            return NULL;
        }
        close(fd);
        unlink(e->path);    /* the store makes it itself, 0600 */
        char url[300];
        snprintf(url, sizeof url, "sqlite:%s", e->path);
        s = rb_store_open(e->loop, url, NULL, err, sizeof err);
    } else {
        const char *url = getenv("RELAYBUS_TEST_PG");
        if (!url || !*url) {
            snprintf(e->why, sizeof e->why, "RELAYBUS_TEST_PG is not set");
            return NULL;
        }
        static int counter;
        char table[64];
        snprintf(table, sizeof table, "ct_%ld_%d_%d", (long)getpid(), (int)rb_wall_time() % 100000,
                 ++counter);
        rb_store_options o = {table, 1};
        s = rb_store_open(e->loop, url, &o, err, sizeof err);
    }
    if (!s) snprintf(e->why, sizeof e->why, "cannot open the store: %s", err);
    return s;
}

int th_setup(void **state)
{
    th_kind kind = state && *state ? *(th_kind *)*state : TH_SQLITE_MEMORY;
    th_env *e = calloc(1, sizeof *e);
    if (!e) return -1;
    e->kind = kind;
    e->loop = ev_loop_new(EVFLAG_AUTO);
    if (!e->loop) { free(e); return -1; }
    ev_timer_init(&e->tick, on_tick, 0.002, 0.002);
    ev_timer_start(e->loop, &e->tick);
    rb_log_set_sink(log_sink, e);
    rb_store *real = open_real(e);
    if (real) {
        e->spy = spy_new(real);
        if (!e->spy) { real->vt->close(real); return -1; }
        e->store = e->spy->store;
    } else {
        e->unavailable = 1;
    }
    *state = e;
    return 0;
}

th_env *th_env_of(void **state)
{
    th_env *e = *state;
    if (e->unavailable) {
        if (ci()) fail_msg("store not available (and CI=true): %s", e->why);
        print_message("# skipped: %s\n", e->why);
        skip();
    }
    return e;
}

int th_teardown(void **state)
{
    th_env *e = *state;
    if (!e) return 0;
    rb_alloc_fail_nth(0);
    if (e->d) rb_dispatcher_free(e->d);
    e->d = NULL;
    if (e->store) e->store->vt->close(e->store);
    free(e->spy);
    for (int i = 0; i < e->nhandlers; i++) free(e->handlers[i]);
    rb_log_set_sink(NULL, NULL);
    ev_timer_stop(e->loop, &e->tick);
    ev_loop_destroy(e->loop);
    if (e->path[0]) {
        char p[300];
        unlink(e->path);
        snprintf(p, sizeof p, "%s-wal", e->path);
        unlink(p);
        snprintf(p, sizeof p, "%s-shm", e->path);
        unlink(p);
    }
    free(e);
    *state = NULL;
    if (th_leak_check()) {
        print_message("# LeakSanitizer found a leak in this test (report above)\n");
        return -1;
    }
    return 0;
}

int th_step(th_env *e, double end)
{
    if (rb_monotonic() >= end) return 0;
    ev_run(e->loop, EVRUN_ONCE);
    return 1;
}

void th_run_for(th_env *e, double seconds)
{
    double end = rb_monotonic() + seconds;
    while (th_step(e, end)) {}
}

void th_record(th_env *e, char what, rb_abort_reason reason, const char *id)
{
    if (e->nevents >= TH_MAX_EVENTS) return;
    th_event *ev = &e->ev[e->nevents++];
    ev->what = what;
    ev->reason = reason;
    snprintf(ev->id, sizeof ev->id, "%s", id ? id : "");
}

int th_find_event(const th_env *e, char what, const char *id, int from)
{
    for (int i = from < 0 ? 0 : from; i < e->nevents; i++)
        if (e->ev[i].what == what && (!id || strcmp(e->ev[i].id, id) == 0)) return i;
    return -1;
}

int th_count_events(const th_env *e, char what, const char *id)
{
    int n = 0;
    for (int i = 0; i < e->nevents; i++)
        if (e->ev[i].what == what && (!id || strcmp(e->ev[i].id, id) == 0)) n++;
    return n;
}

/* ---- dispatchers ---------------------------------------------------------------------------- */
static void on_stopped(rb_dispatcher *d, void *ud)
{
    th_env *e = ud;
    assert_ptr_equal(d, e->d);
    e->stopped++;
    th_record(e, 'P', 0, NULL);
}

static void on_quiet(rb_dispatcher *d, void *ud)
{
    th_env *e = ud;
    assert_ptr_equal(d, e->d);
    e->quiet++;
    th_record(e, 'Q', 0, NULL);
    if (e->free_in_quiet) {
        rb_dispatcher_free(d);
        e->d = NULL;
    }
}

void th_options(th_env *e, rb_dispatcher_options *o)
{
    rb_dispatcher_options_init(o);
    o->poll_interval = 0.05;
    o->on_stopped = on_stopped;
    o->on_stopped_ud = e;
    o->on_quiet = on_quiet;
    o->on_quiet_ud = e;
}

rb_dispatcher *th_dispatcher(th_env *e, const rb_dispatcher_options *o)
{
    rb_dispatcher_options def;
    if (!o) {
        th_options(e, &def);
        o = &def;
    }
    e->d = rb_dispatcher_new(e->store, o);
    assert_non_null(e->d);
    return e->d;
}

static void on_stop_done(void *ud)
{
    th_env *e = ud;
    e->stop_done++;
    th_record(e, 'W', 0, NULL);
}

void th_stop(th_env *e, double timeout)
{
    int before = e->stop_done;
    rb_dispatcher_stop(e->d, timeout, on_stop_done, e);
    TH_RUN_UNTIL(e, e->stop_done > before, timeout + 10);
    assert_true(e->stop_done > before);
}

/* ---- blocking store helpers ------------------------------------------------------------- */
typedef struct waiter {
    int done;
    char err[256];
    th_ids ids;
    rb_delivery **recs;
    size_t n;
    rb_stats st;
} waiter;

static void wait_for(th_env *e, waiter *w, const char *what)
{
    TH_RUN_UNTIL(e, w->done, 30);
    if (!w->done) fail_msg("%s: the store did not answer in 30 s", what);
}

static void on_ids(void *ud, const char *err, char **ids, const unsigned char *kept, size_t n)
{
    (void)kept;
    waiter *w = ud;
    w->done = 1;
    if (err) { snprintf(w->err, sizeof w->err, "%s", err); return; }
    w->ids.n = n;
    w->ids.id = calloc(n + 1, sizeof *w->ids.id);
    for (size_t i = 0; i < n; i++) w->ids.id[i] = strdup(ids[i]);
}

th_ids th_enqueue(th_env *e, const char *topic, size_t n, double delay, int max_attempts)
{
    rb_enqueue_item *items = calloc(n ? n : 1, sizeof *items);
    assert_non_null(items);
    for (size_t i = 0; i < n; i++) {
        items[i].topic = topic;
        items[i].payload = "{}";
        items[i].delay = delay;
        items[i].max_attempts = max_attempts > 0 ? max_attempts : 25;
    }
    waiter w = {0};
    rb_store *real = e->spy->real;
    real->vt->enqueue(real, items, n, on_ids, &w);
    free(items);
    wait_for(e, &w, "enqueue");
    if (w.err[0]) fail_msg("enqueue: %s", w.err);
    assert_int_equal(w.ids.n, n);
    return w.ids;
}

void th_ids_free(th_ids *ids)
{
    for (size_t i = 0; ids->id && i < ids->n; i++) free(ids->id[i]);
    free(ids->id);
    ids->id = NULL;
    ids->n = 0;
}

static void on_records(void *ud, const char *err, rb_delivery **recs, size_t n)
{
    waiter *w = ud;
    w->done = 1;
    if (err) snprintf(w->err, sizeof w->err, "%s", err);
    w->recs = recs;
    w->n = n;
}

static void on_claimed(void *ud, const char *err, rb_claim_result *res)
{
    waiter *w = ud;
    w->done = 1;
    if (err) snprintf(w->err, sizeof w->err, "%s", err);
    if (res) {
        w->recs = res->recs;
        w->n = res->n;
    }
}

rb_delivery *th_get(th_env *e, const char *id)
{
    waiter w = {0};
    rb_store *real = e->spy->real;
    real->vt->get(real, id, on_records, &w);
    wait_for(e, &w, "get");
    if (w.err[0]) fail_msg("get %s: %s", id, w.err);
    rb_delivery *d = w.n ? w.recs[0] : NULL;
    for (size_t i = 1; i < w.n; i++) rb_delivery_free(w.recs[i]);
    free(w.recs);
    return d;
}

int th_status(th_env *e, const char *id)
{
    rb_delivery *d = th_get(e, id);
    int s = d ? (int)d->status : -1;
    rb_delivery_free(d);
    return s;
}

static void on_stats(void *ud, const char *err, const rb_stats *st)
{
    waiter *w = ud;
    w->done = 1;
    if (err) snprintf(w->err, sizeof w->err, "%s", err);
    else w->st = *st;
}

rb_stats th_stats(th_env *e)
{
    waiter w = {0};
    rb_store *real = e->spy->real;
    real->vt->stats(real, on_stats, &w);
    wait_for(e, &w, "stats");
    if (w.err[0]) fail_msg("stats: %s", w.err);
    return w.st;
}

size_t th_claim(th_env *e, const char *topic, size_t limit, double lease)
{
    waiter w = {0};
    const char *topics[] = {topic};
    rb_claim_req req = {topics, 1, limit, lease};
    rb_store *real = e->spy->real;
    real->vt->claim(real, &req, on_claimed, &w);
    wait_for(e, &w, "claim");
    if (w.err[0]) fail_msg("claim: %s", w.err);
    rb_delivery_list_free(w.recs, w.n);
    return w.n;
}

/* ---- the recording handler ---------------------------------------------------------------- */
static void unlink_live(th_run *r)
{
    th_handler *h = r->h;
    if (r->prev) r->prev->next = r->next;
    else h->live = r->next;
    if (r->next) r->next->prev = r->prev;
    h->nlive--;
}

static void rec_start(rb_run *run, void *ud)
{
    th_handler *h = ud;
    const rb_delivery *rec = rb_run_delivery(run);
    assert_null(rb_run_get_data(run));
    th_run *r = calloc(1, sizeof *r);
    assert_non_null(r);
    r->h = h;
    r->run = run;
    snprintf(r->id, sizeof r->id, "%s", rec->id);
    r->attempts = rec->attempts;
    ev_init(&r->timer, NULL);
    r->next = h->live;
    if (h->live) h->live->prev = r;
    h->live = r;
    h->nlive++;
    rb_run_set_data(run, r);
    h->starts++;
    if (++h->running > h->max_running) h->max_running = h->running;
    th_record(h->env, 'S', 0, r->id);
    if (h->on_start) h->on_start(h, r);
}

static void rec_abort(rb_run *run, rb_abort_reason reason, void *ud)
{
    th_handler *h = ud;
    th_run *r = rb_run_get_data(run);
    assert_non_null(r);
    assert_int_equal(rb_run_aborted(run), reason);
    h->aborts++;
    th_record(h->env, 'A', reason, r->id);
    if (h->on_abort) h->on_abort(h, r, reason);
}

static void rec_settled(rb_run *run, void *ud)
{
    th_handler *h = ud;
    th_run *r = rb_run_get_data(run);
    if (!r) {                   /* settled without having started */
        h->unstarted_settles++;
        th_record(h->env, 'U', rb_run_aborted(run), rb_run_delivery(run)->id);
        return;
    }
    h->settles++;
    th_record(h->env, 'D', rb_run_aborted(run), r->id);
    if (h->on_settled) h->on_settled(h, r);
    ev_timer_stop(h->env->loop, &r->timer);
    if (r->run) h->running--;     /* settled without finishing: abandoned at a free */
    unlink_live(r);
    rb_run_set_data(run, NULL);
    free(r);
}

/* The dispatcher is being freed: runs it did not settle are gone with it. */
static void rec_free(void *ud)
{
    th_handler *h = ud;
    h->freed++;
    th_record(h->env, 'F', 0, NULL);
    while (h->live) {
        th_run *r = h->live;
        ev_timer_stop(h->env->loop, &r->timer);
        unlink_live(r);
        free(r);
    }
}

th_handler *th_new_handler(th_env *e)
{
    assert_true(e->nhandlers < 8);
    th_handler *h = calloc(1, sizeof *h);
    assert_non_null(h);
    h->env = e;
    e->handlers[e->nhandlers++] = h;
    return h;
}

void th_handle(th_env *e, th_handler *h, const char *topic)
{
    h->env = e;
    h->def.start = rec_start;
    h->def.abort = rec_abort;
    h->def.settled = rec_settled;
    h->def.free = rec_free;
    h->def.ud = h;
    assert_int_equal(rb_dispatcher_handle(e->d, topic, &h->def), 0);
}

void th_finish(th_run *r, int ok, const char *error)
{
    assert_non_null(r->run);
    rb_run *run = r->run;
    r->run = NULL;          /* finished: the run is the dispatcher's until settled */
    r->h->running--;
    ev_timer_stop(r->h->env->loop, &r->timer);
    rb_run_finish(run, ok, error);
}

static void on_finish_due(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    th_run *r = w->data;
    if (r->run) th_finish(r, r->ok, r->error[0] ? r->error : NULL);
}

void th_finish_after(th_run *r, double delay, int ok, const char *error)
{
    r->ok = ok;
    snprintf(r->error, sizeof r->error, "%s", error ? error : "");
    ev_timer_stop(r->h->env->loop, &r->timer);
    ev_timer_init(&r->timer, on_finish_due, delay, 0);
    r->timer.data = r;
    ev_timer_start(r->h->env->loop, &r->timer);
}

th_run *th_live_run(th_handler *h, const char *id)
{
    for (th_run *r = h->live; r; r = r->next)
        if (!id || strcmp(r->id, id) == 0) return r;
    return NULL;
}

void th_start_ok(th_handler *h, th_run *r) { (void)h; th_finish(r, 1, NULL); }
void th_start_fail(th_handler *h, th_run *r) { (void)h; th_finish(r, 0, "boom"); }
void th_start_later(th_handler *h, th_run *r) { th_finish_after(r, h->delay, 1, NULL); }

void th_abort_finish(th_handler *h, th_run *r, rb_abort_reason reason)
{
    (void)h; (void)reason;
    if (r->run) th_finish(r, 1, NULL);
}

void th_settle_cb(void *ud, const char *err, int applied)
{
    th_settle_result *res = ud;
    res->called++;
    res->applied = applied;
    snprintf(res->err, sizeof res->err, "%s", err ? err : "");
}
