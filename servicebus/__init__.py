"""servicebus: a brokerless, peer-to-peer, durable service bus for Python."""

import logging

from .aio import AsyncBus
from .bus import Bus
from .model.config import BusConfig
from .errors import (
    AdminUnavailable,
    BacklogFull,
    BusBrokenError,
    BusClosedError,
    BusError,
    BusForkedError,
    CorruptRecordError,
    DeliveryError,
    InvalidPayload,
    LockedError,
    ProtocolError,
    RemoteError,
    Reject,
    RequestTimeout,
    TransactionError,
    Retry,
    StoreError,
    StoreWriteError,
    SubscribeRefused,
    SubscribeTimeout,
    TransportError,
    WaitTimeout,
)
from .hooks.base import HandlerOutcome, Hook
from .model.records import BusStatus, DeadLetter, Message, PeerStatus
from .model.stored import Event
from .handling.timeouts import HandlerTimeout

__all__ = [
    "Bus",
    "AsyncBus",
    "BusConfig",
    "Message",
    "BusStatus",
    "PeerStatus",
    "DeadLetter",
    "Hook",
    "Event",
    "HandlerOutcome",
    "BusError",
    "AdminUnavailable",
    "BusClosedError",
    "BusBrokenError",
    "BusForkedError",
    "StoreError",
    "StoreWriteError",
    "CorruptRecordError",
    "LockedError",
    "TransportError",
    "ProtocolError",
    "DeliveryError",
    "SubscribeRefused",
    "SubscribeTimeout",
    "BacklogFull",
    "WaitTimeout",
    "RemoteError",
    "RequestTimeout",
    "TransactionError",
    "Retry",
    "Reject",
    "InvalidPayload",
    "HandlerTimeout",
]



def __getattr__(name: str) -> object:
    # ``from servicebus import metrics`` (README): the Prometheus hook, imported on first use
    # since it needs the ``metrics`` extra.
    if name == "metrics":
        from .hooks import metrics

        return metrics
    raise AttributeError(f"module 'servicebus' has no attribute {name!r}")


__version__ = "0.2.0.dev0"  # the one place: setup.cfg reads it (version = attr: ...)

logging.getLogger("servicebus").addHandler(logging.NullHandler())
