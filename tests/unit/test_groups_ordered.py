"""Subscriber groups (competing consumers) and ordered subscriptions, in the sans-IO core:
cores joined by an in-memory network that loses what a test tells it to."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from servicebus.wire import protocol as P
from servicebus.model.delivery import group_peer, unpack_outgoing
from servicebus.testing import Network

TOPIC = "orders.created"


@pytest.fixture
def net():
    return Network(ack_timeout=1.0, resend_max=2.0, window=50)


def join(net, pub, subs, **options):
    tokens = [(sub, sub.subscribe(pub.address, TOPIC, **options)) for sub in subs]
    net.run(lambda: all(any(t is tok for t, _ in sub.released) for sub, tok in tokens))


def handled_ids(*nodes):
    """How many times each message was handed to a handler (``handled`` holds segments)."""
    return Counter(mid for node in nodes for mid in node.handled_ids())


def publishes(pub, count, size, topic=TOPIC):
    """``count`` publishes of ``size`` messages each (a segment each): their ids, in order."""
    return [mid for i in range(count) for mid in pub.publish(topic, *range(i * size, i * size + size))]


def test_each_message_published_to_a_group_is_handled_by_exactly_one_member(net):
    pub = net.node("pub")
    members = [net.node(f"m{i}") for i in range(3)]
    join(net, pub, members, group="email")
    ids = publishes(pub, 100, 3)  # a group shares segments: 100 of 3 messages
    net.run(lambda: pub.core.idle() and len(handled_ids(*members)) == 300)

    assert handled_ids(*members) == Counter(ids)  # each once, none twice
    assert all(member.handled for member in members), "the work is shared, not all on one"
    assert list(pub.store.delivery) == [(group_peer("email"), "e:" + TOPIC)]  # one shared cursor


def test_a_group_and_a_plain_subscriber_each_get_every_message(net):
    pub, alone = net.node("pub"), net.node("alone")
    members = [net.node("m0"), net.node("m1")]
    join(net, pub, members, group="email")
    join(net, pub, [alone])
    ids = pub.publish(TOPIC, *range(40))
    net.run(lambda: pub.core.idle())
    assert handled_ids(*members) == Counter(ids)
    assert handled_ids(alone) == Counter(ids)


def test_what_a_dead_member_did_not_acknowledge_goes_to_another_after_ack_timeout(net):
    pub = net.node("pub")
    alive, dying = net.node("alive"), net.node("dying")
    join(net, pub, [alive, dying], group="email")
    # "dying" dies before it can store anything sent to it: nothing it was given is acked.
    dying.stop()
    net.lose = lambda s, d, f: d == dying.address
    ids = publishes(pub, 20, 3)
    net.run(lambda: pub.core.idle(), seconds=30)

    assert handled_ids(alive) == Counter(ids)
    assert dying.handled == []


def test_a_member_that_stops_acknowledging_has_its_messages_reassigned_and_counted(net):
    pub = net.node("pub")
    a, b = net.node("a"), net.node("b")
    join(net, pub, [a, b], group="email")
    # b is up (it answers pings) but its acks never arrive: a frozen engine, a half partition.
    net.lose = lambda s, d, f: s == b.address and isinstance(f, P.Ack)
    ids = publishes(pub, 20, 2)
    net.run(lambda: pub.core.idle(), seconds=30)

    reassigned = pub.core.s.counters["group_reassigned"]  # messages (of segments of two)
    assert set(handled_ids(a)) == set(ids)  # a got every one in the end
    assert reassigned == 2 * len(b.handled) > 0  # only reassigned ones can be handled twice
    assert sum(handled_ids(a, b).values()) == len(ids) + reassigned


def test_a_restarted_publisher_resends_a_group_message_to_the_member_it_chose(net):
    pub = net.node("pub")
    a, b = net.node("a"), net.node("b")
    join(net, pub, [a, b], group="email")
    net.lose = lambda s, d, f: isinstance(f, P.Ack)  # stored by members, never acked
    ids = publishes(pub, 10, 2)
    net.run(lambda: len(handled_ids(a, b)) == 20)
    net.run(seconds=0.3)  # the assignment is written with the next turn's batch
    first = {mid: node.address for node in (a, b) for mid in node.handled_ids()}
    assert set(first.values()) == {a.address, b.address}  # each member chosen for some
    pub.stop()
    net.lose = lambda s, d, f: False
    pub.start()
    net.run(lambda: pub.core.idle(), seconds=30)

    assert handled_ids(a, b) == Counter(ids)  # resent to the same member: deduplicated there
    assert {mid: node.address for node in (a, b) for mid in node.handled_ids()} == first
    assert a.core.s.counters["duplicates"] + b.core.s.counters["duplicates"] >= 20


def test_a_member_that_leaves_hands_its_unacknowledged_messages_to_the_others(net):
    pub = net.node("pub")
    a, b = net.node("a"), net.node("b")
    join(net, pub, [a, b], group="email")
    net.lose = lambda s, d, f: d == b.address and isinstance(f, P.Batch)  # b never gets any
    ids = publishes(pub, 10, 3)
    net.run(seconds=0.2)
    left = b.subscribe(pub.address, TOPIC, op="unsubscribe")
    net.run(lambda: any(t is left for t, _ in b.released))
    net.run(lambda: pub.core.idle(), seconds=10)
    assert handled_ids(a) == Counter(ids)
    assert pub.core.s.consumers[(group_peer("email"), "e:" + TOPIC)].members == [a.address]


def test_the_last_member_leaving_ends_the_group_and_its_cursor(net):
    pub, a = net.node("pub"), net.node("a")
    join(net, pub, [a], group="email")
    left = a.subscribe(pub.address, TOPIC, op="unsubscribe")
    net.run(lambda: any(t is left for t, _ in a.released))
    net.run(lambda: not pub.store.delivery)
    assert not pub.store.subs
    assert pub.core.s.consumers == {}


def test_subscribing_again_with_other_options_is_refused_until_unsubscribed(net):
    pub, sub = net.node("pub"), net.node("sub")
    join(net, pub, [sub])
    sub.subscribe(pub.address, TOPIC, group="email")
    net.run(seconds=2)
    nacks = net.sent(pub.address, sub.address, P.Nack)
    assert nacks and "unsubscribe first" in nacks[-1].reason
    assert pub.store.subs[(sub.address, TOPIC)].get("group") is None


def test_a_group_survives_a_publisher_restart_with_its_members(net):
    pub = net.node("pub")
    a, b = net.node("a"), net.node("b")
    join(net, pub, [a, b], group="email")
    pub.stop()
    pub.start()
    ids = publishes(pub, 25, 2)
    net.run(lambda: pub.core.idle(), seconds=30)
    assert handled_ids(a, b) == Counter(ids)
    assert a.handled and b.handled


# --- ordered -------------------------------------------------------------------------------


def lossy(seed: int, rate: float, dst: str):
    rng = random.Random(seed)
    return lambda s, d, f: d == dst and isinstance(f, P.Batch) and rng.random() < rate


def publish_round(pub, i):
    """30 messages: one publish of 15 (a segment), then 15 publishes of one."""
    ids = pub.publish(TOPIC, *range(i * 30, i * 30 + 15))
    for n in range(i * 30 + 15, i * 30 + 30):
        ids += pub.publish(TOPIC, n)
    return ids


@pytest.mark.parametrize("seed", range(5))
def test_an_ordered_subscription_is_handed_its_messages_in_publish_order_whatever_is_lost(net, seed):
    pub, sub = net.node("pub"), net.node("sub")
    join(net, pub, [sub], ordered=True)
    net.lose = lossy(seed, 0.3, sub.address)
    ids = []
    for i in range(10):
        ids += publish_round(pub, i)
        net.run(seconds=0.05)
    net.run(lambda: pub.core.idle(), seconds=60)
    assert sub.handled_ids() == ids


def test_the_same_losses_reorder_an_unordered_subscription(net):
    """The test above can fail: without ``ordered`` the losses do reorder messages."""
    pub, sub = net.node("pub"), net.node("sub")
    join(net, pub, [sub])
    net.lose = lossy(0, 0.3, sub.address)
    ids = []
    for i in range(10):
        ids += publish_round(pub, i)
        net.run(seconds=0.05)
    net.run(lambda: pub.core.idle(), seconds=60)
    assert sorted(sub.handled_ids()) == ids
    assert sub.handled_ids() != ids


def test_an_ordered_subscription_has_one_frame_in_flight_and_marks_its_messages(net):
    pub, sub = net.node("pub"), net.node("sub")
    join(net, pub, [sub], ordered=True)
    net.lose = lambda s, d, f: isinstance(f, P.Ack)  # nothing is ever acked
    publishes(pub, 10, 50)
    net.run(seconds=3)
    frames = net.sent(pub.address, sub.address, P.Batch)
    first = [(env.id, env.ids) for env in frames[0].messages]
    assert sum(len(ids) for _key, ids in first) == net.config.max_batch  # 4 segments of 50
    # Every later frame is the same window again (resends), never the next messages.
    assert all([(env.id, env.ids) for env in f.messages] == first for f in frames)
    assert {env.headers["sb-order"] for env in frames[0].messages} == {"e:" + TOPIC}




def test_an_ordered_window_of_segments_goes_in_one_frame_so_a_loss_cannot_reorder_it():
    net = Network(ack_timeout=1.0, resend_max=2.0, window=50, max_batch=3)
    pub, sub = net.node("pub"), net.node("sub")
    join(net, pub, [sub], ordered=True)
    lost = []
    net.lose = lambda s, d, f: isinstance(f, P.Batch) and d == sub.address and not lost and not lost.append(f)
    ids = publishes(pub, 2, 2)  # two segments of two messages
    net.run(lambda: pub.core.idle(), seconds=30)
    assert lost  # the first frame was lost, and sent again
    assert sub.handled_ids() == ids


# --- backlog counting ------------------------------------------------------------------------


def owed(pub, consumer):
    """What the store says ``consumer`` is owed: the messages of the segments stored after
    its floor, not acked."""
    acked = {i for i in consumer.order if i not in consumer.inflight} | consumer.skip
    return sum(len(unpack_outgoing(data).ids) for key, data in pub.store.iter_stream(consumer.stream, after=consumer.floor)
               if key not in acked)


@pytest.mark.parametrize("seed", range(3))
def test_the_backlog_count_matches_the_store_through_losses_and_restarts(seed):
    # max_batch 30: a publish of more is cut into segments of 30 at most.
    net = Network(ack_timeout=0.5, resend_max=1.0, window=20, max_backlog=10_000, max_batch=30)
    pub, sub = net.node("pub"), net.node("sub")
    join(net, pub, [sub])
    rng = random.Random(seed)
    net.lose = lambda s, d, f: rng.random() < 0.2 and isinstance(f, (P.Batch, P.Ack))

    nonzero = []

    def check():
        for consumer in pub.core.s.consumers.values():
            assert consumer.backlog == owed(pub, consumer)
            nonzero.append(consumer.backlog > 0)

    for round_ in range(6):
        pub.publish(TOPIC, *range(rng.randrange(1, 80)))
        net.run(seconds=rng.uniform(0.05, 0.5))
        check()
        if round_ == 2:
            sub.stop()
            pub.publish(TOPIC, *range(30))
            net.run(seconds=0.3)
            check()
            sub.start()
        if round_ == 4:
            pub.stop()
            pub.start()
            check()
    net.lose = lambda s, d, f: False
    net.run(lambda: pub.core.idle(), seconds=60)
    check()
    assert [c.backlog for c in pub.core.s.consumers.values()] == [0]
    assert any(nonzero), "never checked while something was owed"


# --- priorities ------------------------------------------------------------------------------


def test_a_high_priority_event_overtakes_the_backlog_of_a_subscriber_that_comes_back():
    net = Network(ack_timeout=1.0, resend_max=2.0, window=10)
    pub, sub = net.node("pub"), net.node("sub")
    join(net, pub, [sub])
    sub.stop()
    low = publishes(pub, 200, 1)  # a backlog of 200 segments
    high = pub.publish(TOPIC, "urgent", priority=9)
    net.run(seconds=1)
    sub.start()
    net.run(lambda: pub.core.idle(), seconds=60)
    order = sub.handled_ids()
    assert sorted(order) == sorted(low + high)
    assert order.index(high[0]) < 25  # with the first windows, not after 200
    assert ("ipc://sub", "e:" + TOPIC + " 9") in pub.store.delivery  # a cursor of its own


def test_priority_cursors_survive_a_publisher_restart_and_end_with_the_subscription():
    net = Network(ack_timeout=1.0, resend_max=2.0)
    pub, sub = net.node("pub"), net.node("sub")
    join(net, pub, [sub])
    pub.publish(TOPIC, 1, priority=5)
    net.run(lambda: pub.core.idle() and len(sub.handled) == 1)
    pub.stop()
    pub.start()
    pub.publish(TOPIC, 2, priority=5)
    net.run(lambda: pub.core.idle() and len(sub.handled) == 2, seconds=30)
    assert sub.core.s.counters["duplicates"] == 0  # the first was not sent again
    left = sub.subscribe(pub.address, TOPIC, op="unsubscribe")
    net.run(lambda: any(t is left for t, _ in sub.released))
    net.run(lambda: not pub.store.delivery and not pub.core.s.consumers)


def test_a_group_gets_its_high_priority_events_once_each():
    net = Network(ack_timeout=1.0, resend_max=2.0, window=10)
    pub = net.node("pub")
    members = [net.node("m0"), net.node("m1")]
    join(net, pub, members, group="g")
    ids = pub.publish(TOPIC, *range(30)) + pub.publish(TOPIC, *range(30), priority=3)
    net.run(lambda: pub.core.idle() and len(handled_ids(*members)) == 60, seconds=30)
    assert handled_ids(*members) == Counter(ids)
