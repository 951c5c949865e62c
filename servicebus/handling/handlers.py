"""The handler registry: which functions handle which (kind, topic), under stable names."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..wire.protocol import Kind
from ..model.records import Message
from ..wire.topics import is_pattern, matches
from .policy import Policy

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
    """(kind, topic) -> [(name, handler)]: the topic's own handlers, then those of every
    pattern (``orders.*``, topics.py) it matches. Added to under the dispatcher's lock; read
    by workers without it (dict lookups; lists and dicts are replaced, never changed)."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[int, str], list[tuple[str, Handler]]] = {}
        self._patterns: list[tuple[int, str]] = []  # keys of pattern handlers
        self._resolved: dict[tuple[int, str], list[tuple[str, Handler]] | None] = {}
        # (kind, registered topic or pattern, name) -> its own retry policy (policy.py). A
        # name is distinct among the handlers that run for a topic, so (kind, topic, name)
        # finds one registration.
        self._policies: dict[tuple[int, str, str], Policy] = {}
        # (kind, topic or pattern, name) -> the model its payload is validated into (typed.py)
        self._types: dict[tuple[int, str, str], type] = {}

    def policy(self, kind: int, topic: str, name: str) -> Policy | None:
        """The policy of handler ``name`` as it runs for ``topic``, or None (the bus's)."""
        policies = self._policies
        if not policies:
            return None
        found = policies.get((kind, topic, name))
        if found is not None:
            return found
        for k, pattern in self._patterns:
            if k == kind and matches(pattern, topic):
                found = policies.get((kind, pattern, name))
                if found is not None:
                    return found
        return None

    def limit(self, kind: int, topic: str, default: int) -> int:
        """Runs a message of ``topic`` may have begun: the largest ``max_attempts`` of its
        handlers (a crash ends every handler's run, so none is cut short of its own)."""
        if not self._policies:
            return default
        limits = [default]
        for name, _ in self.get((kind, topic)) or ():
            policy = self.policy(kind, topic, name)
            limits.append(default if policy is None else policy.limit(default))
        return max(limits[1:] or limits)

    def get(self, key: tuple[int, str]) -> list[tuple[str, Handler]] | None:
        if not self._patterns:
            return self._by_key.get(key)
        resolved = self._resolved
        try:
            return resolved[key]
        except KeyError:
            pass
        found = list(self._by_key.get(key, ()))
        for kind, pattern in self._patterns:
            if kind == key[0] and pattern != key[1] and matches(pattern, key[1]):
                found += self._by_key[(kind, pattern)]
        if len(resolved) < 10_000:
            resolved[key] = found or None
        return found or None

    def __contains__(self, key: object) -> bool:
        return self.get(key) is not None  # type: ignore[arg-type]

    def add(self, kind: Kind, topic: str, handler: Handler, name: str | None = None, *,
            derived: str | None = None, policy: Policy | None = None,
            payload: type | None = None) -> tuple[int, str]:
        """Add ``handler``. With several handlers on one topic, the names of the ones that
        finished are stored with the message so that a restart reruns only the others:
        they must be stable across restarts and distinct. ``name`` is the caller's own and
        must be free; without it the name is ``derived`` (the user's function's module and
        qualified name, ``handler_name``) ``@topic``: the same whatever else is registered,
        and distinct across topics and patterns. Only a real clash
        raises ``ValueError``: two handlers of one topic with no stable, distinct names (two
        lambdas, or one function twice). ``payload``: the model it validates payloads into
        (typed.py; for ``described``). Returns the key it was added under."""
        if name is None:
            # Always with its topic: a derived name must not depend on what else is
            # registered (a deploy that adds a handler elsewhere would rename this one).
            name = derived if derived is not None else handler_name(handler)
            if name is not None:
                name = f"{name}@{topic}"
        elif not isinstance(name, str) or not name.strip():
            raise ValueError(f"handler name must be a non-empty str, not {name!r}")
        key = (int(kind), topic)
        existing = self._by_key.get(key, [])
        if kind is Kind.COMMAND and existing:
            # A command has one owner: its handler's return value is the reply.
            raise ValueError(f"command {topic!r} already has a handler ({existing[0][0]})")
        wildcard = is_pattern(topic)
        if wildcard or self._patterns:
            # A topic's handlers and those of the patterns it matches run as one list, whose
            # finished names are stored: every name must be stable and distinct, across keys.
            here = {n for n, _ in existing}
            elsewhere = {n for k, hs in self._by_key.items() if k[0] == int(kind) and k != key for n, _ in hs}
            if name is None or name in here or name in elsewhere:
                raise ValueError(
                    f"with pattern handlers, each handler needs a stable name no other handler "
                    f"has ({name or '<no stable name>'} on {topic!r}): pass every(topic, handler, name=...)")
        if existing:
            names = [None if n == UNNAMED else n for n, _ in existing] + [name]
            if None in names or len(set(names)) != len(names):
                shown = ", ".join(n or "<no stable name>" for n in names)
                raise ValueError(
                    f"several handlers on {topic!r} need stable, distinct names ({shown}): "
                    "pass every(topic, handler, name=...)")
        self._by_key = {**self._by_key, key: existing + [(name or UNNAMED, handler)]}
        if policy is not None:
            self._policies = {**self._policies, (int(kind), topic, name or UNNAMED): policy}
        if payload is not None:
            self._types = {**self._types, (int(kind), topic, name or UNNAMED): payload}
        if wildcard and key not in self._patterns:
            self._patterns = [*self._patterns, key]
        self._resolved = {}
        return key

    def registered(self, kind: int, topic: str, name: str) -> str:
        """The topic or pattern handler ``name`` handles ``topic`` under. A name is unique
        among a topic's handlers and, once there are patterns, among all of a kind's."""
        if any(n == name for n, _ in self._by_key.get((kind, topic), ())):
            return topic
        for key in self._patterns:
            if key[0] == kind and any(n == name for n, _ in self._by_key[key]):
                return key[1]
        return topic

    def described(self) -> list[tuple[int, str, str, type | None]]:
        """(kind, topic or pattern, name, payload model or None) of every handler."""
        return [(kind, topic, name, self._types.get((kind, topic, name)))
                for (kind, topic), hs in self._by_key.items() for name, _ in hs]

    def names(self) -> list[tuple[str, str]]:
        """(topic or pattern, name) of every handler, as registered."""
        return [(topic, name) for (_kind, topic), hs in self._by_key.items() for name, _ in hs]
