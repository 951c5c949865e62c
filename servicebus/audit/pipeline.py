"""The audit itself (``run``): the journals in, the summary out, in the order that costs
one read and one shuffle of the events.

Segments are read and reconciled into pairs (reconcile.py), the pairs written to Parquet
under DIR/_work and read back, classified into the ``messages`` table (classify.py),
summarised from one rollup of it, and written out (outputs.py); with a checkpoint,
folded with the pairs carried from the last run and the open ones carried on
(checkpoint.py). Each phase's seconds go into ``summary["phases"]``.
"""

from __future__ import annotations

import json

import time

from .checkpoint import Checkpoint
from .classify import build_summary, classify, rollup, timeline
from .errors import AuditError
from .hadoopfs import delete_path, write_text
from .journals import input_paths, merge_buses, moved_addresses, read_bus_files, read_events, segment_files
from .outputs import write_outputs
from .problems import LISTED, listed, name_addresses, problem_table
from .reconcile import address_now, combine, journal_clocks, partials

SHOW_IDS = 20


def run(spark, paths: list[str], out: str, *, grace_ms: int = 60_000, since_ms: int | None = None,
        write: bool = True, checkpoint: str | None = None, carry_ms: int = 7 * 86_400_000,
        report: bool = True) -> dict:
    """The whole audit; returns the summary (also written to ``out`` when ``write``).

    ``report=False`` (with ``write``) leaves only the ``messages`` table and summary.json in
    ``out``, without the small tables, report.html and report.png (seconds a run does not
    need when a program reads the table, as tools/chaos does after every fault kind).

    With ``checkpoint`` (a directory or URI): read only the segments no earlier run with
    that checkpoint read, fold in the pairs it carried forward, report the pairs the new
    segments touched and those it carried open, and carry forward to the next run every
    pair still in flight and every pair published within ``carry_ms`` (default 7 days, the
    dedupe window: a late duplicate of a message reported handled is still found)."""
    from pyspark.sql import functions as F

    started = time.monotonic()
    skipped: list[str] = []
    globs = input_paths(paths, skipped)
    files = read_bus_files(spark, globs)  # every bus's, a checkpointed run's old segments' too
    buses, moved = merge_buses([found for _node, found in files]), moved_addresses(files)
    state = None
    segments: list[str] = []
    if checkpoint is not None:
        state = Checkpoint.load(spark, checkpoint)
        segments = segment_files(spark, globs)
        globs = [f for f in segments if f not in state.files]
        state.files = set(segments)  # what the checkpoint says was read, once this run is saved
    if globs:
        pairs = partials(read_events(spark, globs, spread=True), moved)
    else:
        pairs = None
    if state is not None:
        frames = ([pairs.withColumn("touched", F.lit(1)).withColumn("was_open", F.lit(0))
                   .withColumn("new_events", F.col("n_events"))] if pairs is not None else [])
        carried = state.pairs(spark)
        if carried is not None and moved:  # carried at an address its bus has since left
            now, col = address_now(moved), F.col
            carried = carried.withColumn("receiver", now(col("receiver"))).withColumn("sender", now(col("sender")))
            if "moved_to" in carried.columns:  # a drop "moved to" what is now known as the same bus: none
                same = F.coalesce(now(col("moved_to")) == col("receiver"), F.lit(False))
                carried = (carried
                           .withColumn("dropped", F.when(same, col("dropped") - col("moved_drops")).otherwise(col("dropped")))
                           .withColumn("moved_drops", F.when(same, F.lit(0).cast("long")).otherwise(col("moved_drops")))
                           .withColumn("moved_to", F.when(~same, col("moved_to"))))
        if carried is not None:
            frames.append(carried.withColumn("touched", F.lit(0)).withColumn("new_events", F.lit(0)))
        if not frames:
            raise AuditError("no new journal segments since the last checkpointed audit, and nothing carried")
        pairs = combine(frames)
    if pairs is None:
        raise AuditError("the journals hold no events")
    # Intermediate tables go to Parquet under DIR/_work and are read back: measured on 5M
    # events, caching the pairs in Spark's memory took 14 s, writing and reading them 1.3 s.
    work = f"{out.rstrip('/')}/_work"
    try:
        summary = _audit(spark, pairs, paths, out.rstrip("/"), work, state, buses, grace_ms=grace_ms,
                         since_ms=since_ms, write=write, carry_ms=carry_ms, report=report)
    finally:
        delete_path(spark, work)
    if state is not None:
        summary["checkpoint"] = {"segments_read": len(globs), "segments_known": len(segments),
                                 "carried_in": state.carried, "carried_out": state.carried_out}
    summary["seconds"] = round(time.monotonic() - started, 3)
    summary["skipped_inputs"] = skipped
    if write:  # summary.json again: the phases, seconds and checkpoint came after it was written
        write_text(spark, f"{out.rstrip('/')}/summary.json", json.dumps(summary, indent=2, default=str))
    return summary


