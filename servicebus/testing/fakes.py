"""Helpers shared by the test suite and by users testing their own services: ``StubBus``
(an in-memory bus for testing handlers, stub.py; the ``stub_bus`` pytest fixture is in
pytest_plugin.py), free ports, ``wait_until``, and the sans-IO network of cores."""

from __future__ import annotations

import msgpack

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..model.clock import BusClock
from ..model.config import BusConfig
from ..core import Core, Incoming, Published, SendCmd, SubscribeCmd
from ..model.ids import IdGenerator
from ..model.outgoing import stage_publish
from ..model.segments import bodies_of, make_blob
from ..model.stored import DeliveryRecord, IncomingRecord, IntentRecord, OutboxSend, ReplyRecord, SubscriptionRecord
from ..wire.payload import decode_payload, encode_payload
from ..wire.decoding import decode
from ..wire.protocol import Envelope, encode_ack
from .stub import Sent, StubBus

__all__ = ["one_message", "StubBus", "Sent", "free_port", "free_address", "wait_until", "FakeClock", "FakeStore",
           "FakeBatch", "Network", "CoreNode"]

T = TypeVar("T")


def one_message(mid: str, topic: str, sent: int, body: bytes, attempt: int = 1,
                expires: int | None = None, correlation_id: str | None = None,
                headers: dict[str, Any] | None = None) -> Envelope:
    """A segment of one message, as a frame carries it: for tests that write frames by hand
    (``body``: the message's msgpack payload)."""
    return Envelope(mid, topic, sent, make_blob([body]), attempt, expires, correlation_id, headers, (mid,))
_pause = threading.Event().wait


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.02,
               message: str | Callable[[], str] = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy; raise AssertionError at the
    deadline, with ``message`` (a callable is evaluated then, to show the final state)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            raise AssertionError(f"timed out after {timeout}s waiting for {text}")
        # An Event's timed wait, not time.sleep: Python 3.11's sleep uses an absolute
        # clock_nanosleep that libfaketime 0.9.10 breaks (EINVAL) for processes whose clock
        # tests move while leaving the monotonic clock alone (wolfcw/libfaketime#426).
        _pause(interval)


class FakeClock(BusClock):
    """A clock that moves only when told to (``advance``): the bus clock (``now``, ms),
    the monotonic clock (``monotonic``, s) and the wall clock (``wall_ms``) move together."""

    def __init__(self, start_ms: int = 0, wall_ms: int = 1_700_000_000_000) -> None:
        super().__init__(start_ms)
        self.ms = start_ms
        self.mono = 1000.0
        self.wall = wall_ms

    def now(self) -> int:
        return self.ms

    def monotonic(self) -> float:
        return self.mono

    def wall_ms(self) -> int:
        return self.wall

    def advance(self, seconds: float) -> None:
        self.ms += int(seconds * 1000)
        self.mono += seconds
        self.wall += int(seconds * 1000)


# --- an in-memory store, and cores joined by an in-memory network ---------------------------


class FakeBatch:
    """The core's ``WriteBatch``, recorded as operations a ``FakeStore`` applies at once."""

    def __init__(self) -> None:
        self.ops = 0
        self.sync = False
        self.log: list[tuple[str, tuple]] = []

    def _op(self, name: str, *args: object) -> None:
        self.log.append((name, args))
        self.ops += 1

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name.startswith(("put_", "delete_", "forget_")):
            return lambda *args: self._op(name, *args)
        raise AttributeError(name)


