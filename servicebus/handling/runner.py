"""Running one received message: its handlers, then what the outcome says to write.

A run is an outcome table. ``run`` finds what happened (an ``Outcome``), and ``_FINISH``
says what each outcome writes, in one atomic write (writes.py makes and retries it):

=========  ==========================================  ===================================
outcome    when                                        write
=========  ==========================================  ===================================
handled    every handler returned                      incoming -> handled, with what the
                                                       handlers staged (staging.py)
failed     a handler raised (or asked to ``Retry``)    attempts left: the run state, next
                                                       try after a backoff; else as dead
dead       out of attempts, ``Reject``, expired, a     incoming -> dead letters, with the
           payload that does not decode or validate    reason and the error text
           (``invalid``: a typed handler's), or every
           run so far ended the process (crashed)
replied    a request's handler returned or raised      incoming -> handled + its reply
dropped    a request that expired before it ran (its   incoming -> handled (no dead
           caller was told ``RequestTimeout``)         letter: nobody to replay it for)
reply      a reply to one of this bus's requests       incoming -> handled; the caller
                                                       gets it if it still waits
parked     no handler registered yet                   nothing: it waits in the store
unstarted  its start could not be written (full disk)  nothing: tried again STORE_RETRY on
=========  ==========================================  ===================================

Every exception a handler raises fails that attempt, ``BaseException`` included
(``SystemExit``, ``KeyboardInterrupt``): the message is retried, then dead-lettered, like
any other. Letting it through would not stop the process (raised on a worker thread,
Python only ends that thread) but would strand the message: neither done nor retried, and
its ordered lane let go. Ask for a stop another way (close the bus from the main thread).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import Reject, Retry, StoreError
from ..hooks.base import HandlerOutcome, Hooks
from ..model.clock import BusClock, wall_ms
from ..model.config import BusConfig
from ..model.delivery import backoff
from ..model.letters import incoming_letter
from ..wire.payload import decode_payload, encode_payload
from ..model.records import Message
from ..model.segments import bodies_of, by_message
from ..model.stored import NO_RUNS, Event, Incoming, IncomingRecord, Progress, ReplyRecord, RunState, event
from ..wire.protocol import KIND_NAMES, Kind
from .handlers import Handler, Handlers
from .requests import PendingRequests
from .staging import Staging, UpdateFailed
from .transaction import Transaction
from .outcomes import Outcome, settled
from .segmentrun import run_segment
from .writes import RunStore, RunWriter

__all__ = ["Runner", "Outcome", "STORE_RETRY"]

log = logging.getLogger("servicebus")

_tuple = tuple.__new__  # NamedTuples built per message skip their keyword-parsing __new__
STORE_RETRY = 0.5  # seconds before a message whose start could not be written is tried again


def _failed_text(exc: BaseException) -> str:
    """The error recorded for a handler run that raised ``exc`` (see the module docstring
    for why a ``BaseException`` fails the attempt like any other)."""
    if not isinstance(exc, Exception):
        log.error("a handler raised %s, which is not an Exception: that attempt failed; the bus "
                  "does not end the process from a handler thread", type(exc).__name__)
    return f"{type(exc).__name__}: {exc}"


class Runner:
    def __init__(self, store: RunStore, config: BusConfig, handlers: Handlers, *,
                 requests: PendingRequests, on_reply: Callable[[str, ReplyRecord], None],
                 hooks: Hooks, clock: BusClock, park: Callable[[Incoming], None],
                 closing: Callable[[], bool], wall: Callable[[], int] = wall_ms,
                 spawn: Callable[[Incoming, float], None] | None = None) -> None:
        self._config = config
        self._handlers = handlers
        self._requests = requests
        self._on_reply = on_reply  # hands a stored reply to the engine for sending
        self._hooks = hooks
        self._clock = clock  # handled ids are stamped with it: the dedupe window counts it
        self._park = park  # no handler yet: the message waits in the store (dispatch.py)
        self._closing = closing
        self._wall = wall
        # A message split off a segment (its handler failed): queued to run on its own at
        # a monotonic time (dispatch.py).
        self._spawn: Callable[[Incoming, float], None] = spawn or (lambda item, due: None)
        # Segment key -> the progress its run paused at (segmentrun.py), taken by the worker
        # that requeues it: one key is run by one worker at a time.
        self.paused: dict[str, Progress] = {}
        self.writer = RunWriter(store, closing=closing, wall=wall,
                                limit=lambda kind, topic: handlers.limit(kind, topic, config.max_attempts),
                                handles=lambda kind, topic: (kind, topic) in handlers)
        self.staging = Staging(store, self.writer, config.max_payload)
        self.waits = self.writer.waits  # seconds waited per worker thread (concurrency.py)
        self._count_lock = threading.Lock()
        self.requests_expired = 0  # requests dropped here unrun: past their caller's timeout

    def redo_for(self, message_id: str) -> Callable[[], None] | None:
        return self.writer.redo_for(message_id)

    def _event(self, name: str, item: Incoming, attempts: int, error: str | None = None) -> Event:
        record = item.record
        return event(name, self._wall(), item.id, record.topic, KIND_NAMES.get(record.kind, "event"),
                     record.reply_to, attempts, error)

    # --- the run ---------------------------------------------------------------------------

    def run(self, item: Incoming, marked: bool = False,
            nxt: Incoming | None = None) -> tuple[float | None, bool]:
        """Run one received segment and record the outcome. Returns (when to retry,
        monotonic, or None if finished; whether ``nxt``'s start marker went into the write)."""
        if by_message(item.id, item.record.ids):
            return run_segment(self, item, marked, nxt)
        outcome = self._outcome(item, marked)
        return _FINISH[outcome.kind](self, item, outcome, nxt)

    def _several(self, record: IncomingRecord) -> bool:
        """Whether a message of this kind and topic has several handlers."""
        return len(self._handlers.get((record.kind, record.topic)) or ()) > 1

    def _outcome_before(self, item: Incoming) -> Outcome | None:
        """What comes of a segment before any handler runs: it expired, or it waits for a
        handler (parked), or a reply; None if its handlers are to run."""
        record = item.record
        kind = record.kind
        if kind == Kind.REPLY:
            return Outcome("reply", 1)
        attempts, _done, last_error, _next = item.runstate or NO_RUNS
        if record.expires is not None and self._wall() > record.expires:
            if kind == Kind.COMMAND and record.correlation_id is not None:
                return Outcome("dropped", attempts)
            return Outcome("dead", attempts, "expired", last_error)
        if not self._handlers.get((kind, record.topic)):
            return Outcome("parked")
        return None

    def _outcome(self, item: Incoming, marked: bool, body: bytes | None = None,
                 handlers: list[tuple[str, Handler]] | None = None) -> Outcome:
        """What comes of one message: ``item`` a segment of one, or a message of a segment
        of several given with its payload ``body`` and its topic's ``handlers`` (the
        segment's own checks made once, before: ``_outcome_before``)."""
        record = item.record
        kind, topic = record.kind, record.topic
        if handlers is None:
            before = self._outcome_before(item)
            if before is not None:
                return before
            handlers = self._handlers.get((kind, topic))
            assert handlers
        attempts, done, last_error, _next = item.runstate or NO_RUNS
        attempts += 1
        if attempts > self._handlers.limit(kind, topic, self._config.max_attempts):
            # Every run so far started and none ended, not even by raising: the handler
            # ends the process (os._exit, a segfault, the OOM killer). Checked before it
            # runs, or the service would crash-loop on this message forever.
            return Outcome("dead", attempts - 1, "handler_crashed", last_error or (
                f"the process ended during each of its {attempts - 1} run(s) of the handler"))
        if not marked:
            try:
                self.writer.start(item.id, RunState(attempts, done, last_error, 0))
            except (StoreError, RuntimeError):  # RuntimeError: plyvel's closed handle
                if self._closing():
                    raise
                # Not written, so not run: the store cannot be written (a full disk). Try
                # again later; no attempt is used up.
                return Outcome("unstarted")
        message: Message = _tuple(Message, (
            item.id, topic, record.sender, record.reply_to, record.sent, attempts, record.headers,
            KIND_NAMES.get(kind, "event"), record.correlation_id, record.expires, self.staging))
        try:
            payload = decode_payload(bodies_of(record.blob)[0] if body is None else body)
        except Exception as exc:  # an older or hostile publisher's: a dead letter of its own
            return Outcome("dead", attempts, "undecodable", f"{type(exc).__name__}: {exc}")
        if kind == Kind.COMMAND and record.correlation_id is not None:
            return self._request(item, *handlers[0], payload, message)
        return self._handle(item, handlers, payload, message, attempts, list(done), last_error)

    def _call(self, name: str, handler: Handler, payload: Any, message: Message, kind: int) -> Any:
        """Run handler ``name`` on a ``kind`` message inside the hooks' before/after and
        ``handler_outcome`` (metrics time and count it, tracing spans it), counting the time
        it waited rather than computed (concurrency.py)."""
        hooks = self._hooks
        began, computed = time.perf_counter(), time.thread_time()
        try:
            if not hooks.around_handle:
                return handler(payload, message)
            hooks.before_handle(message)
            error: BaseException | None = None
            try:
                return handler(payload, message)
            except BaseException as exc:
                error = exc
                raise
            finally:
                seconds = time.perf_counter() - began
                if hooks.reporting:
                    topic = self._handlers.registered(kind, message.topic, name)
                    hooks.handler_outcome(HandlerOutcome(
                        "handled" if error is None else "rejected" if isinstance(error, Reject)
                        else "failed", message, topic, name, seconds,
                        error=None if error is None else f"{type(error).__name__}: {error}"))
                hooks.after_handle(message, error, seconds)
        finally:
            self.waits.seconds += max(0.0, (time.perf_counter() - began) - (time.thread_time() - computed))

    def _handle(self, item: Incoming, handlers: list[tuple[str, Handler]], payload: Any,
                message: Message, attempts: int, done: list[str], last_error: str | None) -> Outcome:
        """Run each handler not done yet; their outcome."""
        mid, topic, config, staging = item.id, item.record.topic, self._config, self.staging
        kind, registry = item.record.kind, self._handlers
        error: str | None = None
        retry_after: float | None = None
        limit, delay = 0, None  # of the handlers that failed, with a policy of their own
        final: Transaction | None = None  # what the last handler to finish staged
        final_name = handlers[-1][0]
        culprit: str | None = None  # the last handler to fail: its error is the message's
        for name, handler in handlers:
            if name in done:
                continue
            staging.open(mid)
            try:
                self._call(name, handler, payload, message, item.record.kind)
            except Reject as exc:  # InvalidPayload too (typed.py): reason invalid
                staging.close(mid)  # what a failed run staged is dropped
                rejected = exc.letter_error()
                log.warning("handler %s rejected %s %s: %s", name, topic, mid, rejected)
                return Outcome("dead", attempts, exc.reason, rejected,
                               (self._event("handler_failed", item, attempts, rejected),), handler=name)
            except Retry as exc:
                staging.close(mid)
                error, culprit = f"Retry: {exc}", name
                if exc.after is not None:
                    retry_after = max(retry_after or 0.0, exc.after)
                log.info("handler %s asked to retry %s %s (attempt %d/%d): %s", name, topic,
                         mid, attempts, config.max_attempts, exc)
                continue
            except BaseException as exc:  # noqa: BLE001 - SystemExit too: see _failed_text
                staging.close(mid)
                error, culprit = _failed_text(exc), name
                policy = registry.policy(kind, topic, name)
                if policy is not None and policy.gives_up_on(exc):
                    given_up = f"{error} (not retried: the handler's retry_on/dead_letter_on)"
                    log.warning("handler %s failed on %s %s and does not retry it: %s", name, topic, mid, error)
                    return Outcome("dead", attempts, "rejected", given_up,
                                   (self._event("handler_failed", item, attempts, given_up),), handler=name)
                own = config.max_attempts if policy is None else policy.limit(config.max_attempts)
                limit = own if not limit else min(limit, own)
                if policy is not None and policy.backoff is not None:
                    wait = policy.delay(attempts, config.retry_initial, config.retry_max)
                    delay = wait if delay is None else max(delay, wait)
                log.warning("handler %s failed on %s %s (attempt %d/%d): %s", name, topic,
                            mid, attempts, own, error)
                continue
            tx = staging.close(mid)
            done.append(name)
            if len(done) < len(handlers):
                # Remember which handlers finished, so a crash reruns only the others.
                state = RunState(attempts, list(done), last_error, 0)
                try:
                    staging.commit(lambda b: b.put_runstate(mid, state), mid, False, None, tx, name)
                except UpdateFailed as exc:
                    done.pop()
                    error, culprit = f"kv update: {exc}", name
                    log.warning("handler %s failed on %s %s (attempt %d/%d): %s", name, topic,
                                mid, attempts, config.max_attempts, error)
            else:
                final, final_name = tx, name
        if error is None:
            return Outcome("handled", attempts, done=tuple(done), tx=final, part=final_name)
        return Outcome("failed", attempts, error=error, done=tuple(done), retry_after=retry_after,
                       limit=limit or config.max_attempts, delay=delay, handler=culprit)

    def _request(self, item: Incoming, name: str, handler: Handler, payload: Any,
                 message: Message) -> Outcome:
        """A request: the handler's return value, or its exception, is the reply. It is not
        retried here: the caller is waiting, and decides whether to ask again."""
        mid = item.id
        self.staging.open(mid)
        try:
            reply: dict[str, Any] = {"ok": True, "value": self._call(name, handler, payload, message,
                                                                     item.record.kind)}
        except BaseException as exc:  # noqa: BLE001 - SystemExit too: see _failed_text
            log.warning("request handler for %s raised %s: %s", message.topic, type(exc).__name__, exc)
            failed = self._event("handler_failed", item, message.attempt, _failed_text(exc))
            self.staging.close(mid)  # what a failed run staged is dropped
            return Outcome("replied", message.attempt, events=(failed,), message=message,
                           reply={"ok": False, "type": type(exc).__name__, "message": str(exc)})
        return Outcome("replied", message.attempt, tx=self.staging.close(mid), message=message,
                       reply=reply)

    # --- what each outcome writes ----------------------------------------------------------------

    def _handled(self, item: Incoming, o: Outcome, nxt: Incoming | None) -> tuple[float | None, bool]:
        try:
            premarked = self.staging.commit(self._completion(item.id, self._event("handled", item, o.attempts)),
                                            item.id, True, nxt, o.tx, o.part)
        except UpdateFailed as exc:
            error = f"kv update: {exc}"
            log.warning("handler %s failed on %s %s (attempt %d/%d): %s", o.part, item.record.topic,
                        item.id, o.attempts, self._config.max_attempts, error)
            done = tuple(name for name in o.done if name != o.part)
            return self._failed(item, Outcome("failed", o.attempts, error=error, done=done,
                                              handler=o.part), nxt)
        return None, premarked

    def _failed(self, item: Incoming, o: Outcome, nxt: Incoming | None) -> tuple[float | None, bool]:
        mid, attempts, error, config = item.id, o.attempts, o.error, self._config
        failed = self._event("handler_failed", item, attempts, error)
        if attempts >= (o.limit or config.max_attempts):
            return self._dead(item, Outcome("dead", attempts, "handler_failed", error, (failed,),
                                            handler=o.handler), nxt)
        delay = self.retry_delay(o)
        done = list(o.done)

        def retried(batch: Any) -> None:
            batch.put_runstate(mid, RunState(attempts, done, error, self._wall() + int(delay * 1000)))
            self._hooks.events(batch, [failed, self._event("retried", item, attempts, error)])

        settled(self._hooks, self._handlers, "retried", item, o)
        return time.monotonic() + delay, self.writer.record(retried, None, nxt)

    def retry_delay(self, o: Outcome) -> float:
        """Seconds before a failed message runs again: what ``Retry(after=)`` asked for, else
        its failed handlers' backoff, else the bus's."""
        if o.retry_after is not None:
            return o.retry_after
        if o.delay is not None:
            return o.delay
        return backoff(o.attempts, self._config.retry_initial, self._config.retry_max)

    def _dead(self, item: Incoming, o: Outcome, nxt: Incoming | None) -> tuple[float | None, bool]:
        record, reason = item.record, o.reason or "handler_failed"
        name = "expired" if reason == "expired" else "deadlettered"
        letter = incoming_letter(reason, o.error, o.attempts, record)
        events = [*o.events, self._event(name, item, o.attempts, o.error or reason)]

        def deadlettered(batch: Any) -> None:
            self._hooks.events(batch, events)
            batch.deadletter_incoming(item.id, letter)

        settled(self._hooks, self._handlers, "deadlettered", item, o)
        self.writer.record(deadlettered, item.id)
        log.error("dead letter: %s %s after %d attempt(s): %s", record.topic, item.id, o.attempts,
                  o.error or reason)
        return None, False

    def _replied(self, item: Incoming, o: Outcome, nxt: Incoming | None) -> tuple[float | None, bool]:
        message, reply, tx = o.message, o.reply, o.tx
        assert message is not None and reply is not None
        mid, events = item.id, list(o.events)
        if not reply["ok"]:
            tx = None

        def replied_with(body: bytes) -> tuple[Callable[[Any], None], ReplyRecord]:
            reply_record = ReplyRecord(message.reply_to, message.topic, message.correlation_id, body)

            def replied(batch: Any) -> None:
                batch.complete_with_reply(mid, self._clock.now(), reply_record)
                self._hooks.events(batch, [*events, self._event("handled", item, message.attempt)])
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
            premarked = self.staging.commit(replied, mid, True, nxt, tx, "request")
        except UpdateFailed as exc:
            events.append(self._event("handler_failed", item, message.attempt, f"kv update: {exc}"))
            replied, reply_record = replied_with(encode_payload(
                {"ok": False, "type": "TransactionError", "message": f"kv update: {exc}"}))
            premarked = self.writer.record(replied, mid, nxt)
        self._on_reply(mid, reply_record)
        return None, premarked

    def _dropped(self, item: Incoming, o: Outcome, nxt: Incoming | None) -> tuple[float | None, bool]:
        """A request not started before it expired: its caller got ``RequestTimeout``, so it
        never runs (DESIGN.md rule 13). Taken out as handled (a resend is not stored again)
        and journaled as dropped."""
        log.info("request %s %s expired before it ran: dropped (its caller was told "
                 "RequestTimeout)", item.record.topic, item.id)
        with self._count_lock:
            self.requests_expired += 1
        self.writer.record(self._completion(item.id, self._event("dropped", item, o.attempts,
                                                                 "request_expired")), item.id)
        return None, False

    def _reply(self, item: Incoming, o: Outcome, nxt: Incoming | None) -> tuple[float | None, bool]:
        record = item.record
        corr = record.correlation_id
        try:
            reply = decode_payload(bodies_of(record.blob)[0])
            if not isinstance(reply, dict):
                raise ValueError("a reply must be a map")
        except Exception as exc:
            return self._dead(item, Outcome("dead", 0, "undecodable", f"{type(exc).__name__}: {exc}"), None)
        if not self._requests.resolve(corr, reply):
            # After its timeout, or for an earlier run of this bus (a caller's wait is not
            # durable): nobody can take it, now or later.
            late = "came after its timeout" if self._requests.is_ours(corr) else \
                "was for an earlier run of this bus"
            log.warning("reply %s to request %s %s: dropped", item.id, corr, late)
        self.writer.record(self._completion(item.id, self._event("handled", item, 1)), item.id)
        return None, False

    def _parked(self, item: Incoming, o: Outcome, nxt: Incoming | None) -> tuple[float | None, bool]:
        # Kept in the store until a handler registers or its TTL passes, if it has one
        # (or, if one registered since the check, sent back to the store as this run ends
        # for the next scan to read in order: dispatch.py _park).
        self._park(item)
        return None, False

    def _unstarted(self, item: Incoming, o: Outcome, nxt: Incoming | None) -> tuple[float | None, bool]:
        return time.monotonic() + STORE_RETRY, False

    def _completion(self, mid: str, done: Event) -> Callable[[Any], None]:
        """The write that finishes a handled message. Holds the id and its event only, not
        the message (the writer keeps the last few of these)."""
        def completed(batch: Any) -> None:
            batch.complete_incoming(mid, self._clock.now())
            self._hooks.events(batch, [done])
        return completed


_FINISH: dict[str, Callable[[Runner, Incoming, Outcome, Incoming | None], tuple[float | None, bool]]] = {
    "handled": Runner._handled, "failed": Runner._failed, "dead": Runner._dead,
    "replied": Runner._replied, "dropped": Runner._dropped, "reply": Runner._reply,
    "parked": Runner._parked, "unstarted": Runner._unstarted,
}
