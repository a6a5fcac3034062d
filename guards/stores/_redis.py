"""`RedisStore`: state in Redis, shared by every worker of every machine.

One round trip per operation: each operation is one `EVALSHA` of a single Lua script (loaded once
with `SCRIPT LOAD`, reloaded on `NOSCRIPT`) that does the whole check-and-charge atomically on
the server. Nothing is read in Python and written back. The one multi-key operation,
`cooldowns(keys)`, is one `EVALSHA` per key (each touching its own key only), all sent in one
pipeline: still one round trip for a whole fallback chain.

Keys (`<prefix>` is the store's; `{<key>}` is a Redis Cluster hash tag holding the guard's key,
with `%`, `{` and `}` percent-escaped, so every key of one budget, or of one model, lives in one
slot):

- `<prefix>{<key>}:rate`: sorted set of admission times (the sliding minute), kept 60 s after
  the last admission;
- `<prefix>{<key>}:day:YYYY-MM-DD`: the day's admission counter, kept `DAILY_TTL_S` from its
  first unit;
- `<prefix>{<key>}:spend:YYYY-MM-DD`: hash of the day's spend: field `settled` (the settled
  total) and one field `h:<reservation>` = `"<amount> <expires_at>"` per hold, kept
  `DAILY_TTL_S` from the last hold;
- `<prefix>{<key>}:breaker`: the breaker state (one string), kept `Breaker.ttl_s` after its
  last write; a closed breaker without failures (and no calls counted: `Breaker.slow_call_s`)
  has no key;
- `<prefix>{<key>}:cooldown`: the time a cooldown ends (store time, `%.17g`), kept until then
  (set with `PX` in the script that writes it); no key while not cooling down;
- `<prefix>{<key>}:answer`: a route's last good answer (its key a hash): `"<stored_at>
  <expires_at> <value>"`, kept `ttl_s` (`PX`).
- `<prefix>{<key>}:task`: a multi-step task, one hash: `fp` (its fingerprint), `lease` (empty
  while nobody holds it), `until` (the lease's end), `exp` (the task's expiry, store time),
  `own` (its owner's key, or empty), `response` once it completed, and `s:<name>` per saved
  step; kept `ttl_s` from its creation.
- `<prefix>epoch`: the store's epoch marker (see `guards.stores._epoch`), the one key without a
  TTL: read (and made again when missing) by every `step` and `task_claim`, whose KEYS end with
  it. It has no hash tag: its own slot. On Redis Cluster, one per hash slot used instead,
  `<prefix>{<slot's tag>}:epoch` (`slot_tag`), read by each script of a step in that slot.
- `<prefix>{<owner>}:tasks`: an owner's live tasks, a sorted set of task keys scored by their
  expiry (store time), kept until the last of them expires. (Dropping a task removes it from
  its owner's set, whose key the task's hash names: a key the script is not given, in
  another slot on Redis Cluster.)

On Redis Cluster a model's breaker and cooldown (the walk's `guards:breaker:<model>` and
`guards:cooldown:<model>`) share the tag `m:<model>`, each key then spelt whole after it
(`_key`): a model's keys in one slot. A step whose keys span slots is split into one script
per slot (see the "Redis Cluster" section of `RedisStore`); so are `health` and `task_claim`
(whose owner's set is in another slot), and `task_drop` leaves the owner's set to a script of
its own.

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

The client is the store's own (`_Wire`; hiredis packs the commands and parses the replies):
one connection per event loop carries every operation of that loop. The operations a loop
starts in one turn are written together at the turn's end, in one write, and Redis answers a
connection's commands in order, so a burst costs a few round trips, not one each, and nothing
waits for a free connection. A new connection's first write also carries its handshake (AUTH,
SELECT, and the SCRIPT LOAD if the script may be missing): no round trip of its own.

Failures: connecting and each reply are bounded by `timeout_s` (a limit that a worker's own
held-up event loop does not trip while Redis answered in time: see `_Wire`), with no client-side
retries. A reply overdue drops the connection and fails every operation waiting on it (they were
behind that reply); the next operation dials again, so the store is back as soon as Redis is.
Any Redis or socket error raises `StoreUnavailable`, whose message names the error class (or
the Redis error's code, such as `WRONGPASS`) only, never the URL, host, port or password. A
script error (say, a key of ours that another program overwrote) fails that operation alone.

Behind Redis Sentinel (`redis+sentinel://`), each new connection first asks the sentinels where
the primary is and checks its `ROLE` in the handshake; a connection lost, or an operation
answered `READONLY`, `LOADING` or `MASTERDOWN`, drops it, and the next operation asks again.

On Redis Cluster (`redis+cluster://`), each operation goes to the primary of its keys' slot (the
slot of its first key's hash tag: `key_slot`), on that loop's one connection to that primary;
the client (`guards.stores._cluster.Cluster`, one per event loop) learns the slots' primaries
with `CLUSTER SLOTS` and follows `MOVED`, `ASK` and `TRYAGAIN` (a bounded number of times, within
`timeout_s`). Each node's first connection carries the handshake and the SCRIPT LOAD; a
connection lost, or `CLUSTERDOWN`, fails the operation and the next one reads the slots again.

At each new connection (to each node, on a cluster) the server's `maxmemory-policy`,
`maxmemory`, `appendonly` and `save` are read (`CONFIG GET`, behind that turn's operations) and
a setting under which guards' keys can be evicted or lost is warned once (`_check_settings`).
Keys evicted are noticed at run time: `INFO stats` (`evicted_keys`) behind the `health` reads,
at most once a second per connection (each primary, on a cluster), a rise reported as a store
reset (`_watch_evictions`, `Epoch.evicted`).

Event loops: a connection belongs to one event loop, so the store keeps one per running loop,
made on first use there and closed when that loop shuts down (or by `aclose`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import hashlib
import os
import ssl
import time
import urllib.parse
from collections.abc import AsyncGenerator, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, cast

from ..contracts._extras import missing_extra

try:
    import hiredis
except ModuleNotFoundError as _error:  # the extra [redis]
    raise missing_extra(_error, "redis", "RedisStore") from None

from ..contracts._clock import Clock
from ..observe._log import emit, emit_warning
from ._base import (
    ADMITTED,
    Admission,
    Charge,
    Health,
    MoreLimits,
    Passage,
    Report,
    SpendReservation,
    Step,
    StoredAnswer,
    StoreUnavailable,
    TaskClaim,
    TaskStatus,
    bounded_key,
)
from ._breaker import ADMIT_CLOSED, Breaker, BreakerDecision, BreakerState, CircuitState, Outcome
from ._cluster import Cluster, Node, key_slot, slot_tag
from ._epoch import Epoch
from ._step import plainly_admitted
from ._task import new_lease

__all__ = ["RedisStore"]

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

-- The charges of ARGV[4] from field `at` of `e` (11 fields each), their tags from KEYS[k0 + 1].
local function more_charges(e, at, count, k0, hold_s)
  local charges = {}
  for j = 1, count do
    local f = at + 11 * (j - 1)
    local tag = KEYS[k0 + j]
    charges[j] = {tag = tag, window = tag .. ':window', day_stem = tag .. ':day:', spend_stem = tag .. ':spend:',
      per_minute = tonumber(e[f]), per_day = tonumber(e[f + 1]), spend = tonumber(e[f + 2]),
      cap = tonumber(e[f + 3]), per_month = tonumber(e[f + 4]), mspend = tonumber(e[f + 5]),
      spend_per_month = tonumber(e[f + 6]), tokens = tonumber(e[f + 7]), tpm = tonumber(e[f + 8]),
      tpd = tonumber(e[f + 9]), tpmo = tonumber(e[f + 10]), hold_s = hold_s}
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
  -- (see `RedisStore._more_arguments`): C, C x 11 fields, S, reservation, actual, tokens,
  -- S x 11 fields; their tags are KEYS[base + 7...], the C charges' then the S settled. Then,
  -- when some scope has a soft limit: W, W x (the scope's index, its soft charge's 11 fields).
  local e, more, settles, softs, near = {}, {}, {}, {}, {}
  if #ARGV > 4 then -- (the last is the epoch the worker knows: `check_epoch`)
    local j = 1
    for field in string.gmatch(ARGV[4] .. '|', '([^|]*)|') do
      e[j] = field
      j = j + 1
    end
    local count = tonumber(e[1])
    more = more_charges(e, 2, count, base + 6, tonumber(a[15]))
    local s0 = 2 + 11 * count
    local settled = tonumber(e[s0])
    settles = more_charges(e, s0 + 4, settled, base + 6 + count, 0)
    for _, c in ipairs(settles) do
      settle_more(c, e[s0 + 1], tonumber(e[s0 + 2]), tonumber(e[s0 + 3]))
    end
    local w0 = s0 + 4 + 11 * settled
    for j = 1, tonumber(e[w0]) or 0 do
      local f = w0 + 1 + 12 * (j - 1)
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
      if found and later(refusal, found) == found then refusal, index = found, j - 1 end
    end
    if refusal then
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
"""

_SHA = hashlib.sha1(_SCRIPT.encode()).hexdigest()


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
    """The store's connection in one event loop (replaced when it breaks), and what closes it
    when that loop shuts down."""

    wire: _Wire
    keeper: AsyncGenerator[None, None] = field(init=False)


@dataclass(slots=True)
class _Plan:
    """A step's scripts on Redis Cluster (`RedisStore._plan`): `whole`, the one script of a
    step whose keys share a slot; else `scripts`, the report's `parts` first, then a peek per
    group of legs (`grouped`: the legs' indices, per slot), then a pay per scope (`scopes`),
    all holds under `reservation`."""

    whole: tuple[Step, bytes, int] | None
    scripts: list[tuple[Step, bytes, int]] = field(default_factory=list)
    parts: int = 0
    grouped: list[list[int]] = field(default_factory=list)
    scopes: list[Charge] = field(default_factory=list)
    reservation: str = ""


