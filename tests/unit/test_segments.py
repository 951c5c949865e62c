"""Store format 3's unit, the segment (model/segments.py): how a publish is cut into
segments, a segment's blob of payloads, and the migration of a format-2 store, whose
messages become segments of one (store/migrate.py)."""

import random

import msgpack
import pytest

from servicebus.errors import StoreError
from servicebus.model.delivery import pack_outgoing, unpack_outgoing
from servicebus.model.packer import pack
from servicebus.model.segments import SEGMENT_BYTES, bodies_of, count_of, cut, make_blob, single
from servicebus.model.stored import IncomingRecord
from servicebus.store import FORMAT_VERSION, Store
from servicebus.store.migrate import upgrade
from servicebus.wire.payload import encode_payload
from servicebus.wire.protocol import Kind

# --- cutting a publish into segments ----------------------------------------------------------


def test_a_publish_is_cut_by_count():
    bodies = [b"x"] * 10
    assert list(cut(bodies, 4)) == [(0, 4), (4, 8), (8, 10)]
    assert list(cut(bodies, 10)) == [(0, 10)]
    assert list(cut(bodies, 1)) == [(i, i + 1) for i in range(10)]
    assert list(cut([], 4)) == []


def test_a_publish_is_cut_by_bytes_counting_what_msgpack_and_the_caller_add_per_payload():
    bodies = [b"x" * 100] * 7  # each 100 bytes, and up to 5 of msgpack's bin header: 105
    assert list(cut(bodies, 100, max_bytes=315)) == [(0, 3), (3, 6), (6, 7)]  # 3 x 105 fit
    assert list(cut(bodies, 100, max_bytes=314)) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    # ``extra``: per-message overhead the caller counts with the payload (its id, say).
    assert list(cut(bodies, 100, max_bytes=315, extra=1)) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    # The count and the bytes together: whichever comes first.
    assert list(cut(bodies, 2, max_bytes=315)) == [(0, 2), (2, 4), (4, 6), (6, 7)]


def test_a_payload_bigger_than_a_segment_goes_alone_and_the_others_around_it_are_cut_as_usual():
    bodies = [b"a", b"b" * 500, b"c", b"d"]
    assert list(cut(bodies, 100, max_bytes=100)) == [(0, 1), (1, 2), (2, 4)]
    assert list(cut([b"z" * (SEGMENT_BYTES + 1)], 100)) == [(0, 1)]


def test_the_cuts_cover_every_payload_once_in_order_within_both_bounds():
    rng = random.Random(3)
    for _ in range(300):
        bodies = [b"x" * rng.choice([0, 1, 50, 300, 2000]) for _ in range(rng.randrange(0, 60))]
        count, limit = rng.randint(1, 12), rng.choice([10, 400, 3000, SEGMENT_BYTES])
        parts = list(cut(bodies, count, max_bytes=limit))
        assert [i for start, end in parts for i in range(start, end)] == list(range(len(bodies)))
        for start, end in parts:
            assert 0 < end - start <= count
            assert end - start == 1 or sum(len(b) + 5 for b in bodies[start:end]) <= limit


# --- a segment's blob and its stored record ---------------------------------------------------


def test_a_blob_holds_its_payloads_as_they_were_encoded_and_one_can_be_taken_out():
    bodies = [encode_payload({"n": 1}), encode_payload("two"), encode_payload(b"\x00" * 3)]
    blob = make_blob(bodies)
    assert msgpack.unpackb(blob) == bodies  # one msgpack array of bins
    assert bodies_of(blob) == bodies
    assert bodies_of(single(blob, 1)) == [bodies[1]]
    for junk in (msgpack.packb([1]), msgpack.packb(b"x"), msgpack.packb(["str"])):
        with pytest.raises(ValueError):
            bodies_of(junk)


def test_the_messages_of_a_stored_segment_are_counted_without_reading_its_payloads():
    record = pack_outgoing(Kind.EVENT, "t", 1, ["a", "b", "c"], make_blob([b"1", b"2", b"3"]))
    assert count_of(record, 6) == 3
    incoming = pack(IncomingRecord(1, "t", "n", "a", 1, 1, None, None, None, ["a", "b"], make_blob([b"1", b"2"])))
    assert count_of(incoming, 9) == 2
    assert count_of(b"\xc1 damaged", 6) == 1  # a damaged one counts as one (check reports it)


# --- format 2 -> 3 ----------------------------------------------------------------------------

STREAM = "e:orders"
PAYLOAD = encode_payload({"order": 1})


