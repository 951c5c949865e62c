"""``Routes``: who a publish goes to, as one immutable snapshot.

The delivery core owns who subscribes to what; it is touched by the engine thread only.
Publishing threads (``engine/publisher.py``) must still know, without a lock and without
reaching into the core, which streams a topic's events go into and which of them are at
``max_backlog``. So the core keeps that in a ``Routes`` it replaces, never mutates, and the
engine hands each new one to the publisher (a reference swap, atomic in Python). A
publish reads one snapshot from start to end: it never sees half of a change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from ..wire.topics import is_pattern, matches
from .delivery import event_stream
from .retention import NO_RETENTION, Retention

__all__ = ["Routes", "NO_ROUTES"]

_EMPTY: Mapping[str, tuple[str, ...]] = MappingProxyType({})
_CACHE_LIMIT = 10_000  # topics remembered per snapshot (a publish to a new topic computes it)


@dataclass(frozen=True, eq=False)
class Routes:
    # Event streams with consumers -> their peers (a subscriber group's shared consumer is
    # named "group:<name>"): a publish stores into these.
    stream_peers: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: _EMPTY)
    # Event streams (of any priority level) with a consumer at ``max_backlog`` -> the
    # peers of those consumers (named in ``BacklogFull``).
    full: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: _EMPTY)
    # Retained topics (retention.py): a publish to one goes into its own stream even with
    # no consumer, kept by age and size.
    retention: Retention = NO_RETENTION
    _targets: dict[str, tuple[str, ...]] = field(default_factory=dict, repr=False)

    def targets(self, topic: str) -> tuple[str, ...]:
        """The event streams a publish to ``topic`` goes into: its own, if subscribed or
        retained, and those of the subscribed patterns it matches (topics.py). Safe on any thread: the
        cache belongs to this snapshot, and a lost race only computes a topic twice."""
        found = self._targets.get(topic)
        if found is None:
            peers = self.stream_peers
            own = event_stream(topic)
            kept = own in peers or (self.retention and self.retention.ms(topic) > 0)
            found = tuple([own] if kept else []) + tuple(sorted(
                stream for stream in peers if is_pattern(stream[2:]) and matches(stream[2:], topic)))
            if len(self._targets) < _CACHE_LIMIT:
                self._targets[topic] = found
        return found

    def with_peers(self, stream_peers: dict[str, tuple[str, ...]]) -> "Routes":
        return replace(self, stream_peers=MappingProxyType(stream_peers), _targets={})

    def with_full(self, full: dict[str, tuple[str, ...]]) -> "Routes":
        return replace(self, full=MappingProxyType(full), _targets=self._targets)


NO_ROUTES = Routes()
