"""`redis+cluster://`: the store on a real Redis Cluster (six nodes, three primaries with a
replica each, started here: `guards.testing.redis_cluster`). Each operation goes to its slot's
primary; the store follows MOVED after a reshard and ASK during a slot's migration, and a
primary that dies fails its slots' operations within the timeout until its replica takes over.

Without `redis-server`/`redis-cli` these tests are skipped, saying so; with
`GUARDS_REQUIRE_REDIS_CLUSTER=1` (set by `.ci/run`) they fail instead. The tests share one
cluster and run in this file's order (the last kills a primary)."""

from __future__ import annotations

import asyncio
import random
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
from redis.crc import key_slot as redis_py_key_slot

from guards import Breaker
from guards.stores import Charge, RedisStore, Step, StoreUnavailable
from guards.stores import _cluster as cluster_module
from guards.stores._cluster import Cluster, key_slot, slot_tag
from guards.stores._redis._address import Address
from guards.testing.redis_cluster import ClusterTLS, RedisCluster

from ..conftest import running_cluster

#: The store's timeout in these tests (most of them: a loaded CI machine answers within it).
TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    """A cluster of this module's own: its tests kill nodes and move slots."""
    with running_cluster() as made:
        yield made


@pytest.fixture
def prefix() -> str:
    return f"c-{uuid.uuid4().hex[:10]}:"


def clients(store: RedisStore) -> Cluster:
    """The store's cluster client in the running loop."""
    return store._connections.clusters[asyncio.get_running_loop()].cluster


def node_of(cluster: RedisCluster, redis_key: str) -> int:
    return cluster.owner(key_slot(redis_key))


# --- URLs --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "seeds", "username", "password", "prefix"),
    [
        ("redis+cluster://h1:7000", (("h1", 7000),), None, None, None),
        ("redis+cluster://h1:7000,h2:7001,h3", (("h1", 7000), ("h2", 7001), ("h3", 6379)), None, None, None),
        ("redis+cluster://:pw@h1:7000/0?prefix=app:", (("h1", 7000),), None, "pw", "app:"),
        (
            "redis+cluster://app:p%40ss@h1:7000,[::1]:7001?db=0",
            (("h1", 7000), ("::1", 7001)),
            "app",
            "p@ss",
            None,
        ),
    ],
)
def test_cluster_urls(
    url: str,
    seeds: tuple[tuple[str, int], ...],
    username: str | None,
    password: str | None,
    prefix: str | None,
) -> None:
    address = Address.parse(url)
    assert (address.cluster, address.username, address.password, address.prefix) == (
        seeds,
        username,
        password,
        prefix,
    )
    assert address.db == 0
    assert address.tls is None
    assert address.master is None
    assert RedisStore(url).cluster


def test_a_tls_cluster_url_has_the_rediss_options() -> None:
    address = Address.parse("rediss+cluster://:pw@h1:7000,h2:7001?ssl_cert_reqs=none")
    assert address.tls is not None
    assert not address.tls.check_hostname
    assert address.cluster == (("h1", 7000), ("h2", 7001))
    assert not RedisStore("redis://localhost:6379/0").cluster


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis+cluster://:s3cret-pw@h1:7000/1", "database 0 only"),
        ("redis+cluster://:s3cret-pw@h1:7000?db=2", "database 0 only"),
        ("redis+cluster://:s3cret-pw@h1:7000/x", "must be a number"),
        ("redis+cluster://:s3cret-pw@h1:port", "node's host:port is malformed"),
        ("redis+cluster://:s3cret-pw@h1:99999", "node's host:port is malformed"),
        ("redis+cluster://:s3cret-pw@h1:7000,,h2:7001", "node's host:port is malformed"),
        ("redis+cluster://:s3cret-pw@", "node's host:port is malformed"),
        ("redis+cluster:/:s3cret-pw@h1:7000", "expected redis+cluster://"),
        ("redis+cluster://:s3cret-pw@" + ",".join(f"h{i}:7000" for i in range(17)), "at most 16 nodes"),
        ("redis+cluster://:s3cret-pw@h1:7000?sentinel_password=s3cret-pw", "needs redis+sentinel://"),
        ("redis+cluster://:s3cret-pw@h1:7000?ssl_cert_reqs=none", "need rediss+cluster://"),
        ("redis+cluster://:s3cret-pw@h1:7000?s3cret-pw=1", "unknown option '?'"),
    ],
)
def test_a_bad_cluster_url_is_refused_without_echoing_it(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match=r".*") as raised:
        RedisStore(url)
    message = str(raised.value)
    assert problem in message
    assert "s3cret" not in message
    assert "h1" not in message
    assert "7000" not in message


