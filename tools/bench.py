"""servicebus benchmarks, side by side with RabbitMQ, NATS JetStream and Redis Streams.

    tools/bench [--quick] [--runs N] [--only NAME ...] [--no-peers] [--json] [--curve] [--compression]
                [--baseline GITREF]

Every scenario runs against servicebus and (where it applies) each peer, alternating runs,
3 runs each by default; producer and consumer are separate processes; every run checks that
each message arrived exactly once. Printed: one table with the median and min-max per
(scenario, system), the ratio servicebus / best peer, each target, and the physical
references measured in the same run (fsync latency on the disk under the data directory,
raw pyzmq DEALER->ROUTER throughput and one-way latency). ``--baseline GITREF`` also runs
every servicebus scenario on that commit's code (``servicebus@GITREF``, its tree exported to a
temporary folder), alternating with the working tree's: before and after in one invocation.

Peers need: apt-get install rabbitmq-server nats-server redis-server, and
pip install -e '.[bench]'. A missing one is skipped with a note naming the install command.
Internal roles (``--role ...``) run one side of a scenario in a child process.
"""

from __future__ import annotations

import argparse
import decimal
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# BENCH_ROOT: the tree whose servicebus a child role imports (a --baseline's export).
sys.path.insert(0, os.environ.get("BENCH_ROOT") or str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_peers as peers  # noqa: E402
import bench_stages as stages  # noqa: E402

PAD = "x" * 240  # {"n": n, "pad": PAD} is 256 bytes msgpack-encoded
TOPIC = "bench.event"
PEERS = ("redis", "rabbit-classic", "rabbit-quorum", "nats-2.9", "nats-fsync")
# Peers whose durability is weaker than servicebus's are shown but not counted as "best".
WEAKER = {"nats-2.9"}


@dataclass(frozen=True)
class Scenario:
    description: str
    mode: str
    full: int
    quick: int
    peers: bool
    target: str


SCENARIOS = {
    "e2e-batch": Scenario("durable publish (100/batch) -> handler -> done, 1 -> 1 process",
                          "batch", 200_000, 40_000, True, ">= best peer, cpu/msg <= its"),
    "e2e-threads": Scenario("8 threads, one blocking durable publish each -> handler",
                            "threads", 40_000, 8_000, True, ">= best peer"),
    "publish-serial": Scenario("1 thread, one publish at a time (fsync each), subscriber away",
                               "serial", 5_000, 1_500, False, ">= 85 % of fsync ceiling"),
    "latency": Scenario("1 message in flight: publish -> handler start",
                        "latency", 1_000, 300, True, "p50 <= best peer and <= 1.4x floor, p99 <= 3x floor"),
    "latency-stages": Scenario("latency with a probe at each stage (bench_stages.py)",
                               "latency", 1_000, 300, False, "-"),
    "fanout": Scenario("1 publisher -> 10 subscriber processes (deliveries/s)",
                       "fanout", 20_000, 5_000, False, ">= 2x e2e-batch"),
    "backlog": Scenario("1M queued while the subscriber is down, then it starts (drain msgs/s)",
                        "backlog", 1_000_000, 100_000, False, "publisher RSS < 150 MB; drain >= 80 % of e2e-batch"),
    "restart": Scenario("a bus with 1M pending restarts: seconds to the first delivery",
                        "restart", 1_000_000, 100_000, False, "<= 2 s after Bus() returns"),
    "e2e-batch-nojournal": Scenario("e2e-batch with journal=False on both buses",
                                    "batch", 200_000, 40_000, False, "journal on within 10 % of off"),
    "e2e-batch-curve": Scenario("e2e-batch with CURVE keys on both buses (--curve)",
                                "batch", 200_000, 40_000, False, "cost of encryption"),
    "e2e-batch-zstd": Scenario("e2e-batch with wire_compression='zstd' (--compression)",
                               "batch", 200_000, 40_000, False, "cost of compression"),
    "e2e-batch-retained": Scenario("e2e-batch with the publisher retaining the topic (retention=3600)",
                                   "batch", 200_000, 40_000, False, "cost of retention"),
    "e2e-order-dict": Scenario("e2e-batch with an order (uuid, decimals, 3 lines) as a plain dict",
                                     "batch", 200_000, 40_000, False, "-"),
    "e2e-order-typed": Scenario("e2e-order-dict published as a msgspec Struct, handled by a typed handler",
                                "batch", 200_000, 40_000, False, "cost of typed payloads"),
    "e2e-ordered": Scenario("e2e-batch with subscribe(ordered=True): one frame in flight, handled in order",
                            "batch", 100_000, 20_000, False, "cost of strict order"),
    "latency-curve": Scenario("latency with CURVE keys on both buses (--curve)",
                              "latency", 1_000, 300, False, "cost of encryption"),
    "request-serial": Scenario("request -> handler -> reply, one at a time",
                               "req1", 2_000, 500, False, "-"),
    "request-100": Scenario("request_async with 100 in flight", "req100", 20_000, 5_000, False,
                            ">= 5,400/s (1.5x 0.1.0's 3,591)"),
}


def cpu_seconds(pid: int | None = None, tree: bool = False) -> float:
    """User + system CPU seconds of a process, every thread of it (LevelDB's and ZeroMQ's
    too), from /proc (through psutil); with ``tree``, of its descendants as well."""
    import psutil

    proc = psutil.Process(pid)
    total = 0.0
    for p in [proc, *(proc.children(recursive=True) if tree else [])]:
        try:
            t = p.cpu_times()
        except psutil.Error:  # ended meanwhile
            continue
        total += t.user + t.system
    return total


def payload(n: int) -> dict:
    return {"n": n, "pad": PAD}


def order_type() -> Any:
    """The order of e2e-order-typed/-dict: msgspec Structs (the ``typed`` extra), made
    at module level: their fields' types must resolve by name (postponed annotations)."""
    global BenchLine, BenchOrder
    import msgspec

    class BenchLine(msgspec.Struct):  # type: ignore[no-redef]
        sku: str
        qty: int
        price: decimal.Decimal

    class BenchOrder(msgspec.Struct):  # type: ignore[no-redef]
        n: int
        id: uuid.UUID
        lines: list[BenchLine]
        total: decimal.Decimal
        pad: str

    return BenchOrder, BenchLine


def order(n: int, typed: bool, types: Any) -> Any:
    import msgspec

    BenchOrder, BenchLine = types
    o = BenchOrder(n, uuid.UUID(int=n), [BenchLine("A-1", 2, decimal.Decimal("9.99"))] * 3,
                   decimal.Decimal("59.94"), PAD[:100])
    return o if typed else msgspec.to_builtins(o)


_CHILD_ROOT: dict[str, str] = {}  # env of the servicebus roles spawned now (see run_servicebus)


def spawn(*args: str, stdin: bool = False) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args], text=True,
                            stdout=subprocess.PIPE, stdin=subprocess.PIPE if stdin else None,
                            env={**os.environ, **_CHILD_ROOT})


