"""The input: where the journal segments are and how they are read.

A PATH on the command line is a data directory, a folder of data directories, a segment,
or any URI Spark reads; ``input_paths`` turns each into a glob of its segments (checked
here for local paths, so that a typo fails before a JVM starts). ``read_events`` parses
them with an explicit schema, the one pass over the input. ``segment_files`` lists the
segments the globs match, for a checkpoint to know which ones it has read.

A line is one event about the message ``id``, or (store format 3 and later) about every
message of a segment: then ``ids`` names them all (``id`` is the first) and the line stands
for one event per id, the same in every other field. reconcile.py spreads such lines out.
A line whose ``ids`` is not an array is malformed, and dropped as any line that does not
parse (the journal sets such a record aside instead of writing it).
"""

from __future__ import annotations

import re
from pathlib import Path

from .errors import AuditError

SCHEMA = ("event STRING, ts LONG, node STRING, address STRING, id STRING, topic STRING, "
          "kind STRING, peer STRING, attempt INT, role STRING, error STRING, ids ARRAY<STRING>")


def input_paths(paths: list[str], skipped: list[str] | None = None) -> list[str]:
    """Glob patterns for the journal segments under each PATH. A local PATH with none (an
    idle bus that journaled nothing yet) is named in ``skipped`` (when given) and left out:
    one quiet bus must not stop a fleet's audit; with none at all, ``AuditError``."""
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
            why = (f"{raw}: no journal segments (DATADIR/journal/*.jsonl) found; "
                   "for a stopped bus, `servicebus journal flush DATADIR` writes them")
            if skipped is None:
                raise AuditError(why)
            skipped.append(why)
    if not out:
        raise AuditError("; ".join(skipped or ["no input"]))
    return out


def read_events(spark, paths: list[str]):
    return spark.read.schema(SCHEMA).option("mode", "DROPMALFORMED").json(paths)


def segment_files(spark, globs: list[str]) -> list[str]:
    """Every journal segment the globs match (as Spark names them)."""
    jvm = spark.sparkContext._jvm
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    found: list[str] = []
    for pattern in globs:
        path = jvm.org.apache.hadoop.fs.Path(pattern)
        statuses = path.getFileSystem(conf).globStatus(path) or []
        found += [str(st.getPath().toString()) for st in statuses if st.isFile()]
    return sorted(set(found))
