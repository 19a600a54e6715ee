/* dispatcher_claim.c -- lanes and claiming: claims sized to the free slots, by priority, and
 * the runs claimed ahead of them. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "dispatch/dispatcher_impl.h"
#include "util/alloc.h"
#include "util/timer.h"
#include "util/log.h"
#include "util/list.h"
#include "util/text.h"
#include "util/check.h"

/* ---- claiming ------------------------------------------------------------------------------ */
handler_entry *disp_find_handler(rb_dispatcher *d, const char *topic)
{
    for (size_t i = 0; i < d->nhandlers; i++)
        if (strcmp(d->handlers[i].topic, topic) == 0) return &d->handlers[i];
    return NULL;
}

#define CLAIM_MAX 1000          /* deliveries per claim statement */

/* ---- claiming ahead ----------------------------------------------------------------------
 * Handlers that end in less than a claim's round trip leave their slots empty while the next
 * claim is out: at 64 slots a drain of no-ops ran at 64 per round trip. So a lane claims ahead
 * of its free slots as many deliveries as its handlers are expected to finish while a claim
 * is out (its slots times the round trip over the handlers' average run time), at most
 * claim_ahead (an option, 4 by default) times its slots; only a dispatcher of one lane (its
 * handlers share one priority and none has a concurrency of its own, or it has one handler). Those wait here, leased, in claim order, and start as slots
 * free. Slow handlers claim nothing ahead, and neither does a lane whose handlers stopped
 * ending as fast as they did (none ended in twice their average run time and a claim): no
 * delivery waits here much longer than the round trip another process could have run it in.
 * One that still waited a third of its lease (when a run would renew it) is handed back
 * unrun, without using an attempt; a stop hands all of them back at once. */
#define AVERAGE_WEIGHT 0.2      /* of the newest sample in the moving averages */

static double moving_average(double avg, double sample)
{
    return avg < 0 ? sample : avg + AVERAGE_WEIGHT * (sample - avg);
}

void disp_note_run_time(rb_dispatcher *d, size_t k, double seconds)
{
    if (seconds >= 0) d->lanes[k].run_time = moving_average(d->lanes[k].run_time, seconds);
    d->lanes[k].last_end = rb_monotonic();
}

/* Runs of lane ln (or of d) that hold a slot: not those waiting for one (claimed ahead, or
 * parked behind an earlier run of the same delivery: both count in nahead). */
static size_t lane_running(const lane *ln)
{
    RB_ASSERT(ln->nsettling + ln->nahead <= ln->nactive);
    return ln->nactive - ln->nsettling - ln->nahead;
}

static size_t disp_running(const rb_dispatcher *d)
{
    RB_ASSERT(d->nsettling + d->nahead <= d->nactive);
    return d->nactive - d->nsettling - d->nahead;
}

/* How many deliveries lane ln may hold beyond its slots. */
static size_t ahead_room(const rb_dispatcher *d, const lane *ln)
{
    /* Beside other lanes a queue claimed ahead would take the slots that a lane of higher
     * priority should get by claiming first when they free: only a single lane claims ahead. */
    if (!d->opt.claim_ahead || d->nlanes > 1) return 0;
    if (ln->run_time < 0 || d->claim_time <= 0) return 0;    /* nothing measured yet */
    /* A run claimed ahead that does not start within a third of its lease is handed back:
     * when no slot freed for that long, what a claim brings now would likely be. (Without
     * this bound a store slowed down, its claims taking 0.4 s, kept claiming ahead behind a
     * run that hung, and handing back, for as long as it hung: claim_test.) */
    double now = rb_monotonic();
    double stale = fmin(2 * ln->run_time + d->claim_time, d->opt.lease_duration / 3);
    /* None of its handlers ended lately while some run, or while every slot is taken (by
     * other lanes): they run longer now than the average says, or cannot start. */
    if (now - ln->last_end > stale &&
        (lane_running(ln) || disp_running(d) >= (size_t)d->opt.concurrency))
        return 0;
    if (ln->ahead_head && now - ln->ahead_head->claimed_at > stale)
        return 0;       /* what it claimed ahead does not start (other lanes hold the slots) */
    double most = (double)d->opt.claim_ahead * (double)ln->limit;
    if ((double)ln->ahead_cap < most) most = (double)ln->ahead_cap;
    double n = (double)ln->limit * d->claim_time / fmax(ln->run_time, 1e-6);
    return n >= most ? (size_t)most : (size_t)n;
}

