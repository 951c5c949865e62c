"""The HTTP routes (aiohttp). Each turns a request into calls on the bus's public API, run
on a thread pool (they block on fsyncs: concurrent ones share them, the bus's group
commit), and answers only once the call returned: a 201 means what ``publish`` returning
means. Every malformed request is a 4xx with ``{"error": ..., "field": ...}``; nothing
from the client is a 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from ..errors import BacklogFull, BusError, RemoteError, RequestTimeout
from ..wire.topics import validate_topic
from .auth import Token, Tokens
from .pull import PullQueues, Sub, check_sub_name

__all__ = ["make_app", "HttpError", "duration"]

log = logging.getLogger("servicebus.gateway")

MAX_BATCH = 1000  # messages per publish or read request
MAX_WAIT = 60.0  # longest long poll
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)?$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


class HttpError(Exception):
    def __init__(self, status: int, error: str, field: str | None = None) -> None:
        super().__init__(error)
        self.status, self.error, self.field = status, error, field


def duration(value: Any, field: str, *, default: float | None = None, maximum: float = 86400 * 30) -> float | None:
    """``5s``, ``500ms``, ``5m``, ``1h`` or a number of seconds."""
    if value is None or value == "":
        return default
    if isinstance(value, bool):
        raise HttpError(400, "must be a duration such as 5s, 500ms, 5m or a number of seconds", field)
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value).strip())
        if match is None:
            raise HttpError(400, "must be a duration such as 5s, 500ms, 5m or a number of seconds", field)
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if not 0 <= seconds <= maximum:
        raise HttpError(400, f"must be between 0 and {maximum:g} seconds", field)
    return seconds


def _json_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        import base64  # noqa: PLC0415 - rare: a Python publisher's bytes payload
        return {"$base64": base64.b64encode(value).decode()}
    return str(value)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities (which a Python publisher may send) as null."""
    if isinstance(value, float) and value != value or value in (float("inf"), float("-inf")):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _dumps(value: Any) -> str:
    try:
        return json.dumps(value, default=_json_default, separators=(",", ":"), allow_nan=False)
    except ValueError:  # NaN or infinity: JSON has neither
        return json.dumps(_finite(value), default=_json_default, separators=(",", ":"), allow_nan=False)


def reply(status: int, body: Any = None) -> web.Response:
    if body is None:
        return web.Response(status=status)
    return web.Response(status=status, text=_dumps(body), content_type="application/json")


