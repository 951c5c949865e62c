"""Retained streams and start positions (DESIGN.md section 8).

A publisher keeps a retained topic's events for ``retention`` seconds whether or not anyone
subscribes: they are stored in the topic's own event stream (``e:<topic>``, the stream an
exact subscription to it reads), which is then kept by age and size, not emptied once
every consumer acknowledged it. What a subscriber is still owed is never deleted for age or
size (its cursor holds it, as today): retention only adds to what is kept.

A subscription made with a ``start`` begins at that point of the stream instead of at its
end: ``"earliest"`` (everything retained), a time (``t:<ms>``: events published from then
on), or a message id (that message and the ones after it). It applies only when the
publisher creates the subscription; a repeat of the same subscribe (every start of the
subscriber makes one) changes nothing, so a replay happens once. A pattern subscription
with a start gets the retained events of every topic it matches copied into its stream
when it is created, in id (publish) order.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from ..wire.topics import is_pattern, matches, validate_pattern
from .delivery import stream_target

__all__ = ["Retention", "NO_RETENTION", "start_token", "start_floor", "check_retention", "ID_RE"]

ID_RE = re.compile(r"[0-9a-f]{24}~?")  # "~": a delayed message's (ids.py)
_TIME_RE = re.compile(r"t:[0-9]{1,15}")
_LAST_SECOND = 253402300799  # 9999-12-31T23:59:59Z


def check_retention(value: Any) -> dict[str, float] | None:
    """``Bus(retention=...)``: seconds for every topic, or {topic or pattern: seconds or
    None}; the checked form ({"*..." : seconds}: a number is every topic, as ``">"``)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError("option retention must be seconds, a dict of topic -> seconds, or None")
    if isinstance(value, (int, float)):
        if not value > 0 or value == float("inf"):
            raise ValueError(f"option retention must be > 0 seconds, got {value!r}")
        return {">": float(value)}
    if not isinstance(value, Mapping):
        raise TypeError("option retention must be seconds, a dict of topic -> seconds, or None")
    out: dict[str, float] = {}
    for topic, seconds in value.items():
        if not isinstance(topic, str):
            raise TypeError(f"option retention: topic {topic!r} must be a str")
        validate_pattern(topic)
        if seconds is None or seconds == 0:
            out[topic] = 0.0  # explicitly not retained (beats a broader pattern)
            continue
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0 \
                or seconds == float("inf"):
            raise ValueError(f"option retention[{topic!r}] must be seconds > 0 or None, got {seconds!r}")
        out[topic] = float(seconds)
    return out


class Retention:
    """Which topics are retained, for how long (ms): an exact rule first, then the
    patterns, the most specific (longest) first. Immutable; a topic's answer is cached."""

    def __init__(self, rules: Mapping[str, float] | None = None, max_bytes: int = 0) -> None:
        rules = dict(rules or {})
        self.rules = rules
        self.max_bytes = max_bytes
        self._exact = {t: int(s * 1000) for t, s in rules.items() if not is_pattern(t)}
        self._patterns = sorted(((t, int(s * 1000)) for t, s in rules.items() if is_pattern(t)),
                                key=lambda r: (-len(r[0]), r[0]))
        self._cache: dict[str, int] = {}
        # Seconds between sweeps by age and size: a fifth of the shortest retention, so that
        # an event is kept at most 20 % longer than asked, from 50 ms to 5 s.
        kept = [ms for ms in (*self._exact.values(), *(ms for _p, ms in self._patterns)) if ms]
        self.sweep_interval = min(5.0, max(0.05, min(kept) / 5000)) if kept else 5.0

    def __bool__(self) -> bool:
        return bool(self.rules)

    def ms(self, topic: str) -> int:
        """How long ``topic``'s events are kept (ms); 0: not retained."""
        found = self._cache.get(topic)
        if found is None:
            found = self._exact.get(topic)
            if found is None:
                found = next((ms for pattern, ms in self._patterns if matches(pattern, topic)), 0)
            if len(self._cache) < 10_000:
                self._cache[topic] = found
        return found


    def stream_ms(self, stream: str) -> int:
        """How long a retained topic's own event stream (any priority level) keeps its
        events; 0 for every other stream (commands, patterns, topics not retained)."""
        if not self.rules or not stream.startswith("e:"):
            return 0
        topic = stream_target(stream)
        return 0 if is_pattern(topic) else self.ms(topic)


NO_RETENTION = Retention()


def start_token(start: Any) -> str | None:
    """``subscribe(start=...)`` as it travels and is stored: None for "new" (the default),
    ``"earliest"``, ``"t:<ms>"`` for a datetime (aware) or a POSIX timestamp, or a message
    id. ``ValueError``/``TypeError`` for anything else."""
    if start is None or start == "new":
        return None
    if start == "earliest":
        return "earliest"
    if isinstance(start, datetime):
        if start.tzinfo is None:
            raise ValueError("start must be an aware datetime (with tzinfo), so that it means one instant")
        return f"t:{max(0, int(start.timestamp() * 1000))}"
    if isinstance(start, (int, float)) and not isinstance(start, bool):
        if not 0 <= start <= _LAST_SECOND:  # milliseconds given for seconds land far past it
            raise ValueError(f"start as a POSIX timestamp must be seconds from 0 to {_LAST_SECOND} "
                             f"(the year 9999), got {start!r}")
        return f"t:{int(start * 1000)}"
    if isinstance(start, str) and ID_RE.fullmatch(start):
        return start  # (a time travels as "t:<ms>", but is given as a datetime)
    raise ValueError(f"start must be 'new', 'earliest', a datetime, a POSIX timestamp or a "
                     f"message id (24 hex digits), not {start!r}")


def check_start(token: Any) -> str | None:
    """A start token off the wire or from a store, or None if it is not one."""
    if not isinstance(token, str):
        return None
    if token == "earliest" or ID_RE.fullmatch(token) or _TIME_RE.fullmatch(token):
        return token
    return None


def start_floor(token: str) -> str:
    """The cursor floor (every stream id <= it counts as read) a start token means."""
    if token == "earliest":
        return ""  # sorts before every id
    if token.startswith("t:"):
        return f"{int(token[2:]):012x}"  # below every id of that millisecond and later
    number = int(token[:24], 16)
    return f"{number - 1:024x}" if number else ""  # that id included
