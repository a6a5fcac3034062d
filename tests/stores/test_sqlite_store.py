"""`SQLiteStore` specifics: WAL, exact limits across OS processes sharing one file, a locked or
unreachable file answered by `StoreUnavailable` within the store's timeout, and rows that all
expire and are swept. The behaviour it shares with every store is in test_store_*.py and
test_breaker.py. Time moves only through `ManualClock`; nothing sleeps (the test of a worker
serving while another program holds the lock uses short real deadlines)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import queue
import sqlite3
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

from fixtures import FakeBinding, ManualClock, Reply
from fixtures.stores import PiecewiseStore
from guards import AI, Breaker, Budget, CircuitState, Guards, Outcome, header_key
from guards.stores import (
    DAILY_TTL_S,
    Admission,
    Charge,
    MoreLimits,
    Share,
    SQLiteStore,
    Step,
    Store,
    StoreUnavailable,
)

from ..conftest import STORE_TIMEOUT_S, Serve

MIDNIGHT = 86_400.0 * 20_000  # 2024-10-04T00:00:00Z
T0 = MIDNIGHT + 3_600  # 01:00 UTC
DAY = "2024-10-04"


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "guards.db"


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


@pytest.fixture
def store(path: Path, clock: ManualClock) -> Iterator[SQLiteStore]:
    store = SQLiteStore(path, clock=clock)
    yield store
    asyncio.run(store.aclose())


@contextmanager
def peek(path: Path) -> Iterator[sqlite3.Connection]:
    """A connection of its own to the store's file, as another program would open it."""
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        yield conn


def tables(conn: sqlite3.Connection) -> list[str]:
    """The store's tables of state, each row expiring: all but the epoch marker's (one row,
    kept for ever: see `test_the_epoch_marker_is_one_row_that_never_expires`)."""
    rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")
    return [name for (name,) in rows if name != "guards_epoch"]


def row_counts(path: Path) -> dict[str, int]:
    with peek(path) as conn:
        return {t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in tables(conn)}


async def leave_state_everywhere(store: PiecewiseStore, clock: ManualClock) -> Breaker:
    """Rows in every table: a rate window, a daily counter, a live hold, settled spend, an open
    breaker and a closed one that counts failures, a cooldown, a last good answer, a task with a
    saved step, a kept stream and a name pointing at it, a shared limit's minute and its token
    hold. Returns the breakers' policy."""
    policy = Breaker(failure_threshold=2, reset_timeout_s=30)
    assert (await store.charge_budget("user", per_minute=5, per_day=10)).allowed
    hold = await store.reserve_spend("team", amount=3, cap=10, hold_s=120)
    assert hold.reservation is not None
    assert (await store.reserve_spend("team", amount=2, cap=10, hold_s=120)).allowed  # never settled
    await store.settle_spend("team", hold.reservation, actual=1.25)
    for _ in range(2):
        await store.breaker_record("breaker:open", policy, Outcome.failure, probe=None)
    await store.breaker_record("breaker:flaky", policy, Outcome.failure, probe=None)
    await store.start_cooldown("openai:gpt-4o-mini", 30)
    await store.put_answer("guards:last_good:0f1e", '{"label": "billing"}', ttl_s=600)
    task = await store.task_claim(
        "guards:task:r:k", fingerprint="fp", lease_s=76, ttl_s=86_400, owner="guards:tasks:r:ada"
    )
    assert task.lease is not None
    assert await store.task_save("guards:task:r:k", task.lease, "summarize", '"s"', lease_s=76)
    assert await store.kept_append("guards:kept:s", ["id: s:1\ndata: x\n\n"], at=0, ttl_s=600)
    await store.kept_set("guards:kept:c", "s", ttl_s=600)
    share = Share("acme", 1.0, 10, 1_000)  # a shared limit's minute, with a token hold
    charge = Charge("guards:upstream", None, None, None, 0.0, 120.0, MoreLimits(tokens=40, share=share))
    assert (
        await store.step(Step(legs=[("guards:cooldown:m", "guards:breaker:m")], charge=charge))
    ).admitted == 0
    return policy


