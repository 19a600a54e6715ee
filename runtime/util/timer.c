/* timer.c -- libev timers and idle watchers, listed on loops the runtime owns (timer.h). */
#include <stddef.h>
#include "util/check.h"
#include "util/alloc.h"
#include "util/timer.h"
#include "util/list.h"

typedef struct rb_loop_list {
    struct ev_loop *loop;
    rb_heap timers;         /* active timers by due, the earliest first */
    rb_idle *idles;
} rb_loop_list;

static int due_before(const rb_heap_node *a, const rb_heap_node *b)
{
    const rb_timer *ta = (const rb_timer *)((const char *)a - offsetof(rb_timer, node));
    const rb_timer *tb = (const rb_timer *)((const char *)b - offsetof(rb_timer, node));
    return ta->due < tb->due;
}

static rb_timer *timer_of(rb_heap_node *n) { return (rb_timer *)((char *)n - offsetof(rb_timer, node)); }

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
            owned[i] = (rb_loop_list){loop, {NULL, 0, due_before}, NULL};
            return 0;
        }
    return -1;
}

/* Takes every timer of the subtree at n off its loop's heap, without reordering anything. */
static void unlist_all(rb_heap_node *n)
{
    if (!n) return;
    unlist_all(n->left);
    unlist_all(n->right);
    timer_of(n)->list = NULL;
}

void rb_loop_disown(struct ev_loop *loop)
{
    rb_loop_list *l = list_of(loop);
    if (!l) return;
    unlist_all(l->timers.min);
    for (rb_idle *i = l->idles; i; i = i->next) i->list = NULL;
    *l = (rb_loop_list){0};
}

/* ---- timers ---- */
static void timer_unlist(rb_timer *t)
{
    if (!t->list) return;
    rb_heap_remove(&t->list->timers, &t->node);
    t->list = NULL;
}

/* Keyed by libev's own key, read once while the timer is active: its time on libev's
 * monotonic clock (ev.h calls the field private; it is what libev's heap orders by). A key on
 * ev_now's clock (ev_now + remaining) would not do: ev_now follows the wall clock, so keys
 * taken minutes apart differ by what NTP slewed or stepped meanwhile, and the heap's root need
 * not be the timer that fires first. */
static void timer_list(rb_loop_list *l, rb_timer *t)
{
    RB_ASSERT(ev_is_active(&t->w));
    t->due = t->w.at;
    t->list = l;
    rb_heap_insert(&l->timers, &t->node);
}

/* libev calls this: a one-shot timer that fired is no longer active, so it leaves the heap
 * before its owner's callback (which may free it) runs; a repeating one takes its next time. */
static void timer_fired(struct ev_loop *loop, ev_timer *w, int revents)
{
    rb_timer *t = (rb_timer *)w;
    if (t->list) {
        rb_loop_list *l = t->list;
        timer_unlist(t);
        if (ev_is_active(w)) timer_list(l, t);
    }
    t->cb(loop, w, revents);
}

void rb_timer_init(rb_timer *t, rb_timer_cb cb, double after, double repeat)
{
    ev_timer_init(&t->w, timer_fired, after, repeat);
    t->cb = cb;
    t->node = (rb_heap_node){0};
    t->due = 0;
    t->list = NULL;
}

void rb_timer_set(rb_timer *t, double after, double repeat) { ev_timer_set(&t->w, after, repeat); }

void rb_timer_start(struct ev_loop *loop, rb_timer *t)
{
    ev_timer_start(loop, &t->w);
    if (t->list) return;
    rb_loop_list *l = list_of(loop);
    if (l) timer_list(l, t);
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
    if (!l->timers.min) return -1;
    double r = ev_timer_remaining(loop, &timer_of(l->timers.min)->w);
    return r < 0 ? 0 : r;
}
