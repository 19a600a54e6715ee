/* alloc_pg_test.c -- the allocation-failure run of alloc_test.c on PostgreSQL
 * (RELAYBUS_TEST_PG), a program of its own so that it runs beside the SQLite one. */
#define ALLOC_PG 1
#include "alloc_test.c"
