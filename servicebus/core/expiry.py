"""Sender-side dead letters: segments that expired, messages their receiver cannot take,
records that are damaged. A segment given up is settled in its consumer's window (so the
cursor moves past it and garbage collection can delete it) and each of its messages kept
as a dead letter of its own here (a segment of one: ``servicebus replay`` puts it back)."""

from __future__ import annotations

import logging

from collections.abc import Iterable

from ..model.delivery import Consumer, OutgoingRecord, is_command_stream, unpack_outgoing
from ..model.letters import damaged_letter, outgoing_letter
from ..model.segments import bodies_of, make_blob
from ..wire.protocol import KIND_NAMES, Kind
from .state import Peer, State

__all__ = ["Expiry", "EXPIRY_SCAN"]

log = logging.getLogger("servicebus")

EXPIRY_SCAN = 1000  # stored messages read per consumer per check


class Expiry:
    def __init__(self, state: State) -> None:
        self.s = state

    def record(self, consumer: Consumer, mid: str, data: bytes) -> OutgoingRecord | None:
        """The stored segment, or None if its record is damaged: then it becomes a dead
        letter (reason ``damaged``, the raw bytes kept) instead of stopping the engine."""
        try:
            return unpack_outgoing(data)
        except Exception as exc:  # noqa: BLE001 - a damaged record must not stop the engine
            consumer.settle(mid)
            self.s.out.batch.put_deadletter(mid, damaged_letter(
                "outgoing", f"undecodable record ({type(exc).__name__})", data, consumer.peer,
                consumer.stream))
            self.s.counters["damaged"] += 1
            log.error("message %s to %s: its stored record is damaged (%s); moved to the dead "
                      "letters with its raw bytes", mid, consumer.peer, type(exc).__name__)
            return None

    def expired(self, record: OutgoingRecord, now_ms: int | None = None) -> bool:
        if record.expires is None:
            return False
        return record.expires < (self.s.wall() if now_ms is None else now_ms)

    def letters(self, consumer: Consumer, record: OutgoingRecord, reason: str, error: str | None,
                which: Iterable[int] | None = None) -> None:
        """Each of a segment's messages (or those at indices ``which``) as a dead letter of
        its own for ``consumer``'s peer."""
        bodies = bodies_of(record.blob) if which is not None or len(record.ids) > 1 else None
        batch = self.s.out.batch
        for i in range(len(record.ids)) if which is None else which:
            one = record if bodies is None else record._replace(
                ids=[record.ids[i]], blob=make_blob([bodies[i]]))
            batch.put_deadletter(record.ids[i], outgoing_letter(reason, error, one, consumer.peer,
                                                                consumer.stream))

    def expire(self, consumer: Consumer, mid: str, record: OutgoingRecord, attempt: int) -> None:
        """A segment whose TTL passed before its receiver acked it: its messages are dead
        letters here; a request is dropped instead (its caller got ``RequestTimeout``:
        nothing to replay)."""
        s = self.s
        peer = consumer.journal_peer(mid)  # before settling: that forgets a group's member
        consumer.settle(mid, len(record.ids))
        if record.kind == Kind.COMMAND and record.correlation_id is not None:
            s.counters["requests_expired"] += 1
            if s.events_on and peer is not None:
                s.event("dropped_at_sender", s.wall(), mid, record.topic, "command", peer,
                        attempt, "request_expired")
            log.info("request %s to %s expired before it was acknowledged: dropped (its caller "
                     "was told RequestTimeout)", mid, consumer.peer)
            return
        self.letters(consumer, record, "expired", None)
        s.counters["expired"] += len(record.ids)
        if s.events_on and peer is not None:
            s.event("expired_at_sender", s.wall(), mid, record.topic, KIND_NAMES[record.kind],
                    peer, attempt, "expired", record.ids)
        log.warning("%s %s to %s expired before it was acknowledged: dead letter%s",
                    Kind(record.kind).name.lower(), mid, consumer.peer,
                    f" (and {len(record.ids) - 1} more of its segment)" if len(record.ids) > 1 else "")

    def refuse(self, consumer: Consumer, mid: str, record: OutgoingRecord, reason: str,
               error: str, which: list[int] | None = None) -> None:
        """Messages their receiver cannot take (the segment's, or those at ``which``): dead
        letters at the sender (replayable with ``servicebus replay`` once the receiver
        allows them). A whole segment is settled; a part of one is left out of what is sent."""
        s = self.s
        peer = consumer.journal_peer(mid)
        if which is None:
            consumer.settle(mid, len(record.ids))
        kind = Kind(record.kind).name.lower()
        self.letters(consumer, record, reason, error, which)
        ids = record.ids if which is None else [record.ids[i] for i in which]
        s.counters["refused"] += len(ids)
        if s.events_on and peer is not None:
            s.event("deadlettered_at_sender", s.wall(), ids[0], record.topic, kind, peer, 0, reason, ids)
        log.error("%s %s to %s: %s; dead letter", kind, ", ".join(ids[:3]) + (" ..." if len(ids) > 3 else ""),
                  consumer.peer, error)

    def fit(self, consumer: Consumer, mid: str, record: OutgoingRecord, peer: Peer) -> OutgoingRecord | None:
        """The part of a segment ``peer`` takes: its messages whose payload is within the
        peer's ``max_payload`` (the others are dead letters here); None if none is."""
        limit = peer.max_payload
        if limit is None or len(record.blob) <= limit:
            return record  # the whole blob is within: each payload is
        bodies = bodies_of(record.blob)
        big = [i for i, body in enumerate(bodies) if len(body) > limit]
        if not big:
            return record
        sizes = ", ".join(str(len(bodies[i])) for i in big[:3])
        error = f"payload of {sizes} bytes; the receiver's max_payload is {limit}"
        if len(big) == len(bodies):
            self.refuse(consumer, mid, record, "too_large", error)
            return None
        self.refuse(consumer, mid, record, "too_large", error, big)
        keep = [i for i in range(len(bodies)) if i not in set(big)]
        return record._replace(ids=[record.ids[i] for i in keep], blob=make_blob([bodies[i] for i in keep]))

    def expire_waiting(self, now: float) -> None:
        """TTLs pass while a receiver is down too: commands and replies waiting for a peer
        that is down become dead letters when they expire, not when it comes back; so do
        events of streams published to with a TTL since this start. Reads at most EXPIRY_SCAN stored messages per
        consumer per call, resuming where the last call stopped."""
        s = self.s
        now_ms = s.wall()
        window, ack_timeout = s.config.window, s.config.ack_timeout
        for consumer in list(s.consumers.values()):
            if s.up(consumer):
                continue
            if not is_command_stream(consumer.stream) and consumer.stream not in s.ttl_streams:
                continue
            record: OutgoingRecord | None
            for mid, flight in list(consumer.inflight.items()):
                data = s.store.get_outgoing(consumer.stream, mid)
                record = None if data is None else self.record(consumer, mid, data)
                if record is not None and self.expired(record, now_ms):
                    self.expire(consumer, mid, record, flight.attempt)
            start = max(consumer.scan or "", consumer.pos or "")
            items = s.store.iter_stream(consumer.stream, after=start or None, limit=EXPIRY_SCAN)
            consumer.scan = items[-1][0] if len(items) == EXPIRY_SCAN else None  # else: from the start
            # Expired messages right after the cursor are read into the window and settled
            # there, so the cursor moves past them (drain and garbage collection see them
            # gone); ones behind a message still alive are skipped when the cursor gets there.
            leading = start == (consumer.pos or "")
            for mid, data in items:
                if mid in consumer.skip:
                    if leading and consumer.room(window) > 0:
                        consumer.admit(mid, now, ack_timeout)  # skipped: settled at once
                    continue
                try:
                    record = unpack_outgoing(data)
                except Exception:  # noqa: BLE001 - damaged: self.record dead-letters it
                    record = None
                if record is not None and not self.expired(record, now_ms):
                    leading = False
                    continue
                if leading and consumer.room(window) > 0:
                    consumer.admit(mid, now, ack_timeout, 1 if record is None else len(record.ids))
                if record is None:
                    self.record(consumer, mid, data)
                else:
                    self.expire(consumer, mid, record, 0)
