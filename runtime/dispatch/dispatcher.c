/* dispatcher.c -- the claim / run / renew / settle cycle, on the host's libev loop.
 *
 * A dispatcher claims due deliveries in batches sized to its free slots (and ahead of them
 * for fast handlers: dispatcher_claim.c), starts one run per delivery through the topic's
 * handler, renews each lease every third of its duration and
 * keeps a local deadline on the monotonic clock (measured from just before the claim or
 * renewal was sent, less a safety margin) so a run is aborted before the store's expiry lets
 * anyone else claim it. Settle writes made during one loop iteration are coalesced into one
 * fenced store call, flushed from an ev_prepare watcher just before the loop blocks.
 * This file holds the options, lifecycle, events and wake-ups; dispatcher_impl.h names the
 * others. */
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
#include "util/text.h"
#include "util/check.h"

static void on_quiet(struct ev_loop *loop, ev_idle *w, int revents);
static void on_unhandled_check(struct ev_loop *loop, ev_timer *w, int revents);

/* ---- time ------------------------------------------------------------------------------ */
const char *rb_abort_reason_name(rb_abort_reason r)
{
    switch (r) {
    case RB_ABORT_LEASE: return "lease";
    case RB_ABORT_TIMEOUT: return "timeout";
    case RB_ABORT_SHUTDOWN: return "shutdown";
    case RB_ABORT_CANCELLED: return "cancelled";
    default: return NULL;
    }
}

const char *rb_outcome_name(rb_outcome o)
{
    static const char *const names[RB_OUT_COUNT] = {"completed", "retried", "buried", "released",
                                                    "lease_lost", "timeout", "abandoned",
                                                    "cancelled"};
    return (unsigned)o < RB_OUT_COUNT ? names[o] : "unknown";
}

void disp_emit(rb_dispatcher *d, const rb_event *ev)
{
    for (listener *l = d->listeners; l; l = l->next) l->fn(d, ev, l->ud);
}

int rb_dispatcher_on_event(rb_dispatcher *d, rb_event_fn fn, void *ud)
{
    listener *l = rb_malloc(sizeof *l);
    if (!l) return -1;
    *l = (listener){fn, ud, d->listeners};
    d->listeners = l;
    return 0;
}

void rb_dispatcher_off_event(rb_dispatcher *d, rb_event_fn fn, void *ud)
{
    for (listener **pp = &d->listeners; *pp; pp = &(*pp)->next)
        if ((*pp)->fn == fn && (*pp)->ud == ud) {
            listener *l = *pp;
            *pp = l->next;
            free(l);
            return;
        }
}

void rb_dispatcher_options_init(rb_dispatcher_options *o)
{
    memset(o, 0, sizeof *o);
    o->lease_duration = 30;
    o->shutdown_timeout = 30;
    o->poll_interval = 1;
    o->concurrency = 64;
    o->claim_ahead = 4;
    o->listen_poll_interval = 30;
    o->retention = 7 * 86400;
}

/* ---- local wake-ups: every dispatcher on a store hears this process's enqueues ---------- */
/* The dispatchers started on s (its shared state's list), NULL when none is. */
static rb_dispatcher *dispatchers_on(const rb_store *s)
{
    const disp_shared *sh = disp_shared_of(s);
    return sh ? sh->dispatchers : NULL;
}

static void on_local_enqueue(void *ud)
{
    rb_store *s = ud;
    for (rb_dispatcher *d = dispatchers_on(s); d; d = d->next_on_store) rb_dispatcher_wake(d);
}

/* A cancel took the lease of the run of delivery id under token: that run stops, or, still
 * waiting for a slot (claimed ahead, or parked behind an older run of the delivery), never
 * starts (disp_run_start). A lease token is one claim's, so one run at most matches, and the
 * walk ends there: the abort may resume the handler, which may end and free its run (the
 * reference held keeps it alive until the abort is over). */
