"""Read-only views of a data directory, for operators.

The same functions serve the ``servicebus`` CLI reading a stopped bus's store directly and a
live bus answering the CLI over its admin endpoint (admin.py; the bus runs them in
``engine/adminserve.py``). Every view returns plain JSON-able rows, so both paths print the
same.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgpack

from ..model.clock import wall_ms
from ..model.segments import bodies_of
from ..model.delivery import is_command_stream, unpack_outgoing
from .messages import bodies
from . import fleet as F
from ..model.ids import id_millis
from ..store.cursors import ConsumerView, consumers
from ..store.lockfile import probe
from ..store.snapshot import snapshot
from ..store.status import retained_summary
from ..wire.protocol import KIND_NAMES, Kind
from ..wire.topics import matches
from ..model.stored import NO_RUNS, IncomingRecord, RunState
from ..store import Store

__all__ = ["Rows", "VIEWS", "cause_of", "MAX_GROUPS", "run_view", "view_subscriptions", "view_check", "view_fleet", "jsonable", "payload_of", "letter_body", "incoming_row",
           "deadletter_row"]


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
    """A payload as JSON; one that does not decode, as its raw bytes."""
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


def shown_payload(body: bytes | None, blob: bytes) -> Any:
    """``payload_of`` a message's payload; where its segment's payloads do not read
    (``body`` None), the segment's bytes as they are."""
    if body is None:
        return {"undecodable": base64.b64encode(blob).decode()}
    return payload_of(body)


def view_status(store: Store, datadir: Path, args: dict, live: dict | None) -> list[dict]:
    # Counts of messages, as ``Bus.status()`` gives them (store/status.py): a segment
    # record holds one or more.
    now = wall_ms()
    pending_by: dict[str, int] = {}
    oldest: int | None = None
    for c in consumers(store):
        first_key = next(c.pending_ids(store), None)
        if first_key is None:
            pending_by.setdefault(c.peer, 0)
            continue
        first = id_millis(first_key)  # a segment's key is its first (oldest) message's id
        oldest = first if oldest is None else min(oldest, first)
        pending_by[c.peer] = pending_by.get(c.peer, 0) + c.pending_count(store)
    owner, alive = probe(datadir)
    node = store.get_meta("node")
    return [{
        "datadir": str(datadir),
        "node_id": node.decode() if node else None,
        "lock": None if owner is None else {**owner.__dict__, "alive": alive},
        "subscriptions": store.count("subscriptions"),
        "intents": store.count("intents"),
        "intents_unconfirmed": sum(1 for _, _, r in store.intents() if not r.get("confirmed")),
        "outgoing": store.count_messages("outgoing"),
        "pending": sum(pending_by.values()),
        "pending_by_peer": pending_by,
        "oldest_pending_age_s": _age(oldest, now),
        "incoming": store.count_messages("incoming"),
        "deadletters": store.count("deadletters"),
        "handled": store.count("handled"),
        "replies_waiting": store.count("replies"),
        "commands_waiting": store.count("outbox"),  # sent by handlers, not in a stream yet
        "kv_keys": store.count("kv"),
        "store_bytes": store.size_on_disk(),
        "retained": _retained(store, now),
        # New in 0.3, of a live bus only: its engine's counters since it started
        # (published, sent, acked, received, handled, ...); None when read from a stopped one.
        "counters": (live or {}).get("counters"),
    }]


def _retained(store: Store, now: int) -> dict[str, dict]:
    """What the bus retains (model/retention.py), by the rules it last ran with."""
    raw = store.get_meta("retention")
    rules = msgpack.unpackb(raw, raw=False) if raw else []
    return retained_summary(store, rules[0], rules[1], now) if rules else {}


def view_keys(store: Store, datadir: Path, args: dict, live: dict | None) -> list[dict]:
    topics: dict[str, list[str]] = {}
    for sub, topic, _ in store.subscriptions():
        topics.setdefault(topic, []).append(sub)
    return [{"topic": t, "subscribers": len(s), "addresses": sorted(s)} for t, s in sorted(topics.items())]


