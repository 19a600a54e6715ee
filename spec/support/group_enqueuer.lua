-- group_enqueuer.lua -- relaybus run spec/support/group_enqueuer.lua URL TABLE LOG TAG N:
-- enqueues N deliveries of topic "gq" into the groups g0..g4 (payload {p = TAG, i = i}), one
-- at a time, and logs "OK <id>" for each; the conformance spec runs two at once.
local C = dofile((arg[0]:match("^(.*/)") or "./") .. "child.lua")
local relaybus = require "relaybus"
local url, tbl, logpath, tag, n = ...
local store = C.open(url, tbl)
local say = C.logger(logpath)
relaybus.spawn(function()
  for i = 1, tonumber(n) do
    local id = assert(store:enqueue("gq", { p = tag, i = i }, { group = "g" .. i % 5 }))
    say("OK", id)
  end
  say("DONE")
  store:close()
end)
relaybus.run()