class Routes:
    def __init__(self, bus: Any, queues: PullQueues, tokens: Tokens, run: Callable[..., Awaitable[Any]],
                 counters: dict[str, int], max_body: int) -> None:
        self.bus, self.queues, self.tokens, self.run = bus, queues, tokens, run
        self.counters = counters
        self.max_body = max_body
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    # --- helpers ---------------------------------------------------------------------------

    def token(self, request: web.Request) -> Token:
        token = self.tokens.check(request.headers.get("Authorization"))
        if token is None:
            raise HttpError(401, "a valid bearer token is required (Authorization: Bearer ...)", "Authorization")
        return token

    def topic(self, request: web.Request, token: Token, write: bool) -> str:
        return self.check_topic(request.match_info["topic"], token, write)

    @staticmethod
    def check_topic(topic: str, token: Token, write: bool) -> str:
        try:
            validate_topic(topic)
        except (TypeError, ValueError) as exc:
            raise HttpError(400, str(exc), "topic") from None
        if write and not token.may_write(topic):
            raise HttpError(403, f"token {token.name!r} may not write {topic!r}", "topic")
        if not write and not token.may_read(topic):
            raise HttpError(403, f"token {token.name!r} may not read {topic!r}", "topic")
        return topic

    async def body(self, request: web.Request) -> Any:
        if request.content_length is not None and request.content_length > self.max_body:
            raise HttpError(413, f"body larger than {self.max_body} bytes", "body")
        try:
            raw = await request.read()  # whole, however it arrives; bounded by client_max_size
        except web.HTTPRequestEntityTooLarge:
            raise HttpError(413, f"body larger than {self.max_body} bytes", "body") from None
        except asyncio.TimeoutError:
            raise HttpError(408, "the body did not arrive in time", "body") from None
        if len(raw) > self.max_body:
            raise HttpError(413, f"body larger than {self.max_body} bytes", "body")
        if not raw:
            raise HttpError(400, "a JSON body is required", "body")
        try:
            return json.loads(raw, parse_constant=_no_constant)
        except (ValueError, UnicodeDecodeError) as exc:
            raise HttpError(400, f"not JSON: {exc}", "body") from None
        except RecursionError:
            raise HttpError(400, "not JSON this bus takes: nested too deeply", "body") from None

    def sub(self, topic: str, name: str) -> Sub:
        try:
            check_sub_name(name)
        except ValueError as exc:
            raise HttpError(400, str(exc), "subscriber") from None
        sub = self.queues.subs.get((topic, name))
        if sub is None:
            raise HttpError(404, f"no subscriber {name!r} on {topic!r}", "subscriber")
        return sub

    @staticmethod
    def int_param(request: web.Request, name: str, default: int, low: int, high: int) -> int:
        value = request.query.get(name)
        if value is None:
            return default
        try:
            number = int(value)
        except ValueError:
            raise HttpError(400, "must be an integer", name) from None
        if not low <= number <= high:
            raise HttpError(400, f"must be from {low} to {high}", name)
        return number

    @staticmethod
    def message_headers(request: web.Request) -> dict[str, str] | None:
        found = {k[len("X-Message-"):].lower(): v for k, v in request.headers.items()
                 if k.lower().startswith("x-message-")}
        return found or None

    # --- publish and commands ----------------------------------------------------------------------

    async def publish(self, request: web.Request) -> web.Response:
        token = self.token(request)
        topic = self.topic(request, token, write=True)
        ttl = duration(request.query.get("ttl"), "ttl")
        delay = duration(request.query.get("delay"), "delay")
        headers = self.message_headers(request)
        key = request.headers.get("Idempotency-Key")
        if key is not None and not 0 < len(key) <= 200:
            raise HttpError(400, "must be 1-200 characters", "Idempotency-Key")
        payload = await self.body(request)
        many = request.query.get("many") in ("1", "true")
        if many:
            if not isinstance(payload, list) or not 0 < len(payload) <= MAX_BATCH:
                raise HttpError(400, f"with many=true the body is a JSON array of 1-{MAX_BATCH} messages", "body")
            if key is not None or delay is not None:
                raise HttpError(400, "Idempotency-Key and delay apply to one message, not many=true", "many")
            ids = await self.run(self.bus.publish_many, topic, payload, ttl=ttl, headers=headers)
            self.counters["published"] += len(ids)
            return reply(201, {"ids": ids})
        mid = await self.run(self.bus.publish, topic, payload, ttl=ttl, headers=headers, delay=delay,
                             dedupe_key=key)
        self.counters["published"] += 1
        return reply(201, {"id": mid})

    async def command(self, request: web.Request) -> web.Response:
        token = self.token(request)
        target, command = request.match_info["target"], request.match_info["command"]
        if not token.may_write(command):
            raise HttpError(403, f"token {token.name!r} may not send {command!r}", "command")
        payload = await self.body(request)
        ttl = duration(request.query.get("ttl"), "ttl")
        headers = self.message_headers(request)
        if request.query.get("reply") in ("1", "true"):
            timeout = duration(request.query.get("timeout"), "timeout", default=30.0, maximum=MAX_WAIT)
            assert timeout is not None
            try:
                value = await self.run(self.bus.request, target, command, payload, timeout=timeout,
                                       headers=headers, ttl=ttl)
            except RequestTimeout as exc:
                raise HttpError(504, str(exc), "timeout") from None
            except RemoteError as exc:
                raise HttpError(502, f"the handler raised: {exc}", "command") from None
            return reply(200, {"reply": value})
        delay = duration(request.query.get("delay"), "delay")
        mid = await self.run(self.bus.send, target, command, payload, ttl=ttl, headers=headers, delay=delay)
        return reply(202, {"id": mid})

    # --- subscribers --------------------------------------------------------------------------------

    def _options(self, body: Any, field: str = "body") -> dict[str, Any]:
        if not isinstance(body, dict):
            raise HttpError(400, "must be a JSON object", field)
        option = body.get("option", body)  # blockqueue nests them in "option"
        if not isinstance(option, dict):
            raise HttpError(400, "must be a JSON object", f"{field}.option")
        attempts = option.get("max_attempts", 5)
        if isinstance(attempts, bool) or not isinstance(attempts, int) or not 1 <= attempts <= 1000:
            raise HttpError(400, "must be an integer from 1 to 1000", "max_attempts")
        visibility = duration(option.get("visibility_duration"), "visibility_duration", default=30.0,
                              maximum=12 * 3600)
        if visibility is not None and visibility < 0.1:
            raise HttpError(400, "must be at least 100ms", "visibility_duration")
        source = option.get("source")
        if source is not None and (not isinstance(source, str) or not source or len(source) > 300):
            raise HttpError(400, "must be a service name or an address", "source")
        push = option.get("push")
        if push is not None:
            if not isinstance(push, dict) or not isinstance(push.get("url"), str) or \
                    not re.match(r"^https?://", push["url"]) or not isinstance(push.get("secret", ""), str):
                raise HttpError(400, "must be {\"url\": \"http(s)://...\", \"secret\": \"...\"}", "push")
            push = {"url": push["url"], "secret": push.get("secret", "")}
        return {"max_attempts": attempts, "visibility": visibility, "source": source, "push": push}

    async def _put_sub(self, topic: str, name: str, options: dict[str, Any]) -> tuple[Sub, bool]:
        try:
            check_sub_name(name)
        except ValueError as exc:
            raise HttpError(400, str(exc), "subscriber") from None
        try:
            return await self.run(self.queues.put_sub, topic, name, options["max_attempts"],
                                  options["visibility"], options["source"], options["push"])
        except ValueError as exc:  # the source: a name or an address the bus refused
            raise HttpError(400, str(exc), "source") from None

    async def put_subscriber(self, request: web.Request) -> web.Response:
        token = self.token(request)
        topic = self.topic(request, token, write=False)
        self.admin(token)
        body = await self.body(request) if request.can_read_body else {}
        sub, created = await self._put_sub(topic, request.match_info["name"], self._options(body))
        return reply(201 if created else 200, sub.counts(time.time()))

    async def add_subscribers(self, request: web.Request) -> web.Response:
        """blockqueue's ``POST /topics/{topic}/subscribers`` with a list."""
        token = self.token(request)
        topic = self.topic(request, token, write=False)
        self.admin(token)
        body = await self.body(request)
        if isinstance(body, dict) and isinstance(body.get("subscribers"), list):
            body = body["subscribers"]
        return await self._make_all(topic, body)

    async def create_topic(self, request: web.Request) -> web.Response:
        """blockqueue's ``POST /topics`` with a name and its subscribers."""
        token = self.token(request)
        body = await self.body(request)
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            raise HttpError(400, "must be a topic name", "name")
        topic = self.check_topic(body["name"], token, write=False)
        self.admin(token)
        return await self._make_all(topic, body.get("subscribers", []))

    async def _make_all(self, topic: str, entries: Any) -> web.Response:
        if not isinstance(entries, list) or len(entries) > 100:
            raise HttpError(400, "must be a list of at most 100 subscribers", "subscribers")
        made = []
        for n, entry in enumerate(entries):
            if isinstance(entry, str):
                entry = {"name": entry}
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise HttpError(400, "each subscriber needs a name", f"subscribers[{n}].name")
            sub, _created = await self._put_sub(topic, entry["name"], self._options(entry, f"subscribers[{n}]"))
            made.append(sub.counts(time.time()))
        return reply(201, {"topic": topic, "subscribers": made})

    def admin(self, token: Token) -> None:
        if not token.admin:
            raise HttpError(403, f"token {token.name!r} may not make or delete subscribers (admin)", "Authorization")

    async def delete_subscriber(self, request: web.Request) -> web.Response:
        token = self.token(request)
        topic = self.topic(request, token, write=False)
        self.admin(token)
        name = request.match_info["name"]
        self.sub(topic, name)
        await self.run(self.queues.delete_sub, topic, name)
        return reply(204)

    async def list_subscribers(self, request: web.Request) -> web.Response:
        token = self.token(request)
        topic = self.topic(request, token, write=False)
        now = time.time()
        return reply(200, {"topic": topic, "subscribers": [
            s.counts(now) for (t, _n), s in sorted(self.queues.subs.items()) if t == topic]})

    async def read(self, request: web.Request) -> web.Response:
        token = self.token(request)
        topic = self.topic(request, token, write=False)
        sub = self.sub(topic, request.match_info["name"])
        if sub.push:
            raise HttpError(409, "a push subscriber is not read: its messages go to its URL", "subscriber")
        limit = self.int_param(request, "max", 1, 1, MAX_BATCH)
        timeout = duration(request.query.get("timeout"), "timeout", default=0.0, maximum=MAX_WAIT) or 0.0
        deadline = time.monotonic() + timeout
        lock = self._locks.setdefault((topic, sub.name), asyncio.Lock())
        while True:
            async with lock:
                taken = await self.queues.read(sub, limit, self.run)
            if taken:
                self.counters["read"] += len(taken)
                return reply(200, {"messages": [_shown(item) for item in taken]})
            left = deadline - time.monotonic()
            if left <= 0 or sub.deleted:
                return reply(200, {"messages": []})
            await self.queues.wait(sub, left)

    async def ack(self, request: web.Request) -> web.Response:
        token = self.token(request)
        topic = self.topic(request, token, write=False)
        sub = self.sub(topic, request.match_info["name"])
        mid = request.match_info.get("id")
        if mid is not None:
            unknown = await self.run(self.queues.ack, sub, [mid])
            self.queues.acked(sub, [mid])
            if unknown:
                raise HttpError(404, "no such message in flight or queued for this subscriber", "id")
            self.counters["acked"] += 1
            return reply(204)
        ids: Any = request.query.get("ids", "")
        if not ids and request.can_read_body:
            body = await self.body(request)
            ids = body.get("ids") if isinstance(body, dict) else body
        if isinstance(ids, str):
            ids = [i for i in ids.split(",") if i]
        if not isinstance(ids, list) or not all(isinstance(i, str) and 0 < len(i) <= 64 for i in ids) \
                or not 0 < len(ids) <= MAX_BATCH:
            raise HttpError(400, f"must be 1-{MAX_BATCH} message ids", "ids")
        unknown = await self.run(self.queues.ack, sub, ids)
        self.queues.acked(sub, ids)
        self.counters["acked"] += len(ids) - len(unknown)
        return reply(200, {"acked": len(ids) - len(unknown), "unknown": unknown})

    async def deadletters(self, request: web.Request) -> web.Response:
        token = self.token(request)
        topic = self.topic(request, token, write=False)
        sub = self.sub(topic, request.match_info["name"])
        rows = await self.run(self.queues.pull.kv.items, sub.dead_key(""))
        return reply(200, {"deadletters": [{"id": k.rsplit("\x1f", 1)[1], **v} for k, v in rows[:1000]]})


