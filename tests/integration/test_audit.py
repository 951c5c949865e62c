"""The PySpark delivery audit over synthetic journals with known faults and over journals
written by real buses (one of them killed with SIGKILL mid-run)."""

import json
import time
import os
import shlex
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from servicebus import Bus
from servicebus.audit import job
from servicebus.audit.synthetic import SENDER, write_journals
from servicebus.testing import free_address, wait_until

from ..journals import journal_events, segment_events, segment_files

pytestmark = pytest.mark.spark
pyspark = pytest.importorskip("pyspark", reason="pyspark is not installed (pip install 'servicebus[audit]')")
if job.java_problem():
    pytest.skip(job.java_problem(), allow_module_level=True)

CLI = str(Path(sys.executable).parent / "servicebus")
TOPIC = "user.signup"


def classes_of(spark, out: Path) -> dict[str, set]:
    rows = spark.read.parquet(str(out / "messages")).select("id", "receiver", "class").collect()
    found: dict[str, set] = {}
    for row in rows:
        found.setdefault(row["class"], set()).add((row["id"], row["receiver"]))
    return found


def test_injected_faults_are_reported_exactly(spark, tmp_path):
    injected = write_journals(tmp_path / "fleet", messages=3000, receivers=2, rate=10,  # 5 minutes
                              faults={"lost": 3, "duplicate": 2, "deadletter": 2, "in_flight": 2, "owed": 4})
    # Who the journals are: the sender's file names its data directory; the first receiver's
    # does not (where it was found tells); the second receiver's journal is older than the file.
    fleet, rcv0, rcv1 = tmp_path / "fleet", "tcp://10.0.1.0:6000", "tcp://10.0.1.1:6000"
    (fleet / "sender0000000000" / "journal" / "sender0000000000.bus.json").write_text(json.dumps(
        {"node": "sender0000000000", "datadir": "/srv/my shop", "addresses": {SENDER: "shop"}}))
    (fleet / "receiver00000000" / "journal" / "receiver00000000.bus.json").write_text(json.dumps(
        {"node": "receiver00000000", "addresses": {rcv0: "email"}}))
    out = tmp_path / "audit"
    summary = job.run(spark, [str(tmp_path / "fleet")], str(out), grace_ms=60_000)
    found = classes_of(spark, out)
    assert found["lost"] == set(injected["lost"])  # acknowledged by the receiver, then nothing
    assert found["owed"] == set(injected["owed"])  # never acknowledged: the sender holds them
    assert found["handled_more_than_once"] == set(injected["duplicate"])
    assert found["deadlettered"] == set(injected["deadletter"])
    assert found["in_flight"] == set(injected["in_flight"])
    assert len(found["handled"]) == 6000 - 3 - 2 - 2 - 2 - 4
    owed_by = {row["receiver"]: row["messages"] for row in summary["owed"]}
    assert sum(owed_by.values()) == 4 and all(row["since_ms"] for row in summary["owed"])
    assert summary["ok"] is False
    assert {(p["id"], p["receiver"]) for p in summary["problems"]["lost"]} == set(injected["lost"])
    assert summary["deadletter_reasons"] == {"ValueError: bad order": 2}
    assert summary["deadletter_causes"] == [{"cause": "ValueError", "messages": 2, "examples": ["ValueError: bad order"]}]
    assert summary["retries"] == 4
    written = json.loads((out / "summary.json").read_text())
    assert written["classes"] == summary["classes"]
    report = (out / "report.html").read_text()
    assert "Problems found" in report and report.count("data:image/png;base64,") == 2
    assert (out / "report.png").read_bytes().startswith(b"\x89PNG")
    assert "_work" not in {p.name for p in out.iterdir()}  # intermediate tables removed
    for table in ("by_topic", "by_receiver", "timeline"):
        assert spark.read.parquet(str(out / table)).count() > 0
    by_topic = {r["topic"]: r for r in spark.read.parquet(str(out / "by_topic")).collect()}
    assert sum(r["lost"] for r in by_topic.values()) == 3
    assert all(r["latency_p50_ms"] is not None for r in by_topic.values())

    # Every problem pair, with names, its last event and the command that acts on it.
    wanted = {"lost": "lost", "handled_more_than_once": "duplicate", "deadlettered": "deadletter",
              "in_flight": "in_flight", "owed": "owed"}
    assert summary["problem_counts"] == {k: len(injected[v]) for k, v in wanted.items()}
    for klass, fault in wanted.items():
        assert {(p["id"], p["receiver"]) for p in summary["problems"][klass]} == set(injected[fault]), klass
    where = {rcv0: shlex.quote(str((fleet / "receiver00000000").resolve())),
             rcv1: shlex.quote("<data directory of tcp://10.0.1.1:6000>")}
    last = {"lost": "acked", "handled_more_than_once": "handled", "deadlettered": "deadlettered",
            "in_flight": "published", "owed": "sent"}
    for klass, pairs in summary["problems"].items():
        for p in pairs:
            assert (p["sender"], p["sender_name"]) == (SENDER, "shop")
            assert p["receiver_name"] == {rcv0: "email", rcv1: None}[p["receiver"]]
            assert p["topic"].startswith("orders.t") and p["last_event"] == last[klass], p
            assert p["published_ts"] <= p["last_ts"] <= p["published_ts"] + 10
            assert p["command"] == {
                "lost": f"servicebus check {where[p['receiver']]}",
                "handled_more_than_once": f"servicebus journal events {where[p['receiver']]} --id {p['id']}",
                "deadlettered": f"servicebus replay {where[p['receiver']]} {p['id']}",
                "in_flight": f"servicebus outgoing '/srv/my shop' --subscriber {p['receiver']}",
                "owed": f"servicebus outgoing '/srv/my shop' --subscriber {p['receiver']}"}[klass], p
    table = spark.read.parquet(str(out / "problems"))
    assert table.count() == sum(summary["problem_counts"].values())
    assert {r["command"] for r in table.collect()} == {p["command"] for v in summary["problems"].values() for p in v}
    assert written["problems"] == summary["problems"] and written["problem_counts"] == summary["problem_counts"]
    assert [(r["receiver"], r["receiver_name"]) for r in written["by_receiver"]] == [(rcv0, "email"), (rcv1, None)]
    assert {r["receiver"]: r["receiver_name"] for r in summary["owed"]}.items() <= {rcv0: "email", rcv1: None}.items()
    assert {(r["receiver"], r["receiver_name"]) for r in spark.read.parquet(str(out / "by_receiver")).collect()} == {
        (rcv0, "email"), (rcv1, None)}
    for row in written["by_topic"] + written["by_receiver"]:  # the report's latency columns, in the summary
        assert None not in (row["latency_p50_ms"], row["latency_p95_ms"], row["latency_p99_ms"], row["latency_max_ms"])
        assert row["latency_p50_ms"] <= row["latency_p95_ms"] <= row["latency_p99_ms"] <= row["latency_max_ms"]
    assert 'id="problem-data"' in report and "servicebus check" in report and "<b>email</b>" in report


