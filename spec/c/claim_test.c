/* claim_test.c -- claims in flight: never more handlers running than concurrency, no more
 * claims at once than the store's claim_parallelism, claims ahead of the slots for handlers
 * faster than a claim (never run early, handed back by a stop or past their lease), a claim
 * answered after the dispatcher was
 * freed (its records freed, the deliveries left to their leases), a claim answered after the
 * runs' local deadline (released unrun, the attempt not counted), a failing claim retried at
 * the poll interval; rb_dispatcher_options_check and rb_dispatcher_handle refusing misuse. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "harness.h"
#include "stores/leases.h"

#define T "work"

/* Every claim is answered 20 ms late (a store across a network), during a backlog. */
static void slow_claims(th_env *e)
{
    e->spy->claim_delay = 0.02;
    e->spy->delay_claims = -1;
}

/* Each of ids completed, in exactly one attempt (what was handed back counted none). */
static void assert_completed_once(th_env *e, const th_ids *ids)
{
    for (size_t i = 0; i < ids->n; i++) {
        rb_delivery *d = th_get(e, ids->id[i]);
        int status = d->status, attempts = d->attempts;
        rb_delivery_free(d);
        if (status != RB_COMPLETED || attempts != 1)
            print_message("# delivery %s: status %d, %d attempts\n", ids->id[i], status, attempts);
        assert_int_equal(status, RB_COMPLETED);
        assert_int_equal(attempts, 1);
    }
}

/* Each run ends after 50 to 90 ms, depending on its id: long enough that a batch's runs are
 * all running at once even on a loaded machine (the runs of a claim start one by one). */
static void finish_soon(th_handler *h, th_run *r)
{
    (void)h;
    th_finish_after(r, 0.01 * (5 + atoi(r->id) % 5), 1, NULL);
}

static void never_more_runs_than_concurrency(void **state)
{
    th_env *e = th_env_of(state);
    th_ids ids = th_enqueue(e, T, 100, 0, 0);
    rb_dispatcher_options o;
    th_options(e, &o);
    o.concurrency = 7;
    /* no claiming ahead: on a loaded machine a claim can take longer than these runs, and
     * the dispatcher then rightly claims beyond its free slots (claim_ahead's own tests) */
    o.claim_ahead = 0;
    th_dispatcher(e, &o);
    th_handler *h = th_new_handler(e);
    h->on_start = finish_soon;
    th_handle(e, h, T);
    rb_dispatcher_start(e->d);
    TH_RUN_UNTIL(e, h->settles == 100, 20);
    assert_int_equal(h->settles, 100);
    assert_int_equal(h->max_running, 7);
    for (int i = 0; i < e->spy->claim_calls && i < TH_MAX_CALLS; i++)
        assert_true(e->spy->claim_limit[i] >= 1 && e->spy->claim_limit[i] <= 7);
    assert_int_equal(th_stats(e).completed, 100);
    th_ids_free(&ids);
}

/* What a dispatcher may hold beyond its slots by default (claim_ahead): 4 times them. */
#define AHEAD_MAX 4

/* Claims answered 20 ms late, during a backlog: as many side by side as the store allows, and
 * no more; each fills a share of what the lane may hold (its slots and what it claims ahead
 * for handlers of 10 ms). */
static void claims_in_flight(void **state, int parallelism)
{
    th_env *e = th_env_of(state);
    e->spy->vt->claim_parallelism = parallelism;
    slow_claims(e);
    th_ids ids = th_enqueue(e, T, 300, 0, 0);
    rb_dispatcher_options o;
    th_options(e, &o);
    o.concurrency = 30;
    th_dispatcher(e, &o);
    th_handler *h = th_new_handler(e);
    h->on_start = th_start_later;
    h->delay = 0.01;
    th_handle(e, h, T);
    rb_dispatcher_start(e->d);
    TH_RUN_UNTIL(e, h->settles == 300, 30);
    assert_int_equal(h->settles, 300);
    print_message("# parallelism %d: %d claims, at most %d in flight, %d runs at once\n",
                  parallelism, e->spy->claim_calls, e->spy->max_claims_in_flight, h->max_running);
    int want = parallelism > 1 ? parallelism : 1;
    assert_int_equal(e->spy->max_claims_in_flight, want);
    size_t share = (30 * (1 + AHEAD_MAX) + (size_t)want - 1) / (size_t)want;
    /* PostgreSQL runs 2 claims of a table at once (its claim slots): a third waits for a slot
     * and says so, and the dispatcher then keeps one claim in flight for a while, which asks
     * for all the lane may hold (CI under ASan saw it) */
    if (parallelism > 2 && strcmp(e->spy->vt->name, "postgresql") == 0) share = 30 * (1 + AHEAD_MAX);
    for (int i = 0; i < e->spy->claim_calls && i < TH_MAX_CALLS; i++)
        assert_true(e->spy->claim_limit[i] <= share);
    assert_int_equal(h->max_running, 30);
    th_ids_free(&ids);
}

