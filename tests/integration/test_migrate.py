"""Data directories written by servicebus v0.2 (store format 2) opened by this version (format
3: messages stored by segment): nothing is lost.

``tests/data/format2.tar.gz`` holds a publisher, its subscriber and a group member as real
v0.2 buses left them, stopped (made by ``tools/make_format2_fixture``, which runs the code
of the last v0.2 commit; its ``manifest.json`` says what each holds, and
``tools/format2_fixture_v02.py`` how it got there). They are upgraded by ``servicebus
migrate`` or by ``Bus()`` opening them, then run: every message owed is delivered once,
every one received and not handled is handled once, dead letters list and replay, kv
values read back, a handled id still refuses its resend, the journal's records flush. A
migration stopped half way (a write that fails, the process killed) is finished by the
next one with every record as an uninterrupted one writes it.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import msgpack
import plyvel
import pytest

from servicebus import Bus
from servicebus.errors import StoreWriteError
from servicebus.store import Store
from servicebus.store import migrate as migration
from servicebus.testing import wait_until

from ..journals import journal_events

FIXTURE = Path(__file__).resolve().parent.parent / "data" / "format2.tar.gz"
CLI = str(Path(sys.executable).parent / "servicebus")
ROOT = Path(__file__).resolve().parent.parent.parent


def cli(*args):
    return subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "80"})


def cli_json(*args):
    result = cli(*args, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def records(datadir: Path) -> dict[bytes, bytes]:
    """Every record of a stopped bus's store but its high-water mark (every synced write
    moves it)."""
    db = plyvel.DB(str(datadir / "store"))
    try:
        return {k: v for k, v in db.iterator() if k != b"m/hwm"}
    finally:
        db.close()


def format_of(datadir: Path) -> bytes:
    return records(datadir)[b"m/format"]


class Old:
    """The fixture, extracted: ``dirs[name]`` (pub, sub, member), ``m`` (its manifest)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.m = json.loads((root / "manifest.json").read_text())
        self.dirs = {name: root / name for name in self.m["datadirs"]}
        self.addr = self.m["addresses"]


@pytest.fixture
def old(tmp_path) -> Old:
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(tmp_path / "format2", filter="data")
    fixture = Old(tmp_path / "format2")
    for name in ("pub", "sub", "member"):
        port = int(fixture.addr[name].rsplit(":", 1)[1])
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
            try:
                probe.bind(("127.0.0.1", port))
            except OSError as exc:
                pytest.skip(f"the fixture's buses listen on fixed ports, and {port} is taken: {exc}")
    return fixture


def format2_records(stored: dict[bytes, bytes]) -> dict[str, int]:
    """The records of a format-2 store that a migration rewrites, by keyspace: every
    message (one record each in format 2), and dead letters that keep their message."""
    return {"outgoing": sum(k[:2] == b"o/" for k in stored), "incoming": sum(k[:2] == b"n/" for k in stored),
            "deadletters": sum(k[:2] == b"x/" and "record" in msgpack.unpackb(v, raw=False)
                               for k, v in stored.items())}


# --- servicebus migrate ------------------------------------------------------------------------


