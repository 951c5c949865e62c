"""Testing helpers: ``StubBus`` for users' handler tests, loopback helpers, and in-memory
fakes (store, clock, network) that drive delivery cores without sockets or disks, and the
handler side's ``Runner`` (handling.py)."""

from .fakes import CoreNode, one_message, FakeBatch, FakeClock, FakeStore, Network, free_address, free_port, wait_until
from .handling import EventLog, FakePublisher, HandlingBatch, HandlingStore, RunnerRig
from .stub import Sent, StubBus
from .stubcalls import Drained
from .astub import AsyncStubBus

__all__ = ["one_message", "StubBus", "AsyncStubBus", "Drained", "Sent", "free_port", "free_address", "wait_until", "FakeClock", "FakeStore",
           "FakeBatch", "Network", "CoreNode", "HandlingStore", "HandlingBatch", "FakePublisher",
           "EventLog", "RunnerRig"]
