"""check/repair (ops/repair.py, ops/lost.py) on stores written by hand: what a stream's
topic and a delivery state's owner are when the stream is a priority level ("e:<topic> 3")
or the owner a subscriber group ("group:<name>"); and segments (store format 3): records
holding several messages, the progress of their runs, messages split off, and the journal
naming a segment's messages in one event."""

import json

import msgpack
import pytest

from servicebus.model.delivery import Kind, pack_outgoing
from servicebus.model.segments import make_blob
from servicebus.model.stored import IncomingRecord, Progress, RunState
from servicebus.hooks.journal import FLUSH_CHUNK
from servicebus.hooks.segments import Columns
from servicebus.ops.repair import ON_UNDECODABLE, Owed, check, journal_owed, lost_in_repair, older_format
from servicebus.ops.repair import _last_segment_seq

SUB, OTHER = "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"


def cursor(floor, acked=()):
    return {"floor": floor, "acked": list(acked), "attempts": {}}


def write(store, subscriptions=(), deliveries=(), outgoing=()):
    b = store.batch()
    for sub, topic, record in subscriptions:
        b.put_subscription(sub, topic, {"created": 1, "node": "", **record})
    for peer, stream, record in deliveries:
        b.put_delivery(peer, stream, record)
    for stream, mid in outgoing:
        b.put_outgoing(stream, mid, pack_outgoing(Kind.EVENT, "t", 1, [mid], make_blob([b"\x01"])))
    store.write(b, sync=True)


def problems(store, repair=False):
    return {(p.keyspace, p.key, p.problem) for p in check(store, repair)}


def test_a_subscribers_cursors_on_every_priority_level_belong_to_its_subscription(store):
    write(store, [(SUB, "t", {"since": "0001"})],
          [(SUB, "e:t", cursor("0003")), (SUB, "e:t 3", cursor("0002")), (SUB, "e:t 9", cursor(None))],
          [("e:t", "0004"), ("e:t 3", "0005"), ("e:t 9", "0006")])
    assert problems(store) == set()


def test_a_groups_cursors_belong_to_its_members_subscriptions(store):
    write(store, [(SUB, "t", {"since": "0001", "group": "g"}), (OTHER, "t", {"since": "0002", "group": "g"})],
          [("group:g", "e:t", cursor("0003")), ("group:g", "e:t 3", cursor("0002"))],
          [("e:t", "0004"), ("e:t 3", "0005")])
    assert problems(store) == set()


def test_a_priority_level_with_no_cursor_yet_is_owed_to_its_topics_subscribers(store):
    # A crash between a publish and the engine's next turn: the bus makes its cursors at start.
    write(store, [(SUB, "t", {"since": "0001"})], [(SUB, "e:t", cursor("0001"))], [("e:t 3", "0002")])
    assert problems(store) == set()


def test_cursors_left_without_their_subscription_restore_it_to_the_topic_once(store):
    write(store, [], [(SUB, "e:t 3", cursor("0005")), (SUB, "e:t 9", cursor("0007"))], [("e:t 3", "0006")])
    assert problems(store, repair=True) == {
        ("deliveries", f"{SUB} e:t 3", "delivery state without its subscription")}
    # Not from a level's cursor: "since" is where the level-0 stream is read from.
    assert [(s, t, r["since"]) for s, t, r in store.subscriptions()] == [(SUB, "t", "")]
    assert problems(store) == set()


def test_a_groups_cursors_with_no_member_left_are_dropped_not_made_a_subscriber(store):
    write(store, [], [("group:g", "e:t", cursor("0001")), ("group:g", "e:t 3", cursor("0001"))],
          [("e:t", "0002"), ("e:t 3", "0003")])
    found = problems(store, repair=True)
    assert {(k, key) for k, key, _ in found} == {
        ("deliveries", "group:g e:t"), ("deliveries", "group:g e:t 3"),
        ("outgoing", "e:t"), ("outgoing", "e:t 3")}
    assert list(store.subscriptions()) == [] and list(store.deliveries()) == []
    assert sorted(mid for mid, _ in store.deadletters()) == ["0002", "0003"]
    assert problems(store) == set()


