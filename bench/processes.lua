-- processes.lua -- many worker processes on one database, as they run in production: started
-- once and warm. Starts P `relaybus run bench/processes_worker.lua` processes and warms them
-- with a first burst (WARM deliveries a process, untimed: each opens its connections, and
-- their server backends compile the claim function and prepare their statements). Then, while
-- they sit idle, it commits N no-op deliveries in one transaction (with `own`, one transaction
-- per table, committed together) and times from that commit to the last completion; then
-- stops them with SIGTERM.
--   build/relaybus run bench/processes.lua URL [N] [P] [CONCURRENCY] [LABEL] [own]
-- With `own` (PostgreSQL), each process drains a table of its own (N/P deliveries each): the
-- same processes, connections and work with nothing shared between them but the server and
-- the machine's cores, so the figure beside the one-table figure parts what contention on one
-- table costs from what the number of processes costs on this machine. Its end is the last
-- process's last completion (the processes finish within about 5% of each other here).
-- Prints: LABEL processes: P x concurrency C drained N in S s = R/s, how long the last
-- process took to complete its first delivery of the burst, and where the CPU went: the
-- workers' (from /proc) and, on PostgreSQL, the server's (every process of the cluster, when
-- this process may read them), per 1,000 deliveries: time that grows with P is what many
-- processes cost.
local relaybus = require "relaybus"
local B = dofile((arg[0]:match("^(.*/)") or "./") .. "common.lua")

local url = arg[1] or "sqlite:bench-processes.db"
local N = tonumber(arg[2]) or 100000
local P = tonumber(arg[3]) or 2
local C = tonumber(arg[4]) or 64
local label = arg[5] or url:match("^(%a+):") or "store"
local own = arg[6] == "own"
local WARM = 2000
local bin = os.getenv("RELAYBUS_BIN") or "build/relaybus"
local here = arg[0]:match("^(.*/)") or "./"

