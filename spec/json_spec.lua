-- json_spec.lua -- relaybus.json, the codec between payloads and the stores' JSON text: what
-- round-trips exactly (integers over all of int64, floats to the last bit, every byte of a
-- string), the one inexact case (integer literals beyond int64 read as floats), what is refused
-- and how it is said (a path to the bad part; a line and column), [] versus {}, json.null,
-- nesting and cycles, and hostile tables (metatables, finalizers that run in the middle).
-- store:enqueue_json and the command's enqueue are at the end; the conformance suite checks
-- the same values through every store.
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local relaybus = S.relaybus()
local json = relaybus.json

local exactly = H.assert_exactly

local function bits(x) return string.pack("<d", x) end

-- encode, then decode: the value that a store gives back
local function round(v) return (assert(json.decode(json.encode(v)))) end

local function encode_error(v)
  local ok, err = pcall(json.encode, v)
  assert.is_false(ok, "encoded: " .. tostring(err))
  assert.truthy(err:match("^relaybus: "), err)
  H.one_line(err)
  return err
end

local function decode_error(text)
  local v, err = json.decode(text)
  assert.is_nil(v, "decoded " .. string.format("%q", text:sub(1, 60)))
  assert.is_string(err)
  H.one_line(err)
  assert.truthy(err:match("^invalid JSON at line %d+, column %d+: "), err)
  return err
end

local function nest(n, leaf)
  local root = {}
  local t = root
  for _ = 2, n do t[1] = {} t = t[1] end
  if leaf ~= nil then t[1] = leaf end
  return root
end

