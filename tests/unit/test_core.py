"""The delivery core, unit-tested without sockets, disks or sleeps: cores on in-memory
stores, joined by an in-memory network, on a clock that moves only when told to."""

import ast
import os
from pathlib import Path

import msgpack
import pytest

from servicebus.wire import protocol as P
from servicebus.wire.decoding import decode
from servicebus.model.config import BusConfig
from servicebus.model.segments import make_blob
from servicebus.wire.payload import encode_payload
from servicebus.wire.policy import AddressPolicy, OwnAddress
from servicebus.testing import FakeStore, Network

LOCAL = f"localhost:{os.getuid()}:{os.getgid()}:1"  # a Unix-socket peer of this user

TOPIC = "orders"


@pytest.fixture
def net():
    return Network(ack_timeout=1.0, resend_max=2.0)


def subscribed(net, pub, sub, topic=TOPIC):
    confirmed = sub.subscribe(pub.address, topic)
    net.run(lambda: any(token is confirmed for token, _ in sub.released))


def drop_first(kind, src=None):
    """A ``lose`` rule that drops the first frame of ``kind`` (from ``src``) only."""
    dropped = []

    def lose(s, d, frame):
        if not dropped and isinstance(frame, kind) and src in (None, s):
            dropped.append(frame)
            return True
        return False
    return lose, dropped


