-- webhook.lua -- relaybus.webhook{...}: a handler that POSTs each delivery's payload as JSON,
-- signed the Standard Webhooks way, and settles by the answer: 2xx completes; 408, 429, 5xx
-- and network failures retry with backoff, no sooner than Retry-After; a 3xx buries (a webhook
-- never follows a redirect); any other status buries with the status and the body's start.
-- A settle that cannot be written raises, so the run is never taken for a success.
return function(relaybus)
  local http, json = relaybus.http, relaybus.json

  local DEFAULT_MAX_BODY = 64 * 1024  -- of an answer's body, only the start is ever shown
  local MAX_DELAY = 3155760000        -- 100 years: the longest delay the dispatcher takes
  local REASON_BODY = 200             -- bytes of the answer's body in last_error

  local known = { url = true, headers = true, timeout = true, secret = true, backoff = true,
                  max_body = true }
  -- the headers the webhook sets itself: a caller's spelling of them is dropped
  local ours = { ["webhook-id"] = true, ["webhook-timestamp"] = true,
                 ["webhook-signature"] = true }

  local function misuse(fmt, ...)
    error("relaybus: webhook: " .. string.format(fmt, ...), 0)
  end

  local function is_token(s)
    return #s > 0 and not s:find("[^%w!#$%%&'*+%-.^_`|~]")
  end

  local function check_headers(headers)
    for k, v in pairs(headers) do
      if type(k) ~= "string" or (type(v) ~= "string" and type(v) ~= "number") then
        misuse("'headers' must map names to strings")
      end
      if not is_token(k) then misuse("invalid header name: a name is token characters") end
      if tostring(v):find("[\r\n%z]") then
        misuse("invalid value of header '%s': CR, LF and NUL are not allowed", k)
      end
      local lk = k:lower()
      if lk == "content-length" or lk == "transfer-encoding" then
        misuse("header '%s' is the transport's: it frames the body itself", k)
      end
    end
  end

  -- The HMAC key: "whsec_" + base64 is the Standard Webhooks form (the decoded bytes are the
  -- key, so receiver libraries take the same string); anything else is the key's bytes.
  local function signing_key(secret)
    if #secret == 0 then misuse("'secret' must not be empty") end
    if secret:sub(1, 6) ~= "whsec_" then return secret end
    local key = http.base64_decode(secret:sub(7))
    if not key or #key == 0 then misuse("'secret' starts with whsec_ but is not base64 after it") end
    return key
  end

  local function check_opts(opts)
    if type(opts) ~= "table" then misuse("options must be a table") end
    for k in pairs(opts) do
      if not known[k] then misuse("unknown option '%s'", tostring(k)) end
    end
    if type(opts.url) ~= "string" then misuse("'url' is required (a string)") end
    if not opts.url:lower():find("^https?://") then misuse("'url' must be an http or https URL") end
    if opts.url:find("[%c ]") then
      misuse("invalid url: control characters and spaces must be percent-encoded")
    end
    local kinds = { headers = "table", timeout = "number", secret = "string",
                    backoff = "function", max_body = "number" }
    for k, kind in pairs(kinds) do
      if opts[k] ~= nil and type(opts[k]) ~= kind then misuse("'%s' must be a %s", k, kind) end
    end
    if opts.timeout and not (opts.timeout > 0) then misuse("'timeout' must be > 0") end
    if opts.max_body and (math.type(opts.max_body) ~= "integer" or opts.max_body <= 0) then
      misuse("'max_body' must be a positive integer")
    end
    if opts.headers then check_headers(opts.headers) end
  end

  local function percent_decode(s)
    return (s:gsub("%%(%x%x)", function(h) return string.char(tonumber(h, 16)) end))
  end

  -- Parameter names whose values redact_url hides (runtime/text.c).
  local secret_words = { "password", "secret", "token", "passwd", "pwd", "key", "sig",
                         "credential", "session" }
  local function secret_param(name)
    name = name:lower()
    for _, w in ipairs(secret_words) do
      if name:find(w, 1, true) then return true end
    end
    return false
  end

  -- Texts that must never reach last_error or a log: the secret, and what redact_url hides of
  -- the URL (the user-info's password, secret-looking parameters), as written, decoded, and
  -- as the Basic credentials a receiver might echo. Longest first, so none is left half shown.
  local function secrets_of(opts)
    local list = {}
    local function add(s)
      if s and #s > 0 then list[#list + 1] = s end
    end
    add(opts.secret)
    local rest = opts.url:match("^[%w+.-]+://(.*)$") or ""
    local authority = rest:match("^[^/?#]*")
    local userinfo = authority:match("^(.*)@")      -- up to the last '@'
    local password = userinfo and userinfo:match("^[^:]*:(.*)$")
    if password and #password > 0 then
      add(password)
      add(percent_decode(password))
      add(http.base64_encode(percent_decode(userinfo)))
    end
    local query = rest:sub(#authority + 1):match("%?(.*)$")
    for pair in (query or ""):gmatch("[^&#]+") do
      local name, value = pair:match("^([^=]*)=(.*)$")
      if name and secret_param(name) then
        add(value)
        add(percent_decode(value))
      end
    end
    table.sort(list, function(a, b) return #a > #b end)
    return list
  end

  -- s with each byte that is not part of valid UTF-8 replaced by U+FFFD: a store may refuse
  -- the text otherwise, and then the settle itself would fail.
  local function valid_utf8(s)
    local out, i = {}, 1
    while i <= #s do
      local ok, bad = utf8.len(s, i)
      if ok then
        out[#out + 1] = s:sub(i)
        break
      end
      out[#out + 1] = s:sub(i, bad - 1) .. "\u{FFFD}"
      i = bad + 1
    end
    return table.concat(out)
  end

  local function scrub(text, secrets)
    for _, s in ipairs(secrets) do
      local from = 1
      while true do
        local a, b = text:find(s, from, true)
        if not a then break end
        text = text:sub(1, a - 1) .. "***" .. text:sub(b + 1)
        from = a + 3
      end
    end
    return valid_utf8(text)
  end

  local function retryable(status)
    return status == 408 or status == 429 or (status >= 500 and status <= 599)
  end

  -- The start of an answer's body as one line of text.
  local function body_start(body)
    return (body:sub(1, REASON_BODY):gsub("%c+", " "))
  end

  local function request_headers(opts, key, delivery, body)
    local h, has_type = {}, false
    for k, v in pairs(opts.headers or {}) do
      local lk = k:lower()
      if lk == "content-type" then has_type = true end
      -- ours below win over a caller's spelling of the same name
      if not lk:match("^x%-relaybus%-") and not ours[lk] then h[k] = v end
    end
    if not has_type then h["Content-Type"] = "application/json" end
    local id, ts = tostring(delivery.id), tostring(math.floor(relaybus.time()))
    h["X-Relaybus-Id"] = id
    h["X-Relaybus-Topic"] = tostring(delivery.topic)
    h["X-Relaybus-Attempt"] = tostring(delivery.attempts)
    -- Standard Webhooks: the id is stable across retries, the timestamp is this attempt's,
    -- and the signature covers both with the body, so a captured request cannot be replayed
    -- later or with another body.
    h["webhook-id"] = id
    h["webhook-timestamp"] = ts
    if key then
      h["webhook-signature"] = "v1," .. http.hmac_sha256(key, id .. "." .. ts .. "." .. body,
                                                         "base64")
    end
    return h
  end

  -- A settle that was not written fails the run: returning would complete the delivery.
  local function settled(what, reason, ok, err)
    if not ok then
      error(string.format("%s (and the %s failed: %s)", reason, what, tostring(err)), 0)
    end
  end

  local function bury(ctx, reason)
    settled("bury", reason, ctx:bury(reason))
  end

  -- Retry, unless this was the last attempt: then bury now, keeping the reason.
  local function retry(opts, delivery, ctx, reason, not_before)
    if delivery.max_attempts and delivery.attempts >= delivery.max_attempts then
      return bury(ctx, reason)
    end
    local delay, err
    if opts.backoff then
      delay = opts.backoff(delivery.attempts)
      if type(delay) ~= "number" or delay ~= delay then
        misuse("backoff(%d) returned %s, not a number of seconds", delivery.attempts,
               tostring(delay))
      end
    else
      delay, err = ctx:backoff()
      if not delay then settled("backoff", reason, nil, err) end
    end
    if not_before and not_before > delay then delay = not_before end
    delay = math.max(0, math.min(delay, MAX_DELAY))
    settled("reschedule", reason, ctx:reschedule(delay, reason))
  end

  return function(opts)
    check_opts(opts)
    local key = opts.secret and signing_key(opts.secret)
    local secrets = secrets_of(opts)
    return function(delivery, ctx)
      local body = delivery.payload == nil and "null" or json.encode(delivery.payload)
      local res, err = http.request {
        method = "POST", url = opts.url, body = body, timeout = opts.timeout,
        max_body = opts.max_body or DEFAULT_MAX_BODY, truncate_body = true,
        headers = request_headers(opts, key, delivery, body),
      }
      -- after an abort the outcome is the abort's, whatever we would call here
      if ctx.signal and ctx.signal.aborted then return end
      if not res then
        return retry(opts, delivery, ctx, scrub(err, secrets))
      end
      local status = res.status
      if status >= 200 and status <= 299 then return end
      local reason
      if status >= 300 and status <= 399 then
        local to = res.redirect_url or res.headers.location
        reason = string.format("HTTP %d %s: webhooks do not follow redirects; point url at "
                               .. "the final address", status,
                               to and "redirect to " .. body_start(http.redact_url(to))
                                  or "redirect without a Location")
        return bury(ctx, scrub(reason, secrets))
      end
      reason = scrub(string.format("HTTP %d: %s", status, body_start(res.body)), secrets)
      if retryable(status) then
        retry(opts, delivery, ctx, reason, http.retry_after(res.headers["retry-after"]))
      else
        bury(ctx, reason)
      end
    end
  end
end