static void on_local_cancel(void *ud, const char *id, const char *token)
{
    RB_ASSERT(id && token);
    for (rb_run *run = disp_active_find(ud, id); run; run = run->parked) {
        if (!run->rec->lease_token || strcmp(run->rec->lease_token, token) != 0) continue;
        if (run->state == RUN_WAITING || run->state == RUN_BEGINNING || run->state == RUN_RUNNING) {
            run->refs++;
            disp_run_abort(run, RB_ABORT_CANCELLED);
            disp_run_release_ref(run);
        }
        return;
    }
}

/* A schedule changed: every running dispatcher on the store reads them again. */
static void on_local_schedules(void *ud)
{
    disp_shared *sh = disp_shared_of(ud);
    for (rb_dispatcher *d = sh ? sh->dispatchers : NULL; d; d = d->next_on_store)
        disp_schedules_changed(d);
}

static void wake_list_add(rb_dispatcher *d, disp_shared *sh)
{
    d->next_on_store = sh->dispatchers;
    sh->dispatchers = d;
    d->store->local_wakeup = on_local_enqueue;
    d->store->local_cancelled = on_local_cancel;
    d->store->local_schedules = on_local_schedules;
    d->store->local_wakeup_ud = d->store;
}

static void wake_list_remove(rb_dispatcher *d)
{
    disp_shared *sh = disp_shared_of(d->store);
    RB_ASSERT(sh);
    for (rb_dispatcher **pp = &sh->dispatchers; *pp; pp = &(*pp)->next_on_store) {
        if (*pp == d) {
            *pp = d->next_on_store;
            return;
        }
    }
    RB_ASSERT(!"a started dispatcher is on its store's list");
}

/* A notification (or the listener's start or end): it hears. */
static void on_store_notify(void *ud)
{
    rb_store *s = ud;
    for (rb_dispatcher *d = dispatchers_on(s); d; d = d->next_on_store) d->unannounced = 0;
    on_local_enqueue(s);
}


/* ---- topics nobody here handles ------------------------------------------------------------ */
/* Deliveries of a topic no dispatcher handles wait in silence (a typo in d:handle, a worker not
 * deployed). Once per store, a moment after its first dispatcher started (so the others of the
 * process have started too), the pending counts per topic are read and each topic that none of
 * the store's dispatchers here handles is named in a warning. The counts come from at most
 * UNHANDLED_SCAN_MAX pending deliveries (the earliest due) where the store can bound the read
 * (pending_topics): a process start must not cost a scan of a table of millions of rows. */
#define UNHANDLED_CHECK_AFTER 2.0
#define UNHANDLED_NAMED_MAX 10
#define UNHANDLED_SCAN_MAX 10000

static int handled_here(const rb_store *s, const char *topic)
{
    for (rb_dispatcher *d = dispatchers_on(s); d; d = d->next_on_store)
        if (!disp_ended(d) && disp_find_handler(d, topic)) return 1;
    return 0;
}

static int column(const rb_rowset *rs, const char *name)
{
    for (int c = 0; c < rs->ncols; c++)
        if (strcmp(rs->names[c], name) == 0) return c;
    return -1;
}