def _imports(path, package):
    """Absolute names of the modules ``path`` (a module of ``package``) imports."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                names.append(node.module or "")
                continue
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
            names += [module] if node.module else [f"{module}.{a.name}" for a in node.names]
    return names


def test_the_core_and_every_module_it_imports_use_neither_zmq_nor_plyvel():
    root = Path(__file__).parents[2]
    todo, seen = ["servicebus.core"], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = root / (name.replace(".", "/") + ".py")
        package = name.rsplit(".", 1)[0]
        if not path.exists():
            path, package = root / name.replace(".", "/") / "__init__.py", name
            assert path.exists(), name
        if name == "servicebus.core":
            todo += [f"servicebus.core.{p.stem}" for p in path.parent.glob("*.py") if p.stem != "__init__"]
        for imported in _imports(path, package):
            assert imported.split(".")[0] not in ("zmq", "plyvel"), f"{name} imports {imported}"
            if imported.startswith("servicebus.") and imported != "servicebus":
                todo.append(imported)
    assert {"servicebus.core.machine", "servicebus.wire.protocol", "servicebus.model.stored"} <= seen
    assert not seen & {"servicebus.store", "servicebus.engine.sockets", "servicebus.engine.loop"}


def test_a_lost_ack_is_resent_with_attempt_2_and_the_receiver_acks_again_without_handling_twice(net):
    pub, sub = net.node("pub"), net.node("sub")
    subscribed(net, pub, sub)
    net.lose, dropped = drop_first(P.Ack, src=sub.address)
    [mid] = pub.publish(TOPIC, b"one")
    net.run(lambda: pub.core.idle() and dropped)

    batches = net.sent(pub.address, sub.address, P.Batch)
    assert [(env.id, env.attempt) for b in batches for env in b.messages] == [(mid, 1), (mid, 2)]
    assert sub.payloads() == [b"one"]
    assert sub.core.s.counters["duplicates"] == 1
    assert [list(a.ids) for a in net.sent(sub.address, pub.address, P.Ack)][-2:] == [[mid], [mid]]


def test_a_core_restarted_from_its_store_never_resends_what_was_acked(net):
    pub, sub = net.node("pub"), net.node("sub")
    subscribed(net, pub, sub)
    # Three publishes: three segments, acked by key (a publish of two, of one, of two).
    segments = [pub.publish(TOPIC, b"1", b"1b"), pub.publish(TOPIC, b"2"), pub.publish(TOPIC, b"3", b"3b")]
    keys = [ids[0] for ids in segments]
    # The receiver's ack for the middle one is lost: only it is owed after a restart.
    net.lose = lambda s, d, f: isinstance(f, P.Ack) and keys[1] in f.ids
    net.run(lambda: len(sub.handled) == 3)
    # Acks come back one by one as resends (with jitter) go one by one: wait until the
    # store holds the first and the last as acknowledged.
    net.run(lambda: [(r["floor"], r["acked"]) for r in pub.store.delivery.values()] == [(keys[0], [keys[2]])])
    net.lose = lambda s, d, f: False
    before = len(net.log)
    pub.stop()
    pub.start()
    net.run(lambda: pub.core.idle(), seconds=30)
    net.run(seconds=5)  # and nothing more afterwards
    resent = [(env.id, env.ids) for s, d, f in net.log[before:] if isinstance(f, P.Batch) for env in f.messages]
    assert resent == [(keys[1], tuple(segments[1]))]
    assert sub.payloads() == [b"1", b"1b", b"2", b"3", b"3b"]


def test_a_subscribe_is_retried_until_confirmed_and_is_idempotent_on_both_sides(net):
    pub, sub = net.node("pub"), net.node("sub")
    pub.stop()
    confirmed = sub.subscribe(pub.address, TOPIC)
    net.run(seconds=3)  # nobody listens: the intent waits, stored
    assert [r["confirmed"] for r in sub.store.intent.values()] == [False]
    pub.start()
    net.lose, dropped = drop_first(P.Ack, src=pub.address)  # the first confirmation is lost
    net.run(lambda: any(token is confirmed for token, _ in sub.released), seconds=5)
    assert dropped and len(net.sent(sub.address, pub.address, P.Subscribe)) >= 2
    assert [r["confirmed"] for r in sub.store.intent.values()] == [True]
    assert list(pub.store.subs) == [(sub.address, TOPIC)]
    since = pub.store.subs[(sub.address, TOPIC)]["since"]

    again = sub.subscribe(pub.address, TOPIC)  # a second subscribe changes nothing at the publisher
    net.run(lambda: any(token is again for token, _ in sub.released))
    assert pub.store.subs == {(sub.address, TOPIC): pub.store.subs[(sub.address, TOPIC)]}
    assert pub.store.subs[(sub.address, TOPIC)]["since"] == since
    assert len(pub.core.s.consumers) == 1


def test_a_subscriber_that_is_down_does_not_hold_up_another(net):
    pub, down, up = net.node("pub"), net.node("down"), net.node("up")
    subscribed(net, pub, down)  # first: looked at first on every turn
    subscribed(net, pub, up)
    down.stop()
    pub.publish(TOPIC, b"a", b"b")
    net.run(lambda: len(up.handled_ids()) == 2, seconds=0.5)
    assert up.payloads() == [b"a", b"b"] and not down.handled
    assert not pub.core.idle()  # still owed to the one that is down
    down.start()
    net.run(lambda: len(down.handled_ids()) == 2, seconds=5)
    net.run(lambda: pub.core.idle())


def test_a_command_whose_ttl_passes_while_its_receiver_is_down_is_a_dead_letter_at_the_sender(net):
    sender, receiver = net.node("sender"), net.node("receiver")
    receiver.stop()
    sender.send(receiver.address, "charge", b"x", ttl=2.0)
    net.run(lambda: sender.store.letters, seconds=5)
    [letter] = sender.store.letters.values()
    assert letter["reason"] == "expired" and letter["peer"] == receiver.address
    receiver.start()
    net.run(seconds=5)
    assert not receiver.handled
    assert sender.core.idle()


def test_no_more_than_a_window_of_messages_is_in_flight_to_one_subscriber():
    net = Network(window=4, ack_timeout=1.0, resend_max=2.0)
    pub, sub = net.node("pub"), net.node("sub")
    subscribed(net, pub, sub)
    net.lose = lambda s, d, f: isinstance(f, P.Ack) and s == sub.address
    # One publish per message: each a segment of one, each taking one place in the window.
    ids = [mid for i in range(10) for mid in pub.publish(TOPIC, b"%d" % i)]
    net.run(seconds=3)
    sent = {mid for b in net.sent(pub.address, sub.address, P.Batch) for env in b.messages for mid in env.ids}
    assert sent == set(ids[:4])
    net.lose = lambda s, d, f: False
    net.run(lambda: len(sub.handled_ids()) == 10 and pub.core.idle(), seconds=10)
    assert sub.payloads() == [b"%d" % i for i in range(10)]


def test_a_window_counts_messages_when_publishes_hold_several():
    net = Network(window=4, ack_timeout=1.0, resend_max=2.0)
    pub, sub = net.node("pub"), net.node("sub")
    subscribed(net, pub, sub)
    net.lose = lambda s, d, f: isinstance(f, P.Ack) and s == sub.address
    segments = [pub.publish(TOPIC, *[b"%d.%d" % (i, j) for j in range(3)]) for i in range(5)]
    net.run(seconds=3)
    sent = {mid for b in net.sent(pub.address, sub.address, P.Batch) for env in b.messages for mid in env.ids}
    # A segment is taken whole while any room is left: the first two (6 messages), no more.
    assert sent == set(segments[0] + segments[1])
    net.lose = lambda s, d, f: False
    net.run(lambda: len(sub.handled_ids()) == 15 and pub.core.idle(), seconds=10)
    assert sub.handled_ids() == [mid for ids in segments for mid in ids]


@pytest.mark.parametrize("big", [
    0,
    1,
], ids=["the first (its key)", "another"])
def test_a_message_too_large_for_a_receiver_is_refused_alone_and_the_rest_of_its_segment_delivered(big):
    # The receiver's limit is lower than what it told the publisher (it was restarted with
    # a smaller max_payload): the publisher sends the whole segment, the receiver refuses the
    # one message by its id (NACK) and takes the others.
    net = Network(ack_timeout=1.0, resend_max=2.0)
    pub, sub = net.node("pub"), net.node("sub")
    subscribed(net, pub, sub)
    net.config = BusConfig(max_payload=1000)  # what the receiving side now decodes frames with
    payloads = [b"a", b"b", b"c"]
    payloads[big] = b"x" * 2000
    ids = pub.publish(TOPIC, *payloads)
    net.run(lambda: pub.core.idle() and sub.handled, seconds=10)
    net.run(seconds=3)
    assert [tuple(n.ids) for n in net.sent(sub.address, pub.address, P.Nack)] == [(ids[big],)]
    assert sub.handled_ids() == [m for m in ids if m != ids[big]]
    assert sorted(pub.store.letters) == [ids[big]]  # the one refused, and only it
    assert pub.store.letters[ids[big]]["reason"] == "refused"


def test_a_subscriber_that_restarts_gets_what_it_was_owed_at_once_not_after_the_backoff():
    net = Network(ack_timeout=60.0, resend_max=60.0)
    pub, sub = net.node("pub"), net.node("sub")
    subscribed(net, pub, sub)
    net.lose = lambda s, d, f: isinstance(f, P.Batch)  # lost on the way: resent in 60 s
    pub.publish(TOPIC, b"a", b"b")
    net.run(lambda: net.sent(pub.address, sub.address, P.Batch))
    net.lose = lambda s, d, f: False
    sub.stop()
    sub.start()  # a new boot id: the publisher sends what it had in flight again now
    net.run(lambda: len(sub.handled_ids()) == 2, seconds=3)
    assert sub.payloads() == [b"a", b"b"]


def test_a_subscribe_naming_an_address_that_cannot_be_connected_changes_nothing():
    net = Network()
    pub = net.node("pub")
    pub.core.on_router(b"x", P.Subscribe("i1", TOPIC, "ipc://bad-addr", "forger"), 0.0, LOCAL)
    net.run(seconds=0.1)
    assert pub.core.s.malformed["bad_address"] == 1
    assert not pub.store.subs and not pub.core.s.peers


def test_a_fake_store_keeps_only_what_was_written():
    store = FakeStore()
    batch = store.batch()
    batch.put_outgoing("e:t", "1", b"r")
    assert store.stream_names() == []
    store.write(batch, sync=True)
    assert store.iter_stream("e:t") == [("1", b"r")] and store.fsyncs == 1


# --- addresses off the wire (issue 14) ------------------------------------------------------


@pytest.mark.parametrize("address, source, allow, refused", [
    ("tcp://10.0.0.1:3", "127.0.0.1", (), "not_source_host"),
    ("tcp://10.0.0.1:3", "10.0.0.1", (), None),
    ("tcp://127.0.0.2:5", "127.0.0.1", (), None),  # every loopback address is this host
    ("tcp://localhost:5", "127.0.0.1", (), None),
    ("tcp://[::1]:5", "127.0.0.1", (), None),
    ("tcp://orders.internal:5", "10.0.0.7", (), "host_name_not_allowed"),
    ("tcp://orders.internal:5", "10.0.0.7", ("orders.internal",), None),
    ("tcp://10.9.8.7:5", "192.168.1.1", ("10.0.0.0/8",), None),
    ("tcp://10.9.8.7:5", "192.168.1.1", ("0.0.0.0/0",), None),
    ("ipc:///any/socket", "127.0.0.1", (), "ipc_from_network"),
    ("ipc:///any/socket", LOCAL, (), None),
    ("ipc:///any/socket", "localhost:65534:65534:9", (), "ipc_other_user"),
    ("ipc:///run/services/a", "127.0.0.1", ("ipc:///run/services/",), None),
    ("inproc://x", LOCAL, (), "not_tcp_or_ipc"),
    ("tcp://10.0.0.1:3", None, (), "not_source_host"),
])
def test_an_address_off_the_wire_is_allowed_only_on_its_source_host_or_an_allow_list(
        address, source, allow, refused):
    assert AddressPolicy(allow, uid=os.getuid()).refuse(address, source) == refused


@pytest.mark.parametrize("own, address, is_own", [
    (("tcp://127.0.0.1:5",), "tcp://127.0.0.1:5", True),
    (("tcp://127.0.0.1:5",), "tcp://localhost:5", True),
    (("tcp://127.0.0.1:5",), "tcp://LOCALHOST:5", True),
    (("tcp://127.0.0.1:5",), "tcp://127.0.0.2:5", False),  # another address: another bus may be there
    (("tcp://127.0.0.1:5",), "tcp://127.0.0.1:6", False),
    (("tcp://10.0.0.5:5", "tcp://0.0.0.0:5"), "tcp://127.0.0.9:5", True),  # bound on every interface
    (("tcp://10.0.0.5:5", "tcp://*:5"), "tcp://localhost:5", True),
    (("tcp://10.0.0.5:5", "tcp://0.0.0.0:5"), "tcp://10.0.0.5:5", True),
    (("tcp://10.0.0.5:5", "tcp://0.0.0.0:5"), "tcp://10.0.0.6:5", False),  # learnt from a pong, if so
    (("tcp://10.0.0.5:5", "tcp://10.0.0.5:5"), "tcp://127.0.0.1:5", False),
    (("ipc:///run/sb/bus.sock",), "ipc:///run/sb/../sb//bus.sock", True),
    (("ipc:///run/sb/bus.sock",), "ipc:///run/sb/other.sock", False),
    (("ipc:///run/sb/bus.sock",), "tcp://127.0.0.1:5", False),
])
def test_a_bus_knows_its_own_address_in_the_forms_it_can_tell_without_asking(own, address, is_own):
    assert (address in OwnAddress(own)) is is_own


def test_an_alias_of_its_own_address_is_learnt_from_a_pong():
    own = OwnAddress(("tcp://127.0.0.1:5",))
    assert "tcp://host.example:5" not in own
    own.learn("tcp://host.example:5")
    assert "tcp://host.example:5" in own and "tcp://host.example:6" not in own


@pytest.mark.parametrize("entry", ["", "ipc://", "not a host", "10.0.0.0/33"])
def test_a_bad_allow_peers_entry_is_refused_when_the_bus_is_configured(entry):
    from servicebus.model.config import BusConfig
    with pytest.raises(ValueError, match="allow_peers"):
        BusConfig(allow_peers=(entry,))


def test_a_forged_subscriber_address_is_not_connected_to_and_nothing_is_stored():
    net = Network()
    pub, forger = net.node("tcp://127.0.0.1:1000"), net.node("tcp://127.0.0.1:1001")
    pub.core.on_router(forger.address.encode(), P.Subscribe("i1", TOPIC, "tcp://10.0.0.1:3", "forger"),
                       0.0, "127.0.0.1")
    net.run(seconds=0.1)
    assert pub.core.s.counters["refused_not_source_host"] == 1
    assert not pub.store.subs and not pub.core.s.peers
    assert net.sent(pub.address, forger.address, P.Nack)  # the sender is told why


def test_a_forged_unsubscribe_does_not_end_a_subscription():
    net = Network()
    pub, sub = net.node("pub"), net.node("sub")
    sub.subscribe(pub.address, TOPIC)
    net.run(lambda: pub.store.subs, seconds=5)
    pub.core.on_router(b"x", P.Unsubscribe("i2", TOPIC, sub.address, "forger"), net.clock.monotonic(),
                       "10.6.6.6")
    net.run(seconds=0.1)
    assert pub.store.subs and pub.core.s.counters["refused_ipc_from_network"] == 1


def test_a_subscription_is_stored_only_once_its_address_answers_a_ping():
    net = Network()
    pub = net.node("pub")
    pub.core.on_router(b"x", P.Subscribe("i1", TOPIC, "ipc://nobody-home", "n"),
                       net.clock.monotonic(), LOCAL)
    net.run(seconds=1)
    assert not pub.store.subs and "ipc://nobody-home" in pub.core.handshake.unverified
    net.run(seconds=31)  # PROBATION: the connection is dropped, nothing was ever stored
    assert not pub.store.subs and not pub.core.s.peers
    assert pub.core.s.counters["refused_unanswered"] == 1


def test_one_connection_cannot_keep_more_than_a_few_unanswered_addresses_nor_more_than_max_peers():
    net = Network(max_peers=40)
    pub = net.node("pub")
    for n in range(100):
        pub.core.on_router(b"x", P.Subscribe(f"i{n}", TOPIC, f"ipc://ghost{n}", "n"), net.clock.monotonic(),
                           LOCAL)
    net.run(seconds=0.1)
    counters = pub.core.s.counters
    assert len(pub.core.s.peers) == 16 and counters["refused_too_many_unanswered"] == 84
    for conn in range(3):  # other connections: up to max_peers / 2 waiting in all
        for n in range(10):
            pub.core.on_router(b"y%d" % conn, P.Subscribe(f"j{n}", TOPIC, f"tcp://127.0.0.1:{conn * 10 + n + 1}",
                                                          "n"), net.clock.monotonic(), "127.0.0.1")
    net.run(seconds=0.1)
    assert len(pub.core.s.peers) == 20 and counters["refused_too_many_unanswered"] == 84 + 26
    assert not pub.store.subs


def test_a_real_subscriber_is_confirmed_through_the_ping_and_gets_its_messages():
    net = Network()
    pub, sub = net.node("pub"), net.node("sub")
    sub.subscribe(pub.address, TOPIC)
    net.run(lambda: pub.store.subs, seconds=5)
    pub.publish(TOPIC, b"a")
    net.run(lambda: sub.handled, seconds=5)
    assert sub.payloads() == [b"a"]


def test_a_request_whose_reply_address_is_forged_is_refused_not_stored():
    net = Network()
    server = net.node("tcp://127.0.0.1:2000")
    frames = P.encode_batch(P.Kind.COMMAND, "forger", "tcp://10.0.0.1:3",
                            [P.Envelope("m1", "work", 1, make_blob([b"\x01"]), 1, None, "c1", {}, ("m1",))])
    server.core.on_router(b"x", decode(frames, max_payload=1 << 20), 0.0, "127.0.0.1")
    net.run(seconds=0.1)
    assert not server.store.incoming and not server.core.s.peers
    assert server.core.s.counters["refused_not_source_host"] == 1


def test_a_new_address_beyond_max_peers_is_refused_with_the_option_named():
    net = Network(max_peers=2)
    pub = net.node("pub")
    pub.core.roster.peer("ipc://a")
    pub.core.roster.peer("ipc://b")
    with pytest.raises(ValueError, match="max_peers"):
        pub.core.roster.peer("ipc://c")
    assert pub.core.roster.peer("ipc://a")  # a known one is still fine


def test_a_handlers_outbox_command_is_moved_into_its_stream_once_even_if_queued_twice(net):
    from servicebus.core import QueueSend
    from servicebus.model.stored import OutboxSend

    sender, receiver = net.node("sender"), net.node("receiver")
    key = "01handled\x00h:000000"
    send = OutboxSend(receiver.address, "charge", encode_payload({"n": 1}), None, None, None)
    sender.store.sends[key] = send  # stored by the write that finished the handler's run
    sender.stop()
    sender.start()  # a restart queues what the outbox holds ...
    assert [type(c) for c in sender.commands] == [QueueSend]
    sender.commands.append(QueueSend(key, send))  # ... and the worker queued it too
    net.run(lambda: receiver.handled, seconds=5)
    net.run(seconds=3)
    assert receiver.payloads() == [{"n": 1}]
    assert sender.store.sends == {}
    assert sender.core.s.counters["commands_sent"] == 1


def test_a_max_batch_larger_than_any_receiver_takes_in_one_frame_is_refused_when_the_bus_is_configured():
    # A receiver drops a frame of more than MAX_BATCH messages whole: the publisher would
    # resend the same frames for ever.
    from servicebus.model.config import BusConfig
    assert BusConfig(max_batch=P.MAX_BATCH).max_batch == P.MAX_BATCH
    with pytest.raises(ValueError, match="max_batch"):
        BusConfig(max_batch=P.MAX_BATCH + 1)


def test_a_payload_that_does_not_decode_is_stored_and_acked_with_its_segment_not_set_apart_on_receipt():
    # Moved: a payload is no longer decoded on receipt (SB2 carries payloads as the
    # publisher stored them). The segment holding one is stored, acked and handed over like
    # any other, once: the handler's run makes that message alone a dead letter
    # (test_segment_run.py: test_a_payload_that_does_not_decode_is_a_dead_letter_of_its_own_...).
    net = Network()
    sub = net.node("tcp://127.0.0.1:2001")
    old = net.node("tcp://127.0.0.1:2002")  # the sender: only the acks it gets are looked at
    raw = b"\x81\x92\x01\x02\x03"  # {[1, 2]: 3}: a key no receiver can hash
    envs = [P.Envelope("m0", TOPIC, 1, make_blob([encode_payload(0)]), 1, None, None, {}, ("m0",)),
            P.Envelope("m1", TOPIC, 1, make_blob([encode_payload(1), raw, encode_payload(3)]), 1, None, None, {},
                       ("m1", "m1b", "m1c")),
            P.Envelope("m2", TOPIC, 1, make_blob([encode_payload(2)]), 1, None, None, {}, ("m2",))]
    frame = decode(P.encode_batch(P.Kind.EVENT, "old", old.address, envs), max_payload=1 << 20)
    assert frame.invalid == () and [env.id for env in frame.messages] == ["m0", "m1", "m2"]
    for _ in range(2):  # and once more, as a resend: nothing twice
        sub.core.on_router(old.address.encode(), frame, net.clock.monotonic(), "127.0.0.1")
        net.run(seconds=0.1)
    assert sub.handled_ids() == ["m0", "m1", "m1b", "m1c", "m2"]
    assert sub.store.letters == {} and sorted(sub.store.handled) == ["m0", "m1", "m2"]
    [handed] = [item for item in sub.handled if item.id == "m1"]
    assert handed.record.blob == envs[1].body  # as it came, undecodable payload and all
    acked = [key for ack in net.sent(sub.address, old.address, P.Ack) for key in ack.ids]
    assert sorted(acked) == ["m0", "m0", "m1", "m1", "m2", "m2"]
    assert sub.core.s.counters["duplicates"] == 5  # the resend's five messages
    assert not sub.core.s.malformed


def segment_meta(key, topic=TOPIC, sent=1, attempt=1, expires=None, corr=None, headers=None, ids=None):
    """A segment's header array as a sender puts it in an SB2 frame."""
    return [key, topic, sent, attempt, expires, corr, {} if headers is None else headers,
            [key] if ids is None else ids]


