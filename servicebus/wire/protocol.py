"""The wire protocol, sans I/O: frames <-> typed records, with validation.

Every ZeroMQ message is four frames (after the ROUTER identity, which the engine strips)::

    [b"SB1", kind (1 byte), header (msgpack), body (msgpack or empty)]

Message kinds (EVENT, COMMAND, REPLY) are batched: the header is a map holding the
sender's node id, its reply address and a list of per-message arrays
``[id, topic, sent_ms, attempt, expires_ms|None, correlation_id|None, headers]``; the body
is a msgpack array of the payloads, each already msgpack-encoded by the publisher (so they
are forwarded as bytes and never re-encoded). Control kinds carry a map and an empty body.

This module imports neither zmq nor plyvel. Anything malformed raises ``ProtocolError``
with a short ``reason`` (used as a counter name by the engine), but for what is wrong with
one message of a batch alone: its payload too large (``Batch.oversize``), not decodable
(``Batch.undecodable``) or its own fields not valid (``Batch.invalid``). Those are set
apart by their id and the rest of the frame goes on (DESIGN rule 11); a message whose id
cannot be used refuses its frame (``bad_id``), as nothing could ack it.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, NamedTuple

import msgpack

from ..errors import ProtocolError
from ..model.packer import pack
from ..model.stored import subscription_options
from .compression import COMPRESS_MIN, _compressor, _decompress
from .payload import _show
from .validation import (MAX_ATTEMPT, MAX_ID_LEN, MAX_NAME_LEN, MAX_REASON_LEN, MAX_MS, _address, _attempt,
                         _headers, _id, _int, _ms, _pattern, _str, _topic, validate_group)

__all__ = [
    "MAGIC",
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
    "decode",
    "MAX_BATCH",
    "FRAME_BYTES",
    "MAX_HEADERS",
    "frame_body_limit",
]

MAGIC = b"SB1"
MAX_BATCH = 10_000  # messages per frame; far above what the engine sends
# Payload bytes a sender puts in one batch frame, at most; one message alone may be bigger
# (up to max_payload). The sender cuts frames by it (core/sender.py) and a receiver bounds
# what a compressed frame may decompress to by it (frame_body_limit).
FRAME_BYTES = 1 << 20
# Encoded headers of one message, at most: they travel in the frame's header part, which
# must stay under the receiver's ZeroMQ message size limit (sockets.py) with the rest.
MAX_HEADERS = 64 << 10
_BIN_HEADER = 5  # bytes msgpack puts before a payload (bin 32), at most; the array's alike
_FIELDS = ("id", "topic", "sent", "attempt", "expires", "correlation_id", "headers")
_TOPIC_SHOWN = 300  # characters of an invalid message's topic kept on its dead letter


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


MESSAGE_KINDS = frozenset({Kind.EVENT, Kind.COMMAND, Kind.REPLY})
KIND_NAMES = {int(k): k.name.lower() for k in Kind}  # as shown in journals, CLI, Message.kind
_KIND_BYTES = {kind: bytes([kind]) for kind in Kind}


class Envelope(NamedTuple):
    """One message inside a batch. A tuple, not an object: thousands go by per second."""

    id: str
    topic: str
    sent: int  # ms since the epoch, sender's clock
    body: bytes  # msgpack-encoded payload
    attempt: int = 1
    expires: int | None = None  # ms since the epoch, or None for no TTL
    correlation_id: str | None = None
    headers: dict[str, Any] | None = None


class Batch(NamedTuple):
    kind: Kind
    sender: str
    reply_to: str
    messages: tuple[Envelope, ...]
    # The sender's wall clock when it sent the frame (header "now", optional): lets the
    # receiver turn ``expires`` into its own clock's terms, whatever the skew between them.
    sent_at: int | None = None
    # Ids of messages whose payload exceeds the receiver's max_payload: not in
    # ``messages``; the receiver NACKs them (the rest of the frame is fine).
    oversize: tuple[str, ...] = ()
    # Messages whose payload no receiver can decode (from an older or hostile publisher),
    # with msgpack's error: not in ``messages``; the receiver acks each and keeps it as a
    # dead letter, raw bytes and all (the rest of the frame is fine; DESIGN rule 11).
    undecodable: tuple[tuple[Envelope, str], ...] = ()
    # Messages whose own fields are not valid (an older or hostile sender), their id aside:
    # not in ``messages``; the receiver acks each and keeps it as a dead letter (rule 11).
    invalid: tuple["Invalid", ...] = ()


class Invalid(NamedTuple):
    """A message of a batch whose id can be used but whose other fields are not valid: a
    bad topic, times or attempt out of range, headers that are not a map or that a
    receiver cannot read, a header array of the wrong length, a payload that is not bin."""

    id: str
    error: str  # the field and what is wrong with it
    topic: str | None  # as sent, if a str (perhaps not a valid topic; cut to 300 chars)
    header: bytes  # its header array, msgpack: as it came, or re-encoded from what was read
    body: bytes  # its payload as it came (a payload that was not bin: re-encoded)


class Ack(NamedTuple):
    ids: tuple[str, ...]


class Nack(NamedTuple):
    ids: tuple[str, ...]
    reason: str


class Subscribe(NamedTuple):
    id: str
    topic: str
    address: str  # where the subscriber wants its events sent
    sender: str
    group: str | None = None  # header "group", optional: a subscriber group it joins
    ordered: bool = False  # header "ordered", optional: one frame at a time, in order
    limit: int | None = None  # header "limit", optional: the subscription ends after this many


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


Frame = Batch | Ack | Nack | Subscribe | Unsubscribe | Ping | Pong



_pack = pack
_tuple = tuple.__new__
_unpackb = msgpack.unpackb


# --- encoding ------------------------------------------------------------------------------

def encode_batch(kind: Kind, sender: str, reply_to: str, messages: list[Envelope],
                 sent_at: int | None = None, compress: str | None = None) -> list[bytes]:
    header: dict[str, Any] = {
        "sender": sender,
        "reply_to": reply_to,
        "msgs": [
            [m.id, m.topic, m.sent, m.attempt, m.expires, m.correlation_id, m.headers or {}]
            for m in messages
        ],
    }
    if sent_at is not None:
        header["now"] = sent_at
    body = _pack([m.body for m in messages])
    if compress == "zstd" and len(body) >= COMPRESS_MIN:
        header["z"] = "zstd"
        body = _compressor().compress(body)  # the content size goes in the frame
    return [MAGIC, _KIND_BYTES[kind], _pack(header), body]


def _control(kind: Kind, header: dict[str, Any]) -> list[bytes]:
    return [MAGIC, _KIND_BYTES[kind], _pack(header), b""]


def encode_ack(ids: list[str] | tuple[str, ...]) -> list[bytes]:
    return _control(Kind.ACK, {"ids": list(ids)})


def encode_nack(ids: list[str] | tuple[str, ...], reason: str) -> list[bytes]:
    return _control(Kind.NACK, {"ids": list(ids), "reason": reason})


def encode_subscribe(id: str, topic: str, address: str, sender: str, group: str | None = None,
                     ordered: bool = False, limit: int | None = None) -> list[bytes]:
    header: dict[str, Any] = {"id": id, "topic": topic, "address": address, "sender": sender}
    header.update(subscription_options(group, ordered, limit))
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


# --- decoding ------------------------------------------------------------------------------


def _unpack(data: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises many types on junk (ValueError, ExtraData, ...)
        raise ProtocolError("bad_msgpack", f"{what}: {type(exc).__name__}") from exc


def _require(header: dict[str, Any], *fields: str) -> None:
    missing = [f for f in fields if f not in header]
    if missing:
        raise ProtocolError("missing_field", ", ".join(missing))


def _ids(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > MAX_BATCH:
        raise ProtocolError("bad_field", "ids must be a list")
    return tuple(_str(v, "ids[]", MAX_ID_LEN) for v in value)


def decode(frames: list[bytes], *, max_payload: int) -> Frame:
    """Turn the frames of one ZeroMQ message into a typed record, or raise ProtocolError."""
    if len(frames) != 4:
        raise ProtocolError("bad_frame_count", f"{len(frames)} frames")
    magic, kind_b, header_b, body_b = frames
    if magic != MAGIC:
        raise ProtocolError("bad_magic")
    if len(kind_b) != 1 or kind_b[0] not in Kind._value2member_map_:
        raise ProtocolError("unknown_kind")
    kind = Kind(kind_b[0])
    if kind in MESSAGE_KINDS:
        header, parts = _batch_header(header_b)
        if not isinstance(header, dict):
            raise ProtocolError("bad_header", "header must be a map")
        return _decode_batch(kind, header, body_b, max_payload, parts)
    header = _unpack(header_b, "header")
    if not isinstance(header, dict):
        raise ProtocolError("bad_header", "header must be a map")
    if body_b:
        raise ProtocolError("bad_body", f"{kind.name} carries no body")
    if kind is Kind.ACK:
        _require(header, "ids")
        return Ack(_ids(header["ids"]))
    if kind is Kind.NACK:
        _require(header, "ids", "reason")
        return Nack(_ids(header["ids"]), _str(header["reason"], "reason", MAX_REASON_LEN))
    if kind in (Kind.SUBSCRIBE, Kind.UNSUBSCRIBE):
        _require(header, "id", "topic", "address", "sender")
        fields = (
            _str(header["id"], "id", MAX_ID_LEN),
            _pattern(header["topic"]),
            _address(header["address"], "address"),
            _str(header["sender"], "sender", MAX_NAME_LEN),
        )
        if kind is Kind.UNSUBSCRIBE:
            return Unsubscribe(*fields)
        group, ordered = header.get("group"), header.get("ordered", False)
        if group is not None:
            try:
                group = validate_group(group)
            except (TypeError, ValueError) as exc:
                raise ProtocolError("bad_field", str(exc)) from exc
        if type(ordered) is not bool:
            raise ProtocolError("bad_field", "ordered must be a bool")
        limit = header.get("limit")
        if limit is not None:
            limit = _int(limit, "limit", 1)
        return Subscribe(*fields, group, ordered, limit)
    _require(header, "sender", "boot")
    sender, boot = _str(header["sender"], "sender", MAX_NAME_LEN), _str(header["boot"], "boot", MAX_NAME_LEN)
    if kind is Kind.PING:
        return Ping(sender, boot)
    limit = header.get("max")
    z = header.get("z", [])
    if not isinstance(z, list) or not all(isinstance(c, str) and len(c) <= 16 for c in z) or len(z) > 8:
        raise ProtocolError("bad_field", "z must be a short list of codec names")
    return Pong(sender, boot, None if limit is None else _int(limit, "max", 1), tuple(z))


class _Unread:
    """In place of a field of a message's header that a receiver cannot read (msgpack
    refused it: a map key that is not a str or bytes, a str that is not UTF-8): its error."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _batch_header(data: bytes) -> tuple[Any, list[bytes] | None]:
    """A batch frame's header, and None; or, when it does not decode as a whole, what
    ``_read_apart`` makes of it and each message's header bytes. The second reading runs
    only then: the hot path is one C call, as for every other kind."""
    try:
        return _unpackb(data, raw=False, strict_map_key=True, use_list=True), None
    except Exception as exc:  # msgpack raises many types on junk (ValueError, ExtraData, ...)
        error = exc
    try:
        return _read_apart(data)
    except ProtocolError:
        raise
    except Exception:  # noqa: BLE001 - not one message's: the frame's, as the first reading said
        pass
    raise ProtocolError("bad_msgpack", f"header: {type(error).__name__}") from error


