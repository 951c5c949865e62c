"""An HTTP gateway for services not written in Python (the ``gateway`` extra: aiohttp).

``Gateway(bus, listen="127.0.0.1:8080", tokens="tokens.toml").start()`` or
``servicebus gateway DATADIR --listen 0.0.0.0:8080 --tokens tokens.toml``: publish, send and
request over HTTP with the bus's durability, pull subscribers as blockqueue has them (long
polls, visibility, acks, dead letters), push subscribers (signed webhooks), counts,
``/health``, ``/metrics`` and ``/openapi.json``. README "HTTP gateway".
"""

from __future__ import annotations

from .auth import load_tokens
from .push import sign
from .server import Gateway

__all__ = ["Gateway", "load_tokens", "sign"]
