/* hmap.h -- the one hash table of relaybus: intrusive and chained. A member embeds an
 * rb_hnode (so adding one costs no allocation) and is found again from it with
 * RB_HMAP_ENTRY; the table keeps each member's hash, so a lookup compares keys only where
 * the hashes match. It doubles when it holds as many members as buckets; a table that cannot
 * grow (out of memory) goes on with longer chains. Used for the registry of unsettled runs,
 * the metrics' topics, and the MongoDB store's busy documents and version cache. Not
 * thread-safe: its owner locks. */
#ifndef RB_HMAP_H
#define RB_HMAP_H

#include <stddef.h>
#include <stdint.h>

typedef struct rb_hnode {
    struct rb_hnode *next;
    uint64_t hash;
} rb_hnode;

typedef struct rb_hmap {
    rb_hnode **buckets;         /* nbuckets (a power of 2), or NULL before the first add */
    size_t nbuckets, count;
} rb_hmap;

/* The member of type `type` whose rb_hnode field `member` is at node. */
#define RB_HMAP_ENTRY(node, type, member) ((type *)(void *)((char *)(node) - offsetof(type, member)))

/* The hashes of the keys relaybus uses: text (FNV-1a), and 64-bit numbers (splitmix64's). */
uint64_t rb_hash_text(const char *s);
uint64_t rb_hash_u64(uint64_t x);

/* Makes the table with n buckets (rounded up to a power of 2) now, so that adding never
 * fails; -1 when out of memory. Optional: the first add makes it otherwise. */
int rb_hmap_reserve(rb_hmap *m, size_t n);
/* Frees the table (not its members) and empties m. */
void rb_hmap_free(rb_hmap *m);
/* Adds n, which is in no table, under hash. -1 only when m has no table and none can be made
 * (then n is not added). */
int rb_hmap_add(rb_hmap *m, rb_hnode *n, uint64_t hash);
/* The members under hash, one after the other (members of other hashes are skipped; several
 * of one hash are all found): for (n = rb_hmap_first(m, h); n; n = rb_hmap_next(n)). */
rb_hnode *rb_hmap_first(const rb_hmap *m, uint64_t hash);
rb_hnode *rb_hmap_next(const rb_hnode *n);
/* Takes n out of m; 0 when it was not in it. */
int rb_hmap_remove(rb_hmap *m, rb_hnode *n);

#endif