# --- set-up ---------------------------------------------------------------------------------------


def test_sqlite_store_is_a_store(store: SQLiteStore) -> None:
    assert isinstance(store, Store)


def test_the_file_is_in_wal_mode(store: SQLiteStore, path: Path) -> None:
    asyncio.run(store.charge_budget("k", per_minute=None, per_day=1))
    with peek(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_every_table_has_expires_at_and_every_row_sets_it(
    store: SQLiteStore, path: Path, clock: ManualClock
) -> None:
    asyncio.run(leave_state_everywhere(store, clock))
    counts = row_counts(path)
    assert set(counts) == {
        "guards_window",
        "guards_counter",
        "guards_spend",
        "guards_hold",
        "guards_breaker",
        "guards_cooldown",
        "guards_answer",
        "guards_task",
        "guards_task_step",
        "guards_task_owner",
        "guards_kept_list",
        "guards_kept_item",
        "guards_kept_name",
        "guards_share",
    }
    assert all(counts.values()), counts  # the scenario left rows in every table
    with peek(path) as conn:
        for table in tables(conn):
            columns = {
                name: notnull for _, name, _, notnull, _, _ in conn.execute(f"PRAGMA table_info({table})")
            }
            assert columns.get("expires_at") == 1, f"{table} has no NOT NULL expires_at"
            assert conn.execute(f"SELECT count(*) FROM {table} WHERE expires_at IS NULL").fetchone() == (0,)
            # Every row expires in the future, and no later than the longest TTL.
            assert conn.execute(
                f"SELECT count(*) FROM {table} WHERE NOT (expires_at > ? AND expires_at <= ?)",
                (T0, T0 + DAILY_TTL_S),
            ).fetchone() == (0,)


def test_the_epoch_marker_is_one_row_that_never_expires(
    store: SQLiteStore, path: Path, clock: ManualClock
) -> None:
    asyncio.run(leave_state_everywhere(store, clock))
    clock.advance(3 * DAILY_TTL_S)
    asyncio.run(store.charge_budget("k", per_minute=None, per_day=1))  # (a sweep runs)
    with peek(path) as conn:
        assert conn.execute("SELECT count(*) FROM guards_epoch").fetchone() == (1,)


def test_rows_carry_the_memory_stores_ttls(store: SQLiteStore, path: Path, clock: ManualClock) -> None:
    """Rate rows a minute after their admission, daily counters DAILY_TTL_S after their first
    unit, holds `hold_s`, settled spend DAILY_TTL_S, breakers `ttl_s` after their last change
    (an admission that changes nothing writes nothing)."""
    policy = Breaker(failure_threshold=3, reset_timeout_s=30)

    async def scenario() -> None:
        assert (await store.charge_budget("user", per_minute=5, per_day=10)).allowed
        hold = await store.reserve_spend("team", amount=3, cap=10, hold_s=90)
        assert hold.reservation is not None
        await store.breaker_record("breaker", policy, Outcome.failure, probe=None)
        clock.advance(10)
        assert (await store.charge_budget("user", per_minute=5, per_day=10)).allowed
        await store.settle_spend("team", hold.reservation, actual=2.5)
        assert (await store.breaker_admit("breaker", policy)).allowed  # no change: no write

    asyncio.run(scenario())
    with peek(path) as conn:
        assert conn.execute("SELECT key, ts, expires_at FROM guards_window ORDER BY ts").fetchall() == [
            ("user", T0, T0 + 60),
            ("user", T0 + 10, T0 + 70),
        ]
        assert conn.execute("SELECT key, n, expires_at FROM guards_counter").fetchall() == [
            (f"user:day:{DAY}", 2, T0 + DAILY_TTL_S)
        ]
        assert conn.execute("SELECT count(*) FROM guards_hold").fetchone() == (0,)  # settled
        assert conn.execute("SELECT key, settled, expires_at FROM guards_spend").fetchall() == [
            (f"team:spend:{DAY}", 2.5, T0 + 10 + DAILY_TTL_S)
        ]
        assert conn.execute("SELECT key, expires_at FROM guards_breaker").fetchall() == [
            ("breaker", T0 + policy.ttl_s)
        ]


def test_a_hold_expires_after_hold_s(store: SQLiteStore, path: Path) -> None:
    assert asyncio.run(store.reserve_spend("team", amount=3, cap=10, hold_s=45)).allowed
    with peek(path) as conn:
        assert conn.execute("SELECT key, amount, expires_at FROM guards_hold").fetchall() == [
            (f"team:spend:{DAY}", 3.0, T0 + 45)
        ]


def test_refusals_write_nothing(store: SQLiteStore, path: Path) -> None:
    async def scenario() -> None:
        assert (await store.charge_budget("k", per_minute=1, per_day=5)).allowed
        assert (await store.reserve_spend("team", amount=5, cap=5, hold_s=60)).allowed
        before = row_counts(path)
        for _ in range(5):
            assert not (await store.charge_budget("k", per_minute=1, per_day=5)).allowed
            assert not (await store.reserve_spend("team", amount=1, cap=5, hold_s=60)).allowed
        assert row_counts(path) == before

    asyncio.run(scenario())


def test_closed_breakers_keep_no_row(store: SQLiteStore, path: Path, clock: ManualClock) -> None:
    policy = Breaker(failure_threshold=1, reset_timeout_s=30, success_threshold=1)

    async def scenario() -> None:
        for i in range(20):
            assert (await store.breaker_admit(f"breaker:{i}", policy)).allowed
            await store.breaker_record(f"breaker:{i}", policy, Outcome.success, probe=None)
        assert row_counts(path)["guards_breaker"] == 0
        # Opened, then closed again by a probe: the row goes.
        await store.breaker_record("breaker:0", policy, Outcome.failure, probe=None)
        assert row_counts(path)["guards_breaker"] == 1
        clock.advance(30)
        probe = await store.breaker_admit("breaker:0", policy)
        state = await store.breaker_record("breaker:0", policy, Outcome.success, probe=probe.probe)
        assert state.state is CircuitState.closed
        assert row_counts(path)["guards_breaker"] == 0

    asyncio.run(scenario())


# --- expiry ---------------------------------------------------------------------------------------


def test_a_sweep_past_every_ttl_leaves_no_rows(store: SQLiteStore, path: Path, clock: ManualClock) -> None:
    policy = asyncio.run(leave_state_everywhere(store, clock))
    assert sum(row_counts(path).values()) >= 7
    clock.advance(DAILY_TTL_S + policy.ttl_s + 61)  # past every TTL and the sweep interval
    assert asyncio.run(store.spent("team")) == 0  # an operation that writes nothing: it sweeps
    assert row_counts(path) == dict.fromkeys(row_counts(path), 0)


def test_expired_rows_are_ignored_until_swept_at_most_once_per_interval(
    path: Path, clock: ManualClock
) -> None:
    policy = Breaker(failure_threshold=1, reset_timeout_s=30)
    store = SQLiteStore(path, clock=clock, sweep_interval_s=10 * DAILY_TTL_S)

    async def scenario() -> None:
        await store.breaker_record("breaker", policy, Outcome.failure, probe=None)  # open; swept at T0
        assert (await store.charge_budget("k", per_minute=1, per_day=None)).allowed
        clock.set(T0 + policy.ttl_s)  # both rows expired, not yet swept
        assert row_counts(path)["guards_window"] == 1
        assert (await store.charge_budget("k", per_minute=1, per_day=None)).allowed
        # The admission deleted the expired one at its window's tail (at most two per admission).
        assert row_counts(path)["guards_window"] == 1
        assert row_counts(path)["guards_breaker"] == 1  # expired, not yet swept
        # An open breaker read after its row expired would half-open; a forgotten one is closed.
        decision = await store.breaker_admit("breaker", policy)
        assert (decision.allowed, decision.probe, decision.state) == (True, None, CircuitState.closed)
        clock.set(T0 + 10 * DAILY_TTL_S)
        assert await store.spent("nobody") == 0
        assert sum(row_counts(path).values()) == 0
        await store.aclose()

    asyncio.run(scenario())


def test_a_sweep_deletes_a_bounded_batch_and_resumes_at_the_next_operation(
    store: SQLiteStore, path: Path, clock: ManualClock
) -> None:
    async def scenario() -> None:
        for _ in range(1_500):
            assert (await store.charge_budget("busy", per_minute=2_000, per_day=None)).allowed
        assert row_counts(path)["guards_window"] == 1_500
        clock.advance(120)
        await store.spent("nobody")
        assert row_counts(path)["guards_window"] == 500  # one batch of 1,000
        await store.spent("nobody")
        assert row_counts(path)["guards_window"] == 0

    asyncio.run(scenario())


# --- several stores, several processes ------------------------------------------------------------


def test_two_stores_on_one_file_share_their_state(path: Path, clock: ManualClock) -> None:
    """Two workers' stores (two connections to one file) see each other's charges and breakers."""
    policy = Breaker(failure_threshold=1, reset_timeout_s=30)

    async def scenario() -> None:
        a, b = SQLiteStore(path, clock=clock), SQLiteStore(path, clock=clock)
        assert (await a.charge_budget("user", per_minute=None, per_day=2)).allowed
        assert (await b.charge_budget("user", per_minute=None, per_day=2)).allowed
        assert not (await a.charge_budget("user", per_minute=None, per_day=2)).allowed
        await a.breaker_record("breaker", policy, Outcome.failure, probe=None)
        decision = await b.breaker_admit("breaker", policy)
        assert (decision.allowed, decision.state) == (False, CircuitState.open)
        hold = await a.reserve_spend("team", amount=4, cap=5, hold_s=60)
        assert not (await b.reserve_spend("team", amount=4, cap=5, hold_s=60)).allowed
        assert hold.reservation is not None
        await b.settle_spend("team", hold.reservation, actual=1)  # settled by another worker
        assert await a.spent("team") == 1
        await a.aclose()
        await b.aclose()

    asyncio.run(scenario())


def _charge_in_a_process(path: str, now: float, attempts: int, start: Any, results: Any) -> None:
    """A worker process: its own store on the shared file, `attempts` concurrent charges."""

    async def run() -> list[tuple[bool, str | None]]:
        store = SQLiteStore(path, clock=ManualClock(now), timeout_s=10)
        try:
            answers = await asyncio.gather(
                *(store.charge_budget("burst", per_minute=None, per_day=20) for _ in range(attempts))
            )
        finally:
            await store.aclose()
        return [(a.allowed, a.refused_by) for a in answers]

    start.wait()  # every process reaches its first use of the file (schema and all) at once
    results.put(asyncio.run(run()))


def _admit_in_a_process(path: str, now: float, attempts: int, start: Any, results: Any) -> None:
    """A worker process: its own store on the shared file, `attempts` concurrent admits."""
    policy = Breaker(failure_threshold=1, reset_timeout_s=30, half_open_probes=1)

    async def run() -> list[tuple[bool, float | None]]:
        store = SQLiteStore(path, clock=ManualClock(now), timeout_s=10)
        try:
            decisions = await asyncio.gather(
                *(store.breaker_admit("breaker", policy) for _ in range(attempts))
            )
        finally:
            await store.aclose()
        return [(d.allowed, d.probe) for d in decisions]

    start.wait()
    results.put(asyncio.run(run()))


def run_processes(target: Any, path: Path, now: float, attempts: list[int]) -> list[Any]:
    """Run `target` in spawned processes at once, making `attempts[i]` attempts in the i-th;
    their answers, concatenated.
    (A generous store timeout there: these tests are about exactness, not latency.)"""
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(len(attempts)), ctx.Queue()
    processes = [ctx.Process(target=target, args=(str(path), now, n, start, results)) for n in attempts]
    for p in processes:
        p.start()
    answers: list[Any] = []
    reported, deadline = 0, time.monotonic() + 60
    try:
        while reported < len(processes) and time.monotonic() < deadline:
            try:
                answers += results.get(timeout=0.25)
                reported += 1
            except queue.Empty:  # a process that died will never report: stop waiting
                if any(p.exitcode not in (None, 0) for p in processes):
                    break
    finally:
        for p in processes:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in processes] == [0] * len(processes)
    return answers