static void one_claim_at_a_time_without_parallelism(void **state) { claims_in_flight(state, 0); }
static void claim_parallelism_two_is_respected(void **state) { claims_in_flight(state, 2); }
static void claim_parallelism_three_is_respected(void **state) { claims_in_flight(state, 3); }

/* Handlers of 2 ms and claims of 20 ms: claims ask for more than the free slots, the runs over
 * them wait and start as slots free, never more than concurrency at once, each delivery run
 * once. */
static void fast_handlers_claim(void **state, int claim_ahead)
{
    th_env *e = th_env_of(state);
    slow_claims(e);
    th_ids ids = th_enqueue(e, T, 400, 0, 0);
    rb_dispatcher_options o;
    th_options(e, &o);
    o.concurrency = 10;
    o.claim_ahead = claim_ahead;
    th_dispatcher(e, &o);
    th_handler *h = th_new_handler(e);
    h->on_start = th_start_later;
    h->delay = 0.002;
    th_handle(e, h, T);
    rb_dispatcher_start(e->d);
    TH_RUN_UNTIL(e, h->settles == 400, 30);
    assert_int_equal(h->settles, 400);
    assert_int_equal(h->starts, 400);
    /* (claiming ahead fills every slot; without it the slots wait for each claim) */
    if (claim_ahead) assert_int_equal(h->max_running, 10);
    else assert_true(h->max_running <= 10);
    size_t most = 0;
    for (int i = 0; i < e->spy->claim_calls && i < TH_MAX_CALLS; i++) {
        assert_true(e->spy->claim_limit[i] <= (size_t)(10 * (1 + claim_ahead)));
        if (e->spy->claim_limit[i] > most) most = e->spy->claim_limit[i];
    }
    print_message("# %d claims, the largest for %zu\n", e->spy->claim_calls, most);
    if (claim_ahead) assert_true(most > 10);
    else assert_true(most <= 10);   /* never beyond the slots */
    assert_int_equal(e->spy->kinds[RB_OP_RELEASE], 0);
    assert_completed_once(e, &ids);
    th_ids_free(&ids);
}

static void fast_handlers_claim_ahead_of_the_slots(void **state) { fast_handlers_claim(state, AHEAD_MAX); }
static void claim_ahead_0_claims_only_the_free_slots(void **state) { fast_handlers_claim(state, 0); }

/* Ends fast until the handler's ctx points at a counter; then runs until aborted or finished
 * by the test, counting those runs. */
static void fast_then_hang(th_handler *h, th_run *r)
{
    if (h->ctx) ++*(int *)h->ctx;
    else th_finish_after(r, 0.002, 1, NULL);
}

/* Slots taken by runs that hang, with more claimed ahead of them: a stop hands those back at
 * once, unrun and without using an attempt. */
static void a_stop_hands_back_what_was_claimed_ahead(void **state)
{
    th_env *e = th_env_of(state);
    slow_claims(e);
    th_ids ids = th_enqueue(e, T, 300, 0, 0);
    rb_dispatcher_options o;
    th_options(e, &o);
    o.concurrency = 4;
    th_dispatcher(e, &o);
    th_handler *h = th_new_handler(e);
    h->on_start = fast_then_hang;
    h->on_abort = th_abort_finish;
    th_handle(e, h, T);
    rb_dispatcher_start(e->d);
    TH_RUN_UNTIL(e, h->settles >= 40, 20);
    int hanging = 0;
    h->ctx = &hanging;  /* from now on runs hang */
    /* (counted as claimed ahead, not as active less the 4 running: a run that completed just
     * before is active until its settle's answer, and is not handed back) */
    TH_RUN_UNTIL(e, hanging == 4 && h->running == 4 && rb_dispatcher_ahead(e->d) > 0, 20);
    size_t ahead = rb_dispatcher_ahead(e->d);
    int started = h->starts;
    print_message("# %zu claimed ahead of 4 hanging runs\n", ahead);
    assert_true(ahead > 0);
    assert_int_equal(h->running, 4);
    int released = e->spy->kinds[RB_OP_RELEASE];
    rb_dispatcher_stop(e->d, 5, NULL, NULL);
    /* Handed back at once: what was claimed ahead, and what claims in flight then brought
     * (they crossed the stop). Their writes are answered within a round trip; the bound is
     * for a loaded machine (4 C test programs at once with ASan). Only the hanging ones stay,
     * until 4 s. */
    double t0 = rb_monotonic();
    TH_RUN_UNTIL(e, rb_dispatcher_active(e->d) == 4, 2);
    print_message("# handed back in %.3f s\n", rb_monotonic() - t0);
    assert_int_equal(h->starts, started);     /* none of them started */
    assert_true(e->spy->kinds[RB_OP_RELEASE] - released >= (int)ahead);
    assert_int_equal(rb_dispatcher_active(e->d), 4);
    th_stop(e, 0.2);
    /* The hanging runs are aborted at 80% of the timeout and released; a release still in
     * flight at the timeout lands later, and on_quiet comes after its answer (a CI run under
     * ASan read one delivery still running right after on_stopped). */
    TH_RUN_UNTIL(e, e->quiet, 10);
    assert_int_equal(e->quiet, 1);
    size_t completed = 0, pending = 0;
    for (size_t i = 0; i < ids.n; i++) {
        rb_delivery *d = th_get(e, ids.id[i]);
        if (d->status == RB_COMPLETED) {
            completed++;
            assert_int_equal(d->attempts, 1);
        } else {
            pending++;
            assert_int_equal(d->status, RB_PENDING);
            assert_int_equal(d->attempts, 0);   /* released: unrun or aborted by the stop */
        }
        rb_delivery_free(d);
    }
    assert_int_equal(completed + pending, 300);
    assert_int_equal((int)completed, h->starts - 4);    /* all but the hanging ones */
    th_ids_free(&ids);
}

