"""What a running handler stages with ``message.kv``/``publish``/``send``, and the write
that commits it with the handler's outcome.

Everything staged goes into the write that records the run (the completion, or the "done"
mark of one of several handlers), only if the handler returns. With anything staged that
write goes through the publishers' group commit (fsynced, event ids made in commit order,
as ``publish`` does): later durable writes depend on it (see ``commit``). Commands go to
the outbox keyspace in it, and the engine moves them into their streams.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from ..errors import TransactionError
from ..model.stored import Incoming, OutboxSend, Progress
from .transaction import StagedEvent, Transaction
from .writes import RunStore, RunWriter

__all__ = ["Staging", "Publisher", "UpdateFailed"]


class Publisher(Protocol):
    """What a handler's transaction needs from the publish path (engine/publisher.py)."""

    def commit_transaction(self, events: list[StagedEvent], rest: Callable[[Any], bool]) -> bool:
        """Store ``events`` and whatever ``rest(batch)`` adds in one fsynced write shared
        with publishers; returns what ``rest`` returned."""

    def queue_sends(self, sends: list[tuple[str, OutboxSend]]) -> None:
        """Move these outbox commands (stored) into their streams."""

    def backpressure(self, topic: str, priority: int) -> None:
        """As a publish to ``topic`` would: wait for room, or raise ``BacklogFull``."""


class UpdateFailed(Exception):
    """A ``message.kv.update`` function raised at the commit: the run failed."""


Outgoing = Callable[[str, str, "dict[str, Any] | None"], "dict[str, Any] | None"]


class Staging:
    """The transactions of running handlers, by message id (what ``Message`` reaches)."""

    def __init__(self, store: RunStore, writer: RunWriter, max_payload: int) -> None:
        self._store = store
        self._writer = writer
        self._max_payload = max_payload
        # message id -> its handler's transaction while the handler runs (None: nothing staged)
        self._txs: dict[str, Transaction | None] = {}
        self.publisher: Publisher | None = None  # the bus's publish path, once made
        self.kv_lock = threading.Lock()  # one kv update() at a time (shared with bus.kv)
        self.outgoing: Outgoing | None = None  # the hooks' say on staged headers (tracing)

    # --- while a handler runs ---------------------------------------------------------------

    def open(self, message_id: str) -> None:
        """``message.kv``/``publish``/``send`` work from now on for this message ..."""
        self._txs[message_id] = None

    def close(self, message_id: str) -> Transaction | None:
        """... until now: what it staged (None: nothing)."""
        return self._txs.pop(message_id, None)

    def run_transaction(self, message_id: str) -> Transaction:
        """The transaction of ``message_id``'s handler, which must be running."""
        try:
            tx = self._txs[message_id]
        except KeyError:
            raise TransactionError(
                "message.kv, message.publish and message.send work only while the message's "
                "handler runs: they are stored with its completion") from None
        if tx is None:
            admit = None if self.publisher is None else self.publisher.backpressure
            tx = self._txs[message_id] = Transaction(self._store, self._max_payload,
                                                     self.outgoing, admit)
        return tx

    def stage_event(self, message_id: str, topic: str, payload: Any, **options: Any) -> None:
        self.run_transaction(message_id).publish(topic, payload, **options)

    def stage_send(self, message_id: str, address: str, command: str, payload: Any,
                   **options: Any) -> None:
        self.run_transaction(message_id).send(address, command, payload, **options)

    # --- the run's write ----------------------------------------------------------------------

    def commit(self, build: Callable[[Any], None], message_id: str, finished: bool,
               nxt: Incoming | None, tx: Transaction | None, part: str, taken: str | None = None,
               progress: tuple[str, Progress] | None = None) -> bool:
        """``RunWriter.record`` a run's outcome with what its handler staged. Outbox keys
        are the message's id and ``part`` (the handler's name): apart for every message
        and every handler of it. ``finished``: this write takes the message out of the
        incoming store. Raises ``UpdateFailed`` if a kv update function raised: nothing
        was written. ``taken``: the key of a segment of several this write takes out (not
        the message's own id)."""
        done = message_id if finished else taken
        if tx is None or tx.empty():
            return self._writer.record(build, done, nxt, progress=progress)
        if tx.updates:
            with self.kv_lock:  # held until written: the next update reads this one's value
                try:
                    tx.resolve_updates()
                except Exception as exc:
                    raise UpdateFailed(f"{type(exc).__name__}: {exc}") from exc
                return self._commit_staged(build, message_id, done, nxt, tx, part)
        return self._commit_staged(build, message_id, done, nxt, tx, part)

    def _commit_staged(self, build: Callable[[Any], None], mid: str, finished: str | None,
                       nxt: Incoming | None, tx: Transaction, part: str) -> bool:
        sends: list[tuple[str, OutboxSend]] = []

        def full(batch: Any) -> None:
            build(batch)
            tx.write_state(batch)
            sends[:] = tx.write_sends(batch, mid, part)

        publisher = self.publisher
        after = None
        if tx.sends:
            if publisher is None:
                raise TransactionError("this bus cannot send from a handler's transaction")
            after = lambda: publisher.queue_sends(sends)  # noqa: E731
        if publisher is None:
            if tx.events:
                raise TransactionError("this bus cannot publish from a handler's transaction")
            return self._writer.record(full, finished, nxt, after=after, synced=self._writer.synced_write)
        # Fsynced, like events, also when it holds only kv writes or commands: an unsynced
        # write is harmless to lose only if nothing durable comes to depend on it, and here
        # something does (the next kv update reads this one's value; the engine moves the
        # commands into their streams with a synced write). LevelDB does not lose only a
        # suffix of unsynced writes: when its memtable fills it closes its log without an
        # fsync and starts another, whose synced writes can survive a power cut that the old
        # log's tail does not (tests/integration/test_power_loss.py: kv counts 33 too high,
        # commands sent twice). Shared through the group commit like a publish.
        events = tx.events
        return self._writer.record(full, finished, nxt, after=after,
                                   synced=lambda rest: publisher.commit_transaction(events, rest))
