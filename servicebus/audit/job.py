"""The fleet delivery audit (PySpark, DataFrame API only).

    servicebus audit PATH [PATH ...] --out DIR [--master local[*]] [--since T] [--grace 60s]
    spark-submit servicebus/audit/job.py PATH [PATH ...] --out DIR [--since T] [--grace 60s]

PATH is a data directory, a folder of data directories, or any URI Spark reads (then the
segments are found with the glob ``PATH/{journal,*/journal}/*.jsonl``).

Every journal event belongs to one (message, receiver) pair: a sender-side event's
receiver is its ``peer``, a receiver-side event's receiver is its ``address``. Each pair is
classified, in this order:

- ``handled_more_than_once``: more than one ``handled`` event (a duplicate reached a handler)
- ``handled``: exactly one
- ``deadlettered``: dead-lettered or expired, at the sender or the receiver
- ``dropped``: no longer owed and not delivered: the receiver unsubscribed, or an operator
  purged it (``servicebus purge``); the event's error says which
- ``in_flight``: stored at the receiver and not handled yet, or published less than
  ``--grace`` before the sender's latest journal event
- ``lost``: published to that receiver, older than the grace, never received, handled or
  dead-lettered

Reconciliation uses message ids and addresses only, never clocks. The only times compared
across machines are latencies (``handled`` on the receiver's clock minus ``published`` on
the sender's); negative ones (clock skew) are clamped to 0. A message's age, for the
grace, is measured on the sender's own clock.

The job writes Parquet tables ``messages``, ``by_topic``, ``by_receiver`` and ``timeline``,
``summary.json`` and ``report.html`` to DIR, prints a short table, and exits 0 when nothing
is lost or duplicated, 1 when something is (the first 20 ids are printed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

SCHEMA = ("event STRING, ts LONG, node STRING, address STRING, id STRING, topic STRING, "
          "kind STRING, peer STRING, attempt INT, role STRING, error STRING")
CLASSES = ("handled", "handled_more_than_once", "in_flight", "deadlettered", "dropped", "lost")
PROBLEMS = ("lost", "handled_more_than_once")
SHOW_IDS = 20


class AuditError(Exception):
    """Bad input (no journals, bad arguments, no Java): one clear line for the operator."""


# --- arguments -----------------------------------------------------------------------------

_UNITS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def parse_duration(text: str) -> int:
    """'60s', '5m', '2h', '1d', '250ms' or plain seconds -> milliseconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*", text)
    if not match:
        raise AuditError(f"not a duration: {text!r} (examples: 60s, 5m, 2h, 1d)")
    return int(float(match.group(1)) * _UNITS[match.group(2) or "s"])


def parse_since(text: str | None, now_ms: int) -> int | None:
    """An ISO date/time (UTC unless it says), epoch seconds, or a duration ago ('2h')."""
    if text is None:
        return None
    try:
        stamp = datetime.fromisoformat(text)
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=timezone.utc)
        return int(stamp.timestamp() * 1000)
    except ValueError:
        pass
    if re.fullmatch(r"\d{9,}(\.\d+)?", text):
        return int(float(text) * 1000)
    return now_ms - parse_duration(text)


def java_problem() -> str | None:
    """Why PySpark cannot start here, or None. Spark 4 needs Java 17 or newer."""
    java = shutil.which("java")
    if os.environ.get("JAVA_HOME"):
        candidate = Path(os.environ["JAVA_HOME"]) / "bin" / "java"
        java = str(candidate) if candidate.exists() else java
    hint = ("install it (Debian/Ubuntu: apt-get install openjdk-17-jre-headless) or point "
            "JAVA_HOME at a Java 17+ installation")
    if not java:
        return f"the audit runs on Apache Spark, which needs Java 17 or newer, and none was found: {hint}"
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30).stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run {java} ({exc}): {hint}"
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    major = int(match.group(1)) if match else 0
    if major == 1 and match and match.group(2):
        major = int(match.group(2))
    if major < 17:
        return f"Spark needs Java 17 or newer; {java} is Java {major or '?'}: {hint}"
    return None


