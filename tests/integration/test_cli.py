"""The real `servicebus` console script, run in subprocesses against data directories left
by real buses (most of them killed with SIGKILL)."""

import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import plyvel
import pytest

from servicebus import Bus
from servicebus.testing import free_address, wait_until

from ..conftest import BusProcess, subscriber_gone
from ..journals import journal_events

TOPIC = "user.signup"
CLI = str(Path(sys.executable).parent / "servicebus")


def cli(*args, input=None):
    # A fixed width: rich reads COLUMNS, and the one-line checks must not depend on the
    # terminal the suite happens to run in.
    return subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, timeout=60,
                          input=input, env={**os.environ, "COLUMNS": "80"})


def cli_json(*args):
    result = cli(*args, "--json")
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.fixture
def crashed_publisher(make_bus, bus_process):
    """A publisher killed with SIGKILL while 50 messages were owed to a subscriber that is
    down, and nothing to one that is up."""
    pub = bus_process("pub")
    pub.start()
    live = make_bus("live")
    got = set()
    live.every(TOPIC, lambda p, m: got.add(p["n"]))
    live.subscribe(pub.address, TOPIC, wait=10)
    down = bus_process("down", "--handle", TOPIC, "--subscribe", pub.address, TOPIC)
    down.start()
    down.kill()
    pub.kill()
    with Bus(pub.address, pub.datadir) as bus:  # the same bus, restarted here to publish
        ids = bus.publish_many(TOPIC, [{"n": n} for n in range(50)])
        wait_until(lambda: len(got) == 50, 20)
        wait_until(lambda: bus.status().pending == 50, 10)
    pub.start()
    pub.kill()  # left locked by a dead process, as after a crash
    return pub, live, down, ids


def test_status_after_a_crash_shows_the_stale_lock_and_exact_pending_counts(crashed_publisher):
    pub, live, down, ids = crashed_publisher
    status = cli_json("status", pub.datadir)[0]
    assert status["lock"]["alive"] is False and status["lock"]["pid"] == pub.proc.pid
    assert status["pending_by_peer"] == {down.address: 50, live.address: 0}
    assert status["pending"] == 50 and status["subscriptions"] == 2
    assert status["oldest_pending_age_s"] >= 0
    text = cli("status", pub.datadir)
    assert text.returncode == 0 and "STALE" in text.stdout


def test_listings_show_exactly_the_undelivered_messages_and_parse_as_json(crashed_publisher):
    pub, live, down, ids = crashed_publisher
    rows = cli_json("outgoing", pub.datadir, "--limit", "0")
    assert [r["id"] for r in rows] == ids
    assert all(r["owed_by"] == [down.address] for r in rows)
    assert rows[7]["payload"] == {"n": 7}
    assert cli_json("outgoing", pub.datadir, "--subscriber", live.address) == []
    assert len(cli_json("outgoing", pub.datadir, "--limit", "5")) == 5
    assert cli_json("keys", pub.datadir) == [{"topic": TOPIC, "subscribers": 2,
                                               "addresses": sorted([live.address, down.address])}]
    subs = {r["address"]: r for r in cli_json("subscribers", pub.datadir)}
    assert subs[down.address]["pending"] == 50 and subs[live.address]["pending"] == 0
    assert subs[live.address]["last_ack"] is not None
    for listing in ("incoming", "deadletters"):
        assert cli_json(listing, pub.datadir) == []
    table = cli("outgoing", pub.datadir, "--limit", "3")
    assert table.returncode == 0 and ids[0] in table.stdout
    assert max(len(line) for line in table.stdout.splitlines()) <= 80


def test_unlock_then_restart_delivers_the_backlog(crashed_publisher):
    pub, live, down, ids = crashed_publisher
    result = cli("unlock", pub.datadir)
    assert result.returncode == 0 and f"pid {pub.proc.pid}" in result.stdout
    assert not (pub.datadir / "LOCK").exists()
    down.start(wait_ready=False)  # it confirms its subscription once the publisher is up
    pub.start()
    down.wait_ready()
    wait_until(lambda: len(down.done_counts()) == 50, 20)
    pub.stop()
    assert cli_json("status", pub.datadir)[0]["pending"] == 0


def test_commands_that_write_refuse_while_a_live_bus_holds_the_lock(bus_process):
    node = bus_process("node")
    node.start()
    # replay, purge of dead letters and plain check work on a live bus (test_cli_live.py)
    for args in (("unlock",), ("purge", "--outgoing", "--yes"), ("purge", "--incoming", "--yes"),
                 ("compact",), ("check", "--repair")):
        result = cli(*args, node.datadir)
        assert result.returncode == 3, (args, result.stderr)
        assert str(node.proc.pid) in result.stderr
        assert "Traceback" not in result.stderr


