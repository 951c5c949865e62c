"""Classification and the summaries: the ``messages`` table and the numbers in summary.json.

``classify`` gives each (message, receiver) pair its class (the classes, and the order
they are tested in, are listed in job.py's docstring). Ages for the grace are measured on
the sender's own clock, against that journal's latest event; latencies compare two
machines' clocks and are clamped at 0.

Every summary comes from ``rollup``: one small aggregate of the ``messages`` table (counts
by topic, receiver, class, attempts, dead letter reason and latency bucket), from which
the classes, percentiles, per-topic and per-receiver rows and the histogram are computed
in Python. ``timeline`` is the one other aggregate, per second, for the report's plot.
"""

from __future__ import annotations

import re
from typing import Any

from .reconcile import last_event_columns

CLASSES = ("handled", "handled_more_than_once", "in_flight", "deadlettered", "dropped", "owed", "lost")
PROBLEMS = ("lost", "handled_more_than_once")


def classify(spark, pairs, clocks: dict[str, int], *, grace_ms: int, since_ms: int | None):
    """The ``messages`` table: one row per pair with its class."""
    from pyspark.sql import functions as F

    col, when = F.col, F.when
    # Aged on the sender's clock (its journal's latest event), as the README says; on the
    # receiver's only when no sender is known at all. Before, a pair with no published
    # event was aged on its receiver's: a receiver that was down stayed in flight for ever.
    ref_node = F.coalesce(col("sender"), col("receiver"))
    as_of = spark.createDataFrame(list(clocks.items()) or [("", 0)], "ref_node STRING, as_of LONG")
    pairs = (pairs
             .withColumn("ref_ts", F.coalesce(col("published_ts"), col("first_ts")))
             .withColumn("ref_node", ref_node)
             .join(F.broadcast(as_of), "ref_node", "left")
             .withColumn("age_ms", col("as_of") - col("ref_ts")))
    if since_ms is not None:
        pairs = pairs.where(col("ref_ts") >= F.lit(since_ms))
    zero = F.lit(0)
    klass = (when(col("handled_count") > 1, "handled_more_than_once")
             .when(col("handled_count") == 1, "handled")
             # A dead letter put back (servicebus replay) is owed again, not dead.
             .when(col("deadlettered") > F.coalesce(col("replayed"), zero), "deadlettered")
             .when(col("dropped") > 0, "dropped")
             .when(col("received") > 0, "in_flight")
             .when(col("age_ms") < F.lit(grace_ms), "in_flight")
             # Lost only with evidence: the receiver acknowledged it, then nothing. With
             # none, the sender still holds it for that receiver (down, or cut off): owed.
             .when(F.coalesce(col("acked"), zero) > 0, "lost")
             .otherwise("owed"))
    latency = when(col("handled_ts").isNotNull() & col("published_ts").isNotNull(),
                   F.greatest(col("handled_ts") - col("published_ts"), F.lit(0)))
    return pairs.select(
        "id", "receiver", "sender", "topic", "kind", klass.alias("class"), *last_event_columns(),
        F.when(col("sender_deadlettered") > 0, "sender").when(col("deadlettered") > 0, "receiver")
        .alias("deadlettered_at"), "received", "published_ts",
        "received_ts", "handled_ts", latency.alias("latency_ms"), "handled_count",
        F.coalesce(col("attempts"), F.lit(0)).alias("attempts"), "send_attempts", "retries",
        "deadletter_reason", "age_ms", *[c for c in ("touched", "was_open") if c in pairs.columns])


# Latency buckets: 100 per decade (each 2.3 % wide), so that percentiles come from one
# small aggregate rather than a sort or a sketch per group; a value is reported as its
# bucket's lower bound (within 2.3 % below the true percentile).
_BUCKETS_PER_DECADE = 100


def rollup(messages) -> list[dict]:
    """Counts by (topic, receiver, class, attempts, dead letter reason, latency bucket):
    one pass over ``messages``, a few thousand rows at most, from which every summary
    (classes, percentiles, per topic, per receiver, the histogram) is computed here."""
    from pyspark.sql import functions as F

    col = F.col
    bucket = F.floor(F.log10(F.greatest(col("latency_ms"), F.lit(1))) * _BUCKETS_PER_DECADE).cast("int")
    rows = (messages
            .withColumn("bucket", F.when(col("latency_ms").isNotNull(), bucket))
            .groupBy("topic", "receiver", "class", "attempts", "deadletter_reason", "bucket")
            .agg(F.count(F.lit(1)).alias("n"), F.sum("retries").alias("retries"),
                 F.max("latency_ms").alias("latency_max"), F.min("published_ts").alias("first"),
                 F.max("published_ts").alias("last"))
            .collect())
    return [r.asDict() for r in rows]


def _percentiles(buckets: dict[int, int]) -> list[float | None]:
    """p50, p95, p99 (ms) from latency bucket counts."""
    total = sum(buckets.values())
    if not total:
        return [None, None, None]
    out: list[float | None] = []
    seen, wanted = 0, [0.5, 0.95, 0.99]
    for b in sorted(buckets):
        seen += buckets[b]
        while wanted and seen >= wanted[0] * total:
            wanted.pop(0)
            out.append(0.0 if b <= 0 else round(10 ** (b / _BUCKETS_PER_DECADE), 1))
    return out


