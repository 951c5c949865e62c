"""Audit throughput: events/s of the delivery audit on a generated journal, and the wall
time of ``servicebus audit`` with its JVM start.

Generates journals with at least ``--events`` events (one sender, two receivers, a few
injected faults) twice: in the columnar format buses write (``.jcol``: a line per batch of
events) and, the same events, in the line format of older buses (``.jsonl``: a line per
event). Then in one Spark session times, each ``--runs`` times (median shown): (1) the
baseline scan of issue 17, which parses every field of the line format and counts the
rows; (2) the same scan of the columnar journal (its entries spread into one row per
event); (3) a bare ``count()`` of the columnar lines (the floor of reading the files);
(4) the floor of any exact audit: every event shuffled by pair and a row per pair written,
nothing else; (5) the full audit of the columnar journal (reconcile, summarize, write every
table, summary.json, report.html and report.png). Last, unless ``--no-wall``, ``servicebus
audit`` runs ``--runs`` times, each in a new process, over the columnar journal, alternated
with the floor (4) in a new process: their wall times, the JVM's start included (the first
run on a machine also writes the class archive of audit/jvmcache.py, not timed). Prints a
table with events/s and the audit's ratio to the scans, against the targets of issue 32
(>= 0.8x the scan, >= 500k events/s, <= 12 s wall).

``--segment N`` journals the messages as a bus of store format 3 does: published N at a
time, every event about several of a segment's messages one line naming them in ``ids``
in the line format. Several values (``--segment 1 100``) bench each in turn.

    tools/bench_audit [--events 5000000] [--segment 1 [100]] [--master local[2]] [--keep DIR] [--no-wall]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from servicebus.audit import job  # noqa: E402
from servicebus.audit.reconcile import one_per_message  # noqa: E402
from servicebus.audit.synthetic import write_journals  # noqa: E402

EVENTS_PER_MESSAGE = 10  # 2 receivers x (published, sent, acked, received, handled)


def parsed_rows(spark, globs: list[str]) -> int:
    """Rows read with every field of the schema converted: a non-null count per column,
    the cheapest aggregate that needs each value, so that Spark cannot skip the parsing
    the way it does for a bare count()."""
    from pyspark.sql import functions as F

    events = job.read_events(spark, globs)
    return events.agg(F.count(F.lit(1)).alias("n"), *[F.count(c) for c in events.columns]).first()["n"]


def exploded_rows(spark, globs: list[str]) -> int:
    """The same scan, lines about several messages spread into one row per message as the
    audit does (reconcile.one_per_message): what reading costs the audit before its
    shuffle. Counted per column as above."""
    from pyspark.sql import functions as F

    events = one_per_message(job.read_events(spark, globs))
    return events.agg(F.count(F.lit(1)).alias("n"), *[F.count(c) for c in events.columns]).first()["n"]


def pair_floor(spark, globs: list[str], out: Path) -> int:
    """The least any exact audit does: every event shuffled by its (message, receiver) pair
    and one row per pair written (the ``messages`` table has one), with a count per pair and
    nothing else: no classification, no other table. Returns the pairs."""
    from pyspark.sql import functions as F

    events = job.read_events(spark, globs, spread=True)
    receiver = F.when(F.col("role") == "sender", F.col("peer")).otherwise(F.col("address"))
    pairs = events.withColumn("receiver", receiver).groupBy("id", "receiver").agg(F.count(F.lit(1)).alias("n"))
    pairs.write.mode("overwrite").parquet(str(out))
    return spark.read.parquet(str(out)).count()


def cold_floor(root: Path, out: Path, master: str) -> float:
    """pair_floor in a new process, as ``servicebus audit`` starts (the JVM, the class
    archive): its wall time. What the audit's wall time cannot go below on this machine."""
    import subprocess

    t = time.monotonic()
    proc = subprocess.run([sys.executable, __file__, "--cold-floor", str(root), str(out), "--master", master],
                          capture_output=True, text=True)
    took = time.monotonic() - t
    if proc.returncode != 0:
        raise RuntimeError(f"the cold floor failed ({proc.returncode}): {proc.stderr[-500:]}")
    return took


