-- cli_spec.lua -- the relaybus command as its first hour goes: it shows no store password
-- anywhere, what it prints from a store is inert on a terminal (and --json stays JSON), any
-- time prints, read-only commands create nothing, store URLs mean one thing, usage errors are
-- one line with exit 2 and failures exit 1; and the same under attack: NUL bytes and control
-- characters in arguments, numbers out of range, repeated and missing options, huge URLs,
-- unreadable and odd SQLite paths. The parser is also called on its own (parse(argv)).
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local relaybus = S.relaybus()

local PG = os.getenv("RELAYBUS_TEST_PG")
local MONGO = os.getenv("RELAYBUS_TEST_MONGO")
local q = S.quote

-- relaybus ARGS... with env; returns exit code, stdout, stderr. opts.umask, opts.as_nobody.
local function cmd(args, env, opts)
  opts = opts or {}
  local base = S.tmpfile("cli")
  local parts = {}
  if opts.umask then parts[#parts + 1] = "umask " .. opts.umask .. ";" end
  for k, v in pairs(env or {}) do parts[#parts + 1] = k .. "=" .. q(v) end
  if opts.as_nobody then parts[#parts + 1] = "setpriv --reuid=65534 --regid=65534 --clear-groups" end
  parts[#parts + 1] = q(S.bin)
  for _, a in ipairs(args) do parts[#parts + 1] = q(a) end
  local line = "cd " .. q(opts.cwd or S.tmpdir()) .. " && " .. table.concat(parts, " ")
    .. " >" .. q(base .. ".out") .. " 2>" .. q(base .. ".err") .. " </dev/null"
  local _, _, code = os.execute(line)
  return code, S.read(base .. ".out") or "", S.read(base .. ".err") or ""
end

-- stderr is exactly one line, with nothing a terminal would act on.
local function one_inert_line(err, what)
  what = what or "stderr"
  assert.truthy(err:match("^[^\n]+\n$"), what .. " is not one line: " .. err)
  assert.is_nil(err:find("[%z\1-\9\11-\31\127]"), what .. " holds a control character: " .. err)
  assert.is_nil(err:find("\xc2[\x80-\x9f]"), what .. " holds a C1 control: " .. err)
  assert.truthy(utf8.len(err), what .. " is not valid UTF-8")
end

local function sqlite_url() return "sqlite:" .. S.tmpfile("cli") .. ".db" end

local function with_password(url, pw)
  return (url:gsub("^(%a+://)([^@/]*@)", "%1"):gsub("^(%a+://)", "%1relaybus_user:" .. pw .. "@"))
end

-- The loaded CLI chunk in module mode: its parser and formatters, nothing run.
local function cli_module()
  package.loaded.relaybus = relaybus
  return assert(loadfile("cmd/cli.lua"))("module")
end

describe("the command", function()
  teardown(function() S.cleanup() end)

  describe("never shows a store password", function()
    local function assert_hidden(outputs, secrets)
      for what, text in pairs(outputs) do
        for _, secret in ipairs(secrets) do
          assert.is_nil(text:find(secret, 1, true), what .. " shows " .. secret .. ": " .. text)
        end
      end
    end

    it("on PostgreSQL: migrate, enqueue, stats, list, kick and purge with a password in the URL", function()
      if not PG then pending("RELAYBUS_TEST_PG is not set") return end
      -- the throwaway server trusts every connection, so a password is accepted and unused
      local url = PG:gsub("^postgresql://([^@/]*)@", "postgresql://%1:SECRETPW@")
      assert.truthy(url:find("SECRETPW", 1, true))
      local t = S.unique("pw")
      local env = { RELAYBUS_LOG = "debug" }
      local outputs = {}
      for i, args in ipairs {
        { "migrate", "--store", url, "--table", t },
        { "enqueue", "t", "{}", "--store", url, "--table", t },
        { "stats", "--store", url, "--table", t },
        { "list", "--store", url, "--table", t },
        { "kick", "--buried", "--store", url, "--table", t },
        { "purge", "--completed", "--older-than", "0", "--store", url, "--table", t },
      } do
        local code, out, err = cmd(args, env)
        assert.equal(0, code, table.concat(args, " ") .. ": " .. err)
        outputs["stdout " .. i] = out
        outputs["stderr " .. i] = err
      end
      assert.truthy(outputs["stdout 1"]:find(":***@", 1, true), outputs["stdout 1"])
      -- and through RELAYBUS_STORE, for the commands and for a script
      local code, out, err = cmd({ "stats", "--table", t }, { RELAYBUS_STORE = url })
      assert.equal(0, code, err)
      outputs.env_out, outputs.env_err = out, err
      assert_hidden(outputs, { "SECRETPW" })
    end)

    it("on PostgreSQL and MongoDB URLs that fail to open, also when the driver quotes the URL back", function()
      local urls = {
        "postgresql://u:SECRETPW@127.0.0.1:1/none?connect_timeout=2",
        "postgresql://u:SECRETPW@127.0.0.1:notaport/none",               -- libpq quotes the port
        "postgresql://u:SEC%zzRETPW@127.0.0.1:1/none",                    -- and a bad escape
        "postgresql://u:SECRETPW/SECRETPX@127.0.0.1:1/none",              -- an unescaped '/'
        "postgres://127.0.0.1:1/none?password=SECRETPW&connect_timeout=2",
        "mongodb://u:SECRETPW@127.0.0.1:1/none?serverSelectionTimeoutMS=300&connectTimeoutMS=300",
        "mongodb://u:SEC%zzRETPW@127.0.0.1:1/none",
        "mongodb://u:SECRETPW@127.0.0.1:notaport/none",
        "nosuch://u:SECRETPW@host/db",
      }
      if PG then urls[#urls + 1] = with_password(PG, "SECRETPW") .. "?sslmode=require" end
      if MONGO then urls[#urls + 1] = with_password(MONGO, "SECRETPW") end   -- FerretDB: no such auth
      for _, url in ipairs(urls) do
        for _, command in ipairs { { "migrate" }, { "stats" }, { "list", "--json" } } do
          local args = { table.unpack(command) }
          args[#args + 1] = "--store"
          args[#args + 1] = url
          local what = table.concat(args, " ")
          local secrets = { "SECRETPW", "SECRETPX", "SEC%zzRETPW", "zzRETPW" }
          -- logging everything (the drivers' own lines too): more lines, no secret
          local code, out, err = cmd(args, { RELAYBUS_LOG = "debug" })
          assert.equal(1, code, what .. ": " .. err)
          assert_hidden({ [what .. " stdout"] = out, [what .. " stderr"] = err }, secrets)
          code, out, err = cmd(args)
          assert.equal(1, code, what .. ": " .. err)
          assert.equal("", out, what)
          assert_hidden({ [what .. " stderr"] = err }, secrets)
          one_inert_line(err, what)
        end
      end
    end)

    it("nor in a script's error from relaybus.open of RELAYBUS_STORE", function()
      local script = S.tmpfile("open") .. ".lua"
      S.write(script, 'local r = require "relaybus"\nassert(r.open(os.getenv("RELAYBUS_STORE")))\n')
      local code, out, err = cmd({ "run", "--store", "postgresql://u:SECRETPW/SECRETPX@127.0.0.1/x", script })
      assert.equal(1, code)
      assert.is_nil((out .. err):find("SECRET", 1, true), err)
      one_inert_line(err)
    end)

    it("nor an argument that is a URL with a password, quoted in a usage error", function()
      local code, out, err = cmd { "stats", "postgresql://u:SECRETPW@h/db" }
      assert.equal(2, code)
      assert.equal("", out)
      assert.is_nil(err:find("SECRETPW", 1, true), err)
      assert.truthy(err:find("postgresql://u:***@h/db", 1, true), err)
    end)
  end)

  describe("shows what a store holds inertly", function()
    local ESC_TOPIC = "t\27[31mred\27]0;owned\7"
    local function hostile_store()
      local url = sqlite_url()
      local store = assert(relaybus.open(url))
      local id = assert(store:enqueue(ESC_TOPIC, { note = "x\27[2J" }, { key = "k\r\nfake line" }))
      -- what a remote server's response body may leave in last_error: escapes, C1 controls,
      -- a bidi override and bytes that are not UTF-8, written past the API's cleaning
      assert(store:transaction(function(tx)
        return tx:exec("UPDATE relaybus_deliveries SET status = 'buried', last_error = "
          .. "CAST(X'1b5b324a0d0a6f6b07c29be280aeff' AS TEXT) || 'tail' WHERE id = ?", id)
      end))
      store:close()
      return url, id
    end

    it("list escapes control characters, C1 controls, bidi overrides and invalid UTF-8", function()
      local url = hostile_store()
      local code, out, err = cmd { "list", "--store", url }
      assert.equal(0, code, err)
      assert.is_nil(out:find("[%z\1-\9\11-\31\127]"), out)
      assert.is_nil(out:find("\xc2[\x80-\x9f]"), out)
      assert.is_nil(out:find("\xe2\x80\xae", 1, true), "a bidi override is printed raw")
      assert.truthy(utf8.len(out), "not valid UTF-8")
      assert.truthy(out:find("t\\x1b[31mred\\x1b]0;owned\\x07", 1, true), out)
      assert.truthy(out:find("\\x1b[2J", 1, true), out)
      assert.truthy(out:find("\\xff", 1, true), out)
      assert.truthy(out:find("k\\x0d\\x0afake line", 1, true), out)
      -- a header and one row: the key's newline did not make a line of its own
      assert.equal(2, select(2, out:gsub("\n", "")))
    end)

    it("list --json and stats --json are valid JSON that keeps the text (invalid UTF-8 as U+FFFD)", function()
      local url = hostile_store()
      local code, out, err = cmd { "list", "--json", "--store", url }
      assert.equal(0, code, err)
      assert.truthy(utf8.len(out), "not valid UTF-8")
      assert.is_nil(out:find("[%z\1-\9\11-\31\127]"), "a raw control byte: " .. out)
      assert.is_nil(out:find("\xc2[\x80-\x9f]"), out)
      local rows = relaybus.json.decode(out)
      assert.equal(1, #rows)
      assert.equal(ESC_TOPIC, rows[1].topic)
      assert.equal("k\r\nfake line", rows[1].key)
      assert.same({ note = "x\27[2J" }, rows[1].payload)
      assert.equal("\27[2J\r\nok\7\xc2\x9b\xe2\x80\xae\u{fffd}tail", rows[1].last_error)
      code, out = cmd { "stats", "--json", "--store", url }
      assert.equal(0, code)
      assert.equal(1, relaybus.json.decode(out).buried)
    end)

    it("error messages quote arguments escaped", function()
      local url = sqlite_url()
      assert.equal(0, (cmd { "migrate", "--store", url }))
      local code, _, err = cmd { "kick", "id\27[2J\27]0;x\7", "--store", url }
      assert.equal(1, code)
      one_inert_line(err)
      assert.truthy(err:find("id\\x1b[2J", 1, true), err)
      code, _, err = cmd { "frob\27[2J\n" }
      assert.equal(2, code)
      one_inert_line(err)
      assert.truthy(err:find("frob\\x1b[2J\\x0a", 1, true), err)
    end)

    it("prints any time: a run_at of 1e300, year 9999, before year 1, infinity", function()
      local url = sqlite_url()
      local store = assert(relaybus.open(url))
      for _ = 1, 5 do assert(store:enqueue("far", {})) end
      assert(store:transaction(function(tx)
        tx:exec("UPDATE relaybus_deliveries SET run_at = 1e300, created_at = 1e300 WHERE id = 1")
        tx:exec("UPDATE relaybus_deliveries SET run_at = 253402300799.9, created_at = 253402300799.9 WHERE id = 2")
        tx:exec("UPDATE relaybus_deliveries SET run_at = -1e300, created_at = -62135596801 WHERE id = 3")
        tx:exec("UPDATE relaybus_deliveries SET run_at = 9e999, created_at = -9e999, attempts = 3 WHERE id = 4")
        tx:exec("UPDATE relaybus_deliveries SET status = 'processing', lease_token = 'x', "
          .. "lease_expires_at = 1e300 WHERE id = 5")
      end))
      store:close()
      local code, out, err = cmd { "list", "--store", url }
      assert.equal(0, code, err)
      assert.truthy(out:find("after 9999", 1, true), out)
      assert.truthy(out:find("9999-12-31 23:59:59", 1, true), out)
      assert.truthy(out:find("before 0001", 1, true), out)
      assert.truthy(out:find("in >9999y", 1, true), out)
      assert.truthy(out:find("lease >9999y", 1, true), out)
      code, out, err = cmd { "list", "--json", "--store", url }
      assert.equal(0, code, err)
      local rows = relaybus.json.decode(out)
      assert.equal(5, #rows)
      code, out, err = cmd { "stats", "--store", url }
      assert.equal(0, code, err)
    end)

    it("formats times and durations of any number (the formatters on their own)", function()
      local cli = cli_module()
      for _, t in ipairs { 0, 1e300, -1e300, 253402300799, 253402300800, -62135596800,
                           -62135596801, math.huge, -math.huge, 0 / 0, math.maxinteger,
                           math.mininteger, 1.5 } do
        local ok, s = pcall(cli.fmt_time, t)
        assert.is_true(ok, tostring(t) .. ": " .. tostring(s))
        assert.is_string(s)
        ok, s = pcall(cli.fmt_duration, t)
        assert.is_true(ok, tostring(t) .. ": " .. tostring(s))
        assert.is_string(s)
      end
      assert.equal("9999-12-31 23:59:59", cli.fmt_time(253402300799))
      assert.equal("after 9999", cli.fmt_time(253402300800))
      assert.equal("1970-01-01 00:00:00", cli.fmt_time(0.5))
      assert.equal("3m07s", cli.fmt_duration(187))
      assert.equal(">9999y", cli.fmt_duration(1e300))
    end)
  end)

  describe("read-only commands on a store without the schema", function()
    local READ_ONLY = {
      { "stats" }, { "list" }, { "list", "--json" }, { "kick", "--buried" }, { "kick", "7" },
      { "purge", "--completed", "--buried", "--older-than", "0" },
      { "pause", "t" }, { "resume", "t" }, { "paused" }, { "paused", "--json" },
    }
    local function assert_no_schema(code, out, err, what)
      assert.equal(1, code, what .. ": " .. err)
      assert.equal("", out, what)
      one_inert_line(err, what)
      assert.truthy(err:find("no relaybus schema here (run relaybus migrate)", 1, true), what .. ": " .. err)
    end

    it("SQLite: exit 1 naming relaybus migrate, and no file is made", function()
      local path = S.tmpfile("ro") .. ".db"
      for _, args in ipairs(READ_ONLY) do
        local a = { table.unpack(args) }
        a[#a + 1] = "--store"
        a[#a + 1] = "sqlite:" .. path
        local code, out, err = cmd(a)
        assert_no_schema(code, out, err, table.concat(a, " "))
        for _, suffix in ipairs { "", "-wal", "-shm", "-journal" } do
          assert.is_false(S.exists(path .. suffix), path .. suffix .. " was made by " .. a[1])
        end
      end
      -- the default store, in the current directory
      local dir = S.tmpfile("cwd")
      os.execute("mkdir " .. q(dir))
      local code, out, err = cmd({ "stats" }, nil, { cwd = dir })
      assert_no_schema(code, out, err, "stats in " .. dir)
      assert.is_false(S.exists(dir .. "/relaybus.db"))
    end)

    it("SQLite: a database of someone else's is left as it was (not switched to WAL)", function()
      local path = S.tmpfile("other") .. ".db"
      local code = os.execute("sqlite3 " .. q(path) .. " 'CREATE TABLE mine (x)' 2>/dev/null")
      if not code then pending("no sqlite3 shell") return end
      local before = S.read(path)
      local _, out, err = cmd { "stats", "--store", "sqlite:" .. path }
      assert_no_schema(1, out, err, "stats")
      assert.equal(before, S.read(path))
      assert.is_false(S.exists(path .. "-wal"))
    end)

    it("SQLite: a mistyped --table creates no table; migrate then makes it", function()
      local url = sqlite_url()
      assert.equal(0, (cmd { "migrate", "--store", url }))
      local code, out, err = cmd { "stats", "--store", url, "--table", "jobs2" }
      assert_no_schema(code, out, err, "stats --table jobs2")
      local store = assert(relaybus.open(url))
      local _, rows = store:transaction(function(tx)
        return tx:query("SELECT name FROM sqlite_master WHERE name LIKE 'jobs2%'")
      end)
      assert.same({}, rows)
      store:close()
      assert.equal(0, (cmd { "migrate", "--store", url, "--table", "jobs2" }))
      assert.equal(0, (cmd { "stats", "--store", url, "--table", "jobs2" }))
    end)

    it("PostgreSQL: a mistyped --table creates no table", function()
      if not PG then pending("RELAYBUS_TEST_PG is not set") return end
      local t = S.unique("jobs2")
      for _, args in ipairs(READ_ONLY) do
        local a = { table.unpack(args) }
        for _, v in ipairs { "--store", PG, "--table", t } do a[#a + 1] = v end
        local code, out, err = cmd(a)
        assert_no_schema(code, out, err, table.concat(a, " "))
      end
      local store = assert(relaybus.open(PG, { table = S.unique("probe") }))
      local ok, rows = store:transaction(function(tx)
        return tx:query("SELECT relname FROM pg_class WHERE relname LIKE $1", t .. "%")
      end)
      assert.is_true(ok, rows)
      assert.same({}, rows)
      store:close()
    end)

    it("MongoDB: a mistyped --table creates no collection", function()
      if not MONGO then pending("RELAYBUS_TEST_MONGO is not set") return end
      local t = S.unique("jobs2")
      for _, args in ipairs(READ_ONLY) do
        local a = { table.unpack(args) }
        for _, v in ipairs { "--store", MONGO, "--table", t } do a[#a + 1] = v end
        local code, out, err = cmd(a)
        assert_no_schema(code, out, err, table.concat(a, " "))
      end
      -- a collection that does exist, to see that the listing works
      local probe = S.unique("probe")
      assert.equal(0, (cmd { "migrate", "--store", MONGO, "--table", probe }))
      local db = MONGO:match("^mongodb://[^/]+/([^?]+)") or "relaybus"
      local p = assert(io.popen(q(S.build .. "/mongo_collections") .. " " .. q(MONGO) .. " " .. q(db)))
      local names = p:read("a")
      assert.is_true(p:close(), "mongo_collections failed")
      assert.truthy(names:find(probe, 1, true), names)
      assert.is_nil(names:find(t, 1, true), names)
    end)

    it("enqueue and migrate still create the schema, and relaybus.open migrates by default", function()
      local url = sqlite_url()
      local code, out, err = cmd { "enqueue", "t", "{}", "--store", url }
      assert.equal(0, code, err)
      assert.truthy(out:match("^%S+\n$"))
      local store = assert(relaybus.open(sqlite_url()))
      assert.equal(0, assert(store:stats()).pending)
      store:close()
    end)
  end)

  describe("store URLs", function()
    it("accepts postgres:// as postgresql://", function()
      if not PG then pending("RELAYBUS_TEST_PG is not set") return end
      local url = PG:gsub("^postgresql://", "postgres://")
      local t = S.unique("pgs")
      local code, out, err = cmd { "migrate", "--store", url, "--table", t }
      assert.equal(0, code, err)
      assert.truthy(out:find("postgres://", 1, true))
      assert.equal(0, (cmd { "stats", "--store", url, "--table", t }))
    end)

    it("refuses sqlite://PATH in one line that suggests sqlite:PATH, and makes no file", function()
      local dir = S.tmpfile("slashes")
      os.execute("mkdir " .. q(dir))
      for _, url in ipairs { "sqlite://app.db", "sqlite:///app.db", "sqlite:////tmp/app.db" } do
        for _, command in ipairs { "migrate", "stats" } do
          local code, out, err = cmd({ command, "--store", url }, nil, { cwd = dir })
          assert.equal(1, code, url)
          assert.equal("", out)
          one_inert_line(err, url)
          assert.truthy(err:find("sqlite:app.db", 1, true) or err:find("sqlite:tmp/app.db", 1, true), err)
        end
      end
      local p = io.popen("ls -A " .. q(dir))
      assert.equal("", p:read("a"))
      p:close()
      assert.is_false(S.exists("/app.db"))
    end)

    it("sqlite:file:NAME is a file named file:NAME, not an SQLite URI", function()
      local dir = S.tmpfile("uri")
      os.execute("mkdir " .. q(dir))
      local code, _, err = cmd({ "migrate", "--store", "sqlite:file:x.db?mode=ro" }, nil, { cwd = dir })
      assert.equal(0, code, err)
      assert.is_true(S.exists(dir .. "/file:x.db?mode=ro"))
    end)
  end)

  describe("usage and failures", function()
    it("documents RELAYBUS_LOG and its levels, and RELAYBUS_STORE, in --help", function()
      local code, out = cmd { "--help" }
      assert.equal(0, code)
      assert.truthy(out:find("RELAYBUS_LOG", 1, true))
      for _, level in ipairs { "debug", "info", "warn", "error", "off" } do
        assert.truthy(out:find(level, 1, true), level)
      end
      assert.truthy(out:find("RELAYBUS_STORE", 1, true))
      assert.truthy(out:find("postgres://", 1, true))
      for _, c in ipairs { "run", "enqueue", "stats", "list", "kick", "purge", "migrate" } do
        local hc, hout, herr = cmd { c, "--help" }
        assert.equal(0, hc, c)
        assert.equal("", herr)
        assert.truthy(hout:find("Usage: relaybus " .. c, 1, true), c)
        local hc2, hout2 = cmd { "help", c }
        assert.equal(0, hc2)
        assert.equal(hout, hout2)
      end
    end)

    it("run: a script that never starts its dispatcher, or calls relaybus.run() with nothing to run, is told so", function()
      local db = "sqlite:" .. S.tmpfile("unstarted") .. ".db"
      local forgot = S.tmpfile("forgot") .. ".lua"
      S.write(forgot, [[
        local relaybus = require "relaybus"
        local d = relaybus.dispatcher(assert(relaybus.open(arg[1])))
        d:handle("t", function() end)
      ]])
      local code, out, err = cmd { "run", forgot, db }
      assert.equal(0, code)
      assert.equal("", out)
      assert.truthy(err:find("made a dispatcher with handlers but never started it (call d:start())", 1, true), err)
      -- relaybus.run() itself says it, once, whether or not a dispatcher was made
      local runs = S.tmpfile("runs") .. ".lua"
      S.write(runs, [[
        local relaybus = require "relaybus"
        if arg[2] == "unstarted" then
          relaybus.dispatcher(assert(relaybus.open(arg[1]))):handle("t", function() end)
        end
        relaybus.run()
        relaybus.run()
      ]])
      code, out, err = cmd { "run", runs, db, "unstarted" }
      assert.equal(0, code)
      local _, n = err:gsub("relaybus.run%(%): a dispatcher has handlers but was never started %(call d:start%(%)%); nothing to run", "")
      assert.equal(1, n, err)
      code, out, err = cmd { "run", runs, db, "empty" }
      assert.equal(0, code)
      _, n = err:gsub("relaybus.run%(%): nothing to run %(no dispatcher started, no task spawned%)", "")
      assert.equal(1, n, err)
    end)

    -- every usage error: exit 2, nothing on stdout, one inert line on stderr, nothing written
    local USAGE = {
      {}, { "frobnicate" }, { "-" }, { "--json", "stats" }, { "--store" }, { "--table" },
      { "--store", "--json", "stats" }, { "help", "frob" }, { "help", "list", "x" },
      { "stats", "--store" }, { "stats", "--store", "--json" }, { "stats", "--store=" },
      { "stats", "--table", "" }, { "stats", "--table", "a-b" }, { "stats", "--table", "1abc" },
      { "stats", "--table", string.rep("a", 64) }, { "stats", "--json=yes" }, { "stats", "extra" },
      { "stats", "--json", "--json" }, { "stats", "-x" }, { "stats", "--no-such" },
      { "--store", "sqlite:a.db", "stats", "--store", "sqlite:b.db" },
      { "list", "--limit", "1e999" }, { "list", "--limit", "-1" }, { "list", "--limit", "0" },
      { "list", "--limit", "1.5" }, { "list", "--limit", "0x10" }, { "list", "--limit", " 5" },
      { "list", "--limit", "2147483648" }, { "list", "--limit", "99999999999999999999999" },
      { "list", "--limit" }, { "list", "--limit", "" }, { "list", "--status", "sideways" },
      { "list", "--status", "" }, { "list", "--topic", "" }, { "list", "--status", "buried", "--status", "pending" },
      { "enqueue" }, { "enqueue", "" }, { "enqueue", "t", "{not json" }, { "enqueue", "t", "1", "2" },
      { "enqueue", "t", "{}", "--delay", "inf" }, { "enqueue", "t", "{}", "--delay", "nan" },
      { "enqueue", "t", "{}", "--delay", "-1" }, { "enqueue", "t", "{}", "--delay", "1e999" },
      { "enqueue", "t", "{}", "--delay", "1e300" }, { "enqueue", "t", "{}", "--delay", "soon" },
      { "enqueue", "t", "{}", "--key", "" }, { "enqueue", "t", "{}", "--max-attempts", "0" },
      { "enqueue", "t", "{}", "--max-attempts", "-3" }, { "enqueue", "t", "{}", "--max-attempts", "1e3" },
      { "enqueue", "t", "{}", "--max-attempts", "1000000001" },
      { "enqueue", "t", "{}", "--delay", "3155760001" },
      { "enqueue", "t", string.rep("[", 5000) },
      { "kick" }, { "kick", "1", "--buried" }, { "kick", "" }, { "kick", "1", "2" },
      { "purge" }, { "purge", "--completed" }, { "purge", "--completed", "--older-than", "nan" },
      { "purge", "--completed", "--older-than", "-5" }, { "purge", "--completed", "--older-than", "inf" },
      { "purge", "--buried", "--older-than" }, { "migrate", "now" },
      { "run" }, { "run", "--table", "t", "x.lua" }, { "run", "" },
      { "pause" }, { "pause", "" }, { "pause", "a", "b" }, { "pause", "a", "--json" },
      { "resume" }, { "resume", "" }, { "resume", "a", "b" }, { "paused", "x" },
      { "paused", "--json", "--json" },
      { "cancel" }, { "cancel", "" }, { "cancel", "1", "2" }, { "cancel", "1", "--json" },
      { "show" }, { "show", "" }, { "show", "1", "2" }, { "show", "1", "--status", "x" },
      { "kick", "--topic", "a" }, { "kick", "1", "--topic", "a" }, { "kick", "--buried", "--topic", "" },
      { "purge", "--cancelled" },
      { "schedule" }, { "schedule", "n" }, { "schedule", "n", "--topic", "t" },
      { "schedule", "n", "--topic", "t", "--every", "5", "--cron", "* * * * *" },
      { "schedule", "n", "--topic", "t", "--every", "5", "--timezone", "UTC" },
      { "schedule", "n", "--topic", "t", "--every", "x" }, { "schedule", "n", "--topic", "t", "--every", "inf" },
      { "schedule", "n", "--topic", "t", "--every", "5", "--payload", "{nope" },
      { "schedule", "", "--topic", "t", "--every", "5" }, { "schedule", "a", "b", "--topic", "t", "--every", "5" },
      { "unschedule" }, { "unschedule", "" }, { "unschedule", "a", "b" }, { "schedules", "x" },
      { "cancel", "--topic", "t" }, { "cancel", "1", "--status", "pending" }, { "cancel", "--all", "1" },
      { "cancel", "--all", "--status", "buried" }, { "purge", "--buried", "--older-than", "0", "--topic", "" },
      { "enqueue", "t", "--after", "1,,2" }, { "enqueue", "t", "--after", "" }, { "enqueue", "t", "--after", "1," },
    }

    it("every usage error exits 2 with one line on stderr and writes nothing", function()
      local url = sqlite_url()
      assert.equal(0, (cmd { "migrate", "--store", url }))
      for _, args in ipairs(USAGE) do
        local a = { table.unpack(args) }
        -- a store for the commands that would otherwise use the default one
        if a[1] and a[1] ~= "run" and a[1] ~= "help" and a[1]:sub(1, 1) ~= "-" then
          local has_store = false
          for _, v in ipairs(a) do if v:match("^%-%-store") then has_store = true end end
          if not has_store then a[#a + 1] = "--store=" .. url end
        end
        local code, out, err = cmd(a)
        local what = "relaybus " .. table.concat(a, " "):sub(1, 200)
        assert.equal(2, code, what .. ": " .. err)
        assert.equal("", out, what)
        one_inert_line(err, what)
      end
      local store = assert(relaybus.open(url))
      assert.equal(0, (H.total(store)))
      store:close()
    end)

    it("show, cancel and kick --buried --topic: what they print, and what the store keeps", function()
      local url = sqlite_url()
      local function run(want, ...)
        local a = { ... }
        a[#a + 1] = "--store=" .. url
        local code, out, err = cmd(a)
        assert.equal(want, code, err)
        return out, err
      end
      run(0, "migrate")
      local id = (run(0, "enqueue", "mail", '{"to":"a\\u001b"}')):gsub("%s+$", "")
      local out = run(0, "show", id)
      assert.matches("status%s+pending\n", out)
      assert.matches("payload:\n  {\"to\":\"a\\u001b\"}\n$", out)
      local rec = relaybus.json.decode((run(0, "show", id, "--json")))
      assert.equal(id, rec.id)
      assert.equal("a\27", rec.payload.to)
      assert.equal("cancelled " .. id .. "\n", (run(0, "cancel", id)))
      local _, err = run(1, "cancel", id)
      assert.equal("relaybus: cancel: delivery " .. id .. " is not pending or processing, or does not exist\n", err)
      assert.matches("status%s+cancelled\n", (run(0, "show", id)))
      assert.matches("last error:\n  cancelled\n", (run(0, "show", id)))
      _, err = run(1, "show", "424242")
      assert.equal("relaybus: show: no delivery 424242\n", err)
      -- a buried delivery of each of two topics: --topic kicks one
      local store = assert(relaybus.open(url))
      local d = H.dispatcher(store)
      local stop = H.stopper(d)
      local n = 0
      for _, t in ipairs { "a", "b" } do
        store:enqueue(t, {}, { max_attempts = 1 })
        d:handle(t, function() n = n + 1; if n == 2 then stop() end; error("no\nsecond line") end)
      end
      assert.is_true(H.run(d, 10))
      assert.truthy(H.poll(function() return store:stats().buried == 2 end, 5))
      assert.equal("1\n", (run(0, "kick", "--buried", "--topic", "a")))
      assert.equal(1, store:stats().buried)
      assert.equal("0\n", (run(0, "kick", "--buried", "--topic", "a")))
      local b = store:list { status = "buried" }[1]
      assert.equal("b", b.topic)
      assert.matches("last error:\n  [^\n]*no\n  second line\n", (run(0, "show", b.id)))
      assert.equal("1\n", (run(0, "purge", "--cancelled", "--older-than", "0")))
      store:close()
    end)

    it("pause, resume and paused: what they print, and what the store keeps", function()
      local url = sqlite_url()
      local function run(...)
        local a = { ... }
        a[#a + 1] = "--store=" .. url
        local code, out, err = cmd(a)
        assert.equal(0, code, err)
        return out, err
      end
      run("migrate")
      assert.equal("paused mail\n", (run("pause", "mail")))
      assert.equal("already paused: mail\n", (run("pause", "mail")))
      assert.equal("paused a\\x1bb\n", (run("pause", "a\27b")))    -- shown inert
      local out = run("paused")
      assert.equal("a\\x1bb\nmail\n", out)
      assert.equal('["a\\u001bb","mail"]\n', (run("paused", "--json")))
      local store = assert(relaybus.open(url))
      assert.same({ "a\27b", "mail" }, assert(store:paused()))
      store:close()
      assert.equal("resumed mail\n", (run("resume", "mail")))
      assert.equal("not paused: mail\n", (run("resume", "mail")))
      run("resume", "a\27b")
      local none, err = run("paused")
      assert.equal("", none)
      assert.equal("(no paused topics)\n", err)
      assert.equal("[]\n", (run("paused", "--json")))
    end)

    it("schedule, schedules and unschedule: what they print, and what the store keeps; enqueue --after", function()
      local url = sqlite_url()
      local function run(want, ...)
        local a = { ... }
        a[#a + 1] = "--store=" .. url
        local code, out, err = cmd(a)
        assert.equal(want, code, err)
        return out, err
      end
      run(0, "migrate")
      local out = run(0, "schedule", "nightly", "--topic", "report.build", "--cron", "0 3 * * *",
                      "--timezone", "Europe/Berlin", "--payload", '{"n":12345678901234567890}')
      assert.truthy(out:match("^scheduled nightly: next tick %d+%-%d+%-%d+ 0[12]:00:00 UTC\n$"), out)
      out = run(0, "schedule", "nightly", "--topic", "report.build", "--cron", "0 3 * * *",
                "--timezone", "Europe/Berlin")
      assert.truthy(out:match("^replaced nightly: next tick"), out)
      run(0, "schedule", "hb\27x", "--topic", "hb", "--every", "90")
      out = run(0, "schedules")
      assert.truthy(out:find("hb\\x1bx%s+hb%s+every 1m30s"), out)       -- shown inert
      assert.truthy(out:find("nightly%s+report%.build%s+cron 0 3 %* %* %* %(Europe/Berlin%)"), out)
      local list = relaybus.json.decode((run(0, "schedules", "--json")))
      assert.equal(2, #list)
      assert.equal("hb\27x", list[1].name)
      assert.equal(90, list[1].every)
      local _, err = run(1, "schedule", "x", "--topic", "t", "--cron", "0 0 30 2 *")
      assert.truthy(err:match("^relaybus: schedule: cron '0 0 30 2 %*' never fires"), err)
      _, err = run(1, "schedule", "x", "--topic", "t", "--cron", "* * * * *", "--timezone", "Mars/Base")
      assert.truthy(err:find("not in the tz database", 1, true), err)
      assert.equal("unscheduled nightly\n", (run(0, "unschedule", "nightly")))
      _, err = run(1, "unschedule", "nightly")
      assert.equal("relaybus: unschedule: no schedule nightly\n", err)
      local store = assert(relaybus.open(url))
      local kept = assert(store:schedules())
      assert.equal(1, #kept)
      store:close()
      -- cancel --all, purge --topic
      run(0, "enqueue", "x.a", "--delay", "3600")
      run(0, "enqueue", "x.a", "--delay", "3600")
      run(0, "enqueue", "x.b", "--delay", "3600")
      assert.equal("0\n", (run(0, "cancel", "--all", "--topic", "x.a", "--status", "processing")))
      assert.equal("2\n", (run(0, "cancel", "--all", "--topic", "x.a")))
      assert.equal("0\n", (run(0, "purge", "--cancelled", "--older-than", "0", "--topic", "x.b")))
      assert.equal("2\n", (run(0, "purge", "--cancelled", "--older-than", "0", "--topic", "x.a")))
      assert.equal("1\n", (run(0, "cancel", "--all")))
      -- enqueue --after
      local a = (run(0, "enqueue", "t")):gsub("%s+$", "")
      local b = (run(0, "enqueue", "t", "--after", a .. "," .. a)):gsub("%s+$", "")
      assert.truthy(run(0, "show", b):find("after 1 dependency", 1, true))
      _, err = run(1, "enqueue", "t", "--after", a .. ",999999")
      assert.equal("relaybus: enqueue: sqlite: after: no delivery 999999\n", err)
    end)

    it("accepts the largest values it allows, on every store", function()
      for _, entry in ipairs(S.list()) do
        local url, opts = entry.url()
        local t = opts.table or S.default_table
        local args = { "--store", url, "--table", t }
        local function with(...)
          local a = { ... }
          for _, v in ipairs(args) do a[#a + 1] = v end
          return a
        end
        for _, a in ipairs {
          with("migrate"),
          with("enqueue", "t", "{}", "--max-attempts", "1000000000", "--delay", "3155760000"),
          with("list", "--limit", "1000000"),
          with("purge", "--completed", "--buried", "--older-than", "3155760000"),
        } do
          local code, _, err = cmd(a)
          assert.equal(0, code, entry.name .. ": " .. table.concat(a, " ") .. ": " .. err)
        end
        local code, out = cmd(with("list", "--json"))
        assert.equal(0, code)
        local rows = relaybus.json.decode(out)
        assert.equal(1, #rows, entry.name)
        assert.equal(1000000000, rows[1].max_attempts)
      end
    end)

    it("control characters in any argument give exit 1 or 2 and one inert line", function()
      local url = sqlite_url()
      assert.equal(0, (cmd { "migrate", "--store", url }))
      local bad = "x\27[2J\27]0;t\7\r\n\t\127\xc2\x9b\xff\xe2\x80\xae"
      local shapes = {
        { bad }, { "--" .. bad }, { "stats", bad }, { "stats", "--" .. bad }, { "stats", "--table", bad },
        { "stats", "--store", bad }, { "stats", "--store", "sqlite:" .. S.tmpdir() .. "/no/" .. bad },
        { "list", "--status", bad }, { "list", "--limit", bad }, { "kick", bad },
        { "enqueue", "t", bad }, { "enqueue", "t", "{}", "--delay", bad },
        { "enqueue", "t", "{}", "--max-attempts", bad }, { "help", bad }, { "run", S.tmpdir() .. "/" .. bad },
        { "purge", "--completed", "--older-than", bad },
      }
      for _, args in ipairs(shapes) do
        local a = { table.unpack(args) }
        local has_store = false
        for _, v in ipairs(a) do if v == "--store" then has_store = true end end
        if not has_store and a[1] ~= "run" then a[#a + 1] = "--store=" .. url end
        local code, _, err = cmd(a)
        local what = "relaybus " .. table.concat(a, " ")
        assert.truthy(code == 1 or code == 2, what .. " exited " .. tostring(code))
        one_inert_line(err, what)
      end
      -- as data they are fine: a topic and key with control characters are stored as given
      local code, _, err = cmd { "enqueue", bad, "{}", "--key", bad, "--store", url }
      assert.equal(0, code, err)
      local store = assert(relaybus.open(url))
      local rows = assert(store:list {})
      store:close()
      assert.equal(1, #rows)
    end)

    it("runtime failures exit 1 with one line: a 10,000-character URL, a directory, an unreadable file, not a database", function()
      local dir = S.tmpfile("dir")
      os.execute("mkdir " .. q(dir))
      local garbage = S.tmpfile("garbage") .. ".db"
      S.write(garbage, string.rep("not a database\n", 100))
      local cases = {
        { "stats", "--store", "sqlite:" .. string.rep("a", 10000) },
        { "migrate", "--store", "sqlite:" .. string.rep("a", 10000) },
        { "stats", "--store", "postgresql://u:SECRETPW@" .. string.rep("h", 10000) .. "/db" },
        { "stats", "--store", "mongodb://u:SECRETPW@" .. string.rep("h", 10000) .. "/db" },
        { "stats", "--store", "nosuch://" .. string.rep("x", 10000) },
        { "migrate", "--store", "sqlite:" .. dir }, { "stats", "--store", "sqlite:" .. dir },
        { "migrate", "--store", "sqlite:" .. garbage }, { "stats", "--store", "sqlite:" .. garbage },
        { "migrate", "--store", "sqlite:" .. S.tmpdir() .. "/no/such/dir/x.db" },
        { "run", dir },
      }
      for _, args in ipairs(cases) do
        local code, out, err = cmd(args)
        local what = ("relaybus " .. table.concat(args, " ")):sub(1, 120)
        assert.equal(1, code, what .. ": " .. err)
        assert.equal("", out, what)
        one_inert_line(err, what)
        assert.truthy(#err < 1200, what .. ": a message of " .. #err .. " bytes")
        assert.is_nil(err:find("SECRETPW", 1, true), err)
      end
      assert.truthy(select(3, cmd { "stats", "--store", "sqlite:" .. dir }):find("directory", 1, true))
    end)

    it("an unreadable SQLite file: exit 1 with one line, and it is left alone", function()
      local dir = S.tmpfile("locked")
      os.execute("mkdir " .. q(dir) .. " && chmod 755 " .. q(dir) .. " " .. q(S.tmpdir()))
      local path = dir .. "/locked.db"
      assert.equal(0, (cmd { "migrate", "--store", "sqlite:" .. path }))
      os.execute("chmod 000 " .. q(path))
      local root = io.popen("id -u"):read("l") == "0"
      for _, command in ipairs { "stats", "migrate", "enqueue" } do
        local args = { command, "--store", "sqlite:" .. path }
        if command == "enqueue" then args = { "enqueue", "t", "--store", "sqlite:" .. path } end
        local code, out, err = cmd(args, nil, { as_nobody = root, cwd = dir })
        assert.equal(1, code, command .. ": " .. err)
        assert.equal("", out)
        one_inert_line(err, command)
      end
      local p = io.popen("stat -c %a " .. q(path))
      assert.equal("0", p:read("l"))
      p:close()
      os.execute("chmod 700 " .. q(S.tmpdir()))
    end)
  end)

  describe("the parser on its own", function()
    local cli = cli_module()

    it("returns the command without running anything", function()
      local c = assert(cli.parse { "--store", "sqlite:x.db", "list", "--status", "buried", "--limit", "5" })
      assert.equal("list", c.name)
      assert.equal("sqlite:x.db", c.store)
      assert.same({ store = "sqlite:x.db", status = "buried", limit = 5 }, c.opts)
      c = assert(cli.parse { "enqueue", "t", '{"a":[1]}', "--delay", "1.5e2", "--max-attempts", "3" })
      assert.equal("t", c.topic)
      assert.equal('{"a":[1]}', c.text)   -- kept as given, stored with enqueue_json
      assert.equal(150, c.opts.delay)
      assert.equal(3, c.opts["max-attempts"])
      c = assert(cli.parse { "run", "--store", "sqlite:y.db", "s.lua", "--help", "--json" })
      assert.equal("s.lua", c.script)
      assert.same({ "--help", "--json" }, c.script_args)
      assert.equal("help", assert(cli.parse { "list", "-h" }).name)
      assert.is_false(S.exists("x.db"))
    end)

    it("gives a one-line usage error for NUL bytes, control characters and junk in any argument", function()
      local pieces = { "\0", "a\0b", "\27[2J", "\n", "\r", "--", "-", "--=", "--store=", "=",
                       "\xff\xfe", "\xc0\x80", "\xed\xa0\x80", "\u{202e}", string.rep("x", 5000),
                       "list", "stats", "enqueue", "kick", "purge", "migrate", "run", "help",
                       "--store", "--table", "--json", "--limit", "1e999", "-1", "nan", "inf",
                       "--delay", "--older-than", "--status", "--buried", "--completed", "{}" }
      math.randomseed(7)
      for _ = 1, 3000 do
        local argv = { n = math.random(0, 6) }
        for i = 1, argv.n do
          local p = pieces[math.random(#pieces)]
          if math.random() < 0.3 then p = p .. pieces[math.random(#pieces)] end
          argv[i] = p
        end
        local ok, c, msg = pcall(cli.parse, argv)
        assert.is_true(ok, "parse raised: " .. tostring(c))
        if not c then
          assert.is_string(msg)
          assert.truthy(msg:match("^[^\n]+$"), msg)
          assert.is_nil(msg:find("[%z\1-\31\127]"), msg)
          assert.truthy(utf8.len(msg), msg)
        end
      end
      local c, msg = cli.parse { "stats", "--store", "sqlite:a\0b" }
      assert.is_nil(c)
      assert.truthy(msg:find("NUL", 1, true), msg)
    end)
  end)
end)
