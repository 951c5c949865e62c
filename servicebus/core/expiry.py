"""Sender-side dead letters: messages that expired, that their receiver cannot take, or
whose stored record is damaged. Each is settled in its consumer's window (so the cursor
moves past it and garbage collection can delete it) and kept as a dead letter here."""

from __future__ import annotations

import logging

from ..model.delivery import Consumer, OutgoingRecord, is_command_stream, unpack_outgoing
from ..model.letters import damaged_letter, outgoing_letter
from ..wire.protocol import KIND_NAMES, Kind
from .state import Peer, State

__all__ = ["Expiry", "EXPIRY_SCAN"]

log = logging.getLogger("servicebus")

EXPIRY_SCAN = 1000  # stored messages read per consumer per check


class Expiry:
    def __init__(self, state: State) -> None:
        self.s = state

    def record(self, consumer: Consumer, mid: str, data: bytes) -> OutgoingRecord | None:
        """The stored message, or None if its record is damaged: then it becomes a dead
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

    def expire(self, consumer: Consumer, mid: str, record: OutgoingRecord, attempt: int) -> None:
        """A message whose TTL passed before its receiver acked it: a dead letter here; a
        request is dropped instead (its caller got ``RequestTimeout``: nothing to replay)."""
        s = self.s
        peer = consumer.journal_peer(mid)  # before settling: that forgets a group's member
        consumer.settle(mid)
        if record.kind == Kind.COMMAND and record.correlation_id is not None:
            s.counters["requests_expired"] += 1
            if s.events_on and peer is not None:
                s.event("dropped_at_sender", s.wall(), mid, record.topic, "command", peer,
                          attempt, "request_expired")
            log.info("request %s to %s expired before it was acknowledged: dropped (its caller "
                     "was told RequestTimeout)", mid, consumer.peer)
            return
        s.out.batch.put_deadletter(mid, outgoing_letter("expired", None, record, consumer.peer,
                                                        consumer.stream))
        s.counters["expired"] += 1
        if s.events_on and peer is not None:
            s.event("expired_at_sender", s.wall(), mid, record.topic, KIND_NAMES[record.kind],
                      peer, attempt, "expired")
        log.warning("%s %s to %s expired before it was acknowledged: dead letter",
                    Kind(record.kind).name.lower(), mid, consumer.peer)

    def refuse(self, consumer: Consumer, mid: str, record: OutgoingRecord, reason: str,
               error: str) -> None:
        """A message its receiver cannot take: a dead letter at the sender (replayable with
        ``servicebus replay`` once the receiver's ``max_payload`` allows it)."""
        s = self.s
        peer = consumer.journal_peer(mid)
        consumer.settle(mid)
        kind = Kind(record.kind).name.lower()
        s.out.batch.put_deadletter(mid, outgoing_letter(reason, error, record, consumer.peer,
                                                        consumer.stream))
        s.counters["refused"] += 1
        if s.events_on and peer is not None:
            s.event("deadlettered_at_sender", s.wall(), mid, record.topic, kind, peer, 0, reason)
        log.error("%s %s to %s: %s; dead letter", kind, mid, consumer.peer, error)

    def too_large(self, consumer: Consumer, mid: str, record: OutgoingRecord, peer: Peer) -> bool:
        limit = peer.max_payload
        if limit is None or len(record.body) <= limit:
            return False
        self.refuse(consumer, mid, record, "too_large",
                    f"payload of {len(record.body)} bytes; the receiver's max_payload is {limit}")
        return True

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
                        consumer.admit(mid, now, ack_timeout)
                    continue
                try:
                    record = unpack_outgoing(data)
                except Exception:  # noqa: BLE001 - damaged: self.record dead-letters it
                    record = None
                if record is not None and not self.expired(record, now_ms):
                    leading = False
                    continue
                if leading and consumer.room(window) > 0:
                    consumer.admit(mid, now, ack_timeout)
                if record is None:
                    self.record(consumer, mid, data)
                else:
                    self.expire(consumer, mid, record, 0)
