"""Serving the admin endpoint inside a running bus: requests are read on the engine
thread, views run on one thread beside it (a view of a big store can take a while), and
their replies go back through the engine's queue, since only the engine sends on sockets.
The operations that write (replay, purge, kick, readmit: maintain.py) are queued for the
engine itself; the fleet view asks the engine for discovery's table (maintain.MEMBERS)."""

from __future__ import annotations

import functools
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from .maintain import COUNTERS, MEMBERS, OPS, Maintain
from ..ops import admin as A
from ..ops.export import export_rows
from ..ops.views import run_view
from ..errors import BusClosedError
from ..store import Store

__all__ = ["AdminServer", "AdminReply"]

log = logging.getLogger("servicebus")

READ_LIMIT = 100  # requests read per turn
EXPORT_PAGE = 1000  # export rows per reply
EXPORT_IDLE = 60.0  # seconds an export the CLI stopped asking for stays open
EXPORTS = 4  # exports open at once, at most
MEMBERS_TIMEOUT = 10.0  # seconds the view thread waits for the engine's fleet table


@dataclass
class AdminReply:
    ident: bytes
    data: bytes
    future: Future | None = None


class AdminServer:
    def __init__(self, sock: zmq.Socket, store: Store, datadir: Path,
                 submit: Callable[[Any], None], queue: Callable[[Any], None]) -> None:
        self.sock = sock
        self.store = store
        self.datadir = datadir
        self._submit = submit  # from the view thread: refused once the engine stopped
        self._queue = queue  # from the engine thread
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="servicebus-admin")
        self._exports: dict[str, tuple[Iterator[dict], float]] = {}  # cursor -> (rows, last use)

    def read(self) -> None:
        for _ in range(READ_LIMIT):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            ident = frames[0]
            try:
                view, args = A.decode_request(frames[-1])
            except Exception as exc:  # noqa: BLE001 - junk on the admin socket
                self._queue(AdminReply(ident, A.encode_reply(error=f"bad request: {exc}")))
                continue
            if view in OPS:  # it writes: the engine runs it, on its own thread
                future: Future = Future()
                future.add_done_callback(functools.partial(self._done, ident))
                self._queue(Maintain(view, args, future))
                continue
            self._pool.submit(self._run_view, ident, view, args)

    def _done(self, ident: bytes, future: Future) -> None:
        """Reply for an operation the engine ran (on its thread, or failed at close)."""
        exc = future.exception()
        data = A.encode_reply(error=f"{type(exc).__name__}: {exc}") if exc is not None else \
            A.encode_reply(future.result())
        try:
            self._submit(AdminReply(ident, data))
        except BusClosedError:
            pass

    def _run_view(self, ident: bytes, view: str, args: dict) -> None:
        try:
            if view == A.EXPORT_VIEW:
                rows = self._export_page(args.get("cursor"))
            else:
                live: dict[str, Any] = {"pid": os.getpid()}
                if view == "fleet":  # discovery's table as the core has it now (ops/fleet.py)
                    live["members"] = self._members()
                elif view == "status":  # what the console's rates are made of
                    live["counters"] = self._ask(COUNTERS)
                rows = run_view(self.store, self.datadir, view, args, live)
            data = A.encode_reply(rows)
        except Exception as exc:  # noqa: BLE001 - any failure goes back to the operator
            data = A.encode_reply(error=f"{type(exc).__name__}: {exc}")
        try:
            self._submit(AdminReply(ident, data))
        except BusClosedError:
            pass

    def _members(self) -> dict[str, Any]:
        """``{"on": discovery on, "rows": Core.members.view}``, asked of the engine (its
        thread owns the core) from the view thread; a closing bus fails it."""
        return self._ask(MEMBERS)

    def _ask(self, what: str) -> dict[str, Any]:
        """A read-only answer of the engine (MEMBERS, COUNTERS), from the view thread."""
        future: Future = Future()
        self._submit(Maintain(what, {}, future))
        return dict(future.result(timeout=MEMBERS_TIMEOUT)[0])

    def _export_page(self, cursor: object) -> list[dict]:
        """The next EXPORT_PAGE rows of an export (a new one without ``cursor``). Runs on
        the view thread only: the open exports need no lock."""
        now = time.monotonic()
        for key, (_rows, used) in list(self._exports.items()):
            if now - used > EXPORT_IDLE:
                del self._exports[key]
        if cursor is None:
            if len(self._exports) >= EXPORTS:
                raise ValueError(f"{EXPORTS} exports are open already; try again in a minute")
            cursor, rows = os.urandom(8).hex(), export_rows(self.store)
        else:
            entry = self._exports.pop(str(cursor), None)
            if entry is None:
                raise ValueError("this export is unknown or was idle too long; start it again")
            rows = entry[0]
        page = list(itertools.islice(rows, EXPORT_PAGE))
        if len(page) < EXPORT_PAGE:
            return [{"rows": page, "cursor": None}]
        self._exports[str(cursor)] = (rows, now)
        return [{"rows": page, "cursor": cursor}]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
