"""The ``servicebus`` commands that only read: status, keys, subscribers, subscriptions,
outgoing, incoming, deadletters, export. Each works on a stopped bus (reading its store) and
on a live one (asking it over its admin endpoint); both print the same. All but export take
several data directories, each in a section of its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from . import admin as A
from . import export as X
from ..store.lockfile import probe
from .clibase import ALL, DATADIR, DATADIRS, EXIT_LOCKED, FULL, JSON, LIMIT, CliError, _datadir, _denied
from .clibase import _each, _heading, _offline_store, _view, app
from .views import Rows
from .clitable import age as _age, emit as _emit, err, out, progress as _progress
from .clitable import safe as _safe, short as _short, when as _when

__all__ = ["status", "keys", "subscribers", "subscriptions", "outgoing", "incoming", "deadletters", "export"]


@app.command()
def status(datadirs: Optional[list[Path]] = DATADIRS, as_json: bool = JSON) -> None:
    """Lock owner (alive or stale), counts of every store, oldest pending message, size."""
    _each(datadirs, lambda path, _label: _status(path, as_json))


def _status(datadir: Path, as_json: bool) -> None:
    row = _view(datadir, "status", {})[0]
    row["datadir"] = str(datadir)
    if as_json:
        print(json.dumps(row))
        return
    lock = row["lock"]
    if lock is None:
        lock_text = "none (stopped cleanly)"
    else:
        state = "ALIVE" if lock["alive"] else "STALE (owner is gone; `servicebus unlock` removes it)"
        lock_text = f"{state}: pid {lock['pid']} on {lock['host']}, {lock['address']}, started {_when(lock['started'])}"
    table = Table(title=_safe(f"servicebus {datadir} (node {row['node_id']})"), title_justify="left",
                  show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")
    table.add_row("lock", _safe(lock_text))
    for key, label in (("subscriptions", "subscriptions"), ("intents", "subscribe intents"),
                       ("intents_unconfirmed", "  unconfirmed"), ("outgoing", "outgoing messages"),
                       ("pending", "pending deliveries")):
        table.add_row(label, str(row[key]))
    for peer, n in sorted(row["pending_by_peer"].items()):
        table.add_row(_safe(f"  to {peer}"), str(n))  # an address a subscribe named
    table.add_row("oldest pending", _age(row["oldest_pending_age_s"]))
    for key, label in (("incoming", "incoming (not handled)"), ("deadletters", "dead letters"),
                       ("handled", "handled ids (dedupe)"), ("replies_waiting", "replies to queue"),
                       ("commands_waiting", "handlers' commands to queue"), ("kv_keys", "kv keys")):
        table.add_row(label, str(row[key]))
    table.add_row("store size", f"{row['store_bytes'] / 1024:.1f} KiB")
    for topic, kept in sorted(row.get("retained", {}).items()):
        table.add_row(_safe(f"retained {topic}"), (
            f"{kept['messages']} messages, {_size(kept['bytes'])} of {_size(kept['max_bytes'])}, "
            f"oldest {_age(kept['oldest_age_s'])}, kept {kept['retention_s']:g} s"))
    out.print(table)


def _listing(datadirs: Optional[list[Path]], view: str, args: dict, as_json: bool,
             columns: list[tuple[str, Any]], title: str, limit: int | None = None) -> None:
    """A listing of each data directory: its rows (with ``datadir`` in each JSON row when
    there are several), under a heading naming it."""
    def one(path: Path, label: str | None) -> None:
        rows = _view(path, view, args)
        if label is not None and as_json:
            rows = Rows([{"datadir": label, **row} for row in rows], rows.total)
        _heading(None if as_json else label)
        _emit(rows, as_json, columns, title, rows.total if limit is not None or view in _CUT else -1, limit)
    _each(datadirs, one)


_CUT = ("outgoing", "incoming", "deadletters")  # listings a --limit cuts


def _size(n: int) -> str:
    return f"{n / 1048576:.1f} MiB" if n >= 1048576 else f"{n / 1024:.1f} KiB"


@app.command()
def keys(datadirs: Optional[list[Path]] = DATADIRS, as_json: bool = JSON) -> None:
    """Topics that have subscribers."""
    _listing(datadirs, "keys", {}, as_json,
             [("topic", lambda r: r["topic"]), ("subscribers", lambda r: r["subscribers"])], "subscribed topics")


@app.command()
def subscribers(datadirs: Optional[list[Path]] = DATADIRS, as_json: bool = JSON) -> None:
    """Each subscriber (and command receiver) with its topics, pending count, last ack."""
    _listing(datadirs, "subscribers", {}, as_json, [
        ("address", lambda r: r["address"]),
        ("topics", lambda r: ", ".join(r["topics"] + (["(commands)"] if r["commands"] else []))),
        ("pending", lambda r: r["pending"]),
        ("last ack", lambda r: _when(r["last_ack"])),
    ], "subscribers")


@app.command()
def subscriptions(datadirs: Optional[list[Path]] = DATADIRS, as_json: bool = JSON) -> None:
    """What this bus subscribes to: each topic, at which publisher, confirmed or not, and
    its backlog (received, not handled yet)."""
    _listing(datadirs, "subscriptions", {}, as_json, [
        ("topic", lambda r: r["topic"] + ("" if r["op"] == "subscribe" else f" ({r['op']})")),
        ("publisher", lambda r: r["publisher"]),
        ("confirmed", lambda r: "yes" if r["confirmed"] else "NO"),
        ("options", lambda r: ", ".join(o for o in (r["group"] and f"group {r['group']}",
                                                    r["ordered"] and "ordered",
                                                    r["limit"] and f"limit {r['limit']}") if o) or "-"),
        ("backlog", lambda r: r["backlog"]),
        ("by topic", lambda r: ", ".join(f"{t}: {n}" for t, n in r["topics"].items()) or "-"),
    ], "subscriptions (subscribe intents)")


@app.command()
def outgoing(datadirs: Optional[list[Path]] = DATADIRS,
             subscriber: Optional[str] = typer.Option(None, "--subscriber", help="only owed to this address"),
             topic: Optional[str] = typer.Option(None, "--topic", help="only this topic or command"),
             limit: int = LIMIT, all_: bool = ALL, as_json: bool = JSON, full: bool = FULL) -> None:
    """Messages not yet acknowledged by everyone they are owed to."""
    limit_ = None if all_ else limit or None
    _listing(datadirs, "outgoing", {"subscriber": subscriber, "topic": topic, "limit": limit_}, as_json, [
        ("id", lambda r: r["id"]), ("topic", lambda r: r["topic"]), ("age", lambda r: _age(r["age_s"])),
        ("tries", lambda r: r["attempts"]), ("owed by", lambda r: "\n".join(r["owed_by"])),
        ("payload", lambda r: _short(r["payload"], full)),
    ], "pending outgoing messages", limit_)


@app.command()
def incoming(datadirs: Optional[list[Path]] = DATADIRS,
             topic: Optional[str] = typer.Option(None, "--topic", help="only this topic or command"),
             limit: int = LIMIT, all_: bool = ALL, as_json: bool = JSON, full: bool = FULL) -> None:
    """Received messages not handled yet, with attempts and last error."""
    limit_ = None if all_ else limit or None
    _listing(datadirs, "incoming", {"topic": topic, "limit": limit_}, as_json, [
        ("id", lambda r: r["id"]), ("kind", lambda r: r["kind"]), ("topic", lambda r: r["topic"]),
        ("age", lambda r: _age(r["age_s"])), ("tries", lambda r: r["attempts"]),
        ("last error", lambda r: _short(r["last_error"] or "-", full, 24)),
        ("payload", lambda r: _short(r["payload"], full, 24)),
    ], "incoming messages not handled", limit_)


@app.command()
def deadletters(datadirs: Optional[list[Path]] = DATADIRS,
                topic: Optional[str] = typer.Option(None, "--topic", help="only this topic or command"),
                limit: int = LIMIT, all_: bool = ALL, as_json: bool = JSON, full: bool = FULL) -> None:
    """Dead letters and why: handler error, expired, subscriber removed."""
    limit_ = None if all_ else limit or None
    _listing(datadirs, "deadletters", {"topic": topic, "limit": limit_}, as_json, [
        ("id", lambda r: r["id"]), ("topic", lambda r: r["topic"]),
        ("reason", lambda r: r["reason"] + (f" ({r['peer']})" if r.get("peer") else "")),
        ("error", lambda r: _short(r["error"] or "-", full, 28)),
        ("payload", lambda r: _short(r["payload"], full, 20)),
    ], "dead letters", limit_)


@app.command()
def export(datadir: Path = DATADIR, out_file: Path = typer.Argument(..., metavar="OUT.jsonl")) -> None:
    """Every stored message and delivery state as JSON lines (payloads decoded, and the
    exact bytes in base64)."""
    datadir = _datadir(datadir)
    _owner, alive = probe(datadir)
    if alive:  # the bus sends the records; this process, as its user, writes the file
        try:
            with _progress("exporting", None) as step:
                n = X.write_rows(A.live_export(datadir.resolve()), out_file, step)
        except A.AdminDenied as exc:
            raise _denied(Path(exc.path), str(exc)) from None
        except A.AdminUnavailable as exc:
            raise CliError(str(exc), EXIT_LOCKED) from None
        err.print(f"exported {n} records to {out_file} (served by the live bus)")
        return
    with _offline_store(datadir, writing=False) as store:
        with _progress("exporting", None) as step:
            n = X.export(store, out_file, step)
    err.print(f"exported {n} records to {out_file}")
