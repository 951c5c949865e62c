"""What crosses the wire, and what a bus makes of it. A peer that reaches a bus's port can
send it, from a raw ZeroMQ DEALER speaking our protocol, frames that decompress to gigabytes
or messages no receiver can decode; an older publisher can send the latter too. A bus under
attack runs in its own process where its memory is measured."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import zmq

from servicebus.wire import protocol as P
from servicebus.wire.decoding import decode
from servicebus.wire.payload import encode_payload
from servicebus.testing import one_message, free_address, wait_until

from ..journals import journal_events

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
                            "segs": [[f"{0:024x}", TOPIC, 1, 1, None, None, {},
                                      [f"{k:024x}" for k in range(1000)]]]})
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


def test_a_subscriber_with_a_small_max_payload_takes_full_frames_from_a_large_max_batch(make_bus):
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


# --- a message no receiver can decode: a dead letter for that message alone ----------------------

UNDECODABLE = msgpack.packb({(1, 2): 3})  # a map keyed by an array: unhashable once decoded


def test_an_undecodable_message_in_a_raw_ordered_frame_is_a_dead_letter_and_the_lane_goes_on(make_bus, raw):
    from servicebus.ops import admin as A
    from servicebus.model.delivery import ORDER_HEADER

    bus = make_bus("sub")
    handled: list[int] = []
    bus.every(TOPIC, lambda payload, message: handled.append(payload["n"]))
    ids = [f"{k:024x}" for k in range(1, 8)]
    bodies = [encode_payload({"n": n}) for n in range(7)]
    bodies[3] = UNDECODABLE
    envs = [one_message(mid, TOPIC, 1_700_000_000_000, body, 1, None, None, {ORDER_HEADER: "stream-1"})
            for mid, body in zip(ids, bodies)]
    frame = P.encode_batch(P.Kind.EVENT, "hostile", "tcp://127.0.0.1:9", envs)
    dealer = raw(bus.address)
    acked: set[str] = set()

    def read_acks() -> set[str]:
        while dealer.poll(0):
            reply = decode(dealer.recv_multipart(), max_payload=1 << 20)
            assert isinstance(reply, P.Ack), reply
            acked.update(reply.ids)
        return acked

    dealer.send_multipart(frame)
    wait_until(lambda: read_acks() == set(ids), 10, message=lambda: f"acked {sorted(acked)}")
    wait_until(lambda: len(handled) == 6, 10, message=lambda: f"handled {handled}")
    assert handled == [0, 1, 2, 4, 5, 6]  # in order, past the one that cannot be read
    [letter] = bus.deadletters()
    assert (letter.id, letter.origin, letter.reason, letter.topic) == (
        ids[3], "incoming", "undecodable", TOPIC)
    assert "unhashable" in (letter.error or "")
    [row] = A.query_live(bus.datadir, "deadletters", {})
    assert row["payload"] == {"undecodable": base64.b64encode(UNDECODABLE).decode()}  # its raw bytes
    assert bus.status().malformed == 0

    acked.clear()
    dealer.send_multipart(frame)  # resent (its acks lost): acked again, nothing twice
    wait_until(lambda: read_acks() == set(ids), 10)
    assert bus.drain(10)
    assert handled == [0, 1, 2, 4, 5, 6] and len(bus.deadletters()) == 1


OLD_PUBLISHER = textwrap.dedent("""
    import sys
    from servicebus import Bus
    from servicebus.model import outgoing
    from servicebus.model.packer import pack
    from servicebus.testing import wait_until

    outgoing.encode_payload = pack  # as a publisher that did not check what receivers decode
    address, datadir = sys.argv[1:3]
    bus = Bus(address, datadir)
    wait_until(lambda: bus.status().subscriptions == 1, 30)
    bus.publish({topic!r}, {{"n": 0}})
    bus.publish({topic!r}, {{(1, 2): 3}})
    bus.publish_many({topic!r}, [{{"n": n}} for n in range(1, 21)])
    print("drained" if bus.drain(30) else "not drained", flush=True)
    sys.stdin.read()
    bus.close()