def input_paths(paths: list[str]) -> list[str]:
    """Glob patterns for the journal segments under each PATH."""
    out: list[str] = []
    for raw in paths:
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", raw) and not raw.startswith("file://"):
            out.append(raw.rstrip("/") + "/{journal,*/journal}/*.jsonl")
            continue
        local = Path(raw.removeprefix("file://"))
        if not local.exists():
            raise AuditError(f"{raw}: no such file or directory")
        if local.is_file():
            out.append(str(local.resolve()))
            continue
        found = False
        for pattern in ("journal/*.jsonl", "*/journal/*.jsonl", "*.jsonl"):
            if next(local.glob(pattern), None) is not None:
                out.append(str(local.resolve() / pattern))
                found = True
                break
        if not found:
            raise AuditError(f"{raw}: no journal segments (DATADIR/journal/*.jsonl) found; "
                             "for a stopped bus, `servicebus journal flush DATADIR` writes them")
    return out


# --- spark ---------------------------------------------------------------------------------


def spark_session(master: str | None):
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("servicebus-audit")
    if master:
        builder = builder.master(master)
    log4j = Path(__file__).with_name("log4j2.properties")
    builder = (builder
               .config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile=file:{log4j}")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.session.timeZone", "UTC"))
    if master and master.startswith("local"):
        # 200 shuffle partitions is for clusters; on one machine it only adds overhead.
        builder = builder.config("spark.sql.shuffle.partitions", str(max(4, 2 * (os.cpu_count() or 2))))
    if SparkSession.getActiveSession() is not None or os.environ.get("SPARK_ENV_LOADED"):
        spark = builder.getOrCreate()  # the JVM exists already (spark-submit, a test session)
    else:
        spark = _start_quietly(builder)
    spark.sparkContext.setLogLevel("WARN")
    return spark


SPARK_LOG: Path | None = None  # where the JVM's own output went, once it started


def _start_quietly(builder):
    """Start the JVM with its stdout/stderr going to a new private file (SPARK_LOG): its
    start-up chatter (JDK notices, log4j warnings) is not the operator's output. Our own
    prints are unaffected. mkstemp, not a name built from the pid: a name another local
    user can guess is one they can plant a symlink at."""
    global SPARK_LOG
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    log_fd, name = tempfile.mkstemp(prefix="servicebus-audit-", suffix=".log")  # 0600, new
    SPARK_LOG = Path(name)
    try:
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        return builder.getOrCreate()  # the JVM child inherits the log file as fd 1 and 2
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, log_fd):
            os.close(fd)


def read_events(spark, paths: list[str]):
    return spark.read.schema(SCHEMA).option("mode", "DROPMALFORMED").json(paths)


