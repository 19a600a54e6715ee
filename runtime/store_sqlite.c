/* store_sqlite.c -- placeholder until the sqlite store lands: opening one fails with a clear error. */
#include <stdio.h>
#include "store.h"

rb_store *rb_sqlite_open(struct ev_loop *loop, const char *where, const rb_store_options *opts,
                       char *err, size_t errlen)
{
    (void)loop; (void)where; (void)opts;
    snprintf(err, errlen, "the sqlite store is not available in this build");
    return NULL;
}
