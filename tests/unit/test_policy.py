"""Per-handler retry policy (handling/policy.py): ``every(topic, fn, max_attempts=,
backoff=, retry_on=, dead_letter_on=)`` on the handler side, without sockets (RunnerRig),
on segments of several messages, and on the StubBus."""

from __future__ import annotations

import time

import pytest

from servicebus.handling.policy import make_policy
from servicebus.testing import StubBus
from servicebus.testing.handling import RunnerRig

TOPIC = "orders"


def failing(seen, exc):
    def handle(payload, message):
        seen.append(message.attempt)
        raise exc
    return handle


def test_a_handlers_own_max_attempts_dead_letters_it_before_the_buses():
    rig = RunnerRig(max_attempts=5, retry_initial=0.01, retry_max=0.01)
    seen = []
    rig.add(TOPIC, failing(seen, ValueError("no stock")), max_attempts=2)
    mid = rig.receive(TOPIC, "order")
    assert rig.run(mid) is not None
    rig.clock.advance(1)
    assert rig.run(mid) is None
    assert seen == [1, 2] and rig.store.letters[mid]["attempts"] == 2
    assert rig.store.letters[mid]["reason"] == "handler_failed"


def test_a_handlers_own_max_attempts_may_be_more_than_the_buses_and_the_crash_check_allows_it():
    rig = RunnerRig(max_attempts=1, retry_initial=0.01, retry_max=0.01)
    seen = []
    rig.add(TOPIC, failing(seen, ValueError("flaky")), max_attempts=3)
    mid = rig.receive(TOPIC, "order")
    for _ in range(2):
        assert rig.run(mid) is not None
        rig.clock.advance(1)
    assert rig.run(mid) is None and seen == [1, 2, 3]


def test_a_handlers_backoff_sets_the_delay_of_its_retry():
    rig = RunnerRig(retry_initial=0.1, retry_max=0.1)
    rig.add(TOPIC, failing([], ValueError("later")), backoff=(30.0, 60.0))
    mid = rig.receive(TOPIC)
    before = time.monotonic()
    retry_at = rig.run(mid)
    assert retry_at is not None and before + 24 <= retry_at <= time.monotonic() + 36
    rig2 = RunnerRig()
    rig2.add(TOPIC, failing([], ValueError("later")), backoff=lambda attempt: 7.0 * attempt)
    mid2 = rig2.receive(TOPIC)
    before = time.monotonic()
    retry_at = rig2.run(mid2)
    assert retry_at is not None and before + 7 <= retry_at <= time.monotonic() + 7


@pytest.mark.parametrize("policy", [{"dead_letter_on": KeyError}, {"retry_on": (TimeoutError, ConnectionError)}])
def test_an_exception_the_handler_gives_up_on_is_a_dead_letter_at_once(policy):
    rig = RunnerRig(max_attempts=5)
    seen = []
    rig.add(TOPIC, failing(seen, KeyError("no such customer")), **policy)
    mid = rig.receive(TOPIC)
    assert rig.run(mid) is None and seen == [1]
    letter = rig.store.letters[mid]
    assert letter["reason"] == "rejected" and letter["attempts"] == 1
    assert "KeyError" in letter["error"] and "not retried" in letter["error"]


def test_an_exception_in_retry_on_is_retried():
    rig = RunnerRig(max_attempts=5)
    rig.add(TOPIC, failing([], TimeoutError("slow")), retry_on=TimeoutError)
    mid = rig.receive(TOPIC)
    assert rig.run(mid) is not None and not rig.store.letters


def test_in_a_segment_a_message_its_handler_gives_up_on_is_a_dead_letter_and_the_rest_are_handled():
    rig = RunnerRig(max_attempts=5)
    seen = []

    def handle(payload, message):
        seen.append(payload)
        if payload == 2:
            raise KeyError("bad")

    rig.add(TOPIC, handle, dead_letter_on=KeyError)
    key, ids = rig.receive_segment(TOPIC, 1, 2, 3)
    assert rig.run(key) is None
    assert seen == [1, 2, 3] and list(rig.store.letters) == [ids[1]]
    assert rig.store.letters[ids[1]]["reason"] == "rejected"


