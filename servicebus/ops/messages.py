"""The messages of a stored segment (model/segments.py), as the operators' tools list,
export and move them: one row, one dead letter, one journal event id per message.

A segment's record holds its messages' ids and one blob of their payloads. The tools show
whatever a store holds rather than stop at it: a blob that does not read as one payload
per id (a damaged record; ``servicebus check`` names it) still gives each id its row, its
payload shown as the undecodable bytes it is.
"""

from __future__ import annotations

from ..model.delivery import OutgoingRecord
from ..model.letters import damaged_letter, outgoing_letter
from ..model.segments import bodies_of, make_blob

__all__ = ["bodies", "outgoing_letters"]


def bodies(ids: list[str], blob: bytes) -> list[bytes | None]:
    """Each message's payload bytes, in ``ids`` order; all None if ``blob`` does not read as
    one payload per id."""
    try:
        found = bodies_of(blob)
    except Exception:  # noqa: BLE001 - msgpack raises many types on junk
        return [None] * len(ids)
    return list(found) if len(found) == len(ids) else [None] * len(ids)


def outgoing_letters(reason: str, record: OutgoingRecord, peer: str | None, stream: str,
                     raw: bytes) -> list[tuple[str, dict]]:
    """(id, dead letter) of each message of an outgoing segment: a segment of one each, as
    the bus makes them (core/expiry.py), which ``servicebus replay`` puts back. A segment
    whose payloads do not read gives each id a ``damaged`` letter keeping the record's
    ``raw`` bytes instead (replay leaves those alone)."""
    found = bodies(record.ids, record.blob)
    if len(record.ids) == 1 and found[0] is not None:
        return [(record.ids[0], outgoing_letter(reason, None, record, peer, stream))]
    out = []
    for mid, body in zip(record.ids, found):
        if body is None:
            letter = damaged_letter("outgoing", f"{reason}: its segment's payloads do not read", raw,
                                    peer, stream)
        else:
            letter = outgoing_letter(reason, None, record._replace(ids=[mid], blob=make_blob([body])),
                                     peer, stream)
        out.append((mid, letter))
    return out