def test_live_status_over_the_admin_endpoint_matches_offline_status_after_stop(make_bus, bus_process):
    node = bus_process("node", "--handle", TOPIC)
    node.start()
    client = make_bus("client")
    for n in range(5):
        client.send(node.address, "no.handler.yet", {"n": n})
    wait_until(lambda: cli_json("status", node.datadir)[0]["incoming"] == 5, 20)
    live = cli_json("status", node.datadir)[0]
    assert live["lock"]["alive"] is True
    live_incoming = cli_json("incoming", node.datadir)
    node.stop()
    offline = cli_json("status", node.datadir)[0]
    assert offline["lock"] is None
    # The engine's counters are the live bus's alone (what the console's rates are made of).
    assert live["counters"]["received"] == 5 and offline["counters"] is None
    ignore = {"lock", "store_bytes", "oldest_pending_age_s", "counters"}
    assert {k: v for k, v in live.items() if k not in ignore} == \
        {k: v for k, v in offline.items() if k not in ignore}
    assert [r["id"] for r in cli_json("incoming", node.datadir)] == [r["id"] for r in live_incoming]


def test_a_replayed_dead_letter_is_handled(make_bus, tmp_path):
    pub = make_bus("pub")
    sub = make_bus("sub", max_attempts=1)
    sub.subscribe(pub.address, TOPIC, wait=10)
    sub.every(TOPIC, lambda p, m: 1 / 0)
    mid = pub.publish(TOPIC, {"n": 1})
    wait_until(lambda: sub.status().deadletters == 1, 10)
    sub.close()
    rows = cli_json("deadletters", tmp_path / "sub")
    assert rows[0]["id"] == mid and rows[0]["reason"] == "handler_failed"
    assert rows[0]["error"] == "ZeroDivisionError: division by zero"
    assert rows[0]["payload"] == {"n": 1}
    replayed = cli_json("replay", tmp_path / "sub", mid)
    assert replayed[0]["result"] == "replayed" and replayed[0]["to"] == "incoming"
    assert cli_json("deadletters", tmp_path / "sub") == []
    got = []
    with Bus(free_address(), tmp_path / "sub") as again:
        again.every(TOPIC, lambda p, m: got.append((p, m.id)))
        wait_until(lambda: got, 10)
        assert again.drain(5)
    assert got == [({"n": 1}, mid)]


def test_an_expired_command_is_replayed_to_outgoing_and_delivered(make_bus, tmp_path):
    address = free_address()
    client = make_bus("client")
    client.send(address, "audit.record", {"n": 1}, ttl=0.1)
    server = make_bus("server", address)
    wait_until(lambda: client.status().deadletters == 1, 10)
    client.close()
    rows = cli_json("replay", tmp_path / "client", "--all")
    assert rows[0]["result"] == "replayed" and rows[0]["to"] == f"outgoing to {address}"
    got = []
    server.handle("audit.record", lambda p, m: got.append(p))
    with Bus(free_address(), tmp_path / "client"):
        wait_until(lambda: got == [{"n": 1}], 15)


def test_purge_removes_only_what_it_names(crashed_publisher):
    pub, live, down, ids = crashed_publisher
    refused = cli("purge", pub.datadir, "--deadletters")  # not a terminal and no --yes
    assert refused.returncode == 1 and "--yes" in refused.stderr
    before = cli_json("status", pub.datadir)[0]
    removed = cli_json("purge", pub.datadir, "--subscriber", down.address, "--yes")[0]["removed"]
    assert removed == {"subscriptions": 1, "deliveries": 1, "moved_to_deadletters": 50}
    after = cli_json("status", pub.datadir)[0]
    assert after["pending"] == 0 and after["deadletters"] == 50
    assert after["subscriptions"] == before["subscriptions"] - 1
    letters = cli_json("deadletters", pub.datadir, "--limit", "0")
    assert {r["id"] for r in letters} == set(ids)
    assert {r["reason"] for r in letters} == {"subscriber_removed"}
    removed = cli_json("purge", pub.datadir, "--deadletters", "--yes")[0]["removed"]
    assert removed == {"deadletters": 50}
    final = cli_json("status", pub.datadir)[0]
    assert final["deadletters"] == 0 and final["subscriptions"] == 1
    assert cli_json("keys", pub.datadir)[0]["addresses"] == [live.address]


