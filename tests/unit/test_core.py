"""The delivery core, unit-tested without sockets, disks or sleeps: cores on in-memory
stores, joined by an in-memory network, on a clock that moves only when told to."""

import ast
from pathlib import Path

import pytest

from servicebus import protocol as P
from servicebus.testing import FakeStore, Network

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
    assert {"servicebus.core.machine", "servicebus.protocol", "servicebus.stored"} <= seen
    assert not seen & {"servicebus.store", "servicebus.sockets", "servicebus.engine"}


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
    ids = pub.publish(TOPIC, b"1", b"2", b"3")
    # The receiver's ack for the middle one is lost: only it is owed after a restart.
    net.lose = lambda s, d, f: isinstance(f, P.Ack) and ids[1] in f.ids
    net.run(lambda: len(sub.handled) == 3)
    # Acks come back one by one as resends (with jitter) go one by one: wait until the
    # store holds the first and the last as acknowledged.
    net.run(lambda: [(r["floor"], r["acked"]) for r in pub.store.delivery.values()] == [(ids[0], [ids[2]])])
    net.lose = lambda s, d, f: False
    before = len(net.log)
    pub.stop()
    pub.start()
    net.run(lambda: pub.core.idle(), seconds=30)
    net.run(seconds=5)  # and nothing more afterwards
    resent = [env.id for s, d, f in net.log[before:] if isinstance(f, P.Batch) for env in f.messages]
    assert resent == [ids[1]]
    assert sub.payloads() == [b"1", b"2", b"3"]


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
    net.run(lambda: len(up.handled) == 2, seconds=0.5)
    assert up.payloads() == [b"a", b"b"] and not down.handled
    assert not pub.core.idle()  # still owed to the one that is down
    down.start()
    net.run(lambda: len(down.handled) == 2, seconds=5)
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
    ids = pub.publish(TOPIC, *[b"%d" % i for i in range(10)])
    net.run(seconds=3)
    sent = {env.id for b in net.sent(pub.address, sub.address, P.Batch) for env in b.messages}
    assert sent == set(ids[:4])
    net.lose = lambda s, d, f: False
    net.run(lambda: len(sub.handled) == 10 and pub.core.idle(), seconds=10)
    assert sub.payloads() == [b"%d" % i for i in range(10)]


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
    net.run(lambda: len(sub.handled) == 2, seconds=3)
    assert sub.payloads() == [b"a", b"b"]


def test_a_subscribe_naming_an_address_that_cannot_be_connected_changes_nothing():
    net = Network()
    pub = net.node("pub")
    pub.core.on_router(b"x", P.Subscribe("i1", TOPIC, "ipc://bad-addr", "forger"), 0.0)
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