@dataclass(slots=True)
class _ClusterLink:
    """On Redis Cluster, the store's client in one event loop, and what closes it when that
    loop shuts down."""

    cluster: Cluster
    keeper: AsyncGenerator[None, None] = field(init=False)


class RedisStore:
    """A `Store` in Redis: exact across every worker and machine sharing the server.

    `url`: `redis://[[user]:password@]host:port/db`, `rediss://...` (TLS),
    `unix:///path/to/socket?db=n`, `redis+sentinel://...` or `redis+cluster://host:port,...`,
    with the options `_Address` lists. `clock`: tests only (by default the time is Redis').
    `timeout_s` bounds every round trip. `prefix` starts every key (no `{` or `}` in it: hash
    tags are the store's): by default the URL's `prefix` option
    (`redis://host:6379/0?prefix=billing:`), else `guards:`. Apps that share one Redis share
    the state of what they name alike (a model's breaker and cooldown, a budget of the same
    scope and caller); a prefix of their own keeps them apart.
    """

    def __init__(
        self, url: str, *, clock: Clock | None = None, timeout_s: float = 0.1, prefix: str | None = None
    ) -> None:
        self._address = _Address.parse(url)
        prefix = prefix if prefix is not None else self._address.prefix or "guards:"
        if "{" in prefix or "}" in prefix:
            raise ValueError("the key prefix must not contain '{' or '}' (the store's hash tags)")
        if not timeout_s > 0:
            raise ValueError("timeout_s must be positive")
        self._clock = clock
        self._timeout_s = timeout_s
        self._prefix = prefix
        self._links: dict[asyncio.AbstractEventLoop, _Link] = {}
        #: On Redis Cluster: the client per event loop (`_links` stays empty), and the nodes
        #: that were sent the script (a node's first connection sends it).
        self._cluster = bool(self._address.cluster)
        self._clusters: dict[asyncio.AbstractEventLoop, _ClusterLink] = {}
        self._scripted: set[Node] = set()
        #: On Redis Cluster, per step without anything of its own: its scripts (`_split_step`).
        self._plans: dict[int, tuple[Step, _Plan]] = {}
        #: Per step without anything of its own (see `step`): its keys and fixed arguments.
        self._fixed: dict[int, tuple[Step, list[str], str]] = {}
        #: Whether the script is in the server's cache as far as we know (NOSCRIPT says otherwise).
        self._loaded = False
        #: The store's epoch marker (see `guards.stores._epoch`): outside every hash tag.
        self._epoch_key = f"{prefix}epoch"
        self._epoch = Epoch("redis")
        #: The server settings already warned about, (setting, value): once per store each.
        self._warned: set[tuple[str, str]] = set()
        #: Operations refused for memory (OOM) since the last `store_out_of_memory` line, and
        #: when the next line may be written (monotonic).
        self._oom_count = 0
        self._oom_next = 0.0

    def __repr__(self) -> str:
        return f"RedisStore(prefix={self._prefix!r})"  # never the URL: it may carry a password

    @property
    def cluster(self) -> bool:
        """Whether the store is on Redis Cluster (`redis+cluster://`, `rediss+cluster://`)."""
        return self._cluster

    @property
    def epoch(self) -> Epoch:
        """The store's epoch as this worker knows it, and the resets it noticed (see
        docs/stores.md, "When the store forgets")."""
        return self._epoch

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
        # One EVALSHA per key, all written in this turn: one round trip.
        replies = await asyncio.gather(*(self._call(*self._cooldown_read(key, now)) for key in keys))
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
        if self._cluster:
            return await self._split_step(step)
        legs, report, charge = step.legs, step.report, step.charge
        if report is None and (
            charge is None
            or (charge.spend is None and len(charge.key) <= _MAX_FIXED_KEY and charge.more is None)
        ):
            # Nothing of its own in it (a request's first step, which the route keeps per
            # caller): its keys and fixed arguments are made once.
            # (The entry holds the step: no other object can have its id while it is kept.)
            fixed = self._fixed.get(id(step)) or self._fix(step)
            keys, args = fixed[1], fixed[2]
        else:
            keys, args = self._step_arguments(step)
        ages = step.success_ages
        if ages:
            args = "|".join([args, *[_num(age) for age in ages[: len(legs)]]])
        if (charge is not None and charge.more is not None) or (
            report is not None and report.charge is not None
        ):
            # The charges' tags before the epoch marker's key, which stays last; their fields
            # are ARGV[4], before the epoch the worker knows (last: ARGV[5]).
            more_keys, more = self._more_arguments(step, args)
            command = _pack(
                "step", [*keys[:-1], *more_keys, keys[-1]], self._now_arg(), (args, more, self._epoch.known)
            )
        else:
            command = _pack("step", keys, self._now_arg(), (args, self._epoch.known))
        replies = await self._call(command)
        if len(replies) > 1:  # the store's epoch is not the one this worker knew
            self._epoch.found(replies[1])
        reply = replies[0]
        if reply == "P":  # the usual answer (see the script's `step`)
            return plainly_admitted(len(legs), step.breaker is not None)
        return self._passage(step, reply.split("|"))

    def _fix(self, step: Step) -> tuple[Step, list[str], str]:
        if len(self._fixed) >= _MAX_FIXED:
            del self._fixed[next(iter(self._fixed))]  # the oldest
        fixed = self._fixed[id(step)] = (step, *self._step_arguments(step))
        return fixed

    def _step_arguments(self, step: Step, reservation: str | None = None) -> tuple[list[str], str]:
        """The script's keys for `step`, and its fields joined by '|' up to the legs' success
        ages (see the script's `step`). `reservation`: the hold's (made here when None)."""
        legs, report, charge = step.legs, step.report, step.charge
        keys = [self._key(cooldown_key) + ":cooldown" for cooldown_key, _ in legs]
        keys += [self._key(breaker_key) + ":breaker" for _, breaker_key in legs]
        args: list[str] = [str(len(legs)), *_policy_args(step.breaker)]
        if reservation is None:
            reservation = os.urandom(8).hex() if charge is not None and _holds(charge) else ""
        if charge is None:
            keys += ["", "", ""]
            args += ["", "", "", "", "", "", ""]
        else:
            tag = self._key(charge.key)
            keys += [tag + ":window", tag + ":day:", tag + ":spend:"]
            args += ["1" if charge.more is None else "2", _num(charge.per_minute), _num(charge.per_day)]
            args += [_num(charge.spend), _num(charge.spend_cap), _num(charge.hold_s), reservation]
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
            cooling = report.cooldown_key is not None
            cooldown = _num(report.cooldown_s if cooling else None)
            if cooling and report.cooldown_until is not None:
                cooldown += " " + _num(report.cooldown_until)
            args += [_num(report.probe), cooldown]
            settle = report.spend_key is not None and report.reservation is not None
            args += [report.reservation or "" if settle else "", _num(report.actual)]
        args.append(_num(report.success_age if record and report is not None else None))
        keys.append(self._epoch_key)  # always the last key (the script's `check_epoch`)
        # Every field is a number, a token or a hex reservation: none holds a '|'.
        return keys, "|".join(args)

    def _more_arguments(self, step: Step, args: str) -> tuple[list[str], str]:
        """The script's keys and ARGV[4] for the charges with `MoreLimits` of `step` (its
        charge's scopes) and of its report (to settle): the tag of each charge's keys, and
        their fields (see the script's `step`)."""
        charge, report = step.charge, step.report
        charged = () if charge is None or charge.more is None else (charge, *charge.more.also)
        settled = (
            ()
            if report is None or report.charge is None or report.reservation is None
            else (
                report.charge,
                *(report.charge.more.also if report.charge.more is not None else ()),
            )
        )
        keys = [self._key(each.key) for each in (*charged, *settled)]
        fields = [str(len(charged)), *[f for each in charged for f in _more_fields(each)], str(len(settled))]
        if report is not None:
            fields += [report.reservation or "", _num(report.actual), _num(report.tokens)]
        else:
            fields += ["", "", ""]
        fields += [f for each in settled for f in _more_fields(each)]
        if charge is not None and charge.more is not None and charge.more.watched:
            softs = [
                (index, each.more.soft)
                for index, each in enumerate(charged)
                if each.more is not None and each.more.soft is not None
            ]
            fields.append(str(len(softs)))
            for index, soft in softs:
                fields += [str(index), *_more_fields(soft)]
        return keys, "|".join(fields)

    @staticmethod
    def _passage(step: Step, reply: list[str]) -> Passage:
        legs, report = step.legs, step.report
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
            _refusal(refused_by, retry_after) if refused_by else None,
            held or None,
            _state(recorded.split(" ")) if recorded else None,
            tuple(transitions),
            near=tuple(int(index) for index in reply[7 + 6 * n].split(" ")) if len(reply) > 7 + 6 * n else (),
        )

    async def health(self, legs: Sequence[tuple[str, str]]) -> Health:
        self._watch_evictions()
        if self._cluster:
            return await self._split_health(legs)
        keys = [self._key(cooldown_key) + ":cooldown" for cooldown_key, _ in legs]
        keys += [self._key(breaker_key) + ":breaker" for _, breaker_key in legs]
        reply = await self._run("health", keys)
        n = len(legs)
        breakers = tuple(_state(reply[1 + n + 10 * i : 11 + n + 10 * i]) for i in range(n))
        return Health(float(reply[0]), breakers, tuple(float(wait) for wait in reply[1 : 1 + n]))

    async def task_claim(
        self,
        key: str,
        *,
        fingerprint: str,
        lease_s: float,
        ttl_s: float,
        owner: str | None = None,
        max_live: int | None = None,
    ) -> TaskClaim:
        if self._cluster:
            return await self._split_task_claim(key, fingerprint, lease_s, ttl_s, owner, max_live)
        keys = [self._key(key) + ":task", self._key(owner) + ":tasks" if owner is not None else ""]
        keys.append(self._epoch_key)  # last (the script's `check_epoch`)
        known = self._epoch.known
        reply = await self._run(
            "task_claim", keys, fingerprint, new_lease(), _num(lease_s), _num(ttl_s), _num(max_live), known
        )
        return self._task_claim_reply(reply, None)

    def _task_claim_reply(self, reply: list[str], slot: int | None) -> TaskClaim:
        """`task_claim`'s answer from the script's reply (its epoch learnt for `slot`: Redis
        Cluster; None: the store's one marker)."""
        status, lease, response, retry_after = reply[:4]
        pairs = reply[4:]
        if len(pairs) % 2:  # the store's epoch, after the steps' pairs: not the one this worker knew
            if slot is None:
                self._epoch.found(pairs.pop())
            else:
                self._epoch.found_in(slot, pairs.pop())
        elif slot is not None:
            self._epoch.seen_in(slot)
        return TaskClaim(
            TaskStatus(status),
            lease or None,
            dict(zip(pairs[::2], pairs[1::2], strict=True)),
            response if status == TaskStatus.done else None,
            float(retry_after) if retry_after and retry_after != "new" else None,
        )

    async def task_save(self, key: str, lease: str, name: str, value: str, *, lease_s: float) -> bool:
        reply = await self._run("task_save", [self._key(key) + ":task"], lease, name, value, _num(lease_s))
        return reply[0] == "1"

    async def task_complete(self, key: str, lease: str, response: str) -> bool:
        reply = await self._run("task_complete", [self._key(key) + ":task"], lease, response)
        return reply[0] == "1"

    async def task_release(self, key: str, lease: str) -> None:
        await self._run("task_release", [self._key(key) + ":task"], lease)

    async def task_drop(self, key: str, lease: str) -> None:
        if not self._cluster:
            await self._run("task_drop", [self._key(key) + ":task"], lease)
            return
        owner = await self._run("task_drop", [self._key(key) + ":task"], lease, "c")
        if owner:  # the owner's set of live tasks: in another slot
            await self._run("task_untrack", owner, self._key(key) + ":task")

    async def aclose(self) -> None:
        """Close the clients: this loop's now, other running loops' in their own loop. Clients
        of loops that already shut down were closed then. The store stays usable."""
        running = asyncio.get_running_loop()
        links: dict[asyncio.AbstractEventLoop, _Link | _ClusterLink] = {**self._links, **self._clusters}
        self._links, self._clusters = {}, {}
        for loop, link in links.items():
            if loop is running:
                await link.keeper.aclose()
            elif not loop.is_closed():
                with suppress(RuntimeError):  # that loop closed meanwhile
                    asyncio.run_coroutine_threadsafe(_close(link), loop)

    # --- Redis Cluster: operations split per slot ------------------------------------------
    #
    # A script reaches the keys of one hash slot only. An operation whose keys all share a slot
    # (a one-model route without a budget: a model's breaker and cooldown share the model's
    # slot, see `_key`) is the one script it is on one server, with that slot's epoch marker.
    # A step whose keys span slots is split (`_split_step`):
    #
    # 1. one round trip, a script per slot, all sent together: each part of its report in its
    #    slot (written whatever follows); the legs of each slot peeked ('peek': decided in order,
    #    success ages applied, nothing of an admission written); and the charge paid ('pay'):
    #    one script when every scope shares a slot, all or nothing as on one server, else one
    #    per scope;
    # 2. the charge given back ('refund', one round trip, in each slot that took it) when the
    #    step admits no leg, or when a scope refused: so a refusal charges nothing, as on one
    #    server;
    # 3. when the first leg that may be admitted is a half-open probe: that leg admitted for
    #    real, alone in its slot, once the charge passed (another worker may have taken the
    #    probe meanwhile: the next legs are then admitted one at a time, for real; none: 2).
    #
    # Atomic: each script. Across slots: the legs' decision and the charge are made at the same
    # instant, not as one (a breaker that opens in between lets that one request through, as if
    # it had come a moment earlier), and a charge given back was there meanwhile (a request of
    # the same caller in that round trip may be refused for it: never admitted over a cap).

    def _slot_keys(self, keys: list[str]) -> tuple[list[str], int | None]:
        """A script's `keys` (the epoch marker's last) on a cluster: the keys with the marker
        and every unused key ('': the script never touches those) turned into the slot's
        marker, and the slot (None when the keys span slots)."""
        slots = {key_slot(key) for key in keys[:-1] if key}
        if len(slots) > 1:
            return keys, None
        slot = slots.pop() if slots else 0
        marker = f"{self._prefix}{{{slot_tag(slot)}}}:epoch"
        return [key or marker for key in keys[:-1]] + [marker], slot

    def _script(
        self, op: str, step: Step, reservation: str | None = None, receipt: str | None = None
    ) -> tuple[Step, bytes, int] | None:
        """`step` as the script's `op` in one slot (None when its keys span slots): the step,
        the packed command and the slot. `receipt` (a 'refund'): the 'pay' receipt's time and
        window entries, in place of the time and the epoch."""
        keys, args = self._step_arguments(step, reservation)
        ages = step.success_ages
        if ages:
            args = "|".join([args, *[_num(age) for age in ages[: len(step.legs)]]])
        charge, report = step.charge, step.report
        more = None
        if (charge is not None and charge.more is not None) or (
            report is not None and report.charge is not None
        ):
            more_keys, more = self._more_arguments(step, args)
            keys = [*keys[:-1], *more_keys, keys[-1]]
        keys, slot = self._slot_keys(keys)
        if slot is None:
            return None
        now, last = self._now_arg(), self._epoch.known_in(slot)
        if receipt is not None:
            now, _, last = receipt.partition(" ")
        fields = (args, last) if more is None else (args, more, last)
        return step, _pack(op, keys, now, fields), slot

    def _one_slot(
        self, op: str, step: Step, reservation: str | None = None, receipt: str | None = None
    ) -> tuple[Step, bytes, int]:
        script = self._script(op, step, reservation, receipt)
        if script is None:
            raise ValueError(
                "on Redis Cluster, a leg's cooldown and breaker keys share a slot: name them "
                "guards:cooldown:<model> and guards:breaker:<model>"
            )
        return script

    async def _scripts(self, scripts: Sequence[tuple[Step, bytes, int]]) -> list[tuple[Passage, str]]:
        """Each script sent to its slot, all in one round trip; their passages, and each
        'pay' receipt ('' for other scripts, and for a refused charge)."""
        replies = await asyncio.gather(
            *(self._call(command, slot) for _, command, slot in scripts), return_exceptions=True
        )
        answers = []
        for (step, _, slot), replies_ in zip(scripts, replies, strict=True):
            if isinstance(replies_, BaseException):
                raise replies_
            if len(replies_) > 1:  # the slot's epoch is not the one this worker knew
                self._epoch.found_in(slot, replies_[1])
                self._plans.clear()  # (their scripts carry the epoch they knew)
            else:
                self._epoch.seen_in(slot)
            reply, _, receipt = replies_[0].partition("#")
            if not reply:  # a 'refund': nothing to say
                answers.append((Passage(), receipt))
            elif reply == "P":
                answers.append((plainly_admitted(len(step.legs), step.breaker is not None), receipt))
            else:
                answers.append((self._passage(step, reply.split("|")), receipt))
        return answers

    async def _split_step(self, step: Step) -> Passage:
        """`step` on a cluster (see the section's comment)."""
        if step.report is not None or step.success_ages or self._clock is not None:
            plan = self._plan(step)  # (ages read now; a clock's time)
        elif (planned := self._plans.get(id(step))) is not None and planned[0] is step:
            plan = planned[1]
        else:
            plan = self._plan(step)
            if not plan.reservation:
                # Nothing of its own in it (a request's first step, which the route keeps per
                # caller): its scripts are made once (until an epoch changes: `_scripts`).
                # (The entry holds the step: no other object can have its id while it is kept.)
                if len(self._plans) >= _MAX_FIXED:
                    del self._plans[next(iter(self._plans))]  # the oldest
                self._plans[id(step)] = (step, plan)
        if plan.whole is not None:
            return (await self._scripts([plan.whole]))[0][0]
        legs, report, policy, ages = step.legs, step.report, step.breaker, step.success_ages
        scripts, parts, grouped, scopes, reservation = (
            plan.scripts,
            plan.parts,
            plan.grouped,
            plan.scopes,
            plan.reservation,
        )
        answers = await self._scripts(scripts)
        recorded = None
        transitions: list[tuple[str, CircuitState]] = []
        for passage, _ in answers[:parts]:
            if passage.recorded is not None:
                recorded = passage.recorded
            transitions += passage.transitions
        n = len(legs)
        waits = [0.0] * n
        decisions: list[BreakerDecision | None] = [None] * n
        for indices, (passage, _) in zip(grouped, answers[parts : parts + len(grouped)], strict=True):
            for j, i in enumerate(indices):
                waits[i] = passage.waits[j]
                if j < len(passage.decisions):
                    decisions[i] = passage.decisions[j]
        paid = answers[parts + len(grouped) :]
        refusal: Admission | None = None
        if len(paid) == 1:
            refusal = paid[0][0].refusal  # (its scope already named: one script for them all)
        elif paid:
            refusal = _latest([passage for passage, _ in paid])
        # 2. The first leg that may be admitted; a probe taken for real once the charge passed
        # (and, once a probe was lost to another worker, each next leg decided for real).
        admitted: int | None = None
        lost = False
        for index in range(n):
            decision = decisions[index]
            if not lost:
                if waits[index] > 0:
                    continue
                if policy is None or (decision is not None and decision.allowed and decision.probe is None):
                    admitted = index
                    break
                if decision is None or not decision.allowed:
                    continue
                if refusal is not None:  # a probe the charge refused: nothing of it taken
                    admitted = index
                    break
            real = Step(None, [legs[index]], policy, None, [ages[index]] if index < len(ages) else ())
            taken = (await self._scripts([self._one_slot("step", real)]))[0][0]
            waits[index] = taken.waits[0]
            decisions[index] = decision = taken.decisions[0] if taken.decisions else None
            transitions += taken.transitions
            if taken.admitted is not None:
                admitted = index
                break
            lost = True
        if admitted is None:
            refusal = None  # no leg: the charge is not the answer (as on one server)
        if (admitted is None or refusal is not None) and any(receipt for _, receipt in paid):
            # Given back: no leg admitted, or a scope refused.
            await self._scripts(
                [
                    self._one_slot("refund", Step(None, (), None, scope), reservation, receipt)
                    for scope, (_, receipt) in zip(scopes, paid, strict=True)
                    if receipt
                ]
            )
        reserved: str | None = None
        near: tuple[int, ...] = ()
        if refusal is not None:
            admitted = None
        elif admitted is not None and paid:
            reserved = reservation if any(passage.reservation for passage, _ in paid) else None
            if len(paid) == 1:
                near = paid[0][0].near
            else:
                near = tuple(index for index, (passage, _) in enumerate(paid) if passage.near)
        kept = decisions[: admitted + 1] if admitted is not None else decisions
        if (
            report is None
            and admitted == 0
            and reserved is None
            and not near
            and not any(waits)
            and (policy is None or kept[0] == ADMIT_CLOSED)
        ):
            return plainly_admitted(n, policy is not None)
        return Passage(
            tuple(waits),
            tuple(kept),
            admitted,
            refusal,
            reserved,
            recorded,
            tuple(transitions),
            near=near,
        )

    def _plan(self, step: Step) -> _Plan:
        """`step`'s scripts on a cluster: the one script when its keys share a slot; else the
        report's parts, the legs' peeks (one per slot) and the charge's pays, in that order."""
        whole = self._script("step", step)
        if whole is not None:
            return _Plan(whole)
        legs, report, policy, charge = step.legs, step.report, step.breaker, step.charge
        ages = step.success_ages
        scripts = []
        for part in _report_parts(report):
            script = self._script("step", Step(part))
            if script is None:  # a breaker and a cooldown in two slots: one script each
                scripts += [self._one_slot("step", Step(half)) for half in _halves(part)]
            else:
                scripts.append(script)
        parts = len(scripts)
        groups: dict[int, list[int]] = {}
        for index, (_, breaker_key) in enumerate(legs):
            groups.setdefault(key_slot(self._key(breaker_key)), []).append(index)
        grouped = list(groups.values())
        for indices in grouped:
            peeked = Step(
                None,
                [legs[i] for i in indices],
                policy,
                None,
                [ages[i] if i < len(ages) else None for i in indices] if ages else (),
            )
            scripts.append(self._one_slot("peek", peeked))
        reservation = os.urandom(8).hex() if charge is not None and _holds(charge) else ""
        scopes: list[Charge] = []
        if charge is not None and legs:
            whole_charge = self._script("pay", Step(None, (), None, charge), reservation)
            if whole_charge is not None:
                scopes = [charge]
                scripts.append(whole_charge)
            else:
                assert charge.more is not None  # (scopes in several slots)
                scopes = [_alone(each, charge.hold_s) for each in (charge, *charge.more.also)]
                scripts += [self._one_slot("pay", Step(None, (), None, each), reservation) for each in scopes]
        return _Plan(None, scripts, parts, grouped, scopes, reservation)

    async def _split_health(self, legs: Sequence[tuple[str, str]]) -> Health:
        """`health` on a cluster: one script per slot of the legs, in one round trip."""
        groups: dict[int, list[int]] = {}
        for index, (cooldown_key, breaker_key) in enumerate(legs):
            slot = key_slot(self._key(breaker_key))
            if key_slot(self._key(cooldown_key)) != slot:
                raise ValueError(
                    "on Redis Cluster, a leg's cooldown and breaker keys share a slot: name them "
                    "guards:cooldown:<model> and guards:breaker:<model>"
                )
            groups.setdefault(slot, []).append(index)
        if not groups:
            return Health(float((await self._run("health", []))[0]), (), ())
        grouped = list(groups.items())
        sent = []
        for slot, indices in grouped:
            keys = [self._key(legs[i][0]) + ":cooldown" for i in indices]
            keys += [self._key(legs[i][1]) + ":breaker" for i in indices]
            sent.append(self._call(_pack("health", keys, self._now_arg(), ()), slot))
        replies = await asyncio.gather(*sent, return_exceptions=True)
        n = len(legs)
        waits = [0.0] * n
        breakers = [BreakerState()] * n
        for (_, indices), reply in zip(grouped, replies, strict=True):
            if isinstance(reply, BaseException):
                raise reply
            m = len(indices)
            for j, i in enumerate(indices):
                waits[i] = float(reply[1 + j])
                breakers[i] = _state(reply[1 + m + 10 * j : 11 + m + 10 * j])
        first = replies[0]
        assert not isinstance(first, BaseException)
        return Health(float(first[0]), tuple(breakers), tuple(waits))

    async def _split_task_claim(
        self,
        key: str,
        fingerprint: str,
        lease_s: float,
        ttl_s: float,
        owner: str | None,
        max_live: int | None,
    ) -> TaskClaim:
        """`task_claim` on a cluster: one script when the task and its owner's set share a
        slot; else the task claimed in its slot, and a new one entered in its owner's set
        (`task_track`) in a second round trip, undone when the owner has `max_live` already
        (meanwhile the task is there: a retry with the same key is told `busy`)."""
        task = self._key(key) + ":task"
        owned = self._key(owner) + ":tasks" if owner is not None else ""
        lease = new_lease()
        args = [fingerprint, lease, _num(lease_s), _num(ttl_s), _num(max_live)]
        keys, slot = self._slot_keys([task, owned, ""])
        elsewhere = slot is None
        if elsewhere:
            keys, slot = self._slot_keys([task, "", ""])
            args.append(owned)
        assert slot is not None
        args.append(self._epoch.known_in(slot))
        reply = await self._call(_pack("task_claim", keys, self._now_arg(), args), slot)
        claim = self._task_claim_reply(reply, slot)
        if elsewhere and reply[3] == "new":
            tracked = await self._run("task_track", [owned], task, _num(ttl_s), _num(max_live))
            if tracked:  # the owner's live tasks are at `max_live`: the new task undone
                await self._run("task_drop", [task], lease, "c")
                return TaskClaim(TaskStatus.full, None, {}, None, float(tracked[1]))
        return claim

    def _cooldown_read(self, key: str, now: str) -> tuple[bytes, int | None]:
        """`cooldowns`' read of `key`: the packed script and, on a cluster, its slot."""
        redis_key = self._key(key) + ":cooldown"
        return _pack("cooldown", [redis_key], now, ()), key_slot(redis_key) if self._cluster else None

    # --- machinery -------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        key = bounded_key(key)
        if self._cluster and key.startswith(_MODEL_KEYS):
            # Redis Cluster: a model's breaker and cooldown in one slot, the model's (the whole
            # key after the tag keeps every key distinct).
            return f"{self._prefix}{{{_tag('m:' + key.partition(':')[2].partition(':')[2])}}}{_tag(key)}"
        return f"{self._prefix}{{{_tag(key)}}}"

    def _now_arg(self) -> str:
        """The script's time argument: '' (Redis TIME) unless the store has a clock."""
        return "" if self._clock is None else _num(self._clock.time())

    async def _run(self, op: str, keys: Sequence[str], *args: str) -> list[str]:
        """One operation: one EVALSHA of the script (on a cluster, to its first key's slot)."""
        command = _pack(op, keys, self._now_arg(), args)
        if self._cluster:
            return await self._call(command, key_slot(keys[0]) if keys else None)
        return await self._call(command)

    async def _call(self, command: bytes, slot: int | None = None) -> list[str]:
        """One packed EVALSHA, sent on this loop's connection with every other command of the
        loop's turn (see `_Wire`); its reply. The script reloaded once if the server lost it
        (restarted, or its script cache flushed). Any failure raises `StoreUnavailable`.

        On a cluster, sent to the primary of `slot` (that of every key of the command; None:
        any node, which redirects a keyed command once): see `_cluster_call`. Else `slot` is
        ignored."""
        if self._cluster:
            return await self._cluster_call(command, slot)
        loop = asyncio.get_running_loop()
        link = self._links.get(loop)
        if link is None:
            link = await self._open(loop)
        wire = link.wire
        if wire.failure is not None:  # broken: the next operation dials again
            wire = link.wire = self._dial(loop)
        loads = wire.loads
        reply = await wire.send(command)
        if reply.__class__ is list:
            return reply
        if isinstance(reply, hiredis.ReplyError) and str(reply).startswith("NOSCRIPT"):
            if wire.loads == loads:  # no load sent on this connection since the command: send one
                wire.load(_LOAD_SCRIPT)
                self._loaded = True
            reply = await wire.send(command)  # behind the load, on the same connection
            if reply.__class__ is list:
                return reply
        raise self._refused(wire, reply)

    async def _cluster_call(self, command: bytes, slot: int | None) -> list[str]:
        """`_call` on a cluster: through this loop's `Cluster` client (which follows redirections
        and reloads the script on `NOSCRIPT`)."""
        loop = asyncio.get_running_loop()
        link = self._clusters.get(loop)
        if link is None:
            link = await self._open_cluster(loop)
        reply = await link.cluster.send(slot, command)
        if reply.__class__ is list:
            return cast(list[str], reply)
        raise self._refused(None, reply)

    def _refused(self, wire: _Wire | None, reply: Any) -> StoreUnavailable:
        """What an error reply to an operation raises: a write refused for memory is said so
        (`store_out_of_memory`, at most one line a second, with the count since the last); a
        server that no longer takes writes (a replica: `READONLY`, or one loading its data:
        `LOADING`) drops the connection, so the next operation connects again (and, behind
        Sentinel, asks where the primary is now; on a cluster, `Cluster.send` dropped it and
        `wire` is None). Else a script error: that operation alone."""
        text = str(reply) if isinstance(reply, hiredis.ReplyError) else ""
        if text.startswith("OOM") or "-OOM " in text:  # (inside a script, Redis prefixes the error)
            self._oom_count += 1
            now = time.monotonic()
            if now >= self._oom_next:
                self._oom_next = now + 1.0
                count, self._oom_count = self._oom_count, 0
                emit_warning(
                    "store_out_of_memory",
                    store="redis",
                    count=count,
                    setting="maxmemory",
                    detail="Redis refused a write: used memory is over maxmemory (maxmemory-policy "
                    "noeviction). Give Redis more memory (see docs/stores.md for the memory per key)",
                )
            return StoreUnavailable("Redis store unavailable (OOM)")
        code = _code(reply) if isinstance(reply, hiredis.ReplyError) else "ResponseError"
        if code in ("READONLY", "LOADING", "MASTERDOWN"):
            if wire is not None:
                wire.fail(StoreUnavailable(f"Redis store unavailable ({code})"))
            return StoreUnavailable(f"Redis store unavailable ({code})")
        return StoreUnavailable("Redis store unavailable (ResponseError)")  # a script error

    def _watch_evictions(self) -> None:
        """Behind a `health` read, in the same write: ask each server this loop's connections
        reach (each primary, on a cluster) how many keys it has evicted (`INFO stats`), at
        most once per `_EVICTIONS_EVERY_S` per connection; nothing waits for the answer. A
        count that rose since the connection's last answer is a reset (`Epoch.evicted`); a
        connection's first answer (a new server, a failover) is its baseline."""
        loop = asyncio.get_running_loop()
        wires: list[_Wire] = []
        if self._cluster:
            cluster = self._clusters.get(loop)
            if cluster is not None:
                wires = cast(list[_Wire], cluster.cluster.primaries())
        else:
            link = self._links.get(loop)
            if link is not None:
                wires = [link.wire]
        now = time.monotonic()
        for wire in wires:
            if wire.failure is None and now >= wire.evictions_due:
                self._ask_evictions(wire, now)

    def _ask_evictions(self, wire: _Wire, now: float) -> None:
        """`INFO stats` on `wire`, its answer read by `_evictions` (also at connect, with the
        settings: the baseline)."""
        wire.evictions_due = now + _EVICTIONS_EVERY_S
        with suppress(StoreUnavailable):  # broken, or too many in flight: next time
            wire.send(_INFO_STATS).add_done_callback(functools.partial(self._evictions, wire))

    def _evictions(self, wire: _Wire, reply: asyncio.Future[Any]) -> None:
        """`INFO stats` answered on `wire` (see `_watch_evictions`)."""
        if reply.cancelled() or reply.exception() is not None:
            return  # the connection failed: its next one starts a baseline of its own
        count = _evicted_keys(reply.result())
        if count is None:
            return
        last, wire.evicted = wire.evicted, count
        seen, wire.resets_seen = wire.resets_seen, self._epoch.resets
        # A reset noticed since the last answer (the marker found gone: `allkeys-*` evicts it
        # too, and the next step finds that first) is this one: counted once.
        if last is not None and count > last and seen == self._epoch.resets:
            self._epoch.evicted(count - last)

    async def _check_settings(self, wire: _Wire) -> None:
        """Read the server's settings that decide whether it keeps guards' keys (on each new
        connection: a failover may reach another server) and warn, once per store and value,
        when budget keys can be evicted (`maxmemory-policy` other than `noeviction` with a
        `maxmemory`: every guards key has a TTL, so `volatile-*` policies evict them too) or
        are lost on a restart (`appendonly no` and no `save` snapshots). A server whose CONFIG
        command is refused (managed Redis) is said once, at info level."""
        names = ("maxmemory-policy", "maxmemory", "appendonly", "save")
        self._ask_evictions(wire, time.monotonic())  # the baseline of `_watch_evictions`
        try:
            sent = [wire.send(_packed("CONFIG", "GET", name)) for name in names]
        except StoreUnavailable:  # the connection broke: the next one checks
            return
        replies = await asyncio.gather(*sent, return_exceptions=True)
        if any(isinstance(reply, StoreUnavailable) for reply in replies):
            return  # the connection broke meanwhile: the next one checks (an error reply: a result)
        found: dict[str, str] = {}
        for name, reply in zip(names, replies, strict=True):
            if isinstance(reply, list) and len(reply) == 2:
                found[name] = str(reply[1])
        if len(found) < len(names):
            if ("config", "") not in self._warned:
                self._warned.add(("config", ""))
                emit("store_settings_unchecked", store="redis", detail="CONFIG GET refused or renamed")
            return
        policy = found["maxmemory-policy"]
        if policy != "noeviction" and found["maxmemory"] != "0":
            self._warn_setting(
                "maxmemory-policy",
                policy,
                "Redis may evict guards' keys when memory is full (they all have a TTL, so "
                "volatile-* policies evict them too): daily caps, spend, breakers and tasks are "
                "then forgotten. Set maxmemory-policy noeviction (and enough maxmemory)",
            )
        if found["appendonly"] == "no" and not found["save"].strip():
            self._warn_setting(
                "appendonly",
                "no",
                "Redis keeps guards' keys in memory only (appendonly no, and no save snapshots): "
                "a restart forgets daily caps, spend, breakers and tasks. Set appendonly yes",
            )

    def _warn_setting(self, setting: str, value: str, detail: str) -> None:
        if (setting, value) not in self._warned:
            self._warned.add((setting, value))
            emit_warning("store_setting", store="redis", setting=setting, value=value[:40], detail=detail)

    async def _open(self, loop: asyncio.AbstractEventLoop) -> _Link:
        """This loop's link, made on its first operation."""
        for other in [other for other in self._links if other.is_closed()]:
            del self._links[other]  # shut down without running its async generators' cleanup
        link = _Link(self._dial(loop))
        link.keeper = self._keep(loop, link)
        self._links[loop] = link  # before awaiting: concurrent first calls share it
        await anext(link.keeper)  # its first iteration registers it with the loop
        return link

    async def _open_cluster(self, loop: asyncio.AbstractEventLoop) -> _ClusterLink:
        """This loop's cluster client, made on its first operation (as `_open`)."""
        for other in [other for other in self._clusters if other.is_closed()]:
            del self._clusters[other]
        dial = functools.partial(self._dial, loop)
        link = _ClusterLink(Cluster(loop, self._address.cluster, dial, _LOAD_SCRIPT, self._timeout_s))
        link.keeper = self._keep(loop, link)
        self._clusters[loop] = link
        await anext(link.keeper)
        return link

    def _dial(self, loop: asyncio.AbstractEventLoop, node: Node | None = None) -> _Wire:
        """A new connection (on a cluster, to `node`), usable at once: commands wait in it
        until it is connected. Its handshake (AUTH, SELECT, SCRIPT LOAD: whichever it needs; on
        a cluster, the SCRIPT LOAD on each node's first connection) goes first, in the same
        write as the first commands."""
        wire = _Wire(loop, self._timeout_s)
        handshake = self._address.handshake()
        if node is None:
            if not self._loaded:
                handshake.append(_LOAD_SCRIPT)
                self._loaded = True
        elif node not in self._scripted:
            handshake.append(_LOAD_SCRIPT)
            self._scripted.add(node)
        wire.begin(handshake, loop.create_task(self._connect(wire, node)))
        # Its server's settings, read behind this turn's operations (see `_check_settings`).
        wire.checking = loop.create_task(self._check_settings(wire))
        return wire

    async def _connect(self, wire: _Wire, node: Node | None = None) -> None:
        try:
            # Behind Sentinel: one timeout to ask the sentinels, one to connect to the primary.
            with _Bound(self._timeout_s * (2 if self._address.master is not None else 1)):
                await self._address.connect(wire, self._timeout_s, node)
        except (OSError, TimeoutError) as exc:  # refused, unreachable, TLS refused, too slow
            wire.fail(_unavailable(exc))
        except BaseException:  # cancelled (its loop shutting down)
            wire.fail(StoreUnavailable("Redis store unavailable (cancelled)"))
            raise

    async def _keep(
        self, loop: asyncio.AbstractEventLoop, link: _Link | _ClusterLink
    ) -> AsyncGenerator[None, None]:
        """Suspended for the link's life in its loop. An event loop closes its unfinished async
        generators when it shuts down (`asyncio.run` does), which closes the connection (or the
        cluster client's) in the loop that owns it."""
        try:
            yield
        finally:
            if isinstance(link, _Link):
                if self._links.get(loop) is link:
                    del self._links[loop]
                await link.wire.close()
            else:
                if self._clusters.get(loop) is link:
                    del self._clusters[loop]
                await link.cluster.close()