def test_processes_sharing_a_file_admit_exactly_per_day(path: Path) -> None:
    """200 attempts from 4 processes (50 concurrent each) against a daily cap of 20: exactly 20."""
    answers = run_processes(_charge_in_a_process, path, T0, [50] * 4)
    assert len(answers) == 200
    assert sum(allowed for allowed, _ in answers) == 20
    assert {by for allowed, by in answers if not allowed} == {"per_day"}
    with peek(path) as conn:
        assert conn.execute("SELECT n FROM guards_counter").fetchall() == [(20,)]


def test_processes_sharing_a_file_let_exactly_one_probe_through(path: Path, clock: ManualClock) -> None:
    """A breaker opened by one worker half-opens; 50 admits from 4 processes: one probe."""
    policy = Breaker(failure_threshold=1, reset_timeout_s=30, half_open_probes=1)

    async def open_it() -> None:
        store = SQLiteStore(path, clock=clock)
        await store.breaker_record("breaker", policy, Outcome.failure, probe=None)
        assert not (await store.breaker_admit("breaker", policy)).allowed
        await store.aclose()

    asyncio.run(open_it())
    answers = run_processes(_admit_in_a_process, path, T0 + 30, [13, 13, 12, 12])  # at T0 + 30
    assert len(answers) == 50
    allowed = [probe for ok, probe in answers if ok]
    assert allowed == [T0 + 30]  # exactly one, and it is a probe (its ticket: when it half-opened)