def journal_counts(root: Path) -> tuple[int, int, int]:
    """(lines, lines with ``ids``, events: one per message a line names) of the journals."""
    lines = with_ids = events = 0
    for path in root.rglob("*.jsonl"):
        for text in path.read_text().splitlines():
            ids = json.loads(text).get("ids")
            lines += 1
            with_ids += ids is not None
            events += len(ids) if ids else 1
    return lines, with_ids, events


def test_a_segment_journaled_fleet_is_audited_per_message_exactly(spark, tmp_path):
    # Store format 3: 100 messages per publish, each event about a segment one line naming
    # them in "ids". Faults hit single messages inside segments (one lost, the rest of its
    # line handled; a failed handler's message split off on lines of its own), so a line
    # read as one event, or its "ids" ignored, would show as lost or miscounted messages.
    faults = {"lost": 4, "duplicate": 3, "deadletter": 2, "in_flight": 3, "expired": 3, "retried": 2}
    injected = write_journals(tmp_path / "fleet", messages=3000, receivers=2, rate=10, faults=faults,
                              segment=100)
    lines, with_ids, events = journal_counts(tmp_path / "fleet")
    assert with_ids > 0 and lines < events / 20  # mostly lines of ~100 ids
    out = tmp_path / "audit"
    summary = job.run(spark, [str(tmp_path / "fleet")], str(out), grace_ms=60_000)
    found = classes_of(spark, out)
    assert found["lost"] == set(injected["lost"])
    assert found["handled_more_than_once"] == set(injected["duplicate"])
    assert found["deadlettered"] == set(injected["deadletter"]) | set(injected["expired"])
    assert found["in_flight"] == set(injected["in_flight"])
    assert set(injected["retried"]) <= found["handled"]
    assert len(found["handled"]) == 6000 - sum(faults.values()) + faults["retried"]
    assert summary["events"] == events  # each line counted once per message it names
    assert summary["messages"] == 6000
    assert summary["deadletter_reasons"] == {"ValueError: bad order": 2, "expired": 3}
    assert summary["retries"] == 2 * 2 + 2  # two per dead letter, one per retried message
    assert {(p["id"], p["receiver"]) for p in summary["problems"]["lost"]} == set(injected["lost"])

    # The same fleet journaled one line per event (as before store format 3) is the same audit.
    flat = write_journals(tmp_path / "flat", messages=3000, receivers=2, rate=10, faults=faults)
    assert {k: set(v) for k, v in flat.items()} == {k: set(v) for k, v in injected.items()}
    assert journal_counts(tmp_path / "flat")[1:] == (0, events)
    summary_flat = job.run(spark, [str(tmp_path / "flat")], str(tmp_path / "audit-flat"), grace_ms=60_000)
    assert classes_of(spark, tmp_path / "audit-flat") == found
    for key in ("events", "classes", "retries", "attempts", "deadletter_reasons"):
        assert summary_flat[key] == summary[key], key


def test_a_grace_longer_than_the_run_makes_unreceived_messages_in_flight(spark, tmp_path):
    injected = write_journals(tmp_path / "fleet", messages=500, rate=10, faults={"lost": 2})
    summary = job.run(spark, [str(tmp_path / "fleet")], str(tmp_path / "audit"),
                      grace_ms=10 * 86_400_000, write=False)
    assert summary["classes"]["lost"] == 0 and summary["classes"]["in_flight"] == 2 and summary["ok"]
    assert injected["lost"]


def test_real_buses_with_a_subscriber_killed_mid_run_lose_and_duplicate_nothing(
        spark, make_bus, bus_process, tmp_path):
    pub = make_bus("pub")
    sub = bus_process("sub", "--handle", TOPIC, "--subscribe", pub.address, TOPIC, "--workers", "2")
    sub.start("--die-at", "1200")
    for start in range(0, 3000, 100):
        pub.publish_many(TOPIC, [{"n": n} for n in range(start, start + 100)])
    assert sub.wait_exit(60) == -9
    sub.start()
    wait_until(lambda: len(sub.done_counts()) == 3000, 60,
               message=lambda: f"{len(sub.done_counts())} of 3000")
    assert pub.drain(20)
    sub.stop()
    pub.close()
    summary = job.run(spark, [str(tmp_path)], str(tmp_path / "audit"), grace_ms=60_000)
    assert summary["classes"]["handled"] == 3000, summary["classes"]
    assert summary["classes"]["lost"] == 0 and summary["classes"]["handled_more_than_once"] == 0
    assert summary["ok"]


