-- cli.lua -- the subcommands of the `relaybus` command (run, enqueue, stats, list, kick, purge,
-- migrate), compiled into build/relaybus by the Makefile. cmd/main.c calls this chunk with a
-- table of host helpers followed by the command-line arguments; it returns the exit status.
-- Called with the string "module" instead, it runs nothing and returns its parts: the parser
-- (parse(argv) -> command, or nil and a usage message) and the formatters, for the specs and
-- fuzz/cli_fuzz.c.
--
-- Parsing and running are apart: parse() checks every argument and builds a command table
-- without touching a store, the environment or the terminal; commands[NAME] carries it out.
-- Everything shown to a person goes through show(), which makes it one inert line: control
-- characters, invalid UTF-8 and the Unicode controls that reorder text are written as
-- escapes, and store URLs appear only redacted.
local host = ...
local argv = table.pack(select(2, ...))
local relaybus = require "relaybus"
local json = relaybus.json

local DEFAULT_STORE = "sqlite:relaybus.db"
local EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
local MAX_COUNT = 2147483647            -- the stores keep limits in 32 bits
local MAX_COUNTS = { ["max-attempts"] = 1000000000,   -- what store:enqueue accepts
                     limit = 1000000,                 -- and store:list
                     rate = 1000000000, concurrency = 1000000000 }   -- and store:limit
local MAX_SECONDS = 100 * 365.25 * 86400  -- RB_MAX_SECONDS, the longest delay or age accepted
local SHOWN_MAX = 200                   -- characters of one argument quoted in a message

-- A failure ends the command with one line on stderr and an exit status.
local Exit = {}
Exit.__index = Exit
local function fail(status, fmt, ...)
  error(setmetatable({ status = status, msg = string.format(fmt, ...) }, Exit), 0)
end
local function usage(fmt, ...) fail(EXIT_USAGE, fmt, ...) end
local function runtime(fmt, ...) fail(EXIT_FAIL, fmt, ...) end

------------------------------------------------------------------------------------------
-- Text for a terminal

-- The code point at s[i] and its length, or nil when no valid UTF-8 sequence starts there
-- (utf8.len is strict: no overlong forms, surrogates or values past U+10FFFF).
local function char_at(s, i)
  local b = s:byte(i)
  if b < 0x80 then return b, 1 end
  if b < 0xc2 or b > 0xf4 or not utf8.len(s, i, i) then return nil end
  local cp = utf8.codepoint(s, i)
  return cp, cp < 0x800 and 2 or cp < 0x10000 and 3 or 4
end

-- Code points a terminal acts on or that change how the text around them reads: C0, DEL,
-- C1 (0x9b is CSI on some terminals), and the invisible format controls (bidi overrides and
-- isolates, zero-width characters, line and paragraph separators).
local function is_control(cp)
  return cp < 0x20 or (cp >= 0x7f and cp < 0xa0) or cp == 0x61c or cp == 0xfeff
    or (cp >= 0x200b and cp <= 0x200f) or (cp >= 0x2028 and cp <= 0x202e)
    or (cp >= 0x2060 and cp <= 0x2069)
end

