"""The engine: the one thread that owns every socket, the timers and the group commit.

User threads never touch a socket. They append a command to a queue, poke an eventfd and
wait on a ``concurrent.futures.Future``. One turn of the loop (DESIGN.md section 9):

1. read: the wake-up fd, the ROUTER (messages, subscribes, pings) and every DEALER (acks,
   pongs), then the queued user commands; every store change goes into one batch;
2. commit: one ``WriteBatch``, fsynced only if something visible waits on it (a publish
   returning, an ack leaving, a subscription being confirmed);
3. release: resolve futures, send acks, hand received messages to the dispatcher;
4. send: new messages into subscribers' windows, backlog read from the store, resends;
5. timers: pings, subscribe retries, stream garbage collection, dedupe pruning.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from .clock import BusClock, wall_ms
from . import admin as A
from . import protocol as P
from .config import BusConfig
from .delivery import (
    Consumer,
    backoff,
    command_stream,
    envelope_from_record,
    event_stream,
    is_command_stream,
    stream_target,
    pack_outgoing,
    unpack_outgoing,
    OutgoingRecord,
)
from .commit import GroupCommit
from .dispatch import Dispatcher, Incoming, incoming_record
from .errors import BusBrokenError, BusClosedError, BusError, StoreError, StoreWriteError, TransportError
from .ids import IdGenerator
from .journal import Journal
from .letters import damaged_letter, outgoing_letter
from .protocol import KIND_NAMES, Kind
from .records import PeerStatus
from .requests import PendingRequests
from .store import Batch, Store

__all__ = ["Engine", "open_router", "open_admin"]

log = logging.getLogger("servicebus")

FRAME_BYTES = 1 << 20  # payload bytes per frame, at most (one message alone may be bigger)
READ_LIMIT = 2000  # frames read from one socket per turn, so one peer cannot starve the rest
TICK = 0.1  # seconds between timer checks when idle
GC_INTERVAL = 0.5
PRUNE_INTERVAL = 1.0  # handled ids past the dedupe window are deleted this often ...
PRUNE_BATCH = 10_000  # ... this many per turn, and again at once while there are more
CLOCK_SAVE = 5.0  # the bus clock is carried to the store this often (clock.py)
RECOVER_INTERVAL = 0.5  # while the store cannot be written, try to reopen it this often
INTENT_RETRY = 1.0
DOWN_PING = 0.2  # ping a peer this often while it is down, to notice it coming back soon
WAITING_PING = 0.01  # ... and this often while messages wait for it (first contact, restarts),
WAITING_FAST = 2.0  # ... for this long after it went down; then at DOWN_PING again
EXPIRY_INTERVAL = 1.0  # TTLs of messages waiting for a peer that is down, idle peers: checked this often
EXPIRY_SCAN = 1000  # stored messages read per consumer per check



def _stream_topic(stream: str) -> tuple[str | None, str]:
    """(topic, kind name) an ack on ``stream`` refers to, as far as the stream tells."""
    return (None, "command") if is_command_stream(stream) else (stream_target(stream), "event")


def _tune(sock: zmq.Socket, config: BusConfig, hwm: int) -> None:
    """Options every socket of ours gets (DESIGN.md section 4). The store, not ZeroMQ's
    queue, is the source of truth: no linger; a bounded frame size."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
    sock.setsockopt(zmq.MAXMSGSIZE, config.max_payload * 2 + (1 << 20))
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, 100_000)


def open_router(ctx: zmq.Context, bind: str, config: BusConfig) -> tuple[zmq.Socket, str]:
    """Bind this bus's ROUTER; return it and the endpoint it actually bound."""
    router = ctx.socket(zmq.ROUTER)
    _tune(router, config, hwm=100_000)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sends to a vanished peer raise, not vanish
    router.setsockopt(zmq.ROUTER_HANDOVER, 1)
    try:
        router.bind(bind.replace(":*", ":0") if bind.startswith("tcp://") else bind)
    except zmq.ZMQError as exc:
        router.close(linger=0)
        if exc.errno == zmq.EADDRINUSE:
            raise TransportError(f"cannot bind {bind}: the address is already in use") from exc
        raise TransportError(f"cannot bind {bind}: {exc}") from exc
    return router, router.getsockopt(zmq.LAST_ENDPOINT).decode()


def open_admin(ctx: zmq.Context, datadir: Path) -> tuple[zmq.Socket, str]:
    """Bind the admin endpoint: a Unix socket in the data directory, or loopback TCP when
    that path would exceed the OS limit for socket paths (~107 bytes)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    path = (datadir / "admin.sock").resolve()
    if len(str(path).encode()) < 100:
        path.unlink(missing_ok=True)  # left by a killed bus; the data directory lock is ours
        try:
            sock.bind(f"ipc://{path}")
            return sock, f"ipc://{path}"
        except zmq.ZMQError:
            pass
    sock.bind("tcp://127.0.0.1:0")
    return sock, sock.getsockopt(zmq.LAST_ENDPOINT).decode()


@dataclass(eq=False)
class Peer:
    """A bus we send to, through our own DEALER connected to its ROUTER."""

    address: str
    sock: zmq.Socket
    up: bool = False
    boot: str | None = None
    last_pong: float | None = None
    last_ping: float = 0.0
    consumers: list[Consumer] = field(default_factory=list)
    down_since: float = field(default_factory=time.monotonic)
    max_payload: int | None = None  # the largest payload it accepts, as its pongs say
    idle_since: float | None = None  # since when nothing is owed to or by it (peer_expiry)


@dataclass(eq=False)
class Intent:
    """A subscribe or unsubscribe this bus asked of a publisher, until confirmed."""

    publisher: str
    topic: str
    op: str  # "subscribe" | "unsubscribe"
    id: str
    confirmed: bool
    next_try: float = 0.0
    waiters: list[Future] = field(default_factory=list)

    def record(self) -> dict:
        return {"op": self.op, "id": self.id, "confirmed": self.confirmed, "updated": wall_ms()}


# --- commands from user threads ----------------------------------------------------------


@dataclass
class Published:
    """Messages a user thread has just made durable in ``stream`` (in id order)."""

    stream: str
    items: list[tuple[str, bytes]]  # (id, packed outgoing record)
    future: Future | None = None  # nobody waits: the publish returned already


@dataclass
class SendCmd:
    """A command (or a request, with a correlation id) to one address."""

    address: str
    command: str
    body: bytes
    expires: int | None
    headers: dict | None
    correlation_id: str | None
    future: Future


@dataclass
class QueueReply:
    """A handled request's reply, stored by a worker, to be queued for sending."""

    command_id: str
    reply: list  # [reply_to, command, correlation_id, body]
    future: Future | None = None


@dataclass
class AdminReply:
    ident: bytes
    data: bytes
    future: Future | None = None


@dataclass
class SubscribeCmd:
    publisher: str
    topic: str
    op: str
    future: Future  # resolved when the intent is stored
    confirmed: Future | None = None  # resolved when the publisher confirmed


@dataclass
class Drain:
    future: Future


@dataclass
class Snapshot:
    future: Future