class _Phases:
    """Seconds spent in each phase of a run (``summary["phases"]``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.monotonic()

    def done(self, name: str) -> None:
        now = time.monotonic()
        self.seconds[name] = round(now - self._last, 3)
        self._last = now


def _audit(spark, pairs, paths: list[str], out: str, work: str, state: "Checkpoint | None",
           buses: dict[str, dict[str, str | None]], *,
           grace_ms: int, since_ms: int | None, write: bool, carry_ms: int, report: bool) -> dict:
    from pyspark.sql import functions as F

    phases = _Phases()
    pairs.write.mode("overwrite").parquet(f"{work}/pairs")
    phases.done("read_and_reconcile")
    # Read back with the schema it was written with: no Spark job to infer it (each of
    # those costs a few tenths of a second on a cold JVM).
    pairs = spark.read.schema(pairs.schema).parquet(f"{work}/pairs")
    clocks, n_events = journal_clocks(pairs, "new_events" if "new_events" in pairs.columns else "n_events")
    if n_events == 0 and state is None:  # (an incremental run may find nothing new)
        raise AuditError("the journals hold no events")
    if state is not None:
        for node, ts in state.clocks.items():
            clocks[node] = max(ts, clocks.get(node, ts))
        state.clocks = clocks
    messages = classify(spark, pairs, clocks, grace_ms=grace_ms, since_ms=since_ms)
    if state is not None:
        # This run reports what its new segments touched and what it carried open.
        messages = messages.where((F.col("touched") == 1) | (F.coalesce(F.col("was_open"), F.lit(0)) == 1))
    table = f"{out}/messages" if write else f"{work}/messages"
    messages = messages.drop("touched", "was_open")
    messages.write.mode("overwrite").parquet(table)
    phases.done("classify_and_write_messages")
    reported = spark.read.schema(messages.schema).parquet(table)
    rows = rollup(reported)
    summary = build_summary(paths, n_events, rows, grace_ms, since_ms)
    full = write and report  # without the report (tools/chaos), the problem list stays in _work
    table = f"{out}/problems" if full else f"{work}/problems"
    if full or any(summary["classes"][k] for k in LISTED):
        problems = problem_table(spark, reported, buses)
        problems.write.mode("overwrite").parquet(table)
        summary["problems"] = listed(spark.read.schema(problems.schema).parquet(table), summary["classes"])
    else:
        summary["problems"] = {k: [] for k in LISTED}
    summary["problem_counts"] = {k: summary["classes"][k] for k in LISTED}
    owed = []
    if summary["classes"].get("owed"):  # waiting on which receiver, since when
        owed = (reported.where(F.col("class") == "owed")
                .groupBy("receiver").agg(F.count(F.lit(1)).alias("messages"),
                                         F.min("published_ts").alias("since_ms"))
                .orderBy(F.desc("messages")).limit(SHOW_IDS).collect())
    summary["owed"] = [{"receiver": r["receiver"], "messages": r["messages"], "since_ms": r["since_ms"]}
                       for r in owed]
    name_addresses(summary, buses)
    phases.done("summarize")
    if write and report:
        write_outputs(spark, out, summary, rows, timeline(reported))
        phases.done("tables_and_report")
    if state is not None:
        everything = classify(spark, pairs, clocks, grace_ms=grace_ms, since_ms=None)
        state.save(spark, pairs, everything, carry_ms)
        phases.done("checkpoint")
    summary["phases"] = phases.seconds
    return summary
