/* leases.c -- named-lease handles over any store's lease operations, and the in-process
 * lease store behind relaybus.local_leases(). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "leases.h"
#include "dispatcher.h"

struct rb_lease {
    rb_store *s;
    struct ev_loop *loop;   /* kept apart: the handle may outlive a closed store */
    char *name;
    char token[33];
    double duration;
    double deadline;
    int released;
    int freed;          /* the owner let go; freed when no operation refers to it */
    int refs;
    ev_timer timer;
    void (*on_expire)(rb_lease *l, void *ud);
    void *on_expire_ud;
};

/* The local deadline ends ahead of the store's expiry by this much (clock rates, round trip). */
static double margin_for(double duration)
{
    double m = duration * 0.1;
    if (m < 0.05) m = 0.05;
    if (m > 5) m = 5;
    return m;
}

static void unref(rb_lease *l)
{
    if (--l->refs == 0) {
        ev_timer_stop(l->loop, &l->timer);
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
        ev_timer_set(w, left, 0);
        ev_timer_start(l->loop, w);
        return;
    }
    if (l->on_expire && !l->freed) l->on_expire(l, l->on_expire_ud);
}

static void arm(rb_lease *l)
{
    ev_timer_stop(l->loop, &l->timer);
    ev_now_update(l->loop);
    double left = l->deadline - rb_monotonic();
    ev_timer_set(&l->timer, left > 0 ? left : 0, 0);
    ev_timer_start(l->loop, &l->timer);
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
        l->deadline = o->sent_at + o->duration - margin_for(o->duration);
        arm(l);
        o->acb(o->ud, NULL, l);
    }
    free(o);
}

void rb_lease_try_acquire(rb_store *s, const char *name, double duration,
                          rb_lease_acquire_cb cb, void *ud)
{
    rb_lease *l = calloc(1, sizeof *l);
    op *o = calloc(1, sizeof *o);
    if (!l || !o || !(l->name = strdup(name))) {
        free(l); free(o);
        cb(ud, "out of memory", NULL);
        return;
    }
    if (!s->vt->lease_acquire) {
        free(l->name); free(l); free(o);
        cb(ud, "named leases are not supported by this store", NULL);
        return;
    }
    l->s = s;
    l->loop = s->loop;
    l->duration = duration;
    l->refs = 1;
    rb_random_token(l->token);
    ev_init(&l->timer, on_timer);
    l->timer.data = l;
    o->l = l;
    o->sent_at = rb_monotonic();
    o->duration = duration;
    o->acb = cb;
    o->ud = ud;
    s->vt->lease_acquire(s, l->name, l->token, duration, on_acquired, o);
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
            if (o->dcb && o->duration > 0) {        /* extend */
                l->deadline = o->sent_at + o->duration - margin_for(o->duration);
                arm(l);
            } else {                                /* release */
                l->released = 1;
                ev_timer_stop(l->loop, &l->timer);
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
    op *o = calloc(1, sizeof *o);
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
    if (duration > 0) l->s->vt->lease_extend(l->s, l->name, l->token, duration, on_done, o);
    else l->s->vt->lease_release(l->s, l->name, l->token, on_done, o);
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
    ev_timer_stop(l->loop, &l->timer);
    unref(l);
}

/* ---- the in-process lease store ---------------------------------------------------------- */
typedef struct local_entry {
    char *name;
    char token[33];
    double expires;     /* monotonic */
    struct local_entry *next;
} local_entry;

typedef struct local_store {
    rb_store base;
    local_entry *entries;
} local_store;

static local_entry *local_find(local_store *ls, const char *name)
{
    for (local_entry *e = ls->entries; e; e = e->next)
        if (strcmp(e->name, name) == 0) return e;
    return NULL;
}

static void local_acquire(rb_store *s, const char *name, const char *token, double duration,
                          rb_lease_cb cb, void *ud)
{
    local_store *ls = (local_store *)s;
    double now = rb_monotonic();
    local_entry *e = local_find(ls, name);
    if (e && e->expires > now && strcmp(e->token, token) != 0) {
        cb(ud, NULL, 0, 0);
        return;
    }
    if (!e) {
        e = calloc(1, sizeof *e);
        if (!e || !(e->name = strdup(name))) {
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

static void local_extend(rb_store *s, const char *name, const char *token, double duration,
                         rb_lease_cb cb, void *ud)
{
    local_entry *e = local_find((local_store *)s, name);
    double now = rb_monotonic();
    if (!e || strcmp(e->token, token) != 0 || e->expires <= now) {
        cb(ud, NULL, 0, 0);
        return;
    }
    e->expires = now + duration;
    cb(ud, NULL, 1, rb_wall_time() + duration);
}

static void local_release(rb_store *s, const char *name, const char *token, rb_lease_cb cb,
                          void *ud)
{
    local_store *ls = (local_store *)s;
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

static void local_close(rb_store *s)
{
    local_store *ls = (local_store *)s;
    for (local_entry *e = ls->entries, *next; e; e = next) {
        next = e->next;
        free(e->name);
        free(e);
    }
    free(ls->base.table);
    free(ls);
}

static const rb_store_vtable local_vtable = {
    .name = "local",
    .lease_acquire = local_acquire,
    .lease_extend = local_extend,
    .lease_release = local_release,
    .close = local_close,
};

rb_store *rb_local_leases_new(struct ev_loop *loop)
{
    local_store *ls = calloc(1, sizeof *ls);
    if (!ls) return NULL;
    ls->base.vt = &local_vtable;
    ls->base.loop = loop;
    ls->base.table = strdup("local_leases");
    return &ls->base;
}