def format_2_store(tmp_path, converted=()):
    """A store as format 2 left it: every message its own record, its payload in place of
    the segment's ids and blob; with the format-3 records of ``converted`` ids already."""
    store = Store.open(tmp_path / "store")
    b = store.batch()
    b.put_outgoing(STREAM, "o1", pack([1, "orders", 5, None, None, {"h": 1}, PAYLOAD]))
    b.put_outgoing("c:tcp://127.0.0.1:9", "o2", pack([2, "charge", 5, 99, "corr", None, PAYLOAD]))
    b.put_raw(b"n/i1", pack([1, "orders", "node", "tcp://127.0.0.1:9", 5, 2, None, None, None, PAYLOAD]))
    b.put_deadletter("x1", {"origin": "incoming", "reason": "handler_failed", "error": "E", "at": 1,
                            "record": [1, "orders", "node", "tcp://127.0.0.1:9", 5, 1, None, None, None, PAYLOAD]})
    b.put_deadletter("x2", {"origin": "outgoing", "reason": "expired", "error": None, "at": 1,
                            "peer": "tcp://127.0.0.1:9", "stream": STREAM,
                            "record": [1, "orders", 5, 9, None, None, PAYLOAD]})
    b.put_deadletter("x3", {"origin": "outgoing", "reason": "damaged", "error": "E", "at": 1, "raw": b"\xc1"})
    # Already format 3 (a segment of several): left as it is.
    b.put_outgoing(STREAM, "s1", pack_outgoing(Kind.EVENT, "orders", 5, ["s1", "s2"], make_blob([PAYLOAD] * 2)))
    b.put_incoming("s3", IncomingRecord(1, "orders", "node", "tcp://127.0.0.1:9", 5, 1, None, None, None,
                                        ["s3", "s4"], make_blob([PAYLOAD] * 2)))
    b.put_meta("format", b"2")
    store.write(b, sync=True)
    for mid in converted:  # a migration stopped half way: these were rewritten already
        upgrade_one(store, mid)
    store.close()


def upgrade_one(store, mid):
    b = store.batch()
    if mid == "o1":
        b.put_outgoing(STREAM, "o1", pack_outgoing(Kind.EVENT, "orders", 5, ["o1"], make_blob([PAYLOAD]),
                                                   None, None, {"h": 1}))
    store.write(b, sync=True)


def raw(store):
    return {key: value for key, value in store._iter(b"") if not key.startswith(b"m/")}


def test_a_format_2_store_is_opened_as_segments_of_one_keyed_by_their_own_ids(tmp_path):
    format_2_store(tmp_path)
    store = Store.open(tmp_path / "store")
    try:
        assert store.get_meta("format") == str(FORMAT_VERSION).encode() == b"3"
        blob = make_blob([PAYLOAD])
        out = unpack_outgoing(store.get_outgoing(STREAM, "o1"))
        assert out == (1, "orders", 5, None, None, {"h": 1}, ["o1"], blob)
        command = unpack_outgoing(store.get_outgoing("c:tcp://127.0.0.1:9", "o2"))
        assert command == (2, "charge", 5, 99, "corr", None, ["o2"], blob)
        assert store.get_incoming("i1") == IncomingRecord(1, "orders", "node", "tcp://127.0.0.1:9", 5, 2, None,
                                                          None, None, ["i1"], blob)
        letters = dict(store.deadletters())
        assert letters["x1"]["record"][9:] == [["x1"], blob] and letters["x1"]["reason"] == "handler_failed"
        assert letters["x2"]["record"][6:] == [["x2"], blob] and letters["x2"]["stream"] == STREAM
        assert letters["x3"] == {"origin": "outgoing", "reason": "damaged", "error": "E", "at": 1, "raw": b"\xc1"}
        assert unpack_outgoing(store.get_outgoing(STREAM, "s1")).ids == ["s1", "s2"]
        assert store.get_incoming("s3").ids == ["s3", "s4"]
        assert [mid for mid, _ in store.iter_stream(STREAM)] == ["o1", "s1"]  # keys unchanged
    finally:
        store.close()


def test_migrating_again_changes_nothing_and_a_half_done_migration_is_finished(tmp_path):
    format_2_store(tmp_path, converted=["o1"])
    store = Store.open(tmp_path / "store", upgrade_old=False, check_format=False)
    try:
        before = raw(store)
        # o1 is format 3 already: the others (o2, i1, x1, x2) are rewritten, nothing else.
        assert upgrade(store, 2, FORMAT_VERSION).total == 4
        after = raw(store)
        assert {k for k in before if before[k] != after[k]} == {
            b"o/c:tcp://127.0.0.1:9\x00o2", b"n/i1", b"x/x1", b"x/x2"}
        assert upgrade(store, 2, FORMAT_VERSION).total == 0  # idempotent
        assert raw(store) == after
    finally:
        store.close()


def test_a_format_2_store_is_not_upgraded_when_told_not_to(tmp_path):
    format_2_store(tmp_path)
    with pytest.raises(StoreError, match="servicebus migrate"):
        Store.open(tmp_path / "store", upgrade_old=False)
    store = Store.open(tmp_path / "store", check_format=False)
    try:
        assert store.get_meta("format") == b"2"  # untouched
    finally:
        store.close()
