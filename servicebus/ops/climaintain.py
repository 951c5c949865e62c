"""The ``servicebus`` commands that write: keygen, unlock, migrate, replay, purge, check
[--repair], compact. Replay and purge of dead letters, and check without --repair, also work
on a live bus: it does them itself, asked over its admin endpoint (the engine writes:
engine/maintain.py; check reads a snapshot). The others refuse while a live process holds
the lock, and hold the lock themselves while they work, so that no bus starts under them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from ..model.retention import ID_RE
from . import maintenance as M
from . import repair as R
from ..hooks.journal import flush_datadir
from ..errors import LockedError, StoreError
from ..model.config import BusConfig
from ..store.lockfile import LOCK_NAME, probe
from .clibase import DATADIR, DATADIRS, EXIT_CORRUPT, EXIT_LOCKED, EXIT_NO_DATADIR, EXIT_NOTHING, EXIT_USAGE
from .clibase import JSON, CliError, _alive, _ask_live, _datadir, _each, _heading, _holding_lock, _offline_store
from .clibase import app
from .clitable import emit as _emit, err, out, progress as _progress
from .clitable import safe as _safe
from ..store import FORMAT_VERSION, MARK_NAME, Store
from ..store.mark import MarkFile
from ..store.migrate import upgrade

__all__ = ["keygen", "unlock", "migrate", "replay", "purge", "check", "compact"]


@app.command()
def keygen(key_dir: Path = typer.Argument(..., metavar="DIR", help="directory for the key pair"),
           address: Optional[str] = typer.Option(None, "--address",
                                                 help="the address this bus advertises, for the printed peers.toml entry")) -> None:
    """Make a CURVE key pair for Bus(..., keys=DIR): DIR/bus.key (public) and
    DIR/bus.key_secret (mode 0600). Prints the entry other buses add to their peers.toml."""
    from .keys import keygen as make

    try:
        public, secret = make(key_dir)
    except FileExistsError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    import zmq.auth

    key = zmq.auth.load_certificate(public)[0].decode()
    err.print(f"wrote {public} and {secret} (keep the secret one on this machine only)")
    err.print("add this bus to the peers.toml of every bus it talks to:")
    print(f'[[peer]]\naddress = "{address or "tcp://HOST:PORT"}"\nkeys = ["{key}"]')


@app.command()
def unlock(datadir: Path = DATADIR,
           force: bool = typer.Option(False, "--force", help="remove even a live owner's lock")) -> None:
    """Remove a stale lock left by a process that died."""
    if not datadir.is_dir():
        raise CliError(f"{datadir}: no such data directory", EXIT_NO_DATADIR)
    owner, alive = probe(datadir)
    if owner is None and not (datadir / LOCK_NAME).exists():
        out.print(f"{datadir} is not locked")
        return
    if alive and not force:
        who = f"pid {owner.pid}" if owner else "a live process"
        raise CliError(f"{datadir} is locked by live {who}; stop it first (or --force)", EXIT_LOCKED)
    if alive:
        err.print("warning: removing the lock of a LIVE process; two buses on one data "
                  "directory will corrupt delivery state")
    (datadir / LOCK_NAME).unlink(missing_ok=True)
    out.print(_safe(f"removed the lock of {owner.describe() if owner else 'an unknown owner'}"))


# What each keyspace a migration rewrites holds, as its report names it.
_REWRITTEN = {"outgoing": "outgoing messages", "incoming": "incoming messages", "deadletters": "dead letters",
              "handled": "handled ids"}


@app.command()
def migrate(datadir: Path = DATADIR, as_json: bool = JSON) -> None:
    """Upgrade a stopped bus's store, written by an older version, to this version's
    format (a bus does it when it opens); print what it rewrote. Safe to stop: the next
    run (or the bus) finishes it."""
    datadir = _datadir(datadir)
    with _offline_store(datadir, writing=True, command="migrate", as_it_is=True) as store:
        with _progress("migrating", None) as step:
            done = M.migrate(store, step)
    if as_json:
        print(json.dumps({"datadir": str(datadir), "from": FORMAT_VERSION if done is None else done.version,
                          "to": FORMAT_VERSION, "rewritten": {} if done is None else done.rewritten,
                          "left": {} if done is None else done.left}))
        return
    if done is None:
        out.print(_safe(f"{datadir}: already format {FORMAT_VERSION}; nothing to rewrite"))
        return
    counts = ", ".join(f"{n} {_REWRITTEN.get(k, k)}" for k, n in done.rewritten.items() if n) or "no records"
    out.print(_safe(f"{datadir}: upgraded from format {done.version} to {done.target}: rewrote {counts}"))
    if done.left:
        left = ", ".join(f"{n} {_REWRITTEN.get(k, k)}" for k, n in done.left.items())
        err.print(_safe(f"left as they were, reading as neither format: {left}; `servicebus check "
                        f"{datadir}` lists them"))


TARGETS = typer.Argument(None, metavar="DATADIR... [IDS...]", show_default=False,
                         help="data directories (the first one, and each after it that is a "
                              "directory), then dead letter ids")
TOPIC = typer.Option(None, "--topic", help="dead letters of this topic or command")
REASON = typer.Option(None, "--reason", help="dead letters with this reason (handler_failed, expired, ...)")


def _targets(args: list[str] | None) -> tuple[list[Path], list[str]]:
    """``DATADIR... [IDS...]``: the first argument is a data directory, and so is each
    after it that names a directory; the rest are dead letter ids."""
    args = list(args or [])
    dirs = [Path(args.pop(0))] if args else [Path(".")]
    # A directory, or anything that is no message id (a data directory that is missing
    # must be said so, not taken for an id that matches nothing).
    while args and (Path(args[0]).is_dir() or not ID_RE.fullmatch(args[0])):
        dirs.append(Path(args.pop(0)))
    return dirs, args


def _selected(ids: list[str], topic: str | None, reason: str | None) -> str:
    named = [f"ids {', '.join(ids)}" if ids else "", f"topic {topic}" if topic else "",
             f"reason {reason}" if reason else ""]
    return " and ".join(n for n in named if n) or "any"


def _labelled(rows: list[dict], label: str | None) -> list[dict]:
    return rows if label is None else [{"datadir": label, **row} for row in rows]


PAYLOAD = typer.Option(None, "--payload", metavar="JSON",
                       help="replay the one dead letter named with this payload instead of its own "
                            "(JSON, or @FILE of JSON)")


@app.command()
def replay(targets: Optional[list[str]] = TARGETS,
           all_: bool = typer.Option(False, "--all", help="every dead letter"),
           topic: Optional[str] = TOPIC, reason: Optional[str] = REASON,
           payload: Optional[str] = PAYLOAD, as_json: bool = JSON) -> None:
    """Move dead letters back to incoming (or outgoing, for undeliverable ones), by id, by
    topic, by reason or all; a live bus does it at once (over its admin endpoint). With
    --payload, one dead letter (DATADIR ID) goes back with that payload instead of its own.
    Exit 6 if nothing matched or an id named is no dead letter."""
    dirs, ids = _targets(targets)
    edit: list = []  # [the new payload] with --payload
    if payload is not None:
        if len(dirs) != 1 or len(ids) != 1 or all_ or topic or reason:
            raise CliError("--payload is for one dead letter: name one data directory and one dead "
                           "letter id (no --all, --topic or --reason)", EXIT_USAGE)
        edit.append(_payload(payload))
    elif not ids and not all_ and not topic and not reason:
        raise CliError("name dead letter ids, or pass --all, --topic or --reason", EXIT_USAGE)
    _each(dirs, lambda path, label: _replay(path, label, ids, topic, reason, as_json, edit))


def _payload(given: str) -> object:
    """``--payload``'s value: JSON, or ``@FILE`` of JSON (``CliError`` saying what is wrong),
    checked as a publish checks a payload (its size is the bus's to check)."""
    what = "--payload"
    if given.startswith("@"):
        what = given[1:]
        try:
            given = Path(what).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"--payload: cannot read {what}: {exc}", EXIT_USAGE) from None
    try:
        value = json.loads(given)
    except RecursionError:
        raise CliError(f"{what} is not JSON this reads: nested too deep", EXIT_USAGE) from None
    except ValueError as exc:
        raise CliError(f"{what} is not JSON: {exc}", EXIT_USAGE) from None
    try:
        M.edited_body(value, 1 << 62)
    except TypeError as exc:
        raise CliError(f"{what}: {exc}", EXIT_USAGE) from None
    return value


