"""Topic names, and subscription patterns over them (NATS subject rules).

Topics are tokens separated by ``.``. In a pattern, the token ``*`` matches exactly one
token and ``>``, only as the last token, one or more: ``orders.*`` matches
``orders.created`` but not ``orders`` or ``orders.eu.created``; ``orders.>`` matches both
of the latter but not ``orders``. The tokens ``*`` and ``>`` are therefore reserved: a topic
that is published to may not contain them.
"""

from __future__ import annotations

from functools import lru_cache

__all__ = ["MAX_TOPIC_BYTES", "validate_topic", "validate_pattern", "is_pattern", "matches"]

WILDCARDS = ("*", ">")

MAX_TOPIC_BYTES = 255

# Topics end up inside store keys (separated by NUL) and log lines, so control characters
# and whitespace are refused up front rather than escaped everywhere.
_FORBIDDEN = frozenset(chr(c) for c in range(0, 33)) | {"\x7f"}


def validate_topic(topic: object, what: str = "topic", *, pattern: bool = False) -> str:
    """Return ``topic`` if it is a usable topic name, else raise ``ValueError``/``TypeError``."""
    if not isinstance(topic, str):
        raise TypeError(f"{what} must be a str, not {type(topic).__name__}")
    if not topic:
        raise ValueError(f"{what} must not be empty")
    size = len(topic.encode("utf-8", "surrogatepass"))
    if size > MAX_TOPIC_BYTES:
        raise ValueError(f"{what} is {size} bytes long; the limit is {MAX_TOPIC_BYTES}")
    bad = next((ch for ch in topic if ch in _FORBIDDEN), None)
    if bad is not None:
        raise ValueError(f"{what} {topic!r} contains a whitespace or control character ({bad!r})")
    if not pattern and ("*" in topic or ">" in topic) and any(t in WILDCARDS for t in topic.split(".")):
        raise ValueError(f"{what} {topic!r} contains a token '*' or '>': they are reserved for "
                         "subscription patterns")
    return topic


def validate_pattern(pattern: object, what: str = "topic") -> str:
    """A topic, or a pattern with ``*`` tokens and ``>`` as its last token."""
    validate_topic(pattern, what, pattern=True)
    assert isinstance(pattern, str)
    tokens = pattern.split(".")
    if ">" in tokens[:-1]:
        raise ValueError(f"{what} {pattern!r}: '>' may only be the last token")
    if is_pattern(pattern) and any(not t for t in tokens):
        raise ValueError(f"{what} {pattern!r}: a pattern has no empty tokens")
    return pattern


def is_pattern(topic: str) -> bool:
    return ("*" in topic or ">" in topic) and any(t in WILDCARDS for t in topic.split("."))


@lru_cache(maxsize=65536)  # few patterns and topics, each matched thousands of times
def matches(pattern: str, topic: str) -> bool:
    """Whether ``topic`` (no wildcards) falls under ``pattern``."""
    want, have = pattern.split("."), topic.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(have) == len(want)
