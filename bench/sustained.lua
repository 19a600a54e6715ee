-- sustained.lua -- sustained load on PostgreSQL: this process enqueues RATE deliveries a second,
-- steadily (a batch every 10 ms), for SECONDS while WORKERS processes (bench/sustained_worker.lua)
-- run handlers of 1 to 20 ms with retention RETENTION s. Every 10 s it reads the table's and
-- its indexes' size and its dead and live tuples from the server; at the end, per minute: the
-- enqueued count, the start delay p50/p99 (from the workers' histograms), the sizes and the
-- dead tuples, and the same as a data file and a gnuplot chart when gnuplot is installed.
--   build/relaybus run bench/sustained.lua URL [SECONDS] [RATE] [WORKERS] [RETENTION] [OUTDIR]
-- Prints "sustained: ..." lines; the goal is flat lines: no decay of the delays, a bounded size.
local relaybus = require "relaybus"
local B = dofile((arg[0]:match("^(.*/)") or "./") .. "common.lua")

local url = assert(arg[1], "usage: sustained.lua URL [SECONDS] [RATE] [WORKERS] [RETENTION] [OUTDIR]")
local SECONDS = tonumber(arg[2]) or 600
local RATE = tonumber(arg[3]) or 3000
local WORKERS = tonumber(arg[4]) or 2
local RETENTION = tonumber(arg[5]) or 60
local OUTDIR = arg[6] or "bench/out"
local bin = os.getenv("RELAYBUS_BIN") or "build/relaybus"
local here = arg[0]:match("^(.*/)") or "./"
assert(url:match("^postgres"), "sustained.lua reads PostgreSQL's statistics: give a postgresql:// URL")

local T = B.table_name("bench_sustained")
local store = B.open(url, { table = T })
local dir = os.tmpname()
os.remove(dir)
assert(os.execute("mkdir -p " .. dir .. " " .. OUTDIR))

local T0 = relaybus.now()
local pids = B.start_workers(dir, WORKERS, function(i)
  return string.format("%s run %ssustained_worker.lua '%s' '%s' %.6f %g '%s/ready.%d'",
    bin, here, url, T, T0, RETENTION, dir, i)
end)

-- The server's view of the table, every 10 s.
local samples = {}
local function sample()
  local ok, rows = store:transaction(function(tx)
    return tx:query("SELECT pg_relation_size($1::regclass) AS heap, pg_indexes_size($1::regclass) AS idx,"
      .. " pg_total_relation_size($1::regclass) AS total, s.n_dead_tup AS dead, s.n_live_tup AS live,"
      .. " s.autovacuum_count AS autovacuums, s.n_tup_hot_upd AS hot, s.n_tup_upd AS upd"
      .. " FROM pg_stat_user_tables s WHERE s.relid = $1::regclass", '"' .. T .. '"')
  end)
  if ok and rows and rows[1] then
    local r = rows[1]
    r.t = relaybus.now() - T0
    samples[#samples + 1] = r
  end
end

-- The enqueuer: RATE/100 every 10 ms, catching up after a late tick so the rate holds.
local enqueued, per_minute = 0, {}
local stop_at = relaybus.now() + SECONDS
relaybus.spawn(function()
  local start = relaybus.now()
  while relaybus.now() < stop_at do
    local due = math.floor((relaybus.now() - start) * RATE)
    local n = math.min(due - enqueued, RATE)      -- at most a second's worth at once
    if n > 0 then
      local list, now = {}, relaybus.now()
      for k = 1, n do list[k] = { "work", { t = now, i = enqueued + k } } end
      assert(store:enqueue_many(list))
      enqueued = enqueued + n
      local m = math.floor((now - T0) / 60)
      per_minute[m] = (per_minute[m] or 0) + n
    end
    relaybus.sleep(0.01)
  end
end)
relaybus.spawn(function()
  local next_sample = relaybus.now()
  while relaybus.now() < stop_at + 5 do
    if relaybus.now() >= next_sample then
      sample()
      next_sample = next_sample + 10
    end
    relaybus.sleep(0.5)
  end
end)
relaybus.run()

-- Let the workers finish what is due (at most 60 s), then stop them.
local left
for _ = 1, 600 do
  local s = assert(store:stats())
  left = s.pending + s.processing
  if left == 0 then break end
  relaybus.sleep(0.1)
end
sample()
os.execute("kill -TERM " .. table.concat(pids, " ") .. " 2>/dev/null")

-- Merge the workers' histograms per minute.
local LOG_STEP = math.log(1.02)
local function bucket_value(k) return k == 0 and 0 or 1e-4 * math.exp((k - 0.5) * LOG_STEP) end
local merged, ran = {}, 0
for i = 1, WORKERS do
  local text
  for _ = 1, 300 do
    local f = io.open(dir .. "/w" .. i .. ".log")
    text = f and f:read("a") or ""
    if f then f:close() end
    if text:find("HIST ") then break end
    relaybus.sleep(0.1)
  end
  local json = text:match("HIST (%b{})")
  if not json then
    print(string.format("sustained: NOTE worker %d gave no histogram (see %s)", i, dir))
  else
    local h = relaybus.json.decode(json)
    ran = ran + h.ran
    for _, m in ipairs(h.minutes) do
      local mm = merged[m.m] or {}
      merged[m.m] = mm
      for _, kn in ipairs(m.h) do mm[kn[1]] = (mm[kn[1]] or 0) + kn[2] end
    end
  end
end
local function quantiles(h)
  local ks, total = {}, 0
  for k, n in pairs(h) do ks[#ks + 1] = k; total = total + n end
  table.sort(ks)
  local function q(p)
    local want, seen = math.max(1, math.ceil(p * total)), 0
    for _, k in ipairs(ks) do
      seen = seen + h[k]
      if seen >= want then return bucket_value(k) end
    end
    return 0 / 0
  end
  return total, q(0.5), q(0.99)
end
-- The last sample of each minute.
local by_minute = {}
for _, s in ipairs(samples) do by_minute[math.floor(s.t / 60)] = s end

local mib = function(b) return (b or 0) / 1048576 end
print(string.format("sustained: postgresql, %d s, %s/s enqueued steadily by another process, %d workers"
  .. " (handlers of 1-20 ms, defaults, retention %g s): enqueued %s, ran %s, %d left at the end",
  SECONDS, B.int(RATE), WORKERS, RETENTION, B.int(enqueued), B.int(ran), left))
print("sustained: minute  enqueued  started  delay_p50_ms  delay_p99_ms  heap_MiB  index_MiB  dead_tuples  live_tuples  autovacuums")
local data = assert(io.open(OUTDIR .. "/sustained.dat", "w"))
data:write("# minute enqueued started p50_ms p99_ms heap_mib index_mib dead live\n")
local last_minute = math.floor(SECONDS / 60) - (SECONDS % 60 == 0 and 1 or 0)
for m = 0, last_minute do
  local n, p50, p99 = quantiles(merged[m] or {})
  local s = by_minute[m] or {}
  print(string.format("sustained: %6d  %8s  %7s  %12.2f  %12.2f  %8.1f  %9.1f  %11s  %11s  %11s", m + 1,
    B.int(per_minute[m] or 0), B.int(n), p50 * 1000, p99 * 1000, mib(s.heap), mib(s.idx),
    B.int(s.dead or 0), B.int(s.live or 0), tostring(s.autovacuums or "-")))
  data:write(string.format("%d %d %d %.3f %.3f %.2f %.2f %d %d\n", m + 1, per_minute[m] or 0, n,
    p50 * 1000, p99 * 1000, mib(s.heap), mib(s.idx), s.dead or 0, s.live or 0))
end
data:close()
local last = samples[#samples] or {}
if last.upd and last.upd > 0 then
  print(string.format("sustained: updates %s, of them HOT %s (%.0f%%)", B.int(last.upd), B.int(last.hot),
    100 * last.hot / last.upd))
end

if os.execute("command -v gnuplot >/dev/null 2>&1") then
  local plot = string.format([[
set terminal pngcairo size 1000,700
set output '%s/sustained.png'
set multiplot layout 2,1 title 'relaybus sustained load: %s/s, %d workers, handlers 1-20 ms, retention %g s'
set ylabel 'start delay (ms)'
set logscale y
plot '%s/sustained.dat' using 1:4 with linespoints title 'p50', '' using 1:5 with linespoints title 'p99'
unset logscale y
set xlabel 'minute'
set ylabel 'MiB / thousand tuples'
plot '%s/sustained.dat' using 1:6 with linespoints title 'heap MiB', '' using 1:7 with linespoints title 'index MiB', '' using 1:($8/1000) with linespoints title 'dead tuples (k)'
unset multiplot
]], OUTDIR, B.int(RATE), WORKERS, RETENTION, OUTDIR, OUTDIR)
  local f = assert(io.open(dir .. "/plot.gp", "w"))
  f:write(plot)
  f:close()
  if os.execute("gnuplot " .. dir .. "/plot.gp 2>/dev/null") then
    print("sustained: chart " .. OUTDIR .. "/sustained.png, data " .. OUTDIR .. "/sustained.dat")
  end
end
B.drop_pg_table(store, T)
os.execute("rm -rf " .. dir)
store:close()