def test_real_buses_publishing_segments_journal_columns_that_the_audit_reads(spark, make_bus, tmp_path):
    # publish_many of 100: one segment per publish, each event about it one entry per message
    # of a columnar line (.jcol) on both buses, all of them with the one key and time of the
    # event. Some messages fail once: split off their segment, journaled on their own
    # (handler_failed, retried, handled), the rest by the segment's "handled".
    pub, sub = make_bus("pub"), make_bus("sub", retry_initial=0.01)
    failed, handled = set(), []

    def handle(payload, message):
        if payload % 97 == 13 and payload not in failed:
            failed.add(payload)
            raise ValueError("once")
        handled.append(payload)

    sub.every(TOPIC, handle)
    sub.subscribe(pub.address, TOPIC, wait=10)
    for start in range(0, 1000, 100):
        pub.publish_many(TOPIC, list(range(start, start + 100)))
    wait_until(lambda: len(handled) == 1000, 30, message=lambda: f"{len(handled)} of 1000")
    assert pub.drain(10) and sub.drain(10)
    sub.close()  # each journal moves what it holds to its segment files at close
    pub.close()
    lines = {name: [e for path in segment_files(tmp_path / name) for e in segment_events(path)]
             for name in ("pub", "sub")}
    for name in lines:
        assert {p.suffix for p in segment_files(tmp_path / name)} == {".jcol"}
        raw = [json.loads(text) for path in segment_files(tmp_path / name) for text in path.read_text().splitlines()]
        assert sum(len(line["k"]) for line in raw) == len(lines[name])  # an entry per message
        assert len(raw) < len(lines[name]) / 20  # lines of many entries: not one line per event
    # An event about a segment: one entry per message, with the same event, time and attempt.
    by_event = {name: Counter((e["event"], e["ts"], e["attempt"]) for e in side) for name, side in lines.items()}
    assert {event for (event, _, _), n in by_event["pub"].items() if n > 1} >= {"published", "sent", "acked"}
    assert {event for (event, _, _), n in by_event["sub"].items() if n > 1} >= {"received", "handled"}
    assert all("ids" not in e for side in lines.values() for e in side)
    published = [e["id"] for e in lines["pub"] if e["event"] == "published"]
    assert len(published) == len(set(published)) == 1000
    events = sum(len(side) for side in lines.values())
    summary = job.run(spark, [str(tmp_path)], str(tmp_path / "audit"), grace_ms=60_000)
    assert summary["events"] == events
    assert summary["classes"]["handled"] == 1000, summary["classes"]
    assert summary["classes"]["lost"] == 0 and summary["classes"]["handled_more_than_once"] == 0
    assert summary["retries"] == len(failed) == 11  # 13, 110, ..., 983
    assert summary["ok"]


def test_dead_letters_edited_and_replayed_are_journaled_so_and_audited_as_handled_once(spark, make_bus, tmp_path):
    # A received event whose handler failed, replayed with a fixed payload by the
    # subscriber; a command that expired at its sender, replayed edited (under a new id) and
    # handled by a receiver started since. Each replay's journal line says "edited".
    pub, sub, client = make_bus("pub"), make_bus("sub", max_attempts=1), make_bus("client")
    got = []

    def handle(payload, message):
        if not payload.get("fixed"):
            raise ValueError("poison payload")
        got.append(message.id)

    sub.every(TOPIC, handle)
    sub.subscribe(pub.address, TOPIC, wait=10)
    mid = pub.publish(TOPIC, {"n": 1})
    address = free_address()
    client.send(address, "audit.record", {"n": 2}, ttl=0.1)
    wait_until(lambda: sub.status().deadletters == 1 and client.status().deadletters == 1, 10)
    (expired,) = [d.id for d in client.deadletters()]
    assert sub.replay(mid, payload={"n": 1, "fixed": True}) == 1
    assert client.replay(expired, payload={"n": 2, "fixed": True}) == 1
    server = make_bus("server", address)
    server.handle("audit.record", handle)
    wait_until(lambda: len(got) == 2, 20)
    assert pub.drain(10) and sub.drain(10) and client.drain(10)
    for bus in (pub, sub, client, server):
        bus.close()
    lines = journal_events(tmp_path / "sub") + journal_events(tmp_path / "client")
    replays = {e["id"]: e.get("error") for e in lines if e["event"] == "replayed"}
    new_id = next(i for i in got if i != mid)
    assert replays == {mid: "edited", expired: f"as {new_id}, edited"}
    summary = job.run(spark, [str(tmp_path)], str(tmp_path / "audit"), grace_ms=60_000)
    found = classes_of(spark, tmp_path / "audit")
    assert {(mid, sub.address), (new_id, address)} <= found["handled"], found
    assert summary["classes"]["lost"] == 0 and summary["classes"]["handled_more_than_once"] == 0, summary
    assert summary["classes"]["deadlettered"] == 0, summary


