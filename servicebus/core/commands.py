"""Work user threads hand to the core (through the engine's queue).

Each carries the caller to release: an opaque token (a ``concurrent.futures.Future`` in a
running bus) that the core puts in ``Effects.release`` with the result once the batch
holding the change is written, or that the shell fails with the error the command raised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..model.stored import OutboxSend, ReplyRecord

__all__ = ["Published", "SendCmd", "QueueReply", "QueueSend", "SubscribeCmd", "Supersede"]


@dataclass
class Published:
    """Segments a user thread has just made durable in ``stream`` (in key order)."""

    stream: str
    items: list[tuple[str, bytes, int]]  # (key, packed outgoing record, messages in it)
    future: Any = None  # nobody waits: the publish returned already
    ttl: bool = False  # they carry a TTL: the stream is checked for expiry while a peer is down


@dataclass
class SendCmd:
    """A command (or a request, with a correlation id) to one address."""

    address: str
    command: str
    body: bytes
    expires: int | None
    headers: dict[str, Any] | None
    correlation_id: str | None
    future: Any
    due: int | None = None  # wall-clock ms to deliver it at (a delayed command), or now


@dataclass
class QueueReply:
    """A handled request's reply, stored by a worker, to be queued for sending."""

    command_id: str
    reply: ReplyRecord
    future: Any = None


@dataclass
class QueueSend:
    """A command a handler sent (``message.send``), stored in the outbox by the write that
    finished its run, to be moved into its address's stream."""

    key: str  # its outbox key (handled id, NUL, seq)
    send: OutboxSend
    future: Any = None


@dataclass
class SubscribeCmd:
    publisher: str
    topic: str
    op: str  # "subscribe" | "unsubscribe"
    future: Any  # released when the intent is stored
    confirmed: Any = None  # released when the publisher confirmed
    group: str | None = None  # a subscriber group to join (competing consumers)
    ordered: bool = False  # handled one at a time, in publish order
    limit: int | None = None  # the publisher ends the subscription after this many messages
    start: str | None = None  # where a new subscription begins (model/retention.py)


@dataclass
class Supersede:
    """``publish(dedupe_key=K, dedupe="latest")`` stored a newer message for K: the older
    one (``message_id`` on ``topic``) is withdrawn wherever it was not sent yet."""

    message_id: str
    topic: str
    future: Any = None  # nobody waits: the publish returned already
