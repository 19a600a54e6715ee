/* store_sqlite_schema.c -- the SQLite store's file, schema and SQL: opening the file without
 * making what was only asked about, WAL mode, the migrations, the schema check, and the
 * text of the statements the store prepares. No job and no loop here: the opening runs once,
 * blocking, at open (store.h). */
#include <errno.h>
#include <limits.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>
#include "stores/delivery.h"
#include "stores/sqlite/store_sqlite_schema.h"
#include "util/alloc.h"
#include "util/text.h"

#define SCHEMA_VERSION  8
#define OPEN_TIMEOUT_MS 10000   /* open and migrate block (store.h) */

/* --- schema ----------------------------------------------------------------------------- */
/* Adds (SIGN 1) or takes (-1) the row ROW's status to or from its topic's counts. */
#define COUNT_ADD(ROW, SIGN) \
    " INSERT INTO \"{t}_counts\" (topic, buried, cancelled) VALUES (" ROW ".topic," \
    "  " SIGN " * (" ROW ".status = 'buried'), " SIGN " * (" ROW ".status = 'cancelled'))" \
    "  ON CONFLICT (topic) DO UPDATE SET buried = buried + excluded.buried," \
    "  cancelled = cancelled + excluded.cancelled;"
#define COUNTED(ROW) ROW ".status IN ('buried','cancelled')"
#define COUNT_TRIGGERS \
    "CREATE TABLE IF NOT EXISTS \"{t}_counts\" (topic TEXT PRIMARY KEY," \
    " buried INTEGER NOT NULL DEFAULT 0, cancelled INTEGER NOT NULL DEFAULT 0);" \
    "CREATE TRIGGER IF NOT EXISTS \"{t}_count_insert\" AFTER INSERT ON \"{t}\"" \
    " WHEN " COUNTED("NEW") " BEGIN" COUNT_ADD("NEW", "1") " END;" \
    "CREATE TRIGGER IF NOT EXISTS \"{t}_count_update\" AFTER UPDATE OF status, topic ON \"{t}\"" \
    " WHEN (OLD.status IS NOT NEW.status OR OLD.topic IS NOT NEW.topic)" \
    "  AND (" COUNTED("OLD") " OR " COUNTED("NEW") ") BEGIN" \
    COUNT_ADD("OLD", "-1") COUNT_ADD("NEW", "1") " END;" \
    "CREATE TRIGGER IF NOT EXISTS \"{t}_count_delete\" AFTER DELETE ON \"{t}\"" \
    " WHEN " COUNTED("OLD") " BEGIN" COUNT_ADD("OLD", "-1") " END;"

/* SQL templates say "{t}" for the deliveries table name (a validated identifier, always
 * quoted). The partial indexes keep claims and dedupe cheap however many settled rows pile up;
 * queries repeat an index's WHERE term verbatim so the planner can use it. */
