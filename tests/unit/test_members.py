"""Discovery's records without sockets: gossip frames round-trip and refuse junk, seeds and
names are checked, channel roles decide by the first matching pattern."""

from __future__ import annotations

import pytest

from servicebus.errors import ProtocolError
from servicebus.model.members import Member, check_channels, check_name, check_seeds, is_service
from servicebus.wire import protocol as P
from servicebus.wire.decoding import decode

ENTRY = Member("n1", "orders", "tcp://10.0.0.2:5555", 3, 17, None, ("order.placed",), ("stock.*",), "0.3")


def test_a_gossip_frame_round_trips_its_members():
    frame = decode(P.encode_gossip("n1", [ENTRY.wire()], reply=True), max_payload=1 << 20)
    assert frame == P.Gossip("n1", (ENTRY,), True)


@pytest.mark.parametrize("bad", [
    {**ENTRY.wire(), "name": "Orders!"},
    {**ENTRY.wire(), "address": "tcp://*:5555"},
    {**ENTRY.wire(), "address": "http://x"},
    {**ENTRY.wire(), "beat": -1},
    {**ENTRY.wire(), "beat": True},
    {**ENTRY.wire(), "key": "short"},
    {**ENTRY.wire(), "pub": ["x" * 300]},
    {**ENTRY.wire(), "pub": ["t"] * 201},
    "not a map",
])
def test_a_gossip_frame_with_a_bad_member_is_refused_whole(bad):
    with pytest.raises(ProtocolError):
        decode(P.encode_gossip("n1", [bad]), max_payload=1 << 20)


def test_a_gossip_frame_with_too_many_members_is_refused():
    with pytest.raises(ProtocolError, match="at most 1000"):
        decode(P.encode_gossip("n1", [ENTRY.wire()] * 1001), max_payload=1 << 20)


def test_names_and_addresses_are_told_apart_and_names_are_checked():
    assert is_service("orders") and not is_service("tcp://orders:5555")
    assert check_name("billing-v2.eu_1") == "billing-v2.eu_1"
    for bad in ("", "-x", "UPPER", "a" * 64, "a b"):
        with pytest.raises(ValueError):
            check_name(bad)
    with pytest.raises(TypeError):
        check_name(5)


def test_seeds_are_tcp_dns_or_mdns():
    assert check_seeds(["tcp://a:1", "dns://svc.ns.svc.cluster.local:5555", "mdns://", "mdns://shop"])
    for bad in (["tcp://a"], ["http://a:1"], "tcp://a:1", ["dns://a"]):
        with pytest.raises((TypeError, ValueError)):
            check_seeds(bad)


def test_channel_roles_take_the_first_matching_pattern_and_leave_other_topics_open():
    roles = check_channels({"order.placed": {"writers": ["orders"]},
                            "order.*": {"writers": ["orders", "returns"], "readers": ["email"]}})
    assert roles.may_write("orders", "order.placed") and not roles.may_write("returns", "order.placed")
    assert roles.may_write("returns", "order.refunded") and not roles.may_write(None, "order.refunded")
    assert roles.may_read("anyone", "order.placed")  # that rule lists no readers: open
    assert roles.may_read("email", "order.refunded") and not roles.may_read("web", "order.refunded")
    assert roles.may_write(None, "user.signup") and roles.may_read(None, "user.signup")
    assert check_channels({"x.*": {"readers": "*"}}).may_read(None, "x.y")
    for bad in ({"x": {"writer": ["a"]}}, {"x": ["a"]}, {"x": {"writers": ["Bad Name"]}}, ["x"]):
        with pytest.raises((TypeError, ValueError)):
            check_channels(bad)
