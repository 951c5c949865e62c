"""Whom a bus with CURVE keys trusts, and with what (no I/O: the core asks it).

Loaded from ``DIR/peers.toml`` by ``keys.py``; see there for the file's format.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

__all__ = ["PeerEntry", "Keys"]


@dataclass(frozen=True)
class PeerEntry:
    address: str
    keys: tuple[str, ...]  # Z85 public keys, newest first
    subscribe: tuple[str, ...] | None = None  # None: any topic
    send: tuple[str, ...] | None = None  # None: any command

    def may_subscribe(self, topic: str) -> bool:
        return self.subscribe is None or any(fnmatch.fnmatchcase(topic, p) for p in self.subscribe)

    def may_send(self, command: str) -> bool:
        return self.send is None or any(fnmatch.fnmatchcase(command, p) for p in self.send)


@dataclass(frozen=True)
class Keys:
    public: bytes  # Z85
    secret: bytes = field(repr=False)  # Z85; never in a log line
    peers: tuple[PeerEntry, ...] = ()

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
        return ()

    def allowed(self, key: str) -> bool:
        return self.peer_of(key) is not None or key == self.public.decode()
