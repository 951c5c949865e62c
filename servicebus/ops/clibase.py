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
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from . import admin as A
from . import views as V
from ..errors import LockedError, StoreError
from ..store.lockfile import LOCK_NAME, DataDirLock, probe
from ..store import OlderFormatError, Store

__all__ = ["app", "CliError", "EXIT_OK", "EXIT_USAGE", "EXIT_NO_DATADIR", "EXIT_LOCKED", "EXIT_CORRUPT",
           "EXIT_DENIED", "DATADIR", "JSON", "FULL", "LIMIT", "ALL"]

# What each exit code means is in cli.py's docstring (and the README).
EXIT_OK, EXIT_USAGE, EXIT_NO_DATADIR, EXIT_LOCKED, EXIT_CORRUPT, EXIT_DENIED = 0, 1, 2, 3, 4, 5

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