def test_a_damaged_cursor_on_a_priority_level_restarts_from_its_subscription(store):
    write(store, [(SUB, "t", {"since": "0004"}), (OTHER, "t", {"since": "0002", "group": "g"}),
                  ("tcp://127.0.0.1:3", "t", {"since": "0003", "group": "g"})],
          [(SUB, "e:t", cursor("0005")), ("group:g", "e:t", cursor("0005"))])
    b = store.batch()
    b.put_delivery(SUB, "e:t 3", "junk")  # type: ignore[arg-type]
    b.put_delivery("group:g", "e:t 3", "junk")  # type: ignore[arg-type]
    store.write(b, sync=True)
    assert {key for _, key, _ in problems(store, repair=True)} == {f"{SUB}\x00e:t 3", "group:g\x00e:t 3"}
    floors = {(p, s): r["floor"] for p, s, r in store.deliveries()}
    assert floors[(SUB, "e:t 3")] == "0004"  # its subscriber's "since"
    assert floors[("group:g", "e:t 3")] == "0002"  # the earliest of its members'
    assert problems(store) == set()


def test_a_message_missing_after_damage_is_looked_for_on_every_priority_level(store):
    write(store, [(SUB, "t", {"since": "0001"})],
          [(SUB, "e:t", cursor("0001")), (SUB, "e:t 3", cursor("0001"))], [("e:t 3", "0002")])
    owed = Owed(sent={("0002", SUB): "e:t"})  # the journal does not say which level
    assert lost_in_repair(store, owed) == []


def test_a_missing_message_is_acknowledged_only_if_every_level_it_could_be_on_says_so(store):
    # The journal does not say which level "0004" was on: level 0's cursor has passed it,
    # level 3's has not. Had it been a priority-3 event, it was lost: it is reported.
    write(store, [(SUB, "t", {"since": "0001"})],
          [(SUB, "e:t", cursor("0005")), (SUB, "e:t 3", cursor("0002", acked=["0006"]))])
    owed = Owed(sent={("0004", SUB): "e:t", ("0006", SUB): "e:t", ("0001", SUB): "e:t"})
    assert [p.key for p in lost_in_repair(store, owed)] == ["0004"]


# --- store format 3: segments (model/segments.py) ---------------------------------------------

IDS = [f"{n:024x}" for n in range(0xA0, 0xA4)]  # one segment of four: its key is IDS[0]


def segment(store, ids=IDS, progress=None, runstates=()):
    """A received segment of ``ids`` not handled yet, with its runs' progress and run states."""
    b = store.batch()
    b.put_incoming(ids[0], IncomingRecord(1, "t", "node", OTHER, 1, 1, None, None, None, list(ids),
                                          make_blob([b"\x01"] * len(ids))))
    if progress is not None:
        b.put_progress(ids[0], 0, progress)
    for mid in runstates:
        b.put_runstate(mid, RunState(1, [], "ValueError: x", 0))
    store.write(b, sync=True)


def test_a_run_state_of_a_message_inside_a_segment_belongs_to_it(store):
    # An ordered segment retried at its third message keeps that message's run state under
    # its own id (handling/segmentrun.py): not the segment's key, not an orphan.
    segment(store, progress=Progress(2, 1, []), runstates=[IDS[2]])
    assert problems(store) == set()
    b = store.batch()
    b.put_runstate("f" * 24, RunState(1, [], None, 0))
    store.write(b, sync=True)
    assert problems(store) == {("runstate", "f" * 24, "run state of a message that is not stored")}


def test_a_progress_record_whose_segment_is_gone_is_reported_and_repair_drops_it(store):
    segment(store, progress=Progress(1, 1, []))
    b = store.batch()
    b.put_progress("e" * 24, 0, Progress(2, 1, [1]))  # its segment finished, the progress left
    store.write(b, sync=True)
    assert problems(store, repair=True) == {
        ("progress", f"{'e' * 24} 00000", "progress of a segment that is not stored")}
    assert store.progress("e" * 24) == {}
    assert store.progress(IDS[0]) == {0: Progress(1, 1, [])}  # its own segment's is kept
    assert problems(store) == set()


def test_progress_indices_past_the_segment_are_reported_and_kept_within_it(store):
    segment(store, progress=Progress(9, 1, [1, 7]))  # a segment of 4: next 9, skipped 7
    (found,) = problems(store, repair=True)
    assert found[:2] == ("progress", f"{IDS[0]} 00000") and "past its segment of 4" in found[2]
    assert store.progress(IDS[0]) == {0: Progress(4, 1, [1])}
    assert problems(store) == set()


def test_a_damaged_progress_record_is_dropped_and_its_segment_kept(store):
    segment(store, progress=Progress(1, 1, []))
    b = store.batch()
    b.put_raw(b"c/" + IDS[0].encode() + b"\x0000000", b"\xc1 junk")
    store.write(b, sync=True)
    (found,) = check(store, repair=True)
    assert (found.keyspace, found.action) == ("progress", ON_UNDECODABLE["progress"])
    assert store.progress(IDS[0]) == {} and store.get_incoming(IDS[0]).ids == IDS
    assert problems(store) == set()


