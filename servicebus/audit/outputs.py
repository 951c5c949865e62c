"""What a run leaves in DIR besides the ``messages`` table: the ``timeline``, ``by_topic``
and ``by_receiver`` tables, summary.json, report.html and report.png. All of it is drawn
from small inputs (the summary, the rollup's rows, the per-second timeline), never from
the events or the pairs."""

from __future__ import annotations

import json

from . import report
from .classify import CLASSES, latency_histogram
from .hadoopfs import write_bytes, write_text


def write_outputs(spark, out: str, summary: dict, rows: list[dict], times) -> None:
    """The small tables, summary.json, report.html and report.png (the plots alone)."""
    times.write.mode("overwrite").parquet(f"{out}/timeline")
    timeline_rows = [(r["second"], r["published"], r["handled"]) for r in spark.read.schema(times.schema)
                     .parquet(f"{out}/timeline").orderBy("second").limit(100_000).collect()]
    for name in ("by_topic", "by_receiver"):
        key = "topic" if name == "by_topic" else "receiver"
        table = summary[name]
        schema = (f"{key} STRING, " + ("receiver_name STRING, " if key == "receiver" else "")
                  + "messages LONG, " + ", ".join(f"{c} LONG" for c in CLASSES)
                  + ", latency_max_ms LONG, retries LONG, max_attempts INT, latency_p50_ms DOUBLE, "
                  "latency_p95_ms DOUBLE, latency_p99_ms DOUBLE")
        frame = spark.createDataFrame([tuple(r.get(c.split()[0]) for c in schema.split(", ")) for r in table], schema)
        frame.coalesce(1).write.mode("overwrite").parquet(f"{out}/{name}")
    for name in ("by_topic", "by_receiver"):  # all of them in the tables; the count beside
        summary[f"{name}_count"] = len(summary[name])
        summary[name] = summary[name][:200]
    histogram = latency_histogram(rows)
    write_text(spark, f"{out}/summary.json", json.dumps(summary, indent=2, default=str))
    page, png = report.render(summary, histogram, timeline_rows)
    write_text(spark, f"{out}/report.html", page)
    if png is not None:
        write_bytes(spark, f"{out}/report.png", png)
