"""What someone who can reach a bus's port can make it do (issue 14): connect to addresses
it names, fill the bus with peers, read or write through the admin endpoint. Raw pyzmq
clients on loopback against real buses."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path


import msgpack
import pytest
import zmq

from servicebus import SubscribeRefused
from servicebus.ops import admin as A
from servicebus.wire import protocol as P
from servicebus.wire.decoding import decode
from servicebus.wire.payload import decode_payload, encode_payload
from servicebus.model.segments import bodies_of
from servicebus.testing import one_message, free_address, wait_until

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
    assert sum(bus.status().refused_by_reason.values()) == 1
    assert forged not in peer_addresses(bus)
    # ... and the forger is told why, on its own connection
    assert sock.poll(5000)
    assert isinstance(decode(sock.recv_multipart(), max_payload=1 << 20), P.Nack)


def bus_refused(bus) -> int:
    return sum(v for k, v in bus.counters().items() if k.startswith("refused_"))


def test_a_request_whose_reply_address_is_forged_is_refused_and_its_handler_never_runs(make_bus, raw):
    server = make_bus("server")
    ran = []
    server.handle("work", lambda p, m: ran.append(p) or "done")
    sock = raw(server.address)
    env = one_message("m1", "work", 1, encode_payload({"n": 1}), 1, None, "c1", {})
    sock.send_multipart(P.encode_batch(P.Kind.COMMAND, "forger", "tcp://10.0.0.1:3", [env]))
    wait_until(lambda: server.counters().get("refused_not_source_host") == 1, 10)
    assert sock.poll(5000)
    assert isinstance(decode(sock.recv_multipart(), max_payload=1 << 20), P.Nack)
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


# --- a bus never subscribes itself ----------------------------------------------------------


def _own_aliases(tmp_path: Path, kind: str) -> tuple[str, dict, str, str]:
    """(bind, options, an alias of that bus's address, where a raw client connects)."""
    port = free_address().rsplit(":", 1)[1]
    if kind == "its address":
        return f"tcp://127.0.0.1:{port}", {}, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port}"
    if kind == "localhost for 127.0.0.1":
        return f"tcp://127.0.0.1:{port}", {}, f"tcp://localhost:{port}", f"tcp://127.0.0.1:{port}"
    if kind == "another loopback address, bound on every interface":
        return (f"tcp://0.0.0.0:{port}", {"advertise": f"tcp://127.0.0.1:{port}"},
                f"tcp://127.0.0.2:{port}", f"tcp://127.0.0.1:{port}")
    assert kind == "its ipc path through a symlinked folder"
    real = Path(tempfile.mkdtemp(prefix="sb-own-"))  # short: a socket path is at most ~100 bytes
    alias = Path(tempfile.mkdtemp(prefix="sb-alias-"))
    alias.rmdir()
    alias.symlink_to(real)
    return f"ipc://{real}/bus.sock", {}, f"ipc://{alias}/bus.sock", f"ipc://{real}/bus.sock"


OWN_ALIASES = ["its address", "localhost for 127.0.0.1", "another loopback address, bound on every interface",
               "its ipc path through a symlinked folder"]


@pytest.fixture
def own_alias(request, tmp_path):
    bind, options, alias, connect = _own_aliases(tmp_path, request.param)
    yield bind, options, alias, connect
    if bind.startswith("ipc://"):
        link = Path(alias[len("ipc://"):]).parent
        link.unlink()
        shutil.rmtree(Path(bind[len("ipc://"):]).parent, ignore_errors=True)


