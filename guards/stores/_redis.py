"""`RedisStore`: state in Redis, shared by every worker of every machine.

One round trip per operation: each operation is one `EVALSHA` of a single Lua script (loaded once
with `SCRIPT LOAD`, reloaded on `NOSCRIPT`) that does the whole check-and-charge atomically on
the server. Nothing is read in Python and written back. The one multi-key operation,
`cooldowns(keys)`, is one `EVALSHA` per key (each touching its own key only), all sent in one
pipeline: still one round trip for a whole fallback chain.

Keys (`<prefix>` is the store's; `{<key>}` is a Redis Cluster hash tag holding the guard's key,
with `%`, `{` and `}` percent-escaped, so every key of one operation lives in one slot):

- `<prefix>{<key>}:rate`: sorted set of admission times (the sliding minute), kept 60 s after
  the last admission;
- `<prefix>{<key>}:day:YYYY-MM-DD`: the day's admission counter, kept `DAILY_TTL_S` from its
  first unit;
- `<prefix>{<key>}:spend:YYYY-MM-DD`: hash of the day's spend: field `settled` (the settled
  total) and one field `h:<reservation>` = `"<amount> <expires_at>"` per hold, kept
  `DAILY_TTL_S` from the last hold;
- `<prefix>{<key>}:breaker`: the breaker state (one string), kept `Breaker.ttl_s` after its
  last write; a closed breaker without failures has no key;
- `<prefix>{<key>}:cooldown`: the time a cooldown ends (store time, `%.17g`), kept until then
  (set with `PX` in the script that writes it); no key while not cooling down;
- `<prefix>{<key>}:answer`: a route's last good answer (its key a hash): `"<stored_at>
  <expires_at> <value>"`, kept `ttl_s` (`PX`).
- `<prefix>{<key>}:task`: a multi-step task, one hash: `fp` (its fingerprint), `lease` (empty
  while nobody holds it), `until` (the lease's end), `exp` (the task's expiry, store time),
  `response` once it completed, and `s:<name>` per saved step; kept `ttl_s` from its creation.

Cooldowns of different keys live in different slots (each its own hash tag, like every other
key), so `cooldowns(keys)` never sends a multi-key script (a cross-slot error on Redis Cluster):
each key's read is an `EVALSHA` of its own, single-slot and atomic, and the reads of one call go
out together in one pipeline (one round trip). They are not one transaction across keys: each
key's answer is exact at its own instant, microseconds apart, which a fallback chain's choice
does not notice.

The script builds the daily keys' names itself (the day comes from the store's time), from the
stem it is given in KEYS (`...:day:`, `...:spend:`): same hash tag, so the same slot.

Every key gets its TTL in the script that writes it. Time comes from Redis (`TIME`) unless a
`clock` is given (tests): then the client passes `clock.time()`. Either way the script derives the
UTC day from it, so workers with skewed clocks agree on days.

Failures: every round trip is bounded by `timeout_s` (connect, send, each reply, and waiting for
a pooled connection; a reply's limit, `_Bound`, is not tripped by the worker's own event loop
being held up by other work while Redis answered in time), with no client-side retries; any
Redis or socket error raises `StoreUnavailable`, whose message names the error class only
(never the URL, host, port or password). The client reconnects by itself on the next operation
once Redis is back.

Event loops: a Redis asyncio client belongs to one event loop, so the store keeps one client per
running loop, created on first use there and closed when that loop shuts down (or by `aclose`).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import inspect
import math
import os
from collections.abc import AsyncGenerator, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import (
    AbstractConnection,
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
    parse_url,
)
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError, ResponseError

from .._breaker import Breaker, BreakerDecision, BreakerState, CircuitState, Outcome
from .._clock import Clock
from ._base import (
    ADMITTED,
    Admission,
    Health,
    Passage,
    SpendReservation,
    Step,
    StoredAnswer,
    StoreUnavailable,
    TaskClaim,
    TaskStatus,
    bounded_key,
)
from ._task import new_lease

__all__ = ["RedisStore"]

#: No CLIENT SETINFO round trips on connect (`driver_info` since redis-py 7, `lib_*` before).
_NO_CLIENT_INFO: dict[str, None] = (
    {"driver_info": None}
    if "driver_info" in inspect.signature(AbstractConnection.__init__).parameters
    else {"lib_name": None, "lib_version": None}
)

#: Connections per event loop. More concurrent operations wait for a free connection, within
#: the store's timeout.
_MAX_CONNECTIONS = 32

# The whole store on the server side. ARGV[1] is the operation, ARGV[2] the time ('' = Redis
# TIME). Numbers travel as strings in `%.17g` (exact for doubles) in both directions; Lua numbers
# are doubles, so every computation is the same IEEE arithmetic as MemoryStore's in Python.
_SCRIPT = r"""
if redis.replicate_commands then redis.replicate_commands() end

