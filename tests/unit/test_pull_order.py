"""Pull subscribers read their messages in publish order (ids increase in publish order),
whatever order the pull bus's handler threads queue them in and whether a read comes
before a handler's write has landed. No sockets: the queues over a dict as the kv."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

pytest.importorskip("aiohttp", reason="the gateway needs aiohttp (the gateway extra)")

from servicebus.gateway.pull import PullQueues, Sub  # noqa: E402


class _Kv(dict):
    def delete(self, key: str) -> None:
        self.pop(key, None)


def _queues() -> tuple[PullQueues, _Kv]:
    kv = _Kv()

    @contextmanager
    def transaction():
        yield SimpleNamespace(kv=kv)

    pull = SimpleNamespace(kv=kv, transaction=transaction)
    return PullQueues(pull, "tcp://127.0.0.1:1", loop=None), kv  # type: ignore[arg-type]


async def _run(fn, *args):
    return fn(*args)


def _land(kv: _Kv, sub: Sub, mid: str) -> None:
    kv[sub.msg_key(mid)] = {"payload": mid, "attempts": 0, "visible_at": 0.0}


def _read(queues: PullQueues, sub: Sub, limit: int) -> list[str]:
    return [m["id"] for m in asyncio.run(queues.read(sub, limit, _run))]


def test_messages_queued_out_of_order_by_handler_threads_are_read_in_publish_order():
    queues, kv = _queues()
    sub = Sub("t", "s")
    for mid in ("id-2", "id-1", "id-4", "id-3"):  # handler threads finishing in any order
        _land(kv, sub, mid)
        queues._arrived([sub], mid)
    assert _read(queues, sub, 10) == ["id-1", "id-2", "id-3", "id-4"]


def test_a_message_whose_write_has_not_landed_keeps_its_place_ahead_of_later_ones():
    queues, kv = _queues()
    sub = Sub("t", "s")
    for mid in ("id-1", "id-2", "id-3"):
        queues._arrived([sub], mid)
    for mid in ("id-2", "id-3"):
        _land(kv, sub, mid)
    # id-1's handler has queued it but not returned: a read does not hand out id-2 first
    assert _read(queues, sub, 1) == []
    _land(kv, sub, "id-1")
    assert _read(queues, sub, 1) == ["id-1"]
    assert _read(queues, sub, 5) == ["id-2", "id-3"]


def test_a_late_message_far_behind_a_long_backlog_is_queued_without_walking_all_of_it():
    queues, kv = _queues()
    sub = Sub("t", "s")
    backlog = [f"id-{n:06d}" for n in range(1, 5001)]
    for mid in backlog:
        _land(kv, sub, mid)
        queues._arrived([sub], mid)
    _land(kv, sub, "id-000000")  # an old one from a publisher that was down: read last
    queues._arrived([sub], "id-000000")
    got = _read(queues, sub, 6000)
    assert sorted(got) == sorted(backlog + ["id-000000"]) and got[:3] == backlog[:3]


def test_a_message_whose_write_never_lands_stops_holding_up_the_ones_behind_it(monkeypatch):
    import servicebus.gateway.pull as pull

    monkeypatch.setattr(pull, "HOLD_PLACE", 0.0)  # its place held no longer: as after 2 s
    queues, kv = _queues()
    sub = Sub("t", "s")
    for mid in ("id-1", "id-2"):
        queues._arrived([sub], mid)
    _land(kv, sub, "id-2")  # id-1's handler keeps failing: its write never lands
    assert _read(queues, sub, 1) == []
    assert _read(queues, sub, 1) == ["id-2"], "one reading a message at a time is not stuck"
