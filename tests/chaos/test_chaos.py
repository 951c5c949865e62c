"""The short profile of tools/chaos, one fault kind per test: real buses in real processes
under real faults, nothing acknowledged lost or duplicated. `tools/chaos --long` runs the
same with 100+ faults (its table is in the README)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.chaos import KINDS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.mark.parametrize("kind", list(KINDS))
def test_nothing_acknowledged_is_lost_or_duplicated_under(kind):
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "chaos.py"), "--only", kind, "--json"],
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
