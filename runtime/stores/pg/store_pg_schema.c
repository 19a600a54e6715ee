/* store_pg_schema.c -- the PostgreSQL store's SQL and schema: the migrations (tables, the
 * partial indexes, the NOTIFY trigger), the statements the store runs, and migrate / check at
 * open (blocking, libpq's synchronous calls). docs/stores.md describes the schema. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <libpq-fe.h>
#include "stores/delivery.h"
#include "stores/store.h"
#include "stores/pg/store_pg_schema.h"
#include "util/alloc.h"
#include "util/text.h"

#define ERRLEN 512

/* ---- SQL --------------------------------------------------------------------------------
 * "@T" stands for the table name (validated as an identifier, always inside double quotes). */

/* When a row next needs attention: its run_at while pending, its lease expiry while processing.
 * One partial index on it keeps claims cheap however many settled rows the table holds. */
#define DUE "(CASE WHEN status = 'pending' THEN run_at ELSE lease_expires_at END)"
#define COLS_OF(RUN_AT) "id::text AS id_text, topic, payload::text, key, last_error, lease_token," \
    " status, attempts, max_attempts, fence, date_part('epoch', " RUN_AT ")," \
    " date_part('epoch', created_at), coalesce(date_part('epoch', lease_expires_at), 0)"
#define COLS COLS_OF("run_at")
/* get and list read the group and the history too. The group is the column after the claim's
 * c_settled (a record has NULL there), as in the claim's rows; the history follows. A held
 * delivery (schema 11, ENQ_GROUPED) shows the run_at it will get back. */
#define RECORD_COLS COLS_OF("coalesce(held_run_at, run_at)") ", NULL::integer, group_name," \
    " coalesce(date_part('epoch', settled_at), 0), progress::text, errors::text," \
    " coalesce(waiting, 0)"
#define LIVE "status IN ('pending', 'processing')"

/* The fenced writes of a settle batch inside "@T_claim", from its five arrays of one length:
 * s_id, s_token, s_kind (rb_settle_kind: 0 complete, 1 reschedule, 2 bury, 3 release,
 * 4 extend), s_delay and s_error. A row changes only while it is processing under the given
 * token; o.ord numbers the writes. The two clauses that look redundant fix the plan for any
 * size of table: d.id = ANY(s_id) gives the scan of d an index condition on the primary key
 * whatever the join order, and the status compared with the variable `processing` (a
 * parameter in the cached plan) cannot prove the predicate of the partial "@T_due", so the
 * planner cannot walk all of it for the ids (its second column). */
#define SETTLE(EXTRA) \
    "WITH o AS (SELECT * FROM unnest(s_id, s_token, s_kind, s_delay, s_error)" \
    "  WITH ORDINALITY AS o(id, tok, kind, dl, err, ord))" \
    " UPDATE \"@T\" AS d SET" \
    "  status = CASE o.kind WHEN 0 THEN 'completed' WHEN 2 THEN 'buried'" \
    "   WHEN 4 THEN 'processing' ELSE 'pending' END," \
    "  attempts = CASE WHEN o.kind = 3 THEN greatest(d.attempts - 1, 0) ELSE d.attempts END," \
    "  run_at = CASE WHEN o.kind IN (1, 3) THEN now() + o.dl * interval '1 second'" \
    "   ELSE d.run_at END," \
    "  last_error = CASE WHEN o.kind IN (1, 2) THEN coalesce(o.err, d.last_error)" \
    "   ELSE d.last_error END," \
    "  lease_token = CASE WHEN o.kind = 4 THEN d.lease_token END," EXTRA \
    /* an extension never shortens the lease */ \
    "  lease_expires_at = CASE WHEN o.kind = 4 THEN greatest(d.lease_expires_at," \
    "   now() + o.dl * interval '1 second') END," \
    "  settled_at = CASE WHEN o.kind IN (0, 2) THEN now() END" \
    " FROM o WHERE d.id = o.id AND d.id = ANY(s_id) AND d.status = processing" \
    "  AND d.lease_token = o.tok"

/* A failed attempt's error joins the row's `errors` (schema 10), the last RB_ERRORS_KEPT of
 * them, oldest first: an extra SET clause of SETTLE. */
#define ERRORS_ADD \
    "  errors = CASE WHEN o.kind IN (1, 2) AND o.err IS NOT NULL THEN" \
    "   (CASE WHEN jsonb_array_length(coalesce(d.errors, '[]')) >= " RB_TEXT_OF(RB_ERRORS_KEPT) \
    "    THEN d.errors - 0 ELSE coalesce(d.errors, '[]') END) || jsonb_build_array(" \
    "    jsonb_build_object('attempt', d.attempts, 'at', date_part('epoch', now()), 'error', o.err))" \
    "   ELSE d.errors END,"

/* The claim's query: at most p_limit due deliveries of p_topics, claimed (or buried when out of
 * attempts) and returned (CLAIM_FUNCTION; schema 11 runs it again per limited topic). */
#define CLAIM_QUERY(G) CLAIM_ROWS(DUE_WALK("id", G), "", G)
/* The walk of "@T_due": at most p_limit due rows of p_topics free by G's rule, locked;
 * COLS of each. */
#define DUE_WALK(COLS, G) "SELECT " COLS " FROM \"@T\" AS x" \
    "  WHERE " LIVE " AND " DUE " <= now() AND topic = ANY(p_topics)" G##_FREE \
    "  ORDER BY " DUE ", id LIMIT p_limit FOR UPDATE SKIP LOCKED"
/* The claim of the ids that CANDIDATES selects (locked), SET first among the row's changes. */
#define CLAIM_ROWS(CANDIDATES, SET, G) \
    "  RETURN QUERY WITH c AS (" CANDIDATES ")," \
    " u AS (UPDATE \"@T\" AS d SET" SET \
    "  status = CASE WHEN d.attempts >= d.max_attempts THEN 'buried' ELSE 'processing' END," \
    "  attempts = CASE WHEN d.attempts >= d.max_attempts THEN d.attempts ELSE d.attempts + 1 END," \
    "  fence = CASE WHEN d.attempts >= d.max_attempts THEN d.fence ELSE d.fence + 1 END," \
    "  lease_token = CASE WHEN d.attempts >= d.max_attempts THEN NULL ELSE p_token END," \
    "  lease_expires_at = CASE WHEN d.attempts >= d.max_attempts THEN NULL" \
    "   ELSE now() + p_lease * interval '1 second' END," \
    "  last_error = CASE WHEN d.attempts >= d.max_attempts" \
    "   THEN coalesce(d.last_error, 'max attempts exceeded') ELSE d.last_error END," \
    "  settled_at = CASE WHEN d.attempts >= d.max_attempts THEN now() END" \
    /* = ANY(ARRAY(...)) keeps the update on the primary key: a join with c may be \
     * planned as a hash join over a scan of the whole table */ \
    "  WHERE d.id = ANY(ARRAY(SELECT id FROM c)) RETURNING d.*)" \
    " SELECT " COLS ", NULL::integer" G##_VALUE " FROM u WHERE status = 'processing'" \
    " ORDER BY run_at, id;\n"

/* The claim function's rows (see migration 7); from 11 on with the group after c_settled. */
#define CLAIM_RETURNS(EXTRA) "RETURNS TABLE (c_id text, c_topic text, c_payload text," \
    " c_key text, c_last_error text, c_lease_token text, c_status text, c_attempts integer," \
    " c_max_attempts integer, c_fence bigint, c_run_at float8, c_created_at float8," \
    " c_lease_expires_at float8, c_settled integer" EXTRA ")"

/* The claim function of migration 7 (its comment there says what it does); 9 makes it again
 * with the pause, 10 with the errors: DECL declares, START runs before the settles and the
 * claim, SETTLE_EXTRA adds to the settles' SET. */
