/* alloc.h -- the allocation calls of the C core: malloc and friends with one test hook.
 *
 * Every allocation of runtime/ and bindings/ goes through these, so the allocation-failure
 * spec can make exactly the Nth one return NULL (rb_alloc_fail_nth) and walk N over a range:
 * each NULL path of the core is then taken at least once. Memory is released with free(). */
#ifndef RB_ALLOC_H
#define RB_ALLOC_H

#include <stddef.h>

void *rb_malloc(size_t size);
void *rb_calloc(size_t n, size_t size);
void *rb_realloc(void *p, size_t size);
char *rb_strdup(const char *s);
char *rb_strndup(const char *s, size_t n);

/* Test hook: the nth allocation from now fails (n >= 1), once; 0 turns it off. Returns how
 * many allocations have failed through the hook so far. Thread-safe. */
long rb_alloc_fail_nth(long n);

#endif