/* A run was handed back unrun because it could not start within its lease (claimed ahead
 * behind slower runs, or answered too late): its claim, with the room ahead it asked for,
 * brought more than this process can start in time (a short lease, a loaded machine). The
 * lane's room ahead becomes half that claim's, once per claim (runs of a claim made before
 * the last cut cut nothing), and grows back by the lane's slots once a lease, from a lease
 * after the cut. Runs whose claim asked nothing ahead, and parked runs, cut nothing. A pause
 * of one lease alone, with a lease of 10 ms, still claimed 800 and handed back 750 of them
 * every 10 ms: 49,000 hand-backs for 3,000 runs, and on a loaded machine 80 runs in 30 s
 * (claim_test). */
void disp_note_hand_back(rb_dispatcher *d, const rb_run *run)
{
    lane *ln = &d->lanes[run->h->lane];
    if (!run->claim_ahead) return;
    if (ln->cut_at > 0 && run->claimed_at <= ln->cut_at) return;
    size_t had = run->claim_ahead < ln->ahead_cap ? run->claim_ahead : ln->ahead_cap;
    ln->ahead_cap = had / 2;
    ln->cut_at = ln->grown_at = rb_monotonic();
}

/* Before lane ln claims: its room ahead grows back once a lease after a cut. */
static void grow_ahead_cap(rb_dispatcher *d, lane *ln)
{
    if (ln->ahead_cap == SIZE_MAX) return;      /* never cut */
    double now = rb_monotonic();
    if (now - ln->grown_at <= d->opt.lease_duration) return;
    ln->ahead_cap = ln->ahead_cap < SIZE_MAX - ln->limit ? ln->ahead_cap + ln->limit : SIZE_MAX;
    ln->grown_at = now;
}

/* A run waits for a slot: counted apart from the runs that hold one. */
void disp_count_waiting(rb_dispatcher *d, rb_run *run, int n)
{
    lane *ln = &d->lanes[run->h->lane];
    if (n > 0) {
        ln->nahead++;
        d->nahead++;
    } else {
        RB_ASSERT(ln->nahead > 0);
        ln->nahead--;
        RB_ASSERT(d->nahead > 0);
        d->nahead--;
    }
}

/* Queues a run for a slot: at the back (claimed ahead), or at the front (a parked run whose
 * earlier run has settled: it was claimed before those behind it). */
static void ahead_push(rb_dispatcher *d, rb_run *run, int front)
{
    lane *ln = &d->lanes[run->h->lane];
    if (front) {
        run->ahead_next = ln->ahead_head;
        ln->ahead_head = run;
        if (!ln->ahead_tail) ln->ahead_tail = run;
    } else {
        run->ahead_next = NULL;
        if (ln->ahead_tail) ln->ahead_tail->ahead_next = run;
        else ln->ahead_head = run;
        ln->ahead_tail = run;
    }
    disp_count_waiting(d, run, +1);
    d->ahead_due = fmin(d->ahead_due, run->claimed_at + d->opt.lease_duration / 3);
}

/* Takes *at (a link of lane ln's queue) off the queue and returns it. */
static rb_run *ahead_take(rb_dispatcher *d, lane *ln, rb_run **at, rb_run *prev)
{
    rb_run *run = *at;
    *at = run->ahead_next;
    if (ln->ahead_tail == run) ln->ahead_tail = prev;
    run->ahead_next = NULL;
    disp_count_waiting(d, run, -1);
    return run;
}

static void on_ahead_timer(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    disp_start_ahead(w->data);
}

void disp_init_ahead(rb_dispatcher *d)
{
    d->ahead_due = INFINITY;
    rb_timer_init(&d->ahead_timer, on_ahead_timer, 0, 0);
    d->ahead_timer.w.data = d;
}

/* Whether runs may start or be handed back now: not once a stop began, nor inside
 * rb_dispatcher_free's finish_stop (stopped without stopping). */
