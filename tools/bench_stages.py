"""Per-stage latency of servicebus for ``tools/bench`` (the ``latency-stages`` scenario).

The bench's publisher and subscriber processes install probes here: thin wrappers around
the bus's own functions that note ``time.monotonic_ns()`` (one clock for every process of
the machine) when a message passes a stage boundary. The library carries no probe code;
the wrappers cost about a microsecond each, so this run's total is a little above the
plain ``latency`` scenario's.

One message is in flight at a time, so each stage event belongs to the last publish call
before it. ``breakdown`` turns the two processes' events into the median of each stage.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

__all__ = ["STAGES", "install", "breakdown"]

# (name, from event, to event): the path of one message, in order. "pub.stored" and
# "sub.stored" end the first write of each side (the publish, the receipt): unsynced since
# store format 3 (the engine sends, the handlers start, while the fsync runs), the synced
# one before it (a --baseline run of older code).
STAGES = [
    ("publish: build + write to LevelDB", "pub.call", "pub.stored"),
    ("written -> engine takes it", "pub.stored", "pub.engine"),
    ("engine: window -> frames -> send", "pub.engine", "pub.send"),
    ("wire + subscriber wakes", "pub.send", "sub.recv"),
    ("subscriber: recv + decode", "sub.recv", "sub.core"),
    ("subscriber: core takes the frame", "sub.core", "sub.core_done"),
    ("subscriber: -> prepare", "sub.core_done", "sub.prepare"),
    ("subscriber: prepare", "sub.prepare", "sub.prepared"),
    ("subscriber: journal + batch + write", "sub.prepared", "sub.stored"),
    ("subscriber: written -> hand-off", "sub.stored", "sub.handoff"),
    ("hand-off -> handler starts", "sub.handoff", "sub.handler"),
]
# Beside the path: the publisher's fsync and its call's return, which a message's delivery
# no longer waits for (shown, not added to the total).
BESIDE = [
    ("publisher fsync (beside the path)", "pub.sync", "pub.synced"),
    ("subscriber fsync (beside the path since format 3)", "sub.sync", "sub.synced"),
    ("publish call -> it returns", "pub.call", "pub.returned"),
]

events: list[tuple[str, int]] = []
_now = time.monotonic_ns


def _wrap(owner: Any, name: str, before: str | None = None, after: str | None = None,
          when: Callable[..., bool] = lambda *a, **k: True) -> None:
    original = getattr(owner, name)

    def probe(*args: Any, **kwargs: Any) -> Any:
        hit = when(*args, **kwargs)
        if hit and before:
            events.append((before, _now()))
        out = original(*args, **kwargs)
        if hit and after:
            events.append((after, _now()))
        return out

    setattr(owner, name, probe)


def _find(*names: str) -> Any:
    """The first of ``module:attribute`` names that imports: a ``--baseline`` run probes a
    tree of another layout (before issue 27 the modules were flat in servicebus/)."""
    import importlib

    for name in names:
        module, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"none of {names} imports")


def install(side: str) -> None:
    """Probe this process's bus classes: ``side`` is "pub" or "sub"."""
    Published = _find("servicebus.core:Published")
    Core = _find("servicebus.core.machine:Core")
    Dispatcher = _find("servicebus.handling.dispatch:Dispatcher", "servicebus.dispatch:Dispatcher")
    reader, read = _find("servicebus.engine.peerio:PeerIO", "servicebus.engine:Engine"), "read_router"
    if not hasattr(reader, read):  # before issue 27 the engine read its router itself
        read = "_read_router"
    Sockets = _find("servicebus.engine.sockets:Sockets", "servicebus.sockets:Sockets")
    Store = _find("servicebus.store:Store")
    publisher = _find("servicebus.engine.publisher:Publisher", "servicebus.engine:Engine")

    synced = lambda self, batches, sync, **kw: sync  # noqa: E731 - only the fsynced writes
    if side == "pub":
        _wrap(Store, "_writing", None, "pub.stored")  # the first after the call is the publish's
        _wrap(Store, "_writing", "pub.sync", "pub.synced", when=synced)
        _wrap(publisher, "publish", "pub.call", "pub.returned")
        _wrap(Core, "command", "pub.engine", when=lambda self, cmd, now: isinstance(cmd, Published))
        _wrap(Sockets, "send_peer", "pub.send")
    else:
        _wrap(Store, "_writing", None, "sub.stored")  # the first after the frame came: its receipt
        _wrap(Store, "_writing", "sub.sync", "sub.synced", when=synced)
        _wrap(reader, read, "sub.recv")
        _wrap(Core, "on_router", "sub.core", "sub.core_done")
        _wrap(Core, "prepare", "sub.prepare", "sub.prepared")
        _wrap(Dispatcher, "submit", "sub.handoff")


def handler_started() -> None:
    events.append(("sub.handler", _now()))


def breakdown(pub_events: list[tuple[str, int]], sub_events: list[tuple[str, int]]) -> dict:
    """Median microseconds of each stage over every message that passed all of them."""
    merged = sorted(pub_events + sub_events, key=lambda e: e[1])
    per_message: list[dict[str, int]] = []
    for name, t in merged:
        if name == "pub.call":
            per_message.append({name: t})
        elif per_message and name not in per_message[-1]:
            # The first of each event after the publish call: later ones are acks' writes,
            # pings, the next turn's sends.
            if name.startswith("sub.") and "pub.send" not in per_message[-1]:
                continue  # a subscriber event before this message was sent is not its own
            per_message[-1][name] = t
    out: dict[str, float] = {}
    complete = [m for m in per_message if all(a in m and b in m for _, a, b in STAGES)
                and all(m[a] <= m[b] for _, a, b in STAGES)]
    for label, a, b in STAGES:
        out[label] = statistics.median((m[b] - m[a]) / 1000 for m in complete) if complete else 0.0
    for label, a, b in BESIDE:
        spans = [(m[b] - m[a]) / 1000 for m in complete if a in m and b in m and m[a] <= m[b]]
        out[label] = statistics.median(spans) if spans else 0.0
    out["total: publish call -> handler starts"] = (
        statistics.median((m["sub.handler"] - m["pub.call"]) / 1000 for m in complete) if complete else 0.0)
    out["messages"] = len(complete)
    return out
