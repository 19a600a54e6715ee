-- mongo_errors_spec.lua -- what MongoDB users get wrong: a URL without a database (the
-- documented default, relaybus, is used), payloads BSON cannot hold (a key with a NUL), and
-- transactions on a server without a replica set. One-line errors, nothing written.
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local relaybus = S.relaybus()

local url = os.getenv("RELAYBUS_TEST_MONGO")
local ci = os.getenv("CI") == "true"

describe("MongoDB bad input", function()
  if not url then
    if ci then
      it("has a server to run against", function()
        error("RELAYBUS_TEST_MONGO is not set: the MongoDB server was not started")
      end)
    end
    return
  end

  local store
  before_each(function()
    store = assert(relaybus.open(url, { table = S.unique("minput") }))
  end)
  after_each(function() if store then store:close() end end)

  it("opens the database `relaybus` when the URL names none", function()
    local base = url:match("^(mongodb://[^/?]+)")
    local s, err = relaybus.open(base, { table = S.unique("nodb") })
    assert.is_truthy(s, err)
    local id = assert(s:enqueue("t", { a = 1 }))
    assert.same({ a = 1 }, assert(s:get(id)).payload)
    s:close()
    local again = assert(relaybus.open(base .. "/relaybus", { table = "x" }))
    again:close()
  end)

  it("refuses a payload with a key holding a NUL byte and writes nothing", function()
    local before = H.total(store)
    local ok, id, err = pcall(store.enqueue, store, "t", { ["a\0b"] = 1 })
    if ok then
      assert.is_nil(id, "a key with a NUL was stored")
      H.one_line(err)
    else
      assert.truthy(tostring(id):match("^relaybus:"), tostring(id))
    end
    assert.equal(before, H.total(store))
  end)

  it("refuses the whole batch when one payload cannot be held", function()
    local before = H.total(store)
    local ok, ids, err = pcall(store.enqueue_many, store, {
      { "t", { fine = true } }, { "t", { ["bad\0key"] = 2 } } })
    if ok then
      assert.is_nil(ids)
      H.one_line(err)
    end
    assert.equal(before, H.total(store))
  end)

  it("says transactions need a replica set, in one line, when the server has none", function()
    if H.mongo_replica_set(store) then
      local ok = store:transaction(function(tx) tx:enqueue("t", 1) end)
      assert.is_true(ok)
      return
    end
    local ok, err = store:transaction(function(tx) tx:enqueue("t", 1) end)
    assert.is_nil(ok)
    H.one_line(err)
    assert.truthy(err:lower():find("replica set", 1, true), err)
  end)
end)
