-- common.lua -- helpers shared by the benchmark scripts (loaded with dofile from bench/X.lua).
local relaybus = require "relaybus"
local M = {}

-- Resident memory of this process, in KiB (VmRSS from /proc/self/status).
function M.rss_kib()
  local f = io.open("/proc/self/status")
  if not f then return nil end
  for line in f:lines() do
    local kb = line:match("^VmRSS:%s+(%d+)%s+kB")
    if kb then f:close(); return tonumber(kb) end
  end
  f:close()
end

-- Private anonymous memory of this process, in KiB (RssAnon): VmRSS less the pages of mapped
-- files, which for relaybus are mostly its client libraries' (libmongoc, libcurl, libpq and
-- their TLS, Kerberos and LDAP libraries: about 12 MiB, shared between processes).
function M.anon_kib()
  local f = io.open("/proc/self/status")
  if not f then return nil end
  for line in f:lines() do
    local kb = line:match("^RssAnon:%s+(%d+)%s+kB")
    if kb then f:close(); return tonumber(kb) end
  end
  f:close()
end

function M.mib(kib) return kib and kib / 1024 or 0 / 0 end

-- Opens a store or stops with its message.
function M.open(url, opts)
  local store, err = relaybus.open(url, opts)
  if not store then
    io.stderr:write("bench: cannot open ", url, ": ", tostring(err), "\n")
    os.exit(1)
  end
  return store
end

-- Enqueues n deliveries of one topic with enqueue_many in chunks; returns the seconds taken.
-- With groups > 0, delivery i joins ordered group "g" .. i % groups (round robin, so every
-- group holds n / groups, spread over the whole backlog).
function M.fill(store, topic, n, chunk, groups)
  chunk = chunk or 1000
  local t0 = relaybus.now()
  local i = 0
  while i < n do
    local list = {}
    for k = 1, math.min(chunk, n - i) do
      local opts = groups and groups > 0 and { group = "g" .. (i + k) % groups } or nil
      list[k] = { topic, { i = i + k }, opts }
    end
    assert(store:enqueue_many(list))
    i = i + #list
  end
  return relaybus.now() - t0
end

-- Starts n worker processes: cmd(i) is the shell command of worker i (without redirection);
-- its output goes to DIR/wI.log. Waits until each has created DIR/ready.I (at most 60 s);
-- returns their pids.
function M.start_workers(dir, n, cmd)
  local pids = {}
  for i = 1, n do
    local h = assert(io.popen(string.format("%s >'%s/w%d.log' 2>&1 & echo $!", cmd(i), dir, i)))
    pids[i] = h:read("l")
    h:close()
  end
  local t = relaybus.now()
  local function ready()
    for i = 1, n do
      local f = io.open(dir .. "/ready." .. i)
      if not f then return false end
      f:close()
    end
    return true
  end
  while not ready() do
    if relaybus.now() - t > 60 then error("workers did not start: see " .. dir) end
    relaybus.sleep(0.02)
  end
  return pids
end

-- A table name unique to this run, for the server stores (the throwaway servers are shared by
-- several scripts of one run).
function M.table_name(prefix)
  return string.format("%s_%d_%d", prefix, os.time(), math.random(0, 99999))
end

-- Drops a PostgreSQL store's table and what its migrations made beside it (docs/stores.md).
function M.drop_pg_table(store, T)
  return store:transaction(function(tx)
    tx:exec('DROP TABLE IF EXISTS "' .. T .. '", "' .. T .. '_leases"')
    -- (the table's triggers go with it; the claim function has three argument lists since
    -- schema 7)
    local claim = '"' .. T .. '_claim"(text[], bigint, float8, text, bigint[], text[], integer[], float8[], text[]'
    tx:exec('DROP FUNCTION IF EXISTS "' .. T .. '_enq", "' .. T .. '_notify", ' .. claim .. '), '
      .. claim .. ', boolean), ' .. claim .. ', boolean, boolean), "' .. T .. '_pending_topics"')
    tx:exec("DELETE FROM relaybus_schema WHERE table_name = $1", T)
  end)
end

-- Percentile (0..100) of a sorted array, nearest rank.
function M.percentile(sorted, p)
  if #sorted == 0 then return 0 / 0 end
  local k = math.max(1, math.min(#sorted, math.ceil(p / 100 * #sorted)))
  return sorted[k]
end

-- "12345" -> "12,345"
function M.int(n)
  local s = string.format("%d", math.floor(n + 0.5))
  local out = s:reverse():gsub("(%d%d%d)", "%1,"):reverse()
  return (out:gsub("^,", ""))
end

return M
