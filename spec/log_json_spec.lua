-- log_json_spec.lua -- RELAYBUS_LOG=json: every line the library logs is one JSON object with
-- time, level and message, and the lines about a delivery (raised, buried) carry its id and
-- topic; quotes, newlines and bytes that are no UTF-8 stay valid JSON.
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

  it("takes a level beside it", function()
    local url = "sqlite:" .. S.tmpfile("log") .. ".db"
    local p = S.spawn(S.support .. "/log_worker.lua", { url }, { env = { RELAYBUS_LOG = "json,error" } })
    assert.truthy(S.wait_for(function() return S.rc(p) end, 30))
    assert.equal("", S.read(p.err), "info lines are below error")
  end)
end)
