"""The dead-letter record: one builder for every place that makes one.

A dead letter is a msgpack map in the ``x/`` keyspace. Every one has ``origin``
(``incoming``: received here; ``outgoing``: could not be delivered from here), ``reason``,
``error`` and ``at`` (wall-clock ms). Those with a readable message add ``kind``, ``topic``
and ``record`` (the stored message, which ``servicebus replay`` puts back); incoming ones
add ``attempts``, outgoing ones ``peer`` and ``stream``; damaged ones keep ``raw`` bytes
instead of ``record``.
"""

from __future__ import annotations

from typing import Any

from .clock import wall_ms
from .delivery import OutgoingRecord
from .protocol import KIND_NAMES
from .stored import IncomingRecord

__all__ = ["incoming_letter", "outgoing_letter", "damaged_letter"]


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
