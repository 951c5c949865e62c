"""Frozen records handed to users: messages, status, peers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType

__all__ = ["Message", "BusStatus", "PeerStatus", "EMPTY"]

EMPTY: Mapping = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Message:
    """What a handler gets besides the payload."""

    id: str
    topic: str
    sender: str  # node id of the sending bus
    reply_to: str  # address of the sending bus
    sent: datetime  # sender's clock, UTC
    attempt: int  # 1 on the first run of the handler; crash reruns count
    headers: Mapping[str, object] = field(default_factory=lambda: EMPTY)
    kind: str = "event"
    correlation_id: str | None = None
    expires: datetime | None = None


@dataclass(frozen=True, slots=True)
class PeerStatus:
    address: str
    up: bool
    in_flight: int  # messages sent to it and not yet acknowledged
    last_seen: float | None  # seconds since it last answered, None if never


@dataclass(frozen=True)
class BusStatus:
    node_id: str
    address: str
    datadir: str
    running: bool
    subscriptions: int  # (subscriber, topic) pairs subscribed to this bus
    intents: int  # subscribe/unsubscribe requests this bus made
    intents_unconfirmed: int
    outgoing: int  # messages stored for delivery
    pending: int  # deliveries still owed (message x subscriber)
    pending_by_subscriber: Mapping[str, int]
    incoming: int  # received and not yet handled
    deadletters: int
    handled: int  # ids remembered for deduplication
    malformed: int  # frames dropped as malformed
    malformed_by_reason: Mapping[str, int]
    peers: tuple[PeerStatus, ...]
    lock: Mapping[str, object] = field(default_factory=dict)
