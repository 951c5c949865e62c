"""Jepsen-style moves with real processes (a hostile review, helper-34): a subscriber killed
and restarted at a new port, killed again within 0.15 s and restarted at a third, four
times, while a publisher publishes. Every acknowledged event (publish returned) must be
handled at the end. Slow (~20 s); loopback only; every process is killed at the end."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from servicebus.testing import free_address, wait_until

pytestmark = pytest.mark.slow

_JCHILD = r'''
import json, os, sys, time
from servicebus import Bus
role, bind, datadir, cfgs, out, ready = sys.argv[1:7]
cfg = json.loads(cfgs)
opts = {"gossip_interval": 0.2, "down_after": 1.0, "name": cfg["name"]}
if cfg.get("seeds"):
    opts["seeds"] = cfg["seeds"]
bus = Bus(bind, datadir, **opts)
pid = os.getpid()
def rec(line):
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, (line + "\n").encode()); os.close(fd)
if role == "sub":
    bus.every("order.placed")(lambda p, m: rec(f"{p['id']} {pid}"))
    bus.subscribe("orders", "order.placed", wait=30 if cfg.get("first") else None)
open(ready, "w").write("ok")
i = 0
while True:
    if role == "pub" and os.path.exists(cfg["go"]) and not os.path.exists(cfg["stop"]):
        ident = f"{pid}-{i}"
        bus.publish("order.placed", {"id": ident})
        rec(ident)  # acknowledged: publish returned
        i += 1
        time.sleep(0.004)
    else:
        time.sleep(0.02)
'''


def test_a_subscriber_that_moves_twice_in_quick_succession_four_times_gets_every_acknowledged_event(tmp_path):
    """The first subscriber process may be killed within a fraction of a second of its
    first contact with the publisher: its proof must be there by then (a pong names the
    publisher's node id and the proof goes at once), or the publisher refuses every later
    move and keeps the backlog at the first address for good (984 of 1,148 lost under
    load before)."""
    script = tmp_path / "child.py"
    script.write_text(_JCHILD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    procs: list[subprocess.Popen] = []
    seed = int(os.environ.get("MOVES_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    started = [0]

    def start(role: str, datadir, cfg: dict, out) -> subprocess.Popen:
        started[0] += 1
        ready = tmp_path / f"ready{started[0]}"
        proc = subprocess.Popen([sys.executable, str(script), role, cfg.pop("bind", None) or free_address(),
                                 str(datadir), json.dumps(cfg), str(out), str(ready)], env=env)
        procs.append(proc)
        wait_until(lambda: ready.exists() or proc.poll() is not None, timeout=40)
        assert proc.poll() is None, f"{role} died at start (seed {seed})"
        return proc

    def kill(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)

    try:
        acked, handled = tmp_path / "acked", tmp_path / "handled"
        pub_address = free_address()
        start("pub", tmp_path / "orders", {"name": "orders", "bind": pub_address, "go": str(tmp_path / "go"),
                                                 "stop": str(tmp_path / "stop")}, acked)
        sub_cfg = {"name": "email", "seeds": [pub_address]}
        sub = start("sub", tmp_path / "email", {**sub_cfg, "first": True}, handled)
        (tmp_path / "go").write_text("go")

        def count() -> int:
            return len(handled.read_text().split()) // 2 if handled.exists() else 0

        for _ in range(4):
            more = count() + rng.randrange(5, 100)  # soon after the first contact too
            wait_until(lambda: count() > more, timeout=30)
            kill(sub)
            sub = start("sub", tmp_path / "email", dict(sub_cfg), handled)
            time.sleep(rng.uniform(0.0, 0.15))  # the kill's random instant (a fault, not a wait)
            kill(sub)
            sub = start("sub", tmp_path / "email", dict(sub_cfg), handled)
        (tmp_path / "stop").write_text("stop")
        ids = set(acked.read_text().split())
        got = lambda: {line.split()[0] for line in handled.read_text().splitlines() if line.strip()}  # noqa: E731
        wait_until(lambda: ids <= got(), timeout=30,
                   message=lambda: f"seed {seed}: {len(ids - got())} of {len(ids)} acknowledged never handled")
    finally:
        for proc in procs:
            kill(proc)
