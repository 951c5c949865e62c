"""Frozen records handed to users: messages, status, peers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from ..handling.transaction import TransactionKeyValue

__all__ = ["Message", "BusStatus", "PeerStatus", "DeadLetter", "EMPTY"]

EMPTY: Mapping = MappingProxyType({})


class _MessageFields(NamedTuple):
    id: str
    topic: str
    sender: str  # node id of the sending bus
    reply_to: str  # address of the sending bus
    sent_ms: int  # sender's clock, ms since the epoch
    attempt: int  # 1 on the first run of the handler; crash reruns count
    headers_raw: dict | None = None
    kind: str = "event"
    correlation_id: str | None = None
    expires_ms: int | None = None
    # What message.kv/publish/send stage into while its handler runs (runner.py); None
    # where there is no handler's run to commit with (once/any/all, a message made by hand).
    transactions: Any = None


class Message(_MessageFields):
    """What a handler gets besides the payload. Immutable.

    A tuple rather than a frozen dataclass, with ``sent``, ``expires`` and ``headers``
    built when read: one is made per handled message, and most handlers never look at
    them (measured: 2 us of 25 per message on the handling thread).
    """

    __slots__ = ()

    @property
    def sent(self) -> datetime:
        """When the sender published it (sender's clock, UTC)."""
        return datetime.fromtimestamp(self.sent_ms / 1000, tz=timezone.utc)

    @property
    def expires(self) -> datetime | None:
        """When its TTL runs out (UTC), or None."""
        ms = self.expires_ms
        return None if ms is None else datetime.fromtimestamp(ms / 1000, tz=timezone.utc)

    @property
    def headers(self) -> Mapping[str, object]:
        """The publisher's headers, and the bus's own (names starting ``sb-``)."""
        raw = self.headers_raw
        return MappingProxyType(raw) if raw else EMPTY

    @property
    def key(self) -> str | None:
        """The ordering key it was published with (``publish(key=)``), or None."""
        raw = self.headers_raw
        return raw.get("sb-key") if raw else None

    def __repr__(self) -> str:
        # Without ``transactions``: an internal object, not part of what the message says.
        shown = ", ".join(f"{name}={value!r}" for name, value in zip(self._fields[:-1], self[:-1]))
        return f"Message({shown})"

    # --- the handler's transaction (transaction.py) ---------------------------------------

    def _transactions(self) -> Any:
        owner = self.transactions
        if owner is None:
            from ..errors import TransactionError

            raise TransactionError("message.kv, message.publish and message.send work only in "
                                   "the handler a bus runs for this message")
        return owner

    @property
    def kv(self) -> "TransactionKeyValue":
        """The bus's key-value state (``bus.kv``) as this handler's run sees it: writes are
        stored in the same atomic write as the run's completion, or not at all."""
        return self._transactions().run_transaction(self.id).kv

    def publish(self, topic: str, payload: Any, *, ttl: float | None = None,
                headers: dict[str, Any] | None = None, key: str | None = None,
                delay: float | None = None, deliver_at: float | datetime | None = None,
                priority: int = 0) -> None:
        """``Bus.publish`` as part of this handler's run: checked now, stored (and given
        its id) in the write that completes the run, and only if the handler returns."""
        self._transactions().stage_event(self.id, topic, payload, ttl=ttl, headers=headers, key=key,
                                         delay=delay, deliver_at=deliver_at, priority=priority)

    def send(self, address: str, command: str, payload: Any, *, ttl: float | None = None,
             headers: dict[str, Any] | None = None, delay: float | None = None,
             deliver_at: float | datetime | None = None) -> None:
        """``Bus.send`` as part of this handler's run (see ``publish``)."""
        self._transactions().stage_send(self.id, address, command, payload, ttl=ttl,
                                        headers=headers, delay=delay, deliver_at=deliver_at)


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
    # Frames and connections refused for security (issue 14): an address off the wire the
    # bus will not connect to (not_source_host, too_many_peers, unanswered, ...), a right a
    # key does not have, a failed CURVE handshake (handshake_failed_*), by reason.
    refused_by_reason: Mapping[str, int] = field(default_factory=dict)
    lock: Mapping[str, object] = field(default_factory=dict)
    # Why the store cannot be written right now (a full disk, an I/O error), or None. While
    # set, nothing is received, acked or sent, publish raises StoreWriteError, and the bus
    # retries by itself. Counts read from the store are -1 while it cannot be read either.
    store_error: str | None = None
    # (subscriber, topic) pairs owed ``max_backlog`` messages: publishes to the topic wait,
    # raise BacklogFull or push out the oldest, as ``backlog_policy`` says.
    backlog_full: tuple[tuple[str, str], ...] = ()
    # Where ``servicebus`` commands reach this bus while it runs (``ipc://...``), or None
    # when it runs without its admin endpoint; ``admin_off_reason`` then says why (its
    # folder was made by another user, say) and what to do.
    admin_endpoint: str | None = None
    admin_off_reason: str | None = None
    # Retained topics (``Bus(retention=...)``): topic -> messages, bytes kept, the age of the
    # oldest (seconds), its retention (seconds) and the bytes bound.
    retained: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A message that will not be delivered or handled without an operator (``servicebus
    replay`` puts it back). ``origin`` is ``incoming`` (received here: its handler failed,
    crashed or it expired, or it could not be read: ``undecodable``, ``invalid``),
    ``outgoing`` (it could not be delivered from here: expired, too large, refused, its
    subscriber removed) or ``sql_outbox`` (a row of a ``SqlOutbox`` table that could not
    be a message: ``invalid``). ``not_replayable`` says why replay leaves one alone."""

    id: str
    origin: str
    reason: str  # handler_failed, handler_crashed, expired, too_large, refused, damaged, undecodable, invalid, ...
    error: str | None  # the exception's type and text, or the receiver's reason
    topic: str | None  # the event topic or command name
    kind: str | None  # event, command or reply
    attempts: int | None  # handler runs (incoming)
    peer: str | None  # the receiver it was for (outgoing)
    at_ms: int  # when it became a dead letter, ms since the epoch (wall clock)
    not_replayable: str | None = None  # why replay cannot put it back; None: it can

    @property
    def at(self) -> datetime:
        return datetime.fromtimestamp(self.at_ms / 1000, tz=timezone.utc)
