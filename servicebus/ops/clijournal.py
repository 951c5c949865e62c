"""The ``servicebus`` commands about the delivery journal: ``audit`` (on Spark),
``journal flush`` and ``journal events``.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import typer

from ..hooks.journal import flush_datadir
from ..hooks.segments import is_segment, read_segment
from .clibase import DATADIR, _datadir, _offline_store, app
from .clitable import out

__all__ = ["audit", "journal_app", "journal_events", "journal_flush"]


@app.command("audit")
def audit(paths: list[str] = typer.Argument(..., metavar="PATH...",
                                           help="data directories, folders of them, segments, or URIs Spark reads"),
          out: str = typer.Option(..., "--out", metavar="DIR", help="where the tables, summary.json and report go"),
          master: str = typer.Option(None, "--master", help="Spark master (default: spark-submit's, else local[*])"),
          since: str = typer.Option(None, "--since", help="only messages published at or after T"),
          grace: str = typer.Option("60s", "--grace", help="younger unhandled messages are in flight"),
          checkpoint: str = typer.Option(None, "--checkpoint", metavar="DIR",
                                         help="incremental: read only segments earlier runs did not"),
          carry: str = typer.Option("7d", "--carry", help="with --checkpoint: also carry pairs published this recently"),
          progress: bool = typer.Option(True, "--progress/--quiet", help="say what Spark is doing meanwhile")) -> None:
    """Reconcile the delivery journals of many buses on Spark: every (message, receiver) pair
    handled, handled more than once, dead-lettered, dropped, in flight, owed or lost. Exit 0
    when nothing is lost or duplicated, 1 when something is, 2 when it cannot run."""
    from ..audit import job  # pyspark is imported only when the audit runs

    raise typer.Exit(job.audit_cli(paths, out, master=master, since=since, grace=grace,
                                   checkpoint=checkpoint, carry=carry, progress=progress))


journal_app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                          help="The delivery journal (input of `servicebus audit`).")
app.add_typer(journal_app, name="journal")


@journal_app.command("flush")
def journal_flush(datadir: Path = DATADIR) -> None:
    """Move a stopped bus's journal records still in its store to segment files."""
    datadir = _datadir(datadir)
    with _offline_store(datadir, writing=True, command="journal flush") as store:
        moved = flush_datadir(store, datadir)
    out.print(f"moved {moved} journal events to {datadir / 'journal'}")


@journal_app.command("events")
def journal_events(datadir: Path = DATADIR,
                   ids: list[str] = typer.Option([], "--id", metavar="ID", help="only this message's (repeatable)"),
                   topic: str = typer.Option(None, "--topic", help="only events of this topic")) -> None:
    """Print the events of a bus's journal segments (DATADIR, or a journal folder), one JSON
    object per event and message, in the order they were written (segments of either format; a line that does not parse,
    such as a torn last one, is skipped). What the audit reconciles, readable by grep and jq."""
    # Into a reader that stops early (`| head`): die of SIGPIPE, quietly, as GNU tools do
    # (click would turn the broken pipe into exit 1). This command reads files only; the
    # handler is put back after it (a test may run it inside its own process).
    previous = signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        _print_events(datadir, set(ids), topic)
    finally:
        signal.signal(signal.SIGPIPE, previous)


def _print_events(datadir: Path, wanted: set[str], topic: str | None) -> None:
    # A data directory, or a journal folder on its own (copied off a host, kept by chaos).
    try:
        bare = not (datadir / "store").is_dir() and any(is_segment(p.name) for p in datadir.iterdir())
    except OSError:
        bare = False  # _datadir says why
    folder = datadir if bare else _datadir(datadir) / "journal"
    paths = sorted(p for p in folder.iterdir() if is_segment(p.name)) if folder.is_dir() else []
    for path in paths:  # named <node>-<first seq>: in the order written
        for e in read_segment(path):
            # (a damaged line's id may be of any JSON type: not one of the ids asked for)
            if (not wanted or (isinstance(e.get("id"), str) and e["id"] in wanted)) \
                    and (topic is None or e.get("topic") == topic):
                print(json.dumps(e, ensure_ascii=False))
