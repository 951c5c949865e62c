"""The delivery core: the whole state machine of one bus, with no I/O of its own.

The shell (``engine.py`` in a running bus, ``testing.CoreNode`` in tests) feeds it events
and carries out its effects, in the turn order of DESIGN.md section 9::

    core.on_router(ident, frame) / core.on_dealer(address, frame) / core.command(cmd)
    out = core.prepare(now)          # garbage collection, cursors: the batch is complete
    ... write out.batch (fsync if out.batch.sync) ...
    done = core.committed(new_batch) # or core.abandon() if the write failed
    ... release done.release, hand done.handoff to handlers, send done.acks ...
    core.advance(now)                # new messages, backlog, timers, resends, pings
    ... send core.take_frames(), telling core.unreachable(address) of failed sends ...

Time comes in as ``now`` (monotonic seconds) on every call; wall-clock milliseconds (for
TTLs and timestamps) and the bus clock (for dedupe windows) from the callables it is
given, so a test drives all three.
"""

from __future__ import annotations

import heapq
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from ..wire import protocol as P
from ..wire.compression import codecs
from ..model.retention import Retention
from ..model.routes import Routes
from ..model.clock import BusClock, wall_ms
from ..model.config import BusConfig
from ..model.delivery import (Consumer, base_stream, event_stream, group_peer, is_command_stream,
                        is_priority_stream, stream_target)
from ..model.ids import IdGenerator
from ..wire.policy import AddressPolicy, OwnAddress
from ..wire.trust import Keys
from . import owner
from .commands import Published, QueueReply, QueueSend, SendCmd, SubscribeCmd, Supersede
from .backlog import Backlog
from .expiry import Expiry
from .handshake import Handshake
from .peers import WAITING_PING, Roster
from .ports import NO_EVENTS, EventSwitch, Links, StoreView, WriteBatch
from .receiver import Receiver
from .sender import Sender
from .state import Effects, State, snapshot
from .members import Directory
from ..model.members import SERVICE
from .streams import Streams

__all__ = ["Core", "TICK"]

log = logging.getLogger("servicebus")

TICK = 0.1  # seconds between timer checks when idle
GC_INTERVAL = 0.5
PRUNE_INTERVAL = 1.0  # handled ids past the dedupe window are deleted this often
CLOCK_SAVE = 5.0  # the bus clock is carried to the store this often (clock.py)
EXPIRY_INTERVAL = 1.0  # TTLs of messages waiting for a peer that is down, idle peers: checked this often


