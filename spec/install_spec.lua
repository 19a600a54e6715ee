-- install_spec.lua -- what a C host gets from `make install`: relaybus.h and its public
-- headers, librelaybus shared and static, and pkg-config files that build and link a host
-- verbatim (`cc host.c $(pkg-config --cflags --libs relaybus)`), which then runs without
-- LD_LIBRARY_PATH. Nothing internal is installed.
local S = require "spec.support.stores"

local build = os.getenv("RELAYBUS_BUILD") or "build"
local sanitized = build:find("asan", 1, true) ~= nil

local function sh(cmd)
  local out = S.tmpfile("sh")
  local ok = os.execute(cmd .. " >" .. S.quote(out) .. " 2>&1")
  return ok, S.read(out) or ""
end

describe("make install", function()
  local prefix, pc
  setup(function()
    prefix = S.tmpdir() .. "/prefix"
    local ok, out = sh("make -s install BUILD=" .. S.quote(build) .. " PREFIX=" .. S.quote(prefix)
      .. (sanitized and " SANITIZE='-fsanitize=address,undefined -fno-omit-frame-pointer' OPT='-O1 -g'" or ""))
    assert(ok, "make install failed: " .. out)
    pc = "PKG_CONFIG_PATH=" .. S.quote(prefix .. "/lib/pkgconfig") .. " pkg-config"
  end)
  teardown(function() S.cleanup() end)

  it("installs the public headers only, under relaybus/, and relaybus.h includes them there", function()
    local ok, out = sh("cd " .. S.quote(prefix .. "/include") .. " && find . -type f | sort")
    assert.is_true(ok)
    assert.equal(table.concat({ "./relaybus.h", "./relaybus/buf.h", "./relaybus/clock.h",
      "./relaybus/dashboard.h", "./relaybus/delivery.h", "./relaybus/dispatcher.h",
      "./relaybus/http.h", "./relaybus/leases.h", "./relaybus/metrics.h", "./relaybus/store.h" },
      "\n") .. "\n", out)
    assert.truthy(S.read(prefix .. "/include/relaybus.h"):find('#include "relaybus/store.h"', 1, true))
  end)

  it("relaybus.pc names the prefix it was installed to", function()
    local ok, out = sh(pc .. " --variable=prefix relaybus")
    assert.is_true(ok, out)
    assert.equal(prefix .. "\n", out)
  end)

  for _, variant in ipairs { "relaybus", "relaybus-static" } do
    it("a host built with `cc host.c $(pkg-config --cflags --libs " .. variant .. ")` runs without LD_LIBRARY_PATH", function()
      local host = S.tmpfile("host")
      local extra = sanitized and "-fsanitize=address,undefined " or ""
      local ok, out = sh("cc " .. extra .. "examples/embed_host.c -o " .. S.quote(host)
        .. " $(" .. pc .. " --cflags --libs " .. variant .. ")")
      assert.is_true(ok, "the build failed: " .. out)
      local _, ldd = sh("ldd " .. S.quote(host))
      if variant == "relaybus-static" then
        assert.is_nil(ldd:find("librelaybus", 1, true), "linked librelaybus.so: " .. ldd)
      else
        assert.truthy(ldd:find(prefix .. "/lib/librelaybus.so", 1, true), ldd)
      end
      local ran, said = sh("env -u LD_LIBRARY_PATH " .. S.quote(host) .. " sqlite:" .. S.quote(S.tmpfile("h") .. ".db") .. " 30")
      assert.is_true(ran, said)
      assert.truthy(said:find("deliveries done: 30 of 30", 1, true), said)
    end)
  end

  -- The optional parts (docs/lua.md, "Optional parts") go beside the Lua module, where the
  -- installed command and the module both find them.
  it("the installed command and Lua module load the optional parts from lib/lua/5.4", function()
    local script = S.tmpfile("parts") .. ".lua"
    S.write(script, [[
local relaybus = require "relaybus"
print(select(2, relaybus.open("postgresql://127.0.0.1:1/none?connect_timeout=2")))
print(relaybus.http.hmac_sha256("key", "data"))
]])
    local want = "^postgresql: connection to server[^\n]*\n"
      .. "5031fe3d989c6d1537a013fa6e739da23463fdaec3b70137d828e36ace221bd0\n$"
    for _, part in ipairs { "relaybus_pg.so", "relaybus_mongo.so", "relaybus_http.so", "relaybus_serve.so" } do
      assert.is_true(S.exists(prefix .. "/lib/lua/5.4/" .. part), part .. " is not installed")
    end
    local ok, out = sh(S.quote(prefix .. "/bin/relaybus") .. " run " .. S.quote(script))
    assert.is_true(ok, out)
    assert.truthy(out:find(want), out)
    if not sanitized then    -- a stock interpreter cannot load a sanitized module
      ok, out = sh("env -u LD_PRELOAD LUA_CPATH=" .. S.quote(prefix .. "/lib/lua/5.4/?.so") .. " lua5.4 "
        .. S.quote(script))
      assert.is_true(ok, out)
      assert.truthy(out:find(want), out)
    end
  end)

  -- The fault-injecting store and the specs' module (testing/) ship in nothing: neither as
  -- files nor inside the libraries, the module or the command.
  it("installs nothing of testing/, and no installed object holds its code", function()
    local ok, out = sh("cd " .. S.quote(prefix) .. " && find . -type f | sort")
    assert.is_true(ok, out)
    assert.falsy(out:find("testing", 1, true), out)
    for _, f in ipairs { "bin/relaybus", "lib/librelaybus.a", "lib/librelaybus.so", "lib/lua/5.4/relaybus.so" } do
      ok, out = sh("nm -A " .. S.quote(prefix .. "/" .. f) .. " | grep -E ' (rb_faults_|rb_alloc_fail|luaopen_relaybus_testing)' || true")
      assert.is_true(ok, out)
      assert.equal("", out, f .. " holds test code")
    end
    local relaybus = S.relaybus()
    for _, name in ipairs { "_faults", "_fail_alloc" } do
      assert.is_nil(relaybus[name], "relaybus." .. name .. " is in the module")
    end
  end)

  it("pkg-config --static asks only for libraries that exist here", function()
    local ok, out = sh(pc .. " --static --libs relaybus")
    assert.is_true(ok, out)
    local dirs = {}
    for d in out:gmatch("(%-L%S+)") do dirs[#dirs + 1] = d end
    for lib in out:gmatch("%-l(%S+)") do
      local found = sh("cc " .. table.concat(dirs, " ") .. " -l" .. lib .. " -shared -o /dev/null -x c /dev/null")
      assert.is_true(found, "-l" .. lib .. " does not link here")
    end
  end)
end)
