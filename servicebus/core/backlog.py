"""Backpressure: ``max_backlog`` messages owed to one subscriber on one topic, at most.

Each event consumer counts what it is owed (stored after its floor, not acknowledged):
counted from the store once at load, then kept by the core on every path (a publish adds,
an ack or a settle, i.e. an expiry, a refusal or a drop, takes away). Only with
``max_backlog`` set: without it nothing here runs.

The streams with a consumer at its limit are published in ``State.routes`` (a new snapshot
when they change, never mutated; routes.py): publishing threads read it without a lock and
apply ``backlog_policy`` (``engine/publisher.py``): ``block`` (wait for room, up to
``backlog_timeout``, then ``BacklogFull``), ``raise`` (``BacklogFull`` at once), or
``drop_oldest`` (store it; this module moves the consumer's oldest messages to the dead
letters, reason ``backlog_full``). The limit is soft by what is published in one engine
turn: a publish checks the set as of the last turn.
"""

from __future__ import annotations

import logging

from ..model.delivery import Consumer, is_command_stream, unpack_outgoing
from .expiry import Expiry
from .state import State

__all__ = ["Backlog", "DROP_BUDGET"]

log = logging.getLogger("servicebus")

DROP_BUDGET = 5000  # messages dropped per turn at most (one batch)


def _count(data: bytes) -> int:
    """Messages in a stored segment (a damaged one counts as one: expiry.py deals with it)."""
    try:
        return len(unpack_outgoing(data).ids)
    except Exception:  # noqa: BLE001
        return 1


class Backlog:
    def __init__(self, state: State, expiry: Expiry) -> None:
        self.s = state
        self.expiry = expiry
        self.on = state.config.max_backlog is not None

    def load(self) -> None:
        """Count what every event consumer is owed, from the store (at start)."""
        if not self.on:
            return
        s = self.s
        for consumer in s.consumers.values():
            if not is_command_stream(consumer.stream):
                consumer.backlog = sum(
                    _count(data) for key, data in s.store.iter_stream(consumer.stream, after=consumer.floor)
                    if key not in consumer.skip)
        self.update()

    def published(self, consumer: Consumer, items: list[tuple[str, bytes, int]]) -> None:
        floor = consumer.floor or ""
        # Segments written before this consumer started are not owed to it.
        consumer.backlog += sum(count for key, _record, count in items if key > floor)

    def update(self) -> None:
        """Publish which streams have a consumer at its limit; drop the excess of those
        whose policy is ``drop_oldest``."""
        if not self.on:
            return
        s = self.s
        limit = s.config.max_backlog
        assert limit is not None
        full: dict[str, tuple[str, ...]] = {}
        for c in s.consumers.values():
            if c.backlog >= limit and not is_command_stream(c.stream):
                full[c.stream] = full.get(c.stream, ()) + (c.peer,)
        if s.config.backlog_policy == "drop_oldest":
            budget = DROP_BUDGET
            for consumer in list(s.consumers.values()):
                if consumer.backlog > limit and not is_command_stream(consumer.stream) and budget > 0:
                    budget -= self._drop(consumer, min(budget, consumer.backlog - limit))
        if full != s.routes.full:
            s.routes = s.routes.with_full(full)
            s.full_changed = True

    def _drop(self, consumer: Consumer, count: int) -> int:
        """Move at least ``count`` of the oldest messages owed to ``consumer`` to the dead
        letters, whole segments (a publish) at a time. In flight ones only while its
        subscriber is down (up, it may be storing them now); then the unsent ones, in
        stream order. Returns how many messages went."""
        s = self.s
        dropped = 0
        if not s.up(consumer):
            for key in sorted(consumer.inflight):
                if dropped >= count:
                    return dropped
                dropped += self._letter(consumer, key)
        if dropped >= count:
            return dropped
        # Nothing in flight: the cursor moves past them (a skipped key would be kept in the
        # durable record until the cursor got there: a subscriber down for long would grow
        # it without bound). Else each is marked done where it is, as an expiry is.
        jump = not consumer.order
        keys = [key for key in s.store.stream_ids(consumer.stream, after=consumer.pos,
                                                  limit=count - dropped) if key not in consumer.skip]
        last = None
        for key in keys:
            if dropped >= count:
                break
            if jump:
                n = self._record(consumer, key)
                consumer.floor = consumer.pos = last = key
                consumer.backlog -= n
                dropped += n
            else:
                dropped += self._letter(consumer, key)
        if last is not None:
            consumer.skip = {m for m in consumer.skip if m > last}
            consumer.dirty = True
        return dropped

    def _letter(self, consumer: Consumer, key: str) -> int:
        n = self._record(consumer, key)
        consumer.settle(key, n)
        return n

    def _record(self, consumer: Consumer, key: str) -> int:
        """Dead letters for a segment's messages; how many it had."""
        s = self.s
        data = s.store.get_outgoing(consumer.stream, key)
        record = None if data is None else self.expiry.record(consumer, key, data)
        if record is None:
            return 1
        self.expiry.letters(consumer, record, "backlog_full", f"more than max_backlog "
                            f"({s.config.max_backlog}) messages owed to {consumer.peer}")
        s.counters["backlog_dropped"] += len(record.ids)
        peer = consumer.journal_peer(key)
        if s.events_on and peer is not None:
            s.event("deadlettered_at_sender", s.wall(), key, record.topic, "event", peer, 0,
                    "backlog_full", record.ids)
        return len(record.ids)
