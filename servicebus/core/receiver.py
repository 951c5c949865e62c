"""The receiver's side: dedupe, store, ack after the fsync, hand to the handlers.

A message is acked only once it is durable here: stored as incoming in this turn's batch
(which is then fsynced) or already stored, handled or dead-lettered (a resend: acked
again, not handled again). One whose payload does not decode or whose own fields are not
valid (from an older or hostile publisher) is stored as a dead letter instead, with its raw
bytes, and acked the same way: it alone, not its frame, is refused (DESIGN rule 11). Handled ids are remembered for
``dedupe_window``, counted on the bus clock (clock.py), then pruned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..wire import protocol as P
from ..model.letters import incoming_letter, invalid_letter
from ..model.stored import event
from ..wire.protocol import KIND_NAMES
from ..wire.validation import MAX_MS
from .state import Incoming, State, incoming_record

log = logging.getLogger("servicebus")

__all__ = ["Receiver", "PRUNE_BATCH"]

_tuple = tuple.__new__  # a NamedTuple without its keyword-parsing __new__: runs per message
PRUNE_BATCH = 10_000  # handled ids past the dedupe window deleted per turn, at most
_WHY = {"undecodable": "its payload does not decode", "invalid": "its fields are not valid"}


class Receiver:
    def __init__(self, state: State) -> None:
        self.s = state

    def on_batch(self, ident: bytes, frame: P.Batch, source: str | None = None,
                 user: str | None = None) -> None:
        s = self.s
        kind = int(frame.kind)
        if kind == P.Kind.COMMAND:
            # A request's reply goes to reply_to: an address this bus would connect to.
            reason = s.address_refused(frame.reply_to, source, user) if frame.reply_to else None
            if reason is not None:
                s.count_refused(reason, frame.reply_to, source)
                ids = [env.id for env in frame.messages] + list(frame.oversize) + [
                    env.id for env, _ in frame.undecodable] + [m.id for m in frame.invalid]
                s.out.to_router.append((ident, P.encode_nack(ids, (
                    f"reply address {frame.reply_to[:200]!r} refused: {reason}"))))
                return
            entry = s.entry_of(user)
            if entry is not None:
                allowed = entry.may_send
                denied = [env.id for env in frame.messages if not allowed(env.topic)]
                denied += [env.id for env, _ in frame.undecodable if not allowed(env.topic)]
                # One whose name is not even a str cannot be judged: refused.
                denied += [m.id for m in frame.invalid if m.topic is None or not allowed(m.topic)]
                if denied:
                    s.counters["refused_command_not_allowed"] += len(denied)
                    s.out.to_router.append((ident, P.encode_nack(denied, "command not allowed for this key")))
                    frame = frame._replace(
                        messages=tuple(e for e in frame.messages if allowed(e.topic)),
                        undecodable=tuple(u for u in frame.undecodable if allowed(u[0].topic)),
                        invalid=tuple(m for m in frame.invalid if m.topic is not None and allowed(m.topic)))
        batch, seen = s.out.batch, s.turn_ids
        acks = s.out.acks.setdefault(ident, [])
        stored = False
        if frame.oversize:
            s.out.to_router.append((ident, P.encode_nack(frame.oversize, (
                f"payload larger than this bus's max_payload ({s.config.max_payload} bytes)"))))
            s.counters["refused_oversize"] += len(frame.oversize)
        jon, ts, kname = s.events_on, s.wall(), KIND_NAMES[kind]
        jev = s.out.events  # appended to inline: this loop runs per received message
        known = s.store.seen_many([env.id for env in frame.messages])
        # TTLs arrive in the sender's clock. What is left of them counts on ours from now
        # on: skew between the two machines does not shorten or stretch them.
        skew = 0 if frame.sent_at is None else ts - frame.sent_at
        handoff = s.out.handoff
        for env, was_seen in zip(frame.messages, known):
            if skew and env.expires is not None:
                # Within what a datetime shows (Message.expires), as it was sent (validation.MAX_MS).
                env = env._replace(expires=min(MAX_MS - 1, max(0, env.expires + skew)))
            mid = env.id
            acks.append(mid)
            if was_seen or mid in seen:
                # Stored (and fsynced) or handled already: ack again, do not handle again.
                s.counters["duplicates"] += 1
                continue
            seen.add(mid)
            record = incoming_record(kind, frame.sender, frame.reply_to, env)
            batch.put_incoming(mid, record)
            handoff.append(_tuple(Incoming, (mid, record, None)))
            stored = True
            if jon:
                jev.append(event("received", ts, mid, env.topic, kname, frame.reply_to, env.attempt))
        if frame.undecodable or frame.invalid:
            stored = self._set_apart(frame, acks) or stored
        s.counters["received"] += len(frame.messages) + len(frame.undecodable) + len(frame.invalid)
        if stored:
            batch.sync = True  # the acks leave only after the fsync

    def _set_apart(self, frame: P.Batch, acks: list[str]) -> bool:
        """Messages of ``frame`` that no handler can be given: a payload that does not
        decode (``undecodable``: the message's record kept, raw payload and all, and
        msgpack's error) or fields that are not valid (``invalid``: its header and payload
        bytes as they came, and which field is wrong). Each is a dead letter, journaled as
        received and dead-lettered, and acked once that is fsynced, so that its sender stops
        resending it and an ordered subscription goes on past it. True if any was stored."""
        s = self.s
        kind = int(frame.kind)
        apart: list[tuple[str, str | None, int, str, str, P.Envelope | P.Invalid]] = [
            (env.id, env.topic, env.attempt, "undecodable", error, env) for env, error in frame.undecodable]
        apart += [(m.id, m.topic, 0, "invalid", m.error, m) for m in frame.invalid]
        known = s.store.seen_many([mid for mid, *_ in apart])
        stored = False
        for (mid, topic, attempt, reason, error, message), was_seen in zip(apart, known):
            acks.append(mid)
            if was_seen or mid in s.turn_ids:
                s.counters["duplicates"] += 1
                continue
            s.turn_ids.add(mid)
            if isinstance(message, P.Invalid):
                letter = invalid_letter(kind, frame.sender, frame.reply_to, message)
            else:
                letter = incoming_letter(reason, error, 0, incoming_record(
                    kind, frame.sender, frame.reply_to, message))
            s.out.batch.put_deadletter(mid, letter)
            stored = True
            if s.events_on:
                ts, kname = s.wall(), KIND_NAMES[kind]
                peer = frame.reply_to
                s.event("received", ts, mid, topic, kname, peer, attempt)
                s.event("deadlettered", ts, mid, topic, kname, peer, 0, f"{reason}: {error}")
            total = s.tally(s.counters, reason, reason)
            if total is not None:
                log.error("dead letter: %s %s from %s: %s (%s); %d so far", topic, mid, frame.reply_to,
                          _WHY[reason], error, total)
        return stored

    def prune_publish_keys(self) -> bool:
        """Forget publish dedupe keys older than ``publish_dedupe_window`` (bus clock, from
        when they were stored). True if there may be more to prune."""
        s = self.s
        return self._prune(s.config.publish_dedupe_window, s.store.publish_keys_before,
                           lambda key, at: s.out.batch.forget_publish_key(key, at)) >= PRUNE_BATCH

    def prune_handled(self) -> bool:
        """Forget handled ids older than the dedupe window, counted on the bus clock from
        when they were handled (not from the sender's id time, nor on the wall clock: a
        clock stepped forward must not forget ids whose resends may still come). True if
        there may be more to prune."""
        s = self.s
        pruned = self._prune(s.config.dedupe_window, s.store.handled_before,
                             lambda mid, at: s.out.batch.forget_handled(mid, at))
        s.counters["dedupe_pruned"] += pruned
        return pruned >= PRUNE_BATCH

    def _prune(self, window: float, before: Callable[[int, int], list[tuple[str, int]]],
               forget: Callable[[str, int], None]) -> int:
        """Forget up to PRUNE_BATCH entries stamped more than ``window`` seconds ago on the
        bus clock; return how many."""
        cutoff = self.s.clock.now() - int(window * 1000)
        if cutoff <= 0:
            return 0
        due = before(cutoff, PRUNE_BATCH)
        for name, at in due:
            forget(name, at)
        return len(due)
