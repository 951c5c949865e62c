"""A service's AsyncAPI 3.0 document, made from what its bus knows: the topics and patterns
it handles (``every``), the commands it handles (``handle``), the topics it subscribes to at
other buses, and the payload schemas of its typed handlers (typed.py: msgspec's JSON schema
for Structs and dataclasses, pydantic's own for its models). ``Bus.asyncapi()`` and the
test doubles' return it; ``servicebus asyncapi MODULE:ATTR`` prints it.

Every operation is a ``receive``: what a service publishes is not declared anywhere a bus
could read it. Payloads travel as msgpack (``defaultContentType``); a handler with no model
has a message with no payload schema (any value).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from ..wire.protocol import Kind
from ..wire.typed import schemas
from .handlers import Handlers

__all__ = ["document"]

CONTENT_TYPE = "application/msgpack"
_KINDS = {int(Kind.EVENT): "event", int(Kind.COMMAND): "command"}


def _key(text: str) -> str:
    """A key AsyncAPI allows (``^[A-Za-z0-9_.-]+$``): wildcards spelt out, the rest ``_``."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", text.replace("*", "_star_").replace(">", "_rest_"))


def document(address: str, handlers: Handlers, subscribed: Iterable[tuple[str, str]], *,
             title: str | None = None, version: str = "1.0.0",
             description: str | None = None) -> dict[str, Any]:
    """The AsyncAPI 3.0 document (a dict, JSON as it is) of the bus at ``address`` with
    ``handlers``, subscribed to ``(publisher address, topic)`` pairs ``subscribed``."""
    # (kind, topic) -> its handlers' names and models, in registration order
    found: dict[tuple[str, str], list[tuple[str, type | None]]] = {}
    for number, topic, name, model in handlers.described():
        if number in _KINDS:
            found.setdefault((_KINDS[number], topic), []).append((name, model))
    at: dict[str, list[str]] = {}
    for publisher, topic in subscribed:
        at.setdefault(topic, []).append(publisher)
        found.setdefault(("event", topic), [])
    models = list(dict.fromkeys(m for hs in found.values() for _, m in hs if m is not None))
    payloads, components = schemas(models)
    schema_of = dict(zip(models, payloads))
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    for (kind, topic), hs in found.items():
        key = _key(f"{kind}.{topic}")
        typed = list(dict.fromkeys(m for _, m in hs if m is not None))
        messages = {_key(m.__name__): {"name": m.__name__, "payload": schema_of[m]} for m in typed} \
            or {"payload": {"name": "payload", "summary": "any msgpack value (an untyped handler's)"}}
        channel: dict[str, Any] = {"address": topic, "messages": messages, "x-servicebus-kind": kind}
        if topic in at and kind == "event":
            channel["x-servicebus-subscribed-at"] = sorted(at[topic])
        channels[key] = channel
        operation: dict[str, Any] = {
            "action": "receive", "channel": {"$ref": f"#/channels/{key}"},
            "messages": [{"$ref": f"#/channels/{key}/messages/{name}"} for name in messages]}
        if hs:
            operation["x-servicebus-handlers"] = [name for name, _ in hs]
        operations[_key(f"receive.{kind}.{topic}")] = operation
    info: dict[str, Any] = {"title": title or f"servicebus at {address}", "version": version}
    if description:
        info["description"] = description
    doc: dict[str, Any] = {
        "asyncapi": "3.0.0", "info": info,
        "servers": {"self": {"host": address.removeprefix("tcp://"), "protocol": "zmq",
                             "description": "this bus (ZeroMQ over TCP)"}},
        "defaultContentType": CONTENT_TYPE, "channels": channels, "operations": operations}
    if components:
        doc["components"] = {"schemas": components}
    return doc