static int may_start(const rb_dispatcher *d) { return disp_live(d); }

/* Hands back the queued runs that waited a third of their lease (walking the queues only when
 * the earliest is due), and then starts queued runs while slots are free, the lanes of higher
 * priority first. A timer comes back for the next hand-back: the loop may have nothing else to
 * wake it (every slot held by runs that ignore their abort, a long poll_interval). A call made
 * inside one (a run that settles at once, with a parked successor) only asks the outer one to
 * go round again. */
void disp_start_ahead(rb_dispatcher *d)
{
    if (!d->nahead) return;     /* (nothing queued: the timer, if armed, finds nothing) */
    if (d->starting_ahead) {
        d->start_ahead_again = 1;
        return;
    }
    d->starting_ahead = 1;
    rb_timer_stop(d->loop, &d->ahead_timer);
    size_t concurrency = (size_t)d->opt.concurrency;
    double most_wait = d->opt.lease_duration / 3;
    do {
        d->start_ahead_again = 0;
        double now = rb_monotonic();
        if (now >= d->ahead_due) {
            d->ahead_due = INFINITY;
            for (size_t k = 0; k < d->nlanes && may_start(d); k++) {
                lane *ln = &d->lanes[k];
                rb_run *prev = NULL;
                for (rb_run **at = &ln->ahead_head; *at && may_start(d);) {
                    if (now - (*at)->claimed_at < most_wait) {
                        d->ahead_due = fmin(d->ahead_due, (*at)->claimed_at + most_wait);
                        prev = *at;
                        at = &(*at)->ahead_next;
                        continue;
                    }
                    rb_run *run = ahead_take(d, ln, at, prev);
                    disp_note_hand_back(d, run);
                    disp_set_settling(run);
                    disp_write_final(run, RB_OP_RELEASE, 0, NULL);
                }
            }
        }
        for (size_t k = 0; k < d->nlanes && may_start(d); k++) {
            lane *ln = &d->lanes[k];
            while (ln->ahead_head && may_start(d) && disp_running(d) < concurrency &&
                   lane_running(ln) < ln->limit)
                disp_run_start(ahead_take(d, ln, &ln->ahead_head, NULL));
        }
    } while (d->start_ahead_again && may_start(d));
    d->starting_ahead = 0;
    if (may_start(d) && d->ahead_due < INFINITY) {
        rb_timer_stop(d->loop, &d->ahead_timer);
        rb_timer_set(&d->ahead_timer, fmax(d->ahead_due - rb_monotonic(), 0.001), 0);
        rb_timer_start(d->loop, &d->ahead_timer);
    }
}

/* A parked run whose earlier run settled waits for a slot first among its lane's. */
void disp_unparked(rb_dispatcher *d, rb_run *run)
{
    ahead_push(d, run, 1);
    disp_start_ahead(d);
}

/* A stop hands back every run claimed ahead, unrun and without using an attempt. They are
 * taken off their queues first, and the stop cannot end meanwhile (d->stop_held): a write
 * that cannot be made settles its run at once, and ending the stop calls the host, which may
 * free d. The caller checks the stop afterwards. */
void disp_release_ahead(rb_dispatcher *d)
{
    rb_timer_stop(d->loop, &d->ahead_timer);
    rb_run *all = NULL, **tail = &all;
    for (size_t k = 0; k < d->nlanes; k++)
        while (d->lanes[k].ahead_head) {
            rb_run *run = ahead_take(d, &d->lanes[k], &d->lanes[k].ahead_head, NULL);
            *tail = run;
            tail = &run->ahead_next;
        }
    d->ahead_due = INFINITY;
    d->stop_held++;
    for (rb_run *run = all, *next; run; run = next) {
        next = run->ahead_next;
        run->ahead_next = NULL;
        disp_set_settling(run);
        disp_write_final(run, RB_OP_RELEASE, 0, NULL);
    }
    RB_ASSERT(d->stop_held > 0);
    d->stop_held--;
}


/* Claims in flight (of one lane, or of all with lane == (size_t)-1), and (*slots) the handler
 * slots they may fill: at most a few. */
