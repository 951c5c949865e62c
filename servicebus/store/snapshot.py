"""A read-only, consistent view of a store that a running bus goes on writing: a LevelDB
snapshot. Every read of it sees the store as one committed write left it (each write is one
atomic batch, so the keyspaces agree, as after a crash), however long the reading takes and
whatever the bus writes meanwhile. ``servicebus check`` of a live bus reads one."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ..errors import StoreError
from .reads import Reads

if TYPE_CHECKING:
    from .batch import Batch
    from .db import Store
    from .handle import _Guard

__all__ = ["Snapshot", "snapshot"]


class Snapshot(Reads):
    """The reads of ``Store`` on a snapshot; it writes nothing and has no high-water mark
    of its own to compare (the bus holding the store checked it when it opened)."""

    def __init__(self, store: "Store") -> None:
        self._store = store
        self.path = store.path
        with store._op():
            self._db: Any = store._db.snapshot()

    def _op(self) -> "_Guard":
        return self._store._op()  # refused while the store is closed or reopened, as its reads

    def batch(self) -> "Batch":
        raise StoreError("a snapshot of the store is read-only")

    def write(self, batch: "Batch", *, sync: bool) -> None:
        raise StoreError("a snapshot of the store is read-only")

    def mark_behind(self) -> None:
        return None

    def close(self) -> None:
        self._db.close()


@contextmanager
def snapshot(store: "Store") -> Iterator[Snapshot]:
    snap = Snapshot(store)
    try:
        yield snap
    finally:
        snap.close()
