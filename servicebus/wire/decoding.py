"""Frames -> typed records, sans I/O: ``decode`` and every check it runs on a frame.

Anything malformed raises ``ProtocolError`` with a short ``reason`` (used as a counter
name by the engine), but for what is wrong with one segment of a batch alone: a message's
payload too large (``Batch.oversize``, by message id) or the segment's own fields not
valid (``Batch.invalid``). Those are set apart and the rest of the frame goes on (DESIGN
rule 11); a segment whose key cannot be used refuses its frame (``bad_id``), as nothing
could ack it. Payloads are not decoded here: one that does not decode is a dead letter when
a handler would get it (handling/runner.py), for that message alone. The records, the frame layout and the encoders are
``protocol``'s; the checks of single fields, ``validation``'s; the bounded decompression,
``compression``'s.
"""

from __future__ import annotations

from typing import Any

import msgpack

from ..model.members import MAX_MEMBERS, Member
from ..model.retention import check_start
from ..errors import ProtocolError
from ..model.packer import pack
from .compression import _decompress
from .payload import _show
from .protocol import (MAGIC, MAX_BATCH, MAX_SEGMENTS, MESSAGE_KINDS, OLD_MAGIC, Ack, Batch, Envelope,
                       Frame, Gossip, Invalid, Kind, Nack, Ping, Pong, Subscribe, Unsubscribe, frame_body_limit)
from .validation import (MAX_ATTEMPT, MAX_ID_LEN, MAX_MS, MAX_NAME_LEN, MAX_REASON_LEN, _address, _attempt,
                         _headers, _id, _int, _ms, _pattern, _str, _topic, validate_group)

__all__ = ["decode"]

_FIELDS = ("key", "topic", "sent", "attempt", "expires", "correlation_id", "headers", "ids")
_TOPIC_SHOWN = 300  # characters of an invalid message's topic kept on its dead letter

_pack = pack
_tuple = tuple.__new__
_unpackb = msgpack.unpackb


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
    if len(frames) < 4:
        raise ProtocolError("bad_frame_count", f"{len(frames)} frames")
    magic, kind_b, header_b = frames[0], frames[1], frames[2]
    if magic != MAGIC:
        if magic == OLD_MAGIC:
            raise ProtocolError("old_protocol", "a frame of protocol SB1 (servicebus 0.2): that "
                                "bus must be upgraded; what it holds for this one stays with it")
        raise ProtocolError("bad_magic")
    if len(kind_b) != 1 or kind_b[0] not in Kind._value2member_map_:
        raise ProtocolError("unknown_kind")
    kind = Kind(kind_b[0])
    if kind in MESSAGE_KINDS:
        header, parts = _batch_header(header_b)
        if not isinstance(header, dict):
            raise ProtocolError("bad_header", "header must be a map")
        return _decode_batch(kind, header, frames[3:], max_payload, parts)
    if len(frames) != 4:
        raise ProtocolError("bad_frame_count", f"{len(frames)} frames")
    body_b = frames[3]
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
        segment = header.get("segment")
        return Nack(_ids(header["ids"]), _str(header["reason"], "reason", MAX_REASON_LEN),
                    None if segment is None else _str(segment, "segment", MAX_ID_LEN))
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
        start = header.get("start")
        if start is not None and check_start(start) is None:
            raise ProtocolError("bad_field", "start must be 'earliest', 't:<ms>' or a message id")
        return Subscribe(*fields, group, ordered, limit, start)
    if kind is Kind.GOSSIP:
        return _gossip(header)
    _require(header, "sender", "boot")
    sender, boot = _str(header["sender"], "sender", MAX_NAME_LEN), _str(header["boot"], "boot", MAX_NAME_LEN)
    if kind is Kind.PING:
        return Ping(sender, boot)
    limit = header.get("max")
    z = header.get("z", [])
    if not isinstance(z, list) or not all(isinstance(c, str) and len(c) <= 16 for c in z) or len(z) > 8:
        raise ProtocolError("bad_field", "z must be a short list of codec names")
    return Pong(sender, boot, None if limit is None else _int(limit, "max", 1), tuple(z))


