"""Ordered subscriptions attacked as a hostile, unlucky user would (helper-35's review of
the late-registration fix): handlers registering at odd moments while a stream arrives,
tiny dispatch queues, keys, failures, segments, priorities, patterns, restarts.

Two defects these found, each fixed with its tests seen failing first:
- order: an ordered lane's message already in memory (queued, or the lane's head) when
  its topic's first handler registered ran ahead of the lane's older messages parked in
  the store (the one-worker test: every run; the burst and pattern tests: under CPU
  load);
- liveness: after the dispatch queue overflowed, ordered messages left in the store with
  nothing in memory waited for a refill nobody started (the small-queue test: 4 runs in 5;
  drain() never True).

Two more from helper-37's review (the last two tests):
- order: a refill scan already running when a handler registered parked a lane's older
  messages (no handler yet), then queued its newer ones (the handler there by then): 3 of
  10 runs, 16 of 50 keys out of order;
- liveness: with dispatch_queue=1 a refill waited for fewer than 1 // 2 = 0 messages in
  memory, which never happens (2 of 200 handled, ordered or not).
"""

from __future__ import annotations

import threading

import pytest

from servicebus.testing import free_address, wait_until

from ..streams import Stream

TOPIC = "orders.created"


def _state(bus) -> str:
    d = bus._dispatcher
    with d._cv:
        lanes = {k: (v.head, [w[0] for w in v.waiting][:3], len(v.waiting))
                 for k, v in d._lanes._lanes.items()}
        return (f"known={sorted(d._known)[:5]} ({len(d._known)}) heap={[(h[0], h[2].id) for h in d._heap][:5]} "
                f"lanes={lanes} parked={d._parked} overflow={d._overflow} refilling={d._refilling} "
                f"pending={d._refill_pending} stored={bus.status().incoming}")


@pytest.mark.parametrize("when", [1, 20, 200, 800])
def test_an_ordered_burst_keeps_its_order_when_the_handler_registers_while_it_parks(make_bus, when):
    """A burst of ordered messages arrives while no handler exists: the lane's messages
    park one at a time (only the lane's head runs). The handler registers midway: the
    already-parked (older) ones are in the store, the rest in memory."""
    pub = make_bus("pub")
    sub_addr = free_address()
    sub = make_bus("sub", address=sub_addr)
    sub.subscribe(pub.address, TOPIC, ordered=True, wait=10)
    sub.close()
    n = 3000
    for i in range(n):  # one at a time: separate records, waiting at pub
        pub.publish(TOPIC, i)
    sub = make_bus("sub2", address=sub_addr, datadir=sub.datadir)
    seen: list = []
    wait_until(lambda: sub.status().incoming >= when, 30)
    sub.every(TOPIC, lambda p, m: seen.append(p))
    wait_until(lambda: len(seen) >= n, 60, message=lambda: f"{len(seen)} of {n}; {_state(sub)}")
    assert seen == list(range(n)), [
        (i, x) for i, x in enumerate(seen) if x != i][:8]


def test_an_ordered_message_queued_before_the_handler_registers_runs_after_the_older_parked_ones(make_bus):
    """Older messages of an ordered subscription wait in the store (no handler yet). A newer
    one arrives and is queued in memory (workers busy elsewhere), then the handler
    registers: the newer one must still run after the older ones."""
    pub = make_bus("pub")
    sub = make_bus("sub", workers=1)
    gate, blocked = threading.Event(), threading.Event()

    def block(p, m):
        blocked.set()
        gate.wait(30)

    sub.every("other.topic", block)
    sub.subscribe(pub.address, "other.topic", wait=10)
    sub.subscribe(pub.address, TOPIC, ordered=True, wait=10)
    for i in range(10):
        pub.publish(TOPIC, i)
    d = sub._dispatcher  # all ten parked: stored, none in memory
    wait_until(lambda: pub.drain(0.1) and sub.status().incoming == 10 and d._parked
               and not d._known, 30)
    pub.publish("other.topic", "x")
    wait_until(blocked.is_set, 10)  # the only worker is busy
    pub.publish(TOPIC, 10)
    wait_until(lambda: pub.drain(0.1) and sub.status().incoming == 12, 10,
               message=lambda: f"{sub.status().incoming} stored")  # stored at sub
    seen: list = []
    sub.every(TOPIC, lambda p, m: seen.append(p))
    gate.set()
    wait_until(lambda: len(seen) == 11, 30, message=lambda: f"{seen}")
    assert seen == list(range(11))


