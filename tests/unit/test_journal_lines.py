"""The journal's segment files as the audit reads them (store format 3, columnar ``.jcol``
lines, hooks/segments.py): an event about several messages of a segment is one entry per
message and reads as one event per message, a damaged record is set aside whole and the
flush goes on, and every line has the fields and types of the audit's schemas. Then
segments.py itself: lines made by ``Columns`` read back, cut at ``LINE_EVENTS``, a torn last
line skipped, and lines of the older format (``.jsonl``, ``ids``) spread."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgpack
import pytest

from servicebus.audit.journals import COLUMNS_SCHEMA, SCHEMA
from servicebus.hooks.journal import Journal
from servicebus.hooks.segments import (LINE_EVENTS, Columns, events_of_line, is_segment, read_segment,
                                       segment_seq)
from servicebus.model.packer import pack
from servicebus.model.stored import event
from servicebus.store import Store

from ..journals import segment_events, segment_files

PEER = "tcp://127.0.0.1:2"
NODE, ADDRESS = "node", "tcp://127.0.0.1:1"
IDS = [f"{n:024x}" for n in range(1, 101)]


def journal(store: Store, tmp_path: Path) -> Journal:
    return Journal(store, tmp_path, NODE, ADDRESS)


def put(store: Store, j: Journal, events: list) -> None:
    batch = store.batch()
    j.record(batch, events)
    store.write(batch, sync=False)


def put_raw(store: Store, j: Journal, packed: bytes) -> int:
    """A record as the store holds it, whatever it holds (damage that still unpacks); its
    sequence number."""
    seq = next(j._seq)
    batch = store.batch()
    batch.put_journal(seq, packed)
    store.write(batch, sync=False)
    return seq


def events(tmp_path: Path) -> list[dict]:
    """The journal's events, one per message, in file order (strict: a line that does not
    parse fails the test)."""
    return [e for path in segment_files(tmp_path) for e in segment_events(path)]


def raw_lines(tmp_path: Path) -> list[dict]:
    paths = segment_files(tmp_path)
    assert all(p.suffix == ".jcol" for p in paths), paths  # what a bus writes
    return [json.loads(text) for path in paths for text in path.read_text().splitlines()]


# The audit's schemas (journals.SCHEMA for an event, COLUMNS_SCHEMA for a columnar line), as
# checks of the Python values a field must have: a field of another type makes Spark drop the
# whole line as malformed (DROPMALFORMED), every event on it with it.
def _check(kind: str):
    if kind == "STRING":
        return lambda v: isinstance(v, str)
    if kind == "LONG":
        return lambda v: type(v) is int and -2**63 <= v < 2**63
    if kind == "INT":
        return lambda v: type(v) is int and -2**31 <= v < 2**31
    if kind.startswith("ARRAY<"):
        each = _check(kind[6:-1])
        return lambda v: isinstance(v, list) and all(each(x) for x in v)
    if kind.startswith("MAP<STRING,"):
        each = _check(kind[11:-1])
        return lambda v: isinstance(v, dict) and all(isinstance(k, str) and each(x) for k, x in v.items())
    raise AssertionError(f"a type the test does not know: {kind}")


def _fields(schema: str) -> dict:
    return {name: _check(kind) for name, kind in re.findall(r"(\w+) ([A-Z<>,]+)(?:, |$)", schema)}


FIELDS = _fields(SCHEMA)
COLUMN_FIELDS = _fields(COLUMNS_SCHEMA)
# What every event has (``error`` only where there is one; ``ids`` never, in a .jcol file).
EVENT_FIELDS = {"event", "ts", "node", "address", "id", "topic", "kind", "peer", "attempt", "role"}


def test_the_schemas_are_read_whole():
    assert set(FIELDS) == EVENT_FIELDS | {"error", "ids"}
    assert set(COLUMN_FIELDS) == {"node", "address", "keys", "k", "ts", "id", "attempt", "error", "errors"}


def readable_by_the_audit(e: dict) -> bool:
    """An event has every field of the audit's, each of its type, and no other."""
    return (EVENT_FIELDS <= set(e) <= EVENT_FIELDS | {"error"}
            and all(FIELDS[k](v) for k, v in e.items()))