static void on_topic_rows(void *ud, const char *err, rb_rowset *rs)
{
    rb_store *s = ud;
    int tc = rs ? column(rs, "topic") : -1, pc = rs ? column(rs, "pending") : -1;
    size_t named = 0, more = 0;
    /* counts that add up to the bound are lower bounds: more may be pending (s is read only
     * when rows came: an error may be the answer of a store being closed) */
    int64_t seen = 0;
    for (size_t r = 0; !err && pc >= 0 && r < rs->nrows; r++) {
        const rb_value *p = &rs->vals[r * (size_t)rs->ncols + (size_t)pc];
        if (p->type == RB_VINT && p->i > 0) seen += p->i;
    }
    const char *at_least = seen >= UNHANDLED_SCAN_MAX && s->vt->pending_topics ? "at least " : "";
    for (size_t r = 0; !err && dispatchers_on(s) && tc >= 0 && pc >= 0 && r < rs->nrows; r++) {
        const rb_value *t = &rs->vals[r * (size_t)rs->ncols + (size_t)tc];
        const rb_value *p = &rs->vals[r * (size_t)rs->ncols + (size_t)pc];
        if (t->type != RB_VTEXT || p->type != RB_VINT || p->i <= 0) continue;
        char topic[200];
        snprintf(topic, sizeof topic, "%.*s", (int)(t->len < 199 ? t->len : 199), t->s);
        if (handled_here(s, topic)) continue;
        if (named++ < UNHANDLED_NAMED_MAX) {
            char shown[256];
            rb_one_line(shown, sizeof shown, topic);
            rb_log(RB_LOG_WARN, "%s%lld deliveries of topic \"%s\" are pending and no dispatcher "
                   "of this process handles it (a typo in d:handle, or a worker not running?)",
                   at_least, (long long)p->i, shown);
        } else {
            more++;
        }
    }
    if (more) rb_log(RB_LOG_WARN, "and %zu more topics with pending deliveries nobody here handles", more);
    rb_rowset_free(rs);
}

static void on_unhandled_check(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    rb_dispatcher *d = w->data;
    if (disp_winding_down(d)) return;
    if (d->store->vt->pending_topics)
        d->store->vt->pending_topics(d->store, UNHANDLED_SCAN_MAX, on_topic_rows, d->store);
    else
        d->store->vt->topic_stats(d->store, on_topic_rows, d->store);
}

/* ---- lifecycle ------------------------------------------------------------------------------ */
int rb_dispatcher_options_check(const rb_dispatcher_options *o, char *err, size_t errlen)
{
    const char *why = NULL;
    if (!(o->lease_duration >= RB_MIN_LEASE && o->lease_duration <= RB_MAX_SECONDS))
        why = "lease_duration must be a number of seconds from 0.01 to 100 years";
    else if (!rb_valid_seconds(o->shutdown_timeout))
        why = "shutdown_timeout must be a number of seconds from 0 to 100 years";
    else if (!(o->poll_interval > 0 && o->poll_interval <= RB_MAX_SECONDS))
        why = "poll_interval must be a number of seconds above 0, at most 100 years";
    else if (!(o->listen_poll_interval > 0 && o->listen_poll_interval <= RB_MAX_SECONDS))
        why = "listen_poll_interval must be a number of seconds above 0, at most 100 years";
    else if (o->concurrency < 1 || o->concurrency > RB_MAX_CONCURRENCY)
        why = "concurrency must be an integer from 1 to 1000000";
    else if (o->claim_ahead < 0 || o->claim_ahead > RB_MAX_CLAIM_AHEAD)
        why = "claim_ahead must be an integer from 0 to 100";
    else if (!rb_valid_seconds(o->retention))
        why = "retention must be a number of seconds from 0 (off) to 100 years";
    if (why && err && errlen) snprintf(err, errlen, "%s", why);
    return why ? -1 : 0;
}

rb_dispatcher *rb_dispatcher_new(rb_store *store, const rb_dispatcher_options *o)
{
    rb_dispatcher_options opt;
    if (o) opt = *o;
    else rb_dispatcher_options_init(&opt);
    if (rb_dispatcher_options_check(&opt, NULL, 0) != 0) return NULL;
    if (!store || !store->vt->claim || !store->vt->settle) return NULL;  /* not a delivery store */
    rb_dispatcher *d = rb_calloc(1, sizeof *d);
    if (!d) return NULL;
    d->store = store;
    d->loop = store->loop;
    d->opt = opt;
    if (opt.on_event && rb_dispatcher_on_event(d, opt.on_event, opt.on_event_ud) != 0) {
        free(d);
        return NULL;
    }
    d->margin = rb_lease_margin(d->opt.lease_duration);
    d->claim_time = -1;     /* no claim measured yet */
    disp_init_ahead(d);
    ev_prepare_init(&d->flush_watcher, disp_on_flush);
    d->flush_watcher.data = d;
    rb_idle_init(&d->spin_watcher, disp_on_spin);
    rb_timer_init(&d->poll_timer, disp_on_poll_timer, d->opt.poll_interval, d->opt.poll_interval);
    d->poll_timer.w.data = d;
    rb_timer_init(&d->claim_retry_timer, disp_on_poll, 0, 0);
    rb_timer_init(&d->unhandled_timer, on_unhandled_check, UNHANDLED_CHECK_AFTER, 0);
    d->unhandled_timer.w.data = d;
    d->claim_retry_timer.w.data = d;
    rb_idle_init(&d->quiet_watcher, on_quiet);
    d->quiet_watcher.w.data = d;
    return d;
}

