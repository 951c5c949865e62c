from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from servicebus import Bus
from servicebus.testing import free_address, wait_until
from .browser import browser, page  # noqa: F401 - fixtures for the tests of pages
from .faults import forget_moved_clock, libfaketime, moved_clock_env, offset_seconds

ROOT = Path(__file__).resolve().parent.parent

# Every core made in the suite, in this process and in the bus processes it starts, checks
# that only its engine thread touches it (servicebus/core/owner.py).
os.environ["SERVICEBUS_CHECK_THREADS"] = "1"

# The audits the suite runs through the CLI start their Spark driver without the class
# archive (servicebus/audit/jvmcache.py): a test run must not write ~150 MB to the user's
# cache, nor add its one-time writing to whichever test comes first. The archive's own
# tests (test_audit_class_archive.py) turn it on with a cache folder of their own.
os.environ["SERVICEBUS_SPARK_CDS"] = "0"


def counting_handler(bus: Bus, topic: str, each=None) -> Counter:
    """Handle ``topic`` on ``bus`` counting runs per payload ``n``; ``each(payload, message)``
    runs too, under the same lock. Returns the live Counter."""
    got: Counter = Counter()
    lock = threading.Lock()

    @bus.every(topic)
    def handler(payload, message):
        with lock:
            got[payload["n"]] += 1
            if each is not None:
                each(payload, message)

    return got


@pytest.fixture
def make_bus(tmp_path):
    """Open buses that are closed at the end of the test, whatever happens."""
    buses: list[Bus] = []

    def make(name: str, address: str | None = None, datadir: Path | None = None, **options) -> Bus:
        bus = Bus(address or free_address(), datadir or tmp_path / name, **options)
        buses.append(bus)
        return bus

    yield make
    for bus in buses:
        bus.close()


def subscriber_gone(make_bus, pub: Bus, topic: str, *, known_down: bool = False) -> tuple[str, Path]:
    """A subscriber of ``topic`` at ``pub`` that subscribed and closed: what is published
    next waits at ``pub``. With ``known_down``, return once ``pub`` sees it down (nothing is
    sent to it then). Returns its address and data directory, to start it again."""
    address = free_address()
    sub = make_bus(f"gone-{address.rsplit(':', 1)[-1]}", address=address)
    sub.subscribe(pub.address, topic, wait=10)
    sub.close()
    if known_down:
        wait_until(lambda: not any(p.up for p in pub.status().peers if p.address == address), 10)
    return address, sub.datadir


class BusProcess:
    """A tests/busproc.py process; stopped (killed) at the end of the test."""

    def __init__(self, tmp_path: Path, name: str, address: str, *args: str) -> None:
        self.name = name
        self.address = address
        self.datadir = tmp_path / name
        self.ready = tmp_path / f"{name}.ready"
        self.out = tmp_path / f"{name}.out"
        self.ids = tmp_path / f"{name}.ids"
        self.marker = tmp_path / f"{name}.marker"
        self.log = tmp_path / f"{name}.log"
        self.args = args
        self.proc: subprocess.Popen | None = None
        self.clock_offset: float | None = None  # seconds its wall clock is moved by

    def start(self, *extra: str, wait_ready: bool = True,
              env: dict[str, str] | None = None) -> "BusProcess":
        """``env`` adds variables (e.g. ``faketime("-1h")``)."""
        self.ready.unlink(missing_ok=True)
        self.clock_offset = offset_seconds(env["FAKETIME"]) if env and "FAKETIME" in env else None
        cmd = [sys.executable, "-m", "tests.busproc", "--bind", self.address,
               "--datadir", str(self.datadir), "--ready", str(self.ready),
               "--out", str(self.out), "--ids", str(self.ids), "--marker", str(self.marker),
               *self.args, *extra]
        logf = open(self.log, "ab")
        # Its own process group: kill and stop signal the group, so nothing the bus started
        # outlives the test.
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=logf, stderr=logf,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        logf.close()
        if wait_ready:
            self.wait_ready()
        return self

    def _ready_line(self) -> str | None:
        try:
            text = self.ready.read_text()
        except FileNotFoundError:
            return None
        return text if text.endswith("\n") else None

    def wait_ready(self, timeout: float = 30.0) -> None:
        # The ready line whole, not the file alone: it is made, then written (a read between
        # the two found it empty: CI, under load).
        wait_until(lambda: self._ready_line() is not None or self.proc.poll() is not None, timeout,
                   message=f"{self.name} to start")
        if self._ready_line() is None:
            raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
        if self.clock_offset is not None:
            # A clock fault that silently did not happen would make its test pass for nothing.
            wall = float(self._ready_line().split()[1])
            assert abs(wall - time.time() - self.clock_offset) < 60, (
                f"{self.name}'s clock is {wall - time.time():+.0f} s off, not {self.clock_offset:+.0f} s")

    def tail(self) -> str:
        return self.log.read_text()[-3000:] if self.log.exists() else ""

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            forget_moved_clock(self.proc.pid)

    def freeze(self) -> None:
        """SIGSTOP: the process keeps its sockets and answers nothing (a hung VM, a long GC
        pause, a debugger)."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)  # a frozen one would not see SIGTERM
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
                forget_moved_clock(self.proc.pid)  # in case it ended past libfaketime's cleanup
            except subprocess.TimeoutExpired:
                self.kill()

    def wait_exit(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)

    def lines(self, kind: str) -> list[list[str]]:
        if not self.out.exists():
            return []
        text = self.out.read_text()
        # Only whole lines: the process may be appending one while we read.
        text = text[:text.rfind("\n") + 1]
        return [line.split() for line in text.splitlines() if line.startswith(kind + " ")]

    def done_counts(self) -> Counter:
        return Counter(int(parts[2]) for parts in self.lines("done"))

    def published_ids(self) -> list[str]:
        return self.ids.read_text().split() if self.ids.exists() else []


@pytest.fixture
def bus_process(tmp_path):
    procs: list[BusProcess] = []

    def make(name: str, *args: str, address: str | None = None) -> BusProcess:
        proc = BusProcess(tmp_path, name, address or free_address(), *args)
        procs.append(proc)
        return proc

    yield make
    for proc in procs:
        proc.kill()


def faketime(offset: str) -> dict[str, str]:
    """The environment that runs a process with its wall clock moved by ``offset``
    (libfaketime syntax: ``-1h``, ``+8d``; see tests/faults.py). Skips the test if
    libfaketime is missing."""
    if libfaketime() is None:
        pytest.skip("libfaketime is not installed (Debian package faketime; tools/test installs "
                    "it when run as root)")
    return moved_clock_env(offset)


def stop_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``proc`` leads (started with ``start_new_session``): the
    process and whatever it forked, whether it ended or not."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


@pytest.fixture
def walkable_dir():
    """A directory every user may walk into, removed after: pytest's own (under
    /tmp/pytest-of-USER, mode 0700) are closed to other users at the top, so a check of
    what another user may do there would pass for the wrong reason."""
    path = Path(tempfile.mkdtemp(prefix="servicebus-walkable-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def spark():
    """One local[2] Spark session (one JVM) for every audit test of the run, those of
    tests/integration/test_audit.py and the local-mode reference of the cluster test:
    starting a JVM is seconds of CPU each time. Their modules skip without PySpark or Java
    before they ask for it."""
    from servicebus.audit import job

    session = job.spark_session("local[2]")
    yield session
    session.stop()
    if job.SPARK_LOG is not None:
        job.SPARK_LOG.unlink(missing_ok=True)
