-- quickstart.lua -- relaybus's main job on the embedded default store (SQLite), ending by itself:
-- enqueue ~200 deliveries on three topics, run handlers of which some fail and are retried and
-- one topic always fails and is buried, show progress every second, then print a summary.
--   build/relaybus run examples/quickstart.lua
local relaybus = require "relaybus"

-- A fresh store file each run.
local path = "quickstart.db"
for _, suffix in ipairs { "", "-wal", "-shm" } do os.remove(path .. suffix) end
local store = assert(relaybus.open("sqlite:" .. path))

math.randomseed(os.time())
local t0 = relaybus.now()

-- 1. Enqueue. Emails one by one; invoices in one round trip with enqueue_many; and a legacy
-- sync whose endpoint is gone, so it fails every time and is buried after 3 attempts.
local EMAILS, INVOICES, SYNCS = 90, 100, 10
for i = 1, EMAILS do
  assert(store:enqueue("email.welcome", { to = ("user%03d@example.com"):format(i) }))
end
local batch = {}
for i = 1, INVOICES do
  batch[#batch + 1] = { "invoice.render", { invoice = 1000 + i, amount = i * 7.5 } }
end
assert(store:enqueue_many(batch))
for i = 1, SYNCS do
  assert(store:enqueue("legacy.sync", { account = i }, { max_attempts = 3 }))
end
print(("enqueued %d deliveries on 3 topics into %s"):format(EMAILS + INVOICES + SYNCS, path))

-- 2. The dispatcher and its handlers. A handler that returns completes its delivery; one that
-- raises is retried after backoff(attempts) seconds, and buried once max_attempts is reached.
local d = relaybus.dispatcher(store, {
  concurrency = 16,
  lease_duration = 10,
  poll_interval = 0.2,
  backoff = function(attempts) return 0.2 * attempts end,
})

local runs, retries = 0, 0
local function count(delivery)
  runs = runs + 1
  if delivery.attempts > 1 then retries = retries + 1 end
end

d:handle("email.welcome", function(delivery, ctx)
  count(delivery)
  ctx:sleep(0.01 + math.random() * 0.04)            -- talking to the mail server
  if math.random() < 0.25 then error("SMTP 451: try again later") end
end)

d:handle("invoice.render", function(delivery, ctx)
  count(delivery)
  ctx:sleep(0.02 + math.random() * 0.05)            -- rendering a PDF
  if math.random() < 0.15 then error("renderer busy") end
end)

d:handle("legacy.sync", function(delivery, ctx)
  count(delivery)
  ctx:sleep(0.01)
  error("legacy endpoint answered 410 Gone")
end)

d:start()

-- 3. Progress once a second; stop when nothing is pending or processing.
relaybus.spawn(function()
  local last = 0
  while true do
    relaybus.sleep(0.25)
    local s = assert(store:stats())
    local done = s.pending == 0 and s.processing == 0
    local now = relaybus.now() - t0
    if now - last >= 1 or done then
      last = now
      print(("[%5.1fs] pending %3d  processing %2d  completed %3d  buried %2d  retries %3d")
        :format(now, s.pending, s.processing, s.completed, s.buried, retries))
    end
    if done then break end
  end
  d:stop()
end)

relaybus.run()   -- runs the loop until the dispatcher has stopped

-- 4. Summary.
local s = assert(store:stats())
local elapsed = relaybus.now() - t0
print(("done in %.1fs: %d completed, %d buried, %d retries, %d handler runs (%.0f runs/s)")
  :format(elapsed, s.completed, s.buried, retries, runs, runs / elapsed))
for _, b in ipairs(assert(store:list { status = "buried", limit = 3 })) do
  print(("  buried %s %s after %d attempts: %s"):format(b.id, b.topic, b.attempts, b.last_error))
end
if s.buried > 0 then
  print("  (requeue them with: build/relaybus --store sqlite:" .. path .. " kick --buried)")
end
store:close()
