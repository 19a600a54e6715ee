-- cli.lua -- the subcommands of the `relaybus` command (run, enqueue, stats, list, kick, purge,
-- migrate), compiled into build/relaybus by the Makefile. cmd/main.c calls this chunk with a
-- table of host helpers followed by the command-line arguments; it returns the exit status.
local host = ...
local argv = table.pack(select(2, ...))
local relaybus = require "relaybus"
local json = relaybus.json

local DEFAULT_STORE = "sqlite:relaybus.db"
local EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2

-- A failure ends the command with one line on stderr and an exit status.
local Exit = {}
Exit.__index = Exit
local function fail(status, fmt, ...)
  error(setmetatable({ status = status, msg = string.format(fmt, ...) }, Exit), 0)
end
local function usage(fmt, ...) fail(EXIT_USAGE, fmt, ...) end
local function runtime(fmt, ...) fail(EXIT_FAIL, fmt, ...) end

local function oneline(s)
  return (tostring(s):gsub("[\r\n]+", " "))
end

------------------------------------------------------------------------------------------
-- Help texts

local STORE_HELP = [[
  --store URL       the store (else $RELAYBUS_STORE, else sqlite:relaybus.db):
                    sqlite:PATH, sqlite::memory:, postgresql://..., mongodb://.../DB
  --table NAME      the deliveries table or collection (default relaybus_deliveries)
  -h, --help        this help]]

