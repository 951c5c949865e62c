"""The delivery journal: what happened to every message, as durable as the change itself.

Each event is a tuple ``(event, ts_ms, message_id, topic, kind, peer, attempt, error, ids)``
(model/stored.py's ``Event``; records written before store format 3 have no ``ids``).
Events are written into the same atomic LevelDB batch as the state change they describe
(one ``j/<seq>`` record holds all the events of one batch, so the cost is one key per
engine turn, not one per event), and never fsynced on their own: they are exactly as
durable as that change. A background thread moves closed ranges out to segment files
``DATADIR/journal/<node>-<first seq>.jcol`` (written to a temporary file, fsynced,
renamed, then deleted from LevelDB), deletes segments older than the retention, and
``close()`` flushes whatever is left. After a crash the next start (or
``servicebus journal flush``) moves what the crash left in LevelDB.

A segment, once written, is never written again, across power cuts too (the incremental
audit reads each once, by name). Each move: the segment is written to a temporary file
and fsynced; a synced write names the segment and the records it holds (which also makes
those records durable: they can no longer vanish from the store while their segment
exists, nor their numbers be reused); the file is renamed; a synced write deletes the
records and the intent. A cut between the last two leaves the intent and the file: the
next flush deletes the records named in the intent and does not write the file again.

Segment files are JSON lines in columns (segments.py: a line per batch of events, what
repeats from event to event written once per line); segments written before are JSON lines
of one event each (``.jsonl``), read everywhere as before. Either way an event has ``event,
ts, node, address, id, topic, kind, peer, attempt, role`` and ``error`` (none for most):
the audit job's input. ``role`` says on which side of the delivery the event happened:
``sender`` (``peer`` is the receiver) or ``receiver`` (``peer`` is the sender);
``expired`` and ``replayed`` occur on either side. An event about several messages (those
of one stored segment) is one event per message in the file.

Beside the segments, ``<node>.bus.json`` says who this journal belongs to: the bus's data
directory and, per address it has journaled from, its service name (``Bus(name=...)``, null
for none), so that the audit can name the services behind addresses and point its commands
at data directories. The lines do not carry the name: that would repeat it on every line,
and older journals (without the file) must read as before.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import msgpack

from ..model.clock import BusClock
from ..model.packer import pack
from ..store import Batch, Store
from ..model.stored import Event
from .base import BusView, Hook
from .segments import COLUMNS, Columns, is_segment

__all__ = ["Journal", "flush_datadir"]

log = logging.getLogger("servicebus")

FLUSH_INTERVAL = 1.0
RETENTION_CHECK = 60.0
FLUSH_CHUNK = 2000  # journal records (each holding many events) per segment file at most
# ... and about this many packed bytes: a flush that fell behind (a busy process) must not
# read a backlog of millions of events into memory at once.
FLUSH_BYTES = 1 << 20
ADDRESSES_KEPT = 100  # in <node>.bus.json: a bus on a new port at every start must not grow it
BUS_FILE_MAX = 1 << 20  # bytes: a larger <node>.bus.json is not this bus's (it writes ~10 KB at most)
PENDING = "journal_pending"  # meta: [segment name, its records' seqs] while it is moved


def _addresses(path: Path) -> dict[str, str | None]:
    """The addresses an earlier start wrote to ``path``; {} for none, or for a file that is
    not one (a power cut, a hand edit, another program's): it is then written anew."""
    try:
        if path.stat().st_size > BUS_FILE_MAX:
            return {}
        known = json.loads(path.read_text(encoding="utf-8")).get("addresses")
    except (OSError, ValueError, AttributeError):
        return {}
    if not isinstance(known, dict):
        return {}
    return {str(a): n if n is None or isinstance(n, str) else str(n) for a, n in known.items()}


class Journal(Hook):
    """Records events into batches and moves them out to segment files. A hook of the
    bus when ``journal=True`` (the default); offline tools use it directly."""

    def __init__(self, store: Store, datadir: Path, node_id: str, address: str, *,
                 enabled: bool = True, retention: float = 7 * 86400.0,
                 clock: BusClock | None = None, name: str | None = None) -> None:
        self.store = store
        self.name = name
        # Retention counts the bus's own running time, not the wall clock (clock.py).
        self.clock = clock if clock is not None else store.bus_clock()
        self.dir = Path(datadir) / "journal"
        self.node_id = node_id
        self.address = address
        self.enabled = enabled
        self.retention = retention
        # Continue after everything ever recorded here, flushed or not: segment files are
        # named by their first sequence number, so reusing one would overwrite a segment.
        # Every segment's records were durable in the store, or its move's intent was,
        # before the file existed (see flush), so these three bound every number in use.
        flushed = int(store.get_meta("journal_flushed") or b"0")
        pending = self._pending()
        # next() on itertools.count is atomic: the engine and the workers share it.
        self._seq = itertools.count(max(store.last_journal_seq(), flushed,
                                        pending[1][-1] if pending else 0) + 1)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._flush_lock = threading.Lock()

    # --- recording ---------------------------------------------------------------------

    def record(self, batch: Batch | None, events: Sequence[Event]) -> None:
        """Add ``events`` to ``batch``: they become durable exactly when it does."""
        if self.enabled and events and batch is not None:
            batch.put_journal(next(self._seq), pack(events))

    events = record  # the hook: every event the bus makes, in the batch it rides in

    def attach(self, bus: BusView) -> None:
        self.start()  # its first flush moves what a crash left behind

    def detach(self) -> None:
        """After the engine's last write: stop the thread, flush what is left."""
        if not self.started:
            return
        self.stop()
        try:
            self.flush()  # every remaining record goes to segment files
        except Exception as exc:  # noqa: BLE001 - they stay in LevelDB for the next start
            log.error("journal flush at close failed: %s", exc)

    # --- moving out to segment files -----------------------------------------------------

    def start(self) -> None:
        if not self.enabled:
            return
        self.describe()
        self._thread = threading.Thread(target=self._run, name="servicebus-journal", daemon=True)
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def stop(self) -> None:
        """Stop the background thread (the caller flushes once more after its last write)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        next_retention = 0.0
        failing = False
        while True:
            try:
                self.flush()
                if time.monotonic() >= next_retention:
                    next_retention = time.monotonic() + RETENTION_CHECK
                    self.apply_retention()
                if failing:
                    log.info("journal flushes work again")
                failing = False
            except Exception as exc:  # noqa: BLE001 - keep journaling; the records stay in LevelDB
                if not failing:  # once per run of failures (a full disk fails every second)
                    log.error("journal flush failed (%s); retrying every %.0fs", exc, FLUSH_INTERVAL)
                failing = True
            if self._stop.wait(FLUSH_INTERVAL):
                return

    def flush(self) -> int:
        """Move every journal record now in LevelDB to segment files; return events moved
        (one per message a line names)."""
        moved = 0
        with self._flush_lock:
            pending = self._pending()
            if pending is not None and (self.dir / pending[0]).exists():
                self._moved(*pending)  # a cut came after its file, before its delete
            while True:
                records = self.store.journal_records(FLUSH_CHUNK, FLUSH_BYTES)
                if not records:
                    return moved
                tmp, events, seqs = self._write_segment(records)
                name = tmp.name[:-len(".tmp")]
                # Fsynced before the file has its name: the intent, and with it (the log is
                # synced up to here) every record the file holds. A power cut may drop
                # unsynced writes: a record in a segment must not be one of them, or the next
                # start would number new records with its sequence number and write their
                # segment over this one (measured: 49 of 50 moved events lost).
                batch = self.store.batch()
                batch.put_meta(PENDING, msgpack.packb([name, seqs]))
                self.store.write(batch, sync=True)
                os.replace(tmp, self.dir / name)
                dir_fd = os.open(self.dir, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)  # the rename itself must survive a crash before we delete
                finally:
                    os.close(dir_fd)
                moved += events
                self._moved(name, seqs)
                if len(seqs) < FLUSH_CHUNK:
                    # Everything there was when this segment was read. What came since waits
                    # for the next flush: under a steady stream this loop would otherwise go on
                    # writing a segment of a few records, with three fsyncs, after every one.
                    return moved

    def describe(self) -> None:
        """Write ``<node>.bus.json``: this address's service name added to those of earlier
        starts (their segments still name those addresses). Best effort: the audit only
        loses a name without it, and a bus must not fail to start over it."""
        path = self.dir / f"{self.node_id}.bus.json"
        tmp = path.with_suffix(".tmp")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            known = _addresses(path)
            known.pop(self.address, None)  # re-added last: the newest are kept
            known[self.address] = self.name
            data = {"node": self.node_id, "datadir": str(self.dir.parent.resolve()),
                    "addresses": dict(list(known.items())[-ADDRESSES_KEPT:])}
            # Written whole, synced, then renamed over the old one: a crash or a full disk
            # leaves the old file or the new one, never half of one.
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(json.dumps(data, indent=1) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except (OSError, ValueError) as exc:
            log.warning("cannot write %s (the audit will show no service name): %s", path, exc)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass

    def _pending(self) -> tuple[str, list[int]] | None:
        """The segment being moved when the bus stopped, if its delete did not happen."""
        raw = self.store.get_meta(PENDING)
        if not raw:
            return None
        name, seqs = msgpack.unpackb(raw, raw=False)
        return name, seqs

    def _moved(self, name: str, seqs: list[int]) -> None:
        """Delete the records a segment file now holds, and the intent. Fsynced, so that a
        later intent never survives a cut that this delete did not (LevelDB starts a new
        log file now and then: a write to the new one is fsynced without the old one)."""
        batch = self.store.batch()
        batch.put_segment(name, self.clock.now())
        for seq in seqs:
            batch.delete_journal(seq)
        batch.put_meta("journal_flushed", str(max(
            seqs[-1], int(self.store.get_meta("journal_flushed") or b"0"))).encode())
        batch.put_meta(PENDING, b"")
        self.store.write(batch, sync=True)

    def _write_segment(self, records: list[tuple[int, bytes]]) -> tuple[Path, int, list[int]]:
        """Write one segment of up to FLUSH_CHUNK records, starting with ``records`` and
        reading on about FLUSH_BYTES at a time (one fsync per segment, and a heap that stays
        flat however far behind the flush is), to its temporary file, fsynced; return that
        file, how many events it holds (one per message) and the sequence numbers it took.
        Columnar lines (segments.py): a line per LINE_EVENTS events, whatever the records."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f"{self.node_id}-{records[0][0]:012d}{COLUMNS}.tmp"
        seqs: list[int] = []
        columns = Columns(self.node_id, self.address)
        with open(tmp, "w", encoding="utf-8") as fh:
            while records:
                for seq, packed in records:
                    seqs.append(seq)
                    try:
                        # Unpacked directly, not through schema.py: this runs for every
                        # event, and a shape check per event cost a visible share of it.
                        columns.add(msgpack.unpackb(packed, raw=False))
                    except Exception:  # noqa: BLE001 - any damage: set it aside and go on
                        self._set_aside(seq, packed)
                        continue
                fh.writelines(columns.lines())
                room = FLUSH_CHUNK - len(seqs)
                records = self.store.journal_records(room, FLUSH_BYTES, after=seqs[-1]) if room > 0 else []
            fh.flush()
            os.fsync(fh.fileno())
        return tmp, columns.events, seqs

    def _set_aside(self, seq: int, packed: bytes) -> None:
        """A journal record that does not decode is kept, raw, beside the segments (never
        read by the audit) and the flush goes on: one bad record must not stop the journal."""
        path = self.dir / f"{self.node_id}-{seq:012d}.damaged"
        path.write_bytes(packed)
        log.error("journal record %d is damaged: its raw bytes are in %s", seq, path)

    def apply_retention(self) -> int:
        """Delete segments written more than ``retention`` ago on the bus clock; return how
        many. A segment the store has no time for (written by an older version, or copied
        in) starts counting now."""
        if not self.dir.is_dir():
            return 0
        now = self.clock.now()
        cutoff = now - int(self.retention * 1000)
        written = dict(self.store.segments())
        batch, removed = self.store.batch(), 0
        for path in sorted(p for p in self.dir.iterdir() if is_segment(p.name)):
            at = written.pop(path.name, None)
            if at is None:
                batch.put_segment(path.name, now)
            elif at < cutoff:
                path.unlink(missing_ok=True)
                batch.delete_segment(path.name)
                removed += 1
        for gone in written:  # deleted by hand: forget it
            batch.delete_segment(gone)
        self.store.write(batch, sync=False)
        return removed


def flush_datadir(store: Store, datadir: Path) -> int:
    """Move a stopped bus's leftover journal records to segment files."""
    node = store.get_meta("node")
    address = store.get_meta("address")
    journal = Journal(store, datadir, node.decode() if node else "unknown",
                      address.decode() if address else "")
    return journal.flush()
