"""Publisher idempotency keys (issue 15): ``publish(..., dedupe_key=K)`` twice within the
window is one message, whatever happened to the publisher in between."""

from __future__ import annotations

import threading

import pytest

from servicebus.testing import free_address, wait_until
from ..conftest import subscriber_gone

TOPIC = "order.placed"


def subscribed(make_bus, **pub_options):
    pub = make_bus("pub", **pub_options)
    sub = make_bus("sub")
    got = []
    sub.every(TOPIC, lambda p, m: got.append((p, m.id)))
    sub.subscribe(pub.address, TOPIC, wait=10)
    return pub, sub, got


def test_a_second_publish_with_the_same_key_returns_the_first_id_and_delivers_nothing_more(make_bus):
    pub, sub, got = subscribed(make_bus)
    first = pub.publish(TOPIC, {"order": 1}, dedupe_key="order-1")
    again = pub.publish(TOPIC, {"order": 1, "retry": True}, dedupe_key="order-1")
    other = pub.publish(TOPIC, {"order": 2}, dedupe_key="order-2")
    assert again == first and other != first
    assert pub.drain(10) and sub.drain(10)
    assert sorted(mid for _, mid in got) == sorted([first, other])


def test_the_key_survives_a_publisher_restart(make_bus, tmp_path):
    address = free_address()
    pub = make_bus("pub", address=address)
    first = pub.publish(TOPIC, 1, dedupe_key="k")  # nobody subscribed: the key is kept anyway
    pub.close()
    again = make_bus("pub-again", address=address, datadir=pub.datadir)
    assert again.publish(TOPIC, 1, dedupe_key="k") == first


def test_after_the_window_the_same_key_publishes_anew_and_old_keys_are_pruned(make_bus):
    pub = make_bus("pub", publish_dedupe_window=0.3)
    first = pub.publish(TOPIC, 1, dedupe_key="k")
    wait_until(lambda: pub.publish(TOPIC, 1, dedupe_key="k") != first, 10)
    pub.publish(TOPIC, 1, dedupe_key="gone-soon")
    store = pub._store
    wait_until(lambda: store.count("publish_keys") == 0 and store.count("publish_keys_index") == 0, 10)


def test_concurrent_publishes_with_one_key_store_one_message(make_bus):
    pub, sub, got = subscribed(make_bus)
    ids, barrier = [], threading.Barrier(8)

    def publish() -> None:
        barrier.wait()
        ids.append(pub.publish(TOPIC, "x", dedupe_key="same"))

    threads = [threading.Thread(target=publish) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 1
    assert pub.drain(10) and sub.drain(10) and len(got) == 1


@pytest.mark.parametrize("key", ["", 5, "x" * 513])
def test_a_bad_dedupe_key_is_refused(make_bus, key):
    with pytest.raises(ValueError, match="dedupe_key"):
        make_bus("a").publish(TOPIC, 1, dedupe_key=key)


def test_check_finds_damaged_publish_keys_and_repair_restores_the_index(make_bus, tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    import plyvel

    cli = str(Path(sys.executable).parent / "servicebus")
    pub = make_bus("pub")
    for n in range(3):
        pub.publish(TOPIC, n, dedupe_key=f"k{n}")
    pub.close()
    db = plyvel.DB(str(pub.datadir / "store"))
    index = sorted(db.iterator(prefix=b"q/", include_value=False))
    db.delete(index[0])  # k0 loses its index entry: it would never be pruned
    db.put(b"p/k1", b"\xc1 junk")  # k1's record does not decode
    db.close()
    found = subprocess.run([cli, "check", str(pub.datadir), "--json"], capture_output=True, text=True)
    assert found.returncode == 4
    problems = {(p["keyspace"], p["key"]) for p in map(json.loads, found.stdout.splitlines())}
    assert ("publish_keys", "k0") in problems and ("publish_keys", "k1") in problems
    fixed = subprocess.run([cli, "check", str(pub.datadir), "--repair"], capture_output=True, text=True)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert subprocess.run([cli, "check", str(pub.datadir)], capture_output=True).returncode == 0
    again = make_bus("again", datadir=pub.datadir)
    assert again._store.get_publish_key("k0") is not None  # restored, indexed
    assert again._store.get_publish_key("k1") is None  # dropped: no longer deduplicated


def test_in_latest_mode_only_the_newest_reaches_a_subscriber_that_was_down(make_bus):
    pub = make_bus("pub", peer_timeout=1.5, heartbeat=0.5)
    # Known down: nothing is sent to it (a message already sent is kept: the next test).
    address, datadir = subscriber_gone(make_bus, pub, TOPIC, known_down=True)
    ids = [pub.publish(TOPIC, {"price": n}, dedupe_key="price-of-x", dedupe="latest") for n in range(5)]
    other = pub.publish(TOPIC, {"other": True})
    assert len(set(ids)) == 5  # each is stored, under a new id
    wait_until(lambda: pub.status().pending == 2, 10)  # the four older ones are withdrawn
    back = make_bus("sub2", address=address, datadir=datadir)
    got = []
    back.every(TOPIC, lambda p, m: got.append((p, m.id)))
    wait_until(lambda: len(got) == 2 and pub.drain(0.1), 15)
    assert sorted(mid for _, mid in got) == sorted([ids[-1], other])
    assert pub.counters()["superseded"] == 4


def test_in_latest_mode_a_message_already_sent_is_delivered_as_well(make_bus):
    pub, sub, got = subscribed(make_bus)
    first = pub.publish(TOPIC, 1, dedupe_key="k", dedupe="latest")
    wait_until(lambda: len(got) == 1, 10)
    second = pub.publish(TOPIC, 2, dedupe_key="k", dedupe="latest")
    wait_until(lambda: len(got) == 2, 10)
    assert [mid for _, mid in got] == [first, second]


def test_in_latest_mode_one_subscriber_that_read_it_keeps_it_and_one_that_did_not_loses_it(make_bus):
    pub, sub, got = subscribed(make_bus, peer_timeout=1.5, heartbeat=0.5)
    address, datadir = subscriber_gone(make_bus, pub, TOPIC, known_down=True)
    first = pub.publish(TOPIC, 1, dedupe_key="k", dedupe="latest")
    wait_until(lambda: len(got) == 1, 10)
    second = pub.publish(TOPIC, 2, dedupe_key="k", dedupe="latest")
    wait_until(lambda: len(got) == 2, 10)
    back = make_bus("down2", address=address, datadir=datadir)
    seen = []
    back.every(TOPIC, lambda p, m: seen.append(m.id))
    wait_until(lambda: seen and pub.drain(0.1), 15)
    assert seen == [second]
    assert [mid for _, mid in got] == [first, second]


def test_a_bad_dedupe_mode_is_refused(make_bus):
    pub = make_bus("pub")
    with pytest.raises(ValueError, match="'first' or 'latest'"):
        pub.publish(TOPIC, 1, dedupe_key="k", dedupe="last")
