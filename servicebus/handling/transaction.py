"""State a service keeps in its bus's store, and a handler's transaction.

``bus.kv`` is a key-value namespace in the bus's own LevelDB store: each write is fsynced
before it returns (concurrent writers share the fsync, like ``publish``).

``message.kv``, ``message.publish`` and ``message.send`` in a handler do not write at once:
they are staged in the run's ``Transaction`` and written in the same atomic batch as the
run's completion (the message leaving the incoming store). So a crash either loses all of
it, and the handler runs again on a store where none of it happened, or none of it: state
is applied once and the messages the handler produced are neither lost nor made twice. A
handler that raises (a retry, a dead letter) leaves nothing behind.

Isolation: reads see the committed state plus the run's own staged writes, not what a
concurrent handler staged. Two handlers that read, change and ``put`` the same key on two
workers can each overwrite the other's change; ``update(key, fn)`` is the read-modify-write
that cannot lose one: ``fn`` runs on the value at the moment of the commit, under a lock
every ``update`` shares.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from ..model.outgoing import due_ms, prepare_command, prepare_event
from ..wire.payload import decode_payload, encode_payload
from ..model.stored import OutboxSend

__all__ = ["KeyValue", "TransactionKeyValue", "Transaction", "StagedEvent", "MAX_KEY_BYTES",
           "check_key", "encode_value"]

MAX_KEY_BYTES = 1024
_MISSING = object()


def check_key(key: object) -> str:
    if not isinstance(key, str) or not key or "\x00" in key or len(key.encode()) > MAX_KEY_BYTES:
        raise ValueError(f"a kv key must be a non-empty str of at most {MAX_KEY_BYTES} bytes "
                         f"without NUL, not {key!r}")
    return key


def encode_value(value: Any, limit: int) -> bytes:
    data = encode_payload(value, "value")  # read back with decode_payload: the same rules
    if len(data) > limit:
        raise ValueError(f"kv value is {len(data)} bytes encoded; max_payload is {limit}")
    return data


class StagedEvent(NamedTuple):
    """An event a handler published (``message.publish``), stored with its completion."""

    topic: str
    body: bytes
    expires: int | None
    headers: dict[str, Any] | None
    due: int | None
    priority: int


class _KVBase:
    """The read side both namespaces share (``get``/``[]``/``in``/``items``)."""

    def get(self, key: str, default: Any = None) -> Any:
        raise NotImplementedError

    def items(self, prefix: str = "") -> list[tuple[str, Any]]:
        raise NotImplementedError

    def __getitem__(self, key: str) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key, _MISSING) is not _MISSING

    def __setitem__(self, key: str, value: Any) -> None:
        self.put(key, value)

    def __delitem__(self, key: str) -> None:
        self.delete(key)

    def put(self, key: str, value: Any) -> None:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError


class KeyValue(_KVBase):
    """``bus.kv``: the service's own state in the bus's store; every write fsynced."""

    def __init__(self, store: Any, commit: Callable[[Callable[[Any], None]], None],
                 lock: threading.Lock, max_value: int,
                 check: Callable[[], object] = lambda: None) -> None:
        self._store = store
        self._commit = commit  # a synced write shared with concurrent callers (commit.py)
        self._lock = lock  # shared with handlers' update(): one read-modify-write at a time
        self._max = max_value
        self._check = check  # raises if the bus cannot be used (closed, a fork()ed child)

    def get(self, key: str, default: Any = None) -> Any:
        return self._store.get_kv(check_key(key), default)

    def items(self, prefix: str = "") -> list[tuple[str, Any]]:
        """(key, value) of every key starting with ``prefix``, in key order."""
        if not isinstance(prefix, str):
            raise ValueError(f"prefix must be a str, not {prefix!r}")
        return list(self._store.kv_items(prefix))

    def put(self, key: str, value: Any) -> None:
        data = encode_value(value, self._max)
        check_key(key)
        self._commit(lambda batch: batch.put_kv(key, data))

    def delete(self, key: str) -> None:
        check_key(key)
        self._commit(lambda batch: batch.delete_kv(key))

    def update(self, key: str, fn: Callable[[Any], Any], default: Any = None) -> Any:
        """Set ``key`` to ``fn(current value or default)`` with no other ``update`` in between;
        returns the new value."""
        check_key(key)
        self._check()  # before the lock: after a fork a parent thread may have held it
        with self._lock:
            value = fn(self._store.get_kv(key, default))
            data = encode_value(value, self._max)
            self._commit(lambda batch: batch.put_kv(key, data))
        return value


class TransactionKeyValue(_KVBase):
    """``message.kv``: like ``bus.kv``, with writes held until the handler's run commits."""

    def __init__(self, tx: "Transaction") -> None:
        self._tx = tx

    def get(self, key: str, default: Any = None) -> Any:
        tx = self._tx
        check_key(key)
        if key in tx.writes:
            data = tx.writes[key]
            return default if data is None else decode_payload(data)
        return tx.store.get_kv(key, default)

    def items(self, prefix: str = "") -> list[tuple[str, Any]]:
        tx = self._tx
        found = dict(tx.store.kv_items(prefix))
        for key, data in tx.writes.items():
            if key.startswith(prefix):
                if data is None:
                    found.pop(key, None)
                else:
                    found[key] = decode_payload(data)
        return sorted(found.items())

    def put(self, key: str, value: Any) -> None:
        self._tx.writes[check_key(key)] = encode_value(value, self._tx.max_value)

    def delete(self, key: str) -> None:
        self._tx.writes[check_key(key)] = None

    def update(self, key: str, fn: Callable[[Any], Any], default: Any = None) -> None:
        """At the commit, set ``key`` to ``fn(its value then, or default)``, with no other
        ``update`` in between (see the module docstring). Its value is not known before."""
        if not callable(fn):
            raise ValueError(f"update needs a callable, not {fn!r}")
        self._tx.updates.append((check_key(key), fn, default))


