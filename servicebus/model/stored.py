"""The layouts of stored records, named. One home for each: every module that writes or
reads one of these uses the names here, never a position.

Lists and tuples are stored as msgpack arrays (compact, and the same bytes as before they
had names); maps as msgpack maps. ``schema.py`` checks each layout on every read.
"""

from __future__ import annotations

from typing import Any, NamedTuple, TypedDict

__all__ = ["subscription_options", "IncomingRecord", "RunState", "SubscriptionRecord", "IntentRecord",
           "DeliveryRecord", "ReplyRecord", "OutboxSend", "JournalEvent", "NO_RUNS", "Incoming",
           "Event", "event", "Progress"]


class IncomingRecord(NamedTuple):
    """``n/<key>``: a received segment (segments.py), not all handled yet."""

    kind: int  # protocol.Kind
    topic: str  # an event's topic, a command's name
    sender: str  # node id of the sending bus
    reply_to: str  # address of the sending bus
    sent: int  # wall-clock ms at the sender
    attempt: int  # the sender's attempt number (resends count up)
    expires: int | None  # wall-clock ms on our clock (skew-corrected on receipt)
    correlation_id: str | None  # a request's or a reply's
    headers: dict[str, Any] | None
    ids: list[str]  # its messages, in order
    blob: bytes  # their msgpack payloads as a msgpack array, as sent


class Progress(NamedTuple):
    """``c/<key>\0<start>``: how far a run of a segment's messages from index ``start`` on
    got (handling/writes.py). Written, unsynced, each time one of them finishes: that write
    also says the next one has started, so a crash while it runs counts as one attempt."""

    next: int  # the messages [start, next) are finished (but those in ``skipped``)
    started: int  # runs of message ``next`` begun (a crash in one counts as an attempt)
    skipped: list[int]  # indices in [start, next) finished elsewhere: split off to be
    #                     retried on their own (n/<id>) or dead letters (x/<id>)


class RunState(NamedTuple):
    """``r/<id>``: how a received message's handling went so far."""

    attempts: int  # runs started (written before each run: a crash counts as one)
    done: list[str]  # names of the handlers that finished (several handlers on a topic)
    last_error: str | None
    next_ms: int  # wall-clock ms of the next retry, 0 if none is scheduled


NO_RUNS = RunState(0, [], None, 0)


class Incoming(NamedTuple):
    """A received segment, stored, handed from the core to the handlers (``record``: as
    ``n/<key>`` holds it; ``runstate``: a one-message segment's run state, None if it never
    ran or its run state is damaged; ``progress``: what runs of a segment of several got
    through, by start index, {} if none)."""

    id: str  # the segment's key
    record: IncomingRecord
    runstate: RunState | None
    progress: dict[int, Progress] | None = None


class ReplyRecord(NamedTuple):
    """``y/<command id>``: a handled request's reply, until queued for sending."""

    reply_to: str
    command: str
    correlation_id: str | None
    body: bytes


class OutboxSend(NamedTuple):
    """``u/<handled id>\\0<seq>``: a command a handler sent (``message.send``), stored in
    the write that finished its run, until the engine moves it into the address's stream."""

    address: str
    command: str
    body: bytes
    expires: int | None
    headers: dict[str, Any] | None
    due: int | None


class SubscriptionRecord(TypedDict, total=False):
    """``s/<subscriber>\\0<topic>``: who subscribed to us, from which id on."""

    since: str
    created: int
    node: str
    group: str  # optional: a subscriber group (competing consumers) it is a member of
    ordered: bool  # optional: handled one at a time in publish order
    limit: int  # optional: the subscription ends after this many messages
    start: str  # optional: where it began (model/retention.py), when not at the end


class IntentRecord(TypedDict, total=False):
    """``i/<publisher>\\0<topic>``: a subscribe or unsubscribe we asked for."""

    op: str  # "subscribe" | "unsubscribe"
    id: str
    confirmed: bool
    updated: int
    group: str  # optional, as in SubscriptionRecord
    ordered: bool  # optional
    limit: int  # optional
    start: str  # optional: the start position asked for (model/retention.py)
    via: str  # optional: the service it was asked of by name (core/members.py)


class DeliveryRecord(TypedDict, total=False):
    """``d/<peer>\\0<stream>``: one peer's cursor on one stream (see delivery.Consumer)."""

    floor: str | None  # every id up to it is acknowledged
    acked: list[str]  # acknowledged above the floor
    attempts: dict[str, int]  # resend counts above 1
    last_ack: float | None
    assigned: dict[str, str]  # a subscriber group's messages in flight -> the member sent to
    left: int  # a subscription with a limit: messages it is still to be given


class Event(NamedTuple):
    """What happened to one message, as the hooks and the journal see it (hooks/base.py)."""

    name: str  # published, sent, acked, received, handled, handler_failed, retried,
    #            deadlettered, expired, dropped, replayed; *_at_sender where both sides have one
    ts: int  # wall-clock ms
    id: str
    topic: str | None  # the event's topic, the command's name
    kind: str | None  # event, command, reply
    peer: str | None  # the receiver (on the sender's side) or the sender (the receiver's)
    attempt: int
    error: str | None  # why, for failures, dead letters and drops
    ids: tuple[str, ...] | None = None  # the messages of a segment it is about (``id`` is the
    #                                     segment's key); None: ``id`` alone


_tuple = tuple.__new__  # millions are made per run: skip the keyword-parsing __new__


def event(name: str, ts: int, mid: str, topic: str | None, kind: str | None, peer: str | None,
          attempt: int = 0, error: str | None = None, ids: tuple[str, ...] | list[str] | None = None) -> Event:
    """An ``Event``: the one place they are made. ``ids``: the messages of a segment it is
    about, when not ``mid`` alone (``mid`` is the segment's key)."""
    if ids is not None:
        # Kept when they are not ``mid`` alone: a segment cut for its receiver keeps its key
        # (``mid``) without that message, and the event is about the others.
        ids = tuple(ids) if len(ids) > 1 or (ids and ids[0] != mid) else None
    return _tuple(Event, (name, ts, mid, topic, kind, peer, attempt, error, ids))


JournalEvent = Event  # the name journal.py and the audit's docs use


def subscription_options(group: str | None, ordered: bool, limit: int | None) -> dict[str, Any]:
    """A subscription's options as stored in its records (and sent in SUBSCRIBE): only those
    set, so that a plain subscription's records are the same bytes as before they existed."""
    options: dict[str, Any] = {}
    if group is not None:
        options["group"] = group
    if ordered:
        options["ordered"] = True
    if limit is not None:
        options["limit"] = limit
    return options
