"""A damaged data directory: never a hang, never silently empty, always repairable
(DESIGN.md section 3, rule 9). Real damage: files deleted, records overwritten with junk,
tables truncated, bits flipped."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import plyvel
import pytest

from servicebus import Bus, StoreError
from servicebus.model.delivery import unpack_outgoing
from servicebus.store.lockfile import probe
from servicebus.store import Store
from servicebus.hooks.journal import FLUSH_CHUNK
from servicebus.hooks.segments import events_of_line, segment_seq
from servicebus.testing import free_address, wait_until

from ..journals import journal_events, segment_files

TOPIC = "user.signup"
CLI = str(Path(sys.executable).parent / "servicebus")


def cli(*args):
    return subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, timeout=120)


def compact(datadir: Path) -> None:
    db = plyvel.DB(str(datadir / "store"))
    db.compact_range()
    db.close()


def publisher_with_backlog(tmp_path, n=100, pad=0, sessions=1, each=False):
    """A stopped publisher owing ``n`` messages to a stopped subscriber; returns their
    addresses and the message ids. Each of ``sessions`` publishes its share and closes: the
    next open turns that session's log into a table file of its own. A share is one
    ``publish_many`` (stored as segments of many messages, model/segments.py), or with
    ``each`` one ``publish`` per message (a segment of one each)."""
    pub = Bus(free_address(), tmp_path / "pub")
    sub = Bus(free_address(), tmp_path / "sub")
    sub.subscribe(pub.address, TOPIC, wait=10)
    sub.close()
    address, ids = pub.address, []
    for session in range(sessions):
        if session:
            pub = Bus(address, tmp_path / "pub")
        # Random padding does not compress: each session's table holds its messages.
        share = range(session * n // sessions, (session + 1) * n // sessions)
        payloads = [{"n": i, "pad": os.urandom(pad)} for i in share]
        ids += [pub.publish(TOPIC, p) for p in payloads] if each else pub.publish_many(TOPIC, payloads)
        pub.close()
    return address, sub.address, ids


def held(store: Store, stream: str) -> list[str]:
    """The ids of the messages a stream's segments hold, in order (the stream's keys are
    only each segment's first)."""
    return [mid for _key, data in store.iter_stream(stream) for mid in unpack_outgoing(data).ids]


def delivered_after_restart(tmp_path, pub_address, sub_address, expected: int) -> set[int]:
    got: set[int] = set()
    with Bus(pub_address, tmp_path / "pub") as pub, Bus(sub_address, tmp_path / "sub") as sub:
        sub.every(TOPIC, lambda payload, message: got.add(payload["n"]))
        wait_until(lambda: len(got) >= expected, 20, message=lambda: f"{len(got)} of {expected}")
        assert pub.drain(10)
    return got


def servicebus_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("servicebus")]


# --- a missing CURRENT file --------------------------------------------------------------------


def test_a_store_without_its_current_file_is_refused_and_repair_brings_its_messages_back(tmp_path):
    pub_address, sub_address, ids = publisher_with_backlog(tmp_path)
    compact(tmp_path / "pub")  # the messages now live in a table file, not in the log
    store = tmp_path / "pub" / "store"
    (store / "CURRENT").unlink()
    files = sorted(p.name for p in store.iterdir())
    with pytest.raises(StoreError, match=r"servicebus check --repair"):
        Bus(pub_address, tmp_path / "pub")
    assert sorted(p.name for p in store.iterdir()) == files, "opening must not touch a damaged store"
    assert not probe(tmp_path / "pub")[1]
    assert cli("check", tmp_path / "pub").returncode == 4
    repaired = cli("check", tmp_path / "pub", "--repair")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert delivered_after_restart(tmp_path, pub_address, sub_address, 100) == set(range(100))


def test_a_data_directory_without_any_store_gets_a_new_one(tmp_path):
    with Bus(free_address(), tmp_path / "fresh") as bus:
        assert bus.status().outgoing == 0
    assert (tmp_path / "fresh" / "store" / "CURRENT").exists()


# --- records that do not decode ---------------------------------------------------------------

# keyspace -> how to find a key of it in the publisher's or subscriber's store
KEYSPACES_READ_AT_OPEN = ["subscriptions", "deliveries", "intents", "incoming", "runstate",
                          "replies", "outbox", "meta:node", "meta:clock", "meta:format"]
