"""Commands and request/reply between buses (some in real processes)."""

import threading
import time
from collections import Counter

import pytest

from servicebus import Bus, RemoteError, RequestTimeout
from servicebus.ops.admin import query_live
from servicebus.testing import free_address, wait_until


def test_request_round_trip_between_two_processes(make_bus, bus_process):
    server = bus_process("server", "--command", "pricing.quote")
    server.start()
    client = make_bus("client")
    reply = client.request(server.address, "pricing.quote", {"n": 7}, timeout=10)
    assert reply == {"n": 7, "pid": server.proc.pid}


@pytest.mark.slow
def test_a_thousand_concurrent_requests_each_get_their_own_reply(make_bus, bus_process):
    server = bus_process("server", "--command", "pricing.quote")
    server.start()
    client = make_bus("client")
    futures = [client.request_async(server.address, "pricing.quote", {"n": n}, timeout=60)
               for n in range(1000)]
    replies = [f.result(90) for f in futures]
    assert [r["n"] for r in replies] == list(range(1000))
    assert client.drain(10)


def test_a_raising_handler_becomes_remote_error_with_type_and_text(make_bus):
    server, client = make_bus("server"), make_bus("client")

    @server.handle("pricing.quote")
    def quote(payload, message):
        raise LookupError(f"no price for {payload['sku']}")

    with pytest.raises(RemoteError) as info:
        client.request(server.address, "pricing.quote", {"sku": "x"}, timeout=10)
    assert info.value.remote_type == "LookupError"
    assert info.value.remote_message == "no price for x"
    assert server.status().deadletters == 0  # the error went back; nothing is retried


def test_unencodable_reply_becomes_remote_type_error(make_bus):
    server, client = make_bus("server"), make_bus("client")
    server.handle("q", lambda p, m: {1, 2})
    with pytest.raises(RemoteError) as info:
        client.request(server.address, "q", None, timeout=10)
    assert info.value.remote_type == "TypeError"


def test_a_request_that_timed_out_while_its_receiver_was_down_never_runs(make_bus, bus_process):
    # The caller was told it failed (RequestTimeout): two payments authorised that the
    # caller believes failed is the bug this guards against (issue 26).
    server = bus_process("server", "--command", "pricing.quote")
    client = make_bus("client")
    with pytest.raises(RequestTimeout):
        client.request(server.address, "pricing.quote", {"n": 1}, timeout=0.5)
    server.start()
    # A later request on the same stream is answered: the first was dropped before it.
    assert client.request(server.address, "pricing.quote", {"n": 2}, timeout=10)["n"] == 2
    wait_until(lambda: client.drain(0.1), 10)
    wait_until(lambda: query_live(server.datadir, "status", {})[0]["incoming"] == 0, 10)
    assert server.done_counts() == Counter({2: 1})
    status = client.status()
    assert (status.incoming, status.deadletters) == (0, 0)
    assert client.counters()["requests_expired"] == 1


def test_a_request_waiting_for_a_handler_past_its_timeout_never_runs(make_bus):
    server, client = make_bus("server"), make_bus("client")
    reply = client.request_async(server.address, "pricing.quote", {"n": 1}, timeout=2)
    wait_until(lambda: server.status().incoming == 1, 10)  # delivered: it waits for a handler
    with pytest.raises(RequestTimeout):
        reply.result(10)
    wait_until(lambda: server.status().incoming == 0, 10)  # dropped when it expired
    ran = []
    server.handle("pricing.quote", lambda p, m: ran.append(p))
    assert server.drain(5) and ran == [] and server.status().deadletters == 0
    assert server.counters()["requests_expired"] == 1


def test_a_request_with_a_ttl_longer_than_its_timeout_runs_after_the_timeout(make_bus, bus_process):
    server = bus_process("server", "--command", "pricing.quote")
    client = make_bus("client")
    with pytest.raises(RequestTimeout):
        client.request(server.address, "pricing.quote", {"n": 1}, timeout=0.5, ttl=60)
    server.start()
    wait_until(lambda: server.done_counts()[1] == 1, 20, message="the timed-out command handled")
    # Its late reply is dropped, never handed to a later request.
    assert client.request(server.address, "pricing.quote", {"n": 2}, timeout=10)["n"] == 2
    wait_until(lambda: client.drain(0.1), 10)
    assert client.status().incoming == 0


def test_commands_sent_while_receiver_down_are_handled_once_after_it_starts(make_bus, bus_process):
    server = bus_process("server", "--command", "audit.record")
    client = make_bus("client")
    ids = [client.send(server.address, "audit.record", {"n": n}) for n in range(200)]
    assert len(set(ids)) == 200 and client.status().pending == 200
    server.start()
    wait_until(lambda: len(server.done_counts()) == 200, 30,
               message=lambda: f"{len(server.done_counts())} of 200")
    assert set(server.done_counts().values()) == {1}
    assert client.drain(10)


