import pytest

from servicebus.model.delivery import Consumer, backoff, envelope_from_record, pack_outgoing, unpack_outgoing
from servicebus.model.segments import bodies_of, make_blob
from servicebus.wire.protocol import Kind


def test_in_order_acks_move_the_floor():
    c = Consumer("p", "e:t", "0000")
    for i in ("0001", "0002", "0003"):
        c.admit(i, now=0.0, ack_timeout=5)
    assert c.ack("0001") and c.floor == "0001"
    assert c.ack("0002") and c.floor == "0002"
    assert not c.ack("0002")  # a repeated ack changes nothing
    assert c.room(10) == 9


def test_out_of_order_acks_are_kept_above_the_floor_and_survive_a_restart():
    c = Consumer("p", "e:t", "0000")
    for i in ("0001", "0002", "0003", "0004"):
        c.admit(i, now=0.0, ack_timeout=5)
    c.ack("0002")
    c.ack("0004")
    c.inflight["0003"].attempt = 3
    assert c.floor == "0000"
    rec = c.record()
    assert rec["floor"] == "0000" and rec["acked"] == ["0002", "0004"] and rec["attempts"] == {"0003": 3}

    again = Consumer.from_record("p", "e:t", rec)
    sent = [i for i in ("0001", "0002", "0003", "0004") if again.admit(i, 0.0, 5) is not None]
    assert sent == ["0001", "0003"]  # never resends what was acked
    assert again.inflight["0003"].attempt == 4
    again.ack("0001")
    again.ack("0003")
    assert again.floor == "0004" and again.idle is False  # not exhausted until scanned
    again.exhausted = True
    assert again.idle


def test_backoff_doubles_and_caps_with_jitter():
    assert 0.08 <= backoff(1, 0.1, 30) <= 0.12
    assert 0.32 <= backoff(3, 0.1, 30) <= 0.48
    assert 24 <= backoff(50, 0.1, 30) <= 36


def test_outgoing_record_round_trips():
    # A stored segment: its messages' ids (the first is its key) and their payloads' blob.
    blob = make_blob([b"\x01", b"\x02"])
    rec = unpack_outgoing(pack_outgoing(Kind.EVENT, "t", 5, ["m1", "m2"], blob, 9, "c", {"h": 1}))
    assert rec == (int(Kind.EVENT), "t", 5, 9, "c", {"h": 1}, ["m1", "m2"], blob)
    assert bodies_of(rec.blob) == [b"\x01", b"\x02"]
    env = envelope_from_record("m1", rec, 2)  # as it goes on the wire: the blob as stored
    assert (env.id, env.ids, env.body, env.attempt) == ("m1", ("m1", "m2"), blob, 2)


@pytest.mark.parametrize("fields", [
    [1, "t", 5, None, None, None, [], make_blob([])],  # a segment of no message
    [1, "t", 5, None, None, None, ["m1"], [b"\x01"]],  # its payloads not a blob
    [1, "t", 5, None, None, None, b"\x01"],  # format 2's layout
])
def test_an_outgoing_record_that_is_not_a_segment_is_refused(fields):
    from servicebus.model.packer import pack
    with pytest.raises(ValueError):
        unpack_outgoing(pack(fields))


def test_a_window_counts_the_messages_of_the_segments_it_holds_by_key():
    c = Consumer("p", "e:t", "0000")
    c.admit("0001", now=0.0, ack_timeout=5, count=3)  # one publish of three
    c.admit("0004", now=0.0, ack_timeout=5, count=1)
    assert c.room(10) == 6 and set(c.inflight) == {"0001", "0004"}
    c.backlog = 4
    assert c.ack("0004") and c.floor == "0000" and c.room(10) == 6  # behind the first: kept
    assert c.ack("0001") and c.floor == "0004" and c.room(10) == 10
    assert c.backlog == 0  # an ack takes away the messages of its segment


def test_a_segment_settled_before_it_is_read_is_skipped_and_counted_by_its_messages():
    c = Consumer("p", "e:t", "0000")
    c.backlog = 5
    c.settle("0003", 5)  # expired while its receiver was down, not read into the window yet
    assert c.backlog == 0 and c.skip == {"0003"}
    assert c.admit("0003", now=0.0, ack_timeout=5, count=5) is None  # not sent when read
    assert c.floor == "0003" and c.room(10) == 10
