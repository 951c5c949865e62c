"""StubBus: the in-memory bus users test their handlers with (issue 16)."""

from __future__ import annotations

import pytest

from servicebus import BusClosedError, Reject, RemoteError, Retry
from servicebus.testing import StubBus


def test_a_handler_runs_for_each_published_event_when_the_stub_is_drained(stub_bus):
    got = []
    stub_bus.every("user.signup", lambda p, m: got.append((p, m.topic, m.attempt)))
    stub_bus.publish("user.signup", {"id": 1})
    assert got == []  # nothing runs until drain: deterministic
    assert stub_bus.drain()
    assert got == [({"id": 1}, "user.signup", 1)]
    assert [s.payload for s in stub_bus.published] == [{"id": 1}]


def test_a_failing_handler_is_retried_on_the_stub_clock_then_dead_lettered():
    bus = StubBus(max_attempts=3, retry_initial=1.0, retry_max=10.0)
    runs = []

    @bus.every("t")
    def failing(payload, message):
        runs.append(message.attempt)
        raise RuntimeError("downstream down")

    bus.publish("t", 1)
    assert not bus.drain() and runs == [1]  # the retry waits for the clock
    bus.advance(1.0)
    bus.drain()
    bus.advance(2.0)
    assert bus.drain()
    assert runs == [1, 2, 3]
    (letter,) = bus.deadletters()
    assert (letter.reason, letter.attempts, letter.error) == ("handler_failed", 3,
                                                             "RuntimeError: downstream down")


def test_retry_after_and_reject_work_as_on_a_bus(stub_bus):
    runs = []

    @stub_bus.every("t")
    def handler(payload, message):
        runs.append((payload, message.attempt))
        if payload == "later" and message.attempt == 1:
            raise Retry("not yet", after=30)
        if payload == "bad":
            raise Reject("malformed order")

    stub_bus.publish("t", "later")
    stub_bus.publish("t", "bad")
    stub_bus.drain()
    stub_bus.advance(29)
    stub_bus.drain()
    assert runs == [("later", 1), ("bad", 1)]
    stub_bus.advance(1)
    assert stub_bus.drain()
    assert runs[-1] == ("later", 2)
    assert [(d.reason, d.error) for d in stub_bus.deadletters()] == [("rejected", "Reject: malformed order")]


def test_delays_ttls_and_priorities_follow_the_stub_clock(stub_bus):
    got = []
    stub_bus.every("t", lambda p, m: got.append(p))
    stub_bus.publish("t", "in a minute", delay=60)
    stub_bus.publish("t", "expires", ttl=5, delay=10)
    stub_bus.publish("t", "low")
    stub_bus.publish("t", "high", priority=9)
    stub_bus.drain()
    assert got == ["high", "low"]
    stub_bus.advance(60)
    assert stub_bus.drain()
    assert got == ["high", "low", "in a minute"]
    assert [d.reason for d in stub_bus.deadletters()] == ["expired"]


def test_handlers_that_publish_and_send_are_run_in_the_same_drain(stub_bus):
    emails = []

    @stub_bus.every("user.signup")
    def welcome(payload, message):
        stub_bus.send("tcp://127.0.0.1:9", "email.send", {"to": payload["email"]})

    stub_bus.handle("email.send", lambda p, m: emails.append(p["to"]))
    stub_bus.publish("user.signup", {"email": "a@example.com"})
    assert stub_bus.drain()
    assert emails == ["a@example.com"]
    assert [(s.topic, s.address) for s in stub_bus.sent] == [("email.send", "tcp://127.0.0.1:9")]


def test_a_request_is_answered_by_a_fake_handler_and_its_exception_is_a_remote_error(stub_bus):
    stub_bus.handle("pricing.quote", lambda p, m: {"price": 10 * p["qty"]})
    assert stub_bus.request("tcp://127.0.0.1:9", "pricing.quote", {"qty": 3}) == {"price": 30}
    stub_bus.handle("pricing.fail", lambda p, m: 1 / 0)
    with pytest.raises(RemoteError, match="ZeroDivisionError"):
        stub_bus.request("tcp://127.0.0.1:9", "pricing.fail", {})
    with pytest.raises(LookupError, match="no handler"):
        stub_bus.request("tcp://127.0.0.1:9", "nobody.home", {})


