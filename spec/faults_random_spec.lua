-- faults_random_spec.lua -- random faults at the store interface under several worker processes.
-- Each worker (spec/support/faults_worker.lua) wraps its store with testing.faults, from a
-- seed of its own: operations fail, lose their answer after the write, or answer late. Its
-- handlers do something random on each run (return, raise, ctx:complete/reschedule/bury/
-- release/extend_lease, sleep past the lease, enqueue a child; a share of the deliveries is
-- handled transactionally) and log every run to one shared log. After the drain the spec checks:
--   * none lost: every delivery enqueued (by the spec, or by a handler whose enqueue answered) is
--     completed or buried, or pending with a run_at an hour ahead (a handler asked for that);
--   * none completed unless a run of it returned normally (without an explicit settle) or
--     called ctx:complete() with success or an unknown outcome (an error that does not say the
--     write was refused: a lost answer); none buried unless a run buried it or its attempts ran
--     out; transactional ones: exactly one application row when completed (its fence), none
--     otherwise;
--   * no two runs of one delivery overlap in time (across processes: one monotonic clock), and
--     fences grow strictly from run to run; no two runs of d:every overlap (a named lease). One
--     exception, counted and printed apart: a process frozen past its deadline (one worker is
--     stopped for 1.5 s on purpose; a loaded machine stalls others) cannot abort, so another may
--     start the delivery meanwhile; its run must then end as soon as it thaws. The workers log
--     every stall of their loop (a heartbeat) to tell these apart. Likewise a run waiting for
--     the answer of a settle it sent (the truth, waited for past the deadline) that came after
--     the other run began and did not say "written": its code must end within the grace;
--   * every error and log line is one line; no contract violation of the store was counted.
-- The seeds are printed; RELAYBUS_FAULT_SEED=N replays one (the faults each worker draws follow
-- from it; the interleaving of processes does not). RELAYBUS_FAULT_RANDOM_N=N sets the number of
-- deliveries (default 3,000; FerretDB 300), RELAYBUS_FAULT_MAX_DELAY=S the longest late answer
-- (default 0.1 s; the leases are 1 s).
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local F = require "spec.support.fault_util"
local relaybus = S.relaybus()

local WORKER = S.support .. "/faults_worker.lua"
local SEED = tonumber(os.getenv("RELAYBUS_FAULT_SEED") or "")
  or (os.time() % 100000) * 100 + math.random(0, 99)

-- A small PRNG of the spec's own (the rates, the deliveries' options), apart from math.random.
local function prng(seed)
  local x = seed % 2147483647
  if x <= 0 then x = x + 2147483646 end
  return function()
    x = x * 48271 % 2147483647
    return x / 2147483647
  end
end

-- Errors that say an explicit settle was not written; any other error leaves it unknown. Not
-- "aborted": an abort (the deadline, a failed renewal) ends the wait of a settle whose write is
-- already on its way to the store, and that write may still apply.
local function refused(res)
  return res == "lease_lost" or res == "already_settled"
    or res:find("injected_fault:_settle_failed", 1, true) ~= nil
end