def _replay(datadir: Path, label: str | None, ids: list[str], topic: str | None, reason: str | None,
            as_json: bool, edit: list) -> None:
    datadir = _datadir(datadir)
    if _alive(datadir):  # the bus's engine writes, on its own thread (engine/maintain.py)
        args = {"ids": ids or None, "topic": topic, "reason": reason}
        rows = list(_ask_live(datadir, "replay", {**args, "payload": edit[0]} if edit else args,
                              checked=bool(edit)))
    else:
        with _offline_store(datadir, writing=True, command="replay") as store:
            try:
                body = M.edited_body(edit[0], M.max_payload_of(store, BusConfig.max_payload)) if edit else None
                with _progress("replaying", None) as step:
                    rows = M.replay(store, ids or None, topic, step, reason=reason, body=body)
            except ValueError as exc:
                if not edit:
                    raise
                raise CliError(f"{datadir}: {exc}", EXIT_USAGE) from None  # refused: nothing was done
            flush_datadir(store, datadir)  # its journal events, for an audit run next
    _heading(None if as_json else label)
    missing = [r["id"] for r in rows if r.get("detail") == "no such dead letter"]
    if len(missing) < len(rows):
        _emit(_labelled(rows, label), as_json, [("id", lambda r: r["id"]), ("result", lambda r: r["result"]),
                                                ("where / why", lambda r: r.get("to") or r.get("detail", ""))],
              "replay")
    _nothing(datadir, missing, not rows, ids, topic, reason)


