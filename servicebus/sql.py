"""An outbox table in the service's own SQL database (extra ``sql``: SQLAlchemy Core).

A service that keeps its data in PostgreSQL, MySQL or SQLite cannot make its database and
the bus's store commit together. The outbox pattern closes that gap: the service writes the
message as a row of an outbox table in the same database transaction as its data, and a
relay moves committed rows into the bus afterwards. Here each relay step is exactly-once:

1. read the oldest rows (``batch`` of them);
2. in one ``bus.transaction()``: publish or send each row, and mark its ``token`` in
   ``bus.kv``;
3. delete the rows from the table, then the marks.

A row that cannot be a message (written by other means than ``publish``/``send``: a bad
topic, kind or address, a payload or headers that do not decode, a payload over the bus's
``max_payload``, a bad ttl) is not left to stop every relay step after it: in step 2 it
becomes a dead letter in the bus instead (``bus.deadletters()``, ``servicebus deadletters``:
origin ``sql_outbox``, reason ``invalid``, the error, the table, row id, token and columns,
the payload's bytes), marked and deleted as every moved row is, so exactly once. Replay
leaves such a letter alone (it says why): only a corrected row can be moved.

A crash after 2 leaves rows whose mark exists: the next relay deletes them without moving
them again. A crash (or a bus that cannot write) after the table delete leaves marks whose
row is gone: every later relay step forgets those (``forget_stale_marks``), so they do not
pile up, and they cannot do harm meanwhile: a mark names a row's ``token``, a random
string given to the row when it is written, never its id. Databases hand ids out again
(SQLite when the table is empty, without AUTOINCREMENT; a PostgreSQL sequence restarted,
``TRUNCATE ... RESTART IDENTITY``; any table dropped and made again; MySQL before 8.0
after a restart), and a mark that matched a new row by its id would have it deleted unsent.
Nor does the relay assume that ids come in commit order (a sequence does not promise it,
nor that it has no gaps): it keeps no high-water mark, only a mark per row.

Rows are moved in id order (per relay step). Relays of one table on one bus in one process
take turns (a lock); two relays of one table on two buses do not share marks, so a row can
be moved by both: run one relay per table.

``SqlOutbox(bus, engine).start()`` relays every ``interval`` seconds on a thread (and at
once after ``outbox.wake()``); ``relay()`` moves what is there now, on the calling thread.
"""

from __future__ import annotations

import logging
import threading
import uuid
import weakref
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

try:
    import sqlalchemy as sa
except ImportError as exc:  # the extra is not installed
    raise ImportError("servicebus.sql needs SQLAlchemy: pip install 'servicebus[sql]'") from exc

from .errors import BusError
from .model.letters import sql_outbox_letter
from .model.outgoing import check_seconds, prepare_command, prepare_event
from .wire.payload import decode_payload, encode_payload
from .handling.transaction import MAX_KEY_BYTES

__all__ = ["SqlOutbox", "OutboxTableError"]

log = logging.getLogger("servicebus")

EVENT, COMMAND = "event", "command"
TOKEN_LENGTH = 64  # the column's size; the tokens made here are 32 hex digits
_IN_CHUNK = 500  # at most this many values in one IN (...) list


class OutboxTableError(BusError):
    """The outbox table (or what the bus remembers of it) is not in the form this version
    needs: a table made before rows had a ``token``. The message says what to run."""


def new_token() -> str:
    """A row's identity for the relay's marks: random, so it is never given twice."""
    return uuid.uuid4().hex


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