def generate(root: Path, events: int, segment: int, columns: bool = True) -> dict[str, list[tuple[str, str]]]:
    """A fleet with at least ``events`` events, ``segment`` messages per publish, in the
    columnar format buses write (or with ``columns=False`` the line format of older ones)."""
    # Faults drop a few events (a lost pair has no receiver side): generate a little more.
    messages = -(-events // EVENTS_PER_MESSAGE) + 100
    faults = {"lost": 10, "duplicate": 10, "deadletter": 10, "in_flight": 10}
    t = time.monotonic()
    # Spread over at least ten minutes of journal time, so that the injected faults (in the
    # older half) are older than the 60 s grace whatever the size.
    rate = max(1, min(2000, messages // 600))
    injected = write_journals(root, messages=messages, receivers=2, rate=rate, faults=faults, segment=segment,
                              columns=columns)
    size = sum(p.stat().st_size for p in root.rglob("*/journal/*-*.j*"))
    print(f"generated {size / 2**20:,.0f} MiB of {'columnar' if columns else 'line'} journals "
          f"({segment} message(s) per publish) in "
          f"{time.monotonic() - t:.1f}s under {root}", file=sys.stderr)
    return injected


def wall_time(root: Path, out: Path, master: str) -> tuple[float, dict]:
    """``servicebus audit`` in a new process (a cold JVM, as an operator runs it)."""
    import json
    import subprocess

    t = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", "from servicebus.ops.cli import main; main()", "audit", str(root),
                           "--out", str(out),
                           "--master", master, "--quiet"], cwd=ROOT, capture_output=True, text=True)
    took = time.monotonic() - t
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"servicebus audit failed ({proc.returncode}): {proc.stdout[-500:]}{proc.stderr[-500:]}")
    return took, json.loads((out / "summary.json").read_text())


def bench(spark, root: Path, lines_root: Path, out: Path, injected: dict, segment: int, runs: int,
          master: str) -> tuple[bool, dict]:
    """Time the scans and the audit of the fleet at ``root`` (columnar) and the baseline
    scan of the same events as lines at ``lines_root``; print the table; True if the audit
    found the injected faults exactly."""
    scans, cscans, counts, floors, audits = [], [], [], [], []
    globs, line_globs = job.input_paths([str(root)]), job.input_paths([str(lines_root)])
    for _ in range(runs):
        t = time.monotonic()
        (parsed_rows if segment == 1 else exploded_rows)(spark, line_globs)
        scans.append(time.monotonic() - t)
        t = time.monotonic()
        spread = exploded_rows(spark, globs)
        cscans.append(time.monotonic() - t)
        t = time.monotonic()
        job.read_events(spark, globs).count()
        counts.append(time.monotonic() - t)
        t = time.monotonic()
        pair_floor(spark, globs, out.with_name(out.name + "-floor"))
        floors.append(time.monotonic() - t)
        t = time.monotonic()
        summary = job.run(spark, [str(root)], str(out), grace_ms=60_000)
        audits.append(time.monotonic() - t)
    events = summary["events"]
    ok = (summary["classes"]["lost"] == len(injected["lost"])
          and summary["classes"]["handled_more_than_once"] == len(injected["duplicate"]) and spread == events)
    scan_s, cscan_s, count_s, floor_s, audit_s = (statistics.median(x) for x in (scans, cscans, counts, floors, audits))
    rate = events / audit_s
    print(f"\ndelivery audit benchmark, {master}, {segment} message(s) per publish: {events:,} events "
          f"({summary['messages']:,} message-receiver pairs), median of {runs} run(s)")
    print(f"{'step':<52}{'seconds':>9}{'events/s':>13}")
    for name, secs in (("baseline scan: the line format, every field parsed", scan_s),
                       ("scan of the columnar journal, a row per event", cscan_s),
                       ("floor: count() of the columnar lines", count_s),
                       ("floor: a shuffle by pair, a row per pair written", floor_s),
                       ("audit of the columnar journal (every table written)", audit_s)):
        print(f"{name:<52}{secs:>9.1f}{events / secs:>13,.0f}")
    print(f"audit / baseline scan (lines): {scan_s / audit_s:.2f} (target >= 0.80: "
          f"{'met' if scan_s / audit_s >= 0.8 else 'NOT met'}); audit / scan of the columnar journal: "
          f"{cscan_s / audit_s:.2f}")
    print(f"best ratio any exact audit can reach here (baseline scan / shuffle floor): {scan_s / floor_s:.2f}")
    print(f"audit events/s: {rate:,.0f} (target >= 500,000: {'met' if rate >= 500_000 else 'NOT met'})")
    print("audit phases (last run): " + ", ".join(f"{k} {v:.1f}s" for k, v in summary["phases"].items()))
    print(f"injected faults found exactly: {ok}")
    return ok, summary["classes"]