def reconcile(events, *, grace_ms: int, since_ms: int | None):
    """One row per (message, receiver) with its class: the ``messages`` table."""
    from pyspark.sql import functions as F

    col, when = F.col, F.when
    is_ = lambda *names: col("event").isin(*names)  # noqa: E731
    count_of = lambda *names: F.sum(when(is_(*names), 1).otherwise(0))  # noqa: E731
    sender_side = col("role") == "sender"
    e = (events
         .where(col("id").isNotNull() & col("event").isNotNull())
         .withColumn("receiver", when(sender_side, col("peer")).otherwise(col("address")))
         .withColumn("sender", when(sender_side, col("address")).otherwise(col("peer"))))
    # A journal's "now": its latest event, on its own clock (no cross-machine comparison).
    as_of = events.groupBy("address").agg(F.max("ts").alias("as_of"))
    pairs = e.groupBy("id", "receiver").agg(
        F.first("topic", ignorenulls=True).alias("topic"),
        F.first("kind", ignorenulls=True).alias("kind"),
        F.first("sender", ignorenulls=True).alias("sender"),
        F.min(when(is_("published"), col("ts"))).alias("published_ts"),
        F.min(when(is_("received"), col("ts"))).alias("received_ts"),
        F.min(when(is_("handled"), col("ts"))).alias("handled_ts"),
        count_of("received").alias("received"),
        count_of("handled").alias("handled_count"),
        count_of("deadlettered", "expired").alias("deadlettered"),
        count_of("dropped").alias("dropped"),
        F.first(when(is_("deadlettered", "expired"), F.coalesce(col("error"), col("event"))),
                ignorenulls=True).alias("deadletter_reason"),
        count_of("retried").alias("retries"),
        F.max(when(is_("handled", "handler_failed"), col("attempt"))).alias("attempts"),
        F.max(when(is_("sent"), col("attempt"))).alias("send_attempts"),
        F.min("ts").alias("first_ts"),
    )
    ref_node = when(col("published_ts").isNotNull(), col("sender")).otherwise(col("receiver"))
    pairs = (pairs
             .withColumn("ref_ts", F.coalesce(col("published_ts"), col("first_ts")))
             .withColumn("ref_node", ref_node)
             .join(F.broadcast(as_of.withColumnRenamed("address", "ref_node")), "ref_node", "left")
             .withColumn("age_ms", col("as_of") - col("ref_ts")))
    if since_ms is not None:
        pairs = pairs.where(col("ref_ts") >= F.lit(since_ms))
    klass = (when(col("handled_count") > 1, "handled_more_than_once")
             .when(col("handled_count") == 1, "handled")
             .when(col("deadlettered") > 0, "deadlettered")
             .when(col("dropped") > 0, "dropped")
             .when(col("received") > 0, "in_flight")
             .when(col("age_ms") < F.lit(grace_ms), "in_flight")
             .otherwise("lost"))
    latency = when(col("handled_ts").isNotNull() & col("published_ts").isNotNull(),
                   F.greatest(col("handled_ts") - col("published_ts"), F.lit(0)))
    return pairs.select(
        "id", "receiver", "sender", "topic", "kind", klass.alias("class"), "published_ts",
        "received_ts", "handled_ts", latency.alias("latency_ms"), "handled_count",
        F.coalesce(col("attempts"), F.lit(0)).alias("attempts"), "send_attempts", "retries",
        "deadletter_reason", "age_ms")


def summarize(messages, key: str):
    """Counts per class, latency percentiles, retries and dead letters per ``key``."""
    from pyspark.sql import functions as F

    col = F.col
    aggs = [F.count(F.lit(1)).alias("messages")]
    aggs += [F.sum(F.when(col("class") == c, 1).otherwise(0)).alias(c) for c in CLASSES]
    aggs += [
        F.percentile_approx("latency_ms", [0.5, 0.95, 0.99]).alias("latency_pct"),
        F.max("latency_ms").alias("latency_max_ms"),
        F.sum("retries").alias("retries"),
        F.max("attempts").alias("max_attempts"),
    ]
    grouped = messages.withColumn(key, F.coalesce(col(key), F.lit("(unknown)"))).groupBy(key).agg(*aggs)
    return (grouped
            .withColumn("latency_p50_ms", col("latency_pct")[0])
            .withColumn("latency_p95_ms", col("latency_pct")[1])
            .withColumn("latency_p99_ms", col("latency_pct")[2])
            .drop("latency_pct")
            .orderBy(key))


def timeline(messages):
    """Messages published and handled per second (sender and receiver clocks)."""
    from pyspark.sql import functions as F

    published = (messages.where(F.col("published_ts").isNotNull())
                 .groupBy((F.col("published_ts") / 1000).cast("long").alias("second"))
                 .agg(F.count(F.lit(1)).alias("published")))
    handled = (messages.where(F.col("handled_ts").isNotNull())
               .groupBy((F.col("handled_ts") / 1000).cast("long").alias("second"))
               .agg(F.count(F.lit(1)).alias("handled")))
    return (published.join(handled, "second", "full_outer")
            .na.fill(0, ["published", "handled"]).orderBy("second"))


