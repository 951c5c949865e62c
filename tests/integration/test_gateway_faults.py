"""The HTTP gateway as a process (``servicebus gateway``): kill -9 mid-stream and during
long polls, and 10,000 idle long polls against it. Slow (~40 s together); every process is
killed at the end, loopback only."""

from __future__ import annotations

import asyncio
import os
import random
import resource
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("aiohttp", reason="the gateway needs aiohttp (the gateway extra)")

from servicebus.testing import free_address, free_port  # noqa: E402
from ..gwhelp import call, wait_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


class GatewayProcess:
    """``servicebus gateway DATADIR --bind ADDR --listen 127.0.0.1:PORT`` in its own process
    group, on the same directory and ports at every start; killed at the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.datadir = tmp_path / "gw"
        self.address = free_address()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / "gateway.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout: float = 30.0) -> "GatewayProcess":
        cmd = [sys.executable, "-c", "from servicebus.ops.cli import main; main()", "gateway",
               str(self.datadir), "--bind", self.address, "--listen", f"127.0.0.1:{self.port}"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=log, start_new_session=True,
                                         env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.starts += 1
        wait_for(lambda: self.healthy() or self.proc.poll() is not None, timeout, "the gateway to start")
        assert self.proc.poll() is None, f"the gateway exited {self.proc.returncode}:\n{self.tail()}"
        return self

    def healthy(self) -> bool:
        try:
            return call(self.url, "GET", "/health", timeout=2)[0] == 200
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


@pytest.fixture
def gateway_process(tmp_path):
    made: list[GatewayProcess] = []

    def make() -> GatewayProcess:
        made.append(GatewayProcess(tmp_path))
        return made[-1]

    yield make
    for g in made:
        g.kill()


# --- 5. kill -9 ------------------------------------------------------------------------------

def test_kill9_mid_stream_loses_and_duplicates_nothing(gateway_process, make_bus):
    """A client publishes continuously and another long-polls and acks while the gateway
    process is killed -9 at random instants (4 times) and restarted on the same directory
    and ports. Every 201'd message is then acked once by the client (or its ack's answer
    was cut by a kill and it is gone, or it is a dead letter), and handled once by a Python
    subscriber of the gateway's bus."""
    seed = int(os.environ.get("GATEWAY_KILL_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    topic, base = "kill.t", "/topics/kill.t/subscribers/w"
    gw = gateway_process().start()
    status, body = call(gw.url, "PUT", base, {"max_attempts": 10, "visibility_duration": "2s"})
    assert status == 201, body

    sub = make_bus("python-sub")
    handled: Counter = Counter()
    handled_lock = threading.Lock()

    @sub.every(topic)
    def handler(payload, message):
        with handled_lock:
            handled[message.id] += 1

    sub.subscribe(gw.address, topic, wait=15)

    published: list[str] = []
    unsure_publishes = 0
    read: Counter = Counter()
    acked: Counter = Counter()  # acks the gateway answered: acked (not unknown)
    unsure_acks: set[str] = set()  # acks whose answer a kill cut
    errors: list[object] = []
    stop_publishing, stop_reading = threading.Event(), threading.Event()
    publishing = threading.Event()
    publishing.set()

    def publisher() -> None:
        nonlocal unsure_publishes
        n = 0
        while not stop_publishing.is_set():
            if not publishing.wait(0.1):
                continue
            n += 1
            try:
                status, body = call(gw.url, "POST", f"/topics/{topic}/messages", {"n": n}, timeout=5)
            except OSError:
                unsure_publishes += 1
                stop_publishing.wait(0.05)  # down: retry soon (pacing, not synchronisation)
                continue
            if status == 201:
                published.append(body["id"])
            else:
                errors.append(("publish", status, body))

    def consumer() -> None:
        while not stop_reading.is_set():
            try:
                status, body = call(gw.url, "GET", f"{base}?timeout=1s&max=50", timeout=5)
            except OSError:
                stop_reading.wait(0.05)
                continue
            if status != 200:
                errors.append(("read", status, body))
                continue
            ids = [m["id"] for m in body["messages"]]
            if not ids:
                continue
            read.update(ids)
            try:
                status, answer = call(gw.url, "POST", f"{base}/acks", ids, timeout=5)
            except OSError:
                unsure_acks.update(ids)
                continue
            if status != 200:
                errors.append(("ack", status, answer))
                continue
            acked.update(i for i in ids if i not in answer["unknown"])

    threads = [threading.Thread(target=publisher, daemon=True), threading.Thread(target=consumer, daemon=True)]
    for t in threads:
        t.start()
    kills = 4
    try:
        for k in range(kills):
            count = len(published)
            wait_for(lambda: len(published) >= count + 20, 10, "publishes to go on")
            if k % 2:  # during long polls: nothing to read, the consumer waits in its poll
                publishing.clear()
                wait_for(lambda: (lambda w: w["unpublished"] == 0 and w["in_flight"] == 0)(
                    call(gw.url, "GET", "/topics/kill.t/subscribers")[1]["subscribers"][0]), 10, "all read")
            time.sleep(rng.uniform(0.1, 1.2))  # a random instant: the fault, not a synchronisation
            gw.kill()
            gw.start()
            publishing.set()
        wait_for(lambda: len(published) >= count + 40, 10, "publishes after the last restart")
        stop_publishing.set()
        threads[0].join(10)
        ids = set(published)

        def dead() -> set[str]:
            status, body = call(gw.url, "GET", f"{base}/deadletters")
            return {d["id"] for d in body["deadletters"]}

        def settled() -> bool:
            status, body = call(gw.url, "GET", "/topics/kill.t/subscribers")
            [w] = body["subscribers"]
            with handled_lock:
                python_done = ids <= set(handled)
            # Every 201'd id accounted for at the pull subscriber too, not only an empty
            # queue: a message the gateway's bus resends to its pull bus after a restart
            # may not have arrived yet when the queue is first seen empty.
            pull_done = not (ids - set(acked) - unsure_acks - dead())
            return w["unpublished"] == 0 and w["in_flight"] == 0 and python_done and pull_done

        wait_for(settled, 20, "every message acked and handled")
    finally:
        stop_publishing.set()
        stop_reading.set()
        for t in threads:
            t.join(10)
    assert gw.starts == kills + 1 and errors == [], errors
    print(f"seed {seed}: {len(ids)} 201s, {unsure_publishes} publishes failed (down or cut), {len(unsure_acks)} acks cut, "
          f"{sum(read.values()) - len(read)} re-reads")
    assert len(ids) == len(published), "no id given twice"
    dead_ids = dead()
    assert max(acked.values()) == 1, f"seed {seed}: acked twice: {[i for i, c in acked.items() if c > 1][:5]}"
    lost = ids - set(acked) - dead_ids - unsure_acks
    assert not lost, f"seed {seed}: 201'd but never acked nor dead: {sorted(lost)[:5]} of {len(lost)}"
    assert not (set(acked) & dead_ids), "acked and dead"
    with handled_lock:
        missing = ids - set(handled)
        twice = [i for i, c in handled.items() if c > 1]
    assert not missing and not twice, f"seed {seed}: python subscriber missed {len(missing)}, twice {len(twice)}"


# --- 6. 10,000 idle long polls ----------------------------------------------------------------

POLLS = 10_000


def _raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"{POLLS} connections need {need} file descriptors; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


async def _get(port: int, path: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        data = await reader.read()
    finally:
        writer.close()
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    return status, data.partition(b"\r\n\r\n")[2]


def test_ten_thousand_idle_long_polls(gateway_process):
    """10,000 long polls held open at once: the gateway's RSS stays bounded, /health
    answers quickly meanwhile (p99), a message published then reaches exactly one poller,
    and every poll is answered (200) at its timeout."""
    psutil = pytest.importorskip("psutil", reason="psutil measures the gateway's memory")
    _raise_fd_limit(POLLS + 1024)  # each side: the test and the gateway
    gw = gateway_process().start()
    status, _ = call(gw.url, "PUT", "/topics/idle.t/subscribers/s", {})
    assert status == 201
    process = psutil.Process(gw.proc.pid)
    rss_before = process.memory_info().rss
    numbers: dict[str, float] = {}

    async def main() -> None:
        path = "/topics/idle.t/subscribers/s?timeout=12s"
        polls: list[asyncio.Task] = []
        arriving: list[float] = []
        opened = time.monotonic()
        for start in range(0, POLLS, 500):  # open in waves: the listen backlog is 1024
            wave = [asyncio.ensure_future(_get(gw.port, path)) for _ in range(500)]
            polls += wave
            await asyncio.sleep(0)  # let the wave connect (yields; no wall-clock wait)
            t0 = time.monotonic()
            await asyncio.wait_for(_get(gw.port, "/health"), 10)  # the gateway keeps up
            arriving.append(time.monotonic() - t0)
        numbers["open_s"] = time.monotonic() - opened
        numbers["health_max_while_polls_arrive_ms"] = 1000 * max(arriving)
        conns = lambda: len([c for c in process.net_connections("tcp")  # noqa: E731
                             if c.laddr and c.laddr.port == gw.port and c.status == "ESTABLISHED"])
        deadline = time.monotonic() + 10
        while conns() < POLLS * 0.99 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        numbers["connections"] = conns()
        latencies = []
        for _ in range(200):
            t0 = time.monotonic()
            status, _ = await asyncio.wait_for(_get(gw.port, "/health"), 10)
            latencies.append(time.monotonic() - t0)
            assert status == 200
        latencies.sort()
        numbers["health_p50_ms"] = 1000 * latencies[len(latencies) // 2]
        numbers["health_p99_ms"] = 1000 * latencies[int(len(latencies) * 0.99) - 1]
        numbers["rss_mb"] = process.memory_info().rss / 2**20
        numbers["rss_before_mb"] = rss_before / 2**20
        first = asyncio.ensure_future(asyncio.wait(polls, return_when=asyncio.FIRST_COMPLETED))
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(b"POST /topics/idle.t/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 9\r\nConnection: close\r\n\r\n{\"n\": 1}\n")
        answer = await reader.read()
        writer.close()
        assert answer.startswith(b"HTTP/1.1 201"), answer
        t0 = time.monotonic()
        done, _ = await asyncio.wait_for(first, 15)
        numbers["delivery_to_a_poller_ms"] = 1000 * (time.monotonic() - t0)
        results = await asyncio.wait_for(asyncio.gather(*polls, return_exceptions=True), 30)
        failed = [r for r in results if isinstance(r, BaseException) or r[0] != 200]
        numbers["polls_failed"] = len(failed)
        numbers["polls_with_the_message"] = sum(1 for r in results if not isinstance(r, BaseException)
                                                and b'"messages":[{' in r[1])
        numbers["rss_after_mb"] = process.memory_info().rss / 2**20

    asyncio.run(asyncio.wait_for(main(), 60))
    print("10k idle long polls:", {k: round(v, 1) for k, v in numbers.items()})
    assert numbers["connections"] >= POLLS * 0.99, numbers
    assert numbers["polls_failed"] == 0, numbers
    assert numbers["polls_with_the_message"] == 1, numbers
    assert numbers["health_p99_ms"] < 500, numbers
    assert numbers["rss_mb"] - numbers["rss_before_mb"] < 1024, numbers
    assert gw.healthy()
