"""The write side of a handler's run: recording what happened, the start marker, redoing
a write a failed write took with it.

- Before a handler runs, its attempt count is written (unsynced; it survives SIGKILL), so
  a message that crashes the process is eventually dead-lettered instead of looping
  forever. The write that finishes one message also marks the next one of a worker's run
  started (``marker``), saving a write per message.
- A run's outcome is recorded the moment it is known, from the worker thread itself
  (DESIGN.md section 9: deferring it to the engine turns crashes into duplicate handling),
  and tried until it is written: it happened, so the handler must not run again while the
  process lives.
- A write that failed (a full disk) can take the unsynced writes LevelDB appended just
  after it with it when the store is reopened: the last ``RECENT`` finishing writes are
  kept, so that the scan after a reopen writes them again (``redo_for``) instead of
  running their handlers a second time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from ..errors import StoreError
from .concurrency import Waits
from ..model.clock import wall_ms
from ..model.segments import by_message
from ..model.stored import NO_RUNS, Incoming, Progress, RunState
from ..wire.protocol import Kind

__all__ = ["RunWriter", "RunStore", "RECENT"]

log = logging.getLogger("servicebus")

# Finishing writes kept to redo after a reopen. Only those that returned between a failed
# write and its failure being recorded can be dropped: a few per worker. Dead letters and
# replies keep their payload, so this also bounds that memory.
RECENT = 64
_tuple = tuple.__new__  # NamedTuples built per message skip their keyword-parsing __new__


class RunStore(Protocol):
    """What the handler side reads and writes (``servicebus.store.Store``; a fake in tests)."""

    generation: int

    @property
    def closed(self) -> bool: ...
    def batch(self) -> Any: ...
    def write(self, batch: Any, *, sync: bool) -> None: ...
    def wait_writable(self, timeout: float) -> bool: ...
    def has_incoming(self, message_id: str) -> bool: ...
    def get_runstate(self, message_id: str) -> RunState | None: ...
    def get_kv(self, key: str, default: Any = None) -> Any: ...


# Makes the write of a run "synced": through the publishers' group commit (fsynced, with
# the events a handler staged), given the function that fills the batch; returns what it
# returned (whether the next message's marker went in).
Synced = Callable[[Callable[[Any], bool]], bool]


class RunWriter:
    def __init__(self, store: RunStore, *, limit: Callable[[int, str], int], handles: Callable[[int, str], bool],
                 closing: Callable[[], bool], wall: Callable[[], int] = wall_ms) -> None:
        self._store = store
        self._limit = limit  # runs a message of (kind, topic) may begin (policy.py)
        self._handles = handles  # whether a handler is registered for (kind, topic)
        self._closing = closing
        self._wall = wall
        self._lock = threading.Lock()
        self._recent: OrderedDict[str, tuple[Callable[[Any], None], Callable[[], None] | None]] = OrderedDict()
        self._progress: OrderedDict[str, Progress] = OrderedDict()
        self._tls = threading.local()
        self.waits = Waits()

    def scratch(self) -> Any:
        """This thread's write batch, emptied: one per message was measurable."""
        batch = getattr(self._tls, "batch", None)
        if batch is None or batch.generation != self._store.generation:  # reopened since
            batch = self._tls.batch = self._store.batch()
        else:
            batch.clear()
        return batch

    @property
    def store(self) -> RunStore:
        return self._store

    def start_progress(self, key: str, start: int, progress: Progress) -> None:
        """Write that a run of segment ``key`` begins (``StoreError`` if it cannot be)."""
        batch = self.scratch()
        batch.put_progress(key, start, progress)
        self._store.write(batch, sync=False)  # a crash from here on counts as an attempt

    def start(self, message_id: str, state: RunState) -> None:
        """Write that a run begins (``StoreError`` if it cannot be written: then it does not)."""
        batch = self.scratch()
        batch.put_runstate(message_id, state)
        self._store.write(batch, sync=False)  # a crash from here on counts as an attempt

    def record(self, build: Callable[[Any], None], finished: str | None = None,
               nxt: Incoming | None = None, *, after: Callable[[], None] | None = None,
               synced: Synced | None = None, progress: tuple[str, Progress] | None = None) -> bool:
        """Write what a handler's run did: ``build(batch)`` fills a batch, whose write is
        tried until it succeeds (built again each time: one made before a reopen belongs to
        the closed handle). Only closing the bus gives up (the message then runs again
        after the next start, as after a crash). With ``nxt``, the same write marks that
        message's run as started; returns whether it did. ``after`` runs once it is made.

        ``synced``: make the write through it (fsynced, with staged events) rather than as
        a plain unsynced write.

        ``finished``: the id of a message this write takes out of the incoming store. A
        write that failed may still have reached LevelDB's log, and be applied when the
        store is reopened: if the message is gone when a write is tried again, it was,
        and is not made twice."""
        delay = 0.05
        failed = False
        while True:
            try:
                if failed and finished is not None and not self._store.has_incoming(finished):
                    marked = False  # an earlier try's write was applied by the reopen
                    break
                if synced is None:
                    batch = self.scratch()
                    build(batch)
                    marked = self.mark(batch, nxt)
                    self._store.write(batch, sync=False)
                else:
                    def rest(b: Any) -> bool:
                        build(b)
                        return self.mark(b, nxt)
                    began = time.perf_counter()
                    marked = synced(rest)
                    self.waits.seconds += time.perf_counter() - began
                break
            except (StoreError, RuntimeError) as exc:  # RuntimeError: plyvel's closed handle
                if self._closing() or self._store.closed:
                    raise StoreError(f"closing before a handler's run was recorded: {exc}") from exc
                failed = True
                self._store.wait_writable(delay)
                delay = min(delay * 2, 1.0)
        if synced is None and finished is not None:
            # Kept to be written again if a failed write takes it with it (a synced write
            # is never dropped).
            with self._lock:
                recent = self._recent
                recent[finished] = (build, after)
                if len(recent) > RECENT:
                    recent.popitem(last=False)
        elif synced is None and progress is not None:
            # The progress alone (not what else the write held: a message split off and
            # handled since must not come back): the last one of the segment's run.
            with self._lock:
                self._progress[progress[0]] = progress[1]
                self._progress.move_to_end(progress[0])
                if len(self._progress) > RECENT:
                    self._progress.popitem(last=False)
        if after is not None:
            after()
        return marked

    def synced_write(self, rest: Callable[[Any], bool]) -> bool:
        """A synced write of ``rest(batch)``, for a runner without a publisher (tests)."""
        batch = self._store.batch()
        marked = rest(batch)
        self._store.write(batch, sync=True)
        return marked

    def redo_for(self, message_id: str) -> Callable[[], None] | None:
        """Write ``message_id``'s finishing write again, if it was among the last RECENT made."""
        with self._lock:
            found = self._recent.get(message_id)
        if found is None:
            return None
        build, after = found

        def redo() -> None:
            self.record(build, message_id, after=after)
        return redo

    def forget(self, message_ids: list[str]) -> None:
        """Messages an operator put back in the incoming store (replayed dead letters): the
        write that finished them is done with, not to be written again when a scan finds
        them stored (which would make them dead letters again, unrun)."""
        with self._lock:
            for mid in message_ids:
                self._recent.pop(mid, None)

    def progress_redo(self, key: str) -> Callable[[], None] | None:
        """Writes the last progress of segment ``key``'s run again, if it is among the last
        RECENT made (a scan after a reopen: its finished handlers must not run again);
        taken once."""
        with self._lock:
            found = self._progress.pop(key, None)
        if found is None:
            return None

        def redo() -> None:
            log.warning("segment %s: the progress of its run may have been lost with a failed "
                        "write; writing it again (its finished handlers do not run again)", key)
            self.record(lambda batch: batch.put_progress(key, 0, found))
        return redo

    def marker(self, item: Incoming | None) -> RunState | None:
        """The run state that says "this message's handlers have started" (attempt + 1), or
        None if the message will not run a handler (reply, no handler yet, expired)."""
        if item is None:
            return None
        record = item.record
        kind = record.kind
        if kind == Kind.REPLY or not self._handles(kind, record.topic):
            return None
        if record.expires is not None and self._wall() > record.expires:
            return None
        attempts, done, last_error, _next = item.runstate or NO_RUNS
        if attempts >= self._limit(kind, record.topic):
            return None  # it will not run again: the runner dead-letters it
        return _tuple(RunState, (attempts + 1, list(done), last_error, 0))

    def mark(self, batch: Any, nxt: Incoming | None) -> bool:
        """Put the next message's (or segment's) start marker in ``batch``; whether it did."""
        if nxt is not None and by_message(nxt.id, nxt.record.ids):
            return self._mark_segment(batch, nxt)
        marker = self.marker(nxt)
        if marker is None or nxt is None:
            return False
        batch.put_runstate(nxt.id, marker)
        return True

    def _mark_segment(self, batch: Any, nxt: Incoming) -> bool:
        """A segment of several: its run's progress, one more run of its next message begun."""
        record = nxt.record
        if not self._handles(record.kind, record.topic):
            return False
        if record.expires is not None and self._wall() > record.expires:
            return False
        p = (nxt.progress or {}).get(0) or Progress(0, 0, [])
        if p.next >= len(record.ids):
            return False
        batch.put_progress(nxt.id, 0, Progress(p.next, p.started + 1, list(p.skipped)))
        return True
