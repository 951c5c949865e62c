"""OpenTelemetry spans for messages (extra ``otel``: ``pip install 'servicebus[otel]'``).

With ``Bus(tracing=True)`` a publish or send runs in a PRODUCER span and carries the W3C
``traceparent`` (and ``tracestate``) of that span in the message's headers; a handler runs
in a CONSUMER span whose parent is the context those headers carry, so a trace goes from
the publishing service to every handler, across processes. Without the extra the headers
still pass through untouched: a service that sets ``traceparent`` itself keeps it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

try:
    from opentelemetry import propagate, trace
except ImportError as exc:  # the extra is not installed
    raise ImportError("Bus(tracing=True) needs OpenTelemetry: pip install 'servicebus[otel]'") from exc

from ..handling.handlers import Handler
from ..model.records import Message

__all__ = ["tracer", "producing", "consuming", "current_context"]

_SYSTEM = "servicebus"


def tracer() -> trace.Tracer:
    return trace.get_tracer("servicebus")


@contextmanager
def producing(tracer: trace.Tracer, operation: str, destination: str,
              headers: dict[str, Any] | None) -> Iterator[dict[str, Any]]:
    """A PRODUCER span around a publish or send; yields the headers to send, with the
    span's context injected (``traceparent``, ``tracestate``)."""
    with tracer.start_as_current_span(f"{operation} {destination}", kind=trace.SpanKind.PRODUCER,
                                      attributes={"messaging.system": _SYSTEM,
                                                  "messaging.operation": operation,
                                                  "messaging.destination.name": destination}):
        carrier = dict(headers or {})
        propagate.inject(carrier)
        yield carrier


def current_context(headers: dict[str, Any] | None) -> dict[str, Any]:
    """``headers`` with the current span's context in them: what a handler publishes or
    sends in its transaction continues the handler's trace."""
    carrier = dict(headers or {})
    propagate.inject(carrier)
    return carrier


def consuming(tracer: trace.Tracer, handler: Handler) -> Handler:
    """``handler``, run in a CONSUMER span that continues the trace its message carries."""
    @functools.wraps(handler)
    def traced(payload: Any, message: Message) -> Any:
        context = propagate.extract({k: v for k, v in message.headers.items() if isinstance(v, str)})
        with tracer.start_as_current_span(
                f"process {message.topic}", context=context, kind=trace.SpanKind.CONSUMER,
                attributes={"messaging.system": _SYSTEM, "messaging.operation": "process",
                            "messaging.destination.name": message.topic,
                            "messaging.message.id": message.id}):
            return handler(payload, message)
    return traced
