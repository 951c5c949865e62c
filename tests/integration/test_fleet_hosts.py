"""Services by name across hosts: real bus processes, one per network namespace (tests/
hosts.py: orders, email, billing, spare joined by a bridge, each naming the others in its
/etc/hosts), each binding ``tcp://*:PORT`` and advertising ``tcp://<its host name>:PORT``,
reaching each other BY SERVICE NAME ONLY from one seed (``tcp://orders:PORT``). The loopback
versions: test_names.py. Counted from what the processes wrote down (tests/fleetproc.py):
acknowledged publishes against handler runs, Jepsen-style.

Two tests FAIL on the core as it is, on purpose (core/ is not this file's to fix):

- ``...from_one_seed...[names-only]``: an address with a host name is never believed first
  hand. The core checks a gossip entry's own address with the address policy (wire/policy.py),
  which compares host names as written and never resolves them, so ``tcp://email:5555``
  from 10.x.y.3 is ``host_name_not_allowed``: orders never learns email, and refuses its
  subscribe. The ``[allow-peers-names]`` variant and the other tests give every bus
  ``allow_peers`` = the host names, the one workaround there is;
- ``test_curve_discovery_end_to_end...``: see its docstring."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from servicebus.testing import wait_until

from ..hosts import Hosts, cannot_make_hosts

NAMES = ["orders", "email", "billing", "spare"]
PORT = 5555  # every host is a namespace of its own: the same port everywhere
SEED = f"tcp://orders:{PORT}"
TOPIC = "order.placed"
ROOT = Path(__file__).resolve().parents[2]
PROC = str(ROOT / "tests" / "fleetproc.py")
GOSSIP, DOWN = 0.25, 1.5  # gossip_interval, down_after: fast, so the file stays under a minute
SLACK = 2.0  # on top of down_after: a gossip turn, the state file's period, 2 shared cores


class Node:
    """One bus process in a host (tests/fleetproc.py), its files under ``work/<label>``."""

    def __init__(self, fleet: "Fleet", label: str, host: str, name: str, args: list[str]) -> None:
        self.fleet, self.label, self.host, self.name, self.args = fleet, label, host, name, args
        self.dir = fleet.work / label
        self.dir.mkdir(exist_ok=True)
        self.ready, self.state_file = self.dir / "ready", self.dir / "state.json"
        self.handled, self.acks = self.dir / "handled", self.dir / "acks"
        self.go, self.quiet = self.dir / "go", self.dir / "quiet"
        self.proc: subprocess.Popen[bytes] | None = None
        self.pids: list[int] = []
        self.killed: set[int] = set()

    def start(self, host: str | None = None, datadir: str | None = None) -> "Node":
        """Start (again), in ``host`` (default: where it ran), advertising that host's name."""
        self.host = host or self.host
        self.ready.unlink(missing_ok=True)
        self.state_file.unlink(missing_ok=True)
        argv = [sys.executable, PROC, "--bind", f"tcp://*:{PORT}", "--advertise", f"tcp://{self.host}:{PORT}",
                "--datadir", str(self.fleet.work / (datadir or self.label) / "data"), "--name", self.name,
                "--seed", SEED, "--gossip-interval", str(GOSSIP), "--down-after", str(DOWN),
                "--ready", str(self.ready), "--state", str(self.state_file),
                "--handled", str(self.handled), "--acks", str(self.acks), "--go", str(self.go),
                "--quiet", str(self.quiet), *self.fleet.common, *self.args]
        with open(self.dir / "log", "ab") as log:
            self.proc = self.fleet.hosts.popen(self.host, argv, stdout=log, stderr=log,
                                               env={**os.environ, "PYTHONPATH": str(ROOT)})
        wait_until(lambda: self.ready.exists() and self.ready.read_text().strip() or self.proc.poll() is not None,
                   30, 0.02, f"{self.label} ready")
        assert self.proc.poll() is None, f"{self.label} exited: {self.log()}"
        pid, self.node = self.ready.read_text().split()
        self.pids.append(int(pid))
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.killed.add(self.proc.pid)
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def state(self) -> dict[str, Any]:
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {"fleet": [], "counters": {}, "subscriptions": 0}

    def others(self, up: bool | None = True) -> dict[str, list[dict[str, Any]]]:
        """The instances this bus's fleet() lists, by service (not itself)."""
        out: dict[str, list[dict[str, Any]]] = {}
        for row in self.state()["fleet"]:
            if not row.get("self") and (up is None or row["up"] == up):
                out.setdefault(row["name"], []).append(row)
        return out

    def stop_publishing(self) -> None:
        """Stop and wait until it did: a publish under way when asked is in the acks file."""
        self.quiet.touch()
        end = Path(f"{self.acks}.end")
        wait_until(end.exists, 10, 0.01, f"{self.label} to stop publishing")

    def acked(self) -> dict[str, int]:
        """id -> n of every acknowledged publish."""
        if not self.acks.exists():
            return {}
        return {mid: int(n) for n, mid in (line.split() for line in self.acks.read_text().splitlines() if line)}

    def runs(self) -> dict[str, list[int]]:
        """id -> the pids of its handler runs, in order."""
        out: dict[str, list[int]] = {}
        if self.handled.exists():
            for line in self.handled.read_text().splitlines():
                parts = line.split()
                if len(parts) == 4:
                    out.setdefault(parts[1], []).append(int(parts[2]))
        return out

    def log(self) -> str:
        path = self.dir / "log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