# --- slots -------------------------------------------------------------------------------------


def test_key_slot_is_the_clusters(cluster: RedisCluster) -> None:
    """`key_slot` against `CLUSTER KEYSLOT`: random keys, with and without hash tags, and the
    hash-tag rule's edge cases (empty tag, a second tag, braces alone, non-ASCII)."""
    rng = random.Random(7)
    alphabet = "ab{}:%é漢0"
    keys = [
        "",
        "{",
        "}",
        "{}",
        "{}a",
        "a{}",
        "{}{a}",
        "a{b}c{d}",
        "{{a}}",
        "a}b{c}",
        "é{漢}",
        "guards:{%}:rate",
    ]
    keys += ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 12))) for _ in range(300)]
    keys += [f"guards:{{k{i}}}:window" for i in range(100)]
    pipe = cluster.client(cluster.ports[0]).pipeline(transaction=False)
    for key in keys:
        pipe.execute_command("CLUSTER", "KEYSLOT", key)
    assert [key_slot(key) for key in keys] == [int(slot) for slot in pipe.execute()]
    assert all(key_slot(key) == redis_py_key_slot(key.encode()) for key in keys)


def test_slot_tag_names_every_slot(cluster: RedisCluster) -> None:
    """The table of all 16384 slots builds in well under 100 ms (measured: about 30 ms), and
    each tag puts a key in its slot."""
    cluster_module._tags.clear()
    began = time.perf_counter()
    slot_tag(0)
    built_s = time.perf_counter() - began
    assert built_s < 0.5, built_s  # (loaded CI machines: a generous bound)
    tags = [slot_tag(slot) for slot in range(16384)]
    assert all(key_slot(f"guards:{{{tag}}}:epoch") == slot for slot, tag in enumerate(tags))
    assert max(len(tag) for tag in tags) <= 6
    assert all(tag.isdigit() for tag in tags)
    sample = random.Random(3).sample(range(16384), 50)
    client = cluster.client(cluster.ports[0])
    assert [
        int(client.execute_command("CLUSTER", "KEYSLOT", f"p{{{slot_tag(s)}}}:epoch")) for s in sample
    ] == sample


# --- operations ----------------------------------------------------------------------------------


def test_single_key_operations_across_the_primaries(cluster: RedisCluster, prefix: str) -> None:
    """Keys spread over every primary: budgets counted exactly per key, cooldowns started and
    read (one `cooldowns` call over keys of every node), answers stored and read, a breaker
    admitted; one connection per primary."""
    keys = [f"k{i}" for i in range(60)]
    store = RedisStore(cluster.url, prefix=prefix, timeout_s=TIMEOUT_S)
    owners = {node_of(cluster, store._key(key) + ":window") for key in keys}
    assert owners == {port for _, port in cluster.primaries}

    async def main() -> None:
        for _ in range(3):
            admitted = await asyncio.gather(
                *(store.charge_budget(k, per_minute=None, per_day=3) for k in keys)
            )
            assert all(admission.allowed for admission in admitted)
        refused = await asyncio.gather(*(store.charge_budget(k, per_minute=None, per_day=3) for k in keys))
        assert {admission.refused_by for admission in refused} == {"per_day"}
        await asyncio.gather(*(store.start_cooldown(k, 30) for k in keys[::2]))
        waits = await store.cooldowns(keys)
        assert all(25 < wait <= 30 for wait in waits[::2])
        assert not any(waits[1::2])
        await asyncio.gather(*(store.put_answer(k, f"answer {k}", ttl_s=60) for k in keys))
        answers = await asyncio.gather(*(store.get_answer(k, max_age_s=60) for k in keys))
        assert [answer.value if answer else None for answer in answers] == [f"answer {k}" for k in keys]
        decision = await store.breaker_admit("model", Breaker(failure_threshold=2, reset_timeout_s=30))
        assert decision.allowed
        reservation = await store.reserve_spend("spender", amount=2.0, cap=5.0, hold_s=60)
        await store.settle_spend("spender", reservation.reservation or "", actual=1.5)
        assert await store.spent("spender") == 1.5
        assert set(clients(store)._wires) == set(cluster.primaries)
        await store.aclose()

    asyncio.run(main())
    for _, port in cluster.primaries:  # every primary holds some of the keys
        assert cluster.client(port).dbsize() > 0