def a_line_the_audit_reads(line: dict) -> bool:
    """A columnar line has the fields of COLUMNS_SCHEMA, each of its type (and ``group``,
    which the audit does not read: [n, segment key] at the entry where n entries of one
    event begin, within the line); its columns are of one length, its keys of five fields
    each, every ``k`` a key, every error at an entry."""
    n = len(line["k"])
    groups = line.get("group", {})
    fields = {k: v for k, v in line.items() if k != "group"}
    return (set(fields) <= set(COLUMN_FIELDS) and set(COLUMN_FIELDS) - {"error", "errors"} <= set(fields)
            and all(COLUMN_FIELDS[k](v) for k, v in fields.items())
            and all(0 <= int(pos) and type(g[0]) is int and int(pos) + g[0] <= n and isinstance(g[1], str)
                    for pos, g in groups.items())
            and len(line["ts"]) == len(line["id"]) == len(line["attempt"]) == n > 0
            and all(len(key) == 5 for key in line["keys"]) and set(line["k"]) == set(range(len(line["keys"])))
            and ("error" in line) == ("errors" in line)
            and all(0 <= int(pos) < n and 0 <= at < len(line["errors"]) for pos, at in line.get("error", {}).items()))


def test_an_event_about_a_segment_is_an_entry_per_message_and_counts_and_reads_as_one_per_message(store, tmp_path):
    j = journal(store, tmp_path)
    put(store, j, [event("published", 1000, IDS[0], "t", "event", PEER, ids=IDS),
                   event("sent", 1001, IDS[0], "t", "event", PEER, 1, None, IDS),
                   event("handler_failed", 1002, IDS[5], "t", "event", PEER, 1, 'KeyError: "x"')])
    put(store, j, [event("handled", 1003, IDS[0], "t", "event", PEER, 1, None, IDS[:1])])  # one: no ids
    assert j.flush() == 100 + 100 + 1 + 1  # events: one per message a line names
    read = events(tmp_path)
    assert len(read) == 202
    published, sent, (failed, handled) = read[:100], read[100:200], read[200:]
    common = {"node": NODE, "address": ADDRESS, "topic": "t", "kind": "event", "peer": PEER}
    assert published == [{**common, "event": "published", "ts": 1000, "id": mid, "attempt": 0, "role": "sender"}
                         for mid in IDS]
    assert sent == [{**common, "event": "sent", "ts": 1001, "id": mid, "attempt": 1, "role": "sender"}
                    for mid in IDS]
    assert failed == {**common, "event": "handler_failed", "ts": 1002, "id": IDS[5], "attempt": 1,
                      "role": "receiver", "error": 'KeyError: "x"'}
    assert handled == {**common, "event": "handled", "ts": 1003, "id": IDS[0], "attempt": 1, "role": "receiver"}
    assert all(readable_by_the_audit(e) for e in read)
    (line,) = raw_lines(tmp_path)  # the two records' events on one line, what repeats once
    assert a_line_the_audit_reads(line)
    assert [key[0] for key in line["keys"]] == ["published", "sent", "handler_failed", "handled"]
    assert (line["error"], line["errors"]) == ({"200": 0}, ['KeyError: "x"'])


def test_records_written_before_segments_existed_still_flush(store, tmp_path):
    # A store migrated from format 2 may hold journal records of 8-field events.
    j = journal(store, tmp_path)
    put(store, j, [("published", 1000, IDS[0], "t", "event", PEER, 0, None),
                   ("handler_failed", 1001, IDS[1], "t", "event", PEER, 2, "boom")])
    assert j.flush() == 2
    published, failed = events(tmp_path)
    assert published["id"] == IDS[0] and published["event"] == "published" and "error" not in published
    assert (failed["id"], failed["attempt"], failed["error"], failed["role"]) == (IDS[1], 2, "boom", "receiver")
    assert all(readable_by_the_audit(e) for e in (published, failed))
    (line,) = raw_lines(tmp_path)
    assert a_line_the_audit_reads(line)


