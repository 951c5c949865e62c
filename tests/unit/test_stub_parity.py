"""The test doubles at parity with the buses they stand in for: every public call of ``Bus``
on ``StubBus``, of ``AsyncBus`` on ``AsyncStubBus``; ``async def`` handlers awaited; and a
``drain()`` that says what is left and why."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from servicebus import AsyncBus, Bus, RemoteError, WaitTimeout
from servicebus.testing import AsyncStubBus, StubBus

ADDRESS = "tcp://127.0.0.1:9"
INSTANCE = {"kv", "address"}  # set in __init__: not in dir() of the class


def public(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")} | INSTANCE


def test_the_stub_has_every_public_call_of_bus():
    assert public(Bus) - public(StubBus) == set()


def test_async_bus_has_every_public_call_of_bus():
    assert public(Bus) - public(AsyncBus) == set()


def test_the_async_stub_has_every_public_call_of_async_bus_and_awaits_where_it_awaits():
    assert public(AsyncBus) - public(AsyncStubBus) == set()
    for name in public(AsyncBus) - INSTANCE:
        real, stub = getattr(AsyncBus, name), getattr(AsyncStubBus, name)
        if callable(real):
            assert inspect.iscoroutinefunction(real) == inspect.iscoroutinefunction(stub), name


def test_an_async_def_handler_is_awaited_by_drain_and_its_failure_is_retried():
    stub = StubBus(max_attempts=3)
    runs = []

    @stub.every("orders.placed")
    async def place(payload, message):
        await asyncio.sleep(0)
        runs.append(message.attempt)
        if message.attempt == 1:
            raise RuntimeError("first run fails")

    stub.publish("orders.placed", {"n": 1})
    assert not stub.drain() and runs == [1]
    stub.advance(1)
    assert stub.drain() and runs == [1, 2]
    assert stub.counters()["handled"] == 1 and stub.counters()["retried"] == 1
    stub.close()


def test_drain_inside_a_running_loop_says_to_await_drain_async_and_loses_nothing():
    stub = StubBus()
    seen = []

    @stub.every("orders.placed")
    async def place(payload, message):
        seen.append((payload, asyncio.get_running_loop()))

    async def main():
        stub.publish("orders.placed", 1)
        with pytest.raises(RuntimeError, match=r"await stub.drain_async\(\)"):
            stub.drain()
        assert seen == [] and stub.pending() == 1
        assert await stub.drain_async()
        return asyncio.get_running_loop()

    loop = asyncio.run(main())
    assert seen == [(1, loop)]  # on the test's own loop


def test_drain_says_which_topics_nothing_handles_and_which_retries_wait_for_the_clock():
    stub = StubBus()
    stub.every("orders.placed", lambda p, m: m.publish("email.queued", p))
    stub.every("orders.failed", lambda p, m: 1 / 0)
    stub.publish("orders.placed", 1)
    stub.publish("orders.failed", 2)
    drained = stub.drain()
    assert not drained
    text = repr(drained)
    assert "1 x event 'email.queued': no handler on this stub" in text
    assert "1 x event 'orders.failed': a retry due in 0.1 s" in text and "advance()" in text
    stub.every("email.queued", lambda p, m: None)
    stub.advance(60)
    stub.drain()
    stub.advance(60)
    stub.drain()
    stub.advance(60)
    stub.drain()
    stub.advance(60)
    assert stub.drain(), stub.drain()
    assert repr(stub.drain()) == "Drained(nothing left)"


def test_once_any_and_all_return_the_events_a_drain_ran():
    stub = StubBus()
    stub.every("orders.placed", lambda p, m: m.publish("orders.paid", p + 1))
    stub.publish("orders.placed", 1)
    payload, message = stub.once("orders.paid")
    assert payload == 2 and message.topic == "orders.paid" and message.attempt == 0
    with pytest.raises(WaitTimeout, match="orders.shipped"):
        stub.once("orders.shipped", timeout=1)
    stub.publish("orders.placed", 5)
    got = stub.all(["orders.placed", "orders.*"])
    assert got["orders.placed"][0] == 5 and got["orders.*"][0] == 5
    stub.publish("audit.x", 7)
    assert stub.any(["nothing.here", "audit.>"])[:2] == ("audit.>", 7)


def test_a_stub_transaction_applies_everything_or_nothing():
    stub = StubBus()
    with stub.transaction() as tx:
        tx.kv.put("order:1", {"state": "paid"})
        tx.publish("orders.paid", {"id": 1})
        tx.send(ADDRESS, "invoice.create", {"id": 1})
    assert stub.kv.get("order:1") == {"state": "paid"}
    assert [s.topic for s in stub.published] == ["orders.paid"] and [s.topic for s in stub.sent] == ["invoice.create"]
    with pytest.raises(KeyError):
        with stub.transaction() as tx:
            tx.kv.put("order:2", 1)
            tx.publish("orders.paid", {"id": 2})
            raise KeyError("boom")
    assert stub.kv.get("order:2") is None and len(stub.published) == 1
    with pytest.raises(ValueError):
        with stub.transaction() as tx:
            tx.publish("orders.*", 1)  # checked at once, as on a bus


def test_counters_are_present_from_zero_and_count_what_happened():
    stub = StubBus(max_attempts=1)
    assert stub.counters() == {"published": 0, "sent": 0, "handled": 0, "failed": 0, "retried": 0,
                               "rejected": 0, "deadletters": 0, "expired": 0}
    stub.every("a", lambda p, m: None)
    stub.every("b", lambda p, m: 1 / 0)
    stub.publish("a", 1)
    stub.publish("b", 1)
    stub.drain()
    counts = stub.counters()
    assert (counts["published"], counts["handled"], counts["failed"], counts["deadletters"]) == (2, 1, 1, 1)
    status = stub.status()
    assert status.running and status.deadletters == 1 and status.incoming == 0


def test_request_async_on_the_stub_is_a_done_future_with_the_value_or_the_remote_error():
    stub = StubBus()
    stub.handle("price", lambda p, m: p * 2)
    stub.handle("broken", lambda p, m: 1 / 0)
    assert stub.request_async(ADDRESS, "price", 21).result(0) == 42
    with pytest.raises(RemoteError):
        stub.request_async(ADDRESS, "broken", 1).result(0)


def test_the_async_stub_runs_code_written_for_async_bus():
    async def main():
        async with AsyncStubBus() as bus:
            got = []

            @bus.every("orders.placed")
            async def place(payload, message):
                got.append(payload)
                message.publish("orders.paid", payload)

            bus.every("orders.paid", lambda p, m: None)

            @bus.handle("price")
            async def price(payload, message):
                await asyncio.sleep(0)
                return payload * 2

            await bus.publish("orders.placed", 1)
            assert await bus.drain()
            assert got == [1] and [s.topic for s in bus.published] == ["orders.placed", "orders.paid"]
            assert await bus.request(ADDRESS, "price", 4) == 8
            async with bus.transaction() as tx:
                tx.kv.put("k", 1)
            assert await bus.kv.get("k") == 1
            await bus.kv.put("k", 2)
            assert await bus.kv.get("k") == 2
            await bus.publish("orders.placed", 3)
            payload, _ = await bus.once("orders.paid", timeout=1)
            assert payload == 3
            assert (await bus.counters())["handled"] == 4
        assert bus.closed

    asyncio.run(main())