#define ALL_LANES ((size_t)-1)
static int claims_in_flight(const rb_dispatcher *d, size_t lane, size_t *slots)
{
    int n = 0;
    size_t sum = 0;
    for (const claim_ctx *c = d->claims; c; c = c->next)
        if (lane == ALL_LANES || c->lane == lane) {
            n++;
            sum += c->limit;
        }
    if (slots) *slots = sum;
    return n;
}


static int claim_lane(rb_dispatcher *d, size_t k);

/* The slots a claim held in flight and did not fill go to the lanes after it at once: the
 * lanes before it claim first at every pass, so a quiet (or failing) lane in front, whose
 * claims always hold slots while they are out, would otherwise keep a backlog behind it from
 * ever being claimed. Only the lanes those slots kept from claiming are asked (the lanes before
 * it, and lanes that had no use for them, would only poll again). */
static void claim_after(rb_dispatcher *d, size_t lane)
{
    for (size_t k = lane + 1; k < d->nlanes && disp_live(d); k++)
        if (d->lanes[k].blocked) {
            d->lanes[k].blocked = 0;
            claim_lane(d, k);
        }
}

static int any_backlog(const rb_dispatcher *d)
{
    for (size_t i = 0; i < d->nlanes; i++)
        if (d->lanes[i].backlog) return 1;
    return 0;
}

/* After a claim that found less than it asked: when to poll next. A store that wakes the
 * dispatcher for every delivery that becomes due sooner (PostgreSQL while its LISTEN is in
 * force) says when the next one falls due: sleep until then, at most listen_poll_interval
 * (the net under what no trigger sees: a LISTEN through a pooler that drops notifications).
 * Otherwise, and after that first wait, every poll_interval. */
static void arm_poll(rb_dispatcher *d, const rb_claim_result *res)
{
    if (!disp_live(d)) return;
    double wait = d->opt.poll_interval, quiet = res->quiet_until;
    d->poll_is_net = 0;
    if (quiet > 0 && !disp_deaf_to(disp_shared_of(d->store), res->listener)) {
        double most = fmax(d->opt.listen_poll_interval, d->opt.poll_interval);
        wait = fmin(fmax(quiet - rb_monotonic(), 0.001), most);
        d->poll_is_net = wait == most && most > d->opt.poll_interval;
    }
    rb_timer_stop(d->loop, &d->poll_timer);
    rb_timer_set(&d->poll_timer, wait, d->opt.poll_interval);
    rb_timer_start(d->loop, &d->poll_timer);
}

/* A claim of poll `net`, at the end of a whole listen_poll_interval's sleep that the store's
 * answer allowed, found deliveries: nothing should have fallen due meanwhile without a
 * notification. Two such polls since the last notification (once could be a NOTIFY still on
 * its way; the claims of one poll's lanes count once), and the store's notifications are taken
 * as lost. (Only such polls count: at the end of a sleep until a known time, what falls due
 * then is found too. While runs elsewhere keep the next lease expiry nearer than
 * listen_poll_interval, lost notifications go unnoticed; each delivery then waits for the
 * next of those expiries, within listen_poll_interval still.) */
static void found_unannounced(rb_dispatcher *d, unsigned net, unsigned listener)
{
    disp_shared *sh = disp_shared_of(d->store);
    if (!sh || disp_deaf_to(sh, listener) || net == d->net_counted) return;
    d->net_counted = net;
    if (++d->unannounced < 2) return;
    sh->deaf = 1;
    sh->deaf_listener = listener;
    rb_log(RB_LOG_WARN, "deliveries fell due that no notification announced, twice: notifications "
                        "are lost (LISTEN through a pooler in transaction mode?); claiming every "
                        "poll_interval from now on");
}

