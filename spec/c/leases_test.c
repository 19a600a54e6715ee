/* leases_test.c -- named leases (leases.h) over a real store and over the in-process lease
 * store: one holder at a time; the holder's deadline ends before the store's expiry; extend
 * never shortens; on_expire once at the deadline; past it extend and release fail and a late
 * release never revokes a successor; rb_lease_free with an operation in flight; out of
 * memory at each allocation of an acquire. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "harness.h"
#include "stores/leases.h"

typedef struct got {
    int called;
    char err[200];
    rb_lease *lease;
    int ok;
} got;

static void on_acquire(void *ud, const char *err, rb_lease *lease)
{
    got *g = ud;
    g->called++;
    snprintf(g->err, sizeof g->err, "%s", err ? err : "");
    g->lease = lease;
}

static void on_done(void *ud, const char *err, int ok)
{
    got *g = ud;
    g->called++;
    snprintf(g->err, sizeof g->err, "%s", err ? err : "");
    g->ok = ok;
}

/* The real store under the double: its named leases are what is tested. */
static rb_store *lease_store(th_env *e) { return e->spy->real; }

/* Where the leases of a test are kept: a store, or this process's table (local non-NULL). */
typedef struct keeper { rb_store *s; rb_local_leases *local; } keeper;

static keeper store_keeper(th_env *e) { return (keeper){lease_store(e), NULL}; }

static keeper local_keeper(th_env *e)
{
    keeper k = {NULL, rb_local_leases_new(e->loop)};
    assert_non_null(k.local);
    return k;
}

static rb_lease *acquire(th_env *e, keeper k, const char *name, double duration, got *g)
{
    memset(g, 0, sizeof *g);
    if (k.local) rb_local_lease_try_acquire(k.local, name, duration, on_acquire, g);
    else rb_lease_try_acquire(k.s, name, duration, on_acquire, g);
    TH_RUN_UNTIL(e, g->called, 10);
    assert_int_equal(g->called, 1);
    return g->lease;
}

static void wait_done(th_env *e, got *g)
{
    TH_RUN_UNTIL(e, g->called, 10);
    assert_int_equal(g->called, 1);
}

static int is_hex32(const char *t)
{
    if (strlen(t) != 32) return 0;
    for (const char *p = t; *p; p++)
        if (!strchr("0123456789abcdef", *p)) return 0;
    return 1;
}

static void one_holder_at_a_time(th_env *e, keeper s)
{
    got a, b;
    double t0 = rb_monotonic();
    rb_lease *l = acquire(e, s, "job", 10, &a);
    assert_non_null(l);
    assert_string_equal(a.err, "");
    assert_string_equal(rb_lease_name(l), "job");
    assert_true(is_hex32(rb_lease_token(l)));
    /* the deadline: from just before the claim, less the margin (1 s of 10) */
    double dl = rb_lease_deadline(l);
    assert_true(dl >= t0 + 10 - rb_lease_margin(10) - 0.001);
    assert_true(dl <= rb_monotonic() + 10 - rb_lease_margin(10));
    assert_int_equal(rb_lease_over(l), 0);
    /* someone else: no lease, and no error */
    assert_null(acquire(e, s, "job", 10, &b));
    assert_string_equal(b.err, "");
    /* another name is free */
    rb_lease *other = acquire(e, s, "other", 10, &b);
    assert_non_null(other);
    /* release: over, and the name is free again */
    got r = {0};
    rb_lease_release(l, on_done, &r);
    wait_done(e, &r);
    assert_int_equal(r.ok, 1);
    assert_int_equal(rb_lease_over(l), 1);
    rb_lease *again = acquire(e, s, "job", 10, &b);
    assert_non_null(again);
    /* a released handle can do nothing more */
    got x = {0};
    rb_lease_extend(l, 5, on_done, &x);
    wait_done(e, &x);
    assert_int_equal(x.ok, 0);
    assert_string_equal(x.err, "lease released");
    rb_lease_free(l);
    rb_lease_free(other);
    rb_lease_free(again);
}

static void store_one_holder_at_a_time(void **state)
{
    th_env *e = th_env_of(state);
    one_holder_at_a_time(e, store_keeper(e));
}

static void local_one_holder_at_a_time(void **state)
{
    th_env *e = th_env_of(state);
    keeper k = local_keeper(e);
    one_holder_at_a_time(e, k);
    rb_local_leases_free(k.local);
}