int rb_dispatcher_handle(rb_dispatcher *d, const char *topic, const rb_handler_def *h)
{
    if (disp_started(d) || disp_find_handler(d, topic) || !h || !h->start) return -1;
    handler_entry *hs = rb_realloc(d->handlers, (d->nhandlers + 1) * sizeof *hs);
    if (!hs) return -1;
    d->handlers = hs;
    const char **ts = rb_realloc(d->topics, (d->nhandlers + 1) * sizeof *ts);
    if (!ts) return -1;
    d->topics = ts;
    handler_entry *e = &d->handlers[d->nhandlers];
    e->topic = rb_strdup(topic);
    if (!e->topic) return -1;
    e->def = *h;
    /* realloc may have moved the handlers: rebuild the topic pointers */
    d->nhandlers++;
    for (size_t i = 0; i < d->nhandlers; i++) d->topics[i] = d->handlers[i].topic;
    return 0;
}

static const unsigned char phase_moves[] = {
    [DISP_NEW] = 1u << DISP_RUNNING | 1u << DISP_CANCELLED,
    [DISP_RUNNING] = 1u << DISP_STOPPING | 1u << DISP_STOPPED,
    [DISP_STOPPING] = 1u << DISP_STOPPED,
    [DISP_STOPPED] = 0,
    [DISP_CANCELLED] = 0,
};

void disp_set_phase(rb_dispatcher *d, disp_phase to)
{
    RB_ASSERT(phase_moves[d->phase] & (1u << to));
    d->phase = to;
}

int rb_dispatcher_start(rb_dispatcher *d)
{
    /* A dispatcher stopped before it started stays stopped: nothing could stop it again. */
    if (d->phase != DISP_NEW) return 0;
    disp_shared *sh = disp_shared_get(d->store);
    if (!sh) return -1;
    if (disp_retention_start(d) != 0) {
        disp_shared_release(d->store);
        return -1;
    }
    if (disp_schedules_start(d) != 0) {
        disp_retention_stop(d);
        disp_shared_release(d->store);
        return -1;
    }
    if (disp_make_lanes(d) != 0) {
        disp_schedules_stop(d);
        disp_retention_stop(d);
        disp_shared_release(d->store);
        return -1;
    }
    disp_set_phase(d, DISP_RUNNING);
    ev_prepare_start(d->loop, &d->flush_watcher);
    rb_timer_start(d->loop, &d->poll_timer);
    wake_list_add(d, sh);
    if (!sh->unhandled_checked && (d->store->vt->pending_topics || d->store->vt->topic_stats) &&
        d->nhandlers) {
        sh->unhandled_checked = 1;
        rb_timer_start(d->loop, &d->unhandled_timer);
    }
    if (d->store->vt->set_wakeup) d->store->vt->set_wakeup(d->store, on_store_notify, d->store);
    d->want_claim = 1;
    disp_request_flush(d);
    disp_every_start(d);
    return 0;
}

int rb_dispatcher_running(const rb_dispatcher *d)
{
    return d->phase == DISP_RUNNING || d->phase == DISP_STOPPING;
}

