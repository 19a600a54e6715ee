-- rockspec_spec.lua -- Lua's own packaging: `luarocks make` of relaybus-scm-1.rockspec builds
-- the module with the Makefile and installs it into a Lua 5.4 tree, from which plain `lua5.4`
-- loads it (LUA_CPATH pointing into the tree only) and uses it: a sqlite::memory: store takes
-- an enqueue. With CI=true a missing luarocks fails the spec (scripts/install-deps.sh installs
-- it); elsewhere the spec is left pending.
local S = require "spec.support.stores"

local ci = os.getenv("CI") == "true" or os.getenv("CI") == "1"

local function sh(cmd)
  local out = S.tmpfile("sh")
  local ok = os.execute(cmd .. " >" .. S.quote(out) .. " 2>&1 </dev/null")
  return ok, S.read(out) or ""
end

local have_luarocks = sh("command -v luarocks")

describe("relaybus-scm-1.rockspec", function()
  teardown(function() S.cleanup() end)

  if not have_luarocks then
    if ci then
      it("has luarocks to run with", function()
        error("luarocks is not installed (scripts/install-deps.sh installs it)")
      end)
    else
      pending("luarocks is not installed (scripts/install-deps.sh installs it)")
    end
    return
  end

  it("passes luarocks lint", function()
    local ok, out = sh("luarocks --lua-version 5.4 lint relaybus-scm-1.rockspec")
    assert.is_true(ok, out)
  end)

  it("`luarocks make --tree` installs a module plain lua5.4 loads and uses", function()
    local tree = S.tmpdir() .. "/rocks"
    local ok, out = sh("luarocks --lua-version 5.4 make --tree " .. S.quote(tree)
      .. " relaybus-scm-1.rockspec")
    assert.is_true(ok, "luarocks make failed: " .. out)
    local so = tree .. "/lib/lua/5.4/relaybus.so"
    assert.is_true(S.exists(so), "no " .. so .. " after luarocks make: " .. out)

    local script = S.tmpfile("use") .. ".lua"
    S.write(script, [[
      local relaybus = require "relaybus"
      io.write(package.searchpath("relaybus", package.cpath), "\n")
      local store = assert(relaybus.open("sqlite::memory:"))
      local id = assert(store:enqueue("rock.test", {n = 1}))
      local d = assert(store:get(id))
      io.write(id, " ", d.topic, " ", d.payload.n, " ", d.status, "\n")
      store:close()
    ]])
    local env = "env -u LUA_PATH -u LUA_PATH_5_4 -u LUA_CPATH_5_4 LUA_CPATH=" ..
      S.quote(tree .. "/lib/lua/5.4/?.so")
    local ran, said = sh(env .. " lua5.4 " .. S.quote(script))
    assert.is_true(ran, said)
    local path, line = said:match("^([^\n]*)\n([^\n]*)")
    assert.equal(so, path, said)
    assert.truthy(line and line:match("^%d+ rock%.test 1 pending$"), said)
  end)
end)
