/* alloc_faults.c -- util/alloc.h's calls with an allocation failure to inject (alloc_faults.h).
 * It depends on nothing but libc, so relaybus_allocfail.so can be loaded before relaybus.so. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include "alloc_faults.h"

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
char *rb_strdup(const char *s) { return injected_failure() ? NULL : strdup(s); }
char *rb_strndup(const char *s, size_t n) { return injected_failure() ? NULL : strndup(s, n); }