int rb_dispatcher_stopping(const rb_dispatcher *d) { return d->phase == DISP_STOPPING; }
size_t rb_dispatcher_active(const rb_dispatcher *d) { return d->nactive; }
size_t rb_dispatcher_ahead(const rb_dispatcher *d) { return d->nahead; }
rb_store *rb_dispatcher_store(const rb_dispatcher *d) { return d->store; }

static void finish_stop(rb_dispatcher *d)
{
    if (disp_ended(d)) return;
    disp_set_phase(d, DISP_STOPPED);
    rb_timer_stop(d->loop, &d->grace_timer);
    rb_timer_stop(d->loop, &d->hard_timer);
    rb_timer_stop(d->loop, &d->poll_timer);
    rb_timer_stop(d->loop, &d->claim_retry_timer);
    rb_timer_stop(d->loop, &d->unhandled_timer);
    rb_timer_stop(d->loop, &d->ahead_timer);
    disp_retention_stop(d);
    disp_schedules_stop(d);
    disp_every_stop(d);
    /* Runs still unsettled are abandoned with their lease: it expires and another process
     * runs them again. Their late endings write nothing. */
    for (rb_run *run = d->runs; run; run = run->next) {
        run->abandoned = 1;
        disp_stop_renewals(run);
        if (!run->aborted) disp_run_abort(run, RB_ABORT_SHUTDOWN);
    }
    wake_list_remove(d);
    int last = !dispatchers_on(d->store);
    disp_shared_release(d->store);
    if (d->store->vt->set_wakeup && last) d->store->vt->set_wakeup(d->store, NULL, NULL);
    stop_waiter *w = d->waiters;
    d->waiters = NULL;
    stop_waiter spare = d->spare_waiter;
    d->spare_waiter.done = NULL;
    disp_maybe_quiet(d);
    if (d->opt.on_stopped) d->opt.on_stopped(d, d->opt.on_stopped_ud);
    if (spare.done) spare.done(spare.ud);
    while (w) {
        stop_waiter *next = w->next;
        w->done(w->ud);
        free(w);
        w = next;
    }
}

/* Once stopped with nothing in flight, the host is told (from the loop, so it may free d). */
void disp_maybe_quiet(rb_dispatcher *d)
{
    if (disp_ended(d) && !d->quiet && d->nactive == 0 && !d->claims && d->opt.on_quiet)
        rb_idle_start(d->loop, &d->quiet_watcher);
}

static void on_quiet(struct ev_loop *loop, ev_idle *w, int revents)
{
    (void)revents;
    rb_dispatcher *d = w->data;
    rb_idle_stop(loop, (rb_idle *)w);
    if (d->quiet || d->nactive || d->claims) return;
    d->quiet = 1;
    d->opt.on_quiet(d, d->opt.on_quiet_ud);     /* last: the host may free d */
}

void disp_check_stop_done(rb_dispatcher *d)
{
    if (d->stop_held) return;   /* the loop that holds it checks when it is done */
    if (d->phase == DISP_STOPPING && d->nactive == 0 && !d->claims) finish_stop(d);
    else disp_maybe_quiet(d);
}

static void on_grace_over(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    rb_dispatcher *d = w->data;
    double now = rb_monotonic();
    for (rb_run *run = d->runs; run; run = run->next) {
        run->shutdown_deadline = now;
        if (run->state == RUN_RUNNING || run->state == RUN_BEGINNING) {
            if (run->state == RUN_RUNNING) disp_run_abort(run, RB_ABORT_SHUTDOWN);
            else run->aborted = RB_ABORT_SHUTDOWN;
        }
    }
}

static void on_hard_timeout(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    finish_stop(w->data);
}

