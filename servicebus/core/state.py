"""The delivery core's state and the effects one turn produces.

``State`` is everything the core remembers between turns (peers, consumers,
subscriptions, intents); ``Effects`` is what one turn asks the shell to do: the batch to
write and whether it needs an fsync, journal events riding in it, callers to release,
received messages to hand to handlers, acks and frames to send. The shell takes the
effects in the order of DESIGN.md section 9 and starts the next turn with empty ones.
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..model.clock import BusClock
from ..model.config import BusConfig
from ..model.delivery import Consumer
from ..model.ids import IdGenerator
from ..wire.protocol import Envelope
from ..model.routes import NO_ROUTES, Routes
from ..model.records import PeerStatus
from ..model.stored import Event, Incoming, IncomingRecord, IntentRecord, SubscriptionRecord, event, subscription_options
from ..wire.policy import AddressPolicy, OwnAddress
from ..wire.trust import Keys, PeerEntry
from .ports import EventSwitch, Links, StoreView, WriteBatch

log = logging.getLogger("servicebus")

__all__ = ["Peer", "Intent", "Incoming", "incoming_record", "Effects", "State", "snapshot"]



@dataclass(eq=False)
class Peer:
    """A bus we send to (through a connection the shell owns), and whether it answers."""

    address: str
    up: bool = False
    boot: str | None = None
    last_pong: float | None = None
    last_ping: float = 0.0
    consumers: list[Consumer] = field(default_factory=list)
    down_since: float = 0.0
    max_payload: int | None = None  # the largest payload it accepts, as its pongs say
    codecs: tuple[str, ...] = ()  # the compression codecs it decodes, as its pongs say
    idle_since: float | None = None  # since when nothing is owed to or by it (peer_expiry)


@dataclass(eq=False)
class Intent:
    """A subscribe or unsubscribe this bus asked of a publisher, until confirmed."""

    publisher: str
    topic: str
    op: str  # "subscribe" | "unsubscribe"
    id: str
    confirmed: bool
    next_try: float = 0.0
    waiters: list[Any] = field(default_factory=list)  # callers released when confirmed
    group: str | None = None
    ordered: bool = False
    limit: int | None = None
    start: str | None = None  # where a new subscription begins (model/retention.py)
    via: str | None = None  # the service it was asked of, by name (core/members.py)

    def record(self, wall: int) -> IntentRecord:
        record: IntentRecord = {"op": self.op, "id": self.id, "confirmed": self.confirmed, "updated": wall}
        record.update(subscription_options(self.group, self.ordered, self.limit))  # type: ignore[typeddict-item]
        if self.start is not None:
            record["start"] = self.start
        if self.via is not None:
            record["via"] = self.via
        return record


_tuple = tuple.__new__  # a NamedTuple without its keyword-parsing __new__: runs per message


def incoming_record(kind: int, sender: str, reply_to: str, env: Envelope) -> IncomingRecord:
    """The ``n/<key>`` record of a segment as received."""
    return _tuple(IncomingRecord, (kind, env.topic, sender, reply_to, env.sent, env.attempt,
                                   env.expires, env.correlation_id, env.headers,
                                   list(env.ids) or [env.id], env.body))


@dataclass(eq=False)
class Effects:
    """What one turn asks of the shell. ``batch`` always exists: a write made after a
    commit (a sender-side dead letter, a pruned id) belongs to the next turn's batch."""

    batch: WriteBatch
    events: list[Event] = field(default_factory=list)  # for the hooks, riding in batch
    release: list[tuple[Any, Any]] = field(default_factory=list)  # (caller, value) once written
    handoff: list[Incoming] = field(default_factory=list)  # to the handlers once written
    acks: dict[bytes, list[str]] = field(default_factory=dict)  # router identity -> ids, once written
    to_router: list[tuple[bytes, list[bytes]]] = field(default_factory=list)  # at once (pongs, nacks)
    to_peers: list[tuple[str, list[bytes], int]] = field(default_factory=list)  # (address, frames, messages)


