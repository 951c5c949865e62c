"""``servicebus check [--repair]``: find what is damaged in a stopped bus's store, repair
what can be repaired, and say exactly what could not (DESIGN.md section 3, rule 9).

Two levels of damage:

- **Files** LevelDB cannot read (a missing ``CURRENT``, a truncated or bit-flipped table):
  ``repair_files`` (lost.py) runs LevelDB's own repair, which rebuilds the store from every table
  and log entry it can still read and sets the rest aside in ``store/lost/``. What it could
  not read is found by comparing the delivery journal (segment files outside LevelDB: what
  this bus still owed, sent or received) with what the rebuilt store holds: those ids are
  reported as lost, by id.
- **Records** that do not decode, or that no longer agree with each other: ``check`` lists
  them; with ``repair`` it restores what the rest of the store determines (a subscription
  from its delivery state, a delivery state from its subscription, a handled-id index
  entry, the meta records) and drops what cannot be restored, reporting each as lost.
  Messages that no subscriber is owed any more become dead letters (``no_subscriber``),
  never silently deleted.

Messages are stored by segment (model/segments.py, store format 3): a record of ``o/`` or
``n/`` holds one or more messages under its first one's id (its key), cursors and acks go
by key, a received segment's runs keep their progress in ``c/``, and a message split off
from its segment goes on as a segment of one under its own id. What is lost is still said
by message id: a damaged segment's row names its messages when their ids can be read, and
the journal, which names a segment's messages in one event, is read as one event per id.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from ..store import schema
from ..model.delivery import (base_stream, command_stream, event_stream, group_peer, is_command_stream,
                               is_group_peer, stream_target, unpack_outgoing)
from ..errors import CorruptRecordError
from ..hooks.journal import FLUSH_CHUNK
from ..hooks.segments import segment_seq
from ..model.stored import Progress as RunProgress
from ..store import FORMAT_VERSION, MARK_NAME, Store
from ..store.keys import split_pair, split_seq, split_stamped, stamped_name
from ..store.migrate import older_layout
from ..model.clock import wall_ms
from .lost import Owed, Problem, journal_owed, lost_in_repair, lost_writes, repair_files
from .messages import outgoing_letters

# What a damaged store lost is found in lost.py; its names are re-exported here, where the
# CLI and the tests have always found them.
__all__ = ["Problem", "check", "repair_files", "journal_owed", "lost_in_repair", "lost_writes", "Owed",
           "older_format"]

Progress = Callable[[int], None] | None
CHUNK = 5000

# What --repair does with a record that does not decode, per keyspace.
ON_UNDECODABLE = {
    "subscriptions": "restored (resends what is still stored for the topic; duplicates are deduplicated)",
    "deliveries": "restored from the subscription (what was acked is resent and deduplicated)",
    "intents": "dropped (the service's next subscribe/unsubscribe call asks again)",
    "outgoing": "dropped: LOST (its payload cannot be read)",
    "incoming": "dropped: LOST (its payload cannot be read)",
    "runstate": "dropped (its attempt count starts again)",
    "replies": "dropped: LOST (the caller gets no reply)",
    "deadletters": "dropped: LOST",
    "handled": "dropped (this id is no longer deduplicated)",
    "handled_index": "dropped (rebuilt from the handled ids)",
    "publish_keys": "dropped (a publish with this dedupe key is no longer deduplicated)",
    "publish_keys_index": "dropped (rebuilt from the publish keys)",
    "journal": "dropped (these delivery events are missing from the audit)",
    "segments": "dropped (the segment's retention starts again)",
    "kv": "dropped: LOST (the service's state under this key is gone)",
    "outbox": "dropped: LOST (a command a handler sent is not sent)",
    # Which of its segment's messages were done is no longer known: they run again (those
    # a handler finished, a second time), none is lost.
    "progress": "dropped (the segment's messages not split off run again from its first)",
    "meta": "restored",
}
# Where a segment record of a keyspace keeps its messages' ids (delivery.OutgoingRecord,
# stored.IncomingRecord): a damaged one's row names them when they can still be read.
_IDS_AT = {"outgoing": 6, "incoming": 9}


class _Fixes:
    """Repairs written in bounded batches, fsynced once at the end."""

    def __init__(self, store: Store, enabled: bool) -> None:
        self.store, self.enabled = store, enabled
        # Not enabled: no batch at all (a check of a live bus reads a snapshot, which has none).
        self.batch: Any = store.batch() if enabled else None
        self.ops = 0

    def __call__(self, change: Callable) -> None:
        if not self.enabled:
            return
        change(self.batch)
        self.ops += 1
        if self.ops % CHUNK == 0:
            self.store.write(self.batch, sync=False)
            self.batch = self.store.batch()

    def close(self) -> None:
        if self.enabled:
            self.store.write(self.batch, sync=True)


@dataclass
class _Seen:
    """What a scan of the store found, for the cross-checks."""

    subscriptions: dict[tuple[str, str], dict] = field(default_factory=dict)
    deliveries: dict[tuple[str, str], dict] = field(default_factory=dict)
    bad_subscriptions: list[tuple[str, str]] = field(default_factory=list)
    bad_deliveries: list[tuple[str, str]] = field(default_factory=list)
    incoming: dict[str, int] = field(default_factory=dict)  # segment key -> messages it holds
    incoming_ids: set[str] = field(default_factory=set)  # every message of those segments
    progress: list[tuple[str, bytes, Any]] = field(default_factory=list)  # (key, name, record)
    runstates: set[str] = field(default_factory=set)
    handled: dict[str, int] = field(default_factory=dict)
    index: list[tuple[int, str]] = field(default_factory=list)
    publish_keys: dict[str, tuple[str, int]] = field(default_factory=dict)  # key -> (id, at)
    publish_index: list[tuple[int, str]] = field(default_factory=list)
    streams: set[str] = field(default_factory=set)
    meta: set[str] = field(default_factory=set)
    bad_meta: set[str] = field(default_factory=set)
    journal_seq: int = 0


def check(store: Store, repair: bool, progress: Progress = None,
          datadir: Path | None = None) -> list[Problem]:
    """Every record decodes and the keyspaces agree; with ``repair``, make them so."""
    problems: list[Problem] = []
    fix = _Fixes(store, repair)
    seen = _Seen()

    def report(keyspace: str, key: str, problem: str, action: str) -> None:
        problems.append(Problem(keyspace, key, problem, action if repair else ""))

    # Records by keyspace and name (the key without its keyspace's prefix): the key layout
    # is the store's to know.
    for n, (keyspace, name, value) in enumerate(store.records(verify=True), 1):
        if progress and n % 1000 == 0:
            progress(n)
        if keyspace is None:  # ``name`` is the whole key
            report("?", name.decode("utf-8", "backslashreplace"), "key of no known keyspace", "dropped")
            fix(lambda b, k=name: b.delete_record(None, k))
            continue
        try:
            record = schema.decode_record(keyspace, name, value)
        except CorruptRecordError as exc:
            detail = str(exc).split(": ", 1)[-1].split(";", 1)[0]
            if keyspace == "subscriptions":
                seen.bad_subscriptions.append(split_pair(name))
            elif keyspace == "deliveries":
                seen.bad_deliveries.append(split_pair(name))
            elif keyspace == "meta":
                seen.bad_meta.add(name.decode("utf-8", "replace"))
                if name.decode("utf-8", "replace") not in schema.META:
                    report(keyspace, exc.key, detail, "dropped")
                    fix(lambda b, k=keyspace, m=name: b.delete_record(k, m))
                continue
            else:
                fix(lambda b, k=keyspace, m=name: b.delete_record(k, m))
            report(keyspace, exc.key, detail + _messages_of(keyspace, value), ON_UNDECODABLE[keyspace])
            continue
        _collect(seen, keyspace, name, record)
    _cross_check(store, seen, report, fix, datadir)
    fix.close()
    behind = store.mark_behind()
    if behind is not None:
        held, recorded = behind
        report("meta", "hwm", f"store behind its high-water mark, it lost writes: it holds "
               f"{'none' if held is None else held}, {MARK_NAME} "
               f"says {recorded}: a log file was deleted, zeroed or cut, or the store put back "
               "from an older copy", "what it lost is listed by id from the journal; the store "
               "is accepted as it is now")
    return problems


def _messages_of(keyspace: str, value: bytes) -> str:
    """For a damaged segment record: the ids of the messages it held, if they still read
    (what is lost with it, by id); else nothing."""
    at = _IDS_AT.get(keyspace)
    if at is None:
        return ""
    try:
        ids = msgpack.unpackb(value, raw=False, strict_map_key=False)[at]
    except Exception:  # noqa: BLE001 - damaged beyond that
        return ""
    if type(ids) is not list or not ids or not all(type(i) is str for i in ids):
        return ""
    return f"; its message{'s' if len(ids) > 1 else ''}: {', '.join(ids)}"


def _collect(seen: _Seen, keyspace: str, name: bytes, record: Any) -> None:
    """Note a record that decoded (``name``: its key without the keyspace's prefix)."""
    if keyspace == "subscriptions":
        seen.subscriptions[split_pair(name)] = record
    elif keyspace == "deliveries":
        seen.deliveries[split_pair(name)] = record
    elif keyspace == "incoming":
        seen.incoming[name.decode()] = len(record[9])
        seen.incoming_ids.update(record[9])
    elif keyspace == "progress":
        seen.progress.append((split_pair(name)[0], name, record))
    elif keyspace == "runstate":
        seen.runstates.add(name.decode())
    elif keyspace == "handled":
        seen.handled[name.decode()] = record
    elif keyspace == "handled_index":
        seen.index.append(split_stamped(name))
    elif keyspace == "publish_keys":
        seen.publish_keys[name.decode()] = (record[0], record[1])
    elif keyspace == "publish_keys_index":
        seen.publish_index.append(split_stamped(name))
    elif keyspace == "outgoing":
        seen.streams.add(split_pair(name)[0])  # (stream, id)
    elif keyspace == "journal":
        seen.journal_seq = max(seen.journal_seq, split_seq(name))
    elif keyspace == "meta":
        seen.meta.add(name.decode())


def _cross_check(store: Store, seen: _Seen, report: Callable, fix: _Fixes, datadir: Path | None) -> None:
    # A run state is a message's: of a segment (its key), or of one message in a segment
    # (one of several handlers finished it, or an ordered segment is retried at it).
    for mid in sorted(seen.runstates - seen.incoming_ids - set(seen.incoming)):
        report("runstate", mid, "run state of a message that is not stored", "dropped")
        fix(lambda b, m=mid: b.delete_record("runstate", m))
    _check_progress(seen, report, fix)

    # Subscriptions and their delivery states determine each other. A subscription to a
    # topic has a state per level of its stream ("e:<topic>", "e:<topic> 3": delivery.py),
    # kept under the subscriber, or under its group ("group:<name>") for all its members.
    for sub, topic in seen.bad_subscriptions:
        state = seen.deliveries.get((sub, event_stream(topic))) or {}
        record = {"since": state.get("floor") or "", "created": wall_ms(), "node": ""}
        fix(lambda b, s=sub, t=topic, r=record: b.put_subscription(s, t, r))
        seen.subscriptions[(sub, topic)] = record
    owners = {(group_peer(r["group"]) if r.get("group") else s, t) for (s, t), r in seen.subscriptions.items()}
    for peer, stream in sorted(seen.deliveries):
        topic = stream_target(stream)
        if is_command_stream(stream) or (peer, topic) in owners:
            continue
        if is_group_peer(peer):  # no member left: a subscription cannot be made without one
            report("deliveries", f"{peer} {stream}", "delivery state of a group none of whose members "
                   "is subscribed", "dropped (what only it was owed becomes dead letters)")
            fix(lambda b, p=peer, s=stream: b.delete_delivery(p, s))
            del seen.deliveries[(peer, stream)]
            continue
        report("deliveries", f"{peer} {stream}", "delivery state without its subscription",
               "subscription restored from it")
        # Read from where the level-0 cursor is: a priority level's says nothing about it.
        level0 = seen.deliveries.get((peer, event_stream(topic))) or {}
        record = {"since": level0.get("floor") or "", "created": wall_ms(), "node": ""}
        fix(lambda b, p=peer, t=topic, r=record: b.put_subscription(p, t, r))
        seen.subscriptions[(peer, topic)] = record
        owners.add((peer, topic))
    for peer, stream in seen.bad_deliveries:
        since = "" if is_command_stream(stream) else _since(seen, peer, stream_target(stream))
        fix(lambda b, p=peer, s=stream, f=since: b.put_delivery(p, s, {"floor": f, "acked": [], "attempts": {}}))
        seen.deliveries[(peer, stream)] = {"floor": since}

    # A priority level is consumed by its level-0 stream's subscribers, cursor or not yet
    # (the bus makes them at start: a crash can come between a publish and their writing).
    consumed = {event_stream(t) for _, t in seen.subscriptions} | {s for _, s in seen.deliveries}
    for stream in sorted(s for s in seen.streams - consumed if base_stream(s) not in consumed):
        if is_command_stream(stream):
            peer = stream_target(stream)
            report("outgoing", stream, "commands with no delivery state", "delivery state restored")
            fix(lambda b, p=peer: b.put_delivery(p, command_stream(p), {"floor": "", "acked": [], "attempts": {}}))
        else:
            count = store.count_stream(stream)
            report("outgoing", stream, f"{count} message(s) no subscriber is owed",
                   "moved to dead letters (reason no_subscriber)")
            _orphans_to_deadletters(store, stream, fix)

    # The handled-id index (t/) mirrors h/: pruning reads the index, dedupe reads h/.
    indexed = {mid: at for at, mid in seen.index}
    for at, mid in seen.index:
        if seen.handled.get(mid) != at:
            report("handled_index", f"{at} {mid}", "index entry of no handled id", "dropped")
            fix(lambda b, a=at, m=mid: b.delete_record("handled_index", stamped_name(a, m)))
    for mid, at in sorted(seen.handled.items()):
        if indexed.get(mid) != at:
            report("handled", mid, "handled id missing from the pruning index", "index restored")
            fix(lambda b, m=mid, a=at: b.put_handled(m, a))

    # The publish-key index (q/) mirrors p/ the same way.
    by_key = {key: at for at, key in seen.publish_index}
    for at, key in seen.publish_index:
        if (seen.publish_keys.get(key) or ("", -1))[1] != at:
            report("publish_keys_index", f"{at} {key}", "index entry of no publish key", "dropped")
            fix(lambda b, a=at, k=key: b.delete_record("publish_keys_index", stamped_name(a, k)))
    for key, (mid, at) in sorted(seen.publish_keys.items()):
        if by_key.get(key) != at:
            report("publish_keys", key, "publish key missing from the pruning index", "index restored")
            fix(lambda b, k=key, m=mid, a=at: b.put_publish_key(k, m, a))

    _check_meta(seen, report, fix, datadir)


def _since(seen: _Seen, peer: str, topic: str) -> str:
    """Where a cursor of ``peer`` on ``topic`` starts from when it has none: its
    subscription's "since"; a group's, its earliest member's (as core/streams.py does)."""
    if not is_group_peer(peer):
        return str((seen.subscriptions.get((peer, topic)) or {}).get("since", ""))
    return min((str(r.get("since", "")) for (_, t), r in seen.subscriptions.items()
                if t == topic and r.get("group") and group_peer(r["group"]) == peer), default="")


def _check_progress(seen: _Seen, report: Callable, fix: _Fixes) -> None:
    """A segment's progress (``c/<key>\\0<start>``) belongs to a stored segment and names
    indices of its messages: the run from ``start`` finished those before ``next``, but
    ``skipped`` ones (split off or dead letters), and ``next`` is at most its end (there:
    all finished, the segment not yet taken out, which the bus does at its next start)."""
    for key, name, record in seen.progress:
        shown = f"{key} {split_pair(name)[1]}"
        count = seen.incoming.get(key)
        if count is None:
            report("progress", shown, "progress of a segment that is not stored", "dropped")
            fix(lambda b, n=name: b.delete_record("progress", n))
            continue
        try:
            start = int(split_pair(name)[1])
        except ValueError:
            start = -1
        nxt, started, skipped = RunProgress._make(record)
        if not 0 <= start < count:
            report("progress", shown, f"its start is not a message of its segment of {count}", "dropped")
            fix(lambda b, n=name: b.delete_record("progress", n))
            continue
        kept = sorted({i for i in skipped if start <= i < min(nxt, count)})
        if nxt <= count and kept == skipped:
            continue
        fixed = RunProgress(min(nxt, count), started, kept)
        report("progress", shown, f"indices past its segment of {count} messages (next {nxt}, skipped "
               f"{skipped})", f"kept within it (next {fixed.next}, skipped {fixed.skipped})")
        fix(lambda b, k=key, s=start, r=fixed: b.put_progress(k, s, r))


def _orphans_to_deadletters(store: Store, stream: str, fix: _Fixes) -> None:
    """Each message of each segment of ``stream`` becomes a dead letter of its own (a
    segment of one, as the bus makes them), in the write that deletes the segment."""
    after = None
    while True:
        chunk = store.iter_stream(stream, after=after, limit=1000)
        for key, data in chunk:
            try:
                rec = unpack_outgoing(data)
            except Exception:  # noqa: BLE001 - already reported by the scan
                continue
            letters = outgoing_letters("no_subscriber", rec, None, stream, data)

            def move(b: Any, k: str = key, ls: list = letters) -> None:
                for mid, letter in ls:
                    b.put_deadletter(mid, letter)
                b.delete_outgoing(stream, k)
            fix(move)
        if len(chunk) < 1000:
            return
        after = chunk[-1][0]


def _check_meta(seen: _Seen, report: Callable, fix: _Fixes, datadir: Path | None) -> None:
    restore: dict[str, bytes] = {}
    if "format" in seen.bad_meta or "format" not in seen.meta:
        restore["format"] = str(FORMAT_VERSION).encode()
    if "node" in seen.bad_meta:
        restore["node"] = os.urandom(8).hex().encode()
    if "clock" in seen.bad_meta:
        # Never behind a handled id's time: the dedupe window only ever gets longer.
        restore["clock"] = str(max(seen.handled.values(), default=0)).encode()
    if "journal_flushed" in seen.bad_meta:
        restore["journal_flushed"] = str(max(seen.journal_seq, _last_segment_seq(datadir))).encode()
    for name, value in restore.items():
        problem = "does not decode" if name in seen.meta or name in seen.bad_meta else "missing"
        report("meta", name, problem, f"restored ({value.decode()})")
        fix(lambda b, n=name, v=value: b.put_meta(n, v))
    for name in sorted(seen.bad_meta & {"address", "sync", "journal_pending"}):
        report("meta", name, "does not decode", "dropped (written again by the bus)")
        fix(lambda b, n=name: b.delete_record("meta", n))


def _last_segment_seq(datadir: Path | None) -> int:
    """Past every sequence number a segment file may hold: segments are named by their
    first one and hold at most FLUSH_CHUNK records, and a reused number would overwrite."""
    if datadir is None or not (datadir / "journal").is_dir():
        return 0
    firsts = []
    for path in (datadir / "journal").iterdir():
        seq = segment_seq(path.name)
        if seq is not None:
            firsts.append(seq)
    return max(firsts) + FLUSH_CHUNK if firsts else 0


def older_format(store: Store, sample: int = 100) -> tuple[int, str] | None:
    """(format, "" or how it was told) of a store written by an older version, else None.
    Its format record says; where it is damaged or missing, the layout of its message
    records does (a few of each keyspace that has them)."""
    try:
        version = store.meta("format")
    except CorruptRecordError:
        how = "its format record is damaged"
    else:
        if version is not None:
            return (version, "") if version < FORMAT_VERSION else None
        how = "it has no format record"
    for keyspace in ("outgoing", "incoming", "deadletters"):
        if any(older_layout(keyspace, key, value) for key, value in store.records_in(keyspace, sample)):
            return 2, how
    return None
