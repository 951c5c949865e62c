"""Checking and encoding what a service publishes or sends, before anything is stored:
shared by ``Bus``, a handler's transaction (``message.publish``/``message.send``) and
``StubBus``, so that all three refuse the same input with the same error."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any, NamedTuple, Protocol

from .clock import wall_ms
from .delivery import KEY_HEADER, PRIORITY_HEADER, is_group_peer, pack_outgoing, priority_stream
from ..wire.payload import encode_headers, encode_payload
from ..wire.protocol import MAX_HEADERS, Kind
from ..wire.validation import MAX_MS, validate_target
from .ids import IdGenerator
from .routes import Routes
from .segments import cut, make_blob
from .stored import Event as EventRecord, OutboxSend, event
from ..wire.topics import validate_topic

__all__ = ["check_seconds", "check_ttl_headers", "due_ms", "Event", "prepare_event", "prepare_command",
           "MAX_TTL", "stage_publish", "Staged"]

# Seconds a ttl may be, at most: far past any use, and its end well below the year 10000,
# past which a receiver refuses an expires (validation.MAX_MS; a datetime shows no more).
MAX_TTL = 1000 * 365 * 86400


def check_seconds(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{what} must be a positive number of seconds, not {value!r}")


def check_ttl_headers(ttl: float | None, headers: dict[str, Any] | None) -> None:
    if ttl is not None:
        check_seconds(ttl, "ttl")
        if not ttl <= MAX_TTL:  # infinity and NaN too: int() of them raised OverflowError
            raise ValueError(f"ttl must be a positive number of seconds up to {MAX_TTL} (1,000 "
                             f"years), not {ttl!r}")
    if headers is not None:
        if not isinstance(headers, dict) or not all(isinstance(k, str) for k in headers):
            raise TypeError("headers must be a dict with str keys")
        reserved = [k for k in headers if k.startswith("sb-")]
        if reserved:
            raise ValueError(f"header names starting with 'sb-' are the bus's own: {reserved[0]!r}")
        size = len(encode_headers(headers))  # TypeError now, rather than a frame no receiver can read
        if size > MAX_HEADERS:
            raise ValueError(f"headers are {size} bytes encoded; at most {MAX_HEADERS} (they travel "
                             "in each frame's header, which has a size limit at the receiver)")


def due_ms(delay: float | None, deliver_at: float | datetime | None) -> int | None:
    """Wall-clock ms to deliver at, from ``delay`` (seconds from now) or ``deliver_at``
    (a POSIX timestamp or a timezone-aware datetime); None for now."""
    if delay is not None and deliver_at is not None:
        raise ValueError("give delay or deliver_at, not both")
    if delay is not None:
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not 0 <= delay < 10 * 365 * 86400:
            raise ValueError(f"delay must be seconds between 0 and 10 years, not {delay!r}")
        return wall_ms() + int(delay * 1000) if delay > 0 else None
    if deliver_at is None:
        return None
    if isinstance(deliver_at, datetime):
        if deliver_at.tzinfo is None:
            raise ValueError("deliver_at must be timezone-aware (a naive datetime's zone is a guess)")
        at = deliver_at.timestamp()
    elif isinstance(deliver_at, (int, float)) and not isinstance(deliver_at, bool):
        at = float(deliver_at)
    else:
        raise TypeError(f"deliver_at must be a datetime or a POSIX timestamp, not {type(deliver_at).__name__}")
    if not 0 <= at < 253402300799:  # the year 9999
        raise ValueError(f"deliver_at {deliver_at!r} is out of range")
    due = int(at * 1000)
    return due if due > wall_ms() else None


def _expires(ttl: float | None, due: int | None) -> int | None:
    if ttl is None:
        return None
    expires = (due or wall_ms()) + int(ttl * 1000)
    if expires >= MAX_MS:  # what every receiver takes (DESIGN rule 11)
        raise ValueError(f"ttl {ttl!r} from {'deliver_at' if due else 'now'} ends after the year "
                         "9999, later than a receiver keeps")
    return expires


def _check_size(body: bytes, limit: int) -> bytes:
    if len(body) > limit:
        raise ValueError(f"payload is {len(body)} bytes encoded; max_payload is {limit}")
    return body


class Event(NamedTuple):
    """Events ready to store: checked and encoded."""

    topic: str
    bodies: list[bytes]
    expires: int | None
    headers: dict[str, Any] | None  # with the bus's own (sb-key, sb-priority)
    due: int | None
    priority: int


def prepare_event(topic: str, payloads: Iterable[Any], *, max_payload: int,
                  ttl: float | None = None, headers: dict[str, Any] | None = None,
                  key: str | None = None, delay: float | None = None,
                  deliver_at: float | datetime | None = None, priority: int = 0) -> Event:
    """Check a publish and encode its payloads (``ValueError``/``TypeError`` naming what
    is wrong); nothing is stored."""
    validate_topic(topic)
    check_ttl_headers(ttl, headers)
    due = None if delay is None and deliver_at is None else due_ms(delay, deliver_at)
    if priority != 0 or type(priority) is not int:  # the common case checked in one step
        if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 9:
            raise ValueError(f"priority must be an int from 0 to 9, not {priority!r}")
        headers = {**(headers or {}), PRIORITY_HEADER: priority}
    if key is not None:
        if not isinstance(key, str) or not key or len(key.encode()) > 256:
            raise ValueError(f"key must be a non-empty str of at most 256 bytes, not {key!r}")
        headers = {**(headers or {}), KEY_HEADER: key}
    bodies = [_check_size(encode_payload(p), max_payload) for p in payloads]
    return Event(topic, bodies, _expires(ttl, due), headers or None, due, priority)


def prepare_command(address: str, command: str, payload: Any, *, max_payload: int,
                    ttl: float | None = None, headers: dict[str, Any] | None = None,
                    due: int | None = None) -> OutboxSend:
    """Check a send and encode its payload; nothing is stored. The result is the record a
    handler's transaction stores (``OutboxSend``): the same fields a send needs."""
    validate_target(address)
    validate_topic(command, "command")
    check_ttl_headers(ttl, headers)
    body = _check_size(encode_payload(payload), max_payload)
    return OutboxSend(address, command, body, _expires(ttl, due), headers or None, due)


