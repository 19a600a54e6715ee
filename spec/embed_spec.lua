-- embed_spec.lua -- a C host embeds the runtime in its own libev loop (examples/embed_host.c):
-- relaybus's handlers run between the host's own ticks and the host keeps its tick rate.
local S = require "spec.support.stores"

describe("embedding", function()
  it("runs deliveries on the host's loop beside the host's own timer", function()
    local host = S.build .. "/embed_host"
    assert.is_true(S.exists(host), "build it with `make examples`")
    local url = "sqlite:" .. S.tmpfile("embed") .. ".db"
    local out = io.popen(S.quote(host) .. " " .. S.quote(url) .. " 300 2>&1")
    local text = out:read("a")
    local ok = out:close()
    assert.is_true(ok, text)
    assert.matches("deliveries done: 300 of 300", text, 1, true)
    local ticks, secs = text:match("host ticks: (%d+) in ([%d.]+) s")
    assert.is_not_nil(ticks, text)
    ticks, secs = tonumber(ticks), tonumber(secs)
    -- The 50 ms tick kept running while relaybus worked: at least half its nominal count.
    assert.is_true(ticks >= math.floor(secs / 0.05 / 2), text)
    local relaybus = S.relaybus()
    local store = assert(relaybus.open(url))
    local st = assert(store:stats())
    store:close()
    assert.equal(300, st.completed)
    assert.equal(0, st.pending + st.processing + st.buried)
  end)
end)
