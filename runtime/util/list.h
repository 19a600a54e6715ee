/* list.h -- the one idiom for an unordered intrusive doubly linked list, the companion of
 * fifo.h: members join at the head and leave from anywhere in O(1). The list is a head pointer;
 * each member has prev and next links (or, with the _ON forms, links of other names). Used
 * wherever records must leave in any order (runs, timers, idle watchers, tasks, requests,
 * transactions, operations waiting for an answer). Not thread-safe. */
#ifndef RB_LIST_H
#define RB_LIST_H

#include "util/check.h"

/* Puts x at the head of the list *headp. */
#define RB_LIST_PUSH(headp, x) RB_LIST_PUSH_ON(headp, x, prev, next)
#define RB_LIST_PUSH_ON(headp, x, prev_, next_)             \
    do {                                                    \
        RB_ASSERT(!(x)->prev_ && !(x)->next_ && *(headp) != (x)); \
        (x)->prev_ = NULL;                                  \
        (x)->next_ = *(headp);                              \
        if (*(headp)) (*(headp))->prev_ = (x);              \
        *(headp) = (x);                                     \
    } while (0)

/* Takes x off the list *headp (nothing happens when x is on no list); its links are cleared.
 * A member is linked both ways; one that is on no list has no links. */
#define RB_LIST_REMOVE(headp, x) RB_LIST_REMOVE_ON(headp, x, prev, next)
#define RB_LIST_REMOVE_ON(headp, x, prev_, next_)           \
    do {                                                    \
        RB_ASSERT(!(x)->prev_ || (x)->prev_->next_ == (x)); \
        RB_ASSERT(!(x)->next_ || (x)->next_->prev_ == (x)); \
        RB_ASSERT((x)->prev_ || !(x)->next_ || *(headp) == (x)); \
        if ((x)->prev_) (x)->prev_->next_ = (x)->next_;     \
        else if (*(headp) == (x)) *(headp) = (x)->next_;    \
        if ((x)->next_) (x)->next_->prev_ = (x)->prev_;     \
        (x)->prev_ = (x)->next_ = NULL;                     \
    } while (0)

#endif