def test_command_that_expires_before_delivery_is_dead_lettered_at_the_sender(make_bus, tmp_path):
    address = free_address()
    client = make_bus("client")
    expired_at = time.time() + 0.2
    mid = client.send(address, "audit.record", {"n": 1}, ttl=0.2)
    wait_until(lambda: time.time() > expired_at + 0.05, 2)  # the condition is the TTL itself
    server = make_bus("server", address)  # comes up after the TTL passed
    handled = []
    server.handle("audit.record", lambda p, m: handled.append(p))
    wait_until(lambda: client.status().deadletters == 1, 10)
    letter = dict(client._store.deadletters())[mid]
    assert letter["reason"] == "expired" and letter["peer"] == address
    assert client.drain(5) and handled == []


def test_command_waiting_for_a_handler_expires_at_the_receiver(make_bus):
    server, client = make_bus("server"), make_bus("client")
    mid = client.send(server.address, "audit.record", {"n": 1}, ttl=0.5)
    wait_until(lambda: server.status().incoming == 1, 10)
    wait_until(lambda: server.status().deadletters == 1, 10)
    assert dict(server._store.deadletters())[mid]["reason"] == "expired"
    handled = []
    server.handle("audit.record", lambda p, m: handled.append(p))
    assert server.drain(5) and handled == []


def test_command_without_a_handler_is_kept_until_one_registers(make_bus):
    server, client = make_bus("server"), make_bus("client")
    client.send(server.address, "audit.record", {"who": 42}, headers={"trace": "t1"})
    wait_until(lambda: server.status().incoming == 1, 10)
    assert client.drain(5)  # delivered and acked: it is the receiver's now
    assert not server.drain(0.3)  # but not handled, and not silently dropped
    got = []
    server.handle("audit.record", lambda p, m: got.append((p, dict(m.headers), m.kind)))
    wait_until(lambda: got, 10)
    assert got == [({"who": 42}, {"trace": "t1"}, "command")]
    assert server.drain(5)


def test_a_command_has_one_handler(make_bus):
    bus = make_bus("a")
    bus.handle("x", lambda p, m: None)
    with pytest.raises(ValueError, match="already has a handler"):
        bus.handle("x", lambda p, m: None)


def test_send_arguments_are_validated(make_bus):
    bus = make_bus("a")
    with pytest.raises(ValueError):
        bus.send("nope", "x", 1)
    with pytest.raises(ValueError):
        bus.send(free_address(), "", 1)
    with pytest.raises(ValueError):
        bus.send(free_address(), "x", 1, ttl=0)
    with pytest.raises(TypeError):
        bus.send(free_address(), "x", 1, headers={1: "a"})
    with pytest.raises(TypeError):
        bus.send(free_address(), "x", object())
    with pytest.raises(ValueError):
        bus.request(free_address(), "x", 1, timeout=-1)
    assert bus.status().outgoing == 0


def test_a_failing_sent_command_is_retried_then_dead_lettered(make_bus):
    server = make_bus("server", max_attempts=2, retry_initial=0.01)
    client = make_bus("client")
    calls = Counter()

    @server.handle("audit.record")
    def fail(payload, message):
        calls[message.attempt] += 1
        raise RuntimeError("disk full")

    mid = client.send(server.address, "audit.record", 1)
    wait_until(lambda: server.status().deadletters == 1, 10)
    assert calls == {1: 1, 2: 1}
    assert dict(server._store.deadletters())[mid]["error"] == "RuntimeError: disk full"


@pytest.mark.slow
def test_a_reply_for_a_caller_that_restarted_is_dropped_not_kept_for_ever(make_bus, bus_process):
    server = make_bus("server")
    release = threading.Event()
    server.handle("slow.job", lambda p, m: release.wait(30) and {"done": True})
    client = bus_process("client")
    client.start("--request", server.address, "slow.job")
    wait_until(lambda: server.status().incoming == 1, 10)  # the request is being handled
    client.kill()
    release.set()
    client.start()  # a new run of the caller: nobody waits for that reply any more
    wait_until(lambda: server.drain(0.1), 20)
    wait_until(lambda: query_live(client.datadir, "status", {})[0]["handled"] == 1, 10,
               message="the orphaned reply taken out of the caller's incoming store")
    client.stop()
    with Bus(free_address(), client.datadir) as reopened:
        assert (reopened.status().incoming, reopened.status().deadletters) == (0, 0)
