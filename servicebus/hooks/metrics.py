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
- per handler, labelled ``topic`` (the topic or pattern it was registered on) and
  ``handler`` (its name): counters ``servicebus_handler_handled_total``, ``_failed_total``
  (it raised, or asked to ``Retry``), ``_rejected_total`` (``Reject``), ``_retried_total``
  (retries scheduled after it failed) and ``servicebus_handler_deadlettered_total{reason}``
  (handler_failed, rejected, handler_crashed, expired, undecodable, invalid: hooks/base.py's
  ``handler_outcome`` says which handler a dead letter is put down to), and
  ``servicebus_handler_run_seconds{outcome}``, its run times by how the run ended (handled,
  failed, rejected). Every one of these exists at zero from the first scrape after its
  handler is registered;
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
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
except ImportError as exc:  # the extra is not installed
    raise ImportError("servicebus metrics need prometheus_client: pip install 'servicebus[metrics]'") from exc

from ..model.clock import wall_ms
from ..model.records import Message
from ..store.cursors import oldest_pending
from .base import DEADLETTER_REASONS, RUN_OUTCOMES, BusView, HandlerOutcome, Hook, Hooks


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


class HandlerSeries:
    """What each handler's runs came to: counters and run times per (topic, handler), fed
    by ``Metrics.handler_outcome``. At each scrape, every handler registered by then gets
    each of its series at zero first: a series that appears only at its first increment
    is invisible to ``rate()`` and ``increase()``, so an alert on it never fires for the
    first failure.

    The labels are the handler's name and the topic or *pattern* it was registered on,
    never the message's own topic: a handler on ``orders.*`` may see any number of concrete
    topics (an id in each, say), and every label value is a series kept for the life of the
    process. Registrations are few and fixed by the code, so the series are bounded by
    them, times the fixed outcomes and dead-letter reasons (hooks/base.py)."""

    def __init__(self) -> None:
        labels = ["bus", "topic", "handler"]
        self.counters = {what: Counter(f"servicebus_handler_{what}", doc, labels, registry=None)
                         for what, doc in (("handled", "handler runs that returned"),
                                           ("failed", "handler runs that raised (or asked to Retry)"),
                                           ("rejected", "handler runs that raised Reject"),
                                           ("retried", "retries scheduled after the handler failed"))}
        self.deadlettered = Counter("servicebus_handler_deadlettered", "messages the handler's "
                                    "failures made dead letters, by reason", [*labels, "reason"],
                                    registry=None)
        self.runs = Histogram("servicebus_handler_run_seconds", "handler run time, by how the run "
                              "ended", [*labels, "outcome"], registry=None)
        self.bus: BusView | None = None
        self._zeroed: set[tuple[str, str]] = set()

    def count(self, o: HandlerOutcome, address: str) -> None:
        if o.outcome == "deadlettered":
            self.deadlettered.labels(address, o.topic, o.handler, o.reason or "?").inc()
            return
        counter = self.counters.get(o.outcome)
        if counter is not None:
            counter.labels(address, o.topic, o.handler).inc()
        if o.seconds is not None:
            self.runs.labels(address, o.topic, o.handler, o.outcome).observe(o.seconds)

    def collect(self) -> Iterator[Metric]:
        bus = self.bus
        if bus is None or bus.closed:
            return
        for topic, handler in bus.handlers():
            if (topic, handler) not in self._zeroed:  # labels() makes a child at zero
                for counter in self.counters.values():
                    counter.labels(bus.address, topic, handler)
                for reason in DEADLETTER_REASONS:
                    self.deadlettered.labels(bus.address, topic, handler, reason)
                for outcome in RUN_OUTCOMES:
                    self.runs.labels(bus.address, topic, handler, outcome)
                self._zeroed.add((topic, handler))
        for metric in (*self.counters.values(), self.deadlettered, self.runs):
            yield from metric.collect()


class Metrics(Hook):
    """The bus's series in ``registry``: the collector above, read at each scrape, two
    histograms fed as things happen (handler run times, callers per group commit) and the
    handlers' outcomes (``HandlerSeries``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.seconds = Histogram("servicebus_handler_seconds", "handler run time", ["bus", "topic"],
                                 registry=registry)
        self.groups = Histogram("servicebus_group_commit_size", "callers sharing one fsync", ["bus"],
                                buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=registry)
        self.handlers = HandlerSeries()
        self._address = "?"
        self._collector: BusCollector | None = None

    def attach(self, bus: BusView) -> None:
        self._address = bus.address
        self._collector = BusCollector(bus)
        self.registry.register(self._collector)
        self.handlers.bus = bus
        self.registry.register(self.handlers)

    def detach(self) -> None:
        if self._collector is not None:
            self.registry.unregister(self._collector)
            self.registry.unregister(self.handlers)
            self._collector = None

    def after_handle(self, message: Message, error: BaseException | None, seconds: float) -> None:
        self.seconds.labels(self._address, message.topic).observe(seconds)

    def handler_outcome(self, outcome: HandlerOutcome) -> None:
        self.handlers.count(outcome, self._address)

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
