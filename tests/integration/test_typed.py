"""Typed payloads and messages across real buses (issue 29): a Struct, dataclass or pydantic
model published by one bus reaches typed handlers as a validated instance, untyped ones and
the CLI as plain values; one that does not validate is a dead letter ``invalid`` at once.
And ``servicebus asyncapi MODULE:ATTR`` prints a service's AsyncAPI document."""

from __future__ import annotations

import asyncio
import datetime as dt
import decimal
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import msgspec
import pytest

from servicebus import AsyncBus, Message
from servicebus.testing import free_address, wait_until
from tests.unit.test_asyncapi import check_asyncapi

TOPIC = "orders.placed"
CLI = str(Path(sys.executable).parent / "servicebus")
NOW = dt.datetime(2024, 5, 1, 12, 30, tzinfo=dt.timezone.utc)


class Line(msgspec.Struct):
    sku: str
    qty: int
    price: decimal.Decimal


class Placed(msgspec.Struct):
    id: uuid.UUID
    lines: list[Line]
    created: dt.datetime


def placed(n: int) -> Placed:
    return Placed(uuid.UUID(int=n), [Line(f"A-{n}", n, decimal.Decimal("9.99"))], NOW)


def cli(*args, cwd=None):
    return subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, timeout=60, cwd=cwd,
                          env={**os.environ, "COLUMNS": "80"})


def test_a_typed_handler_on_another_bus_gets_instances_and_an_untyped_one_plain_values(make_bus):
    pub, sub = make_bus("pub"), make_bus("sub", max_attempts=5)
    sub.subscribe(pub.address, TOPIC, wait=10)
    typed, plain = [], []

    @sub.every(TOPIC)
    def on_placed(order: Placed, message: Message) -> None:
        typed.append(order)

    sub.every(TOPIC, lambda payload, message: plain.append(payload), name="untyped")
    pub.publish_many(TOPIC, [placed(1), {"id": "nope"}, placed(3)])  # one record, three messages
    wait_until(lambda: len(plain) == 2 and sub.status().deadletters == 1, 10)
    assert sub.drain(10)
    assert typed == [placed(1), placed(3)]  # the invalid one is dead before the next handler runs
    assert plain[0] == {"id": str(uuid.UUID(int=1)), "created": "2024-05-01T12:30:00Z",
                        "lines": [{"sku": "A-1", "qty": 1, "price": "9.99"}]}
    (letter,) = sub.deadletters()
    assert (letter.reason, letter.attempts) == ("invalid", 1)
    assert letter.error.startswith("ValidationError: ") and "uuid" in letter.error.lower()


def test_an_async_def_handler_on_an_async_bus_gets_a_validated_instance(tmp_path):
    got = []

    async def main():
        async with AsyncBus(free_address(), tmp_path / "pub") as pub, \
                AsyncBus(free_address(), tmp_path / "sub") as sub:
            @sub.every(TOPIC)
            async def on_placed(order: Placed, message: Message) -> None:
                got.append(order)

            await sub.subscribe(pub.address, TOPIC, wait=10)
            await pub.publish(TOPIC, placed(2))
            await pub.publish(TOPIC, [1, 2])
            await asyncio.to_thread(wait_until, lambda: got and sub.bus.status().deadletters == 1, 10)
            return await sub.deadletters()

    letters = asyncio.run(main())
    assert got == [placed(2)] and [d.reason for d in letters] == ["invalid"]


def test_the_cli_lists_a_typed_payload_and_its_dead_letter_as_plain_values(make_bus, tmp_path):
    pub, sub = make_bus("pub"), make_bus("sub")
    sub.subscribe(pub.address, TOPIC, wait=10)
    sub.every(TOPIC, lambda order, message: None)

    @sub.every(TOPIC, name="typed")
    def on_placed(order: Placed, message: Message) -> None: ...

    pub.publish(TOPIC, {"id": 5, "when": NOW})
    wait_until(lambda: sub.status().deadletters == 1, 10)
    sub.close()
    result = cli("deadletters", tmp_path / "sub", "--json")
    assert result.returncode == 0, result.stderr
    (row,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert row["reason"] == "invalid" and row["payload"] == {"id": 5, "when": "2024-05-01T12:30:00Z"}


SERVICE = """
    import msgspec
    from servicebus import Bus, Message
    from servicebus.testing import StubBus

    class Placed(msgspec.Struct):
        id: int

    def register(bus):
        @bus.every("orders.placed")
        def on_placed(order: Placed, message: Message) -> None: ...
        bus.handle("invoice.create", lambda payload, message: None)
        return bus

    def stub():
        return register(StubBus("tcp://127.0.0.1:7000"))

    stubbed = stub()
    answer = 42
"""


@pytest.mark.parametrize("target", ["service:stub", "service:stubbed"])
def test_the_asyncapi_command_prints_the_document_of_a_bus_or_of_a_function_returning_one(tmp_path, target):
    (tmp_path / "service.py").write_text(textwrap.dedent(SERVICE))
    result = cli("asyncapi", target, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    check_asyncapi(doc)
    assert {c["address"] for c in doc["channels"].values()} == {"orders.placed", "invoice.create"}
    assert doc["info"]["title"] == "service"
    assert doc["components"]["schemas"]["Placed"]["properties"] == {"id": {"type": "integer"}}


@pytest.mark.skipif(importlib.util.find_spec("yaml") is None, reason="PyYAML is not installed")
def test_the_asyncapi_command_prints_yaml_on_request(tmp_path):
    import yaml
    (tmp_path / "service.py").write_text(textwrap.dedent(SERVICE))
    result = cli("asyncapi", "service:stub", "--format", "yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    check_asyncapi(yaml.safe_load(result.stdout))


def test_the_asyncapi_command_says_what_is_wrong_with_its_target_in_one_line(tmp_path):
    (tmp_path / "service.py").write_text(textwrap.dedent(SERVICE))
    for target, says in [("nomodule:x", "cannot import"), ("service:nothing", "no attribute"),
                         ("service", "MODULE:ATTR"), ("service:answer", "not a bus")]:
        result = cli("asyncapi", target, cwd=tmp_path)
        assert result.returncode == 1 and says in result.stderr, (target, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1
