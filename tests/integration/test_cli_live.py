"""Operations on a running bus (issue 29): `servicebus replay`, `purge` and `check` of a live
bus through its admin endpoint (the engine writes), `bus.replay()`/`bus.purge()`, the
`subscriptions` view, several data directories per command, and tables that wrap rather
than drop columns. The CLI runs in a subprocess; the buses it talks to run in this one."""

import os
import subprocess

from servicebus import Bus
from servicebus.testing import free_address, wait_until

from .test_cli import CLI, TOPIC, cli, cli_json, journal_lines

NOTHING_MATCHED = 6
ERROR = "bad address " + "x" * 40 + " END"  # 68 characters with its type: room for it at 160


def cli_cols(columns: int, *args):
    return subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": str(columns)})


def failing_subscriber(make_bus, pub: Bus, name: str = "sub", topics=(TOPIC,)):
    """A live subscriber of ``topics`` at ``pub`` whose handler fails (one attempt: a dead
    letter at once) while ``state["fail"]``; what it handled is in ``state["got"]``."""
    state = {"fail": True, "got": []}
    sub = make_bus(name, max_attempts=1)

    def handler(payload, message):
        if state["fail"]:
            raise ValueError(ERROR)
        state["got"].append((message.topic, payload["n"]))

    for topic in topics:
        sub.every(topic, handler)
        sub.subscribe(pub.address, topic, wait=10)
    return sub, state


def dead_letters_of(make_bus, topics=(TOPIC,), per_topic: int = 1):
    pub = make_bus("pub")
    sub, state = failing_subscriber(make_bus, pub, topics=topics)
    ids = {t: [pub.publish(t, {"n": n}) for n in range(per_topic)] for t in topics}
    wait_until(lambda: sub.status().deadletters == per_topic * len(topics), 20)
    return pub, sub, state, ids


def journaled(datadir, event):
    return {e["id"] for e in journal_lines(datadir) if e["event"] == event}


# --- replay ------------------------------------------------------------------------------------


def test_a_dead_letter_replayed_through_a_live_bus_is_handled_without_stopping_it(make_bus):
    pub, sub, state, ids = dead_letters_of(make_bus)
    (mid,) = ids[TOPIC]
    state["fail"] = False
    rows = cli_json("replay", sub.datadir, mid)
    assert [(r["id"], r["result"], r["to"]) for r in rows] == [(mid, "replayed", "incoming")]
    wait_until(lambda: state["got"] == [(TOPIC, 0)], 20)
    assert sub.deadletters() == []
    wait_until(lambda: mid in journaled(sub.datadir, "replayed"), 20)  # the live journal moves it


def test_live_replay_selects_by_topic_and_by_reason_and_says_when_nothing_matched(make_bus):
    pub, sub, state, ids = dead_letters_of(make_bus, topics=("a.t", "b.t"), per_topic=2)
    state["fail"] = False
    rows = cli_json("replay", sub.datadir, "--topic", "a.t")
    assert sorted(r["id"] for r in rows) == sorted(ids["a.t"])
    wait_until(lambda: sorted(state["got"]) == [("a.t", 0), ("a.t", 1)], 20)
    none = cli("replay", sub.datadir, "--reason", "expired")
    assert none.returncode == NOTHING_MATCHED and "no dead letter" in none.stderr, none.stderr
    rows = cli_json("replay", sub.datadir, "--reason", "handler_failed")
    assert sorted(r["id"] for r in rows) == sorted(ids["b.t"])
    wait_until(lambda: len(state["got"]) == 4, 20)


def test_replay_of_an_unknown_id_names_it_and_exits_nothing_matched_live_and_stopped(make_bus):
    pub, sub, state, ids = dead_letters_of(make_bus)
    unknown = "0" * 24
    for when in ("live", "stopped"):
        result = cli("replay", sub.datadir, unknown)
        assert result.returncode == NOTHING_MATCHED, (when, result.stderr)
        assert f"no such dead letter: {unknown}" in result.stderr and "Traceback" not in result.stderr
        sub.close()
    assert len(cli_json("deadletters", sub.datadir)) == 1  # left as it was


