"""A bus in a ``fork()``ed child: refused at once, touching nothing (DESIGN.md rule 13).

A child gets a copy of the parent's memory, not of its threads: the engine, the workers
and the journal mover are gone, locks they held stay held for ever, and the store's file
descriptors are the parent's own open files. One write from the child into LevelDB's log
interleaves with the parent's (they share the file offset) and corrupts it; a close waits
for threads that do not exist. So every open ``Bus`` and ``Store`` is marked at the fork,
in the child, and then refuses every call with ``BusForkedError`` before it takes a lock
or makes a system call. The parent is not touched at all.

The marks are set by ``os.register_at_fork``: no ``getpid()`` per call on the hot path.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from typing import Any, Protocol

from .errors import BusForkedError

__all__ = ["Forkable", "watch", "forked_error", "keep_forever"]


class Forkable(Protocol):
    def _orphan(self) -> None:
        """Called in a fork()ed child: refuse every later call, release nothing."""


_live: "weakref.WeakSet[Any]" = weakref.WeakSet()


def watch(obj: Forkable) -> None:
    """Have ``obj._orphan()`` called in every child forked while ``obj`` lives."""
    _live.add(obj)


def _in_child() -> None:
    for obj in list(_live):
        obj._orphan()


os.register_at_fork(after_in_child=_in_child)


def forked_error(what: str, owner_pid: int) -> BusForkedError:
    return BusForkedError(
        f"this {what} was opened by process {owner_pid} and cannot be used in a fork()ed child "
        f"(pid {os.getpid()}): its threads, sockets and store stay with the parent. Open a Bus "
        "of the child's own, on a data directory of its own, after the fork")


def keep_forever(obj: object) -> None:
    """Never let ``obj`` be deallocated in this process: the child's copy of a LevelDB handle
    must not run its destructor, which waits for compactions on threads that do not exist
    here and on a mutex a parent thread may have held at the fork."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
