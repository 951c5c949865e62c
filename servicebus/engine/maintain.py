"""Operations that change a running bus's store: replay and purge of dead letters, asked by
``Bus.replay``/``Bus.purge`` or by ``servicebus replay``/``purge`` over the admin endpoint.

They run on the engine thread, as one of its commands, between a turn's reads and its
commit: nothing the bus does races them (the core, the only other writer of delivery state,
waits for them; handlers never write dead letters' keys of a message that is a dead letter).
The same functions as the offline commands do the writes (ops/maintenance.py), with the
running bus's context: its hooks journal the events (the journal's thread moves them out as
any other), its id generator makes the new ids, and what was put back is told to the core
(messages owed again) and to the handlers (messages to run again) at once.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ..core import Published
from ..errors import StoreWriteError
from ..ops import maintenance as M

__all__ = ["Maintain", "OPS", "MEMBERS", "COUNTERS", "maintain"]

OPS = ("replay", "purge", "kick", "readmit")
# Asked by the admin endpoint's view thread (adminserve.py), never by a client: discovery's
# table as the core knows it now, for ``servicebus fleet`` (ops/fleet.py). Read-only.
MEMBERS = "members"
# Also the view thread's: the engine's counters since start (published, acked, handled...),
# for the status view, whose rates the console plots. Read-only.
COUNTERS = "counters"


@dataclass
class Maintain:
    """``op`` (one of OPS) of the dead letters ``args`` select: ``ids`` (None: any),
    ``topic``, ``reason``; for replay, ``payload`` (present: any value msgpack encodes, None
    too) replays the one letter ``ids`` names with it instead of its own payload. ``strict``: an id named that is no dead letter fails the call
    (``ValueError``) before anything changes (the API); otherwise it is reported (the CLI).
    The future gets replay's report rows, or for purge ``[{"removed": {"deadletters": n},
    "missing": [ids]}]``."""

    op: str
    args: dict
    future: Future
    strict: bool = False


def _selection(args: dict) -> tuple[list[str] | None, str | None, str | None]:
    ids, topic, reason = args.get("ids"), args.get("topic"), args.get("reason")
    if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, str) for i in ids)):
        raise ValueError(f"ids must be a list of message ids, not {ids!r}")
    for name, value in (("topic", topic), ("reason", reason)):
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{name} must be a str, not {value!r}")
    return ids, topic, reason  # ids []: no letter (None: any)


def maintain(engine: Any, cmd: Maintain, now: float, degraded: str | None) -> None:
    """Run ``cmd`` on the engine thread and release its caller. ``engine``: loop.py's
    ``Engine`` (its store, core, hooks, ids and dispatcher; not imported: it imports this)."""
    if cmd.op == MEMBERS:  # reads the core only: answered at once, degraded or not
        members = engine.core.members
        cmd.future.set_result([{"on": members.on, "rows": members.view(now) if members.on else []}])
        return
    if cmd.op == COUNTERS:
        cmd.future.set_result([engine._snapshot(now)["counters"]])
        return
    try:
        if degraded is not None:
            raise StoreWriteError(f"the store cannot be written: {degraded}")
        rows = _run(engine, cmd, now)
        if cmd.op in ("kick", "readmit"):  # released once the turn's batch is written
            engine.core.s.out.release.append((cmd.future, rows))
            return
    except Exception as exc:  # noqa: BLE001 - the caller's error, not the engine's
        if not cmd.future.done():
            cmd.future.set_exception(exc)
        return
    if not cmd.future.done():
        cmd.future.set_result(rows)


def _run(engine: Any, cmd: Maintain, now: float) -> list[dict[str, Any]]:
    if cmd.op == "seeds":  # from the bus's seed finder (seeds.py), not the admin endpoint
        engine.core.members.set_seeds(list(cmd.args["addresses"]))
        return []
    if cmd.op not in OPS:
        raise ValueError(f"no such operation: {cmd.op!r}")
    if cmd.op in ("kick", "readmit"):  # discovery's (core/members.py): in the turn's batch
        target, why = cmd.args.get("target"), cmd.args.get("why") or ""
        if not isinstance(target, str) or not target or not isinstance(why, str):
            raise ValueError("kick and readmit need a target: a service name, node id or address")
        core = engine.core
        if cmd.op == "kick":
            return [core.members.kick(target, why[:500], core.handshake)]
        return [core.members.readmit(target)]
    ids, topic, reason = _selection(cmd.args)
    body = None
    if cmd.op == "replay" and "payload" in cmd.args:  # an edit: encoded and checked as a publish's
        M.check_edit(ids, topic, reason)
        body = M.edited_body(cmd.args["payload"], engine.config.max_payload)
    store = engine.store
    if cmd.strict and ids:
        _letters, missing = M.select_letters(store, ids, None, None)
        if missing:
            raise ValueError(f"no such dead letter: {', '.join(missing)}; nothing was done")
    consumers = engine.core.s.consumers
    context = M.Context(engine.hooks.events, engine.ids, known=lambda peer, stream: (peer, stream) in consumers)
    if cmd.op == "purge":
        removed, missing = M.purge_letters(store, ids, topic, reason, context=context)
        return [{"removed": {"deadletters": removed}, "missing": missing}]
    rows = M.replay(store, ids, topic, reason=reason, context=context, body=body)
    for stream, key, record in context.outgoing:  # owed again: the core sends them
        engine.core.command(Published(stream, [(key, record, 1)]), now)
    if context.incoming:  # to run again: the handlers read them from the store
        engine.dispatcher.runner.writer.forget(context.incoming)  # their last write is done with
        threading.Thread(target=engine.dispatcher.refill, name="servicebus-refill", daemon=True).start()
    return rows
