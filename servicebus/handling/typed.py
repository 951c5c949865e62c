"""Typed handlers: a handler whose payload parameter is annotated with a msgspec Struct, a
dataclass or a pydantic model gets the payload validated into that type. The annotation
is read once, when the handler registers; each message is converted once per handler run,
and one that does not validate raises ``InvalidPayload``: a dead letter ``invalid`` at once
(runner.py, as any ``Reject``), never a retry. Any other annotation, or none, gets the
payload as it was decoded.

The type checkers' half: ``every`` and ``handle`` are ``Registration``s, whose overloads
return the handler's own type (the handler given) or a decorator that keeps it.
"""

from __future__ import annotations

import functools
import inspect
import logging
import typing
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, overload

from ..errors import InvalidPayload
from ..model.records import Message
from ..wire.typed import converter, model_kind
from .policy import Backoff

__all__ = ["payload_type", "typed", "Registration", "registration"]

H = TypeVar("H", bound=Callable[[Any, Message], Any])
log = logging.getLogger("servicebus")


def payload_type(fn: Callable[..., Any]) -> type | None:
    """The model class ``fn``'s first parameter is annotated with, or None."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin, or a callable with no signature
        return None
    if not params or params[0].annotation is inspect.Parameter.empty:
        return None
    annotation = params[0].annotation
    if isinstance(annotation, str):  # postponed (``from __future__ import annotations``)
        target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else getattr(fn, "__call__", fn)
        try:
            annotation = typing.get_type_hints(target).get(params[0].name, annotation)
        except Exception as exc:  # noqa: BLE001 - unresolvable (a name defined later): untyped
            log.warning("the payload annotation %r of handler %s cannot be resolved (%s): it gets "
                        "the payload untyped", annotation, getattr(fn, "__qualname__", fn), exc)
            return None
    return annotation if model_kind(annotation) is not None else None


def typed(fn: Callable[..., Any]) -> tuple[Callable[..., Any], type | None]:
    """``fn`` as it runs (converting its payload first, when it is typed) and its type."""
    tp = payload_type(fn)
    if tp is None:
        return fn, None
    convert = converter(tp)

    @functools.wraps(fn)  # the same stable name (handlers.py derives it from the function)
    def run(payload: Any, message: Message) -> Any:
        try:
            value = convert(payload)
        except ValueError as exc:  # msgspec's and pydantic's ValidationError: the payload's fault
            raise InvalidPayload(f"ValidationError: {exc}") from exc
        # Anything else (a bug in a model's __post_init__ or validator) fails the run as the
        # handler's own exception would: retried, then a dead letter handler_failed.
        return fn(value, message)

    return run, tp


class Registration(Protocol):
    """``every`` / ``handle`` as type checkers see them: the handler keeps its type."""

    @overload
    def __call__(self, topic: str, handler: H, /, *, name: str | None = ..., timeout: float | None = ...,
                 max_attempts: int | None = ..., backoff: Backoff | None = ..., retry_on: Any = ...,
                 dead_letter_on: Any = ...) -> H: ...

    @overload
    def __call__(self, topic: str, handler: None = ..., /, *, name: str | None = ...,
                 timeout: float | None = ..., max_attempts: int | None = ...,
                 backoff: Backoff | None = ..., retry_on: Any = ...,
                 dead_letter_on: Any = ...) -> Callable[[H], H]: ...


def registration(method: Callable[..., Any]) -> Registration:
    """Mark a bus's ``every``/``handle`` (it is returned as it is): type checkers then see
    ``Registration``'s overloads, called on an instance."""
    return typing.cast(Registration, method)
