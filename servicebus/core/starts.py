"""Subscriptions made with a start position (model/retention.py): where each of their
consumers begins, what it skips, and, for a pattern, the retained events copied in.

A start counts only for a topic the publisher retains; for any other it means "new" (what
a stream holds for other subscribers is theirs, not retained history). A start later than
the publisher's id clock means its "now" (a subscriber's clock ahead of the publisher's
must not make it miss what is published meanwhile), delayed messages stored for later
included.

Each consumer of the subscription (the topic's stream and each of its priority levels) gets
a floor, the keys above it it must not be given (events of topics not retained that the
stream holds for others; events whose TTL passed before the subscription was made: never
owed to it), and how many messages it is owed, for ``max_backlog``.

A pattern subscription's copy must see every event a publisher stores before the publishers
know the new subscription: the engine makes it under the publishers' exclusive lock, routes
swapped before they go on (``Handshake`` defers it to ``State.backfills``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..model.delivery import event_stream, stream_target, unpack_outgoing
from ..model.retention import ID_RE, start_floor
from ..wire.topics import is_pattern, matches
from .state import State

__all__ = ["Begin", "plan"]


@dataclass
class Begin:
    """Where a subscription's consumer of one stream begins."""

    floor: str
    skip: set[str] = field(default_factory=set)
    owed: int = 0


def _segment_floor(s: State, stream: str, start: str) -> str:
    """A start id inside a segment (a ``publish_many``) starts at that segment: a stream goes
    by segment keys, and the segment's earlier messages come too, never a gap."""
    floor = start_floor(start)
    if ID_RE.fullmatch(start) is None:
        return floor
    key = s.store.key_at_or_before(stream, start[:24])
    if key is None or key == start:
        return floor
    data = s.store.get_outgoing(stream, key)
    try:
        holds = data is not None and start in unpack_outgoing(data).ids
    except ValueError:
        holds = False
    return start_floor(key) if holds else floor


def _in_future(s: State, start: str) -> bool:
    return start != "earliest" and start_floor(start)[:12] > f"{s.ids.now_ms():012x}"


def _levels(s: State, stream: str) -> list[str]:
    """``stream`` and its priority levels that hold something."""
    return [stream] + sorted(st for st in s.store.stream_names() if st.startswith(stream + " "))


def _scan(s: State, stream: str, begin: Begin, copied: set[str]) -> None:
    """Count what ``stream`` holds above ``begin.floor`` that the new consumer is owed, and
    put in ``skip`` what it is not: topics not retained, TTLs passed already."""
    retention, now = s.routes.retention, s.wall()
    after: str | None = begin.floor
    while chunk := s.store.iter_stream(stream, after=after, limit=1000):
        for key, data in chunk:
            if key in copied:
                continue  # counted when copied
            try:
                record = unpack_outgoing(data)
            except ValueError:
                continue  # expiry.py deals with a damaged record
            if not retention.ms(record.topic) or (record.expires is not None and record.expires < now):
                begin.skip.add(key)
            else:
                begin.owed += len(record.ids)
        after = chunk[-1][0]


def plan(s: State, topic: str, start: str) -> dict[str, Begin] | None:
    """Each stream of a new subscription to ``topic`` starting at ``start`` -> where its
    consumer begins; None if the start means "new". For a pattern, the retained events are
    copied into its streams here, in ``s.out.batch`` (the write that makes it)."""
    if not is_pattern(topic) and not s.routes.retention.ms(topic):
        return None
    if _in_future(s, start):
        # From now on, then: what is published from now, and what is stored already for
        # later (a delayed message, whose id is its due time: it may be the start itself).
        start = f"t:{s.ids.now_ms()}"
    base = event_stream(topic)
    if not is_pattern(topic):
        out = {}
        for stream in _levels(s, base):
            begin = Begin(_segment_floor(s, stream, start))
            _scan(s, stream, begin, set())
            out[stream] = begin
        return out
    return _backfill(s, topic, start, base)


def _backfill(s: State, pattern: str, start: str, base: str) -> dict[str, Begin]:
    retention, now, batch = s.routes.retention, s.wall(), s.out.batch
    out: dict[str, Begin] = {}
    copied: dict[str, set[str]] = {}
    for source in s.store.stream_names():
        topic = stream_target(source)
        if not source.startswith("e:") or is_pattern(topic) or not matches(pattern, topic) \
                or not retention.ms(topic):
            continue
        target = base + source[len(event_stream(topic)):]  # the same priority level
        floor = _segment_floor(s, source, start)
        begin = out.setdefault(target, Begin(floor))
        begin.floor = min(begin.floor, floor)
        keys = copied.setdefault(target, set())
        after: str | None = floor
        while chunk := s.store.iter_stream(source, after=after, limit=1000):
            for key, data in chunk:
                record = unpack_outgoing(data)
                if record.expires is not None and record.expires < now:
                    continue  # expired before this subscription: never owed to it
                batch.put_outgoing(target, key, data)
                keys.add(key)
                begin.owed += len(record.ids)
            after = chunk[-1][0]
    for target in _levels(s, base):
        out.setdefault(target, Begin(start_floor(start)))
    for target, begin in out.items():
        _scan(s, target, begin, copied.get(target, set()))  # what the stream held already
    return out
