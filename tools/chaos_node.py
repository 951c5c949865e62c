"""One bus of a tools/chaos workload, in its own process (see tools/chaos.py).

It reports through append-only files (plain appends reach the page cache, which survives
SIGKILL of this process), so the orchestrator never parses logs:

- ``--ready FILE``: written once the bus is up;
- publisher: each id whose ``publish_many`` returned is appended to ``--acks FILE`` (an
  acknowledged message: the bus promised it);
- subscriber: each handler run appends ``<id> <pid> <wall time>`` to ``--handled FILE``; with
  ``--transact`` the handler also counts in ``message.kv`` and publishes a ``chaos.forwarded``
  event naming the id, both committed with its completion (the count is written to
  ``--kv-out FILE`` at a clean stop);
- sink: subscribes to a transacting subscriber's ``chaos.forwarded`` and appends
  ``<original id> <forwarded id> <pid>`` to ``--handled FILE`` for each.

Exit codes: 0 after ``--stop FILE`` appears, 3 when the bus cannot go on (a damaged store
found at open or while running): the message names the cause.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from pathlib import Path

from servicebus import Bus, BusBrokenError, StoreError, StoreWriteError

TOPIC = "chaos.event"
FORWARDED = "chaos.forwarded"
# Not time.sleep: it fails with EINVAL under libfaketime 0.9.10 with the monotonic clock left
# alone (wolfcw/libfaketime#426), which is how the clock faults run these processes.
pause = threading.Event().wait


def append(fd: int, text: str) -> None:
    os.write(fd, text.encode())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=("pub", "sub", "sink"), required=True)
    ap.add_argument("--bind", required=True)
    ap.add_argument("--datadir", required=True)
    ap.add_argument("--peer", help="subscriber: the publisher's address (or service name, with --name)")
    ap.add_argument("--name", help="this bus's service name (discovery: Bus(name=...))")
    ap.add_argument("--seed", action="append", default=[], help="with --name: a bus of the fleet to learn it from")
    ap.add_argument("--gossip-interval", type=float, default=1.0)
    ap.add_argument("--down-after", type=float, default=5.0)
    ap.add_argument("--ready", required=True)
    ap.add_argument("--acks")
    ap.add_argument("--handled")
    ap.add_argument("--quiet", help="publisher: stop publishing once this file exists")
    ap.add_argument("--stop", required=True)
    ap.add_argument("--rate", type=int, default=500, help="messages per second (publisher)")
    ap.add_argument("--group", help="subscriber: join this subscriber group")
    ap.add_argument("--ordered", action="store_true", help="subscriber: an ordered subscription")
    ap.add_argument("--transact", action="store_true",
                    help="subscriber: count in message.kv and forward each event in the handler's transaction")
    ap.add_argument("--kv-out", help="subscriber with --transact: write the kv count here at a clean stop")
    ap.add_argument("--retention", type=float,
                    help="publisher: retain its events this long and publish before anyone subscribes")
    ap.add_argument("--start", help="subscriber: subscribe(start=...), e.g. earliest")
    ap.add_argument("--handler-ms", type=float, default=0.0, help="subscriber: each handler run takes this long")
    ap.add_argument("--http", action="store_true",
                    help="publisher: publish through its own HTTP gateway (servicebus.gateway), 201 = acknowledged")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[{os.getpid()} {args.role}] %(asctime)s %(threadName)s %(message)s")
    named = {} if args.name is None else {"name": args.name, "seeds": args.seed,
                                          "gossip_interval": args.gossip_interval, "down_after": args.down_after}
    try:
        bus = Bus(args.bind, args.datadir, ack_timeout=1.0, resend_max=2.0, retention=args.retention, **named)
    except StoreError as exc:
        print(f"cannot open the bus: {exc}", file=sys.stderr, flush=True)
        return 3
    stop, quiet = Path(args.stop), Path(args.quiet) if args.quiet else None
    try:
        if args.role in ("sub", "sink"):
            return run_subscriber(bus, args, stop)
        return run_publisher(bus, args, stop, quiet)
    except BusBrokenError as exc:
        print(f"the bus cannot go on: {exc}", file=sys.stderr, flush=True)
        os._exit(3)  # not close(): the store may be what failed
    finally:
        if not bus.closed:
            bus.close()  # a gateway started on it stops with the process (a daemon thread)


def run_subscriber(bus: Bus, args: argparse.Namespace, stop: Path) -> int:
    fd = os.open(args.handled, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    pid = os.getpid()

    if args.role == "sink":
        @bus.every(FORWARDED)
        def forwarded(payload, message):
            append(fd, f"{payload['of']} {message.id} {pid}\n")

        bus.subscribe(args.peer, FORWARDED)
    else:
        @bus.every(TOPIC)
        def handler(payload, message):
            if args.transact:  # both land with the completion, or neither does
                message.kv.update("handled", lambda n: n + 1, 0)
                message.publish(FORWARDED, {"of": message.id})
            if args.handler_ms:
                pause(args.handler_ms / 1000)  # slower than the publisher: always a backlog
            append(fd, f"{message.id} {pid} {time.time():.6f}\n")
            if args.transact:
                pause(0.005)  # runs that last a moment: some kills land between staging and commit

    Path(args.ready).write_text(str(pid))
    if args.role == "sub":
        # What a handler forwards before the sink subscribed would go to nobody: a
        # transacting subscriber takes events only once the sink is there (stored after).
        deadline = time.monotonic() + 60
        while args.transact and bus.status().subscriptions == 0 and time.monotonic() < deadline:
            pause(0.05)
        # Stored and retried: no need to wait here.
        bus.subscribe(args.peer, TOPIC, group=args.group, ordered=args.ordered, start=args.start)
    while not stop.exists():
        pause(0.2)
        bus.status()  # BusBrokenError if the engine stopped (a store damaged while running)
    if args.kv_out:
        bus.drain(30)
        Path(args.kv_out).write_text(str(bus.kv.get("handled", 0)))
    return 0


def post(gateway, payloads: list) -> list[str] | None:
    """POST the payloads to the gateway (``?many=true``); the ids of a 201, else None."""
    import http.client
    import json
    from urllib.parse import urlsplit

    url = urlsplit(gateway.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        conn.request("POST", f"/topics/{TOPIC}/messages?many=true", json.dumps(payloads),
                     {"Content-Type": "application/json"})
        answer = conn.getresponse()
        body = answer.read()
        return json.loads(body)["ids"] if answer.status == 201 else None
    except OSError:
        return None
    finally:
        conn.close()


def run_publisher(bus: Bus, args: argparse.Namespace, stop: Path, quiet: Path | None) -> int:
    fd = os.open(args.acks, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    deadline = time.monotonic() + 60
    while bus.status().subscriptions == 0 and not args.retention:  # else they go to nobody
        if time.monotonic() > deadline:
            print("no subscriber within 60 s", file=sys.stderr, flush=True)
            return 3
        pause(0.05)
    gateway = None
    if args.http:  # in this process: a SIGKILL takes the gateway and its bus down together
        from servicebus.gateway import Gateway

        gateway = Gateway(bus, listen="127.0.0.1:0").start()
    Path(args.ready).write_text(str(os.getpid()))
    batch, interval, k = 10, 10 / args.rate, 0
    next_at = time.monotonic()
    while not stop.exists():
        if quiet is not None and quiet.exists():
            # Said once the last publish's ids are in the acks file: the harness counts
            # only after this (its quiet file alone raced a publish already under way).
            Path(f"{quiet}.seen").touch()
            pause(0.1)
            bus.status()
            continue
        try:
            payloads = [{"k": k + i} for i in range(batch)]
            ids = post(gateway, payloads) if gateway is not None else bus.publish_many(TOPIC, payloads)
            if ids is None:  # the gateway refused it (not a 201): not acknowledged
                pause(0.01)
                continue
        except StoreWriteError:
            # A full disk: not acknowledged, nothing to count; try again soon, as an eager
            # service would (a 0.1 s pause here hid publishes lost during the recovery).
            pause(0.001)
            continue
        append(fd, "".join(f"{mid}\n" for mid in ids))
        k += batch
        next_at += interval
        delay = next_at - time.monotonic()
        if delay > 0:
            pause(delay)
        else:
            next_at = time.monotonic()
    if gateway is not None:
        gateway.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
