"""What a damaged store lost, by message id: ``servicebus check --repair`` of files LevelDB
cannot read, and of a store that lost writes it had made durable (ops/repair.py).

LevelDB's repair (``repair_files``) rebuilds the store from every table and log entry it
can still read and sets the rest aside in ``store/lost/``. What it could not read is found
by comparing the delivery journal (segment files outside LevelDB, and the records the store
still holds: what this bus still owed, sent or received) with what the rebuilt store holds:
those ids are reported as lost, by id.

The journal names a segment's messages in one event (``ids``, model/segments.py); it is read
as one event per id, remembering each message's segment key (the first id of the event that
published or received it): the stored streams, cursors and acks go by those keys.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CorruptRecordError
from ..hooks.segments import LINES, ROLES, is_segment, read_segment
from ..model.delivery import base_stream, command_stream, event_stream, group_peer
from ..model.stored import DeliveryRecord
from ..store import Store, schema
from ..store.keys import seq_name

__all__ = ["Problem", "Owed", "journal_owed", "repair_files", "lost_in_repair", "lost_writes"]

Progress = Callable[[int], None] | None


@dataclass(frozen=True)
class Problem:
    keyspace: str
    key: str
    problem: str
    action: str = ""  # what --repair did about it


def lost_writes(store: Store, datadir: Path, progress: Progress = None) -> list[Problem]:
    """After a store lost writes it had made durable (its mark is behind, or it is gone):
    every message the journal says was owed and the store no longer holds, then the store
    is accepted as it is (its mark catches up)."""
    rows = lost_in_repair(store, journal_owed(datadir, progress))
    if not (datadir / "journal").is_dir():
        rows.append(Problem("*", "journal", "no delivery journal to compare the store with",
                            "the messages lost cannot be listed by id"))
    store.accept_marks()
    return rows


@dataclass
class Owed:
    """What the journal says this bus still owed: sent and not acknowledged (id -> peers,
    with the stream), received and not handled (ids), by message id; and the key of the
    segment each message was stored in (the first id of the event that published or
    received it): cursors, acks and the receiver's records go by those keys."""

    sent: dict[tuple[str, str], str] = field(default_factory=dict)  # (id, peer) -> stream
    received: set[str] = field(default_factory=set)
    keys: dict[str, str] = field(default_factory=dict)  # id -> its segment's key
    events: int = 0


def _apply(owed: Owed, event: str, role: str, ids: list[str], topic: str | None, kind: str,
           peer: str) -> None:
    """One journal event, about the messages ``ids`` (a segment's: the first is its key)."""
    owed.events += 1
    if role == "sender":
        if event == "published":
            stream = event_stream(topic or "") if kind == "event" else command_stream(peer)
            for mid in ids:
                owed.sent[(mid, peer)] = stream
                owed.keys[mid] = ids[0]
        elif event in ("acked", "expired"):
            for mid in ids:
                owed.sent.pop((mid, peer), None)
    elif event in ("received", "replayed"):
        for mid in ids:
            owed.received.add(mid)
            owed.keys[mid] = ids[0]
    elif event in ("handled", "deadlettered", "expired"):
        owed.received.difference_update(ids)


def _ids(mid: Any, more: Any) -> list[str]:
    """The messages an event names: ``ids`` when it names several (``id`` their first)."""
    if isinstance(more, (list, tuple)) and more and all(isinstance(m, str) for m in more):
        return list(more)
    if not isinstance(mid, str):
        raise TypeError("an event's id is a str")
    return [mid]


def _segment_events(path: Path) -> Iterator[dict]:
    """The events of a segment file. A line of the line format (.jsonl) is one event, its
    ``ids`` kept: their first is the key of the segment they were stored in, which
    read_segment's one event per message would lose."""
    if not path.name.endswith(LINES):
        yield from read_segment(path)
        return
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                e = json.loads(line)
            except ValueError:
                continue  # a torn last line: the segment was being written
            if isinstance(e, dict):
                yield e


