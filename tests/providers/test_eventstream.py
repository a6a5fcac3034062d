"""The AWS event stream parser Bedrock's stream is read with: the same messages as botocore's
parser (the reference) for any split of the bytes, both checksums checked, a message over the
cap refused from its prelude, every header type read, and time linear in the bytes."""

from __future__ import annotations

import struct
import time
import zlib

import pytest
from botocore.eventstream import EventStreamBuffer

from guards.providers._eventstream import EventStreamCorrupt, EventStreamParser, Message, encode_message
from guards.providers._sse import EventTooLarge, FrameError

FRAMES = [
    encode_message({":event-type": "messageStart", ":message-type": "event"}, b'{"role":"assistant"}'),
    encode_message({":event-type": "contentBlockDelta"}, b'{"delta":{"text":"h\xc3\xa9llo"}}'),
    encode_message({}, b""),
    encode_message({":message-type": "exception", ":exception-type": "throttlingException"}, b"{}"),
]
BODY = b"".join(FRAMES)


def parse(chunks: list[bytes], cap: int = 1 << 20) -> list[Message]:
    parser = EventStreamParser(max_event_bytes=cap)
    return [message for chunk in chunks for message in parser.feed(chunk)]


def test_the_same_messages_as_botocore() -> None:
    reference = EventStreamBuffer()
    reference.add_data(BODY)
    expected = [(m.headers, m.payload) for m in reference]
    assert [(m.headers, m.payload) for m in parse([BODY])] == expected
    assert len(expected) == 4


@pytest.mark.parametrize("size", [1, 2, 3, 7, 12, 13, 16, 100])
def test_any_split_gives_the_same_messages(size: int) -> None:
    chunks = [BODY[i : i + size] for i in range(0, len(BODY), size)]
    assert parse(chunks) == parse([BODY])


def test_every_header_type() -> None:
    def header(name: str, kind: int, value: bytes) -> bytes:
        return bytes([len(name)]) + name.encode() + bytes([kind]) + value

    block = b"".join(
        [
            header("t", 0, b""),
            header("f", 1, b""),
            header("b", 2, b"\xff"),
            header("s", 3, struct.pack(">h", -2)),
            header("i", 4, struct.pack(">i", 70000)),
            header("l", 5, struct.pack(">q", -(1 << 40))),
            header("y", 6, struct.pack(">H", 2) + b"\x00\x01"),
            header("str", 7, struct.pack(">H", 2) + b"ok"),
            header("ts", 8, struct.pack(">q", 1_700_000_000_000)),
            header("u", 9, bytes(range(16))),
        ]
    )
    prelude = struct.pack(">II", 16 + len(block) + 2, len(block))
    message = prelude + struct.pack(">I", zlib.crc32(prelude)) + block + b"{}"
    message += struct.pack(">I", zlib.crc32(message))
    [parsed] = parse([message])
    assert parsed.headers == {
        "t": True, "f": False, "b": -1, "s": -2, "i": 70000, "l": -(1 << 40), "y": b"\x00\x01",
        "str": "ok", "ts": 1_700_000_000_000, "u": bytes(range(16)),
    }  # fmt: skip
    assert parsed.payload == b"{}"


@pytest.mark.parametrize(
    ("offset", "problem"),
    [pytest.param(9, "prelude checksum", id="prelude"), pytest.param(-1, "message checksum", id="message")],
)
def test_a_broken_checksum_is_refused(offset: int, problem: str) -> None:
    broken = bytearray(FRAMES[1])
    broken[offset] ^= 0xFF
    with pytest.raises(EventStreamCorrupt, match=problem):
        parse([FRAMES[0] + bytes(broken)])
    assert issubclass(EventStreamCorrupt, FrameError)


def test_a_message_over_the_cap_is_refused_from_its_prelude() -> None:
    big = encode_message({}, b"x" * 10_000)
    with pytest.raises(EventTooLarge, match="event over 1000 bytes"):
        parse([big[:12]], cap=1000)


@pytest.mark.parametrize(
    "lengths",
    [pytest.param((15, 0), id="under-the-minimum"), pytest.param((16, 1), id="headers-past-the-end")],
)
def test_impossible_lengths_are_refused(lengths: tuple[int, int]) -> None:
    prelude = struct.pack(">II", *lengths)
    with pytest.raises(EventStreamCorrupt, match="lengths"):
        parse([prelude + struct.pack(">I", zlib.crc32(prelude)) + b"\x00" * 8])


MIB = 1 << 20
#: CPU seconds allowed for 1 MiB (as tests/walk/test_linear_time.py): a linear parser takes
#: tens of milliseconds; a quadratic one, re-reading what it holds at each read, minutes.
BOUND_S = 1.0


def cpu_seconds(chunks: list[bytes], cap: int = 2 * MIB) -> float:
    parser = EventStreamParser(max_event_bytes=cap)
    start = time.thread_time()
    for chunk in chunks:
        parser.feed(chunk)
    return time.thread_time() - start


def slices(body: bytes, size: int) -> list[bytes]:
    return [body[i : i + size] for i in range(0, len(body), size)]


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(encode_message({}, b"") * (MIB // 16), id="65536-empty-messages"),
        pytest.param(
            encode_message({":event-type": "contentBlockDelta"}, b"x" * (MIB - 64)), id="one-1-MiB-message"
        ),
    ],
)
@pytest.mark.parametrize("size", [7, 4096])
def test_a_mebibyte_in_linear_time(body: bytes, size: int) -> None:
    """Any split of 1 MiB: many tiny messages, or one message as large as the cap allows,
    arriving a few bytes at a time."""
    spent = cpu_seconds(slices(body, size))
    assert spent < BOUND_S, f"{spent:.2f} s of CPU for 1 MiB"


def test_repeated_header_blocks_are_each_messages_own() -> None:
    """A header block read once is handed out as a copy: a message's headers are its own."""
    first, second = parse([FRAMES[1] * 2])
    first.headers[":event-type"] = "changed"
    assert second.headers == {":event-type": "contentBlockDelta"}