def _nothing(datadir: Path, missing: list[str], none: bool, ids: list[str], topic: str | None,
             reason: str | None) -> None:
    """Exit 6 (EXIT_NOTHING), saying why, if an id named is no dead letter of ``datadir``
    or nothing matched."""
    if missing:
        err.print(_safe(f"{datadir}: no such dead letter: {', '.join(missing)}"))
    elif none:
        err.print(_safe(f"{datadir}: no dead letter matched ({_selected(ids, topic, reason)})"))
    if missing or none:
        raise typer.Exit(EXIT_NOTHING)


@app.command()
def purge(targets: Optional[list[str]] = TARGETS,
          outgoing_: bool = typer.Option(False, "--outgoing", help="every outgoing message and delivery state"),
          incoming_: bool = typer.Option(False, "--incoming", help="every unhandled incoming message"),
          deadletters_: bool = typer.Option(False, "--deadletters", help="dead letters: every one, or those "
                                            "ids, --topic and --reason select"),
          subscriber: Optional[str] = typer.Option(None, "--subscriber",
                                                   help="forget this subscriber (what it is owed becomes dead letters)"),
          topic: Optional[str] = TOPIC, reason: Optional[str] = REASON,
          yes: bool = typer.Option(False, "--yes", help="do not ask for confirmation"),
          as_json: bool = JSON) -> None:
    """Delete what is named, after a confirmation; print what was removed. Dead letters
    (by id, --topic, --reason, or --deadletters for all) also from a live bus; the rest
    needs the bus stopped. Exit 6 if no dead letter matched."""
    dirs, ids = _targets(targets)
    select = bool(ids or topic or reason)
    whole = outgoing_ or incoming_ or bool(subscriber)
    if not (whole or deadletters_ or select):
        raise CliError("name what to purge: dead letter ids, --topic, --reason, --deadletters, --outgoing, "
                       "--incoming or --subscriber ADDR", EXIT_USAGE)
    if select and whole:
        raise CliError("ids, --topic and --reason select dead letters; purge --outgoing, --incoming and "
                       "--subscriber on their own", EXIT_USAGE)
    if whole:
        _each(dirs, lambda path, label: _purge_whole(path, outgoing_, incoming_, deadletters_, subscriber,
                                                     yes, as_json))
    else:
        _each(dirs, lambda path, label: _purge_letters(path, label, ids, topic, reason, yes, as_json))


def _confirm(yes: bool, question: str) -> None:
    if yes:
        return
    if not sys.stdin.isatty():
        raise CliError("purge needs confirmation: pass --yes when not on a terminal", EXIT_USAGE)
    if not typer.confirm(question):
        raise CliError("nothing purged", EXIT_USAGE)


