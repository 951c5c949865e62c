"""A typed service that joins late and replays what it missed (issue 29).

The orders service retains its order events for a day (``retention=``), so what it
publishes before anyone subscribes is kept. Billing starts later: its handler takes a typed
``OrderPlaced`` (a msgspec Struct: the payload is validated and converted), and it subscribes
with ``start="earliest"``, so it first gets every order it missed, in publish order, then
the live ones. Billing then restarts and subscribes again, as a service does at every
start: nothing is replayed twice. A malformed order is a dead letter ``invalid``.

Run it (after tools/test or tools/demo made .venv; needs the ``typed`` extra, in ``dev``):

    .venv/bin/python examples/late_joiner/main.py
"""

from __future__ import annotations

import datetime as dt
import decimal
import sys
import tempfile
from pathlib import Path

import msgspec

from servicebus import Bus, Message
from servicebus.testing import free_address, wait_until


class OrderPlaced(msgspec.Struct):
    id: int
    customer: str
    total: decimal.Decimal
    placed_at: dt.datetime


def billing(address: str, datadir: Path, orders: str, billed: list[int]) -> Bus:
    """The billing service as it starts, every time."""
    bus = Bus(address, datadir)

    @bus.every("order.placed")
    def charge(order: OrderPlaced, message: Message) -> None:
        billed.append(order.id)
        print(f"billing: charged order {order.id} for {order.customer}: {order.total} "
              f"(placed {order.placed_at:%H:%M:%S})")

    bus.subscribe(orders, "order.placed", start="earliest", ordered=True, wait=10)
    return bus


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="late-joiner-"))
    now = dt.datetime.now(dt.timezone.utc)
    with Bus(free_address(), root / "orders", retention={"order.>": 86400}) as orders:
        for n in (1, 2, 3):  # nobody subscribes yet: kept only because the topic is retained
            orders.publish("order.placed", OrderPlaced(n, f"customer-{n}", decimal.Decimal("9.99") * n, now))
        orders.publish("order.placed", {"id": "four", "customer": "c", "total": "1", "placed_at": "x"})
        kept = orders.status().retained["order.placed"]
        print(f"orders: {kept['messages']} orders published before billing existed, retained")

        billed: list[int] = []
        address = free_address()
        bus = billing(address, root / "billing", orders.address, billed)
        wait_until(lambda: len(billed) == 3 and bus.status().deadletters == 1, 20)
        orders.publish("order.placed", OrderPlaced(5, "customer-5", decimal.Decimal("5.00"), now))
        wait_until(lambda: len(billed) == 4, 20)
        letter = bus.deadletters()[0]
        print(f"billing: the malformed order is a dead letter {letter.reason}: {letter.error}")
        bus.close()

        bus = billing(address, root / "billing", orders.address, billed)  # a restart: subscribes again
        orders.publish("order.placed", OrderPlaced(6, "customer-6", decimal.Decimal("6.00"), now))
        wait_until(lambda: len(billed) == 5, 20)
        assert orders.drain(10) and bus.drain(10)
        bus.close()
        print(f"billing: billed orders {billed}, each once")
        return 0 if billed == [1, 2, 3, 5, 6] else 1


if __name__ == "__main__":
    sys.exit(main())
