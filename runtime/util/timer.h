/* timer.h -- the runtime's timers and idle watchers. They are libev's, with one addition: on a
 * loop the runtime owns (rb_loop_own, the pollable runtime of a host without libev) every
 * active timer is in a heap by its time and every active idle watcher on a list, so
 * rb_loop_timeout() can say when the loop next needs a step at once, however many there are;
 * libev itself has no call for that. On a host's loop they cost one pointer test more.
 *
 * A timer's callback has libev's signature and gets &t->w; the watcher's data is t->w.data. */
#ifndef RB_TIMER_H
#define RB_TIMER_H

#include <ev.h>
#include "util/heap.h"

typedef void (*rb_timer_cb)(struct ev_loop *loop, ev_timer *w, int revents);
typedef void (*rb_idle_cb)(struct ev_loop *loop, ev_idle *w, int revents);

typedef struct rb_timer {
    ev_timer w;                     /* first: libev's callback gets this */
    rb_timer_cb cb;
    rb_heap_node node;              /* in its owned loop's heap while active */
    double due;                     /* that heap's key: libev's time for it (timer.c) */
    struct rb_loop_list *list;
} rb_timer;

typedef struct rb_idle {
    ev_idle w;
    rb_idle_cb cb;
    struct rb_idle *prev, *next;
    struct rb_loop_list *list;
} rb_idle;

void rb_timer_init(rb_timer *t, rb_timer_cb cb, double after, double repeat);
void rb_timer_set(rb_timer *t, double after, double repeat);
void rb_timer_start(struct ev_loop *loop, rb_timer *t);
void rb_timer_stop(struct ev_loop *loop, rb_timer *t);
double rb_timer_remaining(struct ev_loop *loop, rb_timer *t);
int rb_timer_active(const rb_timer *t);

void rb_idle_init(rb_idle *i, rb_idle_cb cb);
void rb_idle_start(struct ev_loop *loop, rb_idle *i);
void rb_idle_stop(struct ev_loop *loop, rb_idle *i);

/* A loop the runtime owns: its timers and idles are kept on lists (see above). Call on the
 * thread that runs it; rb_loop_disown before destroying it. At most a few per thread. */
int rb_loop_own(struct ev_loop *loop);
void rb_loop_disown(struct ev_loop *loop);
/* Seconds until an owned loop needs a step (0: now, work is ready; negative: nothing is
 * scheduled and only its descriptors can wake it). */
double rb_loop_timeout(struct ev_loop *loop);

#endif
