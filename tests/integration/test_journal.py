"""The delivery journal: complete, as durable as the state it describes, flushed, pruned."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

from servicebus import Bus
from servicebus.testing import free_address, wait_until

from ..journals import journal_events, segment_files

TOPIC = "user.signup"
CLI = str(Path(sys.executable).parent / "servicebus")


def journal_lines(datadir: Path) -> list[dict]:
    """The journal's events, one per message, from its segments of either format (a
    line-format line with ``ids`` and a columnar line's entries are one event per message),
    as the audit reads them."""
    return journal_events(datadir)


def test_a_delivery_is_journaled_end_to_end_on_both_buses(make_bus, tmp_path):
    pub = make_bus("pub")
    sub = make_bus("sub", max_attempts=2, retry_initial=0.01)
    sub.subscribe(pub.address, TOPIC, wait=10)
    sub.every(TOPIC, lambda p, m: 1 / 0 if p == "bad" else None)
    ids = pub.publish_many(TOPIC, ["good", "bad"])
    wait_until(lambda: sub.status().deadletters == 1 and sub.drain(0.05), 10)
    assert pub.drain(5)
    pub.close()
    sub.close()
    pub_events = journal_lines(tmp_path / "pub")
    sub_events = journal_lines(tmp_path / "sub")
    assert Counter(e["event"] for e in pub_events) == {"published": 2, "sent": 2, "acked": 2}
    assert Counter(e["event"] for e in sub_events) == {
        "received": 2, "handled": 1, "handler_failed": 2, "retried": 1, "deadlettered": 1}
    published = {e["id"]: e for e in pub_events if e["event"] == "published"}
    assert sorted(published) == ids
    first = published[ids[0]]
    assert (first["node"], first["address"], first["peer"], first["topic"], first["kind"]) == (
        pub.node_id, pub.address, sub.address, TOPIC, "event")
    failed = [e for e in sub_events if e["event"] == "handler_failed"]
    assert [e["attempt"] for e in failed] == [1, 2]
    assert failed[0]["error"] == "ZeroDivisionError: division by zero"
    assert all(e["peer"] == pub.address and e["address"] == sub.address for e in sub_events)
    assert not any("error" in e for e in pub_events)


def test_commands_and_replies_are_journaled(make_bus, tmp_path):
    server, client = make_bus("server"), make_bus("client")
    server.handle("q", lambda p, m: p + 1)
    assert client.request(server.address, "q", 1, timeout=10) == 2
    assert client.drain(5) and server.drain(5)
    server.close()
    client.close()
    c = Counter((e["event"], e["kind"]) for e in journal_lines(tmp_path / "client"))
    s = Counter((e["event"], e["kind"]) for e in journal_lines(tmp_path / "server"))
    assert c[("published", "command")] == 1 and c[("received", "reply")] == 1 and c[("handled", "reply")] == 1
    assert s[("received", "command")] == 1 and s[("handled", "command")] == 1 and s[("published", "reply")] == 1


def test_journal_off_records_nothing(make_bus, tmp_path):
    pub = make_bus("pub", journal=False)
    sub = make_bus("sub", journal=False)
    sub.subscribe(pub.address, TOPIC, wait=10)
    got = []
    sub.every(TOPIC, lambda p, m: got.append(p))
    pub.publish(TOPIC, 1)
    wait_until(lambda: got, 10)
    pub.close()
    sub.close()
    assert not (tmp_path / "pub" / "journal").exists() and not (tmp_path / "sub" / "journal").exists()


def test_records_left_by_a_kill_are_flushed_by_the_cli_or_the_next_start(make_bus, bus_process):
    sub = make_bus("sub")
    got = []
    sub.every(TOPIC, lambda p, m: got.append(p))
    pub = bus_process("pub")
    sub.subscribe(pub.address, TOPIC)
    pub.start("--publish", TOPIC, "--count", "500", "--batch", "100", "--kill-after-publish",
              wait_ready=False)
    assert pub.wait_exit(60) == -9
    ids = pub.published_ids()
    assert len(ids) == 500
    flushed = subprocess.run([CLI, "journal", "flush", pub.datadir], capture_output=True, text=True)
    assert flushed.returncode == 0, flushed.stderr
    published = {e["id"] for e in journal_lines(pub.datadir) if e["event"] == "published"}
    assert published == set(ids)  # every publish that returned is in the journal
    again = subprocess.run([CLI, "journal", "flush", pub.datadir], capture_output=True, text=True)
    assert "moved 0 journal events" in again.stdout


def test_events_a_kill_left_behind_keep_the_address_they_happened_at_when_the_bus_starts_elsewhere(
        make_bus, bus_process):
    # A bus killed before its journal moved its last events out, started again from the same
    # data directory at another address (a service moved: tools/chaos --only move-subscriber):
    # those events happened at the old address, and the audit pairs a receiver's events with
    # its sender's by address. Moved under the new one, a delivery acked at the old address
    # looked lost there.
    sub = make_bus("sub")
    sub.every(TOPIC, lambda p, m: None)
    pub = bus_process("pub")
    sub.subscribe(pub.address, TOPIC)
    pub.start("--publish", TOPIC, "--count", "500", "--batch", "100", "--kill-after-publish",
              wait_ready=False)
    assert pub.wait_exit(60) == -9
    moved = free_address()
    with Bus(moved, pub.datadir):
        pass
    published = [e for e in journal_lines(Path(pub.datadir)) if e["event"] == "published"]
    assert len(published) == 500
    assert {e["address"] for e in published} == {pub.address}


def test_a_restarted_bus_never_overwrites_an_earlier_segment(tmp_path):
    for run in range(3):
        with Bus(free_address(), tmp_path / "node") as bus:
            bus.publish("t", run)  # no subscriber: nothing journaled ...
            bus.send(free_address(), "c", run)  # ... but a command is
    events = journal_lines(tmp_path / "node")
    assert [e["event"] for e in events].count("published") == 3
    # one segment per run: none written over, none written twice
    assert [p.suffix for p in segment_files(tmp_path / "node")] == [".jcol"] * 3


def test_every_way_a_message_stops_being_owed_is_journaled(tmp_path):
    import zmq

    from servicebus.wire import protocol as P

    pub_dir = tmp_path / "pub"
    with Bus(free_address(), pub_dir) as pub:
        subscribers = []
        for name in ("kept", "leaving"):
            with Bus(free_address(), tmp_path / name) as sub:
                sub.subscribe(pub.address, TOPIC, wait=10)
                subscribers.append(sub.address)
        kept, leaving = subscribers  # both down now: what follows is owed to them
        events_ids = pub.publish_many(TOPIC, [1, 2])
        commands = [pub.send(kept, "work", n) for n in range(3)]
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(pub.address)
        try:  # the leaving subscriber's UNSUBSCRIBE, as it would send it
            sock.send_multipart(P.encode_unsubscribe("u1", TOPIC, leaving, "leaving"))
            assert sock.poll(10_000), "no ack for the unsubscribe"
        finally:
            sock.close(linger=0)
        wait_until(lambda: pub.status().subscriptions == 1, 10)
    removed = subprocess.run([CLI, "purge", str(pub_dir), "--subscriber", kept, "--yes"],
                             capture_output=True, text=True, timeout=60)
    assert removed.returncode == 0, removed.stderr
    events = journal_lines(pub_dir)
    owed = {(e["id"], e["peer"]) for e in events if e["event"] == "published"}
    ended = {(e["id"], e["peer"]): e for e in events
             if e["event"] in ("acked", "expired", "deadlettered", "dropped")}
    assert owed == set(ended)
    assert {ended[(mid, leaving)]["event"] for mid in events_ids} == {"dropped"}
    assert {ended[(mid, leaving)]["error"] for mid in events_ids} == {"unsubscribed"}
    assert {ended[(mid, kept)]["event"] for mid in events_ids + commands} == {"deadlettered"}
    assert {ended[(mid, kept)]["error"] for mid in events_ids + commands} == {"subscriber_removed"}


def test_a_segment_cut_to_one_message_for_its_receiver_journals_and_hands_over_that_messages_id(make_bus):
    pub = make_bus("pub", max_payload=100_000)
    sub = make_bus("sub", max_payload=1000)
    got = []
    sub.every(TOPIC, lambda p, m: got.append((m.id, p)))
    sub.subscribe(pub.address, TOPIC, wait=10)
    wait_until(lambda: any(p.up for p in pub.status().peers if p.address == sub.address), 10)  # its pong: max_payload
    big, small = pub.publish_many(TOPIC, ["x" * 5000, "small"])
    wait_until(lambda: got, 10)
    assert pub.drain(5) and sub.drain(5)
    pub.close()
    sub.close()
    assert got == [(small, "small")]
    received = {e["id"] for e in journal_lines(sub.datadir) if e["event"] in ("received", "handled")}
    assert received == {small}
    sent = {e["id"] for e in journal_lines(pub.datadir) if e["event"] == "sent"}
    assert sent == {small}


def test_the_journal_says_whose_it_is_the_service_name_at_each_address(tmp_path):
    # The audit names the services behind the addresses in the journal lines, and points its
    # commands at data directories, from this file: a bus that came back on another port
    # keeps its older address there (its older segments name it).
    first, second = free_address(), free_address()
    for address in (first, second):
        with Bus(address, tmp_path / "email", name="email") as bus:
            node = bus.node_id
    with Bus(free_address(), tmp_path / "anon") as anon:
        anon_address = anon.address
    described = json.loads((tmp_path / "email" / "journal" / f"{node}.bus.json").read_text())
    assert described == {"node": node, "datadir": str((tmp_path / "email").resolve()),
                         "addresses": {first: "email", second: "email"}}
    (anon_file,) = (tmp_path / "anon" / "journal").glob("*.bus.json")
    assert json.loads(anon_file.read_text())["addresses"] == {anon_address: None}


def test_journal_events_into_a_reader_that_stops_early_ends_quietly_by_sigpipe(tmp_path):
    """``servicebus journal events DIR | head -1``: as GNU tools do, the command dies of
    SIGPIPE when its reader goes away (141 in a shell), with nothing on stderr; not a
    Python traceback or an error exit of its own."""
    import signal

    with Bus(free_address(), tmp_path / "pub") as bus:
        nobody = free_address()
        for n in range(2000):  # journaled (a command is, an event without subscribers is not):
            bus.send(nobody, "c", {"n": n})  # ~500 KB of lines, more than a pipe holds
    proc = subprocess.Popen([CLI, "journal", "events", str(tmp_path / "pub")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()  # the reader goes away after one line
    err = proc.stderr.read()
    proc.stderr.close()
    assert proc.wait(30) == -signal.SIGPIPE, (proc.returncode, err)
    assert json.loads(first)["event"] == "published" and err == b""
