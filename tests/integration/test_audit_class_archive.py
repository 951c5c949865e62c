"""``servicebus audit`` with the Spark driver's class archive (servicebus/audit/jvmcache.py),
through the CLI with real, cold JVMs: written by a first audit, used by the next, and never
the reason an audit fails. Each test sets SERVICEBUS_CACHE_DIR: the user's cache is not touched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from servicebus.audit import job, jvmcache
from servicebus.audit.synthetic import write_journals

pyspark = pytest.importorskip("pyspark", reason="pyspark is not installed (pip install 'servicebus[audit]')")
if job.java_problem():
    pytest.skip(job.java_problem(), allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.spark]

CLI = str(Path(sys.executable).parent / "servicebus")
WRITING = "servicebus audit: writing a one-time archive of Spark's classes"


def archive_path(cache: Path) -> Path:
    """Where the CLI keeps the archive for this Java, pyspark and jar set."""
    java = jvmcache.java_binary()
    assert java is not None
    jars = Path(pyspark.__file__).parent / "jars"
    return cache / jvmcache.archive_name(jvmcache.java_version(java), pyspark.__version__, jars)


def audit(tmp_path: Path, cache: Path, name: str, **env: str) -> tuple[subprocess.CompletedProcess, int]:
    """The CLI on the fleet at tmp_path/fleet, logging the driver JVM's class loading; its
    result and how many classes the driver loaded from a dynamic archive."""
    classes = tmp_path / f"{name}-classes.log"
    # SPARK_SUBMIT_OPTS reaches the driver JVM only (not spark-class's launcher JVM).
    result = subprocess.run(
        [CLI, "audit", str(tmp_path / "fleet"), "--out", str(tmp_path / "out"), "--master", "local[2]"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "SERVICEBUS_CACHE_DIR": str(cache), "SERVICEBUS_SPARK_CDS": "1",
             "SPARK_SUBMIT_OPTS": f"-Xlog:class+load=info:file={classes}", **env})
    shared = sum("source: shared objects file (top)" in line for line in classes.read_text().splitlines())
    return result, shared


@pytest.fixture
def fleet(tmp_path):
    write_journals(tmp_path / "fleet", messages=300, rate=10, faults={"duplicate": 1})  # found at once
    return tmp_path / "fleet"


def test_a_first_audit_writes_the_archive_the_next_maps_and_a_truncated_one_is_dropped(tmp_path, fleet):
    cache = tmp_path / "cache"
    first, shared = audit(tmp_path, cache, "first")
    assert first.returncode == 1 and "PROBLEMS FOUND" in first.stdout, first.stdout + first.stderr
    assert WRITING in first.stderr and shared == 0
    archive = archive_path(cache)
    assert jvmcache.looks_valid(archive, ""), sorted(p.name for p in cache.iterdir())
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name]
    written = archive.stat()

    second, shared = audit(tmp_path, cache, "second")
    assert (second.returncode, second.stdout) == (first.returncode, first.stdout), second.stderr
    assert WRITING not in second.stderr
    assert shared > 1000  # Spark's own classes came from the archive
    assert archive.stat().st_ino == written.st_ino  # used, not rewritten

    # Truncated, its recorded size made to match: past jvmcache's checks, Java 17 dies of
    # SIGBUS mapping it. The audit starts again without it, and the archive is dropped.
    cut = archive.read_bytes()[: written.st_size // 2]
    archive.chmod(0o600)
    archive.write_bytes(cut)
    jvmcache.size_file(archive).write_text(str(len(cut)))
    third, shared = audit(tmp_path, cache, "third")
    assert (third.returncode, third.stdout) == (first.returncode, first.stdout), third.stderr
    assert all(line.startswith("servicebus audit: ") for line in third.stderr.splitlines()), third.stderr
    assert shared == 0 and not archive.exists()
    assert not list(Path.cwd().glob("hs_err_pid*.log"))  # the JVM's crash report went to the cache


def test_a_garbage_archive_changes_nothing_in_the_audit_and_is_replaced(tmp_path, fleet):
    cache = tmp_path / "cache"
    without, _ = audit(tmp_path, cache, "without", SERVICEBUS_SPARK_CDS="0")
    assert without.returncode == 1 and WRITING not in without.stderr
    assert not archive_path(cache).exists()
    cache.mkdir(mode=0o700)
    archive = archive_path(cache)
    garbage = os.urandom(1 << 20)
    archive.write_bytes(garbage)
    jvmcache.size_file(archive).write_text(str(len(garbage)))
    with_garbage, shared = audit(tmp_path, cache, "garbage")
    assert (with_garbage.returncode, with_garbage.stdout) == (without.returncode, without.stdout)
    assert WRITING in with_garbage.stderr and shared == 0
    assert jvmcache.looks_valid(archive, "")  # a real archive took its place
