"""HTTP gateway benchmarks: Node 20 clients against servicebus.gateway, beside the Python API.

    tools/bench_gateway [--quick] [--runs N] [--only NAME ...] [--seconds S] [--warmup S]
                        [--profile DIR] [--json]

The conventions of tools/bench (its helpers are imported from there): every role is a
child process, runs alternate between systems, the table shows the median (min-max) per
(scenario, system) and each target with its verdict, and the fsync latency of the disk
is measured in the same invocation. A separate script because tools/bench's scenarios are
a publisher and a subscriber process compared with RabbitMQ/NATS/Redis, while these are a
gateway process, Node clients (``tools/bench_gateway_client.mjs``: built-in fetch,
keep-alive, no packages) and the Python API as the reference; and they bound each run in
time (``--warmup`` then ``--seconds`` measured) rather than in messages.

The gateway runs alone in its process (``Gateway(bus, listen="127.0.0.1:0").start()`` on
a fresh data directory), so its RSS and CPU (sampled from /proc) are the gateway's;
the clients share the machine's cores with it. Publishes need a subscription to be stored:
as in tools/bench's publish-serial, a subscriber process subscribes and goes away, and
every message queues (fsynced) on the publishing bus's disk; the Python API reference
does the same with a bus of its own in its own process.

Scenarios (systems): http-publish (python, http): 64 concurrent publishers, one message
per call; http-publish-batch (python, http): 16 concurrent publishers, 100 per call;
http-pull (http): 4 blockqueue-like consumers, GET ?max=100 then a batch DELETE of the
ids, on a pre-filled queue; http-idle: 10,000 long polls open, /health timed.
``--profile DIR`` records the gateway with py-spy during each measured http window
(collapsed stacks, DIR/<scenario>-<run>.txt) and prints the top frames.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402 - tools/bench's helpers: roles, CPU from /proc, the fsync probe

NODE = os.environ.get("NODE", "/usr/bin/node")
CLIENT = Path(__file__).resolve().parent / "bench_gateway_client.mjs"
TOPIC = bench.TOPIC  # the topic tools/bench's subscriber role subscribes to
PULL_TOPIC, IDLE_TOPIC = "bench.pull", "bench.idle"


@dataclass(frozen=True)
class Scenario:
    description: str
    systems: tuple[str, ...]
    concurrency: int
    batch: int
    target: str


SCENARIOS = {
    "http-publish": Scenario("64 concurrent publishers, 1 message per call, answered after the fsync",
                             ("python", "http"), 64, 1,
                             ">= 3,000 msgs/s; p50 <= 3x python's"),
    "http-publish-batch": Scenario("16 concurrent publishers, 100 messages per call (?many=true)",
                                   ("python", "http"), 16, 100, ">= 15,000 msgs/s"),
    "http-pull": Scenario("4 consumers: GET ?max=100, then DELETE ?ids=... (pre-filled queue)",
                          ("http",), 4, 100, ">= 10,000 msgs/s"),
    "http-idle": Scenario("10,000 idle long polls open (100 subscribers); GET /health every 10 ms",
                          ("http",), 10_000, 0, "RSS < 300 MB; /health p99 < 50 ms"),
}
SYSTEM_LABEL = {"python": "python API (threads)", "http": "gateway <- node fetch"}


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args], text=True,
                            stdout=subprocess.PIPE, stdin=subprocess.PIPE)


def raise_fd_limit() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))


def http(method: str, url: str, body: object | None = None) -> object:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        raw = r.read()
    return json.loads(raw) if raw else None


# --- child roles -----------------------------------------------------------------------------------


def role_gateway(a: argparse.Namespace) -> None:
    """A bus and its gateway, nothing else in the process. Says {"url", "bus"} when
    listening (after making the subscribers and pre-filling the queue asked for), then
    serves until its stdin closes."""
    from servicebus import Bus
    from servicebus.gateway import Gateway
    from servicebus.testing import free_address

    raise_fd_limit()
    # An experiment knob (the gateway's default is 32): bus calls it runs at once.
    threads = {"threads": int(os.environ["BENCH_GATEWAY_THREADS"])} if os.environ.get("BENCH_GATEWAY_THREADS") else {}
    with Bus(free_address(), a.datadir) as bus, Gateway(bus, listen="127.0.0.1:0", **threads) as gw:
        if a.subs:
            for i in range(a.subs):
                name = a.sub if a.subs == 1 else f"{a.sub}{i}"
                http("PUT", f"{gw.url}/topics/{a.topic}/subscribers/{name}",
                     {"max_attempts": 5, "visibility_duration": "60s"})
        if a.prefill:
            for base in range(0, a.prefill, 1000):
                bus.publish_many(a.topic, [bench.payload(n) for n in range(base, min(a.prefill, base + 1000))])
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                subs = http("GET", f"{gw.url}/topics/{a.topic}/subscribers")["subscribers"]
                if subs and subs[0]["unpublished"] >= a.prefill:
                    break
                time.sleep(0.2)
        fsyncs = bus.counters().get("fsyncs", 0)
        print(json.dumps({"url": gw.url, "bus": bus.address}), flush=True)
        sys.stdin.read()
        fsyncs = bus.counters().get("fsyncs", 0) - fsyncs
        print(json.dumps({"fsyncs": fsyncs, "published": gw.counters["published"]}), flush=True)


def role_python(a: argparse.Namespace) -> None:
    """The Python API reference: ``concurrency`` threads, each publishing (``batch`` per
    call) one call at a time on one bus, for warmup + seconds once told to start."""
    from servicebus import Bus
    from servicebus.testing import free_address

    with Bus(free_address(), a.datadir) as bus:
        print(json.dumps({"bus": bus.address}), flush=True)
        sys.stdin.readline()  # the subscriber has subscribed and gone
        t0 = time.perf_counter()
        start, end = t0 + a.warmup, t0 + a.warmup + a.seconds
        lats: list[list[float]] = [[] for _ in range(a.concurrency)]
        counts = [0] * a.concurrency
        cpu: list[float] = []

        def worker(w: int) -> None:
            n = w * 1_000_000_000
            while True:
                t = time.perf_counter()
                if t >= end:
                    return
                if a.batch > 1:
                    bus.publish_many(TOPIC, [bench.payload(n + i) for i in range(a.batch)])
                else:
                    bus.publish(TOPIC, bench.payload(n))
                n += a.batch
                done = time.perf_counter()
                if start <= done <= end:
                    lats[w].append(done - t)
                    counts[w] += a.batch

        def cpu_at(when: float) -> None:
            time.sleep(max(0.0, when - time.perf_counter()))
            cpu.append(bench.cpu_seconds())

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(a.concurrency)]
        threads += [threading.Thread(target=cpu_at, args=(t,)) for t in (start, end)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        lat = sorted(x for w in lats for x in w)
        count = sum(counts)
        print(json.dumps({"count": count, "seconds": a.seconds, "value": count / a.seconds,
                          "p50_us": lat[len(lat) // 2] * 1e6, "p99_us": lat[int(len(lat) * 0.99)] * 1e6,
                          "errors": 0, "cpu": cpu[-1] - cpu[0], "fsyncs": bus.counters().get("fsyncs", 0)}),
              flush=True)


# --- one run ---------------------------------------------------------------------------------------


class Sampler:
    """The gateway process's peak RSS (every 100 ms) and its CPU seconds on demand."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.proc = psutil.Process(pid)
        self.rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.rss = max(self.rss, self.proc.memory_info().rss)
            except Exception:  # noqa: BLE001 - ended
                return
            self._stop.wait(0.1)

    def cpu(self) -> float:
        return bench.cpu_seconds(self.proc.pid)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.rss / 2**20