static void on_claimed(void *ud, const char *err, rb_claim_result *res)
{
    RB_ASSERT(!err == !!res);
    claim_ctx *c = ud;
    rb_dispatcher *d = c->d;
    rb_delivery **recs = res ? res->recs : NULL;
    size_t n = res ? res->n : 0;
    if (!d) {
        /* The dispatcher was freed meanwhile: the deliveries are left to their leases. */
        for (size_t i = 0; !err && i < n; i++) rb_delivery_free(recs[i]);
        free(recs);
        free(c);
        return;
    }
    RB_LIST_REMOVE(&d->claims, c);
    d->lanes[c->lane].backlog = !err && n >= c->limit;
    d->lanes[c->lane].claimed = 1;
    d->lanes[c->lane].last_n = err ? 0 : n;
    d->backlog = any_backlog(d);
    double sent_at = c->sent_at;
    size_t lane_k = c->lane, limit = c->limit, ahead = c->ahead;
    unsigned at_net = c->at_net;
    free(c);
    if (!err) d->claim_time = moving_average(d->claim_time, rb_monotonic() - sent_at);
    if (err) {
        static rb_log_limit lim;
        rb_log_limited(&lim, RB_LOG_WARN, "claim failed: %s", err);
        if (disp_winding_down(d)) { disp_check_stop_done(d); return; }   /* may end (and free) d */
        rb_timer_stop(d->loop, &d->claim_retry_timer);
        rb_timer_set(&d->claim_retry_timer, d->opt.poll_interval, 0);
        rb_timer_start(d->loop, &d->claim_retry_timer);
        claim_after(d, lane_k);
        return;
    }
    if (res->crowded_until > 0) {
        disp_shared *sh = disp_shared_of(d->store);
        if (sh && res->crowded_until > sh->crowded_until) sh->crowded_until = res->crowded_until;
    }
    if (at_net && n > 0) found_unannounced(d, at_net, res->listener);
    if (d->listeners) {
        rb_event ev = {.kind = RB_EV_CLAIM, .n = n};
        disp_emit(d, &ev);
    }
    /* A run settled at once in the loop (a write that cannot be made) must not end a stop
     * while the loop still uses d: the stop is checked after it. */
    d->stop_held++;
    for (size_t i = 0; i < n; i++) {
        handler_entry *h = disp_find_handler(d, recs[i]->topic);
        /* A store on this host may say when its lease really began (after a lock wait). */
        double start = recs[i]->claimed_at > sent_at ? recs[i]->claimed_at : sent_at;
        rb_run *run = h ? disp_run_new(d, h, recs[i], start) : NULL;
        if (!run) {
            rb_delivery_free(recs[i]);  /* left to its lease: another claim will take it */
            continue;
        }
        run->claim_ahead = ahead;
        if (d->listeners) {
            rb_event ev = {.kind = RB_EV_CLAIMED, .delivery = run->rec};
            disp_emit(d, &ev);
        }
        rb_run *earlier = disp_active_find(d->store, run->rec->id);
        if (earlier) {
            /* Never overlap with our own unsettled run: it waits (RUN_WAITING, as made) and
             * starts when the earlier one has settled. */
            while (earlier->parked) earlier = earlier->parked;
            earlier->parked = run;
            run->claim_ahead = 0;               /* waits for its earlier run, not for slots */
            disp_count_waiting(d, run, +1);     /* holds no slot while it waits */
            continue;
        }
        if (disp_active_add(d->store, run) != 0) {
            disp_set_settling(run);
            disp_run_settled(run);
            continue;
        }
        if (disp_winding_down(d)) {
            /* The claim crossed a stop: hand the delivery back without using an attempt. */
            disp_set_settling(run);
            disp_write_final(run, RB_OP_RELEASE, 0, NULL);
            continue;
        }
        lane *ln = &d->lanes[run->h->lane];
        if (!ln->ahead_head && disp_running(d) < (size_t)d->opt.concurrency &&
            lane_running(ln) < ln->limit)
            disp_run_start(run);
        else
            ahead_push(d, run, 0);  /* waits for a slot, in claim order */
    }
    RB_ASSERT(d->stop_held > 0);
    d->stop_held--;
    free(recs);
    disp_start_ahead(d);
    /* Last: ending the stop calls the host, which may free d. */
    if (disp_winding_down(d)) { disp_check_stop_done(d); return; }
    if (n < limit) {
        claim_after(d, lane_k);
        arm_poll(d, res);
    }
    if (d->woken_while_claiming && !d->claims) {
        d->woken_while_claiming = 0;
        d->want_claim = 1;
        disp_request_flush(d);
    }
    /* A full batch means more may be due: claim again at the end of this iteration. */
    if (d->backlog) {
        d->want_claim = 1;
        disp_request_flush(d);
    }
}