def test_migrate_upgrades_a_stopped_bus_reports_what_it_rewrote_and_the_listings_show_every_message(old):
    pub, sub = old.dirs["pub"], old.dirs["sub"]
    before = {name: records(d) for name, d in old.dirs.items()}
    assert {format_of(d) for d in old.dirs.values()} == {b"2"}
    # Until then, every other command says what to do rather than read format 2 as damage.
    for args in (("status", pub), ("outgoing", pub), ("check", pub), ("deadletters", sub)):
        refused = cli(*args)
        assert refused.returncode == 1, (args, refused.stdout + refused.stderr)
        assert f"servicebus migrate {pub if args[1] == pub else sub}" in refused.stderr
        assert "Traceback" not in refused.stderr
    assert records(pub) == before["pub"]  # nothing was written
    for name, datadir in old.dirs.items():
        (report,) = cli_json("migrate", datadir)
        expected = format2_records(before[name])
        assert report["from"] == 2 and report["to"] == 3 and report["left"] == {}
        assert report["rewritten"] == {k: n for k, n in expected.items() if n}, name
        assert format_of(datadir) == b"3"
        assert cli("check", datadir).returncode == 0, cli("check", datadir).stdout
    again = cli("migrate", pub)
    assert again.returncode == 0 and "already format 3; nothing to rewrite" in again.stdout
    # The listings show what v0.2 left, message by message.
    owed = old.m["pub"]["owed_to_sub"]
    rows = cli_json("outgoing", pub, "--subscriber", old.addr["sub"], "--all")
    assert {r["payload"]["tag"] for r in rows} == set(owed) | {"dedupe"}
    assert {r["id"] for r in rows} >= {mid for mid in owed.values() if mid}
    assert {r["id"] for r in cli_json("outgoing", pub, "--subscriber", "group:billing")} == \
        set(old.m["pub"]["owed_to_group"].values())
    status = cli_json("status", pub)[0]
    assert status["pending_by_peer"][old.addr["sub"]] == len(owed) + 1 and status["incoming"] == 2
    incoming = {r["id"]: r for r in cli_json("incoming", sub)}
    assert {mid: r["payload"]["tag"] for mid, r in incoming.items()} == old.m["sub"]["incoming"]
    retry = old.m["sub"]["retry"]
    assert incoming[retry["id"]]["attempts"] == retry["attempts"]
    assert incoming[retry["id"]]["last_error"] == "Retry: fixture: later"
    letters = {r["id"]: r for r in cli_json("deadletters", sub)}
    assert {mid: [r["origin"], r["reason"]] for mid, r in letters.items()} == \
        {mid: want[:2] for mid, want in old.m["sub"]["deadletters"].items()}
    assert {mid: (r["payload"] or {}).get("tag") for mid, r in letters.items()
            if isinstance(r["payload"], dict) and "tag" in r["payload"]} == \
        {mid: want[2] for mid, want in old.m["sub"]["deadletters"].items() if want[2]}


def test_migrate_refuses_a_data_directory_a_live_bus_holds(old, make_bus):
    member = make_bus("member", address=old.addr["member"], datadir=old.dirs["member"])
    refused = cli("migrate", old.dirs["member"])
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert str(os.getpid()) in refused.stderr and "Traceback" not in refused.stderr
    assert member.status().running


# --- nothing lost ------------------------------------------------------------------------------


