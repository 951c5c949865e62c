"""``Store``: opening, closing, writing and reopening the LevelDB database; its reads
are in reads.py, the handle it guards in handle.py. Only this package touches plyvel."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import plyvel

from ..errors import StoreError, StoreWriteError
from ..forks import forked_error, keep_forever, watch
from .batch import Batch
from .handle import _Guard, _has_leveldb_files, _open_db, _room_to_reopen, _WriteFailed
from .schema import REPAIR_HINT
from .keys import FORMAT_VERSION, _M
from .mark import MARK_NAME, MarkFile
from .migrate import upgrade
from .reads import Reads

__all__ = ["Store", "OlderFormatError"]

log = logging.getLogger("servicebus")


class OlderFormatError(StoreError):
    """The store is in an older format, and ``Store.open(upgrade_old=False)`` was asked not
    to upgrade it (the operators' tools: only ``servicebus migrate`` and a bus upgrade)."""

    def __init__(self, message: str, version: int) -> None:
        super().__init__(message)
        self.version = version


class Store(Reads):
    """A LevelDB database in ``DATADIR/store``.

    Thread-safe: plyvel calls are, and ``close()`` waits for calls in progress so that a
    handler thread finishing late gets a ``StoreError`` instead of touching a closed DB.
    """

    def __init__(self, db: Any, path: Path, options: dict[str, Any] | None = None) -> None:
        self._db = db
        self.path = path
        self._options = options or {}
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._active = 0
        self._closed = False
        self._reopening = False
        self._guard = _Guard(self)
        self._reopen_lock = threading.Lock()
        self._failure: str | None = None  # why writes are refused, until reopen() works
        self._failures = 0  # write failures so far (see _writing)
        # The lock of _write_cv, taken bare on the hot path (a Condition's own __enter__ is
        # Python code, run twice per write: measurable at a write per message).
        self._write_lock = threading.Lock()
        self._write_cv = threading.Condition(self._write_lock)
        self._tickets = itertools.count()
        self._inflight: set[int] = set()  # writes inside LevelDB now
        self._unsynced = False  # an unsynced write was made since opening
        # When the oldest unsynced write that no synced write is known to cover was made
        # (monotonic), or None; and how many unsynced writes have returned (see _writing).
        self._unsynced_since: float | None = None
        self._unsynced_writes = 0
        self._waiting = 0  # writes waiting for the outcome of others
        self.generation = 0  # bumped by reopen(): batches of an older handle are copied
        self._pid = os.getpid()
        self._forked = False  # this is a fork()ed child's copy (forks.py)
        watch(self)
        self._marks: MarkFile | None = None  # DATADIR/store.hwm, set by open()
        self._mark_lock = threading.Lock()
        self._mark_value: int | None = None  # the last mark made (read at the first)
        self._synced_since_mark = False
        self._mark_failing = False

    # --- lifecycle ---------------------------------------------------------------------

    def _orphan(self) -> None:
        """In a fork()ed child (forks.py): refuse every call; never close the handle."""
        self._forked = True
        if self._db is not None:
            keep_forever(self._db)

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, create: bool = True, compression: bool = True,
             check_format: bool = True, upgrade_old: bool = True) -> "Store":
        """Open the store, or create it (``create``) where there is none at all.

        A directory holding LevelDB files but no ``CURRENT`` is refused: LevelDB would start
        an empty database over it and delete the old files (rule 9: a store that exists is
        never silently replaced). ``compression`` applies to blocks written from now on;
        blocks written either way stay readable. ``check_format=False`` is for the repair
        tool, which must open a store whose format record is damaged."""
        path = Path(path)
        has_current = (path / "CURRENT").exists()
        if not has_current and _has_leveldb_files(path):
            raise StoreError(f"store {path} holds LevelDB files but no CURRENT file: it is "
                             f"damaged (opening it would start an empty store); {REPAIR_HINT}")
        if not has_current and not create:
            raise StoreError(f"no store at {path}")
        options = dict(
            paranoid_checks=True,
            write_buffer_size=4 << 20,  # LevelDB default: bounds memtable memory
            lru_cache_size=8 << 20,
            bloom_filter_bits=10,
            compression="snappy" if compression else None,
        )
        marks = MarkFile(path.parent / MARK_NAME)
        recorded = marks.read()
        if not has_current and recorded and check_format:
            raise StoreError(f"store {path} is missing, but {marks.path} says it had made writes "
                             f"durable (mark {recorded}): it lost writes; it is not replaced with "
                             f"an empty one; {REPAIR_HINT}")
        store = cls(_open_db(path, create_if_missing=not has_current, **options), path, options)
        store._marks = marks
        if not check_format:
            return store
        try:
            store.check_mark()
            version = store.meta("format")
            if version is None:
                batch = store.batch()
                batch.put_meta("format", str(FORMAT_VERSION).encode())
                store.write(batch, sync=True)
            elif version in (1, 2):
                if not upgrade_old:
                    raise OlderFormatError(f"store {path} has format {version}; this version reads "
                                           f"{FORMAT_VERSION}: `servicebus migrate {path.parent}` upgrades "
                                           "it (a bus does so when it opens)", version)
                upgrade(store, version, FORMAT_VERSION)
            elif version != FORMAT_VERSION:
                raise StoreError(f"store {path} has format {version}; this version reads "
                                 f"{FORMAT_VERSION} (and upgrades 1 and 2)")
        except BaseException:
            store.close()
            raise
        return store

    # --- the high-water mark (mark.py) -------------------------------------------------

    def mark_behind(self) -> tuple[int | None, int] | None:
        """(the store's mark, the data directory's) if the store holds less than it had
        made durable: a lost, cut or older log (mark.py); else None."""
        recorded = self._marks.read() if self._marks is not None else None
        if not recorded:
            return None
        held = self.meta("hwm")
        return None if held is not None and held >= recorded else (held, recorded)

    def check_mark(self) -> None:
        """``StoreError`` if the store lost writes it had made durable (mark.py)."""
        behind = self.mark_behind()
        if behind is not None:
            held, recorded = behind
            raise StoreError(
                f"store {self.path} lost writes it had made durable: it holds mark "
                f"{'none' if held is None else held}, "
                f"{MARK_NAME} says {recorded} (a log file deleted, zeroed or cut, or the store "
                f"put back from an older copy); {REPAIR_HINT}")

    def mark(self, force: bool = False) -> None:
        """Make a new high-water mark durable, in the store then in its file, if synced
        writes were made since the last one (or ``force``). Call it every MARK_INTERVAL
        (the engine does) and at close. ``StoreWriteError`` as for any write; a mark file
        that cannot be written is logged (the store itself is fine)."""
        if self._marks is None or self._forked or not (self._synced_since_mark or force):
            return
        with self._mark_lock:  # marks in increasing order, in the store as in the file
            self._synced_since_mark = False
            if self._mark_value is None:
                self._mark_value = max(self.meta("hwm") or 0, self._marks.read() or 0)
            value = self._mark_value + 1
            batch = self.batch()
            batch.put_meta("hwm", str(value).encode())
            self._writing([batch], True, marking=True)
            self._mark_value = value
            try:
                self._marks.write(value)
            except OSError as exc:
                if not self._mark_failing:  # once, not every second of a full disk
                    log.error("cannot write the store's high-water mark %s: %s (a lost log "
                              "would go unnoticed until it can)", self._marks.path, exc)
                self._mark_failing = True
            else:
                self._mark_failing = False

    def accept_marks(self) -> None:
        """After a repair reported what was lost: the store as it is now is the truth."""
        self._mark_value = None
        self.mark(force=True)

    @staticmethod
    def repair(path: str | os.PathLike[str]) -> None:
        """LevelDB's repair: rebuild the store from whatever table and log files it can
        read (see maintenance.py for what ``check --repair`` does around it)."""
        try:
            # Without paranoid_checks, repair does not verify block checksums and keeps a
            # damaged table as it is.
            plyvel.repair_db(str(path), paranoid_checks=True)
        except plyvel.Error as exc:
            raise StoreError(f"repair of {path} failed: {exc}") from exc

    def close(self) -> None:
        if self._forked:
            return  # the parent's to close
        if self.writable:
            try:
                self.mark()  # what the last synced writes made durable, once more
            except StoreError as exc:
                log.error("the last high-water mark at close failed: %s", exc)
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()  # writers waiting in wait_writable()
            self._cv.wait_for(lambda: self._active == 0)
        if self._db is not None:
            if self._unsynced and self._failure is None:
                # Writes made after the owner's last sync (a handler finishing while the bus
                # closed) are made durable too: closing LevelDB does not fsync its log.
                try:
                    self._db.write_batch(sync=True).write()
                except plyvel.Error as exc:
                    log.error("the last sync at close failed: %s", exc)
            self._db.close()

    # --- failed writes and reopening ----------------------------------------------------

    @property
    def writable(self) -> bool:
        return self._failure is None and not self._closed

    @property
    def failure(self) -> str | None:
        """Why writes are refused (the first failed write's error), or None."""
        return self._failure

    def wait_writable(self, timeout: float) -> bool:
        """Wait until writes are accepted again (or the store closes); True if they are."""
        with self._cv:
            self._cv.wait_for(lambda: self._failure is None or self._closed, timeout)
            return self.writable

    def reopen(self, timeout: float = 1.0) -> bool:
        """After a failed write: close the database and open it again, which recovers its
        log (the failed write's partial record at its end is dropped) and starts a new one,
        then check with a synced write that writing works. True if writes are accepted
        again; False leaves them refused (try again later). Waits up to ``timeout`` for
        calls in progress to finish; calls made meanwhile fail at once."""
        with self._reopen_lock:
            if self._failure is None or self._closed:
                return not self._closed
            if self._db is not None and not _room_to_reopen(self.path):
                return False  # closing now would leave no handle at all until there is room
            with self._cv:
                self._reopening = True
                if not self._cv.wait_for(lambda: self._active == 0, timeout):
                    self._reopening = False
                    self._cv.notify_all()
                    return False
            try:
                if self._db is not None:
                    self._db.close()
                    self._db = None
                try:
                    db = _open_db(self.path, create_if_missing=False, **self._options)
                except StoreError as exc:
                    self._failure = str(exc)
                    return False
                self._db, self.generation = db, self.generation + 1
                try:
                    db.put(_M + b"sync", b"", sync=True)
                except plyvel.Error as exc:
                    self._failure = f"store write failed: {exc}"
                    return False
                with self._lock, self._write_cv:
                    self._failure = None
                return True
            finally:
                with self._cv:
                    self._reopening = False
                    self._cv.notify_all()

    def _writing(self, batches: list[Batch], sync: bool, marking: bool = False,
                 logs_only: bool = False) -> None:
        """Apply ``batches`` atomically in one LevelDB write; ``StoreWriteError`` if it may
        not survive, and for every write after a failed one until ``reopen``.

        Why: when a write fails (ENOSPC) LevelDB leaves a partial record at the end of its
        log, and appends the next write after it; at the next open its recovery takes the
        partial record for a torn tail and silently drops everything after it, paranoid
        checks or not (measured: a synced put that returned OK after an ENOSPC was gone
        after a reopen). So no write may count as done if one that could have gone into the
        log before it failed: a write waits, after LevelDB returned, for the outcome of
        every write still in LevelDB at that moment, and fails if any of them failed.
        Writes are not serialized in Python instead (measured: a fifth to a quarter of
        e2e-batch throughput): LevelDB's own queue groups concurrent writes without the GIL."""
        if self._forked:
            raise forked_error("store", self._pid)
        cv, lock = self._write_cv, self._write_lock
        with lock:
            if self._failure is not None:
                raise StoreWriteError(f"the store refuses writes since one failed ({self._failure})")
            failures = self._failures
            # A synced write covers every write that returned before it began (LevelDB
            # appends them to its log in order, and the fsync takes the log up to here).
            unsynced_before, began = self._unsynced_writes, time.monotonic() if sync else 0.0
            ticket = next(self._tickets)
            inflight = self._inflight
            inflight.add(ticket)
        try:
            with self._op():
                try:
                    if logs_only:
                        self._fsync_logs()
                    elif len(batches) == 1 and not sync and batches[0].generation == self.generation:
                        batches[0]._wb.write()  # the common case: nothing to copy
                    else:
                        merged = self._db.write_batch(sync=sync)
                        for batch in batches:
                            merged.append(batch._wb)
                        merged.write()
                except (plyvel.Error, OSError) as exc:
                    raise _WriteFailed(exc) from exc  # not the guard's "damaged files" error
        except _WriteFailed as failed:
            cause = failed.__cause__
            with cv:
                inflight.discard(ticket)
                first = self._failure is None
                self._failure = f"store write failed: {cause}"
                self._failures += 1
                cv.notify_all()
            if first:
                log.error("%s; the store refuses writes until it is reopened", self._failure)
            raise StoreWriteError(self._failure) from cause
        except BaseException:
            with cv:
                inflight.discard(ticket)
                cv.notify_all()
            raise
        with lock:
            inflight.discard(ticket)
            if not sync:
                self._unsynced = True  # close() syncs once more (cheaper than knowing if it must)
                self._unsynced_writes += 1
                if self._unsynced_since is None:
                    self._unsynced_since = time.monotonic()
            elif self._unsynced_writes == unsynced_before:
                self._unsynced_since = None  # none returned while this one was written
            elif self._unsynced_since is not None and self._unsynced_since < began:
                # Some returned meanwhile (a handler finishing during the engine's fsync):
                # none older than this write's start can be uncovered.
                self._unsynced_since = began
            if self._waiting:
                cv.notify_all()  # someone waits for this write's outcome
            # Writes that may have gone into the log before this one, whose outcome a
            # synced write (it releases acks and publish calls) waits for. An unsynced one
            # does not wait: what it holds is redone if it is dropped (a resend, a handler
            # rerun), as after a power loss, and the wait is what costs (measured: making
            # handler completions wait for the engine's writes halved e2e-batch).
            before = set(inflight) if sync else ()
            if before:
                self._waiting += 1
                try:
                    while before & inflight:
                        cv.wait()
                finally:
                    self._waiting -= 1
            lost = self._failures != failures
        if lost:
            raise StoreWriteError(f"a write at the same time failed ({self._failure}): this one "
                                  "may be dropped with it when the store is reopened, so it does not count")
        if sync and not marking:
            self._synced_since_mark = True

    @property
    def closed(self) -> bool:
        return self._closed

    def _op(self) -> "_Guard":
        """``with self._op():`` around every plyvel call (a small class, not a generator
        context manager: this runs several times per message)."""
        return self._guard

    # --- writes ------------------------------------------------------------------------

    def batch(self) -> Batch:
        with self._op():
            return Batch(self._db.write_batch(transaction=False), self.generation)

    def write(self, batch: Batch, *, sync: bool) -> None:
        """Apply ``batch`` atomically; with ``sync`` the log is fsynced before returning.
        ``StoreWriteError`` if it fails, and for every write after that until ``reopen``."""
        if batch.ops == 0 and not sync:
            return
        # A batch's sync flag is fixed when it is created (the engine only knows at commit
        # time whether anything waits on durability), and a batch made before a reopen
        # belongs to the old handle: both are copied into a new one when written.
        self._writing([batch], sync)

    def write_many(self, batches: list[Batch], *, sync: bool) -> None:
        """Apply several batches as one atomic write (one fsync with ``sync``)."""
        self._writing(batches, sync)

    def next_epoch(self) -> int:
        """Count one more start of the bus, durably, and return its number (ids carry it)."""
        epoch = (self.meta("epoch") or 0) + 1
        batch = self.batch()
        batch.put_meta("epoch", str(epoch).encode())
        self.write(batch, sync=True)
        return int(epoch)

    def unsynced_for(self, now: float) -> float:
        """How long (seconds, monotonic ``now``) the oldest write that may not survive a power
        cut has been waiting for a synced write to cover it; 0.0 if none."""
        since = self._unsynced_since
        return 0.0 if since is None else now - since

    def sync(self) -> None:
        """Make every earlier write durable: an fdatasync of each of LevelDB's log files.
        Not a synced LevelDB write: that fsyncs only the current log, and when LevelDB has
        just started a new one (its memtable full) the earlier writes are in the old one,
        which it closes without an fsync (tests/integration/test_power_loss.py: a publish
        acknowledged that way was gone after a power cut). LevelDB hands every write's
        log record to the OS before the write returns; a log deleted meanwhile was written
        out as a table, which LevelDB fsyncs."""
        self._writing([], True, logs_only=True)

    def _fsync_logs(self) -> None:
        for name in sorted(os.listdir(self.path)):
            if name.endswith(".log"):
                try:
                    fd = os.open(os.path.join(self.path, name), os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue  # written out as a table and deleted meanwhile: durable there
                try:
                    os.fdatasync(fd)
                finally:
                    os.close(fd)
