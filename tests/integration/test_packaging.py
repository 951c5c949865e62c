"""``pip install servicebus`` from a built wheel and sdist (issue 16, packaging): the
version comes from one place, the wheel carries the package data, the dependencies, the
extras and the console script, and the installed copy imports and runs on its own."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import servicebus

ROOT = Path(__file__).resolve().parent.parent.parent
pytest.importorskip("build", reason="the build package is not installed (pip install -e '.[dev]')")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel ``python -m build`` makes from the sdist it makes first (so a file missing
    from the sdist breaks the wheel too). Built from a copy of the tracked files: a build
    writes build/ and *.egg-info into the tree it runs in."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    tmp = tmp_path_factory.mktemp("pkg")
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    src = tmp / "src"
    for name in files:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    # No isolation: the build backend comes from this environment (the dev extra), not
    # from an index this machine may not reach.
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir",
                            str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (sdist,) = (tmp / "dist").glob("servicebus-*.tar.gz")
    assert sdist.name == f"servicebus-{servicebus.__version__}.tar.gz"
    (whl,) = (tmp / "dist").glob("servicebus-*.whl")
    return whl


def test_the_wheel_has_the_one_version_the_data_files_the_extras_and_the_console_script(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        info = f"servicebus-{servicebus.__version__}.dist-info"
        metadata = zf.read(f"{info}/METADATA").decode()
        entry_points = zf.read(f"{info}/entry_points.txt").decode()
    assert f"Version: {servicebus.__version__}" in metadata
    for dependency in ("pyzmq", "plyvel", "msgpack", "typer", "rich"):
        assert f"Requires-Dist: {dependency}" in metadata
    for extra in ("audit", "compression", "bench", "dev"):
        assert f"Provides-Extra: {extra}" in metadata
    assert "servicebus = servicebus.ops.cli:main" in entry_points
    for name in ("servicebus/py.typed", "servicebus/audit/log4j2.properties",
                 "servicebus/core/machine.py", "servicebus/store/__init__.py"):
        assert name in names
    assert not any(n.startswith(("tests/", "tools/")) for n in names)


def test_the_installed_wheel_imports_and_runs_its_command_line_tool(wheel, tmp_path):
    target = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                                "--no-index", "--target", str(target), str(wheel)],
                               capture_output=True, text=True, timeout=120)
    assert installed.returncode == 0, installed.stderr[-2000:]
    # The dependencies come from this environment; servicebus itself from the wheel.
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import servicebus, servicebus.ops.cli;"
            "assert servicebus.__file__.startswith(sys.argv[1]), servicebus.__file__;"
            "print(servicebus.__version__); sys.argv = ['servicebus', '--help']; servicebus.ops.cli.main()")
    ran = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.splitlines()[0] == servicebus.__version__
    assert "check" in ran.stdout and "status" in ran.stdout
