-- prelude.lua -- the parts of the relaybus module written in Lua on top of its C primitives:
-- store:transaction, tx:collection, d:every, and the dispatcher's `retention` option (a
-- wrapper of relaybus.dispatcher, and d:start starting the every and retention tasks). Run by
-- luaopen_relaybus each time the module is opened.
return function(relaybus)
  local registry = debug.getregistry()
  local store_mt = registry["relaybus.store"]
  local tx_mt = registry["relaybus.tx"]
  local dispatcher_mt = registry["relaybus.dispatcher"]
  local json = relaybus.json
  local MAX_SECONDS = 3155760000  -- 100 years: the longest duration relaybus accepts (clock.h)

  -- store:transaction(fn): commit when fn returns, roll back when it raises.
  function store_mt.__index.transaction(store, fn)
    if type(fn) ~= "function" then
      error("relaybus: transaction: expected a function", 0)
    end
    local tx, err = store:_begin()
    if not tx then return nil, err end
    local res = table.pack(pcall(fn, tx))
    if not res[1] then
      tx:_rollback()
      local e = res[2]
      return nil, type(e) == "string" and e or tostring(e)
    end
    local ok, cerr = tx:_commit()
    if not ok then return nil, cerr end
    return true, table.unpack(res, 2, res.n)
  end

  -- tx:collection(name): the application's own MongoDB collection inside the transaction.
  local collection = {}
  collection.__index = collection
  local function encode(v, what)
    if v == nil then return nil end
    local ok, s = pcall(json.encode, v)
    if not ok then error("relaybus: " .. what .. " is not JSON-encodable", 0) end
    return s
  end
  local function decoded(doc, count_or_err)
    if doc == nil and type(count_or_err) == "string" then return nil, count_or_err end
    if doc == nil then return nil end
    return json.decode(doc)
  end
  function collection:insert_one(doc)
    local r, e = self.tx:_doc("insert_one", self.name, nil, encode(doc, "document"))
    if r == nil and type(e) == "string" then return nil, e end
    return r and json.decode(r) or true
  end
  function collection:update_one(filter, update)
    local r, e = self.tx:_doc("update_one", self.name, encode(filter, "filter"), encode(update, "update"))
    if r == nil and type(e) == "string" then return nil, e end
    return e
  end
  function collection:delete_one(filter)
    local r, e = self.tx:_doc("delete_one", self.name, encode(filter, "filter"), nil)
    if r == nil and type(e) == "string" then return nil, e end
    return e
  end
  function collection:find_one(filter)
    return decoded(self.tx:_doc("find_one", self.name, encode(filter or {}, "filter"), nil))
  end
  function tx_mt.__index.collection(tx, name)
    if type(name) ~= "string" or name == "" then
      error("relaybus: collection: name must be a non-empty string", 0)
    end
    return setmetatable({tx = tx, name = name}, collection)
  end

  -- d:every(name, interval, fn): fn(ctx) once per interval across every process sharing the
  -- store. Whoever holds the named lease for this interval runs it; the lease is kept (not
  -- released) until the interval ends, so no other process runs it again in that interval,
  -- and a holder that dies frees it when it expires.
  local every_list = setmetatable({}, {__mode = "k"})
  function dispatcher_mt.__index.every(d, name, interval, fn)
    -- its lease is "every:NAME" (try_acquire's rules: at most 255 bytes of UTF-8, no NUL)
    if type(name) ~= "string" or name == "" or #name > 249 or name:find("\0", 1, true) or not utf8.len(name) then
      error("relaybus: every: name must be 1 to 249 bytes of UTF-8 without NUL", 0)
    end
    if type(interval) ~= "number" or not (interval > 0 and interval <= MAX_SECONDS) then
      error("relaybus: every: interval must be a number of seconds above 0, at most 100 years", 0)
    end
    if type(fn) ~= "function" then error("relaybus: every: expected a function", 0) end
    every_list[d] = every_list[d] or {}
    table.insert(every_list[d], {name = name, interval = interval, fn = fn})
    return d
  end

  local function run_every(d, store, job)
    local lease_name = "every:" .. job.name
    while not d:stats().stopping and d:stats().running do
      local h = store:try_acquire(lease_name, job.interval)
      local next_try = relaybus.now() + math.min(job.interval, 1) * 0.5
      -- (a lease over already, in a process frozen since the acquire, runs nothing)
      if h and not h.signal.aborted and relaybus.now() < h.deadline then
        -- Stopped at the lease's deadline like a handler: waits end, spinning Lua is cut.
        local ctx = {signal = h.signal, deadline = h.deadline, lease = h, name = job.name}
        function ctx.sleep(_, s) return relaybus.sleep(s) end
        local ok, err = h:_run(job.fn, ctx)
        if not ok then
          io.stderr:write("relaybus: every '", job.name, "' failed: ", tostring(err), "\n")
        end
        next_try = h.deadline
      end
      local wait = next_try - relaybus.now()
      if wait > 0 then d:_idle(wait) end
    end
  end

  -- Retention: one instance at a time (a named lease) purges completed deliveries older
  -- than `retention` seconds, in bounded batches so claims are never blocked for long.
  local retention_of = setmetatable({}, {__mode = "k"})
  local new_dispatcher = relaybus.dispatcher
  function relaybus.dispatcher(store, opts)
    local d = new_dispatcher(store, opts)
    local r = opts and opts.retention
    if r ~= nil and (type(r) ~= "number" or not (r >= 0 and r <= MAX_SECONDS)) then
      error("relaybus: dispatcher: retention must be a number of seconds from 0 (off) to 100 years", 0)
    end
    retention_of[d] = r or 7 * 86400
    return d
  end

  -- A purge that finds little to delete still reads every settled row the store keeps (no
  -- index serves it: one would cost every completion an index insert), so once caught up
  -- the holder keeps the lease for `rest`, and no process purges again before it expires.
  -- The first try waits one period: a process that starts into a backlog drains it first.
  local PURGE_BATCH = 1000
  local function run_retention(d, store, retention)
    local period = math.max(1, math.min(retention / 4, 60))
    local rest = math.max(period, math.min(retention / 4, 3600))
    d:_idle(period)
    while d:stats().running and not d:stats().stopping do
      local h = store:try_acquire("relaybus.retention", period)
      if h then
        local n
        repeat
          n = store:purge{status = "completed", older_than = retention, limit = PURGE_BATCH}
          if n and n >= PURGE_BATCH then relaybus.sleep(0) end
        until not n or n < PURGE_BATCH or h.signal.aborted or d:stats().stopping
        if n and n < PURGE_BATCH and not h.signal.aborted then h:extend(rest) end
      end
      d:_idle(period)
    end
  end

  -- The dispatcher has started by now: a task that cannot be made (out of memory) is said,
  -- not raised, or start() would fail for a dispatcher that runs.
  local function daemon(what, fn, ...)
    local ok, err = pcall(relaybus._daemon, fn, ...)
    if not ok then io.stderr:write("relaybus: cannot run ", what, ": ", tostring(err), "\n") end
  end

  local start = dispatcher_mt.__index.start
  function dispatcher_mt.__index.start(d)
    local first = not d:stats().running
    start(d)
    if first then
      local store = d:_store()
      for _, job in ipairs(every_list[d] or {}) do
        daemon("every '" .. job.name .. "'", run_every, d, store, job)
      end
      local retention = retention_of[d]
      if retention and retention > 0 then daemon("retention", run_retention, d, store, retention) end
    end
    return d
  end
end