def _reader(data: bytes) -> Any:
    reader = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=max(1, len(data)))
    reader.feed(data)
    return reader


def _next_part(reader: Any, data: bytes) -> bytes:
    """The bytes of the next whole msgpack object ``reader`` holds, skipped unread."""
    start = reader.tell()
    reader.skip()
    return data[start:reader.tell()]


def _read_apart(data: bytes) -> tuple[dict[Any, Any], list[bytes]]:
    """A batch header that msgpack refused as a whole, read part by part, so that one
    message's header that a receiver cannot read is that message's problem alone (DESIGN
    rule 11): each message's array is read on its own and, if it is refused, each of its
    fields, a refused one standing as an ``_Unread``. Anything else refused is the frame's
    (raises): the header's own keys and values, a message whose bytes cannot even be
    skipped (cut short, junk), bytes after the header. Returns the header as ``decode``
    reads it and the bytes of each message's array, as they came."""
    reader = _reader(data)
    header: dict[Any, Any] = {}
    parts: list[bytes] = []
    for _ in range(reader.read_map_header()):
        key = reader.unpack()
        if type(key) is not str and type(key) is not bytes:
            raise ValueError(f"{type(key).__name__} is not allowed for map key")
        if key != "msgs":
            header[key] = reader.unpack()
            continue
        count = reader.read_array_header()
        if count > MAX_BATCH:
            raise ProtocolError("oversize", f"{count} messages in one frame")
        metas: list[Any] = []
        parts = []
        for _ in range(count):
            part = _next_part(reader, data)
            parts.append(part)
            try:
                metas.append(_unpackb(part, raw=False, strict_map_key=True))
            except Exception:  # noqa: BLE001 - read its fields one by one
                metas.append(_fields_apart(part))
        header[key] = metas
    if reader.tell() != len(data):
        raise ValueError("extra data after the header")
    return header, parts


