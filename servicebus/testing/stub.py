"""``StubBus``: a bus for testing your handlers, in memory, with no sockets, no disk and no
threads, like dramatiq's StubBroker.

It has every public call of ``Bus`` (a test compares the names) with the same checks on
their arguments (``once``/``any``/``all``, ``status``, ``counters``, ``transaction`` and
``request_async`` in stubcalls.py), and runs handlers the way a bus does (several handlers per topic, patterns,
retries up to ``max_attempts``, ``Retry``/``Reject``, dead letters, TTLs, delays, priorities;
one message at a time in publish order), but all of it in the calling thread when you call
``drain()``, on a clock you move with ``advance()``: the same test gives the same result
every time. Everything published or sent on it is delivered to its own handlers (there is no
other bus); ``published`` and ``sent`` keep what was published and sent, for assertions.

In handlers, ``message.kv``, ``message.publish`` and ``message.send`` behave as on a bus: what
a run staged is applied (to ``stub.kv``, ``published``, ``sent``) only if its handler returned.

What it does not model: the network, crashes and restarts, a second bus, handler
``timeout=``, the dedupe window (a ``dedupe_key`` dedupes for the stub's whole life;
``dedupe="latest"`` stores the newer one and withdraws nothing), an
ordered lane held by a message waiting for its retry (the stub runs the next ones).

``async def`` handlers are awaited: by ``drain()`` on a loop of the stub's, or, in an
``async def`` test, by ``await stub.drain_async()`` on the test's own loop.
"""

from __future__ import annotations

import heapq
import inspect
import itertools
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..model.config import BusConfig
from ..errors import BusClosedError, Reject, RemoteError, Retry, TransactionError
from ..handling.asyncapi import document
from ..handling.handlers import Handler, Handlers, handler_name
from ..handling.typed import registration, typed
from ..handling.policy import Policy, make_policy
from ..model.retention import start_token
from ..wire.payload import decode_payload, encode_payload
from ..wire.protocol import Kind
from ..wire.validation import validate_address
from ..model.outgoing import check_seconds, check_ttl_headers, due_ms, prepare_command, prepare_event
from ..model.records import DeadLetter, Message
from ..wire.topics import validate_pattern, validate_topic
from ..handling.transaction import KeyValue, Transaction
from .stubcalls import Drained, StubCalls, _StubMisuse

__all__ = ["StubBus", "Sent", "Drained"]

_START_MS = 1_800_000_000_000  # the stub clock's epoch: fixed, so that runs repeat


@dataclass(frozen=True)
class Sent:
    """A message published or sent on a ``StubBus``: what a test asserts on."""

    id: str
    kind: str  # "event" or "command"
    topic: str  # an event's topic, a command's name
    payload: Any
    headers: dict[str, Any] | None
    address: str | None  # a command's address


