"""``Gateway``: serve a bus over HTTP (aiohttp), in a thread of its own or in the foreground.

The bus given (the *front* bus) is what HTTP publishes, sends and requests go through, with
its durability. Pull and push subscribers live on a second bus the gateway opens in
``datadir`` (default ``<front datadir>/gateway``), which subscribes to the front bus (a bus
never subscribes itself) and to any other publisher a subscriber names as its ``source``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections import Counter
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web

from ..aioserve import LoopThread
from ..bus import Bus
from .app import Routes, make_app, reply
from .auth import load_tokens
from .openapi import document
from .pull import PullQueues
from .push import Pusher

__all__ = ["Gateway", "check_listen"]

log = logging.getLogger("servicebus.gateway")


def check_listen(listen: str, tokens: str | Path | None) -> tuple[str, int]:
    """(host, port) of ``listen``; ``ValueError`` if it is not host:port, or if it is
    beyond loopback without a tokens file."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not host or not 0 <= int(port) <= 65535:
        raise ValueError(f"listen must be host:port, not {listen!r}")
    host = host.strip("[]")
    if tokens is None and host not in ("127.0.0.1", "::1", "localhost"):
        raise ValueError("a gateway listening beyond loopback needs tokens= (a file of bearer tokens)")
    return host, int(port)


def _pull_address(datadir: Path) -> str:
    """A loopback port, the same at every start if it is free (kept in the data directory:
    the front bus owes its subscriptions to that address). If it is taken, another one:
    the pull bus is then found at its new address by discovery (it has a name and the
    front bus as its seed), and what the front bus owes it follows it."""
    kept = datadir / "gateway.address"
    if kept.exists():
        address = kept.read_text().strip()
        with socket.socket() as probe:
            # As ZeroMQ binds: a port whose connections wait in TIME_WAIT (a kill -9 leaves
            # them) is free for it; only a listening socket there takes it.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", int(address.rsplit(":", 1)[1])))
                return address
            except (OSError, ValueError, IndexError):
                pass
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    kept.write_text(address + "\n")
    return address


class Gateway(LoopThread):
    """``Gateway(bus, listen="127.0.0.1:8080", tokens="tokens.toml")``: routes in
    README "HTTP gateway". ``tokens``: a file of bearer tokens (gateway/auth.py); without
    one the gateway must listen on a loopback address. ``ssl``: an ``ssl.SSLContext`` for
    HTTPS. ``max_body``: bytes of a request body at most (default 1 MiB). ``threads``: bus
    calls in parallel (each waits on a shared fsync)."""

    thread_name = "servicebus-gateway-loop"

    def __init__(self, bus: Bus, *, listen: str = "127.0.0.1:8080", tokens: str | Path | None = None,
                 datadir: str | Path | None = None, ssl_context: ssl.SSLContext | None = None,
                 max_body: int = 1 << 20, threads: int = 32) -> None:
        super().__init__()
        self.host, self.port = check_listen(listen, tokens)
        self.tokens = load_tokens(tokens)
        if not 1024 <= max_body <= 64 << 20:
            raise ValueError("max_body must be from 1 KiB to 64 MiB")
        self.bus = bus
        self.datadir = Path(datadir) if datadir is not None else Path(bus.datadir) / "gateway"
        self.ssl_context = ssl_context
        self.max_body = max_body
        self.counters: Counter[str] = Counter()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="servicebus-gateway")
        self.pull: Bus | None = None
        self.url = ""

    # --- running ----------------------------------------------------------------------------------

    async def _run(self, *, foreground: bool) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._stopped = asyncio.Event()
        self.datadir.mkdir(parents=True, exist_ok=True)
        self.pull = pull = Bus(_pull_address(self.datadir), self.datadir, name="servicebus-gateway",
                               seeds=[self.bus.address])
        runner: web.AppRunner | None = None
        pusher: Pusher | None = None
        try:
            queues = PullQueues(pull, self.bus.address, loop)
            await self.call(queues.load)

            async def run(fn: Any, *args: Any, **kwargs: Any) -> Any:
                return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

            pusher = Pusher(queues, run, self.counters)
            routes = Routes(self.bus, queues, self.tokens, run, self.counters, self.max_body)
            original_put = queues.put_sub

            def put_and_push(*args: Any, **kwargs: Any) -> Any:
                made = original_put(*args, **kwargs)
                loop.call_soon_threadsafe(pusher.sync)
                return made
            queues.put_sub = put_and_push  # type: ignore[method-assign]
            extra = {"/health": self._health, "/metrics": self._metrics, "/openapi.json": self._openapi}
            app = make_app(routes, extra, self.max_body)
            runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
            await runner.setup()
            site = web.TCPSite(runner, self.host, self.port, ssl_context=self.ssl_context,
                               backlog=1024, reuse_address=True)
            await site.start()
            sockets = getattr(site._server, "sockets", None) or []  # the port, when 0 was asked
            port = sockets[0].getsockname()[1] if sockets else self.port
            scheme = "https" if self.ssl_context else "http"
            host = f"[{self.host}]" if ":" in self.host else self.host
            self.url = f"{scheme}://{host}:{port}"
            pusher.sync()
            log.info("gateway for %s at %s (subscribers on %s)", self.bus.address, self.url, pull.address)
            self._ready.set()
            await self._stopped.wait()
        finally:
            if pusher is not None:
                await pusher.close()
            if runner is not None:
                await runner.cleanup()
            await loop.run_in_executor(None, pull.close)
            self._ready.set()

    async def call(self, fn: Any, *args: Any) -> Any:
        assert self._loop is not None
        return await self._loop.run_in_executor(self._pool, fn, *args)

    def _serve(self) -> Coroutine[Any, Any, None]:
        return self._run(foreground=False)

    def serve_forever(self) -> None:
        """Serve in this thread until ``close()`` (from a signal handler, another thread)."""
        asyncio.run(self._run(foreground=True))

    def close(self) -> None:
        self._stop_loop()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- the routes that are the gateway's own ----------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        status = await self.call(self.bus.status)
        ok = status.store_error is None and self.pull is not None and not self.pull.closed
        return reply(200 if ok else 503, {"status": "ok" if ok else "degraded", "bus": self.bus.address,
                                          "store_error": status.store_error,
                                          "peers_up": sum(1 for p in status.peers if p.up)})

    async def _metrics(self, request: web.Request) -> web.Response:
        try:
            from prometheus_client import CollectorRegistry, generate_latest  # noqa: PLC0415 - the extra
            from prometheus_client.core import CounterMetricFamily  # noqa: PLC0415
        except ImportError:
            return reply(501, {"error": "metrics need prometheus_client: pip install 'servicebus[metrics]'",
                               "field": None})
        from ..hooks.metrics import register  # noqa: PLC0415 - needs prometheus_client

        counters = self.counters

        class GatewayCollector:
            def collect(self) -> Any:
                family = CounterMetricFamily("servicebus_gateway_messages", "messages through the gateway",
                                             labels=["what"])
                for what, value in sorted(counters.items()):
                    family.add_metric([what], value)
                yield family

        if not hasattr(self, "_registry"):
            self._registry = CollectorRegistry()
            register(self.bus, self._registry)
            self._registry.register(GatewayCollector())
        text = await self.call(generate_latest, self._registry)
        return web.Response(body=text, content_type="text/plain", charset="utf-8")

    async def _openapi(self, request: web.Request) -> web.Response:
        return reply(200, document(self.url))