class Fleet:
    def __init__(self, hosts: Hosts, work: Path) -> None:
        self.hosts, self.work = hosts, work
        self.nodes: list[Node] = []
        self.common: list[str] = []  # arguments every node gets

    def allow_host_names(self) -> None:
        """``allow_peers`` = every host name: the workaround for host names in advertised
        addresses never being believed (see the module's docstring)."""
        self.common = [arg for name in NAMES for arg in ("--allow-peer", name)]

    def node(self, label: str, host: str | None = None, name: str | None = None, *args: str) -> Node:
        made = Node(self, label, host or label, name or label, list(args))
        self.nodes.append(made)
        return made

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    why = cannot_make_hosts()
    if why:
        pytest.skip(why)
    with Hosts(NAMES) as hosts:
        made = Fleet(hosts, tmp_path)
        try:
            yield made
        finally:
            made.stop()  # SIGTERM first: each bus closes; Hosts kills what is left


def count(publisher: Node, subscriber: Node) -> dict[str, Any]:
    """Acknowledged against handled: lost, duplicated, and reruns of a run whose process
    was killed with SIGKILL after it ran and before its completion was stored (README)."""
    acked, runs = publisher.acked(), subscriber.runs()
    lost = sorted(acked[mid] for mid in acked if mid not in runs)
    duplicated, reruns = [], 0
    for mid, pids in runs.items():
        for earlier in pids[:-1]:
            if earlier in subscriber.killed:
                reruns += 1
            else:
                duplicated.append(mid)
    return {"acknowledged": len(acked), "handled": sum(1 for mid in acked if mid in runs), "lost": lost,
            "duplicated": duplicated, "reruns_after_kill": reruns,
            "unacknowledged_handled": len(set(runs) - set(acked))}


def everything_handled(publisher: Node, *subscribers: Node) -> bool:
    acked = set(publisher.acked())
    return all(acked <= set(sub.runs()) for sub in subscribers)


def start_three(fleet: Fleet, count_: int = 0, rate: float = 200.0) -> tuple[Node, Node, Node]:
    """orders publishing (after its go file), email and billing subscribed to it by name."""
    orders = fleet.node("orders", None, None, "--publish", TOPIC, "--count", str(count_), "--rate", str(rate))
    email = fleet.node("email", None, None, "--subscribe", "orders", TOPIC, "--handle", TOPIC)
    billing = fleet.node("billing", None, None, "--subscribe", "orders", TOPIC, "--handle", TOPIC)
    for node in (orders, email, billing):
        node.start()
    # Both subscriptions stored at orders: from here on, every publish is owed to both.
    wait_until(lambda: orders.state()["subscriptions"] >= 2, 8, 0.05,
               lambda: f"orders to have 2 subscribers; orders: {orders.state()}\n{email.log()}")
    return orders, email, billing


@pytest.mark.parametrize("allow", [False, True], ids=["names-only", "allow-peers-names"])
def test_subscribers_find_the_publisher_by_name_from_one_seed_and_get_everything_once(fleet, allow):
    if allow:
        fleet.allow_host_names()
    n = 300
    orders, email, billing = start_three(fleet, n, rate=1000)
    orders.go.touch()
    wait_until(lambda: len(orders.acked()) == n and everything_handled(orders, email, billing), 20, 0.05,
               lambda: f"all {n} handled: {count(orders, email)} {count(orders, billing)}")
    for sub in (email, billing):
        got = count(orders, sub)
        assert got["lost"] == [] and got["duplicated"] == [] and got["handled"] == n, got
    # Every bus's fleet() lists the other two services, up, at their host names.
    for node in (orders, email, billing):
        want = {"orders", "email", "billing"} - {node.name}
        wait_until(lambda: want <= set(node.others()), 10, 0.05,
                   lambda: f"{node.label} to list {want}: {node.state()['fleet']}")
        for name in want:
            assert [row["address"] for row in node.others()[name]] == [f"tcp://{name}:{PORT}"]


