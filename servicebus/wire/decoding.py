"""Frames -> typed records, sans I/O: ``decode`` and every check it runs on a frame.

Anything malformed raises ``ProtocolError`` with a short ``reason`` (used as a counter
name by the engine), but for what is wrong with one message of a batch alone: its payload
too large (``Batch.oversize``), not decodable (``Batch.undecodable``) or its own fields
not valid (``Batch.invalid``). Those are set apart by their id and the rest of the frame
goes on (DESIGN rule 11); a message whose id cannot be used refuses its frame
(``bad_id``), as nothing could ack it. The records, the frame layout and the encoders are
``protocol``'s; the checks of single fields, ``validation``'s; the bounded decompression,
``compression``'s.
"""

from __future__ import annotations

from typing import Any

import msgpack

from ..errors import ProtocolError
from ..model.packer import pack
from .compression import _decompress
from .payload import _show
from .protocol import (MAGIC, MAX_BATCH, MESSAGE_KINDS, Ack, Batch, Envelope, Frame, Invalid, Kind, Nack,
                       Ping, Pong, Subscribe, Unsubscribe, frame_body_limit)
from .validation import (MAX_ATTEMPT, MAX_ID_LEN, MAX_MS, MAX_NAME_LEN, MAX_REASON_LEN, _address, _attempt,
                         _headers, _id, _int, _ms, _pattern, _str, _topic, validate_group)

__all__ = ["decode"]

_FIELDS = ("id", "topic", "sent", "attempt", "expires", "correlation_id", "headers")
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
