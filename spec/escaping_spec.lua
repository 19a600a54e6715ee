-- escaping_spec.lua -- stored bytes and escapes in the dashboard's URLs and the command's output,
-- on every store (found by a hostile pass): a %00 in a dashboard URL was decoded in place and read
-- cut short ("/api/deliveries/1%00" served delivery 1, "topic=t%00x" filtered on "t"); the text
-- output of `stats --topics` and `list` printed a stored backslash raw, so a topic "a\x0ab" (the
-- characters) and "a<newline>b" printed the same line.
local S = require "spec.support.stores"
local D = require "spec.support.dash"
local relaybus = S.relaybus()
local q = S.quote

local function cmd(args)
  local base = S.tmpfile("attack")
  local parts = { q(S.bin) }
  for _, a in ipairs(args) do parts[#parts + 1] = q(a) end
  local _, _, code = os.execute(table.concat(parts, " ") .. " >" .. q(base .. ".out") .. " 2>"
    .. q(base .. ".err") .. " </dev/null")
  return code, S.read(base .. ".out") or "", S.read(base .. ".err") or ""
end

for _, entry in ipairs(S.list()) do
  describe("stored bytes escaped on " .. entry.name .. ":", function()
    after_each(function() S.reset() end)
    teardown(function() S.cleanup() end)

    it("a %00 in a dashboard URL is a 400, never the text cut short at it", function()
      local store = S.open(entry, { migrate = true })
      local id = assert(store:enqueue("t", {}))
      D.with_server(store, { token = D.TOKEN }, function(_, call)
        for _, path in ipairs { "/api/deliveries/" .. id .. "%00", "/api/deliveries/" .. id .. "%00x",
                                "/api/deliveries?topic=t%00x", "/api/deliveries?topic=%00",
                                "/api/deliveries?after=" .. id .. "%00" } do
          local st, body = call("GET", path)
          assert.equal(400, st, path .. ": " .. body)
        end
        local st, body = call("POST", "/api/deliveries/" .. id .. "%00/bury", D.auth)
        assert.equal(400, st, body)
        assert.equal("pending", store:get(id).status, "the bury was not applied to the cut id")
        -- what has no %00 is served as before
        local st2, _, j = call("GET", "/api/deliveries?topic=t")
        assert.equal(200, st2)
        assert.equal(1, #j.deliveries)
        assert.equal(200, (call("GET", "/api/deliveries/" .. id)))
      end)
    end)

    it("stats --topics and list print a stored backslash so no two topics read the same", function()
      local store, url, _, tbl = S.open(entry, { migrate = true })
      local nl_ok = pcall(store.enqueue, store, "a\nb", {})
      assert(store:enqueue("a\\x0ab", {}))
      local code, out, err = cmd { "stats", "--topics", "--store", url, "--table", tbl }
      assert.equal(0, code, err)
      local lines = {}
      for line in out:gmatch("[^\n]*\n") do lines[#lines + 1] = line end
      assert.equal(nl_ok and 3 or 2, #lines, "one line a topic and the header: " .. out)
      assert.truthy(out:find("a\\\\x0ab ", 1, true), out)
      if nl_ok then assert.truthy(out:find("\na\\x0ab ", 1, true), out) end
      local firsts = {}
      for i = 2, #lines do
        local t = lines[i]:match("^(%S+)")
        assert.is_nil(firsts[t], "two topics print as " .. t)
        firsts[t] = true
      end
      local code2, out2, err2 = cmd { "list", "--store", url, "--table", tbl }
      assert.equal(0, code2, err2)
      assert.truthy(out2:find(" a\\\\x0ab ", 1, true), out2)
    end)
  end)
end
