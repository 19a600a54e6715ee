/* fifo.h -- the one queue idiom of the runtime: an intrusive singly linked FIFO of structs that
 * have a `next` pointer (or, with the _ON forms, another link field), kept as a head and a tail. Used wherever work waits its turn (SQLite's
 * jobs, PostgreSQL's operations, the job pool, the dispatcher's settle writes). Not thread-safe:
 * a queue shared between threads is guarded by its owner's mutex. */
#ifndef RB_FIFO_H
#define RB_FIFO_H

#include "util/check.h"

/* A queue of `type`: RB_FIFO(job) q; zeroed, it is empty. */
#define RB_FIFO(type) struct { type *head, *tail; }

#define RB_FIFO_EMPTY(q) ((q)->head == NULL)

/* Appends x (its link is cleared). */
#define RB_FIFO_PUSH(q, x) RB_FIFO_PUSH_ON(q, x, next)
#define RB_FIFO_PUSH_ON(q, x, link)                          \
    do {                                                     \
        RB_ASSERT(!(q)->tail || !(q)->tail->link);           \
        RB_ASSERT(!(q)->head == !(q)->tail);                 \
        (x)->link = NULL;                                    \
        if ((q)->tail) (q)->tail->link = (x);                \
        else (q)->head = (x);                                \
        (q)->tail = (x);                                     \
    } while (0)

/* Puts the list first..last (linked by next, last->next ignored) back at the front. */
#define RB_FIFO_PUSH_FRONT_LIST(q, first, last)              \
    do {                                                     \
        (last)->next = (q)->head;                            \
        if (!(q)->head) (q)->tail = (last);                  \
        (q)->head = (first);                                 \
    } while (0)

/* Takes the first element off into *out (NULL when empty); its link is cleared. */
#define RB_FIFO_POP(q, out) RB_FIFO_POP_ON(q, out, next)
#define RB_FIFO_POP_ON(q, out, link)                         \
    do {                                                     \
        RB_ASSERT(!(q)->head == !(q)->tail);                 \
        *(out) = (q)->head;                                  \
        if (*(out)) {                                        \
            if (!((q)->head = (*(out))->link)) (q)->tail = NULL; \
            (*(out))->link = NULL;                           \
        }                                                    \
    } while (0)

/* Takes the whole queue as a NULL-terminated list into *out; the queue is empty after. */
#define RB_FIFO_TAKE_ALL(q, out)                             \
    do {                                                     \
        *(out) = (q)->head;                                  \
        (q)->head = (q)->tail = NULL;                        \
    } while (0)

#endif
