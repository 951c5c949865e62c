"""Keys and values of the store: keyspace prefixes and how records are packed.

Only the ``store`` package builds or splits keys; see its docstring for the layout.
"""

from __future__ import annotations

from typing import Any

import msgpack

from ..model.packer import pack

__all__ = ["FORMAT_VERSION", "SEP", "KEYSPACES", "keyspace_of", "split_pair", "split_stamped", "stamped_name",
           "split_seq", "seq_name", "record_key"]

# 2: handled ids carry bus-clock time and are indexed by it (t/); journal segments (g/).
# 3: messages are stored, sent, acknowledged and deduplicated by segment (model/segments.py):
#    o/ and n/ hold one record per segment; c/ how far runs of a segment got.
FORMAT_VERSION = 3
SEP = b"\x00"

KEYSPACES = {
    "meta": b"m/",
    "subscriptions": b"s/",
    "intents": b"i/",
    "outgoing": b"o/",
    "deliveries": b"d/",
    "incoming": b"n/",
    "runstate": b"r/",
    "handled": b"h/",
    "deadletters": b"x/",
    "replies": b"y/",
    "journal": b"j/",
    "handled_index": b"t/",
    "segments": b"g/",
    "publish_keys": b"p/",  # publish(dedupe_key=): key -> [message id, bus-clock ms]
    "publish_keys_index": b"q/",  # the same by time, for pruning: time + key -> b""
    "kv": b"v/",  # bus.kv / message.kv: the service's own state, key -> msgpack value
    "outbox": b"u/",  # commands a handler sent, committed with it: handled id, seq -> OutboxSend
    "progress": b"c/",  # runs of a received segment: key, start index -> Progress
}
_M, _S, _I, _O, _D, _N, _R, _H, _X, _Y, _J, _T, _G, _P, _Q, _V, _U, _C = (KEYSPACES[k] for k in (
    "meta", "subscriptions", "intents", "outgoing", "deliveries", "incoming", "runstate",
    "handled", "deadletters", "replies", "journal", "handled_index", "segments",
    "publish_keys", "publish_keys_index", "kv", "outbox", "progress"))
_KEYSPACE_OF = {prefix: name for name, prefix in KEYSPACES.items()}
_PREFIX_LEN = 2  # every prefix: one letter and "/"


_pack = pack


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _pair(prefix: bytes, a: str, b: str) -> bytes:
    return prefix + a.encode() + SEP + b.encode()


def _split(key: bytes, prefix_len: int) -> tuple[str, str]:
    a, _, b = key[prefix_len:].partition(SEP)
    return a.decode(), b.decode()


def _start(index: int) -> str:
    """A run's start index as it is kept in a progress key (fixed width: keys sort by it)."""
    return f"{index:05d}"


def _end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])


# --- records by keyspace and name --------------------------------------------------------------
# For the tools that must see records undecoded (``servicebus check --repair``): a record's
# *name* is its key without the keyspace prefix, so that they never handle a prefix.


def keyspace_of(key: bytes) -> tuple[str | None, bytes]:
    """(keyspace, name) of a raw key; a key of no known keyspace is (None, the whole key)."""
    keyspace = _KEYSPACE_OF.get(key[:_PREFIX_LEN])
    return (None, key) if keyspace is None else (keyspace, key[_PREFIX_LEN:])


def record_key(keyspace: str | None, name: bytes) -> bytes:
    """The raw key of what ``keyspace_of`` split."""
    return name if keyspace is None else KEYSPACES[keyspace] + name


def split_pair(name: bytes) -> tuple[str, str]:
    """The two parts of a name in a keyspace keyed by pairs (subscriber and topic, peer and
    stream, stream and id, ...)."""
    return _split(name, 0)


def split_stamped(name: bytes) -> tuple[int, str]:
    """(time, id or key) of a name in an index keyspace (handled_index, publish_keys_index):
    8 bytes of bus-clock ms, big-endian so that the index is in time order, then the text."""
    return int.from_bytes(name[:8], "big"), name[8:].decode()


def stamped_name(at: int, text: str) -> bytes:
    """The name ``split_stamped`` splits."""
    return at.to_bytes(8, "big") + text.encode()


def split_seq(name: bytes) -> int:
    """The sequence number a journal record is named by."""
    return int.from_bytes(name, "big")


def seq_name(seq: int) -> bytes:
    """The name of journal record ``seq``."""
    return seq.to_bytes(8, "big")
