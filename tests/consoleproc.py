"""A subscriber bus in its own process for the console's tests: it handles ``order.placed``
and fails (at once a dead letter: max_attempts=1) on a payload with ``bad`` true while the
file ``--fail-file`` exists. Each run that ends well appends ``done <n> <payload as JSON>``
to ``--out``."""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from pathlib import Path

from servicebus import Bus

from .busproc import append


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bind", required=True)
    ap.add_argument("--datadir", required=True)
    ap.add_argument("--ready", required=True)
    ap.add_argument("--publisher", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--fail-file", required=True)
    args = ap.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with Bus(args.bind, args.datadir, name="emails", max_attempts=1, retry_initial=0.05) as bus:
        @bus.every("order.placed")
        def handle(payload, message):
            if payload.get("bad") and Path(args.fail_file).exists():
                raise ValueError(f"order {payload['n']} has no customer")
            append(args.out, f"done {payload['n']} {json.dumps(payload, sort_keys=True)}")

        bus.subscribe(args.publisher, "order.placed", wait=30)
        append(args.ready, str(os.getpid()))
        stop.wait()


if __name__ == "__main__":
    main()