static const char *const migrations[SCHEMA_VERSION] = {
    /* 1: deliveries, their indexes, named leases */
    "CREATE TABLE IF NOT EXISTS \"{t}\" ("
    " id INTEGER PRIMARY KEY AUTOINCREMENT,"
    " topic TEXT NOT NULL,"
    " payload TEXT NOT NULL,"
    " key TEXT,"
    " status TEXT NOT NULL DEFAULT 'pending'"
    "  CHECK (status IN ('pending','processing','completed','buried')),"
    " attempts INTEGER NOT NULL DEFAULT 0,"
    " max_attempts INTEGER NOT NULL DEFAULT 25,"
    " fence INTEGER NOT NULL DEFAULT 0,"
    " run_at REAL NOT NULL,"
    " created_at REAL NOT NULL,"
    " settled_at REAL,"
    " lease_token TEXT,"
    " lease_expires_at REAL,"
    " last_error TEXT);"
    "CREATE INDEX IF NOT EXISTS \"{t}_due\" ON \"{t}\" (run_at)"
    " WHERE status IN ('pending','processing');"
    "CREATE INDEX IF NOT EXISTS \"{t}_key\" ON \"{t}\" (topic, key)"
    " WHERE key IS NOT NULL AND status IN ('pending','processing');"
    "CREATE INDEX IF NOT EXISTS \"{t}_settled\" ON \"{t}\" (status, settled_at)"
    " WHERE status IN ('completed','buried');"
    "CREATE TABLE IF NOT EXISTS \"{t}_leases\" ("
    " name TEXT PRIMARY KEY, token TEXT NOT NULL, expires_at REAL NOT NULL);",
    /* 2: leases timed on the boot clock (CLOCK_BOOTTIME, with the boot's id): a SQLite file in
     * WAL mode lives on one host, so its processes share a clock that no step of the wall
     * clock moves. lease_expires_at / expires_at stay as the wall-clock view for readers. */
    "ALTER TABLE \"{t}\" ADD COLUMN lease_boot TEXT;"
    "ALTER TABLE \"{t}\" ADD COLUMN lease_until REAL;"
    "ALTER TABLE \"{t}_leases\" ADD COLUMN boot TEXT;"
    "ALTER TABLE \"{t}_leases\" ADD COLUMN until REAL;",
    /* 3: what operators set per topic, for every process on the file: a pause */
    "CREATE TABLE IF NOT EXISTS \"{t}_topics\" ("
    " topic TEXT PRIMARY KEY, paused_at REAL);",
    /* 4: the status cancelled (its CHECK: see current_check), purged through its own index;
     * a run's progress (JSON) and the last attempts' errors (a JSON array) */
    "CREATE INDEX IF NOT EXISTS \"{t}_cancelled\" ON \"{t}\" (settled_at)"
    " WHERE status = 'cancelled';"
    "ALTER TABLE \"{t}\" ADD COLUMN progress TEXT;"
    "ALTER TABLE \"{t}\" ADD COLUMN errors TEXT;",
    /* 5: ordered groups: a claim looks up a candidate's group's live deliveries by id, and
     * the group's running ones (at most one, but for a kicked one) */
    "ALTER TABLE \"{t}\" ADD COLUMN group_name TEXT;"
    "CREATE INDEX IF NOT EXISTS \"{t}_group\" ON \"{t}\" (group_name, id)"
    " WHERE group_name IS NOT NULL AND status IN ('pending','processing');"
    "CREATE INDEX IF NOT EXISTS \"{t}_group_running\" ON \"{t}\" (group_name)"
    " WHERE group_name IS NOT NULL AND status = 'processing';"
    /* ... and limits per topic: the running deliveries of a topic, the starts of a rate's
     * window */
    "ALTER TABLE \"{t}_topics\" ADD COLUMN rate_max INTEGER;"
    "ALTER TABLE \"{t}_topics\" ADD COLUMN rate_per REAL;"
    "ALTER TABLE \"{t}_topics\" ADD COLUMN running_max INTEGER;"
    "CREATE INDEX IF NOT EXISTS \"{t}_running\" ON \"{t}\" (topic) WHERE status = 'processing';"
    "CREATE TABLE IF NOT EXISTS \"{t}_starts\" (topic TEXT NOT NULL, at REAL NOT NULL);"
    "CREATE INDEX IF NOT EXISTS \"{t}_starts_at\" ON \"{t}_starts\" (topic, at);",
    /* 6: durable schedules (epoch s in next_at and fired_at) */
    "CREATE TABLE IF NOT EXISTS \"{t}_schedules\" ("
    " name TEXT PRIMARY KEY, topic TEXT NOT NULL, payload TEXT NOT NULL, cron TEXT, every REAL,"
    " timezone TEXT, next_at REAL NOT NULL, fired_at REAL, created_at REAL NOT NULL);",
    /* 7: dependencies. A delivery enqueued after others that are live is held: run_at far
     * past any time (HELD_RUN_AT), its own in held_run_at, `waiting` the count of them not
     * completed yet, one row of TABLE_deps per dependency while it is live, after_depth its
     * place in a chain (RB_AFTER_DEPTH_MAX at most). The triggers count a dependency's
     * completion down (the last one makes the delivery due), and cancel the deliveries after
     * one that is buried or cancelled; those cancels fire them again for the deliveries after
     * those (the connection sets recursive_triggers; the depth bounds the recursion).
     * has_dependents spares every other settle the look. */
    "ALTER TABLE \"{t}\" ADD COLUMN waiting INTEGER;"
    "ALTER TABLE \"{t}\" ADD COLUMN held_run_at REAL;"
    "ALTER TABLE \"{t}\" ADD COLUMN has_dependents INTEGER;"
    "ALTER TABLE \"{t}\" ADD COLUMN after_depth INTEGER;"
    "CREATE TABLE IF NOT EXISTS \"{t}_deps\" (id INTEGER NOT NULL, dep INTEGER NOT NULL);"
    "CREATE INDEX IF NOT EXISTS \"{t}_deps_dep\" ON \"{t}_deps\" (dep);"
    "CREATE TRIGGER IF NOT EXISTS \"{t}_dep_done\" AFTER UPDATE OF status ON \"{t}\""
    " WHEN OLD.has_dependents AND OLD.status IN ('pending','processing')"
    "  AND NEW.status = 'completed' BEGIN"
    " UPDATE \"{t}\" SET waiting = waiting - 1,"
    "  run_at = CASE WHEN waiting = 1 THEN held_run_at ELSE run_at END,"
    "  held_run_at = CASE WHEN waiting = 1 THEN NULL ELSE held_run_at END"
    "  WHERE id IN (SELECT id FROM \"{t}_deps\" WHERE dep = NEW.id) AND status = 'pending'"
    "  AND waiting > 0;"
    " DELETE FROM \"{t}_deps\" WHERE dep = NEW.id;"
    " END;"
    "CREATE TRIGGER IF NOT EXISTS \"{t}_dep_failed\" AFTER UPDATE OF status ON \"{t}\""
    " WHEN OLD.has_dependents AND OLD.status IN ('pending','processing')"
    "  AND NEW.status IN ('buried','cancelled') BEGIN"
    " UPDATE \"{t}\" SET status = 'cancelled', settled_at = NEW.settled_at,"
    "  last_error = 'dependency ' || NEW.id || ' was ' || NEW.status, waiting = NULL,"
    "  run_at = held_run_at, held_run_at = NULL"
    "  WHERE id IN (SELECT id FROM \"{t}_deps\" WHERE dep = NEW.id) AND status = 'pending'"
    "  AND waiting > 0;"
    " DELETE FROM \"{t}_deps\" WHERE dep = NEW.id;"
    " END;",
    /* 8: the buried and the cancelled per topic, kept by triggers in the writes that change
     * them (rare: a completion, the common write, reaches none of them), so stats read them
     * in one row per topic however many millions of rows are settled. The topic of a row never
     * changes; the update trigger still counts a change of it, so no write can make a count
     * wrong. Filled once here from the rows there are. */
    COUNT_TRIGGERS
    /* ... and the buried and the cancelled by topic and id: a page of one topic's seeks to
     * them without stepping over every other topic's (building them reads the table once) */
    "CREATE INDEX IF NOT EXISTS \"{t}_buried_topic\" ON \"{t}\" (topic, id)"
    " WHERE status = 'buried';"
    "CREATE INDEX IF NOT EXISTS \"{t}_cancelled_topic\" ON \"{t}\" (topic, id)"
    " WHERE status = 'cancelled';"
    "INSERT INTO \"{t}_counts\" (topic, buried, cancelled) SELECT topic, sum(status = 'buried'),"
    " sum(status = 'cancelled') FROM \"{t}\" WHERE status IN ('buried','cancelled')"
    " GROUP BY topic;",
};

/* The status CHECK as migration 1 wrote it, as earlier versions rewrote it, and as it is
 * rewritten now (see current_check). */
#define SLOW_CHECK "CHECK (status IN ('pending','processing','completed','buried'))"
#define FAST_CHECK "CHECK (status IN ('pending','processing') OR status IN ('completed','buried'))"
#define CURRENT_CHECK "CHECK (status IN ('pending','processing') OR status IN ('completed','buried')" \
    " OR status = 'cancelled')"


/* A kick (?1 the wall clock, ?3 the boot id, ?4 the boot clock): due now, or, when an operator
 * buried the delivery while it ran, when that run's lease ends, which the run itself never
 * outlives (its deadline comes first). The lease stays on the pending row until then, and the
 * claim waits for it on the boot clock (NO_LIVE_LEASE), so no step of the wall clock that
 * run_at is read on lets a second run start early; an expired one is cleared. */
