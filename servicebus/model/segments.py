"""Segments: the unit the bus stores, sends, acknowledges and deduplicates (store format 3).

A segment is the messages of one publish (or one part of a large ``publish_many``), one
command, one reply: they share their kind, topic, times and headers, and each has an id
and a payload. Their payloads are kept as a *blob*: one msgpack array of the payloads,
each already msgpack-encoded by the publisher. The publisher stores the blob once per
stream, the sender puts it in a frame as it is, the receiver stores it as it came; only a
handler's run decodes a payload. One record per segment, where there was one key per
message per step (DESIGN.md section 9: writing one record per batch instead of one key per
message cut store cost from about 180 to 50 us per 100 messages).

A segment's *key* is its first message's id when it was stored. Delivery cursors, acks,
resends, group assignments and the receiver's deduplication all go by keys. What is about
one message alone (a handler that fails, a payload too large for one receiver, a dead
letter) is the exception: that message is taken out of its segment and goes on by itself,
as a segment of one whose key is its own id.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import msgpack

from .packer import pack

__all__ = ["make_blob", "bodies_of", "cut", "single", "count_of", "by_message", "SEGMENT_BYTES"]

SEGMENT_BYTES = 1 << 20  # payload bytes of one segment, at most (protocol.FRAME_BYTES)
_BIN = 5  # what msgpack puts before a payload (bin 32), at most

_unpackb = msgpack.unpackb


def by_message(key: str, ids: Sequence[str]) -> bool:
    """Whether a received segment is run message by message, with progress records: it
    holds several messages, or one that is not its key's (a segment its sender cut for
    this receiver, without its first message). Otherwise it is its key's message alone."""
    return len(ids) != 1 or ids[0] != key


def make_blob(bodies: Sequence[bytes]) -> bytes:
    """The blob of these payloads."""
    return pack(list(bodies))


def bodies_of(blob: bytes) -> list[bytes]:
    """The payloads of a blob (``ValueError`` and msgpack's errors if it is not an array
    of bins: no str, map or ext is read at all)."""
    bodies = _unpackb(blob, raw=False, max_str_len=0, max_map_len=0, max_ext_len=0)
    if type(bodies) is not list or not all(type(b) is bytes for b in bodies):
        raise ValueError("a blob is an array of payloads")
    return bodies


def cut(bodies: Sequence[bytes], max_count: int, max_bytes: int = SEGMENT_BYTES,
        extra: int = 0) -> Iterator[tuple[int, int]]:
    """Where to cut a publish of ``bodies`` into segments: (start, end) index ranges of at
    most ``max_count`` messages and about ``max_bytes`` of payload and per-message
    overhead ``extra`` (one payload alone may be bigger: up to max_payload)."""
    start, size = 0, 0
    for i, body in enumerate(bodies):
        n = len(body) + _BIN + extra
        if i > start and (i - start >= max_count or size + n > max_bytes):
            yield start, i
            start, size = i, 0
        size += n
    if start < len(bodies):
        yield start, len(bodies)


def count_of(record: bytes, ids_at: int) -> int:
    """How many messages a stored segment record holds (its ids are field ``ids_at`` of its
    array), read without copying its payloads; 1 if it does not read."""
    reader = msgpack.Unpacker(raw=False)
    reader.feed(record)
    try:
        reader.read_array_header()
        for _ in range(ids_at):
            reader.skip()
        return int(reader.read_array_header())
    except Exception:  # noqa: BLE001 - damaged: counts as one (check says what it is)
        return 1


def single(blob: bytes, index: int) -> bytes:
    """The blob of one of a blob's payloads: a message taken out of its segment."""
    return make_blob([bodies_of(blob)[index]])