PREFIX = {"subscriptions": b"s/", "deliveries": b"d/", "intents": b"i/", "incoming": b"n/",
          "runstate": b"r/", "replies": b"y/", "outbox": b"u/", "meta:node": b"m/node", "meta:clock": b"m/clock",
          "meta:format": b"m/format"}


def data_directory_with_every_keyspace(tmp_path) -> tuple[Path, Path]:
    """A publisher (subscriptions, deliveries) and a subscriber (intents, incoming with run
    state, a reply and a handler's command waiting to be queued), both stopped."""
    pub = Bus(free_address(), tmp_path / "pub")
    sub = Bus(free_address(), tmp_path / "sub")
    sub.subscribe(pub.address, TOPIC, wait=10)
    sub.every(TOPIC, lambda payload, message: 1 / 0)  # fails: leaves a run state
    pub.publish(TOPIC, {"n": 1})
    sub.send(pub.address, "never.handled", {"n": 2})
    wait_until(lambda: sub.status().incoming == 1, 10)
    wait_until(lambda: pub.status().incoming == 1, 10)
    pub_address = pub.address
    pub.close()
    sub.close()
    db = plyvel.DB(str(tmp_path / "sub" / "store"))
    (incoming_key,) = list(db.iterator(prefix=b"n/", include_value=False))
    db.put(b"y/" + incoming_key[2:], b"\x94\xa1x\xa1y\xc0\xc4\x00")  # a reply record, well formed
    # a handler's command in the outbox, well formed: [address, command, body, expires, headers, due]
    db.put(b"u/" + incoming_key[2:] + b"\x00h:000000",
           msgpack.packb([pub_address, "never.handled", b"\x80", None, None, None]))
    db.close()
    return tmp_path / "pub", tmp_path / "sub"


@pytest.mark.parametrize("keyspace", KEYSPACES_READ_AT_OPEN)
def test_an_undecodable_record_makes_bus_raise_store_error_naming_its_keyspace_at_once(tmp_path, keyspace):
    pub_dir, sub_dir = data_directory_with_every_keyspace(tmp_path)
    for datadir in (pub_dir, sub_dir):
        db = plyvel.DB(str(datadir / "store"))
        keys = [k for k in db.iterator(prefix=PREFIX[keyspace], include_value=False)]
        for key in keys:
            db.put(key, b"\xc1 garbage \xff")
        db.close()
        if keys:
            break
    assert keys, f"no {keyspace} record to damage"
    began = time.monotonic()
    with pytest.raises(StoreError) as info:
        Bus(free_address(), datadir)
    assert time.monotonic() - began < 1.0
    assert keyspace.split(":")[0] in str(info.value)
    assert "servicebus check --repair" in str(info.value)
    assert not probe(datadir)[1] and not (datadir / "LOCK").exists()
    assert servicebus_threads() == []
    # check lists it and exits 4; repair makes the directory usable again
    found = cli("check", datadir, "--json")
    assert found.returncode == 4, found.stdout + found.stderr
    assert "Traceback" not in found.stderr
    assert any(keyspace.split(":")[0] == json.loads(line)["keyspace"] for line in found.stdout.splitlines())
    fixed = cli("check", datadir, "--repair")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert cli("check", datadir).returncode == 0
    with Bus(free_address(), datadir):
        pass


# --- every step of opening can fail, and unwinds exactly what it opened ------------------------

OPEN_STEPS = [
    ("servicebus.lifecycle.DataDirLock.acquire", "taking the lock"),
    ("servicebus.lifecycle.Store.open", "opening the store"),
    ("servicebus.store.Store.bus_clock", "reading the bus clock"),
    ("servicebus.engine.sockets.Sockets.bind_router", "binding the router"),
    ("servicebus.engine.sockets.Sockets.bind_admin", "binding the admin endpoint"),
    ("servicebus.lifecycle.Journal.__init__", "making the journal"),
    ("servicebus.lifecycle.Dispatcher.__init__", "making the dispatcher"),
    ("servicebus.core.machine.Core.load", "loading delivery state"),
    ("servicebus.handling.dispatch.Dispatcher.start", "starting the workers"),
    ("servicebus.engine.loop.Engine.start", "starting the engine"),
    ("servicebus.hooks.journal.Journal.start", "starting the journal"),
]