static void extend_never_shortens(th_env *e, keeper s)
{
    got a, x = {0};
    rb_lease *l = acquire(e, s, "job", 2, &a);
    assert_non_null(l);
    double first = rb_lease_deadline(l);
    rb_lease_extend(l, 20, on_done, &x);
    wait_done(e, &x);
    assert_int_equal(x.ok, 1);
    double longer = rb_lease_deadline(l);
    assert_true(longer > first + 15);
    memset(&x, 0, sizeof x);
    rb_lease_extend(l, 0.5, on_done, &x);   /* shorter than what is left */
    wait_done(e, &x);
    assert_int_equal(x.ok, 1);
    assert_true(rb_lease_deadline(l) >= longer);
    /* extend(0): the acquire's duration */
    memset(&x, 0, sizeof x);
    rb_lease_extend(l, 0, on_done, &x);
    wait_done(e, &x);
    assert_int_equal(x.ok, 1);
    assert_true(rb_lease_deadline(l) >= longer);
    rb_lease_free(l);
}

static void store_extend_never_shortens(void **state)
{
    th_env *e = th_env_of(state);
    extend_never_shortens(e, store_keeper(e));
}

static void local_extend_never_shortens(void **state)
{
    th_env *e = th_env_of(state);
    keeper k = local_keeper(e);
    extend_never_shortens(e, k);
    rb_local_leases_free(k.local);
}

typedef struct expiry { int calls; double at; rb_lease *l; } expiry;

static void on_expire(rb_lease *l, void *ud)
{
    expiry *x = ud;
    x->calls++;
    x->at = rb_monotonic();
    x->l = l;
}

/* Past the deadline the holder has no claim: on_expire once, extend and release fail, and a
 * successor that took the name keeps it. */
static void expiry_and_succession(th_env *e, keeper s)
{
    got a, b;
    rb_lease *l = acquire(e, s, "job", 0.4, &a);     /* deadline 0.2 s, the store's 0.4 */
    assert_non_null(l);
    expiry x = {0};
    rb_lease_on_expire(l, on_expire, &x);
    double dl = rb_lease_deadline(l);
    TH_RUN_UNTIL(e, x.calls, 5);
    assert_int_equal(x.calls, 1);
    assert_ptr_equal(x.l, l);
    assert_true(x.at >= dl);
    assert_int_equal(rb_lease_over(l), 1);
    /* once the store's expiry has passed (0.4 s after it ran the acquire), a successor
     * takes the name */
    rb_lease *next = NULL;
    double end = rb_monotonic() + 5;
    while (!next && rb_monotonic() < end) {
        th_run_for(e, 0.05);
        next = acquire(e, s, "job", 10, &b);
    }
    assert_non_null(next);
    assert_int_equal(x.calls, 1);
    got r = {0};
    rb_lease_release(l, on_done, &r);
    wait_done(e, &r);
    assert_int_equal(r.ok, 0);
    assert_string_equal(r.err, "lease lost");
    memset(&r, 0, sizeof r);
    rb_lease_extend(l, 10, on_done, &r);
    wait_done(e, &r);
    assert_int_equal(r.ok, 0);
    assert_string_equal(r.err, "lease lost");
    /* the successor still holds it */
    assert_null(acquire(e, s, "job", 10, &b));
    rb_lease_free(l);
    rb_lease_free(next);
}

typedef struct raw_answer { int done, acquired; } raw_answer;

static void on_raw(void *ud, const char *err, int acquired, double expires_at)
{
    (void)err; (void)expires_at;
    raw_answer *r = ud;
    r->done = 1;
    r->acquired = acquired;
}

static void store_expiry_and_succession(void **state)
{
    th_env *e = th_env_of(state);
    expiry_and_succession(e, store_keeper(e));
}

static void local_expiry_and_succession(void **state)
{
    th_env *e = th_env_of(state);
    keeper k = local_keeper(e);
    expiry_and_succession(e, k);
    rb_local_leases_free(k.local);
}

