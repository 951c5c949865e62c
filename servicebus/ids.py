"""Message ids: unique, and increasing in the order one bus makes them, whatever its clock.

An id is 24 lowercase hex digits: 12 for milliseconds, 6 for a per-process counter, 6
random per process start. Ids reach a stream in the order they were made (the engine makes
command ids and writes them itself; ``publish`` makes event ids under the group-commit
lock, in commit order), and delivery cursors compare them: an id that sorted below one a
cursor has passed would never be delivered, and garbage collection would delete it.

So the leading milliseconds are the wall clock only while it moves forward: they never go
below the last id made, in this process or (``after``) in any earlier run whose ids the
store still refers to. With the clock set back, ids keep counting up from there.
"""

from __future__ import annotations

import os
import threading

from .clock import wall_ms

__all__ = ["IdGenerator", "id_millis"]


class IdGenerator:
    def __init__(self, after: str | None = None) -> None:
        """``after``: the highest id made before (the store's ``highest_own_id``); every
        id made here sorts above it."""
        self._boot = os.urandom(3).hex()
        # One millisecond past ``after``: above it whatever the counter and boot parts.
        self._last_ms = id_millis(after) + 1 if after else 0
        self._counter = int.from_bytes(os.urandom(2), "big")
        self._lock = threading.Lock()

    def next(self) -> str:
        with self._lock:
            return self._next_locked()

    def _next_locked(self) -> str:
        ms = wall_ms()
        if ms < self._last_ms:
            ms = self._last_ms  # the clock went back: keep counting from the last id
        self._last_ms = ms
        self._counter = (self._counter + 1) & 0xFFFFFF
        if self._counter == 0:
            # The counter wrapped within the same millisecond bucket: move time on.
            self._last_ms = ms = ms + 1
        return f"{ms:012x}{self._counter:06x}{self._boot}"

    def many(self, count: int) -> list[str]:
        return [self.next() for _ in range(count)]

    def delayed(self, count: int, due_ms: int) -> list[str]:
        """Ids for messages to deliver at ``due_ms`` (wall clock): made for that time, so
        they take their place in a stream among what is published then, and marked by a
        25th character (``delivery.is_delayed``): the sender holds them until due, and
        they do not move this generator's clock (``after`` skips them at a restart). Not
        later than the last id made: plain ids, due now."""
        with self._lock:
            if due_ms <= max(wall_ms(), self._last_ms):
                return [self._next_locked() for _ in range(count)]
            out = []
            for _ in range(count):
                self._counter = (self._counter + 1) & 0xFFFFFF
                out.append(f"{due_ms:012x}{self._counter:06x}{self._boot}~")
            return out


def id_millis(message_id: str | None) -> int:
    """The milliseconds encoded in an id (the sender's clock when it was made, unless that
    clock was behind an earlier id); 0 if it is not one of ours."""
    if message_id is None:
        return 0
    try:
        return int(message_id[:12], 16)
    except ValueError:
        return 0
