"""In-memory fakes for the handler side (``servicebus.handling``), in the style of the
delivery core's (fakes.py): no sockets, no LevelDB, no sleeping.

- ``HandlingStore``: a ``FakeStore`` that also takes what a handler's run writes (run
  states, completions, dead letters, replies, kv, the outbox) and can fail writes the way
  a full disk does, or "crash" (the process dies: no later write lands).
- ``FakePublisher``: the publish path (``staging.Publisher``) a handler's staged events
  and commands go through.
- ``EventLog``: a hook keeping every event it is shown.
- ``RunnerRig``: a ``Runner`` on those, driven from the test's thread on a ``FakeClock``;
  ``restart()`` makes a new one on what the store kept (a process started again).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..errors import BacklogFull, StoreError
from ..handling.policy import make_policy
from ..handling.handlers import Handler, Handlers
from ..handling.requests import PendingRequests
from ..handling.runner import Runner
from ..handling.transaction import StagedEvent
from ..hooks.base import Hook, Hooks
from ..model.config import BusConfig
from ..model.stored import Event, Incoming, IncomingRecord, OutboxSend, Progress, ReplyRecord, RunState
from ..model.segments import make_blob
from ..wire.payload import decode_payload, encode_payload
from ..wire.protocol import Kind
from .fakes import FakeBatch, FakeClock, FakeStore

__all__ = ["HandlingBatch", "HandlingStore", "FakePublisher", "EventLog", "RunnerRig"]

Op = tuple[str, tuple]


class HandlingBatch(FakeBatch):
    """``FakeBatch`` with the handler side's writes (``complete_incoming``,
    ``complete_with_reply``, ``deadletter_incoming``, ``split_off``, besides every
    ``put_*``/``delete_*``)
    and what ``RunWriter`` needs of a batch it reuses (``clear``, ``generation``)."""

    def __init__(self, generation: int = 0) -> None:
        super().__init__()
        self.generation = generation

    def clear(self) -> None:
        self.log = []
        self.ops = 0
        self.sync = False

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name.startswith(("complete_", "deadletter_", "split_")):
            return lambda *args: self._op(name, *args)
        return super().__getattr__(name)


class _Records(dict[str, IncomingRecord]):
    """The stored incoming messages by id; called, the store's reader of them (``Store.
    incoming``: (id, record) in id order, from a snapshot)."""

    def __call__(self, damaged: list | None = None) -> list[tuple[str, IncomingRecord]]:
        return sorted(self.items())


class HandlingStore(FakeStore):
    """What the handler side reads and writes (``handling.writes.RunStore``, and what a
    ``Dispatcher`` scans), in dictionaries. Only written batches are kept: a new runner on
    the same store is the process restarted. ``written`` holds each write's operations,
    in order, to tell what went into the same atomic write."""

    def __init__(self) -> None:
        super().__init__()
        self.incoming: _Records = _Records()
        self.runstate: dict[str, RunState] = {}
        self.runs: dict[tuple[str, int], Progress] = {}  # c/: (segment key, start) -> Progress
        self.kv: dict[str, bytes] = {}
        self.written: list[list[Op]] = []
        self.generation = 0
        self.closed = False
        self.crashed = False
        self.waits = 0  # wait_writable calls: a writer waiting for a full disk to clear
        self._failing = 0
        self._applied = False

    def batch(self) -> HandlingBatch:
        return HandlingBatch(self.generation)

    # --- faults -------------------------------------------------------------------------

    def fail_writes(self, count: int = 1, *, applied: bool = False) -> None:
        """The next ``count`` writes raise ``StoreError`` (a full disk). ``applied``: each is
        applied all the same (it reached LevelDB's log before failing, and the reopen
        applied it)."""
        self._failing, self._applied = count, applied

    def crash(self) -> None:
        """The process dies now: no later write lands, and the store reads as closed to
        whoever is still running in the dead process."""
        self.crashed = self.closed = True

    def restart(self) -> None:
        """The next process opens the store: what was written is there, writes work."""
        self.crashed = self.closed = False
        self._failing = 0
        self.generation += 1

    # --- writes ---------------------------------------------------------------------------

    def write(self, batch: FakeBatch, *, sync: bool) -> None:
        if self.crashed:
            raise StoreError("the process is gone")
        if self._failing:
            self._failing -= 1
            if self._applied:
                self._apply(batch, sync)
            raise StoreError("store write failed: No space left on device")
        self._apply(batch, sync)

    def _apply(self, batch: FakeBatch, sync: bool) -> None:
        super().write(batch, sync=sync)
        self.written.append(list(batch.log))

    def wait_writable(self, timeout: float) -> bool:
        self.waits += 1
        return not self.crashed

    def _put_runstate(self, mid: str, rs: RunState) -> None:
        self.runstate[mid] = RunState(rs.attempts, list(rs.done), rs.last_error, rs.next_ms)

    def _complete_incoming(self, mid: str, at: int, starts: Sequence[int] = ()) -> None:
        self.incoming.pop(mid, None)
        self.runstate.pop(mid, None)
        for start in starts:
            self.runs.pop((mid, start), None)
        self.handled[mid] = at

    def _put_progress(self, key: str, start: int, progress: Progress) -> None:
        self.runs[(key, start)] = Progress(progress.next, progress.started, list(progress.skipped))

    def _split_off(self, mid: str, record: IncomingRecord, state: RunState | None) -> None:
        self.incoming[mid] = record
        if state is not None:
            self._put_runstate(mid, state)

    def _delete_runstate(self, mid: str) -> None:
        self.runstate.pop(mid, None)

    def _complete_with_reply(self, mid: str, at: int, reply: ReplyRecord) -> None:
        self._complete_incoming(mid, at)
        self.reply[mid] = reply

    def _deadletter_incoming(self, mid: str, letter: dict) -> None:
        self.incoming.pop(mid, None)
        self.runstate.pop(mid, None)
        self.letters[mid] = letter

    def _put_kv(self, key: str, data: bytes) -> None: self.kv[key] = data
    def _delete_kv(self, key: str) -> None: self.kv.pop(key, None)
    def _put_outbox(self, mid: str, name: str, send: OutboxSend) -> None: self.sends[f"{mid}\x00{name}"] = send

    # --- reads ------------------------------------------------------------------------------

    def has_incoming(self, message_id: str) -> bool:
        return message_id in self.incoming

    def get_runstate(self, message_id: str) -> RunState | None:
        return self.runstate.get(message_id)

    def progress(self, key: str) -> dict[int, Progress]:
        """How far runs of received segment ``key`` got, by start index (``Store.progress``)."""
        return {start: p for (k, start), p in self.runs.items() if k == key}

    def get_kv(self, key: str, default: Any = None) -> Any:
        data = self.kv.get(key)
        return default if data is None else decode_payload(data)

    def kv_items(self, prefix: str = "") -> Iterator[tuple[str, Any]]:
        for key in sorted(self.kv):
            if key.startswith(prefix):
                yield key, decode_payload(self.kv[key])

    def ops(self, name: str, *first: object) -> list[tuple]:
        """The arguments of every ``name`` operation written, in order; with ``first``,
        only those whose arguments begin with it."""
        return [args for log in self.written for op, args in log
                if op == name and args[:len(first)] == first]

    def write_of(self, name: str, *first: object) -> list[Op]:
        """The one write holding a ``name`` operation (whose arguments begin with
        ``first``): every operation it made (AssertionError unless exactly one did)."""
        found = [log for log in self.written
                 if any(op == name and args[:len(first)] == first for op, args in log)]
        assert len(found) == 1, f"{len(found)} writes hold {name}{first}"
        return found[0]


class FakePublisher:
    """``staging.Publisher``: a handler's staged events are put in its run's write (one
    stream per topic: ``store.streams[topic]``), fsynced; the commands it sent are in
    ``queued`` once written. A topic in ``full`` refuses events (``BacklogFull``)."""

    def __init__(self, store: HandlingStore) -> None:
        self.store = store
        self.queued: list[tuple[str, OutboxSend]] = []
        self.full: set[str] = set()
        self._ids = itertools.count(1)

    def commit_transaction(self, events: list[StagedEvent], rest: Callable[[Any], bool]) -> bool:
        batch = self.store.batch()
        for staged in events:
            batch.put_outgoing(staged.topic, f"e{next(self._ids):06d}", staged.body)
        marked = rest(batch)
        self.store.write(batch, sync=True)
        return marked

    def queue_sends(self, sends: list[tuple[str, OutboxSend]]) -> None:
        self.queued.extend(sends)

    def backpressure(self, topic: str, priority: int) -> None:
        if topic in self.full:
            raise BacklogFull(f"a subscriber of {topic!r} has max_backlog messages waiting")

    def published(self, topic: str) -> list[Any]:
        """The payloads stored for ``topic``, in order."""
        return [decode_payload(body) for _mid, body in sorted(self.store.streams.get(topic, {}).items())]


class EventLog(Hook):
    """Keeps every event the bus shows its hooks (``seen``), in order."""

    def __init__(self) -> None:
        self.seen: list[Event] = []

    def events(self, batch: Any, events: Sequence[Event]) -> None:
        self.seen.extend(events)

    def names(self, mid: str) -> list[str]:
        """The names of ``mid``'s events, in order."""
        return [e.name for e in self.seen if e.id == mid]

    def about(self, mid: str) -> list[Event]:
        """Every event naming message ``mid``: its own, and a segment's that lists it."""
        return [e for e in self.seen if e.id == mid or mid in (e.ids or ())]


