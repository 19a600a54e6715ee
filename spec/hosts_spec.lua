-- hosts_spec.lua -- relaybus driven from loops that are not libev (issue 13): the example hosts
-- (examples/*_host.*) run examples/workload.lua and print one result line each; here every
-- host must drain, keep a lease through renewals, see ctx.signal and stop gracefully exactly
-- as the command's own libev loop does (examples/libev_host.lua); the frame host must keep its
-- frames short; four runtimes on four threads (and two on one thread) must lose and overlap
-- nothing; a stepped runtime with nothing to do must not busy-poll; and misuse of step fails.
-- The figures are printed. Timing bounds are generous: the machine may be small and loaded.
local S = require "spec.support.stores"

local ROOT = os.getenv("PWD") or "."
local LUA_ENV = "LUA_CPATH=" .. S.quote(S.build .. "/?.so;;") .. " LUA_CPATH_5_4=" .. S.quote(S.build .. "/?.so;;")
local ci = os.getenv("CI") == "true" or os.getenv("CI") == "1"

-- Runs a shell command line from the repository root; returns its output and whether it exited 0.
local function run(cmd)
  local p = assert(io.popen("cd " .. S.quote(ROOT) .. " && " .. cmd .. " 2>&1"))
  local out = p:read("a")
  local ok = p:close()
  return out, ok == true
end

-- The key=value fields of the line of out that starts with prefix.
local function fields(out, prefix)
  local line = out:match("\n" .. prefix .. "[^\n]*") or out:match("^" .. prefix .. "[^\n]*")
  if not line then return nil end
  local f = {}
  for k, v in line:gmatch("([%w_]+)=(%S+)") do f[k] = tonumber(v) or v end
  return f
end

local function db() return "sqlite:" .. S.tmpfile("host") .. ".db" end

local function figure(...)
  io.stderr:write("\n    ", string.format(...), "\n")
end

-- The hosts: how to start each with the workload's key=value args.
local hosts = {
  { name = "frame_host (poll(), 60 Hz, 2 ms budget)", cmd = function(args)
      return S.quote(S.build .. "/frame_host") .. " " .. args end },
  { name = "uv_host (libuv)", cmd = function(args) return S.quote(S.build .. "/uv_host") .. " " .. args end },
  { name = "luv_host.lua (lua5.4 + luv)", cmd = function(args)
      return LUA_ENV .. " lua5.4 examples/luv_host.lua " .. args end },
  { name = "cqueues_host.lua (lua5.4 + cqueues)", cmd = function(args)
      return LUA_ENV .. " lua5.4 examples/cqueues_host.lua " .. args end },
}

-- What must be the same on every host as on libev: the lease, signal and shutdown checks.
local SAME = { "ok", "long_kept", "long_renewed", "long_status", "long_attempts", "signal", "on_abort",
               "timeout_error", "slow_quick", "slow_stuck", "stuck_status", "stuck_attempts" }

describe("hosts that step relaybus from their own loop:", function()
  local ref
  setup(function()
    local out, ok = run(S.quote(S.bin) .. " run examples/libev_host.lua url=" .. db() .. " n=300 lease=2")
    ref = fields(out, "result ")
    assert(ok and ref, "the libev reference run failed:\n" .. out)
    figure("libev reference: %s", out:match("result [^\n]*"))
  end)

  for _, h in ipairs(hosts) do
    it(h.name .. " drains, keeps a lease through renewals, and signals and stops as on libev", function()
      local out, ok = run(h.cmd("url=" .. db() .. " n=300 lease=2"))
      local r = fields(out, "result ")
      assert.is_not_nil(r, out)
      assert.is_true(ok, out)
      for _, k in ipairs(SAME) do
        assert.equal(ref[k], r[k], k .. " differs from libev's:\n" .. out)
      end
      assert.equal(300, r.completed, out)
      -- the renewals came in time: the lease never came within 0.2 s of its local end (a
      -- renewal every third of the 2 s lease leaves ~0.95 s when stepped on time; a loaded
      -- machine may stall the host for a few hundred ms)
      assert.is_true(r.long_margin > 0.2, out)
      -- the timeout abort came at its time (0.3 s from the run's start), not at some later
      -- step; a frame budget may put the handler's first resume off by a frame or so
      assert.is_true(r.signal_after >= 0.2 and r.signal_after < 2, out)
      -- the stop aborted the stuck run at 4/5 of its 1.5 s timeout and ended by it
      assert.is_true(r.stop_secs < 1.5 + 1, out)
      figure("%s: %s", h.name, out:match("result [^\n]*"))
    end)
  end

  it("frame_host keeps its frame time p99 under 17 ms with 200 handlers sleeping and working", function()
    -- 200 at once, each sleeping up to 50 ms and computing 0.5 ms in 0.2 ms slices, with 1 ms
    -- of the game's own work per frame. The best of three runs counts: a loaded machine may
    -- preempt the host in the middle of a frame, which no budget can help.
    -- The store's file goes on tmpfs when there is one: SQLite's commits and checkpoints block
    -- the loop thread on the disk (100-300 ms stalls seen on a busy shared disk), which is the
    -- store's cost, not the budget's; bench/run.sh measures on the disk.
    local shm = S.exists("/dev/shm") and os.execute("test -d /dev/shm -a -w /dev/shm")
    local best, lines = math.huge, {}
    for attempt = 1, 3 do
      local file = shm and ("/dev/shm/" .. S.unique("relaybus_frame") .. ".db") or (S.tmpfile("frame") .. ".db")
      local out, ok = run(S.quote(S.build .. "/frame_host") .. " url=sqlite:" .. file ..
                          " n=2000 concurrency=200 sleep=0.05 work=0.0005 checks=0")
      if shm then os.execute("rm -f " .. S.quote(file) .. "*") end
      assert.is_true(ok, out)
      local r = fields(out, "result ")
      assert.equal(2000, r.completed, out)
      local ft = fields(out, "frame_time ")
      local fi = fields(out, "frame_interval ")
      assert.is_not_nil(ft, out)
      lines[#lines + 1] = string.format("run %d: frame_time p50=%.2f p99=%.2f max=%.2f ms, interval p50=%.2f p99=%.2f ms, %s",
                                        attempt, ft.p50, ft.p99, ft.max, fi.p50, fi.p99,
                                        out:match("frames=[^\n]*"))
      best = math.min(best, ft.p99)
      if best < 17 then break end
    end
    figure("frame_host, 2000 deliveries at concurrency 200:\n      %s", table.concat(lines, "\n      "))
    -- A sanitizer build runs several times slower: its frame times are shown, not judged.
    if not S.build:find("build%-asan$") then assert.is_true(best < 17, table.concat(lines, "\n")) end
  end)

  it("threads_host: four threads, a runtime and a SQLite file each, all drain; nothing lost or overlapped", function()
    local dir = S.tmpfile("threads")
    assert(os.execute("mkdir -p " .. S.quote(dir)))
    local out, ok = run(S.quote(S.build .. "/threads_host") .. " --sqlite " .. S.quote(dir) .. " n=300 lease=2 concurrency=64")
    assert.is_true(ok, out)
    local c = fields(out, "check ")
    assert.same({ 1, 1200, 0, 0 }, { c.ok, c.ids, c.missing, c.overlaps }, out)
    local n = 0
    for line in out:gmatch("runtime %d+%.%d+: result ok=1[^\n]*") do n = n + 1 end
    assert.equal(4, n, out)
    figure("threads_host sqlite: %s; %s", out:match("check [^\n]*"), out:match("threads=[^\n]*"))
  end)

  it("threads_host: two runtimes on each of two threads, stepped by one poll()", function()
    local dir = S.tmpfile("threads2")
    assert(os.execute("mkdir -p " .. S.quote(dir)))
    local out, ok = run(S.quote(S.build .. "/threads_host") .. " --threads 2 --per-thread 2 --sqlite " ..
                        S.quote(dir) .. " n=200 lease=2 concurrency=64")
    assert.is_true(ok, out)
    local c = fields(out, "check ")
    assert.same({ 1, 800, 0, 0 }, { c.ok, c.ids, c.missing, c.overlaps }, out)
  end)

  local pg = os.getenv("RELAYBUS_TEST_PG")
  if (pg and pg ~= "") or ci then
    it("threads_host: four runtimes drain one PostgreSQL table at once; nothing lost, nothing overlapped", function()
      assert(pg and pg ~= "", "RELAYBUS_TEST_PG is not set and CI=true")
      local tbl = S.unique("threads")
      local out, ok = run(S.quote(S.build .. "/threads_host") .. " --pg " .. S.quote(pg) .. " --table " ..
                          tbl .. " n=4000 lease=3")
      assert.is_true(ok, out)
      local c = fields(out, "check ")
      assert.same({ 1, 4000, 0, 0 }, { c.ok, c.ids, c.missing, c.overlaps }, out)
      -- every runtime took part, and the table agrees: 4000 completed, nothing else left
      local n = 0
      for done in out:gmatch("runtime %d+%.%d+: result ok=1 completed=(%d+)") do
        n = n + 1
      end
      assert.equal(4, n, out)
      local relaybus = S.relaybus()
      local store = assert(relaybus.open(pg, { table = tbl }))
      local st = assert(store:stats())
      store:close()
      assert.equal(4000, st.completed)
      assert.equal(0, st.pending + st.processing + st.buried)
      figure("threads_host postgresql: %s; %s", out:match("check [^\n]*"), out:match("threads=[^\n]*"))
    end)
  else
    pending("threads_host on PostgreSQL (RELAYBUS_TEST_PG is not set)")
  end

  it("a stepped runtime with nothing to do does not busy-poll (CPU well under 1% of a core)", function()
    local out, ok = run(LUA_ENV .. " lua5.4 spec/support/idle_host.lua " .. db() .. " 3")
    assert.is_true(ok, out)
    local r = fields(out, "idle ")
    assert.is_not_nil(r, out)
    figure("idle stepped runtime: %s", out:match("idle [^\n]*"))
    -- a busy poll costs a whole core; the goal is < 1%: 5% is a generous bound for a loaded
    -- machine, and the step count (the default poll_interval is 1 s) shows no spinning
    assert.is_true(r.cpu_pct < 5, out)
    assert.is_true(r.steps < 100, out)
  end)

  it("step refuses a bad budget and a call from inside the runtime; a host that hung has its runs aborted first", function()
    local out, ok = run(LUA_ENV .. " lua5.4 spec/support/step_attacks.lua " .. db())
    assert.is_true(ok, out)
    local r = {}
    for k, v in out:gmatch("([%w_]+)=([^\n]*)") do r[k] = v end
    for _, k in ipairs({ "budget_nan", "budget_negative", "budget_huge" }) do
      assert.equal("relaybus: step: budget must be a number of seconds >= 0", r[k], out)
    end
    assert.equal("relaybus: step: called from inside the runtime (a handler, a task or a callback)", r.inside, out)
    -- 2.5 lease durations without a step: the first step aborts the run before its (long due)
    -- sleep timer can answer
    assert.equal("aborted", r.frozen_sleep, out)
    assert.equal("lease", r.frozen_reason, out)
    assert.equal("0", r.busy, out)
  end)
end)
