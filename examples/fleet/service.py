"""One program for every service of the fleet: what it is comes from its environment,
as it would in Compose, Kubernetes or Nomad. It knows no other service's address: only
names, and one seed to learn the fleet from.

    SERVICE=orders|email|billing   the service name (Bus(name=...))
    LISTEN=tcp://*:5555            where it binds
    ADVERTISE=tcp://orders:5555    how the others reach it (the container's host name)
    SEED=tcp://orders:5555         any one member of the fleet (or dns://orders:5555)
    DATA=/data                     its data directory (a volume: it is the instance)
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from servicebus import Bus

ROLES = {"order.placed": {"writers": ["orders"], "readers": ["email", "billing"]}}


def main() -> int:
    service = os.environ["SERVICE"]
    seed = os.environ.get("SEED")
    bus = Bus(os.environ.get("LISTEN", "tcp://*:5555"), os.environ.get("DATA", "/data"),
              advertise=os.environ.get("ADVERTISE"), name=service, seeds=[seed] if seed else [],
              channels=ROLES, gossip_interval=float(os.environ.get("GOSSIP", "1.0")),
              down_after=float(os.environ.get("DOWN_AFTER", "5.0")))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if service in ("email", "billing"):
        said = threading.Lock()  # handlers run on several threads: one line at a time

        @bus.every("order.placed")
        def on_order(order, message):
            with said:
                print(f"{service}: order {order['n']} from {message.reply_to}", flush=True)

        # By name: every instance of orders. Waits until one confirmed it (stored and
        # retried either way: the wait only makes "up" mean "subscribed").
        bus.subscribe("orders", "order.placed", wait=60)
    if service == "orders":
        @bus.handle("order.place")
        def place(order, message):
            message.publish("order.placed", order)
            return {"accepted": order["n"]}
    print(f"{service}: up at {bus.address}", flush=True)
    try:
        stop.wait()
    finally:
        bus.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
