"""`servicebus fleet`, `kick` and `readmit` (services by name, test_names.py): the topology as a
bus's discovery knows it, live (over the admin endpoint, with the core's table) and stopped
(the table it stored), the same either way; a kick through the CLI ends the subscription and
is journaled; readmit, live and stopped. The CLI runs in a subprocess; the buses in this one."""

from __future__ import annotations

import pytest

from servicebus import Bus
from servicebus.errors import SubscribeRefused
from servicebus.ops.admin import query_live
from servicebus.testing import free_address, wait_until

from .test_cli import cli, cli_json
from .test_cli_live import NOTHING_MATCHED, cli_cols, journaled
from .test_journal import journal_lines

FAST = {"gossip_interval": 0.2, "down_after": 1.0}
USAGE = 1
# What a row says of an instance whatever the bus's state (live: silent, self up).
SAME = ("service", "node", "address", "version", "publishes", "subscribes", "kicked", "subscriber",
        "topics", "backlog", "deadletters", "last_ack")


@pytest.fixture
def service(tmp_path):
    """Buses named as services (in data directories of their names), closed at the end."""
    opened: list[Bus] = []

    def make(name: str, *, address: str | None = None, **options) -> Bus:
        bus = Bus(address or free_address(), tmp_path / name, name=name, **{**FAST, **options})
        opened.append(bus)
        return bus

    yield make
    for bus in opened:
        bus.close()


@pytest.fixture
def fleet(service):
    """orders (publisher) and email (subscribed to order.placed of the service orders)."""
    orders = service("orders")
    email = service("email", seeds=[orders.address])
    email.every("order.placed", lambda payload, message: None)
    email.subscribe("orders", "order.placed", wait=10)
    return orders, email


def _rows(datadir) -> dict[str, dict]:
    """`servicebus fleet --json`, by service."""
    return {row["service"]: row for row in cli_json("fleet", datadir)}


def _asked(bus: Bus) -> dict[str, dict]:
    """The same view of a live bus asked in this process (a CLI run costs a second)."""
    return {row["service"]: row for row in query_live(bus.datadir, "fleet", {})[0]["instances"]}


def _email_up(orders: Bus, up: bool) -> bool:
    return any(m["name"] == "email" and m["up"] == up for m in orders.fleet())


def test_fleet_of_a_live_bus_lists_itself_first_and_each_instance_with_what_it_is_owed(fleet):
    orders, email = fleet
    rows = cli_json("fleet", orders.datadir)
    assert [(r["service"], r["self"]) for r in rows] == [("orders", True), ("email", False)]
    me, sub = rows
    assert (me["address"], me["up"], me["publishes"], me["live"]) == (orders.address, True, ["order.placed"], True)
    assert (sub["address"], sub["up"], sub["subscribes"], sub["version"]) == \
        (email.address, True, ["order.placed"], "0.3")
    assert (sub["subscriber"], sub["topics"], sub["backlog"], sub["kicked"]) == (True, ["order.placed"], 0, None)
    assert sub["node"] == next(r["node"] for r in orders.fleet() if r["name"] == "email")
    assert sub["silent"] is not None and sub["since"] > 0
    table = cli_cols(200, "fleet", orders.datadir)
    assert table.returncode == 0, table.stderr
    assert "live" in table.stdout and "this bus" in table.stdout and "up " in table.stdout
    assert "0 owed" in table.stdout
    # The subscriber's view: the publisher, nothing owed to it here.
    theirs = _asked(email)
    assert theirs["orders"]["up"] and theirs["orders"]["publishes"] == ["order.placed"]
    assert not theirs["orders"]["subscriber"] and theirs["orders"]["backlog"] is None


def test_fleet_shows_a_down_instances_backlog_and_dead_letters_the_same_live_and_stopped(fleet):
    orders, email = fleet
    email.close()
    wait_until(lambda: _email_up(orders, False), 5)
    for n in range(3):
        orders.publish("order.placed", {"n": n})
    orders.publish("order.placed", {"n": 3}, ttl=0.1)  # expires while owed: a dead letter, peer email
    wait_until(lambda: orders.status().deadletters == 1, 5)
    sub = _rows(orders.datadir)["email"]
    assert (sub["up"], sub["backlog"], sub["deadletters"], sub["live"]) == (False, 3, 1, True)
    assert sub["oldest_pending_age_s"] >= 0
    orders.close()
    stopped = _rows(orders.datadir)
    assert {k: stopped["email"][k] for k in SAME} == {k: sub[k] for k in SAME}
    assert stopped["email"]["live"] is False and stopped["email"]["silent"] is None
    assert stopped["orders"]["self"] and stopped["orders"]["up"] is False
    table = cli_cols(200, "fleet", orders.datadir)
    assert table.returncode == 0 and "as stored when the bus stopped" in table.stdout
    assert "this bus (stopped)" in table.stdout and "down since" in table.stdout
    assert "3 owed" in table.stdout and "1 dead letter" in table.stdout


