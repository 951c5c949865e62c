"""``servicebus export``: every stored message and delivery state as JSON lines.

A stopped bus's store is read here directly; a live bus sends the same rows page by page
over its admin endpoint (``admin.live_export``) and the CLI, as its own user, writes them
with ``write_rows``.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from ..model.clock import wall_ms
from ..model.delivery import unpack_outgoing
from ..store.cursors import consumers
from ..wire.protocol import KIND_NAMES
from ..store import Store
from .messages import bodies
from .views import deadletter_row, incoming_messages, incoming_row, jsonable, letter_body, payload_of, shown_payload

__all__ = ["export_rows", "export", "write_rows"]


def export_rows(store: Store) -> Iterator[dict]:
    """Every stored message and delivery state, one JSON-able object each. Message rows
    carry ``payload`` (decoded) and ``body`` (the exact msgpack bytes, base64): one row
    per message, with the ``segment`` it is stored in (its key, which delivery states'
    ``floor`` and ``acked`` name). A segment whose payloads do not read gives each of its
    ids a row whose ``body`` is the segment's payload bytes as stored."""
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
            for key, data in chunk:
                out = unpack_outgoing(data)
                for mid, body in zip(out.ids, bodies(out.ids, out.blob)):  # a segment: one row per message
                    yield {"type": "outgoing", "stream": stream, "id": mid, "segment": key,
                           "kind": KIND_NAMES.get(out.kind), "topic": out.topic, "sent": out.sent,
                           "expires": out.expires, "correlation_id": out.correlation_id,
                           "headers": jsonable(out.headers), "payload": shown_payload(body, out.blob),
                           "body": b64(out.blob if body is None else body)}
            if len(chunk) < 1000:
                break
            after = chunk[-1][0]
    now = wall_ms()
    for key, inc in store.incoming():
        for mid, body, runstate in incoming_messages(store, key, inc):
            row = incoming_row(mid, inc, runstate, now, body)
            yield {"type": "incoming", **row, "segment": key, "sent": inc.sent,
                   "body": b64(inc.blob if body is None else body)}
    for mid, reply in store.replies():
        yield {"type": "reply", "request_id": mid, "reply_to": reply.reply_to, "command": reply.command,
               "correlation_id": reply.correlation_id, "payload": payload_of(reply.body),
               "body": b64(reply.body)}
    for mid, letter in store.deadletters():
        yield {"type": "deadletter", **deadletter_row(mid, letter, now),
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
