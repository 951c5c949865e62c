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
from .scan import reread
from .segmentrun import START
from .refill import RefillLoop
from .workers import RUN, WorkerLoop
from ..store import Store
from ..model.stored import ReplyRecord

__all__ = ["Dispatcher", "RUN"]

log = logging.getLogger("servicebus")

# A message of priority p is queued as if it had arrived p times this long earlier: it goes
# before lower ones that arrived less than that before it, and after those that waited
# longer (so a steady stream of high ones never holds a low one back for good).
PRIORITY_STEP = 1.0

class Dispatcher(RefillLoop, WorkerLoop):
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
        self._sent_back: set[str] = set()  # running, to go back to the store (see _park)
        self._parked: set[tuple[int, str]] = set()  # (kind, topic) with stored, unhandled messages
        self._parked_expiry: float | None = None  # monotonic: a parked message's TTL passes
        self._overflow = False
        self._overflow_gen = 0
        # Under this many in memory after an overflow, a refill reads more: half the queue
        # (at least 1: with a queue of 1, "fewer than 1 // 2 = 0" never came, and it stalled).
        self._low = max(1, config.dispatch_queue // 2)
        self._lanes = Lanes()  # ordered subscriptions' lanes with work
        self._refilling = False
        self._refill_pending = False  # a refill was asked for while one ran
        self._refill_wanted = False  # a worker is to run one (nothing finishing would start it)
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
                # Its messages wait in the store. An ordered lane's newer ones in memory
                # (queued while the older ones parked) go back there too, and newer
                # arrivals wait there (overflow): one scan reads them all in id order.
                self._send_back({lane for lane, k in self._queued_lanes() if k in woken})
        if woken:
            self._refill()

    def handlers(self) -> list[tuple[str, str]]:
        """(topic or pattern, name) of every handler registered (hooks' ``BusView``)."""
        return self._handlers.names()

    @property
    def registry(self) -> Handlers:
        return self._handlers

    def _park(self, item: Incoming) -> None:
        """A worker found no handler for ``item``: it waits in the store until one registers
        (``register`` reads it). If one registered since the worker looked, it goes back to
        the store as the worker finishes it (``_finish``), for a scan that reads it in id
        order among its lane's messages: run at once, it could overtake older ones of its
        lane that the registration's scan is reading."""
        record = item.record
        key = (record.kind, record.topic)
        with self._cv:
            if key in self._handlers:
                self._sent_back.add(item.id)
                return
            self._parked.add(key)
            if record.expires is not None:
                self._wake_parked_at(record.expires)

    def _queued_lanes(self) -> list[tuple[LaneKey, tuple[int, str]]]:
        """(lane, key) of every ordered message in memory and not running. Under _cv."""
        found = [(lane, (item.record.kind, item.record.topic)) for lane, item in self._lanes.queued()]
        for _due, _seq, item in self._heap:
            lane = lane_of(item)
            if lane is not None:
                found.append((lane, (item.record.kind, item.record.topic)))
        return found

    def _send_back(self, lanes: set[LaneKey]) -> None:
        """The messages of ``lanes`` that are in memory and not running leave it (they are
        stored): the lanes wait for a scan of the store (overflow), which reads every lane
        back in id order; one is asked for. Under _cv."""
        forget = set()
        for lane in lanes:
            forget.update(self._lanes.hold(lane))
        if lanes and self._heap:
            kept = []
            for entry in self._heap:
                item = entry[2]
                its = lane_of(item)
                if its is not None and its in lanes:
                    self._lanes.unhead(its, item.id)
                    self._runner.paused.pop(item.id, None)  # its progress is stored
                    forget.add(item.id)
                else:
                    kept.append(entry)
            heapq.heapify(kept)
            self._heap = kept
        self._known -= forget
        self._overflow = True
        self._overflow_gen += 1
        self._want_refill()

    def _want_refill(self) -> None:
        """What is in the store and not in memory is to be read: by the refill running (it
        scans again), else by a worker woken for it. Under _cv."""
        self._refill_pending = True
        if not self._refilling:
            self._refill_wanted = True
            self._cv.notify()

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
            added = left = 0
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
                        lane is not None and self._overflow):
                    self._overflow = True
                    self._overflow_gen += 1
                    left += 1
                    continue
                if lane is None:
                    self._push(item, due)
                else:
                    self._enqueue(item, due, lane)
                added += 1
            if left and not self._refilling and len(self._known) < self._low:
                # Left in the store with little in memory: no finishing message may come to
                # start the refill that reads it, so a worker is woken for it.
                self._want_refill()
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
            elif item.id in self._sent_back:  # parked as a handler registered (_park)
                self._sent_back.discard(item.id)
                self._known.discard(item.id)
                lane = lane_of(item)
                if lane is not None:
                    self._lanes.unhead(lane, item.id)
                self._send_back(set() if lane is None else {lane})
            else:
                self._known.discard(item.id)
                self._lane_done(item)
            idle = self._idle()
            refill = self._overflow and not self._refilling and \
                len(self._known) < self._low
        if refill and not self._closing:
            self._refill()
            idle = self.idle
        if idle:
            self._on_idle()
