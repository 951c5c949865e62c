"""Message ids: unique, and increasing in the order one bus makes them, whatever its clock.

An id is 24 lowercase hex digits: 12 for milliseconds, 6 for a per-process counter, 6
random per process start. Ids reach a stream in the order they were made (the engine makes
command ids and writes them itself; ``publish`` makes event ids under the group-commit
lock, in commit order), and delivery cursors compare them: an id that sorted below one a
cursor has passed would never be delivered, and garbage collection would delete it.

So the leading milliseconds come from the **id clock**, not straight from the wall clock:
at start it reads the wall clock, or one millisecond past the highest id the store refers
to (``after``) if the wall clock is behind that (it was set back), and from then on it
counts the bus's running time (the monotonic clock). It never goes back, in this process
or across restarts, and a wall clock stepped either way while the bus runs does not move it.

Delayed messages (``delay=``/``deliver_at=``) have ids made for their due time on this same
clock, and the sender holds them until the id clock gets there (``State.not_due``): a
delay counts the bus's running time from the publish, so a clock set back before or
during a run never makes one early.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from .clock import wall_ms

__all__ = ["IdGenerator", "id_millis"]


class IdGenerator:
    def __init__(self, after: str | None = None, *, wall: Callable[[], int] = wall_ms,
                 monotonic: Callable[[], float] = time.monotonic, epoch: int | None = None) -> None:
        """``after``: the highest id made before (the store's ``highest_own_id``); every
        id made here sorts above it. ``wall``/``monotonic``: the clocks (tests fake them).
        ``epoch``: this start's number (``Store.next_epoch``), the ids' last 6 digits: an id
        made in one start is never made again in another, even one whose writes a crash
        lost after they were sent (engine/commit.py); random when not given."""
        self._boot = os.urandom(3).hex() if epoch is None else f"{epoch & 0xFFFFFF:06x}"
        self.epoch = wall() if epoch is None else epoch  # grows from one start to the next
        self._wall = wall
        self._monotonic = monotonic
        floor = id_millis(after) + 1 if after else 0
        self._origin = max(wall(), floor)  # the id clock at _t0
        self._t0 = monotonic()
        self._last_ms = floor
        self._counter = int.from_bytes(os.urandom(2), "big")
        self._lock = threading.Lock()

    def now_ms(self) -> int:
        """The id clock: the wall clock at start (or past the highest id, if the wall clock
        was behind it), plus the running time since. Never goes back."""
        return self._origin + int((self._monotonic() - self._t0) * 1000)

    def next(self) -> str:
        with self._lock:
            return self._next_locked()

    def _next_locked(self) -> str:
        ms = self.now_ms()
        if ms < self._last_ms:
            ms = self._last_ms  # the counter wrapped into a later millisecond (below)
        self._last_ms = ms
        self._counter = (self._counter + 1) & 0xFFFFFF
        if self._counter == 0:
            # The counter wrapped within the same millisecond bucket: move time on.
            self._last_ms = ms = ms + 1
        return f"{ms:012x}{self._counter:06x}{self._boot}"

    def many(self, count: int) -> list[str]:
        """``count`` ids in a row, made under one lock: one reading of the clock, the
        counter carried (as ``next`` does when it wraps)."""
        with self._lock:
            ms = max(self.now_ms(), self._last_ms)
            counter, boot = self._counter, self._boot
            out = []
            for _ in range(count):
                counter = (counter + 1) & 0xFFFFFF
                if counter == 0:
                    ms += 1  # the counter wrapped within one millisecond bucket: move time on
                out.append(f"{ms:012x}{counter:06x}{boot}")
            self._counter, self._last_ms = counter, ms
            return out

    def delayed(self, count: int, due_ms: int) -> list[str]:
        """Ids for messages to deliver at ``due_ms`` (wall clock, as ``publish`` computed it
        from ``delay``/``deliver_at``): made for that time on the id clock (the same
        distance ahead of it as ``due_ms`` is ahead of the wall clock now), so they take
        their place in a stream among what is published then, and marked by a 25th
        character (``delivery.is_delayed``): the sender holds them until due, and they do
        not move this generator's clock (``after`` skips them at a restart). Not in the
        future: plain ids, due now."""
        with self._lock:
            ahead = due_ms - self._wall()
            at = self.now_ms() + ahead
            if ahead <= 0 or at <= self._last_ms:
                return [self._next_locked() for _ in range(count)]
            out = []
            for _ in range(count):
                self._counter = (self._counter + 1) & 0xFFFFFF
                out.append(f"{at:012x}{self._counter:06x}{self._boot}~")
            return out


def id_millis(message_id: str | None) -> int:
    """The milliseconds encoded in an id (the id clock of the bus that made it: its wall
    clock, unless that clock was behind an earlier id); 0 if it is not one of ours."""
    if message_id is None:
        return 0
    try:
        return int(message_id[:12], 16)
    except ValueError:
        return 0
