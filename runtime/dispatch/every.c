/* every.c -- rb_dispatcher_every: a function run once per interval across every process whose
 * dispatcher on the same store has the same job (docs/c.md "Every"; d:every in Lua).
 *
 * Whoever holds the named lease "every:NAME" runs it, and keeps the lease from one run to the
 * next: after a run it extends the lease to end a little (`slack`) after the next run's time,
 * and at that time for one interval. So the runs keep a fixed rate: run k starts at the first
 * run's time plus k intervals. A run that ends past the next run's time is followed at once by
 * one run (the ticks it missed are dropped) and the runs after it keep to the grid. A holder
 * that dies frees the name when its lease expires; the others try it every `poll` seconds.
 *
 * A job is in one of three states: waiting for its timer, waiting for a store's answer
 * (`in_flight`), or running (`running`: the host's start was called and it has not finished).
 * Its dispatcher's stop ends the waiting, not a run; freeing the dispatcher orphans a job
 * that is not waiting (`d` NULL), and the answer or the finish it waits for frees it. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "dispatch/dispatcher_impl.h"
#include "stores/leases.h"
#include "util/alloc.h"
#include "util/check.h"
#include "util/clock.h"
#include "util/list.h"
#include "util/log.h"
#include "util/text.h"

#define LEASE_PREFIX "every:"

struct rb_every_run {
    rb_dispatcher *d;           /* NULL once its dispatcher was freed: the job is an orphan */
    rb_store *store;
    rb_every_def def;
    char *name;
    char *lease_name;           /* "every:NAME" */
    double interval;
    double poll;                /* between tries while someone else holds the name */
    double slack;               /* the lease is kept this long past the next run's time */
    rb_lease *lease;            /* held from the acquire until lost */
    double at;                  /* monotonic: the next run's time */
    rb_timer timer;             /* until `at` */
    int in_flight;              /* an acquire or extend is out */
    int running;                /* start was called, finish not yet */
    struct rb_every_run *prev, *next;   /* d->every_jobs (list.h) */
};

static void job_free(rb_every_run *j)
{
    RB_ASSERT(!j->in_flight && !j->running);
    if (j->lease) rb_lease_free(j->lease);
    if (j->def.free) j->def.free(j->def.ud);
    free(j->name);
    free(j->lease_name);
    free(j);
}

/* An orphan's answer or finish: frees it. 1 when it did. */
static int gone(rb_every_run *j)
{
    if (j->d || j->in_flight || j->running) return 0;
    job_free(j);
    return 1;
}

static int stopped(const rb_every_run *j) { return !j->d || disp_winding_down(j->d); }

static void drop_lease(rb_every_run *j)
{
    if (j->lease) rb_lease_free(j->lease);
    j->lease = NULL;
}

/* Waits until `at` (at once when it has passed). */
static void wait_for_at(rb_every_run *j)
{
    if (stopped(j)) return;
    rb_timer_set(&j->timer, fmax(0, j->at - rb_monotonic()), 0);
    rb_timer_start(j->d->loop, &j->timer);
}

static void on_expire(rb_lease *l, void *ud)
{
    (void)l;
    rb_every_run *j = ud;
    if (j->running && j->def.abort) j->def.abort(j, j->def.ud);
}

/* Runs the job if the lease is still ours; otherwise tries again a poll from now. */
static void run_or_retry(rb_every_run *j)
{
    if (stopped(j)) return;
    /* (a lease over already, in a process frozen since the acquire, runs nothing) */
    if (j->lease && !rb_lease_over(j->lease)) {
        j->running = 1;
        rb_lease_on_expire(j->lease, on_expire, j);
        j->def.start(j, j->def.ud);
        return;
    }
    drop_lease(j);
    j->at = rb_monotonic() + j->poll;
    wait_for_at(j);
}

static void on_acquired(void *ud, const char *err, rb_lease *lease)
{
    (void)err;      /* someone else holds it, or the store failed: a poll from now */
    rb_every_run *j = ud;
    RB_ASSERT(j->in_flight && !j->lease);
    j->in_flight = 0;
    j->lease = lease;
    if (!gone(j)) run_or_retry(j);
}

static void acquire(rb_every_run *j)
{
    j->at = rb_monotonic();
    j->in_flight = 1;
    rb_lease_try_acquire(j->store, j->lease_name, j->interval, on_acquired, j);
}

static void on_tick_extended(void *ud, const char *err, int ok)
{
    (void)err;
    rb_every_run *j = ud;
    j->in_flight = 0;
    if (gone(j)) return;
    if (ok) {
        run_or_retry(j);
        return;
    }
    drop_lease(j);
    if (!stopped(j)) acquire(j);
}

