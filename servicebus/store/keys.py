"""Keys and values of the store: keyspace prefixes and how records are packed.

Only the ``store`` package builds or splits keys; see its docstring for the layout.
"""

from __future__ import annotations

from typing import Any

import msgpack

from ..model.packer import pack

__all__ = ["FORMAT_VERSION", "SEP", "KEYSPACES"]

# 2: handled ids carry bus-clock time and are indexed by it (t/); journal segments (g/).
FORMAT_VERSION = 2
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
}
_M, _S, _I, _O, _D, _N, _R, _H, _X, _Y, _J, _T, _G, _P, _Q, _V, _U = (KEYSPACES[k] for k in (
    "meta", "subscriptions", "intents", "outgoing", "deliveries", "incoming", "runstate",
    "handled", "deadletters", "replies", "journal", "handled_index", "segments",
    "publish_keys", "publish_keys_index", "kv", "outbox"))


_pack = pack


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _pair(prefix: bytes, a: str, b: str) -> bytes:
    return prefix + a.encode() + SEP + b.encode()


def _split(key: bytes, prefix_len: int) -> tuple[str, str]:
    a, _, b = key[prefix_len:].partition(SEP)
    return a.decode(), b.decode()


def _end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])
