-- child.lua -- what every `relaybus run` child of the specs starts with: its store (URL and
-- table name from the command line) and a log whose lines are flushed at once, so a SIGKILL
-- loses no finished line. A child loads it from its own folder:
--   local C = dofile((arg[0]:match("^(.*/)") or "./") .. "child.lua")
local relaybus = require "relaybus"
local C = {}

-- The open options for a table argument ("" or "-" means the default table).
function C.store_opts(tbl)
  local opts = {}
  if tbl and tbl ~= "" and tbl ~= "-" then opts.table = tbl end
  return opts
end

function C.open(url, tbl)
  return assert(relaybus.open(url, C.store_opts(tbl)))
end

-- Returns say(...): appends its arguments, space-separated, as one flushed line. With blank
-- given, blanks inside an argument become blank, so every argument stays one word.
function C.logger(path, blank)
  local log = assert(io.open(path, "a"))
  return function(...)
    local parts = table.pack(...)
    for i = 1, parts.n do
      parts[i] = tostring(parts[i])
      if blank then parts[i] = parts[i]:gsub("%s", blank) end
    end
    log:write(table.concat(parts, " ", 1, parts.n), "\n")
    log:flush()
  end
end

-- Monotonic times in logs, to the microsecond.
function C.t(x) return string.format("%.6f", x) end

return C
