"""Helpers shared by the test suite and by users testing their own services."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["free_port", "free_address", "wait_until", "FakeClock"]

from .clock import BusClock

T = TypeVar("T")
_pause = threading.Event().wait


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.02,
               message: str | Callable[[], str] = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy; raise AssertionError at the
    deadline, with ``message`` (a callable is evaluated then, to show the final state)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            raise AssertionError(f"timed out after {timeout}s waiting for {text}")
        # An Event's timed wait, not time.sleep: Python 3.11's sleep uses an absolute
        # clock_nanosleep that libfaketime 0.9.10 breaks (EINVAL) for processes whose clock
        # tests move while leaving the monotonic clock alone (wolfcw/libfaketime#426).
        _pause(interval)


class FakeClock(BusClock):
    """A bus clock that moves only when told to (``advance``), for tests of windows."""

    def __init__(self, start_ms: int = 0) -> None:
        super().__init__(start_ms)
        self.ms = start_ms

    def now(self) -> int:
        return self.ms

    def advance(self, seconds: float) -> None:
        self.ms += int(seconds * 1000)
