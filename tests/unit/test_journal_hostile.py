"""The columnar journal (.jcol) against hostile and odd input: what a bus writes against what
its readers (the audit, check, journal events) read."""

import json

import pytest
from typer.testing import CliRunner

from servicebus.hooks.segments import LINE_EVENTS, Columns, events_of_line, read_segment
from servicebus.ops.cli import app


def _datadir(tmp_path):
    (tmp_path / "store").mkdir()
    (tmp_path / "journal").mkdir()
    return tmp_path


def test_journal_events_by_id_skips_a_damaged_line_whose_id_is_not_a_string(tmp_path):
    datadir = _datadir(tmp_path)
    good = {"event": "handled", "ts": 1, "node": "n", "address": "a", "id": "m1", "topic": "t",
            "kind": "event", "peer": "p", "attempt": 0, "role": "receiver"}
    (datadir / "journal" / "n-000000000001.jsonl").write_text(
        json.dumps({**good, "id": ["m1"]}) + "\n" + json.dumps({**good, "id": {"x": 1}}) + "\n"
        + json.dumps(good) + "\n")
    columns = Columns("n", "a")
    columns.put(("handled", "t", "event", "p", "receiver"), 2, ["m1", "m2"], 0, None)
    (datadir / "journal" / "n-000000002001.jcol").write_text("".join(columns.lines()))
    result = CliRunner().invoke(app, ["journal", "events", str(datadir), "--id", "m1"])
    assert result.exit_code == 0, result.output
    printed = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(e["id"], e["ts"]) for e in printed] == [("m1", 1), ("m1", 2)]


def test_an_error_about_a_segment_of_many_messages_is_not_written_once_per_message():
    # A handler's exception text is unbounded (f"{type(exc).__name__}: {exc}"); a dead
    # letter of a publish_many's segment names every message. The line format wrote the
    # error once for the event; a columnar line must not hold it thousands of times.
    error = "ValueError: " + "x" * 20_000
    ids = [f"m{i:05d}" for i in range(LINE_EVENTS)]
    columns = Columns("n", "a")
    columns.add([["deadlettered", 1, ids[0], "t", "event", "p", 3, error, ids]])
    lines = columns.lines()
    size = sum(len(line.encode()) for line in lines)
    assert size < 4 * len(error) + 64 * len(ids), size
    assert [e["error"] for line in lines for e in events_of_line(line)] == [error] * len(ids)


def test_a_record_that_fails_part_way_adds_none_of_its_events():
    # The journal sets a record that raises aside whole (raw, beside the segments): none of
    # its events may also be in the segment, or the audit would count them twice once the
    # set-aside record is looked at or replayed.
    columns = Columns("n", "a")
    record = [["published", 1, "m1", "t", "event", "p", 0, None],
              ["published", 1, "m2", ["damaged"], "event", "p", 0, None]]
    with pytest.raises((TypeError, ValueError)):
        columns.add(record)
    assert columns.events == 0
    assert columns.lines() == []


def test_odd_but_legal_values_come_back_as_written(tmp_path):
    columns = Columns('nö\n"', "tcp://[::1]:5\u2028")
    topic, peer, error = 't"ö\n\r\u2028\x00', "p\\\u00e9", 'e\r\n"\u2029' * 10
    columns.add([["published", 5, "a", None, None, None, 0, None],
                 ["received", 6, "b", topic, "event", peer, 2, error],
                 ["handled", 7, "c", "t", "event", "p", 0, None, []],
                 ["published", 8, "k", "t", "event", "p", 0, None, [f"i{i}" for i in range(5000)]]])
    path = tmp_path / "n-000000000001.jcol"
    path.write_text("".join(columns.lines()), encoding="utf-8")
    events = list(read_segment(path))
    assert len(events) == 5003
    assert events[0]["topic"] is None and events[0]["kind"] is None and events[0]["peer"] is None
    assert (events[1]["topic"], events[1]["peer"], events[1]["error"]) == (topic, peer, error)
    assert [e["id"] for e in events[3:]] == [f"i{i}" for i in range(5000)]
    grouped = list(read_segment(path, grouped=True))
    assert [(e["id"], len(e.get("ids") or [])) for e in grouped][3:] == [("k", LINE_EVENTS - 3), ("k", 5000 - LINE_EVENTS + 3)]


def test_journal_events_reads_a_data_directory_or_a_journal_folder_on_its_own_and_filters_by_topic(tmp_path):
    (tmp_path / "bus").mkdir()
    datadir = _datadir(tmp_path / "bus")
    columns = Columns("n", "a")
    columns.put(("handled", "orders", "event", "p", "receiver"), 2, ["m1", "m2"], 1, None)
    columns.put(("handled", "emails", "event", "p", "receiver"), 3, ["m3"], 1, "E: x")
    (datadir / "journal" / "n-000000000001.jcol").write_text("".join(columns.lines()))
    runner = CliRunner()
    whole = runner.invoke(app, ["journal", "events", str(datadir)])
    alone = runner.invoke(app, ["journal", "events", str(datadir / "journal")])  # copied off a host
    assert whole.exit_code == alone.exit_code == 0, (whole.output, alone.output)
    assert whole.stdout == alone.stdout
    assert [json.loads(line)["id"] for line in whole.stdout.splitlines()] == ["m1", "m2", "m3"]
    emails = runner.invoke(app, ["journal", "events", str(datadir), "--topic", "emails"])
    assert [(e["id"], e["error"]) for e in map(json.loads, emails.stdout.splitlines())] == [("m3", "E: x")]
    missing = runner.invoke(app, ["journal", "events", str(tmp_path / "nowhere")])
    assert missing.exit_code != 0 and "no such data directory" in str(missing.exception)


def test_a_one_message_event_after_an_event_that_filled_a_line_reads_back_whole():
    # One record: an event about a whole line's worth of messages (the line is closed in
    # the middle of the record), then events about one message each, of an old key and a new.
    many = [f"m{i:05d}" for i in range(LINE_EVENTS)]
    columns = Columns("n", "a")
    columns.add([["published", 1, many[0], "t", "event", "p", 0, None, many],
                 ["published", 2, "single", "t", "event", "p", 0, None],
                 ["sent", 3, "single", "t", "event", "p", 1, None]])
    events = [e for line in columns.lines() for e in events_of_line(line)]
    assert [(e["id"], e["event"]) for e in events[-2:]] == [("single", "published"), ("single", "sent")]
    assert len(events) == LINE_EVENTS + 2