/* One claim for lane k if it has slots and none of its claims is in the way; 1 when sent. */
static int claim_lane(rb_dispatcher *d, size_t k)
{
    lane *ln = &d->lanes[k];
    int parallel = d->store->vt->claim_parallelism > 1 ? d->store->vt->claim_parallelism : 1;
    /* Claims that waited for a claim slot lately (other processes claim on the table too): a
     * second claim would only wait there as well, holding a snapshot that keeps old row
     * versions in every claim's way (rb_claim_result.crowded_until; docs/performance.md, "Claim
     * slots"). */
    const disp_shared *sh = disp_shared_of(d->store);
    if (parallel > 1 && sh && sh->crowded_until > rb_monotonic()) parallel = 1;
    size_t reserved, lane_reserved;
    claims_in_flight(d, ALL_LANES, &reserved);
    int claiming = claims_in_flight(d, k, &lane_reserved);
    if (claiming >= parallel) return 0;
    /* A second claim beside one in flight only pays during a backlog; when little is due it
     * would only double the polling. */
    if (claiming > 0 && !ln->backlog) return 0;
    /* What the lane and the dispatcher may hold: their slots, and what the lane claims ahead. */
    grow_ahead_cap(d, ln);
    size_t ahead = ahead_room(d, ln);
    size_t lane_limit = ln->limit + ahead;
    size_t concurrency = (size_t)d->opt.concurrency + ahead;
    /* (what lanes of lower priority claimed ahead takes no slot from this one: it starts
     * after this lane's runs, and only as slots free; that of higher lanes starts first) */
    size_t waiting_before = 0;
    for (size_t j = 0; j <= k; j++) waiting_before += d->lanes[j].nahead;
    size_t busy = disp_running(d) + waiting_before + reserved;
    size_t lane_busy = ln->nactive - ln->nsettling + lane_reserved;
    if (lane_busy >= lane_limit) return 0;
    if (busy >= concurrency) {
        /* the other lanes' claims in flight hold the slots: claim_after asks again */
        if (disp_running(d) + waiting_before < concurrency) ln->blocked = 1;
        return 0;
    }
    size_t free_slots = concurrency - busy;
    if (free_slots > lane_limit - lane_busy) free_slots = lane_limit - lane_busy;
    /* With claims side by side each fills a share of the slots, so one batch is answered
     * while the one before it runs. */
    size_t batch = (lane_limit + (size_t)parallel - 1) / (size_t)parallel;
    if (batch > CLAIM_MAX) batch = CLAIM_MAX;
    if (free_slots > batch) free_slots = batch;
    /* Wait for a worthwhile batch unless the lane is idle: one claim per freed slot would
     * cost a round trip per delivery. */
    size_t low_water = ln->limit / 4;
    if (low_water > CLAIM_MAX / 2) low_water = CLAIM_MAX / 2;
    if (low_water > batch) low_water = batch;
    if (lane_busy > 0 && free_slots < low_water) {
        if (reserved > lane_reserved) ln->blocked = 1;
        return 0;
    }
    /* Beside other lanes, a lane that found little asks for little more than it found: slots
     * it reserves for a claim that comes back empty are kept from the lanes after it (a quiet
     * urgent lane claiming every slot would starve a backlog behind it). */
    if (d->nlanes > 1 && ln->claimed && !ln->backlog) {
        size_t modest = ln->last_n ? 2 * ln->last_n : 1;
        if (free_slots > modest) free_slots = modest;
    }
    claim_ctx *c = rb_calloc(1, sizeof *c);
    if (!c) return 0;
    c->d = d;
    c->sent_at = rb_monotonic();
    c->limit = free_slots;
    c->ahead = ahead;
    c->lane = k;
    c->at_net = d->claiming_at_net;
    RB_LIST_PUSH(&d->claims, c);
    rb_claim_req req = {ln->topics, ln->ntopics, free_slots, d->opt.lease_duration};
    if (!disp_claim_carrying(d, &req, on_claimed, c))
        d->store->vt->claim(d->store, &req, on_claimed, c);
    return 1;
}

/* Lanes claim by priority, highest first: they take the free slots before the others. */
static int claim_one(rb_dispatcher *d)
{
    int sent = 0;
    for (size_t k = 0; k < d->nlanes && disp_live(d); k++) sent += claim_lane(d, k);
    return sent;
}

