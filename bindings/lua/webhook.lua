-- webhook.lua -- relaybus.webhook{...}: a handler that POSTs each delivery's payload as JSON
-- and settles by the answer: 2xx completes; 408, 429, 5xx and network failures retry with
-- backoff, no sooner than Retry-After; any other status buries with the status and body start.
return function(relaybus)
  local http, json = relaybus.http, relaybus.json

  local known = { url = true, headers = true, timeout = true, secret = true, backoff = true,
                  max_body = true }

  local function misuse(fmt, ...)
    error("relaybus: webhook: " .. string.format(fmt, ...), 0)
  end

  local function check_opts(opts)
    if type(opts) ~= "table" then misuse("options must be a table") end
    for k in pairs(opts) do
      if not known[k] then misuse("unknown option '%s'", tostring(k)) end
    end
    if type(opts.url) ~= "string" then misuse("'url' is required (a string)") end
    local kinds = { headers = "table", timeout = "number", secret = "string",
                    backoff = "function", max_body = "number" }
    for k, kind in pairs(kinds) do
      if opts[k] ~= nil and type(opts[k]) ~= kind then misuse("'%s' must be a %s", k, kind) end
    end
  end

  local function default_backoff(attempts)
    return math.min(2 ^ attempts, 3600)
  end

  -- Days since 1970-01-01 of a civil date (proleptic Gregorian), so an HTTP-date converts
  -- to epoch seconds without os.time's local-time interpretation.
  local function days_from_civil(y, m, d)
    if m <= 2 then y = y - 1 end
    local era = (y >= 0 and y or y - 399) // 400
    local yoe = y - era * 400
    local doy = (153 * (m > 2 and m - 3 or m + 9) + 2) // 5 + d - 1
    local doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468
  end

  local months = { Jan = 1, Feb = 2, Mar = 3, Apr = 4, May = 5, Jun = 6,
                   Jul = 7, Aug = 8, Sep = 9, Oct = 10, Nov = 11, Dec = 12 }

  -- Retry-After in seconds from now: delta-seconds or an IMF-fixdate; nil when absent or bad.
  local function retry_after(headers)
    local v = headers and headers["retry-after"]
    if not v then return nil end
    local n = tonumber(v)
    if n then return math.max(n, 0) end
    local d, mon, y, hh, mm, ss = v:match("^%a+, (%d+) (%a+) (%d+) (%d+):(%d+):(%d+) GMT$")
    if not (d and months[mon]) then return nil end
    local at = days_from_civil(tonumber(y), months[mon], tonumber(d)) * 86400
               + tonumber(hh) * 3600 + tonumber(mm) * 60 + tonumber(ss)
    local now = relaybus.time and relaybus.time() or os.time()
    return math.max(at - now, 0)
  end

  local function retryable(status)
    return status == 408 or status == 429 or (status >= 500 and status <= 599)
  end

  local function request_headers(opts, delivery, body)
    local h, has_type = {}, false
    for k, v in pairs(opts.headers or {}) do
      local lk = tostring(k):lower()
      if lk == "content-type" then has_type = true end
      -- ours below win over a caller's spelling of the same name
      if not lk:match("^x%-relaybus%-") then h[k] = v end
    end
    if not has_type then h["Content-Type"] = "application/json" end
    h["X-Relaybus-Id"] = tostring(delivery.id)
    h["X-Relaybus-Topic"] = tostring(delivery.topic)
    h["X-Relaybus-Attempt"] = tostring(delivery.attempts)
    if opts.secret then
      h["X-Relaybus-Signature"] = "sha256=" .. http.hmac_sha256(opts.secret, body)
    end
    return h
  end

  -- Retry, unless this was the last attempt: then bury now, keeping the reason.
  local function retry(opts, delivery, ctx, reason, not_before)
    if delivery.max_attempts and delivery.attempts >= delivery.max_attempts then
      return ctx:bury(reason)
    end
    local delay = (opts.backoff or default_backoff)(delivery.attempts)
    if not_before and not_before > delay then delay = not_before end
    return ctx:reschedule(delay, reason)
  end

  return function(opts)
    check_opts(opts)
    return function(delivery, ctx)
      local body = delivery.payload == nil and "null" or json.encode(delivery.payload)
      local res, err = http.request {
        method = "POST", url = opts.url, body = body, timeout = opts.timeout,
        max_body = opts.max_body, headers = request_headers(opts, delivery, body),
      }
      -- after an abort the outcome is the abort's, whatever we would call here
      if ctx.signal and ctx.signal.aborted then return end
      if not res then
        retry(opts, delivery, ctx, err)
        return
      end
      local status = res.status
      if status >= 200 and status <= 299 then return end
      local reason = string.format("HTTP %d: %s", status, res.body:sub(1, 200))
      if retryable(status) then
        retry(opts, delivery, ctx, reason, retry_after(res.headers))
      else
        ctx:bury(reason)
      end
    end
  end
end