def test_a_record_whose_ids_are_damaged_is_set_aside_whole_and_the_flush_goes_on(store, tmp_path):
    j = journal(store, tmp_path)
    good = ["published", 1000, IDS[0], "t", "event", PEER, 0, None, IDS[:3]]
    put(store, j, [event("published", 999, IDS[9], "t", "event", PEER)])
    damaged = []
    for ids in (5, "abc", {"a": 1}, [1, 2], [IDS[0], None]):  # unpack, but are no list of ids
        damaged.append(put_raw(store, j, msgpack.packb([good, [*good[:8], ids]])))
    for bad in ([*good[:8], None][:7],  # too few fields
                ["published", "1000", IDS[0], "t", "event", PEER, 0, None],  # ts not an int
                ["published", 1000, 7, "t", "event", PEER, 0, None],  # id not a str
                ["no such event", 1000, IDS[0], "t", "event", PEER, 0, None]):
        damaged.append(put_raw(store, j, msgpack.packb([good, bad])))  # its good event goes with it
    put_raw(store, j, b"\xc1 junk")  # does not unpack at all
    put(store, j, [event("sent", 1001, IDS[0], "t", "event", PEER, 1, None, IDS[:3])])
    assert j.flush() == 1 + 3  # the first record and the last: nothing of the damaged ones
    first, *last = events(tmp_path)
    assert (first["event"], first["id"]) == ("published", IDS[9])
    assert [(e["event"], e["id"]) for e in last] == [("sent", mid) for mid in IDS[:3]]
    assert all(readable_by_the_audit(e) for e in (first, *last))
    assert all(a_line_the_audit_reads(line) for line in raw_lines(tmp_path))
    aside = sorted((tmp_path / "journal").glob("*.damaged"))
    assert len(aside) == len(damaged) + 1
    assert [p.name for p in aside[:-1]] == [f"node-{seq:012d}.damaged" for seq in damaged]
    assert msgpack.unpackb(aside[0].read_bytes(), raw=False)[1][8] == 5  # kept raw, as it was
    assert not store.journal_records(100, 1 << 20)  # every record moved or set aside
    assert j.flush() == 0


def test_ids_are_what_the_journal_packs_and_unpacks(store, tmp_path):
    # ids go through msgpack (a tuple in, a list out) and json: the same ids in order.
    j = journal(store, tmp_path)
    ev = event("received", 1000, IDS[0], "t\u00e9", "event", PEER, 2, None, tuple(IDS[:50]))
    assert msgpack.unpackb(pack([ev]), raw=False)[0][8] == IDS[:50]
    put(store, j, [ev])
    assert j.flush() == 50
    read = events(tmp_path)
    assert [e["id"] for e in read] == IDS[:50]
    assert {(e["topic"], e["attempt"], e["event"], e["role"]) for e in read} == {("t\u00e9", 2, "received", "receiver")}
    assert all(readable_by_the_audit(e) for e in read)
    (line,) = raw_lines(tmp_path)
    assert line["id"] == IDS[:50] and line["keys"] == [["received", "t\u00e9", "event", PEER, "receiver"]]


def test_a_flush_of_more_than_a_line_of_events_writes_lines_of_up_to_line_events(store, tmp_path):
    j = journal(store, tmp_path)
    many = [f"{n:024x}" for n in range(LINE_EVENTS * 2 + 500)]
    for start in range(0, len(many), 100):  # segments of 100 messages
        put(store, j, [event("acked", 1000 + start, many[start], "t", "event", PEER, 1, None, many[start:start + 100])])
    assert j.flush() == len(many)
    lines = raw_lines(tmp_path)
    assert [len(line["k"]) for line in lines] == [LINE_EVENTS, LINE_EVENTS, 500]
    assert all(a_line_the_audit_reads(line) for line in lines)
    assert [e["id"] for e in events(tmp_path)] == many


# --- segments.py --------------------------------------------------------------------------------


KEY_A = ("published", "orders", "event", PEER, "sender")
KEY_B = ("handler_failed", "orders", "command", None, "receiver")


def expected(key: tuple, ts: int, ids: list[str], attempt: int, error: str | None) -> list[dict]:
    out = []
    for mid in ids:
        e = {"event": key[0], "ts": ts, "node": NODE, "address": ADDRESS, "id": mid, "topic": key[1],
             "kind": key[2], "peer": key[3], "attempt": attempt, "role": key[4]}
        if error is not None:
            e["error"] = error
        out.append(e)
    return out


