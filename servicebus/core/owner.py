"""One owner thread for the core, checked when ``SERVICEBUS_CHECK_THREADS=1``.

The core's state is not locked: it is safe only because one thread (the engine's) alone
touches it, and publishing or handler threads see it only through what the engine hands
them (routes, commands). Nothing in Python enforces that, so a debug mode does: with the
environment variable set when a core is made, every public call and every read of its
state from a thread other than the one bound as its owner raises ``WrongThread``. The test
suite turns it on (tests/conftest.py); a running service pays nothing (the checks are
installed only then).
"""

from __future__ import annotations

import os
import threading
from typing import Any

__all__ = ["WrongThread", "checking", "OWNED"]

ENV = "SERVICEBUS_CHECK_THREADS"

# The core's public calls; each must come from its owner thread once one is bound.
OWNED = ("on_router", "on_dealer", "malformed", "command", "unreachable", "prepare", "committed",
         "abandon", "advance", "take_frames", "take_router_frames", "collect_soon", "save_clock",
         "poll_timeout", "idle", "waiters", "snapshot", "reload", "load")


class WrongThread(AssertionError):
    """The core was touched from a thread that does not own it (a defect, not an input)."""


def checking() -> bool:
    return os.environ.get(ENV) == "1"


def check(owner: int | None, what: str) -> None:
    if owner is not None and threading.get_ident() != owner:
        raise WrongThread(f"core.{what} called from thread {threading.current_thread().name!r}; "
                          "only the engine thread may touch the delivery core")


def checked_class(cls: type) -> type:
    """A subclass of ``cls`` (the core) whose public calls and ``s`` check the thread."""
    def owned(name: str) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            check(self.owner, name)
            # Looked up at each call, not once: a test that patches the core's method
            # must reach this one too.
            return getattr(cls, name)(self, *args, **kwargs)
        call.__name__ = name
        call.__doc__ = getattr(cls, name).__doc__
        return call

    def state(self: Any) -> Any:
        check(self.owner, "s")
        return self.__dict__["s"]

    def set_state(self: Any, value: Any) -> None:
        self.__dict__["s"] = value

    body: dict[str, Any] = {name: owned(name) for name in OWNED}
    body["s"] = property(state, set_state)
    return type(f"Checked{cls.__name__}", (cls,), body)