def test_export_round_trips_every_message(crashed_publisher, tmp_path):
    pub, live, down, ids = crashed_publisher
    out = tmp_path / "export.jsonl"
    result = cli("export", pub.datadir, out)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    messages = {r["id"]: r for r in rows if r["type"] == "outgoing"}
    assert sorted(messages) == ids
    import base64, msgpack
    for n, mid in enumerate(ids):
        assert messages[mid]["payload"] == {"n": n}
        assert msgpack.unpackb(base64.b64decode(messages[mid]["body"])) == {"n": n}
    kinds = {r["type"] for r in rows}
    assert {"meta", "subscription", "delivery", "outgoing"} <= kinds


# --- segments (store format 3): one record, several messages -----------------------------------


def cli_json_rows(*args) -> list[dict]:
    """``--json`` rows of a command whatever its exit code (check exits 4 with rows)."""
    return [json.loads(line) for line in cli(*args, "--json").stdout.splitlines()]


def journal_lines(datadir: Path) -> list[dict]:
    """The journal's events, one per message, from segments of either format."""
    return journal_events(Path(datadir))


def test_segments_owed_to_a_stopped_subscriber_are_listed_counted_exported_and_purged_per_message(make_bus, tmp_path):
    """A stream holding segments of several messages (each publish is one record): every
    listing, count, export row and purge goes by message."""
    pub = make_bus("pub")
    address, _subdir = subscriber_gone(make_bus, pub, TOPIC)
    owed = (pub.publish_many(TOPIC, [{"n": n} for n in range(3)])
            + pub.publish_many(TOPIC, [{"n": n} for n in range(3, 7)]) + [pub.publish(TOPIC, {"n": 7})])
    pub.close()
    keys = [k for k, _ in _records(pub.datadir).items() if k.startswith(b"o/")]
    assert len(keys) == 3, keys  # three segments, eight messages
    rows = cli_json("outgoing", pub.datadir, "--all")
    assert [r["id"] for r in rows] == owed and [r["payload"] for r in rows] == [{"n": n} for n in range(8)]
    assert all(r["owed_by"] == [address] for r in rows)
    cut = cli("outgoing", pub.datadir, "--limit", "5")
    assert "5 of 8 shown" in cut.stdout, cut.stdout[-300:]
    status = cli_json("status", pub.datadir)[0]
    assert (status["outgoing"], status["pending"], status["pending_by_peer"]) == (8, 8, {address: 8})
    assert cli_json("subscribers", pub.datadir)[0]["pending"] == 8
    out = tmp_path / "export.jsonl"
    assert cli("export", pub.datadir, out).returncode == 0
    exported = [json.loads(line) for line in out.read_text().splitlines()]
    messages = [r for r in exported if r["type"] == "outgoing"]
    assert [r["id"] for r in messages] == owed
    assert [r["segment"] for r in messages] == [owed[0]] * 3 + [owed[3]] * 4 + [owed[7]]
    removed = cli_json("purge", pub.datadir, "--outgoing", "--yes")[0]["removed"]
    assert removed["outgoing"] == 8
    dropped = {e["id"] for e in journal_lines(pub.datadir) if e["event"] == "dropped"}
    assert dropped == set(owed)  # each message journaled as ended by the operator
    assert cli("check", pub.datadir).returncode == 0


def test_purge_of_a_subscriber_owed_segments_makes_a_dead_letter_of_each_message_that_replays(make_bus, tmp_path):
    pub = make_bus("pub")
    address, subdir = subscriber_gone(make_bus, pub, TOPIC)
    owed = pub.publish_many(TOPIC, [{"n": n} for n in range(4)]) + pub.publish_many(TOPIC, [{"n": 4}, {"n": 5}])
    pub.close()
    removed = cli_json("purge", pub.datadir, "--subscriber", address, "--yes")[0]["removed"]
    assert removed["moved_to_deadletters"] == 6
    letters = cli_json("deadletters", pub.datadir)
    assert [r["id"] for r in letters] == owed and [r["payload"] for r in letters] == [{"n": n} for n in range(6)]
    journaled = {e["id"] for e in journal_lines(pub.datadir) if e["event"] == "deadlettered"}
    assert journaled == set(owed)
    # Its stream is owed to no one now (the bus deletes such at its next start): counted by message.
    checked = cli_json_rows("check", pub.datadir)
    assert [(r["keyspace"], r["problem"]) for r in checked] == [("outgoing", "6 message(s) no subscriber is owed")]
    # Subscribed again, its letters replay one by one (each a segment of one) and arrive.
    got = []
    sub = make_bus("sub-again", address=address, datadir=subdir)
    sub.every(TOPIC, lambda p, m: got.append(p["n"]))
    sub.subscribe(pub.address, TOPIC)
    with Bus(pub.address, pub.datadir) as again:
        wait_until(lambda: again.status().subscriptions == 1, 10)
    rows = cli_json("replay", pub.datadir, "--all")
    assert [r["result"] for r in rows] == ["replayed"] * 6, rows
    make_bus("pub-again", address=pub.address, datadir=pub.datadir)
    wait_until(lambda: sorted(got) == list(range(6)), 20, message=lambda: f"got {got}")