/* Runs claimed ahead behind one that outlasts their lease (renewed, so it keeps its own) are
 * handed back once they waited a third of it, before it ends: another process may take them.
 * Here they are claimed again, and each runs once. The lease leaves a renewal 1 s to come back
 * (CI's loaded machine under ASan took over 0.2 s, the room a lease of 0.6 s leaves: the
 * hanging run lost its lease and ran twice). */
static void runs_claimed_ahead_are_handed_back_within_their_lease(void **state)
{
    th_env *e = th_env_of(state);
    slow_claims(e);
    th_ids ids = th_enqueue(e, T, 200, 0, 0);
    rb_dispatcher_options o;
    th_options(e, &o);
    o.concurrency = 1;
    o.lease_duration = 1.5;
    th_dispatcher(e, &o);
    th_handler *h = th_new_handler(e);
    h->on_start = fast_then_hang;
    th_handle(e, h, T);
    rb_dispatcher_start(e->d);
    TH_RUN_UNTIL(e, h->settles >= 20, 20);
    int hung = 0;
    int released = e->spy->kinds[RB_OP_RELEASE];
    h->ctx = &hung;
    double t0 = rb_monotonic();
    /* (a claim is in flight nearly all the time: what it brings waits behind the hanging run) */
    TH_RUN_UNTIL(e, hung == 1 && e->spy->kinds[RB_OP_RELEASE] > released, 5);
    double took = rb_monotonic() - t0;
    int handed_back = e->spy->kinds[RB_OP_RELEASE] - released;
    print_message("# %d claimed ahead handed back after %.3f s (lease 1.5), %d started\n",
                  handed_back, took, hung);
    assert_int_equal(hung, 1);
    th_run *hanging = h->live;
    assert_true(handed_back > 0);
    assert_true(took < 1.5);
    TH_RUN_UNTIL(e, rb_dispatcher_active(e->d) == 1, 5);
    assert_int_equal(rb_dispatcher_active(e->d), 1);    /* only the hanging run is held */
    th_run_for(e, 1.6);                 /* past its first lease: renewed, it still runs */
    print_message("# then: %d running, %zu active, %d started behind it\n",
                  h->running, rb_dispatcher_active(e->d), hung);
    assert_int_equal(h->running, 1);
    assert_int_equal(rb_dispatcher_active(e->d), 1);    /* nothing claimed ahead again */
    h->ctx = NULL;
    th_finish(hanging, 1, NULL);
    TH_RUN_UNTIL(e, th_stats(e).completed == 200, 30);
    assert_int_equal(h->max_running, 1);
    assert_completed_once(e, &ids);     /* the hand-back used no attempt */
    th_ids_free(&ids);
}

/* A lane of higher priority whose runs hang holds every slot: the fast lane behind it, whose
 * handlers end in 2 ms, neither runs more than the slots allow nor claims ahead what it cannot
 * start (each batch would wait a third of its lease, kept from other processes, and go back:
 * 72 in 2 s before this was fixed). Dispatchers of several lanes claim nothing ahead now. */
static th_handler *hanging_lane;
static int most_at_once;
static void fast_counting(th_handler *h, th_run *r)
{
    int now = h->running + (hanging_lane ? hanging_lane->running : 0);
    if (now > most_at_once) most_at_once = now;
    th_finish_after(r, 0.002, 1, NULL);
}

