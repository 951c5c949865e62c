"""Read-only views of a data directory, for operators.

The same functions serve the ``servicebus`` CLI reading a stopped bus's store directly and a
live bus answering the CLI over its admin endpoint (``admin.endpoint`` in the data
directory names it: a Unix socket in ``DATADIR/run`` or, for a long path, in a private
folder under $XDG_RUNTIME_DIR or /tmp; ``admin.off`` instead says why a live bus runs
without one). Every view returns plain JSON-able rows, so both paths print the same.

Admin protocol (msgpack over ZeroMQ DEALER -> the bus's admin ROUTER): request
``{"view": name, "args": {...}}``, reply ``{"ok": true, "rows": [...], "total": n}`` (``total``:
rows in all, more than those sent when ``args["limit"]`` cut them) or ``{"ok": false,
"error": text}``. Only read-only views are served.
"""

from __future__ import annotations

import base64
import json
import os
import socket
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import msgpack

from ..model.clock import wall_ms
from ..model.delivery import is_command_stream, unpack_outgoing
from ..errors import AdminDenied, AdminUnavailable
from ..model.ids import id_millis
from ..store.cursors import ConsumerView, consumers
from ..store.datadir import ENDPOINT_FILE, OFF_FILE
from ..store.lockfile import probe
from ..wire.protocol import KIND_NAMES
from ..model.stored import NO_RUNS, IncomingRecord, RunState
from ..store import Store

__all__ = [
    "Rows", "VIEWS", "run_view", "jsonable", "payload_of",
    "ENDPOINT_FILE", "OFF_FILE", "query_live", "AdminUnavailable", "AdminDenied",
]