#define CLAIM_FUNCTION(DECL, START, SETTLE_EXTRA, G) \
    "CREATE OR REPLACE FUNCTION \"@T_claim\"(p_topics text[], p_limit bigint, p_lease float8," \
    " p_token text, s_id bigint[], s_token text[], s_kind integer[], s_delay float8[]," \
    " s_error text[], p_next boolean, p_tell_wait boolean) " CLAIM_RETURNS(G##_COLUMN) \
    " LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off" \
    " SET enable_nestloop = off SET enable_sort = off SET enable_bitmapscan = off SET jit = off" \
    " AS $f$\n" \
    "DECLARE processing constant text := 'processing';\n" \
    " slots_text text; slots integer; slot integer; tkey integer; user_timeout text;\n" \
    " claimed bigint; waited boolean := false;\n" DECL \
    "BEGIN\n" \
    "  IF p_limit > 0 THEN\n" \
    "    slots_text := btrim(coalesce(current_setting('relaybus.claim_slots', true), ''));\n" \
    "    slots := CASE WHEN slots_text ~ '^[+-]?[0-9]{1,9}$' THEN slots_text::integer ELSE 2 END;\n" \
    "    IF slots > 0 THEN\n" \
    "      tkey := ('\"@T\"'::regclass::oid::bigint - 2147483648)::integer;\n" \
    "      slot := 0;\n" \
    "      WHILE slot < slots AND NOT pg_try_advisory_xact_lock(tkey, slot) LOOP\n" \
    "        slot := slot + 1;\n" \
    "      END LOOP;\n" \
    "      IF slot = slots THEN\n" \
    "        user_timeout := current_setting('lock_timeout');\n" \
    "        IF user_timeout = '0' THEN PERFORM set_config('lock_timeout', '1s', true); END IF;\n" \
    "        BEGIN\n" \
    "          PERFORM pg_advisory_xact_lock(tkey, floor(random() * slots)::integer);\n" \
    "          waited := true;\n" \
    "        EXCEPTION WHEN lock_not_available THEN\n" \
    "          NULL;\n" \
    "        END;\n" \
    "        PERFORM set_config('lock_timeout', user_timeout, true);\n" \
    "      END IF;\n" \
    "    END IF;\n" \
    "  END IF;\n" \
    START \
    "  IF coalesce(array_length(s_id, 1), 0) > 0 THEN\n" \
    G##_SETTLE_BEGIN \
    "    RETURN QUERY WITH w AS (" SETTLE(SETTLE_EXTRA) \
    "     RETURNING o.ord, coalesce(date_part('epoch', d.lease_expires_at), 0) AS expires)" \
    "    SELECT NULL::text, NULL::text, NULL::text, NULL::text, NULL::text, NULL::text," \
    "     NULL::text, NULL::integer, NULL::integer, NULL::bigint, NULL::float8, NULL::float8," \
    "     w.expires, w.ord::integer" G##_NULL " FROM w;\n" \
    G##_SETTLE_END \
    "  END IF;\n" \
    "  IF p_limit > 0 THEN\n" \
    G##_CLAIM \
    "  GET DIAGNOSTICS claimed = ROW_COUNT;\n" \
    G##_LIMITS \
    "  IF p_next AND claimed < p_limit THEN\n" \
    "    RETURN QUERY SELECT NULL::text, NULL::text, NULL::text, NULL::text, NULL::text," \
    "     NULL::text, NULL::text, NULL::integer, NULL::integer, NULL::bigint," \
    /* (the difference of the epochs, not of the times: a run_at of 'infinity' or \
     * '-infinity', as an operator may park a row, cannot be subtracted from a time) */ \
    "     (SELECT date_part('epoch', " DUE ") - date_part('epoch', now()) FROM \"@T\" WHERE " LIVE \
    "      ORDER BY " DUE ", id LIMIT 1), NULL::float8, NULL::float8, 0" G##_NULL ";\n" \
    "  END IF;\n" \
    "  IF p_tell_wait AND waited THEN\n" \
    "    RETURN QUERY SELECT NULL::text, NULL::text, NULL::text, NULL::text, NULL::text," \
    " NULL::text, NULL::text, NULL::integer, NULL::integer, NULL::bigint, NULL::float8," \
    " NULL::float8, NULL::float8, -1" G##_NULL ";\n" \
    "  END IF;\n" \
    "  END IF;\n" \
    "END\n" \
    "$f$;\n"

/* The claim's groups (CLAIM_FUNCTION's G): UNGROUPED as made before schema 11, GROUPED
 * after. A grouped row is claimable when it is its group's head (the live one of the
 * smallest id) and no other of the group holds a live lease (one an operator kicked back
 * ahead of a running one waits for it): so at most one of a group is claimed, and a claim
 * beside it sees the head pending (in its snapshot) or processing, or skips it locked.
 * Two subqueries that are not pulled up into joins (a NOT EXISTS would become an anti join,
 * which with nested loops off hashes every live grouped row on each claim). The busy groups,
 * those with a running delivery under a live lease (read once per claim from
 * "@T_group_running", then a hash: a candidate's own expired lease is not live, so it is not
 * among them): when every group is busy, a claim steps over the whole grouped backlog, and
 * each row costs a probe of that hash. Then, per row of a group that is not busy, its live
 * predecessor in "@T_group", walked down from the candidate: a row waiting behind its head
 * finds it at once, where a walk up from the group's start would step over the index entries
 * its settled predecessors left until vacuum. */
#define UNGROUPED_SETTLE_BEGIN ""
#define UNGROUPED_SETTLE_END ""
/* The settles let the next of each group go (GROUP_NEXT_TRIGGER) in one statement for the
 * batch rather than the trigger's call per row, which the setting relaybus.group_release
 * turns off meanwhile. The rows of the batch that are completed or buried now: their groups,
 * each locked (in one order, so two batches cannot wait for each other's), then the live one
 * of the smallest id of each gets its run_at back when held (= ANY(ARRAY(...)): by the primary
 * key, as the claim's update). (A row whose write was fenced
 * may have been settled by its new holder: letting its group go again changes nothing.) */
/* The groups of the rows of the batch completed or buried now: each locked (in one order, so
 * two batches cannot wait for each other's), and the live one of the smallest id of each. */
#define SETTLED_GROUPS_LOCK \
    "    PERFORM pg_advisory_xact_lock(q.k) FROM (SELECT DISTINCT " GROUP_KEY("d.group_name") \
    " AS k FROM \"@T\" AS d WHERE d.id = ANY(s_id) AND d.group_name IS NOT NULL" \
    " AND d.status IN ('completed', 'buried') ORDER BY 1) AS q;\n"
#define SETTLED_GROUPS_NEXTS \
    "SELECT (SELECT g.id FROM \"@T\" AS g WHERE g.group_name = q.n AND g." LIVE \
    " ORDER BY g.id LIMIT 1) FROM (SELECT DISTINCT d.group_name AS n FROM \"@T\" AS d" \
    " WHERE d.id = ANY(s_id) AND d.group_name IS NOT NULL AND d.status IN ('completed', 'buried'))" \
    " AS q"
#define GROUPED_SETTLE_BEGIN \
    "    PERFORM set_config('relaybus.group_release', 'batch', true);\n"
#define GROUPED_SETTLE_END \
    "    PERFORM set_config('relaybus.group_release', '', true);\n" \
    SETTLED_GROUPS_LOCK \
    "    UPDATE \"@T\" SET run_at = held_run_at, held_run_at = NULL WHERE id = ANY(ARRAY(" \
    SETTLED_GROUPS_NEXTS ")) AND held_run_at IS NOT NULL;\n"
/* Schema 16's claim (HANDED) is GROUPED's, but the nexts its settles release are claimed with
 * no write of their own: HANDED_SETTLE_END only finds them (the live one of the smallest id
 * of each group a settle completed or buried the head of; the group's lock is held, so no
 * enqueue adds a held one behind a head meanwhile), and the claim's candidates (HANDED_CLAIM)
 * are the walk of "@T_due" and those of them that are held, due by their held_run_at, of
 * p_topics (so neither paused nor limited) and free by the group's rule (an operator may
 * have kicked an older one back), ordered together by due time: a group's next goes where
 * its release would have put it, not ahead of older work. The update that claims one gives
 * it its run_at back; those left are released after the claim (HANDED_LIMITS), or at once by
 * a call that does not claim. One row write and one NOTIFY fewer per grouped delivery.
 * (A next is held, run_at 'infinity', so never also in the walk: x.run_at > now() keeps one
 * edited by hand from counting twice. The rows the walk locked and the limit then left out
 * stay locked until the claim commits: claims beside it skip them meanwhile, as they skip
 * any claim's.) */
#define HANDED_SETTLE_BEGIN GROUPED_SETTLE_BEGIN
#define HANDED_SETTLE_END \
    "    PERFORM set_config('relaybus.group_release', '', true);\n" \
    SETTLED_GROUPS_LOCK \
    "    nexts := ARRAY(" SETTLED_GROUPS_NEXTS ");\n" \
    "    IF NOT coalesce(p_limit > 0, false) THEN\n" \
    HANDED_RELEASE \
    "    END IF;\n"
#define HANDED_RELEASE \
    "    IF cardinality(nexts) > 0 THEN\n" \
    "      UPDATE \"@T\" SET run_at = held_run_at, held_run_at = NULL WHERE id = ANY(nexts)" \
    " AND held_run_at IS NOT NULL;\n" \
    "    END IF;\n"
/* (the held ones' status is compared with a variable, so the planner cannot prove the
 * predicate of "@T_due" and walk all of it for their ids: it goes by the primary key) */
#define HANDED_CLAIM CLAIM_ROWS( \
    "WITH w AS (" DUE_WALK("x.id, " DUE " AS due", GROUPED) ")," \
    " h AS (SELECT x.id, x.held_run_at AS due FROM \"@T\" AS x WHERE x.id = ANY(nexts)" \
    "  AND x.status = waiting_status AND x.held_run_at <= now() AND x.run_at > now()" \
    "  AND topic = ANY(p_topics)" GROUPED_FREE \
    "  ORDER BY x.held_run_at, x.id LIMIT p_limit FOR UPDATE SKIP LOCKED)" \
    " SELECT a.id FROM (SELECT * FROM w UNION ALL SELECT * FROM h) AS a" \
    " ORDER BY a.due, a.id LIMIT p_limit", \
    " run_at = CASE WHEN d.id = ANY(nexts) THEN coalesce(d.held_run_at, d.run_at)" \
    "  ELSE d.run_at END," \
    " held_run_at = CASE WHEN d.id = ANY(nexts) THEN NULL ELSE d.held_run_at END,", GROUPED)
#define HANDED_DECL " nexts bigint[] := '{}'; waiting_status constant text := 'pending';\n"
#define HANDED_LIMITS HANDED_RELEASE GROUPED_LIMITS
#define HANDED_FREE GROUPED_FREE
#define HANDED_COLUMN GROUPED_COLUMN
#define HANDED_NULL GROUPED_NULL
#define HANDED_VALUE GROUPED_VALUE
#define UNGROUPED_CLAIM CLAIM_QUERY(UNGROUPED)
#define GROUPED_CLAIM CLAIM_QUERY(GROUPED)
#define UNGROUPED_LIMITS ""
/* Limits per topic (schema 11; LIMITS_DECL, LIMITS_START): the limited topics among those asked
 * for are left out of the claim's first query; then each, in topic order, under its advisory
 * lock (so two claims of one topic count one after the other: the second sees the first's
 * rows running once it got the lock), gets what it may start: its concurrency less those of it
 * running under live leases, its rate less its starts in the window (older ones go), and the
 * claim's query again for it alone, its starts recorded. */
#define GROUPED_LIMITS \
    "  want := p_limit;\n" \
    "  FOREACH lt IN ARRAY limited LOOP\n" \
    "    EXIT WHEN claimed >= want;\n" \
    "    PERFORM pg_advisory_xact_lock(" LIMIT_KEY("lt") ");\n" \
    "    SELECT t.rate_max, t.rate_per, t.running_max INTO lim FROM \"@T_topics\" AS t" \
    " WHERE t.topic = lt;\n" \
    "    allow := want - claimed;\n" \
    "    IF lim.running_max IS NOT NULL THEN\n" \
    "      allow := least(allow, lim.running_max - (SELECT count(*) FROM \"@T\" AS r" \
    " WHERE r.topic = lt AND r.status = 'processing' AND r.lease_expires_at > now()));\n" \
    "    END IF;\n" \
    "    IF lim.rate_max IS NOT NULL THEN\n" \
    "      DELETE FROM \"@T_starts\" AS o WHERE o.topic = lt" \
    " AND o.at <= now() - lim.rate_per * interval '1 second';\n" \
    "      allow := least(allow, lim.rate_max - (SELECT count(*) FROM \"@T_starts\" AS o" \
    " WHERE o.topic = lt));\n" \
    "    END IF;\n" \
    "    CONTINUE WHEN allow IS NULL OR allow <= 0;\n" \
    "    p_topics := ARRAY[lt];\n" \
    "    p_limit := allow;\n" \
    CLAIM_QUERY(GROUPED) \
    "    GET DIAGNOSTICS took = ROW_COUNT;\n" \
    "    claimed := claimed + took;\n" \
    "    IF lim.rate_max IS NOT NULL AND took > 0 THEN\n" \
    "      INSERT INTO \"@T_starts\" (topic, at) SELECT lt, now() FROM generate_series(1, took);\n" \
    "    END IF;\n" \
    "  END LOOP;\n" \
    "  p_limit := want;\n"
#define LIMIT_KEY(T) "(('\"@T\"'::regclass::oid::bigint << 32) | (hashtext('limit ' || " T ")::bigint" \
    " & 4294967295))"
#define LIMITS_DECL " limited text[]; lt text; lim record; allow bigint; want bigint; took bigint;\n"
#define LIMITS_START \
    "  IF p_limit > 0 THEN\n" \
    "    limited := ARRAY(SELECT t.topic FROM \"@T_topics\" AS t WHERE t.topic = ANY(p_topics)" \
    " AND (t.rate_max IS NOT NULL OR t.running_max IS NOT NULL) ORDER BY t.topic);\n" \
    "    IF cardinality(limited) > 0 THEN\n" \
    "      p_topics := ARRAY(SELECT x FROM unnest(p_topics) AS x WHERE x <> ALL(limited));\n" \
    "    END IF;\n" \
    "  END IF;\n"
#define UNGROUPED_COLUMN ""
#define UNGROUPED_NULL ""
#define UNGROUPED_VALUE ""
#define UNGROUPED_FREE ""
#define GROUPED_COLUMN ", c_group text"
#define GROUPED_NULL ", NULL::text"
#define GROUPED_VALUE ", group_name"
#define GROUPED_FREE \
    "  AND (x.group_name IS NULL OR (x.group_name NOT IN (SELECT g.group_name FROM \"@T\" AS g" \
    "   WHERE g.group_name IS NOT NULL AND g.status = 'processing'" \
    "   AND g.lease_expires_at > now())" \
    "   AND (SELECT g.id FROM \"@T\" AS g WHERE g.group_name = x.group_name" \
    "    AND g.status IN ('pending', 'processing') AND g.id < x.id ORDER BY g.id DESC LIMIT 1)" \
    "   IS NULL))"

/* The claim's pause (schema 9): the paused topics among those asked for are left out. */
#define PAUSED_DECL " paused text[];\n"
#define PAUSED_START \
    "  IF p_limit > 0 THEN\n" \
    "    paused := ARRAY(SELECT t.topic FROM \"@T_topics\" t WHERE t.topic = ANY(p_topics)" \
    " AND t.paused_at IS NOT NULL);\n" \
    "    IF cardinality(paused) > 0 THEN\n" \
    "      p_topics := ARRAY(SELECT x FROM unnest(p_topics) AS x WHERE x <> ALL(paused));\n" \
    "    END IF;\n" \
    "  END IF;\n"

/* The three claim functions (of 11, 10 and 9 arguments), dropped where their rows change. */
#define DROP_CLAIM_FUNCTIONS \
    "DROP FUNCTION IF EXISTS \"@T_claim\"(text[], bigint, float8, text, bigint[], text[]," \
    " integer[], float8[], text[], boolean, boolean);\n" \
    "DROP FUNCTION IF EXISTS \"@T_claim\"(text[], bigint, float8, text, bigint[], text[]," \
    " integer[], float8[], text[], boolean);\n" \
    "DROP FUNCTION IF EXISTS \"@T_claim\"(text[], bigint, float8, text, bigint[], text[]," \
    " integer[], float8[], text[]);\n"

/* Schema 11's groups, beside the claim's rule (GROUPED_FREE).
 * Holding: a delivery that store:enqueue adds behind a live one of its group is held, its
 * run_at 'infinity' (out of every claim's walk of "@T_due") and its own in held_run_at, so a
 * claim does not step over a group's whole backlog while its head runs (one that every group
 * is busy would read all of them). When a delivery of a group stops being live (completed,
 * buried, cancelled, deleted, by relaybus or by hand), GROUP_NEXT_TRIGGER (or, for the
 * settles of the claim function, GROUPED_SETTLE_END) lets the group's next one go: the live one of the smallest id, when held, gets its run_at back (a NOTIFY
 * follows, by "@T_sooner"). Holding only spares work: the claim's rule alone keeps a group to
 * one at a time, so a delivery inserted without it (plain SQL, tx:enqueue) only costs claims
 * a look at it.
 * Each side takes the group's transaction-scoped advisory lock (GROUP_KEY: the table's oid and
 * the group's hash; the one-bigint form, apart from the claim slots' two-integer one) before
 * it reads the group, so a hold and the release that must see it cannot miss each other: the
 * release waits for the enqueue's commit, or the enqueue reads the release's. The enqueue only
 * tries the lock (when another holds it, it adds without holding: it never waits, so no cycle
 * of waits can form through it), and only p_hold (store:enqueue, which commits at once) takes
 * it: a user's transaction (tx:enqueue) would keep the group's releases waiting until it ends.
 * (A replace, ENQ_GROUPED, keeps a held delivery held: its new due time goes to held_run_at.) */
