"""Synthetic delivery journals with known faults, for tests and ``tools/bench_audit``.

One sender publishes ``messages`` events to each of ``receivers`` receivers; every
(message, receiver) pair gets a full, clean lifecycle (published, sent, acked on the
sender; received, handled on the receiver) unless a fault is injected into it:

- ``lost``: the receiver never got it (no received/handled/acked), published long ago
- ``duplicate``: handled twice
- ``deadletter``: the handler failed ``max_attempts`` times, then a dead letter
- ``in_flight``: published moments before the sender's last event, not yet received
"""

from __future__ import annotations

import random
from pathlib import Path

SENDER = "tcp://10.0.0.1:5000"


def _receiver(n: int) -> str:
    return f"tcp://10.0.1.{n}:6000"


def write_journals(root: Path, *, messages: int, receivers: int = 2, start_ms: int = 1_790_000_000_000,
                   rate: int = 5000, faults: dict[str, int] | None = None, topics: int = 3,
                   seed: int = 7) -> dict[str, list[tuple[str, str]]]:
    """Write journals under ``root/<node>/journal/``; return the injected (id, receiver) pairs
    per fault kind."""
    rng = random.Random(seed)
    faults = dict(faults or {})
    nodes = {SENDER: "sender0000000000"} | {_receiver(r): f"receiver{r:08d}" for r in range(receivers)}
    files = {}
    for address, node in nodes.items():
        directory = root / node / "journal"
        directory.mkdir(parents=True, exist_ok=True)
        files[address] = open(directory / f"{node}-{1:012d}.jsonl", "w")
    injected: dict[str, list[tuple[str, str]]] = {k: [] for k in ("lost", "duplicate", "deadletter", "in_flight")}
    # Fault pairs are drawn up front, from the older half of the run (so that they are
    # older than a grace shorter than half the run), and in-flight ones are the newest.
    pairs = [(m, r) for m in range(messages) for r in range(receivers)]
    chosen = rng.sample(range(len(pairs) // 2), sum(v for k, v in faults.items() if k != "in_flight"))
    plan: dict[tuple[int, int], str] = {}
    it = iter(chosen)
    for kind in ("lost", "duplicate", "deadletter"):
        for _ in range(faults.get(kind, 0)):
            plan[pairs[next(it)]] = kind
    for i in range(faults.get("in_flight", 0)):
        plan[pairs[len(pairs) - 1 - i]] = "in_flight"

    def line(address: str, event: str, ts: int, mid: str, topic: str, peer: str, attempt: int,
             role: str, error: str | None = None) -> str:
        err = "" if error is None else f',"error":"{error}"'
        return (f'{{"event":"{event}","ts":{ts},"node":"{nodes[address]}","address":"{address}",'
                f'"id":"{mid}","topic":"{topic}","kind":"event","peer":"{peer}",'
                f'"attempt":{attempt},"role":"{role}"{err}}}\n')

    sender_file = files[SENDER]
    last_ts = start_ms + messages * 1000 // rate + 5
    for m in range(messages):
        ts = start_ms + m * 1000 // rate
        mid = f"{ts:012x}{m:06x}abcdef"
        topic = f"orders.t{m % topics}"
        for r in range(receivers):
            rcv = _receiver(r)
            fault = plan.get((m, r))
            if fault == "in_flight":
                ts_pub = last_ts - 1  # published just now, on the sender's clock
                sender_file.write(line(SENDER, "published", ts_pub, mid, topic, rcv, 0, "sender"))
                injected["in_flight"].append((mid, rcv))
                continue
            sender_file.write(line(SENDER, "published", ts, mid, topic, rcv, 0, "sender"))
            sender_file.write(line(SENDER, "sent", ts + 1, mid, topic, rcv, 1, "sender"))
            if fault == "lost":
                injected["lost"].append((mid, rcv))
                continue
            sender_file.write(line(SENDER, "acked", ts + 3, mid, topic, rcv, 0, "sender"))
            out = files[rcv]
            out.write(line(rcv, "received", ts + 2, mid, topic, SENDER, 1, "receiver"))
            if fault == "deadletter":
                for attempt in (1, 2, 3):
                    out.write(line(rcv, "handler_failed", ts + 3 + attempt, mid, topic, SENDER, attempt,
                                   "receiver", "ValueError: bad order"))
                    if attempt < 3:
                        out.write(line(rcv, "retried", ts + 3 + attempt, mid, topic, SENDER, attempt,
                                       "receiver", "ValueError: bad order"))
                out.write(line(rcv, "deadlettered", ts + 7, mid, topic, SENDER, 3, "receiver",
                               "ValueError: bad order"))
                injected["deadletter"].append((mid, rcv))
                continue
            out.write(line(rcv, "handled", ts + 4 + rng.randint(0, 3), mid, topic, SENDER, 1, "receiver"))
            if fault == "duplicate":
                out.write(line(rcv, "handled", ts + 9, mid, topic, SENDER, 2, "receiver"))
                injected["duplicate"].append((mid, rcv))
    for fh in files.values():
        fh.close()
    return injected
