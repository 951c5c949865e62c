"""``Bus``: the thread-safe public face of one embedded bus, and its lifecycle.

Opening a bus: create the data directory, take its lock, open the store, bind the ROUTER,
then start the handler workers and the engine thread. Closing reverses that: stop taking
work, let running handlers finish (bounded), stop the engine after a last commit, fsync,
close the store, release the lock.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import zmq

from . import engine as E
from .config import BusConfig
from .delivery import event_stream
from .dispatch import Dispatcher
from .errors import BusClosedError, StoreError, SubscribeTimeout
from .lockfile import DataDirLock
from .protocol import Kind, encode_payload, validate_address
from .records import BusStatus, Message
from .store import Store
from .topics import validate_topic

__all__ = ["Bus"]

log = logging.getLogger("servicebus")

Handler = Callable[[Any, Message], Any]

_BIND_TCP = re.compile(r"^tcp://(?P<host>\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(?P<port>\*|[0-9]{1,5})$")
_WILDCARD_HOSTS = {"*", "0.0.0.0", "[::]"}


def _check_bind(bind: object, advertise: str | None) -> None:
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


class Bus:
    """An embedded, durable service bus. See the README for the guarantees.

    ``Bus(bind, datadir, **options)``: ``bind`` is this bus's ZeroMQ address
    (``tcp://host:port``; port ``0`` picks a free one), ``datadir`` the directory holding
    its store and lock. ``options`` are the fields of ``BusConfig``.
    """

    def __init__(self, bind: str, datadir: str | os.PathLike, **options: Any) -> None:
        self.config = config = BusConfig(**options)
        _check_bind(bind, config.advertise)
        self.datadir = Path(datadir)
        self._closed = False
        self._close_lock = threading.Lock()
        self._lock: DataDirLock | None = None
        self._store: Store | None = None
        self._ctx: zmq.Context | None = None
        self._engine: E.Engine | None = None
        self._dispatcher: Dispatcher | None = None
        try:
            self._open(bind)
        except BaseException:
            self._teardown()
            raise

    def _open(self, bind: str) -> None:
        try:
            self.datadir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create data directory {self.datadir}: {exc.strerror}") from exc
        if not os.access(self.datadir, os.W_OK | os.X_OK):
            raise StoreError(f"data directory {self.datadir} is not writable")
        self._lock = DataDirLock.acquire(self.datadir, address=bind)
        self._store = store = Store.open(self.datadir / "store")
        node = store.get_meta("node")
        if node is None:
            node = os.urandom(8).hex().encode()
            batch = store.batch()
            batch.put_meta("node", node)
            store.write(batch, sync=True)
        self.node_id = node.decode()

        self._ctx = zmq.Context()
        router, endpoint = E.open_router(self._ctx, bind, self.config)
        self.address = self.config.advertise or endpoint
        self._lock.update(self.address)

        self._dispatcher = Dispatcher(store, self.config, on_idle=self._wake)
        self._engine = E.Engine(config=self.config, store=store, context=self._ctx, router=router,
                                address=self.address, node_id=self.node_id,
                                dispatcher=self._dispatcher)
        self._dispatcher.start()
        self._engine.start()
        log.info("bus %s up at %s (data %s)", self.node_id, self.address, self.datadir)

    def _wake(self) -> None:
        if self._engine is not None:
            self._engine.wake()

    # --- plumbing ----------------------------------------------------------------------

    def _check_open(self) -> E.Engine:
        if self._closed or self._engine is None:
            raise BusClosedError("the bus is closed")
        return self._engine

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
                if self._engine is None or not self._engine.is_alive():
                    raise BusClosedError("the bus engine stopped") from None
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    # --- publishing --------------------------------------------------------------------

    def publish(self, topic: str, payload: Any) -> str:
        """Store ``payload`` for every subscriber of ``topic``; return its message id.

        Returns only after the message is fsynced. Subscriptions are those this bus has
        confirmed when the call reaches the engine; with none, nothing is stored.
        """
        return self.publish_many(topic, [payload])[0]

    def publish_many(self, topic: str, payloads: Iterable[Any]) -> list[str]:
        """Like ``publish`` for a list, with one fsync for all of it; returns the ids."""
        validate_topic(topic)
        bodies = [encode_payload(p) for p in payloads]
        limit = self.config.max_payload
        for body in bodies:
            if len(body) > limit:
                raise ValueError(f"payload is {len(body)} bytes encoded; max_payload is {limit}")
        if not bodies:
            self._check_open()
            return []
        return self._call(lambda f: E.Publish(topic, bodies, f))

    # --- subscribing -------------------------------------------------------------------

    def subscribe(self, address: str, topic: str, *, wait: float | None = None) -> None:
        """Ask the bus at ``address`` to send this bus its ``topic`` events.

        The request is stored durably and retried until the publisher confirms it, across
        restarts of either side. Idempotent: call it on every start. With ``wait``, block
        until confirmed, raising ``SubscribeTimeout`` after ``wait`` seconds (the request
        stays stored and keeps being retried).
        """
        self._intent(address, topic, "subscribe", wait)

    def unsubscribe(self, address: str, topic: str, *, wait: float | None = None) -> None:
        """Stop ``topic`` events from ``address``; durable and retried like ``subscribe``."""
        self._intent(address, topic, "unsubscribe", wait)

    def _intent(self, address: str, topic: str, op: str, wait: float | None) -> None:
        validate_address(address)
        validate_topic(topic)
        confirmed: Future | None = Future() if wait is not None else None
        self._call(lambda f: E.SubscribeCmd(address, topic, op, f, confirmed))
        if confirmed is not None:
            try:
                self._wait(confirmed, wait)
            except FutureTimeout:
                raise SubscribeTimeout(
                    f"{op} of {topic!r} at {address} not confirmed within {wait}s; "
                    "it stays stored and is retried") from None

    # --- handlers ----------------------------------------------------------------------

    def every(self, topic: str, handler: Handler | None = None) -> Any:
        """Run ``handler(payload, message)`` for each ``topic`` event (also a decorator).

        Returning marks the message done; raising retries it with backoff, then moves it
        to the dead letters. Several handlers on one topic: done when all returned.
        """
        validate_topic(topic)

        def register(fn: Handler) -> Handler:
            if not callable(fn):
                raise TypeError(f"handler must be callable, not {type(fn).__name__}")
            self._check_open()
            self._dispatcher.register(Kind.EVENT, topic, fn)
            return fn

        return register if handler is None else register(handler)

    # --- state -------------------------------------------------------------------------

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until nothing is pending anywhere: every subscriber acknowledged, every
        received message handled (or dead-lettered), every subscribe confirmed. Returns
        False if that did not happen within ``timeout`` seconds."""
        engine = self._check_open()
        if self._dispatcher.in_worker():
            # The running handler is itself pending work: this would wait for itself.
            raise RuntimeError("drain() cannot be called from inside a handler")
        future: Future = Future()
        engine.submit(E.Drain(future))
        try:
            return bool(self._wait(future, timeout))
        except FutureTimeout:
            future.cancel()
            return False

    def status(self) -> BusStatus:
        """A frozen snapshot of counts per store, peers and the lock owner."""
        snap = self._call(lambda f: E.Snapshot(f))
        store = self._store
        pending_by: dict[str, int] = {}
        for peer, stream, floor, acked in snap["consumers"]:
            n = max(0, store.count_stream(stream, after=floor) - acked)
            pending_by[peer] = pending_by.get(peer, 0) + n
        return BusStatus(
            node_id=self.node_id,
            address=self.address,
            datadir=str(self.datadir),
            running=not self._closed,
            subscriptions=store.count("subscriptions"),
            intents=store.count("intents"),
            intents_unconfirmed=snap["intents_unconfirmed"],
            outgoing=store.count("outgoing"),
            pending=sum(pending_by.values()),
            pending_by_subscriber=pending_by,
            incoming=store.count("incoming"),
            deadletters=store.count("deadletters"),
            handled=store.count("handled"),
            malformed=sum(snap["malformed"].values()),
            malformed_by_reason=snap["malformed"],
            peers=snap["peers"],
            lock=dict(self._lock.owner.__dict__) if self._lock else {},
        )

    def counters(self) -> dict[str, int]:
        """Engine counters since start (published, sent, received, acked, fsyncs, ...)."""
        snap = self._call(lambda f: E.Snapshot(f))
        return dict(snap["counters"])

    @property
    def closed(self) -> bool:
        return self._closed

    # --- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Stop taking work, let running handlers finish (up to ``close_timeout``), make
        everything durable, close the store and release the lock. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._teardown()
        log.info("bus %s closed", getattr(self, "node_id", "?"))

    def _teardown(self) -> None:
        self._closed = True
        if self._dispatcher is not None:
            self._dispatcher.close(self.config.close_timeout)
        if self._engine is not None:
            if self._engine.is_alive():
                self._engine.stop()
            elif self._engine.ident is None:
                self._engine.router.close(linger=0)
        if self._store is not None:
            try:
                self._store.sync()
            except StoreError as exc:
                log.error("final sync failed: %s", exc)
            self._store.close()
        if self._ctx is not None:
            self._ctx.term()
        if self._lock is not None:
            self._lock.release()

    def __enter__(self) -> "Bus":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Bus {getattr(self, 'address', '?')} {self.datadir} {state}>"

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            log.warning("%r was never closed", self)
