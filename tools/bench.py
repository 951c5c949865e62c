"""servicebus benchmarks: durable end-to-end throughput between two processes.

Prints one table (median and min-max of N runs) and each scenario's ratio against the
physical baseline measured in the same invocation: the fsync ceiling of the disk under the
data directory (1 / latency of a small write + fsync).

    tools/bench [--quick] [--runs N] [--only NAME] [--json]

Roles (internal): ``--role sub`` / ``--role pub`` run one side of a scenario.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PAYLOAD = {"pad": "x" * 240}  # 256 bytes once msgpack-encoded with its id field
TOPIC = "bench.event"

SCENARIOS = {
    # name: (description, publish mode, messages (full), messages (quick))
    "e2e-batch": ("publish_many (100/batch) -> handler, 1 -> 1 process", "batch", 200_000, 40_000),
    "e2e-batch-nojournal": ("e2e-batch with journal=False on both buses (journal cost)", "batch", 200_000, 40_000),
    "e2e-threads": ("8 threads calling publish -> handler, 1 -> 1 process", "threads", 40_000, 10_000),
    "publish-serial": ("1 thread, one publish at a time (fsync each)", "serial", 5_000, 1_500),
    "request-serial": ("request -> handler -> reply, one at a time, 2 processes", "req1", 2_000, 500),
    "request-100": ("request_async with 100 in flight, 2 processes", "req100", 20_000, 5_000),
}


# --- child roles ---------------------------------------------------------------------------

def role_sub(args: argparse.Namespace) -> None:
    from servicebus import Bus

    seen: set[int] = set()
    dupes = 0
    lock = threading.Lock()
    done = threading.Event()
    first_last = [0.0, 0.0]
    with Bus(args.bind, args.datadir, workers=args.workers, journal=not args.no_journal) as bus:
        @bus.every(TOPIC)
        def handler(payload, message):
            nonlocal dupes
            with lock:
                n = payload["n"]
                if n in seen:
                    dupes += 1
                seen.add(n)
                now = time.time()
                if not first_last[0]:
                    first_last[0] = now
                first_last[1] = now
                if len(seen) >= args.count:
                    done.set()

        bus.subscribe(args.peer, TOPIC, wait=60)
        print("ready", flush=True)
        done.wait(600)
        bus.drain(30)
        counters = bus.counters()
    print(json.dumps({"received": len(seen), "duplicates": dupes, "first": first_last[0],
                      "last": first_last[1], "fsyncs": counters.get("fsyncs", 0)}), flush=True)


def role_server(args: argparse.Namespace) -> None:
    from servicebus import Bus

    with Bus(args.bind, args.datadir) as bus:
        bus.handle("bench.quote", lambda payload, message: {"n": payload["n"], "price": 10})
        print("ready", flush=True)
        sys.stdin.readline()  # the parent closes stdin when the run is over
        counters = bus.counters()
    print(json.dumps({"fsyncs": counters.get("fsyncs", 0)}), flush=True)


def role_client(args: argparse.Namespace) -> None:
    from collections import deque

    from servicebus import Bus

    in_flight = 1 if args.mode == "req1" else 100
    with Bus(args.bind, args.datadir) as bus:
        bus.request(args.peer, "bench.quote", {"n": -1, **PAYLOAD}, timeout=60)  # warm up
        before = bus.counters().get("fsyncs", 0)
        start = time.time()
        pending: deque = deque()
        wrong = 0
        for n in range(args.count):
            if len(pending) >= in_flight:
                k, fut = pending.popleft()
                wrong += fut.result(60)["n"] != k
            pending.append((n, bus.request_async(args.peer, "bench.quote", {"n": n, **PAYLOAD}, 60)))
        while pending:
            k, fut = pending.popleft()
            wrong += fut.result(60)["n"] != k
        end = time.time()
        fsyncs = bus.counters().get("fsyncs", 0) - before
    print(json.dumps({"start": start, "end": end, "fsyncs": fsyncs, "wrong": wrong}), flush=True)


def run_request_scenario(mode: str, count: int, run_dir: Path) -> dict:
    from servicebus.testing import free_address

    server_addr, client_addr = free_address(), free_address()
    me = [sys.executable, str(Path(__file__).resolve())]
    server = subprocess.Popen(me + ["--role", "server", "--bind", server_addr,
                                    "--datadir", str(run_dir / "server")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        client = subprocess.run(me + ["--role", "client", "--bind", client_addr, "--peer", server_addr,
                                      "--mode", mode, "--count", str(count),
                                      "--datadir", str(run_dir / "client")],
                                stdout=subprocess.PIPE, text=True, check=True, timeout=600)
        c = json.loads(client.stdout)
        server.stdin.close()
        s = json.loads(server.stdout.readline())
    finally:
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    return {
        "msgs_per_s": count / (c["end"] - c["start"]),
        "fsyncs_per_msg": (c["fsyncs"] + s["fsyncs"]) / count,
        "exactly_once": c["wrong"] == 0,
        "received": count, "duplicates": 0,
    }


def role_pub(args: argparse.Namespace) -> None:
    from servicebus import Bus
    from servicebus.testing import wait_until

    with Bus(args.bind, args.datadir, journal=not args.no_journal) as bus:
        wait_until(lambda: bus.status().subscriptions > 0, 60, 0.01)
        before = bus.counters().get("fsyncs", 0)
        start = time.time()
        if args.mode == "batch":
            for base in range(0, args.count, 100):
                bus.publish_many(TOPIC, [{"n": n, **PAYLOAD} for n in range(base, min(args.count, base + 100))])
        elif args.mode == "serial":
            for n in range(args.count):
                bus.publish(TOPIC, {"n": n, **PAYLOAD})
        else:
            def worker(k: int) -> None:
                for n in range(k, args.count, 8):
                    bus.publish(TOPIC, {"n": n, **PAYLOAD})
            threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        end = time.time()
        fsyncs = bus.counters().get("fsyncs", 0) - before
        bus.drain(120)
    print(json.dumps({"start": start, "end": end, "fsyncs": fsyncs}), flush=True)


# --- parent --------------------------------------------------------------------------------

def fsync_latency(directory: Path, count: int) -> float:
    """Median seconds for a 256-byte write + fsync on the data directory's filesystem."""
    path = directory / "fsync.probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    samples = []
    try:
        for _ in range(count):
            t = time.perf_counter()
            os.write(fd, b"x" * 256)
            os.fsync(fd)
            samples.append(time.perf_counter() - t)
    finally:
        os.close(fd)
        path.unlink()
    return statistics.median(samples)