class RunnerRig:
    """A ``Runner`` made as a dispatcher makes it, on a ``HandlingStore``, a
    ``FakePublisher`` and a ``FakeClock``: ``add`` handlers, ``receive`` messages (stored
    as the engine stores them; ``receive_segment`` for a segment of several), ``run`` one
    from the test's thread, ``restart`` after a ``store.crash()``. ``parked``, ``replies``
    and ``spawned`` (messages split off a segment) keep what the runner handed back."""

    def __init__(self, store: HandlingStore | None = None, clock: FakeClock | None = None, *,
                 publisher: bool = True, **config: Any) -> None:
        self.store = store or HandlingStore()
        self.clock = clock or FakeClock()
        self.config = BusConfig.of(config)
        self.handlers = Handlers()
        self.log = EventLog()
        self.publisher = FakePublisher(self.store) if publisher else None
        self.parked: list[tuple[tuple[int, str], int | None]] = []
        self.spawned: list[tuple[Incoming, float]] = []  # messages split off a segment, and when due
        self.replies: list[tuple[str, ReplyRecord]] = []
        self.closing = False
        self._ids = itertools.count(1)
        self.runner = self._runner()

    def _runner(self) -> Runner:
        self.requests = PendingRequests()
        runner = Runner(self.store, self.config, self.handlers, requests=self.requests,
                        on_reply=lambda mid, reply: self.replies.append((mid, reply)),
                        hooks=Hooks([self.log]), clock=self.clock,
                        park=self._park,
                        closing=lambda: self.closing, wall=self.clock.wall_ms,
                        spawn=lambda item, due: self.spawned.append((item, due)))
        runner.staging.publisher = self.publisher
        return runner

    def _park(self, item: Incoming) -> None:
        self.parked.append(((item.record.kind, item.record.topic), item.record.expires))

    def restart(self) -> None:
        """The process started again: a new runner on what the store kept (the handlers
        are registered again, as the service's code does at start)."""
        self.store.restart()
        self.runner = self._runner()

    def add(self, topic: str, handler: Handler, *, kind: Kind = Kind.EVENT, name: str | None = None,
            **policy: Any) -> None:
        """Add a handler, with ``every``'s retry policy keywords (policy.py)."""
        self.handlers.add(kind, topic, handler, name, policy=make_policy(**policy))

    def receive(self, topic: str, payload: Any = None, *, kind: Kind = Kind.EVENT,
                ttl: float | None = None, correlation_id: str | None = None,
                body: bytes | None = None) -> str:
        """Store a received message, as the engine does before handing it over; its id."""
        mid = f"0000000000000000000{next(self._ids):06d}"
        expires = None if ttl is None else self.clock.wall_ms() + int(ttl * 1000)
        self.store.incoming[mid] = IncomingRecord(
            int(kind), topic, "peer-node", "ipc://peer", self.clock.wall_ms(), 1, expires,
            correlation_id, None, [mid], make_blob([encode_payload(payload) if body is None else body]))
        return mid

    def receive_segment(self, topic: str, *payloads: Any, kind: Kind = Kind.EVENT,
                        ttl: float | None = None, headers: dict[str, Any] | None = None,
                        bodies: Sequence[bytes] | None = None) -> tuple[str, list[str]]:
        """Store a received segment of several messages (one publish of ``payloads``, or of
        the raw ``bodies``), as the engine does; its key and its messages' ids."""
        if bodies is None:
            bodies = [encode_payload(p) for p in payloads]
        ids = [f"0000000000000000000{next(self._ids):06d}" for _ in bodies]
        expires = None if ttl is None else self.clock.wall_ms() + int(ttl * 1000)
        self.store.incoming[ids[0]] = IncomingRecord(
            int(kind), topic, "peer-node", "ipc://peer", self.clock.wall_ms(), 1, expires,
            None, headers, ids, make_blob(list(bodies)))
        return ids[0], ids

    def request(self, command: str, payload: Any = None, *, ttl: float | None = None) -> str:
        """Store a received request (a command a caller waits on) for ``command``."""
        return self.receive(command, payload, kind=Kind.COMMAND, ttl=ttl,
                            correlation_id="c0ffee000000-1")

    def item(self, mid: str) -> Incoming:
        """``mid`` as the dispatcher hands it to a runner: its record and run state (and
        for a segment of several, the progress of its runs)."""
        record = self.store.incoming[mid]
        progress = self.store.progress(mid) if len(record.ids) > 1 else None
        return Incoming(mid, record, self.store.get_runstate(mid), progress)

    def run(self, mid: str) -> float | None:
        """Run ``mid`` once; when to retry it (monotonic), or None if it is finished."""
        retry_at, _marked = self.runner.run(self.item(mid))
        return retry_at

    def reply(self, mid: str) -> Any:
        """The reply stored for request ``mid``, decoded."""
        return decode_payload(self.store.reply[mid].body)