#define GROUP_KEY(G) "(('\"@T\"'::regclass::oid::bigint << 32) | (hashtext(" G ")::bigint & 4294967295))"

/* The enqueue of schema 11 ("@T_enqueue"; "@T_enq" of migration 1 stays as it was for the
 * calls of earlier versions and of applications): per item also its group, and with p_hold
 * whether it may be held (above), and p_replace whether a pending delivery of its key gets its
 * payload, run_at (or held_run_at) and max_attempts. Its rows: each item's id, and c_kept,
 * whether a live delivery was found by the key and left as it was (a dedupe, or a replace of
 * one running). A replace locks the row it found (FOR UPDATE): a claim beside it skips the
 * row until the replace commits, or the replace waits for the claim and finds it running. */
#define ENQ_GROUPED \
    "CREATE OR REPLACE FUNCTION \"@T_enqueue\"(p_topic text[], p_payload text[], p_key text[]," \
    " p_run_at float8[], p_delay float8[], p_max integer[], p_group text[], p_hold boolean," \
    " p_replace boolean[]) RETURNS TABLE (c_id bigint, c_kept boolean) LANGUAGE plpgsql AS $f$\n" \
    "DECLARE i integer; nid bigint; pend boolean; locked text[] := '{}'; at timestamptz;" \
    " held boolean;\n" \
    "BEGIN\n" \
    "  IF p_hold THEN\n" \
    "    locked := ARRAY(SELECT g FROM (SELECT DISTINCT g FROM unnest(p_group) AS q(g)" \
    " WHERE g IS NOT NULL) AS d WHERE pg_try_advisory_xact_lock(" GROUP_KEY("g") "));\n" \
    "  END IF;\n" \
    "  IF NOT EXISTS (SELECT 1 FROM unnest(p_key) AS k(v) WHERE v IS NOT NULL) THEN\n" \
    "    RETURN QUERY WITH v AS (\n" \
    "      SELECT u.*, CASE WHEN u.r > 0 THEN to_timestamp(u.r)\n" \
    "             ELSE now() + u.dl * interval '1 second' END AS due,\n" \
    "        u.g = ANY(locked) AND (row_number() OVER (PARTITION BY u.g ORDER BY u.ord) > 1\n" \
    "          OR EXISTS (SELECT 1 FROM \"@T\" AS l WHERE l.group_name = u.g AND l." LIVE "))\n" \
    "          AS held\n" \
    "      FROM unnest(p_topic, p_payload, p_run_at, p_delay, p_max, p_group)\n" \
    "           WITH ORDINALITY AS u(t, p, r, dl, m, g, ord)),\n" \
    "    ins AS (\n" \
    "      INSERT INTO \"@T\" (topic, payload, run_at, max_attempts, group_name, held_run_at)\n" \
    "      SELECT v.t, v.p::jsonb, CASE WHEN v.held THEN 'infinity' ELSE v.due END, v.m, v.g,\n" \
    "             CASE WHEN v.held THEN v.due END\n" \
    "      FROM v ORDER BY v.ord RETURNING id)\n" \
    "    SELECT ins.id, false FROM ins ORDER BY ins.id;\n" \
    "  ELSE\n" \
    "    FOR i IN 1 .. coalesce(array_length(p_topic, 1), 0) LOOP\n" \
    "      at := CASE WHEN p_run_at[i] > 0 THEN to_timestamp(p_run_at[i])\n" \
    "            ELSE now() + p_delay[i] * interval '1 second' END;\n" \
    "      held := p_group[i] = ANY(locked) AND EXISTS (SELECT 1 FROM \"@T\" AS l\n" \
    "              WHERE l.group_name = p_group[i] AND l." LIVE ");\n" \
    "      c_kept := false;\n" \
    "      LOOP\n" \
    "        INSERT INTO \"@T\" (topic, payload, key, run_at, max_attempts, group_name, held_run_at)\n" \
    "        VALUES (p_topic[i], p_payload[i]::jsonb, p_key[i],\n" \
    "                CASE WHEN held THEN 'infinity' ELSE at END, p_max[i], p_group[i],\n" \
    "                CASE WHEN held THEN at END)\n" \
    "        ON CONFLICT (topic, key) WHERE key IS NOT NULL AND " LIVE " DO NOTHING\n" \
    "        RETURNING id INTO nid;\n" \
    "        EXIT WHEN nid IS NOT NULL;\n" \
    "        IF p_replace[i] THEN\n" \
    "          SELECT id, status = 'pending' INTO nid, pend FROM \"@T\"\n" \
    "           WHERE topic = p_topic[i] AND key = p_key[i] AND " LIVE " FOR UPDATE;\n" \
    "        ELSE\n" \
    "          SELECT id, false INTO nid, pend FROM \"@T\"\n" \
    "           WHERE topic = p_topic[i] AND key = p_key[i] AND " LIVE ";\n" \
    "        END IF;\n" \
    "        IF nid IS NOT NULL THEN\n" \
    "          c_kept := NOT pend;\n" \
    "          IF pend THEN\n" \
    "            UPDATE \"@T\" SET payload = p_payload[i]::jsonb, max_attempts = p_max[i],\n" \
    "              attempts = 0,\n" \
    "              run_at = CASE WHEN held_run_at IS NULL THEN at ELSE run_at END,\n" \
    "              held_run_at = CASE WHEN held_run_at IS NULL THEN NULL ELSE at END\n" \
    "             WHERE id = nid;\n" \
    "          END IF;\n" \
    "          EXIT;\n" \
    "        END IF;\n" \
    "      END LOOP;\n" \
    "      c_id := nid;\n" \
    "      RETURN NEXT;\n" \
    "    END LOOP;\n" \
    "  END IF;\n" \
    "  PERFORM pg_notify('@T', '');\n" \
    "END\n" \
    "$f$;\n"

#define GROUP_NEXT_TRIGGER \
    "CREATE OR REPLACE FUNCTION \"@T_group_next\"() RETURNS trigger LANGUAGE plpgsql AS $f$\n" \
    "BEGIN\n" \
    "  PERFORM pg_advisory_xact_lock(" GROUP_KEY("OLD.group_name") ");\n" \
    "  UPDATE \"@T\" SET run_at = held_run_at, held_run_at = NULL\n" \
    "   WHERE id = (SELECT g.id FROM \"@T\" AS g WHERE g.group_name = OLD.group_name\n" \
    "    AND g." LIVE " ORDER BY g.id LIMIT 1) AND held_run_at IS NOT NULL;\n" \
    "  RETURN NULL;\n" \
    "END\n" \
    "$f$;\n" \
    "ALTER FUNCTION \"@T_group_next\"() SET search_path FROM CURRENT;\n" \
    "DROP TRIGGER IF EXISTS \"@T_group_next\" ON \"@T\";\n" \
    "CREATE TRIGGER \"@T_group_next\" AFTER UPDATE OF status ON \"@T\" FOR EACH ROW" \
    " WHEN (OLD.group_name IS NOT NULL AND OLD." LIVE " AND NEW.status NOT IN ('pending'," \
    " 'processing') AND current_setting('relaybus.group_release', true)" \
    " IS DISTINCT FROM 'batch') EXECUTE FUNCTION \"@T_group_next\"();\n" \
    "DROP TRIGGER IF EXISTS \"@T_group_gone\" ON \"@T\";\n" \
    "CREATE TRIGGER \"@T_group_gone\" AFTER DELETE ON \"@T\" FOR EACH ROW" \
    " WHEN (OLD.group_name IS NOT NULL AND OLD." LIVE ") EXECUTE FUNCTION \"@T_group_next\"();\n"

/* Dependencies (schema 13). "@T_depend" gives a delivery just enqueued (p_id) its
 * dependencies: it fails on an id that is no delivery or not one enqueued before it (so no
 * cycle can form), cancels the new one when one was buried or cancelled, and otherwise holds it
 * behind the live ones (run_at 'infinity', its own in held_run_at, `waiting` their count), one
 * row of "@T_deps" each while they are live. The trigger "@T_dep_settled", which only rows
 * marked as dependencies (has_dependents) reach, counts a completed dependency down (the
 * last one gives the delivery its run_at back, and the NOTIFY trigger wakes the dispatchers),
 * or cancels the ones after a buried or cancelled one, which fires it again for the ones after
 * those (after_depth bounds that: RB_AFTER_DEPTH_MAX); it locks them in id order first, so
 * settles of dependencies they share mostly do not deadlock. The enqueue locks no dependency:
 * a user's transaction holding one until its end would stall the settles of another process
 * (and the claims skip a locked row). Instead "@T_dep_check", at the enqueue's commit (a
 * deferred constraint trigger on "@T_deps"), locks each dependency for that moment, which
 * waits for a settle of it in progress, and looks again: a live one is marked, and its settle
 * after the commit finds the row of "@T_deps"; one that completed or failed meanwhile, whose
 * trigger could not see the uncommitted row, is counted there. */
#define DEP_RELEASE(WHERE) \
    "UPDATE \"@T\" SET waiting = waiting - 1," \
    " run_at = CASE WHEN waiting = 1 THEN held_run_at ELSE run_at END," \
    " held_run_at = CASE WHEN waiting = 1 THEN NULL ELSE held_run_at END" \
    " WHERE " WHERE " AND status = 'pending' AND waiting > 0;\n"
#define DEP_CANCEL(WHERE, WHY) \
    "UPDATE \"@T\" SET status = 'cancelled', settled_at = now(), last_error = " WHY "," \
    " waiting = NULL, run_at = coalesce(held_run_at, run_at), held_run_at = NULL" \
    " WHERE " WHERE " AND status = 'pending' AND waiting > 0;\n"
