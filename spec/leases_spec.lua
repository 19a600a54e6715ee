-- leases_spec.lua -- named leases (docs/lua.md "Named leases", issue 5): store:try_acquire and
-- relaybus.local_leases() handles (deadline, signal, extend, release, late release), two holders
-- never overlapping across processes, a holder frozen with SIGSTOP past its deadline, d:every
-- across processes (one killed), every's run stopped at its deadline, and retention.
--
-- Worker processes are spec/support/lease_*.lua; they log on the monotonic clock
-- (relaybus.now(), CLOCK_MONOTONIC), which this process shares with them.
-- RELAYBUS_LEASE_CONTEND_S overrides how long the five contending processes run (default 20 s
-- on SQLite, 8 s on the server stores).
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local relaybus = S.relaybus()

local CONTEND = S.support .. "/lease_contend.lua"
local FROZEN = S.support .. "/lease_frozen.lua"
local EVERY = S.support .. "/lease_every.lua"

local TOL = 0.15 -- scheduling slack on a loaded machine

-- Main chunk: runs relaybus's loop (relaybus.sleep) between tries of `cond`, so lease timers
-- fire while we wait. Returns cond's value, or nil after `timeout` s.
local function poll(cond, timeout)
  local limit = relaybus.now() + (timeout or 5)
  while true do
    local v = cond()
    if v then return v end
    if relaybus.now() > limit then return nil end
    relaybus.sleep(0.01)
  end
end

local parse = S.parse_log

local function find(path, kind)
  for _, f in ipairs(parse(path)) do
    if f[1] == kind then return f end
  end
end