def _store_by_hand(datadir: Path):
    """A data directory whose store is written here, record by record."""
    from servicebus.store import Store

    datadir.mkdir()
    return Store.open(datadir / "store")


def test_incoming_lists_what_is_left_of_a_segment_and_the_message_split_off_it(tmp_path):
    """A received segment of four whose run got to its third message: its second failed and
    was split off (retried as a segment of one, with its run state), its third has begun a
    run. incoming lists those three messages, once each; status counts three; purge
    --incoming takes the segment's progress with it."""
    from servicebus.model.segments import make_blob
    from servicebus.model.stored import IncomingRecord, Progress, RunState

    ids = [f"{n:024x}" for n in range(0xC0, 0xC4)]
    record = IncomingRecord(1, TOPIC, "node", "tcp://127.0.0.1:9", 1, 1, None, None, None, ids,
                            make_blob([msgpack_of({"n": n}) for n in range(4)]))
    store = _store_by_hand(tmp_path / "sub")
    b = store.batch()
    b.put_incoming(ids[0], record)
    b.put_progress(ids[0], 0, Progress(2, 1, [1]))
    b.split_off(ids[1], record._replace(ids=[ids[1]], blob=make_blob([msgpack_of({"n": 1})])),
                RunState(1, [], "ValueError: no", 2_000_000_000_000))
    store.write(b, sync=True)
    store.close()
    datadir = tmp_path / "sub"
    assert cli("check", datadir).returncode == 0
    rows = {r["id"]: r for r in cli_json("incoming", datadir)}
    assert sorted(rows) == ids[1:]
    assert (rows[ids[1]]["attempts"], rows[ids[1]]["last_error"]) == (1, "ValueError: no")
    assert rows[ids[2]]["attempts"] == 1 and rows[ids[3]]["attempts"] == 0  # the run begun counts
    assert [rows[m]["payload"] for m in ids[1:]] == [{"n": 1}, {"n": 2}, {"n": 3}]
    assert cli_json("status", datadir)[0]["incoming"] == 3
    out = tmp_path / "export.jsonl"
    assert cli("export", datadir, out).returncode == 0
    exported = {r["id"]: r["segment"] for r in map(json.loads, out.read_text().splitlines())
                if r["type"] == "incoming"}
    assert exported == {ids[1]: ids[1], ids[2]: ids[0], ids[3]: ids[0]}
    removed = cli_json("purge", datadir, "--incoming", "--yes")[0]["removed"]
    assert removed == {"incoming": 3, "runstate": 1, "progress": 1}
    assert not [k for k in _records(datadir) if k[:2] in (b"n/", b"r/", b"c/")]
    assert cli("check", datadir).returncode == 0


def test_replay_puts_back_a_letter_only_as_a_message_of_its_own_this_version_reads(tmp_path):
    """A dead letter keeps its message as a segment of one (store format 3). One whose record
    is anything else (an older layout a migration did not reach, a segment of several) is
    skipped with why, not put back as a record the bus would find damaged."""
    from servicebus.model.segments import make_blob

    good, old_layout, several = (f"{n:024x}" for n in (0xD1, 0xD2, 0xD3))
    incoming = [1, TOPIC, "node", "tcp://127.0.0.1:9", 1, 1, None, None, None]
    store = _store_by_hand(tmp_path / "sub")
    b = store.batch()
    b.put_deadletter(good, {"origin": "incoming", "reason": "handler_failed", "error": "x", "at": 1,
                            "record": [*incoming, [good], make_blob([msgpack_of({"n": 1})])]})
    b.put_deadletter(old_layout, {"origin": "incoming", "reason": "handler_failed", "error": "x", "at": 1,
                                  "record": [*incoming, msgpack_of({"n": 2})]})
    b.put_deadletter(several, {"origin": "incoming", "reason": "handler_failed", "error": "x", "at": 1,
                               "record": [*incoming, [several, good], make_blob([b"\x01", b"\x02"])]})
    store.write(b, sync=True)
    store.close()
    rows = {r["id"]: r for r in cli_json("replay", tmp_path / "sub", "--all")}
    assert rows[good]["result"] == "replayed"
    assert rows[old_layout]["result"] == "skipped" and "not a message this version reads" in rows[old_layout]["detail"]
    assert rows[several]["result"] == "skipped" and "not this message alone" in rows[several]["detail"]
    assert cli("check", tmp_path / "sub").returncode == 0  # nothing damaged was put back