def test_an_ordered_subscription_keeps_its_order_across_restarts_with_a_backlog_and_a_live_stream(make_bus, tmp_path):
    """A subscriber with a backlog restarts again and again while the publisher keeps
    publishing; the handler registers right after the bus starts (as a service does)."""
    import time
    pub = make_bus("pub")
    sub_addr = free_address()
    datadir = tmp_path / "sub"
    seen: list = []
    lock = threading.Lock()

    def handler(p, m):
        with lock:
            seen.append(p)
        time.sleep(0.005)  # slower than the publisher: a backlog (a sleep: the GIL is free)

    sub = make_bus("sub0", address=sub_addr, datadir=datadir)
    sub.every(TOPIC, handler)
    sub.subscribe(pub.address, TOPIC, ordered=True, wait=10)
    with Stream(pub, TOPIC) as stream:
        for r in range(15):
            wait_until(lambda: len(seen) > 0 and sub.status().incoming > 20, 30,
                       message=lambda: f"round {r}: {len(seen)} seen of {stream.sent} sent; {_state(sub)}")
            sub.close()
            sub = make_bus(f"sub{r + 1}", address=sub_addr, datadir=datadir)
            sub.every(TOPIC, handler)
    wait_until(lambda: len(seen) >= stream.sent, 120, message=lambda: f"{len(seen)} of {stream.sent}")
    bad = [(i, a, b) for i, (a, b) in enumerate(zip(seen, seen[1:])) if b <= a]
    assert not bad, f"out of order at {bad[:5]} of {len(seen)}"


@pytest.mark.parametrize("late", [False, True])
def test_ordered_keys_keep_their_order_with_a_small_queue_failures_and_segments(make_bus, late):
    """Keys, a tiny dispatch queue, failing first attempts, segments and single messages
    mixed; optionally the handler registers while the stream arrives."""
    import random
    pub = make_bus("pub")
    sub = make_bus("sub", dispatch_queue=5, workers=4)
    sub.subscribe(pub.address, TOPIC, ordered=True, wait=10)
    seen: dict = {}
    lock = threading.Lock()
    failed: set = set()
    rnd = random.Random(7)

    def handler(p, m):
        k, i = p
        if i % 7 == 3 and (k, i) not in failed:
            failed.add((k, i))
            raise RuntimeError("first attempt fails")
        with lock:
            seen.setdefault(k, []).append(i)

    if not late:
        sub.every(TOPIC, handler, max_attempts=5)
    counts = {f"k{j}": 0 for j in range(4)}
    total = 0
    for step in range(150):
        k = f"k{rnd.randrange(4)}"
        if rnd.random() < 0.3:
            batch = [(k, counts[k] + j) for j in range(rnd.randrange(2, 12))]
            pub.publish_many(TOPIC, batch, key=k)
            counts[k] += len(batch)
            total += len(batch)
        else:
            pub.publish(TOPIC, (k, counts[k]), key=k)
            counts[k] += 1
            total += 1
        if late and step == 60:
            sub.every(TOPIC, handler, max_attempts=5)
    wait_until(lambda: sum(map(len, seen.values())) >= total, 30,
               message=lambda: f"{sum(map(len, seen.values()))} of {total}; {_state(sub)}")
    for k, got in seen.items():
        assert got == list(range(counts[k])), (k, got[:20])


@pytest.mark.parametrize("ordered", [True, False])
def test_a_stream_through_a_small_dispatch_queue_never_stalls(make_bus, ordered):
    """A steady stream into a tiny dispatch queue: what was left in the store must be read
    back; nothing may wait there with nothing in memory and no refill coming."""
    pub = make_bus("pub")
    sub = make_bus("sub", dispatch_queue=5, workers=4)
    seen: list = []
    sub.every(TOPIC, lambda p, m: seen.append(p))
    sub.subscribe(pub.address, TOPIC, ordered=ordered, wait=10)
    n = 2000
    for i in range(n):
        if i % 10 == 0:
            pub.publish_many(TOPIC, list(range(i, i + 5)))
        elif i % 10 < 5:
            continue
        else:
            pub.publish(TOPIC, i)
    wait_until(lambda: len(seen) >= n, 30, message=lambda: f"{len(seen)} of {n}; {_state(sub)}")
    assert (seen if ordered else sorted(seen)) == list(range(n))


