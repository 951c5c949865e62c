"""A peer frozen with SIGSTOP (a hung VM, a stop-the-world pause, a debugger): it keeps its
connections and answers nothing. Real processes, really stopped."""

from __future__ import annotations

from collections import Counter

from servicebus.testing import wait_until

TOPIC = "user.signup"


def handled(*procs) -> Counter:
    counts: Counter = Counter()
    for proc in procs:
        counts.update(proc.done_counts())
    return counts


def test_a_frozen_group_member_has_its_messages_handled_by_the_other(make_bus, bus_process):
    pub = make_bus("pub", ack_timeout=0.5, heartbeat=0.3, peer_timeout=1.5)
    members = [bus_process(name, "--handle", TOPIC, "--subscribe", pub.address, TOPIC,
                           "--group", "billing") for name in ("m1", "m2")]
    for member in members:
        member.start()
    wait_until(lambda: pub.status().subscriptions == 2, 10, message="both members subscribed")
    pub.publish_many(TOPIC, [{"n": n} for n in range(100)])
    wait_until(lambda: len(handled(*members)) == 100, 15, message="the first 100")
    frozen, other = members
    frozen.freeze()
    try:
        pub.publish_many(TOPIC, [{"n": n} for n in range(100, 600)])
        wait_until(lambda: set(range(600)) <= set(handled(*members)), 20,
                   message=lambda: f"{len(handled(*members))} of 600 handled with m1 frozen")
        assert set(range(100, 600)) <= set(other.done_counts()) | set(frozen.done_counts())
    finally:
        frozen.thaw()
    wait_until(lambda: pub.drain(0.1), 20, message="everything acknowledged once m1 is thawed")
    counts = handled(*members)
    twice = [n for n, c in counts.items() if c > 1]
    assert set(counts) == set(range(600))
    assert len(twice) <= pub.counters()["group_reassigned"], twice  # the bound the README states


def test_messages_published_while_the_subscriber_is_frozen_arrive_once_when_it_is_thawed(make_bus, bus_process):
    pub = make_bus("pub", ack_timeout=0.5, heartbeat=0.3, peer_timeout=1.5)
    sub = bus_process("sub", "--handle", TOPIC, "--subscribe", pub.address, TOPIC)
    sub.start()
    wait_until(lambda: pub.status().subscriptions == 1, 10, message="the subscription")
    sub.freeze()
    try:
        ids = pub.publish_many(TOPIC, [{"n": n} for n in range(300)])  # never blocked by it
        assert len(ids) == 300
        wait_until(lambda: not any(p.up for p in pub.status().peers if p.address == sub.address), 10,
                   message="the publisher to see the subscriber down")
        assert pub.status().pending == 300
    finally:
        sub.thaw()
    wait_until(lambda: len(sub.done_counts()) == 300, 20, message=lambda: f"{len(sub.done_counts())} of 300")
    assert set(sub.done_counts().values()) == {1}
    assert pub.drain(10)


def test_a_frozen_publisher_delivers_what_it_stored_once_it_is_thawed(make_bus, bus_process):
    sub = make_bus("sub", heartbeat=0.3, peer_timeout=1.5)
    got: Counter = Counter()
    sub.every(TOPIC, lambda p, m: got.update([p["n"]]))
    pub = bus_process("pub", "--publish", TOPIC, "--count", "20000", "--batch", "100",
                      "--ack-timeout", "0.5")
    pub.start(wait_ready=False)
    sub.subscribe(pub.address, TOPIC, wait=10)
    pub.wait_ready()
    pub.freeze()
    try:
        frozen_at = len(got)
        wait_until(lambda: not any(p.up for p in sub.status().peers if p.address == pub.address), 10,
                   message="the subscriber to see the publisher down")
        assert frozen_at < 20000, "frozen after it had delivered everything: nothing was owed"
    finally:
        pub.thaw()
    wait_until(lambda: len(got) == 20000, 60, message=lambda: f"{len(got)} of 20000")
    assert set(got.values()) == {1}
    assert sorted(got) == list(range(20000))
