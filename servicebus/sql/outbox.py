"""``SqlOutbox``: writing rows in the service's transaction, and the relay that moves them
into the bus, exactly once (the package docstring says how).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any
from urllib.parse import quote

import sqlalchemy as sa

from ..model.letters import sql_outbox_letter
from ..model.outgoing import check_seconds, prepare_command, prepare_event
from ..wire.payload import encode_payload
from ..handling.transaction import MAX_KEY_BYTES
from .rows import COMMAND, EVENT, stage
from .table import TOKEN_LENGTH, OutboxTableError, TableForm, chunks, new_token, outbox_table, usable

__all__ = ["SqlOutbox"]

log = logging.getLogger("servicebus")


# One lock per (bus, table): relays of one table on one bus take turns, so one cannot
# read a row while another is between moving it and forgetting its mark (it would find no
# mark and move it again).
_turns: "weakref.WeakKeyDictionary[Any, dict[str, threading.Lock]]" = weakref.WeakKeyDictionary()
_turns_lock = threading.Lock()


def _turn(bus: Any, name: str) -> threading.Lock:
    with _turns_lock:
        try:
            return _turns.setdefault(bus, {}).setdefault(name, threading.Lock())
        except TypeError:  # a bus-like object that takes no weak reference: its own lock
            return threading.Lock()


class SqlOutbox(TableForm):
    """``bus``: the bus the rows go to. ``engine``: the service's SQLAlchemy engine.
    ``table_name`` (default ``servicebus_outbox``) in ``metadata`` (a new one by default:
    pass the service's own to have its migrations see the table). ``batch`` (100): rows
    per relay step. ``interval`` (0.5 s): how often ``start()``'s thread looks.

    The table's ``token`` column (a unique string, made by ``publish``/``send`` and by any
    Core insert into ``outbox.table``) is what the relay's marks name. A row written by
    other means may leave it NULL (the relay gives it one before moving it) or set it to a
    string that is never used again, such as a random UUID; never a value a row had before.
    A table made by an earlier 0.2.0.dev0 (rows marked by id) has no ``token``:
    ``upgrade_table()`` adds it.

    ``relayed`` counts the rows this object moved into the bus as messages, ``deadlettered``
    those that could not be messages and are dead letters in the bus instead (the package
    docstring says which); ``relay()`` returns how many it moved, the latter not counted."""

    def __init__(self, bus: Any, engine: sa.Engine, *, table_name: str = "servicebus_outbox",
                 metadata: sa.MetaData | None = None, batch: int = 100,
                 interval: float = 0.5) -> None:
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise ValueError(f"batch must be a positive int, not {batch!r}")
        check_seconds(interval, "interval")
        # Marks are keyed by the table's name quoted (no ":" left in it), so the marks of
        # table "a" are never under the prefix of table "a:b", nor the other way round.
        self._marks = f"sb-sql-outbox:{quote(table_name, safe='')}:row:"
        if len((self._marks + "x" * TOKEN_LENGTH).encode()) > MAX_KEY_BYTES:
            raise ValueError(f"table_name is too long for the relay's marks: {table_name!r}")
        self._legacy = f"sb-sql-outbox:{table_name}:"  # the id marks of earlier versions
        self.bus = bus
        self.engine = engine
        self.batch = batch
        self.interval = interval
        self.table, self._token_index = outbox_table(table_name, metadata)
        self._turn = _turn(bus, self._marks)
        self._checked = False  # the table has its token and no id marks are left
        self._writable = False  # publish/send found the token column
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.relayed = 0  # rows moved into the bus by this object
        self.deadlettered = 0  # rows that could not be messages: dead letters in the bus

    # --- writing, in the service's transaction ---------------------------------------------

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
        if not self._writable:
            # Once per object: a table of an earlier version gets the error that says what
            # to do, not the database's "no such column".
            try:
                columns = {column["name"] for column in sa.inspect(conn).get_columns(self.table.name)}
            except sa.exc.NoSuchTableError:
                columns = None  # the insert says so
            if columns is not None and "token" not in columns:
                raise OutboxTableError(
                    f"the outbox table {self.table.name!r} has no 'token' column (made by an "
                    f"earlier version): run upgrade_table() once (see the README, 'Transactions')")
            self._writable = columns is not None
        conn.execute(self.table.insert().values(
            token=new_token(), kind=kind, address=address, topic=topic,
            payload=encode_payload(payload),
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
        with self._turn:
            if not self._checked:
                self._check_table()
            t = self.table
            with self.engine.connect() as conn:
                rows = conn.execute(sa.select(t).order_by(t.c.id).limit(self.batch)).all()
            untokened = [row for row in rows if not usable(row.token)]
            if untokened:
                self._give_tokens(untokened)
                return 0, True  # read them again, with their tokens
            marks = {key for key, _ in self.bus.kv.items(self._marks)}
            keys = [self._marks + row.token for row in rows]
            fresh = [row for row, key in zip(rows, keys) if key not in marks]
            letters: list[tuple[Any, str]] = []
            if fresh:
                with self.bus.transaction() as tx:
                    for row in fresh:
                        error = stage(tx, row)
                        if error is not None:
                            # Not left to fail every step after it (DESIGN rule 11): kept
                            # as a dead letter, marked and deleted as a moved row is.
                            tx.stage_deadletter(sql_outbox_letter(t.name, row, error))
                            letters.append((row, error))
                        tx.kv[self._marks + row.token] = row.id
                # In the bus now, whatever happens to the rest.
                self.relayed += len(fresh) - len(letters)
                self.deadlettered += len(letters)
                for row, error in letters:
                    log.error("sql outbox %s: row %s (token %s) cannot be a message and is a dead "
                              "letter in the bus: %s", t.name, row.id, row.token, error)
            if len(fresh) < len(rows):
                log.info("sql outbox %s: %d row(s) moved before a stop were not moved again",
                         t.name, len(rows) - len(fresh))
            if rows:
                with self.engine.begin() as conn:
                    # By token, not id: only the rows read and marked, whatever has the ids.
                    for chunk in chunks([row.token for row in rows]):
                        conn.execute(t.delete().where(t.c.token.in_(chunk)))
            # Marks of other rows: rows moved but not yet deleted (kept), or marks that a
            # stop or a failed write left after their rows were deleted (forgotten now).
            stale = self._gone(sorted(marks.difference(keys)))
            if keys or stale:
                with self.bus.transaction() as tx:
                    for key in keys + stale:
                        del tx.kv[key]
            if stale:
                log.info("sql outbox %s: forgot %d mark(s) of rows deleted before a stop",
                         t.name, len(stale))
            return len(fresh) - len(letters), len(rows) == self.batch

    def _gone(self, keys: list[str]) -> list[str]:
        """Those of the mark ``keys`` whose row is no longer in the table."""
        if not keys:
            return []
        t = self.table
        tokens = [key[len(self._marks):] for key in keys]
        present: set[str] = set()
        with self.engine.connect() as conn:
            for chunk in chunks(tokens):
                present.update(conn.execute(sa.select(t.c.token).where(t.c.token.in_(chunk))).scalars())
        return [key for key, token in zip(keys, tokens) if token not in present]

    def forget_stale_marks(self) -> int:
        """Remove marks whose row is gone (a stop between the two deletes, or a bus that
        could not write then); returns how many. Every relay step does it too."""
        with self._turn:
            stale = self._gone([key for key, _ in self.bus.kv.items(self._marks)])
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
        try:
            with self._turn:
                self._check_table()  # an old table fails here, at once and clearly
        except sa.exc.SQLAlchemyError as exc:  # the database is not there yet: the thread retries
            log.warning("sql outbox %s: cannot look at the table yet (%s: %s)",
                        self.table.name, type(exc).__name__, exc)
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
                delay = min(delay * 2, 30.0)
                # A table in the wrong form needs someone to act: an error, not a hiccup.
                level = logging.ERROR if isinstance(exc, OutboxTableError) else logging.WARNING
                log.log(level, "sql outbox %s: relay failed (%s: %s); trying again in %.2fs",
                        self.table.name, type(exc).__name__, exc, delay)
            self._wake.wait(delay)
            self._wake.clear()

    def __enter__(self) -> "SqlOutbox":
        """``with outbox:`` (or ``with outbox.start():``) relays for the block."""
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


