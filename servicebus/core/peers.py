"""Peers and their liveness: who we send to, whether they answer, and when to forget them.

A peer is up from its first pong until a send to it fails or it stays silent for
``peer_timeout``. Pings go every ``heartbeat`` while it is up, every DOWN_PING while it is
down, and every WAITING_PING for a short while after it went down if messages wait for
it (a new subscriber, a restart), so that they are not held for a whole ping period.
"""

from __future__ import annotations

import logging

from ..wire import protocol as P
from ..model.delivery import Consumer, group_peer, is_command_stream, stream_target
from ..model.stored import DeliveryRecord
from .owed import journal_moved, owed, owed_to_member
from .state import Peer, State

__all__ = ["Roster", "PeerLimit", "DOWN_PING", "WAITING_PING", "WAITING_FAST"]

log = logging.getLogger("servicebus")

DOWN_PING = 0.2  # ping a peer this often while it is down, to notice it coming back soon
WAITING_PING = 0.01  # ... and this often while messages wait for it (first contact, restarts),
WAITING_FAST = 2.0  # ... for this long after it went down; then at DOWN_PING again


class PeerLimit(ValueError):
    """A new address while ``max_peers`` are connected."""


class Roster:
    def __init__(self, state: State) -> None:
        self.s = state

    # --- membership --------------------------------------------------------------------

    def peer(self, address: str) -> Peer:
        """The peer at ``address``, connecting to it first if needed. ``ValueError`` if it
        cannot be connected: callers call this before they change any other state, so
        such an address leaves nothing half-registered."""
        peer = self.s.peers.get(address)
        if peer is None:
            if len(self.s.peers) >= self.s.config.max_peers:
                raise PeerLimit(f"cannot connect to {address[:200]}: {len(self.s.peers)} peers "
                                "connected already (option max_peers)")
            self.s.links.connect(address)
            peer = Peer(address, down_since=self.s.now)
            self.s.peers[address] = peer
        return peer

    def drop_if_unused(self, address: str) -> None:
        """Close the connection to ``address`` if nothing uses it: no consumer, no intent."""
        s = self.s
        peer = s.peers.get(address)
        if peer is None or peer.consumers or any(i.publisher == address for i in s.intents.values()):
            return
        del s.peers[address]
        s.outbox.pop(peer, None)
        s.links.forget(address)

    def add_consumer(self, consumer: Consumer) -> None:
        s = self.s
        peer = self.peer(consumer.peer)  # first: a failure to connect leaves nothing behind
        s.consumers[(consumer.peer, consumer.stream)] = consumer
        s.by_stream[consumer.stream].append(consumer)
        peer.consumers.append(consumer)
        self._update_stream_peers(consumer.stream)

    def join_group(self, name: str, stream: str, member: str, state: DeliveryRecord | None,
                   since: str | None) -> Consumer:
        """Add ``member`` to the subscriber group ``name`` on ``stream``, making the group's
        shared consumer first if needed (from its stored ``state``, or starting after
        ``since``). ``ValueError`` before any change if ``member`` cannot be connected."""
        s = self.s
        peer = self.peer(member)
        key = (group_peer(name), stream)
        consumer = s.consumers.get(key)
        if consumer is None:
            if state is not None:
                consumer = Consumer.from_record(key[0], stream, state)
            else:
                consumer = Consumer(key[0], stream, since)
                consumer.exhausted = True  # it starts at the end of the stream
            consumer.members = []
            consumer.dirty = True
            s.consumers[key] = consumer
            s.by_stream[stream].append(consumer)
            self._update_stream_peers(stream)
        assert consumer.members is not None
        if member not in consumer.members:
            consumer.members.append(member)
            peer.consumers.append(consumer)
        return consumer

    def leave_group(self, name: str, stream: str, member: str) -> Consumer | None:
        """Take ``member`` out of its group: its messages in flight are sent again to the
        others at once. Returns the group's consumer if it was the last member (the group
        is gone then), else None."""
        s = self.s
        consumer = s.consumers.get((group_peer(name), stream))
        if consumer is None or consumer.members is None or member not in consumer.members:
            return None
        consumer.members.remove(member)
        peer = s.peers.get(member)
        if peer is not None and consumer in peer.consumers:
            peer.consumers.remove(consumer)
        if consumer.members:
            for mid, to in consumer.assigned.items():
                flight = consumer.inflight.get(mid)
                if to == member and flight is not None:
                    flight.deadline = 0.0
            s.tick_due = True
            return None
        del s.consumers[(consumer.peer, stream)]
        s.by_stream[stream].remove(consumer)
        if not s.by_stream[stream]:
            del s.by_stream[stream]
        self._update_stream_peers(stream)
        return consumer

    def move(self, old: str, new: str, node: str) -> None:
        """The instance ``node`` listens at ``new`` now, no longer at ``old`` (discovery,
        core/members.py): its subscriptions, their cursors and what they are owed, and
        the commands queued for it go there. What it had in flight is resent there at
        once (its dedupe makes a resend of what it had handled harmless). The journal says
        of each message it was owed that it was ``dropped`` at ``old`` (error ``moved to
        NEW``) and ``published`` to ``new`` (core/owed.py): one read of what it is owed,
        here, not a cost per frame."""
        s = self.s
        if old == new or old in s.own or new in s.own:
            return
        topics = set()
        for (subscriber, topic), record in list(s.subscriptions.items()):
            if subscriber != old or (record.get("node") not in (None, node)):
                continue  # another bus's (it subscribed from that address before)
            newer = s.subscriptions.get((new, topic))
            if newer is not None:
                if newer.get("node") != node or newer.get("group") or record.get("group"):
                    continue  # another bus's, or a group's: the old one ends as it would
                # It subscribed again from there before we learnt it moved (a service calls
                # subscribe at every start): that newer subscription goes, and the older one,
                # with what it is still owed, takes its place (what both delivered is
                # deduplicated by the receiver). Before, the older one's backlog stayed behind.
                for consumer in [c for (peer, _st), c in list(s.consumers.items())
                                 if peer == new and stream_target(c.stream) == topic]:
                    self.remove_consumer(consumer)
                    s.out.batch.delete_delivery(new, consumer.stream)
                del s.subscriptions[(new, topic)]
            del s.subscriptions[(old, topic)]
            s.subscriptions[(new, topic)] = record
            s.out.batch.delete_subscription(old, topic)
            s.out.batch.put_subscription(new, topic, record)
            topics.add(topic)
        target = self.peer(new)
        source = s.peers.get(old)
        for consumer in list(source.consumers if source is not None else ()):
            if not is_command_stream(consumer.stream) and stream_target(consumer.stream) not in topics:
                continue
            if consumer.members is not None:  # a group: the member's address changes
                journal_moved(s, consumer.stream, old, new,
                              owed_to_member(s, consumer, old) if s.events_on else [])
                consumer.members[consumer.members.index(old)] = new
                for mid, member in list(consumer.assigned.items()):
                    if member == old:
                        consumer.assign(mid, new)
                        flight = consumer.inflight.get(mid)
                        if flight is not None:
                            flight.deadline = 0.0
                source.consumers.remove(consumer)  # type: ignore[union-attr]
                target.consumers.append(consumer)
                consumer.dirty = True
                continue
            if (new, consumer.stream) in s.consumers:
                continue
            # The journal says it is owed at ``new`` now, not at ``old`` (else the audit
            # reads every pair left at ``old`` as still held for it): read before it moves.
            journal_moved(s, consumer.stream, old, new, owed(s, consumer) if s.events_on else [])
            self.remove_consumer(consumer)
            s.out.batch.delete_delivery(old, consumer.stream)
            consumer.peer = new
            for flight in consumer.inflight.values():
                flight.deadline = 0.0  # resent to the new address at once
            consumer.dirty = True
            self.add_consumer(consumer)
        s.tick_due = True
        s.new_peer_work = True
        log.info("moved what is owed to %s (%d subscriptions) to %s", old, len(topics), new)
        self.drop_if_unused(old)

    def remove_consumer(self, consumer: Consumer) -> None:
        s = self.s
        s.consumers.pop((consumer.peer, consumer.stream), None)
        s.by_stream[consumer.stream].remove(consumer)
        if not s.by_stream[consumer.stream]:
            del s.by_stream[consumer.stream]
        s.peers[consumer.peer].consumers.remove(consumer)
        self._update_stream_peers(consumer.stream)

    def _update_stream_peers(self, stream: str) -> None:
        if is_command_stream(stream):
            return
        s = self.s
        peers = dict(s.routes.stream_peers)
        consumers = s.by_stream.get(stream)
        if consumers:
            peers[stream] = tuple(c.peer for c in consumers)
        else:
            peers.pop(stream, None)
        s.routes = s.routes.with_peers(peers)

    # --- liveness ----------------------------------------------------------------------

    def send(self, peer: Peer, frames: list[bytes], count: int = 0) -> None:
        self.s.out.to_peers.append((peer.address, frames, count))

    def ping(self, peer: Peer, now: float) -> None:
        peer.last_ping = now
        self.send(peer, P.encode_ping(self.s.node_id, self.s.boot))

    def unreachable(self, address: str, now: float) -> None:
        """A send to ``address`` failed (not connected, or its queue is full): it is down;
        what was in flight is resent when it answers a ping again."""
        peer = self.s.peers.get(address)
        if peer is None:
            return
        if peer.up:
            log.info("peer %s is down (cannot send)", address)
            peer.down_since = now
        peer.up = False
        for consumer in peer.consumers:  # a group's other members take over at once
            if consumer.members is not None and len(consumer.members) > 1:
                for mid, to in consumer.assigned.items():
                    flight = consumer.inflight.get(mid)  # restored ones wait to be read
                    if to == address and flight is not None:
                        flight.deadline = 0.0
                self.s.tick_due = True

    def on_pong(self, peer: Peer, pong: P.Pong, now: float) -> bool:
        """Record a pong; True if the peer just came up or restarted (a new boot id)."""
        restarted = peer.boot is not None and peer.boot != pong.boot
        peer.last_pong = now
        peer.max_payload = pong.max_payload
        peer.codecs = pong.codecs
        peer.boot = pong.boot
        if peer.up and not restarted:
            return False
        peer.up = True
        log.info("peer %s is up%s", peer.address, " (restarted)" if restarted else "")
        return True

    def check(self, now: float) -> None:
        """Every tick: mark silent peers down, ping whoever is due."""
        cfg = self.s.config
        for peer in self.s.peers.values():
            if peer.up and peer.last_pong is not None and now - peer.last_pong > cfg.peer_timeout:
                log.info("peer %s is down (no answer for %.1fs)", peer.address, now - peer.last_pong)
                peer.up = False
                peer.down_since = now
            interval = cfg.heartbeat if peer.up else DOWN_PING
            if now - peer.last_ping >= interval:
                self.ping(peer, now)

    def ping_waiting(self, now: float) -> None:
        """Ping down peers that have messages waiting often, so that the first messages to
        a new subscriber, or to one that restarted, are not held for a whole ping period."""
        waiting = False
        for peer in self.s.peers.values():
            if peer.up or not any(not c.exhausted or c.inflight for c in peer.consumers):
                continue
            if now - peer.down_since > WAITING_FAST:
                continue  # down a while: the DOWN_PING timer is enough, no busy pinging
            waiting = True
            if now - peer.last_ping >= WAITING_PING:
                self.ping(peer, now)
        self.s.waiting_peers = waiting

    def forget_idle(self, now: float) -> None:
        """Bound per-address state: an address nothing is owed to, either way, for
        ``peer_expiry`` loses its connection, consumers and delivery records. Subscribers
        and publishers we have a subscription or intent with are never idle."""
        s = self.s
        publishers = {intent.publisher for intent in s.intents.values()}
        for address, peer in list(s.peers.items()):
            idle = address not in publishers and all(
                is_command_stream(c.stream) and c.idle for c in peer.consumers)
            if not idle:
                peer.idle_since = None
                continue
            if peer.idle_since is None:
                peer.idle_since = now
                continue
            if now - peer.idle_since < s.config.peer_expiry:
                continue
            if any(s.store.stream_ids(c.stream, limit=1) for c in peer.consumers):
                continue  # acknowledged messages not collected yet: next time
            for consumer in list(peer.consumers):
                self.remove_consumer(consumer)
                s.out.batch.delete_delivery(consumer.peer, consumer.stream)
            del s.peers[address]
            s.outbox.pop(peer, None)
            s.links.forget(address)
            s.counters["peers_forgotten"] += 1
            log.info("forgot peer %s: nothing owed either way for %.0fs", address, now - peer.idle_since)
