"""``Outcome``: what one run of a message came to (runner.py's table has the rows), and
``settled``: telling the hooks what came of a message a run failed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..hooks.base import HandlerOutcome, Hooks
from ..model.records import Message
from ..model.stored import NO_RUNS, Event, Incoming
from ..wire.protocol import KIND_NAMES
from .handlers import Handlers
from .transaction import Transaction

__all__ = ["Outcome", "settled"]

_tuple = tuple.__new__


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one run of a message came to (the rows of the table above)."""

    kind: str
    attempts: int = 0
    reason: str | None = None  # dead: why (expired, rejected, handler_failed, ...)
    error: str | None = None  # the exception's type and text
    events: tuple[Event, ...] = ()  # written with the outcome
    done: tuple[str, ...] = ()  # failed: the handlers that finished (not rerun)
    retry_after: float | None = None  # failed: asked for by ``Retry(after=)``
    limit: int = 0  # failed: the runs it may have (its failed handlers' policies; 0: the bus's)
    delay: float | None = None  # failed: their backoff before the next run (None: the bus's)
    tx: Transaction | None = None  # handled, replied: what the last handler staged
    part: str = ""  # handled: that handler's name (keeps its outbox keys apart)
    reply: dict[str, Any] | None = None  # replied: the reply to send back
    message: Message | None = None
    handler: str | None = None  # failed, dead: the handler whose error it keeps, if one ran


def settled(hooks: Hooks, handlers: Handlers, what: str, item: Incoming, o: Outcome,
            ids: Sequence[str] | None = None) -> None:
    """Tell the hooks that message ``item`` (or the messages ``ids`` of segment ``item``)
    is ``what``: retried, or deadlettered (``o.reason``), put down to ``o.handler`` or, if
    no handler ran, to the first of its handlers it had not been through (hooks/base.py's
    ``Hook.handler_outcome``). Called before the write that records it."""
    if not hooks.reporting:
        return
    record = item.record
    found = handlers.get((record.kind, record.topic))
    if not found:
        return  # nobody's: a reply, a message no handler is registered for
    done = (item.runstate or NO_RUNS).done
    name = o.handler or next((n for n, _ in found if n not in done), found[0][0])
    topic = handlers.registered(record.kind, record.topic, name)
    reason = (o.reason or "handler_failed") if what == "deadlettered" else None
    kind = KIND_NAMES.get(record.kind, "event")
    for mid in ids or (item.id,):
        message = _tuple(Message, (mid, record.topic, record.sender, record.reply_to, record.sent,
                                   o.attempts, record.headers, kind, record.correlation_id,
                                   record.expires, None))
        hooks.handler_outcome(HandlerOutcome(what, message, topic, name, None, reason, o.error))