class SqlOutbox:
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
    those that could not be messages and are dead letters in the bus instead (the module
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
        self.table = sa.Table(
            table_name, metadata if metadata is not None else sa.MetaData(),
            # BIGINT on the databases that have one (a busy outbox outlives 2**31 ids);
            # SQLite's rowid is 64-bit already and needs the word INTEGER.
            sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
                      primary_key=True, autoincrement=True),
            # What the relay's marks name; NULL only in an upgraded table (rows an older
            # writer still adds): the relay gives those one before moving them.
            sa.Column("token", sa.String(TOKEN_LENGTH), nullable=False, default=new_token),
            sa.Column("kind", sa.String(7), nullable=False),  # event | command
            sa.Column("address", sa.String(512), nullable=True),  # a command's
            sa.Column("topic", sa.String(512), nullable=False),  # an event's topic, a command
            sa.Column("payload", sa.LargeBinary, nullable=False),  # msgpack
            sa.Column("headers", sa.LargeBinary, nullable=True),  # msgpack
            sa.Column("ttl", sa.Float, nullable=True),
            # SQLite then never hands an id out twice (while the table lives): not what
            # exactly-once rests on (the tokens are), but ids in logs stay unambiguous.
            sqlite_autoincrement=True,
        )
        self._token_index = sa.Index(f"{table_name}_token", self.table.c.token, unique=True)
        self._turn = _turn(bus, self._marks)
        self._checked = False  # the table has its token and no id marks are left
        self._writable = False  # publish/send found the token column
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.relayed = 0  # rows moved into the bus by this object
        self.deadlettered = 0  # rows that could not be messages: dead letters in the bus

    # --- writing, in the service's transaction ---------------------------------------------

    def create_table(self) -> None:
        """Create the table (and the unique index on its ``token``) if it does not exist,
        or let your migrations do it. A table of an earlier version (no ``token``) is left
        as it is, with an ``OutboxTableError`` that says to run ``upgrade_table()``."""
        self.table.create(self.engine, checkfirst=True)
        self._check_table()

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
            untokened = [row for row in rows if not _usable(row.token)]
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
                        error = _stage(tx, row)
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
                    for chunk in _chunks([row.token for row in rows]):
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
            for chunk in _chunks(tokens):
                present.update(conn.execute(sa.select(t.c.token).where(t.c.token.in_(chunk))).scalars())
        return [key for key, token in zip(keys, tokens) if token not in present]

    def _give_tokens(self, rows: Sequence[Any]) -> None:
        """Give rows written without a usable token (NULL, empty, too long for a mark, with
        a NUL) one of ours, committed before any mark names it."""
        t = self.table
        with self.engine.begin() as conn:
            for row in rows:
                same = t.c.token.is_(None) if row.token is None else t.c.token == row.token
                conn.execute(t.update().where(t.c.id == row.id, same).values(token=new_token()))

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

    # --- the table's form ----------------------------------------------------------------------

    def _columns(self) -> set[str] | None:
        inspector = sa.inspect(self.engine)
        if not inspector.has_table(self.table.name):
            return None
        return {column["name"] for column in inspector.get_columns(self.table.name)}

    def _legacy_marks(self) -> list[tuple[str, int]]:
        """Marks an earlier version left (``sb-sql-outbox:TABLE:ID``), with their ids."""
        n = len(self._legacy)
        return [(key, int(key[n:])) for key, _ in self.bus.kv.items(self._legacy)
                if key[n:].isdigit()]

    def _check_table(self) -> None:
        """Refuse, with what to do, a table without ``token`` or an earlier version's marks
        (they name ids, which this version no longer trusts): never relay on a guess."""
        columns = self._columns()
        if columns is None:
            return  # not made yet (migrations may be on their way): the select will say
        if "token" not in columns:
            raise OutboxTableError(
                f"the outbox table {self.table.name!r} has no 'token' column: it was made by an "
                f"earlier version, whose relay could delete rows unsent. Stop its relays and run "
                f"SqlOutbox(bus, engine, table_name={self.table.name!r}).upgrade_table() once "
                f"(it adds the column; see the README, 'Transactions')")
        legacy = self._legacy_marks()
        if legacy:
            raise OutboxTableError(
                f"the bus holds {len(legacy)} mark(s) of the outbox table {self.table.name!r} "
                f"made by an earlier version (by row id): run upgrade_table() once to carry "
                f"them over")
        self._checked = True

    def upgrade_table(self) -> int:
        """Bring a table made by an earlier version (0.2.0.dev0 before rows had a token) up
        to this one, in place; returns how many rows were given a token. Adds the ``token``
        column (NULL allowed: older writers may go on adding rows meanwhile, and the relay
        gives those a token) with its unique index, gives every row a token, and carries
        the old marks (by id) over: a row the old relay had moved but not deleted keeps its
        mark (it is deleted without being moved again, as the old relay would have done), a
        mark whose row is gone is dropped. Stop every relay of the table first, the old
        ones above all (they would go on marking ids). Safe to run again, and on a table
        that needs nothing."""
        with self._turn:
            t = self.table
            columns = self._columns()
            if columns is None:
                raise OutboxTableError(f"there is no outbox table {t.name!r} to upgrade")
            if "token" not in columns:
                dialect = self.engine.dialect
                kind = sa.String(TOKEN_LENGTH).compile(dialect=dialect)
                with self.engine.begin() as conn:
                    conn.execute(sa.text(
                        f"ALTER TABLE {dialect.identifier_preparer.format_table(t)} "
                        f"ADD COLUMN {dialect.identifier_preparer.quote('token')} {kind}"))
                    self._token_index.create(conn)
            with self.engine.connect() as conn:
                untokened = conn.execute(sa.select(t.c.id, t.c.token).where(t.c.token.is_(None))).all()
            self._give_tokens(untokened)
            legacy = self._legacy_marks()
            if legacy:
                tokens: dict[int, str] = {}
                with self.engine.connect() as conn:
                    for chunk in _chunks([i for _, i in legacy]):
                        for i, token in conn.execute(sa.select(t.c.id, t.c.token)
                                                     .where(t.c.id.in_(chunk))):
                            tokens[i] = token
                with self.bus.transaction() as tx:
                    for key, i in legacy:
                        if i in tokens:
                            tx.kv[self._marks + tokens[i]] = i
                        del tx.kv[key]
                kept = sorted(i for _, i in legacy if i in tokens)
                if kept:
                    log.warning("sql outbox %s: rows %s were marked as moved by an earlier "
                                "version and will be deleted without being moved again",
                                t.name, kept)
            self._checked = False
            self._check_table()
            return len(untokened)

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