-- The shared log as events.
local function read_log(path)
  local L = { runs = {}, by_key = {}, explicit = {}, children = {}, ticks = {}, stats = {}, stalls = {},
              ready = 0, done = 0, problems = {} }
  local function problem(fmt, ...) L.problems[#L.problems + 1] = string.format(fmt, ...) end
  for _, f in ipairs(S.parse_log(path)) do
    local k = f[1]
    if k == "S" then
      local key = f[2] .. " " .. f[3]
      if L.by_key[key] then problem("fence %s of %s started twice", f[3], f[2]) end
      local run = { id = f[2], fence = tonumber(f[3]), attempts = tonumber(f[4]),
                    s = tonumber(f[5]), pid = f[6], what = f[7], settles = {} }
      L.by_key[key] = run
      L.runs[f[2]] = L.runs[f[2]] or {}
      table.insert(L.runs[f[2]], run)
    elseif k == "E" or k == "C" or k == "X" or k == "Q" or k == "G" then
      local run = L.by_key[f[2] .. " " .. f[3]]
      if not run then
        problem("a %s line without its start: %s", k, table.concat(f, " "))
      elseif k == "E" then
        run.e, run.how = tonumber(f[4]), f[5]
      elseif k == "G" then
        run.g = tonumber(f[4])
      elseif k == "C" then
        run.settles[#run.settles + 1] = { call = "complete", res = f[4], asked = tonumber(f[5]),
                                          answered = tonumber(f[6]) }
      elseif k == "X" then
        run.settles[#run.settles + 1] = { call = f[4], res = f[5], asked = tonumber(f[6]),
                                          answered = tonumber(f[7]) }
      else
        L.children[#L.children + 1] = f[4]
      end
    elseif k == "P" then
      L.stalls[f[2]] = L.stalls[f[2]] or {}
      table.insert(L.stalls[f[2]], { from = tonumber(f[3]), to = tonumber(f[4]), cpu = tonumber(f[5]),
                                     runq = tonumber(f[6]) })
    elseif k == "T" then
      L.ticks[#L.ticks + 1] = { pid = f[2], s = tonumber(f[3]), e = tonumber(f[4]) }
    elseif k == "STATS" then
      L.stats[f[2]] = relaybus.json.decode(f[3])
    elseif k == "READY" then
      L.ready = L.ready + 1
    elseif k == "DONE" then
      L.done = L.done + 1
    end
  end
  return L
end

-- What the runs of one delivery may have done to it: complete (a ctx:complete() that succeeded
-- or whose outcome is unknown, or a return not preceded by a successful explicit settle, which
-- would make the dispatcher ignore it), bury (a ctx:bury() that succeeded or may have),
-- long (likewise for the reschedule by an hour).
local SETTLES = { reschedule = true, reschedule_long = true, bury = true, release = true }
local function outcomes(runs)
  local o = { complete = false, bury = false, long = false }
  for _, run in ipairs(runs or {}) do
    local settled = false
    for _, st in ipairs(run.settles) do
      local maybe = st.res == "ok" or not refused(st.res)
      if maybe and st.call == "complete" then o.complete = true end
      if maybe and st.call == "bury" then o.bury = true end
      if maybe and st.call == "reschedule_long" then o.long = true end
      if st.res == "ok" and SETTLES[st.call] then settled = true end
    end
    if run.how == "ret" and not settled then o.complete = true end
  end
  return o
end

-- The stall of `pid` that froze it at time `at` (the loop did not run), or just before it:
-- a process that thaws runs its overdue timers (its run's deadline among them) only once it
-- is scheduled again, some milliseconds on (6 ms under ASan, seen once), and a takeover in
-- that moment is one it could not have stopped for. Or nil.
local THAW_S = 0.05
local function frozen_at(L, pid, at)
  for _, st in ipairs(L.stalls[pid] or {}) do
    if st.from <= at and at <= st.to + THAW_S then return st end
  end
end

-- The settle call of `run` that was asked before `at` and answered after it without being
-- written (its error says so, or leaves it unknown), when run ended within the grace of that
-- answer, or nil. A settle's answer is waited for past the run's deadline (it is the truth):
-- held up behind a lock (SQLite: a frozen process holds the write lock) it may come after the
-- lease expired and another run began, and the run's code learns of its abort only then, with
-- the grace from then to return (docs/guarantees.md, "A run that learns of its abort late").
-- An answer "ok" is never excused: a written settle means no other run could have begun.
local function late_answer(run, at, ended)
  for _, st in ipairs(run.settles) do
    if st.asked and st.asked < at and st.answered >= at and st.res ~= "ok"
      and ended <= st.answered + 0.25 then
      return st
    end
  end
end

-- The application table's rows per delivery id: id -> {n=, fence=}.
local function app_rows(entry, store, app, ids)
  local per = {}
  if entry.name == "mongodb" then
    for from = 1, #ids, 100 do
      assert(store:transaction(function(tx)
        local c = tx:collection(app)
        for i = from, math.min(from + 99, #ids) do
          local doc = c:find_one { delivery_id = ids[i] }
          local n = 0
          while assert(c:delete_one { delivery_id = ids[i] }) > 0 do n = n + 1 end
          if n > 0 then per[ids[i]] = { n = n, fence = doc and doc.fence } end
        end
      end))
    end
    return per
  end
  local ok, rows = store:transaction(function(tx)
    return tx:query("SELECT delivery_id, count(*) AS n, min(fence) AS fence FROM " .. app
      .. " GROUP BY delivery_id")
  end)
  assert(ok, rows)
  for _, r in ipairs(rows) do
    per[r.delivery_id] = { n = math.tointeger(r.n) or r.n, fence = math.tointeger(r.fence) or r.fence }
  end
  return per
end

for index, entry in ipairs(S.list()) do
  describe("random faults at the store interface on " .. entry.name .. ":", function()
    after_each(S.reset)
    teardown(S.cleanup)

    local n_default = entry.name == "mongodb" and 300 or 3000
    local N = tonumber(os.getenv("RELAYBUS_FAULT_RANDOM_N") or "") or n_default
    local W = entry.name == "mongodb" and 2 or 3

    it(N .. " deliveries, " .. W .. " workers with faults of their own seeds: none lost, none completed"
      .. " or buried without cause, no two runs of one delivery overlap, fences grow, named leases"
      .. " exclusive, one-line errors, no contract violations", function()
      local seed = SEED + index
      local rnd = prng(seed)
      local t0 = relaybus.now()
      io.stderr:write(string.format("\nfaults_random %s: seed %d (replay: RELAYBUS_FAULT_SEED=%d"
        .. " RELAYBUS_SPEC_STORES=%s; worker seeds %d..%d)\n", entry.name, seed, SEED, entry.name,
        seed * 10 + 1, seed * 10 + W))
      local store, url, opts, tbl = S.open(entry)
      local tx = entry.name ~= "mongodb" or H.mongo_rs(entry)
      local app = tx and tbl .. "_app" or nil
      if tx and entry.name ~= "mongodb" then
        assert(store:transaction(function(t)
          t:exec("CREATE TABLE " .. app .. " (delivery_id TEXT NOT NULL, fence BIGINT)")
        end))
      end

      -- the deliveries: a tenth transactional (when the store has transactions), a fifth with
      -- few attempts so raises bury them
      local all, topic_of, batch = {}, {}, {}
      local function flush()
        local ids = assert(store:enqueue_many(batch))
        for i, id in ipairs(ids) do
          all[#all + 1] = id
          topic_of[id] = batch[i][1]
        end
        batch = {}
      end
      for i = 1, N do
        local topic = (tx and rnd() < 0.1) and "tx" or "work"
        local max_attempts = rnd() < 0.2 and 1 + math.floor(rnd() * 3) or 25
        batch[#batch + 1] = { topic, { i = i }, { max_attempts = max_attempts } }
        if #batch == 500 then flush() end
      end
      if #batch > 0 then flush() end
      assert.equal(N, #all)

      local log = S.tmpfile("faults") .. ".log"
      local stopfile = S.tmpfile("stop")
      local procs = {}
      for w = 1, W do
        local env = {
          RB_SEED = tostring(seed * 10 + w),
          RB_FAIL = string.format("%.3f", 0.02 + rnd() * 0.1),
          RB_LOST = string.format("%.3f", 0.02 + rnd() * 0.06),
          RB_LATE = string.format("%.3f", 0.1 + rnd() * 0.3),
          RB_MAX_DELAY = os.getenv("RELAYBUS_FAULT_MAX_DELAY") or "0.1",
          RB_LEASE = "1",
          RB_CONC = entry.name == "mongodb" and "8" or "16",
          RB_STOPFILE = stopfile,
          RB_KIND = entry.name,
          RB_APP = app,
        }
        procs[w] = S.spawn(WORKER, { url, opts.table or "-", log }, { env = env })
      end
      assert.truthy(S.wait_for(function() return read_log(log).ready == W end, 30),
        "the workers did not start: " .. (S.read(procs[1].err) or ""))

      -- drained: nothing processing or due, three times in a row. A third of the way, worker 1
      -- is frozen (SIGSTOP) for 1.5 s, past its leases: what it held runs elsewhere meanwhile.
      local calm, limit = 0, relaybus.now() + (entry.name == "mongodb" and 80 or 70)
      local st, frozen = nil, false
      while calm < 3 do
        if not frozen and st and st.completed >= N // 3 then
          frozen = true
          S.signal(procs[1], "STOP")
          S.sleep(1.5)
          S.signal(procs[1], "CONT")
        end
        for w, p in ipairs(procs) do
          assert.is_nil(S.rc(p), "worker " .. w .. " exited: " .. (S.read(p.err) or ""))
        end
        st = store:stats()
        if st and st.processing == 0 and st.due == 0 then calm = calm + 1 else calm = 0 end
        assert.is_true(relaybus.now() < limit, "not drained in time (seed " .. seed .. "): "
          .. relaybus.json.encode(st or {}))
        S.sleep(0.3)
      end
      S.write(stopfile, "")
      for w, p in ipairs(procs) do
        assert.equal(0, S.wait_exit(p, 30), "worker " .. w .. " did not stop cleanly: "
          .. (S.read(p.err) or ""))
      end

      local L = read_log(log)
      local problems = L.problems
      local function problem(fmt, ...) problems[#problems + 1] = string.format(fmt, ...) end
      if L.done ~= W then problem("%d of %d workers logged DONE", L.done, W) end

      -- the store's view
      local recs = assert(store:list { limit = 10 * (N + #L.children) + 1000 })
      local by_id = {}
      for _, r in ipairs(recs) do by_id[r.id] = r end
      for _, id in ipairs(all) do
        if not by_id[id] then problem("%s was enqueued and is gone", id) end
      end
      for _, id in ipairs(L.children) do
        if not by_id[id] then problem("child %s was enqueued and is gone", id) end
      end
      local wall = relaybus.time()
      local stalled = {}
      local late = {}   -- overlaps with a run that waited for a late settle answer (late_answer)
      local counts = { completed = 0, buried = 0, pending = 0, processing = 0 }
      local done_tx = {}
      for _, r in ipairs(recs) do
        counts[r.status] = (counts[r.status] or 0) + 1
        local runs = L.runs[r.id] or {}
        local o = outcomes(runs)
        if r.last_error and r.last_error:find("\n") then
          problem("%s: last_error is not one line: %q", r.id, r.last_error)
        end
        if r.status == "completed" then
          if not o.complete then
            problem("%s completed without a run that returned or completed it (%d runs)", r.id, #runs)
          end
          if topic_of[r.id] == "tx" then done_tx[r.id] = r end
        elseif r.status == "buried" then
          if not o.bury and r.attempts < r.max_attempts then
            problem("%s buried (%s) at attempt %d of %d without a run that buried it", r.id,
              tostring(r.last_error), r.attempts, r.max_attempts)
          end
        elseif r.status == "pending" then
          if not (o.long and r.run_at > wall + 600) then
            problem("%s left pending, run_at in %.1f s, last_error %s", r.id, r.run_at - wall,
              tostring(r.last_error))
          end
        else
          problem("%s left %s", r.id, r.status)
        end
        -- runs in time order: no overlap, fences strictly growing. A run holds the delivery
        -- until it ends, or until it hands it back (G: ctx:release/reschedule called).
        table.sort(runs, function(a, b) return a.s < b.s end)
        local holder, held_to     -- the earlier run that held the delivery the longest
        for i, run in ipairs(runs) do
          local late_st = held_to and run.s < held_to and late_answer(holder, run.s, held_to)
          if not run.e then
            problem("%s: the run of fence %d (pid %s, %s) never ended", r.id, run.fence, run.pid, run.what)
          elseif held_to and run.s < held_to and frozen_at(L, holder.pid, run.s)
            and held_to <= frozen_at(L, holder.pid, run.s).to + 0.25 then
            -- The holder's process was frozen past its deadline (it cannot abort then) and
            -- ended the run as soon as it ran again: what a lease allows, counted apart.
            local st = frozen_at(L, holder.pid, run.s)
            stalled[#stalled + 1] = string.format("%s: fence %d ran at %.4f while pid %s was frozen"
              .. " [%.4f, %.4f] (%.3f s on a CPU, %.3f s waiting for one) in its run of fence %d,"
              .. " which ended %.3f s after it thawed", r.id, run.fence, run.s, holder.pid, st.from,
              st.to, st.cpu, st.runq, holder.fence, held_to - st.to)
          elseif late_st then
            local st = late_st
            late[#late + 1] = string.format("%s: fence %d ran at %.4f while pid %s waited for the"
              .. " answer of its %s of fence %d, asked at %.4f, answered %s at %.4f; that run"
              .. " ended %.3f s later", r.id, run.fence, run.s, holder.pid, st.call, holder.fence,
              st.asked, st.res, st.answered, held_to - st.answered)
          elseif held_to and run.s < held_to then
            problem("%s: runs overlap: fence %d [%.4f, %.4f] pid %s (%s) and fence %d [%.4f, %.4f] pid %s (%s)",
              r.id, holder.fence, holder.s, held_to, holder.pid, holder.what,
              run.fence, run.s, run.e, run.pid, run.what)
          end
          local to = math.min(run.e or math.huge, run.g or math.huge)
          if not held_to or to > held_to then holder, held_to = run, to end
          if i > 1 and run.fence <= runs[i - 1].fence then
            problem("%s: fence %d ran after fence %d", r.id, run.fence, runs[i - 1].fence)
          end
          if run.fence > r.fence then
            problem("%s: a run had fence %d, the delivery has %d", r.id, run.fence, r.fence)
          end
        end
      end

      -- transactional deliveries: one row each when completed, by the run that completed it
      if app then
        local tx_ids = {}
        for _, id in ipairs(all) do if topic_of[id] == "tx" then tx_ids[#tx_ids + 1] = id end end
        local rows = app_rows(entry, store, app, tx_ids)
        for _, id in ipairs(tx_ids) do
          local row, r = rows[id], by_id[id]
          if done_tx[id] then
            if not row or row.n ~= 1 then
              problem("tx %s completed with %d application rows", id, row and row.n or 0)
            elseif row.fence ~= r.fence then
              problem("tx %s completed at fence %d, its row has fence %s", id, r.fence, tostring(row.fence))
            end
          elseif row then
            problem("tx %s is %s yet has %d application rows", id, r and r.status or "gone", row.n)
          end
        end
      end

      -- named lease: runs of d:every never overlap
      table.sort(L.ticks, function(a, b) return a.s < b.s end)
      local last     -- the earlier tick that ended the latest
      for _, b in ipairs(L.ticks) do
        local st = last and b.s < last.e and frozen_at(L, last.pid, b.s)
        if st and last.e <= st.to + 0.25 then
          stalled[#stalled + 1] = string.format("every 'tick' ran at %.4f in pid %s while pid %s was"
            .. " frozen [%.4f, %.4f] (%.3f s on a CPU, %.3f s waiting for one) in its tick", b.s,
            b.pid, last.pid, st.from, st.to, st.cpu, st.runq)
        elseif last and b.s < last.e then
          problem("every 'tick' overlapped: pid %s [%.4f, %.4f] and pid %s [%.4f, %.4f]",
            last.pid, last.s, last.e, b.pid, b.s, b.e)
        end
        if not last or b.e > last.e then last = b end
      end

      -- the workers: contract checks, one-line errors
      local faults, kinds = 0, { fail = 0, lost = 0, late = 0 }
      for pid, stt in pairs(L.stats) do
        for k, v in pairs(stt.violations) do
          if v ~= 0 then problem("worker %s: %d contract violations (%s) of the store", pid, v, k) end
        end
        if stt.waiting ~= 0 then problem("worker %s: %d operations unanswered at the end", pid, stt.waiting) end
        if stt.multiline_errors ~= 0 then
          problem("worker %s: %d errors of more than one line", pid, stt.multiline_errors)
        end
        faults = faults + stt.faults
        for kind, by_op in pairs(stt.injected) do
          for _, n in pairs(by_op) do kinds[kind] = kinds[kind] + n end
        end
      end
      for w, p in ipairs(procs) do
        local bad, n = F.stray_stderr(p.err)
        for i = 1, math.min(#bad, 3) do
          problem("worker %d printed a line that is not one relaybus: line (of %d): %s", w, n, bad[i])
        end
      end

      local nruns = 0
      for _, list in pairs(L.runs) do nruns = nruns + #list end
      io.stderr:write(string.format("faults_random %s: seed %d, %d deliveries (%d children), %d runs,"
        .. " %d completed, %d buried, %d pending; %d faults injected (fail %d, lost %d, late %d),"
        .. " %d every runs; %d overlaps in a stalled process, %d after a late settle answer; %.1f s;"
        .. " %d problems\n", entry.name, seed, #recs, #L.children, nruns, counts.completed,
        counts.buried, counts.pending, faults, kinds.fail, kinds.lost, kinds.late, #L.ticks,
        #stalled, #late, relaybus.now() - t0, #problems))
      for i = 1, math.min(#stalled, 5) do io.stderr:write("  stalled: " .. stalled[i] .. "\n") end
      for i = 1, math.min(#late, 5) do io.stderr:write("  late answer: " .. late[i] .. "\n") end
      if #problems > 0 then
        for pid, list in pairs(L.stalls) do
          for _, st in ipairs(list) do
            io.stderr:write(string.format("  pid %s stalled [%.4f, %.4f]: %.3f s on a CPU, %.3f s"
              .. " waiting for one\n", pid, st.from, st.to, st.cpu, st.runq))
          end
        end
        local shown = {}
        for i = 1, math.min(#problems, 25) do shown[i] = problems[i] end
        io.stderr:write("  " .. table.concat(shown, "\n  ") .. "\n")
      end
      assert.is_true(faults > 0, "no fault was injected")
      assert.is_true(kinds.fail > 0 and kinds.lost > 0 and kinds.late > 0, "a kind of fault never happened")
      assert.same({}, problems, "seed " .. seed)
    end)
  end)
end
