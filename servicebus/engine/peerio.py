"""The engine's I/O with its peers: frames read off the ROUTER and every DEALER, decoded
and fed to the core; frames the core asks for, sent; CURVE handshake failures counted and
the next key of a peer that changed keys tried. On the engine thread, like the core.
"""

from __future__ import annotations

import logging

import zmq

from ..core import Core
from ..errors import BusError
from ..model.config import BusConfig
from ..wire import protocol as P
from ..wire.decoding import decode
from .sockets import Sockets

__all__ = ["PeerIO", "READ_LIMIT", "KEY_SWITCH_AFTER"]

log = logging.getLogger("servicebus")

READ_LIMIT = 2000  # frames read from one socket per turn, so one peer cannot starve the rest
KEY_SWITCH_AFTER = 2.0  # a peer down this long with several keys listed: try its next key


def _property(frame: zmq.Frame, name: str) -> str | None:
    """A ZeroMQ message property: "Peer-Address", or with CURVE "User-Id" (the client's
    public key, as the ZAP handler names it)."""
    try:
        return str(frame.get(name))
    except zmq.ZMQError:  # a transport or mechanism without one
        return None


class PeerIO:
    def __init__(self, sockets: Sockets, core: Core, config: BusConfig) -> None:
        self.sockets = sockets
        self.core = core
        self.config = config
        self._key_tried: dict[str, float] = {}  # address -> when its next CURVE key was tried

    def read(self, events: dict, now: float) -> None:
        sockets = self.sockets
        if sockets.monitor is not None and sockets.monitor in events:
            self.count_handshakes()
        if sockets.router in events:
            self.read_router(now)
        for sock in events:
            address = sockets.address_of(sock)
            if address is not None:
                self.read_dealer(address, sock, now)
        # NACKs a pong led to (subscribes naming an alias of this bus): at once too.
        for ident, reply in self.core.take_router_frames():
            self.send_router(ident, reply)

    def count_handshakes(self) -> None:
        s = self.core.s
        for name in self.sockets.handshake_failures():
            total = s.tally(s.counters, name, "handshake_failed")
            if total is not None:
                log.warning("a peer failed the CURVE handshake (%s: a NULL client or an unknown "
                            "key); %d so far", name, total)

    def switch_keys(self, now: float) -> None:
        """A peer that stays down although peers.toml lists several keys for it may have
        switched to another: try the next one every KEY_SWITCH_AFTER seconds."""
        peers = self.core.s.peers
        for address in self.sockets.switchable:
            peer = peers.get(address)
            if peer is None or peer.up or now - peer.down_since < KEY_SWITCH_AFTER:
                continue
            if now - self._key_tried.get(address, 0.0) < KEY_SWITCH_AFTER:
                continue
            self._key_tried[address] = now
            if self.sockets.try_next_key(address):
                log.info("peer %s does not answer: trying the next key peers.toml lists for it", address)

    def send_frames(self, now: float) -> None:
        failed: set[str] = set()
        sent = 0
        for address, frames, count in self.core.take_frames():
            if address in failed:
                continue
            if self.sockets.send_peer(address, frames):
                sent += count
            else:
                failed.add(address)
                self.core.unreachable(address, now)
        self.core.s.counters["sent"] += sent

    def send_router(self, ident: bytes, frames: list[bytes]) -> None:
        if not self.sockets.send_router(ident, frames):
            self.core.s.counters["router_send_failed"] += 1

    def decode(self, frames: list[bytes]) -> P.Frame | None:
        try:
            return decode(frames, max_payload=self.config.max_payload)
        except BusError as exc:
            self.core.malformed(getattr(exc, "reason", "malformed"), str(exc))
            return None

    def read_router(self, now: float) -> None:
        router, core = self.sockets.router, self.core
        assert router is not None
        curve = self.sockets.keys is not None
        for _ in range(READ_LIMIT):
            try:
                # The identity part uncopied: it carries the connection's Peer-Address.
                # Not cached by identity: a peer may choose its identity, and the ROUTER
                # hands an identity over to the latest connection that claims it.
                first = router.recv(zmq.NOBLOCK, copy=False)
                frames = [first.bytes]
                while router.getsockopt(zmq.RCVMORE):
                    frames.append(router.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            if len(frames) < 2:
                core.malformed("bad_frame_count", f"{len(frames)} frame(s)")
                continue
            frame = self.decode(frames[1:])
            if frame is not None:
                # Only frames that name an address to connect to need to know where they
                # came from (events, the bulk, do not).
                events = isinstance(frame, P.Batch) and frame.kind != P.Kind.COMMAND
                if events or isinstance(frame, P.Ping):
                    core.on_router(frames[0], frame, now)
                else:
                    user = _property(first, "User-Id") if curve else None
                    core.on_router(frames[0], frame, now, _property(first, "Peer-Address"), user)
        for ident, reply in core.take_router_frames():  # pongs and nacks, at once
            self.send_router(ident, reply)

    def read_dealer(self, address: str, sock: zmq.Socket, now: float) -> None:
        for _ in range(READ_LIMIT):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            frame = self.decode(frames)
            if frame is not None:
                self.core.on_dealer(address, frame, now)
                if sock.closed:  # the core let the connection go (an alias of this bus)
                    return
