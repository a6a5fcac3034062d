"""Provider cooldowns, for every store: `start_cooldown` never shortens a running cooldown and its
key expires when it ends; `cooldowns` reads a whole fallback chain at once, in order. Then what
is particular to each store: memory keeps no key past the end, SQLite rows carry the end and are
swept, Redis keys carry a TTL ending with the cooldown and a chain is read in one round trip,
and an unreachable SQLite file or Redis server raises `StoreUnavailable` within the timeout.
Time moves only through `ManualClock`, except where Redis' own clock and TTLs are the point."""

from __future__ import annotations

import asyncio
import random
import re
import socket
import sqlite3
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from fixtures import ManualClock
from fixtures.redis_server import RedisServer
from fixtures.stores import PiecewiseStore
from guards.stores import MemoryStore, RedisStore, SQLiteStore, StoreUnavailable

from ..conftest import STORE_TIMEOUT_S, RedisReads, wait_until

MIDNIGHT = 86_400.0 * 20_000  # 2024-10-04T00:00:00Z
T0 = MIDNIGHT + 3_600  # 01:00 UTC
CHAIN = ["openai:gpt-4o-mini", "anthropic:claude-haiku", "workers-ai:llama"]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


# --- every store ------------------------------------------------------------------------------


def test_a_key_never_cooled_down_reads_zero(store: PiecewiseStore) -> None:
    assert asyncio.run(store.cooldowns(["openai:gpt-4o-mini"])) == (0.0,)
    assert asyncio.run(store.cooldowns([])) == ()


def test_a_cooldown_counts_down_with_the_store_clock_and_ends(
    store: PiecewiseStore, clock: ManualClock
) -> None:
    async def scenario() -> None:
        await store.start_cooldown("openai:gpt-4o-mini", 60)
        assert await store.cooldowns(["openai:gpt-4o-mini"]) == (pytest.approx(60),)
        clock.advance(15)
        assert await store.cooldowns(["openai:gpt-4o-mini"]) == (pytest.approx(45),)
        clock.advance(44.5)
        assert await store.cooldowns(["openai:gpt-4o-mini"]) == (pytest.approx(0.5),)
        clock.advance(0.5)  # exactly at its end: over
        assert await store.cooldowns(["openai:gpt-4o-mini"]) == (0.0,)
        clock.advance(3_600)
        assert await store.cooldowns(["openai:gpt-4o-mini"]) == (0.0,)

    asyncio.run(scenario())


def test_a_shorter_cooldown_never_shortens_a_running_one_and_a_longer_one_extends_it(
    store: PiecewiseStore, clock: ManualClock
) -> None:
    async def left() -> float:
        (seconds,) = await store.cooldowns(["m"])
        return seconds

    async def scenario() -> None:
        await store.start_cooldown("m", 60)
        clock.advance(10)
        await store.start_cooldown("m", 5)  # would end at T0 + 15: the running one ends later
        assert await left() == pytest.approx(50)
        await store.start_cooldown("m", 50)  # ends at the very same instant
        assert await left() == pytest.approx(50)
        await store.start_cooldown("m", 120)  # ends later: extended
        assert await left() == pytest.approx(120)
        clock.advance(119)
        assert await left() == pytest.approx(1)
        clock.advance(1)
        assert await left() == 0.0
        await store.start_cooldown("m", 5)  # after its end, a short one starts afresh
        assert await left() == pytest.approx(5)

    asyncio.run(scenario())


def test_several_keys_are_read_at_once_in_order(store: PiecewiseStore, clock: ManualClock) -> None:
    async def scenario() -> None:
        await store.start_cooldown(CHAIN[0], 30)
        await store.start_cooldown(CHAIN[2], 90)
        clock.advance(10)
        assert await store.cooldowns(CHAIN) == (pytest.approx(20), 0.0, pytest.approx(80))
        assert await store.cooldowns(list(reversed(CHAIN))) == (pytest.approx(80), 0.0, pytest.approx(20))
        assert await store.cooldowns((CHAIN[2], "unknown", CHAIN[2], CHAIN[0])) == (
            pytest.approx(80),
            0.0,
            pytest.approx(80),
            pytest.approx(20),
        )
        clock.advance(20)
        assert await store.cooldowns(CHAIN) == (0.0, 0.0, pytest.approx(60))

    asyncio.run(scenario())


