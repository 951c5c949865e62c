"""Group commit for writes made on user threads (``publish``), without the engine.

Handing a publish to the engine thread and waiting for it costs two thread wake-ups and
whatever else the engine does in that turn: measured, about 200 us on top of the fsync for
a single ``publish``. Here the calling thread commits itself; concurrent callers share one
fsync the usual way (leader/follower): the first caller to find no commit running becomes
the leader, takes every batch queued so far, writes them with one synced write, and wakes
the others.

Batches are built under the lock, in the order their ids are made, and committed groups
are reported (``on_commit``) in that same order, before any caller returns. So a stream
never holds a newer id without the older ones, and the engine learns of new messages in id
order: its delivery cursors rely on both.

One fsync on the latency path: a group is written to LevelDB unsynced first; the publishes
at its head (``early``: plain publishes, not a handler's transaction) are reported to the
engine right then, so that it sends them while the fsync runs; then one synced write makes
the group durable and its callers return. A publish returns only once durable, as always;
but a message may be delivered although its publish then raised (the fsync failed) or never
returned (a crash or a power cut during the fsync), as with any at-least-once producer.
Its id is never made again: ids carry the bus's epoch, counted up durably at every start
(ids.py). A transaction is reported only once durable: if its write must be made again
(a failed fsync), its events get new ids, and what was sent under the old ones would be
delivered twice.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

from ..store import Batch, Store

__all__ = ["GroupCommit"]

T = TypeVar("T")


class _Entry(Generic[T]):
    __slots__ = ("batch", "result", "done", "error", "lead", "wake", "early")

    def __init__(self, batch: Batch, result: T, early: bool = False) -> None:
        self.batch = batch
        self.result = result
        self.early = early  # may be reported before the fsync (a plain publish)
        self.done = False
        self.error: BaseException | None = None
        self.lead = False  # handed the lead of the next group
        # Released once: when the entry's group is committed, or when it is to lead the
        # next group. A bare lock per caller: a Condition shared by all of them costs a
        # wake-up of every waiter per commit (measured: a third of the publishing CPU).
        self.wake = threading.Lock()
        self.wake.acquire()


class GroupCommit:
    def __init__(self, store: Store, on_commit: Callable[[list[Any]], None]) -> None:
        self._store = store
        self._on_commit = on_commit  # called with the results of one group, in order
        self._mutex = threading.Lock()
        self._idle = threading.Condition(self._mutex)  # quiet(): no leader, no build
        self._quieting = False
        self._queue: list[_Entry[Any]] = []
        self._leading = False
        self._last_group = 0
        self.fsyncs = 0  # synced writes made (each one fsync of the log)
        # Called with each committed group's size (callers sharing one fsync), under the
        # mutex: metrics.py's histogram. None: not observed.
        self.observe: Callable[[int], None] | None = None

    def commit(self, build: Callable[[Batch], T], early: bool = False) -> T:
        """Run ``build(batch)`` under the commit lock, then make the batch durable (shared
        with concurrent callers) and return what ``build`` returned. ``early``: it may be
        reported before its fsync (see the module docstring).

        Exception-safe: whatever is raised where (the write, ``on_commit``, a
        KeyboardInterrupt while waiting or leading), the lead passes on or is given up, so
        a later caller never waits for a leader that is gone."""
        with self._mutex:
            while self._quieting:
                self._idle.wait()
            batch = self._store.batch()
            entry = _Entry(batch, build(batch), early)
            self._queue.append(entry)
            follow, self._leading = self._leading, True
        leading = not follow
        try:
            if follow:
                entry.wake.acquire()
                if entry.done:
                    if entry.error is not None:
                        raise entry.error
                    return entry.result
                # not done: the last leader handed over; this thread commits the next group
                leading = True
            if self._last_group > 1:
                # Callers of the last group are just waking up and will publish again at
                # once: give them the GIL to join this group, or each waits a fsync more.
                os.sched_yield()  # releases the GIL; unlike time.sleep(0), no clock involved
            with self._mutex:
                group, self._queue = self._queue, []
                self._last_group = len(group)
        except BaseException:
            if not entry.done:
                self._withdraw(entry, leading)
            raise
        error: BaseException | None = None
        head = 0  # the early entries at the group's head: reported before the fsync
        while head < len(group) and group[head].early:
            head += 1
        try:
            if head:
                # In LevelDB (readable) before the engine hears of it; durable right after.
                self._store.write_many([e.batch for e in group], sync=False)
                with self._mutex:
                    self._report(group[:head])
                self._store.sync()
            else:
                self._store.write_many([e.batch for e in group], sync=True)
        except BaseException as exc:  # noqa: BLE001 - every caller of the group gets it
            error = exc
        nxt = None
        try:
            with self._mutex:
                if error is None:
                    self.fsyncs += 1
                    if self.observe is not None:
                        self.observe(len(group))
                    try:
                        self._report(group[head:])
                    except BaseException as exc:  # noqa: BLE001 - written, but not reported
                        error = exc
                for e in group:
                    e.done = True
                    e.error = error
                nxt = self._pass_lead()
        finally:
            for e in group:
                if e is not entry:
                    e.wake.release()
            if nxt is not None:
                nxt.wake.release()
        if error is not None:
            raise error
        return entry.result

    def _report(self, entries: list[_Entry[Any]]) -> None:
        """Tell ``on_commit`` of these entries (under the mutex, in commit order)."""
        if entries:
            self._on_commit([e.result for e in entries])

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """No batch is built and no group reported meanwhile: builds read state the engine
        thread owns (who subscribes to what), and the engine rebuilds it under this."""
        with self._mutex:
            yield

    @contextmanager
    def quiet(self) -> Iterator[None]:
        """Stronger than ``exclusive``: also every batch built before is written and
        reported, so the store holds all of them (a scan by the engine then sees every
        publish built with routes it is about to replace). New builds wait meanwhile."""
        with self._mutex:
            self._quieting = True
            try:
                while self._leading:
                    self._idle.wait()
                yield
            finally:
                self._quieting = False
                self._idle.notify_all()

    def _pass_lead(self) -> _Entry[Any] | None:
        """Under the mutex: the entry that leads next (queued during this write), marked so,
        or None and nobody leads."""
        if self._queue:
            nxt = self._queue[0]
            nxt.lead = True
            return nxt
        self._leading = False
        self._idle.notify_all()  # quiet() waits for this
        return None

    def _withdraw(self, entry: _Entry[Any], leading: bool) -> None:
        """The caller of ``entry`` was interrupted (a KeyboardInterrupt) before its group
        was taken: its batch is not written, and if the lead was its own, or was being
        handed to it, the next caller gets it."""
        nxt = None
        with self._mutex:
            if entry in self._queue:
                self._queue.remove(entry)
            if leading or entry.lead:
                nxt = self._pass_lead()
        if nxt is not None:
            nxt.wake.release()