/* The run's time: the holder extends its lease for the interval (the run's own time), anyone
 * else tries to take the name. */
static void on_timer(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    rb_every_run *j = w->data;
    RB_ASSERT(j->d && !j->in_flight && !j->running);
    if (stopped(j)) return;
    if (j->lease && rb_lease_over(j->lease)) drop_lease(j);
    if (j->lease) {
        j->in_flight = 1;
        rb_lease_extend(j->lease, j->interval, on_tick_extended, j);
    } else {
        acquire(j);
    }
}

static void on_rested(void *ud, const char *err, int ok)
{
    (void)err;
    rb_every_run *j = ud;
    j->in_flight = 0;
    if (gone(j)) return;
    if (!ok) drop_lease(j);
    wait_for_at(j);
}

void rb_every_finish(rb_every_run *j, int ok, const char *error)
{
    RB_ASSERT(j->running && !j->in_flight);
    j->running = 0;
    if (j->lease) rb_lease_on_expire(j->lease, NULL, NULL);
    if (!ok) rb_log(RB_LOG_ERROR, "every '%s' failed: %s", j->name, error ? error : "error");
    if (gone(j)) return;
    double now = rb_monotonic();
    j->at += j->interval;
    if (now > j->at) j->at += floor((now - j->at) / j->interval) * j->interval;
    if (j->at <= now) {             /* it overran: the next run at once */
        wait_for_at(j);
        return;
    }
    if (!j->lease || rb_lease_over(j->lease) || stopped(j)) {
        drop_lease(j);
        wait_for_at(j);
        return;
    }
    /* kept until just after the next run's time, when it is extended for that run */
    j->in_flight = 1;
    rb_lease_extend(j->lease, fmin(rb_lease_for(j->at - now + j->slack), RB_MAX_SECONDS),
                    on_rested, j);
}

const char *rb_every_name(const rb_every_run *j) { return j->name; }
rb_lease *rb_every_lease(rb_every_run *j) { return j->lease; }
double rb_every_deadline(const rb_every_run *j) { return j->lease ? rb_lease_deadline(j->lease) : 0; }
rb_dispatcher *rb_every_dispatcher(const rb_every_run *j) { return j->d; }

int rb_every_valid_name(const char *name)
{
    size_t n = name ? strlen(name) : 0;
    return n >= 1 && n <= RB_EVERY_NAME_MAX && rb_utf8_valid(name, n);
}

int rb_dispatcher_every(rb_dispatcher *d, const char *name, double interval, const rb_every_def *def)
{
    if (d->phase != DISP_NEW || !def || !def->start || !rb_every_valid_name(name) ||
        !(interval > 0 && interval <= RB_MAX_SECONDS) || !d->store->vt->lease)
        return -1;
    rb_every_run *j = rb_calloc(1, sizeof *j);
    if (!j) return -1;
    size_t n = strlen(name);
    j->name = rb_strdup(name);
    j->lease_name = rb_malloc(sizeof LEASE_PREFIX + n);
    if (!j->name || !j->lease_name) {
        free(j->name);
        free(j->lease_name);
        free(j);
        return -1;
    }
    memcpy(j->lease_name, LEASE_PREFIX, sizeof LEASE_PREFIX - 1);
    memcpy(j->lease_name + sizeof LEASE_PREFIX - 1, name, n + 1);
    j->d = d;
    j->store = d->store;
    j->def = *def;
    j->interval = interval;
    j->poll = fmin(interval, 1) * 0.5;
    j->slack = j->poll * 0.5;
    rb_timer_init(&j->timer, on_timer, 0, 0);
    j->timer.w.data = j;
    RB_LIST_PUSH(&d->every_jobs, j);
    return 0;
}

void disp_every_start(rb_dispatcher *d)
{
    for (rb_every_run *j = d->every_jobs; j; j = j->next) {
        j->at = rb_monotonic();
        wait_for_at(j);
    }
}

/* The stop has begun: no job waits for its next time any more (runs go on to their end). */
void disp_every_stop(rb_dispatcher *d)
{
    for (rb_every_run *j = d->every_jobs; j; j = j->next) rb_timer_stop(d->loop, &j->timer);
}

/* The dispatcher is freed: a job not waiting for anything goes now, the others when their
 * answer or finish comes. */
void disp_every_free(rb_dispatcher *d)
{
    while (d->every_jobs) {
        rb_every_run *j = d->every_jobs;
        RB_LIST_REMOVE(&d->every_jobs, j);
        rb_timer_stop(d->loop, &j->timer);
        j->d = NULL;
        gone(j);
    }
}