static void a_lane_behind_full_slots_does_not_hoard(void **state)
{
    th_env *e = th_env_of(state);
    slow_claims(e);
    th_ids fast = th_enqueue(e, "fast", 100, 0, 0);
    rb_dispatcher_options o;
    th_options(e, &o);
    o.concurrency = 4;
    o.lease_duration = 0.9;
    th_dispatcher(e, &o);
    th_handler *f = th_new_handler(e);
    f->on_start = fast_counting;
    th_handler *s = th_new_handler(e);
    s->def.priority = 10;
    s->def.concurrency = 4;
    hanging_lane = s;
    most_at_once = 0;
    th_handle(e, f, "fast");
    th_handle(e, s, "slow");
    rb_dispatcher_start(e->d);
    TH_RUN_UNTIL(e, f->settles >= 100, 20);
    th_ids slow = th_enqueue(e, "slow", 4, 0, 0);
    rb_dispatcher_wake(e->d);
    TH_RUN_UNTIL(e, s->running == 4, 20);
    int released = e->spy->kinds[RB_OP_RELEASE], claims = e->spy->claim_calls;
    th_ids more = th_enqueue(e, "fast", 12, 0, 0);
    rb_dispatcher_wake(e->d);
    e->spy->settle_delay = 0.1;
    size_t most_ahead = 0;
    double t0 = rb_monotonic();
    while (rb_monotonic() - t0 < 2.0) {
        th_run_for(e, 0.02);
        if (rb_dispatcher_ahead(e->d) > most_ahead) most_ahead = rb_dispatcher_ahead(e->d);
        assert_true(s->running + f->running <= 4);
    }
    int handed_back = e->spy->kinds[RB_OP_RELEASE] - released;
    print_message("# behind 4 hanging runs: %d claims, at most %zu waiting, %d handed back in 2 s\n",
                  e->spy->claim_calls - claims, most_ahead, handed_back);
    assert_true(most_at_once <= 4);
    assert_int_equal(s->running, 4);
    assert_int_equal(f->starts, 100);               /* no slot: none of the 12 ran */
    assert_true(handed_back <= 12);                 /* at most one round of them, not a churn */
    assert_true(rb_dispatcher_ahead(e->d) <= 12);
    hanging_lane = NULL;
    th_ids_free(&fast);
    th_ids_free(&slow);
    th_ids_free(&more);
}

/* The first run of "x" fails at once; every other run hangs until the test ends it. */
static char failing_id[24];
static void fail_x_once_hang_others(th_handler *h, th_run *r)
{
    (void)h;
    if (strcmp(r->id, failing_id) == 0 && r->attempts == 1) th_finish(r, 0, "boom");
}

static double no_backoff(int attempts, void *ud) { (void)attempts; (void)ud; return 0; }

/* A run of h that is still running (its handler not finished), or NULL. */
static th_run *running_one(th_handler *h)
{
    for (th_run *r = h->live; r; r = r->next)
        if (r->run) return r;
    return NULL;
}

/* A delivery claimed again while our earlier run of it still settles waits (parked) without a
 * slot, so other deliveries fill the slots meanwhile; once the earlier run has settled, it
 * waits for a free slot like one claimed ahead: never more runs at once than concurrency. */
static void a_parked_run_waits_for_a_slot(void **state)
{
    th_env *e = th_env_of(state);
    th_ids x = th_enqueue(e, T, 1, 0, 0);
    snprintf(failing_id, sizeof failing_id, "%s", x.id[0]);
    th_ids hang = th_enqueue(e, T, 3, 0.3, 0);
    e->spy->settle_delay = 0.6;     /* the failed run's reschedule is answered late */
    rb_dispatcher_options o;
    th_options(e, &o);
    o.concurrency = 2;
    o.backoff = no_backoff;
    th_dispatcher(e, &o);
    th_handler *h = th_new_handler(e);
    h->on_start = fail_x_once_hang_others;
    th_handle(e, h, T);
    rb_dispatcher_start(e->d);
    TH_RUN_UNTIL(e, h->running == 2, 10);           /* two of the later ones */
    assert_int_equal(h->starts, 3);
    th_run_for(e, 0.8);                             /* the reschedule is answered */
    assert_int_equal(h->running, 2);
    assert_int_equal(h->max_running, 2);
    assert_int_equal(h->starts, 3);                 /* x waits for a slot */
    assert_true(rb_dispatcher_ahead(e->d) >= 1);
    th_finish(running_one(h), 1, NULL);             /* a slot frees: x (or the third) runs */
    TH_RUN_UNTIL(e, h->starts == 4, 10);
    assert_int_equal(h->max_running, 2);
    for (int i = 0; i < 40 && th_stats(e).completed < 4; i++) {
        th_run *r = running_one(h);
        if (r) th_finish(r, 1, NULL);
        th_run_for(e, 0.1);
    }
    assert_int_equal(th_stats(e).completed, 4);
    assert_int_equal(h->max_running, 2);
    th_ids_free(&x);
    th_ids_free(&hang);
}

/* A second dispatcher on e's store, handling topic with h (e->d stays the first). */
static rb_dispatcher *second_dispatcher(th_env *e, th_handler *h, const char *topic,
                                        const rb_dispatcher_options *o)
{
    rb_dispatcher *first = e->d;
    rb_dispatcher *second = th_dispatcher(e, o);
    th_handle(e, h, topic);
    e->d = first;
    return second;
}

/* Dispatcher A's run of x failed and its reschedule is answered late; dispatcher B on the same
 * store claims x meanwhile, and its run waits behind A's (the registry of unsettled runs is
 * the store's). Returns B, its run of x parked; A is stopping (it claims nothing more). */