def jsonable(value: Any) -> Any:
    """A msgpack value as JSON: bytes become {"base64": ...} unless they are UTF-8 text."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return {"base64": base64.b64encode(value).decode()}
    if isinstance(value, dict):
        return {str(k) if not isinstance(k, str) else k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def payload_of(body: bytes) -> Any:
    try:
        return jsonable(msgpack.unpackb(body, raw=False, strict_map_key=False))
    except Exception:  # an undecodable body is shown raw rather than hiding the record
        return {"undecodable": base64.b64encode(body).decode()}


def _age(ms: int | None, now: int) -> float | None:
    return None if not ms else max(0.0, (now - ms) / 1000)


# --- views ---------------------------------------------------------------------------------


class Rows(list):
    """A view's rows, and ``total``: how many rows there are in all. More than ``len`` when
    a ``limit`` cut the list; None when not known (an older bus did not say)."""

    def __init__(self, rows: Iterable[dict] = (), total: int | None = -1) -> None:
        super().__init__(rows)
        self.total: int | None = len(self) if total == -1 else total


def view_status(store: Store, datadir: Path, args: dict, live: dict | None) -> list[dict]:
    now = wall_ms()
    pending_by: dict[str, int] = {}
    oldest: int | None = None
    for c in consumers(store):
        n = 0
        for mid in c.pending_ids(store):
            if n == 0:
                first = id_millis(mid)
                oldest = first if oldest is None else min(oldest, first)
            n += 1
        pending_by[c.peer] = pending_by.get(c.peer, 0) + n
    owner, alive = probe(datadir)
    node = store.get_meta("node")
    return [{
        "datadir": str(datadir),
        "node_id": node.decode() if node else None,
        "lock": None if owner is None else {**owner.__dict__, "alive": alive},
        "subscriptions": store.count("subscriptions"),
        "intents": store.count("intents"),
        "intents_unconfirmed": sum(1 for _, _, r in store.intents() if not r.get("confirmed")),
        "outgoing": store.count("outgoing"),
        "pending": sum(pending_by.values()),
        "pending_by_peer": pending_by,
        "oldest_pending_age_s": _age(oldest, now),
        "incoming": store.count("incoming"),
        "deadletters": store.count("deadletters"),
        "handled": store.count("handled"),
        "replies_waiting": store.count("replies"),
        "commands_waiting": store.count("outbox"),  # sent by handlers, not in a stream yet
        "kv_keys": store.count("kv"),
        "store_bytes": store.size_on_disk(),
    }]


def view_keys(store: Store, datadir: Path, args: dict, live: dict | None) -> list[dict]:
    topics: dict[str, list[str]] = {}
    for sub, topic, _ in store.subscriptions():
        topics.setdefault(topic, []).append(sub)
    return [{"topic": t, "subscribers": len(s), "addresses": sorted(s)} for t, s in sorted(topics.items())]


def view_subscribers(store: Store, datadir: Path, args: dict, live: dict | None) -> list[dict]:
    rows: dict[str, dict] = {}
    for c in consumers(store):
        row = rows.setdefault(c.peer, {"address": c.peer, "topics": [], "commands": False,
                                       "pending": 0, "last_ack": None})
        if is_command_stream(c.stream):
            row["commands"] = True
        else:
            row["topics"].append(c.topic)
        row["pending"] += sum(1 for _ in c.pending_ids(store))
        if c.last_ack and (row["last_ack"] is None or c.last_ack > row["last_ack"]):
            row["last_ack"] = c.last_ack
    return list(rows.values())


def view_outgoing(store: Store, datadir: Path, args: dict, live: dict | None) -> list[dict]:
    now, limit = wall_ms(), args.get("limit")
    subscriber, topic = args.get("subscriber"), args.get("topic")
    by_stream: dict[str, list[ConsumerView]] = {}
    for c in consumers(store):
        by_stream.setdefault(c.stream, []).append(c)
    rows: list[dict] = []
    total = 0  # past the limit, still counted: the CLI says "100 of 1,031"
    for stream, cs in sorted(by_stream.items()):
        if subscriber and subscriber not in (c.peer for c in cs):
            continue
        floors = [c.floor for c in cs]
        after = None if None in floors else min(f for f in floors if f is not None)
        while True:
            chunk = store.iter_stream(stream, after=after, limit=1000)
            for mid, data in chunk:
                owed = [c for c in cs if c.owes(mid)]
                if subscriber:
                    owed = [c for c in owed if c.peer == subscriber]
                if not owed:
                    continue
                full = limit is not None and limit > 0 and len(rows) >= limit
                if full and not topic:
                    total += 1  # counted without decoding it
                    continue
                rec = unpack_outgoing(data)
                if topic and rec.topic != topic:
                    continue
                total += 1
                if full:
                    continue
                rows.append({
                    "id": mid, "kind": KIND_NAMES.get(rec.kind, "?"), "topic": rec.topic,
                    "age_s": _age(rec.sent, now),
                    "attempts": max(c.attempts.get(mid, 1) for c in owed),
                    "owed_by": [c.peer for c in owed],
                    "expires": rec.expires, "correlation_id": rec.correlation_id,
                    "headers": jsonable(rec.headers), "payload": payload_of(rec.body),
                })
            if len(chunk) < 1000:
                break
            after = chunk[-1][0]
    return Rows(rows, total)


def _incoming_row(mid: str, rec: IncomingRecord, runstate: RunState | None, now: int) -> dict:
    attempts, _done, last_error, next_ms = runstate or NO_RUNS
    return {
        "id": mid, "kind": KIND_NAMES.get(rec.kind, "?"), "topic": rec.topic, "sender": rec.sender,
        "reply_to": rec.reply_to, "age_s": _age(rec.sent, now), "attempts": attempts,
        "last_error": last_error, "next_attempt_ms": next_ms or None, "expires": rec.expires,
        "correlation_id": rec.correlation_id, "headers": jsonable(rec.headers),
        "payload": payload_of(rec.body),
    }


def view_incoming(store: Store, datadir: Path, args: dict, live: dict | None) -> list[dict]:
    now, limit, topic = wall_ms(), args.get("limit"), args.get("topic")
    rows: list[dict] = []
    total = 0
    for mid, rec in store.incoming():
        if topic and rec.topic != topic:
            continue
        if limit and len(rows) >= limit:
            if not topic:  # the rest, counted by key without decoding it
                return Rows(rows, store.count("incoming"))
            total += 1
            continue
        total += 1
        rows.append(_incoming_row(mid, rec, store.get_runstate(mid), now))
    return Rows(rows, total)


def letter_body(rec: dict) -> bytes | None:
    """A dead letter's payload bytes: its message record's, or its own ``body`` (a message
    that was not valid, a SQL outbox row: no record could be made of them)."""
    inner = rec.get("record") or []
    if inner and isinstance(inner[-1], bytes):
        return inner[-1]
    body = rec.get("body")
    return body if isinstance(body, bytes) else None


def _deadletter_row(mid: str, rec: dict, now: int) -> dict:
    body = letter_body(rec)
    return {
        "id": mid, "origin": rec.get("origin"), "reason": rec.get("reason"), "error": rec.get("error"),
        "kind": rec.get("kind"), "topic": rec.get("topic"), "attempts": rec.get("attempts"),
        "peer": rec.get("peer"), "age_s": _age(rec.get("at"), now),
        "payload": None if body is None else payload_of(body),
        # New in 0.2: why replay leaves it alone (None: it can be replayed), and where a
        # letter that was never a message came from (a SQL outbox row: table, row, token).
        "not_replayable": rec.get("not_replayable"),
        "source": jsonable(rec.get("source")),
    }


def view_deadletters(store: Store, datadir: Path, args: dict, live: dict | None) -> list[dict]:
    now, limit, topic = wall_ms(), args.get("limit"), args.get("topic")
    rows: list[dict] = []
    total = 0
    for mid, rec in store.deadletters():
        if topic and rec.get("topic") != topic:
            continue
        if limit and len(rows) >= limit:
            if not topic:  # the rest, counted by key without decoding it
                return Rows(rows, store.count("deadletters"))
            total += 1
            continue
        total += 1
        rows.append(_deadletter_row(mid, rec, now))
    return Rows(rows, total)


def export_rows(store: Store) -> Iterator[dict]:
    """Every stored message and delivery state, one JSON-able object each. Message rows
    carry ``payload`` (decoded) and ``body`` (the exact msgpack bytes, base64)."""
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    node = store.get_meta("node")
    yield {"type": "meta", "node_id": node.decode() if node else None}
    for sub, topic, subscription in store.subscriptions():
        yield {"type": "subscription", "subscriber": sub, "topic": topic, "record": jsonable(subscription)}
    for pub, topic, intent in store.intents():
        yield {"type": "intent", "publisher": pub, "topic": topic, "record": jsonable(intent)}
    for c in consumers(store):
        yield {"type": "delivery", "peer": c.peer, "stream": c.stream, "floor": c.floor,
               "acked": sorted(c.acked), "attempts": c.attempts, "last_ack": c.last_ack}
    for stream in store.stream_names():
        after = None
        while True:
            chunk = store.iter_stream(stream, after=after, limit=1000)
            for mid, data in chunk:
                out = unpack_outgoing(data)
                yield {"type": "outgoing", "stream": stream, "id": mid, "kind": KIND_NAMES.get(out.kind),
                       "topic": out.topic, "sent": out.sent, "expires": out.expires,
                       "correlation_id": out.correlation_id, "headers": jsonable(out.headers),
                       "payload": payload_of(out.body), "body": b64(out.body)}
            if len(chunk) < 1000:
                break
            after = chunk[-1][0]
    now = wall_ms()
    for mid, inc in store.incoming():
        row = _incoming_row(mid, inc, store.get_runstate(mid), now)
        yield {"type": "incoming", **row, "sent": inc.sent, "body": b64(inc.body)}
    for mid, reply in store.replies():
        yield {"type": "reply", "request_id": mid, "reply_to": reply.reply_to, "command": reply.command,
               "correlation_id": reply.correlation_id, "payload": payload_of(reply.body),
               "body": b64(reply.body)}
    for mid, letter in store.deadletters():
        yield {"type": "deadletter", **_deadletter_row(mid, letter, now),
               "body": b64(letter_body(letter) or b"")}


def export(store: Store, out: Path, progress: Callable[[int], None] | None = None) -> int:
    """Write ``export_rows`` as JSON lines to ``out`` (atomically: temp file, fsync, rename)."""
    return write_rows(export_rows(store), out, progress)


def write_rows(rows: Iterable[dict], out: Path, progress: Callable[[int], None] | None = None) -> int:
    """Write ``rows`` as JSON lines to ``out`` (atomically: temp file, fsync, rename)."""
    tmp = out.with_name(out.name + ".tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
            if progress and n % 1000 == 0:
                progress(n)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out)
    return n


VIEWS: dict[str, Callable[[Store, Path, dict, dict | None], list[dict]]] = {
    "status": view_status,
    "keys": view_keys,
    "subscribers": view_subscribers,
    "outgoing": view_outgoing,
    "incoming": view_incoming,
    "deadletters": view_deadletters,
}
# Every view is read-only. ``export`` is not one of them: over the admin endpoint it is
# served page by page (adminserve.py) and the CLI, as its own user, writes the file.
EXPORT_VIEW = "export_page"


def run_view(store: Store, datadir: Path, name: str, args: dict, live: dict | None = None) -> Rows:
    """The rows of view ``name``; ``Rows.total`` says how many there are in all (listings
    with a ``limit``: outgoing, incoming, deadletters)."""
    try:
        view = VIEWS[name]
    except KeyError:
        raise ValueError(f"no such view: {name!r}") from None
    rows = view(store, datadir, args, live)
    return rows if isinstance(rows, Rows) else Rows(rows)


# --- the admin endpoint: request encoding and the CLI's client --------------------------------


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
            raise AdminUnavailable(f"the live bus refused: {reply.get('error')}")
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
