"""Two or more real buses in this process, talking over loopback TCP."""

import os
import random
import threading
from collections import Counter

import pytest
import zmq

from servicebus import (
    Bus, BusClosedError, LockedError, Message, StoreError, SubscribeTimeout, TransportError,
)
from servicebus.wire.payload import encode_payload
from servicebus.wire.protocol import MAGIC, Kind, encode_batch
from servicebus.testing import one_message, free_address, wait_until


def pair(make_bus, topic="user.signup", **sub_options):
    pub = make_bus("pub")
    sub = make_bus("sub", **sub_options)
    sub.subscribe(pub.address, topic, wait=10)
    return pub, sub


def test_published_events_reach_the_handler_once_with_their_message_record(make_bus):
    pub, sub = pair(make_bus)
    got = []
    sub.every("user.signup", lambda payload, message: got.append((payload, message)))
    mid = pub.publish("user.signup", {"id": 42, "email": "a@example.com"})
    wait_until(lambda: got, 10)
    payload, message = got[0]
    assert payload == {"id": 42, "email": "a@example.com"}
    assert isinstance(message, Message)
    assert (message.id, message.topic, message.sender, message.reply_to, message.attempt) == (
        mid, "user.signup", pub.node_id, pub.address, 1)
    assert message.sent.tzinfo is not None and dict(message.headers) == {}
    assert pub.drain(10) and sub.drain(10)
    assert len(got) == 1


def test_publish_many_returns_ids_in_order_and_delivers_all(make_bus):
    pub, sub = pair(make_bus)
    seen = Counter()
    lock = threading.Lock()

    @sub.every("user.signup")
    def handler(payload, message):
        with lock:
            seen[payload] += 1

    ids = pub.publish_many("user.signup", list(range(2000)))
    assert len(ids) == len(set(ids)) == 2000 and ids == sorted(ids)
    wait_until(lambda: len(seen) == 2000, 20, message=lambda: f"{len(seen)} of 2000")
    assert pub.drain(10) and sub.drain(10)
    assert set(seen.values()) == {1}
    assert pub.publish_many("user.signup", []) == []


def test_payload_types_round_trip(make_bus):
    pub, sub = pair(make_bus)
    got = []
    sub.every("user.signup", lambda p, m: got.append(p))
    payloads = [{"a": [1, 2.5]}, [1, "x"], "text", 7, 1.5, True, None, b"\x00\xffbytes"]
    pub.publish_many("user.signup", payloads)
    wait_until(lambda: len(got) == len(payloads), 10)
    assert sorted(map(repr, got)) == sorted(map(repr, payloads))


def test_bad_payloads_and_topics_are_refused_before_anything_is_stored(make_bus):
    pub, sub = pair(make_bus)
    with pytest.raises(TypeError, match="set"):
        pub.publish("user.signup", {1, 2})
    with pytest.raises(TypeError, match="object"):
        pub.publish_many("user.signup", [1, object()])
    with pytest.raises(ValueError):
        pub.publish("", 1)
    with pytest.raises(ValueError):
        pub.publish("x" * 256, 1)
    with pytest.raises(ValueError, match="max_payload"):
        pub.publish("user.signup", b"x" * (2 << 20))
    with pytest.raises(ValueError):
        sub.subscribe("not an address", "t")
    assert pub.status().outgoing == 0


def test_unknown_options_and_bad_values_are_refused(tmp_path):
    with pytest.raises(TypeError):
        Bus(free_address(), tmp_path / "a", no_such_option=1)
    with pytest.raises(ValueError):
        Bus(free_address(), tmp_path / "b", workers=0)
    with pytest.raises(ValueError):
        Bus("tcp://*:5555", tmp_path / "c")
    with pytest.raises(ValueError):
        Bus("http://x", tmp_path / "d")
    with pytest.raises(TypeError, match="store_compression must be a bool"):
        Bus(free_address(), tmp_path / "e", store_compression="yes")


def test_handler_that_raises_is_retried_then_dead_lettered_with_the_error(make_bus):
    pub, sub = pair(make_bus, max_attempts=3, retry_initial=0.01, retry_max=0.05)
    attempts = []

    @sub.every("user.signup")
    def flaky(payload, message):
        attempts.append(message.attempt)
        raise RuntimeError(f"smtp down for {payload}")

    mid = pub.publish("user.signup", "p1")
    wait_until(lambda: sub.status().deadletters == 1, 10)
    assert attempts == [1, 2, 3]
    letters = dict(sub._store.deadletters())
    assert letters[mid]["reason"] == "handler_failed"
    assert letters[mid]["error"] == "RuntimeError: smtp down for p1"
    assert letters[mid]["attempts"] == 3
    assert sub.status().incoming == 0
    assert sub.drain(5)