static rb_dispatcher *park_behind_another(th_env *e, const char *x, th_handler **hb_out)
{
    snprintf(failing_id, sizeof failing_id, "%s", x);
    e->spy->settle_delay = 0.6;
    rb_dispatcher_options o;
    th_options(e, &o);
    o.concurrency = 1;
    o.backoff = no_backoff;
    th_dispatcher(e, &o);
    th_handler *ha = th_new_handler(e);
    ha->on_start = fail_x_once_hang_others;
    th_handle(e, ha, T);
    rb_dispatcher_start(e->d);
    TH_RUN_UNTIL(e, ha->starts == 1, 10);
    assert_int_equal(ha->starts, 1);
    rb_dispatcher_stop(e->d, 10, NULL, NULL);
    th_handler *hb = th_new_handler(e);
    hb->on_start = th_start_ok;
    o.on_stopped = NULL;            /* (the recorders are e->d's) */
    o.on_quiet = NULL;
    rb_dispatcher *b = second_dispatcher(e, hb, T, &o);
    rb_dispatcher_start(b);
    TH_RUN_UNTIL(e, rb_dispatcher_ahead(b) == 1, 5);
    assert_int_equal(rb_dispatcher_ahead(b), 1);     /* claimed, waiting for A's run */
    assert_int_equal(hb->starts, 0);
    *hb_out = hb;
    return b;
}

/* The run B parked behind A's is counted and started on B when A's settles. It was unparked
 * on A: A's count of waiting runs went below zero, B's never came down, and B, idle, counted
 * more runs holding a slot than it had, so it started nothing again. */
static void a_run_parked_behind_another_dispatchers_starts_on_its_own(void **state)
{
    th_env *e = th_env_of(state);
    th_ids x = th_enqueue(e, T, 1, 0, 0);
    th_handler *hb;
    rb_dispatcher *b = park_behind_another(e, x.id[0], &hb);
    TH_RUN_UNTIL(e, hb->starts == 1, 5);            /* A's run settled: x runs on B */
    assert_int_equal(hb->starts, 1);
    TH_RUN_UNTIL(e, th_status(e, x.id[0]) == RB_COMPLETED, 5);
    assert_int_equal(th_status(e, x.id[0]), RB_COMPLETED);
    assert_int_equal(rb_dispatcher_ahead(b), 0);
    assert_int_equal(rb_dispatcher_ahead(e->d), 0);
    th_ids more = th_enqueue(e, T, 3, 0, 0);        /* and B goes on running what comes */
    TH_RUN_UNTIL(e, hb->starts == 4, 10);
    assert_int_equal(hb->starts, 4);
    TH_RUN_UNTIL(e, th_stats(e).completed == 4, 5);
    assert_int_equal(th_stats(e).completed, 4);
    assert_true(hb->max_running <= 1);
    rb_dispatcher_free(b);
    th_ids_free(&more);
    th_ids_free(&x);
}

/* B is freed while its run waits behind A's: A's run, settling, must not hand on a freed run
 * (ASan: a use after free). x is left to B's lease and runs again after it. */
static void a_dispatcher_freed_with_a_run_parked_behind_another(void **state)
{
    th_env *e = th_env_of(state);
    th_ids x = th_enqueue(e, T, 1, 0, 0);
    th_handler *hb;
    rb_dispatcher *b = park_behind_another(e, x.id[0], &hb);
    rb_dispatcher_free(b);
    TH_RUN_UNTIL(e, !rb_dispatcher_running(e->d), 5);   /* A's run settled, its stop ended */
    assert_false(rb_dispatcher_running(e->d));
    assert_int_equal(rb_dispatcher_active(e->d), 0);
    assert_int_equal(rb_dispatcher_ahead(e->d), 0);
    assert_int_equal(hb->starts, 0);
    assert_int_equal(th_status(e, x.id[0]), RB_PROCESSING);     /* B's claim, unrun */
    th_ids_free(&x);
}

/* A is freed while B's run waits behind A's: B's run moves up and starts on B, instead of
 * waiting for a run that will never settle. */
static void a_run_parked_behind_a_freed_dispatchers_run_starts(void **state)
{
    th_env *e = th_env_of(state);
    th_ids x = th_enqueue(e, T, 1, 0, 0);
    th_handler *hb;
    rb_dispatcher *b = park_behind_another(e, x.id[0], &hb);
    rb_dispatcher_free(e->d);
    e->d = b;                                       /* teardown frees B */
    TH_RUN_UNTIL(e, hb->starts == 1, 5);
    assert_int_equal(hb->starts, 1);
    TH_RUN_UNTIL(e, th_status(e, x.id[0]) == RB_COMPLETED, 5);
    assert_int_equal(th_status(e, x.id[0]), RB_COMPLETED);
    assert_int_equal(rb_dispatcher_ahead(b), 0);
    th_ids_free(&x);
}

/* A lease of 10 ms and claim_ahead 100: a batch of 800 takes longer to start than the lease
 * lasts, so its tail is handed back unrun. Without claiming less ahead after that, the drain
 * went on claiming 800 and handing most back (194 of 3,000 done in 30 s; with a pause of one
 * lease, 1,287 in 30 s on a loaded CI machine). */