local HELP = {}
HELP.main = [[
Usage: relaybus COMMAND [OPTIONS] [ARGS]

Durable delivery of work from a database to code.

Commands:
  run SCRIPT [ARGS]      run a Lua script; keeps running while a dispatcher runs
  enqueue TOPIC [JSON]   add a delivery and print its id
  stats                  counts of deliveries by status
  list                   list deliveries, oldest first
  kick ID | --buried     put buried deliveries back to pending
  purge                  delete settled deliveries
  migrate                create or upgrade the schema
  help [COMMAND]         this help, or a command's

Every command takes:
]] .. STORE_HELP .. [[


Exit status: 0 success, 1 runtime failure, 2 usage error.
Run `relaybus COMMAND --help` for a command's options.]]

HELP.run = [[
Usage: relaybus run [--store URL] SCRIPT [ARGS...]

Runs the Lua script SCRIPT (`-` reads standard input) with ARGS as `...` and in the global
`arg` (arg[0] = SCRIPT), then runs the event loop while any dispatcher runs. `require
"relaybus"` works in the script. SIGINT or SIGTERM stops every dispatcher gracefully; a
second signal exits at once. Options must come before SCRIPT; everything after it is the
script's. --store sets RELAYBUS_STORE for the script.

Options:
]] .. STORE_HELP

HELP.enqueue = [[
Usage: relaybus enqueue TOPIC [JSON] [OPTIONS]

Adds one delivery of TOPIC with the payload JSON (default {}) and prints its id.

Options:
  --delay S         run no sooner than S seconds from now
  --key K           dedupe key: while a delivery of TOPIC with key K is pending or
                    processing, print its id and add nothing
  --max-attempts N  bury after N attempts (default 25)
]] .. STORE_HELP

HELP.stats = [[
Usage: relaybus stats [OPTIONS]

Prints the number of deliveries by status, how many are due, and the age of the oldest due.

Options:
  --json            print a JSON object instead of a table
]] .. STORE_HELP

HELP.list = [[
Usage: relaybus list [OPTIONS]

Lists deliveries, oldest first.

Options:
  --status S        only pending, processing, completed or buried deliveries
  --topic T         only deliveries of topic T
  --limit N         at most N deliveries (default 100)
  --json            print a JSON array of delivery records instead of a table
]] .. STORE_HELP

HELP.kick = [[
Usage: relaybus kick ID
       relaybus kick --buried

Puts the buried delivery ID, or every buried delivery, back to pending with its attempts
reset, and prints how many were requeued. Kicking an ID that is not buried fails (exit 1).

Options:
  --buried          every buried delivery
]] .. STORE_HELP

HELP.purge = [[
Usage: relaybus purge --completed|--buried --older-than S

Deletes completed (or buried, or both) deliveries settled more than S seconds ago and
prints how many were deleted.

Options:
  --completed       delete completed deliveries
  --buried          delete buried deliveries
  --older-than S    only those older than S seconds (required; 0 for all)
]] .. STORE_HELP

HELP.migrate = [[
Usage: relaybus migrate [OPTIONS]

Creates or upgrades the store's schema.

Options:
]] .. STORE_HELP

------------------------------------------------------------------------------------------
-- Option parsing

-- spec: option name -> "flag" | "string" | "number" | "count" (integer >= 1) | "seconds"
local COMMON = { store = "string", table = "string", help = "flag" }

local function check_value(cmd, name, kind, v)
  if kind == "number" or kind == "seconds" then
    local n = tonumber(v)
    if not n or n ~= n or n == math.huge or n == -math.huge then
      usage("%s: --%s needs a number, got '%s'", cmd, name, v)
    end
    if n < 0 then usage("%s: --%s must not be negative", cmd, name) end
    return n
  elseif kind == "count" then
    local n = math.tointeger(tonumber(v))
    if not n or n < 1 then usage("%s: --%s needs a positive integer, got '%s'", cmd, name, v) end
    return n
  end
  return v
end

-- Parses args[first..last] against spec; returns options and the positional arguments.
-- stop_at_positional: the first positional argument ends option parsing (for `run`).
local function parse(cmd, args, first, spec, stop_at_positional)
  local opts, pos = {}, {}
  local i = first
  while i <= args.n do
    local a = args[i]
    if a == "--" then
      for j = i + 1, args.n do pos[#pos + 1] = args[j] end
      break
    elseif a == "-h" then
      opts.help = true
    elseif a:sub(1, 2) == "--" and #a > 2 then
      local name, value = a:match("^%-%-([^=]+)=(.*)$")
      name = name or a:sub(3)
      local kind = spec[name] or COMMON[name]
      if not kind then usage("%s: unknown option --%s (see relaybus %s --help)", cmd, name, cmd) end
      if kind == "flag" then
        if value then usage("%s: --%s takes no value", cmd, name) end
        opts[name] = true
      else
        if not value then
          i = i + 1
          value = args[i]
          if value == nil then usage("%s: --%s needs a value", cmd, name) end
        end
        opts[name] = check_value(cmd, name, kind, value)
      end
    elseif a:sub(1, 1) == "-" and #a > 1 then
      usage("%s: unknown option %s (see relaybus %s --help)", cmd, a, cmd)
    else
      pos[#pos + 1] = a
      if stop_at_positional then
        for j = i + 1, args.n do pos[#pos + 1] = args[j] end
        break
      end
    end
    i = i + 1
  end
  return opts, pos
end

local function help(cmd)
  io.stdout:write(HELP[cmd], "\n")
  return EXIT_OK
end

local function max_args(cmd, pos, n)
  if #pos > n then usage("%s: unexpected argument '%s'", cmd, pos[n + 1]) end
end

------------------------------------------------------------------------------------------
-- Store access

local function store_url(opts)
  local url = opts.store or os.getenv("RELAYBUS_STORE")
  if url == nil or url == "" then url = DEFAULT_STORE end
  return url
end

local function open_store(opts)
  local url = store_url(opts)
  local ok, store, err = pcall(relaybus.open, url, { table = opts.table })
  if not ok then runtime("cannot open store %s: %s", url, oneline(store)) end
  if not store then runtime("cannot open store %s: %s", url, oneline(err or "unknown error")) end
  return store
end

-- Calls store:method(...); a runtime failure (nil, err) ends the command with exit 1.
local function call(cmd, store, method, ...)
  local r = table.pack(store[method](store, ...))
  if r[1] == nil then runtime("%s: %s", cmd, oneline(r[2] or "failed")) end
  return table.unpack(r, 1, r.n)
end

------------------------------------------------------------------------------------------
-- Formatting

local function fmt_duration(s)
  if s == nil then return "-" end
  s = tonumber(s) or 0
  if s < 0 then return "-" .. fmt_duration(-s) end
  if s < 60 then return string.format("%.1fs", s) end
  if s < 3600 then return string.format("%dm%02ds", s // 60, math.floor(s % 60)) end
  if s < 86400 then return string.format("%dh%02dm", s // 3600, math.floor(s % 3600 // 60)) end
  return string.format("%dd%02dh", s // 86400, math.floor(s % 86400 // 3600))
end

local function fmt_time(t)
  if t == nil or type(t) ~= "number" then return "-" end
  return os.date("!%Y-%m-%d %H:%M:%S", math.floor(t))
end

local function truncate(s, n)
  s = oneline(s)
  if utf8.len(s) and utf8.len(s) > n then
    return s:sub(1, utf8.offset(s, n) - 1) .. "…"
  end
  return s
end

local function width(s)
  return utf8.len(s) or #s
end

-- Prints rows (arrays of strings) as aligned columns; align[i] == "r" right-aligns column i.
local function print_table(header, rows, align)
  local w = {}
  for i, h in ipairs(header) do w[i] = width(h) end
  for _, r in ipairs(rows) do
    for i = 1, #header do w[i] = math.max(w[i], width(r[i])) end
  end
  local function line(r)
    local cells = {}
    for i = 1, #header do
      local pad = string.rep(" ", w[i] - width(r[i]))
      if i == #header then
        cells[i] = align[i] == "r" and pad .. r[i] or r[i]
      else
        cells[i] = align[i] == "r" and pad .. r[i] or r[i] .. pad
      end
    end
    io.stdout:write(table.concat(cells, "  "), "\n")
  end
  line(header)
  for _, r in ipairs(rows) do line(r) end
end

-- JSON of an array that stays an array when empty.
local function json_array(list)
  local parts = {}
  for i, v in ipairs(list) do parts[i] = json.encode(v) end
  return "[" .. table.concat(parts, ",") .. "]"
end

------------------------------------------------------------------------------------------
-- Commands

local commands = {}

function commands.run(args)
  local opts, pos = parse("run", args, 2, {}, true)
  if opts.help then return help("run") end
  local script = pos[1]
  if not script then usage("run: missing SCRIPT (see relaybus run --help)") end
  if opts.store then host.setenv("RELAYBUS_STORE", opts.store) end

  local chunk, err = loadfile(script ~= "-" and script or nil)
  if not chunk then runtime("%s", oneline(err)) end

  -- The script's arguments, as lua5.4 gives them.
  local sarg = { [0] = script }
  for i = 2, #pos do sarg[i - 1] = pos[i] end
  sarg[-1] = "run"
  sarg[-2] = arg and arg[0] or "relaybus"
  _G.arg = sarg

  local ok, serr = xpcall(chunk, function(e)
    if type(e) == "string" then return e end
    local mt = getmetatable(e)
    if mt and mt.__tostring then return tostring(e) end
    return "(error object is a " .. type(e) .. " value)"
  end, table.unpack(pos, 2))
  if not ok then
    io.stderr:write("relaybus: ", oneline(serr), "\n")
    io.stderr:flush()
    -- Stop what the script started, gracefully, before failing.
    host.stop_all()
    pcall(relaybus.run)
    return EXIT_FAIL
  end
  relaybus.run()
  return EXIT_OK
end

function commands.enqueue(args)
  local opts, pos = parse("enqueue", args, 2,
    { delay = "seconds", key = "string", ["max-attempts"] = "count" })
  if opts.help then return help("enqueue") end
  local topic = pos[1]
  if not topic then usage("enqueue: missing TOPIC (see relaybus enqueue --help)") end
  if topic == "" then usage("enqueue: TOPIC must not be empty") end
  max_args("enqueue", pos, 2)
  local payload = {}
  if pos[2] then
    local ok, v, err = pcall(json.decode, pos[2])
    if not ok then err = v end
    if not ok or (v == nil and err ~= nil) then
      usage("enqueue: invalid JSON payload: %s", oneline(err))
    end
    payload = v   -- JSON null: nil, an absent payload
  end
  local eopts = { delay = opts.delay, key = opts.key, max_attempts = opts["max-attempts"] }
  local store = open_store(opts)
  local id = call("enqueue", store, "enqueue", topic, payload, eopts)
  io.stdout:write(tostring(id), "\n")
  store:close()
  return EXIT_OK
end

local STAT_KEYS = { "pending", "processing", "completed", "buried", "due", "oldest_due_age" }

function commands.stats(args)
  local opts, pos = parse("stats", args, 2, { json = "flag" })
  if opts.help then return help("stats") end
  max_args("stats", pos, 0)
  local store = open_store(opts)
  local s = call("stats", store, "stats")
  if opts.json then
    io.stdout:write(json.encode(s), "\n")
  else
    local rows = {}
    for _, k in ipairs(STAT_KEYS) do
      local v = s[k]
      if k == "oldest_due_age" then
        v = (v and (s.due or 0) > 0) and fmt_duration(v) or "-"
      else
        v = tostring(v or 0)
      end
      rows[#rows + 1] = { k, v }
    end
    print_table({ "STATUS", "COUNT" }, rows, { "l", "r" })
  end
  store:close()
  return EXIT_OK
end

local STATUSES = { pending = true, processing = true, completed = true, buried = true }

function commands.list(args)
  local opts, pos = parse("list", args, 2,
    { status = "string", topic = "string", limit = "count", json = "flag" })
  if opts.help then return help("list") end
  max_args("list", pos, 0)
  if opts.status and not STATUSES[opts.status] then
    usage("list: --status must be pending, processing, completed or buried, got '%s'", opts.status)
  end
  local store = open_store(opts)
  local rows = call("list", store, "list",
    { status = opts.status, topic = opts.topic, limit = opts.limit or 100 })
  if opts.json then
    io.stdout:write(json_array(rows), "\n")
  else
    local now = relaybus.time()
    local out = {}
    for _, d in ipairs(rows) do
      local due
      if d.status == "pending" then
        local wait = (d.run_at or now) - now
        due = wait > 0 and ("in " .. fmt_duration(wait)) or "now"
      elseif d.status == "processing" then
        local left = (d.lease_expires_at or now) - now
        due = left > 0 and ("lease " .. fmt_duration(left)) or "lease expired"
      else
        due = "-"
      end
      out[#out + 1] = {
        tostring(d.id), truncate(d.topic or "", 24), d.status or "?",
        string.format("%d/%d", d.attempts or 0, d.max_attempts or 0),
        tostring(d.fence or 0), fmt_time(d.created_at), due,
        d.key and truncate(d.key, 20) or "-",
        d.last_error and truncate(d.last_error, 40) or "-",
      }
    end
    print_table({ "ID", "TOPIC", "STATUS", "ATTEMPTS", "FENCE", "CREATED (UTC)", "RUN",
                  "KEY", "LAST ERROR" }, out,
                { "l", "l", "l", "r", "r", "l", "l", "l", "l" })
    if #out == 0 then io.stderr:write("(no deliveries)\n") end
  end
  store:close()
  return EXIT_OK
end

function commands.kick(args)
  local opts, pos = parse("kick", args, 2, { buried = "flag" })
  if opts.help then return help("kick") end
  max_args("kick", pos, 1)
  if opts.buried and pos[1] then usage("kick: give an ID or --buried, not both") end
  if not opts.buried and not pos[1] then usage("kick: missing ID or --buried (see relaybus kick --help)") end
  local store = open_store(opts)
  local n
  if opts.buried then
    n = call("kick", store, "kick", { status = "buried" })
  else
    n = call("kick", store, "kick", pos[1])
    if n == 0 then
      store:close()
      runtime("kick: delivery %s is not buried or does not exist", pos[1])
    end
  end
  io.stdout:write(tostring(n), "\n")
  store:close()
  return EXIT_OK
end

function commands.purge(args)
  local opts, pos = parse("purge", args, 2,
    { completed = "flag", buried = "flag", ["older-than"] = "seconds" })
  if opts.help then return help("purge") end
  max_args("purge", pos, 0)
  if not opts.completed and not opts.buried then
    usage("purge: say what to delete: --completed and/or --buried (see relaybus purge --help)")
  end
  if opts["older-than"] == nil then usage("purge: missing --older-than S (0 for all)") end
  local store = open_store(opts)
  local total = 0
  for _, status in ipairs{ "completed", "buried" } do
    if opts[status] then
      total = total + call("purge", store, "purge", { status = status, older_than = opts["older-than"] })
    end
  end
  io.stdout:write(tostring(total), "\n")
  store:close()
  return EXIT_OK
end

function commands.migrate(args)
  local opts, pos = parse("migrate", args, 2, {})
  if opts.help then return help("migrate") end
  max_args("migrate", pos, 0)
  local url = store_url(opts)
  local ok, store, err = pcall(relaybus.open, url, { table = opts.table, migrate = true })
  if not ok then runtime("migrate: %s: %s", url, oneline(store)) end
  if not store then runtime("migrate: %s: %s", url, oneline(err or "unknown error")) end
  store:close()
  io.stdout:write("schema up to date: ", url, "\n")
  return EXIT_OK
end

------------------------------------------------------------------------------------------
-- Entry

local function main()
  -- Options before the command (relaybus --store URL stats) apply to it.
  local pre = {}
  local i = 1
  while i <= argv.n and argv[i]:sub(1, 1) == "-" do
    local a = argv[i]
    if a == "-h" or a == "--help" then
      return help("main")
    elseif a == "--version" then
      io.stdout:write("relaybus ", relaybus._VERSION or "", "\n")
      return EXIT_OK
    end
    local name, value = a:match("^%-%-([^=]+)=(.*)$")
    name = name or a:match("^%-%-(.+)$")
    if name ~= "store" and name ~= "table" then
      usage("unknown option %s (see relaybus --help)", a)
    end
    if not value then
      i = i + 1
      value = argv[i]
      if value == nil then usage("--%s needs a value", name) end
    end
    pre[#pre + 1] = "--" .. name
    pre[#pre + 1] = value
    i = i + 1
  end
  local cmd = argv[i]
  if cmd == nil then usage("missing command (see relaybus --help)") end
  if cmd == "help" then
    local topic = argv[i + 1]
    if topic == nil then return help("main") end
    if not HELP[topic] or topic == "main" then usage("help: unknown command '%s'", topic) end
    return help(topic)
  end
  local fn = commands[cmd]
  if not fn then usage("unknown command '%s' (see relaybus --help)", cmd) end
  -- args[1] is the command; global options go right after it.
  local args = { cmd }
  for _, v in ipairs(pre) do args[#args + 1] = v end
  for j = i + 1, argv.n do args[#args + 1] = argv[j] end
  args.n = #args
  return fn(args)
end

local ok, status = pcall(main)
if ok then
  io.stdout:flush()
  return status
end
if getmetatable(status) == Exit then
  io.stdout:flush()
  io.stderr:write("relaybus: ", status.msg, "\n")
  return status.status
end
error(status, 0)
