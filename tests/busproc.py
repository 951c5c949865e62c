"""A bus in its own process, driven by command-line flags, for cross-process tests.

It reports through files so the test never needs to parse logs:
- ``--ready FILE`` is written once the bus is up (and its subscriptions confirmed);
- each handler run appends ``start <id> <n> <attempt>`` and ``done <id> <n> <wall time>``
  lines to ``--out FILE`` (plain appends reach the page cache, which survives SIGKILL; a
  power-loss test keeps this file off the disk it cuts: it is the world outside the bus);
- each ``publish`` that returned appends its id to ``--ids FILE``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

from servicebus import Bus
from servicebus.testing import wait_until


def append(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bind", required=True)
    ap.add_argument("--datadir", required=True)
    ap.add_argument("--ready", required=True)
    ap.add_argument("--subscribe", action="append", default=[], help="ADDRESS TOPIC", nargs=2)
    ap.add_argument("--handle", help="topic to handle")
    ap.add_argument("--command", help="command to handle; replies {'n': n, 'pid': pid}")
    ap.add_argument("--request", nargs=2, help="ADDRESS COMMAND: fire one request, do not wait")
    ap.add_argument("--send", nargs=2, help="ADDRESS COMMAND: send one command {'n': 0}")
    ap.add_argument("--ttl", type=float, help="TTL of the --send command, in seconds")
    ap.add_argument("--out", help="handler log file")
    ap.add_argument("--die-at", type=int, help="SIGKILL self inside the handler of payload n, once")
    ap.add_argument("--marker", help="file that records that --die-at already happened")
    ap.add_argument("--die-always-at", type=int, help="SIGKILL self inside the handler of payload n, every time")
    ap.add_argument("--max-attempts", type=int, default=5)
    ap.add_argument("--publish", help="topic to publish to once a subscriber is there")
    ap.add_argument("--count", type=int, default=0)
    ap.add_argument("--first", type=int, default=0, help="payload n of the first message")
    ap.add_argument("--batch", type=int, default=0, help="publish_many batches of this size")
    ap.add_argument("--rate", type=float, default=0.0, help="publish at most this many messages a second")
    ap.add_argument("--ids", help="file of ids whose publish returned")
    ap.add_argument("--publish-when", help="publish only once this file exists (after ready)")
    ap.add_argument("--pad", type=int, default=200, help="payload padding bytes")
    ap.add_argument("--random-pad", action="store_true", help="incompressible padding")
    ap.add_argument("--kill-after-publish", action="store_true")
    ap.add_argument("--delay", type=float, help="publish with this delay= (seconds)")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--fail-first", action="store_true", help="the handler raises on attempt 1")
    ap.add_argument("--retry-initial", type=float, default=0.1)
    ap.add_argument("--retry-max", type=float, default=30.0)
    ap.add_argument("--ack-timeout", type=float, default=5.0)
    ap.add_argument("--group", help="subscribe in this subscriber group")
    ap.add_argument("--ordered", action="store_true", help="subscribe ordered")
    ap.add_argument("--keys", type=int, default=0, help="publish with key n %% KEYS")
    ap.add_argument("--handler-ms", type=float, default=0.0, help="each handler run takes this long")
    ap.add_argument("--kv-count", action="store_true",
                    help="in its run, the handler counts in message.kv ('count', and 'n:<n>' = its "
                         "attempt): committed with its completion, nothing else (an unsynced write)")
    ap.add_argument("--stage-pad", type=int, default=0,
                    help="padding bytes in what --kv-count and --send-to stage (the n:<n> value, the command)")
    ap.add_argument("--send-to", metavar="ADDRESS",
                    help="in its run, the handler sends tx.note {'n': n} to ADDRESS, nothing else "
                         "(stored in the outbox with its completion)")
    ap.add_argument("--transact", metavar="ADDRESS",
                    help="in its run, the handler counts in message.kv, publishes TOPIC.done and "
                         "sends tx.note to ADDRESS (committed with the run)")
    ap.add_argument("--retention", type=float, help="Bus(retention=): publish without waiting for a subscriber")
    ap.add_argument("--start", help="subscribe(start=): earliest, new or a message id")
    args = ap.parse_args()

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[{os.getpid()}] %(asctime)s %(threadName)s %(message)s")
    bus = Bus(args.bind, args.datadir, workers=args.workers, ack_timeout=args.ack_timeout,
              retry_initial=args.retry_initial, retry_max=args.retry_max,
              max_attempts=args.max_attempts, retention=args.retention)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def handler(payload, message):
        n = payload["n"]
        append(args.out, f"start {message.id} {n} {message.attempt}")
        if args.transact:
            message.kv.update("count", lambda c: c + 1, 0)
            message.kv.put(f"n:{n}", [message.attempt, "x" * args.stage_pad])
            message.publish(f"{message.topic}.done", {"n": n})
            message.send(args.transact, "tx.note", {"n": n})
        if args.send_to:
            message.send(args.send_to, "tx.note", {"n": n, "pad": "x" * args.stage_pad})
        if args.kv_count:
            message.kv.update("count", lambda c: c + 1, 0)
            message.kv.put(f"n:{n}", [message.attempt, "x" * args.stage_pad])
        if args.handler_ms:
            threading.Event().wait(args.handler_ms / 1000)
        if args.fail_first and message.attempt == 1:
            raise RuntimeError("failing the first attempt, as asked")
        if args.die_always_at is not None and n == args.die_always_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if args.die_at is not None and n == args.die_at and not os.path.exists(args.marker):
            append(args.marker, "died")
            os.kill(os.getpid(), signal.SIGKILL)
        append(args.out, f"done {message.id} {n} {time.time():.6f}")
        return {"n": n, "pid": os.getpid()}

    if args.handle:
        bus.every(args.handle, handler)
    if args.command:
        bus.handle(args.command, handler)
    if args.send:
        sent = bus.send(args.send[0], args.send[1], {"n": 0}, ttl=args.ttl)
        if args.ids:
            append(args.ids, sent)
    if args.request:
        bus.request_async(args.request[0], args.request[1], {"n": 0}, timeout=120)

    for address, topic in args.subscribe:
        bus.subscribe(address, topic, wait=30, group=args.group, ordered=args.ordered, start=args.start)

    if args.publish and not args.retention:
        wait_until(lambda: bus.status().subscriptions > 0, 30, 0.05, "a subscriber")
    # Its pid and its wall clock: a test that moved the clock checks that it really moved.
    append(args.ready, f"{os.getpid()} {time.time()}")

    if args.publish and args.publish_when:  # the test sets a fault up first, then lets it go
        wait_until(lambda: os.path.exists(args.publish_when), 60, 0.01, "the go file")
    if args.publish:
        n, end = args.first, args.first + args.count
        began = time.monotonic()
        while n < end:
            if args.rate:  # a steady stream, so that faults land mid-stream
                ahead = (n - args.first) / args.rate - (time.monotonic() - began)
                if ahead > 0:
                    threading.Event().wait(ahead)
            size = max(1, args.batch)
            payloads = [{"n": i, "pad": os.urandom(args.pad) if args.random_pad else "x" * args.pad}
                        for i in range(n, min(end, n + size))]
            if args.keys:
                ids = [bus.publish(args.publish, p, key=f"k{p['n'] % args.keys}") for p in payloads]
            elif args.batch:
                ids = bus.publish_many(args.publish, payloads)
            else:
                ids = [bus.publish(args.publish, payloads[0], delay=args.delay)]
            if args.ids:
                append(args.ids, "\n".join(ids))
            n += len(ids)
        if args.kill_after_publish:
            os.kill(os.getpid(), signal.SIGKILL)

    while not stop.is_set():
        stop.wait(0.1)
    bus.close()


if __name__ == "__main__":
    main()
