"""Rebuild ``tests/data/format2.tar.gz``: data directories written by servicebus v0.2.

    tools/make_format2_fixture [--out tests/data/format2.tar.gz] [--commit 5d27b83]

Exports the code of ``--commit`` (the last v0.2 commit on main: its store is format 2)
with ``git archive`` into a temporary directory and runs ``tools/format2_fixture_v02.py``
in a subprocess with that code, not this tree's, first on ``sys.path``: it runs real
buses of that version and leaves their stopped data directories (see its docstring for
what each holds) and a ``manifest.json`` saying what a test should find in them. This
script checks that every store is format 2 and writes them, with the manifest, as one
small reproducible tar.gz (fixed order, times and owners): what
``tests/integration/test_migrate.py`` opens with the current code.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import plyvel

ROOT = Path(__file__).resolve().parent.parent
BUILDER = ROOT / "tools" / "format2_fixture_v02.py"
# Fixed addresses: a subscription names its subscriber's address, and the test starts the
# new buses where the old ones were. Below Linux's ephemeral range (32768-60999), so that
# no port the suite's free_address() hands out can be one of them.
PORTS = (24511, 24512, 24513, 24514)
# Left by a bus while it runs, or by its admin endpoint: not part of what a test opens.
RUNTIME_FILES = ("LOCK", "admin.endpoint", "admin.off")


def export_code(commit: str, into: Path) -> None:
    """The ``servicebus`` package of ``commit``: ``git archive COMMIT servicebus | tar -x -C into``."""
    archive = subprocess.run(["git", "archive", commit, "servicebus"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def build(code: Path, out: Path, commit: str) -> None:
    """Run the builder with the exported code first on sys.path (cwd elsewhere than this tree,
    whose servicebus would otherwise be found through the editable install)."""
    env = {**os.environ, "PYTHONPATH": str(code), "SERVICEBUS_CHECK_THREADS": ""}
    subprocess.run([sys.executable, str(BUILDER), str(out), ",".join(map(str, PORTS)), commit],
                   cwd=code, env=env, check=True, timeout=600)


def check_format(datadir: Path) -> dict[str, int]:
    """Every store is format 2 and holds something; returns its record counts by prefix."""
    db = plyvel.DB(str(datadir / "store"), create_if_missing=False)
    try:
        version = db.get(b"m/format")
        counts: dict[str, int] = {}
        for key in db.iterator(include_value=False):
            counts[key[:2].decode()] = counts.get(key[:2].decode(), 0) + 1
    finally:
        db.close()
    if version != b"2":
        raise SystemExit(f"{datadir}: store format {version!r}, not 2: not a v0.2 store")
    return counts


def tidy(datadir: Path) -> None:
    for name in RUNTIME_FILES:
        (datadir / name).unlink(missing_ok=True)
    shutil.rmtree(datadir / "run", ignore_errors=True)


def write_tar(src: Path, out: Path) -> int:
    """``src``'s files as a gzipped tar with fixed order, times and owners."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(src.rglob("*")):
            info = tar.gettarinfo(str(path), arcname=str(path.relative_to(src)))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if path.is_file():
                with open(path, "rb") as fh:
                    tar.addfile(info, fh)
            else:
                tar.addfile(info)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=9) as gz:
        gz.write(buf.getvalue())
    return out.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "format2.tar.gz")
    parser.add_argument("--commit", default="5d27b83", help="the v0.2 code to run (default: %(default)s)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="format2-") as tmp:
        code = Path(tmp) / "code"
        code.mkdir()
        export_code(args.commit, code)
        data = Path(tmp) / "format2"
        data.mkdir()
        build(code, data, args.commit)
        manifest = json.loads((data / "manifest.json").read_text())
        for name in manifest["datadirs"]:
            tidy(data / name)
            counts = check_format(data / name)
            print(f"{name}: format 2, records by keyspace {dict(sorted(counts.items()))}")
        size = write_tar(data, args.out)
    print(f"wrote {args.out} ({size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