def run_scenario(name: str, count: int, tmp: Path) -> dict:
    from servicebus.testing import free_address

    _desc, mode, _full, _quick = SCENARIOS[name]
    run_dir = Path(tempfile.mkdtemp(dir=tmp))
    if mode.startswith("req"):
        return run_request_scenario(mode, count, run_dir)
    pub_addr, sub_addr = free_address(), free_address()
    me = [sys.executable, str(Path(__file__).resolve())]
    extra = ["--no-journal"] if name.endswith("-nojournal") else []
    sub = subprocess.Popen(me + ["--role", "sub", "--bind", sub_addr, "--peer", pub_addr,
                                 "--datadir", str(run_dir / "sub"), "--count", str(count), *extra],
                           stdout=subprocess.PIPE, text=True)
    pub = subprocess.Popen(me + ["--role", "pub", "--bind", pub_addr, "--mode", mode,
                                 "--datadir", str(run_dir / "pub"), "--count", str(count), *extra],
                           stdout=subprocess.PIPE, text=True)
    try:
        assert sub.stdout.readline().strip() == "ready"
        p = json.loads(pub.stdout.readline())
        s = json.loads(sub.stdout.readline())
    finally:
        for proc in (pub, sub):
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
    elapsed = s["last"] - p["start"]
    return {
        "msgs_per_s": count / elapsed,
        "publish_per_s": count / (p["end"] - p["start"]),
        "fsyncs_per_msg": (p["fsyncs"] + s["fsyncs"]) / count,
        "exactly_once": s["received"] == count and s["duplicates"] == 0,
        "received": s["received"], "duplicates": s["duplicates"],
    }