def _report_parts(report: Report | None) -> list[Report]:
    """Redis Cluster: `report` in parts that each touch one key's slot: the model's (its
    breaker and cooldown), the day's spend, and each scope of a charge to settle."""
    if report is None:
        return []
    parts = []
    if (report.breaker_key is not None and report.breaker is not None) or report.cooldown_key is not None:
        parts.append(
            Report(
                breaker_key=report.breaker_key,
                breaker=report.breaker,
                outcome=report.outcome,
                probe=report.probe,
                success_age=report.success_age,
                cooldown_key=report.cooldown_key,
                cooldown_s=report.cooldown_s,
                cooldown_until=report.cooldown_until,
            )
        )
    if report.spend_key is not None and report.reservation is not None:
        parts.append(Report(spend_key=report.spend_key, reservation=report.reservation, actual=report.actual))
    if report.charge is not None and report.reservation is not None:
        scopes = (report.charge, *(report.charge.more.also if report.charge.more is not None else ()))
        for scope in scopes:
            parts.append(
                Report(
                    charge=_alone(scope, report.charge.hold_s),
                    reservation=report.reservation,
                    actual=report.actual,
                    tokens=report.tokens,
                )
            )
    return parts


def _halves(part: Report) -> list[Report]:
    """A model's report part as its breaker's and its cooldown's (keys in two slots)."""
    return [
        dataclasses.replace(part, cooldown_key=None, cooldown_s=0.0, cooldown_until=None),
        Report(
            cooldown_key=part.cooldown_key, cooldown_s=part.cooldown_s, cooldown_until=part.cooldown_until
        ),
    ]