#define DEPS \
    "CREATE OR REPLACE FUNCTION \"@T_depend\"(p_id bigint, p_after bigint[]) RETURNS void" \
    " LANGUAGE plpgsql AS $f$\n" \
    "DECLARE bad bigint; why text; live bigint[]; depth integer;\n" \
    "BEGIN\n" \
    "  IF p_after IS NULL OR cardinality(p_after) = 0 THEN RETURN; END IF;\n" \
    "  SELECT x.dep INTO bad FROM unnest(p_after) AS x(dep)\n" \
    "   WHERE NOT EXISTS (SELECT 1 FROM \"@T\" AS t WHERE t.id = x.dep) LIMIT 1;\n" \
    "  IF bad IS NOT NULL THEN\n" \
    "    RAISE EXCEPTION 'after: no delivery %', bad;\n" \
    "  END IF;\n" \
    "  SELECT x.dep INTO bad FROM unnest(p_after) AS x(dep) WHERE x.dep >= p_id LIMIT 1;\n" \
    "  IF bad IS NOT NULL THEN\n" \
    "    RAISE EXCEPTION 'after: delivery % was not enqueued before this one', bad;\n" \
    "  END IF;\n" \
    "  SELECT 'dependency ' || t.id || ' was ' || t.status INTO why FROM \"@T\" AS t\n" \
    "   WHERE t.id = ANY(p_after) AND t.status IN ('buried', 'cancelled') ORDER BY t.id LIMIT 1;\n" \
    "  IF why IS NOT NULL THEN\n" \
    "    UPDATE \"@T\" SET status = 'cancelled', settled_at = now(), last_error = why" \
    " WHERE id = p_id;\n" \
    "    RETURN;\n" \
    "  END IF;\n" \
    "  SELECT array_agg(DISTINCT t.id), 1 + coalesce(max(t.after_depth), 0) INTO live, depth" \
    " FROM \"@T\" AS t WHERE t.id = ANY(p_after) AND t." LIVE ";\n" \
    "  IF live IS NULL THEN RETURN; END IF;\n" \
    "  IF depth > " RB_TEXT_OF(RB_AFTER_DEPTH_MAX) " THEN\n" \
    "    RAISE EXCEPTION 'after: a chain of more than " RB_TEXT_OF(RB_AFTER_DEPTH_MAX) " dependencies';\n" \
    "  END IF;\n" \
    "  INSERT INTO \"@T_deps\" (id, dep) SELECT p_id, d FROM unnest(live) AS u(d) ORDER BY d;\n" \
    "  UPDATE \"@T\" SET waiting = cardinality(live), held_run_at = run_at," \
    " run_at = 'infinity', after_depth = depth WHERE id = p_id;\n" \
    "END\n" \
    "$f$;\n" \
    "ALTER FUNCTION \"@T_depend\"(bigint, bigint[]) SET search_path FROM CURRENT;\n" \
    "CREATE OR REPLACE FUNCTION \"@T_dep_settled\"() RETURNS trigger LANGUAGE plpgsql AS $f$\n" \
    "BEGIN\n" \
    "  PERFORM 1 FROM \"@T\" WHERE id IN (SELECT d.id FROM \"@T_deps\" AS d" \
    " WHERE d.dep = NEW.id) ORDER BY id FOR NO KEY UPDATE;\n" \
    "  IF NEW.status = 'completed' THEN\n" \
    "    " DEP_RELEASE("id IN (SELECT d.id FROM \"@T_deps\" AS d WHERE d.dep = NEW.id)") \
    "  ELSE\n" \
    "    " DEP_CANCEL("id IN (SELECT d.id FROM \"@T_deps\" AS d WHERE d.dep = NEW.id)", \
                      "'dependency ' || NEW.id || ' was ' || NEW.status") \
    "  END IF;\n" \
    "  DELETE FROM \"@T_deps\" WHERE dep = NEW.id;\n" \
    "  RETURN NULL;\n" \
    "END\n" \
    "$f$;\n" \
    "ALTER FUNCTION \"@T_dep_settled\"() SET search_path FROM CURRENT;\n" \
    "DROP TRIGGER IF EXISTS \"@T_dep_settled\" ON \"@T\";\n" \
    "CREATE TRIGGER \"@T_dep_settled\" AFTER UPDATE OF status ON \"@T\" FOR EACH ROW" \
    " WHEN (OLD.has_dependents AND OLD." LIVE " AND NEW.status IN ('completed', 'buried'," \
    " 'cancelled')) EXECUTE FUNCTION \"@T_dep_settled\"();\n" \
    "CREATE OR REPLACE FUNCTION \"@T_dep_check\"() RETURNS trigger LANGUAGE plpgsql AS $f$\n" \
    "DECLARE st text;\n" \
    "BEGIN\n" \
    "  SELECT status INTO st FROM \"@T\" WHERE id = NEW.dep FOR NO KEY UPDATE;\n" \
    "  IF st IN ('pending', 'processing') THEN\n" \
    "    UPDATE \"@T\" SET has_dependents = true WHERE id = NEW.dep" \
    " AND has_dependents IS NOT TRUE;\n" \
    "  ELSIF st IS NULL OR st = 'completed' THEN\n" \
    "    " DEP_RELEASE("id = NEW.id") \
    "    DELETE FROM \"@T_deps\" WHERE id = NEW.id AND dep = NEW.dep;\n" \
    "  ELSIF st IN ('buried', 'cancelled') THEN\n" \
    "    " DEP_CANCEL("id = NEW.id", "'dependency ' || NEW.dep || ' was ' || st") \
    "    DELETE FROM \"@T_deps\" WHERE id = NEW.id AND dep = NEW.dep;\n" \
    "  END IF;\n" \
    "  RETURN NULL;\n" \
    "END\n" \
    "$f$;\n" \
    "ALTER FUNCTION \"@T_dep_check\"() SET search_path FROM CURRENT;\n" \
    "DROP TRIGGER IF EXISTS \"@T_dep_check\" ON \"@T_deps\";\n" \
    "CREATE CONSTRAINT TRIGGER \"@T_dep_check\" AFTER INSERT ON \"@T_deps\"" \
    " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION \"@T_dep_check\"();\n"

/* The buried and the cancelled per topic (schema 15), kept by triggers in the writes that
 * change them, so stats read a row per topic however many millions of rows are settled.
 * Those writes are rare (a completion, the common write, meets none of the WHEN terms).
 * Each only inserts its change into "@T_count_deltas", which has no key, so no write waits
 * for another there: a count row updated in the trigger would be held to the end of its
 * transaction, and two settles burying in two topics in opposite orders, or one holding a
 * count while it waits for a group's or a limit's lock, would deadlock. Now and then (one
 * change in COUNT_FOLD_EVERY) the writer that gets the table's fold lock without waiting
 * (transaction-scoped, the claim slots' two-integer form with -1 where they have a slot's
 * number) moves the deltas into "@T_counts" in one statement; holding that lock, it is the
 * only writer of either table, so the fold waits for no one. Stats add the deltas to the
 * counts. A TRUNCATE empties both with the table. */
#define COUNT_FOLD_EVERY "1000"
#define COUNTED(ROW) ROW ".status IN ('buried', 'cancelled')"
#define COUNT_DELTA(ROW, SIGN) \
    "    INSERT INTO \"@T_count_deltas\" (topic, buried, cancelled) VALUES (" ROW ".topic," \
    " " SIGN " * (" ROW ".status = 'buried')::integer, " SIGN " * (" ROW ".status = 'cancelled')::integer);\n"
#define COUNTS \
    "CREATE TABLE IF NOT EXISTS \"@T_counts\" (topic text PRIMARY KEY," \
    " buried bigint NOT NULL DEFAULT 0, cancelled bigint NOT NULL DEFAULT 0);\n" \
    "CREATE TABLE IF NOT EXISTS \"@T_count_deltas\" (topic text NOT NULL, buried integer NOT NULL," \
    " cancelled integer NOT NULL);\n" \
    "CREATE OR REPLACE FUNCTION \"@T_tally\"() RETURNS trigger LANGUAGE plpgsql AS $f$\n" \
    "BEGIN\n" \
    "  IF TG_OP = 'TRUNCATE' THEN\n" \
    "    DELETE FROM \"@T_counts\";\n" \
    "    DELETE FROM \"@T_count_deltas\";\n" \
    "    RETURN NULL;\n" \
    "  END IF;\n" \
    "  IF TG_OP <> 'INSERT' AND " COUNTED("OLD") " THEN\n" COUNT_DELTA("OLD", "-1") \
    "  END IF;\n" \
    "  IF TG_OP <> 'DELETE' AND " COUNTED("NEW") " THEN\n" COUNT_DELTA("NEW", "1") \
    "  END IF;\n" \
    "  IF random() * " COUNT_FOLD_EVERY " < 1 AND pg_try_advisory_xact_lock(" \
    "('\"@T\"'::regclass::oid::bigint - 2147483648)::integer, -1) THEN\n" \
    "    WITH d AS (DELETE FROM \"@T_count_deltas\" RETURNING topic, buried, cancelled)\n" \
    "    INSERT INTO \"@T_counts\" AS k (topic, buried, cancelled)" \
    " SELECT topic, sum(buried), sum(cancelled) FROM d GROUP BY topic ORDER BY topic" \
    " ON CONFLICT (topic) DO UPDATE SET buried = k.buried + excluded.buried," \
    " cancelled = k.cancelled + excluded.cancelled;\n" \
    "  END IF;\n" \
    "  RETURN NULL;\n" \
    "END\n" \
    "$f$;\n" \
    "ALTER FUNCTION \"@T_tally\"() SET search_path FROM CURRENT;\n" \
    "DROP TRIGGER IF EXISTS \"@T_tally_insert\" ON \"@T\";\n" \
    "CREATE TRIGGER \"@T_tally_insert\" AFTER INSERT ON \"@T\" FOR EACH ROW" \
    " WHEN (" COUNTED("NEW") ") EXECUTE FUNCTION \"@T_tally\"();\n" \
    "DROP TRIGGER IF EXISTS \"@T_tally_update\" ON \"@T\";\n" \
    "CREATE TRIGGER \"@T_tally_update\" AFTER UPDATE OF status, topic ON \"@T\" FOR EACH ROW" \
    " WHEN ((OLD.status IS DISTINCT FROM NEW.status OR OLD.topic IS DISTINCT FROM NEW.topic)" \
    " AND (" COUNTED("OLD") " OR " COUNTED("NEW") ")) EXECUTE FUNCTION \"@T_tally\"();\n" \
    "DROP TRIGGER IF EXISTS \"@T_tally_delete\" ON \"@T\";\n" \
    "CREATE TRIGGER \"@T_tally_delete\" AFTER DELETE ON \"@T\" FOR EACH ROW" \
    " WHEN (" COUNTED("OLD") ") EXECUTE FUNCTION \"@T_tally\"();\n" \
    "DROP TRIGGER IF EXISTS \"@T_tally_truncate\" ON \"@T\";\n" \
    "CREATE TRIGGER \"@T_tally_truncate\" AFTER TRUNCATE ON \"@T\" FOR EACH STATEMENT" \
    " EXECUTE FUNCTION \"@T_tally\"();\n"
/* The counts now: the folded ones and the deltas since (a few hundred rows, COUNTS above) */
#define COUNTS_NOW \
    "(SELECT topic, sum(buried)::bigint AS buried, sum(cancelled)::bigint AS cancelled FROM" \
    " (SELECT topic, buried, cancelled FROM \"@T_counts\" UNION ALL" \
    "  SELECT topic, buried, cancelled FROM \"@T_count_deltas\") AS u GROUP BY topic)"
