"""Runs handlers on worker threads owned by the bus: retries, dead letters, parking.

The engine hands over incoming messages only after they are fsynced (and acked). From then
on this module owns their ``n/`` and ``r/`` records:

- Before a handler runs, the attempt count is written (unsynced; it survives SIGKILL), so a
  message that crashes the process is eventually dead-lettered instead of looping forever.
- The moment every handler for a message has returned, the message moves from incoming to
  handled in one write from the worker thread itself (DESIGN.md section 9: deferring that
  to the engine turns crashes into duplicate handling).
- A handler that raises is retried with backoff; after ``max_attempts`` the message moves
  to the dead letters with the exception type and text, atomically.
- Messages without a handler yet stay in the store ("parked") and are dispatched when one
  registers. At most ``dispatch_queue`` messages are held in memory; the rest wait in the
  store and are read back as the queue empties.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections import OrderedDict
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from .clock import BusClock, wall_ms
from .config import BusConfig
from .core.state import Incoming, incoming_record
from .delivery import backoff
from .errors import CorruptRecordError, StoreError
from .journal import Journal
from .letters import incoming_letter
from .protocol import KIND_NAMES, Kind, decode_payload, encode_payload
from .records import Message
from .requests import PendingRequests
from .store import Store

__all__ = ["Dispatcher", "Incoming", "incoming_record"]

log = logging.getLogger("servicebus")

Handler = Callable[[Any, Message], Any]
RUN = 16  # ready messages a worker takes at once, at most
# Finishing writes kept to redo after a reopen (see _record). Only those that returned
# between a failed write and its failure being recorded can be dropped: a few per worker.
# Dead letters and replies keep their payload, so this also bounds that memory.
RECENT = 64
UNNAMED = "<handler>"  # the one handler of a topic, whose name never needs storing
STORE_RETRY = 0.5  # seconds before a message whose start could not be written is tried again

# Incoming record layout in the store (a list, for compactness):
def _event(name: str, item: "Incoming", attempts: int, error: str | None = None) -> tuple:
    record = item.record
    return (name, wall_ms(), item.id, record[1], KIND_NAMES.get(record[0], "event"), record[3],
            attempts, error)


def handler_name(handler: Handler) -> str | None:
    """A name for ``handler`` that is the same after a restart: module and qualified
    name. None when there is none (a ``functools.partial``, whose repr holds a memory
    address); a lambda's or a bound method's is stable but may be shared, which
    ``register`` refuses when it matters."""
    if isinstance(handler, functools.partial):
        return None
    qualname = getattr(handler, "__qualname__", None)
    if qualname is None:  # a callable object: its class's __call__
        qualname = getattr(type(handler), "__qualname__", None)
    module = getattr(handler, "__module__", None) or getattr(type(handler), "__module__", "?")
    return None if qualname is None else f"{module}.{qualname}"


class Dispatcher:
    def __init__(self, store: Store, config: BusConfig, *, on_idle: Callable[[], None],
                 requests: PendingRequests, on_reply: Callable[[str, list], None],
                 journal: Journal, clock: BusClock) -> None:
        self._store = store
        self._clock = clock  # handled ids are stamped with it: the dedupe window counts it
        self._config = config
        self._on_idle = on_idle
        self._requests = requests
        self._on_reply = on_reply  # hands a stored reply to the engine for sending
        self._journal = journal
        self._handlers: dict[tuple[int, str], list[tuple[str, Handler]]] = {}
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, Incoming]] = []
        self._seq = itertools.count()
        self._known: set[str] = set()  # queued, running or waiting for a retry
        self._reserved: set[str] = set()  # being stored by the engine (see reserve)
        self._parked: set[tuple[int, str]] = set()  # (kind, topic) with stored, unhandled messages
        self._recent: OrderedDict[str, Callable[[Any], None]] = OrderedDict()  # see _record
        self._parked_expiry: float | None = None  # monotonic: a parked message's TTL passes
        self._overflow = False
        self._overflow_gen = 0
        self._refilling = False
        self._refill_pending = False  # a refill was asked for while one ran
        self._closing = False
        self._threads: list[threading.Thread] = []
        self._tls = threading.local()

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        # Messages stored before a restart. A damaged record stops the start here, with a
        # StoreError naming it (rule 9), rather than being found later.
        self._refill(strict=True)
        for n in range(self._config.workers):
            t = threading.Thread(target=self._work, name=f"servicebus-worker-{n}", daemon=True)
            t.start()
            self._threads.append(t)

    def close(self, timeout: float) -> bool:
        """Stop taking work; wait up to ``timeout`` for running handlers. True if all ended."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        deadline = time.monotonic() + timeout
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:  # close() called from a handler: that handler is finishing now
                t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive() and t is not me]
        if alive:
            log.warning("close: %d handler(s) still running after %.1fs; their results will "
                        "be rerun after the next start", len(alive), timeout)
        return not alive

    def refill(self) -> None:
        """Queue every stored incoming message not in memory (after the store was reopened:
        a write that did not count may still have stored messages nobody handed over)."""
        try:
            self._refill()
        except StoreError as exc:
            log.error("reading stored incoming messages failed: %s", exc)

    def in_worker(self) -> bool:
        return threading.current_thread() in self._threads

    @property
    def idle(self) -> bool:
        with self._cv:
            return self._idle()

    def _idle(self) -> bool:
        return not (self._known or self._parked or self._overflow or self._refilling
                    or self._refill_pending)

    def _scratch(self) -> Any:
        """This thread's write batch, emptied: one per message was measurable."""
        batch = getattr(self._tls, "batch", None)
        if batch is None or batch.generation != self._store.generation:  # reopened since
            batch = self._tls.batch = self._store.batch()
        else:
            batch.clear()
        return batch

    def _record(self, build: Callable[[Any], None], finished: str | None = None,
                nxt: Incoming | None = None) -> bool:
        """Write what a handler's run did (done, failed, dead-lettered): ``build(batch)``
        fills a batch, whose write is tried until it succeeds. It happened: if the write
        fails (a full disk, the store being reopened), the handler must not run again while
        the process lives, so the message stays in memory meanwhile. The batch is built
        again each time (one made before a reopen belongs to the closed handle). Only
        closing the bus gives up (the message then runs again after the next start, as
        after a crash). With ``nxt``, the same write marks that message's run as started;
        returns whether it did.

        ``finished``: the id of a message this write takes out of the incoming store. Such
        writes are not fsynced, and one that LevelDB appended just after a write that
        failed (a full disk) is dropped when the store is reopened: the message is then
        found stored again. The last few such writes are kept, so that the scan after a
        reopen writes them again instead of running their handlers a second time."""
        delay = 0.05
        while True:
            try:
                batch = self._scratch()
                build(batch)
                marked = self._with_marker(batch, nxt)
                self._store.write(batch, sync=False)
                break
            except (StoreError, RuntimeError) as exc:  # RuntimeError: plyvel's closed handle
                if self._closing or self._store.closed:
                    raise StoreError(f"closing before a handler's run was recorded: {exc}") from exc
                self._store.wait_writable(delay)
                delay = min(delay * 2, 1.0)
        if finished is not None:
            with self._cv:
                recent = self._recent
                recent[finished] = build
                if len(recent) > RECENT:
                    recent.popitem(last=False)
        return marked

    # --- handlers ----------------------------------------------------------------------

    def register(self, kind: Kind, topic: str, handler: Handler, name: str | None = None) -> None:
        """Add ``handler``. With several handlers on one topic, the names of the ones that
        finished are stored with the message so that a restart reruns only the others:
        they must be stable across restarts and distinct, so a second handler on a topic
        needs every handler there to have one (``name=``, or a function's qualified
        name); ``ValueError`` otherwise."""
        if name is None:
            name = handler_name(handler)
        elif not isinstance(name, str) or not name.strip():
            raise ValueError(f"handler name must be a non-empty str, not {name!r}")
        key = (int(kind), topic)
        with self._cv:
            existing = self._handlers.get(key, [])
            if kind is Kind.COMMAND and existing:
                # A command has one owner: its handler's return value is the reply.
                raise ValueError(f"command {topic!r} already has a handler ({existing[0][0]})")
            if existing:
                names = [None if n == UNNAMED else n for n, _ in existing] + [name]
                if None in names or len(set(names)) != len(names):
                    shown = ", ".join(n or "<no stable name>" for n in names)
                    raise ValueError(
                        f"several handlers on {topic!r} need stable, distinct names ({shown}): "
                        "pass every(topic, handler, name=...)")
            self._handlers[key] = existing + [(name or UNNAMED, handler)]
            was_parked = key in self._parked
            self._parked.discard(key)
            if was_parked:
                self._refill_pending = True  # not idle until its messages are read
        if was_parked:
            self._refill(only=key)

    # --- intake ------------------------------------------------------------------------

    def reserve(self, ids: list[str]) -> None:
        """Messages the engine is storing now and will ``submit`` once that write counts:
        a refill running meanwhile must not take (and finish) them first, or the engine's
        hand-off would run them again."""
        with self._cv:
            self._known.update(ids)
            self._reserved.update(ids)

    def unreserve(self, ids: list[str]) -> None:
        """The write that stored them did not count: they are not handed over."""
        with self._cv:
            for mid in ids:
                if mid in self._reserved:
                    self._reserved.discard(mid)
                    self._known.discard(mid)

    def submit(self, items: Iterable[Incoming]) -> None:
        with self._cv:
            added = 0
            reserved = self._reserved
            for item in items:
                if item.id in reserved:
                    reserved.discard(item.id)
                    self._known.discard(item.id)
                elif item.id in self._known:
                    continue
                if len(self._known) >= self._config.dispatch_queue:
                    self._overflow = True
                    self._overflow_gen += 1
                    continue
                self._push(item, 0.0)
                added += 1
            if added:
                # Wake as many workers as there are runs to take, not all of them: every
                # needless wake-up is a context switch and a turn at the GIL.
                self._cv.notify(min(self._config.workers, -(-added // RUN)))

    def _wake_parked_at(self, expires_ms: int) -> None:
        """A parked message expires then: a scan at that time dead-letters it. Under _cv."""
        due = time.monotonic() + max(0, expires_ms - wall_ms()) / 1000 + 0.001
        if self._parked_expiry is None or due < self._parked_expiry:
            self._parked_expiry = due
            self._cv.notify()

    def _push(self, item: Incoming, due: float) -> None:
        self._known.add(item.id)
        heapq.heappush(self._heap, (due, next(self._seq), item))

    def _refill(self, only: tuple[int, str] | None = None, strict: bool = False) -> None:
        """Read stored incoming messages that are not in memory yet (restart, overflow, a
        handler registered late, a parked message's TTL). One refill runs at a time; a
        request made meanwhile makes it scan once more (everything) before it ends, so
        no request is lost and ``idle`` stays False until then."""
        with self._cv:
            self._refill_pending = True
            if self._refilling:
                return
            self._refilling = True
        try:
            while True:
                with self._cv:
                    self._refill_pending = False
                    gen = self._overflow_gen
                filled = self._scan(only, strict)
                with self._cv:
                    if only is None:
                        # Something was turned away while we scanned: its record may sort
                        # before where the scan had got to, so scan again once there is room.
                        self._overflow = not filled or gen != self._overflow_gen
                    again = (self._overflow and not self._closing
                             and len(self._known) < self._config.dispatch_queue // 2)
                    if self._refill_pending and not self._closing:
                        again, only = True, None
                    if not again:
                        self._refill_pending = False
                        return
        except StoreError:
            if not self._closing:
                raise
        finally:
            with self._cv:
                self._refilling = False

    def _scan(self, only: tuple[int, str] | None, strict: bool) -> bool:
        """Queue stored messages not yet in memory; False if the queue filled up first.
        Not ``strict`` (a running bus), damaged records become dead letters and the scan
        goes on."""
        now_ms, now = wall_ms(), time.monotonic()
        damaged: list | None = None if strict else []
        try:
            return self._scan_records(only, strict, damaged, now_ms, now)
        finally:
            if damaged:
                self._quarantine(damaged)

    def _quarantine(self, damaged: list[tuple[bytes, bytes]]) -> None:
        batch = self._store.batch()
        for key, raw in damaged:
            batch.quarantine_incoming(key, raw, "undecodable record")
            log.error("incoming message %s: its stored record is damaged; moving it to the "
                      "dead letters with its raw bytes", key[2:].decode("utf-8", "replace"))
        try:
            self._store.write(batch, sync=False)
        except StoreError as exc:  # found again by the next scan
            log.error("could not move damaged incoming records: %s", exc)

    def _scan_records(self, only: tuple[int, str] | None, strict: bool, damaged: list | None,
                      now_ms: int, now: float) -> bool:
        redos: list[tuple[str, Callable[[Any], None]]] = []
        try:
            return self._scan_stored(only, strict, damaged, now_ms, now, redos)
        finally:
            for message_id, redo in redos:  # finished here, but the write was dropped
                log.warning("message %s: its finishing write was lost with a failed write; "
                            "writing it again (its handler does not run again)", message_id)
                self._record(redo, message_id)

    def _scan_stored(self, only: tuple[int, str] | None, strict: bool, damaged: list | None,
                     now_ms: int, now: float, redos: list) -> bool:
        for message_id, record in self._store.incoming(damaged):
            if only is not None and (record[0], record[1]) != only:
                continue
            with self._cv:
                if self._closing:
                    return True
                if message_id in self._known:
                    continue
                if len(self._known) >= self._config.dispatch_queue:
                    return False
                key = (record[0], record[1])
                if record[0] != Kind.REPLY and key not in self._handlers and (
                        record[6] is None or record[6] > now_ms):
                    # Nobody handles it yet: it waits in the store, not in the queue, or
                    # enough of them would fill the queue on every scan and keep the
                    # messages after them from their handlers. register() reads them.
                    self._parked.add(key)
                    if record[6] is not None:
                        self._wake_parked_at(record[6])
                    if strict:  # at start every record is checked (rule 9), its run state too
                        self._store.get_runstate(message_id)
                    continue
                # The iterator reads a snapshot: a message finished since it was taken is
                # gone from the store (finishing deletes it before leaving _known).
                if not self._store.has_incoming(message_id):
                    continue
                redo = self._recent.get(message_id)
                if redo is not None:
                    redos.append((message_id, redo))
                    continue
                try:
                    runstate = self._store.get_runstate(message_id)
                except CorruptRecordError:
                    if strict:
                        raise
                    log.error("the run state of %s is damaged; its attempts start again", message_id)
                    runstate = None
                due = 0.0
                if runstate and runstate[3] and runstate[3] > now_ms:
                    # A retry time is wall-clock ms from an earlier run. If the clock was
                    # set back since, it is too far off: no retry waits past retry_max.
                    due = now + min((runstate[3] - now_ms) / 1000, self._config.retry_max)
                self._push(Incoming(message_id, record, runstate), due)
                self._cv.notify()
        return True

    # --- workers -----------------------------------------------------------------------

    def _next_run(self) -> list[Incoming] | None:
        """The next ready messages for one worker: a fair share of what is ready (so slow,
        I/O-bound handlers still spread over all workers), at most RUN. An empty list when
        a parked message's TTL passed: the worker scans the store for it."""
        with self._cv:
            while True:
                if self._closing:
                    return None
                parked = self._parked_expiry
                if parked is not None and parked <= time.monotonic():
                    self._parked_expiry = None
                    return []
                if self._heap:
                    now = time.monotonic()
                    due = self._heap[0][0]
                    if parked is not None:
                        due = min(due, parked)
                    if due <= now:
                        ready = sum(1 for d, _, _ in self._heap[:RUN * 8] if d <= now)
                        take = max(1, min(RUN, ready // self._config.workers))
                        run = [heapq.heappop(self._heap)[2]]
                        while len(run) < take and self._heap and self._heap[0][0] <= now:
                            run.append(heapq.heappop(self._heap)[2])
                        return run
                    self._cv.wait(due - now)
                elif parked is not None:
                    self._cv.wait(parked - time.monotonic())
                else:
                    self._cv.wait()

    def _work(self) -> None:
        while True:
            run = self._next_run()
            if run is None:
                return
            if not run:
                self._refill()  # a parked message expired: the scan queues it to dead-letter
                continue
            marked = False  # whether run[i]'s "started" marker was written with run[i-1]
            for i, item in enumerate(run):
                nxt = run[i + 1] if i + 1 < len(run) else None
                retry_at: float | None = None
                try:
                    retry_at, marked = self._run(item, marked, nxt)
                except StoreError as exc:
                    marked = False
                    if not self._closing:
                        log.error("handling %s: %s", item.id, exc)
                except BaseException:  # noqa: BLE001 - a worker must never die silently
                    marked = False
                    log.exception("unexpected error dispatching %s", item.id)
                finally:
                    try:
                        self._finish(item, retry_at)
                    except BaseException:  # noqa: BLE001 - nor die finishing one
                        log.exception("unexpected error finishing %s", item.id)

    def _finish(self, item: Incoming, retry_at: float | None) -> None:
        refill = False
        with self._cv:
            if retry_at is not None and not self._closing:
                try:
                    runstate = self._store.get_runstate(item.id) if not self._store.closed else None
                except StoreError as exc:  # damaged, or closing: retried from its attempt 0
                    log.error("reading the run state of %s: %s", item.id, exc)
                    runstate = None
                heapq.heappush(self._heap, (retry_at, next(self._seq), item._replace(runstate=runstate)))
                self._cv.notify()
            else:
                self._known.discard(item.id)
            idle = self._idle()
            refill = self._overflow and not self._refilling and \
                len(self._known) < self._config.dispatch_queue // 2
        if refill and not self._closing:
            self._refill()
            idle = self.idle
        if idle:
            self._on_idle()

    def _marker(self, item: Incoming | None) -> list | None:
        """The run state that says "this message's handlers have started" (attempt + 1), or
        None if the message will not run a handler (reply, no handler yet, expired)."""
        if item is None:
            return None
        record = item.record
        kind = record[0]
        if kind == Kind.REPLY or (kind, record[1]) not in self._handlers:
            return None
        if record[6] is not None and wall_ms() > record[6]:
            return None
        attempts, done, last_error = (item.runstate or [0, [], None, 0])[:3]
        if attempts >= self._config.max_attempts:
            return None  # it will not run again: _run dead-letters it
        return [attempts + 1, list(done), last_error, 0]

    def _with_marker(self, batch: Any, nxt: Incoming | None) -> bool:
        """Put the next message's start marker in ``batch``: the write that finishes one
        message also records that the next one started, saving a write per message."""
        marker = self._marker(nxt)
        if marker is None or nxt is None:
            return False
        batch.put_runstate(nxt.id, marker)
        return True

    def _run(self, item: Incoming, marked: bool = False,
             nxt: Incoming | None = None) -> tuple[float | None, bool]:
        """Run the handlers for one message. Returns (when to retry or None if finished,
        whether ``nxt``'s start marker was written)."""
        record = item.record
        kind, topic = record[0], record[1]
        if kind == Kind.REPLY:
            self._run_reply(item)
            return None, False
        attempts, done, last_error = (item.runstate or [0, [], None, 0])[:3]
        done = list(done)
        store, config = self._store, self._config
        expires = record[6]
        now_ms = wall_ms()
        if expires is not None and now_ms > expires:
            self._deadletter(item, "expired", last_error, attempts)
            return None, False
        handlers = self._handlers.get((kind, topic))
        if not handlers:
            # Kept in the store until a handler registers or its TTL passes, if it has one.
            with self._cv:
                self._parked.add((kind, topic))
                if expires is not None:
                    self._wake_parked_at(expires)
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
                batch.put_runstate(item.id, [attempts, done, last_error, 0])
                store.write(batch, sync=False)  # a crash from here on counts as an attempt
            except (StoreError, RuntimeError):  # RuntimeError: plyvel's closed handle
                if self._closing:
                    raise
                # Not written, so not run: the store cannot be written (a full disk). Try
                # again later; no attempt is used up.
                return time.monotonic() + STORE_RETRY, False

        message = Message(item.id, topic, record[2], record[3], record[4], attempts, record[8],
                          KIND_NAMES.get(kind, "event"), record[7], expires)
        try:
            payload = decode_payload(record[9])
        except Exception as exc:  # validated on receipt; only a corrupted store gets here
            self._deadletter(item, "undecodable", f"{type(exc).__name__}: {exc}", attempts)
            return None, False

        if kind == Kind.COMMAND and record[7] is not None:
            return None, self._run_request(item, handlers[0][1], payload, message, nxt)

        error: str | None = None
        for name, handler in handlers:
            if name in done:
                continue
            try:
                handler(payload, message)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                log.warning("handler %s failed on %s %s (attempt %d/%d): %s", name, topic,
                            item.id, attempts, config.max_attempts, error)
                continue
            done.append(name)
            if len(handlers) > 1 and len(done) < len(handlers):
                # Remember which handlers finished, so a crash reruns only the others.
                self._record(lambda b: b.put_runstate(item.id, [attempts, done, last_error, 0]))

        if error is None:
            premarked = self._record(self._completion(item.id, _event("handled", item, attempts)),
                                     item.id, nxt)
            return None, premarked
        failed = _event("handler_failed", item, attempts, error)
        if attempts >= config.max_attempts:
            self._deadletter(item, "handler_failed", error, attempts, [failed])
            return None, False
        delay = backoff(attempts, config.retry_initial, config.retry_max)

        def retried(batch: Any) -> None:
            batch.put_runstate(item.id, [attempts, done, error, wall_ms() + int(delay * 1000)])
            self._journal.record(batch, [failed, _event("retried", item, attempts, error)])

        return time.monotonic() + delay, self._record(retried, None, nxt)

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
        try:
            reply: dict = {"ok": True, "value": handler(payload, message)}
        except Exception as exc:
            log.warning("request handler for %s raised %s: %s", message.topic, type(exc).__name__, exc)
            reply = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
            events.append(_event("handler_failed", item, message.attempt, f"{type(exc).__name__}: {exc}"))
        try:
            body = encode_payload(reply)
        except TypeError as exc:
            body = encode_payload({"ok": False, "type": "TypeError", "message": str(exc)})
        if len(body) > self._config.max_payload:
            body = encode_payload({"ok": False, "type": "ValueError",
                                   "message": f"reply of {len(body)} bytes exceeds max_payload"})
        reply_record = [message.reply_to, message.topic, message.correlation_id, body]
        events.append(_event("handled", item, message.attempt))

        def replied(batch: Any) -> None:
            batch.complete_with_reply(item.id, self._clock.now(), reply_record)
            self._journal.record(batch, events)

        premarked = self._record(replied, item.id, nxt)
        self._on_reply(item.id, reply_record)
        return premarked

    def _run_reply(self, item: Incoming) -> None:
        record = item.record
        corr = record[7]
        try:
            reply = decode_payload(record[9])
            if not isinstance(reply, dict):
                raise ValueError("a reply must be a map")
        except Exception as exc:
            self._deadletter(item, "undecodable", f"{type(exc).__name__}: {exc}", 0)
            return None
        if not self._requests.resolve(corr, reply):
            if not self._requests.is_ours(corr):
                # For an earlier run of this service: nobody can take it. It stays stored
                # (and visible to operators); it does not count as pending work.
                log.warning("reply %s to request %s of an earlier run of this bus: kept in "
                            "the incoming store", item.id, corr)
                return None
            log.warning("reply %s to request %s came after its timeout: dropped", item.id, corr)
        self._record(self._completion(item.id, _event("handled", item, 1)), item.id)
        return None

    def _deadletter(self, item: Incoming, reason: str, error: str | None, attempts: int,
                    events: list | None = None) -> None:
        record = item.record
        name = "expired" if reason == "expired" else "deadlettered"
        letter = incoming_letter(reason, error, attempts, record)

        def deadlettered(batch: Any) -> None:
            self._journal.record(batch, [*(events or []), _event(name, item, attempts, error or reason)])
            batch.deadletter_incoming(item.id, letter)

        self._record(deadlettered, item.id)
        log.error("dead letter: %s %s after %d attempt(s): %s", record[1], item.id, attempts,
                  error or reason)
