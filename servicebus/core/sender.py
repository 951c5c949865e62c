"""The sender's side of delivery: windows, acks, resends and the frames that carry them.

Each consumer (one peer on one stream) has a window of at most ``window`` unacknowledged
messages. New messages go straight into windows that had caught up; backlog is read from
the store into windows with room; what is not acked by its deadline is sent again with the
next attempt number, with backoff. Frames are cut at ``max_batch`` messages and
FRAME_BYTES of payload.
"""

from __future__ import annotations

import logging

from .. import protocol as P
from ..delivery import Consumer, backoff, envelope_from_record, is_command_stream, stream_target
from ..protocol import KIND_NAMES, Kind
from collections.abc import Iterable
from .expiry import Expiry
from .state import Peer, State

__all__ = ["Sender", "FRAME_BYTES"]

log = logging.getLogger("servicebus")

FRAME_BYTES = 1 << 20  # payload bytes per frame, at most (one message alone may be bigger)


def _stream_topic(stream: str) -> tuple[str | None, str]:
    """(topic, kind name) an ack on ``stream`` refers to, as far as the stream tells."""
    return (None, "command") if is_command_stream(stream) else (stream_target(stream), "event")


class Sender:
    def __init__(self, state: State, expiry: Expiry) -> None:
        self.s = state
        self.expiry = expiry

    # --- acks --------------------------------------------------------------------------

    def on_acks(self, peer: Peer, ids: Iterable[str], wall_ms: int) -> None:
        s = self.s
        jon, jev, consumers = s.journal_on, s.out.journal, peer.consumers
        for mid in ids:
            for consumer in consumers:
                if consumer.ack(mid):
                    consumer.last_ack = wall_ms / 1000
                    if jon:
                        topic, kname = _stream_topic(consumer.stream)
                        jev.append(("acked", wall_ms, mid, topic, kname, peer.address, 0, None))
                    break

    def on_nack(self, peer: Peer, nack: P.Nack) -> None:
        """The peer refused these messages for good (too large for it): each becomes a dead
        letter here, with the peer's reason, and its place in the window is freed."""
        log.warning("peer %s refused %d message(s): %s", peer.address, len(nack.ids), nack.reason)
        for mid in nack.ids:
            for consumer in peer.consumers:
                if mid in consumer.inflight:
                    data = self.s.store.get_outgoing(consumer.stream, mid)
                    record = None if data is None else self.expiry.record(consumer, mid, data)
                    if record is not None:
                        self.expiry.refuse(consumer, mid, record, "refused", nack.reason)
                    else:
                        consumer.settle(mid)
                    break

    def peer_up(self, peer: Peer) -> None:
        """A peer (re)appeared: what it had in flight may be lost, so send it again now
        rather than at the end of a long backoff."""
        for consumer in peer.consumers:
            consumer.exhausted = False
            for flight in consumer.inflight.values():
                flight.deadline = 0.0

    # --- into the windows --------------------------------------------------------------

    def _admit(self, consumer: Consumer, mid: str, data: bytes, now: float,
               out: list[tuple[int, P.Envelope]]) -> None:
        s = self.s
        flight = consumer.admit(mid, now, s.config.ack_timeout)
        if flight is None:
            return  # acknowledged before a restart
        record = self.expiry.record(consumer, mid, data)
        if record is None:
            return
        if self.expiry.expired(record):
            self.expiry.expire(consumer, mid, record, flight.attempt)
            return
        if self.expiry.too_large(consumer, mid, record):
            return
        out.append((record.kind, envelope_from_record(mid, record, flight.attempt)))
        if s.journal_on:
            s.out.journal.append(("sent", s.wall(), mid, record.topic, KIND_NAMES[record.kind],
                                  consumer.peer, flight.attempt, None))

    def deliver_new(self, now: float) -> None:
        """Messages written this turn go straight into windows that had caught up."""
        s = self.s
        new, s.new = s.new, {}
        window = s.config.window
        for stream, items in new.items():
            for consumer in s.by_stream.get(stream, ()):
                peer = s.peers[consumer.peer]
                if not consumer.exhausted or not peer.up:
                    consumer.exhausted = False
                    s.new_peer_work = s.new_peer_work or not peer.up
                    continue
                out = s.outbox.setdefault(peer, [])
                pos = consumer.pos or ""
                for mid, record in items:
                    if mid <= pos:
                        continue  # read from the store before this notice arrived
                    if consumer.room(window) <= 0:
                        consumer.exhausted = False  # the rest is read from the store later
                        break
                    self._admit(consumer, mid, record, now, out)

    def fill_windows(self, now: float) -> None:
        """Read backlog from the store into windows with room (never more than a window)."""
        s = self.s
        window = s.config.window
        for consumer in list(s.consumers.values()):
            if consumer.exhausted:
                continue
            peer = s.peers[consumer.peer]
            room = consumer.room(window)
            if not peer.up:
                continue  # check_down learns whether anything waits for it
            if room <= 0:
                continue
            items = s.store.iter_stream(consumer.stream, after=consumer.pos, limit=room)
            if len(items) < room:
                consumer.exhausted = True
            out = s.outbox.setdefault(peer, [])
            for mid, data in items:
                self._admit(consumer, mid, data, now, out)

    def resend_due(self, now: float) -> None:
        s = self.s
        cfg = s.config
        now_ms = s.wall()
        for consumer in list(s.consumers.values()):
            peer = s.peers[consumer.peer]
            if not peer.up or not consumer.inflight:
                continue
            out = None
            for mid, flight in list(consumer.inflight.items()):
                if flight.deadline > now:
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
                if self.expiry.too_large(consumer, mid, record):
                    continue
                flight.attempt += 1
                flight.deadline = now + backoff(flight.attempt - 1, cfg.ack_timeout, cfg.resend_max)
                consumer.dirty = True
                if out is None:
                    out = s.outbox.setdefault(peer, [])
                out.append((record.kind, envelope_from_record(mid, record, flight.attempt)))
                s.counters["resent"] += 1
                if s.journal_on:
                    s.journal("sent", s.wall(), mid, record.topic, KIND_NAMES[record.kind],
                              consumer.peer, flight.attempt)

    def check_down(self) -> None:
        """Whether anything waits for peers that are down (drain and status need it): one
        seek per consumer per tick, not per turn."""
        s = self.s
        for consumer in s.consumers.values():
            if not consumer.exhausted and not s.peers[consumer.peer].up:
                if not s.store.stream_ids(consumer.stream, after=consumer.pos, limit=1):
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
            by_kind: dict[int, list[P.Envelope]] = {}
            for kind, env in items:
                by_kind.setdefault(kind, []).append(env)
            codec = s.config.wire_compression  # only to a peer whose pongs say it decodes it
            compress = codec if codec is not None and codec in peer.codecs else None
            for kind, envs in by_kind.items():
                for chunk in self._frames(envs):
                    frames = P.encode_batch(Kind(kind), s.node_id, s.address, chunk, s.wall(), compress)
                    s.out.to_peers.append((peer.address, frames, len(chunk)))

    def _frames(self, envs: list[P.Envelope]) -> list[list[P.Envelope]]:
        """Split into frames of at most ``max_batch`` messages and FRAME_BYTES of payload
        (one message alone may be bigger): a frame above the receiver's ZeroMQ message
        size limit would make libzmq drop the connection, and only resends recover."""
        count = self.s.config.max_batch
        chunks: list[list[P.Envelope]] = []
        chunk: list[P.Envelope] = []
        size = 0
        for env in envs:
            if chunk and (len(chunk) >= count or size + len(env.body) > FRAME_BYTES):
                chunks.append(chunk)
                chunk, size = [], 0
            chunk.append(env)
            size += len(env.body)
        if chunk:
            chunks.append(chunk)
        return chunks
