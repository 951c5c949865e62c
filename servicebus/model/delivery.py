"""Per-subscriber delivery state, retry timing, and the outgoing record format.

Outgoing messages live once per stream (``e:<topic>`` for events). Each (peer, stream) pair
has a ``Consumer``: a cursor into the stream plus a window of messages in flight.

Durable form of a consumer (``d/`` keyspace): ``floor`` (every stream id <= floor is
acknowledged by this peer), ``acked`` (ids above the floor acknowledged out of order) and
``attempts`` (resend counts above 1). After a restart the consumer rescans from ``floor``,
skips ``acked`` and resends the rest; it never resends what the peer acknowledged before the
state was written. Writes of this state are not fsynced on their own: losing one costs a
resend, which the receiver deduplicates (DESIGN.md section 9). In a group a resend could go
to another member, which would not: so a message's assignment to a member is fsynced before
it is sent, and after a (re)load its member is waited for (sender.py).
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any, NamedTuple

import msgpack

from .packer import pack
from ..wire.protocol import Envelope, Kind
from .stored import DeliveryRecord

__all__ = [
    "Consumer",
    "InFlight",
    "backoff",
    "pack_outgoing",
    "unpack_outgoing",
    "event_stream",
    "command_stream",
    "is_command_stream",
    "stream_target",
    "priority_stream",
    "base_stream",
    "is_priority_stream",
    "PRIORITY_HEADER",
    "OutgoingRecord",
    "group_peer",
    "is_group_peer",
    "ORDER_HEADER",
    "KEY_HEADER",
    "is_delayed",
]

# Headers the bus itself sets (a publish may not): an ordered subscription's stream, which
# tells the receiver to handle its messages one at a time in id order (dispatch.py), and a
# publish's ordering key (only messages with the same key wait for each other).
ORDER_HEADER = "sb-order"
KEY_HEADER = "sb-key"
PRIORITY_HEADER = "sb-priority"  # 1-9: the receiver runs it sooner (dispatch.py)
_GROUP = "group:"


def group_peer(name: str) -> str:
    """The name a subscriber group's shared consumer is stored under (not an address)."""
    return _GROUP + name


def is_group_peer(peer: str) -> bool:
    return peer.startswith(_GROUP)


def is_delayed(message_id: str) -> bool:
    """Delayed messages have ids made for their due time, marked by a 25th character
    (ids.py): the sender holds them until then."""
    return len(message_id) == 25


def event_stream(topic: str) -> str:
    return "e:" + topic


def command_stream(address: str) -> str:
    """Commands and replies to one address share one stream: one consumer, that address."""
    return "c:" + address


def is_command_stream(stream: str) -> bool:
    return stream.startswith("c:")


def stream_target(stream: str) -> str:
    """The topic of an event stream (of any priority), the address of a command stream."""
    if stream.startswith("c:"):
        return stream[2:]
    return stream[2:].split(" ", 1)[0]


def priority_stream(stream: str, priority: int) -> str:
    """Where events of ``priority`` (1-9) published to an event stream are stored: a stream
    of their own per level (a space cannot be in a topic), read by a consumer of its own
    per subscriber with its own window, so they never wait behind the level-0 backlog."""
    return f"{stream} {priority}" if priority else stream


def base_stream(stream: str) -> str:
    """The level-0 event stream a priority stream belongs to (any other stream: itself)."""
    return stream.split(" ", 1)[0] if stream.startswith("e:") else stream


def is_priority_stream(stream: str) -> bool:
    return stream.startswith("e:") and " " in stream


def backoff(attempt: int, initial: float, cap: float, jitter: float = 0.2) -> float:
    """Delay before try number ``attempt + 1``: initial * 2**(attempt-1), capped, +/- jitter."""
    base: float = min(cap, initial * (2 ** min(attempt - 1, 62)))
    return base * random.uniform(1.0 - jitter, 1.0 + jitter)


class OutgoingRecord(NamedTuple):
    """``o/<stream>\0<key>``: a stored segment (segments.py)."""

    kind: int
    topic: str
    sent: int
    expires: int | None
    correlation_id: str | None
    headers: dict[str, Any] | None
    ids: list[str]  # its messages; the key is the first
    blob: bytes  # their payloads (segments.py)


def pack_outgoing(kind: Kind, topic: str, sent: int, ids: list[str], blob: bytes,
                  expires: int | None = None, correlation_id: str | None = None,
                  headers: dict[str, Any] | None = None) -> bytes:
    return pack([int(kind), topic, sent, expires, correlation_id, headers, ids, blob])


_tuple = tuple.__new__  # NamedTuples built per message skip their keyword-parsing __new__


def unpack_outgoing(data: bytes) -> OutgoingRecord:
    """Decode a stored outgoing record; ``ValueError`` (or msgpack's errors) if damaged.
    Checked lightly, as this runs per message sent: the full check is schema.py's."""
    fields = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if type(fields) is not list or len(fields) != 8:
        raise ValueError("not an outgoing record")
    record: OutgoingRecord = _tuple(OutgoingRecord, fields)
    if record.kind not in (1, 2, 3) or type(record.blob) is not bytes or type(record.topic) is not str \
            or type(record.ids) is not list or not record.ids:
        raise ValueError("not an outgoing record")
    return record


def envelope_from_record(key: str, record: OutgoingRecord, attempt: int) -> Envelope:
    """The segment ``key`` as it goes on the wire (protocol.Envelope)."""
    return _tuple(Envelope, (key, record.topic, record.sent, record.blob, attempt,
                             record.expires, record.correlation_id, record.headers,
                             tuple(record.ids)))


