"""The input: where the journal segments are and how they are read.

A PATH on the command line is a data directory, a folder of data directories, a segment,
or any URI Spark reads; ``input_paths`` turns each into a glob of its segments (checked
here for local paths, so that a typo fails before a JVM starts). ``read_events`` parses
them with an explicit schema, the one pass over the input. ``segment_files`` lists the
segments the globs match, for a checkpoint to know which ones it has read.

Segments come in two formats (hooks/segments.py): columnar lines (``.jcol``, what a bus
writes), each a batch of events, spread into one row per event inside the scan; and lines
of one event each (``.jsonl``, older buses), where a line with ``ids`` stands for one event
per id (reconcile.py spreads those). A line that does not parse, or whose fields are not of
the schema's types, is dropped (the journal sets a damaged record aside instead of writing
it); so is an entry of a columnar line whose key is out of range.

Beside the segments, a bus writes ``<node>.bus.json`` (hooks/journal.py): its data directory
and its service name at each address it journaled from. ``read_buses`` reads them into
address -> (name, data directory): the names shown beside addresses, and where the
commands the report prints act. Journals written before the file existed have none: their
addresses show no name, and the data directory is the one the file would have been in.
"""

from __future__ import annotations

import json
import re
from typing import Any
from pathlib import Path

from .errors import AuditError

# The segment files' suffixes, as hooks/segments.py names them: columnar lines (what a bus
# writes) and lines of one event each (older buses). Not imported from there: spark-submit
# runs this package alone, where the bus need not be installed.
COLUMNS, LINES = ".jcol", ".jsonl"
SUFFIXES = (COLUMNS, LINES)

SCHEMA = ("event STRING, ts LONG, node STRING, address STRING, id STRING, topic STRING, "
          "kind STRING, peer STRING, attempt INT, role STRING, error STRING, ids ARRAY<STRING>")


def input_paths(paths: list[str], skipped: list[str] | None = None) -> list[str]:
    """Glob patterns for the journal segments under each PATH (of either format: one glob
    per suffix). A local PATH with none (an idle bus that journaled nothing yet) is named
    in ``skipped`` (when given) and left out: one quiet bus must not stop a fleet's audit;
    with none at all, ``AuditError``."""
    out: list[str] = []
    for raw in paths:
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", raw) and not raw.startswith("file://"):
            out += [raw.rstrip("/") + "/{journal,*/journal}/*" + suffix for suffix in SUFFIXES]
            continue
        local = Path(raw.removeprefix("file://"))
        if not local.exists():
            raise AuditError(f"{raw}: no such file or directory")
        if local.is_file():
            out.append(str(local.resolve()))
            continue
        found = False
        for level in ("journal/", "*/journal/", ""):
            for suffix in SUFFIXES:
                if next(local.glob(f"{level}*{suffix}"), None) is not None:
                    out.append(str(local.resolve() / f"{level}*{suffix}"))
                    found = True
            if found:
                break
        if not found:
            why = (f"{raw}: no journal segments (DATADIR/journal/*.jcol, or *.jsonl of older "
                   "versions) found; for a stopped bus, `servicebus journal flush DATADIR` writes them")
            if skipped is None:
                raise AuditError(why)
            skipped.append(why)
    if not out:
        raise AuditError("; ".join(skipped or ["no input"]))
    return out


# A columnar line (hooks/segments.py), and what spreads it into one row per event.
COLUMNS_SCHEMA = ("node STRING, address STRING, keys ARRAY<ARRAY<STRING>>, k ARRAY<INT>, ts ARRAY<LONG>, "
                  "id ARRAY<STRING>, attempt ARRAY<INT>, error MAP<STRING,INT>, errors ARRAY<STRING>")
_KEY_FIELDS = ("event", "topic", "kind", "peer", "role")


