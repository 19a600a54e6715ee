/* leases.c -- named-lease handles over a keeper of leases: any store's lease operation, or
 * the in-process table behind relaybus.local_leases() (rb_local_leases, not a store). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "stores/leases.h"
#include "dispatch/dispatcher.h"
#include "util/alloc.h"
#include "util/timer.h"
#include "util/check.h"

/* The lease operation of a keeper (a store's vt->lease, or the local table's). */
typedef void (*keeper_fn)(void *keeper, rb_lease_op op, const char *name, const char *token,
                          double duration, rb_lease_cb cb, void *ud);

struct rb_lease {
    keeper_fn keep;
    void *keeper;
    struct ev_loop *loop;   /* kept apart: the handle may outlive a closed store */
    char *name;
    char token[33];
    double duration;
    double deadline;
    int released;
    int freed;          /* the owner let go; freed when no operation refers to it */
    int refs;
    rb_timer timer;
    void (*on_expire)(rb_lease *l, void *ud);
    void *on_expire_ud;
};

static void unref(rb_lease *l)
{
    RB_ASSERT(l->refs > 0);
    if (--l->refs == 0) {
        rb_timer_stop(l->loop, &l->timer);
        free(l->name);
        free(l);
    }
}

static void on_timer(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    rb_lease *l = w->data;
    double left = l->deadline - rb_monotonic();
    if (left > 0) {     /* the loop's clock ran ahead of ours: wait the rest */
        rb_timer_set(&l->timer, left, 0);
        rb_timer_start(l->loop, &l->timer);
        return;
    }
    if (l->on_expire && !l->freed) l->on_expire(l, l->on_expire_ud);
}

static void arm(rb_lease *l)
{
    rb_timer_stop(l->loop, &l->timer);
    ev_now_update(l->loop);
    double left = l->deadline - rb_monotonic();
    rb_timer_set(&l->timer, left > 0 ? left : 0, 0);
    rb_timer_start(l->loop, &l->timer);
}

typedef struct op {
    rb_lease *l;
    double sent_at, duration;
    rb_lease_acquire_cb acb;
    rb_lease_done_cb dcb;
    void *ud;
} op;

static void on_acquired(void *ud, const char *err, int acquired, double expires_at)
{
    (void)expires_at;
    op *o = ud;
    rb_lease *l = o->l;
    if (err || !acquired) {
        l->refs = 1;
        unref(l);
        o->acb(o->ud, err, NULL);
    } else {
        l->deadline = o->sent_at + o->duration - rb_lease_margin(o->duration);
        arm(l);
        o->acb(o->ud, NULL, l);
    }
    free(o);
}

static void try_acquire(keeper_fn keep, void *keeper, struct ev_loop *loop, const char *name,
                        double duration, rb_lease_acquire_cb cb, void *ud)
{
    rb_lease *l = rb_calloc(1, sizeof *l);
    op *o = rb_calloc(1, sizeof *o);
    if (!l || !o || !(l->name = rb_strdup(name))) {
        free(l); free(o);
        cb(ud, "out of memory", NULL);
        return;
    }
    l->keep = keep;
    l->keeper = keeper;
    l->loop = loop;
    l->duration = duration;
    l->refs = 1;
    rb_random_token(l->token);
    rb_timer_init(&l->timer, on_timer, 0, 0);
    l->timer.w.data = l;
    o->l = l;
    o->sent_at = rb_monotonic();
    o->duration = duration;
    o->acb = cb;
    o->ud = ud;
    keep(keeper, RB_LEASE_ACQUIRE, l->name, l->token, duration, on_acquired, o);
}

static void store_keeps(void *keeper, rb_lease_op op, const char *name, const char *token,
                        double duration, rb_lease_cb cb, void *ud)
{
    rb_store *s = keeper;
    s->vt->lease(s, op, name, token, duration, cb, ud);
}

void rb_lease_try_acquire(rb_store *s, const char *name, double duration,
                          rb_lease_acquire_cb cb, void *ud)
{
    if (!s->vt->lease) {
        cb(ud, "named leases are not supported by this store", NULL);
        return;
    }
    try_acquire(store_keeps, s, s->loop, name, duration, cb, ud);
}

const char *rb_lease_name(const rb_lease *l) { return l->name; }
const char *rb_lease_token(const rb_lease *l) { return l->token; }
double rb_lease_deadline(const rb_lease *l) { return l->deadline; }
int rb_lease_over(const rb_lease *l) { return l->released || rb_monotonic() >= l->deadline; }

void rb_lease_on_expire(rb_lease *l, void (*fn)(rb_lease *l, void *ud), void *ud)
{
    l->on_expire = fn;
    l->on_expire_ud = ud;
}

static void on_done(void *ud, const char *err, int ok, double expires_at)
{
    (void)expires_at;
    op *o = ud;
    rb_lease *l = o->l;
    if (!l->freed) {
        if (!err && ok) {
            if (o->dcb && o->duration > 0) {        /* extend: never shortens */
                double d = o->sent_at + o->duration - rb_lease_margin(o->duration);
                if (d > l->deadline) l->deadline = d;
                arm(l);
            } else {                                /* release */
                l->released = 1;
                rb_timer_stop(l->loop, &l->timer);
            }
        }
        o->dcb(o->ud, err ? err : (ok ? NULL : "lease lost"), !err && ok);
    }
    free(o);
    unref(l);
}

