"""``Bus.status()``'s record, built from the engine's snapshot and counts read from the store.

Here rather than in the bus facade or the operators' tools: the bus needs it while it runs,
and the counts are the store's (a keyspace that cannot be read right now counts -1).
"""

from __future__ import annotations

from typing import Any

from ..errors import StoreError
from ..model.records import BusStatus
from .db import Store

__all__ = ["live_status"]


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
    )