def test_each_node_gets_the_script_again_after_losing_it(cluster: RedisCluster, prefix: str) -> None:
    """`SCRIPT FLUSH` on every primary: the next operation on each node is answered NOSCRIPT,
    and the script is loaded on that node's connection ahead of the operation sent again."""
    keys = [f"s{i}" for i in range(30)]
    store = RedisStore(cluster.url, prefix=prefix, timeout_s=TIMEOUT_S)

    async def main() -> None:
        await asyncio.gather(*(store.start_cooldown(k, 30) for k in keys))
        for _, port in cluster.primaries:
            cluster.client(port).script_flush()
        waits = await store.cooldowns(keys)
        assert all(25 < wait <= 30 for wait in waits)
        admitted = await asyncio.gather(*(store.charge_budget(k, per_minute=None, per_day=1) for k in keys))
        assert all(admission.allowed for admission in admitted)
        await store.aclose()

    asyncio.run(main())


def test_a_client_per_event_loop_closed_with_it(cluster: RedisCluster, prefix: str) -> None:
    """Each event loop has its own cluster client (one connection per primary), closed when
    that loop shuts down; the store goes on in the next loop. A seed that does not answer (the
    first of the URL here) is passed over: another gives the map."""
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: connection refused
    url = cluster.url.replace("redis+cluster://", f"redis+cluster://127.0.0.1:{dead.getsockname()[1]},")
    store = RedisStore(url, prefix=prefix, timeout_s=TIMEOUT_S)

    async def charge() -> bool:
        admission = await store.charge_budget("looped", per_minute=None, per_day=2)
        assert set(clients(store)._wires) <= set(cluster.primaries)
        return admission.allowed

    try:
        assert [asyncio.run(charge()) for _ in range(3)] == [True, True, False]
        assert not store._connections.clusters
    finally:
        dead.close()


def test_a_cluster_with_a_password(prefix: str) -> None:
    """Every node's connection logs in (AUTH in its first write); a wrong password is
    `StoreUnavailable` naming the error's code, never the password or an address."""
    with running_cluster(password="s3cret-pw") as protected:
        store = RedisStore(protected.url, prefix=prefix, timeout_s=TIMEOUT_S)
        wrong = RedisStore(protected.url.replace("s3cret-pw", "wrong-pw"), prefix=prefix, timeout_s=TIMEOUT_S)

        async def main() -> None:
            keys = [f"p{i}" for i in range(30)]
            await asyncio.gather(*(store.put_answer(k, k, ttl_s=60) for k in keys))
            answers = await asyncio.gather(*(store.get_answer(k, max_age_s=60) for k in keys))
            assert [answer.value if answer else None for answer in answers] == keys
            assert set(clients(store)._wires) == set(protected.primaries)
            with pytest.raises(StoreUnavailable) as raised:
                await wrong.get_answer("p0", max_age_s=60)
            assert "WRONGPASS" in str(raised.value)
            assert "pw" not in str(raised.value)
            assert "127.0.0.1" not in str(raised.value)
            await store.aclose()
            await wrong.aclose()

        asyncio.run(main())


