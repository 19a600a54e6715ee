-- unhandled_spec.lua -- deliveries of a topic no dispatcher of the process handles do not wait
-- in silence: a moment after the first dispatcher on a store starts, each such topic with
-- pending deliveries is named once in a warning (a typo in d:handle, a worker not running).
-- Run per store, through the command (the warning goes to its stderr).
local S = require "spec.support.stores"

local SCRIPT = [[
  local relaybus = require "relaybus"
  local url, tbl = ...
  local store = assert(relaybus.open(url, tbl ~= "-" and { table = tbl } or nil))
  for i = 1, 3 do assert(store:enqueue("orders.creatd", { i = i })) end
  assert(store:enqueue("orders.created", { i = 0 }))
  assert(store:enqueue("mail.send", { i = 0 }, { delay = 3600 }))
  -- a topic that is not UTF-8 where the store keeps one (SQLite), else its valid twin
  if not store:enqueue("bad\255topic\nsecond line", { i = 0 }) then
    assert(store:enqueue("bad\u{FFFD}topic\nsecond line", { i = 0 }))
  end
  local d = relaybus.dispatcher(store, { poll_interval = 0.2 })
  d:handle("orders.created", function() end)
  local e = relaybus.dispatcher(store, { poll_interval = 0.2 })
  e:handle("mail.later", function() end)
  d:start()
  e:start()
  relaybus.spawn(function() relaybus.sleep(3.5); d:stop(); e:stop() end)
  relaybus.run()
]]

for _, entry in ipairs(S.list()) do
  describe("unhandled topics on " .. entry.name .. ":", function()
    local url, opts
    before_each(function() _, url, opts = S.open(entry) end)
    after_each(S.reset)
    teardown(function() S.cleanup() end)

    -- Runs the script text through the command on this store; its stderr once it exited 0.
    local function run_script(text)
      local script = S.tmpfile("unhandled") .. ".lua"
      S.write(script, text)
      local code, _, err = S.run_command { S.bin, "run", script, url, opts.table or "-" }
      assert.equal(0, code, err)
      return err
    end

    it("each topic with pending deliveries that no dispatcher here handles is named once", function()
      local err = run_script(SCRIPT)
      local _, n = err:gsub('3 deliveries of topic "orders.creatd" are pending and no dispatcher', "")
      assert.equal(1, n, err)
      -- handled topics, and topics with nothing pending (a delayed delivery is pending, but
      -- counts: it will be due), are told apart
      assert.is_nil(err:find('"orders.created"', 1, true), err)
      local _, m = err:gsub('1 deliveries of topic "mail.send" are pending', "")
      assert.equal(1, m, err)
      -- a topic that is not UTF-8 and holds a newline is named on one line of valid UTF-8
      assert.is_not_nil(utf8.len(err), "stderr is not UTF-8")
      assert.truthy(err:find('1 deliveries of topic "bad\u{FFFD}topic second line" are pending', 1, true), err)
    end)

    -- Once per store, not per dispatcher: one started after the first has stopped does not
    -- name the topic again (what the dispatchers learnt lives as long as the store).
    it("a dispatcher started on the store after another stopped does not name the topics again", function()
      local err = run_script [[
        local relaybus = require "relaybus"
        local url, tbl = ...
        local store = assert(relaybus.open(url, tbl ~= "-" and { table = tbl } or nil))
        assert(store:enqueue("orders.creatd", { i = 1 }))
        for round = 1, 2 do
          local d = relaybus.dispatcher(store, { poll_interval = 0.2 })
          d:handle("orders.created", function() end)
          d:start()
          relaybus.spawn(function() relaybus.sleep(2.5); d:stop() end)
          relaybus.run()
        end
      ]]
      local _, n = err:gsub('deliveries of topic "orders.creatd" are pending', "")
      assert.equal(1, n, err)
    end)

    it("reads at most the 10,000 earliest due pending deliveries, and says 'at least' when it hit that bound", function()
      local script = S.tmpfile("unhandled_many") .. ".lua"
      S.write(script, [[
        local relaybus = require "relaybus"
        local url, tbl = ...
        local store = assert(relaybus.open(url, tbl ~= "-" and { table = tbl } or nil))
        local list = {}
        for i = 1, 10050 do list[i] = { "orders.creatd", { i = i } } end
        assert(store:enqueue_many(list))
        -- due after all of them: beyond the bound, so not counted
        assert(store:enqueue("mail.send", { i = 0 }, { delay = 3600 }))
        local d = relaybus.dispatcher(store, { poll_interval = 0.2 })
        d:handle("orders.created", function() end)
        d:start()
        relaybus.run()    -- until the spec stops it
      ]])
      -- The read of 10,000 may take a while on a loaded machine (FerretDB): wait for the
      -- warning, then stop the worker as an operator would.
      local p = S.spawn(script, { url, opts.table or "-" })
      local warning = 'at least 10000 deliveries of topic "orders.creatd" are pending and no dispatcher'
      S.wait_for(function() return (S.read(p.err) or ""):find(warning, 1, true) ~= nil end, 60)
      assert.equal(0, S.term(p), S.read(p.err))
      local err = S.read(p.err) or ""
      local _, n = err:gsub(warning, "")
      assert.equal(1, n, err)
      assert.is_nil(err:find('"mail.send"', 1, true), err)
    end)
  end)
end
