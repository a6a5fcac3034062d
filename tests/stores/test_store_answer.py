"""Last good answers in every store (`Store.put_answer`, `Store.get_answer`): kept for their TTL
on the store's clock, replaced by a newer one, refused past a reader's max age, bounded keys;
and the memory store's cap on their number. Time moves only through `ManualClock`."""

from __future__ import annotations

import asyncio

import pytest

from fixtures import ManualClock
from guards.stores import MemoryStore, Store, StoredAnswer

T0 = 86_400.0 * 20_000 + 3_600


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


def test_an_answer_is_kept_for_its_ttl_on_the_store_clock(store: Store, clock: ManualClock) -> None:
    async def scenario() -> None:
        assert await store.get_answer("q", max_age_s=600) is None
        await store.put_answer("q", '{"label": "billing"}', ttl_s=600)
        clock.advance(42.5)
        assert await store.get_answer("q", max_age_s=600) == StoredAnswer(
            '{"label": "billing"}', pytest.approx(42.5)
        )
        assert await store.get_answer("q", max_age_s=42.5) is None  # a reader's own max age
        assert await store.get_answer("other", max_age_s=600) is None
        clock.advance(557.5)  # exactly at its end: gone
        assert await store.get_answer("q", max_age_s=10_000) is None

    asyncio.run(scenario())


def test_a_new_answer_replaces_the_old_and_starts_its_age_again(store: Store, clock: ManualClock) -> None:
    async def scenario() -> None:
        await store.put_answer("q", "old", ttl_s=60)
        clock.advance(50)
        await store.put_answer("q", "new \u00e9 {} with spaces", ttl_s=60)
        clock.advance(30)
        found = await store.get_answer("q", max_age_s=60)
        assert found == StoredAnswer("new \u00e9 {} with spaces", pytest.approx(30))

    asyncio.run(scenario())


def test_long_keys_are_bounded_and_kept_apart(store: Store) -> None:
    async def scenario() -> None:
        long_a, long_b = "k" * 300 + "a", "k" * 300 + "b"
        await store.put_answer(long_a, "a", ttl_s=60)
        await store.put_answer(long_b, "b", ttl_s=60)
        assert (await store.get_answer(long_a, max_age_s=60)).value == "a"  # type: ignore[union-attr]
        assert (await store.get_answer(long_b, max_age_s=60)).value == "b"  # type: ignore[union-attr]

    asyncio.run(scenario())


def test_the_memory_store_keeps_a_bounded_number_of_answers(clock: ManualClock) -> None:
    store = MemoryStore(clock=clock, max_answers=3)

    async def scenario() -> None:
        for key in "abcd":
            await store.put_answer(key, key, ttl_s=60)
        await store.put_answer("b", "b2", ttl_s=60)  # stored again: the newest
        await store.put_answer("e", "e", ttl_s=60)
        kept = {key: await store.get_answer(key, max_age_s=60) for key in "abcde"}
        assert {key for key, found in kept.items() if found is not None} == {"b", "d", "e"}
        assert len(store) == 3
        clock.advance(61)
        assert len(store) == 0

    asyncio.run(scenario())