def _charge_in_a_forked_child(store: SQLiteStore, results: Any) -> None:
    results.put(asyncio.run(store.charge_budget("k", per_minute=None, per_day=2)).allowed)


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")  # Python 3.12+: fork with threads
def test_a_store_used_before_a_fork_works_in_the_child(path: Path, clock: ManualClock) -> None:
    """Forked after use (say a pre-forking server), the child gets a thread and connection of its own."""
    store = SQLiteStore(path, clock=clock)
    assert asyncio.run(store.charge_budget("k", per_minute=None, per_day=2)).allowed
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    child = ctx.Process(target=_charge_in_a_forked_child, args=(store, results))
    child.start()
    try:
        assert results.get(timeout=10) is True
    finally:
        child.join(10)
    assert child.exitcode == 0
    assert not asyncio.run(store.charge_budget("k", per_minute=None, per_day=2)).allowed  # it counted
    asyncio.run(store.aclose())


# --- store failures -------------------------------------------------------------------------------


def test_a_locked_file_raises_store_unavailable_within_the_timeout_then_recovers(
    store: SQLiteStore, path: Path
) -> None:
    async def scenario() -> None:
        assert (await store.charge_budget("k", per_minute=None, per_day=2)).allowed
        with peek(path) as locker:
            locker.execute("BEGIN EXCLUSIVE")  # another program holds the write lock
            for operation in (
                store.charge_budget("k", per_minute=None, per_day=2),
                store.reserve_spend("team", amount=1, cap=5, hold_s=60),
                store.breaker_record("b", Breaker(), Outcome.failure, probe=None),
                store.breaker_admit("b", Breaker()),
            ):
                started = time.monotonic()
                with pytest.raises(StoreUnavailable) as raised:
                    await operation
                elapsed = time.monotonic() - started
                assert 0.05 <= elapsed < 1.0  # it waited for the lock, about timeout_s (0.1 s)
                assert str(path) in str(raised.value)
                assert not isinstance(raised.value.__cause__, sqlite3.Error)
            locker.execute("ROLLBACK")
        # Released: the store works again, and the operations that gave up charged nothing.
        assert (await store.charge_budget("k", per_minute=None, per_day=2)).allowed
        assert not (await store.charge_budget("k", per_minute=None, per_day=2)).allowed
        assert (await store.reserve_spend("team", amount=5, cap=5, hold_s=60)).allowed

    asyncio.run(scenario())


