/* settle_test.c -- coalesced settles: the writes made in one loop iteration reach the store in
 * one settle call; a call the store refuses is retried with a doubling delay, each of its
 * writes alone, so one write the store cannot take fails only itself; a store that refuses
 * everything gets a handful of calls a second, and a write refused until the run's lease ends
 * leaves the delivery to that lease. The store double counts the calls. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "harness.h"
#include "util/log.h"

#define T "work"

static th_handler *holding(th_env *e, size_t n, const rb_dispatcher_options *o, th_ids *ids)
{
    *ids = th_enqueue(e, T, n, 0, 0);
    th_dispatcher(e, o);
    th_handler *h = th_new_handler(e);
    th_handle(e, h, T);
    rb_dispatcher_start(e->d);
    TH_RUN_UNTIL(e, h->starts == (int)n, 10);
    assert_int_equal(h->starts, (int)n);
    th_run_for(e, 0.02);
    return h;
}

/* Finishes every live run of h from one timer callback: one loop iteration. */
typedef struct finish_all { th_handler *h; int ok; ev_timer t; int done; } finish_all;

static void on_finish_all(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    finish_all *f = w->data;
    for (th_run *r = f->h->live; r; r = r->next)
        if (r->run) th_finish(r, f->ok, f->ok ? NULL : "boom");
    f->done = 1;
}

static void finish_all_at_once(th_env *e, th_handler *h)
{
    finish_all f = {.h = h, .ok = 1};
    ev_timer_init(&f.t, on_finish_all, 0, 0);
    f.t.data = &f;
    ev_timer_start(e->loop, &f.t);
    TH_RUN_UNTIL(e, f.done, 10);
    ev_timer_stop(e->loop, &f.t);
    assert_true(f.done);
}

static void runs_ending_in_one_iteration_settle_in_one_call(void **state)
{
    th_env *e = th_env_of(state);
    th_ids ids;
    th_handler *h = holding(e, 50, NULL, &ids);
    assert_int_equal(e->spy->settle_calls, 0);
    finish_all_at_once(e, h);
    TH_RUN_UNTIL(e, h->settles == 50, 10);
    assert_int_equal(h->settles, 50);
    assert_int_equal(e->spy->settle_calls, 1);
    assert_int_equal(e->spy->batch[0], 50);
    assert_int_equal(e->spy->kinds[RB_OP_COMPLETE], 50);
    assert_int_equal(th_stats(e).completed, 50);
    th_ids_free(&ids);
}

static void runs_ending_inside_start_settle_in_one_call(void **state)
{
    th_env *e = th_env_of(state);
    th_ids ids = th_enqueue(e, T, 30, 0, 0);
    th_dispatcher(e, NULL);
    th_handler *h = th_new_handler(e);
    h->on_start = th_start_ok;
    th_handle(e, h, T);
    rb_dispatcher_start(e->d);
    TH_RUN_UNTIL(e, h->settles == 30, 10);
    assert_int_equal(h->settles, 30);
    assert_int_equal(e->spy->claim_calls >= 1, 1);
    /* one claim brought all 30 (the batch is up to concurrency / claim_parallelism) */
    assert_int_equal(e->spy->settle_calls, 1);
    assert_int_equal(e->spy->batch[0], 30);
    th_ids_free(&ids);
}

static void a_refused_batch_is_retried_after_a_delay_each_write_alone(void **state)
{
    th_env *e = th_env_of(state);
    th_ids ids;
    th_handler *h = holding(e, 10, NULL, &ids);
    e->spy->refuse_settles = 1;
    finish_all_at_once(e, h);
    TH_RUN_UNTIL(e, h->settles == 10, 10);
    assert_int_equal(h->settles, 10);
    assert_int_equal(e->spy->refused, 1);
    assert_int_equal(e->spy->settle_calls, 11);
    assert_int_equal(e->spy->batch[0], 10);
    for (int i = 1; i < 11; i++) {
        assert_int_equal(e->spy->batch[i], 1);
        assert_true(e->spy->batch_at[i] - e->spy->batch_at[0] >= 0.045);   /* RETRY_FIRST */
    }
    assert_int_equal(th_stats(e).completed, 10);
    th_ids_free(&ids);
}

/* The store cannot take one write: the batch with it fails, the nine others go through alone,
 * and that one is tried again by itself, less and less often, until the store takes it. */
