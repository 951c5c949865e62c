"""Handler time limits: ``every(topic, handler, timeout=seconds)``.

A Python thread cannot be killed. A handler past its limit gets ``HandlerTimeout`` raised
inside it, asynchronously (CPython's ``PyThreadState_SetAsyncExc``, as dramatiq's time
limits do): it lands at the handler's next Python instruction, so a handler blocked in a
C call (a socket read without a timeout) is interrupted when that call returns. The
runner sees an exception like any other: a failed attempt, retried with backoff, a dead
letter after ``max_attempts``.

Exactly one exception per run, and never outside it: the watchdog fires at most once per
armed run, under the lock that disarming takes; a run disarmed after the watchdog fired
(the exception not yet delivered) clears it before leaving.
"""

from __future__ import annotations

import ctypes
import functools
import heapq
import itertools
import threading
import time
from typing import Any

from .handlers import Handler
from ..model.records import Message

__all__ = ["HandlerTimeout", "Watchdog"]

_set_async_exc = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.py_object)(
    ("PyThreadState_SetAsyncExc", ctypes.pythonapi))
# The same call with NULL clears an exception set but not yet raised.
_clear_async_exc = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)(
    ("PyThreadState_SetAsyncExc", ctypes.pythonapi))


class HandlerTimeout(Exception):
    """Raised inside a handler that ran longer than its ``timeout``."""


def timeout_text(name: str, seconds: float) -> str:
    return f"handler {name} ran longer than its timeout of {seconds:g}s"


def _timeout_class(text: str) -> type[HandlerTimeout]:
    """CPython raises an asynchronous exception by calling its class with no arguments:
    a subclass per firing carries the text."""
    def __init__(self: HandlerTimeout, *args: object) -> None:
        HandlerTimeout.__init__(self, text)
    return type("HandlerTimeout", (HandlerTimeout,), {"__init__": __init__})


class Watchdog:
    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._armed: dict[int, tuple[int, str, float]] = {}  # token -> (thread id, name, limit)
        self._deadlines: list[tuple[float, int]] = []
        self._fired: set[int] = set()
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    def limit(self, handler: Handler, seconds: float, name: str) -> Handler:
        """``handler``, interrupted with HandlerTimeout past ``seconds``. A partial: it has
        no stable name of its own (the caller registers it under the handler's)."""
        return functools.partial(self._limited, handler, seconds, name)

    def _limited(self, handler: Handler, seconds: float, name: str, payload: Any, message: Message) -> Any:
        token = self._arm(seconds, name)
        try:
            return handler(payload, message)
        finally:
            self._disarm(token)

    def _arm(self, seconds: float, name: str) -> int:
        token = next(self._tokens)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="servicebus-timeouts", daemon=True)
                self._thread.start()
            self._armed[token] = (threading.get_ident(), name, seconds)
            heapq.heappush(self._deadlines, (time.monotonic() + seconds, token))
            self._lock.notify()
        return token

    def _disarm(self, token: int) -> None:
        with self._lock:
            self._armed.pop(token, None)
            if token in self._fired:
                self._fired.discard(token)
                _clear_async_exc(threading.get_ident(), None)  # if not raised yet, never

    def _run(self) -> None:
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                while self._deadlines and self._deadlines[0][0] <= now:
                    _due, token = heapq.heappop(self._deadlines)
                    armed = self._armed.pop(token, None)
                    if armed is None:
                        continue  # finished in time
                    ident, name, seconds = armed
                    self._fired.add(token)
                    _set_async_exc(ident, _timeout_class(timeout_text(name, seconds)))
                wait = self._deadlines[0][0] - now if self._deadlines else None
                self._lock.wait(wait)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
