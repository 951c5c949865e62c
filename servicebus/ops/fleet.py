"""``servicebus fleet``: the topology as one bus's discovery knows it (core/members.py), and
what each instance that subscribes to this bus is owed here.

One view (views.py ``fleet``) serves a live bus (its admin endpoint's view thread, with the
table the engine's core has now: ``live["members"]``, engine/maintain.py ``MEMBERS``) and a
stopped one (the table it stored, meta ``members``); the rest comes from the store either
way, so both print the same. Also the offline half of ``servicebus readmit`` (the kicked
list is a stored record the bus loads at start).
"""

from __future__ import annotations

from typing import Any

import msgpack

from ..model.clock import wall_ms
from ..model.ids import id_millis
from ..model.members import SERVICE
from ..model.packer import pack
from ..store import Store
from ..store.cursors import consumers

__all__ = ["fleet", "readmit_stored"]


def fleet(store: Store, subscribers: list[dict], live: dict | None) -> list[dict]:
    """One row: ``discovery`` (on or off), ``live`` (the running bus's table, or the one a
    stopped bus stored), ``node`` (this bus's id) and ``instances``: a row per instance,
    this bus's own first (``self``), with what it is owed here (``subscribers``: the rows
    of views.view_subscribers), and a row per kick that names no instance known."""
    node_raw = store.get_meta("node")
    node = node_raw.decode() if node_raw else None
    stored = _stored(store)
    kicked: dict[str, str] = {str(k): str(v) for k, v in (stored.get("kicked") or {}).items()}
    members = (live or {}).get("members")
    if members is not None:
        on, is_live, rows = bool(members.get("on")), True, [_live_row(r) for r in members.get("rows") or []]
    else:
        is_live, rows = False, [_stored_row(e, node) for e in stored.get("members") or [] if isinstance(e, dict)]
        on = bool(rows or kicked)
    if not on:
        return [{"discovery": False, "live": is_live, "node": node, "instances": []}]
    owed = _owed(store, subscribers, {r["address"] for r in rows if not r["self"]})
    matched: set[str] = set()
    for row in rows:
        keys = (row["node"], SERVICE + row["service"], row["address"])
        why = row.pop("kicked", None) or next((kicked[k] for k in keys if k in kicked), None)
        matched.update(k for k in keys if k in kicked)
        row.update(kicked=why, live=is_live, **owed.get(row["address"], _NOT_OWED))
        if row["self"]:
            row.update(_NOT_OWED)
    rows.sort(key=lambda r: (not r["self"], r["service"], r["node"]))
    rows += [_kick_row(key, why, is_live) for key, why in sorted(kicked.items()) if key not in matched]
    return [{"discovery": True, "live": is_live, "node": node, "instances": rows}]


_NOT_OWED: dict[str, Any] = {"subscriber": False, "topics": [], "backlog": None, "oldest_pending_age_s": None,
                             "last_ack": None, "deadletters": 0}


def _stored(store: Store) -> dict[str, Any]:
    found = store.meta("members")
    return found if isinstance(found, dict) else {}


def _row(entry: dict, self_: bool, up: bool | None, since: Any, silent: Any) -> dict[str, Any]:
    return {"service": str(entry.get("name") or ""), "node": str(entry.get("node") or ""),
            "address": str(entry.get("address") or ""), "self": self_, "up": up, "since": since,
            "silent": silent, "version": entry.get("v") or "", "publishes": list(entry.get("pub") or []),
            "subscribes": list(entry.get("sub") or []), "via": entry.get("via")}


def _live_row(entry: dict) -> dict[str, Any]:
    """A row of ``Directory.view`` (core/members.py), as the running bus has it."""
    self_ = bool(entry.get("self"))
    row = _row(entry, self_, True if self_ else bool(entry.get("up")), entry.get("since"), entry.get("silent"))
    row["kicked"] = entry.get("kicked")
    return row


def _stored_row(entry: dict, node: str | None) -> dict[str, Any]:
    """An entry of the stored table: as the bus believed it when it last stored it (a
    stopped bus is down itself, and knows nothing of how long the others were silent)."""
    if entry.get("node") == node:
        return _row(entry, True, False, None, None)
    return _row(entry, False, bool(entry.get("up")), entry.get("since"), None)


def _kick_row(key: str, why: str, is_live: bool) -> dict[str, Any]:
    """A kick that names no instance in the table (an address, or a service none of whose
    instances is known any more)."""
    service = key[len(SERVICE):] if key.startswith(SERVICE) else ""
    address = key if "://" in key else ""
    node = "" if service or address else key
    return {**_row({"name": service, "node": node, "address": address}, False, None, None, None),
            "kicked": why, "live": is_live, **_NOT_OWED}


def _owed(store: Store, subscribers: list[dict], addresses: set[str]) -> dict[str, dict[str, Any]]:
    """For each address of ``addresses`` subscribed here: its topics, the messages it is
    owed, the age of the oldest, its last ack and its dead letters here."""
    out: dict[str, dict[str, Any]] = {}
    for sub in subscribers:
        if sub["address"] in addresses:
            out[sub["address"]] = {"subscriber": True, "topics": sub["topics"] + (["(commands)"] if sub["commands"] else []),
                                   "backlog": sub["pending"], "oldest_pending_age_s": None,
                                   "last_ack": sub["last_ack"], "deadletters": 0}
    if not addresses:
        return out
    now = wall_ms()
    for c in consumers(store):
        if c.peer not in out:
            continue
        first = next(c.pending_ids(store), None)  # a segment's key is its oldest message's id
        if first is not None:
            age = max(0.0, (now - id_millis(first)) / 1000)
            row = out[c.peer]
            row["oldest_pending_age_s"] = max(age, row["oldest_pending_age_s"] or 0.0)
    letters: dict[str, int] = {}
    for _mid, rec in store.deadletters():
        peer = rec.get("peer")
        if peer in addresses:
            letters[peer] = letters.get(peer, 0) + 1
    for address, n in letters.items():
        out.setdefault(address, {**_NOT_OWED})["deadletters"] = n
    return out


def readmit_stored(store: Store, target: str) -> list[str]:
    """Readmit ``target`` (as ``Directory.readmit``: the key itself or ``svc:<target>``) in
    the table a stopped bus stored; the bus loads it at start. Returns the keys removed
    (none: ``target`` was not kicked, and nothing is written)."""
    raw = store.get_meta("members")
    stored = _stored(store) if raw else {}
    kicked = dict(stored.get("kicked") or {})
    found = [k for k in (target, SERVICE + target) if k in kicked]
    if not found:
        return []
    for key in found:
        del kicked[key]
    assert raw is not None
    record = msgpack.unpackb(raw, raw=False)  # as it was, but for the kicks
    record["kicked"] = kicked
    batch = store.batch()
    batch.put_meta("members", pack(record))
    store.write(batch, sync=True)
    return found