def msgpack_of(value) -> bytes:
    import msgpack

    return msgpack.packb(value)


def test_check_finds_a_corrupted_record_and_repair_keeps_the_rest(make_bus, tmp_path):
    server, client = make_bus("server"), make_bus("client")
    for n in range(20):
        client.send(server.address, "no.handler", {"n": n})
    wait_until(lambda: server.status().incoming == 20, 10)
    server.close()
    clean = cli("check", tmp_path / "server")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    db = plyvel.DB(str(tmp_path / "server" / "store"))
    victim = next(db.iterator(prefix=b"n/", include_value=False))
    db.put(victim, b"\xc1 not msgpack")
    db.put(b"r/" + b"0" * 24, b"\x94\x01\x90\xc0\x00")  # run state of no message
    db.close()
    found = cli("check", tmp_path / "server", "--json")
    assert found.returncode == 4
    problems = [json.loads(line) for line in found.stdout.splitlines()]
    assert {(p["keyspace"], p["key"]) for p in problems} == {
        ("incoming", victim[2:].decode()), ("runstate", "0" * 24)}
    fixed = cli("check", tmp_path / "server", "--repair", "--json")
    assert fixed.returncode == 0
    assert all(json.loads(line)["action"].startswith("dropped") for line in fixed.stdout.splitlines())
    assert cli("check", tmp_path / "server").returncode == 0
    assert cli_json("status", tmp_path / "server")[0]["incoming"] == 19


