"""The fleet delivery audit (PySpark, DataFrame API only).

    servicebus audit PATH [PATH ...] --out DIR [--master local[*]] [--since T] [--grace 60s]
                     [--checkpoint DIR [--carry 7d]]
    spark-submit servicebus/audit/job.py PATH [PATH ...] --out DIR [--since T] [--grace 60s]

PATH is a data directory, a folder of data directories, or any URI Spark reads (then the
segments are found with the glob ``PATH/{journal,*/journal}/*.jsonl``).

Every journal event belongs to one (message, receiver) pair: a sender-side event's
receiver is its ``peer``, a receiver-side event's receiver is its ``address``; an address a
bus had before (its ``<node>.bus.json`` lists them) counts as the address it has now, so a
subscriber restarted elsewhere with its data directory is one receiver. A line with
``ids`` (an event about a segment's messages, store format 3) is one event per id. Each
pair is classified, in this order:

- ``handled_more_than_once``: more than one ``handled`` event (a duplicate reached a handler)
- ``handled``: exactly one
- ``deadlettered``: dead-lettered or expired, at the sender or the receiver
- ``dropped``: no longer owed and not delivered: the receiver unsubscribed, or an operator
  purged it (``servicebus purge``); the event's error says which
- ``in_flight``: stored at the receiver and not handled yet, or published less than
  ``--grace`` before the sender's latest journal event
- ``owed``: older than the grace and never acknowledged: the sender still holds it for a
  receiver that is down (not a problem)
- ``lost``: older than the grace, acknowledged by the receiver, then never handled or
  dead-lettered there (a loss with evidence)

Reconciliation uses message ids and addresses only, never clocks. The only times compared
across machines are latencies (``handled`` on the receiver's clock minus ``published`` on
the sender's); negative ones (clock skew) are clamped to 0. A message's age, for the
grace, is measured on the sender's own clock.

The job writes Parquet tables ``messages``, ``problems``, ``by_topic``, ``by_receiver`` and
``timeline``, ``summary.json``, ``report.html`` and ``report.png`` to DIR, prints a short
table, and exits 0 when nothing is lost or duplicated, 1 when something is (the first 20 ids
are printed). ``problems`` holds every lost, duplicated, dead-lettered, in-flight and owed
pair with the service names beside its addresses, its last event and the command that acts
on it (problems.py); summary.json and the report list the first 1,000 of each class.

Cost: the input is parsed once, with an explicit schema, and shuffled once (one ``groupBy``
of the events by pair, with conditional aggregates); each journal's "now" comes from the
pairs; every summary (classes, percentiles, per topic and receiver, the histogram) comes
from one small rollup of the pairs; plots are drawn from those small tables only.

``--checkpoint DIR`` makes audits incremental (see ``pipeline.run`` and checkpoint.py): a
daily audit reads only the segments written since the last one (segments are immutable once
written) and carries the pairs still open forward.

This module is the entry point: the command line, the Java check, starting Spark, and the
summary printed at the end. The audit itself is in its sibling modules (the package's
docstring lists them); the names this module held before they moved are re-exported here.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

if not __package__:
    # spark-submit (or ``python job.py``) runs this file as a script, outside any package.
    # Its directory is loaded as a package of its own so that this file and its siblings
    # import each other with the same relative imports as when installed. Not as
    # ``servicebus.audit``: that would import ``servicebus``, the bus, which a Spark driver
    # need not have installed.
    _here = Path(__file__).resolve().parent
    _spec = importlib.util.spec_from_file_location(
        "servicebus_audit", _here / "__init__.py", submodule_search_locations=[str(_here)])
    assert _spec is not None and _spec.loader is not None
    sys.modules[_spec.name] = _package = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_package)
    __package__ = _spec.name

from . import jvmcache, report
from .checkpoint import Checkpoint
from .classify import CLASSES, PROBLEMS, classify, rollup, summarize, timeline
from .errors import AuditError
from .hadoopfs import delete_path, read_text, write_bytes, write_text
from .journals import SCHEMA, input_paths, read_events, segment_files
from .pipeline import SHOW_IDS, run
from .reconcile import combine, journal_clocks, partials

# Every public name job.py had before its parts moved to sibling modules: the CLI,
# tools/bench_audit, the tests and users' scripts import them from here.
__all__ = [
    "AuditError", "CLASSES", "Checkpoint", "PROBLEMS", "SCHEMA", "SHOW_IDS", "SPARK_LOG",
    "classify", "combine", "delete_path", "input_paths", "java_problem", "journal_clocks",
    "main", "parse_duration", "parse_since", "partials", "print_summary", "read_events",
    "read_text", "rollup", "run", "segment_files", "spark_session", "summarize", "timeline",
    "write_bytes", "write_text",
]


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
    java = jvmcache.java_binary()
    hint = ("install it (Debian/Ubuntu: apt-get install openjdk-17-jre-headless) or point "
            "JAVA_HOME at a Java 17+ installation")
    if not java:
        return f"the audit runs on Apache Spark, which needs Java 17 or newer, and none was found: {hint}"
    try:
        out = jvmcache.java_version(java)  # run once: the class archive's name needs it too
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run {java} ({exc}): {hint}"
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    major = int(match.group(1)) if match else 0
    if major == 1 and match and match.group(2):
        major = int(match.group(2))
    if major < 17:
        return f"Spark needs Java 17 or newer; {java} is Java {major or '?'}: {hint}"
    return None


# --- spark ---------------------------------------------------------------------------------


def spark_session(master: str | None, *, class_archive: bool = False):
    """A SparkSession for ``master`` with the audit's settings. ``class_archive``: start the
    driver JVM with the class-data-sharing archive (jvmcache.py), or have it write one; the
    CLI and tools/bench_audit ask for it, the tests' session does not (a test run must not
    write to the user's cache). Call ``finish_class_archive`` after ``spark.stop()``."""
    global CLASS_ARCHIVE
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("servicebus-audit")
    if master:
        builder = builder.master(master)
    log4j = Path(__file__).with_name("log4j2.properties")
    options = [f"-Dlog4j2.configurationFile=file:{log4j}"]
    # The JVM exists already (spark-submit, a test session, an earlier session of this
    # process): getOrCreate joins it, and its options are not ours to set.
    joining = (SparkSession.getActiveSession() is not None or bool(os.environ.get("SPARK_ENV_LOADED"))
               or SparkContext._gateway is not None)
    if not joining and master and master.startswith("local"):
        # The throughput collector: an audit is a batch job with no pauses to keep short.
        # Measured on 5M events: 20-21 s against 23 s cold, 12 s against 13 s warm (G1).
        options.append("-XX:+UseParallelGC")
    CLASS_ARCHIVE = jvmcache.prepare(master) if class_archive and not joining else None
    if CLASS_ARCHIVE is not None:
        options += CLASS_ARCHIVE.options
    builder = (builder
               .config("spark.driver.extraJavaOptions", " ".join(options))
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.session.timeZone", "UTC"))
    if master and master.startswith("local"):
        # 200 shuffle partitions is for clusters; on one machine it only adds overhead.
        builder = builder.config("spark.sql.shuffle.partitions", str(max(4, 2 * (os.cpu_count() or 2))))
    if joining:
        spark = builder.getOrCreate()
    elif CLASS_ARCHIVE is None:
        spark = _start_quietly(builder)
    else:
        try:
            spark = _start_quietly(builder)
        except Exception:  # noqa: BLE001 - e.g. an archive damaged past what jvmcache checks
            # The archive must never cost an audit: drop it and start as without one.
            CLASS_ARCHIVE.discard()
            CLASS_ARCHIVE = None
            if SPARK_LOG is not None:
                SPARK_LOG.unlink(missing_ok=True)
            builder = builder.config("spark.driver.extraJavaOptions", options[0])
            spark = _start_quietly(builder)
    if CLASS_ARCHIVE is not None and not CLASS_ARCHIVE.creating:
        proc = getattr(SparkContext._gateway, "proc", None)
        if proc is not None and not CLASS_ARCHIVE.check_mapped(proc.pid):
            CLASS_ARCHIVE = None  # unusable (removed): the next start writes a new one
    spark.sparkContext.setLogLevel("WARN")
    return spark


# The class archive the running driver uses or writes (jvmcache.Archive), if any.
CLASS_ARCHIVE: jvmcache.Archive | None = None


def finish_class_archive() -> bool:
    """After ``spark.stop()``, when the driver JVM is writing the class archive: end the JVM
    (the archive is written at its exit, which otherwise comes after Python's), wait for it
    and keep the archive if the JVM exited cleanly. True if an archive was put in place.
    The process can start a new SparkSession (a new JVM) afterwards."""
    global CLASS_ARCHIVE
    archive, CLASS_ARCHIVE = CLASS_ARCHIVE, None
    if archive is None or not archive.creating:
        return False
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    if gateway is not None:
        try:
            gateway.shutdown()  # py4j's side; the JVM itself exits when its stdin closes
        except Exception:  # noqa: BLE001 - the JVM may be gone already
            pass
    SparkContext._gateway = None
    SparkContext._jvm = None
    return archive.finish(proc)


# Where the JVM's own output went, once it started. It stays in this module, not with
# the audit: the CLI, tools/bench_audit and the tests read job.SPARK_LOG after the start,
# and a name re-exported from another module would still be the None it was at import.
SPARK_LOG: Path | None = None


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


# --- the command line ----------------------------------------------------------------------


def named(address: str | None, name: str | None) -> str:
    """An address with its service's name beside it, when the journals said it."""
    return f"{address} ({name})" if name else str(address)


# Every control character, newline included: ids, topics, names and error texts come from
# journals and side files anyone may have written; one must not drive the terminal or forge
# a line of the summary ("verdict: OK").
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x20), *range(0x7f, 0xa0))}


