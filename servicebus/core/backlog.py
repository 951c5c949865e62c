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

from ..model.delivery import Consumer, is_command_stream
from ..model.letters import outgoing_letter
from .expiry import Expiry
from .state import State

__all__ = ["Backlog", "DROP_BUDGET"]

log = logging.getLogger("servicebus")

DROP_BUDGET = 5000  # messages dropped per turn at most (one batch)


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
                owed = s.store.stream_ids(consumer.stream, after=consumer.floor)
                consumer.backlog = len(owed) - len(consumer.skip)
        self.update()

    def published(self, consumer: Consumer, items: list[tuple[str, bytes]]) -> None:
        floor = consumer.floor or ""
        if items and items[0][0] > floor:
            consumer.backlog += len(items)
        else:  # written before this consumer started: not owed to it
            consumer.backlog += sum(1 for mid, _ in items if mid > floor)

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
        """Move the ``count`` oldest messages owed to ``consumer`` to the dead letters. In
        flight ones only while its subscriber is down (up, it may be storing them now);
        then the unsent ones, in stream order."""
        s = self.s
        dropped = 0
        if not s.up(consumer):
            for mid in sorted(consumer.inflight)[:count]:
                dropped += self._letter(consumer, mid)
        if dropped >= count:
            return dropped
        # Nothing in flight: the cursor moves past them (a skipped id would be kept in the
        # durable record until the cursor got there: a subscriber down for long would grow
        # it without bound). Else each is marked done where it is, as an expiry is.
        jump = not consumer.order
        ids = [mid for mid in s.store.stream_ids(consumer.stream, after=consumer.pos,
                                                 limit=count - dropped) if mid not in consumer.skip]
        for mid in ids:
            if jump:
                self._record(consumer, mid)
                consumer.floor = consumer.pos = mid
                consumer.backlog -= 1
            else:
                dropped += self._letter(consumer, mid)
        if jump and ids:
            dropped += len(ids)
            consumer.skip = {m for m in consumer.skip if m > ids[-1]}
            consumer.dirty = True
        return dropped

    def _letter(self, consumer: Consumer, mid: str) -> int:
        self._record(consumer, mid)
        consumer.settle(mid)
        return 1

    def _record(self, consumer: Consumer, mid: str) -> None:
        s = self.s
        data = s.store.get_outgoing(consumer.stream, mid)
        record = None if data is None else self.expiry.record(consumer, mid, data)
        if record is None:
            return
        s.out.batch.put_deadletter(mid, outgoing_letter(
            "backlog_full", f"more than max_backlog ({s.config.max_backlog}) messages owed to "
            f"{consumer.peer}", record, consumer.peer, consumer.stream))
        s.counters["backlog_dropped"] += 1
        peer = consumer.journal_peer(mid)
        if s.events_on and peer is not None:
            s.event("deadlettered_at_sender", s.wall(), mid, record.topic, "event", peer, 0,
                      "backlog_full")
