"""The web console over two live services: ``orders`` publishes an order every 0.2 s and
``emails`` handles them, failing (a dead letter at once) on an order without a customer,
one in seven. Open the URL it prints, then: *Show* the ValueError group, *Edit & replay* a
letter with a customer filled in, or *Replay* one after starting with ``--mended`` (the
handler then accepts orders without a customer).

    python examples/console/main.py [--seconds N] [--listen 127.0.0.1:8470] [--mended]
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from pathlib import Path

from servicebus import Bus
from servicebus.console import Console
from servicebus.testing import free_address


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=0, help="stop after this long (0: at Ctrl-C)")
    ap.add_argument("--listen", default="127.0.0.1:8470")
    ap.add_argument("--mended", action="store_true", help="the handler accepts orders without a customer")
    ap.add_argument("--data", type=Path, help="data directories under this folder (default: a temporary one)")
    args = ap.parse_args()
    root = args.data or Path(tempfile.mkdtemp(prefix="servicebus-console-"))
    with Bus(free_address(), root / "orders", name="orders") as orders, \
            Bus(free_address(), root / "emails", name="emails", max_attempts=1) as emails:

        @emails.every("order.placed")
        def send_confirmation(order, message):
            if order["customer"] is None and not args.mended:
                raise ValueError(f"order {order['n']} has no customer to email")

        emails.subscribe(orders.address, "order.placed", wait=10)
        with Console([root / "orders", root / "emails"], listen=args.listen, write=True, interval=1.0) as console:
            print(f"console: {console.url}  (data under {root}; Ctrl-C stops)", flush=True)
            end = time.monotonic() + args.seconds if args.seconds else None
            try:
                for n in itertools.count():
                    if end is not None and time.monotonic() >= end:
                        break
                    orders.publish("order.placed", {"n": n, "customer": None if n % 7 == 3 else f"c{n}"})
                    time.sleep(0.2)
            except KeyboardInterrupt:
                pass


if __name__ == "__main__":
    main()
