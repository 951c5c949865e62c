"""The publish path: ``publish`` and a handler's transaction, on the callers' own threads.

A publish is stored by the calling thread itself through the group commit (commit.py):
handing it to the engine thread and waiting would cost two thread wake-ups per call. So
this module runs on many threads at once and must never touch the delivery core, which
the engine thread alone owns. What it needs to know of the core (which streams a topic
goes into, which are at ``max_backlog``) it reads from ``routes``, an immutable snapshot
(model/routes.py) the engine swaps in whenever the core makes a new one. What the engine
needs to know of a publish (new messages in a stream, a superseded message, a handler's
commands to move out of the outbox) goes to it as commands, through ``EnginePort``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from ..core import Published, QueueSend, Supersede
from ..errors import BacklogFull, BusError, StoreWriteError
from ..handling.transaction import StagedEvent
from ..hooks.base import Hooks
from ..model.clock import BusClock, wall_ms
from ..model.config import BusConfig
from ..model.delivery import priority_stream
from ..model.ids import IdGenerator
from ..model.outgoing import Staged, stage_publish
from ..model.routes import NO_ROUTES, Routes
from ..model.stored import OutboxSend
from ..store import Batch, Store
from .commit import GroupCommit

__all__ = ["Publisher", "EnginePort"]

log = logging.getLogger("servicebus")

# What one committed publish reports to the engine: (ids, what went into each stream, ttl?)
_Result = tuple[list[str], list[Staged], bool]
_PublishKey = tuple[str, int, "tuple[str, int] | None"]  # (dedupe key, now, earlier (id, at))


class EnginePort(Protocol):
    """All the publish path asks of the engine."""

    def submit(self, command: Any) -> None:
        """Queue a command for the engine thread (``BusError`` if it is closed or broken)."""

    def notify(self, commands: list[Any]) -> None:
        """Queue commands about writes that are durable already, whatever state the engine
        is in (it reads the store again after a reload), and wake it."""


class Publisher:
    def __init__(self, *, config: BusConfig, store: Store, ids: IdGenerator, clock: BusClock,
                 hooks: Hooks, engine: EnginePort, wall: Callable[[], int] = wall_ms) -> None:
        self.config = config
        self.store = store
        self.ids = ids
        self.clock = clock
        self.hooks = hooks
        self.engine = engine
        self.wall = wall
        # Swapped by the engine thread whenever the core replaces its own (never mutated).
        self.routes: Routes = NO_ROUTES
        self.committer = GroupCommit(store, self._on_commit)
        self.committer.observe = hooks.committed  # callers sharing each fsync
        self._dedupe_lock = threading.Lock()  # publishes with a dedupe key, one at a time
        self._count_lock = threading.Lock()
        self.published = 0  # ids handed out by publish()
        self.backlog_refused = 0  # publishes refused by backlog_policy
        self._room = threading.Condition()  # publishers waiting for max_backlog room
        self._closing = False

    # --- publish -------------------------------------------------------------------------

    def publish(self, topic: str, bodies: list[bytes], expires: int | None = None,
                headers: dict[str, Any] | None = None, dedupe_key: str | None = None,
                due: int | None = None, latest: bool = False, priority: int = 0) -> list[str]:
        """Store ``bodies`` for every subscriber of ``topic`` and return their ids once
        fsynced. Thread-safe. With ``dedupe_key`` (one body): the id of an earlier publish
        with that key within ``publish_dedupe_window``, storing nothing, or a new one
        stored with the key."""
        if not self.store.writable:
            # Not even an id for nobody's event: a bus that cannot write cannot deliver.
            raise StoreWriteError(f"the store cannot be written: {self.store.failure}")
        if self.routes.full:
            self.backpressure(topic, priority)
        if dedupe_key is not None:
            # Keyed publishes one at a time: the lookup and the write that stores the key
            # must not interleave with another publish of the same key.
            with self._dedupe_lock:
                found = self.store.get_publish_key(dedupe_key)
                now = self.clock.now()
                within = found is not None and now - found[1] < int(self.config.publish_dedupe_window * 1000)
                if within and not latest:
                    return [found[0]]  # type: ignore[index]
                ids = self._commit(topic, bodies, expires, headers, (dedupe_key, now, found), due, priority)
                if within and found is not None and found[0] != ids[0]:
                    self.engine.submit(Supersede(found[0], topic))
                return ids
        nobody = not self.routes.targets(topic)
        if nobody:  # asked again, not while the engine reloads who subscribes (Engine._recover)
            with self.committer.exclusive():
                nobody = not self.routes.targets(topic)
        if nobody:  # nothing to store
            ids = self.ids.many(len(bodies)) if due is None else self.ids.delayed(len(bodies), due)
            with self._count_lock:
                self.published += len(ids)
            return ids
        return self._commit(topic, bodies, expires, headers, None, due, priority)

    def _commit(self, topic: str, bodies: list[bytes], expires: int | None,
                headers: dict[str, Any] | None, key: _PublishKey | None, due: int | None,
                priority: int = 0) -> list[str]:
        def build(batch: Batch) -> _Result:
            ids, streams, events = self._stage(batch, topic, bodies, expires, headers, due, priority)
            self.hooks.events(batch, events)
            if key is not None:  # stored even with nobody subscribed: a retry finds it
                name, now, old = key
                if old is not None:  # past the window, not pruned yet: its index entry goes
                    batch.forget_publish_key(name, old[1])
                batch.put_publish_key(name, ids[0], now)
            return ids, streams, expires is not None

        return self.committer.commit(build, early=True)[0]

    def _stage(self, batch: Batch, topic: str, bodies: list[bytes], expires: int | None,
               headers: dict[str, Any] | None, due: int | None,
               priority: int) -> tuple[list[str], list[Staged], list[Any]]:
        # Under the group commit's lock: ids are made in the order batches commit.
        return stage_publish(batch, self.routes, self.ids, self.wall(), topic, bodies, expires,
                             headers, due, priority, journal=self.hooks.wanted,
                             max_count=self.config.max_batch)

    def _on_commit(self, results: list[_Result]) -> None:
        # Under the commit lock, in commit order: the engine sees new ids in stream order.
        commands = []
        with self._count_lock:
            for ids, streams, ttl in results:
                self.published += len(ids)
                commands += [Published(stream, items, ttl=ttl) for stream, items in streams]
        self.engine.notify(commands)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """No publish is built or reported meanwhile (the engine reloads under this)."""
        with self.committer.exclusive():
            yield

    @contextmanager
    def quiet(self) -> Iterator[None]:
        """No publish built meanwhile, and every one built before is in the store."""
        with self.committer.quiet():
            yield

    @property
    def fsyncs(self) -> int:
        return self.committer.fsyncs

    # --- backpressure ----------------------------------------------------------------------

    def backpressure(self, topic: str, priority: int) -> None:
        """A subscriber of ``topic`` may be at ``max_backlog``: apply ``backlog_policy``
        (core/backlog.py). Raises ``BacklogFull``, or returns when there is room (or the
        policy is to drop the oldest)."""
        if not self.routes.full:
            return
        cfg = self.config
        policy = cfg.backlog_policy
        if policy == "drop_oldest":
            return
        deadline = time.monotonic() + (cfg.backlog_timeout if policy == "block" else 0.0)
        with self._room:
            while True:
                routes = self.routes
                full = [level for st in routes.targets(topic)
                        if (level := priority_stream(st, priority)) in routes.full]
                if not full:
                    return
                left = deadline - time.monotonic()
                if left <= 0 or self._closing:
                    with self._count_lock:
                        self.backlog_refused += 1
                    who = [peer for stream in full for peer in routes.full[stream]]
                    raise BacklogFull(
                        f"{', '.join(who[:3]) or 'a subscriber'} of {topic!r} has "
                        f"max_backlog ({cfg.max_backlog}) messages waiting"
                        + (f" (waited {cfg.backlog_timeout:g}s)" if policy == "block" else "")
                        + "; nothing was stored")
                self._room.wait(min(left, 0.5))

    def room_changed(self) -> None:
        """The engine swapped in routes whose streams at max_backlog changed: publishers
        waiting for room look again."""
        with self._room:
            self._room.notify_all()

    def close(self) -> None:
        """The bus is closing: publishers waiting for room give up now."""
        self._closing = True
        self.room_changed()

    # --- a handler's transaction (handling/runner.py's Publisher) --------------------------

    def commit_transaction(self, events: list[StagedEvent], rest: Callable[[Batch], bool]) -> bool:
        """Store a handler's events with the rest of its run's write, fsynced, through the
        group commit (ids in commit order, the engine told in that order)."""
        if not self.store.writable:
            raise StoreWriteError(f"the store cannot be written: {self.store.failure}")
        marked = [False]

        def build(batch: Batch) -> _Result:
            ids: list[str] = []
            streams: list[Staged] = []
            for e in events:
                got, into, journaled = self._stage(batch, e.topic, [e.body], e.expires, e.headers,
                                                   e.due, e.priority)
                ids += got
                streams += into
                self.hooks.events(batch, journaled)
            marked[0] = rest(batch)
            return ids, streams, any(e.expires is not None for e in events)

        self.committer.commit(build)
        return marked[0]

    def queue_sends(self, sends: list[tuple[str, OutboxSend]]) -> None:
        """Have the engine move these commands (stored in the outbox) into their streams."""
        for key, send in sends:
            try:
                self.engine.submit(QueueSend(key, send))
            except BusError:
                return  # closing or broken: the outbox keeps them for the next start
