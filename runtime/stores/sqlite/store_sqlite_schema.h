/* store_sqlite_schema.h -- the SQLite store's file, schema and statements
 * (store_sqlite_schema.c), for store_sqlite.c; not installed. */
#ifndef RB_STORE_SQLITE_SCHEMA_H
#define RB_STORE_SQLITE_SCHEMA_H
#include <stddef.h>
#include <sqlite3.h>

#pragma GCC visibility push(hidden)

/* Column order read by read_delivery (its COL_ names follow it). */
#define COLS "id, topic, payload, key, status, attempts, max_attempts, fence," \
             " coalesce(held_run_at, run_at), created_at, lease_token, lease_expires_at," \
             " last_error, group_name"
/* get and list read the history too (claims do not need it) */
#define RECORD_COLS COLS ", settled_at, progress, errors, waiting"

/* Prepared once per store, on first use. Settle statements share their parameter numbers:
 * ?1 now, ?2 id, ?3 token, ?4 delay, ?5 error, ?6 boot id, ?7 boot clock. Lease ones: ?1 name,
 * ?2 token, ?3 now, ?4 s, ?5 boot id, ?6 boot clock. The boot id is NULL when unknown: then
 * the wall clock times leases, as it does for rows leased before schema 2. */
enum {
    ST_ENQ_FIND, ST_ENQ_INSERT, ST_CLAIM_BURY, ST_CLAIM_TAKE,
    ST_COMPLETE, ST_RESCHEDULE, ST_BURY, ST_RELEASE, ST_EXTEND,
    ST_GET, ST_STATS, ST_KICK_ONE, ST_KICK_BURIED, ST_PURGE,
    ST_BURY_ONE, ST_DELETE_ONE, ST_TOPIC_STATS, ST_PENDING_TOPICS,
    ST_LEASE_ACQUIRE, ST_LEASE_EXTEND, ST_LEASE_RELEASE,
    ST_PAUSE, ST_RESUME, ST_PAUSED, ST_CANCEL_FIND, ST_CANCEL_ONE, ST_PURGE_CANCELLED,
    ST_PROGRESS, ST_ENQ_REPLACE,
    ST_LIMITS, ST_CLAIM_TOPICS, ST_LIMIT_SET, ST_LIMIT_CLEAR, ST_RUNNING, ST_STARTS, ST_START_ADD, ST_STARTS_TRIM,
    ST_SCHEDULE_FIND, ST_SCHEDULE_SET, ST_UNSCHEDULE, ST_SCHEDULES, ST_SCHEDULE_FIRE,
    ST_DEP_STATUS, ST_DEP_HOLD, ST_DEP_CANCEL, ST_DEP_ADD, ST_DEP_MARK,
    ST_CANCEL_ALL_RUNS, ST_CANCEL_ALL, ST_TOPIC_STATS_LARGE, ST_ID_SPAN,
    ST_COUNT
};

#define FENCED " WHERE id = ?2 AND status = 'processing' AND lease_token = ?3"
#define NO_LEASE " lease_token = NULL, lease_expires_at = NULL, lease_boot = NULL, lease_until = NULL"
/* Whether a lease is over, given the boot clock's identity B (rb_boot_id), the boot clock T and
 * the wall clock W: on the boot clock when its holder shared ours; on the wall clock when the
 * holder ran in another time namespace of this boot (its boot clock is offset from ours), or
 * either side does not know; over when the machine booted since. */
#define LEASE_OVER(B, T, W) "(CASE WHEN lease_boot IS NULL OR " B " IS NULL THEN " WALL_OVER(W) \
    " WHEN lease_boot = " B " THEN coalesce(lease_until, 0) <= " T \
    " WHEN substr(lease_boot, 1, 36) = substr(" B ", 1, 36) THEN " WALL_OVER(W) " ELSE 1 END)"
/* (a row made processing by hand without a lease has none to wait for) */
#define WALL_OVER(W) "coalesce(lease_expires_at, 0) <= " W
/* Whether a delivery's lease, if it has one, is over: a pending delivery keeps the lease of
 * a run an operator buried and kicked until it is over (the claim waits for it, ?3 ?4 ?1). */
#define NO_LIVE_LEASE(B, T, W) "(lease_expires_at IS NULL OR " LEASE_OVER(B, T, W) ")"
#define NAMED_OVER "(CASE WHEN boot IS NULL OR ?5 IS NULL THEN expires_at <= ?3" \
    " WHEN boot = ?5 THEN until <= ?6" \
    " WHEN substr(boot, 1, 36) = substr(?5, 1, 36) THEN expires_at <= ?3 ELSE 1 END)"

/* Above this many rows (the span of the ids) the completed are estimated, not counted (ID_SPAN
 * in store_sqlite_schema.c). */
#define ESTIMATE_ABOVE_ROWS 100000

/* The statements, by ST_ number: templates with "{t}" for the table (rb_sqlite_expand). */
extern const char *const rb_sqlite_stmt_sql[ST_COUNT];


/* tmpl with every "{t}" replaced by the table name (a validated identifier); NULL out of
 * memory. The caller frees it. */
char *rb_sqlite_expand(const char *tmpl, const char *table);

/* Opens the database file at path (":memory:" when memory) for the deliveries table `table`:
 * with want_migrate it is made if missing (mode 0600) and migrated; without, nothing is made
 * and a missing or foreign schema is an error ("no relaybus schema here"). WAL mode either
 * way. 0 with *db open, or -1 with err set and *db NULL. Blocks (store.h: open). */
int rb_sqlite_open_file(const char *path, const char *table, int want_migrate, int memory,
                        sqlite3 **db, char *err, size_t errlen);

#pragma GCC visibility pop
#endif
