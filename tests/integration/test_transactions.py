"""A handler's transaction (issue 16): message.kv, message.publish and message.send are
committed in the write that completes the handler's run, so a crash can neither lose what
the handler produced nor apply it twice; bus.kv is the same state outside handlers."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from servicebus import Bus, Reject, TransactionError
from servicebus.testing import free_address, wait_until

from ..conftest import counting_handler

TOPIC = "order.placed"


def downstream(make_bus, producer_address: str | None) -> tuple[Bus, Counter, Counter]:
    """A bus that subscribes to what the producer's handler publishes (TOPIC.done), if
    its address is given, and handles the command it sends (tx.note); returns it and the
    runs of each, by ``n``."""
    down = make_bus("down")
    events, notes = Counter(), Counter()
    lock = threading.Lock()

    def count(into: Counter):
        def handler(payload, message):
            with lock:
                into[payload["n"]] += 1
        return handler

    down.every(f"{TOPIC}.done", count(events))
    down.handle("tx.note", count(notes))
    if producer_address is not None:
        down.subscribe(producer_address, f"{TOPIC}.done", wait=15)
    return down, events, notes


def test_state_events_and_commands_a_handler_staged_are_stored_when_it_returns(make_bus):
    pub = make_bus("pub")
    sub = make_bus("sub")
    down, events, notes = downstream(make_bus, sub.address)
    sub.subscribe(pub.address, TOPIC, wait=10)

    @sub.every(TOPIC)
    def place(payload, message):
        message.kv.update("orders", lambda c: c + 1, 0)
        message.kv[f"order:{payload['n']}"] = {"total": payload["n"] * 10}
        assert message.kv[f"order:{payload['n']}"] == {"total": payload["n"] * 10}  # reads its writes
        message.publish(f"{TOPIC}.done", {"n": payload["n"]})
        message.send(down.address, "tx.note", {"n": payload["n"]})

    for n in range(30):
        pub.publish(TOPIC, {"n": n})
    wait_until(lambda: len(events) == 30 and len(notes) == 30, 20,
               message=lambda: f"{len(events)} events, {len(notes)} notes")
    assert set(events.values()) == {1} and set(notes.values()) == {1}
    assert sub.kv.get("orders") == 30
    assert sub.kv.items("order:")[:2] == [("order:0", {"total": 0}), ("order:1", {"total": 10})]
    assert len(sub.kv.items("order:")) == 30


def test_what_a_failing_run_staged_is_dropped_and_the_retry_applies_it_once(make_bus):
    pub = make_bus("pub")
    sub = make_bus("sub", retry_initial=0.05)
    down, events, notes = downstream(make_bus, sub.address)
    sub.subscribe(pub.address, TOPIC, wait=10)

    @sub.every(TOPIC)
    def place(payload, message):
        message.kv.update("orders", lambda c: c + 1, 0)
        message.publish(f"{TOPIC}.done", {"n": payload["n"]})
        message.send(down.address, "tx.note", {"n": payload["n"]})
        if message.attempt < 3:
            raise RuntimeError("not yet")

    pub.publish(TOPIC, {"n": 7})
    wait_until(lambda: events[7] and notes[7], 20, message="the third attempt's messages")
    assert sub.drain(10)
    assert down.drain(10)
    assert sub.kv.get("orders") == 1  # three runs, one of them committed
    assert events == Counter({7: 1}) and notes == Counter({7: 1})


def test_a_rejected_run_leaves_no_state_behind(make_bus):
    pub = make_bus("pub")
    sub = make_bus("sub")
    sub.subscribe(pub.address, TOPIC, wait=10)

    @sub.every(TOPIC)
    def place(payload, message):
        message.kv["seen"] = True
        raise Reject("bad order")

    pub.publish(TOPIC, {"n": 1})
    wait_until(lambda: sub.deadletters(), 10, message="the dead letter")
    assert "seen" not in sub.kv and sub.kv.get("seen") is None


def test_kv_updates_from_concurrent_handlers_lose_no_increment(make_bus):
    pub = make_bus("pub")
    sub = make_bus("sub", workers=6)
    sub.subscribe(pub.address, TOPIC, wait=10)
    runs = Counter()

    @sub.every(TOPIC)
    def place(payload, message):
        message.kv.update("total", lambda t: t + payload["n"], 0)
        runs[payload["n"]] += 1

    pub.publish_many(TOPIC, [{"n": n} for n in range(1, 201)])
    wait_until(lambda: sub.kv.get("total") == sum(range(1, 201)), 20,
               message=lambda: f"total {sub.kv.get('total')} of {sum(range(1, 201))}")
    assert sub.drain(10)
    assert sub.kv.get("total") == sum(range(1, 201))


def test_a_kv_update_function_that_raises_fails_the_run_like_its_handler(make_bus):
    pub = make_bus("pub")
    sub = make_bus("sub", retry_initial=0.05, max_attempts=2)
    sub.subscribe(pub.address, TOPIC, wait=10)

    @sub.every(TOPIC)
    def place(payload, message):
        message.kv["other"] = 1
        message.kv.update("orders", lambda c: c + "x", 0)  # TypeError at the commit

    pub.publish(TOPIC, {"n": 1})
    letters = wait_until(lambda: sub.deadletters(), 10, message="the dead letter")
    assert letters[0].reason == "handler_failed" and "TypeError" in letters[0].error
    assert sub.kv.get("orders") is None and sub.kv.get("other") is None


def test_message_kv_after_the_handler_returned_raises_transaction_error(make_bus):
    pub = make_bus("pub")
    sub = make_bus("sub")
    sub.subscribe(pub.address, TOPIC, wait=10)
    kept = []
    counting_handler(sub, TOPIC, lambda payload, message: kept.append(message))
    pub.publish(TOPIC, {"n": 1})
    wait_until(lambda: kept, 10, message="the handler")
    with pytest.raises(TransactionError, match="only while the message's handler runs"):
        kept[0].kv.put("late", 1)
    with pytest.raises(TransactionError):
        kept[0].publish(TOPIC, {"n": 2})
    assert sub.kv.get("late") is None


def test_bus_kv_checks_keys_and_values_and_survives_a_restart(make_bus, tmp_path):
    address = free_address()
    bus = make_bus("a", address=address, max_payload=1000)
    with pytest.raises(ValueError, match="kv key"):
        bus.kv.put("", 1)
    with pytest.raises(ValueError, match="kv key"):
        bus.kv.put("a\x00b", 1)
    with pytest.raises(ValueError, match="max_payload"):
        bus.kv.put("big", "x" * 2000)
    with pytest.raises(TypeError, match="msgpack"):
        bus.kv.put("obj", object())
    bus.kv.put("user:1", {"name": "a"})
    bus.kv["user:2"] = {"name": "b"}
    assert bus.kv.update("n", lambda v: v + 1, 41) == 42
    del bus.kv["user:2"]
    with pytest.raises(KeyError):
        bus.kv["user:2"]
    bus.close()
    again = Bus(address, tmp_path / "a")
    try:
        assert again.kv.items() == [("n", 42), ("user:1", {"name": "a"})]
    finally:
        again.close()


@pytest.mark.parametrize("kill", ["inside the handler", "mid-stream, twice"])
def test_a_handler_killed_at_any_point_neither_loses_nor_repeats_its_transaction(
        make_bus, bus_process, kill):
    pub = make_bus("pub")
    sub = bus_process("sub", "--handle", TOPIC, "--subscribe", pub.address, TOPIC,
                      "--handler-ms", "3", "--workers", "4")
    down, events, notes = downstream(make_bus, None)
    extra = ["--die-at", "40"] if kill == "inside the handler" else []
    sub.start("--transact", down.address, *extra)
    down.subscribe(sub.address, f"{TOPIC}.done", wait=15)
    pub.publish_many(TOPIC, [{"n": n} for n in range(300)])
    if kill == "mid-stream, twice":
        for seen in (80, 180):
            wait_until(lambda: len(events) >= seen, 30, message=lambda: f"{len(events)} events")
            sub.kill()  # SIGKILL: whatever the runs were doing
            sub.start("--transact", down.address)
    else:
        wait_until(lambda: sub.marker.exists() and sub.proc.poll() is not None, 30,
                   message="the process to kill itself in the handler of n=40")
        sub.start("--transact", down.address)
    wait_until(lambda: len(events) == 300 and len(notes) == 300, 60,
               message=lambda: f"{len(events)} events, {len(notes)} notes of 300")
    assert down.drain(10)
    assert set(events.values()) == {1}, [n for n, c in events.items() if c > 1]
    assert set(notes.values()) == {1}, [n for n, c in notes.items() if c > 1]
    sub.stop()
    # The state was applied once per message, whatever runs the kills cut short.
    state = Bus(free_address(), sub.datadir)
    try:
        assert state.kv.get("count") == 300
        assert len(state.kv.items("n:")) == 300
    finally:
        state.close()


def test_two_handlers_on_a_topic_each_commit_their_own_transaction_once(make_bus):
    """The run that returned is recorded with its writes and not run again; the one that
    failed is retried alone, and only its last attempt's writes land."""
    pub = make_bus("pub")
    sub = make_bus("sub", retry_initial=0.05)
    sub.subscribe(pub.address, TOPIC, wait=10)
    runs = Counter()

    @sub.every(TOPIC, name="bill")
    def bill(payload, message):
        runs["bill"] += 1
        message.kv.update("billed", lambda c: c + 1, 0)

    @sub.every(TOPIC, name="ship")
    def ship(payload, message):
        runs["ship"] += 1
        message.kv.update("shipped", lambda c: c + 1, 0)
        if message.attempt < 3:
            raise RuntimeError("not yet")

    pub.publish(TOPIC, {"n": 1})
    wait_until(lambda: sub.kv.get("shipped") == 1, 20, message="the third attempt of ship")
    assert sub.drain(10)
    assert runs == Counter({"bill": 1, "ship": 3})
    assert sub.kv.get("billed") == 1 and sub.kv.get("shipped") == 1