static void start_op(rb_lease *l, double duration, rb_lease_done_cb cb, void *ud)
{
    if (l->released || rb_monotonic() >= l->deadline) {
        /* Past our deadline the claim is no longer ours, whatever the store would say. */
        cb(ud, l->released ? "lease released" : "lease lost", 0);
        return;
    }
    op *o = rb_calloc(1, sizeof *o);
    if (!o) {
        cb(ud, "out of memory", 0);
        return;
    }
    o->l = l;
    o->sent_at = rb_monotonic();
    o->duration = duration;
    o->dcb = cb;
    o->ud = ud;
    l->refs++;
    l->keep(l->keeper, duration > 0 ? RB_LEASE_EXTEND : RB_LEASE_RELEASE, l->name, l->token,
            duration, on_done, o);
}

void rb_lease_extend(rb_lease *l, double duration, rb_lease_done_cb cb, void *ud)
{
    start_op(l, duration > 0 ? duration : l->duration, cb, ud);
}

void rb_lease_release(rb_lease *l, rb_lease_done_cb cb, void *ud) { start_op(l, 0, cb, ud); }

void rb_lease_free(rb_lease *l)
{
    if (!l) return;
    l->freed = 1;
    rb_timer_stop(l->loop, &l->timer);
    unref(l);
}

/* ---- this process's own leases ------------------------------------------------------------ */
typedef struct local_entry {
    char *name;
    char token[33];
    double expires;     /* monotonic */
    struct local_entry *next;
} local_entry;

struct rb_local_leases {
    struct ev_loop *loop;
    local_entry *entries;
};

static local_entry *local_find(rb_local_leases *ls, const char *name)
{
    for (local_entry *e = ls->entries; e; e = e->next)
        if (strcmp(e->name, name) == 0) return e;
    return NULL;
}

static void local_acquire(rb_local_leases *ls, const char *name, const char *token,
                          double duration, rb_lease_cb cb, void *ud)
{
    double now = rb_monotonic();
    local_entry *e = local_find(ls, name);
    if (e && e->expires > now && strcmp(e->token, token) != 0) {
        cb(ud, NULL, 0, 0);
        return;
    }
    if (!e) {
        e = rb_calloc(1, sizeof *e);
        if (!e || !(e->name = rb_strdup(name))) {
            free(e);
            cb(ud, "out of memory", 0, 0);
            return;
        }
        e->next = ls->entries;
        ls->entries = e;
    }
    snprintf(e->token, sizeof e->token, "%s", token);
    e->expires = now + duration;
    cb(ud, NULL, 1, rb_wall_time() + duration);
}

static void local_extend(rb_local_leases *ls, const char *name, const char *token,
                         double duration, rb_lease_cb cb, void *ud)
{
    local_entry *e = local_find(ls, name);
    double now = rb_monotonic();
    if (!e || strcmp(e->token, token) != 0 || e->expires <= now) {
        cb(ud, NULL, 0, 0);
        return;
    }
    if (now + duration > e->expires) e->expires = now + duration;     /* never shortens */
    cb(ud, NULL, 1, rb_wall_time() + (e->expires - now));
}

static void local_release(rb_local_leases *ls, const char *name, const char *token,
                          rb_lease_cb cb, void *ud)
{
    for (local_entry **pp = &ls->entries; *pp; pp = &(*pp)->next) {
        local_entry *e = *pp;
        if (strcmp(e->name, name) == 0) {
            if (strcmp(e->token, token) != 0) break;
            *pp = e->next;
            free(e->name);
            free(e);
            cb(ud, NULL, 1, 0);
            return;
        }
    }
    cb(ud, NULL, 0, 0);
}

static void local_keeps(void *keeper, rb_lease_op op, const char *name, const char *token,
                        double duration, rb_lease_cb cb, void *ud)
{
    switch (op) {
    case RB_LEASE_ACQUIRE: local_acquire(keeper, name, token, duration, cb, ud); break;
    case RB_LEASE_EXTEND: local_extend(keeper, name, token, duration, cb, ud); break;
    default: local_release(keeper, name, token, cb, ud); break;
    }
}

rb_local_leases *rb_local_leases_new(struct ev_loop *loop)
{
    rb_local_leases *ls = rb_calloc(1, sizeof *ls);
    if (ls) ls->loop = loop;
    return ls;
}

void rb_local_leases_free(rb_local_leases *ls)
{
    if (!ls) return;
    for (local_entry *e = ls->entries, *next; e; e = next) {
        next = e->next;
        free(e->name);
        free(e);
    }
    free(ls);
}

void rb_local_lease_try_acquire(rb_local_leases *ls, const char *name, double duration,
                                rb_lease_acquire_cb cb, void *ud)
{
    try_acquire(local_keeps, ls, ls->loop, name, duration, cb, ud);
}