def raw_batch(reply_to, metas, now=None, kind=P.Kind.EVENT, blobs=None):
    """A batch frame as an older or hostile sender makes it: segment header arrays as given,
    each segment's blob of one payload per id it names (the n-th payload: n)."""
    head = {"sender": "old", "reply_to": reply_to, "segs": metas}
    if now is not None:
        head["now"] = now
    if blobs is None:
        blobs, n = [], 0
        for meta in metas:
            count = len(meta[7]) if isinstance(meta, list) and len(meta) > 7 and isinstance(meta[7], list) else 1
            blobs.append(make_blob([encode_payload(n + i) for i in range(count)]))
            n += count
    return decode([P.MAGIC, bytes([kind]), msgpack.packb(head), *blobs], max_payload=1 << 20)


def test_a_message_with_a_bad_field_is_a_dead_letter_acked_and_the_rest_of_its_frame_is_handled():
    # Now by segment: one whose own fields are not valid is one dead letter under its key,
    # its header (with its messages' ids) and blob kept as they came, and acked.
    net = Network()
    sub = net.node("tcp://127.0.0.1:2001")
    old = net.node("tcp://127.0.0.1:2002")  # the sender: only the acks it gets are looked at
    metas = [segment_meta("m0"), segment_meta("m1", ids=["m1", "m1b"]), segment_meta("m2")]
    metas[1][1] = "bad topic"
    frame = raw_batch(old.address, metas)
    for _ in range(2):  # and once more, as a resend: nothing twice
        sub.core.on_router(old.address.encode(), frame, net.clock.monotonic(), "127.0.0.1")
        net.run(seconds=0.1)
    assert sub.payloads() == [0, 3] and sorted(sub.store.handled) == ["m0", "m2"]
    letter = sub.store.letters["m1"]
    assert list(sub.store.letters) == ["m1"]  # one dead letter, named by the segment's key
    assert (letter["origin"], letter["reason"], letter["topic"], letter["kind"]) == (
        "incoming", "invalid", "bad topic", "event")
    assert letter["error"].startswith("topic 'bad topic' contains a whitespace")
    assert msgpack.unpackb(letter["header"]) == metas[1]  # its ids in it: ["m1", "m1b"]
    assert letter["body"] == make_blob([encode_payload(1), encode_payload(2)])
    assert (letter["sender"], letter["reply_to"]) == ("old", old.address)
    assert "not_replayable" in letter  # its fields cannot make a message to handle
    acked = [mid for ack in net.sent(sub.address, old.address, P.Ack) for mid in ack.ids]
    assert sorted(acked) == ["m0", "m0", "m1", "m1", "m2", "m2"]  # all of them, each time
    assert sub.core.s.counters["invalid"] == 1 and sub.core.s.counters["duplicates"] == 3
    assert sub.core.s.counters["received"] == 8  # messages: 4 a frame
    assert not sub.core.s.malformed


