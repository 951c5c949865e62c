"""What each keyspace's records look like, checked when they are read.

A damaged store (a bit flipped on disk, a record written by hand, a half-repaired file)
must never reach the rest of the bus as a raw ``msgpack`` error, a ``KeyError`` deep in the
engine, or a silently wrong value: every record is checked here, and one that is not its
keyspace's record raises ``CorruptRecordError`` naming the keyspace and the key, with the
way out (``servicebus check --repair``). The same checks are what ``check`` runs over the
whole store, so the bus and the repair tool always agree on what is damaged.

The store package calls ``decode`` on every read, ``servicebus check`` calls ``decode_record`` on
every record; it stays free of plyvel so that it can be tested alone.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from typing import Any, cast

import msgpack

from ..errors import CorruptRecordError
from .keys import record_key

__all__ = ["decode", "decode_record", "REPAIR_HINT", "KEY_PAIR_KEYSPACES", "MESSAGE_KINDS"]

REPAIR_HINT = "run `servicebus check --repair DATADIR` (it lists and repairs what is damaged)"
SEP = b"\x00"
MESSAGE_KINDS = (1, 2, 3)  # event, command, reply (protocol.Kind)
KEY_PAIR_KEYSPACES = ("subscriptions", "intents", "outgoing", "deliveries", "outbox", "progress")


def _unpack(value: bytes) -> Any:
    return msgpack.unpackb(value, raw=False, strict_map_key=False)


def _is_int(v: Any) -> bool:
    return type(v) is int


def _is_opt_int(v: Any) -> bool:
    return v is None or type(v) is int


def _is_str(v: Any) -> bool:
    return type(v) is str


def _is_opt_str(v: Any) -> bool:
    return v is None or type(v) is str


def _is_opt_dict(v: Any) -> bool:
    return v is None or type(v) is dict


class _NotItsRecord(ValueError):
    pass


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise _NotItsRecord(what)


def _subscription(value: bytes) -> dict[str, Any]:
    rec = _unpack(value)
    _require(type(rec) is dict and _is_str(rec.get("since")), "not a subscription record")
    return cast("dict[str, Any]", rec)


def _intent(value: bytes) -> dict[str, Any]:
    rec = _unpack(value)
    _require(type(rec) is dict and rec.get("op") in ("subscribe", "unsubscribe")
             and _is_str(rec.get("id")) and type(rec.get("confirmed")) is bool, "not an intent record")
    return cast("dict[str, Any]", rec)


def _delivery(value: bytes) -> dict[str, Any]:
    rec = _unpack(value)
    _require(type(rec) is dict, "not a delivery record")
    acked, attempts, last_ack = rec.get("acked") or [], rec.get("attempts") or {}, rec.get("last_ack")
    _require(_is_opt_str(rec.get("floor")) and type(acked) is list and all(map(_is_str, acked))
             and type(attempts) is dict and all(_is_str(k) and _is_int(v) for k, v in attempts.items())
             and (last_ack is None or type(last_ack) in (int, float)), "not a delivery record")
    return cast("dict[str, Any]", rec)


def _ids(v: Any) -> bool:
    return type(v) is list and bool(v) and all(type(i) is str and i for i in v)


def _blob(blob: Any, count: int) -> bool:
    """A segment's payloads: a msgpack array of ``count`` bins (model/segments.py)."""
    if type(blob) is not bytes:
        return False
    try:
        bodies = msgpack.unpackb(blob, raw=False, max_map_len=0, max_str_len=0, max_ext_len=0)
    except Exception:  # noqa: BLE001 - msgpack raises many types on junk
        return False
    return type(bodies) is list and len(bodies) == count and all(type(b) is bytes for b in bodies)


