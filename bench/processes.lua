-- processes.lua -- many worker processes on one database: fills N no-op deliveries, starts P
-- `relaybus run bench/processes_worker.lua` processes, lets them all go at once, and times
-- until every delivery is completed (read from the store), then stops them with SIGTERM.
--   build/relaybus run bench/processes.lua URL [N] [P] [CONCURRENCY] [LABEL]
-- Prints: LABEL processes: P x concurrency C drained N in S s = R/s
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

local dir = os.tmpname()
os.remove(dir)
assert(os.execute("mkdir -p " .. dir))
local pids = B.start_workers(dir, P, function(i)
  return string.format("%s run %sprocesses_worker.lua '%s' '%s' %d '%s/go' '%s/ready.%d'",
    bin, here, url, url:match("^sqlite:") and "-" or tbl, C, dir, dir, i)
end)
local t0, w0 = relaybus.now(), relaybus.time()
io.open(dir .. "/go", "w"):close()
-- Polled slowly: a count over the table is not free, and the end comes from the workers.
local s
repeat
  relaybus.sleep(0.25)
  s = assert(store:stats())
until s.completed >= N or relaybus.now() - t0 > 300
os.execute("kill -TERM " .. table.concat(pids, " ") .. " 2>/dev/null")
local last, ran = 0, {}
for i = 1, P do
  local got
  for _ = 1, 300 do
    local f = io.open(dir .. "/w" .. i .. ".log")
    local text = f and f:read("a") or ""
    if f then f:close() end
    local n, l = text:match("RAN (%d+) LAST ([%d.]+)")
    if n then got = true; ran[#ran + 1] = n; last = math.max(last, tonumber(l)); break end
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
store:close()
