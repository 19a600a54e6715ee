/* alloc.c -- malloc and friends with the allocation-failure test hook (alloc.h). */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include "util/alloc.h"

/* Allocations left until the injected failure; <= 0 when no failure is armed. */
static atomic_long fail_countdown;
static atomic_long failures;

static int injected_failure(void)
{
    if (atomic_load_explicit(&fail_countdown, memory_order_relaxed) <= 0) return 0;
    if (atomic_fetch_sub(&fail_countdown, 1) != 1) return 0;
    atomic_fetch_add(&failures, 1);
    return 1;
}

long rb_alloc_fail_nth(long n)
{
    atomic_store(&fail_countdown, n > 0 ? n : 0);
    return atomic_load(&failures);
}

void *rb_malloc(size_t size) { return injected_failure() ? NULL : malloc(size); }
void *rb_calloc(size_t n, size_t size) { return injected_failure() ? NULL : calloc(n, size); }
void *rb_realloc(void *p, size_t size) { return injected_failure() ? NULL : realloc(p, size); }

char *rb_strdup(const char *s)
{
    if (injected_failure()) return NULL;
    return strdup(s);
}

char *rb_strndup(const char *s, size_t n)
{
    if (injected_failure()) return NULL;
    return strndup(s, n);
}