def _alone(charge: Charge, hold_s: float) -> Charge:
    """One scope of a charge on its own (no other scope), with the request's `hold_s` (the
    first scope's, which one script gives every scope)."""
    more = charge.more
    if more is not None:
        more = dataclasses.replace(more, also=(), watched=more.soft is not None)
    return dataclasses.replace(charge, hold_s=hold_s, more=more)


def _latest(passages: Sequence[Passage]) -> Admission | None:
    """The refusal among `passages` (one per scope, in order) that frees up last (a hold that
    never fits: last of all), its `charge` the scope's index; None when none refused."""
    refusals = [
        dataclasses.replace(passage.refusal, charge=index)
        for index, passage in enumerate(passages)
        if passage.refusal is not None
    ]
    if not refusals:
        return None
    return max(refusals, key=lambda r: float("inf") if r.retry_after_s is None else r.retry_after_s)


def _holds(charge: Charge) -> bool:
    """Whether `charge` (any of its scopes) holds spend or tokens."""
    return any(
        each.spend is not None
        or (
            (more := each.more) is not None
            and (more.tokens is not None or (more.spend is not None and more.spend_per_month is not None))
        )
        for each in (charge, *(charge.more.also if charge.more is not None else ()))
    )


def _more_fields(charge: Charge) -> list[str]:
    """A charge's 11 fields in the script's ARGV[4] (see `more_charges` in the script)."""
    more = charge.more or MoreLimits()
    return [
        _num(charge.per_minute),
        _num(charge.per_day),
        _num(charge.spend),
        _num(charge.spend_cap),
        _num(more.per_month),
        _num(more.spend),
        _num(more.spend_per_month),
        _num(more.tokens),
        _num(more.tokens_per_minute),
        _num(more.tokens_per_day),
        _num(more.tokens_per_month),
    ]


