"""What a field may be, sans I/O: peer addresses, binds and subscriber group names (the
same rules for user input and for what arrives off the wire), and the checks ``decode``
runs on each field of a frame's header, with their bounds.

The ``validate_*`` functions raise ``TypeError``/``ValueError`` for a caller to show; the
field checks (``_str``, ``_ms``, ``_topic``, ...) raise ``ProtocolError`` with a reason
the engine counts; each returns its value as it came. Per message of a batch (20-40k a
second), ``decode`` runs most of these tests inline and calls a check only to raise.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import ProtocolError
from .topics import validate_pattern, validate_topic

from ..model.members import check_name

__all__ = [
    "MAX_ID_LEN",
    "MAX_NAME_LEN",
    "MAX_ADDRESS_LEN",
    "MAX_REASON_LEN",
    "MAX_MS",
    "MAX_ATTEMPT",
    "MAX_IPC_PATH_BYTES",
    "validate_address",
    "validate_target",
    "validate_bind",
    "validate_group",
]

MAX_ID_LEN = 64
MAX_NAME_LEN = 64
MAX_ADDRESS_LEN = 512
MAX_REASON_LEN = 4096
# What a message's times (ms since the epoch) and attempt number may be: below the year
# 10000, which a datetime (Message.sent, .expires, the CLI) cannot show, and far below
# what msgpack stores (2**64 - 1, which a TTL moved onto our clock passed); an attempt the
# audit reads as a 32-bit INT. The sender's own values are in range by far.
MAX_MS = 253_402_300_800_000
MAX_ATTEMPT = 2**31 - 1


# --- addresses, binds, groups --------------------------------------------------------------

_TCP = re.compile(r"^tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(?P<port>[0-9]{1,5})$")
_IPC = re.compile(r"^ipc://(?P<path>[^\x00-\x1f\x7f]+)$")
# A Unix socket path must fit sockaddr_un.sun_path (108 bytes with its NUL on Linux):
# libzmq refuses longer ones at connect(), which must never be where we find out.
MAX_IPC_PATH_BYTES = 107


def validate_target(target: object, *, what: str = "address") -> str:
    """An address, or a service name (``Bus(name=...)``, found by discovery)."""
    if isinstance(target, str) and "://" not in target:
        return check_name(target, f"{what} or service name")
    return validate_address(target, what=what)


def validate_address(address: object, *, what: str = "address") -> str:
    """Return a peer address (``tcp://host:port`` or ``ipc://path``) or raise ``ValueError``.

    Used on user input and on every address that arrives off the wire before any
    ``connect()``: junk would make libzmq raise, and a forged address must not point the
    bus at arbitrary endpoints in forms we never meant to support.
    """
    if not isinstance(address, str):
        raise ValueError(f"{what} must be a str, not {type(address).__name__}")
    if len(address) > MAX_ADDRESS_LEN:
        raise ValueError(f"{what} is longer than {MAX_ADDRESS_LEN} characters")
    match = _TCP.match(address)
    if match:
        port = int(match.group("port"))
        if not 1 <= port <= 65535:
            raise ValueError(f"{what} {address!r} has port {port}; expected 1-65535")
        if match.group("host") in ("*", "0.0.0.0", "[::]"):
            raise ValueError(f"{what} {address!r} is a wildcard; peers need a reachable host")
        return address
    match = _IPC.match(address)
    if match:
        size = len(match.group("path").encode("utf-8", "surrogatepass"))
        if size > MAX_IPC_PATH_BYTES:
            raise ValueError(f"{what} {address[:60]!r}...: an ipc path is at most "
                             f"{MAX_IPC_PATH_BYTES} bytes (the OS limit for socket paths), not {size}")
        return address
    raise ValueError(f"{what} {address!r} is not of the form tcp://host:port or ipc://path")


_BIND_TCP = re.compile(r"^tcp://(?P<host>\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(?P<port>\*|[0-9]{1,5})$")
_WILDCARD_HOSTS = {"*", "0.0.0.0", "[::]"}


def validate_bind(bind: object, advertise: str | None) -> None:
    """Check a bus's ``bind`` (``tcp://host:port``, ``*`` and port 0 allowed, or
    ``ipc://path``) and its ``advertise`` address; ``TypeError``/``ValueError`` if bad."""
    if not isinstance(bind, str):
        raise TypeError(f"bind must be a str, not {type(bind).__name__}")
    if bind.startswith("ipc://"):
        validate_address(bind, what="bind")
        return
    match = _BIND_TCP.match(bind)
    if not match:
        raise ValueError(f"bind {bind!r} is not of the form tcp://host:port or ipc://path")
    if match.group("host") in _WILDCARD_HOSTS and advertise is None:
        raise ValueError(f"bind {bind!r} listens on every interface; pass advertise= with the "
                         "address other buses should use to reach this one")
    if advertise is not None:
        validate_address(advertise, what="advertise")


_GROUP_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")


def validate_group(name: object) -> str:
    """A subscriber group's name: 1-64 of letters, digits, ``_ . -``; else an error."""
    if not isinstance(name, str):
        raise TypeError(f"group must be a str, not {type(name).__name__}")
    if not _GROUP_NAME.match(name):
        raise ValueError(f"group {name[:80]!r} must be 1-64 letters, digits, '_', '.' or '-'")
    return name


# --- a frame header's fields (decode's checks) ---------------------------------------------


def _str(value: Any, field: str, limit: int) -> str:
    if not isinstance(value, str) or not value or len(value) > limit:
        raise ProtocolError("bad_field", f"{field} must be a non-empty str of at most {limit}")
    return value


def _int(value: Any, field: str, minimum: int = 0) -> int:
    if type(value) is not int or value < minimum:
        raise ProtocolError("bad_field", f"{field} must be an int >= {minimum}")
    return value


def _ms(value: Any, field: str) -> int:
    if type(value) is not int or not 0 <= value < MAX_MS:
        raise ProtocolError("bad_field", f"{field} must be an int from 0 to {MAX_MS - 1} "
                            "(ms since the epoch, before the year 10000)")
    return value


def _attempt(value: Any) -> int:
    if type(value) is not int or not 1 <= value <= MAX_ATTEMPT:
        raise ProtocolError("bad_field", f"attempt must be an int from 1 to {MAX_ATTEMPT}")
    return value


def _headers(value: Any) -> dict[str, Any] | None:
    """A message's headers that are not a map: None, or refused."""
    if value is None:
        return None
    raise ProtocolError("bad_field", f"headers must be a map, not {type(value).__name__}")


_valid_topics: set[str] = set()  # a bus sees few distinct topics, each thousands of times


def _pattern(value: Any) -> str:
    """A SUBSCRIBE's topic: a topic or a pattern (topics.py)."""
    try:
        return validate_pattern(value)
    except (TypeError, ValueError) as exc:
        raise ProtocolError("bad_field", str(exc)) from exc


def _topic(value: Any) -> str:
    if type(value) is str and value in _valid_topics:  # junk may be unhashable
        return value
    try:
        topic = validate_topic(value)  # the same rules as for a topic given to the API
    except (TypeError, ValueError) as exc:
        raise ProtocolError("bad_field", str(exc)) from exc
    if len(_valid_topics) < 10_000:
        _valid_topics.add(topic)
    return topic


def _address(value: Any, field: str) -> str:
    try:
        return validate_address(value, what=field)
    except ValueError as exc:
        raise ProtocolError("bad_address", str(exc)) from exc


def _id(value: Any) -> str:
    if type(value) is not str or not value or len(value) > MAX_ID_LEN:
        raise ProtocolError("bad_id", f"id must be a non-empty str of at most {MAX_ID_LEN}")
    return value