/* Migration N brings the schema from version N-1 to N; each is idempotent. */
static const char *const migrations[] = {
    "CREATE TABLE IF NOT EXISTS \"@T\" ("
    " id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,"
    " topic text NOT NULL,"
    " payload jsonb NOT NULL DEFAULT 'null',"
    " key text,"
    " status text NOT NULL DEFAULT 'pending'"
    "  CHECK (status IN ('pending', 'processing', 'completed', 'buried')),"
    " attempts integer NOT NULL DEFAULT 0,"
    " max_attempts integer NOT NULL DEFAULT 25,"
    " fence bigint NOT NULL DEFAULT 0,"
    " run_at timestamptz NOT NULL DEFAULT now(),"
    " created_at timestamptz NOT NULL DEFAULT now(),"
    " lease_token text,"
    " lease_expires_at timestamptz,"
    " settled_at timestamptz,"
    " last_error text);\n"
    "CREATE INDEX IF NOT EXISTS \"@T_due\" ON \"@T\" (" DUE ", id) WHERE " LIVE ";\n"
    "CREATE UNIQUE INDEX IF NOT EXISTS \"@T_dedup\" ON \"@T\" (topic, key)"
    " WHERE key IS NOT NULL AND " LIVE ";\n"
    "CREATE TABLE IF NOT EXISTS \"@T_leases\" ("
    " name text PRIMARY KEY, token text NOT NULL, expires_at timestamptz NOT NULL);\n"
    /* Enqueue as a function: the dedupe retry (a conflicting row may settle between the
     * INSERT and the look-up) needs a loop, and the NOTIFY rides the same commit. Without
     * keys, one INSERT; identity values grow in insertion order, so sorted ids match input.
     * (Made again with groups by 11.) */
    "CREATE OR REPLACE FUNCTION \"@T_enq\"(p_topic text[], p_payload text[], p_key text[],"
    " p_run_at float8[], p_delay float8[], p_max integer[]) RETURNS SETOF bigint"
    " LANGUAGE plpgsql AS $f$\n"
    "DECLARE i integer; nid bigint;\n"
    "BEGIN\n"
    "  IF NOT EXISTS (SELECT 1 FROM unnest(p_key) AS k(v) WHERE v IS NOT NULL) THEN\n"
    "    RETURN QUERY WITH ins AS (\n"
    "      INSERT INTO \"@T\" (topic, payload, run_at, max_attempts)\n"
    "      SELECT u.t, u.p::jsonb, CASE WHEN u.r > 0 THEN to_timestamp(u.r)\n"
    "             ELSE now() + u.dl * interval '1 second' END, u.m\n"
    "      FROM unnest(p_topic, p_payload, p_run_at, p_delay, p_max)\n"
    "           WITH ORDINALITY AS u(t, p, r, dl, m, ord)\n"
    "      ORDER BY u.ord RETURNING id)\n"
    "    SELECT ins.id FROM ins ORDER BY ins.id;\n"
    "  ELSE\n"
    "    FOR i IN 1 .. coalesce(array_length(p_topic, 1), 0) LOOP\n"
    "      LOOP\n"
    "        INSERT INTO \"@T\" (topic, payload, key, run_at, max_attempts)\n"
    "        VALUES (p_topic[i], p_payload[i]::jsonb, p_key[i],\n"
    "                CASE WHEN p_run_at[i] > 0 THEN to_timestamp(p_run_at[i])\n"
    "                ELSE now() + p_delay[i] * interval '1 second' END, p_max[i])\n"
    "        ON CONFLICT (topic, key) WHERE key IS NOT NULL AND " LIVE " DO NOTHING\n"
    "        RETURNING id INTO nid;\n"
    "        EXIT WHEN nid IS NOT NULL;\n"
    "        SELECT id INTO nid FROM \"@T\"\n"
    "         WHERE topic = p_topic[i] AND key = p_key[i] AND " LIVE ";\n"
    "        EXIT WHEN nid IS NOT NULL;\n"
    "      END LOOP;\n"
    "      RETURN NEXT nid;\n"
    "    END LOOP;\n"
    "  END IF;\n"
    "  PERFORM pg_notify('@T', '');\n"
    "END\n"
    "$f$;\n",
    /* 2: any INSERT wakes idle dispatchers, so applications in any language can enqueue with
     * plain SQL in their own transactions (NOTIFY is delivered at commit, once per payload). */
    "CREATE OR REPLACE FUNCTION \"@T_notify\"() RETURNS trigger LANGUAGE plpgsql AS $f$\n"
    "BEGIN PERFORM pg_notify('@T', ''); RETURN NULL; END\n"
    "$f$;\n"
    "DROP TRIGGER IF EXISTS \"@T_notify\" ON \"@T\";\n"
    "CREATE TRIGGER \"@T_notify\" AFTER INSERT ON \"@T\""
    " FOR EACH STATEMENT EXECUTE FUNCTION \"@T_notify\"();\n",
    /* 3: the first claim function, replaced whole by 4 (which creates it where 3 never ran). */
    "SELECT 1;\n",
    /* 4: the claim function's earlier text, replaced whole by 5 (which creates it where 4
     * never ran), and the function for the check for topics nobody handles. */
    "SELECT 1;\n"
    /* The counts per topic of the p_scan earliest due pending deliveries, for the check for
     * topics nobody handles: the ordered walk of "@T_due" that stops at p_scan, under the
     * same settings, so no statistics can turn it into a read of every live row. */
    "CREATE OR REPLACE FUNCTION \"@T_pending_topics\"(p_scan bigint, p_max bigint)"
    " RETURNS TABLE (c_topic text, c_pending bigint) LANGUAGE sql"
    " SET enable_seqscan = off SET enable_sort = off SET enable_bitmapscan = off SET jit = off"
    " AS $f$\n"
    "SELECT p.topic, count(*) FROM (SELECT d.topic FROM \"@T\" AS d WHERE d.status = 'pending'"
    " ORDER BY " DUE ", d.id LIMIT p_scan) AS p GROUP BY p.topic ORDER BY p.topic LIMIT p_max\n"
    "$f$;\n",
    /* 5: the claim function with claim slots, of the arguments of 3 and 4; its text is now
     * part of 7 (which creates it where 5 never ran). */
    "SELECT 1;\n",
    /* 6: the claim function with p_next and the trigger on updates; its text is now part of
     * 7 (which creates them where 6 never ran). */
    "SELECT 1;\n",
    /* 7: the claim as a function, which also applies the settles of the batch before it: one
     * statement, one round trip and one commit for both (the settles first, so a delivery
     * they release can be claimed again at once). Its rows: the settles' results first
     * (c_settled = the write's ordinal, c_lease_expires_at its new expiry; the other columns
     * NULL), then the claimed deliveries (c_settled NULL), then, when p_next is true and it
     * claimed fewer than p_limit, one row with c_settled 0: c_run_at is the seconds until the
     * earliest live delivery of the table falls due (its run_at, or its lease's expiry; NULL
     * when none is live), read from the head of "@T_due"; and when p_tell_wait is true and
     * it got its claim slot only after waiting for it (below), one row with c_settled -1. A dispatcher that
     * hears every insert and every update that makes a delivery due sooner (the triggers of 2
     * and 7, on its LISTEN connection) sleeps until then instead of polling. With p_limit 0 it
     * only settles: ST_SETTLE is this function too, so every fenced write runs under the same
     * plans.
     * The planner settings: plpgsql caches each statement's plan from its first calls, and a
     * table starts empty. A plan made for an empty table (or one whose statistics were taken
     * while few rows were live) scans it whole: a sequential scan to find the claimed or the
     * settled ids, a bitmap scan and a sort of every due row, so a fresh table under load
     * falls behind until autovacuum's first ANALYZE replaces the plans (docs/performance.md,
     * "The claim function's planner settings", has the figures).
     * With sequential scans, bitmap scans and sorts off, the only plans left reach rows by
     * key, however many rows the table holds: the ordered walk of "@T_due" that stops after the
     * limit, the primary key for the ids (see SETTLE for how its statement keeps to it).
     * Nested loops off: the settle's join of n writes to n rows by hash, not n rescans of the
     * writes for each row (n^2). The
     * plans are always the generic ones, so that is true of every call, not only of those
     * after the first five. The sort of the claimed rows stays; its penalty cost would start
     * JIT compilation, hence jit off.
     * Claim slots: at most relaybus.claim_slots claims (default 2; 0 or less: no limit) run at
     * once on the table, from all processes: each holds one of that many transaction-scoped
     * advisory locks (keys: the table's oid, the slot number). Every claim walks the head of
     * "@T_due" and steps over the rows the claims beside it have locked and not committed yet:
     * the more claims at once, the more index entries each reads per row it claims, and the
     * server's CPU per delivery grows (docs/performance.md, "Claim slots"). The slot comes first, before the settles, so a claim waiting for
     * one holds no row (a keyed enqueue or a bury of a delivery it settles would wait behind
     * it). With every slot taken it waits on one, at most a second (or the session's own
     * lock_timeout), then claims without one: a slot held by a stuck or foreign session slows
     * claims, never stops them. A claim waiting for a slot holds its statement's snapshot, and
     * with it the old row versions at the head of "@T_due" that every claim steps over: a claim that waited and got a slot
     * (the claims beside it are many, not stuck) returns a row of c_settled -1, which tells
     * the dispatcher to keep one claim in flight instead of two for a while
     * (dispatcher_claim.c). One that gave up waiting says nothing: behind a stuck holder a
     * single claim in flight would only halve what still gets claimed.
     * The setting is parsed strictly (ASCII digits, spaces around): anything else counts as
     * the default, so no value can make the cast fail every claim. */
    /* (a table made again after it was dropped by hand finds the functions of its last
     * version, whose rows may differ: CREATE OR REPLACE cannot change them) */
    DROP_CLAIM_FUNCTIONS
    CLAIM_FUNCTION("", "", "", UNGROUPED)
    /* The arguments of 6 (p_next, no p_tell_wait) and of 3 to 5, which an older relaybus
     * calls: the same function, without the rows they do not know. */
    "CREATE OR REPLACE FUNCTION \"@T_claim\"(p_topics text[], p_limit bigint, p_lease float8,"
    " p_token text, s_id bigint[], s_token text[], s_kind integer[], s_delay float8[],"
    " s_error text[], p_next boolean) RETURNS TABLE (c_id text, c_topic text, c_payload text,"
    " c_key text, c_last_error text, c_lease_token text, c_status text, c_attempts integer,"
    " c_max_attempts integer, c_fence bigint, c_run_at float8, c_created_at float8,"
    " c_lease_expires_at float8, c_settled integer) LANGUAGE sql AS $f$\n"
    "SELECT * FROM \"@T_claim\"(p_topics, p_limit, p_lease, p_token, s_id, s_token, s_kind,"
    " s_delay, s_error, p_next, false)\n"
    "$f$;\n"
    "CREATE OR REPLACE FUNCTION \"@T_claim\"(p_topics text[], p_limit bigint, p_lease float8,"
    " p_token text, s_id bigint[], s_token text[], s_kind integer[], s_delay float8[],"
    " s_error text[]) RETURNS TABLE (c_id text, c_topic text, c_payload text, c_key text,"
    " c_last_error text, c_lease_token text, c_status text, c_attempts integer,"
    " c_max_attempts integer, c_fence bigint, c_run_at float8, c_created_at float8,"
    " c_lease_expires_at float8, c_settled integer) LANGUAGE sql AS $f$\n"
    "SELECT * FROM \"@T_claim\"(p_topics, p_limit, p_lease, p_token, s_id, s_token, s_kind,"
    " s_delay, s_error, false, false)\n"
    "$f$;\n"
    /* An update that makes a delivery due sooner wakes idle dispatchers as an insert does
     * (the trigger of 2): a settle that hands a delivery back or schedules its retry, a kick,
     * an UPDATE by hand. Claims and completions leave the row not pending: no call. Made
     * only where missing (a table of 6 has it): dropping it would lock the table against
     * every claim and settle until the migration commits. (Table names are letters, digits
     * and _, so they are safe inside the literals.) */
    "DO $d$ BEGIN\n"
    "  IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = '\"@T\"'::regclass"
    " AND tgname = '@T_sooner') THEN\n"
    "    CREATE TRIGGER \"@T_sooner\" AFTER UPDATE ON \"@T\" FOR EACH ROW"
    " WHEN (NEW.status = 'pending' AND (OLD.status <> 'pending' OR NEW.run_at < OLD.run_at))"
    " EXECUTE FUNCTION \"@T_notify\"();\n"
    "  END IF;\n"
    "END $d$;\n"
    /* Every claim and every completion leaves a dead entry at the head of "@T_due", and only
     * VACUUM removes them; each claim and each next-due read walks over them first
     * (docs/performance.md, "The deliveries table's autovacuum settings"). Autovacuum's
     * default waits for dead rows of a fifth of the table, and since PostgreSQL 14 skips the indexes when
     * few pages hold dead rows: so a fixed threshold, and the indexes always vacuumed. */
    "ALTER TABLE \"@T\" SET (autovacuum_vacuum_scale_factor = 0,"
    " autovacuum_vacuum_threshold = 10000, vacuum_index_cleanup = true);\n",
    /* 8: the functions find the table whatever search_path their caller set: a user's
     * transaction may SET it before tx:enqueue or before the completion commits with it.
     * (The search_path of the migration, which found the table. A later migration that
     * replaces one of these functions must say SET search_path FROM CURRENT again.) */
    "ALTER FUNCTION \"@T_enq\"(text[], text[], text[], float8[], float8[], integer[])"
    " SET search_path FROM CURRENT;\n"
    "ALTER FUNCTION \"@T_claim\"(text[], bigint, float8, text, bigint[], text[], integer[],"
    " float8[], text[], boolean, boolean) SET search_path FROM CURRENT;\n"
    "ALTER FUNCTION \"@T_claim\"(text[], bigint, float8, text, bigint[], text[], integer[],"
    " float8[], text[], boolean) SET search_path FROM CURRENT;\n"
    "ALTER FUNCTION \"@T_claim\"(text[], bigint, float8, text, bigint[], text[], integer[],"
    " float8[], text[]) SET search_path FROM CURRENT;\n"
    "ALTER FUNCTION \"@T_pending_topics\"(bigint, bigint) SET search_path FROM CURRENT;\n",
    /* 9: what operators set per topic, for every process on the table: a pause. The claim
     * (the one function that every relaybus's claims and settles reach) takes nothing of a
     * paused topic: it claims from the others alone. */
    "CREATE TABLE IF NOT EXISTS \"@T_topics\" (topic text PRIMARY KEY, paused_at timestamptz);\n"
    CLAIM_FUNCTION(PAUSED_DECL, PAUSED_START, "", UNGROUPED)
    "ALTER FUNCTION \"@T_claim\"(text[], bigint, float8, text, bigint[], text[], integer[],"
    " float8[], text[], boolean, boolean) SET search_path FROM CURRENT;\n",
    /* 10: the status cancelled. The CHECK that allows it replaces the one of four statuses
     * that migration 1 wrote (a CHECK of the user's is left alone); NOT VALID: every row meets
     * the old one, so it meets this one, without a scan. Dropping the old one and adding the
     * columns take the table's ACCESS EXCLUSIVE lock for a moment, once: waited for 10 s at
     * most (behind a long transaction every claim would queue behind the wait), then the open
     * fails and may be tried again. */
    "SET LOCAL lock_timeout = '10s';\n"
    "DO $m$\n"
    "DECLARE c record;\n"
    "BEGIN\n"
    "  FOR c IN SELECT conname FROM pg_constraint WHERE conrelid = '\"@T\"'::regclass"
    "   AND contype = 'c' AND pg_get_constraintdef(oid) LIKE '%(status = ANY (ARRAY[''pending''::text,"
    " ''processing''::text, ''completed''::text, ''buried''::text]))%' LOOP\n"
    "    EXECUTE format('ALTER TABLE %s DROP CONSTRAINT %I', '\"@T\"'::regclass, c.conname);\n"
    "  END LOOP;\n"
    "  IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = '\"@T\"'::regclass"
    "   AND contype = 'c' AND pg_get_constraintdef(oid) LIKE '%cancelled%') THEN\n"
    "    ALTER TABLE \"@T\" ADD CHECK (status IN ('pending', 'processing', 'completed',"
    " 'buried', 'cancelled')) NOT VALID;\n"
    "  END IF;\n"
    "END\n"
    "$m$;\n"
    /* ... a run's progress and the last attempts' errors, which the claim function's
     * settles now keep */
    "ALTER TABLE \"@T\" ADD COLUMN IF NOT EXISTS progress jsonb,"
    " ADD COLUMN IF NOT EXISTS errors jsonb;\n"
    CLAIM_FUNCTION(PAUSED_DECL, PAUSED_START, ERRORS_ADD, UNGROUPED)
    "ALTER FUNCTION \"@T_claim\"(text[], bigint, float8, text, bigint[], text[], integer[],"
    " float8[], text[], boolean, boolean) SET search_path FROM CURRENT;\n",
    /* 11: ordered groups. The column (a moment of the table's lock, waited for 10 s at most as
     * in 10) and the indexes of each group's live deliveries by id and of its running ones,
     * which the claim reads; the
     * claim function with the group's rule and the group in its rows, after c_settled (a
     * relaybus of schema 10 still reads the first 14); its two shorter forms with it; the
     * enqueue with the groups (p_group last, so the calls without it stay as they were).
     * Building the index scans the table once, holding off writes meanwhile. */
    "SET LOCAL lock_timeout = '10s';\n"
    "ALTER TABLE \"@T\" ADD COLUMN IF NOT EXISTS group_name text,"
    " ADD COLUMN IF NOT EXISTS held_run_at timestamptz;\n"
    "CREATE INDEX IF NOT EXISTS \"@T_group\" ON \"@T\" (group_name, id)"
    " WHERE group_name IS NOT NULL AND " LIVE ";\n"
    "CREATE INDEX IF NOT EXISTS \"@T_group_running\" ON \"@T\" (group_name)"
    " WHERE group_name IS NOT NULL AND status = 'processing';\n"
    /* limits per topic: theirs in "@T_topics", the starts of a rate's window, a topic's running
     * ones by an index of their own */
    "ALTER TABLE \"@T_topics\" ADD COLUMN IF NOT EXISTS rate_max bigint,"
    " ADD COLUMN IF NOT EXISTS rate_per float8, ADD COLUMN IF NOT EXISTS running_max bigint;\n"
    "CREATE TABLE IF NOT EXISTS \"@T_starts\" (topic text NOT NULL, at timestamptz NOT NULL);\n"
    "CREATE INDEX IF NOT EXISTS \"@T_starts_at\" ON \"@T_starts\" (topic, at);\n"
    "CREATE INDEX IF NOT EXISTS \"@T_running\" ON \"@T\" (topic) WHERE status = 'processing';\n"
    DROP_CLAIM_FUNCTIONS
    CLAIM_FUNCTION(PAUSED_DECL LIMITS_DECL, PAUSED_START LIMITS_START, ERRORS_ADD, GROUPED)
    "CREATE FUNCTION \"@T_claim\"(p_topics text[], p_limit bigint, p_lease float8,"
    " p_token text, s_id bigint[], s_token text[], s_kind integer[], s_delay float8[],"
    " s_error text[], p_next boolean) " CLAIM_RETURNS(GROUPED_COLUMN) " LANGUAGE sql AS $f$\n"
    "SELECT * FROM \"@T_claim\"(p_topics, p_limit, p_lease, p_token, s_id, s_token, s_kind,"
    " s_delay, s_error, p_next, false)\n"
    "$f$;\n"
    "CREATE FUNCTION \"@T_claim\"(p_topics text[], p_limit bigint, p_lease float8,"
    " p_token text, s_id bigint[], s_token text[], s_kind integer[], s_delay float8[],"
    " s_error text[]) " CLAIM_RETURNS(GROUPED_COLUMN) " LANGUAGE sql AS $f$\n"
    "SELECT * FROM \"@T_claim\"(p_topics, p_limit, p_lease, p_token, s_id, s_token, s_kind,"
    " s_delay, s_error, false, false)\n"
    "$f$;\n"
    ENQ_GROUPED
    "ALTER FUNCTION \"@T_enqueue\"(text[], text[], text[], float8[], float8[], integer[], text[],"
    " boolean, boolean[]) SET search_path FROM CURRENT;\n"
    GROUP_NEXT_TRIGGER
    "ALTER FUNCTION \"@T_claim\"(text[], bigint, float8, text, bigint[], text[], integer[],"
    " float8[], text[], boolean, boolean) SET search_path FROM CURRENT;\n"
    "ALTER FUNCTION \"@T_claim\"(text[], bigint, float8, text, bigint[], text[], integer[],"
    " float8[], text[], boolean) SET search_path FROM CURRENT;\n"
    "ALTER FUNCTION \"@T_claim\"(text[], bigint, float8, text, bigint[], text[], integer[],"
    " float8[], text[]) SET search_path FROM CURRENT;\n",
    /* 12: durable schedules (epoch s in next_at and fired_at, compared exactly by the fire) */
    "CREATE TABLE IF NOT EXISTS \"@T_schedules\" (name text PRIMARY KEY, topic text NOT NULL,"
    " payload text NOT NULL, cron text, every float8, timezone text, next_at float8 NOT NULL,"
    " fired_at float8, created_at timestamptz NOT NULL DEFAULT now());\n",
    /* 13: dependencies (DEPS above); the columns wait for the table's lock as in 10 */
    "SET LOCAL lock_timeout = '10s';\n"
    "ALTER TABLE \"@T\" ADD COLUMN IF NOT EXISTS waiting integer,"
    " ADD COLUMN IF NOT EXISTS has_dependents boolean, ADD COLUMN IF NOT EXISTS after_depth integer;\n"
    "CREATE TABLE IF NOT EXISTS \"@T_deps\" (id bigint NOT NULL, dep bigint NOT NULL);\n"
    "CREATE INDEX IF NOT EXISTS \"@T_deps_dep\" ON \"@T_deps\" (dep);\n"
    DEPS,
    /* 14: the buried and the cancelled ones by topic and id: stats count them, and lists and
     * the dashboard page through them, without reading the completed rows (millions of them
     * before the retention deletes them). Building them reads the table once. */
    "CREATE INDEX IF NOT EXISTS \"@T_buried\" ON \"@T\" (topic, id) WHERE status = 'buried';\n"
    "CREATE INDEX IF NOT EXISTS \"@T_cancelled\" ON \"@T\" (topic, id) WHERE status = 'cancelled';\n",
    /* 15: the buried and the cancelled per topic, kept (COUNTS above); the triggers wait for
     * the table's lock as in 10, and that lock keeps every writer out until the fill commits */
    "SET LOCAL lock_timeout = '10s';\n"
    COUNTS
    "DELETE FROM \"@T_counts\";\n"
    "DELETE FROM \"@T_count_deltas\";\n"
    "INSERT INTO \"@T_counts\" (topic, buried, cancelled) SELECT topic,"
    " count(*) FILTER (WHERE status = 'buried'), count(*) FILTER (WHERE status = 'cancelled')"
    " FROM \"@T\" WHERE status IN ('buried', 'cancelled') GROUP BY topic;\n",
    /* 16: the claim hands a group on (HANDED above); its rows are those of 11 */
    CLAIM_FUNCTION(PAUSED_DECL LIMITS_DECL HANDED_DECL, PAUSED_START LIMITS_START, ERRORS_ADD,
                   HANDED)
    "ALTER FUNCTION \"@T_claim\"(text[], bigint, float8, text, bigint[], text[], integer[],"
    " float8[], text[], boolean, boolean) SET search_path FROM CURRENT;\n",
};
#define PG_SCHEMA_VERSION ((int)(sizeof migrations / sizeof migrations[0]))

