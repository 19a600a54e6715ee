-- mongo_dialect_spec.lua -- the MongoDB store's two code paths (docs/stores.md, "Dialects"):
-- ?dialect=mongodb|ferretdb in the URL picks one, else the server's own is detected. Only
-- FerretDB runs here, so conformance_spec runs a second time with ?dialect=mongodb (the
-- "mongodb-dialect" entry of spec/support/stores.lua); this spec checks which path that is,
-- and that the store says what FerretDB cannot show of it.
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local relaybus = S.relaybus()

-- Runs the delivery `id` of topic "work" through a dispatcher; returns its record after.
local function run_one(st, id)
  local d = H.dispatcher(st)
  local stop = H.stopper(d)
  d:handle("work", function() stop() end)
  assert.is_true(H.run(d, 10))
  return assert(st:get(id))
end

local function plain(url) return (url:gsub("([?&])dialect=%a+&?", "%1"):gsub("[?&]$", "")) end

local function collections(url)
  local db = plain(url):match("^mongodb://[^/]+/([^?]+)") or "relaybus"
  local p = assert(io.popen(S.quote(S.build .. "/mongo_collections") .. " " .. S.quote(plain(url)) ..
                            " " .. S.quote(db)))
  local names = p:read("a")
  assert.is_true(p:close(), "mongo_collections failed")
  local set = {}
  for name in names:gmatch("[^\n]+") do set[name] = true end
  return set
end

local function with_dialect(url, d)
  return url .. (url:find("?", 1, true) and "&" or "?") .. "dialect=" .. d
end

for _, entry in ipairs(S.list { dialects = true }) do
  if entry.name ~= "mongodb-dialect" then goto continue end
  describe("MongoDB dialects:", function()
    local base     -- the server's URL, no dialect
    local ferretdb -- the server is FerretDB: detected, it makes the ready queue
    before_each(function()
      local url, opts = entry.url()
      base = plain(url)
      if ferretdb == nil then
        local st = assert(relaybus.open(base, opts))
        st:close()
        ferretdb = collections(base)[opts.table .. "_queue"] == true
      end
    end)
    after_each(S.reset)
    teardown(function() S.cleanup() end)

    it("?dialect=mongodb claims without the ready queue: migrate makes no _queue collection", function()
      local t = S.unique("dia")
      local st = assert(relaybus.open(with_dialect(base, "mongodb"), { table = t }))
      local id = assert(st:enqueue("work", { n = 1 }))
      assert.equal("completed", run_one(st, id).status)
      st:close()
      local names = collections(base)
      assert.is_true(names[t] == true, "the deliveries collection")
      assert.is_nil(names[t .. "_queue"], "a ready queue in the mongodb dialect")
    end)

    it("?dialect=ferretdb makes and uses the ready queue, on either server", function()
      local t = S.unique("dia")
      local st = assert(relaybus.open(with_dialect(base, "FerretDB"), { table = t }))
      local id = assert(st:enqueue("work", { n = 1 }))
      assert.equal("completed", run_one(st, id).status)
      st:close()
      assert.is_true(collections(base)[t .. "_queue"] == true)
    end)

    it("refuses any other dialect, in one line, before it connects", function()
      local st, err = relaybus.open(with_dialect("mongodb://127.0.0.1:1/x", "postgres"))
      assert.is_nil(st)
      assert.equal('mongodb: bad URL: dialect must be mongodb or ferretdb, not "postgres"', err)
    end)

    it("says at open what FerretDB cannot show of the mongodb dialect", function()
      local code, _, err = S.run_command { S.bin, "migrate", "--store", with_dialect(base, "mongodb"),
                                           "--table", S.unique("dia") }
      assert.equal(0, code, err)
      if ferretdb then
        -- what conformance on mongodb-dialect cannot show here: the bulk write path (FerretDB
        -- 1.24 deadlocks on concurrent multi-update commands, so writes stay one per
        -- command) and the atomicity of the version-filtered write (FerretDB's filter is a
        -- read then a write: the tickets still decide, as in the ferretdb dialect)
        assert.truthy(err:find("the mongodb dialect on FerretDB", 1, true), err)
        assert.truthy(err:find("one write per command", 1, true), err)
        assert.truthy(err:find("not atomic there", 1, true), err)
      else
        assert.is_nil(err:find("FerretDB", 1, true), err)
      end
    end)
  end)
  ::continue::
end