void disp_maybe_claim(rb_dispatcher *d)
{
    if (!disp_live(d) || !d->nhandlers) return;
    while (disp_live(d)) {
        int before = claims_in_flight(d, ALL_LANES, NULL);
        if (!claim_one(d)) break;
        /* Answered at once (SQLite may be synchronous): the next claim waits for this
         * iteration's settles to be flushed, or a backlog would be claimed in one go. */
        if (claims_in_flight(d, ALL_LANES, NULL) <= before) break;
    }
}

void disp_on_poll(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    disp_maybe_claim(w->data);
}

void disp_on_poll_timer(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    rb_dispatcher *d = w->data;
    if (d->poll_is_net && ++d->net_polls == 0) d->net_polls = 1;
    d->claiming_at_net = d->poll_is_net ? d->net_polls : 0;
    d->poll_is_net = 0;     /* (it repeats every poll_interval after) */
    disp_maybe_claim(d);
    d->claiming_at_net = 0;
}

void rb_dispatcher_check_deadlines(rb_dispatcher *d)
{
    for (rb_run *run = d->runs, *next; run; run = next) {
        next = run->next;
        if (run->state == RUN_RUNNING) rb_run_check(run);
    }
}

void rb_dispatcher_wake(rb_dispatcher *d)
{
    if (!disp_live(d)) return;
    /* A claim in flight may have read the table before what woke us committed, and the claim
     * this asks for may be held back by it: claim again when it answers. */
    if (d->claims) d->woken_while_claiming = 1;
    d->want_claim = 1;
    disp_request_flush(d);
}


/* Groups the handlers into lanes: one per topic with a concurrency of its own, and one per
 * priority for the others; ordered by priority, highest first. Returns -1 out of memory. */
int disp_make_lanes(rb_dispatcher *d)
{
    size_t cap = d->nhandlers ? d->nhandlers : 1;
    lane *lanes = rb_calloc(cap, sizeof *lanes);
    const char **topics = rb_calloc(cap, sizeof *topics);
    size_t *order = rb_calloc(cap, sizeof *order);
    if (!lanes || !topics || !order) {
        free(lanes);
        free(topics);
        free(order);
        return -1;
    }
    size_t n = 0;
    for (size_t i = 0; i < d->nhandlers; i++) {
        handler_entry *h = &d->handlers[i];
        size_t k = n;
        if (h->def.concurrency <= 0)
            for (k = 0; k < n && (lanes[k].own || lanes[k].priority != h->def.priority); k++) {}
        if (k == n)
            lanes[n++] = (lane){.priority = h->def.priority, .own = h->def.concurrency > 0,
                                .limit = h->def.concurrency > 0 ? (size_t)h->def.concurrency
                                                                : (size_t)d->opt.concurrency,
                                .run_time = -1, .ahead_cap = SIZE_MAX};
        h->lane = k;
        lanes[k].ntopics++;
    }
    /* highest priority first (insertion sort: lanes are few); order[new] = old */
    for (size_t i = 0; i < n; i++) order[i] = i;
    for (size_t i = 1; i < n; i++)
        for (size_t j = i; j > 0 && lanes[order[j]].priority > lanes[order[j - 1]].priority; j--) {
            size_t t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    lane *sorted = rb_calloc(cap, sizeof *sorted);
    if (!sorted) {
        free(lanes);
        free(topics);
        free(order);
        return -1;
    }
    size_t at = 0;
    for (size_t k = 0; k < n; k++) {
        sorted[k] = lanes[order[k]];
        sorted[k].topics = topics + at;
        at += sorted[k].ntopics;
        sorted[k].ntopics = 0;
    }
    for (size_t i = 0; i < d->nhandlers; i++) {
        handler_entry *h = &d->handlers[i];
        size_t k = 0;
        while (order[k] != h->lane) k++;
        h->lane = k;
        sorted[k].topics[sorted[k].ntopics++] = h->topic;
    }
    free(lanes);
    free(order);
    d->lanes = sorted;
    d->nlanes = n;
    d->lane_topics = topics;
    return 0;
}

