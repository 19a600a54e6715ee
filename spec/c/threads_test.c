/* threads_test.c -- dispatchers on threads of their own, each with its own loop and store, as
 * a C host may run them (dispatcher.c keeps its pools per thread for that): a thread that
 * ran one and ended leaves nothing behind, and two running at once do not disturb each
 * other. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "harness.h"

#define T "work"

typedef struct worker {
    int n;                  /* deliveries */
    int concurrency;
    int started, settled, completed;
    int stopped, quiet, failed;
    char why[400];
    struct ev_loop *loop;
} worker;

static void w_start(rb_run *run, void *ud)
{
    worker *w = ud;
    w->started++;
    rb_run_finish(run, 1, NULL);
}

static void w_settled(rb_run *run, void *ud)
{
    (void)run;
    ((worker *)ud)->settled++;
}

static void w_stopped(rb_dispatcher *d, void *ud) { (void)d; ((worker *)ud)->stopped++; }
static void w_quiet(rb_dispatcher *d, void *ud) { (void)d; ((worker *)ud)->quiet++; }

typedef struct flag { int done; int64_t completed; } flag;
static void on_ids(void *ud, const char *err, char **ids, const unsigned char *kept, size_t n)
{
    (void)ids; (void)kept; (void)n;
    flag *f = ud;
    f->done = err ? -1 : 1;
}
static void on_stats(void *ud, const char *err, const rb_stats *st)
{
    flag *f = ud;
    f->done = err ? -1 : 1;
    if (st) f->completed = st->completed;
}
static void noop(struct ev_loop *l, ev_timer *t, int ev) { (void)l; (void)t; (void)ev; }

static void run_until(worker *w, int *cond, double timeout)
{
    double end = rb_monotonic() + timeout;
    while (!*cond && rb_monotonic() < end) ev_run(w->loop, EVRUN_ONCE);
}

/* One full cycle on the calling thread: open, enqueue n, run them all, stop, free, close. */
static void *cycle(void *arg)
{
    worker *w = arg;
    w->loop = ev_loop_new(EVFLAG_AUTO);
    ev_timer tick;
    ev_timer_init(&tick, noop, 0.002, 0.002);
    ev_timer_start(w->loop, &tick);
    char err[300];
    rb_store *s = rb_store_open(w->loop, "sqlite::memory:", NULL, err, sizeof err);
    if (!s) {
        snprintf(w->why, sizeof w->why, "open: %s", err);
        w->failed = 1;
        return NULL;
    }
    rb_enqueue_item *items = calloc((size_t)w->n, sizeof *items);
    for (int i = 0; i < w->n; i++)
        items[i] = (rb_enqueue_item){.topic = T, .payload = "{}", .max_attempts = 25};
    flag f = {0};
    s->vt->enqueue(s, items, (size_t)w->n, on_ids, &f);
    run_until(w, &f.done, 10);
    free(items);
    rb_dispatcher_options o;
    rb_dispatcher_options_init(&o);
    o.concurrency = w->concurrency;
    o.poll_interval = 0.02;
    o.on_stopped = w_stopped;
    o.on_stopped_ud = w;
    o.on_quiet = w_quiet;
    o.on_quiet_ud = w;
    rb_dispatcher *d = rb_dispatcher_new(s, &o);
    rb_handler_def h = {.start = w_start, .settled = w_settled, .ud = w};
    rb_dispatcher_handle(d, T, &h);
    rb_dispatcher_start(d);
    int all = 0;
    double end = rb_monotonic() + 60;
    while (!all && rb_monotonic() < end) {
        ev_run(w->loop, EVRUN_ONCE);
        all = w->settled >= w->n;
    }
    rb_dispatcher_stop(d, 1, NULL, NULL);
    run_until(w, &w->quiet, 5);
    rb_dispatcher_free(d);
    flag st = {0};
    s->vt->stats(s, on_stats, &st);
    run_until(w, &st.done, 10);
    w->completed = (int)st.completed;
    s->vt->close(s);
    ev_timer_stop(w->loop, &tick);
    ev_loop_destroy(w->loop);
    return NULL;
}

static void check(const worker *w)
{
    if (w->failed) fail_msg("%s", w->why);
    assert_int_equal(w->completed, w->n);
    assert_int_equal(w->started, w->n);
    assert_int_equal(w->stopped, 1);
    assert_int_equal(w->quiet, 1);
}

static void a_thread_that_ran_a_dispatcher_leaves_nothing_behind(void **state)
{
    (void)state;
    worker w = {.n = 200, .concurrency = 64};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, cycle, &w), 0);
    assert_int_equal(pthread_join(t, NULL), 0);
    check(&w);
    /* the runs and settle requests it pooled, and its registry, went with the thread */
    if (th_leak_check()) fail_msg("LeakSanitizer found memory the ended thread left (above)");
}

static void dispatchers_on_two_threads_do_not_disturb_each_other(void **state)
{
    (void)state;
    enum { THREADS = 2 };
    worker w[THREADS];
    pthread_t t[THREADS];
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < THREADS; i++) {
            w[i] = (worker){.n = 1000, .concurrency = 200};
            assert_int_equal(pthread_create(&t[i], NULL, cycle, &w[i]), 0);
        }
        for (int i = 0; i < THREADS; i++) assert_int_equal(pthread_join(t[i], NULL), 0);
        for (int i = 0; i < THREADS; i++) check(&w[i]);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        {"a thread that ran a dispatcher and ended leaves nothing behind",
         a_thread_that_ran_a_dispatcher_leaves_nothing_behind, NULL, NULL, NULL},
        {"dispatchers on two threads, each with its own loop and store, run side by side",
         dispatchers_on_two_threads_do_not_disturb_each_other, NULL, NULL, NULL},
    };
    return cmocka_run_group_tests_name("threads", tests, NULL, NULL);
}
