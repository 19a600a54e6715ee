-- bad_input_spec.lua -- what users and servers get wrong: bad store URLs, unknown options and
-- wrong types, payloads JSON cannot hold, a payload row that is not JSON, handlers that raise
-- odd values, broken scripts, read-only paths, and the command's exit codes. Each gives a
-- one-line error or a buried delivery with last_error: never a crash, and nothing is lost.
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local relaybus = S.relaybus()

local raises_relaybus, refused = H.raises_relaybus, H.refused

describe("bad input:", function()
  teardown(function() S.cleanup() end)

  describe("opening a store", function()
    it("returns nil and a one-line error for a URL of no known scheme", function()
      for _, u in ipairs { "nosuch://host/db", "not a url", "", "sqlite" } do
        local s, err = relaybus.open(u)
        assert.is_nil(s, "opened '" .. u .. "'")
        H.one_line(err, "error for '" .. u .. "'")
      end
    end)

    it("returns nil and a one-line error for an unreachable PostgreSQL server, quickly", function()
      local t0 = relaybus.now()
      local s, err = relaybus.open("postgresql://relaybus@127.0.0.1:1/none?connect_timeout=2")
      assert.is_nil(s)
      H.one_line(err)
      assert.is_true(relaybus.now() - t0 < 10)
    end)

    it("returns nil and a one-line error for an unreachable MongoDB server, quickly", function()
      local t0 = relaybus.now()
      local s, err = relaybus.open("mongodb://127.0.0.1:1/none?serverSelectionTimeoutMS=1000&connectTimeoutMS=1000")
      assert.is_nil(s)
      H.one_line(err)
      assert.is_true(relaybus.now() - t0 < 15)
    end)

    it("returns nil and a one-line error for a SQLite file on a read-only or missing path", function()
      for _, path in ipairs { "/proc/relaybus-spec.db", "/proc/self/none/relaybus.db",
                               S.tmpdir() .. "/no/such/dir/relaybus.db" } do
        local s, err = relaybus.open("sqlite:" .. path)
        assert.is_nil(s, "opened " .. path)
        H.one_line(err, "error for " .. path)
      end
    end)

    it("refuses a table name that is not an identifier", function()
      for _, name in ipairs { "bad\"name", "drop table x;", "1abc", "a-b", "", string.rep("a", 200) } do
        local msg = refused(relaybus.open, "sqlite:" .. S.tmpfile("t") .. ".db", { table = name })
        assert.is_string(msg, "table '" .. name .. "'")
      end
    end)

    it("raises relaybus: for an unknown option and for wrong types", function()
      local url = "sqlite:" .. S.tmpfile("t") .. ".db"
      raises_relaybus(relaybus.open, url, { tabel = "x" })
      raises_relaybus(relaybus.open, url, { table = 5 })
      raises_relaybus(relaybus.open, url, { migrate = "yes please" })
      raises_relaybus(relaybus.open, 42)
    end)
  end)

  describe("the API", function()
    local store
    before_each(function()
      store = assert(relaybus.open("sqlite:" .. S.tmpfile("api") .. ".db"))
    end)
    after_each(function() store:close() end)

    it("raises relaybus: for an unknown option of enqueue, list, purge, dispatcher and handle", function()
      raises_relaybus(store.enqueue, store, "t", 1, { dealy = 5 })
      raises_relaybus(store.list, store, { statuss = "pending" })
      raises_relaybus(store.purge, store, { status = "completed", older_thn = 5 })
      raises_relaybus(relaybus.dispatcher, store, { leese_duration = 5 })
      local d = relaybus.dispatcher(store, {})
      raises_relaybus(d.handle, d, "t", function() end, { timout = 5 })
      assert.equal(0, (H.total(store)))
    end)

    it("raises relaybus: for wrong types", function()
      raises_relaybus(store.enqueue, store, nil, 1)
      raises_relaybus(store.enqueue, store, {}, 1)
      raises_relaybus(store.enqueue, store, "t", 1, { delay = "soon" })
      raises_relaybus(store.enqueue, store, "t", 1, { max_attempts = "many" })
      raises_relaybus(store.enqueue_many, store, "not a list")
      raises_relaybus(relaybus.dispatcher, store, { concurrency = "lots" })
      raises_relaybus(relaybus.dispatcher, "not a store", {})
      local d = relaybus.dispatcher(store, {})
      raises_relaybus(d.handle, d, "t", "not a function")
      assert.equal(0, (H.total(store)))
    end)

    it("close is idempotent", function()
      assert.has_no.errors(function() store:close(); store:close() end)
    end)
  end)

  for _, entry in ipairs(S.list()) do
    describe("payloads and handlers on " .. entry.name .. ":", function()
      local store, url, opts, tbl
      before_each(function() store, url, opts, tbl = S.open(entry) end)
      after_each(S.reset)

      it("refuses a payload JSON cannot hold (function, NaN, infinity, nested function) and writes nothing", function()
        local bad = { function() end, 0 / 0, math.huge, -math.huge, { ok = 1, f = print },
                      { 1, 2, coroutine.create(function() end) } }
        for i, p in ipairs(bad) do
          local msg = refused(store.enqueue, store, "bi.json", p)
          assert.is_string(msg, "payload #" .. i)
        end
        assert.equal(0, (H.total(store)))
        -- and the store still works
        local id = assert(store:enqueue("bi.json", { fine = true }))
        assert.same({ fine = true }, assert(store:get(id)).payload)
      end)

      it("a handler that raises a table or nil buries with a string last_error; nothing is lost", function()
        local ids = assert(store:enqueue_many {
          { "bi.table", 1, { max_attempts = 1 } },
          { "bi.nil", 2, { max_attempts = 1 } },
          { "bi.obj", 3, { max_attempts = 1 } },
        })
        local d = H.dispatcher(store)
        local stop = H.stopper(d)
        local runs = 0
        local function count() runs = runs + 1; if runs == 3 then stop() end end
        d:handle("bi.table", function() count(); error({ code = 42 }) end)
        d:handle("bi.nil", function() count(); error(nil) end)
        d:handle("bi.obj", function()
          count()
          error(setmetatable({}, { __tostring = function() return "custom error object" end }))
        end)
        assert.is_true(H.run(d, 10))
        assert.equal(3, runs)
        for _, id in ipairs(ids) do
          local r = assert(store:get(id))
          assert.equal("buried", r.status)
          assert.is_string(r.last_error)
          assert.is_true(#r.last_error > 0)
        end
        assert.truthy(assert(store:get(ids[3])).last_error:find("custom error object", 1, true))
      end)
    end)
  end

  describe("a payload row that is not valid JSON (written by hand into the SQLite table)", function()
    it("is buried by the dispatcher with last_error about the payload; get and list do not crash", function()
      local store = assert(relaybus.open("sqlite:" .. S.tmpfile("rows") .. ".db"))
      local good = assert(store:enqueue("bi.row", { fine = 1 }))
      local now = relaybus.time()
      local ok, err = store:transaction(function(tx)
        return tx:exec("INSERT INTO relaybus_deliveries (topic, payload, status, attempts, max_attempts,"
          .. " fence, run_at, created_at) VALUES ('bi.row', '{not json', 'pending', 0, 5, 0, ?, ?)", now - 1, now - 1)
      end)
      assert.is_true(ok, err)
      local rows = assert(store:list { topic = "bi.row" })
      assert.equal(2, #rows)
      local bad
      for _, r in ipairs(rows) do if r.id ~= good then bad = r.id end end
      assert.is_string(bad)
      local okget, rec = pcall(store.get, store, bad)
      assert.is_true(okget, rec)
      assert.is_table(rec)
      assert.equal("pending", rec.status)

      local d = H.dispatcher(store)
      local stop = H.stopper(d)
      local seen = {}
      d:handle("bi.row", function(delivery)
        seen[#seen + 1] = delivery.id
      end)
      -- the good one runs; the bad one is buried without running: wait until both settled
      relaybus.spawn(function()
        H.poll(function()
          local b, g = store:get(bad), store:get(good)
          return b and g and g.status == "completed" and b.status ~= "pending" and b.status ~= "processing"
        end, 5)
        stop()
      end)
      assert.is_true(H.run(d, 10))
      assert.same({ good }, seen)
      assert.equal("completed", assert(store:get(good)).status)
      local r = assert(store:get(bad))
      assert.equal("buried", r.status)
      assert.is_string(r.last_error)
      assert.truthy(r.last_error:lower():find("payload", 1, true), r.last_error)
      assert.is_true(pcall(store.list, store, {}))
      store:close()
    end)
  end)

  describe("the command", function()
    local function relaybus_cmd(args, env)
      local argv = { S.bin }
      for _, a in ipairs(args) do argv[#argv + 1] = a end
      return S.run_command(argv, env)
    end
    local function db() return "sqlite:" .. S.tmpfile("cli") .. ".db" end

    it("relaybus run of a script with a syntax error exits 1 with one line on stderr", function()
      local script = S.tmpfile("syntax") .. ".lua"
      S.write(script, "local x = = 1\nprint('never')\n")
      local code, out, err = relaybus_cmd { "run", script }
      assert.equal(1, code)
      assert.equal("", out)
      H.one_line((err:gsub("\n$", "")), "stderr")
    end)

    it("relaybus run of a script that raises exits 1 with one line on stderr", function()
      local script = S.tmpfile("raise") .. ".lua"
      S.write(script, "error('deliberate failure')\n")
      local code, _, err = relaybus_cmd { "run", script }
      assert.equal(1, code)
      H.one_line((err:gsub("\n$", "")), "stderr")
      assert.truthy(err:find("deliberate failure", 1, true))
    end)

    it("relaybus run passes the arguments as ... and arg, and exits 0", function()
      local script = S.tmpfile("args") .. ".lua"
      S.write(script, "local a, b = ...\nio.write(a, ' ', b, ' ', arg[1], ' ', arg[2], '\\n')\n")
      local code, out = relaybus_cmd { "run", script, "one", "two" }
      assert.equal(0, code)
      assert.equal("one two one two\n", out)
    end)

    it("exits 0 on success: enqueue prints the id, stats and list --json print JSON", function()
      local url = db()
      local code, out, err = relaybus_cmd { "enqueue", "cli.t", '{"a":1}', "--store", url }
      assert.equal(0, code, err)
      local id = out:match("^%s*(%S+)%s*$")
      assert.is_string(id)
      code, out = relaybus_cmd { "stats", "--json", "--store", url }
      assert.equal(0, code)
      local st = relaybus.json.decode(out)
      assert.equal(1, st.pending)
      code, out = relaybus_cmd { "list", "--json", "--store", url }
      assert.equal(0, code)
      local list = relaybus.json.decode(out)
      assert.equal(1, #list)
      assert.equal(id, tostring(list[1].id))
      assert.same({ a = 1 }, list[1].payload)
      local store = assert(relaybus.open(url))
      assert.same({ a = 1 }, assert(store:get(id)).payload)
      store:close()
    end)

    it("uses RELAYBUS_STORE when --store is not given", function()
      local url = db()
      local code = relaybus_cmd({ "enqueue", "cli.env", "[1,2]" }, { RELAYBUS_STORE = url })
      assert.equal(0, code)
      local store = assert(relaybus.open(url))
      assert.equal(1, assert(store:stats()).pending)
      store:close()
    end)

    it("exits 2 with one line on stderr on a usage error", function()
      local url = db()
      for _, args in ipairs {
        { "frobnicate" },
        {},
        { "enqueue", "--store", url },
        { "enqueue", "t", "{not json", "--store", url },
        { "stats", "--no-such-flag", "--store", url },
        { "enqueue", "t", "1", "--delay", "soon", "--store", url },
        { "list", "--status", "sideways", "--store", url },
        { "run" },
      } do
        local code, _, err = relaybus_cmd(args)
        local what = "relaybus " .. table.concat(args, " ")
        assert.equal(2, code, what)
        H.one_line((err:gsub("\n$", "")), "stderr of " .. what)
      end
      local store = assert(relaybus.open(url))
      assert.equal(0, (H.total(store)))
      store:close()
    end)

    it("exits 1 with one line on stderr on a runtime failure", function()
      for _, args in ipairs {
        { "stats", "--store", "sqlite:/proc/relaybus-spec/none.db" },
        { "enqueue", "t", "1", "--store", "nosuch://x" },
        { "run", S.tmpdir() .. "/no-such-script.lua" },
      } do
        local code, _, err = relaybus_cmd(args)
        local what = "relaybus " .. table.concat(args, " ")
        assert.equal(1, code, what)
        H.one_line((err:gsub("\n$", "")), "stderr of " .. what)
      end
    end)

    it("exits 0 for --help", function()
      local code, out = relaybus_cmd { "--help" }
      assert.equal(0, code)
      assert.truthy(out:find("run", 1, true))
      code = relaybus_cmd { "enqueue", "--help" }
      assert.equal(0, code)
    end)
  end)
end)
