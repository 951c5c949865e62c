"""AsyncBus (issue 16): the same bus for asyncio code; async handlers run on the loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from servicebus import AsyncBus, RemoteError
from servicebus.testing import free_address

TOPIC = "user.signup"


def test_async_publish_and_an_async_handler_on_the_loop(tmp_path):
    async def main():
        loop_thread = threading.current_thread()
        async with AsyncBus(free_address(), tmp_path / "pub") as pub, \
                AsyncBus(free_address(), tmp_path / "sub") as sub:
            got, threads = [], []
            done = asyncio.Event()

            @sub.every(TOPIC)
            async def welcome(payload, message):
                await asyncio.sleep(0)  # really a coroutine, on the loop
                threads.append(threading.current_thread())
                got.append(payload)
                if len(got) == 3:
                    done.set()

            await sub.subscribe(pub.address, TOPIC, wait=10)
            ids = [await pub.publish(TOPIC, {"n": n}) for n in range(3)]
            await asyncio.wait_for(done.wait(), 10)
            assert await sub.drain(10)
            return ids, got, threads, loop_thread

    ids, got, threads, loop_thread = asyncio.run(main())
    assert len(set(ids)) == 3 and sorted(p["n"] for p in got) == [0, 1, 2]
    assert set(threads) == {loop_thread}


def test_an_async_handler_that_raises_is_retried_and_an_async_command_replies(tmp_path):
    async def main():
        async with AsyncBus(free_address(), tmp_path / "a", retry_initial=0.05, retry_max=0.05) as a, \
                AsyncBus(free_address(), tmp_path / "b") as b:
            attempts = []

            @a.handle("pricing.quote")
            async def quote(payload, message):
                return {"price": 10 * payload["qty"]}

            @a.handle("pricing.fail")
            async def fail(payload, message):
                raise ValueError("no price")

            @a.every("flaky.event")
            async def flaky(payload, message):
                attempts.append(message.attempt)
                if message.attempt < 3:
                    raise RuntimeError("not yet")

            assert await b.request(a.address, "pricing.quote", {"qty": 2}, timeout=10) == {"price": 20}
            with pytest.raises(RemoteError, match="no price"):
                await b.request(a.address, "pricing.fail", {}, timeout=10)
            await a.subscribe(b.address, "flaky.event", wait=10)
            await b.publish("flaky.event", 1)
            for _ in range(200):  # a condition with a deadline (10 s)
                if attempts == [1, 2, 3]:
                    break
                await asyncio.sleep(0.05)
            assert await a.drain(10)
            return attempts

    assert asyncio.run(main()) == [1, 2, 3]


def test_an_async_handlers_transaction_is_committed_with_its_completion(tmp_path):
    async def main():
        async with AsyncBus(free_address(), tmp_path / "pub") as pub, \
                AsyncBus(free_address(), tmp_path / "sub") as sub:
            @sub.every(TOPIC)
            async def count(payload, message):
                await asyncio.sleep(0)
                message.kv.update("count", lambda c: c + 1, 0)
                message.kv[f"n:{payload['n']}"] = message.attempt

            await sub.subscribe(pub.address, TOPIC, wait=10)
            for n in range(5):
                await pub.publish(TOPIC, {"n": n})
            for _ in range(500):
                if sub.bus.kv.get("count") == 5:
                    break
                await asyncio.sleep(0.02)
            return sub.bus.kv.get("count"), [k for k, _ in sub.bus.kv.items("n:")]

    count, keys = asyncio.run(main())
    assert count == 5 and keys == [f"n:{n}" for n in range(5)]



def _first_dead_letter(bus, seconds=10.0):
    async def wait():
        deadline = asyncio.get_running_loop().time() + seconds
        while asyncio.get_running_loop().time() < deadline:
            letters = await asyncio.to_thread(bus.deadletters)
            if letters:
                return letters[0]
            await asyncio.sleep(0.05)
        raise AssertionError(f"no dead letter within {seconds}s")
    return wait()


def test_an_async_handler_past_its_timeout_is_cancelled_and_counted_as_a_failed_attempt(tmp_path):
    async def main():
        async with AsyncBus(free_address(), tmp_path / "pub") as pub, \
                AsyncBus(free_address(), tmp_path / "sub", retry_initial=0.05, retry_max=0.05,
                         max_attempts=2) as sub:
            cancelled = []

            @sub.every(TOPIC, timeout=0.3)
            async def hangs(payload, message):
                try:
                    await asyncio.sleep(60)  # hung: only the time limit ends it
                except asyncio.CancelledError:
                    cancelled.append(message.attempt)
                    raise

            await sub.subscribe(pub.address, TOPIC, wait=10)
            started = asyncio.get_running_loop().time()
            await pub.publish(TOPIC, {"n": 1})
            letter = await _first_dead_letter(sub.bus)
            return letter, cancelled, asyncio.get_running_loop().time() - started

    letter, cancelled, took = asyncio.run(main())
    assert cancelled == [1, 2]  # each coroutine itself was stopped, not left running on the loop
    assert letter.attempts == 2 and "HandlerTimeout" in letter.error
    assert "ran longer than its timeout of 0.3s" in letter.error
    assert took < 5, f"dead letter {took:.1f}s after the publish: the limit did not hold"


def test_an_async_handlers_own_timeout_error_is_a_plain_failure_not_the_time_limit(tmp_path):
    async def main():
        async with AsyncBus(free_address(), tmp_path / "pub") as pub, \
                AsyncBus(free_address(), tmp_path / "sub", max_attempts=1) as sub:
            @sub.every(TOPIC, timeout=30)
            async def own_timeout(payload, message):
                async with asyncio.timeout(0.01):
                    await asyncio.sleep(5)

            await sub.subscribe(pub.address, TOPIC, wait=10)
            await pub.publish(TOPIC, {"n": 1})
            return await _first_dead_letter(sub.bus)

    letter = asyncio.run(main())
    assert letter.error.startswith("TimeoutError"), letter.error


def test_an_async_handler_raising_system_exit_fails_its_attempt_and_leaves_the_loop_running(tmp_path):
    async def main():
        async with AsyncBus(free_address(), tmp_path / "pub") as pub, \
                AsyncBus(free_address(), tmp_path / "sub", retry_initial=0.05, retry_max=0.05) as sub:
            attempts = []
            done = asyncio.Event()

            @sub.every(TOPIC)
            async def exits_once(payload, message):
                attempts.append(message.attempt)
                if message.attempt == 1:
                    raise SystemExit("from a coroutine")
                done.set()

            await sub.subscribe(pub.address, TOPIC, wait=10)
            await pub.publish(TOPIC, 1)
            await asyncio.wait_for(done.wait(), 10)
            assert await sub.drain(10)
            return attempts, (await sub.status()).incoming

    assert asyncio.run(main()) == ([1, 2], 0)


def test_async_bus_has_the_calls_of_bus_kv_transaction_once_counters_deadletters(tmp_path):
    async def main():
        async with AsyncBus(free_address(), tmp_path / "pub", max_attempts=1) as pub, \
                AsyncBus(free_address(), tmp_path / "sub", max_attempts=1) as sub:
            sub.every("orders.bad", lambda p, m: 1 / 0)
            sub.every("orders.placed", lambda p, m: None)
            sub.handle("price", lambda p, m: p * 2)
            await sub.subscribe(pub.address, "orders.>", wait=10)
            waiting = asyncio.ensure_future(sub.once("orders.placed", timeout=10))
            async with pub.transaction() as tx:
                tx.kv.put("order:1", {"state": "placed"})
                tx.publish("orders.placed", {"id": 1})
            with pytest.raises(KeyError):
                async with pub.transaction() as tx:
                    tx.kv.put("order:2", {"state": "placed"})
                    raise KeyError("nothing stored")
            payload, message = await waiting
            assert payload == {"id": 1} and message.topic == "orders.placed"
            assert await pub.kv.get("order:1") == {"state": "placed"} and await pub.kv.get("order:2") is None
            await pub.kv.put("order:2", 2)
            assert await pub.kv.items("order:") == [("order:1", {"state": "placed"}), ("order:2", 2)]
            assert await pub.request_async(sub.address, "price", 21, timeout=10) == 42
            await pub.publish("orders.bad", 1)
            assert await pub.drain(10)  # acked: stored at sub, so sub's drain waits for it
            assert await sub.drain(10)
            [letter] = await sub.deadletters()
            assert letter.topic == "orders.bad" and letter.reason == "handler_failed"
            assert (await pub.counters())["published"] >= 2 and not pub.closed
        assert pub.closed and sub.closed

    asyncio.run(main())
