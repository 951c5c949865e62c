"""The handler side, unit-tested without sockets, disks or sleeps: one ``Runner`` on an
in-memory store (servicebus/testing/handling.py), driven from the test's thread on a
clock that moves only when told to. What each outcome of a run writes (handling/runner.py):
handled, failed (a retry), dead, replied, dropped, parked; and the start marker that
makes a run which never finished count as an attempt."""

import time

import pytest

from servicebus.errors import Reject, Retry, StoreError
from servicebus.handling.timeouts import Watchdog
from servicebus.model.stored import RunState
from servicebus.testing.handling import RunnerRig
from servicebus.wire.protocol import Kind

TOPIC = "orders"


def calls_into(seen):
    def handle(payload, message):
        seen.append((payload, message.attempt))
    return handle


def failing(seen, exc):
    def handle(payload, message):
        seen.append(message.attempt)
        raise exc
    return handle


# --- handled -------------------------------------------------------------------------------


def test_a_handled_message_moves_from_incoming_to_handled_in_one_write_and_runs_once():
    rig = RunnerRig()
    seen = []
    rig.add(TOPIC, calls_into(seen))
    rig.clock.advance(3)
    mid = rig.receive(TOPIC, {"n": 1})

    assert rig.run(mid) is None
    assert seen == [({"n": 1}, 1)]
    assert mid not in rig.store.incoming and mid not in rig.store.runstate
    assert rig.store.handled == {mid: 3000}  # stamped with the bus clock (the dedupe window's)
    assert rig.store.ops("complete_incoming", mid) == [(mid, 3000)]
    assert rig.log.names(mid) == ["handled"]
    assert not rig.store.letters


def test_the_write_that_finishes_a_message_marks_the_next_one_started():
    rig = RunnerRig()
    seen = []
    rig.add(TOPIC, calls_into(seen))
    first, second = rig.receive(TOPIC, 1), rig.receive(TOPIC, 2)
    nxt = rig.item(second)  # as the dispatcher took it, before either ran

    assert rig.runner.run(rig.item(first), False, nxt) == (None, True)
    written = rig.store.write_of("complete_incoming", first)
    assert ("put_runstate", (second, RunState(1, [], None, 0))) in written
    writes = len(rig.store.written)
    assert rig.runner.run(nxt, True) == (None, False)
    assert len(rig.store.written) == writes + 1  # its completion only: no start of its own
    assert seen == [(1, 1), (2, 1)]


# --- the start marker, and runs that never finished ------------------------------------------


def test_a_run_the_process_died_in_counts_as_an_attempt_and_the_last_is_a_dead_letter_unrun():
    rig = RunnerRig(max_attempts=3)
    runs = []

    def crashes(payload, message):  # os._exit, a segfault, the OOM killer: nothing after lands
        runs.append(rig.store.get_runstate(message.id))  # the marker is in before it runs
        rig.store.crash()

    rig.add(TOPIC, crashes)
    mid = rig.receive(TOPIC, "poison")
    for attempt in (1, 2, 3):
        with pytest.raises(StoreError):
            rig.run(mid)
        rig.restart()
        assert rig.store.get_runstate(mid) == RunState(attempt, [], None, 0)

    assert rig.run(mid) is None
    assert runs == [RunState(a, [], None, 0) for a in (1, 2, 3)]  # and no fourth run
    letter = rig.store.letters[mid]
    assert (letter["reason"], letter["attempts"]) == ("handler_crashed", 3)
    assert letter["error"] == "the process ended during each of its 3 run(s) of the handler"
    assert mid not in rig.store.incoming and mid not in rig.store.runstate


# --- failed: retried with backoff, then a dead letter -----------------------------------------


