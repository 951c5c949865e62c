"""What ``StubBus`` has beside running handlers, so that it has every public call of ``Bus``:
``drain``'s answer (what is left and why), ``once``/``any``/``all``, ``status``,
``counters``, ``request_async``, ``transaction`` and ``drain_async``. A mixin over
``stub.py``'s state, one concern: the calls a test makes around its handlers."""

from __future__ import annotations

import asyncio
import inspect
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import WaitTimeout
from ..handling.handlers import Handlers
from ..handling.transaction import KeyValue, Transaction
from ..model.config import BusConfig
from ..model.outgoing import check_seconds, prepare_command, prepare_event
from ..model.records import BusStatus, DeadLetter, Message
from ..wire.payload import decode_payload
from ..wire.protocol import Kind
from ..wire.topics import matches, validate_pattern

__all__ = ["Drained", "StubCalls", "STUB_COUNTERS"]

# Counters a StubBus keeps, present from the start at zero (Bus.counters() has more: the
# network's and the store's, which a stub has not).
STUB_COUNTERS = ("published", "sent", "handled", "failed", "retried", "rejected", "deadletters",
                 "expired")


@dataclass(frozen=True)
class Drained:
    """``StubBus.drain()``'s answer: true when nothing is left; otherwise false, and
    ``left`` says what is left and why, so that ``assert stub.drain()`` fails with the
    reason in pytest's message."""

    left: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return not self.left

    def __repr__(self) -> str:
        return "Drained(nothing left)" if not self.left else f"Drained(left: {'; '.join(self.left)})"


class _StubMisuse(RuntimeError):
    """A call the stub cannot do as asked (an ``async def`` handler run by ``drain()`` inside
    a running event loop): raised out of ``drain``, never counted as a handler's failure."""


class StubTransaction:
    """``StubBus.transaction()``'s ``tx``: ``kv``, ``publish`` and ``send`` checked at once,
    applied when the block ends without an exception."""

    def __init__(self, tx: Transaction, calls: list[Callable[[], Any]], stub: "StubCalls") -> None:
        self._tx, self._calls, self._stub = tx, calls, stub

    @property
    def kv(self) -> Any:
        return self._tx.kv

    def publish(self, topic: str, payload: Any, **options: Any) -> None:
        prepare_event(topic, [payload], max_payload=self._stub.config.max_payload, **options)  # the checks
        self._calls.append(lambda: self._stub.publish(topic, payload, **options))

    def send(self, address: str, command: str, payload: Any, **options: Any) -> None:
        prepare_command(address, command, payload, max_payload=self._stub.config.max_payload,
                        ttl=options.get("ttl"), headers=options.get("headers"))
        self._calls.append(lambda: self._stub.send(address, command, payload, **options))