def latency_histogram(messages) -> list[tuple[float, int]]:
    """(bucket lower bound in ms, count) on a log scale, 10 buckets per decade."""
    from pyspark.sql import functions as F

    bucket = F.floor(F.log10(F.greatest(F.col("latency_ms"), F.lit(1))) * 10).alias("b")
    rows = (messages.where(F.col("latency_ms").isNotNull()).groupBy(bucket)
            .agg(F.count(F.lit(1)).alias("n")).orderBy("b").collect())
    return [(10 ** (r["b"] / 10), r["n"]) for r in rows]


# --- output --------------------------------------------------------------------------------


def write_text(spark, path: str, text: str) -> None:
    """Write a small file through Hadoop's FileSystem, so DIR can be any URI Spark writes."""
    jvm = spark.sparkContext._jvm
    target = jvm.org.apache.hadoop.fs.Path(path)
    fs = target.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    stream = fs.create(target, True)
    try:
        stream.write(bytearray(text.encode("utf-8")))
    finally:
        stream.close()


def run(spark, paths: list[str], out: str, *, grace_ms: int = 60_000, since_ms: int | None = None,
        write: bool = True) -> dict:
    """The whole audit; returns the summary (also written to ``out`` when ``write``)."""
    from pyspark.sql import functions as F

    started = time.monotonic()
    globs = input_paths(paths)
    events = read_events(spark, globs).persist()
    n_events = events.count()
    if n_events == 0:
        raise AuditError("the journals hold no events")
    messages = reconcile(events, grace_ms=grace_ms, since_ms=since_ms).persist()
    by_topic = summarize(messages, "topic")
    by_receiver = summarize(messages, "receiver")
    times = timeline(messages)

    classes = {c: 0 for c in CLASSES}
    for row in messages.groupBy("class").count().collect():
        classes[row["class"]] = row["count"]
    overall = messages.agg(F.percentile_approx("latency_ms", [0.5, 0.95, 0.99]).alias("p"),
                           F.max("latency_ms").alias("max"), F.sum("retries").alias("retries"),
                           F.min("published_ts").alias("first"), F.max("published_ts").alias("last")).first()
    pct = overall["p"] or [None, None, None]
    problems = {}
    for klass in PROBLEMS:
        rows = (messages.where(F.col("class") == klass).select("id", "receiver")
                .orderBy("id", "receiver").limit(SHOW_IDS).collect())
        problems[klass] = [{"id": r["id"], "receiver": r["receiver"]} for r in rows]
    summary: dict[str, Any] = {
        "inputs": paths,
        "events": n_events,
        "messages": sum(classes.values()),
        "classes": classes,
        "ok": classes["lost"] == 0 and classes["handled_more_than_once"] == 0,
        "latency_ms": {"p50": pct[0], "p95": pct[1], "p99": pct[2], "max": overall["max"]},
        "retries": overall["retries"] or 0,
        "attempts": {str(r["attempts"]): r["count"] for r in
                     messages.groupBy("attempts").count().orderBy("attempts").collect()},
        "deadletter_reasons": {r["deadletter_reason"] or "?": r["count"] for r in
                               messages.where(F.col("class") == "deadlettered")
                               .groupBy("deadletter_reason").count().collect()},
        "problems": problems,
        "published_from_ms": overall["first"],
        "published_to_ms": overall["last"],
        "grace_ms": grace_ms,
        "since_ms": since_ms,
    }
    if write:
        out = out.rstrip("/")
        for name, frame in (("messages", messages), ("by_topic", by_topic),
                            ("by_receiver", by_receiver), ("timeline", times)):
            frame.write.mode("overwrite").parquet(f"{out}/{name}")
        summary["by_topic"] = [r.asDict() for r in by_topic.limit(200).collect()]
        summary["by_receiver"] = [r.asDict() for r in by_receiver.limit(200).collect()]
        timeline_rows = [(r["second"], r["published"], r["handled"]) for r in times.limit(100_000).collect()]
        histogram = latency_histogram(messages)
        summary["seconds"] = round(time.monotonic() - started, 3)
        write_text(spark, f"{out}/summary.json", json.dumps(summary, indent=2, default=str))
        try:
            from . import report
        except ImportError:  # run as a script by spark-submit
            import report  # type: ignore[no-redef]
        write_text(spark, f"{out}/report.html", report.render(summary, histogram, timeline_rows))
    summary["seconds"] = round(time.monotonic() - started, 3)
    messages.unpersist()
    events.unpersist()
    return summary


