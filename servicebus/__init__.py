"""servicebus: a brokerless, peer-to-peer, durable service bus for Python."""

import logging

from .aio import AsyncBus
from .bus import Bus
from .config import BusConfig
from .errors import (
    AdminUnavailable,
    BacklogFull,
    BusBrokenError,
    BusClosedError,
    BusError,
    BusForkedError,
    CorruptRecordError,
    DeliveryError,
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
from .records import BusStatus, DeadLetter, Message, PeerStatus
from .timeouts import HandlerTimeout

__all__ = [
    "Bus",
    "AsyncBus",
    "BusConfig",
    "Message",
    "BusStatus",
    "PeerStatus",
    "DeadLetter",
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
    "HandlerTimeout",
]

__version__ = "0.2.0.dev0"  # the one place: setup.cfg reads it (version = attr: ...)

logging.getLogger("servicebus").addHandler(logging.NullHandler())
