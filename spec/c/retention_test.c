/* retention_test.c -- the dispatcher's retention (runtime/dispatch/retention.c) for a C host:
 * completed deliveries older than `retention` are deleted in batches, pending ones are kept;
 * 0 turns it off; a dispatcher freed with a purge of its retention in flight leaves nothing
 * behind when the answer comes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "harness.h"

#define T "work"

/* A dispatcher with this retention, started once n deliveries are enqueued, has completed
 * them all. Counted by the handler's settles, not by stats: a retention of 1 s may purge the
 * first completions before a slow drain ends. */
static void completes_all(th_env *e, double retention, size_t n)
{
    th_ids ids = th_enqueue(e, T, n, 0, 0);
    th_ids_free(&ids);
    rb_dispatcher_options o;
    th_options(e, &o);
    o.retention = retention;
    th_dispatcher(e, &o);
    th_handler *h = th_new_handler(e);
    h->on_start = th_start_ok;
    th_handle(e, h, T);
    rb_dispatcher_start(e->d);
    TH_RUN_UNTIL(e, h->settles == (int)n, 60);
    assert_int_equal(h->settles, (int)n);
}

static void retention_deletes_completed_older_than_it_in_batches(void **state)
{
    th_env *e = th_env_of(state);
    th_ids later = th_enqueue(e, "later", 3, 3600, 0);     /* pending: kept */
    completes_all(e, 1, 2500);     /* a period of 1 s; caught up, the lease is kept 1 s */
    TH_RUN_UNTIL(e, th_stats(e).completed == 0, 20);
    rb_stats st = th_stats(e);
    print_message("# %d purge calls\n", e->spy->purges);
    assert_int_equal(st.completed, 0);
    assert_int_equal(st.pending, 3);
    assert_true(e->spy->purges >= 3);       /* 1,000 at a time: at least 1,000 + 1,000 + 500 */
    for (size_t i = 0; i < later.n; i++) assert_int_equal(th_status(e, later.id[i]), RB_PENDING);
    th_ids_free(&later);
}

static void retention_zero_deletes_nothing(void **state)
{
    th_env *e = th_env_of(state);
    completes_all(e, 0, 50);
    th_run_for(e, 2.5);
    assert_int_equal(th_stats(e).completed, 50);
    assert_int_equal(e->spy->purges, 0);
}

static void options_check_refuses_a_retention_out_of_range(void **state)
{
    (void)state;
    const double bad[] = {-1, 0.0 / 0.0, 1.0 / 0.0, 3.2e9};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        rb_dispatcher_options o;
        rb_dispatcher_options_init(&o);
        o.retention = bad[i];
        char err[160] = "";
        assert_int_equal(rb_dispatcher_options_check(&o, err, sizeof err), -1);
        assert_non_null(strstr(err, "retention"));
    }
    rb_dispatcher_options o;
    rb_dispatcher_options_init(&o);
    assert_true(o.retention == 7 * 86400);
}

/* The purge is out when the host frees the dispatcher: its answer frees what retention kept
 * (LeakSanitizer, under ASan, would say otherwise), and the store closes cleanly after. */
static void a_dispatcher_freed_with_a_purge_in_flight_leaves_nothing(void **state)
{
    th_env *e = th_env_of(state);
    completes_all(e, 1, 10);
    TH_RUN_UNTIL(e, e->spy->purges >= 1, 10);
    assert_true(e->spy->purges >= 1);
    rb_dispatcher_free(e->d);       /* at once: on PostgreSQL the purge has not answered yet */
    e->d = NULL;
    th_run_for(e, 1.5);
    assert_int_equal(e->spy->purges, 1);    /* nothing more once freed */
    if (th_lsan_active()) assert_int_equal(th_leak_check(), 0);
}

#define BOTH(name, fn) TH_TEST(sqlite_memory, name, fn), TH_TEST(postgresql, name, fn)

int main(void)
{
    const struct CMUnitTest tests[] = {
        BOTH("retention deletes completed deliveries older than it, in batches, and keeps pending ones",
             retention_deletes_completed_older_than_it_in_batches),
        BOTH("retention 0 deletes nothing", retention_zero_deletes_nothing),
        {"rb_dispatcher_options_check refuses a retention that is not finite or out of range",
         options_check_refuses_a_retention_out_of_range, NULL, NULL, NULL},
        BOTH("a dispatcher freed with its retention's purge in flight leaves nothing behind",
             a_dispatcher_freed_with_a_purge_in_flight_leaves_nothing),
    };
    return cmocka_run_group_tests_name("retention", tests, NULL, NULL);
}