def test_a_damaged_segment_record_is_reported_with_the_ids_of_the_messages_it_held(store):
    b = store.batch()
    # Its ids read, its payloads do not (three ids, two payloads): every one of them is lost.
    b.put_raw(b"o/e:t\x00" + IDS[0].encode(), msgpack.packb([1, "t", 1, None, None, None, IDS[:3],
                                                             make_blob([b"\x01", b"\x02"])]))
    store.write(b, sync=True)
    (found,) = check(store, repair=True)
    assert found.keyspace == "outgoing" and found.key == f"e:t\x00{IDS[0]}"
    assert found.problem.endswith(f"its messages: {IDS[0]}, {IDS[1]}, {IDS[2]}")
    assert found.action.startswith("dropped: LOST")
    assert store.stream_ids("e:t") == []


def test_a_segment_no_subscriber_is_owed_becomes_a_dead_letter_per_message(store):
    b = store.batch()
    b.put_outgoing("e:gone", IDS[0], pack_outgoing(Kind.EVENT, "gone", 1, IDS[:3],
                                                    make_blob([b"\x01", b"\x02", b"\x03"])))
    store.write(b, sync=True)
    assert problems(store, repair=True) == {("outgoing", "e:gone", "3 message(s) no subscriber is owed")}
    letters = dict(store.deadletters())
    assert sorted(letters) == IDS[:3] and store.stream_ids("e:gone") == []
    for n, mid in enumerate(IDS[:3]):  # each a segment of one, as replay puts it back
        assert letters[mid]["reason"] == "no_subscriber"
        assert letters[mid]["record"][6:] == [[mid], make_blob([bytes([n + 1])])]
    assert problems(store) == set()