def test_check_repairs_a_store_whose_files_are_damaged(make_bus, tmp_path):
    server, client = make_bus("server"), make_bus("client")
    for n in range(300):
        client.send(server.address, "no.handler", {"n": n, "pad": "x" * 500})
    wait_until(lambda: server.status().incoming == 300, 20)
    server.close()
    assert cli("compact", tmp_path / "server").returncode == 0
    tables = sorted((tmp_path / "server" / "store").glob("*.ldb"), key=lambda p: p.stat().st_size)
    assert tables, "compaction wrote no table file"
    data = bytearray(tables[-1].read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = b"\xff" * 64
    tables[-1].write_bytes(bytes(data))
    broken = cli("check", tmp_path / "server")
    assert broken.returncode == 4, broken.stdout + broken.stderr
    fixed = cli("check", tmp_path / "server", "--repair")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "LevelDB repair" in fixed.stdout + fixed.stderr
    left = cli_json("status", tmp_path / "server")[0]["incoming"]
    assert 0 < left < 300  # the damaged block is gone, the rest recovered
    assert cli("check", tmp_path / "server").returncode == 0


def _records(datadir: Path) -> dict[bytes, bytes]:
    db = plyvel.DB(str(datadir / "store"))
    try:
        return dict(db.iterator())
    finally:
        db.close()


def _publisher_owing_priority_events(make_bus, group=None):
    """A publisher whose subscriber (or group of one) handled an event of priority 3 and one
    of priority 0, stopped, and is owed 7 more: 3 of priority 3, 2 of 0 and 2 of 9. Each
    priority level is a stream of its own ("e:<topic> 3"), with a delivery cursor of its
    own. Returns the publisher, still open, and the ids owed."""
    pub, sub = make_bus("pub"), make_bus("sub")
    got = []
    sub.every(TOPIC, lambda p, m: got.append(p["n"]))
    sub.subscribe(pub.address, TOPIC, group=group, wait=10)
    pub.publish(TOPIC, {"n": 0}, priority=3)
    pub.publish(TOPIC, {"n": 1})
    wait_until(lambda: len(got) == 2 and pub.status().pending == 0, 10)
    sub.close()
    owed = (pub.publish_many(TOPIC, [{"n": n} for n in (2, 3, 4)], priority=3)
            + pub.publish_many(TOPIC, [{"n": n} for n in (5, 6)])
            + pub.publish_many(TOPIC, [{"n": n} for n in (7, 8)], priority=9))
    wait_until(lambda: pub.status().pending == 7, 10)
    return pub, owed


@pytest.mark.parametrize("group", [None, "billing"])
def test_a_healthy_store_with_priority_streams_checks_clean_and_repair_changes_nothing(make_bus, group):
    pub, owed = _publisher_owing_priority_events(make_bus, group)
    pub.close()
    before = _records(pub.datadir)
    assert any(k.startswith(b"d/") and k.endswith((b" 3", b" 9")) for k in before)
    checked = cli("check", pub.datadir, "--json")
    assert (checked.returncode, checked.stdout) == (0, ""), checked.stdout + checked.stderr
    repaired = cli("check", pub.datadir, "--repair", "--json")
    assert (repaired.returncode, repaired.stdout) == (0, ""), repaired.stdout + repaired.stderr
    after = _records(pub.datadir)
    # No subscription to a topic with a space in it ("user.signup 3"), none for "group:...".
    assert sorted(k for k in after if k.startswith(b"s/")) == sorted(k for k in before if k.startswith(b"s/"))
    # Every synced write moves the store's high-water mark (store/mark.py): nothing else.
    assert {k: v for k, v in after.items() if k != b"m/hwm"} == {k: v for k, v in before.items() if k != b"m/hwm"}


def test_listings_of_priority_streams_name_the_topic_once_and_count_every_level(make_bus):
    pub, owed = _publisher_owing_priority_events(make_bus)

    def listed():
        (sub,) = cli_json("subscribers", pub.datadir)
        return {"topics": sub["topics"], "pending": sub["pending"],
                "outgoing": sorted(r["id"] for r in cli_json("outgoing", pub.datadir, "--limit", "0")),
                "status": cli_json("status", pub.datadir)[0]["pending"]}

    expected = {"topics": [TOPIC], "pending": 7, "outgoing": sorted(owed), "status": 7}
    assert listed() == expected  # served by the live bus
    pub.close()
    assert listed() == expected  # read from the stopped bus's store


def test_a_priority_stream_whose_cursors_were_not_written_yet_is_owed_not_orphaned(make_bus):
    """A crash between a publish and the engine's next turn leaves a priority stream with no
    delivery state of its own: the bus gives it its subscribers' cursors at start
    (core/machine.py), so check finds nothing wrong, repair dead-letters nothing, the
    listings count it, and it is delivered."""
    pub = make_bus("pub")
    address, subdir = subscriber_gone(make_bus, pub, TOPIC)
    owed = (pub.publish_many(TOPIC, [{"n": n} for n in range(3)], priority=3)
            + pub.publish_many(TOPIC, [{"n": n} for n in range(3, 5)]))
    pub.close()
    db = plyvel.DB(str(pub.datadir / "store"))
    levels = [k for k in db.iterator(prefix=b"d/", include_value=False) if k.endswith(b" 3")]
    assert levels, "the publisher wrote no cursor for priority 3"
    for key in levels:
        db.delete(key)
    db.close()
    checked = cli("check", pub.datadir, "--json")
    assert (checked.returncode, checked.stdout) == (0, ""), checked.stdout + checked.stderr
    assert cli_json("status", pub.datadir)[0]["pending"] == 5
    rows = cli_json("outgoing", pub.datadir, "--limit", "0")
    assert sorted(r["id"] for r in rows) == sorted(owed) and all(r["owed_by"] == [address] for r in rows)
    repaired = cli("check", pub.datadir, "--repair", "--json")
    assert (repaired.returncode, repaired.stdout) == (0, ""), repaired.stdout + repaired.stderr
    assert cli_json("deadletters", pub.datadir) == []
    got = set()
    sub = make_bus("sub-again", address=address, datadir=subdir)
    sub.every(TOPIC, lambda p, m: got.add(m.id))
    make_bus("pub-again", address=pub.address, datadir=pub.datadir)
    wait_until(lambda: got == set(owed), 20, message=lambda: f"{len(got)} of {len(owed)}")


def test_exit_codes_and_one_line_errors(tmp_path):
    missing = cli("status", tmp_path / "nope")
    assert missing.returncode == 2 and "no such data directory" in missing.stderr
    (tmp_path / "plain").mkdir()
    plain = cli("outgoing", tmp_path / "plain")
    assert plain.returncode == 2 and "not a servicebus data directory" in plain.stderr
    long_path = tmp_path / ("x" * 120)
    long_path.mkdir()
    long = cli("outgoing", long_path)
    assert long.returncode == 2 and long.stderr.count("\n") == 1, long.stderr  # one line, unwrapped
    usage = cli("status", "--no-such-option")
    assert usage.returncode == 1
    nothing = cli("purge", tmp_path / "plain")
    assert nothing.returncode == 1
    for result in (missing, plain, usage, nothing):
        assert "Traceback" not in result.stderr


def test_version_prints_the_package_version_and_exits_zero():
    import servicebus

    result = cli("--version")
    assert result.returncode == 0 and result.stdout == f"servicebus {servicebus.__version__}\n", result


def test_status_of_a_stopped_publisher_counts_a_groups_backlog_once_under_the_group(make_bus):
    pub = make_bus("pub")
    members = [make_bus("a"), make_bus("b")]
    for member in members:
        member.subscribe(pub.address, "orders.created", group="billing", wait=10)
        member.close()
    pub.publish_many("orders.created", list(range(10)))
    pub.close()
    status = cli_json("status", pub.datadir)[0]
    assert status["pending"] == 10
    assert status["pending_by_peer"] == {"group:billing": 10}


def test_export_of_a_live_bus_pages_through_every_message(make_bus, tmp_path):
    """The live bus serves its records 1,000 per request: an export over several pages has
    each message once."""
    pub = make_bus("pub")
    gone = make_bus("gone")
    gone.subscribe(pub.address, TOPIC, wait=10)
    gone.close()  # owed everything from now on
    ids = pub.publish_many(TOPIC, [{"n": n} for n in range(2500)])
    out = tmp_path / "live.jsonl"
    result = cli("export", pub.datadir, out)
    assert result.returncode == 0, result.stderr
    assert "served by the live bus" in result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    outgoing = [r["id"] for r in rows if r["type"] == "outgoing"]
    assert sorted(outgoing) == sorted(ids)  # none missing, none twice


# --- run by another user ---------------------------------------------------------------------

NOBODY = 65534


def cli_as(uid: int, *args) -> tuple[subprocess.CompletedProcess, float]:
    """The console script run as ``uid`` (setpriv: no capabilities, no groups of ours), and
    how long it took."""
    started = time.monotonic()
    result = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", CLI,
                             *map(str, args)], capture_output=True, text=True, timeout=120, cwd="/",
                            env={**os.environ, "COLUMNS": "80"})
    return result, time.monotonic() - started