#define KICK_SET " settled_at = NULL, lease_token = NULL, waiting = NULL, held_run_at = NULL," \
    " run_at = CASE WHEN " NO_LIVE_LEASE("?3", "?4", "?1") " THEN ?1" \
    "  WHEN lease_boot IS NULL OR ?3 IS NULL THEN MAX(?1, lease_expires_at)" \
    "  ELSE MAX(?1, ?1 + lease_until - ?4) END," \
    " lease_expires_at = CASE WHEN " NO_LIVE_LEASE("?3", "?4", "?1") " THEN NULL" \
    "  ELSE lease_expires_at END," \
    " lease_boot = CASE WHEN " NO_LIVE_LEASE("?3", "?4", "?1") " THEN NULL ELSE lease_boot END," \
    " lease_until = CASE WHEN " NO_LIVE_LEASE("?3", "?4", "?1") " THEN NULL ELSE lease_until END"

/* How many rows the table holds at most: the span of its ids, each read from one end of the
 * rowid b-tree (two subqueries: SQLite reads one min() or max() of an index quickly, not
 * both at once). Above ESTIMATE_ABOVE_ROWS the completed ones are not counted (a scan of millions
 * of index entries): stats estimate them from it, less the others, and per topic leave them
 * out. A purge deletes the oldest rows, so the span stays close to the rows held. */
#define ID_SPAN "coalesce((SELECT max(id) FROM \"{t}\") - (SELECT min(id) FROM \"{t}\") + 1, 0)"

/* The run_at of a delivery held behind its dependencies: after every time a run_at can be
 * (RB_MAX_EPOCH). */
#define HELD_RUN_AT "1e300"

/* A failed attempt's error (?5, when there is one, at ?1) joins the row's `errors`, the last
 * ERRORS_KEPT of them, oldest first. */
#define ERRORS_ADD " errors = CASE WHEN ?5 IS NULL THEN errors ELSE json_insert(" \
    "CASE WHEN json_array_length(coalesce(errors, '[]')) >= " RB_TEXT_OF(RB_ERRORS_KEPT) \
    " THEN json_remove(errors, '$[0]') ELSE coalesce(errors, '[]') END, '$[#]'," \
    " json_object('attempt', attempts, 'at', ?1, 'error', ?5)) END,"

