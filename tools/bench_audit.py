"""Audit throughput: events/s of the delivery audit on a generated journal.

Generates journals with at least ``--events`` events (one sender, two receivers, a few
injected faults), then in one Spark session times (1) a baseline scan that only parses and
counts the same files, and (2) the full audit (reconcile, summarize, write everything).
Prints a table with events/s and the audit's ratio to the scan.

    tools/bench_audit [--events 5000000] [--master local[2]] [--keep DIR]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from servicebus.audit import job  # noqa: E402
from servicebus.audit.synthetic import write_journals  # noqa: E402

EVENTS_PER_MESSAGE = 10  # 2 receivers x (published, sent, acked, received, handled)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=5_000_000)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--keep", help="generate into (and keep) this directory")
    args = ap.parse_args()
    problem = job.java_problem()
    if problem:
        print(f"bench_audit: {problem}", file=sys.stderr)
        return 2
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="servicebus-bench-audit-"))
    # Faults drop a few events (a lost pair has no receiver side): generate a little more.
    messages = -(-args.events // EVENTS_PER_MESSAGE) + 100
    faults = {"lost": 10, "duplicate": 10, "deadletter": 10, "in_flight": 10}
    t = time.monotonic()
    injected = write_journals(work / "fleet", messages=messages, receivers=2, rate=2000, faults=faults)
    gen_s = time.monotonic() - t
    size = sum(p.stat().st_size for p in (work / "fleet").rglob("*.jsonl"))
    print(f"generated {size / 2**20:,.0f} MiB of journals in {gen_s:.1f}s under {work}", file=sys.stderr)

    spark = job.spark_session(args.master)
    try:
        globs = job.input_paths([str(work / "fleet")])
        t = time.monotonic()
        scanned = job.read_events(spark, globs).count()
        scan_s = time.monotonic() - t
        t = time.monotonic()
        summary = job.run(spark, [str(work / "fleet")], str(work / "audit"), grace_ms=60_000)
        audit_s = time.monotonic() - t
    finally:
        spark.stop()
    if job.SPARK_LOG is not None:
        job.SPARK_LOG.unlink(missing_ok=True)  # the JVM's own output: kept only if Spark failed
    ok = (summary["classes"]["lost"] == len(injected["lost"])
          and summary["classes"]["handled_more_than_once"] == len(injected["duplicate"]))
    print(f"\ndelivery audit benchmark, {args.master}, {scanned:,} events "
          f"({summary['messages']:,} message-receiver pairs)")
    print(f"{'step':<34}{'seconds':>10}{'events/s':>14}")
    print(f"{'baseline: parse + count (scan)':<34}{scan_s:>10.1f}{scanned / scan_s:>14,.0f}")
    print(f"{'audit: reconcile + report + write':<34}{audit_s:>10.1f}{scanned / audit_s:>14,.0f}")
    print(f"audit / scan throughput ratio: {scan_s / audit_s:.2f}; injected faults found exactly: {ok}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
