"""The LevelDB store: one database per data directory, split into keyspaces by prefix.

Only this module touches plyvel. Other modules speak in records and ``Batch`` methods,
never in raw keys. Every change that spans keyspaces goes through one ``Batch`` and so is
atomic. Keys (``\\0`` separates parts; topics and addresses cannot contain it)::

    m/<name>                       meta (node id, format version)
    s/<subscriber>\\0<topic>        subscriptions: who subscribed to me
    i/<publisher>\\0<topic>         subscribe intents: whom I asked (and whether confirmed)
    o/<stream>\\0<id>               outgoing messages, one log per stream (e:<topic>, ...)
    d/<peer>\\0<stream>             delivery state of one peer on one stream (a cursor)
    n/<id>                         incoming messages not yet handled
    r/<id>                         run state of an incoming message (attempts, errors)
    h/<id>                         handled ids, kept for the dedupe window (value: when, in
                                   bus-clock ms, see clock.py)
    t/<when, 8 bytes><id>          the same ids ordered by when they were handled (pruning)
    x/<id>                         dead letters
    y/<command id>                 replies of handled requests, not yet queued for sending
    j/<seq, 8 bytes>               delivery journal records not yet moved to segment files
    g/<segment file name>          when (bus-clock ms) a journal segment was written (retention)

Outgoing messages are stored once per stream, however many subscribers there are; each
subscriber's delivery state is a cursor into the stream (see ``delivery.py``). That keeps a
fan-out to ten subscribers at one write per message.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import msgpack
import plyvel

from .clock import BusClock
from . import schema
from .errors import CorruptRecordError, LockedError, StoreError, StoreWriteError
from .letters import damaged_letter
from .schema import REPAIR_HINT

__all__ = ["Store", "Batch", "KEYSPACES", "FORMAT_VERSION"]

log = logging.getLogger("servicebus")

# 2: handled ids carry bus-clock time and are indexed by it (t/); journal segments (g/).
FORMAT_VERSION = 2
SEP = b"\x00"

KEYSPACES = {
    "meta": b"m/",
    "subscriptions": b"s/",
    "intents": b"i/",
    "outgoing": b"o/",
    "deliveries": b"d/",
    "incoming": b"n/",
    "runstate": b"r/",
    "handled": b"h/",
    "deadletters": b"x/",
    "replies": b"y/",
    "journal": b"j/",
    "handled_index": b"t/",
    "segments": b"g/",
}
_M, _S, _I, _O, _D, _N, _R, _H, _X, _Y, _J, _T, _G = (KEYSPACES[k] for k in (
    "meta", "subscriptions", "intents", "outgoing", "deliveries", "incoming", "runstate",
    "handled", "deadletters", "replies", "journal", "handled_index", "segments"))


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _has_leveldb_files(path: Path) -> bool:
    """Whether ``path`` holds any of LevelDB's data files (tables, logs, manifests)."""
    try:
        names = [p.name for p in path.iterdir()]
    except FileNotFoundError:
        return False
    return any(n.endswith((".ldb", ".sst", ".log")) or n.startswith("MANIFEST-") for n in names)


def _room_to_reopen(path: Path) -> bool:
    """Whether the file system holds enough free space for LevelDB to reopen the store: it
    turns its log into a table first (about the log's size), then starts a new log."""
    try:
        logs = sum(p.stat().st_size for p in path.glob("*.log"))
        st = os.statvfs(path)
    except OSError:
        return True  # cannot tell: try
    return st.f_bavail * st.f_frsize > logs + (1 << 20)


def _open_db(path: Path, **options: Any) -> Any:
    try:
        return plyvel.DB(str(path), **options)
    except plyvel.IOError as exc:
        if "lock" in str(exc).lower():
            # LevelDB's own lock: another process has this store open right now (one that
            # does not hold DATADIR/LOCK, or got in first). Never a reason to repair it.
            raise LockedError(f"store {path} is in use by another process ({exc})") from exc
        raise StoreError(f"cannot open store {path}: {exc}") from exc
    except plyvel.Error as exc:
        raise StoreError(f"cannot open store {path}: {exc}; {REPAIR_HINT}") from exc
    except OSError as exc:
        raise StoreError(f"cannot open store {path}: {exc}") from exc


