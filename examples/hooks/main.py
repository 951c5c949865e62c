"""A hook of your own: count what happens to messages, and alert on dead letters.

``Bus(..., hooks=[...])`` takes objects of ``servicebus.Hook`` subclasses. Each overrides
what it needs: here ``failed`` and ``deadlettered`` (events, once per write that makes
them durable) and ``after_handle`` (every handler run, with its time). "billing" fails the
first attempt of every third order and gives up on order 6 (``Reject``); the hook counts
the failures and prints the dead letter as it happens.

Run it (after tools/test or tools/demo made .venv):

    .venv/bin/python examples/hooks/main.py
"""

from __future__ import annotations

import logging
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))  # run from a checkout

from servicebus import Bus, Event, Hook, Message, Reject  # noqa: E402
from servicebus.testing import free_address, wait_until  # noqa: E402


class Alerts(Hook):
    """Counts handler failures per topic and prints every dead letter."""

    def __init__(self) -> None:
        self.failures: Counter[str] = Counter()
        self.runs = 0
        self.slowest = 0.0
        self._lock = threading.Lock()  # hooks are called on several threads

    def failed(self, batch: object, events: list[Event]) -> None:
        with self._lock:
            for event in events:
                self.failures[event.topic or "?"] += 1

    def deadlettered(self, batch: object, events: list[Event]) -> None:
        for event in events:
            print(f"ALERT: {event.topic} {event.id} is a dead letter: {event.error}", flush=True)

    def after_handle(self, message: Message, error: BaseException | None, seconds: float) -> None:
        with self._lock:
            self.runs += 1
            self.slowest = max(self.slowest, seconds)


def main() -> None:
    logging.basicConfig(level=logging.CRITICAL)
    work = Path(tempfile.mkdtemp(prefix="servicebus-hooks-"))
    alerts = Alerts()
    billed: list[int] = []
    with Bus(free_address(), work / "shop") as shop, \
            Bus(free_address(), work / "billing", hooks=[alerts], retry_initial=0.05) as billing:

        @billing.every("order.placed")
        def bill(order: dict, message: Message) -> None:
            if order["id"] == 6:
                raise Reject("order 6 has no customer")
            if order["id"] % 3 == 0 and message.attempt == 1:
                raise RuntimeError("payment service busy")
            billed.append(order["id"])

        billing.subscribe(shop.address, "order.placed", wait=10)
        for n in range(1, 10):
            shop.publish("order.placed", {"id": n})
        wait_until(lambda: len(billed) == 8 and len(billing.deadletters()) == 1, 20)
    print(f"billed orders {sorted(billed)}")
    print(f"handler failures by topic: {dict(alerts.failures)}")
    print(f"handler runs: {alerts.runs}, slowest {alerts.slowest * 1000:.1f} ms")


if __name__ == "__main__":
    main()