""").format(topic=TOPIC)


def test_an_undecodable_message_from_an_older_publisher_does_not_stop_an_ordered_subscription(
        make_bus, tmp_path):
    address = free_address()
    proc = subprocess.Popen([sys.executable, "-c", OLD_PUBLISHER, address, str(tmp_path / "old")],
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        sub = make_bus("sub")
        handled: list[int] = []
        sub.every(TOPIC, lambda payload, message: handled.append(payload["n"]))
        sub.subscribe(address, TOPIC, ordered=True, wait=30)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "drained"  # every message acked, none owed
        wait_until(lambda: len(handled) == 21, 10, message=lambda: f"handled {handled}")
        assert handled == list(range(21))
        [letter] = sub.deadletters()
        assert letter.reason == "undecodable" and letter.origin == "incoming"
        sub.close()
        events = [e for e in journal_events(tmp_path / "sub") if e["id"] == letter.id]
        assert [e["event"] for e in events] == ["received", "deadlettered"]  # not lost to the audit
    finally:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()


# --- a message whose own fields are not valid: a dead letter for that message alone --------------

CLI = str(Path(sys.executable).parent / "servicebus")


def ack_reader(dealer: zmq.Socket) -> tuple[set[str], Callable[[], set[str]]]:
    """The ids a raw DEALER was acked, and a function that reads what has come since."""
    acked: set[str] = set()

    def read() -> set[str]:
        while dealer.poll(0):
            reply = decode(dealer.recv_multipart(), max_payload=1 << 20)
            assert isinstance(reply, P.Ack), reply
            acked.update(reply.ids)
        return acked
    return acked, read


def test_messages_with_bad_fields_in_a_raw_ordered_frame_are_dead_letters_and_the_lane_goes_on(
        make_bus, raw):
    from servicebus.ops import admin as A
    from servicebus.model.delivery import ORDER_HEADER

    bus = make_bus("sub")
    handled: list[int] = []
    bus.every(TOPIC, lambda payload, message: handled.append(payload["n"]))
    ids = [f"{k:024x}" for k in range(1, 8)]
    lane = {ORDER_HEADER: "stream-1"}
    envs = [one_message(mid, TOPIC, 1_700_000_000_000, encode_payload({"n": n}), 1, None, None, lane)
            for n, mid in enumerate(ids)]
    envs[2] = envs[2]._replace(topic="user signup")  # not a topic
    envs[4] = envs[4]._replace(headers={**lane, "x": {1: 2}})  # a map no receiver reads in a header
    frame = P.encode_batch(P.Kind.EVENT, "hostile", "tcp://127.0.0.1:9", envs)
    dealer = raw(bus.address)
    acked, read_acks = ack_reader(dealer)

    dealer.send_multipart(frame)
    wait_until(lambda: read_acks() == set(ids), 10, message=lambda: f"acked {sorted(acked)}")
    wait_until(lambda: len(handled) == 5, 10, message=lambda: f"handled {handled}")
    assert handled == [0, 1, 3, 5, 6]  # in order, past the two that are not valid
    letters = {letter.id: letter for letter in bus.deadletters()}
    assert sorted(letters) == [ids[2], ids[4]]
    assert {(d.origin, d.reason) for d in letters.values()} == {("incoming", "invalid")}
    topic, headers = letters[ids[2]], letters[ids[4]]
    assert topic.topic == "user signup" and "whitespace" in (topic.error or "")
    assert headers.topic == TOPIC and re.match(r"headers: .*map key", headers.error or ""), headers.error
    rows = {row["id"]: row for row in A.query_live(bus.datadir, "deadletters", {})}
    assert (rows[ids[2]]["payload"], rows[ids[4]]["payload"]) == ({"n": 2}, {"n": 4})  # kept
    assert bus.status().malformed == 0

    acked.clear()
    dealer.send_multipart(frame)  # resent (its acks lost): acked again, nothing twice
    wait_until(lambda: read_acks() == set(ids), 10)
    assert bus.drain(10)
    assert handled == [0, 1, 3, 5, 6] and len(bus.deadletters()) == 2

    bus.close()
    # Nothing in them makes a message to handle: replay says so, and leaves them.
    replay = subprocess.run([CLI, "replay", str(bus.datadir), "--all", "--json"],
                            capture_output=True, text=True, timeout=60)
    assert replay.returncode == 0, replay.stderr
    rows = [json.loads(line) for line in replay.stdout.splitlines()]
    assert [(r["id"], r["result"]) for r in rows] == [(ids[2], "skipped"), (ids[4], "skipped")]
    assert all("not replayable" in r["detail"] for r in rows), rows
    shown = subprocess.run([CLI, "deadletters", str(bus.datadir), "--json"],
                           capture_output=True, text=True, timeout=60)
    assert [json.loads(line)["id"] for line in shown.stdout.splitlines()] == [ids[2], ids[4]]


def test_a_ttl_past_any_clock_from_a_raw_dealer_is_a_dead_letter_and_the_bus_goes_on(make_bus, raw):
    # An expires of 2**64 - 1 ms, moved onto this bus's clock by the frame's "now", no
    # longer fitted msgpack's ints when the message was stored: the engine stopped on
    # OverflowError and every later call raised BusBrokenError (DESIGN rule 10).
    bus = make_bus("sub")
    handled: list[int] = []
    bus.every(TOPIC, lambda payload, message: handled.append(payload["n"]))
    ids = [f"{k:024x}" for k in range(1, 4)]
    envs = [one_message(mid, TOPIC, 1_700_000_000_000, encode_payload({"n": n}), 1, None, None, {})
            for n, mid in enumerate(ids)]
    envs[1] = envs[1]._replace(expires=2**64 - 1)
    dealer = raw(bus.address)
    acked, read_acks = ack_reader(dealer)
    dealer.send_multipart(P.encode_batch(P.Kind.EVENT, "hostile", "tcp://127.0.0.1:9", envs, sent_at=1))
    wait_until(lambda: read_acks() == set(ids), 10,
               message=lambda: f"acked {sorted(acked)}; the bus: {bus.status()}")
    wait_until(lambda: sorted(handled) == [0, 2], 10, message=lambda: f"handled {handled}")
    [letter] = bus.deadletters()
    assert (letter.id, letter.reason) == (ids[1], "invalid")
    assert (letter.error or "").startswith("expires must be an int"), letter.error
    bus.publish("after", 1)  # the bus goes on
    assert bus.status().running


# --- what every way in accepts, every receiver decodes (DESIGN rule 11) ---------------------------

BAD = [1, {"a": {(1, 2): 3}}]
WHERE = r'payload\[1\]\["a"\]: map key \(1, 2\) is a tuple; a receiver cannot decode it'


def test_every_way_to_publish_or_send_refuses_what_no_receiver_can_decode(make_bus, tmp_path):
    from servicebus.testing.stub import StubBus

    bus = make_bus("bus")
    other = make_bus("other")
    doors = {
        "publish": lambda: bus.publish(TOPIC, BAD),
        "publish_many": lambda: bus.publish_many(TOPIC, [1, BAD]),
        "send": lambda: bus.send(other.address, "cmd", BAD),
        "request": lambda: bus.request(other.address, "cmd", BAD, timeout=1),
        "headers": lambda: bus.publish(TOPIC, 1, headers={"h": {1: 2}}),
        "kv": lambda: bus.kv.__setitem__("k", BAD),
        "StubBus.publish": lambda: StubBus().publish(TOPIC, BAD),
        "StubBus.send": lambda: StubBus().send(other.address, "cmd", BAD),
    }
    where = {"headers": r'headers\["h"\]: map key 1', "kv": WHERE.replace("payload", "value")}
    for name, door in doors.items():
        with pytest.raises(TypeError, match=where.get(name, WHERE)):
            door()
    refused: list[str] = []

    @bus.every("in")
    def handler(payload, message):
        for name, door in (("message.publish", lambda: message.publish(TOPIC, BAD)),
                           ("message.send", lambda: message.send(other.address, "cmd", BAD))):
            try:
                door()
            except TypeError as exc:
                refused.append(f"{name}: {exc}")

    bus.subscribe(other.address, "in", wait=10)
    other.publish("in", 1)
    wait_until(lambda: len(refused) == 2, 10)
    assert all(re.search(WHERE, r) for r in refused), refused
    assert bus.drain(10) and bus.status().outgoing == 0 and bus.status().deadletters == 0


def test_a_sql_outbox_refuses_what_no_receiver_can_decode(make_bus, tmp_path):
    sa = pytest.importorskip("sqlalchemy", reason="the sql extra (SQLAlchemy) is not installed")
    from servicebus.sql import SqlOutbox

    engine = sa.create_engine(f"sqlite:///{tmp_path / 'svc.db'}")
    outbox = SqlOutbox(make_bus("svc"), engine)
    outbox.create_table()
    try:
        with engine.begin() as conn:
            with pytest.raises(TypeError, match=WHERE):
                outbox.publish(conn, TOPIC, BAD)
            with pytest.raises(TypeError, match=WHERE):
                outbox.send(conn, "tcp://127.0.0.1:9", "cmd", BAD)
    finally:
        outbox.stop()
        engine.dispose()


def test_headers_too_large_to_travel_are_refused_at_publish(make_bus):
    bus = make_bus("pub")
    with pytest.raises(ValueError, match=r"headers are \d+ bytes encoded; at most 65536"):
        bus.publish(TOPIC, 1, headers={"h": "x" * 70_000})
    with pytest.raises(ValueError, match="headers"):
        bus.send(free_address(), "cmd", 1, headers={"h": "x" * 70_000})


def test_messages_with_large_headers_go_in_frames_the_receiver_accepts_without_resends(make_bus):
    # 400 messages each with ~60 KB of headers: a frame of 200 of them (12 MB of header) is
    # above the receiver's ZeroMQ message size limit and would be dropped whole, again and
    # again; the sender must count header bytes when it cuts frames.
    pub = make_bus("pub")
    sub = make_bus("sub", free_address())
    got = []
    sub.every(TOPIC, lambda payload, message: got.append(payload))
    sub.subscribe(pub.address, TOPIC, wait=10)
    pub.publish_many(TOPIC, list(range(400)), headers={"h": "x" * 60_000})
    wait_until(lambda: len(got) == 400, 30, message=lambda: f"{len(got)} of 400")
    assert pub.drain(10)
    assert pub.counters().get("resent", 0) == 0
