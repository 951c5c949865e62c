"""The audit package runs alone: ``spark-submit servicebus/audit/job.py`` loads its folder as
a package of its own, where nothing outside it can be imported (the bus need not be
installed on a Spark driver). The cluster test shows it too, but slowly."""

import ast
import subprocess
import sys
from pathlib import Path

AUDIT = Path(__file__).resolve().parents[2] / "servicebus" / "audit"
# Used by the tests and tools/bench_audit only, where servicebus is installed.
OUTSIDE_ALLOWED = {"synthetic.py"}


def test_no_module_the_job_loads_imports_from_outside_the_audit_package():
    reaching_out = []
    for path in sorted(AUDIT.glob("*.py")):
        if path.name in OUTSIDE_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 2:
                reaching_out.append(f"{path.name}:{node.lineno}")
            elif isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and node.level == 0):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                reaching_out += [f"{path.name}:{node.lineno}" for n in names if n and n.startswith("servicebus")]
    assert reaching_out == []


def test_job_py_runs_as_a_script_outside_any_package(tmp_path):
    done = subprocess.run([sys.executable, str(AUDIT / "job.py"), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage: servicebus audit" in done.stdout