def test_moved_is_followed_after_a_reshard(cluster: RedisCluster, prefix: str) -> None:
    """200 slots move to another primary (`redis-cli --cluster reshard`) while a store has the
    old map: its next operations on those slots are answered MOVED, sent on to the new primary
    and the map updated; the daily counts moved with the keys (charged exactly up to the cap)."""
    source = cluster.primaries[0][1]
    target = cluster.primaries[1][1]
    first = min(start for start, _, port in cluster.slots(source) if port == source)
    moving = range(first, first + 200)  # reshard takes the source's lowest slots
    store = RedisStore(cluster.url, prefix=prefix, timeout_s=TIMEOUT_S)
    candidates = (f"m{i}" for i in range(100_000))
    keys = [key for key in candidates if key_slot(store._key(key) + ":window") in moving][:8]
    assert len(keys) == 8

    async def charge(times: int) -> list[bool]:
        admitted = []
        for _ in range(times):
            each = await asyncio.gather(*(store.charge_budget(k, per_minute=None, per_day=5) for k in keys))
            admitted += [admission.allowed for admission in each]
        return admitted

    async def before() -> None:
        assert all(await charge(3))
        assert all(clients(store)._slots[s] == ("127.0.0.1", source) for s in moving)

    async def after() -> None:
        assert await charge(3) == [True] * 2 * len(keys) + [False] * len(keys)
        slots = clients(store)._slots
        assert {slots[key_slot(store._key(k) + ":window")] for k in keys} == {("127.0.0.1", target)}
        await store.aclose()

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(before())
        cluster.reshard(200, source, target)
        assert {cluster.owner(s) for s in (moving.start, moving.stop - 1)} == {target}
        loop.run_until_complete(after())
    finally:
        loop.close()


def test_ask_is_followed_during_a_migration(cluster: RedisCluster, prefix: str) -> None:
    """One slot migrated by hand. Half-way (MIGRATING on the source, IMPORTING on the target,
    the keys not moved yet): a key the source still has is served there; a new key is answered
    ASK and written on the target (ASKING first); a multi-key script whose keys are not all
    there (a budget's: its day key's stem is never written) is answered TRYAGAIN, retried until
    the store's timeout (then StoreUnavailable), or until the migration ends. Once migrated,
    every key reads back from the target."""
    store = RedisStore(cluster.url, prefix=prefix, timeout_s=TIMEOUT_S)
    slot = key_slot(store._key("asked") + ":answer")
    source = cluster.owner(slot)
    target = next(port for _, port in cluster.primaries if port != source)
    loop = asyncio.new_event_loop()

    def on_target(key: str) -> int:
        pipe = cluster.client(target).pipeline(transaction=False)
        pipe.execute_command("ASKING")
        pipe.exists(key)
        return int(pipe.execute()[1])

    async def halfway() -> None:
        answer = await store.get_answer("asked", max_age_s=60)
        assert answer is not None
        assert answer.value == "before"
        await store.start_cooldown("asked", 30)  # no such key on the source: ASK
        assert on_target(store._key("asked") + ":cooldown") == 1
        on_source = cluster.client(source).execute_command("CLUSTER", "GETKEYSINSLOT", slot, 10)
        assert on_source == [store._key("asked") + ":answer"]
        (wait,) = await store.cooldowns(["asked"])
        assert 25 < wait <= 30
        hurried = RedisStore(cluster.url, prefix=prefix, timeout_s=0.2)
        began = time.monotonic()
        with pytest.raises(StoreUnavailable, match=r"TRYAGAIN|ASK"):  # (whichever came last)
            await hurried.charge_budget("asked", per_minute=None, per_day=5)
        assert time.monotonic() - began < 3 * 0.2
        await hurried.aclose()
        # The migration ends meanwhile (from another thread): the script retried goes through.
        admission, _ = await asyncio.gather(
            store.charge_budget("asked", per_minute=None, per_day=5),
            asyncio.to_thread(cluster.finish_move, slot, source, target),
        )
        assert admission.allowed

    try:
        loop.run_until_complete(store.put_answer("asked", "before", ttl_s=60))
        cluster.move_slot(slot, target, between=lambda: loop.run_until_complete(halfway()))

        async def after() -> None:
            answer = await store.get_answer("asked", max_age_s=60)
            assert answer is not None
            assert answer.value == "before"
            (wait,) = await store.cooldowns(["asked"])
            assert 25 < wait <= 30
            assert (await store.charge_budget("asked", per_minute=None, per_day=5)).allowed
            assert clients(store)._slots[slot] == ("127.0.0.1", target)
            await store.aclose()

        loop.run_until_complete(after())
    finally:
        loop.close()


