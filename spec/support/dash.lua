-- dash.lua -- what the dashboard specs share: a server on a free port inside the spec's own
-- loop, HTTP calls to it through relaybus.http, and a store with deliveries in every status.
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local relaybus = S.relaybus()
local json = relaybus.json

local D = {}
D.TOKEN = "spec-token-0123456789"
D.XSS = "<img src=x onerror=alert(1)>"

-- Runs fn(srv, call) as a task with a server on the store, then stops the server and runs
-- the loop to its end. call(method, path, headers) -> status, body, decoded JSON (or nil).
function D.with_server(store, opts, fn)
  local err, finished
  relaybus.spawn(function()
    local o = { store = store, listen = "127.0.0.1:0" }
    for k, v in pairs(opts or {}) do o[k] = v end
    local srv, serr = relaybus.serve(o)
    if not srv then err = serr; finished = true; return end
    local function call(method, path, headers, body)
      local r, herr = relaybus.http.request { url = srv:url():gsub("/$", "") .. path,
                                               method = method, headers = headers, body = body,
                                               timeout = 60 }
      assert(r, herr)
      local ok, v = pcall(json.decode, r.body)
      return r.status, r.body, ok and v or nil, r.headers
    end
    local ok, e = xpcall(fn, debug.traceback, srv, call)
    srv:stop()
    if not ok then err = e end
    finished = true
  end)
  -- run() returns once a dispatcher the test started has stopped: go on until the test ends
  repeat relaybus.run() until finished
  if err then error(err, 0) end
end

D.auth = { Authorization = "Bearer " .. D.TOKEN }

-- Deliveries in every status: 2 completed, 1 buried (with a last error), 1 pending later, and
-- one per topic given that stays pending. Returns ids by status.
function D.fill(store, extra_topics)
  local ids = { completed = {}, buried = {}, pending = {} }
  for i = 1, 2 do ids.completed[i] = store:enqueue("ok", { n = i }) end
  ids.buried[1] = store:enqueue("bad", { order = 7, items = { "a", "b" } }, { max_attempts = 1 })
  local d = H.dispatcher(store)
  d:handle("ok", function() end)
  d:handle("bad", function() error("card declined: <b>nope</b>") end)
  local stop = H.stopper(d)
  d:start()
  relaybus.spawn(function()
    H.poll(function() local s = store:stats() return s.completed == 2 and s.buried == 1 end, 20)
    stop()
  end)
  relaybus.run()
  ids.pending[1] = store:enqueue("later", { n = 9 }, { delay = 3600 })
  for _, t in ipairs(extra_topics or {}) do ids.pending[#ids.pending + 1] = store:enqueue(t, { t = true }) end
  return ids
end

return D
