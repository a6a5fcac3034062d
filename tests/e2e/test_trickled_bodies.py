"""Trickled request bodies cannot take the example app served as `make run` serves it.

The issue's attack: 1,100 connections each sending its body at 1 byte a second made `/health`
answer 503 to most checks for as long as they trickled (a connection mid-body was neither timed
out nor evicted). Here, against `python -m guards.serve app.main:app`, on both HTTP stacks: a
body must keep up with `--timeout-body` plus one second per `--min-body-rate` bytes (else 408),
and a connection mid-body behind that rate makes room for a new one.
"""

from __future__ import annotations

import math
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from guards.serve import ServeError, serve

from .served import STACKS, ServedApp
from .test_slow_clients import wait_closed

APP = "app.main:app"
ENV = {"AI_PROVIDER": "fake", "GUARDS_STORE": "memory://"}
BODY = b'{"text": "' + b"a" * 980 + b'"}'
#: Bounds of the tests.
ANSWER_WITHIN_S = 1.0  # each /health and /summary answer, while the bodies trickle
SLACK_S = 1.0  # past a bound, for the server's timer and this client's loop


def post_head(length: int = len(BODY)) -> bytes:
    return (
        f"POST /summary HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        f"content-length: {length}\r\n\r\n"
    ).encode()


def trickler(port: int) -> socket.socket:
    """A connection that has sent a whole head and the first byte of its body."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(post_head())
    sock.sendall(BODY[:1])
    return sock


def read_until_closed(sock: socket.socket, received: dict[socket.socket, bytes]) -> bool:
    """Read what the server sent on `sock` so far (into `received`); whether it closed it."""
    while answered(sock):
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            return True
        if not data:
            return True
        received[sock] += data
    return False


def answered(sock: socket.socket) -> bool:
    """Whether the server has sent something (an answer, or the close) on `sock`."""
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    yield opened
    for sock in opened:
        sock.close()


@pytest.mark.parametrize("stack", STACKS)
def test_a_body_behind_the_minimum_rate_gets_408_and_one_that_keeps_up_is_served(
    tmp_path: Path, sockets: list[socket.socket], stack: tuple[str, ...]
) -> None:
    """`--timeout-body 1 --min-body-rate 400`: a body at 10 bytes a second is answered 408 and
    closed about a second after its head; a 992-byte body sent at 500 bytes a second (two
    seconds, past the first one) is served; a body the guarded route refused at once (its
    declared length is over the route's limit) and that goes on trickling is closed at the same
    bound, its answer already sent."""
    timeout_s, rate, tick_s = 1.0, 400, 0.1
    args = ("--timeout-body", str(timeout_s), "--min-body-rate", str(rate), *stack)
    with ServedApp(tmp_path / "log", APP, *args, env=ENV) as served:
        served.wait_started(1)
        slow, steady, refused = (
            socket.create_connection(("127.0.0.1", served.port), timeout=10) for _ in range(3)
        )
        sockets += [slow, steady, refused]
        for sock in sockets:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.monotonic()
        slow.sendall(post_head() + BODY[:1])
        steady.sendall(post_head())
        refused.sendall(post_head(2 << 20) + BODY[:1])
        trickling = {slow: 1, refused: 1}
        answers = {slow: b"", refused: b""}
        closed_after: dict[socket.socket, float] = {}
        pieces = [BODY[i : i + 50] for i in range(0, len(BODY), 50)]
        for tick, piece in enumerate(pieces):  # 20 ticks: 2 s in all
            while (wait := start + tick * tick_s - time.monotonic()) > 0:
                time.sleep(wait)  # pacing the bodies (bounded: 2 s in all)
            for sock, sent in trickling.items():
                if sock in closed_after:
                    continue
                if read_until_closed(sock, answers):
                    closed_after[sock] = time.monotonic() - start
                else:
                    sock.send(BODY[sent : sent + 1])
                    trickling[sock] += 1
            steady.sendall(piece)
        steady.settimeout(ANSWER_WITHIN_S)
        steady_answer = steady.recv(65536)
        assert served.stop() == 0
    assert answers[slow].startswith(b"HTTP/1.1 408 ")
    assert answers[refused].startswith(b"HTTP/1.1 400 ")
    assert b" 408 " not in answers[refused]
    # Closed once the first second and the bytes sent (at 400 bytes a second) had passed.
    assert timeout_s <= closed_after.get(slow, math.inf) < timeout_s + SLACK_S
    assert timeout_s <= closed_after.get(refused, math.inf) < timeout_s + SLACK_S
    assert steady_answer.startswith(b"HTTP/1.1 200 ")
    assert "Traceback" not in served.log
    print(f"\n{stack[-1]}: trickled bodies closed after {sorted(closed_after.values())} s")


@pytest.mark.stress
@pytest.mark.parametrize("stack", STACKS)
def test_trickled_bodies_make_room_for_ready_clients(
    tmp_path: Path, sockets: list[socket.socket], stack: tuple[str, ...]
) -> None:
    """300 connections trickle their bodies a byte at a time, past `--limit-concurrency 200`,
    and 10 more come every round (as an attacker reconnects), for 2 s (the default body
    bound, 10 s, ends none of them): `/health` and the guarded route keep answering 200, as
    the trickling connections make room for them (408, or closed before their head was read)."""
    tricklers, limit, rounds, more = 300, 200, 8, 10
    json_type = {"content-type": "application/json"}
    fresh = httpx.Limits(max_keepalive_connections=0)  # a new connection per request
    with ServedApp(tmp_path / "log", APP, "--limit-concurrency", str(limit), *stack, env=ENV) as served:
        served.wait_started(1)
        sockets += [trickler(served.port) for _ in range(tricklers)]
        statuses: list[int] = []
        latencies: list[float] = []
        with httpx.Client(base_url=served.url, timeout=5, limits=fresh) as client:
            for sent in range(1, rounds + 1):
                for sock in sockets:
                    if not answered(sock):
                        sock.send(BODY[sent : sent + 1])
                sockets += [trickler(served.port) for _ in range(more)]
                for method, path, body in (("GET", "/health", None), ("POST", "/summary", BODY)):
                    start = time.monotonic()
                    statuses.append(client.request(method, path, content=body, headers=json_type).status_code)
                    latencies.append(time.monotonic() - start)
                time.sleep(0.25)  # pacing the trickle: about 2 s in all
        closed = wait_closed(sockets, SLACK_S)
        for sock in sockets:
            sock.close()  # the requests still trickling end (a graceful stop waits for them)
        assert served.stop() == 0
    assert statuses == [200] * 2 * rounds
    assert max(latencies) < ANSWER_WITHIN_S, latencies
    # The open connections stayed below the limit; those closed were answered 408 if their head
    # had been read (most), else closed silently.
    assert len(sockets) - limit < len(closed) < len(sockets)
    timed_out = [answer for answer in closed.values() if answer.startswith(b"HTTP/1.1 408 ")]
    assert len(timed_out) + list(closed.values()).count(b"") == len(closed)
    print(
        f"closed {len(closed)} of {len(sockets)}: {len(timed_out)} with 408; max latency {max(latencies):.3f}"
    )
    assert "Traceback" not in served.log


@pytest.mark.parametrize("option", [{"timeout_body_s": 0}, {"min_body_rate": 0}])
def test_a_body_bound_that_cannot_work_is_refused(option: dict[str, float]) -> None:
    with pytest.raises(ServeError, match=r"^timeout_body_s and min_body_rate must be positive$"):
        serve("tests.e2e.serve_probe:app", **option)  # type: ignore[arg-type]