def test_clusterdown_fails_the_operation_and_the_store_comes_back(cluster: RedisCluster, prefix: str) -> None:
    """A slot no node serves (DELSLOTS everywhere): the cluster refuses every command
    (CLUSTERDOWN, full coverage required), which the store raises as StoreUnavailable; once the
    slot is served again, the store reads the slots afresh and works."""
    store = RedisStore(cluster.url, prefix=prefix, timeout_s=TIMEOUT_S)
    slot = key_slot(store._key("down") + ":answer")
    owner = cluster.owner(slot)
    orphan = (slot + 1) % 16384
    orphan_owner = cluster.owner(orphan)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(store.put_answer("down", "kept", ttl_s=60))
        for port in cluster.ports:
            cluster.client(port).execute_command("CLUSTER", "DELSLOTS", orphan)
        deadline = time.monotonic() + 5
        while "cluster_state:fail" not in str(cluster.client(owner).execute_command("CLUSTER", "INFO")):
            assert time.monotonic() < deadline, "the cluster did not go down"
            time.sleep(0.02)  # polling the cluster's state, bounded by the deadline
        with pytest.raises(StoreUnavailable, match="CLUSTERDOWN"):
            loop.run_until_complete(store.get_answer("down", max_age_s=60))
        cluster.client(orphan_owner).execute_command("CLUSTER", "ADDSLOTS", orphan)
        cluster.wait_agreed()
        answer = loop.run_until_complete(store.get_answer("down", max_age_s=60))
        assert answer is not None
        assert answer.value == "kept"
        loop.run_until_complete(store.aclose())
    finally:
        loop.close()


def test_a_dead_primary_fails_its_slots_within_the_timeout_until_its_replica_takes_over(
    cluster: RedisCluster, prefix: str
) -> None:
    """A primary killed (SIGKILL): operations on its slots raise StoreUnavailable within the
    timeout, the other primaries' keys keep working; once its replica is promoted (about 2 s
    later: the cluster's node timeout is 1 s), the store finds it, and the key written before
    is there. (Runs last: the cluster is left with a primary that has no replica.)"""
    timeout_s = 0.3
    store = RedisStore(cluster.url, prefix=prefix, timeout_s=timeout_s)
    keys = [f"d{i}" for i in range(60)]
    by_node: dict[int, list[str]] = {}
    for key in keys:
        by_node.setdefault(node_of(cluster, store._key(key) + ":answer"), []).append(key)
    victim = cluster.primaries[-1][1]
    doomed, alive = by_node[victim][0], next(ks[0] for port, ks in by_node.items() if port != victim)

    async def main() -> float:
        for key in (doomed, alive):
            await store.put_answer(key, f"kept {key}", ttl_s=600)
        assert cluster.client(victim).wait(1, 2000) >= 1  # the replica has it
        cluster.kill(victim)
        began = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await store.get_answer(doomed, max_age_s=600)
        assert time.monotonic() - began < 3 * timeout_s
        answer = await store.get_answer(alive, max_age_s=600)
        assert answer is not None
        assert answer.value == f"kept {alive}"
        deadline = began + 10
        while True:
            began_call = time.monotonic()
            try:
                answer = await store.get_answer(doomed, max_age_s=600)
                break
            except StoreUnavailable:
                assert time.monotonic() - began_call < 3 * timeout_s
                assert time.monotonic() < deadline, "the replica was not promoted within 10 s"
                await asyncio.sleep(0.05)  # polling for the promotion, bounded by the deadline
        assert answer is not None
        assert answer.value == f"kept {doomed}"
        await store.aclose()
        return time.monotonic() - began

    took_s = asyncio.run(main())
    assert took_s < 10


def test_ci_requires_the_cluster_tests() -> None:
    script = (Path(__file__).parents[2] / ".ci" / "run").read_text()
    assert "export GUARDS_REQUIRE_REDIS_CLUSTER=1" in script


