"""The several-hosts harness itself (tests/hosts.py): hosts find each other by name over
ZeroMQ, a cut host answers nothing until healed, a readdressed host is found at its new
address by name and not at its old one, and nothing the harness made outlives it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from servicebus.testing import wait_until

from ..hosts import NETNS_ETC, Hosts, cannot_make_hosts, sweep_orphans

NAMES = ["orders", "email", "billing", "spare"]
PORT = 5555  # every host is a fresh network namespace: nothing else listens there
ROOT = Path(__file__).resolve().parents[2]

# Answers each request with "<its host>:<the request>", bound on every address (a readdressed
# host still serves).
REP = textwrap.dedent("""
    import sys, zmq
    sock = zmq.Context.instance().socket(zmq.REP)
    sock.bind(f"tcp://*:{sys.argv[1]}")
    while True:
        sock.send(sys.argv[2].encode() + b":" + sock.recv())
""")

# Reads "ENDPOINT TIMEOUT_MS" lines and tries one request on a new REQ socket each (linger 0,
# so a request that got no answer is dropped with its socket), printing "ok <reply>" or
# "timeout". One process for all the requests a test makes: no interpreter start per try.
REQ = textwrap.dedent("""
    import sys, zmq
    ctx = zmq.Context.instance()
    for line in sys.stdin:
        endpoint, timeout = line.split()
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(timeout))
        sock.connect(endpoint)
        sock.send(b"ping")
        try:
            print("ok", sock.recv().decode(), flush=True)
        except zmq.Again:
            print("timeout", flush=True)
        sock.close()
