"""``Outcome``: what one run of a message came to (runner.py's table has the rows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..model.records import Message
from ..model.stored import Event
from .transaction import Transaction

__all__ = ["Outcome"]


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
