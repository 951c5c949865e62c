"""The web console (``servicebus console``; the ``console`` extra, aiohttp): services and
instances up or down, backlogs and rates over time, dead letters grouped by cause with
replay, edit-and-replay and purge, and the latest audit's verdict. README "Console"."""

from .server import Console

__all__ = ["Console"]
