"""What someone who can reach a bus's port can make it do (issue 14): connect to addresses
it names, fill the bus with peers, read or write through the admin endpoint. Raw pyzmq
clients on loopback against real buses."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path


import pytest
import zmq

from servicebus import SubscribeRefused
from servicebus import admin as A
from servicebus import protocol as P
from servicebus.testing import free_address, wait_until

TOPIC = "user.signup"


@pytest.fixture
def raw():
    """Raw DEALER sockets to a bus, closed with linger 0 at the end."""
    socks: list[zmq.Socket] = []

    def connect(address: str) -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        socks.append(sock)
        return sock

    yield connect
    for sock in socks:
        sock.close(linger=0)


def peer_addresses(bus) -> set[str]:
    return {p.address for p in bus.status().peers}


@pytest.mark.parametrize("forged", ["tcp://10.0.0.1:3", "ipc:///tmp/servicebus-forged.sock"])
def test_a_subscribe_naming_an_address_off_its_sender_host_is_not_stored_nor_connected(
        make_bus, raw, forged):
    bus = make_bus("pub")
    sock = raw(bus.address)
    sock.send_multipart(P.encode_subscribe("x1", TOPIC, forged, "forger"))
    wait_until(lambda: any(k.startswith("refused_") for k in bus.counters()), 10)
    bus.publish(TOPIC, {"n": 1})
    assert bus.status().subscriptions == 0 and bus.status().outgoing == 0
    assert forged not in peer_addresses(bus)
    # ... and the forger is told why, on its own connection
    assert sock.poll(5000)
    assert isinstance(P.decode(sock.recv_multipart(), max_payload=1 << 20), P.Nack)


def bus_refused(bus) -> int:
    return sum(v for k, v in bus.counters().items() if k.startswith("refused_"))


def test_a_request_whose_reply_address_is_forged_is_refused_and_its_handler_never_runs(make_bus, raw):
    server = make_bus("server")
    ran = []
    server.handle("work", lambda p, m: ran.append(p) or "done")
    sock = raw(server.address)
    env = P.Envelope("m1", "work", 1, P.encode_payload({"n": 1}), 1, None, "c1", {})
    sock.send_multipart(P.encode_batch(P.Kind.COMMAND, "forger", "tcp://10.0.0.1:3", [env]))
    wait_until(lambda: server.counters().get("refused_not_source_host") == 1, 10)
    assert sock.poll(5000)
    assert isinstance(P.decode(sock.recv_multipart(), max_payload=1 << 20), P.Nack)
    assert server.drain(10) and ran == [] and "tcp://10.0.0.1:3" not in peer_addresses(server)


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def test_a_flood_of_subscribes_to_10k_addresses_is_refused_and_real_traffic_goes_on(make_bus, raw):
    pub, sub = make_bus("pub"), make_bus("sub")
    got = []
    sub.every(TOPIC, lambda p, m: got.append(p["n"]))
    sub.subscribe(pub.address, TOPIC, wait=10)
    before = rss_mb()
    flood = raw(pub.address)
    for n in range(10_000):  # closed loopback ports: nothing there answers a ping
        flood.send_multipart(P.encode_subscribe(f"f{n}", TOPIC, f"tcp://127.0.0.1:{40000 + n % 20000}", "flood"))
    wait_until(lambda: bus_refused(pub) >= 10_000 - 16, 60)
    for n in range(100):
        pub.publish(TOPIC, {"n": n})
    wait_until(lambda: len(got) == 100, 30)
    late = make_bus("late")  # a new subscriber, on a connection of its own, still gets in
    late_got = []
    late.every(TOPIC, lambda p, m: late_got.append(p["n"]))
    late.subscribe(pub.address, TOPIC, wait=10)
    pub.publish(TOPIC, {"n": 100})
    wait_until(lambda: late_got == [100], 10)
    status = pub.status()
    assert status.running and status.subscriptions == 2
    assert len(status.peers) <= 2 + 16
    assert rss_mb() - before < 50


def test_a_subscriber_refused_by_the_publisher_gets_the_reason(make_bus):
    pub = make_bus("pub", allow_peers=["192.0.2.0/24"])
    sub = make_bus("sub")
    # The publisher sees the subscriber's connection come from 127.0.0.1; it names itself as
    # a host name the publisher does not know.
    sub2 = make_bus("sub2", address=free_address().replace("127.0.0.1", "0.0.0.0"),
                    advertise="tcp://sub2.example:5555")
    with pytest.raises(SubscribeRefused, match="host_name_not_allowed"):
        sub2.subscribe(pub.address, TOPIC, wait=10)
    sub.subscribe(pub.address, TOPIC, wait=10)  # loopback: its own source host
    assert pub.status().subscriptions == 1


# --- the admin endpoint ----------------------------------------------------------------------

NOBODY = 65534
REACH = """
import socket, sys
endpoint = sys.argv[1]
if endpoint.startswith("ipc://"):
    s = socket.socket(socket.AF_UNIX)
    target = endpoint[len("ipc://"):]
