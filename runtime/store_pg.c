/* store_pg.c -- placeholder until the postgresql store lands: opening one fails with a clear error. */
#include <stdio.h>
#include "store.h"

rb_store *rb_pg_open(struct ev_loop *loop, const char *where, const rb_store_options *opts,
                       char *err, size_t errlen)
{
    (void)loop; (void)where; (void)opts;
    snprintf(err, errlen, "the postgresql store is not available in this build");
    return NULL;
}
