"""The short profile of tools/chaos, one fault kind per test: real buses in real processes
under real faults, nothing acknowledged lost or duplicated. `tools/chaos --long` runs the
same with 100+ faults (its table is in the README)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools.chaos import KINDS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.mark.parametrize("kind", list(KINDS))
def test_nothing_acknowledged_is_lost_or_duplicated_under(kind):
    # disk-full's data directories are on tmpfs mounts the run takes down: --keep must
    # still leave every journal behind, for an audit of the run (issue 32).
    keep = ["--keep"] if kind == "disk-full" else []
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "chaos.py"), "--only", kind, "--json", *keep],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.stdout, done.stderr[-3000:]
    (run,) = json.loads(done.stdout)["runs"]
    if run["skipped"]:
        pytest.skip(f"{kind}: {run['skipped']}")
    assert run["faults"] == KINDS[kind][0]
    assert run["acknowledged"] > 0
    assert run["lost"] == [] and run["duplicated"] == [], (run, done.stderr[-3000:])
    assert run["out_of_order"] == 0, (run, done.stderr[-3000:])
    assert run["state_errors"] == [], (run, done.stderr[-3000:])
    assert done.returncode == 0
    if keep:
        (work,) = [Path(note.split(" ", 1)[1]) for note in run["notes"] if note.startswith("kept ")]
        try:
            kept = {p.parent.parent.name: p for p in (work / "journals").glob("*/journal/*.jsonl")}
            assert {"pub", "sub"} <= set(kept), sorted(kept)
            assert all(p.stat().st_size > 0 for p in kept.values())
        finally:
            shutil.rmtree(work, ignore_errors=True)
