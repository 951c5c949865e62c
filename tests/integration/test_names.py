"""Services by name on one host (loopback): discovery from a seed, subscribe/send/request by
name, an instance that moves keeps what it is owed, channel roles, kicks. The same across
network namespaces (several hosts): test_fleet_hosts.py."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

from servicebus import Bus
from servicebus.errors import SubscribeRefused
from servicebus.testing import free_address, wait_until

from ..conftest import counting_handler

FAST = {"gossip_interval": 0.2, "down_after": 1.0}


@pytest.fixture
def buses(tmp_path):
    opened: list[Bus] = []

    def make(name: str, *, address: str | None = None, datadir: str | None = None, **options) -> Bus:
        bus = Bus(address or free_address(), tmp_path / (datadir or name), name=name, **{**FAST, **options})
        opened.append(bus)
        return bus

    yield make
    for bus in opened:
        bus.close()


def _knows(bus: Bus, name: str, up: bool = True) -> bool:
    return any(m["name"] == name and m["up"] == up and not m.get("self") for m in bus.fleet())


def test_a_subscriber_names_the_publisher_service_and_gets_its_events_from_one_seed(buses):
    orders = buses("orders")
    email = buses("email", seeds=[orders.address])
    got = counting_handler(email, "order.placed")
    email.subscribe("orders", "order.placed", wait=10)
    for n in range(20):
        orders.publish("order.placed", {"n": n})
    wait_until(lambda: len(got) == 20, timeout=10)
    assert set(got.values()) == {1}
    # Each learnt of the other: the publisher from the subscriber's gossip, not a seed.
    assert _knows(orders, "email") and _knows(email, "orders")


def test_a_third_service_learns_the_fleet_from_any_one_member(buses):
    orders = buses("orders")
    buses("email", seeds=[orders.address])
    billing = buses("billing", seeds=[orders.address])
    wait_until(lambda: _knows(billing, "email"), timeout=10)


def test_commands_and_requests_go_to_a_service_by_name(buses):
    pricing = buses("pricing")
    web = buses("web", seeds=[pricing.address])
    seen = []
    pricing.handle("quote", lambda payload, message: {"price": payload["sku"] * 2})
    pricing.handle("note", lambda payload, message: seen.append(payload))
    wait_until(lambda: _knows(web, "pricing"), timeout=10)
    assert web.request("pricing", "quote", {"sku": 21}, timeout=10) == {"price": 42}
    web.send("pricing", "note", {"x": 1})
    wait_until(lambda: seen == [{"x": 1}], timeout=10)


def test_a_name_nobody_knows_is_a_clear_error_and_a_bad_name_is_refused(buses):
    lonely = buses("lonely")
    with pytest.raises(ValueError, match="no instance of service 'ghost' is known"):
        lonely.send("ghost", "x", {})
    with pytest.raises(ValueError, match="not a service name"):
        lonely.send("Not A Name", "x", {})
    with pytest.raises(ValueError, match="not a service name"):
        Bus(free_address(), "/tmp/never-made-sb", name="UPPER")


def test_a_subscriber_that_comes_back_at_a_new_address_gets_what_was_published_meanwhile(buses, tmp_path):
    orders = buses("orders")
    email = buses("email", seeds=[orders.address])
    email.subscribe("orders", "order.placed", wait=10)
    old = email.address
    email.close()
    wait_until(lambda: _knows(orders, "email", up=False), timeout=10)
    for n in range(50):
        orders.publish("order.placed", {"n": n})
    # Redeployed: same data directory (the same instance), another port, and no seed: it
    # knows the fleet from its store and tells the publisher where it is now.
    moved = buses("email", datadir="email", address=free_address())
    assert moved.address != old
    got = counting_handler(moved, "order.placed")
    wait_until(lambda: len(got) == 50, timeout=15)
    assert set(got.values()) == {1}
    subscribers = {p.address for p in orders.status().peers if p.up}
    assert moved.address in subscribers
    orders.publish("order.placed", {"n": 50})
    wait_until(lambda: len(got) == 51, timeout=10)


def test_a_publisher_that_comes_back_at_a_new_address_is_subscribed_there(buses):
    orders = buses("orders")
    email = buses("email", seeds=[orders.address])
    got = counting_handler(email, "order.placed")
    email.subscribe("orders", "order.placed", wait=10)
    orders.publish("order.placed", {"n": 0})
    wait_until(lambda: len(got) == 1, timeout=10)
    orders.close()
    orders2 = buses("orders", datadir="orders", address=free_address())
    for n in range(1, 30):
        orders2.publish("order.placed", {"n": n})
    wait_until(lambda: len(got) == 30, timeout=15)
    assert set(got.values()) == {1}


def test_commands_queued_for_an_instance_that_moved_follow_it(buses):
    pricing = buses("pricing")
    web = buses("web", seeds=[pricing.address])
    wait_until(lambda: _knows(web, "pricing"), timeout=10)
    pricing.close()
    for n in range(10):
        web.send("pricing", "note", {"n": n})
    moved = buses("pricing", datadir="pricing", address=free_address())
    got = Counter()
    moved.handle("note", lambda payload, message: got.update([payload["n"]]))
    wait_until(lambda: len(got) == 10, timeout=15)
    assert set(got.values()) == {1}


def test_channel_roles_refuse_a_reader_and_a_writer_the_topic_does_not_list(buses):
    channels = {"order.*": {"writers": ["orders"], "readers": ["email"]}}
    orders = buses("orders", channels=channels)
    spy = buses("spy", seeds=[orders.address])
    with pytest.raises(SubscribeRefused, match="not_a_reader"):
        spy.subscribe("orders", "order.placed", wait=10)
    # A receiver with the same roles takes order.* only from the service orders.
    email = buses("email", seeds=[orders.address], channels=channels)
    got = counting_handler(email, "order.placed")
    email.subscribe("orders", "order.placed", wait=10)
    forger = buses("forger", seeds=[orders.address])
    wait_until(lambda: _knows(email, "forger"), timeout=10)
    forger.send("email", "order.placed", {"n": 99})  # a command named like the topic
    wait_until(lambda: forger.deadletters(), timeout=10)
    letter = forger.deadletters()[0]
    assert letter.reason == "refused" and "channel roles" in (letter.error or "")
    orders.publish("order.placed", {"n": 1})
    wait_until(lambda: got == Counter({1: 1}), timeout=10)


def test_a_kicked_service_loses_its_subscription_and_cannot_subscribe_again_until_readmitted(buses):
    orders = buses("orders")
    email = buses("email", seeds=[orders.address])
    email.subscribe("orders", "order.placed", wait=10)
    report = orders.kick("email", why="rogue deploy")
    assert report["ended"] == [{"subscriber": email.address, "topic": "order.placed"}]
    with pytest.raises(SubscribeRefused, match="kicked"):
        email.subscribe("orders", "order.other", wait=5)
    orders.readmit("email")
    email.subscribe("orders", "order.other", wait=10)


def test_the_table_is_stored_with_the_data_directory(buses, tmp_path):
    orders = buses("orders")
    email = buses("email", seeds=[orders.address])
    wait_until(lambda: _knows(email, "orders"), timeout=10)
    email.close()
    from servicebus.store import Store
    store = Store.open(Path(tmp_path / "email" / "store"))
    try:
        stored = store.meta("members")
    finally:
        store.close()
    assert [m["name"] for m in stored["members"] if m["node"] != stored["members"][0]["node"]] == ["orders"]


def test_a_dns_seed_finds_every_address_the_name_resolves_to(buses):
    orders = buses("orders")
    port = orders.address.rsplit(":", 1)[1]
    email = buses("email", seeds=[f"dns://localhost:{port}"])
    wait_until(lambda: _knows(email, "orders"), timeout=10)
    assert _knows(orders, "email")


def test_mdns_seeds_find_each_other_on_the_lan(buses):
    pytest.importorskip("zeroconf", reason="the mdns extra (python-zeroconf) is not installed")
    kind = f"sbt{os.getpid() % 100000}"  # a service type of this run alone
    orders = buses("orders", seeds=[f"mdns://{kind}"])
    email = buses("email", seeds=[f"mdns://{kind}"])
    wait_until(lambda: _knows(email, "orders") and _knows(orders, "email"), timeout=15)


def test_a_handlers_send_by_name_before_any_instance_is_known_waits_and_is_delivered_once(buses):
    """message.send (and SqlOutbox.send) by service name commit with the handler: if no
    instance of the service is known yet when the engine queues it, it must wait in the
    outbox for one, not be dropped (it was, with an error in the log)."""
    shop = buses("shop")
    orders = buses("orders", seeds=[shop.address])
    handled = []

    @orders.every("order.placed")
    def notify(payload, message):
        message.send("mailer", "mail.send", {"n": payload["n"]})
        handled.append(payload["n"])

    orders.subscribe("shop", "order.placed", wait=10)
    shop.publish("order.placed", {"n": 1})
    wait_until(lambda: handled == [1], timeout=10)
    got: Counter = Counter()
    mailer = buses("mailer", seeds=[shop.address])  # the service appears only now
    mailer.handle("mail.send", lambda payload, message: got.update([payload["n"]]))
    wait_until(lambda: got == Counter({1: 1}), timeout=15, message=lambda: f"mail.send handled: {got}")



def test_a_bus_without_a_name_that_starts_at_another_address_says_that_nothing_follows_it(tmp_path, caplog):
    """Only an instance with a name is followed when it moves (a bus without one is its
    address): starting elsewhere, a bus without a name says so, naming the old address."""
    old, new = free_address(), free_address()
    Bus(old, tmp_path / "anon").close()
    with caplog.at_level("WARNING", logger="servicebus"):
        Bus(new, tmp_path / "anon").close()
    assert any(old in r.getMessage() and "without a name" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="servicebus"):
        Bus(new, tmp_path / "named", name="svc").close()
        Bus(free_address(), tmp_path / "named", name="svc").close()
    assert not any("without a name" in r.getMessage() for r in caplog.records)