static void a_short_lease_stops_claiming_ahead_what_cannot_start(void **state)
{
    th_env *e = th_env_of(state);
    th_ids ids = th_enqueue(e, T, 1000, 0, 0);
    rb_dispatcher_options o;
    th_options(e, &o);
    o.concurrency = 8;
    o.claim_ahead = RB_MAX_CLAIM_AHEAD;
    o.lease_duration = 0.5;
    th_dispatcher(e, &o);
    th_handler *h = th_new_handler(e);
    /* 20 ms runs: of a claim ahead of more than 8 slots x (0.3 s to the local deadline /
     * 20 ms), 120 runs, the rest cannot start in time on any machine, however fast. (Runs of
     * a few ms against a lease of a few tens made every stall of a loaded machine hand a
     * whole claim back.) */
    h->on_start = th_start_later;
    h->delay = 0.02;
    th_handle(e, h, T);
    rb_dispatcher_start(e->d);
    TH_RUN_UNTIL(e, th_stats(e).completed == 1000, 60);
    print_message("# %d claims, %d runs handed back unrun\n", e->spy->claim_calls,
                  e->spy->kinds[RB_OP_RELEASE]);
    assert_int_equal(th_stats(e).completed, 1000);
    assert_true(h->max_running <= 8);
    /* the room ahead is what can start within the lease, and halves after a hand-back: few
     * hand-backs (claiming RB_MAX_CLAIM_AHEAD regardless would hand back about 690 of the
     * 808 of its first claim alone) */
    assert_true(e->spy->kinds[RB_OP_RELEASE] < 400);
    th_ids_free(&ids);
}

static void a_claim_answered_after_free_frees_its_records(void **state)
{
    th_env *e = th_env_of(state);
    th_ids ids = th_enqueue(e, T, 5, 0, 0);
    e->spy->hold_claims = 1;
    rb_dispatcher_options o;
    th_options(e, &o);
    o.lease_duration = 0.4;
    th_dispatcher(e, &o);
    th_handler *h = th_new_handler(e);
    h->on_start = th_start_ok;
    th_handle(e, h, T);
    double t0 = rb_monotonic();
    rb_dispatcher_start(e->d);
    TH_RUN_UNTIL(e, th_spy_held(e->spy) == 1, 10);
    assert_int_equal(th_spy_held(e->spy), 1);
    rb_dispatcher_free(e->d);           /* running, with a claim in flight */
    e->d = NULL;
    assert_int_equal(h->freed, 1);
    assert_int_equal(th_spy_answer_claims(e->spy), 1);  /* finds no dispatcher */
    assert_int_equal(h->starts, 0);
    for (size_t i = 0; i < ids.n; i++) {
        rb_delivery *d = th_get(e, ids.id[i]);
        assert_int_equal(d->status, RB_PROCESSING);     /* left to their leases */
        assert_int_equal(d->attempts, 1);
        rb_delivery_free(d);
    }
    while (rb_monotonic() < t0 + 0.5) th_run_for(e, 0.05);
    size_t n = 0;
    TH_RUN_UNTIL(e, (n += th_claim(e, T, 10, 30)) >= 5, 3);
    assert_int_equal(n, 5);
    th_ids_free(&ids);
    /* teardown's leak check: the records the late answer brought were freed */
}

static void a_claim_answered_past_the_local_deadline_is_released(void **state)
{
    th_env *e = th_env_of(state);
    th_ids ids = th_enqueue(e, T, 3, 0, 0);
    rb_dispatcher_options o;
    th_options(e, &o);
    /* local deadline: 3.6 s after the claim was sent (the margin is 10% of a lease, 0.2 s at
     * least); the late answer's releases then have 0.38 s before the lease ends (with 0.15 s,
     * of a 0.6 s lease, a loaded machine let the lease end first, and the delivery was
     * claimed again with its attempt counted) */
    o.lease_duration = 4.0;
    e->spy->claim_delay = 3.62;
    e->spy->delay_claims = 1;           /* only the first claim comes late */
    th_dispatcher(e, &o);
    th_handler *h = th_new_handler(e);
    h->on_start = th_start_ok;
    th_handle(e, h, T);
    rb_dispatcher_start(e->d);
    TH_RUN_UNTIL(e, h->settles == 3, 10);
    assert_int_equal(h->settles, 3);
    assert_int_equal(h->starts, 3);     /* only the second claim's runs started */
    assert_int_equal(e->spy->kinds[RB_OP_RELEASE], 3);
    for (size_t i = 0; i < ids.n; i++) {
        rb_delivery *d = th_get(e, ids.id[i]);
        assert_int_equal(d->status, RB_COMPLETED);
        assert_int_equal(d->attempts, 1);               /* the late claim was not counted */
        rb_delivery_free(d);
    }
    th_ids_free(&ids);
}

static void a_failing_claim_is_retried_at_the_poll_interval(void **state)
{
    th_env *e = th_env_of(state);
    th_ids ids = th_enqueue(e, T, 2, 0, 0);
    e->spy->refuse_claims = -1;
    rb_dispatcher_options o;
    th_options(e, &o);
    o.poll_interval = 0.1;
    th_dispatcher(e, &o);
    th_handler *h = th_new_handler(e);
    h->on_start = th_start_ok;
    th_handle(e, h, T);
    rb_dispatcher_start(e->d);
    th_run_for(e, 1.0);
    int calls = e->spy->claim_calls;
    print_message("# %d claims in 1 s while the store refuses them (poll_interval 0.1)\n", calls);
    assert_true(calls >= 5 && calls <= 25);
    e->spy->refuse_claims = 0;
    TH_RUN_UNTIL(e, h->settles == 2, 5);
    assert_int_equal(h->settles, 2);
    th_ids_free(&ids);
}