class _MemoryKV:
    """The stub's kv state: what ``bus.kv`` and a transaction read, and a batch they write."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def get_kv(self, key: str, default: Any = None) -> Any:
        data = self.data.get(key)
        return default if data is None else decode_payload(data)

    def kv_items(self, prefix: str = "") -> list[tuple[str, Any]]:
        return sorted((k, decode_payload(v)) for k, v in self.data.items() if k.startswith(prefix))

    def put_kv(self, key: str, data: bytes) -> None:
        self.data[key] = data

    def delete_kv(self, key: str) -> None:
        self.data.pop(key, None)


@dataclass
class _Queued:
    id: str
    kind: Kind
    topic: str
    body: bytes
    headers: dict[str, Any] | None
    expires: int | None
    correlation_id: str | None
    attempts: int = 0
    done: tuple[str, ...] = ()
    watched: bool = False  # taken by a drain once: what once/any/all see after that


class StubBus(StubCalls):
    """See the module docstring. ``options`` are ``Bus``'s (``max_attempts``,
    ``retry_initial``, ``retry_max`` and ``max_payload`` are used)."""

    def __init__(self, address: str = "tcp://127.0.0.1:1", **options: Any) -> None:
        self.config = BusConfig.of(options)
        self.address = validate_address(address)
        self.node_id = "stub"
        self.published: list[Sent] = []
        self.sent: list[Sent] = []
        self._handlers = Handlers()
        self._subscribed: dict[tuple[str, str], None] = {}  # (address, topic), in order
        self._queue: list[tuple[int, int, int, _Queued]] = []  # (due ms, -priority, seq, msg)
        self._seq = itertools.count()
        self._ids = itertools.count(1)
        self._letters: list[DeadLetter] = []
        self._dead_msgs: dict[str, _Queued] = {}  # a dead letter's message, for replay
        self._keys: dict[str, str] = {}  # dedupe_key -> id
        self._now_ms = _START_MS
        self._closed = False
        self._lock = threading.RLock()
        self._state = _MemoryKV()
        self.kv = KeyValue(self._state, lambda build: build(self._state), threading.Lock(),
                           self.config.max_payload)
        # message id -> (its run's kv transaction, publishes and sends to make if it returns)
        self._txs: dict[str, tuple[Transaction, list[Callable[[], Any]]]] = {}
        self._init_calls()

    # --- time --------------------------------------------------------------------------

    def now_ms(self) -> int:
        """The stub's wall clock (ms): starts at a fixed time, moves only with ``advance``."""
        return self._now_ms

    def advance(self, seconds: float) -> None:
        """Move the stub's clock: delayed messages and retries that come due are run by the
        next ``drain``; TTLs that pass expire."""
        if seconds < 0:
            raise ValueError("the stub's clock only moves forward")
        self._now_ms += int(seconds * 1000)

    # --- publishing and sending ----------------------------------------------------------

    def publish(self, topic: str, payload: Any, *, ttl: float | None = None,
                headers: dict[str, Any] | None = None, dedupe_key: str | None = None,
                dedupe: str = "first", key: str | None = None, delay: float | None = None,
                deliver_at: float | datetime | None = None, priority: int = 0) -> str:
        """As ``Bus.publish``; delivered to this stub's own handlers by ``drain``."""
        if dedupe_key is not None and dedupe == "first" and dedupe_key in self._keys:
            return self._keys[dedupe_key]
        (mid,) = self.publish_many(topic, [payload], ttl=ttl, headers=headers, key=key, delay=delay,
                                   deliver_at=deliver_at, priority=priority)
        if dedupe_key is not None:
            self._keys[dedupe_key] = mid
        return mid

    def publish_many(self, topic: str, payloads: Iterable[Any], *, ttl: float | None = None,
                     headers: dict[str, Any] | None = None, key: str | None = None,
                     delay: float | None = None, deliver_at: float | datetime | None = None,
                     priority: int = 0) -> list[str]:

        validate_topic(topic)
        check_ttl_headers(ttl, headers)
        if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 9:
            raise ValueError(f"priority must be an int from 0 to 9, not {priority!r}")
        due = self._stub_due(due_ms, delay, deliver_at)
        if key is not None:
            headers = {**(headers or {}), "sb-key": key}
        ids = []
        for payload in payloads:
            body = self._encode(payload)
            mid = self._new_id()
            expires = None if ttl is None else due + int(ttl * 1000)
            self._enqueue(_Queued(mid, Kind.EVENT, topic, body, headers, expires, None), due, priority)
            self.published.append(Sent(mid, "event", topic, decode_payload(body), headers, None))
            self._counts["published"] += 1
            ids.append(mid)
        return ids

    def send(self, address: str, command: str, payload: Any, *, ttl: float | None = None,
             headers: dict[str, Any] | None = None, delay: float | None = None,
             deliver_at: float | datetime | None = None) -> str:
        """As ``Bus.send``; handled by this stub's ``handle`` handler for ``command``."""

        validate_address(address)
        validate_topic(command, "command")
        check_ttl_headers(ttl, headers)
        due = self._stub_due(due_ms, delay, deliver_at)
        body = self._encode(payload)
        mid = self._new_id()
        expires = None if ttl is None else due + int(ttl * 1000)
        self._enqueue(_Queued(mid, Kind.COMMAND, command, body, headers, expires, None), due, 0)
        self.sent.append(Sent(mid, "command", command, decode_payload(body), headers, address))
        self._counts["sent"] += 1
        return mid

    def request(self, address: str, command: str, payload: Any, *, timeout: float = 30.0,
                headers: dict[str, Any] | None = None, ttl: float | None = None) -> Any:
        """As ``Bus.request``, answered at once by this stub's handler for ``command`` (a
        fake of the remote service, registered with ``handle``): its return value, or
        ``RemoteError`` if it raised. ``timeout`` and ``ttl`` are checked, never reached."""
        check_seconds(timeout, "timeout")
        if ttl is not None:
            check_seconds(ttl, "ttl")
        validate_address(address)
        validate_topic(command, "command")
        body = self._encode(payload)
        handlers = self._handlers.get((int(Kind.COMMAND), command))
        if not handlers:
            raise LookupError(f"no handler for {command!r} on this StubBus: register a fake "
                              "with stub.handle(command, fn)")
        mid = self._new_id()
        self.sent.append(Sent(mid, "command", command, decode_payload(body), headers, address))
        message = self._message(_Queued(mid, Kind.COMMAND, command, body, headers, None, "stub"), 1)
        try:
            return self._call(handlers[0][1], decode_payload(body), message)
        except BaseException as exc:  # noqa: BLE001 - the caller gets it, as from a remote bus
            raise RemoteError(type(exc).__name__, str(exc)) from exc

    # --- handlers and subscriptions -------------------------------------------------------

    @registration
    def every(self, topic: str, handler: Handler | None = None, *, name: str | None = None,
              timeout: float | None = None, **policy: Any) -> Any:
        """As ``Bus.every``, with its retry policy (``timeout`` is accepted, not enforced)."""
        validate_pattern(topic)
        return self._register(Kind.EVENT, topic, handler, name, make_policy(**policy))

    @registration
    def handle(self, command: str, handler: Handler | None = None, *, name: str | None = None,
               timeout: float | None = None, **policy: Any) -> Any:
        """As ``Bus.handle``."""
        validate_topic(command, "command")
        return self._register(Kind.COMMAND, command, handler, name, make_policy(**policy))

    def subscribe(self, address: str, topic: str, **options: Any) -> None:
        """Checked and kept for ``asyncapi``: on a stub every event goes to its own handlers."""
        start_token(options.get("start"))  # the checks
        self._subscribed[(validate_address(address), validate_pattern(topic))] = None

    def unsubscribe(self, address: str, topic: str, **options: Any) -> None:
        self._subscribed.pop((validate_address(address), validate_pattern(topic)), None)

    def asyncapi(self, *, title: str | None = None, version: str = "1.0.0",
                 description: str | None = None) -> dict[str, Any]:
        """As ``Bus.asyncapi``."""
        return document(self.address, self._handlers, list(self._subscribed), title=title,
                        version=version, description=description)

    def _register(self, kind: Kind, topic: str, handler: Handler | None, name: str | None,
                  policy: Policy | None) -> Any:
        def register(fn: Handler) -> Handler:
            if not callable(fn):
                raise TypeError(f"handler must be callable, not {type(fn).__name__}")
            self._check_open()
            run, payload = typed(fn)
            self._handlers.add(kind, topic, run, name, derived=handler_name(fn), policy=policy, payload=payload)
            return fn

        return register if handler is None else register(handler)

    # --- running -------------------------------------------------------------------------

    def drain(self, timeout: float | None = None) -> Drained:
        """Run every message that is due on the stub's clock through its handlers, in
        order (priority first, then publish order), including messages that handlers
        publish, until nothing due is left. A failed run is retried when its backoff comes
        due: ``advance`` the clock past ``retry_max`` and drain again to run the retries.
        Returns a ``Drained`` that is true when nothing is left at all; false, it says what
        is left and why (delayed messages and retries not due, messages nothing handles)."""
        with self._lock:
            while self._queue and self._queue[0][0] <= self._now_ms:
                _due, _prio, _seq, msg = heapq.heappop(self._queue)
                try:
                    self._run(msg)
                except _StubMisuse:
                    self._enqueue(msg, self._now_ms, 0)  # not run: as it was
                    raise
            return self._left()

    def pending(self) -> int:
        """Messages not handled yet (delayed, or waiting for a retry)."""
        return len(self._queue)

    def deadletters(self, limit: int | None = None) -> list[DeadLetter]:
        return list(self._letters[:limit] if limit is not None else self._letters)

    def close(self) -> None:
        self._closed = True
        self._close_calls()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "StubBus":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, msg: _Queued) -> None:
        if msg.expires is not None and msg.expires < self._now_ms:
            self._counts["expired"] += 1
            self._dead(msg, "expired", None)
            return
        if not msg.watched:  # received now, as a bus receives it: once
            self._saw(msg.kind, msg.topic, msg.body, lambda: self._message(msg, 0))
            msg.watched = True
        handlers = self._handlers.get((int(msg.kind), msg.topic))
        if not handlers:
            # As on a bus: it waits for a handler (registering one and draining runs it).
            self._enqueue(msg, self._now_ms + 1, 0)
            return
        msg.attempts += 1
        payload = decode_payload(msg.body)
        message = self._message(msg, msg.attempts)
        failure: BaseException | None = None
        after: float | None = None
        limit, wait = 0, 0.0  # the failed handlers' policies: the fewest runs, the longest backoff
        for name, handler in handlers:
            if name in msg.done:
                continue
            try:
                self._call(handler, payload, message)
            except Reject as exc:
                self._counts["rejected"] += 1
                self._dead(msg, exc.reason, exc.letter_error())
                return
            except _StubMisuse:
                msg.attempts -= 1
                raise
            except BaseException as exc:  # noqa: BLE001 - a failure, SystemExit too (as on a Bus)
                policy = self._handlers.policy(int(msg.kind), msg.topic, name) or Policy()
                if policy.gives_up_on(exc):
                    self._counts["failed"] += 1
                    self._dead(msg, "rejected", f"{type(exc).__name__}: {exc} (not retried: the "
                               "handler's retry_on/dead_letter_on)")
                    return
                failure = exc
                after = exc.after if isinstance(exc, Retry) else None
                own = policy.limit(self.config.max_attempts)
                limit = own if not limit else min(limit, own)
                wait = max(wait, _stub_backoff(policy, msg.attempts, self.config))
                continue
            msg.done += (name,)
        if failure is None:
            self._counts["handled"] += 1
            return
        self._counts["failed"] += 1
        if msg.attempts >= limit:
            self._dead(msg, "handler_failed", f"{type(failure).__name__}: {failure}")
            return
        if after is None:
            after = wait
        self._counts["retried"] += 1
        self._enqueue(msg, self._now_ms + int(after * 1000), 0)

    def _dead(self, msg: _Queued, reason: str, error: str | None) -> None:
        self._counts["deadletters"] += 1
        self._dead_msgs[msg.id] = msg
        self._letters.append(DeadLetter(msg.id, "incoming", reason, error, msg.topic,
                                        msg.kind.name.lower(), msg.attempts, None, self._now_ms))

    # --- helpers --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise BusClosedError("the bus is closed")

    def _new_id(self) -> str:
        self._check_open()
        return f"{self._now_ms:012x}{next(self._ids):012x}"

    def _encode(self, payload: Any) -> bytes:
        body = encode_payload(payload)
        if len(body) > self.config.max_payload:
            raise ValueError(f"payload is {len(body)} bytes encoded; max_payload is {self.config.max_payload}")
        return body

    def _stub_due(self, due_of: Callable[..., int | None], delay: float | None,
                  deliver_at: float | datetime | None) -> int:
        """When to deliver, on the stub's clock: ``delay`` counts from its now;
        ``deliver_at`` is a wall time, checked as a bus checks it and used as given."""
        if delay is not None and deliver_at is None:
            due_of(delay, None)  # the checks
            return self._now_ms + int(delay * 1000)
        if deliver_at is not None:
            due_of(None, deliver_at) if delay is None else due_of(delay, deliver_at)
            at = deliver_at.timestamp() if isinstance(deliver_at, datetime) else float(deliver_at)
            return max(self._now_ms, int(at * 1000))
        return self._now_ms

    def _enqueue(self, msg: _Queued, due: int, priority: int) -> None:
        heapq.heappush(self._queue, (due, -priority, next(self._seq), msg))

    def _message(self, msg: _Queued, attempt: int) -> Message:
        return Message(msg.id, msg.topic, self.node_id, self.address, self._now_ms, attempt,
                       msg.headers, msg.kind.name.lower(), msg.correlation_id, msg.expires, self)

    # --- a handler's transaction (what Message.kv/publish/send call) ----------------------

    def _call(self, handler: Handler, payload: Any, message: Message) -> Any:
        """Run ``handler`` in a transaction: what it staged is applied if it returned."""
        self._txs[message.id] = (Transaction(self._state, self.config.max_payload), [])
        try:
            value = handler(payload, message)
            if inspect.isawaitable(value):
                value = self._await(value)
            tx, calls = self._txs[message.id]
            tx.resolve_updates()
        finally:
            self._txs.pop(message.id, None)
        tx.write_state(self._state)
        for call in calls:
            call()
        return value

    def _running(self, message_id: str) -> tuple[Transaction, list[Callable[[], Any]]]:
        try:
            return self._txs[message_id]
        except KeyError:
            raise TransactionError("message.kv, message.publish and message.send work only "
                                   "while the message's handler runs") from None

    def run_transaction(self, message_id: str) -> Transaction:
        return self._running(message_id)[0]

    def stage_event(self, message_id: str, topic: str, payload: Any, **options: Any) -> None:
        calls = self._running(message_id)[1]
        prepare_event(topic, [payload], max_payload=self.config.max_payload, **options)  # the checks
        calls.append(lambda: self.publish(topic, payload, **options))

    def stage_send(self, message_id: str, address: str, command: str, payload: Any,
                   **options: Any) -> None:
        calls = self._running(message_id)[1]
        prepare_command(address, command, payload, max_payload=self.config.max_payload,
                        ttl=options.get("ttl"), headers=options.get("headers"))
        calls.append(lambda: self.send(address, command, payload, **options))


def _stub_backoff(policy: Policy, attempts: int, config: BusConfig) -> float:
    """The bus's backoff (or the handler's) without its jitter: deterministic."""
    if callable(policy.backoff):
        return policy.delay(attempts, config.retry_initial, config.retry_max)
    initial, cap = policy.backoff or (config.retry_initial, config.retry_max)
    return min(cap, initial * 2 ** (attempts - 1))