def view_subscribers(store: Store, datadir: Path, args: dict, live: dict | None) -> list[dict]:
    now = wall_ms()
    rows: dict[str, dict] = {}
    for c in consumers(store):
        row = rows.setdefault(c.peer, {"address": c.peer, "topics": [], "commands": False,
                                       "pending": 0, "last_ack": None, "oldest_pending_age_s": None})
        if is_command_stream(c.stream):
            row["commands"] = True
        elif c.topic not in row["topics"]:  # once, however many priority levels it has
            row["topics"].append(c.topic)
        row["pending"] += c.pending_count(store)  # messages, not segments
        first = next(c.pending_ids(store), None)  # a segment's key: its oldest message's id
        if first is not None:
            age = _age(id_millis(first), now)
            if age is not None and (row["oldest_pending_age_s"] is None or age > row["oldest_pending_age_s"]):
                row["oldest_pending_age_s"] = age
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
            for key, data in chunk:
                owed = [c for c in cs if c.owes(key)]
                if subscriber:
                    owed = [c for c in owed if c.peer == subscriber]
                if not owed:
                    continue
                rec = unpack_outgoing(data)  # a segment: one row per message
                if topic and rec.topic != topic:
                    continue
                for mid, body in zip(rec.ids, bodies(rec.ids, rec.blob)):
                    total += 1
                    if limit is not None and limit > 0 and len(rows) >= limit:
                        continue
                    rows.append({
                        "id": mid, "kind": KIND_NAMES.get(rec.kind, "?"), "topic": rec.topic,
                        "age_s": _age(rec.sent, now),
                        "attempts": max(c.attempts.get(key, 1) for c in owed),
                        "owed_by": [c.peer for c in owed],
                        "expires": rec.expires, "correlation_id": rec.correlation_id,
                        "headers": jsonable(rec.headers), "payload": shown_payload(body, rec.blob),
                    })
            if len(chunk) < 1000:
                break
            after = chunk[-1][0]
    return Rows(rows, total)


def incoming_row(mid: str, rec: IncomingRecord, runstate: RunState | None, now: int,
                 body: bytes | None) -> dict:
    attempts, _done, last_error, next_ms = runstate or NO_RUNS
    return {
        "id": mid, "kind": KIND_NAMES.get(rec.kind, "?"), "topic": rec.topic, "sender": rec.sender,
        "reply_to": rec.reply_to, "age_s": _age(rec.sent, now), "attempts": attempts,
        "last_error": last_error, "next_attempt_ms": next_ms or None, "expires": rec.expires,
        "correlation_id": rec.correlation_id, "headers": jsonable(rec.headers),
        "payload": shown_payload(body, rec.blob),
    }


def incoming_messages(store: Store, key: str, rec: IncomingRecord
                      ) -> list[tuple[str, bytes | None, RunState | None]]:
    """The messages of received segment ``key`` not handled yet: (id, payload or None if
    the segment's payloads do not read, run state).

    A segment of several runs its messages in order and records how far it got (its
    progress, ``c/``): those before ``next`` are done (handled, or split off to go on as
    segments of their own, or dead letters: each listed where it is now). Message ``next``
    has had ``started`` runs begun (a crash in one counts); a run state of its own, if it
    has one, says its last error."""
    found = bodies(rec.ids, rec.blob)
    if len(rec.ids) == 1:
        return [(rec.ids[0], found[0], store.get_runstate(key))]
    progress = store.progress(key).get(0)
    start, started = (0, 0) if progress is None else (progress.next, progress.started)
    out: list[tuple[str, bytes | None, RunState | None]] = []
    for j in range(start, len(rec.ids)):
        mid = rec.ids[j]
        state = store.get_runstate(mid)
        if j == start and started:
            state = (state or NO_RUNS)._replace(attempts=max(started, (state or NO_RUNS).attempts))
        out.append((mid, found[j], state))
    return out


def view_incoming(store: Store, datadir: Path, args: dict, live: dict | None) -> list[dict]:
    now, limit, topic = wall_ms(), args.get("limit"), args.get("topic")
    rows: list[dict] = []
    total = 0
    for key, rec in store.incoming():
        if topic and rec.topic != topic:
            continue
        for mid, body, runstate in incoming_messages(store, key, rec):
            total += 1
            if limit and len(rows) >= limit:
                continue
            rows.append(incoming_row(mid, rec, runstate, now, body))
    return Rows(rows, total)