def test_keys_are_independent(store: PiecewiseStore) -> None:
    async def scenario() -> None:
        await store.start_cooldown("openai:gpt-4o", 60)
        await store.start_cooldown("openai:gpt-4o-mini", 10)
        assert await store.cooldowns(["openai:gpt-4o", "openai:gpt-4o-mini", "openai"]) == (
            pytest.approx(60),
            pytest.approx(10),
            0.0,
        )
        # Neither a budget, a spend nor a breaker under the same key is a cooldown, nor the reverse.
        assert (await store.charge_budget("openai:gpt-4o", per_minute=1, per_day=1)).allowed
        assert await store.spent("openai:gpt-4o") == 0
        assert await store.cooldowns(["openai:gpt-4o"]) == (pytest.approx(60),)

    asyncio.run(scenario())


@pytest.mark.parametrize("seconds", [0.0, -1.0, -60.0, float("nan"), 1e-300])
def test_a_cooldown_of_no_time_does_nothing(
    store: PiecewiseStore, clock: ManualClock, seconds: float
) -> None:
    async def scenario() -> None:
        await store.start_cooldown("idle", seconds)
        assert await store.cooldowns(["idle"]) == (0.0,)
        await store.start_cooldown("busy", 30)
        await store.start_cooldown("busy", seconds)  # nor does it shorten a running one
        assert await store.cooldowns(["busy"]) == (pytest.approx(30),)

    asyncio.run(scenario())


def test_concurrent_starts_keep_the_latest_end(store: PiecewiseStore) -> None:
    """50 concurrent cooldowns of one key: the one ending last wins, whatever the order."""
    lengths = [float(s) for s in random.Random(3).sample(range(1, 500), 50)]

    async def scenario() -> None:
        await asyncio.gather(*(store.start_cooldown("m", seconds) for seconds in lengths))
        assert await store.cooldowns(["m"]) == (pytest.approx(max(lengths)),)

    asyncio.run(scenario())


def test_concurrent_reads_and_starts_are_answered_in_order(store: PiecewiseStore) -> None:
    """Reads of whole chains racing each other (pipelined together on Redis, batched in one
    transaction on SQLite) each get their own keys' answers, in their order."""

    async def scenario() -> None:
        await asyncio.gather(*(store.start_cooldown(f"m{i}", 10 * (i + 1)) for i in range(6)))
        chains = [[f"m{(i + j) % 7}" for j in range(3)] for i in range(40)]
        answers = await asyncio.gather(*(store.cooldowns(chain) for chain in chains))
        for chain, answer in zip(chains, answers, strict=True):
            assert answer == tuple(0.0 if k == "m6" else pytest.approx(10 * (int(k[1:]) + 1)) for k in chain)

    asyncio.run(scenario())


@pytest.mark.parametrize("store_kind", ["sqlite", "redis"], indirect=True)
def test_two_workers_see_each_others_cooldowns(
    make_store: Callable[[ManualClock], PiecewiseStore], clock: ManualClock
) -> None:
    """Two stores on one SQLite file, or one Redis: one worker's 429 cools the model down for all."""
    a, b = make_store(clock), make_store(clock)

    async def scenario() -> None:
        await a.start_cooldown(CHAIN[1], 60)
        assert await b.cooldowns(CHAIN) == (0.0, pytest.approx(60), 0.0)
        await b.start_cooldown(CHAIN[1], 30)  # shorter: the other worker's stands
        await b.start_cooldown(CHAIN[0], 5)
        assert await a.cooldowns(CHAIN) == (pytest.approx(5), pytest.approx(60), 0.0)

    asyncio.run(scenario())


def test_answers_equal_memory_stores(store: PiecewiseStore, clock: ManualClock) -> None:
    """Seeded random starts and clock moves: the very same answers as `MemoryStore`, exactly."""
    rng = random.Random(21)
    memory = MemoryStore(clock=clock)
    keys = ["a", "b", "c", "d"]

    async def scenario() -> None:
        for step in range(400):
            roll = rng.random()
            if roll < 0.3:
                clock.advance(rng.choice([0.0, 0.25, 1.0, 7.5, 30.0, 59.75, 60.0, 600.0]))
            elif roll < 0.6:
                key, seconds = rng.choice(keys), rng.choice([-1.0, 0.0, 0.5, 1.0, 10.0, 30.0, 59.75, 60.0])
                await memory.start_cooldown(key, seconds)
                await store.start_cooldown(key, seconds)
            chain = rng.sample(keys, rng.randint(1, 4))
            assert await store.cooldowns(chain) == await memory.cooldowns(chain), (step, chain)

    asyncio.run(scenario())


