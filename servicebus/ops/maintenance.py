"""Operations that change a stopped bus's data directory: migrate, replay, purge,
check/repair, compact. The CLI refuses to run them while a live bus holds the lock.

Every change is written in batches that keep the keyspaces consistent (a dead letter is
deleted in the same write that puts its message back), and reported row by row so an
operator sees exactly what happened.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from ..errors import StoreError
from ..model.clock import wall_ms
from ..model.packer import pack
from ..model.segments import make_blob
from ..store.cursors import consumers
from ..model.delivery import is_command_stream, pack_outgoing, stream_target, unpack_outgoing
from ..model.ids import IdGenerator
from ..hooks.journal import Journal
from ..model.letters import damaged_letter
from ..model.stored import event
from ..wire.payload import encode_payload
from ..wire.protocol import Kind
from ..store import FORMAT_VERSION, Store, schema
from ..store.migrate import Upgrade, upgrade
from .messages import outgoing_letters

__all__ = ["migrate", "replay", "purge", "purge_letters", "select_letters", "Context", "REPLAYABLE",
           "edited_body", "check_edit", "max_payload_of"]

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


# --- migrate -------------------------------------------------------------------------------


def migrate(store: Store, progress: Progress = None) -> Upgrade | None:
    """Upgrade a store (opened without its format checked) written by an older version;
    None if it is in this version's format already. ``StoreError`` for one this version
    cannot upgrade: a newer format, or none recorded in a store that holds records."""
    store.check_mark()  # one that lost writes is repaired first: it says what it lost
    version = store.meta("format")
    if version is None:
        if any(True for _ in store.records(verify=False)):
            raise StoreError(f"store {store.path} has no format record; `servicebus check --repair` "
                             "restores it")
        version = FORMAT_VERSION
    if version > FORMAT_VERSION:
        raise StoreError(f"store {store.path} has format {version}, newer than this version's "
                         f"({FORMAT_VERSION}): run the servicebus that wrote it")
    if version == FORMAT_VERSION:
        return None
    return upgrade(store, version, FORMAT_VERSION, progress)


# --- replay --------------------------------------------------------------------------------


def _replayable(mid: str, rec: dict) -> str | None:
    """Why a letter's message record cannot be put back as it is (None: it can). Letters
    keep their message as a segment of one (format 3; ``servicebus migrate`` rewrites
    older ones): anything else would go back as a record the bus cannot read."""
    inner = "incoming" if rec.get("origin") == "incoming" else "outgoing"
    try:
        record = schema.VALUES[inner](pack(rec["record"]))
    except Exception:  # noqa: BLE001 - msgpack and the checks raise many types on junk
        return "its record is not a message this version reads; servicebus export shows what is left of it"
    if record[-2] != [mid]:
        return f"its record holds {record[-2]!r}, not this message alone"
    return None


def edited_body(payload: Any, max_payload: int) -> bytes:
    """A replay's new payload, encoded as a publish encodes one: ``TypeError`` (where in it)
    for what a receiver could not decode, ``ValueError`` if larger than ``max_payload``."""
    body = encode_payload(payload, "the new payload")
    if len(body) > max_payload:
        raise ValueError(f"the new payload is {len(body)} bytes encoded; max_payload is {max_payload}")
    return body


def max_payload_of(store: Store, default: int) -> int:
    """The ``max_payload`` the store's bus last ran with (it records it at start), or
    ``default`` for a store of a bus that did not record it."""
    try:
        recorded = store.meta("max_payload")
    except StoreError:  # damaged: check says so; the default limit holds meanwhile
        recorded = None
    return int(recorded) if recorded else default


def check_edit(ids: list[str] | None, topic: str | None, reason: str | None) -> None:
    """An edit (a new payload) is of one dead letter named by its id alone: ``ValueError``
    otherwise."""
    if ids is None or len(ids) != 1 or topic is not None or reason is not None:
        raise ValueError("a new payload is for one dead letter: name its id alone (no topic, "
                         "reason or other id)")


def _check_edit(letters: list[tuple[str, dict]], ids: list[str] | None, topic: str | None,
                reason: str | None) -> None:
    """``check_edit``, and the letter can be replayed: ``ValueError``, before anything is
    written, otherwise."""
    check_edit(ids, topic, reason)
    for mid, rec in letters:
        if rec.get("not_replayable"):
            raise ValueError(f"dead letter {mid} is not replayable: {rec['not_replayable']}; nothing was done")


def _edited(record: Any, body: bytes | None) -> Any:
    """A letter's message record (a segment of one: its blob last) with its payload
    replaced by ``body`` (None: as it is)."""
    return record if body is None else [*record[:-1], make_blob([body])]


def select_letters(store: Store, ids: list[str] | None, topic: str | None,
                   reason: str | None) -> tuple[list[tuple[str, dict]], list[str]]:
    """The dead letters an operation names: by ``ids`` (None: any), of ``topic``, with
    ``reason`` (each None: any); and the ids named that are no dead letter here (one that
    is, of another topic or reason, is left out without a word: the filter said so)."""
    wanted = None if ids is None else set(ids)  # [] names no letter: nothing, not every one
    letters, stored = [], set()
    for mid, rec in store.deadletters():
        if wanted is None or mid in wanted:
            stored.add(mid)
            if (topic is None or rec.get("topic") == topic) and (reason is None or rec.get("reason") == reason):
                letters.append((mid, rec))
    missing = sorted(wanted - stored) if wanted else []
    return letters, missing


@dataclass
class Context:
    """How an operation's changes reach the bus. Offline (the defaults): the journal of the
    store's bus, ids above every one the store refers to. In a running bus the engine passes
    its own (engine/maintain.py): its hooks record the events, its id generator makes ids,
    its core says which command receivers it knows (``known``), and what replay put back
    is told to it (``outgoing``: (stream, key, record); ``incoming``: the ids)."""

    record: Callable[[Any, list], None]
    ids: IdGenerator | None = None  # offline: made by replay, above every id the store names
    known: Callable[[str, str], bool] | None = None
    outgoing: list[tuple[str, str, bytes]] = field(default_factory=list)
    incoming: list[str] = field(default_factory=list)

    @classmethod
    def offline(cls, store: Store) -> "Context":
        return cls(_journal(store).record)


def replay(store: Store, ids: list[str] | None, topic: str | None,
           progress: Progress = None, *, reason: str | None = None,
           context: Context | None = None, body: bytes | None = None) -> list[dict]:
    """Put dead letters back where they can be tried again; one report row per letter
    (and one ``skipped`` row per id named that is no dead letter).

    ``body``: a new payload (``edited_body``) for the one letter ``ids`` names, replayed
    with it instead of its own (its topic, headers and correlation id kept), journaled
    ``replayed`` with detail ``edited``. ``ValueError`` and nothing done if more is named
    or the letter is not replayable.

    Letters of received messages go back to the incoming store (handled at the next start,
    or at once by a running bus, attempts reset). Letters of messages this bus could not
    deliver go back to their outgoing stream under a new id (so no delivery cursor has
    passed it) and without TTL.
    """
    ctx = context or Context.offline(store)
    letters, missing = select_letters(store, ids, topic, reason)
    if body is not None:
        _check_edit(letters, ids, topic, reason)
    edit = None if body is None else "edited"
    report: list[dict] = [{"id": mid, "result": "skipped", "detail": "no such dead letter"} for mid in missing]
    views = {(c.peer, c.stream): c for c in consumers(store)}
    subscribers_of: dict[str, set[str]] = {}
    for c in views.values():
        subscribers_of.setdefault(c.stream, set()).add(c.peer)
    gen = ctx.ids or IdGenerator(after=store.highest_own_id(), epoch=store.next_epoch())  # above every cursor
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
        elif origin in REPLAYABLE and (why := _replayable(mid, rec)) is not None:
            row.update(result="skipped", detail=why)
        elif origin == "incoming" and store.has_incoming(mid):
            # The first message of a publish (a segment, keyed by that message's id) that
            # is still being handled here: put back, it would overwrite the rest of it.
            row.update(result="skipped", detail="the rest of its publish is still being handled here "
                                                "(it was the first of a publish_many): replay it when that is done")
        elif origin == "incoming":
            if (at := store.handled_at(mid)) is not None:
                # It keyed a publish handled since (its first message): that mark goes with
                # its index entry, and comes back when the replayed message is handled.
                batch.forget_handled(mid, at)
            inner = _edited(rec["record"], body)
            batch.put_incoming(mid, inner)
            batch.delete_deadletter(mid)
            ctx.record(batch, [event("replayed", wall_ms(), mid, inner[1], rec.get("kind"), inner[3], 0, edit)])
            ctx.incoming.append(mid)
            row.update(result="replayed", to="incoming")
        elif origin == "outgoing":
            stream, peer = str(rec.get("stream") or ""), str(rec.get("peer") or "")
            if not stream or not peer:
                row.update(result="skipped", detail="the letter names no stream or receiver")
                report.append(row)
                continue
            if is_command_stream(stream) and ctx.known is not None:
                if not ctx.known(peer, stream):  # the running core has no consumer for it
                    row.update(result="skipped", detail=f"the running bus sends nothing to {peer} "
                                                        "now; replay it with the bus stopped")
                    report.append(row)
                    continue
            elif is_command_stream(stream):
                if (peer, stream) not in views:
                    batch.put_delivery(peer, stream, {"floor": "", "acked": [], "attempts": {}})
                    views[(peer, stream)] = None  # type: ignore[assignment]
            elif subscribers_of.get(stream) != {peer}:
                why_not = ("is no longer subscribed" if peer not in subscribers_of.get(stream, ())
                           else "shares the topic with other subscribers, who would get it again")
                row.update(result="skipped", detail=f"subscriber {peer} {why_not}")
                report.append(row)
                continue
            kind, topic_, _sent, _expires, corr, headers, _ids, blob = _edited(rec["record"], body)
            new_id = gen.next()  # a segment of one, as the letter kept it
            packed = pack_outgoing(Kind(kind), topic_, wall_ms(), [new_id], blob, None, corr, headers)
            batch.put_outgoing(stream, new_id, packed)
            batch.delete_deadletter(mid)
            ctx.outgoing.append((stream, new_id, packed))
            ctx.record(batch, [
                event("replayed_at_sender", wall_ms(), mid, topic_, rec.get("kind"), peer, 0,
                      f"as {new_id}" + (", edited" if edit else "")),
                event("published", wall_ms(), new_id, topic_, rec.get("kind"), peer)])
            row.update(result="replayed", to=f"outgoing to {peer}", new_id=new_id)
        else:
            row.update(result="skipped", detail=f"unknown origin {origin!r}")
        report.append(row)
        writer.step()
    writer.close()
    return report


# --- purge ---------------------------------------------------------------------------------


def purge_letters(store: Store, ids: list[str] | None, topic: str | None, reason: str | None,
                  progress: Progress = None, *, context: Context | None = None) -> tuple[int, list[str]]:
    """Delete the dead letters named (by ids, topic, reason: see ``select_letters``), each
    journaled as ended by an operator (``dropped``, error ``purged``); return how many, and
    the ids named that are no dead letter."""
    record = (context or Context.offline(store)).record
    letters, missing = select_letters(store, ids, topic, reason)
    writer = _Writer(store, progress)
    for mid, rec in letters:
        writer.batch.delete_deadletter(mid)
        at_sender = rec.get("origin") == "outgoing"
        inner = rec.get("record") or []
        peer = rec.get("peer") if at_sender else (inner[3] if len(inner) > 3 else None)
        record(writer.batch, [event("dropped_at_sender" if at_sender else "dropped", wall_ms(), mid,
                                    rec.get("topic"), rec.get("kind"), peer, 0, "purged")])
        writer.step()
    writer.close()
    return len(letters), missing



def _journal(store: Store) -> Journal:
    """The journal of the bus that owns ``store``, for events of changes made here (it
    moves them to segment files at its next start, or ``servicebus journal flush``)."""
    node, address = store.get_meta("node"), store.get_meta("address")
    return Journal(store, Path("."), (node or b"").decode(), (address or b"").decode())


def _journal_owed(store: Store, writer: "_Writer", peer: str | None, name: str, why: str) -> None:
    """Journal every message still owed to ``peer`` (every peer if None) as ended by an
    operator: the audit counts it as ``event``, not as lost. One event per segment naming
    its messages (``ids``), as the bus journals them; a segment whose record does not read
    is named by its key alone."""
    journal = _journal(store)
    for c in consumers(store):
        if peer is not None and c.peer != peer:
            continue
        kind = "command" if is_command_stream(c.stream) else "event"
        topic = None if kind == "command" else stream_target(c.stream)
        for key in c.pending_ids(store):
            ids: list[str] | None = None
            data = store.get_outgoing(c.stream, key)
            if data is not None:
                try:
                    ids = unpack_outgoing(data).ids
                except Exception:  # noqa: BLE001 - damaged: named by its key
                    ids = None
            journal.record(writer.batch, [event(name, wall_ms(), key, topic, kind, c.peer, 0, why, ids)])
            writer.step()


# Keyspaces whose records are segments: what purge counts of them is messages.
_MESSAGES = ("outgoing", "incoming")


def _delete_keyspaces(store: Store, names: tuple[str, ...], progress: Progress) -> dict[str, int]:
    counts = {name: store.count_messages(name) if name in _MESSAGES else 0 for name in names}
    writer = _Writer(store, progress)
    if "outgoing" in names:
        _journal_owed(store, writer, None, "dropped_at_sender", "purged")
    for name in names:
        for key in store.keys_in(name):
            writer.batch.delete_raw(key)
            if name not in _MESSAGES:
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
        # A segment's runs' progress goes with it: left alone, it would resume a segment
        # received later under the same key from where this one's run stopped.
        names += ("incoming", "runstate", "progress")
    if deadletters:
        names += ("deadletters",)
    if names:
        removed.update(_delete_keyspaces(store, names, progress))
    if subscriber:
        removed.update(_remove_subscriber(store, subscriber, progress))
    return removed


def _remove_subscriber(store: Store, address: str, progress: Progress) -> dict[str, int]:
    """Forget a subscriber. What it was still owed becomes dead letters (reason
    ``subscriber_removed``) rather than vanishing: they can be exported or inspected. A dead
    letter is one message's: each message of a segment it was owed becomes one (a segment
    of one, as the bus makes them), and the journal names them all in one event."""
    mine = [c for c in consumers(store) if c.peer == address]
    writer = _Writer(store, progress)
    journal = _journal(store)
    moved = 0
    for c in mine:
        for key in c.pending_ids(store):
            data = store.get_outgoing(c.stream, key)
            if data is None:
                continue
            try:
                rec = unpack_outgoing(data)
            except Exception as exc:  # noqa: BLE001 - damaged: kept as its raw bytes, by its key
                writer.batch.put_deadletter(key, damaged_letter(
                    "outgoing", f"subscriber_removed: undecodable record ({type(exc).__name__})", data,
                    address, c.stream))
                moved += 1
                writer.step()
                continue
            kind = Kind(rec.kind).name.lower()
            for mid, letter in outgoing_letters("subscriber_removed", rec, address, c.stream, data):
                writer.batch.put_deadletter(mid, letter)
                moved += 1
            journal.record(writer.batch, [event("deadlettered_at_sender", wall_ms(), key, rec.topic, kind,
                                                address, 0, "subscriber_removed", rec.ids)])
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
