"""``servicebus``: inspect, unlock, replay and repair a bus's data directory.

Read-only commands work on a stopped bus (reading its store) and on a live one (asking it
over its admin endpoint); both print the same. Commands that write refuse while a live
process holds the lock. Exit codes: 0 ok, 1 usage, 2 no such / not a data directory,
3 locked by a live process, 4 corruption found, 5 permission denied (run it as the bus's
user). Errors are one line, never a traceback.
"""

from __future__ import annotations

import json
import os
import pwd
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from typer.exceptions import TyperException
from rich.table import Table

from . import admin as A
from . import export as X
from . import views as V
from . import maintenance as M
from . import repair as R
from ..hooks.journal import flush_datadir
from ..errors import BusError, LockedError, StoreError
from ..store.lockfile import LOCK_NAME, DataDirLock, probe
from .clitable import age as _age, emit as _emit, err, out, progress as _progress
from .clitable import safe as _safe, short as _short, when as _when
from ..store import MARK_NAME, Store
from ..store.mark import MarkFile

EXIT_OK, EXIT_USAGE, EXIT_NO_DATADIR, EXIT_LOCKED, EXIT_CORRUPT, EXIT_DENIED = 0, 1, 2, 3, 4, 5

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Inspect, unlock, replay and repair servicebus data directories.")