def test_a_tls_cluster_checks_every_nodes_certificate(tmp_path: Path, prefix: str) -> None:
    """`rediss+cluster://...?ssl_ca_certs=...` on a cluster that speaks TLS only (Debian's Redis
    7, built with it): every primary's connection is TLS, its certificate checked, budgets and
    a step work across them; a client that does not trust the CA is `StoreUnavailable`, naming
    no address."""
    ca = trustme.CA()
    node = ca.issue_cert("127.0.0.1", "localhost")
    files = ClusterTLS(str(tmp_path / "node.pem"), str(tmp_path / "node.key"), str(tmp_path / "ca.pem"))
    node.cert_chain_pems[0].write_to_path(files.cert_file)
    node.private_key_pem.write_to_path(files.key_file)
    ca.cert_pem.write_to_path(files.ca_file)
    with running_cluster(tls=files, replicas=0) as cluster:
        store = RedisStore(cluster.url + "&prefix=" + prefix, timeout_s=TIMEOUT_S)
        untrusting = RedisStore(cluster.url.split("?")[0], timeout_s=TIMEOUT_S)  # the system's CAs

        async def scenario() -> None:
            users = [f"user-{i}" for i in range(12)]  # spread over the three primaries
            first = await asyncio.gather(*(store.charge_budget(u, per_minute=None, per_day=1) for u in users))
            again = await asyncio.gather(*(store.charge_budget(u, per_minute=None, per_day=1) for u in users))
            assert [a.allowed for a in first] == [True] * 12
            assert [a.allowed for a in again] == [False] * 12
            legs = [("guards:cooldown:m", "guards:breaker:m")]
            assert (await store.step(Step(None, legs, Breaker(), Charge("user-x", per_day=1)))).admitted == 0
            assert set(clients(store)._wires) == set(cluster.primaries)
            with pytest.raises(StoreUnavailable) as raised:
                await untrusting.get_answer("k", max_age_s=1)
            assert "127.0.0.1" not in str(raised.value)
            await store.aclose()
            await untrusting.aclose()

        asyncio.run(scenario())


def test_keys_evicted_on_any_primary_are_reported_as_a_reset(cluster: RedisCluster, prefix: str) -> None:
    """Each primary is asked how many keys it evicted (`INFO stats`, behind the store's health
    reads, at most once a second per node): a rise on any of them is a reset, even on a node
    that the health read's own keys are not on."""
    store = RedisStore(cluster.url, prefix=prefix, timeout_s=TIMEOUT_S)
    legs = [("guards:cooldown:m", "guards:breaker:m")]
    port = cluster.owner(0)
    node = cluster.client(port)
    fillers = [f"filler{{{slot_tag(0)}}}:{n}" for n in range(20_000)]
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(store.health(legs))  # each primary's baseline, at connect
        before = int(node.info("stats")["evicted_keys"])
        node.config_set("maxmemory-policy", "allkeys-lru")
        node.config_set("maxmemory", int(node.info("memory")["used_memory"]) + 512 * 1024)
        for start in range(0, len(fillers), 500):  # bounded: the node evicts long before the end
            with node.pipeline(transaction=False) as pipe:
                for name in fillers[start : start + 500]:
                    pipe.set(name, b"x" * 512)
                pipe.execute()
            if int(node.info("stats")["evicted_keys"]) > before:
                break
        assert int(node.info("stats")["evicted_keys"]) > before
        node.config_set("maxmemory", 0)
        deadline = time.monotonic() + 5
        while store.epoch.resets == 0:
            assert time.monotonic() < deadline, "the eviction was not noticed"
            loop.run_until_complete(store.health(legs))
            loop.run_until_complete(asyncio.sleep(0.05))  # the next health read, bounded above
        assert store.epoch.resets == 1
        loop.run_until_complete(store.aclose())
    finally:
        node.config_set("maxmemory", 0)
        node.config_set("maxmemory-policy", "noeviction")
        for start in range(0, len(fillers), 1000):
            node.delete(*fillers[start : start + 1000])
        loop.close()
