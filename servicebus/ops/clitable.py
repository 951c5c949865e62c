"""How the command line prints: tables or JSON lines, ages, times, progress bars."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

__all__ = ["out", "err", "progress", "age", "when", "short", "emit", "cut_notice", "safe"]

# soft_wrap: a message is one line however long its path, also when stdout is not a
# terminal (rich would wrap at 80 columns); tables still fit the width. markup=False: what
# is printed comes from stores whose topics, payloads and error texts anyone who reaches a
# bus's port chose; "[/bold]" in one must be shown, not obeyed (or fail to parse).
out = Console(highlight=False, soft_wrap=True, markup=False)
err = Console(stderr=True, highlight=False, soft_wrap=True, markup=False)

# C0 and C1 control characters but newline and tab: an escape sequence from the wire must
# not reach the operator's terminal (set its title, write its clipboard, clear it).
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x20), *range(0x7f, 0xa0)) if c not in (0x09, 0x0a)}


def safe(value: object) -> str:
    """``value`` as text a terminal shows and does not obey."""
    return str(value).translate(_CONTROL)


@contextmanager
def progress(label: str, total: int | None) -> Iterator[Any]:
    """A progress bar on a terminal; nothing when piped."""
    progress = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=err, disable=not err.is_terminal, transient=True)
    with progress:
        task = progress.add_task(label, total=total)
        yield lambda n: progress.update(task, completed=n)


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.1f}s"


def when(ts: float | None) -> str:
    return "-" if not ts else datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def short(value: Any, full: bool, width: int = 30) -> str:
    """``value`` as text, cut at ``width`` characters on an 80-column terminal; a wider one
    gives each cut column its extra columns too (the table folds what does not fit)."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    width += max(0, out.width - 80)
    return text if full or len(text) <= width else text[: width - 1] + "…"


def cut_notice(shown: int, total: int | None, limit: int | None) -> dict | None:
    """What to tell when a ``limit`` cut a listing (None when nothing was cut): how many of
    how many are shown and how to see them all. ``total`` None: an older bus did not say,
    and the listing may be cut if it filled its limit."""
    if total is not None and total > shown:
        text = f"{shown:,} of {total:,} shown; --limit 0 (or --all) shows all {total:,}"
        return {"truncated": True, "shown": shown, "total": total, "limit": limit, "note": text}
    if total is None and limit and shown >= limit:
        text = (f"{shown:,} shown, the limit: there may be more (the live bus runs an older "
                "version, which does not say); --limit 0 (or --all) shows all")
        return {"truncated": None, "shown": shown, "total": None, "limit": limit, "note": text}
    return None


# Every column but the id (24 characters, whole) is at least MIN_WIDTH wide: at 60 columns
# a table of five still shows each, folded over several lines.
MIN_WIDTH = 4
_WHOLE = ("publisher", "address", "owed by", "node")


def _fit(headers: list[str], cells: list[list[str]], width: int) -> list[int | None]:
    """Each column's width in a table ``width`` wide: None (as wide as its longest line)
    when the table fits; else the widest columns are narrowed first, one character at a
    time (short ones keep their width, the long ones share what is left)."""
    want = [max([len(h)] + [len(line) for row in cells for line in (row[i].splitlines() or [""])])
            for i, h in enumerate(headers)]
    room = width - (3 * len(headers) + 1)  # a border and two spaces of padding per column
    if sum(want) <= room:
        return [None] * len(headers)
    widths = list(want)
    # Addresses (copied, as ids are) count half their width: narrowed once twice as wide as
    # the widest other column.
    weight = [0.0 if h == "id" else 0.5 if h in _WHOLE else 1.0 for h in headers]
    while sum(widths) > room:
        widest = max((i for i in range(len(widths)) if weight[i] and widths[i] > MIN_WIDTH),
                     key=lambda i: widths[i] * weight[i], default=None)
        if widest is None:
            break
        widths[widest] -= 1
    return [None if h == "id" else w for h, w in zip(headers, widths)]


def emit(rows: list[dict], as_json: bool, columns: list[tuple[str, Any]], title: str,
         total: int | None = -1, limit: int | None = None) -> None:
    """Print rows as JSON lines or as a table; ``columns`` are (header, row -> str).

    ``total``: rows in all, of which ``limit`` were asked for (-1: the listing is never
    cut). When the rows are fewer, the table says so in its title and under it; with
    ``--json`` stdout stays one row per line, as ever (a script that reads rows reads no
    other kind of line), and a JSON object on stderr says ``{"truncated": true, "shown":
    100, "total": 1031, ...}`` for a script to check."""
    notice = None if total == -1 else cut_notice(len(rows), total, limit)
    if as_json:
        for row in rows:
            print(json.dumps(row, ensure_ascii=False))
        if notice is not None:
            sys.stdout.flush()
            print(json.dumps(notice), file=sys.stderr)
        return
    if not rows:
        out.print(f"{title}: none")
        return
    shown = f"{len(rows):,} of {total:,} shown" if notice and total is not None else f"{len(rows):,}"
    table = Table(title=safe(f"{title} ({shown})"), title_justify="left", expand=False)
    cells = [[safe(fn(row)) for _, fn in columns] for row in rows]
    widths = _fit([h for h, _ in columns], cells, out.width)
    for (header, _), width in zip(columns, widths):
        if header == "id":  # whole, always, on one line: operators copy ids into `replay`
            table.add_column(header, no_wrap=True, min_width=24)
        else:  # folded (never cut) where the table is too wide for the terminal
            table.add_column(header, overflow="fold", width=width)
    for row_cells in cells:
        table.add_row(*row_cells)
    out.print(table)
    if notice is not None:  # under the table too: where the eye is after a long one
        out.print(notice["note"])