def print_summary(summary: dict, out: str, file=sys.stdout) -> None:
    p = lambda line: print(line.translate(_CONTROL), file=file)  # noqa: E731
    lat = summary["latency_ms"]
    fmt = lambda v: "-" if v is None else f"{v:,.0f}"  # noqa: E731
    p(f"delivery audit: {summary['events']:,} events, {summary['messages']:,} (message, receiver) pairs")
    for why in summary.get("skipped_inputs", []):
        p(f"  skipped (an idle bus has no journal yet): {why}")
    if "checkpoint" in summary:
        c = summary["checkpoint"]
        p(f"  incremental: {c['segments_read']:,} new segment(s) of {c['segments_known']:,}; "
          f"{c['carried_in']:,} pair(s) carried in, {c['carried_out']:,} carried forward")
    p(f"  {'class':<24}{'count':>12}")
    for klass in CLASSES:
        flag = "  <-- PROBLEM" if klass in PROBLEMS and summary["classes"][klass] else ""
        p(f"  {klass:<24}{summary['classes'][klass]:>12,}{flag}")
    p(f"  latency published->handled ms: p50 {fmt(lat['p50'])}  p95 {fmt(lat['p95'])}  "
      f"p99 {fmt(lat['p99'])}  max {fmt(lat['max'])}")
    p(f"  retries {summary['retries']:,}; dead letters by reason: "
      + (", ".join(f"{c['cause']} {c['messages']}" for c in summary.get("deadletter_causes", [])) or "none"))
    for row in (summary.get("by_topic") or [])[:10]:
        p(f"  topic {row['topic']}: {row['messages']:,} msgs, handled {row['handled']:,}, "
          f"lost {row['lost']:,}, dup {row['handled_more_than_once']:,}, p99 {fmt(row['latency_p99_ms'])} ms")
    counts = summary.get("problem_counts") or {}
    for klass in PROBLEMS:
        ids = summary["problems"][klass][:SHOW_IDS]
        if ids:
            p(f"  {klass} (first {len(ids)} of {counts.get(klass, len(ids)):,}): "
              + ", ".join(f"{i['id']}->{named(i['receiver'], i.get('receiver_name'))}" for i in ids))
    if any(counts.values()):
        p("  every problem pair (lost, duplicated, dead-lettered, in flight, owed) with the command "
          "that acts on it: report.html, summary.json, and all of them in the table problems")
    p(f"  verdict: {'OK: nothing lost or duplicated' if summary['ok'] else 'PROBLEMS FOUND'}; "
      f"tables and report.html in {out}")


