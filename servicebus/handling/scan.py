"""What the dispatcher's scans of the incoming store make of each stored segment.

A scan (at start, after the queue overflowed, when a handler registers late, after the
store was reopened) reads received segments that are not in memory: their run state and
the progress of their runs, when they are due again; and it moves records that no longer
decode to the dead letters, raw bytes and all, so that the rest goes on.
"""

from __future__ import annotations

import logging
from typing import Any

from ..errors import CorruptRecordError, StoreError
from ..model.letters import damaged_letter
from ..model.segments import by_message
from ..model.stored import Incoming, IncomingRecord

__all__ = ["stored_item", "quarantine"]

log = logging.getLogger("servicebus")


def stored_item(store: Any, key: str, record: IncomingRecord, strict: bool, now_ms: int,
                now: float, retry_max: float) -> tuple[Incoming, float]:
    """Stored segment ``key`` as the handlers get it, and when (monotonic) it is due. A
    damaged run state restarts its attempts (``strict``, at start: raises instead)."""
    progress = None
    try:
        runstate = store.get_runstate(key)
        if by_message(key, record.ids):
            progress = store.progress(key)
    except CorruptRecordError:
        if strict:
            raise
        log.error("the run state of %s is damaged; its attempts start again", key)
        runstate = None
    due = 0.0
    if runstate and runstate.next_ms and runstate.next_ms > now_ms:
        # A retry time is wall-clock ms from an earlier run. If the clock was set back
        # since, it is too far off: no retry waits past retry_max.
        due = now + min((runstate.next_ms - now_ms) / 1000, retry_max)
    return Incoming(key, record, runstate, progress), due


def reread(store: Any, item: Incoming) -> Incoming:
    """A segment to run again, as its run left it in the store: its run state, and for
    one run by message its record (its first message may have been split off under its
    key, the rest of it gone on under another: segmentrun.py) and progress."""
    if store.closed:
        return item._replace(runstate=None, progress=None)
    runstate = store.get_runstate(item.id)
    if not by_message(item.id, item.record.ids):
        return item._replace(runstate=runstate)
    record = store.get_incoming(item.id) or item.record
    progress = store.progress(item.id) if by_message(item.id, record.ids) else None
    return item._replace(record=record, runstate=runstate, progress=progress)


def quarantine(store: Any, damaged: list[tuple[bytes, bytes]]) -> None:
    """Move incoming records that do not decode to the dead letters, raw bytes kept."""
    batch = store.batch()
    for key, raw in damaged:
        batch.quarantine_incoming(key, damaged_letter("incoming", "undecodable record", raw))
        log.error("incoming message %s: its stored record is damaged; moving it to the "
                  "dead letters with its raw bytes", key[2:].decode("utf-8", "replace"))
    try:
        store.write(batch, sync=False)
    except StoreError as exc:  # found again by the next scan
        log.error("could not move damaged incoming records: %s", exc)