/* Statements prepared once per connection. */
const char *const rb_pg_stmt_names[ST_COUNT] = {
    "rb_enq", "rb_claim", "rb_settle", "rb_get", "rb_lacq", "rb_lext", "rb_lrel", "rb_enq_after"};
const char *const rb_pg_stmt_templates[ST_COUNT] = {
    [ST_ENQ] = "SELECT c_id::text, c_kept FROM \"@T_enqueue\"($1::text[], $2::text[], $3::text[],"
               " $4::float8[], $5::float8[], $6::integer[], $7::text[], $8::boolean, $9::boolean[])",
    /* ST_ENQ with dependencies ($10: per item its ids joined by commas, or NULL), given to
     * each delivery the enqueue made (not to one a key found) */
    [ST_ENQ_AFTER] = "SELECT e.c_id::text, e.c_kept FROM \"@T_enqueue\"($1::text[], $2::text[],"
               " $3::text[], $4::float8[], $5::float8[], $6::integer[], $7::text[], $8::boolean,"
               " $9::boolean[]) WITH ORDINALITY AS e(c_id, c_kept, ord)"
               " LEFT JOIN LATERAL (SELECT \"@T_depend\"(e.c_id,"
               "  string_to_array(($10::text[])[e.ord], ',')::bigint[])"
               "  WHERE NOT e.c_kept AND ($10::text[])[e.ord] IS NOT NULL) AS dep ON true"
               " ORDER BY e.ord",
    [ST_CLAIM] = "SELECT * FROM \"@T_claim\"($1::text[], $2::bigint, $3::float8, $4::text,"
                 " $5::bigint[], $6::text[], $7::integer[], $8::float8[], $9::text[], true, true)",
    [ST_SETTLE] = "SELECT c_settled, c_lease_expires_at FROM \"@T_claim\"(NULL::text[], 0::bigint,"
                  " 0::float8, NULL::text, $1::bigint[], $2::text[], $3::integer[], $4::float8[],"
                  " $5::text[], false, false)",
    [ST_GET] = "SELECT " RECORD_COLS " FROM \"@T\" WHERE id = $1::bigint",
    [ST_LACQ] =
        "INSERT INTO \"@T_leases\" AS l (name, token, expires_at)"
        " VALUES ($1::text, $2::text, now() + $3::float8 * interval '1 second')"
        " ON CONFLICT (name) DO UPDATE SET token = excluded.token, expires_at = excluded.expires_at"
        " WHERE l.expires_at <= now() OR l.token = excluded.token"
        " RETURNING date_part('epoch', l.expires_at)",
    [ST_LEXT] =
        "UPDATE \"@T_leases\" SET expires_at = greatest(expires_at, now() + $3::float8 * interval '1 second')"
        " WHERE name = $1::text AND token = $2::text AND expires_at > now()"
        " RETURNING date_part('epoch', expires_at)",
    [ST_LREL] = "DELETE FROM \"@T_leases\" WHERE name = $1::text AND token = $2::text RETURNING 0",
};

/* The filters of a list: $1 status, $2 topic, $5 key, $6 a topic's prefix, $7 a text in
 * last_error (NULL: any); $3 the limit, $4 the last id of the page before. */
#define LIST_FILTERS "($1::text IS NULL OR status = $1::text)" \
    " AND ($2::text IS NULL OR topic = $2::text) AND ($5::text IS NULL OR key = $5::text)" \
    " AND ($6::text IS NULL OR starts_with(topic, $6::text))" \
    " AND ($7::text IS NULL OR strpos(last_error, $7::text) > 0)"
const char rb_pg_sql_list[] =
    "SELECT " RECORD_COLS " FROM \"@T\" WHERE " LIST_FILTERS
    " AND ($4::bigint IS NULL OR id > $4::bigint) ORDER BY id LIMIT $3::bigint";
const char rb_pg_sql_list_page[] =
    "SELECT " RECORD_COLS " FROM \"@T\" WHERE " LIST_FILTERS
    " AND ($4::bigint IS NULL OR id < $4::bigint) ORDER BY id DESC LIMIT $3::bigint";
/* A running delivery's lease loses its token (the run's later writes are refused) and keeps
 * its expiry, which a kick makes it due no earlier than (rb_pg_sql_kick); so does a pending
 * one that a kick left waiting for it. */
const char rb_pg_sql_bury_one[] =
    "UPDATE \"@T\" SET status = 'buried', settled_at = now(), last_error = $2::text,"
    " lease_token = NULL"
    " WHERE id = $1::bigint AND status IN ('pending','processing')";