class Handled:
    """Every run of a handler on the new buses: (topic, tag, id, attempt), in order."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, str, str, int]] = []
        self.lock = threading.Lock()

    def __call__(self, payload, message) -> None:
        with self.lock:
            self.runs.append((message.topic, payload["tag"], message.id, message.attempt))

    def tags(self, topic: str | None = None) -> Counter:
        with self.lock:
            return Counter(tag for t, tag, _, _ in self.runs if topic is None or t == topic)

    def ids(self) -> dict[str, str]:
        with self.lock:
            return {tag: mid for _, tag, mid, _ in self.runs}


def start(old: Old, make_bus, handled: Handled, suffix: str = "") -> dict[str, Bus]:
    """The three buses of the fixture, this version, where the old ones were; every topic and
    command they were sent handled by ``handled``."""
    pub = make_bus("pub" + suffix, address=old.addr["pub"], datadir=old.dirs["pub"])
    sub = make_bus("sub" + suffix, address=old.addr["sub"], datadir=old.dirs["sub"])
    member = make_bus("member" + suffix, address=old.addr["member"], datadir=old.dirs["member"])
    for command in ("unhandled.p", "cmd.back"):
        pub.handle(command, handled)
    for topic in ("orders.t", "ordered.t", "unhandled.t", "retry.t", "dedupe.t", "handled.t", "fails.t",
                  "rejects.t", "sends.t"):
        sub.every(topic, handled)
    for command in ("orders.cmd", "unhandled.cmd"):
        sub.handle(command, handled)
    member.every("billing.t", handled)
    return {"pub": pub, "sub": sub, "member": member}


@pytest.mark.parametrize("upgrade", ["servicebus migrate", "Bus() at open"])
def test_nothing_v02_left_is_lost_after_the_upgrade(old, make_bus, upgrade):
    m = old.m
    if upgrade == "servicebus migrate":
        for datadir in old.dirs.values():
            assert cli("migrate", datadir).returncode == 0
    handled = Handled()
    buses = start(old, make_bus, handled)
    pub, sub = buses["pub"], buses["sub"]
    owed = m["pub"]["owed_to_sub"]
    expected = Counter({**{tag: 1 for tag in owed}, **{tag: 1 for tag in m["sub"]["incoming"].values()},
                        **{tag: 1 for tag in m["pub"]["incoming"].values()},
                        **{tag: 1 for tag in m["pub"]["owed_to_group"]}, "cmd.back": 1})
    # The retried one runs when its run state says (30 s after the fixture was made).
    due = max(0.0, (m["made_at_ms"] + 31_000) / 1000 - time.time())
    wait_until(lambda: handled.tags() == expected, 30 + due,
               message=lambda: f"missing {expected - handled.tags()}, extra {handled.tags() - expected}")
    wait_until(lambda: pub.status().pending == 0 and sub.status().incoming == 0, 20,
               message=lambda: f"{pub.status()}\n{sub.status()}")
    assert pub.drain(10) and sub.drain(10)
    time.sleep(1.0)  # a duplicate would come now, if one were coming
    # Each message once: the ones owed (by the ids v0.2 gave them), the ones it had received.
    assert handled.tags() == expected
    ids = handled.ids()
    assert {tag: ids[tag] for tag, mid in owed.items() if mid} == {t: mid for t, mid in owed.items() if mid}
    assert {ids[tag]: tag for tag in m["sub"]["incoming"].values()} == m["sub"]["incoming"]
    # What v0.2 handled is not handled again: the resent dedupe.t is refused by its handled id.
    assert not handled.tags("dedupe.t") and not handled.tags("handled.t") and not handled.tags("sends.t")
    with handled.lock:
        runs = list(handled.runs)
    assert [tag for t, tag, _, _ in runs if t == "ordered.t"] == ["ordered-0", "ordered-1", "ordered-2"]
    (retry,) = [r for r in runs if r[0] == "retry.t"]
    assert retry[2:] == (m["sub"]["retry"]["id"], 2)  # its run state came along: the 2nd attempt
    # The handler's command v0.2 left in the outbox went out, once, as sent.
    assert [r[1] for r in runs if r[0] == "cmd.back"] == ["cmd.back"]
    # kv values, bytes and all.
    for bus, kv in ((pub, m["pub"]["kv"]), (sub, m["sub"]["kv"])):
        for key, value in kv.items():
            want = base64.b64decode(value["base64"]) if isinstance(value, dict) and "base64" in value else value
            assert bus.kv.get(key) == want, key
    # Dead letters of each origin, as they were.
    for name in ("pub", "sub"):
        letters = {d.id: d for d in buses[name].deadletters()}
        assert {mid: [d.origin, d.reason] for mid, d in letters.items()} == \
            {mid: want[:2] for mid, want in m[name]["deadletters"].items()}
    # The publisher's journal records (in its store since v0.2 wrote them) went to segment files.
    for bus in buses.values():
        bus.close()
    published = {e["id"] for e in journal_events(old.dirs["pub"]) if e["event"] == "published"}
    assert published >= {mid for mid in owed.values() if mid} | set(m["pub"]["owed_to_group"].values())
    assert not [k for k in records(old.dirs["pub"]) if k[:2] == b"j/"]
    for datadir in old.dirs.values():
        checked = cli("check", datadir)
        assert checked.returncode == 0, checked.stdout + checked.stderr

    # Replay: the subscriber's letters go back to incoming (not the invalid one), the
    # publisher's to their streams under new ids; each is handled or delivered once.
    rows = {r["id"]: r for r in cli_json("replay", old.dirs["sub"], "--all")}
    assert {mid: r["result"] for mid, r in rows.items()} == {
        mid: "skipped" if want[1] == "invalid" else "replayed" for mid, want in m["sub"]["deadletters"].items()}
    rows = {r["id"]: r for r in cli_json("replay", old.dirs["pub"], "--all")}
    assert {r["result"] for r in rows.values()} == {"replayed"}, rows
    again = Handled()
    buses = start(old, make_bus, again, suffix="-again")
    wanted = Counter({"fails": 1, "rejects": 1, "expiring": 1})
    wait_until(lambda: again.tags() == wanted, 30, message=lambda: f"{again.tags()}")
    time.sleep(1.0)
    assert again.tags() == wanted
    # The undecodable one is a dead letter again (its payload still does not decode); the
    # command to an address nobody answers waits there.
    assert {(d.id, d.reason) for d in buses["sub"].deadletters()} == {
        (mid, want[1]) for mid, want in m["sub"]["deadletters"].items() if want[1] in ("invalid", "undecodable")}
    assert buses["pub"].status().pending_by_subscriber.get(old.addr["nowhere"]) == 1


# --- a migration stopped half way ---------------------------------------------------------------


def reference(old: Old, tmp_path: Path) -> dict[bytes, bytes]:
    """The publisher's records as an uninterrupted migration writes them."""
    copy = tmp_path / "reference"
    shutil.copytree(old.dirs["pub"], copy)
    Store.open(copy / "store").close()
    return records(copy)