def test_patterns_several_handlers_and_a_late_handler_as_on_a_bus(stub_bus):
    seen = []
    stub_bus.publish("orders.created", 1)  # no handler yet: it waits
    assert not stub_bus.drain()
    stub_bus.every("orders.*", lambda p, m: seen.append(("pattern", p)), name="pattern")
    stub_bus.every("orders.created", lambda p, m: seen.append(("exact", p)), name="exact")
    stub_bus.advance(0.001)
    assert stub_bus.drain()
    assert sorted(seen) == [("exact", 1), ("pattern", 1)]


def test_the_stub_checks_arguments_as_a_bus_does(stub_bus):
    with pytest.raises(TypeError, match="msgpack"):
        stub_bus.publish("t", object())
    with pytest.raises(ValueError):
        stub_bus.publish("orders.*", 1)
    with pytest.raises(ValueError, match="the bus's own"):
        stub_bus.publish("t", 1, headers={"sb-x": 1})
    with pytest.raises(ValueError):
        stub_bus.send("not an address", "c", 1)
    stub_bus.close()
    with pytest.raises(BusClosedError):
        stub_bus.publish("t", 1)


def test_a_dedupe_key_publishes_once(stub_bus):
    first = stub_bus.publish("t", 1, dedupe_key="k")
    assert stub_bus.publish("t", 1, dedupe_key="k") == first
    assert len(stub_bus.published) == 1


def test_a_handlers_transaction_is_applied_on_the_stub_only_if_it_returns(stub_bus):
    @stub_bus.every("order.placed")
    def place(payload, message):
        message.kv.update("orders", lambda c: c + 1, 0)
        message.kv[f"order:{payload['n']}"] = "placed"
        message.publish("order.counted", {"n": payload["n"]})
        message.send("tcp://127.0.0.1:9", "audit.note", {"n": payload["n"]})
        if message.attempt == 1:
            raise RuntimeError("first attempt fails")

    stub_bus.publish("order.placed", {"n": 1})
    stub_bus.drain()
    assert stub_bus.kv.get("orders") is None and stub_bus.sent == []  # the failed run left nothing
    stub_bus.advance(60)
    stub_bus.drain()
    assert stub_bus.kv.get("orders") == 1 and stub_bus.kv["order:1"] == "placed"
    assert [s.topic for s in stub_bus.published] == ["order.placed", "order.counted"]
    assert [(s.topic, s.address) for s in stub_bus.sent] == [("audit.note", "tcp://127.0.0.1:9")]


def test_message_kv_outside_a_running_handler_raises_on_the_stub(stub_bus):
    from servicebus import TransactionError

    kept = []
    stub_bus.every("t", lambda payload, message: kept.append(message))
    stub_bus.publish("t", {})
    stub_bus.drain()
    with pytest.raises(TransactionError):
        kept[0].kv.get("x")


def test_a_handler_raising_system_exit_fails_its_attempt_on_the_stub_as_on_a_bus():
    bus = StubBus(max_attempts=2, retry_initial=1.0, retry_max=1.0)
    runs = []

    @bus.every("t")
    def exits(payload, message):
        runs.append(message.attempt)
        raise SystemExit("from a handler")

    bus.publish("t", 1)
    bus.drain()
    bus.advance(1.0)
    bus.drain()
    assert runs == [1, 2]
    letter, = bus.deadletters()
    assert (letter.reason, letter.error) == ("handler_failed", "SystemExit: from a handler")


def test_the_stub_replays_and_purges_dead_letters_by_id_topic_and_reason_as_a_bus_does():
    bus = StubBus(max_attempts=1)
    fail = {"on": True}
    got = []

    @bus.every("a.*")
    def handler(payload, message):
        if fail["on"]:
            raise RuntimeError("down")
        got.append((message.topic, payload))

    first = bus.publish("a.one", 1)
    bus.publish("a.two", 2)
    bus.publish("a.three", 3)
    bus.drain()
    assert len(bus.deadletters()) == 3
    fail["on"] = False
    assert bus.replay(topic="a.none") == 0
    assert bus.replay([first]) == 1
    assert bus.purge(topic="a.two", reason="handler_failed") == 1
    assert bus.replay(reason="expired") == 0
    assert bus.replay() == 1
    assert bus.drain() and got == [("a.one", 1), ("a.three", 3)]
    assert bus.deadletters() == []
    with pytest.raises(ValueError, match="no such dead letter"):
        bus.replay(["0" * 24])