def away_subscriber(run_dir: Path, bus_address: str) -> None:
    """tools/bench's subscriber role, count 0: subscribes to TOPIC and goes away, so what
    is published there is stored for it (fsynced) at the publisher."""
    from servicebus.testing import free_address

    away = bench.spawn("--role", "sub", "--bind", free_address(), "--peer", bus_address,
                       "--datadir", str(run_dir / "away"), "--count", "0")
    bench.read_json(away)
    bench.read_json(away)
    bench.finish(away)


def run_python(name: str, a: argparse.Namespace, run_dir: Path) -> dict:
    sc = SCENARIOS[name]
    proc = spawn("--role", "python", "--datadir", str(run_dir / "bus"), "--concurrency", str(sc.concurrency),
                 "--batch", str(sc.batch), "--seconds", str(a.seconds), "--warmup", str(a.warmup))
    bus = bench.read_json(proc)["bus"]
    away_subscriber(run_dir, bus)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    r = bench.read_json(proc)
    proc.stdin.close()
    bench.finish(proc)
    r["cpu_us_per_msg"] = r["cpu"] / max(1, r["count"]) * 1e6
    r["fsyncs_per_msg"] = r["fsyncs"] / max(1, r["count"])
    return r


def run_http(name: str, a: argparse.Namespace, run_dir: Path, run: int) -> dict:
    sc = SCENARIOS[name]
    role = ["--role", "gateway", "--datadir", str(run_dir / "bus")]
    client = {"mode": "publish", "topic": TOPIC, "concurrency": sc.concurrency, "batch": sc.batch,
              "seconds": a.seconds, "warmup": a.warmup}
    if name == "http-pull":
        # Enough for the target and then some over warmup + window (an early drain is timed).
        prefill = int(max(20_000, 20_000 * (a.seconds + a.warmup)))
        role += ["--topic", PULL_TOPIC, "--subs", "1", "--sub", "worker", "--prefill", str(prefill)]
        client.update(mode="pull", topic=PULL_TOPIC, sub="worker")
    elif name == "http-idle":
        role += ["--topic", IDLE_TOPIC, "--subs", "100", "--sub", "idle"]
        client.update(mode="idle", topic=IDLE_TOPIC, sub="idle", subs=100, polls=sc.concurrency, interval_ms=10)
    gw = spawn(*role)
    try:
        info = bench.read_json(gw)
        if name.startswith("http-publish"):
            away_subscriber(run_dir, info["bus"])
        sampler = Sampler(gw.pid)
        node = subprocess.Popen([NODE, str(CLIENT), json.dumps({**client, "url": info["url"]})], text=True,
                                stdout=subprocess.PIPE, stdin=subprocess.PIPE)
        try:
            extra: dict = {}
            if name == "http-idle":
                opened = bench.read_json(node)
                t0 = time.monotonic()
                while sampler.proc.num_fds() < opened["polls"] and time.monotonic() - t0 < 60:
                    time.sleep(0.2)
                extra["fds_held"] = sampler.proc.num_fds()
                # Then until it has read them all (each takes once, finds nothing, waits):
                # quiet, under 10 % of a core for half a second.
                while time.monotonic() - t0 < 60:
                    before = sampler.cpu()
                    time.sleep(0.5)
                    if sampler.cpu() - before < 0.05:
                        break
                extra["open_s"] = time.monotonic() - t0
                node.stdin.write("go\n")
                node.stdin.flush()
            assert bench.read_json(node, timeout=60).get("phase") == "measure"
            cpu0 = sampler.cpu()
            spy = profile(a, gw.pid, f"{name}-{run + 1}")
            r = bench.read_json(node, timeout=a.seconds + 120)
            cpu = sampler.cpu() - cpu0
            if spy is not None:
                spy.wait(60)
        finally:
            bench.finish(node)
        if "fatal" in r:
            raise RuntimeError(f"node client: {r['fatal']}")
        rss = sampler.stop()
        gw.stdin.close()
        end = bench.read_json(gw)
        if end["published"]:  # the front bus's fsyncs per message published over HTTP (warm-up too)
            extra["fsyncs_per_msg"] = end["fsyncs"] / end["published"]
    finally:
        if not gw.stdin.closed:
            gw.stdin.close()
        bench.finish(gw)
    r.update(extra, max_rss_mb=rss, cpu=cpu, cpu_us_per_msg=cpu / max(1, r["count"]) * 1e6)
    if name == "http-idle":
        r["value"] = r["p99_us"] / 1000  # ms
    return r


