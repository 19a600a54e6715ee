/* timer_test.c -- the timers of an owned loop (runtime/util/timer.c) and the heap under them
 * (runtime/util/heap.c): whatever the order of starts, stops, restarts and firings, of one-shot
 * and repeating timers, rb_loop_timeout gives what a scan of every active timer gives. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <cmocka.h>
#include <ev.h>
#include "util/heap.h"
#include "util/timer.h"

#define NTIMERS 400

static int fired;
static void on_fire(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)w; (void)revents;
    fired++;
}

/* The earliest of the active timers, found by looking at each. */
static double scan(struct ev_loop *loop, rb_timer *t, size_t n)
{
    double best = -1;
    for (size_t i = 0; i < n; i++) {
        if (!rb_timer_active(&t[i])) continue;
        double r = rb_timer_remaining(loop, &t[i]);
        if (r < 0) r = 0;
        if (best < 0 || r < best) best = r;
    }
    return best;
}

static void timeout_is_the_earliest_active_timer(void **state)
{
    (void)state;
    struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
    assert_int_equal(rb_loop_own(loop), 0);
    static rb_timer t[NTIMERS];
    for (size_t i = 0; i < NTIMERS; i++) rb_timer_init(&t[i], on_fire, 0, 0);
    assert_true(rb_loop_timeout(loop) < 0);     /* nothing scheduled */
    unsigned seed = 7;
    for (int step = 0; step < 20000; step++) {
        rb_timer *x = &t[rand_r(&seed) % NTIMERS];
        switch (rand_r(&seed) % 6) {
        case 0: case 1: case 2:         /* start (a no-op when active), now and then repeating */
            if (!rb_timer_active(x))
                rb_timer_set(x, (rand_r(&seed) % 1000) * 1e-4, rand_r(&seed) % 4 ? 0 : 0.002);
            rb_timer_start(loop, x);
            break;
        case 3: case 4:
            rb_timer_stop(loop, x);
            break;
        default:                        /* let time pass and timers fire */
            if (rand_r(&seed) % 50 == 0) {
                struct timespec ts = {0, 200000};
                nanosleep(&ts, NULL);
                ev_run(loop, EVRUN_NOWAIT);
            }
        }
        if (ev_pending_count(loop)) continue;   /* rb_loop_timeout says 0 then */
        double got = rb_loop_timeout(loop), want = scan(loop, t, NTIMERS);
        if (want < 0) assert_true(got < 0);
        else assert_true(got >= want - 1e-9 && got <= want + 1e-9);
    }
    assert_true(fired > 0);
    for (size_t i = 0; i < NTIMERS; i++) rb_timer_stop(loop, &t[i]);
    assert_true(rb_loop_timeout(loop) < 0);
    rb_loop_disown(loop);
    ev_loop_destroy(loop);
}

typedef struct item { int key; rb_heap_node node; int in; } item;
static int item_less(const rb_heap_node *a, const rb_heap_node *b)
{
    return ((const item *)((const char *)a - offsetof(item, node)))->key <
           ((const item *)((const char *)b - offsetof(item, node)))->key;
}

/* Every node's children order after it, and the count matches. */
static size_t check_subtree(const rb_heap_node *n, const rb_heap_node *parent)
{
    if (!n) return 0;
    assert_ptr_equal(n->parent, parent);
    if (n->left) assert_false(item_less(n->left, n));
    if (n->right) assert_false(item_less(n->right, n));
    return 1 + check_subtree(n->left, n) + check_subtree(n->right, n);
}

static void heap_keeps_its_order_through_any_inserts_and_removals(void **state)
{
    (void)state;
    enum { N = 300 };
    static item it[N];
    rb_heap h = {NULL, 0, item_less};
    unsigned seed = 11;
    size_t members = 0;
    for (int step = 0; step < 30000; step++) {
        item *x = &it[rand_r(&seed) % N];
        if (x->in) {
            rb_heap_remove(&h, &x->node);
            x->in = 0;
            members--;
        } else {
            x->key = (int)(rand_r(&seed) % 100);     /* ties too */
            rb_heap_insert(&h, &x->node);
            x->in = 1;
            members++;
        }
        assert_int_equal(h.n, members);
        assert_int_equal(check_subtree(h.min, NULL), members);
        if (h.min) {
            int least = 1 << 30;
            for (size_t i = 0; i < N; i++) if (it[i].in && it[i].key < least) least = it[i].key;
            assert_int_equal(((item *)((char *)h.min - offsetof(item, node)))->key, least);
        }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        {"rb_loop_timeout is the earliest active timer through any starts, stops and firings",
         timeout_is_the_earliest_active_timer, NULL, NULL, NULL},
        {"the heap keeps its order and its count through any inserts and removals",
         heap_keeps_its_order_through_any_inserts_and_removals, NULL, NULL, NULL},
    };
    return cmocka_run_group_tests_name("timer", tests, NULL, NULL);
}
