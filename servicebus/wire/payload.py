"""Payloads and user headers as every receiver decodes them, sans I/O: what publish accepts.

A payload may hold what services send besides msgpack's own types (datetime, Decimal,
UUID, enums, dataclasses, msgspec Structs, pydantic models): typed.py lowers them, as the
packer meets them, to the plain values every receiver decodes.

``encode_payload`` and ``encode_headers`` check what they encode with the receiver's own
decode, so that nothing a receiver would refuse is ever sent (DESIGN rule 11); what they
refuse, a walk through the value explains (where in it, and why). ``decode_payload`` is
that decode, used wherever a payload is read back.
"""

from __future__ import annotations

import threading
from typing import Any

import msgpack

from ..model.packer import pack
from .typed import lower, lowerable

__all__ = ["encode_payload", "encode_headers", "header_bytes", "decode_payload"]

_unpackb = msgpack.unpackb
_CHECKED = (TypeError, ValueError, OverflowError)  # what msgpack raises on what it refuses
_local = threading.local()


def _pack_payload(payload: Any) -> bytes:
    """``pack`` with typed.py's ``lower`` for what msgpack does not pack itself (a thread's
    own ``Packer``: see packer.py). A plain payload never calls it."""
    try:
        packer = _local.packer
    except AttributeError:
        packer = _local.packer = msgpack.Packer(use_bin_type=True, default=lower)
    data: bytes = packer.pack(payload)
    return data


def encode_payload(payload: Any, what: str = "payload") -> bytes:
    """msgpack-encode a user payload that every receiver decodes, or raise ``TypeError``
    saying where in it (``what`` names its root) the problem is (DESIGN rule 11). The check is the receiver's own
    decode (msgpack's C unpacker, ~0.5 us for a small payload): what it refuses is what a
    receiver would refuse, e.g. a map keyed by a tuple (an array, unhashable once
    decoded). A walk through the payload, in Python, runs only to explain a refusal."""
    try:
        body = _pack_payload(payload)
        _unpackb(body, raw=False, strict_map_key=False)
    except _CHECKED as exc:
        raise TypeError(_refusal(payload, what, exc, strict_keys=False)) from exc
    return body


def encode_headers(headers: dict[str, Any]) -> bytes:
    """msgpack-encode a message's user headers as a receiver reads them (in the frame's
    header, where every map must have str or bytes keys), or raise ``TypeError`` saying
    where the problem is: a frame a receiver cannot read is dropped whole, and resent."""
    try:
        body = pack(headers)
        _unpackb(body, raw=False, strict_map_key=True)
    except _CHECKED as exc:
        raise TypeError(_refusal(headers, "headers", exc, strict_keys=True)) from exc
    return body


def header_bytes(headers: dict[str, Any] | None) -> int:
    """What a message's headers take in a frame's header part (0 for none): the sender
    counts them with its payload when it cuts frames."""
    return len(pack(headers)) if headers else 0


def decode_payload(body: bytes) -> Any:
    """A payload as every receiver decodes it (and ``encode_payload`` checks)."""
    return _unpackb(body, raw=False, strict_map_key=False)


# Containers msgpack nests, at most (its C packer and unpacker; measured on msgpack 1.x).
_MAX_NESTING = 1024
_INT_RANGE = "-2**63 to 2**64 - 1"


def _refusal(value: Any, root: str, exc: Exception, *, strict_keys: bool) -> str:
    """Why ``value`` cannot be sent, and where: the first problem msgpack meets."""
    try:
        found = _first_problem(value, root, strict_keys)
    except RecursionError:
        found = None
    # Should the walk miss what msgpack refused, msgpack's own words still say what.
    return found or f"{root} cannot be sent: {type(exc).__name__}: {exc}"


def _a(name: str) -> str:
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _step(key: Any) -> str:
    """``[key]`` as a path shows it: str keys in double quotes, as most people write them."""
    text = repr(key)
    if isinstance(key, str) and text.startswith("'") and '"' not in text:
        text = f'"{text[1:-1]}"'
    return f"[{text if len(text) <= 80 else text[:77] + '...'}]"


def _scalar_problem(value: Any, key: bool) -> str | None:
    """Why msgpack cannot pack a non-container (its checks, in its order), or None; worded
    to follow ``map key <value>`` (``key``) or ``<path>:``."""
    if value is None or isinstance(value, (bool, float, bytes, bytearray, memoryview)):
        return None
    if isinstance(value, int):
        if -(2**63) <= value < 2**64:
            return None
        where = "is an int" if key else f"int {_show(value)} is"
        return f"{where} out of msgpack's range ({_INT_RANGE})"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            where = "is a str with" if key else f"str {_show(value)} has"
            return (f"{where} a lone surrogate ({value[exc.start]!r} at {exc.start}), which "
                    "cannot be encoded as UTF-8")
        return None
    if isinstance(value, msgpack.ExtType) or type(value) is msgpack.Timestamp:
        return None
    if lowerable(value) and not key:  # typed.py's; a model's fields are walked (_first_problem)
        return None
    kind = _a(type(value).__name__)
    return f"is {kind}, which cannot be encoded with msgpack" if key else \
        f"{kind} cannot be encoded with msgpack"


def _key_problem(key: Any, strict_keys: bool) -> str | None:
    if isinstance(key, dict):  # a dict subclass with a __hash__: a plain dict once decoded
        return f"is {_a(type(key).__name__)} (a map); a receiver cannot decode it"
    if isinstance(key, tuple) and not isinstance(key, msgpack.ExtType):
        kind = "a tuple" if type(key) is tuple else f"{_a(type(key).__name__)} (a tuple)"
        return f"is {kind}; a receiver cannot decode it"  # an array: a list once decoded
    problem = _scalar_problem(key, True)
    if problem is None and strict_keys and not isinstance(key, (str, bytes)):
        return f"is {_a(type(key).__name__)}; a receiver reads header maps with str or bytes keys only"
    return problem


def _first_problem(value: Any, root: str, strict_keys: bool) -> str | None:
    """Walk ``value`` as msgpack packs it (depth first, in order) to the first thing it
    or a receiver refuses: ``path: what``. Iterative: payloads nest up to 1,024 deep."""
    stack: list[tuple[Any, str, int]] = [(value, root, 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, dict):
            children = []
            for key, child in item.items():
                problem = _key_problem(key, strict_keys)
                if problem is not None:
                    return f"{path}: map key {_show(key)} {problem}"
                children.append((child, path + _step(key)))
        elif isinstance(item, (list, tuple)) and not isinstance(item, msgpack.ExtType):
            children = [(child, f"{path}[{i}]") for i, child in enumerate(item)]
        elif lowerable(item) and not isinstance(item, (str, int, float)):
            try:
                lowered = lower(item)
            except TypeError as exc:
                return f"{path}: {_a(type(item).__name__)} cannot be encoded: {exc}"
            if isinstance(lowered, (dict, list)):
                stack.append((lowered, path, depth))
            continue
        else:
            problem = _scalar_problem(item, False)
            if problem is None:
                continue
            return f"{path}: {problem}"
        if depth >= _MAX_NESTING:
            path = path if len(path) <= 200 else f"{path[:100]}...{path[-100:]}"
            return (f"{path}: nested more than {_MAX_NESTING} deep (or a container holds "
                    "itself); msgpack refuses it")
        stack.extend((child, where, depth + 1) for child, where in reversed(children))
    return None