def _refusal(refused_by: str, retry_after: str) -> Admission:
    """A step's refusal: '<retry>' (one charge), or '<retry or none> <scope index>'."""
    retry, _, index = retry_after.partition(" ")
    return Admission(False, refused_by, None if retry == "none" else float(retry), int(index or 0))


def _pack(op: str, keys: Sequence[str], now: str, args: Sequence[str]) -> bytes:
    """An EVALSHA of the script, in Redis' wire format."""
    return _packed("EVALSHA", _SHA, len(keys), *keys, op, now, *args)


def _packed(*command: str | int) -> bytes:
    """A command in Redis' wire format (hiredis' packer; its stub types the tuple wrongly)."""
    return cast(bytes, hiredis.pack_command(command))  # type: ignore[arg-type]


_LOAD_SCRIPT = _packed("SCRIPT", "LOAD", _SCRIPT)
#: How often (at most) each connection's server is asked how many keys it evicted (behind a
#: `health` read: `RedisStore._watch_evictions`).
_EVICTIONS_EVERY_S = 1.0
_INFO_STATS = _packed("INFO", "stats")


def _evicted_keys(info: Any) -> int | None:
    """The `evicted_keys` of an `INFO stats` reply; None when it has none (an error reply, a
    server that does not count them)."""
    if not isinstance(info, str):
        return None
    start = info.find("\nevicted_keys:")
    if start < 0:
        return None
    start += len("\nevicted_keys:")
    end = info.find("\r", start, start + 24)
    value = info[start : end if end >= 0 else start + 24]
    return int(value) if value.isdigit() else None