def _pair(prefix: bytes, a: str, b: str) -> bytes:
    return prefix + a.encode() + SEP + b.encode()


def _split(key: bytes, prefix_len: int) -> tuple[str, str]:
    a, _, b = key[prefix_len:].partition(SEP)
    return a.decode(), b.decode()


def _end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])


class Batch:
    """A set of writes applied atomically by ``Store.write``. Belongs to one thread."""

    __slots__ = ("_wb", "ops", "sync", "generation")

    def __init__(self, wb: Any, generation: int = 0) -> None:
        self._wb = wb
        self.ops = 0
        self.sync = False  # set when something visible waits on this batch being durable
        self.generation = generation  # of the store's database handle (see Store.reopen)

    def clear(self) -> None:
        """Empty the batch for reuse (cheaper than a new one per message)."""
        self._wb.clear()
        self.ops = 0
        self.sync = False

    def _put(self, key: bytes, value: bytes) -> None:
        self._wb.put(key, value)
        self.ops += 1

    def _delete(self, key: bytes) -> None:
        self._wb.delete(key)
        self.ops += 1

    def put_meta(self, name: str, value: bytes) -> None:
        self._put(_M + name.encode(), value)

    def put_clock(self, clock: BusClock) -> None:
        """Carry the bus clock over to the next start (clock.py)."""
        self._put(_M + b"clock", str(clock.now()).encode())

    def put_subscription(self, subscriber: str, topic: str, record: dict) -> None:
        self._put(_pair(_S, subscriber, topic), _pack(record))

    def delete_subscription(self, subscriber: str, topic: str) -> None:
        self._delete(_pair(_S, subscriber, topic))

    def put_intent(self, publisher: str, topic: str, record: dict) -> None:
        self._put(_pair(_I, publisher, topic), _pack(record))

    def delete_intent(self, publisher: str, topic: str) -> None:
        self._delete(_pair(_I, publisher, topic))

    def put_outgoing(self, stream: str, message_id: str, record: bytes) -> None:
        """``record`` is already packed (see ``delivery.pack_outgoing``)."""
        self._put(_pair(_O, stream, message_id), record)

    def delete_outgoing(self, stream: str, message_id: str) -> None:
        self._delete(_pair(_O, stream, message_id))

    def put_delivery(self, peer: str, stream: str, record: dict) -> None:
        self._put(_pair(_D, peer, stream), _pack(record))

    def delete_delivery(self, peer: str, stream: str) -> None:
        self._delete(_pair(_D, peer, stream))

    def put_incoming(self, message_id: str, record: list) -> None:
        self._put(_N + message_id.encode(), _pack(record))

    def put_runstate(self, message_id: str, record: list) -> None:
        self._put(_R + message_id.encode(), _pack(record))

    def complete_incoming(self, message_id: str, handled_at: int) -> None:
        """``handled_at``: bus-clock ms (clock.py), which the dedupe window counts from."""
        key = message_id.encode()
        self._delete(_N + key)
        self._delete(_R + key)
        self.put_handled(message_id, handled_at)

    def put_handled(self, message_id: str, handled_at: int) -> None:
        key, at = message_id.encode(), handled_at.to_bytes(8, "big")
        self._put(_H + key, at)
        self._put(_T + at + key, b"")

    def complete_with_reply(self, message_id: str, handled_at: int, reply: list) -> None:
        """Finish a request and keep its reply, in one write: a reply is never lost
        after its request counts as handled, and never made for an unfinished one."""
        self.complete_incoming(message_id, handled_at)
        self._put(_Y + message_id.encode(), _pack(reply))

    def delete_reply(self, message_id: str) -> None:
        self._delete(_Y + message_id.encode())

    def forget_handled(self, message_id: str, handled_at: int) -> None:
        key = message_id.encode()
        self._delete(_H + key)
        self._delete(_T + handled_at.to_bytes(8, "big") + key)

    def quarantine_incoming(self, key: bytes, raw: bytes, error: str) -> None:
        """Move an incoming record that does not decode to the dead letters, raw bytes kept."""
        self._delete(key)
        self._delete(_R + key[len(_N):])
        self._put(_X + key[len(_N):], _pack(damaged_letter("incoming", error, raw)))

    def deadletter_incoming(self, message_id: str, record: dict) -> None:
        key = message_id.encode()
        self._delete(_N + key)
        self._delete(_R + key)
        self._put(_X + key, _pack(record))

    def put_deadletter(self, message_id: str, record: dict) -> None:
        self._put(_X + message_id.encode(), _pack(record))

    def delete_deadletter(self, message_id: str) -> None:
        self._delete(_X + message_id.encode())

    def put_journal(self, seq: int, record: bytes) -> None:
        self._put(_J + seq.to_bytes(8, "big"), record)

    def delete_journal(self, seq: int) -> None:
        self._delete(_J + seq.to_bytes(8, "big"))

    def put_segment(self, name: str, written_at: int) -> None:
        self._put(_G + name.encode(), written_at.to_bytes(8, "big"))

    def delete_segment(self, name: str) -> None:
        self._delete(_G + name.encode())

    def delete_raw(self, key: bytes) -> None:
        """Delete any key (repair of records that no longer decode)."""
        self._delete(key)