def test_concurrent_operations_on_a_locked_file_all_give_up_within_the_timeout(
    store: SQLiteStore, path: Path
) -> None:
    """The timeout covers the wait for the store's thread too: 20 queued operations give up
    together after about `timeout_s`, not one after another."""

    async def scenario() -> None:
        assert (await store.spent("team")) == 0
        with peek(path) as locker:
            locker.execute("BEGIN EXCLUSIVE")
            started = time.monotonic()
            answers = await asyncio.gather(
                *(store.charge_budget("k", per_minute=None, per_day=100) for _ in range(20)),
                return_exceptions=True,
            )
            assert time.monotonic() - started < 1.0
            assert all(isinstance(a, StoreUnavailable) for a in answers), answers
            locker.execute("ROLLBACK")
        assert (await store.charge_budget("k", per_minute=None, per_day=1)).allowed  # none counted

    asyncio.run(scenario())


def test_a_pause_of_this_process_longer_than_the_timeout_is_not_a_store_outage(
    path: Path, clock: ManualClock
) -> None:
    """A garbage collection (or any code holding the GIL) stalls the store's thread as much as
    the event loop: operations held up by it, not by the file, still get their answer."""
    store = SQLiteStore(path, clock=clock, timeout_s=0.05)

    async def scenario() -> None:
        assert await store.spent("warm") == 0
        charges = [
            asyncio.create_task(store.charge_budget("k", per_minute=None, per_day=100)) for _ in range(10)
        ]
        await asyncio.sleep(0)  # the operations are queued, their timers running
        previous = sys.getswitchinterval()
        sys.setswitchinterval(10.0)  # this thread keeps the GIL while it runs, as a collection does
        try:
            end = time.monotonic() + 0.1
            while time.monotonic() < end:
                pass
        finally:
            sys.setswitchinterval(previous)
        answers = await asyncio.gather(*charges)
        assert all(a.allowed for a in answers)
        await store.aclose()

    asyncio.run(scenario())