def watch_progress(spark, say) -> threading.Event:
    """Tell ``say`` what Spark is doing, every second, while the audit runs (a daemon thread;
    set the returned event to stop it): the active stages with their tasks done."""
    stop = threading.Event()
    tracker = spark.sparkContext.statusTracker()

    def loop() -> None:
        last = ""
        while not stop.wait(1.0):
            try:
                stages = [tracker.getStageInfo(i) for i in tracker.getActiveStageIds()]
            except Exception:  # noqa: BLE001 - the context is stopping
                return
            line = ", ".join(f"stage {st.stageId} {st.name.split(' at ')[0]}: "
                             f"{st.numCompletedTasks}/{st.numTasks} tasks" for st in stages if st is not None)
            if line and line != last:
                say(f"spark: {line}")
                last = line

    threading.Thread(target=loop, name="audit-progress", daemon=True).start()
    return stop


def check_out(out: str) -> None:
    """``AuditError`` if ``out``, a local folder, cannot be made and written: said before the
    JVM starts, not after the whole job (a URI, hdfs:// or s3a://, is Spark's to check)."""
    if "://" in out and not out.startswith("file://"):
        return
    folder = Path(out.removeprefix("file://"))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".servicebus-audit-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise AuditError(f"--out {out} cannot be written: {exc.strerror or exc}") from None