@pytest.mark.parametrize("own_alias", OWN_ALIASES, indirect=True)
def test_a_forged_subscribe_naming_the_bus_s_own_address_is_refused_and_nothing_is_stored_twice(
        make_bus, raw, own_alias):
    bind, options, alias, connect = own_alias
    bus = make_bus("bus", address=bind, **options)
    forger = raw(connect)
    forger.send_multipart(P.encode_subscribe("x1", TOPIC, alias, "forger"))
    assert forger.poll(35_000), "no answer to the forged subscribe"
    answer = decode(forger.recv_multipart(), max_payload=1 << 20)
    assert isinstance(answer, P.Nack) and "own_address" in answer.reason, answer
    assert bus.counters().get("refused_own_address") == 1
    assert bus.status().refused_by_reason == {"own_address": 1}
    bus.publish_many(TOPIC, [{"n": n} for n in range(10)])
    status = bus.status()
    assert status.subscriptions == 0 and status.outgoing == 0 and status.incoming == 0
    assert bus.drain(5) and bus.status().incoming == 0


def test_a_bus_asked_to_subscribe_to_itself_raises_value_error_and_stores_nothing(make_bus):
    bus = make_bus("bus")
    for alias in (bus.address, bus.address.replace("127.0.0.1", "localhost")):
        with pytest.raises(ValueError, match="itself"):
            bus.subscribe(alias, TOPIC)
    bus.unsubscribe(bus.address, TOPIC)  # allowed: it may end what an older version stored
    assert bus.drain(5)
    assert bus.status().intents == 0 and bus.status().subscriptions == 0


def test_a_bus_asked_to_subscribe_to_an_alias_of_itself_finds_out_and_keeps_nothing(make_bus, tmp_path):
    real = Path(tempfile.mkdtemp(prefix="sb-own-"))
    alias = Path(tempfile.mkdtemp(prefix="sb-alias-"))
    alias.rmdir()
    alias.symlink_to(real)
    try:
        bus = make_bus("bus", address=f"ipc://{real}/bus.sock")
        with pytest.raises(SubscribeRefused, match="itself"):
            bus.subscribe(f"ipc://{alias}/bus.sock", TOPIC, wait=30)
        bus.publish(TOPIC, {"n": 1})
        wait_until(lambda: bus.status().intents == 0, 10)
        assert bus.status().subscriptions == 0 and bus.status().incoming == 0
    finally:
        alias.unlink()
        shutil.rmtree(real, ignore_errors=True)


def test_a_subscription_to_itself_stored_by_an_older_version_is_dropped_at_start(make_bus, tmp_path, caplog):
    from servicebus.store import Store

    address = free_address()
    bus = make_bus("bus", address=address)
    bus.close()
    store = Store.open(tmp_path / "bus" / "store")
    try:
        batch = store.batch()
        batch.put_subscription(address, TOPIC, {"since": "0" * 24, "created": 1, "node": "forged"})
        store.write(batch, sync=True)
    finally:
        store.close()
    with caplog.at_level("WARNING", logger="servicebus"):
        again = make_bus("again", address=address, datadir=tmp_path / "bus")
    assert "own address" in caplog.text
    again.publish_many(TOPIC, [{"n": n} for n in range(10)])
    assert again.drain(5)
    status = again.status()
    assert status.subscriptions == 0 and status.outgoing == 0 and status.incoming == 0


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
def test_only_the_bus_s_own_user_can_reach_its_admin_endpoint(make_bus, walkable_dir, long_path):
    import socket

    datadir = walkable_dir / ("d" * 120 if long_path else "d") / "bus"
    open_socket = socket.socket(socket.AF_UNIX)  # another user may walk to the data directory
    try:  # and connect to a socket there that lets it ...
        open_socket.bind(str(walkable_dir / "open.sock"))
        open_socket.listen()
        os.chmod(walkable_dir / "open.sock", 0o777)
        assert reach_as(NOBODY, f"ipc://{walkable_dir / 'open.sock'}") == "connected"
    finally:
        open_socket.close()
    bus = make_bus("bus", datadir=datadir)
    endpoint = A.admin_endpoint(datadir)
    assert endpoint is not None and endpoint.startswith("ipc://")
    folder = Path(endpoint[len("ipc://"):]).parent
    mode = folder.stat()
    assert stat.S_IMODE(mode.st_mode) == 0o700 and mode.st_uid == os.getuid()
    assert A.query_live(datadir, "status", {})[0]["node_id"] == bus.node_id  # ... its user can
    assert reach_as(NOBODY, endpoint) == "refused 13"  # ... but not to the bus's (EACCES)
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


