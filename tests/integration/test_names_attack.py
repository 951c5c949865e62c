"""Attacks on services by name and discovery (core/members.py), on loopback.

Each test states a promise of the feature and fails while it is broken. A raw ZeroMQ
DEALER plays the hostile peer: it speaks the wire protocol (wire/protocol.py) to a bus's
ROUTER. A raw ROUTER (``_Impostor``) plays a bus that answers pings and acks batches."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import zmq

from servicebus import Bus
from servicebus.engine import loop as E
from servicebus.testing import free_address, wait_until
from servicebus.wire import protocol as P
from servicebus.wire.decoding import decode

from ..conftest import counting_handler
from .test_names import _knows

FAST = {"gossip_interval": 0.2, "down_after": 1.0}
MAX = 1 << 26


@pytest.fixture
def buses(tmp_path):
    opened: list[Bus] = []

    def make(name: str | None, *, address: str | None = None, datadir: str | None = None, **options) -> Bus:
        opts = {**FAST, **options}
        if name is not None:
            opts["name"] = name
        bus = Bus(address or free_address(), tmp_path / (datadir or name or "anon"), **opts)
        opened.append(bus)
        return bus

    yield make
    for bus in opened:
        try:
            bus.close()
        except Exception:  # noqa: BLE001 - closed by the test already
            pass


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _row(bus: Bus, node: str) -> dict | None:
    return next((m for m in bus.fleet() if m["node"] == node), None)


def _table(ctx: zmq.Context, address: str) -> P.Gossip:
    """What any stranger gets by gossiping an empty table to ``address``: its table."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(address)
    try:
        dealer.send_multipart(P.encode_gossip("stranger", []))
        assert dealer.poll(10_000), "no answer to a gossip"
        frame = decode(dealer.recv_multipart(), max_payload=MAX)
        assert isinstance(frame, P.Gossip)
        return frame
    finally:
        dealer.close(0)


def _fake(n: int, name: str, address: str, topics: int = 0, beat: int = 1) -> dict:
    return {"node": f"fake{n:012d}", "name": name, "address": address, "epoch": 1, "beat": beat,
            "pub": [f"t{n}.{i}." + "x" * 230 for i in range(topics)], "sub": [], "v": "0.3"}


