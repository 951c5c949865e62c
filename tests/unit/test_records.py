from datetime import datetime, timezone

import pytest

from servicebus import Message


def test_message_converts_times_and_headers_when_read_and_cannot_be_changed():
    m = Message("id1", "user.signup", "node", "tcp://127.0.0.1:1", 1_700_000_000_123, 2,
                {"trace": "x"}, "command", "corr", 1_700_000_060_000)
    assert m.sent == datetime(2023, 11, 14, 22, 13, 20, 123000, tzinfo=timezone.utc)
    assert m.expires == datetime(2023, 11, 14, 22, 14, 20, tzinfo=timezone.utc)
    assert dict(m.headers) == {"trace": "x"}
    with pytest.raises(TypeError):
        m.headers["trace"] = "y"  # a read-only view
    with pytest.raises(AttributeError):
        m.attempt = 3


def test_message_without_ttl_or_headers():
    m = Message("id1", "t", "node", "tcp://127.0.0.1:1", 0, 1)
    assert m.expires is None and dict(m.headers) == {} and m.kind == "event"


def test_every_dead_letter_has_origin_reason_error_and_time_and_what_replay_needs():
    from servicebus.model.delivery import OutgoingRecord
    from servicebus.model.letters import damaged_letter, incoming_letter, outgoing_letter
    from servicebus.model.segments import make_blob
    from servicebus.model.stored import IncomingRecord

    # Each letter holds one message: a segment of one (what ``servicebus replay`` puts back).
    out = outgoing_letter("expired", None, OutgoingRecord(2, "charge", 1, 2, "c1", None, ["m1"],
                                                          make_blob([b"\x01"])),
                          "tcp://10.0.0.1:1", "c:tcp://10.0.0.1:1")
    inc = incoming_letter("handler_failed", "ValueError: x", 5,
                          IncomingRecord(1, "t", "n", "a", 1, 1, None, None, None, ["m2"], make_blob([b"\x01"])))
    bad = damaged_letter("outgoing", "undecodable record", b"\xc1", "tcp://10.0.0.1:1", "e:t")
    for letter in (out, inc, bad):
        assert {"origin", "reason", "error", "at"} <= set(letter) and letter["at"] > 0
    assert (out["kind"], out["topic"], out["record"][1], out["peer"]) == ("command", "charge", "charge", "tcp://10.0.0.1:1")
    assert (inc["kind"], inc["attempts"], inc["record"][1]) == ("event", 5, "t")
    assert (out["record"][6], inc["record"][9]) == (["m1"], ["m2"])  # the message it is
    assert bad["raw"] == b"\xc1" and "record" not in bad and bad["stream"] == "e:t"


def test_a_messages_repr_shows_what_it_says_not_the_bus_object_behind_it():
    m = Message("id1", "t", "node", "tcp://127.0.0.1:1", 0, 1, None, "event", None, None, object())
    assert repr(m).startswith("Message(id='id1', topic='t'") and "transactions" not in repr(m)
