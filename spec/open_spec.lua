-- open_spec.lua -- opening a store: the SQLite file is private (0600, and so its -wal and -shm),
-- an open without migrate creates nothing anywhere (no file, table or collection) and says
-- to run relaybus migrate, open errors carry no secret of the URL, and the URL forms
-- (sqlite:PATH only, postgres:// and postgresql://). Also the redaction helpers themselves.
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local relaybus = S.relaybus()

local q = S.quote

local function mode(path)
  local p = assert(io.popen("stat -c %a " .. q(path) .. " 2>/dev/null"))
  local m = p:read("l")
  p:close()
  return m
end

-- Runs a Lua script with `relaybus run SCRIPT ARGS...` under umask 022; returns exit code,
-- stdout, stderr.
local function run_script(src, args)
  local script = S.tmpfile("script") .. ".lua"
  S.write(script, src)
  local base = S.tmpfile("out")
  local line = "cd " .. q(S.tmpdir()) .. " && umask 022 && " .. q(S.bin) .. " run " .. q(script)
  for _, a in ipairs(args or {}) do line = line .. " " .. q(a) end
  local _, _, code = os.execute(line .. " >" .. q(base .. ".out") .. " 2>" .. q(base .. ".err") .. " </dev/null")
  return code, S.read(base .. ".out") or "", S.read(base .. ".err") or ""
end

-- After an upgrade: the two deliveries `ids` (topic "t", payloads {n = 1} and {n = 2}) run and
-- complete.
local function runs_both(store, ids)
  local seen = {}
  local d = H.dispatcher(store)
  local stop = H.stopper(d)
  d:handle("t", function(delivery)
    seen[#seen + 1] = delivery.payload.n
    if #seen == 2 then stop() end
  end)
  assert.is_true((H.run(d, 10)))
  table.sort(seen)
  assert.same({ 1, 2 }, seen)
  for _, id in ipairs(ids) do assert.equal("completed", assert(store:get(id)).status) end
end

-- The current schema versions.
local PG_VERSION, SQLITE_VERSION = 16, 8
local UNDO_SQLITE_SINCE_7

-- The arguments of PostgreSQL's claim function since schema 7, those of schema 6 and those of
-- schemas 3 to 5 (what an older relaybus calls; since 7 both are wrappers of the first).
local CLAIM_ARGS = "(text[], bigint, float8, text, bigint[], text[], integer[], float8[], text[], boolean, boolean)"
local V6_CLAIM_ARGS = "(text[], bigint, float8, text, bigint[], text[], integer[], float8[], text[], boolean)"
local OLD_CLAIM_ARGS = "(text[], bigint, float8, text, bigint[], text[], integer[], float8[], text[])"

-- A column of the claim function of PostgreSQL table t (of the arguments `args`, by default
-- CLAIM_ARGS), from pg_proc ("" when it has none).
local function claim_function(store, t, column, args)
  local ok, rows = store:transaction(function(tx)
    return tx:query("SELECT " .. column .. " AS v FROM pg_proc WHERE oid = to_regprocedure($1)",
      '"' .. t .. '_claim"' .. (args or CLAIM_ARGS))
  end)
  assert.is_true(ok, rows)
  return rows[1] and rows[1].v or ""
end

-- Runs the statements in one transaction of store.
local function exec_all(store, ...)
  local sqls = { ... }
  assert(store:transaction(function(tx)
    for _, sql in ipairs(sqls) do assert(tx:exec(sql)) end
    return true
  end))
end

-- s with the plain text `old` (which must be there) replaced by `new`, once.
local function replace(s, old, new)
  local a = assert(s:find(old, 1, true), old)
  return s:sub(1, a - 1) .. new .. s:sub(a + #old)
end

-- The autovacuum settings of PostgreSQL table t (schema 7), as "name=value" joined by spaces
-- in their order, or "" when it has none.
local VACUUM_SETTINGS = "autovacuum_vacuum_scale_factor=0 autovacuum_vacuum_threshold=10000 vacuum_index_cleanup=true"
local function vacuum_settings(store, t)
  local ok, rows = store:transaction(function(tx)
    return tx:query("SELECT array_to_string(reloptions, ' ') AS o FROM pg_class WHERE oid = ($1)::regclass", t)
  end)
  assert.is_true(ok, rows)
  return rows[1].o or ""
end

-- s without the text from `from` to the end of the first `to` after it (both must be there).
local function cut(s, from, to)
  local a = assert(s:find(from, 1, true), from)
  local _, b = assert(s:find(to, a, true))
  return s:sub(1, a - 1) .. s:sub(b + 1)
end

-- After a migration that made the counts per topic: ids[1] and ids[3], ids[4] buried, ids[2]
-- cancelled (topics a, a, b, b, b) are counted, and a kick of ids[3] moves them.
local function counts_filled_then_kept(store, ids)
  local st = assert(store:stats())
  assert.same({ 3, 1 }, { st.buried, st.cancelled })
  local per = {}
  for _, row in ipairs(assert(store:_topic_stats())) do per[row.topic] = row end
  assert.same({ 1, 1, 0 }, { per.a.buried, per.a.cancelled, per.a.pending })
  assert.same({ 2, 0, 1 }, { per.b.buried, per.b.cancelled, per.b.pending })
  assert(store:kick(ids[3]))
  for _, row in ipairs(assert(store:_topic_stats())) do per[row.topic] = row end
  assert.same({ 1, 0, 2 }, { per.b.buried, per.b.cancelled, per.b.pending })
end

-- The CHECK on status that migration 1 wrote, and the one of schema 10.
local CHECK_OF_FOUR = "CHECK (status IN ('pending', 'processing', 'completed', 'buried'))"

-- Brings PostgreSQL table t back to what schema 15 left: the claim function whose settles
-- release the next of a group (its run_at back) and hand none on to the claim.
local function back_to_version_15(store, t)
  local def = claim_function(store, t, "pg_get_functiondef(oid)")
  def = replace(def, " nexts bigint[] := '{}'; waiting_status constant text := 'pending';\n", "")
  -- the settles release the nexts at once
  local from, to = "    nexts := ARRAY(", ");\n    IF NOT coalesce(p_limit > 0, false) THEN"
  local a, b = assert(def:find(from, 1, true)), def:find(to, 1, true)
  local nexts = def:sub(a + #from, b - 1)
  def = cut(def, from, "    END IF;\n    END IF;\n")
  def = def:sub(1, a - 1) .. '    UPDATE "' .. t .. '" SET run_at = held_run_at, held_run_at = NULL'
    .. " WHERE id = ANY(ARRAY(" .. nexts .. ")) AND held_run_at IS NOT NULL;\n" .. def:sub(a)
  -- the claim walks "@T_due" alone
  def = replace(def, "WITH c AS (WITH w AS (SELECT x.id, (CASE WHEN status = 'pending' THEN run_at"
    .. " ELSE lease_expires_at END) AS due FROM", "WITH c AS (SELECT id FROM")
  def = cut(def, "), h AS (SELECT x.id, x.held_run_at", "ORDER BY a.due, a.id LIMIT p_limit")
  def = cut(def, " run_at = CASE WHEN d.id = ANY(nexts)", "ELSE d.held_run_at END,")
  def = cut(def, "    IF cardinality(nexts) > 0 THEN\n", "    END IF;\n")
  assert.is_nil(def:find("nexts", 1, true), def)
  exec_all(store, def, "UPDATE relaybus_schema SET version = 15 WHERE table_name = '" .. t .. "'")
end

-- Brings PostgreSQL table t back to what schema 10 left: the claim function without groups
-- (and its two wrappers, with 14 columns), no TABLE_enqueue, no group columns, indexes or
-- triggers.
local function back_to_version_10(store, t)
  back_to_version_15(store, t)
  local def = claim_function(store, t, "pg_get_functiondef(oid)")
  def = replace(def, ", c_group text)", ")")
  def = replace(def, " limited text[]; lt text; lim record; allow bigint; want bigint; took bigint;\n", "")
  def = cut(def, "  IF p_limit > 0 THEN\n    limited := ARRAY(", "    END IF;\n  END IF;\n")
  def = cut(def, "  want := p_limit;\n", "  p_limit := want;\n")
  assert.is_nil(def:find("limited", 1, true), def)
  def = cut(def, "  AND (x.group_name IS NULL OR", "   IS NULL))")
  def = replace(def, "    PERFORM set_config('relaybus.group_release', 'batch', true);\n", "")
  def = cut(def, "    PERFORM set_config('relaybus.group_release', '', true);", "AND held_run_at IS NOT NULL;\n")
  def = replace(def, ", NULL::text FROM w;", " FROM w;")
  def = replace(def, "NULL::integer, group_name FROM u", "NULL::integer FROM u")
  def = replace(def, ", 0, NULL::text;", ", 0;")
  def = replace(def, ", -1, NULL::text;", ", -1;")
  assert.is_nil(def:find("group", 1, true), def)
  local wrappers = {}
  for _, args in ipairs { V6_CLAIM_ARGS, OLD_CLAIM_ARGS } do
    wrappers[#wrappers + 1] = replace(claim_function(store, t, "pg_get_functiondef(oid)", args), ", c_group text)", ")")
  end
  exec_all(store, 'DROP FUNCTION "' .. t .. '_claim"' .. CLAIM_ARGS,
    'DROP FUNCTION "' .. t .. '_claim"' .. V6_CLAIM_ARGS,
    'DROP FUNCTION "' .. t .. '_claim"' .. OLD_CLAIM_ARGS, def, wrappers[1], wrappers[2],
    'DROP FUNCTION "' .. t .. '_enqueue"(text[], text[], text[], float8[], float8[], integer[], text[], boolean, boolean[])',
    'DROP TRIGGER "' .. t .. '_group_next" ON "' .. t .. '"', 'DROP TRIGGER "' .. t .. '_group_gone" ON "' .. t .. '"',
    'DROP FUNCTION "' .. t .. '_group_next"()',
    'DROP INDEX "' .. t .. '_group"', 'DROP INDEX "' .. t .. '_group_running"',
    'DROP INDEX "' .. t .. '_running"', 'DROP TABLE "' .. t .. '_starts"',
    'ALTER TABLE "' .. t .. '_topics" DROP COLUMN rate_max, DROP COLUMN rate_per, DROP COLUMN running_max',
    'ALTER TABLE "' .. t .. '" DROP COLUMN group_name, DROP COLUMN held_run_at',
    "UPDATE relaybus_schema SET version = 10 WHERE table_name = '" .. t .. "'")
end

-- Brings PostgreSQL table t back to what schema 9 left: the claim function whose settles keep
-- no errors, no progress or errors columns, the CHECK of four statuses.
local function back_to_version_9(store, t)
  back_to_version_10(store, t)
  local def = claim_function(store, t, "pg_get_functiondef(oid)")
  def = cut(def, "  errors = CASE WHEN", "ELSE d.errors END,")
  assert.is_nil(def:find("errors", 1, true), def)
  local ok, rows = store:transaction(function(tx)
    return tx:query("SELECT conname AS c FROM pg_constraint WHERE conrelid = ($1)::regclass"
      .. " AND contype = 'c' AND pg_get_constraintdef(oid) LIKE '%cancelled%'", t)
  end)
  assert.is_true(ok, rows)
  assert.equal(1, #rows)
  exec_all(store, def, 'ALTER TABLE "' .. t .. '" DROP COLUMN progress, DROP COLUMN errors',
    'ALTER TABLE "' .. t .. '" DROP CONSTRAINT "' .. rows[1].c .. '"',
    'ALTER TABLE "' .. t .. '" ADD ' .. CHECK_OF_FOUR,
    "UPDATE relaybus_schema SET version = 9 WHERE table_name = '" .. t .. "'")
end

-- Brings PostgreSQL table t back to what schema 8 left: the claim function without the pause,
-- no TABLE_topics.
local function back_to_version_8(store, t)
  back_to_version_9(store, t)
  local def = claim_function(store, t, "pg_get_functiondef(oid)")
  def = replace(def, "\n paused text[];", "")
  def = cut(def, "  IF p_limit > 0 THEN\n    paused := ", "    END IF;\n  END IF;\n")
  assert.is_nil(def:find("paused", 1, true), def)
  exec_all(store, def, 'DROP TABLE "' .. t .. '_topics"',
    "UPDATE relaybus_schema SET version = 8 WHERE table_name = '" .. t .. "'")
  assert.is_nil(claim_function(store, t, "prosrc"):find("paused", 1, true))
end

-- Brings PostgreSQL table t back to what schema 6 left: the claim function of ten arguments
-- (the text of 8 without p_tell_wait and its row about claim slots), the one of nine its
-- wrapper, and autovacuum's defaults.
local function back_to_version_6(store, t)
  back_to_version_8(store, t)
  local def = claim_function(store, t, "pg_get_functiondef(oid)")
  def = replace(def, ", p_next boolean, p_tell_wait boolean)", ", p_next boolean)")
  def = replace(def, " waited boolean := false;", "")
  def = replace(def, "          waited := true;\n", "")
  local from = assert(def:find("  IF p_tell_wait AND waited THEN\n", 1, true), def)
  local _, to = assert(def:find("\n  END IF;\n", from, true))
  def = def:sub(1, from - 1) .. def:sub(to + 1)
  local wrapper = claim_function(store, t, "pg_get_functiondef(oid)", OLD_CLAIM_ARGS)
  local n
  wrapper, n = wrapper:gsub("s_error, false, false%)", "s_error, false)")
  assert.equal(1, n, wrapper)
  exec_all(store, def, wrapper, 'DROP FUNCTION "' .. t .. '_claim"' .. CLAIM_ARGS,
    'ALTER TABLE "' .. t .. '" RESET (autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold,'
      .. " vacuum_index_cleanup)",
    "UPDATE relaybus_schema SET version = 6 WHERE table_name = '" .. t .. "'")
  assert.equal("", vacuum_settings(store, t))
  assert.equal("", claim_function(store, t, "prosrc"))
  local src = claim_function(store, t, "prosrc", V6_CLAIM_ARGS)
  assert.truthy(src:find("p_next", 1, true), src)
  assert.is_nil(src:find("waited", 1, true), src)
end

-- Brings PostgreSQL table t back to what schema 5 left: the claim function of nine arguments
-- (the text of 6 without p_next and its next-due row), no trigger on updates.
local function back_to_version_5(store, t)
  back_to_version_6(store, t)
  local def = claim_function(store, t, "pg_get_functiondef(oid)", V6_CLAIM_ARGS)
  local args_at = assert(def:find(", p_next boolean)", 1, true), def)
  def = def:sub(1, args_at - 1) .. ")" .. def:sub(args_at + #", p_next boolean)")
  local from = assert(def:find("  GET DIAGNOSTICS claimed", 1, true), def)
  local _, to = assert(def:find("\n  END IF;\n", from, true))
  def = def:sub(1, from - 1) .. def:sub(to + 1)
  exec_all(store, def, 'DROP FUNCTION "' .. t .. '_claim"' .. V6_CLAIM_ARGS,
    'DROP TRIGGER "' .. t .. '_sooner" ON "' .. t .. '"',
    "UPDATE relaybus_schema SET version = 5 WHERE table_name = '" .. t .. "'")
  assert.equal("", claim_function(store, t, "prosrc", V6_CLAIM_ARGS))
  assert.is_nil(claim_function(store, t, "prosrc", OLD_CLAIM_ARGS):find("p_next", 1, true))
end

-- What an older relaybus's claim (schemas 3 to 5: nine arguments) of topic on table t returns:
-- the rows' c_id and c_settled.
local function old_claim(store, t, topic)
  local ok, rows = store:transaction(function(tx)
    return tx:query('SELECT c_id, c_settled FROM "' .. t .. '_claim"(ARRAY[$1], 10, 30, \'tok\','
      .. ' NULL, NULL, NULL, NULL, NULL)', topic)
  end)
  assert.is_true(ok, rows)
  return rows
end

-- An older relaybus at schema `version` claims on table t (two deliveries of topic "old"); then
-- `store` closes, an open without migrate is refused, and an open migrates: returns that store.
-- What an older relaybus's enqueue (six arrays, every schema) of n deliveries of topic on
-- table t returns: their ids.
local function old_enqueue(store, t, topic, n)
  local ok, rows = store:transaction(function(tx)
    return tx:query('SELECT x::text AS id FROM "' .. t .. '_enq"(array_fill($1::text, ARRAY[$2::int]),'
      .. " array_fill('{}'::text, ARRAY[$2::int]), array_fill(NULL::text, ARRAY[$2::int]),"
      .. " array_fill(0::float8, ARRAY[$2::int]), array_fill(0::float8, ARRAY[$2::int]),"
      .. " array_fill(5, ARRAY[$2::int])) AS x", topic, n)
  end)
  assert.is_true(ok, rows)
  assert.equal(n, #rows)
  local ids = {}
  for i, r in ipairs(rows) do ids[i] = r.id end
  return ids
end

local function claims_then_migrates(url, store, t, version)
  old_enqueue(store, t, "old", 2)
  assert.equal(2, #old_claim(store, t, "old"))
  store:close()
  local s, err = relaybus.open(url, { table = t, migrate = false })
  assert.is_nil(s)
  assert.truthy(err:find("version " .. version .. ", this relaybus needs " .. PG_VERSION .. " (run relaybus migrate)", 1, true), err)
  s = assert(relaybus.open(url, { table = t }))
  assert.equal(VACUUM_SETTINGS, vacuum_settings(s, t))
  return s
end

describe("opening a store", function()
  teardown(function() S.cleanup() end)

  describe("SQLite file permissions", function()
    it("makes a new database file 0600 under umask 022, and its -wal and -shm too", function()
      local path = S.tmpfile("private") .. ".db"
      -- the modes are read while the store is open: SQLite removes -wal and -shm on close
      local code, out, err = run_script([[
        local relaybus = require "relaybus"
        local store = assert(relaybus.open("sqlite:" .. arg[1]))
        assert(store:enqueue("t", {}))
        for _, suffix in ipairs { "", "-wal", "-shm" } do
          local p = io.popen("stat -c %a '" .. arg[1] .. suffix .. "'")
          io.write(suffix, "=", p:read("l"), "\n")
          p:close()
        end
        store:close()
      ]], { path })
      assert.equal(0, code, err)
      assert.equal("=600\n-wal=600\n-shm=600\n", out)
    end)

    -- SQLite follows the link and makes the file it points to; so must the 0600 making.
    -- Three ways to point at nothing yet: a relative target, an absolute one, a chain of two.
    it("makes a database file 0600 through a dangling symlink, and its -wal and -shm too", function()
      local dir = S.tmpfile("linked")
      assert(os.execute("mkdir " .. q(dir)))
      local links = {
        { "rel.db", "target-rel.db" },
        { "abs.db", dir .. "/target-abs.db" },
        { "chain.db", "chain2.db" }, { "chain2.db", "target-chain.db" },
      }
      for _, l in ipairs(links) do
        assert(os.execute("ln -s " .. q(l[2]) .. " " .. q(dir .. "/" .. l[1])))
      end
      for _, case in ipairs { { "rel.db", "target-rel.db" }, { "abs.db", "target-abs.db" },
                              { "chain.db", "target-chain.db" } } do
        local link, target = dir .. "/" .. case[1], dir .. "/" .. case[2]
        local code, out, err = run_script([[
          local relaybus = require "relaybus"
          local store = assert(relaybus.open("sqlite:" .. arg[1]))
          assert(store:enqueue("t", {}))
          for _, suffix in ipairs { "", "-wal", "-shm" } do
            local p = io.popen("stat -c %a '" .. arg[2] .. suffix .. "'")
            io.write(suffix, "=", p:read("l"), "\n")
            p:close()
          end
          store:close()
        ]], { link, target })
        assert.equal(0, code, err)
        assert.equal("=600\n-wal=600\n-shm=600\n", out, case[1])
        assert.is_true(os.execute("test -L " .. q(link)) == true, "the link is still a link")
      end
      -- a link to a directory that does not exist fails as a missing directory does
      assert(os.execute("ln -s " .. q(dir .. "/nodir/x.db") .. " " .. q(dir .. "/nodir.db")))
      local s, err = relaybus.open("sqlite:" .. dir .. "/nodir.db")
      assert.is_nil(s)
      H.one_line(err)
      assert.is_false(S.exists(dir .. "/nodir"))
      -- a loop of links is an error, not a hang
      assert(os.execute("ln -s loop2.db " .. q(dir .. "/loop1.db") .. " && ln -s loop1.db " .. q(dir .. "/loop2.db")))
      s, err = relaybus.open("sqlite:" .. dir .. "/loop1.db")
      assert.is_nil(s)
      H.one_line(err)
    end)

    it("relaybus migrate makes it 0600 too; an existing file keeps its mode", function()
      local path = S.tmpfile("cmd") .. ".db"
      local _, _, code = os.execute("umask 022; " .. q(S.bin) .. " migrate --store " .. q("sqlite:" .. path)
        .. " >/dev/null 2>&1")
      assert.equal(0, code)
      assert.equal("600", mode(path))
      local shared = S.tmpfile("shared") .. ".db"
      S.write(shared, "")
      os.execute("chmod 640 " .. q(shared))
      local store = assert(relaybus.open("sqlite:" .. shared))
      assert(store:enqueue("t", {}))
      store:close()
      assert.equal("640", mode(shared))
    end)

    it("a failed open leaves a file it did not make", function()
      local path = S.tmpfile("failed") .. ".db"
      local store = assert(relaybus.open("sqlite:" .. path))
      assert(store:transaction(function(tx)
        return tx:exec("UPDATE relaybus_schema SET version = 99")
      end))
      store:close()
      local s, err = relaybus.open("sqlite:" .. path)
      assert.is_nil(s)
      H.one_line(err)
      assert.is_true(S.exists(path), "a file it did not make was removed")
    end)
  end)

  describe("without migrate", function()
    it("SQLite: a missing file is not made; the error names relaybus migrate", function()
      local path = S.tmpfile("none") .. ".db"
      local s, err = relaybus.open("sqlite:" .. path, { migrate = false })
      assert.is_nil(s)
      H.one_line(err)
      assert.truthy(err:find("no relaybus schema here (run relaybus migrate)", 1, true), err)
      assert.is_false(S.exists(path))
      -- :memory: is always empty
      s, err = relaybus.open("sqlite::memory:", { migrate = false })
      assert.is_nil(s)
      assert.truthy(err:find("relaybus migrate", 1, true), err)
    end)

    it("SQLite: a store that was migrated opens, with the default migrate = true", function()
      local url = "sqlite:" .. S.tmpfile("yes") .. ".db"
      local store = assert(relaybus.open(url))
      store:close()
      store = assert(relaybus.open(url, { migrate = false }))
      assert.equal(0, assert(store:stats()).pending)
      store:close()
    end)

    for _, entry in ipairs(S.list()) do
      if entry.server then
        it(entry.name .. ": a table that does not exist fails and is not created", function()
          local url = entry.url()
          local t = S.unique("absent")
          local s, err = relaybus.open(url, { table = t, migrate = false })
          assert.is_nil(s)
          H.one_line(err)
          assert.truthy(err:find("no relaybus schema here (run relaybus migrate)", 1, true), err)
          -- still not there: a second look says the same
          s, err = relaybus.open(url, { table = t, migrate = false })
          assert.is_nil(s)
          assert.truthy(err:find("no relaybus schema here", 1, true), err)
          -- and after a migrating open it is
          local store = assert(relaybus.open(url, { table = t }))
          store:close()
          store = assert(relaybus.open(url, { table = t, migrate = false }))
          store:close()
        end)
      end
      -- (the SQL stores record a table's schema version beside it; MongoDB's open looks at the
      -- collection's indexes themselves, which a dropped collection takes with it)
      if entry.sql then
        it(entry.name .. ": a table name whose own or _leases name another table holds is refused before anything is made", function()
          local url = entry.url()
          local t = S.unique("names")
          -- a deliveries table named t_leases, then --table t
          local a = assert(relaybus.open(url, { table = t .. "_leases" }))
          for _, migrate in ipairs { true, false } do
            local s, err = relaybus.open(url, { table = t, migrate = migrate })
            assert.is_nil(s)
            H.one_line(err)
            assert.truthy(err:find(t .. "_leases exists and is not the named leases of table " .. t, 1, true), err)
          end
          assert(a:try_acquire("still", 5))   -- t_leases's own leases are untouched
          -- the reverse: t2 made first, then --table t2_leases (its leases table)
          local t2 = S.unique("names")
          local b = assert(relaybus.open(url, { table = t2 }))
          assert(b:try_acquire("n", 5))
          local s, err = relaybus.open(url, { table = t2 .. "_leases" })
          assert.is_nil(s)
          assert.truthy(err:find(t2 .. "_leases exists and is not a relaybus deliveries table", 1, true), err)
          assert(b:try_acquire("n2", 5))
          -- an application's table of that name
          local t3 = S.unique("names")
          assert(a:transaction(function(tx) assert(tx:exec("CREATE TABLE " .. t3 .. " (x INTEGER)")) end))
          s, err = relaybus.open(url, { table = t3 })
          assert.is_nil(s)
          assert.truthy(err:find(t3 .. " exists and is not a relaybus deliveries table", 1, true), err)
          a:close()
          b:close()
        end)

        it(entry.name .. ": a deliveries table dropped by hand (what it left beside it kept) is refused without migrate, and made again by open: keyed enqueues still dedupe", function()
          local store, url, opts, t = S.open(entry)
          assert(store:enqueue("t", { n = 0 }, { key = "k" }))
          assert(store:transaction(function(tx) tx:exec('DROP TABLE "' .. t .. '"') end))
          store:close()
          local o = {}
          for k, v in pairs(opts) do o[k] = v end
          o.migrate = false
          local s, err = relaybus.open(url, o)
          assert.is_nil(s)
          H.one_line(err)
          assert.truthy(err:find("run relaybus migrate", 1, true), err)
          assert.truthy(err:find("was it dropped?", 1, true), err)
          s = assert(relaybus.open(url, opts))
          local a = assert(s:enqueue("t", { n = 1 }, { key = "k" }))
          assert.equal(a, assert(s:enqueue("t", { n = 9 }, { key = "k" })))   -- the dedup index is back
          runs_both(s, { a, assert(s:enqueue("t", { n = 2 })) })
          s:close()
          assert(relaybus.open(url, o)):close()      -- and without migrate it opens now
        end)
      end
      if entry.name == "sqlite" then
        -- The status CHECK as every relaybus before 2026-12-03 made it, as it was rewritten
        -- until schema version 4, and as it is now (which allows cancelled too).
        local OLD_CHECKS = { "CHECK (status IN ('pending','processing','completed','buried'))",
                             "CHECK (status IN ('pending','processing') OR status IN ('completed','buried'))" }
        local NEW_CHECK = "CHECK (status IN ('pending','processing') OR status IN ('completed','buried') OR status = 'cancelled')"
        local function sqlite_cli(path, text)
          local p = assert(io.popen("sqlite3 " .. q(path) .. " " .. q(text) .. " 2>&1"))
          local out = p:read("a")
          p:close()
          return out
        end
        local function check_of(path)
          return sqlite_cli(path, "SELECT sql FROM sqlite_master WHERE name = 'relaybus_deliveries'"):match("CHECK %b()")
        end
        -- What migrations 8 (counts) and 7 (dependencies) made, undone: the triggers first (they
        -- name the columns).
        UNDO_SQLITE_SINCE_7 = "DROP TRIGGER relaybus_deliveries_count_insert; DROP TRIGGER relaybus_deliveries_count_update;"
          .. " DROP TRIGGER relaybus_deliveries_count_delete; DROP TABLE relaybus_deliveries_counts;"
          .. " DROP INDEX relaybus_deliveries_buried_topic; DROP INDEX relaybus_deliveries_cancelled_topic;"
          .. " DROP TRIGGER relaybus_deliveries_dep_done; DROP TRIGGER relaybus_deliveries_dep_failed;"
          .. " DROP TABLE relaybus_deliveries_deps; ALTER TABLE relaybus_deliveries DROP COLUMN waiting;"
          .. " ALTER TABLE relaybus_deliveries DROP COLUMN held_run_at;"
          .. " ALTER TABLE relaybus_deliveries DROP COLUMN has_dependents;"
          .. " ALTER TABLE relaybus_deliveries DROP COLUMN after_depth;"

        -- A file made by this relaybus, its CHECK then put back as an older one wrote it.
        local function file_with_old_check(path, items, old_check)
          local store = assert(relaybus.open("sqlite:" .. path))
          local ids = assert(store:enqueue_many(items))
          store:close()
          assert.equal(NEW_CHECK, check_of(path))
          local cookie = tonumber(sqlite_cli(path, "PRAGMA schema_version"))
          sqlite_cli(path, "PRAGMA writable_schema = ON; UPDATE sqlite_master SET sql = replace(sql, "
            .. "'" .. NEW_CHECK:gsub("'", "''") .. "', '" .. old_check:gsub("'", "''") .. "') WHERE name = 'relaybus_deliveries'; "
            .. "PRAGMA schema_version = " .. (cookie + 1) .. "; PRAGMA writable_schema = OFF")
          assert.equal(old_check, check_of(path))
          return ids
        end

        it("sqlite: a table whose status CHECK is an older one gets the current from a migrating open, and nothing else changes", function()
          for k, old in ipairs(OLD_CHECKS) do
            local path = S.tmpfile("check" .. k) .. ".db"
            local ids = file_with_old_check(path, { { "t", { n = 1 } }, { "t", { n = 2 } } }, old)
            local function sql(text) return sqlite_cli(path, text) end
            local function check_of_table() return check_of(path) end
            local store
            -- an open without migrate changes no schema
            store = assert(relaybus.open("sqlite:" .. path, { migrate = false }))
            store:close()
            assert.equal(old, check_of_table())
            store = assert(relaybus.open("sqlite:" .. path))
            assert.equal(NEW_CHECK, check_of_table())
            assert.equal("ok", (sql("PRAGMA integrity_check"):gsub("%s+$", "")))
            assert.equal(tostring(SQLITE_VERSION), (sql("SELECT version FROM relaybus_schema"):gsub("%s+$", "")))
            -- the constraint still holds, for writers other than relaybus too
            assert.truthy(sql("UPDATE relaybus_deliveries SET status = 'done' WHERE id = 1"):find("CHECK constraint failed", 1, true))
            for _, st in ipairs { "pending", "processing", "completed", "buried", "cancelled" } do
              assert.equal("", sql("UPDATE relaybus_deliveries SET status = '" .. st .. "' WHERE id = 99"))
            end
            runs_both(store, ids)
            store:close()
            -- opening again changes nothing
            store = assert(relaybus.open("sqlite:" .. path))
            store:close()
            assert.equal(NEW_CHECK, check_of_table())
          end
        end)

        it("sqlite: a file of schema version 5 is refused without migrate and migrated by open: schedules fire", function()
          local path = S.tmpfile("v5") .. ".db"
          local store = assert(relaybus.open("sqlite:" .. path))
          store:close()
          sqlite_cli(path, UNDO_SQLITE_SINCE_7 .. " DROP TABLE relaybus_deliveries_schedules; UPDATE relaybus_schema SET version = 5")
          local s, err = relaybus.open("sqlite:" .. path, { migrate = false })
          assert.is_nil(s)
          assert.truthy(err:find("outdated (run relaybus migrate)", 1, true), err)
          store = assert(relaybus.open("sqlite:" .. path))
          assert.equal(tostring(SQLITE_VERSION), (sqlite_cli(path, "SELECT version FROM relaybus_schema"):gsub("%s+$", "")))
          assert(store:schedule("s", { every = 1, topic = "tick" }))
          local d = H.dispatcher(store)
          local stop = H.stopper(d)
          d:handle("tick", function() stop() end)
          assert.is_true((H.run(d, 10)))
          assert.equal(1, #assert(store:list { topic = "tick" }))
          store:close()
        end)

        it("sqlite: a file of schema version 7 with buried and cancelled rows is migrated: its counts per topic are filled once", function()
          local path = S.tmpfile("v7") .. ".db"
          local store = assert(relaybus.open("sqlite:" .. path))
          local ids = assert(store:enqueue_many { { "a", {} }, { "a", {} }, { "b", {} }, { "b", {} }, { "b", {} } })
          store:close()
          -- as version 7 left them: settled with no counts kept
          sqlite_cli(path, "DROP TRIGGER relaybus_deliveries_count_insert; DROP TRIGGER relaybus_deliveries_count_update;"
            .. " DROP TRIGGER relaybus_deliveries_count_delete; DROP TABLE relaybus_deliveries_counts;"
            .. " DROP INDEX relaybus_deliveries_buried_topic; DROP INDEX relaybus_deliveries_cancelled_topic;"
            .. " UPDATE relaybus_deliveries SET status = 'buried', settled_at = 1 WHERE id IN ("
            .. ids[1] .. ", " .. ids[3] .. ", " .. ids[4] .. "); UPDATE relaybus_deliveries"
            .. " SET status = 'cancelled', settled_at = 1 WHERE id = " .. ids[2] .. ";"
            .. " UPDATE relaybus_schema SET version = 7")
          local s, err = relaybus.open("sqlite:" .. path, { migrate = false })
          assert.is_nil(s)
          assert.truthy(err:find("outdated (run relaybus migrate)", 1, true), err)
          store = assert(relaybus.open("sqlite:" .. path))
          assert.equal(tostring(SQLITE_VERSION), (sqlite_cli(path, "SELECT version FROM relaybus_schema"):gsub("%s+$", "")))
          counts_filled_then_kept(store, ids)
          store:close()
        end)

        it("sqlite: a file of schema version 3 is refused without migrate and brought to the current by open: cancelled, progress and errors", function()
          local path = S.tmpfile("v3") .. ".db"
          local ids = file_with_old_check(path, { { "t", { n = 1 } }, { "t", { n = 2 } } }, OLD_CHECKS[2])
          sqlite_cli(path, UNDO_SQLITE_SINCE_7 .. " DROP TABLE relaybus_deliveries_schedules;"
            .. " DROP INDEX relaybus_deliveries_group; DROP INDEX relaybus_deliveries_group_running;"
            .. " DROP INDEX relaybus_deliveries_running; DROP TABLE relaybus_deliveries_starts;"
            .. " ALTER TABLE relaybus_deliveries_topics DROP COLUMN rate_max;"
            .. " ALTER TABLE relaybus_deliveries_topics DROP COLUMN rate_per;"
            .. " ALTER TABLE relaybus_deliveries_topics DROP COLUMN running_max;"
            .. " ALTER TABLE relaybus_deliveries DROP COLUMN group_name;"
            .. " DROP INDEX relaybus_deliveries_cancelled; ALTER TABLE relaybus_deliveries DROP COLUMN progress;"
            .. " ALTER TABLE relaybus_deliveries DROP COLUMN errors; UPDATE relaybus_schema SET version = 3")
          local s, err = relaybus.open("sqlite:" .. path, { migrate = false })
          assert.is_nil(s)
          assert.truthy(err:find("outdated (run relaybus migrate)", 1, true), err)
          s = assert(relaybus.open("sqlite:" .. path))
          assert.equal(NEW_CHECK, check_of(path))
          assert.equal(tostring(SQLITE_VERSION), (sqlite_cli(path, "SELECT version FROM relaybus_schema"):gsub("%s+$", "")))
          runs_both(s, ids)
          local later = assert(s:enqueue("t", { n = 3 }))
          assert.is_true(assert(s:cancel(later)))
          assert.equal("cancelled", assert(s:get(later)).status)
          assert.equal("ok", (sqlite_cli(path, "PRAGMA integrity_check"):gsub("%s+$", "")))
          s:close()
        end)

        it("sqlite: eight processes opening a new file at once all open it (25 times over)", function()
          -- (setting WAL mode takes the exclusive lock from under a shared one, where SQLite
          -- answers busy at once: 6 of 1,200 opens failed with "database is locked")
          local script = S.tmpfile("newfile") .. ".lua"
          S.write(script, [[
local relaybus = require "relaybus"
local store, err = relaybus.open("sqlite:" .. arg[1])
if not store then print("FAIL " .. err) os.exit(1) end
assert(store:enqueue("t", {}))
store:close()
print("OPENED")
]])
          local base = S.tmpfile("newfile")
          for round = 1, 25 do
            local path = base .. "-" .. round .. ".db"
            local line = "("
            for i = 1, 8 do
              line = line .. q(S.bin) .. " run " .. q(script) .. " " .. q(path) .. " >" .. q(base .. i) .. " 2>&1 & "
            end
            assert.is_true(os.execute(line .. "wait)"))
            for i = 1, 8 do
              local out = S.read(base .. i) or ""
              assert.truthy(out:find("OPENED", 1, true), "round " .. round .. ", process " .. i .. ": " .. out)
            end
            assert.equal("8", (sqlite_cli(path, "SELECT count(*) FROM relaybus_deliveries"):gsub("%s+$", "")))
          end
        end)

        it("sqlite: six processes opening a file with the list of four at once all run, the rewrite happens once, and every delivery runs once", function()
          local path = S.tmpfile("race") .. ".db"
          local items = {}
          for i = 1, 600 do items[i] = { "t", { n = i } } end
          file_with_old_check(path, items, OLD_CHECKS[1])
          local script = S.tmpfile("race") .. ".lua"
          S.write(script, [[
local relaybus = require "relaybus"
local store, err = relaybus.open("sqlite:" .. arg[1])
if not store then print("ERR " .. err) os.exit(1) end
local d = relaybus.dispatcher(store, { concurrency = 8, poll_interval = 0.05 })
local ran = {}
d:handle("t", function(delivery, ctx) ran[#ran + 1] = delivery.payload.n; ctx:sleep(0.001) end)
d:start()
relaybus.spawn(function()
  while store:stats().completed < 600 do relaybus.sleep(0.05) end
  d:stop()
end)
relaybus.run()
print("RAN " .. table.concat(ran, ","))
]])
          local base = S.tmpfile("race")
          local line = "("
          for i = 1, 6 do
            line = line .. q(S.bin) .. " run " .. q(script) .. " " .. q(path) .. " >" .. q(base .. i) .. " 2>&1 & "
          end
          assert.is_true(os.execute(line .. "wait)"))
          local seen, runs = {}, 0
          for i = 1, 6 do
            local out = S.read(base .. i) or ""
            local list = out:match("RAN ([%d,]*)")
            assert.truthy(list, "process " .. i .. ": " .. out)
            for n in list:gmatch("%d+") do
              runs = runs + 1
              assert.is_nil(seen[n], "delivery " .. n .. " ran twice")
              seen[n] = true
            end
          end
          assert.equal(600, runs)
          assert.equal(NEW_CHECK, check_of(path))
          assert.equal("ok", (sqlite_cli(path, "PRAGMA integrity_check"):gsub("%s+$", "")))
          assert.equal("600", (sqlite_cli(path, "SELECT count(*) FROM relaybus_deliveries WHERE status = 'completed'"):gsub("%s+$", "")))
        end)
      end
      if entry.name == "postgresql" then
        it("postgresql: a table of schema version 2 is refused without migrate and brought to 9 by open; its deliveries then run", function()
          local url = entry.url()
          local t = S.unique("v2")
          local store = assert(relaybus.open(url, { table = t }))
          local ids = assert(store:enqueue_many { { "t", { n = 1 } }, { "t", { n = 2 } } })
          -- what a database migrated by the release before the claim function looks like
          back_to_version_5(store, t)
          exec_all(store, 'DROP FUNCTION "' .. t .. '_claim"' .. OLD_CLAIM_ARGS,
            "UPDATE relaybus_schema SET version = 2 WHERE table_name = '" .. t .. "'")
          store:close()
          local s, err = relaybus.open(url, { table = t, migrate = false })
          assert.is_nil(s)
          H.one_line(err)
          assert.truthy(err:find("version 2, this relaybus needs " .. PG_VERSION .. " (run relaybus migrate)", 1, true), err)
          store = assert(relaybus.open(url, { table = t }))
          runs_both(store, ids)
          store:close()
        end)
        it("postgresql: a table of schema version 3 gets the claim function whose plans reach rows by key", function()
          local url = entry.url()
          local t = S.unique("v3")
          local store = assert(relaybus.open(url, { table = t }))
          local function settings() return claim_function(store, t, "array_to_string(proconfig, ',')") end
          assert.truthy(settings():find("enable_seqscan=off", 1, true), settings())
          -- what version 3 left: the function with only its sort, bitmap scan and JIT settings
          back_to_version_5(store, t)
          local old = '"' .. t .. '_claim"' .. OLD_CLAIM_ARGS
          exec_all(store, "ALTER FUNCTION " .. old .. " RESET ALL",
            "ALTER FUNCTION " .. old .. " SET enable_sort = off SET enable_bitmapscan = off SET jit = off",
            'DROP FUNCTION "' .. t .. '_pending_topics"',
            "UPDATE relaybus_schema SET version = 3 WHERE table_name = '" .. t .. "'")
          assert.equal("", settings())
          store:close()
          local s, err = relaybus.open(url, { table = t, migrate = false })
          assert.is_nil(s)
          assert.truthy(err:find("version 3, this relaybus needs " .. PG_VERSION .. " (run relaybus migrate)", 1, true), err)
          store = assert(relaybus.open(url, { table = t }))
          local c = settings()
          for _, want in ipairs { "plan_cache_mode=force_generic_plan", "enable_seqscan=off", "enable_nestloop=off", "enable_sort=off",
            "enable_bitmapscan=off", "jit=off" } do
            assert.truthy(c:find(want, 1, true), c)
          end
          local ok, rows = store:transaction(function(tx)
            return tx:query("SELECT count(*) AS n FROM pg_proc WHERE proname = $1", t .. "_pending_topics")
          end)
          assert.is_true(ok, rows)
          assert.equal(1, tonumber(rows[1].n))
          -- its deliveries run and complete under the new function
          runs_both(store, assert(store:enqueue_many { { "t", { n = 1 } }, { "t", { n = 2 } } }))
          store:close()
        end)
        it("postgresql: a table of schema version 4 is refused without migrate and gets the claim with slots by open; its deliveries run before and after", function()
          local url = entry.url()
          local t = S.unique("v4")
          local store = assert(relaybus.open(url, { table = t }))
          local function claim_source() return claim_function(store, t, "prosrc") end
          -- what version 4 left: the function of version 5 without the slots
          back_to_version_5(store, t)
          local def = claim_function(store, t, "pg_get_functiondef(oid)", OLD_CLAIM_ARGS)
          local from = assert(def:find("  IF p_limit > 0 THEN\n    slots_text := ", 1, true), def)
          local _, to = assert(def:find("\n    END IF;\n  END IF;\n", from, true))
          def = def:sub(1, from - 1) .. def:sub(to + 1)
          exec_all(store, def, "UPDATE relaybus_schema SET version = 4 WHERE table_name = '" .. t .. "'")
          assert.is_nil(claim_function(store, t, "prosrc", OLD_CLAIM_ARGS):find("pg_advisory_xact_lock", 1, true))
          -- the claim of version 4 claims deliveries (what an older relaybus does on its table)
          store = claims_then_migrates(url, store, t, 4)
          local src = claim_source()
          assert.truthy(src:find("relaybus.claim_slots", 1, true), src)
          assert.truthy(src:find("pg_advisory_xact_lock", 1, true), src)
          runs_both(store, assert(store:enqueue_many { { "t", { n = 1 } }, { "t", { n = 2 } } }))
          store:close()
        end)
        it("postgresql: a table of schema version 5 is refused without migrate and migrated by open; an older relaybus's claim goes on beside it and gets no next-due row", function()
          local url = entry.url()
          local t = S.unique("v5")
          local store = assert(relaybus.open(url, { table = t }))
          back_to_version_5(store, t)
          store = claims_then_migrates(url, store, t, 5)
          -- the older relaybus's claim, now the wrapper: deliveries, and no row of c_settled 0
          assert.truthy(claim_function(store, t, "prosrc", OLD_CLAIM_ARGS):find("false", 1, true))
          assert(store:enqueue_many { { "old", {} }, { "old", {} }, { "old", {} } })
          local rows = old_claim(store, t, "old")
          assert.equal(3, #rows)
          for _, r in ipairs(rows) do assert.is_nil(r.c_settled) end
          assert.equal(0, #old_claim(store, t, "old"))
          -- the new claim's next-due row: the two claimed above are live, their leases 30 s away
          local ok, next_rows = store:transaction(function(tx)
            return tx:query('SELECT c_settled, c_run_at FROM "' .. t .. '_claim"(ARRAY[\'old\'], 10, 30,'
              .. " 'tok', NULL, NULL, NULL, NULL, NULL, true)")
          end)
          assert.is_true(ok, next_rows)
          assert.equal(1, #next_rows)
          assert.equal(0, tonumber(next_rows[1].c_settled))
          local in_s = tonumber(next_rows[1].c_run_at)
          assert.truthy(in_s > 20 and in_s <= 30, tostring(in_s))
          runs_both(store, assert(store:enqueue_many { { "t", { n = 1 } }, { "t", { n = 2 } } }))
          store:close()
        end)
        it("postgresql: a table of schema version 6 is refused without migrate and migrated by open (claim slots told, autovacuum settings); the claim of a relaybus of 6 goes on beside it and gets no row about claim slots", function()
          local url = entry.url()
          local t = S.unique("v6")
          local store = assert(relaybus.open(url, { table = t }))
          assert.equal(VACUUM_SETTINGS, vacuum_settings(store, t))   -- a new table has them
          back_to_version_6(store, t)
          store = claims_then_migrates(url, store, t, 6)
          assert.truthy(claim_function(store, t, "prosrc", V6_CLAIM_ARGS):find("p_next, false", 1, true))
          -- A claim of one delivery with the arguments args_sql after the nine, while another
          -- session holds both claim slots for held_for seconds (none: nobody holds them):
          -- returns how many rows told it that it got its slot after waiting.
          local holder = assert(relaybus.open(url, { table = t }))
          local function claim(args_sql, held_for)
            assert(store:enqueue("old", {}))
            local held = not held_for
            if held_for then
              relaybus.spawn(function()
                assert(holder:transaction(function(tx)
                  assert(tx:query("SELECT pg_advisory_xact_lock(k, 0), pg_advisory_xact_lock(k, 1) FROM"
                    .. " (SELECT (($1)::regclass::oid::bigint - 2147483648)::integer AS k) AS x", t))
                  held = true
                  relaybus.sleep(held_for)
                end))
              end)
              while not held do relaybus.sleep(0.005) end
            end
            local ok, rows = store:transaction(function(tx)
              return tx:query('SELECT c_id, c_settled FROM "' .. t .. '_claim"(ARRAY[\'old\'], 1, 30,'
                .. " 'tok', NULL, NULL, NULL, NULL, NULL" .. args_sql .. ")")
            end)
            assert.is_true(ok, rows)
            local got, told = 0, 0
            for _, r in ipairs(rows) do
              if r.c_settled == nil then got = got + 1
              elseif tonumber(r.c_settled) == -1 then told = told + 1 end
            end
            assert.equal(1, got, "the claim claimed " .. got)
            return told
          end
          -- held for less than the second a claim waits: each waits, then gets a slot
          assert.equal(0, claim(", true", 0.3))         -- a relaybus of 6
          assert.equal(0, claim("", 0.3))               -- of 3 to 5
          assert.equal(1, claim(", true, true", 0.3))   -- this one: told
          assert.equal(0, claim(", true, false", 0.3))
          -- held for longer: the claim gives up waiting and claims without a slot, untold
          assert.equal(0, claim(", true, true", 1.5))
          relaybus.run()                                -- the holder's transaction ends
          assert.equal(0, claim(", true, true"))        -- the slots free: no wait
          holder:close()
          runs_both(store, assert(store:enqueue_many { { "t", { n = 1 } }, { "t", { n = 2 } } }))
          store:close()
        end)

        it("postgresql: a table of schema version 14 with buried and cancelled rows is migrated: its counts per topic are filled once, then kept", function()
          local url = entry.url()
          local t = S.unique("v14")
          local store = assert(relaybus.open(url, { table = t }))
          local ids = assert(store:enqueue_many { { "a", {} }, { "a", {} }, { "b", {} }, { "b", {} }, { "b", {} } })
          -- as version 14 left them: settled with no counts kept
          exec_all(store, 'DROP TRIGGER "' .. t .. '_tally_insert" ON "' .. t .. '"',
            'DROP TRIGGER "' .. t .. '_tally_update" ON "' .. t .. '"',
            'DROP TRIGGER "' .. t .. '_tally_delete" ON "' .. t .. '"',
            'DROP TRIGGER "' .. t .. '_tally_truncate" ON "' .. t .. '"',
            'DROP FUNCTION "' .. t .. '_tally"()', 'DROP TABLE "' .. t .. '_counts"',
            'DROP TABLE "' .. t .. '_count_deltas"',
            'UPDATE "' .. t .. "\" SET status = 'buried', settled_at = now() WHERE id IN ("
              .. ids[1] .. ", " .. ids[3] .. ", " .. ids[4] .. ")",
            'UPDATE "' .. t .. "\" SET status = 'cancelled', settled_at = now() WHERE id = " .. ids[2],
            "UPDATE relaybus_schema SET version = 14 WHERE table_name = '" .. t .. "'")
          store:close()
          local s, err = relaybus.open(url, { table = t, migrate = false })
          assert.is_nil(s)
          assert.truthy(err:find("version 14, this relaybus needs " .. PG_VERSION .. " (run relaybus migrate)", 1, true), err)
          store = assert(relaybus.open(url, { table = t }))
          local st
          counts_filled_then_kept(store, ids)
          -- a TRUNCATE empties the counts with the table
          exec_all(store, 'TRUNCATE "' .. t .. '"')
          st = assert(store:stats())
          assert.same({ 0, 0 }, { st.buried, st.cancelled })
          assert.same({}, assert(store:_topic_stats()))
          store:close()
        end)

        -- The tally only inserts deltas (no write waits for another); one change in 1,000 folds
        -- them into the counts under a lock it only tries.
        it("postgresql: 20,000 cancels in one statement are counted exactly, their deltas folded along the way", function()
          local url = entry.url()
          local t = S.unique("fold")
          local store = assert(relaybus.open(url, { table = t }))
          local items = {}
          for i = 1, 20000 do items[i] = { i % 2 == 0 and "f.a" or "f.b", {} } end
          assert(store:enqueue_many(items))
          assert.equal(20000, assert(store:cancel { all = true }))
          local st = assert(store:stats())
          assert.same({ 20000, 0 }, { st.cancelled, st.buried })
          local per = {}
          for _, row in ipairs(assert(store:_topic_stats())) do per[row.topic] = row.cancelled end
          assert.same({ ["f.a"] = 10000, ["f.b"] = 10000 }, per)
          local ok, rows = store:transaction(function(tx)
            return tx:query('SELECT (SELECT count(*) FROM "' .. t .. '_count_deltas") AS deltas,'
              .. ' (SELECT coalesce(sum(cancelled), 0) FROM "' .. t .. '_counts") AS folded')
          end)
          assert.is_true(ok, rows)
          -- (no fold in 20,000 tries has a chance of e^-20)
          assert.is_true(tonumber(rows[1].folded) > 0, "nothing was folded")
          assert.equal(20000, tonumber(rows[1].folded) + tonumber(rows[1].deltas))
          store:close()
        end)

        it("postgresql: a table of schema version 11 is refused without migrate and migrated by open: schedules fire", function()
          local url = entry.url()
          local t = S.unique("v12")
          local store = assert(relaybus.open(url, { table = t }))
          exec_all(store, 'DROP TABLE "' .. t .. '_schedules"',
            "UPDATE relaybus_schema SET version = 11 WHERE table_name = '" .. t .. "'")
          store:close()
          local s, err = relaybus.open(url, { table = t, migrate = false })
          assert.is_nil(s)
          assert.truthy(err:find("version 11, this relaybus needs " .. PG_VERSION .. " (run relaybus migrate)", 1, true), err)
          store = assert(relaybus.open(url, { table = t }))
          assert(store:schedule("s", { every = 1, topic = "tick" }))
          local d = H.dispatcher(store)
          local stop = H.stopper(d)
          d:handle("tick", function() stop() end)
          assert.is_true((H.run(d, 10)))
          assert.equal(1, #assert(store:list { topic = "tick" }))
          store:close()
        end)

        it("postgresql: a table of schema version 15 is migrated by open: a claim that settles a group's head takes the next in one write, in due order; one held before goes on", function()
          local url = entry.url()
          local t = S.unique("v16")
          local store = assert(relaybus.open(url, { table = t }))
          back_to_version_15(store, t)
          -- the group's first, an ungrouped one, then the group's second and third (held)
          local ids = { assert(store:enqueue("grp", { n = 1 }, { group = "g" })) }
          local other = assert(store:enqueue("grp", { n = 0 }))
          for i = 2, 3 do ids[i] = assert(store:enqueue("grp", { n = i }, { group = "g" })) end
          store = claims_then_migrates(url, store, t, 15)
          -- the claim function as the dispatcher calls it, for one delivery at a time
          local function claim(settle)
            local ok, rows = store:transaction(function(tx)
              return tx:query('SELECT c_id, c_settled, c_run_at FROM "' .. t .. '_claim"('
                .. "ARRAY['grp'], 1, 30, 'tok', " .. (settle and ("ARRAY[" .. settle .. "]::bigint[],"
                .. " ARRAY['tok'], ARRAY[0], ARRAY[0]::float8[], ARRAY[NULL]::text[]")
                or "NULL, NULL, NULL, NULL, NULL") .. ", false, false)")
            end)
            assert.is_true(ok, rows)
            local claimed = {}
            for _, r in ipairs(rows) do
              if r.c_settled == nil then claimed[#claimed + 1] = r end
            end
            return claimed
          end
          -- (a trigger of the spec's own counts the writes of the group's third)
          exec_all(store, 'CREATE TABLE "' .. t .. '_writes" (id bigint)',
            'CREATE FUNCTION "' .. t .. '_count"() RETURNS trigger LANGUAGE plpgsql AS $f$ BEGIN'
              .. ' INSERT INTO "' .. t .. '_writes" VALUES (OLD.id); RETURN NULL; END $f$',
            'CREATE TRIGGER "' .. t .. '_count" AFTER UPDATE ON "' .. t .. '" FOR EACH ROW'
              .. " WHEN (OLD.id = " .. ids[3] .. ') EXECUTE FUNCTION "' .. t .. '_count"()')
          assert.equal(ids[1], claim()[1].c_id)
          -- settling the head: the ungrouped one that fell due before the group's second
          -- goes first (the second is released)
          assert.equal(other, claim(ids[1])[1].c_id)
          assert.equal(ids[2], claim()[1].c_id)
          -- settling the second: the third is claimed in the write that gives it its run_at
          -- back (schema 15 wrote it twice: the release, then the claim)
          local handed = claim(ids[2])
          assert.equal(1, #handed)
          assert.equal(ids[3], handed[1].c_id)
          assert.near(assert(store:get(ids[3])).created_at, handed[1].c_run_at, 1)
          assert.equal("processing", assert(store:get(ids[3])).status)
          local ok, writes = store:transaction(function(tx)
            return tx:query('SELECT count(*) AS n FROM "' .. t .. '_writes"')
          end)
          assert.is_true(ok, writes)
          assert.equal(1, writes[1].n)
          -- (found by attack: a settle called by hand with a NULL limit left the next held)
          local fourth = assert(store:enqueue("grp", { n = 4 }, { group = "g" }))
          local okn, errn = store:transaction(function(tx)
            return tx:query('SELECT c_settled FROM "' .. t .. '_claim"(NULL, NULL, 0, NULL, ARRAY['
              .. ids[3] .. "]::bigint[], ARRAY['tok'], ARRAY[0], ARRAY[0]::float8[], ARRAY[NULL]::text[], false, false)")
          end)
          assert.is_true(okn, errn)
          local after = claim()
          assert.equal(1, #after, "the next stayed held")
          assert.equal(fourth, after[1].c_id)
          store:close()
        end)

        it("postgresql: a table of schema version 10 is migrated by open: groups run one at a time; an older relaybus's claim and enqueue go on beside it", function()
          local url = entry.url()
          local t = S.unique("v11")
          local store = assert(relaybus.open(url, { table = t }))
          back_to_version_10(store, t)
          local before = old_enqueue(store, t, "v10", 1)[1]
          store = claims_then_migrates(url, store, t, 10)
          -- an older relaybus enqueues with six arrays and claims reading 14 columns
          old_enqueue(store, t, "old", 1)
          assert.equal(1, #old_claim(store, t, "old"))
          for i = 1, 4 do assert(store:enqueue("grp", { n = i }, { group = "g" })) end
          local running, most, order = 0, 0, {}
          local d = H.dispatcher(store)
          local stop = H.stopper(d)
          d:handle("grp", function(delivery, ctx)
            running = running + 1
            most = math.max(most, running)
            ctx:sleep(0.02)
            running = running - 1
            order[#order + 1] = delivery.payload.n
            if #order == 4 then stop() end
          end)
          assert.is_true((H.run(d, 10)))
          assert.same({ 1, 2, 3, 4 }, order)
          assert.equal(1, most)
          assert.equal("pending", assert(store:get(before)).status)
          store:close()
        end)

        it("postgresql: a table of schema version 9 is migrated by open: cancelled is allowed, and progress and errors are kept; an older relaybus's claim goes on beside it", function()
          local url = entry.url()
          local t = S.unique("v10")
          local store = assert(relaybus.open(url, { table = t }))
          back_to_version_9(store, t)
          local id = old_enqueue(store, t, "v9", 1)[1]
          local refused = store:cancel(id)            -- the CHECK of four refuses the status
          assert.is_not_true(refused)
          store = claims_then_migrates(url, store, t, 9)
          assert.is_true(assert(store:cancel(id)))
          local failing = assert(store:enqueue("v10", {}, { max_attempts = 2 }))
          local d = H.dispatcher(store, { backoff = function() return 0 end })
          local stop = H.stopper(d)
          local n = 0
          d:handle("v10", function(_, ctx)
            n = n + 1
            assert(ctx:progress { n = n })
            if n == 1 then error("first", 0) end
            stop()
          end)
          assert.is_true((H.run(d, 10)))
          local r = assert(store:get(failing))
          assert.equal("completed", r.status)
          assert.same({ n = 2 }, r.progress)
          assert.equal(1, #r.errors)
          assert.equal("first", r.errors[1].error)
          store:close()
        end)

        it("postgresql: a table of schema version 8 is migrated by open; the claims of every relaybus on it then keep a pause (they all call the same function)", function()
          local url = entry.url()
          local t = S.unique("v9")
          local store = assert(relaybus.open(url, { table = t }))
          back_to_version_8(store, t)           -- and migrated from there to 9
          store = claims_then_migrates(url, store, t, 8)
          assert(store:enqueue_many { { "pz", {} }, { "pz", {} }, { "free", {} } })
          assert.is_true(store:pause("pz"))
          -- the function as each relaybus calls it: of 11 (this one, 7 and 8), 10 and 9 arguments
          for _, args in ipairs { ", true, true", ", true", "" } do
            local ok, rows = store:transaction(function(tx)
              return tx:query('SELECT c_id, c_topic, c_settled FROM "' .. t .. '_claim"('
                .. "ARRAY['pz', 'free'], 10, 30, 'tok', NULL, NULL, NULL, NULL, NULL" .. args .. ")")
            end)
            assert.is_true(ok, rows)
            local claimed = {}
            for _, r in ipairs(rows) do
              if r.c_settled == nil then claimed[#claimed + 1] = r.c_topic end
            end
            -- (the first call claims "free"; the ones after find nothing else due)
            assert.same(args == ", true, true" and { "free" } or {}, claimed, args)
          end
          assert.equal(2, #assert(store:list { topic = "pz", status = "pending" }))
          store:close()
        end)
      end
    end
  end)

  describe("errors carry no secret of the URL", function()
    it("for PostgreSQL and MongoDB URLs the drivers refuse or cannot reach", function()
      for _, url in ipairs {
        "postgresql://u:SECRETPW@127.0.0.1:1/x?connect_timeout=2",
        "postgresql://u:SEC%zzRETPW@127.0.0.1:1/x",
        "postgresql://u:SECRETPW/SECRETPX@127.0.0.1:1/x",
        "postgresql://u:SECRETPW@127.0.0.1:notaport/x",
        "postgres://127.0.0.1:1/x?password=SECRETPW&connect_timeout=2",
        "mongodb://u:SECRETPW@127.0.0.1:1/x?serverSelectionTimeoutMS=300&connectTimeoutMS=300",
        "mongodb://u:SEC%zzRETPW@127.0.0.1:1/x",
        "mongodb://u:SECRETPW/SECRETPX@127.0.0.1:1/x",
        "nosuch://u:SECRETPW@h/x",
        "sqlite://u:SECRETPW@h/x",
      } do
        for _, migrate in ipairs { true, false } do
          local s, err = relaybus.open(url, { migrate = migrate })
          assert.is_nil(s, url)
          H.one_line(err, url)
          for _, secret in ipairs { "SECRETPW", "SECRETPX", "zzRETPW" } do
            assert.is_nil(err:find(secret, 1, true), url .. ": " .. err)
          end
        end
      end
    end)

    it("relaybus._redact_url and relaybus._redact_secrets hide passwords and secret parameters", function()
      local r, s = relaybus._redact_url, relaybus._redact_secrets
      assert.equal("postgresql://u:***@h:5432/db", r("postgresql://u:pw123@h:5432/db"))
      assert.equal("postgresql://u:***@h/db", r("postgresql://u:a/b+c=@h/db"))
      assert.equal("mongodb://h/db?authSource=admin&password=***", r("mongodb://h/db?authSource=admin&password=x"))
      assert.equal("host=h password=*** user=u", r("host=h password=p user=u"))
      assert.equal("sqlite:app.db", r("sqlite:app.db"))
      assert.equal("postgresql://u@h/db", r("postgresql://u@h/db"))
      assert.equal('bad "***" and ***', s('bad "SEC%52ET" and SECRET', "postgresql://u:SEC%52ET@h"))
      -- libpq reads u:xyz/abcd/efg@h as host u, port xyz, and quotes such pieces back
      assert.equal("invalid port ***/***", s("invalid port abcd/efg", "postgresql://u:xyz/abcd/efg@h"))
      assert.equal("a\0***", s("a\0p@ss", "mongodb://u:p%40ss@h"))
    end)

    -- libpq's options= carries "-c name=value" settings for the server, any of which may be a
    -- secret whatever its name, and percent-encoded in a URL ("-c%20password%3Dx").
    it("relaybus._redact_url hides all of a PostgreSQL options=, _redact_secrets each setting's value", function()
      local r, s = relaybus._redact_url, relaybus._redact_secrets
      assert.equal("postgresql://u@h/db?options=***", r("postgresql://u@h/db?options=-c%20password%3Dx"))
      assert.equal("postgresql://u@h/db?sslmode=require&options=***&connect_timeout=2",
                   r("postgresql://u@h/db?sslmode=require&options=-c%20app.conf%3Dabc&connect_timeout=2"))
      assert.equal("postgresql://u@h/db?OPTIONS=***", r("postgresql://u@h/db?OPTIONS=--app.x=y+-c+z=w"))
      assert.equal("postgres://u:***@h/db?options=***#x", r("postgres://u:pw@h/db?options=-c%20a%3Db#x"))
      assert.equal("host=h options=*** user=u", r("host=h options='-c password=x' user=u"))
      assert.equal("host=h options=*** user=u", r("host=h options=-capp.conf=hunter22 user=u"))
      assert.equal("host=h options=*** user=u", r("host=h options='-c a=\\' b' user=u"))
      -- the server quotes a setting's value back; the setting's name is no secret
      local url = "postgresql://u@h/db?options=-c%20app.conf%3Dhunter22%20-c%20search_path%3Dsp_x1"
      assert.equal('invalid value for parameter "app.conf": "***"',
                   s('invalid value for parameter "app.conf": "hunter22"', url))
      assert.equal('bad ***, ***', s("bad sp_x1, hunter22", url))
      assert.equal("password authentication failed", s("password authentication failed",
                   "postgresql://u@h/db?options=-c%20password%3Dxyz1"))
      assert.equal("*** and ***", s("hunter22 and opt4", "host=h options='-c app.conf=hunter22 -capp.b=opt4'"))
      assert.equal("***", s("v+w", "postgresql://u@h/db?options=--app.x=v%2Bw%20-c%20b%3Dy"))
    end)

    it("an open error never shows a setting of options=, as written or as the server quotes it", function()
      for _, url in ipairs {
        "nosuch://u@h/x?options=-c%20password%3DSECRETPW",
        "postgresql://u@127.0.0.1:1/x?options=-c%20password%3DSECRETPW&connect_timeout=2",
        "host=127.0.0.1 port=1 connect_timeout=2 options='-c app.conf=SECRETPW'",
      } do
        local st, err = relaybus.open(url)
        assert.is_nil(st, url)
        H.one_line(err, url)
        assert.is_nil(err:find("SECRETPW", 1, true), url .. ": " .. err)
      end
      local pg = os.getenv("RELAYBUS_TEST_PG")
      if not pg then pending("RELAYBUS_TEST_PG is not set") return end
      -- the server refuses the value and quotes it: 'invalid value for parameter ...: "..."'
      local st, err = relaybus.open(pg .. (pg:find("?", 1, true) and "&" or "?")
                                    .. "options=-c%20statement_timeout%3DSECRETPW",
                                    { table = S.unique("opt") })
      assert.is_nil(st)
      H.one_line(err)
      assert.truthy(err:find("statement_timeout", 1, true), err)
      assert.is_nil(err:find("SECRETPW", 1, true), err)
    end)
  end)

  describe("URL forms", function()
    it("refuses sqlite://PATH, suggesting sqlite:PATH, and makes nothing", function()
      local name = S.unique("slashes") .. ".db"
      local s, err = relaybus.open("sqlite://" .. name)
      assert.is_nil(s)
      H.one_line(err)
      assert.truthy(err:find("sqlite:" .. name, 1, true), err)
      assert.is_false(S.exists(name))
      assert.is_false(S.exists("/" .. name))
    end)

    it("opens postgres:// like postgresql://", function()
      local pg = os.getenv("RELAYBUS_TEST_PG")
      if not pg then pending("RELAYBUS_TEST_PG is not set") return end
      local store = assert(relaybus.open((pg:gsub("^postgresql://", "postgres://")), { table = S.unique("pgs") }))
      assert.equal(0, assert(store:stats()).pending)
      store:close()
    end)
  end)
end)
