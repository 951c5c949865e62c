"""The receiver's side: dedupe, store, ack after the fsync, hand to the handlers, by
segment (model/segments.py).

A segment is acked only once it is durable here: stored as incoming in this turn's batch
(which is then fsynced) or already stored, handled or dead-lettered (a resend: acked
again, not handled again). One whose own fields are not valid (from an older or hostile
publisher) is stored as a dead letter instead, with its raw bytes, and acked the same
way: it alone, not its frame, is refused (DESIGN rule 11); a payload that does not decode
is a dead letter of its own when a handler would get it (handling/runner.py). Handled
segments are remembered for ``dedupe_window``, counted on the bus clock (clock.py), then
pruned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..wire import protocol as P
from ..model.letters import invalid_letter
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

    def _writers_only(self, ident: bytes, frame: P.Batch, user: str | None) -> P.Batch:
        """Channel roles (model/members.py): events and commands of a topic only from the
        services that may write it; the rest refused for good (dead letters at the sender).
        From a sender discovery does not know yet, held: neither acked nor refused (it
        sends them again), and the sender is asked who it is."""
        s = self.s
        service = s.service_of(frame.sender, user)
        allowed = s.channels.may_write
        denied = [env.id for env in frame.messages if not allowed(service, env.topic)]
        denied += [m.id for m in frame.invalid if m.topic is None or not allowed(service, m.topic)]
        if not denied:
            return frame
        if service is None and s.trust is None:
            s.counters["held_unknown_writer"] += len(denied)
            if frame.reply_to:
                s.hint(frame.reply_to)
        else:
            s.counters["refused_not_a_writer"] += len(denied)
            s.out.to_router.append((ident, P.encode_nack(denied, (
                f"service {service or '(unknown)'} may not write this topic here (channel roles)"))))
        return frame._replace(messages=tuple(e for e in frame.messages if allowed(service, e.topic)),
                              invalid=tuple(m for m in frame.invalid if m.topic is not None
                                            and allowed(service, m.topic)))

    def on_batch(self, ident: bytes, frame: P.Batch, source: str | None = None,
                 user: str | None = None) -> None:
        s = self.s
        kind = int(frame.kind)
        if kind == P.Kind.COMMAND:
            # A request's reply goes to reply_to: an address this bus would connect to.
            reason = s.address_refused(frame.reply_to, source, user) if frame.reply_to else None
            if reason is not None:
                s.count_refused(reason, frame.reply_to, source)
                ids = [env.id for env in frame.messages] + [m.id for m in frame.invalid] + [
                    key for key, _ids in frame.oversize if key not in {env.id for env in frame.messages}]
                s.out.to_router.append((ident, P.encode_nack(ids, (
                    f"reply address {frame.reply_to[:200]!r} refused: {reason}"))))
                return
            entry = s.entry_of(user)
            if entry is not None:
                allowed = entry.may_send
                denied = [env.id for env in frame.messages if not allowed(env.topic)]
                # One whose name is not even a str cannot be judged: refused.
                denied += [m.id for m in frame.invalid if m.topic is None or not allowed(m.topic)]
                if denied:
                    s.counters["refused_command_not_allowed"] += len(denied)
                    s.out.to_router.append((ident, P.encode_nack(denied, "command not allowed for this key")))
                    frame = frame._replace(
                        messages=tuple(e for e in frame.messages if allowed(e.topic)),
                        invalid=tuple(m for m in frame.invalid if m.topic is not None and allowed(m.topic)))
        if s.channels and kind != P.Kind.REPLY:
            frame = self._writers_only(ident, frame, user)
        batch, seen = s.out.batch, s.turn_ids
        acks = s.out.acks.setdefault(ident, [])
        stored = False
        for key, too_big in frame.oversize:  # by message, naming its segment
            s.out.to_router.append((ident, P.encode_nack(too_big, (
                f"payload larger than this bus's max_payload ({s.config.max_payload} bytes)"), key)))
            s.counters["refused_oversize"] += len(too_big)
        jon, ts, kname = s.events_on, s.wall(), KIND_NAMES[kind]
        jev = s.out.events  # appended to inline: this loop runs per received segment
        known = s.store.seen_many([env.id for env in frame.messages])
        # TTLs arrive in the sender's clock. What is left of them counts on ours from now
        # on: skew between the two machines does not shorten or stretch them.
        skew = 0 if frame.sent_at is None else ts - frame.sent_at
        handoff = s.out.handoff
        received = 0
        for env, was_seen in zip(frame.messages, known):
            if skew and env.expires is not None:
                # Within what a datetime shows (Message.expires), as it was sent (validation.MAX_MS).
                env = env._replace(expires=min(MAX_MS - 1, max(0, env.expires + skew)))
            key = env.id
            acks.append(key)
            count = len(env.ids) or 1
            received += count
            if was_seen or key in seen:
                # Stored (and fsynced) or handled already: ack again, do not handle again.
                s.counters["duplicates"] += count
                continue
            seen.add(key)
            record = incoming_record(kind, frame.sender, frame.reply_to, env)
            batch.put_incoming(key, record)
            handoff.append(_tuple(Incoming, (key, record, None, None)))
            stored = True
            if jon:
                jev.append(event("received", ts, key, env.topic, kname, frame.reply_to, env.attempt,
                                 None, env.ids or None))
        if frame.invalid:
            stored = self._set_apart(frame, acks) or stored
            received += sum(len(m.message_ids()) for m in frame.invalid)
        s.counters["received"] += received
        if stored:
            batch.sync = True  # the acks leave only after the fsync

    def _set_apart(self, frame: P.Batch, acks: list[str]) -> bool:
        """Segments of ``frame`` that no handler can be given: their own fields are not
        valid (an older or hostile sender: its header and blob bytes as they came, and
        which field is wrong). Each is one dead letter naming its messages, journaled as
        received and dead-lettered, and acked once that is fsynced, so that its sender stops
        resending it and an ordered subscription goes on past it. True if any was stored."""
        s = self.s
        kind = int(frame.kind)
        known = s.store.seen_many([m.id for m in frame.invalid])
        stored = False
        for message, was_seen in zip(frame.invalid, known):
            key = message.id
            acks.append(key)
            if was_seen or key in s.turn_ids:
                s.counters["duplicates"] += 1
                continue
            s.turn_ids.add(key)
            s.out.batch.put_deadletter(key, invalid_letter(kind, frame.sender, frame.reply_to, message))
            stored = True
            ids = message.message_ids()
            if s.events_on:
                ts, kname = s.wall(), KIND_NAMES[kind]
                peer = frame.reply_to
                s.event("received", ts, key, message.topic, kname, peer, 0, None, ids)
                s.event("deadlettered", ts, key, message.topic, kname, peer, 0, f"invalid: {message.error}", ids)
            total = s.tally(s.counters, "invalid", "invalid")
            if total is not None:
                log.error("dead letter: %s %s from %s: %s (%s); %d so far", message.topic, key,
                          frame.reply_to, _WHY["invalid"], message.error, total)
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