class StubCalls:
    """The mixin; ``StubBus.__init__`` calls ``_init_calls``."""

    # What the mixin uses of StubBus (stub.py), declared here rather than imported: stub.py
    # imports this module.
    config: BusConfig
    node_id: str
    address: str
    kv: KeyValue
    _queue: list[Any]
    _letters: list[DeadLetter]
    _dead_msgs: dict[str, Any]
    _handlers: Handlers
    _now_ms: int
    _closed: bool
    _state: Any
    publish: Callable[..., str]
    send: Callable[..., str]

    if TYPE_CHECKING:
        def drain(self, timeout: float | None = None) -> Drained: ...
        def request(self, address: str, command: str, payload: Any, *, timeout: float = 30.0,
                    headers: dict[str, Any] | None = None, ttl: float | None = None) -> Any: ...
        def _check_open(self) -> None: ...
        def _enqueue(self, msg: Any, due: int, priority: int) -> None: ...

    # --- the fleet: a stub is alone ----------------------------------------------------------

    def fleet(self) -> list[dict[str, Any]]:
        """No discovery in a stub: no instance but this one."""
        return []

    def kick(self, target: str, *, why: str = "") -> dict[str, Any]:
        raise ValueError(f"{target!r} is no instance, address or service this bus knows (a stub knows none)")

    def readmit(self, target: str) -> None:
        raise ValueError(f"{target!r} is not kicked")

    # --- dead letters, as Bus.replay/purge ---------------------------------------------------

    def replay(self, ids: Iterable[str] | None = None, *, topic: str | None = None,
               reason: str | None = None) -> int:
        """The letters selected (as ``Bus.replay``) run again at the next ``drain``, attempts
        reset; returns how many."""
        chosen = self._chosen(ids, topic, reason)
        for letter in chosen:
            msg = self._dead_msgs.pop(letter.id)
            msg.attempts, msg.done = 0, ()
            self._enqueue(msg, self._now_ms, 0)
        return len(chosen)

    def purge(self, ids: Iterable[str] | None = None, *, topic: str | None = None,
              reason: str | None = None) -> int:
        """The letters selected (as ``Bus.purge``) are deleted; returns how many."""
        chosen = self._chosen(ids, topic, reason)
        for letter in chosen:
            self._dead_msgs.pop(letter.id, None)
        return len(chosen)

    def _chosen(self, ids: Iterable[str] | None, topic: str | None, reason: str | None) -> list[DeadLetter]:
        """Take the letters selected out of the list (``ValueError``, none taken, for an id
        that is no dead letter)."""
        self._check_open()
        wanted = None if ids is None else {ids} if isinstance(ids, str) else set(ids)
        missing = sorted((wanted or set()) - {d.id for d in self._letters})
        if missing:
            raise ValueError(f"no such dead letter: {', '.join(missing)}; nothing was done")
        chosen = [d for d in self._letters if (wanted is None or d.id in wanted)
                  and topic in (None, d.topic) and reason in (None, d.reason)]
        taken = {d.id for d in chosen}
        self._letters = [d for d in self._letters if d.id not in taken]
        return chosen

    def _init_calls(self) -> None:
        self._counts: Counter[str] = Counter({name: 0 for name in STUB_COUNTERS})
        # pattern -> the first (payload, message) seen since a once/any/all began
        self._seen: dict[str, tuple[Any, Message]] | None = None
        self._watching: tuple[str, ...] = ()
        self._loop: asyncio.AbstractEventLoop | None = None  # drain_async's, while it runs
        self._own_loop: asyncio.AbstractEventLoop | None = None  # async handlers under drain()

    # --- drain's answer ---------------------------------------------------------------------

    def _left(self) -> Drained:
        reasons: Counter[str] = Counter()
        for due, _prio, _seq, msg in self._queue:
            what = f"{msg.kind.name.lower()} {msg.topic!r}"
            if msg.attempts and self._handlers.get((int(msg.kind), msg.topic)):
                reasons[f"{what}: a retry due in {(due - self._now_ms) / 1000:g} s on the stub's clock "
                        "(advance() past it, then drain again)"] += 1
            elif due > self._now_ms and self._handlers.get((int(msg.kind), msg.topic)):
                reasons[f"{what}: delayed, due in {(due - self._now_ms) / 1000:g} s on the stub's clock "
                        "(advance() past it, then drain again)"] += 1
            else:
                reasons[f"{what}: no handler on this stub (register one, or a fake, with "
                        "every()/handle(), then drain again)"] += 1
        return Drained(tuple(f"{n} x {reason}" for reason, n in reasons.items()))

    # --- once / any / all -----------------------------------------------------------------

    def _saw(self, kind: Kind, topic: str, body: bytes, message: Callable[[], Message]) -> None:
        """Give an event to the once/any/all that waits for it."""
        if self._seen is None or kind is not Kind.EVENT:
            return
        for pattern in self._watching:
            if pattern not in self._seen and matches(pattern, topic):
                self._seen[pattern] = (decode_payload(body), message())

    def _watch(self, patterns: tuple[str, ...], need_all: bool) -> dict[str, tuple[Any, Message]]:
        if not patterns:
            raise ValueError("give at least one topic")
        for pattern in patterns:
            validate_pattern(pattern)
        self._check_open()
        self._watching, self._seen = patterns, {}
        try:
            self.drain()
            got = self._seen
        finally:
            self._seen = None
        if (need_all and len(got) < len(patterns)) or not got:
            missing = [p for p in patterns if p not in got]
            raise WaitTimeout(f"no event on {', '.join(map(repr, missing))} in what drain() ran "
                              "(the stub's clock moves only with advance())")
        if not need_all:
            first = next(iter(got))
            return {first: got[first]}
        return got

    def once(self, topic: str, *, timeout: float | None = None) -> tuple[Any, Message]:
        """As ``Bus.once``: runs ``drain()`` and returns the first event on ``topic`` it
        ran; ``WaitTimeout`` if none (``timeout`` is checked, never waited)."""
        if timeout is not None:
            check_seconds(timeout, "timeout")
        return self._watch((topic,), False)[topic]

    def any(self, topics: Iterable[str], *, timeout: float | None = None) -> tuple[str, Any, Message]:
        if timeout is not None:
            check_seconds(timeout, "timeout")
        (pattern, (payload, message)), = self._watch(tuple(topics), False).items()
        return pattern, payload, message

    def all(self, topics: Iterable[str], *, timeout: float | None = None) -> dict[str, tuple[Any, Message]]:
        if timeout is not None:
            check_seconds(timeout, "timeout")
        return self._watch(tuple(topics), True)

    # --- status, counters, request_async, transaction ---------------------------------------

    def counters(self) -> dict[str, int]:
        """Counts since the stub was made: published, sent, handled, failed, retried,
        rejected, deadletters, expired (all present, from zero)."""
        return dict(self._counts)

    def status(self) -> BusStatus:
        """A ``BusStatus`` of the stub: ``incoming`` is what ``drain`` has still to run."""
        return BusStatus(node_id=self.node_id, address=self.address, datadir="", running=not self._closed,
                         subscriptions=0, intents=0, intents_unconfirmed=0, outgoing=0, pending=0,
                         pending_by_subscriber={}, incoming=len(self._queue),
                         deadletters=len(self._letters), handled=self._counts["handled"], malformed=0,
                         malformed_by_reason={}, peers=())

    def request_async(self, address: str, command: str, payload: Any, timeout: float = 30.0,
                      headers: dict[str, Any] | None = None, ttl: float | None = None) -> Future:
        """As ``Bus.request_async``: a future that is already done (``request``'s value or
        its exception)."""
        future: Future = Future()
        try:
            future.set_result(self.request(address, command, payload, timeout=timeout,
                                           headers=headers, ttl=ttl))
        except Exception as exc:  # noqa: BLE001 - the future carries it, as on a bus
            future.set_exception(exc)
        return future

    @contextmanager
    def transaction(self) -> Iterator[StubTransaction]:
        """As ``Bus.transaction``: kv writes, publishes and sends applied together when the
        block ends without an exception, none of them otherwise."""
        self._check_open()
        tx = Transaction(self._state, self.config.max_payload)
        calls: list[Callable[[], Any]] = []
        yield StubTransaction(tx, calls, self)
        tx.resolve_updates()
        tx.write_state(self._state)
        for call in calls:
            call()

    # --- async def handlers ---------------------------------------------------------------

    def _await(self, value: Awaitable[Any]) -> Any:
        """The result of an ``async def`` handler's coroutine: on ``drain_async``'s loop
        (the test's own), else on a loop of the stub's when no loop runs in this thread."""
        if self._loop is not None:
            return asyncio.run_coroutine_threadsafe(_as_coroutine(value), self._loop).result()
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            if self._own_loop is None:
                self._own_loop = asyncio.new_event_loop()
            return self._own_loop.run_until_complete(value)
        if inspect.iscoroutine(value):
            value.close()  # never awaited: say why instead of Python's warning
        raise _StubMisuse("an async def handler cannot run under drain() inside a running event "
                          "loop: use 'await stub.drain_async()'")

    async def drain_async(self, timeout: float | None = None) -> Drained:
        """``drain()`` for an ``async def`` test: async handlers run on the test's loop
        (so they may use what that loop owns), the stub's work in a thread meanwhile."""
        self._loop = asyncio.get_running_loop()
        try:
            return await asyncio.to_thread(self.drain, timeout)
        finally:
            self._loop = None

    def _close_calls(self) -> None:
        if self._own_loop is not None:
            self._own_loop.close()
            self._own_loop = None


async def _as_coroutine(value: Awaitable[Any]) -> Any:
    return await value
