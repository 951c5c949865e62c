"""The ``servicebus`` CLI's plumbing, shared by its command modules (cliinspect.py,
climaintain.py, clijournal.py; cli.py registers them and is the console script): the typer
app, the exit codes, the common arguments, and how a command reaches a data directory
(checked, locked, its store opened, or a live bus asked). The helpers keep their leading
underscore: they are the CLI's own, not an API.
"""

from __future__ import annotations

import os
import pwd
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer

from . import admin as A
from . import views as V
from ..errors import BusError, LockedError, StoreError
from ..store.lockfile import LOCK_NAME, DataDirLock, probe
from ..store import OlderFormatError, Store
from .clitable import err, out, safe

__all__ = ["app", "CliError", "EXIT_OK", "EXIT_USAGE", "EXIT_NO_DATADIR", "EXIT_LOCKED", "EXIT_CORRUPT",
           "EXIT_DENIED", "EXIT_NOTHING", "DATADIR", "DATADIRS", "JSON", "FULL", "LIMIT", "ALL"]

# What each exit code means is in cli.py's docstring (and the README).
EXIT_OK, EXIT_USAGE, EXIT_NO_DATADIR, EXIT_LOCKED, EXIT_CORRUPT, EXIT_DENIED = 0, 1, 2, 3, 4, 5
EXIT_NOTHING = 6  # a replay or purge that matched nothing, or named an id that is no dead letter
# A command run on several data directories exits with the worst of their codes, in this
# order from the least bad (a damaged store is the worst news).
SEVERITY = (EXIT_OK, EXIT_NOTHING, EXIT_USAGE, EXIT_LOCKED, EXIT_NO_DATADIR, EXIT_DENIED, EXIT_CORRUPT)

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Inspect, unlock, replay and repair servicebus data directories.")


def _show_version(value: bool) -> None:
    if value:
        from .. import __version__  # the package root imports no ops module: no circle
        typer.echo(f"servicebus {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_show_version, is_eager=True,
                                       help="print the version and exit")) -> None:
    """Inspect, unlock, replay and repair servicebus data directories."""


class CliError(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


# readable=False: whether this user may read it is ours to check, to say what to do.
DATADIR = typer.Argument(Path("."), help="the bus's data directory", show_default=True, readable=False)
DATADIRS = typer.Argument(None, help="the buses' data directories (default: .)", show_default=False,
                          readable=False, metavar="DATADIR...")
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
def _offline_store(path: Path, *, writing: bool, command: str = "", as_it_is: bool = False) -> Iterator[Store]:
    if writing:
        with _holding_lock(path, command), _open_store(path, as_it_is=as_it_is) as store:
            yield store
        return
    owner, alive = probe(path)
    if alive:
        who = f"pid {owner.pid} ({owner.address})" if owner else "a live process"
        raise CliError(f"{path} is locked by {who}, and did not serve this", EXIT_LOCKED)
    with _open_store(path) as store:
        yield store


@contextmanager
def _open_store(path: Path, *, as_it_is: bool = False) -> Iterator[Store]:
    """The data directory's store. A store written by an older version is refused with what
    upgrades it (``servicebus migrate``): no command but that one rewrites a store's format,
    and none reads one it does not know. ``as_it_is``: opened without checking its format or
    its high-water mark (for ``migrate``, which checks them itself)."""
    if not os.access(path / "store", os.R_OK | os.W_OK | os.X_OK):
        # LevelDB writes its LOCK and LOG files even to read: told as what it is, not as
        # a store in use or a damaged one.
        raise _denied(path / "store", f"{path / 'store'} cannot be written (LevelDB needs to, even to read it)")
    try:
        store = Store.open(path / "store", create=False, check_format=not as_it_is, upgrade_old=False)
    except OlderFormatError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    except StoreError as exc:
        raise CliError(f"{exc} (try: servicebus check --repair {path})", EXIT_CORRUPT) from None
    try:
        yield store
    finally:
        store.close()


def _alive(path: Path) -> bool:
    """Whether a live bus holds ``path`` (a checked data directory)."""
    return probe(path)[1]


def _ask_live(path: Path, name: str, args: dict, *, checked: bool = False) -> V.Rows:
    """View or operation ``name`` of the live bus holding ``path``, over its admin endpoint.
    ``checked``: the bus refusing the request as wrong (its ``ValueError`` or ``TypeError``:
    nothing was done) exits ``EXIT_USAGE`` with its text, not as a bus that cannot answer."""
    try:
        return A.query_live(path.resolve(), name, args)
    except A.AdminRefused as exc:
        kind, _, text = exc.error.partition(": ")
        if checked and kind in ("ValueError", "TypeError"):
            raise CliError(f"{path}: {text}", EXIT_USAGE) from None
        raise CliError(str(exc), EXIT_LOCKED) from None
    except A.AdminDenied as exc:
        raise _denied(Path(exc.path), str(exc)) from None
    except A.AdminUnavailable as exc:
        raise CliError(str(exc), EXIT_LOCKED) from None


def _view(path: Path, name: str, args: dict) -> V.Rows:
    """Rows of a read-only view: from the live bus if one holds the data directory."""
    path = _datadir(path)
    if _alive(path):
        return _ask_live(path, name, args)
    with _offline_store(path, writing=False) as store:
        return V.run_view(store, path, name, args)


def describe(exc: BaseException) -> tuple[str, int]:
    """An error as one line and its exit code (``main``'s, and each data directory's of a
    command run on several)."""
    if isinstance(exc, CliError):
        return safe(exc), exc.code
    if isinstance(exc, StoreError):
        return safe(exc), EXIT_CORRUPT
    if isinstance(exc, PermissionError):  # a file of the data directory this user may not use
        where = Path(exc.filename) if exc.filename else Path(".")
        denied = _denied(where, f"{exc.filename or 'a file'}: {exc.strerror}")
        return safe(denied), denied.code
    if isinstance(exc, (BusError, OSError)):
        return safe(exc), EXIT_USAGE
    raise exc


def _worst(codes: list[int]) -> int:
    return max(codes, key=lambda c: SEVERITY.index(c) if c in SEVERITY else len(SEVERITY), default=EXIT_OK)


def _each(datadirs: list[Path] | None, run: Callable[[Path, str | None], None]) -> None:
    """``run(datadir, label)`` for each data directory named (``.`` if none). One: as it
    always was (its errors end the command). Several: each labelled (``label``: the
    directory, for the command to print as its section's heading or add to its JSON rows),
    an error of one is printed (one line) and the next goes on; the command exits with the
    worst code of them (``SEVERITY``)."""
    dirs = list(datadirs or [Path(".")])
    if len(dirs) == 1:
        run(dirs[0], None)
        return
    codes = []
    for path in dirs:
        try:
            run(path, str(path))
            codes.append(EXIT_OK)
        except typer.Exit as exc:
            codes.append(exc.exit_code)
        except (CliError, StoreError, PermissionError, BusError, OSError) as exc:  # as main() tells them
            message, code = describe(exc)
            err.print(safe(f"servicebus: {path}: {message}"))
            codes.append(code)
    if _worst(codes) != EXIT_OK:
        raise typer.Exit(_worst(codes))


def _serve_until_stopped(server: Any, line: str) -> None:
    """Run ``server`` (started by ``with``), print ``line`` once it listens, and stop it on
    Ctrl-C or SIGTERM (the long-running commands: gateway, console)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with server:
        print(line.format(url=server.url), flush=True)
        stop.wait()


def _heading(label: str | None) -> None:
    """A section's heading, when a command runs on several data directories."""
    if label is not None:
        out.print(safe(f"== {label} =="))