def fmt_rate(values: list[float]) -> str:
    return f"{statistics.median(values):>9,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=["sub", "pub", "server", "client"], help=argparse.SUPPRESS)
    ap.add_argument("--bind", help=argparse.SUPPRESS)
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    ap.add_argument("--datadir", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--no-journal", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="fewer messages per run")
    ap.add_argument("--runs", type=int, default=3, help="runs per scenario (default 3)")
    ap.add_argument("--only", action="append", choices=list(SCENARIOS), help="run only this scenario")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    if args.role == "sub":
        role_sub(args)
        return 0
    if args.role == "pub":
        role_pub(args)
        return 0
    if args.role in ("server", "client"):
        (role_server if args.role == "server" else role_client)(args)
        return 0

    names = args.only or list(SCENARIOS)
    tmp = Path(tempfile.mkdtemp(prefix="servicebus-bench-"))
    results: dict[str, list[dict]] = {n: [] for n in names}
    fsync_samples = []
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    log(f"servicebus bench: {os.cpu_count()} cores, 256-byte payloads, data under {tmp}")
    for run in range(args.runs):
        fsync_samples.append(fsync_latency(tmp, 300 if args.quick else 1000))
        for name in names:  # alternate scenarios run by run
            count = SCENARIOS[name][3 if args.quick else 2]
            result = run_scenario(name, count, tmp)
            results[name].append(result)
            log(f"  run {run + 1}/{args.runs} {name}: {result['msgs_per_s']:,.0f} msgs/s, "
                f"{result['fsyncs_per_msg']:.3f} fsyncs/msg, exactly once: {result['exactly_once']}")
    ceiling = 1 / statistics.median(fsync_samples)
    summary = {
        "fsync_latency_us": [s * 1e6 for s in fsync_samples],
        "fsync_ceiling_per_s": ceiling,
        "scenarios": {n: {"runs": r, "median_msgs_per_s": statistics.median(x["msgs_per_s"] for x in r),
                          "ratio_to_fsync_ceiling": statistics.median(x["msgs_per_s"] for x in r) / ceiling}
                      for n, r in results.items()},
    }
    journal_note = None
    if "e2e-batch" in results and "e2e-batch-nojournal" in results:
        on = statistics.median(r["msgs_per_s"] for r in results["e2e-batch"])
        off = statistics.median(r["msgs_per_s"] for r in results["e2e-batch-nojournal"])
        summary["journal_cost"] = 1 - on / off
        journal_note = (f"\njournal cost: e2e-batch with the journal on runs at {on / off:.1%} of journal "
                        f"off ({1 - on / off:+.1%}; target: within 15 %)")
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        lat = statistics.median(fsync_samples) * 1e6
        print(f"\nbaseline: fsync of a 256-byte write {lat:.0f} us median -> ceiling {ceiling:,.0f} fsyncs/s")
        print("every message is fsynced twice: by the publisher before publish returns and by the "
              "subscriber before it acks\n")
        print("request scenarios count round trips (request, handler, reply) per second\n")
        print(f"{'scenario':<15} {'msgs/s median (min-max)':>28} {'fsyncs/msg':>11} {'x fsync ceiling':>16} exactly-once")
        for name, runs in results.items():
            rates = [r["msgs_per_s"] for r in runs]
            print(f"{name:<15} {fmt_rate(rates):>28} {statistics.median(r['fsyncs_per_msg'] for r in runs):>11.3f} "
                  f"{statistics.median(rates) / ceiling:>15.1f}x {'yes' if all(r['exactly_once'] for r in runs) else 'NO'}")
        if journal_note:
            print(journal_note)
    shutil_rmtree(tmp)
    return 0 if all(r["exactly_once"] for runs in results.values() for r in runs) else 1


def shutil_rmtree(path: Path) -> None:
    import shutil
    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
