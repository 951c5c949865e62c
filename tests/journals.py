"""A bus's journal segments as the tests read them: both formats (hooks/segments.py), the
columnar ``.jcol`` a bus writes and the ``.jsonl`` of older buses, one event per message."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from servicebus.hooks.segments import events_of_line, is_segment


def segment_files(datadir: Path) -> list[Path]:
    """The segment files of the journal of ``datadir``, of either format, by name (node, then
    first sequence number)."""
    journal = Path(datadir) / "journal"
    return sorted(p for p in journal.iterdir() if is_segment(p.name)) if journal.is_dir() else []


def segment_events(path: Path) -> list[dict]:
    """Every event of one segment file, one per message, in file order. Strict, unlike
    ``read_segment`` (which skips a line that does not parse, as a reader of a live bus's
    files must): a segment is written whole (fsynced, then renamed), so a line that does not
    parse here is a fault the test must see."""
    events: list[dict] = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            try:
                events += events_of_line(line)
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                raise AssertionError(f"{path}:{n}: not a journal line ({exc!r}): {line[:200]!r}") from exc
    return events


def journal_events(datadir: Path) -> list[dict]:
    """Every event of the journal of ``datadir``, one per message (a line-format line with
    ``ids`` is spread, a columnar line is one event per entry), segment by segment."""
    return [e for path in segment_files(datadir) for e in segment_events(path)]


def event_key(event: dict) -> str:
    """An event as one comparable string (what a line of the line format was to a test that
    compared sets of lines)."""
    return json.dumps(event, sort_keys=True, ensure_ascii=False)


def event_counts(datadir: Path) -> Counter[str]:
    """How many times each event is in the journal of ``datadir``: a count above one is an
    event written twice."""
    return Counter(event_key(e) for e in journal_events(datadir))
