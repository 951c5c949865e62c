"""tools/bench_fleet: what discovery (services by name) costs and how fast it is.

    tools/bench_fleet [--sizes 5 20] [--window 10] [--gossip-interval 1.0] [--down-after 5.0]

For each fleet size N: N bus processes on loopback (tests/fleetproc.py: one ``orders``, the
seed of the others, and N-1 instances of services ``svc-0``, ``svc-1``...), plus this
script's own bus (``bench``, seeded with orders: the observer that subscribes and requests
by name). Measured, at the given gossip_interval/down_after (default: the bus's defaults):

- converged: from the first start until every bus's fleet() lists all the others up;
- new publisher used: a new instance of a new service ``feed`` that publishes 100 events a
  second from its start; from its process start until ``bench``, subscribed to ``feed`` by
  name before it existed, handles its first event (an interpreter start, ~0.3-0.5 s, included;
  "after up" counts from its bus being up);
- new server used: the same for a new instance of ``pricing`` and ``bench.request("pricing", ...)``
  tried in a loop until one is answered by it;
- declared down: one instance killed with SIGKILL; until ``bench``'s fleet() shows it down
  (its own poll, every 20 ms), and the slowest of the others (their fleet() in their state
  files, rewritten every 0.5 s: up to 0.5 s late);
- gossip per node: frames a second (gossip_sent + gossip_received counters, the mean over
  the nodes in a quiet window of ``--window`` s) and bytes a second (those frames times the
  size of a gossip frame carrying that node's table: msgpack payload, without ZeroMQ's
  framing and TCP/IP headers, ~60-100 bytes a frame more).

The column ``rmds`` is not measured: it is what RMDS-style liveness (a keepalive every 10 s
on each connection, offline after 3 missed) gives by its parameters, for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from servicebus import Bus  # noqa: E402
from servicebus.testing import free_address  # noqa: E402
from servicebus.wire import protocol as P  # noqa: E402

PROC = str(ROOT / "tests" / "fleetproc.py")
WIRE_KEYS = ("node", "name", "address", "epoch", "beat", "pub", "sub", "v", "key")
STATE_EVERY = 0.5


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class Proc:
    def __init__(self, work: Path, label: str, name: str, seed: str | None, args: list[str],
                 gossip: float, down: float) -> None:
        self.label, self.name, self.address = label, name, free_address()
        self.dir = work / label
        self.dir.mkdir()
        self.ready, self.state_file = self.dir / "ready", self.dir / "state.json"
        argv = [sys.executable, PROC, "--bind", self.address, "--datadir", str(self.dir / "data"),
                "--name", name, "--gossip-interval", str(gossip), "--down-after", str(down),
                "--ready", str(self.ready), "--state", str(self.state_file), "--state-every", str(STATE_EVERY),
                "--handled", str(self.dir / "handled"), "--acks", str(self.dir / "acks"), *args]
        if seed:
            argv += ["--seed", seed]
        self.started, self.started_wall = time.monotonic(), time.time()
        with open(self.dir / "log", "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=out, start_new_session=True,
                                         env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.up_at: float | None = None
        self.node = ""

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not (self.ready.exists() and self.ready.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.label} did not start:\n{(self.dir / 'log').read_text()[-2000:]}")
            time.sleep(0.005)
        self.up_at = time.monotonic()
        self.node = self.ready.read_text().split()[1]

    def state(self) -> dict[str, Any]:
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {"fleet": [], "counters": {}}

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


def wait(predicate: Any, timeout: float, what: str, interval: float = 0.01) -> float:
    """Seconds until ``predicate()`` held; RuntimeError past ``timeout``."""
    began = time.monotonic()
    while not predicate():
        if time.monotonic() - began > timeout:
            raise RuntimeError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - began


def up_nodes(rows: list[dict[str, Any]]) -> set[str]:
    return {r["node"] for r in rows if r.get("up") and not r.get("self")}


def frame_bytes(state: dict[str, Any]) -> int:
    """The size of a gossip frame carrying this node's table (itself and the instances up)."""
    rows = [r for r in state["fleet"] if r.get("self") or r.get("up")]
    members = [{k: r[k] for k in WIRE_KEYS if k in r} for r in rows]
    me = next((r["node"] for r in rows if r.get("self")), "0" * 16)
    return sum(len(part) for part in P.encode_gossip(me, members))