# --- memory -------------------------------------------------------------------------------------


def test_memory_keeps_no_key_past_a_cooldowns_end(clock: ManualClock) -> None:
    store = MemoryStore(clock=clock)

    async def scenario() -> None:
        await store.start_cooldown("m", 60)
        await store.start_cooldown("idle", 0)
        await store.cooldowns(["unknown", "other"])  # reads create nothing
        assert len(store) == 1
        clock.advance(59.5)
        assert len(store) == 1
        clock.advance(0.5)
        assert len(store) == 0

    asyncio.run(scenario())


# --- SQLite -------------------------------------------------------------------------------------


def cooldown_rows(path: Path) -> list[tuple[str, float]]:
    """The cooldown table as another program sees the file."""
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        return conn.execute("SELECT key, expires_at FROM guards_cooldown ORDER BY key").fetchall()


def test_sqlite_rows_end_with_their_cooldown_and_are_swept(tmp_path: Path, clock: ManualClock) -> None:
    path = tmp_path / "guards.db"
    store = SQLiteStore(path, clock=clock)

    async def scenario() -> None:
        await store.start_cooldown("a", 60)
        await store.start_cooldown("b", 30)
        await store.start_cooldown("none", 0)
        await store.cooldowns(["unknown"])  # reads write nothing
        assert cooldown_rows(path) == [("a", T0 + 60), ("b", T0 + 30)]
        clock.advance(10)
        await store.start_cooldown("a", 5)  # shorter: the row is left alone
        await store.start_cooldown("b", 40)  # longer: its end moves
        assert cooldown_rows(path) == [("a", T0 + 60), ("b", T0 + 50)]
        clock.set(T0 + 60 + 61)  # past both ends and the sweep interval
        assert await store.cooldowns(["a", "b"]) == (0.0, 0.0)  # an operation: it sweeps
        assert cooldown_rows(path) == []
        await store.aclose()

    asyncio.run(scenario())


def test_sqlite_expired_rows_read_as_no_cooldown_until_swept(tmp_path: Path, clock: ManualClock) -> None:
    path = tmp_path / "guards.db"
    store = SQLiteStore(path, clock=clock, sweep_interval_s=3_600)

    async def scenario() -> None:
        await store.start_cooldown("a", 60)
        clock.advance(60)
        assert await store.cooldowns(["a"]) == (0.0,)
        assert cooldown_rows(path) == [("a", T0 + 60)]  # not swept yet
        await store.start_cooldown("a", 5)  # an ended cooldown is replaced, even by a short one
        assert cooldown_rows(path) == [("a", T0 + 65)]
        assert await store.cooldowns(["a"]) == (pytest.approx(5),)
        await store.aclose()

    asyncio.run(scenario())


def test_sqlite_reads_a_chain_longer_than_one_statement_binds(tmp_path: Path, clock: ManualClock) -> None:
    store = SQLiteStore(tmp_path / "guards.db", clock=clock)
    keys = [f"model-{i}" for i in range(1_234)]

    async def scenario() -> None:
        for key in keys[::100]:
            await store.start_cooldown(key, 42)
        answers = await store.cooldowns(keys)
        assert answers == tuple(42.0 if i % 100 == 0 else 0.0 for i in range(len(keys)))
        await store.aclose()

    asyncio.run(scenario())


def test_sqlite_a_locked_file_raises_store_unavailable_within_the_timeout_then_recovers(
    tmp_path: Path, clock: ManualClock
) -> None:
    path = tmp_path / "guards.db"
    store = SQLiteStore(path, clock=clock)

    async def scenario() -> None:
        assert await store.cooldowns(CHAIN) == (0.0, 0.0, 0.0)
        with closing(sqlite3.connect(path, isolation_level=None)) as locker:
            locker.execute("BEGIN EXCLUSIVE")  # another program holds the write lock
            for operation in (store.cooldowns(CHAIN), store.start_cooldown(CHAIN[0], 60)):
                started = time.monotonic()
                with pytest.raises(StoreUnavailable) as raised:
                    await operation
                assert 0.05 <= time.monotonic() - started < 1.0  # about timeout_s (0.1 s)
                assert str(path) in str(raised.value)
            locker.execute("ROLLBACK")
        assert await store.cooldowns(CHAIN) == (0.0, 0.0, 0.0)  # the start that gave up did nothing
        await store.start_cooldown(CHAIN[0], 60)
        assert await store.cooldowns(CHAIN) == (pytest.approx(60), 0.0, 0.0)
        await store.aclose()

    asyncio.run(scenario())