def _outgoing(value: bytes) -> list[Any]:
    rec = _unpack(value)
    _require(type(rec) is list and len(rec) == 8, "not an outgoing record")
    kind, topic, sent, expires, corr, headers, ids, blob = rec
    _require(kind in MESSAGE_KINDS and _is_str(topic) and _is_int(sent) and _is_opt_int(expires)
             and _is_opt_str(corr) and _is_opt_dict(headers) and _ids(ids) and _blob(blob, len(ids)),
             "not an outgoing record")
    return cast("list[Any]", rec)


def _progress(value: bytes) -> list[Any]:
    rec = _unpack(value)
    _require(type(rec) is list and len(rec) == 3 and _is_int(rec[0]) and rec[0] >= 0
             and _is_int(rec[1]) and rec[1] >= 0 and type(rec[2]) is list and all(map(_is_int, rec[2])),
             "not a run's progress")
    return cast("list[Any]", rec)


def _incoming(value: bytes) -> list[Any]:
    rec = _unpack(value)
    _require(type(rec) is list and len(rec) == 11, "not an incoming record")
    kind, topic, sender, reply_to, sent, attempt, expires, corr, headers, ids, blob = rec
    _require(kind in MESSAGE_KINDS and _is_str(topic) and _is_str(sender) and _is_str(reply_to)
             and _is_int(sent) and _is_int(attempt) and _is_opt_int(expires) and _is_opt_str(corr)
             and _is_opt_dict(headers) and _ids(ids) and _blob(blob, len(ids)), "not an incoming record")
    return cast("list[Any]", rec)


def _runstate(value: bytes) -> list[Any]:
    rec = _unpack(value)
    _require(type(rec) is list and len(rec) == 4, "not a run state")
    attempts, done, last_error, next_ms = rec
    _require(_is_int(attempts) and attempts >= 0 and type(done) is list and all(map(_is_str, done))
             and _is_opt_str(last_error) and _is_int(next_ms), "not a run state")
    return cast("list[Any]", rec)


def _reply(value: bytes) -> list[Any]:
    rec = _unpack(value)
    _require(type(rec) is list and len(rec) == 4 and _is_str(rec[0]) and _is_str(rec[1])
             and _is_opt_str(rec[2]) and type(rec[3]) is bytes, "not a reply record")
    return cast("list[Any]", rec)


def _outbox(value: bytes) -> list[Any]:
    rec = _unpack(value)
    _require(type(rec) is list and len(rec) == 6, "not an outbox command")
    address, command, body, expires, headers, due = rec
    _require(_is_str(address) and _is_str(command) and type(body) is bytes and _is_opt_int(expires)
             and _is_opt_dict(headers) and _is_opt_int(due), "not an outbox command")
    return cast("list[Any]", rec)


def _deadletter(value: bytes) -> dict[str, Any]:
    rec = _unpack(value)
    _require(type(rec) is dict and _is_str(rec.get("origin")) and _is_str(rec.get("reason")),
             "not a dead letter")
    return cast("dict[str, Any]", rec)


def _stamp(value: bytes) -> int:
    _require(len(value) == 8, "not an 8-byte time")
    return int.from_bytes(value, "big")


def _publish_key(value: bytes) -> list[Any]:
    rec = _unpack(value)
    _require(isinstance(rec, list) and len(rec) == 2 and isinstance(rec[0], str)
             and type(rec[1]) is int, "not [message id, time]")
    return cast("list[Any]", rec)


def _empty(value: bytes) -> bytes:
    _require(value == b"", "index entries carry no value")
    return value


def _journal(value: bytes) -> list[Any]:
    rec = _unpack(value)
    _require(type(rec) is list and all(type(e) is list and len(e) in (8, 9) for e in rec),
             "not a journal record")
    return cast("list[Any]", rec)


def _decimal(value: bytes) -> int:
    _require(value.isdigit() and len(value) < 20, "not a number")
    return int(value)


def _node(value: bytes) -> str:
    text = value.decode("ascii")
    _require(len(text) == 16 and all(c in string.hexdigits for c in text), "not a node id")
    return text


