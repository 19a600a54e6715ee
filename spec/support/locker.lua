-- locker.lua -- holds a write lock on the deliveries table for a while, so a spec can see what a
-- process does when the store cannot confirm its writes. Run as
--   relaybus run spec/support/locker.lua STORE_URL TABLE SECONDS READYFILE
-- In one transaction it takes the lock (SQLite: an UPDATE takes the database write lock;
-- PostgreSQL: LOCK TABLE ... ACCESS EXCLUSIVE, so reads, inserts and updates all wait), writes
-- READYFILE, holds the transaction SECONDS, then commits.
local relaybus = require "relaybus"
local url, tbl, seconds, ready = ...
local opts = {}
if tbl and tbl ~= "-" and tbl ~= "" then opts.table = tbl end
local store = assert(relaybus.open(url, opts))
local name = opts.table or "relaybus_deliveries"
local ok, err = store:transaction(function(tx)
  if url:match("^postgres") then
    tx:exec("LOCK TABLE " .. name .. " IN ACCESS EXCLUSIVE MODE")
  else
    tx:exec("UPDATE " .. name .. " SET topic = topic")
  end
  local f = assert(io.open(ready, "w"))
  f:write("locked\n")
  f:close()
  relaybus.sleep(tonumber(seconds))
end)
assert(ok, err)
store:close()
