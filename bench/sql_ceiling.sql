-- sql_ceiling.sql -- the database's own ceiling for relaybus's claim-then-complete, with no
-- runtime at all: claim 100 due rows with FOR UPDATE SKIP LOCKED the way runtime/store_pg.c's
-- rb_claim does (same due expression, so the same partial index; processing, attempts + 1,
-- fence + 1, one new lease token for the batch, an expiry), then complete them in a second
-- statement, as a coalesced settle does. Adapted from ../shared/peers/sql_ceiling_claim_complete.sql
-- to our table (relaybus_bench_ceiling, made by bench/pg_ceiling_setup.lua). Run by bench/run.sh:
--   pgbench -n -f bench/sql_ceiling.sql -c 2 -j 2 -t T URL      (rows/s = tps * 100)
WITH c AS (SELECT id FROM relaybus_bench_ceiling
           WHERE status IN ('pending', 'processing')
             AND (CASE WHEN status = 'pending' THEN run_at ELSE lease_expires_at END) <= now()
           ORDER BY (CASE WHEN status = 'pending' THEN run_at ELSE lease_expires_at END), id
           LIMIT 100 FOR UPDATE SKIP LOCKED),
u AS (UPDATE relaybus_bench_ceiling AS d SET status = 'processing', attempts = d.attempts + 1,
        fence = d.fence + 1, lease_token = (SELECT replace(gen_random_uuid()::text, '-', '')),
        lease_expires_at = now() + interval '30 s'
      FROM c WHERE d.id = c.id RETURNING d.id, d.lease_token)
SELECT quote_literal(array_agg(id)::text) AS ids, quote_literal(array_agg(lease_token)::text) AS toks FROM u \gset
UPDATE relaybus_bench_ceiling SET status = 'completed', settled_at = now(), lease_token = NULL,
       lease_expires_at = NULL
 WHERE id = ANY(:ids::bigint[]) AND status = 'processing'
   AND lease_token = ANY(:toks::text[]);