#: The most steps a store keeps the fixed arguments of (a route keeps one per caller), and
#: the longest budget key of a step kept: what they hold stays within a few megabytes.
_MAX_FIXED = 4096
#: The walk's per-model keys (`guards:breaker:<model>`, `guards:cooldown:<model>`): on Redis
#: Cluster both in the model's slot (`RedisStore._key`).
_MODEL_KEYS = ("guards:breaker:", "guards:cooldown:")
_MAX_FIXED_KEY = 128


#: The most commands one connection may have unanswered: past it, operations fail at once
#: (`StoreUnavailable`) rather than queue without end behind a server that does not answer.
_MAX_IN_FLIGHT = 10_000


class _Wire(asyncio.Protocol):
    """One connection to Redis, carrying every operation of one event loop (pipelining).

    Commands given in one loop turn are written together, at the turn's end, in one write:
    a burst of requests costs a few round trips, not one each, and Redis answers in order, so
    each reply goes to the next command waiting. Nothing blocks on a reply: a caller that gives
    up (cancelled) leaves its reply to be read and dropped, and the connection stays usable.

    Replies are waited for under one timer, on the oldest command unanswered: it is overdue
    `timeout_s` after it was written. A limit timed on the event loop also passes when the loop
    itself is held up by other work of the worker (a burst of requests, a blocking call) while
    Redis answered in time: the reply is then waiting in the socket. So a limit that comes due
    is checked first: when it fires late (by `_LATE_S` or more), or the loop then takes `_LATE_S`
    or more to come round once more (which also reads a reply already there), the worker, not
    Redis, was slow, and the limit waits another `timeout_s`. It expires when the loop keeps up
    and no reply came, or after `_MAX_TIMEOUTS` timeouts; then the connection is dropped and
    every command waiting on it fails (`StoreUnavailable`): they were behind that reply. The
    next operation dials again.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.loop = loop
        self._timeout_s = timeout_s
        self._reader = hiredis.Reader(encoding="utf-8")
        self._transport: asyncio.Transport | None = None
        self._opening: asyncio.Task[None] | None = None  # the dial in progress (a strong reference)
        #: Commands not written yet (until the turn ends, or the connection is made), and their
        #: callers' futures (None: a reply nobody waits for).
        self._out: list[bytes] = []
        self._queued: list[asyncio.Future[Any] | None] = []
        #: Commands written and not answered yet, in order: (future, when it was written).
        self._waiting: collections.deque[tuple[asyncio.Future[Any] | None, float]] = collections.deque()
        #: How many of the first replies answer the handshake (an error there fails the connection).
        self._handshake = 0
        self._flushing = False
        self._timer: asyncio.Handle | None = None
        self._watched: tuple[asyncio.Future[Any] | None, float] | None = None
        self._due = 0.0
        self._probing = False
        #: Why the connection is unusable (None while it is usable).
        self.failure: str | None = None
        #: SCRIPT LOADs sent on this connection.
        self.loads = 0
        #: The reading of its server's settings (a strong reference: `_check_settings`).
        self.checking: asyncio.Task[None] | None = None
        #: Its server's `evicted_keys` when last asked (None: not yet), and when it may be
        #: asked again (monotonic): `RedisStore._watch_evictions`.
        self.evicted: int | None = None
        self.evictions_due = 0.0
        #: The store's count of resets at that answer.
        self.resets_seen = 0
        #: Done once the socket is closed (if it was ever connected).
        self._made = False
        self._lost: asyncio.Future[None] = loop.create_future()

    # --- the store's side ----------------------------------------------------------------------

    def begin(self, handshake: list[bytes], opening: asyncio.Task[None]) -> None:
        self._handshake = len(handshake)
        self._out.extend(handshake)
        self._queued.extend([None] * len(handshake))
        self._opening = opening

    def send(self, command: bytes) -> asyncio.Future[Any]:
        """`command` (packed), written at the end of this loop turn; the future of its reply
        (an error reply as a `hiredis.ReplyError` result)."""
        if self.failure is not None:
            raise StoreUnavailable(self.failure)
        if len(self._waiting) + len(self._queued) >= _MAX_IN_FLIGHT:
            raise StoreUnavailable("Redis store unavailable (too many operations in flight)")
        future = self.loop.create_future()
        self._out.append(command)
        self._queued.append(future)
        if not self._flushing and self._transport is not None:
            self._flushing = True
            self.loop.call_soon(self._flush)
        return future

    def load(self, command: bytes) -> None:
        """A SCRIPT LOAD, ahead of the commands given after it."""
        self.loads += 1
        self._out.append(command)
        self._queued.append(None)

    async def close(self) -> None:
        """Close the connection; returns once its socket is closed."""
        self.fail(StoreUnavailable("Redis store unavailable (closed)"))
        if self._made:
            await self._lost

    def fail(self, error: StoreUnavailable) -> None:
        """The connection is done for: every command waiting on it fails with `error`."""
        if self.failure is None:
            self.failure = str(error)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._transport is not None:
            self._transport.abort()
        futures = [future for future, _ in self._waiting] + self._queued
        self._waiting.clear()
        self._out, self._queued = [], []
        for future in futures:
            if future is not None and not future.done():
                future.set_exception(StoreUnavailable(self.failure))

    def _flush(self) -> None:
        self._flushing = False
        if self._transport is None or self.failure is not None or not self._out:
            return
        out, queued = self._out, self._queued
        self._out, self._queued = [], []
        self._transport.write(b"".join(out))
        now = self.loop.time()
        self._waiting.extend([(future, now) for future in queued])
        if self._timer is None:
            self._timer = self.loop.call_at(now + self._timeout_s, self._check)

    def _check(self) -> None:
        """The timer: is the oldest reply overdue? (See the class docstring.)"""
        self._timer = None
        if not self._waiting or self.failure is not None:
            return
        oldest = self._waiting[0]
        now = self.loop.time()
        if oldest is not self._watched:  # answered since: the next one's own limit
            self._watched, self._due, self._probing = oldest, oldest[1] + self._timeout_s, False
        if now < self._due:
            self._timer = self.loop.call_at(self._due, self._check)
            return
        later = _patience(
            now, self._due, oldest[1] + _MAX_TIMEOUTS * self._timeout_s, self._probing, self._timeout_s
        )
        if later is None:
            self.fail(StoreUnavailable("Redis store unavailable (TimeoutError)"))
            return
        self._due, self._probing = later
        self._timer = (
            self.loop.call_soon(self._check) if self._probing else self.loop.call_at(self._due, self._check)
        )

    # --- asyncio's side ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport, though not always an `asyncio.Transport` (uvloop's are not).
        transport = cast("asyncio.Transport", transport)
        self._made = True
        if self.failure is not None:  # given up meanwhile
            transport.abort()
            return
        self._transport = transport
        self._flush()

    def data_received(self, data: bytes) -> None:
        reader, waiting = self._reader, self._waiting
        reader.feed(data)
        try:
            while (reply := reader.gets()) is not False:
                future = waiting.popleft()[0]  # IndexError: a reply nobody asked for
                if future is not None:
                    if not future.done():  # else its caller gave up
                        future.set_result(reply)
                elif self._handshake:
                    self._handshake -= 1
                    if isinstance(reply, hiredis.ReplyError):  # AUTH or SELECT refused
                        self.fail(StoreUnavailable(f"Redis store unavailable ({_code(reply)})"))
                        return
                    if isinstance(reply, list) and reply and reply[0] != "master":  # ROLE: a replica
                        self.fail(StoreUnavailable("Redis store unavailable (READONLY)"))
                        return
        except (hiredis.ProtocolError, IndexError, ValueError):  # ValueError: not UTF-8
            self.fail(StoreUnavailable("Redis store unavailable (ProtocolError)"))

    def eof_received(self) -> bool:
        return False  # the server closed it: close our side too (connection_lost follows)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self.fail(_unavailable(exc or ConnectionResetError()))
        self._lost.set_result(None)


def _code(reply: hiredis.ReplyError) -> str:
    """An error reply's code (`WRONGPASS`, `NOAUTH`, `ERR`...): never the rest of its text."""
    code = str(reply).split(" ", 1)[0][:32]
    return code if code.isalnum() else "ResponseError"


