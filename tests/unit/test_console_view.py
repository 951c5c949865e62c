"""What the console's page is given of a bus, without a server: bounded however many
subscribers and dead letters the bus has."""

from pathlib import Path

import pytest

pytest.importorskip("aiohttp", reason="the console needs aiohttp")

from servicebus.console.app import SHOWN_SUBSCRIBERS, _bus, _shown  # noqa: E402
from servicebus.console.sources import Sample, Source, cause_of  # noqa: E402


def test_a_bus_with_thousands_of_subscribers_shows_those_most_behind_and_says_how_many():
    src = Source(0, Path("/nonexistent"), 2.0)
    subs = [{"address": f"tcp://10.0.0.{n % 250}:{5000 + n}", "pending": n % 97, "topics": ["t"]} for n in range(3000)]
    src.latest = Sample(0.0, True, subscribers=subs)
    shown = _shown(src)
    assert len(shown) == SHOWN_SUBSCRIBERS
    assert [s["pending"] for s in shown] == sorted((s["pending"] for s in subs), reverse=True)[:SHOWN_SUBSCRIBERS]
    page = _bus(src, {shown[0]["address"]: "billing"})
    assert page["subscribers_total"] == 3000 and len(page["subscribers"]) == SHOWN_SUBSCRIBERS
    assert page["subscribers"][0]["service"] == "billing"


def test_a_dead_letters_cause_is_its_exception_type_or_else_its_reason():
    assert cause_of({"error": "ValueError: order 3 has no customer", "reason": "handler_failed"}) == "ValueError"
    assert cause_of({"error": "app.errors.Rejected: no", "reason": "handler_failed"}) == "app.errors.Rejected"
    assert cause_of({"error": "the TTL passed: 3 s", "reason": "expired"}) == "expired"
    assert cause_of({"error": None, "reason": None}) == "unknown"
