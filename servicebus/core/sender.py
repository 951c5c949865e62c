"""The sender's side of delivery: windows, acks, resends and the frames that carry them.

Each consumer (one peer on one stream) has a window of at most ``window`` unacknowledged
messages. New messages go straight into windows that had caught up; backlog is read from
the store into windows with room; what is not acked by its deadline is sent again with the
next attempt number, with backoff. Frames are cut at ``max_batch`` messages and
FRAME_BYTES of payload.
"""

from __future__ import annotations

import logging

from ..wire import protocol as P
from ..model.delivery import (ORDER_HEADER, Consumer, OutgoingRecord, backoff, envelope_from_record, unpack_outgoing,
                        is_command_stream, is_delayed, stream_target)
from ..model.ids import id_millis
from ..model.segments import bodies_of, count_of, make_blob
from ..model.stored import event
from ..wire.payload import header_bytes
from ..wire.protocol import FRAME_BYTES, KIND_NAMES, Kind
from collections.abc import Iterable
from .expiry import Expiry
from .state import Peer, State

__all__ = ["Sender", "FRAME_BYTES"]

log = logging.getLogger("servicebus")


def _stream_topic(stream: str) -> tuple[str | None, str]:
    """(topic, kind name) an ack on ``stream`` refers to, as far as the stream tells."""
    return (None, "command") if is_command_stream(stream) else (stream_target(stream), "event")


def _part(record: OutgoingRecord, ids: list[str]) -> OutgoingRecord:
    """The messages ``ids`` of a segment, in a record of their own (same key)."""
    keep = set(ids)
    bodies = bodies_of(record.blob)
    return record._replace(ids=[i for i in record.ids if i in keep],
                           blob=make_blob([b for i, b in zip(record.ids, bodies) if i in keep]))