def letter_body(rec: dict) -> bytes | None:
    """A dead letter's payload bytes: its message record's, or its own ``body`` (a message
    that was not valid, a SQL outbox row: no record could be made of them)."""
    inner = rec.get("record") or []
    if inner and isinstance(inner[-1], bytes):  # a segment of one: its blob
        try:
            return bodies_of(inner[-1])[0]
        except Exception:  # noqa: BLE001 - shown as it is
            return inner[-1]
    body = rec.get("body")
    if isinstance(body, bytes) and rec.get("reason") == "invalid" and rec.get("origin") == "incoming":
        try:  # a segment that was not valid: its blob; of one message, that message's payload
            bodies = bodies_of(body)
        except Exception:  # noqa: BLE001 - shown as it came
            return body
        return bodies[0] if len(bodies) == 1 else body
    return body if isinstance(body, bytes) else None


def _stored_size(rec: dict) -> int:
    """The bytes of a dead letter's payload as stored (its blob, not decoded)."""
    inner = rec.get("record") or []
    blob = inner[-1] if inner and isinstance(inner[-1], bytes) else rec.get("body")
    return len(blob) if isinstance(blob, bytes) else 0


def _letter_headers(rec: dict) -> Any:
    """A dead letter's message headers, where its record keeps them (an outgoing record's
    sixth field, an incoming one's ninth: model/stored.py)."""
    inner = rec.get("record") or []
    at = 8 if rec.get("origin") == "incoming" else 5
    headers = inner[at] if len(inner) > at else None
    return jsonable(headers) if isinstance(headers, dict) else None


def deadletter_row(mid: str, rec: dict, now: int, *, brief: bool = False) -> dict:
    """A dead letter as the views show it; ``brief``: without its payload (not decoded)."""
    body = None if brief else letter_body(rec)
    return {
        "id": mid, "origin": rec.get("origin"), "reason": rec.get("reason"), "error": rec.get("error"),
        "kind": rec.get("kind"), "topic": rec.get("topic"), "attempts": rec.get("attempts"),
        "peer": rec.get("peer"), "age_s": _age(rec.get("at"), now),
        "payload": None if body is None else payload_of(body),
        # New in 0.2: why replay leaves it alone (None: it can be replayed), and where a
        # letter that was never a message came from (a SQL outbox row: table, row, token).
        "not_replayable": rec.get("not_replayable"),
        "source": jsonable(rec.get("source")),
        "headers": _letter_headers(rec),  # new in 0.3
    }


def cause_of(letter: dict[str, Any]) -> str:
    """A dead letter's cause: the exception type of a ``Type: text`` error, else its reason
    (``expired``, ``refused``...). As the audit groups them (audit/classify.py ``causes``)."""
    error = str(letter.get("error") or "")
    head, sep, _ = error.partition(":")
    if sep and re.fullmatch(r"[A-Za-z_][\w.]*", head.strip()):
        return head.strip()
    return str(letter.get("reason") or "unknown")


MAX_GROUPS = 200  # groups of dead letters a ``groups`` view returns at most, the biggest