def print_summary(summary: dict, out: str, file=sys.stdout) -> None:
    p = lambda *a: print(*a, file=file)  # noqa: E731
    lat = summary["latency_ms"]
    fmt = lambda v: "-" if v is None else f"{v:,.0f}"  # noqa: E731
    p(f"delivery audit: {summary['events']:,} events, {summary['messages']:,} (message, receiver) pairs")
    p(f"  {'class':<24}{'count':>12}")
    for klass in CLASSES:
        flag = "  <-- PROBLEM" if klass in PROBLEMS and summary["classes"][klass] else ""
        p(f"  {klass:<24}{summary['classes'][klass]:>12,}{flag}")
    p(f"  latency published->handled ms: p50 {fmt(lat['p50'])}  p95 {fmt(lat['p95'])}  "
      f"p99 {fmt(lat['p99'])}  max {fmt(lat['max'])}")
    p(f"  retries {summary['retries']:,}; dead letters by reason: "
      + (", ".join(f"{k} {v}" for k, v in summary["deadletter_reasons"].items()) or "none"))
    for row in (summary.get("by_topic") or [])[:10]:
        p(f"  topic {row['topic']}: {row['messages']:,} msgs, handled {row['handled']:,}, "
          f"lost {row['lost']:,}, dup {row['handled_more_than_once']:,}, p99 {fmt(row['latency_p99_ms'])} ms")
    for klass in PROBLEMS:
        ids = summary["problems"][klass]
        if ids:
            p(f"  {klass} (first {len(ids)}): " + ", ".join(f"{i['id']}->{i['receiver']}" for i in ids))
    p(f"  verdict: {'OK: nothing lost or duplicated' if summary['ok'] else 'PROBLEMS FOUND'}; "
      f"tables and report.html in {out}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="servicebus audit", description="Reconcile delivery journals.")
    ap.add_argument("paths", nargs="+", metavar="PATH")
    ap.add_argument("--out", required=True, metavar="DIR")
    ap.add_argument("--master", default=None, help="Spark master (default: spark-submit's, else local[*])")
    ap.add_argument("--since", default=None, help="only messages published at or after T")
    ap.add_argument("--grace", default="60s", help="younger unhandled messages are in flight (default 60s)")
    args = ap.parse_args(argv)
    try:
        grace = parse_duration(args.grace)
        since = parse_since(args.since, int(time.time() * 1000))
        input_paths(args.paths)  # fail fast, before starting a JVM
        problem = java_problem() if not os.environ.get("SPARK_ENV_LOADED") else None
        if problem:
            raise AuditError(problem)
        from pyspark.sql import SparkSession  # noqa: F401 - fails clearly if pyspark is missing
    except AuditError as exc:
        print(f"servicebus audit: {exc}", file=sys.stderr)
        return 2
    except ImportError:
        print("servicebus audit: pyspark is not installed: pip install 'servicebus[audit]'", file=sys.stderr)
        return 2
    master = args.master
    if master is None and not os.environ.get("SPARK_ENV_LOADED"):
        master = "local[*]"  # not under spark-submit
    spark = spark_session(master)
    try:
        summary = run(spark, args.paths, args.out, grace_ms=grace, since_ms=since)
    except AuditError as exc:
        print(f"servicebus audit: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a Spark failure: say where Spark's own log is
        where = f" (Spark's log: {SPARK_LOG})" if SPARK_LOG is not None else ""
        print(f"servicebus audit: Spark failed: {str(exc).splitlines()[0]}{where}", file=sys.stderr)
        return 2
    finally:
        spark.stop()
    if SPARK_LOG is not None:
        SPARK_LOG.unlink(missing_ok=True)
    print_summary(summary, args.out)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
