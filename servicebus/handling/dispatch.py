"""Hands received messages to worker threads owned by the bus: a bounded work queue,
parking, refills from the store, and the workers themselves.

The engine hands over incoming messages only after they are fsynced (and acked). From then
on the dispatcher owns their ``n/`` and ``r/`` records; ``runner.py`` runs one message
(handlers, retries, dead letters, replies) and ``handlers.py`` holds who handles what.
Messages without a handler yet stay in the store ("parked") and are dispatched when one
registers. At most ``dispatch_queue`` messages are held in memory; the rest wait in the
store and are read back as the queue empties.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable

from ..model.clock import BusClock, wall_ms
from ..model.config import BusConfig
from ..model.segments import by_message
from ..model.stored import Incoming
from ..model.delivery import PRIORITY_HEADER
from ..errors import StoreError
from ..wire.topics import is_pattern, matches
from .concurrency import Concurrency
from .policy import Policy
from .handlers import Handler, Handlers
from .lanes import LaneKey, Lanes, lane_of
from ..hooks.base import Hooks
from ..wire.protocol import Kind
from .requests import PendingRequests
from .runner import Runner
from .scan import quarantine, reread, stored_item
from .segmentrun import START
from .workers import RUN, WorkerLoop
from ..store import Store
from ..model.stored import ReplyRecord

__all__ = ["Dispatcher", "RUN"]

log = logging.getLogger("servicebus")

# A message of priority p is queued as if it had arrived p times this long earlier: it goes
# before lower ones that arrived less than that before it, and after those that waited
# longer (so a steady stream of high ones never holds a low one back for good).
PRIORITY_STEP = 1.0

class Dispatcher(WorkerLoop):
    def __init__(self, store: Store, config: BusConfig, *, on_idle: Callable[[], None],
                 requests: PendingRequests, on_reply: Callable[[str, ReplyRecord], None],
                 hooks: Hooks, clock: BusClock) -> None:
        self._store = store
        self._config = config
        self._on_idle = on_idle
        self._handlers = Handlers()
        self._runner = Runner(store, config, self._handlers, requests=requests,
                              on_reply=on_reply, hooks=hooks, clock=clock,
                              park=self._park, closing=lambda: self._closing, spawn=self._spawn)
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, Incoming]] = []
        self._seq = itertools.count()
        self._known: set[str] = set()  # queued, running or waiting for a retry
        self._reserved: set[str] = set()  # being stored by the engine (see reserve)
        self._parked: set[tuple[int, str]] = set()  # (kind, topic) with stored, unhandled messages
        self._parked_expiry: float | None = None  # monotonic: a parked message's TTL passes
        self._overflow = False
        self._overflow_gen = 0
        self._lanes = Lanes()  # ordered subscriptions' lanes with work
        self._refilling = False
        self._refill_pending = False  # a refill was asked for while one ran
        self._closing = False
        self._threads: list[threading.Thread] = []
        self._concurrency = Concurrency(config.workers, time.monotonic())  # under _cv
        self._watchers = 0

    # --- lifecycle ---------------------------------------------------------------------

    @property
    def runner(self) -> Runner:
        return self._runner

    def start(self) -> None:
        # Messages stored before a restart. A damaged record stops the start here, with a
        # StoreError naming it (rule 9), rather than being found later.
        self._refill(strict=True)
        for n in range(self._config.workers):
            t = threading.Thread(target=self._work, name=f"servicebus-worker-{n}", daemon=True)
            t.start()
            self._threads.append(t)

    def close(self, timeout: float) -> bool:
        """Stop taking work; wait up to ``timeout`` for running handlers. True if all ended."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        deadline = time.monotonic() + timeout
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:  # close() called from a handler: that handler is finishing now
                t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive() and t is not me]
        if alive:
            log.warning("close: %d handler(s) still running after %.1fs; their results will "
                        "be rerun after the next start", len(alive), timeout)
        return not alive

    def refill(self) -> None:
        """Queue every stored incoming message not in memory (after the store was reopened:
        a write that did not count may still have stored messages nobody handed over)."""
        try:
            self._refill()
        except StoreError as exc:
            log.error("reading stored incoming messages failed: %s", exc)

    def in_worker(self) -> bool:
        return threading.current_thread() in self._threads

    @property
    def idle(self) -> bool:
        with self._cv:
            return self._idle()

    def _idle(self) -> bool:
        return not (self._known or self._parked or self._overflow or self._refilling
                    or self._refill_pending)

    # --- handlers ----------------------------------------------------------------------

    def register(self, kind: Kind, topic: str, handler: Handler, name: str | None = None,
                 derived: str | None = None, policy: Policy | None = None,
                 payload: type | None = None) -> None:
        """Add ``handler`` (see ``Handlers.add``) and queue its parked messages."""
        with self._cv:
            key = self._handlers.add(kind, topic, handler, name, derived=derived, policy=policy,
                                     payload=payload)
            woken = {k for k in self._parked if k == key or (
                k[0] == key[0] and is_pattern(topic) and matches(topic, k[1]))}
            self._parked -= woken
            if woken:
                self._refill_pending = True  # not idle until its messages are read
                # Its messages are in the store, not in memory: until a scan has read them,
                # an ordered lane's newer arrivals wait in the store behind them.
                self._overflow = True
                self._overflow_gen += 1
        if woken:
            self._refill(only=key if woken == {key} else None)

    def handlers(self) -> list[tuple[str, str]]:
        """(topic or pattern, name) of every handler registered (hooks' ``BusView``)."""
        return self._handlers.names()

    @property
    def registry(self) -> Handlers:
        return self._handlers

    def _park(self, key: tuple[int, str], expires: int | None) -> bool:
        """A worker found no handler for ``key``: False if one registered since (run it
        now), else True: it waits in the store until one does (``register`` reads it)."""
        with self._cv:
            if key in self._handlers:
                return False
            self._parked.add(key)
            if expires is not None:
                self._wake_parked_at(expires)
            return True

    # --- intake ------------------------------------------------------------------------

    def reserve(self, ids: list[str]) -> None:
        """Messages the engine is storing now and will ``submit`` once that write counts:
        a refill running meanwhile must not take (and finish) them first, or the engine's
        hand-off would run them again."""
        with self._cv:
            self._known.update(ids)
            self._reserved.update(ids)

    def unreserve(self, ids: list[str]) -> None:
        """The write that stored them did not count: they are not handed over."""
        with self._cv:
            for mid in ids:
                if mid in self._reserved:
                    self._reserved.discard(mid)
                    self._known.discard(mid)

    def submit(self, items: Iterable[Incoming]) -> None:
        with self._cv:
            added = 0
            reserved = self._reserved
            now = time.monotonic()
            for item in items:
                if item.id in reserved:
                    reserved.discard(item.id)
                    self._known.discard(item.id)
                elif item.id in self._known:
                    continue
                headers = item.record.headers
                lane, due = None, now
                if headers:  # ordered lanes and priorities live in headers; most have none
                    lane = lane_of(item)
                    prio = headers.get(PRIORITY_HEADER)
                    if type(prio) is int:
                        due -= PRIORITY_STEP * max(0, min(9, prio))
                # An ordered message waits in the store while older ones may be there and
                # not in memory (the queue overflowed, or a handler just woke parked ones):
                # the refill reads them all back in id order.
                if len(self._known) >= self._config.dispatch_queue or (
                        lane is not None and (self._overflow or self._lanes.has_gap(lane))):
                    self._overflow = True
                    self._overflow_gen += 1
                    if lane is not None:
                        self._lanes.left_behind(lane)
                    continue
                if lane is None:
                    self._push(item, due)
                else:
                    self._enqueue(item, due, lane)
                added += 1
            if added:
                # Wake as many workers as may take the runs (concurrency.py), not all of
                # them: every needless wake-up is a context switch and a turn at the GIL.
                self._cv.notify(self._concurrency.wake(added, RUN, now))

    def _wake_parked_at(self, expires_ms: int) -> None:
        """A parked message expires then: a scan at that time dead-letters it. Under _cv."""
        due = time.monotonic() + max(0, expires_ms - wall_ms()) / 1000 + 0.001
        if self._parked_expiry is None or due < self._parked_expiry:
            self._parked_expiry = due
            self._cv.notify()

    def _nudge(self) -> None:
        """Work was queued (under _cv): wake a worker if one may take it. A worker queueing
        it takes it next itself unless another may run beside it (concurrency.py)."""
        if self._concurrency.may_start(time.monotonic()):
            self._cv.notify()

    def _spawn(self, item: Incoming, due: float) -> None:
        """A message split off a segment (runner.py): queued to run by itself at ``due``."""
        with self._cv:
            if item.id in self._known or self._closing:
                return
            self._enqueue(item, due, lane_of(item))
            self._nudge()

    def _push(self, item: Incoming, due: float) -> None:
        self._known.add(item.id)
        heapq.heappush(self._heap, (due, next(self._seq), item))

    def _enqueue(self, item: Incoming, due: float, lane: LaneKey | None) -> None:
        """Queue a message; one of an ordered lane waits behind the lane's head. Under _cv."""
        if lane is None or self._lanes.admit(item, due, lane):
            self._push(item, due)
        else:
            self._known.add(item.id)

    def _lane_done(self, item: Incoming) -> None:
        """``item`` is finished (handled, dead letter, parked): its lane's next one goes.
        Under _cv."""
        nxt = self._lanes.done(item)
        if nxt is not None:
            due, ready = nxt
            heapq.heappush(self._heap, (due, next(self._seq), ready))
            self._nudge()

    def _refill(self, only: tuple[int, str] | None = None, strict: bool = False) -> None:
        """Read stored incoming messages that are not in memory yet (restart, overflow, a
        handler registered late, a parked message's TTL). One refill runs at a time; a
        request made meanwhile makes it scan once more (everything) before it ends, so
        no request is lost and ``idle`` stays False until then."""
        with self._cv:
            self._refill_pending = True
            if self._refilling:
                return
            self._refilling = True
        try:
            while True:
                with self._cv:
                    self._refill_pending = False
                    gen = self._overflow_gen
                filled = self._scan(only, strict)
                with self._cv:
                    if only is None:
                        # Something was turned away while we scanned: its record may sort
                        # before where the scan had got to, so scan again once there is room.
                        self._overflow = not filled or gen != self._overflow_gen
                        if not self._overflow:  # every lane's messages are in memory, in order
                            self._lanes.all_read()
                    again = (self._overflow and not self._closing
                             and len(self._known) < self._config.dispatch_queue // 2)
                    if self._refill_pending and not self._closing:
                        again = True
                    if again:  # an overflow or a request: only a scan of everything ends it
                        only = None
                    if not again:
                        self._refill_pending = False
                        return
        except StoreError:
            if not self._closing:
                raise
        finally:
            with self._cv:
                self._refilling = False

    def _scan(self, only: tuple[int, str] | None, strict: bool) -> bool:
        """Queue stored messages not yet in memory; False if the queue filled up first.
        Not ``strict`` (a running bus), damaged records become dead letters and the scan
        goes on."""
        now_ms, now = wall_ms(), time.monotonic()
        damaged: list | None = None if strict else []
        try:
            return self._scan_records(only, strict, damaged, now_ms, now)
        finally:
            if damaged:
                quarantine(self._store, damaged)

    def _scan_records(self, only: tuple[int, str] | None, strict: bool, damaged: list | None,
                      now_ms: int, now: float) -> bool:
        redos: list[tuple[str, Callable[[], None]]] = []
        try:
            return self._scan_stored(only, strict, damaged, now_ms, now, redos)
        finally:
            for message_id, redo in redos:  # written here, but the write was dropped
                log.warning("message %s: its last write may have been lost with a failed write; "
                            "writing it again (its handler does not run again)", message_id)
                redo()

    def _scan_stored(self, only: tuple[int, str] | None, strict: bool, damaged: list | None,
                     now_ms: int, now: float, redos: list) -> bool:
        for message_id, record in self._store.incoming(damaged):
            if only is not None and (record.kind, record.topic) != only:
                continue
            with self._cv:
                if self._closing:
                    return True
                if message_id in self._known:
                    continue
                if len(self._known) >= self._config.dispatch_queue:
                    return False
                key = (record.kind, record.topic)
                if record.kind != Kind.REPLY and key not in self._handlers and (
                        record.expires is None or record.expires > now_ms):
                    # Nobody handles it yet: it waits in the store, not in the queue, or
                    # enough of them would fill the queue on every scan and keep the
                    # messages after them from their handlers. register() reads them.
                    self._parked.add(key)
                    if record.expires is not None:
                        self._wake_parked_at(record.expires)
                    if strict:  # at start every record is checked (rule 9), its run state too
                        self._store.get_runstate(message_id)
                    continue
                # The iterator reads a snapshot: a message finished since it was taken is
                # gone from the store (finishing deletes it before leaving _known).
                if not self._store.has_incoming(message_id):
                    continue
                redo = self._runner.redo_for(message_id)
                if redo is not None:
                    redos.append((message_id, redo))
                    continue
                progress_redo = self._runner.writer.progress_redo(message_id) \
                    if by_message(message_id, record.ids) else None
                if progress_redo is not None:  # written again after the scan, read by the next
                    redos.append((message_id, progress_redo))
                    self._refill_pending = True
                    continue
                item, due = stored_item(self._store, message_id, record, strict, now_ms, now,
                                        self._config.retry_max)
                self._enqueue(item, due, lane_of(item))
                self._nudge()
        return True

    def _requeue(self, due: float, seq: int, item: Incoming, read: bool = True) -> None:
        """Back in the queue where it was: a segment paused between two of its messages
        (``read``: its progress is read again), or what its worker had taken after it."""
        with self._cv:
            if self._closing:
                return
            paused = self._runner.paused.pop(item.id, None) if read else None
            if paused is not None:  # what its run wrote last
                item = item._replace(progress={**(item.progress or {}), START: paused})
            elif read:
                try:
                    item = item._replace(progress=self._store.progress(item.id))
                except StoreError as exc:  # a refill reads it again
                    log.error("reading the progress of %s: %s", item.id, exc)
                    self._known.discard(item.id)
                    return
            heapq.heappush(self._heap, (due, seq, item))
            self._nudge()

    def _finish(self, item: Incoming, retry_at: float | None) -> None:
        refill = False
        with self._cv:
            if retry_at is not None and not self._closing:
                try:
                    item = reread(self._store, item)
                except StoreError as exc:  # damaged, or closing: retried from its attempt 0
                    log.error("reading the run state of %s: %s", item.id, exc)
                    item = item._replace(runstate=None, progress=None)
                heapq.heappush(self._heap, (retry_at, next(self._seq), item))
                self._nudge()
            else:
                self._known.discard(item.id)
                self._lane_done(item)
            idle = self._idle()
            refill = self._overflow and not self._refilling and \
                len(self._known) < self._config.dispatch_queue // 2
        if refill and not self._closing:
            self._refill()
            idle = self.idle
        if idle:
            self._on_idle()
