"""The store's reads, each one guarded call (``Store._op``) with keys built here only."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..model.clock import BusClock
from ..model.segments import count_of
from . import schema
from ..errors import CorruptRecordError
from ..model.stored import (DeliveryRecord, IncomingRecord, IntentRecord, OutboxSend, Progress, ReplyRecord, RunState,
                      SubscriptionRecord)
from .keys import KEYSPACES, SEP, keyspace_of, _C, _D, _G, _H, _I, _J, _M, _N, _O, _P, _Q, _R, _S, _T, _U, _V, _X, _Y, _end, _pair, _split

if TYPE_CHECKING:
    from .batch import Batch
    from .handle import _Guard

__all__ = ["Reads"]


class Reads:
    """Read methods of ``Store`` (db.py), kept apart from opening, writing and reopening."""

    _db: Any
    path: Any

    def _op(self) -> "_Guard":
        raise NotImplementedError

    def batch(self) -> "Batch":
        raise NotImplementedError

    def write(self, batch: "Batch", *, sync: bool) -> None:
        raise NotImplementedError


    def get_meta(self, name: str) -> bytes | None:
        with self._op():
            value: bytes | None = self._db.get(_M + name.encode())
        return value

    def meta(self, name: str) -> Any:
        """A meta record, decoded and checked (``CorruptRecordError`` if damaged)."""
        key = _M + name.encode()
        value = self.get_meta(name)
        return None if value is None else schema.decode("meta", key, value)

    def bus_clock(self) -> BusClock:
        """The bus clock, continuing from where the store last saved it (clock.py)."""
        return BusClock(self.meta("clock") or 0)

    def _decoded(self, keyspace: str, prefix: bytes) -> Iterator[tuple[bytes, Any]]:
        for key, value in self._iter(prefix):
            yield key, schema.decode(keyspace, key, value)

    def _iter(self, prefix: bytes, **kwargs: Any) -> Iterator[tuple[bytes, bytes]]:
        with self._op():
            it = self._db.iterator(prefix=prefix, **kwargs)
            try:
                yield from it
            finally:
                it.close()

    def keys_in(self, keyspace: str) -> Iterator[bytes]:
        """Every raw key of one keyspace, for tools that delete a keyspace whole (purge)."""
        with self._op():
            with self._db.iterator(prefix=KEYSPACES[keyspace], include_value=False) as it:
                yield from it

    def records_in(self, keyspace: str, limit: int | None = None) -> Iterator[tuple[bytes, bytes]]:
        """(raw key, raw value) of one keyspace, undecoded, at most ``limit``: for tools that
        must look at records before knowing their layout (``servicebus check`` of a store
        whose format record is damaged)."""
        for n, item in enumerate(self._iter(KEYSPACES[keyspace])):
            if limit is not None and n >= limit:
                return
            yield item

    def count(self, keyspace: str) -> int:
        prefix = KEYSPACES[keyspace]
        with self._op():
            with self._db.iterator(prefix=prefix, include_value=False) as it:
                return sum(1 for _ in it)

    def subscriptions(self) -> Iterator[tuple[str, str, SubscriptionRecord]]:
        for key, record in self._decoded("subscriptions", _S):
            sub, topic = _split(key, len(_S))
            yield sub, topic, record

    def intents(self) -> Iterator[tuple[str, str, IntentRecord]]:
        for key, record in self._decoded("intents", _I):
            pub, topic = _split(key, len(_I))
            yield pub, topic, record

    def deliveries(self) -> Iterator[tuple[str, str, DeliveryRecord]]:
        for key, record in self._decoded("deliveries", _D):
            peer, stream = _split(key, len(_D))
            yield peer, stream, record

    def stream_names(self) -> list[str]:
        """Names of the outgoing streams that hold messages (one seek per stream)."""
        names: list[str] = []
        with self._op():
            with self._db.iterator(prefix=_O, include_value=False) as it:
                while True:
                    key = next(it, None)
                    if key is None:
                        return names
                    stream = key[len(_O):].partition(SEP)[0]
                    names.append(stream.decode())
                    it.seek(_O + stream + b"\x01")  # past every key of this stream

    def last_stream_id(self, stream: str) -> str | None:
        """The highest id in a stream that is not a delayed message's (those are made for
        their due time, not in order: ids.py); one seek unless delayed ones end it."""
        prefix = _O + stream.encode() + SEP
        with self._op():
            with self._db.iterator(prefix=prefix, reverse=True, include_value=False) as it:
                for key in it:
                    if len(key) - len(prefix) != 25:
                        return str(key[len(prefix):].decode())
        return None

    def highest_own_id(self) -> str | None:
        """The highest id this bus made that its store still refers to: the last message of
        every outgoing stream, every delivery cursor (which outlive the messages they
        passed), subscription starts and intents. New ids must sort above it (ids.py)."""
        found: list[str] = []
        for stream in self.stream_names():
            last = self.last_stream_id(stream)
            if last:
                found.append(last)
        for _peer, _stream, rec in self.deliveries():
            floor = rec.get("floor")
            if floor:
                found.append(floor)
            found.extend(rec.get("acked") or ())
        found.extend(rec.get("since") or "" for _s, _t, rec in self.subscriptions())
        found.extend(rec.get("id") or "" for _p, _t, rec in self.intents())
        return max(found, default=None) or None

    def iter_stream(
        self, stream: str, after: str | None = None, limit: int | None = None
    ) -> list[tuple[str, bytes]]:
        """Up to ``limit`` (id, packed record) of a stream, in id order, after ``after``."""
        prefix = _O + stream.encode() + SEP
        out: list[tuple[str, bytes]] = []
        with self._op():
            if after is None:
                it = self._db.iterator(prefix=prefix)
            else:
                it = self._db.iterator(
                    start=prefix + after.encode(), include_start=False, stop=_end(prefix)
                )
            with it:
                plen = len(prefix)
                for key, value in it:
                    out.append((key[plen:].decode(), value))
                    if limit is not None and len(out) >= limit:
                        break
        return out

    def stream_ids(self, stream: str, after: str | None = None, upto: str | None = None,
                   limit: int | None = None) -> list[str]:
        """Ids of a stream in (after, upto], without reading the payloads."""
        prefix = _O + stream.encode() + SEP
        kwargs: dict[str, Any] = {"include_value": False}
        # None means "no bound"; "" is a real bound that sorts before every id.
        kwargs["start"] = prefix if after is None else prefix + after.encode()
        kwargs["include_start"] = after is None
        kwargs["stop"] = _end(prefix) if upto is None else prefix + upto.encode()
        kwargs["include_stop"] = upto is not None
        out: list[str] = []
        plen = len(prefix)
        with self._op():
            with self._db.iterator(**kwargs) as it:
                for key in it:
                    out.append(key[plen:].decode())
                    if limit is not None and len(out) >= limit:
                        break
        return out

    def count_stream(self, stream: str, after: str | None = None,
                     skip: set[str] | frozenset[str] = frozenset()) -> int:
        """Messages stored in a stream's segments after key ``after`` but those in ``skip``."""
        prefix = _O + stream.encode() + SEP
        with self._op():
            if after is None:
                it = self._db.iterator(prefix=prefix, fill_cache=False)
            else:
                it = self._db.iterator(start=prefix + after.encode(), include_start=False,
                                       stop=_end(prefix), fill_cache=False)
            plen = len(prefix)
            with it:
                return sum(count_of(value, 6) for key, value in it if key[plen:].decode() not in skip)

    def count_messages(self, keyspace: str) -> int:
        """Messages held by the segments of ``outgoing`` or ``incoming`` (not handled yet: a
        segment's run may have finished some)."""
        if keyspace == "outgoing":
            with self._op():
                with self._db.iterator(prefix=_O, fill_cache=False) as it:
                    return sum(count_of(value, 6) for _key, value in it)
        total = 0
        for key, value in self._iter(_N, fill_cache=False):
            n = count_of(value, 9)
            if n > 1:
                p = self.progress(key[len(_N):].decode()).get(0)
                if p is not None:  # those before its next are done here, or split off (counted
                    n -= min(n, p.next)  # as their own segments) or dead letters
            total += n
        return total

    def key_at_or_before(self, stream: str, message_id: str) -> str | None:
        """The greatest key of ``stream`` at or before ``message_id`` (the segment that may
        hold it: a segment is keyed by its first message's id), or None."""
        prefix = _O + stream.encode() + SEP
        with self._op():
            with self._db.iterator(start=prefix, stop=prefix + message_id.encode(), include_stop=True,
                                   reverse=True, include_value=False) as it:
                key = next(it, None)
        return None if key is None else key[len(prefix):].decode()

    def get_outgoing(self, stream: str, message_id: str) -> bytes | None:
        with self._op():
            value: bytes | None = self._db.get(_pair(_O, stream, message_id))
        return value

    def has_deadletter(self, message_id: str) -> bool:
        with self._op():
            return self._db.get(_X + message_id.encode()) is not None

    def has_incoming(self, message_id: str) -> bool:
        key = message_id.encode()
        with self._op():
            return self._db.get(_N + key) is not None

    def seen_many(self, message_ids: list[str]) -> list[bool]:
        """``seen`` for many ids in one guarded call (the engine checks whole frames).

        The reads follow the order a message moves in (incoming, then handled or dead
        letters, each move one write): read the other way round, a message completing
        between two reads is found in neither, and its resend is handled again."""
        out = []
        with self._op():
            get = self._db.get
            for mid in message_ids:
                key = mid.encode()
                out.append(get(_N + key) is not None or get(_H + key) is not None
                           or get(_X + key) is not None)
        return out

    def seen(self, message_id: str) -> bool:
        """True if the id is stored as incoming, handled (dedupe window) or dead-lettered."""
        return self.seen_many([message_id])[0]

    def get_incoming(self, message_id: str) -> IncomingRecord | None:
        key = _N + message_id.encode()
        with self._op():
            value = self._db.get(key)
        return None if value is None else IncomingRecord._make(schema.decode("incoming", key, value))

    def get_runstate(self, message_id: str) -> RunState | None:
        key = _R + message_id.encode()
        with self._op():
            value = self._db.get(key)
        return None if value is None else RunState._make(schema.decode("runstate", key, value))

    def progress(self, key: str) -> dict[int, Progress]:
        """How far runs of received segment ``key`` got, by start index (a damaged record
        raises ``CorruptRecordError``)."""
        prefix = _C + key.encode() + SEP
        out: dict[int, Progress] = {}
        for raw, record in self._decoded("progress", prefix):
            out[int(raw[len(prefix):])] = Progress._make(record)
        return out

    def incoming(self, damaged: list[tuple[bytes, bytes]] | None = None
                 ) -> Iterator[tuple[str, IncomingRecord]]:
        """Incoming messages, in id order. A damaged record raises ``CorruptRecordError``,
        or, if ``damaged`` is a list, is appended to it as (key, raw value) and skipped."""
        if damaged is None:
            for key, record in self._decoded("incoming", _N):
                yield key[len(_N):].decode(), IncomingRecord._make(record)
            return
        for key, value in self._iter(_N):
            try:
                record = schema.decode("incoming", key, value)
            except CorruptRecordError:
                damaged.append((key, value))
                continue
            yield key[len(_N):].decode(), IncomingRecord._make(record)

    def handled_at(self, message_id: str) -> int | None:
        """When (bus-clock ms) ``message_id`` (a segment key) was marked handled, or None."""
        with self._op():
            value = self._db.get(_H + message_id.encode())
        return int.from_bytes(value, "big") if value is not None and len(value) == 8 else None

    def handled_before(self, cutoff: int, limit: int) -> list[tuple[str, int]]:
        """(id, handled_at) of handled ids handled before bus-clock ``cutoff``, oldest
        first, at most ``limit``. A damaged index key is deleted on the way (it could
        only ever make an id be remembered too long)."""
        out, bad = [], []
        with self._op():
            with self._db.iterator(start=_T, stop=_T + cutoff.to_bytes(8, "big"),
                                   include_value=False, fill_cache=False) as it:
                for key in it:
                    try:
                        out.append((key[10:].decode(), int.from_bytes(key[2:10], "big")))
                    except UnicodeDecodeError:
                        bad.append(key)
                    if len(out) + len(bad) >= limit:
                        break
        if bad:
            batch = self.batch()
            for key in bad:
                batch.delete_raw(key)
            self.write(batch, sync=False)
        return out

    def get_publish_key(self, key: str) -> tuple[str, int] | None:
        """(message id, bus-clock ms) a ``publish(dedupe_key=key)`` stored, if any."""
        raw = _P + key.encode()
        with self._op():
            value = self._db.get(raw)
        if value is None:
            return None
        mid, at = schema.decode("publish_keys", raw, value)
        return mid, at

    def publish_keys_before(self, cutoff: int, limit: int) -> list[tuple[str, int]]:
        """(dedupe key, bus-clock ms) of publish keys stored before ``cutoff``, oldest first,
        at most ``limit``."""
        out = []
        with self._op():
            with self._db.iterator(start=_Q, stop=_Q + cutoff.to_bytes(8, "big"),
                                   include_value=False, fill_cache=False) as it:
                for key in it:
                    out.append((key[10:].decode("utf-8", "replace"), int.from_bytes(key[2:10], "big")))
                    if len(out) >= limit:
                        break
        return out

    def segments(self) -> list[tuple[str, int]]:
        """(journal segment file name, bus-clock ms it was written at)."""
        return [(key[2:].decode(), at) for key, at in self._decoded("segments", _G)]

    def deadletters(self) -> Iterator[tuple[str, dict[str, Any]]]:
        for key, record in self._decoded("deadletters", _X):
            yield key[len(_X):].decode(), record

    def replies(self) -> Iterator[tuple[str, ReplyRecord]]:
        for key, record in self._decoded("replies", _Y):
            yield key[len(_Y):].decode(), ReplyRecord._make(record)

    def outbox(self) -> Iterator[tuple[str, OutboxSend]]:
        """(key, command) of every command a handler sent that is not in its stream yet."""
        for key, record in self._decoded("outbox", _U):
            yield key[len(_U):].decode(), OutboxSend._make(record)

    def has_outbox(self, key: str) -> bool:
        with self._op():
            return self._db.get(_U + key.encode()) is not None

    def get_kv(self, key: str, default: Any = None) -> Any:
        """The value ``bus.kv`` holds under ``key``, or ``default``."""
        raw = _V + key.encode()
        with self._op():
            value: bytes | None = self._db.get(raw)
        return default if value is None else schema.decode("kv", raw, value)

    def kv_items(self, prefix: str = "") -> Iterator[tuple[str, Any]]:
        """(key, value) of the ``bus.kv`` keys starting with ``prefix``, in key order."""
        for key, value in self._decoded("kv", _V + prefix.encode()):
            yield key[len(_V):].decode(), value

    def journal_records(self, limit: int, max_bytes: int, after: int | None = None) -> list[tuple[int, bytes]]:
        """The oldest journal records (seq, packed events), after seq ``after`` if given: at
        most ``limit`` of them and about ``max_bytes`` (at least one). Read without filling
        the block cache: each is read once, and caching them would grow the heap for nothing."""
        out = []
        size = 0
        start = _J if after is None else _J + (after + 1).to_bytes(8, "big")
        with self._op():
            with self._db.iterator(start=start, stop=_end(_J), fill_cache=False) as it:
                for key, value in it:
                    out.append((int.from_bytes(key[2:], "big"), value))
                    size += len(value)
                    if len(out) >= limit or size >= max_bytes:
                        break
        return out

    def last_journal_seq(self) -> int:
        with self._op():
            with self._db.iterator(prefix=_J, reverse=True, include_value=False) as it:
                key = next(it, None)
        return 0 if key is None else int.from_bytes(key[2:], "big")

    def scan_raw(self, *, verify: bool = False) -> Iterator[tuple[bytes, bytes]]:
        """Every key and value, undecoded. With ``verify``, LevelDB checks every block's
        checksum as it reads (damaged files raise StoreError instead of yielding junk)."""
        if verify:
            yield from self._iter(b"", verify_checksums=True, fill_cache=False)
        else:
            yield from self._iter(b"")

    def records(self, *, verify: bool = False) -> Iterator[tuple[str | None, bytes, bytes]]:
        """``scan_raw`` as (keyspace, name, raw value): the name is the key without its
        keyspace's prefix (``keys.keyspace_of``; keyspace None: a key of no known keyspace,
        named whole). What check/repair reads, so that it never handles a prefix."""
        for key, value in self.scan_raw(verify=verify):
            keyspace, name = keyspace_of(key)
            yield keyspace, name, value

    def compact(self) -> None:
        with self._op():
            self._db.compact_range()

    def size_on_disk(self) -> int:
        """Bytes in the store's files. LevelDB's background compaction deletes files while
        this runs (a CI run met one vanishing between the listing and its stat): those
        count as gone."""
        total = 0
        for p in self.path.iterdir():
            try:
                if p.is_file():
                    total += p.stat().st_size
            except FileNotFoundError:
                continue
        return total
