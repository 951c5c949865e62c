"""The dead-letter record: one builder for every place that makes one.

A dead letter is a msgpack map in the ``x/`` keyspace. Every one has ``origin``
(``incoming``: received here; ``outgoing``: could not be delivered from here), ``reason``,
``error`` and ``at`` (wall-clock ms). Those with a readable message add ``kind``, ``topic``
and ``record`` (the stored message, which ``servicebus replay`` puts back); incoming ones
add ``attempts``, outgoing ones ``peer`` and ``stream``; damaged ones keep ``raw`` bytes
instead of ``record``. A message received with fields that are not valid (``invalid``)
keeps its ``header`` and ``body`` bytes as they came instead, and says why it cannot be
replayed in ``not_replayable``: replay leaves such letters alone. So does a row of a
``SqlOutbox`` table that cannot be a message (origin ``sql_outbox``): its columns are in
``source``, its payload in ``body``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .clock import wall_ms
from .delivery import OutgoingRecord
from ..wire.protocol import KIND_NAMES, Invalid
from ..wire.validation import MAX_REASON_LEN
from .records import DeadLetter
from .stored import IncomingRecord

__all__ = ["dead_letters", "incoming_letter", "outgoing_letter", "damaged_letter", "invalid_letter", "sql_outbox_letter"]


def incoming_letter(reason: str, error: str | None, attempts: int,
                    record: IncomingRecord) -> dict[str, Any]:
    """A received message (``core.state.incoming_record`` layout) that will not be handled."""
    return {"origin": "incoming", "reason": reason, "error": error, "attempts": attempts,
            "at": wall_ms(), "kind": KIND_NAMES.get(record.kind, "event"), "topic": record.topic,
            "record": record}


def outgoing_letter(reason: str, error: str | None, record: OutgoingRecord, peer: str | None,
                    stream: str) -> dict[str, Any]:
    """A stored message that will not be delivered to ``peer`` (None: to nobody)."""
    return {"origin": "outgoing", "reason": reason, "error": error, "at": wall_ms(),
            "peer": peer, "stream": stream, "kind": KIND_NAMES.get(record.kind, "event"),
            "topic": record.topic, "record": list(record)}


def damaged_letter(origin: str, error: str, raw: bytes, peer: str | None = None,
                   stream: str | None = None) -> dict[str, Any]:
    """A stored record that does not decode: its raw bytes, for an operator to look at."""
    letter: dict[str, Any] = {"origin": origin, "reason": "damaged", "error": error,
                              "at": wall_ms(), "raw": raw}
    if peer is not None:
        letter.update(peer=peer, stream=stream)
    return letter


def invalid_letter(kind: int, sender: str, reply_to: str, message: Invalid) -> dict[str, Any]:
    """A received message whose fields are not valid (``protocol.Invalid``: from an older or
    hostile sender): what it said, as it came. No message to handle can be made of it."""
    return {"origin": "incoming", "reason": "invalid", "error": message.error, "attempts": 0,
            "at": wall_ms(), "kind": KIND_NAMES.get(kind, "event"), "topic": message.topic,
            "sender": sender, "reply_to": reply_to, "header": message.header, "body": message.body,
            "not_replayable": "its fields are not valid, so no message to handle can be made "
                              "of it; its header and body are kept as they came"}


def _column(value: Any) -> Any:
    """A value read from a SQL row as a letter keeps it: msgpack's types as they are (bytes
    for any buffer), anything else as its repr."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if value is None or isinstance(value, (bool, float, str)) or (
            isinstance(value, int) and -(2**63) <= value < 2**64):
        return value
    return repr(value)[:200]


def sql_outbox_letter(table: str, row: Any, error: str) -> dict[str, Any]:
    """A row of the ``SqlOutbox`` table ``table`` that cannot be a message (``sql.py``; the
    row has its columns as attributes): its columns as they were read, its payload's bytes
    in ``body``. Not replayable: only a corrected row can be moved."""
    kind, topic, address = row.kind, row.topic, row.address
    source = {"table": table, "row_id": _column(row.id), "token": _column(row.token),
              "kind": _column(kind), "address": _column(address), "ttl": _column(row.ttl),
              "headers": _column(row.headers)}
    body = _column(row.payload)
    if not isinstance(body, bytes):
        source["payload"] = body  # not bytes: kept here, as it was read
    return {"origin": "sql_outbox", "reason": "invalid", "error": error[:MAX_REASON_LEN],
            "at": wall_ms(), "kind": kind if kind in ("event", "command") else None,
            "topic": topic[:300] if isinstance(topic, str) else None,
            "peer": address[:600] if kind == "command" and isinstance(address, str) else None,
            "source": source, "body": body if isinstance(body, bytes) else None,
            "not_replayable": f"a row of the SQL outbox table {table!r} that cannot be a message: "
                              "write a corrected row to the table (its columns are in source)"}


def dead_letters(stored: Iterable[tuple[str, dict[str, Any]]], limit: int | None = None) -> list[DeadLetter]:
    """``Bus.deadletters``: the stored letters (id, record) as ``DeadLetter``, at most ``limit``."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be an int >= 0, not {limit!r}")
    out: list[DeadLetter] = []
    for mid, rec in stored:
        if limit is not None and len(out) >= limit:
            break
        out.append(DeadLetter(mid, rec.get("origin", "?"), rec.get("reason", "?"), rec.get("error"),
                              rec.get("topic"), rec.get("kind"), rec.get("attempts"),
                              rec.get("peer"), int(rec.get("at") or 0), rec.get("not_replayable")))
    return out