class Injected(Exception):
    pass


@pytest.mark.parametrize("target, step", OPEN_STEPS, ids=[s for _, s in OPEN_STEPS])
def test_a_failure_at_any_step_of_opening_closes_what_was_opened_and_releases_the_lock(
        tmp_path, monkeypatch, target, step):
    datadir = tmp_path / "node"
    with Bus(free_address(), datadir) as bus:  # a store with something in it
        bus.subscribe(free_address(), TOPIC)
    address = free_address()

    def fail(*args, **kwargs):
        raise Injected(step)

    monkeypatch.setattr(target, fail)
    began = time.monotonic()
    with pytest.raises(Injected):
        Bus(address, datadir)
    assert time.monotonic() - began < 2.0
    monkeypatch.undo()
    wait_until(lambda: servicebus_threads() == [], 5, message=lambda: f"threads left: {servicebus_threads()}")
    assert not probe(datadir)[1]
    with Bus(address, datadir) as bus:  # the port, the store and the lock are free again
        assert bus.status().intents == 1


# --- damaged table files ----------------------------------------------------------------------


def test_repair_of_a_truncated_table_reports_by_id_what_it_could_not_recover(tmp_path):
    pub_address, sub_address, ids = publisher_with_backlog(tmp_path, n=600, pad=1000, sessions=4)
    tables = sorted((tmp_path / "pub" / "store").glob("*.ldb"))
    assert len(tables) >= 3, "the backlog should span several table files"
    victim = tables[1]  # the second session's messages
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(StoreError, match="servicebus check --repair"):
        with Bus(pub_address, tmp_path / "pub") as bus:
            bus.status()  # the damaged table is read at the latest here
    assert cli("check", tmp_path / "pub").returncode == 4
    repaired = cli("check", tmp_path / "pub", "--repair", "--json")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    rows = [json.loads(line) for line in repaired.stdout.splitlines()]
    lost = {row["key"] for row in rows if row["problem"].startswith("lost")}
    assert lost and lost < set(ids), f"repair reported no loss, or not by id: {rows[:5]}"
    # What it says it lost is exactly what no longer arrives; everything else does.
    kept = delivered_after_restart(tmp_path, pub_address, sub_address, len(ids) - len(lost))
    assert {ids[n] for n in kept} == set(ids) - lost
    assert cli("check", tmp_path / "pub").returncode == 0


# --- damage found while running ---------------------------------------------------------------


def test_a_message_whose_stored_record_is_damaged_becomes_a_dead_letter_and_the_rest_go_out(tmp_path):
    pub_address, sub_address, ids = publisher_with_backlog(tmp_path, n=20, each=True)
    db = plyvel.DB(str(tmp_path / "pub" / "store"))
    victim = next(k for k in db.iterator(prefix=b"o/", include_value=False) if k.endswith(ids[7].encode()))
    db.put(victim, b"\xc1 junk")
    db.close()
    got = delivered_after_restart(tmp_path, pub_address, sub_address, 19)
    assert got == set(range(20)) - {7}
    listed = subprocess.run([CLI, "deadletters", tmp_path / "pub", "--json"], capture_output=True, text=True)
    (letter,) = [json.loads(line) for line in listed.stdout.splitlines()]
    assert letter["id"] == ids[7] and letter["reason"] == "damaged"


def test_a_damaged_segment_of_several_messages_is_checked_and_repaired_naming_each_of_them(tmp_path):
    """A record holds a whole publish's messages: damaged, it loses them all. check says which
    by id (the ids still read where its payloads do not); repair drops it and keeps the rest."""
    pub = Bus(free_address(), tmp_path / "pub")
    sub = Bus(free_address(), tmp_path / "sub")
    sub.subscribe(pub.address, TOPIC, wait=10)
    sub.close()
    address, sub_address = pub.address, sub.address
    pub.publish_many(TOPIC, [{"n": n} for n in range(3)])
    second = pub.publish_many(TOPIC, [{"n": n} for n in range(3, 7)])
    pub.close()
    db = plyvel.DB(str(tmp_path / "pub" / "store"))
    victim = b"o/e:" + TOPIC.encode() + b"\x00" + second[0].encode()
    record = msgpack.unpackb(db.get(victim), raw=False)
    record[7] = record[7][:-3]  # its payloads cut short: the ids still read
    db.put(victim, msgpack.packb(record))
    db.close()
    found = cli("check", tmp_path / "pub", "--json")
    assert found.returncode == 4, found.stdout + found.stderr
    (row,) = [json.loads(line) for line in found.stdout.splitlines()]
    assert row["keyspace"] == "outgoing" and row["problem"].endswith("its messages: " + ", ".join(second))
    fixed = cli("check", tmp_path / "pub", "--repair", "--json")
    assert fixed.returncode == 0 and "LOST" in json.loads(fixed.stdout.splitlines()[0])["action"]
    assert cli("check", tmp_path / "pub").returncode == 0
    assert delivered_after_restart(tmp_path, address, sub_address, 3) == {0, 1, 2}