local op = ARGV[1]
local now
if ARGV[2] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
else
  now = tonumber(ARGV[2])
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

-- The day's spend hash: drops lapsed holds (and `drop`, a hold field) and returns the settled
-- total, the sum of live holds and the fields to delete.
local function read_spend(key, drop)
  local flat = redis.call('HGETALL', key)
  local settled, held, gone = 0, 0, {}
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
      end
    end
  end
  return settled, held, gone
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
local function charge(c)
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

local function settle(stem, reservation, actual)
  local key = stem .. day_name(now)
  local settled, _, gone = read_spend(key, 'h:' .. reservation)
  redis.call('HSET', key, 'settled', fmt(settled + actual))
  if #gone > 0 then redis.call('HDEL', key, unpack(gone)) end
  ensure_ttl(key, DAILY_TTL_MS)
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

-- Breakers: guards._breaker.admit / record, ported line for line. The state is one string:
-- "state opened_at probes last_probe_at successes probe_since expires_at failures", failures
-- comma-separated or '-'. expires_at (now + ttl_s at the last write) makes a key read after
-- its TTL on the store's clock count as gone, exactly like MemoryStore, whatever the clock.

local function closed()
  return {state = 'closed', failures = {}, opened_at = 0, probes = 0, last_probe_at = 0,
    successes = 0, probe_since = 0}
end

local function is_closed(s)
  return s.state == 'closed' and #s.failures == 0 and s.opened_at == 0 and s.probes == 0
    and s.last_probe_at == 0 and s.successes == 0 and s.probe_since == 0
end

