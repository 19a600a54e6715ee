/* store_pg.h -- what the PostgreSQL store shows outside store_pg.c: its row decoder, for the
 * fuzz target (fuzz/pg_row_fuzz.c). Internal: not installed. */
#ifndef RB_STORE_PG_H
#define RB_STORE_PG_H

#include <libpq-fe.h>
#include "stores/delivery.h"

/* The delivery in row i of a result of the store's record columns (COLS in store_pg.c), or
 * NULL when the result has fewer columns, i is out of range, or memory ran out. Any text is
 * taken: numbers out of range are clamped, non-finite times become 0. */
rb_delivery *rb_pg_row_delivery(const PGresult *r, int i);

#endif