def test_a_raising_handler_is_retried_with_backoff_then_dead_lettered_naming_the_exception():
    rig = RunnerRig(max_attempts=3, retry_initial=1.0, retry_max=10.0)
    seen = []
    rig.add(TOPIC, failing(seen, ValueError("no stock")))
    mid = rig.receive(TOPIC, "order")
    record = rig.store.incoming[mid]

    for attempt, base in ((1, 1.0), (2, 2.0)):  # 1 s, then doubled; +/-20 % jitter
        before, wall = time.monotonic(), rig.clock.wall_ms()
        retry_at = rig.run(mid)
        assert retry_at is not None and before + 0.8 * base <= retry_at <= time.monotonic() + 1.2 * base
        state = rig.store.runstate[mid]
        assert state[:3] == (attempt, [], "ValueError: no stock")
        assert wall + 800 * base <= state.next_ms <= wall + 1200 * base
        assert mid in rig.store.incoming and not rig.store.letters
        rig.clock.advance(base * 1.2)

    assert rig.run(mid) is None
    assert seen == [1, 2, 3]
    letter = rig.store.letters[mid]
    assert (letter["reason"], letter["error"], letter["attempts"]) == ("handler_failed", "ValueError: no stock", 3)
    assert (letter["topic"], letter["record"]) == (TOPIC, record)  # kept for a replay
    assert mid not in rig.store.incoming and mid not in rig.store.runstate
    assert rig.log.names(mid) == ["handler_failed", "retried", "handler_failed", "retried",
                                  "handler_failed", "deadlettered"]


def test_retry_after_sets_the_delay_of_the_next_attempt():
    rig = RunnerRig(retry_initial=0.1)
    rig.add(TOPIC, failing([], Retry("supplier busy", after=7)))
    mid = rig.receive(TOPIC)
    wall = rig.clock.wall_ms()

    before = time.monotonic()
    retry_at = rig.run(mid)
    assert retry_at is not None and before + 7 <= retry_at <= time.monotonic() + 7
    assert rig.store.runstate[mid] == RunState(1, [], "Retry: supplier busy", wall + 7000)


def test_reject_makes_a_dead_letter_at_once():
    rig = RunnerRig(max_attempts=5)
    seen = []
    rig.add(TOPIC, failing(seen, Reject("no such plan: platinum")))
    mid = rig.receive(TOPIC)

    assert rig.run(mid) is None
    assert seen == [1]
    letter = rig.store.letters[mid]
    assert (letter["reason"], letter["error"], letter["attempts"]) == ("rejected", "Reject: no such plan: platinum", 1)
    assert mid not in rig.store.incoming and mid not in rig.store.runstate


def test_a_handler_raising_system_exit_has_failed_that_attempt_like_any_other():
    rig = RunnerRig(max_attempts=2)
    seen = []
    rig.add(TOPIC, failing(seen, SystemExit("bye")))
    mid = rig.receive(TOPIC)

    assert rig.run(mid) is not None  # not raised: retried
    assert rig.store.runstate[mid][:3] == (1, [], "SystemExit: bye")
    assert rig.run(mid) is None
    assert seen == [1, 2]
    assert (rig.store.letters[mid]["reason"], rig.store.letters[mid]["error"]) == ("handler_failed", "SystemExit: bye")


def test_a_handler_past_its_timeout_fails_that_attempt_with_handler_timeout():
    rig = RunnerRig()
    watchdog = Watchdog()
    finished = []

    def slow(payload, message):
        until = time.monotonic() + 2.0  # interrupted long before, unless the watchdog is broken
        while time.monotonic() < until:
            pass
        finished.append(message.id)

    rig.add(TOPIC, watchdog.limit(slow, 0.01, "slow"))
    mid = rig.receive(TOPIC)
    try:
        assert rig.run(mid) is not None
    finally:
        watchdog.close()
    assert not finished
    assert rig.store.runstate[mid][:3] == (1, [], "HandlerTimeout: handler slow ran longer than its timeout of 0.01s")


# --- expired ----------------------------------------------------------------------------------


def test_an_expired_message_becomes_a_dead_letter_expired_without_running():
    rig = RunnerRig()
    seen = []
    rig.add(TOPIC, calls_into(seen))
    mid = rig.receive(TOPIC, ttl=1.0)
    rig.clock.advance(1.5)

    assert rig.run(mid) is None
    assert not seen
    assert rig.store.letters[mid]["reason"] == "expired"
    assert mid not in rig.store.incoming and mid not in rig.store.handled
    assert rig.log.names(mid) == ["expired"]


