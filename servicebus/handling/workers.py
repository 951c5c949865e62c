"""The workers' loop (mixed into ``Dispatcher``, dispatch.py, whose state it uses): each
worker takes a run of ready messages when it may (concurrency.py), runs them in turn, and
puts each back, finished, retried or paused, where the dispatcher says."""

from __future__ import annotations

import heapq
import logging
import threading
import time
from typing import TYPE_CHECKING

from ..errors import StoreError
from ..model.config import BusConfig
from ..model.stored import Incoming
from .concurrency import STALL, Concurrency
from .segmentrun import PAUSE

if TYPE_CHECKING:
    from .runner import Runner

__all__ = ["WorkerLoop", "RUN"]

log = logging.getLogger("servicebus")

RUN = 16  # ready messages a worker takes at once, at most


class WorkerLoop:
    _cv: threading.Condition
    _heap: list[tuple[float, int, Incoming]]
    _closing: bool
    _parked_expiry: float | None
    _refill_wanted: bool
    _refilling: bool
    _config: BusConfig
    _concurrency: Concurrency
    _runner: "Runner"
    _watchers: int  # workers waiting with a timeout, to see runs stall (under _cv)

    def _refill(self, strict: bool = False) -> None:
        raise NotImplementedError

    def _requeue(self, due: float, seq: int, item: Incoming, read: bool = True) -> None:
        raise NotImplementedError

    def _finish(self, item: Incoming, retry_at: float | None) -> None:
        raise NotImplementedError

    def _next_run(self) -> list[tuple[float, int, Incoming]] | None:
        """The next ready messages for one worker: a fair share of what is ready (so slow,
        I/O-bound handlers still spread over all workers), at most RUN. An empty list when
        a parked message's TTL passed or a refill is wanted: the worker scans the store."""
        with self._cv:
            while True:
                if self._closing:
                    return None
                if self._refill_wanted and not self._refilling:
                    self._refill_wanted = False
                    return []
                parked = self._parked_expiry
                if parked is not None and parked <= time.monotonic():
                    self._parked_expiry = None
                    return []
                if self._heap:
                    now = time.monotonic()
                    due = self._heap[0][0]
                    if parked is not None:
                        due = min(due, parked)
                    if due <= now:
                        concurrency = self._concurrency
                        if not concurrency.may_start(now):
                            self._watch(concurrency.recheck_in(now))
                            continue
                        ready = sum(1 for d, _, _ in self._heap[:RUN * 8] if d <= now)
                        # A share of what is ready, as if every worker ran: what a run holds
                        # waits behind its handlers, however few workers are running now.
                        take = max(1, min(RUN, ready // self._config.workers))
                        run = [heapq.heappop(self._heap)]
                        while len(run) < take and self._heap and self._heap[0][0] <= now:
                            run.append(heapq.heappop(self._heap))
                        concurrency.started()
                        if not self._watchers:
                            # What is queued, now or later, waits for this run unless a worker
                            # watches for it to stall (concurrency.py): the others may be
                            # asleep with no timeout, and new work wakes none while it runs.
                            self._cv.notify()
                        return run
                    self._cv.wait(due - now)
                elif parked is not None:
                    self._cv.wait(parked - time.monotonic())
                elif self._concurrency.active and not self._watchers:
                    # New work may come and find the running workers stalled: one worker
                    # looks again then (no one is woken for work a running one should take).
                    self._watch(STALL)
                else:
                    self._cv.wait()

    def _watch(self, timeout: float) -> None:
        """Wait (under _cv) as the worker that looks for stalled runs."""
        self._watchers += 1
        try:
            self._cv.wait(timeout)
        finally:
            self._watchers -= 1

    def _work(self) -> None:
        while True:
            run = self._next_run()
            if run is None:
                return
            if not run:
                # A parked message expired (the scan queues it to dead-letter), or what is
                # in the store is to be read and nothing finishing would start the refill.
                self._refill()
                continue
            waits = self._runner.waits
            began, waited = time.perf_counter(), waits.seconds
            try:
                self._run(run)
            finally:
                with self._cv:
                    self._concurrency.finished(time.monotonic(), time.perf_counter() - began,
                                               waits.seconds - waited)
                    # No wake-up: this worker takes the next run itself (one that may run
                    # beside it was woken when the work came, or asks again in a while).

    def _run(self, run: list[tuple[float, int, Incoming]]) -> None:
        """One worker's run: its messages in turn (a paused segment's rest goes back)."""
        marked = False  # whether run[i]'s "started" marker was written with run[i-1]
        paused = False
        for i, (due, seq, item) in enumerate(run):
            if paused:  # the rest of the run goes back as it was, after the paused one
                self._requeue(due, seq, item, read=False)
                continue
            nxt = run[i + 1][2] if i + 1 < len(run) else None
            retry_at: float | None = None
            try:
                retry_at, marked = self._runner.run(item, marked, nxt)
            except StoreError as exc:
                marked = False
                if not self._closing:
                    log.error("handling %s: %s", item.id, exc)
            except BaseException:  # noqa: BLE001 - a worker must never die silently
                marked = False
                log.exception("unexpected error dispatching %s", item.id)
            finally:
                try:
                    if retry_at == PAUSE:  # a segment's next part: its place in the queue kept
                        self._requeue(due, seq, item)
                        paused = True
                    else:
                        self._finish(item, retry_at)
                except BaseException:  # noqa: BLE001 - nor die finishing one
                    log.exception("unexpected error finishing %s", item.id)