@pytest.mark.parametrize("how", ["spare", "readdress"])
def test_an_instance_that_moves_to_another_host_mid_stream_gets_everything_once(fleet, how):
    """email is killed while orders publishes, and comes back with the same data directory
    at a new address: on the host 'spare' (another host, another IP, advertising
    tcp://spare:PORT), or on its own host after a readdress (a new IP for the same name)."""
    fleet.allow_host_names()
    orders, email, billing = start_three(fleet, rate=300)
    orders.go.touch()
    wait_until(lambda: len(email.runs()) >= 200, 10, 0.02, "email handling")
    email.kill()
    away = len(orders.acked())
    if how == "spare":
        email.start(host="spare", datadir="email")
    else:
        old = fleet.hosts.ip("email")
        assert fleet.hosts.readdress("email") != old
        email.start()
    moved_to = f"tcp://{email.host}:{PORT}"
    # Published while it was away and after: the stream goes on for a while.
    wait_until(lambda: len(orders.acked()) >= away + 400, 15, 0.02, "orders publishing on")
    orders.stop_publishing()
    wait_until(lambda: everything_handled(orders, email, billing), 25, 0.05,
               lambda: f"everything handled after the move: email {count(orders, email)}\n"
                       f"orders fleet {orders.state()['fleet']}\n{email.log()}")
    got = count(orders, email)
    assert got["lost"] == [] and got["duplicated"] == [], got
    assert got["acknowledged"] > away + 300, got  # a real stream went to the moved instance
    assert count(orders, billing)["duplicated"] == []
    if how == "spare":
        # One instance of email, at its new address (the same node), up.
        wait_until(lambda: [r["address"] for r in orders.others(None).get("email", [])] == [moved_to], 10, 0.05,
                   lambda: f"orders to list email at {moved_to} only: {orders.state()['fleet']}")
        assert orders.state()["counters"].get("instances_moved", 0) >= 1
    # (A readdress keeps the address tcp://email:PORT: not a move to the bus; ZeroMQ
    # resolves the name again when it reconnects.)


def test_a_partitioned_subscriber_is_seen_down_then_catches_up_exactly_once(fleet):
    fleet.allow_host_names()
    orders, email, billing = start_three(fleet, rate=300)
    orders.go.touch()
    wait_until(lambda: len(billing.runs()) >= 100, 10, 0.02, "billing handling")
    for node in (orders, email):
        wait_until(lambda: "billing" in node.others(), 10, 0.05, f"{node.label} to see billing")
    fleet.hosts.cut("billing")
    cut_at = time.monotonic()
    for node in (orders, email):
        wait_until(lambda: "billing" in node.others(up=False), DOWN + SLACK + 1, 0.02,
                   lambda: f"{node.label} to see billing down: {node.state()['fleet']}")
    seen_down = time.monotonic() - cut_at
    assert seen_down <= DOWN + SLACK, seen_down
    during = len(orders.acked())
    wait_until(lambda: len(orders.acked()) >= during + 200, 10, 0.02, "orders publishing during the cut")
    fleet.hosts.heal("billing")
    wait_until(lambda: "billing" in orders.others(), 10, 0.05, "orders to see billing up again")
    orders.stop_publishing()
    wait_until(lambda: everything_handled(orders, email, billing), 20, 0.05,
               lambda: f"billing to catch up: {count(orders, billing)}")
    for sub in (email, billing):
        got = count(orders, sub)
        assert got["lost"] == [] and got["duplicated"] == [] and got["reruns_after_kill"] == 0, got


# --- CURVE ---------------------------------------------------------------------------------------


