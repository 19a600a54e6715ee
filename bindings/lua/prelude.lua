-- prelude.lua -- the parts of the relaybus module written in Lua on top of its C primitives:
-- store:transaction and tx:collection (d:every and retention are the C dispatcher's,
-- runtime/dispatch/every.c and retention.c). Run by luaopen_relaybus each time the module is
-- opened.
return function(relaybus)
  local registry = debug.getregistry()
  local store_mt = registry["relaybus.store"]
  local tx_mt = registry["relaybus.tx"]
  local json = relaybus.json

  -- An error value as text, as a handler's raise is described (bindings/task.c): any value,
  -- one whose __tostring raises or answers no string included, so nothing raises out of
  -- store:transaction once its transaction is open.
  local function error_text(e)
    if type(e) == "string" then return e end
    if e == nil then return "error (nil)" end
    local ok, text = pcall(tostring, e)
    if ok and type(text) == "string" then return text end
    return "error (a value whose __tostring raised)"
  end

  -- store:transaction(fn): commit when fn returns, roll back when it raises.
  function store_mt.__index.transaction(store, fn)
    if type(fn) ~= "function" then
      error("relaybus: transaction: expected a function", 0)
    end
    local tx, err = store:_begin()
    if not tx then return nil, err end
    local res = table.pack(pcall(fn, tx))
    if not res[1] then
      pcall(tx._rollback, tx)   -- (fn may have ended the transaction itself: nothing to undo)
      return nil, error_text(res[2])
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

end
