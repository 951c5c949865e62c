"""The wire protocol's frame layer, sans I/O: kinds, typed records, frame limits, encoders.

Every ZeroMQ message is a multipart message (after the ROUTER identity, which the engine
strips)::

    [b"SB2", kind (1 byte), header (msgpack), blob, blob, ...]   message kinds
    [b"SB2", kind (1 byte), header (msgpack), b""]                control kinds

Message kinds (EVENT, COMMAND, REPLY) carry segments: the messages of one publish (or of
one part of a large ``publish_many``), which share their topic, times and headers and are
stored, sent, acknowledged, resent and deduplicated together (DESIGN.md section 9: one
record per batch, not one key per message). The header is a map holding the sender's node
id, its reply address and one array per segment
``[key, topic, sent_ms, attempt, expires_ms|None, correlation_id|None, headers, ids]``;
each segment's payloads follow as one part of their own, its *blob*: a msgpack array of
the payloads, each already msgpack-encoded by the publisher, exactly as the publisher
stored it, so a payload is never decoded or re-encoded on its way. ``key`` names the
segment (its first message's id when it was stored): what an ack names and a receiver
deduplicates by; ``ids`` are the messages it carries (all of the segment's but those a
sender leaves out for this receiver). Control kinds carry a map and an empty part.
Version 2 of the protocol (``SB2``): buses of 0.2 spoke ``SB1``, one array per message.

The rest of the wire package: ``decoding`` turns frames back into these records (and
refuses what is malformed), ``validation`` says what a field may be, ``payload`` what a
payload may be, ``compression`` how a batch's body is compressed and, within bounds,
decompressed. None of them imports zmq or plyvel.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, NamedTuple

from ..model.packer import pack
from ..model.stored import subscription_options
from .compression import COMPRESS_MIN, _compressor

__all__ = [
    "MAGIC",
    "OLD_MAGIC",
    "MAX_SEGMENTS",
    "Kind",
    "Envelope",
    "Invalid",
    "Batch",
    "Ack",
    "Nack",
    "Subscribe",
    "Unsubscribe",
    "Ping",
    "Pong",
    "Frame",
    "MESSAGE_KINDS",
    "KIND_NAMES",
    "encode_batch",
    "encode_ack",
    "encode_nack",
    "encode_subscribe",
    "encode_unsubscribe",
    "encode_ping",
    "encode_pong",
    "MAX_BATCH",
    "FRAME_BYTES",
    "MAX_HEADERS",
    "frame_body_limit",
]

MAGIC = b"SB2"
OLD_MAGIC = b"SB1"  # what buses of 0.2 send: refused, counted apart (old_protocol)
MAX_BATCH = 10_000  # messages per frame; far above what the engine sends
MAX_SEGMENTS = 1_000  # segments per frame
# Payload bytes a sender puts in one batch frame, at most; one message alone may be bigger
# (up to max_payload). The sender cuts frames by it (core/sender.py) and a receiver bounds
# what a compressed frame may decompress to by it (frame_body_limit).
FRAME_BYTES = 1 << 20
# Encoded headers of one message, at most: they travel in the frame's header part, which
# must stay under the receiver's ZeroMQ message size limit (sockets.py) with the rest.
MAX_HEADERS = 64 << 10
_BIN_HEADER = 5  # bytes msgpack puts before a payload (bin 32), at most; the array's alike


class Kind(IntEnum):
    EVENT = 1
    COMMAND = 2
    REPLY = 3
    ACK = 4
    NACK = 5
    SUBSCRIBE = 6
    UNSUBSCRIBE = 7
    PING = 8
    PONG = 9
    GOSSIP = 10  # what a bus knows of the fleet (model/members.py)


MESSAGE_KINDS = frozenset({Kind.EVENT, Kind.COMMAND, Kind.REPLY})
KIND_NAMES = {int(k): k.name.lower() for k in Kind}  # as shown in journals, CLI, Message.kind
_KIND_BYTES = {kind: bytes([kind]) for kind in Kind}


class Envelope(NamedTuple):
    """One segment of a batch frame: messages that travel together. A tuple, not an
    object: thousands go by per second."""

    id: str  # the segment's key: what is acked and deduplicated
    topic: str
    sent: int  # ms since the epoch, sender's clock
    body: bytes  # the blob: a msgpack array of the payloads, as stored
    attempt: int = 1
    expires: int | None = None  # ms since the epoch, or None for no TTL
    correlation_id: str | None = None
    headers: dict[str, Any] | None = None
    ids: tuple[str, ...] = ()  # the messages, in order; () reads as (id,)

    def message_ids(self) -> tuple[str, ...]:
        return self.ids or (self.id,)


class Batch(NamedTuple):
    kind: Kind
    sender: str
    reply_to: str
    messages: tuple[Envelope, ...]  # segments
    # The sender's wall clock when it sent the frame (header "now", optional): lets the
    # receiver turn ``expires`` into its own clock's terms, whatever the skew between them.
    sent_at: int | None = None
    # (segment key, ids of its messages whose payload exceeds the receiver's max_payload):
    # left out of their segment in ``messages``; the receiver NACKs them by id, naming the
    # segment (the rest of the frame is fine).
    oversize: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # Kept for the receiver's interface: payloads are no longer decoded on receipt (one
    # that does not decode is a dead letter when a handler would get it; handling/runner.py).
    undecodable: tuple[tuple[Envelope, str], ...] = ()
    # Segments whose own fields are not valid (an older or hostile sender), their key
    # aside: not in ``messages``; the receiver acks each and keeps each of its messages
    # as a dead letter (rule 11).
    invalid: tuple["Invalid", ...] = ()


class Invalid(NamedTuple):
    """A segment of a batch whose key can be used but whose other fields are not valid: a
    bad topic, times or attempt out of range, headers that are not a map or that a
    receiver cannot read, a header array of the wrong length, ids that are not ids, a blob
    that is not an array of one bin per message."""

    id: str  # the segment's key
    error: str  # the field and what is wrong with it
    topic: str | None  # as sent, if a str (perhaps not a valid topic; cut to 300 chars)
    header: bytes  # its header array, msgpack: as it came, or re-encoded from what was read
    body: bytes  # its blob as it came
    ids: tuple[str, ...] = ()  # its messages' ids as far as they can be read; () reads as (id,)

    def message_ids(self) -> tuple[str, ...]:
        return self.ids or (self.id,)


class Ack(NamedTuple):
    ids: tuple[str, ...]


class Nack(NamedTuple):
    ids: tuple[str, ...]  # segment keys; or, with ``segment``, messages of that segment
    reason: str
    segment: str | None = None  # header "segment", optional: the messages' segment (the rest of it is kept)


class Subscribe(NamedTuple):
    id: str
    topic: str
    address: str  # where the subscriber wants its events sent
    sender: str
    group: str | None = None  # header "group", optional: a subscriber group it joins
    ordered: bool = False  # header "ordered", optional: one frame at a time, in order
    limit: int | None = None  # header "limit", optional: the subscription ends after this many
    start: str | None = None  # header "start", optional: where a new subscription begins (retention.py)


class Unsubscribe(NamedTuple):
    id: str
    topic: str
    address: str
    sender: str


class Ping(NamedTuple):
    sender: str
    boot: str


class Pong(NamedTuple):
    sender: str
    boot: str
    # The largest payload the answering bus accepts (header "max", optional): a sender
    # dead-letters a bigger message instead of sending what would be refused.
    max_payload: int | None = None
    # Codecs it decodes in batch frames (header "z", optional): a sender with
    # ``wire_compression`` compresses frames to it only if its codec is among them.
    codecs: tuple[str, ...] = ()


class Gossip(NamedTuple):
    sender: str  # the node that sent it
    members: tuple[Any, ...]  # model.members.Member entries, its own first
    reply: bool = False  # an answer to a gossip: not answered again
    # The sender's proof to the receiver (core/members.py): the same every time it writes
    # to that receiver, unknown to any other, so an instance that moves can show it is the
    # one that wrote before. None when it does not know the receiver yet.
    proof: str | None = None


Frame = Batch | Ack | Nack | Subscribe | Unsubscribe | Ping | Pong | Gossip


def frame_body_limit(count: int, max_payload: int) -> int:
    """The most bytes one blob (a segment of ``count`` messages) may hold once
    decompressed: what a sender puts in one segment (FRAME_BYTES of payload, or one message
    of up to ``max_payload``) plus msgpack's framing. Not ``count`` payloads' worth: a frame
    may declare 10,000 messages in a few KB of header."""
    return max(FRAME_BYTES, max_payload) + _BIN_HEADER * (count + 1)


_pack = pack


# --- encoding ------------------------------------------------------------------------------

def encode_batch(kind: Kind, sender: str, reply_to: str, segments: list[Envelope],
                 sent_at: int | None = None, compress: str | None = None) -> list[bytes]:
    """A batch frame of ``segments``: their blobs go as they are (compressed with
    ``compress`` when worth it), each a part of its own."""
    header: dict[str, Any] = {
        "sender": sender,
        "reply_to": reply_to,
        "segs": [
            [m.id, m.topic, m.sent, m.attempt, m.expires, m.correlation_id, m.headers or {},
             list(m.ids) or [m.id]]
            for m in segments
        ],
    }
    if sent_at is not None:
        header["now"] = sent_at
    blobs = [m.body for m in segments]
    if compress == "zstd" and sum(len(b) for b in blobs) >= COMPRESS_MIN:
        header["z"] = "zstd"
        comp = _compressor()
        blobs = [comp.compress(b) for b in blobs]  # each with its content size in it
    return [MAGIC, _KIND_BYTES[kind], _pack(header), *blobs]


def _control(kind: Kind, header: dict[str, Any]) -> list[bytes]:
    return [MAGIC, _KIND_BYTES[kind], _pack(header), b""]


def encode_ack(ids: list[str] | tuple[str, ...]) -> list[bytes]:
    return _control(Kind.ACK, {"ids": list(ids)})


def encode_nack(ids: list[str] | tuple[str, ...], reason: str, segment: str | None = None) -> list[bytes]:
    """Refused for good: segments by key; or, with ``segment``, those messages of it."""
    header: dict[str, Any] = {"ids": list(ids), "reason": reason}
    if segment is not None:
        header["segment"] = segment
    return _control(Kind.NACK, header)


def encode_subscribe(id: str, topic: str, address: str, sender: str, group: str | None = None,
                     ordered: bool = False, limit: int | None = None, start: str | None = None) -> list[bytes]:
    header: dict[str, Any] = {"id": id, "topic": topic, "address": address, "sender": sender}
    header.update(subscription_options(group, ordered, limit))
    if start is not None:
        header["start"] = start
    return _control(Kind.SUBSCRIBE, header)


def encode_unsubscribe(id: str, topic: str, address: str, sender: str) -> list[bytes]:
    return _control(
        Kind.UNSUBSCRIBE, {"id": id, "topic": topic, "address": address, "sender": sender}
    )


def encode_ping(sender: str, boot: str) -> list[bytes]:
    return _control(Kind.PING, {"sender": sender, "boot": boot})


def encode_pong(sender: str, boot: str, max_payload: int | None = None,
                codecs: tuple[str, ...] = ()) -> list[bytes]:
    header: dict[str, Any] = {"sender": sender, "boot": boot}
    if max_payload is not None:
        header["max"] = max_payload
    if codecs:
        header["z"] = list(codecs)
    return _control(Kind.PONG, header)


def encode_gossip(sender: str, members: list[dict[str, Any]], reply: bool = False,
                  proof: str | None = None) -> list[bytes]:
    header: dict[str, Any] = {"sender": sender, "members": members}
    if reply:
        header["reply"] = True
    if proof is not None:
        header["proof"] = proof
    return _control(Kind.GOSSIP, header)