def curve_fleet(fleet: Fleet, addresses: bool) -> dict[str, Path]:
    """A key pair per bus (``servicebus keygen``) and a peers.toml per bus listing the
    others, each with its service name (the 'stranger', on the host spare, with the name
    'stranger'): orders with its address (the seed); the others with their addresses only
    if ``addresses``, else without (discovery gives them)."""
    cli = str(Path(sys.executable).parent / "servicebus")
    hosts = {"orders": "orders", "email": "email", "billing": "billing", "stranger": "spare"}
    keys: dict[str, Path] = {}
    public: dict[str, str] = {}
    for label in hosts:
        keys[label] = fleet.work / "keys" / label
        subprocess.run([cli, "keygen", str(keys[label])], check=True, capture_output=True)
        text = (keys[label] / "bus.key").read_text()
        public[label] = next(line.split('"')[1] for line in text.splitlines() if "public-key" in line)
    for label in keys:
        entries = []
        for other in keys:
            if other == label:
                continue
            address = f'address = "tcp://{hosts[other]}:{PORT}"\n' if other == "orders" or addresses else ""
            entries.append(f'[[peer]]\n{address}keys = ["{public[other]}"]\nnames = ["{other}"]\n')
        (keys[label] / "peers.toml").write_text("\n".join(entries))
    return keys


def test_curve_a_listed_key_without_the_name_cannot_announce_itself_as_that_service(fleet):
    """Every peers.toml entry has its address here: what the next test shows fails
    without them is left out of this one."""
    keys = curve_fleet(fleet, addresses=True)
    orders = fleet.node("orders", None, None, "--keys", str(keys["orders"]))
    email = fleet.node("email", None, None, "--keys", str(keys["email"]), "--subscribe", "orders", TOPIC,
                       "--handle", TOPIC)
    # The stranger: a key orders and email list, with the name 'stranger', not 'orders'.
    stranger = fleet.node("stranger", "spare", "orders", "--keys", str(keys["stranger"]),
                          "--publish", TOPIC, "--count", "1")
    for node in (orders, email, stranger):
        node.start()
    wait_until(lambda: orders.state()["subscriptions"] >= 1, 10, 0.05,
               lambda: f"email subscribed to the real orders: {email.state()}\n{email.log()}")
    refused = "gossip_refused_name_not_allowed"
    # The bus it gossips to refuses it again and again (the counter grows), never taking
    # it for an orders; and tells nobody of it (only confirmed instances are told), so
    # email never lists it either.
    wait_until(lambda: orders.state()["counters"].get(refused, 0) >= 3, 10, 0.05,
               lambda: f"orders to refuse the stranger: {orders.state()['counters']}\n{orders.log()}")
    for node in (orders, email):
        rows = node.state()["fleet"]
        assert not [r for r in rows if r["node"] == stranger.node], rows
    assert [r["node"] for r in email.others().get("orders", [])] == [orders.node]
    assert stranger.state()["subscriptions"] == 0  # nobody subscribed to it
    stranger.go.touch()  # what it publishes goes to nobody
    wait_until(lambda: len(stranger.acked()) == 1, 10, 0.05, "the stranger's publish")
    assert email.runs() == {}


def test_curve_discovery_end_to_end_a_subscriber_by_name_gets_everything(fleet):
    """As designed (wire/trust.py): email's entry in orders' peers.toml has no address, only
    its key and name; orders learns the address from email's own gossip and connects to it
    with that key as the server's. FAILS on the core as it is (see the report): an answer
    to gossip on a connection is refused as ``not_its_key`` (the core compares the entry's
    key with the ZAP User-Id, which an answer on our own connection does not have), and a
    discovered address is never given a server key (Keys.learned is never filled), so
    orders cannot connect to email ("peers.toml has no key for it")."""
    keys = curve_fleet(fleet, addresses=False)
    n = 100
    orders = fleet.node("orders", None, None, "--keys", str(keys["orders"]), "--publish", TOPIC,
                        "--count", str(n), "--rate", "1000")
    email = fleet.node("email", None, None, "--keys", str(keys["email"]), "--subscribe", "orders", TOPIC,
                       "--handle", TOPIC)
    for node in (orders, email):
        node.start()
    wait_until(lambda: "orders" in email.others() and "email" in orders.others(), 8, 0.05,
               lambda: f"each to see the other: orders {orders.state()}\nemail {email.state()}")
    wait_until(lambda: orders.state()["subscriptions"] >= 1, 10, 0.05,
               lambda: f"email's subscription at orders: {orders.state()['counters']}\n{orders.log()}")
    orders.go.touch()
    wait_until(lambda: len(orders.acked()) == n and everything_handled(orders, email), 15, 0.05,
               lambda: f"all handled: {count(orders, email)}\n{orders.log()}")
    got = count(orders, email)
    assert got["lost"] == [] and got["duplicated"] == [], got
    assert Counter(len(p) for p in email.runs().values()) == Counter({1: n})