def _shown(item: dict[str, Any]) -> dict[str, Any]:
    return {"id": item["id"], "payload": item.get("payload"), "headers": item.get("headers"),
            "attempt": item.get("attempts"), "published": item.get("published"),
            "visible_until": item.get("visible_at")}


@web.middleware
async def errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    try:
        return await handler(request)
    except HttpError as exc:
        return reply(exc.status, {"error": exc.error, "field": exc.field})
    except web.HTTPException as exc:  # aiohttp's own: 404 route, 405 method, 413 ...
        if exc.status >= 400:
            return reply(exc.status, {"error": exc.reason, "field": None})
        raise
    except BacklogFull as exc:
        return reply(429, {"error": str(exc), "field": "topic"})
    except (ValueError, TypeError) as exc:  # the bus refused a value (payload, header, name)
        return reply(400, {"error": str(exc)[:500], "field": "body"})
    except BusError as exc:  # the bus cannot take it now (closed, its disk)
        log.warning("%s %s: %s", request.method, request.path, exc)
        return reply(503, {"error": f"{type(exc).__name__}: {exc}"[:500], "field": None})


def make_app(routes: Routes, extra: Mapping[str, Callable[[web.Request], Awaitable[web.Response]]],
             max_body: int) -> web.Application:
    app = web.Application(middlewares=[errors], client_max_size=max_body + 1024)
    r = app.router
    r.add_post("/topics", routes.create_topic)
    r.add_post("/topics/{topic}/messages", routes.publish)
    r.add_get("/topics/{topic}/subscribers", routes.list_subscribers)
    r.add_post("/topics/{topic}/subscribers", routes.add_subscribers)
    r.add_put("/topics/{topic}/subscribers/{name}", routes.put_subscriber)
    r.add_delete("/topics/{topic}/subscribers/{name}", routes.delete_subscriber)
    r.add_get("/topics/{topic}/subscribers/{name}", routes.read)
    r.add_delete("/topics/{topic}/subscribers/{name}/messages/{id}", routes.ack)
    r.add_delete("/topics/{topic}/subscribers/{name}/messages", routes.ack)
    r.add_post("/topics/{topic}/subscribers/{name}/acks", routes.ack)
    r.add_get("/topics/{topic}/subscribers/{name}/deadletters", routes.deadletters)
    r.add_post("/commands/{target}/{command}", routes.command)
    for path, handler in extra.items():
        r.add_get(path, handler)
    return app