class CliError(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


# readable=False: whether this user may read it is ours to check, to say what to do.
DATADIR = typer.Argument(Path("."), help="the bus's data directory", show_default=True, readable=False)
JSON = typer.Option(False, "--json", help="one JSON object per line")
FULL = typer.Option(False, "--full", help="show payloads whole")
LIMIT = typer.Option(100, "--limit", min=0, help="at most this many rows (0: all); a cut listing says how many there are")
ALL = typer.Option(False, "--all", help="every row (as --limit 0)")


# --- plumbing ------------------------------------------------------------------------------


def _user(uid: int) -> str:
    """A user's name, or ``#UID`` (as ``sudo -u`` takes a uid) for one without a name."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"#{uid}"


def _owner_of(path: Path) -> str:
    """The user owning ``path``, or the nearest parent this user can see."""
    for candidate in (path, *path.absolute().parents):
        try:
            return _user(candidate.stat().st_uid)
        except OSError:
            continue
    return "the bus's user"


def _denied(path: Path, what: str) -> CliError:
    """Permission denied, and what to do: run the same command as the bus's user (the
    owner of ``path``, what was denied)."""
    owner = _owner_of(path)
    again = shlex.join(["servicebus", *sys.argv[1:]])
    who = "root" if owner == "root" else f"the bus's user ({owner}) and root"
    return CliError(f"permission denied: {what}; only {who} may, and this runs as "
                    f"{_user(os.getuid())}. Run it as {owner}: sudo -u {owner} {again}", EXIT_DENIED)


def _datadir(path: Path) -> Path:
    try:
        path.stat()
    except PermissionError:
        raise _denied(path, f"{path} cannot be reached") from None
    except OSError:
        pass
    if not path.is_dir():
        raise CliError(f"{path}: no such data directory", EXIT_NO_DATADIR)
    if not os.access(path, os.R_OK | os.X_OK):
        raise _denied(path, f"{path} cannot be read")
    if not (path / "store").is_dir():
        raise CliError(f"{path}: not a servicebus data directory (no store/)", EXIT_NO_DATADIR)
    return path



@contextmanager
def _holding_lock(path: Path, command: str) -> Iterator[None]:
    """Hold DATADIR/LOCK for a whole maintenance command, so that no bus starts on the data
    directory while it is being changed (a bus that tries gets LockedError naming this
    command). A stale lock left by a crashed bus is put back afterwards, as it was."""
    lock_file = path / LOCK_NAME
    if not os.access(path, os.W_OK | os.X_OK) or (lock_file.exists() and not os.access(lock_file, os.W_OK)):
        raise _denied(path, f"{path} cannot be written")
    try:
        lock = DataDirLock.acquire(path, address=f"servicebus {command}")
    except LockedError as exc:
        owner = exc.owner
        who = f"pid {owner.get('pid')} ({owner.get('address')})" if owner else "a live process"
        raise CliError(f"{path} is locked by {who}; it must be stopped first", EXIT_LOCKED) from None
    try:
        yield
    finally:
        lock.release(keep_stale=True)


@contextmanager
def _offline_store(path: Path, *, writing: bool, command: str = "") -> Iterator[Store]:
    if writing:
        with _holding_lock(path, command), _open_store(path) as store:
            yield store
        return
    owner, alive = probe(path)
    if alive:
        who = f"pid {owner.pid} ({owner.address})" if owner else "a live process"
        raise CliError(f"{path} is locked by {who}, and did not serve this", EXIT_LOCKED)
    with _open_store(path) as store:
        yield store


@contextmanager
def _open_store(path: Path) -> Iterator[Store]:
    if not os.access(path / "store", os.R_OK | os.W_OK | os.X_OK):
        # LevelDB writes its LOCK and LOG files even to read: told as what it is, not as
        # a store in use or a damaged one.
        raise _denied(path / "store", f"{path / 'store'} cannot be written (LevelDB needs to, even to read it)")
    try:
        store = Store.open(path / "store", create=False)
    except StoreError as exc:
        raise CliError(f"{exc} (try: servicebus check --repair {path})", EXIT_CORRUPT) from None
    try:
        yield store
    finally:
        store.close()


def _view(path: Path, name: str, args: dict) -> V.Rows:
    """Rows of a read-only view: from the live bus if one holds the data directory."""
    path = _datadir(path)
    _owner, alive = probe(path)
    if alive:
        try:
            return A.query_live(path.resolve(), name, args)
        except A.AdminDenied as exc:
            raise _denied(Path(exc.path), str(exc)) from None
        except A.AdminUnavailable as exc:
            raise CliError(str(exc), EXIT_LOCKED) from None
    with _offline_store(path, writing=False) as store:
        return V.run_view(store, path, name, args)


# --- read-only commands ----------------------------------------------------------------------


@app.command()
def status(datadir: Path = DATADIR, as_json: bool = JSON) -> None:
    """Lock owner (alive or stale), counts of every store, oldest pending message, size."""
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
    out.print(table)


@app.command()
def keys(datadir: Path = DATADIR, as_json: bool = JSON) -> None:
    """Topics that have subscribers."""
    rows = _view(datadir, "keys", {})
    _emit(rows, as_json, [("topic", lambda r: r["topic"]), ("subscribers", lambda r: r["subscribers"])],
          "subscribed topics")


@app.command()
def subscribers(datadir: Path = DATADIR, as_json: bool = JSON) -> None:
    """Each subscriber (and command receiver) with its topics, pending count, last ack."""
    rows = _view(datadir, "subscribers", {})
    _emit(rows, as_json, [
        ("address", lambda r: r["address"]),
        ("topics", lambda r: ", ".join(r["topics"] + (["(commands)"] if r["commands"] else []))),
        ("pending", lambda r: r["pending"]),
        ("last ack", lambda r: _when(r["last_ack"])),
    ], "subscribers")


@app.command()
def outgoing(datadir: Path = DATADIR,
             subscriber: Optional[str] = typer.Option(None, "--subscriber", help="only owed to this address"),
             topic: Optional[str] = typer.Option(None, "--topic", help="only this topic or command"),
             limit: int = LIMIT, all_: bool = ALL, as_json: bool = JSON, full: bool = FULL) -> None:
    """Messages not yet acknowledged by everyone they are owed to."""
    limit_ = None if all_ else limit or None
    rows = _view(datadir, "outgoing", {"subscriber": subscriber, "topic": topic, "limit": limit_})
    _emit(rows, as_json, [
        ("id", lambda r: r["id"]), ("topic", lambda r: r["topic"]), ("age", lambda r: _age(r["age_s"])),
        ("tries", lambda r: r["attempts"]), ("owed by", lambda r: "\n".join(r["owed_by"])),
        ("payload", lambda r: _short(r["payload"], full)),
    ], "pending outgoing messages", rows.total, limit_)


@app.command()
def incoming(datadir: Path = DATADIR,
             topic: Optional[str] = typer.Option(None, "--topic", help="only this topic or command"),
             limit: int = LIMIT, all_: bool = ALL, as_json: bool = JSON, full: bool = FULL) -> None:
    """Received messages not handled yet, with attempts and last error."""
    limit_ = None if all_ else limit or None
    rows = _view(datadir, "incoming", {"topic": topic, "limit": limit_})
    _emit(rows, as_json, [
        ("id", lambda r: r["id"]), ("kind", lambda r: r["kind"]), ("topic", lambda r: r["topic"]),
        ("age", lambda r: _age(r["age_s"])), ("tries", lambda r: r["attempts"]),
        ("last error", lambda r: _short(r["last_error"] or "-", full, 24)),
        ("payload", lambda r: _short(r["payload"], full, 24)),
    ], "incoming messages not handled", rows.total, limit_)


@app.command()
def deadletters(datadir: Path = DATADIR,
                topic: Optional[str] = typer.Option(None, "--topic", help="only this topic or command"),
                limit: int = LIMIT, all_: bool = ALL, as_json: bool = JSON, full: bool = FULL) -> None:
    """Dead letters and why: handler error, expired, subscriber removed."""
    limit_ = None if all_ else limit or None
    rows = _view(datadir, "deadletters", {"topic": topic, "limit": limit_})
    _emit(rows, as_json, [
        ("id", lambda r: r["id"]), ("topic", lambda r: r["topic"]),
        ("reason", lambda r: r["reason"] + (f" ({r['peer']})" if r.get("peer") else "")),
        ("error", lambda r: _short(r["error"] or "-", full, 28)),
        ("payload", lambda r: _short(r["payload"], full, 20)),
    ], "dead letters", rows.total, limit_)


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


# --- commands that write ----------------------------------------------------------------------


@app.command()
def keygen(key_dir: Path = typer.Argument(..., metavar="DIR", help="directory for the key pair"),
           address: Optional[str] = typer.Option(None, "--address",
                                                 help="the address this bus advertises, for the printed peers.toml entry")) -> None:
    """Make a CURVE key pair for Bus(..., keys=DIR): DIR/bus.key (public) and
    DIR/bus.key_secret (mode 0600). Prints the entry other buses add to their peers.toml."""
    from ..wire.keys import keygen as make

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


@app.command()
def replay(datadir: Path = DATADIR,
           ids: Optional[list[str]] = typer.Argument(None, help="dead letter ids"),
           all_: bool = typer.Option(False, "--all", help="every dead letter"),
           topic: Optional[str] = typer.Option(None, "--topic", help="dead letters of this topic"),
           as_json: bool = JSON) -> None:
    """Move dead letters back to incoming (or outgoing, for undeliverable ones)."""
    if not ids and not all_ and not topic:
        raise CliError("name dead letter ids, or pass --all or --topic", EXIT_USAGE)
    datadir = _datadir(datadir)
    with _offline_store(datadir, writing=True, command="replay") as store:
        with _progress("replaying", None) as step:
            rows = M.replay(store, ids or None, topic, step)
        flush_datadir(store, datadir)  # its journal events, for an audit run next
    _emit(rows, as_json, [("id", lambda r: r["id"]), ("result", lambda r: r["result"]),
                          ("where / why", lambda r: r.get("to") or r.get("detail", ""))], "replay")


@app.command()
def purge(datadir: Path = DATADIR,
          outgoing_: bool = typer.Option(False, "--outgoing", help="every outgoing message and delivery state"),
          incoming_: bool = typer.Option(False, "--incoming", help="every unhandled incoming message"),
          deadletters_: bool = typer.Option(False, "--deadletters", help="every dead letter"),
          subscriber: Optional[str] = typer.Option(None, "--subscriber",
                                                   help="forget this subscriber (what it is owed becomes dead letters)"),
          yes: bool = typer.Option(False, "--yes", help="do not ask for confirmation"),
          as_json: bool = JSON) -> None:
    """Delete what is named, after a confirmation; print what was removed."""
    if not (outgoing_ or incoming_ or deadletters_ or subscriber):
        raise CliError("name what to purge: --outgoing, --incoming, --deadletters or --subscriber ADDR",
                       EXIT_USAGE)
    datadir = _datadir(datadir)
    named = [n for n, on in (("outgoing", outgoing_), ("incoming", incoming_),
                             ("deadletters", deadletters_)) if on]
    if subscriber:
        named.append(f"subscriber {subscriber}")
    with _offline_store(datadir, writing=True, command="purge") as store:
        if not yes:
            if not sys.stdin.isatty():
                raise CliError("purge needs confirmation: pass --yes when not on a terminal", EXIT_USAGE)
            if not typer.confirm(f"Delete {', '.join(named)} from {datadir}?"):
                raise CliError("nothing purged", EXIT_USAGE)
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
def check(datadir: Path = DATADIR,
          repair: bool = typer.Option(False, "--repair", help="repair damaged files and records; report what is lost"),
          as_json: bool = JSON) -> None:
    """Verify every record decodes and cross-references hold; exit 4 if not. --repair runs
    LevelDB's repair on damaged files, restores or drops damaged records, and reports by id
    the messages that could not be recovered."""
    datadir = _datadir(datadir)
    with _holding_lock(datadir, "check"):
        rows = [p.__dict__ for p in _check(datadir, repair)]
    if as_json:
        for row in rows:
            print(json.dumps(row))
    elif rows:
        _emit(_grouped(rows), False, [
            ("keyspace", lambda r: r["keyspace"]), ("key", lambda r: r["key"]),
            ("problem", lambda r: r["problem"]), ("repair", lambda r: r["action"] or "-")], "problems")
    else:
        out.print(f"{datadir}: every record decodes and every reference holds")
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
        with _progress("checking", None) as step:
            rows = R.check(store, repair, step, datadir)
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


def main() -> None:
    """Console entry point: named exit codes, one-line errors."""
    try:
        code = app(standalone_mode=False)
    except CliError as exc:
        err.print(f"servicebus: {_safe(exc)}")
        sys.exit(exc.code)
    except TyperException as exc:  # usage errors: unknown option, missing argument, ...
        show = getattr(exc, "show", None)
        show() if show else err.print(f"servicebus: {exc.format_message()}")
        sys.exit(EXIT_USAGE)
    except typer.Abort:
        err.print("servicebus: aborted")
        sys.exit(EXIT_USAGE)
    except StoreError as exc:
        err.print(f"servicebus: {_safe(exc)}")
        sys.exit(EXIT_CORRUPT)
    except PermissionError as exc:  # a file of the data directory this user may not use
        where = Path(exc.filename) if exc.filename else Path(".")
        denied = _denied(where, f"{exc.filename or 'a file'}: {exc.strerror}")
        err.print(f"servicebus: {_safe(denied)}")
        sys.exit(denied.code)
    except BusError as exc:
        err.print(f"servicebus: {_safe(exc)}")
        sys.exit(EXIT_USAGE)
    except OSError as exc:
        err.print(f"servicebus: {_safe(exc)}")
        sys.exit(EXIT_USAGE)
    sys.exit(code if isinstance(code, int) else EXIT_OK)