def _gossip(header: dict[str, Any]) -> Gossip:
    _require(header, "sender", "members")
    sender, members, reply = header["sender"], header["members"], header.get("reply", False)
    if not isinstance(members, list) or len(members) > MAX_MEMBERS or type(reply) is not bool:
        raise ProtocolError("bad_field", f"members must be a list of at most {MAX_MEMBERS}")
    try:
        entries = tuple(Member.from_wire(m, lambda a: _address(a, "member address")) for m in members)
    except (TypeError, ValueError, ProtocolError) as exc:
        raise ProtocolError("bad_field", str(exc)[:200]) from exc
    proof = header.get("proof")
    return Gossip(_str(sender, "sender", MAX_NAME_LEN), entries, reply,
                  None if proof is None else _str(proof, "proof", 64))


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
        if key != "segs":
            header[key] = reader.unpack()
            continue
        count = reader.read_array_header()
        if count > MAX_SEGMENTS:
            raise ProtocolError("oversize", f"{count} segments in one frame")
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
    """A segment that is not valid (``error`` says why), set apart by its key; or, if its
    key cannot be used, ``ProtocolError`` for the frame: a segment nobody can name cannot
    be acked (its sender resends it, and the rest of an ordered lane waits behind it,
    anyway), deduplicated or kept as a dead letter, and the rest of its frame handled
    without it would be a gap nobody sees; refused, it is counted and logged as malformed."""
    if type(meta) is not list or not meta:
        what = meta.error if isinstance(meta, _Unread) else f"{type(meta).__name__} {_show(meta)}"
        raise ProtocolError("bad_id", f"a segment's header is not an array that starts with its "
                            f"key ({what}): it cannot be acked or kept")
    key = meta[0]
    if type(key) is not str or not key or len(key) > MAX_ID_LEN:
        what = f"cannot be read ({key.error})" if isinstance(key, _Unread) else (
            f"must be a non-empty str of at most {MAX_ID_LEN}, not {type(key).__name__} {_show(key)}")
        raise ProtocolError("bad_id", f"a segment's key {what}: it cannot be acked or kept")
    for name, value in zip(_FIELDS, meta):
        if isinstance(value, _Unread):
            error = f"{name}: a receiver cannot read it ({value.error})"
            break
    topic = meta[1] if len(meta) > 1 and type(meta[1]) is str else None
    ids: tuple[str, ...] = ()
    if len(meta) > 7 and type(meta[7]) is list and meta[7] and len(meta[7]) <= MAX_BATCH and all(
            type(i) is str and 0 < len(i) <= MAX_ID_LEN for i in meta[7]):
        ids = tuple(meta[7])  # its messages can be named: each is a dead letter of its own
    if part is None:
        try:
            part = _pack(meta)
        except Exception:  # noqa: BLE001 - what msgpack read, it writes; should it not, nothing is lost but a copy
            part = b""
    return _tuple(Invalid, (key, error[:MAX_REASON_LEN], topic and topic[:_TOPIC_SHOWN], part,
                            body if type(body) is bytes else _pack(body), ids))