def _journal_pending(value: bytes) -> Any:
    """Empty, or [segment name, its records' sequence numbers] (journal.py)."""
    if not value:
        return None
    name, seqs = msgpack.unpackb(value, raw=False)
    _require(isinstance(name, str) and bool(seqs) and all(isinstance(s, int) for s in seqs),
             "not a segment and its records")
    return name, seqs


def _members(value: bytes) -> dict[str, Any]:
    rec = _unpack(value)
    _require(type(rec) is dict and type(rec.get("members", [])) is list
             and type(rec.get("kicked", {})) is dict, "not a members record")
    return cast("dict[str, Any]", rec)


def _retention(value: bytes) -> list[Any]:
    rec = _unpack(value)
    _require(type(rec) is list and (rec == [] or (len(rec) == 2 and type(rec[0]) is dict
                                                  and _is_int(rec[1]))), "not a retention record")
    return cast("list[Any]", rec)


META: dict[str, Callable[[bytes], Any]] = {
    "format": _decimal,
    "clock": _decimal,
    "journal_flushed": _decimal,
    "journal_pending": _journal_pending,
    "node": _node,
    "address": lambda v: v.decode("utf-8"),
    "sync": _empty,
    "hwm": _decimal,  # the high-water mark (store/mark.py)
    "epoch": _decimal,  # starts of the bus so far: in every id it makes (model/ids.py)
    "retention": _retention,  # [rules, max bytes] the bus runs with, or [] (model/retention.py)
    "members": _members,
    "max_payload": _decimal,  # the bus's max_payload at its last start, for offline replay edits  # what discovery knows: {"members": [...], "kicked": {...}} (core/members.py)
}

VALUES: dict[str, Callable[[bytes], Any]] = {
    "subscriptions": _subscription,
    "intents": _intent,
    "deliveries": _delivery,
    "outgoing": _outgoing,
    "incoming": _incoming,
    "runstate": _runstate,
    "replies": _reply,
    "deadletters": _deadletter,
    "handled": _stamp,
    "handled_index": _empty,
    "publish_keys": _publish_key,
    "publish_keys_index": _empty,
    "journal": _journal,
    "segments": _stamp,
    "kv": _unpack,  # any value msgpack encodes
    "outbox": _outbox,
    "progress": _progress,
}


def _check_key(keyspace: str, rest: bytes) -> None:
    if keyspace in KEY_PAIR_KEYSPACES:
        a, sep, b = rest.partition(SEP)
        _require(bool(sep) and bool(a) and bool(b), "key has no separator")
    elif keyspace == "journal":
        _require(len(rest) == 8, "key is not a sequence number")
        return
    elif keyspace in ("handled_index", "publish_keys_index"):
        _require(len(rest) > 8, "key is not a time and an id")
        rest = rest[8:]
    elif keyspace == "meta":
        _require(rest.decode("utf-8") in META, "unknown meta record")
    rest.decode("utf-8")


def shown(key: bytes) -> str:
    """A key as operators see it: its text after the keyspace prefix."""
    return key[2:].decode("utf-8", "backslashreplace")


def decode(keyspace: str, key: bytes, value: bytes) -> Any:
    """The decoded value of one record, or ``CorruptRecordError``."""
    try:
        _check_key(keyspace, key[2:])
        if keyspace == "meta":
            return META[key[2:].decode()](value)
        return VALUES[keyspace](value)
    except Exception as exc:  # noqa: BLE001 - msgpack alone raises a dozen types on junk
        detail = exc if isinstance(exc, _NotItsRecord) else f"does not decode ({type(exc).__name__})"
        raise CorruptRecordError(f"damaged store record in {keyspace} under {shown(key)!r}: {detail}; "
                                 f"{REPAIR_HINT}", keyspace, shown(key)) from exc


def decode_record(keyspace: str, name: bytes, value: bytes) -> Any:
    """``decode`` of a record named as ``Reads.records`` names it (its key without the
    keyspace's prefix): what check/repair calls."""
    return decode(keyspace, record_key(keyspace, name), value)