const char *const rb_sqlite_stmt_sql[ST_COUNT] = {
    [ST_ENQ_FIND] = "SELECT id, status = 'pending' FROM \"{t}\" WHERE key IS NOT NULL"
        " AND status IN ('pending','processing') AND topic = ?1 AND key = ?2 ORDER BY id LIMIT 1",
    [ST_ENQ_INSERT] = "INSERT INTO \"{t}\" (topic, payload, key, status, attempts, max_attempts,"
        " fence, run_at, created_at, group_name) VALUES (?1, ?2, ?3, 'pending', 0, ?4, 0, ?5, ?6, ?7)",
    /* a replace (?1 id, ?2 payload, ?3 run_at, ?4 max_attempts) of a delivery found pending
     * in the same write transaction; one held behind its dependencies stays held, its own
     * due time changed */
    [ST_ENQ_REPLACE] = "UPDATE \"{t}\" SET payload = ?2, max_attempts = ?4, attempts = 0,"
        " run_at = CASE WHEN held_run_at IS NULL THEN ?3 ELSE run_at END,"
        " held_run_at = CASE WHEN held_run_at IS NULL THEN NULL ELSE ?3 END"
        " WHERE id = ?1 AND status = 'pending'",
    [ST_CLAIM_BURY] = "UPDATE \"{t}\" SET status = 'buried', settled_at = ?1,"
        " last_error = COALESCE(last_error, 'max attempts exceeded')," NO_LEASE " WHERE id = ?2",
    [ST_CLAIM_TAKE] = "UPDATE \"{t}\" SET status = 'processing', attempts = attempts + 1,"
        " fence = fence + 1, lease_token = ?1, lease_expires_at = ?2, lease_boot = ?4,"
        " lease_until = ?5 WHERE id = ?3",
    [ST_COMPLETE] = "UPDATE \"{t}\" SET status = 'completed', settled_at = ?1," NO_LEASE FENCED,
    [ST_RESCHEDULE] = "UPDATE \"{t}\" SET status = 'pending', run_at = ?1 + ?4,"
        " last_error = COALESCE(?5, last_error)," ERRORS_ADD NO_LEASE FENCED,
    [ST_BURY] = "UPDATE \"{t}\" SET status = 'buried', settled_at = ?1,"
        " last_error = COALESCE(?5, last_error)," ERRORS_ADD NO_LEASE FENCED,
    [ST_RELEASE] = "UPDATE \"{t}\" SET status = 'pending', run_at = ?1 + ?4,"
        " attempts = MAX(attempts - 1, 0)," NO_LEASE FENCED,
    /* an extension never shortens the lease */
    [ST_EXTEND] = "UPDATE \"{t}\" SET lease_expires_at = MAX(COALESCE(lease_expires_at, 0), ?1 + ?4),"
        " lease_until = CASE WHEN lease_boot IS ?6 THEN MAX(COALESCE(lease_until, 0), ?7 + ?4)"
        " ELSE ?7 + ?4 END, lease_boot = ?6" FENCED,
    [ST_GET] = "SELECT " RECORD_COLS " FROM \"{t}\" WHERE id = ?1",
    /* a run's progress (?4, JSON text), fenced as a settle */
    [ST_PROGRESS] = "UPDATE \"{t}\" SET progress = ?4" FENCED,
    [ST_STATS] = "SELECT"
        " (SELECT count(*) FROM \"{t}\" WHERE status IN ('pending','processing')"
        "   AND status = 'pending'),"
        " (SELECT count(*) FROM \"{t}\" WHERE status IN ('pending','processing')"
        "   AND status = 'processing'),"
        " CASE WHEN " ID_SPAN " > " RB_TEXT_OF(ESTIMATE_ABOVE_ROWS) " THEN -1 ELSE"
        "  (SELECT count(*) FROM \"{t}\" WHERE status IN ('completed','buried')"
        "   AND status = 'completed') END,"
        " (SELECT coalesce(sum(buried), 0) FROM \"{t}_counts\"),"
        " (SELECT coalesce(sum(cancelled), 0) FROM \"{t}_counts\"),"
        " count(*), min(run_at),"
        " (SELECT count(*) FROM \"{t}\" WHERE status IN ('pending','processing')"
        "   AND status = 'processing' AND " NO_LIVE_LEASE("?2", "?3", "?1") ")"
        " , " ID_SPAN
        " FROM \"{t}\" WHERE status IN ('pending','processing')"
        "   AND run_at <= ?1 AND " NO_LIVE_LEASE("?2", "?3", "?1"),
    [ST_KICK_ONE] = "UPDATE \"{t}\" SET status = 'pending', attempts = 0," KICK_SET
        " WHERE id = ?2 AND (status = 'buried' OR status = 'cancelled')",
    [ST_KICK_BURIED] = "UPDATE \"{t}\" SET status = 'pending', attempts = 0," KICK_SET
        " WHERE status IN ('completed','buried') AND status = 'buried'"
        " AND (?5 IS NULL OR topic = ?5)",
    [ST_PURGE] = "DELETE FROM \"{t}\" WHERE id IN (SELECT id FROM \"{t}\""
        " WHERE status IN ('completed','buried') AND status = ?1 AND settled_at < ?2"
        " AND (?4 IS NULL OR topic = ?4) ORDER BY settled_at LIMIT ?3)",
    /* The lease's token goes (the run's later writes are refused), its expiry stays: a kick
     * makes the delivery due no earlier (KICK_SET). */
    [ST_BURY_ONE] = "UPDATE \"{t}\" SET status = 'buried', settled_at = ?1, last_error = ?3,"
        " lease_token = NULL WHERE id = ?2 AND status IN ('pending','processing')",
    [ST_DELETE_ONE] = "DELETE FROM \"{t}\" WHERE id = ?2"
        " AND (status IN ('completed','buried') OR status = 'cancelled')",
    /* Per topic: the live ones through "{t}_due", the buried and the cancelled from
     * "{t}_counts", and the completed counted in a small table (ST_TOPIC_STATS) and left out
     * (NULL) in a large one (ST_TOPIC_STATS_LARGE: ST_ID_SPAN above ESTIMATE_ABOVE_ROWS). */
#define TOPIC_STATS(D, D_TOPICS, D_COUNT, D_JOIN) \
        "WITH live AS (SELECT topic, sum(status = 'pending') AS p," \
        "  sum(status = 'processing') AS r, min(CASE WHEN status = 'pending' THEN run_at END) AS m" \
        "  FROM \"{t}\" WHERE status IN ('pending','processing') GROUP BY topic)," \
        " k AS (SELECT topic, buried, cancelled FROM \"{t}_counts\"" \
        "  WHERE buried <> 0 OR cancelled <> 0)" D "," \
        " t AS (SELECT topic FROM live UNION SELECT topic FROM k" D_TOPICS ")" \
        " SELECT t.topic AS topic, coalesce(live.p, 0) AS pending, coalesce(live.r, 0) AS processing," \
        " " D_COUNT " AS completed, coalesce(k.buried, 0) AS buried," \
        " coalesce(k.cancelled, 0) AS cancelled, max(0, ?2 - coalesce(live.m, ?2)) AS oldest_due_age" \
        " FROM t LEFT JOIN live USING (topic) LEFT JOIN k USING (topic)" D_JOIN \
        " ORDER BY t.topic LIMIT ?1"
    [ST_TOPIC_STATS] = TOPIC_STATS(", d AS (SELECT topic, count(*) AS n FROM \"{t}\""
        "  WHERE status IN ('completed','buried') AND status = 'completed' GROUP BY topic)",
        " UNION SELECT topic FROM d", "coalesce(d.n, 0)", " LEFT JOIN d USING (topic)"),
    [ST_TOPIC_STATS_LARGE] = TOPIC_STATS("", "", "NULL", ""),
    [ST_ID_SPAN] = "SELECT " ID_SPAN,
    /* the earliest due pending deliveries, at most ?2, through "{t}_due" (its own WHERE term
     * repeated: SQLite uses a partial index only for a query that states its condition) */
    [ST_PENDING_TOPICS] = "SELECT topic, count(*) AS pending FROM (SELECT topic FROM \"{t}\""
        " WHERE status IN ('pending','processing') AND status = 'pending' ORDER BY run_at LIMIT ?2)"
        " GROUP BY topic ORDER BY topic LIMIT ?1",
    [ST_LEASE_ACQUIRE] = "INSERT INTO \"{t}_leases\" (name, token, expires_at, boot, until)"
        " VALUES (?1, ?2, ?3 + ?4, ?5, ?6 + ?4) ON CONFLICT (name) DO UPDATE"
        " SET token = excluded.token, expires_at = excluded.expires_at, boot = excluded.boot,"
        " until = excluded.until WHERE " NAMED_OVER " OR token = excluded.token",
    /* never shortens */
    [ST_LEASE_EXTEND] = "UPDATE \"{t}_leases\" SET expires_at = MAX(expires_at, ?3 + ?4),"
        " until = MAX(COALESCE(until, 0), ?6 + ?4)"
        " WHERE name = ?1 AND token = ?2 AND NOT " NAMED_OVER,
    [ST_LEASE_RELEASE] = "DELETE FROM \"{t}_leases\" WHERE name = ?1 AND token = ?2",
    /* ?1 the topic, ?2 the wall clock; a change only when the state changes (count 1) */
    [ST_PAUSE] = "INSERT INTO \"{t}_topics\" (topic, paused_at) VALUES (?1, ?2)"
        " ON CONFLICT (topic) DO UPDATE SET paused_at = excluded.paused_at WHERE paused_at IS NULL",
    [ST_RESUME] = "UPDATE \"{t}_topics\" SET paused_at = NULL"
        " WHERE topic = ?1 AND paused_at IS NOT NULL",
    [ST_PAUSED] = "SELECT topic, paused_at FROM \"{t}_topics\" WHERE paused_at IS NOT NULL"
        " ORDER BY topic LIMIT ?1",
    /* limits (schema 5): ?1 the topic; set ?2 rate, ?3 per, ?4 concurrency (NULL: off) */
    [ST_LIMITS] = "SELECT topic, rate_max AS rate, rate_per AS per, running_max AS concurrency"
        " FROM \"{t}_topics\" WHERE rate_max IS NOT NULL OR running_max IS NOT NULL"
        " ORDER BY topic LIMIT ?1",
    /* a claim's one look at what operators set: paused (1) or limited topics */
    [ST_CLAIM_TOPICS] = "SELECT topic, paused_at IS NOT NULL, rate_max, rate_per, running_max"
        " FROM \"{t}_topics\" WHERE paused_at IS NOT NULL OR rate_max IS NOT NULL"
        " OR running_max IS NOT NULL LIMIT ?1",
    [ST_LIMIT_SET] = "INSERT INTO \"{t}_topics\" (topic, rate_max, rate_per, running_max)"
        " VALUES (?1, ?2, ?3, ?4) ON CONFLICT (topic) DO UPDATE SET rate_max = excluded.rate_max,"
        " rate_per = excluded.rate_per, running_max = excluded.running_max",
    [ST_LIMIT_CLEAR] = "UPDATE \"{t}_topics\" SET rate_max = NULL, rate_per = NULL,"
        " running_max = NULL WHERE topic = ?1",
    /* a claim's look at a limited topic (?1): its runs under live leases (?2 boot id, ?3 boot
     * clock, ?4 wall clock), its starts since ?2, and its starts' record */
    [ST_RUNNING] = "SELECT count(*) FROM \"{t}\" WHERE topic = ?1 AND status = 'processing'"
        " AND NOT " LEASE_OVER("?2", "?3", "?4"),
    [ST_STARTS] = "SELECT count(*) FROM \"{t}_starts\" WHERE topic = ?1 AND at > ?2",
    [ST_START_ADD] = "INSERT INTO \"{t}_starts\" (topic, at) VALUES (?1, ?2)",
    [ST_STARTS_TRIM] = "DELETE FROM \"{t}_starts\" WHERE topic = ?1 AND at <= ?2",
    /* a cancel (?1 the wall clock, ?2 the id, ?3 the reason): the lease it takes, read first
     * in the same write transaction; then as ST_BURY_ONE */
    [ST_CANCEL_FIND] = "SELECT status = 'processing', lease_token FROM \"{t}\""
        " WHERE id = ?2 AND status IN ('pending','processing')",
    [ST_CANCEL_ONE] = "UPDATE \"{t}\" SET status = 'cancelled', settled_at = ?1, last_error = ?3,"
        " lease_token = NULL WHERE id = ?2 AND status IN ('pending','processing')",
    /* schedules (schema 6): ?1 the name; set ?2 topic, ?3 payload, ?4 cron, ?5 every,
     * ?6 timezone, ?7 next_at (kept when the timing is the same), ?8 the wall clock */
    [ST_SCHEDULE_FIND] = "SELECT 1 FROM \"{t}_schedules\" WHERE name = ?1",
    [ST_SCHEDULE_SET] = "INSERT INTO \"{t}_schedules\" (name, topic, payload, cron, every,"
        " timezone, next_at, created_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)"
        " ON CONFLICT (name) DO UPDATE SET topic = excluded.topic, payload = excluded.payload,"
        " next_at = CASE WHEN cron IS excluded.cron AND every IS excluded.every"
        "  AND timezone IS excluded.timezone THEN next_at ELSE excluded.next_at END,"
        " cron = excluded.cron, every = excluded.every, timezone = excluded.timezone",
    [ST_UNSCHEDULE] = "DELETE FROM \"{t}_schedules\" WHERE name = ?1",
    [ST_SCHEDULES] = "SELECT name, topic, payload, cron, every, timezone, next_at, fired_at"
        " FROM \"{t}_schedules\" ORDER BY name LIMIT ?1",
    /* a tick (?2 its due time) moves next_at on (?3) while no other process has */
    [ST_SCHEDULE_FIRE] = "UPDATE \"{t}_schedules\" SET next_at = ?3, fired_at = ?4"
        " WHERE name = ?1 AND next_at = ?2 AND topic = ?5 AND payload = ?6",
    /* dependencies (schema 7): ?1 a dependency's id; the new delivery ?1 held behind ?2 of
     * them, or cancelled (?2 the wall clock, ?3 why); a dependency row (?1 the delivery, ?2
     * the dependency) and its mark */
    [ST_DEP_STATUS] = "SELECT status, coalesce(after_depth, 0) FROM \"{t}\" WHERE id = ?1",
    [ST_DEP_HOLD] = "UPDATE \"{t}\" SET waiting = ?2, held_run_at = run_at,"
        " run_at = " HELD_RUN_AT ", after_depth = ?3 WHERE id = ?1",
    [ST_DEP_CANCEL] = "UPDATE \"{t}\" SET status = 'cancelled', settled_at = ?2, last_error = ?3"
        " WHERE id = ?1",
    [ST_DEP_ADD] = "INSERT INTO \"{t}_deps\" (id, dep) VALUES (?1, ?2)",
    [ST_DEP_MARK] = "UPDATE \"{t}\" SET has_dependents = 1 WHERE id = ?1"
        " AND has_dependents IS NOT 1",
    [ST_PURGE_CANCELLED] = "DELETE FROM \"{t}\" WHERE id IN (SELECT id FROM \"{t}\""
        " WHERE status = 'cancelled' AND settled_at < ?2 AND (?4 IS NULL OR topic = ?4)"
        " ORDER BY settled_at LIMIT ?3)",
    /* cancel every live delivery (?4 of that status only) of topic ?1 (NULL: any), at ?2,
     * last_error ?3; the running ones' leases, read first in the same write transaction */
    [ST_CANCEL_ALL_RUNS] = "SELECT id, lease_token FROM \"{t}\" WHERE status IN ('pending','processing')"
        " AND status = 'processing' AND (?4 IS NULL OR ?4 = 'processing')"
        " AND (?1 IS NULL OR topic = ?1) AND lease_token IS NOT NULL",
    [ST_CANCEL_ALL] = "UPDATE \"{t}\" SET status = 'cancelled', settled_at = ?2, last_error = ?3,"
        " lease_token = NULL WHERE status IN ('pending','processing') AND (?4 IS NULL OR status = ?4)"
        " AND (?1 IS NULL OR topic = ?1)",
};

