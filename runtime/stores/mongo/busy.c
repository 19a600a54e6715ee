/* busy.c -- the MongoDB store: one write at a time per delivery (or named lease) from this
 * process. Every change takes the version ticket "<doc>:<v+1>" (tickets.c), so two writes of
 * ours on one document in flight at once, on two worker threads (a run's renewal beside its
 * ctx:extend_lease or its settle, a named lease's extend beside its release), would compete
 * for one ticket and the loser would be refused as if its lease were gone. So a job holds the
 * keys of the documents it writes from its read to its write; another job wanting one of them
 * waits until it is given back. A job takes all its keys at once or none (it never holds some
 * while waiting for others), so two jobs cannot wait for each other. A ticket lost now is lost
 * to another process: a real loss. */
#include <string.h>
#include "stores/mongo/mstore.h"

static int busy_held(const mstore *s, const char *key)
{
    for (rb_hnode *n = rb_hmap_first(&s->busy, rb_hash_text(key)); n; n = rb_hmap_next(n))
        if (strcmp(RB_HMAP_ENTRY(n, mg_busy, node)->key, key) == 0) return 1;
    return 0;
}

void mg_busy_take(mstore *s, mg_busy *held, size_t n)
{
    pthread_mutex_lock(&s->busy_mu);
    for (size_t i = 0; i < n;) {
        if (held[i].key && busy_held(s, held[i].key)) {
            pthread_cond_wait(&s->busy_cv, &s->busy_mu);
            i = 0;      /* look at all of them again: take all at once or none */
        } else {
            i++;
        }
    }
    /* (the table was made at open: adding cannot fail, it can only make chains longer) */
    for (size_t i = 0; i < n; i++)
        if (held[i].key) rb_hmap_add(&s->busy, &held[i].node, rb_hash_text(held[i].key));
    pthread_mutex_unlock(&s->busy_mu);
}

void mg_busy_give(mstore *s, mg_busy *held, size_t n)
{
    pthread_mutex_lock(&s->busy_mu);
    for (size_t i = 0; i < n; i++)
        if (held[i].key) rb_hmap_remove(&s->busy, &held[i].node);
    pthread_cond_broadcast(&s->busy_cv);
    pthread_mutex_unlock(&s->busy_mu);
}
