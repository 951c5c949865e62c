"""The audit's commands and side files against hostile journals and bus files (Spark: the
session's ``spark`` fixture; the rest is plain Python in tests/unit/test_audit_hostile.py)."""

import subprocess

import pytest

from servicebus.audit import job

pytestmark = pytest.mark.spark
pytest.importorskip("pyspark", reason="pyspark is not installed (pip install 'servicebus[audit]')")
if job.java_problem():
    pytest.skip(job.java_problem(), allow_module_level=True)

MESSAGES = ("class STRING, id STRING, topic STRING, sender STRING, receiver STRING, last_event STRING, "
            "last_ts LONG, published_ts LONG, handled_count INT, attempts INT, deadletter_reason STRING, "
            "deadlettered_at STRING, received INT")


def _args(command: str, cwd) -> list[str]:
    """What bash runs when an operator pastes ``command``: the arguments servicebus (or grep)
    gets, and nothing else may run (a second line would be a command of its own)."""
    done = subprocess.run(["bash", "-c", 'f() { printf "%s\\0" "$@"; }; f ' + command.split(" ", 1)[1]],
                          capture_output=True, timeout=10, cwd=cwd)
    assert done.returncode == 0 and done.stderr == b"", (command, done.stderr)
    return done.stdout.decode().split("\0")[:-1]


def test_every_printed_command_is_one_command_with_exactly_its_arguments_whatever_the_names(spark, tmp_path):
    from servicebus.audit.problems import problem_table

    odd = ["/srv/x\n", "/srv/$(touch PWNED); x", "/srv/it's \u202egnp.exe", "-rf", "/srv/\r", "/srv/a\u2028"]
    buses = {f"tcp://s:{i}": {"name": "shop", "datadir": d} for i, d in enumerate(odd)}
    rows = [("deadlettered", "MARK", "t", f"tcp://s:{i}", "tcp://unknown>x:1", "x", 1, 1, 0, 1, "r", "sender", 0)
            for i in range(len(odd))]
    rows.append(("owed", "id\n", "t", "tcp://nobody'$(x):1\n", "tcp://r:1\n", "x", 1, 1, 0, 1, None, None, 0))
    got = problem_table(spark, spark.createDataFrame(rows, MESSAGES), buses).select("sender", "command").collect()
    by_sender = {r["sender"]: r["command"] for r in got}
    for i, datadir in enumerate(odd):
        assert _args(by_sender[f"tcp://s:{i}"], tmp_path) == ["replay", datadir, "MARK"]
    # No bus file for the sender: a placeholder to fill in, that does nothing when pasted as it is.
    assert _args(by_sender["tcp://nobody'$(x):1\n"], tmp_path) == [
        "outgoing", "<data directory of tcp://nobody'$(x):1\n>", "--subscriber", "tcp://r:1\n"]
    assert list(tmp_path.iterdir()) == []


def test_a_huge_bus_file_is_not_read(spark, tmp_path):
    from servicebus.audit.journals import read_buses

    journal = tmp_path / "a" / "journal"
    journal.mkdir(parents=True)
    (journal / "n-000000000001.jsonl").write_text("")
    (journal / "n.bus.json").write_text('{"addresses": {"tcp://a:1": "' + "x" * (2 << 20) + '"}}')
    (journal / "m.bus.json").write_text('{"addresses": {"tcp://a:2": "email"}}')
    assert read_buses(spark, [str(journal / "*.jsonl")]) == {"tcp://a:2": {"name": "email", "datadir": str(tmp_path / "a")}}


def test_damaged_columnar_lines_lose_only_their_damaged_entries_and_never_fail_the_audit(spark, tmp_path):
    """A columnar segment (hooks/segments.py) with hostile lines: keys indexed out of range
    (-1 would make Spark's element_at fail the whole job, -2 would read the last key: another
    event's), keys too short, arrays of different lengths, fields of the wrong type, no JSON.
    The audit reads every good entry and no other."""
    import json

    journal = tmp_path / "pub" / "journal"
    journal.mkdir(parents=True)
    key = ["published", "t", "event", "tcp://r:1", "sender"]
    good = {"node": "pub", "address": "tcp://p:1", "keys": [key, ["sent", "t", "event", "tcp://r:1", "sender"]],
            "k": [0, 1], "ts": [1000, 1001], "id": ["m1", "m1"], "attempt": [0, 1]}
    lines = [good,
             {**good, "k": [-1, 0], "id": ["bad1", "m2"]},  # -1: no key (m2 is good)
             {**good, "k": [-2, 5], "id": ["bad2", "bad3"]},  # -2, past the end: no key
             {**good, "keys": [["published", "t"]], "k": [0, 0], "id": ["bad4", "bad5"]},  # a short key
             {**good, "k": "0", "id": ["bad6", "bad7"]},  # not an array: the line is malformed
             {**good, "ts": ["x", 1], "id": ["bad8", "bad9"]},
             # errors: an index out of range is no error; one of another type, damage
             {**good, "id": ["m3", "m4"], "errors": ["E: x"], "error": {"0": -1, "1": 7}},
             {**good, "id": ["m5", "m6"], "errors": ["E: x"], "error": {"1": 0}},
             {**good, "id": ["bad10", "bad11"], "errors": ["E: x"], "error": {"1": "E: x"}}]
    text = "".join(json.dumps(line) + "\n" for line in lines) + "{not json\n" + '{"k": [0], "ts": [1]'
    (journal / "pub-000000000001.jcol").write_text(text)
    events = job.read_events(spark, job.input_paths([str(tmp_path / "pub")]))
    from servicebus.audit.reconcile import one_per_message

    got = sorted((r["id"], r["event"], r["error"]) for r in one_per_message(events).collect())
    assert got == [("m1", "published", None), ("m1", "sent", None), ("m2", "published", None),
                   ("m3", "published", None), ("m4", "sent", None), ("m5", "published", None),
                   ("m6", "sent", "E: x")]
    # The readers outside Spark (check, journal events) read the same.
    from servicebus.hooks.segments import read_segment

    assert sorted((e["id"], e["event"], e.get("error")) for e in read_segment(journal / "pub-000000000001.jcol")) == got
    summary = job.run(spark, [str(tmp_path / "pub")], str(tmp_path / "out"), write=False)
    assert summary["events"] == 7 and summary["messages"] == 6
