"""The LevelDB handle: opening it (refusing what would replace a store that exists) and
guarding every call on it, so that ``close()`` and ``reopen()`` can wait for calls in
progress and plyvel's errors are translated at this boundary."""

from __future__ import annotations

import os
from pathlib import Path
import threading
from typing import Any, Literal, Protocol

import plyvel

from ..errors import LockedError, StoreError, StoreWriteError
from ..forks import forked_error
from .schema import REPAIR_HINT


class _Guarded(Protocol):
    """What the guard reads and counts of the store it guards (db.py's ``Store``)."""

    _forked: bool
    _pid: int
    _lock: threading.Lock
    _cv: threading.Condition
    _closed: bool
    _reopening: bool
    _db: Any
    _failure: str | None
    _active: int

__all__: list[str] = []


def _has_leveldb_files(path: Path) -> bool:
    """Whether ``path`` holds any of LevelDB's data files (tables, logs, manifests)."""
    try:
        names = [p.name for p in path.iterdir()]
    except FileNotFoundError:
        return False
    return any(n.endswith((".ldb", ".sst", ".log")) or n.startswith("MANIFEST-") for n in names)


def _room_to_reopen(path: Path) -> bool:
    """Whether the file system holds enough free space for LevelDB to reopen the store: it
    turns its log into a table first (about the log's size), then starts a new log."""
    try:
        logs = sum(p.stat().st_size for p in path.glob("*.log"))
        st = os.statvfs(path)
    except OSError:
        return True  # cannot tell: try
    return st.f_bavail * st.f_frsize > logs + (1 << 20)


def _open_db(path: Path, **options: Any) -> Any:
    try:
        return plyvel.DB(str(path), **options)
    except plyvel.IOError as exc:
        if "permission denied" in str(exc).lower():
            # LevelDB writes its LOCK (and LOG) file even to read: this user may not.
            raise StoreError(f"cannot open store {path}: permission denied ({exc}); only its "
                             "owner can open it, to read too") from exc
        if "lock" in str(exc).lower():
            # LevelDB's own lock: another process has this store open right now (one that
            # does not hold DATADIR/LOCK, or got in first). Never a reason to repair it.
            raise LockedError(f"store {path} is in use by another process ({exc})") from exc
        raise StoreError(f"cannot open store {path}: {exc}") from exc
    except plyvel.Error as exc:
        raise StoreError(f"cannot open store {path}: {exc}; {REPAIR_HINT}") from exc
    except OSError as exc:
        raise StoreError(f"cannot open store {path}: {exc}") from exc


class _WriteFailed(Exception):
    """A LevelDB write failed (carried past the guard, which would call it damage)."""


class _Guard:
    """Counts calls in progress so that ``close()`` and ``reopen()`` can wait for them, and
    translates errors. While the database handle is being replaced, calls fail at once
    (only a bus that cannot write reopens, and everything it does then retries)."""

    __slots__ = ("_store",)

    def __init__(self, store: _Guarded) -> None:
        self._store = store

    def __enter__(self) -> None:
        store = self._store
        if store._forked:  # before the lock: a parent thread may have held it at the fork
            raise forked_error("store", store._pid)
        with store._lock:  # the bare lock, not the Condition: this runs per plyvel call
            if store._closed:
                raise StoreError("the store is closed")
            if store._reopening or store._db is None:
                raise StoreWriteError(f"the store is being reopened after: {store._failure}")
            store._active += 1

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        store = self._store
        with store._lock:
            store._active -= 1
            if store._active == 0 and (store._closed or store._reopening):
                store._cv.notify_all()
        if exc_type is not None and issubclass(exc_type, plyvel.Error):
            # Reads fail like this only on damaged files (writes handle their own errors).
            raise StoreError(f"store error: {exc}; {REPAIR_HINT}") from exc
        return False
