"""Synthetic delivery journals with known faults, for tests and ``tools/bench_audit``.

One sender publishes ``messages`` events to each of ``receivers`` receivers; every
(message, receiver) pair gets a full, clean lifecycle (published, sent, acked on the
sender; received, handled on the receiver) unless a fault is injected into it:

- ``lost``: the receiver acknowledged it and then nothing (no received, handled or dead
  letter in its journal), published long ago: a loss with evidence
- ``owed``: published long ago and never acknowledged: the sender still holds it for a
  receiver that is down (not lost: the audit's class ``owed``)
- ``duplicate``: handled twice
- ``deadletter``: the handler failed ``max_attempts`` times, then a dead letter
- ``in_flight``: published moments before the sender's last event, not yet received
- ``expired``: its TTL passed at the sender before the receiver acked it (a dead letter
  there, reason ``expired``)
- ``retried``: the handler failed once, then handled it (not a fault: class ``handled``,
  one retry)

With ``segment`` above 1 the journals are those of a bus of store format 3: the messages
are published ``segment`` at a time (one stored segment each), and every event about
several messages of a segment is one line naming them all in ``ids`` (``id`` is the
first): published, sent, acked, received and handled per segment and receiver, an expiry
of several. What happens to one message alone is a line of its own, as the bus writes it:
a failed handler's message is split off its segment (handler_failed, retried, then handled
or deadlettered), and the segment's ``handled`` names the others; a pair faulted out of a
segment (lost, in flight) is left out of the lines it did not get. ``segment=1`` writes
exactly what it wrote before segments existed (no line has ``ids``).

``columns=True`` writes the same events in the columnar format a bus writes now
(hooks/segments.py, ``.jcol``), one entry per message; the default is the line format of
older buses (``.jsonl``), which the tests of old journals use.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from ..hooks.segments import COLUMNS, LINES, Columns

SENDER = "tcp://10.0.0.1:5000"
FAULTS = ("lost", "duplicate", "deadletter", "in_flight", "expired", "retried", "owed")


def _receiver(n: int) -> str:
    return f"tcp://10.0.1.{n}:6000"


def write_journals(root: Path, *, messages: int, receivers: int = 2, start_ms: int = 1_790_000_000_000,
                   rate: int = 5000, faults: dict[str, int] | None = None, topics: int = 3,
                   seed: int = 7, segment: int = 1, columns: bool = False) -> dict[str, list[tuple[str, str]]]:
    """Write journals under ``root/<node>/journal/``; return the injected (id, receiver) pairs
    per fault kind (every kind of FAULTS, empty if not asked for)."""
    rng = random.Random(seed)
    faults = dict(faults or {})
    unknown = set(faults) - set(FAULTS)
    if unknown or segment < 1:
        raise ValueError(f"faults are among {FAULTS} and segment >= 1; got {sorted(unknown)}, {segment}")
    nodes = {SENDER: "sender0000000000"} | {_receiver(r): f"receiver{r:08d}" for r in range(receivers)}
    files, builders = {}, {}
    for address, node in nodes.items():
        directory = root / node / "journal"
        directory.mkdir(parents=True, exist_ok=True)
        files[address] = open(directory / f"{node}-{1:012d}{COLUMNS if columns else LINES}", "w")
        builders[address] = Columns(node, address)
    injected: dict[str, list[tuple[str, str]]] = {k: [] for k in FAULTS}
    # Fault pairs are drawn up front, from the older half of the run (so that they are
    # older than a grace shorter than half the run), and in-flight ones are the newest.
    # The kinds take their draws in FAULTS order: a kind added later leaves the pairs an
    # older seed gave the first kinds where they were.
    pairs = [(m, r) for m in range(messages) for r in range(receivers)]
    chosen = rng.sample(range(len(pairs) // 2), sum(v for k, v in faults.items() if k != "in_flight"))
    plan: dict[tuple[int, int], str] = {}
    it = iter(chosen)
    for kind in FAULTS:
        if kind != "in_flight":
            for _ in range(faults.get(kind, 0)):
                plan[pairs[next(it)]] = kind
    for i in range(faults.get("in_flight", 0)):
        plan[pairs[len(pairs) - 1 - i]] = "in_flight"

    def line(address: str, event: str, ts: int, ids: list[str], topic: str, peer: str, attempt: int,
             role: str, error: str | None = None) -> str:
        # As the journal writes them (hooks/journal.py): ``ids`` only when there are several.
        err = "" if error is None else f',"error":"{error}"'
        more = f',"ids":{json.dumps(ids)}' if len(ids) > 1 else ""
        return (f'{{"event":"{event}","ts":{ts},"node":"{nodes[address]}","address":"{address}",'
                f'"id":"{ids[0]}"{more},"topic":"{topic}","kind":"event","peer":"{peer}",'
                f'"attempt":{attempt},"role":"{role}"{err}}}\n')

    def emit(address: str, event: str, ts: int, ids: list[str], topic: str, peer: str, attempt: int,
             role: str, error: str | None = None) -> None:
        if not columns:
            files[address].write(line(address, event, ts, ids, topic, peer, attempt, role, error))
            return
        builder = builders[address]
        builder.put((event, topic, "event", peer, role), ts, ids, attempt, error)
        files[address].writelines(builder.ready())  # line by line: memory stays flat

    last_ts = start_ms + messages * 1000 // rate + 5
    for first in range(0, messages, segment):
        group = range(first, min(first + segment, messages))
        ts = start_ms + first * 1000 // rate  # a segment's messages are published together
        ids = {m: f"{start_ms + m * 1000 // rate:012x}{m:06x}abcdef" for m in group}
        topic = f"orders.t{first // segment % topics}"
        for r in range(receivers):
            rcv = _receiver(r)
            fault = [(ids[m], plan.get((m, r))) for m in group]
            for mid, how in fault:
                if how is not None:
                    injected[how].append((mid, rcv))

            def of(*kinds: str | None) -> list[str]:
                """The segment's messages (in order) whose fault is one of ``kinds``."""
                return [mid for mid, how in fault if how in kinds]

            if of("in_flight"):  # published just now, on the sender's clock
                emit(SENDER, "published", last_ts - 1, of("in_flight"), topic, rcv, 0, "sender")
            owed = [mid for mid, how in fault if how != "in_flight"]
            if not owed:
                continue
            emit(SENDER, "published", ts, owed, topic, rcv, 0, "sender")
            emit(SENDER, "sent", ts + 1, owed, topic, rcv, 1, "sender")
            if of("expired"):
                emit(SENDER, "expired", ts + 2, of("expired"), topic, rcv, 1, "sender",
                                       "expired")
            arrived = of(None, "duplicate", "deadletter", "retried")
            if arrived or of("lost"):
                emit(SENDER, "acked", ts + 3, of(None, "duplicate", "deadletter", "retried",
                                                                   "lost"), topic, rcv, 0, "sender")
            if not arrived:
                continue
            emit(rcv, "received", ts + 2, arrived, topic, SENDER, 1, "receiver")
            for mid in of("deadletter"):  # split off its segment: lines of its own
                for attempt in (1, 2, 3):
                    emit(rcv, "handler_failed", ts + 3 + attempt, [mid], topic, SENDER, attempt,
                                   "receiver", "ValueError: bad order")
                    if attempt < 3:
                        emit(rcv, "retried", ts + 3 + attempt, [mid], topic, SENDER, attempt,
                                       "receiver", "ValueError: bad order")
                emit(rcv, "deadlettered", ts + 7, [mid], topic, SENDER, 3, "receiver",
                               "ValueError: bad order")
            for mid in of("retried"):
                emit(rcv, "handler_failed", ts + 4, [mid], topic, SENDER, 1, "receiver",
                               "TimeoutError: slow database")
                emit(rcv, "retried", ts + 4, [mid], topic, SENDER, 1, "receiver",
                               "TimeoutError: slow database")
                emit(rcv, "handled", ts + 6, [mid], topic, SENDER, 2, "receiver")
            if of(None, "duplicate"):  # the segment's one "handled": every message it handled
                emit(rcv, "handled", ts + 4 + rng.randint(0, 3), of(None, "duplicate"), topic,
                               SENDER, 1, "receiver")
            if of("duplicate"):
                emit(rcv, "handled", ts + 9, of("duplicate"), topic, SENDER, 2, "receiver")
    for address, fh in files.items():
        fh.writelines(builders[address].lines())
        fh.close()
    return injected
