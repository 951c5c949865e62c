"""The gateway's OpenAPI 3.1 document (served at ``/openapi.json``; a test holds it against
the routes the app has)."""

from __future__ import annotations

from typing import Any

__all__ = ["document", "ROUTES"]

_ERROR = {"description": "the request is wrong: which field, and why",
          "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_TOPIC = {"name": "topic", "in": "path", "required": True, "schema": {"type": "string"}}
_NAME = {"name": "name", "in": "path", "required": True,
         "schema": {"type": "string", "pattern": "^[A-Za-z0-9._-]{1,100}$"}}
_DURATION = {"type": "string", "description": "5s, 500ms, 5m, 1h or a number of seconds"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _op(summary: str, responses: dict[str, Any], params: list[dict] | None = None,
        body: dict[str, Any] | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "parameters": params or [],
                          "responses": {**responses, "400": _ERROR, "401": _ERROR, "403": _ERROR}}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return op


_Q = {"name": "", "in": "query", "required": False}
_OPTIONS = {"$ref": "#/components/schemas/SubscriberOptions"}

ROUTES: dict[str, dict[str, Any]] = {
    "/topics": {"post": _op("make a topic's subscribers (blockqueue's create topic)",
                            {"201": _json({"type": "object"}, "made")},
                            body={"type": "object", "required": ["name"],
                                  "properties": {"name": {"type": "string"},
                                                 "subscribers": {"type": "array"}}})},
    "/topics/{topic}/messages": {"post": _op(
        "publish: 201 once the message is fsynced, as Bus.publish returns",
        {"201": _json({"type": "object", "properties": {"id": {"type": "string"},
                                                         "ids": {"type": "array", "items": {"type": "string"}}}},
                      "stored and fsynced"), "413": _ERROR, "429": _ERROR, "503": _ERROR},
        [_TOPIC, {**_Q, "name": "many", "schema": {"type": "boolean"},
                  "description": "the body is a JSON array of messages, published together"},
         {**_Q, "name": "ttl", "schema": _DURATION}, {**_Q, "name": "delay", "schema": _DURATION},
         {"name": "Idempotency-Key", "in": "header", "required": False, "schema": {"type": "string"}}],
        body={"description": "the payload: any JSON value"})},
    "/topics/{topic}/subscribers": {
        "get": _op("subscribers of a topic with their counts",
                   {"200": _json({"type": "object"}, "unpublished, in flight, dead letters")}, [_TOPIC]),
        "post": _op("make several subscribers (blockqueue)", {"201": _json({"type": "object"}, "made")},
                    [_TOPIC], body={"type": "array", "items": _OPTIONS})},
    "/topics/{topic}/subscribers/{name}": {
        "put": _op("make a pull (or push) subscriber, or change its options",
                   {"201": _json({"type": "object"}, "made"), "200": _json({"type": "object"}, "changed")},
                   [_TOPIC, _NAME], body=_OPTIONS),
        "get": _op("read: long-polls up to timeout for messages, which become invisible for the "
                   "visibility duration", {"200": _json({"$ref": "#/components/schemas/Messages"}, "messages, or none"),
                                            "404": _ERROR, "409": _ERROR},
                   [_TOPIC, _NAME, {**_Q, "name": "timeout", "schema": _DURATION},
                    {**_Q, "name": "max", "schema": {"type": "integer", "minimum": 1, "maximum": 1000}}]),
        "delete": _op("delete a subscriber and what it holds (durable)", {"204": {"description": "deleted"},
                                                                         "404": _ERROR}, [_TOPIC, _NAME])},
    "/topics/{topic}/subscribers/{name}/messages/{id}": {"delete": _op(
        "acknowledge one message", {"204": {"description": "acknowledged"}, "404": _ERROR},
        [_TOPIC, _NAME, {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}])},
    "/topics/{topic}/subscribers/{name}/messages": {"delete": _op(
        "acknowledge several messages (?ids=a,b,c)", {"200": _json({"type": "object"}, "acked, unknown")},
        [_TOPIC, _NAME, {**_Q, "name": "ids", "schema": {"type": "string"}}])},
    "/topics/{topic}/subscribers/{name}/acks": {"post": _op(
        "acknowledge several messages (a JSON list of ids)", {"200": _json({"type": "object"}, "acked, unknown")},
        [_TOPIC, _NAME], body={"type": "array", "items": {"type": "string"}})},
    "/topics/{topic}/subscribers/{name}/deadletters": {"get": _op(
        "the subscriber's dead letters", {"200": _json({"type": "object"}, "dead letters")}, [_TOPIC, _NAME])},
    "/commands/{target}/{command}": {"post": _op(
        "send a command to an address or a service by name (202 once fsynced); with reply=true a "
        "request that waits for the handler's reply", {
            "202": _json({"type": "object"}, "stored and fsynced"), "200": _json({"type": "object"}, "the reply"),
            "502": _ERROR, "504": _ERROR},
        [{"name": "target", "in": "path", "required": True, "schema": {"type": "string"}},
         {"name": "command", "in": "path", "required": True, "schema": {"type": "string"}},
         {**_Q, "name": "reply", "schema": {"type": "boolean"}}, {**_Q, "name": "timeout", "schema": _DURATION},
         {**_Q, "name": "ttl", "schema": _DURATION}, {**_Q, "name": "delay", "schema": _DURATION}],
        body={"description": "the payload: any JSON value"})},
    "/health": {"get": {"summary": "200 when the bus can write, 503 if not", "parameters": [],
                        "responses": {"200": {"description": "ok"}, "503": {"description": "degraded"}}}},
    "/metrics": {"get": {"summary": "Prometheus metrics of the bus and the gateway", "parameters": [],
                         "responses": {"200": {"description": "text exposition format"}}}},
    "/openapi.json": {"get": {"summary": "this document", "parameters": [],
                              "responses": {"200": {"description": "OpenAPI 3.1"}}}},
}


def document(url: str) -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": "servicebus HTTP gateway", "version": "0.3"},
        "servers": [{"url": url}],
        "security": [{"bearer": []}],
        "paths": ROUTES,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {"type": "object", "required": ["error"],
                          "properties": {"error": {"type": "string"}, "field": {"type": ["string", "null"]}}},
                "SubscriberOptions": {"type": "object", "properties": {
                    "name": {"type": "string"},
                    "max_attempts": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 5},
                    "visibility_duration": {**_DURATION, "default": "30s"},
                    "source": {"type": "string", "description": "another publisher: service name or address"},
                    "push": {"type": "object", "properties": {"url": {"type": "string"}, "secret": {"type": "string"}}},
                    "option": {"type": "object", "description": "blockqueue's nesting of the same options"}}},
                "Messages": {"type": "object", "properties": {"messages": {"type": "array", "items": {
                    "type": "object", "properties": {
                        "id": {"type": "string"}, "payload": {}, "headers": {"type": ["object", "null"]},
                        "attempt": {"type": "integer"}, "published": {"type": "integer"},
                        "visible_until": {"type": "number"}}}}}},
            },
        },
    }
