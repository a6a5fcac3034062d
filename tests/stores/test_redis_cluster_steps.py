"""A request's step on Redis Cluster, counted by the servers: the scripts of one step go to
every node involved at once, one write each (the legs' slot and the budget's: one round trip);
a charge given back (no leg admitted) costs one more to the budget's node. What is atomic
across slots is in docs/stores.md ("Redis Cluster"); that every store, the cluster included,
gives back a refused scope's charges is `tests/stores/test_store_limits.py`'s."""

from __future__ import annotations

import asyncio
import gc
import itertools
import uuid
from collections.abc import Iterator

import pytest
import redis

from guards import Breaker
from guards.stores import Charge, Passage, RedisStore, Step
from guards.testing.redis_cluster import RedisCluster

LEGS = [("guards:cooldown:m", "guards:breaker:m")]


def owner_of(cluster: RedisCluster, tag: str) -> int:
    """The port of the primary serving the slot of hash tag `tag`."""
    with redis.Redis(*cluster.primaries[0]) as admin:
        return cluster.owner(int(admin.cluster("KEYSLOT", "{" + tag + "}")))


class Node:
    """One primary, as its server counts (`counts()`, one `INFO everything`, so one read):
    the reads it made from its clients, the scripts it ran (`EVALSHA` calls) and the
    acknowledgements its replica sent (`REPLCONF`, about one a second, each a read too)."""

    def __init__(self, host: str, port: int) -> None:
        self.admin = redis.Redis(host=host, port=port)

    def counts(self) -> tuple[int, int, int]:
        info = self.admin.info("everything")
        calls = {
            name: int(info.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("evalsha", "replconf")
        }
        return int(info["total_reads_processed"]), calls["evalsha"], calls["replconf"]


@pytest.fixture
def nodes(redis_cluster: RedisCluster) -> Iterator[dict[int, Node]]:
    """Each primary's counts (its port -> `Node`)."""
    made = {port: Node(host, port) for host, port in redis_cluster.primaries}
    yield made
    for node in made.values():
        node.admin.close()


def counted(
    cluster: RedisCluster, store: RedisStore, nodes: dict[int, Node], step: Step
) -> tuple[Passage, dict[int, tuple[int, int]]]:
    """`step` once the store is warm (a connection to every primary, its script and settings
    read there, the map learnt), and what each primary it touched counted for it: (writes
    read, scripts run). A primary it did not touch ran no script; its reads are left out (a
    connection that an earlier test left to the garbage collector closing is a read too)."""
    tags, covered = [], set()
    for n in itertools.count():  # a key on every primary
        if (port := owner_of(cluster, f"warm-{n}")) not in covered:
            covered.add(port)
            tags.append(f"warm-{n}")
        if len(covered) == len(cluster.primaries):
            break

    async def scenario() -> tuple[Passage, dict[int, tuple[int, int]]]:
        try:
            # Twice: the second answers come after the first connection's settings reads.
            for _ in range(2):
                await asyncio.gather(*(store.get_answer(tag, max_age_s=1) for tag in tags))
            gc.collect()
            before = {port: node.counts() for port, node in nodes.items()}
            passage = await store.step(step)
            after = {port: node.counts() for port, node in nodes.items()}
            # A client's write is one read; the INFO of `after` is one, and so is each
            # acknowledgement the replica sent meanwhile.
            counts = {
                port: (
                    after[port][0] - before[port][0] - 1 - (after[port][2] - before[port][2]),
                    after[port][1] - before[port][1],
                )
                for port in nodes
            }
            return passage, {port: count for port, count in counts.items() if count[1]}
        finally:
            await store.aclose()

    return asyncio.run(scenario())


def test_a_budgeted_step_is_one_write_to_each_node_involved(
    redis_cluster: RedisCluster, nodes: dict[int, Node]
) -> None:
    store = RedisStore(redis_cluster.url, prefix=f"s-{uuid.uuid4().hex[:8]}:", timeout_s=2)
    user = "user:ada"
    passage, writes = counted(
        redis_cluster, store, nodes, Step(None, LEGS, Breaker(), Charge(user, per_minute=5, per_day=5))
    )
    assert passage.admitted == 0
    involved = {owner_of(redis_cluster, "m:m"), owner_of(redis_cluster, user)}
    assert writes == dict.fromkeys(involved, (1, 1))  # one write, one script, each


def test_a_one_model_step_without_a_budget_is_one_script(
    redis_cluster: RedisCluster, nodes: dict[int, Node]
) -> None:
    store = RedisStore(redis_cluster.url, prefix=f"s-{uuid.uuid4().hex[:8]}:", timeout_s=2)
    passage, writes = counted(redis_cluster, store, nodes, Step(None, LEGS, Breaker()))
    assert passage.admitted == 0
    assert writes == {owner_of(redis_cluster, "m:m"): (1, 1)}


def test_a_charge_given_back_costs_one_more_write_to_the_budgets_node(
    redis_cluster: RedisCluster, nodes: dict[int, Node]
) -> None:
    prefix = f"s-{uuid.uuid4().hex[:8]}:"
    user = "user:bo"
    cooling = RedisStore(redis_cluster.url, prefix=prefix, timeout_s=2)
    asyncio.run(cooling.start_cooldown(LEGS[0][0], 60))
    asyncio.run(cooling.aclose())
    store = RedisStore(redis_cluster.url, prefix=prefix, timeout_s=2)
    passage, writes = counted(
        redis_cluster, store, nodes, Step(None, LEGS, Breaker(), Charge(user, per_day=1))
    )
    assert passage.admitted is None
    assert passage.refusal is None  # skipped for its cooldown, not refused by the budget
    budget, model = owner_of(redis_cluster, user), owner_of(redis_cluster, "m:m")
    # The model's peek; the budget's pay, then (a second write) its refund; on one node, the
    # peek and the pay in one write.
    expected = {budget: (2, 2), model: (1, 1)} if model != budget else {budget: (2, 3)}
    assert writes == expected
