"""The ``servicebus`` commands about services by name (discovery, core/members.py): ``fleet``
(the topology as a bus knows it, live or stopped, as every read-only view), ``kick`` (live
only: the running bus ends the subscriptions in its core) and ``readmit`` (live, or in the
table a stopped bus stored).

``kick`` and ``readmit`` are commands of their own rather than ``fleet kick``: ``fleet``
takes data directories, and a group taking them would read ``kick`` as one.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import typer

from . import admin as A
from . import fleet as F
from .clibase import DATADIRS, EXIT_LOCKED, EXIT_NOTHING, EXIT_USAGE, JSON, CliError, _alive, _datadir, _denied
from .clibase import _each, _heading, _offline_store, _view, app
from .clitable import age as _age, emit as _emit, err, out
from .clitable import safe as _safe, when as _when

__all__ = ["fleet", "kick", "readmit"]

OFF = "discovery is off for this bus: start it with name=... and seeds=... (Bus(name=\"email\", seeds=[...]))"
LIVE_DATADIR = typer.Argument(..., help="the bus's data directory", show_default=False, readable=False,
                              metavar="DATADIR")
TARGET = typer.Argument(..., help="a service name (every instance of it), a node id or an address",
                        show_default=False, metavar="TARGET")


@app.command()
def fleet(datadirs: Optional[list[Path]] = DATADIRS, as_json: bool = JSON) -> None:
    """The services and instances this bus knows (discovery: Bus(name=..., seeds=...)):
    up or down and since when, version, topics published and subscribed, and for each
    instance subscribed here what it is owed, its oldest pending message, its dead letters
    here, and whether it was kicked. A stopped bus: the table as it last stored it."""
    _each(datadirs, lambda path, label: _fleet(path, label, as_json))


def _fleet(datadir: Path, label: str | None, as_json: bool) -> None:
    view = _view(datadir, "fleet", {})[0]
    rows = [{**({"datadir": label} if label else {}), **r} for r in view["instances"]]
    _heading(None if as_json else label)
    if not view["discovery"]:
        (err if as_json else out).print(_safe(f"{datadir}: {OFF}" if label is None else OFF))
        return
    if not rows and not as_json:
        out.print("discovery is on, and knows no instance yet (no seed answered)")
        return
    how = "live" if view["live"] else "as stored when the bus stopped"
    _emit(rows, as_json, [
        ("service", lambda r: r["service"] or "-"),
        ("node", lambda r: r["node"] or "-"),
        ("address", lambda r: r["address"] or "-"),
        ("state", _state),
        ("version", lambda r: r["version"] or "-"),
        ("topics", _topics),
        ("owed here", _owed),
        ("kicked", lambda r: r["kicked"] or "-"),
    ], f"fleet of {datadir} (node {view['node']}, {how})")


def _clock(ms: int | None) -> str:
    """A time of day, with its date unless it is today."""
    if not ms:
        return "?"
    at = datetime.fromtimestamp(ms / 1000)
    return at.strftime("%H:%M:%S") if at.date() == datetime.now().date() else _when(ms / 1000)


def _span(seconds: float) -> str:
    """``3m``, ``2h``: a whole number of the largest unit that fits."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def _state(row: dict) -> str:
    if row["self"]:
        return "this bus" if row["live"] else "this bus (stopped)"
    if row["up"] is None:  # a kick naming no instance known
        return "-"
    if not row["up"]:
        return f"down since {_clock(row['since'])}"
    if not row["live"]:
        return f"up when last seen (since {_clock(row['since'])})"
    return "up" if not row["since"] else f"up {_span(max(0.0, time.time() - row['since'] / 1000))}"


def _topics(row: dict) -> str:
    lines = [f"{what} {', '.join(row[key])}" for what, key in (("pub", "publishes"), ("sub", "subscribes"))
             if row[key]]
    return "\n".join(lines) or "-"


def _owed(row: dict) -> str:
    lines = []
    if row["subscriber"]:
        oldest = row["oldest_pending_age_s"]
        lines.append(f"{row['backlog']} owed" + ("" if oldest is None else f", oldest {_age(oldest)}"))
    if row["deadletters"]:
        lines.append(f"{row['deadletters']} dead letter{'' if row['deadletters'] == 1 else 's'}")
    return "\n".join(lines) or "-"


# --- kick and readmit ------------------------------------------------------------------------


def _operate(datadir: Path, op: str, args: dict) -> dict[str, Any]:
    """Operation ``op`` of the live bus on ``datadir``; a target it refuses (one it does
    not know, or not kicked) is EXIT_NOTHING, as a replay that matched nothing."""
    try:
        return dict(A.query_live(datadir.resolve(), op, args)[0])
    except A.AdminRefused as exc:
        kind, _, text = exc.error.partition(": ")
        if kind == "ValueError":
            raise CliError(f"{datadir}: {text}", EXIT_NOTHING) from None
        raise CliError(str(exc), EXIT_LOCKED) from None
    except A.AdminDenied as exc:
        raise _denied(Path(exc.path), str(exc)) from None
    except A.AdminUnavailable as exc:
        raise CliError(str(exc), EXIT_LOCKED) from None


@app.command()
def kick(datadir: Path = LIVE_DATADIR, target: str = TARGET,
         why: str = typer.Option(..., "--why", help="why (journaled with what it was owed: 'kicked: WHY')"),
         as_json: bool = JSON) -> None:
    """Remove an instance or a whole service from this publisher's subscribers: their
    subscriptions end, what they were owed is dropped (journaled), their subscribes are
    refused until `servicebus readmit`. The bus must be running. Exit 6 if it knows no
    such target."""
    datadir = _datadir(datadir)
    if not why.strip():
        raise CliError("say why (--why TEXT): it is journaled with what the target was owed", EXIT_USAGE)
    if not _alive(datadir):
        raise CliError(f"{datadir}: kick needs the running bus: it ends subscriptions in its core "
                       "(start the bus, then kick)", EXIT_USAGE)
    done = _operate(datadir, "kick", {"target": target, "why": why})
    if as_json:
        print(json.dumps(done))
        return
    ended = done.get("ended") or []
    out.print(_safe(f"kicked {done['kicked']} ({done['why']}): {len(ended)} subscription"
                    f"{'' if len(ended) == 1 else 's'} ended"))
    for sub in ended:
        out.print(_safe(f"  {sub['subscriber']} {sub['topic']}"))


@app.command()
def readmit(datadir: Path = LIVE_DATADIR, target: str = TARGET, as_json: bool = JSON) -> None:
    """Let a kicked instance or service subscribe again: on a running bus at once, on a
    stopped one in the table it loads at start. Exit 6 if it is not kicked."""
    datadir = _datadir(datadir)
    if _alive(datadir):
        found = list(_operate(datadir, "readmit", {"target": target}).get("readmitted") or [])
    else:
        with _offline_store(datadir, writing=True, command="readmit") as store:
            found = F.readmit_stored(store, target)
        if not found:
            raise CliError(f"{datadir}: {target!r} is not kicked", EXIT_NOTHING)
    if as_json:
        print(json.dumps({"readmitted": found}))
    else:
        out.print(_safe(f"readmitted {', '.join(found)}"))
