"""A SQLite WAL index (`-shm`) that the worker may no longer write: made immutable under a
served worker (`chattr +i`, what a read-only remount does to writes). SQLite maps the file
into memory; the kernel refuses a write fault on a page of an immutable file with SIGBUS, so
the first store operation after it used to kill the worker. Now the store answers unavailable
(each guard's `on_store_failure`, the `store_unavailable` warning) and comes back as soon as
the file is writable again. `guards.serve` in a process of its own, real HTTP, the fake
Workers AI server."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fixtures import FakeWorkersAI

from .served import ServedApp
from .test_shared_state import SUMMARY, app_process_env, burst


def chattr(flag: str, path: Path) -> bool:
    """`chattr flag path`; False when this filesystem or user cannot set the attribute."""
    try:
        done = subprocess.run(["chattr", flag, str(path)], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.fixture
def immutable_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory whose files can be made immutable (root on ext4, xfs, btrfs...): the test's
    own, else one under /var/tmp (often another file system than a tmpfs /tmp); skipped only
    when neither allows it. Whatever a test leaves immutable is made mutable again."""
    made = None
    for parent in (tmp_path, Path("/var/tmp")):
        if not parent.is_dir():
            continue
        here = Path(tempfile.mkdtemp(prefix="guards-shm-", dir=parent))
        probe = here / "probe"
        probe.write_bytes(b"x")
        if chattr("+i", probe):
            assert chattr("-i", probe)
            probe.unlink()
            made = here
            break
        shutil.rmtree(here, ignore_errors=True)
    if made is None:
        pytest.skip(f"chattr +i is refused in {tmp_path} and /var/tmp (needs root and ext4, xfs or btrfs)")
    yield made
    for path in made.iterdir():
        chattr("-i", path)
    if made.parent != tmp_path:
        shutil.rmtree(made, ignore_errors=True)


def store_events(log: str) -> list[dict[str, object]]:
    events = []
    for line in log.splitlines():
        if line.startswith("{"):
            with_event = json.loads(line)
            if with_event.get("event") == "store_unavailable":
                events.append(with_event)
    return events


def test_an_immutable_wal_index_is_unavailable_not_sigbus_and_recovers_when_writable(
    immutable_dir: Path, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.default = SUMMARY
    path = immutable_dir / "guards.db"
    env = app_process_env(fake_workers_ai, f"sqlite:///{path}", DAILY_CALL_LIMIT="1000")
    with ServedApp(immutable_dir / "log", "app.main:app", "--workers", "1", env=env) as served:
        served.wait_started(1)
        url = served.url
        warm = asyncio.run(burst([url], 4, user="warm-up"))
        assert all(r.json()["fallback"] is None for r in warm)
        calls = len(fake_workers_ai.calls)
        shm = Path(f"{path}-shm")
        assert shm.exists()
        assert chattr("+i", shm)
        try:
            down = asyncio.run(burst([url], 20, user="down"))
            down += [httpx.post(f"{url}/summary", json={"text": "refund"}, timeout=30) for _ in range(5)]
            assert served.process.poll() is None, served.log
            assert served.started_pids()[1:] == [], served.log  # never a worker started again
        finally:
            assert chattr("-i", shm)
        # The budget fails closed (the app's default for /summary): no call, the fallback.
        assert all(r.status_code == 200 for r in down)
        assert {r.json()["fallback"]["reason"] for r in down} == {"circuit_open"}
        assert len(fake_workers_ai.calls) == calls
        assert {e["guard"] for e in store_events(served.log)} >= {"budget"}
        # Writable again: the same file, the same worker, answering again.
        deadline = time.monotonic() + 10
        while True:
            back = asyncio.run(burst([url], 4, user="back"))
            if all(r.json()["fallback"] is None for r in back) or time.monotonic() > deadline:
                break
            time.sleep(0.2)  # bounded by the deadline above
        assert all(r.json()["fallback"] is None for r in back)
        assert len(served.started_pids()) == 1
        assert "died" not in served.log
