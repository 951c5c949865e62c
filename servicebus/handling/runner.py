"""Running one received message: its handlers, retries, dead letter, reply, and the
writes that record each outcome.

- Before a handler runs, the attempt count is written (unsynced; it survives SIGKILL), so a
  message that crashes the process is eventually dead-lettered instead of looping forever.
  The write that finishes one message also marks the next one of a worker's run started.
- The moment every handler for a message has returned, the message moves from incoming to
  handled in one write from the worker thread itself (DESIGN.md section 9: deferring that
  to the engine turns crashes into duplicate handling).
- A handler that raises is retried with backoff; after ``max_attempts`` the message moves
  to the dead letters with the exception type and text, atomically.
- A request's handler is run once; its return value or exception is the reply.
- What a handler stages with ``message.kv``/``publish``/``send`` (transaction.py) goes
  into the write that records its run: the completion, or the "done" mark of one of
  several handlers. With anything staged, that write goes through the publishers' group
  commit (fsynced, ids made in commit order, as ``publish`` does): later durable writes
  depend on it (see _commit_staged). Commands go to the outbox keyspace in it, and the
  engine moves them into their streams. A run that staged nothing is recorded unsynced:
  a power cut may rerun it (the engine syncs within SYNC_INTERVAL, engine.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from ..model.clock import BusClock, wall_ms
from ..model.config import BusConfig
from ..core.state import Incoming
from ..model.delivery import backoff
from ..errors import Reject, Retry, StoreError, TransactionError
from .handlers import Handler, Handlers
from ..hooks.journal import Journal
from ..model.letters import incoming_letter
from ..wire.payload import decode_payload, encode_payload
from ..wire.protocol import KIND_NAMES, Kind
from ..model.records import Message
from ..model.stored import NO_RUNS, JournalEvent, OutboxSend, ReplyRecord, RunState
from .transaction import StagedEvent, Transaction
from .requests import PendingRequests
from ..store import Store

__all__ = ["Runner", "Publisher", "RECENT", "STORE_RETRY"]

log = logging.getLogger("servicebus")

# Finishing writes kept to redo after a reopen (see Runner.record). Only those that returned
# between a failed write and its failure being recorded can be dropped: a few per worker.
# Dead letters and replies keep their payload, so this also bounds that memory.
RECENT = 64
_tuple = tuple.__new__  # NamedTuples built per message skip their keyword-parsing __new__
STORE_RETRY = 0.5  # seconds before a message whose start could not be written is tried again


class Publisher(Protocol):
    """What a handler's transaction needs from the engine (engine.py implements it)."""

    def commit_transaction(self, events: list[StagedEvent], rest: Callable[[Any], bool]) -> bool:
        """Store ``events`` and whatever ``rest(batch)`` adds in one fsynced write shared
        with publishers; returns what ``rest`` returned."""

    def queue_sends(self, sends: list[tuple[str, OutboxSend]]) -> None:
        """Move these outbox commands (stored) into their streams."""

    def backpressure(self, topic: str, priority: int) -> None:
        """As a publish to ``topic`` would: wait for room, or raise ``BacklogFull``."""


def _failed_text(exc: BaseException) -> str:
    """The error recorded for a handler run that raised ``exc``.

    Every exception a handler raises fails that attempt, ``BaseException`` included
    (``SystemExit``, ``KeyboardInterrupt``): the message is retried, then dead-lettered,
    like any other. Letting it through would not stop the process (raised on a worker
    thread, Python only ends that thread) but would strand the message: neither done
    nor retried, and its ordered lane let go. Ask for a stop another way (close the bus
    from the main thread)."""
    if not isinstance(exc, Exception):
        log.error("a handler raised %s, which is not an Exception: that attempt failed; the bus "
                  "does not end the process from a handler thread", type(exc).__name__)
    return f"{type(exc).__name__}: {exc}"


class _UpdateFailed(Exception):
    """A ``message.kv.update`` function raised at the commit: the run failed."""


def _event(name: str, item: Incoming, attempts: int, error: str | None = None) -> JournalEvent:
    record = item.record
    return (name, wall_ms(), item.id, record.topic, KIND_NAMES.get(record.kind, "event"),
            record.reply_to, attempts, error)