def test_a_damaged_journal_record_is_set_aside_and_the_journal_goes_on(tmp_path):
    datadir = tmp_path / "node"
    with Bus(free_address(), datadir, journal=True) as bus:
        bus.send(free_address(), "c", 1)
    db = plyvel.DB(str(datadir / "store"))
    db.put(b"j/" + (10**9).to_bytes(8, "big"), b"\xc1 junk")
    db.close()
    with Bus(free_address(), datadir) as bus:
        bus.send(free_address(), "c", 2)
        wait_until(lambda: list((datadir / "journal").glob("*.damaged")), 10)
    events = journal_events(datadir)
    assert [e["event"] for e in events].count("published") == 2


# --- a lost or cut LevelDB log -----------------------------------------------------------------


def _damage_log(store: Path, how: str) -> None:
    (log,) = sorted(store.glob("*.log"))
    if how == "deleted":
        log.unlink()
    elif how == "zeroed":
        log.write_bytes(bytes(log.stat().st_size))
    else:  # cut in half
        data = log.read_bytes()
        log.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("how", ["deleted", "zeroed", "cut"])
def test_a_store_whose_log_was_lost_or_cut_is_refused_and_repair_reports_every_lost_id(tmp_path, how):
    # 3,000 messages owed, all in the log (the memtable was never written to a table): the
    # store would open with none, or some, of them, and nothing would say so (issue 26).
    pub_address, sub_address, ids = publisher_with_backlog(tmp_path, n=3000)
    _damage_log(tmp_path / "pub" / "store", how)
    with pytest.raises(StoreError, match=r"lost writes.*servicebus check --repair"):
        Bus(pub_address, tmp_path / "pub")
    assert not probe(tmp_path / "pub")[1]
    checked = cli("check", tmp_path / "pub", "--json")
    assert checked.returncode == 4, checked.stdout + checked.stderr
    assert any("lost writes" in json.loads(line)["problem"] for line in checked.stdout.splitlines())
    repaired = cli("check", tmp_path / "pub", "--repair", "--json")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    rows = [json.loads(line) for line in repaired.stdout.splitlines()]
    lost = {row["key"] for row in rows if row["problem"].startswith("lost")}
    store = Store.open(tmp_path / "pub" / "store", create=False)
    try:
        kept = set(held(store, "e:" + TOPIC))
    finally:
        store.close()
    assert not kept & lost and kept | lost == set(ids), (
        f"{len(lost)} reported lost, {len(kept)} kept, of {len(ids)}")
    assert cli("check", tmp_path / "pub").returncode == 0
    with Bus(pub_address, tmp_path / "pub") as pub:
        assert pub.status().outgoing == len(kept)


def as_older_segments(datadir: Path) -> None:
    """Rewrite a stopped bus's .jcol segments as the .jsonl segments buses wrote before
    (hooks/segments.py): one line per event, ``ids`` naming a segment's messages, ``id`` the
    first of them. An event is a run of entries of one key, time, attempt and error: right
    for the tests that use this, whose events of one key never share a millisecond."""
    for path in segment_files(datadir):
        if path.suffix != ".jcol":
            continue
        out = []
        for text in path.read_text().splitlines():
            line = json.loads(text)
            events = events_of_line(line)
            runs: list[list[dict]] = []
            for n, e in enumerate(events):
                same = (line["k"][n], e["ts"], e["attempt"], e.get("error"))
                if runs and runs[-1][0][1] == same:
                    runs[-1].append((e, same))
                else:
                    runs.append([(e, same)])
            for run in runs:
                first = run[0][0]
                out.append({**first, "ids": [e["id"] for e, _ in run]} if len(run) > 1 else first)
        path.with_suffix(".jsonl").write_text("".join(json.dumps(e) + "\n" for e in out))
        path.unlink()
    assert all(p.suffix == ".jsonl" for p in segment_files(datadir))


