"""Ordered lanes: the messages of an ordered subscription (per ``key``, when published with
one) are handled one at a time, in id order, which is publish order (DESIGN.md; sender.py
keeps one frame of them in flight at a time).

A lane holds the message queued, running or waiting for a retry (its head) and the ones
after it, by id. While the store holds messages that are not in memory (the dispatcher's
overflow: the queue was full, or a handler registered late), a newer ordered message
waits in the store too, and a refill reads them all back in id order (dispatch.py,
refill.py). All calls are made under the dispatcher's lock.
"""

from __future__ import annotations

import heapq

from ..model.delivery import KEY_HEADER, ORDER_HEADER
from ..model.stored import Incoming

__all__ = ["LaneKey", "Lanes", "lane_of"]

LaneKey = tuple[str, str, "str | None"]


def lane_of(item: Incoming) -> LaneKey | None:
    """The lane of a message from an ordered subscription: (publisher, subscription,
    key); None for any other message."""
    headers = item.record.headers
    if not headers:
        return None
    order = headers.get(ORDER_HEADER)
    if type(order) is not str:
        return None
    key = headers.get(KEY_HEADER)
    return (item.record.reply_to, order, key if type(key) is str else None)


class _Lane:
    __slots__ = ("head", "waiting")

    def __init__(self) -> None:
        self.head: str | None = None  # queued, running or waiting for a retry
        self.waiting: list[tuple[str, float, Incoming]] = []  # after it: a heap by id


class Lanes:
    def __init__(self) -> None:
        self._lanes: dict[LaneKey, _Lane] = {}

    def __len__(self) -> int:
        return len(self._lanes)

    def queued(self) -> list[tuple[LaneKey, Incoming]]:
        """(lane, message) of every message waiting behind a lane's head."""
        return [(lane, item) for lane, state in self._lanes.items() for _mid, _due, item in state.waiting]

    def hold(self, lane: LaneKey) -> list[str]:
        """``lane``'s messages waiting behind its head go back to the store (they are
        stored): their ids, dropped here."""
        state = self._lanes.get(lane)
        if state is None:
            return []
        dropped = [mid for mid, _due, _item in state.waiting]
        state.waiting = []
        self._forget_empty(lane, state)
        return dropped

    def unhead(self, lane: LaneKey, message_id: str) -> None:
        """``message_id``, ``lane``'s head, went back to the store: it does not run now
        (a scan reads it again, in order)."""
        state = self._lanes.get(lane)
        if state is not None and state.head == message_id:
            state.head = None
            self._forget_empty(lane, state)

    def admit(self, item: Incoming, due: float, lane: LaneKey) -> bool:
        """Take ``item`` into its lane: True if it heads it (ready to run now), False if
        it waits behind the head."""
        state = self._lanes.get(lane)
        if state is None:
            state = self._lanes[lane] = _Lane()
        if state.head is None:
            state.head = item.id
            return True
        heapq.heappush(state.waiting, (item.id, due, item))
        return False

    def done(self, item: Incoming) -> tuple[float, Incoming] | None:
        """``item`` finished (handled, dead letter, parked): (due, its lane's next message)
        to run now, or None."""
        lane = lane_of(item)
        state = None if lane is None else self._lanes.get(lane)
        if state is None or state.head != item.id:
            return None
        if state.waiting:
            _mid, due, nxt = heapq.heappop(state.waiting)
            state.head = nxt.id
            return due, nxt
        state.head = None
        self._forget_empty(lane, state)  # type: ignore[arg-type]
        return None

    def _forget_empty(self, lane: LaneKey, state: _Lane) -> None:
        if state.head is None and not state.waiting:
            del self._lanes[lane]