def layouts(datadir: Path) -> Counter:
    """How many outgoing records are in each format's layout (7 fields: 2; 8: 3)."""
    return Counter(len(msgpack.unpackb(v, raw=False)) for k, v in records(datadir).items() if k[:2] == b"o/")


def test_a_migration_whose_write_fails_half_way_is_finished_by_the_next_open_with_nothing_lost(
        old, tmp_path, monkeypatch):
    want = reference(old, tmp_path)
    pub = old.dirs["pub"]
    writes = []
    real_write = Store.write

    def failing(self, batch, *, sync):
        if sync and batch.ops and len(writes) >= 3:  # the fourth chunk's write fails
            raise StoreWriteError("injected: the disk is full")
        writes.append(batch.ops)
        return real_write(self, batch, sync=sync)

    monkeypatch.setattr(migration, "CHUNK", 4)
    monkeypatch.setattr(Store, "write", failing)
    with pytest.raises(StoreWriteError, match="injected"):
        Store.open(pub / "store")
    monkeypatch.setattr(Store, "write", real_write)
    outgoing = format2_records(records(pub))["outgoing"]
    assert outgoing > 12  # the failure comes among the outgoing records
    assert format_of(pub) == b"2" and layouts(pub) == Counter({8: 12, 7: outgoing - 12})  # three chunks of four
    assert cli("status", pub).returncode == 1  # still format 2 to the tools
    Store.open(pub / "store").close()  # the next open finishes it
    assert records(pub) == want
    assert cli("check", pub).returncode == 0


KILLED_MIGRATION = textwrap.dedent("""
    import os, signal, sys
    from servicebus.ops.cli import main
    from servicebus.store import Store
    from servicebus.store import migrate

    migrate.CHUNK = 4
    real_write, synced = Store.write, []

    def write(self, batch, *, sync):
        real_write(self, batch, sync=sync)
        if sync and migrate.CHUNK == 4 and batch.ops:
            synced.append(batch.ops)
            if len(synced) == 3:  # after the third chunk is made durable: SIGKILL
                os.kill(os.getpid(), signal.SIGKILL)

    Store.write = write
    sys.argv = ["servicebus", "migrate", sys.argv[1]]
    main()
""")


def test_servicebus_migrate_killed_half_way_is_finished_by_the_next_run_with_nothing_lost(old, tmp_path):
    want = reference(old, tmp_path)
    pub = old.dirs["pub"]
    before = format2_records(records(pub))
    killed = subprocess.run([sys.executable, "-c", KILLED_MIGRATION, str(pub)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert format_of(pub) == b"2" and layouts(pub) == Counter({8: 12, 7: before["outgoing"] - 12})
    assert (pub / "LOCK").exists()  # left by the killed command; stale
    (report,) = cli_json("migrate", pub)
    assert report["rewritten"] == {**before, "outgoing": before["outgoing"] - 12}  # the rest only
    assert records(pub) == want
    assert cli("check", pub).returncode == 0


# --- check --repair of a format-2 store ---------------------------------------------------------


def test_check_repair_upgrades_a_format_2_store_first_and_drops_nothing(old, tmp_path):
    want = reference(old, tmp_path)
    pub = old.dirs["pub"]
    n = sum(format2_records(records(pub)).values())
    rows = cli_json("check", pub, "--repair")
    assert [(r["keyspace"], r["key"], r["action"]) for r in rows] == [
        ("meta", "format", f"upgraded to format 3 ({n} records rewritten)")]
    assert records(pub) == want
    assert cli("check", pub).returncode == 0


def test_a_format_2_store_whose_format_record_is_damaged_is_told_by_its_records_not_dropped(old, tmp_path):
    want = reference(old, tmp_path)
    pub = old.dirs["pub"]
    n = sum(format2_records(records(pub)).values())
    db = plyvel.DB(str(pub / "store"))
    db.put(b"m/format", b"\xff junk")
    db.close()
    checked = cli("check", pub, "--json")
    assert checked.returncode == 4, checked.stdout + checked.stderr
    assert [json.loads(line)["problem"] for line in checked.stdout.splitlines()] == [
        "its format record is damaged; its records are format 2's"]  # not 22 damaged messages
    rows = cli_json("check", pub, "--repair")
    assert [(r["key"], r["action"]) for r in rows] == [("format", f"upgraded to format 3 ({n} records rewritten)")]
    assert records(pub) == want
    assert cli("check", pub).returncode == 0
