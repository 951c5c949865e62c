"""Hooks: observers of a bus, called at fixed points, like dramatiq's middleware.

A hook is an object of a ``Hook`` subclass that overrides the methods it needs; every
method here does nothing. Give them to a bus with ``Bus(..., hooks=[MyHook()])``. The
bus's own journal, metrics, tracing and ``once/any/all`` waits are hooks too; yours come
after them. Methods named ``before_*`` are called in registration order, ``after_*`` (and
``detach``) in reverse, so that a hook's "after" sees the state its "before" left.

What happened to messages reaches ``events(batch, events)``: a list of ``Event`` records
(published, sent, acked, received, handled, failed, retried, deadlettered, expired,
dropped, replayed), once per write that makes them durable, with ``batch``, the write they
ride in. A hook may add its own records to that batch (the journal does: its events are
exactly as durable as the change they describe) and must do nothing slow: it runs on the
engine thread, a handler's worker or a publishing thread, inside the write. The default
``events`` hands each kind to a method of its name (``failed`` for ``handler_failed``;
``expired``, ``dropped``, ``deadlettered`` and ``replayed`` for both sides), once per batch.

What each handler's run came to, and what came of a message whose run failed, reaches
``handler_outcome`` with the handler's name and the topic or pattern it was registered on
(a ``HandlerOutcome``): what metrics and tracing count per handler.

A hook must not raise: an exception from it is logged, and the bus goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from ..model.records import BusStatus, Message
from ..model.stored import Event, Incoming

if TYPE_CHECKING:
    from ..store import Batch, Store

__all__ = ["Hook", "Hooks", "BusView", "Event", "HandlerOutcome", "RUN_OUTCOMES", "DEADLETTER_REASONS"]

log = logging.getLogger("servicebus")


class BusView(Protocol):
    """What a hook may read of the bus it is attached to."""

    address: str
    node_id: str
    datadir: Path

    @property
    def closed(self) -> bool: ...
    def counters(self) -> dict[str, int]: ...
    def status(self) -> BusStatus: ...
    @property
    def store(self) -> "Store": ...
    def handlers(self) -> list[tuple[str, str]]:
        """(topic or pattern, name) of every handler registered, as registered."""
        ...


# How one handler's run ends, and why a message a handler failed becomes a dead letter
# (handling/runner.py): the label values metrics export from the start, at zero.
RUN_OUTCOMES = ("handled", "failed", "rejected")
DEADLETTER_REASONS = ("handler_failed", "rejected", "handler_crashed", "expired", "undecodable", "invalid")


class HandlerOutcome(NamedTuple):
    """What ``Hook.handler_outcome`` is told: how one handler's run ended (``outcome``
    handled, failed or rejected, with ``seconds``), or what comes of a message after a
    failed run (retried, or deadlettered with ``reason``), put down to one handler."""

    outcome: str  # handled, failed, rejected (a run); retried, deadlettered (the message)
    message: Message  # its ``attempt``: the run's; for retried or deadlettered, the last one
    topic: str  # the topic or pattern the handler was registered on (message.topic: the message's)
    handler: str  # the handler's name (``every(..., name=)``, by default module.qualname)
    seconds: float | None = None  # a run's; None for retried and deadlettered
    reason: str | None = None  # deadlettered: one of DEADLETTER_REASONS
    error: str | None = None  # failed, rejected, retried, deadlettered: what was raised


# Event names -> the Hook method the default ``events`` hands them to.
_METHODS = {
    "published": "published", "sent": "sent", "acked": "acked", "received": "received",
    "handled": "handled", "handler_failed": "failed", "retried": "retried",
    "deadlettered": "deadlettered", "deadlettered_at_sender": "deadlettered",
    "expired": "expired", "expired_at_sender": "expired", "dropped": "dropped",
    "dropped_at_sender": "dropped", "replayed": "replayed", "replayed_at_sender": "replayed",
}


class Hook:
    """Override what you need; see the module docstring for when each is called."""

    # --- lifecycle -----------------------------------------------------------------------

    def attach(self, bus: BusView) -> None:
        """The bus opened (or this hook was added to an open one)."""

    def detach(self) -> None:
        """The bus is closing: its last writes are made; release what the hook holds."""

    # --- what happened to messages, per write ------------------------------------------------

    def events(self, batch: "Batch | None", events: Sequence[Event]) -> None:
        """``events`` become durable with ``batch``. Hands each kind to its method."""
        by: dict[str, list[Event]] = {}
        for event in events:
            method = _METHODS.get(event.name)
            if method is not None:
                by.setdefault(method, []).append(event)
        for method, evs in by.items():
            getattr(self, method)(batch, evs)

    def published(self, batch: "Batch | None", events: list[Event]) -> None:
        """Stored for a receiver (one event per message and receiver)."""

    def sent(self, batch: "Batch | None", events: list[Event]) -> None:
        """Sent to a receiver (again, for a resend: ``attempt`` says which)."""

    def acked(self, batch: "Batch | None", events: list[Event]) -> None:
        """A receiver acknowledged storing them."""

    def received(self, batch: "Batch | None", events: list[Event]) -> None:
        """Stored here, to be handled."""

    def handled(self, batch: "Batch | None", events: list[Event]) -> None:
        """Every handler returned."""

    def failed(self, batch: "Batch | None", events: list[Event]) -> None:
        """A handler raised (``error`` says what); it is retried or dead-lettered next."""

    def retried(self, batch: "Batch | None", events: list[Event]) -> None:
        """A retry is scheduled."""

    def deadlettered(self, batch: "Batch | None", events: list[Event]) -> None:
        """Moved to the dead letters, here or at the sender (``error``: why)."""

    def expired(self, batch: "Batch | None", events: list[Event]) -> None:
        """Its ttl passed before it was handled."""

    def dropped(self, batch: "Batch | None", events: list[Event]) -> None:
        """No longer owed and not delivered (superseded, purged, unsubscribed, a request
        that expired before it ran)."""

    def replayed(self, batch: "Batch | None", events: list[Event]) -> None:
        """A dead letter put back by an operator."""

    # --- on the caller's thread ----------------------------------------------------------------

    def before_publish(self, kind: str, name: str) -> None:
        """``Bus.publish``/``publish_many`` (kind "event", name the topic) or ``send`` and
        ``request`` (kind "command", name the command) starts."""

    def outgoing(self, kind: str, name: str, headers: dict[str, Any]) -> None:
        """A message is about to be stored for sending: add to its ``headers`` (a fresh
        dict) what receivers should see. Also for what a handler stages."""

    def after_publish(self, kind: str, name: str, error: BaseException | None) -> None:
        """The publish or send returned (``error``: what it raised, or None)."""

    def committed(self, callers: int) -> None:
        """A group commit made ``callers`` publishes durable with one fsync."""

    # --- on a handler's worker thread -----------------------------------------------------------

    def before_handle(self, message: Message) -> None:
        """A handler is about to run for ``message`` (each handler of it, each attempt)."""

    def after_handle(self, message: Message, error: BaseException | None, seconds: float) -> None:
        """That handler returned (``error`` None) or raised, after ``seconds``."""

    def handler_outcome(self, outcome: HandlerOutcome) -> None:
        """Per handler run, just before ``after_handle`` (its span, if traced, still open):
        handled, failed (it raised, or asked to ``Retry``) or rejected (``Reject``). Then,
        for a message that a run failed, before the write that records it: retried, or
        deadlettered and why, put down to the handler whose error the message keeps (the
        one that rejected it, the last one to fail); when no handler ran (it expired,
        crashed the process, does not decode), to the first of its handlers it had not
        been through. A message no handler is registered for is nobody's: not reported."""

    # --- on the engine thread -----------------------------------------------------------------

    def handed_off(self, items: Sequence[Incoming]) -> None:
        """Received messages are durable here and given to the handlers now."""