/* The store's release is conditional on the token: a stale holder's token revokes nothing. */
static void a_stale_token_releases_nothing(void **state)
{
    th_env *e = th_env_of(state);
    rb_store *s = lease_store(e);
    raw_answer r = {0};
    s->vt->lease(s, RB_LEASE_ACQUIRE, "n", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", 10, on_raw, &r);
    TH_RUN_UNTIL(e, r.done, 10);
    assert_int_equal(r.acquired, 1);
    memset(&r, 0, sizeof r);
    s->vt->lease(s, RB_LEASE_RELEASE, "n", "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb", 0, on_raw, &r);
    TH_RUN_UNTIL(e, r.done, 10);
    assert_int_equal(r.acquired, 0);
    memset(&r, 0, sizeof r);
    s->vt->lease(s, RB_LEASE_ACQUIRE, "n", "cccccccccccccccccccccccccccccccc", 10, on_raw, &r);
    TH_RUN_UNTIL(e, r.done, 10);
    assert_int_equal(r.acquired, 0);            /* still aaaa's */
    memset(&r, 0, sizeof r);
    s->vt->lease(s, RB_LEASE_EXTEND, "n", "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb", 10, on_raw, &r);
    TH_RUN_UNTIL(e, r.done, 10);
    assert_int_equal(r.acquired, 0);
}

/* rb_lease_free while an extend is in flight (PostgreSQL answers later): its callback is not
 * called, and nothing leaks. */
static void free_with_an_extend_in_flight(void **state)
{
    th_env *e = th_env_of(state);
    got a, x = {0};
    rb_lease *l = acquire(e, store_keeper(e), "job", 10, &a);
    assert_non_null(l);
    rb_lease_extend(l, 20, on_done, &x);
    int sync = x.called;
    rb_lease_free(l);
    th_run_for(e, 0.3);
    assert_int_equal(x.called, sync);           /* an answer after the free is not passed on */
}

static void a_store_without_named_leases_says_so(void **state)
{
    th_env *e = th_env_of(state);
    e->spy->vt->lease = NULL;
    got g;
    assert_null(acquire(e, (keeper){e->store, NULL}, "job", 10, &g));
    assert_string_equal(g.err, "named leases are not supported by this store");
}

/* Each allocation of an acquire fails in turn: "out of memory", no handle, nothing leaked;
 * then the name is still free. */
static void out_of_memory_at_each_allocation_of_an_acquire(void **state)
{
    th_env *e = th_env_of(state);
    rb_store *s = lease_store(e);
    int fired_any = 0;
    for (long n = 1; n <= 12; n++) {
        got g;
        long before = rb_alloc_fail_nth(n);
        memset(&g, 0, sizeof g);
        rb_lease_try_acquire(s, "oom", 10, on_acquire, &g);
        TH_RUN_UNTIL(e, g.called, 10);
        long fired = rb_alloc_fail_nth(0) - before;
        fired_any |= fired > 0;
        assert_int_equal(g.called, 1);
        if (g.lease) {
            got r = {0};
            rb_lease_release(g.lease, on_done, &r);
            TH_RUN_UNTIL(e, r.called, 10);
            rb_lease_free(g.lease);
        } else {
            assert_true(fired > 0);
            assert_true(strlen(g.err) > 0);
        }
        /* whatever happened, the name can be taken and given back */
        got ok;
        rb_lease *l = acquire(e, store_keeper(e), "oom", 10, &ok);
        if (!l) fail_msg("N=%ld: the name stayed taken (%s)", n, g.err);
        got r = {0};
        rb_lease_release(l, on_done, &r);
        TH_RUN_UNTIL(e, r.called, 10);
        assert_int_equal(r.ok, 1);
        rb_lease_free(l);
    }
    assert_true(fired_any);
}

#define BOTH(name, fn) TH_TEST(sqlite_memory, name, fn), TH_TEST(postgresql, name, fn)

int main(void)
{
    const struct CMUnitTest tests[] = {
        BOTH("one holder at a time; its deadline ends before the store's expiry",
             store_one_holder_at_a_time),
        TH_TEST(sqlite_memory, "local leases: one holder at a time", local_one_holder_at_a_time),
        BOTH("extend never shortens the lease", store_extend_never_shortens),
        TH_TEST(sqlite_memory, "local leases: extend never shortens", local_extend_never_shortens),
        BOTH("on_expire once at the deadline; then extend and release fail and a successor keeps it",
             store_expiry_and_succession),
        TH_TEST(sqlite_memory, "local leases: on_expire once; a late release revokes nothing",
                local_expiry_and_succession),
        BOTH("a stale token releases and extends nothing", a_stale_token_releases_nothing),
        TH_TEST(postgresql, "rb_lease_free with an extend in flight drops its answer",
                free_with_an_extend_in_flight),
        TH_TEST(sqlite_memory, "a store without named leases says so",
                a_store_without_named_leases_says_so),
        BOTH("out of memory at each allocation of an acquire: an error, and nothing is held",
             out_of_memory_at_each_allocation_of_an_acquire),
    };
    return cmocka_run_group_tests_name("leases", tests, NULL, NULL);
}