class Engine(threading.Thread):
    def __init__(self, *, config: BusConfig, store: Store, clock: BusClock, context: zmq.Context,
                 router: zmq.Socket, address: str, node_id: str,
                 dispatcher: Dispatcher, requests: PendingRequests,
                 journal: Journal, admin: zmq.Socket | None = None,
                 datadir: Path | None = None) -> None:
        super().__init__(name="servicebus-engine", daemon=True)
        self.config = config
        self.store = store
        self.clock = clock
        self.ctx = context
        self.router = router
        self.address = address
        self.node_id = node_id
        self.boot = os.urandom(6).hex()
        self.dispatcher = dispatcher
        self.requests = requests
        self.journal = journal
        self._jon = journal.enabled
        self._jevents: list[tuple] = []  # journal events that ride in the current batch
        # Above every id the store refers to, whatever the wall clock says now (ids.py).
        self.ids = IdGenerator(after=store.highest_own_id())

        self._queue: deque[Any] = deque()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._wake_lock = threading.Lock()
        self._stopping = False
        self._shut = False  # _shutdown has emptied the queue for good
        self._submit_lock = threading.Lock()
        self.failure: BaseException | None = None

        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.poller.register(self._wake_fd, zmq.POLLIN)
        # While the store cannot be written, only user commands and operators are served.
        self._degraded_poller = zmq.Poller()
        self._degraded_poller.register(self._wake_fd, zmq.POLLIN)
        self._degraded: str | None = None  # why the store cannot be written, if it cannot
        self._next_recover = 0.0
        self.admin = admin
        self.datadir = datadir
        self._admin_pool: ThreadPoolExecutor | None = None
        if admin is not None:
            self.poller.register(admin, zmq.POLLIN)
            self._degraded_poller.register(admin, zmq.POLLIN)
            # Views can take a while on a big store: they run beside the loop, not in it.
            self._admin_pool = ThreadPoolExecutor(1, thread_name_prefix="servicebus-admin")

        self.peers: dict[str, Peer] = {}
        self._sock_peer: dict[zmq.Socket, Peer] = {}
        self.consumers: dict[tuple[str, str], Consumer] = {}
        self.by_stream: dict[str, list[Consumer]] = defaultdict(list)
        self.subscriptions: dict[tuple[str, str], dict] = {}
        self.intents: dict[tuple[str, str], Intent] = {}
        self._intent_ids: dict[str, Intent] = {}
        self._drains: list[Future] = []
        self._gc_floor: dict[str, str | None] = {}
        self._orphans_due = True
        # Event streams with consumers -> their peers. Replaced, never mutated, so that
        # publishing threads can read it without a lock.
        self._stream_peers: dict[str, tuple[str, ...]] = {}
        self.committer = GroupCommit(store, self._on_published)
        self._count_lock = threading.Lock()
        self.published = 0  # ids handed out by publish(), on user threads

        self.malformed: Counter[str] = Counter()
        self.counters: Counter[str] = Counter()

        self._next_gc = 0.0
        self._next_expiry = 0.0
        self._next_prune = 0.0
        self._next_clock_save = 0.0
        self._waiting_peers = False  # some down peer has messages waiting
        self._new_peer_work = True
        self._next_tick = 0.0

        # per-turn scratch. The batch always exists: a write made after a commit (a sender-
        # side dead letter, a pruned id) belongs to the next turn's batch, not to nothing.
        self._batch: Batch = store.batch()
        self._after: list[tuple[Future, Any]] = []  # callers released once the batch is written
        self._acks: dict[bytes, list[str]] = {}
        self._handoff: list[Incoming] = []
        self._new: dict[str, list[tuple[str, bytes]]] = {}
        self._outbox: dict[Peer, list[tuple[int, P.Envelope]]] = {}
        self._turn_ids: set[str] = set()

        try:
            self._load()
        except BaseException:
            self.close_wake()  # the bus never gets this engine to close it
            raise

    # --- user-thread side -------------------------------------------------------------

    def submit(self, command: Any) -> None:
        if self.failure is not None:
            raise self.broken()
        # Under the lock _shutdown empties the queue with: a command is either in the
        # queue before that (and failed by it) or refused here, never left in a dead queue.
        with self._submit_lock:
            if self._stopping or self._shut or not self.is_alive() and self.ident is not None:
                raise BusClosedError("the bus is closed")
            self._queue.append(command)
        self.wake()

    def broken(self) -> BusBrokenError:
        """The error every call gets once this engine stopped on an error of its own."""
        return BusBrokenError(f"the bus cannot go on: its engine stopped on {self.failure!r}; "
                              "close it and open it again")

    def wake(self) -> None:
        # Under the lock, and never after close_wake(): a write to a closed descriptor
        # would land in whatever file reuses its number (a journal segment, a LevelDB log).
        with self._wake_lock:
            if self._wake_fd < 0:
                return
            try:
                os.eventfd_write(self._wake_fd, 1)
            except BlockingIOError:
                pass  # already signalled (counter full): the engine will look anyway

    def close_wake(self) -> None:
        """Close the wake-up descriptor; later ``wake()`` calls do nothing. Called once the
        engine thread has ended (or never started)."""
        with self._wake_lock:
            if self._wake_fd >= 0:
                os.close(self._wake_fd)
                self._wake_fd = -1

    def publish(self, topic: str, bodies: list[bytes]) -> list[str]:
        """Store ``bodies`` for every subscriber of ``topic`` on the calling thread and
        return their ids once fsynced (see ``commit.py``). Thread-safe."""
        if not self.store.writable:
            # Not even an id for nobody's event: a bus that cannot write cannot deliver.
            raise StoreWriteError(f"the store cannot be written: {self.store.failure}")
        stream = event_stream(topic)
        if not self._stream_peers.get(stream):  # nobody subscribed: nothing to store
            ids = self.ids.many(len(bodies))
            with self._count_lock:
                self.published += len(ids)
            return ids

        def build(batch: Batch) -> tuple[str, list[str], list[tuple[str, bytes]]]:
            # Under the commit lock: ids are made in the order the batches will commit.
            ids = self.ids.many(len(bodies))
            peers = self._stream_peers.get(stream, ())
            items: list[tuple[str, bytes]] = []
            if peers:
                sent = wall_ms()
                put = batch.put_outgoing
                for mid, body in zip(ids, bodies):
                    record = pack_outgoing(Kind.EVENT, topic, sent, body)
                    put(stream, mid, record)
                    items.append((mid, record))
                if self._jon:  # one event per (message, receiver): what the audit reconciles
                    self.journal.record(batch, [("published", sent, mid, topic, "event", peer, 0, None)
                                                for peer in peers for mid in ids])
            return stream, ids, items

        return self.committer.commit(build)[1]

    def _on_published(self, results: list[tuple[str, list[str], list[tuple[str, bytes]]]]) -> None:
        # Under the commit lock, in commit order: the engine sees new ids in stream order.
        with self._count_lock:
            for stream, ids, items in results:
                self.published += len(ids)
                if items:
                    self._queue.append(Published(stream, items))
        self.wake()

    def stop(self, timeout: float | None = None) -> None:
        self._stopping = True
        self.wake()
        self.join(timeout)

    # --- startup -----------------------------------------------------------------------

    def _load(self) -> None:
        for subscriber, topic, record in self.store.subscriptions():
            self.subscriptions[(subscriber, topic)] = record
        states = {(peer, stream): rec for peer, stream, rec in self.store.deliveries()}
        for (subscriber, topic), record in self.subscriptions.items():
            stream = event_stream(topic)
            state = states.pop((subscriber, stream), None)
            if state is None:
                consumer = Consumer(subscriber, stream, record["since"])
            else:
                consumer = Consumer.from_record(subscriber, stream, state)
            self._load_consumer(consumer)
        for (peer, stream), state in list(states.items()):
            if is_command_stream(stream):
                self._load_consumer(Consumer.from_record(peer, stream, state))
                del states[(peer, stream)]
        for stream in self.store.stream_names():
            # Commands whose delivery state is missing (an edited or repaired store) are
            # still owed to their address: deliver them rather than leave them stranded.
            if is_command_stream(stream) and (stream_target(stream), stream) not in self.consumers:
                self._load_consumer(Consumer(stream_target(stream), stream, ""))
        for peer, stream in states:
            log.warning("dropping delivery state of %s on %s: no subscription", peer, stream)
            self._batch.delete_delivery(peer, stream)
        for command_id, reply in self.store.replies():  # replies stored before a crash
            self._queue.append(QueueReply(command_id, reply))
        for publisher, topic, record in self.store.intents():
            intent = Intent(publisher, topic, record["op"], record["id"], record["confirmed"])
            try:
                self._peer(publisher)
            except ValueError as exc:
                log.error("subscribe intent for %s at %s kept but not sent: %s", topic, publisher, exc)
                continue
            self.intents[(publisher, topic)] = intent
            self._intent_ids[intent.id] = intent

    def _load_consumer(self, consumer: Consumer) -> None:
        try:
            self._add_consumer(consumer)
        except ValueError as exc:
            # Stored by an older version that let such an address in: its messages stay
            # in the store for an operator (servicebus purge --subscriber) to deal with.
            log.error("not delivering to %s: %s", consumer.peer, exc)

    def _add_consumer(self, consumer: Consumer) -> None:
        peer = self._peer(consumer.peer)  # first: a failure to connect leaves nothing behind
        self.consumers[(consumer.peer, consumer.stream)] = consumer
        self.by_stream[consumer.stream].append(consumer)
        peer.consumers.append(consumer)
        self._update_stream_peers(consumer.stream)

    def _remove_consumer(self, consumer: Consumer) -> None:
        self.consumers.pop((consumer.peer, consumer.stream), None)
        self.by_stream[consumer.stream].remove(consumer)
        if not self.by_stream[consumer.stream]:
            del self.by_stream[consumer.stream]
        self.peers[consumer.peer].consumers.remove(consumer)
        self._update_stream_peers(consumer.stream)

    def _update_stream_peers(self, stream: str) -> None:
        if is_command_stream(stream):
            return
        peers = dict(self._stream_peers)
        consumers = self.by_stream.get(stream)
        if consumers:
            peers[stream] = tuple(c.peer for c in consumers)
        else:
            peers.pop(stream, None)
        self._stream_peers = peers

    def _peer(self, address: str) -> Peer:
        """The peer at ``address``, connecting to it first if needed. ``ValueError`` if it
        cannot be connected (libzmq refuses the address): callers call this before they
        change any other state, so such an address leaves nothing half-registered."""
        peer = self.peers.get(address)
        if peer is None:
            sock = self.ctx.socket(zmq.DEALER)
            try:
                _tune(sock, self.config, hwm=10_000)
                sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a live connection
                sock.setsockopt(zmq.RECONNECT_IVL, 100)
                sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
                sock.connect(address)
            except zmq.ZMQError as exc:
                sock.close(linger=0)
                raise ValueError(f"cannot connect to {address}: {exc}") from exc
            peer = Peer(address, sock)
            self.peers[address] = peer
            self._sock_peer[sock] = peer
            self.poller.register(sock, zmq.POLLIN)
        return peer

    # --- the loop ----------------------------------------------------------------------

    def run(self) -> None:
        try:
            while not self._stopping:
                timeout = 0 if self._queue else self._poll_timeout()
                poller = self.poller if self._degraded is None else self._degraded_poller
                events = dict(poller.poll(int(timeout * 1000)))
                self._turn(events)
            self._next_gc = 0.0  # leave no acknowledged message behind in the store
            self._turn({})  # last commands and acks before the sockets close
            if self._degraded is None:
                if self._jevents:
                    self.journal.record(self._batch, self._jevents)
                    self._jevents = []
                self._batch.put_clock(self.clock)
                try:
                    self.store.write(self._batch, sync=True)
                except StoreError as exc:
                    log.error("last write at close failed: %s (as after a crash: what it held "
                              "is redone after the next start)", exc)
        except BaseException as exc:  # noqa: BLE001
            self.failure = exc
            log.exception("servicebus engine stopped by an unexpected error")
        finally:
            self._shutdown()

    def _poll_timeout(self) -> float:
        tick = WAITING_PING if self._waiting_peers else TICK
        return max(0.0, min(tick, self._next_tick - time.monotonic()))

    def _ping_waiting(self, now: float) -> None:
        """Ping down peers that have messages waiting often, so that the first messages to
        a new subscriber, or to one that restarted, are not held for a whole ping period."""
        waiting = False
        for peer in self.peers.values():
            if peer.up or not any(not c.exhausted or c.inflight for c in peer.consumers):
                continue
            if now - peer.down_since > WAITING_FAST:
                continue  # down a while: the DOWN_PING timer is enough, no busy pinging
            waiting = True
            if now - peer.last_ping >= WAITING_PING:
                peer.last_ping = now
                self._send_peer(peer, P.encode_ping(self.node_id, self.boot))
        self._waiting_peers = waiting

    def _turn(self, events: dict) -> None:
        if self._degraded is None and not self.store.writable:
            self._degrade(StoreWriteError(self.store.failure or "the store refuses writes"))
        if self._degraded is not None:
            self._degraded_turn(events)
            return
        now = time.monotonic()
        batch = self._batch
        if self._wake_fd in events:
            try:
                os.eventfd_read(self._wake_fd)
            except BlockingIOError:
                pass
        if self.router in events:
            self._read_router(now)
        if self.admin is not None and self.admin in events:
            self._read_admin()
        for sock in events:
            peer = self._sock_peer.get(sock)
            if peer is not None:
                self._read_dealer(peer, now)
        self._run_commands(now)
        if now >= self._next_gc:
            self._next_gc = now + GC_INTERVAL
            self._collect_garbage()
        for consumer in self.consumers.values():
            if consumer.dirty:
                consumer.dirty = False
                batch.put_delivery(consumer.peer, consumer.stream, consumer.record())

        # commit: one fsync for everything this turn that someone waits on
        if self._jevents:
            self.journal.record(batch, self._jevents)
            self._jevents = []
        if batch.ops or batch.sync:
            if self._handoff:
                self.dispatcher.reserve([item.id for item in self._handoff])
            try:
                self.store.write(batch, sync=batch.sync)
            except StoreError as exc:
                self._degrade(exc)  # nothing of this turn happened: no ack, no release
                return
            if batch.sync:
                self.counters["fsyncs"] += 1
            self._batch = self.store.batch()

        # release
        after, self._after = self._after, []
        for future, value in after:
            if not future.done():
                future.set_result(value)
        if len(after) > 1:
            # Several callers were waiting on this commit: let them run and queue their next
            # call before the next turn, so that it commits them together (group commit).
            os.sched_yield()  # releases the GIL (see commit.py)
        if self._handoff:
            # Before the acks: a worker takes a while to wake up, the acks go meanwhile.
            handoff, self._handoff = self._handoff, []
            self.dispatcher.submit(handoff)
        acks, self._acks = self._acks, {}
        for ident, ids in acks.items():
            self._send_router(ident, P.encode_ack(ids))
        self._turn_ids.clear()

        # send
        if self._new:
            self._deliver_new(now)
        self._fill_windows(now)
        if now >= self._next_tick:
            self._next_tick = now + TICK
            self._timers(now)
        if self._waiting_peers or self._new_peer_work:
            self._new_peer_work = False
            self._ping_waiting(now)
        self._flush_outbox()
        if self._drains:
            self._check_drains()

    # --- a store that cannot be written ---------------------------------------------------

    def _degrade(self, exc: BaseException) -> None:
        """A write failed (a full disk, an I/O error). What this turn would have done did
        not happen: nobody is released, nothing acked, nothing handed to handlers. Until
        the store can be written again the engine neither receives (peers see it down and
        keep their messages) nor sends; every RECOVER_INTERVAL it tries to reopen the
        store, then reloads its delivery state from it, exactly as after a restart."""
        self._degraded = str(exc)
        self.counters["store_failures"] += 1
        log.error("the store cannot be written (%s): receiving and sending are paused; the bus "
                  "retries every %.1fs and goes on by itself once writing works", exc, RECOVER_INTERVAL)
        failed = StoreWriteError(f"the store cannot be written: {exc}")
        after, self._after = self._after, []
        for future, _value in after:
            if not future.done():
                future.set_exception(failed)
        self._acks.clear()
        self.dispatcher.unreserve([item.id for item in self._handoff])
        self._handoff.clear()
        self._turn_ids.clear()
        self._jevents = []
        self._new.clear()
        self._outbox.clear()
        self._next_recover = time.monotonic() + RECOVER_INTERVAL

    def _degraded_turn(self, events: dict) -> None:
        now = time.monotonic()
        if self._wake_fd in events:
            try:
                os.eventfd_read(self._wake_fd)
            except BlockingIOError:
                pass
        if self.admin is not None and self.admin in events:
            self._read_admin()
        failed = StoreWriteError(f"the store cannot be written: {self._degraded}")
        queue = self._queue
        while queue:
            cmd = queue.popleft()
            if isinstance(cmd, (SendCmd, SubscribeCmd)):
                if not cmd.future.done():
                    cmd.future.set_exception(failed)
            elif isinstance(cmd, AdminReply):
                self._send_admin(cmd)
            elif isinstance(cmd, Drain):
                self._drains.append(cmd.future)
            elif isinstance(cmd, Snapshot):
                cmd.future.set_result(self._snapshot(now))
            # Published and QueueReply: already in the store, which the reload reads.
        self.requests.expire(now)
        if now >= self._next_recover:
            self._next_recover = now + RECOVER_INTERVAL
            if self.store.writable or self.store.reopen():
                self._recover()

    def _recover(self) -> None:
        log.warning("the store can be written again (it had failed: %s); reloading delivery "
                    "state and going on", self._degraded)
        self._degraded = None
        waiters = {key: intent for key, intent in self.intents.items() if intent.waiters}
        for peer in self.peers.values():
            peer.consumers = []
            peer.last_ping = 0.0
        self.consumers.clear()
        self.by_stream.clear()
        self.subscriptions.clear()
        self.intents.clear()
        self._intent_ids.clear()
        self._stream_peers = {}
        self._gc_floor.clear()
        self._orphans_due = True
        self._queue = deque(c for c in self._queue if not isinstance(c, (Published, QueueReply)))
        self._batch = self.store.batch()
        self._load()  # as at a start: cursors, subscriptions, intents, stored replies
        # ... and the handlers get whatever is stored and not in memory, off this thread.
        threading.Thread(target=self.dispatcher.refill, name="servicebus-refill", daemon=True).start()
        for key, old in waiters.items():
            intent = self.intents.get(key)
            if intent is not None and intent.op == old.op:
                intent.waiters.extend(old.waiters)
        self._new_peer_work = True
        self._next_tick = 0.0

    # --- reading -----------------------------------------------------------------------

    def _read_router(self, now: float) -> None:
        router = self.router
        for _ in range(READ_LIMIT):
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2:
                self.malformed["bad_frame_count"] += 1
                continue
            ident = frames[0]
            try:
                frame = P.decode(frames[1:], max_payload=self.config.max_payload)
            except BusError as exc:
                self._malformed(exc)
                continue
            if isinstance(frame, P.Batch):
                self._on_batch(ident, frame)
            elif isinstance(frame, P.Ping):
                self._send_router(ident, P.encode_pong(self.node_id, self.boot, self.config.max_payload))
            elif isinstance(frame, P.Subscribe):
                self._on_subscribe(ident, frame)
            elif isinstance(frame, P.Unsubscribe):
                self._on_unsubscribe(ident, frame)
            else:
                self.malformed["unexpected_kind"] += 1

    def _read_admin(self) -> None:
        admin, pool = self.admin, self._admin_pool
        if admin is None or pool is None:
            return
        for _ in range(100):
            try:
                frames = admin.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            ident = frames[0]
            try:
                view, args = A.decode_request(frames[-1])
            except Exception as exc:  # noqa: BLE001 - junk on the admin socket
                self._queue.append(AdminReply(ident, A.encode_reply(error=f"bad request: {exc}")))
                continue
            pool.submit(self._run_view, ident, view, args)

    def _run_view(self, ident: bytes, view: str, args: dict) -> None:
        try:
            data = A.encode_reply(A.run_view(self.store, self.datadir or Path("."), view, args,
                                             {"pid": os.getpid()}))
        except Exception as exc:  # noqa: BLE001 - any failure goes back to the operator
            data = A.encode_reply(error=f"{type(exc).__name__}: {exc}")
        try:
            self.submit(AdminReply(ident, data))
        except BusClosedError:
            pass

    def _send_admin(self, cmd: AdminReply) -> None:
        if self.admin is None:
            return
        try:
            self.admin.send_multipart([cmd.ident, b"", cmd.data], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("admin reply not sent: %s", exc)

    def _malformed(self, exc: BusError) -> None:
        reason = getattr(exc, "reason", "malformed")
        self.malformed[reason] += 1
        total = sum(self.malformed.values())
        if total & (total - 1) == 0:  # log the 1st, 2nd, 4th, 8th ... to stay readable
            log.warning("dropped a malformed frame (%s); %d so far", exc, total)

    def _read_dealer(self, peer: Peer, now: float) -> None:
        sock = peer.sock
        for _ in range(READ_LIMIT):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                frame = P.decode(frames, max_payload=self.config.max_payload)
            except BusError as exc:
                self._malformed(exc)
                continue
            if isinstance(frame, P.Ack):
                self._on_ack(peer, frame.ids)
            elif isinstance(frame, P.Pong):
                self._on_pong(peer, frame, now)
            elif isinstance(frame, P.Nack):
                self._on_nack(peer, frame)
            else:
                self.malformed["unexpected_kind"] += 1

    def _on_batch(self, ident: bytes, frame: P.Batch) -> None:
        batch, store, seen = self._batch, self.store, self._turn_ids
        acks = self._acks.setdefault(ident, [])
        kind = int(frame.kind)
        stored = False
        if frame.oversize:
            self._send_router(ident, P.encode_nack(frame.oversize, (
                f"payload larger than this bus's max_payload ({self.config.max_payload} bytes)")))
            self.counters["refused_oversize"] += len(frame.oversize)
        jon, jev, ts, kname = self._jon, self._jevents, wall_ms(), KIND_NAMES[kind]
        known = store.seen_many([env.id for env in frame.messages])
        # TTLs arrive in the sender's clock. What is left of them counts on ours from now
        # on: skew between the two machines does not shorten or stretch them.
        skew = 0 if frame.sent_at is None else ts - frame.sent_at
        for env, was_seen in zip(frame.messages, known):
            if skew and env.expires is not None:
                env = env._replace(expires=max(0, env.expires + skew))
            mid = env.id
            acks.append(mid)
            if was_seen or mid in seen:
                # Stored (and fsynced) or handled already: ack again, do not handle again.
                self.counters["duplicates"] += 1
                continue
            seen.add(mid)
            record = incoming_record(kind, frame.sender, frame.reply_to, env)
            batch.put_incoming(mid, record)
            self._handoff.append(Incoming(mid, record, None))
            stored = True
            if jon:
                jev.append(("received", ts, mid, env.topic, kname, frame.reply_to, env.attempt, None))
        self.counters["received"] += len(frame.messages)
        if stored:
            batch.sync = True  # the acks leave only after the fsync

    def _on_subscribe(self, ident: bytes, frame: P.Subscribe) -> None:
        key = (frame.address, frame.topic)
        if key not in self.subscriptions:
            try:
                self._peer(frame.address)
            except ValueError as exc:
                self._malformed(P.ProtocolError("bad_address", str(exc)))
                return
            since = self.ids.next()
            record = {"since": since, "created": wall_ms(), "node": frame.sender}
            self.subscriptions[key] = record
            self._batch.put_subscription(frame.address, frame.topic, record)
            consumer = Consumer(frame.address, event_stream(frame.topic), since)
            consumer.exhausted = True  # it starts at the end of the stream
            consumer.dirty = True
            self._add_consumer(consumer)
            log.info("%s subscribed to %s", frame.address, frame.topic)
        self._batch.sync = True
        self._acks.setdefault(ident, []).append(frame.id)

    def _on_unsubscribe(self, ident: bytes, frame: P.Unsubscribe) -> None:
        key = (frame.address, frame.topic)
        if self.subscriptions.pop(key, None) is not None:
            stream = event_stream(frame.topic)
            consumer = self.consumers.get((frame.address, stream))
            if consumer is not None:
                if self._jon:
                    self._journal_dropped(consumer, frame.topic, "unsubscribed")
                self._remove_consumer(consumer)
            self._batch.delete_subscription(frame.address, frame.topic)
            self._batch.delete_delivery(frame.address, stream)
            self._gc_floor.pop(stream, None)
            self._orphans_due = True
            log.info("%s unsubscribed from %s", frame.address, frame.topic)
        self._batch.sync = True
        self._acks.setdefault(ident, []).append(frame.id)

    def _journal_dropped(self, consumer: Consumer, topic: str, why: str) -> None:
        """Journal every message ``consumer`` was still owed as dropped (the audit must not
        take them for lost): those in flight and those stored after its cursor."""
        ts, peer, jev = wall_ms(), consumer.peer, self._jevents
        owed = list(consumer.inflight)
        after = consumer.pos
        while True:
            ids = self.store.stream_ids(consumer.stream, after=after, limit=10_000)
            owed += [mid for mid in ids if mid not in consumer.skip]
            if len(ids) < 10_000:
                break
            after = ids[-1]
        jev.extend(("dropped_at_sender", ts, mid, topic, "event", peer, 0, why) for mid in owed)

    def _on_ack(self, peer: Peer, ids: tuple[str, ...]) -> None:
        consumers = peer.consumers
        wall = time.time()
        for mid in ids:
            intent = self._intent_ids.get(mid)
            if intent is not None:
                self._confirm_intent(intent)
                continue
            for consumer in consumers:
                if consumer.ack(mid):
                    consumer.last_ack = wall
                    if self._jon:
                        topic, kname = _stream_topic(consumer.stream)
                        self._jevents.append(("acked", int(wall * 1000), mid, topic, kname,
                                              peer.address, 0, None))
                    break
        self.counters["acked"] += len(ids)

    def _on_nack(self, peer: Peer, nack: P.Nack) -> None:
        """The peer refused these messages for good (too large for it): each becomes a dead
        letter here, with the peer's reason, and its place in the window is freed."""
        log.warning("peer %s refused %d message(s): %s", peer.address, len(nack.ids), nack.reason)
        for mid in nack.ids:
            for consumer in peer.consumers:
                if mid in consumer.inflight:
                    data = self.store.get_outgoing(consumer.stream, mid)
                    record = None if data is None else self._outgoing_record(consumer, mid, data)
                    if record is not None:
                        self._refuse(consumer, mid, record, "refused", nack.reason)
                    else:
                        consumer.settle(mid)
                    break

    def _refuse(self, consumer: Consumer, mid: str, record: OutgoingRecord, reason: str,
                error: str) -> None:
        """A message its receiver cannot take: a dead letter at the sender (replayable with
        ``servicebus replay`` once the receiver's ``max_payload`` allows it)."""
        consumer.settle(mid)
        kind = Kind(record.kind).name.lower()
        self._batch.put_deadletter(mid, outgoing_letter(reason, error, record, consumer.peer,
                                                        consumer.stream))
        self.counters["refused"] += 1
        if self._jon:
            self._jevents.append(("deadlettered_at_sender", wall_ms(), mid, record.topic, kind,
                                  consumer.peer, 0, reason))
        log.error("%s %s to %s: %s; dead letter", kind, mid, consumer.peer, error)

    def _too_large(self, consumer: Consumer, mid: str, record: OutgoingRecord) -> bool:
        limit = self.peers[consumer.peer].max_payload
        if limit is None or len(record.body) <= limit:
            return False
        self._refuse(consumer, mid, record, "too_large",
                     f"payload of {len(record.body)} bytes; the receiver's max_payload is {limit}")
        return True

    def _on_pong(self, peer: Peer, pong: P.Pong, now: float) -> None:
        restarted = peer.boot is not None and peer.boot != pong.boot
        peer.last_pong = now
        peer.max_payload = pong.max_payload
        peer.boot = pong.boot
        if not peer.up or restarted:
            peer.up = True
            log.info("peer %s is up%s", peer.address, " (restarted)" if restarted else "")
            self._peer_up(peer, now)

    def _peer_up(self, peer: Peer, now: float) -> None:
        """A peer (re)appeared: what it had in flight may be lost, so send it again now
        rather than at the end of a long backoff."""
        for consumer in peer.consumers:
            consumer.exhausted = False
            for mid, flight in consumer.inflight.items():
                flight.deadline = 0.0
        for intent in self.intents.values():
            if intent.publisher == peer.address and not intent.confirmed:
                intent.next_try = 0.0
        self._next_tick = 0.0

    # --- user commands -----------------------------------------------------------------

    def _run_commands(self, now: float) -> None:
        queue = self._queue
        while queue:
            cmd = queue.popleft()
            try:
                if isinstance(cmd, Published):
                    if cmd.stream in self.by_stream:
                        self._new.setdefault(cmd.stream, []).extend(cmd.items)
                    else:
                        self._orphans_due = True  # unsubscribed while they were written
                elif isinstance(cmd, SendCmd):
                    self._cmd_send(cmd)
                elif isinstance(cmd, QueueReply):
                    self._queue_reply(cmd)
                elif isinstance(cmd, AdminReply):
                    self._send_admin(cmd)
                elif isinstance(cmd, SubscribeCmd):
                    self._cmd_subscribe(cmd)
                elif isinstance(cmd, Drain):
                    self._drains.append(cmd.future)
                elif isinstance(cmd, Snapshot):
                    cmd.future.set_result(self._snapshot(now))
                else:
                    raise TypeError(f"unknown engine command {cmd!r}")
            except Exception as exc:  # a bad command fails its caller, not the engine
                if cmd.future is None:
                    raise
                if not cmd.future.done():
                    cmd.future.set_exception(exc)

    def _command_consumer(self, address: str) -> str:
        stream = command_stream(address)
        if (address, stream) not in self.consumers:
            consumer = Consumer(address, stream, "")  # "" sorts before every id
            consumer.exhausted = True
            consumer.dirty = True
            self._add_consumer(consumer)
        return stream

    def _cmd_send(self, cmd: SendCmd) -> None:
        stream = self._command_consumer(cmd.address)
        mid = self.ids.next()
        record = pack_outgoing(Kind.COMMAND, cmd.command, wall_ms(), cmd.body, cmd.expires,
                               cmd.correlation_id, cmd.headers)
        self._batch.put_outgoing(stream, mid, record)
        self._new.setdefault(stream, []).append((mid, record))
        self._batch.sync = True
        self.counters["commands_sent"] += 1
        if self._jon:
            self._jevents.append(("published", wall_ms(), mid, cmd.command, "command", cmd.address, 0, None))
        self._after.append((cmd.future, mid))

    def _queue_reply(self, cmd: QueueReply) -> None:
        reply_to, command, corr, body = cmd.reply
        try:
            stream = self._command_consumer(reply_to)
        except ValueError as exc:  # checked on receipt; only an older store gets here
            log.error("reply to %s cannot be sent: %s; dropped", reply_to, exc)
            self._batch.delete_reply(cmd.command_id)
            return
        mid = self.ids.next()
        sent = wall_ms()
        record = pack_outgoing(Kind.REPLY, command, sent, body, sent + int(self.config.reply_ttl * 1000), corr, None)
        # The reply moves from "pending" to the outgoing stream in one write. No fsync of
        # its own: the request's completion was not fsynced either, and the log keeps
        # their order, so a crash loses both (the request runs again) or neither.
        self._batch.put_outgoing(stream, mid, record)
        self._batch.delete_reply(cmd.command_id)
        self._new.setdefault(stream, []).append((mid, record))
        self.counters["replies_sent"] += 1
        if self._jon:
            self._jevents.append(("published", wall_ms(), mid, command, "reply", reply_to, 0, None))

    def _cmd_subscribe(self, cmd: SubscribeCmd) -> None:
        self._peer(cmd.publisher)  # ValueError to the caller, before anything is stored
        key = (cmd.publisher, cmd.topic)
        old = self.intents.get(key)
        if old is not None:
            self._intent_ids.pop(old.id, None)
        intent = Intent(cmd.publisher, cmd.topic, cmd.op, self.ids.next(), False)
        if old is not None and old.op == cmd.op:
            intent.waiters = old.waiters
        if cmd.confirmed is not None:
            intent.waiters.append(cmd.confirmed)
        self.intents[key] = intent
        self._intent_ids[intent.id] = intent
        self._batch.put_intent(cmd.publisher, cmd.topic, intent.record())
        self._batch.sync = True
        self._after.append((cmd.future, intent.id))
        self._next_tick = 0.0

    def _confirm_intent(self, intent: Intent) -> None:
        self._intent_ids.pop(intent.id, None)
        key = (intent.publisher, intent.topic)
        if intent.op == "subscribe":
            intent.confirmed = True
            self._batch.put_intent(intent.publisher, intent.topic, intent.record())
            log.info("subscription to %s at %s confirmed", intent.topic, intent.publisher)
        else:
            if self.intents.get(key) is intent:
                del self.intents[key]
            self._batch.delete_intent(intent.publisher, intent.topic)
            log.info("unsubscribe from %s at %s confirmed", intent.topic, intent.publisher)
        waiters, intent.waiters = intent.waiters, []
        for fut in waiters:
            self._after.append((fut, True))

    # --- sending -----------------------------------------------------------------------

    def _admit(self, consumer: Consumer, mid: str, data: bytes, now: float,
               out: list[tuple[int, P.Envelope]]) -> None:
        flight = consumer.admit(mid, now, self.config.ack_timeout)
        if flight is None:
            return  # acknowledged before a restart
        record = self._outgoing_record(consumer, mid, data)
        if record is None:
            return
        if record.expires is not None and record.expires < wall_ms():
            self._expire(consumer, mid, record, flight.attempt)
            return
        if self._too_large(consumer, mid, record):
            return
        out.append((record.kind, envelope_from_record(mid, record, flight.attempt)))
        if self._jon:
            self._jevents.append(("sent", wall_ms(), mid, record.topic, KIND_NAMES[record.kind],
                                  consumer.peer, flight.attempt, None))

    def _outgoing_record(self, consumer: Consumer, mid: str, data: bytes) -> OutgoingRecord | None:
        """The stored message, or None if its record is damaged: then it becomes a dead
        letter (reason ``damaged``, the raw bytes kept) instead of stopping the engine."""
        try:
            return unpack_outgoing(data)
        except Exception as exc:  # noqa: BLE001 - a damaged record must not stop the engine
            consumer.settle(mid)
            self._batch.put_deadletter(mid, damaged_letter(
                "outgoing", f"undecodable record ({type(exc).__name__})", data, consumer.peer,
                consumer.stream))
            self.counters["damaged"] += 1
            log.error("message %s to %s: its stored record is damaged (%s); moved to the dead "
                      "letters with its raw bytes", mid, consumer.peer, type(exc).__name__)
            return None

    def _expire(self, consumer: Consumer, mid: str, record: OutgoingRecord, attempt: int) -> None:
        """A message whose TTL passed before its receiver acked it: a dead letter here."""
        consumer.settle(mid)
        self._batch.put_deadletter(mid, outgoing_letter("expired", None, record, consumer.peer,
                                                        consumer.stream))
        self.counters["expired"] += 1
        if self._jon:
            self._jevents.append(("expired_at_sender", wall_ms(), mid, record.topic,
                                  KIND_NAMES[record.kind], consumer.peer, attempt, "expired"))
        log.warning("%s %s to %s expired before it was acknowledged: dead letter",
                    Kind(record.kind).name.lower(), mid, consumer.peer)

    def _deliver_new(self, now: float) -> None:
        """Messages written this turn go straight into windows that had caught up."""
        new, self._new = self._new, {}
        window = self.config.window
        for stream, items in new.items():
            for consumer in self.by_stream.get(stream, ()):
                peer = self.peers[consumer.peer]
                if not consumer.exhausted or not peer.up:
                    consumer.exhausted = False
                    self._new_peer_work = self._new_peer_work or not peer.up
                    continue
                out = self._outbox.setdefault(peer, [])
                pos = consumer.pos or ""
                for mid, record in items:
                    if mid <= pos:
                        continue  # read from the store before this notice arrived
                    if consumer.room(window) <= 0:
                        consumer.exhausted = False  # the rest is read from the store later
                        break
                    self._admit(consumer, mid, record, now, out)

    def _fill_windows(self, now: float) -> None:
        """Read backlog from the store into windows with room (never more than a window)."""
        window = self.config.window
        for consumer in list(self.consumers.values()):
            if consumer.exhausted:
                continue
            peer = self.peers[consumer.peer]
            room = consumer.room(window)
            if not peer.up:
                continue  # _check_down_consumers learns whether anything waits for it
            if room <= 0:
                continue
            items = self.store.iter_stream(consumer.stream, after=consumer.pos, limit=room)
            if len(items) < room:
                consumer.exhausted = True
            out = self._outbox.setdefault(peer, [])
            for mid, data in items:
                self._admit(consumer, mid, data, now, out)

    def _resend_due(self, now: float) -> None:
        cfg = self.config
        now_ms = wall_ms()
        for consumer in list(self.consumers.values()):
            peer = self.peers[consumer.peer]
            if not peer.up or not consumer.inflight:
                continue
            out = None
            for mid, flight in list(consumer.inflight.items()):
                if flight.deadline > now:
                    continue
                data = self.store.get_outgoing(consumer.stream, mid)
                if data is None:  # cannot happen unless the store was edited underneath us
                    log.error("message %s vanished from stream %s", mid, consumer.stream)
                    consumer.ack(mid)
                    continue
                record = self._outgoing_record(consumer, mid, data)
                if record is None:
                    continue
                if record.expires is not None and record.expires < now_ms:
                    self._expire(consumer, mid, record, flight.attempt)
                    continue
                if self._too_large(consumer, mid, record):
                    continue
                flight.attempt += 1
                flight.deadline = now + backoff(flight.attempt - 1, cfg.ack_timeout, cfg.resend_max)
                consumer.dirty = True
                if out is None:
                    out = self._outbox.setdefault(peer, [])
                out.append((record.kind, envelope_from_record(mid, record, flight.attempt)))
                self.counters["resent"] += 1
                if self._jon:
                    self._jevents.append(("sent", wall_ms(), mid, record.topic, KIND_NAMES[record.kind],
                                          consumer.peer, flight.attempt, None))

    def _flush_outbox(self) -> None:
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, {}
        for peer, items in outbox.items():
            if not items or not peer.up:
                continue  # what is in flight is resent when the peer comes back
            by_kind: dict[int, list[P.Envelope]] = {}
            for kind, env in items:
                by_kind.setdefault(kind, []).append(env)
            for kind, envs in by_kind.items():
                for chunk in self._frames(envs):
                    frames = P.encode_batch(Kind(kind), self.node_id, self.address, chunk, wall_ms())
                    if not self._send_peer(peer, frames):
                        break
                    self.counters["sent"] += len(chunk)
                if not peer.up:
                    break

    def _frames(self, envs: list[P.Envelope]) -> list[list[P.Envelope]]:
        """Split into frames of at most ``max_batch`` messages and FRAME_BYTES of payload
        (one message alone may be bigger): a frame above the receiver's ZeroMQ message
        size limit would make libzmq drop the connection, and only resends recover."""
        count = self.config.max_batch
        chunks: list[list[P.Envelope]] = []
        chunk: list[P.Envelope] = []
        size = 0
        for env in envs:
            if chunk and (len(chunk) >= count or size + len(env.body) > FRAME_BYTES):
                chunks.append(chunk)
                chunk, size = [], 0
            chunk.append(env)
            size += len(env.body)
        if chunk:
            chunks.append(chunk)
        return chunks

    def _send_peer(self, peer: Peer, frames: list[bytes]) -> bool:
        try:
            peer.sock.send_multipart(frames, zmq.NOBLOCK)
            return True
        except zmq.Again:
            # Not connected (IMMEDIATE) or its queue is full: treat the peer as down; what
            # was in flight is resent when it answers a ping again.
            if peer.up:
                log.info("peer %s is down (cannot send)", peer.address)
                peer.down_since = time.monotonic()
            peer.up = False
            return False

    def _send_router(self, ident: bytes, frames: list[bytes]) -> None:
        try:
            self.router.send_multipart([ident, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # EHOSTUNREACH (ROUTER_MANDATORY: the peer went away) or EAGAIN: the sender
            # will resend and we will ack again.
            self.counters["router_send_failed"] += 1
            log.debug("reply to a peer failed: %s", exc)

    # --- timers ------------------------------------------------------------------------

    def _timers(self, now: float) -> None:
        cfg = self.config
        for peer in self.peers.values():
            if peer.up and peer.last_pong is not None and now - peer.last_pong > cfg.peer_timeout:
                log.info("peer %s is down (no answer for %.1fs)", peer.address, now - peer.last_pong)
                peer.up = False
                peer.down_since = now
            interval = cfg.heartbeat if peer.up else DOWN_PING
            if now - peer.last_ping >= interval:
                peer.last_ping = now
                self._send_peer(peer, P.encode_ping(self.node_id, self.boot))
        for intent in self.intents.values():
            if intent.confirmed or now < intent.next_try:
                continue
            intent.next_try = now + INTENT_RETRY
            encode = P.encode_subscribe if intent.op == "subscribe" else P.encode_unsubscribe
            self._send_peer(self.peers[intent.publisher],
                            encode(intent.id, intent.topic, self.address, self.node_id))
        self._resend_due(now)
        self._check_down_consumers()
        if now >= self._next_expiry:
            self._next_expiry = now + EXPIRY_INTERVAL
            self._expire_waiting(now)
            self._forget_idle_peers(now)
        self.requests.expire(now)
        if now >= self._next_prune:
            # While ids are due faster than one batch a second, go on next turn.
            more = self._prune_handled()
            self._next_prune = now + (0.0 if more else PRUNE_INTERVAL)
        if now >= self._next_clock_save:
            self._next_clock_save = now + CLOCK_SAVE
            self._batch.put_clock(self.clock)

    def _check_down_consumers(self) -> None:
        """Whether anything waits for peers that are down (drain and status need it): one
        seek per consumer per tick, not per turn."""
        for consumer in self.consumers.values():
            if not consumer.exhausted and not self.peers[consumer.peer].up:
                if not self.store.stream_ids(consumer.stream, after=consumer.pos, limit=1):
                    consumer.exhausted = True

    def _expire_waiting(self, now: float) -> None:
        """TTLs pass while a receiver is down too: commands and replies waiting for a peer
        that is down become dead letters when they expire, not when it comes back. (Only
        command streams carry TTLs.) Reads at most EXPIRY_SCAN stored messages per
        consumer per call, resuming where the last call stopped."""
        now_ms = wall_ms()
        for consumer in list(self.consumers.values()):
            if not is_command_stream(consumer.stream) or self.peers[consumer.peer].up:
                continue
            record: OutgoingRecord | None
            for mid, flight in list(consumer.inflight.items()):
                data = self.store.get_outgoing(consumer.stream, mid)
                record = None if data is None else self._outgoing_record(consumer, mid, data)
                if record is not None and record.expires is not None and record.expires < now_ms:
                    self._expire(consumer, mid, record, flight.attempt)
            start = max(consumer.scan or "", consumer.pos or "")
            items = self.store.iter_stream(consumer.stream, after=start or None, limit=EXPIRY_SCAN)
            consumer.scan = items[-1][0] if len(items) == EXPIRY_SCAN else None  # else: from the start
            # Expired messages right after the cursor are read into the window and settled
            # there, so the cursor moves past them (drain and garbage collection see them
            # gone); ones behind a message still alive are skipped when the cursor gets there.
            leading = start == (consumer.pos or "")
            for mid, data in items:
                if mid in consumer.skip:
                    if leading and consumer.room(self.config.window) > 0:
                        consumer.admit(mid, now, self.config.ack_timeout)
                    continue
                try:
                    record = unpack_outgoing(data)
                except Exception:  # noqa: BLE001 - damaged: _outgoing_record dead-letters it
                    record = None
                if record is not None and (record.expires is None or record.expires >= now_ms):
                    leading = False
                    continue
                if leading and consumer.room(self.config.window) > 0:
                    consumer.admit(mid, now, self.config.ack_timeout)
                if record is None:
                    self._outgoing_record(consumer, mid, data)
                else:
                    self._expire(consumer, mid, record, 0)

    def _forget_idle_peers(self, now: float) -> None:
        """Bound per-address state: an address nothing is owed to, either way, for
        ``peer_expiry`` loses its socket, consumers and delivery records. Subscribers and
        publishers we have a subscription or intent with are never idle."""
        publishers = {intent.publisher for intent in self.intents.values()}
        for address, peer in list(self.peers.items()):
            idle = address not in publishers and all(
                is_command_stream(c.stream) and c.idle for c in peer.consumers)
            if not idle:
                peer.idle_since = None
                continue
            if peer.idle_since is None:
                peer.idle_since = now
                continue
            if now - peer.idle_since < self.config.peer_expiry:
                continue
            if any(self.store.stream_ids(c.stream, limit=1) for c in peer.consumers):
                continue  # acknowledged messages not collected yet: next time
            for consumer in list(peer.consumers):
                self._remove_consumer(consumer)
                self._batch.delete_delivery(consumer.peer, consumer.stream)
            self.poller.unregister(peer.sock)
            del self._sock_peer[peer.sock]
            del self.peers[address]
            self._outbox.pop(peer, None)
            peer.sock.close(linger=0)
            self.counters["peers_forgotten"] += 1
            log.info("forgot peer %s: nothing owed either way for %.0fs", address, now - peer.idle_since)

    def _collect_garbage(self) -> None:
        """Delete stream messages every consumer of the stream has acknowledged."""
        batch, budget = self._batch, 5000
        for stream, consumers in list(self.by_stream.items()):
            floors = [c.floor for c in consumers]
            floor = min(f for f in floors if f is not None) if floors and None not in floors else None
            if floor is None or self._gc_floor.get(stream) == floor:
                continue
            ids = self.store.stream_ids(stream, upto=floor, limit=budget)
            for mid in ids:
                batch.delete_outgoing(stream, mid)
            budget -= len(ids)
            if budget > 0:
                self._gc_floor[stream] = floor  # everything up to it is gone now
            else:
                return
        if self._orphans_due and budget > 0:
            # Streams nobody consumes any more (after an unsubscribe, or a removed
            # subscription found at start): their messages are owed to no one.
            for stream in self.store.stream_names():
                if stream in self.by_stream:
                    continue
                ids = self.store.stream_ids(stream, limit=budget)
                for mid in ids:
                    batch.delete_outgoing(stream, mid)
                budget -= len(ids)
                if budget <= 0:
                    return
            self._orphans_due = False

    def _prune_handled(self) -> bool:
        """Forget handled ids older than the dedupe window, counted on the bus clock from
        when they were handled (not from the sender's id time, nor on the wall clock: a
        clock stepped forward must not forget ids whose resends may still come). True if
        there may be more to prune."""
        cutoff = self.clock.now() - int(self.config.dedupe_window * 1000)
        if cutoff <= 0:
            return False
        due = self.store.handled_before(cutoff, PRUNE_BATCH)
        for mid, at in due:
            self._batch.forget_handled(mid, at)
        self.counters["dedupe_pruned"] += len(due)
        return len(due) >= PRUNE_BATCH

    # --- drain and status --------------------------------------------------------------

    def idle(self) -> bool:
        if self._degraded is not None or self._queue or self._new or self._handoff:
            return False
        if any(not c.idle for c in self.consumers.values()):
            return False
        if any(not i.confirmed for i in self.intents.values()):
            return False
        if len(self.requests):
            return False
        return self.dispatcher.idle

    def _counters(self) -> dict[str, int]:
        counters = Counter(self.counters)
        counters["fsyncs"] += self.committer.fsyncs
        counters["published"] += self.published
        return dict(counters)

    def _check_drains(self) -> None:
        self._drains = [f for f in self._drains if not f.done()]
        if self._drains and self.idle():
            for fut in self._drains:
                fut.set_result(True)
            self._drains = []

    def _snapshot(self, now: float) -> dict:
        peers = tuple(
            PeerStatus(p.address, p.up, sum(len(c.inflight) for c in p.consumers),
                       None if p.last_pong is None else now - p.last_pong)
            for p in self.peers.values()
        )
        consumers = [(c.peer, c.stream, c.floor, len(c.order) - len(c.inflight) + len(c.skip))
                     for c in self.consumers.values()]
        return {
            "peers": peers,
            "consumers": consumers,
            "malformed": dict(self.malformed),
            "counters": self._counters(),
            "intents_unconfirmed": sum(1 for i in self.intents.values() if not i.confirmed),
            "store_error": self._degraded or self.store.failure,
        }

    # --- shutdown ----------------------------------------------------------------------

    def _shutdown(self) -> None:
        self._stopping = True
        err: BusError = BusClosedError("the bus closed before this call completed")
        if self.failure is not None:
            err = self.broken()
        with self._submit_lock:
            self._shut = True
            queued, self._queue = list(self._queue), deque()
        for cmd in queued:
            if cmd.future is not None and not cmd.future.done():
                cmd.future.set_exception(err)
        for fut in self._drains:
            if not fut.done():
                fut.set_result(False)
        for intent in self.intents.values():
            for fut in intent.waiters:
                if not fut.done():
                    fut.set_exception(err)
        self.requests.close(err)
        if self._admin_pool is not None:
            self._admin_pool.shutdown(wait=True, cancel_futures=True)
        if self.admin is not None:
            self.admin.close(linger=0)
        for peer in self.peers.values():
            peer.sock.close(linger=0)
        self.router.close(linger=0)
