"""What a peer that reaches a bus's port can send it, speaking our protocol from a raw
ZeroMQ DEALER: frames that decompress to gigabytes, messages no receiver can decode. The
bus under attack runs in its own process, so that its memory is its own to measure."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import msgpack
import pytest
import zmq

from servicebus import protocol as P
from servicebus.testing import free_address, wait_until

ROOT = Path(__file__).resolve().parent.parent.parent
TOPIC = "user.signup"

VICTIM = textwrap.dedent("""
    import sys
    from servicebus import Bus

    address, datadir, publisher = sys.argv[1:4]
    bus = Bus(address, datadir)
    handled = []
    bus.every({topic!r}, lambda payload, message: handled.append(payload["n"]))
    bus.handle("probe", lambda payload, message: {{
        "malformed": dict(bus.status().malformed_by_reason), "handled": list(handled)}})
    bus.subscribe(publisher, {topic!r}, wait=30)
    print("ready", flush=True)
    sys.stdin.read()  # until the test closes our stdin
    bus.close()
""").format(topic=TOPIC)


@pytest.fixture
def raw():
    """Raw DEALER sockets, closed with linger 0 at the end."""
    ctx = zmq.Context()
    socks: list[zmq.Socket] = []

    def connect(address: str) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        socks.append(sock)
        return sock

    yield connect
    for sock in socks:
        sock.close(linger=0)
    ctx.term()


@pytest.fixture
def victim(tmp_path):
    """Start a bus in a child process subscribed to a publisher; stopped at the end."""
    procs: list[subprocess.Popen] = []

    def start(publisher: str) -> tuple[subprocess.Popen, str]:
        address = free_address()
        proc = subprocess.Popen([sys.executable, "-c", VICTIM, address, str(tmp_path / "victim"), publisher],
                                cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        return proc, address

    yield start
    for proc in procs:
        if proc.poll() is None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def peak_rss_mib(pid: int) -> float:
    """The most memory the process ever had resident (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc")


def test_zstd_bombs_from_a_raw_dealer_do_not_grow_a_bus_and_it_goes_on_delivering(make_bus, raw, victim):
    zstandard = pytest.importorskip("zstandard", reason="the compression extra is not installed")
    pub = make_bus("pub")
    proc, address = victim(pub.address)
    pub.publish(TOPIC, {"n": 0})

    def probe() -> dict:
        return pub.request(address, "probe", {}, timeout=30)

    wait_until(lambda: probe()["handled"] == [0], 30)
    before = peak_rss_mib(proc.pid)

    # 900 MiB of zeros each, in a few dozen KB: one frame declaring its size, one (a stream)
    # that does not. 1,000 messages declared in a ~16 KB header.
    mib = 900
    declared = zstandard.ZstdCompressor(level=1).compressobj(size=mib << 20)
    streamed = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
    chunk = bytes(1 << 20)
    bombs = []
    for comp in (declared, streamed):
        bombs.append(b"".join([*(comp.compress(chunk) for _ in range(mib)), comp.flush()]))
    assert all(len(b) < 64 << 10 for b in bombs)
    header = msgpack.packb({"sender": "bomber", "reply_to": "tcp://127.0.0.1:9", "z": "zstd",
                            "msgs": [[f"{k:024x}", TOPIC, 1, 1, None, None, {}] for k in range(1000)]})
    dealer = raw(address)
    for _ in range(3):
        for bomb in bombs:
            dealer.send_multipart([P.MAGIC, bytes([P.Kind.EVENT]), header, bomb])

    wait_until(lambda: sum(probe()["malformed"].values()) == 6, 60,
               message=lambda: f"malformed so far: {probe()['malformed']}")
    grown = peak_rss_mib(proc.pid) - before
    assert grown < 64, f"the bus's peak RSS grew by {grown:.0f} MiB"
    pub.publish(TOPIC, {"n": 1})
    wait_until(lambda: probe()["handled"] == [0, 1], 30)
    assert probe()["malformed"] == {"bad_compression": 6}
    assert pub.drain(30)


def test_a_subscriber_with_a_small_max_payload_takes_the_full_frames_of_a_publisher_with_a_large_max_batch(make_bus):
    # ~5,000 payloads of ~200 bytes make a frame of 1 MiB of payload and 10 KB of framing:
    # past what the subscriber's sockets took (2 x max_payload + 1 MiB), so libzmq dropped
    # the connection, and the messages arrived only once resends happened to cut them into
    # other frames (12,000 resends for 6,000 messages, 6.5 s).
    pub = make_bus("pub", max_batch=10_000, window=10_000, ack_timeout=30)
    sub = make_bus("sub", max_payload=1000)
    got: set[int] = set()
    sub.every(TOPIC, lambda payload, message: got.add(payload["n"]))
    sub.subscribe(pub.address, TOPIC, wait=10)
    pub.publish_many(TOPIC, [{"n": n, "pad": "x" * 180} for n in range(6000)])
    wait_until(lambda: len(got) == 6000, 20, message=lambda: f"{len(got)} of 6000 handled")
    assert pub.drain(10)
    assert pub.counters().get("resent", 0) == 0