def summarize(rows: list[dict], key: str) -> list[dict]:
    """The ``by_topic`` / ``by_receiver`` rows, from the rollup."""
    groups: dict[str, dict] = {}
    latency: dict[str, dict[int, int]] = {}
    for r in rows:
        name = r[key] if r[key] is not None else "(unknown)"
        g = groups.setdefault(name, {key: name, "messages": 0, **{c: 0 for c in CLASSES},
                                     "latency_max_ms": None, "retries": 0, "max_attempts": 0})
        g["messages"] += r["n"]
        g[r["class"]] += r["n"]
        g["retries"] += r["retries"] or 0
        g["max_attempts"] = max(g["max_attempts"], r["attempts"] or 0)
        if r["latency_max"] is not None:
            g["latency_max_ms"] = max(g["latency_max_ms"] or 0, r["latency_max"])
        if r["bucket"] is not None:
            lat = latency.setdefault(name, {})
            lat[r["bucket"]] = lat.get(r["bucket"], 0) + r["n"]
    out = []
    for name in sorted(groups):
        p50, p95, p99 = _percentiles(latency.get(name, {}))
        out.append({**groups[name], "latency_p50_ms": p50, "latency_p95_ms": p95, "latency_p99_ms": p99})
    return out


def timeline(messages):
    """Messages published and handled per second (sender and receiver clocks): one
    ``groupBy`` over both times."""
    from pyspark.sql import functions as F

    col = F.col
    stamps = messages.select(F.explode(F.array(
        F.struct((col("published_ts") / 1000).cast("long").alias("second"), F.lit(1).alias("p"), F.lit(0).alias("h")),
        F.struct((col("handled_ts") / 1000).cast("long").alias("second"), F.lit(0).alias("p"), F.lit(1).alias("h")),
    )).alias("s")).select("s.*").where(col("second").isNotNull())
    return (stamps.groupBy("second").agg(F.sum("p").alias("published"), F.sum("h").alias("handled"))
            .orderBy("second"))


def latency_histogram(rows: list[dict]) -> list[tuple[float, int]]:
    """(bucket lower bound ms, count), 10 buckets per decade, for the report's plot."""
    coarse: dict[int, int] = {}
    for r in rows:
        if r["bucket"] is not None:
            b = r["bucket"] // (_BUCKETS_PER_DECADE // 10)
            coarse[b] = coarse.get(b, 0) + r["n"]
    return [(10 ** (b / 10), n) for b, n in sorted(coarse.items())]


def causes(reasons: dict[str, int], examples: int = 3) -> list[dict[str, Any]]:
    """Dead-letter reasons grouped by cause: the exception type of a ``Type: text`` error
    (one cause for every message its text names), else the reason itself (``expired``);
    each with how many and a few of its texts, the biggest first."""
    groups: dict[str, dict[str, Any]] = {}
    for text, n in reasons.items():
        head, sep, _rest = text.partition(":")
        cause = head.strip() if sep and re.fullmatch(r"[A-Za-z_][\w.]*", head.strip()) else text
        group = groups.setdefault(cause, {"cause": cause, "messages": 0, "examples": []})
        group["messages"] += n
        if len(group["examples"]) < examples:
            group["examples"].append(text[:300])
    return sorted(groups.values(), key=lambda g: (-g["messages"], g["cause"]))


def build_summary(paths: list[str], n_events: int, rows: list[dict], grace_ms: int,
             since_ms: int | None) -> dict[str, Any]:
    classes = {c: 0 for c in CLASSES}
    attempts: dict[str, int] = {}
    reasons: dict[str, int] = {}
    buckets: dict[int, int] = {}
    retries, latency_max, first, last = 0, None, None, None
    for r in rows:
        classes[r["class"]] += r["n"]
        key = str(r["attempts"])
        attempts[key] = attempts.get(key, 0) + r["n"]
        if r["class"] == "deadlettered":
            reason = r["deadletter_reason"] or "?"
            reasons[reason] = reasons.get(reason, 0) + r["n"]
        if r["bucket"] is not None:
            buckets[r["bucket"]] = buckets.get(r["bucket"], 0) + r["n"]
        retries += r["retries"] or 0
        if r["latency_max"] is not None:
            latency_max = max(latency_max or 0, r["latency_max"])
        if r["first"] is not None:
            first = r["first"] if first is None else min(first, r["first"])
            last = r["last"] if last is None else max(last, r["last"])
    p50, p95, p99 = _percentiles(buckets)
    return {
        "inputs": paths,
        "events": n_events,
        "messages": sum(classes.values()),
        "classes": classes,
        "ok": classes["lost"] == 0 and classes["handled_more_than_once"] == 0,
        "latency_ms": {"p50": p50, "p95": p95, "p99": p99, "max": latency_max},
        "retries": retries,
        "attempts": dict(sorted(attempts.items(), key=lambda kv: int(kv[0]))),
        "deadletter_reasons": reasons,
        "deadletter_causes": causes(reasons),
        "published_from_ms": first,
        "published_to_ms": last,
        "grace_ms": grace_ms,
        "since_ms": since_ms,
        "by_topic": summarize(rows, "topic"),
        "by_receiver": summarize(rows, "receiver"),
    }
