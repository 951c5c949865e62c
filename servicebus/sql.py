"""An outbox table in the service's own SQL database (extra ``sql``: SQLAlchemy Core).

A service that keeps its data in PostgreSQL, MySQL or SQLite cannot make its database and
the bus's store commit together. The outbox pattern closes that gap: the service writes the
message as a row of an outbox table in the same database transaction as its data, and a
relay moves committed rows into the bus afterwards. Here each relay step is exactly-once:

1. read the oldest rows (``batch`` of them);
2. in one ``bus.transaction()``: publish or send each row, and mark its id in ``bus.kv``;
3. delete the rows from the table, then the marks.

A crash after 2 leaves rows whose mark exists: the next relay deletes them without moving
them again. A crash after the table delete leaves marks whose row is gone: they are removed
at the next start. Rows are moved in id order (per relay step); with several relays on one
table, each row is still moved once (the marks), but they race for the same rows.

``SqlOutbox(bus, engine).start()`` relays every ``interval`` seconds on a thread (and at
once after ``outbox.wake()``); ``relay()`` moves what is there now, on the calling thread.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

try:
    import sqlalchemy as sa
except ImportError as exc:  # the extra is not installed
    raise ImportError("servicebus.sql needs SQLAlchemy: pip install 'servicebus[sql]'") from exc

from .outgoing import check_seconds, prepare_command, prepare_event
from .protocol import decode_payload, encode_payload

__all__ = ["SqlOutbox"]

log = logging.getLogger("servicebus")

EVENT, COMMAND = "event", "command"


class SqlOutbox:
    """``bus``: the bus the rows go to. ``engine``: the service's SQLAlchemy engine.
    ``table_name`` (default ``servicebus_outbox``) in ``metadata`` (a new one by default:
    pass the service's own to have its migrations see the table). ``batch`` (100): rows
    per relay step. ``interval`` (0.5 s): how often ``start()``'s thread looks."""

    def __init__(self, bus: Any, engine: sa.Engine, *, table_name: str = "servicebus_outbox",
                 metadata: sa.MetaData | None = None, batch: int = 100,
                 interval: float = 0.5) -> None:
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise ValueError(f"batch must be a positive int, not {batch!r}")
        check_seconds(interval, "interval")
        self.bus = bus
        self.engine = engine
        self.batch = batch
        self.interval = interval
        self.table = sa.Table(
            table_name, metadata if metadata is not None else sa.MetaData(),
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("kind", sa.String(7), nullable=False),  # event | command
            sa.Column("address", sa.String(512), nullable=True),  # a command's
            sa.Column("topic", sa.String(512), nullable=False),  # an event's topic, a command
            sa.Column("payload", sa.LargeBinary, nullable=False),  # msgpack
            sa.Column("headers", sa.LargeBinary, nullable=True),  # msgpack
            sa.Column("ttl", sa.Float, nullable=True),
        )
        self._mark = f"sb-sql-outbox:{table_name}:"
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.relayed = 0  # rows moved into the bus by this object

    # --- writing, in the service's transaction ---------------------------------------------

    def create_table(self) -> None:
        """Create the table if it does not exist (or let your migrations do it)."""
        self.table.create(self.engine, checkfirst=True)

    def publish(self, conn: sa.Connection, topic: str, payload: Any, *, ttl: float | None = None,
                headers: dict[str, Any] | None = None) -> None:
        """Add an event to the outbox in ``conn``'s transaction: it reaches the bus only if
        that transaction commits. Checked as ``Bus.publish`` checks (errors now, not at
        the relay)."""
        prepare_event(topic, [payload], max_payload=self.bus.config.max_payload, ttl=ttl,
                      headers=headers)
        self._insert(conn, EVENT, None, topic, payload, ttl, headers)

    def send(self, conn: sa.Connection, address: str, command: str, payload: Any, *,
             ttl: float | None = None, headers: dict[str, Any] | None = None) -> None:
        """Add a command for ``address`` to the outbox in ``conn``'s transaction."""
        prepare_command(address, command, payload, max_payload=self.bus.config.max_payload,
                        ttl=ttl, headers=headers)
        self._insert(conn, COMMAND, address, command, payload, ttl, headers)

    def _insert(self, conn: sa.Connection, kind: str, address: str | None, topic: str,
                payload: Any, ttl: float | None, headers: dict[str, Any] | None) -> None:
        conn.execute(self.table.insert().values(
            kind=kind, address=address, topic=topic, payload=encode_payload(payload),
            headers=None if headers is None else encode_payload(headers), ttl=ttl))

    # --- relaying ------------------------------------------------------------------------------

    def relay(self) -> int:
        """Move every row now in the table into the bus; returns how many were moved."""
        moved = 0
        while True:
            n, more = self._step()
            moved += n
            if not more:
                return moved

    def _step(self) -> tuple[int, bool]:
        t = self.table
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(t).order_by(t.c.id).limit(self.batch)).all()
        if not rows:
            return 0, False
        done = [self._mark + str(row.id) in self.bus.kv for row in rows]
        marked = sum(done)
        fresh = [row for row, moved in zip(rows, done) if not moved]
        if fresh:
            with self.bus.transaction() as tx:
                for row in fresh:
                    payload = decode_payload(row.payload)
                    headers = None if row.headers is None else decode_payload(row.headers)
                    if row.kind == COMMAND:
                        tx.send(row.address, row.topic, payload, ttl=row.ttl, headers=headers)
                    else:
                        tx.publish(row.topic, payload, ttl=row.ttl, headers=headers)
                    tx.kv[self._mark + str(row.id)] = True
        if marked:
            log.info("sql outbox %s: %d row(s) moved before a crash were not moved again",
                     t.name, marked)
        ids = [row.id for row in rows]
        with self.engine.begin() as conn:
            conn.execute(t.delete().where(t.c.id.in_(ids)))
        with self.bus.transaction() as tx:
            for i in ids:
                del tx.kv[self._mark + str(i)]
        self.relayed += len(fresh)
        return len(fresh), len(rows) == self.batch

    def forget_stale_marks(self) -> int:
        """Remove marks whose row is gone (a crash between the two deletes); returns how
        many. Run by ``start()``."""
        marks = [key for key, _ in self.bus.kv.items(self._mark)]
        if not marks:
            return 0
        t = self.table
        ids = [int(key[len(self._mark):]) for key in marks]
        with self.engine.connect() as conn:
            present = set(conn.execute(sa.select(t.c.id).where(t.c.id.in_(ids))).scalars())
        stale = [key for key, i in zip(marks, ids) if i not in present]
        if stale:
            with self.bus.transaction() as tx:
                for key in stale:
                    del tx.kv[key]
        return len(stale)

    def wake(self) -> None:
        """Relay now rather than at the next interval (call it after your commit)."""
        self._wake.set()

    def start(self) -> "SqlOutbox":
        """Relay on a thread until ``stop()`` (or the bus closes)."""
        if self._thread is not None:
            raise RuntimeError("this outbox relay is already started")
        self.forget_stale_marks()
        self._thread = threading.Thread(target=self._run, name="servicebus-sql-outbox", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        delay = self.interval
        while not self._stop.is_set() and not self.bus.closed:
            try:
                self.relay()
                delay = self.interval
            except Exception as exc:  # noqa: BLE001 - a database or bus hiccup: try again
                if self._stop.is_set() or self.bus.closed:
                    return
                log.warning("sql outbox %s: relay failed (%s: %s); trying again in %.1fs",
                            self.table.name, type(exc).__name__, exc, delay)
                delay = min(delay * 2, 30.0)
            self._wake.wait(delay)
            self._wake.clear()

    def __enter__(self) -> "SqlOutbox":
        """``with outbox:`` (or ``with outbox.start():``) relays for the block."""
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

