/* check.c -- the failure of RB_ASSERT (check.h). */
#include <stdio.h>
#include <stdlib.h>
#include "util/check.h"

void rb_assert_failed(const char *expr, const char *file, int line, const char *func)
{
    fprintf(stderr, "relaybus: %s:%d: %s: invariant broken: %s\n", file, line, func, expr);
    fflush(stderr);
    abort();
}