class _Impostor:
    """A ROUTER that acts as a bus: answers pings, acks every batch, keeps what it got.
    With ``node``: answers gossip as that node id (another bus's) and keeps the proofs
    it is sent."""

    def __init__(self, ctx: zmq.Context, node: str | None = None) -> None:
        self.address = free_address()
        self.node = node
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.bind(self.address)
        self.got: list[str] = []
        self.proofs: list[str | None] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, *frames = self.sock.recv_multipart()
            try:
                frame = decode(frames, max_payload=MAX)
            except Exception:  # noqa: BLE001
                continue
            if isinstance(frame, P.Gossip) and self.node is not None:
                self.proofs.append(frame.proof)
                if not frame.reply:
                    self.sock.send_multipart([ident, *P.encode_gossip(self.node, [], reply=True)])
            elif isinstance(frame, P.Ping):
                self.sock.send_multipart([ident, *P.encode_pong("impostor", "boot-1")])
            elif isinstance(frame, P.Batch):
                ids = [env.id for env in frame.messages]
                self.got.extend(ids)
                self.sock.send_multipart([ident, *P.encode_ack(ids)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)


# --- hostile gossip --------------------------------------------------------------------


def test_a_forged_gossip_naming_a_subscribers_node_id_must_not_move_its_events_to_the_forger(buses, ctx):
    """members.py: 'an instance's address only from the instance itself ... nobody can move
    another instance's backlog by announcing an address'. A stranger learns the
    subscriber's node id from the publisher's own answer, then gossips that node id (as
    the frame's sender) with an address of its own host: the publisher moves the
    subscription there, the stranger acks, the real subscriber never gets the events."""
    orders = buses("orders")
    email = buses("email", seeds=[orders.address])
    got = counting_handler(email, "order.placed")
    email.subscribe("orders", "order.placed", wait=10)
    victim = next(m for m in _table(ctx, orders.address).members if m.name == "email")
    impostor = _Impostor(ctx)
    forger = ctx.socket(zmq.DEALER)
    forger.connect(orders.address)
    try:
        forged = {**victim.wire(), "address": impostor.address}
        for n in range(20):
            forger.send_multipart(P.encode_gossip(victim.node, [forged]))  # "I am email, I moved"
            orders.publish("order.placed", {"n": n})
        # Every event reaches the real subscriber, none the forger.
        wait_until(lambda: len(got) == 20 or len(impostor.got) == 20, timeout=15)
        forger.send_multipart(P.encode_gossip("stranger", []))  # stop forging; let it settle
        wait_until(lambda: len(got) + len(impostor.got) >= 20, timeout=15)
        assert impostor.got == [], (f"a stranger took {len(impostor.got)} of the subscriber's events "
                                    f"(and acked them); the subscriber got {len(got)} of 20")
    finally:
        forger.close(0)
        impostor.close()


@pytest.mark.parametrize("first", [False, True], ids=["after-they-met", "before-they-met"])
def test_a_stranger_who_gossips_as_the_publisher_must_not_get_the_subscribers_proof_for_it(buses, ctx, first):
    """The proof an instance sends a publisher must not be handed to whoever names the
    publisher's node id: a stranger gossips to the subscriber as the publisher (its node id
    is in any answer of the publisher), takes the proof from the answer, then tells the
    publisher "email moved here" with it and acks the subscriber's events. ``first``: the
    stranger comes before the subscriber ever met the publisher, which then keeps the
    same proof (trust on first use) when the subscriber subscribes (an answer on first
    contact gave it before)."""
    orders = buses("orders")
    email = buses("email", **({} if first else {"seeds": [orders.address]}))
    got = counting_handler(email, "order.placed")
    orders_node = _table(ctx, orders.address).sender
    stranger = ctx.socket(zmq.DEALER)
    stranger.connect(email.address)
    impostor = _Impostor(ctx)
    forger = ctx.socket(zmq.DEALER)
    forger.connect(orders.address)
    try:
        def meet() -> None:
            email.subscribe(orders.address if first else "orders", "order.placed", wait=10)
            wait_until(lambda: orders.counters().get("instances_proven"), timeout=10,
                       message="the publisher to hold the subscriber's proof")

        if not first:
            meet()
        stranger.send_multipart(P.encode_gossip(orders_node, []))  # "I am orders"
        assert stranger.poll(10_000), "no answer"
        stolen = decode(stranger.recv_multipart(), max_payload=MAX).proof
        if first:
            meet()
        victim = next(m for m in _table(ctx, email.address).members if m.name == "email")
        forged = {**victim.wire(), "address": impostor.address, "beat": victim.beat + 100}
        for n in range(20):  # "email moved here", again and again (its own gossip says otherwise)
            forger.send_multipart(P.encode_gossip(victim.node, [forged], proof=stolen))
            orders.publish("order.placed", {"n": n})
        wait_until(lambda: len(got) + len(impostor.got) >= 20, timeout=15)
        assert stolen is None and impostor.got == [], (
            f"the stranger got the proof ({stolen}) and took {len(impostor.got)} of 20 events")
    finally:
        stranger.close(0)
        forger.close(0)
        impostor.close()


def test_a_seed_answering_with_another_instances_node_id_never_gets_the_proof_meant_for_that_instance(
        buses, ctx):
    """A bus sends its proof to a seed or a publisher by address once it knows the node id
    that answered there (they may have no name). A hostile seed that answers as the
    publisher's node id must not get the proof meant for the publisher: with it, it could
    tell the publisher that the subscriber moved to the seed's host and take its events."""
    orders = buses("orders")
    orders_node = next(m for m in _table(ctx, orders.address).members if m.name == "orders").node
    hostile = ctx.socket(zmq.ROUTER)
    address = free_address()
    hostile.bind(address)
    proofs: list[str | None] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not hostile.poll(50):
                continue
            ident, *frames = hostile.recv_multipart()
            try:
                frame = decode(frames, max_payload=MAX)
            except Exception:  # noqa: BLE001
                continue
            if isinstance(frame, P.Gossip):
                proofs.append(frame.proof)
                if not frame.reply:
                    hostile.send_multipart([ident, *P.encode_gossip(orders_node, [], reply=True)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        email = buses("email", seeds=[orders.address, address])
        email.subscribe("orders", "order.placed", wait=10)
        email.subscribe(address, "order.placed")  # a business partner too: gossiped to unasked
        wait_until(lambda: proofs, timeout=10, message="the hostile seed to be gossiped to")
        sent = email.counters()["gossip_sent"]
        wait_until(lambda: email.counters()["gossip_sent"] >= sent + 20, timeout=20)
        assert proofs and all(p is None for p in proofs), f"the hostile seed got a proof: {proofs}"
    finally:
        stop.set()
        thread.join(5)
        hostile.close(0)


def test_a_second_hand_entry_with_a_huge_beat_must_not_rename_an_instance_or_silence_its_own_gossip(buses, ctx):
    """Only the instance raises its (epoch, beat); a second-hand entry is believed for
    everything but its address. A stranger's one frame with the email instance's node id,
    another name and epoch 2**53-1 renames it at the publisher for good: its own gossip
    (a smaller age) is ignored from then on, and ``send("email", ...)`` has no instance."""
    orders = buses("orders")
    buses("email", seeds=[orders.address])
    wait_until(lambda: _knows(orders, "email"), timeout=10)
    victim = next(m for m in _table(ctx, orders.address).members if m.name == "email")
    stranger = ctx.socket(zmq.DEALER)
    stranger.connect(orders.address)
    try:
        forged = {**victim.wire(), "name": "nobody", "epoch": (1 << 53) - 1, "beat": 0}
        stranger.send_multipart(P.encode_gossip("stranger", [forged]))  # second hand: sender is not the node
        assert stranger.poll(10_000)
    finally:
        stranger.close(0)
    # The real instance keeps gossiping every 0.2 s: within a few down_after it must be
    # "email" again and up, as it says itself.
    wait_until(lambda: (_row(orders, victim.node) or {}).get("name") == "email"
               and _row(orders, victim.node)["up"], timeout=5,
               message=lambda: f"the publisher's row for the email instance: {_row(orders, victim.node)}")
    orders.send("email", "note", {"n": 1})


def test_a_flood_of_fake_instances_must_not_lock_real_instances_out_of_discovery(buses, ctx):
    """The table is capped at MAX_MEMBERS 'so a flood must not grow it'; but a stranger's
    one frame of 1000 made-up instances (new instances are believed from anyone) fills it
    for good: nothing is ever forgotten, so a real instance that starts afterwards is
    refused (table_full) and cannot be reached by name."""
    orders = buses("orders")
    stranger = ctx.socket(zmq.DEALER)
    stranger.connect(orders.address)
    try:
        fakes = [_fake(n, "ghost", f"tcp://127.0.0.1:{1 + n % 60000}") for n in range(1000)]
        stranger.send_multipart(P.encode_gossip("stranger", fakes))
        assert stranger.poll(10_000)
    finally:
        stranger.close(0)
    email = buses("email", seeds=[orders.address])
    email.subscribe("orders", "order.placed", wait=10)  # the subscriber learns the publisher ...
    # ... and the publisher, which gets its gossip first hand, must learn the subscriber.
    wait_until(lambda: _knows(orders, "email"), timeout=10,
               message=lambda: f"orders to know email; counters {orders.counters().get('gossip_refused_table_full')}"
                               " gossip entries refused as table_full")


def test_fake_instances_of_a_service_must_not_use_up_a_subscribers_max_peers(buses, ctx):
    """A bus that subscribes to a service by name subscribes to every instance gossip
    names. A stranger gossips 40 made-up instances of that service (new instances from
    anyone): the subscriber connects to each, its max_peers is used up, and a real
    publisher it then subscribes to by address is refused ('max_peers')."""
    email = buses("email", max_peers=32)
    buses("orders", seeds=[email.address])
    email.subscribe("orders", "order.placed", wait=10)
    stranger = ctx.socket(zmq.DEALER)
    stranger.connect(email.address)
    try:
        fakes = [_fake(n, "orders", f"tcp://127.0.0.1:{2 + n}") for n in range(40)]
        stranger.send_multipart(P.encode_gossip("stranger", fakes))
        assert stranger.poll(10_000)
    finally:
        stranger.close(0)
    billing = buses(None, datadir="billing")
    email.subscribe(billing.address, "invoice.paid", wait=10)


def test_a_huge_gossiped_table_must_not_cut_the_publisher_off_from_new_subscribers(buses, ctx):
    """Each gossip frame is bounded (1000 entries, 200 topics each) but the table it
    builds up is not: a stranger's few frames, each under the frame size limit, make the
    publisher's table (and so every answer it gives) larger than any bus takes in one
    frame (ZMQ_MAXMSGSIZE). A subscriber that starts then never learns the publisher, as
    the answer to its gossip is dropped with its connection."""
    orders = buses("orders")
    stranger = ctx.socket(zmq.DEALER)
    stranger.setsockopt(zmq.MAXMSGSIZE, -1)
    stranger.connect(orders.address)
    try:
        for part in range(5):  # 5 frames of 200 entries, 20 topics each: ~1 MB a frame
            fakes = [_fake(part * 200 + n, "ghost", f"tcp://127.0.0.1:{1 + part * 200 + n}", topics=20)
                     for n in range(200)]
            stranger.send_multipart(P.encode_gossip("stranger", fakes, reply=True))
        # What it said is hints, asked and forgotten: no ghost is in the table others get.
        wait_until(lambda: orders.counters().get("gossip_received", 0) >= 5, timeout=15)
        assert len(orders.fleet()) == 1
    finally:
        stranger.close(0)
    email = buses("email", seeds=[orders.address])
    wait_until(lambda: _knows(email, "orders"), timeout=10,
               message="the new subscriber to learn the publisher from its seed")


# --- moves -------------------------------------------------------------------------------


def test_a_publisher_and_a_subscriber_that_move_at_once_find_each_other_again(buses):
    """Both redeployed at once (new ports, same data directories), a hub as their only
    seed: each tells the other's *old* address that it moved, and learns the other's new
    address only second hand (never believed). The events published after the move must
    still reach the subscriber."""
    hub = buses("hub")
    orders = buses("orders", seeds=[hub.address])
    email = buses("email", seeds=[hub.address])
    email.subscribe("orders", "order.placed", wait=10)
    orders.close()
    email.close()
    orders2 = buses("orders", datadir="orders", address=free_address(), seeds=[hub.address])
    email2 = buses("email", datadir="email", address=free_address(), seeds=[hub.address])
    got = counting_handler(email2, "order.placed")
    for n in range(10):
        orders2.publish("order.placed", {"n": n})
    wait_until(lambda: len(got) == 10, timeout=20,
               message=lambda: f"10 events at the moved subscriber, got {len(got)}; the publisher's "
                               f"view: {[(m['name'], m['address'], m['up']) for m in orders2.fleet()]}, "
                               f"email now at {email2.address}")


# --- commands by name ---------------------------------------------------------------------


def test_commands_sent_by_name_to_an_instance_that_is_gone_reach_the_one_still_up(buses):
    """send/request by name: 'one up instance in turn'. One of two instances stops for
    good; commands sent by name in the next moments (it is not known to be down yet) and
    a request after it is known down must all be handled by the instance still up, not
    wait for ever for an address that nobody will listen at again."""
    a = buses("worker", datadir="worker-a")
    b = buses("worker", datadir="worker-b", seeds=[a.address])
    client = buses("client", seeds=[a.address])
    handled: Counter = Counter()
    a.handle("job", lambda payload, message: handled.update([payload["n"]]))
    b.handle("job", lambda payload, message: handled.update([payload["n"]]))
    wait_until(lambda: sum(1 for m in client.fleet() if m["name"] == "worker" and m["up"]) == 2, timeout=10)
    b.close()  # scaled down for good
    # Once it is known down (at once for a clean stop, to the instances it has a
    # connection to; within down_after for the others), every command goes to the one up.
    # Commands sent to it in the moments before stay owed to it (README "Services by
    # name", not built: re-routing them could run one on two instances).
    wait_until(lambda: sum(1 for m in client.fleet() if m["name"] == "worker" and m["up"]) == 1, timeout=10)
    for n in range(10):
        client.send("worker", "job", {"n": n})
    wait_until(lambda: len(handled) == 10, timeout=15,
               message=lambda: f"10 commands handled, {len(handled)} were: {sorted(handled)}")


def test_a_request_by_name_is_answered_by_the_instance_that_is_up(buses):
    a = buses("pricing", datadir="pricing-a")
    b = buses("pricing", datadir="pricing-b", seeds=[a.address])
    web = buses("web", seeds=[a.address])
    a.handle("quote", lambda payload, message: {"by": "a"})
    b.handle("quote", lambda payload, message: {"by": "b"})
    wait_until(lambda: sum(1 for m in web.fleet() if m["name"] == "pricing" and m["up"]) == 2, timeout=10)
    b.close()
    # Known down (a clean stop tells the instances it has a connection to at once; the
    # others see it within down_after): two requests in a row both go to the one up.
    # Before, round robin sent one of them to the stopped instance all the same.
    wait_until(lambda: sum(1 for m in web.fleet() if m["name"] == "pricing" and m["up"]) == 1, timeout=10)
    answers = [web.request("pricing", "quote", {}, timeout=5) for _ in range(2)]
    assert answers == [{"by": "a"}, {"by": "a"}]


# --- kicks, channel roles ------------------------------------------------------------------


def test_an_instance_kicked_by_address_cannot_subscribe_again_until_readmitted(buses):
    """kick(target): 'the instance (node id, or address) ... their subscribes are refused
    until readmit'. Kicked by its address, it subscribes again at once."""
    orders = buses("orders")
    email = buses("email", seeds=[orders.address])
    email.subscribe("orders", "order.placed", wait=10)
    orders.kick(email.address, why="rogue")
    from servicebus.errors import SubscribeRefused
    with pytest.raises(SubscribeRefused, match="kicked"):
        email.subscribe(orders.address, "order.other", wait=5)


def test_a_readmitted_subscriber_gets_events_again_when_it_subscribes_by_name_again(buses):
    """After kick and readmit, the subscriber asks again with the same call it used at
    first (subscribe by name): it must be subscribed again. Its intent to the instance is
    still 'confirmed' (nobody told it of the kick) so the call sends nothing."""
    orders = buses("orders")
    email = buses("email", seeds=[orders.address])
    got = counting_handler(email, "order.placed")
    email.subscribe("orders", "order.placed", wait=10)
    orders.kick("email", why="mistake")
    orders.readmit("email")
    # Waited for: a subscribe not yet made at the publisher misses what is published
    # before it is (as by address). This test waited for nothing while a repeat by name
    # never confirmed (test_subscribing_by_name_again_is_confirmed_at_once).
    email.subscribe("orders", "order.placed", wait=10)
    orders.publish("order.placed", {"n": 1})
    wait_until(lambda: got == Counter({1: 1}), timeout=10,
               message="the event at the readmitted subscriber")


def test_a_writer_the_receiver_has_not_heard_of_yet_is_not_dead_lettered_for_good(buses):
    """Channel roles at the receiver: commands of a topic 'only from the services that
    may write it'. A legitimate writer that learnt of the receiver (second hand, from a
    hub) before the receiver learnt of it gets its command refused for good: a dead
    letter at the sender, though it is exactly the service the roles name."""
    channels = {"mail.*": {"writers": ["orders"]}}
    slow = {"gossip_interval": 3.0, "down_after": 10.0}
    hub = buses("hub", **slow)
    email = buses("email", seeds=[hub.address], channels=channels, **slow)
    wait_until(lambda: _knows(hub, "email"), timeout=10)
    seen = []
    email.handle("mail.send", lambda payload, message: seen.append(payload))
    orders = buses("orders", seeds=[hub.address])
    wait_until(lambda: _knows(orders, "email"), timeout=10)
    orders.send("email", "mail.send", {"n": 1})
    wait_until(lambda: seen or orders.deadletters(), timeout=15)
    assert not orders.deadletters(), f"dead-lettered: {orders.deadletters()[0].error}"
    assert seen == [{"n": 1}]


# --- the engine keeps serving ----------------------------------------------------------


@pytest.mark.parametrize("members", [
    [{"node": "x", "name": "ok", "address": "ipc:///tmp/evil.sock", "epoch": 1, "beat": 1}],
    [{"node": "x", "name": "ok", "address": "tcp://127.0.0.1:1", "epoch": 1.5, "beat": 1}],
    [{"node": "x", "name": "ok", "address": "tcp://127.0.0.1:1", "epoch": True, "beat": 1}],
    [{"node": ["x"], "name": "ok", "address": "tcp://127.0.0.1:1", "epoch": 1, "beat": 1}],
    [{"node": "x", "name": "OK!", "address": "tcp://127.0.0.1:1", "epoch": 1, "beat": 1}],
    [{"node": "x", "name": "ok", "address": "tcp://127.0.0.1:1", "epoch": 1, "beat": 1, "pub": "abc"}],
    [{"node": "x", "name": "ok", "address": "tcp://127.0.0.1:1", "epoch": 1, "beat": 1, "key": 5}],
    "notalist",
    [1, 2, 3],
])
def test_malformed_gossip_is_dropped_and_the_bus_keeps_serving(buses, ctx, members):
    orders = buses("orders")
    email = buses("email", seeds=[orders.address])
    got = counting_handler(email, "order.placed")
    email.subscribe("orders", "order.placed", wait=10)
    stranger = ctx.socket(zmq.DEALER)
    stranger.connect(orders.address)
    try:
        stranger.send_multipart([P.MAGIC, bytes([P.Kind.GOSSIP]),
                                 __import__("msgpack").packb({"sender": "x", "members": members}), b""])
        orders.publish("order.placed", {"n": 1})
        wait_until(lambda: got == Counter({1: 1}), timeout=10)
    finally:
        stranger.close(0)
    assert not any(m["name"] == "ok" for m in orders.fleet())


def test_subscribing_by_name_again_is_confirmed_at_once(buses):
    """An application calls ``subscribe("orders", topic, wait=...)`` at every start. The
    repeat must be confirmed as a repeat of a subscribe by address is; it waits on the
    per-instance intent that is confirmed already, and times out."""
    orders = buses("orders")
    email = buses("email", seeds=[orders.address])
    email.subscribe("orders", "order.placed", wait=10)
    email.subscribe(orders.address, "order.placed", wait=5)  # by address: a repeat, fine
    email.subscribe("orders", "order.placed", wait=5)  # by name: SubscribeTimeout


# --- kill -9 during a move (a process of its own) --------------------------------------

_CHILD = r"""
import os, sys, time
from servicebus import Bus
from servicebus.engine import loop as E
bind, datadir, seed, out, ready = sys.argv[1:6]
bus = Bus(bind, datadir, name="email", seeds=[seed], gossip_interval=0.2, down_after=1.0)
def handler(payload, message):
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"{payload['n']}\n".encode()); os.close(fd)
    time.sleep(0.002)
bus.every("order.placed")(handler)
# A restart does not wait: a repeated subscribe by name is never confirmed (see
# test_subscribing_by_name_again_is_confirmed_at_once); its stored intents stand.
bus.subscribe("orders", "order.placed", wait=30 if ready.endswith("ready0") else None)
open(ready, "w").write("ok")
while True:
    time.sleep(1)
"""


def test_a_subscriber_killed_and_moved_twice_mid_stream_gets_every_acknowledged_event(buses, tmp_path):
    """Jepsen-style: every publish that returned must be handled by the subscriber, which
    is SIGKILLed twice while events flow and comes back each time at a new address (same
    data directory)."""
    import os
    import signal
    import subprocess
    import sys

    orders = buses("orders")
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    out = tmp_path / "handled.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    procs = []

    def start(n: int) -> subprocess.Popen:
        ready = tmp_path / f"ready{n}"
        proc = subprocess.Popen([sys.executable, str(script), free_address(), str(tmp_path / "email"),
                                 orders.address, str(out), str(ready)], env=env)
        procs.append(proc)
        wait_until(lambda: ready.exists() or proc.poll() is not None, timeout=30)
        assert proc.poll() is None
        return proc

    published = 0
    try:
        proc = start(0)
        for round_ in (1, 2):
            for _ in range(300):
                orders.publish("order.placed", {"n": published})
                published += 1
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            for _ in range(100):  # published while it is dead
                orders.publish("order.placed", {"n": published})
                published += 1
            proc = start(round_)
        for _ in range(100):
            orders.publish("order.placed", {"n": published})
            published += 1

        def handled() -> set[int]:
            return {int(x) for x in out.read_text().split()} if out.exists() else set()

        wait_until(lambda: len(handled()) == published, timeout=30,
                   message=lambda: f"{published} acknowledged publishes handled; missing "
                                   f"{sorted(set(range(published)) - handled())[:20]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


# --- what held (these pass) ----------------------------------------------------------------


def test_held_subscribe_by_name_before_any_instance_then_two_publisher_instances_no_duplicates(buses):
    hub = buses("hub")
    email = buses("email", seeds=[hub.address])
    got = counting_handler(email, "order.placed")
    email.subscribe("orders", "order.placed")  # nobody of orders is known yet
    a = buses("orders", datadir="orders-a", seeds=[hub.address])
    wait_until(lambda: _knows(email, "orders"), timeout=10)
    b = buses("orders", datadir="orders-b", seeds=[hub.address])
    wait_until(lambda: sum(1 for m in email.fleet() if m["name"] == "orders" and m["up"]) == 2, timeout=10)
    for pub in (a, b):  # each has the subscription (its consumer's peer is the subscriber)
        wait_until(lambda pub=pub: any(c[0] == email.address for c in pub._call(
            lambda f: E.Snapshot(f))["consumers"]), timeout=10)
    for n in range(10):
        a.publish("order.placed", {"n": n})
        b.publish("order.placed", {"n": 100 + n})
    wait_until(lambda: len(got) == 20, timeout=15, message=lambda: f"20 events, got {sorted(got)}")
    assert set(got.values()) == {1}
    email.unsubscribe("orders", "order.placed", wait=10)
    for pub in (a, b):  # both instances were told
        wait_until(lambda pub=pub: not any(c[0] == email.address for c in pub._call(
            lambda f: E.Snapshot(f))["consumers"]), timeout=10)


# --- moves of instances known only by address (hostile review helper-33) --------------


@pytest.mark.parametrize("publisher, seeded", [(None, True), (None, False), ("orders", False)],
                         ids=["unnamed-publisher-as-seed", "unnamed-publisher-no-seed", "named-publisher-no-seed"])
def test_what_a_publisher_subscribed_to_by_address_owes_a_named_subscriber_follows_it_when_it_moves(
        buses, publisher, seeded):
    """A named subscriber subscribes by address to a publisher, with or without a name (the
    gateway's pull bus: its one seed is its front bus, which has none), the publisher its
    seed or not: it must learn the subscriber's proof, or the subscriber's backlog stays
    owed at its old address when it comes back at another (a kill -9 of the gateway lost a
    message that way; a subscriber without seeds never gossiped to the publisher at all).
    A move before the first proof arrived is not followed (README): waited for."""
    hub = buses(publisher, datadir="hub")
    seeds = {"seeds": [hub.address]} if seeded else {}
    email = buses("email", datadir="email", **seeds)
    got = counting_handler(email, "order.placed")
    email.subscribe(hub.address, "order.placed", wait=10)
    hub.publish("order.placed", {"n": 0})
    wait_until(lambda: len(got) == 1, timeout=10)
    wait_until(lambda: hub.counters().get("instances_proven") == 1, timeout=10,
               message="the publisher to hold the subscriber's proof")
    email.close()
    for n in range(1, 11):  # owed at the old address
        hub.publish("order.placed", {"n": n})
    moved = buses("email", datadir="email", address=free_address(), **seeds)
    got_there = counting_handler(moved, "order.placed")
    wait_until(lambda: len(got_there) == 10, timeout=15,
               message=lambda: f"10 owed events at the new address, got {sorted(got_there)}")
    assert set(got_there.values()) == {1}


def test_commands_an_unnamed_seed_queued_for_a_named_instance_follow_it_when_it_moves(buses):
    """A seed is told the instance's proof (README: "a bus proves itself the same way to its
    seeds"). Its first gossip to a seed carries none (it does not know the seed's node id
    yet) and once the seed answered it is no longer gossiped to as a seed: unless it is also
    a publisher subscribed to by address, the seed holds the instance confirmed without a
    proof, and every later move is refused (move_unproven), stranding the commands queued
    for it."""
    hub = buses(None, datadir="hub")
    mailer = buses("mailer", datadir="mailer", seeds=[hub.address])
    handled: set[int] = set()
    mailer.handle("mail.send", lambda payload, message: handled.add(payload["n"]))
    hub.send(mailer.address, "mail.send", {"n": 0})
    wait_until(lambda: handled == {0}, timeout=10)
    wait_until(lambda: hub.counters().get("gossip_received"), timeout=10, message="the seed to hear of it")
    beat = mailer.fleet()[0]["beat"]
    wait_until(lambda: mailer.fleet()[0]["beat"] >= beat + 10, timeout=10)  # ten turns to prove itself
    mailer.close()
    for n in range(1, 11):  # queued for the old address
        hub.send(mailer.address, "mail.send", {"n": n})
    moved = buses("mailer", datadir="mailer", seeds=[hub.address], address=free_address())
    there: set[int] = set()
    moved.handle("mail.send", lambda payload, message: there.add(payload["n"]))
    wait_until(lambda: there == set(range(1, 11)), timeout=15,
               message=lambda: f"10 queued commands at the new address, got {sorted(there)}; "
                               f"hub refused: { {k: v for k, v in hub.counters().items() if 'refused' in k} }")


def test_a_hostile_seed_answering_as_an_unnamed_publishers_node_id_never_gets_the_proof_meant_for_it(buses, ctx):
    """README: the proof "never travels anywhere else", and a bus sends it to an address
    "never for a node id it knows at another address". A publisher without a name is in
    no table, so that check is void for it: a hostile seed that answers with the unnamed
    publisher's node id (any stranger's gossip gets it) is sent the subscriber's proof for
    the publisher at the subscriber's next start, and with it moves the subscriber's
    backlog at the publisher to itself."""
    hub = buses(None, datadir="hub")
    hub_node = _table(ctx, hub.address).sender
    seed = _Impostor(ctx, node=hub_node)
    try:
        email = buses("email", datadir="email", seeds=[seed.address, hub.address])
        email.subscribe(hub.address, "order.placed", wait=10)
        wait_until(lambda: hub.counters().get("instances_proven") == 1, timeout=10,
                   message="the publisher to hold the subscriber's proof")
        me = next(m for m in _table(ctx, email.address).members if m.name == "email")
        email.close()
        again = buses("email", datadir="email", seeds=[seed.address, hub.address], address=email.address)
        wait_until(lambda: again.counters().get("gossip_received"), timeout=10)
        wait_until(lambda: seed.proofs, timeout=10)
        again.close()  # between two deploys: what it is owed waits at the publisher
        # What a thief does with every proof it was sent (one for the node id its pong
        # named is the subscriber's proof for that node, not for the publisher):
        # "email moved here", each refused by the publisher or believed.
        forger = ctx.socket(zmq.DEALER)
        forger.connect(hub.address)
        try:
            forged = {**me.wire(), "address": seed.address, "beat": me.beat + 100}
            refused = lambda: sum(v for k, v in hub.counters().items() if k.startswith("gossip_refused_"))  # noqa: E731
            for proof in dict.fromkeys(p for p in seed.proofs if p is not None):
                before = refused()
                forger.send_multipart(P.encode_gossip(me.node, [forged], proof=proof))
                wait_until(lambda: refused() > before or hub.counters().get("instances_moved"), timeout=10)
        finally:
            forger.close(0)
        for n in range(10):
            hub.publish("order.placed", {"n": n})
        assert not hub.counters().get("instances_moved") and not seed.got, (
            f"the hostile seed moved the subscriber to itself with a proof it was sent; "
            f"{len(seed.got)} events acked by it")
    finally:
        seed.close()
