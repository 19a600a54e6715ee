/* heap.h -- an intrusive binary min-heap: members embed an rb_heap_node, and the heap neither
 * allocates nor fails. Insert and remove (of any member) are O(log n); the minimum is O(1).
 * The tree is kept complete by walking to its last place along the bits of the member count
 * (the shape of libuv's heap-inl.h). Used for the timers of owned loops (timer.c). Not
 * thread-safe. */
#ifndef RB_HEAP_H
#define RB_HEAP_H

#include <stddef.h>

typedef struct rb_heap_node {
    struct rb_heap_node *left, *right, *parent;
} rb_heap_node;

/* 1 when a orders before b. */
typedef int (*rb_heap_less)(const rb_heap_node *a, const rb_heap_node *b);

typedef struct rb_heap {
    rb_heap_node *min;      /* the root; NULL when empty */
    size_t n;
    rb_heap_less less;
} rb_heap;

void rb_heap_insert(rb_heap *h, rb_heap_node *x);
/* x must be a member. */
void rb_heap_remove(rb_heap *h, rb_heap_node *x);

#endif