def journal_owed(datadir: Path, progress: Progress = None) -> Owed:
    """Replay the journal's segment files (outside LevelDB, so they survive damage to it)."""
    owed = Owed()
    journal = datadir / "journal"
    for path in sorted(p for p in journal.iterdir() if is_segment(p.name)) if journal.is_dir() else ():
        for e in _segment_events(path):  # a line that does not parse (a torn last one) is skipped
            try:
                _apply(owed, e["event"], e["role"], _ids(e["id"], e.get("ids")), e.get("topic"),
                       e["kind"], e["peer"])
            except (ValueError, KeyError, TypeError):
                continue
        if progress:
            progress(owed.events)
    return owed


def _add_stored_journal(owed: Owed, store: Store) -> None:
    """Events the store still held (not yet moved to segments when the damage happened)."""
    for _seq, packed in store.journal_records(1 << 62, 1 << 62):
        try:
            # The name only goes into the error, which is dropped here.
            events = schema.decode_record("journal", seq_name(0), packed)
        except CorruptRecordError:
            continue
        for ev in events:  # 8 fields, and a 9th, ids, when it names a segment's messages
            name, _ts, mid, topic, kind, peer = ev[:6]
            event, role = ROLES.get(name, (name, "sender"))
            try:
                _apply(owed, event, role, _ids(mid, ev[8] if len(ev) > 8 else None), topic, kind, peer)
            except TypeError:
                continue


def repair_files(store_path: Path) -> list[Problem]:
    """LevelDB's repair; returns what it says about it (files it set aside)."""
    lost_dir = store_path / "lost"
    before = set(os.listdir(lost_dir)) if lost_dir.is_dir() else set()
    Store.repair(store_path)
    after = set(os.listdir(lost_dir)) if lost_dir.is_dir() else set()
    rows = [Problem("*", "*", "LevelDB files damaged", "LevelDB repair rebuilt the store from what it could read")]
    for name in sorted(after - before):
        if name.endswith((".ldb", ".sst")):  # logs and old manifests are archived there too
            rows.append(Problem("*", f"lost/{name}", "a table file LevelDB could not read",
                                "set aside in store/lost/"))
    return rows


def lost_in_repair(store: Store, owed: Owed) -> list[Problem]:
    """Messages the journal says were owed and the repaired store no longer holds."""
    _add_stored_journal(owed, store)
    # The journal names an event's topic, not its priority level: every level's stream
    # and cursor is looked at. A group member's are the group's shared ones.
    levels: dict[str, list[str]] = {}
    for name in store.stream_names():
        levels.setdefault(base_stream(name), []).append(name)
    cursors: dict[tuple[str, str], list[DeliveryRecord]] = {}
    for p, s, rec in store.deliveries():
        cursors.setdefault((p, base_stream(s)), []).append(rec)
    groups = {(sub, event_stream(topic)): group_peer(rec["group"])
              for sub, topic, rec in store.subscriptions() if rec.get("group")}
    rows = []
    for (mid, peer), stream in sorted(owed.sent.items()):
        key = owed.keys.get(mid, mid)  # its segment, which the stream and cursors go by
        if any(store.get_outgoing(s, key) is not None or store.get_outgoing(s, mid) is not None
               for s in levels.get(stream, ())) or store.has_deadletter(mid):
            continue
        states = cursors.get((groups.get((peer, stream), peer), stream))
        if not states:
            rows.append(Problem("outgoing", mid, f"lost in repair, or dropped by an unsubscribe: owed to {peer} "
                                "per the journal, not stored, and it has no subscription now", "reported"))
            continue
        passed = [(st.get("floor") or "") >= key for st in states]
        if all(passed) or any(key in (st.get("acked") or ()) for st in states):
            continue  # acknowledged, on whichever level (its "acked" event was lost with the damage)
        rows.append(Problem("outgoing", mid, f"lost in repair: owed to {peer} on {stream}, no longer stored"
                            + ("; or acknowledged, if it was on a priority level whose cursor has passed it "
                               "(the journal does not say which)" if any(passed) else ""), "reported"))
    for mid in sorted(owed.received):
        # Stored in its segment, or handled with it (the segment's key is remembered), or on
        # its own: split off, handled as such, or a dead letter.
        if not store.seen(owed.keys.get(mid, mid)) and not store.seen(mid):
            rows.append(Problem("incoming", mid, "lost in repair: received, not handled, no longer stored",
                                "reported"))
    return rows
