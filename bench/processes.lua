-- processes.lua -- many worker processes on one database: fills N no-op deliveries, starts P
-- `relaybus run bench/processes_worker.lua` processes, lets them all go at once, and times
-- until every delivery is completed (read from the store), then stops them with SIGTERM.
--   build/relaybus run bench/processes.lua URL [N] [P] [CONCURRENCY] [LABEL]
-- Prints: LABEL processes: P x concurrency C drained N in S s = R/s, and where the CPU went:
-- the workers' own (each reports its CPU time from the start of the drain to its exit) and,
-- on PostgreSQL, the server's (every process of the cluster, from /proc, when this process may
-- read them), per 1,000 deliveries: time that grows with P is what many processes cost.
local relaybus = require "relaybus"
local B = dofile((arg[0]:match("^(.*/)") or "./") .. "common.lua")

local url = arg[1] or "sqlite:bench-processes.db"
local N = tonumber(arg[2]) or 100000
local P = tonumber(arg[3]) or 2
local C = tonumber(arg[4]) or 64
local label = arg[5] or url:match("^(%a+):") or "store"
local bin = os.getenv("RELAYBUS_BIN") or "build/relaybus"
local here = arg[0]:match("^(.*/)") or "./"

local tbl = B.table_name("bench_procs")
local opts = url:match("^sqlite:") and {} or { table = tbl }
local store = B.open(url, opts)
local tfill = B.fill(store, "noop", N, 1000)
print(string.format("%s processes: enqueued %s in %.2f s (setup)", label, B.int(N), tfill))

-- CPU seconds of the PostgreSQL cluster's processes (the postmaster and its children), or nil
-- when its data directory or its processes cannot be read.
local function command_number(cmd)
  local h = io.popen(cmd)
  local v = tonumber(h:read("l"))
  h:close()
  return v
end
local clk_tck = command_number("getconf CLK_TCK") or 100
local cores = command_number("nproc") or 1
local postmaster
if not url:match("^sqlite:") and not url:match("^mongodb") then
  local ok, rows = store:transaction(function(tx) return tx:query("SHOW data_directory") end)
  local f = ok and rows[1] and io.open(rows[1].data_directory .. "/postmaster.pid")
  if f then postmaster = f:read("l"); f:close() end
end
local function server_cpu()
  if not postmaster then return nil end
  local ticks, found = 0, false
  local ls = io.popen("ls /proc")
  for pid in ls:lines() do
    if pid:match("^%d+$") then
      local f = io.open("/proc/" .. pid .. "/stat")
      local st = f and f:read("a")
      if f then f:close() end
      local rest = st and st:match("%) (.*)")
      if rest then
        local fields = {}
        for w in rest:gmatch("%S+") do fields[#fields + 1] = w end
        -- after the name: state ppid ... utime (the 12th) stime (the 13th)
        if pid == postmaster or fields[2] == postmaster then
          ticks = ticks + tonumber(fields[12]) + tonumber(fields[13])
          found = true
        end
      end
    end
  end
  ls:close()
  return found and ticks / clk_tck or nil
end

local dir = os.tmpname()
os.remove(dir)
assert(os.execute("mkdir -p " .. dir))
local pids = B.start_workers(dir, P, function(i)
  return string.format("%s run %sprocesses_worker.lua '%s' '%s' %d '%s/go' '%s/ready.%d'",
    bin, here, url, url:match("^sqlite:") and "-" or tbl, C, dir, dir, i)
end)
local t0, w0 = relaybus.now(), relaybus.time()
local cpu0 = server_cpu()
io.open(dir .. "/go", "w"):close()
-- Polled slowly, and on PostgreSQL by one probe of the live rows' index: stats() counts over
-- the whole table (a parallel sequential scan), and with every 0.25 s of an 8-process drain
-- it was a sixth of the server's CPU (perf), charged to the processes under test. The end
-- itself comes from the workers' own clocks.
local function live_left()
  if postmaster then
    local ok, rows = store:transaction(function(tx)
      return tx:query('SELECT EXISTS (SELECT 1 FROM "' .. tbl .. '"'
        .. " WHERE status IN ('pending', 'processing')) AS live")
    end)
    assert(ok, rows)
    return rows[1].live
  end
  local st = assert(store:stats())
  return st.completed < N
end
repeat
  relaybus.sleep(0.25)
until not live_left() or relaybus.now() - t0 > 300
local s = assert(store:stats())
local cpu1 = server_cpu()
os.execute("kill -TERM " .. table.concat(pids, " ") .. " 2>/dev/null")
local last, ran, worker_cpu = 0, {}, 0
for i = 1, P do
  local got
  for _ = 1, 300 do
    local f = io.open(dir .. "/w" .. i .. ".log")
    local text = f and f:read("a") or ""
    if f then f:close() end
    local n, l, cpu = text:match("RAN (%d+) LAST ([%d.]+) .*CPU ([%d.]+)")
    if n then
      got = true
      ran[#ran + 1] = n
      last = math.max(last, tonumber(l))
      worker_cpu = worker_cpu + tonumber(cpu)
      break
    end
    relaybus.sleep(0.1)
  end
  if not got then print(string.format("%s processes: NOTE worker %d gave no result (see %s)", label, i, dir)) end
end
local dt = last - w0
if s.completed < N then
  print(string.format("%s processes: INCOMPLETE %d x %d: %s of %s in %.1f s", label, P, C,
    B.int(s.completed), B.int(N), relaybus.now() - t0))
  os.exit(1)
end
os.execute("rm -rf " .. dir)
print(string.format("%s processes: %d x concurrency %d drained %s in %.2f s = %s/s (per worker: %s)",
  label, P, C, B.int(N), dt, B.int(N / dt), table.concat(ran, ", ")))
print(string.format("%s processes: %d x concurrency %d: CPU per 1,000 deliveries: workers %.1f ms%s",
  label, P, C, 1e6 * worker_cpu / N,
  cpu0 and cpu1 and string.format(", server %.1f ms (in %.2f s of the drain: %.0f%% of the %d cores busy)",
    1e6 * (cpu1 - cpu0) / N, dt, 100 * (worker_cpu + cpu1 - cpu0) / dt / cores, cores) or ""))
-- The table goes, or autovacuum works through every round's 100,000 dead rows during the
-- figures measured after this one (the idle workers' server CPU read 24% of a core).
if not url:match("^sqlite:") and not url:match("^mongodb") then assert(B.drop_pg_table(store, tbl)) end
store:close()
