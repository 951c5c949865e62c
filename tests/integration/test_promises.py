"""Promises a line-by-line review of the durability paths found broken (issue 11), each
shown by the behaviour a user relies on: a bad address, a crash-looping handler, state
that must expire, TTLs while a receiver is down, refills, purges, handler names, frames
too big for the receiver, and the lifecycle's small print."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from servicebus import Bus, BusClosedError, LockedError
from servicebus.wire import protocol as P
from servicebus.wire.decoding import decode
from servicebus.wire.payload import encode_payload
from servicebus.store.lockfile import probe
from servicebus.testing import one_message, free_address, wait_until

CLI = str(Path(sys.executable).parent / "servicebus")
TOPIC = "user.signup"
LONG_IPC = "ipc:///run/" + "x" * 150


def cli(*args):
    return subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, timeout=60)


def raw_dealer(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


# --- 1. addresses ------------------------------------------------------------------------


def test_an_address_that_cannot_be_connected_is_refused_and_the_bus_goes_on(make_bus):
    bus = make_bus("a")
    with pytest.raises(ValueError, match="ipc"):
        bus.send(LONG_IPC, "c", 1)
    with pytest.raises(ValueError, match="ipc"):
        bus.subscribe(LONG_IPC, TOPIC)
    other = make_bus("b")
    got = []
    other.handle("c", lambda p, m: got.append(p))
    bus.send(other.address, "c", 2)
    wait_until(lambda: got == [2], 10)
    assert bus.status().running and bus.drain(10)


def test_a_subscribe_off_the_wire_naming_an_unconnectable_address_is_counted_malformed(make_bus):
    bus = make_bus("a")
    sock = raw_dealer(bus.address)
    try:
        sock.send_multipart(P.encode_subscribe("x1", TOPIC, LONG_IPC, "forger"))
        wait_until(lambda: bus.status().malformed_by_reason.get("bad_address") == 1, 10)
    finally:
        sock.close(linger=0)
    sub = make_bus("s")
    got = []
    sub.every(TOPIC, lambda p, m: got.append(p))
    sub.subscribe(bus.address, TOPIC, wait=10)
    bus.publish(TOPIC, 1)
    wait_until(lambda: got == [1], 10)
    assert bus.status().subscriptions == 1


def test_a_peer_whose_connect_fails_does_not_stop_the_engine(make_bus, monkeypatch):
    bus = make_bus("a")
    engine = bus._engine
    real = engine.sockets.ctx.socket

    class Refusing:
        def __init__(self, sock):
            self._sock = sock

        def connect(self, address):
            raise zmq.ZMQError(zmq.EINVAL)

        def __getattr__(self, name):
            return getattr(self._sock, name)

    monkeypatch.setattr(engine.sockets.ctx, "socket", lambda kind: Refusing(real(kind)))
    with pytest.raises(ValueError, match="cannot connect"):
        bus.send(free_address(), "c", 1)
    monkeypatch.undo()
    other = make_bus("b")
    got = []
    other.handle("c", lambda p, m: got.append(p))
    bus.send(other.address, "c", 2)
    wait_until(lambda: got == [2], 10)


# --- 2. a handler that kills the process ---------------------------------------------------


def test_a_handler_that_kills_its_process_every_time_is_dead_lettered_after_max_attempts(
        make_bus, bus_process):
    sub = bus_process("sub", "--command", "work", "--die-always-at", "7", "--max-attempts", "3")
    sub.start()
    sender = make_bus("sender")
    sender.send(sub.address, "work", {"n": 7})
    deaths = 0
    while True:
        code = sub.proc.wait(30) if deaths < 10 else None
        assert code == -9, "the handler was expected to kill its process"
        deaths += 1
        starts = [line for line in sub.lines("start")]
        sub.start(wait_ready=False)
        try:
            sub.proc.wait(5)
        except subprocess.TimeoutExpired:
            break  # it stays up: the message no longer runs
        assert deaths <= 5, f"still crash-looping after {deaths} runs: {starts}"
    sub.wait_ready()
    assert len(sub.lines("start")) == 3  # max_attempts runs, then no more
    sub.stop()
    rows = cli("deadletters", sub.datadir, "--json")
    assert rows.returncode == 0 and '"reason": "handler_crashed"' in rows.stdout


# --- 3. wake after shutdown ----------------------------------------------------------------


def test_waking_a_closed_bus_writes_into_no_file(make_bus, tmp_path):
    bus = make_bus("a")
    engine = bus._engine
    number = engine._wake_fd
    bus.close()
    target = tmp_path / "reused"
    fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.dup2(fd, number)  # a journal segment or a LevelDB log could get this number
        engine.wake()
        bus._engine.wake()
    finally:
        os.close(number)
        os.close(fd)
    assert target.read_bytes() == b""


# --- 4. repair and the lock ----------------------------------------------------------------


def test_repair_never_touches_a_store_another_process_has_open(make_bus, tmp_path):
    bus = make_bus("a")
    bus.close()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import plyvel, sys, time; db = plyvel.DB(sys.argv[1]); print('open', flush=True); "
        "time.sleep(60)"), str(tmp_path / "a" / "store")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        result = cli("check", tmp_path / "a", "--repair")
        assert result.returncode != 0
        assert "in use by another process" in result.stderr and result.returncode == 3
        assert not (tmp_path / "a" / "store" / "lost").exists()
    finally:
        holder.kill()
        holder.wait(10)
        holder.stdout.close()


# --- 6. pruning keeps up --------------------------------------------------------------------


def test_handled_ids_are_forgotten_as_fast_as_they_arrive_once_past_the_window(make_bus):
    sender = make_bus("s")
    receiver = make_bus("r", dedupe_window=1.0)
    receiver.every(TOPIC, lambda p, m: None)
    receiver.subscribe(sender.address, TOPIC, wait=10)
    for start in range(0, 24_000, 2000):
        sender.publish_many(TOPIC, list(range(start, start + 2000)))
    assert sender.drain(60) and receiver.drain(60)
    # 24k ids past a 1 s window: at 10k a minute this took more than two minutes.
    wait_until(lambda: receiver.status().handled == 0, 20, 0.2, "every handled id pruned")


# --- 7. per-address state expires ----------------------------------------------------------


def test_an_address_nothing_is_owed_to_is_forgotten_after_peer_expiry(make_bus):
    bus = make_bus("a", peer_expiry=0.5)
    other = make_bus("b")
    other.handle("c", lambda p, m: None)
    bus.send(other.address, "c", 1)
    assert bus.drain(10)
    wait_until(lambda: not bus.status().peers and bus._store.count("deliveries") == 0, 10,
               message="the peer and its delivery record forgotten")
    bus.send(other.address, "c", 2)  # and it comes back when needed
    assert bus.drain(10) and other.drain(10)


def test_a_reply_owed_to_a_caller_that_went_away_expires_and_drain_returns(make_bus):
    bus = make_bus("a", reply_ttl=1.0)
    bus.handle("ask", lambda p, m: p + 1)
    gone = free_address()  # a caller that bound a port and went away for good
    sock = raw_dealer(bus.address)
    try:
        env = one_message("0000000000000000000001", "ask", int(time.time() * 1000),
                         encode_payload(1), 1, None, "corr-1", None)
        sock.send_multipart(P.encode_batch(P.Kind.COMMAND, "caller", gone, [env], int(time.time() * 1000)))
        wait_until(lambda: bus.status().handled == 1, 10)
    finally:
        sock.close(linger=0)
    assert bus.drain(15)
    assert bus.status().deadletters == 1
    wait_until(lambda: bus.status().outgoing == 0, 5, message="the expired reply collected")


# --- 9. TTL while the receiver is down -----------------------------------------------------


def test_a_command_to_a_receiver_that_never_comes_up_expires_at_the_sender(make_bus):
    bus = make_bus("a")
    bus.send(free_address(), "c", 1, ttl=0.5)
    wait_until(lambda: bus.status().deadletters == 1, 10, message="the command dead-lettered")
    assert bus.drain(10)
    wait_until(lambda: bus.status().outgoing == 0, 5, message="the expired command collected")


# --- 10. refill --------------------------------------------------------------------------


def test_messages_nobody_handles_do_not_keep_later_messages_from_their_handlers(make_bus, tmp_path):
    address = free_address()
    make_bus("r", address=address).close()  # the receiver is down while they are sent
    sender = make_bus("s", ack_timeout=0.5)
    for n in range(40):
        sender.send(address, "nobody.handles.this", n, ttl=300)  # each waits for a handler or its TTL
    for n in range(5):
        sender.send(address, "work", n)
    # Up again: the backlog arrives in one frame, more than the queue holds.
    receiver = make_bus("r2", address=address, datadir=tmp_path / "r", dispatch_queue=10)
    got = []
    receiver.handle("work", lambda p, m: got.append(p))
    wait_until(lambda: sorted(got) == list(range(5)), 20, message="the work handled")


# --- 11. purge --subscriber ------------------------------------------------------------------


def test_a_purged_subscriber_gets_no_more_commands_and_replayed_ones_are_handled_once(
        make_bus, bus_process, tmp_path):
    sub = bus_process("sub", "--command", "work")
    sub.start()
    sender_dir = tmp_path / "sender"
    with Bus(free_address(), sender_dir, ack_timeout=0.5) as sender:
        for n in range(3):
            sender.send(sub.address, "work", {"n": n})
        wait_until(lambda: sorted(sub.done_counts()) == [0, 1, 2], 15)
        assert sender.drain(10)
        sub.kill()
        for n in range(3, 5):
            sender.send(sub.address, "work", {"n": n})
    removed = cli("purge", sender_dir, "--subscriber", sub.address, "--yes", "--json")
    assert removed.returncode == 0, removed.stderr
    assert '"moved_to_deadletters": 2' in removed.stdout
    sub.start()
    with Bus(free_address(), sender_dir, ack_timeout=0.5) as sender:
        assert sender.drain(5)
        assert sender.status().outgoing == 0
    assert cli("replay", sender_dir, "--all", "--json").returncode == 0
    with Bus(free_address(), sender_dir, ack_timeout=0.5) as sender:
        wait_until(lambda: sorted(sub.done_counts()) == [0, 1, 2, 3, 4], 15)
        assert sender.drain(10)
    assert set(sub.done_counts().values()) == {1}


# --- 12. handler names ---------------------------------------------------------------------


def _record(seen, payload, message):
    seen.append(payload)


def test_two_handlers_on_a_topic_need_names_that_outlive_a_restart(make_bus):
    bus = make_bus("a")
    bus.every(TOPIC, lambda p, m: None)
    with pytest.raises(ValueError, match="name="):
        bus.every(TOPIC, lambda p, m: None)
    with pytest.raises(ValueError, match="name="):
        bus.every(TOPIC, functools.partial(_record, []))
    bus.every(TOPIC, functools.partial(_record, []), name="recorder")
    with pytest.raises(ValueError, match="recorder"):
        bus.every(TOPIC, functools.partial(_record, []), name="recorder")
    bus.every("other.topic", functools.partial(_record, []))  # alone on its topic: no name needed


def test_a_finished_handler_does_not_run_again_after_a_restart(make_bus, tmp_path):
    pub = make_bus("pub")
    runs = {"first": 0, "second": 0}

    def first(payload, message):
        runs["first"] += 1

    def second(payload, message):
        runs["second"] += 1
        if runs["second"] == 1:
            raise RuntimeError("once")

    with Bus(free_address(), tmp_path / "sub", retry_initial=30.0, retry_max=30.0) as sub:
        sub.every(TOPIC, first, name="first")
        sub.every(TOPIC, second, name="second")
        sub.subscribe(pub.address, TOPIC, wait=10)
        pub.publish(TOPIC, 1)
        wait_until(lambda: runs == {"first": 1, "second": 1}, 10)
    with Bus(free_address(), tmp_path / "sub", retry_initial=0.1, retry_max=0.1) as sub:
        sub.every(TOPIC, second, name="second")  # registered in the other order this time
        sub.every(TOPIC, first, name="first")
        wait_until(lambda: runs["second"] == 2, 40)
        assert sub.drain(10)
    assert runs == {"first": 1, "second": 2}


# --- 14. frames sized by bytes, NACK ------------------------------------------------------


def test_large_messages_go_in_frames_the_receiver_accepts_without_resends(make_bus, tmp_path):
    address = free_address()
    make_bus("r", address=address).close()  # down while they are sent: they go as a backlog
    sender = make_bus("s", max_payload=1 << 20, ack_timeout=5.0)
    for _ in range(60):
        sender.send(address, "big", b"x" * 300_000)
    receiver = make_bus("r2", address=address, datadir=tmp_path / "r", max_payload=1 << 20)
    got = []
    receiver.handle("big", lambda p, m: got.append(len(p)))
    wait_until(lambda: len(got) == 60, 30, message="60 large commands")
    assert sender.counters().get("resent", 0) == 0


def test_a_message_larger_than_the_receiver_accepts_is_dead_lettered_and_the_rest_go_on(make_bus):
    sender = make_bus("s", max_payload=4 << 20)
    receiver = make_bus("r", max_payload=64 << 10)
    got = []
    receiver.handle("c", lambda p, m: got.append(len(p)))
    sender.send(receiver.address, "c", b"x" * 10)  # learns the receiver's limit
    wait_until(lambda: got == [10], 10)
    for size in (100_000, 2_000_000):
        sender.send(receiver.address, "c", b"y" * size)
    sender.send(receiver.address, "c", b"z" * 20)
    wait_until(lambda: got == [10, 20], 15, message="the small one after the big ones")
    wait_until(lambda: sender.status().deadletters == 2, 10)
    assert sender.drain(10)
    letters = sender.deadletters()
    assert [(d.origin, d.reason, d.peer) for d in letters] == [("outgoing", "too_large", receiver.address)] * 2
    assert "max_payload is 65536" in letters[0].error and sender.deadletters(limit=1) == letters[:1]


def test_a_receiver_refuses_an_oversize_message_in_a_frame_with_a_nack(make_bus):
    receiver = make_bus("r", max_payload=1000)
    sock = raw_dealer(receiver.address)
    try:
        now = int(time.time() * 1000)
        envs = [one_message("0000000000000000000001", "c", now, encode_payload("x" * 2000)),
                one_message("0000000000000000000002", "c", now, encode_payload("ok"))]
        sock.send_multipart(P.encode_batch(P.Kind.COMMAND, "raw", free_address(), envs, now))
        answers = []
        deadline = time.monotonic() + 10
        while len(answers) < 2 and time.monotonic() < deadline:
            if sock.poll(200):
                answers.append(decode(sock.recv_multipart(), max_payload=1000))
    finally:
        sock.close(linger=0)
    kinds = {type(a).__name__: a for a in answers}
    assert kinds["Nack"].ids == ("0000000000000000000001",) and "max_payload" in kinds["Nack"].reason
    assert kinds["Ack"].ids == ("0000000000000000000002",)


# --- 15. the small print -----------------------------------------------------------------


def test_drain_waits_for_messages_of_a_handler_registered_while_another_refill_runs(make_bus, tmp_path):
    pub = make_bus("pub")
    with Bus(free_address(), tmp_path / "sub") as sub:
        sub.subscribe(pub.address, "a", wait=10)
        sub.subscribe(pub.address, "b", wait=10)
        pub.publish_many("a", list(range(20_000)))
        pub.publish_many("b", list(range(5)))
        assert pub.drain(30)
    got_b = []
    with Bus(free_address(), tmp_path / "sub") as sub:
        sub.every("a", lambda p, m: None)
        sub.every("b", lambda p, m: got_b.append(p))
        assert sub.drain(60)
        assert sorted(got_b) == list(range(5))


def test_a_request_made_on_a_closed_bus_fails_at_once(make_bus):
    bus = make_bus("a")
    bus.close()
    with pytest.raises(BusClosedError):
        bus.request_async(free_address(), "c", 1)


def test_every_request_made_while_the_bus_closes_completes(tmp_path):
    for round_ in range(20):
        bus = Bus(free_address(), tmp_path / "a")
        futures: list = []
        stop = threading.Event()
        nobody = free_address()

        def ask():
            while not stop.is_set():
                try:
                    futures.append(bus.request_async(nobody, "c", 1, timeout=60))
                except BusClosedError:
                    return

        threads = [threading.Thread(target=ask) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.02 * (round_ % 5))  # close at a different moment each round
        bus.close()
        stop.set()
        for t in threads:
            t.join(10)
        for f in futures:
            with pytest.raises(BusClosedError):
                f.result(5)


def test_a_write_made_after_the_last_sync_is_synced_by_close(tmp_path):
    from servicebus.store import Store
    store = Store.open(tmp_path / "s")
    synced = []

    class Db:  # records the synced writes LevelDB is asked for
        def __init__(self, db):
            self._db = db

        def write_batch(self, **kwargs):
            synced.append(bool(kwargs.get("sync")))
            return self._db.write_batch(**kwargs)

        def __getattr__(self, name):
            return getattr(self._db, name)

    store._db = Db(store._db)
    batch = store.batch()
    batch.put_meta("x", b"1")
    store.write(batch, sync=False)
    assert True not in synced
    store.close()
    assert synced[-1] is True


def test_checking_the_lock_never_makes_a_starting_bus_fail(tmp_path):
    from servicebus.store.lockfile import DataDirLock

    stop = threading.Event()

    def prober():
        while not stop.is_set():
            probe(tmp_path)  # what servicebus status does, any time

    threads = [threading.Thread(target=prober) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(2000):  # what Bus() does first
            DataDirLock.acquire(tmp_path, address="tcp://127.0.0.1:1").release()
    finally:
        stop.set()
        for t in threads:
            t.join(10)


def test_a_forked_child_does_not_keep_the_data_directory_locked(tmp_path):
    script = (
        "import os, sys, time\n"
        "from servicebus import Bus\n"
        "bus = Bus(sys.argv[1], sys.argv[2])\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    null = os.open(os.devnull, os.O_RDWR); os.dup2(null, 1); os.dup2(null, 2)\n"
        "    time.sleep(60); os._exit(0)\n"
        "print(pid, flush=True)\n"
        "os._exit(0)  # the parent dies without closing, as in a crash\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, free_address(), str(tmp_path / "a")],
                          capture_output=True, text=True, timeout=30)
    child = int(proc.stdout.split()[0])
    try:
        with Bus(free_address(), tmp_path / "a") as bus:
            assert bus.status().running
    except LockedError as exc:
        pytest.fail(f"the forked child kept the lock: {exc}")
    finally:
        os.kill(child, signal.SIGKILL)
