-- full_disk.lua DIR -- run by group_commit_spec inside `unshare -r -m` with a small tmpfs
-- mounted on DIR: fills the file system until only ROOM bytes are left, then 64 enqueues in 8
-- waves (8 groups) run into ENOSPC: the first groups commit, the later ones fail whole. Prints one line of what it saw for the spec to check:
--   errs=N ids=N multiline=N missing=N pending=N
local relaybus = require "relaybus"
local dir = assert(arg[1], "usage: full_disk.lua DIR")
local room = tonumber(os.getenv("ROOM") or "") or 400 * 1024

local store = assert(relaybus.open("sqlite:" .. dir .. "/full.db"))
assert(store:enqueue("rg.warm", 1))   -- the schema and the WAL are there before the filler

-- fill the file system, then give ROOM bytes back
local filler = dir .. "/filler"
local f = assert(io.open(filler, "wb"))
local chunk, total = string.rep("\0", 4096), 0
while f:write(chunk) and f:flush() do total = total + #chunk end
f:close()
os.remove(filler)
f = assert(io.open(filler, "wb"))
assert(f:write(string.rep("\0", math.max(0, total - room))))
assert(f:close())

local ids, errs = {}, {}
for i = 1, 64 do
  relaybus.spawn(function()
    relaybus.sleep(0.02 * (i % 8))
    local id, err = store:enqueue("rg.full", { pad = string.rep("x", (i % 4 == 0) and 60000 or 100) })
    if id then ids[#ids + 1] = id else errs[#errs + 1] = tostring(err) end
  end)
end
relaybus.run()

local multiline, missing = 0, 0
for _, e in ipairs(errs) do if e:find("\n") then multiline = multiline + 1 end end
for _, id in ipairs(ids) do if not store:get(id) then missing = missing + 1 end end
local stats = assert(store:stats())
print(string.format("errs=%d ids=%d multiline=%d missing=%d pending=%d",
                    #errs, #ids, multiline, missing, stats.pending - 1))  -- less rg.warm
if errs[1] then print("first error: " .. errs[1]) end
store:close()
