"""The email service: subscribes to the web service's ``user.signup`` events and "sends" a
welcome email for each (appends a line to a file).

    python email_service.py --web tcp://127.0.0.1:12345 --bind tcp://127.0.0.1:54321 \\
        --data data/email --outbox out/emails.txt
"""

import argparse
import os
import signal
import threading

from servicebus import Bus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--web", default="tcp://127.0.0.1:12345")
    ap.add_argument("--bind", default="tcp://127.0.0.1:54321")
    ap.add_argument("--data", default="data/email")
    ap.add_argument("--outbox", default="out/emails.txt")
    args = ap.parse_args()
    os.makedirs(os.path.dirname(args.outbox) or ".", exist_ok=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    with Bus(args.bind, args.data) as bus:
        @bus.every("user.signup")
        def welcome(payload, message):
            # Returning marks the message done; raising would retry it, then dead-letter it.
            with open(args.outbox, "a") as out:
                out.write(f"{message.id} welcome {payload['email']}\n")

        # Idempotent: a service subscribes on every start. Waits here only so that the demo
        # can say "subscribed"; without wait= the request is stored and retried anyway.
        bus.subscribe(args.web, "user.signup", wait=30)
        print(f"ready {bus.address}", flush=True)
        stop.wait()


if __name__ == "__main__":
    main()
