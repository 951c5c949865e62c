"""Helpers of the HTTP gateway's tests (tests/integration/test_gateway*.py): a plain HTTP
client (http.client: what any non-Python client sees, no aiohttp on the client side) and
a gateway run in this process."""

from __future__ import annotations

import http.client
import json
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

from servicebus import Bus
from servicebus.gateway import Gateway
from servicebus.testing import free_address

__all__ = ["call", "running_gateway", "raw", "wait_for"]


def call(url: str, method: str, path: str, body: Any = None, *, headers: dict[str, str] | None = None,
         timeout: float = 15.0) -> tuple[int, Any]:
    """``(status, body)``: the body parsed as JSON (strictly: NaN is not JSON) when it is
    JSON, else the text. ``body``: bytes as they are, anything else as JSON."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        raw_body = response.read()
    finally:
        conn.close()
    if response.getheader("Content-Type", "").startswith("application/json"):
        return response.status, json.loads(raw_body, parse_constant=_not_json)
    return response.status, raw_body.decode(errors="replace")


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (RFC 8259): a strict client fails here")


def raw(url: str, request: bytes, *, timeout: float = 10.0) -> bytes:
    """Send ``request`` as it is on a fresh connection; the whole answer (until close)."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(request)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    """``predicate()`` until truthy, or AssertionError at the deadline (polls at 20 ms)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


@contextmanager
def running_gateway(datadir: Path, *, address: str | None = None, **options: Any) -> Iterator[Gateway]:
    """A bus at ``address`` (a free one by default) in ``datadir``/front with its gateway
    on a free loopback port; both closed at the end. ``gateway.bus`` is the bus."""
    bus = Bus(address or free_address(), datadir / "front")
    try:
        with Gateway(bus, listen=options.pop("listen", "127.0.0.1:0"), **options) as gateway:
            yield gateway
    finally:
        bus.close()
