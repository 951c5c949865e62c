"""The store's high-water mark: what it must hold at least, kept outside LevelDB.

LevelDB keeps its newest writes in a log file (``store/NNNNNN.log``) until they reach a
table. A log that is deleted, zeroed, cut short or replaced by an older copy is read at
the next open as a store that never had those writes: empty, or partly empty, with no
error (its recovery takes a short log for a crash's torn tail). Only something outside the
store can tell: so every so often a counter is written into the store with a synced write
(``m/hwm``) and then, once that write is durable, into ``DATADIR/store.hwm`` (fsynced). At
open, a store whose counter is below the file's lost writes it had made durable: it is
refused (DESIGN.md rule 9) until ``servicebus check --repair`` reports what it lost (from
the delivery journal) and accepts the store as it is.

What it cannot see: writes made after the last mark (at most ``MARK_INTERVAL`` before the
damage, plus the writes of the close, which marks again), and a mark file that was itself
deleted (as with a data directory made by a version before this file existed).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["MarkFile", "MARK_INTERVAL", "MARK_NAME"]

MARK_NAME = "store.hwm"
MARK_INTERVAL = 1.0  # seconds between marks while synced writes happen
_WIDTH = 20  # digits: one fixed-size write, never a short record


class MarkFile:
    """``DATADIR/store.hwm``: the highest mark the store is known to have made durable."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> int | None:
        """The mark, or None if there is no file (a new data directory, or an older one)."""
        try:
            text = self.path.read_text(encoding="ascii", errors="replace").strip()
        except FileNotFoundError:
            return None
        try:
            return int(text)
        except ValueError:
            # A mark that does not read says nothing either way: the store is checked as
            # before marks existed, and the next mark rewrites it.
            return None

    def write(self, mark: int) -> None:
        """Make ``mark`` durable (``OSError`` if it could not be)."""
        new = not self.path.exists()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, f"{mark:0{_WIDTH}d}\n".encode(), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        if new:  # the file's name must survive a power cut too
            dfd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
