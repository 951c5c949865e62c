"""Which addresses taken off the wire a bus may connect to (DESIGN.md section 3, rule 10).

A SUBSCRIBE names the address to deliver to, a request the address to reply to; the bus
connects to them. Without a policy anyone who reaches the port could make it connect
anywhere (another host, any Unix socket on this one) and pile messages up there. So an
address from the wire is allowed only if:

- it is on the host the frame came from: a ``tcp://`` address whose host is the
  connection's source IP (every loopback address counts as one host, and ``localhost`` as
  loopback), or an ``ipc://`` address when the frame came over a Unix socket from a process
  of this bus's own user; or
- it matches an entry of ``allow_peers``: an IP, a CIDR (``10.0.0.0/8``; ``0.0.0.0/0`` and
  ``::/0`` allow every TCP peer), a host name (compared as written, never resolved: the
  engine does not wait on DNS), or an ``ipc://`` path prefix.

``source`` is ZeroMQ's "Peer-Address" of the frame: the IP for TCP, and
``localhost:UID:GID:PID`` for a Unix socket.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Iterable

__all__ = ["AddressPolicy", "OwnAddress", "parse_allow"]

_TCP = re.compile(r"^tcp://(?:\[(?P<v6>[^\]]+)\]|(?P<host>[^:/\[\]]+)):(?P<port>\d+)$")
_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}

Net = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_allow(entries: Iterable[str]) -> tuple[tuple[Net, ...], frozenset[str], tuple[str, ...]]:
    """``allow_peers`` entries as (networks, host names, ipc path prefixes); ``ValueError``
    for an entry that is none of them."""
    nets: list[Net] = []
    names: set[str] = set()
    ipc: list[str] = []
    for entry in entries:
        if not isinstance(entry, str) or not entry.strip():
            raise ValueError(f"allow_peers entry {entry!r} is not a host, CIDR or ipc:// path")
        entry = entry.strip()
        if entry.startswith("ipc://"):
            if len(entry) <= len("ipc://"):
                raise ValueError("allow_peers entry 'ipc://' names no path")
            ipc.append(entry[len("ipc://"):])
            continue
        try:
            nets.append(ipaddress.ip_network(entry, strict=False))
            continue
        except ValueError:
            pass
        if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?", entry):
            raise ValueError(f"allow_peers entry {entry!r} is not a host, CIDR or ipc:// path")
        names.add(entry.lower())
    return tuple(nets), frozenset(names), tuple(ipc)


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


class AddressPolicy:
    def __init__(self, allow_peers: Iterable[str] = (), uid: int = 0) -> None:
        self.nets, self.names, self.ipc = parse_allow(allow_peers)
        self.uid = uid  # this bus's user: an ipc peer of the same user may name ipc addresses
        # Every request frame is checked: the same few (address, source) pairs, remembered.
        self._seen: dict[tuple[str, str | None], str | None] = {}

    def refuse(self, address: str, source: str | None) -> str | None:
        """None if the bus may connect to ``address`` named by a frame from ``source``;
        otherwise why not (a short reason for counters and logs)."""
        key = (address, source)
        try:
            return self._seen[key]
        except KeyError:
            pass
        if len(self._seen) >= 4096:
            self._seen.clear()  # bounded: a flood of distinct addresses must not grow it
        reason = self._seen[key] = self._refuse(address, source)
        return reason

    def _refuse(self, address: str, source: str | None) -> str | None:
        if address.startswith("ipc://"):
            path = address[len("ipc://"):]
            if any(path.startswith(prefix) for prefix in self.ipc):
                return None
            if source is not None and source.startswith("localhost:"):
                parts = source.split(":")
                if len(parts) >= 2 and parts[1] == str(self.uid):
                    return None
                return "ipc_other_user"
            return "ipc_from_network"
        match = _TCP.match(address)
        if match is None:
            return "not_tcp_or_ipc"
        host = (match.group("v6") or match.group("host") or "").lower()
        ip = _ip(host)
        if ip is None:
            if host in self.names:
                return None
            if host not in _LOOPBACK_NAMES:
                return "host_name_not_allowed"
            ip = ipaddress.ip_address("127.0.0.1")
        if any(ip in net for net in self.nets):
            return None
        src = _ip(source) if source is not None else None
        if src is not None and (src == ip or (src.is_loopback and ip.is_loopback)):
            return None
        return "not_source_host"


_WILDCARDS = {"*", "0.0.0.0", "::", ""}


def _tcp_parts(address: str) -> tuple[str, int] | None:
    """(host, port) of a ``tcp://`` address, the host lower-cased and a loopback name as
    127.0.0.1 (as ZeroMQ resolves it: IPv4 unless asked for IPv6); None for others."""
    match = _TCP.match(address)
    if match is None:
        return None
    host = (match.group("v6") or match.group("host") or "").lower()
    return ("127.0.0.1" if host in _LOOPBACK_NAMES else host), int(match.group("port"))


class OwnAddress:
    """Whether an address names this bus itself: a bus never subscribes itself (it would
    store every event it publishes a second time, as incoming, for good).

    Known from how the bus was set up (its advertised address, the endpoint it bound):
    the same address; ``localhost`` for a loopback address; for a bus bound on every
    interface, any loopback address on its port; an ipc path spelled another way
    (``a/../b``, ``//``). Aliases only the network or the file system knows (a host name
    or interface address of this machine, an ipc path through a symlink) are learnt when
    the address answers a ping with this very bus's node id and boot (``learn``)."""

    LEARNT_MAX = 256  # aliases learnt from pongs, at most (each needed a connection first)

    def __init__(self, addresses: Iterable[str]) -> None:
        self.exact: set[str] = set()
        self.tcp: set[tuple[str, int]] = set()
        self.any_interface: set[int] = set()  # ports bound on every interface
        self.ipc: set[str] = set()
        for address in addresses:
            self._add(address)

    def _add(self, address: str) -> None:
        self.exact.add(address)
        if address.startswith("ipc://"):
            self.ipc.add(os.path.normpath(address[len("ipc://"):]))
            return
        parts = _tcp_parts(address)
        if parts is None:
            return
        host, port = parts
        if host in _WILDCARDS:
            self.any_interface.add(port)
        else:
            self.tcp.add((host, port))

    def learn(self, address: str) -> None:
        """``address`` answered a ping with this bus's own node id and boot."""
        if len(self.exact) >= self.LEARNT_MAX:
            return  # bounded: the static forms and the first ones learnt still hold
        self._add(address)

    def __contains__(self, address: object) -> bool:
        if not isinstance(address, str):
            return False
        if address in self.exact:
            return True
        if address.startswith("ipc://"):
            return os.path.normpath(address[len("ipc://"):]) in self.ipc
        parts = _tcp_parts(address)
        if parts is None:
            return False
        host, port = parts
        if (host, port) in self.tcp:
            return True
        if port in self.any_interface:
            ip = _ip(host)
            return ip is not None and ip.is_loopback
        return False
