-- mongo_tickets_spec.lua -- the MongoDB store's write tickets (runtime/stores/mongo/tickets.c)
-- when a writer died between taking a ticket and writing: what a SIGKILL leaves is planted
-- directly (spec/support/mongo_insert.c), so the takeover that took a minute and a lucky kill
-- in process_spec's stress test happens at once, on every delivery, under several workers.
-- A ticket whose write never landed blocks its delivery until it is STALE_TICKET_S (60 s) old;
-- then exactly one writer may pass it. Two that both pass it would both "win" the same version:
-- two runs of one delivery, with the same fence.
local S = require "spec.support.stores"
local relaybus = S.relaybus()

local WORKER = S.support .. "/worker.lua"
local STALE = 120   -- seconds: well past STALE_TICKET_S

local P = require "spec.support.mongo_plant"
local insert = P.insert

-- The ticket a writer of version v + 1 of delivery `id` takes (cas_init), taken at `at`
-- (the store's clock: the server's, here the same machine's wall clock). A float, as the
-- store writes it.
local function ticket(id, v, at)
  return { _id = string.format("d:%s:%d", id, v), d = "d:" .. id, at = math.floor(at) + 0.5 }
end

-- Both dialects (docs/stores.md): on MongoDB's the write also filters on the version.
for _, entry in ipairs(S.list { dialects = true }) do
  if entry.kind ~= "mongodb" then goto continue end
  describe("write tickets on " .. entry.name .. ":", function()
    local store, url, opts

    local function worker(log, env)
      return S.spawn(WORKER, { url, opts.table, log }, { env = env })
    end

    before_each(function()
      store, url, opts = S.open(entry)
    end)
    after_each(S.reset)
    teardown(function() S.cleanup() end)

    it("a fresh ticket of a writer that died blocks its delivery; once stale, one claim passes it", function()
      local blocked = assert(store:enqueue("work", { i = 1 }))
      local stale = assert(store:enqueue("work", { i = 2 }))
      local now = relaybus.time()
      insert(url, opts.table .. "_tickets", { ticket(blocked, 1, now), ticket(stale, 1, now - STALE) })
      local log = S.tmpfile("w") .. ".log"
      local w = worker(log, { RB_SLEEP = "0.01", RB_POLL = "0.02" })
      assert.truthy(S.wait_for(function() return assert(store:get(stale)).status == "completed" end, 20),
        "the delivery behind a stale ticket was never claimed: " .. (S.read(w.err) or ""))
      S.sleep(1)   -- many claims read `blocked` meanwhile
      assert.equal(0, S.term(w))
      local b, s = assert(store:get(blocked)), assert(store:get(stale))
      assert.equal("pending", b.status)
      assert.equal(0, b.attempts)
      assert.equal(0, b.fence)
      assert.equal(1, s.attempts)
      assert.equal(1, s.fence)
      local runs = {}
      for _, f in ipairs(S.parse_log(log)) do
        if f[1] == "S" then runs[#runs + 1] = f[2] .. " " .. f[4] end
      end
      assert.same({ stale .. " 1" }, runs)
    end)

    it("named leases: a fresh ticket of a writer that died blocks the name; a stale one is passed by one claim", function()
      local blocked, stale = S.unique("lease"), S.unique("lease")
      for _, name in ipairs({ blocked, stale }) do
        assert.is_true(assert(store:try_acquire(name, 5)):release())   -- now at version 1, free
      end
      local now = relaybus.time()
      insert(url, opts.table .. "_tickets", {
        { _id = "l:" .. blocked .. ":2", d = "l:" .. blocked, at = math.floor(now) + 0.5 },
        { _id = "l:" .. stale .. ":2", d = "l:" .. stale, at = math.floor(now - STALE) + 0.5 },
      })
      assert.is_nil(store:try_acquire(blocked, 5))
      local h = store:try_acquire(stale, 5)
      assert.is_not_nil(h, "a name behind a stale ticket was never taken")
      assert.is_nil(store:try_acquire(stale, 5), "taken twice")
      assert.is_true(h:release())
      local again = assert(store:try_acquire(stale, 5), "a passed ticket held the name up")
      assert.is_true(again:release())
    end)

    it("200 deliveries behind stale tickets, 3 workers claiming them at once: each runs once, with fence 1", function()
      local N = tonumber(os.getenv("RB_TICKETS_N") or "") or 200
      local items = {}
      for i = 1, N do items[i] = { "work", { i = i } } end
      local ids = assert(store:enqueue_many(items))
      local now = relaybus.time()
      local docs = {}
      -- first the tickets of a busy hour: FerretDB scans them for any filter but {_id: X}, and a
      -- scan reads one snapshot, so the old removal of a stale ticket had a wide window
      for i = 1, tonumber(os.getenv("RB_TICKETS_PAST") or "") or 2000 do
        docs[#docs + 1] = { _id = "d:past:" .. i, d = "d:past", at = math.floor(now) - 9.5 }
      end
      for _, id in ipairs(ids) do docs[#docs + 1] = ticket(id, 1, now - STALE) end
      insert(url, opts.table .. "_tickets", docs)
      local env = { RB_SLEEP = "0.01", RB_JITTER = "0.02", RB_CONC = "16", RB_POLL = "0.01", RB_LEASE = "30" }
      local logs, procs = {}, {}
      for i = 1, 3 do
        logs[i] = S.tmpfile("w" .. i) .. ".log"
        procs[i] = worker(logs[i], env)
      end
      local runs   -- id -> list of "w<i> fence <f> attempts <a>"
      local function read_runs()
        runs = {}
        local twice = {}
        for i = 1, 3 do
          for _, f in ipairs(S.parse_log(logs[i])) do
            if f[1] == "S" then
              runs[f[2]] = runs[f[2]] or {}
              table.insert(runs[f[2]], string.format("w%d fence %s attempts %s", i, f[4], f[5]))
              if #runs[f[2]] == 2 then twice[#twice + 1] = f[2] end
            end
          end
        end
        return twice
      end
      -- done when all are completed, or at once when one ran twice (the store that let it
      -- left others stuck for a minute after that)
      local done = S.wait_for(function()
        return #read_runs() > 0 or assert(store:stats()).completed == N
      end, 60)
      for i = 1, 3 do assert.equal(0, S.term(procs[i]), "worker " .. i .. " did not stop gracefully") end
      local twice = {}
      for _, id in ipairs(read_runs()) do twice[#twice + 1] = id .. ": " .. table.concat(runs[id], ", ") end
      assert.same({}, twice)
      local st = assert(store:stats())
      assert.truthy(done, string.format("completed %d of %d in 60 s", st.completed, N))
      assert.equal(N, st.completed)
      for _, id in ipairs(ids) do
        assert.equal(1, #runs[id], id)
        local d = assert(store:get(id))
        assert.equal(1, d.fence, id)
        assert.equal(1, d.attempts, id)
      end
    end)
  end)
  ::continue::
end