local is_pg = not url:match("^sqlite:") and not url:match("^mongodb")
assert(not own or is_pg, "processes.lua: `own` tables are for PostgreSQL")
if own then N = N // P * P end
-- The tables: one for every process, or each its own (stores[i] is process i's table).
local tbls, stores = {}, {}
for i = 1, own and P or 1 do
  tbls[i] = B.table_name(own and "bench_procs" .. i .. "_" or "bench_procs")
  stores[i] = B.open(url, is_pg and { table = tbls[i] } or {})
end

-- Enqueues n deliveries of topic on every table, each table in one transaction, all committed
-- together: each transaction fills, then waits for the others before it commits; at_commit()
-- runs once then. Returns the time of the first commit's start.
local function burst(topic, n, at_commit)
  local filled, released, done = 0, nil, 0
  for i, s in ipairs(stores) do
    relaybus.spawn(function()
      assert(s:transaction(function(tx)
        for k = 1, n, 1000 do
          local list = {}
          for j = k, math.min(n, k + 999) do list[#list + 1] = { topic, { i = j } } end
          tx:enqueue_many(list)
        end
        filled = filled + 1
        while filled < #stores do relaybus.sleep(0.001) end
        if not released then
          if at_commit then at_commit() end
          released = relaybus.time()
        end
      end))
      done = done + 1
    end)
  end
  repeat relaybus.sleep(0.001) until done == #stores
  return released
end

-- CPU seconds of some processes, from /proc: those whose pid `want` says yes to (given the
-- pid and its parent's), or nil when none could be read.
local clk_tck, cores
do
  local function number(cmd)
    local h = io.popen(cmd)
    local v = tonumber(h:read("l"))
    h:close()
    return v
  end
  clk_tck, cores = number("getconf CLK_TCK") or 100, number("nproc") or 1
end
local function cpu_of(want)
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
        if want(pid, fields[2]) then
          ticks = ticks + tonumber(fields[12]) + tonumber(fields[13])
          found = true
        end
      end
    end
  end
  ls:close()
  return found and ticks / clk_tck or nil
end
-- The PostgreSQL cluster's processes: the postmaster and its children.
local postmaster
if is_pg then
  local ok, rows = stores[1]:transaction(function(tx) return tx:query("SHOW data_directory") end)
  local f = ok and rows[1] and io.open(rows[1].data_directory .. "/postmaster.pid")
  if f then postmaster = f:read("l"); f:close() end
end
local function server_cpu()
  return postmaster and cpu_of(function(pid, ppid) return pid == postmaster or ppid == postmaster end)
end

-- Whether a table still holds deliveries to run. Polled slowly, and on PostgreSQL by one probe
-- of the live rows' index: stats() counts over the whole table (a parallel sequential scan),
-- and with every 0.25 s of an 8-process drain it was a sixth of the server's CPU (perf),
-- charged to the processes under test. The end itself comes from the workers' own clocks.
local function live_left(want)
  for i, s in ipairs(stores) do
    if is_pg then
      local ok, rows = s:transaction(function(tx)
        return tx:query('SELECT EXISTS (SELECT 1 FROM "' .. tbls[i] .. '"'
          .. " WHERE status IN ('pending', 'processing')) AS live")
      end)
      assert(ok, rows)
      if rows[1].live then return true end
    elseif assert(s:stats()).completed < want then
      return true
    end
  end
  return false
end
local function wait_drained(want, what)
  local t0 = relaybus.now()
  repeat
    relaybus.sleep(0.25)
    if relaybus.now() - t0 > 300 then
      print(string.format("%s processes: INCOMPLETE %d x %d: %s not drained in 300 s", label, P, C, what))
      os.exit(1)
    end
  until not live_left(want)
end

local dir = os.tmpname()
os.remove(dir)
assert(os.execute("mkdir -p " .. dir))
local pids = B.start_workers(dir, P, function(i)
  return string.format("%s run %sprocesses_worker.lua '%s' '%s' %d '%s/ready.%d'",
    bin, here, url, is_pg and tbls[own and i or 1] or "-", C, dir, i)
end)
local is_worker = {}
for _, pid in ipairs(pids) do is_worker[pid] = true end
local function workers_cpu() return cpu_of(function(pid) return is_worker[pid] end) end

-- The warm-up: every process runs some deliveries, and so opens its pool's connections.
local warm, each = own and WARM or WARM * P, own and N // P or N   -- a table's
burst("warm", warm)
wait_drained(warm, "the warm-up")
relaybus.sleep(0.5)   -- the warm-up's completions written, every process idle

local cpu0, wcpu0
local w0 = burst("noop", each, function() cpu0, wcpu0 = server_cpu(), workers_cpu() end)
wait_drained(warm + each, "the burst")
local cpu1, wcpu1 = server_cpu(), workers_cpu()
os.execute("kill -TERM " .. table.concat(pids, " ") .. " 2>/dev/null")
local last, ran, began = 0, {}, 0
for i = 1, P do
  local got
  for _ = 1, 300 do
    local f = io.open(dir .. "/w" .. i .. ".log")
    local text = f and f:read("a") or ""
    if f then f:close() end
    local n, l, first = text:match("RAN (%d+) LAST ([%d.]+) FIRST ([%d.]+)")
    if n then
      got = true
      ran[#ran + 1] = n
      last = math.max(last, tonumber(l))
      began = math.max(began, tonumber(first) - w0)
      break
    end
    relaybus.sleep(0.1)
  end
  if not got then print(string.format("%s processes: NOTE worker %d gave no result (see %s)", label, i, dir)) end
end
local dt = last - w0
local completed = 0
for _, s in ipairs(stores) do completed = completed + assert(s:stats()).completed end
if completed < N + WARM * P then
  print(string.format("%s processes: INCOMPLETE %d x %d: %s of %s", label, P, C, B.int(completed),
    B.int(N + WARM * P)))
  os.exit(1)
end
os.execute("rm -rf " .. dir)
print(string.format("%s processes: %d x concurrency %d%s drained %s in %.2f s = %s/s (per worker: %s;"
  .. " the last to start completed its first after %.3f s)",
  label, P, C, own and ", each on a table of its own," or "", B.int(N), dt, B.int(N / dt),
  table.concat(ran, ", "), began))
local busy = wcpu0 and wcpu1 and cpu0 and cpu1
  and string.format(" (%.0f%% of the %d cores busy)", 100 * (wcpu1 - wcpu0 + cpu1 - cpu0) / dt / cores, cores) or ""
print(string.format("%s processes: %d x concurrency %d: CPU per 1,000 deliveries: workers %s%s%s",
  label, P, C, wcpu0 and wcpu1 and string.format("%.1f ms", 1e6 * (wcpu1 - wcpu0) / N) or "?",
  cpu0 and cpu1 and string.format(", server %.1f ms", 1e6 * (cpu1 - cpu0) / N) or "", busy))
-- The tables go, or autovacuum works through every round's dead rows during the figures
-- measured after this one (the idle workers' server CPU read 24% of a core).
for i, s in ipairs(stores) do
  if is_pg then assert(B.drop_pg_table(s, tbls[i])) end
  s:close()
end
