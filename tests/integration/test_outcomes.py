"""A handler says what should happen to its message (issue 15): ``Retry(after=)`` runs it
again later, ``Reject(reason)`` makes it a dead letter at once."""

from __future__ import annotations

import time

import pytest

from servicebus import Reject, Retry
from servicebus.testing import free_address, wait_until

TOPIC = "user.signup"


def pair(make_bus, **sub_options):
    pub = make_bus("pub")
    sub = make_bus("sub", free_address(), **sub_options)
    return pub, sub


def test_a_handler_that_rejects_its_message_makes_it_a_dead_letter_at_once(make_bus):
    pub, sub = pair(make_bus, max_attempts=5, retry_initial=0.01)
    attempts = []

    @sub.every(TOPIC)
    def validate(payload, message):
        attempts.append(message.attempt)
        raise Reject(f"no such plan: {payload['plan']}")

    sub.subscribe(pub.address, TOPIC, wait=10)
    mid = pub.publish(TOPIC, {"plan": "platinum"})
    wait_until(lambda: sub.status().deadletters == 1, 10)
    assert attempts == [1]
    letter = sub.deadletters()[0]
    assert (letter.id, letter.reason, letter.error) == (mid, "rejected", "Reject: no such plan: platinum")
    assert sub.drain(5) and attempts == [1]


def test_a_handler_that_asks_to_retry_runs_again_after_the_delay_it_named(make_bus):
    pub, sub = pair(make_bus, retry_initial=0.01, retry_max=0.02)
    runs: list[float] = []

    @sub.every(TOPIC)
    def later(payload, message):
        runs.append(time.monotonic())
        if message.attempt == 1:
            raise Retry("the mail server asked us to wait", after=0.5)

    sub.subscribe(pub.address, TOPIC, wait=10)
    pub.publish(TOPIC, 1)
    wait_until(lambda: len(runs) == 2 and sub.drain(0.1), 10)
    assert runs[1] - runs[0] >= 0.5  # not the 10-20 ms backoff
    assert sub.status().deadletters == 0


def test_retry_counts_as_an_attempt_so_a_message_cannot_be_postponed_forever(make_bus):
    pub, sub = pair(make_bus, max_attempts=3)
    attempts = []

    @sub.every(TOPIC)
    def never(payload, message):
        attempts.append(message.attempt)
        raise Retry(after=0.01)

    sub.subscribe(pub.address, TOPIC, wait=10)
    pub.publish(TOPIC, 1)
    wait_until(lambda: sub.status().deadletters == 1, 10)
    assert attempts == [1, 2, 3]
    assert sub.deadletters()[0].reason == "handler_failed"


@pytest.mark.parametrize("after", [-1, "soon", True])
def test_retry_refuses_a_delay_that_is_not_seconds(after):
    with pytest.raises(ValueError, match="seconds"):
        Retry(after=after)


def busy(seconds: float) -> None:
    start = time.monotonic()
    while time.monotonic() - start < seconds:  # Python bytecode all along: interruptible
        pass


def test_a_handler_past_its_timeout_is_interrupted_and_counted_as_a_failed_attempt(make_bus):
    pub, sub = pair(make_bus, max_attempts=2, retry_initial=0.01, retry_max=0.02)
    runs = []

    @sub.every(TOPIC, timeout=0.2)
    def hangs(payload, message):
        runs.append(message.attempt)
        busy(10)  # far past the limit; bounded, should the limit not work

    sub.subscribe(pub.address, TOPIC, wait=10)
    started = time.monotonic()
    pub.publish(TOPIC, 1)
    wait_until(lambda: sub.status().deadletters == 1, 10)
    assert time.monotonic() - started < 5 and runs == [1, 2]
    letter = sub.deadletters()[0]
    assert letter.reason == "handler_failed"
    assert letter.error.startswith("HandlerTimeout: handler") and "0.2s" in letter.error


def test_a_handler_within_its_timeout_and_the_code_after_it_are_not_touched(make_bus):
    pub, sub = pair(make_bus)
    done = []

    @sub.every(TOPIC, timeout=1.0)
    def quick(payload, message):
        busy(0.01)
        done.append(payload)

    sub.subscribe(pub.address, TOPIC, wait=10)
    pub.publish_many(TOPIC, list(range(50)))
    wait_until(lambda: len(done) >= 50 and sub.drain(0.1), 20)
    assert sorted(done) == list(range(50))  # each ran once: none interrupted, none retried
    assert sub.status().deadletters == 0 and sub.status().running


def test_a_request_handler_past_its_timeout_answers_the_caller_with_the_timeout(make_bus):
    from servicebus import RemoteError

    server, client = make_bus("server"), make_bus("client")

    @server.handle("slow", timeout=0.2)
    def slow(payload, message):
        busy(10)

    with pytest.raises(RemoteError, match="HandlerTimeout"):
        client.request(server.address, "slow", 1, timeout=10)


@pytest.mark.parametrize("timeout", [0, -1, "1", True])
def test_a_timeout_that_is_not_positive_seconds_is_refused(make_bus, timeout):
    bus = make_bus("a")
    with pytest.raises(ValueError, match="timeout"):
        bus.every(TOPIC, lambda p, m: None, timeout=timeout)


