"""``Bus.once`` / ``any`` / ``all``: wait in a script or a test for events to arrive.

A watch sees events this bus receives (durably stored, acknowledged) after it was made,
on topics matching its patterns; it does not handle them (handlers still run, or the
message waits for one) and it is not durable: it is a wait in memory. A hook: the engine
offers it each turn's hand-off, which it looks at only while a watch exists.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ..model.stored import Incoming
from ..wire.payload import decode_payload
from ..wire.protocol import KIND_NAMES, Kind
from ..model.records import Message
from ..model.segments import bodies_of
from ..wire.topics import matches
from .base import Hook

__all__ = ["Watches", "Watch"]


class Watch:
    def __init__(self, patterns: tuple[str, ...], need_all: bool) -> None:
        self.patterns = patterns
        self.need_all = need_all
        self.got: dict[str, tuple[Any, Message]] = {}  # pattern -> its first event
        self.done = threading.Event()

    def offer(self, topic: str, event: Any) -> None:
        for pattern in self.patterns:
            if pattern not in self.got and matches(pattern, topic):
                self.got[pattern] = event
                if not self.need_all or len(self.got) == len(self.patterns):
                    self.done.set()
                return


class Watches(Hook):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watches: list[Watch] = []

    @property
    def active(self) -> bool:
        return bool(self._watches)

    def add(self, patterns: tuple[str, ...], need_all: bool) -> Watch:
        watch = Watch(patterns, need_all)
        with self._lock:
            self._watches = [*self._watches, watch]
        return watch

    def remove(self, watch: Watch) -> None:
        with self._lock:
            self._watches = [w for w in self._watches if w is not watch]

    def handed_off(self, items: Sequence[Incoming]) -> None:
        """Received messages (engine thread, after they are stored)."""
        watches = self._watches
        if not watches:
            return
        for item in items:
            record = item.record
            if record.kind != Kind.EVENT:
                continue
            try:
                bodies = bodies_of(record.blob)
            except Exception:  # noqa: BLE001 - checked on receipt; a handler will say
                continue
            for mid, body in zip(record.ids, bodies):  # each message of the segment, in order
                for watch in watches:
                    if watch.done.is_set():
                        continue
                    message = Message(mid, record.topic, record.sender, record.reply_to, record.sent,
                                      0, record.headers, KIND_NAMES[Kind.EVENT], None, record.expires)
                    try:
                        payload = decode_payload(body)
                    except Exception:  # noqa: BLE001 - a dead letter when a handler gets it
                        continue
                    watch.offer(record.topic, (payload, message))