def bench_wall(root: Path, out: Path, master: str, classes: dict, runs: int) -> bool:
    """``servicebus audit`` in a new process, ``runs`` times (median shown); True if each
    found what the warm runs did."""
    walls, floors, phases, ok = [], [], {}, True
    for _ in range(runs):  # alternated: the machine's noise falls on both alike
        took, cold = wall_time(root, out, master)
        walls.append(took)
        floors.append(cold_floor(root, out.with_name(out.name + "-floor"), master))
        phases = cold["phases"]
        ok = ok and cold["classes"] == classes
    took = statistics.median(walls)
    print(f"floor in a new process (JVM start, a shuffle by pair, a row per pair written), median of {runs}: "
          f"{statistics.median(floors):.1f} s wall (runs: " + ", ".join(f"{w:.1f}" for w in floors) + ")")
    print(f"servicebus audit over {root.name}, a new process each (JVM start included), median of {runs}: "
          f"{took:.1f} s wall (target <= 12 s: {'met' if took <= 12 else 'NOT met'}; runs: "
          + ", ".join(f"{w:.1f}" for w in walls) + "); phases (last run): "
          + ", ".join(f"{k} {v:.1f}s" for k, v in phases.items()))
    return ok


def made(work: Path, name: str, events: int, segment: int) -> tuple[dict, dict]:
    """The fleet ``name`` and its copy as lines, generated, or kept from an earlier run with
    ``--keep`` (the same size and shape: its injected faults were saved beside it)."""
    import json

    saved = work / f"{name}.json"
    if saved.exists():
        known = json.loads(saved.read_text())
        if known["events"] == events and known["segment"] == segment:
            print(f"reusing the journals kept in {work / name} and {work / name}-lines", file=sys.stderr)
            return known["injected"], known["injected"]
    shutil.rmtree(work / name, ignore_errors=True)
    shutil.rmtree(work / f"{name}-lines", ignore_errors=True)
    injected = generate(work / name, events, segment)
    generate(work / f"{name}-lines", events, segment, columns=False)
    saved.write_text(json.dumps({"events": events, "segment": segment, "injected": injected}))
    return injected, injected


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=5_000_000)
    ap.add_argument("--segment", type=int, nargs="+", default=[1], metavar="N",
                    help="messages per publish (default 1); several values: each in turn")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--keep", help="generate into (and keep) this directory (kept journals are reused)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs of each step (median shown)")
    ap.add_argument("--no-wall", dest="wall", action="store_false",
                    help="skip the run of servicebus audit in a new process")
    ap.add_argument("--cold-floor", nargs=2, metavar=("ROOT", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cold_floor:  # the floor in a new process (cold_floor runs this)
        spark = job.spark_session(args.master, class_archive=True)
        try:
            pair_floor(spark, job.input_paths([args.cold_floor[0]]), Path(args.cold_floor[1]))
        finally:
            spark.stop()
            job.finish_class_archive()
        return 0
    if min(args.segment) < 1:
        ap.error("--segment takes counts of 1 or more")
    problem = job.java_problem()
    if problem:
        print(f"bench_audit: {problem}", file=sys.stderr)
        return 2
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="servicebus-bench-audit-"))
    fleets = {}
    for n in dict.fromkeys(args.segment):
        name = "fleet" if len(args.segment) == 1 else f"fleet-{n}"
        fleets[n] = (work / name, work / f"{name}-lines", *made(work, name, args.events, n))
    # The class archive (jvmcache.py) as the CLI uses it: the start-up is not what is timed.
    spark = job.spark_session(args.master, class_archive=True)
    ok, found = True, {}
    try:
        # The JVM's first queries run interpreted code: warm it up, or the first step timed
        # pays for it (the scan of issue 17's figures did).
        first = next(iter(fleets.values()))
        parsed_rows(spark, job.input_paths([str(first[0])]))
        for n, (root, lines_root, injected, _) in fleets.items():
            audit_dir = work / ("audit" if len(fleets) == 1 else f"audit-{n}")
            good, found[n] = bench(spark, root, lines_root, audit_dir, injected, n, args.runs, args.master)
            ok = good and ok
    finally:
        spark.stop()
        job.finish_class_archive()  # if this run wrote the archive: wait for the JVM to write it
    if args.wall:  # after the archive is in place (the first run on a machine writes it)
        for n, (root, *_rest) in fleets.items():
            ok = bench_wall(root, work / f"audit-wall-{n}", args.master, found[n], args.runs) and ok
    if job.SPARK_LOG is not None:
        job.SPARK_LOG.unlink(missing_ok=True)  # the JVM's own output: kept only if Spark failed
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
