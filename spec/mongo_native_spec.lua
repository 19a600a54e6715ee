-- mongo_native_spec.lua -- the MongoDB store's payloads as BSON values (runtime/stores/mongo/payload.c,
-- docs/stores.md "The delivery document"): deliveries an application inserts with its own
-- driver (spec/support/mongo_enqueue.c, on libmongoc) run through a dispatcher with their
-- numbers exact; relaybus's own enqueue writes BSON an application can query; what MongoDB
-- cannot hold as it is stays JSON text, and older documents' text payloads still read.
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local relaybus = S.relaybus()
local json = relaybus.json

local function helper()
  local bin = S.build .. "/mongo_enqueue"
  if not S.exists(bin) then
    -- built by `make examples`; compiled here too so the spec also runs on a bare build directory
    local ok = os.execute("cc -std=c11 -D_GNU_SOURCE -O2 -o " .. S.quote(bin) ..
                          " spec/support/mongo_enqueue.c $(pkg-config --cflags --libs libmongoc-1.0)")
    assert(ok, "cannot build " .. bin)
  end
  return bin
end

local function plain_url(url)
  return (url:gsub("([?&])dialect=%a+&?", "%1"):gsub("[?&]$", ""))   -- the store's own option
end

-- Inserts one delivery per line (canonical Extended JSON {topic, payload[, payload_format]});
-- returns their ids.
local function outside_enqueue(url, tbl, lines, queue)
  local path = S.tmpfile("lines") .. ".jsonl"
  local one = {}
  for i, l in ipairs(lines) do one[i] = l:gsub("\n%s*", " ") end
  S.write(path, table.concat(one, "\n") .. "\n")
  local code, out, err = S.run_command({ "sh", "-c", S.quote(helper()) .. " " .. S.quote(plain_url(url)) ..
    " " .. S.quote(tbl) .. (queue and " queue" or "") .. " < " .. S.quote(path) })
  assert(code == 0, "mongo_enqueue: " .. err)
  local ids = {}
  for id in out:gmatch("%x+") do ids[#ids + 1] = id end
  assert.equal(#lines, #ids)
  return ids
end

-- The stored payload and payload_format of a delivery, decoded from canonical Extended JSON.
local function stored(url, tbl, id)
  local code, out, err = S.run_command({ helper(), plain_url(url), tbl, "dump", id })
  assert(code == 0, "mongo_enqueue dump: " .. err)
  return assert(json.decode(out))
end

-- Runs a dispatcher on `topic` until it has seen n deliveries; returns their payloads by id.
local function run_all(store, topic, n)
  local d = H.dispatcher(store)
  local stop = H.stopper(d)
  local seen, count = {}, 0
  d:handle(topic, function(delivery)
    if seen[delivery.id] == nil then count = count + 1 end
    seen[delivery.id] = delivery.payload == nil and json.null or delivery.payload
    if count == n then stop() end
  end)
  assert.is_true(H.run(d, 20), "the dispatcher did not see every delivery")
  return seen
end

for _, entry in ipairs(S.list { dialects = true }) do
  if entry.kind ~= "mongodb" then goto continue end
  describe("native payloads on " .. entry.name .. ":", function()
    local store, url, tbl
    -- the ferretdb dialect claims from the ready queue: an outside writer adds the entry
    local queue = entry.name ~= "mongodb-dialect"

    before_each(function()
      store, url, _, tbl = S.open(entry)
    end)
    after_each(S.reset)
    teardown(function() S.cleanup() end)

    it("deliveries inserted by an outside driver run, their numbers exact", function()
      local ids = outside_enqueue(url, tbl, {
        [=[{"topic": "out", "payload": {"max": {"$numberLong": "9223372036854775807"},
          "min": {"$numberLong": "-9223372036854775808"}, "above53": {"$numberLong": "9007199254740993"},
          "i32": {"$numberInt": "-7"}, "one": {"$numberDouble": "1.0"}, "tenth": {"$numberDouble": "0.1"},
          "tiny": {"$numberDouble": "5e-324"}, "e300": {"$numberDouble": "1e+300"},
          "text": "caf\u00e9 \"q\" back\\slash \n\t\u0001 \ud83d\ude00",
          "list": [{"$numberInt": "1"}, {"x": null}, true, false, {}], "nested": {"a": {"b": {"c": {}}}}}}]=],
        [=[{"topic": "out", "payload": "just text"}]=],
        [=[{"topic": "out", "payload": {"$numberLong": "42"}}]=],
        [=[{"topic": "out", "payload": {"$numberDouble": "2.0"}}]=],
        [=[{"topic": "out", "payload": []}]=],
        [=[{"topic": "out", "payload": null}]=],
      }, queue)
      local seen = run_all(store, "out", #ids)
      H.assert_exactly({
        max = math.maxinteger, min = math.mininteger, above53 = (1 << 53) + 1, i32 = -7, one = 1.0,
        tenth = 0.1, tiny = 5e-324, e300 = 1e300,
        text = "caf\u{e9} \"q\" back\\slash \n\t\1 \u{1F600}",
        list = { 1, { x = json.null }, true, false, {} }, nested = { a = { b = { c = {} } } },
      }, seen[ids[1]], "payload 1")
      assert.equal('{"a":{"b":{"c":{}}}}', json.encode(seen[ids[1]].nested))
      assert.equal("[]", json.encode(seen[ids[5]]))
      H.assert_exactly("just text", seen[ids[2]], "payload 2")
      H.assert_exactly(42, seen[ids[3]], "payload 3")
      H.assert_exactly(2.0, seen[ids[4]], "payload 4")
      assert.equal(json.null, seen[ids[6]])
      for _, id in ipairs(ids) do assert.equal("completed", assert(store:get(id)).status) end
    end)

    it("older documents' JSON text payloads still read, beside native ones", function()
      local ids = outside_enqueue(url, tbl, {
        -- as relaybus wrote them before: a string, no payload_format
        [[{"topic": "old", "payload": "{\"n\": 12345678901234567, \"f\": 2.0, \"s\": \"x\"}", "payload_format": null}]],
        [[{"topic": "old", "payload": "\"a string\"", "payload_format": "json"}]],
      }, queue)
      local seen = run_all(store, "old", #ids)
      H.assert_exactly({ n = 12345678901234567, f = 2.0, s = "x" }, seen[ids[1]], "old payload")
      H.assert_exactly("a string", seen[ids[2]], "json-format payload")
    end)

    -- FerretDB refuses NaN, infinities and decimals (spec/c/mongo_payload_test.c has them)
    it("BSON types JSON lacks come back as relaxed Extended JSON", function()
      local ids = outside_enqueue(url, tbl, {
        [[{"topic": "types", "payload": {"when": {"$date": {"$numberLong": "1700000000000"}},
          "oid": {"$oid": "5f0a1b2c3d4e5f6a7b8c9d0e"}, "bin": {"$binary": {"base64": "AAE=", "subType": "00"}}}}]],
      }, queue)
      local seen = run_all(store, "types", 1)
      H.assert_exactly({ when = { ["$date"] = "2023-11-14T22:13:20Z" },
                         oid = { ["$oid"] = "5f0a1b2c3d4e5f6a7b8c9d0e" },
                         bin = { ["$binary"] = { base64 = "AAE=", subType = "00" } } }, seen[ids[1]], "payload")
    end)

    it("relaybus's enqueue stores the payload as BSON an application can query", function()
      local id = assert(store:enqueue("mine", { n = math.maxinteger, f = 1.0, s = "x", l = { 1, 2.5 },
                                                o = { deep = json.array() } }))
      local doc = stored(url, tbl, id)
      assert.equal("bson", doc.payload_format)
      assert.same({ n = { ["$numberLong"] = "9223372036854775807" }, f = { ["$numberDouble"] = "1.0" },
                    s = "x", l = { { ["$numberLong"] = "1" }, { ["$numberDouble"] = "2.5" } },
                    o = { deep = json.array() } }, doc.payload)
      local sid = assert(store:enqueue("mine", "plain"))
      assert.same({ payload = "plain", payload_format = "bson" }, stored(url, tbl, sid))
    end)

    it("keeps as JSON text what MongoDB cannot hold as it is, and gives it back exactly", function()
      local deep = "1"
      for _ = 1, 95 do deep = "[" .. deep .. "]" end
      local cases = {
        { text = '{"$set": 1}' }, { text = '{"a.b": {"c": 2}}' }, { text = '{"ok": {"$x": true}}' },
        { text = '{"big": 123456789012345678901234567890, "n": 1}' }, { text = deep },
      }
      for i, c in ipairs(cases) do
        local id = assert(store:enqueue_json("text", c.text))
        local doc = stored(url, tbl, id)
        assert.equal("json", doc.payload_format, "case " .. i)
        assert.equal(c.text, doc.payload, "case " .. i)
        H.assert_exactly(json.decode(c.text), assert(store:get(id)).payload, "case " .. i)
      end
    end)

    it("refuses what is not JSON at all, in one line, and writes nothing", function()
      local before = H.total(store)
      for _, text in ipairs { "NaN", '{"x": Infinity}', '"\xff\xfe"', "[1,", "" } do
        local ok, id, err = pcall(store.enqueue_json, store, "bad", text)
        if ok then
          assert.is_nil(id, text)
          H.one_line(err)
        end
      end
      assert.equal(before, H.total(store))
    end)

    it("a payload of megabytes round-trips; one over MongoDB's 16 MB document limit is refused", function()
      local big = { s = string.rep("x", 4 * 1024 * 1024), n = math.maxinteger }
      local id = assert(store:enqueue("big", big))
      H.assert_exactly(big, assert(store:get(id)).payload, "4 MB payload")
      local ok, id2, err = pcall(store.enqueue, store, "big", { s = string.rep("y", 17 * 1024 * 1024) })
      if ok then
        assert.is_nil(id2)
        H.one_line(err)
      end
    end)
  end)
  ::continue::
end
