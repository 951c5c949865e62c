"""Prometheus metrics (issue 16): ``Bus(metrics_port=)`` serves them, ``metrics.register``
adds a bus to an application's own registry."""

from __future__ import annotations

import urllib.request

import pytest

from servicebus import Bus
from servicebus.model.clock import wall_ms
from servicebus.model.ids import id_millis
from servicebus.testing import free_address, free_port, wait_until

from ..conftest import subscriber_gone

prometheus_client = pytest.importorskip(
    "prometheus_client", reason="prometheus_client is not installed (pip install 'servicebus[metrics]')")

TOPIC = "orders.created"


def sample(text: str, name: str, **labels: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def delivered(pub, sub, count: int) -> None:
    """``count`` events published by ``pub``, handled by ``sub`` and acknowledged."""
    handled = []
    sub.every(TOPIC, lambda p, m: handled.append(p))
    sub.subscribe(pub.address, TOPIC, wait=10)
    pub.publish_many(TOPIC, list(range(count)))
    wait_until(lambda: len(handled) == count, 10)
    assert pub.drain(10) and sub.drain(10)


def test_a_bus_serves_its_counters_gauges_and_handler_times_on_its_metrics_port(make_bus):
    port = free_port()
    pub = make_bus("pub", metrics_port=port)
    sub = make_bus("sub")
    delivered(pub, sub, 25)
    assert pub.metrics_address == f"http://127.0.0.1:{port}/metrics"
    text = urllib.request.urlopen(pub.metrics_address, timeout=10).read().decode()
    assert sample(text, "servicebus_published_total", bus=pub.address) == 25
    assert sample(text, "servicebus_acked_total", bus=pub.address) == 25
    assert sample(text, "servicebus_peer_up", bus=pub.address, peer=sub.address) == 1
    assert sample(text, "servicebus_pending", bus=pub.address, subscriber=sub.address) == 0
    assert sample(text, "servicebus_group_commit_size_count", bus=pub.address) == 1  # one publish_many
    assert sample(text, "servicebus_group_commit_size_sum", bus=pub.address) == 1


def test_the_age_of_the_oldest_message_owed_is_exported_per_subscriber(make_bus):
    pub = make_bus("pub", metrics_port=free_port())
    gone, _ = subscriber_gone(make_bus, pub, TOPIC, known_down=True)
    first = pub.publish(TOPIC, {"n": 1})
    pub.publish(TOPIC, {"n": 2})

    def age() -> float | None:
        text = urllib.request.urlopen(pub.metrics_address, timeout=10).read().decode()
        return sample(text, "servicebus_oldest_pending_seconds", bus=pub.address, subscriber=gone)

    wait_until(lambda: (age() or 0) >= 1.0, 10, message="an age of a second")  # it grows
    assert abs(age() - (wall_ms() - id_millis(first)) / 1000) < 1.0  # the oldest one's


def test_register_adds_a_bus_to_the_applications_registry_with_handler_times(make_bus):
    from prometheus_client import CollectorRegistry, generate_latest

    from servicebus import metrics  # the public name (README)

    registry = CollectorRegistry()
    pub, sub = make_bus("pub"), make_bus("sub")
    metrics.register(sub, registry)
    delivered(pub, sub, 10)
    text = generate_latest(registry).decode()
    assert sample(text, "servicebus_handler_seconds_count", bus=sub.address, topic=TOPIC) == 10
    assert sample(text, "servicebus_received_total", bus=sub.address) == 10
    assert sample(text, "servicebus_incoming", bus=sub.address) == 0


def test_a_closed_bus_exports_nothing_and_its_port_is_freed(tmp_path):
    port = free_port()
    bus = Bus(free_address(), tmp_path / "b", metrics_port=port)
    urllib.request.urlopen(bus.metrics_address, timeout=10).read()
    bus.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()


def test_a_bad_metrics_port_is_refused(tmp_path):
    with pytest.raises(ValueError, match="metrics_port"):
        Bus(free_address(), tmp_path / "b", metrics_port=70000)


# --- handler outcomes (issue 29): counters per registered topic and handler ----------------

OUTCOMES = ("handled", "failed", "rejected", "retried")
REASONS = ("handler_failed", "rejected", "handler_crashed", "expired", "undecodable")


def scrape(bus: Bus) -> str:
    return urllib.request.urlopen(bus.metrics_address, timeout=10).read().decode()


def outcomes(text: str, bus: Bus, topic: str, handler: str) -> dict[str, float | None]:
    """One handler's counters, its dead letters per reason and its runs' count per outcome,
    as scraped (None: no such series)."""
    labels = {"bus": bus.address, "topic": topic, "handler": handler}
    found: dict[str, float | None] = {
        what: sample(text, f"servicebus_handler_{what}_total", **labels) for what in OUTCOMES}
    for reason in REASONS:
        found[f"deadlettered/{reason}"] = sample(text, "servicebus_handler_deadlettered_total",
                                                 reason=reason, **labels)
    for outcome in ("handled", "failed", "rejected"):
        found[f"runs/{outcome}"] = sample(text, "servicebus_handler_run_seconds_count",
                                          outcome=outcome, **labels)
    return found


def expected(**nonzero: float) -> dict[str, float]:
    zero = {**{what: 0.0 for what in OUTCOMES}, **{f"deadlettered/{r}": 0.0 for r in REASONS},
            **{f"runs/{o}": 0.0 for o in ("handled", "failed", "rejected")}}
    return {**zero, **{key.replace("__", "/"): float(n) for key, n in nonzero.items()}}


def test_every_registered_handler_has_its_outcome_counters_at_zero_before_any_message(make_bus):
    bus = make_bus("sub", metrics_port=free_port())
    bus.every("orders.created", lambda p, m: None, name="billing")
    bus.every("orders.created", lambda p, m: None, name="stock")
    bus.every("invoices.*", lambda p, m: None, name="archive")
    bus.handle("email.send", lambda p, m: None, name="mailer")
    text = scrape(bus)
    for topic, handler in (("orders.created", "billing"), ("orders.created", "stock"),
                           ("invoices.*", "archive"), ("email.send", "mailer")):
        assert outcomes(text, bus, topic, handler) == expected(), (topic, handler)


def test_a_handler_registered_after_the_first_scrape_has_its_series_at_zero_on_the_next(make_bus):
    bus = make_bus("sub", metrics_port=free_port())
    assert sample(scrape(bus), "servicebus_handler_handled_total", bus=bus.address) is None
    bus.every(TOPIC, lambda p, m: None, name="late")
    assert outcomes(scrape(bus), bus, TOPIC, "late") == expected()


def test_handler_outcomes_are_counted_per_registered_topic_and_handler_with_dead_letter_reasons(make_bus):
    pub = make_bus("pub")
    sub = make_bus("sub", metrics_port=free_port(), max_attempts=2, retry_initial=0.01, retry_max=0.02)
    from servicebus import Reject

    def flaky(payload, message):  # fails its first attempt, then succeeds
        if message.attempt == 1:
            raise RuntimeError("not yet")

    def picky(payload, message):
        raise Reject("not for us")

    def broken(payload, message):
        raise RuntimeError("always")

    sub.every("jobs.flaky", flaky, name="flaky")
    sub.every("jobs.picky", picky, name="picky")
    sub.every("jobs.broken.*", broken, name="broken")  # on a pattern: counted under it
    for topic in ("jobs.flaky", "jobs.picky", "jobs.broken.7"):
        sub.subscribe(pub.address, topic, wait=10)
        pub.publish(topic, {"n": 1})

    def done() -> bool:
        text = scrape(sub)
        return (sample(text, "servicebus_handler_handled_total", topic="jobs.flaky") == 1
                and sample(text, "servicebus_handler_deadlettered_total", topic="jobs.broken.*",
                           reason="handler_failed") == 1
                and sample(text, "servicebus_handler_deadlettered_total", topic="jobs.picky",
                           reason="rejected") == 1)

    wait_until(done, 10, message=lambda: scrape(sub))
    assert sub.drain(10) and len(sub.deadletters()) == 2
    text = scrape(sub)
    assert outcomes(text, sub, "jobs.flaky", "flaky") == expected(
        handled=1, failed=1, retried=1, runs__handled=1, runs__failed=1)
    assert outcomes(text, sub, "jobs.picky", "picky") == expected(
        rejected=1, deadlettered__rejected=1, runs__rejected=1)
    assert outcomes(text, sub, "jobs.broken.*", "broken") == expected(
        failed=2, retried=1, deadlettered__handler_failed=1, runs__failed=2)
    # The concrete topic of a pattern's message makes no series of its own.
    assert sample(text, "servicebus_handler_failed_total", topic="jobs.broken.7") is None


@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
def test_outcomes_inside_a_segment_of_several_messages_are_counted_like_those_of_single_ones(make_bus, ordered):
    from servicebus import Reject

    pub = make_bus("pub")
    sub = make_bus("sub", metrics_port=free_port(), max_attempts=2, retry_initial=0.01, retry_max=0.02)

    def handler(payload, message):
        n = payload["n"]
        if n in (0, 2) and message.attempt == 1:  # the first one (split off first), one inside
            raise RuntimeError("not yet")
        if n == 3:
            raise Reject("not for us")
        if n == 5:
            raise RuntimeError("always")

    sub.every(TOPIC, handler, name="worker")
    sub.subscribe(pub.address, TOPIC, wait=10, ordered=ordered)
    pub.publish_many(TOPIC, [{"n": n} for n in range(6)])  # one segment

    def done() -> bool:
        text = scrape(sub)
        return (sample(text, "servicebus_handler_handled_total", topic=TOPIC) == 4
                and sample(text, "servicebus_handler_deadlettered_total", topic=TOPIC,
                           reason="handler_failed") == 1)

    wait_until(done, 10, message=lambda: scrape(sub))
    assert sub.drain(10) and len(sub.deadletters()) == 2
    assert outcomes(scrape(sub), sub, TOPIC, "worker") == expected(
        handled=4, failed=4, rejected=1, retried=3, deadlettered__rejected=1,
        deadlettered__handler_failed=1, runs__handled=4, runs__failed=4, runs__rejected=1)


def test_a_message_two_handlers_share_is_retried_and_dead_lettered_under_the_one_that_failed(make_bus):
    pub = make_bus("pub")
    sub = make_bus("sub", metrics_port=free_port(), max_attempts=2, retry_initial=0.01, retry_max=0.02)
    sub.every(TOPIC, lambda p, m: None, name="billing")
    sub.every(TOPIC, lambda p, m: 1 / 0, name="stock")
    sub.subscribe(pub.address, TOPIC, wait=10)
    pub.publish(TOPIC, {"n": 1})
    wait_until(lambda: sample(scrape(sub), "servicebus_handler_deadlettered_total",
                              handler="stock", reason="handler_failed") == 1, 10, message=lambda: scrape(sub))
    text = scrape(sub)
    # billing finished on the first attempt and is not run again.
    assert outcomes(text, sub, TOPIC, "billing") == expected(handled=1, runs__handled=1)
    assert outcomes(text, sub, TOPIC, "stock") == expected(
        failed=2, retried=1, deadlettered__handler_failed=1, runs__failed=2)