def audit_cli(paths: list[str], out: str, *, master: str | None = None, since: str | None = None,
              grace: str = "60s", checkpoint: str | None = None, carry: str = "7d",
              progress: bool = True) -> int:
    """``servicebus audit``: returns the exit code (0 nothing lost or duplicated, 1 problems,
    2 the audit could not run); messages on stderr, the table on stdout."""
    say = lambda text: print(f"servicebus audit: {text}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        grace_ms = parse_duration(grace)
        carry_ms = parse_duration(carry)
        since_ms = parse_since(since, int(time.time() * 1000))
        skipped: list[str] = []
        input_paths(paths, skipped)  # fail fast, before starting a JVM
        check_out(out)
        for why in skipped:
            say(f"skipped (an idle bus has no journal yet): {why}")
        problem = java_problem() if not os.environ.get("SPARK_ENV_LOADED") else None
        if problem:
            raise AuditError(problem)
        from pyspark.sql import SparkSession  # noqa: F401 - fails clearly if pyspark is missing
    except AuditError as exc:
        say(str(exc))
        return 2
    except ImportError:
        say("pyspark is not installed: pip install 'servicebus[audit]'")
        return 2
    if master is None and not os.environ.get("SPARK_ENV_LOADED"):
        master = "local[*]"  # not under spark-submit
    say(f"starting Spark ({master or 'spark-submit'}) for {len(paths)} input(s)")
    threading.Thread(target=report.preload, name="audit-preload", daemon=True).start()
    spark = spark_session(master, class_archive=True)
    if CLASS_ARCHIVE is not None and CLASS_ARCHIVE.creating:
        say(f"writing a one-time archive of Spark's classes for faster starts, to "
            f"{CLASS_ARCHIVE.final.parent} (at the end: a few seconds more this time)")
    try:
        return _audit(spark, say, paths, out, grace_ms=grace_ms, since_ms=since_ms,
                      checkpoint=checkpoint, carry_ms=carry_ms, progress=progress)
    finally:
        finish_class_archive()


def _audit(spark, say, paths: list[str], out: str, *, grace_ms: int, since_ms: int | None,
           checkpoint: str | None, carry_ms: int, progress: bool) -> int:
    """audit_cli once Spark is up: run, stop Spark, print the summary; the exit code."""
    watching = watch_progress(spark, say) if progress else None
    try:
        summary = run(spark, paths, out, grace_ms=grace_ms, since_ms=since_ms,
                      checkpoint=checkpoint, carry_ms=carry_ms)
    except AuditError as exc:
        say(str(exc))
        return 2
    except Exception as exc:  # a Spark failure: say where Spark's own log is
        where = f" (Spark's log: {SPARK_LOG})" if SPARK_LOG is not None else ""
        say(f"Spark failed: {str(exc).splitlines()[0]}{where}")
        return 2
    finally:
        if watching is not None:
            watching.set()
        spark.stop()
    if SPARK_LOG is not None:
        SPARK_LOG.unlink(missing_ok=True)
    print_summary(summary, out)
    return 0 if summary["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    """``spark-submit job.py ...`` (the typer command ``servicebus audit`` calls
    ``audit_cli`` with the same options)."""
    ap = argparse.ArgumentParser(prog="servicebus audit", description="Reconcile delivery journals.")
    ap.add_argument("paths", nargs="+", metavar="PATH")
    ap.add_argument("--out", required=True, metavar="DIR")
    ap.add_argument("--master", default=None, help="Spark master (default: spark-submit's, else local[*])")
    ap.add_argument("--since", default=None, help="only messages published at or after T")
    ap.add_argument("--grace", default="60s", help="younger unhandled messages are in flight (default 60s)")
    ap.add_argument("--checkpoint", default=None, metavar="DIR",
                    help="incremental: read only segments earlier runs with DIR did not, carry open pairs in DIR")
    ap.add_argument("--carry", default="7d",
                    help="with --checkpoint: also carry pairs published this recently, to find late "
                         "duplicates (default 7d, the dedupe window)")
    args = ap.parse_args(argv)
    return audit_cli(args.paths, args.out, master=args.master, since=args.since, grace=args.grace,
                     checkpoint=args.checkpoint, carry=args.carry, progress=False)


if __name__ == "__main__":
    sys.exit(main())
