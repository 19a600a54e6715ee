/* heap.c -- see heap.h. */
#include "util/check.h"
#include "util/heap.h"

/* Swaps parent and its child c in the tree (their links, not their places in memory). */
static void swap_with_child(rb_heap *h, rb_heap_node *parent, rb_heap_node *c)
{
    rb_heap_node t = *parent, *sibling;
    *parent = *c;
    *c = t;
    parent->parent = c;
    if (c->left == c) {
        c->left = parent;
        sibling = c->right;
    } else {
        c->right = parent;
        sibling = c->left;
    }
    if (sibling) sibling->parent = c;
    if (parent->left) parent->left->parent = parent;
    if (parent->right) parent->right->parent = parent;
    if (!c->parent) h->min = c;
    else if (c->parent->left == parent) c->parent->left = c;
    else c->parent->right = c;
}

/* The link that holds (or will hold) the member at 1-based place `place` of the complete
 * tree: the bits of place below its top bit spell the way down, 0 left, 1 right. */
static rb_heap_node **link_at(rb_heap *h, size_t place, rb_heap_node **parent)
{
    size_t path = 0;
    unsigned k = 0;
    for (size_t n = place; n >= 2; n /= 2, k++) path = path << 1 | (n & 1);
    rb_heap_node **at = &h->min;
    *parent = NULL;
    for (; k > 0; k--, path >>= 1) {
        *parent = *at;
        at = path & 1 ? &(*at)->right : &(*at)->left;
    }
    return at;
}

void rb_heap_insert(rb_heap *h, rb_heap_node *x)
{
    rb_heap_node *parent;
    rb_heap_node **at = link_at(h, h->n + 1, &parent);
    RB_ASSERT(*at == NULL);
    x->left = x->right = NULL;
    x->parent = parent;
    *at = x;
    h->n++;
    while (x->parent && h->less(x, x->parent)) swap_with_child(h, x->parent, x);
}

void rb_heap_remove(rb_heap *h, rb_heap_node *x)
{
    RB_ASSERT(h->n > 0);
    rb_heap_node *parent;
    rb_heap_node **at = link_at(h, h->n, &parent);
    rb_heap_node *last = *at;
    *at = NULL;
    h->n--;
    if (last == x) {
        if (h->min == x) h->min = NULL;
        return;
    }
    /* the last member takes x's place, then moves down or up to where it belongs */
    last->left = x->left;
    last->right = x->right;
    last->parent = x->parent;
    if (last->left) last->left->parent = last;
    if (last->right) last->right->parent = last;
    if (!x->parent) h->min = last;
    else if (x->parent->left == x) x->parent->left = last;
    else x->parent->right = last;
    for (;;) {
        rb_heap_node *least = last;
        if (last->left && h->less(last->left, least)) least = last->left;
        if (last->right && h->less(last->right, least)) least = last->right;
        if (least == last) break;
        swap_with_child(h, last, least);
    }
    while (last->parent && h->less(last, last->parent)) swap_with_child(h, last->parent, last);
}
