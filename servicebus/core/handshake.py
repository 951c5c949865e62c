"""Both sides of the subscribe handshake.

Subscriber side: ``subscribe()`` stores an intent (fsynced) and sends SUBSCRIBE (or
UNSUBSCRIBE) every INTENT_RETRY until the publisher acks the intent's id; the ack
confirms it durably. Publisher side: a SUBSCRIBE stores the subscription and a consumer
starting at the end of the stream, then acks after the fsync; both sides are idempotent
(a repeated SUBSCRIBE is acked again and changes nothing).
"""

from __future__ import annotations

import logging
from typing import Any

from ..wire import protocol as P
from ..model.delivery import Consumer, base_stream, event_stream, group_peer, stream_target
from ..errors import SubscribeRefused
from ..model.stored import IntentRecord, SubscriptionRecord, subscription_options
from ..wire.topics import is_pattern
from .commands import SubscribeCmd
from .owed import owed
from .peers import PeerLimit, Roster
from .starts import Begin, plan
from .state import Intent, State

__all__ = ["Handshake", "INTENT_RETRY"]

log = logging.getLogger("servicebus")

INTENT_RETRY = 1.0
# A SUBSCRIBE naming an address that is not up yet is stored only once that address answers
# a ping: until then it costs a connection and this entry, nothing durable, no messages.
# Such addresses waiting at once, at most: named over one connection, and in all (a share
# of max_peers, so that a flood cannot take every connection a real subscriber needs).
UNVERIFIED_PER_CONNECTION = 16
PROBATION = 30.0  # seconds an address gets to answer before the connection is dropped


class _Unverified:
    __slots__ = ("source", "conn", "since", "frames")

    def __init__(self, source: str | None, conn: bytes, since: float) -> None:
        self.source = source
        self.conn = conn  # the ROUTER identity of the connection that named it
        self.since = since
        self.frames: dict[str, tuple[bytes, P.Subscribe]] = {}  # topic -> latest (ident, frame)


