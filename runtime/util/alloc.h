/* alloc.h -- the allocation calls of the C core: malloc and friends, one place for all.
 *
 * Every allocation of runtime/ and bindings/ goes through these, so the tests can replace
 * them (testing/alloc_faults.c: exactly the Nth one returns NULL, for N over a range, and
 * each NULL path of the core is taken at least once) without a hook in the product: the C
 * tests link the test library before librelaybus.a, and the specs load relaybus_allocfail.so
 * globally before relaybus.so, whose calls to these then bind to the test's. So they stay in
 * a file of their own (alloc.o defines nothing else), with default visibility, and the shared
 * objects are linked without -Bsymbolic. Memory is released with free(). */
#ifndef RB_ALLOC_H
#define RB_ALLOC_H

#include <stddef.h>

void *rb_malloc(size_t size);
void *rb_calloc(size_t n, size_t size);
void *rb_realloc(void *p, size_t size);
char *rb_strdup(const char *s);
char *rb_strndup(const char *s, size_t n);

#endif