char *rb_sqlite_expand(const char *tmpl, const char *table)
{
    return rb_text_subst(tmpl, "{t}", table);
}

/* --- opening and migrations ------------------------------------------------------------- */
/* The schema version recorded for this deliveries table (0 when none); -1 on error. */
static int schema_version(sqlite3 *db, const char *table)
{
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(db, "SELECT version FROM relaybus_schema WHERE name = ?1", -1, &st,
                           NULL) != SQLITE_OK) return -1;
    sqlite3_bind_text(st, 1, table, -1, SQLITE_STATIC);
    int rc = sqlite3_step(st), v = rc == SQLITE_ROW ? sqlite3_column_int(st, 0) : 0;
    sqlite3_finalize(st);
    return rc == SQLITE_ROW || rc == SQLITE_DONE ? v : -1;
}

/* Runs a migration's statements in turn. An ADD COLUMN of a column that is there already
 * counts as done (SQLite has no ADD COLUMN IF NOT EXISTS): a deliveries table dropped by hand
 * is made again from the first migration beside the leases table it left, whose columns the
 * later ones added then. */
static int exec_template(sqlite3 *db, const char *tmpl, const char *table)
{
    char *sql = rb_sqlite_expand(tmpl, table);
    if (!sql) return SQLITE_NOMEM;
    int rc = SQLITE_OK;
    for (const char *next = sql; rc == SQLITE_OK && *next;) {
        sqlite3_stmt *st = NULL;
        rc = sqlite3_prepare_v2(db, next, -1, &st, &next);
        if (rc == SQLITE_ERROR && strncmp(sqlite3_errmsg(db), "duplicate column name", 21) == 0) {
            rc = SQLITE_OK;     /* (SQLite refuses such an ALTER when preparing it) */
            continue;
        }
        if (rc != SQLITE_OK || !st) break;      /* an error, or only spaces were left */
        int step = sqlite3_step(st);
        if (step != SQLITE_DONE && step != SQLITE_ROW) rc = step;
        sqlite3_finalize(st);
    }
    free(sql);
    return rc;
}