class FakeStore:
    """What a core reads and writes, in dictionaries: only written batches are kept, so a
    new core on the same ``FakeStore`` is a process restarted after a crash."""

    def __init__(self) -> None:
        self.subs: dict[tuple[str, str], SubscriptionRecord] = {}
        self.intent: dict[tuple[str, str], IntentRecord] = {}
        self.streams: dict[str, dict[str, bytes]] = {}
        self.delivery: dict[tuple[str, str], DeliveryRecord] = {}
        self.incoming: dict[str, IncomingRecord] = {}
        self.handled: dict[str, int] = {}
        self.letters: dict[str, dict] = {}
        self.reply: dict[str, ReplyRecord] = {}
        self.sends: dict[str, OutboxSend] = {}
        self.metas: dict[str, object] = {}
        self.writes = self.fsyncs = 0

    def batch(self) -> FakeBatch:
        return FakeBatch()

    def write(self, batch: FakeBatch, *, sync: bool) -> None:
        for name, args in batch.log:
            getattr(self, "_" + name)(*args)
        self.writes += 1
        self.fsyncs += sync

    # writes, by the batch method they apply
    def _put_subscription(self, sub: str, topic: str, rec: SubscriptionRecord) -> None: self.subs[(sub, topic)] = rec
    def _delete_subscription(self, sub: str, topic: str) -> None: self.subs.pop((sub, topic), None)
    def _put_intent(self, pub: str, topic: str, rec: IntentRecord) -> None: self.intent[(pub, topic)] = rec
    def _delete_intent(self, pub: str, topic: str) -> None: self.intent.pop((pub, topic), None)
    def _put_outgoing(self, stream: str, mid: str, rec: bytes) -> None: self.streams.setdefault(stream, {})[mid] = rec
    def _put_delivery(self, peer: str, stream: str, rec: DeliveryRecord) -> None: self.delivery[(peer, stream)] = rec
    def _delete_delivery(self, peer: str, stream: str) -> None: self.delivery.pop((peer, stream), None)
    def _put_incoming(self, mid: str, rec: IncomingRecord) -> None: self.incoming[mid] = rec
    def _delete_reply(self, mid: str) -> None: self.reply.pop(mid, None)
    def _delete_outbox(self, key: str) -> None: self.sends.pop(key, None)
    def _forget_handled(self, mid: str, at: int) -> None: self.handled.pop(mid, None)
    def _put_deadletter(self, mid: str, rec: dict) -> None: self.letters[mid] = rec
    def _put_clock(self, clock: BusClock) -> None: self.metas["clock"] = clock.now()
    def _put_meta(self, name: str, value: bytes) -> None: self.metas[name] = msgpack.unpackb(value)

    def meta(self, name: str) -> Any:
        return self.metas.get(name)

    def _delete_outgoing(self, stream: str, mid: str) -> None:
        self.streams.get(stream, {}).pop(mid, None)
        if not self.streams.get(stream, True):
            del self.streams[stream]

    def complete(self, mid: str, at: int) -> None:
        """What a handler finishing does: the message moves from incoming to handled."""
        del self.incoming[mid]
        self.handled[mid] = at

    # the core's StoreView
    def subscriptions(self) -> list[tuple[str, str, SubscriptionRecord]]:
        return [(a, b, r) for (a, b), r in self.subs.items()]

    def intents(self) -> list[tuple[str, str, IntentRecord]]:
        return [(a, b, r) for (a, b), r in self.intent.items()]

    def deliveries(self) -> list[tuple[str, str, DeliveryRecord]]:
        return [(a, b, r) for (a, b), r in self.delivery.items()]

    def replies(self) -> list[tuple[str, ReplyRecord]]:
        return list(self.reply.items())

    def outbox(self) -> list[tuple[str, OutboxSend]]:
        return sorted(self.sends.items())

    def has_outbox(self, key: str) -> bool:
        return key in self.sends

    def stream_names(self) -> list[str]:
        return sorted(name for name, msgs in self.streams.items() if msgs)

    def highest_own_id(self) -> str | None:
        """As ``Store.highest_own_id``: what a restarted core's ids must sort above."""
        found = [mid for msgs in self.streams.values() for mid in msgs if len(mid) != 25]
        found += [r.get("floor") or "" for r in self.delivery.values()]
        found += [r.get("since") or "" for r in self.subs.values()]
        found += [r.get("id") or "" for r in self.intent.values()]
        return max(found, default=None) or None

    def stream_ids(self, stream: str, after: str | None = None, upto: str | None = None,
                   limit: int | None = None) -> list[str]:
        ids = [mid for mid in sorted(self.streams.get(stream, {}))
               if (after is None or mid > after) and (upto is None or mid <= upto)]
        return ids[:limit]

    def iter_stream(self, stream: str, after: str | None = None,
                    limit: int | None = None) -> list[tuple[str, bytes]]:
        return [(mid, self.streams[stream][mid]) for mid in self.stream_ids(stream, after, limit=limit)]

    def key_at_or_before(self, stream: str, message_id: str) -> str | None:
        return max((k for k in self.streams.get(stream, {}) if k <= message_id), default=None)

    def get_outgoing(self, stream: str, message_id: str) -> bytes | None:
        return self.streams.get(stream, {}).get(message_id)

    def seen_many(self, message_ids: list[str]) -> list[bool]:
        return [m in self.incoming or m in self.handled or m in self.letters for m in message_ids]

    def publish_keys_before(self, cutoff: int, limit: int) -> list[tuple[str, int]]:
        return []  # the core's tests publish without dedupe keys

    def handled_before(self, cutoff: int, limit: int) -> list[tuple[str, int]]:
        return sorted(((m, at) for m, at in self.handled.items() if at < cutoff), key=lambda x: x[1])[:limit]


