"""One exception root for everything the bus raises, grouped by cause.

Errors coming from pyzmq or plyvel are translated where they cross into this package and
raised ``from`` the original exception, so callers only ever need ``except BusError``.
"""

from __future__ import annotations

__all__ = [
    "BusError",
    "BusClosedError",
    "StoreError",
    "CorruptRecordError",
    "StoreWriteError",
    "BusBrokenError",
    "BusForkedError",
    "LockedError",
    "TransportError",
    "ProtocolError",
    "DeliveryError",
    "SubscribeTimeout",
    "SubscribeRefused",
    "BacklogFull",
    "WaitTimeout",
    "RemoteError",
    "RequestTimeout",
    "TransactionError",
    "Retry",
    "Reject",
    "InvalidPayload",
]


class BusError(Exception):
    """Root of every error raised by servicebus."""


class BusClosedError(BusError):
    """The bus is closed (or closing) and cannot take new work."""


class StoreError(BusError):
    """The data directory or its LevelDB store cannot be used (I/O, corruption, permissions)."""


class CorruptRecordError(StoreError):
    """A stored record does not decode as its keyspace's record: the store is damaged.
    ``keyspace`` and ``key`` say which; ``servicebus check --repair`` deals with it."""

    def __init__(self, message: str, keyspace: str, key: str) -> None:
        super().__init__(message)
        self.keyspace = keyspace
        self.key = key


class StoreWriteError(StoreError):
    """A write to the store failed (a full disk, an I/O error). Nothing of it was applied,
    and the store refuses every write after it until the bus has reopened it, which it does
    by itself once writing works again (``status().store_error`` says why meanwhile)."""


class BusBrokenError(BusError):
    """The bus cannot go on (its engine stopped on an error it could not get past). Every
    call after that raises this, naming the cause; unlike ``BusClosedError``, nobody asked
    for it. Close the bus and open it again (after fixing the cause)."""


class BusForkedError(BusError):
    """A ``Bus`` (or its store) was used in a ``fork()``ed child. Its threads, sockets and
    store handle stay with the parent; the child must open a bus of its own."""


class LockedError(BusError):
    """Another live process holds the data directory's lock."""

    def __init__(self, message: str, owner: dict | None = None) -> None:
        super().__init__(message)
        self.owner = owner or {}


class AdminUnavailable(BusError):
    """A live bus holds the data directory but did not answer on its admin endpoint."""


class AdminDenied(AdminUnavailable):
    """This user may not reach the live bus's admin endpoint: only the bus's own user and
    root may. ``path`` is the socket's folder (its owner is the bus's user)."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


class TransportError(BusError):
    """A socket could not be bound or used (address in use, bad address, ...)."""


class ProtocolError(BusError):
    """A frame did not follow the wire protocol; ``reason`` names what was wrong."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class DeliveryError(BusError):
    """A message could not be delivered or handled."""


class SubscribeTimeout(DeliveryError, TimeoutError):
    """A subscribe handshake was not confirmed within the time the caller waited.

    The intent stays stored and is retried; only the wait gave up.
    """


class SubscribeRefused(DeliveryError):
    """The publisher refused a subscribe (its address policy or peer limit); the message
    says why. The intent stays stored and is retried until confirmed or unsubscribed."""


class BacklogFull(DeliveryError):
    """A publish found a subscriber of its topic at ``max_backlog`` (policy ``raise``, or
    ``block`` past ``backlog_timeout``): nothing was stored; the message names the
    subscriber. Publish again later."""


class WaitTimeout(DeliveryError, TimeoutError):
    """``Bus.once``/``any``/``all``: the events waited for did not arrive in time."""


class RemoteError(DeliveryError):
    """A remote handler raised; ``remote_type`` and ``remote_message`` describe it."""

    def __init__(self, remote_type: str, remote_message: str) -> None:
        super().__init__(f"{remote_type}: {remote_message}")
        self.remote_type = remote_type
        self.remote_message = remote_message


class RequestTimeout(BusError, TimeoutError):
    """No reply arrived within the request's timeout."""


class TransactionError(BusError):
    """``message.kv``/``publish``/``send`` used where no handler's run can commit them: the
    message was not given to a handler by a bus, or its handler already returned."""


# --- raised by handlers, not by the bus -------------------------------------------------------


class Retry(Exception):
    """Raise in a handler to have the message run again after ``after`` seconds (default:
    the bus's backoff). It counts as a failed attempt: after ``max_attempts`` the message
    is a dead letter, so a handler cannot postpone it forever."""

    def __init__(self, reason: str = "retry requested", *, after: float | None = None) -> None:
        if after is not None and (isinstance(after, bool) or not isinstance(after, (int, float))
                                  or after < 0):
            raise ValueError(f"Retry(after=) must be seconds >= 0, got {after!r}")
        super().__init__(reason)
        self.after = after


class Reject(Exception):
    """Raise in a handler to make the message a dead letter at once (reason ``rejected``,
    with this text), without further attempts: input no retry will fix."""

    reason = "rejected"  # the dead letter's

    def letter_error(self) -> str:
        """The dead letter's error text."""
        return f"Reject: {self}"


class InvalidPayload(Reject):
    """A payload that does not validate against the type a handler's payload parameter is
    annotated with (a msgspec Struct, a dataclass, a pydantic model): a dead letter at once,
    reason ``invalid``, with the validation error. A handler may raise it too."""

    reason = "invalid"

    def letter_error(self) -> str:
        return str(self)
