"""Pull subscribers read their messages in publish order (ids increase in publish order),
whatever order the pull bus's handler threads queue them in and whether a read comes
before a handler's write has landed. No sockets: the queues over a dict as the kv."""

from __future__ import annotations

import asyncio
import time
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


def _first_not_landed() -> tuple[PullQueues, _Kv, Sub]:
    """id-1, id-2, id-3 queued by their handlers; id-1's write has not landed yet."""
    queues, kv = _queues()
    sub = Sub("t", "s")
    for mid in ("id-1", "id-2", "id-3"):
        queues._arrived([sub], mid)
    for mid in ("id-2", "id-3"):
        _land(kv, sub, mid)
    return queues, kv, sub


def test_a_message_whose_write_has_not_landed_keeps_its_place_ahead_of_later_ones():
    queues, kv, sub = _first_not_landed()
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


# Found by a hostile review (helper-32), each seen failing on the first version of make_ready/read.
def test_a_held_message_keeps_its_place_when_a_read_asks_for_more_than_one():
    queues, kv, sub = _first_not_landed()
    # id-1's write has not landed: with max=10 the later ones must not be handed out first
    got = _read(queues, sub, 10)
    _land(kv, sub, "id-1")
    got += _read(queues, sub, 10)
    assert got == ["id-1", "id-2", "id-3"]


def test_a_held_message_keeps_its_place_ahead_of_a_backlog_longer_than_reorder():
    queues, kv = _queues()
    sub = Sub("t", "s")
    ids = [f"id-{n:06d}" for n in range(1000)]
    for mid in ids:
        queues._arrived([sub], mid)
        if mid != ids[0]:
            _land(kv, sub, mid)
    assert _read(queues, sub, 1) == []  # id-000000 not landed yet: held
    _land(kv, sub, ids[0])
    assert _read(queues, sub, 1) == [ids[0]]


def test_a_read_that_fails_before_its_commit_leaves_its_messages_readable():
    # e.g. the push loop's task cancelled by sync() while it awaits the fetch (a push
    # subscriber changed to a pull one), or a kv read error
    queues, kv = _queues()
    sub = Sub("t", "s")
    for mid in ("id-1", "id-2"):
        _land(kv, sub, mid)
        queues._arrived([sub], mid)

    async def cancelled(fn, *args):
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(queues.read(sub, 10, cancelled))
    assert _read(queues, sub, 10) == ["id-1", "id-2"]


def test_a_message_due_for_dead_letter_is_not_stranded_when_the_commit_fails():
    queues, kv = _queues()
    sub = Sub("t", "s", max_attempts=1, visibility=0.1)
    _land(kv, sub, "id-1")
    queues._arrived([sub], "id-1")
    assert _read(queues, sub, 10) == ["id-1"]  # its one attempt
    time.sleep(0.15)  # not acked: visible again, due for the dead letters

    async def disk_full(fn, *args):
        if fn == queues._commit:
            raise OSError("disk full")
        return fn(*args)

    with pytest.raises(OSError):
        asyncio.run(queues.read(sub, 10, disk_full))
    assert _read(queues, sub, 10) == []
    assert sub.dead == 1 and "id-1" not in sub.queue, (sub.dead, sub.queue, sub.ready, sub.later)


def test_an_ack_that_lands_while_a_read_commits_is_not_undone_in_the_kv():
    # reader 1 read id-1; its visibility ended and reader 2's read takes it again; reader 1's
    # ack lands while reader 2's read awaits its commit (a pool thread)
    queues, kv = _queues()
    sub = Sub("t", "s", visibility=0.1)
    _land(kv, sub, "id-1")
    queues._arrived([sub], "id-1")
    assert _read(queues, sub, 10) == ["id-1"]
    time.sleep(0.15)

    async def ack_meanwhile(fn, *args):
        if fn == queues._commit:
            queues.ack(sub, ["id-1"])
            queues.acked(sub, ["id-1"])
        return fn(*args)

    asyncio.run(queues.read(sub, 10, ack_meanwhile))
    assert sub.msg_key("id-1") not in kv  # else read again after a restart (load), acked or not