def test_a_cancelled_operation_has_no_effect(store: SQLiteStore, path: Path) -> None:
    async def scenario() -> None:
        assert await store.spent("warm") == 0
        with peek(path) as locker:
            locker.execute("BEGIN EXCLUSIVE")  # the store's thread will wait for the lock
            charge = asyncio.create_task(store.charge_budget("k", per_minute=None, per_day=1))
            await asyncio.sleep(0)  # queued
            charge.cancel()
            with pytest.raises(asyncio.CancelledError):
                await charge
            locker.execute("ROLLBACK")
        assert (await store.charge_budget("k", per_minute=None, per_day=1)).allowed  # nothing charged

    asyncio.run(scenario())


def test_a_failing_operation_fails_alone_in_its_transaction(path: Path, clock: ManualClock) -> None:
    """Operations queued together share one transaction; one that fails (here on a row the
    store did not write) gets `StoreUnavailable`, and the others are answered as usual."""
    store = SQLiteStore(path, clock=clock, timeout_s=5)
    policy = Breaker(failure_threshold=1, reset_timeout_s=30)

    async def scenario() -> None:
        await store.breaker_record("broken", policy, Outcome.failure, probe=None)
        with peek(path) as locker:
            locker.execute("UPDATE guards_breaker SET state = 'not json'")
            locker.execute("BEGIN EXCLUSIVE")
            first = asyncio.create_task(store.spent("team"))  # the thread waits for the lock
            await asyncio.sleep(0)
            together = asyncio.gather(
                store.charge_budget("k", per_minute=1, per_day=1),
                store.breaker_admit("broken", policy),
                store.charge_budget("k2", per_minute=1, per_day=1),
                return_exceptions=True,
            )
            await asyncio.sleep(0)  # queued while the file is locked: one batch (maybe with `first`)
            locker.execute("ROLLBACK")
            assert await first == 0
            charged, broken, charged_too = await together
        assert charged == Admission(True)
        assert charged_too == Admission(True)
        assert isinstance(broken, StoreUnavailable)
        assert row_counts(path)["guards_counter"] == 2  # both charges committed, once each
        await store.aclose()

    asyncio.run(scenario())