def read_events(spark, paths: list[str], *, spread: bool = False):
    """The events of every segment the globs match, one row per event (a line-format line
    with ``ids`` is still one row: reconcile.one_per_message spreads it), in the columns
    of SCHEMA. ``spread``: one row per message already (lines with ``ids`` spread, rows
    without an event or id left out), without the ``ids`` column: the columnar rows are
    not put through an explode of one each. Columnar lines are spread here, in the JVM,
    inside the scan's stage: each entry looks its event, topic, kind, peer and role up in
    its line's ``keys`` (an index out of range, in a damaged line, gives nulls: the event
    is then left out, as a line that does not parse is)."""
    from functools import reduce

    from pyspark.sql import functions as F

    lines = [p for p in paths if not p.endswith(COLUMNS)]
    columns = [p for p in paths if p.endswith(COLUMNS)]
    if len(paths) > 1:  # a glob that matches nothing fails the read: only those that match
        matching = set(segment_files(spark, paths, which=True))
        lines, columns = [p for p in lines if p in matching], [p for p in columns if p in matching]
    from .reconcile import one_per_message

    frames = []
    if lines or not columns:
        lined = spark.read.schema(SCHEMA).option("mode", "DROPMALFORMED").json(lines or paths)
        frames.append(one_per_message(lined) if spread else lined)
    if columns:
        raw = spark.read.schema(COLUMNS_SCHEMA).option("mode", "DROPMALFORMED").json(columns)
        entry = F.posexplode(F.arrays_zip("k", "ts", "id", "attempt")).alias("pos", "e")
        entries = raw.select("node", "address", "keys", "error", "errors", entry)
        error_at = F.col("error")[F.col("pos").cast("string")]  # [], not element_at: null if absent
        # Null, not an error, out of range; a negative index would count from the end
        # (another event's key) and -1 would fail the whole job: none for them either.
        at = F.try_element_at(F.col("keys"), F.when(F.col("e.k") >= 0, F.col("e.k") + 1))
        key = F.when(F.size(at) == len(_KEY_FIELDS), at)  # a key of another shape: damage
        fields = {name: F.try_element_at(key, F.lit(i + 1)) for i, name in enumerate(_KEY_FIELDS)}
        frames.append(entries.select(
            fields["event"].alias("event"), F.col("e.ts").alias("ts"), "node", "address",
            F.col("e.id").alias("id"), fields["topic"].alias("topic"), fields["kind"].alias("kind"),
            fields["peer"].alias("peer"), F.col("e.attempt").alias("attempt"), fields["role"].alias("role"),
            F.try_element_at("errors", F.when(error_at >= 0, error_at + 1)).alias("error"),
            *([] if spread else [F.lit(None).cast("array<string>").alias("ids")])))
        if spread:
            frames[-1] = frames[-1].where(F.col("event").isNotNull() & F.col("id").isNotNull())
    return reduce(lambda a, b: a.unionByName(b), frames)


def segment_files(spark, globs: list[str], which: bool = False) -> list[str]:
    """Every journal segment the globs match (as Spark names them); with ``which``, the
    globs that match any instead."""
    jvm = spark.sparkContext._jvm
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    found: list[str] = []
    for pattern in globs:
        path = jvm.org.apache.hadoop.fs.Path(pattern)
        statuses = path.getFileSystem(conf).globStatus(path) or []
        files = [str(st.getPath().toString()) for st in statuses if st.isFile()]
        if which and files:
            found.append(pattern)
        elif not which:
            found += files
    return sorted(set(found))


BUS_FILE = "*.bus.json"
BUS_FILE_MAX = 1 << 20  # bytes; a bus writes ~10 KB at most: a larger file is not one, and is not read


def bus_globs(globs: list[str]) -> list[str]:
    """Where the ``<node>.bus.json`` files are beside the segments ``globs`` match."""
    out = []
    for pattern in globs:
        folder, _, last = pattern.rpartition("/")
        out.append(f"{folder}/{BUS_FILE}" if last.endswith(SUFFIXES) else pattern)
    return sorted(set(out))


def parse_bus_file(text: str, found_in: str) -> dict[str, dict[str, str | None]]:
    """address -> {"name", "datadir"} from one bus file, found in the journal folder
    ``found_in``; {} for a file that is not one (a power cut may leave it empty)."""
    try:
        return _bus_addresses(json.loads(text), found_in)
    except ValueError:
        return {}


