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
  (set with `PX` in the script that writes it); no key while not cooling down.

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

Failures: every round trip is bounded by `timeout_s` (connect, read, and waiting for a pooled
connection), with no client-side retries; any Redis or socket error raises `StoreUnavailable`,
whose message names the error class only (never the URL, host, port or password). The client
reconnects by itself on the next operation once Redis is back.

Event loops: a Redis asyncio client belongs to one event loop, so the store keeps one client per
running loop, created on first use there and closed when that loop shuts down (or by `aclose`).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import os
from collections.abc import AsyncGenerator, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import AbstractConnection, parse_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError, ResponseError

from .._breaker import Breaker, BreakerDecision, BreakerState, CircuitState, Outcome
from .._clock import Clock
from ._base import ADMITTED, Admission, SpendReservation, StoreUnavailable

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

-- budget: KEYS = {rate key, day key stem}; ARGV[3] per_minute or '', ARGV[4] per_day or '',
-- ARGV[5] a unique member for the rate set. Returns {} when admitted, else {limit, retry_after}.
local function charge_budget()
  local rate_key = KEYS[1]
  local per_minute = tonumber(ARGV[3])
  local per_day = tonumber(ARGV[4])
  local refused_by, retry = nil, nil
  if per_minute then
    redis.call('ZREMRANGEBYSCORE', rate_key, '-inf', fmt(now - MINUTE))
    local n = redis.call('ZCARD', rate_key)
    if n >= per_minute then
      refused_by = 'per_minute'
      retry = MINUTE
      if n > 0 then
        local oldest = redis.call('ZRANGE', rate_key, 0, 0, 'WITHSCORES')
        retry = tonumber(oldest[2]) + MINUTE - now
      end
    end
  end
  local day_key
  if per_day then
    day_key = KEYS[2] .. day_name(now)
    local count = tonumber(redis.call('GET', day_key) or '0')
    local wait = DAY - second_of_day(now) -- until the next UTC midnight
    -- Both spent: name the limit that frees up last.
    if count >= per_day and (refused_by == nil or wait > retry) then
      refused_by = 'per_day'
      retry = wait
    end
  end
  if refused_by then return {refused_by, fmt(retry)} end
  if per_day then
    if redis.call('INCR', day_key) == 1 then redis.call('PEXPIRE', day_key, DAILY_TTL_MS) end
  end
  if per_minute then
    redis.call('ZADD', rate_key, fmt(now), ARGV[5])
    redis.call('PEXPIRE', rate_key, MINUTE_MS)
  end
  return {}
end

-- The day's spend hash: drops lapsed holds (and `drop`, a hold field) and returns the settled
-- total and the sum of live holds.
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

-- reserve: KEYS = {spend key stem}; ARGV[3] amount, ARGV[4] cap, ARGV[5] hold_s,
-- ARGV[6] reservation id. Returns {} when held, else {retry_after}.
local function reserve_spend()
  local key = KEYS[1] .. day_name(now)
  local amount, cap, hold_s = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
  local settled, held, gone = read_spend(key, nil)
  if #gone > 0 then redis.call('HDEL', key, unpack(gone)) end
  if settled + held + amount > cap then
    return {fmt(DAY - second_of_day(now))}
  end
  redis.call('HSET', key, 'h:' .. ARGV[6], fmt(amount) .. ' ' .. fmt(now + hold_s))
  redis.call('PEXPIRE', key, DAILY_TTL_MS)
  return {}
end

-- settle: KEYS = {spend key stem}; ARGV[3] reservation id, ARGV[4] actual cost.
local function settle_spend()
  local key = KEYS[1] .. day_name(now)
  local settled, _, gone = read_spend(key, 'h:' .. ARGV[3])
  redis.call('HSET', key, 'settled', fmt(settled + tonumber(ARGV[4])))
  if #gone > 0 then redis.call('HDEL', key, unpack(gone)) end
  ensure_ttl(key, DAILY_TTL_MS)
  return {}
end

-- spent: KEYS = {spend key stem}. Returns {settled total}.
local function spent()
  local settled = redis.call('HGET', KEYS[1] .. day_name(now), 'settled')
  return {settled or '0'}
end

-- cooldown: KEYS = {cooldown key}. Returns {seconds left} ('0' when not cooling down). A key
-- whose end has passed on the store's clock (an injected clock in tests) counts as gone.
local function cooldown_left()
  local ends = tonumber(redis.call('GET', KEYS[1]) or '')
  if ends == nil or ends <= now then return {'0'} end
  return {fmt(ends - now)}