class Core:
    owner: int | None = None  # the thread that alone may touch it, once bound (owner.py)

    def __new__(cls, *args: Any, **kwargs: Any) -> "Core":
        if cls is Core and owner.checking():
            cls = _CheckedCore  # every call checks the thread (the test suite's debug mode)
        return object.__new__(cls)

    def bind_owner(self) -> None:
        """From now on only the calling thread (the engine's) may touch this core."""
        self.owner = threading.get_ident()

    def __init__(self, *, config: BusConfig, store: StoreView, links: Links, batch: WriteBatch,
                 address: str, node_id: str, boot: str, ids: IdGenerator, clock: BusClock,
                 wall: Callable[[], int] = wall_ms, events: EventSwitch = NO_EVENTS,
                 now: float = 0.0, uid: int = 0, trust: Keys | None = None,
                 aliases: Iterable[str] = ()) -> None:
        # ``aliases``: other spellings of this bus's address it knows (the endpoint it
        # bound, when it advertises another): never taken as a subscriber's.
        self.s = s = State(config=config, store=store, links=links, address=address,
                           node_id=node_id, boot=boot, ids=ids, clock=clock, wall=wall,
                           switch=events, out=Effects(batch), now=now,
                           policy=AddressPolicy(config.allow_peers, uid), trust=trust,
                           own=OwnAddress((address, *aliases)))
        s.routes = Routes(retention=Retention(config.retention, config.retention_bytes))
        self.roster = Roster(s)
        self.expiry = Expiry(s)
        self.sender = Sender(s, self.expiry)
        self.backlog = Backlog(s, self.expiry)
        self.streams = Streams(s, self.roster, self.backlog)
        self.handshake = Handshake(s, self.roster)
        self.receiver = Receiver(s)
        s.channels = config.channels
        self.members = Directory(s, self.roster, self.handshake, ids.epoch)
        self.handshake.kicked = self.members.is_kicked
        s.pick, s.hint, s.instances = self.members.pick, self.members.hint, self.members.addresses
        self.members.found = self._found
        self._next_tick = self._next_gc = self._next_expiry = 0.0
        self._next_prune = self._next_clock_save = 0.0
        self._codecs = codecs()  # what this bus decodes, told to every peer that pings it

    @property
    def out(self) -> Effects:
        return self.s.out

    # --- startup -----------------------------------------------------------------------

    def load(self) -> list[QueueReply | QueueSend]:
        """Read subscriptions, cursors and intents from the store; return the replies and
        the handlers' commands a crash left stored and not yet queued, for the shell to queue."""
        s = self.s
        for subscriber, topic, record in s.store.subscriptions():
            s.subscriptions[(subscriber, topic)] = record
        states = {(peer, stream): rec for peer, stream, rec in s.store.deliveries()}
        for (subscriber, topic), record in s.subscriptions.items():
            stream = event_stream(topic)
            group = record.get("group")
            if group:
                try:
                    self.roster.join_group(group, stream, subscriber,
                                           states.pop((group_peer(group), stream), None), record["since"])
                except ValueError as exc:
                    log.error("not delivering to %s: %s", subscriber, exc)
                continue
            state = states.pop((subscriber, stream), None)
            if state is None:
                consumer = Consumer(subscriber, stream, record["since"])
            else:
                consumer = Consumer.from_record(subscriber, stream, state)
            consumer.ordered = bool(record.get("ordered"))
            if consumer.left is None and record.get("limit"):
                consumer.left = record["limit"]
            self._load_consumer(consumer)
        for (peer, stream), state in list(states.items()):
            base = s.consumers.get((peer, base_stream(stream))) if is_priority_stream(stream) else None
            if base is not None:  # a subscriber's (or group's) cursor on a priority level
                del states[(peer, stream)]
                if (peer, stream) not in s.consumers:
                    self.streams.mirror(base, stream, state)
        for stream in s.store.stream_names():
            if is_priority_stream(stream):  # a level whose cursors were not written yet
                self.streams.mirror_all(stream)
        for (peer, stream), state in list(states.items()):
            if is_command_stream(stream):
                self._load_consumer(Consumer.from_record(peer, stream, state))
                del states[(peer, stream)]
        for stream in s.store.stream_names():
            # Commands whose delivery state is missing (an edited or repaired store) are
            # still owed to their address: deliver them rather than leave them stranded.
            if is_command_stream(stream) and (stream_target(stream), stream) not in s.consumers:
                self._load_consumer(Consumer(stream_target(stream), stream, ""))
        for peer, stream in states:
            log.warning("dropping delivery state of %s on %s: no subscription", peer, stream)
            s.out.batch.delete_delivery(peer, stream)
        self.members.load(s.store.meta("members"), s.wall())
        for publisher, topic, intent in s.store.intents():
            if publisher.startswith(SERVICE):
                self.members.load_intent(publisher[len(SERVICE):], topic, intent)
            else:
                self.handshake.load_intent(publisher, topic, intent)
        for subscriber, topic in [key for key in s.subscriptions if key[0] in s.own]:
            log.warning("ending the subscription of %s to %s: that is this bus's own address "
                        "(a bus never subscribes itself; an older version stored it)", subscriber, topic)
            self.handshake.end(subscriber, topic, "own_address")
            self.roster.drop_if_unused(subscriber)  # the connection its consumer made
        self.backlog.load()
        s.outbox_moving.clear()
        queued: list[QueueReply | QueueSend] = [QueueReply(cid, reply) for cid, reply in s.store.replies()]
        queued += [QueueSend(key, send) for key, send in s.store.outbox()]
        return queued

    def _load_consumer(self, consumer: Consumer) -> None:
        try:
            self.roster.add_consumer(consumer)
        except ValueError as exc:
            # Stored by an older version that let such an address in: its messages stay
            # in the store for an operator (servicebus purge --subscriber) to deal with.
            log.error("not delivering to %s: %s", consumer.peer, exc)

    def reload(self, batch: WriteBatch) -> list[QueueReply | QueueSend]:
        """Start over from the store, as at a start, after a write failed and the store
        was reopened. Connections and callers waiting on intents are kept. The caller holds
        publishing off meanwhile (the engine hands the publishers the rebuilt routes before
        they go on)."""
        s = self.s
        waiters = {key: intent for key, intent in s.intents.items() if intent.waiters}
        for peer in s.peers.values():
            peer.consumers = []
            peer.last_ping = 0.0
        s.consumers.clear()
        s.by_stream.clear()
        s.subscriptions.clear()
        s.intents.clear()
        s.intent_ids.clear()
        s.routes = s.routes.with_peers({})
        s.gc_floor.clear()
        s.parked.clear()
        s.filling_since = None
        s.orphans_due = True
        s.out = Effects(batch)
        replies = self.load()
        for key, old in waiters.items():
            intent = s.intents.get(key)
            if intent is not None and intent.op == old.op:
                intent.waiters.extend(old.waiters)
        s.new_peer_work = True
        s.tick_due = True
        return replies

    # --- events in -----------------------------------------------------------------------

    def on_router(self, ident: bytes, frame: P.Frame, now: float, source: str | None = None,
                  user: str | None = None) -> None:
        """A frame a peer sent to our ROUTER (messages, subscribes, pings). ``source``: where
        the connection comes from (ZeroMQ's Peer-Address); ``user``: with CURVE, the
        client's public key (its ZAP User-Id). Addresses the frame names are connected to
        only if allowed for them (``State.address_refused``)."""
        s = self.s
        s.now = now
        if isinstance(frame, P.Batch):
            self.receiver.on_batch(ident, frame, source, user)
        elif isinstance(frame, P.Ping):
            s.out.to_router.append((ident, P.encode_pong(s.node_id, s.boot, s.config.max_payload,
                                                         self._codecs)))
        elif isinstance(frame, P.Subscribe):
            self.handshake.on_subscribe(ident, frame, source, user)
        elif isinstance(frame, P.Unsubscribe):
            self.handshake.on_unsubscribe(ident, frame, source, user)
        elif isinstance(frame, P.Gossip):
            self.members.on_gossip(frame, now, source, user, ident=ident)
        else:
            s.malformed["unexpected_kind"] += 1

    def on_dealer(self, address: str, frame: P.Frame, now: float) -> None:
        """A frame the bus at ``address`` sent back on our connection to it (acks, pongs)."""
        s = self.s
        s.now = now
        peer = s.peers.get(address)
        if peer is None:
            return
        if isinstance(frame, P.Ack):
            ids = frame.ids
            if s.intent_ids:  # rare: only while a subscribe or unsubscribe waits
                ids = tuple(mid for mid in ids if not self.handshake.on_ack(mid))
            s.counters["acked"] += self.sender.on_acks(peer, ids, s.wall())
        elif isinstance(frame, P.Pong):
            if frame.sender == s.node_id and frame.boot == s.boot and address not in s.own.exact:
                self.handshake.found_self(address)  # an alias of our own address
                if s.peers.get(address) is not peer:
                    return  # nothing else used the connection: closed
            if self.roster.on_pong(peer, frame, now):
                self.sender.peer_up(peer)
                self.handshake.peer_up(address)
                self.members.peer_up(address, frame.sender)
                s.tick_due = True
        elif isinstance(frame, P.Gossip):
            self.members.on_gossip(frame, now, None, None, address=address)
        elif isinstance(frame, P.Nack):
            if s.intent_ids:  # rare: only while a subscribe or unsubscribe waits
                frame = frame._replace(ids=self.handshake.on_refused(frame))
            if frame.ids:
                self.sender.on_nack(peer, frame)
        else:
            s.malformed["unexpected_kind"] += 1

    def malformed(self, reason: str, error: str) -> None:
        """A frame that did not decode (the shell decodes)."""
        self.s.count_malformed(reason, error)

    def command(self, cmd: Published | SendCmd | QueueReply | QueueSend | SubscribeCmd | Supersede,
                now: float) -> None:
        """Work from a user thread. Raises (``ValueError`` for an address that cannot be
        connected) before it changes any state; the shell fails the caller with it."""
        self.s.now = now
        if isinstance(cmd, Published):
            self.streams.published(cmd)
        elif isinstance(cmd, SendCmd):
            self.streams.send(cmd)
        elif isinstance(cmd, QueueReply):
            self.streams.queue_reply(cmd)
        elif isinstance(cmd, QueueSend):
            self.streams.queue_send(cmd)
        elif isinstance(cmd, SubscribeCmd):
            if cmd.publisher.startswith(SERVICE):
                self.members.subscribe(cmd)
            else:
                self.handshake.subscribe(cmd)
        elif isinstance(cmd, Supersede):
            self.streams.supersede(cmd)
        else:
            raise TypeError(f"unknown core command {cmd!r}")

    def _found(self, service: str) -> None:
        for cmd in self.s.awaiting.pop(service, {}).values():  # waited for an instance of it
            self.streams.queue_send(cmd)

    def backfill(self) -> None:
        """Make the pattern subscriptions with a start waiting in ``s.backfills``: the caller
        holds the publishers' exclusive lock and swaps the routes before releasing it."""
        self.handshake.backfill()

    def unreachable(self, address: str, now: float) -> None:
        """A send to ``address`` failed: it is down until it answers a ping again."""
        self.roster.unreachable(address, now)

    # --- the turn ----------------------------------------------------------------------

    def prepare(self, now: float) -> Effects:
        """Complete this turn's batch (garbage collection, changed cursors) and return the
        effects that wait on it being written."""
        s = self.s
        s.now = now
        if now >= self._next_gc:
            self._next_gc = now + GC_INTERVAL
            self.streams.collect_garbage()
        batch = s.out.batch
        for consumer in s.consumers.values():
            if consumer.dirty:
                consumer.dirty = False
                batch.put_delivery(consumer.peer, consumer.stream, consumer.record())
        if s.parked:
            batch.sync = True  # their assignments are in it: sent once it is durable
        return s.out

    def committed(self, batch: WriteBatch) -> Effects:
        """The batch is written: return the effects to carry out now (release callers,
        hand off, ack); the next writes go into ``batch``."""
        s = self.s
        done = s.out
        s.out = Effects(batch, to_peers=done.to_peers, to_router=done.to_router)
        done.to_peers, done.to_router = [], []
        s.turn_ids.clear()
        s.outbox_moving.clear()  # written: the store no longer holds them
        if s.parked:  # their assignments are durable now: sent this turn, before newer frames
            parked, s.parked = s.parked, {}
            for peer, items in parked.items():
                s.outbox.setdefault(peer, [])[:0] = items
        return done

    def abandon(self) -> Effects:
        """The batch could not be written: nothing of this turn happened. Return its
        effects so that the shell fails the callers; no ack, no hand-off, nothing sent."""
        s = self.s
        done = s.out
        s.out = Effects(done.batch)
        s.turn_ids.clear()
        s.new.clear()
        s.outbox.clear()
        s.parked.clear()  # their assignments were not written: resent when due, maybe elsewhere
        s.outbox_moving.clear()  # not moved after all: a reload queues them again
        return done

    def advance(self, now: float) -> bool:
        """The send half of the turn: new messages into windows, backlog, and the timers
        when due. True if the timers ran."""
        s = self.s
        s.now = now
        if s.new:
            self.sender.deliver_new(now)
        self.sender.fill_windows(now)
        ticked = s.tick_due or now >= self._next_tick
        if ticked:
            s.tick_due = False
            self._next_tick = now + TICK
            self._timers(now)
        if s.waiting_peers or s.new_peer_work:
            s.new_peer_work = False
            self.roster.ping_waiting(now)
        if self.backlog.on:
            self.backlog.update()
        self.sender.flush()
        return ticked

    def take_frames(self) -> list[tuple[str, list[bytes], int]]:
        """(address, frames, messages in them) to send, in order. After a failed send to
        an address, skip the rest for it and call ``unreachable``."""
        frames, self.s.out.to_peers = self.s.out.to_peers, []
        return frames

    def take_router_frames(self) -> list[tuple[bytes, list[bytes]]]:
        """Frames for the ROUTER (pongs, nacks), sent at once, not after the commit."""
        frames, self.s.out.to_router = self.s.out.to_router, []
        return frames

    def _timers(self, now: float) -> None:
        s = self.s
        if s.timers:
            now_ms = s.ids.now_ms()  # delayed ids are made on the id clock (ids.py)
            while s.timers and s.timers[0][0] <= now_ms:
                _due, stream = heapq.heappop(s.timers)
                for consumer in s.by_stream.get(stream, ()):
                    consumer.exhausted = False  # a delayed message is due: read on
        self.roster.check(now)
        self.members.tick(now)
        self.handshake.retry(now)
        self.handshake.expire_unverified(now)
        self.sender.resend_due(now)
        self.handshake.end_limited()
        self.sender.check_down()
        if now >= self._next_expiry:
            self._next_expiry = now + EXPIRY_INTERVAL
            self.expiry.expire_waiting(now)
            self.roster.forget_idle(now)
        if now >= self._next_prune:
            # While ids are due faster than one batch a second, go on next turn.
            more = self.receiver.prune_handled() | self.receiver.prune_publish_keys()
            self._next_prune = now + (0.0 if more else PRUNE_INTERVAL)
        if now >= self._next_clock_save:
            self._next_clock_save = now + CLOCK_SAVE
            self.save_clock()

    def collect_soon(self) -> None:
        """The last turn before a close: collect garbage at the next ``prepare``, and tell
        the instances discovery knows that this one is leaving."""
        self._next_gc = 0.0
        self.members.leave()

    def save_clock(self) -> None:
        """Carry the bus clock to the store in this turn's batch (clock.py)."""
        self.s.out.batch.put_clock(self.s.clock)

    def poll_timeout(self, now: float) -> float:
        """How long the shell may wait for input before the core has something to do."""
        if self.s.tick_due or self.s.parked:  # parked frames go after the next commit
            return 0.0
        tick = WAITING_PING if self.s.waiting_peers else TICK
        return max(0.0, min(tick, self._next_tick - now))

    # --- what the shell asks -------------------------------------------------------------

    def idle(self) -> bool:
        """Nothing owed by this core: every window acked, every intent confirmed."""
        s = self.s
        if s.new or s.out.handoff:
            return False
        if any(not c.idle for c in s.consumers.values()):
            return False
        return all(i.confirmed for i in s.intents.values())

    def waiters(self) -> list[Any]:
        """Callers waiting for intents to be confirmed (the shell fails them at close)."""
        return [fut for intent in self.s.intents.values() for fut in intent.waiters]

    def snapshot(self, now: float) -> dict[str, Any]:
        return {**snapshot(self.s, now), "fleet": self.members.view(now) if self.members.on else []}

_CheckedCore = owner.checked_class(Core)