@dataclass
class Result:
    size: int
    converged: float = 0.0
    feed_used: float = 0.0
    feed_after_up: float = 0.0
    pricing_used: float = 0.0
    pricing_after_up: float = 0.0
    down_bench: float = 0.0
    down_slowest: float = 0.0
    frames: float = 0.0
    bytes: float = 0.0
    frame_size: float = 0.0
    notes: list[str] = field(default_factory=list)


def run_size(size: int, args: argparse.Namespace) -> Result:
    result = Result(size)
    work = Path(tempfile.mkdtemp(prefix=f"bench-fleet-{size}-"))
    procs: list[Proc] = []
    bench: Bus | None = None
    gossip, down = args.gossip_interval, args.down_after
    try:
        began = time.monotonic()
        orders = Proc(work, "orders", "orders", None, ["--command", "ping"], gossip, down)
        procs.append(orders)
        orders.wait_ready()
        for k in range(size - 1):
            procs.append(Proc(work, f"svc-{k}", f"svc-{k}", orders.address, ["--command", "ping"], gossip, down))
        for proc in procs:
            proc.wait_ready()
        nodes = {p.node for p in procs}
        converged = wait(lambda: all(up_nodes(p.state()["fleet"]) >= nodes - {p.node} for p in procs),
                         120, f"the {size} buses to know each other", 0.05)
        result.converged = time.monotonic() - began
        log(f"  {size} buses converged {result.converged:.1f} s after the first start ({converged:.1f} s after all up)")

        # Gossip traffic, in a quiet window: nothing else is sent but pings.
        before = {p.label: p.state()["counters"] for p in procs}
        t0 = time.monotonic()
        time.sleep(args.window)
        after = {p.label: p.state()["counters"] for p in procs}
        span = time.monotonic() - t0
        frames, sizes, byte_rates = [], [], []
        for p in procs:
            sent = after[p.label].get("gossip_sent", 0) - before[p.label].get("gossip_sent", 0)
            received = after[p.label].get("gossip_received", 0) - before[p.label].get("gossip_received", 0)
            size_ = frame_bytes(p.state())
            frames.append((sent + received) / span)
            sizes.append(size_)
            # Each frame sent carries this node's table; each received, the other's (about
            # the same size once converged): frames x this table's size.
            byte_rates.append((sent + received) / span * size_)
        result.frames = sum(frames) / len(frames)
        result.bytes = sum(byte_rates) / len(byte_rates)
        result.frame_size = sum(sizes) / len(sizes)

        # The observer: subscribes to 'feed' by name before any instance of it exists.
        bench = Bus(free_address(), work / "bench", name="bench", seeds=[orders.address],
                    gossip_interval=gossip, down_after=down)
        first = threading.Event()
        bench.every("feed.tick", lambda payload, message: first.set())
        bench.subscribe("feed", "feed.tick")
        wait(lambda: len(up_nodes(bench.fleet())) >= size, 60, "bench to know the fleet", 0.05)

        feed = Proc(work, "feed", "feed", orders.address, ["--publish", "feed.tick", "--rate", "100"], gossip, down)
        procs.append(feed)
        first.wait(60)
        if not first.is_set():
            raise RuntimeError("the new feed instance's events never reached bench")
        used = time.monotonic()
        feed.wait_ready()  # its ready file came before; read when it was written
        result.feed_used = used - feed.started
        result.feed_after_up = used - (feed.started + ready_offset(feed))

        pricing = Proc(work, "pricing", "pricing", orders.address, ["--command", "quote"], gossip, down)
        procs.append(pricing)
        while True:
            try:
                reply = bench.request("pricing", "quote", {}, timeout=0.5)
                if reply and reply.get("pid"):
                    break
            except ValueError:  # no instance of pricing known yet
                time.sleep(0.005)
            except Exception:  # noqa: BLE001 - a timeout: try again
                pass
            if time.monotonic() - pricing.started > 60:
                raise RuntimeError("no request by name reached the new pricing instance")
        used = time.monotonic()
        pricing.wait_ready()
        result.pricing_used = used - pricing.started
        result.pricing_after_up = used - (pricing.started + ready_offset(pricing))

        # Declared down: SIGKILL one of the services.
        victim = procs[1]
        victim.kill()
        killed = time.monotonic()
        result.down_bench = wait(lambda: any(r["node"] == victim.node and not r["up"] for r in bench.fleet()),
                                 down * 4 + 10, "bench to see the killed instance down", 0.02)
        others = [p for p in procs if p is not victim and p.proc.poll() is None]
        # Down, or never confirmed there (a bus that had not asked it itself before the kill
        # does not list it: only instances heard first hand are listed).
        wait(lambda: all(not any(r["node"] == victim.node and r["up"] for r in p.state()["fleet"]) for p in others),
             down * 4 + 10, "every bus to see the killed instance down", 0.05)
        result.down_slowest = time.monotonic() - killed
    finally:
        if bench is not None:
            bench.close()
        for proc in procs:
            proc.stop()
        shutil.rmtree(work, ignore_errors=True)
    return result


