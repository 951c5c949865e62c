"""The dead-letter record: one builder for every place that makes one.

A dead letter is a msgpack map in the ``x/`` keyspace. Every one has ``origin``
(``incoming``: received here; ``outgoing``: could not be delivered from here), ``reason``,
``error`` and ``at`` (wall-clock ms). Those with a readable message add ``kind``, ``topic``
and ``record`` (the stored message, which ``servicebus replay`` puts back); incoming ones
add ``attempts``, outgoing ones ``peer`` and ``stream``; damaged ones keep ``raw`` bytes
instead of ``record``. A message received with fields that are not valid (``invalid``)
keeps its ``header`` and ``body`` bytes as they came instead, and says why it cannot be
replayed in ``not_replayable``: replay leaves such letters alone.
"""

from __future__ import annotations

from typing import Any

from .clock import wall_ms
from .delivery import OutgoingRecord
from .protocol import KIND_NAMES, Invalid
from .stored import IncomingRecord

__all__ = ["incoming_letter", "outgoing_letter", "damaged_letter", "invalid_letter"]


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
