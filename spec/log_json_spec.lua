-- log_json_spec.lua -- what the library logs. RELAYBUS_LOG=json: every line is one JSON object
-- with time, level and message, and the lines about a delivery (raised, buried) carry its id
-- and topic; quotes, newlines and bytes that are no UTF-8 stay valid JSON. At the relaybus
-- command's default level (info) every failure of a run leaves a line (a raise, a burial by
-- the handler or a webhook, a retry a webhook asks for, a timeout), the count of lines the
-- rate limit left out is not lost at exit, and a script's misuse error has one prefix.
local S = require "spec.support.stores"
local json = S.relaybus().json

describe("RELAYBUS_LOG=json", function()
  after_each(function() S.reset() end)

  it("writes one JSON object a line, with the delivery's id and topic", function()
    local url = "sqlite:" .. S.tmpfile("log") .. ".db"
    local p = S.spawn(S.support .. "/log_worker.lua", { url }, { env = { RELAYBUS_LOG = "json" } })
    assert.truthy(S.wait_for(function() return S.rc(p) end, 30), "worker did not end")
    assert.equal(0, S.rc(p), S.read(p.err))
    local lines, about = 0, {}
    for line in S.read(p.err):gmatch("[^\n]+") do
      lines = lines + 1
      local ok, o = pcall(json.decode, line)
      assert.truthy(ok and type(o) == "table", "not a JSON object: " .. line)
      assert.matches("^%d%d%d%d%-%d%d%-%d%dT%d%d:%d%d:%d%d%.%d%d%dZ$", o.time)
      assert.truthy(({ debug = 1, info = 1, warn = 1, error = 1 })[o.level], line)
      assert.equal("string", type(o.message))
      if o.delivery_id then
        assert.equal('top"ic', o.topic)
        about[#about + 1] = o.message
      end
    end
    assert.truthy(lines >= 2)
    local text = table.concat(about, "\n")
    assert.matches("raised: bad \"thing\" second line \239\191\189", text, 1, true)
    assert.matches("buried after 1 attempts", text, 1, true)
  end)

  it("carries the lines of the module's Lua parts too: a d:every job that raised, with hostile errors", function()
    local script = S.tmpfile("every") .. ".lua"
    -- the errors: a value whose __tostring raises, bytes that are not UTF-8 and a NUL, then a
    -- plain one; the name has a quote and a newline
    S.write(script, [[
local relaybus = require "relaybus"
local store = assert(relaybus.open(arg[1]))
local d = relaybus.dispatcher(store, { poll_interval = 0.05 })
local n = 0
d:every("tick\n\"q", 0.05, function()
  n = n + 1
  if n == 1 then error(setmetatable({}, {__tostring = function() error("raised in tostring") end})) end
  if n == 2 then error("bytes \255\0 after") end
  error("tick went wrong")
end)
d:start()
relaybus.spawn(function() relaybus.sleep(0.4) d:stop() end)
relaybus.run()
]])
    local p = S.spawn(script, { "sqlite:" .. S.tmpfile("every") .. ".db" }, { env = { RELAYBUS_LOG = "json" } })
    assert.truthy(S.wait_for(function() return S.rc(p) end, 30), "the script did not end")
    assert.equal(0, S.rc(p), S.read(p.err))
    local said = {}
    for line in S.read(p.err):gmatch("[^\n]+") do
      local ok, o = pcall(json.decode, line)
      assert.truthy(ok and type(o) == "table", "not a JSON object: " .. line)
      assert.truthy(utf8.len(o.message), "not UTF-8: " .. line)
      if o.message:find("every 'tick \"q' failed", 1, true) then
        assert.equal("error", o.level)
        said[#said + 1] = o.message
      end
    end
    local text = table.concat(said, "\n")
    assert.truthy(#said >= 3, "fewer than 3 lines about the failed every job: " .. S.read(p.err))
    assert.truthy(text:find("a value whose __tostring raised", 1, true), text)
    assert.truthy(text:find("bytes \239\191\189", 1, true), text)
    assert.truthy(text:find("tick went wrong", 1, true), text)
  end)

  -- A topic and an error of bytes that are not UTF-8, NUL, quotes, backslashes and DEL, the
  -- error 120 KB long: every line is still one JSON object of valid UTF-8, each field cut.
  it("keeps every line JSON whatever bytes a topic or an error holds, however long", function()
    local dir = S.tmpdir()
    S.write(dir .. "/hostile.lua", [[
local relaybus = require "relaybus"
local store = assert(relaybus.open(arg[1]))
local topic = "bad\255to\"pic\\\127"
assert(store:enqueue(topic, {}, { max_attempts = 1 }))
local d = relaybus.dispatcher(store, { poll_interval = 0.05 })
d:handle(topic, function() error("e\0rr\255\"\\\127" .. string.rep("\200x", 60000), 0) end)
d:start()
relaybus.spawn(function() relaybus.sleep(1) d:stop() end)
relaybus.run()
]])
    local rc, _, err = S.run_command({ "env", "RELAYBUS_LOG=json", S.bin, "run", dir .. "/hostile.lua",
                                       "sqlite:" .. dir .. "/h.db" })
    assert.equal(0, rc, err)
    local about = 0
    for line in err:gmatch("[^\n]+") do
      assert.truthy(utf8.len(line), "not UTF-8: " .. line:sub(1, 200))
      assert.truthy(#line < 16384, "a line of " .. #line .. " bytes")
      local ok, o = pcall(json.decode, line)
      assert.truthy(ok and type(o) == "table", "not a JSON object: " .. line:sub(1, 200))
      if o.topic then
        about = about + 1
        assert.equal("bad\u{FFFD}to\"pic\\\127", o.topic)
      end
    end
    assert.truthy(about >= 1, err:sub(1, 400))
  end)

  -- Found by a hostile run: the line a limit writes with the count of those it left out
  -- carried the topic cut at 127 bytes; it carries the whole topic, as the others do.
  it("the line with the count of similar lines left out carries the whole topic", function()
    local dir = S.tmpdir()
    S.write(dir .. "/flood.lua", [[
local relaybus = require "relaybus"
local store = assert(relaybus.open(arg[1]))
local topic = "ctl." .. string.rep("\1", 300) .. ".END"
for i = 1, 7 do assert(store:enqueue(topic, i)) end
local d = relaybus.dispatcher(store, { poll_interval = 0.01 })
d:handle(topic, function(_, ctx) ctx:bury("r") end)
d:start()
relaybus.spawn(function() relaybus.sleep(1) d:stop() end)
relaybus.run()
]])
    local rc, _, err = S.run_command({ "env", "RELAYBUS_LOG=json", S.bin, "run", dir .. "/flood.lua",
                                       "sqlite:" .. dir .. "/f.db" })
    assert.equal(0, rc, err)
    local topics, counted = 0, 0
    for line in err:gmatch("[^\n]+") do
      local ok, o = pcall(json.decode, line)
      assert.truthy(ok and type(o) == "table", "not a JSON object: " .. line:sub(1, 200))
      if o.topic then
        topics = topics + 1
        assert.equal("ctl." .. string.rep("\1", 300) .. ".END", o.topic)
        if o.message:find("similar lines left out", 1, true) then counted = counted + 1 end
      end
    end
    assert.equal(6, topics, err:sub(1, 400))      -- the first 5 (RB_LOG_BURST), then the count's line
    assert.equal(1, counted, err:sub(1, 400))
  end)

  it("takes a level beside it", function()
    local url = "sqlite:" .. S.tmpfile("log") .. ".db"
    local p = S.spawn(S.support .. "/log_worker.lua", { url }, { env = { RELAYBUS_LOG = "json,error" } })
    assert.truthy(S.wait_for(function() return S.rc(p) end, 30))
    assert.equal("", S.read(p.err), "info lines are below error")
  end)
end)


describe("the relaybus command at its default log level", function()
  local receiver
  setup(function()
    local bin = S.build .. "/http_receiver"
    assert(S.exists(bin), bin .. " is missing (make examples)")
    local p = assert(io.popen("exec " .. S.quote(bin) .. " -"))
    local port, pid = (p:read("l") or ""):match("^(%d+) (%d+)$")
    assert(port, "the receiver printed no port")
    receiver = { url = "http://127.0.0.1:" .. port, pid = pid, proc = p }
  end)
  teardown(function()
    if receiver then
      os.execute("kill " .. receiver.pid)
      receiver.proc:close()
    end
  end)
  after_each(function() S.reset() end)

  -- Runs spec/support/log_outcomes.lua CASE [URL] with RELAYBUS_LOG unset; returns its stderr.
  local function outcome(case, target)
    local url = "sqlite:" .. S.tmpfile("log") .. ".db"
    local p = S.spawn(nil, { url, case, target },
      { argv = { "env", "-u", "RELAYBUS_LOG", S.bin, "run", S.support .. "/log_outcomes.lua" } })
    assert.equal(0, S.wait_exit(p, 30), "the worker did not end well: " .. (S.read(p.err) or ""))
    return S.read(p.err) or ""
  end

  it("logs a burial by ctx:bury(reason) with the delivery and the reason", function()
    local err = outcome("bury")
    assert.matches("relaybus: delivery %d+ %(user%.sync%) buried: no such user\n", err)
  end)

  it("logs a webhook's 404, which buries the delivery", function()
    local err = outcome("webhook", receiver.url .. "/status/404")
    assert.matches("relaybus: delivery %d+ %(order%.push%) buried: HTTP 404", err)
  end)

  it("logs a webhook's 503, which retries the delivery", function()
    local err = outcome("webhook", receiver.url .. "/status/503")
    assert.matches("relaybus: delivery %d+ %(order%.push%) rescheduled in 60 s: HTTP 503", err)
  end)

  it("logs a handler's timeout that will be retried", function()
    local err = outcome("timeout")
    assert.matches("relaybus: run of %d+ %(slow%.job%) passed its timeout; retried in 60 s\n", err)
  end)

  it("writes the count of the lines its limit left out when the process ends", function()
    -- twelve raises and twelve burials in a moment: five lines of each get through, and the
    -- rest is counted at the exit (the last line left out, with the count of the others)
    local err = outcome("many")
    for _, what in ipairs { "raised: bad job", "buried after 1 attempts" } do
      local lines, left_out = 0, 0
      for line in err:gmatch("[^\n]+") do
        if line:find(what, 1, true) then
          lines = lines + 1
          left_out = left_out + tonumber(line:match("%((%d+) similar lines left out%)") or 0)
        end
      end
      assert.equal(12, lines + left_out, what .. ": " .. lines .. " lines and " .. left_out
        .. " counted as left out, not 12:\n" .. err)
    end
  end)

  it("prints a script's misuse error with one relaybus: prefix, and an error whose __tostring raises as one line", function()
    local dir = S.tmpdir()
    S.write(dir .. "/misuse.lua", 'require("relaybus").open(5)\n')
    local rc, _, err = S.run_command({ S.bin, "run", dir .. "/misuse.lua" })
    assert.equal(1, rc)
    assert.equal("relaybus: open: the store URL must be a string\n", err)
    S.write(dir .. "/tostring.lua",
      'error(setmetatable({}, {__tostring = function() error("no text for you") end}))\n')
    rc, _, err = S.run_command({ S.bin, "run", dir .. "/tostring.lua" })
    assert.equal(1, rc)
    assert.equal("relaybus: (error object is a table value)\n", err)
  end)
end)
