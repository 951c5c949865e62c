"""How many workers run handlers at once: as few as keep the queue moving.

Python runs one thread's bytecode at a time. Handlers that compute (most are quick) gain
nothing from a second worker and lose to the hand-offs of the GIL between them (measured
with tools/bench, e2e-batch: 21,700 msgs/s with the 8 workers taking turns, 38,800 with one
at a time). Handlers that wait (a network call, a sleep, an fsync) gain from many. So a
worker starts a run when none is running; or when the runs going on stall (none finished
for ``STALL``: a slow or hung handler must not hold the queue up); or when the runs lately
waited most of their time (``BLOCKED``: in a handler, not computing, or in a fsynced
write of what it staged, whose fsyncs more workers share): then up to ``workers`` run at
once. Time a worker waits for the GIL or for an unsynced write does not count: more
workers would only wait more. Used under the dispatcher's lock.
"""

from __future__ import annotations

import threading

__all__ = ["Concurrency", "Waits", "STALL", "BLOCKED"]

STALL = 0.02  # seconds without a run finishing before one more worker may start
BLOCKED = 0.7  # share of their time the last runs spent not computing, above which all may run
WEIGHT = 0.2  # of each run in the moving average of that share


class Waits(threading.local):
    """Seconds this worker thread spent waiting in handlers and fsynced writes (a clock per
    thread, added to by the runner and read by the dispatcher around a run)."""

    seconds = 0.0


class Concurrency:
    def __init__(self, limit: int, now: float) -> None:
        self.limit = max(1, limit)
        self.active = 0  # workers running a run now
        self.last_done = now  # monotonic: when a run last finished
        self.blocked = 0.0  # moving average of the runs' blocked share of their time

    def may_start(self, now: float) -> bool:
        if self.active == 0:
            return True
        if self.active >= self.limit:
            return False
        return self.blocked >= BLOCKED or now - self.last_done >= STALL

    def recheck_in(self, now: float) -> float:
        """How long a worker held back waits before it asks again (unless woken)."""
        return max(0.001, STALL - (now - self.last_done))

    def wake(self, added: int, run: int, now: float) -> int:
        """Workers to wake for ``added`` new messages taken ``run`` at a time: none if one
        runs and no other may start (it takes them next; a wake-up is a context switch)."""
        if self.active and not self.may_start(now):
            return 0
        wanted = min(self.limit - self.active, -(-added // run))
        return wanted if self.blocked >= BLOCKED else min(wanted, 1)

    def started(self) -> None:
        self.active += 1

    def finished(self, now: float, wall: float, waited: float) -> None:
        """A run ended; ``wall``: the seconds it took, ``waited``: of those, in handlers not
        computing and in fsynced writes (``Waits``)."""
        self.active -= 1
        self.last_done = now
        if wall > 0:
            share = min(1.0, max(0.0, waited / wall))
            self.blocked += WEIGHT * (share - self.blocked)