class _WriteFailed(Exception):
    """A LevelDB write failed (carried past the guard, which would call it damage)."""


class _Guard:
    """Counts calls in progress so that ``close()`` and ``reopen()`` can wait for them, and
    translates errors. While the database handle is being replaced, calls fail at once
    (only a bus that cannot write reopens, and everything it does then retries)."""

    __slots__ = ("_store",)

    def __init__(self, store: "Store") -> None:
        self._store = store

    def __enter__(self) -> None:
        store = self._store
        with store._lock:  # the bare lock, not the Condition: this runs per plyvel call
            if store._closed:
                raise StoreError("the store is closed")
            if store._reopening or store._db is None:
                raise StoreWriteError(f"the store is being reopened after: {store._failure}")
            store._active += 1

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        store = self._store
        with store._lock:
            store._active -= 1
            if store._active == 0 and (store._closed or store._reopening):
                store._cv.notify_all()
        if exc_type is not None and issubclass(exc_type, plyvel.Error):
            # Reads fail like this only on damaged files (writes handle their own errors).
            raise StoreError(f"store error: {exc}; {REPAIR_HINT}") from exc
        return False


class Store:
    """A LevelDB database in ``DATADIR/store``.

    Thread-safe: plyvel calls are, and ``close()`` waits for calls in progress so that a
    handler thread finishing late gets a ``StoreError`` instead of touching a closed DB.
    """

    def __init__(self, db: Any, path: Path, options: dict | None = None) -> None:
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
        self._write_cv = threading.Condition(threading.Lock())
        self._tickets = itertools.count()
        self._inflight: set[int] = set()  # writes inside LevelDB now
        self._unsynced = False  # an unsynced write was made since opening
        self._waiting = 0  # writes waiting for the outcome of others
        self.generation = 0  # bumped by reopen(): batches of an older handle are copied

    # --- lifecycle ---------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike, *, create: bool = True, compression: bool = True,
             check_format: bool = True) -> "Store":
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
        store = cls(_open_db(path, create_if_missing=not has_current, **options), path, options)
        if not check_format:
            return store
        try:
            version = store.meta("format")
            if version is None:
                batch = store.batch()
                batch.put_meta("format", str(FORMAT_VERSION).encode())
                store.write(batch, sync=True)
            elif version == 1:
                store._upgrade_from_1()
            elif version != FORMAT_VERSION:
                raise StoreError(f"store {path} has format {version}; this version reads "
                                 f"{FORMAT_VERSION} (and upgrades 1)")
        except BaseException:
            store.close()
            raise
        return store

    def _upgrade_from_1(self) -> None:
        """Format 1 kept the wall-clock time of handling under h/ and had no t/ index: index
        every handled id as handled now, on the bus clock (so each is remembered for one
        whole dedupe window more, never less)."""
        now = int(self.get_meta("clock") or b"0")
        batch, n = self.batch(), 0
        for key, _value in self._iter(_H):
            batch.put_handled(key[2:].decode(), now)
            n += 1
            if n % 10_000 == 0:
                self.write(batch, sync=False)
                batch = self.batch()
        batch.put_meta("format", str(FORMAT_VERSION).encode())
        self.write(batch, sync=True)

    @staticmethod
    def repair(path: str | os.PathLike) -> None:
        """LevelDB's repair: rebuild the store from whatever table and log files it can
        read (see maintenance.py for what ``check --repair`` does around it)."""
        try:
            # Without paranoid_checks, repair does not verify block checksums and keeps a
            # damaged table as it is.
            plyvel.repair_db(str(path), paranoid_checks=True)
        except plyvel.Error as exc:
            raise StoreError(f"repair of {path} failed: {exc}") from exc

    def close(self) -> None:
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

    def _writing(self, batches: list[Batch], sync: bool) -> None:
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
        cv = self._write_cv
        with cv:
            if self._failure is not None:
                raise StoreWriteError(f"the store refuses writes since one failed ({self._failure})")
            failures = self._failures
            ticket = next(self._tickets)
            inflight = self._inflight
            inflight.add(ticket)
        try:
            with self._op():
                try:
                    if len(batches) == 1 and not sync and batches[0].generation == self.generation:
                        batches[0]._wb.write()  # the common case: nothing to copy
                    else:
                        merged = self._db.write_batch(sync=sync)
                        for batch in batches:
                            merged.append(batch._wb)
                        merged.write()
                except plyvel.Error as exc:
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
        with cv:
            inflight.discard(ticket)
            if not sync:
                self._unsynced = True  # close() syncs once more (cheaper than knowing if it must)
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

    def sync(self) -> None:
        """Make every earlier unsynced write durable (one fsync of the log)."""
        batch = self.batch()
        batch.put_meta("sync", b"")
        self._writing([batch], True)

    # --- reads -------------------------------------------------------------------------

    def get_meta(self, name: str) -> bytes | None:
        with self._op():
            return self._db.get(_M + name.encode())

    def meta(self, name: str) -> Any:
        """A meta record, decoded and checked (``CorruptRecordError`` if damaged)."""
        key = _M + name.encode()
        value = self.get_meta(name)
        return None if value is None else schema.decode("meta", key, value)

    def bus_clock(self) -> BusClock:
        """The bus clock, continuing from where the store last saved it (clock.py)."""
        return BusClock(self.meta("clock") or 0)

    def _decoded(self, keyspace: str, prefix: bytes) -> Iterator[tuple[bytes, Any]]:
        for key, value in self._iter(prefix):
            yield key, schema.decode(keyspace, key, value)

    def _iter(self, prefix: bytes, **kwargs: Any) -> Iterator[tuple[bytes, bytes]]:
        with self._op():
            it = self._db.iterator(prefix=prefix, **kwargs)
            try:
                yield from it
            finally:
                it.close()

    def count(self, keyspace: str) -> int:
        prefix = KEYSPACES[keyspace]
        with self._op():
            with self._db.iterator(prefix=prefix, include_value=False) as it:
                return sum(1 for _ in it)

    def subscriptions(self) -> Iterator[tuple[str, str, dict]]:
        for key, record in self._decoded("subscriptions", _S):
            sub, topic = _split(key, len(_S))
            yield sub, topic, record

    def intents(self) -> Iterator[tuple[str, str, dict]]:
        for key, record in self._decoded("intents", _I):
            pub, topic = _split(key, len(_I))
            yield pub, topic, record

    def deliveries(self) -> Iterator[tuple[str, str, dict]]:
        for key, record in self._decoded("deliveries", _D):
            peer, stream = _split(key, len(_D))
            yield peer, stream, record

    def stream_names(self) -> list[str]:
        """Names of the outgoing streams that hold messages (one seek per stream)."""
        names: list[str] = []
        with self._op():
            with self._db.iterator(prefix=_O, include_value=False) as it:
                while True:
                    key = next(it, None)
                    if key is None:
                        return names
                    stream = key[len(_O):].partition(SEP)[0]
                    names.append(stream.decode())
                    it.seek(_O + stream + b"\x01")  # past every key of this stream

    def last_stream_id(self, stream: str) -> str | None:
        """The highest id in a stream (one seek)."""
        prefix = _O + stream.encode() + SEP
        with self._op():
            with self._db.iterator(prefix=prefix, reverse=True, include_value=False) as it:
                key = next(it, None)
        return None if key is None else key[len(prefix):].decode()

    def highest_own_id(self) -> str | None:
        """The highest id this bus made that its store still refers to: the last message of
        every outgoing stream, every delivery cursor (which outlive the messages they
        passed), subscription starts and intents. New ids must sort above it (ids.py)."""
        found: list[str] = []
        for stream in self.stream_names():
            last = self.last_stream_id(stream)
            if last:
                found.append(last)
        for _peer, _stream, rec in self.deliveries():
            if rec.get("floor"):
                found.append(rec["floor"])
            found.extend(rec.get("acked") or ())
        found.extend(rec.get("since") or "" for _s, _t, rec in self.subscriptions())
        found.extend(rec.get("id") or "" for _p, _t, rec in self.intents())
        return max(found, default=None) or None

    def iter_stream(
        self, stream: str, after: str | None = None, limit: int | None = None
    ) -> list[tuple[str, bytes]]:
        """Up to ``limit`` (id, packed record) of a stream, in id order, after ``after``."""
        prefix = _O + stream.encode() + SEP
        out: list[tuple[str, bytes]] = []
        with self._op():
            if after is None:
                it = self._db.iterator(prefix=prefix)
            else:
                it = self._db.iterator(
                    start=prefix + after.encode(), include_start=False, stop=_end(prefix)
                )
            with it:
                plen = len(prefix)
                for key, value in it:
                    out.append((key[plen:].decode(), value))
                    if limit is not None and len(out) >= limit:
                        break
        return out

    def stream_ids(self, stream: str, after: str | None = None, upto: str | None = None,
                   limit: int | None = None) -> list[str]:
        """Ids of a stream in (after, upto], without reading the payloads."""
        prefix = _O + stream.encode() + SEP
        kwargs: dict[str, Any] = {"include_value": False}
        # None means "no bound"; "" is a real bound that sorts before every id.
        kwargs["start"] = prefix if after is None else prefix + after.encode()
        kwargs["include_start"] = after is None
        kwargs["stop"] = _end(prefix) if upto is None else prefix + upto.encode()
        kwargs["include_stop"] = upto is not None
        out: list[str] = []
        plen = len(prefix)
        with self._op():
            with self._db.iterator(**kwargs) as it:
                for key in it:
                    out.append(key[plen:].decode())
                    if limit is not None and len(out) >= limit:
                        break
        return out

    def count_stream(self, stream: str, after: str | None = None) -> int:
        prefix = _O + stream.encode() + SEP
        with self._op():
            if after is None:
                it = self._db.iterator(prefix=prefix, include_value=False)
            else:
                it = self._db.iterator(start=prefix + after.encode(), include_start=False,
                                       stop=_end(prefix), include_value=False)
            with it:
                return sum(1 for _ in it)

    def get_outgoing(self, stream: str, message_id: str) -> bytes | None:
        with self._op():
            return self._db.get(_pair(_O, stream, message_id))

    def has_deadletter(self, message_id: str) -> bool:
        with self._op():
            return self._db.get(_X + message_id.encode()) is not None

    def has_incoming(self, message_id: str) -> bool:
        key = message_id.encode()
        with self._op():
            return self._db.get(_N + key) is not None

    def seen_many(self, message_ids: list[str]) -> list[bool]:
        """``seen`` for many ids in one guarded call (the engine checks whole frames).

        The reads follow the order a message moves in (incoming, then handled or dead
        letters, each move one write): read the other way round, a message completing
        between two reads is found in neither, and its resend is handled again."""
        out = []
        with self._op():
            get = self._db.get
            for mid in message_ids:
                key = mid.encode()
                out.append(get(_N + key) is not None or get(_H + key) is not None
                           or get(_X + key) is not None)
        return out

    def seen(self, message_id: str) -> bool:
        """True if the id is stored as incoming, handled (dedupe window) or dead-lettered."""
        return self.seen_many([message_id])[0]

    def get_incoming(self, message_id: str) -> list | None:
        key = _N + message_id.encode()
        with self._op():
            value = self._db.get(key)
        return None if value is None else schema.decode("incoming", key, value)

    def get_runstate(self, message_id: str) -> list | None:
        key = _R + message_id.encode()
        with self._op():
            value = self._db.get(key)
        return None if value is None else schema.decode("runstate", key, value)

    def incoming(self, damaged: list | None = None) -> Iterator[tuple[str, list]]:
        """Incoming messages, in id order. A damaged record raises ``CorruptRecordError``,
        or, if ``damaged`` is a list, is appended to it as (key, raw value) and skipped."""
        if damaged is None:
            for key, record in self._decoded("incoming", _N):
                yield key[len(_N):].decode(), record
            return
        for key, value in self._iter(_N):
            try:
                record = schema.decode("incoming", key, value)
            except CorruptRecordError:
                damaged.append((key, value))
                continue
            yield key[len(_N):].decode(), record

    def handled_before(self, cutoff: int, limit: int) -> list[tuple[str, int]]:
        """(id, handled_at) of handled ids handled before bus-clock ``cutoff``, oldest
        first, at most ``limit``. A damaged index key is deleted on the way (it could
        only ever make an id be remembered too long)."""
        out, bad = [], []
        with self._op():
            with self._db.iterator(start=_T, stop=_T + cutoff.to_bytes(8, "big"),
                                   include_value=False, fill_cache=False) as it:
                for key in it:
                    try:
                        out.append((key[10:].decode(), int.from_bytes(key[2:10], "big")))
                    except UnicodeDecodeError:
                        bad.append(key)
                    if len(out) + len(bad) >= limit:
                        break
        if bad:
            batch = self.batch()
            for key in bad:
                batch.delete_raw(key)
            self.write(batch, sync=False)
        return out

    def segments(self) -> list[tuple[str, int]]:
        """(journal segment file name, bus-clock ms it was written at)."""
        return [(key[2:].decode(), at) for key, at in self._decoded("segments", _G)]

    def deadletters(self) -> Iterator[tuple[str, dict]]:
        for key, record in self._decoded("deadletters", _X):
            yield key[len(_X):].decode(), record

    def replies(self) -> Iterator[tuple[str, list]]:
        for key, record in self._decoded("replies", _Y):
            yield key[len(_Y):].decode(), record

    def journal_records(self, limit: int, max_bytes: int, after: int | None = None) -> list[tuple[int, bytes]]:
        """The oldest journal records (seq, packed events), after seq ``after`` if given: at
        most ``limit`` of them and about ``max_bytes`` (at least one). Read without filling
        the block cache: each is read once, and caching them would grow the heap for nothing."""
        out = []
        size = 0
        start = _J if after is None else _J + (after + 1).to_bytes(8, "big")
        with self._op():
            with self._db.iterator(start=start, stop=_end(_J), fill_cache=False) as it:
                for key, value in it:
                    out.append((int.from_bytes(key[2:], "big"), value))
                    size += len(value)
                    if len(out) >= limit or size >= max_bytes:
                        break
        return out

    def last_journal_seq(self) -> int:
        with self._op():
            with self._db.iterator(prefix=_J, reverse=True, include_value=False) as it:
                key = next(it, None)
        return 0 if key is None else int.from_bytes(key[2:], "big")

    def scan_raw(self, *, verify: bool = False) -> Iterator[tuple[bytes, bytes]]:
        """Every key and value, undecoded. With ``verify``, LevelDB checks every block's
        checksum as it reads (damaged files raise StoreError instead of yielding junk)."""
        if verify:
            yield from self._iter(b"", verify_checksums=True, fill_cache=False)
        else:
            yield from self._iter(b"")

    def compact(self) -> None:
        with self._op():
            self._db.compact_range()

    def size_on_disk(self) -> int:
        """Bytes in the store's files. LevelDB's background compaction deletes files while
        this runs (a CI run met one vanishing between the listing and its stat): those
        count as gone."""
        total = 0
        for p in self.path.iterdir():
            try:
                if p.is_file():
                    total += p.stat().st_size
            except FileNotFoundError:
                continue
        return total
