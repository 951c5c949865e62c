"""The delivery audit of a tools/chaos run, against what the run's processes counted.

After each fault kind tools/chaos audits the run's journals (kept in WORK/journals) with the
PySpark delivery audit (servicebus/audit) and compares, message by message, the audit's
classes with what the processes themselves wrote down (``facts``: the publisher's
acknowledged ids, every handler run, the dead letters listed at each bus, what a repair
reported lost; WORK/counts.json). tests/chaos/test_chaos.py runs the same ``compare`` with
its one Spark session of the test run.

Where they must agree (``compare``; the audit's classes are per (message, receiver) pair, a
message's classes are those of its pairs):

- every acknowledged message is in the journals (its ``published`` event is written in
  the batch its publish fsynced);
- the messages the audit finds handled (``handled`` or ``handled_more_than_once`` at some
  receiver) are exactly those a handler ran for: acknowledged or not (a publish killed
  during its fsync may still be delivered), the transaction kind's forwarded events at the
  sink included. A rerun after kill -9 or a power cut is one ``handled`` (its first
  completion never reached the disk, nor did its journal event); a group's handover is
  ``handled`` at each of two members, each once;
- the audit's ``handled_more_than_once`` only for messages the harness counted duplicated,
  and its ``lost`` only for messages the harness counted lost or a repair reported lost:
  with none counted, both are empty. Messages the harness knows are still owed at the end
  (lost, reported lost, or published without an acknowledgement) may be ``owed`` or
  ``in_flight``; another pair of a handled message may be ``dropped`` (a group's
  reassignment; a subscriber that moved is one receiver, at its new address);
- the messages dead-lettered (at a sender or a receiver) are exactly the dead letters
  ``servicebus deadletters`` lists at the buses.

The audit runs with ``grace_ms=0``: the run settled before the buses stopped, so nothing
is young; a message older than that is ``in_flight`` only if stored at its receiver, or
if its sender's clock went back after it was published (the clock kind).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

# The harness's facts (WORK/counts.json): each a list of message ids.
FACTS = ("acknowledged", "handled", "forwarded", "lost", "duplicated", "reported_lost", "deadletters")
FORWARDED = "chaos.forwarded"  # tools/chaos_node.py's topic of the transaction kind's forwarded events
GRACE_MS = 0
SHOW = 5  # ids shown per disagreement


def spark_problem() -> str | None:
    """Why the audit cannot run here (no pyspark, no Java 17+), or None."""
    try:
        import pyspark  # noqa: F401
    except ImportError:
        return "pyspark is not installed (pip install 'servicebus[audit]')"
    from servicebus.audit import job

    return job.java_problem()


def write_facts(work: Path, facts: dict[str, Any]) -> Path:
    path = work / "counts.json"
    path.write_text(json.dumps(facts))
    return path


def read_facts(work: Path) -> dict[str, Any]:
    return json.loads((work / "counts.json").read_text())


def _some(ids: Iterable[str]) -> str:
    ids = sorted(ids)
    return " ".join(ids[:SHOW]) + (f" (+{len(ids) - SHOW})" if len(ids) > SHOW else "")


def compare(facts: dict[str, Any], rows: Iterable[tuple[str, str, str, str]]) -> list[str]:
    """The disagreements between the harness's ``facts`` and the audit's ``rows`` (id,
    receiver, topic, class: its ``messages`` table), each one line; [] when they agree."""
    classes: dict[str, set[str]] = defaultdict(set)
    forwarded_topic: set[str] = set()
    for mid, _receiver, topic, klass in rows:
        classes[mid].add(klass)
        if topic == FORWARDED:
            forwarded_topic.add(mid)
    fact = {name: set(facts.get(name, ())) for name in FACTS}
    # The transaction kind names a forwarded event missing or doubled after the message
    # it forwards ("forward of ID"): an id the audit never saw as a forwarded message.
    forward_lost = any(x.startswith("forward of ") for x in fact["lost"])
    forward_dup = any(x.startswith("forward of ") for x in fact["duplicated"])
    audit_handled = {m for m, c in classes.items() if c & {"handled", "handled_more_than_once"}}
    audit_dup = {m for m, c in classes.items() if "handled_more_than_once" in c}
    audit_lost = {m for m, c in classes.items() if "lost" in c}
    audit_dead = {m for m, c in classes.items() if "deadlettered" in c}
    harness_handled = fact["handled"] | fact["forwarded"]
    out = []

    def differ(ids: set[str], what: str) -> None:
        if ids:
            out.append(f"{len(ids)} {what}: {_some(ids)}")

    differ(fact["acknowledged"] - set(classes), "acknowledged messages are in no journal")
    missed = harness_handled - audit_handled
    differ(missed, "messages a handler ran for are not handled in the audit (its classes: "
           + ", ".join(sorted({k for m in missed for k in classes.get(m, {"absent"})})) + ")")
    differ(audit_handled - harness_handled, "messages handled in the audit ran no handler the harness saw")
    dup_ok = fact["duplicated"] | (forwarded_topic if forward_dup else set())
    differ(audit_dup - dup_ok, "messages the audit finds handled more than once, the harness once")
    lost_ok = fact["lost"] | fact["reported_lost"] | (forwarded_topic if forward_lost else set())
    differ(audit_lost - lost_ok, "messages the audit finds lost, the harness not")
    differ(audit_dead - fact["deadletters"], "messages dead-lettered in the audit are no dead letter at any bus")
    differ(fact["deadletters"] - audit_dead, "dead letters at the buses are not dead-lettered in the audit")
    return out


def audit_run(spark, work: Path, facts: dict[str, Any], *, report: bool = False) -> dict[str, Any]:
    """Audit WORK/journals into WORK/audit and compare it with ``facts``: the audit's
    classes (message, receiver pairs), the disagreements, the seconds it took."""
    from servicebus.audit import job

    began = time.monotonic()
    out = work / "audit"
    summary = job.run(spark, [str(work / "journals")], str(out), grace_ms=GRACE_MS, report=report)
    rows = [(r["id"], r["receiver"], r["topic"], r["class"]) for r in
            spark.read.parquet(str(out / "messages")).select("id", "receiver", "topic", "class").collect()]
    disagreements = compare(facts, rows)
    messages = {r[0] for r in rows}
    return {"classes": summary["classes"], "messages": len(messages), "pairs": len(rows),
            "agrees": not disagreements, "disagreements": disagreements,
            "seconds": round(time.monotonic() - began, 2)}


class Auditor:
    """tools/chaos's audits: one Spark session (one JVM) for every kind of one invocation,
    started at the first audit; ``skipped`` says why there is none (said once on stderr)."""

    def __init__(self, enabled: bool, say) -> None:
        self.say = say
        self.skipped: str | None = None if enabled else "--no-audit"
        if enabled:
            self.skipped = spark_problem()
            if self.skipped:
                say(f"tools/chaos: the delivery audit is skipped: {self.skipped}")
        self.spark = None

    def audit(self, work: Path, facts: dict[str, Any], report: bool) -> dict[str, Any]:
        if self.skipped:
            return {"skipped": self.skipped}
        if self.spark is None:
            from servicebus.audit import job

            self.say("tools/chaos: starting Spark (local[2]) for the delivery audits")
            self.spark = job.spark_session("local[2]")
        try:
            return audit_run(self.spark, work, facts, report=report)
        except Exception as exc:  # an audit that cannot run is a failed run, said plainly
            return {"agrees": False, "disagreements": [f"the audit failed: {str(exc).splitlines()[0]}"]}

    def close(self) -> None:
        if self.spark is not None:
            from servicebus.audit import job

            self.spark.stop()
            if job.SPARK_LOG is not None:
                job.SPARK_LOG.unlink(missing_ok=True)