def test_a_handler_that_fails_once_succeeds_on_retry(make_bus):
    pub, sub = pair(make_bus, retry_initial=0.01)
    calls = []

    @sub.every("user.signup")
    def once(payload, message):
        calls.append(message.attempt)
        if message.attempt == 1:
            raise ValueError("first time")

    pub.publish("user.signup", 1)
    wait_until(lambda: calls == [1, 2] and sub.drain(0.1), 10)
    assert sub.status().deadletters == 0


def test_several_handlers_on_one_topic_all_run_and_a_failing_one_is_retried_alone(make_bus):
    pub, sub = pair(make_bus, retry_initial=0.01)
    a, b = [], []
    sub.every("user.signup", lambda p, m: a.append(m.attempt))

    def b_handler(p, m):
        b.append(m.attempt)
        if m.attempt < 3:
            raise RuntimeError("not yet")

    sub.every("user.signup", b_handler)
    pub.publish("user.signup", 1)
    wait_until(lambda: b == [1, 2, 3], 10)
    assert sub.drain(5)
    assert a == [1]  # finished once; never rerun for b's failures


def test_messages_arriving_before_any_handler_wait_for_one(make_bus):
    pub, sub = pair(make_bus)
    pub.publish_many("user.signup", [1, 2, 3])
    wait_until(lambda: sub.status().incoming == 3, 10)
    assert not sub.drain(0.3)  # parked, not dropped and not dead-lettered
    got = []
    sub.every("user.signup", lambda p, m: got.append(p))
    wait_until(lambda: sorted(got) == [1, 2, 3], 10)
    assert sub.drain(5) and sub.status().deadletters == 0


def test_a_handler_registered_while_a_worker_parks_its_message_still_gets_it(make_bus):
    """A worker finds no handler and parks the message; the handler registers between the
    two (here: from inside the park, the widest such gap). The message must run now, not
    wait in the store until the next restart."""
    pub, sub = pair(make_bus)
    got = []
    runner = sub._dispatcher.runner
    park = runner._park

    def registering_meanwhile(item):
        key = (item.record.kind, item.record.topic)
        if not got and key[1] == "user.signup" and not sub._dispatcher.registry.get(key):
            sub.every("user.signup", lambda p, m: got.append(p))
        return park(item)

    runner._park = registering_meanwhile
    pub.publish("user.signup", 1)
    wait_until(lambda: got == [1], 10, message=lambda: f"still parked: {sub.status().incoming} stored")
    assert sub.drain(5)


def test_subscribe_is_idempotent_and_unsubscribe_stops_delivery(make_bus):
    pub, sub = pair(make_bus)
    sub.subscribe(pub.address, "user.signup", wait=10)
    assert pub.status().subscriptions == 1
    got = []
    sub.every("user.signup", lambda p, m: got.append(p))
    pub.publish("user.signup", 1)
    wait_until(lambda: got == [1], 10)
    sub.unsubscribe(pub.address, "user.signup", wait=10)
    assert pub.status().subscriptions == 0
    assert sub.status().intents == 0
    pub.publish("user.signup", 2)  # nobody subscribes any more: nothing is stored
    wait_until(lambda: pub.status().outgoing == 0, 5)  # what was delivered is collected
    assert pub.drain(5) and got == [1]


def test_subscribe_wait_times_out_when_the_publisher_never_answers(make_bus):
    sub = make_bus("sub")
    with pytest.raises(SubscribeTimeout):
        sub.subscribe(free_address(), "t", wait=0.3)
    assert sub.status().intents_unconfirmed == 1