@pytest.mark.parametrize("segments", [".jcol", ".jsonl"])  # as a bus writes them; of a bus before .jcol
def test_repair_after_a_lost_log_reports_exactly_what_it_lost_of_a_topic_with_priority_streams(tmp_path, segments):
    # Events of priority 3 are in a stream of their own ("e:<topic> 3") that the journal
    # does not name: the ones the store kept must not be reported lost with the others.
    # The journal (check reads it: ops/lost.py journal_owed) names the 50 of a publish in one
    # event; a segment's later messages are found in the store by its key, the first id.
    pub = Bus(free_address(), tmp_path / "pub")
    sub = Bus(free_address(), tmp_path / "sub")
    sub.subscribe(pub.address, TOPIC, wait=10)
    sub.close()
    address = pub.address
    kept = pub.publish_many(TOPIC, [{"n": n} for n in range(50)], priority=3)
    pub.close()
    with Bus(address, tmp_path / "pub") as pub:  # opening turns the last log into a table
        lost = pub.publish_many(TOPIC, [{"n": n} for n in range(50, 100)])
    published = [e["id"] for e in journal_events(tmp_path / "pub") if e["event"] == "published"]
    assert sorted(published) == sorted(kept + lost)  # the journal has them all, whatever the store lost
    if segments == ".jsonl":
        as_older_segments(tmp_path / "pub")
    _damage_log(tmp_path / "pub" / "store", "deleted")
    repaired = cli("check", tmp_path / "pub", "--repair", "--json")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    rows = [json.loads(line) for line in repaired.stdout.splitlines()]
    reported = {row["key"] for row in rows if row["problem"].startswith("lost")}
    assert reported == set(lost), f"{len(reported & set(kept))} kept ones reported lost"
    store = Store.open(tmp_path / "pub" / "store", create=False)
    try:
        assert held(store, f"e:{TOPIC} 3") == kept
    finally:
        store.close()
    assert cli("check", tmp_path / "pub").returncode == 0


@pytest.mark.parametrize("segments", [".jcol", ".jsonl"])
def test_repair_of_a_damaged_journal_number_keeps_new_segments_past_those_of_either_format(tmp_path, segments):
    # Segments are named by their first record's number: repair restores the journal's
    # number past every segment there is (ops/repair.py _last_segment_seq), or the bus would
    # number its next records from 1 again and a segment would be written over.
    datadir = tmp_path / "node"
    with Bus(free_address(), datadir) as bus:
        bus.send(free_address(), "c", 1)  # no receiver: journaled all the same
    if segments == ".jsonl":
        as_older_segments(datadir)
    (before,) = segment_files(datadir)
    assert before.suffix == segments and segment_seq(before.name) == 1
    written = before.read_bytes()
    db = plyvel.DB(str(datadir / "store"))
    db.put(b"m/journal_flushed", b"\xff not a number")
    db.close()
    assert cli("check", datadir).returncode == 4
    repaired = cli("check", datadir, "--repair", "--json")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert any(json.loads(line)["key"] == "journal_flushed" for line in repaired.stdout.splitlines())
    assert cli("check", datadir).returncode == 0
    with Bus(free_address(), datadir) as bus:
        bus.send(free_address(), "c", 2)
    first, after = segment_files(datadir)
    assert first == before and first.read_bytes() == written  # never written again
    assert after.suffix == ".jcol" and segment_seq(after.name) > 1 + FLUSH_CHUNK - 1
    assert [e["event"] for e in journal_events(datadir)].count("published") == 2


def test_a_data_directory_whose_store_was_deleted_is_refused_not_started_empty(tmp_path):
    pub_address, _sub_address, _ids = publisher_with_backlog(tmp_path, n=10)
    import shutil

    shutil.rmtree(tmp_path / "pub" / "store")
    with pytest.raises(StoreError, match=r"servicebus check --repair"):
        Bus(pub_address, tmp_path / "pub")