def _purge_letters(datadir: Path, label: str | None, ids: list[str], topic: str | None,
                   reason: str | None, yes: bool, as_json: bool) -> None:
    datadir = _datadir(datadir)
    selection = _selected(ids, topic, reason)
    what = "every dead letter" if selection == "any" else f"the dead letters of {selection}"
    if _alive(datadir):  # the bus's engine writes, on its own thread (engine/maintain.py)
        _confirm(yes, f"Delete {what} from {datadir} (live)?")
        done = _ask_live(datadir, "purge", {"ids": ids or None, "topic": topic, "reason": reason})[0]
        removed, missing = done["removed"]["deadletters"], done["missing"]
    else:
        with _offline_store(datadir, writing=True, command="purge") as store:
            _confirm(yes, f"Delete {what} from {datadir}?")
            with _progress("purging", None) as step:
                removed, missing = M.purge_letters(store, ids or None, topic, reason, step)
            flush_datadir(store, datadir)  # its journal events, for an audit run next
    _heading(None if as_json else label)
    if as_json:
        print(json.dumps({**({"datadir": label} if label else {}), "removed": {"deadletters": removed}}))
    elif removed:
        out.print(f"removed {removed} dead letters")
    _nothing(datadir, missing, not removed, ids, topic, reason)


def _purge_whole(datadir: Path, outgoing_: bool, incoming_: bool, deadletters_: bool,
                 subscriber: str | None, yes: bool, as_json: bool) -> None:
    datadir = _datadir(datadir)
    named = [n for n, on in (("outgoing", outgoing_), ("incoming", incoming_),
                             ("deadletters", deadletters_)) if on]
    if subscriber:
        named.append(f"subscriber {subscriber}")
    with _offline_store(datadir, writing=True, command="purge") as store:
        _confirm(yes, f"Delete {', '.join(named)} from {datadir}?")
        with _progress("purging", None) as step:
            removed = M.purge(store, outgoing=outgoing_, incoming=incoming_,
                              deadletters=deadletters_, subscriber=subscriber, progress=step)
        flush_datadir(store, datadir)  # its journal events, for an audit run next
    if as_json:
        print(json.dumps({"removed": removed}))
    else:
        for what, n in removed.items():
            out.print(f"removed {n} {what.replace('_', ' ')}")


@app.command()
def check(datadirs: Optional[list[Path]] = DATADIRS,
          repair: bool = typer.Option(False, "--repair", help="repair damaged files and records; report what is lost"),
          as_json: bool = JSON) -> None:
    """Verify every record decodes and cross-references hold; exit 4 if not. A live bus is
    checked on a snapshot of its store (LevelDB's), read by the bus itself. --repair (the
    bus stopped) runs LevelDB's repair on damaged files, restores or drops damaged records,
    and reports by id the messages that could not be recovered."""
    _each(datadirs, lambda path, label: _check_one(path, label, repair, as_json))


def _check_one(datadir: Path, label: str | None, repair: bool, as_json: bool) -> None:
    datadir = _datadir(datadir)
    live = not repair and _alive(datadir)
    if live:  # read-only: on a snapshot, by the bus (views.view_check)
        rows = list(_ask_live(datadir, "check", {}))
    else:
        with _holding_lock(datadir, "check"):
            rows = [p.__dict__ for p in _check(datadir, repair)]
    _heading(None if as_json else label)
    if as_json:
        for row in rows:
            print(json.dumps({**({"datadir": label} if label else {}), **row}))
    elif rows:
        _emit(_grouped(rows), False, [
            ("keyspace", lambda r: r["keyspace"]), ("key", lambda r: r["key"]),
            ("problem", lambda r: r["problem"]), ("repair", lambda r: r["action"] or "-")], "problems")
    else:
        how = " (a snapshot of the live bus's store)" if live else ""
        out.print(f"{datadir}: every record decodes and every reference holds{how}")
    if rows and not repair:
        raise typer.Exit(EXIT_CORRUPT)


