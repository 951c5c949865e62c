"""Push subscribers (webhooks): a pull subscriber the gateway reads itself and POSTs to a URL.

Each message goes as ``POST url`` with the JSON ``{"id", "topic", "payload", "headers",
"attempt", "published"}`` and the headers ``X-Servicebus-Id``, ``X-Servicebus-Timestamp``
(epoch seconds) and ``X-Servicebus-Signature: sha256=<hex>``, the HMAC-SHA256 with the
subscriber's secret of ``timestamp + "." + body``: a receiver checks it (and the timestamp's
age, against replays) before it trusts the message. A 2xx acknowledges it; anything else
(or no answer within 10 s) leaves it to come back after the visibility duration, doubled per
attempt up to 5 minutes (gateway/pull.py ``read``); after ``max_attempts`` it is a dead letter, as for a pull
subscriber. At least once: a receiver that answered 2xx after a crash of the gateway may
get it again (``X-Servicebus-Id`` tells it).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from .pull import PullQueues, Sub

__all__ = ["Pusher", "sign"]

log = logging.getLogger("servicebus.gateway")

BATCH = 20
TIMEOUT = 10.0


def sign(secret: str, timestamp: str, body: bytes) -> str:
    digest = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


class Pusher:
    def __init__(self, queues: PullQueues, run: Callable[..., Awaitable[Any]],
                 counters: dict[str, int]) -> None:
        self.queues = queues
        self.run = run
        self._tasks: dict[tuple[str, str], asyncio.Task] = {}
        self._session: aiohttp.ClientSession | None = None
        self.counters = counters  # the gateway's: pushed, push_failed (on /metrics)

    def sync(self) -> None:
        """One task per push subscriber (started, or stopped when it went)."""
        for key, sub in self.queues.subs.items():
            if sub.push and key not in self._tasks:
                self._tasks[key] = asyncio.ensure_future(self._loop(sub))
        for key in [k for k in self._tasks if k not in self.queues.subs or not self.queues.subs[k].push]:
            self._tasks.pop(key).cancel()

    async def _loop(self, sub: Sub) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT))
        while not sub.deleted and sub.push:
            taken = await self.queues.read(sub, BATCH, self.run)
            if not taken:
                await self.queues.wait(sub, 5.0)
                continue
            done = await asyncio.gather(*(self._post(sub, item) for item in taken))
            acked = [item["id"] for item, ok in zip(taken, done) if ok]
            if acked:
                await self.run(self.queues.ack, sub, acked)
                self.queues.acked(sub, acked)

    async def _post(self, sub: Sub, item: dict[str, Any]) -> bool:
        assert self._session is not None and sub.push is not None
        body = json.dumps({"id": item["id"], "topic": sub.topic, "payload": item.get("payload"),
                           "headers": item.get("headers"), "attempt": item.get("attempts"),
                           "published": item.get("published")}, default=str).encode()
        stamp = str(int(time.time()))
        headers = {"Content-Type": "application/json", "X-Servicebus-Id": item["id"],
                   "X-Servicebus-Timestamp": stamp,
                   "X-Servicebus-Signature": sign(sub.push.get("secret", ""), stamp, body)}
        try:
            async with self._session.post(sub.push["url"], data=body, headers=headers) as response:
                ok = 200 <= response.status < 300
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            log.info("push of %s to %s failed: %s", item["id"], sub.push["url"], exc)
            ok = False
        self.counters["pushed" if ok else "push_failed"] += 1
        return ok

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        if self._session is not None:
            await self._session.close()
