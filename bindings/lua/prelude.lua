-- prelude.lua -- the parts of the relaybus module written in Lua on top of its C primitives:
-- store:transaction, tx:collection and d:every. Loaded once by luaopen_relaybus.
return function(relaybus)
  local registry = debug.getregistry()
  local store_mt = registry["relaybus.store"]
  local tx_mt = registry["relaybus.tx"]
  local dispatcher_mt = registry["relaybus.dispatcher"]
  local json = relaybus.json

  -- store:transaction(fn): commit when fn returns, roll back when it raises.
  function store_mt.__index.transaction(store, fn)
    if type(fn) ~= "function" then
      error("relaybus: transaction: expected a function", 2)
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
    if not ok then error("relaybus: " .. what .. " is not JSON-encodable", 3) end
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
      error("relaybus: collection: name must be a non-empty string", 2)
    end
    return setmetatable({tx = tx, name = name}, collection)
  end

  -- d:every(name, interval, fn): fn(ctx) once per interval across every process sharing the
  -- store. Whoever holds the named lease for this interval runs it; the lease is kept (not
  -- released) until the interval ends, so no other process runs it again in that interval,
  -- and a holder that dies frees it when it expires.
  local every_list = setmetatable({}, {__mode = "k"})
  function dispatcher_mt.__index.every(d, name, interval, fn)
    if type(name) ~= "string" or name == "" then error("relaybus: every: name must be a string", 2) end
    if type(interval) ~= "number" or interval <= 0 then error("relaybus: every: interval must be > 0", 2) end
    if type(fn) ~= "function" then error("relaybus: every: expected a function", 2) end
    every_list[d] = every_list[d] or {}
    table.insert(every_list[d], {name = name, interval = interval, fn = fn})
    return d
  end

  local function run_every(d, store, job)
    local lease_name = "every:" .. job.name
    while not d:stats().stopping and d:stats().running do
      local h = store:try_acquire(lease_name, job.interval)
      local next_try = relaybus.now() + math.min(job.interval, 1) * 0.5
      if h then
        local ctx = {signal = h.signal, deadline = h.deadline, lease = h, name = job.name}
        function ctx.sleep(_, s) return relaybus.sleep(s) end
        local ok, err = pcall(job.fn, ctx)
        if not ok then
          io.stderr:write("relaybus: every '", job.name, "' failed: ", tostring(err), "\n")
        end
        next_try = h.deadline
      end
      local wait = next_try - relaybus.now()
      if wait > 0 then relaybus.sleep(wait) end
    end
  end

  local start = dispatcher_mt.__index.start
  function dispatcher_mt.__index.start(d)
    local first = not d:stats().running
    start(d)
    if first and every_list[d] then
      local store = d:_store()
      for _, job in ipairs(every_list[d]) do
        relaybus.spawn(run_every, d, store, job)
      end
    end
    return d
  end
end
