"""``Console``: serve the web console for some data directories, in a thread of its own or in
the foreground, reading each of them every ``interval`` seconds."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from collections.abc import Coroutine, Sequence
from typing import Any

from aiohttp import web

from ..aioserve import LoopThread
from ..ops.letters import ADMIN_TIMEOUT
from .app import Settings, make_app
from .sources import Source

__all__ = ["Console", "check_listen", "is_loopback"]

log = logging.getLogger("servicebus.console")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_listen(listen: str) -> tuple[str, int]:
    """(host, port) of ``host:port``; ``ValueError`` if it is not one."""
    host, sep, port = listen.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"listen must be host:port, not {listen!r}")
    return host, int(port)


class Console(LoopThread):
    """``Console(["/var/lib/orders", ...], listen="127.0.0.1:8470", write=False)``.

    ``write``: the replay, edit-and-replay and purge buttons work (read-only without it).
    ``token``: needed on every API call; bound beyond loopback one is made if none is given
    (``token`` then says it, and ``url`` carries it). ``audit``: the folder of the latest
    ``servicebus audit --out``, whose verdict is shown and whose report is served.
    ``interval``: seconds between two readings of each data directory (default 2)."""

    thread_name = "servicebus-console-loop"

    def __init__(self, datadirs: Sequence[str | Path], *, listen: str = "127.0.0.1:8470", write: bool = False,
                 token: str | None = None, audit: str | Path | None = None, interval: float = 2.0) -> None:
        if not datadirs:
            raise ValueError("name at least one data directory")
        if not 0.2 <= interval <= 3600:
            raise ValueError("interval must be from 0.2 to 3600 seconds")
        super().__init__()
        if token is not None and len(token) < 16:
            raise ValueError("a token must be at least 16 characters")
        self.host, self.port = check_listen(listen)
        self.loopback = is_loopback(self.host)
        self.token = token if token is not None or self.loopback else secrets.token_urlsafe(24)
        self.write = write
        self.interval = interval
        self.audit = Path(audit) if audit is not None else None
        self.sources = [Source(i, Path(d), interval) for i, d in enumerate(datadirs)]
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="servicebus-console")
        # A thread for each data directory: a bus that does not answer (frozen, SIGSTOP) holds
        # up its own reads and actions, never another's nor the page's.
        self._pools = [ThreadPoolExecutor(1, thread_name_prefix=f"servicebus-console-{s.index}") for s in self.sources]
        self._sampled = threading.Event()
        self._read: set[int] = set()
        self.url = ""

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop, self._stopped = loop, asyncio.Event()

        async def run(fn: Any, *args: Any) -> Any:
            """``fn(*args)`` off the loop: a source's method on that source's own thread."""
            owner = getattr(fn, "__self__", None)
            pool = self._pools[owner.index] if isinstance(owner, Source) else self._pool
            return await loop.run_in_executor(pool, fn, *args)

        settings = Settings(self.sources, write=self.write, token=self.token, hosts=None,
                            audit=self.audit, interval=self.interval, run=run)
        runner = web.AppRunner(make_app(settings), access_log=None, handler_cancellation=True)
        await runner.setup()
        samplers: list[asyncio.Task] = []
        try:
            site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
            await site.start()
            sockets = getattr(site._server, "sockets", None) or []  # the port, when 0 was asked
            port = sockets[0].getsockname()[1] if sockets else self.port
            host = f"[{self.host}]" if ":" in self.host else self.host
            if self.loopback:  # a page of another site must not reach us by a name it controls
                settings.hosts = {f"{h}:{port}" for h in (host, "localhost", "127.0.0.1", "[::1]")}
            self.url = f"http://{host}:{port}/" + (f"#token={self.token}" if self.token else "")
            samplers = [asyncio.create_task(self._sample(run, src)) for src in self.sources]
            self._ready.set()
            await self._stopped.wait()
        finally:
            for sampler in samplers:
                sampler.cancel()
            await runner.cleanup()
            self._ready.set()

    async def _sample(self, run: Any, src: Source) -> None:
        """Read ``src`` every interval, on its own: a bus slow to answer slows only itself,
        and a directory that cannot be read (a symlink loop...) is said, not the end of it."""
        while True:
            try:
                await run(src.read)
            except Exception as exc:  # noqa: BLE001 - shown on the page; the next read tries again
                src.failed(exc)
            self._read.add(src.index)
            if len(self._read) == len(self.sources):
                self._sampled.set()
            await asyncio.sleep(self.interval)

    def wait_sampled(self, timeout: float = 30.0) -> bool:
        """Wait until every data directory was read once (for tests and scripts)."""
        return self._sampled.wait(timeout)

    def _serve(self) -> Coroutine[Any, Any, None]:
        return self._run()

    def close(self) -> None:
        self._stop_loop()
        pools = (self._pool, *self._pools)
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)
        # Then wait for their threads, but not for ever: a read of a frozen bus ends at
        # its admin timeout (ops/letters.py), after which its thread ends too.
        deadline = time.monotonic() + ADMIN_TIMEOUT + 5
        for pool in pools:
            for thread in list(getattr(pool, "_threads", ())):
                thread.join(max(0.0, deadline - time.monotonic()))
