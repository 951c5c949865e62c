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