void rb_dispatcher_stop(rb_dispatcher *d, double timeout, void (*done)(void *ud), void *ud)
{
    if (timeout < 0) timeout = d->opt.shutdown_timeout;
    if (done) {
        if (!rb_dispatcher_running(d)) {
            if (d->phase == DISP_NEW) disp_set_phase(d, DISP_CANCELLED);
            done(ud);
            return;
        }
        stop_waiter *w = rb_malloc(sizeof *w);
        if (w) {
            *w = (stop_waiter){done, ud, d->waiters};
            d->waiters = w;
        } else if (!d->spare_waiter.done) {
            /* out of memory: done must come all the same, or the host waits for ever */
            d->spare_waiter = (stop_waiter){done, ud, NULL};
        }
    }
    if (d->phase == DISP_NEW) disp_set_phase(d, DISP_CANCELLED);
    if (disp_ended(d)) return;
    if (d->phase == DISP_STOPPING) {
        /* A later stop may only shorten the timeout. */
        double left = rb_timer_remaining(d->loop, &d->hard_timer);
        if (timeout >= left) return;
    }
    if (d->phase == DISP_RUNNING) disp_set_phase(d, DISP_STOPPING);
    disp_every_stop(d);
    ev_now_update(d->loop);     /* the loop's cached time may be stale: time from now */
    rb_timer_stop(d->loop, &d->poll_timer);
    rb_timer_stop(d->loop, &d->grace_timer);
    rb_timer_stop(d->loop, &d->hard_timer);
    rb_timer_init(&d->grace_timer, on_grace_over, timeout * 0.8, 0);
    d->grace_timer.w.data = d;
    rb_timer_init(&d->hard_timer, on_hard_timeout, timeout, 0);
    d->hard_timer.w.data = d;
    rb_timer_start(d->loop, &d->grace_timer);
    rb_timer_start(d->loop, &d->hard_timer);
    disp_release_ahead(d);
    disp_check_stop_done(d);
}

void rb_dispatcher_free(rb_dispatcher *d)
{
    if (!d) return;
    if (rb_dispatcher_running(d)) finish_stop(d);
    ev_prepare_stop(d->loop, &d->flush_watcher);
    rb_idle_stop(d->loop, &d->spin_watcher);
    rb_timer_stop(d->loop, &d->poll_timer);
    rb_timer_stop(d->loop, &d->claim_retry_timer);
    rb_timer_stop(d->loop, &d->unhandled_timer);
    rb_timer_stop(d->loop, &d->ahead_timer);
    rb_timer_stop(d->loop, &d->grace_timer);
    rb_timer_stop(d->loop, &d->hard_timer);
    rb_idle_stop(d->loop, &d->quiet_watcher);
    disp_every_free(d);
    /* (finish_stop took it off its store's list: a quiet dispatcher touches its store no
     * more, so the store may be closed before it is freed) */
    /* Claims still in flight answer later: they find no dispatcher and free their records. */
    for (claim_ctx *c = d->claims; c; c = c->next) c->d = NULL;
    /* Runs still referenced by in-flight store operations are detached, not freed: their
     * callbacks still arrive. The settle queue is dropped (leases expire). */
    for (settle_req *r = d->queue.head, *next; r; r = next) {
        next = r->next;
        rb_run *run = r->run;
        disp_settle_free(r);
        RB_ASSERT(run->refs > 0);
        run->refs--;
    }
    disp_unlink_parked(d);
    for (rb_run *run = d->runs, *next; run; run = next) {
        next = run->next;
        int in_registry = disp_active_find(d->store, run->rec->id) == run;
        disp_active_remove(d->store, run);
        if (in_registry) disp_hand_on_parked(run);
        disp_stop_clocks(run);
        if (run->retry) {
            disp_settle_free(run->retry);
            run->retry = NULL;
            RB_ASSERT(run->refs > 0);
            run->refs--;
        }
        disp_set_state(run, RUN_SETTLED);
        if (run->refs == 0) disp_run_free(run);
    }
    for (size_t i = 0; i < d->nhandlers; i++) {
        if (d->handlers[i].def.free) d->handlers[i].def.free(d->handlers[i].def.ud);
        free(d->handlers[i].topic);
    }
    free(d->handlers);
    free(d->topics);
    free(d->lane_topics);
    free(d->lanes);
    while (d->listeners) rb_dispatcher_off_event(d, d->listeners->fn, d->listeners->ud);
    free(d);
}

