/* timer.c -- libev timers and idle watchers, listed on loops the runtime owns (timer.h). */
#include <stddef.h>
#include "alloc.h"
#include "timer.h"
#include "list.h"

typedef struct rb_loop_list {
    struct ev_loop *loop;
    rb_timer *timers;
    rb_idle *idles;
} rb_loop_list;

/* The loops this thread owns: a pollable runtime has one; a host may make a few. */
#define OWNED_MAX 8
static _Thread_local rb_loop_list owned[OWNED_MAX];

static rb_loop_list *list_of(struct ev_loop *loop)
{
    for (int i = 0; i < OWNED_MAX; i++)
        if (owned[i].loop == loop) return &owned[i];
    return NULL;
}

int rb_loop_own(struct ev_loop *loop)
{
    for (int i = 0; i < OWNED_MAX; i++)
        if (!owned[i].loop) {
            owned[i] = (rb_loop_list){loop, NULL, NULL};
            return 0;
        }
    return -1;
}

void rb_loop_disown(struct ev_loop *loop)
{
    rb_loop_list *l = list_of(loop);
    if (!l) return;
    for (rb_timer *t = l->timers; t; t = t->next) t->list = NULL;
    for (rb_idle *i = l->idles; i; i = i->next) i->list = NULL;
    *l = (rb_loop_list){0};
}

/* ---- timers ---- */
static void timer_unlist(rb_timer *t)
{
    if (!t->list) return;
    RB_LIST_REMOVE(&t->list->timers, t);
    t->list = NULL;
}

/* libev calls this: a one-shot timer that fired is no longer active, so it leaves the list
 * before its owner's callback (which may free it) runs. */
static void timer_fired(struct ev_loop *loop, ev_timer *w, int revents)
{
    rb_timer *t = (rb_timer *)w;
    if (!ev_is_active(w)) timer_unlist(t);
    t->cb(loop, w, revents);
}

void rb_timer_init(rb_timer *t, rb_timer_cb cb, double after, double repeat)
{
    ev_timer_init(&t->w, timer_fired, after, repeat);
    t->cb = cb;
    t->prev = t->next = NULL;
    t->list = NULL;
}

void rb_timer_set(rb_timer *t, double after, double repeat) { ev_timer_set(&t->w, after, repeat); }

void rb_timer_start(struct ev_loop *loop, rb_timer *t)
{
    ev_timer_start(loop, &t->w);
    if (t->list) return;
    rb_loop_list *l = list_of(loop);
    if (!l) return;
    t->list = l;
    RB_LIST_PUSH(&l->timers, t);
}

void rb_timer_stop(struct ev_loop *loop, rb_timer *t)
{
    ev_timer_stop(loop, &t->w);
    timer_unlist(t);
}

double rb_timer_remaining(struct ev_loop *loop, rb_timer *t) { return ev_timer_remaining(loop, &t->w); }
int rb_timer_active(const rb_timer *t) { return ev_is_active(&t->w); }

/* ---- idle watchers ---- */
static void idle_unlist(rb_idle *i)
{
    if (!i->list) return;
    RB_LIST_REMOVE(&i->list->idles, i);
    i->list = NULL;
}

static void idle_fired(struct ev_loop *loop, ev_idle *w, int revents)
{
    rb_idle *i = (rb_idle *)w;
    i->cb(loop, w, revents);
}

void rb_idle_init(rb_idle *i, rb_idle_cb cb)
{
    ev_idle_init(&i->w, idle_fired);
    i->cb = cb;
    i->prev = i->next = NULL;
    i->list = NULL;
}

void rb_idle_start(struct ev_loop *loop, rb_idle *i)
{
    ev_idle_start(loop, &i->w);
    if (i->list) return;
    rb_loop_list *l = list_of(loop);
    if (!l) return;
    i->list = l;
    RB_LIST_PUSH(&l->idles, i);
}

void rb_idle_stop(struct ev_loop *loop, rb_idle *i)
{
    ev_idle_stop(loop, &i->w);
    idle_unlist(i);
}

double rb_loop_timeout(struct ev_loop *loop)
{
    if (ev_pending_count(loop)) return 0;
    rb_loop_list *l = list_of(loop);
    if (!l) return -1;
    if (l->idles) return 0;
    double best = -1;
    for (rb_timer *t = l->timers; t; t = t->next) {
        double r = ev_timer_remaining(loop, &t->w);
        if (r < 0) r = 0;
        if (best < 0 || r < best) best = r;
    }
    return best;
}
