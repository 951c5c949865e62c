"""The outbox table: its columns, the tokens its rows are marked by, and its form.

A table made by an earlier version (before rows had a ``token``) is refused with what to do,
and ``upgrade_table()`` brings it up to this one; both are here, in ``TableForm``, which
``SqlOutbox`` (outbox.py) is made of.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from ..errors import BusError

__all__ = ["OutboxTableError", "TableForm", "TOKEN_LENGTH", "new_token", "outbox_table", "usable", "chunks"]

log = logging.getLogger("servicebus")

TOKEN_LENGTH = 64  # the column's size; the tokens made here are 32 hex digits
_IN_CHUNK = 500  # at most this many values in one IN (...) list


class OutboxTableError(BusError):
    """The outbox table (or what the bus remembers of it) is not in the form this version
    needs: a table made before rows had a ``token``. The message says what to run."""


def new_token() -> str:
    """A row's identity for the relay's marks: random, so it is never given twice."""
    return uuid.uuid4().hex


def outbox_table(table_name: str, metadata: sa.MetaData | None) -> tuple[sa.Table, sa.Index]:
    """The outbox table ``table_name`` in ``metadata`` (a new one if None), and the unique
    index on its ``token``."""
    table = sa.Table(
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
    return table, sa.Index(f"{table_name}_token", table.c.token, unique=True)


def usable(token: Any) -> bool:
    """Whether a row's token can name a mark: a string that fits a kv key and is not
    empty (an empty one would be the same for every row that has it)."""
    return isinstance(token, str) and 0 < len(token) <= TOKEN_LENGTH and "\x00" not in token


def chunks(values: list[Any]) -> list[list[Any]]:
    return [values[i:i + _IN_CHUNK] for i in range(0, len(values), _IN_CHUNK)]


class TableForm:
    """The parts of ``SqlOutbox`` that make the table, check its form and upgrade it."""

    bus: Any
    engine: sa.Engine
    table: sa.Table
    _token_index: sa.Index
    _marks: str  # the prefix of this table's marks in ``bus.kv``
    _legacy: str  # the prefix of the id marks of earlier versions
    _turn: threading.Lock  # relays of this table on this bus take turns (outbox.py)
    _checked: bool  # the table has its token and no id marks are left

    def create_table(self) -> None:
        """Create the table (and the unique index on its ``token``) if it does not exist,
        or let your migrations do it. A table of an earlier version (no ``token``) is left
        as it is, with an ``OutboxTableError`` that says to run ``upgrade_table()``."""
        self.table.create(self.engine, checkfirst=True)
        self._check_table()

    def _give_tokens(self, rows: Sequence[Any]) -> None:
        """Give rows written without a usable token (NULL, empty, too long for a mark, with
        a NUL) one of ours, committed before any mark names it."""
        t = self.table
        with self.engine.begin() as conn:
            for row in rows:
                same = t.c.token.is_(None) if row.token is None else t.c.token == row.token
                conn.execute(t.update().where(t.c.id == row.id, same).values(token=new_token()))

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
                    for chunk in chunks([i for _, i in legacy]):
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
