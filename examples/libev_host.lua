-- libev_host.lua -- the reference for the example hosts: the same workload on the `relaybus`
-- command's own libev loop (no stepping), so a spec can check that every stepped host behaves
-- as libev does.
--
--   build/relaybus run examples/libev_host.lua key=value...   (examples/workload.lua's options)
local relaybus = require "relaybus"
local W = dofile(os.getenv("RELAYBUS_WORKLOAD") or "examples/workload.lua")
local t0 = relaybus.now()
local w = W.start(relaybus, ...)
relaybus.run()
local line = w.report()
print(line)
print(string.format("secs=%.2f", relaybus.now() - t0))
if not line:find("^result ok=1") then os.exit(1) end