def test_bus_replay_and_purge_select_by_id_topic_and_reason_and_return_how_many(make_bus):
    pub, sub, state, ids = dead_letters_of(make_bus, topics=("a.t", "b.t", "c.t"))
    state["fail"] = False
    assert sub.replay(topic="nope.t") == 0
    assert sub.replay(ids["a.t"]) == 1
    wait_until(lambda: ("a.t", 0) in state["got"], 20)
    assert sub.purge(reason="handler_failed", topic="b.t") == 1
    assert [d.topic for d in sub.deadletters()] == ["c.t"]
    assert sub.replay() == 1  # every dead letter
    wait_until(lambda: ("c.t", 0) in state["got"], 20)
    assert sub.deadletters() == [] and ("b.t", 0) not in state["got"]
    wait_until(lambda: set(ids["b.t"]) <= journaled(sub.datadir, "dropped"), 20)


# --- purge -------------------------------------------------------------------------------------


def test_live_purge_removes_only_the_dead_letters_it_selects_and_journals_each(make_bus):
    pub, sub, state, ids = dead_letters_of(make_bus, topics=("a.t", "b.t"), per_topic=2)
    refused = cli("purge", sub.datadir, "--topic", "a.t")  # not a terminal and no --yes
    assert refused.returncode == 1 and "--yes" in refused.stderr
    removed = cli_json("purge", sub.datadir, "--topic", "a.t", "--yes")[0]["removed"]
    assert removed == {"deadletters": 2}
    removed = cli_json("purge", sub.datadir, ids["b.t"][0], "--yes")[0]["removed"]
    assert removed == {"deadletters": 1}
    assert [d.id for d in sub.deadletters()] == [ids["b.t"][1]]
    wait_until(lambda: set(ids["a.t"]) | {ids["b.t"][0]} <= journaled(sub.datadir, "dropped"), 20)
    none = cli("purge", sub.datadir, "--reason", "expired", "--yes")
    assert none.returncode == NOTHING_MATCHED and "no dead letter" in none.stderr
    whole = cli("purge", sub.datadir, "--outgoing", "--yes")  # the whole-keyspace forms need it stopped
    assert whole.returncode == 3 and "stop" in whole.stderr
    sub.close()
    removed = cli_json("purge", sub.datadir, "--deadletters", "--yes")[0]["removed"]
    assert removed == {"deadletters": 1}


# --- check -------------------------------------------------------------------------------------


