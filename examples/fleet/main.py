"""A fleet that knows only names and one seed, run here on one machine (issue 30).

The services are examples/fleet/service.py, started as separate processes the way
docker-compose.yml starts them: orders, email and billing, each given its name, its own
data directory and the seed ``orders``; nobody is told another's address. A web client
(this script: a bus with a seed and no name of its own) places orders by
``request("orders", ...)``; orders publishes ``order.placed``; email and billing subscribe
to the service ``orders`` by name. Then email is redeployed: killed (-9) and started at a
new address with its data directory, as a rescheduled container is. The orders placed
meanwhile wait at orders, follow email to its new address, and arrive once.

Run it (after tools/test or tools/demo made .venv):

    .venv/bin/python examples/fleet/main.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from servicebus import Bus
from servicebus.testing import free_address, wait_until

HERE = Path(__file__).resolve().parent
FAST = {"GOSSIP": "0.2", "DOWN_AFTER": "1.0"}  # a lively demo; the defaults are 1 s and 5 s


def start(service: str, address: str, data: Path, seed: str | None, log: Path) -> subprocess.Popen:
    env = {**os.environ, **FAST, "SERVICE": service, "LISTEN": address, "DATA": str(data),
           "PYTHONUNBUFFERED": "1"}
    if seed:
        env["SEED"] = seed
    return subprocess.Popen([sys.executable, str(HERE / "service.py")], env=env,
                            stdout=log.open("a"), stderr=subprocess.STDOUT)


def lines(log: Path, prefix: str) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith(prefix)] if log.exists() else []


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="fleet-"))
    seed = free_address()  # orders' address: the one thing the others are given
    procs = {"orders": start("orders", seed, root / "orders", None, root / "orders.log")}
    for service in ("email", "billing"):
        procs[service] = start(service, free_address(), root / service, seed, root / f"{service}.log")
    web = Bus(free_address(), root / "web", seeds=[seed], gossip_interval=0.2, down_after=1.0)
    try:
        wait_until(lambda: {"orders", "email", "billing"} <= {m["name"] for m in web.fleet() if m["up"]},
                   timeout=30, message="the fleet to be found from the seed")
        for m in sorted(web.fleet(), key=lambda m: m["name"]):
            print(f"web: knows {m['name']:8} at {m['address']}")
        wait_until(lambda: all(lines(root / f"{s}.log", f"{s}: up") for s in ("email", "billing")), timeout=30)
        for n in (1, 2, 3):
            print(f"web: {web.request('orders', 'order.place', {'n': n}, timeout=30)}")
        wait_until(lambda: len(lines(root / "email.log", "email: order")) == 3, timeout=30)

        old = procs["email"]
        old.send_signal(signal.SIGKILL)
        old.wait()
        print("web: email killed (-9); orders 4-6 placed while it is away")
        for n in (4, 5, 6):
            web.request("orders", "order.place", {"n": n}, timeout=30)
        new_address = free_address()
        procs["email"] = start("email", new_address, root / "email", None, root / "email.log")
        print(f"web: email redeployed at {new_address} with its data (no seed: it knows the fleet)")
        wait_until(lambda: len(lines(root / "email.log", "email: order")) == 6, timeout=30,
                   message="email to get the orders placed while it was away")
        wait_until(lambda: len(lines(root / "billing.log", "billing: order")) == 6, timeout=30)
        for service in ("email", "billing"):
            got = [line.split()[2] for line in lines(root / f"{service}.log", f"{service}: order")]
            print(f"{service}: got orders {' '.join(got)}")
            assert sorted(got) == ["1", "2", "3", "4", "5", "6"], got
        print("fleet: every order reached every subscriber once, by name only")
        return 0
    except AssertionError:
        for log in sorted(root.glob("*.log")):  # what each service said, to see why
            print(f"--- {log.name} (last lines)", *log.read_text().splitlines()[-15:], sep="\n", file=sys.stderr)
        raise
    finally:
        web.close()
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    sys.exit(main())