static int record_version(sqlite3 *db, const char *table)
{
    sqlite3_stmt *st;
    int rc = sqlite3_prepare_v2(db, "INSERT OR REPLACE INTO relaybus_schema (name, version)"
                                " VALUES (?1, ?2)", -1, &st, NULL);
    if (rc != SQLITE_OK) return rc;
    sqlite3_bind_text(st, 1, table, -1, SQLITE_STATIC);
    sqlite3_bind_int(st, 2, SCHEMA_VERSION);
    rc = sqlite3_step(st);
    sqlite3_finalize(st);
    return rc == SQLITE_DONE ? SQLITE_OK : rc;
}

/* 1 when the table's definition lacks CURRENT_CHECK (0 when it has it, or cannot tell). */
static int has_old_check(sqlite3 *db, const char *table)
{
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(db, "SELECT instr(sql, ?2) = 0 FROM sqlite_master"
                           " WHERE type = 'table' AND name = ?1", -1, &st, NULL) != SQLITE_OK)
        return 0;
    sqlite3_bind_text(st, 1, table, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 2, CURRENT_CHECK, -1, SQLITE_STATIC);
    int old = sqlite3_step(st) == SQLITE_ROW && sqlite3_column_int(st, 0);
    sqlite3_finalize(st);
    return old;
}

/* Inside migrate's transaction: the status CHECK becomes CURRENT_CHECK, which also allows
 * cancelled. Its form is for speed: SQLite tests a value against a list of more than two
 * constants by building a temporary b-tree every time a statement runs (two zeroed pages and
 * a dozen allocations in every claim, settle and enqueue, half the work of a drain); lists of
 * two and an equality are plain comparisons. SQLite changes no CHECK in place; its documented
 * way for a constraint that every row already meets (this one only allows more) is to rewrite
 * the table's definition in sqlite_master (writable_schema), then move the schema cookie on,
 * so that every connection reads the definition anew. A build in defensive mode refuses that
 * unless the connection turns defensive off, which it does for this statement. */
static int current_check(sqlite3 *db, const char *table)
{
    sqlite3_stmt *st;
    int cookie = -1, changed = 0, defensive = 0;
    if (sqlite3_prepare_v2(db, "PRAGMA schema_version", -1, &st, NULL) == SQLITE_OK) {
        if (sqlite3_step(st) == SQLITE_ROW) cookie = sqlite3_column_int(st, 0);
        sqlite3_finalize(st);
    }
    sqlite3_db_config(db, SQLITE_DBCONFIG_DEFENSIVE, -1, &defensive);
    if (defensive) sqlite3_db_config(db, SQLITE_DBCONFIG_DEFENSIVE, 0, NULL);
    if (cookie >= 0 && sqlite3_exec(db, "PRAGMA writable_schema = ON", NULL, NULL, NULL) == SQLITE_OK) {
        if (sqlite3_prepare_v2(db, "UPDATE sqlite_master SET sql = replace(replace(sql, ?2, ?4),"
                               " ?3, ?4) WHERE type = 'table' AND name = ?1", -1, &st,
                               NULL) == SQLITE_OK) {
            sqlite3_bind_text(st, 1, table, -1, SQLITE_STATIC);
            sqlite3_bind_text(st, 2, SLOW_CHECK, -1, SQLITE_STATIC);
            sqlite3_bind_text(st, 3, FAST_CHECK, -1, SQLITE_STATIC);
            sqlite3_bind_text(st, 4, CURRENT_CHECK, -1, SQLITE_STATIC);
            changed = sqlite3_step(st) == SQLITE_DONE && sqlite3_changes(db) > 0;
            sqlite3_finalize(st);
        }
        if (changed) {
            char sql[48];
            snprintf(sql, sizeof sql, "PRAGMA schema_version = %d", cookie + 1);
            sqlite3_exec(db, sql, NULL, NULL, NULL);
        }
        sqlite3_exec(db, "PRAGMA writable_schema = OFF", NULL, NULL, NULL);
    }
    if (defensive) sqlite3_db_config(db, SQLITE_DBCONFIG_DEFENSIVE, 1, NULL);
    return has_old_check(db, table) ? SQLITE_ERROR : SQLITE_OK;
}

/* Whether the deliveries table is missing, though relaybus_schema may still hold its row: a
 * table dropped by hand, its version left behind. */
static int table_missing(sqlite3 *db, const char *table)
{
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(db, "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?1",
                           -1, &st, NULL) != SQLITE_OK) return 0;
    sqlite3_bind_text(st, 1, table, -1, SQLITE_STATIC);
    int missing = sqlite3_step(st) == SQLITE_DONE;
    sqlite3_finalize(st);
    return missing;
}