""")


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    why = cannot_make_hosts()
    if why:
        pytest.skip(why)
    with Hosts(NAMES) as made:
        yield made


class Client:
    """The REQ process in a host: ``ask(endpoint, timeout)`` -> the reply, or None."""

    def __init__(self, hosts: Hosts, host: str) -> None:
        self.host = host
        self.proc = hosts.popen(host, [sys.executable, "-c", REQ], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, bufsize=1)

    def ask(self, endpoint: str, timeout: float = 0.5) -> str | None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{endpoint} {int(timeout * 1000)}\n")
        answer = self.proc.stdout.readline().split()
        assert answer, f"the client in {self.host} died (exit {self.proc.poll()})"
        return answer[1] if answer[0] == "ok" else None


def serve(hosts: Hosts, host: str) -> None:
    hosts.popen(host, [sys.executable, "-c", REP, str(PORT), host])


def answered(client: Client, endpoint: str, reply: str) -> bool:
    return client.ask(endpoint) == reply


def test_hosts_reach_each_other_by_name(hosts):
    serve(hosts, "email")
    orders = Client(hosts, "orders")
    wait_until(lambda: answered(orders, f"tcp://email:{PORT}", "email:ping"), 5,
               message="orders' request to tcp://email answered")
    # Every host resolves every host, itself included, to its address.
    for host in NAMES:
        out = hosts.run(host, ["getent", "hosts", *NAMES], capture_output=True, text=True, check=True).stdout
        assert dict(reversed(line.split()) for line in out.splitlines()) == {
            name: hosts.ip(name) for name in NAMES}
    # Addresses only inside the namespaces: none of the subnet in the root namespace.
    assert str(hosts.subnet.network_address)[:-1] not in subprocess.run(
        ["ip", "-o", "addr"], capture_output=True, text=True).stdout


def test_cut_then_heal(hosts):
    serve(hosts, "email")
    serve(hosts, "billing")
    orders = Client(hosts, "orders")
    wait_until(lambda: answered(orders, f"tcp://email:{PORT}", "email:ping"), 5, message="email up")
    hosts.cut("email")
    started = time.monotonic()
    assert orders.ask(f"tcp://email:{PORT}", 0.3) is None
    assert time.monotonic() - started < 2, "the timeout is bounded by RCVTIMEO"
    # Only email is cut off: orders still reaches billing, and email still reaches itself.
    wait_until(lambda: answered(orders, f"tcp://billing:{PORT}", "billing:ping"), 5, message="billing up")
    assert Client(hosts, "email").ask(f"tcp://email:{PORT}", 2) == "email:ping"
    hosts.heal("email")
    wait_until(lambda: answered(orders, f"tcp://email:{PORT}", "email:ping"), 5, message="email healed")


def test_readdress(hosts):
    serve(hosts, "email")
    orders = Client(hosts, "orders")  # started before: must see the rewritten hosts file too
    wait_until(lambda: answered(orders, f"tcp://email:{PORT}", "email:ping"), 5, message="email up")
    old = hosts.ip("email")
    new = hosts.readdress("email")
    assert new != old and hosts.ip("email") == new
    for host in NAMES:  # every host, email itself included, finds it at the new address
        out = hosts.run(host, ["getent", "hosts", "email"], capture_output=True, text=True, check=True).stdout
        assert out.split() == [new, "email"], (host, out)
    wait_until(lambda: answered(orders, f"tcp://email:{PORT}", "email:ping"), 5, message="email by name")
    assert orders.ask(f"tcp://{new}:{PORT}") == "email:ping"
    assert orders.ask(f"tcp://{old}:{PORT}", 0.3) is None


def our_traces(hosts: Hosts) -> list[str]:
    """What of ``hosts`` is still on the machine: namespaces, /etc/netns dirs, links in the
    root namespace named like its ports, bridge or host interfaces (there never should be)."""
    names = [*hosts.ns.values(), hosts.switch]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    left = [ns for ns in names if re.search(rf"^{re.escape(ns)}\b", listed, re.M)]
    left += [str(NETNS_ETC / ns) for ns in names if (NETNS_ETC / ns).exists()]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    left += [f"link {dev}" for dev in [*hosts.port.values(), Hosts.BRIDGE]
             if re.search(rf"^\d+: {dev}[@:]", links, re.M)]
    return left


def test_nothing_left_after_exit_even_when_the_body_raised():
    why = cannot_make_hosts()
    if why:
        pytest.skip(why)
    with pytest.raises(RuntimeError, match="the body failed"):
        with Hosts(NAMES) as hosts:
            serve(hosts, "email")
            proc = hosts.procs[0]
            # The check sees them while they are there (namespaces and /etc/netns dirs).
            assert len(our_traces(hosts)) == 2 * (len(NAMES) + 1) - 1  # the switch has no /etc/netns dir
            raise RuntimeError("the body failed")
    assert proc.poll() is not None, "the process it started is gone"
    assert our_traces(hosts) == []


# A process that makes Hosts and dies without leaving the `with`: by sys.exit (atexit takes
# them down) or by SIGKILL (the next Hosts, or sweep_orphans, does).
CRASH = textwrap.dedent("""
    import os, signal, sys
    from tests.hosts import Hosts
    hosts = Hosts(["a", "b"]).__enter__()
    print(" ".join([*hosts.ns.values(), hosts.switch]), flush=True)
    if sys.stdin.readline().strip() == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(3)
""")


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_a_crashed_run_leaves_nothing_behind(how):
    why = cannot_make_hosts()
    if why:
        pytest.skip(why)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", CRASH], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env, cwd=ROOT)
    try:
        made = proc.stdout.readline().split()
        assert len(made) == 3, made
        assert set(made) <= set(subprocess.run(["ip", "netns", "list"], capture_output=True,
                                               text=True).stdout.split())
        proc.stdin.write(how + "\n")
        proc.stdin.close()
        code = proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    if how == "kill":
        assert code == -signal.SIGKILL
        sweep_orphans()  # atexit did not run: the sweep removes them (or a parallel run's did)
    else:
        assert code == 3
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert [ns for ns in made if ns in listed or (NETNS_ETC / ns).exists()] == []
