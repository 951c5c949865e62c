"""Operations that change a stopped bus's data directory: replay, purge, check/repair,
compact. The CLI refuses to run them while a live bus holds the lock.

Every change is written in batches that keep the keyspaces consistent (a dead letter is
deleted in the same write that puts its message back), and reported row by row so an
operator sees exactly what happened.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


from ..model.clock import wall_ms
from ..store.cursors import consumers
from ..model.delivery import is_command_stream, pack_outgoing, stream_target, unpack_outgoing
from ..model.ids import IdGenerator
from ..hooks.journal import Journal
from ..model.letters import outgoing_letter
from ..model.segments import bodies_of, make_blob
from ..model.stored import event
from ..wire.protocol import Kind
from ..store import Store

__all__ = ["replay", "purge", "REPLAYABLE"]

Progress = Callable[[int], None] | None
CHUNK = 5000
REPLAYABLE = ("incoming", "outgoing")



class _Writer:
    """Writes a long operation in bounded batches (memory), fsyncing once at the end."""

    def __init__(self, store: Store, progress: Progress) -> None:
        self.store, self.progress = store, progress
        self.batch, self.done = store.batch(), 0

    def step(self) -> None:
        self.done += 1
        if self.done % CHUNK == 0:
            self.store.write(self.batch, sync=False)
            self.batch = self.store.batch()
            if self.progress:
                self.progress(self.done)

    def close(self) -> None:
        self.store.write(self.batch, sync=True)


# --- replay --------------------------------------------------------------------------------


def replay(store: Store, ids: list[str] | None, topic: str | None,
           progress: Progress = None) -> list[dict]:
    """Put dead letters back where they can be tried again; one report row per letter.

    Letters of received messages go back to the incoming store (handled at the next start,
    attempts reset). Letters of messages this bus could not deliver go back to their
    outgoing stream under a new id (so no delivery cursor has passed it) and without TTL.
    """
    wanted = set(ids) if ids else None
    letters = [(mid, rec) for mid, rec in store.deadletters()
               if (wanted is None or mid in wanted) and (topic is None or rec.get("topic") == topic)]
    report: list[dict] = []
    if wanted:
        for missing in sorted(wanted - {mid for mid, _ in letters}):
            report.append({"id": missing, "result": "skipped", "detail": "no such dead letter"})
    views = {(c.peer, c.stream): c for c in consumers(store)}
    subscribers_of: dict[str, set[str]] = {}
    for c in views.values():
        subscribers_of.setdefault(c.stream, set()).add(c.peer)
    gen = IdGenerator(after=store.highest_own_id())  # above every cursor, whatever the clock
    journal = _journal(store)
    writer = _Writer(store, progress)
    for mid, rec in letters:
        batch = writer.batch
        row = {"id": mid, "topic": rec.get("topic"), "reason": rec.get("reason")}
        origin = rec.get("origin")
        if rec.get("not_replayable"):
            # Nothing in it can be put back as it is (a message whose fields were not
            # valid, a SQL outbox row that could not be a message): it stays, to look at.
            row.update(result="skipped", detail=f"not replayable: {rec['not_replayable']}")
        elif "record" not in rec:
            row.update(result="skipped", detail=f"its record is damaged ({rec.get('error')}); "
                                                "servicebus export shows what is left of it")
        elif origin == "incoming":
            batch.put_incoming(mid, rec["record"])
            batch.delete_deadletter(mid)
            inner = rec["record"]
            journal.record(batch, [event("replayed", wall_ms(), mid, inner[1], rec.get("kind"), inner[3])])
            row.update(result="replayed", to="incoming")
        elif origin == "outgoing":
            stream, peer = str(rec.get("stream") or ""), str(rec.get("peer") or "")
            if not stream or not peer:
                row.update(result="skipped", detail="the letter names no stream or receiver")
                report.append(row)
                continue
            if is_command_stream(stream):
                if (peer, stream) not in views:
                    batch.put_delivery(peer, stream, {"floor": "", "acked": [], "attempts": {}})
                    views[(peer, stream)] = None  # type: ignore[assignment]
            elif subscribers_of.get(stream) != {peer}:
                reason = ("is no longer subscribed" if peer not in subscribers_of.get(stream, ())
                          else "shares the topic with other subscribers, who would get it again")
                row.update(result="skipped", detail=f"subscriber {peer} {reason}")
                report.append(row)
                continue
            kind, topic_, _sent, _expires, corr, headers, _ids, blob = rec["record"]
            new_id = gen.next()  # a segment of one, as the letter kept it
            batch.put_outgoing(stream, new_id, pack_outgoing(Kind(kind), topic_, wall_ms(), [new_id], blob,
                                                             None, corr, headers))
            batch.delete_deadletter(mid)
            journal.record(batch, [
                event("replayed_at_sender", wall_ms(), mid, topic_, rec.get("kind"), peer, 0, f"as {new_id}"),
                event("published", wall_ms(), new_id, topic_, rec.get("kind"), peer)])
            row.update(result="replayed", to=f"outgoing to {peer}", new_id=new_id)
        else:
            row.update(result="skipped", detail=f"unknown origin {origin!r}")
        report.append(row)
        writer.step()
    writer.close()
    return report


# --- purge ---------------------------------------------------------------------------------


def _journal(store: Store) -> Journal:
    """The journal of the bus that owns ``store``, for events of changes made here (it
    moves them to segment files at its next start, or ``servicebus journal flush``)."""
    node, address = store.get_meta("node"), store.get_meta("address")
    return Journal(store, Path("."), (node or b"").decode(), (address or b"").decode())


def _journal_owed(store: Store, writer: "_Writer", peer: str | None, name: str, why: str) -> None:
    """Journal every message still owed to ``peer`` (every peer if None) as ended by an
    operator: the audit counts it as ``event``, not as lost."""
    journal = _journal(store)
    for c in consumers(store):
        if peer is not None and c.peer != peer:
            continue
        kind = "command" if is_command_stream(c.stream) else "event"
        topic = None if kind == "command" else stream_target(c.stream)
        for mid in c.pending_ids(store):
            # A segment's key names its first message only: the event names them all, or
            # the audit would find the others never ended (lost).
            journal.record(writer.batch, [event(name, wall_ms(), mid, topic, kind, c.peer, 0, why,
                                                _segment_ids(store, c.stream, mid))])
            writer.step()


def _segment_ids(store: Store, stream: str, key: str) -> list[str] | None:
    """The message ids of the segment stored under ``key``; None if it is gone or damaged
    (the event names the key alone, as before segments)."""
    data = store.get_outgoing(stream, key)
    if data is None:
        return None
    try:
        return unpack_outgoing(data).ids
    except Exception:  # noqa: BLE001 - damaged: check/repair says what it is
        return None


def _delete_keyspaces(store: Store, names: tuple[str, ...], progress: Progress) -> dict[str, int]:
    counts = {name: 0 for name in names}
    writer = _Writer(store, progress)
    if "outgoing" in names:
        _journal_owed(store, writer, None, "dropped_at_sender", "purged")
    for name in names:
        for key in store.keys_in(name):
            writer.batch.delete_raw(key)
            counts[name] += 1
            writer.step()
    writer.close()
    return counts


def purge(store: Store, *, outgoing: bool = False, incoming: bool = False,
          deadletters: bool = False, subscriber: str | None = None,
          progress: Progress = None) -> dict[str, int]:
    """Delete what is named; return counts per kind of record removed."""
    removed: dict[str, int] = {}
    names: tuple[str, ...] = ()
    if outgoing:
        names += ("outgoing", "deliveries", "replies")
    if incoming:
        names += ("incoming", "runstate")
    if deadletters:
        names += ("deadletters",)
    if names:
        removed.update(_delete_keyspaces(store, names, progress))
    if subscriber:
        removed.update(_remove_subscriber(store, subscriber, progress))
    return removed


def _remove_subscriber(store: Store, address: str, progress: Progress) -> dict[str, int]:
    """Forget a subscriber. What it was still owed becomes dead letters (reason
    ``subscriber_removed``) rather than vanishing: they can be exported or inspected."""
    mine = [c for c in consumers(store) if c.peer == address]
    writer = _Writer(store, progress)
    journal = _journal(store)
    moved = 0
    for c in mine:
        for mid in c.pending_ids(store):
            data = store.get_outgoing(c.stream, mid)
            if data is None:
                continue
            rec = unpack_outgoing(data)
            kind = Kind(rec.kind).name.lower()
            # One dead letter per message, as the bus makes them (core/expiry.py): replay
            # puts a letter back as a segment of one, and the listings count messages.
            bodies = bodies_of(rec.blob) if len(rec.ids) > 1 else [None]
            for mid_i, body in zip(rec.ids, bodies):
                one = rec if body is None else rec._replace(ids=[mid_i], blob=make_blob([body]))
                writer.batch.put_deadletter(mid_i, outgoing_letter("subscriber_removed", None, one, address,
                                                                   c.stream))
            journal.record(writer.batch, [event("deadlettered_at_sender", wall_ms(), rec.ids[0], rec.topic,
                                                kind, address, 0, "subscriber_removed", rec.ids)])
            moved += len(rec.ids)
            writer.step()
        writer.batch.delete_delivery(c.peer, c.stream)
        if is_command_stream(c.stream):
            # Its stream is this address's alone: without its delivery state, the next start
            # would deliver all of it again from the start, acknowledged commands included.
            for mid in list(store.stream_ids(c.stream)):
                writer.batch.delete_outgoing(c.stream, mid)
                writer.step()
    subs = [(s, t) for s, t, _ in store.subscriptions() if s == address]
    for s, t in subs:
        writer.batch.delete_subscription(s, t)
    writer.close()
    return {"subscriptions": len(subs), "deliveries": len(mine), "moved_to_deadletters": moved}
