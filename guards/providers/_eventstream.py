"""The AWS event stream (`application/vnd.amazon.eventstream`), read incrementally: Bedrock's
`converse-stream` sends its events in these binary frames.

One message on the wire, all integers big-endian:

    total length (4) | headers length (4) | prelude CRC32 (4) | headers | payload | message CRC32 (4)

The prelude CRC covers the first 8 bytes, the message CRC everything before it; both are
checked. A header is `name length (1) | name | type (1) | value`, the value's size fixed by its
type or given by a 2-byte length (byte arrays, strings).

Written here rather than taken from botocore (`EventStreamBuffer`, the reference) so the stream
shares the SSE path's bounds and costs: a message over the adapter's event cap fails as soon
as its prelude says so, before its bytes are buffered; each byte is copied once into the
buffer and read once; the consumed prefix is dropped once per network read. botocore's parser
would also tie the stream to the `bedrock` extra, and its limits (16 MiB a payload) to its own.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, NamedTuple

from ._sse import EventTooLarge, FrameError

__all__ = ["EventStreamCorrupt", "EventStreamParser", "Message", "encode_message"]

_PRELUDE = struct.Struct(">III")
_PRELUDE_BYTES = 12
#: Prelude and message CRC: the smallest message (no header, no payload).
_MIN_MESSAGE = 16
#: The size of each fixed-size header value, by type; 6 (bytes) and 7 (string) carry a 2-byte
#: length, 0 and 1 (true, false) nothing.
_FIXED = {0: 0, 1: 0, 2: 1, 3: 2, 4: 4, 5: 8, 8: 8, 9: 16}
#: A stream repeats a few header blocks (one per event type): blocks this short are read once
#: and kept, at most `_CACHED` of them per parser (then the cache starts over).
_CACHE_BYTES = 256
_CACHED = 32


class EventStreamCorrupt(FrameError):
    """A frame whose lengths or checksums do not hold: the stream cannot be read further."""


class Message(NamedTuple):
    """One message: its headers (strings as `str`, byte arrays as `bytes`, booleans and
    integers as such, timestamps as milliseconds, UUIDs as 16 bytes) and its payload."""

    headers: dict[str, Any]
    payload: bytes


class EventStreamParser:
    """Feed it the body's bytes as they arrive; `feed` returns the messages they completed.

    Raises `EventTooLarge` for a message longer than `max_event_bytes` (as its prelude
    announces it) and `EventStreamCorrupt` for a broken frame. Linear in the bytes fed,
    whatever their split.
    """

    __slots__ = ("_buffer", "_headers", "_max", "_need")

    def __init__(self, *, max_event_bytes: int) -> None:
        self._buffer = bytearray()
        self._max = max_event_bytes
        self._headers: dict[bytes, dict[str, Any]] = {}
        #: The bytes the message being received needs in all, once its prelude was checked.
        self._need = 0

    def feed(self, data: bytes) -> list[Message]:
        buffer = self._buffer
        buffer += data
        size = len(buffer)
        if size < self._need:
            return []  # the same message still on its way: nothing to read again
        messages: list[Message] = []
        start = self._need = 0
        while size - start >= _PRELUDE_BYTES:
            total, headers_length, prelude_crc = _PRELUDE.unpack_from(buffer, start)
            if total > self._max:
                raise EventTooLarge(f"event over {self._max} bytes")
            if zlib.crc32(memoryview(buffer)[start : start + 8]) != prelude_crc:
                raise EventStreamCorrupt("event stream corrupt: prelude checksum")
            if total < _MIN_MESSAGE or headers_length > total - _MIN_MESSAGE:
                raise EventStreamCorrupt("event stream corrupt: lengths")
            if size - start < total:
                self._need = total  # the rest of the message is still on its way
                break
            end = start + total
            view = memoryview(buffer)
            (message_crc,) = struct.unpack_from(">I", buffer, end - 4)
            if zlib.crc32(view[start : end - 4]) != message_crc:
                raise EventStreamCorrupt("event stream corrupt: message checksum")
            headers_start = start + _PRELUDE_BYTES
            payload_start = headers_start + headers_length
            messages.append(
                Message(
                    self._read_headers(bytes(view[headers_start:payload_start])),
                    bytes(view[payload_start : end - 4]),
                )
            )
            view.release()
            start = end
        if start:
            del buffer[:start]
        return messages

    def _read_headers(self, raw: bytes) -> dict[str, Any]:
        """The headers of `raw`, read once per parser for a short block (a copy each time: a
        message's headers are its own)."""
        if len(raw) > _CACHE_BYTES:
            return _headers(raw)
        known = self._headers.get(raw)
        if known is None:
            if len(self._headers) >= _CACHED:
                self._headers.clear()
            known = self._headers[raw] = _headers(raw)
        return known.copy()

    @property
    def pending(self) -> int:
        """Bytes held of a message not yet complete."""
        return len(self._buffer)


def _headers(raw: bytes) -> dict[str, Any]:
    """The headers block of one message (bounded by the message's own length)."""
    headers: dict[str, Any] = {}
    at, end = 0, len(raw)
    try:
        while at < end:
            name_length = raw[at]
            name = raw[at + 1 : at + 1 + name_length].decode("utf-8")
            at += 1 + name_length
            kind = raw[at]
            at += 1
            value: Any
            if kind in (6, 7):
                (length,) = struct.unpack_from(">H", raw, at)
                value = raw[at + 2 : at + 2 + length]
                at += 2 + length
                if kind == 7:
                    value = value.decode("utf-8")
            elif kind in _FIXED:
                width = _FIXED[kind]
                chunk = raw[at : at + width]
                at += width
                value = (
                    kind == 0
                    if kind <= 1
                    else chunk
                    if kind == 9
                    else int.from_bytes(chunk, "big", signed=True)
                )
            else:
                raise EventStreamCorrupt("event stream corrupt: header type")
            if at > end:
                raise EventStreamCorrupt("event stream corrupt: header length")
            headers[name] = value
    except (IndexError, struct.error, UnicodeDecodeError):
        raise EventStreamCorrupt("event stream corrupt: headers") from None
    return headers


def encode_message(headers: dict[str, str], payload: bytes) -> bytes:
    """One message with string headers: what a test server sends (`guards.testing`)."""
    block = bytearray()
    for name, value in headers.items():
        encoded_name, encoded = name.encode(), value.encode()
        block += (
            bytes([len(encoded_name)]) + encoded_name + b"\x07" + struct.pack(">H", len(encoded)) + encoded
        )
    total = _MIN_MESSAGE + len(block) + len(payload)
    prelude = struct.pack(">II", total, len(block))
    head = prelude + struct.pack(">I", zlib.crc32(prelude))
    body = head + bytes(block) + payload
    return body + struct.pack(">I", zlib.crc32(body))
