"""The engine: the I/O shell around the delivery core, on the one thread that owns every
socket (through ``Sockets``), the timers and the group commit.

User threads never touch a socket. They append a command to a queue, poke an eventfd and
wait on a ``concurrent.futures.Future``. One turn of the loop (DESIGN.md section 9):

1. read: the wake-up fd, the ROUTER (messages, subscribes, pings), the admin endpoint and
   every DEALER (acks, pongs), then the queued user commands, each fed to the core;
2. commit: the core's batch in one ``WriteBatch``, fsynced only if something visible waits
   on it (a publish returning, an ack leaving, a subscription being confirmed);
3. release: resolve futures, hand received messages to the dispatcher, send acks;
4. send: the core fills windows and runs its timers; the frames it asks for go out.

The state machine itself is in ``servicebus.core``; this module only does I/O.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast


from ..wire import protocol as P
from .adminserve import AdminReply, AdminServer
from .maintain import Maintain, maintain
from ..model.clock import BusClock
from .peerio import PeerIO
from .publisher import Publisher
from ..model.config import BusConfig
from ..core import Core, Published, QueueReply, QueueSend, SendCmd, SubscribeCmd, Supersede
from ..handling.dispatch import Dispatcher
from ..errors import BusClosedError, BusError, BusBrokenError, StoreError, StoreWriteError
from ..model.ids import IdGenerator
from ..hooks.base import Hooks
from ..handling.requests import PendingRequests
from .sockets import Sockets
from ..store import MARK_INTERVAL, Batch, Store

__all__ = ["Engine", "Drain", "Snapshot", "Maintain", "SendCmd", "QueueReply", "SubscribeCmd"]

log = logging.getLogger("servicebus")

RECOVER_INTERVAL = 0.5  # while the store cannot be written, try to reopen it this often
# Unsynced writes (handler completions, acked deletes, cursors, journal moves) become durable
# with the next synced write. A bus that receives and publishes nothing more makes none, so
# the engine fsyncs once an unsynced write has waited this long: a power cut reruns only
# handlers that finished within about this long before it (DESIGN.md rule 12, README).
SYNC_INTERVAL = 0.2


@dataclass
class Drain:
    future: Future


@dataclass
class Snapshot:
    future: Future


class Engine(threading.Thread):
    def __init__(self, *, config: BusConfig, store: Store, clock: BusClock, sockets: Sockets,
                 address: str, node_id: str, dispatcher: Dispatcher, requests: PendingRequests,
                 hooks: Hooks, datadir: Path | None = None) -> None:
        super().__init__(name="servicebus-engine", daemon=True)
        self.config = config
        self.store = store
        self.sockets = sockets
        self.address = address
        self.node_id = node_id
        self.dispatcher = dispatcher
        self.requests = requests
        self.hooks = hooks
        self.datadir = datadir

        self._queue: deque[Any] = deque()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._wake_lock = threading.Lock()
        self._stopping = False
        self._shut = False  # _shutdown has emptied the queue for good
        self._submit_lock = threading.Lock()
        self.failure: BaseException | None = None
        sockets.watch(self._wake_fd)

        self._degraded: str | None = None  # why the store cannot be written, if it cannot
        self._next_mark = 0.0  # the store's next high-water mark (store/mark.py)
        self._next_recover = 0.0
        self._drains: list[Future] = []
        self.clock = clock
        self._admin: AdminServer | None = None
        if sockets.admin is not None:
            self._admin = AdminServer(sockets.admin, store, datadir or Path("."), self.submit,
                                      lambda cmd: self._queue.append(cmd))  # _queue is replaced

        self.fsyncs = 0
        try:
            # Above every id the store refers to, whatever the wall clock says now (ids.py).
            self.ids = IdGenerator(after=store.highest_own_id(), epoch=store.next_epoch())
            self.core = Core(config=config, store=store, links=sockets, batch=store.batch(),
                             address=address, node_id=node_id, boot=os.urandom(6).hex(),
                             ids=self.ids, clock=clock, events=hooks,
                             now=time.monotonic(), uid=os.getuid(), trust=sockets.keys,
                             aliases=sockets.bound)
            self.io = PeerIO(sockets, self.core, config)
            self._queue.extend(self.core.load())  # replies stored before a crash
            # The publish path, on the callers' threads: it sees the core only through the
            # routes handed to it (_swap_routes) and talks back through submit/notify.
            self.publisher = Publisher(config=config, store=store, ids=self.ids, clock=clock,
                                       hooks=hooks, engine=self)
            self.publisher.routes = self.core.s.routes
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

    def notify(self, commands: list[Any]) -> None:
        """Commands about writes already durable (publisher.py's ``EnginePort``): queued
        whatever the engine's state, since a reload reads the store again anyway."""
        if commands:
            self._queue.extend(commands)
            self.wake()

    def stop(self, timeout: float | None = None) -> None:
        self._stopping = True
        self.publisher.close()
        self.wake()
        self.join(timeout)

    # --- the loop ----------------------------------------------------------------------

    def run(self) -> None:
        self.core.bind_owner()  # the core is this thread's alone from here on (core/owner.py)
        try:
            while not self._stopping:
                now = time.monotonic()
                timeout = 0 if self._queue else self.core.poll_timeout(now)
                poller = self.sockets.poller if self._degraded is None else self.sockets.degraded_poller
                # Rounded up: a timer due in under a millisecond is a poll(1), not a spin of poll(0).
                self._turn(dict(poller.poll(math.ceil(timeout * 1000))))
            self.core.collect_soon()  # leave no acknowledged message behind in the store
            self._turn({})  # last commands and acks before the sockets close
            if self._degraded is None:
                batch = cast(Batch, self.core.out.batch)  # the core writes into ours
                self.hooks.events(batch, self.core.out.events)
                self.core.save_clock()
                try:
                    self.store.write(batch, sync=True)
                except StoreError as exc:
                    log.error("last write at close failed: %s (as after a crash: what it held "
                              "is redone after the next start)", exc)
        except BaseException as exc:  # noqa: BLE001
            self.failure = exc
            log.exception("servicebus engine stopped by an unexpected error")
        finally:
            self._shutdown()

    def _turn(self, events: dict) -> None:
        if self._degraded is None and not self.store.writable:
            self._degrade(StoreWriteError(self.store.failure or "the store refuses writes"))
        if self._degraded is not None:
            self._degraded_turn(events)
            return
        now = time.monotonic()
        core = self.core
        self._read(events, now)
        self._run_commands(now)
        if core.s.backfills:  # under the publishers' lock: nothing half published (starts.py)
            with self.publisher.quiet():
                core.backfill()
                self._swap_routes()
        self._swap_routes()  # new subscribers count for publishes from now on

        # commit: one fsync for everything this turn that someone waits on
        out = core.prepare(now)
        batch = cast(Batch, out.batch)  # the core writes into what store.batch() made
        if out.events:
            self.hooks.events(batch, out.events)
        if not batch.sync and self.store.unsynced_for(now) >= SYNC_INTERVAL:
            batch.sync = True  # idle turns come every TICK (0.1 s): the bound holds when idle
        handed = False
        if batch.ops or batch.sync:
            if out.handoff:
                self.dispatcher.reserve([item.id for item in out.handoff])
            try:
                if batch.sync and out.handoff:
                    # What was received is in LevelDB before a handler runs, and durable
                    # before it is acked; the handlers may start while the fsync runs (their
                    # writes queue behind it in LevelDB). A crash before the fsync ends
                    # leaves it unacked: resent, run again (README: the rerun bound).
                    self.store.write(batch, sync=False)
                    handed = True
                    self._hand_off(out.handoff)
                    self.store.sync()
                else:
                    self.store.write(batch, sync=batch.sync)
            except StoreError as exc:
                self._degrade(exc)  # nothing of this turn was released or acked
                return
            if batch.sync:
                self.fsyncs += 1
            batch = self.store.batch()
        done = core.committed(batch)

        # release
        for future, value in done.release:
            if not future.done():
                if isinstance(value, BaseException):  # a refused subscribe (handshake.py)
                    future.set_exception(value)
                else:
                    future.set_result(value)
        if len(done.release) > 1:
            # Several callers were waiting on this commit: let them run and queue their next
            # call before the next turn, so that it commits them together (group commit).
            os.sched_yield()  # releases the GIL (see commit.py)
        if done.handoff and not handed:
            self._hand_off(done.handoff)  # before the acks: a worker takes a while to wake up
        for ident, ids in done.acks.items():
            self.io.send_router(ident, P.encode_ack(ids))

        # send
        if core.advance(now):
            self.requests.expire(now)
            if self.sockets.keys is not None:
                self.io.switch_keys(now)
        self._swap_routes()
        self.io.send_frames(now)
        if self._drains:
            self._check_drains()
        if now >= self._next_mark:
            self._next_mark = now + MARK_INTERVAL
            try:
                self.store.mark()  # what synced writes made durable, outside the store too
            except StoreError:
                pass  # the store refuses writes now: the next turn degrades (as for any write)

    def _hand_off(self, items: list[Any]) -> None:
        self.dispatcher.submit(items)
        if self.hooks.handing_off:
            self.hooks.handed_off(items)

    def _swap_routes(self) -> None:
        """Hand the publishers the core's routes if it made new ones (model/routes.py)."""
        s = self.core.s
        if self.publisher.routes is not s.routes:
            self.publisher.routes = s.routes
            if s.full_changed:  # max_backlog: publishers waiting for room look again
                s.full_changed = False
                self.publisher.room_changed()

    def _read(self, events: dict, now: float) -> None:
        self._read_wake(events)
        if self._admin is not None and self._admin.sock in events:
            self._admin.read()
        self.io.read(events, now)

    def _read_wake(self, events: dict) -> None:
        if self._wake_fd in events:
            try:
                os.eventfd_read(self._wake_fd)
            except BlockingIOError:
                pass  # read by an earlier turn already

    # --- a store that cannot be written ---------------------------------------------------

    def _degrade(self, exc: BaseException) -> None:
        """A write failed (a full disk, an I/O error). What this turn would have done did
        not happen: nobody is released, nothing acked (what was handed to the handlers
        before a failed fsync is in LevelDB and runs as any stored message: if the reopen
        finds it gone, the sender resends it, and the dedupe set knows it if it ran). Until
        the store can be written again the engine neither receives (peers see it down and
        keep their messages) nor sends; every RECOVER_INTERVAL it tries to reopen the
        store, then reloads its delivery state from it, exactly as after a restart."""
        self._degraded = str(exc)
        self.core.s.counters["store_failures"] += 1
        log.error("the store cannot be written (%s): receiving and sending are paused; the bus "
                  "retries every %.1fs and goes on by itself once writing works", exc, RECOVER_INTERVAL)
        failed = StoreWriteError(f"the store cannot be written: {exc}")
        dropped = self.core.abandon()
        for future, _value in dropped.release:
            if not future.done():
                future.set_exception(failed)
        self.dispatcher.unreserve([item.id for item in dropped.handoff])
        self._next_recover = time.monotonic() + RECOVER_INTERVAL

    def _degraded_turn(self, events: dict) -> None:
        now = time.monotonic()
        self._read_wake(events)
        if self.sockets.monitor is not None and self.sockets.monitor in events:
            self.io.count_handshakes()
        if self._admin is not None and self._admin.sock in events:
            self._admin.read()
        failed = StoreWriteError(f"the store cannot be written: {self._degraded}")
        queue = self._queue
        while queue:
            cmd = queue.popleft()
            if isinstance(cmd, (SendCmd, SubscribeCmd)):
                if not cmd.future.done():
                    cmd.future.set_exception(failed)
            elif isinstance(cmd, Supersede):
                pass  # best effort: the older message is delivered too
            elif not isinstance(cmd, (Published, QueueReply, QueueSend)):  # in the store: reloaded
                self._engine_command(cmd, now)
        self.requests.expire(now)
        if now >= self._next_recover:
            self._next_recover = now + RECOVER_INTERVAL
            if self.store.writable or self.store.reopen():
                self._recover()

    def _recover(self) -> None:
        log.warning("the store can be written again (it had failed: %s); reloading delivery "
                    "state and going on", self._degraded)
        self._degraded = None
        # Publishing threads (retrying since the store failed) write again from the moment it
        # reopened. Reloading clears, then rebuilds, the subscriptions their writes go by: a
        # publish in between would store nothing. So none is built meanwhile (one reported
        # before is in the store, read from it).
        with self.publisher.exclusive():
            self._queue = deque(c for c in self._queue
                                if not isinstance(c, (Published, QueueReply, QueueSend, Supersede)))
            # As at a start: cursors, subscriptions, intents, stored replies ...
            self._queue.extend(self.core.reload(self.store.batch()))
            self._swap_routes()
        # ... and the handlers get whatever is stored and not in memory, off this thread.
        threading.Thread(target=self.dispatcher.refill, name="servicebus-refill", daemon=True).start()

    # --- user commands -----------------------------------------------------------------

    def _run_commands(self, now: float) -> None:
        queue, core = self._queue, self.core
        while queue:
            cmd = queue.popleft()
            try:
                if isinstance(cmd, (Published, SendCmd, QueueReply, QueueSend, SubscribeCmd, Supersede)):
                    core.command(cmd, now)
                else:
                    self._engine_command(cmd, now)
            except Exception as exc:  # a bad command fails its caller, not the engine
                if cmd.future is None:
                    raise
                if not cmd.future.done():
                    cmd.future.set_exception(exc)

    def _engine_command(self, cmd: Any, now: float) -> None:
        if isinstance(cmd, AdminReply):
            self.sockets.send_admin(cmd.ident, cmd.data)
        elif isinstance(cmd, Drain):
            self._drains.append(cmd.future)
        elif isinstance(cmd, Snapshot):
            cmd.future.set_result(self._snapshot(now))
        elif isinstance(cmd, Maintain):  # replay, purge: on this thread (maintain.py)
            maintain(self, cmd, now, self._degraded)
        else:
            raise TypeError(f"unknown engine command {cmd!r}")

    # --- drain and status --------------------------------------------------------------

    def idle(self) -> bool:
        if self._degraded is not None or self._queue or not self.core.idle() or len(self.requests):
            return False
        return self.dispatcher.idle

    def _check_drains(self) -> None:
        self._drains = [f for f in self._drains if not f.done()]
        if self._drains and self.idle():
            for fut in self._drains:
                fut.set_result(True)
            self._drains = []

    def _snapshot(self, now: float) -> dict:
        snap = self.core.snapshot(now)
        counters = Counter(snap["counters"])
        publisher = self.publisher
        counters["fsyncs"] += self.fsyncs + publisher.fsyncs
        counters["published"] += publisher.published
        if publisher.backlog_refused:
            counters["backlog_refused"] += publisher.backlog_refused
        counters["requests_expired"] += self.dispatcher.runner.requests_expired
        snap["counters"] = dict(counters)
        snap["store_error"] = self._degraded or self.store.failure
        return snap

    # --- shutdown ----------------------------------------------------------------------

    def _shutdown(self) -> None:
        self._stopping = True
        self.publisher.close()
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
        for fut in self.core.waiters():
            if not fut.done():
                fut.set_exception(err)
        self.requests.close(err)
        if self._admin is not None:
            self._admin.close()
        self.sockets.close()