def test_sqlite_a_file_that_cannot_be_opened_raises_store_unavailable(
    tmp_path: Path, clock: ManualClock
) -> None:
    path = tmp_path / "missing-directory" / "guards.db"
    store = SQLiteStore(path, clock=clock)

    async def scenario() -> None:
        for operation in (store.cooldowns(CHAIN), store.start_cooldown(CHAIN[0], 60)):
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await operation
            assert time.monotonic() - started < 1.0
        path.parent.mkdir()
        await store.start_cooldown(CHAIN[0], 60)
        assert await store.cooldowns(CHAIN[:1]) == (pytest.approx(60),)
        await store.aclose()

    asyncio.run(scenario())


# --- Redis --------------------------------------------------------------------------------------


def evalsha_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_redis_a_chain_is_read_in_one_round_trip() -> None:
    """One EVALSHA per key (each on its own slot), all in one pipeline: one round trip, alone
    or while other operations are in flight."""
    with RedisServer() as server, redis.Redis.from_url(server.url) as admin:
        store = RedisStore(server.url, clock=ManualClock(T0), prefix="t:")
        reads = RedisReads(server.url)

        async def scenario() -> None:
            await store.start_cooldown(CHAIN[1], 60)  # connected, the script is loaded
            before = evalsha_calls(admin)
            reads.take()
            assert await store.cooldowns(CHAIN) == (0.0, pytest.approx(60), 0.0)
            assert reads.take() == 1
            assert evalsha_calls(admin) - before == 3
            reads.take()
            await store.start_cooldown(CHAIN[0], 30)
            assert reads.take() == 1
            answers = await asyncio.gather(*(store.cooldowns(CHAIN) for _ in range(50)))
            assert answers == [(pytest.approx(30), pytest.approx(60), 0.0)] * 50
            assert reads.take() <= 3  # written together: a pipeline

        asyncio.run(scenario())
        reads.close()
        asyncio.run(store.aclose())


@pytest.mark.parametrize("with_clock", [False, True], ids=["redis-time", "clock"])
def test_redis_a_cooldown_key_has_a_ttl_ending_with_it(
    redis_url: str, admin: redis.Redis, prefix: str, with_clock: bool
) -> None:
    clock = ManualClock(T0) if with_clock else None
    store = RedisStore(redis_url, clock=clock, prefix=prefix, timeout_s=STORE_TIMEOUT_S)

    async def scenario() -> None:
        await store.start_cooldown("short", 30)
        await store.start_cooldown("long", 60)
        await store.start_cooldown("long", 5)  # shorter: neither the end nor the TTL move
        await store.start_cooldown("extended", 10)
        await store.start_cooldown("extended", 90)
        await store.start_cooldown("none", 0)
        await store.cooldowns(["unknown", "short"])  # reads create nothing

    asyncio.run(scenario())
    asyncio.run(store.aclose())
    seconds, micros = admin.time()
    redis_now = seconds + micros / 1e6
    ttls = {key.removeprefix(prefix): admin.pttl(key) for key in admin.scan_iter(match=prefix + "*")}
    assert set(ttls) == {"{short}:cooldown", "{long}:cooldown", "{extended}:cooldown"}
    for name, seconds_ in {"short": 30, "long": 60, "extended": 90}.items():
        assert seconds_ * 1000 - 5_000 < ttls[f"{{{name}}}:cooldown"] <= seconds_ * 1000
        ends = float(admin.get(f"{prefix}{{{name}}}:cooldown") or 0)
        start = T0 if with_clock else redis_now
        assert start + seconds_ - 5 < ends <= start + seconds_  # the stored value: the end


def test_redis_a_cooldown_key_is_gone_when_it_ends(redis_url: str, admin: redis.Redis, prefix: str) -> None:
    """On Redis' own clock the key expires by itself when the cooldown ends."""
    store = RedisStore(redis_url, prefix=prefix, timeout_s=STORE_TIMEOUT_S)
    name = f"{prefix}{{brief}}:cooldown"
    asyncio.run(store.start_cooldown("brief", 0.05))
    wait_until(lambda: not admin.exists(name))  # on Redis' clock: nothing to advance
    assert asyncio.run(store.cooldowns(["brief"])) == (0.0,)
    asyncio.run(store.aclose())


