"""The console's HTTP routes (aiohttp): the page and its assets, the JSON it polls, the dead
letters, the actions, and the latest audit's files.

Who may do what: everything is read-only unless the console was started with ``write``;
bound beyond loopback it needs a token (``Authorization: Bearer``, or ``?token=`` for the
audit's pages a link opens). A page of another site must not drive a console on loopback
through the operator's browser: requests must name our host (DNS rebinding), and an action
must be a JSON POST (a cross-site form cannot send one without a preflight we never answer)
from our own origin.
"""

from __future__ import annotations

import hmac
import json
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from ..errors import AdminUnavailable, BusError, LockedError
from ..ops.admin import AdminRefused
from .sources import Source, fleet_view, read_audit

__all__ = ["make_app", "Settings", "MAX_BODY", "MAX_IDS"]

STATIC = Path(__file__).parent / "static"
ASSETS = {"console.js": "text/javascript", "console.css": "text/css"}
MAX_BODY = 4 << 20  # an edited payload may be as big as a message (the bus checks its own limit)
MAX_IDS = 1000  # ids one action names at most
MAX_LETTERS = 500  # dead letters one page lists at most
PAGE_BYTES = 1 << 20  # and payload bytes (one letter at least): a page of 1 MiB letters is not 500 MiB
SHOWN_SUBSCRIBERS = 50  # subscribers a bus's card lists, those most behind first
Run = Callable[..., Awaitable[Any]]


class Settings:
    """What the routes need of the running console (server.py)."""

    def __init__(self, sources: list[Source], *, write: bool, token: str | None, hosts: set[str] | None,
                 audit: Path | None, interval: float, run: Run) -> None:
        self.sources, self.write, self.token, self.hosts = sources, write, token, hosts
        self.audit, self.interval, self.run = audit, interval, run


def _json(status: int, body: Any) -> web.Response:
    return web.json_response(body, status=status, dumps=_dumps)