class _Outgoing(Protocol):
    def put_outgoing(self, stream: str, message_id: str, record: bytes) -> None: ...


# (stream, [(key, packed outgoing record, messages in it)]): what a publish wrote into one
# stream, one entry per segment, which the engine is told once it is durable (core.Published).
Staged = tuple[str, list[tuple[str, bytes, int]]]


def stage_publish(batch: _Outgoing, routes: Routes, ids: IdGenerator, sent: int, topic: str,
                  bodies: list[bytes], expires: int | None = None,
                  headers: dict[str, Any] | None = None, due: int | None = None,
                  priority: int = 0, journal: bool = False, max_count: int = 200,
                  ) -> tuple[list[str], list[Staged], list[EventRecord]]:
    """Write ``bodies`` into ``batch`` for every subscriber of ``topic`` as ``routes`` has
    them, as segments of at most ``max_count`` messages (segments.py): one record per
    segment per stream it goes into, each stream with the same ids (made here: the caller
    holds the group commit's lock, so ids are made in the order batches commit). ``due``:
    wall-clock ms to deliver them at; ``sent``: wall-clock ms now. Returns the ids, what
    went into each stream and, with ``journal``, one "published" event per (segment,
    receiver) naming its messages."""
    made = ids.many(len(bodies)) if due is None else ids.delayed(len(bodies), due)
    streams = routes.targets(topic)
    out: list[Staged] = []
    events: list[EventRecord] = []
    if streams:
        segments = []
        for start, end in cut(bodies, max_count):
            part = made[start:end]
            segments.append((part, pack_outgoing(Kind.EVENT, topic, sent, part, make_blob(bodies[start:end]),
                                                 expires, None, headers)))
        put = batch.put_outgoing
        for stream in streams:
            target = priority_stream(stream, priority)
            items = []
            for part, record in segments:
                put(target, part[0], record)
                items.append((part[0], record, len(part)))
            out.append((target, items))
        if journal:  # one event per (segment, receiver): what the audit reconciles
            # A group's messages are journaled per member when one is picked (core/sender.py).
            peers = dict.fromkeys(p for stream in streams for p in routes.stream_peers.get(stream, ())
                                  if not is_group_peer(p))
            events = [event("published", sent, part[0], topic, "event", peer, ids=part)
                      for peer in peers for part, _record in segments]
    return made, out, events
