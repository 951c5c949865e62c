"""Requests waiting for their replies, keyed by correlation id.

A correlation id is ``<boot>-<n>``: ``boot`` is random per ``Bus`` instance. A reply whose
correlation id carries this instance's boot but matches no waiting request was for a
request that timed out: it is logged and dropped. A reply for another boot was for an
earlier run of this service (restarted before the reply came): nobody can receive it, so
it stays in the incoming store where the CLI shows it.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from concurrent.futures import Future
from typing import Any

from ..errors import RemoteError, RequestTimeout

__all__ = ["PendingRequests"]


class PendingRequests:
    def __init__(self) -> None:
        self.boot = os.urandom(6).hex()
        self._counter = itertools.count(1)
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[Future, float, str]] = {}
        self._closed: BaseException | None = None

    def new(self, timeout: float, what: str) -> tuple[str, Future]:
        corr = f"{self.boot}-{next(self._counter)}"
        future: Future = Future()
        with self._lock:
            if self._closed is not None:  # nobody would ever complete or expire it
                raise type(self._closed)(str(self._closed))
            self._waiting[corr] = (future, time.monotonic() + timeout, what)
        return corr, future

    def is_ours(self, corr: str | None) -> bool:
        return corr is not None and corr.startswith(self.boot + "-")

    def fail(self, corr: str, exc: BaseException) -> None:
        with self._lock:
            entry = self._waiting.pop(corr, None)
        if entry is not None and not entry[0].done():
            entry[0].set_exception(exc)

    def resolve(self, corr: str | None, reply: dict[str, Any]) -> bool:
        """Complete the request waiting on ``corr``; False if none is (any more)."""
        with self._lock:
            entry = self._waiting.pop(corr, None) if corr else None
        if entry is None:
            return False
        future = entry[0]
        if future.done():
            return True
        if reply.get("ok"):
            future.set_result(reply.get("value"))
        else:
            future.set_exception(RemoteError(str(reply.get("type")), str(reply.get("message"))))
        return True

    def expire(self, now: float) -> None:
        with self._lock:
            late = [(c, e) for c, e in self._waiting.items() if e[1] <= now]
            for corr, _ in late:
                del self._waiting[corr]
        for corr, (future, _deadline, what) in late:
            if not future.done():
                future.set_exception(RequestTimeout(f"no reply to {what} ({corr}) in time"))

    def close(self, exc: BaseException) -> None:
        """Fail every waiting request with ``exc``, and every later ``new``."""
        with self._lock:
            self._closed = exc
            entries, self._waiting = list(self._waiting.values()), {}
        for future, _deadline, _what in entries:
            if not future.done():
                future.set_exception(exc)

    def __len__(self) -> int:
        with self._lock:
            return len(self._waiting)
