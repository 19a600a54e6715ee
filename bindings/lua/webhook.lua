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
  local PIECE = 8                     -- this many bytes in a row of a secret are hidden too

  local known = { url = true, headers = true, timeout = true, secret = true, backoff = true,
                  max_body = true }
  -- the headers the webhook sets itself: a caller's spelling of them is dropped
  local ours = { ["webhook-id"] = true, ["webhook-timestamp"] = true,
                 ["webhook-signature"] = true }
  -- the caller's headers that carry no secret: the transport keeps only these across origins
  -- for the same reason (lua_http.c), and a receiver may well say which one it wanted
  local plain = { ["content-type"] = true, accept = true, ["user-agent"] = true }

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

  -- Parameter names whose values redact_url hides (runtime/util/text.c).
  local secret_words = { "password", "secret", "token", "passwd", "pwd", "key", "sig",
                         "credential", "session" }
  local function secret_param(name)
    name = name:lower()
    if name == "options" then return true end     -- libpq's settings: all of it is hidden
    for _, w in ipairs(secret_words) do
      if name:find(w, 1, true) then return true end
    end
    return false
  end

  -- Texts that must never reach last_error or a log: the secret (and the key it stands for),
  -- each header value of 3 bytes or more the caller sends but those in `plain`, and what
  -- redact_url hides of the URL (the user-info's password, secret-looking parameters), as
  -- written, decoded, and as the Basic credentials sent for it (their base64: "Basic " names
  -- the scheme, no secret). Indexed for scrub: starts[byte] lists {secret, position} for
  -- each position of each secret where that byte stands.
  local function secrets_of(opts, key)
    local list, seen = {}, {}
    local function add(s)
      if s and #s > 0 and not seen[s] then
        seen[s] = true
        list[#list + 1] = s
      end
    end
    add(opts.secret)
    -- the key's raw bytes, when long enough not to be found in any text by chance
    if key and #key >= PIECE then add(key) end
    -- a value of one or two bytes ("1", "v2") is no secret, and hiding it everywhere would
    -- leave nothing of the answer to read
    for k, v in pairs(opts.headers or {}) do
      v = tostring(v)
      if not plain[k:lower()] and #v >= 3 then add(v) end
    end
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
    local starts = {}
    for _, secret in ipairs(list) do
      for j = 1, #secret do
        local b = secret:byte(j)
        starts[b] = starts[b] or {}
        table.insert(starts[b], { secret, j })
      end
    end
    return { starts = starts }
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

  local json_escapes = { ['"'] = '"', ["\\"] = "\\", ["/"] = "/", b = "\b", f = "\f",
                         n = "\n", r = "\r", t = "\t" }
  local html_names = { amp = "&", lt = "<", gt = ">", quot = '"', apos = "'" }

  local function code_point(cp)
    if cp and cp <= 0x10FFFF and not (cp >= 0xD800 and cp <= 0xDFFF) then return utf8.char(cp) end
  end

  -- A JSON \uXXXX escape at i (a surrogate pair as one): its UTF-8 bytes and where it ends.
  local function json_u(text, i)
    local hi = tonumber(text:match("^\\u(%x%x%x%x)", i) or "", 16)
    if not hi then return nil end
    if hi >= 0xD800 and hi <= 0xDBFF then
      local lo = tonumber(text:match("^\\u(%x%x%x%x)", i + 6) or "", 16)
      if not (lo and lo >= 0xDC00 and lo <= 0xDFFF) then return nil end
      return code_point(0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)), i + 12
    end
    return code_point(hi), i + 6
  end

  -- An HTML character reference at i (&amp; &#233; &#xE9;): its UTF-8 bytes and where it ends.
  local function html_ref(text, i)
    local ref, stop = text:match("^&(#?%w+);()", i)
    if not ref then return nil end
    if html_names[ref] then return html_names[ref], stop end
    local hex = ref:match("^#[xX](%x+)$")
    local cp = hex and tonumber(hex, 16) or tonumber(ref:match("^#(%d+)$") or "")
    return code_point(cp), stop
  end

  -- Calls fn(bytes, next) for each way the text at i may spell bytes of a secret: the byte
  -- itself, and as a receiver may write it back: percent-encoded (once or twice), '+' for a
  -- space (a form), a JSON escape, an HTML character reference.
  local function spellings(text, i, fn)
    local c = text:sub(i, i)
    fn(c, i + 1)
    if c == "%" then
      local h = text:match("^%%(%x%x)", i)
      if h then fn(string.char(tonumber(h, 16)), i + 3) end
      h = text:match("^%%25(%x%x)", i)
      if h then fn(string.char(tonumber(h, 16)), i + 5) end
    elseif c == "+" then
      fn(" ", i + 1)
    elseif c == "\\" then
      local e = text:sub(i + 1, i + 1)
      if json_escapes[e] then
        fn(json_escapes[e], i + 2)
      elseif e == "u" then
        local bytes, stop = json_u(text, i)
        if bytes then fn(bytes, stop) end
      end
    elseif c == "&" then
      local bytes, stop = html_ref(text, i)
      if bytes then fn(bytes, stop) end
    end
  end

  -- The longest run of secret s from its byte j that the text spells from i: its length in
  -- bytes of s, and where it ends in the text. Every spelling is followed (the text positions
  -- reached after each byte of s form a set, so ambiguous spellings cost no more than s is
  -- long). A run of PIECE bytes that already reaches past `limit` is long enough: nothing
  -- after the cut is shown. work.left counts the steps down.
  local function longest(text, i, s, j, limit, work)
    local at, best, stop, k, last = { [j] = { [i] = true } }, 0, i, j, j
    local function step(bytes, nxt)
      if s:sub(k, k + #bytes - 1) ~= bytes then return end
      local kk = k + #bytes
      at[kk] = at[kk] or {}
      at[kk][nxt] = true
      if kk > last then last = kk end
      if kk - j > best or (kk - j == best and nxt > stop) then best, stop = kk - j, nxt end
    end
    while k <= math.min(last, #s) and work.left > 0 do
      local here = at[k]
      at[k] = nil
      for pos in pairs(here or {}) do
        work.left = work.left - 1
        if pos <= #text then spellings(text, pos, step) end
      end
      if best >= PIECE and stop > limit then break end
      k = k + 1
    end
    return best, stop
  end

  -- Steps of matching one text may take; past them the rest of the text is hidden whole, so a
  -- secret of one byte repeated cannot make a settle slow.
  local WORK = 100000

  -- The first `limit` bytes of text (all of it without a limit) with "***" for each secret,
  -- and each run of PIECE or more bytes of one, that starts there, however it is spelled.
  -- A run is followed past the cut, so one that the cut goes through is hidden too.
  local function scrub(text, secrets, limit)
    limit = math.min(limit or #text, #text)
    local hidden, covered, work = {}, 0, { left = WORK }
    local i = 1
    -- covered: the end of the furthest run found; once past the cut, all that is left is hidden
    while i <= limit and covered <= limit and work.left > 0 do
      local tried = {}
      spellings(text, i, function(bytes)
        for _, at in ipairs(secrets.starts[bytes:byte(1)] or {}) do
          if covered > limit or work.left <= 0 then return end
          if not tried[at] then
            tried[at] = true
            work.left = work.left - 1
            local s, j = at[1], at[2]
            local n, stop = longest(text, i, s, j, limit, work)
            if n >= PIECE or (j == 1 and n == #s) then
              for p = i, math.min(stop - 1, limit) do hidden[p] = true end
              if stop > covered then covered = stop end
            end
          end
        end
      end)
      i = i + 1
    end
    if work.left <= 0 then
      for p = i, limit do hidden[p] = true end
    end
    local out, p = {}, 1
    while p <= limit do
      local q = p
      while q <= limit and (hidden[q] or false) == (hidden[p] or false) do q = q + 1 end
      out[#out + 1] = hidden[p] and "***" or text:sub(p, q - 1)
      p = q
    end
    return valid_utf8(table.concat(out))
  end

  local function retryable(status)
    return status == 408 or status == 429 or (status >= 500 and status <= 599)
  end

  -- The start of an answer's body (or a Location) as one line, without the secrets: they are
  -- taken out before the cut, so that none the cut goes through is left half shown.
  local function body_start(body, secrets)
    return (scrub(body, secrets, REASON_BODY):gsub("%c+", " "))
  end

  -- The topic as a header value: '%', space and control bytes percent-encoded. A CR or LF
  -- could not be sent at all (each attempt would fail the same way), and HTTP trims spaces
  -- at either end; percent-decoding gives the topic back exactly.
  local function header_topic(topic)
    return (topic:gsub("[%%%c ]", function(c) return string.format("%%%02X", c:byte()) end))
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
    h["X-Relaybus-Topic"] = header_topic(tostring(delivery.topic))
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
    local secrets = secrets_of(opts, key)
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
                               to and "redirect to " .. body_start(http.redact_url(to), secrets)
                                  or "redirect without a Location")
        return bury(ctx, reason)
      end
      reason = string.format("HTTP %d: %s", status, body_start(res.body, secrets))
      if retryable(status) then
        retry(opts, delivery, ctx, reason, http.retry_after(res.headers["retry-after"]))
      else
        bury(ctx, reason)
      end
    end
  end
end