# --- CURVE ---------------------------------------------------------------------------------


def make_keys(folder: Path, name: str) -> tuple[Path, str]:
    from servicebus.ops.keys import keygen
    import zmq.auth

    public, _secret = keygen(folder / name)
    return folder / name, zmq.auth.load_certificate(public)[0].decode()


def trust(key_dir: Path, *peers: dict) -> None:
    lines = []
    for peer in peers:
        lines.append("[[peer]]")
        for name, value in peer.items():
            lines.append(f"{name} = {value!r}".replace("'", '"'))
    (key_dir / "peers.toml").write_text("\n".join(lines) + "\n")


@pytest.fixture
def curve_pair(make_bus, tmp_path):
    """A publisher and a subscriber with keys, each listing the other."""
    (pub_dir, pub_key), (sub_dir, sub_key) = make_keys(tmp_path, "pk"), make_keys(tmp_path, "sk")
    pub_addr, sub_addr = free_address(), free_address()
    trust(pub_dir, {"address": sub_addr, "keys": [sub_key]})
    trust(sub_dir, {"address": pub_addr, "keys": [pub_key]})
    pub = make_bus("pub", address=pub_addr, keys=pub_dir)
    sub = make_bus("sub", address=sub_addr, keys=sub_dir)
    return pub, sub, pub_key


def test_buses_with_keys_deliver_and_a_null_intruder_gets_nothing_in_or_out_and_is_counted(
        curve_pair, raw):
    pub, sub, _ = curve_pair
    got = []
    sub.every(TOPIC, lambda p, m: got.append(p))
    sub.subscribe(pub.address, TOPIC, wait=10)
    intruder = raw(pub.address)  # NULL mechanism
    intruder.send_multipart(P.encode_subscribe("x1", TOPIC, "tcp://127.0.0.1:9", "intruder"))
    env = one_message("m1", "work", 1, encode_payload(1), 1, None, "c1", {})
    intruder.send_multipart(P.encode_batch(P.Kind.COMMAND, "intruder", "tcp://127.0.0.1:9", [env]))
    pub.publish(TOPIC, {"n": 1})
    wait_until(lambda: got == [{"n": 1}], 10)
    # libzmq reports the mechanism mismatch as a protocol failure or, when the intruder's
    # greeting is cut short, without detail: either is a counted handshake failure.
    wait_until(lambda: handshake_failures(pub) >= 1, 10)
    assert not intruder.poll(500)  # nothing out
    assert pub.status().subscriptions == 1 and pub.status().incoming == 0  # nothing in


def handshake_failures(bus) -> int:
    return sum(v for k, v in bus.status().refused_by_reason.items() if k.startswith("handshake_failed"))


def test_a_client_whose_key_is_not_in_peers_toml_is_refused_at_the_handshake(curve_pair, raw, tmp_path):
    pub, _sub, pub_key = curve_pair
    _dir, _key = make_keys(tmp_path, "stranger")
    import zmq.auth
    public, secret = zmq.auth.load_certificate(tmp_path / "stranger" / "bus.key_secret")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = secret, public, pub_key.encode()
    try:
        sock.connect(pub.address)
        sock.send_multipart(P.encode_ping("stranger", "b"))
        wait_until(lambda: pub.counters().get("handshake_failed_auth", 0) >= 1, 10)
        assert not sock.poll(500)
    finally:
        sock.close(linger=0)


