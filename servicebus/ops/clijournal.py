"""The ``servicebus`` commands about the delivery journal: ``audit`` (on Spark) and
``journal flush``.
"""

from __future__ import annotations

from pathlib import Path

import typer

from ..hooks.journal import flush_datadir
from .clibase import DATADIR, _datadir, _offline_store, app
from .clitable import out

__all__ = ["audit", "journal_app", "journal_flush"]


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                "help_option_names": []})
def audit(ctx: typer.Context) -> None:
    """Reconcile the delivery journals of many buses on Spark (see `servicebus audit --help`).

    servicebus audit PATH [PATH ...] --out DIR [--master local[*]] [--since T] [--grace 60s]
                     [--checkpoint DIR [--carry 7d]]
    """
    from ..audit import job  # pyspark is imported only when the audit runs

    raise typer.Exit(job.main(list(ctx.args)))


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
