"""A SQLite file deleted, replaced or truncated under running workers: detected within a second
and answered as an unavailable store (each guard's `on_store_failure`), never a split of the
state and never a dead worker. Real uvicorn workers, real HTTP, the fake Workers AI server."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from pathlib import Path

import httpx

from fixtures import FakeWorkersAI

from .test_shared_state import SUMMARY, AppProcess, app_process_env, burst


def children(pid: int) -> set[int]:
    """The worker processes of the uvicorn supervisor `pid` (from /proc)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry))
    return found


async def burst_and(urls: list[str], count: int, action: float, then: object) -> list[httpx.Response]:
    """`burst`, with `then()` run `action` seconds after it started."""

    async def later() -> None:
        await asyncio.sleep(action)
        then()  # type: ignore[operator]

    responses, _ = await asyncio.gather(burst(urls, count), later())
    return responses


def test_a_deleted_file_never_splits_the_daily_cap_nor_kills_a_worker(
    tmp_path: Path, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.default = SUMMARY
    path = tmp_path / "guards.db"
    app = AppProcess(app_process_env(fake_workers_ai, f"sqlite:///{path}"), workers=4)
    try:
        app.wait_ready()
        workers = children(app.process.pid)
        asyncio.run(burst([app.url], 4, user="warm-up"))  # every worker has its file open

        def delete() -> None:
            for suffix in ("", "-wal", "-shm"):
                Path(f"{path}{suffix}").unlink(missing_ok=True)

        responses = asyncio.run(burst_and([app.url], 200, 0.05, delete))
        time.sleep(1.2)  # past every worker's next check (at most one second)
        after = asyncio.run(burst([app.url], 20))
        assert children(app.process.pid) == workers  # no worker died
        assert app.process.poll() is None
    finally:
        app.stop()
    assert all(r.status_code == 200 for r in responses + after)
    assert len(fake_workers_ai.calls) <= 20 + 4  # the cap of 20, and the warm-up's four
    # The budget fails closed while no file is there; a worker that never had the file (it
    # created a new one) makes every worker move to that one: one state again, never two.
    reasons = {r.json()["fallback"]["reason"] for r in after if r.json()["fallback"]}
    assert reasons <= {"circuit_open", "budget_exceeded"}


def test_a_truncated_wal_index_is_unavailable_not_sigbus_and_a_new_file_recovers(
    tmp_path: Path, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.default = SUMMARY
    path = tmp_path / "guards.db"
    app = AppProcess(app_process_env(fake_workers_ai, f"sqlite:///{path}"), workers=2)
    try:
        app.wait_ready()
        workers = children(app.process.pid)
        asyncio.run(burst([app.url], 4, user="warm-up"))
        os.truncate(f"{path}-shm", 0)  # what a full or reset tmpfs does to a mapped file
        down = asyncio.run(burst([app.url], 10, user="down"))
        # A worker that sees the shrunk WAL index answers unavailable (the budget fails
        # closed); SQLite may also rebuild a zeroed index by itself, and then answers. Never
        # a crash: before the check, the first access to the truncated mapping was a SIGBUS.
        assert all(r.status_code == 200 for r in down)
        fallbacks = [r.json()["fallback"] for r in down]
        assert {f["reason"] for f in fallbacks if f is not None} <= {"circuit_open"}
        assert children(app.process.pid) == workers  # no SIGBUS
        # Usable again: a database at the path (the old one's -wal and -shm removed with it).
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        sqlite3.connect(path).close()
        deadline = time.monotonic() + 5
        while True:
            back = asyncio.run(burst([app.url], 4, user="back"))
            if all(r.json()["fallback"] is None for r in back) or time.monotonic() > deadline:
                break
            time.sleep(0.2)  # bounded by the deadline above
        assert all(r.json()["fallback"] is None for r in back)
        assert children(app.process.pid) == workers
    finally:
        app.stop()