def test_a_message_with_a_bad_field_in_a_command_frame_from_a_refused_address_is_refused_with_the_rest():
    net = Network()
    server = net.node("tcp://127.0.0.1:2000")
    metas = [segment_meta("m1", "work", corr="c1"), segment_meta("m2", "work", attempt=0, corr="c2")]
    head = {"sender": "forger", "reply_to": "tcp://10.0.0.1:3", "segs": metas}
    frame = decode([P.MAGIC, bytes([P.Kind.COMMAND]), msgpack.packb(head),
                    make_blob([b"\x01"]), make_blob([b"\x02"])], max_payload=1 << 20)
    assert [m.id for m in frame.invalid] == ["m2"]
    server.core.on_router(b"x", frame, 0.0, "127.0.0.1")
    [(_, nack)] = server.core.take_router_frames()
    assert decode(nack, max_payload=1 << 20).ids == ("m1", "m2")  # both refused, neither kept
    net.run(seconds=0.1)
    assert not server.store.incoming and not server.store.letters


def test_a_ttl_moved_onto_this_bus_clock_stays_within_what_a_datetime_shows():
    # "now" says how far the sender's clock is behind ours: its expires is moved by that
    # much, and must not land past the year 9999 (Message.expires is a datetime).
    net = Network()
    sub = net.node("tcp://127.0.0.1:2001")
    last = 253_402_300_800_000 - 1
    frame = raw_batch("tcp://127.0.0.1:2002", [segment_meta("m0", expires=last)], now=0)
    sub.core.on_router(b"x", frame, net.clock.monotonic(), "127.0.0.1")
    net.run(seconds=0.1)
    [item] = sub.handled
    assert item.record.expires == last
