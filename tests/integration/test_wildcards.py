"""Subject wildcards (issue 15, NATS rules): ``orders.*`` matches one token, ``orders.>``
one or more trailing tokens; ``*`` and ``>`` are reserved in published topics."""

from __future__ import annotations

import functools
from collections import Counter

import pytest

from servicebus.testing import free_address, wait_until
from servicebus.wire.topics import matches


@pytest.mark.parametrize("pattern, topic, expected", [
    ("orders.*", "orders.created", True),
    ("orders.*", "orders", False),
    ("orders.*", "orders.eu.created", False),
    ("orders.>", "orders.eu.created", True),
    ("orders.>", "orders.created", True),
    ("orders.>", "orders", False),
    ("*.created", "orders.created", True),
    ("*.created", "orders.eu.created", False),
    (">", "anything.at.all", True),
    ("orders.created", "orders.created", True),
])
def test_patterns_match_as_nats_subjects_do(pattern, topic, expected):
    assert matches(pattern, topic) is expected


TOPICS = ["orders.created", "orders.eu.created", "orders", "payments.created"]


@pytest.mark.parametrize("pattern, expected", [
    ("orders.*", {"orders.created"}),
    ("orders.>", {"orders.created", "orders.eu.created"}),
    ("*.created", {"orders.created", "payments.created"}),
])
def test_a_pattern_subscription_gets_every_matching_topic_and_nothing_else(make_bus, pattern, expected):
    pub, sub = make_bus("pub"), make_bus("sub")
    got = []
    sub.every(pattern, lambda p, m: got.append(m.topic), name="by-pattern")
    sub.subscribe(pub.address, pattern, wait=10)
    for topic in TOPICS:
        pub.publish(topic, topic)
    assert pub.drain(10) and sub.drain(10)
    assert sorted(got) == sorted(expected)


def test_a_topic_and_a_pattern_subscribed_together_run_each_handler_once(make_bus):
    pub, sub = make_bus("pub"), make_bus("sub")
    runs: Counter = Counter()
    sub.every("orders.created", lambda p, m: runs.update(["exact"]), name="exact")
    sub.every("orders.*", lambda p, m: runs.update(["pattern"]), name="pattern")
    sub.subscribe(pub.address, "orders.created", wait=10)
    sub.subscribe(pub.address, "orders.*", wait=10)
    pub.publish("orders.created", 1)  # stored for both subscriptions: received twice, once handled
    pub.publish("orders.deleted", 2)
    assert pub.drain(10) and sub.drain(10)
    assert runs == Counter({"exact": 1, "pattern": 2})


def test_a_pattern_subscription_survives_a_publisher_restart_and_ends_with_unsubscribe(make_bus):
    address = free_address()
    pub, sub = make_bus("pub", address=address), make_bus("sub")
    got = []
    sub.every("orders.>", lambda p, m: got.append(p), name="orders")
    sub.subscribe(pub.address, "orders.>", wait=10)
    pub.close()
    pub = make_bus("pub-again", address=address, datadir=pub.datadir)
    pub.publish("orders.eu.created", 1)
    wait_until(lambda: got == [1], 10)
    sub.unsubscribe(pub.address, "orders.>", wait=10)
    pub.publish("orders.eu.created", 2)  # nobody subscribed any more
    assert pub.drain(10)
    wait_until(lambda: pub.status().outgoing == 0, 10)
    assert got == [1]


def test_messages_waiting_for_a_handler_are_run_when_a_matching_pattern_handler_registers(make_bus):
    pub, sub = make_bus("pub"), make_bus("sub")
    sub.subscribe(pub.address, "orders.*", wait=10)
    pub.publish_many("orders.created", [1, 2, 3])
    wait_until(lambda: sub.status().incoming == 3, 10)  # stored, parked: nobody handles them
    got = []
    sub.every("orders.*", lambda p, m: got.append(p), name="late")
    wait_until(lambda: sorted(got) == [1, 2, 3], 10)


@pytest.mark.parametrize("topic", ["orders.*", "orders.>", "*", "a.*.b"])
def test_wildcard_tokens_are_reserved_in_published_topics(make_bus, topic):
    with pytest.raises(ValueError, match="reserved"):
        make_bus("pub").publish(topic, 1)


@pytest.mark.parametrize("pattern", ["orders.>.x", "orders..*"])
def test_a_malformed_pattern_is_refused(make_bus, pattern):
    with pytest.raises(ValueError, match="pattern|last token"):
        make_bus("sub").subscribe(free_address(), pattern)


def test_pattern_handlers_need_names_no_other_handler_has(make_bus):
    sub = make_bus("sub")
    sub.every("orders.*", lambda p, m: None, name="a")
    with pytest.raises(ValueError, match="stable name"):
        sub.every("orders.created", functools.partial(print))  # no stable name of its own
    with pytest.raises(ValueError, match="stable name"):
        sub.every("orders.>", lambda p, m: None, name="a")
