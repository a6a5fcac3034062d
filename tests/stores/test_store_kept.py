"""Kept streams in every store (`StreamKeeper`: the events of resumable streams): appended in
order, only at the length the writer expects (an expired or evicted stream is never made again
from its middle), read from any position with the stream's length, kept for the TTL of the last
write, and names pointing at streams. Time moves through `ManualClock` (Redis keeps its TTLs on
its own clock: there the TTL is read back)."""

from __future__ import annotations

import asyncio

import pytest

from fixtures import ManualClock
from guards.stores import MemoryStore, StreamKeeper

from ..conftest import redis_admins

T0 = 86_400.0 * 20_000 + 3_600


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


def test_a_stream_is_appended_in_order_and_read_from_any_position(store: StreamKeeper) -> None:
    async def scenario() -> None:
        assert isinstance(store, StreamKeeper)
        assert await store.kept_read("s", 0, 10) is None
        assert await store.kept_append("s", ["e1", "e2"], at=0, ttl_s=60)
        assert await store.kept_append("s", ["e3"], at=2, ttl_s=60)
        assert await store.kept_read("s", 0, 10) == (3, ["e1", "e2", "e3"])
        assert await store.kept_read("s", 1, 1) == (3, ["e2"])
        assert await store.kept_read("s", 3, 10) == (3, [])
        # A writer that does not know the stream's length appends nothing.
        assert not await store.kept_append("s", ["x"], at=1, ttl_s=60)
        assert not await store.kept_append("gone", ["x"], at=3, ttl_s=60)
        assert await store.kept_read("gone", 0, 1) is None
        assert await store.kept_read("s", 0, 10) == (3, ["e1", "e2", "e3"])
        await store.kept_wait("s", 0, 0.01)  # returns at once: there is more than 0

    asyncio.run(scenario())


def test_a_stream_lives_for_the_ttl_of_its_last_write(
    store: StreamKeeper, clock: ManualClock, store_kind: str, request: pytest.FixtureRequest
) -> None:
    async def scenario() -> None:
        await store.kept_append("s", ["e1"], at=0, ttl_s=600)
        await store.kept_append("s", ["e2"], at=1, ttl_s=60)  # the last write's TTL holds
        await store.kept_set("chat", "s", ttl_s=60)
        if store_kind.startswith("redis"):  # on the server's clock: read it back
            admins = redis_admins(store_kind, request)
            try:
                keys = [(admin, key) for admin in admins for key in admin.scan_iter(match="*{s}:kept")]
                keys += [(admin, key) for admin in admins for key in admin.scan_iter(match="*{chat}:kept")]
                ttls = [admin.pttl(key) for admin, key in keys]
            finally:
                for admin in admins:
                    admin.close()
            assert ttls
            assert all(0 < ttl <= 60_000 for ttl in ttls)
            return
        clock.advance(59)
        assert await store.kept_read("s", 0, 5) == (2, ["e1", "e2"])
        assert await store.kept_get("chat") == "s"
        clock.advance(1)
        assert await store.kept_read("s", 0, 5) is None
        assert await store.kept_get("chat") is None
        # Expired: it starts again only from its start.
        assert not await store.kept_append("s", ["e3"], at=2, ttl_s=60)
        assert await store.kept_append("s", ["f1"], at=0, ttl_s=60)
        assert await store.kept_read("s", 0, 5) == (1, ["f1"])

    asyncio.run(scenario())


def test_a_name_points_at_a_stream(store: StreamKeeper) -> None:
    async def scenario() -> None:
        assert await store.kept_get("chat-1") is None
        await store.kept_set("chat-1", "stream-a", ttl_s=60)
        await store.kept_set("chat-1", "stream-b", ttl_s=60)
        assert await store.kept_get("chat-1") == "stream-b"

    asyncio.run(scenario())


def test_the_memory_store_keeps_a_bounded_number_of_streams(clock: ManualClock) -> None:
    async def scenario() -> None:
        store = MemoryStore(clock=clock, max_streams=3)
        for n in range(5):
            assert await store.kept_append(f"s{n}", ["e"], at=0, ttl_s=60)
        found = [await store.kept_read(f"s{n}", 0, 1) for n in range(5)]
        assert found == [None, None, (1, ["e"]), (1, ["e"]), (1, ["e"])]  # the oldest went first

    asyncio.run(scenario())