def py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"  # pip install py-spy into the venv
    return str(beside) if beside.exists() else shutil.which("py-spy")


def client_ceiling(a: argparse.Namespace) -> dict:
    """http-publish's client against a Node server that answers 201 at once: what one Node
    process of fetch() can ask on this machine, whatever the server."""
    server = subprocess.Popen([NODE, str(CLIENT), json.dumps({"mode": "null-server"})], text=True,
                              stdout=subprocess.PIPE, stdin=subprocess.PIPE)
    try:
        url = bench.read_json(server)["url"]
        sc = SCENARIOS["http-publish"]
        client = {"mode": "publish", "topic": TOPIC, "concurrency": sc.concurrency, "batch": 1,
                  "seconds": a.seconds, "warmup": a.warmup, "url": url}
        node = subprocess.Popen([NODE, str(CLIENT), json.dumps(client)], text=True, stdout=subprocess.PIPE)
        bench.read_json(node, timeout=60)
        cpu0 = bench.cpu_seconds(node.pid)
        r = bench.read_json(node, timeout=a.seconds + 60)
        r["client_cpu_us_per_req"] = (bench.cpu_seconds(node.pid) - cpu0) / max(1, r["count"]) * 1e6
        bench.finish(node)
        return r
    finally:
        server.stdin.close()
        bench.finish(server)


