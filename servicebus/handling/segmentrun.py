"""Running a received segment of several messages (model/segments.py), one after another.

Each message's outcome is the runner's (runner.py, the outcome table); what it writes is
the segment's: one small record, the run's progress (``c/<key>``: the next message to run,
how many runs of it began, which earlier ones were finished elsewhere), written unsynced
the moment a message's handlers return. That write also says the next message has
started, so a crash while it runs counts as one of its attempts, and a restart resumes
there: a finished handler is not run again (DESIGN.md section 9). When the last message
is done, one write takes the segment out of the incoming store, remembers its key for
deduplication and journals every message it handled.

A message whose handler fails is taken out of the segment (split off): it goes on by
itself, a segment of one under its own id with its run state, retried with backoff like
any message, while the rest of the segment goes on (for an ordered subscription, the rest
waits for it: the dispatcher's lanes order runs by the first message still to run). A
message that becomes a dead letter is kept as one of its own. Both are noted in the
progress (``skipped``), so that a restart does not run them again here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ..errors import StoreError
from ..model.letters import incoming_letter
from ..model.segments import bodies_of, make_blob
from ..model.stored import NO_RUNS, Event, Incoming, IncomingRecord, Progress, RunState, event
from ..wire.protocol import KIND_NAMES
from .lanes import lane_of
from .outcomes import Outcome, settled
from .staging import UpdateFailed

# ``runner`` below is the Runner (runner.py, which calls in here: not imported back).
Runner = Any

__all__ = ["run_segment", "START", "PAUSE"]

log = logging.getLogger("servicebus")

START = 0  # a segment runs from its first message on, as one run (one progress record)
# Messages run before a segment goes back in the queue (its place kept): what is queued
# meanwhile, a higher priority first, does not wait for a whole segment.
BUDGET = 16
PAUSE = -1.0  # returned for "run again from where it is, at its place in the queue"
_tuple = tuple.__new__


def one(record: IncomingRecord, index: int, body: bytes) -> IncomingRecord:
    """Message ``index`` of a segment, as a segment of one."""
    return _tuple(IncomingRecord, (*record[:9], [record.ids[index]], make_blob([body])))


def progress_of(item: Incoming) -> Progress:
    found = (item.progress or {}).get(START)
    return found if found is not None else Progress(0, 0, [])


def run_segment(runner: Runner, item: Incoming, marked: bool,
                nxt: Incoming | None, budget: int = BUDGET) -> tuple[float | None, bool]:
    """Run what is left of segment ``item``, ``budget`` messages at most; (when to run it
    again, or None; whether ``nxt``'s start marker went into the last write)."""
    record, key = item.record, item.id
    ids = record.ids
    try:
        bodies = bodies_of(record.blob)
    except Exception as exc:  # noqa: BLE001 - checked on receipt: only a damaged store gets here
        bodies = None
        error = f"{type(exc).__name__}: {exc}"
    p = progress_of(item)
    nxt_index, started, skipped = p.next, p.started, list(p.skipped)
    if bodies is None or len(bodies) != len(ids):
        return _all_dead(runner, item, nxt_index, skipped, "undecodable",
                         error if bodies is None else "its payloads do not match its ids")
    writer = runner.writer
    if nxt_index < len(ids):
        first = runner._outcome_before(item)  # the segment's: expired, parked, not ours
        if first is not None:
            if first.kind == "parked":
                runner._park(item)
                return None, False
            return _all_dead(runner, item, nxt_index, skipped, first.reason or "expired", first.error)
        started += 1  # this run of the next message (written already when ``marked``)
        if not marked:
            try:
                writer.start_progress(key, START, Progress(nxt_index, started, skipped))
            except (StoreError, RuntimeError):  # RuntimeError: plyvel's closed handle
                if runner._closing():
                    raise
                return time.monotonic() + 0.5, False  # not written, so not run: later
    marked_next: bool | None = False
    ordered = lane_of(item) is not None
    handlers = runner._handlers.get((record.kind, record.topic))
    several = len(handlers or ()) > 1
    ran = 0
    while nxt_index < len(ids):
        if ran >= budget:
            # The rest later: its progress says where (the one the last write held, kept for
            # the dispatcher so that it need not read it back).
            runner.paused[key] = Progress(nxt_index, started, list(skipped))
            return PAUSE, False
        ran += 1
        i = nxt_index
        mid = ids[i]
        # The segment's own record stands for its message's: every field but ids and blob is
        # theirs, and the payload is given apart (a record of its own is made only when the
        # message leaves the segment).
        state, kept = _state(runner, mid, started, i == p.next or several)
        view = _tuple(Incoming, (mid, record, state, None))
        outcome = runner._outcome(view, True, bodies[i], handlers)
        last = i + 1 == len(ids)
        follow = nxt if last else None
        # The next one starts with the write recording this one, unless it waits for later.
        nxt_index, started = i + 1, 1 if ran < budget else 0
        if outcome.kind == "handled":
            marked_next = _commit_handled(runner, item, view, outcome, nxt_index, started, skipped, last,
                                          follow, kept or several)
            if marked_next is None:  # a kv update raised at the commit: the message failed
                outcome = _failed_update(view, outcome)
            else:
                continue
        if outcome.kind == "failed" and outcome.attempts < outcome.limit and ordered:
            # The rest of an ordered lane waits for it: the segment is retried from here.
            return _retry_here(runner, item, outcome, i, started_now=outcome.attempts, skipped=skipped)
        if outcome.kind == "failed" and outcome.attempts < outcome.limit and mid == key:
            return _split_first(runner, item, view, one(record, i, bodies[i]), outcome, bodies)
        if outcome.kind == "failed" and outcome.attempts < outcome.limit:
            skipped.append(i)
            marked_next = _split_off(runner, item, view, one(record, i, bodies[i]), outcome, nxt_index,
                                     started, skipped, last, follow)
            continue
        if outcome.kind == "failed":
            outcome = Outcome("dead", outcome.attempts, "handler_failed", outcome.error,
                              (runner._event("handler_failed", view, outcome.attempts, outcome.error),),
                              handler=outcome.handler)
        skipped.append(i)
        marked_next = _dead_one(runner, item, view, one(record, i, bodies[i]), outcome, nxt_index,
                                started, skipped, last, follow)
    if not ids or nxt_index < len(ids):
        return None, False
    if p.next >= len(ids):
        # Resumed after a crash between the last message's write and the finishing one.
        marked_next = _finish(runner, item, skipped, nxt, lambda b: None)
    return None, bool(marked_next)


def _state(runner: Runner, mid: str, started: int, look: bool) -> tuple[RunState, bool]:
    """Message ``mid``'s run state: runs so far from the progress (this one included);
    with ``look``, the handlers that finished and the last error from a record of its own,
    if it has one (one of several handlers finished, or an ordered segment is retried at
    it). Whether it has one: the write that finishes it deletes it."""
    found = None
    if look:
        try:
            found = runner.writer.store.get_runstate(mid)
        except StoreError:
            found = None
    done = list(found.done) if found is not None else []
    return RunState(started - 1, done, None if found is None else found.last_error, 0), found is not None


def _events(runner: Runner, item: Incoming, skipped: list[int]) -> list[Event]:
    """The segment's "handled" event: every message it handled (not the skipped ones)."""
    record = item.record
    ids = [m for j, m in enumerate(record.ids) if j not in set(skipped)]
    if not ids:
        return []
    return [event("handled", runner._wall(), ids[0], record.topic, KIND_NAMES.get(record.kind, "event"),
                  record.reply_to, 1, None, ids)]  # the handler attempt (one that failed was split
    #                                        off), not the delivery attempt; crash reruns not counted


def _finish(runner: Runner, item: Incoming, skipped: list[int], nxt: Incoming | None,
            extra: Callable[[Any], None]) -> bool:
    """The write that takes the segment out: with ``extra`` (the last message's own)."""
    key = item.id
    events = _events(runner, item, skipped)
    starts = {START, *(item.progress or {})}

    def finished(batch: Any) -> None:
        extra(batch)
        batch.complete_incoming(key, runner._clock.now(), sorted(starts))
        runner._hooks.events(batch, events)
    return runner.writer.record(finished, key, nxt)


def _commit_handled(runner: Runner, item: Incoming, view: Incoming, o: Outcome, nxt_index: int,
                    started: int, skipped: list[int], last: bool, nxt: Incoming | None,
                    several: bool) -> bool | None:
    """Record message ``view`` handled (with what its handlers staged); None if a kv update
    raised at the commit (nothing written). ``several``: it may have a run state of its own
    (deleted with it)."""
    key, mid = item.id, view.id
    progress = Progress(nxt_index, started, list(skipped))
    events = _events(runner, item, skipped) if last else []
    starts = sorted({START, *(item.progress or {})})

    def build(batch: Any) -> None:
        if several:
            batch.delete_runstate(mid)
        if last:
            batch.complete_incoming(key, runner._clock.now(), starts)
            runner._hooks.events(batch, events)
        else:
            batch.put_progress(key, START, progress)
    try:
        return runner.staging.commit(build, mid, False, nxt, o.tx, o.part, taken=key if last else None,
                                     progress=None if last else (key, progress))
    except UpdateFailed as exc:
        log.warning("handler %s failed on %s %s: kv update: %s", o.part, item.record.topic, mid, exc)
        return None


def _failed_update(view: Incoming, o: Outcome) -> Outcome:
    return Outcome("failed", o.attempts, error="kv update failed at the commit",
                   done=tuple(name for name in o.done if name != o.part), handler=o.part)


def _split_off(runner: Runner, item: Incoming, view: Incoming, single: IncomingRecord, o: Outcome,
               nxt_index: int, started: int, skipped: list[int], last: bool,
               nxt: Incoming | None) -> bool:
    """Message ``view`` failed, attempts left: it goes on as a segment of one, retried
    after a backoff; the segment goes on without it."""
    mid = view.id
    delay = runner.retry_delay(o)
    state = RunState(o.attempts, list(o.done), o.error, runner._wall() + int(delay * 1000))
    failed = runner._event("handler_failed", view, o.attempts, o.error)
    retried = runner._event("retried", view, o.attempts, o.error)
    progress = Progress(nxt_index, started, list(skipped))
    settled(runner._hooks, runner._handlers, "retried", view, o)

    def build(batch: Any) -> None:
        batch.split_off(mid, single, state)
        runner._hooks.events(batch, [failed, retried])
        if not last:
            batch.put_progress(item.id, START, progress)
    if last:
        marked = _finish(runner, item, skipped, nxt, build)
    else:
        marked = runner.writer.record(build, None, nxt, progress=(item.id, progress))
    runner._spawn(_tuple(Incoming, (mid, single, state, None)), time.monotonic() + delay)
    return marked


def _split_first(runner: Runner, item: Incoming, view: Incoming, single: IncomingRecord, o: Outcome,
                 bodies: list[bytes]) -> tuple[float | None, bool]:
    """The segment's first message failed, attempts left. Its id is the segment's key, so
    it cannot be split off beside the segment: it stays under the key, by itself, retried
    after a backoff (the dispatcher reads its record again), and the rest of the segment
    goes on at once under its next message's id, as a segment of its own."""
    record, key = item.record, item.id
    delay = runner.retry_delay(o)
    state = RunState(o.attempts, list(o.done), o.error, runner._wall() + int(delay * 1000))
    rest = record._replace(ids=list(record.ids[1:]), blob=make_blob(bodies[1:]))
    events = [runner._event("handler_failed", view, o.attempts, o.error),
              runner._event("retried", view, o.attempts, o.error)]
    starts = sorted({START, *(item.progress or {})})
    settled(runner._hooks, runner._handlers, "retried", view, o)

    def build(batch: Any) -> None:
        batch.split_off(key, single, state)
        batch.delete_progress(key, starts)
        batch.put_incoming(rest.ids[0], rest)
        runner._hooks.events(batch, events)
    runner.writer.record(build, None, None)
    runner._spawn(_tuple(Incoming, (rest.ids[0], rest, None, None)), time.monotonic())
    return time.monotonic() + delay, False


def _retry_here(runner: Runner, item: Incoming, o: Outcome, i: int, started_now: int,
                skipped: list[int]) -> tuple[float | None, bool]:
    """Message ``i`` of an ordered segment failed: the segment stays at it, and runs again
    from it after a backoff (its run state keeps the error; the progress, the attempts)."""
    record = item.record
    mid = record.ids[i]
    delay = runner.retry_delay(o)
    state = RunState(o.attempts, list(o.done), o.error, runner._wall() + int(delay * 1000))
    view = _tuple(Incoming, (mid, record, None, None))
    events = [runner._event("handler_failed", view, o.attempts, o.error),
              runner._event("retried", view, o.attempts, o.error)]
    progress = Progress(i, started_now, list(skipped))
    settled(runner._hooks, runner._handlers, "retried", view, o)

    def build(batch: Any) -> None:
        batch.put_runstate(mid, state)
        batch.put_progress(item.id, START, progress)
        runner._hooks.events(batch, events)
    runner.writer.record(build, None, None)
    return time.monotonic() + delay, False


def _dead_one(runner: Runner, item: Incoming, view: Incoming, single: IncomingRecord, o: Outcome,
              nxt_index: int, started: int, skipped: list[int], last: bool, nxt: Incoming | None) -> bool:
    """Message ``view`` is a dead letter of its own; the segment goes on without it."""
    reason = o.reason or "handler_failed"
    name = "expired" if reason == "expired" else "deadlettered"
    letter = incoming_letter(reason, o.error, o.attempts, single)
    events = [*o.events, runner._event(name, view, o.attempts, o.error or reason)]
    progress = Progress(nxt_index, started, list(skipped))
    log.error("dead letter: %s %s after %d attempt(s): %s", view.record.topic, view.id, o.attempts,
              o.error or reason)
    settled(runner._hooks, runner._handlers, "deadlettered", view, o)

    def build(batch: Any) -> None:
        batch.delete_runstate(view.id)
        batch.put_deadletter(view.id, letter)
        runner._hooks.events(batch, events)
        if not last:
            batch.put_progress(item.id, START, progress)
    if last:
        return _finish(runner, item, skipped, nxt, build)
    return runner.writer.record(build, None, nxt, progress=(item.id, progress))


def _all_dead(runner: Runner, item: Incoming, start: int, skipped: list[int], reason: str,
              error: str | None) -> tuple[float | None, bool]:
    """Every message of the segment not done yet is a dead letter (it expired, or it cannot
    be read), in the write that takes the segment out."""
    record = item.record
    try:
        bodies: list[bytes] | None = bodies_of(record.blob)
    except Exception:  # noqa: BLE001
        bodies = None
    todo = [j for j in range(start, len(record.ids)) if j not in set(skipped)]
    name = "expired" if reason == "expired" else "deadlettered"
    attempts = (item.runstate or NO_RUNS).attempts

    def build(batch: Any) -> None:
        evs = []
        for j in todo:
            single = one(record, j, bodies[j]) if bodies is not None and j < len(bodies) else \
                record._replace(ids=[record.ids[j]])
            batch.put_deadletter(record.ids[j], incoming_letter(reason, error, attempts, single))
        if todo:
            evs.append(event(name, runner._wall(), record.ids[todo[0]], record.topic,
                             KIND_NAMES.get(record.kind, "event"), record.reply_to, attempts,
                             error or reason, [record.ids[j] for j in todo]))
        runner._hooks.events(batch, evs)
    log.error("dead letter: %s %s (%d message(s) of its segment): %s", record.topic, item.id,
              len(todo), error or reason)
    settled(runner._hooks, runner._handlers, "deadlettered", item, Outcome("dead", attempts, reason, error),
            [record.ids[j] for j in todo])
    _finish(runner, item, [*skipped, *todo], None, build)
    return None, False