def test_the_cli_prints_the_table_and_exits_1_naming_the_problem_ids(tmp_path):
    injected = write_journals(tmp_path / "fleet", messages=2000, rate=10, faults={"lost": 1, "duplicate": 1})
    private_tmp = tmp_path / "tmp"  # where the JVM's own output goes: a new file, removed after
    private_tmp.mkdir()
    idle = tmp_path / "idle"  # a bus that journaled nothing yet: said, skipped, not fatal
    (idle / "store").mkdir(parents=True)
    result = subprocess.run([CLI, "audit", str(tmp_path / "fleet"), str(idle), "--out", str(tmp_path / "out"),
                             "--master", "local[2]"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TMPDIR": str(private_tmp)})
    assert result.returncode == 1, result.stdout + result.stderr
    assert not [p for p in private_tmp.iterdir() if p.name.startswith("servicebus-audit-")]
    assert injected["lost"][0][0] in result.stdout and injected["duplicate"][0][0] in result.stdout
    assert "PROBLEMS FOUND" in result.stdout
    assert f"skipped (an idle bus has no journal yet): {idle}: no journal segments" in result.stderr
    assert "servicebus audit: starting Spark (local[2])" in result.stderr  # said before the JVM's wait
    # Spark's console noise stays out of the output: every line on stderr is the audit's own.
    assert all(line.startswith("servicebus audit: ") for line in result.stderr.splitlines()), result.stderr
    helped = subprocess.run([CLI, "audit", "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "Usage: servicebus audit [OPTIONS]" in helped.stdout  # typer's, as every command
    bad = subprocess.run([CLI, "audit", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no such file or directory" in bad.stderr


def test_an_out_folder_that_cannot_be_written_is_said_before_spark_starts(tmp_path, capsys):
    write_journals(tmp_path / "fleet", messages=10, rate=10, faults={})
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    began = time.monotonic()
    code = job.audit_cli([str(tmp_path / "fleet")], str(blocker / "audit"), progress=False)
    assert code == 2 and time.monotonic() - began < 5  # no JVM was started for it
    err = capsys.readouterr().err
    assert f"--out {blocker / 'audit'} cannot be written" in err and "starting Spark" not in err


def test_durations_and_since_parse():
    assert job.parse_duration("60s") == 60_000 and job.parse_duration("5m") == 300_000
    assert job.parse_duration("250ms") == 250 and job.parse_duration("2") == 2000
    assert job.parse_since("2026-01-01T00:00:00", 0) == 1767225600000
    assert job.parse_since("1767225600", 0) == 1767225600000
    assert job.parse_since("1h", 10_000_000) == 10_000_000 - 3_600_000
    with pytest.raises(job.AuditError):
        job.parse_duration("soon")


def test_messages_dropped_by_an_unsubscribe_or_an_operator_are_not_reported_lost(spark, tmp_path):
    journal = tmp_path / "fleet" / "pub" / "journal"
    journal.mkdir(parents=True)
    old, now = 1_790_000_000_000, 1_790_000_000_000 + 86_400_000
    lines = []
    for n, (end, error) in enumerate([("dropped", "unsubscribed"), ("dropped", "purged"),
                                      ("deadlettered", "subscriber_removed")]):
        base = {"ts": old, "node": "pub", "address": "tcp://10.0.0.1:1", "id": f"{n:022d}",
                "topic": TOPIC, "kind": "event", "peer": "tcp://10.0.0.2:1", "attempt": 0,
                "role": "sender"}
        lines.append({**base, "event": "published"})
        lines.append({**base, "event": end, "error": error, "ts": old + 1})
    lines.append({**base, "id": "9" * 22, "event": "published", "ts": now})
    (journal / "pub-000000000001.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = job.run(spark, [str(tmp_path / "fleet")], str(tmp_path / "audit"), grace_ms=60_000,
                      write=False)
    assert summary["classes"]["lost"] == 0
    assert summary["classes"]["dropped"] == 2 and summary["classes"]["deadlettered"] == 1


def test_a_message_sent_twice_for_an_exact_and_a_pattern_subscription_is_audited_once(spark, tmp_path):
    # One subscriber with "orders.created" and "orders.*": each orders.created message is
    # stored, sent and acked once per subscription, received twice, handled once.
    # (Bus itself: make_bus's first argument is the data directory's name, not the service's.)
    with Bus(free_address(), tmp_path / "pub", name="shop") as pub, \
            Bus(free_address(), tmp_path / "sub", name="email", max_attempts=1) as sub:
        sub.every("orders.created", lambda p, m: None, name="exact")
        sub.every("orders.*", lambda p, m: 1 / 0 if p == "bad" else None, name="pattern")
        sub.subscribe(pub.address, "orders.created", wait=10)
        sub.subscribe(pub.address, "orders.*", wait=10)
        for n in range(5):
            pub.publish("orders.created", n)
            pub.publish("orders.deleted", n)
        pub.publish("orders.failed", "bad")  # a dead letter at the subscriber, for its command
        wait_until(lambda: sub.status().deadletters == 1, 10)
        assert pub.drain(10) and sub.drain(10)
        sub_address = sub.address
        sub.close()
    summary = job.run(spark, [str(tmp_path)], str(tmp_path / "audit"), grace_ms=60_000)
    assert summary["classes"]["handled"] == 10, summary["classes"]
    assert summary["classes"]["lost"] == 0 and summary["classes"]["handled_more_than_once"] == 0
    assert summary["ok"]

    # The journals name the services; the command printed for the dead letter replays it.
    assert [(r["receiver"], r["receiver_name"]) for r in summary["by_receiver"]] == [(sub_address, "email")]
    (dead,) = summary["problems"]["deadlettered"]
    assert (dead["sender_name"], dead["receiver_name"], dead["topic"]) == ("shop", "email", "orders.failed")
    assert dead["command"] == f"servicebus replay {shlex.quote(str((tmp_path / 'sub').resolve()))} {dead['id']}"
    replay = subprocess.run([CLI, *shlex.split(dead["command"])[1:]], capture_output=True, text=True, timeout=60)
    assert replay.returncode == 0, replay.stdout + replay.stderr
    left = subprocess.run([CLI, "deadletters", str(tmp_path / "sub"), "--json"], capture_output=True, text=True,
                          timeout=60)
    assert left.returncode == 0 and not left.stdout.strip(), left.stdout + left.stderr


def test_a_group_is_audited_per_member_and_a_reassigned_message_is_not_lost(spark, make_bus, tmp_path):
    # The publisher journals a group's message as published to the member it goes to, and,
    # when it goes to another one, as dropped for the first: b is closed, so what was sent to
    # it before the publisher noticed goes to a. A member is given a whole segment (store
    # format 3): eight publishes of five, so that b is given some; the journal names a
    # segment's messages in "ids", and the counter counts messages, as the audit does.
    pub = make_bus("pub", ack_timeout=0.3, peer_timeout=1.5, heartbeat=0.3)
    a, b = make_bus("a"), make_bus("b")
    for member in (a, b):
        member.every(TOPIC, lambda p, m: None)
        member.subscribe(pub.address, TOPIC, group="welcome", wait=10)
    b.close()
    for start in range(0, 40, 5):
        pub.publish_many(TOPIC, list(range(start, start + 5)))
    assert pub.drain(20) and a.drain(20)
    reassigned = pub.counters().get("group_reassigned", 0)
    a.close()
    pub.close()
    summary = job.run(spark, [str(tmp_path)], str(tmp_path / "audit"), grace_ms=60_000)
    assert summary["classes"]["handled"] == 40, summary["classes"]
    assert summary["classes"]["lost"] == 0 and summary["classes"]["handled_more_than_once"] == 0
    assert summary["classes"].get("dropped", 0) == reassigned > 0
    assert summary["ok"]


def _segment(root: Path, node: str, address: str, seq: int, events: list[dict]) -> None:
    journal = root / node / "journal"
    journal.mkdir(parents=True, exist_ok=True)
    (journal / f"{node}-{seq:012d}.jsonl").write_text(
        "".join(json.dumps({"node": node, "address": address, "topic": TOPIC, "kind": "event",
                            "attempt": 1, **e}) + "\n" for e in events))


def test_an_incremental_audit_reads_only_new_segments_and_carries_open_pairs_forward(spark, tmp_path):
    pub, sub = "tcp://10.0.0.1:1", "tcp://10.0.0.2:1"
    fleet, checkpoint = tmp_path / "fleet", str(tmp_path / "checkpoint")
    t0 = 1_790_000_000_000
    mid = lambda n: f"{n:024d}"  # noqa: E731

    def published(n, ts):
        return [{"event": e, "ts": ts, "id": mid(n), "peer": sub, "role": "sender"} for e in ("published", "sent")]

    def handled(n, ts):
        return [{"event": e, "ts": ts, "id": mid(n), "peer": pub, "role": "receiver"} for e in ("received", "handled")]

    # Day 1: 0-99 published and handled; 100-104 published seconds before the journal ends.
    _segment(fleet, "pub", pub, 1, [e for n in range(105) for e in published(n, t0 + n * 1000)])
    _segment(fleet, "sub", sub, 1, [e for n in range(100) for e in handled(n, t0 + n * 1000 + 5)])
    first = job.run(spark, [str(fleet)], str(tmp_path / "day1"), grace_ms=60_000, checkpoint=checkpoint)
    assert first["classes"]["handled"] == 100 and first["classes"]["in_flight"] == 5 and first["ok"]
    assert first["checkpoint"]["segments_read"] == 2 and first["checkpoint"]["carried_in"] == 0

    # Day 2: new segments only. 100-104 arrive and are handled; 105-109 are new and handled;
    # 7 (handled on day 1) is handled a second time; 110 is published and never arrives (no
    # ack: still owed); 111 is acked by the receiver and then nothing (lost).
    day2 = t0 + 86_400_000
    _segment(fleet, "pub", pub, 2, [e for n in (*range(105, 110), 110, 111) for e in published(n, day2 + n)]
             + [{"event": "acked", "ts": day2 + 300, "id": mid(111), "peer": sub, "role": "sender"}])
    _segment(fleet, "sub", sub, 2, [e for n in range(100, 110) for e in handled(n, day2 + 500 + n)]
             + [{"event": "handled", "ts": day2 + 600, "id": mid(7), "peer": pub, "role": "receiver"}])
    _segment(fleet, "pub", pub, 3, [{"event": "acked", "ts": day2 + 3_600_000, "id": mid(105),
                                     "peer": sub, "role": "sender"}])  # the journal goes on an hour
    second = job.run(spark, [str(fleet)], str(tmp_path / "day2"), grace_ms=60_000, checkpoint=checkpoint)
    assert second["checkpoint"]["segments_read"] == 3  # not day 1's two
    assert second["checkpoint"]["carried_in"] >= 5
    assert second["events"] < first["events"]  # only the new events were read
    found = classes_of(spark, tmp_path / "day2")
    assert found["handled"] == {(mid(n), sub) for n in range(100, 110)}  # the five carried ones too
    assert found["handled_more_than_once"] == {(mid(7), sub)}  # a late duplicate of day 1's
    assert found["owed"] == {(mid(110), sub)}
    assert found["lost"] == {(mid(111), sub)}
    assert not found.get("in_flight")

    # A third run with nothing new reads nothing and reports nothing open.
    third = job.run(spark, [str(fleet)], str(tmp_path / "day3"), grace_ms=60_000, checkpoint=checkpoint,
                    write=False)
    # ... but what is still owed, which it carries open and reports again.
    assert third["checkpoint"]["segments_read"] == 0 and third["messages"] == 1
    assert third["classes"]["owed"] == 1 and third["ok"]


def test_a_message_owed_to_a_receiver_that_is_down_is_owed_not_lost_and_the_audit_passes(spark, tmp_path):
    """Issue 32: messages the publisher holds for a subscriber that is down (no ack in any
    journal) read 'lost' once older than the grace, and the job exited 1. A pair with no
    'published' event was aged on its receiver's clock (a down receiver's last event), so
    it stayed in flight for ever; it is aged on the sender's. A dead letter replayed is not
    a dead letter any more."""
    pub, sub = "tcp://10.0.0.1:1", "tcp://10.0.0.2:1"
    fleet, t0 = tmp_path / "fleet", 1_790_000_000_000
    mid = lambda n: f"{n:024d}"  # noqa: E731
    sender = [{"event": e, "ts": t0 + n, "id": mid(n), "peer": sub, "role": "sender"}
              for n in range(3) for e in ("published", "sent")]
    sender.append({"event": "sent", "ts": t0 + 5, "id": mid(3), "peer": sub, "role": "sender"})  # no published
    sender += [{"event": "acked", "ts": t0 + 9, "id": mid(n), "peer": sub, "role": "sender"} for n in (2, 4)]
    sender.append({"event": "published", "ts": t0 + 3_600_000, "id": mid(99), "peer": "tcp://10.0.0.3:1",
                   "role": "sender"})  # the sender's journal goes on an hour
    _segment(fleet, "pub", pub, 1, sender)
    # The receiver got 2 and 4, dead-lettered 2 and then 2 was replayed; then it went down.
    _segment(fleet, "sub", sub, 1, [
        {"event": "received", "ts": t0 + 8, "id": mid(2), "peer": pub, "role": "receiver"},
        {"event": "deadlettered", "ts": t0 + 10, "id": mid(2), "peer": pub, "role": "receiver", "error": "x"},
        {"event": "replayed", "ts": t0 + 20, "id": mid(2), "peer": pub, "role": "receiver"}])
    summary = job.run(spark, [str(fleet)], str(tmp_path / "audit"), grace_ms=60_000)
    found = classes_of(spark, tmp_path / "audit")
    assert found["owed"] == {(mid(0), sub), (mid(1), sub), (mid(3), sub)}
    assert found["in_flight"] == {(mid(2), sub), (mid(99), "tcp://10.0.0.3:1")}  # replayed: owed again
    assert found["lost"] == {(mid(4), sub)}  # acked, then nothing in the receiver's journal
    assert summary["owed"] == [{"receiver": sub, "messages": 3, "since_ms": t0, "receiver_name": None}]
    written = json.loads((tmp_path / "audit" / "summary.json").read_text())
    assert {"classify_and_write_messages", "tables_and_report"} <= set(written["phases"])


def test_an_audit_without_the_report_writes_the_messages_table_and_the_summary_only(spark, tmp_path):
    # What tools/chaos asks for after each fault kind: the table it reads, in less time.
    injected = write_journals(tmp_path / "fleet", messages=300, rate=10, faults={"lost": 2})
    out = tmp_path / "audit"
    summary = job.run(spark, [str(tmp_path / "fleet")], str(out), grace_ms=1_000, report=False)
    assert {p.name for p in out.iterdir() if not p.name.startswith(".")} == {"messages", "summary.json"}
    assert classes_of(spark, out)["lost"] == set(injected["lost"])
    assert json.loads((out / "summary.json").read_text())["classes"] == summary["classes"]
    assert "tables_and_report" not in summary["phases"]


def test_what_a_moved_subscriber_was_owed_is_handled_once_by_it_at_its_new_address(spark, tmp_path):
    # An instance that restarts at a new address with its data directory (discovery tells
    # the publisher): what it was owed at the old one, events and a command queued for it,
    # is delivered at the new one. Before, the journal said nothing at the old address, so
    # every such pair read "owed" there, a message the publisher no longer held for it; the
    # publisher journals it "dropped" there. Both addresses are one bus (its bus file
    # lists them): one receiver, at the address it has now, each message handled once.
    opened: list[Bus] = []

    def bus(name: str, directory: str, **options) -> Bus:
        opened.append(Bus(free_address(), tmp_path / directory, name=name, gossip_interval=0.2, down_after=1.0,
                          **options))
        return opened[-1]

    try:
        _move_and_audit(spark, tmp_path, bus)
    finally:
        for each in opened:
            each.close()


def _move_and_audit(spark, tmp_path, bus):
    orders = bus("orders", "orders")
    email = bus("email", "email", seeds=[orders.address])
    email.subscribe("orders", TOPIC, wait=10)
    old = email.address
    wait_until(lambda: any(m["name"] == "email" and not m.get("self") for m in orders.fleet()), 10)
    email.close()
    wait_until(lambda: any(m["name"] == "email" and not m["up"] for m in orders.fleet()), 10)
    ids = orders.publish_many(TOPIC, list(range(100))) + [orders.publish(TOPIC, n) for n in range(100, 110)]
    commands = [orders.send("email", "note", n) for n in range(5)]
    moved = bus("email", "email")
    got: list[str] = []
    moved.every(TOPIC, lambda payload, message: got.append(message.id))
    moved.handle("note", lambda payload, message: got.append(message.id))
    wait_until(lambda: len(got) == 115, 15, message=lambda: f"{len(got)} of 115")
    assert orders.drain(10) and moved.drain(10)
    moved.close()
    orders.close()
    summary = job.run(spark, [str(tmp_path / "orders"), str(tmp_path / "email")], str(tmp_path / "audit"),
                      grace_ms=0, report=False)
    found = classes_of(spark, tmp_path / "audit")
    assert found == {"handled": {(mid, moved.address) for mid in ids + commands}}, summary["classes"]
    assert summary["classes"]["handled"] == 115 and summary["ok"], summary["classes"]
    lines = journal_events(tmp_path / "orders")
    dropped = [e for e in lines if e["event"] == "dropped"]
    assert {e["peer"] for e in dropped} == {old} and len({e["id"] for e in dropped}) == 115
    assert {e.get("error") for e in dropped} == {f"moved to {moved.address}"}


def test_a_message_handled_before_its_subscriber_moved_and_acked_again_at_the_new_address_is_not_lost(
        spark, tmp_path):
    # tools/chaos (move-subscriber, CI): the subscriber handled M at A and was killed before
    # its ack reached the publisher; restarted with its data directory at B, it acked M
    # again as a duplicate (nothing to journal: it had it). Read per address, (M, B) was
    # "acknowledged, then nothing": lost, for a message handled once. A and B are one bus
    # (its bus file lists both): one receiver.
    pub, old, new = "tcp://10.0.0.1:1", "tcp://10.0.0.2:1", "tcp://10.0.0.2:2"
    fleet, t0, mid = tmp_path / "fleet", 1_790_000_000_000, "0" * 23 + "1"
    _segment(fleet, "pub", pub, 1, [
        {"event": "published", "ts": t0, "id": mid, "peer": old, "role": "sender"},
        {"event": "sent", "ts": t0 + 1, "id": mid, "peer": old, "role": "sender"},
        {"event": "dropped", "ts": t0 + 50, "id": mid, "peer": old, "role": "sender", "error": f"moved to {new}"},
        {"event": "sent", "ts": t0 + 51, "id": mid, "peer": new, "role": "sender"},
        {"event": "acked", "ts": t0 + 52, "id": mid, "peer": new, "role": "sender"}])
    _segment(fleet, "sub", old, 1, [
        {"event": "received", "ts": t0 + 2, "id": mid, "peer": pub, "role": "receiver"},
        {"event": "handled", "ts": t0 + 3, "id": mid, "peer": pub, "role": "receiver"}])
    (fleet / "sub" / "journal" / "sub.bus.json").write_text(json.dumps(
        {"node": "sub", "datadir": "/srv/email", "addresses": {old: "email", new: "email"}}))
    summary = job.run(spark, [str(fleet)], str(tmp_path / "audit"), grace_ms=0, report=False)
    found = classes_of(spark, tmp_path / "audit")
    assert found == {"handled": {(mid, new)}}, summary["classes"]  # the bus's address now
    assert summary["ok"]
    # One receiver must not hide a loss behind the move: the publisher's "dropped, moved to
    # B" is no drop for the bus at B. A message moved, acked at B and never handled is lost.
    lost = "0" * 23 + "2"
    _segment(fleet, "pub", pub, 2, [
        {"event": "published", "ts": t0 + 60, "id": lost, "peer": old, "role": "sender"},
        {"event": "dropped", "ts": t0 + 61, "id": lost, "peer": old, "role": "sender", "error": f"moved to {new}"},
        {"event": "sent", "ts": t0 + 62, "id": lost, "peer": new, "role": "sender"},
        {"event": "acked", "ts": t0 + 63, "id": lost, "peer": new, "role": "sender"}])
    summary = job.run(spark, [str(fleet)], str(tmp_path / "audit2"), grace_ms=0, report=False)
    found = classes_of(spark, tmp_path / "audit2")
    assert found == {"handled": {(mid, new)}, "lost": {(lost, new)}}, summary["classes"]


def test_an_incremental_audit_follows_a_subscriber_that_moved_between_two_runs(spark, tmp_path):
    # Day 1: M received at A, not handled yet: carried open, at A. Day 2: the bus is at B (its
    # file lists both) and handles M there. The pair carried at A is the pair at B.
    pub, old, new = "tcp://10.0.0.1:1", "tcp://10.0.0.2:1", "tcp://10.0.0.2:2"
    fleet, checkpoint, t0, mid = tmp_path / "fleet", str(tmp_path / "checkpoint"), 1_790_000_000_000, "0" * 24
    bus_file = fleet / "sub" / "journal" / "sub.bus.json"
    _segment(fleet, "pub", pub, 1, [{"event": e, "ts": t0, "id": mid, "peer": old, "role": "sender"}
                                    for e in ("published", "sent", "acked")])
    _segment(fleet, "sub", old, 1, [{"event": "received", "ts": t0 + 1, "id": mid, "peer": pub, "role": "receiver"}])
    bus_file.write_text(json.dumps({"node": "sub", "datadir": "/srv/email", "addresses": {old: "email"}}))
    first = job.run(spark, [str(fleet)], str(tmp_path / "day1"), grace_ms=0, checkpoint=checkpoint)
    assert first["classes"]["in_flight"] == 1
    _segment(fleet, "sub", new, 2, [{"event": "handled", "ts": t0 + 9, "id": mid, "peer": pub, "role": "receiver"}])
    bus_file.write_text(json.dumps({"node": "sub", "datadir": "/srv/email", "addresses": {old: "email", new: "email"}}))
    second = job.run(spark, [str(fleet)], str(tmp_path / "day2"), grace_ms=0, checkpoint=checkpoint)
    assert classes_of(spark, tmp_path / "day2") == {"handled": {(mid, new)}}, second["classes"]


# Found by a hostile review of the move handling (helper-32), each seen failing first but the last.

_PUB, _A, _B = "tcp://10.0.0.1:1", "tcp://10.0.0.5:7000", "tcp://10.0.0.7:7000"
_T0 = 1_790_000_000_000


def _bus_file(root, node, addresses, datadir="/data"):
    journal = root / node / "journal"
    journal.mkdir(parents=True, exist_ok=True)
    (journal / f"{node}.bus.json").write_text(json.dumps({"node": node, "datadir": datadir, "addresses": addresses}))


def _handled_at_a_lost_at_b(tmp_path):
    """M published to _A and _B and acked by both; e2's journal (at _A) handles it, e1's
    (at _B) has another message only."""
    fleet, mid = tmp_path / "fleet", "0" * 24
    _segment(fleet, "pub", _PUB, 1, [{"event": e, "ts": _T0 + i, "id": mid, "peer": to, "role": "sender"}
                                     for to in (_A, _B) for i, e in enumerate(("published", "sent", "acked"))])
    _segment(fleet, "e2", _A, 1, [{"event": e, "ts": _T0 + 5, "id": mid, "peer": _PUB, "role": "receiver"}
                                  for e in ("received", "handled")])
    _segment(fleet, "e1", _B, 1, [{"event": e, "ts": _T0 - 9, "id": "1" * 24, "peer": _PUB, "role": "receiver"}
                                  for e in ("received", "handled")])
    return fleet, mid


def test_a_loss_at_one_container_is_not_hidden_by_another_container_that_reused_its_old_address(spark, tmp_path):
    # M is broadcast to both instances: e2 (now at _A) handles it; e1 (at _B) acks it and never handles it.
    fleet, mid = _handled_at_a_lost_at_b(tmp_path)
    _bus_file(fleet, "e1", {_A: "email", _B: "email"})
    _bus_file(fleet, "e2", {_A: "email"})
    summary = job.run(spark, [str(fleet)], str(tmp_path / "audit"), grace_ms=0, report=False)
    found = classes_of(spark, tmp_path / "audit")
    assert (mid, _B) in found.get("lost", set()), (found, summary["classes"])


def test_a_bus_without_a_bus_file_at_a_moved_bus_old_address_is_not_taken_for_it(spark, tmp_path):
    # e2, an older bus that writes no bus file, was given A after e1 moved from A to B.
    # e2 handles M at A; e1 acks M at B and never handles it: lost at B, not hidden by e2.
    fleet, mid = _handled_at_a_lost_at_b(tmp_path)
    _bus_file(fleet, "e1", {_A: "email", _B: "email"})
    summary = job.run(spark, [str(fleet)], str(tmp_path / "audit"), grace_ms=0, report=False)
    found = classes_of(spark, tmp_path / "audit")
    assert (mid, _B) in found.get("lost", set()) and (mid, _A) in found.get("handled", set()), summary["classes"]


def test_a_drop_carried_from_before_the_move_was_known_does_not_hide_a_loss_at_the_new_address(spark, tmp_path):
    # Run 1 (an audit before the bus file listed _B, e.g. the checkpoint of the previous audit
    # version, or a bus file shipped later than the segments): the publisher dropped M at _A,
    # "moved to _B". Run 2: M sent to _B, acked by _B, never handled: lost, as a full audit says.
    fleet, checkpoint, mid = tmp_path / "fleet", str(tmp_path / "checkpoint"), "0" * 24
    _segment(fleet, "pub", _PUB, 1, [
        {"event": "published", "ts": _T0, "id": mid, "peer": _A, "role": "sender"},
        {"event": "sent", "ts": _T0 + 1, "id": mid, "peer": _A, "role": "sender"},
        {"event": "dropped", "ts": _T0 + 2, "id": mid, "peer": _A, "role": "sender", "error": f"moved to {_B}"}])
    _segment(fleet, "sub", _A, 1, [{"event": e, "ts": _T0 - 10, "id": "1" * 24, "peer": _PUB, "role": "receiver"}
                                  for e in ("received", "handled")])
    _bus_file(fleet, "sub", {_A: "email"})
    job.run(spark, [str(fleet)], str(tmp_path / "day1"), grace_ms=0, checkpoint=checkpoint, report=False)
    _segment(fleet, "pub", _PUB, 2, [
        {"event": "published", "ts": _T0, "id": mid, "peer": _B, "role": "sender"},
        {"event": "sent", "ts": _T0 + 3, "id": mid, "peer": _B, "role": "sender"},
        {"event": "acked", "ts": _T0 + 4, "id": mid, "peer": _B, "role": "sender"}])
    _bus_file(fleet, "sub", {_A: "email", _B: "email"})
    full = job.run(spark, [str(fleet)], str(tmp_path / "full"), grace_ms=0, report=False)
    assert classes_of(spark, tmp_path / "full").get("lost") == {(mid, _B)}, full["classes"]  # holds
    second = job.run(spark, [str(fleet)], str(tmp_path / "day2"), grace_ms=0, checkpoint=checkpoint, report=False)
    assert classes_of(spark, tmp_path / "day2").get("lost") == {(mid, _B)}, second["classes"]


def test_held_back_and_forth_third_bus_odd_addresses_and_a_long_bus_file(spark, tmp_path):
    fleet = tmp_path / "fleet"
    a, b, c = "tcp://[::1]:7000", "tcp://h$x.(1)+:7001", "tcp://10.0.0.9:1"
    m1, m2, m3 = "1" * 24, "2" * 24, "3" * 24
    _segment(fleet, "pub", _PUB, 1, [
        {"event": "published", "ts": _T0, "id": m1, "peer": a, "role": "sender"},
        {"event": "dropped", "ts": _T0 + 1, "id": m1, "peer": a, "role": "sender", "error": f"moved to {b}"},
        {"event": "published", "ts": _T0, "id": m1, "peer": b, "role": "sender"},
        {"event": "acked", "ts": _T0 + 2, "id": m1, "peer": b, "role": "sender"},  # then nothing: lost
        {"event": "published", "ts": _T0, "id": m2, "peer": b, "role": "sender"},
        {"event": "dropped", "ts": _T0 + 3, "id": m2, "peer": b, "role": "sender", "error": f"moved to {c}"},
        {"event": "published", "ts": _T0, "id": m2, "peer": c, "role": "sender"},
        {"event": "published", "ts": _T0, "id": m3, "peer": b, "role": "sender"},
        {"event": "dropped", "ts": _T0 + 3, "id": m3, "peer": b, "role": "sender", "error": f"moved to {a}"},
        {"event": "published", "ts": _T0, "id": m3, "peer": a, "role": "sender"}])
    _segment(fleet, "other", c, 1, [{"event": "handled", "ts": _T0 + 4, "id": m2, "peer": _PUB, "role": "receiver"}])
    _segment(fleet, "sub", a, 1, [{"event": "handled", "ts": _T0 + 4, "id": m3, "peer": _PUB, "role": "receiver"}])
    old = {f"tcp://10.9.{n}.1:1": "email" for n in range(97)}
    _bus_file(fleet, "sub", {**old, b: "email", a: "email"}, datadir="/srv/email")  # _A -> _B -> _A, 99 earlier
    _bus_file(fleet, "other", {c: "other"}, datadir="/srv/other")
    summary = job.run(spark, [str(fleet)], str(tmp_path / "audit"), grace_ms=0, report=False)
    assert classes_of(spark, tmp_path / "audit") == {
        "lost": {(m1, a)}, "dropped": {(m2, a)}, "handled": {(m2, c), (m3, a)}}, summary["classes"]


def _jcol_segment(root: Path, node: str, address: str, seq: int, events: list[dict]) -> None:
    from servicebus.hooks.segments import Columns

    journal = root / node / "journal"
    journal.mkdir(parents=True, exist_ok=True)
    columns = Columns(node, address)
    for e in events:
        ids = e.get("ids") or [e["id"]]
        columns.put((e["event"], TOPIC, "event", e["peer"], e["role"]), e["ts"], ids, 1, e.get("error"), e["id"])
    (journal / f"{node}-{seq:012d}.jcol").write_text("".join(columns.lines()), encoding="utf-8")


def test_an_incremental_audit_reads_columnar_segments_that_follow_line_segments_once(spark, tmp_path):
    """An upgraded fleet: day 1's segments are .jsonl, day 2's .jcol (one a segment event
    about many messages, an error with odd characters); each event is read once."""
    pub, sub = "tcp://10.0.0.1:1", "tcp://10.0.0.2:1"
    fleet, checkpoint = tmp_path / "fleet", str(tmp_path / "checkpoint")
    t0 = 1_790_000_000_000
    mid = lambda n: f"{n:024d}"  # noqa: E731
    _segment(fleet, "pub", pub, 1, [{"event": e, "ts": t0 + n, "id": mid(n), "peer": sub, "role": "sender"}
                                    for n in range(10) for e in ("published", "sent")])
    _segment(fleet, "sub", sub, 1, [{"event": e, "ts": t0 + n + 5, "id": mid(n), "peer": pub, "role": "receiver"}
                                    for n in range(5) for e in ("received", "handled")])
    first = job.run(spark, [str(fleet)], str(tmp_path / "day1"), grace_ms=60_000, checkpoint=checkpoint)
    assert first["classes"]["handled"] == 5 and first["classes"]["in_flight"] == 5

    day2 = t0 + 86_400_000
    ids = [mid(n) for n in range(10, 5010)]  # one event about 5,000 messages: across two lines
    _jcol_segment(fleet, "pub", pub, 2001, [
        {"event": "published", "ts": day2, "id": ids[0], "ids": ids, "peer": sub, "role": "sender"},
        {"event": "sent", "ts": day2, "id": ids[0], "ids": ids, "peer": sub, "role": "sender"},
        {"event": "published", "ts": day2 + 3_600_000, "id": mid(9999), "peer": "tcp://10.0.0.3:1",
         "role": "sender"}])
    _jcol_segment(fleet, "sub", sub, 2001, [
        *[{"event": e, "ts": day2 + 10, "id": mid(n), "peer": pub, "role": "receiver"}
          for n in range(5, 10) for e in ("received", "handled")],
        {"event": "received", "ts": day2 + 20, "id": ids[0], "ids": ids, "peer": pub, "role": "receiver"},
        {"event": "handled", "ts": day2 + 30, "id": ids[0], "ids": ids[:-1], "peer": pub, "role": "receiver"},
        {"event": "deadlettered", "ts": day2 + 30, "id": ids[-1], "peer": pub, "role": "receiver",
         "error": 'ValueError: "ö"\n\u2028'}])
    second = job.run(spark, [str(fleet)], str(tmp_path / "day2"), grace_ms=60_000, checkpoint=checkpoint)
    assert second["checkpoint"]["segments_read"] == 2
    assert second["events"] == 2 * 5000 + 1 + 10 + 5000 + 4999 + 1
    found = classes_of(spark, tmp_path / "day2")
    assert found["handled"] == {(m, sub) for m in [mid(n) for n in range(5, 10)] + ids[:-1]}
    assert found["deadlettered"] == {(ids[-1], sub)}
    assert not found.get("handled_more_than_once") and not found.get("lost")
    assert found["in_flight"] == {(mid(9999), "tcp://10.0.0.3:1")}  # the newest: the journal's clock
