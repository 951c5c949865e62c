"""What a subscriber is still owed, read from the store when that ends at its address: an
unsubscribe or a kick drops it there (core/handshake.py), a move to another address
(``Roster.move``) takes it there. The journal says so for every such message, so that the
audit does not take the pairs left at the old address for messages still held for it.

These walks read the consumer's stream after its floor, a page at a time: O(backlog),
once, when it ends or moves (rare), never per frame.
"""

from __future__ import annotations

from ..model.delivery import Consumer, OutgoingRecord, is_command_stream, stream_target, unpack_outgoing
from ..wire.protocol import KIND_NAMES
from .state import State

__all__ = ["Owed", "owed", "owed_to_member", "journal_moved"]

PAGE = 1000

# A segment still owed: its key, its stored record (None if damaged: its key is all there
# is to name) and the messages owed (a segment cut for its receiver owes the rest only).
Owed = tuple[str, OutgoingRecord | None, tuple[str, ...] | list[str]]


def _read(data: bytes | None) -> OutgoingRecord | None:
    if data is None:
        return None
    try:
        return unpack_outgoing(data)
    except Exception:  # noqa: BLE001 - damaged: its key is all there is to name
        return None


def owed(s: State, consumer: Consumer) -> list[Owed]:
    """Every segment ``consumer`` (one subscriber, not a group) is still owed, in stream
    order: those in flight and those stored after its cursor that it did not ack."""
    inflight, skip, pos = consumer.inflight, consumer.skip, consumer.pos
    out: list[Owed] = []
    after = consumer.floor
    while True:
        items = s.store.iter_stream(consumer.stream, after=after, limit=PAGE)
        for key, data in items:
            flight = inflight.get(key)
            if flight is None and (key in skip or (pos is not None and key <= pos)):
                continue  # acknowledged
            record = _read(data)
            ids = flight.ids if flight is not None and flight.ids else (record.ids if record else ())
            out.append((key, record, ids))
        if len(items) < PAGE:
            return out
        after = items[-1][0]


def owed_to_member(s: State, consumer: Consumer, member: str) -> list[Owed]:
    """The segments of a group's ``consumer`` in flight to ``member``."""
    out: list[Owed] = []
    for key, to in consumer.assigned.items():
        flight = consumer.inflight.get(key)
        if to != member or flight is None:
            continue
        record = _read(s.store.get_outgoing(consumer.stream, key))
        out.append((key, record, flight.ids or (record.ids if record else ())))
    return out


def journal_moved(s: State, stream: str, old: str, new: str, segments: list[Owed]) -> None:
    """Journal each segment as no longer owed at ``old`` (``dropped``, error ``moved to
    NEW``) and owed at ``new`` (``published`` there, at its first publish time, as a
    group's message given to another member is), one event each per segment."""
    if not s.events_on or not segments:
        return
    ts, why = s.wall(), f"moved to {new}"
    command = is_command_stream(stream)
    default_topic = None if command else stream_target(stream)
    default_kind = "command" if command else "event"
    for key, record, ids in segments:
        topic = record.topic if record is not None else default_topic
        kind = KIND_NAMES.get(record.kind, default_kind) if record is not None else default_kind
        s.event("dropped_at_sender", ts, key, topic, kind, old, 0, why, ids or None)
        s.event("published", record.sent if record is not None else ts, key, topic, kind, new, 0, None,
                ids or None)