local function load_breaker(key)
  local raw = redis.call('GET', key)
  if not raw then return closed() end
  local f = {}
  for word in string.gmatch(raw, '%S+') do f[#f + 1] = word end
  if tonumber(f[7]) <= now then return closed() end
  local failures = {}
  if f[8] ~= '-' then
    for t in string.gmatch(f[8], '[^,]+') do failures[#failures + 1] = tonumber(t) end
  end
  return {state = f[1], opened_at = tonumber(f[2]), probes = tonumber(f[3]),
    last_probe_at = tonumber(f[4]), successes = tonumber(f[5]), probe_since = tonumber(f[6]),
    failures = failures}
end

local function state_fields(s)
  local failures = {}
  for i, t in ipairs(s.failures) do failures[i] = fmt(t) end
  local joined = '-'
  if #failures > 0 then joined = table.concat(failures, ',') end
  return {s.state, fmt(s.opened_at), fmt(s.probes), fmt(s.last_probe_at), fmt(s.successes),
    fmt(s.probe_since), joined}
end

local function save_breaker(key, s, ttl_s)
  if is_closed(s) then
    redis.call('DEL', key) -- a healthy breaker needs no key at all
    return
  end
  local f = state_fields(s)
  local raw = table.concat({f[1], f[2], f[3], f[4], f[5], f[6], fmt(now + ttl_s), f[7]}, ' ')
  redis.call('SET', key, raw, 'PX', string.format('%d', math.ceil(ttl_s * 1000)))
end

-- Writes `after` unless it equals `before` (an open breaker's refusal, a closed one's
-- admission or success): a breaker is written only when its state changes.
local function save_changed(key, before, after, ttl_s)
  if table.concat(state_fields(before), ' ') ~= table.concat(state_fields(after), ' ') then
    save_breaker(key, after, ttl_s)
  end
end

-- A policy from args[i..i+5]: failure_threshold, window_s or '', reset_timeout_s,
-- half_open_probes, success_threshold, ttl_s. nil when args[i] is '' (no breaker).
local function read_policy(args, i)
  if args[i] == '' then return nil end
  return {
    failure_threshold = tonumber(args[i]), window_s = tonumber(args[i + 1]),
    reset_timeout_s = tonumber(args[i + 2]), half_open_probes = tonumber(args[i + 3]),
    success_threshold = tonumber(args[i + 4]), ttl_s = tonumber(args[i + 5]),
  }
end

local function copy(s)
  local c = {}
  for k, v in pairs(s) do c[k] = v end
  return c
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
    local reopen_at = s.opened_at + policy.reset_timeout_s
    if now < reopen_at then
      return s, {'0', '', s.state, fmt(reopen_at - now), '1'}
    end
    local opened_at = s.opened_at
    s = closed()
    s.state = 'half_open'
    s.opened_at = opened_at
    s.probe_since = now
  end
  if s.probes < policy.half_open_probes then
    s.probes = s.probes + 1
    s.last_probe_at = now
    return s, {'1', fmt(s.probe_since), s.state, '', '1'}
  end
  -- Every slot is taken: slots held longer than the reset timeout belong to calls that never
  -- reported; start a new generation of probes (the lost probes' tickets go stale).
  local reclaim_at = s.last_probe_at + policy.reset_timeout_s
  if now < reclaim_at then
    return s, {'0', '', s.state, fmt(reclaim_at - now), '1'}
  end
  s.probes = 1
  s.last_probe_at = now
  s.probe_since = now
  return s, {'1', fmt(s.probe_since), s.state, '', '1'}
end

-- As guards._breaker.forget_before: a closed breaker counting consecutive failures forgets
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
  return s2
end

local function record(s, policy, outcome, probe)
  s = copy(s)
  if probe ~= nil then
    if s.state ~= 'half_open' or probe ~= s.probe_since then return s end
    s.probes = math.max(0, s.probes - 1)
    if outcome == 'failure' then
      local opened = closed()
      opened.state = 'open'
      opened.opened_at = now
      return opened
    end
    if outcome == 'success' then
      if s.successes + 1 >= policy.success_threshold then return closed() end
      s.successes = s.successes + 1
      return s
    end
    return s
  end
  if s.state ~= 'closed' or outcome == 'released' then return s end
  if outcome == 'success' then
    if policy.window_s == nil then return closed() end
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
  if #last >= policy.failure_threshold then
    local opened = closed()
    opened.state = 'open'
    opened.opened_at = now
    return opened
  end
  local s2 = closed()
  s2.failures = last
  return s2
end

-- One step of a walk (see guards.stores.Step). KEYS: the legs' cooldown keys (L), their breaker
-- keys (L), then the charge's window key, day stem and spend stem, then the report's breaker
-- key, cooldown key and spend stem ('' where unused). ARGV[3]: the step's fields joined by '|'
-- (each packed command argument costs the client more than the script's split), numbered
-- from 3 in `a`: a[3] L; a[4..9] the step's breaker policy; a[10] '1' to charge: a[11..16]
-- per_minute, per_day, spend, cap, hold_s, reservation; a[17..22] the report's breaker policy,
-- a[23] outcome, a[24] probe; a[25] cooldown seconds; a[26] the reservation to settle, a[27]
-- its actual cost; a[28] the report's success age, a[29..28+L] the legs' ('' for none: see Step).
-- Returns one string, its fields joined by '|' (one reply to parse, not a
-- dozen): admitted index (0-based) or '', refused_by or '', retry_after, reservation or '',
-- recorded state or '', the state the report moved its breaker to or '', the state the
-- admission moved its breaker to or '', the L waits, then L decisions of 5 fields ('' for none).
local function step()
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
  local cool_s = tonumber(a[25])
  if cool_s and cool_s > 0 then start_cooldown(KEYS[base + 5], cool_s) end
  if a[26] ~= '' then settle(KEYS[base + 6], a[26], tonumber(a[27])) end
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
  local refused_by, retry, reservation = '', '', ''
  if admitted and a[10] == '1' then
    local c = {window = KEYS[base + 1], day_stem = KEYS[base + 2], spend_stem = KEYS[base + 3],
      per_minute = tonumber(a[11]), per_day = tonumber(a[12]), spend = tonumber(a[13]),
      cap = tonumber(a[14]), hold_s = tonumber(a[15]), reservation = a[16]}
    local refusal = charge(c)
    if refusal then
      refused_by, retry = refusal[1], refusal[2]
      admitted = nil -- nothing of the admission is written: no probe slot taken
    elseif c.spend then
      reservation = c.reservation
    end
  end
  if admitted and opened then
    save_changed(opened[1], opened[2], opened[3], policy.ttl_s)
    if opened[3].state ~= opened[2].state then admit_to = opened[3].state end
  end
  local reply = {admitted and string.format('%d', admitted - 1) or '', refused_by, retry,
    reservation, recorded, report_to, admit_to}
  for i = 1, n do reply[#reply + 1] = fmt(waits[i]) end
  for i = 1, n do
    local d = decisions[i] or {'', '', '', '', ''}
    for j = 1, 5 do reply[#reply + 1] = d[j] end
  end
  return {table.concat(reply, '|')}
end

-- The health of models, read only: KEYS are L cooldown keys, then the L breaker keys. Returns
-- {now, the L waits, then L breaker states of 7 fields}.
local function health()
  local n = #KEYS / 2
  local reply = {fmt(now)}
  for i = 1, n do reply[#reply + 1] = fmt(cooldown_left(KEYS[i])) end
  for i = 1, n do
    local f = state_fields(load_breaker(KEYS[n + i]))
    for j = 1, 7 do reply[#reply + 1] = f[j] end
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

-- Returns {status, lease, response, retry_after, then the saved steps' names and values}.
local function task_claim(key, fp, lease, lease_s, ttl_s)
  if not task_live(key) then
    redis.call('DEL', key)
    redis.call('HSET', key, 'fp', fp, 'lease', lease, 'until', fmt(now + lease_s), 'exp', fmt(now + ttl_s))
    redis.call('PEXPIRE', key, math.ceil(ttl_s * 1000))
    return {'claimed', lease, '', ''}
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

if op == 'step' then return step() end
if op == 'health' then return health() end
if op == 'task_claim' then
  return task_claim(KEYS[1], ARGV[3], ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6]))
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
"""

_SHA = hashlib.sha1(_SCRIPT.encode()).hexdigest()
_SHA_BYTES = _SHA.encode()


def _num(x: float | None) -> str:
    """A number as the script reads it ('' for None): `repr` of a float round-trips exactly."""
    return "" if x is None else repr(float(x))


def _tag(key: str) -> str:
    """`key` as a hash tag's content: `{`, `}` and `%` percent-escaped, so the tag is the whole
    key (one slot per key, spread over the cluster) and distinct keys stay distinct. The empty
    key becomes `%`, which no escaped key can be (an empty tag would not be a tag)."""
    return key.replace("%", "%25").replace("{", "%7B").replace("}", "%7D") or "%"


@dataclass(slots=True)
class _Link:
    """The store's client for one event loop."""

    client: Redis
    keeper: AsyncGenerator[None, None]
    #: The SCRIPT LOAD in flight, if any.
    loading: asyncio.Task[None] | None = None
    #: Operations waiting for the next round trip, with their callers' futures.
    queue: list[tuple[tuple[Any, ...], asyncio.Future[Any]]] = field(default_factory=list)
    #: Tasks sending the queue (strong references: the loop holds tasks weakly).
    flushes: set[asyncio.Task[None]] = field(default_factory=set)
    #: Round trips in flight.
    in_flight: int = 0


class RedisStore:
    """A `Store` in Redis: exact across every worker and machine sharing the server.

    `url`: `redis://[:password@]host:port/db` (or `rediss://`, `unix://`). `clock`: tests only
    (by default the time is Redis'). `timeout_s` bounds every round trip. `prefix` starts every
    key (no `{` or `}` in it: hash tags are the store's).
    """

    def __init__(
        self, url: str, *, clock: Clock | None = None, timeout_s: float = 0.1, prefix: str = "guards:"
    ) -> None:
        if "{" in prefix or "}" in prefix:
            raise ValueError("the key prefix must not contain '{' or '}' (the store's hash tags)")
        if not timeout_s > 0:
            raise ValueError("timeout_s must be positive")
        try:
            parse_url(url)
        except ValueError:
            raise ValueError("invalid Redis URL (expected redis://, rediss:// or unix://)") from None
        self._url = url
        self._clock = clock
        self._timeout_s = timeout_s
        self._prefix = prefix
        self._links: dict[asyncio.AbstractEventLoop, _Link] = {}
        #: Whether the script is in the server's cache as far as we know (NOSCRIPT says otherwise).
        self._loaded = False

    def __repr__(self) -> str:
        return f"RedisStore(prefix={self._prefix!r})"  # never the URL: it may carry a password

    # --- the Store operations ---------------------------------------------------------------

    @property
    def clock(self) -> Clock | None:
        """The clock the store's time comes from, when one was given (tests); None: the
        server's (Redis `TIME`)."""
        return self._clock

    async def now(self) -> float:
        if self._clock is not None:
            return self._clock.time()
        reply = await self._run("now", [])
        return float(reply[0])

    async def charge_budget(self, key: str, *, per_minute: int | None, per_day: int | None) -> Admission:
        if per_minute is None and per_day is None:
            return ADMITTED  # nothing to check, nothing to charge
        tag = self._key(key)
        reply = await self._run("budget", [tag + ":window", tag + ":day:"], _num(per_minute), _num(per_day))
        if not reply:
            return ADMITTED
        return Admission(False, str(reply[0]), float(reply[1]))

    async def reserve_spend(self, key: str, *, amount: float, cap: float, hold_s: float) -> SpendReservation:
        reservation = os.urandom(8).hex()
        reply = await self._run(
            "reserve",
            [self._key(key) + ":spend:"],
            _num(amount),
            _num(cap),
            _num(hold_s),
            reservation,
        )
        if not reply:
            return SpendReservation(True, reservation)
        return SpendReservation(False, retry_after_s=float(reply[0]))

    async def settle_spend(self, key: str, reservation: str, *, actual: float) -> None:
        await self._run("settle", [self._key(key) + ":spend:"], reservation, _num(actual))

    async def spent(self, key: str) -> float:
        reply = await self._run("spent", [self._key(key) + ":spend:"])
        return float(reply[0])

    async def breaker_admit(self, key: str, policy: Breaker) -> BreakerDecision:
        return _decision(await self._run("admit", [self._key(key) + ":breaker"], *_policy_args(policy)))

    async def breaker_record(
        self, key: str, policy: Breaker, outcome: Outcome, *, probe: float | None
    ) -> BreakerState:
        reply = await self._run(
            "record",
            [self._key(key) + ":breaker"],
            *_policy_args(policy),
            Outcome(outcome).value,
            _num(probe),
        )
        return _state(reply)

    async def cooldowns(self, keys: Sequence[str]) -> tuple[float, ...]:
        if not keys:
            return ()
        now = self._now_arg()
        replies = await self._run_all(
            [self._command("cooldown", [self._key(key) + ":cooldown"], now) for key in keys]
        )
        return tuple(float(reply[0]) for reply in replies)

    async def start_cooldown(self, key: str, seconds: float) -> None:
        if not seconds > 0:
            return  # nothing to start, and a running cooldown is never shortened
        await self._run("cool", [self._key(key) + ":cooldown"], _num(seconds))

    async def put_answer(self, key: str, value: str, *, ttl_s: float) -> None:
        await self._run("put_answer", [self._key(key) + ":answer"], value, _num(ttl_s))

    async def get_answer(self, key: str, *, max_age_s: float) -> StoredAnswer | None:
        reply = await self._run("get_answer", [self._key(key) + ":answer"], _num(max_age_s))
        return StoredAnswer(reply[0], float(reply[1])) if reply else None

    async def step(self, step: Step) -> Passage:
        legs, report, charge = step.legs, step.report, step.charge
        keys = [self._key(cooldown_key) + ":cooldown" for cooldown_key, _ in legs]
        keys += [self._key(breaker_key) + ":breaker" for _, breaker_key in legs]
        args: list[str] = [str(len(legs)), *_policy_args(step.breaker)]
        reservation = os.urandom(8).hex() if charge is not None and charge.spend is not None else ""
        if charge is None:
            keys += ["", "", ""]
            args += ["", "", "", "", "", "", ""]
        else:
            tag = self._key(charge.key)
            keys += [tag + ":window", tag + ":day:", tag + ":spend:"]
            args += ["1", _num(charge.per_minute), _num(charge.per_day), _num(charge.spend)]
            args += [_num(charge.spend_cap), _num(charge.hold_s), reservation]
        record = report is not None and report.breaker_key is not None and report.breaker is not None
        if report is None:
            keys += ["", "", ""]
            args += [*_policy_args(None), "", "", "", "", ""]
        else:
            keys += [
                self._key(report.breaker_key) + ":breaker" if record and report.breaker_key else "",
                self._key(report.cooldown_key) + ":cooldown" if report.cooldown_key else "",
                self._key(report.spend_key) + ":spend:" if report.spend_key else "",
            ]
            args += [*_policy_args(report.breaker if record else None), report.outcome.value]
            args += [_num(report.probe), _num(report.cooldown_s if report.cooldown_key else None)]
            settle = report.spend_key is not None and report.reservation is not None
            args += [report.reservation or "" if settle else "", _num(report.actual)]
        args.append(_num(report.success_age if record and report is not None else None))
        ages = step.success_ages
        if ages:
            args += [_num(age) for age in ages[: len(legs)]]
        # Every field is a number, a token or a hex reservation: none holds a '|'.
        reply = (await self._run("step", keys, "|".join(args)))[0].split("|")
        admitted, refused_by, retry_after, held, recorded, report_to, admit_to = reply[:7]
        n = len(legs)
        waits = tuple(float(wait) for wait in reply[7 : 7 + n])
        decisions = tuple(
            _decision(reply[7 + n + 5 * i : 12 + n + 5 * i]) if reply[7 + n + 5 * i] else None
            for i in range(n)
        )
        transitions: list[tuple[str, CircuitState]] = []
        if report_to and report is not None and report.breaker_key is not None:
            transitions.append((report.breaker_key, CircuitState(report_to)))
        if admit_to and admitted:
            transitions.append((legs[int(admitted)][1], CircuitState(admit_to)))
        if admitted:
            decisions = decisions[: int(admitted) + 1]
        else:
            last = max((i for i, d in enumerate(decisions) if d is not None), default=-1)
            decisions = decisions[: max(last + 1, n)]
        return Passage(
            waits,
            decisions,
            int(admitted) if admitted else None,
            Admission(False, refused_by, float(retry_after)) if refused_by else None,
            held or None,
            _state(recorded.split(" ")) if recorded else None,
            tuple(transitions),
        )

    async def health(self, legs: Sequence[tuple[str, str]]) -> Health:
        keys = [self._key(cooldown_key) + ":cooldown" for cooldown_key, _ in legs]
        keys += [self._key(breaker_key) + ":breaker" for _, breaker_key in legs]
        reply = await self._run("health", keys)
        n = len(legs)
        breakers = tuple(_state(reply[1 + n + 7 * i : 8 + n + 7 * i]) for i in range(n))
        return Health(float(reply[0]), breakers, tuple(float(wait) for wait in reply[1 : 1 + n]))

    async def task_claim(self, key: str, *, fingerprint: str, lease_s: float, ttl_s: float) -> TaskClaim:
        reply = await self._run(
            "task_claim", [self._key(key) + ":task"], fingerprint, new_lease(), _num(lease_s), _num(ttl_s)
        )
        status, lease, response, retry_after = reply[:4]
        pairs = reply[4:]
        return TaskClaim(
            TaskStatus(status),
            lease or None,
            dict(zip(pairs[::2], pairs[1::2], strict=True)),
            response if status == TaskStatus.done else None,
            float(retry_after) if retry_after else None,
        )

    async def task_save(self, key: str, lease: str, name: str, value: str, *, lease_s: float) -> bool:
        reply = await self._run("task_save", [self._key(key) + ":task"], lease, name, value, _num(lease_s))
        return reply[0] == "1"

    async def task_complete(self, key: str, lease: str, response: str) -> bool:
        reply = await self._run("task_complete", [self._key(key) + ":task"], lease, response)
        return reply[0] == "1"

    async def task_release(self, key: str, lease: str) -> None:
        await self._run("task_release", [self._key(key) + ":task"], lease)

    async def aclose(self) -> None:
        """Close the clients: this loop's now, other running loops' in their own loop. Clients
        of loops that already shut down were closed then. The store stays usable."""
        running = asyncio.get_running_loop()
        links, self._links = self._links, {}
        for loop, link in links.items():
            if loop is running:
                await link.keeper.aclose()
            elif not loop.is_closed():
                with suppress(RuntimeError):  # that loop closed meanwhile
                    asyncio.run_coroutine_threadsafe(_close(link), loop)

    # --- machinery -------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        return f"{self._prefix}{{{_tag(bounded_key(key))}}}"

    def _now_arg(self) -> str:
        """The script's time argument: '' (Redis TIME) unless the store has a clock."""
        return "" if self._clock is None else _num(self._clock.time())

    @staticmethod
    def _command(op: str, keys: Sequence[str], now: str, *args: str) -> tuple[Any, ...]:
        # Bytes: redis-py's packer takes them as they are (a str costs it a dozen more steps).
        return (
            b"EVALSHA",
            _SHA_BYTES,
            b"%d" % len(keys),
            *[key.encode() for key in keys],
            op.encode(),
            now.encode(),
            *[arg.encode() for arg in args],
        )

    async def _run(self, op: str, keys: Sequence[str], *args: str) -> list[str]:
        """One operation: one EVALSHA (see `_run_all`)."""
        (reply,) = await self._run_all([self._command(op, keys, self._now_arg(), *args)])
        return reply

    async def _run_all(self, commands: list[tuple[Any, ...]]) -> list[list[str]]:
        """EVALSHAs sent together, in one round trip: at once when nothing else is in flight in
        this loop; otherwise queued and sent with every operation queued meanwhile, in one
        pipeline (a burst costs a few round trips, not one each). Any failure to get an answer
        from Redis, to any of them, raises `StoreUnavailable`."""
        link = await self._link()
        try:
            if not self._loaded:
                # One SCRIPT LOAD for every caller waiting on it: if it fails, they all fail
                # together, within one timeout, instead of trying again one after the other.
                if link.loading is None or link.loading.done():
                    link.loading = asyncio.create_task(self._load(link.client))
                    link.loading.add_done_callback(_retrieve)
                await asyncio.shield(link.loading)
            if link.in_flight == 0:
                link.in_flight += 1
                try:
                    replies = await self._send(link.client, commands)
                finally:
                    link.in_flight -= 1
                for reply in replies:
                    if isinstance(reply, Exception):
                        raise reply
                return [[str(x) for x in reply] for reply in replies]
        except (RedisError, OSError) as exc:
            raise _unavailable(exc) from None
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Any]] = [loop.create_future() for _ in commands]
        if not link.queue:  # the first to wait: send the queue once the loop has run the others
            flush = asyncio.create_task(self._flush(link))
            link.flushes.add(flush)
            flush.add_done_callback(link.flushes.discard)
        link.queue.extend(zip(commands, futures, strict=True))  # in the same pipeline
        if len(futures) == 1:
            return [[str(x) for x in await futures[0]]]
        # gather: a failure answers at once, and the other futures' failures count as seen.
        return [[str(x) for x in reply] for reply in await asyncio.gather(*futures)]

    async def _flush(self, link: _Link) -> None:
        """Send every operation queued so far in this loop: one round trip for all of them."""
        batch, link.queue = link.queue, []
        batch = [(command, future) for command, future in batch if not future.done()]  # cancelled
        link.in_flight += 1
        try:
            if batch:
                replies = await self._send(link.client, [command for command, _ in batch])
                for (_, future), reply in zip(batch, replies, strict=True):
                    if future.done():
                        continue
                    if isinstance(reply, Exception):
                        future.set_exception(_unavailable(reply))
                    else:
                        future.set_result(reply)
        except (RedisError, OSError) as exc:
            for _, future in batch:
                if not future.done():
                    future.set_exception(_unavailable(exc))
        finally:
            link.in_flight -= 1
            for _, future in batch:  # cancelled (the loop is shutting down): nobody waits forever
                if not future.done():
                    future.set_exception(StoreUnavailable("Redis store unavailable (cancelled)"))

    async def _send(self, client: Redis, commands: list[tuple[Any, ...]]) -> list[Any]:
        """The replies to `commands` (a script error as an exception in its place), reloading
        the script once if the server lost it (restarted, or its script cache was flushed)."""
        if len(commands) == 1:
            try:
                return [await _execute(client, *commands[0])]
            except NoScriptError:
                await self._load(client)
                return [await _execute(client, *commands[0])]
            except ResponseError as exc:
                return [exc]
        replies = await _pipeline(client, commands)
        lost = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if lost:
            await self._load(client)
            for i, reply in zip(lost, await _pipeline(client, [commands[i] for i in lost]), strict=True):
                replies[i] = reply
        return replies

    async def _load(self, client: Redis) -> None:
        await _execute(client, "SCRIPT LOAD", _SCRIPT)
        self._loaded = True

    async def _link(self) -> _Link:
        loop = asyncio.get_running_loop()
        link = self._links.get(loop)
        if link is None:
            for other in [other for other in self._links if other.is_closed()]:
                del self._links[other]  # shut down without running its async generators' cleanup
            pool = BlockingConnectionPool.from_url(
                self._url,
                max_connections=_MAX_CONNECTIONS,
                timeout=self._timeout_s,
                socket_timeout=self._timeout_s,
                socket_connect_timeout=self._timeout_s,
                retry=Retry(NoBackoff(), 0),
                decode_responses=True,
                protocol=2,  # RESP3 would cost a HELLO round trip per connection
                **_NO_CLIENT_INFO,
            )
            # Replies waited for with a limit that a busy worker does not trip (`_Bound`).
            pool.connection_class = _LAG_AWARE.get(pool.connection_class, pool.connection_class)
            client = Redis.from_pool(pool)
            link = _Link(client, self._keep(loop, client))
            self._links[loop] = link  # before awaiting: concurrent first calls share it
            await anext(link.keeper)  # its first iteration registers it with the loop
        return link

    async def _keep(self, loop: asyncio.AbstractEventLoop, client: Redis) -> AsyncGenerator[None, None]:
        """Suspended for the client's life in its loop. An event loop closes its unfinished async
        generators when it shuts down (`asyncio.run` does), which closes the client in the loop
        that owns its connections."""
        try:
            yield
        finally:
            link = self._links.get(loop)
            if link is not None and link.client is client:
                del self._links[loop]
            with suppress(Exception):
                await client.aclose()


async def _execute(client: Redis, *command: Any) -> Any:
    return await client.execute_command(*command)  # type: ignore[no-untyped-call]


async def _pipeline(client: Redis, commands: list[tuple[Any, ...]]) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    return list(await pipe.execute(raise_on_error=False))


def _retrieve(task: asyncio.Task[None]) -> None:
    """Mark a load's failure as seen even if every caller waiting on it was cancelled."""
    if not task.cancelled():
        task.exception()


#: How late (seconds past its time) a `_Bound` must fire to have found the loop held up.
_LATE_S = 0.01
#: The longest a `_Bound` waits in all, in timeouts, however held up the loop is.
_MAX_TIMEOUTS = 10


class _Bound:
    """`with _Bound(timeout_s):` in a task: the store's limit on one wait for Redis (a reply).
    When it expires, the task is cancelled where it waits (redis-py then drops the connection,
    whose reply is unknown) and the block raises `TimeoutError`.

    A limit timed on the event loop also passes when the loop itself is held up by other work
    of the worker (a burst of requests, a blocking call), though Redis answered in time: the
    reply is then waiting in the socket, or read and waiting for the task to run. So a limit
    that comes due is checked first: when it fires late (by `_LATE_S` or more), or the loop
    then takes `_LATE_S` or more to come round once more (which also hands over a reply it
    already has), the worker, not Redis, was slow, and the limit waits another `timeout_s`.
    It expires when the loop keeps up and no reply came, or after `_MAX_TIMEOUTS` timeouts."""

    __slots__ = (
        "_cancelling",
        "_end",
        "_expired",
        "_handle",
        "_loop",
        "_probing",
        "_task",
        "_timeout_s",
        "_when",
    )

    def __init__(self, timeout_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a Redis round trip must run in a task")
        self._task = task
        self._timeout_s = timeout_s
        now = self._loop.time()
        self._when = now + timeout_s
        self._end = now + _MAX_TIMEOUTS * timeout_s
        self._expired = self._probing = False
        self._cancelling = 0
        self._handle: asyncio.Handle = self._loop.call_at(self._when, self._fire)

    def __enter__(self) -> _Bound:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self._handle.cancel()
        # `uncancel` whatever the exception: the expiry's cancel request is spent. A cancellation
        # also requested from elsewhere goes on as `CancelledError`.
        if self._expired and self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc

    def _fire(self) -> None:
        now = self._loop.time()
        if now < self._end:
            if now - self._when >= _LATE_S:  # the loop was held up: wait another timeout
                self._probing = False
                self._when = min(now + self._timeout_s, self._end)
                self._handle = self._loop.call_at(self._when, self._fire)
                return
            if not self._probing:  # due on time: see how the loop's next turn goes
                self._probing = True
                self._when = now
                self._handle = self._loop.call_soon(self._fire)
                return
        self._expired = True
        self._cancelling = self._task.cancelling()
        self._task.cancel()


class _LagAwareReads(AbstractConnection):
    """A connection whose wait for each reply is bounded by `_Bound` rather than redis-py's own
    limit (`socket_timeout`): a reply that came while the worker's event loop was held up by
    other work is taken, not counted as a timeout."""

    async def read_response(
        self,
        disable_decoding: bool = False,
        timeout: float | None = None,  # noqa: ASYNC109 (redis-py's signature)
        *,
        disconnect_on_error: bool = True,
        push_request: bool | None = False,
    ) -> Any:
        limit = self.socket_timeout
        if timeout is not None or not limit:  # a limit of the caller's own: as redis-py does
            return await super().read_response(
                disable_decoding, timeout, disconnect_on_error=disconnect_on_error, push_request=push_request
            )
        with _Bound(limit):
            return await super().read_response(
                disable_decoding, math.inf, disconnect_on_error=disconnect_on_error, push_request=push_request
            )


class _TCPConnection(_LagAwareReads, Connection):
    pass


class _TLSConnection(_LagAwareReads, SSLConnection):
    pass


class _UnixConnection(_LagAwareReads, UnixDomainSocketConnection):
    pass


#: redis-py's connection classes (by URL scheme), and the store's.
_LAG_AWARE: dict[type[AbstractConnection], type[AbstractConnection]] = {
    Connection: _TCPConnection,
    SSLConnection: _TLSConnection,
    UnixDomainSocketConnection: _UnixConnection,
}


def _unavailable(exc: BaseException) -> StoreUnavailable:
    # The class name only: redis-py's messages carry the host and port.
    return StoreUnavailable(f"Redis store unavailable ({type(exc).__name__})")


async def _close(link: _Link) -> None:
    await link.keeper.aclose()


def _decision(fields: Sequence[str]) -> BreakerDecision:
    allowed, probe, state, retry_after, record_success = fields
    return BreakerDecision(
        allowed == "1",
        probe=float(probe) if probe else None,
        state=CircuitState(state),
        retry_after_s=float(retry_after) if retry_after else None,
        record_success=record_success == "1",
    )


def _state(fields: Sequence[str]) -> BreakerState:
    state, opened_at, probes, last_probe_at, successes, probe_since, failures = fields
    return BreakerState(
        CircuitState(state),
        failures=tuple(float(t) for t in failures.split(",")) if failures != "-" else (),
        opened_at=float(opened_at),
        probes=int(probes),
        last_probe_at=float(last_probe_at),
        successes=int(successes),
        probe_since=float(probe_since),
    )


@functools.lru_cache(maxsize=64)  # a route's policy, formatted for each of its requests once
def _policy_args(policy: Breaker | None) -> tuple[str, ...]:
    if policy is None:
        return ("", "", "", "", "", "")
    return (
        _num(policy.failure_threshold),
        _num(policy.window_s),
        _num(policy.reset_timeout_s),
        _num(policy.half_open_probes),
        _num(policy.success_threshold),
        _num(policy.ttl_s),
    )