def test_concurrent_publishers_share_fsyncs(make_bus):
    pub, sub = pair(make_bus)
    got = Counter()
    lock = threading.Lock()

    def handler(p, m):
        with lock:
            got[p] += 1

    sub.every("user.signup", handler)
    before = pub.counters().get("fsyncs", 0)

    def publisher(t):
        for i in range(150):
            pub.publish("user.signup", f"{t}-{i}")

    threads = [threading.Thread(target=publisher, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fsyncs = pub.counters()["fsyncs"] - before
    assert fsyncs <= 1200 * 0.6, f"{fsyncs} fsyncs for 1200 concurrent publishes"
    wait_until(lambda: len(got) == 1200, 20)
    assert set(got.values()) == {1}


def test_a_second_bus_on_a_locked_datadir_fails_naming_the_owner(make_bus, tmp_path):
    first = make_bus("data")
    with pytest.raises(LockedError, match=f"pid {os.getpid()}") as info:
        Bus(free_address(), tmp_path / "data")
    assert info.value.owner["address"] == first.address


def test_bind_address_in_use_and_unusable_datadir_raise_clear_errors(make_bus, tmp_path):
    first = make_bus("a")
    with pytest.raises(TransportError, match="already in use"):
        Bus(first.address, tmp_path / "b")
    # the failed bus released its lock: the data directory opens fine afterwards
    make_bus("b")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreError, match="cannot create data directory"):
        Bus(free_address(), blocker / "data")


def test_closed_bus_refuses_work_and_close_is_idempotent(make_bus):
    bus = make_bus("a")
    bus.close()
    bus.close()
    with pytest.raises(BusClosedError):
        bus.publish("t", 1)
    with pytest.raises(BusClosedError):
        bus.status()


def test_fuzzed_frames_are_counted_and_dropped_while_delivery_goes_on(make_bus):
    pub, sub = pair(make_bus)
    got = set()
    sub.every("user.signup", lambda p, m: got.add(p))
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(sub.address)
    rng = random.Random(1)
    good = encode_batch(Kind.EVENT, "evil", "tcp://127.0.0.1:1",
                        [one_message("f" * 24, "user.signup", 1, encode_payload(-1))])
    junk_kinds = [
        lambda: [os.urandom(rng.randint(0, 64))],
        lambda: [b"XXX", bytes([Kind.EVENT]), good[2], good[3]],
        lambda: [MAGIC, b"\x77", good[2], good[3]],
        lambda: [MAGIC, bytes([Kind.EVENT]), b"\xc1" + os.urandom(8), good[3]],
        lambda: [MAGIC, bytes([Kind.EVENT]), __import__("msgpack").packb({"sender": "x"}), good[3]],
        lambda: [MAGIC, bytes([Kind.EVENT]), good[2], __import__("msgpack").packb([b"\xc1"])],
        lambda: [MAGIC, bytes([Kind.SUBSCRIBE]), __import__("msgpack").packb(
            {"id": "i", "topic": "t", "address": "tcp://evil", "sender": "x"}), b""],
    ]
    try:
        sent = 0
        for n in range(3000):
            dealer.send_multipart(junk_kinds[n % len(junk_kinds)]())
            sent += 1
            if n % 300 == 0:
                pub.publish("user.signup", n)
        # Each kind of junk is counted once, under the reason it deserves; a well-formed
        # frame whose one payload is junk is not malformed: that message is a dead letter
        # (once; the same id again is a duplicate, acked).
        reasons = ["bad_frame_count", "bad_magic", "unknown_kind", "bad_msgpack", "missing_field",
                   "undecodable", "bad_address"]
        expected = Counter(reasons[n % len(reasons)] for n in range(sent))
        undecodable = expected.pop("undecodable")
        wait_until(lambda: sub.status().malformed >= sent - undecodable, 20,
                   message=lambda: f"{sub.status().malformed} of {sent - undecodable} counted")
        assert sub.status().malformed == sent - undecodable
        assert dict(sub.status().malformed_by_reason) == dict(expected)
        wait_until(lambda: sub.counters().get("duplicates") == undecodable - 1, 20)
        assert [(d.id, d.reason) for d in sub.deadletters()] == [("f" * 24, "undecodable")]
        wait_until(lambda: got == set(range(0, 3000, 300)), 20)
        pub.publish("user.signup", "after")
        wait_until(lambda: "after" in got, 10)
        assert -1 not in got and pub.status().subscriptions == 1
        assert sub.status().subscriptions == 0  # the forged subscribe was refused
    finally:
        dealer.close(linger=0)
        ctx.term()


def test_drain_from_a_handler_is_refused_and_close_from_a_handler_does_not_hang(make_bus):
    pub, sub = pair(make_bus)
    outcome = []

    @sub.every("user.signup")
    def handler(payload, message):
        try:
            sub.drain(1)
        except RuntimeError as exc:
            outcome.append(str(exc))
        sub.close()
        outcome.append("closed")

    pub.publish("user.signup", 1)
    wait_until(lambda: "closed" in outcome, 20)
    assert "inside a handler" in outcome[0]
    assert sub.closed
