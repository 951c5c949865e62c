"""A publisher that keeps publishing while a test does something else (a handler
registering, a subscriber restarting): numbered events, one publish each, in a thread."""

from __future__ import annotations

import threading

from servicebus import Bus


class Stream:
    """Publishes ``topic`` events ``first``, ``first + 1``... one at a time until the
    ``with`` block ends or ``last`` was published; ``sent`` is the next number (so every
    number below it was published and acknowledged)."""

    def __init__(self, pub: Bus, topic: str, first: int = 0, last: int = 20_000) -> None:
        self.sent = first
        self._pub, self._topic, self._last = pub, topic, last
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-stream")

    def _run(self) -> None:
        while not self._stop.is_set() and self.sent < self._last:
            self._pub.publish(self._topic, self.sent)
            self.sent += 1

    def __enter__(self) -> "Stream":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