class Network:
    """Cores joined in memory, the way their sockets join them: a node's frames to an
    address land in that node's ROUTER inbox; ROUTER replies land in the sender's inbox
    for that address. ``lose`` decides, frame by frame, what the network drops."""

    def __init__(self, clock: FakeClock | None = None, **config: Any) -> None:
        self.clock = clock or FakeClock()
        self.config = BusConfig.of(config)
        self.nodes: dict[str, CoreNode] = {}
        self.lose: Callable[[str, str, Any], bool] = lambda src, dst, frame: False
        self.log: list[tuple[str, str, Any]] = []  # (from, to, decoded frame), all that left

    def node(self, name: str, store: FakeStore | None = None) -> CoreNode:
        """A node at ``ipc://<name>`` (``name`` itself if it is an address)."""
        address = name if "://" in name else f"ipc://{name}"
        node = CoreNode(self, address, store or FakeStore())
        self.nodes[address] = node
        return node

    def deliver(self, src: str, dst: str, frames: list[bytes], reply: bool) -> bool:
        """False when nothing listens at ``dst`` (a send to it fails, as with IMMEDIATE)."""
        node = self.nodes.get(dst)
        if node is None or not node.running:
            return False
        frame = decode(frames, max_payload=self.config.max_payload)
        self.log.append((src, dst, frame))
        if not self.lose(src, dst, frame):
            node.inbox.append((src, frame, reply))
        return True

    def run(self, until: Callable[[], object] | None = None, *, seconds: float = 10.0,
            step: float = 0.01) -> None:
        """Turn every running node until ``until()`` holds (AssertionError if it does not
        within ``seconds`` of fake time), or, without ``until``, for ``seconds``; the clock
        moves ``step`` after each round."""
        deadline = self.clock.mono + seconds
        while True:
            for node in list(self.nodes.values()):
                if node.running:
                    node.turn()
            if until is not None and until():
                return
            if self.clock.mono >= deadline:
                if until is None:
                    return
                raise AssertionError(f"not reached within {seconds}s of fake time")
            self.clock.advance(step)

    def sent(self, src: str, dst: str, kind: type) -> list[Any]:
        return [f for s, d, f in self.log if s == src and d == dst and isinstance(f, kind)]


def _source(address: str) -> str:
    """What ZeroMQ's Peer-Address would say of a frame from ``address``: its host for TCP,
    ``localhost:UID:GID:PID`` (this process's user) for a Unix socket."""
    if address.startswith("tcp://"):
        return address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return f"localhost:{os.getuid()}:{os.getgid()}:{os.getpid()}"