@dataclass(frozen=True, slots=True)
class _Address:
    """Where the store's Redis is and how to log in, from its URL:
    `redis://[[username]:password@]host[:port][/db]`, `rediss://...` (TLS) or
    `unix://[[username]:password@]/path/to/socket[?db=n]`; or, behind Redis Sentinel,
    `redis+sentinel://[[username]:password@]host[:port][,host[:port]...]/master-name[/db]`
    (`rediss+sentinel://`: TLS to the sentinels and the primary; the sentinels' port is 26379
    by default); or on Redis Cluster, `redis+cluster://[[username]:password@]host[:port][,...]`
    (`rediss+cluster://`: TLS to every node; the seeds, at most 16, any nodes of the cluster;
    database 0 only). Options, in the query string: `db`, and for TLS `ssl_cert_reqs` (`required`,
    the default; `optional`; `none`), `ssl_ca_certs` (a CA file), `ssl_certfile` and
    `ssl_keyfile` (a client certificate), `ssl_check_hostname` (`true` by default when
    certificates are required); `sentinel_password` (the sentinels' own, when they require
    one; the URL's password is the primary's); and `prefix`, the store's key prefix (see
    `RedisStore`)."""

    host: str = "localhost"
    port: int = 6379
    path: str | None = None  # a unix socket
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: ssl.SSLContext | None = None
    prefix: str | None = None
    #: Behind Sentinel: the sentinels, the primary's name among them, and their password.
    sentinels: tuple[tuple[str, int], ...] = ()
    master: str | None = None
    sentinel_password: str | None = None
    #: On Redis Cluster: the seeds (nodes asked for the slots' primaries).
    cluster: tuple[tuple[str, int], ...] = ()

    _OPTIONS = frozenset(
        {
            "db",
            "prefix",
            "ssl_cert_reqs",
            "ssl_ca_certs",
            "ssl_certfile",
            "ssl_keyfile",
            "ssl_check_hostname",
            "sentinel_password",
        }
    )

    @classmethod
    def parse(cls, url: str) -> _Address:
        """The address in `url`; a `ValueError` naming what is wrong, never the URL (it may
        carry a password)."""
        scheme = url.split(":", 1)[0].lower()
        if scheme in ("redis+sentinel", "rediss+sentinel"):
            return cls._parse_sentinel(url, scheme)
        if scheme in ("redis+cluster", "rediss+cluster"):
            return cls._parse_cluster(url, scheme)
        try:
            parts = urllib.parse.urlsplit(url)
            query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
            port = parts.port
        except ValueError:
            raise ValueError("invalid Redis URL (expected redis://, rediss:// or unix://)") from None
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError("invalid Redis URL (expected redis://, rediss:// or unix://)")
        options = cls._options(query)
        if "sentinel_password" in options:
            raise ValueError("invalid Redis URL: sentinel_password needs redis+sentinel://")
        db_text = options.get("db", "")
        if parts.scheme != "unix" and parts.path.strip("/"):
            db_text = parts.path.strip("/")
        if db_text and not db_text.isdigit():
            raise ValueError("invalid Redis URL: the database must be a number")
        username = urllib.parse.unquote(parts.username) if parts.username else None
        password = urllib.parse.unquote(parts.password) if parts.password else None
        if parts.scheme == "unix":
            if not parts.path:
                raise ValueError("invalid Redis URL: unix:// needs the socket's path")
            return cls(
                path=parts.path,
                db=int(db_text or 0),
                username=username,
                password=password,
                prefix=options.get("prefix"),
            )
        tls = _tls_of(parts.scheme, "rediss", options)
        return cls(
            parts.hostname or "localhost",
            port or 6379,
            None,
            int(db_text or 0),
            username,
            password,
            tls,
            options.get("prefix"),
        )

    @classmethod
    def _options(cls, query: dict[str, list[str]]) -> dict[str, str]:
        unknown = sorted(name for name in query if name not in cls._OPTIONS)
        if unknown:
            named = unknown[0] if unknown[0].isidentifier() and len(unknown[0]) <= 40 else "?"
            raise ValueError(
                f"invalid Redis URL: unknown option {named!r} (known: {', '.join(sorted(cls._OPTIONS))})"
            )
        return {name: values[-1] for name, values in query.items()}

    @classmethod
    def _parse_sentinel(cls, url: str, scheme: str) -> _Address:
        """`redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/master-name[/db]`."""
        spelling = "redis+sentinel://[[user]:password@]host:port[,host:port...]/master-name[/db]"
        username, password, sentinels, path, query_text = cls._split_hosts(
            url, scheme, spelling, "sentinel", 26379
        )
        names = [urllib.parse.unquote(part) for part in path.split("/") if part]
        if not names or len(names) > 2:
            raise ValueError(f"invalid Redis URL: name the primary ({spelling})")
        master, db_text = names[0], names[1] if len(names) == 2 else ""
        options = cls._options(urllib.parse.parse_qs(query_text, keep_blank_values=True))
        db_text = db_text or options.get("db", "")
        if db_text and not db_text.isdigit():
            raise ValueError("invalid Redis URL: the database must be a number")
        tls = _tls_of(scheme, "rediss+sentinel", options)
        return cls(
            db=int(db_text or 0),
            username=username,
            password=password,
            tls=tls,
            prefix=options.get("prefix"),
            sentinels=tuple(sentinels),
            master=master,
            sentinel_password=options.get("sentinel_password"),
        )

    @classmethod
    def _parse_cluster(cls, url: str, scheme: str) -> _Address:
        """`redis+cluster://[[user]:password@]host[:port][,host[:port]...][/0][?options]`."""
        spelling = "redis+cluster://[[user]:password@]host:port[,host:port...][?options]"
        username, password, seeds, path, query_text = cls._split_hosts(url, scheme, spelling, "node", 6379)
        options = cls._options(urllib.parse.parse_qs(query_text, keep_blank_values=True))
        if "sentinel_password" in options:
            raise ValueError("invalid Redis URL: sentinel_password needs redis+sentinel://")
        db_text = path.strip("/") or options.get("db", "")
        if db_text and not db_text.isdigit():
            raise ValueError("invalid Redis URL: the database must be a number")
        if int(db_text or 0) != 0:
            raise ValueError("invalid Redis URL: Redis Cluster has database 0 only")
        tls = _tls_of(scheme, "rediss+cluster", options)
        return cls(
            username=username, password=password, tls=tls, prefix=options.get("prefix"), cluster=tuple(seeds)
        )

    @staticmethod
    def _split_hosts(
        url: str, scheme: str, spelling: str, what: str, default_port: int
    ) -> tuple[str | None, str | None, list[tuple[str, int]], str, str]:
        """A URL of several hosts (`<scheme>://[[user]:password@]host[:port][,...][/path][?query]`):
        its username, password, hosts (at most 16, `what`s), path and query."""
        rest = url[len(scheme) + 3 :] if url[len(scheme) : len(scheme) + 3] == "://" else None
        if rest is None:
            raise ValueError(f"invalid Redis URL: expected {spelling}")
        rest, _, query_text = rest.partition("?")
        hosts_part, _, path = rest.partition("/")
        login, _, hosts_text = hosts_part.rpartition("@")
        username = password = None
        if login:
            user_text, _, password_text = login.partition(":")
            username = urllib.parse.unquote(user_text) or None
            password = urllib.parse.unquote(password_text) if password_text else None
        hosts = []
        for host_text in hosts_text.split(","):
            try:
                parts = urllib.parse.urlsplit(f"//{host_text}")
                host, port = parts.hostname, parts.port or default_port
            except ValueError:
                host = None
            if not host:
                raise ValueError(f"invalid Redis URL: a {what}'s host:port is malformed ({spelling})")
            hosts.append((host, port))
        if len(hosts) > 16:
            raise ValueError(f"invalid Redis URL: at most 16 {what}s")
        return username, password, hosts, path, query_text

    def handshake(self) -> list[bytes]:
        """The commands a new connection starts with (none for a default database without a
        password). Behind Sentinel, `ROLE` too: a server that is not (or no longer) the primary
        fails the connection (`_Wire.data_received`), and the next one asks the sentinels."""
        commands = []
        if self.password is not None:
            login = (self.username, self.password) if self.username else (self.password,)
            commands.append(_packed("AUTH", *login))
        if self.db:
            commands.append(_packed("SELECT", self.db))
        if self.master is not None:
            commands.append(_packed("ROLE"))
        return commands

    async def connect(self, wire: _Wire, timeout_s: float, node: tuple[str, int] | None = None) -> None:
        """Connect `wire` to the server (on a cluster, to `node`, with the URL's TLS)."""
        loop = wire.loop
        if node is not None:
            await loop.create_connection(lambda: wire, node[0], node[1], ssl=self.tls)
        elif self.path is not None:
            await loop.create_unix_connection(lambda: wire, self.path)
        elif self.master is not None:
            host, port = await self._primary(timeout_s)
            await loop.create_connection(lambda: wire, host, port, ssl=self.tls)
        else:
            await loop.create_connection(lambda: wire, self.host, self.port, ssl=self.tls)

    async def _primary(self, timeout_s: float) -> tuple[str, int]:
        """Where the primary is, as the sentinels say: all asked at once, each given
        `timeout_s`; the first in the URL's order that answered wins. `OSError` when none knows
        (unreachable, or the name unknown to them)."""
        asks = [asyncio.ensure_future(self._ask(host, port)) for host, port in self.sentinels]
        try:
            await asyncio.wait(asks, timeout=timeout_s)
        finally:
            for ask in asks:
                ask.cancel()
        found = None
        for ask in asks:  # (every failure read, so none is reported as never retrieved)
            if ask.done() and not ask.cancelled() and ask.exception() is None and found is None:
                found = ask.result()
        if found is None:
            raise ConnectionRefusedError("no sentinel named the primary")
        return found

    async def _ask(self, host: str, port: int) -> tuple[str, int] | None:
        """One sentinel's answer to `SENTINEL get-master-addr-by-name` (None: it knows no
        such primary)."""
        reader, writer = await asyncio.open_connection(host, port, ssl=self.tls)
        try:
            commands = []
            if self.sentinel_password is not None:
                commands.append(_packed("AUTH", self.sentinel_password))
            commands.append(_packed("SENTINEL", "get-master-addr-by-name", self.master or ""))
            writer.write(b"".join(commands))
            parser = hiredis.Reader(encoding="utf-8")
            replies: list[Any] = []
            while len(replies) < len(commands):
                data = await reader.read(4096)
                if not data:
                    raise ConnectionResetError
                parser.feed(data)
                while (reply := parser.gets()) is not False:
                    replies.append(reply)
        finally:
            writer.close()
        answer = replies[-1]
        if not isinstance(answer, list) or len(answer) != 2 or not str(answer[1]).isdigit():
            return None
        return str(answer[0]), int(answer[1])


