-- docs_spec.lua -- the reference in docs/ cannot fall behind the code silently: every public
-- Lua function and method (the module table and its sub-tables, and the methods of every
-- relaybus metatable in the registry, names starting with `_` left out) is named in
-- docs/lua.md as it is called (`relaybus.open`, `store:enqueue`, `ctx:sleep`...); the methods
-- of tx:collection's objects too. And the project stands on its own: no file of it outside
-- bench/ names the team's contract document or its shared directory.
local S = require "spec.support.stores"
local relaybus = S.relaybus()

local function read_doc(name)
  local text = S.read("docs/" .. name)
  assert(text, "docs/" .. name .. " is missing")
  return text
end

-- How the docs write a method of each metatable: the receiver's usual name.
local RECEIVER = {
  ["relaybus.store"] = "store",
  ["relaybus.tx"] = "tx",
  ["relaybus.dispatcher"] = "d",
  ["relaybus.ctx"] = "ctx",
  ["relaybus.signal"] = "signal",
  ["relaybus.lease"] = "handle",
  ["relaybus.stop_waitable"] = "waitable",
  ["relaybus.local_leases"] = "leases",
  ["relaybus.server"] = "server",
}

-- The method table of a metatable: its __index when that is a table, else its `methods`.
local function methods_of(mt)
  if type(mt.__index) == "table" then return mt.__index end
  if type(mt.methods) == "table" then return mt.methods end
  return nil
end

local function public(name)
  return type(name) == "string" and name:sub(1, 1) ~= "_"
end

