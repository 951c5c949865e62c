"""Prometheus metrics for a bus (extra ``metrics``: ``pip install 'servicebus[metrics]'``).

``register(bus, registry)`` adds the bus to a registry the application already has;
``Bus(metrics_port=PORT)`` serves one of its own at ``http://metrics_bind:PORT/metrics``.

What is exported (every series labelled with ``bus``, the bus's address):
- every engine counter as ``servicebus_<name>_total`` (published, sent, received, acked,
  resent, duplicates, expired, fsyncs, group_reassigned, backlog_refused, ...);
- gauges from ``status()``: ``servicebus_pending{subscriber}``, ``servicebus_incoming``,
  ``servicebus_outgoing``, ``servicebus_deadletters``, ``servicebus_peer_up{peer}``,
  ``servicebus_in_flight{peer}``, ``servicebus_malformed_total{reason}``,
  ``servicebus_backlog_full``;
- ``servicebus_oldest_pending_seconds{subscriber}``: the age of the oldest message each
  subscriber is owed (from the stored cursors);
- ``servicebus_handler_seconds{topic}``: a histogram of handler run times (successful or
  not), observed by the worker threads;
- ``servicebus_group_commit_size``: a histogram of how many publishes (or handler
  transactions with events) shared each fsync.

The gauges are read at scrape time through ``status()``, which counts the store's
keyspaces: on a store holding millions of messages a scrape takes that long.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from typing import Any, Protocol

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Histogram, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
except ImportError as exc:  # the extra is not installed
    raise ImportError("servicebus metrics need prometheus_client: pip install 'servicebus[metrics]'") from exc

from ..model.clock import wall_ms
from ..model.records import Message
from ..store.cursors import oldest_pending
from .base import BusView, Hook, Hooks


__all__ = ["register", "serve", "BusCollector", "Metrics"]

_NAME = re.compile(r"[^a-zA-Z0-9_]")


class BusCollector:
    """Reads the bus's counters and status at each scrape."""

    def __init__(self, bus: BusView) -> None:
        self.bus = bus

    def collect(self) -> Iterator[Metric]:
        bus = self.bus
        if bus.closed:
            return
        me = bus.address
        status, counters = bus.status(), bus.counters()
        for name, value in sorted(counters.items()):
            yield _family(CounterMetricFamily, f"servicebus_{_NAME.sub('_', name)}",
                          f"servicebus engine counter {name}", ["bus"], [([me], value)])
        for name, value, doc in (("incoming", status.incoming, "received, not handled yet"),
                                 ("outgoing", status.outgoing, "stored for delivery"),
                                 ("deadletters", status.deadletters, "dead letters"),
                                 ("backlog_full", len(status.backlog_full),
                                  "(subscriber, topic) pairs at max_backlog")):
            yield _family(GaugeMetricFamily, f"servicebus_{name}", f"messages {doc}", ["bus"],
                          [([me], value)])
        yield _family(GaugeMetricFamily, "servicebus_pending", "deliveries owed, per subscriber",
                      ["bus", "subscriber"],
                      [([me, sub], n) for sub, n in sorted(status.pending_by_subscriber.items())])
        yield _family(GaugeMetricFamily, "servicebus_peer_up", "1 if the peer answers", ["bus", "peer"],
                      [([me, p.address], 1 if p.up else 0) for p in status.peers])
        yield _family(GaugeMetricFamily, "servicebus_in_flight", "messages sent to the peer, not acknowledged",
                      ["bus", "peer"], [([me, p.address], p.in_flight) for p in status.peers])
        now = wall_ms()
        yield _family(GaugeMetricFamily, "servicebus_oldest_pending_seconds",
                      "age of the oldest message owed, per subscriber", ["bus", "subscriber"],
                      [([me, sub], max(0.0, (now - ms) / 1000))
                       for sub, ms in sorted(oldest_pending(bus.store).items())])
        yield _family(CounterMetricFamily, "servicebus_malformed", "frames dropped as malformed",
                      ["bus", "reason"],
                      [([me, reason], n) for reason, n in sorted(status.malformed_by_reason.items())])


def _family(kind: Any, name: str, doc: str, labels: list[str],
            rows: list[tuple[list[str], float]]) -> Metric:
    family = kind(name, doc, labels=labels)
    for values, value in rows:
        family.add_metric(values, value)
    return family


class Metrics(Hook):
    """The bus's series in ``registry``: the collector above, read at each scrape, and two
    histograms fed as things happen (handler run times, callers per group commit)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.seconds = Histogram("servicebus_handler_seconds", "handler run time", ["bus", "topic"],
                                 registry=registry)
        self.groups = Histogram("servicebus_group_commit_size", "callers sharing one fsync", ["bus"],
                                buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=registry)
        self._address = "?"
        self._collector: BusCollector | None = None

    def attach(self, bus: BusView) -> None:
        self._address = bus.address
        self._collector = BusCollector(bus)
        self.registry.register(self._collector)

    def detach(self) -> None:
        if self._collector is not None:
            self.registry.unregister(self._collector)
            self._collector = None

    def after_handle(self, message: Message, error: BaseException | None, seconds: float) -> None:
        self.seconds.labels(self._address, message.topic).observe(seconds)

    def committed(self, callers: int) -> None:
        self.groups.labels(self._address).observe(callers)


class _Hooked(Protocol):
    """A bus, as far as metrics need: its hooks (hooks/base.py)."""

    hooks: Hooks


def register(bus: _Hooked, registry: CollectorRegistry | None = None) -> Histogram:
    """Export ``bus`` in ``registry`` (prometheus_client's default one if None); returns
    the handler-time histogram."""
    hook = Metrics(REGISTRY if registry is None else registry)
    bus.hooks.add(hook)
    return hook.seconds


def serve(bus: _Hooked, port: int, host: str = "127.0.0.1") -> tuple[Any, threading.Thread]:
    """Serve ``bus``'s metrics (a registry of its own) at ``http://host:port/metrics``;
    returns the server and its thread (``server.shutdown()`` stops it)."""
    registry = CollectorRegistry()
    register(bus, registry)
    server, thread = start_http_server(port, addr=host, registry=registry)
    return server, thread