@dataclass(eq=False)
class State:
    """Everything the core remembers between turns. One instance, shared by its parts."""

    config: BusConfig
    store: StoreView
    links: Links
    address: str
    node_id: str
    boot: str
    ids: IdGenerator
    clock: BusClock  # the bus clock: dedupe windows (clock.py)
    wall: Callable[[], int]  # wall-clock ms: timestamps, TTLs
    switch: EventSwitch  # whether any hook wants events (``events_on``)
    out: Effects
    policy: AddressPolicy  # which addresses off the wire may be connected to (policy.py)
    trust: Keys | None = None  # with CURVE keys: the peers' keys, addresses and rights (trust.py)
    # This bus's own address and its aliases: never a subscriber of its own (policy.py).
    own: OwnAddress = field(default_factory=lambda: OwnAddress(()))
    now: float = 0.0  # monotonic seconds, as of the event being handled
    peers: dict[str, Peer] = field(default_factory=dict)
    consumers: dict[tuple[str, str], Consumer] = field(default_factory=dict)
    by_stream: defaultdict[str, list[Consumer]] = field(default_factory=lambda: defaultdict(list))
    subscriptions: dict[tuple[str, str], SubscriptionRecord] = field(default_factory=dict)
    intents: dict[tuple[str, str], Intent] = field(default_factory=dict)
    intent_ids: dict[str, Intent] = field(default_factory=dict)
    # Who a publish goes to (event streams with consumers, those at max_backlog): replaced,
    # never mutated; the engine hands each new one to the publishing threads (routes.py).
    routes: Routes = NO_ROUTES
    # Segments written this turn, per stream: (key, packed record, messages in it).
    new: dict[str, list[tuple[str, bytes, int]]] = field(default_factory=dict)
    # peer -> (kind, or (kind, stream) for an ordered consumer's frame, envelope)
    outbox: dict[Peer, list[tuple[Any, Envelope]]] = field(default_factory=dict)
    # Frames of group messages just given to a member: sent only once the batch recording
    # that assignment is fsynced (next turn), as the outbox after the commit (sender.py).
    parked: dict[Peer, list[tuple[Any, Envelope]]] = field(default_factory=dict)
    turn_ids: set[str] = field(default_factory=set)  # received this turn (not in the store yet)
    gc_floor: dict[str, str | None] = field(default_factory=dict)
    # Retained streams (model/retention.py): their stored bytes, counted once at the first
    # sweep and kept up to date as events are published and deleted; when to sweep next.
    retained_bytes: dict[str, int] = field(default_factory=dict)
    # Pattern subscriptions with a start, made by the engine under the publishers' lock
    # (core/starts.py): (router identity, SUBSCRIBE frame).
    backfills: list[tuple[bytes, Any]] = field(default_factory=list)
    next_retain: float = 0.0
    # Outbox keys (handlers' commands) moved into streams by the batch being built.
    outbox_moving: set[str] = field(default_factory=set)
    # Event streams that got messages with a TTL since this start: checked for expiry while
    # a subscriber is down, as command streams always are (expiry.py).
    ttl_streams: set[str] = field(default_factory=set)
    orphans_due: bool = True
    tick_due: bool = True  # run the timers at the next turn, whatever the time
    filling_since: float | None = None  # first window fill since the (re)load (sender.py)
    new_peer_work: bool = True  # a down peer may have got messages waiting: ping it soon
    waiting_peers: bool = False  # some down peer has messages waiting
    full_changed: bool = False  # routes.full changed: publishers waiting for room look again
    # Delayed messages are held until the id clock passes their id's time (not_due).
    # Timers: (due ms, stream), a heap.
    timers: list[tuple[int, str]] = field(default_factory=list)
    # Discovery (core/members.py): node id -> service name; addresses an instance gave
    # first hand -> (the host it came from, its key): allowed as if in allow_peers.
    services: dict[str, str] = field(default_factory=dict)
    vouched: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)
    channels: Any = None  # channel roles (model/members.py Channels), empty when none
    pick: Callable[[str], str] | None = None  # a service name -> one instance's address
    hint: Callable[[str], None] = lambda address: None  # an unknown sender: ask who it is
    counters: Counter[str] = field(default_factory=Counter)
    malformed: Counter[str] = field(default_factory=Counter)
    totals: Counter[str] = field(default_factory=Counter)  # per kind of trouble, for tally

    @property
    def events_on(self) -> bool:
        """Whether to make events: a hook wants them (the journal, when on)."""
        return self.switch.wanted

    def up(self, consumer: Consumer) -> bool:
        """Whether the consumer's subscriber (in a group: any member) is up."""
        if consumer.members is None:
            return self.peers[consumer.peer].up
        return any(self.peers[m].up for m in consumer.members)

    def not_due(self, message_id: str) -> bool:
        """A delayed message's id (ids.py) whose time has not come on the id clock (the
        clock its id was made on, which a wall clock set back does not move)."""
        return message_id > f"{self.ids.now_ms() + 1:012x}"

    def wake(self, due_ms: int, stream: str) -> None:
        """Have the consumers of ``stream`` read it again at ``due_ms`` (a delayed message)."""
        if (due_ms, stream) not in self.timers:
            heapq.heappush(self.timers, (due_ms, stream))

    def tally(self, counter: Counter[str], name: str, group: str) -> int | None:
        """Count one ``name`` in ``counter``; the ``group``'s total when it is worth a log
        line (the 1st, 2nd, 4th, 8th ...: readable under a flood), else None."""
        counter[name] += 1
        self.totals[group] += 1
        total = self.totals[group]
        return total if total & (total - 1) == 0 else None

    def count_malformed(self, reason: str, error: str) -> None:
        total = self.tally(self.malformed, reason, "malformed")
        if total is not None:
            log.warning("dropped a malformed frame (%s); %d so far", error, total)

    def address_refused(self, address: str, source: str | None, user: str | None) -> str | None:
        """Why the bus must not connect to ``address`` named by a frame from ``source``
        (and, with CURVE, the client key ``user``), or None. With keys a peer may name only
        the address its entry in peers.toml gives: stronger than its source host."""
        vouched = self.vouched.get(address)
        if self.trust is not None:
            entry = self.trust.peer_of(user)
            if entry is None:
                return "unknown_key"
            if vouched is not None and vouched[1] == user:
                return None  # the instance with this key gave this address itself
            return None if address == entry.address else "not_its_own_address"
        reason = self.policy.refuse(address, source)
        if reason is not None and vouched is not None and vouched[0] in (None, source):
            # An instance told us this address itself, from that host, or answered there
            # on our own connection (a host name: ZeroMQ resolved it, we did not).
            return None
        return reason

    def target(self, address: str) -> str:
        """The address a command to ``address`` goes to: itself, or for a service name
        one instance of it (core/members.py; ``ValueError`` if none is known)."""
        if "://" in address:
            return address
        if self.pick is None:
            raise ValueError(f"{address!r} is no address")
        return self.pick(address)

    def service_of(self, node: str, user: str | None) -> str | None:
        """The service of the bus ``node`` as discovery knows it (with CURVE, only if the
        key ``user`` is the one peers.toml allows that name)."""
        name = self.services.get(node)
        if name is not None and self.trust is not None:
            entry = self.trust.peer_of(user)
            if entry is None or not entry.may_name(name):
                return None
        return name

    def entry_of(self, user: str | None) -> PeerEntry | None:
        return None if self.trust is None else self.trust.peer_of(user)

    def count_refused(self, reason: str, address: str, source: str | None) -> None:
        """An address off the wire the bus will not connect to (policy.py, peer caps)."""
        total = self.tally(self.counters, f"refused_{reason}", "refused")
        if total is not None:
            log.warning("refused to connect to %r named by a frame from %s (%s); %d refused so far",
                        address[:200], source or "?", reason, total)

    def event(self, name: str, ts: int, mid: str, topic: str | None, kind: str,
              peer: str | None, attempt: int = 0, error: str | None = None,
              ids: tuple[str, ...] | list[str] | None = None) -> None:
        self.out.events.append(event(name, ts, mid, topic, kind, peer, attempt, error, ids))


def snapshot(s: State, now: float) -> dict[str, Any]:
    """What ``Core.snapshot`` tells ``status()`` and the admin endpoint."""
    peers = tuple(
        PeerStatus(p.address, p.up, sum(
            len(c.inflight) if c.members is None else c.load.get(p.address, 0)
            for c in p.consumers), None if p.last_pong is None else now - p.last_pong)
        for p in s.peers.values()
    )
    # (peer, stream, floor, keys past the floor that are done: acked in the window or
    # settled ahead of it) for status(), which counts the messages owed from the store.
    consumers = [(c.peer, c.stream, c.floor,
                  frozenset(k for k in c.order if k not in c.inflight) | frozenset(c.skip))
                 for c in s.consumers.values()]
    return {
        "peers": peers,
        "consumers": consumers,
        "malformed": dict(s.malformed),
        "counters": dict(s.counters),
        "intents_unconfirmed": sum(1 for i in s.intents.values() if not i.confirmed),
        "retention": (s.config.retention or {}, s.config.retention_bytes),
        "backlog_full": tuple(sorted((c.peer, c.stream[2:]) for c in s.consumers.values()
                                     if c.stream in s.routes.full
                                     and c.backlog >= (s.config.max_backlog or 0))),
    }