def test_columns_lines_give_back_every_event_with_its_errors_at_the_right_entries():
    columns = Columns(NODE, ADDRESS)
    puts = [(KEY_A, 10, IDS[:3], 0, None), (KEY_B, 11, IDS[3:4], 2, "ValueError: x"),
            (KEY_A, 12, IDS[4:5], 0, None), (KEY_B, 13, IDS[5:8], 3, "caf\u00e9 \"quoted\"\n"),
            (KEY_A, 14, IDS[8:9], 1, None)]
    assert [columns.put(*p) for p in puts] == [3, 1, 1, 3, 1]
    assert columns.events == 9
    assert columns.ready() == []  # the line being filled is not ready
    (text,) = columns.lines()
    assert text.endswith("\n") and "\n" not in text[:-1]
    line = json.loads(text)
    assert line["keys"] == [list(KEY_A), list(KEY_B)] and line["k"] == [0, 0, 0, 1, 0, 1, 1, 1, 0]
    # Each text once in the line, an index per entry that has it.
    assert line["errors"] == ["ValueError: x", "caf\u00e9 \"quoted\"\n"]
    assert line["error"] == {"3": 0, "5": 1, "6": 1, "7": 1}
    assert events_of_line(text) == events_of_line(line) == [e for p in puts for e in expected(*p)]
    assert columns.lines() == []  # taken


def test_columns_add_takes_a_records_events_whole_or_not_at_all():
    columns = Columns(NODE, ADDRESS)
    record = [event("published", 1, IDS[0], "t", "event", PEER, ids=IDS[:4]),
              ("handled", 2, IDS[9], "t", "event", PEER, 1, None)]  # 8 fields: before segments
    record = msgpack.unpackb(pack(record), raw=False)  # as a flush reads it: ids a list
    assert columns.add(record) == 5
    with pytest.raises((ValueError, TypeError)):
        columns.add([record[0], ("sent", 3, IDS[0], "t", "event", PEER, 1, None, [1, 2])])
    (text,) = columns.lines()
    assert [(e["event"], e["id"]) for e in events_of_line(text)] == [("published", mid) for mid in IDS[:4]] + [
        ("handled", IDS[9])]
    assert "error" not in json.loads(text)  # none: no empty map either


def test_lines_are_cut_at_line_events_each_with_its_own_keys():
    columns = Columns(NODE, ADDRESS)
    ids = [f"{n:024x}" for n in range(LINE_EVENTS * 2 + 7)]
    for n, mid in enumerate(ids):  # one message per event: a line closes at LINE_EVENTS exactly
        columns.put(KEY_A if n < LINE_EVENTS + 3 else KEY_B, n, [mid], 0, "e" if n % 1000 == 999 else None)
    assert len(columns.ready()) == 2  # two full lines, ready before the end
    assert columns.ready() == []
    columns2 = Columns(NODE, ADDRESS)
    for n, mid in enumerate(ids):
        columns2.put(KEY_A if n < LINE_EVENTS + 3 else KEY_B, n, [mid], 0, "e" if n % 1000 == 999 else None)
    lines = [json.loads(text) for text in columns2.lines()]
    assert [len(line["k"]) for line in lines] == [LINE_EVENTS, LINE_EVENTS, 7]
    assert [line["keys"] for line in lines] == [[list(KEY_A)], [list(KEY_A), list(KEY_B)], [list(KEY_B)]]
    read = [e for line in lines for e in events_of_line(line)]
    assert [e["id"] for e in read] == ids and [e["ts"] for e in read] == list(range(len(ids)))
    assert [e["ts"] for e in read if "error" in e] == [n for n in range(len(ids)) if n % 1000 == 999]


def test_an_event_about_more_messages_than_a_line_holds_is_cut_across_lines():
    columns = Columns(NODE, ADDRESS)
    ids = [f"{n:024x}" for n in range(LINE_EVENTS + 10)]
    assert columns.put(KEY_B, 5, ids[:10], 1, "x") == 10
    assert columns.put(KEY_B, 6, ids[10:], 2, "y") == LINE_EVENTS
    lines = [json.loads(text) for text in columns.lines()]
    assert [len(line["k"]) for line in lines] == [LINE_EVENTS, 10]
    read = [e for line in lines for e in events_of_line(line)]
    assert read == expected(KEY_B, 5, ids[:10], 1, "x") + expected(KEY_B, 6, ids[10:], 2, "y")


