
if redis.replicate_commands then redis.replicate_commands() end

-- Locals, not the globals: a batch of steps ('steps', below) points them at each step's own.
local KEYS, ARGV = KEYS, ARGV
local op = ARGV[1]
local now
if ARGV[2] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
else
  now = tonumber(ARGV[2])
end

-- The store's epoch marker (see guards.stores._epoch): an operation that checks it has the
-- marker's key last in KEYS and the epoch the worker knows last in ARGV. A missing marker is
-- made again (its id: Redis' TIME, unique per reset); `epoch` is the id found when the worker
-- did not know it, which the operation adds to its reply.
local epoch = nil
local function check_epoch()
  local key = KEYS[#KEYS]
  local found = redis.call('GET', key)
  if not found then
    local t = redis.call('TIME')
    found = t[1] .. '.' .. t[2]
    redis.call('SET', key, found)
  end
  if found ~= ARGV[#ARGV] then epoch = found end
end

local DAY = 86400
local MINUTE = 60
local DAILY_TTL_MS = 90000000 -- DAILY_TTL_S: a day and an hour
local MINUTE_MS = 60000

local function fmt(x)
  return string.format('%.17g', x)
end

-- now % DAY as Python computes it (fmod, then the sign of the divisor): exact, unlike Lua's %.
local function second_of_day(t)
  local sod = math.fmod(t, DAY)
  if sod < 0 then sod = sod + DAY end
  return sod
end

-- YYYY-MM-DD of the UTC day of t: int(t // DAY) as Python computes it, then the civil date of
-- that day number (H. Hinnant's days-to-civil), as guards.stores._base.utc_day names it.
local function day_name(t)
  local rem = math.fmod(t, DAY)
  local days = (t - rem) / DAY
  if rem < 0 then days = days - 1 end
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m
  if mp < 10 then m = mp + 3 else m = mp - 9 end
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return string.format('%04d-%02d-%02d', y, m, d)
end

local function ensure_ttl(key, ms)
  if redis.call('PTTL', key) == -1 then redis.call('PEXPIRE', key, ms) end
end

local function int(x)
  return string.format('%d', x)
end

-- The day's spend hash (or another held counter: see `more_check`): drops lapsed holds (and
-- `drop`, a hold field) and returns the settled total, the sum of live holds, the fields to
-- delete and the live holds as {amount, expires}.
local function read_spend(key, drop)
  local flat = redis.call('HGETALL', key)
  local settled, held, gone, live = 0, 0, {}, {}
  for i = 1, #flat, 2 do
    local field, value = flat[i], flat[i + 1]
    if field == 'settled' then
      settled = tonumber(value)
    else
      local amount, expires = string.match(value, '^(%S+) (%S+)$')
      if field == drop or tonumber(expires) <= now then
        gone[#gone + 1] = field
      else
        held = held + tonumber(amount)
        live[#live + 1] = {tonumber(amount), tonumber(expires)}
      end
    end
  end
  return settled, held, gone, live
end

local MONTHLY_TTL_MS = 2768400000 -- MONTHLY_TTL_S: 32 days and an hour
local TOKEN_WINDOW_CAP = 10000

-- Seconds from t to the start of the next UTC calendar month.
local function month_left(t)
  local name = day_name(t)
  local y, m, d = tonumber(name:sub(1, 4)), tonumber(name:sub(6, 7)), tonumber(name:sub(9, 10))
  local days = ({31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31})[m]
  if m == 2 and (y % 4 == 0 and (y % 100 ~= 0 or y % 400 == 0)) then days = 29 end
  return (days - d + 1) * DAY - second_of_day(t)
end

-- Of two refusals {refused_by, retry} (retry nil: never frees up), the one that frees up last.
local function later(r, o)
  if o == nil then return r end
  if r == nil or (r[2] ~= nil and (o[2] == nil or o[2] > r[2])) then return o end
  return r
end

-- A charge's held counters (guards.stores._limits._held_limits): {key, limit, amount, cap}.
local function held_limits(c)
  local held, month = {}, day_name(now):sub(1, 7)
  if c.mspend and c.spend_per_month then
    held[#held + 1] = {c.tag .. ':spend:' .. month, 'spend_per_month', c.mspend, c.spend_per_month}
  end
  if c.tokens then
    if c.tpm then held[#held + 1] = {c.tag .. ':tokens:minute', 'tokens_per_minute', c.tokens, c.tpm} end
    if c.tpd then held[#held + 1] = {c.tag .. ':tokens:' .. day_name(now), 'tokens_per_day', c.tokens, c.tpd} end
    if c.tpmo then held[#held + 1] = {c.tag .. ':tokens:' .. month, 'tokens_per_month', c.tokens, c.tpmo} end
  end
  return held
end

-- A shared limit's fair shares (guards.stores._share): the UTC minute's hash of active tenants
-- (field: the tenant's hex name, or '*' the overflow bucket; value '<weight> <requests>
-- <tokens>') at `<tag>:share:<minute>`, and its token holds at `...:h` ('<tenant> <tokens>'),
-- both kept two minutes.
local SHARE_TENANTS_CAP = 256
local SHARE_TTL_MS = 120000

local function share_key(c)
  local rem = math.fmod(now, MINUTE)
  return c.tag .. ':share:' .. int((now - rem) / MINUTE)
end

local function share_tenants(key)
  local flat = redis.call('HGETALL', key)
  local tenants, count = {}, 0
  for i = 1, #flat, 2 do
    local w, r, k = string.match(flat[i + 1], '^(%S+) (%S+) (%S+)$')
    tenants[flat[i]] = {tonumber(w), tonumber(r), tonumber(k)}
    count = count + 1
  end
  return tenants, count
end

-- The tenant's field and weight: the overflow bucket once the minute has the cap of others.
local function share_name(c, tenants, count)
  if tenants[c.tenant] or count < SHARE_TENANTS_CAP then return c.tenant, c.weight end
  return '*', 1
end

-- guards.stores._share.decide: the refusal {refused_by, retry} or nil; writes nothing.
local function share_check(c)
  local tenants, count = share_tenants(share_key(c))
  local name, weight = share_name(c, tenants, count)
  local mine = tenants[name]
  if mine then mine = {weight, mine[2], mine[3]} else mine = {weight, 0, 0} end
  tenants[name] = mine
  local total_weight = 0
  for _, e in pairs(tenants) do total_weight = total_weight + e[1] end
  local limits = {{'shared_per_minute', c.spm, 1, 2}, {'shared_tokens_per_minute', c.stpm, c.tokens, 3}}
  for _, l in ipairs(limits) do
    local refused_by, limit, amount, at = l[1], l[2], l[3], l[4]
    if limit and amount then
      if amount > limit then return {refused_by, nil} end
      local total = 0
      for _, e in pairs(tenants) do total = total + e[at] end
      local room = limit
      if mine[at] + amount > limit * weight / total_weight then
        for other, e in pairs(tenants) do
          if other ~= name then room = room - math.max(0, limit * e[1] / total_weight - e[at]) end
        end
      end
      if total + amount > room then return {refused_by, MINUTE - math.fmod(now, MINUTE)} end
    end
  end
  return nil
end

-- Write the tenant's entry with `requests` and `tokens` added (a refused one: none, still active).
local function share_add(c, requests, tokens)
  local key = share_key(c)
  local tenants, count = share_tenants(key)
  local name, weight = share_name(c, tenants, count)
  local e = tenants[name] or {weight, 0, 0}
  redis.call('HSET', key, name, fmt(weight) .. ' ' .. fmt(math.max(e[2] + requests, 0)) .. ' '
    .. fmt(math.max(e[3] + tokens, 0)))
  ensure_ttl(key, SHARE_TTL_MS)
  return key, name
end

local function share_apply(c, reservation)
  local amount = 0
  if c.stpm and c.tokens then amount = c.tokens end
  local key, name = share_add(c, 1, amount)
  if amount > 0 then
    redis.call('HSET', key .. ':h', 'h:' .. reservation, name .. ' ' .. fmt(amount))
    ensure_ttl(key .. ':h', SHARE_TTL_MS)
  end
end

-- The tenant's token hold of this minute settled to `tokens`, or (`unpay`) its request too.
local function share_settle(c, reservation, tokens, requests)
  local key = share_key(c)
  local hold = redis.call('HGET', key .. ':h', 'h:' .. reservation)
  local name, amount
  if hold then
    name, amount = string.match(hold, '^(%S+) (%S+)$')
    redis.call('HDEL', key .. ':h', 'h:' .. reservation)
  elseif requests == 0 then
    return
  else
    name, amount = share_name(c, share_tenants(key)), 0
  end
  local value = redis.call('HGET', key, name)
  if not value then return end
  local w, r, k = string.match(value, '^(%S+) (%S+) (%S+)$')
  redis.call('HSET', key, name, w .. ' ' .. fmt(math.max(tonumber(r) + requests, 0)) .. ' '
    .. fmt(math.max(tonumber(k) + tokens - tonumber(amount), 0)))
end

-- A charge's MoreLimits, checked (guards.stores._limits._check_more): the refusal or nil.
local function more_check(c)
  local refusal = nil
  if c.per_month then
    local count = tonumber(redis.call('GET', c.tag .. ':month:' .. day_name(now):sub(1, 7)) or '0')
    if count >= c.per_month then refusal = {'per_month', month_left(now)} end
  end
  for _, h in ipairs(held_limits(c)) do
    local key, limit, amount, cap = h[1], h[2], h[3], h[4]
    if amount > cap then
      refusal = later(refusal, {limit, nil})
    else
      local settled, held, _, live = read_spend(key, nil)
      held = settled + held
      if limit == 'tokens_per_minute' then
        if held + amount > cap or #live >= TOKEN_WINDOW_CAP then
          table.sort(live, function(x, y) return x[2] < y[2] end)
          local wait, freed, left = 0, 0, #live
          for _, hold in ipairs(live) do
            freed, left, wait = freed + hold[1], left - 1, hold[2] - now
            if held - freed + amount <= cap and left < TOKEN_WINDOW_CAP then break end
          end
          refusal = later(refusal, {limit, math.max(wait, 0)})
        end
      elseif held + amount > cap then
        local wait
        if limit == 'tokens_per_day' then wait = DAY - second_of_day(now) else wait = month_left(now) end
        refusal = later(refusal, {limit, wait})
      end
    end
  end
  return refusal
end

-- A charge's MoreLimits, written (guards.stores._limits._apply_more).
local function more_apply(c, reservation)
  if c.tenant then share_apply(c, reservation) end
  if c.per_month then
    local key = c.tag .. ':month:' .. day_name(now):sub(1, 7)
    if redis.call('INCR', key) == 1 then redis.call('PEXPIRE', key, MONTHLY_TTL_MS) end
  end
  for _, h in ipairs(held_limits(c)) do
    local key, limit, amount = h[1], h[2], h[3]
    local _, _, gone = read_spend(key, nil)
    if #gone > 0 then redis.call('HDEL', key, unpack(gone)) end
    if limit == 'tokens_per_minute' then
      redis.call('HSET', key, 'h:' .. reservation, fmt(amount) .. ' ' .. fmt(now + MINUTE))
      redis.call('PEXPIRE', key, MINUTE_MS)
    else
      redis.call('HSET', key, 'h:' .. reservation, fmt(amount) .. ' ' .. fmt(now + c.hold_s))
      if limit == 'tokens_per_day' then
        redis.call('PEXPIRE', key, DAILY_TTL_MS)
      else
        redis.call('PEXPIRE', key, MONTHLY_TTL_MS)
      end
    end
  end
end

-- A request's charge, all or nothing: c = {window, day_stem, spend_stem, per_minute, per_day,
-- spend, cap, hold_s, reservation} (nil for a limit not set). Returns nil when charged, else
-- {refused_by, retry_after}.
--
-- The per-minute window is a hash of admissions numbered 0, 1, 2...: field n = the next number,
-- t = the lowest number that may still be there, and one field per admission = its time. The
-- window has room when the admission `per_minute` places back is gone or older than 60 s: one
-- HGET, whatever the traffic. Each admission deletes at most two expired admissions at the
-- tail; the hash expires a minute after the last admission.
local function charge(c, dry)
  local refused_by, retry = nil, nil
  local seq = 0
  if c.per_minute then
    seq = tonumber(redis.call('HGET', c.window, 'n') or '0')
    if seq >= c.per_minute then
      local stamp = tonumber(redis.call('HGET', c.window, int(seq - c.per_minute)) or '')
      if stamp ~= nil and stamp > now - MINUTE then
        refused_by = 'per_minute'
        retry = stamp + MINUTE - now
      end
    end
  end
  local wait = DAY - second_of_day(now) -- until the next UTC midnight
  local day_key, spend_key, gone
  if c.per_day then
    day_key = c.day_stem .. day_name(now)
    local count = tonumber(redis.call('GET', day_key) or '0')
    -- Both spent: name the limit that frees up last.
    if count >= c.per_day and (refused_by == nil or wait > retry) then
      refused_by = 'per_day'
      retry = wait
    end
  end
  if c.spend then
    spend_key = c.spend_stem .. day_name(now)
    local settled, held
    settled, held, gone = read_spend(spend_key, nil)
    if settled + held + c.spend > c.cap and (refused_by == nil or wait > retry) then
      refused_by = 'spend_per_day'
      retry = wait
    end
  end
  if refused_by then return {refused_by, fmt(retry)} end
  if dry then return nil end
  if c.per_minute then
    local tail = tonumber(redis.call('HGET', c.window, 't') or '0')
    for _ = 1, 2 do
      if tail >= seq then break end
      local stamp = tonumber(redis.call('HGET', c.window, int(tail)) or '')
      if stamp ~= nil and stamp > now - MINUTE then break end
      if stamp ~= nil then redis.call('HDEL', c.window, int(tail)) end
      tail = tail + 1
    end
    redis.call('HSET', c.window, int(seq), fmt(now), 'n', int(seq + 1), 't', int(tail))
    c.seq = int(seq) -- (Redis Cluster: the receipt of a 'pay', to give it back: `unpay`)
    redis.call('PEXPIRE', c.window, MINUTE_MS)
  end
  if c.per_day then
    if redis.call('INCR', day_key) == 1 then redis.call('PEXPIRE', day_key, DAILY_TTL_MS) end
  end
  if c.spend then
    if #gone > 0 then redis.call('HDEL', spend_key, unpack(gone)) end
    redis.call('HSET', spend_key, 'h:' .. c.reservation, fmt(c.spend) .. ' ' .. fmt(now + c.hold_s))
    redis.call('PEXPIRE', spend_key, DAILY_TTL_MS)
  end
  return nil
end

-- Redis Cluster (RedisStore._split_step): a charge 'pay' made, given back at the same `now`
-- (its receipt's): the window's entry `seq`, a unit of the day's and the month's counts, and its
-- holds, so the charge counts no more than a refused one.
local function unpay(c, reservation, seq)
  if c.per_minute and seq ~= '' then redis.call('HDEL', c.window, seq) end
  local counts = {}
  if c.per_day then counts[#counts + 1] = c.day_stem .. day_name(now) end
  if c.per_month then counts[#counts + 1] = c.tag .. ':month:' .. day_name(now):sub(1, 7) end
  for _, key in ipairs(counts) do
    if tonumber(redis.call('GET', key) or '0') > 0 then redis.call('DECR', key) end
  end
  if c.spend then redis.call('HDEL', c.spend_stem .. day_name(now), 'h:' .. reservation) end
  for _, h in ipairs(held_limits(c)) do redis.call('HDEL', h[1], 'h:' .. reservation) end
  if c.tenant then share_settle(c, reservation, 0, -1) end
end

local function settle(stem, reservation, actual)
  local key = stem .. day_name(now)
  local settled, _, gone = read_spend(key, 'h:' .. reservation)
  redis.call('HSET', key, 'settled', fmt(settled + actual))
  if #gone > 0 then redis.call('HDEL', key, unpack(gone)) end
  ensure_ttl(key, DAILY_TTL_MS)
end

-- Settle the holds a charge with MoreLimits made (guards.stores._limits.settle_charge).
local function settle_more(c, reservation, actual, tokens)
  if c.spend then settle(c.tag .. ':spend:', reservation, actual) end
  if c.tenant and c.stpm then share_settle(c, reservation, tokens, 0) end
  for _, h in ipairs(held_limits(c)) do
    local key, limit = h[1], h[2]
    if limit == 'tokens_per_minute' then
      local value = redis.call('HGET', key, 'h:' .. reservation)
      local expires = value and tonumber(string.match(value, ' (%S+)$'))
      if expires and expires > now then
        redis.call('HSET', key, 'h:' .. reservation, fmt(tokens) .. ' ' .. fmt(expires))
      end
    else
      local amount = tokens
      local ttl = MONTHLY_TTL_MS
      if limit == 'spend_per_month' then amount = actual end
      if limit == 'tokens_per_day' then ttl = DAILY_TTL_MS end
      local settled, _, gone = read_spend(key, 'h:' .. reservation)
      redis.call('HSET', key, 'settled', fmt(settled + amount))
      if #gone > 0 then redis.call('HDEL', key, unpack(gone)) end
      ensure_ttl(key, ttl)
    end
  end
end

-- The charges of ARGV[4] from field `at` of `e` (MORE fields each), their tags from KEYS[k0 + 1].
local MORE = 15
local function more_charges(e, at, count, k0, hold_s)
  local charges = {}
  for j = 1, count do
    local f = at + MORE * (j - 1)
    local tag = KEYS[k0 + j]
    charges[j] = {tag = tag, window = tag .. ':window', day_stem = tag .. ':day:', spend_stem = tag .. ':spend:',
      per_minute = tonumber(e[f]), per_day = tonumber(e[f + 1]), spend = tonumber(e[f + 2]),
      cap = tonumber(e[f + 3]), per_month = tonumber(e[f + 4]), mspend = tonumber(e[f + 5]),
      spend_per_month = tonumber(e[f + 6]), tokens = tonumber(e[f + 7]), tpm = tonumber(e[f + 8]),
      tpd = tonumber(e[f + 9]), tpmo = tonumber(e[f + 10]), hold_s = hold_s,
      spm = tonumber(e[f + 11]), stpm = tonumber(e[f + 12]), weight = tonumber(e[f + 13])}
    if e[f + 14] ~= '' then charges[j].tenant = e[f + 14] end
  end
  return charges
end

-- Seconds left on a cooldown ('0' when not cooling down). A key whose end has passed on the
-- store's clock (an injected clock in tests) counts as gone.
local function cooldown_left(key)
  local ends = tonumber(redis.call('GET', key) or '')
  if ends == nil or ends <= now then return 0 end
  return ends - now
end

-- Never shortens a running cooldown; the key expires when the cooldown ends.
local function start_cooldown(key, seconds)
  local ends = now + seconds
  local current = tonumber(redis.call('GET', key) or '')
  if ends <= now or (current ~= nil and current >= ends) then return end
  redis.call('SET', key, fmt(ends), 'PX', string.format('%d', math.ceil((ends - now) * 1000)))
end

-- Breakers: guards.stores._breaker.admit / record, ported line for line. The state is one string:
-- "state opened_at probes last_probe_at successes probe_since expires_at failures open_s
-- calls probe_s", failures and calls comma-separated or '-'; open_s is the open period the
-- opener's policy set (missing in a state written before it was kept: 0, and the reader's
-- policy decides); calls and probe_s are BreakerState's (missing in a state written before
-- they were kept: none, and 0; a version before them reads the first nine words and ignores
-- the rest, so it waits out open_s after a failed probe and counts no calls). expires_at
-- (now + ttl_s at the last write) makes a key read after its TTL on the store's clock count as
-- gone, exactly like MemoryStore, whatever the clock.

local function closed()
  return {state = 'closed', failures = {}, opened_at = 0, probes = 0, last_probe_at = 0,
    successes = 0, probe_since = 0, open_s = 0, calls = {}, probe_s = 0}
end

local function is_closed(s)
  return s.state == 'closed' and #s.failures == 0 and s.opened_at == 0 and s.probes == 0
    and s.last_probe_at == 0 and s.successes == 0 and s.probe_since == 0 and s.open_s == 0
    and #s.calls == 0 and s.probe_s == 0
end

local function times(word)
  local list = {}
  if word and word ~= '-' then
    for t in string.gmatch(word, '[^,]+') do list[#list + 1] = tonumber(t) end
  end
  return list
end

local function joined(list)
  local words = {}
  for i, t in ipairs(list) do words[i] = fmt(t) end
  if #words == 0 then return '-' end
  return table.concat(words, ',')
end

local function load_breaker(key)
  local raw = redis.call('GET', key)
  if not raw then return closed() end
  local f = {}
  for word in string.gmatch(raw, '%S+') do f[#f + 1] = word end
  if tonumber(f[7]) <= now then return closed() end
  return {state = f[1], opened_at = tonumber(f[2]), probes = tonumber(f[3]),
    last_probe_at = tonumber(f[4]), successes = tonumber(f[5]), probe_since = tonumber(f[6]),
    failures = times(f[8]), open_s = tonumber(f[9] or '0'), calls = times(f[10]),
    probe_s = tonumber(f[11] or '0')}
end

local function state_fields(s)
  return {s.state, fmt(s.opened_at), fmt(s.probes), fmt(s.last_probe_at), fmt(s.successes),
    fmt(s.probe_since), joined(s.failures), fmt(s.open_s), joined(s.calls), fmt(s.probe_s)}
end

local function save_breaker(key, s, ttl_s)
  if is_closed(s) then
    redis.call('DEL', key) -- a healthy breaker needs no key at all
    return
  end
  ttl_s = math.max(ttl_s, 2 * s.open_s + 600) -- guards.stores._breaker.keep_s
  local f = state_fields(s)
  local raw = table.concat({f[1], f[2], f[3], f[4], f[5], f[6], fmt(now + ttl_s), f[7], f[8], f[9],
    f[10]}, ' ')
  redis.call('SET', key, raw, 'PX', string.format('%d', math.ceil(ttl_s * 1000)))
end

-- Writes `after` unless it equals `before` (an open breaker's refusal, a closed one's
-- admission or success): a breaker is written only when its state changes.
local function save_changed(key, before, after, ttl_s)
  -- Both healthy and closed (a closed breaker's admission: most steps): equal, field for field,
  -- without formatting a dozen numbers to find it out.
  if is_closed(before) and is_closed(after) then return end
  if table.concat(state_fields(before), ' ') ~= table.concat(state_fields(after), ' ') then
    save_breaker(key, after, ttl_s)
  end
end

-- A policy from args[i..i+5]: failure_threshold, window_s or '' (then, after spaces,
-- slow_call_s and minimum_calls when set), reset_timeout_s (then, after a space, the probe
-- interval in force, Breaker.reopen_after_probe_s, when there is one), half_open_probes,
-- success_threshold, ttl_s. nil when args[i] is '' (no breaker).
local function read_policy(args, i)
  if args[i] == '' then return nil end
  local window, slow, minimum = string.match(args[i + 1], '^(%S*) ?(%S*) ?(%S*)$')
  local reset, probe = string.match(args[i + 2], '^(%S*) ?(%S*)$')
  return {
    failure_threshold = tonumber(args[i]), window_s = tonumber(window),
    slow_call_s = tonumber(slow), minimum_calls = tonumber(minimum),
    reset_timeout_s = tonumber(reset), probe_interval_s = tonumber(probe),
    half_open_probes = tonumber(args[i + 3]), success_threshold = tonumber(args[i + 4]),
    ttl_s = tonumber(args[i + 5]),
  }
end

local function copy(s)
  local c = {}
  for k, v in pairs(s) do c[k] = v end
  return c
end

-- guards.stores._breaker.open_period: the period stored when the breaker opened, else the policy's.
local function open_period(s, policy)
  if s.open_s > 0 then return s.open_s end
  return policy.reset_timeout_s
end

-- Returns the new state and the decision {allowed, probe, state, retry_after, record_success}.
local function admit(s, policy)
  s = copy(s)
  if s.state == 'closed' then
    local record_success = '0'
    if policy.window_s == nil and #s.failures > 0 then record_success = '1' end
    return s, {'1', '', 'closed', '', record_success}
  end
  if s.state == 'open' then
    -- guards.stores._breaker.half_open_at
    local reopen_at = s.opened_at + open_period(s, policy)
    if s.probe_s > 0 then reopen_at = s.opened_at + s.probe_s end
    if now < reopen_at then
      return s, {'0', '', s.state, fmt(reopen_at - now), '1'}
    end
    local opened_at, open_s = s.opened_at, s.open_s
    s = closed()
    s.state = 'half_open'
    s.opened_at = opened_at
    s.open_s = open_s
    s.probe_since = now
  end
  if s.probes < policy.half_open_probes then
    s.probes = s.probes + 1
    s.last_probe_at = now
    return s, {'1', fmt(s.probe_since), s.state, '', '1'}
  end
  -- Every slot is taken: slots held longer than the reset timeout belong to calls that never
  -- reported; start a new generation of probes (the lost probes' tickets go stale).
  local reclaim_at = s.last_probe_at + open_period(s, policy)
  if now < reclaim_at then
    return s, {'0', '', s.state, fmt(reclaim_at - now), '1'}
  end
  s.probes = 1
  s.last_probe_at = now
  s.probe_since = now
  return s, {'1', fmt(s.probe_since), s.state, '', '1'}
end

-- As guards.stores._breaker.forget_before: a closed breaker counting consecutive failures forgets
-- those counted strictly before a success that ended at `ended_at`.
local function forget_before(s, policy, ended_at)
  if #s.failures == 0 or s.failures[1] >= ended_at or s.state ~= 'closed'
      or policy.window_s ~= nil then
    return s
  end
  local kept = {}
  for _, t in ipairs(s.failures) do
    if t >= ended_at then kept[#kept + 1] = t end
  end
  local s2 = closed()
  s2.failures = kept
  s2.calls = s.calls
  return s2
end

-- guards.stores._breaker._opened: open from now for the policy's reset timeout, or probe_s when set.
local function opened(policy, probe_s)
  local s = closed()
  s.state = 'open'
  s.opened_at = now
  s.open_s = policy.reset_timeout_s
  s.probe_s = probe_s
  return s
end

local function record(s, policy, outcome, probe)
  s = copy(s)
  if outcome == 'slow' and policy.slow_call_s == nil then outcome = 'success' end
  if probe ~= nil then
    if s.state ~= 'half_open' or probe ~= s.probe_since then return s end
    s.probes = math.max(0, s.probes - 1)
    if outcome == 'failure' or outcome == 'slow' then
      return opened(policy, policy.probe_interval_s or 0)
    end
    if outcome == 'success' then
      if s.successes + 1 >= policy.success_threshold then return closed() end
      s.successes = s.successes + 1
      return s
    end
    return s
  end
  if s.state ~= 'closed' or outcome == 'released' then return s end
  local calls = s.calls
  if policy.slow_call_s ~= nil and policy.window_s ~= nil then
    -- the calls that ended within the window, this one included, the newest minimum_calls
    local within = {}
    for _, t in ipairs(s.calls) do
      if t > now - policy.window_s then within[#within + 1] = t end
    end
    within[#within + 1] = now
    calls = {}
    for i = math.max(1, #within - policy.minimum_calls + 1), #within do calls[#calls + 1] = within[i] end
    if outcome == 'slow' then
      if #calls >= policy.minimum_calls then outcome = 'failure' else outcome = 'success' end
    end
  end
  if outcome == 'success' then
    if policy.window_s == nil then return closed() end
    s.calls = calls
    return s
  end
  local failures = {}
  for _, t in ipairs(s.failures) do failures[#failures + 1] = t end
  failures[#failures + 1] = now
  if policy.window_s ~= nil then
    local kept = {}
    for _, t in ipairs(failures) do
      if t > now - policy.window_s then kept[#kept + 1] = t end
    end
    failures = kept
  end
  local first = math.max(1, #failures - policy.failure_threshold + 1)
  local last = {}
  for i = first, #failures do last[#last + 1] = failures[i] end
  if #last >= policy.failure_threshold then return opened(policy, 0) end
  local s2 = closed()
  s2.failures = last
  s2.calls = calls
  return s2
end

-- One step of a walk (see guards.stores.Step). KEYS: the legs' cooldown keys (L), their breaker
-- keys (L), then the charge's window key, day stem and spend stem, then the report's breaker
-- key, cooldown key and spend stem ('' where unused). ARGV[3]: the step's fields joined by '|'
-- (each packed command argument costs the client more than the script's split), numbered
-- from 3 in `a`: a[3] L; a[4..9] the step's breaker policy; a[10] '1' to charge: a[11..16]
-- per_minute, per_day, spend, cap, hold_s, reservation; a[17..22] the report's breaker policy,
-- a[23] outcome, a[24] probe; a[25] cooldown seconds (then, after a space, the latest it may
-- end, store time: a provider's date); a[26] the reservation to settle, a[27]
-- its actual cost; a[28] the report's success age, a[29..28+L] the legs' ('' for none: see Step).
-- Returns one string, its fields joined by '|' (one reply to parse, not a
-- dozen): admitted index (0-based) or '', refused_by or '', retry_after, reservation or '',
-- recorded state or '', the state the report moved its breaker to or '', the state the
-- admission moved its breaker to or '', the L waits, then L decisions of 5 fields ('' for none).
local function step(mode)
  local a, i = {}, 3
  for field in string.gmatch(ARGV[3] .. '|', '([^|]*)|') do
    a[i] = field
    i = i + 1
  end
  local n = tonumber(a[3])
  local base = 2 * n
  local recorded, report_to, admit_to = '', '', ''
  local report_policy = read_policy(a, 17)
  if report_policy then
    local key = KEYS[base + 4]
    local before = load_breaker(key)
    local age = tonumber(a[28])
    local known = before
    if age then known = forget_before(before, report_policy, now - age) end
    local after = record(known, report_policy, a[23], tonumber(a[24]))
    save_changed(key, before, after, report_policy.ttl_s)
    recorded = table.concat(state_fields(after), ' ')
    if after.state ~= before.state then report_to = after.state end
  end
  local cool, cool_end = string.match(a[25], '^(%S*) ?(%S*)$')
  local cool_s, ends_by = tonumber(cool), tonumber(cool_end)
  if cool_s and ends_by then cool_s = math.min(cool_s, ends_by - now) end
  if cool_s and cool_s > 0 then start_cooldown(KEYS[base + 5], cool_s) end
  if a[26] ~= '' then settle(KEYS[base + 6], a[26], tonumber(a[27])) end
  -- ARGV[4], when given: the charges with MoreLimits (a[10] '2') and the charges to settle
  -- (see `RedisStore._more_arguments`): C, C x MORE fields, S, reservation, actual, tokens,
  -- S x MORE fields; their tags are KEYS[base + 7...], the C charges' then the S settled. Then,
  -- when some scope has a soft limit: W, W x (the scope's index, its soft charge's MORE fields).
  local e, more, settles, softs, near = {}, {}, {}, {}, {}
  if #ARGV > 4 then -- (the last is the epoch the worker knows: `check_epoch`)
    local j = 1
    for field in string.gmatch(ARGV[4] .. '|', '([^|]*)|') do
      e[j] = field
      j = j + 1
    end
    local count = tonumber(e[1])
    more = more_charges(e, 2, count, base + 6, tonumber(a[15]))
    local s0 = 2 + MORE * count
    local settled = tonumber(e[s0])
    settles = more_charges(e, s0 + 4, settled, base + 6 + count, 0)
    for _, c in ipairs(settles) do
      settle_more(c, e[s0 + 1], tonumber(e[s0 + 2]), tonumber(e[s0 + 3]))
    end
    local w0 = s0 + 4 + MORE * settled
    for j = 1, tonumber(e[w0]) or 0 do
      local f = w0 + 1 + (MORE + 1) * (j - 1)
      local index = tonumber(e[f])
      softs[j] = {index, more_charges(e, f + 1, 1, base + 6 + index, 0)[1]}
    end
  end
  local single = {window = KEYS[base + 1], day_stem = KEYS[base + 2], spend_stem = KEYS[base + 3],
    per_minute = tonumber(a[11]), per_day = tonumber(a[12]), spend = tonumber(a[13]),
    cap = tonumber(a[14]), hold_s = tonumber(a[15]), reservation = a[16]}
  if mode == 'refund' then -- the last ARGV: the window entries of the receipt, one per charge
    local seqs = {}
    for field in string.gmatch(ARGV[#ARGV] .. ',', '([^,]*),') do seqs[#seqs + 1] = field end
    if a[10] == '1' then unpay(single, a[16], seqs[1]) end
    for j, c in ipairs(more) do unpay(c, a[16], seqs[j]) end
    return {''}
  end
  local policy = read_policy(a, 4)
  local waits, decisions = {}, {}
  for i = 1, n do waits[i] = cooldown_left(KEYS[i]) end
  local admitted, opened = nil, nil
  for i = 1, n do
    if waits[i] <= 0 then
      if policy == nil then
        admitted = i
        break
      end
      local before = load_breaker(KEYS[n + i])
      local age = tonumber(a[28 + i])
      if age and #before.failures > 0 then
        -- an earlier success the caller did not report: written whatever the admission becomes
        local forgotten = forget_before(before, policy, now - age)
        save_changed(KEYS[n + i], before, forgotten, policy.ttl_s)
        before = forgotten
      end
      local after, d = admit(before, policy)
      decisions[i] = d
      if d[1] == '1' then
        admitted = i
        opened = {KEYS[n + i], before, after}
        break
      end
    end
  end
  -- Redis Cluster (RedisStore._split_step): 'pay' charges with no leg, as if one were admitted,
  -- and answers a receipt; 'peek' decides the legs but writes no admission (no probe taken).
  if mode == 'pay' then admitted = 1 end
  local refused_by, retry, reservation = '', '', ''
  local paid = {}
  if admitted and a[10] == '1' then
    local c = single
    paid = {c}
    local refusal = charge(c)
    if refusal then
      refused_by, retry = refusal[1], refusal[2]
      admitted = nil -- nothing of the admission is written: no probe slot taken
    elseif c.spend then
      reservation = c.reservation
    end
  elseif admitted and a[10] == '2' then
    -- Every scope checked with nothing written, then every one charged: all or nothing.
    local refusal, index = nil, 0
    for j, c in ipairs(more) do
      c.reservation = a[16]
      local found = charge(c, true)
      if found then found = {found[1], tonumber(found[2])} end
      found = later(found, more_check(c))
      if c.tenant then
        local shared = share_check(c)
        if shared then
          c.unfair = true
          found = later(found, shared)
        end
      end
      if found and later(refusal, found) == found then refusal, index = found, j - 1 end
    end
    if refusal then
      for _, c in ipairs(more) do
        if c.unfair then share_add(c, 0, 0) end -- refused by its share: still active
      end
      refused_by = refusal[1]
      if refusal[2] then retry = fmt(refusal[2]) else retry = 'none' end
      retry = retry .. ' ' .. string.format('%d', index)
      admitted = nil
    else
      for _, c in ipairs(more) do
        charge(c, false)
        more_apply(c, a[16])
      end
      paid = more
      if a[16] ~= '' then reservation = a[16] end
      -- A scope past its soft limit: its soft charge refused, nothing written
      -- (guards.stores._limits.near_scopes).
      for _, soft in ipairs(softs) do
        if charge(soft[2], true) or more_check(soft[2]) then near[#near + 1] = string.format('%d', soft[1]) end
      end
    end
  end
  if admitted and opened and mode ~= 'peek' then
    save_changed(opened[1], opened[2], opened[3], policy.ttl_s)
    if opened[3].state ~= opened[2].state then admit_to = opened[3].state end
  end
  local receipt = ''
  if mode == 'pay' and refused_by == '' then
    -- Redis Cluster: what `unpay` needs to give the charge back (RedisStore._split_step).
    local seqs = {}
    for j, c in ipairs(paid) do seqs[j] = c.seq or '' end
    receipt = '#' .. fmt(now) .. ' ' .. table.concat(seqs, ',')
  end
  if admitted == 1 and refused_by == '' and reservation == '' and a[23] == '' and admit_to == '' and #near == 0 then
    -- The usual answer, in one letter: no report, no leg cooling down, the first leg admitted
    -- with no probe and no success to record, the charge passed without a hold.
    local plain = true
    for i = 1, n do
      if waits[i] > 0 then plain = false end
    end
    local d = decisions[1]
    if d and not (d[1] == '1' and d[2] == '' and d[3] == 'closed' and d[4] == '' and d[5] == '0') then
      plain = false
    end
    if plain then return {'P' .. receipt} end
  end
  local reply = {admitted and string.format('%d', admitted - 1) or '', refused_by, retry,
    reservation, recorded, report_to, admit_to}
  for i = 1, n do reply[#reply + 1] = fmt(waits[i]) end
  for i = 1, n do
    local d = decisions[i] or {'', '', '', '', ''}
    for j = 1, 5 do reply[#reply + 1] = d[j] end
  end
  if #near > 0 then reply[#reply + 1] = table.concat(near, ' ') end
  return {table.concat(reply, '|') .. receipt}
end

-- The health of models, read only: KEYS are L cooldown keys, then the L breaker keys. Returns
-- {now, the L waits, then L breaker states of 10 fields}.
local function health()
  local n = #KEYS / 2
  local reply = {fmt(now)}
  for i = 1, n do reply[#reply + 1] = fmt(cooldown_left(KEYS[i])) end
  for i = 1, n do
    local f = state_fields(load_breaker(KEYS[n + i]))
    for j = 1, 10 do reply[#reply + 1] = f[j] end
  end
  return reply
end

-- Tasks (see guards.stores._task for the same rules in Python). A task whose `exp` has passed
-- on the store's clock counts as gone, whatever the key's TTL says (an injected clock in tests).
local function task_live(key)
  local exp = tonumber(redis.call('HGET', key, 'exp') or '')
  return exp ~= nil and exp > now
end

local function task_held(key, lease)
  if not task_live(key) then return false end
  local f = redis.call('HMGET', key, 'lease', 'response')
  return f[1] == lease and not f[2]
end

-- A new task `member` in its owner's set of live tasks, kept ttl_s: the seconds until the
-- oldest leaves when the owner has `max_live` live already (nothing written), else nil.
local function track(owner, member, ttl_s, max_live)
  redis.call('ZREMRANGEBYSCORE', owner, '-inf', fmt(now))
  if max_live and redis.call('ZCARD', owner) >= max_live then
    local oldest = redis.call('ZRANGE', owner, 0, 0, 'WITHSCORES')
    return fmt(tonumber(oldest[2]) - now)
  end
  redis.call('ZADD', owner, fmt(now + ttl_s), member)
  local last = redis.call('ZRANGE', owner, -1, -1, 'WITHSCORES')
  redis.call('PEXPIRE', owner, math.max(1, math.ceil((tonumber(last[2]) - now) * 1000)))
  return nil
end

-- Returns {status, lease, response, retry_after, then the saved steps' names and values}.
-- `owner`: the owner's set of live tasks ('' for none); `max_live`: its cap (nil for none).
-- `elsewhere` (Redis Cluster): the owner's set key, in another slot: a new task records it,
-- touches no set and answers retry_after 'new' (RedisStore then tracks it with `task_track`).
local function task_claim(key, owner, fp, lease, lease_s, ttl_s, max_live, elsewhere)
  if not task_live(key) then
    local retry = ''
    if elsewhere then
      owner, retry = elsewhere, 'new'
    elseif owner ~= '' then
      local full = track(owner, key, ttl_s, max_live)
      if full then return {'full', '', '', full} end
    end
    redis.call('DEL', key)
    redis.call('HSET', key, 'fp', fp, 'lease', lease, 'until', fmt(now + lease_s), 'exp', fmt(now + ttl_s),
      'own', owner)
    redis.call('PEXPIRE', key, math.ceil(ttl_s * 1000))
    return {'claimed', lease, '', retry}
  end
  local flat = redis.call('HGETALL', key)
  local t, steps = {}, {}
  for i = 1, #flat, 2 do
    local name, value = flat[i], flat[i + 1]
    if string.sub(name, 1, 2) == 's:' then
      steps[#steps + 1] = string.sub(name, 3)
      steps[#steps + 1] = value
    else
      t[name] = value
    end
  end
  if t.fp ~= fp then return {'reused', '', '', ''} end
  if t.response then return {'done', '', t.response, ''} end
  local lease_end = tonumber(t['until'])
  if t.lease ~= '' and lease_end > now then return {'busy', '', '', fmt(lease_end - now)} end
  redis.call('HSET', key, 'lease', lease, 'until', fmt(now + lease_s))
  local reply = {'claimed', lease, '', ''}
  for i = 1, #steps do reply[#reply + 1] = steps[i] end
  return reply
end

if op == 'refund' then return step(op) end
-- Steps of several requests in one call (the client's coalescing: the steps its event loop
-- started in one turn): ARGV[3] the count, then per step the count of its KEYS, the count of
-- its fields and its fields (the ARGV of its own 'step' from ARGV[3]); KEYS are the steps'
-- own, one after the other. Each step runs as its own 'step' would, in order, at this call's
-- time; one that fails (a script error) is answered its error, and its neighbours theirs.
if op == 'steps' then
  local all_keys, all_args = KEYS, ARGV
  local replies, k, j = {}, 0, 4
  for s = 1, tonumber(all_args[3]) do
    local nk, na = tonumber(all_args[j]), tonumber(all_args[j + 1])
    KEYS = {unpack(all_keys, k + 1, k + nk)}
    ARGV = {'step', all_args[2], unpack(all_args, j + 2, j + 1 + na)}
    k, j = k + nk, j + 2 + na
    epoch = nil
    local ok, reply = pcall(function()
      check_epoch()
      local r = step('step')
      if epoch then r[#r + 1] = epoch end
      return r
    end)
    if ok then
      replies[s] = reply
    elseif type(reply) == 'table' and reply.err then
      replies[s] = reply
    else
      replies[s] = {err = tostring(reply)}
    end
  end
  return replies
end
if op == 'step' or op == 'peek' or op == 'pay' then
  check_epoch()
  local reply = step(op)
  if epoch then reply[#reply + 1] = epoch end -- a second element: the epoch found
  return reply
end
if op == 'health' then return health() end
if op == 'task_claim' then
  check_epoch()
  local elsewhere, owner = nil, KEYS[2]
  if #ARGV == 9 then elsewhere = ARGV[8] end
  if owner == KEYS[#KEYS] then owner = '' end -- Redis Cluster: an unused key is the marker
  local reply = task_claim(KEYS[1], owner, ARGV[3], ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6]),
    tonumber(ARGV[7]), elsewhere)
  if epoch then reply[#reply + 1] = epoch end -- after the steps' pairs: an odd one out
  return reply
end
if op == 'task_save' then
  if not task_held(KEYS[1], ARGV[3]) then return {'0'} end
  redis.call('HSET', KEYS[1], 's:' .. ARGV[4], ARGV[5], 'until', fmt(now + tonumber(ARGV[6])))
  return {'1'}
end
if op == 'task_complete' then
  if not task_held(KEYS[1], ARGV[3]) then return {'0'} end
  local gone = {}
  for _, name in ipairs(redis.call('HKEYS', KEYS[1])) do
    if string.sub(name, 1, 2) == 's:' then gone[#gone + 1] = name end
  end
  if #gone > 0 then redis.call('HDEL', KEYS[1], unpack(gone)) end
  redis.call('HSET', KEYS[1], 'response', ARGV[4], 'lease', '', 'until', '0')
  return {'1'}
end
if op == 'task_drop' then
  if not task_held(KEYS[1], ARGV[3]) then return {} end
  for _, name in ipairs(redis.call('HKEYS', KEYS[1])) do
    if string.sub(name, 1, 2) == 's:' then -- saved steps: kept, released
      redis.call('HSET', KEYS[1], 'lease', '', 'until', '0')
      return {}
    end
  end
  local owner = redis.call('HGET', KEYS[1], 'own')
  redis.call('DEL', KEYS[1])
  if owner and owner ~= '' then
    if ARGV[4] == 'c' then return {owner} end -- Redis Cluster: another slot (`task_untrack`)
    redis.call('ZREM', owner, KEYS[1])
  end
  return {}
end
-- Redis Cluster: a new task's entry in its owner's set (KEYS[1]), as `task_claim` makes it on
-- one server: {'full', retry_after} when the owner has `max_live` live tasks already.
if op == 'task_track' then
  local full = track(KEYS[1], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]))
  if full then return {'full', full} end
  return {}
end
if op == 'task_untrack' then
  redis.call('ZREM', KEYS[1], ARGV[3])
  return {}
end
if op == 'task_release' then
  if task_live(KEYS[1]) and redis.call('HGET', KEYS[1], 'lease') == ARGV[3] then
    redis.call('HSET', KEYS[1], 'lease', '', 'until', '0')
  end
  return {}
end
if op == 'budget' then
  return charge({window = KEYS[1], day_stem = KEYS[2], per_minute = tonumber(ARGV[3]),
    per_day = tonumber(ARGV[4])}) or {}
end
if op == 'reserve' then
  local refusal = charge({spend_stem = KEYS[1], spend = tonumber(ARGV[3]), cap = tonumber(ARGV[4]),
    hold_s = tonumber(ARGV[5]), reservation = ARGV[6]})
  if refusal then return {refusal[2]} end
  return {}
end
if op == 'settle' then
  settle(KEYS[1], ARGV[3], tonumber(ARGV[4]))
  return {}
end
if op == 'spent' then return {redis.call('HGET', KEYS[1] .. day_name(now), 'settled') or '0'} end
if op == 'now' then return {fmt(now)} end
if op == 'cooldown' then return {fmt(cooldown_left(KEYS[1]))} end
if op == 'cool' then
  start_cooldown(KEYS[1], tonumber(ARGV[3]))
  return {}
end
-- A last good answer: "<stored_at> <expires_at> <value>", kept ttl seconds. Read back only
-- while it has not expired on the store's clock and is younger than the reader's max age.
if op == 'put_answer' then
  local ms = math.ceil(tonumber(ARGV[4]) * 1000)
  if ms <= 0 then
    redis.call('DEL', KEYS[1])
    return {}
  end
  local stored = fmt(now) .. ' ' .. fmt(now + tonumber(ARGV[4])) .. ' '
  redis.call('SET', KEYS[1], stored .. ARGV[3], 'PX', string.format('%d', ms))
  return {}
end
if op == 'get_answer' then
  local raw = redis.call('GET', KEYS[1])
  if not raw then return {} end
  local first = string.find(raw, ' ', 1, true)
  local second = string.find(raw, ' ', first + 1, true)
  local stored = tonumber(string.sub(raw, 1, first - 1))
  local expires = tonumber(string.sub(raw, first + 1, second - 1))
  if expires <= now or now - stored >= tonumber(ARGV[3]) then return {} end
  return {string.sub(raw, second + 1), fmt(now - stored)}
end
if op == 'admit' then
  local policy = read_policy(ARGV, 3)
  local before = load_breaker(KEYS[1])
  local after, decision = admit(before, policy)
  save_changed(KEYS[1], before, after, policy.ttl_s)
  return decision
end
if op == 'record' then
  local policy = read_policy(ARGV, 3)
  local before = load_breaker(KEYS[1])
  local after = record(before, policy, ARGV[9], tonumber(ARGV[10]))
  save_changed(KEYS[1], before, after, policy.ttl_s)
  return state_fields(after)
end
return redis.error_reply('guards: unknown operation')
