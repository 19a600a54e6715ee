/* ticks.c -- the dispatcher's part in durable schedules (store:schedule): every running
 * dispatcher on a store reads its schedules and fires each tick that is due.
 *
 * A round reads the schedules (a small table), and for each whose next_at has come asks the
 * store to fire it: next_at moves to the first tick after now, and the tick's delivery (run_at
 * the tick's time, its key "NAME@TIME") is enqueued, both only while next_at is still the one
 * read (store.h, schedule_fire). So each tick is enqueued once whichever dispatchers race for
 * it, and a schedule whose ticks were missed (every process down) fires one tick, the first it
 * missed, and goes on from now: never a flood. The next round comes when the earliest next_at
 * falls due, at once when a schedule changed (rb_store_schedules_changed: here, or on
 * PostgreSQL in any process), and at least every `period`. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "dispatch/dispatcher_impl.h"
#include "schedule/schedule.h"
#include "util/alloc.h"
#include "util/check.h"
#include "util/clock.h"
#include "util/log.h"

/* the rows of vt->schedules, by column */
enum { COL_NAME, COL_TOPIC, COL_PAYLOAD, COL_CRON, COL_EVERY, COL_TIMEZONE, COL_NEXT_AT,
       NCOLS_USED };
#define WARN_EVERY 60.0         /* s between warnings about one broken schedule */

struct disp_schedules {
    rb_dispatcher *d;           /* NULL once its dispatcher stopped: the last answer frees it */
    rb_store *store;
    double period;
    rb_timer timer;
    int reading;                /* the read of the schedules is out */
    size_t firing;              /* fires out */
    double soonest;             /* wall clock: the earliest next tick this round saw */
    int failed;                 /* the round met a store error: the next one a period later */
    int changed;                /* a schedule changed during the round: another one at once */
    double warned_at;           /* monotonic: the last warning about a broken schedule */
};

static int gone(disp_schedules *r)
{
    if (r->d || r->reading || r->firing) return 0;
    free(r);
    return 1;
}

static void round_end(disp_schedules *r)
{
    if (r->reading || r->firing || !r->d || disp_winding_down(r->d)) return;
    double wait = r->failed ? r->period : fmin(r->period, fmax(0.01, r->soonest - rb_wall_time()));
    if (r->changed && !r->failed) wait = 0;
    r->changed = 0;
    rb_timer_set(&r->timer, wait, 0);
    rb_timer_start(r->d->loop, &r->timer);
}

static double num(const rb_value *v)
{
    return v->type == RB_VFLOAT ? v->f : v->type == RB_VINT ? (double)v->i : NAN;
}

static const char *text(const rb_value *v) { return v->type == RB_VTEXT ? v->s : NULL; }

static void on_fired(void *ud, const char *err, int64_t count)
{
    disp_schedules *r = ud;
    RB_ASSERT(r->firing > 0);
    r->firing--;
    if (err) {
        static rb_log_limit lim;
        rb_log_limited(&lim, RB_LOG_WARN, "schedules: a tick could not be fired: %s", err);
        r->failed = 1;
    }
    (void)count;        /* 0: another process fired it first; both are fine */
    if (!gone(r)) round_end(r);
}

/* Fires row's tick when it is due; keeps r->soonest. */
static void consider(disp_schedules *r, const rb_value *row, double now)
{
    const char *name = text(&row[COL_NAME]), *topic = text(&row[COL_TOPIC]);
    const char *payload = text(&row[COL_PAYLOAD]);
    double due = num(&row[COL_NEXT_AT]), every = num(&row[COL_EVERY]);
    if (!name || !topic || !payload || !isfinite(due)) return;
    if (due > now) {
        r->soonest = fmin(r->soonest, due);
        return;
    }
    double next;
    char err[300];
    if (rb_schedule_next(text(&row[COL_CRON]), isfinite(every) ? every : 0,
                         text(&row[COL_TIMEZONE]), due, now, &next, err, sizeof err) != 0) {
        /* a schedule written by hand, or a zone the tz database lost: it cannot go on */
        if (rb_monotonic() - r->warned_at >= WARN_EVERY || r->warned_at == 0) {
            r->warned_at = rb_monotonic();
            rb_log(RB_LOG_WARN, "schedule '%s' cannot fire: %s", name, err);
        }
        return;
    }
    char key[RB_SCHEDULE_NAME_MAX + 48];
    rb_schedule_tick_key(key, sizeof key, name, due);
    rb_enqueue_item tick = {.topic = topic, .payload = payload, .key = key, .run_at = due,
                            .max_attempts = 25};
    r->soonest = fmin(r->soonest, next);
    r->firing++;
    r->store->vt->schedule_fire(r->store, name, due, next, &tick, on_fired, r);
}

static void on_rows(void *ud, const char *err, rb_rowset *rs)
{
    disp_schedules *r = ud;
    r->reading = 0;
    if (!err && rs && rs->ncols >= NCOLS_USED && r->d && !disp_winding_down(r->d)) {
        double now = rb_wall_time();
        r->firing++;    /* held while the fires go out: one that answers at once ends nothing */
        for (size_t i = 0; i < rs->nrows; i++) consider(r, &rs->vals[i * (size_t)rs->ncols], now);
        r->firing--;
    } else if (err) {
        r->failed = 1;      /* the claims say the store is down; no line of its own */
    }
    rb_rowset_free(rs);
    if (!gone(r)) round_end(r);
}

static void on_timer(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    disp_schedules *r = w->data;
    RB_ASSERT(r->d && !r->reading && !r->firing);
    if (disp_winding_down(r->d)) return;
    r->reading = 1;
    r->failed = 0;
    r->soonest = INFINITY;
    r->store->vt->schedules(r->store, on_rows, r);
}

void disp_schedules_changed(rb_dispatcher *d)
{
    disp_schedules *r = d->schedules;
    if (!r || disp_winding_down(d)) return;
    if (r->reading || r->firing) {
        r->changed = 1;         /* this round may have read it before the change */
        return;
    }
    rb_timer_stop(d->loop, &r->timer);
    rb_timer_set(&r->timer, 0, 0);
    rb_timer_start(d->loop, &r->timer);
}

int disp_schedules_start(rb_dispatcher *d)
{
    const rb_store_vtable *vt = d->store->vt;
    if (!vt->schedules || !vt->schedule_fire) return 0;
    disp_schedules *r = rb_calloc(1, sizeof *r);
    if (!r) return -1;
    r->d = d;
    r->store = d->store;
    /* A store that tells every process of a change (PostgreSQL's NOTIFY) is read again
     * then, and otherwise when the earliest tick falls due, or every listen_poll_interval: an
     * idle dispatcher there sends nothing in between. Elsewhere every poll_interval, within
     * 0.1 to 1 s: a schedule another process made is seen that soon. */
    r->period = fmin(fmax(d->opt.poll_interval, 0.1), 1.0);
    if (vt->set_wakeup) r->period = fmax(r->period, d->opt.listen_poll_interval);
    rb_timer_init(&r->timer, on_timer, 0, 0);      /* the first round at once */
    r->timer.w.data = r;
    rb_timer_start(d->loop, &r->timer);
    d->schedules = r;
    return 0;
}

void disp_schedules_stop(rb_dispatcher *d)
{
    disp_schedules *r = d->schedules;
    if (!r) return;
    d->schedules = NULL;
    rb_timer_stop(d->loop, &r->timer);
    r->d = NULL;
    gone(r);        /* or the last answer out frees it */
}
