"""Subscriptions asked of a service by name, and kicks (sans I/O; core/members.py's).

``subscribe("orders", topic)`` is stored as an intent to ``svc:orders``; every instance of
``orders`` that discovery has confirmed (heard first hand) gets an intent of its own,
stored and retried as any other, marked with the service it was asked of (``via``), so
that one that moves is asked again where it went, and one that appears later is asked too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

from ..model.members import SERVICE, Member
from ..model.stored import IntentRecord
from .commands import SubscribeCmd
from .handshake import Handshake
from .peers import Roster
from .proofs import MAX_ANSWERED
from .state import Intent, State

__all__ = ["ServiceIntents", "Instances", "Known", "load_table", "stored_table", "pick_instance"]

log = logging.getLogger("servicebus")


@dataclass(eq=False)
class Known:
    member: Member
    heard: float  # our monotonic clock when its (epoch, beat) last grew
    up: bool
    since: int  # wall ms it went up or down
    via: str | None = None  # the source host of its own last gossip (first hand)
    confirmed: bool = False  # heard first hand at least once
    proof: str | None = None  # what it proves itself with (trust on first use)
    probed: float = -1e9  # when we last asked it (not confirmed yet, or a hinted address)


def load_table(d: Any, stored: dict[str, Any] | None, wall: int) -> None:
    """``Directory.load``: the table as the bus left it (all down until they gossip again)."""
    if not stored:
        d.dirty = True  # the secret, at least
        return
    d.kicked = dict(stored.get("kicked") or {})
    answered = stored.get("answered")
    if isinstance(answered, dict):
        d.answered = {a: n for a, n in list(answered.items())[:MAX_ANSWERED]
                      if isinstance(a, str) and isinstance(n, str)}
    if isinstance(stored.get("secret"), bytes) and len(stored["secret"]) == 16:
        d.secret = stored["secret"]
    else:
        d.dirty = True
    for entry in stored.get("members") or []:
        try:
            member = Member.from_wire(entry, lambda a: a if isinstance(a, str) else "")
        except (TypeError, ValueError):
            continue
        if member.node != d.s.node_id:
            d.known[member.node] = Known(member, 0.0, False, int(entry.get("since") or wall), entry.get("via"),
                                         bool(entry.get("confirmed", True)), entry.get("proof"))
        elif member.address != d.s.address:
            d.moved = True  # tell everyone we knew at once: what they owe us follows
            log.info("this bus moved from %s to %s: telling the instances it knows", member.address, d.s.address)
    for k in d.known.values():
        if k.confirmed:
            d._vouch(k, False)


def pick_instance(d: Any, name: str, turn: int) -> str:
    """``Directory.pick``: the address of one instance of ``name`` for a command or
    request: of those up, the ones heard from within two gossip intervals (else any up),
    in turn; if none is up, the one heard from last. ``ValueError`` if none is known."""
    found = [k for k in d.known.values() if k.confirmed and k.member.name == name]
    if not found:
        raise ValueError(f"no instance of service {name!r} is known (yet): give this bus a seed "
                         "(Bus(seeds=[...])) or wait until discovery finds one")
    up = sorted((k for k in found if k.up), key=lambda k: k.member.node)
    fresh = [k for k in up if d.s.now - k.heard <= 2 * d.s.config.gossip_interval]
    if fresh or up:
        chosen = fresh or up
        return str(chosen[turn % len(chosen)].member.address)
    return str(max(found, key=lambda k: k.heard).member.address)


def stored_table(d: Any) -> dict[str, Any]:
    members = [d.me().wire()] if d.name else []
    for k in d.known.values():
        members.append({**k.member.wire(), "since": k.since, "via": k.via, "up": k.up,
                        "confirmed": k.confirmed, "proof": k.proof})
    return {"members": members, "kicked": d.kicked, "secret": d.secret, "answered": d.answered}


class Instances(Protocol):
    def addresses(self, service: str) -> list[str]: ...


class ServiceIntents:
    def __init__(self, state: State, roster: Roster, handshake: Handshake, instances: Instances) -> None:
        self.s = state
        self.roster = roster
        self.handshake = handshake
        self.instances = instances
        self.wanted: dict[tuple[str, str], Intent] = {}  # (service, topic) -> what was asked

    def load(self, service: str, topic: str, record: IntentRecord) -> None:
        self.wanted[(service, topic)] = Intent(SERVICE + service, topic, record["op"], record["id"], True,
                                               group=record.get("group"), ordered=bool(record.get("ordered")),
                                               limit=record.get("limit"), start=record.get("start"))

    def topics(self) -> set[str]:
        return {topic for _service, topic in self.wanted}

    def subscribe(self, cmd: SubscribeCmd) -> None:
        s = self.s
        service = cmd.publisher[len(SERVICE):]
        key = (service, cmd.topic)
        if cmd.op == "unsubscribe":
            self.wanted.pop(key, None)
            s.out.batch.delete_intent(cmd.publisher, cmd.topic)
            for (publisher, topic), intent in list(s.intents.items()):
                if topic == cmd.topic and intent.via == service and intent.op == "subscribe":
                    self.handshake.subscribe(SubscribeCmd(publisher, topic, "unsubscribe", None, cmd.confirmed))
        else:
            intent = Intent(cmd.publisher, cmd.topic, "subscribe", s.ids.next(), True, group=cmd.group,
                            ordered=cmd.ordered, limit=cmd.limit, start=cmd.start)
            intent.waiters = [cmd.confirmed] if cmd.confirmed is not None else []
            self.wanted[key] = intent
            s.out.batch.put_intent(cmd.publisher, cmd.topic, intent.record(s.wall()))
            # Asked again (a service calls subscribe at every start): every instance is
            # asked again too, as a subscribe by address is, so a publisher that ended the
            # subscription meanwhile (a kick, then readmit) makes it again.
            self.resolve(service, again=cmd.topic)
        s.out.batch.sync = True
        s.out.release.append((cmd.future, True))

    def resolve(self, service: str, again: str | None = None) -> None:
        """Give every confirmed instance of ``service`` the subscriptions asked of it."""
        s = self.s
        addresses = [a for a in self.instances.addresses(service) if a not in s.own]
        for (name, topic), wanted in self.wanted.items():
            if name != service:
                continue
            for address in addresses:
                have = s.intents.get((address, topic))
                if have is not None and have.op == "subscribe" and topic != again:
                    have.waiters.extend(wanted.waiters)
                    continue
                try:
                    self.handshake.subscribe(SubscribeCmd(address, topic, "subscribe", None, None, wanted.group,
                                                          wanted.ordered, wanted.limit, wanted.start), via=name)
                except ValueError as exc:
                    log.error("cannot subscribe to %s at %s (instance of %s): %s", topic, address, name, exc)
                    continue
                s.intents[(address, topic)].waiters.extend(wanted.waiters)
            if addresses:
                wanted.waiters = []

    def moved(self, old: str, new: str) -> None:
        """Our subscriptions to an instance that moved: asked again at its new address
        (it has them stored: a repeat, acked at once); the old ones forgotten here, not
        unsubscribed (the address is not that instance's any more)."""
        s = self.s
        for (publisher, topic), intent in list(s.intents.items()):
            if publisher != old:
                continue
            del s.intents[(publisher, topic)]
            s.intent_ids.pop(intent.id, None)
            s.out.batch.delete_intent(publisher, topic)
            if intent.op == "subscribe" and (new, topic) not in s.intents:
                self.handshake.subscribe(SubscribeCmd(new, topic, "subscribe", None, None, intent.group,
                                                      intent.ordered, intent.limit, intent.start), via=intent.via)
        self.roster.drop_if_unused(old)


def fleet_view(d: Any, now: float) -> list[dict[str, Any]]:
    """``Bus.fleet()``: this bus first (if it has a name), then every confirmed instance."""
    rows = []
    if d.name:
        rows.append({**d.me().wire(), "up": True, "since": None, "self": True})
    for k in d.known.values():
        if k.confirmed:
            rows.append({**k.member.wire(), "up": k.up, "since": k.since, "via": k.via,
                         "silent": None if not k.heard else round(now - k.heard, 3),
                         "kicked": d.is_kicked(k.member.node, k.member.address)})
    return rows


def kick_target(d: Any, target: str, why: str, handshake: Handshake) -> dict[str, Any]:
    """``Directory.kick``: ``target`` an instance's node id or address, or a service."""
    confirmed = [k for k in d.known.values() if k.confirmed]
    found = [k for k in confirmed if target in (k.member.node, k.member.address)]
    service = target if any(k.member.name == target for k in confirmed) else None
    done = kick(d.s, handshake, d.kicked, target, why, {k.member.node for k in found}, service)
    for k in found:  # kicked by address: its node is refused too, wherever it moves
        d.kicked.setdefault(k.member.node, d.kicked[done["kicked"]])
    d.dirty = True
    d.save()
    return done


def readmit(d: Any, target: str) -> dict[str, Any]:
    nodes = {k.member.node for k in d.known.values() if target in (k.member.node, k.member.address)}
    found = [key for key in (target, SERVICE + target, *nodes) if key in d.kicked]
    for key in found:
        del d.kicked[key]
    if not found:
        raise ValueError(f"{target!r} is not kicked")
    d.dirty = True
    d.save()
    d.s.out.batch.sync = True
    return {"readmitted": found}


def kick(s: State, handshake: Handshake, kicked: dict[str, str], target: str, why: str,
         nodes: set[str], service: str | None) -> dict[str, Any]:
    """End the subscriptions of ``target`` (an address, the instances ``nodes``, or every
    instance of ``service``) at this publisher, what they were owed dropped (journaled
    ``dropped``, reason ``kicked: why``); their subscribes are refused until readmitted."""
    if not nodes and service is None and not any(target == addr or target == rec.get("node")
                                                 for (addr, _t), rec in s.subscriptions.items()):
        raise ValueError(f"{target!r} is no instance, address or service this bus knows")
    key = SERVICE + service if service else target
    kicked[key] = why or "kicked by an operator"
    ended = []
    for (address, topic), record in list(s.subscriptions.items()):
        node = str(record.get("node"))
        if address == target or node in nodes or node == target or \
                (service is not None and s.services.get(node) == service):
            handshake.end(address, topic, f"kicked: {kicked[key]}")
            ended.append({"subscriber": address, "topic": topic})
    s.out.batch.sync = True
    log.warning("kicked %s (%s): %d subscriptions ended", target, kicked[key], len(ended))
    return {"kicked": key, "why": kicked[key], "ended": ended}


def is_kicked(s: State, kicked: dict[str, str], node: str, address: str) -> str | None:
    if not kicked:
        return None
    for key in (node, address):
        if key in kicked:
            return kicked[key]
    name = s.services.get(node)
    return None if name is None else kicked.get(SERVICE + name)
