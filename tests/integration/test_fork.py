"""A Bus used after ``fork()`` (issue 26): every call in the child raises at once and
touches nothing; the parent's bus goes on intact (DESIGN.md rule 13)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from servicebus import Bus
from servicebus.testing import free_address

from ..conftest import stop_group

ROOT = Path(__file__).resolve().parents[2]

# The parent publishes from several threads while it forks; the child tries every kind of
# call, closes, and exits through normal interpreter shutdown (destructors run); the parent
# publishes more and reports what it was acknowledged.
SCRIPT = r'''
import json, os, sys, threading, time
from servicebus import Bus, BusError

pub_addr, sub_addr, pub_dir, sub_dir, report = sys.argv[1:6]
sub = Bus(sub_addr, sub_dir)
got = set()
lock = threading.Lock()

@sub.every("t")
def handled(payload, message):
    with lock:
        got.add(payload)

pub = Bus(pub_addr, pub_dir)
sub.subscribe(pub.address, "t", wait=10)
acked = []
stop = threading.Event()

def publisher(base):
    n = base
    while not stop.is_set():
        pub.publish("t", n)
        acked.append(n)
        n += 1

threads = [threading.Thread(target=publisher, args=(k * 10_000_000,)) for k in range(3)]
for t in threads:
    t.start()
time.sleep(0.2)
child = os.fork()
if child == 0:
    results = {}
    calls = {
        "publish": lambda: pub.publish("t", -1),
        "publish_many": lambda: pub.publish_many("t", list(range(-1000, 0))),
        "send": lambda: pub.send(sub_addr, "cmd", 1),
        "kv_put": lambda: pub.kv.__setitem__("k", 1),
        "kv_get": lambda: pub.kv.get("k"),
        "status": lambda: pub.status(),
        "subscribe": lambda: pub.subscribe(sub_addr, "u"),
        "every": lambda: pub.every("u", lambda p, m: None),
        "drain": lambda: pub.drain(1),
        "deadletters": lambda: pub.deadletters(),
    }
    for name, call in calls.items():
        began = time.monotonic()
        try:
            call()
            results[name] = "returned"
        except BusError as exc:
            results[name] = f"{type(exc).__name__}: {exc}" if time.monotonic() - began < 1 else "slow"
        except Exception as exc:
            results[name] = f"other {type(exc).__name__}: {exc}"
    began = time.monotonic()
    pub.close()
    sub.close()
    results["close_seconds"] = time.monotonic() - began
    with open(report + ".child", "w") as f:
        json.dump(results, f)
    sys.exit(0)  # interpreter shutdown: destructors of the inherited objects run
_, status = os.waitpid(child, 0)
time.sleep(0.3)
stop.set()
for t in threads:
    t.join()
more = pub.publish_many("t", list(range(-2000, -1000)))
acked.extend(range(-2000, -1000))
ok = pub.drain(60) and sub.drain(60)
with lock:
    missing = len(set(acked) - got)
pub.close()
sub.close()
with open(report, "w") as f:
    json.dump({"child_status": status, "acked": len(acked), "missing": missing, "drained": ok}, f)
'''


def test_every_call_on_a_bus_from_a_forked_child_raises_at_once_and_the_parent_goes_on(tmp_path):
    report = tmp_path / "report.json"
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, free_address(), free_address(),
                             str(tmp_path / "pub"), str(tmp_path / "sub"), str(report)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)  # the child too is stopped, whatever happens
    try:
        _out, err = proc.communicate(timeout=120)
    finally:
        stop_group(proc)
    assert proc.returncode == 0, err[-3000:]
    child = json.loads(Path(str(report) + ".child").read_text())
    assert child.pop("close_seconds") < 1.0
    for name, outcome in child.items():
        assert outcome.startswith("BusForkedError: "), (name, outcome)
        assert "fork" in outcome
    parent = json.loads(report.read_text())
    assert parent["child_status"] == 0
    assert parent["drained"] and parent["missing"] == 0 and parent["acked"] > 1000
    # The parent's store opens and holds no damage (the child wrote nothing into it).
    check = subprocess.run([str(Path(sys.executable).parent / "servicebus"), "check",
                            str(tmp_path / "pub")], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    with Bus(free_address(), tmp_path / "pub") as again:
        assert again.status().outgoing == 0