/* Applies the migrations this table lacks, in one transaction; idempotent. */
static int migrate(sqlite3 *db, const char *table, char *err, size_t errlen)
{
    /* Current already (the usual case): a read says so, and no write lock is taken -- a
     * worker restarting beside a busy one must not queue for the single writer. */
    if (schema_version(db, table) == SCHEMA_VERSION && !has_old_check(db, table) &&
        !table_missing(db, table)) return 0;
    int rc = sqlite3_exec(db, "BEGIN IMMEDIATE; CREATE TABLE IF NOT EXISTS relaybus_schema ("
                          " name TEXT PRIMARY KEY, version INTEGER NOT NULL)", NULL, NULL, NULL);
    int v = rc == SQLITE_OK ? schema_version(db, table) : -1;
    if (v > SCHEMA_VERSION) {
        snprintf(err, errlen, "sqlite: table '%s' has schema version %d, newer than this "
                 "relaybus knows (%d)", table, v, SCHEMA_VERSION);
        sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
        return -1;
    }
    if (v < 0) rc = rc == SQLITE_OK ? SQLITE_ERROR : rc;
    if (v > 0 && table_missing(db, table)) v = 0;      /* made again from the start */
    for (int i = v; rc == SQLITE_OK && i < SCHEMA_VERSION; i++)
        rc = exec_template(db, migrations[i], table);
    if (rc == SQLITE_OK && v < SCHEMA_VERSION) rc = record_version(db, table);
    int check = rc == SQLITE_OK && has_old_check(db, table) ? current_check(db, table) : SQLITE_OK;
    if (check != SQLITE_OK) {
        snprintf(err, errlen, "sqlite: cannot allow the status cancelled in the CHECK of '%s' "
                 "(this SQLite refuses to rewrite a table's definition)", table);
        sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
        return -1;
    }
    if (rc == SQLITE_OK) rc = sqlite3_exec(db, "COMMIT", NULL, NULL, NULL);
    if (rc != SQLITE_OK) {
        snprintf(err, errlen, "sqlite: cannot create the schema of '%s': %s", table,
                 sqlite3_errmsg(db));
        if (!sqlite3_get_autocommit(db)) sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
        return -1;
    }
    return 0;
}

/* Without migrate the schema must already be there, at this version. */
static int check_schema(sqlite3 *db, const char *path, const char *table, char *err,
                        size_t errlen)
{
    int v = schema_version(db, table);
    if (v > 0 && table_missing(db, table)) {
        snprintf(err, errlen, "sqlite: no table '%s' in '%s', though relaybus_schema records "
                 "version %d of it (was it dropped? run relaybus migrate)", table, path, v);
        return -1;
    }
    if (v == SCHEMA_VERSION) return 0;
    int code = sqlite3_errcode(db);
    if (v < 0 && code != SQLITE_ERROR)     /* not a missing table: not a database, I/O... */
        snprintf(err, errlen, "sqlite: %s '%s'", sqlite3_errmsg(db), path);
    else if (v > SCHEMA_VERSION)
        snprintf(err, errlen, "sqlite: table '%s' has schema version %d, newer than this "
                 "relaybus knows (%d)", table, v, SCHEMA_VERSION);
    else if (v > 0)
        snprintf(err, errlen, "sqlite: the schema of table '%s' in '%s' is outdated "
                 "(run relaybus migrate)", table, path);
    else
        snprintf(err, errlen, "sqlite: no relaybus schema here (run relaybus migrate): no "
                 "table '%s' in '%s'", table, path);
    return -1;
}

static int check_writable(sqlite3 *db, const char *path, char *err, size_t errlen)
{
    sqlite3_busy_timeout(db, OPEN_TIMEOUT_MS);
    if (sqlite3_db_readonly(db, "main") == 1) {
        snprintf(err, errlen, "sqlite: database '%s' is read-only", path);
        return -1;
    }
    return 0;
}

/* WAL lets several processes share the file (readers never wait for the writer). */
static int use_wal(sqlite3 *db, const char *path, char *err, size_t errlen)
{
    /* Changing the journal mode takes the file's exclusive lock from under a shared one, and
     * SQLite answers SQLITE_BUSY at once there instead of waiting (it would deadlock another
     * connection doing the same): processes opening a new file together try again, within
     * the open's time. */
    int rc, waited = 0;
    while ((rc = sqlite3_exec(db, "PRAGMA journal_mode = WAL", NULL, NULL, NULL) & 0xff) ==
               SQLITE_BUSY && waited < OPEN_TIMEOUT_MS)
        waited += sqlite3_sleep(5);
    if (rc == SQLITE_READONLY || rc == SQLITE_CANTOPEN || rc == SQLITE_PERM)
        snprintf(err, errlen, "sqlite: cannot use '%s' in WAL mode (%s; the file and its "
                 "directory must be writable)", path, sqlite3_errmsg(db));
    else if (rc != SQLITE_OK)
        snprintf(err, errlen, "sqlite: %s '%s'", sqlite3_errmsg(db), path);
    return rc == SQLITE_OK ? 0 : -1;
}

/* A symbolic link at path that points at nothing (yet): SQLite would make the file it names. */
static int dangling_link(const char *path)
{
    struct stat st;
    return lstat(path, &st) == 0 && S_ISLNK(st.st_mode) && stat(path, &st) != 0 &&
           errno == ENOENT;
}

/* The path the link at path names, relative ones taken from the link's directory, into out
 * (cap bytes); -1 when it cannot be read or does not fit. */
static int link_target(const char *path, char *out, size_t cap)
{
    char to[PATH_MAX];
    ssize_t n = readlink(path, to, sizeof to);
    if (n <= 0 || (size_t)n >= sizeof to) return -1;
    to[n] = 0;
    const char *slash = strrchr(path, '/');
    int dir = to[0] == '/' || !slash ? 0 : (int)(slash - path + 1);
    int len = snprintf(out, cap, "%.*s%s", dir, path, to);
    return len >= 0 && (size_t)len < cap ? 0 : -1;
}

/* Links followed from the path given, at most: Linux's own limit for one lookup. */
#define LINKS_MAX 40

