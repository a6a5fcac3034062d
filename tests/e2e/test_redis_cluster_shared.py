"""Shared state on a real Redis Cluster (three primaries, each with a replica) across app
processes: an exact daily cap, one breaker for every process, and a resharding of the slots in
use while traffic runs.

Real servers only: the cluster (`redis_cluster`, started by the tests), uvicorn app processes
and the fake Workers AI server. What a step costs on a cluster, and what is atomic across slots,
is in docs/stores.md ("Redis Cluster").
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import re
import threading
import uuid
from collections.abc import Callable

import httpx
import pytest
import redis

from guards.testing import Fail, FakeWorkersAI
from guards.testing.redis_cluster import RedisCluster

from .test_shared_state import (
    MODEL,
    SUMMARY,
    AppProcess,
    app_process_env,
    assert_exact_daily_cap,
    burst_across_processes,
)

pytestmark = pytest.mark.serial


def cluster_url(cluster: RedisCluster) -> str:
    """The cluster's store URL with a key prefix of the test's own."""
    return f"{cluster.url}?prefix=t-{uuid.uuid4().hex[:10]}:"


def test_daily_cap_is_exact_across_two_app_processes_on_redis_cluster(
    redis_cluster: RedisCluster, fake_workers_ai: FakeWorkersAI
) -> None:
    """200 concurrent requests of one user, a daily cap of 20, two app processes: 20 calls."""
    fake_workers_ai.default = SUMMARY
    responses = burst_across_processes(app_process_env(fake_workers_ai, cluster_url(redis_cluster)), 200)
    assert_exact_daily_cap(responses, fake_workers_ai, 20)


def test_a_breaker_opened_through_one_process_refuses_in_the_other(
    redis_cluster: RedisCluster, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.default = Fail(status=500)
    env = app_process_env(
        fake_workers_ai,
        cluster_url(redis_cluster),
        BREAKER_FAILURE_THRESHOLD="3",
        BREAKER_RESET_S="300",
        DAILY_CALL_LIMIT="1000",
    )
    first, second = apps = [AppProcess(env) for _ in range(2)]
    try:
        for app in apps:
            app.wait_ready()
        with httpx.Client(timeout=10) as client:

            def reason(app: AppProcess) -> str:
                response = client.post(
                    f"{app.url}/summary", json={"text": "refund"}, headers={"x-user-id": "u"}
                )
                assert response.status_code == 200
                return str(response.json()["fallback"]["reason"])

            reasons = [reason(first) for _ in range(3)]
            assert "circuit_open" not in reasons  # three failures open it
            calls = len(fake_workers_ai.calls)
            assert calls >= 3
            # The other process never saw a failure: the breaker it reads is the cluster's.
            assert [reason(second) for _ in range(5)] == ["circuit_open"] * 5
            assert len(fake_workers_ai.calls) == calls
    finally:
        for app in apps:
            app.stop()


def test_a_resharding_under_traffic_keeps_the_caps_and_answers_every_request(
    redis_cluster: RedisCluster, fake_workers_ai: FakeWorkersAI
) -> None:
    """The slots holding the users' budgets and the model's breaker move to another primary
    while two app processes serve 20 users; every request is answered (the envelope, 200), a
    store failure only as the budget's documented `on_store_failure` (`circuit_open`), and no
    user is admitted over the cap."""
    users, per_user, cap = 20, 30, 20
    fake_workers_ai.default = SUMMARY
    env = app_process_env(fake_workers_ai, cluster_url(redis_cluster), DAILY_CALL_LIMIT=str(cap))
    apps = [AppProcess(env) for _ in range(2)]
    try:
        for app in apps:
            app.wait_ready()
        # One request per user first, so their keys exist and their slots can be found.
        warm = asyncio.run(_requests([app.url for app in apps], [f"user-{i}" for i in range(users)]))
        assert all(r.status_code == 200 and r.json()["fallback"] is None for r in warm)
        prefix = env["GUARDS_STORE"].rsplit("prefix=", 1)[1]
        slots = sorted(_slots_in_use(redis_cluster, prefix))
        assert len(slots) >= 5
        # The model's slot too: its breaker and cooldown (no key while healthy) live there.
        with redis.Redis(*redis_cluster.primaries[0]) as admin:
            slots.append(int(admin.cluster("KEYSLOT", "{m:" + MODEL + "}")))
        moved: list[int] = []
        answered = threading.Condition()
        count = [0]  # requests answered so far

        def one_answered() -> None:
            with answered:
                count[0] += 1
                answered.notify_all()

        def reshard() -> None:
            # Each slot in use to the next primary, one every 10 answers: all during the traffic.
            ports = [port for _, port in redis_cluster.primaries]
            for k, slot in enumerate(slots):
                with answered:
                    if not answered.wait_for(lambda k=k: count[0] >= 10 * (k + 1), timeout=60):
                        return
                source = redis_cluster.owner(slot)
                redis_cluster.move_slot(slot, ports[(ports.index(source) + 1) % len(ports)])
                moved.append(slot)

        mover = threading.Thread(target=reshard)
        names = [f"user-{i % users}" for i in range(users * (per_user - 1))]
        assert len(names) >= 10 * len(slots) + 100  # the traffic goes on after the last move
        mover.start()
        try:
            responses = asyncio.run(_requests([app.url for app in apps], names, 20, one_answered))
        finally:
            with answered:
                count[0] = len(names)  # (a failed burst: the mover ends)
                answered.notify_all()
            mover.join(60)
    finally:
        for app in apps:
            app.stop()
    assert moved == slots, "every slot in use moved while the traffic ran"
    assert {r.status_code for r in responses} == {200}
    bodies = [r.json() for r in responses]
    reasons = collections.Counter(b["fallback"]["reason"] for b in bodies if b["fallback"])
    assert set(reasons) <= {"budget_exceeded", "circuit_open"}, reasons
    calls = collections.Counter(_user(call.inputs) for call in fake_workers_ai.calls)
    assert max(calls.values()) <= cap  # never over a cap, whatever moved
    print(
        f"\nresharding: {len(moved)} slots moved under traffic; calls {sum(calls.values())}, refusals {dict(reasons)}"
    )


async def _requests(
    urls: list[str], users: list[str], concurrency: int = 50, answered: Callable[[], None] = lambda: None
) -> list[httpx.Response]:
    """POST /summary once per entry of `users` (its `x-user-id`), `concurrency` at a time;
    `answered()` after each answer."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=30) as client:

        async def one(i: int, user: str) -> httpx.Response:
            async with gate:
                response = await client.post(
                    f"{urls[i % len(urls)]}/summary",
                    json={"text": f"refund for {user}"},
                    headers={"x-user-id": user},
                )
            answered()
            return response

        return await asyncio.gather(*(one(i, user) for i, user in enumerate(users)))


