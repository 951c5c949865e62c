"""``AsyncStubBus``: ``StubBus`` for code written against ``AsyncBus``.

The same in-memory bus on the same clock, with ``AsyncBus``'s calls: what ``AsyncBus``
awaits is awaited here too, ``every``/``handle`` register at once, ``transaction`` is an
``async with``. ``await stub.drain()`` runs the handlers (``async def`` ones on the test's
own loop), so a test of asyncio code reads as the service does.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

import asyncio

from ..aio import AsyncKeyValue, async_transaction
from ..handling.handlers import Handler
from ..handling.typed import registration
from ..model.records import BusStatus, DeadLetter, Message
from .stub import Sent, StubBus
from .stubcalls import Drained

__all__ = ["AsyncStubBus"]


class AsyncStubBus:
    """``AsyncStubBus(address, **options)``: see the module docstring; ``stub`` is the
    ``StubBus`` under it (``published``, ``sent``, ``advance`` are also here)."""

    def __init__(self, address: str = "tcp://127.0.0.1:1", **options: Any) -> None:
        self.stub = StubBus(address, **options)

    # --- what a test asserts on and moves ---------------------------------------------

    @property
    def address(self) -> str:
        return self.stub.address

    @property
    def published(self) -> list[Sent]:
        return self.stub.published

    @property
    def sent(self) -> list[Sent]:
        return self.stub.sent

    def advance(self, seconds: float) -> None:
        self.stub.advance(seconds)

    def now_ms(self) -> int:
        return self.stub.now_ms()

    def pending(self) -> int:
        return self.stub.pending()

    # --- AsyncBus's calls ---------------------------------------------------------------

    async def publish(self, topic: str, payload: Any, **options: Any) -> str:
        return self.stub.publish(topic, payload, **options)

    async def publish_many(self, topic: str, payloads: Iterable[Any], **options: Any) -> list[str]:
        return self.stub.publish_many(topic, payloads, **options)

    async def send(self, address: str, command: str, payload: Any, **options: Any) -> str:
        return self.stub.send(address, command, payload, **options)

    async def request(self, address: str, command: str, payload: Any, *, timeout: float = 30.0,
                      headers: dict[str, Any] | None = None, ttl: float | None = None) -> Any:
        """As ``StubBus.request``; an ``async def`` fake runs on this loop."""
        future = self.request_async(address, command, payload, timeout, headers, ttl)
        return await future

    def request_async(self, address: str, command: str, payload: Any, timeout: float = 30.0,
                      headers: dict[str, Any] | None = None, ttl: float | None = None) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        call = functools.partial(self.stub.request_async, address, command, payload, timeout, headers, ttl)

        async def in_thread() -> Any:
            # The fake may be async def: it runs on this loop while the stub waits in a thread.
            self.stub._loop = loop
            try:
                done: Future = await asyncio.to_thread(call)
            finally:
                self.stub._loop = None
            return done.result()

        return asyncio.ensure_future(in_thread())

    async def subscribe(self, address: str, topic: str, **options: Any) -> None:
        self.stub.subscribe(address, topic, **options)

    async def unsubscribe(self, address: str, topic: str, **options: Any) -> None:
        self.stub.unsubscribe(address, topic, **options)

    async def drain(self, timeout: float | None = None) -> Drained:
        return await self.stub.drain_async(timeout)

    async def status(self) -> BusStatus:
        return self.stub.status()

    async def deadletters(self, limit: int | None = None) -> list[DeadLetter]:
        return self.stub.deadletters(limit)

    async def replay(self, ids: Iterable[str] | None = None, *, topic: str | None = None,
                     reason: str | None = None) -> int:
        return self.stub.replay(ids, topic=topic, reason=reason)

    async def purge(self, ids: Iterable[str] | None = None, *, topic: str | None = None,
                    reason: str | None = None) -> int:
        return self.stub.purge(ids, topic=topic, reason=reason)

    async def counters(self) -> dict[str, int]:
        return self.stub.counters()

    async def fleet(self) -> list[dict[str, Any]]:
        return self.stub.fleet()

    async def kick(self, target: str, *, why: str = "") -> dict[str, Any]:
        return self.stub.kick(target, why=why)

    async def readmit(self, target: str) -> None:
        self.stub.readmit(target)

    async def once(self, topic: str, *, timeout: float | None = None) -> tuple[Any, Message]:
        return await self._in_thread(functools.partial(self.stub.once, topic, timeout=timeout))

    async def any(self, topics: Iterable[str], *, timeout: float | None = None) -> tuple[str, Any, Message]:
        return await self._in_thread(functools.partial(self.stub.any, list(topics), timeout=timeout))

    async def all(self, topics: Iterable[str], *, timeout: float | None = None) -> dict[str, tuple[Any, Message]]:
        return await self._in_thread(functools.partial(self.stub.all, list(topics), timeout=timeout))

    async def _in_thread(self, call: Any) -> Any:
        """Run a call that drains in a thread, with ``async def`` handlers on this loop."""
        self.stub._loop = asyncio.get_running_loop()
        try:
            return await asyncio.to_thread(call)
        finally:
            self.stub._loop = None

    @registration
    def every(self, topic: str, handler: Handler | None = None, *, name: str | None = None,
              timeout: float | None = None, **policy: Any) -> Any:
        return self.stub.every(topic, handler, name=name, timeout=timeout, **policy)

    @registration
    def handle(self, command: str, handler: Handler | None = None, *, name: str | None = None,
               timeout: float | None = None, **policy: Any) -> Any:
        return self.stub.handle(command, handler, name=name, timeout=timeout, **policy)

    def asyncapi(self, **options: Any) -> dict[str, Any]:
        return self.stub.asyncapi(**options)

    @property
    def kv(self) -> AsyncKeyValue:
        return AsyncKeyValue(self.stub.kv)

    def transaction(self) -> Any:
        return async_transaction(self.stub.transaction())

    @property
    def closed(self) -> bool:
        return self.stub.closed

    async def close(self) -> None:
        self.stub.close()

    async def __aenter__(self) -> "AsyncStubBus":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