def test_ordered_priorities_keep_their_order_within_each_level(make_bus):
    """An ordered subscription is ordered within each priority level."""
    pub = make_bus("pub")
    sub = make_bus("sub", workers=4)
    seen: list = []
    sub.every(TOPIC, lambda p, m: seen.append(p))
    sub.subscribe(pub.address, TOPIC, ordered=True, wait=10)
    n = 1500
    for i in range(n):
        prio = (i * 7) % 3 * 4  # 0, 4, 8
        if i % 5 == 0:
            pub.publish_many(TOPIC, [[prio, i, j] for j in range(3)], priority=prio)
        else:
            pub.publish(TOPIC, [prio, i, 0], priority=prio)
    total = n + 2 * (n // 5)
    wait_until(lambda: len(seen) >= total, 60, message=lambda: f"{len(seen)} of {total}; {_state(sub)}")
    for level in (0, 4, 8):
        got = [(i, j) for p, i, j in seen if p == level]
        assert got == sorted(got), level


def test_an_ordered_pattern_keeps_its_order_when_its_handler_registers_while_a_stream_arrives(make_bus):
    """A pattern handler (orders.*) registers while an ordered stream arrives."""
    pub = make_bus("pub")
    sub = make_bus("sub")
    sub.subscribe(pub.address, "orders.*", ordered=True, wait=10)
    stop, sent = threading.Event(), [0]

    def stream():
        while not stop.is_set() and sent[0] < 3000:
            pub.publish("orders.a" if sent[0] % 2 else "orders.b", sent[0])
            sent[0] += 1

    t = threading.Thread(target=stream)
    t.start()
    seen: list = []
    try:
        wait_until(lambda: sent[0] > 300, 10)
        sub.every("orders.*", lambda p, m: seen.append(p), name="all-orders")
        wait_until(lambda: len(seen) > 600, 30)
    finally:
        stop.set()
        t.join(10)
    wait_until(lambda: len(seen) >= sent[0], 60, message=lambda: f"{len(seen)} of {sent[0]}; {_state(sub)}")
    assert seen == list(range(sent[0]))


@pytest.mark.parametrize("queue", [2, 16])
def test_keyed_ordered_messages_keep_their_order_when_the_handler_registers_during_a_burst(make_bus, queue):
    """The subscriber starts with no handler while a backlog of 50 keys arrives (each
    message parks as its lane's head runs); the handler registers midway: every key must
    still be handled in publish order."""
    pub = make_bus("pub")
    sub_addr = free_address()
    sub = make_bus("sub", address=sub_addr)
    sub.subscribe(pub.address, TOPIC, ordered=True, wait=10)
    sub.close()
    n, keys = 1000, 50
    for i in range(n):  # one at a time: separate records, waiting at pub
        pub.publish(TOPIC, (f"k{i % keys}", i), key=f"k{i % keys}")
    sub = make_bus("sub2", address=sub_addr, datadir=sub.datadir, dispatch_queue=queue, workers=4)
    seen: dict = {}
    lock = threading.Lock()

    def handler(p, m):
        with lock:
            seen.setdefault(p[0], []).append(p[1])

    wait_until(lambda: sub.status().incoming >= 300, 30)
    sub.every(TOPIC, handler)
    wait_until(lambda: sum(map(len, seen.values())) >= n, 60,
               message=lambda: f"{sum(map(len, seen.values()))} of {n}; {_state(sub)}")
    wrong = {k: v[:4] for k, v in seen.items() if v != sorted(v)}
    assert not wrong, f"{len(wrong)} keys out of order, e.g. {list(wrong.items())[:3]}"
    assert sub.drain(timeout=10)


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("queue", [1, 2, 3])
def test_a_stream_drains_with_a_dispatch_queue_of_one_to_three_and_nothing_failing(make_bus, queue, ordered):
    """No retries, no slow handler: 200 messages (one key) through a subscriber with
    dispatch_queue 1, 2 or 3 are all handled (in order, ordered) and drain() is True.
    With 1, the refill waited for fewer than 1 // 2 = 0 messages in memory: never (2 of
    200 handled, ordered or not)."""
    pub = make_bus("pub")
    sub = make_bus("sub", dispatch_queue=queue, workers=4)
    seen: list = []
    sub.every(TOPIC, lambda p, m: seen.append(p))
    sub.subscribe(pub.address, TOPIC, ordered=ordered, wait=10)
    n = 200
    for i in range(n):
        pub.publish(TOPIC, i, key="k")
    wait_until(lambda: len(seen) >= n, 10, message=lambda: f"{len(seen)} of {n}; {_state(sub)}")
    assert sorted(seen) == list(range(n))
    if ordered:
        assert seen == list(range(n))
    assert sub.drain(timeout=10)