def view_deadletters(store: Store, datadir: Path, args: dict, live: dict | None) -> list[dict]:
    """``limit``, ``topic``; ``brief`` (new in 0.3): rows without payloads (the console's
    groups, read every few seconds, need only reasons, topics and errors). New in 0.4:
    ``reason`` and ``cause`` (cause_of) select too, before the limit; ``groups``: one row
    per (reason, topic, cause) of every dead letter, with its count and an example error
    (payloads not decoded; the MAX_GROUPS biggest), total: the dead letters counted;
    ``payload_bytes``: rows listed until their payloads' stored bytes reach it (one at least)."""
    now, limit, topic, brief = wall_ms(), args.get("limit"), args.get("topic"), bool(args.get("brief"))
    reason, cause, budget = args.get("reason"), args.get("cause"), args.get("payload_bytes")
    rows: list[dict] = []
    spent = 0
    groups: dict[tuple[str, str, str], dict] = {}
    total = 0
    for mid, rec in store.deadletters():
        if (topic and rec.get("topic") != topic) or (reason and rec.get("reason") != reason) \
                or (cause and cause_of(rec) != cause):
            continue
        if args.get("groups"):
            key = (str(rec.get("reason")), str(rec.get("topic")), cause_of(rec))
            group = groups.setdefault(key, {"reason": key[0], "topic": key[1], "cause": key[2],
                                            "count": 0, "example": rec.get("error")})
            group["count"] += 1
            total += 1
            continue
        if (limit and len(rows) >= limit) or (budget and spent >= budget):
            if not (topic or reason or cause):  # the rest, counted by key without decoding it
                return Rows(rows, store.count("deadletters"))
            total += 1
            continue
        total += 1
        rows.append(deadletter_row(mid, rec, now, brief=brief))
        spent += _stored_size(rec)
    if args.get("groups"):
        return Rows(sorted(groups.values(), key=lambda g: (-g["count"], g["topic"]))[:MAX_GROUPS], total)
    return Rows(rows, total)


def view_subscriptions(store: Store, datadir: Path, args: dict, live: dict | None) -> list[dict]:
    """What this bus subscribes to (its subscribe intents): at which publisher, confirmed or
    not, and its backlog: messages of the topics it matches received and not handled yet
    (``topics``: by topic). A received event matching two intents counts in each."""
    waiting: dict[str, int] = {}
    for key, rec in store.incoming():
        if rec.kind == Kind.EVENT:
            waiting[rec.topic] = waiting.get(rec.topic, 0) + len(incoming_messages(store, key, rec))
    rows = []
    for publisher, topic, intent in store.intents():
        mine = {t: n for t, n in sorted(waiting.items()) if matches(topic, t)}
        rows.append({"publisher": publisher, "topic": topic, "op": intent.get("op"),
                     "confirmed": bool(intent.get("confirmed")), "group": intent.get("group"),
                     "ordered": bool(intent.get("ordered")), "limit": intent.get("limit"),
                     "since": intent.get("id"), "backlog": sum(mine.values()), "topics": mine})
    return rows


def view_check(store: Store, datadir: Path, args: dict, live: dict | None) -> list[dict]:
    """``servicebus check`` of a live bus (never ``--repair``): every record of a LevelDB
    snapshot decodes and the keyspaces agree. A snapshot, so that the check reads the
    store as one committed write left it while the bus goes on writing: read record by
    record instead, a message moved between keyspaces meanwhile would be seen in neither
    or in both, and reported as damage that is not there."""
    from .repair import check  # the repair tools load only for a check

    with snapshot(store) as snap:
        return [p.__dict__ for p in check(snap, False, None, datadir)]  # type: ignore[arg-type]


def view_fleet(store: Store, datadir: Path, args: dict, live: dict | None) -> list[dict]:
    """``servicebus fleet``: discovery's table (the running bus's, ``live["members"]``, or
    the one a stopped bus stored) and, per instance subscribed here, what it is owed
    (fleet.py): one row, its ``instances`` a list."""
    return F.fleet(store, view_subscribers(store, datadir, args, live), live)


VIEWS: dict[str, Callable[[Store, Path, dict, dict | None], list[dict]]] = {
    "status": view_status,
    "keys": view_keys,
    "subscribers": view_subscribers,
    "outgoing": view_outgoing,
    "incoming": view_incoming,
    "deadletters": view_deadletters,
    "subscriptions": view_subscriptions,
    "check": view_check,
    "fleet": view_fleet,
}
# Every view is read-only. ``export`` (export.py) is not one of them: see admin.EXPORT_VIEW.


def run_view(store: Store, datadir: Path, name: str, args: dict, live: dict | None = None) -> Rows:
    """The rows of view ``name``; ``Rows.total`` says how many there are in all (listings
    with a ``limit``: outgoing, incoming, deadletters)."""
    try:
        view = VIEWS[name]
    except KeyError:
        raise ValueError(f"no such view: {name!r}") from None
    rows = view(store, datadir, args, live)
    return rows if isinstance(rows, Rows) else Rows(rows)
