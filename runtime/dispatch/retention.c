/* retention.c -- the dispatcher's retention (rb_dispatcher_options.retention): one process at
 * a time, holding the named lease "relaybus.retention", deletes completed deliveries older than
 * `retention` seconds, in batches of PURGE_BATCH so claims are never blocked for long.
 *
 * Every period (max(1, min(retention / 4, 60)) s; the first one period after the start, so a
 * process that starts into a backlog drains it first) each running dispatcher tries the lease
 * for a period. The holder purges until a batch comes back short, then, caught up, keeps the
 * lease for `rest` (max(period, min(retention / 4, 3600)) s): no process purges again before
 * it expires. A purge that finds little to delete still reads every settled row the store
 * keeps (no index serves it: one would cost every completion an index insert), so a table of
 * millions is read about once an hour, not every minute. */
#include <math.h>
#include <stdlib.h>
#include "dispatch/dispatcher_impl.h"
#include "stores/leases.h"
#include "util/alloc.h"
#include "util/check.h"

#define PURGE_BATCH 1000
#define LEASE_NAME "relaybus.retention"

struct disp_retention {
    rb_dispatcher *d;           /* NULL once its dispatcher stopped: the answer out frees it */
    rb_store *store;
    double retention, period, rest;
    rb_timer timer;             /* the next round, or the next batch of this one */
    rb_lease *lease;            /* held during a round */
    int in_flight;              /* an acquire, purge or extend is out */
    int purging;                /* the timer's next firing is the round's next batch */
};

/* The answer of an orphan (its dispatcher stopped meanwhile): frees it. 1 when it did. */
static int gone(disp_retention *r)
{
    if (r->d) return 0;
    if (r->lease) rb_lease_free(r->lease);
    free(r);
    return 1;
}

/* The round is over: the lease (kept in the store, for `rest` when caught up) is let go
 * here, and the next round comes a period later. */
static void round_end(disp_retention *r)
{
    if (r->lease) rb_lease_free(r->lease);
    r->lease = NULL;
    r->purging = 0;
    if (disp_winding_down(r->d)) return;
    rb_timer_set(&r->timer, r->period, 0);
    rb_timer_start(r->d->loop, &r->timer);
}

static void on_extended(void *ud, const char *err, int ok)
{
    (void)err; (void)ok;
    disp_retention *r = ud;
    r->in_flight = 0;
    if (!gone(r)) round_end(r);
}

static void on_purged(void *ud, const char *err, int64_t count)
{
    disp_retention *r = ud;
    r->in_flight = 0;
    if (gone(r)) return;
    if (err || rb_lease_over(r->lease) || disp_winding_down(r->d)) {
        round_end(r);
    } else if (count >= PURGE_BATCH) {
        /* more to delete: the next batch from the loop, so claims and settles go between
         * (and a store that answers at once does not recurse) */
        r->purging = 1;
        rb_timer_set(&r->timer, 0, 0);
        rb_timer_start(r->d->loop, &r->timer);
    } else {
        r->in_flight = 1;       /* caught up: keep the name for `rest` */
        rb_lease_extend(r->lease, r->rest, on_extended, r);
    }
}

static void purge(disp_retention *r)
{
    r->in_flight = 1;
    r->store->vt->purge(r->store, "completed", NULL, r->retention, PURGE_BATCH, on_purged, r);
}

static void on_acquired(void *ud, const char *err, rb_lease *lease)
{
    (void)err;      /* someone else holds it, or the store failed: next period */
    disp_retention *r = ud;
    r->in_flight = 0;
    r->lease = lease;
    if (gone(r)) return;
    if (!lease || disp_winding_down(r->d)) round_end(r);
    else purge(r);
}

static void on_timer(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    disp_retention *r = w->data;
    RB_ASSERT(r->d && !r->in_flight);
    if (disp_winding_down(r->d)) return;
    if (r->purging) {
        purge(r);
        return;
    }
    r->in_flight = 1;
    rb_lease_try_acquire(r->store, LEASE_NAME, r->period, on_acquired, r);
}

int disp_retention_start(rb_dispatcher *d)
{
    double keep = d->opt.retention;
    if (!(keep > 0) || !d->store->vt->purge || !d->store->vt->lease) return 0;
    disp_retention *r = rb_calloc(1, sizeof *r);
    if (!r) return -1;
    r->d = d;
    r->store = d->store;
    r->retention = keep;
    r->period = fmax(1, fmin(keep / 4, 60));
    r->rest = fmax(r->period, fmin(keep / 4, 3600));
    rb_timer_init(&r->timer, on_timer, r->period, 0);
    r->timer.w.data = r;
    rb_timer_start(d->loop, &r->timer);
    d->retention = r;
    return 0;
}

void disp_retention_stop(rb_dispatcher *d)
{
    disp_retention *r = d->retention;
    if (!r) return;
    d->retention = NULL;
    rb_timer_stop(d->loop, &r->timer);
    r->d = NULL;
    if (!r->in_flight) gone(r);     /* otherwise the answer out frees it */
}