def _overrides(hook: Hook, name: str) -> bool:
    return getattr(type(hook), name) is not getattr(Hook, name)


class Hooks:
    """The hooks of one bus, in registration order. Calls reach only the hooks that
    override a method (a bus with none pays one attribute test per point). Replaced, never
    mutated: ``add`` may run while other threads call."""

    def __init__(self, hooks: Sequence[Hook] = ()) -> None:
        self._all: tuple[Hook, ...] = ()
        self._view: BusView | None = None
        for hook in hooks:
            self._check(hook)
        self._plan(tuple(hooks))

    @staticmethod
    def _check(hook: object) -> None:
        if not isinstance(hook, Hook):
            raise TypeError(f"a hook must be a servicebus.Hook, not {type(hook).__name__}")

    def _plan(self, hooks: tuple[Hook, ...]) -> None:
        def which(name: str) -> tuple[Hook, ...]:
            return tuple(h for h in hooks if _overrides(h, name) or (
                name == "events" and any(_overrides(h, m) for m in set(_METHODS.values()))))
        self._events = which("events")
        self._before_publish = which("before_publish")
        self._outgoing = which("outgoing")
        self._after_publish = tuple(reversed(which("after_publish")))
        self._committed = which("committed")
        self._before_handle = which("before_handle")
        self._after_handle = tuple(reversed(which("after_handle")))
        self._handed_off = which("handed_off")
        self._handler_outcome = which("handler_outcome")
        self._all = hooks
        # Read per message by the core and the runner: build events only when wanted.
        self.wanted = bool(self._events)
        self.around_publish = bool(self._before_publish or self._after_publish or self._outgoing)
        self.reporting = bool(self._handler_outcome)  # the runner names handlers only then
        self.around_handle = bool(self._before_handle or self._after_handle or self.reporting)
        self.committing = bool(self._committed)
        self.handing_off = bool(self._handed_off)

    def __iter__(self) -> Any:
        return iter(self._all)

    def attach(self, view: BusView) -> None:
        self._view = view
        for hook in self._all:
            hook.attach(view)

    def prepend(self, hook: Hook) -> None:
        """Put ``hook`` before the others (the journal: before the bus opens)."""
        self._check(hook)
        self._plan((hook, *self._all))

    def add(self, hook: Hook) -> None:
        """Add a hook (to an open bus: it is attached at once)."""
        self._check(hook)
        if self._view is not None:
            hook.attach(self._view)
        self._plan((*self._all, hook))

    def detach(self) -> None:
        for hook in reversed(self._all):
            try:
                hook.detach()
            except Exception:  # noqa: BLE001 - one hook must not keep the others from closing
                log.exception("hook %r failed to detach", hook)

    # --- the points -------------------------------------------------------------------------

    def events(self, batch: "Batch | None", events: Sequence[Event]) -> None:
        if events:
            for hook in self._events:
                _call(hook.events, batch, events)

    def before_publish(self, kind: str, name: str) -> None:
        for hook in self._before_publish:
            _call(hook.before_publish, kind, name)

    def outgoing(self, kind: str, name: str, headers: dict[str, Any] | None) -> dict[str, Any] | None:
        """``headers`` as the hooks would send them (a new dict if any hook adds to them)."""
        if not self._outgoing:
            return headers
        carrier = dict(headers or {})
        for hook in self._outgoing:
            _call(hook.outgoing, kind, name, carrier)
        return carrier or None

    def after_publish(self, kind: str, name: str, error: BaseException | None) -> None:
        for hook in self._after_publish:
            _call(hook.after_publish, kind, name, error)

    def committed(self, callers: int) -> None:
        for hook in self._committed:
            _call(hook.committed, callers)

    def before_handle(self, message: Message) -> None:
        for hook in self._before_handle:
            _call(hook.before_handle, message)

    def after_handle(self, message: Message, error: BaseException | None, seconds: float) -> None:
        for hook in self._after_handle:
            _call(hook.after_handle, message, error, seconds)

    def handed_off(self, items: Sequence[Incoming]) -> None:
        for hook in self._handed_off:
            _call(hook.handed_off, items)

    def handler_outcome(self, outcome: HandlerOutcome) -> None:
        for hook in self._handler_outcome:
            _call(hook.handler_outcome, outcome)


def _call(method: Callable[..., Any], *args: Any) -> None:
    try:
        method(*args)
    except Exception:  # noqa: BLE001 - an observer's defect must not stop the bus
        log.exception("hook %r raised", getattr(method, "__self__", method))
