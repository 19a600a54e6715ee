/* hmap.c -- the intrusive chained hash table (hmap.h). */
#include <stdlib.h>
#include "util/alloc.h"
#include "util/check.h"
#include "util/hmap.h"

uint64_t rb_hash_text(const char *s)
{
    uint64_t h = 14695981039346656037ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

uint64_t rb_hash_u64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static size_t slot(const rb_hmap *m, uint64_t hash)
{
    return (size_t)hash & (m->nbuckets - 1);
}

/* Moves every member into a table of n buckets; 0 (m unchanged) when out of memory. */
static int rehash(rb_hmap *m, size_t n)
{
    rb_hnode **b = rb_calloc(n, sizeof *b);
    if (!b) return 0;
    for (size_t i = 0; i < m->nbuckets; i++) {
        for (rb_hnode *e = m->buckets[i], *next; e; e = next) {
            next = e->next;
            size_t k = (size_t)e->hash & (n - 1);
            e->next = b[k];
            b[k] = e;
        }
    }
    free(m->buckets);
    m->buckets = b;
    m->nbuckets = n;
    return 1;
}

int rb_hmap_reserve(rb_hmap *m, size_t n)
{
    size_t p = 16;
    while (p < n) p *= 2;
    if (p <= m->nbuckets) return 0;
    return rehash(m, p) ? 0 : -1;
}

void rb_hmap_free(rb_hmap *m)
{
    free(m->buckets);
    m->buckets = NULL;
    m->nbuckets = m->count = 0;
}

int rb_hmap_add(rb_hmap *m, rb_hnode *n, uint64_t hash)
{
    if (m->count >= m->nbuckets) rehash(m, m->nbuckets ? m->nbuckets * 2 : 16);
    if (!m->nbuckets) return -1;
    n->hash = hash;
    size_t k = slot(m, hash);
    n->next = m->buckets[k];
    m->buckets[k] = n;
    m->count++;
    return 0;
}

/* The first member of the chain from n on whose hash is hash. */
static rb_hnode *match(rb_hnode *n, uint64_t hash)
{
    while (n && n->hash != hash) n = n->next;
    return n;
}

rb_hnode *rb_hmap_first(const rb_hmap *m, uint64_t hash)
{
    return m->nbuckets ? match(m->buckets[slot(m, hash)], hash) : NULL;
}

rb_hnode *rb_hmap_next(const rb_hnode *n)
{
    return match(n->next, n->hash);
}

int rb_hmap_remove(rb_hmap *m, rb_hnode *n)
{
    if (!m->nbuckets) return 0;
    for (rb_hnode **pp = &m->buckets[slot(m, n->hash)]; *pp; pp = &(*pp)->next) {
        if (*pp == n) {
            *pp = n->next;
            n->next = NULL;
            RB_ASSERT(m->count > 0);
            m->count--;
            return 1;
        }
    }
    return 0;
}