end

-- cool: KEYS = {cooldown key}; ARGV[3] seconds (> 0). Never shortens a running cooldown; the
-- key expires when the cooldown ends.
local function start_cooldown()
  local ends = now + tonumber(ARGV[3])
  local current = tonumber(redis.call('GET', KEYS[1]) or '')
  if ends <= now or (current ~= nil and current >= ends) then return {} end
  redis.call('SET', KEYS[1], fmt(ends), 'PX', string.format('%d', math.ceil((ends - now) * 1000)))
  return {}
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

-- Policy: ARGV[3] failure_threshold, ARGV[4] window_s or '', ARGV[5] reset_timeout_s,
-- ARGV[6] half_open_probes, ARGV[7] success_threshold, ARGV[8] ttl_s.
local policy = {
  failure_threshold = tonumber(ARGV[3]), window_s = tonumber(ARGV[4]),
  reset_timeout_s = tonumber(ARGV[5]), half_open_probes = tonumber(ARGV[6]),
  success_threshold = tonumber(ARGV[7]), ttl_s = tonumber(ARGV[8]),
}

-- Returns the new state and the decision {allowed, probe, state, retry_after, record_success}.
local function admit(s)
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

local function record(s, outcome, probe)
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

if op == 'budget' then return charge_budget() end
if op == 'reserve' then return reserve_spend() end
if op == 'settle' then return settle_spend() end
if op == 'spent' then return spent() end
if op == 'now' then return {fmt(now)} end
if op == 'cooldown' then return cooldown_left() end
if op == 'cool' then return start_cooldown() end
if op == 'admit' then
  local s, decision = admit(load_breaker(KEYS[1]))
  save_breaker(KEYS[1], s, policy.ttl_s)
  return decision
end
if op == 'record' then
  local s = record(load_breaker(KEYS[1]), ARGV[9], tonumber(ARGV[10]))
  save_breaker(KEYS[1], s, policy.ttl_s)
  return state_fields(s)
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

    async def now(self) -> float:
        if self._clock is not None:
            return self._clock.time()
        reply = await self._run("now", [])
        return float(reply[0])

    async def charge_budget(self, key: str, *, per_minute: int | None, per_day: int | None) -> Admission:
        if per_minute is None and per_day is None:
            return ADMITTED  # nothing to check, nothing to charge
        tag = self._key(key)
        member = os.urandom(8).hex()  # rate set members must be unique, even at one instant
        reply = await self._run(
            "budget", [tag + ":rate", tag + ":day:"], _num(per_minute), _num(per_day), member
        )
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
        reply = await self._run("admit", [self._key(key) + ":breaker"], *_policy_args(policy))
        allowed, probe, state, retry_after, record_success = reply
        return BreakerDecision(
            allowed == "1",
            probe=float(probe) if probe else None,
            state=CircuitState(state),
            retry_after_s=float(retry_after) if retry_after else None,
            record_success=record_success == "1",
        )

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
        state, opened_at, probes, last_probe_at, successes, probe_since, failures = reply
        return BreakerState(
            CircuitState(state),
            failures=tuple(float(t) for t in failures.split(",")) if failures != "-" else (),
            opened_at=float(opened_at),
            probes=int(probes),
            last_probe_at=float(last_probe_at),
            successes=int(successes),
            probe_since=float(probe_since),
        )

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
        return f"{self._prefix}{{{_tag(key)}}}"

    def _now_arg(self) -> str:
        """The script's time argument: '' (Redis TIME) unless the store has a clock."""
        return "" if self._clock is None else _num(self._clock.time())

    @staticmethod
    def _command(op: str, keys: Sequence[str], now: str, *args: str) -> tuple[Any, ...]:
        return ("EVALSHA", _SHA, len(keys), *keys, op, now, *args)

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
            client = Redis.from_pool(
                BlockingConnectionPool.from_url(
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
            )
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


def _unavailable(exc: BaseException) -> StoreUnavailable:
    # The class name only: redis-py's messages carry the host and port.
    return StoreUnavailable(f"Redis store unavailable ({type(exc).__name__})")


async def _close(link: _Link) -> None:
    await link.keeper.aclose()


def _policy_args(policy: Breaker) -> tuple[str, ...]:
    return (
        _num(policy.failure_threshold),
        _num(policy.window_s),
        _num(policy.reset_timeout_s),
        _num(policy.half_open_probes),
        _num(policy.success_threshold),
        _num(policy.ttl_s),
    )