/* ---- options and handlers --------------------------------------------------------------------- */
typedef struct option_case {
    const char *what;
    double lease, shutdown, poll;
    int concurrency;
    int ok;
} option_case;

static void options_check_refuses_what_is_out_of_range(void **state)
{
    (void)state;
    static option_case cases[] = {
        {"defaults", 30, 30, 1, 64, 1},
        {"the smallest", RB_MIN_LEASE, 0, 1e-9, 1, 1},
        {"the largest", RB_MAX_SECONDS, RB_MAX_SECONDS, RB_MAX_SECONDS, RB_MAX_CONCURRENCY, 1},
        {"lease NaN", NAN, 30, 1, 64, 0},
        {"lease inf", INFINITY, 30, 1, 64, 0},
        {"lease -inf", -INFINITY, 30, 1, 64, 0},
        {"lease negative", -1, 30, 1, 64, 0},
        {"lease zero", 0, 30, 1, 64, 0},
        {"lease below the minimum", RB_MIN_LEASE / 2, 30, 1, 64, 0},
        {"lease huge", RB_MAX_SECONDS * 2, 30, 1, 64, 0},
        {"lease 1e300", 1e300, 30, 1, 64, 0},
        {"shutdown NaN", 30, NAN, 1, 64, 0},
        {"shutdown inf", 30, INFINITY, 1, 64, 0},
        {"shutdown negative", 30, -0.5, 1, 64, 0},
        {"shutdown huge", 30, RB_MAX_SECONDS * 2, 1, 64, 0},
        {"poll NaN", 30, 30, NAN, 64, 0},
        {"poll inf", 30, 30, INFINITY, 64, 0},
        {"poll negative", 30, 30, -1, 64, 0},
        {"poll zero", 30, 30, 0, 64, 0},
        {"poll huge", 30, 30, RB_MAX_SECONDS * 2, 64, 0},
        {"concurrency zero", 30, 30, 1, 0, 0},
        {"concurrency negative", 30, 30, 1, -5, 0},
        {"concurrency huge", 30, 30, 1, RB_MAX_CONCURRENCY + 1, 0},
        {"concurrency INT_MIN", 30, 30, 1, -2147483647 - 1, 0},
    };
    char why[200];
    rb_store *s = rb_store_open(ev_default_loop(0), "sqlite::memory:", NULL, why, sizeof why);
    if (!s) fail_msg("sqlite::memory: %s", why);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const option_case *c = &cases[i];
        rb_dispatcher_options o;
        rb_dispatcher_options_init(&o);
        o.lease_duration = c->lease;
        o.shutdown_timeout = c->shutdown;
        o.poll_interval = c->poll;
        o.concurrency = c->concurrency;
        char err[200] = "unchanged";
        int rc = rb_dispatcher_options_check(&o, err, sizeof err);
        if (c->ok) {
            if (rc != 0) fail_msg("%s: refused (%s)", c->what, err);
            assert_string_equal(err, "unchanged");
        } else {
            if (rc != -1) fail_msg("%s: accepted", c->what);
            assert_true(strlen(err) > 10);
            /* the message names the option */
            const char *name = c->what[0] == 'l' ? "lease_duration" : c->what[0] == 's'
                ? "shutdown_timeout" : c->what[0] == 'p' ? "poll_interval" : "concurrency";
            if (!strstr(err, name)) fail_msg("%s: the message does not name %s: %s", c->what, name, err);
            assert_int_equal(rb_dispatcher_options_check(&o, NULL, 0), -1);
            char tiny[4];
            assert_int_equal(rb_dispatcher_options_check(&o, tiny, sizeof tiny), -1);
            assert_int_equal(strlen(tiny), 3);
        }
        rb_dispatcher *d = rb_dispatcher_new(s, &o);
        if (c->ok) assert_non_null(d);
        else assert_null(d);
        rb_dispatcher_free(d);
    }
    rb_dispatcher_options o;
    rb_dispatcher_options_init(&o);
    assert_int_equal(o.claim_ahead, AHEAD_MAX);
    assert_int_equal(rb_dispatcher_options_check(&o, NULL, 0), 0);
    const int aheads[] = {0, 1, RB_MAX_CLAIM_AHEAD, -1, RB_MAX_CLAIM_AHEAD + 1, -2147483647 - 1};
    for (size_t i = 0; i < sizeof aheads / sizeof aheads[0]; i++) {
        o.claim_ahead = aheads[i];
        char err[200] = "";
        int ok = aheads[i] >= 0 && aheads[i] <= RB_MAX_CLAIM_AHEAD;
        assert_int_equal(rb_dispatcher_options_check(&o, err, sizeof err), ok ? 0 : -1);
        if (!ok) assert_non_null(strstr(err, "claim_ahead"));
        rb_dispatcher *d = rb_dispatcher_new(s, &o);
        if (ok) assert_non_null(d);
        else assert_null(d);
        rb_dispatcher_free(d);
    }
    s->vt->close(s);
}

