"""The delivery audit on a real Spark standalone cluster (issue 17): a master and two
workers on loopback, started with the ``spark-class`` launcher PySpark ships, and the job
submitted with ``spark-submit``; it must find what local mode finds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from servicebus.audit import job
from servicebus.audit.synthetic import write_journals
from servicebus.testing import free_port, wait_until

pytestmark = [pytest.mark.spark, pytest.mark.slow]
pyspark = pytest.importorskip("pyspark", reason="pyspark is not installed (pip install 'servicebus[audit]')")
if job.java_problem():
    pytest.skip(job.java_problem(), allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent.parent
SPARK_HOME = Path(pyspark.__file__).resolve().parent
JOB = ROOT / "servicebus" / "audit" / "job.py"


def spark_env() -> dict[str, str]:
    return {**os.environ, "SPARK_HOME": str(SPARK_HOME), "PYSPARK_PYTHON": sys.executable,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_NO_DAEMONIZE": "1"}


def alive_workers(web_port: int) -> int:
    """Workers the master's web UI lists as alive; 0 while it is not answering JSON yet (a
    starting master's UI can answer /json/ with an HTML page: seen once in CI)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{web_port}/json/", timeout=2) as answer:
            state = json.load(answer)
    except (OSError, ValueError):
        return 0
    if not isinstance(state, dict):
        return 0
    return sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE")


@pytest.fixture
def cluster(tmp_path):
    """spark://127.0.0.1:PORT with two one-core workers; every process stopped after."""
    launcher = str(SPARK_HOME / "bin" / "spark-class")
    port, web = free_port(), free_port()
    procs: list[subprocess.Popen] = []

    def start(name: str, *args: str) -> None:
        log = open(tmp_path / f"{name}.log", "wb")
        procs.append(subprocess.Popen([launcher, *args], stdout=log, stderr=log, env=spark_env(),
                                      start_new_session=True))
        log.close()

    try:
        start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
              "--port", str(port), "--webui-port", str(web))
        for n in (1, 2):
            start(f"worker{n}", "org.apache.spark.deploy.worker.Worker", f"spark://127.0.0.1:{port}",
                  "--host", "127.0.0.1", "--cores", "1", "--memory", "1g",
                  "--webui-port", str(free_port()), "--work-dir", str(tmp_path / f"work{n}"))
        wait_until(lambda: alive_workers(web) == 2, 90, interval=0.5,
                   message=lambda: f"two workers registered with the master "
                                   f"({(tmp_path / 'master.log').read_text()[-1500:]})")
        yield f"spark://127.0.0.1:{port}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def test_the_audit_submitted_to_a_standalone_cluster_finds_what_local_mode_finds(cluster, spark, tmp_path):
    injected = write_journals(tmp_path / "shared" / "fleet", messages=3000, receivers=2, rate=10,
                              faults={"lost": 3, "duplicate": 2, "deadletter": 2, "in_flight": 2})
    out = tmp_path / "shared" / "audit"
    with open(tmp_path / "submit.out", "w+") as stdout, open(tmp_path / "submit.err", "w+") as stderr:
        submitting = subprocess.Popen(
            [str(SPARK_HOME / "bin" / "spark-submit"), "--master", cluster,
             "--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.driver.bindAddress=127.0.0.1",
             "--conf", "spark.executor.memory=512m",
             # Two cores: Spark's default of 200 shuffle partitions (for big clusters) is 200
             # tasks per shuffle here, most of this test's time; the result does not depend
             # on it (the job is exact for any partitioning), only the time does.
             "--conf", "spark.sql.shuffle.partitions=8",
             str(JOB), str(tmp_path / "shared" / "fleet"), "--out", str(out)],
            stdout=stdout, stderr=stderr, text=True, env=spark_env(), cwd=tmp_path, start_new_session=True)
        try:
            # Meanwhile, the reference: the same job in local mode (local[2], in the test
            # session's JVM, as `job.py --master local[2]` would run it), with main's
            # defaults (grace 60 s, no checkpoint).
            local = job.run(spark, [str(tmp_path / "shared" / "fleet")], str(tmp_path / "local"),
                               grace_ms=job.parse_duration("60s"))
            returncode = submitting.wait(300)
        finally:
            if submitting.poll() is None:
                os.killpg(submitting.pid, signal.SIGKILL)
                submitting.wait(10)
        stdout.seek(0)
        stderr.seek(0)
        submitted = subprocess.CompletedProcess(submitting.args, returncode, stdout.read(), stderr.read())
    assert submitted.returncode == 1, submitted.stdout + submitted.stderr[-3000:]  # faults found
    assert "PROBLEMS FOUND" in submitted.stdout
    on_cluster = json.loads((out / "summary.json").read_text())
    assert (out / "report.png").stat().st_size > 0

    assert local["ok"] is False  # what its exit 1 said
    in_local = json.loads((tmp_path / "local" / "summary.json").read_text())
    assert on_cluster["classes"] == in_local["classes"]
    assert on_cluster["problems"] == in_local["problems"]
    assert on_cluster["latency_ms"] == in_local["latency_ms"]
    assert on_cluster["classes"]["lost"] == len(injected["lost"]) == 3
    assert {(p["id"], p["receiver"]) for p in on_cluster["problems"]["handled_more_than_once"]} == \
        set(injected["duplicate"])