class Runner:
    def __init__(self, store: Store, config: BusConfig, handlers: Handlers, *,
                 requests: PendingRequests, on_reply: Callable[[str, ReplyRecord], None],
                 journal: Journal, clock: BusClock,
                 park: Callable[[tuple[int, str], int | None], None],
                 closing: Callable[[], bool]) -> None:
        self._store = store
        self._config = config
        self._handlers = handlers
        self._requests = requests
        self._on_reply = on_reply  # hands a stored reply to the engine for sending
        self._journal = journal
        self._clock = clock  # handled ids are stamped with it: the dedupe window counts it
        self._park = park  # no handler yet: the message waits in the store (dispatch.py)
        # (topic, seconds) of each handler run, for metrics.py; None: not timed at all
        self.observe: Callable[[str, float], None] | None = None
        self._closing = closing
        self._lock = threading.Lock()
        self._recent: OrderedDict[str, tuple[Callable[[Any], None], Callable[[], None] | None]] = OrderedDict()
        self._tls = threading.local()
        # message id -> its handler's transaction while the handler runs (None: nothing staged)
        self._txs: dict[str, Transaction | None] = {}
        self.requests_expired = 0  # requests dropped here unrun: past their caller's timeout
        self.publisher: Publisher | None = None  # the engine, once made
        self.kv_lock = threading.Lock()  # one kv update() at a time (shared with bus.kv)
        self.inject: Callable[[dict[str, Any] | None], dict[str, Any] | None] | None = None  # tracing

    def redo_for(self, message_id: str) -> Callable[[], None] | None:
        """Writes ``message_id``'s finishing write again, if it was among the last RECENT made."""
        with self._lock:
            found = self._recent.get(message_id)
        if found is None:
            return None
        build, after = found

        def redo() -> None:
            self.record(build, message_id, after=after)
        return redo

    # --- a handler's transaction --------------------------------------------------------

    def transaction(self, message_id: str) -> Transaction:
        """The transaction of ``message_id``'s handler, which must be running."""
        try:
            tx = self._txs[message_id]
        except KeyError:
            raise TransactionError(
                "message.kv, message.publish and message.send work only while the message's "
                "handler runs: they are stored with its completion") from None
        if tx is None:
            admit = None if self.publisher is None else self.publisher.backpressure
            tx = self._txs[message_id] = Transaction(self._store, self._config.max_payload,
                                                     self.inject, admit)
        return tx

    def stage_event(self, message_id: str, topic: str, payload: Any, **options: Any) -> None:
        self.transaction(message_id).publish(topic, payload, **options)

    def stage_send(self, message_id: str, address: str, command: str, payload: Any,
                   **options: Any) -> None:
        self.transaction(message_id).send(address, command, payload, **options)

    def _commit(self, build: Callable[[Any], None], finished: str | None, nxt: Incoming | None,
                tx: Transaction | None, part: str) -> bool:
        """``record`` a run's outcome with what its handler staged (``part`` names the
        handler, keeping outbox keys of several handlers apart). Raises ``_UpdateFailed``
        if a kv update function raised: nothing was written."""
        if tx is None or tx.empty():
            return self.record(build, finished, nxt)
        if tx.updates:
            with self.kv_lock:  # held until written: the next update reads this one's value
                try:
                    tx.resolve_updates()
                except Exception as exc:
                    raise _UpdateFailed(f"{type(exc).__name__}: {exc}") from exc
                return self._commit_staged(build, finished, nxt, tx, part)
        return self._commit_staged(build, finished, nxt, tx, part)

    def _commit_staged(self, build: Callable[[Any], None], finished: str | None,
                       nxt: Incoming | None, tx: Transaction, part: str) -> bool:
        mid = finished or part
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
            return self.record(full, finished, nxt, after=after, synced=self._synced_write)
        # Fsynced, like events, also when it holds only kv writes or commands: an unsynced
        # write is harmless to lose only if nothing durable comes to depend on it, and here
        # something does (the next kv update reads this one's value; the engine moves the
        # commands into their streams with a synced write). LevelDB does not lose only a
        # suffix of unsynced writes: when its memtable fills it closes its log without an
        # fsync and starts another, whose synced writes can survive a power cut that the old
        # log's tail does not (tests/integration/test_power_loss.py: kv counts 33 too high,
        # commands sent twice). Shared through the group commit like a publish.
        events = tx.events
        return self.record(full, finished, nxt, after=after,
                           synced=lambda rest: publisher.commit_transaction(events, rest))

    def _synced_write(self, rest: Callable[[Any], bool]) -> bool:
        """A synced write of ``rest(batch)``, for a runner without an engine (tests)."""
        batch = self._store.batch()
        marked = rest(batch)
        self._store.write(batch, sync=True)
        return marked

    def _scratch(self) -> Any:
        """This thread's write batch, emptied: one per message was measurable."""
        batch = getattr(self._tls, "batch", None)
        if batch is None or batch.generation != self._store.generation:  # reopened since
            batch = self._tls.batch = self._store.batch()
        else:
            batch.clear()
        return batch

    def record(self, build: Callable[[Any], None], finished: str | None = None,
               nxt: Incoming | None = None, *, after: Callable[[], None] | None = None,
               synced: Callable[[Callable[[Any], bool]], bool] | None = None) -> bool:
        """Write what a handler's run did (done, failed, dead-lettered): ``build(batch)``
        fills a batch, whose write is tried until it succeeds. It happened: if the write
        fails (a full disk, the store being reopened), the handler must not run again while
        the process lives, so the message stays in memory meanwhile. The batch is built
        again each time (one made before a reopen belongs to the closed handle). Only
        closing the bus gives up (the message then runs again after the next start, as
        after a crash). With ``nxt``, the same write marks that message's run as started;
        returns whether it did. ``after`` runs once the write is made.

        ``synced``: make the write through it (``Publisher.commit_transaction``: fsynced,
        with events) rather than as a plain unsynced write.

        ``finished``: the id of a message this write takes out of the incoming store. A
        write that failed may still have reached LevelDB's log, and be applied when the
        store is reopened: if the message is gone when a write is tried again, it was,
        and is not made twice. Unsynced writes that LevelDB appended just after a write
        that failed (a full disk) are dropped when the store is reopened: the message is
        then found stored again. The last few such writes are kept, so that the scan
        after a reopen writes them again instead of running their handlers a second time."""
        delay = 0.05
        failed = False
        while True:
            try:
                if failed and finished is not None and not self._store.has_incoming(finished):
                    marked = False  # an earlier try's write was applied by the reopen
                    break
                if synced is None:
                    batch = self._scratch()
                    build(batch)
                    marked = self._with_marker(batch, nxt)
                    self._store.write(batch, sync=False)
                else:
                    def rest(b: Any) -> bool:
                        build(b)
                        return self._with_marker(b, nxt)
                    marked = synced(rest)
                break
            except (StoreError, RuntimeError) as exc:  # RuntimeError: plyvel's closed handle
                if self._closing() or self._store.closed:
                    raise StoreError(f"closing before a handler's run was recorded: {exc}") from exc
                failed = True
                self._store.wait_writable(delay)
                delay = min(delay * 2, 1.0)
        if finished is not None and synced is None:  # a synced write is never dropped
            with self._lock:
                recent = self._recent
                recent[finished] = (build, after)
                if len(recent) > RECENT:
                    recent.popitem(last=False)
        if after is not None:
            after()
        return marked

    def _marker(self, item: Incoming | None) -> RunState | None:
        """The run state that says "this message's handlers have started" (attempt + 1), or
        None if the message will not run a handler (reply, no handler yet, expired)."""
        if item is None:
            return None
        record = item.record
        kind = record.kind
        if kind == Kind.REPLY or (kind, record.topic) not in self._handlers:
            return None
        if record.expires is not None and wall_ms() > record.expires:
            return None
        attempts, done, last_error, _next = item.runstate or NO_RUNS
        if attempts >= self._config.max_attempts:
            return None  # it will not run again: run() dead-letters it
        return _tuple(RunState, (attempts + 1, list(done), last_error, 0))

    def _with_marker(self, batch: Any, nxt: Incoming | None) -> bool:
        """Put the next message's start marker in ``batch``: the write that finishes one
        message also records that the next one started, saving a write per message."""
        marker = self._marker(nxt)
        if marker is None or nxt is None:
            return False
        batch.put_runstate(nxt.id, marker)
        return True

    def run(self, item: Incoming, marked: bool = False,
             nxt: Incoming | None = None) -> tuple[float | None, bool]:
        """Run the handlers for one message. Returns (when to retry or None if finished,
        whether ``nxt``'s start marker was written)."""
        record = item.record
        kind, topic = record.kind, record.topic
        if kind == Kind.REPLY:
            self._run_reply(item)
            return None, False
        attempts, done, last_error, _next = item.runstate or NO_RUNS
        done = list(done)
        store, config = self._store, self._config
        expires = record.expires
        now_ms = wall_ms()
        if expires is not None and now_ms > expires:
            if kind == Kind.COMMAND and record.correlation_id is not None:
                self._drop_request(item, attempts)
            else:
                self._deadletter(item, "expired", last_error, attempts)
            return None, False
        handlers = self._handlers.get((kind, topic))
        if not handlers:
            # Kept in the store until a handler registers or its TTL passes, if it has one.
            self._park((kind, topic), expires)
            return None, False

        attempts += 1
        if attempts > config.max_attempts:
            # Every run so far started and none ended, not even by raising: the handler
            # ends the process (os._exit, a segfault, the OOM killer). Checked before it
            # runs, or the service would crash-loop on this message forever.
            self._deadletter(item, "handler_crashed", last_error or (
                f"the process ended during each of its {attempts - 1} run(s) of the handler"),
                attempts - 1)
            return None, False
        if not marked:
            try:
                batch = self._scratch()
                batch.put_runstate(item.id, RunState(attempts, done, last_error, 0))
                store.write(batch, sync=False)  # a crash from here on counts as an attempt
            except (StoreError, RuntimeError):  # RuntimeError: plyvel's closed handle
                if self._closing():
                    raise
                # Not written, so not run: the store cannot be written (a full disk). Try
                # again later; no attempt is used up.
                return time.monotonic() + STORE_RETRY, False

        mid = item.id
        message: Message = _tuple(Message, (
            mid, topic, record.sender, record.reply_to, record.sent, attempts, record.headers,
            KIND_NAMES.get(kind, "event"), record.correlation_id, expires, self))
        try:
            payload = decode_payload(record.body)
        except Exception as exc:  # validated on receipt; only a corrupted store gets here
            self._deadletter(item, "undecodable", f"{type(exc).__name__}: {exc}", attempts)
            return None, False

        if kind == Kind.COMMAND and record.correlation_id is not None:
            return None, self._run_request(item, handlers[0][1], payload, message, nxt)

        error: str | None = None
        retry_after: float | None = None
        observe = self.observe
        txs = self._txs
        final: Transaction | None = None  # what the last handler to finish staged
        final_name = handlers[-1][0]
        for name, handler in handlers:
            if name in done:
                continue
            began = time.perf_counter() if observe is not None else 0.0
            txs[mid] = None  # message.kv/publish/send work from here ...
            try:
                handler(payload, message)
            except Reject as exc:
                rejected = f"Reject: {exc}"
                log.warning("handler %s rejected %s %s: %s", name, topic, mid, exc)
                self._deadletter(item, "rejected", rejected, attempts,
                                 [_event("handler_failed", item, attempts, rejected)])
                return None, False
            except Retry as exc:
                error = f"Retry: {exc}"
                if exc.after is not None:
                    retry_after = max(retry_after or 0.0, exc.after)
                log.info("handler %s asked to retry %s %s (attempt %d/%d): %s", name, topic,
                         mid, attempts, config.max_attempts, exc)
                continue
            except BaseException as exc:  # noqa: BLE001 - SystemExit too: see _failed_text
                error = _failed_text(exc)
                log.warning("handler %s failed on %s %s (attempt %d/%d): %s", name, topic,
                            mid, attempts, config.max_attempts, error)
                continue
            finally:
                tx = txs.pop(mid, None)  # ... to here; what a failed run staged is dropped
                if observe is not None:
                    observe(topic, time.perf_counter() - began)
            done.append(name)
            if len(done) < len(handlers):
                # Remember which handlers finished, so a crash reruns only the others.
                state = RunState(attempts, list(done), last_error, 0)
                try:
                    self._commit(lambda b: b.put_runstate(mid, state), None, None, tx, name)
                except _UpdateFailed as exc:
                    done.pop()
                    error = f"kv update: {exc}"
                    log.warning("handler %s failed on %s %s (attempt %d/%d): %s", name, topic,
                                mid, attempts, config.max_attempts, error)
            else:
                final, final_name = tx, name

        if error is None:
            try:
                premarked = self._commit(self._completion(mid, _event("handled", item, attempts)),
                                         mid, nxt, final, final_name)
                return None, premarked
            except _UpdateFailed as exc:
                done.remove(final_name)
                error = f"kv update: {exc}"
                log.warning("handler %s failed on %s %s (attempt %d/%d): %s", final_name,
                            topic, mid, attempts, config.max_attempts, error)
        failed = _event("handler_failed", item, attempts, error)
        if attempts >= config.max_attempts:
            self._deadletter(item, "handler_failed", error, attempts, [failed])
            return None, False
        delay = backoff(attempts, config.retry_initial, config.retry_max) if retry_after is None else retry_after

        def retried(batch: Any) -> None:
            batch.put_runstate(mid, RunState(attempts, done, error, wall_ms() + int(delay * 1000)))
            self._journal.record(batch, [failed, _event("retried", item, attempts, error)])

        return time.monotonic() + delay, self.record(retried, None, nxt)

    def _completion(self, mid: str, event: tuple) -> Callable[[Any], None]:
        """The write that finishes a handled message. Holds the id and its journal event
        only, not the message (``_record`` keeps the last few of these)."""
        def completed(batch: Any) -> None:
            batch.complete_incoming(mid, self._clock.now())
            self._journal.record(batch, [event])
        return completed

    def _run_request(self, item: Incoming, handler: Handler, payload: Any, message: Message,
                     nxt: Incoming | None = None) -> bool:
        """A request: the handler's return value, or its exception, is the reply. It is not
        retried here: the caller is waiting, and decides whether to ask again."""
        events = []
        mid = item.id
        self._txs[mid] = None
        try:
            reply: dict = {"ok": True, "value": handler(payload, message)}
        except BaseException as exc:  # noqa: BLE001 - SystemExit too: see _failed_text
            log.warning("request handler for %s raised %s: %s", message.topic, type(exc).__name__, exc)
            reply = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
            events.append(_event("handler_failed", item, message.attempt, _failed_text(exc)))
        finally:
            tx = self._txs.pop(mid, None)
        if not reply["ok"]:
            tx = None  # what a failed run staged is dropped

        def replied_with(body: bytes) -> tuple[Callable[[Any], None], ReplyRecord]:
            reply_record = ReplyRecord(message.reply_to, message.topic, message.correlation_id, body)

            def replied(batch: Any) -> None:
                batch.complete_with_reply(mid, self._clock.now(), reply_record)
                self._journal.record(batch, [*events, _event("handled", item, message.attempt)])
            return replied, reply_record

        try:
            body = encode_payload(reply)
        except TypeError as exc:
            body, tx = encode_payload({"ok": False, "type": "TypeError", "message": str(exc)}), None
        if len(body) > self._config.max_payload:
            body, tx = encode_payload({"ok": False, "type": "ValueError",
                                       "message": f"reply of {len(body)} bytes exceeds max_payload"}), None
        replied, reply_record = replied_with(body)
        try:
            premarked = self._commit(replied, mid, nxt, tx, "request")
        except _UpdateFailed as exc:
            events.append(_event("handler_failed", item, message.attempt, f"kv update: {exc}"))
            replied, reply_record = replied_with(encode_payload(
                {"ok": False, "type": "TransactionError", "message": f"kv update: {exc}"}))
            premarked = self.record(replied, mid, nxt)
        self._on_reply(item.id, reply_record)
        return premarked

    def _drop_request(self, item: Incoming, attempts: int) -> None:
        """A request not started before it expired: its caller got ``RequestTimeout``, so it
        never runs (DESIGN.md rule 13). Taken out as handled (a resend is not stored again)
        and journaled as dropped; not a dead letter: there is nobody to replay it for."""
        log.info("request %s %s expired before it ran: dropped (its caller was told "
                 "RequestTimeout)", item.record.topic, item.id)
        with self._lock:
            self.requests_expired += 1
        self.record(self._completion(item.id, _event("dropped", item, attempts, "request_expired")),
                    item.id)

    def _run_reply(self, item: Incoming) -> None:
        record = item.record
        corr = record.correlation_id
        try:
            reply = decode_payload(record.body)
            if not isinstance(reply, dict):
                raise ValueError("a reply must be a map")
        except Exception as exc:
            self._deadletter(item, "undecodable", f"{type(exc).__name__}: {exc}", 0)
            return None
        if not self._requests.resolve(corr, reply):
            # After its timeout, or for an earlier run of this bus (a caller's wait is not
            # durable): nobody can take it, now or later.
            late = "came after its timeout" if self._requests.is_ours(corr) else \
                "was for an earlier run of this bus"
            log.warning("reply %s to request %s %s: dropped", item.id, corr, late)
        self.record(self._completion(item.id, _event("handled", item, 1)), item.id)
        return None

    def _deadletter(self, item: Incoming, reason: str, error: str | None, attempts: int,
                    events: list | None = None) -> None:
        record = item.record
        name = "expired" if reason == "expired" else "deadlettered"
        letter = incoming_letter(reason, error, attempts, record)

        def deadlettered(batch: Any) -> None:
            self._journal.record(batch, [*(events or []), _event(name, item, attempts, error or reason)])
            batch.deadletter_incoming(item.id, letter)

        self.record(deadlettered, item.id)
        log.error("dead letter: %s %s after %d attempt(s): %s", record.topic, item.id, attempts,
                  error or reason)
