"""Events with a TTL and headers (issue 15), as commands have had: an expired event is a
dead letter ``expired`` at whichever side holds it."""

from __future__ import annotations

import pytest

from servicebus.testing import wait_until
from ..conftest import subscriber_gone

TOPIC = "user.signup"


def test_an_event_carries_its_headers_and_expiry_to_the_handler(make_bus):
    pub, sub = make_bus("pub"), make_bus("sub")
    seen = []
    sub.every(TOPIC, lambda p, m: seen.append((p, dict(m.headers or {}), m.expires)))
    sub.subscribe(pub.address, TOPIC, wait=10)
    pub.publish(TOPIC, 1, ttl=60, headers={"traceparent": "00-abc-def-01"})
    pub.publish(TOPIC, 2)
    wait_until(lambda: len(seen) == 2, 10)
    first, second = sorted(seen, key=lambda s: s[0])
    assert first[1] == {"traceparent": "00-abc-def-01"} and first[2] is not None
    assert second[1] == {} and second[2] is None


def test_an_event_whose_ttl_passes_while_its_subscriber_is_down_is_a_dead_letter_at_the_publisher(
        make_bus, tmp_path):
    pub = make_bus("pub", peer_timeout=1.5, heartbeat=0.5)
    address, datadir = subscriber_gone(make_bus, pub, TOPIC, known_down=True)
    mid = pub.publish(TOPIC, "stale soon", ttl=0.3)
    kept = pub.publish(TOPIC, "no ttl")
    wait_until(lambda: [d.id for d in pub.deadletters()] == [mid], 10)  # while it is still down
    letter = pub.deadletters()[0]
    assert (letter.reason, letter.origin, letter.peer) == ("expired", "outgoing", address)
    back = make_bus("sub-again", address=address, datadir=datadir)
    got = []
    back.every(TOPIC, lambda p, m: got.append(m.id))
    wait_until(lambda: got == [kept] and pub.drain(0.1), 15)


def test_an_event_whose_ttl_passes_while_its_handler_keeps_failing_is_a_dead_letter_at_the_subscriber(
        make_bus):
    pub = make_bus("pub")
    sub = make_bus("sub", retry_initial=0.2, retry_max=0.2, max_attempts=100)
    runs = []

    @sub.every(TOPIC)
    def failing(payload, message):
        runs.append(message.attempt)
        raise RuntimeError("downstream unavailable")

    sub.subscribe(pub.address, TOPIC, wait=10)
    mid = pub.publish(TOPIC, 1, ttl=1.0)
    wait_until(lambda: sub.status().deadletters == 1, 10)
    letter = sub.deadletters()[0]
    assert (letter.id, letter.reason, letter.origin) == (mid, "expired", "incoming")
    assert 1 <= len(runs) < 10


@pytest.mark.parametrize("ttl, headers, error", [(0, None, ValueError), (-1, None, ValueError),
                                                 (True, None, ValueError), (None, {1: "x"}, TypeError),
                                                 (None, {"x": object()}, TypeError)])
def test_a_bad_ttl_or_headers_on_publish_is_refused_before_anything_is_stored(make_bus, ttl, headers, error):
    bus = make_bus("a")
    with pytest.raises(error):
        bus.publish(TOPIC, 1, ttl=ttl, headers=headers)
