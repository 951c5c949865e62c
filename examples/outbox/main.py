"""Exactly-once state and an outbox, end to end (issue 16).

- "orders" keeps its orders in its own SQLite database. Each order and the event announcing
  it are written in one SQL transaction (an outbox row); a relay moves the rows into the
  bus. An order whose transaction fails is never announced.
- "billing" handles each order in a handler whose state (a running total and an invoice
  per order, ``message.kv``) and whose outgoing event (``message.publish``) are stored in
  the same atomic write as the handler's completion: the first attempt of order 2 fails
  after staging its writes, and the retry applies them once.
- "ledger" receives billing's events and prints them.

Run it (after tools/test or tools/demo made .venv):

    .venv/bin/python examples/outbox/main.py
"""

from __future__ import annotations

import logging
import sys
import tempfile
import threading
from pathlib import Path

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))  # run from a checkout

from servicebus import Bus  # noqa: E402
from servicebus.sql import SqlOutbox  # noqa: E402
from servicebus.testing import free_address, wait_until  # noqa: E402


def main() -> None:
    logging.basicConfig(level=logging.ERROR)
    work = Path(tempfile.mkdtemp(prefix="servicebus-outbox-"))
    orders_db = sa.create_engine(f"sqlite:///{work / 'orders.db'}")
    table = sa.Table("orders", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True),
                     sa.Column("amount", sa.Integer, nullable=False))
    table.create(orders_db)

    with Bus(free_address(), work / "orders") as orders, \
            Bus(free_address(), work / "billing", retry_initial=0.1) as billing, \
            Bus(free_address(), work / "ledger") as ledger:
        invoiced = threading.Event()
        lines: list[str] = []

        @billing.every("order.placed")
        def bill(payload, message):
            message.kv.update("total", lambda total: total + payload["amount"], 0)
            message.kv[f"invoice:{payload['id']}"] = {"amount": payload["amount"]}
            message.publish("invoice.created", {"order": payload["id"], "amount": payload["amount"]})
            if payload["id"] == 2 and message.attempt == 1:
                raise RuntimeError("billing: the first attempt of order 2 fails after staging")

        @ledger.every("invoice.created")
        def record(payload, message):
            lines.append(f"ledger:  invoice for order {payload['order']} ({payload['amount']})")
            if len(lines) == 3:
                invoiced.set()

        billing.subscribe(orders.address, "order.placed", wait=10)
        ledger.subscribe(billing.address, "invoice.created", wait=10)

        outbox = SqlOutbox(orders, orders_db)
        outbox.create_table()
        with outbox.start():
            for order_id, amount in ((1, 30), (2, 12), (3, 50), (4, 99)):
                try:
                    with orders_db.begin() as conn:
                        conn.execute(table.insert().values(id=order_id, amount=amount))
                        outbox.publish(conn, "order.placed", {"id": order_id, "amount": amount})
                        if order_id == 4:
                            raise ValueError("orders: order 4 fails validation; rolled back")
                    print(f"orders:  order {order_id} ({amount}) committed with its outbox row")
                except ValueError as exc:
                    print(exc)
                outbox.wake()
            wait_until(invoiced.is_set, 30, message="three invoices")
            wait_until(lambda: billing.drain(1), 10, message="billing to finish")
        for line in sorted(lines):
            print(line)
        print(f"billing: total {billing.kv['total']} (30 + 12 + 50: order 2's failed attempt "
              f"left nothing), invoices {[k for k, _ in billing.kv.items('invoice:')]}")
        print(f"orders:  {outbox.relayed} outbox rows relayed")
    orders_db.dispose()


if __name__ == "__main__":
    main()
