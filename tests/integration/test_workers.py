"""Workers on real buses: handlers that compute run one at a time (handling/
concurrency.py), but handlers that wait, or hang, never hold the others up."""

from __future__ import annotations

import threading

from servicebus.testing import wait_until

TOPIC = "mail.send"


def test_handlers_that_wait_run_side_by_side_on_every_worker(make_bus):
    pub = make_bus("pub")
    sub = make_bus("sub", workers=6)
    cond = threading.Condition()
    state = {"running": 0, "peak": 0}

    def send_mail(payload, message):  # waits for the others, as a slow network call would
        with cond:
            state["running"] += 1
            state["peak"] = max(state["peak"], state["running"])
            cond.notify_all()
            cond.wait_for(lambda: state["peak"] >= 6, timeout=10)
            state["running"] -= 1

    sub.every(TOPIC, send_mail)
    sub.subscribe(pub.address, TOPIC, wait=10)
    for n in range(6):
        pub.publish(TOPIC, {"n": n})  # six segments: each runs on a worker of its own
    wait_until(lambda: state["peak"] == 6, 10, message=lambda: f"at most {state['peak']} ran at once")
    assert pub.drain(10) and sub.drain(10)


def test_a_hung_handler_does_not_hold_up_the_messages_after_it(make_bus):
    pub = make_bus("pub")
    sub = make_bus("sub", workers=2)
    release = threading.Event()
    done: list[int] = []

    def handler(payload, message):
        if payload == 0:
            release.wait(30)  # hangs until the test ends
        done.append(payload)

    sub.every(TOPIC, handler)
    sub.subscribe(pub.address, TOPIC, wait=10)
    for n in range(20):
        pub.publish(TOPIC, n)
    try:
        wait_until(lambda: sorted(done) == list(range(1, 20)), 10, message=lambda: f"{len(done)} of 19 handled")
    finally:
        release.set()
    wait_until(lambda: len(done) == 20, 10)
