"""Pull subscribers (as blockqueue has them) on a bus of their own, durable in its kv.

The gateway's *pull bus* subscribes to the topics pull subscribers want (from the gateway's
own bus, where HTTP publishes go, and from any other publisher named in the subscriber's
``source``). Its handler copies each event into the queue of every pull subscriber of the
topic through ``message.kv``: stored in the same atomic write as the handled mark, so each
event is queued once per subscriber whatever crashes (the bus's exactly-once state,
README "Transactions").

Keys (``\\x1f`` between parts: topics and names cannot hold it):
``gw/sub|topic|name`` -> options; ``gw/msg|topic|name|id`` -> a queued message;
``gw/dead|topic|name|id`` -> a dead letter.

A read makes the messages it returns invisible for ``visibility`` seconds and counts an
attempt, both stored (fsynced, one write per read) before the response goes out; a message
read ``max_attempts`` times and not acknowledged in time is a dead letter instead of being
read again. Acks delete (one write per request). In memory: per subscriber, its queued ids
in order with their visibility, rebuilt from the kv at start; what a handler queues is
taken only once the kv has it (a handler's writes land when it returns).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..bus import Bus
from ..errors import BusError

__all__ = ["PullQueues", "Sub", "SEP", "check_sub_name"]

log = logging.getLogger("servicebus.gateway")

SEP = "\x1f"
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")  # not "." or "..": URLs drop those
MAX_VISIBILITY = 12 * 3600.0
MAX_ATTEMPTS = 1000
# How far back from the newest an arrival is put in id order: the pull bus's handler
# threads queue one publisher's messages a few places out of order; an old one arriving
# behind a long backlog (its publisher was down) goes no further back than this.
REORDER = 256
HOLD_PLACE = 2.0  # s a message queued by a handler whose write has not landed stays first


def check_sub_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError("subscriber name must be 1-100 characters of A-Z a-z 0-9 . _ -, "
                         "not starting with a dot")
    return name


@dataclass
class Sub:
    topic: str
    name: str
    max_attempts: int = 5
    visibility: float = 30.0
    source: str | None = None
    push: dict[str, Any] | None = None  # {"url", "secret"} for a webhook (push.py)
    created: int = 0
    # id -> [attempts, visible at (epoch s)]: everything queued. ``ready``: the ids that may
    # be read now, in order; ``later``: (visible at, id) of those read and not acked, a heap.
    # A read costs what it returns, not what is queued. Changed on the loop thread only.
    queue: dict[str, list[float]] = field(default_factory=dict)
    ready: dict[str, None] = field(default_factory=dict)
    later: list[tuple[float, str]] = field(default_factory=list)
    # queued by a handler, not yet confirmed in kv -> until when it keeps its place in order
    pending: dict[str, float] = field(default_factory=dict)
    dead: int = 0
    deleted: bool = False
    waiters: list[asyncio.Future] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"gw/sub{SEP}{self.topic}{SEP}{self.name}"

    def msg_key(self, mid: str) -> str:
        return f"gw/msg{SEP}{self.topic}{SEP}{self.name}{SEP}{mid}"

    def dead_key(self, mid: str) -> str:
        return f"gw/dead{SEP}{self.topic}{SEP}{self.name}{SEP}{mid}"

    def options(self) -> dict[str, Any]:
        out: dict[str, Any] = {"max_attempts": self.max_attempts, "visibility": self.visibility,
                               "created": self.created}
        if self.source:
            out["source"] = self.source
        if self.push:
            out["push"] = self.push
        return out

    def due(self, now: float) -> None:
        """Those whose invisibility ended are ready again."""
        while self.later and self.later[0][0] <= now:
            visible_at, mid = heapq.heappop(self.later)
            entry = self.queue.get(mid)
            if entry is not None and entry[1] == visible_at:
                self.ready[mid] = None

    def make_ready(self, mid: str) -> None:
        """``mid`` readable, in id (publish) order among the last ``REORDER`` ready ones."""
        ready = self.ready
        moved: list[str] = []
        while ready and len(moved) < REORDER:
            last = next(reversed(ready))
            if last < mid:
                break
            ready.popitem()  # the newest: dicts pop in LIFO order
            moved.append(last)
        ready[mid] = None
        for later in reversed(moved):
            ready[later] = None

    def counts(self, now: float) -> dict[str, Any]:
        self.due(now)
        inflight = len(self.queue) - len(self.ready)
        return {"name": self.name, "topic": self.topic, "unpublished": len(self.queue) - inflight,
                "in_flight": inflight, "dead_letters": self.dead, "max_attempts": self.max_attempts,
                "visibility_duration": f"{self.visibility:g}s", "source": self.source,
                "push": (self.push or {}).get("url")}


class PullQueues:
    def __init__(self, pull: Bus, front_address: str, loop: asyncio.AbstractEventLoop) -> None:
        self.pull = pull
        self.front = front_address
        self.loop = loop
        self.subs: dict[tuple[str, str], Sub] = {}
        self._handled: set[str] = set()  # topics the pull bus has a handler for
        self._lock = threading.Lock()  # subs as the handler threads see them
        self._kv_lock = threading.Lock()  # a read's commit and an ack of the same message

    # --- state ------------------------------------------------------------------------------

    def load(self) -> None:
        kv = self.pull.kv
        for key, value in kv.items(f"gw/sub{SEP}"):
            _, topic, name = key.split(SEP)
            sub = Sub(topic, name, value["max_attempts"], value["visibility"], value.get("source"),
                      value.get("push"), value.get("created", 0))
            self.subs[(topic, name)] = sub
        for key, value in kv.items(f"gw/msg{SEP}"):
            _, topic, name, mid = key.split(SEP)
            owner = self.subs.get((topic, name))
            if owner is not None:
                visible_at = float(value.get("visible_at", 0.0))
                owner.queue[mid] = [value.get("attempts", 0), visible_at]
                if visible_at:
                    heapq.heappush(owner.later, (visible_at, mid))
                else:
                    owner.ready[mid] = None
        for key in (k for k, _v in kv.items(f"gw/dead{SEP}")):
            _, topic, name, _mid = key.split(SEP)
            if (topic, name) in self.subs:
                self.subs[(topic, name)].dead += 1
        for sub in self.subs.values():
            self._listen(sub)

    def _listen(self, sub: Sub) -> None:
        """The pull bus handles ``sub.topic`` and is subscribed to where it comes from: to
        the front bus confirmed before this returns (what is published through the gateway
        after a subscriber was made reaches it); to a ``source`` stored and retried (it
        may be down now)."""
        if sub.topic not in self._handled:
            self._handled.add(sub.topic)
            self.pull.every(sub.topic, self._on_event, name=f"gateway@{sub.topic}")
        self.pull.subscribe(self.front, sub.topic, wait=30)
        if sub.source:
            self.pull.subscribe(sub.source, sub.topic)

    def put_sub(self, topic: str, name: str, max_attempts: int, visibility: float,
                source: str | None = None, push: dict[str, Any] | None = None) -> tuple[Sub, bool]:
        """Make (or change the options of) a subscriber; durable when it returns."""
        if not 1 <= max_attempts <= MAX_ATTEMPTS:
            raise ValueError(f"max_attempts must be 1-{MAX_ATTEMPTS}")
        if not 0.1 <= visibility <= MAX_VISIBILITY:
            raise ValueError("visibility_duration must be from 100ms to 12h")
        with self._lock:
            found = self.subs.get((topic, name))
            created = found is None
            sub = found if found is not None else Sub(topic, name, created=int(time.time() * 1000))
            sub.max_attempts, sub.visibility, sub.source, sub.push = max_attempts, visibility, source, push
            self.pull.kv[sub.key] = sub.options()
            self.subs[(topic, name)] = sub
        self._listen(sub)
        return sub, created

    def delete_sub(self, topic: str, name: str) -> bool:
        with self._lock:
            sub = self.subs.pop((topic, name), None)
        if sub is None:
            return False
        sub.deleted = True
        with self.pull.transaction() as tx:
            tx.kv.delete(sub.key)
            for mid in list(sub.queue):  # one C call: no arrival slips in between
                tx.kv.delete(sub.msg_key(mid))
            for key, _v in self.pull.kv.items(f"gw/dead{SEP}{topic}{SEP}{name}{SEP}"):
                tx.kv.delete(key)
        for waiter in sub.waiters:
            if not waiter.done():
                waiter.set_result(None)
        return True

    # --- arriving (handler threads of the pull bus) ----------------------------------------------

    def _on_event(self, payload: Any, message: Any) -> None:
        with self._lock:
            subs = [s for s in self.subs.values() if s.topic == message.topic]
        if not subs:
            return
        record = {"payload": payload, "headers": {k: v for k, v in message.headers.items()
                                                   if not k.startswith("sb-")} or None,
                  "published": message.sent_ms, "attempts": 0, "visible_at": 0.0,
                  "from": message.reply_to}
        for sub in subs:
            message.kv[sub.msg_key(message.id)] = record
        self.loop.call_soon_threadsafe(self._arrived, subs, message.id)

    def _arrived(self, subs: list[Sub], mid: str) -> None:
        for sub in subs:
            if sub.deleted or mid in sub.queue:
                continue
            sub.queue[mid] = [0, 0.0]
            sub.make_ready(mid)
            sub.pending[mid] = time.monotonic() + HOLD_PLACE
            self._wake(sub)

    def _wake(self, sub: Sub) -> None:
        waiters, sub.waiters = sub.waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    # --- reading ---------------------------------------------------------------------------------

    def _fetch(self, sub: Sub, ids: list[str]) -> list[tuple[str, dict[str, Any] | None]]:
        """The stored records of ``ids`` (a pool thread: kv reads only)."""
        return [(mid, self.pull.kv.get(sub.msg_key(mid))) for mid in ids]

    async def read(self, sub: Sub, limit: int, run: Any) -> list[dict[str, Any]]:
        """Up to ``limit`` messages, each made invisible and its attempt counted, stored
        (one fsynced write) before they are returned; those whose attempts ran out become
        dead letters instead. The caller holds the subscriber's read lock.

        The ids stay in ``ready``, in their places, until that write succeeded: a read
        cancelled or failed on the way (a push loop stopped, a full disk) leaves them as
        they were. A message whose handler's write has not landed yet holds its place and
        the ones after it (up to HOLD_PLACE), so that a read never skips ahead of it."""
        now = time.time()
        sub.due(now)
        ids: list[str] = []
        for mid in sub.ready:
            if len(ids) >= limit:
                break
            ids.append(mid)
        if not ids:
            return []
        fetched = await run(self._fetch, sub, ids)
        taken: list[dict[str, Any]] = []
        dead: list[tuple[str, dict]] = []
        for mid, record in fetched:
            entry = sub.queue.get(mid)
            if entry is None or mid not in sub.ready:
                sub.ready.pop(mid, None)
                continue  # acked or deleted meanwhile
            if record is None:
                held = sub.pending.get(mid)
                if held is None:  # gone from the kv and not on its way: forget it
                    del sub.queue[mid]
                    del sub.ready[mid]
                    continue
                if held > time.monotonic():
                    break  # its handler's write has not landed: it and those after it wait
                del sub.ready[mid]  # a handler failing again and again holds up no one
                sub.ready[mid] = None
                continue
            sub.pending.pop(mid, None)
            if entry[0] >= sub.max_attempts:
                dead.append((mid, record))
                continue
            attempts = int(entry[0])
            record["attempts"] = attempts + 1
            # A webhook that failed waits longer each time (up to 5 minutes); a reader
            # that did not ack gets it back after the visibility duration, as it asked.
            wait = min(300.0, sub.visibility * 2 ** attempts) if sub.push else sub.visibility
            record["visible_at"] = now + wait
            taken.append({"id": mid, **record})
        acked: set[str] = set()
        if taken or dead:
            acked = await run(self._commit, sub, taken, dead)  # raises: nothing changed here either
        for item in taken:
            sub.ready.pop(item["id"], None)
            entry = sub.queue.get(item["id"])
            if entry is not None and item["id"] not in acked:
                entry[0], entry[1] = item["attempts"], item["visible_at"]
                heapq.heappush(sub.later, (item["visible_at"], item["id"]))
        for mid, _record in dead:
            sub.ready.pop(mid, None)
            if sub.queue.pop(mid, None) is not None and mid not in acked:
                sub.dead += 1
        return [item for item in taken if item["id"] not in acked] if acked else taken

    def _commit(self, sub: Sub, taken: list[dict[str, Any]], dead: list[tuple[str, dict]]) -> set[str]:
        """A pool thread. Under the lock acks take too: a message acked while this read
        was on its way is not written back (a restart would have read it again); its id
        is returned."""
        kv, acked = self.pull.kv, set()
        with self._kv_lock, self.pull.transaction() as tx:
            for item in taken:
                key = sub.msg_key(item["id"])
                if kv.get(key) is None:
                    acked.add(item["id"])
                    continue
                tx.kv[key] = {k: v for k, v in item.items() if k != "id"}
            for mid, record in dead:
                if kv.get(sub.msg_key(mid)) is None:
                    acked.add(mid)
                    continue
                tx.kv.delete(sub.msg_key(mid))
                tx.kv[sub.dead_key(mid)] = {**record, "error": f"not acknowledged after {record.get('attempts')} reads",
                                            "at": int(time.time() * 1000)}
        return acked

    def ack(self, sub: Sub, ids: list[str]) -> list[str]:
        """Delete the messages ``ids`` (durable when it returns; a pool thread: kv writes
        only); returns the ids not queued. ``acked`` then forgets them (loop thread)."""
        known = [mid for mid in ids if mid in sub.queue]
        if known:
            with self._kv_lock, self.pull.transaction() as tx:
                for mid in known:
                    tx.kv.delete(sub.msg_key(mid))
        return [mid for mid in ids if mid not in known]

    def acked(self, sub: Sub, ids: list[str]) -> None:
        for mid in ids:
            sub.queue.pop(mid, None)
            sub.ready.pop(mid, None)
            sub.pending.pop(mid, None)

    def next_visible(self, sub: Sub) -> float | None:
        """When the next invisible message becomes visible again (epoch s), or None."""
        return sub.later[0][0] if sub.later else None

    async def wait(self, sub: Sub, timeout: float) -> None:
        """Until something arrives for ``sub``, a message turns visible, or ``timeout``."""
        waiter = self.loop.create_future()
        sub.waiters.append(waiter)
        due = self.next_visible(sub)
        if due is not None:
            timeout = min(timeout, max(0.0, due - time.time()) + 0.005)
        if sub.pending:  # queued by a handler whose write has not landed yet: look again soon
            timeout = min(timeout, 0.005)
        try:
            await asyncio.wait_for(waiter, timeout)
        except (asyncio.TimeoutError, BusError):
            pass
        finally:
            if waiter in sub.waiters:
                sub.waiters.remove(waiter)