def _dumps(value: Any) -> str:
    """Strict JSON, as a browser parses it: a NaN or an infinity a bus sent (a payload may
    hold one) is said as the string Python writes for it, not as a bare ``NaN``."""
    try:
        return json.dumps(value, default=str, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(value), default=str, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return json.dumps(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _error(status: int, message: str) -> web.Response:
    return _json(status, {"error": message})


def make_app(s: Settings) -> web.Application:

    @web.middleware
    async def guard(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
        if s.hosts is not None and request.host not in s.hosts:
            return _error(421, f"this console answers to {sorted(s.hosts)[0]}, not {request.host!r}")
        path = request.path
        if s.token is not None and (path.startswith("/api/") or path.startswith("/audit/")):
            given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            if not given and path.startswith("/audit/"):  # a link cannot send a header
                given = request.query.get("token", "")
            if not hmac.compare_digest(given.encode(), s.token.encode()):
                return _error(401, "a token is needed: open the console's URL with #token=... "
                                   "or send Authorization: Bearer <token>")
        if request.method not in ("GET", "HEAD"):
            if request.content_type != "application/json":
                return _error(415, "actions are JSON: Content-Type: application/json")
            origin = request.headers.get("Origin")
            if origin is not None and origin != f"{request.scheme}://{request.host}":
                return _error(403, f"an action from another origin ({origin}) is refused")
            if request.headers.get("Sec-Fetch-Site", "same-origin") not in ("same-origin", "none"):
                return _error(403, "an action from another site is refused")
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except _Refused as exc:
            return _error(exc.status, str(exc))

    async def index(request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / "index.html", headers=_NO_STORE)

    async def asset(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in ASSETS:
            raise web.HTTPNotFound()
        return web.FileResponse(STATIC / name, headers={**_NO_STORE, "Content-Type": ASSETS[name]})

    async def state(request: web.Request) -> web.Response:
        services = fleet_view(s.sources)
        names = {r["address"]: r["service"] for r in services if r.get("address") and r.get("service")}
        return _json(200, {"write": s.write, "interval": s.interval,
                           "buses": [_bus(src, names) for src in s.sources],
                           "services": services, "audit": await s.run(read_audit, s.audit)})

    async def history(request: web.Request) -> web.Response:
        src = _source(s, request.query.get("bus"))
        times = [t for t, _ in src.history]
        shown = {sub["address"] for sub in _shown(src)}  # the plots of the rows the page shows
        names = sorted({name for _, point in src.history for name in point
                        if " " not in name or name.split(" ", 1)[1] in shown})
        series = {name: [point.get(name) for _, point in src.history] for name in names}
        return _json(200, {"bus": src.index, "t": times, "series": series})

    async def letters(request: web.Request) -> web.Response:
        src = _source(s, request.query.get("bus"))
        args: dict[str, Any] = {"limit": _int(request.query.get("limit"), MAX_LETTERS, "limit"),
                                "payload_bytes": PAGE_BYTES}
        for name in ("topic", "reason", "cause"):  # selected by the bus, before the limit
            if request.query.get(name):
                args[name] = request.query[name]
        rows = await _call(s.run(src.view, "deadletters", args))
        shown = [{**r, "payload_text": json.dumps(r.get("payload"), indent=1, ensure_ascii=False, default=str)}
                 for r in rows]
        return _json(200, {"bus": src.index, "letters": shown, "total": rows.total})

    async def action(request: web.Request) -> web.Response:
        name = request.match_info["action"]
        if not s.write:
            raise _Refused(403, "this console is read-only: start it with --write to replay or purge")
        try:
            body = await request.json()
        except ValueError:
            raise _Refused(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise _Refused(400, "the body must be a JSON object")
        src = _source(s, body.get("bus"))
        args = _selection(name, body)
        more = False
        cause = args.pop("cause", None)
        if cause is not None:  # a group of the page: its letters, not the others of its topic
            args["ids"], more = await _of_cause(src, args, cause)
            if not args["ids"]:
                empty = [{"removed": {"deadletters": 0}, "missing": []}] if name == "purge" else []
                return _json(200, {"bus": src.index, "action": name, "rows": empty, "more": False})
        rows = await _call(s.run(src.act, name, args))
        return _json(200, {"bus": src.index, "action": name, "rows": rows, "more": more})

    async def _of_cause(src: Source, args: dict[str, Any], cause: str) -> tuple[list[str], bool]:
        """The ids of the dead letters of ``cause`` (and topic and reason), as many as one
        action names at most, and whether more may be left (the page says so)."""
        query = {"limit": MAX_IDS, "brief": True, "cause": cause} | {k: args[k] for k in ("topic", "reason") if args[k]}
        rows = await _call(s.run(src.view, "deadletters", query))
        ids = [str(r["id"]) for r in rows]
        return ids, (rows.total or 0) > len(ids)

    async def audit_file(request: web.Request) -> web.StreamResponse:
        if s.audit is None:
            raise _Refused(404, "this console was started without --audit")
        root = s.audit.resolve()
        target = (root / request.match_info["path"]).resolve()
        if not target.is_relative_to(root) or not target.is_file():
            raise web.HTTPNotFound()
        return web.FileResponse(target, headers=_AUDIT_FILE)

    async def health(request: web.Request) -> web.Response:
        return _json(200, {"status": "ok", "buses": len(s.sources)})

    app = web.Application(middlewares=[guard], client_max_size=MAX_BODY)
    app.router.add_get("/", index)
    app.router.add_get("/static/{name}", asset)
    app.router.add_get("/api/state", state)
    app.router.add_get("/api/history", history)
    app.router.add_get("/api/letters", letters)
    app.router.add_post("/api/{action:replay|purge}", action)
    app.router.add_get("/audit/{path:.+}", audit_file)
    app.router.add_get("/health", health)
    return app


_NO_STORE = {"Cache-Control": "no-store", "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff",
             "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                                        "frame-ancestors 'none'",
             "Referrer-Policy": "no-referrer"}  # an audit page's URL holds the token (?token=)
# The audit's report styles itself and pages its lists inline (audit/reportlist.py escapes
# what buses sent into it). Sandboxed without same-origin, a script there is of no origin:
# it cannot read the console's API (no CORS) nor send it an action (JSON needs a preflight),
# and may fetch nothing at all (default-src 'none').
_AUDIT_FILE = {**_NO_STORE, "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; "
                                                       "script-src 'unsafe-inline'; img-src data:; "
                                                       "frame-ancestors 'none'; sandbox allow-scripts"}


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _int(raw: Any, most: int, name: str) -> int:
    if raw is None or raw == "":
        return most
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise _Refused(400, f"{name} must be a whole number, not {raw!r}") from None
    if not 1 <= value <= most:
        raise _Refused(400, f"{name} must be from 1 to {most}")
    return value


def _source(s: Settings, raw: Any) -> Source:
    """The data directory numbered ``raw`` (its place in the console's list, from 0)."""
    index = -1
    if isinstance(raw, int) and not isinstance(raw, bool):
        index = raw
    elif isinstance(raw, str) and raw.isascii() and raw.isdigit() and len(raw) < 6:  # not "²"
        index = int(raw)
    if not 0 <= index < len(s.sources):
        raise _Refused(400, f"bus must be a number from 0 to {len(s.sources) - 1}, not {raw!r}")
    return s.sources[index]


def _selection(action: str, body: dict[str, Any]) -> dict[str, Any]:
    """The dead letters an action names, checked: ``ids`` (strings), ``topic``, ``reason``;
    ``payload`` for a replay of one letter with a new payload; ``all`` to name every one."""
    unknown = set(body) - {"bus", "ids", "topic", "reason", "cause", "payload", "payload_text", "all"}
    if unknown:
        raise _Refused(400, f"unknown fields: {', '.join(sorted(map(str, unknown)))}")
    ids = body.get("ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(i, str) and 0 < len(i) <= 64 for i in ids):
            raise _Refused(400, "ids must be a list of message ids")
        if not 0 < len(ids) <= MAX_IDS:
            raise _Refused(400, f"ids must name from 1 to {MAX_IDS} dead letters")
    for name in ("topic", "reason", "cause"):
        value = body.get(name)
        if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 512):
            raise _Refused(400, f"{name} must be a non-empty string")
    if body.get("all") not in (None, True, False):
        raise _Refused(400, "all must be true or false")
    named = ids is not None or body.get("topic") is not None or body.get("reason") is not None
    if not named and body.get("all") is not True:
        raise _Refused(400, "name the dead letters: ids, topic, reason, or all: true")
    if named and body.get("all") is True:
        raise _Refused(400, "all: true names every dead letter; leave ids, topic and reason out")
    args: dict[str, Any] = {"ids": ids, "topic": body.get("topic"), "reason": body.get("reason")}
    if body.get("cause") is not None:
        if ids is not None or not (body.get("topic") or body.get("reason")):
            raise _Refused(400, "a cause names the dead letters of a topic or reason: leave ids out")
        args["cause"] = body["cause"]
    if "payload_text" in body:  # the payload as the operator wrote it: 2**64 stays 2**64, NaN NaN
        if "payload" in body or not isinstance(body["payload_text"], str):
            raise _Refused(400, "payload_text is the new payload as JSON text, instead of payload")
        try:
            body = {**body, "payload": json.loads(body["payload_text"])}
        except ValueError as exc:
            raise _Refused(400, f"payload_text is not JSON: {exc}") from None
    if "payload" in body:
        if action != "replay" or ids is None or len(ids) != 1:
            raise _Refused(400, "a new payload replaces one dead letter's: replay with ids of one")
        args["payload"] = body["payload"]
    return args


async def _call(pending: Awaitable[Any]) -> Any:
    """The bus's errors as HTTP answers: a wrong request 400, a bus that cannot answer 503,
    a data directory a command holds 409."""
    try:
        return await pending
    except AdminRefused as exc:
        raise _Refused(400 if exc.error.startswith(("ValueError", "TypeError")) else 409, exc.error) from None
    except LockedError as exc:
        raise _Refused(409, str(exc)) from None
    except AdminUnavailable as exc:
        raise _Refused(503, str(exc)) from None
    except (ValueError, TypeError) as exc:
        raise _Refused(400, str(exc)) from None
    except (BusError, OSError) as exc:
        raise _Refused(503, f"{type(exc).__name__}: {exc}") from None


def _shown(src: Source) -> list[dict[str, Any]]:
    """The subscribers a bus's card shows: those most behind first, SHOWN_SUBSCRIBERS at most
    (a publisher with thousands must not make every poll and page that big)."""
    subs = src.latest.subscribers if src.latest is not None else []
    return sorted(subs, key=lambda sub: (-(sub.get("pending") or 0), str(sub.get("address"))))[:SHOWN_SUBSCRIBERS]


def _bus(src: Source, names: dict[str, str]) -> dict[str, Any]:
    """A data directory as the page shows it; ``names``: service names by address, as
    every bus read knows them."""
    sample = src.latest
    if sample is None:
        return {"id": src.index, "label": src.label, "up": None, "read": False}
    status = sample.status
    me: dict[str, Any] = next((i for i in sample.fleet.get("instances") or [] if i.get("self")), {})
    return {
        "id": src.index, "label": src.label, "read": True, "up": sample.up, "at": sample.at,
        "error": sample.error, "node": status.get("node_id"), "service": me.get("service") or "",
        "address": me.get("address") or (status.get("lock") or {}).get("address"),
        "counts": {k: status.get(k) for k in ("outgoing", "pending", "incoming", "deadletters",
                                              "oldest_pending_age_s", "store_bytes", "handled")},
        "subscribers": [{**sub, "service": names.get(str(sub.get("address"))) or ""} for sub in _shown(src)],
        "subscribers_total": len(sample.subscribers),
        "letters": sample.letters, "groups": sample.groups, "rates": sample.rates,
    }