class Handshake:
    def __init__(self, state: State, roster: Roster) -> None:
        self.s = state
        self.roster = roster
        self.unverified: dict[str, _Unverified] = {}  # address -> SUBSCRIBEs waiting on its pong
        self.kicked: Any = None  # node id -> why it was kicked, or None (core/members.py)
        self._refused_logged: set[str] = set()

    # --- subscriber side ---------------------------------------------------------------

    def load_intent(self, publisher: str, topic: str, record: IntentRecord) -> None:
        if record["op"] == "subscribe" and publisher in self.s.own:
            log.warning("dropping the subscribe intent for %s at %s: that is this bus's own address "
                        "(a bus never subscribes itself; an older version stored it)", topic, publisher)
            self.s.out.batch.delete_intent(publisher, topic)
            return
        intent = Intent(publisher, topic, record["op"], record["id"], record["confirmed"],
                        group=record.get("group"), ordered=bool(record.get("ordered")),
                        limit=record.get("limit"), start=record.get("start"), via=record.get("via"))
        try:
            self.roster.peer(publisher)
        except ValueError as exc:
            log.error("subscribe intent for %s at %s kept but not sent: %s", topic, publisher, exc)
            return
        self.s.intents[(publisher, topic)] = intent
        self.s.intent_ids[intent.id] = intent

    def subscribe(self, cmd: SubscribeCmd, via: str | None = None) -> None:
        """An intent to the address ``cmd.publisher`` (asked of the service ``via`` by
        name, core/members.py: then nobody waits on ``cmd.future``)."""
        s = self.s
        if cmd.op == "subscribe" and cmd.publisher in s.own:
            raise ValueError(f"cannot subscribe to {cmd.publisher}: that is this bus itself (a bus "
                             "never subscribes itself: it would store every event it publishes a "
                             "second time, as received)")
        self.roster.peer(cmd.publisher)  # ValueError to the caller, before anything is stored
        key = (cmd.publisher, cmd.topic)
        old = s.intents.get(key)
        if old is not None:
            s.intent_ids.pop(old.id, None)
        intent = Intent(cmd.publisher, cmd.topic, cmd.op, s.ids.next(), False,
                        group=cmd.group, ordered=cmd.ordered, limit=cmd.limit, start=cmd.start,
                        via=via if via is not None else (old.via if old is not None else None))
        if old is not None and old.op == cmd.op and \
                (old.group, old.ordered, old.limit) == (cmd.group, cmd.ordered, cmd.limit):
            intent.waiters = old.waiters
        if cmd.confirmed is not None:
            intent.waiters.append(cmd.confirmed)
        s.intents[key] = intent
        s.intent_ids[intent.id] = intent
        s.out.batch.put_intent(cmd.publisher, cmd.topic, intent.record(s.wall()))
        s.out.batch.sync = True
        if cmd.future is not None:
            s.out.release.append((cmd.future, intent.id))
        s.tick_due = True

    def on_ack(self, mid: str) -> bool:
        """Confirm the intent ``mid`` names; False if it names none."""
        intent = self.s.intent_ids.pop(mid, None)
        if intent is None:
            return False
        s = self.s
        key = (intent.publisher, intent.topic)
        if intent.op == "subscribe":
            intent.confirmed = True
            s.out.batch.put_intent(intent.publisher, intent.topic, intent.record(s.wall()))
            log.info("subscription to %s at %s confirmed", intent.topic, intent.publisher)
        else:
            if s.intents.get(key) is intent:
                del s.intents[key]
            s.out.batch.delete_intent(intent.publisher, intent.topic)
            log.info("unsubscribe from %s at %s confirmed", intent.topic, intent.publisher)
        waiters, intent.waiters = intent.waiters, []
        s.out.release.extend((fut, True) for fut in waiters)
        return True

    def on_refused(self, nack: P.Nack) -> tuple[str, ...]:
        """The publisher refused a subscribe or unsubscribe of ours (its address policy,
        its peer limit): callers waiting on it get the reason; the intent stays stored and
        is retried (an operator may fix the policy), logged once. Returns the ids that
        are not intents (messages)."""
        rest = []
        for mid in nack.ids:
            intent = self.s.intent_ids.get(mid)
            if intent is None:
                rest.append(mid)
                continue
            if intent.id not in self._refused_logged:
                self._refused_logged.add(intent.id)
                log.error("%s to %s at %s refused by the publisher: %s (retried every %.0fs)",
                          intent.op, intent.topic, intent.publisher, nack.reason, INTENT_RETRY)
            error = SubscribeRefused(f"{intent.op} to {intent.topic!r} at {intent.publisher} refused "
                                     f"by the publisher: {nack.reason}; it stays stored and is "
                                     "retried until confirmed (unsubscribe to give it up)")
            waiters, intent.waiters = intent.waiters, []
            self.s.out.release.extend((fut, error) for fut in waiters)
        return tuple(rest)

    def peer_up(self, address: str) -> None:
        for intent in self.s.intents.values():
            if intent.publisher == address and not intent.confirmed:
                intent.next_try = 0.0
        pending = self.unverified.pop(address, None)
        if pending is not None:  # it answered: what it asked for is stored now
            for ident, frame in pending.frames.values():
                self._store_subscription(ident, frame)

    def expire_unverified(self, now: float) -> None:
        for address, pending in list(self.unverified.items()):
            if now - pending.since < PROBATION:
                continue
            del self.unverified[address]
            self.s.count_refused("unanswered", address, pending.source)
            self.roster.drop_if_unused(address)

    def retry(self, now: float) -> None:
        s = self.s
        for intent in s.intents.values():
            if intent.confirmed or now < intent.next_try:
                continue
            intent.next_try = now + INTENT_RETRY
            if intent.op == "subscribe":
                frames = P.encode_subscribe(intent.id, intent.topic, s.address, s.node_id,
                                            intent.group, intent.ordered, intent.limit, intent.start)
            else:
                frames = P.encode_unsubscribe(intent.id, intent.topic, s.address, s.node_id)
            self.roster.send(s.peers[intent.publisher], frames)

    # --- publisher side ----------------------------------------------------------------

    def _refuse(self, ident: bytes, frame: P.Subscribe | P.Unsubscribe, reason: str,
                source: str | None) -> None:
        s = self.s
        s.count_refused(reason, frame.address, source)
        why = f"{reason} (that is this bus itself)" if reason == "own_address" else reason
        s.out.to_router.append((ident, P.encode_nack([frame.id], f"address {frame.address[:200]!r} "
                                                                 f"refused: {why}")))

    def found_self(self, address: str) -> None:
        """``address`` answered a ping with this very bus's node id and boot: an alias of
        its own address (a host name, an interface address, an ipc path through a
        symlink). Subscribes naming it that waited on the pong are refused, subscriptions
        stored for it ended, this bus's subscribe intents to it given up; the connection
        stays only if something else uses it (commands a user sends to itself)."""
        s = self.s
        s.own.learn(address)
        pending = self.unverified.pop(address, None)
        refused = 0
        if pending is not None:
            for ident, frame in pending.frames.values():
                self._refuse(ident, frame, "own_address", pending.source)
                refused += 1
        ended = [key for key in s.subscriptions if key[0] == address]
        for subscriber, topic in ended:
            self.end(subscriber, topic, "own_address")
        given_up = [(k, i) for k, i in s.intents.items() if k[0] == address and i.op == "subscribe"]
        for key, intent in given_up:
            del s.intents[key]
            s.intent_ids.pop(intent.id, None)
            s.out.batch.delete_intent(*key)
            error = SubscribeRefused(f"subscribe to {intent.topic!r} at {address} given up: that "
                                     "is this bus itself (a bus never subscribes itself)")
            waiters, intent.waiters = intent.waiters, []
            s.out.release.extend((fut, error) for fut in waiters)
        # Commands a user sends itself through an alias are fine: said quietly then.
        log.log(logging.WARNING if refused or ended or given_up else logging.INFO,
                "%s is this bus's own address (it answered a ping as this bus): %d subscribes "
                "naming it refused, %d subscriptions to it ended, %d subscribe intents to it given up",
                address[:200], refused, len(ended), len(given_up))
        self.roster.drop_if_unused(address)

    def on_subscribe(self, ident: bytes, frame: P.Subscribe, source: str | None = None,
                     user: str | None = None) -> None:
        s = self.s
        if frame.address in s.own:  # it would store its own events a second time, for good
            self._refuse(ident, frame, "own_address", source)
            return
        key = (frame.address, frame.topic)
        existing = s.subscriptions.get(key)
        if existing is not None:
            if (existing.get("group"), bool(existing.get("ordered")), existing.get("limit")) != \
                    (frame.group, frame.ordered, frame.limit):
                s.counters["refused_options_changed"] += 1
                s.out.to_router.append((ident, P.encode_nack([frame.id], (
                    f"{frame.address[:200]} is subscribed to {frame.topic!r} with other options "
                    f"(group {existing.get('group')!r}, ordered {bool(existing.get('ordered'))}, "
                    f"limit {existing.get('limit')}); unsubscribe first"))))
                return
            s.out.batch.sync = True  # a repeat: acked again, changes nothing
            s.out.acks.setdefault(ident, []).append(frame.id)
            return
        reason = s.address_refused(frame.address, source, user)
        entry = s.entry_of(user)
        if reason is None and entry is not None and not entry.may_subscribe(frame.topic):
            reason = "topic_not_allowed"
        if reason is None and s.channels and not s.channels.may_read(s.service_of(frame.sender, user), frame.topic):
            reason = "not_a_reader"  # channel roles (model/members.py)
        if reason is None and self.kicked is not None and self.kicked(frame.sender, frame.address):
            reason = "kicked"
        if reason is not None:
            self._refuse(ident, frame, reason, source)
            return
        peer = s.peers.get(frame.address)
        if peer is not None and peer.up:
            self._store_subscription(ident, frame)
            return
        pending = self.unverified.get(frame.address)
        if pending is None:
            if len(self.unverified) >= max(UNVERIFIED_PER_CONNECTION, s.config.max_peers // 2) or \
                    sum(1 for p in self.unverified.values() if p.conn == ident) >= UNVERIFIED_PER_CONNECTION:
                self._refuse(ident, frame, "too_many_unanswered", source)
                return
            try:
                peer = self.roster.peer(frame.address)
            except PeerLimit:
                self._refuse(ident, frame, "too_many_peers", source)
                return
            except ValueError as exc:
                s.count_malformed("bad_address", str(exc))
                return
            pending = self.unverified[frame.address] = _Unverified(source, ident, s.now)
            self.roster.ping(peer, s.now)
        pending.frames[frame.topic] = (ident, frame)

    def _store_subscription(self, ident: bytes, frame: P.Subscribe, exclusive: bool = False) -> None:
        s = self.s
        key = (frame.address, frame.topic)
        if key not in s.subscriptions:
            # A start (model/retention.py) counts only here, where the subscription is made:
            # the subscriber's repeats of its subscribe change nothing, so it replays once.
            start = frame.start
            if start is not None and is_pattern(frame.topic) and not exclusive:
                s.backfills.append((ident, frame))  # made under the publishers' lock (starts.py)
                return
            begins = None if start is None else plan(s, frame.topic, start)
            stream = event_stream(frame.topic)
            since = s.ids.next() if begins is None else begins[stream].floor
            record: SubscriptionRecord = {"since": since, "created": s.wall(), "node": frame.sender}
            record.update(subscription_options(frame.group, frame.ordered, frame.limit))  # type: ignore[typeddict-item]
            if begins is not None and start is not None:
                record["start"] = start
            s.subscriptions[key] = record
            for level, begin in (begins or {stream: None}).items():  # type: ignore[dict-item]
                self._consumer(frame, level, since if begin is None else begin.floor, begin)
            s.out.batch.put_subscription(frame.address, frame.topic, record)
            log.info("%s subscribed to %s%s%s", frame.address, frame.topic,
                     f" in group {frame.group}" if frame.group else "", f" from {start}" if begins else "")
        s.out.batch.sync = True
        s.out.acks.setdefault(ident, []).append(frame.id)

    def _consumer(self, frame: P.Subscribe, stream: str, floor: str, begin: Begin | None) -> None:
        """The new subscription's consumer of ``stream`` (its topic's, or a priority level's
        that holds what it starts from)."""
        s = self.s
        if frame.group is not None:
            members = s.consumers.get((group_peer(frame.group), stream))
            consumer = self.roster.join_group(frame.group, stream, frame.address, None, floor)
            if members is not None:
                return  # a group's cursor is shared: a start counts when the group is made
        else:
            consumer = Consumer(frame.address, stream, floor)
            consumer.dirty = True
            consumer.ordered = frame.ordered
            if stream == event_stream(frame.topic):
                consumer.left = frame.limit
            self.roster.add_consumer(consumer)
        if begin is None:
            consumer.exhausted = True  # it starts at the end of the stream
            return
        consumer.exhausted = False  # it reads what is stored after its floor
        consumer.skip |= begin.skip
        consumer.backlog = begin.owed

    def backfill(self) -> None:
        """Make the pattern subscriptions with a start deferred to now (the engine holds the
        publishers' exclusive lock: nothing is half published)."""
        s = self.s
        pending, s.backfills = s.backfills, []
        for ident, frame in pending:
            self._store_subscription(ident, frame, exclusive=True)

    def on_unsubscribe(self, ident: bytes, frame: P.Unsubscribe, source: str | None = None,
                       user: str | None = None) -> None:
        s = self.s
        # Only the subscriber's own host (or key) may end its subscription, as it made it.
        reason = s.address_refused(frame.address, source, user)
        if reason is not None:
            self._refuse(ident, frame, reason, source)
            return
        pending = self.unverified.get(frame.address)
        if pending is not None:
            pending.frames.pop(frame.topic, None)
        self.end(frame.address, frame.topic, "unsubscribed")
        s.out.batch.sync = True
        s.out.acks.setdefault(ident, []).append(frame.id)

    def end_limited(self) -> None:
        """Subscriptions that were given their ``limit`` of messages (all acknowledged)
        end here, as an unsubscribe would end them."""
        s = self.s
        done = [c for c in s.consumers.values() if c.left is not None and c.left <= 0 and not c.inflight]
        for consumer in done:
            topic = stream_target(consumer.stream)
            self.end(consumer.peer, topic, "limit_reached")
            s.counters["subscriptions_completed"] += 1

    def end(self, address: str, topic: str, why: str) -> None:
        """End the subscription of ``address`` to ``topic``: what it was still owed is
        dropped (journaled as such), its records deleted in this turn's batch."""
        s = self.s
        key = (address, topic)
        record = s.subscriptions.pop(key, None)
        if record is not None and record.get("group"):
            self._leave_group(record["group"], address, topic)
        elif record is not None:
            base = event_stream(topic)
            for stream in self._levels(base):
                consumer = s.consumers.get((address, stream))
                if consumer is not None:
                    if s.events_on:
                        self._journal_dropped(consumer, topic, why)
                    self.roster.remove_consumer(consumer)
                s.out.batch.delete_delivery(address, stream)
                s.gc_floor.pop(stream, None)
            s.out.batch.delete_subscription(address, topic)
            s.orphans_due = True
            log.info("%s %s %s", address, "unsubscribed from" if why == "unsubscribed" else
                     f"ended its subscription ({why}) to", topic)

    def _leave_group(self, group: str, address: str, topic: str) -> None:
        """A member leaves: what was in flight to it goes to the others (``Roster``); the
        last one out ends the group, and its messages are owed to no one."""
        s = self.s
        s.out.batch.delete_subscription(address, topic)
        log.info("%s left group %s on %s", address, group, topic)
        for stream in self._levels(event_stream(topic)):
            consumer = self.roster.leave_group(group, stream, address)
            if consumer is None:
                continue
            if s.events_on:
                ts = s.wall()
                for mid, member in consumer.assigned.items():
                    flight = consumer.inflight.get(mid)
                    s.event("dropped_at_sender", ts, mid, topic, "event", member, 0, "unsubscribed",
                            None if flight is None else flight.ids)
            s.out.batch.delete_delivery(consumer.peer, consumer.stream)
            s.gc_floor.pop(consumer.stream, None)
            s.orphans_due = True

    def _levels(self, stream: str) -> list[str]:
        """An event stream and its priority streams that have consumers."""
        return [stream, *(st for st in list(self.s.by_stream) if st != stream and base_stream(st) == stream)]

    def _journal_dropped(self, consumer: Consumer, topic: str, why: str) -> None:
        """Journal every message ``consumer`` was still owed as dropped (the audit must not
        take them for lost): those in flight and those stored after its cursor."""
        s = self.s
        ts, peer = s.wall(), consumer.peer
        for key, _record, ids in owed(s, consumer):
            s.event("dropped_at_sender", ts, key, topic, "event", peer, 0, why, ids or None)
