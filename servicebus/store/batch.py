"""``Batch``: the writes of one atomic change, by record (never by raw key outside here)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..model.clock import BusClock
from ..model.stored import (DeliveryRecord, IncomingRecord, IntentRecord, OutboxSend, Progress, ReplyRecord, RunState,
                      SubscriptionRecord)
from .keys import (SEP, _C, _D, _G, _H, _I, _J, _M, _N, _O, _P, _Q, _R, _S, _T, _U, _V, _X, _Y, _pack, _pair,
                   _start, record_key)

__all__ = ["Batch"]


class Batch:
    """A set of writes applied atomically by ``Store.write``. Belongs to one thread."""

    __slots__ = ("_wb", "ops", "sync", "generation")

    def __init__(self, wb: Any, generation: int = 0) -> None:
        self._wb = wb
        self.ops = 0
        self.sync = False  # set when something visible waits on this batch being durable
        self.generation = generation  # of the store's database handle (see Store.reopen)

    def clear(self) -> None:
        """Empty the batch for reuse (cheaper than a new one per message)."""
        self._wb.clear()
        self.ops = 0
        self.sync = False

    def _put(self, key: bytes, value: bytes) -> None:
        self._wb.put(key, value)
        self.ops += 1

    def _delete(self, key: bytes) -> None:
        self._wb.delete(key)
        self.ops += 1

    def put_meta(self, name: str, value: bytes) -> None:
        self._put(_M + name.encode(), value)

    def put_clock(self, clock: BusClock) -> None:
        """Carry the bus clock over to the next start (clock.py)."""
        self._put(_M + b"clock", str(clock.now()).encode())

    def put_subscription(self, subscriber: str, topic: str, record: SubscriptionRecord) -> None:
        self._put(_pair(_S, subscriber, topic), _pack(record))

    def delete_subscription(self, subscriber: str, topic: str) -> None:
        self._delete(_pair(_S, subscriber, topic))

    def put_intent(self, publisher: str, topic: str, record: IntentRecord) -> None:
        self._put(_pair(_I, publisher, topic), _pack(record))

    def delete_intent(self, publisher: str, topic: str) -> None:
        self._delete(_pair(_I, publisher, topic))

    def put_outgoing(self, stream: str, message_id: str, record: bytes) -> None:
        """``record`` is already packed (see ``delivery.pack_outgoing``)."""
        self._put(_pair(_O, stream, message_id), record)

    def delete_outgoing(self, stream: str, message_id: str) -> None:
        self._delete(_pair(_O, stream, message_id))

    def put_delivery(self, peer: str, stream: str, record: DeliveryRecord) -> None:
        self._put(_pair(_D, peer, stream), _pack(record))

    def delete_delivery(self, peer: str, stream: str) -> None:
        self._delete(_pair(_D, peer, stream))

    def put_incoming(self, message_id: str, record: IncomingRecord) -> None:
        self._put(_N + message_id.encode(), _pack(record))

    def put_runstate(self, message_id: str, record: RunState) -> None:
        self._put(_R + message_id.encode(), _pack(record))

    def complete_incoming(self, message_id: str, handled_at: int, starts: Iterable[int] = ()) -> None:
        """A received segment is done (its messages handled, dead letters or split off):
        it goes, with its run state and the progress of its runs from ``starts``, and its
        key is remembered as handled. ``handled_at``: bus-clock ms (clock.py), which the
        dedupe window counts from."""
        key = message_id.encode()
        self._delete(_N + key)
        self._delete(_R + key)
        for start in starts:
            self._delete(_C + key + SEP + _start(start).encode())
        self.put_handled(message_id, handled_at)

    def put_progress(self, key: str, start: int, progress: Progress) -> None:
        """How far the run of segment ``key`` from message ``start`` on got."""
        self._put(_C + key.encode() + SEP + _start(start).encode(), _pack(progress))

    def delete_progress(self, key: str, starts: Iterable[int]) -> None:
        for start in starts:
            self._delete(_C + key.encode() + SEP + _start(start).encode())

    def split_off(self, message_id: str, record: IncomingRecord, state: RunState | None) -> None:
        """One message of a received segment goes on by itself, as a segment of one (its
        handler failed and is retried, or it waits for one), with its run state."""
        self._put(_N + message_id.encode(), _pack(record))
        if state is not None:
            self._put(_R + message_id.encode(), _pack(state))

    def delete_runstate(self, message_id: str) -> None:
        self._delete(_R + message_id.encode())

    def put_handled(self, message_id: str, handled_at: int) -> None:
        key, at = message_id.encode(), handled_at.to_bytes(8, "big")
        self._put(_H + key, at)
        self._put(_T + at + key, b"")

    def complete_with_reply(self, message_id: str, handled_at: int, reply: ReplyRecord) -> None:
        """Finish a request and keep its reply, in one write: a reply is never lost
        after its request counts as handled, and never made for an unfinished one."""
        self.complete_incoming(message_id, handled_at)
        self._put(_Y + message_id.encode(), _pack(reply))

    def delete_reply(self, message_id: str) -> None:
        self._delete(_Y + message_id.encode())

    def put_kv(self, key: str, value: bytes) -> None:
        """``value``: the msgpack-encoded user value."""
        self._put(_V + key.encode(), value)

    def delete_kv(self, key: str) -> None:
        self._delete(_V + key.encode())

    def put_outbox(self, message_id: str, name: str, send: OutboxSend) -> None:
        self._put(_pair(_U, message_id, name), _pack(send))

    def delete_outbox(self, key: str) -> None:
        """``key``: as ``Reads.outbox`` yields it (handled id, NUL, seq)."""
        self._delete(_U + key.encode())

    def put_publish_key(self, key: str, message_id: str, at: int) -> None:
        """``at``: bus-clock ms; the publish dedupe window counts from it."""
        raw = key.encode()
        self._put(_P + raw, _pack([message_id, at]))
        self._put(_Q + at.to_bytes(8, "big") + raw, b"")

    def forget_publish_key(self, key: str, at: int) -> None:
        raw = key.encode()
        self._delete(_P + raw)
        self._delete(_Q + at.to_bytes(8, "big") + raw)

    def forget_handled(self, message_id: str, handled_at: int) -> None:
        key = message_id.encode()
        self._delete(_H + key)
        self._delete(_T + handled_at.to_bytes(8, "big") + key)

    def quarantine_incoming(self, key: bytes, letter: dict[str, Any]) -> None:
        """Move an incoming record that does not decode (``key``, as ``Reads.incoming``
        reported it) to the dead letters as ``letter`` (its raw bytes kept in it)."""
        self._delete(key)
        self._delete(_R + key[len(_N):])
        self._put(_X + key[len(_N):], _pack(letter))

    def deadletter_incoming(self, message_id: str, record: dict[str, Any]) -> None:
        key = message_id.encode()
        self._delete(_N + key)
        self._delete(_R + key)
        self._put(_X + key, _pack(record))

    def put_deadletter(self, message_id: str, record: dict[str, Any]) -> None:
        self._put(_X + message_id.encode(), _pack(record))

    def delete_deadletter(self, message_id: str) -> None:
        self._delete(_X + message_id.encode())

    def put_journal(self, seq: int, record: bytes) -> None:
        self._put(_J + seq.to_bytes(8, "big"), record)

    def delete_journal(self, seq: int) -> None:
        self._delete(_J + seq.to_bytes(8, "big"))

    def put_segment(self, name: str, written_at: int) -> None:
        self._put(_G + name.encode(), written_at.to_bytes(8, "big"))

    def delete_segment(self, name: str) -> None:
        self._delete(_G + name.encode())

    def put_raw(self, key: bytes, value: bytes) -> None:
        """Write any key (a migration rewriting a record in a new layout)."""
        self._put(key, value)

    def delete_raw(self, key: bytes) -> None:
        """Delete any key (repair of records that no longer decode)."""
        self._delete(key)

    def delete_record(self, keyspace: str | None, name: bytes | str) -> None:
        """Delete one record by keyspace and name, as ``Reads.records`` yields them (a str
        name is its UTF-8 bytes). For repair: it drops records whatever they hold."""
        self._delete(record_key(keyspace, name.encode() if isinstance(name, str) else name))
