"""OpenTelemetry spans for messages (extra ``otel``: ``pip install 'servicebus[otel]'``).

With ``Bus(tracing=True)`` this hook is added to the bus: a publish or send runs in a
PRODUCER span and carries the W3C ``traceparent`` (and ``tracestate``) of that span in the
message's headers; a handler runs in a CONSUMER span whose parent is the context those
headers carry, so a trace goes from the publishing service to every handler, across
processes; what a handler publishes or sends in its transaction carries the handler's
span. Without the extra the headers still pass through untouched: a service that sets
``traceparent`` itself keeps it.

A handler's span says which run it is (``servicebus.attempt``: 1, then one more each retry
or crash rerun), which handler (``servicebus.handler``, its name) and how the run ended
(``servicebus.outcome``: handled, failed, rejected). A message that becomes a dead letter
gets a span of its own, ``deadletter <topic>``, in its trace beside the runs it ends (its
parent is the context the message carries), with the reason
(``servicebus.deadletter.reason``: handler_failed, rejected, handler_crashed, expired,
undecodable, invalid), the last attempt, the handler it is put down to and status ERROR: a message
that expired or crashed the process before any run ended has no other span to say so.
Attributes are in a ``servicebus.`` namespace of their own: OpenTelemetry's
``messaging.servicebus.*`` are Azure Service Bus's.
"""

from __future__ import annotations

import threading
from typing import Any

try:
    from opentelemetry import context, propagate, trace
except ImportError as exc:  # the extra is not installed
    raise ImportError("Bus(tracing=True) needs OpenTelemetry: pip install 'servicebus[otel]'") from exc

from ..model.records import Message
from .base import RUN_OUTCOMES, HandlerOutcome, Hook

__all__ = ["Tracing"]

_SYSTEM = "servicebus"
_OPERATION = {"event": "publish", "command": "send"}


class Tracing(Hook):
    """PRODUCER spans around publishes and sends, CONSUMER spans around handler runs."""

    def __init__(self, tracer: trace.Tracer | None = None) -> None:
        self.tracer = tracer if tracer is not None else trace.get_tracer("servicebus")
        # A publish and a handler run each begin and end on one thread: the span they
        # opened, and the context token to put back, wait here in between (a stack: a
        # handler may publish inside its own span).
        self._local = threading.local()

    def _stack(self) -> list[tuple[Any, Any]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _open(self, name: str, kind: trace.SpanKind, parent: Any, attributes: dict[str, Any]) -> None:
        span = self.tracer.start_span(name, context=parent, kind=kind, attributes=attributes)
        token = context.attach(trace.set_span_in_context(span))
        self._stack().append((span, token))

    def _close(self, error: BaseException | None) -> None:
        stack = self._stack()
        if not stack:
            return
        span, token = stack.pop()
        context.detach(token)
        if error is not None:
            span.record_exception(error)
            span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        span.end()

    def before_publish(self, kind: str, name: str) -> None:
        operation = _OPERATION.get(kind, kind)
        self._open(f"{operation} {name}", trace.SpanKind.PRODUCER, None,
                   {"messaging.system": _SYSTEM, "messaging.operation": operation,
                    "messaging.destination.name": name})

    def outgoing(self, kind: str, name: str, headers: dict[str, Any]) -> None:
        propagate.inject(headers)  # the current span: the publish's, or the handler's

    def after_publish(self, kind: str, name: str, error: BaseException | None) -> None:
        self._close(error)

    def before_handle(self, message: Message) -> None:
        self._open(f"process {message.topic}", trace.SpanKind.CONSUMER, _carried(message),
                   {"messaging.system": _SYSTEM, "messaging.operation": "process",
                    "messaging.destination.name": message.topic, "messaging.message.id": message.id,
                    "servicebus.attempt": message.attempt})

    def handler_outcome(self, outcome: HandlerOutcome) -> None:
        if outcome.outcome in RUN_OUTCOMES:  # called before after_handle: its span is open
            stack = self._stack()
            if stack:
                stack[-1][0].set_attributes({"servicebus.handler": outcome.handler,
                                             "servicebus.outcome": outcome.outcome})
        elif outcome.outcome == "deadlettered":
            message, reason = outcome.message, outcome.reason or "?"
            span = self.tracer.start_span(
                f"deadletter {message.topic}", context=_carried(message), kind=trace.SpanKind.INTERNAL,
                attributes={"messaging.system": _SYSTEM, "messaging.operation": "deadletter",
                            "messaging.destination.name": message.topic,
                            "messaging.message.id": message.id, "servicebus.attempt": message.attempt,
                            "servicebus.handler": outcome.handler,
                            "servicebus.deadletter.reason": reason})
            span.set_status(trace.Status(trace.StatusCode.ERROR,
                                         f"{reason}: {outcome.error}" if outcome.error else reason))
            span.end()

    def after_handle(self, message: Message, error: BaseException | None, seconds: float) -> None:
        self._close(error)


def _carried(message: Message) -> Any:
    """The trace context ``message``'s headers carry (the publisher's span), if any."""
    return propagate.extract({k: v for k, v in message.headers.items() if isinstance(v, str)})