class InFlight:
    __slots__ = ("attempt", "deadline", "ids")

    def __init__(self, attempt: int, deadline: float) -> None:
        self.attempt = attempt
        self.deadline = deadline
        self.ids: tuple[str, ...] | list[str] = ()  # the segment's messages, once read


class Consumer:
    """Delivery state of one peer on one stream, by segment key (segments.py): its window
    counts messages. Owned by the engine thread."""

    __slots__ = ("peer", "stream", "floor", "pos", "order", "inflight", "skip", "attempts",
                 "exhausted", "dirty", "last_ack", "scan", "members", "assigned", "ordered",
                 "backlog", "left", "load", "sizes", "used")

    def __init__(self, peer: str, stream: str, floor: str | None,
                 acked: list[str] | None = None, attempts: dict[str, int] | None = None) -> None:
        self.peer = peer
        self.stream = stream
        self.floor = floor  # every stream id <= floor is acknowledged
        self.pos = floor  # last stream id read into the window
        self.order: deque[str] = deque()  # window ids in stream order, acked ones included
        self.inflight: dict[str, InFlight] = {}  # unacknowledged ids of the window
        self.skip = set(acked or ())  # acknowledged above floor before a restart
        self.attempts = dict(attempts or {})  # resend counts restored from the store
        self.exhausted = False  # True when pos is at the end of the stream
        self.dirty = False
        self.last_ack: float | None = None
        self.scan: str | None = None  # where the TTL scan of a peer that is down got to
        # A subscriber group (competing consumers): one cursor shared by ``members``, each
        # message in flight ``assigned`` to one of them. None for one subscriber.
        self.members: list[str] | None = None
        self.assigned: dict[str, str] = {}
        self.load: dict[str, int] = {}  # member -> messages assigned to it in flight
        self.ordered = False  # one frame in flight at a time, handled in order (sender.py)
        self.backlog = 0  # messages owed (after floor, not acked); kept with max_backlog only
        self.left: int | None = None  # subscribe(limit=N): messages still to give; None: no end
        self.sizes: dict[str, int] = {}  # messages of each segment in ``order``
        self.used = 0  # messages in ``order``: what the window holds

    # --- window ------------------------------------------------------------------------

    def room(self, window: int) -> int:
        """Messages the window takes still (a segment is taken whole while any room is left)."""
        return window - self.used

    def admit(self, message_id: str, now: float, ack_timeout: float, count: int = 1) -> InFlight | None:
        """Take the next stream key (a segment of ``count`` messages) into the window; None
        if it was acked before a restart."""
        self.pos = message_id
        self.order.append(message_id)
        self.sizes[message_id] = count
        self.used += count
        if message_id in self.skip:
            self.skip.discard(message_id)
            self._advance()
            return None
        attempt = self.attempts.pop(message_id, 0) + 1
        flight = InFlight(attempt, now + ack_timeout)
        self.inflight[message_id] = flight
        return flight

    def ack(self, message_id: str) -> bool:
        if self.inflight.pop(message_id, None) is None:
            return False
        if self.members is not None:
            self.unassign(message_id)
        count = self.sizes.get(message_id, 1)
        self.backlog -= count
        if self.left is not None:
            self.left -= count
        self._advance()
        return True

    def settle(self, message_id: str, count: int = 1) -> None:
        """Count a segment (of ``count`` messages) as done without it being sent (expired
        while its receiver was down): in flight, it is acked; not read into the window
        yet, it is skipped when read."""
        if not self.ack(message_id) and (self.pos is None or message_id > self.pos):
            self.skip.add(message_id)
            self.backlog -= count
            self.dirty = True

    def _advance(self) -> None:
        order, inflight, sizes = self.order, self.inflight, self.sizes
        while order and order[0] not in inflight:
            self.floor = key = order.popleft()
            self.used -= sizes.pop(key, 1)
        # Even without moving the floor, an out-of-order ack changes the durable record.
        self.dirty = True

    @property
    def idle(self) -> bool:
        return not self.inflight and self.exhausted

    # --- durable form ------------------------------------------------------------------

    def record(self) -> DeliveryRecord:
        inflight = self.inflight
        record: DeliveryRecord = {
            "floor": self.floor,
            "acked": [i for i in self.order if i not in inflight] + sorted(self.skip),
            "attempts": {i: f.attempt for i, f in inflight.items() if f.attempt > 1},
            "last_ack": self.last_ack,
        }
        if self.members is not None:
            # After a restart each message goes back to the member that may hold it: a
            # resend to another could have two members handle it.
            record["assigned"] = dict(self.assigned)
        if self.left is not None:
            record["left"] = self.left
        return record

    @classmethod
    def from_record(cls, peer: str, stream: str, record: DeliveryRecord) -> "Consumer":
        consumer = cls(peer, stream, record.get("floor"), record.get("acked"), record.get("attempts"))
        consumer.last_ack = record.get("last_ack")
        left = record.get("left")
        if type(left) is int:
            consumer.left = left
        assigned = record.get("assigned")
        if isinstance(assigned, dict):
            for mid, member in assigned.items():
                if isinstance(member, str):
                    consumer.assign(mid, member)
        return consumer

    def assign(self, message_id: str, member: str) -> None:
        """Give a group's message in flight to ``member`` (from another one, if it had one)."""
        self.unassign(message_id)
        self.assigned[message_id] = member
        self.load[member] = self.load.get(member, 0) + 1

    def unassign(self, message_id: str) -> None:
        member = self.assigned.pop(message_id, None)
        if member is not None:
            self.load[member] -= 1

    def journal_peer(self, message_id: str) -> str | None:
        """Whom the journal names for this message: the subscriber, or in a group the
        member it went to (None if it went to none yet: nothing to reconcile)."""
        return self.peer if self.members is None else self.assigned.get(message_id)
