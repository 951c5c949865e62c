"""Several hosts on one machine, for tests that need a bus spread over a network: one network
namespace per host, all plugged into one Linux bridge (a switch, in a namespace of its own),
each host with an address on a private /24 and an /etc/hosts through which every host finds
every other by its short name. A host can be cut off (its cable pulled out of the switch) and
healed, and redeployed at a new address. Everything it sets up it takes down again on exit,
on a crash of the test process (atexit), or, after a SIGKILL, the next time a ``Hosts`` is
made (``sweep_orphans``). ``cannot_make_hosts()`` says why it cannot run (not root, no
network namespaces, no bridge or veth in this kernel) so callers skip with that reason.

Why not the root namespace: the switch, its ports and every address live in namespaces made
here, so nothing on the machine itself (its routes, its firewall, other test runs) changes.
"""

from __future__ import annotations

import atexit
import functools
import ipaddress
import os
import random
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Hosts", "cannot_make_hosts", "sweep_orphans"]

NETNS_ETC = Path("/etc/netns")
PREFIX = "sbh"  # every namespace made here: sbh-<creator pid>-<tag>-...
_NAME = re.compile(r"^[a-z][a-z0-9-]{0,30}$")
_OURS = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]+-")
GRACE = 1.0  # seconds between SIGTERM and SIGKILL on exit


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


def _must(*args: str) -> str:
    done = _ip(*args)
    if done.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def _namespaces() -> list[str]:
    """Names of the network namespaces ``ip netns`` knows (the first word of each line)."""
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]


