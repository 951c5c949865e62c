"""Segments (store format 3) on real buses: what is about one message of a segment (its
handler fails, its payload is too large for the receiver) goes on by itself, and nothing
of the rest of its segment is lost or handed over under the wrong id."""

from __future__ import annotations

import threading
from collections import Counter

from servicebus import Retry
from servicebus.testing import wait_until

TOPIC = "order.placed"


def test_a_segments_first_message_that_fails_runs_again_and_the_rest_goes_on(make_bus):
    pub = make_bus("pub")
    sub = make_bus("sub", retry_initial=0.05)
    runs: Counter = Counter()
    lock = threading.Lock()

    def handler(payload, message):
        with lock:
            runs[(payload, message.id)] += 1
            first = runs[(payload, message.id)] == 1
        if payload == 0 and first:
            raise RuntimeError("the first message fails its first run")

    sub.every(TOPIC, handler)
    sub.subscribe(pub.address, TOPIC, wait=10)
    ids = pub.publish_many(TOPIC, [0, 1, 2])
    wait_until(lambda: len(runs) == 3 and runs[(0, ids[0])] == 2, 10,
               message=lambda: f"runs {dict(runs)}")
    assert pub.drain(5) and sub.drain(5)
    assert runs == {(0, ids[0]): 2, (1, ids[1]): 1, (2, ids[2]): 1}
    assert sub.status().incoming == 0


def test_a_segments_first_message_waiting_for_its_retry_outlives_a_restart(make_bus):
    """Its retry is due after the bus stopped: it must still be in the store, and run once
    the bus is back (it was overwritten by its own segment's finishing write, the segment's
    key being its id, and refused as a duplicate when sent again)."""
    pub = make_bus("pub")
    sub = make_bus("sub")
    got: list = []

    def handler(payload, message):
        if payload == 0 and message.attempt == 1:
            raise Retry(after=1.0)
        got.append((payload, message.id, message.attempt))

    sub.every(TOPIC, handler)
    sub.subscribe(pub.address, TOPIC, wait=10)
    ids = pub.publish_many(TOPIC, [0, 1, 2])
    wait_until(lambda: len(got) == 2, 10, message=lambda: f"got {got}")
    assert sub.status().incoming == 1, "the first message, waiting for its retry"
    sub.close()
    sub = make_bus("sub")
    sub.every(TOPIC, handler)
    wait_until(lambda: len(got) == 3, 10, message=lambda: f"got {got}")
    assert sorted(got) == [(0, ids[0], 2), (1, ids[1], 1), (2, ids[2], 1)]
    assert sub.status().incoming == 0


def test_a_segment_whose_first_message_is_too_large_for_its_receiver_hands_over_the_rest_under_their_ids(make_bus):
    pub = make_bus("pub", max_payload=100_000)
    sub = make_bus("sub", max_payload=1000)
    got = []
    sub.every(TOPIC, lambda payload, message: got.append((message.id, payload)))
    sub.subscribe(pub.address, TOPIC, wait=10)
    wait_until(lambda: any(p.up for p in pub.status().peers if p.address == sub.address), 10)  # its max_payload
    big, small, other = pub.publish_many(TOPIC, ["x" * 5000, "small", "other"])
    big2, last = pub.publish_many(TOPIC, ["y" * 5000, "last"])
    wait_until(lambda: len(got) == 3, 10, message=lambda: f"got {got}")
    assert pub.drain(5) and sub.drain(5)
    assert sorted(got) == sorted([(small, "small"), (other, "other"), (last, "last")])
    assert {letter.id for letter in pub.deadletters()} == {big, big2}
