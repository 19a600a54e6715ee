-- browser_spec.lua -- the dashboard in headless Chromium (spec/support/browser.js, with
-- playwright-core from scripts/install-deps.sh's node cache): counts, the XSS topic as text,
-- filter to buried, open one, kick it with the token, see it pending, cancel it. Screenshots are saved
-- under artifacts/ (gitignored). With CI=true a missing browser or playwright is a failure.
local S = require "spec.support.stores"
local D = require "spec.support.dash"
local ci = os.getenv("CI") == "true" or os.getenv("CI") == "1"
local node_cache = os.getenv("RELAYBUS_NODE_CACHE") or ((os.getenv("HOME") or "") .. "/.cache/relaybus-node")
local chromium = os.getenv("RELAYBUS_CHROMIUM") or "/usr/bin/chromium"

local function missing()
  if not os.execute("command -v node >/dev/null 2>&1") then return "node" end
  if not S.exists(chromium) then return chromium end
  if not S.exists(node_cache .. "/node_modules/playwright-core/package.json") then
    return "playwright-core in " .. node_cache
  end
end

describe("the dashboard in a browser", function()
  after_each(function() S.reset() end)

  for _, entry in ipairs(S.list()) do
    it("filters to buried, opens one, kicks it with the token, sees it pending and cancels it on " .. entry.name, function()
      local why = missing()
      if why and not ci then pending(why .. " missing: run scripts/install-deps.sh") return end
      assert.is_nil(why, "missing: " .. tostring(why) .. " (scripts/install-deps.sh installs it)")
      local url, opts = entry.url()
      local args = { S.support .. "/dash_server.lua", url, D.TOKEN }
      local p = S.spawn(nil, nil, { argv = { S.bin, "run", args[1], args[2], args[3] },
                                    env = opts.table and { RELAYBUS_SPEC_TABLE = opts.table } or nil })
      assert.truthy(S.wait_for(function() return (S.read(p.out) or ""):match("http://%S+") end, 60),
                    "no server: " .. tostring(S.read(p.err)))
      local base = S.read(p.out):match("(http://%S+)")
      local out = os.getenv("PWD") .. "/artifacts/browser-" .. entry.name
      os.execute("mkdir -p " .. S.quote(out))
      local cmd = S.foreign(string.format("NODE_PATH=%s timeout 180 node %s %s %s %s 2>&1", S.quote(node_cache .. "/node_modules"),
                                S.quote(S.support .. "/browser.js"), S.quote(base), S.quote(D.TOKEN), S.quote(out)))
      local f = io.popen(cmd)
      local text = f:read("a")
      f:close()
      S.signal(p, "TERM")
      local line = text:match("(%b{})%s*$")
      assert.truthy(line, "browser.js said: " .. text)
      local r = S.relaybus().json.decode(line)
      assert.is_nil(r.failure, text)
      assert.same({ "overview", "filtered", "opened", "kicked", "cancelled", "kicked topic", "bulk", "permalink" }, r.steps)
      assert.same({ { "pending", "5" }, { "processing", "1" }, { "completed", "24" }, { "buried", "3" } }, r.counts)
      assert.is_true(r.xss_text, "the XSS topic shows as text")
      assert.same({ { "<b>nightly</b>", "reports.nightly", "cron 0 3 * * * (Europe/Berlin)" },
                    { "heartbeat", "ops.heartbeat", "every 1 h" } }, r.schedules)
      assert.equal(0, r.images, "no element was made from data")
      assert.same({}, r.dialogs, "no script from data ran")
      assert.same({}, r.external, "nothing fetched from elsewhere")
      assert.same({}, r.errors)
      assert.matches('"amount"', r.payload)
      assert.matches("\n", r.payload, 1, true)    -- pretty-printed
      assert.matches("card declined: insufficient funds <b>42</b>", r.last_error, 1, true)
      assert.matches("kick: this action needs Authorization", r.without_token, 1, true)
      assert.matches("delete: this action needs Authorization", r.delete_refused, 1, true)
      assert.is_true(r.detail_shown, "a refused delete hid the delivery and its error")
      assert.equal("kick: done (1)", r.with_token)
      assert.equal("pending", r.after_kick)
      assert.is_true(r.cancel_enabled, "the cancel button of a pending delivery is disabled")
      assert.equal("cancel: done (1)", r.cancelled)
      assert.is_true(r.kick_enabled_after, "a cancelled delivery cannot be kicked from the page")
      -- the bulk kick names the filter, asks first, and kicks only that topic's
      assert.equal("confirm: kick all buried of topic \u{201c}no.such.topic\u{201d}?", r.kick_other.asked)
      assert.is_true(r.kick_other.untouched, "the first click kicked without asking")
      assert.equal("kick all buried of topic \u{201c}no.such.topic\u{201d}: done (0)", r.kick_other.said)
      assert.equal("2", r.buried_after_other)
      assert.equal("kick all buried of topic \u{201c}payments.charge\u{201d}: done (2)", r.kick_topic.said)
      -- cancel all and delete all: the filter named, asked first
      assert.is_true(r.delete_disabled_for_pending)
      assert.equal("confirm: cancel all pending of topic \u{201c}email.send\u{201d}?", r.cancel_pending.asked)
      assert.equal("cancel all pending of topic \u{201c}email.send\u{201d}: done (4)", r.cancel_pending.said)
      assert.equal("confirm: delete all cancelled of topic \u{201c}email.send\u{201d}?", r.delete_cancelled.asked)
      assert.equal("delete all cancelled of topic \u{201c}email.send\u{201d}: done (4)", r.delete_cancelled.said)
      assert.is_true(r.bulk_disabled_when_searching, "a bulk action took a search it does not apply")
      -- one delivery by id and by its link; its errors, each with its lines
      assert.equal("#delivery=" .. r.id, r.hash)
      assert.equal(1, #r.errors_listed)
      assert.matches("card declined: insufficient funds <b>42</b>", r.errors_listed[1], 1, true)
      assert.equal("#delivery=" .. r.id, r.permalink)
      assert.is_true(r.permalink_visible)
      assert.equal("cancelled", r.permalink_status)
      assert.is_true(r.bad_hash_hidden, "a bad link opened something")
      assert.truthy(S.exists(out .. "/dashboard.png"))
      assert.truthy(S.wait_for(function() return S.rc(p) end, 20))
    end)
  end
end)
