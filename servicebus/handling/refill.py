"""The dispatcher's refills (mixed into ``Dispatcher``, dispatch.py, whose state it uses):
scans of the incoming store that queue what is stored and not in memory: at start, after
the queue overflowed, when a handler registers late, after the store was reopened.

A scan reads the store in id order, so an ordered lane's messages are queued in publish
order; one that ends with nothing turned away meanwhile (no overflow) has every lane's
stored messages in memory, which lets new ordered arrivals into memory again (submit).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import StoreError
from ..model.clock import wall_ms
from ..model.config import BusConfig
from ..model.segments import by_message
from ..model.stored import Incoming
from ..wire.protocol import Kind
from .handlers import Handlers
from .lanes import LaneKey, lane_of
from .scan import quarantine, stored_item

if TYPE_CHECKING:
    from ..store import Store
    from .runner import Runner

__all__ = ["RefillLoop"]

log = logging.getLogger("servicebus")


class RefillLoop:
    _cv: threading.Condition
    _store: "Store"
    _config: BusConfig
    _handlers: Handlers
    _runner: "Runner"
    _known: set[str]
    _parked: set[tuple[int, str]]
    _closing: bool
    _overflow: bool
    _overflow_gen: int
    _refilling: bool
    _refill_pending: bool
    _refill_wanted: bool
    _low: int

    def _enqueue(self, item: Incoming, due: float, lane: LaneKey | None) -> None:
        raise NotImplementedError

    def _nudge(self) -> None:
        raise NotImplementedError

    def _wake_parked_at(self, expires_ms: int) -> None:
        raise NotImplementedError

    def _refill(self, strict: bool = False) -> None:
        """Read stored incoming messages that are not in memory yet (restart, overflow, a
        handler registered late, a parked message's TTL). One refill runs at a time; a
        request made meanwhile makes it scan once more before it ends, so no request is
        lost and ``idle`` stays False until then."""
        with self._cv:
            self._refill_pending = True
            if self._refilling:
                return
            self._refilling = True
            self._refill_wanted = False
        ended = False
        try:
            while True:
                with self._cv:
                    self._refill_pending = False
                    gen = self._overflow_gen
                filled = self._scan(strict)
                with self._cv:
                    # Something was turned away while we scanned: its record may sort
                    # before where the scan had got to, so scan again once there is room.
                    # Until then ordered arrivals wait in the store (submit): not over, a
                    # lane's messages are all in memory, in order.
                    self._overflow = not filled or gen != self._overflow_gen
                    again = (self._overflow and not self._closing
                             and len(self._known) < self._low)
                    if (again or self._refill_pending) and not self._closing:
                        continue
                    # Ends in the same hold of the lock as the decision: a message finishing
                    # from now on sees no refill running and starts the next one itself.
                    self._refill_pending = False
                    self._refilling, ended = False, True
                    return
        except StoreError:
            if not self._closing:
                raise
        finally:
            if not ended:
                with self._cv:
                    self._refilling = False

    def _scan(self, strict: bool) -> bool:
        """Queue stored messages not yet in memory; False if the queue filled up first.
        Not ``strict`` (a running bus), damaged records become dead letters and the scan
        goes on."""
        now_ms, now = wall_ms(), time.monotonic()
        damaged: list | None = None if strict else []
        try:
            return self._scan_records(strict, damaged, now_ms, now)
        finally:
            if damaged:
                quarantine(self._store, damaged)

    def _scan_records(self, strict: bool, damaged: list | None,
                      now_ms: int, now: float) -> bool:
        redos: list[tuple[str, Callable[[], None]]] = []
        try:
            return self._scan_stored(strict, damaged, now_ms, now, redos)
        finally:
            for message_id, redo in redos:  # written here, but the write was dropped
                log.warning("message %s: its last write may have been lost with a failed write; "
                            "writing it again (its handler does not run again)", message_id)
                redo()

    def _scan_stored(self, strict: bool, damaged: list | None,
                     now_ms: int, now: float, redos: list) -> bool:
        parked: set[tuple[int, str]] = set()  # the (kind, topic) this scan left parked
        for message_id, record in self._store.incoming(damaged):
            with self._cv:
                if self._closing:
                    return True
                if message_id in self._known:
                    continue
                if len(self._known) >= self._config.dispatch_queue:
                    return False
                key = (record.kind, record.topic)
                if key in parked and key in self._handlers:
                    # Its handler registered while this scan ran, after it parked older
                    # ones of the topic: queued now, this one would overtake them. The
                    # registration asked for the next scan, which reads them all in order.
                    continue
                if record.kind != Kind.REPLY and key not in self._handlers and (
                        record.expires is None or record.expires > now_ms):
                    # Nobody handles it yet: it waits in the store, not in the queue, or
                    # enough of them would fill the queue on every scan and keep the
                    # messages after them from their handlers. register() reads them.
                    self._parked.add(key)
                    parked.add(key)
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