class Transaction:
    """What one handler's run (or one ``bus.transaction()``) stages: state writes, events,
    commands. ``kv``, ``publish`` and ``send`` check their input at once, as ``Bus`` does."""

    __slots__ = ("store", "max_value", "writes", "updates", "events", "sends", "letters", "_kv",
                 "_outgoing", "_admit")

    def __init__(self, store: Any, max_value: int,
                 outgoing: Callable[[str, str, dict[str, Any] | None], dict[str, Any] | None] | None = None,
                 admit: Callable[[str, int], None] | None = None) -> None:
        self.store = store
        self.max_value = max_value
        # The hooks' say on a message's headers (hooks/base.py, Hooks.outgoing): tracing puts
        # the current span's context in them.
        self._outgoing = outgoing
        # Backpressure (topic, priority), applied once an event is found valid: it may wait
        # for room or raise BacklogFull, as a publish does.
        self._admit = admit
        self.writes: dict[str, bytes | None] = {}  # key -> encoded value, None: deleted
        self.updates: list[tuple[str, Callable[[Any], Any], Any]] = []
        self.events: list[StagedEvent] = []
        self.sends: list[OutboxSend] = []
        self.letters: list[dict[str, Any]] = []  # dead letters (stage_deadletter)
        self._kv: TransactionKeyValue | None = None

    @property
    def kv(self) -> TransactionKeyValue:
        if self._kv is None:
            self._kv = TransactionKeyValue(self)
        return self._kv

    def publish(self, topic: str, payload: Any, *, ttl: float | None = None,
                headers: dict[str, Any] | None = None, key: str | None = None,
                delay: float | None = None, deliver_at: Any = None, priority: int = 0) -> None:
        """Stage an event (``Bus.publish``'s options but ``dedupe_key``); its id is made
        when the transaction commits."""
        event = prepare_event(topic, [payload], max_payload=self.max_value, ttl=ttl,
                              headers=headers, key=key, delay=delay, deliver_at=deliver_at,
                              priority=priority)
        if self._admit is not None:
            self._admit(topic, event.priority)
        headers = event.headers if self._outgoing is None else self._outgoing("event", topic, event.headers)
        self.events.append(StagedEvent(topic, event.bodies[0], event.expires, headers, event.due,
                                       event.priority))

    def send(self, address: str, command: str, payload: Any, *, ttl: float | None = None,
             headers: dict[str, Any] | None = None, delay: float | None = None,
             deliver_at: Any = None) -> None:
        """Stage a command (``Bus.send``'s options)."""
        cmd = prepare_command(address, command, payload, max_payload=self.max_value, ttl=ttl,
                              headers=headers, due=due_ms(delay, deliver_at))
        if self._outgoing is not None:
            cmd = cmd._replace(headers=self._outgoing("command", command, cmd.headers))
        self.sends.append(cmd)

    def stage_deadletter(self, letter: dict[str, Any]) -> None:
        """Stage a dead letter (a record from ``letters.py``), stored under a new id with the
        rest: what a ``bus.transaction()`` was given that can never be a message (a
        ``SqlOutbox`` row), kept for an operator in the same write as what it goes with."""
        self.letters.append(letter)

    def empty(self) -> bool:
        return not (self.writes or self.updates or self.events or self.sends or self.letters)

    def resolve_updates(self) -> None:
        """Run the ``update`` functions on the values in the store (this run's own writes
        applied) and stage their results as writes. The caller holds the kv lock until
        the batch is written; a function that raises fails the run like its handler."""
        for key, fn, default in self.updates:
            if key not in self.writes:
                value = self.store.get_kv(key, default)
            else:
                staged = self.writes[key]
                value = default if staged is None else decode_payload(staged)
            self.writes[key] = encode_value(fn(value), self.max_value)
        self.updates.clear()

    def write_state(self, batch: Any) -> None:
        for key, data in self.writes.items():
            if data is None:
                batch.delete_kv(key)
            else:
                batch.put_kv(key, data)

    def write_sends(self, batch: Any, message_id: str, part: str) -> list[tuple[str, OutboxSend]]:
        """Put the commands into the outbox under ``message_id`` and ``part`` (which of its
        handlers sent them); returns (outbox key, command) of each."""
        out = []
        for seq, send in enumerate(self.sends):
            name = f"{part}:{seq:06d}"
            batch.put_outbox(message_id, name, send)
            out.append((f"{message_id}\x00{name}", send))
        return out