def test_a_command_handlers_transaction_lands_with_its_reply(make_bus):
    server = make_bus("server")
    client = make_bus("client")

    @server.handle("order.reserve")
    def reserve(payload, message):
        message.kv.update("reserved", lambda c: c + payload["qty"], 0)
        return {"ok": True}

    assert client.request(server.address, "order.reserve", {"qty": 2}, timeout=10) == {"ok": True}
    assert client.request(server.address, "order.reserve", {"qty": 3}, timeout=10) == {"ok": True}
    assert server.kv.get("reserved") == 5


def test_a_run_past_its_timeout_leaves_nothing_it_staged(make_bus):
    pub = make_bus("pub")
    sub = make_bus("sub", retry_initial=0.05, max_attempts=2)
    sub.subscribe(pub.address, TOPIC, wait=10)
    release = threading.Event()

    @sub.every(TOPIC, timeout=0.3)
    def slow(payload, message):
        message.kv.update("staged", lambda c: c + 1, 0)
        message.publish(f"{TOPIC}.done", {"n": 1})
        while not release.is_set():  # Python instructions: the time limit lands here
            release.wait(0.01)

    pub.publish(TOPIC, {"n": 1})
    try:
        wait_until(lambda: sub.deadletters(), 10, message="the dead letter after two timed-out runs")
    finally:
        release.set()
    assert sub.drain(10)
    assert sub.kv.get("staged") is None
    assert sub.status().pending == 0 and sub.counters().get("published", 0) == 0