def _grouped(rows: list[dict], most: int = 5) -> list[dict]:
    """For the table: many rows with the same problem become one, naming a few keys
    (``--json`` lists every one)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["keyspace"], row["problem"], row["action"]), []).append(row)
    out_rows = []
    for (keyspace, problem, action), members in groups.items():
        if len(members) <= most:
            out_rows.extend(members)
            continue
        keys = ", ".join(r["key"] for r in members[:3])
        out_rows.append({"keyspace": keyspace, "problem": problem, "action": action,
                         "key": f"{len(members)} of them: {keys}, … (--json lists all)"})
    return out_rows


def _check(datadir: Path, repair: bool) -> list[R.Problem]:
    path = datadir / "store"
    store: Store | None = None
    try:
        if _store_missing(datadir):
            if not repair:
                return [R.Problem("*", "store", f"the store is missing, but {MARK_NAME} says it had "
                                  "made writes durable", "")]
            store = Store.open(path, create=True, check_format=False)
            rows = [R.Problem("*", "store", "the store was missing", "a new empty store was made")]
            with _progress("reading the journal", None) as step:
                return rows + R.lost_writes(store, datadir, step)
        store = Store.open(path, create=False, check_format=False)
        rows = _older_format(store, datadir, repair)
        if rows and not repair:
            return rows  # its records are an older format's: checked once repair upgraded them
        with _progress("checking", None) as step:
            rows += R.check(store, repair, step, datadir)
        if repair and store.mark_behind() is not None:
            with _progress("reading the journal", None) as step:
                rows += R.lost_writes(store, datadir, step)
        return rows
    except LockedError as exc:  # a live process has the store open: never repair under it
        raise CliError(f"{exc}; stop it first", EXIT_LOCKED) from None
    except StoreError as exc:
        if store is not None:
            store.close()  # LevelDB's repair needs the store closed (its own lock)
            store = None
        if not repair:
            raise CliError(f"the store is damaged: {exc}", EXIT_CORRUPT) from None
        err.print(f"the store is damaged ({exc}); running LevelDB repair")
        with _progress("reading the journal", None) as step:
            owed = R.journal_owed(datadir, step)
        rows = R.repair_files(path)
        store = Store.open(path, create=False, check_format=False)
        rows += _older_format(store, datadir, True)
        rows += R.check(store, True, None, datadir)
        if owed.events == 0:
            rows.append(R.Problem("*", "journal", "no delivery journal to compare the repaired store with",
                                  "messages lost in the repair cannot be listed by id"))
        rows += R.lost_in_repair(store, owed)
        store.accept_marks()  # what it lost is reported: the repaired store is the truth
        return rows
    finally:
        if store is not None and not store.closed:
            store.close()


def _older_format(store: Store, datadir: Path, repair: bool) -> list[R.Problem]:
    """A store written by an older version is checked in its own format's terms by no one:
    this version's checks would take every message record of it for damage, and --repair
    would drop them. So plain ``check`` refuses it (``servicebus migrate`` first), and
    ``--repair`` upgrades it first (the migration leaves what is damaged as it is, for the
    check after it to deal with); either tells it from its records when its format record
    is damaged or missing."""
    found = R.older_format(store)
    if found is None:
        return []
    version, how = found
    if not repair:
        if how:  # the format record cannot say: a problem of the store's, which repair solves
            return [R.Problem("meta", "format", f"{how}; its records are format {version}'s", "")]
        raise CliError(f"store {store.path} has format {version}; this version reads {FORMAT_VERSION}: "
                       f"`servicebus migrate {datadir}` upgrades it (a bus does so when it opens)", EXIT_USAGE)
    with _progress("migrating", None) as step:
        done = upgrade(store, version, FORMAT_VERSION, step)
    return [R.Problem("meta", "format", how or f"format {version}, older than this version's",
                      f"upgraded to format {FORMAT_VERSION} ({done.total} records rewritten)")]


def _store_missing(datadir: Path) -> bool:
    """No store at all where the data directory's high-water mark says one had data."""
    path = datadir / "store"
    return not (path / "CURRENT").exists() and not any(path.glob("*.l*")) and \
        bool(MarkFile(datadir / MARK_NAME).read())


@app.command()
def compact(datadir: Path = DATADIR) -> None:
    """Compact the LevelDB store; print its size before and after."""
    datadir = _datadir(datadir)
    with _offline_store(datadir, writing=True, command="compact") as store:
        before = store.size_on_disk()
        store.compact()
        after = store.size_on_disk()
    out.print(f"compacted {datadir}: {before / 1024:.1f} KiB -> {after / 1024:.1f} KiB")
