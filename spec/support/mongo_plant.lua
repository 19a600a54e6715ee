-- mongo_plant.lua -- plants documents in a MongoDB store's collections behind its back
-- (spec/support/mongo_insert.c), for the specs that must show what a crashed process leaves.
local S = require "spec.support.stores"
local relaybus = S.relaybus()
local M = {}

local function inserter()
  local bin = S.build .. "/mongo_insert"
  if not S.exists(bin) then
    -- built by `make examples`; compiled here too so the spec also runs on a bare build directory
    local ok = os.execute("cc -std=c11 -D_GNU_SOURCE -O2 -o " .. S.quote(bin) ..
                          " spec/support/mongo_insert.c $(pkg-config --cflags --libs libmongoc-1.0)")
    if not ok then error("cannot build " .. bin, 2) end
  end
  return bin
end

-- Inserts the documents (Lua tables of strings and numbers) into the collection.
function M.insert(url, collection, docs)
  local lines = {}
  for _, d in ipairs(docs) do lines[#lines + 1] = relaybus.json.encode(d) end
  local path = S.tmpfile("docs") .. ".jsonl"
  S.write(path, table.concat(lines, "\n") .. "\n")
  url = url:gsub("([?&])dialect=%a+&?", "%1"):gsub("[?&]$", "")   -- the store's own option
  local code, out, err = S.run_command({ "sh", "-c", S.quote(inserter()) .. " " .. S.quote(url) ..
    " " .. S.quote(collection) .. " < " .. S.quote(path) })
  if code ~= 0 then error("mongo_insert: " .. err, 2) end
  if tonumber(out) ~= #docs then error("mongo_insert inserted " .. out .. " of " .. #docs, 2) end
end


-- An ObjectId made at epoch second t, as the store writes ids (lower-case hex).
function M.oid(t)
  local r = {}
  for i = 1, 8 do r[i] = string.format("%02x", math.random(0, 255)) end
  return string.format("%08x", math.floor(t)) .. table.concat(r)
end

-- The _id of a group's document (runtime/stores/mongo/groups.c): the SHA-256 of its name.
function M.group_doc_id(name)
  local code, out = S.run_command({ "sh", "-c", "printf '%s' " .. S.quote(name) .. " | sha256sum" })
  if code ~= 0 then error("sha256sum failed", 2) end
  return (out:match("^(%x+)"))
end

return M