static void handle_refuses_a_second_handler_and_a_late_one(void **state)
{
    th_env *e = th_env_of(state);
    th_dispatcher(e, NULL);
    th_handler *h = th_new_handler(e);
    th_handle(e, h, T);
    assert_int_equal(rb_dispatcher_handle(e->d, T, &h->def), -1);     /* the topic has one */
    rb_handler_def none = {0};
    assert_int_equal(rb_dispatcher_handle(e->d, "other", &none), -1);  /* no start */
    assert_int_equal(rb_dispatcher_handle(e->d, "other", NULL), -1);
    rb_dispatcher_start(e->d);
    th_handler *late = th_new_handler(e);
    late->def.start = h->def.start;
    assert_int_equal(rb_dispatcher_handle(e->d, "later", &late->def), -1);
    th_stop(e, 1);
    rb_dispatcher_free(e->d);
    e->d = NULL;
    assert_int_equal(h->freed, 1);      /* the refused ones are not the dispatcher's */
    assert_int_equal(late->freed, 0);
}

/* Only topics with a handler are claimed. */
static void only_handled_topics_are_claimed(void **state)
{
    th_env *e = th_env_of(state);
    th_ids mine = th_enqueue(e, T, 3, 0, 0), other = th_enqueue(e, "other", 3, 0, 0);
    th_dispatcher(e, NULL);
    th_handler *h = th_new_handler(e);
    h->on_start = th_start_ok;
    th_handle(e, h, T);
    rb_dispatcher_start(e->d);
    TH_RUN_UNTIL(e, h->settles == 3, 10);
    th_run_for(e, 0.1);
    assert_int_equal(h->settles, 3);
    for (size_t i = 0; i < other.n; i++) assert_int_equal(th_status(e, other.id[i]), RB_PENDING);
    th_ids_free(&mine);
    th_ids_free(&other);
}

#define BOTH(name, fn) TH_TEST(sqlite_memory, name, fn), TH_TEST(postgresql, name, fn)

int main(void)
{
    const struct CMUnitTest tests[] = {
        BOTH("never more handlers running than concurrency", never_more_runs_than_concurrency),
        BOTH("one claim at a time when the store runs them one by one",
             one_claim_at_a_time_without_parallelism),
        BOTH("claim_parallelism 2: two claims in flight during a backlog, never more",
             claim_parallelism_two_is_respected),
        BOTH("claim_parallelism 3: three claims in flight during a backlog, never more",
             claim_parallelism_three_is_respected),
        BOTH("handlers faster than a claim: claims ahead of the slots, never run more at once",
             fast_handlers_claim_ahead_of_the_slots),
        BOTH("claim_ahead 0: claims never go beyond the free slots",
             claim_ahead_0_claims_only_the_free_slots),
        BOTH("a stop hands back what was claimed ahead, unrun, the attempts back",
             a_stop_hands_back_what_was_claimed_ahead),
        BOTH("runs claimed ahead behind a long one are handed back within their lease",
             runs_claimed_ahead_are_handed_back_within_their_lease),
        BOTH("a lane behind slots held by a higher one neither overruns them nor hoards",
             a_lane_behind_full_slots_does_not_hoard),
        BOTH("a delivery claimed again while its earlier run settles waits for a slot",
             a_parked_run_waits_for_a_slot),
        BOTH("a run parked behind another dispatcher's run is started on its own dispatcher",
             a_run_parked_behind_another_dispatchers_starts_on_its_own),
        BOTH("a dispatcher freed with a run parked behind another's leaves nothing dangling",
             a_dispatcher_freed_with_a_run_parked_behind_another),
        BOTH("a run parked behind a freed dispatcher's run moves up and starts",
             a_run_parked_behind_a_freed_dispatchers_run_starts),
        BOTH("a lease too short for the batch stops claiming ahead, and everything completes",
             a_short_lease_stops_claiming_ahead_what_cannot_start),
        BOTH("a claim answered after the dispatcher was freed frees its records",
             a_claim_answered_after_free_frees_its_records),
        BOTH("a claim answered past the runs' local deadline is released, the attempt back",
             a_claim_answered_past_the_local_deadline_is_released),
        BOTH("a failing claim is retried at the poll interval, not spun on",
             a_failing_claim_is_retried_at_the_poll_interval),
        {"rb_dispatcher_options_check refuses NaN, inf, negative, zero and huge values",
         options_check_refuses_what_is_out_of_range, NULL, NULL, NULL},
        TH_TEST(sqlite_memory, "handle refuses a second handler, no start, and after start",
                handle_refuses_a_second_handler_and_a_late_one),
        BOTH("only topics with a handler are claimed", only_handled_topics_are_claimed),
    };
    return cmocka_run_group_tests_name("claim", tests, NULL, NULL);
}
