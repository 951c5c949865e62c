"""Retained streams and start positions (issue 29): a publisher keeps a topic's events for a
time whether or not anyone subscribes, and a subscriber starts from the earliest, a time or
an id, exactly once, across restarts of either side."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from servicebus import Bus
from servicebus.testing import free_address, wait_until

TOPIC = "orders.placed"
CLI = str(Path(sys.executable).parent / "servicebus")


def collector(bus: Bus, topic: str = TOPIC) -> list:
    got: list = []
    bus.every(topic, lambda p, m: got.append(p))
    return got


def test_events_published_before_anyone_subscribed_are_lost_without_retention(make_bus):
    pub = make_bus("pub")
    for n in range(5):
        pub.publish(TOPIC, {"n": n})
    sub = make_bus("sub")
    got = collector(sub)
    sub.subscribe(pub.address, TOPIC, wait=10, start="earliest")
    pub.publish(TOPIC, {"n": 5})
    wait_until(lambda: got, 10)
    assert pub.drain(10) and sub.drain(10)
    assert got == [{"n": 5}]  # the first-start trap: nothing kept, nothing to start from


def test_a_subscriber_that_starts_at_earliest_gets_what_was_published_before_it_then_live(make_bus):
    pub = make_bus("pub", retention=3600)
    early = [pub.publish(TOPIC, {"n": n}) for n in range(12)]
    sub = make_bus("sub")
    got = collector(sub)
    sub.subscribe(pub.address, TOPIC, wait=10, start="earliest", ordered=True)
    pub.publish(TOPIC, {"n": 12})
    wait_until(lambda: len(got) == 13, 10)
    assert [p["n"] for p in got] == list(range(13)) and len(set(early)) == 12  # in publish order
    assert pub.drain(10) and sub.drain(10) and len(got) == 13


def test_the_default_start_is_new_even_when_the_publisher_retains(make_bus):
    pub = make_bus("pub", retention=3600)
    pub.publish(TOPIC, {"n": 0})
    sub = make_bus("sub")
    got = collector(sub)
    sub.subscribe(pub.address, TOPIC, wait=10)
    pub.publish(TOPIC, {"n": 1})
    wait_until(lambda: got, 10)
    assert pub.drain(10) and sub.drain(10) and got == [{"n": 1}]


def test_a_start_at_a_message_id_includes_it_and_a_start_at_a_time_takes_what_came_since(make_bus):
    pub = make_bus("pub", retention=3600)
    ids = [pub.publish(TOPIC, {"n": n}) for n in range(3)]
    wait_until(lambda: time.time() * 1000 > int(ids[-1][:12], 16) + 5, 5, 0.005)
    cut = datetime.now(timezone.utc)
    wait_until(lambda: time.time() * 1000 > cut.timestamp() * 1000 + 5, 5, 0.005)
    later = [pub.publish(TOPIC, {"n": n}) for n in range(3, 5)]
    by_id = make_bus("by-id")
    got_id = collector(by_id)
    by_id.subscribe(pub.address, TOPIC, wait=10, start=ids[1])
    by_time = make_bus("by-time")
    got_time = collector(by_time)
    by_time.subscribe(pub.address, TOPIC, wait=10, start=cut)
    wait_until(lambda: len(got_id) == 4 and len(got_time) == 2, 10)
    assert sorted(p["n"] for p in got_id) == [1, 2, 3, 4]
    assert sorted(p["n"] for p in got_time) == [3, 4] and len(later) == 2


def test_a_pattern_subscription_with_a_start_gets_every_matching_retained_topic_in_publish_order(make_bus):
    pub = make_bus("pub", retention={"orders.>": 3600, "orders.secret": None})
    sequence = ["orders.placed", "orders.paid", "orders.secret", "audit.x", "orders.eu.placed", "orders.paid"]
    for n, topic in enumerate(sequence):
        pub.publish(topic, {"n": n, "topic": topic})
    sub = make_bus("sub")
    got = collector(sub, "orders.>")
    sub.subscribe(pub.address, "orders.>", wait=10, start="earliest", ordered=True)
    pub.publish("orders.shipped", {"n": 6, "topic": "orders.shipped"})
    wait_until(lambda: len(got) == 5, 10)
    assert [p["n"] for p in got] == [0, 1, 4, 5, 6]  # not retained: secret; not matched: audit
    assert pub.drain(10) and sub.drain(10) and len(got) == 5


def test_subscribing_again_at_every_start_replays_only_once(make_bus, tmp_path):
    pub = make_bus("pub", retention=3600)
    for n in range(5):
        pub.publish(TOPIC, {"n": n})
    address = free_address()
    got: list = []
    for _ in range(3):  # the service's code runs at each start: subscribe(start="earliest")
        with Bus(address, tmp_path / "sub") as sub:
            sub.every(TOPIC, lambda p, m: got.append(p["n"]))
            sub.subscribe(pub.address, TOPIC, wait=10, start="earliest")
            wait_until(lambda: len(got) >= 5, 10)
            assert pub.drain(10) and sub.drain(10)
    assert sorted(got) == [0, 1, 2, 3, 4]


def test_retained_events_go_when_older_than_the_retention_and_status_shows_what_is_kept(make_bus):
    pub = make_bus("pub", retention={"orders.*": 1.0})
    pub.publish_many(TOPIC, [{"n": n} for n in range(10)])
    kept = pub.status().retained
    assert kept[TOPIC]["messages"] == 10 and kept[TOPIC]["retention_s"] == 1.0 and kept[TOPIC]["bytes"] > 0
    wait_until(lambda: TOPIC not in pub.status().retained, 10)
    sub = make_bus("sub")
    got = collector(sub)
    sub.subscribe(pub.address, TOPIC, wait=10, start="earliest")
    pub.publish(TOPIC, {"n": 10})
    wait_until(lambda: got, 10)
    assert pub.drain(10) and sub.drain(10) and got == [{"n": 10}]


def test_retention_bytes_keeps_only_the_newest_but_never_what_a_subscriber_is_owed(make_bus):
    pub = make_bus("pub", retention=3600, retention_bytes=20_000)
    sub_address = free_address()
    down = make_bus("down", sub_address)
    down.subscribe(pub.address, "owed.topic", wait=10)
    down.close()  # what is published next is owed to it, whether the publisher knows it is down or not
    pad = "x" * 1000
    for n in range(60):
        pub.publish(TOPIC, {"n": n, "pad": pad})
        pub.publish("owed.topic", {"n": n, "pad": pad})
    wait_until(lambda: pub.status().retained[TOPIC]["bytes"] <= 20_000, 10)
    assert pub.status().retained[TOPIC]["messages"] < 60
    assert pub.status().retained["owed.topic"]["messages"] == 60  # owed to the stopped subscriber
    sub = make_bus("sub")
    got = collector(sub)
    sub.subscribe(pub.address, TOPIC, wait=10, start="earliest", ordered=True)
    wait_until(lambda: got and got[-1]["n"] == 59, 10)
    assert [p["n"] for p in got] == list(range(60 - len(got), 60))  # the newest, in order
    back = make_bus("back", sub_address, datadir=down.datadir)
    owed = collector(back, "owed.topic")
    wait_until(lambda: len(owed) == 60, 15)


def test_servicebus_status_shows_the_retained_topics_of_a_stopped_bus(tmp_path):
    with Bus(free_address(), tmp_path / "pub", retention=120) as pub:
        pub.publish_many(TOPIC, [{"n": n} for n in range(4)])
    shown = subprocess.run([CLI, "status", str(tmp_path / "pub")], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert shown.returncode == 0, shown.stderr
    assert f"retained {TOPIC}" in shown.stdout and "4 messages" in shown.stdout and "kept 120 s" in shown.stdout


@pytest.mark.parametrize("start", ["latest", "", "0" * 23, "t:x", 1.5j])
def test_a_bad_start_is_refused_before_anything_is_stored(make_bus, start):
    sub = make_bus("sub")
    with pytest.raises((ValueError, TypeError)):
        sub.subscribe(free_address(), TOPIC, start=start)
    assert sub.status().intents == 0


def test_a_naive_datetime_start_is_refused_as_ambiguous(make_bus):
    with pytest.raises(ValueError, match="aware"):
        make_bus("sub").subscribe(free_address(), TOPIC, start=datetime.now())


def test_a_replay_from_earliest_survives_kill_9_of_either_side_exactly_once(bus_process, tmp_path):
    """The publisher retains 400 events published before anyone subscribed; the subscriber
    starts at earliest; the subscriber is killed during the replay, then the publisher, and
    both restarted: each event handled once (no duplicates beyond the reruns of handler runs
    killed mid-way, of which there are none here: the handler is not killed)."""
    pub = bus_process("pub", "--publish", TOPIC, "--count", "400", "--batch", "20", "--retention", "3600")
    pub.start()
    wait_until(lambda: pub.ids.exists() and len(pub.ids.read_text().split()) == 400, 30)
    sub = bus_process("sub", "--handle", TOPIC, "--subscribe", pub.address, TOPIC, "--start", "earliest",
                      "--handler-ms", "2")
    sub.start()
    wait_until(lambda: sub.out.exists() and sub.out.read_text().count("done ") >= 50, 30)
    sub.kill()
    sub.start()
    wait_until(lambda: sub.out.read_text().count("done ") >= 150, 30)
    pub.kill()
    pub.start("--count", "0")
    wait_until(lambda: len({line.split()[2] for line in sub.out.read_text().splitlines()
                            if line.startswith("done ")}) == 400, 60)
    done = Counter(line.split()[2] for line in sub.out.read_text().splitlines() if line.startswith("done "))
    started = Counter(line.split()[2] for line in sub.out.read_text().splitlines() if line.startswith("start "))
    assert sorted(map(int, done)) == list(range(400))
    twice = [n for n, c in done.items() if c > 1]
    # A run killed after "done" and before its completion was written is the one rerun allowed.
    assert len(twice) <= 2 * sub.out.read_text().count("start ") - 2 * len(done) + 2, twice
    assert all(started[n] <= 2 for n in started)


@pytest.mark.parametrize("topic", [TOPIC, "orders.*"])
def test_a_start_id_inside_a_publish_many_starts_at_that_publish_and_misses_nothing_after_it(make_bus, topic):
    pub = make_bus("pub", retention=3600)
    pub.publish(TOPIC, {"n": -1})
    ids = pub.publish_many(TOPIC, [{"n": n} for n in range(10)])  # one segment, keyed by ids[0]
    pub.publish(TOPIC, {"n": 10})
    sub = make_bus("sub")
    got = collector(sub, topic)
    sub.subscribe(pub.address, topic, wait=10, start=ids[4])
    wait_until(lambda: {p["n"] for p in got} >= set(range(4, 11)), 10)
    assert pub.drain(10) and sub.drain(10)
    assert sorted(p["n"] for p in got) == list(range(0, 11))  # the whole publish, nothing before it


# --- found by a hostile review (each failed before its fix) -------------------------------


def test_a_pattern_subscription_with_a_start_misses_nothing_published_while_it_is_made(make_bus):
    import threading

    pub = make_bus("pub", retention={"orders.>": 3600})
    acked: list[str] = []
    lock, stop = threading.Lock(), threading.Event()

    def publish(t: int) -> None:
        n = 0
        while not stop.is_set() and n < 3000:
            mid = pub.publish(f"orders.t{t}", {"t": t, "n": n})
            with lock:
                acked.append(mid)
            n += 1

    threads = [threading.Thread(target=publish, args=(t,)) for t in range(3)]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(acked) >= 300, 10)
    sub = make_bus("sub")
    got: Counter = Counter()
    sub.every("orders.>", lambda p, m: got.update([m.id]))
    sub.subscribe(pub.address, "orders.>", wait=10, start="earliest")
    wait_until(lambda: len(acked) >= 900 or len(acked) >= 9000, 20)
    stop.set()
    for thread in threads:
        thread.join(30)
    wait_until(lambda: set(acked) <= set(got), 30)
    assert pub.drain(10) and sub.drain(10)
    assert set(got) == set(acked) and max(got.values()) == 1


def test_a_group_subscription_with_a_start_gets_the_retained_events(make_bus):
    pub = make_bus("pub", retention=3600)
    for n in range(5):
        pub.publish(TOPIC, {"n": n})
    sub = make_bus("sub")
    got = collector(sub)
    sub.subscribe(pub.address, TOPIC, wait=10, group="billing", start="earliest")
    pub.publish(TOPIC, {"n": 5})
    wait_until(lambda: len(got) == 6, 10)
    assert sorted(p["n"] for p in got) == list(range(6))


def test_retained_events_published_with_a_priority_are_replayed_from_earliest(make_bus):
    pub = make_bus("pub", retention=3600)
    for n in range(3):
        pub.publish(TOPIC, {"n": n})
    for n in range(3, 6):
        pub.publish(TOPIC, {"n": n}, priority=5)
    sub = make_bus("sub")
    got = collector(sub)
    sub.subscribe(pub.address, TOPIC, wait=10, start="earliest")
    wait_until(lambda: len(got) == 6, 10)
    assert sorted(p["n"] for p in got) == list(range(6))


def test_max_backlog_counts_what_a_subscription_with_a_start_is_owed(make_bus):
    pub = make_bus("pub", retention=3600, max_backlog=20, backlog_policy="raise")
    for n in range(60):
        pub.publish(TOPIC, {"n": n})
    address = free_address()
    sub = make_bus("sub", address)
    got = collector(sub)
    sub.subscribe(pub.address, TOPIC, wait=10, start="earliest")
    wait_until(lambda: len(got) == 60, 15)
    assert pub.drain(10)
    sub.close()  # what is published next is owed to it: the backlog grows
    from servicebus import BacklogFull

    published = 0
    with pytest.raises(BacklogFull):
        while published < 100:
            pub.publish(TOPIC, {"n": 100 + published})
            published += 1
    assert 20 <= published <= 22  # the limit holds (soft by one engine turn), not 20 + 60


@pytest.mark.parametrize("topic", ["orders.secret", "orders.>"])
def test_a_start_gives_nothing_from_before_of_a_topic_that_is_not_retained(make_bus, topic):
    pub = make_bus("pub", retention={"orders.>": 3600, "orders.secret": None})
    down = make_bus("down")  # owed the secret events: the stream holds them for it
    down.subscribe(pub.address, "orders.secret", wait=10)
    down.subscribe(pub.address, "orders.>", wait=10)
    down.close()
    for n in range(3):
        pub.publish("orders.secret", {"n": n, "secret": True})
    pub.publish("orders.placed", {"n": 100, "secret": False})
    sub = make_bus("sub")
    got = collector(sub, topic)
    sub.subscribe(pub.address, topic, wait=10, start="earliest")
    pub.publish("orders.secret", {"n": 3, "secret": True})
    wait_until(lambda: any(p["n"] == 3 for p in got), 10)
    assert pub.status().pending > 0  # still owed to the stopped subscriber
    assert sub.drain(5)
    assert sorted(p["n"] for p in got) == ([3] if topic == "orders.secret" else [3, 100])


def test_a_newer_publish_with_dedupe_latest_withdraws_the_older_from_a_retained_stream_nobody_reads(make_bus):
    pub = make_bus("pub", retention=3600)
    first = pub.publish(TOPIC, {"n": 1}, dedupe_key="order-1", dedupe="latest")
    second = pub.publish(TOPIC, {"n": 2}, dedupe_key="order-1", dedupe="latest")
    assert first != second
    wait_until(lambda: pub.status().retained[TOPIC]["messages"] == 1, 10)
    sub = make_bus("sub")
    got = collector(sub)
    sub.subscribe(pub.address, TOPIC, wait=10, start="earliest")
    wait_until(lambda: got, 10)
    assert pub.drain(10) and sub.drain(10) and got == [{"n": 2}]


def test_retained_events_whose_ttl_passed_are_not_dead_letters_for_a_late_subscriber(make_bus):
    pub = make_bus("pub", retention=3600)
    for n in range(5):
        pub.publish(TOPIC, {"n": n}, ttl=0.05)
    pub.publish(TOPIC, {"n": 5})
    published = time.time()
    wait_until(lambda: time.time() > published + 0.1, 5, 0.01)  # their TTL passed, nobody subscribed
    pub.publish(TOPIC, {"n": 6})
    sub = make_bus("sub")
    got = collector(sub)
    sub.subscribe(pub.address, TOPIC, wait=10, start="earliest")
    wait_until(lambda: len(got) >= 2, 10)
    assert pub.drain(10) and sub.drain(10)
    assert sorted(p["n"] for p in got) == [5, 6] and pub.status().deadletters == 0


def test_a_start_later_than_the_publishers_clock_means_new_and_misses_nothing_published_after(make_bus):
    pub = make_bus("pub", retention=3600)
    pub.publish(TOPIC, {"n": 0})
    sub = make_bus("sub")
    got = collector(sub)
    sub.subscribe(pub.address, TOPIC, wait=10, start=datetime.now(timezone.utc) + timedelta(minutes=5))
    pub.publish(TOPIC, {"n": 1})
    wait_until(lambda: got, 10)
    assert pub.drain(10) and sub.drain(10) and got == [{"n": 1}]


def test_a_delayed_messages_id_is_a_start(make_bus):
    pub = make_bus("pub", retention=3600)
    pub.publish(TOPIC, {"n": 0})
    later = pub.publish(TOPIC, {"n": 1}, delay=0.3)
    sub = make_bus("sub")
    got = collector(sub)
    sub.subscribe(pub.address, TOPIC, wait=10, start=later)
    wait_until(lambda: got, 10)
    assert pub.drain(10) and sub.drain(10) and got == [{"n": 1}]