local function errors_of(path)
  local out = {}
  for _, f in ipairs(parse(path)) do
    if f[1] == "ERR" then out[#out + 1] = table.concat(f, " ") end
  end
  return out
end

-- The backends of the in-process cases: relaybus.local_leases() and every store of the matrix.
local backends = {
  { name = "local_leases", open = function() return relaybus.local_leases() end },
}
for _, entry in ipairs(S.list()) do
  local b = { name = entry.name, entry = entry }
  function b.open()
    local store, url = S.open(entry)
    b.url = url
    return store
  end
  backends[#backends + 1] = b
end

for _, backend in ipairs(backends) do
  describe("named leases on " .. backend.name .. ":", function()
    local leases
    before_each(function() leases = backend.open() end)
    after_each(function()
      if leases and leases.close then leases:close() end
      leases = nil
    end)

    it("try_acquire returns a handle (name, a monotonic deadline just under now + duration, a signal not aborted), and nil while the name is held", function()
      local name = S.unique("lease")
      local t0 = relaybus.now()
      local h, err = leases:try_acquire(name, 2)
      local t1 = relaybus.now()
      assert.is_nil(err)
      assert.is_not_nil(h, "try_acquire on a free name returned nil")
      assert.equal(name, h.name)
      assert.is_number(h.deadline)
      -- measured from just before the claim was sent, less a safety margin: never after
      -- now + duration, and not much before it
      assert.is_true(h.deadline <= t1 + 2, string.format("deadline %.3f s after the call returned + 2 s",
        h.deadline - (t1 + 2)))
      assert.is_true(h.deadline >= t0 + 2 - 0.25, string.format("deadline %.3f s before the call + 2 s",
        t0 + 2 - h.deadline))
      assert.is_false(h.signal.aborted)
      -- held: another claim on the name is an ordinary nil, not an error
      local h2, err2 = leases:try_acquire(name, 2)
      assert.is_nil(h2)
      assert.is_nil(err2)
      -- another name is independent
      local other = leases:try_acquire(name .. "_other", 2)
      assert.is_not_nil(other)
      assert.is_true(other:release())
      assert.is_true(h:release())
    end)

    -- Found by the hostile pass: a NUL cut the name, so "job\0one" and "job\0two" shared one
    -- lease (the second was refused as held); bytes that are not UTF-8 failed at the store only.
    it("try_acquire refuses a name with a NUL, not UTF-8, empty or over 255 bytes, and names differing after byte 1 are distinct", function()
      for _, bad in ipairs { "job\0one", "caf\233", "", string.rep("n", 256) } do
        local err = H.raises_relaybus(function() return leases:try_acquire(bad, 2) end)
        assert.truthy(err:find("UTF-8 without NUL", 1, true), err)
      end
      local a = assert(leases:try_acquire("job-one", 2))
      local b = assert(leases:try_acquire("job-two", 2))
      assert.is_true(a:release())
      assert.is_true(b:release())
      local ok = assert(leases:try_acquire(string.rep("n", 255), 2))
      assert.is_true(ok:release())
    end)

    if backend.entry then
      it("d:every refuses the same names at the call (its lease is every:NAME), not later in its task", function()
        local d = H.dispatcher(leases)
        for _, bad in ipairs { "job\0one", "caf\233", "", string.rep("n", 250) } do
          local err = H.raises_relaybus(function() d:every(bad, 1, function() end) end)
          assert.truthy(err:find("UTF-8 without NUL", 1, true), err)
        end
        d:every(string.rep("n", 249), 1, function() end)
      end)

      -- (the random calls found it: every read the store's freed struct through the dispatcher)
      it("a dispatcher whose store was closed refuses every and start with a one-line misuse", function()
        local url, opts = select(2, S.open(backend.entry))
        local store = assert(relaybus.open(url, opts))
        local d = H.dispatcher(store)
        store:close()
        for what, call in pairs { every = function() d:every("after-close", 1, function() end) end,
                                  start = function() d:start() end } do
          local err = H.raises_relaybus(call)
          assert.equal("relaybus: " .. what .. ": the dispatcher's store is closed", err)
        end
      end)
    end

    it("expiry frees the name: another claim succeeds once the holder's deadline has passed, not before", function()
      local name = S.unique("lease")
      local a = assert(leases:try_acquire(name, 0.6))
      local misses = 0
      local b = poll(function()
        local h = leases:try_acquire(name, 5)
        if not h then misses = misses + 1 end
        return h
      end, 5)
      local t_got = relaybus.now()
      assert.is_not_nil(b, "the name was never freed after the holder's 0.6 s lease")
      assert.is_true(misses > 0, "the name was free while the first holder held it")
      assert.is_true(t_got >= a.deadline, string.format("taken over %.3f s before the holder's deadline",
        a.deadline - t_got))
      assert.is_true(t_got <= a.deadline + 0.5, string.format("taken over only %.3f s after the deadline",
        t_got - a.deadline))
      assert.is_true(a.signal.aborted)
      assert.is_false(b.signal.aborted)
      assert.is_true(b:release())
    end)

    it("extend moves the deadline forward and keeps the name past the original deadline", function()
      local name = S.unique("lease")
      local h = assert(leases:try_acquire(name, 0.6))
      local first = h.deadline
      relaybus.sleep(0.2)
      local t0 = relaybus.now()
      local ok, err = h:extend(1.5)
      local t1 = relaybus.now()
      assert.is_nil(err)
      assert.is_true(ok)
      assert.is_true(h.deadline > first + 0.5, string.format("deadline moved by %.3f s only", h.deadline - first))
      assert.is_true(h.deadline <= t1 + 1.5 and h.deadline >= t0 + 1.5 - 0.2,
        string.format("extended deadline is now %+.3f s, want about 1.5", h.deadline - t1))
      -- past the original deadline the name is still ours and the signal has not fired
      assert.truthy(poll(function() return relaybus.now() > first + 0.1 end, 3))
      assert.is_false(h.signal.aborted)
      assert.is_nil(leases:try_acquire(name, 1))
      -- an extension never shortens: extend() (the acquire's 0.6 s) keeps the later deadline
      local later = h.deadline
      assert.is_true(h:extend())
      assert.is_true(h.deadline >= later, string.format("extend() moved the deadline back by %.3f s", later - h.deadline))
      -- once less than that is left, extend() renews for the acquire's duration (less its margin)
      assert.truthy(poll(function() return h.deadline - relaybus.now() < 0.3 end, 3))
      local before = relaybus.now()
      assert.is_true(h:extend())
      H.near(before + 0.6 - 0.2, h.deadline, 0.1, "deadline after extend()")
      assert.is_nil(leases:try_acquire(name, 1))
      assert.is_true(h:release())
    end)

    -- On MongoDB each change of the name takes a version ticket: the holder's own writes in
    -- flight at once would compete for it, and the loser would be refused.
    it("extends of one handle in flight at once, from several tasks, all succeed; the release after them too", function()
      local name = S.unique("lease")
      local h = assert(leases:try_acquire(name, 5))
      local N, results, left = 100, {}, 100
      for i = 1, N do
        relaybus.spawn(function()
          relaybus.sleep((i % 25) * 0.001)
          local ok, err = h:extend(5)
          results[#results + 1] = ok and "ok" or tostring(err)
          left = left - 1
        end)
      end
      assert.truthy(poll(function() return left == 0 end, 20), "the extends did not all answer")
      local want = {}
      for i = 1, N do want[i] = "ok" end
      assert.same(want, results)
      assert.is_false(h.signal.aborted)
      assert.is_nil(leases:try_acquire(name, 1))
      assert.is_true(h:release())
      local b = assert(leases:try_acquire(name, 1), "the name was not free after the release")
      assert.is_true(b:release())
    end)

    it("release frees the name at once; a released handle can neither release nor extend again", function()
      local name = S.unique("lease")
      local h = assert(leases:try_acquire(name, 10))
      assert.is_nil(leases:try_acquire(name, 10))
      local ok, err = h:release()
      assert.is_nil(err)
      assert.is_true(ok)
      local again, aerr = h:release()
      assert.is_nil(again)
      H.one_line(aerr, "second release's error")
      local ext, eerr = h:extend()
      assert.is_nil(ext)
      H.one_line(eerr, "extend after release's error")
      local b = leases:try_acquire(name, 10)
      assert.is_not_nil(b, "the name was not free right after release")
      assert.is_true(b:release())
    end)

    it("a late release (after the deadline, a successor holding) returns nil, err and does not revoke the successor", function()
      local name = S.unique("lease")
      local a = assert(leases:try_acquire(name, 0.4))
      local b = poll(function() return leases:try_acquire(name, 5) end, 5)
      assert.is_not_nil(b, "no successor got the name after the first lease expired")
      local ok, err = a:release()
      assert.is_nil(ok)
      H.one_line(err, "late release's error")
      local ext, eerr = a:extend()
      assert.is_nil(ext)
      H.one_line(eerr, "late extend's error")
      -- the successor still holds: nobody else gets the name, and its own extend works
      assert.is_nil(leases:try_acquire(name, 5))
      assert.is_false(b.signal.aborted)
      assert.is_true(b:extend())
      assert.is_nil(leases:try_acquire(name, 5))
      assert.is_true(b:release())
      local c = leases:try_acquire(name, 5)
      assert.is_not_nil(c, "the name was not free after the successor released it")
      assert.is_true(c:release())
    end)

    it("try_acquire inside a relaybus coroutine returns a handle too (also when the store makes the call wait)", function()
      local name = S.unique("lease")
      if backend.entry and backend.entry.name == "sqlite" then
        -- another connection holds SQLite's write lock for a moment: the claim has to wait
        local ready = S.tmpfile("locked")
        S.spawn(S.support .. "/locker.lua", { backend.url, "-", "0.5", ready })
        assert.truthy(S.wait_for(function() return S.exists(ready) end, 10), "the locker did not take the lock")
      end
      local got = {}
      relaybus.spawn(function()
        local h, err = leases:try_acquire(name, 5)
        got.type, got.err = type(h), err
        got.ok, got.name = pcall(function() return h.name end)
        if got.ok then
          got.deadline = h.deadline
          got.aborted = h.signal.aborted
          got.again = leases:try_acquire(name, 5)
          got.extended = h:extend()
          got.released = h:release()
        end
      end)
      relaybus.run()
      S.kill_all()
      assert.is_nil(got.err)
      assert.equal("userdata", got.type)
      assert.is_true(got.ok, "the value try_acquire returned in a coroutine is not a lease handle: "
        .. tostring(got.name))
      assert.equal(name, got.name)
      assert.is_number(got.deadline)
      assert.is_false(got.aborted)
      assert.is_nil(got.again)
      assert.is_true(got.extended)
      assert.is_true(got.released)
    end)

    it("handle.signal fires at the deadline (aborted, reason lease); extend after the deadline returns nil, err", function()
      local name = S.unique("lease")
      local h = assert(leases:try_acquire(name, 0.5))
      assert.is_false(h.signal.aborted)
      local fired
      h.signal:on_abort(function(reason) fired = { at = relaybus.now(), reason = reason } end)
      assert.truthy(poll(function() return fired end, 3), "the signal never fired")
      assert.equal("lease", fired.reason)
      assert.is_true(fired.at >= h.deadline, string.format("fired %.3f s before the deadline",
        h.deadline - fired.at))
      assert.is_true(fired.at <= h.deadline + 0.1, string.format("fired %.3f s after the deadline",
        fired.at - h.deadline))
      assert.is_true(h.signal.aborted)
      assert.equal("lease", h.signal.reason)
      assert.has_error(function() h.signal:check() end)
      -- nobody took the name over, yet past the deadline the claim is not ours any more
      local ok, err = h:extend()
      assert.is_nil(ok)
      H.one_line(err, "extend after the deadline's error")
      local rok, rerr = h:release()
      assert.is_nil(rok)
      H.one_line(rerr, "release after the deadline's error")
    end)
  end)
end

for _, entry in ipairs(S.list()) do
  describe("named leases across processes on " .. entry.name .. ":", function()
    local store, url, opts
    local tbl = function() return opts.table or "-" end
    before_each(function() store, url, opts = S.open(entry) end)
    after_each(S.reset)
    teardown(function() S.cleanup() end)

    it("two holders never overlap: five processes contend for one name, holding, extending, releasing and letting it expire", function()
      H.near(S.mono(), relaybus.now(), 0.5, "relaybus.now() against CLOCK_MONOTONIC")
      local run_for = tonumber(os.getenv("RELAYBUS_LEASE_CONTEND_S") or "")
        or (entry.name == "sqlite" and 20 or 8)
      local name = S.unique("contend")
      local until_ = relaybus.now() + 1 + run_for
      local procs, logs = {}, {}
      local seed0 = os.time() % 100000
      for i = 1, 5 do
        logs[i] = S.tmpfile("contend" .. i) .. ".log"
        procs[i] = S.spawn(CONTEND, { url, tbl(), logs[i], name, "0.5", string.format("%.6f", until_),
          tostring(seed0 * 10 + i) })
      end
      for i = 1, 5 do
        local rc = S.wait_exit(procs[i], run_for + 30)
        assert.equal(0, rc, "contender " .. i .. " exited with " .. tostring(rc) .. ": "
          .. (S.read(procs[i].err) or ""))
        assert.is_table(find(logs[i], "DONE"), "contender " .. i .. " did not finish its log")
        assert.same({}, errors_of(logs[i]))
      end
      local all, holders, kinds, late_ok, bad_signal = {}, {}, {}, {}, {}
      for i = 1, 5 do
        for _, f in ipairs(parse(logs[i])) do
          if f[1] == "I" then
            local iv = { p = i, s = tonumber(f[2]), e = tonumber(f[3]), how = f[4],
                         extends = tonumber(f[5]) }
            assert.is_true(iv.e >= iv.s, "an interval ending before it started: " .. table.concat(f, " "))
            all[#all + 1] = iv
            holders[i] = (holders[i] or 0) + 1
            kinds[iv.how] = (kinds[iv.how] or 0) + 1
            if iv.extends > 0 then kinds.extended = (kinds.extended or 0) + 1 end
            if f[6] ~= "-" and f[6] ~= "nil" then late_ok[#late_ok + 1] = table.concat(f, " ") end
          elseif f[1] == "SIGNAL" then
            bad_signal[#bad_signal + 1] = table.concat(f, " ")
          end
        end
      end
      table.sort(all, function(a, b) return a.s < b.s end)
      local overlaps, held = {}, 0
      local last -- the interval ending last so far
      for _, iv in ipairs(all) do
        if last and iv.s < last.e then
          overlaps[#overlaps + 1] = string.format("process %d [%.4f, %.4f] (%s) and process %d [%.4f, %.4f] (%s)",
            last.p, last.s, last.e, last.how, iv.p, iv.s, iv.e, iv.how)
        end
        if not last or iv.e > last.e then last = iv end
        held = held + (iv.e - iv.s)
      end
      local nholders = 0
      for _ in pairs(holders) do nholders = nholders + 1 end
      if os.getenv("RELAYBUS_SPEC_VERBOSE") then
        local k = {}
        for kind, n in pairs(kinds) do k[#k + 1] = kind .. "=" .. n end
        io.stderr:write(string.format("\n%s: %d holdings in %d s by %d processes, held %.0f%% of the time (%s)\n",
          entry.name, #all, run_for, nholders, 100 * held / (run_for + 1), table.concat(k, " ")))
      end
      assert.same({}, overlaps)
      assert.same({}, late_ok, "a release after the deadline succeeded")
      assert.same({}, bad_signal, "an expired handle's signal was not aborted with reason lease")
      assert.is_true(#all >= run_for * 1.2, string.format("the name was held only %d times in %d s", #all, run_for))
      assert.is_true(nholders >= 3, "only " .. nholders .. " of 5 processes ever held the name")
      assert.is_true((kinds.release or 0) > 0, "no holding ended with a release")
      assert.is_true((kinds.expire or 0) > 0, "no holding ended with an expiry")
      assert.is_true((kinds.extended or 0) > 0, "no holding was extended")
      assert.is_true(held >= run_for * 0.3, string.format("the name was held %.1f s of %d", held, run_for))
    end)

    it("a holder frozen with SIGSTOP past its deadline sees its signal aborted when thawed, and cannot release or extend the successor's claim", function()
      local name = S.unique("frozen")
      local log = S.tmpfile("frozen") .. ".log"
      local A = S.spawn(FROZEN, { url, tbl(), log, name, "1.5" })
      local hline = S.wait_for(function() return find(log, "H") or find(log, "NOLEASE") end, 20)
      assert.is_table(hline, "the holder did not start: " .. (S.read(A.err) or ""))
      assert.equal("H", hline[1], "the holder did not get the name")
      local deadline = tonumber(hline[3])
      assert.truthy(S.signal(A, "STOP"))
      local t_stop = relaybus.now()
      assert.is_true(t_stop < deadline - 0.2, "the holder was frozen too late to test anything")
      -- the successor: this process, once the store has let the frozen claim expire
      local b = poll(function() return store:try_acquire(name, 10) end, 10)
      assert.is_not_nil(b, "the name was not freed while its holder was frozen")
      assert.is_true(relaybus.now() > deadline)
      assert.is_nil(find(log, "A"), "the frozen holder logged while stopped")
      local t_cont = relaybus.now() -- just before the thaw
      assert.truthy(S.signal(A, "CONT"))
      local a = S.wait_for(function() return find(log, "A") end, 10)
      assert.is_table(a, "the thawed holder logged no abort: " .. (S.read(A.err) or ""))
      assert.equal(0, S.wait_exit(A, 10))
      -- A <seen> <aborted> <reason> <extend_ok> <extend_err> <release_ok> <release_err>
      assert.is_true(tonumber(a[2]) >= t_cont, string.format("the abort was seen %.3f s before the thaw",
        t_cont - tonumber(a[2])))
      assert.is_true(tonumber(a[2]) <= t_cont + 1, "the abort came late after the thaw")
      assert.equal("true", a[3])
      assert.equal("lease", a[4])
      assert.equal("nil", a[5], "extend by the thawed holder")
      assert.is_true(a[6] ~= nil and a[6] ~= "nil", "extend by the thawed holder gave no error")
      assert.equal("nil", a[7], "release by the thawed holder")
      assert.is_true(a[8] ~= nil and a[8] ~= "nil", "release by the thawed holder gave no error")
      -- the successor still holds
      assert.is_false(b.signal.aborted)
      assert.is_nil(store:try_acquire(name, 10), "the successor's claim was revoked")
      assert.is_true(b:extend())
      assert.is_true(b:release())
      assert.is_not_nil(store:try_acquire(name, 1))
    end)

    -- (the case CI's LeakSanitizer found: a d:every process stopped with an extend in flight)
    it("a script that ends with an acquire, an extend and a release in flight exits at once, cleanly (each one's record is freed: LeakSanitizer under ASan)", function()
      local p = S.spawn(S.support .. "/lease_inflight.lua", { url, tbl(), S.unique("inflight") })
      local t0 = relaybus.now()
      assert.equal(0, S.wait_exit(p, 20), "the script failed: " .. (S.read(p.err) or ""))
      assert.equal("STARTED\n", S.read(p.out))
      assert.equal("", S.read(p.err) or "")
      -- (it did not wait for the 3 s late answers: the state closed with them in flight)
      assert.is_true(relaybus.now() - t0 < 2.5, "the script waited for its lease operations")
    end)

    it("d:every: three processes, one killed mid-run, run the work about once per interval, never twice at once, with no gap longer than interval + lease", function()
      local interval = 1
      local total = 9
      local name = S.unique("every")
      local logs, procs, killed_at = {}, {}, {}
      for i = 1, 3 do
        logs[i] = S.tmpfile("every" .. i) .. ".log"
        procs[i] = S.spawn(EVERY, { url, tbl(), logs[i], name, tostring(interval) })
      end
      for i = 1, 3 do
        assert.truthy(S.wait_for(function() return find(logs[i], "READY") end, 20),
          "every process " .. i .. " did not start: " .. (S.read(procs[i].err) or ""))
      end
      local t0 = relaybus.now()
      -- midway, kill the process that is running fn (an S without its E)
      local victim = S.wait_for(function()
        if relaybus.now() - t0 < total / 2 then return nil end
        for i = 1, 3 do
          local open = {}
          for _, f in ipairs(parse(logs[i])) do
            if f[1] == "S" then open[f[2]] = true elseif f[1] == "E" then open[f[2]] = nil end
          end
          if next(open) then return i end
        end
      end, total)
      if not victim then
        local errs = {}
        for i = 1, 3 do errs[#errs + 1] = (S.read(procs[i].err) or ""):gsub("\n+$", "") end
        assert.is_not_nil(victim, "no process was seen running fn in " .. total .. " s; their stderr: "
          .. table.concat(errs, " | "))
      end
      assert.equal(137, S.kill(procs[victim]))
      killed_at[victim] = relaybus.now()
      local t_kill = killed_at[victim]
      assert.truthy(S.wait_for(function() return relaybus.now() - t0 >= total end, total + 5))
      for i = 1, 3 do
        if i ~= victim then
          S.signal(procs[i], "TERM")
          assert.equal(0, S.wait_exit(procs[i], 15), "every process " .. i .. " did not stop: "
            .. (S.read(procs[i].err) or ""))
          killed_at[i] = relaybus.now()
        end
      end
      local runs, by = {}, {}
      for i = 1, 3 do
        local open = {}
        for _, f in ipairs(parse(logs[i])) do
          if f[1] == "S" then
            open[f[2]] = { p = i, s = tonumber(f[2]), deadline = tonumber(f[3]) }
          elseif f[1] == "E" then
            local r = assert(open[f[2]], "an end without a start")
            open[f[2]] = nil
            r.e = tonumber(f[3])
            assert.equal("true", f[4], "fn's sleep was cut short: " .. table.concat(f, " "))
            runs[#runs + 1] = r
          end
        end
        for _, r in pairs(open) do -- killed mid-run: it ran until the kill at the latest
          r.e = killed_at[i]
          r.killed = true
          runs[#runs + 1] = r
        end
      end
      table.sort(runs, function(a, b) return a.s < b.s end)
      local overlaps, gaps, short = {}, {}, {}
      local maxgap = 0
      for k, r in ipairs(runs) do
        by[r.p] = (by[r.p] or 0) + 1
        assert.is_true(r.e <= r.deadline + TOL, "a run went past its deadline")
        if k > 1 then
          local p = runs[k - 1]
          if r.s < p.e then
            overlaps[#overlaps + 1] = string.format("process %d [%.3f, %.3f] and process %d [%.3f, %.3f]",
              p.p, p.s, p.e, r.p, r.s, r.e)
          end
          local gap = r.s - p.s
          maxgap = math.max(maxgap, gap)
          if gap > interval + interval + TOL then
            gaps[#gaps + 1] = string.format("%.3f s between the runs starting at %.3f (process %d) and %.3f (process %d)",
              gap, p.s, p.p, r.s, r.p)
          end
          if gap < interval - TOL then
            short[#short + 1] = string.format("%.3f s between runs at %.3f and %.3f", gap, p.s, r.s)
          end
        end
      end
      local span = runs[#runs].s - runs[1].s
      if os.getenv("RELAYBUS_SPEC_VERBOSE") then
        io.stderr:write(string.format("\n%s: every: %d runs over %.1f s, longest gap %.3f s, by process %s/%s/%s, killed %d\n",
          entry.name, #runs, span, maxgap, by[1] or 0, by[2] or 0, by[3] or 0, victim))
      end
      assert.same({}, overlaps)
      assert.same({}, gaps)
      assert.same({}, short, "runs closer together than the interval")
      -- about one run per interval (a successor takes the name a little after the expiry)
      assert.is_true(#runs >= 2 and (#runs - 1) >= span / (interval * 1.6),
        string.format("%d runs over %.1f s with a %g s interval", #runs, span, interval))
      local after = 0
      for _, r in ipairs(runs) do if r.s > t_kill and r.p ~= victim then after = after + 1 end end
      assert.is_true(after >= 2, "the survivors ran the work only " .. after .. " times after the kill")
      assert.is_true((by[victim] or 0) >= 1)
    end)
  end)

  describe("every and retention on " .. entry.name .. ":", function()
    local store, url, tbl
    before_each(function()
      local _
      store, url, _, tbl = S.open(entry)
    end)
    after_each(S.reset)

    it("every stops a run at its deadline: ctx:sleep past the interval returns nil, \"aborted\" and ctx.signal is aborted", function()
      local d = H.dispatcher(store)
      local stop = H.stopper(d, 2)
      local got
      d:every(S.unique("slow"), 0.5, function(ctx)
        if got then return end
        local r = { start = relaybus.now(), deadline = ctx.deadline, before = ctx.signal.aborted }
        r.ok, r.err = ctx:sleep(5)
        r.stop = relaybus.now()
        r.aborted, r.reason = ctx.signal.aborted, ctx.signal.reason
        got = r
        stop()
      end)
      assert.is_true(H.run(d, 10), "the every run did not end (fn ran: " .. tostring(got ~= nil) .. ")")
      assert.is_table(got, "fn never ran")
      assert.is_false(got.before)
      assert.is_nil(got.ok)
      assert.equal("aborted", got.err)
      assert.is_true(got.aborted)
      assert.equal("lease", got.reason)
      -- the local deadline ends the lease's margin (0.2 s here) before the store's expiry
      assert.is_true(got.deadline <= got.start + 0.5 and got.deadline >= got.start + 0.5 - 0.25,
        string.format("ctx.deadline is %+.3f s from the start, the interval is 0.5", got.deadline - got.start))
      assert.is_true(got.stop >= got.deadline - 0.005, string.format("the sleep ended %.3f s before the deadline",
        got.deadline - got.stop))
      assert.is_true(got.stop <= got.deadline + TOL, string.format("the sleep ended %.3f s after the deadline",
        got.stop - got.deadline))
    end)

    -- Runs `d:every(name, interval, fn)` from the first run's start for `span` seconds; fn
    -- gets the run's number (1...) and its ctx. Returns the starts, relative to the first.
    local function every_starts(interval, span, fn)
      local d = H.dispatcher(store)
      local stop = H.stopper(d, 2)
      local t0
      local starts = {}
      d:every(S.unique("rate"), interval, function(ctx)
        t0 = t0 or relaybus.now()
        starts[#starts + 1] = relaybus.now() - t0
        if #starts == 1 then
          relaybus.spawn(function()
            relaybus.sleep(span)
            stop()
          end)
        end
        fn(#starts, ctx)
      end)
      assert.is_true(H.run(d, span + 10), "the dispatcher did not stop")
      local text = {}
      for i, s in ipairs(starts) do text[i] = string.format("%.3f", s) end
      return starts, table.concat(text, " ")
    end

    it("every keeps a fixed rate: every(0.5) whose fn takes 0.15 s starts runs at multiples of 0.5 s from the first, 6 in 2.75 s", function()
      local starts, text = every_starts(0.5, 2.75, function(_, ctx) ctx:sleep(0.15) end)
      assert.is_true(#starts >= 5 and #starts <= 7, #starts .. " runs in 2.75 s: " .. text)
      for k, s in ipairs(starts) do
        assert.is_true(math.abs(s - (k - 1) * 0.5) <= TOL,
          string.format("run %d started at %+.3f s, not at %.1f s (all: %s)", k, s, (k - 1) * 0.5, text))
      end
    end)

    it("every: a run that overruns its interval (it extends its lease) is followed at once by the next, then by the grid, without a burst of the runs missed", function()
      local ended
      local starts, text = every_starts(0.5, 2.3, function(k, ctx)
        if k == 2 then
          assert(ctx.lease:extend(3))
          ctx:sleep(1.2)          -- from 0.5 to 1.7: the runs due at 1.0 and 1.5 are missed
          ended = relaybus.now()
        end
      end)
      assert.is_number(ended, "the second run did not end: " .. text)
      -- 0, 0.5, then at once at about 1.7 (the run of the grid's 1.5), then 2.0
      assert.equal(4, #starts, "runs started at " .. text)
      assert.is_true(math.abs(starts[2] - 0.5) <= TOL, text)
      assert.is_true(math.abs(starts[3] - 1.7) <= TOL, "the run after the overrun started at " .. text)
      assert.is_true(math.abs(starts[4] - 2.0) <= TOL, "the run after that left the grid: " .. text)
    end)

    it("every: a run that releases its lease, or raises, is followed by the next at the grid's time", function()
      local starts, text = every_starts(0.3, 1.05, function(k, ctx)
        if k % 2 == 1 then assert(ctx.lease:release()) else error("run " .. k .. " fails") end
      end)
      assert.equal(4, #starts, "runs started at " .. text)
      for k, s in ipairs(starts) do
        assert.is_true(math.abs(s - (k - 1) * 0.3) <= TOL, "run " .. k .. " off the grid: " .. text)
      end
    end)

    it("every runs nothing on a lease whose answer came past its deadline (a process frozen between the acquire and the run)", function()
      local testing = S.testing()
      -- every acquire is answered 0.5 s late: past the deadline of a 0.3 s lease
      local slow = assert(testing.faults(store, { ops = { lease_acquire = { late = 1 } },
        min_delay = 0.5, max_delay = 0.5 }))
      local d = H.dispatcher(slow)
      local ran = 0
      d:every(S.unique("late"), 0.3, function() ran = ran + 1 end)
      d:start()
      local t0 = relaybus.now()
      relaybus.spawn(function() relaybus.sleep(1.8) d:stop() end)
      assert.is_true(H.run(d, 10), "the dispatcher did not stop")
      assert.is_true(relaybus.now() - t0 >= 1.7)
      assert.is_true((testing.fault_stats(slow).injected.late.lease_acquire or 0) >= 2, "fewer than 2 late acquires")
      assert.equal(0, ran, "a run started on a lease already over")
      -- on time, the same job runs
      local d2 = H.dispatcher(store)
      local stop = H.stopper(d2, 2)
      d2:every(S.unique("late"), 0.3, function() ran = ran + 1; stop() end)
      assert.is_true(H.run(d2, 10))
      assert.equal(1, ran)
    end)

    it("every: ctx.lease is the run's own: after the run its calls are misuse; d:every after start is misuse", function()
      local d = H.dispatcher(store)
      local stop = H.stopper(d, 2)
      local kept
      d:every(S.unique("kept"), 0.3, function(ctx)
        if kept then return end
        kept = ctx.lease
        assert.is_string(kept.name)
        assert.is_number(kept.deadline)
        assert.is_true(kept:extend(0.5))
        relaybus.spawn(function() relaybus.sleep(0.1) stop() end)
      end)
      assert.is_true(H.run(d, 10))
      assert.is_not_nil(kept, "fn never ran")
      H.raises_relaybus(kept.extend, kept)
      H.raises_relaybus(kept.release, kept)
      local d2 = H.dispatcher(store)
      d2:start()
      H.raises_relaybus(d2.every, d2, "late", 1, function() end)
      d2:stop()
    end)

    it("every with an interval of 100 years runs once and its task lives on (nothing on stderr)", function()
      local script = S.tmpfile("every_max") .. ".lua"
      S.write(script, table.concat({
        'local relaybus = require "relaybus"',
        'local store = assert(relaybus.open(' .. string.format("%q", url) .. ', {table = ' .. string.format("%q", tbl) .. '}))',
        'local d = relaybus.dispatcher(store, {poll_interval = 0.05})',
        'd:every("max", 3155760000, function(ctx) print("ran", ctx.deadline - relaybus.now() > 3e9) end)',
        'd:start()',
        'relaybus.spawn(function() relaybus.sleep(0.5) d:stop() end)',
      }, "\n"))
      local rc, out, err = S.run_command({ S.bin, "run", script })
      assert.equal(0, rc, err)
      assert.equal("ran\ttrue\n", out)
      assert.equal("", err)
    end)

    it("retention = 1 purges completed deliveries once they are older than 1 s, more than one batch of them, and leaves pending ones", function()
      -- 1,100: more than one purge batch (1,000 a batch in the prelude); MongoDB drains far
      -- slower here (tens a second), so it gets fewer
      local N, M = entry.name == "mongodb" and 60 or 1100, 7
      local items = {}
      for i = 1, N do items[i] = { "ret.done", { i = i } } end
      local pending = {}
      for i = 1, M do pending[i] = { "ret.later", { i = i } } end -- no handler: stays pending
      assert(store:enqueue_many(pending))
      local d = H.dispatcher(store, { retention = 1, concurrency = 64 })
      local stop = H.stopper(d, 2)
      local returns = {} -- {id=, at=}: when each run returned (its delivery settles just after)
      d:handle("ret.done", function(delivery)
        returns[#returns + 1] = { id = delivery.id, at = relaybus.now() }
      end)
      local res = { young = {} }
      -- the deliveries whose run returned less than 0.7 s ago are still there (completed, or
      -- processing while their completion is written): the last few are looked up by id
      local function check_young()
        local t = relaybus.now()
        for k = #returns, math.max(1, #returns - 2), -1 do
          local r = returns[k]
          if r.at <= t - 0.7 then break end
          if not store:get(r.id) then
            res.young[#res.young + 1] = string.format("%s, completed %.3f s before, is gone", r.id, t - r.at)
          end
        end
        return store:stats()
      end
      relaybus.spawn(function()
        local t0 = relaybus.now()
        assert(store:enqueue_many(items))
        res.all_ran = H.poll(function()
          local st = check_young()
          return #returns >= N and st.processing == 0 and st.pending == M
        end, 40)
        res.ran, res.t_ran = #returns, relaybus.now() - t0
        res.gone = H.poll(function() return check_young().completed == 0 end, 8)
        res.t_gone = relaybus.now()
        res.stats = store:stats()
        stop()
      end)
      assert.is_true(H.run(d, 80), "the retention run did not end")
      assert.truthy(res.all_ran, string.format("only %d of %d deliveries ran in %.1f s", res.ran, N, res.t_ran))
      assert.same({}, res.young, "completed deliveries younger than 1 s were purged")
      local last_return = returns[#returns].at
      assert.truthy(res.gone, res.stats.completed .. " of " .. N
        .. " completed deliveries older than 1 s were not purged")
      assert.is_true(res.t_gone >= last_return + 1 - 0.05,
        string.format("purged %.3f s after the last completion, before 1 s", res.t_gone - last_return))
      assert.equal(0, res.stats.completed)
      assert.equal(M, res.stats.pending)
      assert.equal(0, res.stats.buried + res.stats.processing)
      assert.equal(M, #assert(store:list { status = "pending" }))
    end)
  end)
end