@functools.cache
def cannot_make_hosts() -> str | None:
    """Why namespaces joined by a bridge cannot be made here, or None. Makes (and removes) a
    namespace with a bridge and a veth pair in it, once per process: a kernel or container may
    lack either even to root."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (the ip command) is not installed"
    if not Path("/etc/hosts").is_file():
        return "/etc/hosts is missing: ip netns exec has nothing to bind each host's hosts file over"
    probe = f"{PREFIX}-{os.getpid()}-0-probe"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"this kernel cannot make network namespaces: {made.stderr.strip()}"
    try:
        bridge = _ip("-n", probe, "link", "add", "br0", "type", "bridge")
        if bridge.returncode != 0:
            return f"this kernel cannot make a bridge (module bridge): {bridge.stderr.strip()}"
        veth = _ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        if veth.returncode != 0:
            return f"this kernel cannot make a veth pair (module veth): {veth.stderr.strip()}"
    finally:
        _ip("netns", "del", probe)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_pids(pids: Iterable[int], grace: float = GRACE) -> None:
    """SIGTERM each pid, then SIGKILL those still there after ``grace`` seconds. For
    processes that are not our children (``ip netns pids``): they cannot be waited for, so
    "gone" is "no longer signalable" (a zombie of another parent still counts as there)."""
    pids = [pid for pid in pids if pid != os.getpid()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            pids = [pid for pid in pids if _alive(pid)]
            time.sleep(0.02)


def _remove_namespace(ns: str) -> list[str]:
    """Kill what still runs in ``ns`` (by pid), delete it (the links in it go along: a veth
    whose one end is in it, the bridge), remove /etc/netns/<ns>. Returns what failed."""
    failed: list[str] = []
    if ns in _namespaces():
        pids = [int(word) for word in _ip("netns", "pids", ns).stdout.split() if word.isdigit()]
        _kill_pids(pids)
        done = _ip("netns", "del", ns)
        if done.returncode != 0:
            failed.append(f"ip netns del {ns}: {done.stderr.strip()}")
    try:
        shutil.rmtree(NETNS_ETC / ns)
    except FileNotFoundError:
        pass
    except OSError as exc:
        failed.append(f"rm -r {NETNS_ETC / ns}: {exc}")
    return failed


def sweep_orphans() -> list[str]:
    """Remove the namespaces (and /etc/netns dirs) that a Hosts made in a process that has
    ended without taking them down (SIGKILL, a timeout's kill): their names carry the
    creator's pid. Those of live processes, this one included, are left alone. Returns the
    names removed. (A pid reused since is taken for alive: the sweep errs on leaving.)"""
    names = set(_namespaces())
    if NETNS_ETC.is_dir():
        names |= {entry.name for entry in NETNS_ETC.iterdir()}
    removed = []
    for ns in sorted(names):
        match = _OURS.match(ns)
        if match and not _alive(int(match.group(1))):
            _remove_namespace(ns)
            removed.append(ns)
    return removed


def _networks_in_use() -> list[ipaddress.IPv4Network]:
    """IPv4 networks of the root namespace's addresses and routes."""
    found = []
    text = _ip("-o", "-4", "addr").stdout + "\n" + _ip("-4", "route", "show", "table", "all").stdout
    for word in re.findall(r"\b\d+\.\d+\.\d+\.\d+(?:/\d+)?\b", text):
        try:
            found.append(ipaddress.ip_network(word, strict=False))
        except ValueError:
            continue
    return [net for net in found if isinstance(net, ipaddress.IPv4Network)]


def _pick_subnet() -> ipaddress.IPv4Network:
    """A random 10.x.y.0/24 that overlaps nothing in use in the root namespace."""
    used = _networks_in_use()
    for _ in range(1000):
        net = ipaddress.IPv4Network(f"10.{random.randrange(256)}.{random.randrange(256)}.0/24")
        if not any(net.overlaps(other) for other in used):
            return net
    raise OSError("no free 10.x.y.0/24: every one tried overlaps an address or route in use")


# The Hosts still up in this process: taken down at exit if a test crashed past its `with`.
_LIVE: set["Hosts"] = set()


@atexit.register
def _take_down_live() -> None:
    for hosts in list(_LIVE):
        hosts.close()


class Hosts:
    """Hosts named ``names`` (short host names: ``orders``, ``email``), each a network
    namespace with loopback and one interface ``eth0`` plugged into a bridge, an address on a
    random free 10.x.y.0/24, and an /etc/hosts naming every host. Use as a context manager:
    on exit it kills the processes it started, deletes the namespaces (the bridge and the veth
    pairs go with them) and their /etc/netns dirs, whatever happened in the body."""

    BRIDGE = "br0"
    DEV = "eth0"  # each host's interface, inside its namespace

    def __init__(self, names: Sequence[str]) -> None:
        names = list(names)
        if not names:
            raise ValueError("Hosts needs at least one host name")
        for name in names:
            if not _NAME.match(name) or name == "localhost":
                raise ValueError(f"{name!r} is not a short host name (a-z, 0-9, '-', starting with a letter)")
        if len(set(names)) != len(names):
            raise ValueError(f"host names repeat: {names}")
        self.names = names
        self.tag = os.urandom(3).hex()
        base = f"{PREFIX}-{os.getpid()}-{self.tag}"
        self.switch = f"{base}-switch"  # the bridge's namespace
        self.ns = {name: f"{base}-{name}" for name in names}
        self.port = {name: f"p{index}" for index, name in enumerate(names)}  # in the switch's namespace
        self.subnet: ipaddress.IPv4Network | None = None
        self._ip: dict[str, str] = {}
        self._next_host = 2  # .1 is left for a gateway nobody has
        self._cut: set[str] = set()
        self.procs: list[subprocess.Popen[Any]] = []
        self.closed = False

    # --- setup and teardown ------------------------------------------------------------------

    def __enter__(self) -> "Hosts":
        sweep_orphans()
        _LIVE.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        subnet = self.subnet = _pick_subnet()
        _must("netns", "add", self.switch)
        NETNS_ETC.mkdir(exist_ok=True)
        _must("-n", self.switch, "link", "add", self.BRIDGE, "type", "bridge")
        _must("-n", self.switch, "link", "set", self.BRIDGE, "addrgenmode", "none")  # no IPv6 address either
        _must("-n", self.switch, "link", "set", self.BRIDGE, "up")
        for name in self.names:
            ns, port = self.ns[name], self.port[name]
            _must("netns", "add", ns)
            # Made inside the switch's namespace, the other end moved straight into the host's:
            # neither end is ever in the root namespace.
            _must("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", self.DEV, "netns", ns)
            _must("-n", self.switch, "link", "set", port, "addrgenmode", "none")
            _must("-n", self.switch, "link", "set", port, "master", self.BRIDGE)
            _must("-n", self.switch, "link", "set", port, "up")
            self._ip[name] = self._new_address()
            _must("-n", ns, "addr", "add", f"{self._ip[name]}/{subnet.prefixlen}", "dev", self.DEV)
            _must("-n", ns, "link", "set", self.DEV, "up")
            _must("-n", ns, "link", "set", "lo", "up")
            (NETNS_ETC / ns).mkdir()
        self._write_hosts_files()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        failed = self.close()
        if failed and exc_type is None:
            raise OSError("Hosts left things behind: " + "; ".join(failed))

    def close(self) -> list[str]:
        """Take everything down (idempotent). Returns what could not be removed."""
        if self.closed:
            return []
        self.closed = True
        _LIVE.discard(self)
        self._stop_procs()
        failed: list[str] = []
        for ns in [*self.ns.values(), self.switch]:
            failed += _remove_namespace(ns)
        return failed

    def _stop_procs(self) -> None:
        running = [proc for proc in self.procs if proc.poll() is None]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in running:
                try:
                    # Its own session (popen's default): the group is its pid, and takes the
                    # children it started along.
                    if os.getpgid(proc.pid) == proc.pid:
                        os.killpg(proc.pid, sig)
                    else:
                        os.kill(proc.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + GRACE
            for proc in running:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()) if sig == signal.SIGTERM else 10)
                except subprocess.TimeoutExpired:
                    pass
            running = [proc for proc in running if proc.poll() is None]
        for proc in self.procs:
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()

    # --- addresses and names -----------------------------------------------------------------

    def _new_address(self) -> str:
        """The next address of the subnet never given out in this Hosts (a redeploy does not
        get an address a host had before)."""
        assert self.subnet is not None
        if self._next_host > 254:
            raise OSError(f"{self.subnet} has no address left that was never used")
        address = str(self.subnet.network_address + self._next_host)
        self._next_host += 1
        return address

    def hosts_file(self) -> str:
        """The /etc/hosts every host sees. Fixed-width lines: a readdress leaves the length the
        same, so the file is rewritten by one write over the old bytes."""
        lines = ["127.0.0.1       localhost", "::1             localhost ip6-localhost ip6-loopback"]
        lines += [f"{self._ip[name]:<15} {name}" for name in self.names]
        return "\n".join(lines) + "\n"

    def _write_hosts_files(self) -> None:
        # In place, not a new file renamed over it: `ip netns exec` bind-mounts this very
        # file (its inode) over /etc/hosts, so the processes already running in a host only
        # see what is written into it.
        data = self.hosts_file().encode()
        for ns in self.ns.values():
            fd = os.open(NETNS_ETC / ns / "hosts", os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.pwrite(fd, data, 0)
                os.ftruncate(fd, len(data))
            finally:
                os.close(fd)

    def ip(self, host: str) -> str:
        """``host``'s current IPv4 address."""
        return self._ip[self._known(host)]

    def _known(self, host: str) -> str:
        if host not in self.ns:
            raise KeyError(f"no host {host!r} (hosts: {', '.join(self.names)})")
        return host

    # --- running things in a host ------------------------------------------------------------

    def prefix(self, host: str) -> list[str]:
        """Command prefix that runs a program inside ``host`` (its network and its /etc/hosts)."""
        return ["ip", "netns", "exec", self.ns[self._known(host)]]

    def popen(self, host: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in ``host`` (keywords as subprocess.Popen's; in a session of its own
        unless ``start_new_session=False``). Killed on exit if still running."""
        if self.closed:
            raise RuntimeError("these Hosts are taken down")
        kw.setdefault("start_new_session", True)
        proc = subprocess.Popen([*self.prefix(host), *argv], **kw)
        self.procs.append(proc)
        return proc

    def run(self, host: str, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` in ``host`` to the end (keywords as subprocess.run's)."""
        return subprocess.run([*self.prefix(host), *argv], **kw)

    # --- faults ------------------------------------------------------------------------------

    def cut(self, host: str) -> None:
        """Cut ``host`` off from every other host: its cable out of the switch (its port taken
        out of the bridge). Packets both ways vanish without an error, as in a real partition;
        nothing inside the host changes (its link stays up, its address, routes and firewall
        stay), and it still reaches itself."""
        self._known(host)
        _must("-n", self.switch, "link", "set", self.port[host], "nomaster")
        self._cut.add(host)

    def heal(self, host: str) -> None:
        """Plug ``host`` back in (its port back into the bridge: forwarding at once, the bridge
        runs no STP). A no-op for a host not cut. A new connection works at once; one that was
        open across the cut resumes at TCP's next retransmission, and the wait between those
        doubles: measured here, 0.3-0.7 s after heal for a cut of 1-3 s, 5.4 s for one of 8 s."""
        self._known(host)
        if host in self._cut:
            _must("-n", self.switch, "link", "set", self.port[host], "master", self.BRIDGE)
            self._cut.discard(host)

    def is_cut(self, host: str) -> bool:
        return self._known(host) in self._cut

    def readdress(self, host: str) -> str:
        """Redeploy ``host`` at a new address (one no host had before): the old address is
        removed from it, so nothing answers there any more, and every hosts file now names the
        new one. The other hosts forget the old address's ARP entry, as they would for a host
        that is gone. Processes in ``host`` keep running (one bound to ``*`` serves the new
        address); connections made to or from the old address are dead. Returns the new address."""
        self._known(host)
        assert self.subnet is not None
        old, new = self._ip[host], self._new_address()
        ns, prefixlen = self.ns[host], self.subnet.prefixlen
        # Old one out first: deleting a primary address also deletes the secondaries of its
        # subnet (promote_secondaries is off by default), and the new one would be one.
        _must("-n", ns, "addr", "del", f"{old}/{prefixlen}", "dev", self.DEV)
        _must("-n", ns, "addr", "add", f"{new}/{prefixlen}", "dev", self.DEV)
        self._ip[host] = new
        self._write_hosts_files()
        for other in self.names:
            if other != host:
                _ip("-n", self.ns[other], "neigh", "flush", "to", old)
        return new
