"""What goes into the outgoing streams, and what comes out of them once acknowledged.

Events are stored once per topic stream (``e:<topic>``) however many subscribers it has;
commands and replies once per address stream (``c:<address>``). Messages every consumer of
a stream has acknowledged are deleted; streams nobody consumes any more are emptied.
"""

from __future__ import annotations


import logging

from ..model.delivery import (Consumer, base_stream, command_stream, event_stream, is_priority_stream, pack_outgoing,
                              stream_target)
from ..model.segments import make_blob
from ..model.stored import DeliveryRecord
from ..wire.protocol import Kind
from .commands import Published, QueueReply, QueueSend, SendCmd, Supersede
from .backlog import Backlog
from .peers import Roster
from .state import State

__all__ = ["Streams", "GC_BUDGET"]

log = logging.getLogger("servicebus")

GC_BUDGET = 5000  # stream messages deleted per collection, at most
SUPERSEDE_SKIPS = 10_000  # superseded messages marked done per consumer ahead of its cursor


class Streams:
    def __init__(self, state: State, roster: Roster, backlog: Backlog) -> None:
        self.s = state
        self.roster = roster
        self.backlog = backlog

    # --- in ----------------------------------------------------------------------------

    def published(self, cmd: Published) -> None:
        s = self.s
        if cmd.ttl:
            s.ttl_streams.add(cmd.stream)
        if is_priority_stream(cmd.stream):
            self.mirror_all(cmd.stream)
        if cmd.stream in s.retained_bytes:
            s.retained_bytes[cmd.stream] += sum(len(record) for _mid, record, _n in cmd.items)
        if cmd.stream in s.by_stream:
            s.new.setdefault(cmd.stream, []).extend(cmd.items)
            if self.backlog.on:
                for consumer in s.by_stream[cmd.stream]:
                    self.backlog.published(consumer, cmd.items)
        elif not self.retained_ms(cmd.stream):
            s.orphans_due = True  # unsubscribed while they were written

    def mirror_all(self, stream: str) -> None:
        """Give every consumer of the priority stream's level-0 stream its consumer of
        ``stream`` (a new subscriber's first message of that level, or found at start)."""
        s = self.s
        for base in list(s.by_stream.get(base_stream(stream), ())):
            if (base.peer, stream) not in s.consumers:
                self.mirror(base, stream, None)

    def mirror(self, base: Consumer, stream: str, state: DeliveryRecord | None) -> None:
        """The consumer of priority stream ``stream`` for the subscriber (or group) of
        ``base``: same peer, ordering and group; a cursor of its own, from ``state`` or
        from when the subscription started."""
        s = self.s
        topic = stream_target(base.stream)
        if base.members is not None:
            name = base.peer[len("group:"):]
            since = min((s.subscriptions[(m, topic)].get("since", "") for m in base.members
                         if (m, topic) in s.subscriptions), default=None)
            for member in base.members:
                consumer = self.roster.join_group(name, stream, member, state, since)
                consumer.exhausted = False  # read what is stored
            return
        record = s.subscriptions.get((base.peer, topic))
        if state is not None:
            consumer = Consumer.from_record(base.peer, stream, state)
        else:
            consumer = Consumer(base.peer, stream, None if record is None else record.get("since"))
            consumer.dirty = True
        consumer.ordered = base.ordered
        self.roster.add_consumer(consumer)  # its backlog: counted by Backlog.load, or as published

    def supersede(self, cmd: Supersede) -> None:
        """Withdraw an older message for a publish dedupe key in mode "latest" from every
        consumer that has not read it yet: deleted from a stream nobody read it from, else
        marked done for those that did not (at most SUPERSEDE_SKIPS waiting per consumer:
        each is kept in its delivery record until its cursor gets there). Consumers that
        were sent it keep it: they get both."""
        s = self.s
        old = cmd.message_id
        self._withdraw_retained(cmd.topic, old)
        bases = set(s.routes.targets(cmd.topic))
        for stream in [st for st in list(s.by_stream) if base_stream(st) in bases]:  # every level
            pending = s.new.get(stream)
            if pending is not None:  # written and withdrawn within one turn
                s.new[stream] = [item for item in pending if item[0] != old]
            consumers = s.by_stream.get(stream, ())
            if not consumers or s.store.get_outgoing(stream, old) is None:
                continue
            unread = [c for c in consumers if (c.pos or "") < old]
            if len(unread) == len(consumers):
                s.out.batch.delete_outgoing(stream, old)
                for c in consumers:
                    if self.backlog.on:
                        c.backlog -= 1
                    self._superseded(c, old, cmd.topic)
                continue
            for c in unread:
                if len(c.skip) < SUPERSEDE_SKIPS:
                    c.settle(old)
                    self._superseded(c, old, cmd.topic)

    def _withdraw_retained(self, topic: str, old: str) -> None:
        """A retained topic's own stream with no consumer yet: the older message goes, as
        from any stream nobody read it from."""
        s, own = self.s, event_stream(topic)
        if own not in s.by_stream and self.retained_ms(own) and s.store.get_outgoing(own, old) is not None:
            s.out.batch.delete_outgoing(own, old)
            s.counters["superseded"] += 1

    def _superseded(self, consumer: Consumer, mid: str, topic: str) -> None:
        s = self.s
        s.counters["superseded"] += 1
        peer = consumer.journal_peer(mid)
        if s.events_on and peer is not None:
            s.event("dropped_at_sender", s.wall(), mid, topic, "event", peer, 0, "superseded")

    def _command_consumer(self, address: str) -> str:
        stream = command_stream(address)
        if (address, stream) not in self.s.consumers:
            consumer = Consumer(address, stream, "")  # "" sorts before every id
            consumer.exhausted = True
            consumer.dirty = True
            self.roster.add_consumer(consumer)
        return stream

    def send(self, cmd: SendCmd) -> None:
        s = self.s
        cmd.address = s.target(cmd.address)  # a service by name: one instance of it
        stream = self._command_consumer(cmd.address)
        mid = s.ids.delayed(1, cmd.due)[0] if cmd.due is not None else s.ids.next()
        record = pack_outgoing(Kind.COMMAND, cmd.command, s.wall(), [mid], make_blob([cmd.body]),
                               cmd.expires, cmd.correlation_id, cmd.headers)
        s.out.batch.put_outgoing(stream, mid, record)
        s.new.setdefault(stream, []).append((mid, record, 1))
        s.out.batch.sync = True
        s.counters["commands_sent"] += 1
        if s.events_on:
            s.event("published", s.wall(), mid, cmd.command, "command", cmd.address)
        s.out.release.append((cmd.future, mid))

    def queue_reply(self, cmd: QueueReply) -> None:
        s = self.s
        reply_to, command, corr, body = cmd.reply
        try:
            stream = self._command_consumer(reply_to)
        except ValueError as exc:  # checked on receipt; only an older store gets here
            log.error("reply to %s cannot be sent: %s; dropped", reply_to, exc)
            s.out.batch.delete_reply(cmd.command_id)
            return
        mid = s.ids.next()
        sent = s.wall()
        record = pack_outgoing(Kind.REPLY, command, sent, [mid], make_blob([body]),
                               sent + int(s.config.reply_ttl * 1000), corr, None)
        # The reply moves from "pending" to the outgoing stream in one write. No fsync of
        # its own: the request's completion was not fsynced either, and the log keeps
        # their order, so a crash loses both (the request runs again) or neither.
        s.out.batch.put_outgoing(stream, mid, record)
        s.out.batch.delete_reply(cmd.command_id)
        s.new.setdefault(stream, []).append((mid, record, 1))
        s.counters["replies_sent"] += 1
        if s.events_on:
            s.event("published", s.wall(), mid, command, "reply", reply_to)

    def queue_send(self, cmd: QueueSend) -> None:
        """Move a command a handler sent from the outbox into its address's stream, ids
        made here like ``send``'s. Fsynced: once sent, a crash must not find it in the
        outbox again and send it a second time under a new id."""
        s = self.s
        key, send = cmd.key, cmd.send
        if key in s.outbox_moving or not s.store.has_outbox(key):
            return  # queued twice (read again by a reload while its first queueing waited)
        if "://" not in send.address and not s.instances(send.address):
            # A service no instance of which is known yet: it stays in the outbox (stored)
            # until discovery confirms one (core/members.py hands it back then).
            s.awaiting.setdefault(send.address, {})[key] = cmd
            return
        try:
            send = send._replace(address=s.target(send.address))  # a service: one instance
            stream = self._command_consumer(send.address)
        except ValueError as exc:  # checked by message.send; only an older store gets here
            log.error("command %s to %s cannot be sent: %s; dropped", send.command, send.address, exc)
            s.out.batch.delete_outbox(key)
            return
        s.outbox_moving.add(key)
        mid = s.ids.delayed(1, send.due)[0] if send.due is not None else s.ids.next()
        record = pack_outgoing(Kind.COMMAND, send.command, s.wall(), [mid], make_blob([send.body]),
                               send.expires, None, send.headers)
        s.out.batch.put_outgoing(stream, mid, record)
        s.out.batch.delete_outbox(key)
        s.out.batch.sync = True
        s.new.setdefault(stream, []).append((mid, record, 1))
        s.counters["commands_sent"] += 1
        if s.events_on:
            s.event("published", s.wall(), mid, send.command, "command", send.address)

    # --- out ---------------------------------------------------------------------------

    def retained_ms(self, stream: str) -> int:
        return self.s.routes.retention.stream_ms(stream)

    def _cutoff(self, stream: str) -> str | None:
        """Stream ids at or below this are older than the stream's retention; None: the
        stream is not retained (everything acknowledged may go)."""
        ms = self.retained_ms(stream)
        return None if not ms else f"{max(0, self.s.ids.now_ms() - ms):012x}"

    def collect_garbage(self) -> None:
        """Delete stream messages every consumer of the stream has acknowledged (and, in a
        retained stream, that are older than its retention)."""
        s = self.s
        batch, budget = s.out.batch, GC_BUDGET
        if s.routes.retention and s.now >= s.next_retain:
            s.next_retain = s.now + s.routes.retention.sweep_interval
            budget -= self.retain(budget)
        for stream, consumers in list(s.by_stream.items()):
            floors = [c.floor for c in consumers]
            floor = min(f for f in floors if f is not None) if floors and None not in floors else None
            if floor is None or s.gc_floor.get(stream) == floor or self.retained_ms(stream):
                continue  # (a retained stream: swept by retain)
            ids = s.store.stream_ids(stream, upto=floor, limit=budget)
            for mid in ids:
                batch.delete_outgoing(stream, mid)
            budget -= len(ids)
            if budget > 0:
                s.gc_floor[stream] = floor  # everything up to it is gone now
            else:
                return
        if s.orphans_due and budget > 0:
            # Streams nobody consumes any more (after an unsubscribe, or a removed
            # subscription found at start): their messages are owed to no one.
            for stream in s.store.stream_names():
                if stream in s.by_stream or base_stream(stream) in s.by_stream:
                    continue  # (a priority stream written before its consumers were made)
                if self.retained_ms(stream):
                    continue  # kept by age and size (retain)
                ids = s.store.stream_ids(stream, limit=budget)
                for mid in ids:
                    batch.delete_outgoing(stream, mid)
                budget -= len(ids)
                if budget <= 0:
                    return
            s.orphans_due = False

    # --- retention (model/retention.py) ---------------------------------------------------

    def retain(self, budget: int) -> int:
        """Sweep the retained streams nobody consumes: delete what is older than their
        retention, then the oldest beyond ``retention_bytes``. Streams with consumers are
        swept by ``collect_garbage`` (never past what a consumer is owed). Returns how many
        it deleted."""
        s = self.s
        deleted = 0
        for stream in s.store.stream_names():
            if not self.retained_ms(stream) or budget - deleted <= 0:
                continue
            if stream in s.by_stream or base_stream(stream) in s.by_stream:
                consumers = s.by_stream.get(stream, ())
                floors = [c.floor for c in consumers]
                if not floors or None in floors:
                    continue
                owed = min(f for f in floors if f is not None)
            else:
                owed = None
            cutoff = self._cutoff(stream)
            floor = cutoff if owed is None or cutoff is None else min(owed, cutoff)
            deleted += self._delete_retained(stream, floor, budget - deleted, owed)
        return deleted

    def _delete_retained(self, stream: str, floor: str | None, budget: int,
                         owed: str | None = None) -> int:
        """Delete a retained stream's events up to ``floor`` (by age), then its oldest
        beyond ``retention_bytes`` (never past ``owed``, what a consumer still needs),
        counting its bytes. Returns how many it deleted."""
        s = self.s
        batch = s.out.batch
        size = s.retained_bytes.get(stream)
        if size is None:  # first sweep since start: count what is stored, a chunk at a time
            size, after = 0, None
            while chunk := s.store.iter_stream(stream, after=after, limit=1000):
                size += sum(len(record) for _mid, record in chunk)
                after = chunk[-1][0]
        deleted, step = 0, 16  # most sweeps find nothing to delete: read little first
        after = None
        limit = s.routes.retention.max_bytes
        while deleted < budget:
            chunk = s.store.iter_stream(stream, after=after, limit=min(step, budget - deleted))
            step = 500
            if not chunk:
                break
            for mid, record in chunk:
                old = floor is not None and mid <= floor
                big = size > limit and (owed is None or mid <= owed)
                if not (old or big):
                    s.retained_bytes[stream] = size
                    return deleted
                batch.delete_outgoing(stream, mid)
                size -= len(record)
                deleted += 1
            after = chunk[-1][0]
        s.retained_bytes[stream] = size
        if floor is not None:
            s.gc_floor[stream] = floor
        return deleted