-- s as one inert line of at most max characters (then "…"): \xNN for control bytes and
-- invalid UTF-8, \u{NNNN} for other control characters. message: runs of whitespace become
-- one space first (for error texts, which are often several lines). Outside messages a
-- backslash is doubled, so a stored "\\x0a" never reads as the escape of a newline.
local function show(s, max, message)
  s = tostring(s)
  if message then s = s:gsub("[ \t\r\n\v\f]+", " "):gsub("^ ", ""):gsub(" $", "") end
  max = max or math.huge
  if not s:find("[^\32-\126]") and (message or not s:find("\\", 1, true)) and #s <= max then
    return s
  end
  local out, n, i = {}, 0, 1
  while i <= #s do
    if n >= max then out[#out + 1] = "…"; break end
    local cp, len = char_at(s, i)
    if not cp then
      out[#out + 1] = string.format("\\x%02x", s:byte(i))
      len = 1
    elseif cp == 0x5c and not message then
      out[#out + 1] = "\\\\"
    elseif cp < 0x80 and is_control(cp) then
      out[#out + 1] = string.format("\\x%02x", cp)
    elseif is_control(cp) then
      out[#out + 1] = string.format("\\u{%x}", cp)
    else
      out[#out + 1] = s:sub(i, i + len - 1)
    end
    n = n + 1
    i = i + len
  end
  return table.concat(out)
end

-- An argument quoted in a message: a URL only redacted, and shown inert.
local function show_arg(a)
  return show(relaybus._redact_url(a), SHOWN_MAX)
end

-- The store URLs this run has seen: their secrets are taken out of every message.
local urls = {}
local function scrub(text)
  for _, url in ipairs(urls) do text = relaybus._redact_secrets(text, url) end
  return text
end

------------------------------------------------------------------------------------------
-- Formatting

local DAY, YEAR = 86400, 365.25 * 86400
local MIN_TIME, MAX_TIME = -62135596800, 253402300799   -- 0001-01-01, 9999-12-31 23:59:59

local function finite(v)
  return type(v) == "number" and v == v and v ~= math.huge and v ~= -math.huge
end

-- A duration for a person: 4.2s, 3m07s, 5h02m, 12d03h, 31y; "-" for no number.
local function fmt_duration(s)
  if type(s) ~= "number" or s ~= s then return "-" end
  s = s + 0.0     -- a float: -math.mininteger is math.mininteger again
  if s < 0 then return "-" .. fmt_duration(-s) end
  if s < 60 then return string.format("%.1fs", s) end
  s = math.floor(s)
  if s < 3600 then return string.format("%dm%02ds", s // 60, s % 60) end
  if s < DAY then return string.format("%dh%02dm", s // 3600, s % 3600 // 60) end
  if s < 1000 * DAY then return string.format("%dd%02dh", s // DAY, s % DAY // 3600) end
  if s < 10000 * YEAR then return string.format("%dy", math.floor(s / YEAR)) end
  return ">9999y"
end

-- Epoch seconds as a UTC time; a time os.date cannot show (or a year of five digits) says so.
local function fmt_time(t)
  if type(t) ~= "number" or t ~= t then return "-" end
  t = math.floor(t)
  if t < MIN_TIME then return "before 0001" end
  if t > MAX_TIME then return "after 9999" end
  return os.date("!%Y-%m-%d %H:%M:%S", math.tointeger(t))
end

-- An integer field (attempts, fence) whatever the store returned.
local function fmt_int(v)
  if type(v) ~= "number" then return v == nil and "-" or show(v, 20) end
  return math.tointeger(v) and string.format("%d", v) or tostring(v)
end

local function width(s)
  return utf8.len(s) or #s
end

-- Prints rows (arrays of strings already shown) as aligned columns; align[i] == "r"
-- right-aligns column i.
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

------------------------------------------------------------------------------------------
-- JSON output: always valid JSON, also for what a store holds that JSON cannot (invalid
-- UTF-8 becomes U+FFFD, an infinite time null), and inert on a terminal.

local NULL = json.decode("[null]")[1]

local function utf8_clean(s)
  if utf8.len(s) then return s end
  local out, i = {}, 1
  while i <= #s do
    local cp, len = char_at(s, i)
    out[#out + 1] = cp and s:sub(i, i + len - 1) or "\u{fffd}"
    i = i + (len or 1)
  end
  return table.concat(out)
end

local function json_safe(v, depth)
  local t = type(v)
  if t == "string" then return utf8_clean(v) end
  if t == "number" then return finite(v) and v or NULL end
  if t ~= "table" or depth > 100 then return v end
  local out = {}
  for k, x in pairs(v) do
    out[type(k) == "string" and utf8_clean(k) or k] = json_safe(x, depth + 1)
  end
  return out
end

-- Raw control characters past what cjson escapes (C1, bidi controls...) as \u escapes: in
-- JSON text such characters occur only inside strings, where the escape means the same.
local function json_text(v)
  local ok, text = pcall(json.encode, json_safe(v, 0))
  if not ok then runtime("cannot write JSON: %s", show(text, SHOWN_MAX, true)) end
  return (text:gsub("[\xc2-\xf4][\x80-\xbf]+", function(c)
    local cp = utf8.codepoint(c)
    return is_control(cp) and string.format("\\u%04x", cp) or c
  end))
end

-- JSON of an array that stays an array when empty.
local function json_array(list)
  local parts = {}
  for i, v in ipairs(list) do parts[i] = json_text(v) end
  return "[" .. table.concat(parts, ",") .. "]"
end

------------------------------------------------------------------------------------------
-- Help texts

local STORE_HELP = [[
  --store URL       the store (else $RELAYBUS_STORE, else sqlite:relaybus.db):
                    sqlite:PATH, sqlite::memory:, postgresql://... (or postgres://...),
                    mongodb://.../DB
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
  show ID                one delivery, whole
  kick ID | --buried [--topic T]
                         put buried (or a cancelled) deliveries back to pending
  cancel ID | --all [--topic T]
                         cancel a pending or running delivery, or every one
  purge                  delete settled deliveries
  pause TOPIC            no process starts a delivery of TOPIC until resumed
  resume TOPIC           let TOPIC's deliveries start again
  paused                 list the paused topics
  limit TOPIC [--rate N --per S] [--concurrency M] | --clear
                         limit how often and how many of TOPIC start, across processes
  limits                 list the limited topics
  schedule NAME --topic T --cron SPEC | --every S
                         enqueue a delivery on a schedule, from every process's dispatcher
  unschedule NAME        remove a schedule
  schedules              list the schedules and their next ticks
  migrate                create or upgrade the schema
  dashboard [STORE-URL]  serve the web dashboard, /metrics and the JSON API
  help [COMMAND]         this help, or a command's

Every command takes:
]] .. STORE_HELP .. [[


stats, list, show, kick, cancel, purge, pause, resume, paused, limit, limits, schedule,
unschedule and schedules never create a schema: on a store
without one they fail (run `relaybus migrate` first); enqueue and migrate create it. An
option may be given once.

Environment:
  RELAYBUS_STORE    the store when --store is not given
  RELAYBUS_DASHBOARD_TOKEN  the dashboard's token when --token is not given
  RELAYBUS_LOG      what the library logs on stderr: debug, info (the default here: raises,
                    burials and lost leases are logged), warn, error or off; json
                    writes each line (at info) as one JSON object, for log shippers

Exit status: 0 success, 1 runtime failure, 2 usage error; a failure prints one line on
stderr. Run `relaybus COMMAND --help` for a command's options.]]

HELP.run = [[
Usage: relaybus run [--store URL] SCRIPT [ARGS...]

Runs the Lua script SCRIPT (`-` reads standard input) with ARGS as `...` and in the global
`arg` (arg[0] = SCRIPT), then runs the event loop while any dispatcher runs. `require
"relaybus"` works in the script. SIGINT or SIGTERM stops every dispatcher gracefully; a
second signal exits at once. Options must come before SCRIPT; everything after it is the
script's. --store sets RELAYBUS_STORE for the script.

Options:
  --store URL       sets RELAYBUS_STORE for the script
  -h, --help        this help]]

HELP.enqueue = [[
Usage: relaybus enqueue TOPIC [JSON] [OPTIONS]

Adds one delivery of TOPIC with the payload JSON (default {}) and prints its id. The text
is stored as given (store:enqueue_json), so numbers keep every digit. Creates the schema if
the store has none.

Options:
  --delay S         run no sooner than S seconds from now
  --key K           dedupe key: while a delivery of TOPIC with key K is pending or
                    processing, print its id and add nothing
  --replace         with --key: a pending delivery of TOPIC with key K gets JSON and the
                    options and keeps its id; a running one is left as it is (said on stderr)
  --group G         ordered group: deliveries of group G run one at a time, in order
  --after ID[,ID]   due only once these deliveries completed; cancelled when one of them
                    is buried or cancelled
  --max-attempts N  bury after N attempts (default 25)
]] .. STORE_HELP

HELP.stats = [[
Usage: relaybus stats [OPTIONS]

Prints the number of deliveries by status, how many are due, and the age of the oldest due.

Options:
  --topics          counts per topic and status instead (a table, or with --json an array)
  --json            print a JSON object instead of a table
]] .. STORE_HELP

HELP.list = [[
Usage: relaybus list [OPTIONS]

Lists deliveries, oldest first. Control characters in what the store holds are shown as
escapes (\x1b); --json keeps them in valid JSON.

Options:
  --status S        only pending, processing, completed, buried or cancelled deliveries
  --topic T         only deliveries of topic T
  --topic-prefix P  only deliveries whose topic starts with P
  --key K           only deliveries with the dedupe key K
  --error TEXT      only deliveries whose last error contains TEXT
  --limit N         at most N deliveries (default 100)
  --json            print a JSON array of delivery records instead of a table
]] .. STORE_HELP

HELP.show = [[
Usage: relaybus show ID [--json]

Prints delivery ID whole: its fields one a line, then its last error and the errors of its
last attempts with their times (line breaks kept, each line indented), and its payload as
JSON. Control characters are shown as escapes (\x1b).
--json prints its record as one JSON object instead. An ID with no delivery fails (exit 1).

Options:
  --json            print the record as JSON
]] .. STORE_HELP

HELP.kick = [[
Usage: relaybus kick ID
       relaybus kick --buried [--topic T]

Puts the buried or cancelled delivery ID, or every buried delivery, back to pending with its
attempts reset, and prints how many were requeued. Kicking an ID that is neither buried nor
cancelled fails (exit 1).

Options:
  --buried          every buried delivery
  --topic T         with --buried: every buried delivery of topic T only
]] .. STORE_HELP

HELP.cancel = [[
Usage: relaybus cancel ID
       relaybus cancel --all [--topic T] [--status pending|processing]

Cancels the pending or running delivery ID for good: it becomes cancelled and never runs
(unless kicked). A running handler sees ctx.signal.reason "cancelled" (on PostgreSQL at
once, in any process; elsewhere at its next lease renewal) and nothing it writes afterwards
is applied. Prints "cancelled ID"; an ID that is not pending or processing fails (exit 1).
With --all, cancels every pending and running delivery (of topic T, of that status only)
and prints how many.

Options:
  --all             every live delivery (with --topic and --status: of those only)
  --topic T         with --all: of topic T only
  --status S        with --all: pending or processing only
]] .. STORE_HELP

HELP.purge = [[
Usage: relaybus purge --completed|--buried|--cancelled --older-than S [--topic T]

Deletes completed, buried or cancelled deliveries (any of them) settled more than S seconds
ago and prints how many were deleted.

Options:
  --completed       delete completed deliveries
  --buried          delete buried deliveries
  --cancelled       delete cancelled deliveries
  --older-than S    only those older than S seconds (required; 0 for all)
  --topic T         only those of topic T
]] .. STORE_HELP

HELP.pause = [[
Usage: relaybus pause TOPIC

Pauses TOPIC for every process on the store, durably: no dispatcher starts a delivery of it
until `relaybus resume TOPIC`. What runs now runs on; what is pending stays pending, its
attempts untouched, and enqueues go on. Prints whether it was paused now or already.

Options:
]] .. STORE_HELP

HELP.resume = [[
Usage: relaybus resume TOPIC

Resumes a paused TOPIC: its due deliveries start again (PostgreSQL wakes idle dispatchers at
once; elsewhere they see it at their next poll). Prints whether it was resumed now or was
not paused.

Options:
]] .. STORE_HELP

HELP.limit = [[
Usage: relaybus limit TOPIC [--rate N --per S] [--concurrency M]
       relaybus limit TOPIC --clear

Limits TOPIC for every process on the store, durably: in any window of S seconds at most N
of its deliveries start (a sliding window), and at most M run at once. A delivery held back
waits pending: no attempt is counted. The limits given replace the topic's; --clear removes
them. Not on MongoDB yet.

Options:
  --rate N          at most N starts per --per S seconds (1 to 1,000,000,000)
  --per S           the window of --rate, in seconds (above 0)
  --concurrency M   at most M running at once (1 to 1,000,000,000)
  --clear           remove the topic's limits
]] .. STORE_HELP

HELP.limits = [[
Usage: relaybus limits [--json]

Lists the limited topics and their limits (with --json, a JSON array of {topic, rate, per,
concurrency}).

Options:
  --json            print a JSON array
]] .. STORE_HELP

HELP.schedule = [[
Usage: relaybus schedule NAME --topic T (--cron SPEC [--timezone TZ] | --every S) [--payload JSON]

Makes or replaces the durable schedule NAME: every running dispatcher on the store takes part,
and each tick is enqueued once, as a delivery of T with the payload (default {}) and the key
NAME@TIME. After downtime one tick catches up, not every tick missed. A schedule replaced with
the same timing keeps its next tick. Prints when that is.

Options:
  --topic T         the topic of the deliveries
  --cron SPEC       5 fields (minute hour day month weekday), or 6 with seconds first;
                    @hourly, @daily, @weekly, @monthly, @yearly
  --timezone TZ     the zone of --cron's times, from the system's tz database (default UTC)
  --every S         every S seconds (at least 1)
  --payload JSON    the deliveries' payload, stored as given
]] .. STORE_HELP

HELP.unschedule = [[
Usage: relaybus unschedule NAME

Removes the schedule NAME. Deliveries it already enqueued stay.
]] .. STORE_HELP

HELP.schedules = [[
Usage: relaybus schedules [--json]

Lists the schedules, by name, with their next tick (UTC) and when one was last fired (with
--json, a JSON array of {name, topic, payload, cron, every, timezone, next_at, fired_at}).

Options:
  --json            print a JSON array
]] .. STORE_HELP

HELP.paused = [[
Usage: relaybus paused [--json]

Lists the paused topics, one per line (with --json, a JSON array of their names).

Options:
  --json            print a JSON array
]] .. STORE_HELP

HELP.migrate = [[
Usage: relaybus migrate [OPTIONS]

Creates or upgrades the store's schema.

Options:
]] .. STORE_HELP

------------------------------------------------------------------------------------------
-- Parsing: argv -> a command table, or a usage error. Runs nothing.

-- Option kinds: "flag", "string" (not empty), "store", "table", "seconds" (a decimal number
-- from 0 to MAX_SECONDS), "count" (a whole number from 1 to MAX_COUNTS[name] or MAX_COUNT).
local COMMON = { store = "store", table = "table", help = "flag" }

local SPECS = {
  run = { options = { store = "store", help = "flag" }, stop_at_positional = true },
  enqueue = { options = { delay = "seconds", key = "string", group = "string",
                          replace = "flag", ["max-attempts"] = "count", after = "string" } },
  stats = { options = { json = "flag", topics = "flag" } },
  list = { options = { status = "string", topic = "string", limit = "count", json = "flag",
                       ["topic-prefix"] = "string", key = "string", error = "string" } },
  show = { options = { json = "flag" } },
  kick = { options = { buried = "flag", topic = "string" } },
  cancel = { options = { all = "flag", topic = "string", status = "string" } },
  purge = { options = { completed = "flag", buried = "flag", cancelled = "flag",
                        ["older-than"] = "seconds", topic = "string" } },
  pause = { options = {} },
  resume = { options = {} },
  paused = { options = { json = "flag" } },
  limit = { options = { rate = "count", per = "seconds", concurrency = "count", clear = "flag" } },
  limits = { options = { json = "flag" } },
  schedule = { options = { topic = "string", cron = "string", timezone = "string",
                           every = "seconds", payload = "string" } },
  unschedule = { options = {} },
  schedules = { options = { json = "flag" } },
  migrate = { options = {} },
  dashboard = { options = { listen = "string", token = "string" } },
}

local function decimal(v)
  return v:match("^%d+%.?%d*$") or v:match("^%.%d+$")
    or v:match("^%d+%.?%d*[eE][-+]?%d+$") or v:match("^%.%d+[eE][-+]?%d+$")
end

local function check_value(cmd, name, kind, v)
  if kind == "seconds" then
    if v:match("^%-") then usage("%s: --%s must not be negative, got '%s'", cmd, name, show_arg(v)) end
    local n = decimal(v) and tonumber(v)
    if not n or not finite(n) then
      usage("%s: --%s needs a number of seconds, got '%s'", cmd, name, show_arg(v))
    end
    if n > MAX_SECONDS then
      usage("%s: --%s must be at most %d seconds (100 years), got '%s'", cmd, name,
            math.floor(MAX_SECONDS), show_arg(v))
    end
    return n
  elseif kind == "count" then
    local max = MAX_COUNTS[name] or MAX_COUNT
    local n = v:match("^%d+$") and #v <= 10 and math.tointeger(tonumber(v))
    if not n or n < 1 or n > max then
      usage("%s: --%s needs a whole number from 1 to %d, got '%s'", cmd, name, max, show_arg(v))
    end
    return n
  elseif kind == "table" then
    if not v:match("^[%a_][%w_]*$") or #v > 63 then
      usage("%s: --table needs a name of letters, digits and _ (at most 63, not starting "
            .. "with a digit), got '%s'", cmd, show_arg(v))
    end
  elseif v == "" then
    usage("%s: --%s must not be empty", cmd, name)
  end
  return v
end

-- Parses args[first..args.n] against the command's options; returns options and the
-- positional arguments. stop_at_positional: the first positional argument ends the options
-- (for `run`: the rest is the script's).
local function parse_options(cmd, args, first, spec)
  local opts, pos = {}, {}
  local allowed = spec.options
  local i = first
  while i <= args.n do
    local a = args[i]
    if a == "--" then
      for j = i + 1, args.n do pos[#pos + 1] = args[j] end
      break
    elseif a == "-h" or a == "--help" then
      opts.help = true
    elseif a:sub(1, 2) == "--" and #a > 2 then
      local name, value = a:match("^%-%-([^=]+)=(.*)$")
      name = name or a:sub(3)
      local kind = allowed[name] or (cmd ~= "run" and COMMON[name])
      if not kind then
        usage("%s: unknown option --%s (see relaybus %s --help)", cmd, show_arg(name), cmd)
      end
      if opts[name] ~= nil then usage("%s: --%s given twice", cmd, name) end
      if kind == "flag" then
        if value then usage("%s: --%s takes no value", cmd, name) end
        opts[name] = true
      else
        if not value then
          -- `--store --json` lacks the URL; it does not name a store called "--json"
          value = args[i + 1]
          if value == nil or (value:sub(1, 2) == "--" and #value > 2) then
            usage("%s: --%s needs a value", cmd, name)
          end
          i = i + 1
        end
        opts[name] = check_value(cmd, name, kind, value)
      end
    elseif a:sub(1, 1) == "-" and #a > 1 then
      usage("%s: unknown option %s (see relaybus %s --help)", cmd, show_arg(a), cmd)
    else
      pos[#pos + 1] = a
      if spec.stop_at_positional then
        for j = i + 1, args.n do pos[#pos + 1] = args[j] end
        break
      end
    end
    i = i + 1
  end
  return opts, pos
end

local function max_args(cmd, pos, n)
  if #pos > n then usage("%s: unexpected argument '%s'", cmd, show_arg(pos[n + 1])) end
end

local STATUSES = { pending = true, processing = true, completed = true, buried = true, cancelled = true }

HELP.dashboard = [[
Usage: relaybus dashboard [--listen HOST:PORT] [--token T] [STORE-URL]

Serves the web dashboard of the store (counts, a chart, deliveries, kick/bury/delete),
Prometheus metrics at /metrics and the JSON API under /api/, and prints its URL. Runs until
SIGINT or SIGTERM, then stops gracefully. Without a token it is read-only: actions answer
403. With one (--token, else $RELAYBUS_DASHBOARD_TOKEN; at least 8 characters) actions
need the header `Authorization: Bearer T`.

Options:
  --listen HOST:PORT  the address (default 127.0.0.1:8480; [::1]:PORT for IPv6; port 0
                      picks a free one). Anything but loopback exposes it to the network.
  --token T           the token that allows actions
]] .. STORE_HELP

-- What each command needs beyond its options; fills c from the positional arguments.
local CHECKS = {}

function CHECKS.run(c, pos)
  c.script = pos[1]
  if not c.script then usage("run: missing SCRIPT (see relaybus run --help)") end
  if c.script == "" then usage("run: SCRIPT must not be empty") end
  c.script_args = table.move(pos, 2, #pos, 1, {})
end

function CHECKS.enqueue(c, pos)
  c.topic = pos[1]
  if not c.topic then usage("enqueue: missing TOPIC (see relaybus enqueue --help)") end
  if c.topic == "" then usage("enqueue: TOPIC must not be empty") end
  max_args("enqueue", pos, 2)
  -- The text is stored as given (enqueue_json); it is checked here, so a payload that is not
  -- JSON is a usage error whatever the store.
  c.text = pos[2] or "{}"
  local ok, v, err = pcall(json.decode, c.text)
  if not ok then err = v end
  if not ok or (v == nil and err ~= nil) then
    usage("enqueue: invalid JSON payload: %s", show(err, SHOWN_MAX, true))
  end
end

function CHECKS.stats(c, pos) max_args("stats", pos, 0) end

function CHECKS.list(c, pos)
  max_args("list", pos, 0)
  local st = c.opts.status
  if st and not STATUSES[st] then
    usage("list: --status must be pending, processing, completed, buried or cancelled, got '%s'", show_arg(st))
  end
end

function CHECKS.kick(c, pos)
  max_args("kick", pos, 1)
  c.id = pos[1]
  if c.opts.topic and not c.opts.buried then usage("kick: --topic goes with --buried") end
  if c.opts.buried and c.id then usage("kick: give an ID or --buried, not both") end
  if not c.opts.buried and not c.id then usage("kick: missing ID or --buried (see relaybus kick --help)") end
  if c.id == "" then usage("kick: ID must not be empty") end
end

-- The one argument of a command (its ID, its TOPIC) into c[field]: there, and not empty.
local function one_arg(cmd, c, pos, field, name)
  max_args(cmd, pos, 1)
  c[field] = pos[1]
  if not c[field] then usage("%s: missing %s (see relaybus %s --help)", cmd, name, cmd) end
  if c[field] == "" then usage("%s: %s must not be empty", cmd, name) end
end

function CHECKS.show(c, pos) one_arg("show", c, pos, "id", "ID") end
function CHECKS.cancel(c, pos)
  local o = c.opts
  if not o.all then
    if o.topic or o.status then usage("cancel: --topic and --status go with --all") end
    return one_arg("cancel", c, pos, "id", "ID")
  end
  max_args("cancel", pos, 0)
  if o.status and o.status ~= "pending" and o.status ~= "processing" then
    usage("cancel: --status must be pending or processing, got '%s'", show_arg(o.status))
  end
end

function CHECKS.purge(c, pos)
  max_args("purge", pos, 0)
  if not c.opts.completed and not c.opts.buried and not c.opts.cancelled then
    usage("purge: say what to delete: --completed, --buried and/or --cancelled (see relaybus purge --help)")
  end
  if c.opts["older-than"] == nil then usage("purge: missing --older-than S (0 for all)") end
end

function CHECKS.pause(c, pos) one_arg("pause", c, pos, "topic", "TOPIC") end
function CHECKS.resume(c, pos) one_arg("resume", c, pos, "topic", "TOPIC") end
function CHECKS.paused(c, pos) max_args("paused", pos, 0) end
function CHECKS.limit(c, pos)
  one_arg("limit", c, pos, "topic", "TOPIC")
  local o = c.opts
  local set = o.rate or o.per or o.concurrency
  if o.clear and set then usage("limit: --clear takes no other limit") end
  if not o.clear and not set then
    usage("limit: say the limits (--rate N --per S, --concurrency M) or --clear (see relaybus limit --help)")
  end
  if (o.rate == nil) ~= (o.per == nil) then usage("limit: --rate and --per go together") end
  if o.per and o.per < 0.001 then usage("limit: --per must be at least 0.001 seconds") end
end
function CHECKS.limits(c, pos) max_args("limits", pos, 0) end
function CHECKS.schedule(c, pos)
  one_arg("schedule", c, pos, "sname", "NAME")
  local o = c.opts
  if not o.topic then usage("schedule: missing --topic T (see relaybus schedule --help)") end
  if (o.cron == nil) == (o.every == nil) then usage("schedule: give --cron SPEC or --every S") end
  if o.timezone and not o.cron then usage("schedule: --timezone goes with --cron") end
  if o.payload then
    local ok, v, err = pcall(json.decode, o.payload)
    if not ok then err = v end
    if not ok or (v == nil and err ~= nil) then
      usage("schedule: invalid JSON payload: %s", show(err, SHOWN_MAX, true))
    end
  end
end
function CHECKS.unschedule(c, pos) one_arg("unschedule", c, pos, "sname", "NAME") end
function CHECKS.schedules(c, pos) max_args("schedules", pos, 0) end

function CHECKS.migrate(c, pos) max_args("migrate", pos, 0) end

function CHECKS.dashboard(c, pos)
  max_args("dashboard", pos, 1)
  if pos[1] then
    if c.store then usage("dashboard: give the store as --store or as STORE-URL, not both") end
    if pos[1] == "" then usage("dashboard: STORE-URL must not be empty") end
    c.store = pos[1]
  end
  local l = c.opts.listen
  if l and not l:match("^.+:%d+$") then
    usage("dashboard: --listen must be HOST:PORT, got '%s'", show_arg(l))
  end
  if c.opts.token and #c.opts.token < 8 then usage("dashboard: --token must be at least 8 characters") end
end

local function parse_argv(args)
  local given = args
  args = { n = given.n or #given }
  for i = 1, args.n do
    local a = given[i]
    args[i] = a
    if type(a) ~= "string" then usage("argument %d is not a string", i) end
    -- C strings end at a NUL: what reached the store would not be what was given
    if a:find("\0", 1, true) then usage("argument %d contains a NUL byte", i) end
  end
  -- Options before the command (relaybus --store URL stats) apply to it.
  local pre = {}
  local i = 1
  while i <= args.n and args[i]:sub(1, 1) == "-" do
    local a = args[i]
    if a == "-h" or a == "--help" then return { name = "help", topic = "main" } end
    if a == "--version" then return { name = "version" } end
    local name, value = a:match("^%-%-([^=]+)=(.*)$")
    name = name or a:match("^%-%-(.+)$")
    if not COMMON[name] or name == "help" then
      usage("unknown option %s (see relaybus --help)", show_arg(a))
    end
    if not value then
      value = args[i + 1]
      if value == nil or (value:sub(1, 2) == "--" and #value > 2) then
        usage("--%s needs a value", name)
      end
      i = i + 1
    end
    pre[#pre + 1] = "--" .. name .. "=" .. value
    i = i + 1
  end
  local name = args[i]
  if name == nil then usage("missing command (see relaybus --help)") end
  if name == "help" then
    local topic = args[i + 1]
    if args.n > i + 1 then usage("help: unexpected argument '%s'", show_arg(args[i + 2])) end
    if topic == nil then return { name = "help", topic = "main" } end
    if not SPECS[topic] then usage("help: unknown command '%s'", show_arg(topic)) end
    return { name = "help", topic = topic }
  end
  local spec = SPECS[name]
  if not spec then usage("unknown command '%s' (see relaybus --help)", show_arg(name)) end
  -- Global options go right before the command's own, so that both count as given.
  local cargs = { n = 0 }
  for _, v in ipairs(pre) do cargs.n = cargs.n + 1; cargs[cargs.n] = v end
  for j = i + 1, args.n do cargs.n = cargs.n + 1; cargs[cargs.n] = args[j] end
  local opts, pos = parse_options(name, cargs, 1, spec)
  if opts.help then return { name = "help", topic = name } end
  local c = { name = name, opts = opts, store = opts.store, table = opts.table }
  CHECKS[name](c, pos)
  return c
end

-- parse(argv): the command argv (an array, n = its length) asks for, or nil and the usage
-- message (one line). Any other error is a bug.
local function parse(args)
  local ok, c = pcall(parse_argv, args)
  if ok then return c end
  if getmetatable(c) == Exit then return nil, c.msg end
  error(c, 0)
end

if host == "module" then
  return { parse = parse, show = show, fmt_time = fmt_time, fmt_duration = fmt_duration,
           json_text = json_text, EXIT_USAGE = EXIT_USAGE }
end

------------------------------------------------------------------------------------------
-- Store access

local function store_url(c)
  local url = c.store or os.getenv("RELAYBUS_STORE")
  if url == nil or url == "" then url = DEFAULT_STORE end
  urls[#urls + 1] = url
  return url
end

-- Opens the command's store. Without migrate (the read-only commands) a store without the
-- schema fails, and nothing is created.
local function open_store(c, migrate)
  local url = store_url(c)
  local ok, store, err = pcall(relaybus.open, url, { table = c.table, migrate = migrate })
  if ok and store then return store end
  runtime("%s: cannot open store %s: %s", c.name, show_arg(url),
          show(scrub(tostring(ok and err or store or "unknown error")), nil, true))
end

-- Calls store:method(...); a runtime failure (nil, err), or a value the library refuses
-- (a raise), ends the command with exit 1.
local function call(c, store, method, ...)
  local r = table.pack(pcall(store[method], store, ...))
  local err = not r[1] and r[2] or r[2] == nil and (r[3] or "failed")
  if err then
    -- a misuse the library caught already names the call (schedule's "schedule: ...")
    err = tostring(err):gsub("^relaybus: ", ""):gsub("^" .. method .. ": ", "")
    runtime("%s: %s", c.name, show(scrub(err), nil, true))
  end
  return table.unpack(r, 2, r.n)
end

------------------------------------------------------------------------------------------
-- Commands

local commands = {}

function commands.help(c)
  io.stdout:write(HELP[c.topic], "\n")
  return EXIT_OK
end

function commands.version()
  io.stdout:write("relaybus ", relaybus._VERSION or "", "\n")
  return EXIT_OK
end

function commands.run(c)
  if c.store then
    urls[#urls + 1] = c.store
    host.setenv("RELAYBUS_STORE", c.store)
  end
  if os.getenv("RELAYBUS_STORE") then urls[#urls + 1] = os.getenv("RELAYBUS_STORE") end
  local script = c.script
  local chunk, err = loadfile(script ~= "-" and script or nil)
  if not chunk then runtime("%s", show(scrub(err), nil, true)) end

  -- The script's arguments, as lua5.4 gives them.
  local sarg = { [0] = script }
  for i, a in ipairs(c.script_args) do sarg[i] = a end
  sarg[-1] = "run"
  sarg[-2] = arg and arg[0] or "relaybus"
  _G.arg = sarg

  local ok, serr = xpcall(chunk, function(e)
    if type(e) == "string" then return e end
    local mt = getmetatable(e)
    if mt and mt.__tostring then
      local tok, text = pcall(tostring, e)    -- a __tostring that raises too
      if tok and type(text) == "string" then return text end
    end
    return "(error object is a " .. type(e) .. " value)"
  end, table.unpack(c.script_args))
  if not ok then
    -- a misuse error already starts with "relaybus: ": one prefix, not two
    local text = tostring(serr):gsub("^relaybus: ", "")
    io.stderr:write("relaybus: ", show(scrub(text), nil, true), "\n")
    io.stderr:flush()
    -- Stop what the script started, gracefully, before failing.
    host.stop_all()
    if host.busy() > 0 then pcall(relaybus.run) end
    return EXIT_FAIL
  end
  -- Keep running while the script left something running; a script that set up handlers and
  -- forgot to start them is told so.
  if host.busy() > 0 then
    relaybus.run()
  elseif relaybus._unstarted() > 0 then
    io.stderr:write("relaybus: the script made a dispatcher with handlers but never started it",
                    " (call d:start())\n")
  end
  return EXIT_OK
end

function commands.enqueue(c)
  if c.opts.replace and not c.opts.key then usage("enqueue: --replace needs --key") end
  local after
  if c.opts.after then
    after = {}
    for id in (c.opts.after .. ","):gmatch("([^,]*),") do
      if id == "" then usage("enqueue: --after takes ids separated by commas, got '%s'", show_arg(c.opts.after)) end
      after[#after + 1] = id
    end
  end
  local eopts = { delay = c.opts.delay, key = c.opts.key, group = c.opts.group,
                  replace = c.opts.replace or nil, max_attempts = c.opts["max-attempts"],
                  after = after }
  local store = open_store(c, true)
  local id, made = call(c, store, "enqueue_json", c.topic, c.text, eopts)
  io.stdout:write(show(id), "\n")
  if c.opts.replace and made == false then
    io.stderr:write("relaybus: enqueue: delivery ", show(id), " is running: left as it is\n")
  end
  store:close()
  return EXIT_OK
end

local STAT_KEYS = { "pending", "processing", "stalled", "completed", "buried", "cancelled", "due",
                    "oldest_due_age" }

function commands.stats(c)
  local store = open_store(c, false)
  if c.opts.topics then
    local rows = call(c, store, "_topic_stats")
    if c.opts.json then
      io.stdout:write(json_array(rows), "\n")
    else
      local out = {}
      for _, t in ipairs(rows) do
        out[#out + 1] = { show(t.topic, 40), fmt_int(t.pending), fmt_int(t.processing),
                          fmt_int(t.completed), fmt_int(t.buried), fmt_int(t.cancelled) }
      end
      print_table({ "TOPIC", "PENDING", "PROCESSING", "COMPLETED", "BURIED", "CANCELLED" }, out,
                  { "l", "r", "r", "r", "r", "r" })
      if #out == 0 then io.stderr:write("(no deliveries)\n") end
    end
    store:close()
    return EXIT_OK
  end
  local s = call(c, store, "stats")
  if c.opts.json then
    io.stdout:write(json_text(s), "\n")
  else
    local rows = {}
    for _, k in ipairs(STAT_KEYS) do
      local v = s[k]
      if k == "oldest_due_age" then
        v = (v and (tonumber(s.due) or 0) > 0) and fmt_duration(v) or "-"
      elseif k == "completed" and s.completed_estimated then
        v = "~" .. fmt_int(v or 0) .. " (estimated)"     -- a large table
      else
        v = fmt_int(v or 0)
      end
      rows[#rows + 1] = { k, v }
    end
    print_table({ "STATUS", "COUNT" }, rows, { "l", "r" })
  end
  store:close()
  return EXIT_OK
end

-- When a delivery runs (pending) or its lease ends (processing), from now.
local function fmt_due(d, now)
  if d.status == "pending" and d.waiting then
    return "after " .. fmt_int(d.waiting) .. (d.waiting == 1 and " dependency" or " dependencies")
  elseif d.status == "pending" then
    local wait = (tonumber(d.run_at) or now) - now
    return wait > 0 and ("in " .. fmt_duration(wait)) or "now"
  elseif d.status == "processing" then
    local left = (tonumber(d.lease_expires_at) or now) - now
    return left > 0 and ("lease " .. fmt_duration(left)) or "lease expired"
  end
  return "-"
end

function commands.list(c)
  local store = open_store(c, false)
  local rows = call(c, store, "list",
    { status = c.opts.status, topic = c.opts.topic, limit = c.opts.limit or 100,
      topic_prefix = c.opts["topic-prefix"], key = c.opts.key, error_text = c.opts.error })
  if c.opts.json then
    io.stdout:write(json_array(rows), "\n")
  else
    local now = relaybus.time()
    local out = {}
    for _, d in ipairs(rows) do
      out[#out + 1] = {
        show(d.id, 40), show(d.topic or "", 24), show(d.status or "?", 12),
        fmt_int(d.attempts) .. "/" .. fmt_int(d.max_attempts),
        fmt_int(d.fence), fmt_time(d.created_at), fmt_due(d, now),
        d.key and show(d.key, 20) or "-",
        d.last_error and show(d.last_error, 40, true) or "-",
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

function commands.kick(c)
  local store = open_store(c, false)
  local n
  if c.opts.buried then
    n = call(c, store, "kick", { status = "buried", topic = c.opts.topic })
  else
    n = call(c, store, "kick", c.id)
    if n == 0 then
      store:close()
      runtime("kick: delivery %s is not buried or cancelled, or does not exist", show_arg(c.id))
    end
  end
  io.stdout:write(fmt_int(n), "\n")
  store:close()
  return EXIT_OK
end

function commands.purge(c)
  local store = open_store(c, false)
  local total = 0
  for _, status in ipairs { "completed", "buried", "cancelled" } do
    if c.opts[status] then
      total = total + call(c, store, "purge", { status = status, older_than = c.opts["older-than"],
                                                topic = c.opts.topic })
    end
  end
  io.stdout:write(fmt_int(total), "\n")
  store:close()
  return EXIT_OK
end

function commands.show(c)
  local store = open_store(c, false)
  local ok, d, err = pcall(store.get, store, c.id)
  store:close()
  if not ok or (d == nil and err ~= nil) then
    runtime("show: %s", show(scrub(tostring(ok and err or d):gsub("^relaybus: ", "")), nil, true))
  end
  if d == nil then runtime("show: no delivery %s", show_arg(c.id)) end
  if c.opts.json then
    io.stdout:write(json_text(d), "\n")
    return EXIT_OK
  end
  local now = relaybus.time()
  local rows = {
    { "id", show(d.id, 80) }, { "topic", show(d.topic or "", 200) }, { "status", show(d.status or "?") },
    { "attempts", fmt_int(d.attempts) .. "/" .. fmt_int(d.max_attempts) }, { "fence", fmt_int(d.fence) },
    { "key", d.key and show(d.key, 200) or "-" },
    { "group", d.group and show(d.group, 200) or "-" },
    { "created (UTC)", fmt_time(d.created_at) }, { "run at (UTC)", fmt_time(d.run_at) },
    { "run", fmt_due(d, now) },
    { "lease expires", d.lease_expires_at and fmt_time(d.lease_expires_at) or "-" },
    { "settled (UTC)", d.settled_at and fmt_time(d.settled_at) or "-" },
    { "progress", d.progress ~= nil and show(json_text(d.progress), 200) or "-" },
  }
  print_table({ "FIELD", "VALUE" }, rows, { "l", "l" })
  local function lines(text, indent)
    for line in tostring(text):gmatch("[^\n]+") do io.stdout:write(indent, show(line), "\n") end
  end
  io.stdout:write("last error:", d.last_error and "\n" or " -\n")
  lines(d.last_error or "", "  ")
  local errors = type(d.errors) == "table" and d.errors or {}
  io.stdout:write("errors of the last attempts:", #errors > 0 and "\n" or " -\n")
  for _, e in ipairs(errors) do
    io.stdout:write("  attempt ", fmt_int(e.attempt), ", ", fmt_time(tonumber(e.at)), " (UTC):\n")
    lines(e.error or "", "    ")
  end
  io.stdout:write("payload:\n  ", d.payload_error and show(d.payload_error, nil, true) or json_text(d.payload), "\n")
  return EXIT_OK
end

function commands.cancel(c)
  local store = open_store(c, false)
  if c.opts.all then
    local all = not c.opts.topic and not c.opts.status or nil
    local n = call(c, store, "cancel", { topic = c.opts.topic, status = c.opts.status, all = all })
    store:close()
    io.stdout:write(fmt_int(n), "\n")
    return EXIT_OK
  end
  local cancelled = call(c, store, "cancel", c.id)
  store:close()
  if not cancelled then
    runtime("cancel: delivery %s is not pending or processing, or does not exist", show_arg(c.id))
  end
  io.stdout:write("cancelled ", show(c.id, 80), "\n")
  return EXIT_OK
end

-- pause and resume: what they print when they changed the topic, and when it already was so
local PAUSE_SAYS = { pause = { "paused ", "already paused: " }, resume = { "resumed ", "not paused: " } }

local function pause_or_resume(c)
  local store = open_store(c, false)
  local changed = call(c, store, c.name, c.topic)
  io.stdout:write(PAUSE_SAYS[c.name][changed and 1 or 2], show(c.topic, 80), "\n")
  store:close()
  return EXIT_OK
end
commands.pause = pause_or_resume
commands.resume = pause_or_resume

function commands.paused(c)
  local store = open_store(c, false)
  local topics = call(c, store, "paused")
  if c.opts.json then
    io.stdout:write(json_array(topics), "\n")
  else
    for _, t in ipairs(topics) do io.stdout:write(show(t, 200), "\n") end
    if #topics == 0 then io.stderr:write("(no paused topics)\n") end
  end
  store:close()
  return EXIT_OK
end

function commands.limit(c)
  local store = open_store(c, false)
  local lim = not c.opts.clear and { rate = c.opts.rate, per = c.opts.per,
                                      concurrency = c.opts.concurrency } or nil
  call(c, store, "limit", c.topic, lim)
  io.stdout:write(lim and "limited " or "no limits: ", show(c.topic, 80), "\n")
  store:close()
  return EXIT_OK
end

function commands.limits(c)
  local store = open_store(c, false)
  local rows = call(c, store, "limits")
  if c.opts.json then
    io.stdout:write(json_array(rows), "\n")
  else
    local out = {}
    for _, l in ipairs(rows) do
      out[#out + 1] = { show(l.topic, 40), l.rate and (fmt_int(l.rate) .. " per " .. fmt_duration(l.per)) or "-",
                        l.concurrency and fmt_int(l.concurrency) or "-" }
    end
    print_table({ "TOPIC", "RATE", "CONCURRENCY" }, out, { "l", "r", "r" })
    if #out == 0 then io.stderr:write("(no limited topics)\n") end
  end
  store:close()
  return EXIT_OK
end

function commands.schedule(c)
  local o = c.opts
  local store = open_store(c, false)
  local _, made = call(c, store, "schedule", c.sname, { topic = o.topic, cron = o.cron,
                       every = o.every, timezone = o.timezone, payload_json = o.payload or "{}" })
  local next_at
  for _, s in ipairs(call(c, store, "schedules")) do
    if s.name == c.sname then next_at = s.next_at end
  end
  store:close()
  io.stdout:write(made and "scheduled " or "replaced ", show(c.sname, 80), ": next tick ",
                  fmt_time(next_at), " UTC\n")
  return EXIT_OK
end

function commands.unschedule(c)
  local store = open_store(c, false)
  local removed = call(c, store, "unschedule", c.sname)
  store:close()
  if not removed then runtime("unschedule: no schedule %s", show_arg(c.sname)) end
  io.stdout:write("unscheduled ", show(c.sname, 80), "\n")
  return EXIT_OK
end

-- A schedule's timing for a person: "cron 0 3 * * * (Europe/Berlin)" or "every 5m00s".
local function fmt_timing(s)
  if s.cron then return "cron " .. show(s.cron, 60) .. (s.timezone and (" (" .. show(s.timezone, 40) .. ")") or "") end
  return "every " .. fmt_duration(s.every)
end

function commands.schedules(c)
  local store = open_store(c, false)
  local rows = call(c, store, "schedules")
  store:close()
  if c.opts.json then
    io.stdout:write(json_array(rows), "\n")
    return EXIT_OK
  end
  local out = {}
  for _, s in ipairs(rows) do
    out[#out + 1] = { show(s.name, 40), show(s.topic, 40), fmt_timing(s), fmt_time(s.next_at),
                      s.fired_at and fmt_time(s.fired_at) or "-" }
  end
  print_table({ "NAME", "TOPIC", "WHEN", "NEXT (UTC)", "LAST FIRED (UTC)" }, out,
              { "l", "l", "l", "l", "l" })
  if #out == 0 then io.stderr:write("(no schedules)\n") end
  return EXIT_OK
end

function commands.migrate(c)
  local store = open_store(c, true)
  store:close()
  io.stdout:write("schema up to date: ", show_arg(urls[#urls]), "\n")
  return EXIT_OK
end

function commands.dashboard(c)
  local store = open_store(c, false)
  local ok, srv, err = pcall(relaybus.serve, { store = store, listen = c.opts.listen,
                                                token = c.opts.token })
  if not ok or not srv then
    store:close()
    runtime("dashboard: %s", show(scrub((tostring(ok and err or srv):gsub("^relaybus: ", ""))), nil, true))
  end
  local token = c.opts.token or os.getenv("RELAYBUS_DASHBOARD_TOKEN")
  io.stdout:write("relaybus dashboard: ", srv:url(),
                  (token and token ~= "") and "" or " (read-only: no token)", "\n")
  io.stdout:flush()
  relaybus.run()      -- until SIGINT/SIGTERM stops the server
  store:close()
  return EXIT_OK
end

------------------------------------------------------------------------------------------
-- Entry

local function main()
  local c, msg = parse(argv)
  if not c then fail(EXIT_USAGE, "%s", msg) end
  return commands[c.name](c)
end

local ok, status = pcall(main)
if ok then
  io.stdout:flush()
  return status
end
io.stdout:flush()
if getmetatable(status) == Exit then
  io.stderr:write("relaybus: ", scrub(status.msg), "\n")
  return status.status
end
-- A bug: still one line, and no secret in it.
io.stderr:write("relaybus: ", show(scrub(tostring(status)), nil, true), "\n")
return EXIT_FAIL