def test_read_segment_skips_a_torn_last_line_and_reads_both_formats(tmp_path):
    columns = Columns(NODE, ADDRESS)
    columns.put(KEY_A, 1, IDS[:3], 0, None)
    first = columns.lines()[0]
    columns.put(KEY_B, 2, IDS[3:6], 1, "boom")
    second = columns.lines()[0]
    path = tmp_path / "node-000000000001.jcol"
    path.write_text(first + second[:len(second) // 2])  # a file being written: its last line torn
    assert list(read_segment(path)) == expected(KEY_A, 1, IDS[:3], 0, None)
    path.write_text(first + "\n" + second)
    assert list(read_segment(path)) == expected(KEY_A, 1, IDS[:3], 0, None) + expected(KEY_B, 2, IDS[3:6], 1, "boom")
    old = tmp_path / "node-000000000009.jsonl"
    lines = [{"event": "sent", "ts": 3, "node": NODE, "address": ADDRESS, "id": IDS[0], "topic": "t",
              "kind": "event", "peer": PEER, "attempt": 1, "role": "sender", "ids": IDS[:4]},
             {"event": "handled", "ts": 4, "node": NODE, "address": ADDRESS, "id": IDS[7], "topic": "t",
              "kind": "event", "peer": PEER, "attempt": 1, "role": "receiver"}]
    old.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"event": "sent", "ts"')
    read = list(read_segment(old))
    assert [(e["event"], e["id"]) for e in read] == [("sent", mid) for mid in IDS[:4]] + [("handled", IDS[7])]
    assert all("ids" not in e for e in read)


def test_events_of_an_old_line_with_ids_spread_it_one_per_message():
    line = {"event": "acked", "ts": 7, "node": NODE, "address": ADDRESS, "id": IDS[0], "topic": "t",
            "kind": "event", "peer": PEER, "attempt": 1, "role": "sender", "ids": IDS[:5]}
    spread = events_of_line(json.dumps(line))
    assert spread == [{**{k: v for k, v in line.items() if k != "ids"}, "id": mid} for mid in IDS[:5]]
    alone = {k: v for k, v in line.items() if k != "ids"}
    assert events_of_line(json.dumps(alone)) == [alone]
    for bad in ("[1, 2]", "not json", '{"keys": [], "k": ["0"], "ts": [1], "id": ["a"], "attempt": [0]}',
                '{"k": [0], "ts": [1], "id": ["a"], "attempt": [0]}'):
        with pytest.raises((ValueError, KeyError, TypeError, IndexError)):
            events_of_line(bad)


def test_a_damaged_columnar_entry_is_left_out_alone_as_the_audit_does():
    # audit/journals.py: a key index out of range, or a key not of five fields, or no id,
    # leaves out that entry; shorter arrays are padded with nulls.
    key = ["sent", "t", "event", PEER, "sender"]
    line = {"node": NODE, "address": ADDRESS, "keys": [key, ["short"]], "k": [0, 5, -1, 1, 0, 0],
            "ts": [1, 2, 3, 4, 5], "id": ["a", "b", "c", "d", None, "f"], "attempt": [0, 0, 0, 0, 0, 0]}
    assert [(e["id"], e["ts"]) for e in events_of_line(line)] == [("a", 1), ("f", None)]


def test_segment_names():
    assert is_segment("n-000000000012.jcol") and is_segment("n-000000000012.jsonl")
    assert not any(is_segment(name) for name in ("n-000000000012.jcol.tmp", "n-000000000012.damaged",
                                                  "n.bus.json", "n-000000000012.json"))
    assert segment_seq("a1b2-000000000012.jcol") == segment_seq("a1b2-000000000012.jsonl") == 12
    assert segment_seq("n-x.jcol") is None and segment_seq("n.damaged") is None


def test_grouped_reading_gives_back_each_event_about_a_segment_with_its_key_even_across_lines():
    from servicebus.hooks.segments import LINE_EVENTS, Columns, events_of_line

    many = [f"{n:024x}" for n in range(LINE_EVENTS + 10)]
    columns = Columns("node", "tcp://127.0.0.1:1")
    columns.add([("published", 1, "KEY", "t", "event", PEER, 0, None, many),
                 ("received", 2, "CUT", "t", "event", PEER, 1, None, ["other"]),  # a cut segment: key not in ids
                 ("handled", 3, "one", "t", "event", PEER, 1, "x", None)])
    lines = columns.lines()
    assert len(lines) == 2
    grouped = [e for line in lines for e in events_of_line(line, grouped=True)]
    assert [(e["event"], e["id"], e.get("ids")) for e in grouped] == [
        ("published", "KEY", many[:LINE_EVENTS]), ("published", "KEY", many[LINE_EVENTS:]),
        ("received", "CUT", ["other"]), ("handled", "one", None)]
    spread = [e for line in lines for e in events_of_line(line)]
    assert [e["id"] for e in spread] == [*many, "other", "one"] and spread[-1]["error"] == "x"
