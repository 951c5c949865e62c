"""What ``Bus`` answers about itself: waiting for events (``once``/``any``/``all``),
``drain``, ``status``, ``deadletters`` (and ``replay``/``purge`` of them), ``counters``. A layer of ``Bus`` (bus.py) over
``Lifecycle`` (lifecycle.py), so that each file holds one concern."""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from .engine import loop as E
from .errors import WaitTimeout
from .lifecycle import Lifecycle
from .model.letters import dead_letters
from .model.outgoing import check_seconds
from .model.records import BusStatus, DeadLetter, Message
from .store.status import live_status
from .wire.topics import validate_pattern

__all__ = ["BusState", "OWN_PAYLOAD"]

OWN_PAYLOAD = object()  # replay's payload when none is given: each letter's own


class BusState(Lifecycle):
    # --- waiting for events -----------------------------------------------------------

    def once(self, topic: str, *, timeout: float | None = None) -> tuple[Any, Message]:
        """Wait for the next event on ``topic`` (a pattern too) that this bus receives;
        return ``(payload, message)`` (``message.attempt`` is 0: not a handler run).

        For scripts, tests and sagas: it sees events received after the call, whether or
        not a handler handles them, and it handles nothing itself. Not durable: a wait in
        memory. You still need a subscription that brings the events here. Raises
        ``WaitTimeout`` after ``timeout`` seconds."""
        return self._watch((topic,), False, timeout)[topic]

    def any(self, topics: Iterable[str], *, timeout: float | None = None) -> tuple[str, Any, Message]:
        """Wait for the next event on any of ``topics``; ``(topic pattern, payload,
        message)`` of the first (see ``once``)."""
        patterns = tuple(topics)
        got = self._watch(patterns, False, timeout)
        (pattern, (payload, message)), = got.items()
        return pattern, payload, message

    def all(self, topics: Iterable[str], *, timeout: float | None = None) -> dict[str, tuple[Any, Message]]:
        """Wait until an event has arrived on each of ``topics``; ``{topic pattern:
        (payload, message)}`` with the first of each (see ``once``)."""
        return self._watch(tuple(topics), True, timeout)

    def _watch(self, patterns: tuple[str, ...], need_all: bool,
               timeout: float | None) -> dict[str, tuple[Any, Message]]:
        if not patterns:
            raise ValueError("give at least one topic")
        for pattern in patterns:
            validate_pattern(pattern)
        if timeout is not None:
            check_seconds(timeout, "timeout")
        self._check_open()
        watch = self._watches.add(patterns, need_all)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not watch.done.wait(0.5 if deadline is None else
                                      min(0.5, max(0.0, deadline - time.monotonic()))):
                self._check_open()
                if deadline is not None and time.monotonic() >= deadline:
                    missing = [p for p in patterns if p not in watch.got]
                    raise WaitTimeout(f"no event on {', '.join(map(repr, missing))} within {timeout}s")
            return dict(watch.got)
        finally:
            self._watches.remove(watch)

    # --- state -------------------------------------------------------------------------

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until nothing is pending anywhere: every subscriber acknowledged, every
        received message handled (or dead-lettered), every subscribe confirmed. Returns
        False if that did not happen within ``timeout`` seconds."""
        engine = self._check_open()
        if self._dispatcher.in_worker():
            # The running handler is itself pending work: this would wait for itself.
            raise RuntimeError("drain() cannot be called from inside a handler")
        future: Future = Future()
        engine.submit(E.Drain(future))
        try:
            return bool(self._wait(future, timeout))
        except FutureTimeout:
            future.cancel()
            return False

    def status(self) -> BusStatus:
        """A frozen snapshot of counts per store, peers and the lock owner, and
        ``store_error`` when the store cannot be written."""
        snap = self._call(lambda f: E.Snapshot(f))
        return live_status(self._store, snap, node_id=self.node_id, address=self.address,
                           datadir=str(self.datadir), running=not self._closed,
                           lock=dict(self._lock.owner.__dict__) if self._lock else {},
                           admin=self._admin)

    def deadletters(self, limit: int | None = None) -> list[DeadLetter]:
        """The dead letters in the store, oldest id first (at most ``limit``): what an
        operator would replay or purge (``servicebus deadletters`` shows the payloads)."""
        self._check_open()
        return dead_letters(self._store.deadletters(), limit)

    def replay(self, ids: Iterable[str] | None = None, *, topic: str | None = None,
               reason: str | None = None, payload: Any = OWN_PAYLOAD) -> int:
        """Put dead letters back, as ``servicebus replay`` does, while the bus runs: received
        ones are handled again (attempts reset), undeliverable ones are owed again under a
        new id and without TTL; each journaled ``replayed``. Selects by ``ids``, ``topic``
        and ``reason`` (all that are given; none: every dead letter; ``ids=[]``: none).
        Returns how many were put back: a letter that cannot be as it is (a message whose
        own fields were not valid) stays, and so does the first message of a publish still
        being handled here, until it is done. ``ValueError``, and nothing done, if an id
        named is no dead letter.

        ``payload`` (None too) edits the one letter ``ids`` names (its id alone: no topic or
        reason): it is replayed with this payload instead of its own, encoded as ``publish``
        encodes one, its topic, headers and correlation id kept; journaled ``replayed`` with
        detail ``edited``. Nothing done, and ``TypeError`` if a receiver could not decode it
        (as ``publish``), ``ValueError`` if it is over ``max_payload``, more than one letter is
        named or the letter is not replayable."""
        args = _selection(ids, topic, reason)
        if payload is not OWN_PAYLOAD:
            args["payload"] = payload
        rows = self._call(lambda f: E.Maintain("replay", args, f, strict=True))
        return sum(1 for row in rows if row.get("result") == "replayed")

    def purge(self, ids: Iterable[str] | None = None, *, topic: str | None = None,
              reason: str | None = None) -> int:
        """Delete dead letters, selected as for ``replay`` (none given: every one), each
        journaled ``dropped``; returns how many. ``ValueError``, and nothing done, if an id
        named is no dead letter."""
        rows = self._call(lambda f: E.Maintain("purge", _selection(ids, topic, reason), f, strict=True))
        return int(rows[0]["removed"]["deadletters"])

    def fleet(self) -> list[dict[str, Any]]:
        """What discovery knows (``Bus(name=..., seeds=...)``): one row per instance, this
        bus's own first (``self``): service ``name``, ``node``, ``address``, ``up``,
        ``since`` (ms it went up or down), ``silent`` (seconds since its last gossip),
        ``pub``/``sub`` topics, ``v`` version, ``kicked`` (why, if it was)."""
        snap = self._call(lambda f: E.Snapshot(f))
        return list(snap["fleet"])

    def kick(self, target: str, *, why: str = "") -> dict[str, Any]:
        """Remove an instance (node id or address) or a whole service (its name) from this
        publisher's subscribers: their subscriptions end, what they were owed is dropped
        (journaled ``dropped``, reason ``kicked: why``), and their subscribes are refused
        (``kicked``) until ``readmit``. ``ValueError`` if this bus knows no such target."""
        return dict(self._call(lambda f: E.Maintain("kick", {"target": target, "why": why}, f))[0])

    def readmit(self, target: str) -> None:
        """Let a kicked instance or service subscribe again."""
        self._call(lambda f: E.Maintain("readmit", {"target": target}, f))

    def counters(self) -> dict[str, int]:
        """Engine counters since start (published, sent, received, acked, fsyncs, ...)."""
        snap = self._call(lambda f: E.Snapshot(f))
        return dict(snap["counters"])


def _selection(ids: Iterable[str] | None, topic: str | None, reason: str | None) -> dict[str, Any]:
    """The dead letters a replay or purge names (engine/maintain.py checks the types)."""
    return {"ids": None if ids is None else [ids] if isinstance(ids, str) else list(ids),
            "topic": topic, "reason": reason}
