"""Backpressure (issue 15): ``max_backlog`` messages owed to one subscriber on one topic,
and what a publish does when a subscriber is at it: ``backlog_policy`` block, raise or
drop_oldest. The subscriber is made slow the simplest way: it is closed."""

from __future__ import annotations

import threading
import time

import pytest

from servicebus import BacklogFull
from servicebus.testing import free_address, wait_until
from ..conftest import subscriber_gone

TOPIC = "orders.created"


def subscriber_down(make_bus, pub):
    """A subscriber that subscribed and then closed: everything for it waits at ``pub``."""
    return subscriber_gone(make_bus, pub, TOPIC)


def test_with_policy_raise_a_publish_beyond_max_backlog_raises_and_stores_nothing(make_bus):
    pub = make_bus("pub", max_backlog=50, backlog_policy="raise")
    address, datadir = subscriber_down(make_bus, pub)
    for n in range(50):
        pub.publish(TOPIC, n)
    wait_until(lambda: pub.status().backlog_full == ((address, TOPIC),), 10)
    with pytest.raises(BacklogFull, match="max_backlog"):
        pub.publish(TOPIC, 50)
    assert pub.status().pending == 50
    assert pub.counters()["backlog_refused"] == 1

    back = make_bus("sub2", address=address, datadir=datadir)
    got = []
    back.every(TOPIC, lambda p, m: got.append(p))
    wait_until(lambda: len(got) == 50 and pub.status().backlog_full == (), 15)
    pub.publish(TOPIC, 51)  # room again
    wait_until(lambda: 51 in got, 10)
    assert sorted(got) == [*range(50), 51]


def test_with_policy_block_a_publish_waits_until_the_subscriber_makes_room(make_bus):
    pub = make_bus("pub", max_backlog=20, backlog_policy="block", backlog_timeout=30)
    address, datadir = subscriber_down(make_bus, pub)
    pub.publish_many(TOPIC, list(range(20)))
    wait_until(lambda: pub.status().backlog_full, 10)
    returned = threading.Event()
    threading.Thread(target=lambda: (pub.publish(TOPIC, 20), returned.set()), daemon=True).start()
    time.sleep(0.5)  # a negative check: the publish must still be waiting after a while
    assert not returned.is_set()
    back = make_bus("sub2", address=address, datadir=datadir)
    got = []
    back.every(TOPIC, lambda p, m: got.append(p))
    wait_until(returned.is_set, 15)
    wait_until(lambda: sorted(got) == list(range(21)), 15)


def test_with_policy_block_a_publish_raises_after_backlog_timeout(make_bus):
    pub = make_bus("pub", max_backlog=5, backlog_policy="block", backlog_timeout=0.5)
    subscriber_down(make_bus, pub)
    pub.publish_many(TOPIC, list(range(5)))
    wait_until(lambda: pub.status().backlog_full, 10)
    began = time.monotonic()
    with pytest.raises(BacklogFull, match=r"waited 0.5s"):
        pub.publish(TOPIC, 5)
    assert time.monotonic() - began >= 0.5


def test_with_policy_drop_oldest_the_oldest_become_dead_letters_and_the_newest_arrive(make_bus):
    pub = make_bus("pub", max_backlog=30, backlog_policy="drop_oldest")
    address, datadir = subscriber_down(make_bus, pub)
    ids = [pub.publish(TOPIC, n) for n in range(100)]
    wait_until(lambda: pub.status().deadletters == 70, 10)
    letters = pub.deadletters()
    assert [d.id for d in letters] == ids[:70]
    assert {(d.reason, d.peer) for d in letters} == {("backlog_full", address)}
    back = make_bus("sub2", address=address, datadir=datadir)
    got = []
    back.every(TOPIC, lambda p, m: got.append(p))
    wait_until(lambda: len(got) == 30 and pub.drain(0.1), 15)
    assert sorted(got) == list(range(70, 100))


def test_the_backlog_is_counted_again_after_a_publisher_restart(make_bus):
    pub_address = free_address()
    pub = make_bus("pub", address=pub_address, max_backlog=10, backlog_policy="raise")
    subscriber_down(make_bus, pub)
    pub.publish_many(TOPIC, list(range(10)))
    pub.close()
    again = make_bus("pub2", address=pub_address, datadir=pub.datadir, max_backlog=10,
                     backlog_policy="raise")
    wait_until(lambda: again.status().backlog_full, 10)
    with pytest.raises(BacklogFull):
        again.publish(TOPIC, 10)


def test_a_subscriber_below_its_backlog_is_not_slowed_by_another_at_it(make_bus):
    pub = make_bus("pub", max_backlog=10, backlog_policy="raise")
    subscriber_down(make_bus, pub)
    live = make_bus("live")
    got = []
    live.every("other.topic", lambda p, m: got.append(p))
    live.subscribe(pub.address, "other.topic", wait=10)
    pub.publish_many(TOPIC, list(range(10)))
    wait_until(lambda: pub.status().backlog_full, 10)
    pub.publish_many("other.topic", list(range(100)))  # another topic: not affected
    wait_until(lambda: len(got) == 100, 10)


@pytest.mark.parametrize("options, error", [
    ({"max_backlog": 0}, "max_backlog must be > 0"),
    ({"max_backlog": 10, "backlog_policy": "wait"}, "backlog_policy must be"),
    ({"backlog_timeout": -1}, "backlog_timeout must be > 0"),
])
def test_bad_backlog_options_are_refused(tmp_path, options, error):
    from servicebus import Bus
    with pytest.raises(ValueError, match=error):
        Bus(free_address(), tmp_path / "x", **options)


def test_the_backlog_limit_holds_per_priority_level(make_bus):
    pub = make_bus("pub", max_backlog=5, backlog_policy="raise")
    subscriber_down(make_bus, pub)
    pub.publish_many(TOPIC, list(range(5)))
    wait_until(lambda: pub.status().backlog_full, 10)
    with pytest.raises(BacklogFull):
        pub.publish(TOPIC, 5)
    for n in range(5):  # level 9 has its own count
        pub.publish(TOPIC, n, priority=9)
    wait_until(lambda: {t for _, t in pub.status().backlog_full} == {TOPIC, TOPIC + " 9"}, 10)
    with pytest.raises(BacklogFull):
        pub.publish(TOPIC, 5, priority=9)