class Stop(BaseException):
    """Neither an Exception nor SystemExit: the odd BaseException a library may raise."""


@pytest.mark.parametrize("raised", [SystemExit(3), KeyboardInterrupt(), Stop("odd")],
                         ids=["SystemExit", "KeyboardInterrupt", "BaseException"])
def test_a_handler_raising_a_base_exception_has_failed_that_attempt_and_runs_again(make_bus, raised):
    pub, sub = pair(make_bus, retry_initial=0.01, retry_max=0.02)
    attempts = []

    @sub.every(TOPIC)
    def exits_once(payload, message):
        attempts.append(message.attempt)
        if message.attempt == 1:
            raise raised

    sub.subscribe(pub.address, TOPIC, wait=10)
    pub.publish(TOPIC, 1)
    wait_until(lambda: attempts == [1, 2], 10)
    assert sub.drain(10)
    status = sub.status()
    assert (status.incoming, status.deadletters) == (0, 0)
    assert attempts == [1, 2]


def test_a_handler_that_always_raises_system_exit_becomes_a_dead_letter_naming_it(make_bus):
    pub, sub = pair(make_bus, max_attempts=3, retry_initial=0.01, retry_max=0.02)
    attempts = []

    @sub.every(TOPIC)
    def exits(payload, message):
        attempts.append(message.attempt)
        raise SystemExit("shutting down from a handler")

    sub.subscribe(pub.address, TOPIC, wait=10)
    pub.publish(TOPIC, 1)
    wait_until(lambda: sub.status().deadletters == 1, 10)
    assert attempts == [1, 2, 3]
    letter = sub.deadletters()[0]
    assert (letter.reason, letter.error) == ("handler_failed", "SystemExit: shutting down from a handler")
    assert sub.drain(5) and sub.status().incoming == 0


def test_drain_waits_for_a_message_whose_handler_raised_system_exit(make_bus):
    pub, sub = pair(make_bus, retry_initial=0.5, retry_max=0.5)
    attempts = []

    @sub.every(TOPIC)
    def exits_once(payload, message):
        attempts.append(message.attempt)
        if message.attempt == 1:
            raise SystemExit(1)

    sub.subscribe(pub.address, TOPIC, wait=10)
    pub.publish(TOPIC, 1)
    wait_until(lambda: attempts == [1], 10)
    assert not sub.drain(0.1)  # its retry is still owed
    assert sub.status().incoming == 1
    assert sub.drain(10) and attempts == [1, 2]


def test_an_ordered_lane_waits_for_a_message_whose_handler_raised_system_exit(make_bus):
    pub, sub = pair(make_bus, retry_initial=0.05, retry_max=0.05)
    order = []

    @sub.every(TOPIC)
    def record(payload, message):
        if payload == 0 and message.attempt == 1:
            raise SystemExit(1)
        order.append(payload)

    sub.subscribe(pub.address, TOPIC, wait=10, ordered=True)
    pub.publish_many(TOPIC, list(range(10)))
    wait_until(lambda: len(order) == 10, 10)
    assert order == list(range(10))


def test_a_request_handler_raising_system_exit_replies_with_a_remote_error(make_bus):
    from servicebus import RemoteError

    server = make_bus("server")
    client = make_bus("client", free_address())

    @server.handle("quote")
    def quote(payload, message):
        raise SystemExit("no quotes today")

    with pytest.raises(RemoteError, match="SystemExit"):
        client.request(server.address, "quote", {}, timeout=10)
    assert server.drain(10) and server.status().incoming == 0


def test_each_handler_follows_its_own_retry_policy_on_a_real_bus(make_bus):
    pub, sub = pair(make_bus, max_attempts=5, retry_initial=0.01, retry_max=0.02)
    runs: dict[str, list[int]] = {"strict": [], "patient": [], "picky": []}

    @sub.every("orders.strict", max_attempts=2)
    def strict(payload, message):
        runs["strict"].append(message.attempt)
        raise ValueError("always")

    @sub.every("orders.patient", max_attempts=7, backoff=lambda attempt: 0.01)
    def patient(payload, message):
        runs["patient"].append(message.attempt)
        if message.attempt < 7:
            raise TimeoutError("not yet")

    @sub.every("orders.picky", retry_on=TimeoutError)
    def picky(payload, message):
        runs["picky"].append(message.attempt)
        raise KeyError("no such customer")

    sub.subscribe(pub.address, "orders.*", wait=10)
    for topic in ("orders.strict", "orders.patient", "orders.picky"):
        pub.publish(topic, 1)
    wait_until(lambda: sub.status().deadletters == 2 and sub.drain(0.1), 20)
    assert runs == {"strict": [1, 2], "patient": [1, 2, 3, 4, 5, 6, 7], "picky": [1]}
    letters = {d.topic: (d.reason, d.attempts) for d in sub.deadletters()}
    assert letters == {"orders.strict": ("handler_failed", 2), "orders.picky": ("rejected", 1)}