static void one_write_the_store_refuses_fails_only_itself(void **state)
{
    th_env *e = th_env_of(state);
    th_ids ids;
    th_handler *h = holding(e, 10, NULL, &ids);
    snprintf(e->spy->refuse_id, sizeof e->spy->refuse_id, "%s", ids.id[3]);
    finish_all_at_once(e, h);
    TH_RUN_UNTIL(e, h->settles == 9, 10);
    assert_int_equal(h->settles, 9);
    assert_int_equal(th_status(e, ids.id[3]), RB_PROCESSING);
    th_run_for(e, 0.5);
    int calls = e->spy->settle_calls;
    /* 1 batch + 10 alone, then the refused one again at +0.1, +0.3 (+0.7 s after the first) */
    assert_true(calls >= 11 + 2 && calls <= 11 + 4);
    for (int i = 2; i < calls && i < TH_MAX_CALLS; i++)
        assert_int_equal(e->spy->batch[i], 1);
    e->spy->refuse_id[0] = 0;
    TH_RUN_UNTIL(e, h->settles == 10, 5);
    assert_int_equal(h->settles, 10);
    assert_int_equal(th_stats(e).completed, 10);
    th_ids_free(&ids);
}

static void a_store_refusing_every_settle_is_not_spun_on(void **state)
{
    th_env *e = th_env_of(state);
    th_ids ids;
    th_handler *h = holding(e, 20, NULL, &ids);
    e->spy->refuse_settles = -1;
    double t0 = rb_monotonic();
    finish_all_at_once(e, h);
    th_run_for(e, 1.5);
    double took = rb_monotonic() - t0;
    int calls = e->spy->settle_calls;
    /* per write: 0, +0.05, +0.15, +0.35, +0.75 (+1.55) s: at most 6 each, not one per
     * iteration; the first call holds all 20 */
    print_message("# %d settle calls in %.2f s for 20 writes the store refuses\n", calls, took);
    assert_true(calls >= 1 + 20 * 3);
    assert_true(calls <= 1 + 20 * 6);
    assert_int_equal(h->settles, 0);
    /* the log says so a few times, not once per call */
    assert_true(e->warnings <= 2 * (RB_LOG_BURST + 1));
    /* once the store takes writes again, they go through */
    e->spy->refuse_settles = 0;
    TH_RUN_UNTIL(e, h->settles == 20, 5);
    assert_int_equal(h->settles, 20);
    assert_int_equal(th_stats(e).completed, 20);
    th_ids_free(&ids);
}

static void a_write_refused_until_the_lease_ends_leaves_the_delivery_to_it(void **state)
{
    th_env *e = th_env_of(state);
    rb_dispatcher_options o;
    th_options(e, &o);
    o.lease_duration = 0.6;     /* local deadline 0.4 s after the claim */
    th_ids ids;
    th_handler *h = holding(e, 1, &o, &ids);
    e->spy->refuse_settles = -1;
    finish_all_at_once(e, h);
    TH_RUN_UNTIL(e, h->settles == 1, 5);
    assert_int_equal(h->settles, 1);
    assert_non_null(strstr(e->last_warning, "left to its lease"));
    assert_true(e->spy->settle_calls >= 2 && e->spy->settle_calls <= 6);
    rb_delivery *d = th_get(e, ids.id[0]);
    assert_int_equal(d->status, RB_PROCESSING);
    assert_int_equal(d->attempts, 1);
    rb_delivery_free(d);
    th_ids_free(&ids);
}

#define BOTH(name, fn) TH_TEST(sqlite_memory, name, fn), TH_TEST(postgresql, name, fn)

int main(void)
{
    const struct CMUnitTest tests[] = {
        BOTH("runs that end in one loop iteration settle in one store call",
             runs_ending_in_one_iteration_settle_in_one_call),
        BOTH("runs that end inside start, from one claim, settle in one store call",
             runs_ending_inside_start_settle_in_one_call),
        BOTH("a refused batch is retried after a delay, each write alone",
             a_refused_batch_is_retried_after_a_delay_each_write_alone),
        BOTH("one write the store refuses fails only itself, and is retried less and less often",
             one_write_the_store_refuses_fails_only_itself),
        BOTH("a store that refuses every settle gets a handful of calls a second",
             a_store_refusing_every_settle_is_not_spun_on),
        BOTH("a write refused until the run's lease ends leaves the delivery to its lease",
             a_write_refused_until_the_lease_ends_leaves_the_delivery_to_it),
    };
    return cmocka_run_group_tests_name("settle", tests, NULL, NULL);
}
