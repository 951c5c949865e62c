"""Delivery state as stored: every (peer, stream) cursor, and what each is still owed.

Cursors go by segment key (model/segments.py): what a cursor owes is segments, each of one
or more messages. ``pending_ids`` yields the keys; ``pending_count`` counts the messages.

Read from the store alone, so at most a turn behind the engine. The operators' views
(``ops/``), their maintenance commands and the metrics hook (``hooks/metrics.py``) all read
it, which is why it lives in the store package rather than with any one of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from ..model.delivery import base_stream, event_stream, group_peer, is_priority_stream, stream_target
from ..model.ids import id_millis
from .db import Store

__all__ = ["ConsumerView", "consumers", "oldest_pending"]


@dataclass
class ConsumerView:
    peer: str
    stream: str
    floor: str | None
    acked: set[str] = field(default_factory=set)
    attempts: dict[str, int] = field(default_factory=dict)
    last_ack: float | None = None

    @property
    def topic(self) -> str:
        return stream_target(self.stream)

    def owes(self, key: str) -> bool:
        """Whether it still owes segment ``key`` (every message of it: a segment is acked whole)."""
        return (self.floor is None or key > self.floor) and key not in self.acked

    def pending_count(self, store: Store) -> int:
        """Messages it is owed: those of every segment past its floor not acked."""
        return store.count_stream(self.stream, after=self.floor, skip=self.acked)

    def pending_ids(self, store: Store, limit: int | None = None) -> Iterator[str]:
        """The keys of the segments it is owed, in stream order."""
        after, batch = self.floor, 2000
        while True:
            ids = store.stream_ids(self.stream, after=after, limit=batch)
            for mid in ids:
                if mid not in self.acked:
                    yield mid
            if len(ids) < batch:
                return
            after = ids[-1]


def consumers(store: Store) -> list[ConsumerView]:
    """Every (peer, stream) delivery state, including those not written yet: of a
    subscription, and of a priority level ("e:<topic> 3") written before its cursors were
    (the bus makes them at start, as core/streams.py ``mirror`` does)."""
    views: dict[tuple[str, str], ConsumerView] = {}
    for peer, stream, rec in store.deliveries():
        views[(peer, stream)] = ConsumerView(peer, stream, rec.get("floor"), set(rec.get("acked") or ()),
                                             dict(rec.get("attempts") or {}), rec.get("last_ack"))
    starts: dict[str, dict[str, str]] = {}  # level-0 stream -> subscriber or group -> since
    for sub, topic, subscription in store.subscriptions():
        group = subscription.get("group")
        key = (group_peer(group) if group else sub, event_stream(topic))  # a group: one cursor
        if key not in views:
            views[key] = ConsumerView(key[0], key[1], subscription["since"])
        since, peers = subscription["since"], starts.setdefault(key[1], {})
        peers[key[0]] = min(peers.get(key[0], since), since)  # a group: its earliest member's
    for stream in store.stream_names():
        if is_priority_stream(stream):
            for peer, since in starts.get(base_stream(stream), {}).items():
                if (peer, stream) not in views:
                    views[(peer, stream)] = ConsumerView(peer, stream, since)
    return sorted(views.values(), key=lambda c: (c.peer, c.stream))


def oldest_pending(store: Store) -> dict[str, int]:
    """Subscriber (or address) -> the time (ms, from its id) of the oldest message it is
    owed (a segment's first message is its oldest: its key is that one's id). Reads the
    stored cursors: at most a turn behind the engine."""
    out: dict[str, int] = {}
    for c in consumers(store):
        first = next(c.pending_ids(store), None)
        if first is not None:
            ms = id_millis(first)
            out[c.peer] = min(out.get(c.peer, ms), ms)
    return out