def test_check_of_a_live_bus_reads_a_snapshot_of_its_store_and_repair_needs_it_stopped(make_bus):
    pub, sub, state, ids = dead_letters_of(make_bus, per_topic=3)
    gone = make_bus("gone")
    gone.subscribe(pub.address, TOPIC, wait=10)
    gone.close()
    pub.publish_many(TOPIC, [{"n": n} for n in range(50)])  # owed to gone, handled by sub
    result = cli("check", pub.datadir, sub.datadir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("every record decodes and every reference holds") == 2
    assert "live" in result.stdout
    repair = cli("check", "--repair", sub.datadir)
    assert repair.returncode == 3 and "stop" in repair.stderr


# --- subscriptions -----------------------------------------------------------------------------


def test_subscriptions_lists_each_intent_its_publisher_confirmation_and_backlog_live_and_stopped(make_bus):
    pub = make_bus("pub")
    nowhere = free_address()
    sub = make_bus("sub")
    sub.subscribe(pub.address, "orders.*", wait=10)
    sub.subscribe(nowhere, "billing.due")  # nobody there: never confirmed
    pub.publish_many("orders.placed", [{"n": n} for n in range(3)])  # no handler: they wait
    wait_until(lambda: sub.status().incoming == 3, 20)
    live = cli_json("subscriptions", sub.datadir)
    by_topic = {r["topic"]: r for r in live}
    assert by_topic["orders.*"]["publisher"] == pub.address and by_topic["orders.*"]["confirmed"] is True
    assert by_topic["orders.*"]["backlog"] == 3
    assert by_topic["billing.due"]["publisher"] == nowhere and by_topic["billing.due"]["confirmed"] is False
    assert by_topic["billing.due"]["backlog"] == 0
    table = cli("subscriptions", sub.datadir)
    headers, _cells = table_columns(table.stdout)
    assert table.returncode == 0 and headers[:3] == ["topic", "publisher", "confirmed"], table.stdout
    assert "orders.*" in table.stdout and nowhere.replace(" ", "") in _joined_cells(table.stdout, 1)
    sub.close()
    assert cli_json("subscriptions", sub.datadir) == live


# --- several data directories ----------------------------------------------------------------


def test_status_of_several_data_directories_labels_each_and_exits_with_the_worst(make_bus, tmp_path):
    a, b = make_bus("a"), make_bus("b")
    b.close()
    both = cli("status", a.datadir, b.datadir)
    assert both.returncode == 0, both.stderr
    assert f"servicebus {a.datadir}" in both.stdout and f"servicebus {b.datadir}" in both.stdout
    rows = cli_json("status", a.datadir, b.datadir)
    assert [r["datadir"] for r in rows] == [str(a.datadir), str(b.datadir)]
    worse = cli("status", a.datadir, tmp_path / "nope", b.datadir)
    assert worse.returncode == 2 and "no such data directory" in worse.stderr
    assert f"servicebus {b.datadir}" in worse.stdout  # the rest still shown
    letters = cli("deadletters", a.datadir, b.datadir)
    assert letters.returncode == 0 and f"== {a.datadir}" in letters.stdout and f"== {b.datadir}" in letters.stdout


def test_replay_of_several_data_directories_replays_each_and_labels_its_rows(make_bus):
    pub = make_bus("pub")
    one, s1 = failing_subscriber(make_bus, pub, "one")
    two, s2 = failing_subscriber(make_bus, pub, "two")
    pub.publish(TOPIC, {"n": 1})
    wait_until(lambda: one.status().deadletters == 1 and two.status().deadletters == 1, 20)
    s1["fail"] = s2["fail"] = False
    two.close()
    rows = cli_json("replay", one.datadir, two.datadir, "--all")
    assert sorted(r["datadir"] for r in rows) == sorted([str(one.datadir), str(two.datadir)])
    assert {r["result"] for r in rows} == {"replayed"}
    wait_until(lambda: s1["got"] == [(TOPIC, 1)], 20)


# --- tables ------------------------------------------------------------------------------------


def _joined_cells(text: str, column: int) -> str:
    """Column ``column`` of every row of a printed table, its folded lines joined."""
    rows = [line.split("│")[1:-1] for line in text.splitlines() if line.startswith("│")]
    return "".join(row[column].strip() for row in rows)


def table_columns(text: str) -> tuple[list[str], list[str]]:
    """(headers, cells) of a one-row rich table as printed, each column's text joined
    across the lines it was folded over, without spaces."""
    def joined(mark: str) -> list[str]:
        rows = [line.split(mark)[1:-1] for line in text.splitlines() if line.startswith(mark)]
        return ["".join(row[i] for row in rows).replace(" ", "") for i in range(len(rows[0]))]
    return joined("┃"), joined("│")


def test_a_table_at_60_columns_shows_every_column_and_at_160_uses_the_room_for_the_error(make_bus):
    pub, sub, state, ids = dead_letters_of(make_bus)
    (mid,) = ids[TOPIC]
    whole_error = f"ValueError: {ERROR}".replace(" ", "")
    narrow = cli_cols(60, "deadletters", sub.datadir, "--full")
    assert narrow.returncode == 0, narrow.stderr
    assert max(len(line) for line in narrow.stdout.splitlines()) <= 60, narrow.stdout
    headers, cells = table_columns(narrow.stdout)
    assert headers == ["id", "topic", "reason", "error", "payload"], narrow.stdout
    assert cells == [mid, TOPIC, "handler_failed", whole_error, '{"n":0}'], narrow.stdout
    cut = cli_cols(60, "deadletters", sub.datadir)  # without --full: cut short, still there
    headers, cells = table_columns(cut.stdout)
    assert headers == ["id", "topic", "reason", "error", "payload"] and cells[0] == mid, cut.stdout
    assert cells[3].startswith("ValueError") and cells[4].startswith('{"n"'), cut.stdout
    wide = cli_cols(160, "deadletters", sub.datadir)
    assert max(len(line) for line in wide.stdout.splitlines()) <= 160
    assert f"ValueError: {ERROR}" in wide.stdout, wide.stdout  # whole, on one line
    headers, cells = table_columns(wide.stdout)
    assert cells == [mid, TOPIC, "handler_failed", whole_error, '{"n":0}'], wide.stdout


def test_an_expired_command_replayed_by_a_running_bus_is_owed_again_and_delivered(make_bus):
    address = free_address()
    client = make_bus("client")
    client.send(address, "audit.record", {"n": 1}, ttl=0.1)
    wait_until(lambda: client.status().deadletters == 1, 10)
    got = []
    server = make_bus("server", address)
    server.handle("audit.record", lambda p, m: got.append(p))
    assert client.replay(reason="expired") == 1
    wait_until(lambda: got == [{"n": 1}], 15)
    assert client.deadletters() == []


# --- found by a hostile review (each failed before its fix) -------------------------------


def test_replaying_the_first_message_of_a_publish_still_being_handled_is_refused_and_loses_nothing(make_bus):
    import threading

    pub = make_bus("pub")
    sub = make_bus("sub", max_attempts=1)
    gate, got = threading.Event(), []

    def handler(payload, message):
        if payload["n"] == 0 and not got:
            raise ValueError("first fails")
        gate.wait(10)  # the rest of the publish waits here: its segment stays stored
        got.append(payload["n"])

    sub.every(TOPIC, handler)
    sub.subscribe(pub.address, TOPIC, wait=10)
    pub.publish_many(TOPIC, [{"n": n} for n in range(10)])
    wait_until(lambda: sub.status().deadletters == 1, 10)
    assert sub.replay(reason="handler_failed") == 0  # its publish is still being handled here
    gate.set()
    wait_until(lambda: len(got) == 9, 10)
    assert sub.drain(10) and sub.status().deadletters == 1
    assert sub.replay(reason="handler_failed") == 1  # done now: it goes back
    wait_until(lambda: len(got) == 10, 10)
    assert sorted(got) == list(range(10))
    assert cli("check", sub.datadir).returncode == 0


def test_an_empty_list_of_ids_selects_no_dead_letter(make_bus):
    pub = make_bus("pub")
    sub, state = failing_subscriber(make_bus, pub)
    pub.publish(TOPIC, {"n": 1})
    wait_until(lambda: sub.status().deadletters == 1, 10)
    assert sub.purge(ids=[]) == 0 and sub.replay(ids=[]) == 0
    assert sub.status().deadletters == 1


def test_a_missing_data_directory_among_several_is_named_not_taken_for_an_id(make_bus, tmp_path):
    pub = make_bus("pub")
    sub, state = failing_subscriber(make_bus, pub)
    pub.publish(TOPIC, {"n": 1})
    wait_until(lambda: sub.status().deadletters == 1, 10)
    missing = tmp_path / "missing"
    result = cli("replay", sub.datadir, missing, "--all")
    assert result.returncode == 2 and "no such data directory" in result.stderr, result
    assert str(missing) in result.stderr and "no such dead letter" not in result.stderr
    assert sub.status().deadletters == 1  # a command that writes does nothing if a data directory is missing