def test_a_bus_without_discovery_says_so_and_lists_nothing(make_bus):
    plain = make_bus("plain")
    text = cli("fleet", plain.datadir)
    assert text.returncode == 0 and "discovery is off for this bus: start it with name=" in text.stdout
    plain.close()
    assert cli_json("fleet", plain.datadir) == []


def test_a_kick_through_the_cli_ends_the_subscription_until_readmit(fleet):
    orders, email = fleet
    (done,) = cli_json("kick", orders.datadir, "email", "--why", "rogue deploy")
    assert done == {"kicked": "svc:email", "why": "rogue deploy",
                    "ended": [{"subscriber": email.address, "topic": "order.placed"}]}
    assert orders.status().subscriptions == 0
    with pytest.raises(SubscribeRefused, match="kicked"):
        email.subscribe("orders", "order.other", wait=5)
    assert _asked(orders)["email"]["kicked"] == "rogue deploy"
    text = cli("readmit", orders.datadir, "email")
    assert text.returncode == 0 and "readmitted svc:email" in text.stdout
    email.subscribe("orders", "order.other", wait=5)
    assert _asked(orders)["email"]["kicked"] is None


def test_a_kick_drops_what_the_instance_was_owed_and_the_journal_says_kicked(fleet):
    orders, email = fleet
    node = next(m["node"] for m in orders.fleet() if m["name"] == "email")
    email.close()
    wait_until(lambda: _email_up(orders, False), 5)
    ids = orders.publish_many("order.placed", [{"n": n} for n in range(3)])
    kicked = cli("kick", orders.datadir, node, "--why", "decommissioned")
    assert kicked.returncode == 0 and "1 subscription ended" in kicked.stdout, kicked.stderr
    wait_until(lambda: set(ids) <= journaled(orders.datadir, "dropped"), 5)
    dropped = [e for e in journal_lines(orders.datadir) if e["event"] == "dropped" and e["id"] in ids]
    assert {e["error"] for e in dropped} == {"kicked: decommissioned"}
    assert {e["peer"] for e in dropped} == {email.address}
    row = _asked(orders)["email"]
    assert (row["kicked"], row["subscriber"], row["backlog"]) == ("decommissioned", False, None)


def test_an_unknown_target_is_a_clear_error(fleet):
    orders, email = fleet
    unknown = cli("kick", orders.datadir, "ghost", "--why", "x")
    assert unknown.returncode == NOTHING_MATCHED
    assert "'ghost' is no instance, address or service this bus knows" in unknown.stderr
    assert unknown.stderr.count("\n") == 1  # one line, no traceback
    not_kicked = cli("readmit", orders.datadir, "email")
    assert not_kicked.returncode == NOTHING_MATCHED and "'email' is not kicked" in not_kicked.stderr


def test_kick_needs_the_running_bus_and_a_reason(service):
    orders = service("orders")
    no_why = cli("kick", orders.datadir, "email")
    assert no_why.returncode == USAGE and "--why" in no_why.stderr
    orders.close()
    stopped = cli("kick", orders.datadir, "email", "--why", "x")
    assert stopped.returncode == USAGE
    assert "kick needs the running bus: it ends subscriptions in its core" in stopped.stderr


def test_readmit_of_a_stopped_bus_edits_the_table_it_loads_at_start(fleet, service):
    orders, email = fleet
    orders.kick("email", why="later")
    orders.close()
    assert _rows(orders.datadir)["email"]["kicked"] == "later"
    text = cli("readmit", orders.datadir, "email")
    assert text.returncode == 0 and "readmitted svc:email" in text.stdout, text.stderr
    again = service("orders", address=orders.address)
    assert _asked(again)["email"]["kicked"] is None
    email.subscribe("orders", "order.other", wait=5)  # not refused: the bus loaded no kick
    assert again.status().subscriptions == 1
