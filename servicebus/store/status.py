"""``Bus.status()``'s record, built from the engine's snapshot and counts read from the store.

Here rather than in the bus facade or the operators' tools: the bus needs it while it runs,
and the counts are the store's (a keyspace that cannot be read right now counts -1).
"""

from __future__ import annotations

from typing import Any

from ..errors import StoreError
from ..model.clock import wall_ms
from ..model.ids import id_millis
from ..model.records import BusStatus
from ..model.retention import Retention
from .db import Store

__all__ = ["live_status", "retained_summary"]


def live_status(store: Store, snap: dict[str, Any], *, node_id: str, address: str, datadir: str,
                running: bool, lock: dict[str, Any],
                admin: tuple[str | None, str | None] = (None, None)) -> BusStatus:
    """``Bus.status()``: the engine's snapshot (``snap``) and counts read from the store.
    A count the store cannot give right now is -1; ``store_error`` says why."""
    def count(keyspace: str) -> int:
        try:
            return store.count(keyspace)
        except StoreError:
            return -1

    def messages(keyspace: str) -> int:
        try:
            return store.count_messages(keyspace)
        except StoreError:
            return -1

    pending_by: dict[str, int] = {}
    for peer, stream, floor, acked in snap["consumers"]:
        try:
            n = store.count_stream(stream, after=floor, skip=acked)
        except StoreError:
            n = -1
        pending_by[peer] = n if n < 0 else pending_by.get(peer, 0) + n
    return BusStatus(
        node_id=node_id,
        address=address,
        datadir=datadir,
        running=running,
        subscriptions=count("subscriptions"),
        intents=count("intents"),
        intents_unconfirmed=snap["intents_unconfirmed"],
        outgoing=messages("outgoing"),
        pending=-1 if any(n < 0 for n in pending_by.values()) else sum(pending_by.values()),
        pending_by_subscriber=pending_by,
        incoming=messages("incoming"),
        deadletters=count("deadletters"),
        handled=count("handled"),
        malformed=sum(snap["malformed"].values()),
        malformed_by_reason=snap["malformed"],
        refused_by_reason={k.removeprefix("refused_"): v for k, v in snap["counters"].items()
                           if k.startswith(("refused_", "handshake_failed")) and k != "refused_oversize"},
        peers=snap["peers"],
        lock=lock,
        store_error=snap["store_error"],
        backlog_full=snap.get("backlog_full", ()),
        admin_endpoint=admin[0],
        admin_off_reason=admin[1],
        retained=_retained(store, snap),
    )


def _retained(store: Store, snap: dict[str, Any]) -> dict[str, dict[str, Any]]:
    rules, max_bytes = snap.get("retention") or ({}, 0)
    if not rules:
        return {}
    try:
        return retained_summary(store, rules, max_bytes, wall_ms())
    except StoreError:
        return {}


def retained_summary(store: Store, rules: dict[str, float], max_bytes: int, now_ms: int) -> dict[str, dict[str, Any]]:
    """Per retained topic (model/retention.py): messages and bytes kept, the age of the
    oldest, and its retention. Reads each retained stream once (operator calls only)."""
    retention = Retention(rules, max_bytes)
    out: dict[str, dict[str, Any]] = {}
    for stream in store.stream_names():
        ms = retention.stream_ms(stream)
        if not ms:
            continue
        topic = stream[2:].split(" ", 1)[0]
        entry = out.setdefault(topic, {"messages": 0, "bytes": 0, "oldest_age_s": None,
                                       "retention_s": ms / 1000, "max_bytes": max_bytes})
        entry["messages"] += store.count_stream(stream)
        after: str | None = None
        while chunk := store.iter_stream(stream, after=after, limit=1000):
            if after is None:
                age = max(0.0, (now_ms - id_millis(chunk[0][0])) / 1000)
                entry["oldest_age_s"] = age if entry["oldest_age_s"] is None else max(age, entry["oldest_age_s"])
            entry["bytes"] += sum(len(record) for _mid, record in chunk)
            after = chunk[-1][0]
    return out