def test_an_expired_request_is_dropped_not_dead_lettered_and_counted():
    rig = RunnerRig()
    seen = []
    rig.add("quote", calls_into(seen), kind=Kind.COMMAND)
    mid = rig.request("quote", ttl=1.0)
    rig.clock.advance(1.5)

    assert rig.run(mid) is None
    assert not seen and not rig.store.letters and not rig.replies
    assert mid in rig.store.handled and mid not in rig.store.incoming
    assert rig.runner.requests_expired == 1
    assert [(e.name, e.error) for e in rig.log.seen] == [("dropped", "request_expired")]


# --- requests: the reply is written with the completion ---------------------------------------


def test_a_requests_return_value_is_its_reply_stored_in_the_write_that_completes_it():
    rig = RunnerRig()
    rig.add("quote", lambda payload, message: {"price": payload["qty"] * 3}, kind=Kind.COMMAND)
    rig.clock.advance(2)
    mid = rig.request("quote", {"qty": 4})

    assert rig.run(mid) is None
    assert rig.reply(mid) == {"ok": True, "value": {"price": 12}}
    (args,) = rig.store.ops("complete_with_reply", mid)
    assert args[:2] == (mid, 2000) and not rig.store.ops("complete_incoming")
    reply = rig.store.reply[mid]
    assert (reply.reply_to, reply.command, reply.correlation_id) == ("ipc://peer", "quote", "c0ffee000000-1")
    assert rig.replies == [(mid, reply)]  # handed to the engine to send
    assert mid in rig.store.handled and mid not in rig.store.incoming


@pytest.mark.parametrize("raised", [ValueError("out of stock"), SystemExit("out of stock")])
def test_a_raising_request_handler_replies_an_error_with_type_and_message(raised):
    rig = RunnerRig(max_attempts=5)
    seen = []
    rig.add("quote", failing(seen, raised), kind=Kind.COMMAND)
    mid = rig.request("quote")

    assert rig.run(mid) is None  # not retried: the caller decides whether to ask again
    assert seen == [1]
    assert rig.reply(mid) == {"ok": False, "type": type(raised).__name__, "message": "out of stock"}
    assert mid in rig.store.handled and not rig.store.letters


@pytest.mark.parametrize("value,error", [
    (object(), ("TypeError", "cannot be encoded")),
    ("x" * 2000, ("ValueError", "exceeds max_payload")),
], ids=["unencodable", "too-large"])
def test_a_reply_that_cannot_be_encoded_or_is_too_large_becomes_an_error_reply(value, error):
    rig = RunnerRig(max_payload=1024)
    rig.add("quote", lambda payload, message: value, kind=Kind.COMMAND)
    mid = rig.request("quote")

    assert rig.run(mid) is None
    reply = rig.reply(mid)
    assert (reply["ok"], reply["type"]) == (False, error[0]) and error[1] in reply["message"]
    assert len(rig.store.reply[mid].body) <= 1024
    assert mid in rig.store.handled


# --- parked: no handler yet ------------------------------------------------------------------


def test_a_message_with_no_handler_is_parked_stored_not_run_not_dead():
    rig = RunnerRig()
    rig.add("other", calls_into([]))
    mid = rig.receive(TOPIC, ttl=60)

    assert rig.run(mid) is None
    assert rig.parked == [((int(Kind.EVENT), TOPIC), rig.clock.wall_ms() + 60_000)]
    assert mid in rig.store.incoming and mid not in rig.store.runstate
    assert not rig.store.written and not rig.store.letters and not rig.store.handled


# --- several handlers on a topic ----------------------------------------------------------------


def test_with_several_handlers_on_a_topic_a_retry_runs_only_those_not_done():
    rig = RunnerRig()
    ran = []

    def ship(payload, message):
        ran.append(("ship", message.attempt))

    def bill(payload, message):
        ran.append(("bill", message.attempt))
        if message.attempt == 1:
            raise ConnectionError("billing down")

    def audit(payload, message):
        ran.append(("audit", message.attempt))

    rig.add(TOPIC, ship, name="ship")
    rig.add(TOPIC, bill, name="bill")
    rig.add(TOPIC, audit, name="audit")
    mid = rig.receive(TOPIC)

    assert rig.run(mid) is not None
    assert rig.store.runstate[mid][:3] == (1, ["ship", "audit"], "ConnectionError: billing down")
    assert rig.run(mid) is None
    assert ran == [("ship", 1), ("bill", 1), ("audit", 1), ("bill", 2)]
    assert mid in rig.store.handled
