"""``Bus``: the thread-safe public face of one embedded bus: publishing, commands and
requests, subscribing, handlers. Waiting for events and its state are in busstate.py;
opening and closing it, and the plumbing its calls share, in lifecycle.py."""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import datetime
from typing import Any

from .engine import loop as E
from .busstate import BusState
from .handling.asyncapi import document
from .handling.handlers import handler_name
from .handling.policy import Backoff, Policy, make_policy
from .handling.typed import registration, typed
from .model.retention import start_token
from .errors import BusClosedError, RequestTimeout, StoreError, SubscribeTimeout
from .model.outgoing import check_seconds, due_ms, prepare_command, prepare_event
from .wire.protocol import Kind
from .wire.validation import validate_group, validate_target
from .model.members import SERVICE, is_service
from .model.records import Message
from .handling.transaction import Transaction
from .wire.topics import validate_pattern, validate_topic

__all__ = ["Bus"]

Handler = Callable[[Any, Message], Any]

class Bus(BusState):
    """An embedded, durable service bus. See the README for the guarantees.

    ``Bus(bind, datadir, **options)``: ``bind`` is this bus's ZeroMQ address
    (``tcp://host:port``; port ``0`` picks a free one), ``datadir`` the directory holding
    its store and lock. ``options`` are the fields of ``BusConfig``.
    """

    # --- publishing --------------------------------------------------------------------

    def publish(self, topic: str, payload: Any, *, ttl: float | None = None,
                headers: dict[str, Any] | None = None, dedupe_key: str | None = None,
                dedupe: str = "first", key: str | None = None, delay: float | None = None,
                deliver_at: float | datetime | None = None, priority: int = 0) -> str:
        """Store ``payload`` for every subscriber of ``topic``; return its message id.

        Returns only after the message is fsynced. Subscriptions are those this bus has
        confirmed when the call is made; with none, nothing is stored. The calling thread
        does the write itself; concurrent callers share one fsync (group commit).

        ``ttl`` (seconds): not handled in time, it becomes a dead letter with reason
        ``expired`` wherever it is (at the publisher for a subscriber that has not acked
        it, at the subscriber otherwise). ``headers``: a dict with str keys, given to
        handlers as ``message.headers``.

        ``dedupe_key``: a publish with a key used within ``publish_dedupe_window`` returns
        the first one's id and stores nothing (a publisher that retries after a crash or a
        timeout publishes once). Keyed publishes are serialized: each pays its own fsync.
        ``dedupe="latest"``: the newer one wins instead: it is stored (a new id) and the
        earlier one is withdrawn from every subscriber it was not sent to yet.

        ``key``: for ordered subscriptions, only messages with the same key wait for each
        other (given to handlers as ``message.key``). ``delay`` (seconds) or ``deliver_at``
        (a POSIX timestamp or an aware datetime): stored now, sent to subscribers when
        due (held durably at the publisher, across restarts); a ``ttl`` counts from then.

        ``priority`` (0-9, default 0): higher ones go before the backlog of lower ones, at
        the publisher (each level has its own window) and at the subscriber (a level counts
        as having waited one second longer than it has: lower ones still go first once they
        have waited that much longer, so none waits forever).
        """
        if dedupe_key is not None and (not isinstance(dedupe_key, str) or not dedupe_key
                                       or len(dedupe_key.encode()) > 512):
            raise ValueError(f"dedupe_key must be a non-empty str of at most 512 bytes, not {dedupe_key!r}")
        if dedupe not in ("first", "latest"):
            raise ValueError(f"dedupe must be 'first' or 'latest', not {dedupe!r}")
        return self._publish(topic, [payload], ttl, headers, dedupe_key, key, delay, deliver_at,
                             dedupe == "latest", priority)[0]

    def publish_many(self, topic: str, payloads: Iterable[Any], *, ttl: float | None = None,
                     headers: dict[str, Any] | None = None, key: str | None = None,
                     delay: float | None = None, deliver_at: float | datetime | None = None,
                     priority: int = 0) -> list[str]:
        """Like ``publish`` for a list, with one fsync for all of it; returns the ids."""
        return self._publish(topic, payloads, ttl, headers, None, key, delay, deliver_at,
                             priority=priority)

    def _publish(self, topic: str, payloads: Iterable[Any], ttl: float | None,
                 headers: dict[str, Any] | None, dedupe_key: str | None, key: str | None = None,
                 delay: float | None = None, deliver_at: float | datetime | None = None,
                 latest: bool = False, priority: int = 0) -> list[str]:
        event = prepare_event(topic, payloads, max_payload=self.config.max_payload, ttl=ttl,
                              headers=headers, key=key, delay=delay, deliver_at=deliver_at,
                              priority=priority)
        engine = self._check_open()
        if not event.bodies:
            return []
        bodies, expires, headers, due = event.bodies, event.expires, event.headers, event.due
        hooks = self.hooks
        if hooks.around_publish:
            hooks.before_publish("event", topic)
        error: BaseException | None = None
        try:
            headers = hooks.outgoing("event", topic, headers)
            return engine.publisher.publish(topic, bodies, expires, headers or None, dedupe_key,
                                            due, latest, priority)
        except StoreError as exc:
            error = exc
            if self._closed or self._store.closed:
                error = BusClosedError("the bus closed before this call completed")
                raise error from None
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            if hooks.around_publish:
                hooks.after_publish("event", topic, error)

    @contextmanager
    def transaction(self) -> Iterator[Transaction]:
        """Group state writes and messages into one atomic, fsynced write::

            with bus.transaction() as tx:
                tx.kv["order:42"] = {"state": "paid"}
                tx.publish("order.paid", {"id": 42})
                tx.send(billing, "invoice.create", {"id": 42})

        ``tx`` has ``kv``, ``publish`` and ``send`` as in a handler (``message.kv`` ...):
        checked when called, stored when the block ends without an exception, all or
        nothing (a crash loses all of it or none). An exception in the block stores
        nothing and propagates. Event ids are made at the commit (they are not returned).
        """
        engine = self._check_open()
        staging = self._dispatcher.runner.staging
        tx = Transaction(self._store, self.config.max_payload, self.hooks.outgoing,
                         engine.publisher.backpressure)
        yield tx
        if tx.empty():
            return
        sends: list = []
        part = f"tx-{os.urandom(8).hex()}"  # outbox keys of its commands: unique

        def rest(batch: Any) -> bool:
            tx.write_state(batch)
            sends[:] = tx.write_sends(batch, part, "bus")
            for letter in tx.letters:
                batch.put_deadletter(engine.ids.next(), letter)
            return False
        with staging.kv_lock if tx.updates else nullcontext():
            tx.resolve_updates()
            self._commit_staged(engine, tx.events, rest)
        if sends:
            engine.publisher.queue_sends(sends)

    def _commit_kv(self, build: Callable[[Any], None]) -> None:
        def rest(batch: Any) -> bool:
            build(batch)
            return False
        self._commit_staged(self._check_open(), [], rest)

    def _commit_staged(self, engine: E.Engine, events: list, rest: Callable[[Any], bool]) -> None:
        try:
            engine.publisher.commit_transaction(events, rest)
        except StoreError:
            if self._closed or self._store.closed:
                raise BusClosedError("the bus closed before this call completed") from None
            raise

    # --- commands and requests ----------------------------------------------------------

    def send(self, address: str, command: str, payload: Any, *, ttl: float | None = None,
             headers: dict[str, Any] | None = None, delay: float | None = None,
             deliver_at: float | datetime | None = None) -> str:
        """Send a durable command to the one bus at ``address``; return its message id.

        Same durability as ``publish``: fsynced before this returns, resent until the
        receiver acks, deduplicated and handled once there. With ``ttl`` (seconds), a
        command not handled in time becomes a dead letter with reason ``expired`` (at the
        sender if it was never acknowledged, at the receiver otherwise). ``delay`` /
        ``deliver_at``: as for ``publish``.
        """
        return self._send(address, command, payload, ttl=ttl, headers=headers,
                          due=due_ms(delay, deliver_at))

    def _send(self, address: str, command: str, payload: Any, *, ttl: float | None,
              headers: dict[str, Any] | None, correlation_id: str | None = None,
              wait: bool = True, due: int | None = None) -> Any:
        address, command, body, expires, headers, due = prepare_command(
            address, command, payload, max_payload=self.config.max_payload, ttl=ttl,
            headers=headers, due=due)
        engine = self._check_open()
        future: Future = Future()
        hooks = self.hooks
        if hooks.around_publish:
            hooks.before_publish("command", command)
        error: BaseException | None = None
        try:
            headers = hooks.outgoing("command", command, headers)
            engine.submit(E.SendCmd(address, command, body, expires, headers or None, correlation_id,
                                    future, due))
            return self._wait(future, None) if wait else future
        except BaseException as exc:
            error = exc
            raise
        finally:
            if hooks.around_publish:
                hooks.after_publish("command", command, error)

    @registration
    def handle(self, command: str, handler: Handler | None = None, *, name: str | None = None,
               timeout: float | None = None, max_attempts: int | None = None, backoff: Backoff | None = None,
               retry_on: Any = None, dead_letter_on: Any = None) -> Any:
        """Handle ``command``: ``handler(payload, message)``; its return value is the reply
        to ``request``. One handler per command (``ValueError`` for a second). Also a
        decorator. For a plain ``send`` a raising handler is retried, then dead-lettered;
        for a ``request`` the exception goes back to the caller as ``RemoteError``.
        ``timeout`` and the retry policy: as for ``every``."""
        validate_topic(command, "command")
        policy = make_policy(max_attempts, backoff, retry_on, dead_letter_on)
        return self._register(Kind.COMMAND, command, handler, name, timeout, policy)

    def request_async(self, address: str, command: str, payload: Any,
                      timeout: float = 30.0, headers: dict[str, Any] | None = None,
                      ttl: float | None = None) -> Future:
        """Send ``command`` as a request; the returned ``concurrent.futures.Future`` gets the
        handler's return value, or raises ``RemoteError`` / ``RequestTimeout``.

        The command is durable and expires with the request: one not started by
        ``timeout`` seconds after this call (``ttl`` seconds, if given) never runs; it is
        dropped where it is (counted as ``requests_expired``, journaled as ``dropped``), not
        dead-lettered, since its caller was told. So ``RequestTimeout`` means the handler
        did not run and will not start, or it was already running at the deadline (its
        reply is then logged and dropped). A ``ttl`` longer than ``timeout`` lets the
        command run later anyway.
        """
        check_seconds(timeout, "timeout")
        if ttl is not None:
            check_seconds(ttl, "ttl")
        self._check_open()  # before the requests' lock (after a fork it may be held)
        corr, future = self._requests.new(timeout, f"{command} at {address}")
        try:
            stored = self._send(address, command, payload, ttl=timeout if ttl is None else ttl,
                                headers=headers, correlation_id=corr, wait=False)
        except BaseException as exc:
            self._requests.fail(corr, exc)
            raise

        def on_stored(f: Future) -> None:
            exc = f.exception()
            if exc is not None:
                self._requests.fail(corr, exc)

        stored.add_done_callback(on_stored)
        return future

    def request(self, address: str, command: str, payload: Any, *, timeout: float = 30.0,
                headers: dict[str, Any] | None = None, ttl: float | None = None) -> Any:
        """Send ``command`` to ``address`` and wait for the reply (see ``request_async``:
        a command not started within ``timeout``, or ``ttl`` if given, never runs)."""
        future = self.request_async(address, command, payload, timeout, headers, ttl)
        try:
            # The engine fails the future at the deadline; the extra second only guards
            # against an engine that stopped.
            return self._wait(future, timeout + 1.0)
        except FutureTimeout:
            raise RequestTimeout(f"no reply to {command} at {address} within {timeout}s") from None

    # --- subscribing -------------------------------------------------------------------

    def subscribe(self, address: str, topic: str, *, wait: float | None = None,
                  group: str | None = None, ordered: bool = False, limit: int | None = None,
                  start: Any = None) -> None:
        """Ask the bus at ``address`` to send this bus its ``topic`` events.

        The request is stored durably and retried until the publisher confirms it, across
        restarts of either side. Idempotent: call it on every start. With ``wait``, block
        until confirmed, raising ``SubscribeTimeout`` after ``wait`` seconds (the request
        stays stored and keeps being retried).

        ``group``: join a subscriber group (competing consumers): each message goes to one
        live member; what a member does not acknowledge within ``ack_timeout`` (dead,
        frozen, partitioned) goes to another. ``ordered``: this bus handles the
        subscription's messages one at a time, in publish order (per ``key`` when
        published with one). Not both. Changing either needs an ``unsubscribe`` first.

        ``limit``: the publisher ends the subscription once it has given this bus that many
        messages (acknowledged here; expired ones do not count), as an ``unsubscribe``
        would. Subscribing again starts a new one.

        ``start``: where a new subscription begins: ``"new"`` (the default: events published
        from now on), ``"earliest"`` (everything the publisher retains, then live), an aware
        ``datetime`` or POSIX timestamp (retained events published from then on), or a
        message id (that event and the ones after it; inside a ``publish_many``, from that
        publish). The publisher must retain the topic (``Bus(retention=...)``) for there to
        be anything before now. It counts when the
        publisher makes the subscription, not on repeats: calling this on every start
        replays once.
        """
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"limit must be an int >= 1, not {limit!r}")
        if limit is not None and group is not None:
            raise ValueError("a subscriber group cannot have a limit (its members share one cursor)")
        if group is not None:
            validate_group(group)
            if ordered:
                raise ValueError("a subscriber group cannot be ordered: its members handle "
                                 "messages in parallel (subscribe ordered=True without a group)")
        if not isinstance(ordered, bool):
            raise TypeError(f"ordered must be a bool, not {type(ordered).__name__}")
        self._intent(address, topic, "subscribe", wait, group, ordered, limit, start_token(start))

    def unsubscribe(self, address: str, topic: str, *, wait: float | None = None) -> None:
        """Stop ``topic`` events from ``address``; durable and retried like ``subscribe``."""
        self._intent(address, topic, "unsubscribe", wait)

    def _intent(self, address: str, topic: str, op: str, wait: float | None,
                group: str | None = None, ordered: bool = False, limit: int | None = None,
                start: str | None = None) -> None:
        validate_target(address)
        validate_pattern(topic)
        confirmed: Future | None = Future() if wait is not None else None
        target = SERVICE + address if is_service(address) else address  # every instance of it
        self._call(lambda f: E.SubscribeCmd(target, topic, op, f, confirmed, group, ordered, limit, start))
        if confirmed is not None:
            try:
                self._wait(confirmed, wait)
            except FutureTimeout:
                raise SubscribeTimeout(
                    f"{op} of {topic!r} at {address} not confirmed within {wait}s; "
                    "it stays stored and is retried") from None

    # --- handlers ----------------------------------------------------------------------

    @registration
    def every(self, topic: str, handler: Handler | None = None, *, name: str | None = None,
              timeout: float | None = None, max_attempts: int | None = None, backoff: Backoff | None = None,
              retry_on: Any = None, dead_letter_on: Any = None) -> Any:
        """Run ``handler(payload, message)`` for each ``topic`` event (also a decorator).

        Returning marks the message done; raising retries it with backoff, then moves it
        to the dead letters. Several handlers on one topic: done when all returned; each
        needs a name that is stable across restarts and distinct (``name``; by default the
        function's module and qualified name, ``@topic`` added for a lambda or where another
        topic's handler has it), as the names of the finished ones are stored.

        ``timeout`` (seconds): a run that takes longer gets ``HandlerTimeout`` raised inside
        it (at its next Python instruction: a call blocked in C is interrupted when it
        returns) and counts as a failed attempt (timeouts.py).

        This handler's own retry policy, else the bus's options (policy.py): ``max_attempts``,
        ``backoff`` ((initial, cap) seconds, or attempt -> seconds), ``retry_on`` (only these
        exception classes retry) and ``dead_letter_on`` (these dead-letter at once, reason
        ``rejected``).
        """
        validate_pattern(topic)
        policy = make_policy(max_attempts, backoff, retry_on, dead_letter_on)
        return self._register(Kind.EVENT, topic, handler, name, timeout, policy)

    def asyncapi(self, *, title: str | None = None, version: str = "1.0.0",
                 description: str | None = None) -> dict[str, Any]:
        """This service's AsyncAPI 3.0 document, a dict (JSON as it is): the topics and
        patterns it handles, the commands it handles, the topics it subscribes to (stored
        subscriptions, this run's and earlier ones') and its typed handlers' payload schemas
        (handling/asyncapi.py). ``servicebus asyncapi MODULE:ATTR`` prints it."""
        self._check_open()
        subscribed = [(pub, topic) for pub, topic, intent in self._store.intents()
                      if intent.get("op") == "subscribe"]
        return document(self.address, self._dispatcher.registry, subscribed, title=title,
                        version=version, description=description)

    def _register(self, kind: Kind, topic: str, handler: Handler | None, name: str | None = None,
                  timeout: float | None = None, policy: Policy | None = None) -> Any:
        """Register now, or return a decorator that does (``every`` and ``handle``)."""
        if timeout is not None:
            check_seconds(timeout, "timeout")

        def register(fn: Handler) -> Handler:
            if not callable(fn):
                raise TypeError(f"handler must be callable, not {type(fn).__name__}")
            self._check_open()
            derived = handler_name(fn)  # of the function itself, not of the time limit's wrapper
            run, payload = typed(fn)  # validates the payload into its annotated model, if any
            if timeout is not None:
                run = self._watchdog.limit(run, timeout, name or derived or topic)
            self._dispatcher.register(kind, topic, run, name, derived, policy, payload)
            return fn

        return register if handler is None else register(handler)