def test_redis_cooldown_keys_carry_their_own_hash_tag(
    redis_url: str, admin: redis.Redis, prefix: str
) -> None:
    """Escaped like every key: braces in a model name neither break the tag nor merge keys."""
    store = RedisStore(redis_url, clock=ManualClock(T0), prefix=prefix, timeout_s=STORE_TIMEOUT_S)
    keys = ["openai:gpt-4o-mini", "a{b}c", "}x{", "", "{", "%7B"]

    async def scenario() -> None:
        for i, key in enumerate(keys):
            await store.start_cooldown(key, 10 * (i + 1))
        assert await store.cooldowns(keys) == tuple(pytest.approx(10 * (i + 1)) for i in range(len(keys)))

    asyncio.run(scenario())
    asyncio.run(store.aclose())
    names = list(admin.scan_iter(match=prefix + "*"))
    assert len(names) == len(keys)
    for name in names:
        match = re.fullmatch(r"\{([^{}]+)\}:cooldown", name[len(prefix) :])
        assert match, name
        assert key_slot(name.encode()) == key_slot(match[1].encode())  # the tag's slot


def test_redis_a_stopped_server_fails_fast_and_the_store_recovers() -> None:
    with RedisServer() as server:
        store = RedisStore(server.url, prefix="t:")  # the default timeout, 100 ms

        async def scenario() -> None:
            await store.start_cooldown(CHAIN[0], 60)
            assert (await store.cooldowns(CHAIN))[0] > 59
            server.stop()
            for operation in (store.cooldowns(CHAIN), store.start_cooldown(CHAIN[0], 60)):
                started = time.monotonic()
                with pytest.raises(StoreUnavailable) as raised:
                    await operation
                assert time.monotonic() - started < 1.0
                assert str(server.port) not in str(raised.value)
            started = time.monotonic()
            answers = await asyncio.gather(
                *(store.cooldowns(CHAIN) for _ in range(20)), return_exceptions=True
            )
            assert all(isinstance(a, StoreUnavailable) for a in answers)
            assert time.monotonic() - started < 1.0

            server.start()  # the same port, empty (and without the script)
            assert await store.cooldowns(CHAIN) == (0.0, 0.0, 0.0)
            await store.start_cooldown(CHAIN[2], 60)
            assert (await store.cooldowns(CHAIN))[2] > 59

        asyncio.run(scenario())
        asyncio.run(store.aclose())


def test_redis_a_server_that_never_answers_costs_one_timeout() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        store = RedisStore(f"redis://127.0.0.1:{listener.getsockname()[1]}/0", timeout_s=0.1)

        async def scenario() -> None:
            for operation in (store.cooldowns(CHAIN), store.start_cooldown(CHAIN[0], 60)):
                started = time.monotonic()
                with pytest.raises(StoreUnavailable):
                    await operation
                assert 0.09 < time.monotonic() - started < 0.6

        asyncio.run(scenario())
        asyncio.run(store.aclose())


def test_redis_a_spoiled_key_fails_the_read_of_its_chain_only(
    redis_url: str, admin: redis.Redis, prefix: str
) -> None:
    """A key another program wrote with another type (WRONGTYPE in the script) makes the chain
    reading it `StoreUnavailable`; chains without it are answered, even in the same pipeline."""
    admin.hset(f"{prefix}{{spoiled}}:cooldown", "x", "1")
    admin.expire(f"{prefix}{{spoiled}}:cooldown", 600)  # no immortal keys, even here
    store = RedisStore(redis_url, clock=ManualClock(T0), prefix=prefix, timeout_s=STORE_TIMEOUT_S)

    async def scenario() -> None:
        await store.start_cooldown("fine", 60)
        with pytest.raises(StoreUnavailable, match="ResponseError"):
            await store.cooldowns(["fine", "spoiled"])
        with pytest.raises(StoreUnavailable, match="ResponseError"):
            await store.start_cooldown("spoiled", 60)
        answers = await asyncio.gather(
            *(store.cooldowns(chain) for chain in [["fine", "spoiled"], ["fine", "other"]] * 5),
            return_exceptions=True,
        )
        assert all(isinstance(a, StoreUnavailable) for a in answers[0::2])
        assert answers[1::2] == [(pytest.approx(60), 0.0)] * 5

    asyncio.run(scenario())
    asyncio.run(store.aclose())