def _tls_of(scheme: str, secure: str, options: dict[str, str]) -> ssl.SSLContext | None:
    """The TLS context of a URL whose scheme is `scheme` (`secure`: its TLS spelling), from its
    `ssl_*` options; None without TLS, where an `ssl_*` option is an error."""
    if scheme == secure:
        return _tls_context(options)
    if any(name.startswith("ssl_") for name in options):
        raise ValueError(f"invalid Redis URL: ssl_* options need {secure}://")
    return None


def _tls_context(options: dict[str, str]) -> ssl.SSLContext:
    requirement = options.get("ssl_cert_reqs", "required").lower()
    modes = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}
    if requirement not in modes:
        raise ValueError("invalid Redis URL: ssl_cert_reqs must be required, optional or none")
    try:
        context = ssl.create_default_context(cafile=options.get("ssl_ca_certs"))
        if "ssl_certfile" in options:
            context.load_cert_chain(options["ssl_certfile"], options.get("ssl_keyfile"))
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(
            f"invalid Redis URL: its TLS files cannot be loaded ({type(exc).__name__})"
        ) from None
    check = options.get("ssl_check_hostname", "true" if requirement == "required" else "false").lower()
    if check not in ("true", "false"):
        raise ValueError("invalid Redis URL: ssl_check_hostname must be true or false")
    context.check_hostname = check == "true"
    context.verify_mode = modes[requirement]
    return context


#: How late (seconds past its time) a limit must fire to have found the loop held up.
_LATE_S = 0.01
#: The longest a limit waits in all, in timeouts, however held up the loop is.
_MAX_TIMEOUTS = 10


class _Bound:
    """`with _Bound(timeout_s):` in a task: the store's limit on connecting. When it expires,
    the task is cancelled where it waits and the block raises `TimeoutError`; like the limit
    on replies (`_Wire`), it waits longer when the worker's own event loop was held up."""

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
            raise RuntimeError("connecting to Redis must run in a task")
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
        later = _patience(self._loop.time(), self._when, self._end, self._probing, self._timeout_s)
        if later is None:
            self._expired = True
            self._cancelling = self._task.cancelling()
            self._task.cancel()
            return
        self._when, self._probing = later
        self._handle = (
            self._loop.call_soon(self._fire) if self._probing else self._loop.call_at(self._when, self._fire)
        )


def _patience(
    now: float, due: float, end: float, probing: bool, timeout_s: float
) -> tuple[float, bool] | None:
    """A lag-aware limit's rule (see `_Wire`), when the limit due at `due` (at most `end`) comes
    round at `now`: when to look again and whether that look is the probe of the loop's next
    turn; None when the limit has expired."""
    if now < end:
        if now - due >= _LATE_S:  # the loop was held up: wait another timeout
            return min(now + timeout_s, end), False
        if not probing:  # due on time: see how the loop's next turn goes
            return now, True
    return None


def _unavailable(exc: BaseException) -> StoreUnavailable:
    # The class name only: socket errors' messages carry the host and port.
    return StoreUnavailable(f"Redis store unavailable ({type(exc).__name__})")


async def _close(link: _Link | _ClusterLink) -> None:
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
    state, opened_at, probes, last_probe_at, successes, probe_since, failures, open_s, calls, probe_s = fields
    return BreakerState(
        CircuitState(state),
        failures=_times(failures),
        opened_at=float(opened_at),
        probes=int(probes),
        last_probe_at=float(last_probe_at),
        successes=int(successes),
        probe_since=float(probe_since),
        open_s=float(open_s),
        calls=_times(calls),
        probe_s=float(probe_s),
    )


def _times(word: str) -> tuple[float, ...]:
    """A list of times as the script writes it (comma-separated, or '-' for none)."""
    return tuple(float(t) for t in word.split(",")) if word != "-" else ()


@functools.lru_cache(maxsize=64)  # a route's policy, formatted for each of its requests once
def _policy_args(policy: Breaker | None) -> tuple[str, ...]:
    if policy is None:
        return ("", "", "", "", "", "")
    window, reset = _num(policy.window_s), _num(policy.reset_timeout_s)
    if policy.slow_call_s is not None:  # (the script's `read_policy`: words after the window)
        window += f" {_num(policy.slow_call_s)} {_num(policy.minimum_calls)}"
    if (interval := policy.reopen_after_probe_s) is not None:
        reset += " " + _num(interval)
    return (
        _num(policy.failure_threshold),
        window,
        reset,
        _num(policy.half_open_probes),
        _num(policy.success_threshold),
        _num(policy.ttl_s),
    )