def test_in_a_segment_a_handlers_own_max_attempts_counts():
    rig = RunnerRig(max_attempts=5)
    rig.add(TOPIC, failing([], ValueError("x")), max_attempts=1)
    key, ids = rig.receive_segment(TOPIC, 1, 2)
    rig.run(key)
    assert sorted(rig.store.letters) == sorted(ids)


def test_with_two_handlers_the_one_that_failed_judges_the_message():
    rig = RunnerRig(max_attempts=5, retry_initial=0.01, retry_max=0.01)
    ran = []
    rig.add(TOPIC, lambda p, m: ran.append("ok"), name="ok", max_attempts=9)
    rig.add(TOPIC, failing([], ValueError("x")), name="strict", max_attempts=1)
    mid = rig.receive(TOPIC)
    assert rig.run(mid) is None and rig.store.letters[mid]["attempts"] == 1


@pytest.mark.parametrize("bad", [{"max_attempts": 0}, {"max_attempts": True}, {"backoff": (5, 1)},
                                 {"backoff": 3}, {"retry_on": "KeyError"}, {"dead_letter_on": (KeyError, 1)}])
def test_a_bad_policy_is_refused_at_registration(bad):
    with pytest.raises((ValueError, TypeError)):
        make_policy(**bad)
    with pytest.raises((ValueError, TypeError)):
        StubBus().every(TOPIC, lambda p, m: None, **bad)


def test_a_backoff_function_returning_nonsense_falls_back_to_the_buses_backoff():
    policy = make_policy(backoff=lambda attempt: float("nan"))
    assert 0.08 <= policy.delay(1, 0.1, 1.0) <= 0.12


def test_the_stub_follows_each_handlers_policy():
    stub = StubBus(max_attempts=5)
    runs = []

    def flaky(payload, message):
        runs.append(message.attempt)
        raise TimeoutError("slow")

    stub.every("a", flaky, max_attempts=2, backoff=(3.0, 3.0))
    stub.every("b", failing([], KeyError("gone")), dead_letter_on=KeyError)
    stub.publish("a", 1)
    stub.publish("b", 1)
    stub.drain()
    assert runs == [1] and [d.reason for d in stub.deadletters()] == ["rejected"]
    stub.advance(2.9)
    assert not stub.drain() and runs == [1]
    stub.advance(0.1)
    assert stub.drain() and runs == [1, 2]
    assert [d.reason for d in stub.deadletters()] == ["rejected", "handler_failed"]


@pytest.mark.parametrize("backoff", [lambda attempt: 1e12, lambda attempt: float("inf"), lambda attempt: 1 / 0,
                                     lambda attempt: "soon"])
def test_a_backoff_function_that_raises_or_returns_nonsense_gives_a_bounded_delay(backoff):
    delay = make_policy(backoff=backoff).delay(1, 0.1, 1.0)
    assert 0 <= delay <= 30 * 86400  # never a stuck message, never a timeout a thread cannot wait


@pytest.mark.parametrize("backoff", [lambda attempt: 1e12, lambda attempt: 1 / 0, lambda attempt: float("inf")])
def test_on_the_runner_a_misbehaving_backoff_function_still_retries_then_dead_letters(backoff):
    rig = RunnerRig(max_attempts=2)
    rig.add(TOPIC, failing([], ValueError("x")), backoff=backoff)
    mid = rig.receive(TOPIC)
    assert rig.run(mid) is not None  # a retry is scheduled, whatever the function did
    rig.clock.advance(31 * 86400)
    assert rig.run(mid) is None and rig.store.letters[mid]["reason"] == "handler_failed"
