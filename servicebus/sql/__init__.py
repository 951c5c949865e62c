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

try:
    import sqlalchemy  # noqa: F401 - here, so that every module of the package can use it plainly
except ImportError as exc:  # the extra is not installed
    raise ImportError("servicebus.sql needs SQLAlchemy: pip install 'servicebus[sql]'") from exc

# The package's parts (each module's docstring says what it holds): outbox.py, SqlOutbox
# (writing rows, relaying them); table.py, the table, its tokens and its form; rows.py, a
# row as a message. The names below were all importable from the single module it was.
from .outbox import SqlOutbox
from .rows import COMMAND as COMMAND, EVENT as EVENT
from .table import TOKEN_LENGTH as TOKEN_LENGTH, OutboxTableError, new_token as new_token

__all__ = ["SqlOutbox", "OutboxTableError"]
