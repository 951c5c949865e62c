"""The two processes of the SQL outbox's kill tests, driven by command-line flags.

``relay``: a bus and ``SqlOutbox(bus, engine).start()``; writes ``--ready FILE`` once the
relay thread runs, stops cleanly on SIGTERM (the tests mostly SIGKILL it). With
``--fork-server`` it imports everything once, then on each ``go`` line on stdin forks a
relay of its own session (printing its pid) and on ``reap PID`` waits for it to end
(printing ``reaped``): the kill test restarts the relay 50 times, and a new interpreter
importing SQLAlchemy and the bus each time was most of the test's time.

``write``: a service instance whose ``--threads`` each commit one outbox row per
transaction (``{"n": n}``, n unique) into the same database until SIGTERM, rolling about
one in ten back instead (gaps in the ids). With ``--hold-ms`` each transaction stays open a
random moment before it ends, so with two threads rows commit out of id order, which a
PostgreSQL sequence allows (SQLite gives ids under its one write lock, in commit order).
For each attempt it appends ``ok N`` to ``--log FILE`` once the commit returned,
``rolledback N``, or ``failed N`` if the transaction raised (a row in doubt: it may or may
not have been committed). Plain appends reach the page cache, which survives the process.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import sys
import threading
import time
import traceback

import sqlalchemy as sa

from servicebus import Bus
from servicebus.sql import SqlOutbox

TOPIC = "order.placed"


def append(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def relay(args: argparse.Namespace, bus: Bus, engine: sa.Engine, stop: threading.Event) -> None:
    outbox = SqlOutbox(bus, engine, batch=args.batch, interval=args.interval).start()
    append(args.ready, f"{os.getpid()} {time.time()}")
    stop.wait()
    outbox.stop()


def write(args: argparse.Namespace, bus: Bus, engine: sa.Engine, stop: threading.Event) -> None:
    outbox = SqlOutbox(bus, engine)

    def writer(lane: int) -> None:
        rng = random.Random(os.getpid() * 100 + lane)
        n = args.first + lane
        while not stop.is_set():
            try:
                with engine.connect() as conn, conn.begin() as tx:
                    outbox.publish(conn, TOPIC, {"n": n})
                    if args.hold_ms:  # the other thread may commit a later id meanwhile
                        stop.wait(rng.uniform(0, args.hold_ms) / 1000)
                    rollback = rng.random() < 0.1
                    if rollback:
                        tx.rollback()
                append(args.log, f"{'rolledback' if rollback else 'ok'} {n}")
            except sa.exc.OperationalError as exc:  # e.g. SQLite's "database is locked"
                append(args.log, f"failed {n} {type(exc.orig).__name__}")
            n += args.threads
            # Pacing, not synchronisation: rows come at an uneven rate, often slower than
            # the relay moves them (so the table is often empty: the case where SQLite
            # handed ids out again).
            stop.wait(rng.uniform(0, args.pause_ms) / 1000)

    lanes = [threading.Thread(target=writer, args=(lane,)) for lane in range(args.threads)]
    for lane in lanes:
        lane.start()
    append(args.ready, f"{os.getpid()} {time.time()}")
    for lane in lanes:
        lane.join()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["relay", "write"])
    ap.add_argument("--bind", required=True)
    ap.add_argument("--datadir", required=True)
    ap.add_argument("--db", required=True, help="SQLAlchemy URL of the service's database")
    ap.add_argument("--ready", required=True)
    ap.add_argument("--log", help="write: the file of ok/failed lines")
    ap.add_argument("--first", type=int, default=0, help="write: n of the first row")
    ap.add_argument("--pause-ms", type=float, default=5.0, help="write: up to this between rows")
    ap.add_argument("--hold-ms", type=float, default=0.0, help="write: up to this in a transaction")
    ap.add_argument("--threads", type=int, default=1, help="write: transactions at once")
    ap.add_argument("--batch", type=int, default=100, help="relay: rows per relay step")
    ap.add_argument("--interval", type=float, default=0.001, help="relay: seconds between looks")
    ap.add_argument("--fork-server", action="store_true", help="relay: fork one on each 'go' line")
    args = ap.parse_args()
    if args.fork_server:
        serve_forks(args)
    else:
        run(args)


def serve_forks(args: argparse.Namespace) -> None:
    sa.create_engine(args.db).dispose()  # imports the database's driver here, once
    while line := sys.stdin.readline():
        if line.startswith("go"):
            pid = os.fork()
            if pid == 0:  # the relay: its own session (the test kills its group), not the pipes
                code = 1
                try:
                    os.setsid()
                    devnull = os.open(os.devnull, os.O_RDONLY)
                    os.dup2(devnull, 0)
                    os.dup2(2, 1)
                    run(args)
                    code = 0
                except BaseException:
                    traceback.print_exc()
                finally:
                    sys.stderr.flush()
                    os._exit(code)
            print(pid, flush=True)
        elif line.startswith("reap"):
            os.waitpid(int(line.split()[1]), 0)
            print("reaped", flush=True)


def run(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[{os.getpid()}] %(asctime)s %(threadName)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    engine = sa.create_engine(args.db)
    bus = Bus(args.bind, args.datadir)
    try:
        (relay if args.mode == "relay" else write)(args, bus, engine, stop)
    finally:
        bus.close()
        engine.dispose()


if __name__ == "__main__":
    main()
