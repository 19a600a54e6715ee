/* alloc_faults.h -- the C core's allocation calls (util/alloc.h) with a failure to inject,
 * for tests: alloc_faults.c defines rb_malloc and the others in place of util/alloc.c (see
 * there how it takes their place), and this hook. */
#ifndef RB_ALLOC_FAULTS_H
#define RB_ALLOC_FAULTS_H

#include "util/alloc.h"

/* The nth allocation from now fails (n >= 1), once; 0 turns it off. Returns how many
 * allocations have failed through it so far. Thread-safe. */
long rb_alloc_fail_nth(long n);

#endif
