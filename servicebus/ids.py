"""Message ids: unique, and sortable by creation time within one bus.

An id is 24 lowercase hex digits: 12 for the wall-clock milliseconds, 6 for a per-process
counter, 6 random per process start. Ids reach a stream in the order they were made (the
engine makes command ids and writes them itself; ``publish`` makes event ids under the
group-commit lock, in commit order), which the delivery cursors rely on.
"""

from __future__ import annotations

import os
import threading
import time

__all__ = ["IdGenerator", "id_millis"]


class IdGenerator:
    def __init__(self) -> None:
        self._boot = os.urandom(3).hex()
        self._last_ms = 0
        self._counter = int.from_bytes(os.urandom(2), "big")
        self._lock = threading.Lock()

    def next(self) -> str:
        with self._lock:
            ms = time.time_ns() // 1_000_000
            # Never go backwards, even if the wall clock does: cursors compare ids.
            if ms < self._last_ms:
                ms = self._last_ms
            self._last_ms = ms
            self._counter = (self._counter + 1) & 0xFFFFFF
            if self._counter == 0:
                # The counter wrapped within the same millisecond bucket: move time on.
                self._last_ms = ms = ms + 1
            return f"{ms:012x}{self._counter:06x}{self._boot}"

    def many(self, count: int) -> list[str]:
        return [self.next() for _ in range(count)]


def id_millis(message_id: str) -> int:
    """Creation time (ms since the epoch, sender's clock) encoded in an id; 0 if not ours."""
    try:
        return int(message_id[:12], 16)
    except ValueError:
        return 0
