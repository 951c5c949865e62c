"""A row of the outbox table as a message: what its ``kind`` may be, and staging it in a
bus transaction, checked as ``publish``/``send`` check (or saying why it cannot be one).
"""

from __future__ import annotations

from typing import Any

from ..wire.payload import decode_payload

__all__ = ["EVENT", "COMMAND", "stage"]

EVENT, COMMAND = "event", "command"


def stage(tx: Any, row: Any) -> str | None:
    """Stage the message ``row`` holds in ``tx``; or, if it cannot be one, say why (nothing
    staged). Checked as ``publish``/``send`` check: what they refuse, a row cannot carry."""
    kind, payload, headers = row.kind, row.payload, row.headers
    if kind != EVENT and kind != COMMAND:
        return f"kind must be {EVENT!r} or {COMMAND!r}, not {str(kind)[:40]!r}"
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        return f"payload must be bytes (msgpack), not {type(payload).__name__}"
    try:
        value = decode_payload(bytes(payload))
    except Exception as exc:  # noqa: BLE001 - msgpack raises many types on junk
        return f"payload does not decode: {type(exc).__name__}: {exc}"
    if headers is not None:
        if not isinstance(headers, (bytes, bytearray, memoryview)):
            return f"headers must be bytes (msgpack) or NULL, not {type(headers).__name__}"
        try:
            headers = decode_payload(bytes(headers))
        except Exception as exc:  # noqa: BLE001
            return f"headers do not decode: {type(exc).__name__}: {exc}"
    try:
        if kind == COMMAND:
            tx.send(row.address, row.topic, value, ttl=row.ttl, headers=headers)
        else:
            tx.publish(row.topic, value, ttl=row.ttl, headers=headers)
    except (TypeError, ValueError) as exc:  # the checks' (BacklogFull and the like go on up)
        return str(exc)
    return None