class Sender:
    def __init__(self, state: State, expiry: Expiry) -> None:
        self.s = state
        self.expiry = expiry

    # --- acks --------------------------------------------------------------------------

    def on_acks(self, peer: Peer, ids: Iterable[str], wall_ms: int) -> int:
        """Segments ``peer`` acknowledged; how many messages they held."""
        s = self.s
        jon, jev, consumers = s.events_on, s.out.events, peer.consumers
        acked = 0
        for mid in ids:
            for consumer in consumers:
                flight = consumer.inflight.get(mid)
                if flight is not None and consumer.ack(mid):
                    acked += len(flight.ids) or 1
                    consumer.last_ack = wall_ms / 1000
                    if jon:
                        topic, kname = _stream_topic(consumer.stream)
                        jev.append(event("acked", wall_ms, mid, topic, kname, peer.address, 0, None,
                                         flight.ids or None))
                    break
        return acked

    def on_nack(self, peer: Peer, nack: P.Nack) -> None:
        """The peer refused these for good: segments (by key; their place in the window is
        freed) or single messages of a segment (too large for it: the rest of the segment
        is acked as usual). Each message becomes a dead letter here, with the peer's reason."""
        log.warning("peer %s refused %d message(s) or segment(s): %s", peer.address, len(nack.ids),
                    nack.reason)
        if nack.segment is not None:
            self._refuse_part(peer, nack)
            return
        for key in nack.ids:
            for consumer in peer.consumers:
                if key not in consumer.inflight:
                    continue
                data = self.s.store.get_outgoing(consumer.stream, key)
                record = None if data is None else self.expiry.record(consumer, key, data)
                if record is None:
                    consumer.settle(key)
                else:
                    self.expiry.refuse(consumer, key, record, "refused", nack.reason)
                break

    def _refuse_part(self, peer: Peer, nack: P.Nack) -> None:
        """Messages of an in-flight segment its receiver refused (too large for it): dead
        letters here, left out of its resends; the rest of it is acked as usual (none left:
        the segment is done)."""
        key = nack.segment
        assert key is not None
        refused = set(nack.ids)
        for consumer in peer.consumers:
            flight = consumer.inflight.get(key)
            if flight is None:
                continue
            data = self.s.store.get_outgoing(consumer.stream, key)
            record = None if data is None else self.expiry.record(consumer, key, data)
            if record is None:
                break
            which = [i for i, mid in enumerate(record.ids) if mid in refused and mid in (flight.ids or record.ids)]
            if which:
                self.expiry.refuse(consumer, key, record, "refused", nack.reason, which)
            flight.ids = [mid for mid in (flight.ids or record.ids) if mid not in refused]
            if not flight.ids:
                consumer.settle(key, len(record.ids))  # nothing of it is left to deliver
            break

    def peer_up(self, peer: Peer) -> None:
        """A peer (re)appeared: what it had in flight may be lost, so send it again now
        rather than at the end of a long backoff (in a group: what went to it)."""
        for consumer in peer.consumers:
            consumer.exhausted = False
            assigned = consumer.assigned if consumer.members is not None else None
            for mid, flight in consumer.inflight.items():
                if assigned is None or assigned.get(mid) == peer.address:
                    flight.deadline = 0.0

    # --- whom to send to ---------------------------------------------------------------

    def _room(self, consumer: Consumer, window: int) -> int:
        """How many more messages the consumer's window takes now. An ordered one takes a
        frame's worth, and only once the last one is all acknowledged: the next frame
        cannot overtake it then, whatever the network loses. A group's window is one per
        member; ``subscribe(limit=N)`` caps it at what the subscription is still given."""
        if consumer.ordered:
            room = 0 if consumer.order else self.s.config.max_batch
        elif consumer.members is not None:
            room = consumer.room(window * max(1, len(consumer.members)))
        else:
            room = consumer.room(window)
        if consumer.left is not None:
            room = min(room, self._left(consumer))
        return room

    @staticmethod
    def _left(consumer: Consumer) -> int:
        """Messages a subscription with a limit may still be given, past those in flight."""
        assert consumer.left is not None
        return consumer.left - sum(len(f.ids) or 1 for f in consumer.inflight.values())

    def _member(self, consumer: Consumer, avoid: str | None = None) -> Peer | None:
        """The up member of a group with the fewest messages in flight (not ``avoid``,
        unless it is the only one up)."""
        peers = self.s.peers
        live = [m for m in consumer.members or () if peers[m].up]
        if not live:
            return None
        others = [m for m in live if m != avoid] or live
        load = consumer.load
        return peers[min(others, key=lambda m: load.get(m, 0))]

    def _delayed(self, consumer: Consumer, mid: str) -> bool:
        """A delayed message not due yet: the consumer stops reading at it (every id after
        it is later still) and a timer wakes it when due."""
        s = self.s
        if len(mid) != 25 or not s.not_due(mid):
            return False
        s.wake(id_millis(mid), consumer.stream)
        return True

    # --- into the windows --------------------------------------------------------------

    def _admit(self, consumer: Consumer, mid: str, data: bytes, now: float, peer: Peer) -> int:
        """Take segment ``mid`` into the window and queue it for ``peer`` (in a group: the
        member picked for it). Returns the payload bytes queued."""
        s = self.s
        if mid in consumer.skip:
            consumer.admit(mid, now, s.config.ack_timeout)  # acknowledged before a restart
            return 0
        try:
            record: OutgoingRecord | None = unpack_outgoing(data)
        except Exception:  # noqa: BLE001 - damaged: expiry.record dead-letters it below
            record = None
        if record is not None and consumer.left is not None and len(record.ids) > self._left(consumer):
            # A subscription's last messages: the first part of the segment, the rest never
            # (resends send the same part: flight.ids).
            record = _part(record, record.ids[:max(1, self._left(consumer))])
        flight = consumer.admit(mid, now, s.config.ack_timeout, 1 if record is None else len(record.ids))
        if flight is None:
            return 0
        if record is None:
            self.expiry.record(consumer, mid, data)
            return 0
        flight.ids = record.ids
        if self.expiry.expired(record):
            self.expiry.expire(consumer, mid, record, flight.attempt)
            return 0
        assigned = False
        if consumer.members is not None:
            to = consumer.assigned.get(mid)  # sent before a restart: to the same member
            member = s.peers.get(to) if to is not None and to in consumer.members else None
            if member is None or not member.up:
                member = self._member(consumer)
                if member is None:
                    consumer.inflight[mid].deadline = 0.0  # all went down meanwhile
                    return 0
                self._assign(consumer, mid, record, member, None)
                assigned = True
            peer = member
        fits = self.expiry.fit(consumer, mid, record, peer)
        if fits is None:
            return 0
        self._queue(consumer, peer, fits, mid, flight.attempt, park=assigned)
        return len(fits.blob) + header_bytes(record.headers)

    def _queue(self, consumer: Consumer, peer: Peer, record: OutgoingRecord, mid: str,
               attempt: int, park: bool = False) -> None:
        """Queue a frame for ``peer``. ``park``: a group message just given to a member waits
        for the fsync of the batch that records it (prepare() makes it synced): the record
        of who has it is written unsynced otherwise, and a power cut that lost it while the
        member kept (and handled) the message would give it to another member after the
        restart (tests/integration/test_power_loss.py: 5 of 2,500 handled by both)."""
        s = self.s
        env = envelope_from_record(mid, record, attempt)
        into = s.parked if park else s.outbox
        if consumer.ordered:
            env = env._replace(headers={**(record.headers or {}), ORDER_HEADER: consumer.stream})
            into.setdefault(peer, []).append(((record.kind, consumer.stream), env))
        else:
            into.setdefault(peer, []).append((record.kind, env))
        if s.events_on:
            s.event("sent", s.wall(), mid, record.topic, KIND_NAMES[record.kind], peer.address, attempt,
                    None, record.ids)

    def _assign(self, consumer: Consumer, mid: str, record: OutgoingRecord, member: Peer,
                old: str | None) -> None:
        """Give a group's message to ``member``. The journal says it was published to the
        member (the audit reconciles members, not groups) and, if it goes to another one
        than before, that the first one was dropped: only such reassigned messages can be
        handled by two members (one that was slow to ack, not dead), counted here."""
        s = self.s
        consumer.assign(mid, member.address)
        consumer.dirty = True
        if old is not None:  # counted in messages, as the journal's dropped events are
            s.counters["group_reassigned"] += len(record.ids)
        if s.events_on:
            ts = s.wall()
            if old is not None:
                s.event("dropped_at_sender", ts, mid, record.topic, "event", old, 0, "reassigned",
                        record.ids)
            s.event("published", record.sent, mid, record.topic, "event", member.address, 0, None,
                    record.ids)

    def deliver_new(self, now: float) -> None:
        """Messages written this turn go straight into windows that had caught up."""
        s = self.s
        new, s.new = s.new, {}
        window = s.config.window
        peers = s.peers
        for stream, items in new.items():
            for consumer in s.by_stream.get(stream, ()):
                group = consumer.members is not None
                peer = None if group else peers[consumer.peer]
                up = s.up(consumer) if group else peer.up  # type: ignore[union-attr]
                if not consumer.exhausted or not up:
                    consumer.exhausted = False
                    s.new_peer_work = s.new_peer_work or not up
                    continue
                pos = consumer.pos or ""
                room = self._room(consumer, window)
                size = 0
                for mid, record, count in items:
                    if mid <= pos:
                        continue  # read from the store before this notice arrived
                    if len(mid) == 25 and self._delayed(consumer, mid):
                        continue  # read from the store when due
                    if room <= 0 or size >= FRAME_BYTES or (consumer.ordered and consumer.order and count > room):
                        # The rest is read from the store later (an ordered window holds what
                        # one frame carries: the first segment, and others while they fit).
                        consumer.exhausted = False
                        break
                    n = self._admit(consumer, mid, record, now, peer)  # type: ignore[arg-type]
                    room -= count
                    if consumer.ordered:
                        size += n

    def fill_windows(self, now: float) -> None:
        """Read backlog from the store into windows with room (never more than a window)."""
        s = self.s
        window = s.config.window
        if s.filling_since is None:
            s.filling_since = now
        holding = now - s.filling_since < s.config.peer_timeout
        for consumer in list(s.consumers.values()):
            if consumer.exhausted:
                continue
            peer: Peer | None = None
            if consumer.members is None:
                peer = s.peers[consumer.peer]
                if not peer.up:
                    continue  # check_down learns whether anything waits for it
            elif not s.up(consumer):
                continue
            elif holding and self._unheard_member(consumer):
                continue
            room = self._room(consumer, window)
            if room <= 0:
                continue
            # At most ``room`` segments: each holds one message or more.
            items = s.store.iter_stream(consumer.stream, after=consumer.pos, limit=room)
            if len(items) < room:
                consumer.exhausted = True
            size = 0
            for mid, data in items:
                if len(mid) == 25 and self._delayed(consumer, mid):
                    consumer.exhausted = True  # until the timer wakes it
                    break
                if room <= 0 or (consumer.ordered and (size >= FRAME_BYTES or (
                        consumer.order and count_of(data, 6) > room))):
                    consumer.exhausted = False
                    break
                used = consumer.used
                size += self._admit(consumer, mid, data, now, peer)  # type: ignore[arg-type]
                room -= max(1, consumer.used - used)

    def _unheard_member(self, consumer: Consumer) -> bool:
        """Whether a member that the stored record says has messages of this group has not
        answered since the (re)load. Until it does, or ``peer_timeout`` passes, the window
        is not filled: _admit would give its messages to the first member that answered,
        and it may have them already. A restart (kill -9) brings back the messages in
        flight; a power cut also brings back acknowledged ones whose acks were not fsynced
        (tests/integration/test_power_loss.py: 5 of 2,500 handled by both members)."""
        peers = self.s.peers
        return any(peers[m].last_pong is None for m in set(consumer.assigned.values())
                   if m in peers and m in (consumer.members or ()))

    def resend_due(self, now: float) -> None:
        s = self.s
        cfg = s.config
        now_ms = s.wall()
        for consumer in list(s.consumers.values()):
            if not consumer.inflight:
                continue
            group = consumer.members is not None
            peer = None if group else s.peers[consumer.peer]
            if not (s.up(consumer) if group else peer.up):  # type: ignore[union-attr]
                continue
            # An ordered window goes again whole, in one frame, when any of it is due.
            ordered_due = consumer.ordered and any(f.deadline <= now for f in consumer.inflight.values())
            deadline = now + backoff(max(f.attempt for f in consumer.inflight.values()),
                                     cfg.ack_timeout, cfg.resend_max) if ordered_due else 0.0
            for mid, flight in list(consumer.inflight.items()):
                if flight.deadline > now and not ordered_due:
                    continue
                data = s.store.get_outgoing(consumer.stream, mid)
                if data is None:  # cannot happen unless the store was edited underneath us
                    log.error("message %s vanished from stream %s", mid, consumer.stream)
                    consumer.ack(mid)
                    continue
                record = self.expiry.record(consumer, mid, data)
                if record is None:
                    continue
                if self.expiry.expired(record, now_ms):
                    self.expiry.expire(consumer, mid, record, flight.attempt)
                    continue
                moved = False
                if group:
                    # Due means its member is down or did not ack in time: another one
                    # gets it (the same one if no other is up).
                    old = consumer.assigned.get(mid)
                    peer = self._member(consumer, avoid=old)
                    if peer is None:
                        continue
                    if peer.address != old:
                        self._assign(consumer, mid, record, peer, old)
                        moved = True
                if flight.ids and len(flight.ids) != len(record.ids):
                    record = _part(record, list(flight.ids))  # as first sent (a limit's last part)
                fits = self.expiry.fit(consumer, mid, record, peer)  # type: ignore[arg-type]
                if fits is None:
                    continue
                record = fits
                flight.attempt += 1
                flight.deadline = deadline or now + backoff(flight.attempt - 1, cfg.ack_timeout,
                                                            cfg.resend_max)
                consumer.dirty = True
                self._queue(consumer, peer, record, mid, flight.attempt, park=moved)  # type: ignore[arg-type]
                s.counters["resent"] += len(record.ids)

    def check_down(self) -> None:
        """Whether anything waits for peers that are down (drain and status need it): one
        seek per consumer per tick, not per turn."""
        s = self.s
        for consumer in s.consumers.values():
            if not consumer.exhausted and not s.up(consumer):
                ids = s.store.stream_ids(consumer.stream, after=consumer.pos, limit=1)
                if not ids or (is_delayed(ids[0]) and s.not_due(ids[0])):
                    consumer.exhausted = True

    # --- out -----------------------------------------------------------------------------

    def flush(self) -> None:
        """The outbox, as frames for the shell to send (peers that are down are skipped:
        what they have in flight is resent when they come back)."""
        s = self.s
        if not s.outbox:
            return
        outbox, s.outbox = s.outbox, {}
        for peer, items in outbox.items():
            if not items or not peer.up:
                continue
            # Per kind; an ordered consumer's messages (key (kind, stream)) apart, in a
            # frame of their own.
            by_kind: dict[object, list[P.Envelope]] = {}
            for key, env in items:
                by_kind.setdefault(key, []).append(env)
            codec = s.config.wire_compression  # only to a peer whose pongs say it decodes it
            compress = codec if codec is not None and codec in peer.codecs else None
            for key, envs in by_kind.items():
                kind = Kind(key if type(key) is int else key[0])  # type: ignore[index]
                # An ordered consumer's window goes in one frame, whole (it was cut to fit):
                # two frames in flight could arrive the other way round.
                for chunk in [envs] if type(key) is not int else self._frames(envs):
                    frames = P.encode_batch(kind, s.node_id, s.address, chunk, s.wall(), compress)
                    s.out.to_peers.append((peer.address, frames, sum(len(e.ids) or 1 for e in chunk)))

    def _frames(self, envs: list[P.Envelope]) -> list[list[P.Envelope]]:
        """Split segments into frames of at most ``max_batch`` messages (and MAX_SEGMENTS
        segments) and FRAME_BYTES of payload and headers (one segment alone may be bigger:
        one message up to max_payload): a frame above the receiver's ZeroMQ message size
        limit would make libzmq drop the connection, and only resends recover."""
        count = self.s.config.max_batch
        chunks: list[list[P.Envelope]] = []
        chunk: list[P.Envelope] = []
        size = messages = 0
        for env in envs:
            n = len(env.body) + (header_bytes(env.headers) if env.headers else 0) + 25 * len(env.ids)
            m = len(env.ids) or 1
            if chunk and (messages + m > count or size + n > FRAME_BYTES or len(chunk) >= P.MAX_SEGMENTS):
                chunks.append(chunk)
                chunk, size, messages = [], 0, 0
            chunk.append(env)
            size += n
            messages += m
        if chunk:
            chunks.append(chunk)
        return chunks