describe("relaybus.json", function()
  teardown(function() S.cleanup() end)

  describe("integers", function()
    local ints = { 0, 1, -1, 42, math.maxinteger, math.mininteger, (1 << 53) + 1, -(1 << 53) - 1,
                   1234567890123456789, math.maxinteger - 1, math.mininteger + 1 }

    it("encodes Lua integers as integer literals and decodes them back as integers, exact over all of int64", function()
      for _, i in ipairs(ints) do
        assert.equal(string.format("%d", i), json.encode(i))
        local back = json.decode(json.encode(i))
        assert.equal("integer", math.type(back), tostring(i))
        assert.equal(i, back)
      end
      exactly(ints, round(ints))
      exactly({ order_id = 1234567890123456789 }, round { order_id = 1234567890123456789 })
    end)

    it("reads integer literals beyond int64 as floats (the one inexact case) without failing the payload; the other numbers keep their type", function()
      local v = assert(json.decode('{"big": 99999999999999999999, "neg": -99999999999999999999, ' ..
        '"edge": 9223372036854775808, "low": -9223372036854775809, "max": 9223372036854775807, ' ..
        '"min": -9223372036854775808, "one": 1, "f": 1000000000000000.0, "half": 2.5, ' ..
        '"in": [100000000000000000000000000000, 7]}'))
      exactly({ big = 1e20, neg = -1e20, edge = 2.0 ^ 63, low = -2.0 ^ 63, max = math.maxinteger,
                min = math.mininteger, one = 1, f = 1e15, half = 2.5, ["in"] = { 1e29, 7 } }, v)
      -- and a float so big that PostgreSQL's jsonb prints all its digits comes back a float
      local digits = "1" .. string.rep("0", 300)
      exactly({ 1e300, math.maxinteger }, assert(json.decode("[" .. digits .. ", 9223372036854775807]")))
    end)
  end)

  describe("floats", function()
    local floats = { 0.1, 12345678.123456789, 1e15, 1e300, -0.0, 0.0, 5e-324, 2.0 ^ 53, 2.0 ^ 63,
                     -2.0 ^ 63, 2.0 ^ 64, 1 / 3, math.pi, 1e-7, 2.2250738585072014e-308,
                     1.7976931348623157e308, -1.5, 3.0, 1e17, 123456789012345680.0 }

    it("round-trips floats to the last bit and keeps them floats (-0.0 stays -0.0)", function()
      for _, x in ipairs(floats) do
        local back = json.decode(json.encode(x))
        assert.equal("float", math.type(back), string.format("%.17g", x))
        assert.equal(bits(x), bits(back), string.format("%.17g came back as %.17g", x, back))
      end
      exactly(floats, round(floats))
    end)

    it("round-trips 10,000 random bit patterns to the last bit", function()
      local n = 0
      for _ = 1, 10000 do
        local x = string.unpack("<d", string.pack("<I4I4", math.random(0, 0xffffffff), math.random(0, 0xffffffff)))
        if x == x and x ~= math.huge and x ~= -math.huge then
          n = n + 1
          local back = json.decode(json.encode(x))
          assert.equal("float", math.type(back))
          assert.equal(bits(x), bits(back), string.format("%.17g came back as %.17g (%s)", x, back, json.encode(x)))
        end
      end
      assert.is_true(n > 9000)
    end)

    it("writes the shortest text that reads back, and an integral float below 2^63 in fixed notation with .0", function()
      -- (pairs, not a table: a float key such as 1e15 would become the integer key)
      local want = {
        { 0.1, "0.1" }, { 12345678.123456789, "12345678.12345679" }, { 1e15, "1000000000000000.0" },
        { 3.0, "3.0" }, { -1.5, "-1.5" }, { 1e300, "1e+300" }, { 5e-324, "5e-324" },
        { 2.0 ^ 63, "9.223372036854776e+18" }, { 1e17, "100000000000000000.0" },
        { 2.0 ^ 62, "4611686018427387904.0" }, { 1 / 3, "0.3333333333333333" },
      }
      for _, p in ipairs(want) do assert.equal(p[2], json.encode(p[1])) end
      assert.equal("-0.0", json.encode(-0.0))
      assert.equal("0.0", json.encode(0.0))
    end)

    it("refuses NaN and infinities with a clear error", function()
      assert.truthy(encode_error(0 / 0):find("cannot encode NaN as JSON", 1, true))
      assert.truthy(encode_error(math.huge):find("cannot encode inf as JSON", 1, true))
      assert.truthy(encode_error(-math.huge):find("cannot encode -inf as JSON", 1, true))
      assert.truthy(encode_error({ a = { 1, 0 / 0 } }):find("value.a[2]: cannot encode NaN", 1, true))
    end)

    it("decoding keeps a number written with a fraction or an exponent a float, and refuses one beyond the doubles", function()
      exactly({ 1.0, 1e5, -0.0, 2.5e-3 }, assert(json.decode("[1.0, 1e5, -0.0, 2.5e-3]")))
      assert.truthy(decode_error("[1e400]"):find("overflow", 1, true))
    end)
  end)

  describe("strings", function()
    it("encodes NUL as \\u0000 and every control character escaped, and decodes them back", function()
      local all = {}
      for b = 0, 127 do all[#all + 1] = string.char(b) end
      local s = table.concat(all) .. "a\0b\0"
      local text = json.encode(s)
      assert.is_nil(text:find("[%z\1-\31]"), "a raw control byte in " .. text)
      assert.truthy(text:find("\\u0000", 1, true))
      assert.truthy(text:find('\\n', 1, true))
      assert.equal(s, json.decode(text))
      assert.equal('"a\\u0000b"', json.encode("a\0b"))
    end)

    it("keeps valid UTF-8 as it is and decodes escapes and surrogate pairs", function()
      local s = "caf\u{e9} \u{2713} \u{1F600} \u{10FFFF}"
      assert.equal('"' .. s .. '"', json.encode(s))
      assert.equal(s, round(s))
      assert.equal("\u{1F600}\u{e9}/", json.decode('"\\ud83d\\ude00\\u00e9\\/"'))
    end)

    it("refuses a string that is not valid UTF-8, naming the offset of the first bad byte", function()
      for s, off in pairs { ["ab\xffcd"] = 2, ["\xc0\x80"] = 0, ["ok\xed\xa0\x80"] = 2,
                            ["x\xe2\x82"] = 1, ["\xf4\x90\x80\x80"] = 0, ["\u{e9}\x80"] = 2 } do
        local err = encode_error({ name = s })
        assert.truthy(err:find("value.name: string is not valid UTF-8", 1, true), err)
        assert.truthy(err:find("at offset " .. off .. ")", 1, true), err)
      end
      assert.truthy(encode_error({ ["k\xff"] = 1 }):find("a key is not valid UTF-8", 1, true))
    end)

    it("refuses a NUL byte in a key: JSON parsers cannot bring it back", function()
      assert.truthy(encode_error({ ["k\0ey"] = 1 }):find("NUL", 1, true))
    end)

    it("refuses invalid UTF-8, lone surrogates and NUL bytes in JSON text, with the position", function()
      decode_error('"\xff"')
      decode_error('"\xed\xa0\x80"')
      decode_error('"\\ud800"')
      decode_error('"\\udc00\\ud800"')
      assert.truthy(decode_error("1\0"):find("NUL byte", 1, true))
      assert.truthy(decode_error('[1]\0[2]'):find("NUL byte", 1, true))
    end)
  end)

  describe("tables", function()
    it("encodes a table whose keys are exactly 1..n as an array, however it was filled", function()
      assert.equal("[1,2,3]", json.encode { 1, 2, 3 })
      local back = {}
      for i = 5, 1, -1 do back[i] = i * 10 end
      assert.equal("[10,20,30,40,50]", json.encode(back))
      local t = {}
      t[2] = "b"; t[1] = "a"; t[3] = "c"
      assert.equal('["a","b","c"]', json.encode(t))
    end)

    it("encodes other tables as objects, integer keys as their decimal text, keys sorted", function()
      assert.equal('{"1":1,"3":3}', json.encode { [1] = 1, [3] = 3 })
      assert.equal('{"1":1,"2":2,"x":3}', json.encode { 1, 2, x = 3 })
      assert.equal('{"0":"z"}', json.encode { [0] = "z" })
      assert.equal('{"-1":1,"1000000000":2}', json.encode { [-1] = 1, [1000000000] = 2 })
      assert.equal('{"-9223372036854775808":1,"9223372036854775807":2}',
        json.encode { [math.mininteger] = 1, [math.maxinteger] = 2 })
      assert.equal('{"a":1,"b":2,"c":3}', json.encode { c = 3, a = 1, b = 2 })
    end)

    it("gives one text for one value, whatever order the table was filled in", function()
      local a, b = {}, {}
      for i = 1, 200 do a["k" .. i] = i end
      for i = 200, 1, -1 do b["k" .. i] = i end
      assert.equal(json.encode(a), json.encode(b))
      local v = assert(json.decode(json.encode(a)))
      assert.equal(json.encode(a), json.encode(v))
    end)

    it("encodes the empty table as {}, and [] for json.array() and decoded arrays", function()
      assert.equal("{}", json.encode {})
      assert.equal("[]", json.encode(json.array()))
      assert.equal("[]", json.encode(json.array {}))
      local v = assert(json.decode('{"list": [], "obj": {}, "nested": [[], {}]}'))
      assert.equal(json.array_mt, getmetatable(v.list))
      assert.is_nil(getmetatable(v.obj))
      assert.equal('{"list":[],"nested":[[],{}],"obj":{}}', json.encode(v))
      -- an array marked so still encodes its elements; a filled-in one is an object again
      local arr = json.array { 1, 2 }
      assert.equal("[1,2]", json.encode(arr))
      arr.x = 1
      assert.equal('{"1":1,"2":2,"x":1}', json.encode(arr))
    end)

    it("json.array refuses a table that has another metatable", function()
      H.raises_relaybus(json.array, setmetatable({}, {}))
      H.raises_relaybus(json.array, 5)
      local t = json.array {}
      assert.equal(t, json.array(t))
    end)

    it("decodes JSON null inside values as json.null and encodes it back as null; null at the top is nil", function()
      local v = assert(json.decode('{"a": null, "list": [1, null, 3]}'))
      assert.equal(json.null, v.a)
      assert.equal(json.null, v.list[2])
      assert.equal(3, #v.list)
      assert.equal('{"a":null,"list":[1,null,3]}', json.encode(v))
      local top, err = json.decode("null")
      assert.is_nil(top)
      assert.is_nil(err)
      assert.equal("null", json.encode(nil))
      assert.equal("null", json.encode(json.null))
    end)

    it("decodes duplicate object keys as the last one", function()
      assert.same({ a = 3 }, json.decode('{"a": 1, "a": 2, "a": 3}'))
    end)

    it("refuses keys that are neither strings nor integers, naming the path", function()
      assert.truthy(encode_error({ x = { [1.5] = 1 } }):find("value.x: cannot encode a key of type float", 1, true))
      assert.truthy(encode_error({ [true] = 1 }):find("key of type boolean", 1, true))
      assert.truthy(encode_error({ [{}] = 1 }):find("key of type table", 1, true))
      assert.truthy(encode_error({ [1] = "a", ["1"] = "b" }):find("both as an integer and as a string", 1, true))
    end)

    it("refuses functions, userdata and threads, naming the path", function()
      local err = encode_error { items = { 1, 2, { price = print } } }
      assert.truthy(err:find("value.items[3].price: cannot encode a function", 1, true), err)
      assert.truthy(encode_error({ f = io.stdout }):find("value.f: cannot encode a userdata", 1, true))
      assert.truthy(encode_error({ coroutine.create(print) }):find("value[1]: cannot encode a thread", 1, true))
      assert.truthy(encode_error({ ["a key"] = { ["\u{e9}t\u{e9} \n"] = print } })
        :find('value["a key"]["\u{e9}t\u{e9} \\x0a"]: cannot encode a function', 1, true))
      local store = assert(relaybus.open("sqlite:" .. S.tmpfile("json") .. ".db"))
      local serr = H.raises_relaybus(store.enqueue, store, "t", { items = { 1, 2, { price = print } } })
      assert.truthy(serr:find("payload.items[3].price: cannot encode a function", 1, true), serr)
      assert.equal(0, (H.total(store)))
      store:close()
    end)

    it("refuses a table that contains itself, and encodes one shared twice", function()
      local t = { a = {} }
      t.a.back = t
      assert.truthy(encode_error(t):find("value.a.back: cannot encode a cycle", 1, true))
      local shared = { 1 }
      assert.equal('{"x":[1],"y":[1]}', json.encode { x = shared, y = shared })
    end)

    it("refuses nesting deeper than 1000 levels both ways, with a message", function()
      assert.equal(string.rep("[", 999) .. "{}" .. string.rep("]", 999), json.encode(nest(1000)))
      local err = encode_error(nest(1001))
      assert.truthy(err:find("nesting deeper than 1000 levels", 1, true), err)
      assert.is_true(#err < 400)
      local ok1000 = string.rep("[", 1000) .. string.rep("]", 1000)
      assert.equal(ok1000, json.encode(assert(json.decode(ok1000))))
      for _, n in ipairs { 1001, 2048, 5000, 100000 } do
        err = decode_error(string.rep("[", n) .. string.rep("]", n))
        assert.truthy(err:find("line 1, column 1001: nesting deeper than 1000 levels", 1, true), err)
      end
      err = decode_error(string.rep('{"a":', 1001) .. "1" .. string.rep("}", 1001))
      assert.truthy(err:find("nesting deeper than 1000 levels", 1, true), err)
    end)

    it("does not consult metatables: a table encodes as what it holds", function()
      local t = setmetatable({ real = 1 }, {
        __index = function() return "made up" end,
        __pairs = function() error("__pairs was called") end,
        __len = function() return 99 end,
        __newindex = function() error("__newindex was called") end,
      })
      assert.equal('{"real":1}', json.encode(t))
      assert.equal("{}", json.encode(setmetatable({}, { __index = { 1, 2, 3 } })))
    end)

    it("encodes sparse tables with huge indices as objects, without filling the holes", function()
      assert.equal('{"1000000000":1}', json.encode { [1000000000] = 1 })
      local t = { 1, 2, 3 }
      t[2 ^ 40] = 4
      assert.equal('{"1":1,"1099511627776":4,"2":2,"3":3}', json.encode(t))
    end)

    it("encodes an object with more keys than the Lua stack holds comfortably (100,000)", function()
      local t = {}
      for i = 1, 100000 do t["key" .. i] = i end
      local text = json.encode(t)
      local v = assert(json.decode(text))
      exactly(t, v)
      assert.equal(text, json.encode(v))
    end)
  end)

  describe("under a hostile garbage collector", function()
    it("finalizers that run mid-decode and mid-encode, encode themselves and change tables, break nothing", function()
      -- more keys than encode keeps on the Lua stack: it allocates a table for them, a moment
      -- when the collector can run finalizers (decode allocates all the time)
      local victim = {}
      for i = 1, 5000 do victim["k" .. i] = { i, tostring(i) } end
      local ran, mid, inside = 0, 0, false
      local function litter(n)
        for _ = 1, n do
          setmetatable({}, { __gc = function()
            ran = ran + 1
            if inside then mid = mid + 1 end
            victim["k" .. math.random(1, 6000)] = nil
            victim["n" .. ran] = { ran }
            if ran % 50 == 0 then pcall(json.encode, victim) end
            json.decode('[1, {"a": [2, 3]}]')
          end })
        end
      end
      local good = 0
      for _ = 1, 10 do
        litter(200)
        inside = true
        local ok, text = pcall(json.encode, victim)
        inside = false
        if ok then
          good = good + 1
        else
          assert.truthy(tostring(text):match("^relaybus: "), text)
        end
        litter(200)
        inside = true
        local v, err = json.decode(ok and text or '{"x": [1, 2, 3]}')
        inside = false
        assert.is_table(v, err)
      end
      collectgarbage("collect")
      assert.is_true(good > 0)
      assert.is_true(mid > 0, "no finalizer ran inside encode or decode")
    end)
  end)

  describe("decode errors", function()
    it("are one line with the line and column of the problem", function()
      local err = decode_error('{"a": 1,\n  "b": }')
      assert.truthy(err:find("line 2, column 8", 1, true), err)
      decode_error("")
      decode_error("   ")
      decode_error("[1, 2")
      decode_error("[1, 2,]")
      decode_error("{'a': 1}")
      decode_error("NaN")
      decode_error("01")
      decode_error("[1] [2]")
      decode_error("\"line\nbreak\"")
      -- the position stays right after integers beyond int64 earlier in the text
      err = decode_error('[99999999999999999999, 99999999999999999999,\n 99999999999999999999, x]')
      assert.truthy(err:find("line 2, column 24", 1, true), err)
    end)
  end)

  describe("store:enqueue_json", function()
    local store
    before_each(function() store = assert(relaybus.open("sqlite:" .. S.tmpfile("ej") .. ".db")) end)
    after_each(function() store:close() end)

    it("stores the text as it is given and gives back its value", function()
      local text = '{ "order_id": 1234567890123456789,  "price": 12345678.123456789, "tags": [] }'
      local id = assert(store:enqueue_json("ej.t", text, { key = "k1" }))
      local r = assert(store:get(id))
      exactly({ order_id = 1234567890123456789, price = 12345678.123456789, tags = {} }, r.payload)
      assert.equal("[]", json.encode(r.payload.tags))
      local ok, rows = store:transaction(function(tx)
        return tx:query("SELECT payload FROM relaybus_deliveries WHERE id = ?", tonumber(id))
      end)
      assert.is_true(ok, rows)
      assert.equal(text, rows[1].payload)
      -- in a transaction too
      local tok, tid = store:transaction(function(tx) return assert(tx:enqueue_json("ej.t", "[1, 2.0]")) end)
      assert.is_true(tok, tid)
      exactly({ 1, 2.0 }, assert(store:get(tid)).payload)
    end)

    it("refuses text that does not parse, or is not valid UTF-8, and writes nothing", function()
      for _, text in ipairs { "{not json", "", '"\xff"', "[1] x", "1\0", string.rep("[", 1001) .. string.rep("]", 1001) } do
        H.raises_relaybus(store.enqueue_json, store, "ej.bad", text)
      end
      H.raises_relaybus(store.enqueue_json, store, "ej.bad", { a = 1 })
      H.raises_relaybus(store.enqueue_json, store, "ej.bad", nil)
      assert.equal(0, (H.total(store)))
    end)

    it("a Lua string that looks like JSON text is still a JSON string, with one warning per process", function()
      local script = S.tmpfile("warn") .. ".lua"
      local db = "sqlite:" .. S.tmpfile("warn") .. ".db"
      S.write(script, [[
        local relaybus = require "relaybus"
        local store = assert(relaybus.open(...))
        local a = assert(store:enqueue("t", '{"a": 1}'))
        assert(store:enqueue("t", '  [1, 2]'))
        assert(store:enqueue("t", "plain"))
        io.write(type(store:get(a).payload), " ", store:get(a).payload, "\n")
      ]])
      local code, out, err = S.run_command { S.bin, "run", script, db }
      assert.equal(0, code, err)
      assert.equal('string {"a": 1}\n', out)
      local _, n = err:gsub("looks like JSON text", "")
      assert.equal(1, n, err)
      assert.truthy(err:find("use store:enqueue_json", 1, true), err)
    end)
  end)

  describe("relaybus enqueue", function()
    it("keeps the JSON text as given, every digit", function()
      local db = "sqlite:" .. S.tmpfile("cli") .. ".db"
      local text = '{"order_id": 1234567890123456789, "p": 12345678.123456789, "z": 1e15}'
      local code, out, err = S.run_command { S.bin, "enqueue", "cli.exact", text, "--store", db }
      assert.equal(0, code, err)
      local id = out:match("^(%S+)\n$")
      local store = assert(relaybus.open(db))
      exactly({ order_id = 1234567890123456789, p = 12345678.123456789, z = 1e15 }, assert(store:get(id)).payload)
      store:close()
    end)

    it("a payload that does not parse is a usage error: exit 2, one line", function()
      local db = "sqlite:" .. S.tmpfile("cli") .. ".db"
      for _, text in ipairs { "{not json", '{"a": 1} trailing', "[1e400]", '"\xff"' } do
        local code, _, err = S.run_command { S.bin, "enqueue", "cli.bad", text, "--store", db }
        assert.equal(2, code, text)
        H.one_line((err:gsub("\n$", "")))
        assert.truthy(err:find("invalid JSON at line", 1, true), err)
      end
    end)
  end)
end)