/* A run's progress ($3, JSON), fenced as a settle */
const char rb_pg_sql_progress[] =
    "UPDATE \"@T\" SET progress = $3::jsonb WHERE id = $1::bigint AND status = 'processing'"
    " AND lease_token = $2::text";
const char rb_pg_sql_delete_one[] =
    "DELETE FROM \"@T\" WHERE id = $1::bigint AND status IN ('completed','buried','cancelled')";
/* As bury_one, to cancelled; the run it took the lease of ($1 the id, tok its token) is told
 * to every process by NOTIFY on $3 (the table's name: the dispatchers' channel). */
const char rb_pg_sql_cancel_one[] =
    "WITH old AS (SELECT id, status AS was, lease_token AS tok FROM \"@T\""
    "  WHERE id = $1::bigint AND status IN ('pending','processing') FOR UPDATE),"
    " upd AS (UPDATE \"@T\" AS d SET status = 'cancelled', settled_at = now(),"
    "  last_error = $2::text, lease_token = NULL FROM old WHERE d.id = old.id"
    "  RETURNING d.id, CASE WHEN old.was = 'processing' THEN old.tok END AS tok)"
    " SELECT id::text, tok, CASE WHEN tok IS NOT NULL"
    "  THEN pg_notify($3::text, 'cancel ' || id || ' ' || tok) END FROM upd";
/* As cancel_one, for every live delivery of status $1 (NULL: both) and topic $2 (NULL: any),
 * last_error $3, $4 the channel; locked in id order, running ones' leases told by NOTIFY. */
const char rb_pg_sql_cancel_all[] =
    "WITH old AS (SELECT id, status AS was, lease_token AS tok FROM \"@T\""
    "  WHERE " LIVE " AND ($1::text IS NULL OR status = $1::text)"
    "  AND ($2::text IS NULL OR topic = $2::text) ORDER BY id FOR UPDATE),"
    " upd AS (UPDATE \"@T\" AS d SET status = 'cancelled', settled_at = now(),"
    "  last_error = $3::text, lease_token = NULL FROM old WHERE d.id = old.id"
    "  RETURNING d.id, CASE WHEN old.was = 'processing' THEN old.tok END AS tok)"
    " SELECT id::text, tok, CASE WHEN tok IS NOT NULL"
    "  THEN pg_notify($4::text, 'cancel ' || id || ' ' || tok) END FROM upd";
/* Stats that stay quick however many rows are settled: the live ones through "@T_due", the
 * buried and the cancelled from "@T_counts" (schema 15), and the completed counted only
 * in a table of fewer than ESTIMATE_ABOVE rows; in a larger one they are the planner's estimate
 * of the table's rows (pg_class, scaled to its size now, as the planner does) less the others,
 * and the last column says so. */
#define ESTIMATE_ABOVE "100000"
#define TABLE_ROWS_ESTIMATE \
    "(SELECT CASE WHEN c.reltuples < 0 OR c.relpages = 0 THEN NULL ELSE c.reltuples / c.relpages" \
    " * (pg_relation_size(c.oid) / current_setting('block_size')::float8) END FROM pg_class AS c" \
    " WHERE c.oid = (SELECT tableoid FROM \"@T\" LIMIT 1))"
/* Whether the table is large: the per-topic stats (below) are two statements, chosen by this
 * one: one with both forms behind a one-time filter still started parallel workers for the
 * count it never ran. */
const char rb_pg_sql_table_large[] =
    "SELECT coalesce(" TABLE_ROWS_ESTIMATE " > " ESTIMATE_ABOVE ", false)";
/* Per topic: the live ones through "@T_due", the buried and the cancelled from "@T_counts",
 * and the completed counted in a small table (rb_pg_sql_topic_stats) and left out (NULL) in a
 * large one (rb_pg_sql_topic_stats_large). */
#define TOPIC_STATS(D, D_TOPICS, D_COUNT, D_JOIN) \
    "WITH live AS (SELECT topic, count(*) FILTER (WHERE status = 'pending') AS p," \
    "  count(*) FILTER (WHERE status = 'processing') AS r," \
    "  greatest(0, coalesce(date_part('epoch', now() - min(run_at) FILTER (WHERE status = 'pending'" \
    "   AND run_at <= now())), 0))::float8 AS age FROM \"@T\" WHERE " LIVE " GROUP BY topic)," \
    " k AS (SELECT topic, buried, cancelled FROM " COUNTS_NOW " AS n WHERE buried <> 0 OR cancelled <> 0)" \
    D "," \
    " t AS (SELECT topic FROM live UNION SELECT topic FROM k" D_TOPICS ")" \
    " SELECT t.topic, coalesce(live.p, 0) AS pending, coalesce(live.r, 0) AS processing," \
    " " D_COUNT " AS completed, coalesce(k.buried, 0) AS buried, coalesce(k.cancelled, 0) AS cancelled," \
    " coalesce(live.age, 0) AS oldest_due_age FROM t LEFT JOIN live USING (topic)" \
    " LEFT JOIN k USING (topic)" D_JOIN " ORDER BY t.topic LIMIT $1::bigint"
const char rb_pg_sql_topic_stats[] = TOPIC_STATS(
    ", d AS (SELECT topic, count(*) AS n FROM \"@T\" WHERE status = 'completed' GROUP BY topic)",
    " UNION SELECT topic FROM d", "coalesce(d.n, 0)", " LEFT JOIN d USING (topic)");
const char rb_pg_sql_topic_stats_large[] = TOPIC_STATS("", "", "NULL::bigint", "");
/* $1 the topic; a row only when the state changes. A resume wakes idle dispatchers ($2 the
 * channel, the table's name): the topic's deliveries may be due. */
const char rb_pg_sql_pause[] =
    "INSERT INTO \"@T_topics\" AS t (topic, paused_at) VALUES ($1::text, now())"
    " ON CONFLICT (topic) DO UPDATE SET paused_at = excluded.paused_at WHERE t.paused_at IS NULL";
const char rb_pg_sql_resume[] =
    "WITH u AS (UPDATE \"@T_topics\" SET paused_at = NULL WHERE topic = $1::text"
    " AND paused_at IS NOT NULL RETURNING topic) SELECT pg_notify($2::text, '') FROM u";
/* A topic's limits (schema 11): $1 the topic, $2 rate, $3 per, $4 concurrency (NULL: off);
 * a limit set or cleared wakes idle dispatchers ($5 the channel): more may start now. */
const char rb_pg_sql_limit_set[] =
    "WITH u AS (INSERT INTO \"@T_topics\" AS t (topic, rate_max, rate_per, running_max)"
    " VALUES ($1::text, $2::bigint, $3::float8, $4::bigint) ON CONFLICT (topic) DO UPDATE"
    " SET rate_max = excluded.rate_max, rate_per = excluded.rate_per,"
    " running_max = excluded.running_max RETURNING t.topic)"
    " SELECT pg_notify($5::text, '') FROM u";
const char rb_pg_sql_limit_clear[] =
    "WITH u AS (UPDATE \"@T_topics\" SET rate_max = NULL, rate_per = NULL, running_max = NULL"
    " WHERE topic = $1::text RETURNING topic) SELECT pg_notify($2::text, '') FROM u";
/* Schedules (schema 12): $1 the name; set $2 topic, $3 payload (through jsonb, as a delivery
 * keeps it: one jsonb cannot hold is refused now, not at every tick), $4 cron, $5 every, $6
 * timezone, $7 next_at (kept when the timing is the same); its row says whether it was made. */
const char rb_pg_sql_schedule_set[] =
    "WITH u AS (INSERT INTO \"@T_schedules\" AS s (name, topic, payload, cron, every, timezone, next_at)"
    " VALUES ($1::text, $2::text, ($3::jsonb)::text, $4::text, $5::float8, $6::text, $7::float8)"
    " ON CONFLICT (name) DO UPDATE SET topic = excluded.topic, payload = excluded.payload,"
    " next_at = CASE WHEN s.cron IS NOT DISTINCT FROM excluded.cron"
    "  AND s.every IS NOT DISTINCT FROM excluded.every"
    "  AND s.timezone IS NOT DISTINCT FROM excluded.timezone THEN s.next_at"
    "  ELSE excluded.next_at END,"
    " cron = excluded.cron, every = excluded.every, timezone = excluded.timezone"
    " RETURNING (s.xmax = 0)::int AS made)"
    " SELECT made, pg_notify($8::text, 'schedules') FROM u";
/* ... and every process's dispatchers hear of a change ($8, $2: the channel) */
const char rb_pg_sql_unschedule[] =
    "WITH d AS (DELETE FROM \"@T_schedules\" WHERE name = $1::text RETURNING 1)"
    " SELECT pg_notify($2::text, 'schedules') FROM d";
const char rb_pg_sql_schedules[] =
    "SELECT name, topic, payload, cron, every, timezone, next_at, fired_at"
    " FROM \"@T_schedules\" ORDER BY name LIMIT $1::bigint";
/* A tick ($2 its due time) moves next_at on ($3) while no other process has, and its
 * delivery ($4 topic, $5 payload, $6 key, $7 max_attempts) is enqueued in the same statement:
 * LATERAL, so the enqueue runs once per row the update changed, and never without one. */
const char rb_pg_sql_schedule_fire[] =
    "WITH f AS (UPDATE \"@T_schedules\" SET next_at = $3::float8,"
    "  fired_at = date_part('epoch', now()) WHERE name = $1::text AND next_at = $2::float8"
    "  AND topic = $4::text AND payload = $5::text RETURNING topic, payload)"
    " SELECT e.c_id::text FROM f CROSS JOIN LATERAL \"@T_enqueue\"(ARRAY[f.topic],"
    " ARRAY[f.payload], ARRAY[$6::text], ARRAY[$2::float8], ARRAY[0::float8],"
    " ARRAY[$7::integer], ARRAY[NULL::text], false, ARRAY[false]) AS e";
const char rb_pg_sql_limits[] =
    "SELECT topic, rate_max AS rate, rate_per AS per, running_max AS concurrency"
    " FROM \"@T_topics\" WHERE rate_max IS NOT NULL OR running_max IS NOT NULL"
    " ORDER BY topic LIMIT $1::bigint";
const char rb_pg_sql_paused[] =
    "SELECT topic, date_part('epoch', paused_at) AS paused_at FROM \"@T_topics\""
    " WHERE paused_at IS NOT NULL ORDER BY topic LIMIT $1::bigint";
const char rb_pg_sql_pending_topics[] =
    "SELECT c_topic AS topic, c_pending AS pending FROM \"@T_pending_topics\"($1::bigint, $2::bigint)";
const char rb_pg_sql_stats[] =
    "WITH live AS (SELECT count(*) FILTER (WHERE status = 'pending') AS p,"
    "  count(*) FILTER (WHERE status = 'processing') AS r,"
    "  count(*) FILTER (WHERE " DUE " <= now()) AS due,"
    "  coalesce(extract(epoch FROM now() - min(" DUE ") FILTER (WHERE " DUE " <= now()))::float8, 0)"
    "   AS age,"
    "  count(*) FILTER (WHERE status = 'processing' AND coalesce(lease_expires_at <= now(), true))"
    "   AS stalled FROM \"@T\" WHERE " LIVE "),"
    " b AS (SELECT coalesce(sum(buried), 0)::bigint AS n FROM " COUNTS_NOW " AS k),"
    " c AS (SELECT coalesce(sum(cancelled), 0)::bigint AS n FROM " COUNTS_NOW " AS k),"
    " est AS (SELECT " TABLE_ROWS_ESTIMATE " AS n)"
    " SELECT live.p, live.r, CASE WHEN est.n > " ESTIMATE_ABOVE
    "  THEN greatest(0, round(est.n)::bigint - live.p - live.r - b.n - c.n)"
    "  ELSE (SELECT count(*) FROM \"@T\" WHERE status = 'completed') END,"
    " b.n, c.n, live.due, live.age, live.stalled, coalesce(est.n > " ESTIMATE_ABOVE ", false)"
    " FROM live, b, c, est";
/* A buried row whose topic and key are live again stays buried (the dedupe index forbids two
 * live ones); of several buried twins only the newest comes back. Due now, or, when an
 * operator buried it while it ran, when that run's lease ends: the run never outlives it.
 * The lease stays on the pending row until then, so a bury and kick again keep the wait. */
