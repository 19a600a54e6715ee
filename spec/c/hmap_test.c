/* hmap_test.c -- the hash table (runtime/util/hmap.c): through any adds and removes, of keys
 * that share a hash and keys that share a bucket, every member is found and nothing else;
 * growing that runs out of memory keeps every member. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>
#include "alloc_faults.h"
#include "util/hmap.h"

#define N 3000

typedef struct item {
    rb_hnode node;
    char key[16];
    int in;
} item;

static uint64_t hash_of(const item *it, int collide)
{
    /* collide: a tenth of the keys share one hash, as different texts may */
    return collide && atoi(it->key) % 10 == 0 ? 42 : rb_hash_text(it->key);
}

/* How many members hold key (a scan of every bucket), and how many the lookup finds. */
static void count(const rb_hmap *m, const char *key, uint64_t h, int *scanned, int *found)
{
    *scanned = *found = 0;
    for (size_t b = 0; b < m->nbuckets; b++)
        for (rb_hnode *n = m->buckets[b]; n; n = n->next)
            *scanned += !strcmp(RB_HMAP_ENTRY(n, item, node)->key, key);
    for (rb_hnode *n = rb_hmap_first(m, h); n; n = rb_hmap_next(n))
        *found += !strcmp(RB_HMAP_ENTRY(n, item, node)->key, key);
}

static void members_are_found_through_any_adds_and_removes(void **state)
{
    (void)state;
    for (int collide = 0; collide < 2; collide++) {
        static item it[N];
        memset(it, 0, sizeof it);
        for (int i = 0; i < N; i++) snprintf(it[i].key, sizeof it[i].key, "%d", i);
        rb_hmap m = {0};
        assert_null(rb_hmap_first(&m, 1));
        assert_int_equal(rb_hmap_remove(&m, &it[0].node), 0);
        unsigned seed = 99;
        size_t members = 0;
        for (int round = 0; round < 40000; round++) {
            item *x = &it[rand_r(&seed) % N];
            if (x->in) {
                assert_int_equal(rb_hmap_remove(&m, &x->node), 1);
                x->in = 0;
                members--;
                assert_int_equal(rb_hmap_remove(&m, &x->node), 0);     /* not twice */
            } else {
                assert_int_equal(rb_hmap_add(&m, &x->node, hash_of(x, collide)), 0);
                x->in = 1;
                members++;
            }
            assert_int_equal(m.count, members);
            if (round % 97 == 0) {
                for (int i = 0; i < N; i += 7) {
                    int scanned, found;
                    count(&m, it[i].key, hash_of(&it[i], collide), &scanned, &found);
                    assert_int_equal(scanned, it[i].in);
                    assert_int_equal(found, it[i].in);
                }
            }
        }
        assert_true(m.nbuckets >= m.count);
        rb_hmap_free(&m);
        assert_int_equal(m.count, 0);
    }
}

static void growth_out_of_memory_keeps_every_member(void **state)
{
    (void)state;
    static item it[200];
    memset(it, 0, sizeof it);
    rb_hmap m = {0};
    rb_alloc_fail_nth(1);       /* the first table cannot be made: nothing is added */
    snprintf(it[0].key, sizeof it[0].key, "first");
    assert_int_equal(rb_hmap_add(&m, &it[0].node, rb_hash_text(it[0].key)), -1);
    assert_int_equal(m.count, 0);
    for (int i = 0; i < 200; i++) {
        snprintf(it[i].key, sizeof it[i].key, "k%d", i);
        if (i == 16) rb_alloc_fail_nth(1);  /* the table of 16 cannot double: chains grow */
        assert_int_equal(rb_hmap_add(&m, &it[i].node, rb_hash_text(it[i].key)), 0);
    }
    rb_alloc_fail_nth(0);
    assert_int_equal(m.count, 200);
    for (int i = 0; i < 200; i++) {
        int scanned, found;
        count(&m, it[i].key, rb_hash_text(it[i].key), &scanned, &found);
        assert_int_equal(found, 1);
    }
    assert_int_equal(rb_hmap_reserve(&m, 5000), 0);
    assert_true(m.nbuckets >= 5000);
    for (int i = 0; i < 200; i++) assert_int_equal(rb_hmap_remove(&m, &it[i].node), 1);
    assert_int_equal(m.count, 0);
    rb_hmap_free(&m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        {"every member is found and nothing else, through any adds and removes, hashes shared or not",
         members_are_found_through_any_adds_and_removes, NULL, NULL, NULL},
        {"a table that cannot grow keeps every member, and one never made adds nothing",
         growth_out_of_memory_keeps_every_member, NULL, NULL, NULL},
    };
    return cmocka_run_group_tests_name("hmap", tests, NULL, NULL);
}
