"""``AsyncBus``: the same bus for asyncio code.

It wraps a ``Bus`` (one engine, the same durability): calls that wait on the store or the
network run in threads (``asyncio.to_thread``) or as futures the loop awaits
(``asyncio.wrap_future``), so the loop never blocks on an fsync. ``async def`` handlers run
on the loop the bus was opened on; the worker thread that runs the message waits for the
coroutine, so a handler's completion is recorded only once it returned, exactly as for a
plain handler (a raise is a retry, then a dead letter). A handler's ``timeout`` cancels
its coroutine on the loop (``HandlerTimeout`` in its place). Plain handlers still run on
the worker threads. ``async with AsyncBus(...)`` closes it when the block ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import sys
from collections.abc import AsyncIterator, Coroutine, Iterable
from typing import Any

from .bus import Bus
from .busstate import OWN_PAYLOAD
from .handling.handlers import Handler, handler_name
from .handling.typed import registration
from .model.outgoing import check_seconds
from .model.records import BusStatus, DeadLetter, Message
from .handling.timeouts import HandlerTimeout, timeout_text

__all__ = ["AsyncBus", "AsyncKeyValue", "async_transaction"]


class AsyncBus:
    """``AsyncBus(bind, datadir, **options)``: as ``Bus``, made on a running loop."""

    def __init__(self, bind: str, datadir: Any, **options: Any) -> None:
        self._loop = asyncio.get_running_loop()  # async handlers run here
        self.bus = Bus(bind, datadir, **options)

    @property
    def address(self) -> str:
        return self.bus.address

    async def publish(self, topic: str, payload: Any, **options: Any) -> str:
        return await asyncio.to_thread(self.bus.publish, topic, payload, **options)

    async def publish_many(self, topic: str, payloads: Iterable[Any], **options: Any) -> list[str]:
        return await asyncio.to_thread(self.bus.publish_many, topic, list(payloads), **options)

    async def send(self, address: str, command: str, payload: Any, **options: Any) -> str:
        return await asyncio.to_thread(self.bus.send, address, command, payload, **options)

    async def request(self, address: str, command: str, payload: Any, *, timeout: float = 30.0,
                      headers: dict[str, Any] | None = None, ttl: float | None = None) -> Any:
        """As ``Bus.request``, awaited without a thread: the reply arrives as a future."""
        future = self.bus.request_async(address, command, payload, timeout, headers, ttl)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout + 1.0)
        except asyncio.TimeoutError:
            from .errors import RequestTimeout

            raise RequestTimeout(f"no reply to {command} at {address} within {timeout}s") from None

    async def subscribe(self, address: str, topic: str, **options: Any) -> None:
        await asyncio.to_thread(self.bus.subscribe, address, topic, **options)

    async def unsubscribe(self, address: str, topic: str, **options: Any) -> None:
        await asyncio.to_thread(self.bus.unsubscribe, address, topic, **options)

    async def drain(self, timeout: float | None = None) -> bool:
        return await asyncio.to_thread(self.bus.drain, timeout)

    async def status(self) -> BusStatus:
        return await asyncio.to_thread(self.bus.status)

    async def deadletters(self, limit: int | None = None) -> list[DeadLetter]:
        return await asyncio.to_thread(self.bus.deadletters, limit)

    async def replay(self, ids: Iterable[str] | None = None, *, topic: str | None = None,
                     reason: str | None = None, payload: Any = OWN_PAYLOAD) -> int:
        return await asyncio.to_thread(self.bus.replay, ids, topic=topic, reason=reason, payload=payload)

    async def purge(self, ids: Iterable[str] | None = None, *, topic: str | None = None,
                    reason: str | None = None) -> int:
        return await asyncio.to_thread(self.bus.purge, ids, topic=topic, reason=reason)

    async def counters(self) -> dict[str, int]:
        return await asyncio.to_thread(self.bus.counters)

    async def fleet(self) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.bus.fleet)

    async def kick(self, target: str, *, why: str = "") -> dict[str, Any]:
        return await asyncio.to_thread(functools.partial(self.bus.kick, target, why=why))

    async def readmit(self, target: str) -> None:
        await asyncio.to_thread(self.bus.readmit, target)

    async def once(self, topic: str, *, timeout: float | None = None) -> tuple[Any, Message]:
        """As ``Bus.once``, waited for in a thread (give a ``timeout``: a cancelled await
        leaves the thread waiting until it passes)."""
        return await asyncio.to_thread(functools.partial(self.bus.once, topic, timeout=timeout))

    async def any(self, topics: Iterable[str], *, timeout: float | None = None) -> tuple[str, Any, Message]:
        return await asyncio.to_thread(functools.partial(self.bus.any, list(topics), timeout=timeout))

    async def all(self, topics: Iterable[str], *, timeout: float | None = None) -> dict[str, tuple[Any, Message]]:
        return await asyncio.to_thread(functools.partial(self.bus.all, list(topics), timeout=timeout))

    def request_async(self, address: str, command: str, payload: Any, timeout: float = 30.0,
                      headers: dict[str, Any] | None = None, ttl: float | None = None) -> asyncio.Future:
        """As ``Bus.request_async``, as an asyncio future of this loop."""
        return asyncio.wrap_future(self.bus.request_async(address, command, payload, timeout, headers, ttl))

    @property
    def kv(self) -> "AsyncKeyValue":
        """``Bus.kv`` with each call awaited (a write waits for its fsync in a thread)."""
        return AsyncKeyValue(self.bus.kv)

    @property
    def closed(self) -> bool:
        return self.bus.closed

    def transaction(self) -> Any:
        """``async with bus.transaction() as tx:`` as ``Bus.transaction`` (``tx``'s calls
        are not awaited: they only stage); the commit's fsync is awaited in a thread."""
        return async_transaction(self.bus.transaction())

    @registration
    def every(self, topic: str, handler: Handler | None = None, *, name: str | None = None,
              timeout: float | None = None, **policy: Any) -> Any:
        """As ``Bus.every`` (``policy``: its ``max_attempts``, ``backoff``, ``retry_on``,
        ``dead_letter_on``); ``handler`` may be an ``async def``."""
        return self._register(self.bus.every, topic, handler, name, timeout, policy)

    @registration
    def handle(self, command: str, handler: Handler | None = None, *, name: str | None = None,
               timeout: float | None = None, **policy: Any) -> Any:
        """As ``Bus.handle``; ``handler`` may be an ``async def`` (its return value is the
        reply)."""
        return self._register(self.bus.handle, command, handler, name, timeout, policy)

    def _register(self, register: Any, topic: str, handler: Handler | None, name: str | None,
                  timeout: float | None, policy: dict[str, Any]) -> Any:
        if timeout is not None:
            check_seconds(timeout, "timeout")

        def add(fn: Handler) -> Handler:
            if not inspect.iscoroutinefunction(fn):
                register(topic, fn, name=name, timeout=timeout, **policy)
                return fn
            loop = self._loop
            label = name or handler_name(fn) or topic

            @functools.wraps(fn)  # the bus derives the handler's stable name from fn's
            def run(payload: Any, message: Message) -> Any:
                # On a worker thread: the coroutine runs on the loop; this thread waits,
                # so the message is done only when the coroutine returned.
                try:
                    return asyncio.run_coroutine_threadsafe(
                        _contained(_limited(fn(payload, message), timeout, label)), loop).result()
                except _Escaped as escaped:
                    raise escaped.original from None  # a failed attempt (runner.py)

            # The time limit is the loop's (the coroutine is cancelled), not the worker's: an
            # exception raised in the waiting thread would land only after the coroutine ended.
            register(topic, run, name=name, timeout=None, **policy)
            return fn

        return add if handler is None else add(handler)

    def asyncapi(self, **options: Any) -> dict[str, Any]:
        """As ``Bus.asyncapi`` (in memory and a short read: not awaited)."""
        return self.bus.asyncapi(**options)

    async def close(self) -> None:
        """Close the bus; handlers still running get ``close_timeout`` to finish (async ones
        need the loop running meanwhile: this awaits in a thread)."""
        await asyncio.to_thread(self.bus.close)

    async def __aenter__(self) -> "AsyncBus":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncKeyValue:
    """A ``KeyValue`` (``Bus.kv``, ``StubBus.kv``) whose calls are awaited."""

    def __init__(self, kv: Any) -> None:
        self._kv = kv

    async def get(self, key: str, default: Any = None) -> Any:
        return await asyncio.to_thread(self._kv.get, key, default)

    async def items(self, prefix: str = "") -> list[tuple[str, Any]]:
        return await asyncio.to_thread(self._kv.items, prefix)

    async def put(self, key: str, value: Any) -> None:
        await asyncio.to_thread(self._kv.put, key, value)

    async def delete(self, key: str) -> None:
        await asyncio.to_thread(self._kv.delete, key)

    async def update(self, key: str, fn: Any, default: Any = None) -> Any:
        return await asyncio.to_thread(self._kv.update, key, fn, default)