def ready_offset(proc: Proc) -> float:
    """Seconds from the process start to its bus up (the ready file's mtime)."""
    return max(0.0, proc.ready.stat().st_mtime - proc.started_wall)


def table(results: list[Result], gossip: float, down: float) -> str:
    head = ["measure"] + [f"fleet of {r.size}" for r in results] + ["rmds (keepalive 10 s, 3 missed)"]
    rows = [
        ["converged (all list all), s"] + [f"{r.converged:.2f}" for r in results] + ["n/a"],
        ["new publisher used by a subscriber by name, s from process start"]
        + [f"{r.feed_used:.2f}" for r in results] + ["not measured"],
        ["  of which after its bus was up, s"] + [f"{r.feed_after_up:.2f}" for r in results] + [""],
        ["new server reached by a request by name, s from process start"]
        + [f"{r.pricing_used:.2f}" for r in results] + ["not measured"],
        ["  of which after its bus was up, s"] + [f"{r.pricing_after_up:.2f}" for r in results] + [""],
        ["declared down after SIGKILL, s (one observer, polled 20 ms)"]
        + [f"{r.down_bench:.2f}" for r in results] + ["30-40 (3 x 10 s missed)"],
        ["declared down by every bus, s (+ up to 0.5 s state-file lag)"]
        + [f"{r.down_slowest:.2f}" for r in results] + ["30-40"],
        ["gossip frames/s per node (sent + received)"] + [f"{r.frames:.2f}" for r in results]
        + ["0.1 per connection each way"],
        ["gossip frame size, bytes (payload)"] + [f"{r.frame_size:.0f}" for r in results] + ["n/a"],
        ["gossip bytes/s per node (payload)"] + [f"{r.bytes:.0f}" for r in results] + ["n/a"],
    ]
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    line = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"  # noqa: E731
    return "\n".join([f"tools/bench_fleet, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, loopback, "
                      f"gossip_interval={gossip}, down_after={down}",
                      line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[5, 20])
    ap.add_argument("--window", type=float, default=10.0, help="seconds of quiet gossip counted")
    ap.add_argument("--gossip-interval", type=float, default=1.0)
    ap.add_argument("--down-after", type=float, default=5.0)
    args = ap.parse_args()
    results = []
    for size in args.sizes:
        log(f"== fleet of {size}")
        results.append(run_size(size, args))
    print(table(results, args.gossip_interval, args.down_after))
    return 0


if __name__ == "__main__":
    sys.exit(main())
