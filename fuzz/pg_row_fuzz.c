/* pg_row_fuzz.c -- libFuzzer target for the PostgreSQL store's row decoder: whatever a row
 * holds (a row written by hand, a column of another type, 'infinity'), decoding it gives a
 * record with finite times and in-range numbers, or NULL; never a crash.
 * Input: rows separated by 0x1e, fields by 0x1f; a field of exactly "\x00" is SQL NULL. */
#include <libpq-fe.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "stores/pg/store_pg.h"

#define CHECK(c) do { if (!(c)) __builtin_trap(); } while (0)
#define NCOLS 13        /* the claim's columns (COLS) */
#define NCOLS_FULL 16   /* get and list's (RECORD_COLS: the history too) */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    PGresult *r = PQmakeEmptyPGresult(NULL, PGRES_TUPLES_OK);
    if (!r) return 0;
    PGresAttDesc att[NCOLS_FULL];
    memset(att, 0, sizeof att);
    static char names[NCOLS_FULL][4];
    for (int c = 0; c < NCOLS_FULL; c++) {
        names[c][0] = (char)('a' + c);
        att[c].name = names[c];
        att[c].typid = 25;     /* text */
        att[c].typlen = -1;
        att[c].atttypmod = -1;
    }
    /* fewer columns than the decoder wants now and then, or the history's */
    int ncols = size && data[0] == 'F' ? 5 : size && data[0] == 'H' ? NCOLS_FULL : NCOLS;
    PQsetResultAttrs(r, ncols, att);
    int row = 0, col = 0;
    size_t start = 0;
    for (size_t i = 0; i <= size && row < 50; i++) {
        if (i < size && data[i] != 0x1e && data[i] != 0x1f) continue;
        if (col < ncols) {
            size_t len = i - start;
            const char *v = (const char *)data + start;
            if (len == 1 && v[0] == 0) PQsetvalue(r, row, col, NULL, -1);
            else PQsetvalue(r, row, col, (char *)v, (int)len);
        }
        if (i == size || data[i] == 0x1e) { row++; col = 0; }
        else col++;
        start = i + 1;
    }
    for (int i = -1; i <= PQntuples(r); i++) {
        rb_delivery *d = rb_pg_row_delivery(r, i);
        if (i < 0 || i >= PQntuples(r) || ncols < NCOLS) CHECK(!d);
        if (!d) continue;
        CHECK(isfinite(d->run_at) && isfinite(d->created_at) && isfinite(d->lease_expires_at) &&
              isfinite(d->settled_at));
        CHECK(d->status >= RB_PENDING && d->status < RB_STATUS_COUNT);
        CHECK(ncols == NCOLS_FULL || (!d->progress && !d->errors && d->settled_at == 0));
        rb_delivery_free(d);
    }
    PQclear(r);
    return 0;
}
