-- json.lua -- encode and decode speed of relaybus.json against lua-cjson 2.1 (inexact: 14
-- digits, no integers) and Jansson's own encoder (a json_t tree per value, then json_dumps
-- with the 17 digits that round-trip) on a few payload shapes. Decode: relaybus.json parses
-- with Jansson and converts the tree to Lua values; "jansson parse" is that parse alone.
--   build/relaybus run bench/json.lua [PATH/bench_jansson.so] [SECONDS_PER_FIGURE]
local relaybus = require "relaybus"
local B = dofile((arg[0]:match("^(.*/)") or "./") .. "common.lua")
local json = relaybus.json

local so = arg[1] or "build/bench_jansson.so"
local per = tonumber(arg[2]) or 0.3

local ok_cjson, cjson = pcall(require, "cjson")
if ok_cjson then cjson = cjson.new() end
local jansson
do
  local open = package.loadlib(so, "luaopen_bench_jansson")
  if open then jansson = open() end
end

-- ---- payload shapes ---------------------------------------------------------------------
math.randomseed(42)
local function random_double()
  return (math.random() - 0.5) * 10 ^ math.random(-8, 12)
end

local shapes = {}

-- a typical delivery: an e-mail with a few fields
shapes[#shapes + 1] = { name = "small object (8 fields)", value = {
  to = "ada@example.com", template = "welcome", order_id = 1234567890123456789, amount = 129.95,
  qty = 3, vip = true, tags = { "new", "eu" }, meta = { source = "signup", attempt = 1 },
} }

local floats = {}
for i = 1, 1000 do floats[i] = random_double() end
shapes[#shapes + 1] = { name = "1,000 random floats", value = floats }

local ints = {}
for i = 1, 1000 do ints[i] = math.random(math.mininteger, math.maxinteger) end
shapes[#shapes + 1] = { name = "1,000 int64 integers", value = ints }

local strings = {}
for i = 1, 100 do
  strings["field_" .. i] = string.rep("caf\u{e9} au lait, ", 6) .. i
end
shapes[#shapes + 1] = { name = "100 keys of 100-byte strings", value = strings }

local orders = {}
for i = 1, 100 do
  local items = {}
  for k = 1, 5 do items[k] = { sku = "SKU-" .. (i * 10 + k), qty = k, price = 0.01 * math.random(100, 99999) } end
  orders[i] = { id = 1000000 + i, customer = { name = "customer " .. i, email = "c" .. i .. "@example.com" },
                items = items, paid = i % 2 == 0, note = json.null }
end
shapes[#shapes + 1] = { name = "100 orders (nested, mixed)", value = orders }

-- ---- measuring --------------------------------------------------------------------------
-- Runs fn(x) in batches until `per` seconds passed; returns the rate per second.
local function rate(fn, x)
  local n, batch = 0, 1
  local t0 = relaybus.now()
  local dt
  repeat
    for _ = 1, batch do fn(x) end
    n = n + batch
    batch = batch * 2
    dt = relaybus.now() - t0
  until dt >= per
  return n / dt
end

local function fmt(r, bytes)
  return string.format("%10s/s %8.1f MB/s", B.int(r), r * bytes / 1e6)
end

print(string.format("json codecs, %.1f s per figure (%s)", per,
  (ok_cjson and "lua-cjson 2.1" or "no lua-cjson") .. ", " .. (jansson and "jansson " .. so or "no jansson helper")))
for _, sh in ipairs(shapes) do
  local text = json.encode(sh.value)
  local bytes = #text
  print(string.format("\njson payload: %s, %s bytes of JSON", sh.name, B.int(bytes)))
  local exact = json.encode(assert(json.decode(text))) == text
  print(string.format("json encode relaybus   %s%s", fmt(rate(json.encode, sh.value), bytes),
    exact and "" or "  NOT EXACT"))
  if ok_cjson then
    local same = cjson.decode(cjson.encode(sh.value))
    local lossy = json.encode(same) ~= text
    print(string.format("json encode lua-cjson  %s%s", fmt(rate(cjson.encode, sh.value), bytes),
      lossy and "  (loses digits: not exact)" or ""))
  end
  if jansson then
    print(string.format("json encode jansson    %s  (tree + json_dumps)", fmt(rate(jansson.encode, sh.value), bytes)))
  end
  print(string.format("json decode relaybus   %s", fmt(rate(json.decode, text), bytes)))
  if ok_cjson then
    print(string.format("json decode lua-cjson  %s", fmt(rate(cjson.decode, text), bytes)))
  end
  if jansson then
    print(string.format("json decode jansson    %s  (json_loadb + json_decref only)", fmt(rate(jansson.parse, text), bytes)))
    local function allocs(fn, x)
      local a0 = jansson.allocs()
      fn(x)
      return jansson.allocs() - a0
    end
    print(string.format("json mallocs per call: encode relaybus none up to 1 KiB of text and 32 open keys" ..
      " (C stack, then doubling), jansson %s; decode (Jansson's tree) %s",
      B.int(allocs(jansson.encode, sh.value)), B.int(allocs(json.decode, text))))
  end
end