class CoreNode:
    """One bus in a ``Network``: a ``Core`` on a ``FakeStore``, turned like the engine
    turns it (DESIGN.md section 9), with handlers that complete what they are handed."""

    def __init__(self, net: Network, address: str, store: FakeStore) -> None:
        self.net, self.address, self.store = net, address, store
        self.inbox: list[tuple[str, Any, bool]] = []  # (from, frame, is a reply to our DEALER)
        self.released: list[tuple[Any, Any]] = []
        self.handled: list[Incoming] = []
        self.running = False
        self.start()

    def start(self) -> None:
        """Start (again) on what the store holds, with a new boot id: a restart."""
        clock = self.net.clock
        self.core = Core(config=self.net.config, store=self.store, links=self, batch=self.store.batch(),
                         address=self.address, node_id=self.address, boot=os.urandom(6).hex(),
                         ids=IdGenerator(after=self.store.highest_own_id(), wall=clock.wall_ms, monotonic=clock.monotonic), clock=clock, wall=clock.wall_ms,
                         now=clock.monotonic(), uid=os.getuid())
        self.commands: list[Any] = list(self.core.load())
        self.inbox.clear()  # what the dead process had not read is gone with it
        self.running = True

    def stop(self) -> None:
        """Die: what was not written is lost, and nothing listens here until ``start``."""
        self.running = False
        self.inbox.clear()

    # the core's Links: every address in memory can be connected, but "ipc://bad..." ones
    def connect(self, address: str) -> None:
        if address.startswith("ipc://bad"):
            raise ValueError(f"cannot connect to {address}")

    def forget(self, address: str) -> None:
        pass

    # what user threads do
    def publish(self, topic: str, *payloads: Any, priority: int = 0) -> list[str]:
        """One publish of ``payloads`` (one segment, or several of at most ``max_batch``
        messages, as the bus's publisher cuts them); their ids."""
        batch = self.store.batch()
        bodies = [encode_payload(p) for p in payloads]
        ids, streams, _events = stage_publish(batch, self.core.s.routes, self.core.s.ids, self.net.clock.wall_ms(),
                                              topic, bodies, priority=priority,
                                              max_count=self.net.config.max_batch)
        self.store.write(batch, sync=True)
        self.commands.extend(Published(stream, items) for stream, items in streams)
        return ids

    def subscribe(self, publisher: str, topic: str, op: str = "subscribe", group: str | None = None,
                  ordered: bool = False) -> object:
        confirmed = object()
        self.commands.append(SubscribeCmd(publisher, topic, op, object(), confirmed, group, ordered))
        return confirmed

    def send(self, address: str, command: str, payload: Any, ttl: float | None = None) -> None:
        expires = None if ttl is None else self.net.clock.wall_ms() + int(ttl * 1000)
        self.commands.append(SendCmd(address, command, encode_payload(payload), expires, None,
                                     None, object()))

    def payloads(self) -> list[Any]:
        """What the handlers were handed, in order."""
        return [decode_payload(body) for item in self.handled for body in bodies_of(item.record.blob)]

    def handled_ids(self) -> list[str]:
        """The ids of the messages the handlers were handed, in order (``handled`` holds
        segments: their keys are their first messages' ids)."""
        return [mid for item in self.handled for mid in item.record.ids]

    def turn(self) -> None:
        core, now = self.core, self.net.clock.monotonic()
        inbox, self.inbox = self.inbox, []
        for src, frame, reply in inbox:
            if reply:
                core.on_dealer(src, frame, now)
            else:
                core.on_router(src.encode(), frame, now, _source(src))
        for ident, frames in core.take_router_frames():
            self.net.deliver(self.address, ident.decode(), frames, reply=True)
        commands, self.commands = self.commands, []
        for cmd in commands:
            core.command(cmd, now)
        out = core.prepare(now)
        batch = out.batch
        if batch.ops or batch.sync:
            self.store.write(batch, sync=batch.sync)  # type: ignore[arg-type]
            batch = self.store.batch()
        done = core.committed(batch)
        self.released.extend(done.release)
        for item in done.handoff:  # the handlers run at once, and succeed
            self.handled.append(item)
            self.store.complete(item.id, self.net.clock.now())
        for ident, ids in done.acks.items():
            self.net.deliver(self.address, ident.decode(), encode_ack(ids), reply=True)
        core.advance(now)
        failed: set[str] = set()
        for address, frames, _count in core.take_frames():
            if address not in failed and not self.net.deliver(self.address, address, frames, reply=False):
                failed.add(address)
                core.unreachable(address, now)