def _fields_apart(part: bytes) -> Any:
    """A message's header array that msgpack refused, field by field (``_read_apart``)."""
    reader = _reader(part)
    try:
        count = reader.read_array_header()
    except Exception as exc:  # not an array: no id to name it by (the frame is refused)
        return _Unread(f"{type(exc).__name__}: {exc}")
    fields: list[Any] = []
    for _ in range(count):
        field = _next_part(reader, part)
        try:
            fields.append(_unpackb(field, raw=False, strict_map_key=True))
        except Exception as exc:  # noqa: BLE001 - msgpack raises many types
            fields.append(_Unread(f"{type(exc).__name__}: {exc}"))
    return fields


def _invalid(meta: Any, body: Any, error: str, part: bytes | None) -> Invalid:
    """A message that is not valid (``error`` says why), set apart by its id; or, if its id
    cannot be used, ``ProtocolError`` for the frame: a message nobody can name cannot be
    acked (its sender resends it, and the rest of an ordered lane waits behind it, anyway),
    deduplicated or kept as a dead letter, and the rest of its frame handled without it
    would be a gap nobody sees; refused, it is counted and logged as malformed."""
    if type(meta) is not list or not meta:
        what = meta.error if isinstance(meta, _Unread) else f"{type(meta).__name__} {_show(meta)}"
        raise ProtocolError("bad_id", f"a message's header is not an array that starts with its "
                            f"id ({what}): it cannot be acked or kept")
    mid = meta[0]
    if type(mid) is not str or not mid or len(mid) > MAX_ID_LEN:
        what = f"cannot be read ({mid.error})" if isinstance(mid, _Unread) else (
            f"must be a non-empty str of at most {MAX_ID_LEN}, not {type(mid).__name__} {_show(mid)}")
        raise ProtocolError("bad_id", f"a message's id {what}: it cannot be acked or kept")
    for name, value in zip(_FIELDS, meta):
        if isinstance(value, _Unread):
            error = f"{name}: a receiver cannot read it ({value.error})"
            break
    topic = meta[1] if len(meta) > 1 and type(meta[1]) is str else None
    if part is None:
        try:
            part = _pack(meta)
        except Exception:  # noqa: BLE001 - what msgpack read, it writes; should it not, nothing is lost but a copy
            part = b""
    return _tuple(Invalid, (mid, error[:MAX_REASON_LEN], topic and topic[:_TOPIC_SHOWN], part,
                            body if type(body) is bytes else _pack(body)))