def test_a_file_locked_before_first_use_raises_then_the_store_starts(path: Path, clock: ManualClock) -> None:
    """Another program holds the (not yet WAL) file exclusively when the store first opens it."""
    store = SQLiteStore(path, clock=clock)

    async def scenario() -> None:
        with peek(path) as locker:
            locker.execute("CREATE TABLE other (x)")
            locker.execute("BEGIN EXCLUSIVE")
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await store.charge_budget("k", per_minute=None, per_day=1)
            assert time.monotonic() - started < 1.0
            locker.execute("ROLLBACK")
        assert (await store.charge_budget("k", per_minute=None, per_day=1)).allowed
        await store.aclose()

    asyncio.run(scenario())
    with peek(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_file_that_cannot_be_opened_raises_store_unavailable(tmp_path: Path, clock: ManualClock) -> None:
    path = tmp_path / "missing-directory" / "guards.db"
    store = SQLiteStore(path, clock=clock)

    async def scenario() -> None:
        for operation in (
            store.charge_budget("k", per_minute=1, per_day=1),
            store.reserve_spend("team", amount=1, cap=5, hold_s=60),
            store.spent("team"),
            store.breaker_admit("b", Breaker()),
        ):
            started = time.monotonic()
            with pytest.raises(StoreUnavailable) as raised:
                await operation
            assert time.monotonic() - started < 1.0
            assert str(path) in str(raised.value)
        path.parent.mkdir()  # the directory appears: the store opens the file
        assert (await store.charge_budget("k", per_minute=1, per_day=1)).allowed
        await store.aclose()

    asyncio.run(scenario())


def test_a_closed_store_raises_store_unavailable(path: Path, clock: ManualClock) -> None:
    store = SQLiteStore(path, clock=clock)
    assert asyncio.run(store.charge_budget("k", per_minute=None, per_day=1)).allowed
    asyncio.run(store.aclose())  # another event loop than the operation's
    asyncio.run(store.aclose())  # twice is fine
    with pytest.raises(StoreUnavailable):
        asyncio.run(store.charge_budget("k", per_minute=None, per_day=1))


def test_a_store_never_used_closes(path: Path) -> None:
    asyncio.run(SQLiteStore(path).aclose())
    assert not path.exists()  # nothing was opened


# --- the event loop and the WAL ---------------------------------------------------------------


def test_a_worker_waiting_for_the_files_lock_keeps_serving(path: Path, serve: Serve) -> None:
    """The store runs a transaction on the worker's event loop only when the file's lock is free
    at once. While another program holds it, a guarded request waits for it on the store's
    thread (and is served once it is released, within the store's timeout), and the worker
    answers its other requests meanwhile."""
    guards = Guards(FakeBinding(Reply("ok")), store=SQLiteStore(path, timeout_s=2.0))
    app = FastAPI()
    guards.install(app)

    @app.post("/label")
    @guards.route(model="@cf/test/model", budget=Budget(per_day=100, key=header_key("x-user-id")))
    async def label(ai: AI[str]) -> str:
        return await ai.run({"prompt": "label"})

    @app.get("/ping")
    async def ping() -> str:
        return "pong"

    client = serve(app)
    assert client.post("/label", headers={"x-user-id": "u"}).status_code == 200  # connected
    with peek(path) as locker, ThreadPoolExecutor(1) as pool:
        locker.execute("BEGIN IMMEDIATE")  # another program holds the write lock
        submitted = time.monotonic()
        waiting = pool.submit(client.post, "/label", headers={"x-user-id": "u"})
        pings = 0
        while time.monotonic() - submitted < 0.5 or pings < 5:  # while the request waits
            started = time.monotonic()
            assert client.get("/ping").text == '"pong"'
            assert time.monotonic() - started < 1.0  # a loop waiting for the lock: up to 2 s
            pings += 1
        assert not waiting.done()  # still waiting for the lock (up to its 2 s timeout)
        locker.execute("ROLLBACK")
        assert waiting.result(timeout=10).status_code == 200
    with peek(path) as conn:
        assert conn.execute("SELECT n FROM guards_counter").fetchall() == [(2,)]


def test_the_wal_stays_bounded_with_sqlites_own_checkpoints_off(path: Path, clock: ManualClock) -> None:
    """The store turns SQLite's automatic checkpoint off (it syncs files, which a transaction
    run on the event loop must not do) and its thread checkpoints as often instead: thousands
    of commits leave a WAL of a few megabytes, as SQLite's own 1,000-page checkpoint would. (A
    generous timeout: what is measured is the WAL's size, and a checkpoint's sync on a busy
    machine's disk can outlast the default 0.1 s.)"""
    store = SQLiteStore(path, clock=clock, timeout_s=STORE_TIMEOUT_S)

    async def commits(n: int) -> int:
        for i in range(n):  # one at a time: a transaction each
            assert (await store.charge_budget(f"user-{i % 500}", per_minute=10**6, per_day=None)).allowed
            clock.advance(0.001)
        return os.stat(f"{path}-wal").st_size  # (closing the store removes it)

    wal = asyncio.run(commits(6_000))
    asyncio.run(store.aclose())
    assert wal < 8 * 1024 * 1024, f"WAL of {wal} bytes"  # unbounded, 6,000 commits wrote 80 MB


def test_a_breaker_row_of_an_earlier_version_is_read_and_an_earlier_version_reads_ours(
    store: SQLiteStore, path: Path, clock: ManualClock
) -> None:
    """A row of eight fields (before counted calls and probe intervals were kept) reads as it
    did. A row this version writes keeps those eight in their places, its own two after them,
    which an earlier version ignores (it waits out the open period after a failed probe)."""
    probing = Breaker(failure_threshold=1, reset_timeout_s=30, probe_interval_s=5)
    counting = Breaker(failure_threshold=5, window_s=60, slow_call_s=1, minimum_calls=3)

    async def scenario() -> None:
        assert (await store.breaker_admit("warm-up", probing)).allowed  # the tables exist
        with peek(path) as conn:
            conn.execute(
                "INSERT INTO guards_breaker (key, state, expires_at) VALUES (?, ?, ?)",
                ("old", json.dumps(["open", [], T0, 0, 0, 0, 0, 30.0]), T0 + 660),
            )
        refused = await store.breaker_admit("old", probing)
        assert (refused.allowed, refused.retry_after_s) == (False, pytest.approx(30))
        clock.advance(30)
        probe = await store.breaker_admit("old", probing)
        await store.breaker_record("old", probing, Outcome.failure, probe=probe.probe)
        await store.breaker_record("counted", counting, Outcome.success, probe=None)
        with peek(path) as conn:
            rows = dict(conn.execute("SELECT key, state FROM guards_breaker").fetchall())
        assert json.loads(rows["old"]) == ["open", [], T0 + 30, 0, 0.0, 0, 0.0, 30.0, [], 5.0]
        assert json.loads(rows["counted"]) == ["closed", [], 0.0, 0, 0.0, 0, 0.0, 0.0, [T0 + 30], 0.0]
        assert (await store.breaker_admit("old", probing)).retry_after_s == pytest.approx(5)

    asyncio.run(scenario())
