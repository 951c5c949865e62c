"""Buses in real subprocesses, killed with SIGKILL at the awkward moments."""

import time
from collections import Counter

import pytest

from servicebus import Bus
from servicebus.testing import free_address, wait_until

from ..conftest import counting_handler

pytestmark = pytest.mark.slow

TOPIC = "user.signup"


def test_message_published_while_subscriber_down_arrives_after_restart(make_bus, bus_process):
    pub = make_bus("pub")
    sub = bus_process("sub", "--handle", TOPIC, "--subscribe", pub.address, TOPIC)
    sub.start()
    sub.stop()  # a clean stop; the subscription stays with the publisher
    ids = pub.publish_many(TOPIC, [{"n": n} for n in range(500)])
    assert pub.status().pending == 500
    sub.start()
    wait_until(lambda: len(sub.done_counts()) == 500, 30,
               message=lambda: f"{len(sub.done_counts())} of 500 handled")
    assert set(sub.done_counts().values()) == {1}
    assert {line[1] for line in sub.lines("done")} == set(ids)
    assert pub.drain(10)


def test_publisher_killed_right_after_publish_returned_delivers_after_restart(make_bus, bus_process):
    address = free_address()
    sub = make_bus("sub")
    got = counting_handler(sub, TOPIC)
    sub.subscribe(address, TOPIC)  # the publisher is not running yet
    pub = bus_process("pub", address=address)
    pub.start("--publish", TOPIC, "--count", "300", "--kill-after-publish", wait_ready=False)
    assert pub.wait_exit(60) == -9
    published = pub.published_ids()
    assert len(published) == 300  # every publish returned before the kill
    pub.start()  # restarted with the same data directory, publishing nothing new
    wait_until(lambda: len(got) == 300, 30, message=lambda: f"{len(got)} of 300")
    assert set(got.values()) == {1}
    assert sub.drain(10)


def test_subscriber_killed_inside_a_handler_reruns_it_and_handles_the_rest_once(make_bus, bus_process):
    pub = make_bus("pub")
    args = ("--handle", TOPIC, "--subscribe", pub.address, TOPIC, "--workers", "1")
    sub = bus_process("sub", *args)
    sub.start("--die-at", "120")
    pub.publish_many(TOPIC, [{"n": n} for n in range(300)])
    assert sub.wait_exit(30) == -9
    assert sub.marker.exists()
    sub.start()
    wait_until(lambda: len(sub.done_counts()) == 300, 30,
               message=lambda: f"{len(sub.done_counts())} of 300")
    starts = Counter(int(line[2]) for line in sub.lines("start"))
    assert starts[120] == 2  # the handler that was killed ran again
    rerun = [line for line in sub.lines("start") if line[2] == "120"]
    assert [line[3] for line in rerun] == ["1", "2"]  # and the crash counted as an attempt
    assert set(sub.done_counts().values()) == {1}  # everything finished exactly once
    assert all(count == 1 for n, count in starts.items() if n != 120)
    assert pub.drain(10)


def test_subscribe_while_publisher_down_completes_when_it_starts(make_bus, bus_process):
    address = free_address()
    sub = make_bus("sub")
    got = counting_handler(sub, TOPIC)
    sub.subscribe(address, TOPIC)
    assert sub.status().intents_unconfirmed == 1
    pub = bus_process("pub", "--publish", TOPIC, "--count", "200", "--batch", "50", address=address)
    pub.start()
    wait_until(lambda: len(got) == 200, 30, message=lambda: f"{len(got)} of 200")
    assert sub.status().intents_unconfirmed == 0
    assert set(got.values()) == {1}


def test_a_subscriber_down_for_the_whole_test_does_not_hold_up_another(make_bus, bus_process):
    pub = make_bus("pub")
    dead = bus_process("dead", "--handle", TOPIC, "--subscribe", pub.address, TOPIC)
    dead.start()
    dead.kill()
    live = make_bus("live")
    got = counting_handler(live, TOPIC)
    live.subscribe(pub.address, TOPIC, wait=10)
    for start in range(0, 2000, 100):
        pub.publish_many(TOPIC, [{"n": n} for n in range(start, start + 100)])
    wait_until(lambda: len(got) == 2000, 20, message=lambda: f"{len(got)} of 2000")
    status = pub.status()
    assert status.pending_by_subscriber[dead.address] == 2000
    assert status.pending_by_subscriber[live.address] == 0


def test_peer_that_comes_back_gets_its_backlog_promptly_not_after_backoff(make_bus, bus_process):
    pub = make_bus("pub", ack_timeout=20.0)
    sub = bus_process("sub", "--handle", TOPIC, "--subscribe", pub.address, TOPIC)
    sub.start()
    sub.kill()
    pub.publish_many(TOPIC, [{"n": n} for n in range(100)])
    sub.start()
    # Without reconnect detection the first resend would wait for the 20 s ack timeout.
    began = time.monotonic()
    wait_until(lambda: len(sub.done_counts()) == 100, 8,
               message=lambda: f"{len(sub.done_counts())} of 100")
    assert time.monotonic() - began < 8


def test_restart_after_kill_9_takes_over_the_stale_lock(bus_process, tmp_path, caplog):
    proc = bus_process("node")
    proc.start()
    proc.kill()
    with caplog.at_level("WARNING", logger="servicebus"):
        with Bus(free_address(), proc.datadir) as bus:
            assert bus.status().lock["pid"] != proc.proc.pid
    assert "recovered a stale lock" in caplog.text


def anon_rss(pid: int) -> int:
    """Anonymous resident memory (heap, LevelDB's memtables and block cache) of a process, in
    bytes. Mapped table files are left out: LevelDB maps them, and how much of them is
    resident depends on the page cache, not on what the process holds."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/PID/status")


def test_a_backlog_of_100k_messages_stays_on_disk_not_in_publisher_memory(make_bus, bus_process):
    pad = 1000
    pub = bus_process("pub", "--publish", TOPIC, "--count", "100000", "--batch", "500",
                      "--pad", str(pad), "--random-pad")
    sub = make_bus("sub")
    sub.subscribe(pub.address, TOPIC)  # confirmed as soon as the publisher is up
    pub.start(wait_ready=False)
    pub.wait_ready()
    sub.close()  # the subscriber goes away; the whole backlog stays queued
    # By 25k queued (25 MB written), the memtables have filled and been flushed several
    # times and the journal has been flushed: what grows after that grows with the backlog.
    wait_until(lambda: len(pub.published_ids()) >= 25_000, 60)
    baseline = anon_rss(pub.proc.pid)
    wait_until(lambda: len(pub.published_ids()) == 100_000, 120,
               message=lambda: f"{len(pub.published_ids())} published")
    assert pub.proc.poll() is None
    grown = anon_rss(pub.proc.pid) - baseline
    # What may still grow is bounded by configuration: two 4 MB memtables (the one being
    # written and the one being flushed) and the 8 MB block cache. Holding the 75k
    # messages queued meanwhile would take more than 75 MB.
    assert grown < 16 * 2**20, f"publisher heap grew {grown / 2**20:.1f} MB for 75k queued messages"
