"""A SQLite store on a small disk: its write-ahead log stays bounded under a flood of writes,
and a disk the WAL filled up (SQLITE_FULL) recovers once a checkpoint can run, with no restart.

A real 2 MiB tmpfs (mounted here: the tests run as root), a real uvicorn worker, real HTTP, the
fake Workers AI server. Where no tmpfs can be mounted the test is skipped, except in CI
(`CI=true`), where it fails."""

from __future__ import annotations

import asyncio
import os
import shutil
import sqlite3
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fixtures import FakeWorkersAI

from .test_shared_state import SUMMARY, AppProcess, app_process_env

# A flood of writes, timed: not while another test loads the machine.
pytestmark = pytest.mark.serial

DISK_BYTES = 2 * 1024 * 1024
#: What the store's WAL may take on that disk: it checkpoints every 256 pages of 4 KiB (1 MiB
#: of frames), give or take the commit that crosses the line, and `journal_size_limit` cuts
#: the file back to 1 MiB after a checkpoint. Before, it filled the disk (2 MiB).
WAL_BOUND = DISK_BYTES * 5 // 8


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs mounted at a fresh directory for the test, unmounted after it."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(disk)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        reason = f"cannot mount a tmpfs here (root needed): {mounted.stderr.decode(errors='replace').strip()}"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True, check=False)


def size(file: Path) -> int:
    """`file`'s size (0: none), read while flooding: a stat on a tmpfs, microseconds."""
    return file.stat().st_size if file.exists() else 0


async def flood(url: str, count: int, wal: Path, concurrency: int = 20) -> tuple[int, int, int]:
    """`count` refused `/report` requests from one capped user, each with a new
    `Idempotency-Key` (each claims its task and drops it: two commits), `concurrency` at a
    time, for at most 30 s (a loaded machine); returns how many were sent, how many answered 5xx, and the WAL's
    largest size seen."""
    deadline = time.monotonic() + 30
    sent = failed = largest = 0
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=10, limits=limits) as client:

        async def one() -> None:
            nonlocal sent, failed, largest
            while sent < count and time.monotonic() < deadline:
                r = await client.post(
                    f"{url}/report",
                    json={"text": "refund"},
                    headers={"x-user-id": "capped", "idempotency-key": uuid.uuid4().hex},
                )
                sent += 1
                failed += r.status_code >= 500
                largest = max(largest, size(wal))

        await asyncio.gather(*(one() for _ in range(concurrency)))
    return sent, failed, largest


def smallest_wal_seen(url: str, wal: Path) -> int:
    """The WAL's smallest size seen between refused `/report` requests (two commits each) sent
    one after the other, until it is below a quarter of the disk (at most 10 s)."""
    smallest = size(wal)
    deadline = time.monotonic() + 10
    with httpx.Client(timeout=10) as client:
        while smallest >= DISK_BYTES // 4 and time.monotonic() < deadline:
            client.post(
                f"{url}/report",
                json={"text": "refund"},
                headers={"x-user-id": "capped", "idempotency-key": uuid.uuid4().hex},
            )
            smallest = min(smallest, size(wal))
    return smallest


def admitted(url: str, user: str) -> bool:
    r = httpx.post(f"{url}/summary", json={"text": "refund"}, headers={"x-user-id": user}, timeout=10)
    return r.status_code == 200 and r.json()["fallback"] is None


def test_the_wal_stays_bounded_and_a_full_disk_recovers_when_space_returns(
    small_disk: Path, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.default = SUMMARY
    path = small_disk / "guards.db"
    wal = small_disk / "guards.db-wal"
    env = app_process_env(fake_workers_ai, f"sqlite:///{path}", DAILY_CALL_LIMIT="1")
    app = AppProcess(env, workers=1)
    try:
        app.wait_ready()
        assert admitted(app.url, "capped")  # its one call of the day: the rest are refused
        sent, failed, largest = asyncio.run(flood(app.url, 400, wal))
        assert sent >= 400  # (the WAL filled the disk after about 330, before)
        # Bounded: before, the WAL grew to the whole disk (SQLITE_FULL) and stayed there.
        assert largest <= WAL_BOUND, (largest, sent, failed)
        assert failed == 0, (failed, sent)
        assert admitted(app.url, "after-flood")

        # Now another program's file takes half the free space, and a reader holds a snapshot
        # (a backup, say): no checkpoint can complete, so the WAL grows until the disk is full
        # (SQLITE_FULL: the budget fails closed).
        filler = small_disk / "filler"
        filler.write_bytes(b"\0" * (shutil.disk_usage(small_disk).free // 2))
        reader = sqlite3.connect(path)
        try:
            reader.execute("BEGIN")
            reader.execute("SELECT count(*) FROM guards_counter").fetchall()
            _, failed, largest = asyncio.run(flood(app.url, 200, wal))
            assert failed > 0, largest  # the disk did fill up
            assert not admitted(app.url, "while-full")
            # The snapshot ends (the connection stays open, as another worker's would: no
            # close is the last one, which would checkpoint), and the file is deleted.
            reader.commit()
            filler.unlink()
            # Space returned: a new user is admitted, and within the next checkpoint's worth of
            # commits the WAL gives its space back (a truncating checkpoint, owed since the
            # failure). Before, it kept the whole disk's worth it had grown to.
            deadline = time.monotonic() + 5
            while not admitted(app.url, "space-returned") and time.monotonic() < deadline:
                time.sleep(0.1)  # bounded by the deadline above
            assert admitted(app.url, "space-returned-2")
            assert smallest_wal_seen(app.url, wal) < DISK_BYTES // 4, largest
        finally:
            reader.close()
    finally:
        app.stop()
