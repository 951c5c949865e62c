"""Tracing (issue 16): W3C trace context in message headers; with ``tracing=True`` and
OpenTelemetry, PRODUCER and CONSUMER spans of one trace across two buses."""

from __future__ import annotations

import pytest

from servicebus.testing import wait_until

TOPIC = "user.signup"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_requests_headers_reach_its_handler_without_opentelemetry(make_bus):
    server, client = make_bus("server"), make_bus("client")
    server.handle("pricing.quote", lambda p, m: dict(m.headers))
    headers = client.request(server.address, "pricing.quote", {}, timeout=10,
                             headers={"traceparent": TRACEPARENT})
    assert headers == {"traceparent": TRACEPARENT}


@pytest.fixture(scope="module")
def spans():
    pytest.importorskip("opentelemetry.sdk", reason="OpenTelemetry SDK not installed (pip install -e '.[dev]')")
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)  # once per process: only this module sets it
    return exporter


def test_a_trace_goes_from_the_publisher_to_the_handler_in_another_bus(make_bus, spans):
    from opentelemetry import trace

    pub, sub = make_bus("pub", tracing=True), make_bus("sub", tracing=True)
    seen = []
    sub.every(TOPIC, lambda p, m: seen.append((trace.get_current_span().get_span_context().trace_id,
                                              m.headers.get("traceparent"))))
    sub.subscribe(pub.address, TOPIC, wait=10)
    with trace.get_tracer("test").start_as_current_span("signup request") as root:
        pub.publish(TOPIC, {"id": 1})
    wait_until(lambda: seen, 10)
    trace_id, traceparent = seen[0]
    assert trace_id == root.get_span_context().trace_id
    assert traceparent.split("-")[1] == f"{trace_id:032x}"
    by_name = {s.name: s for s in spans.get_finished_spans()}
    producer, consumer = by_name[f"publish {TOPIC}"], by_name[f"process {TOPIC}"]
    assert producer.kind == trace.SpanKind.PRODUCER and consumer.kind == trace.SpanKind.CONSUMER
    assert consumer.parent.span_id == producer.context.span_id
    assert producer.parent.span_id == root.get_span_context().span_id


def test_a_send_and_its_handler_are_traced_too(make_bus, spans):
    from opentelemetry import trace

    sender, receiver = make_bus("sender", tracing=True), make_bus("receiver", tracing=True)
    seen = []
    receiver.handle("email.send", lambda p, m: seen.append(trace.get_current_span().get_span_context().trace_id))
    with trace.get_tracer("test").start_as_current_span("job") as root:
        sender.send(receiver.address, "email.send", {"to": "a@example.com"})
    wait_until(lambda: seen, 10)
    assert seen == [root.get_span_context().trace_id]


def test_what_a_handler_publishes_in_its_transaction_continues_its_trace(make_bus, spans):
    from opentelemetry import trace

    pub, mid, end = (make_bus(n, tracing=True) for n in ("pub", "mid", "end"))
    seen = []
    mid.every(TOPIC, lambda p, m: m.publish("user.welcomed", p))
    end.every("user.welcomed", lambda p, m: seen.append(trace.get_current_span().get_span_context().trace_id))
    mid.subscribe(pub.address, TOPIC, wait=10)
    end.subscribe(mid.address, "user.welcomed", wait=10)
    with trace.get_tracer("test").start_as_current_span("signup") as root:
        pub.publish(TOPIC, {"id": 1})
    wait_until(lambda: seen, 10)
    assert seen == [root.get_span_context().trace_id]


# --- attempts and dead letters (issue 29) -------------------------------------------------

def finished(spans, name: str, message_id: str) -> list:
    return [s for s in spans.get_finished_spans()
            if s.name == name and s.attributes.get("messaging.message.id") == message_id]


def test_each_handler_run_span_carries_its_attempt_number_handler_and_outcome(make_bus, spans):
    from opentelemetry import trace

    sub = make_bus("sub", tracing=True, max_attempts=3, retry_initial=0.01, retry_max=0.02)
    sub.every("jobs.flaky", lambda p, m: 1 / (m.attempt - 1), name="flaky")  # fails once
    pub = make_bus("pub", tracing=True)
    sub.subscribe(pub.address, "jobs.flaky", wait=10)
    mid = pub.publish("jobs.flaky", {})
    runs = wait_until(lambda: (lambda r: len(r) == 2 and r)(finished(spans, "process jobs.flaky", mid)), 10)
    runs.sort(key=lambda s: s.attributes["servicebus.attempt"])
    assert [s.attributes["servicebus.attempt"] for s in runs] == [1, 2]
    assert [s.attributes["servicebus.outcome"] for s in runs] == ["failed", "handled"]
    assert {s.attributes["servicebus.handler"] for s in runs} == {"flaky"}
    assert [s.status.status_code for s in runs] == [trace.StatusCode.ERROR, trace.StatusCode.UNSET]
    assert not finished(spans, "deadletter jobs.flaky", mid)


def test_a_dead_letter_is_a_span_in_the_messages_trace_with_its_reason_and_last_attempt(make_bus, spans):
    from opentelemetry import trace

    sub = make_bus("sub", tracing=True, max_attempts=2, retry_initial=0.01, retry_max=0.02)
    sub.every("jobs.broken", lambda p, m: 1 / 0, name="broken")
    pub = make_bus("pub", tracing=True)
    sub.subscribe(pub.address, "jobs.broken", wait=10)
    mid = pub.publish("jobs.broken", {})
    [dead] = wait_until(lambda: finished(spans, "deadletter jobs.broken", mid), 10)
    assert dead.attributes["servicebus.deadletter.reason"] == "handler_failed"
    assert dead.attributes["servicebus.attempt"] == 2
    assert dead.attributes["servicebus.handler"] == "broken"
    assert dead.status.status_code == trace.StatusCode.ERROR
    assert "ZeroDivisionError" in dead.status.description
    [producer] = [s for s in spans.get_finished_spans() if s.name == "publish jobs.broken"
                  and s.context.trace_id == dead.context.trace_id]
    assert dead.parent.span_id == producer.context.span_id  # beside the runs it ends
    assert sorted(s.attributes["servicebus.attempt"] for s in finished(spans, "process jobs.broken", mid)) == [1, 2]


def test_a_rejected_messages_dead_letter_span_says_rejected_at_its_first_attempt(make_bus, spans):
    from servicebus import Reject

    def picky(payload, message):
        raise Reject("not for us")

    sub = make_bus("sub", tracing=True)
    sub.every("jobs.picky", picky, name="picky")
    pub = make_bus("pub", tracing=True)
    sub.subscribe(pub.address, "jobs.picky", wait=10)
    mid = pub.publish("jobs.picky", {})
    [dead] = wait_until(lambda: finished(spans, "deadletter jobs.picky", mid), 10)
    assert dead.attributes["servicebus.deadletter.reason"] == "rejected"
    assert dead.attributes["servicebus.attempt"] == 1
    [run] = finished(spans, "process jobs.picky", mid)
    assert run.attributes["servicebus.outcome"] == "rejected"
