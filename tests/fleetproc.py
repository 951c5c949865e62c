"""One bus of a fleet (services by name), in its own process, for tests/integration/
test_fleet_hosts.py, tools/chaos's ``move-subscriber`` and tools/bench_fleet.

It reports through files, never through logs:

- ``--ready FILE``: ``<pid> <node id>`` once the bus is up (its name subscriptions stored);
- ``--state FILE``: a JSON ``{"fleet": bus.fleet(), "counters": ..., "subscriptions": N,
  "address": ...}`` rewritten (write, rename) every ``--state-every`` seconds;
- ``--handled FILE``: ``<n> <id> <pid> <wall time>`` per handler run of ``--handle TOPIC``
  (plain appends reach the page cache, which survives SIGKILL);
- ``--acks FILE``: ``<n> <id>`` per publish that returned (an acknowledged message), and
  ``FILE.end`` once publishing is over (after ``--count`` or ``--quiet``);
- ``--command CMD``: handles it, replying ``{"pid": pid, "node": node id}``.

A publisher (``--publish TOPIC``) waits for ``--go FILE``, then publishes ``--count``
events (0: until ``--quiet FILE`` exists) at ``--rate`` a second. Stops at SIGTERM or once
``--stop FILE`` exists.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from servicebus import Bus

pause = threading.Event().wait


def append(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def write_state(bus: Bus, path: str) -> None:
    state: dict[str, Any] = {"fleet": bus.fleet(), "counters": bus.counters(),
                             "subscriptions": bus.status().subscriptions, "address": bus.address,
                             "wall": time.time()}
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as out:
        json.dump(state, out, default=str)
    os.replace(tmp, path)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bind", required=True)
    ap.add_argument("--advertise")
    ap.add_argument("--datadir", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--seed", action="append", default=[])
    ap.add_argument("--gossip-interval", type=float, default=1.0)
    ap.add_argument("--down-after", type=float, default=5.0)
    ap.add_argument("--heartbeat", type=float, default=1.0)
    ap.add_argument("--peer-timeout", type=float, default=3.0)
    ap.add_argument("--ack-timeout", type=float, default=1.0)
    ap.add_argument("--resend-max", type=float, default=2.0)
    ap.add_argument("--keys", help="a servicebus keygen directory (CURVE)")
    ap.add_argument("--allow-peer", action="append", default=[])
    ap.add_argument("--ready", required=True)
    ap.add_argument("--state")
    ap.add_argument("--state-every", type=float, default=0.1)
    ap.add_argument("--subscribe", nargs=2, action="append", default=[], metavar=("SERVICE", "TOPIC"))
    ap.add_argument("--handle", help="topic to handle")
    ap.add_argument("--handled")
    ap.add_argument("--command", help="command to handle (replies with pid and node)")
    ap.add_argument("--publish", help="topic to publish")
    ap.add_argument("--acks")
    ap.add_argument("--go", help="publish once this file exists")
    ap.add_argument("--quiet", help="stop publishing once this file exists")
    ap.add_argument("--count", type=int, default=0, help="events to publish (0: until --quiet)")
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--stop")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[{os.getpid()} {args.name}] %(asctime)s %(threadName)s %(message)s")
    options: dict[str, Any] = {}
    if args.advertise:
        options["advertise"] = args.advertise
    if args.keys:
        options["keys"] = args.keys
    if args.allow_peer:
        options["allow_peers"] = args.allow_peer
    bus = Bus(args.bind, args.datadir, name=args.name, seeds=args.seed, gossip_interval=args.gossip_interval,
              down_after=args.down_after, heartbeat=args.heartbeat, peer_timeout=args.peer_timeout,
              ack_timeout=args.ack_timeout, resend_max=args.resend_max, **options)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    pid = os.getpid()

    if args.handle:
        @bus.every(args.handle)
        def handler(payload, message):
            append(args.handled, f"{payload['n']} {message.id} {pid} {time.time():.6f}")

    if args.command:
        bus.handle(args.command, lambda payload, message: {"pid": pid, "node": bus.node_id})

    for service, topic in args.subscribe:
        bus.subscribe(service, topic)  # stored; asked of every instance discovery finds

    def report() -> None:
        while not stop.is_set():
            try:
                write_state(bus, args.state)
            except Exception as exc:  # the bus closing under it
                logging.getLogger("fleetproc").debug("state: %s", exc)
            stop.wait(args.state_every)

    if args.state:
        write_state(bus, args.state)
        threading.Thread(target=report, daemon=True, name="state").start()
    append(args.ready, f"{pid} {bus.node_id}")

    if args.publish:
        while args.go and not os.path.exists(args.go) and not stop.is_set():
            pause(0.01)
        n, began = 0, time.monotonic()
        while not stop.is_set() and (args.count == 0 or n < args.count):
            if args.quiet and os.path.exists(args.quiet):
                break
            ahead = n / args.rate - (time.monotonic() - began)
            if ahead > 0:
                pause(ahead)
            mid = bus.publish(args.publish, {"n": n})
            append(args.acks, f"{n} {mid}")
            n += 1
        append(f"{args.acks}.end", str(n))  # publishing is over: the acks file is complete

    while not stop.is_set() and not (args.stop and os.path.exists(args.stop)):
        stop.wait(0.1)
    stop.set()
    bus.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
