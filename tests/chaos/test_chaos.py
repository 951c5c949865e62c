"""The short profile of tools/chaos, one fault kind per test: real buses in real processes
under real faults, nothing acknowledged lost or duplicated, and the delivery audit of each
run's journals agreeing with its counts. `tools/chaos --long` runs the same with 100+
faults (its table is in the README).

tools/chaos audits each run itself, with a JVM of its own; here it runs with --no-audit
and --keep, and the test audits the kept journals with the session's one Spark session
(tests/conftest.py), through the comparison tools/chaos uses (tools/chaos_audit.py).

Not every kind here: an audit costs 3-4 s once Spark is warm (67 s for all 15 kinds, 2
cores, measured 2026-11-26). AUDITED are the kinds that each change what the journals say
in a way of their own: a receiver's events left unmoved by SIGKILL (kill-subscriber), a
journal flush failing on a full disk, clocks moved under the grace (clock), repairs and
dead letters (store-damage), a group's per-member pairs and reassignments (group-kill), a
third bus and the forwarded events (transaction-kill), unsynced writes dropped
(power-loss), retained events replayed to a late subscriber (replay-kill) and a receiver at
a new address (move-subscriber). The others add resends and restarts to the two-bus shape
kill-subscriber has; tools/chaos itself audits every kind."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from servicebus.hooks.segments import is_segment
from tools.chaos import KINDS
from tools.chaos_audit import audit_run, read_facts, spark_problem

pytestmark = pytest.mark.slow
AUDITED = ("kill-subscriber", "disk-full", "clock", "store-damage", "group-kill", "transaction-kill",
           "power-loss", "replay-kill", "move-subscriber")

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.mark.parametrize("kind", list(KINDS))
def test_nothing_acknowledged_is_lost_or_duplicated_under(kind, request):
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "chaos.py"), "--only", kind, "--json",
                           "--keep", "--no-audit"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.stdout, done.stderr[-3000:]
    (run,) = json.loads(done.stdout)["runs"]
    if run["skipped"]:
        pytest.skip(f"{kind}: {run['skipped']}")
    (work,) = [Path(note.split(" ", 1)[1]) for note in run["notes"] if note.startswith("kept ")]
    try:
        assert run["faults"] == KINDS[kind][0]
        assert run["acknowledged"] > 0
        assert run["lost"] == [] and run["duplicated"] == [], (run, done.stderr[-3000:])
        assert run["out_of_order"] == 0, (run, done.stderr[-3000:])
        assert run["state_errors"] == [], (run, done.stderr[-3000:])
        assert done.returncode == 0
        # Every journal is kept, disk-full's too (its data directories are on tmpfs mounts
        # the run takes down), for the audit of the run (issue 32).
        kept = {p.parent.parent.name: p for p in (work / "journals").glob("*/journal/*")
                if is_segment(p.name)}
        assert {"pub", "sub"} <= set(kept), sorted(kept)
        assert all(p.stat().st_size > 0 for p in kept.values())
        if kind not in AUDITED:
            return
        problem = spark_problem()
        if problem:
            pytest.skip(f"the delivery audit of the run: {problem}")
        audit = audit_run(request.getfixturevalue("spark"), work, read_facts(work))
        print(f"audit of {kind}: {audit['seconds']} s, {audit['classes']}")
        assert audit["agrees"], (audit, run)
        assert audit["classes"]["handled"] >= run["acknowledged"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
