"""Upgrading a store written by an older version, at open (or ``servicebus migrate``).

Format 1 -> 2: handled ids get a bus-clock time and an index by it.
Format 2 -> 3: messages are kept by segment (model/segments.py). Every stored message of
format 2 becomes a segment of one, keyed by its own id, so nothing another bus knows
about it changes: cursors, acks and a receiver's deduplication keep going by that id.
Outgoing records ``[kind, topic, sent, expires, corr, headers, body]`` gain the segment's
ids and payload blob in place of the body; incoming records likewise; a dead letter's
record too (``servicebus replay`` puts it back as a segment of one).

Each step is written synced, a chunk at a time, and only records still in the old layout
are rewritten: a migration stopped by a crash or a power cut is finished by the next open.
The format record is written last.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ..model.packer import pack
from .schema import VALUES, decode
from .keys import SEP, _H, _N, _O, _X
from .reads import Reads

# The store's reads and writes, typed by what db.Store inherits (not db itself, which
# imports this module: a type-only import back would tie the two in a circle).
Store = Reads

__all__ = ["upgrade", "Upgrade", "CHUNK", "older_layout"]

log = logging.getLogger("servicebus")

CHUNK = 5_000  # records rewritten per synced write


@dataclass
class Upgrade:
    """What an upgrade did, by keyspace: records ``rewritten`` in the new layout, and those
    ``left`` as they were because they read as neither layout (damaged: ``servicebus check``
    lists them, ``--repair`` drops them). Records already in the new layout (a migration
    stopped half way, finished now) are in neither."""

    version: int
    target: int
    rewritten: dict[str, int] = field(default_factory=dict)
    left: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.rewritten.values())

    def _count(self, into: dict[str, int], keyspace: str) -> None:
        into[keyspace] = into.get(keyspace, 0) + 1


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def upgrade(store: Store, version: int, target: int,
            progress: Callable[[int], None] | None = None) -> Upgrade:
    """Bring ``store`` from ``version`` to ``target``; returns what it rewrote."""
    done = Upgrade(version, target)
    if version < 2:
        done.rewritten["handled"] = _handled_by_time(store, progress)
    if version < 3:
        _segments_of_one(store, progress, done)
    batch = store.batch()
    batch.put_meta("format", str(target).encode())
    store.write(batch, sync=True)
    if done.total:
        log.info("store %s upgraded from format %d to %d (%d records rewritten)", store.path,
                 version, target, done.total)
    if done.left:
        log.error("store %s: %d records read as neither format %d nor %d and were left as they are: "
                  "`servicebus check` lists them", store.path, sum(done.left.values()), version, target)
    return done


class _Chunks:
    """Rewritten records, written synced a chunk of CHUNK at a time: a migration stopped
    between two chunks is finished by the next open, which rewrites only what is still in
    the old layout."""

    def __init__(self, store: Store, progress: Callable[[int], None] | None) -> None:
        self.store, self.progress, self.n = store, progress, 0
        self.batch = store.batch()

    def added(self) -> None:
        self.n += 1
        if self.n % CHUNK == 0:
            self.store.write(self.batch, sync=True)
            self.batch = self.store.batch()
            if self.progress is not None:
                self.progress(self.n)

    def close(self) -> int:
        self.store.write(self.batch, sync=True)
        return self.n


def _handled_by_time(store: Store, progress: Callable[[int], None] | None) -> int:
    """Format 1 kept the wall-clock time of handling under h/ and had no t/ index: index
    every handled id as handled now, on the bus clock (so each is remembered for one whole
    dedupe window more, never less)."""
    now = int(store.get_meta("clock") or b"0")
    chunks = _Chunks(store, progress)
    for key, _value in store._iter(_H):
        chunks.batch.put_handled(key[2:].decode(), now)
        chunks.added()
    return chunks.close()


def _outgoing(record: list[Any], message_id: str) -> list[Any] | None:
    """A format-2 outgoing record as a segment of one; None if it is not one."""
    if type(record) is not list or len(record) != 7 or type(record[6]) is not bytes:
        return None
    kind, topic, sent, expires, corr, headers, body = record
    return [kind, topic, sent, expires, corr, headers, [message_id], pack([body])]


def _incoming(record: list[Any], message_id: str) -> list[Any] | None:
    """A format-2 incoming record as a segment of one; None if it is not one."""
    if type(record) is not list or len(record) != 10 or type(record[9]) is not bytes:
        return None
    return [*record[:9], [message_id], pack([record[9]])]


def _letter(letter: Any, message_id: str) -> Any:
    """A format-2 dead letter with its record in the format-3 layout; None if unchanged."""
    if type(letter) is not dict or "record" not in letter:
        return None
    record = letter["record"]
    if letter.get("origin") == "incoming":
        new = _incoming(record, message_id)
    elif letter.get("origin") == "outgoing":
        new = _outgoing(record, message_id)
    else:
        return None
    return None if new is None else {**letter, "record": new}


def _current(keyspace: str, key: bytes, value: bytes) -> bool:
    """Whether a record reads in this version's layout (a dead letter's message record
    too): one a stopped migration rewrote already."""
    try:
        letter = decode(keyspace, key, value)
        if keyspace == "deadletters" and "record" in letter:
            inner = "incoming" if letter.get("origin") == "incoming" else "outgoing"
            VALUES[inner](pack(letter["record"]))  # a letter's record has no key of its own
    except Exception:  # noqa: BLE001 - CorruptRecordError, and msgpack's errors on junk
        return False
    return True


def older_layout(keyspace: str, key: bytes, value: bytes) -> bool:
    """Whether a record of ``outgoing``, ``incoming`` or ``deadletters`` is in format 2's
    layout (``servicebus check`` of a store whose format record is damaged or missing must
    not take those for damage and drop them)."""
    prefix, convert = {"outgoing": (_O, _outgoing), "incoming": (_N, _incoming),
                       "deadletters": (_X, _letter)}[keyspace]
    try:
        return convert(_unpack(value), _message_id(prefix, key)) is not None
    except Exception:  # noqa: BLE001 - damaged
        return False


def _message_id(prefix: bytes, key: bytes) -> str:
    rest = key[len(prefix):]
    return (rest.rpartition(SEP)[2] if prefix == _O else rest).decode("utf-8", "replace")


def _segments_of_one(store: Store, progress: Callable[[int], None] | None, done: Upgrade) -> None:
    chunks = _Chunks(store, progress)
    for keyspace, prefix, convert in (("outgoing", _O, _outgoing), ("incoming", _N, _incoming),
                                      ("deadletters", _X, _letter)):
        for key, value in store._iter(prefix):
            try:
                new = convert(_unpack(value), _message_id(prefix, key))
            except Exception:  # noqa: BLE001 - damaged: left for `servicebus check` to report
                new = None
            if new is None:
                if not _current(keyspace, key, value):
                    done._count(done.left, keyspace)
                continue  # already format 3, or damaged (check reports it)
            chunks.batch.put_raw(key, pack(new))
            done._count(done.rewritten, keyspace)
            chunks.added()
    chunks.close()