def frame_body_limit(count: int, max_payload: int) -> int:
    """The most bytes the body of a batch frame of ``count`` messages may hold once
    decompressed: what a sender puts in one frame (FRAME_BYTES of payload, or one message
    of up to ``max_payload``) plus msgpack's framing. Not ``count`` payloads' worth: a frame
    may declare 10,000 messages in a few KB of header."""
    return max(FRAME_BYTES, max_payload) + _BIN_HEADER * (count + 1)


def _decode_batch(kind: Kind, header: dict[str, Any], body_b: bytes, max_payload: int,
                  parts: list[bytes] | None = None) -> Batch:
    _require(header, "sender", "reply_to", "msgs")
    sender = _str(header["sender"], "sender", MAX_NAME_LEN)
    reply_to = _address(header["reply_to"], "reply_to")
    metas = header["msgs"]
    if not isinstance(metas, list) or not metas:
        raise ProtocolError("bad_field", "msgs must be a non-empty list")
    if len(metas) > MAX_BATCH:
        raise ProtocolError("oversize", f"{len(metas)} messages in one frame")
    sent_at = header.get("now")
    if sent_at is not None:
        sent_at = _ms(sent_at, "now")
    if "z" in header:
        body_b = _decompress(header["z"], body_b, frame_body_limit(len(metas), max_payload))
    try:
        # An array of len(metas) bins and nothing else, checked as msgpack reads the
        # lengths: a body of a million tiny payloads is refused before it is 50 MB of objects.
        bodies = _unpackb(body_b, raw=False, max_array_len=len(metas), max_map_len=0,
                          max_str_len=0, max_ext_len=0)
    except Exception as exc:  # msgpack raises many types on junk (ValueError, ExtraData, ...)
        raise ProtocolError("bad_body", f"body must be an array of {len(metas)} payloads: "
                            f"{type(exc).__name__}") from exc
    if not isinstance(bodies, list) or len(bodies) != len(metas):
        raise ProtocolError("bad_body", "body must be a list with one payload per message")
    out = []
    oversize = []
    undecodable = []
    invalid = []
    max_ms, max_id = MAX_MS, MAX_ID_LEN
    for meta, body in zip(metas, bodies):
        # One message's fields that are not valid set that message apart, not its frame: a
        # frame refused is resent for ever and an ordered lane waits behind it (rule 11).
        if type(meta) is not list or len(meta) != 7 or type(body) is not bytes:
            invalid.append(_invalid(meta, body, _shape(meta, body), _part(meta, metas, parts)))
            continue
        mid, topic, sent, attempt, expires, corr, headers = meta
        if len(body) > max_payload:
            oversize.append(_id(mid))  # refused by id, the rest accepted
            continue
        try:
            # Per message, 20-40k times a second: each check inline, its function called
            # only to raise, and the NamedTuple made without its keyword parsing.
            env = _tuple(Envelope, (
                mid if type(mid) is str and 0 < len(mid) <= max_id else _id(mid),
                _topic(topic),
                sent if type(sent) is int and 0 <= sent < max_ms else _ms(sent, "sent"),
                body,
                attempt if type(attempt) is int and 1 <= attempt <= MAX_ATTEMPT else _attempt(attempt),
                None if expires is None else (
                    expires if type(expires) is int and 0 <= expires < max_ms else _ms(expires, "expires")),
                None if corr is None else _str(corr, "correlation_id", max_id),
                (headers or None) if type(headers) is dict else _headers(headers),
            ))
        except ProtocolError as exc:
            invalid.append(_invalid(meta, body, exc.detail, _part(meta, metas, parts)))
            continue
        try:
            # Payloads are checked here so that junk never reaches a handler; decode_payload.
            _unpackb(body, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises many types on junk
            # Set apart, not the frame refused: a frame dropped is resent for ever, and an
            # ordered subscription waits behind it.
            undecodable.append((env, f"{type(exc).__name__}: {exc}"[:MAX_REASON_LEN]))
            continue
        out.append(env)
    return Batch(kind, sender, reply_to, tuple(out), sent_at, tuple(oversize), tuple(undecodable),
                 tuple(invalid))


def _part(meta: Any, metas: list[Any], parts: list[bytes] | None) -> bytes | None:
    """The bytes ``meta`` came in, when the header was read apart (``_read_apart``)."""
    if parts:
        for other, part in zip(metas, parts):
            if other is meta:
                return part
    return None


def _shape(meta: Any, body: Any) -> str:
    """What is wrong with a message's header array or payload as a whole."""
    if type(meta) is not list:
        return f"a message's header must be an array, not {type(meta).__name__}"
    if len(meta) != 7:
        return f"the message's header has {len(meta)} fields; expected 7 ({', '.join(_FIELDS)})"
    return f"payload must be msgpack bin, not {type(body).__name__}"