def _user(inputs: object) -> str:
    """The user whose request made a call (its prompt names them)."""
    found = re.search(r"user-[0-9]+", str(inputs))
    assert found is not None
    return found.group()


def _slots_in_use(cluster: RedisCluster, prefix: str) -> set[int]:
    """The slots of every key under `prefix`, on every primary (epoch markers aside)."""
    slots = set()
    for host, port in cluster.primaries:
        with redis.Redis(host=host, port=port) as admin:
            for key in admin.scan_iter(match=f"{prefix}*", count=1000):
                if not key.endswith(b"}:epoch"):
                    slots.add(int(admin.cluster("KEYSLOT", key)))
    return slots


def test_redis_cli_resharding_a_primarys_every_slot_under_traffic(
    redis_cluster: RedisCluster, fake_workers_ai: FakeWorkersAI
) -> None:
    """`redis-cli --cluster reshard` moves every slot of the primary that holds the most of the
    slots in use (the users' budgets, the model's) to another primary, while two app processes
    serve 20 users without a pause: every request answered, a store failure only as the
    budget's `on_store_failure`, and no user over the cap."""
    users, cap = 20, 20
    fake_workers_ai.default = SUMMARY
    env = app_process_env(fake_workers_ai, cluster_url(redis_cluster), DAILY_CALL_LIMIT=str(cap))
    apps = [AppProcess(env) for _ in range(2)]
    urls = [app.url for app in apps]
    try:
        for app in apps:
            app.wait_ready()
        warm = asyncio.run(_requests(urls, [f"user-{i}" for i in range(users)]))
        assert all(r.status_code == 200 and r.json()["fallback"] is None for r in warm)
        in_use = _slots_in_use(redis_cluster, env["GUARDS_STORE"].rsplit("prefix=", 1)[1])
        with redis.Redis(*redis_cluster.primaries[0]) as admin:
            in_use.add(int(admin.cluster("KEYSLOT", "{m:" + MODEL + "}")))
        owners = collections.Counter(redis_cluster.owner(slot) for slot in in_use)
        source = owners.most_common(1)[0][0]
        ports = [port for _, port in redis_cluster.primaries]
        target = ports[(ports.index(source) + 1) % len(ports)]
        held = sum(last - first + 1 for first, last, port in redis_cluster.slots(source) if port == source)
        done = threading.Event()

        def reshard() -> None:
            try:
                redis_cluster.reshard(held, source, target)
            finally:
                done.set()

        async def traffic() -> tuple[list[httpx.Response], int]:
            """Rounds of 20 concurrent requests until the resharding ends, then one more."""
            responses: list[httpx.Response] = []
            for n in itertools.count():
                ended = done.is_set()
                names = [f"user-{(n * 20 + i) % users}" for i in range(20)]
                responses += await _requests(urls, names, concurrency=20)
                if ended:
                    return responses, n  # n rounds began while it ran
                assert n < 2_000, "the resharding did not end"
            raise AssertionError  # (unreachable)

        mover = threading.Thread(target=reshard)
        mover.start()
        try:
            responses, during = asyncio.run(traffic())
        finally:
            mover.join(120)
        assert not any(port == source for _, _, port in redis_cluster.slots(target))  # all moved
    finally:
        for app in apps:
            app.stop()
    assert during >= 2, "the traffic did not overlap the resharding"
    assert {r.status_code for r in responses} == {200}
    bodies = [r.json() for r in responses]
    reasons = collections.Counter(b["fallback"]["reason"] for b in bodies if b["fallback"])
    assert set(reasons) <= {"budget_exceeded", "circuit_open"}, reasons
    calls = collections.Counter(_user(call.inputs) for call in fake_workers_ai.calls)
    assert max(calls.values()) <= cap
    print(
        f"\nredis-cli reshard: {held} slots ({owners[source]} of the {len(in_use)} in use), {during} rounds "
        f"of 20 during it; {len(responses)} requests, calls {sum(calls.values())}, refusals {dict(reasons)}"
    )
