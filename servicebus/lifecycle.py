"""Opening and closing a ``Bus``, and the plumbing its calls share.

Opening: create the data directory, take its lock, open the store, bind the ROUTER, then
start the handler workers, the engine thread and the hooks. Closing reverses that: stop
taking work, let running handlers finish (bounded), stop the engine after a last commit,
detach the hooks (the journal flushes), fsync, close the store, release the lock. Every
step is on one ``ExitStack``: a failure while opening closes exactly what was opened.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Self

import msgpack

from . import forks
from .engine import loop as E
from .engine.keys import load_keys
from .engine.seeds import SeedFinder
from .engine.sockets import Sockets
from .errors import BusClosedError, BusError, LockedError, StoreError
from .handling.dispatch import Dispatcher
from .handling.requests import PendingRequests
from .handling.timeouts import Watchdog
from .handling.transaction import KeyValue
from .hooks.base import Hook, Hooks
from .hooks.journal import Journal, flush_datadir
from .hooks.watch import Watches
from .model.config import BusConfig
from .model.packer import pack
from .model.records import BusStatus
from .model.stored import ReplyRecord
from .store.datadir import ENDPOINT_FILE, OFF_FILE
from .store import Store
from .store.lockfile import DataDirLock
from .wire.validation import validate_bind

__all__ = ["Lifecycle"]

log = logging.getLogger("servicebus")


class _View:
    """What hooks may read of a bus (hooks/base.py's ``BusView``)."""

    def __init__(self, bus: "Lifecycle") -> None:
        self._bus = bus
        self.address = bus.address
        self.node_id = bus.node_id
        self.datadir = bus.datadir

    @property
    def closed(self) -> bool:
        return self._bus.closed

    def counters(self) -> dict[str, int]:
        return self._bus.counters()

    def status(self) -> BusStatus:
        return self._bus.status()

    @property
    def store(self) -> Store:
        return self._bus._store

    def handlers(self) -> list[tuple[str, str]]:
        return self._bus._dispatcher.handlers()


class Lifecycle:
    """The opening, closing and plumbing half of ``Bus`` (bus.py has its calls)."""

    config: BusConfig
    address: str
    node_id: str

    def _commit_kv(self, build: Callable[[Any], None]) -> None:
        raise NotImplementedError  # bus.py

    def counters(self) -> dict[str, int]:
        raise NotImplementedError  # bus.py

    def status(self) -> BusStatus:
        raise NotImplementedError  # bus.py

    def __init__(self, bind: str, datadir: str | os.PathLike, **options: Any) -> None:
        self.config = config = BusConfig.of(options)
        validate_bind(bind, config.advertise)
        self.datadir = Path(datadir)
        self._closed = False
        self._pid = os.getpid()
        self._forked = False  # this is a fork()ed child's copy (forks.py)
        self.metrics_address: str | None = None  # with metrics_port: where they are served
        # Observers (hooks/base.py): the journal, tracing and once/any/all waits are hooks
        # like the application's own, which come after them.
        builtin: list[Hook] = []
        if config.tracing:
            from .hooks.tracing import Tracing  # ImportError naming the extra without it

            builtin.append(Tracing())
        self._watches = Watches()  # Bus.once/any/all
        self.hooks = Hooks([*builtin, self._watches, *config.hooks])
        self._close_lock = threading.Lock()
        self._watchdog = Watchdog()  # handler time limits; its thread starts on first use
        self._lock: DataDirLock | None = None
        # Set by _open; a Bus whose opening failed is never handed out.
        self._store: Store
        self._dispatcher: Dispatcher
        self._engine: E.Engine | None = None
        # The service's own state in this bus's store (transaction.py); in a handler,
        # message.kv is the same state, written with the handler's completion.
        self.kv: KeyValue
        # Everything opened is closed by this stack, in reverse: a failure at any step of
        # opening closes exactly what was opened before it, and close() is the same unwind.
        self._resources = ExitStack()
        forks.watch(self)
        try:
            self._open(bind, self._resources)
        except BaseException:
            self._closed = True
            self._resources.close()
            raise

    def _open(self, bind: str, stack: ExitStack) -> None:
        try:
            self.datadir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create data directory {self.datadir}: {exc.strerror}") from exc
        if not os.access(self.datadir, os.W_OK | os.X_OK):
            raise StoreError(f"data directory {self.datadir} is not writable")
        self._lock = lock = DataDirLock.acquire(self.datadir, address=bind)
        stack.callback(lock.release)
        self._store = store = _open_store(self.datadir / "store", self.config.store_compression)
        stack.callback(self._close_store, store)
        node = store.meta("node")
        if node is None:
            node = os.urandom(8).hex()
            batch = store.batch()
            batch.put_meta("node", node.encode())
            store.write(batch, sync=True)
        self.node_id = node
        _durable_secret(store)
        clock = store.bus_clock()

        keys = load_keys(self.config.keys) if self.config.keys is not None else None
        sockets = Sockets(self.config, keys)
        stack.callback(self._destroy_sockets, sockets)  # closes every socket it made, then terms
        endpoint = sockets.bind_router(bind)
        admin_endpoint = sockets.bind_admin(self.datadir)
        self._admin = (admin_endpoint, sockets.admin_off)  # (endpoint, or why there is none)
        self.address = self.config.advertise or endpoint
        lock.update(self.address)
        before = store.get_meta("address")
        if before is not None and before.decode() != self.address and not self.config.name:
            log.warning("this bus was at %s and is at %s now, without a name: nothing follows it here "
                        "(what publishers owe %s waits there); give it name=... to be followed when it moves",
                        before.decode(), self.address, before.decode())
        if self.config.journal and before is not None and before.decode() != self.address:
            # Events a crash left unmoved happened at the address the bus had then: moved
            # out under its new one, the audit would pair them with the wrong receiver.
            try:
                flush_datadir(store, self.datadir)
            except Exception as exc:  # noqa: BLE001 - a full disk: the journal moves them later
                log.error("journal events of %s not moved out before starting at %s: %s",
                          before.decode(), self.address, exc)
        batch = store.batch()
        batch.put_meta("address", self.address.encode())  # for offline journal flushes
        # What is retained, for the offline tools (servicebus status): empty when nothing.
        batch.put_meta("retention", msgpack.packb(
            [self.config.retention or {}, self.config.retention_bytes] if self.config.retention else []))
        batch.put_meta("max_payload", str(self.config.max_payload).encode())  # for offline replay edits
        store.write(batch, sync=False)

        hooks = self.hooks
        if self.config.journal:  # first: its events ride in every batch before others look
            hooks.prepend(Journal(store, self.datadir, self.node_id, self.address,
                                  retention=self.config.journal_retention, clock=clock,
                                  name=self.config.name))
        stack.callback(hooks.detach)  # after the engine's last turn (the journal flushes it)
        self._requests = PendingRequests()
        self._dispatcher = dispatcher = Dispatcher(
            store, self.config, on_idle=self._wake, requests=self._requests,
            on_reply=self._reply_ready, hooks=hooks, clock=clock)
        self._engine = engine = E.Engine(
            config=self.config, store=store, clock=clock, sockets=sockets,
            address=self.address, node_id=self.node_id, dispatcher=dispatcher,
            requests=self._requests, hooks=hooks, datadir=self.datadir)
        stack.callback(self._stop_engine, engine)
        staging = dispatcher.runner.staging
        staging.publisher = engine.publisher  # message.publish/send commit with the handler's run
        staging.outgoing = hooks.outgoing
        self.kv = KeyValue(store, self._commit_kv, staging.kv_lock, self.config.max_payload,
                           self._check_open)
        stack.callback(self._remove_endpoint_files)
        if admin_endpoint is not None:
            (self.datadir / OFF_FILE).unlink(missing_ok=True)
            (self.datadir / ENDPOINT_FILE).write_text(admin_endpoint + "\n")
        else:
            # The CLI reads why, rather than wait on an endpoint that is not there.
            log.warning("bus starts without its admin endpoint: %s", sockets.admin_off)
            (self.datadir / ENDPOINT_FILE).unlink(missing_ok=True)
            (self.datadir / OFF_FILE).write_text(f"{sockets.admin_off}\n")
        dispatcher.start()
        stack.callback(dispatcher.close, self.config.close_timeout)  # first thing close() does
        engine.start()
        self._start_seeds(engine, stack)
        hooks.attach(_View(self))  # the journal's first flush moves what a crash left behind
        if self.config.metrics_port is not None:
            from .hooks.metrics import serve  # ImportError naming the extra without it

            server, _thread = serve(self, self.config.metrics_port, self.config.metrics_bind)
            self.metrics_address = f"http://{self.config.metrics_bind}:{server.server_port}/metrics"
            stack.callback(server.server_close)
            stack.callback(server.shutdown)
        log.info("bus %s up at %s (data %s)", self.node_id, self.address, self.datadir)

    def _start_seeds(self, engine: E.Engine, stack: Any) -> None:
        """Seeds that need a lookup (dns://, mdns://) are found on a thread of their own."""
        def found(addresses: list[str]) -> None:
            try:
                engine.submit(E.Maintain("seeds", {"addresses": addresses}, Future()))
            except BusError:
                pass  # closing

        finder = SeedFinder(self.config.seeds, address=self.address, node_id=self.node_id,
                            name=self.config.name, found=found)
        if finder.needed:
            finder.start()
            stack.callback(finder.close)

    # --- closing, step by step (run by the stack in reverse order of opening) ----------------

    def _stop_engine(self, engine: E.Engine) -> None:
        if engine.ident is None:  # made but never started: nothing runs, release its fd
            engine.close_wake()
            return
        engine.stop(self.config.close_timeout)
        if engine.is_alive():
            log.error("the engine did not stop within %.1fs; its sockets are left open",
                      self.config.close_timeout)
            return
        engine.close_wake()

    def _remove_endpoint_files(self) -> None:
        (self.datadir / ENDPOINT_FILE).unlink(missing_ok=True)
        (self.datadir / OFF_FILE).unlink(missing_ok=True)
        (self.datadir / "admin.sock").unlink(missing_ok=True)  # where versions up to 0.1 put it

    def _destroy_sockets(self, sockets: Sockets) -> None:
        if self._engine is not None and self._engine.is_alive():
            return  # its sockets belong to a thread that is still running: never close them under it
        sockets.destroy()  # every socket it made, including ones a failed open left

    def _close_store(self, store: Store) -> None:
        try:
            store.sync()
        except StoreError as exc:
            log.error("final sync failed: %s", exc)
        store.close()

    def _wake(self) -> None:
        if self._engine is not None:
            self._engine.wake()

    def _reply_ready(self, command_id: str, reply: ReplyRecord) -> None:
        # Called on a worker thread once a request's reply is stored. If the engine has
        # stopped, the stored reply is queued by the next start instead.
        engine = self._engine
        if engine is None:
            return
        try:
            engine.submit(E.QueueReply(command_id, reply))
        except BusClosedError:
            pass

    # --- plumbing ----------------------------------------------------------------------

    def _orphan(self) -> None:
        """In a fork()ed child (forks.py): every call raises ``BusForkedError``."""
        self._forked = True

    def _check_open(self) -> E.Engine:
        if self._forked:
            raise forks.forked_error("Bus", self._pid)
        engine = self._engine
        if self._closed or engine is None:
            raise BusClosedError("the bus is closed")
        if engine.failure is not None:
            raise engine.broken()
        return engine

    def _call(self, make: Callable[[Future], Any], timeout: float | None = None) -> Any:
        engine = self._check_open()
        future: Future = Future()
        engine.submit(make(future))
        return self._wait(future, timeout)

    def _wait(self, future: Future, timeout: float | None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = 0.5 if deadline is None else min(0.5, max(0.0, deadline - time.monotonic()))
            try:
                return future.result(step)
            except FutureTimeout:
                engine = self._engine
                if engine is not None and engine.failure is not None:
                    raise engine.broken() from None
                if engine is None or not engine.is_alive():
                    raise BusClosedError("the bus closed before this call completed") from None
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    @property
    def closed(self) -> bool:
        return self._closed

    # --- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Stop taking work, let running handlers finish (up to ``close_timeout``), make
        everything durable, close the store and release the lock. Idempotent."""
        if self._forked:
            # The parent's to close: here its threads are gone and its locks may be held.
            self._closed = True
            return
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._resources.close()
        self._watchdog.close()
        log.info("bus %s closed", getattr(self, "node_id", "?"))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Bus {getattr(self, 'address', '?')} {self.datadir} {state}>"

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and not self._forked:
            log.warning("%r was never closed", self)


STORE_BUSY_WAIT = 10.0  # seconds a starting bus waits for a reader to close its store


def _open_store(path: Path, compression: bool) -> Store:
    """The bus's store. Holding DATADIR/LOCK, no other bus has it; LevelDB's own lock held
    means a reader that does not take DATADIR/LOCK has it open for a moment (the web console
    or a read-only command reading a stopped bus): the bus waits for it rather than fail."""
    deadline = time.monotonic() + STORE_BUSY_WAIT
    while True:
        try:
            return Store.open(path, compression=compression)
        except LockedError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.02)


def _durable_secret(store: Store) -> None:
    """Discovery's secret (core/members.py: what this bus proves itself with) on disk and
    fsynced before anything can send a proof made with it. A proof goes out with the turn
    that makes it (core/proofs.py), whose write is not fsynced: a power cut that then lost
    the secret would bring this bus back with another, refused for good by every bus that
    kept the first proof."""
    raw = store.get_meta("members")
    try:
        record = msgpack.unpackb(raw, raw=False) if raw else {}
    except (ValueError, TypeError, msgpack.ExtraData):
        return  # a damaged table: the core starts over, secret and all (`servicebus check`)
    if not isinstance(record, dict):
        return
    secret = record.get("secret")
    if isinstance(secret, bytes) and len(secret) == 16:
        return
    record["secret"] = os.urandom(16)
    batch = store.batch()
    batch.put_meta("members", pack(record))
    store.write(batch, sync=True)
