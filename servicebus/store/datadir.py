"""Names of the files a running bus keeps in its data directory beside ``store/``.

They live here, in the lowest layer that knows the data directory, because both sides read
or write them: the bus writes them as it starts and removes them as it closes, and the
operators' tools (``ops/``) read them to find the live bus, without either importing the
other. The lock (``LOCK``, lockfile.py) and the high-water mark (``store.hwm``, mark.py)
are named beside the code that owns them.
"""

from __future__ import annotations

__all__ = ["ENDPOINT_FILE", "OFF_FILE"]

ENDPOINT_FILE = "admin.endpoint"  # the live bus's admin endpoint
OFF_FILE = "admin.off"  # instead, when it runs without one: why
