"""The handler registry: which functions handle which (kind, topic), under stable names."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .protocol import Kind
from .records import Message

__all__ = ["Handler", "Handlers", "handler_name", "UNNAMED"]

Handler = Callable[[Any, Message], Any]
UNNAMED = "<handler>"  # the one handler of a topic, whose name never needs storing


def handler_name(handler: Handler) -> str | None:
    """A name for ``handler`` that is the same after a restart: module and qualified
    name. None when there is none (a ``functools.partial``, whose repr holds a memory
    address); a lambda's or a bound method's is stable but may be shared, which
    ``Handlers.add`` refuses when it matters."""
    if isinstance(handler, functools.partial):
        return None
    qualname = getattr(handler, "__qualname__", None)
    if qualname is None:  # a callable object: its class's __call__
        qualname = getattr(type(handler), "__qualname__", None)
    module = getattr(handler, "__module__", None) or getattr(type(handler), "__module__", "?")
    return None if qualname is None else f"{module}.{qualname}"


class Handlers:
    """(kind, topic) -> [(name, handler)]. Added to under the dispatcher's lock; read by
    workers without it (a dict lookup, and lists are replaced, never changed)."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[int, str], list[tuple[str, Handler]]] = {}

    def get(self, key: tuple[int, str]) -> list[tuple[str, Handler]] | None:
        return self._by_key.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def add(self, kind: Kind, topic: str, handler: Handler, name: str | None = None) -> tuple[int, str]:
        """Add ``handler``. With several handlers on one topic, the names of the ones that
        finished are stored with the message so that a restart reruns only the others:
        they must be stable across restarts and distinct, so a second handler on a topic
        needs every handler there to have one (``name=``, or a function's qualified
        name); ``ValueError`` otherwise. Returns the key it was added under."""
        if name is None:
            name = handler_name(handler)
        elif not isinstance(name, str) or not name.strip():
            raise ValueError(f"handler name must be a non-empty str, not {name!r}")
        key = (int(kind), topic)
        existing = self._by_key.get(key, [])
        if kind is Kind.COMMAND and existing:
            # A command has one owner: its handler's return value is the reply.
            raise ValueError(f"command {topic!r} already has a handler ({existing[0][0]})")
        if existing:
            names = [None if n == UNNAMED else n for n, _ in existing] + [name]
            if None in names or len(set(names)) != len(names):
                shown = ", ".join(n or "<no stable name>" for n in names)
                raise ValueError(
                    f"several handlers on {topic!r} need stable, distinct names ({shown}): "
                    "pass every(topic, handler, name=...)")
        self._by_key[key] = existing + [(name or UNNAMED, handler)]
        return key