@pytest.fixture
def as_nobody(walkable_dir):
    """``walkable_dir``, where the CLI can be run as uid nobody (else the test is skipped)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv, to run the CLI as another user")
    probe = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                            sys.executable, "-c", "import servicebus.ops.cli"], capture_output=True,
                           text=True, timeout=60, cwd="/", env=os.environ)
    if probe.returncode != 0:
        pytest.skip(f"uid {NOBODY} cannot run this venv's python and import servicebus from "
                    f"{os.environ.get('PYTHONPATH') or 'the venv'}: {probe.stderr.strip()[-200:]}")
    return walkable_dir


@pytest.mark.parametrize("private", ["its lock file", "its admin folder", "its data directory"])
def test_status_run_by_another_user_against_a_live_bus_says_permission_denied_at_once(
        as_nobody, private):
    node = BusProcess(as_nobody, "node", free_address())
    try:
        node.start()
        if private == "its admin folder":
            (node.datadir / "LOCK").chmod(0o644)  # as older versions made it: readable
        elif private == "its data directory":
            node.datadir.chmod(0o700)
        result, took = cli_as(NOBODY, "status", node.datadir)
        assert result.returncode == 5, result.stdout + result.stderr
        assert "permission denied" in result.stderr.lower(), result.stderr
        assert "run it as root" in result.stderr.lower(), result.stderr  # the bus's user, named
        assert "did not answer" not in result.stderr and "Traceback" not in result.stderr
        assert {"its lock file": "LOCK", "its admin folder": "admin endpoint",
                "its data directory": "cannot be read"}[private] in result.stderr  # what it met
        assert took < 10, f"took {took:.1f}s"
        assert cli("status", node.datadir).returncode == 0  # its own user is served as ever
    finally:
        node.kill()


def test_status_run_by_another_user_against_a_stopped_bus_says_permission_denied(as_nobody):
    with Bus(free_address(), as_nobody / "node"):
        pass
    result, _took = cli_as(NOBODY, "status", as_nobody / "node")
    assert result.returncode == 5, result.stdout + result.stderr
    assert "permission denied" in result.stderr.lower() and "run it as root" in result.stderr.lower(), result.stderr
    assert "--repair" not in result.stderr and "Traceback" not in result.stderr


# --- listings cut at --limit ----------------------------------------------------------------

CUT = 1031  # rows in each listing: more than the default limit of 100


@pytest.fixture
def long_listings(make_bus):
    """Live buses with 1,031 rows in each listing: dead letters at a publisher whose
    subscriber's backlog dropped the oldest (the case read as 931 lost), messages owed at
    another, incoming not handled (no handler) at a subscriber."""
    dropper = make_bus("dropper", max_backlog=100, backlog_policy="drop_oldest")
    pub, recv, gone = make_bus("pub"), make_bus("recv"), make_bus("gone")
    gone.subscribe(dropper.address, "drop.t", wait=10)
    gone.subscribe(pub.address, "out.t", wait=10)
    gone.close()
    recv.subscribe(pub.address, "in.t", wait=10)
    # Backlog drops go by whole segments (a publish's messages, model/segments.py): 31, then
    # 100 at a time, so that exactly the oldest CUT go and the newest 100 stay.
    sizes = [31] + [100] * ((CUT - 31) // 100 + 1)
    for start, size in zip(itertools.accumulate([0] + sizes), sizes):
        dropper.publish_many("drop.t", [{"n": n} for n in range(start, start + size)])
    pub.publish_many("out.t", [{"n": n} for n in range(CUT)])
    pub.publish_many("in.t", [{"n": n} for n in range(CUT)])
    wait_until(lambda: dropper.status().deadletters == CUT and recv.status().incoming == CUT, 30)
    return {"deadletters": dropper, "outgoing": pub, "incoming": recv}


@pytest.mark.parametrize("listing", ["deadletters", "outgoing", "incoming"])
def test_a_listing_cut_at_its_limit_says_how_many_of_how_many_and_how_to_see_all(long_listings, listing):
    datadir = long_listings[listing].datadir
    table = cli(listing, datadir)
    assert table.returncode == 0, table.stderr
    assert f"100 of {CUT:,} shown" in table.stdout and "--limit 0" in table.stdout, table.stdout[-400:]
    assert max(len(line) for line in table.stdout.splitlines()) <= 80
    as_json = cli(listing, datadir, "--json")
    rows = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert len(rows) == 100 and all("id" in row for row in rows)  # stdout: rows, as before
    notice = json.loads(as_json.stderr.strip().splitlines()[-1])  # stderr: what a script checks
    assert notice["shown"] == 100 and notice["total"] == CUT and notice["truncated"] is True
    for see_all in (("--limit", "0"), ("--all",)):
        whole = cli(listing, datadir, *see_all, "--json")
        assert len(whole.stdout.splitlines()) == CUT and whole.stderr == "", (see_all, whole.stderr)


def test_a_listing_cut_at_its_limit_says_so_from_a_stopped_bus_too_and_counts_within_its_filter(long_listings):
    dropper = long_listings["deadletters"]
    dropper.close()
    table = cli("deadletters", dropper.datadir, "--topic", "drop.t", "--limit", "10")
    assert f"10 of {CUT:,} shown" in table.stdout, table.stdout[-400:]
    roomy = cli("deadletters", dropper.datadir, "--limit", "5000", "--json")  # under its limit: as ever
    assert len(roomy.stdout.splitlines()) == CUT and roomy.stderr == ""
    assert cli_json("deadletters", dropper.datadir, "--topic", "other.t") == []
    bad = cli("deadletters", dropper.datadir, "--limit", "-1")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr


def test_a_listing_from_a_bus_that_does_not_say_its_total_says_there_may_be_more_when_full():
    from servicebus.ops.clitable import cut_notice

    assert cut_notice(100, None, 100)["note"].startswith("100 shown, the limit: there may be more")
    assert cut_notice(40, None, 100) is None  # under its limit: the whole listing
    assert cut_notice(100, 100, 100) is None  # exactly all of them


# --- what came off the wire, printed -------------------------------------------------------


def test_a_listing_prints_what_came_off_the_wire_as_text_never_as_markup_or_terminal_control(make_bus, tmp_path):
    """Anyone who reaches a bus's port chooses topics, payloads and, through a handler that
    raises, error texts: the operator's terminal must show them, not obey them."""
    hostile = "[/bold] [link=https://example.invalid]x[/link] \x1b]52;c;cHduZWQ=\x07 \x1b[2J"
    server = make_bus("server", max_attempts=1)

    def fail(payload, message):
        raise ValueError(hostile)

    server.handle("work", fail)
    client = make_bus("client")
    client.send(server.address, "work", {"x": hostile})
    wait_until(lambda: server.status().deadletters == 1, 20)
    for args in ((), ("--full",)):
        table = cli("deadletters", server.datadir, *args)
        assert table.returncode == 0 and "Traceback" not in table.stderr, table.stderr[-500:]
        assert "[/bold]" in table.stdout and "[link=" in table.stdout  # as written
        assert "\x1b" not in table.stdout and "\x07" not in table.stdout  # no terminal control
    rows = cli_json("deadletters", server.datadir)
    assert rows[0]["error"] == f"ValueError: {hostile}" and rows[0]["payload"] == {"x": hostile}
