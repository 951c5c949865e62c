"""Retention rules and start positions (model/retention.py), without a bus."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import pytest

from servicebus.model.retention import Retention, check_retention, start_floor, start_token


def test_a_number_retains_every_topic_and_a_dict_picks_the_most_specific_rule():
    assert Retention(check_retention(60)).ms("any.topic") == 60_000
    rules = Retention(check_retention({"orders.>": 3600, "orders.eu.*": 60, "orders.eu.secret": None}))
    assert rules.ms("orders.placed") == 3_600_000
    assert rules.ms("orders.eu.placed") == 60_000  # the longer pattern
    assert rules.ms("orders.eu.secret") == 0  # an exact None beats the patterns
    assert rules.ms("audit.x") == 0


def test_only_a_retained_topics_own_event_streams_are_kept():
    rules = Retention(check_retention({"orders.>": 10}))
    assert rules.stream_ms("e:orders.placed") == 10_000
    assert rules.stream_ms("e:orders.placed 5") == 10_000  # a priority level of it
    assert rules.stream_ms("e:orders.*") == 0  # a pattern subscription's stream
    assert rules.stream_ms("c:tcp://127.0.0.1:1") == 0


@pytest.mark.parametrize("bad", [0, -1, float("inf"), True, "60", {"orders.>": -5}, {"a b": 1}, {1: 5}])
def test_a_bad_retention_is_refused(bad):
    with pytest.raises((TypeError, ValueError)):
        check_retention(bad)


def test_start_positions_become_floors_that_include_what_they_name():
    assert start_token(None) is None and start_token("new") is None
    assert start_floor(start_token("earliest")) == ""
    at = datetime(2026, 11, 25, 12, 0, tzinfo=timezone.utc)
    token = start_token(at)
    assert token == f"t:{int(at.timestamp() * 1000)}"
    same_ms = f"{int(at.timestamp() * 1000):012x}" + "0" * 12
    assert start_floor(token) < same_ms  # an id of that very millisecond is included
    assert start_floor(start_token(at.timestamp())) == start_floor(token)
    mid = "0198a2b3c4d5000001abcdef"
    assert start_floor(mid) < mid and start_floor(mid) == "0198a2b3c4d5000001abcdee"
    assert start_floor("0" * 24) == ""


@pytest.mark.parametrize("bad", ["latest", "0198A2B3C4D5000001ABCDEF", "t:1", datetime.now(),
                                 -1, timedelta(1), ["earliest"], time.time() * 1000])
def test_a_bad_start_is_refused(bad):
    with pytest.raises((TypeError, ValueError)):
        start_token(bad)