def profile(a: argparse.Namespace, pid: int, label: str) -> subprocess.Popen | None:
    spy = py_spy()
    if not a.profile or spy is None:
        return None
    Path(a.profile).mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(int(a.seconds)),
                             "--rate", "250", "--format", "raw", "--nonblocking",
                             "--output", str(Path(a.profile) / f"{label}.txt")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def top_frames(path: Path, n: int = 25) -> list[tuple[str, float, float]]:
    """(frame, self %, inclusive %) of py-spy's collapsed stacks, the busiest first."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    samples = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        k = int(count)
        samples += k
        frames = stack.split(";")
        own[frames[-1]] += k
        for f in set(frames):
            total[f] += k
    return [(f, own[f] / samples * 100, total[f] / samples * 100) for f, _ in own.most_common(n)]


# --- the table -------------------------------------------------------------------------------------


def verdict(name: str, t: dict) -> str:
    http_, py = t.get("http"), t.get("python")
    if http_ is None:
        return "-"
    if name == "http-publish":
        ok = http_["median"] >= 3000
        text = f"{http_['median']:,.0f}/s {'ok' if ok else 'MISSED'}"
        if py:
            ratio = http_["p50_us"] / py["p50_us"]
            text += f"; p50 {ratio:.1f}x python's {'ok' if ratio <= 3 else 'MISSED'}"
        return text
    if name == "http-publish-batch":
        return f"{'ok' if http_['median'] >= 15000 else 'MISSED'}"
    if name == "http-pull":
        return f"{'ok' if http_['median'] >= 10000 else 'MISSED'}"
    rss_ok, p99_ok = http_["max_rss_mb"] < 300, http_["median"] < 50
    return f"RSS {'ok' if rss_ok else 'MISSED'}, p99 {'ok' if p99_ok else 'MISSED'}"


def summarize(runs: list[dict]) -> dict:
    values = [r["value"] for r in runs]
    out = {"median": statistics.median(values), "min": min(values), "max": max(values),
           "errors": sum(r["errors"] for r in runs), "runs": runs}
    for key in ("p50_us", "p99_us", "cpu_us_per_msg", "max_rss_mb", "fsyncs_per_msg"):
        if all(r.get(key) is not None for r in runs):
            out[key] = statistics.median(r[key] for r in runs)
    return out


def print_table(summary: dict) -> None:
    print(f"\nservicebus gateway bench {summary['date']}: {summary['cores']} cores shared by the gateway and "
          f"the clients, 256-byte payloads ({{\"n\", \"pad\"}} JSON), loopback; {summary['runs']} run(s) each, "
          f"alternating; {summary['warmup']:g} s warm-up then {summary['seconds']:g} s measured; median (min-max)")
    print(f"physical: fsync {summary['fsync_us']:.0f} us (ceiling {1e6 / summary['fsync_us']:,.0f}/s); "
          f"node {summary['node']}, the gateway alone in its process (cpu/msg and RSS are its own; for "
          "python, the publishing process's)")
    c = summary.get("ceiling")
    if c:
        print(f"client ceiling: http-publish's 64 fetch() loops against a Node server that answers 201 at once: "
              f"{c['value']:,.0f} req/s, p50 {c['p50_us'] / 1000:.2f} ms, {c['client_cpu_us_per_req']:.0f} us of "
              "client CPU per request")
    print("msg/fsync: messages per fsync of the publishing bus (the group commit's group size)")
    print(f"{'scenario':<20}{'system':<24}{'median (min-max)':>28}      {'p50':>8} {'p99':>8} {'cpu/msg':>9} "
          f"{'RSS':>7} {'msg/fsync':>9} {'err':>4}  target")
    for name, systems in summary["scenarios"].items():
        sc = SCENARIOS[name]
        unit = "ms p99" if name == "http-idle" else "msgs/s"
        for system, v in systems.items():
            fmt = "{:,.1f}" if name == "http-idle" else "{:,.0f}"
            med, lo, hi = (fmt.format(v[k]) for k in ("median", "min", "max"))
            p50 = f"{v['p50_us'] / 1000:.2f}ms" if "p50_us" in v else "-"
            p99 = f"{v['p99_us'] / 1000:.2f}ms" if "p99_us" in v else "-"
            cpu = f"{v['cpu_us_per_msg']:.0f}us" if "cpu_us_per_msg" in v and name != "http-idle" else "-"
            rss = f"{v['max_rss_mb']:.0f}MB" if "max_rss_mb" in v else "-"
            group = f"{1 / v['fsyncs_per_msg']:.1f}" if v.get("fsyncs_per_msg") else "-"
            target = f"{sc.target} -> {verdict(name, systems)}" if system == "http" else ""
            print(f"{name:<20}{SYSTEM_LABEL[system]:<24}{med:>14} ({lo}-{hi}) {unit:<6}"
                  f" {p50:>8} {p99:>8} {cpu:>9} {rss:>7} {group:>9} {v['errors']:>4}  {target}")
    for name, systems in summary["scenarios"].items():
        if "http" in systems and "python" in systems:
            h, p = systems["http"], systems["python"]
            print(f"{name}: http / python API {h['median'] / p['median']:.0%} of the rate, p50 "
                  f"{h['p50_us'] / p['p50_us']:.1f}x, cpu/msg {h['cpu_us_per_msg'] / p['cpu_us_per_msg']:.1f}x")
    for name, systems in summary["scenarios"].items():
        for r in systems.get("http", {}).get("runs", []):
            if name == "http-pull":
                print(f"http-pull run: {r['count']:,} acked in {r['seconds']:.1f} s, duplicates {r['duplicates']}, "
                      f"drained early: {r['drained']}")
            if name == "http-idle":
                print(f"http-idle run: {r.get('fds_held')} fds held by the gateway ({r.get('open_s', 0):.1f} s to "
                      f"open and go quiet), {r['samples']} /health, long polls answered early: {r.get('answered_early')}")
    for note in summary["notes"]:
        print(f"note: {note}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for hidden in ("--role", "--datadir", "--topic", "--sub"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    for hidden in ("--concurrency", "--batch", "--subs", "--prefill"):
        ap.add_argument(hidden, type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="1 s warm-up and 4 s measured per run")
    ap.add_argument("--seconds", type=float, help="measured seconds per run (default 10)")
    ap.add_argument("--warmup", type=float, help="warm-up seconds per run (default 2)")
    ap.add_argument("--runs", type=int, default=3, help="runs per scenario and system (default 3)")
    ap.add_argument("--only", action="append", choices=list(SCENARIOS), help="only this scenario")
    ap.add_argument("--profile", metavar="DIR", help="py-spy the gateway in each measured http window")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    a = ap.parse_args()
    if a.role:
        if os.environ.get("BENCH_SWITCH_INTERVAL"):  # an experiment, as in tools/bench: the GIL's hand-off
            sys.setswitchinterval(float(os.environ["BENCH_SWITCH_INTERVAL"]))
        {"gateway": role_gateway, "python": role_python}[a.role](a)
        return 0
    a.seconds = a.seconds or (4.0 if a.quick else 10.0)
    a.warmup = a.warmup if a.warmup is not None else (1.0 if a.quick else 2.0)
    if not os.access(NODE, os.X_OK):
        print(f"tools/bench_gateway needs Node 20 at {NODE} (or NODE=...): apt-get install nodejs", file=sys.stderr)
        return 2
    raise_fd_limit()  # the node client inherits it: 10,000 sockets
    log = (lambda *x: None) if a.json else (lambda *x: print(*x, file=sys.stderr, flush=True))
    names = a.only or list(SCENARIOS)
    tmp = Path(tempfile.mkdtemp(prefix="servicebus-gwbench-"))
    notes: list[str] = []
    if a.profile and py_spy() is None:
        notes.append("--profile: py-spy not found (pip install py-spy): not profiled")
    results: dict[str, dict[str, list[dict]]] = {n: {} for n in names}
    fsync_samples: list[float] = []
    ceilings: list[dict] = []
    try:
        for run in range(a.runs):
            fsync_samples.append(bench.fsync_latency(tmp, 300 if a.quick else 1000))
            if any(n.startswith("http-publish") for n in names):
                ceilings.append(client_ceiling(a))
                log(f"  run {run + 1}/{a.runs} client ceiling (null server) {ceilings[-1]['value']:>10,.0f} req/s  "
                    f"p50 {ceilings[-1]['p50_us'] / 1000:.2f} ms  client cpu/req "
                    f"{ceilings[-1]['client_cpu_us_per_req']:.0f} us")
            for name in names:
                systems = list(SCENARIOS[name].systems)
                if run % 2:
                    systems.reverse()  # neither side always goes first
                for system in systems:
                    run_dir = Path(tempfile.mkdtemp(dir=tmp))
                    try:
                        r = run_python(name, a, run_dir) if system == "python" else run_http(name, a, run_dir, run)
                    except Exception as exc:  # noqa: BLE001 - said in the notes
                        notes.append(f"{name}/{system} run {run + 1} failed: {type(exc).__name__}: {exc}")
                        continue
                    finally:
                        shutil.rmtree(run_dir, ignore_errors=True)
                    results[name].setdefault(system, []).append(r)
                    if r.get("errors"):
                        notes.append(f"{name}/{system} run {run + 1}: {r['errors']} failed requests, "
                                     f"first: {r.get('first_error')}")
                    log(f"  run {run + 1}/{a.runs} {name:<20} {system:<7} {r['value']:>10,.1f}"
                        f"{' ms p99' if name == 'http-idle' else ' msgs/s'}  p50 {r['p50_us'] / 1000:.2f} ms  "
                        f"p99 {r['p99_us'] / 1000:.2f} ms  cpu/msg {r.get('cpu_us_per_msg', 0):.0f} us"
                        + (f"  RSS {r['max_rss_mb']:.0f} MB" if "max_rss_mb" in r else ""))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    node_version = subprocess.run([NODE, "--version"], capture_output=True, text=True).stdout.strip()
    summary = {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "runs": a.runs, "quick": a.quick,
               "seconds": a.seconds, "warmup": a.warmup, "node": node_version,
               "fsync_us": statistics.median(fsync_samples) * 1e6,
               "ceiling": ({k: statistics.median(c[k] for c in ceilings)
                            for k in ("value", "p50_us", "client_cpu_us_per_req")} if ceilings else None),
               "scenarios": {n: {s: summarize(r) for s, r in sorted(rs.items(), reverse=True)}
                             for n, rs in results.items()}, "notes": notes}
    if a.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        print_table(summary)
        if a.profile:
            for path in sorted(Path(a.profile).glob("*.txt")):
                print(f"\npy-spy {path.name}: self % / inclusive % of the gateway's samples")
                for frame, own, total in top_frames(path, 15):
                    print(f"  {own:5.1f} {total:5.1f}  {frame[:150]}")
    failed = any(s["errors"] for rs in summary["scenarios"].values() for s in rs.values())
    return 1 if failed or any("failed" in n for n in notes) else 0


if __name__ == "__main__":
    sys.exit(main())
