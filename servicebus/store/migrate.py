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
from typing import Any

import msgpack

from ..model.packer import pack
from .keys import SEP, _H, _N, _O, _X

# ``store`` below is the Store (db.py, which calls in here at open: not imported back).
Store = Any

__all__ = ["upgrade", "CHUNK"]

log = logging.getLogger("servicebus")

CHUNK = 5_000  # records rewritten per synced write


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def upgrade(store: Store, version: int, target: int,
            progress: Callable[[int], None] | None = None) -> int:
    """Bring ``store`` from ``version`` to ``target``; returns records rewritten."""
    done = 0
    if version < 2:
        done += _handled_by_time(store, progress)
    if version < 3:
        done += _segments_of_one(store, progress)
    batch = store.batch()
    batch.put_meta("format", str(target).encode())
    store.write(batch, sync=True)
    if done:
        log.info("store %s upgraded from format %d to %d (%d records rewritten)", store.path,
                 version, target, done)
    return done


def _handled_by_time(store: Store, progress: Callable[[int], None] | None) -> int:
    """Format 1 kept the wall-clock time of handling under h/ and had no t/ index: index
    every handled id as handled now, on the bus clock (so each is remembered for one whole
    dedupe window more, never less)."""
    now = int(store.get_meta("clock") or b"0")
    batch, n = store.batch(), 0
    for key, _value in store._iter(_H):
        batch.put_handled(key[2:].decode(), now)
        n += 1
        if n % CHUNK == 0:
            store.write(batch, sync=True)
            batch = store.batch()
            if progress is not None:
                progress(n)
    store.write(batch, sync=True)
    return n


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


def _segments_of_one(store: Store, progress: Callable[[int], None] | None) -> int:
    n = 0
    batch = store.batch()
    for prefix, convert in ((_O, _outgoing), (_N, _incoming), (_X, _letter)):
        for key, value in store._iter(prefix):
            rest = key[len(prefix):]
            message_id = (rest.rpartition(SEP)[2] if prefix == _O else rest).decode("utf-8", "replace")
            try:
                new = convert(_unpack(value), message_id)
            except Exception:  # noqa: BLE001 - damaged: left for `servicebus check` to report
                new = None
            if new is None:
                continue  # already format 3, or damaged (check reports it)
            batch.put_raw(key, pack(new))
            n += 1
            if n % CHUNK == 0:
                store.write(batch, sync=True)
                batch = store.batch()
                if progress is not None:
                    progress(n)
    store.write(batch, sync=True)
    return n