def test_a_key_may_subscribe_only_to_the_topics_and_only_for_the_address_its_entry_gives(
        make_bus, tmp_path):
    (pub_dir, pub_key), (sub_dir, sub_key) = make_keys(tmp_path, "pk"), make_keys(tmp_path, "sk")
    pub_addr, sub_addr = free_address(), free_address()
    trust(pub_dir, {"address": sub_addr, "keys": [sub_key], "subscribe": ["orders.*"]})
    trust(sub_dir, {"address": pub_addr, "keys": [pub_key]})
    pub = make_bus("pub", address=pub_addr, keys=pub_dir)
    sub = make_bus("sub", address=sub_addr, keys=sub_dir)
    with pytest.raises(SubscribeRefused, match="topic_not_allowed"):
        sub.subscribe(pub.address, TOPIC, wait=10)
    sub.subscribe(pub.address, "orders.created", wait=10)
    assert pub.status().subscriptions == 1


def test_keys_are_checked_when_the_bus_opens(make_bus, tmp_path):
    with pytest.raises(ValueError, match="keygen"):
        make_bus("a", keys=tmp_path / "none")
    key_dir, _ = make_keys(tmp_path, "k")
    (key_dir / "peers.toml").write_text('[[peer]]\naddress = "tcp://127.0.0.1:1"\nkeys = ["short"]\n')
    with pytest.raises(ValueError, match="40 Z85"):
        make_bus("b", keys=key_dir)
    os.chmod(key_dir / "bus.key_secret", 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        make_bus("c", keys=key_dir)


def test_a_subscriber_that_switches_keys_keeps_its_messages_while_both_keys_are_listed(
        make_bus, tmp_path):
    (pub_dir, pub_key), (old_dir, old_key) = make_keys(tmp_path, "pk"), make_keys(tmp_path, "old")
    new_dir, new_key = make_keys(tmp_path, "new")
    pub_addr, sub_addr = free_address(), free_address()
    # During the switch the publisher lists both keys of the subscriber.
    trust(pub_dir, {"address": sub_addr, "keys": [old_key, new_key]})
    for key_dir in (old_dir, new_dir):
        trust(key_dir, {"address": pub_addr, "keys": [pub_key]})
    pub = make_bus("pub", address=pub_addr, keys=pub_dir)
    sub = make_bus("sub", address=sub_addr, keys=old_dir)
    got = []
    sub.every(TOPIC, lambda p, m: got.append(p["n"]))
    sub.subscribe(pub.address, TOPIC, wait=10)
    pub.publish(TOPIC, {"n": 1})
    wait_until(lambda: got == [1], 10)
    assert sub.drain(10)
    sub.close()
    pub.publish(TOPIC, {"n": 2})  # waits for the subscriber, which comes back with its new key
    again = make_bus("sub-again", address=sub_addr, datadir=sub.datadir, keys=new_dir)
    got2 = []
    again.every(TOPIC, lambda p, m: got2.append(p["n"]))
    wait_until(lambda: got2 == [2], 30)
    pub.publish(TOPIC, {"n": 3})
    wait_until(lambda: got2 == [2, 3], 10)


def test_keygen_writes_a_key_pair_with_a_private_secret_and_never_overwrites_one(tmp_path):
    cli = str(Path(os.sys.executable).parent / "servicebus")
    made = subprocess.run([cli, "keygen", str(tmp_path / "k"), "--address", "tcp://10.0.0.5:5555"],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    assert 'address = "tcp://10.0.0.5:5555"' in made.stdout and "keys = [" in made.stdout
    assert stat.S_IMODE((tmp_path / "k" / "bus.key_secret").stat().st_mode) == 0o600
    again = subprocess.run([cli, "keygen", str(tmp_path / "k")], capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and "already" in again.stderr


# --- compression ---------------------------------------------------------------------------


@pytest.mark.parametrize("peer_codecs, compressed", [(("zstd",), True), ((), False)],
                         ids=["peer decodes zstd", "peer does not say so"])
def test_frames_are_compressed_only_to_a_peer_whose_pongs_say_it_decodes_the_codec(
        make_bus, raw, peer_codecs, compressed):
    pytest.importorskip("zstandard", reason="the compression extra is not installed")
    pub = make_bus("pub", wire_compression="zstd")
    address = free_address()
    fake = zmq.Context.instance().socket(zmq.ROUTER)  # a subscriber, by hand
    fake.setsockopt(zmq.LINGER, 0)
    fake.bind(address)
    try:
        raw(pub.address).send_multipart(P.encode_subscribe("s1", TOPIC, address, "fake"))
        batches = []

        def serve() -> bool:
            while fake.poll(10):
                ident, *frames = fake.recv_multipart()
                frame = decode(frames, max_payload=1 << 20)
                if isinstance(frame, P.Ping):
                    fake.send_multipart([ident, *P.encode_pong("fake", "b1", 1 << 20, peer_codecs)])
                elif isinstance(frame, P.Batch):
                    batches.append((frames, frame))
            return bool(batches) or pub.status().subscriptions == 1

        wait_until(serve, 10)
        pub.publish_many(TOPIC, [{"n": n, "pad": "y" * 500} for n in range(20)])
        wait_until(lambda: serve() and len(batches) >= 1, 10)
        frames, frame = batches[0]
        assert ("z" in msgpack.unpackb(frames[2])) is compressed
        assert [decode_payload(b)["n"] for e in frame.messages for b in bodies_of(e.body)] == list(range(20))
    finally:
        fake.close(linger=0)


def test_wire_compression_is_checked_when_the_bus_opens(make_bus):
    with pytest.raises(ValueError, match="zstd"):
        make_bus("a", wire_compression="lz4")


def test_a_killed_bus_with_a_long_data_path_leaves_no_admin_directory_behind_for_good(
        make_bus, tmp_path):
    import sys
    import textwrap

    datadir = tmp_path / ("d" * 120) / "bus"
    script = textwrap.dedent(f"""
        import os
        from servicebus import Bus
        Bus({free_address()!r}, {str(datadir)!r})
        os.kill(os.getpid(), 9)
    """)
    killed = subprocess.run([sys.executable, "-c", script], timeout=60)
    assert killed.returncode == -9
    left = Path(A.admin_endpoint(datadir)[len("ipc://"):]).parent
    assert left.is_dir()  # what the killed bus left
    bus = make_bus("bus", datadir=datadir)
    assert Path(A.admin_endpoint(datadir)[len("ipc://"):]).parent == left  # taken up again
    bus.close()
    assert not left.exists()


def _expected_admin_folder(datadir: Path) -> Path:
    """Where a bus on ``datadir`` puts its admin socket (the folder itself is not made)."""
    from servicebus.engine.sockets import admin_folder

    return admin_folder(datadir)[0]


def _cli(*args: object) -> tuple[subprocess.CompletedProcess, float]:
    """The real console script, and how long it took."""
    started = time.monotonic()
    result = subprocess.run([str(Path(os.sys.executable).parent / "servicebus"), *map(str, args)],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "80"})
    return result, time.monotonic() - started


@pytest.mark.parametrize("taken_as", ["a directory", "a symlink to a directory"])
def test_a_bus_whose_admin_folder_was_taken_by_another_user_starts_without_admin(
        make_bus, tmp_path, caplog, taken_as):
    if os.geteuid() != 0:
        pytest.skip("needs root, to make a folder owned by another user")
    datadir = tmp_path / ("d" * 120) / "bus"
    datadir.mkdir(parents=True)
    folder = _expected_admin_folder(datadir)
    trap = tmp_path / "trap"  # where another user would like the bus's socket to land
    trap.mkdir(mode=0o777)
    os.chown(trap, NOBODY, NOBODY)
    if taken_as == "a directory":
        folder.mkdir(mode=0o777)
        os.chown(folder, NOBODY, NOBODY)
    else:
        folder.symlink_to(trap, target_is_directory=True)
        os.lchown(folder, NOBODY, NOBODY)
    try:
        with caplog.at_level("WARNING", logger="servicebus"):
            bus = make_bus("bus", datadir=datadir)
        warnings = [r.getMessage() for r in caplog.records if "admin endpoint" in r.getMessage()]
        assert len(warnings) == 1 and str(folder) in warnings[0] and "nobody" in warnings[0], caplog.text
        status = bus.status()
        assert status.running and status.admin_endpoint is None
        assert status.admin_off_reason is not None and str(folder) in status.admin_off_reason
        assert "nobody" in status.admin_off_reason
        assert not (datadir / A.ENDPOINT_FILE).exists()
        sub = make_bus("sub")  # the bus itself works as ever
        got = []
        sub.every(TOPIC, lambda p, m: got.append(p))
        sub.subscribe(bus.address, TOPIC, wait=10)
        bus.publish(TOPIC, {"n": 1})
        wait_until(lambda: got == [{"n": 1}], 10)
        assert not any(trap.iterdir()) and (taken_as != "a directory" or not any(folder.iterdir()))
        result, took = _cli("status", datadir)  # the operator is told why, at once
        assert result.returncode == 3, result.stderr
        assert "admin endpoint is off" in result.stderr and str(folder) in result.stderr
        assert "Traceback" not in result.stderr and took < 20
        bus.close()
        assert folder.is_symlink() or folder.is_dir()  # another user's: left as it was
    finally:
        if folder.is_symlink():
            folder.unlink()
        elif folder.exists():
            shutil.rmtree(folder)


def test_the_admin_socket_is_bound_in_the_folder_that_was_checked_even_if_that_is_swapped_after(
        make_bus, tmp_path, monkeypatch):
    from servicebus.engine import sockets as S

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("binds through /proc/self/fd (Linux)")
    datadir = tmp_path / ("d" * 120) / "bus"
    folder = _expected_admin_folder(datadir)
    checked, elsewhere = tmp_path / "checked", tmp_path / "elsewhere"
    elsewhere.mkdir()
    real_open = S.open_private_folder

    def open_then_swap(path: Path) -> int:
        fd = real_open(path)
        os.rename(path, checked)  # the folder that passed the checks moves away, and a
        path.symlink_to(elsewhere)  # symlink to somewhere else takes its name
        return fd

    monkeypatch.setattr(S, "open_private_folder", open_then_swap)
    try:
        bus = make_bus("bus", datadir=datadir)
        assert stat.S_ISSOCK(os.lstat(checked / "admin.sock").st_mode)
        assert not any(elsewhere.iterdir())
        bus.close()
        assert not (checked / "admin.sock").exists()  # its socket is removed, ...
        assert folder.is_symlink() and elsewhere.is_dir()  # ... what took the name is not touched
    finally:
        folder.unlink(missing_ok=True)
        shutil.rmtree(checked, ignore_errors=True)


def _mutated_frames(count: int, seed: int, addr: str) -> list[list[bytes]]:
    """Frames of every kind with header fields deleted, added, or replaced by values of
    other types and sizes, kept only if they still decode: what passes the protocol's
    checks and reaches the core. Subscribes name ``addr`` (a bus that answers pings, so
    that they are stored with their odd options)."""
    import random

    rng = random.Random(seed)
    env = one_message("a" * 24, "user.signup", 1_700_000_000_000, encode_payload({"n": 1}),
                     2, 5, "c", {"sb-key": "k", "traceparent": "x"})
    goods = [P.encode_batch(kind, "n", addr, [env]) for kind in (P.Kind.EVENT, P.Kind.COMMAND, P.Kind.REPLY)]
    goods += [P.encode_ack(["a" * 24]), P.encode_nack(["a" * 24], "x"), P.encode_ping("n", "b"),
              P.encode_subscribe("i" * 24, "user.*", addr, "n", group="g", limit=5),
              P.encode_subscribe("i" * 24, "user.>", addr, "n", ordered=True),
              P.encode_subscribe("i" * 24, TOPIC, addr, "n", limit=3),
              P.encode_unsubscribe("i" * 24, "t", addr, "n"), P.encode_pong("n", "b", 10, ("zstd",))]
    values = [None, True, 0, -1, 2**63 - 1, 1.5, "", "x" * 300, b"\xff", [], [1, "a"], {"k": 1}]

    def mutate(obj: object) -> object:
        if isinstance(obj, dict) and obj:
            key = rng.choice(list(obj))
            if rng.random() < 0.2:
                del obj[key]
            else:
                obj[key] = mutate(obj[key]) if rng.random() < 0.4 else rng.choice(values)
            if rng.random() < 0.1:
                obj[rng.choice(["group", "ordered", "limit", "now", "z", "max"])] = rng.choice(values)
            return obj
        if isinstance(obj, list) and obj:
            i = rng.randrange(len(obj))
            obj[i] = mutate(obj[i]) if rng.random() < 0.4 else rng.choice(values)
            return obj
        return rng.choice(values)

    frames = []
    while len(frames) < count:
        good = rng.choice(goods)
        header = mutate(msgpack.unpackb(good[2], raw=False, strict_map_key=False))
        candidate = [good[0], good[1], msgpack.packb(header, use_bin_type=True), good[3]]
        try:
            decode(candidate, max_payload=1 << 20)
        except Exception:  # noqa: BLE001 - only what decodes is of interest here
            continue
        frames.append(candidate)
    return frames


def test_frames_with_odd_but_well_formed_headers_do_not_stop_the_engine(make_bus, raw):
    pub, sub, other = make_bus("pub"), make_bus("sub"), make_bus("other")
    got = []
    sub.every(TOPIC, lambda p, m: got.append(p["n"]))
    sub.subscribe(pub.address, TOPIC, wait=10)
    socks = [raw(pub.address) for _ in range(4)]
    frames = _mutated_frames(1500, seed=11, addr=other.address)
    for i, frame in enumerate(frames):
        socks[i % 4].send_multipart(frame)
    for sock in socks:  # a ping last: its pong comes once the bus has read everything before it
        sock.send_multipart(P.encode_ping("fuzz", "b"))
        deadline = time.monotonic() + 20
        while True:
            assert sock.poll(max(0, int((deadline - time.monotonic()) * 1000))), "no pong: the bus stopped reading"
            if sock.recv_multipart()[1] == bytes([P.Kind.PONG]):
                break
    assert pub.status().malformed + bus_refused(pub) > 0
    pub.publish_many(TOPIC, [{"n": n} for n in range(50)])
    wait_until(lambda: sorted(got) == list(range(50)), 20, message=lambda: f"{len(got)} of 50 after the frames")
    assert pub.status().running and pub.status().subscriptions >= 2  # some odd ones were stored


HOLD_SHARED = """
import fcntl, os, sys, time
try:
    fd = os.open(sys.argv[1], os.O_RDONLY)
except OSError as exc:
    print("refused", exc.errno, flush=True)
    sys.exit(0)
fcntl.flock(fd, fcntl.LOCK_SH)  # waits for the bus to die, then keeps it from starting again
print("held", flush=True)
time.sleep(120)
"""


def test_another_user_cannot_hold_a_crashed_bus_s_lock_to_keep_it_from_restarting(walkable_dir):
    from tests.conftest import BusProcess

    python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or python is None or shutil.which("setpriv") is None:
        pytest.skip("needs root, setpriv and /usr/bin/python3, to run a process as uid nobody")
    node = BusProcess(walkable_dir, "node", free_address())
    holder = None
    try:
        node.start()
        holder = subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                                   python, "-c", HOLD_SHARED, str(node.datadir / "LOCK")],
                                  stdout=subprocess.PIPE, text=True, cwd="/")
        node.kill()  # a crash: its LOCK stays, with its record
        answer = holder.stdout.readline().strip()
        assert answer.startswith("refused"), answer
        node.start()  # restarts as after any crash
    finally:
        if holder is not None:
            holder.kill()
            holder.wait(10)
            holder.stdout.close()
        node.kill()