local function sorted_keys(t)
  local keys = {}
  for k in pairs(t) do keys[#keys + 1] = k end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  return keys
end

-- Every public name as the docs must write it.
local function public_names()
  local names = {}
  for _, k in ipairs(sorted_keys(relaybus)) do
    if public(k) then
      names[#names + 1] = "relaybus." .. k
      if type(relaybus[k]) == "table" then
        for _, sub in ipairs(sorted_keys(relaybus[k])) do
          if public(sub) then names[#names + 1] = "relaybus." .. k .. "." .. sub end
        end
      end
    end
  end
  local unknown = {}
  for _, mtname in ipairs(sorted_keys(debug.getregistry())) do
    local mt = debug.getregistry()[mtname]
    if type(mtname) == "string" and mtname:match("^relaybus%.") and type(mt) == "table" then
      local methods = methods_of(mt)
      if methods then
        local recv = RECEIVER[mtname]
        for _, m in ipairs(sorted_keys(methods)) do
          if public(m) and type(methods[m]) == "function" then
            if recv then names[#names + 1] = recv .. ":" .. m
            else unknown[#unknown + 1] = mtname .. ":" .. m end
          end
        end
      end
    end
  end
  -- tx:collection's objects are plain tables made by the prelude (MongoDB only).
  local prelude = S.read("bindings/lua/prelude.lua") or ""
  for m in prelude:gmatch("\nfunction collection:([%w_]+)") do
    if public(m) then names[#names + 1] = "collection:" .. m end
  end
  return names, unknown
end

describe("docs/lua.md", function()
  local doc = read_doc("lua.md")

  it("names every public function of the module and its tables", function()
    local missing = {}
    for _, n in ipairs((public_names())) do
      if n:match("^relaybus%.") and not doc:find(n, 1, true) then missing[#missing + 1] = n end
    end
    assert.same({}, missing)
  end)

  it("names every public method of every relaybus object", function()
    local names, unknown = public_names()
    assert.same({}, unknown, "a metatable without a receiver name here: add it to RECEIVER and document its methods")
    local missing, methods = {}, 0
    for _, n in ipairs(names) do
      if not n:match("^relaybus%.") then
        methods = methods + 1
        if not doc:find(n, 1, true) then missing[#missing + 1] = n end
      end
    end
    assert.same({}, missing)
    assert.is_true(methods > 30, "the walk found only " .. methods .. " methods")
  end)

  it("documents the options the code accepts", function()
    local missing = {}
    local sources = {
      { "bindings/lua_dispatcher.c", "dispatcher_opts" }, { "bindings/lua_dispatcher.c", "handle_opts" },
      { "bindings/lua_store.c", "enqueue_opts" }, { "bindings/lua_store.c", "list_opts" },
      { "bindings/lua_store.c", "purge_opts" }, { "bindings/lua_store.c", "open_opts" },
      { "bindings/lua_http.c", "request_keys" }, { "bindings/lua_serve.c", "serve_opts" },
    }
    for _, src in ipairs(sources) do
      local text = assert(S.read(src[1]), src[1])
      local list = text:match(src[2] .. "%[%]%s*=%s*(%b{})")
      assert.is_truthy(list, src[2] .. " not found in " .. src[1])
      for opt in list:gmatch('"([%w_]+)"') do
        if not doc:find("`" .. opt .. "`", 1, true) then missing[#missing + 1] = src[2] .. "." .. opt end
      end
    end
    local webhook = assert(S.read("bindings/lua/webhook.lua"))
    for opt in webhook:match("local known = (%b{})"):gmatch("([%w_]+) = true") do
      if not doc:find("`" .. opt .. "`", 1, true) then missing[#missing + 1] = "webhook." .. opt end
    end
    assert.same({}, missing)
  end)
end)

describe("the reference", function()
  it("lists every command of the relaybus command, with its options, in docs/cli.md and in the README's table", function()
    local cli = assert(S.read("cmd/cli.lua"))
    local specs = assert(cli:match("\nlocal SPECS = (%b{})"), "SPECS not found in cmd/cli.lua")
    local clidoc, readme = read_doc("cli.md"), assert(S.read("README.md"))
    local missing, n = {}, 0
    for name, body in specs:gmatch("\n  ([%w_]+) = (%b{})") do
      n = n + 1
      if not clidoc:find("| [`" .. name, 1, true) then missing[#missing + 1] = "cli.md's table: " .. name end
      local section = clidoc:match("\n## " .. name .. "\n(.-)\n## ")
      if not section then missing[#missing + 1] = "cli.md's section: " .. name end
      local row = readme:match("\n| `relaybus " .. name .. "[^\n]*")
      if not row then missing[#missing + 1] = "the README's table: " .. name end
      for opt in body:match("options = (%b{})"):gmatch('([%w%-]+)"?%]?%s*=%s*"') do
        if opt ~= "store" and opt ~= "help" then
          if section and not section:find("--" .. opt, 1, true) then
            missing[#missing + 1] = "cli.md's section " .. name .. ": --" .. opt
          end
          if row and not row:find("--" .. opt, 1, true) then
            missing[#missing + 1] = "the README's row " .. name .. ": --" .. opt
          end
        end
      end
    end
    assert.is_true(n >= 8, "found only " .. n .. " commands in SPECS")
    assert.same({}, missing)
  end)

  it("has the pages the README points to", function()
    local readme = assert(S.read("README.md"))
    for _, page in ipairs { "lua.md", "c.md", "guarantees.md", "stores.md", "cli.md" } do
      assert.is_truthy(#read_doc(page) > 1000, page .. " is nearly empty")
      assert.is_truthy(readme:find("docs/" .. page, 1, true), "README does not point to docs/" .. page)
    end
  end)

  -- A retry after a lost answer carries the same webhook-id (http_spec: "sends the delivery id
  -- as webhook-id on every attempt"):
  -- advice to reject an id already seen would have receivers bury what they have taken.
  it("tells webhook receivers to answer 2xx to a webhook-id already seen, never to reject it", function()
    for _, page in ipairs { "README.md", "docs/lua.md" } do
      local text = assert(S.read(page)):gsub("%s+", " ")
      for sentence in text:gmatch("[^.;]+") do
        if sentence:find("already seen", 1, true) or sentence:find("already processed", 1, true) then
          assert.is_nil(sentence:lower():find("reject", 1, true), page .. ": " .. sentence)
        end
      end
      assert.is_truthy(text:find("an id it has already processed", 1, true), page)
      assert.is_truthy(text:find("answer%w* 2xx"), page)
    end
  end)
end)

describe("the project", function()
  -- Built from parts, so that this file does not name them itself.
  local outside = { "CONTRACT" .. ".md", "shared" .. "/" }

  local function project_files()
    local p = io.popen("git ls-files 2>/dev/null")
    local files = {}
    for line in p:lines() do files[#files + 1] = line end
    p:close()
    if #files == 0 then     -- not a git checkout: every file but the build's
      p = io.popen("find . -type f -not -path './.git/*' -not -path './build*' | sed 's|^\\./||'")
      for line in p:lines() do files[#files + 1] = line end
      p:close()
    end
    return files
  end

  it("stands on its own: nothing outside bench/ cites the team's contract or shared directory", function()
    local files = project_files()
    assert.is_true(#files > 50, "found only " .. #files .. " files")
    local found = {}
    for _, f in ipairs(files) do
      if f:sub(1, 6) ~= "bench/" then
        local text = S.read(f) or ""
        for _, word in ipairs(outside) do
          if text:find(word, 1, true) then found[#found + 1] = f .. ": " .. word end
        end
      end
    end
    assert.same({}, found)
  end)
end)
