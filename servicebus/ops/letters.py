"""Reading a data directory and acting on its dead letters, live or stopped, for a client that
is not the CLI (the web console, servicebus/console/).

The same calls as ``servicebus deadletters/replay/purge`` make: a live bus is asked over its
admin endpoint (its engine makes the change and journals it); a stopped one is changed here,
holding its lock for the whole change (a bus that starts meanwhile gets ``LockedError``
naming us), its journal events written as the CLI writes them. Errors are the bus's own
(``LockedError``, ``StoreError``, ``AdminUnavailable``, ``ValueError`` for a wrong request):
the caller says them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import LockedError, StoreError
from ..hooks.journal import flush_datadir
from ..model.config import BusConfig
from ..store import Store
from ..store.lockfile import DataDirLock, probe
from . import admin as A
from . import maintenance as M
from .views import Rows, run_view

__all__ = ["alive", "read_view", "act", "ACTIONS"]

ACTIONS = ("replay", "purge")
ADMIN_TIMEOUT = 10.0  # seconds a live bus has to answer (a console must not hang on one)


def alive(datadir: Path) -> bool:
    """Whether a live process holds ``datadir``'s lock (a bus, or a maintenance command)."""
    return probe(datadir)[1]


def _store(datadir: Path) -> Store:
    if not (datadir / "store").is_dir():
        raise StoreError(f"{datadir}: not a servicebus data directory (no store/)")
    if not os.access(datadir / "store", os.R_OK | os.W_OK | os.X_OK):
        raise PermissionError(f"{datadir / 'store'} cannot be written (LevelDB needs to, even to read it)")
    return Store.open(datadir / "store", create=False, check_format=True, upgrade_old=False)


def read_view(datadir: Path, view: str, args: dict[str, Any]) -> Rows:
    """Rows of read-only view ``view`` (ops/views.py) of ``datadir``: from its live bus, or
    from its store when it is stopped (opened, read, closed: held for as short as can be)."""
    if alive(datadir):
        return A.query_live(datadir.resolve(), view, args, timeout=ADMIN_TIMEOUT)
    store = _store(datadir)
    try:
        return run_view(store, datadir, view, args)
    finally:
        store.close()


def act(datadir: Path, action: str, args: dict[str, Any], *, by: str = "servicebus console") -> list[dict]:
    """``replay`` or ``purge`` the dead letters ``args`` select (``ids``, ``topic``,
    ``reason``; ``payload`` for a replay of one letter with a new payload). Replay returns
    its report rows (``result``: replayed or skipped, and why); purge one row
    ``{"removed": {"deadletters": n}, "missing": [ids]}``."""
    if action not in ACTIONS:
        raise ValueError(f"no such action: {action!r}")
    selection = {k: args.get(k) for k in ("ids", "topic", "reason")}
    if "payload" in args:  # an edit: None too is a payload
        selection["payload"] = args["payload"]
    if alive(datadir):  # the bus's engine writes, on its own thread (engine/maintain.py)
        return list(A.query_live(datadir.resolve(), action, selection, timeout=ADMIN_TIMEOUT))
    try:
        lock = DataDirLock.acquire(datadir, address=by)
    except LockedError:
        if alive(datadir):  # it started between the probe and now: ask it
            return list(A.query_live(datadir.resolve(), action, selection, timeout=ADMIN_TIMEOUT))
        raise
    try:
        store = _store(datadir)
        try:
            ids, topic, reason = selection["ids"], selection["topic"], selection["reason"]
            if action == "purge":
                removed, missing = M.purge_letters(store, ids, topic, reason)
                rows = [{"removed": {"deadletters": removed}, "missing": missing}]
            else:
                body = None
                if "payload" in selection:  # checked and encoded as a publish's, by the bus's limit
                    M.check_edit(ids, topic, reason)
                    body = M.edited_body(selection["payload"], M.max_payload_of(store, BusConfig.max_payload))
                rows = M.replay(store, ids, topic, reason=reason, body=body)
            flush_datadir(store, datadir)  # its journal events, for an audit run next
            return rows
        finally:
            store.close()
    finally:
        lock.release(keep_stale=True)
