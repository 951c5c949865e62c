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