else:
    s = socket.socket(socket.AF_INET)
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    target = (host, int(port))
try:
    s.connect(target)
except OSError as exc:
    print("refused", exc.errno)
else:
    print("connected")
"""


def reach_as(uid: int, endpoint: str) -> str:
    """Whether a process of ``uid`` can open a connection to ``endpoint`` at all (stdlib
    only: the test's venv lives where another user cannot read it)."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or python is None:
        pytest.skip("needs root (to run a client as uid nobody) and /usr/bin/python3")
    out = subprocess.run([python, "-c", REACH, endpoint], user=uid, group=uid, capture_output=True,
                         text=True, timeout=30, cwd="/")
    return out.stdout.strip() or out.stderr.strip()


@pytest.mark.parametrize("long_path", [False, True], ids=["short datadir", "datadir over 100 bytes"])
def test_only_the_bus_s_own_user_can_reach_its_admin_endpoint(make_bus, tmp_path, long_path):
    datadir = tmp_path / ("d" * 120 if long_path else "d") / "bus"
    os.chmod(tmp_path, 0o755)  # another user may walk to the data directory ...
    bus = make_bus("bus", datadir=datadir)
    endpoint = A.admin_endpoint(datadir)
    assert endpoint is not None and endpoint.startswith("ipc://")
    folder = Path(endpoint[len("ipc://"):]).parent
    mode = folder.stat()
    assert stat.S_IMODE(mode.st_mode) == 0o700 and mode.st_uid == os.getuid()
    assert A.query_live(datadir, "status", {})[0]["node_id"] == bus.node_id  # ... its user can
    assert reach_as(NOBODY, endpoint).startswith("refused")  # ... another cannot connect
    bus.close()
    assert not folder.exists() or not any(folder.iterdir())  # nothing left behind


def test_the_admin_endpoint_writes_no_file_and_export_is_streamed_to_the_cli(make_bus, tmp_path):
    pub, sub = make_bus("pub"), make_bus("sub")
    sub.subscribe(pub.address, TOPIC, wait=10)
    sub.close()  # the messages stay queued at the publisher
    for n in range(2500):
        pub.publish(TOPIC, {"n": n})
    target = tmp_path / "written-by-the-bus.jsonl"
    with pytest.raises(A.AdminUnavailable, match="no such view"):
        A.query_live(pub.datadir, "export", {"out": str(target)})
    assert not target.exists()
    out = tmp_path / "export.jsonl"
    result = subprocess.run([str(Path(os.sys.executable).parent / "servicebus"), "export", str(pub.datadir),
                             str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "served by the live bus" in result.stderr
    rows = [line for line in out.read_text().splitlines() if '"type": "outgoing"' in line]
    assert len(rows) == 2500
