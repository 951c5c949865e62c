"""Whom a bus with CURVE keys trusts, and with what (no I/O: the core asks it).

The key directory (``Bus(..., keys=DIR)``): ``servicebus keygen DIR`` writes
``DIR/bus.key`` (public) and ``DIR/bus.key_secret`` (secret, mode 0600) with pyzmq's
certificate writer (ops/keys.py). ``DIR/peers.toml`` lists the buses this one talks to,
each with the public key(s) it may use and, optionally, what it may do::

    [[peer]]
    address = "tcp://10.0.0.5:5555"          # where it listens (as it advertises itself)
    keys = ["rq3...Z85 public key...="]     # several during a key switch, newest first
    subscribe = ["orders.*", "user.signup"]  # optional: topics it may subscribe to (fnmatch)
    send = ["charge"]                        # optional: commands it may send or request
    names = ["orders"]                       # optional: service names it may announce

With discovery (``Bus(name=..., seeds=...)``) an entry may leave ``address`` out: the
instance gives its address itself, bound to its key; ``names`` then says which service it
may be (no name at all if left out: nobody can announce another service's name).

With keys, every socket of the bus speaks CURVE (ZeroMQ's CurveZMQ: encrypted and
authenticated): a peer whose key is not listed, or that speaks NULL, is refused during the
handshake and counted; a listed peer may name only its own address in a subscribe or a
request, and only do what its entry allows. The bus reads the directory when it opens
(engine/keys.py); this module parses what it read.
"""

from __future__ import annotations

import fnmatch
import tomllib
from dataclasses import dataclass, field

__all__ = ["PeerEntry", "Keys", "KEY_NAME", "parse_peers"]

KEY_NAME = "bus"  # DIR/bus.key and DIR/bus.key_secret


@dataclass(frozen=True)
class PeerEntry:
    address: str
    keys: tuple[str, ...]  # Z85 public keys, newest first
    subscribe: tuple[str, ...] | None = None  # None: any topic
    send: tuple[str, ...] | None = None  # None: any command
    names: tuple[str, ...] = ()  # service names it may announce (discovery)

    def may_name(self, name: str) -> bool:
        return name in self.names

    def may_subscribe(self, topic: str) -> bool:
        return self.subscribe is None or any(fnmatch.fnmatchcase(topic, p) for p in self.subscribe)

    def may_send(self, command: str) -> bool:
        return self.send is None or any(fnmatch.fnmatchcase(command, p) for p in self.send)


@dataclass(frozen=True)
class Keys:
    public: bytes  # Z85
    secret: bytes = field(repr=False)  # Z85; never in a log line
    peers: tuple[PeerEntry, ...] = ()
    # Addresses discovery learnt first hand from a listed key (core/members.py): connected
    # to with that key as the server's. The only mutable part: the engine thread's.
    learned: dict[str, tuple[str, ...]] = field(default_factory=dict, compare=False, repr=False)

    def peer_of(self, key: str | None) -> PeerEntry | None:
        """The entry that lists public key ``key`` (a client's ZAP User-Id)."""
        if key is None:
            return None
        for peer in self.peers:
            if key in peer.keys:
                return peer
        return None

    def server_keys(self, address: str) -> tuple[str, ...]:
        """The public keys the bus at ``address`` may present, newest first."""
        for peer in self.peers:
            if peer.address == address:
                return peer.keys
        return self.learned.get(address, ())

    def allowed(self, key: str) -> bool:
        return self.peer_of(key) is not None or key == self.public.decode()


def _z85_key(value: object, where: str) -> str:
    if not isinstance(value, str) or len(value) != 40:
        raise ValueError(f"{where}: a public key is 40 Z85 characters, got {value!r}")
    return value


def _patterns(entry: dict, name: str, where: str) -> tuple[str, ...] | None:
    value = entry.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}: {name} must be a list of strings")
    return tuple(value)


def parse_peers(text: str, source: str) -> tuple[PeerEntry, ...]:
    """The entries of a ``peers.toml`` (read from ``source``, named in errors);
    ``ValueError`` naming the entry and the problem."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{source}: {exc}") from exc
    peers: list[PeerEntry] = []
    for n, entry in enumerate(data.get("peer", []), 1):
        where = f"{source} peer #{n}"
        names = _patterns(entry, "names", where) if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or not isinstance(entry.get("address", "" if names else None), str):
            raise ValueError(f"{where}: needs address = \"tcp://host:port\" (or ipc://path), "
                             "or names = [...] for an instance discovery finds")
        keys = entry.get("keys")
        if not isinstance(keys, list) or not keys:
            raise ValueError(f"{where}: needs keys = [\"<public key>\", ...]")
        peers.append(PeerEntry(entry.get("address", ""), tuple(_z85_key(k, where) for k in keys),
                               _patterns(entry, "subscribe", where), _patterns(entry, "send", where),
                               names or ()))
    return tuple(peers)
