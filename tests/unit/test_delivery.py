from servicebus.model.delivery import Consumer, backoff, pack_outgoing, unpack_outgoing
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
    rec = unpack_outgoing(pack_outgoing(Kind.EVENT, "t", 5, b"\x01", 9, "c", {"h": 1}))
    assert rec == (int(Kind.EVENT), "t", 5, 9, "c", {"h": 1}, b"\x01")