def _stage(tx: Any, row: Any) -> str | None:
    """Stage the message ``row`` holds in ``tx``; or, if it cannot be one, say why (nothing
    staged). Checked as ``publish``/``send`` check: what they refuse, a row cannot carry."""
    kind, payload, headers = row.kind, row.payload, row.headers
    if kind != EVENT and kind != COMMAND:
        return f"kind must be {EVENT!r} or {COMMAND!r}, not {str(kind)[:40]!r}"
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        return f"payload must be bytes (msgpack), not {type(payload).__name__}"
    try:
        value = decode_payload(bytes(payload))
    except Exception as exc:  # noqa: BLE001 - msgpack raises many types on junk
        return f"payload does not decode: {type(exc).__name__}: {exc}"
    if headers is not None:
        if not isinstance(headers, (bytes, bytearray, memoryview)):
            return f"headers must be bytes (msgpack) or NULL, not {type(headers).__name__}"
        try:
            headers = decode_payload(bytes(headers))
        except Exception as exc:  # noqa: BLE001
            return f"headers do not decode: {type(exc).__name__}: {exc}"
    try:
        if kind == COMMAND:
            tx.send(row.address, row.topic, value, ttl=row.ttl, headers=headers)
        else:
            tx.publish(row.topic, value, ttl=row.ttl, headers=headers)
    except (TypeError, ValueError) as exc:  # the checks' (BacklogFull and the like go on up)
        return str(exc)
    return None


def _usable(token: Any) -> bool:
    """Whether a row's token can name a mark: a string that fits a kv key and is not
    empty (an empty one would be the same for every row that has it)."""
    return isinstance(token, str) and 0 < len(token) <= TOKEN_LENGTH and "\x00" not in token


def _chunks(values: list[Any]) -> list[list[Any]]:
    return [values[i:i + _IN_CHUNK] for i in range(0, len(values), _IN_CHUNK)]