const char rb_pg_sql_kick[] =
    "UPDATE \"@T\" AS d SET status = 'pending', attempts = 0, held_run_at = NULL, waiting = NULL,"
    " run_at = greatest(now(), coalesce(d.lease_expires_at, now())), settled_at = NULL,"
    " lease_token = NULL,"
    " lease_expires_at = CASE WHEN d.lease_expires_at > now() THEN d.lease_expires_at END"
    " WHERE (d.status = 'buried' OR ($1::bigint IS NOT NULL AND d.status = 'cancelled'))"
    " AND ($1::bigint IS NULL OR d.id = $1::bigint) AND ($2::text IS NULL OR d.topic = $2::text)"
    " AND (d.key IS NULL OR ("
    "  NOT EXISTS (SELECT 1 FROM \"@T\" o WHERE o.topic = d.topic AND o.key = d.key AND o." LIVE ")"
    "  AND d.id = (SELECT max(b.id) FROM \"@T\" b WHERE b.topic = d.topic AND b.key = d.key"
    "   AND b.status = d.status)))";
/* The retention's purge also mends rows made processing by hand without a lease: no claim
 * sees them (their DUE is NULL), so they get a lease that is over now. DUE IS NULL is read
 * from the end of "@T_due", whatever the table's size. */
const char rb_pg_sql_purge[] =
    "WITH mended AS (UPDATE \"@T\" SET lease_expires_at = now() WHERE " LIVE
    " AND " DUE " IS NULL AND status = 'processing' RETURNING 0)"
    " DELETE FROM \"@T\" WHERE id IN (SELECT id FROM \"@T\" WHERE status = $1::text"
    " AND coalesce(settled_at, created_at) <= now() - $2::float8 * interval '1 second'"
    " AND ($4::text IS NULL OR topic = $4::text) LIMIT $3::bigint)";


/* "postgresql: " + msg on one line: libpq's messages carry newlines and tabs. */
void rb_pg_one_line(char *out, size_t outlen, const char *msg)
{
    size_t n = (size_t)snprintf(out, outlen, "postgresql: ");
    if (n < outlen) rb_one_line(out + n, outlen - n, msg ? msg : "unknown error");
}

char *rb_pg_result_error(const PGresult *r)
{
    char buf[ERRLEN], msg[ERRLEN];
    const char *primary = PQresultErrorField(r, PG_DIAG_MESSAGE_PRIMARY);
    const char *detail = PQresultErrorField(r, PG_DIAG_MESSAGE_DETAIL);
    if (!primary) primary = PQresultErrorMessage(r);
    /* jsonb refuses "\u0000" as an "unsupported Unicode escape sequence": only the detail
     * says which, and a payload string holding a NUL byte is the usual cause */
    if (primary && detail && strstr(detail, "\\u0000")) {
        snprintf(msg, sizeof msg, "%s: jsonb cannot hold a NUL character (\\u0000) in a string", primary);
        primary = msg;
    }
    rb_pg_one_line(buf, sizeof buf, primary);
    return rb_strdup(buf);
}

char *rb_pg_subst_table(const char *tpl, const char *table)
{
    return rb_text_subst(tpl, "@T", table);
}

/* The statements the store runs name the table with its schema ("@T always follows a double
 * quote): a user's transaction may change search_path, or make a temporary table of the same
 * name, before relaybus's statements run on its connection. */
char *rb_pg_subst_qualified(const char *tpl, const char *schema, const char *table)
{
    size_t n = strlen(schema), k = 0;
    char *name = rb_malloc(2 * n + strlen(table) + 8);
    if (!name) return NULL;
    name[k++] = '"';
    for (const char *p = schema; *p; p++) {
        if (*p == '"') name[k++] = '"';     /* a quote inside a quoted identifier doubles */
        name[k++] = *p;
    }
    k += (size_t)sprintf(name + k, "\".\"%s", table);
    char *sql = rb_text_subst(tpl, "\"@T", name);
    free(name);
    return sql;
}

/* The schema of the table that `table` names on the search path, into out; 0 on failure. */
int rb_pg_table_schema(PGconn *pq, const char *table, char *out, size_t outlen, char *err,
                       size_t errlen)
{
    const char *p[1] = {table};
    PGresult *r = PQexecParams(pq, "SELECT n.nspname FROM pg_class c JOIN pg_namespace n"
                               " ON n.oid = c.relnamespace WHERE c.oid = to_regclass(quote_ident($1))",
                               1, NULL, p, NULL, NULL, 0);
    int ok = PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1 &&
             (size_t)PQgetlength(r, 0, 0) < outlen;
    if (ok) snprintf(out, outlen, "%s", PQgetvalue(r, 0, 0));
    else snprintf(err, errlen, "postgresql: cannot find the schema of table %s", table);
    PQclear(r);
    return ok;
}


/* ---- migrate and check (blocking, at open) ---------------------------------------------- */

static int exec_ok(PGconn *pq, const char *sql, char *err, size_t errlen, const char *what)
{
    PGresult *r = PQexec(pq, sql);
    ExecStatusType st = PQresultStatus(r);
    int ok = st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK;
    if (!ok) {
        char *m = rb_pg_result_error(r);
        snprintf(err, errlen, "%s%s%s", m ? m : "postgresql: error", what ? " " : "", what ? what : "");
        free(m);
    }
    PQclear(r);
    return ok;
}

/* The schema version of the table: -1 when unknown (no version table or no row). */
static int schema_version(PGconn *pq, const char *table)
{
    const char *p[1] = {table};
    PGresult *r = PQexecParams(pq, "SELECT version FROM relaybus_schema WHERE table_name = $1",
                               1, NULL, p, NULL, NULL, 0);
    int v = -1;
    if (PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1) v = atoi(PQgetvalue(r, 0, 0));
    PQclear(r);
    return v;
}

/* Whether the deliveries table is missing (on the search path), though relaybus_schema may
 * still hold its row: a table dropped by hand, its version left behind. */
static int table_missing(PGconn *pq, const char *table)
{
    const char *p[1] = {table};
    PGresult *r = PQexecParams(pq, "SELECT to_regclass(quote_ident($1)) IS NULL", 1, NULL, p,
                               NULL, NULL, 0);
    int missing = PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1 &&
                  strcmp(PQgetvalue(r, 0, 0), "t") == 0;
    PQclear(r);
    return missing;
}

/* 1 when relation `name` (on the search path) exists without `column`. */
static int lacks_column(PGconn *pq, const char *name, const char *column)
{
    const char *p[2] = {name, column};
    PGresult *r = PQexecParams(pq, "SELECT NOT EXISTS (SELECT 1 FROM pg_attribute WHERE"
                               " attrelid = c.oid AND attname = $2 AND NOT attisdropped)"
                               " FROM (SELECT to_regclass(quote_ident($1)) AS oid) c WHERE c.oid IS NOT NULL",
                               2, NULL, p, NULL, NULL, 0);
    int lacks = PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1 &&
                strcmp(PQgetvalue(r, 0, 0), "t") == 0;
    PQclear(r);
    return lacks;
}

/* The deliveries table TABLE, its leases table TABLE_leases, its topic settings TABLE_topics
 * and its schedules TABLE_schedules must be what they say: another relaybus table may hold one of the names (a
 * deliveries table named jobs_leases beside --table jobs), or an application's own table or
 * index. Refused before anything is made. */
int rb_pg_check_names(PGconn *pq, const char *table, char *err, size_t errlen)
{
    char leases[256], topics[256], schedules[256], deps[256];
    snprintf(deps, sizeof deps, "%s_deps", table);
    snprintf(leases, sizeof leases, "%s_leases", table);
    snprintf(topics, sizeof topics, "%s_topics", table);
    snprintf(schedules, sizeof schedules, "%s_schedules", table);
    if (lacks_column(pq, table, "fence"))
        snprintf(err, errlen, "postgresql: relation %s exists and is not a relaybus deliveries "
                 "table (is it another table's named leases, or the application's?): choose "
                 "another table name", table);
    else if (lacks_column(pq, leases, "token"))
        snprintf(err, errlen, "postgresql: relation %s exists and is not the named leases of "
                 "table %s (is it a deliveries table?): choose another table name", leases, table);
    else if (lacks_column(pq, topics, "paused_at"))
        snprintf(err, errlen, "postgresql: relation %s exists and is not the topic settings of "
                 "table %s (is it a deliveries table?): choose another table name", topics, table);
    else if (lacks_column(pq, deps, "dep"))
        snprintf(err, errlen, "postgresql: relation %s exists and is not the dependencies of "
                 "table %s (is it a deliveries table?): choose another table name", deps, table);
    else if (lacks_column(pq, schedules, "next_at"))
        snprintf(err, errlen, "postgresql: relation %s exists and is not the schedules of "
                 "table %s (is it a deliveries table?): choose another table name", schedules,
                 table);
    else
        return 1;
    return 0;
}

/* Brings the schema up to date in one transaction. The advisory lock serialises concurrent
 * opens: CREATE ... IF NOT EXISTS alone races on the catalog. */
int rb_pg_migrate(PGconn *pq, const char *table, char *err, size_t errlen)
{
    if (!exec_ok(pq, "BEGIN", err, errlen, NULL)) return 0;
    int ok = exec_ok(pq, "SELECT pg_advisory_xact_lock(7262017731406542)", err, errlen, NULL) &&
             exec_ok(pq, "CREATE TABLE IF NOT EXISTS relaybus_schema (table_name text PRIMARY KEY,"
                         " version integer NOT NULL, migrated_at timestamptz NOT NULL DEFAULT now())",
                     err, errlen, "(creating relaybus_schema)");
    int v = ok ? schema_version(pq, table) : 0;
    /* Dropped by hand: made again from the start. (Not a newer relaybus's table: this one
     * would record its own, older version over that one's.) */
    if (ok && v >= 0 && v <= PG_SCHEMA_VERSION && table_missing(pq, table)) v = -1;
    for (int i = v < 0 ? 0 : v; ok && i < PG_SCHEMA_VERSION; i++) {
        char *sql = rb_pg_subst_table(migrations[i], table);
        char what[64];
        snprintf(what, sizeof what, "(migration %d)", i + 1);
        ok = sql && exec_ok(pq, sql, err, errlen, what);
        if (!sql) snprintf(err, errlen, "postgresql: out of memory");
        free(sql);
    }
    if (ok && v < PG_SCHEMA_VERSION) {
        const char *p[2] = {table, NULL};
        char ver[16];
        snprintf(ver, sizeof ver, "%d", PG_SCHEMA_VERSION);
        p[1] = ver;
        PGresult *r = PQexecParams(pq,
            "INSERT INTO relaybus_schema (table_name, version) VALUES ($1, $2::integer)"
            " ON CONFLICT (table_name) DO UPDATE SET version = excluded.version, migrated_at = now()",
            2, NULL, p, NULL, NULL, 0);
        if (PQresultStatus(r) != PGRES_COMMAND_OK) {
            char *m = rb_pg_result_error(r);
            snprintf(err, errlen, "%s", m ? m : "postgresql: recording the schema version failed");
            free(m);
            ok = 0;
        }
        PQclear(r);
    }
    if (!ok) {
        PQclear(PQexec(pq, "ROLLBACK"));
        return 0;
    }
    return exec_ok(pq, "COMMIT", err, errlen, NULL);
}

/* Without migrate: the schema must be there, and nothing is created when it is not. */
int rb_pg_check_schema(PGconn *pq, const char *table, char *err, size_t errlen)
{
    const char *p[1] = {table};
    PGresult *r = PQexecParams(pq, "SELECT version FROM relaybus_schema WHERE table_name = $1",
                               1, NULL, p, NULL, NULL, 0);
    int v = -1;
    if (PQresultStatus(r) == PGRES_TUPLES_OK) {
        if (PQntuples(r) == 1) v = atoi(PQgetvalue(r, 0, 0));
    } else {
        const char *state = PQresultErrorField(r, PG_DIAG_SQLSTATE);
        if (!state || strcmp(state, "42P01") != 0) {    /* not undefined_table */
            char *m = rb_pg_result_error(r);
            snprintf(err, errlen, "%s (reading relaybus_schema)", m ? m : "postgresql: error");
            free(m);
            PQclear(r);
            return 0;
        }
    }
    PQclear(r);
    if (v >= 0 && table_missing(pq, table)) {
        snprintf(err, errlen, "postgresql: no table %s in this database, though relaybus_schema "
                 "records version %d of it (was it dropped? run relaybus migrate)", table, v);
        return 0;
    }
    if (v >= PG_SCHEMA_VERSION) return 1;
    if (v < 0)
        snprintf(err, errlen, "postgresql: no relaybus schema here (run relaybus migrate): no "
                 "table %s in this database", table);
    else
        snprintf(err, errlen, "postgresql: the schema of table %s is at version %d, this relaybus "
                 "needs %d (run relaybus migrate)", table, v, PG_SCHEMA_VERSION);
    return 0;
}

