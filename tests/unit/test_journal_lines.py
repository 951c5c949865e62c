"""The journal's segment files as the audit reads them (store format 3): an event about
several messages of a segment is one line with ``ids``, a damaged record is set aside whole
and the flush goes on, and every line has the fields and types of the audit's schema."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgpack

from servicebus.audit.journals import SCHEMA
from servicebus.hooks.journal import Journal
from servicebus.model.packer import pack
from servicebus.model.stored import event
from servicebus.store import Store

PEER = "tcp://127.0.0.1:2"
IDS = [f"{n:024x}" for n in range(1, 101)]


def journal(store: Store, tmp_path: Path) -> Journal:
    return Journal(store, tmp_path, "node", "tcp://127.0.0.1:1")


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


def lines(tmp_path: Path) -> list[dict]:
    return [json.loads(text) for path in sorted((tmp_path / "journal").glob("*.jsonl"))
            for text in path.read_text().splitlines()]


# The audit's schema (journals.SCHEMA), as Python types a line's fields must have.
_TYPES = {"STRING": str, "LONG": int, "INT": int, "ARRAY<STRING>": list}
FIELDS = {name: _TYPES[kind] for name, kind in re.findall(r"(\w+) ([A-Z<>]+)", SCHEMA)}


def readable_by_the_audit(line: dict) -> bool:
    """Every field of the line is one of the audit's, of its type (a field of another type
    makes Spark drop the line as malformed); ``ids`` is an array of strings."""
    return (set(line) <= set(FIELDS) and all(isinstance(v, FIELDS[k]) for k, v in line.items())
            and all(isinstance(i, str) for i in line.get("ids", [])))


def test_an_event_about_a_segment_is_one_line_naming_every_message_and_counts_as_one_per_message(store, tmp_path):
    j = journal(store, tmp_path)
    put(store, j, [event("published", 1000, IDS[0], "t", "event", PEER, ids=IDS),
                   event("sent", 1001, IDS[0], "t", "event", PEER, 1, None, IDS),
                   event("handler_failed", 1002, IDS[5], "t", "event", PEER, 1, 'KeyError: "x"')])
    put(store, j, [event("handled", 1003, IDS[0], "t", "event", PEER, 1, None, IDS[:1])])  # one: no ids
    assert j.flush() == 100 + 100 + 1 + 1  # events: one per message a line names
    published, sent, failed, handled = lines(tmp_path)
    assert published["ids"] == IDS and published["id"] == IDS[0]
    assert (published["event"], published["role"], published["peer"], published["attempt"]) == (
        "published", "sender", PEER, 0)
    assert sent["ids"] == IDS and sent["attempt"] == 1
    assert "ids" not in failed and failed["id"] == IDS[5] and failed["error"] == 'KeyError: "x"'
    assert "ids" not in handled and handled["id"] == IDS[0]
    assert all(readable_by_the_audit(line) for line in (published, sent, failed, handled))


def test_records_written_before_segments_existed_still_flush(store, tmp_path):
    # A store migrated from format 2 may hold journal records of 8-field events.
    j = journal(store, tmp_path)
    put(store, j, [("published", 1000, IDS[0], "t", "event", PEER, 0, None)])
    assert j.flush() == 1
    (line,) = lines(tmp_path)
    assert line["id"] == IDS[0] and "ids" not in line and readable_by_the_audit(line)


def test_a_record_whose_ids_are_damaged_is_set_aside_whole_and_the_flush_goes_on(store, tmp_path):
    j = journal(store, tmp_path)
    good = ["published", 1000, IDS[0], "t", "event", PEER, 0, None, IDS[:3]]
    put(store, j, [event("published", 999, IDS[9], "t", "event", PEER)])
    damaged = []
    for ids in (5, "abc", {"a": 1}, [1, 2], [IDS[0], None]):  # unpack, but are no list of ids
        damaged.append(put_raw(store, j, msgpack.packb([good, [*good[:8], ids]])))
    put_raw(store, j, b"\xc1 junk")  # does not unpack at all
    put(store, j, [event("sent", 1001, IDS[0], "t", "event", PEER, 1, None, IDS[:3])])
    assert j.flush() == 1 + 3  # the first record and the last: not a line of the damaged ones
    first, last = lines(tmp_path)
    assert (first["event"], first["id"]) == ("published", IDS[9]) and last["ids"] == IDS[:3]
    aside = sorted((tmp_path / "journal").glob("*.damaged"))
    assert len(aside) == len(damaged) + 1
    assert [p.name for p in aside[:-1]] == [f"node-{seq:012d}.damaged" for seq in damaged]
    assert msgpack.unpackb(aside[0].read_bytes(), raw=False)[1][8] == 5  # kept raw, as it was
    assert not store.journal_records(100, 1 << 20)  # every record moved or set aside
    assert j.flush() == 0


def test_a_line_with_ids_is_what_the_journal_packs_and_unpacks(store, tmp_path):
    # ids go through msgpack (a tuple in, a list out) and json: the same ids in order.
    j = journal(store, tmp_path)
    ev = event("received", 1000, IDS[0], "t\u00e9", "event", PEER, 2, None, tuple(IDS[:50]))
    assert msgpack.unpackb(pack([ev]), raw=False)[0][8] == IDS[:50]
    put(store, j, [ev])
    assert j.flush() == 50
    (line,) = lines(tmp_path)
    assert line["ids"] == IDS[:50] and line["topic"] == "t\u00e9" and readable_by_the_audit(line)
