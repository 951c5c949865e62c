"""``asyncapi()``: an AsyncAPI 3.0 document of what a service handles and subscribes to, with
the payload schemas of its typed handlers; and ``every``/``handle`` keep a handler's type
for type checkers (mypy run on a snippet)."""

from __future__ import annotations

import asyncio
import dataclasses
import decimal
import json
import re
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import msgspec
import pydantic

from servicebus import AsyncBus, Bus, Message
from servicebus.testing import AsyncStubBus, StubBus

ROOT = Path(__file__).resolve().parents[2]
KEY = re.compile(r"^[A-Za-z0-9_.\-]+$")  # AsyncAPI 3.0: the keys of channels, operations, components


class Placed(msgspec.Struct):
    id: uuid.UUID
    total: decimal.Decimal


@dataclasses.dataclass
class Address:
    street: str
    city: str


@dataclasses.dataclass
class Shipped:
    order: str
    to: Address


class Invoice(pydantic.BaseModel):
    order: str
    amount: decimal.Decimal


def _resolve(doc: dict, ref: str) -> object:
    assert ref.startswith("#/"), ref
    node: object = doc
    for part in ref[2:].split("/"):
        assert isinstance(node, dict) and part in node, f"{ref} does not resolve"
        node = node[part]
    return node


def _refs(node: object):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def check_asyncapi(doc: dict) -> None:
    """The AsyncAPI 3.0 document's required shape (its JSON schema's required fields and
    key patterns), and every ``$ref`` resolves; it is JSON as it is."""
    json.dumps(doc)
    assert doc["asyncapi"] == "3.0.0"
    assert isinstance(doc["info"]["title"], str) and isinstance(doc["info"]["version"], str)
    assert set(doc) <= {"asyncapi", "id", "info", "servers", "defaultContentType", "channels",
                        "operations", "components"}
    for server in doc.get("servers", {}).values():
        assert isinstance(server["host"], str) and isinstance(server["protocol"], str)
    for key, channel in doc.get("channels", {}).items():
        assert KEY.match(key), key
        assert isinstance(channel["address"], str)
        for name, message in channel.get("messages", {}).items():
            assert KEY.match(name) and isinstance(message, dict)
    for key, operation in doc.get("operations", {}).items():
        assert KEY.match(key) and operation["action"] in ("send", "receive")
        assert set(operation["channel"]) == {"$ref"}
        assert operation["channel"]["$ref"].startswith("#/channels/")
        for message in operation.get("messages", []):
            assert message["$ref"].startswith(operation["channel"]["$ref"] + "/messages/")
    for name in doc.get("components", {}).get("schemas", {}):
        assert KEY.match(name), name
    for ref in _refs(doc):
        _resolve(doc, ref)


def a_service(bus):
    """Handlers of every kind: typed by a Struct, a dataclass and a pydantic model, and untyped."""
    @bus.every("orders.placed")
    def placed(order: Placed, message: Message) -> None: ...

    @bus.every("orders.shipped")
    def shipped(event: Shipped, message: Message) -> None: ...

    @bus.handle("invoice.create")
    def invoice(command: Invoice, message: Message) -> str:
        return command.order

    bus.every("audit.>", lambda payload, message: None)
    bus.subscribe("tcp://127.0.0.1:7001", "orders.placed")
    return bus


def test_the_document_lists_handled_topics_commands_and_subscriptions_with_their_schemas():
    doc = a_service(StubBus("tcp://127.0.0.1:7000")).asyncapi(title="orders", version="2.1.0")
    check_asyncapi(doc)
    assert doc["info"] == {"title": "orders", "version": "2.1.0"} | {
        k: v for k, v in doc["info"].items() if k not in ("title", "version")}
    addresses = {c["address"] for c in doc["channels"].values()}
    assert addresses == {"orders.placed", "orders.shipped", "invoice.create", "audit.>"}
    assert {o["action"] for o in doc["operations"].values()} == {"receive"}
    schemas = doc["components"]["schemas"]
    assert schemas["Placed"]["properties"]["id"]["format"] == "uuid"
    assert schemas["Shipped"]["properties"]["to"] == {"$ref": "#/components/schemas/Address"}
    assert set(schemas["Invoice"]["properties"]) == {"order", "amount"}
    placed = next(c for c in doc["channels"].values() if c["address"] == "orders.placed")
    assert placed["x-servicebus-subscribed-at"] == ["tcp://127.0.0.1:7001"]
    (message,) = placed["messages"].values()
    assert message["payload"] == {"$ref": "#/components/schemas/Placed"}


def test_every_bus_and_double_describes_the_same_service(tmp_path):
    stub = a_service(StubBus("tcp://127.0.0.1:7000")).asyncapi()
    astub = AsyncStubBus("tcp://127.0.0.1:7000")
    a_service(astub.stub)
    assert astub.asyncapi()["channels"] == stub["channels"]
    with Bus("tcp://127.0.0.1:0", tmp_path / "bus") as bus:
        doc = a_service(bus).asyncapi()
    check_asyncapi(doc)
    assert doc["servers"]["self"]["host"] == bus.address.removeprefix("tcp://")
    assert doc["channels"] == stub["channels"] and doc["operations"] == stub["operations"]
    assert doc["components"] == stub["components"]

    async def on_a_loop():
        async with AsyncBus("tcp://127.0.0.1:0", tmp_path / "abus") as abus:
            a_service(abus.bus)
            return abus.asyncapi()

    assert asyncio.run(on_a_loop())["channels"] == stub["channels"]


def test_every_and_handle_keep_the_handlers_type_for_type_checkers(tmp_path):
    head = textwrap.dedent("""
        from servicebus import AsyncBus, Bus, Message
        from servicebus.testing import AsyncStubBus, StubBus

        def handler(payload: dict[str, int], message: Message) -> int:
            return 1
    """)
    body = textwrap.dedent("""
        def check_{kind}(b: {kind}) -> None:
            reveal_type(b.every("t", handler))
            reveal_type(b.handle("c", handler, name="x"))

            @b.every("t", max_attempts=3)
            def decorated(payload: str, message: Message) -> str:
                return payload

            reveal_type(decorated)
            b.every("t", handler, no_such_option=1)
    """)
    kinds = ("Bus", "StubBus", "AsyncBus", "AsyncStubBus")
    snippet = tmp_path / "typed_snippet.py"
    snippet.write_text(head + "".join(body.format(kind=kind) for kind in kinds))
    result = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent",
                             "--config-file", str(ROOT / "setup.cfg"), str(snippet)],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    revealed = [line.split("Revealed type is ")[1] for line in result.stdout.splitlines()
                if "Revealed type is" in line]
    assert len(revealed) == 3 * len(kinds), result.stdout
    for i, shown in enumerate(revealed):
        returns = "str" if i % 3 == 2 else "int"
        assert shown.startswith('"def (payload:') and shown.endswith(f'-> {returns}"'), shown
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    # The only errors: the unknown options' lines (the overloads keep the keywords checked).
    lines = snippet.read_text().splitlines()
    assert {int(e.split(":")[1]) for e in errors} == {
        n for n, line in enumerate(lines, 1) if "no_such_option" in line}, result.stdout
