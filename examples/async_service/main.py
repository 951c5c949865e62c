"""An asyncio service on servicebus, traced and measured (README: asyncio, Tracing, Metrics).

    .venv/bin/python examples/async_service/main.py

A "web" bus publishes an order per incoming request inside a request span; a "billing" bus
handles each order in an ``async def`` handler. The output shows the trace id of each
request and the trace id the handler ran under (the same: carried in the message's
``traceparent`` header), then a scrape of billing's Prometheus endpoint.
Needs the dev extra (opentelemetry-sdk, prometheus_client): ``tools/test`` installs it.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import urllib.request
from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from servicebus import AsyncBus
from servicebus.testing import free_address, free_port

TOPIC = "order.placed"


async def main() -> None:
    trace.set_tracer_provider(TracerProvider())  # a real service would add an exporter
    tracer = trace.get_tracer("web")
    data = Path(tempfile.mkdtemp(prefix="servicebus-async-"))
    try:
        await run(tracer, data)
    finally:
        shutil.rmtree(data, ignore_errors=True)


async def run(tracer: trace.Tracer, data: Path) -> None:
    port = free_port()
    async with AsyncBus(free_address(), data / "web", tracing=True) as web, \
            AsyncBus(free_address(), data / "billing", tracing=True, metrics_port=port) as billing:
        handled = asyncio.Queue()

        @billing.every(TOPIC)
        async def bill(payload, message):
            trace_id = trace.get_current_span().get_span_context().trace_id
            await handled.put((payload["order"], f"{trace_id:032x}"))

        await billing.subscribe(web.address, TOPIC, wait=10)
        for order in (1, 2, 3):
            with tracer.start_as_current_span("POST /orders") as request:
                await web.publish(TOPIC, {"order": order})
                print(f"web:     order {order} published in trace {request.get_span_context().trace_id:032x}")
        for _ in range(3):
            order, trace_id = await asyncio.wait_for(handled.get(), 10)
            print(f"billing: order {order} handled in trace   {trace_id}")
        await billing.drain(10)
        scrape = await asyncio.to_thread(lambda: urllib.request.urlopen(billing.bus.metrics_address).read().decode())
        print(f"metrics scraped from {billing.bus.metrics_address}:")
        for line in scrape.splitlines():
            if line.startswith(("servicebus_received_total", "servicebus_handler_seconds_count", "servicebus_incoming")):
                print("  " + line)


if __name__ == "__main__":
    asyncio.run(main())
