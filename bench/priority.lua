-- priority.lua -- latency under load: enqueue-to-start of a topic enqueued every 20 ms while a
-- backlog of N deliveries of another topic drains, first with both topics in one lane, then
-- with the urgent topic given {priority = 10} (docs/lua.md: d:handle's lanes).
--   build/relaybus run bench/priority.lua URL [N] [LABEL]
-- Prints: LABEL priority: LANES urgent start p50 X ms, p99 Y ms (K samples) during a backlog of N
local relaybus = require "relaybus"
local B = dofile((arg[0]:match("^(.*/)") or "./") .. "common.lua")

local url = arg[1] or "sqlite:bench-priority.db"
local N = tonumber(arg[2]) or 50000
local label = arg[3] or url:match("^(%a+):") or "store"

local function pct(xs, p)
  table.sort(xs)
  return xs[math.max(1, math.ceil(#xs * p))] or 0 / 0
end

local function measure(lanes)
  local opts = url:match("^sqlite:") and {} or { table = B.table_name("bench_prio") }
  local u = url
  if url:match("^sqlite:") then u = url:gsub("%.db$", "") .. "-" .. lanes .. ".db" end
  local store = B.open(u, opts)
  B.fill(store, "bulk", N, 1000)
  local d = relaybus.dispatcher(store, { concurrency = 64, lease_duration = 60 })
  local done, delays, sent = 0, {}, 0
  d:handle("bulk", function(_, ctx)
    ctx:sleep(0.001)
    done = done + 1
    if done == N then relaybus.spawn(function() d:stop { timeout = 30 } end) end
  end)
  d:handle("urgent", function(delivery)
    delays[#delays + 1] = (relaybus.now() - delivery.payload.t) * 1000
  end, lanes == "priority" and { priority = 10 } or nil)
  relaybus.spawn(function()
    relaybus.sleep(0.2)                  -- the backlog is running by then
    while done < N * 0.9 do
      sent = sent + 1
      store:enqueue("urgent", { t = relaybus.now() })
      relaybus.sleep(0.02)
    end
  end)
  d:start()
  relaybus.run()
  print(string.format("%s priority: %s urgent start p50 %.1f ms, p99 %.1f ms (%d samples) during a backlog of %s",
    label, lanes == "priority" and "{priority = 10}" or "one lane", pct(delays, 0.5), pct(delays, 0.99),
    #delays, B.int(N)))
  store:close()
end

measure("one")
measure("priority")