def _decode_batch(kind: Kind, header: dict[str, Any], blobs: list[bytes], max_payload: int,
                  parts: list[bytes] | None = None) -> Batch:
    _require(header, "sender", "reply_to", "segs")
    sender = _str(header["sender"], "sender", MAX_NAME_LEN)
    reply_to = _address(header["reply_to"], "reply_to")
    metas = header["segs"]
    if not isinstance(metas, list) or not metas:
        raise ProtocolError("bad_field", "segs must be a non-empty list")
    if len(metas) > MAX_SEGMENTS:
        raise ProtocolError("oversize", f"{len(metas)} segments in one frame")
    if len(blobs) != len(metas):
        raise ProtocolError("bad_frame_count", f"{len(metas)} segments, {len(blobs)} blobs")
    sent_at = header.get("now")
    if sent_at is not None:
        sent_at = _ms(sent_at, "now")
    codec = header.get("z")
    out = []
    oversize: list[tuple[str, tuple[str, ...]]] = []
    invalid = []
    total = 0
    max_ms, max_id = MAX_MS, MAX_ID_LEN
    for meta, blob in zip(metas, blobs):
        # One segment's fields that are not valid set that segment apart, not its frame: a
        # frame refused is resent for ever and an ordered lane waits behind it (rule 11).
        if type(meta) is not list or len(meta) != 8:
            invalid.append(_invalid(meta, blob, _shape(meta), _part(meta, metas, parts)))
            continue
        key, topic, sent, attempt, expires, corr, headers, ids = meta
        try:
            # Per segment: each check inline, its function called only to raise, and the
            # NamedTuple made without its keyword parsing.
            if type(ids) is not list or not ids or len(ids) > MAX_BATCH or not all(
                    type(i) is str and 0 < len(i) <= max_id for i in ids):
                raise ProtocolError("bad_field", "ids must be a non-empty list of message ids")
            if kind is not Kind.EVENT and len(ids) != 1:
                raise ProtocolError("bad_field", "a command or a reply travels alone (ids must hold one id)")
            env = _tuple(Envelope, (
                key if type(key) is str and 0 < len(key) <= max_id else _id(key),
                _topic(topic),
                sent if type(sent) is int and 0 <= sent < max_ms else _ms(sent, "sent"),
                blob,
                attempt if type(attempt) is int and 1 <= attempt <= MAX_ATTEMPT else _attempt(attempt),
                None if expires is None else (
                    expires if type(expires) is int and 0 <= expires < max_ms else _ms(expires, "expires")),
                None if corr is None else _str(corr, "correlation_id", max_id),
                (headers or None) if type(headers) is dict else _headers(headers),
                tuple(ids),
            ))
        except ProtocolError as exc:
            invalid.append(_invalid(meta, blob, exc.detail, _part(meta, metas, parts)))
            continue
        total += len(ids)
        if total > MAX_BATCH:
            raise ProtocolError("oversize", f"more than {MAX_BATCH} messages in one frame")
        if codec is not None:
            blob = _decompress(codec, blob, frame_body_limit(len(ids), max_payload))
        try:
            # An array of len(ids) bins and nothing else, checked as msgpack reads the
            # lengths: a blob of a million tiny payloads is refused before it is 50 MB of objects.
            bodies = _unpackb(blob, raw=False, max_array_len=len(ids), max_map_len=0,
                              max_str_len=0, max_ext_len=0)
            if type(bodies) is not list or len(bodies) != len(ids) or not all(type(b) is bytes for b in bodies):
                raise ValueError("not one payload (bin) per message")
        except Exception as exc:  # msgpack raises many types on junk (ValueError, ExtraData, ...)
            invalid.append(_invalid(meta, blob, f"the blob must be an array of {len(ids)} payloads "
                                    f"({type(exc).__name__})", _part(meta, metas, parts)))
            continue
        too_big = [i for i, body in enumerate(bodies) if len(body) > max_payload]
        if too_big:
            # Refused by id, the rest of the segment kept (rarely: a sender knows the limit).
            oversize.append((env.id, tuple(ids[i] for i in too_big)))
            keep = [i for i in range(len(ids)) if i not in set(too_big)]
            if not keep:
                continue
            env = env._replace(ids=tuple(ids[i] for i in keep), body=_pack([bodies[i] for i in keep]))
        elif codec is not None:
            env = env._replace(body=blob)
        out.append(env)
    return Batch(kind, sender, reply_to, tuple(out), sent_at, tuple(oversize), (), tuple(invalid))


def _part(meta: Any, metas: list[Any], parts: list[bytes] | None) -> bytes | None:
    """The bytes ``meta`` came in, when the header was read apart (``_read_apart``)."""
    if parts:
        for other, part in zip(metas, parts):
            if other is meta:
                return part
    return None


def _shape(meta: Any) -> str:
    """What is wrong with a segment's header array as a whole."""
    if type(meta) is not list:
        return f"a segment's header must be an array, not {type(meta).__name__}"
    return f"the segment's header has {len(meta)} fields; expected 8 ({', '.join(_FIELDS)})"