/* The database file is made here, not by SQLite, which would make it 0644 (less the umask):
 * deliveries and their payloads are the application's data, so 0600. SQLite gives its -wal
 * and -shm files the mode of the database file. A file that exists keeps its mode. A path
 * that is a link to nothing yet is followed, as SQLite follows it, and the file it names is
 * made 0600 (O_EXCL never follows a link: it would answer EEXIST and leave SQLite to make
 * it). A file made here stays when the open fails later: another process may have opened it
 * meanwhile. Returns 1 when the file was made, 0 when it was there, -1 with err set. */
static int create_private(const char *path, char *err, size_t errlen)
{
    char at[2][PATH_MAX];
    const char *p = path;
    for (int hops = 0;; hops++) {
        int fd = open(p, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (fd >= 0) {
            close(fd);
            return 1;
        }
        if (errno != EEXIST) {
            snprintf(err, errlen, "sqlite: cannot create '%s': %s", path, strerror(errno));
            return -1;
        }
        /* a loop of links, or one that cannot be read, is left to SQLite to report */
        char *next = at[hops % 2];
        if (hops == LINKS_MAX || !dangling_link(p) || link_target(p, next, PATH_MAX) != 0)
            return 0;
        p = next;
    }
}

/* Why a database file could not be opened, when the file system says more than SQLite's
 * "unable to open database file". */
static void explain_open(const char *path, int migrate, char *err, size_t errlen)
{
    struct stat st;
    if (stat(path, &st) == 0) {
        if (S_ISDIR(st.st_mode))
            snprintf(err, errlen, "sqlite: '%s' is a directory, not a database file", path);
        else if (access(path, R_OK | W_OK) != 0)
            snprintf(err, errlen, "sqlite: cannot open '%s': %s", path, strerror(errno));
    } else if (errno == ENOENT && !migrate) {
        snprintf(err, errlen, "sqlite: no relaybus schema here (run relaybus migrate): '%s' "
                 "does not exist", path);
    } else if (errno != ENOENT) {
        snprintf(err, errlen, "sqlite: cannot open '%s': %s", path, strerror(errno));
    }
}

/* 1 when table `name` exists without `column` (a table of another kind under that name). */
static int lacks_column(sqlite3 *db, const char *name, const char *column)
{
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(db, "SELECT count(*), sum(name = ?2) FROM pragma_table_info(?1)"
                           " WHERE schema = 'main'", -1, &st, NULL) != SQLITE_OK) return 0;
    sqlite3_bind_text(st, 1, name, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 2, column, -1, SQLITE_STATIC);
    int lacks = sqlite3_step(st) == SQLITE_ROW && sqlite3_column_int(st, 0) > 0 &&
                sqlite3_column_int(st, 1) == 0;
    sqlite3_finalize(st);
    return lacks;
}

/* The deliveries table TABLE, its leases table TABLE_leases, its topic settings TABLE_topics
 * and its schedules TABLE_schedules must be what they say: another relaybus table may hold one of the names (a deliveries table
 * named jobs_leases beside --table jobs), or an application's own table. Refused before
 * anything is made. */
static int check_names(sqlite3 *db, const char *table, char *err, size_t errlen)
{
    char leases[256], topics[256], schedules[256], deps[256];
    snprintf(deps, sizeof deps, "%s_deps", table);
    snprintf(leases, sizeof leases, "%s_leases", table);
    snprintf(topics, sizeof topics, "%s_topics", table);
    snprintf(schedules, sizeof schedules, "%s_schedules", table);
    if (lacks_column(db, table, "fence"))
        snprintf(err, errlen, "sqlite: table %s exists and is not a relaybus deliveries table "
                 "(is it another table's named leases, or the application's?): choose another "
                 "table name", table);
    else if (lacks_column(db, leases, "token"))
        snprintf(err, errlen, "sqlite: table %s exists and is not the named leases of table %s "
                 "(is it a deliveries table?): choose another table name", leases, table);
    else if (lacks_column(db, topics, "paused_at"))
        snprintf(err, errlen, "sqlite: table %s exists and is not the topic settings of table %s "
                 "(is it a deliveries table?): choose another table name", topics, table);
    else if (lacks_column(db, deps, "dep"))
        snprintf(err, errlen, "sqlite: table %s exists and is not the dependencies of table %s "
                 "(is it a deliveries table?): choose another table name", deps, table);
    else if (lacks_column(db, schedules, "next_at"))
        snprintf(err, errlen, "sqlite: table %s exists and is not the schedules of table %s "
                 "(is it a deliveries table?): choose another table name", schedules, table);
    else
        return 0;
    return -1;
}

int rb_sqlite_open_file(const char *path, const char *table, int want_migrate, int memory,
                        sqlite3 **db, char *err, size_t errlen)
{
    *db = NULL;
    int created = want_migrate && !memory ? create_private(path, err, errlen) : 0;
    int rc = SQLITE_CANTOPEN;
    if (created >= 0) {
        /* Without migrate nothing is made: a mistyped path must not leave a file behind. The
         * connection is used on its loop's thread only: SQLite's own locking of it (the
         * serialized mode) would be a lock and an unlock on every call, for nothing. */
        int flags = SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX |
                    (want_migrate ? SQLITE_OPEN_CREATE : 0);
        rc = sqlite3_open_v2(path, db, flags, NULL);
        if (rc != SQLITE_OK) {
            snprintf(err, errlen, "sqlite: %s '%s'", *db ? sqlite3_errmsg(*db)
                                                         : sqlite3_errstr(rc), path);
            explain_open(path, want_migrate, err, errlen);
        }
    }
    /* Without migrate the schema is checked before WAL mode is set: opening some other
     * database by mistake must leave it as it was. */
    if (rc != SQLITE_OK || check_writable(*db, path, err, errlen) != 0 ||
        check_names(*db, table, err, errlen) != 0 ||
        (want_migrate ? use_wal(*db, path, err, errlen) != 0 ||
                        migrate(*db, table, err, errlen) != 0
                      : check_schema(*db, path, table, err, errlen) != 0 ||
                        use_wal(*db, path, err, errlen) != 0)) {
        sqlite3_close_v2(*db);
        *db = NULL;
        return -1;
    }
    /* the dependencies' triggers cancel a chain of deliveries by firing again (schema 7) */
    sqlite3_exec(*db, "PRAGMA recursive_triggers = ON", NULL, NULL, NULL);
    return 0;
}