def _bus_addresses(data: Any, found_in: str) -> dict[str, dict[str, str | None]]:
    """parse_bus_file of a bus file's parsed JSON."""
    try:
        addresses = data["addresses"]
        datadir = data.get("datadir") or found_in.rpartition("/")[0]
        return {str(a): {"name": None if n is None else str(n), "datadir": str(datadir)}
                for a, n in addresses.items()}
    except (KeyError, TypeError, AttributeError):
        return {}


def merge_buses(files: list[dict[str, dict[str, str | None]]]) -> dict[str, dict[str, str | None]]:
    """The bus files' addresses together. An address several buses claim (a port reused by
    another bus, a copy of a data directory) is not one bus's more than the other's: its
    names are all shown ("billing or email") and its data directory is None, so that a
    command says ``<data directory of ADDRESS>`` rather than act on the wrong bus."""
    seen: dict[str, list[dict[str, str | None]]] = {}
    for found in files:
        for address, bus in found.items():
            if bus not in seen.setdefault(address, []):
                seen[address].append(bus)
    out: dict[str, dict[str, str | None]] = {}
    for address, claims in seen.items():
        if len(claims) == 1:
            out[address] = claims[0]
            continue
        names = sorted({b["name"] for b in claims if b["name"]})
        dirs = {b["datadir"] for b in claims}
        out[address] = {"name": " or ".join(names) or None, "datadir": dirs.pop() if len(dirs) == 1 else None}
    return out


def moved_addresses(files: list[tuple[str | None, dict[str, dict[str, str | None]]]]) -> dict[str, tuple[str, str | None]]:
    """address -> (the address its bus has now, that bus's node id), for every earlier
    address of a bus that had several (``files``: read_bus_files, each its node id and its
    addresses oldest first, the last its current one): a subscriber restarted elsewhere with
    its data directory is one receiver (it deduplicates across the move; a message it
    handled at one address and acked again as a duplicate at the next was read "lost" at
    the next). A bus is its node id (else its name and data directory: many containers
    have the same /data); an address two buses claim, or that two files move to different
    addresses, is left as it is: which bus it meant is unknown."""
    owners: dict[str, set[str]] = {}
    for node, found in files:
        for address, bus in found.items():
            owners.setdefault(address, set()).add(node or json.dumps(bus, sort_keys=True))
    out: dict[str, tuple[str, str | None]] = {}
    unsure: set[str] = set()
    for node, found in files:
        addresses = list(found)
        if len(addresses) < 2 or len(owners[addresses[-1]]) > 1:
            continue
        for address in addresses[:-1]:
            if len(owners[address]) > 1 or out.setdefault(address, (addresses[-1], node)) != (addresses[-1], node):
                unsure.add(address)
    return {a: now for a, now in out.items() if a not in unsure}


def read_bus_files(spark, globs: list[str]) -> list[tuple[str | None, dict[str, dict[str, str | None]]]]:
    """Each bus file beside the segments ``globs`` match: its node id (None if it names
    none) and its addresses as parse_bus_file reads them (oldest first)."""
    from .hadoopfs import read_text

    files = []
    for path in segment_files(spark, bus_globs(globs)):
        text = read_text(spark, path, limit=BUS_FILE_MAX)
        if not text:
            continue
        try:
            data = json.loads(text)
        except ValueError:
            continue  # a power cut may leave it torn
        found = _bus_addresses(data, path.rpartition("/")[0].removeprefix("file:"))
        if found:  # (data is a dict)
            node = data.get("node")
            files.append((node if isinstance(node, str) and node else None, found))
    return files


def read_buses(spark, globs: list[str]) -> dict[str, dict[str, str | None]]:
    """address -> {"name", "datadir"} for every bus whose journal the segment ``globs`` read
    (merge_buses: where several claim one address)."""
    return merge_buses([found for _node, found in read_bus_files(spark, globs)])
