"""The ``servicebus`` command line tool (operations on a data directory).

This first version shows a stopped bus's state and removes stale locks; the full
disaster-recovery tool (listings, replay, purge, export, check, compact) builds on it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from .errors import BusError, StoreError
from .lockfile import LOCK_NAME, probe
from .store import Store

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Inspect and repair servicebus data directories.")
console = Console()

EXIT_OK, EXIT_USAGE, EXIT_NO_DATADIR, EXIT_LOCKED, EXIT_CORRUPT = 0, 1, 2, 3, 4


def _fail(message: str, code: int) -> "typer.Exit":
    Console(stderr=True).print(f"servicebus: {message}", highlight=False)
    return typer.Exit(code)


def _datadir(path: Path) -> Path:
    if not path.is_dir():
        raise _fail(f"{path}: no such data directory", EXIT_NO_DATADIR)
    if not (path / "store").is_dir():
        raise _fail(f"{path}: not a servicebus data directory (no store/)", EXIT_NO_DATADIR)
    return path


def offline_counts(store: Store) -> dict:
    pending: dict[str, int] = {}
    for peer, stream, record in store.deliveries():
        n = store.count_stream(stream, after=record.get("floor")) - len(record.get("acked") or [])
        pending[peer] = pending.get(peer, 0) + max(0, n)
    return {
        "subscriptions": store.count("subscriptions"),
        "intents": store.count("intents"),
        "outgoing": store.count("outgoing"),
        "pending": sum(pending.values()),
        "pending_by_subscriber": pending,
        "incoming": store.count("incoming"),
        "deadletters": store.count("deadletters"),
        "handled": store.count("handled"),
    }


@app.command()
def status(datadir: Path = typer.Argument(Path("."), help="the bus's data directory"),
           as_json: bool = typer.Option(False, "--json", help="one JSON object")) -> None:
    """Lock owner (alive or stale) and counts of every store of a stopped bus."""
    datadir = _datadir(datadir)
    owner, alive = probe(datadir)
    if alive:
        raise _fail(f"{datadir} is in use by {owner.describe() if owner else 'a live process'}; "
                    "stop it to read its store", EXIT_LOCKED)
    try:
        store = Store.open(datadir / "store", create=False)
    except StoreError as exc:
        raise _fail(str(exc), EXIT_CORRUPT) from None
    try:
        counts = offline_counts(store)
    finally:
        store.close()
    lock = None if owner is None else {**owner.__dict__, "stale": True}
    if as_json:
        print(json.dumps({"datadir": str(datadir), "lock": lock, **counts}))
        return
    table = Table(title=f"servicebus data directory {datadir}", show_header=False)
    table.add_row("lock", "none" if owner is None else f"STALE: {owner.describe()}")
    for key, value in counts.items():
        if key != "pending_by_subscriber":
            table.add_row(key, str(value))
    for peer, n in counts["pending_by_subscriber"].items():
        table.add_row(f"  pending for {peer}", str(n))
    console.print(table)


@app.command()
def unlock(datadir: Path = typer.Argument(Path("."), help="the bus's data directory"),
           force: bool = typer.Option(False, "--force", help="remove even a live owner's lock")) -> None:
    """Remove a stale lock (left by a process that died)."""
    if not datadir.is_dir():
        raise _fail(f"{datadir}: no such data directory", EXIT_NO_DATADIR)
    owner, alive = probe(datadir)
    if owner is None and not (datadir / LOCK_NAME).exists():
        console.print(f"{datadir} is not locked")
        return
    if alive and not force:
        raise _fail(f"{datadir} is locked by live pid {owner.pid if owner else '?'}; "
                    "stop it first (or --force)", EXIT_LOCKED)
    if alive:
        Console(stderr=True).print("warning: removing the lock of a live process", highlight=False)
    (datadir / LOCK_NAME).unlink(missing_ok=True)
    console.print(f"removed lock of {owner.describe() if owner else 'unknown owner'}")


def main() -> None:
    try:
        app()
    except BusError as exc:  # one clear line, never a traceback
        Console(stderr=True).print(f"servicebus: {exc}", highlight=False)
        sys.exit(EXIT_CORRUPT if isinstance(exc, StoreError) else EXIT_USAGE)