@contextlib.asynccontextmanager
async def async_transaction(sync: contextlib.AbstractContextManager) -> AsyncIterator[Any]:
    """A synchronous transaction context (``Bus.transaction()``) for ``async with``: entered
    at once (it only makes the staging object), committed in a thread."""
    tx = sync.__enter__()
    try:
        yield tx
    except BaseException:
        if not sync.__exit__(*sys.exc_info()):  # stores nothing
            raise
        return
    await asyncio.to_thread(sync.__exit__, None, None, None)


class _Escaped(Exception):
    """Carries a ``SystemExit`` or ``KeyboardInterrupt`` an async handler raised past the
    loop to the worker thread: asyncio re-raises those two out of the running loop, which
    would end the service's ``asyncio.run`` for one message's handler."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(repr(original))
        self.original = original


async def _contained(coro: Coroutine[Any, Any, Any]) -> Any:
    try:
        return await coro
    except (SystemExit, KeyboardInterrupt) as exc:
        raise _Escaped(exc) from None


async def _limited(coro: Coroutine[Any, Any, Any], seconds: float | None, name: str) -> Any:
    """``coro``, cancelled past ``seconds`` with ``HandlerTimeout`` raised in its place; a
    ``TimeoutError`` of the handler's own (its own ``asyncio.timeout``) stays what it is."""
    if seconds is None:
        return await coro
    try:
        async with asyncio.timeout(seconds) as limit:
            return await coro
    except TimeoutError:
        if limit.expired():
            raise HandlerTimeout(timeout_text(name, seconds)) from None
        raise
