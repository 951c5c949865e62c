"""The two clocks of a bus, and which one decides what.

``wall_ms()`` is the wall clock: what timestamps shown to people and written to the journal
use, and what TTLs are stated in. It can jump either way (an operator, NTP stepping, a VM
restored from a snapshot), so nothing that orders or forgets messages relies on it
(DESIGN.md section 3, rule 8):

- message ids never go backwards, across restarts too (``ids.IdGenerator`` starts above
  the highest id the store refers to);
- windows that forget (the dedupe window, journal retention) count ``BusClock`` time:
  milliseconds of this bus's own running time, from the monotonic clock, carried across
  restarts in the store. It does not move while the bus is down, so a bus that was down
  remembers longer, never shorter; after a crash it resumes from the last value stored
  (a few seconds behind), which again only makes it remember longer.
"""

from __future__ import annotations

import time

__all__ = ["wall_ms", "BusClock"]


def wall_ms() -> int:
    """Wall-clock milliseconds since the epoch."""
    return time.time_ns() // 1_000_000


class BusClock:
    """Running time of one bus in ms, continued from ``start_ms`` (what the store held)."""

    def __init__(self, start_ms: int = 0) -> None:
        self._start = max(0, int(start_ms))
        self._t0 = time.monotonic_ns()

    def now(self) -> int:
        return self._start + (time.monotonic_ns() - self._t0) // 1_000_000
