"""The admin endpoint of a live bus: its protocol, and the CLI's client.

A live bus answers the CLI's read-only views (views.py) over its admin endpoint
(``admin.endpoint`` in the data directory names it: a Unix socket in ``DATADIR/run`` or, for
a long path, in a private folder under $XDG_RUNTIME_DIR or /tmp; ``admin.off`` instead says
why a live bus runs without one). The bus side is ``engine/adminserve.py``.

Admin protocol (msgpack over ZeroMQ DEALER -> the bus's admin ROUTER): request
``{"view": name, "args": {...}}``, reply ``{"ok": true, "rows": [...], "total": n}`` (``total``:
rows in all, more than those sent when ``args["limit"]`` cut them) or ``{"ok": false,
"error": text}``. The views are read-only (``check`` reads a snapshot of the store); the
operations that write, ``replay`` and ``purge`` of dead letters (args ``ids``, ``topic``,
``reason``), and ``kick`` and ``readmit`` (args ``target``, ``why``), are run by the bus's
engine on its own thread (engine/maintain.py). ``replay`` also takes ``payload`` (new in
0.2; any value msgpack encodes, nil too: present means an edit) with ``ids`` naming one dead
letter alone: it goes back with that payload instead of its own, or the reply is an error
(``ValueError: ...``: more than one letter, not replayable, over the bus's max_payload;
``TypeError: ...``: a payload a receiver could not decode), and nothing changed.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack

from ..errors import AdminDenied, AdminUnavailable
from ..store.datadir import ENDPOINT_FILE, OFF_FILE
from .views import Rows

__all__ = [
    "ENDPOINT_FILE", "OFF_FILE", "EXPORT_VIEW", "query_live", "live_export", "admin_endpoint", "admin_off",
    "encode_request", "decode_request", "encode_reply", "AdminUnavailable", "AdminDenied", "AdminRefused",
]


class AdminRefused(AdminUnavailable):
    """The live bus answered, with an error (``error``: its text, ``"ValueError: ..."`` for
    a request it found wrong, such as a kick of a target it does not know)."""

    def __init__(self, message: str, error: str) -> None:
        super().__init__(message)
        self.error = error


# ``export`` is not one of the views (views.py): over the admin endpoint it is served page
# by page (adminserve.py) and the CLI, as its own user, writes the file.
EXPORT_VIEW = "export_page"


def encode_request(view: str, args: dict) -> bytes:
    return msgpack.packb({"view": view, "args": args}, use_bin_type=True)


def decode_request(data: bytes) -> tuple[str, dict]:
    req = msgpack.unpackb(data, raw=False)
    if not isinstance(req, dict) or not isinstance(req.get("view"), str) or not isinstance(req.get("args"), dict):
        raise ValueError("bad admin request")
    return req["view"], req["args"]


def encode_reply(rows: list[dict] | None = None, error: str | None = None) -> bytes:
    """``{"ok": true, "rows": [...], "total": n}`` (``total``, new in 0.2: rows in all, when a
    limit cut them; a CLI that does not know it ignores it) or ``{"ok": false, "error": ...}``."""
    if error is not None:
        body: dict[str, Any] = {"ok": False, "error": error}
    else:
        body = {"ok": True, "rows": rows}
        if isinstance(rows, Rows):
            body["total"] = rows.total
    return msgpack.packb(body, use_bin_type=True)


def admin_endpoint(datadir: Path) -> str | None:
    try:
        return (datadir / ENDPOINT_FILE).read_text().strip() or None
    except OSError:
        return None


def admin_off(datadir: Path) -> str | None:
    """Why the live bus on ``datadir`` runs without its admin endpoint (``admin.off``), or None."""
    try:
        reason = (datadir / OFF_FILE).read_text().strip()
    except OSError:
        return None
    return f"the live bus on {datadir} cannot answer: {reason}"


def _check_reachable(datadir: Path, endpoint: str) -> None:
    """Fail at once where ZeroMQ would retry in silence until the timeout: a Unix socket
    this user may not connect to (the bus's folder is 0700: ``AdminDenied``), or that
    nothing listens on. One plain connection, closed at once: the bus sees a client that
    left before its greeting."""
    if not endpoint.startswith("ipc://"):
        return
    path = endpoint[len("ipc://"):]
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except PermissionError as exc:
        raise AdminDenied(f"{path}, the admin endpoint of the live bus on {datadir}, cannot be "
                          "reached", os.path.dirname(path)) from exc
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        raise AdminUnavailable(f"the live bus on {datadir} does not listen on its admin endpoint "
                               f"{endpoint} ({exc.strerror}): it may be starting, stopping or "
                               "hung; try again") from exc
    except OSError:
        pass  # something only ZeroMQ knows how to reach: let it try
    finally:
        probe.close()


class _AdminClient:
    """One connection to a live bus's admin endpoint, for one call or many (an export's
    pages share it: a ZeroMQ context per page cost ~1,000 context setups per million rows)."""

    def __init__(self, datadir: Path, timeout: float) -> None:
        import zmq

        endpoint = admin_endpoint(datadir)
        if endpoint is None:
            raise AdminUnavailable(admin_off(datadir) or f"the live bus on {datadir} has no admin endpoint")
        self.datadir, self.endpoint, self.timeout = datadir, endpoint, timeout
        _check_reachable(datadir, endpoint)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def ask(self, view: str, args: dict) -> Rows:
        self.sock.send_multipart([b"", encode_request(view, args)])
        if not self.sock.poll(int(self.timeout * 1000)):
            raise AdminUnavailable(f"the live bus on {self.datadir} did not answer on {self.endpoint} "
                                   f"within {self.timeout:.0f}s")
        reply = msgpack.unpackb(self.sock.recv_multipart()[-1], raw=False)
        if not reply.get("ok"):
            raise AdminRefused(f"the live bus refused: {reply.get('error')}", str(reply.get("error")))
        return Rows(reply["rows"], reply.get("total"))  # no total: an older bus

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def __enter__(self) -> "_AdminClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def query_live(datadir: Path, view: str, args: dict, timeout: float = 30.0) -> Rows:
    """Ask the live bus holding ``datadir`` for a view over its admin endpoint."""
    with _AdminClient(datadir, timeout) as client:
        return client.ask(view, args)


def live_export(datadir: Path, timeout: float = 30.0) -> Iterator[dict]:
    """``export_rows`` of the live bus holding ``datadir``, fetched page by page."""
    cursor = None
    with _AdminClient(datadir, timeout) as client:
        while True:
            page = client.ask(EXPORT_VIEW, {"cursor": cursor})[0]
            yield from page["rows"]
            cursor = page["cursor"]
            if cursor is None:
                return
