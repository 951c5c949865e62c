"""The web service: each line on stdin is a sign-up; it publishes ``user.signup``.

    python web.py --bind tcp://127.0.0.1:12345 --data data/web

``publish`` returns once the event is fsynced, so the line printed after it is a promise:
this sign-up will reach every subscriber, even if this process is killed right now.
"""

import argparse
import signal
import sys

from servicebus import Bus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bind", default="tcp://127.0.0.1:12345")
    ap.add_argument("--data", default="data/web")
    args = ap.parse_args()
    # SIGTERM unwinds the `with` below, so the bus closes cleanly and releases its lock.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with Bus(args.bind, args.data) as bus:
        print(f"ready {bus.address}", flush=True)
        for n, line in enumerate(sys.stdin):
            email = line.strip()
            if not email:
                continue
            message_id = bus.publish("user.signup", {"id": n, "email": email})
            print(f"published {message_id} {email} pending={bus.status().pending}", flush=True)


if __name__ == "__main__":
    main()
