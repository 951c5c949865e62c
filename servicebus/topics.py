"""Topic names: validation (and, later, subject matching with ``*`` and ``>``)."""

from __future__ import annotations

__all__ = ["MAX_TOPIC_BYTES", "validate_topic"]

MAX_TOPIC_BYTES = 255

# Topics end up inside store keys (separated by NUL) and log lines, so control characters
# and whitespace are refused up front rather than escaped everywhere.
_FORBIDDEN = frozenset(chr(c) for c in range(0, 33)) | {"\x7f"}


def validate_topic(topic: object, what: str = "topic") -> str:
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
    return topic
