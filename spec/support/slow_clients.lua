-- slow_clients.lua PORT N ADDRESSES SECONDS READYFILE -- an attacker for dashboard_spec, run
-- with lua5.4 and luasocket: N connections to 127.0.0.1:PORT, spread over the loopback
-- addresses 127.0.0.2 .. 127.0.0.(1 + ADDRESSES), each sending its request head one byte
-- every 5 s and never ending it. A connection the server closes is opened again (at most N
-- times over), as a hostile client would. Writes "connected N failed N" to READYFILE once all
-- were tried, then goes on for SECONDS and exits. Bounded in connections and in time.
local socket = require "socket"
local port, n, naddr, seconds, ready = tonumber(arg[1]), tonumber(arg[2]), tonumber(arg[3]),
                                       tonumber(arg[4]), arg[5]
assert(port and n and naddr and seconds and ready, "usage: slow_clients.lua PORT N ADDRESSES SECONDS READYFILE")

local HEAD = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:" .. port .. "\r\nX-Slow: " .. string.rep("a", 4096)
local conns, connected, failed, reopened = {}, 0, 0, 0

local function open(i)
  local c = socket.tcp()
  if not c then return nil end
  c:bind("127.0.0." .. (2 + (i - 1) % naddr), 0)
  c:settimeout(0.5)
  local ok = c:connect("127.0.0.1", port)
  if not ok then c:close() return nil end
  c:settimeout(0)
  c:send(HEAD:sub(1, 1))
  return { c = c, sent = 1 }
end

for i = 1, n do
  conns[i] = open(i)
  if conns[i] then connected = connected + 1 else failed = failed + 1 end
end
local f = assert(io.open(ready .. ".tmp", "w"))
f:write(("connected %d failed %d\n"):format(connected, failed))
f:close()
os.rename(ready .. ".tmp", ready)

local deadline, next_byte = socket.gettime() + seconds, socket.gettime() + 5
while socket.gettime() < deadline do
  local byte_now = socket.gettime() >= next_byte
  if byte_now then next_byte = next_byte + 5 end
  for i = 1, n do
    local k = conns[i]
    if k then
      local _, err = k.c:receive(1)
      if err == "closed" or err == nil then     -- closed, or an answer (an error): gone
        k.c:close()
        conns[i] = nil
      elseif byte_now and k.sent < #HEAD then
        k.sent = k.sent + 1
        k.c:send(HEAD:sub(k.sent, k.sent))
      end
    end
    if not conns[i] and reopened < n and socket.gettime() < deadline then
      reopened = reopened + 1
      conns[i] = open(i)
    end
  end
  socket.sleep(0.2)
end
for _, k in pairs(conns) do k.c:close() end