def test_journal_events_naming_a_segment_are_read_as_one_event_per_id(tmp_path):
    journal = tmp_path / "journal"
    journal.mkdir()
    line = {"role": "sender", "topic": "t", "kind": "event", "peer": SUB}
    events = [{**line, "event": "published", "id": IDS[0], "ids": IDS},
              {**line, "event": "acked", "id": IDS[0], "ids": IDS[:2]},
              {**line, "event": "received", "role": "receiver", "id": IDS[2], "ids": IDS[2:]},
              {**line, "event": "handled", "role": "receiver", "id": IDS[3]}]
    (journal / "n-000000000001.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    owed = journal_owed(tmp_path)
    assert sorted(owed.sent) == [(IDS[2], SUB), (IDS[3], SUB)]
    assert owed.received == {IDS[2]} and owed.keys[IDS[3]] == IDS[2]


def _columns(events: list[tuple], node: str = "n") -> str:
    """The .jcol lines a bus writes of ``events`` (model/stored.py's tuples)."""
    columns = Columns(node, "tcp://127.0.0.1:9")
    columns.add(msgpack.unpackb(msgpack.packb(events), raw=False))
    return "".join(columns.lines())


SEGMENT_EVENTS = [("published", 1, IDS[0], "t", "event", SUB, 0, None, IDS),
                  ("acked", 2, IDS[0], "t", "event", SUB, 1, None, IDS[:2]),
                  ("received", 3, IDS[2], "t", "event", SUB, 1, None, IDS[2:]),
                  ("handled", 4, IDS[3], "t", "event", SUB, 1, None)]


def test_journal_events_naming_a_segment_in_columns_are_read_as_one_event_per_id(tmp_path):
    # What a bus writes since .jcol: the same events as above, one entry per message.
    journal = tmp_path / "journal"
    journal.mkdir()
    (journal / "n-000000000001.jcol").write_text(_columns(SEGMENT_EVENTS))
    owed = journal_owed(tmp_path)
    assert sorted(owed.sent) == [(IDS[2], SUB), (IDS[3], SUB)]
    assert owed.received == {IDS[2]}


def test_a_segment_key_is_known_from_a_columnar_journal(tmp_path):
    # Cursors, the stored streams and the receiver's records go by a segment's key (its
    # first id): lost_in_repair finds a message that is not a segment's first by it. The
    # .jsonl journal gave it (``ids``); the .jcol one must too, or a kept message of a
    # segment is reported lost (test_damage's priority-stream test shows it end to end).
    journal = tmp_path / "journal"
    journal.mkdir()
    (journal / "n-000000000001.jcol").write_text(_columns(SEGMENT_EVENTS))
    owed = journal_owed(tmp_path)
    assert owed.keys[IDS[3]] == IDS[2] and owed.keys[IDS[1]] == IDS[0]


def test_segments_of_both_formats_are_read_in_order_of_their_names(tmp_path):
    # A bus upgraded in place: its older segments .jsonl, its newer .jcol; events in the new
    # ones follow those in the old (acked after published).
    journal = tmp_path / "journal"
    journal.mkdir()
    line = {"role": "sender", "topic": "t", "kind": "event", "peer": SUB, "event": "published"}
    (journal / "n-000000000001.jsonl").write_text(json.dumps({**line, "id": IDS[0], "ids": IDS}) + "\n"
                                                  + '{"event": "acked", "ro')  # a torn last line: skipped
    (journal / "n-000000000007.jcol").write_text(_columns([("acked", 2, IDS[0], "t", "event", SUB, 1, None, IDS[:3]),
                                                           ("published", 3, "d" * 24, "t", "event", OTHER, 0, None)]))
    (journal / "n-000000000007.jcol.tmp").write_text(_columns([("acked", 2, IDS[3], "t", "event", SUB, 1, None)]))
    owed = journal_owed(tmp_path)
    assert sorted(owed.sent) == [(IDS[3], SUB), ("d" * 24, OTHER)]


@pytest.mark.parametrize("suffix", [".jcol", ".jsonl"])
def test_repair_numbers_journal_records_past_every_segment_of_either_format(tmp_path, suffix):
    # A segment is named by its first record's number and holds up to FLUSH_CHUNK: a record
    # numbered within its range could later be flushed under a name already taken.
    assert _last_segment_seq(tmp_path) == 0
    journal = tmp_path / "journal"
    journal.mkdir()
    assert _last_segment_seq(tmp_path) == 0
    (journal / f"n-000000000040{suffix}").write_text("")
    (journal / "n-000000000009.jsonl").write_text("")
    (journal / "n-000000009999.damaged").write_text("")  # a record set aside: not a segment
    (journal / "n-000000099999.jcol.tmp").write_text("")  # never renamed: not a segment
    (journal / "n.bus.json").write_text("{}")
    assert _last_segment_seq(tmp_path) == 40 + FLUSH_CHUNK
    (journal / "m-000000000100.jcol").write_text("")
    assert _last_segment_seq(tmp_path) == 100 + FLUSH_CHUNK


def test_no_message_of_a_segment_still_stored_or_passed_by_its_cursor_is_reported_lost(store):
    # The journal names every message of each segment; the store and the cursors know the
    # segments by their keys: a message that is not a segment's first is found by its key.
    later = [f"{n:024x}" for n in range(0xB0, 0xB3)]
    write(store, [(SUB, "t", {"since": "0001"})], [(SUB, "e:t", cursor(IDS[0]))])
    b = store.batch()
    b.put_outgoing("e:t", later[0], pack_outgoing(Kind.EVENT, "t", 1, later, make_blob([b"\x01"] * 3)))
    store.write(b, sync=True)
    owed = Owed()
    for ids in (IDS, later):  # IDS acked (the cursor's floor is its key), ``later`` stored
        for mid in ids:
            owed.sent[(mid, SUB)] = "e:t"
            owed.keys[mid] = ids[0]
    assert lost_in_repair(store, owed) == []
    del owed.keys[later[1]]  # without its segment's key, it would be "lost"
    b = store.batch()
    b.delete_outgoing("e:t", later[0])
    store.write(b, sync=True)
    assert {p.key for p in lost_in_repair(store, owed)} == set(later)


def test_received_messages_of_a_handled_segment_are_not_reported_lost(store):
    b = store.batch()
    b.put_handled(IDS[0], 5)  # the segment completed: its key is remembered
    b.put_journal(1, msgpack.packb([["received", 1, IDS[0], "t", "event", SUB, 1, None, IDS],
                                    ["received", 1, "c" * 24, "t", "event", SUB, 1, None]]))
    store.write(b, sync=True)
    assert [p.key for p in lost_in_repair(store, Owed())] == ["c" * 24]


def test_a_store_of_an_older_format_is_told_by_its_records_when_its_format_record_is_damaged(store):
    assert older_format(store) is None
    b = store.batch()
    b.put_raw(b"o/e:t\x00" + IDS[0].encode(), msgpack.packb([1, "t", 1, None, None, None, b"\x01"]))
    b.put_meta("format", b"junk")
    store.write(b, sync=True)
    assert older_format(store) == (2, "its format record is damaged")
    b = store.batch()
    b.put_meta("format", b"2")
    store.write(b, sync=True)
    assert older_format(store) == (2, "")