def export_tree(ref: str, into: Path) -> Path:
    """The tree of git commit ``ref`` as files in ``into`` (for --baseline)."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", ref],
                             capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def read_json(proc: subprocess.Popen, timeout: float = 900) -> dict:
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout)
        raise RuntimeError(f"child {proc.args[2:5]} exited with {proc.returncode} and no result")
    return json.loads(line)


def finish(*procs: subprocess.Popen) -> None:
    for proc in procs:
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()


# --- child roles: servicebus -------------------------------------------------------------------


def role_sub(a: argparse.Namespace) -> None:
    from servicebus import Bus

    seen: set[int] = set()
    dupes, lat = 0, []
    lock, done = threading.Lock(), threading.Event()
    times = [0.0, 0.0]
    if a.stages:
        stages.install("sub")
    workers = int(os.environ.get("BENCH_WORKERS", "8"))  # an experiment knob; 8 is the default
    with Bus(a.bind, a.datadir, journal=not a.no_journal, keys=a.keys, workers=workers) as bus:
        def handler(p, message):
            nonlocal dupes
            if a.stages:
                stages.handler_started()
            now = time.time()
            if "t" in p:
                lat.append(time.time_ns() - p["t"])
            with lock:
                if p["n"] in seen:
                    dupes += 1
                seen.add(p["n"])
                times[0] = times[0] or now
                times[1] = now
                if len(seen) >= a.count:
                    done.set()

        if a.count and a.typed:
            BenchOrder = order_type()[0]

            def typed_handler(p, message):
                handler({"n": p.n}, message)
            typed_handler.__annotations__["p"] = BenchOrder  # a local class: no string to resolve
            bus.every(TOPIC, typed_handler)
        elif a.count:
            # Not when it only subscribes and goes away (publish-serial): messages that
            # reach it before it closes must wait in its store for the process that comes
            # back and counts them, not be handled and counted by nobody.
            bus.every(TOPIC, handler)
        if not a.subscribed:
            bus.subscribe(a.peer, TOPIC, wait=60, ordered=a.ordered)
        print(json.dumps({"ready": True}), flush=True)
        cpu = cpu_seconds()
        if a.count:
            done.wait(900)
            bus.drain(60)
        cpu = cpu_seconds() - cpu
        fsyncs = bus.counters().get("fsyncs", 0)
        print(json.dumps({"received": len(seen), "duplicates": dupes, "first": times[0], "last": times[1],
                          "fsyncs": fsyncs, "latency_ns": lat, "cpu": cpu, "stages": stages.events}), flush=True)
        if a.hold:
            # Open until the parent says the publisher has every ack: a bus closes its
            # sockets without linger, so acks still queued in them would be dropped and
            # the publisher's drain() would wait for a subscriber that is gone.
            sys.stdin.readline()


def role_pub(a: argparse.Namespace) -> None:
    from servicebus import Bus
    from servicebus.testing import wait_until

    if a.mode == "restart":
        with Bus(a.bind, a.datadir) as bus:
            opened = time.time()
            print(json.dumps({"start": opened, "end": opened, "fsyncs": 0}), flush=True)
            bus.drain(900)
        return
    if a.stages:
        stages.install("pub")
    extra = {"retention": a.retention} if a.retention else {}  # (a --baseline tree may not know it)
    with Bus(a.bind, a.datadir, journal=not a.no_journal, keys=a.keys,
             wire_compression="zstd" if a.zstd else None, **extra) as bus:
        wait_until(lambda: bus.status().subscriptions >= a.subscribers, 120, 0.01)
        before = bus.counters().get("fsyncs", 0)
        cpu = cpu_seconds()
        start = time.time()
        if a.mode == "batch" and (a.order or a.typed):
            types = order_type()
            for base in range(0, a.count, 100):
                bus.publish_many(TOPIC, [order(n, a.typed, types) for n in range(base, min(a.count, base + 100))])
        elif a.mode in ("batch", "fanout", "backlog"):
            for base in range(0, a.count, 100):
                bus.publish_many(TOPIC, [payload(n) for n in range(base, min(a.count, base + 100))])
        elif a.mode == "restart-fill":
            for base in range(0, a.count, 1000):
                bus.publish_many(TOPIC, [payload(n) for n in range(base, min(a.count, base + 1000))])
        elif a.mode == "serial":
            for n in range(a.count):
                bus.publish(TOPIC, payload(n))
        elif a.mode == "latency":
            for n in range(a.count):
                bus.publish(TOPIC, {"n": n, "t": time.time_ns(), "pad": PAD[:200]})
                time.sleep(0.004)  # one in flight: far longer than a delivery takes
        else:
            def worker(k: int) -> None:
                for n in range(k, a.count, 8):
                    bus.publish(TOPIC, payload(n))
            threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        end = time.time()
        fsyncs = bus.counters().get("fsyncs", 0) - before
        print(json.dumps({"start": start, "end": end, "fsyncs": fsyncs,
                          "cpu": cpu_seconds() - cpu, "stages": stages.events}), flush=True)
        if a.mode != "restart-fill":
            bus.drain(900)  # stay until every subscriber (the returning one, too) has it all
            # ... and what that cost, sends and acks included (a second line)
            print(json.dumps({"cpu": cpu_seconds() - cpu}), flush=True)


def role_server(a: argparse.Namespace) -> None:
    from servicebus import Bus

    with Bus(a.bind, a.datadir) as bus:
        bus.handle("bench.quote", lambda p, m: {"n": p["n"], "price": 10})
        print(json.dumps({"ready": True}), flush=True)
        cpu = cpu_seconds()
        sys.stdin.readline()  # the parent closes stdin when the run is over
        cpu = cpu_seconds() - cpu
        fsyncs = bus.counters().get("fsyncs", 0)
    print(json.dumps({"fsyncs": fsyncs, "cpu": cpu}), flush=True)


def role_client(a: argparse.Namespace) -> None:
    from collections import deque

    from servicebus import Bus

    in_flight = 1 if a.mode == "req1" else 100
    with Bus(a.bind, a.datadir) as bus:
        bus.request(a.peer, "bench.quote", {"n": -1}, timeout=60)  # warm up
        before = bus.counters().get("fsyncs", 0)
        cpu = cpu_seconds()
        start, wrong, pending = time.time(), 0, deque()
        for n in range(a.count):
            if len(pending) >= in_flight:
                k, fut = pending.popleft()
                wrong += fut.result(60)["n"] != k
            pending.append((n, bus.request_async(a.peer, "bench.quote", payload(n), 60)))
        while pending:
            k, fut = pending.popleft()
            wrong += fut.result(60)["n"] != k
        end = time.time()
        cpu = cpu_seconds() - cpu
        fsyncs = bus.counters().get("fsyncs", 0) - before
    print(json.dumps({"start": start, "end": end, "fsyncs": fsyncs, "wrong": wrong, "cpu": cpu}), flush=True)


# --- child roles: physical references and peers -------------------------------------------------


def role_zmq_sink(a: argparse.Namespace) -> None:
    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVHWM, 0)
    router.bind(a.bind)
    print(json.dumps({"ready": True}), flush=True)
    first = None
    for i in range(a.count):
        frames = router.recv_multipart()
        if a.mode == "echo":
            router.send_multipart(frames)
        elif first is None:
            first = time.time()
    print(json.dumps({"first": first, "last": time.time()}), flush=True)
    router.close(linger=0)
    ctx.term()


def role_peer(a: argparse.Namespace) -> None:
    import importlib

    # The client library is imported before the clock starts, as servicebus's roles do.
    importlib.import_module("redis" if a.peer == "redis" else "nats" if a.peer.startswith("nats") else "pika")
    cpu = cpu_seconds()
    if a.role == "peer-produce":
        out = peers.produce(a.peer, a.port, a.name, a.mode, a.count)
    else:
        print(json.dumps({"ready": True}), flush=True)
        cpu = cpu_seconds()
        out = peers.consume(a.peer, a.port, a.name, a.count, a.mode)
    print(json.dumps({**out, "cpu": cpu_seconds() - cpu}), flush=True)


# --- one run of one scenario on one system ------------------------------------------------------


def result(count: int, start: float, last: float, consumer: dict, fsyncs: int | None = None,
           cpu: float | None = None, per: int | None = None) -> dict:
    """One run's figures. ``cpu``: user + system seconds of every process of the run over
    its measured part, divided by ``per`` (default ``count``) messages."""
    lat = sorted(consumer.get("latency_ns") or [])
    out = {"value": count / max(1e-9, last - start), "received": consumer["received"],
           "duplicates": consumer["duplicates"],
           "exactly_once": consumer["received"] == count and consumer["duplicates"] == 0}
    if fsyncs is not None:
        out["fsyncs_per_msg"] = fsyncs / count
    if cpu is not None:
        out["cpu_us_per_msg"] = cpu / (per or count) * 1e6
    if lat:
        out["p50_us"] = lat[len(lat) // 2] / 1000
        out["p99_us"] = lat[min(len(lat) - 1, int(len(lat) * 0.99))] / 1000
        out["value"] = out["p50_us"]
    return out


def run_servicebus(name: str, count: int, tmp: Path, root: Path | None = None) -> dict:
    """One run of scenario ``name``; with ``root``, on the servicebus of that tree."""
    if root is None:
        _CHILD_ROOT.clear()
    else:
        _CHILD_ROOT["BENCH_ROOT"] = str(root)
    try:
        return _run_servicebus(name, count, tmp)
    finally:
        _CHILD_ROOT.clear()


def _run_servicebus(name: str, count: int, tmp: Path) -> dict:
    from servicebus.testing import free_address

    sc = SCENARIOS[name]
    run_dir = Path(tempfile.mkdtemp(dir=tmp))
    flags = ["--no-journal"] if name.endswith("nojournal") else []
    if name == "latency-stages":
        flags.append("--stages")  # both roles take the flag
    if sc.mode.startswith("req"):
        server_addr, client_addr = free_address(), free_address()
        server = spawn("--role", "server", "--bind", server_addr, "--datadir", str(run_dir / "s"), stdin=True)
        read_json(server)
        client = spawn("--role", "client", "--bind", client_addr, "--peer", server_addr, "--mode", sc.mode,
                       "--count", str(count), "--datadir", str(run_dir / "c"))
        c = read_json(client)
        server.stdin.close()
        s = read_json(server)
        finish(client, server)
        return result(count, c["start"], c["end"], {"received": count - c["wrong"], "duplicates": 0},
                      c["fsyncs"] + s["fsyncs"], cpu=c["cpu"] + s["cpu"])
    pub_addr = free_address()
    n_subs = 10 if sc.mode == "fanout" else 1
    subs_addrs = [free_address() for _ in range(n_subs)]
    pub_flags = list(flags)
    sub_flags = [list(flags) for _ in range(n_subs)]
    if name.endswith("-zstd"):
        pub_flags.append("--zstd")
    if name == "e2e-ordered":
        for f in sub_flags:
            f.append("--ordered")
    if name == "e2e-batch-retained":
        pub_flags += ["--retention", "3600"]
    if name in ("e2e-order-typed", "e2e-order-dict"):
        flag = "--typed" if name.endswith("typed") else "--order"
        pub_flags.append(flag)
        for f in sub_flags:
            f.append(flag)
    if name.endswith("-curve"):
        pub_keys, sub_keys = curve_keys(run_dir, pub_addr, subs_addrs)
        pub_flags += ["--keys", pub_keys]
        for i in range(n_subs):
            sub_flags[i] += ["--keys", sub_keys[i]]
    sub_args = lambda i, c: ["--role", "sub", "--bind", subs_addrs[i], "--peer", pub_addr,  # noqa: E731
                             "--datadir", str(run_dir / f"sub{i}"), "--count", str(c), *sub_flags[i]]
    if sc.mode == "serial":
        away = spawn(*sub_args(0, 0))  # subscribes, then goes away: publishes queue on disk
        pub = spawn("--role", "pub", "--bind", pub_addr, "--mode", "serial", "--count", str(count),
                    "--datadir", str(run_dir / "pub"), "--subscribers", "1", *flags)
        read_json(away)
        read_json(away)
        finish(away)
        p = read_json(pub)
        sub = spawn(*sub_args(0, count))  # comes back and drains, to check exactly once
        read_json(sub)
        s = read_json(sub)
        finish(pub, sub)
        return result(count, p["start"], p["end"], s, p["fsyncs"], cpu=p["cpu"])  # publishing only
    if sc.mode in ("backlog", "restart"):
        return run_backlog(sc.mode, count, run_dir, pub_addr, sub_args)
    subs = [spawn(*sub_args(i, count), "--hold", stdin=True) for i in range(n_subs)]
    pub = spawn("--role", "pub", "--bind", pub_addr, "--mode", sc.mode, "--count", str(count),
                "--datadir", str(run_dir / "pub"), "--subscribers", str(n_subs), *pub_flags)
    for sub in subs:
        read_json(sub)
    p = read_json(pub)
    results = [read_json(sub) for sub in subs]
    cpu = read_json(pub)["cpu"] + sum(r["cpu"] for r in results)  # every process of the run
    for sub in subs:
        sub.stdin.close()
    finish(pub, *subs)
    if sc.mode == "fanout":
        last = max(r["last"] for r in results)
        merged = {"received": sum(r["received"] for r in results) // n_subs,
                  "duplicates": sum(r["duplicates"] for r in results)}
        out = result(count, p["start"], last, merged, cpu=cpu, per=count * n_subs)  # per delivery
        out["value"] *= n_subs  # deliveries per second
        out["exactly_once"] = all(r["received"] == count and not r["duplicates"] for r in results)
        return out
    s = results[0]
    out = result(count, p["start"], s["last"], s, p["fsyncs"] + s["fsyncs"], cpu=cpu)
    if name == "latency-stages":
        out["stages"] = stages.breakdown(p["stages"], s["stages"])
    return out


def curve_keys(run_dir: Path, pub_addr: str, subs_addrs: list[str]) -> tuple[str, list[str]]:
    """Key directories for a publisher and its subscribers, each trusting the other side."""
    import zmq.auth
    try:
        from servicebus.ops.keys import keygen
    except ImportError:  # a --baseline tree of the layout before issue 27
        from servicebus.keys import keygen  # type: ignore[no-redef]

    def make(name: str) -> tuple[Path, str]:
        public, _secret = keygen(run_dir / "keys" / name)
        return public.parent, zmq.auth.load_certificate(public)[0].decode()

    pub_dir, pub_key = make("pub")
    subs = [make(f"sub{i}") for i in range(len(subs_addrs))]
    (pub_dir / "peers.toml").write_text("".join(
        f'[[peer]]\naddress = "{addr}"\nkeys = ["{key}"]\n' for addr, (_d, key) in zip(subs_addrs, subs)))
    for sub_dir, _key in subs:
        (sub_dir / "peers.toml").write_text(f'[[peer]]\naddress = "{pub_addr}"\nkeys = ["{pub_key}"]\n')
    return str(pub_dir), [str(d) for d, _k in subs]


def run_backlog(mode: str, count: int, run_dir: Path, pub_addr: str, sub_args) -> dict:
    """The subscriber subscribes and goes away; ``count`` messages queue on the publisher's
    disk (its RSS sampled all along). backlog: the subscriber returns and drains it.
    restart: the publisher stops, the subscriber returns, the publisher restarts; the time
    from its ``Bus()`` returning to the first delivery is measured."""
    import psutil

    away = spawn(*sub_args(0, 0))
    fill = "backlog" if mode == "backlog" else "restart-fill"
    pub = spawn("--role", "pub", "--bind", pub_addr, "--mode", fill, "--count", str(count),
                "--datadir", str(run_dir / "pub"), "--subscribers", "1")
    read_json(away)
    read_json(away)
    finish(away)
    rss, stop = [0], threading.Event()

    def sample() -> None:
        proc = psutil.Process(pub.pid)
        while not stop.is_set():
            try:
                rss[0] = max(rss[0], proc.memory_info().rss)
            except psutil.Error:
                return
            stop.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    p = read_json(pub)
    if mode == "restart":
        stop.set()
        finish(pub)  # restart-fill closes the bus once everything is queued
        sub = spawn(*sub_args(0, count), "--subscribed")
        read_json(sub)
        pub = spawn("--role", "pub", "--bind", pub_addr, "--mode", "restart", "--count", "0",
                    "--datadir", str(run_dir / "pub"))
        p = read_json(pub)
        s = read_json(sub)
        finish(pub, sub)
        out = result(count, 0, 1, s)
        out["value"] = s["first"] - p["start"]  # seconds to the first delivery
        return out
    sub = spawn(*sub_args(0, count))
    read_json(sub)
    drain_start = time.time()
    s = read_json(sub)
    stop.set()
    finish(pub, sub)
    out = result(count, drain_start, s["last"], s)
    out["max_rss_mb"] = rss[0] / 2**20
    return out


def run_peer(peer: str, server: "peers.Server", name: str, count: int) -> dict:
    mode = SCENARIOS[name].mode
    qname = "b" + uuid.uuid4().hex[:12]
    peers.prepare(peer, server.port, qname)
    common = ["--peer", peer, "--port", str(server.port), "--name", qname, "--mode", mode,
              "--count", str(count)]
    consumer = spawn("--role", "peer-consume", *common)
    read_json(consumer)
    server_cpu = cpu_seconds(server.proc.pid, tree=True) if server.proc else 0.0
    producer = spawn("--role", "peer-produce", *common)
    p = read_json(producer)
    c = read_json(consumer)
    if server.proc:  # the broker's whole process tree (RabbitMQ runs several)
        server_cpu = cpu_seconds(server.proc.pid, tree=True) - server_cpu
    finish(producer, consumer)
    return result(count, p["start"], c["last"], c, cpu=server_cpu + p["cpu"] + c["cpu"])


# --- physical references -------------------------------------------------------------------------


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


def zmq_reference(count: int) -> dict:
    """Raw pyzmq DEALER -> ROUTER between two processes: one-way msgs/s and latency."""
    import zmq

    from servicebus.testing import free_address

    out = {}
    ctx = zmq.Context()
    for mode in ("sink", "echo"):
        address = free_address()
        n = count if mode == "sink" else 2000
        child = spawn("--role", "zmq", "--bind", address, "--count", str(n), "--mode", mode)
        read_json(child)
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.SNDHWM, 0)
        dealer.connect(address)
        body = b"x" * 256
        if mode == "sink":
            start = time.time()
            for _ in range(n):
                dealer.send(body)
            r = read_json(child)
            out["zmq_msgs_per_s"] = n / (r["last"] - start)
        else:
            rtts = []
            for _ in range(n):
                t = time.perf_counter()
                dealer.send(body)
                dealer.recv()
                rtts.append(time.perf_counter() - t)
            read_json(child)
            out["zmq_one_way_us"] = statistics.median(rtts) / 2 * 1e6
        dealer.close(linger=0)
        finish(child)
    ctx.term()
    return out


# --- the table -------------------------------------------------------------------------------------


def summarize(name: str, runs: list[dict]) -> dict:
    values = [r["value"] for r in runs]
    out = {"median": statistics.median(values), "min": min(values), "max": max(values),
           "exactly_once": all(r["exactly_once"] for r in runs), "runs": runs}
    for key in ("p99_us", "fsyncs_per_msg", "max_rss_mb", "cpu_us_per_msg"):
        if all(key in r for r in runs):
            out[key] = statistics.median(r[key] for r in runs)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for hidden in ("--role", "--bind", "--peer", "--datadir", "--mode", "--name"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--subscribers", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--no-journal", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--subscribed", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stages", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--keys", help=argparse.SUPPRESS)
    ap.add_argument("--zstd", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ordered", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--retention", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--order", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--typed", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--compression", action="store_true",
                    help="also run e2e-batch with wire_compression='zstd' on the publisher")
    ap.add_argument("--curve", action="store_true",
                    help="also run e2e-batch and latency with CURVE keys on both buses")
    ap.add_argument("--quick", action="store_true", help="fewer messages per run")
    ap.add_argument("--runs", type=int, default=3, help="runs per scenario and system (default 3)")
    ap.add_argument("--only", action="append", choices=list(SCENARIOS), help="only this scenario")
    ap.add_argument("--no-peers", action="store_true", help="servicebus only")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--baseline", metavar="GITREF",
                    help="also run servicebus at this commit, alternating: before and after side by side")
    ap.add_argument("--switch-interval", type=float, metavar="S",
                    help="sys.setswitchinterval(S) in every servicebus process (default: Python's 0.005)")
    a = ap.parse_args()
    roles = {"sub": role_sub, "pub": role_pub, "server": role_server, "client": role_client,
             "zmq": role_zmq_sink, "peer-produce": role_peer, "peer-consume": role_peer}
    if a.role:
        if os.environ.get("BENCH_SWITCH_INTERVAL"):  # an experiment: the GIL's hand-off period
            sys.setswitchinterval(float(os.environ["BENCH_SWITCH_INTERVAL"]))
        roles[a.role](a)
        return 0

    if a.switch_interval:
        os.environ["BENCH_SWITCH_INTERVAL"] = str(a.switch_interval)  # the children inherit it
    log = (lambda *x: None) if a.json else (lambda *x: print(*x, file=sys.stderr, flush=True))
    names = a.only or [n for n in SCENARIOS if (a.curve or not n.endswith("-curve"))
                       and (a.compression or not n.endswith("-zstd"))]
    tmp = Path(tempfile.mkdtemp(prefix="servicebus-bench-"))
    notes: list[str] = []
    servers: dict[str, peers.Server] = {}
    wanted_peers = [] if a.no_peers or not any(SCENARIOS[n].peers for n in names) else list(PEERS)
    for peer in wanted_peers:
        why = peers.missing(peer)
        if why:
            notes.append(f"skipped {peer}: not installed ({why})")
            continue
        try:
            servers[peer] = peers.Server(peer, tmp).start()
            log(f"started {peer} {servers[peer].version} on port {servers[peer].port}")
        except Exception as exc:  # noqa: BLE001 - a peer that will not start is skipped, said so
            notes.append(f"skipped {peer}: server did not start ({exc})")
    results: dict[str, dict[str, list[dict]]] = {n: {} for n in names}
    baseline = f"servicebus@{a.baseline}" if a.baseline else None
    baseline_root = export_tree(a.baseline, tmp / "baseline") if a.baseline else None
    fsync_samples: list[float] = []
    zmq_refs: list[dict] = []
    try:
        for run in range(a.runs):
            fsync_samples.append(fsync_latency(tmp, 300 if a.quick else 1000))
            zmq_refs.append(zmq_reference(20_000 if a.quick else 100_000))
            for name in names:
                sc = SCENARIOS[name]
                count = sc.quick if a.quick else sc.full
                systems = (["servicebus"] + ([baseline] if baseline else [])
                           + ([p for p in servers] if sc.peers else []))
                if run % 2 and baseline:  # neither side always goes first
                    systems[0], systems[1] = systems[1], systems[0]
                for system in systems:  # alternating: every system once per run
                    try:
                        r = (run_servicebus(name, count, tmp) if system == "servicebus" else
                             run_servicebus(name, count, tmp, baseline_root) if system == baseline
                             else run_peer(system, servers[system], name, count))
                    except Exception as exc:  # noqa: BLE001
                        notes.append(f"{name}/{system} run {run + 1} failed: {exc}")
                        continue
                    results[name].setdefault(system, []).append(r)
                    log(f"  run {run + 1}/{a.runs} {name:<20} {system:<24} {r['value']:>12,.0f}"
                        f"{' us p50' if 'p50_us' in r else ' msgs/s'}  exactly once: {r['exactly_once']}")
    finally:
        for server in servers.values():
            server.stop()
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)

    fsync_s = statistics.median(fsync_samples)
    zmq_tp = statistics.median(z["zmq_msgs_per_s"] for z in zmq_refs)
    zmq_lat = statistics.median(z["zmq_one_way_us"] for z in zmq_refs)
    floor_us = 2 * fsync_s * 1e6 + zmq_lat
    table = {n: {s: summarize(n, r) for s, r in systems.items()} for n, systems in results.items()}
    summary = {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "quick": a.quick, "runs": a.runs,
               "baseline": baseline,
               "fsync_us": fsync_s * 1e6, "fsync_ceiling_per_s": 1 / fsync_s, "zmq_msgs_per_s": zmq_tp,
               "zmq_one_way_us": zmq_lat, "latency_floor_us": floor_us,
               "peers": {p: {"version": s.version, "durability": peers.NOTES[p]} for p, s in servers.items()},
               "scenarios": table, "notes": notes}
    if a.json:
        print(json.dumps(summary, indent=2, default=str))
        return 0
    print_table(summary)
    return 0 if all(s["exactly_once"] for sys_ in table.values() for s in sys_.values()) else 1


def print_table(summary: dict) -> None:
    t = summary["scenarios"]
    print(f"\nservicebus bench {summary['date']}: {summary['cores']} cores, 256-byte payloads, loopback; "
          f"{summary['runs']} run(s) each, alternating; median (min-max)")
    print(f"physical: fsync {summary['fsync_us']:.0f} us (ceiling {summary['fsync_ceiling_per_s']:,.0f}/s); "
          f"raw pyzmq DEALER->ROUTER {summary['zmq_msgs_per_s']:,.0f} msgs/s, {summary['zmq_one_way_us']:.0f} us "
          f"one way; latency floor (2 fsyncs + 1 hop) {summary['latency_floor_us']:.0f} us")
    print("servicebus fsyncs every message twice (publisher before publish returns, subscriber before "
          "it acks): stronger than any peer. Python clients are pure Python; all processes share 2 cores.\n")
    print("vs best peer: servicebus / best peer at the same or stronger durability (> 1: servicebus "
          "better; nats-2.9, which acks before fsync, is shown but not counted)")
    print("cpu/msg: user + system CPU us per message of every process of the run (publisher and "
          "subscriber with all their threads; for a peer, its server and both clients), from /proc")
    print(f"{'scenario':<20}{'system':<24}{'median (min-max)':>30}  {'p99/fsync':>10}  {'cpu/msg':>8}  once  "
          "vs best peer  target")
    for name, systems in t.items():
        sc = SCENARIOS[name]
        unit = {"latency": "us", "restart": "s"}.get(sc.mode, "/s")
        best = [(s, v["median"]) for s, v in systems.items()
                if not s.startswith("servicebus") and s not in WEAKER]
        ours = systems.get("servicebus")
        for system, v in systems.items():
            extra = (f"{v['p99_us']:.0f}us" if "p99_us" in v else
                     f"{v['max_rss_mb']:.0f}MB" if "max_rss_mb" in v else
                     f"{v['fsyncs_per_msg']:.3f}" if "fsyncs_per_msg" in v else "-")
            ratio = ""
            if system == "servicebus" and best and ours:
                # > 1 means servicebus is better (more msgs/s, or a lower latency).
                if sc.mode == "latency":
                    peer, val = min(best, key=lambda x: x[1])
                    ratio = f"{val / ours['median']:.2f}x {peer}"
                else:
                    peer, val = max(best, key=lambda x: x[1])
                    ratio = f"{ours['median'] / val:.2f}x {peer}"
            target = sc.target if system == "servicebus" else ""
            if system == "servicebus" and name == "publish-serial":
                target += f" ({ours['median'] * summary['fsync_us'] / 1e6:.0%})"
            if system == "servicebus" and name == "latency":
                target += (f" ({ours['median'] / summary['latency_floor_us']:.2f}x / "
                           f"{ours['p99_us'] / summary['latency_floor_us']:.2f}x)")
            fmt = "{:,.2f}" if sc.mode == "restart" else "{:,.0f}"
            med, lo, hi = (fmt.format(x) for x in (v["median"], v["min"], v["max"]))
            cpu = f"{v['cpu_us_per_msg']:.1f}us" if "cpu_us_per_msg" in v else "-"
            print(f"{name:<20}{system:<24}{med:>14} ({lo}-{hi}) {unit:<3}"
                  f"{extra:>10}  {cpu:>8}  {'yes' if v['exactly_once'] else 'NO':<4}  {ratio:<13} {target}")
    base = summary.get("baseline")
    if base:
        print(f"\nservicebus (this tree) vs {base}, same runs, alternating (> 1: this tree better):")
        for name, systems in t.items():
            now, before = systems.get("servicebus"), systems.get(base)
            if not now or not before:
                continue
            lower = SCENARIOS[name].mode in ("latency", "restart")  # smaller is better
            ratio = before["median"] / now["median"] if lower else now["median"] / before["median"]
            cpu = (f", cpu/msg {now['cpu_us_per_msg']:.1f} vs {before['cpu_us_per_msg']:.1f} us"
                   if "cpu_us_per_msg" in now and "cpu_us_per_msg" in before else "")
            p99 = (f", p99 {now['p99_us']:,.0f} vs {before['p99_us']:,.0f} us"
                   if "p99_us" in now and "p99_us" in before else "")
            print(f"  {name:<22}{now['median']:>12,.0f} vs {before['median']:>12,.0f}  {ratio:.3f}x{p99}{cpu}")
    if "fanout" in t and "e2e-batch" in t and "servicebus" in t["fanout"] and "servicebus" in t["e2e-batch"]:
        print(f"\nfanout / e2e-batch: {t['fanout']['servicebus']['median'] / t['e2e-batch']['servicebus']['median']:.2f}x")
    stage_runs = [r["stages"] for r in t.get("latency-stages", {}).get("servicebus", {}).get("runs", [])]
    if stage_runs:
        print(f"\nservicebus latency by stage (median us per message, median over {len(stage_runs)} run(s); "
              "probes add ~1 us each):")
        for label in stage_runs[0]:
            if label != "messages":
                print(f"  {label:<42}{statistics.median(r[label] for r in stage_runs):>8.0f}")
    if "e2e-batch" in t and "e2e-batch-nojournal" in t:
        on, off = t["e2e-batch"]["servicebus"]["median"], t["e2e-batch-nojournal"]["servicebus"]["median"]
        print(f"journal cost: e2e-batch with the journal runs at {on / off:.1%} of journal=False")
    if "servicebus" in t.get("e2e-batch", {}) and "servicebus" in t.get("e2e-ordered", {}):
        o, p = t["e2e-ordered"]["servicebus"]["median"], t["e2e-batch"]["servicebus"]["median"]
        print(f"order: an ordered subscription runs at {o / p:.0%} of e2e-batch")
    if "servicebus" in t.get("e2e-batch", {}) and "servicebus" in t.get("e2e-batch-retained", {}):
        p, r = t["e2e-batch"]["servicebus"], t["e2e-batch-retained"]["servicebus"]
        print(f"retention: e2e-batch with the topic retained runs at {r['median'] / p['median']:.0%} of plain"
              + (f", cpu/msg {r['cpu_us_per_msg'] - p['cpu_us_per_msg']:+.1f} us"
                 if "cpu_us_per_msg" in r and "cpu_us_per_msg" in p else ""))
    if "servicebus" in t.get("e2e-order-dict", {}) and "servicebus" in t.get("e2e-order-typed", {}):
        p, r = t["e2e-order-dict"]["servicebus"], t["e2e-order-typed"]["servicebus"]
        print(f"typed payloads: the order as a Struct to a typed handler runs at {r['median'] / p['median']:.0%} "
              "of the same order as a dict" + (f", cpu/msg {r['cpu_us_per_msg'] - p['cpu_us_per_msg']:+.1f} us"
                                               if "cpu_us_per_msg" in r and "cpu_us_per_msg" in p else ""))
    if "servicebus" in t.get("e2e-batch", {}) and "servicebus" in t.get("e2e-batch-zstd", {}):
        p, c = t["e2e-batch"]["servicebus"], t["e2e-batch-zstd"]["servicebus"]
        print(f"compression: e2e-batch with zstd frames runs at {c['median'] / p['median']:.0%} of plain"
              + (f", cpu/msg {c['cpu_us_per_msg'] - p['cpu_us_per_msg']:+.1f} us"
                 if "cpu_us_per_msg" in c and "cpu_us_per_msg" in p else ""))
    for plain, curve in (("e2e-batch", "e2e-batch-curve"), ("latency", "latency-curve")):
        if "servicebus" in t.get(plain, {}) and "servicebus" in t.get(curve, {}):
            p, c = t[plain]["servicebus"], t[curve]["servicebus"]
            if plain == "latency":
                print(f"CURVE cost: latency p50 {c['median'] - p['median']:+,.0f} us "
                      f"({c['median'] / p['median']:.0%} of plain)")
            else:
                print(f"CURVE cost: e2e-batch with keys runs at {c['median'] / p['median']:.0%} of plain"
                      + (f", cpu/msg {c['cpu_us_per_msg'] - p['cpu_us_per_msg']:+.1f} us"
                         if "cpu_us_per_msg" in c and "cpu_us_per_msg" in p else ""))
    for peer, info in summary["peers"].items():
        print(f"{peer}: {info['version']}; {info['durability']}")
    for note in summary["notes"]:
        print(f"note: {note}")


if __name__ == "__main__":
    sys.exit(main())
