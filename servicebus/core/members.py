"""Discovery and services by name, in the core (sans I/O; the entries: model/members.py).

Every ``gossip_interval`` this bus raises its beat and sends what it knows (itself and the
instances it sees up) to one instance it knows, to its seeds until they answer, and, for a
while after its own address changed, to every instance it knows; the one asked answers with
its own table. An instance whose (epoch, beat) stops growing for ``down_after`` seconds of
our clock is down; it stays in the table (stored, so a restart needs no seed) until
forgotten.

What is believed from whom:
- an instance's **address** only from the instance itself (the gossip frame is its own,
  and the address is on the host the frame came from, or, with CURVE, the frame's key is
  the entry's): nobody can move another instance's backlog by announcing an address.
  Such an address is *vouched*: a subscribe or request naming it is allowed without
  ``allow_peers`` (State.address_refused);
- a **new instance** from anyone (that is how a fleet spreads), a ``tcp://`` address only;
  with CURVE only an entry whose key peers.toml lists with the right to that name;
- with CURVE, a name only from a key allowed it (peers.toml ``names``).

When an instance's address changes, what is owed to it follows: its subscriptions, their
cursors and backlogs, and the commands queued for it move to the new address
(``Roster.move``); this bus's subscriptions to it are asked again at the new address.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, replace
from typing import Any

from ..model.members import MAX_MEMBERS, SERVICE, Member
from ..model.packer import pack
from ..model.stored import IntentRecord
from ..wire import protocol as P
from ..wire.validation import validate_address
from .commands import SubscribeCmd
from .handshake import Handshake
from .peers import Roster
from .state import Intent, State

__all__ = ["Directory", "Known"]

log = logging.getLogger("servicebus")

VERSION = "0.3"


@dataclass(eq=False)
class Known:
    member: Member
    heard: float  # our monotonic clock when its (epoch, beat) last grew
    up: bool
    since: int  # wall ms it went up or down
    via: str | None = None  # the source host of its own last gossip (first hand)


class Directory:
    def __init__(self, state: State, roster: Roster, handshake: Handshake, epoch: int) -> None:
        self.s = state
        self.roster = roster
        self.handshake = handshake
        cfg = state.config
        self.name: str | None = cfg.name
        self.epoch = epoch
        self.beat = 0
        self.known: dict[str, Known] = {}
        self.seeds: tuple[str, ...] = tuple(s for s in cfg.seeds if s.startswith("tcp://"))
        self.heard_seeds: set[str] = set()
        self.on = bool(self.name or cfg.seeds)
        self.next_gossip = 0.0
        self.announce_until = 0.0
        self.moved = False  # this bus listens elsewhere than at its last start
        self.dirty = False
        self.kicked: dict[str, str] = {}  # node id or "svc:<name>" -> why (servicebus fleet kick)
        self.name_intents: dict[tuple[str, str], Intent] = {}  # (service, topic) -> intent
        self._turn = 0

    # --- the table -----------------------------------------------------------------------

    def load(self, stored: dict[str, Any] | None, wall: int) -> None:
        """The table as the bus left it (all down until they gossip again)."""
        if not stored:
            return
        self.kicked = dict(stored.get("kicked") or {})
        for entry in stored.get("members") or []:
            try:
                member = Member.from_wire(entry, lambda a: a if isinstance(a, str) else "")
            except (TypeError, ValueError):
                continue
            if member.node != self.s.node_id:
                self.known[member.node] = Known(member, 0.0, False, int(entry.get("since") or wall),
                                                entry.get("via"))
            elif member.address != self.s.address:
                # We moved: tell everyone we knew at once, so that what they owe us follows.
                self.moved = True
                log.info("this bus moved from %s to %s: telling the %d instances it knows",
                         member.address, self.s.address, len(stored.get("members") or []) - 1)
        for k in self.known.values():
            self.s.services[k.member.node] = k.member.name
            if k.via is not None:
                self.s.vouched[k.member.address] = (k.via, k.member.key)

    def stored(self) -> dict[str, Any]:
        members = [self.me().wire()] if self.name else []
        for k in self.known.values():
            members.append({**k.member.wire(), "since": k.since, "via": k.via, "up": k.up})
        return {"members": members, "kicked": self.kicked}

    def me(self) -> Member:
        s = self.s
        publishes = sorted({topic for _addr, topic in s.subscriptions} | set(s.routes.retention.rules))
        subscribes = sorted({topic for _p, topic in s.intents} | {t for _n, t in self.name_intents})
        key = s.trust.public.decode() if s.trust is not None else None
        return Member(s.node_id, self.name or "", s.address, self.epoch, self.beat, key,
                      tuple(publishes[:200]), tuple(subscribes[:200]), VERSION)

    def instances(self, name: str) -> list[Known]:
        return [k for k in self.known.values() if k.member.name == name]

    def pick(self, name: str) -> str:
        """The address of one instance of ``name`` for a command or request: an instance
        that is up, in turn (round robin); if none is, the one heard from last.
        ``ValueError`` if none is known."""
        found = self.instances(name)
        if not found:
            raise ValueError(f"no instance of service {name!r} is known (yet): give this bus a seed "
                             "(Bus(seeds=[...])) or wait until discovery finds one")
        up = sorted((k for k in found if k.up), key=lambda k: k.member.node)
        if up:
            self._turn += 1
            return up[self._turn % len(up)].member.address
        return max(found, key=lambda k: k.heard).member.address

    # --- gossip ----------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        if not self.on or now < self.next_gossip:
            return
        s = self.s
        self.next_gossip = now + s.config.gossip_interval
        self.beat += 1
        if self.moved:
            self.moved, self.announce_until, self.dirty = False, now + s.config.down_after, True
        for k in self.known.values():
            if k.up and now - k.heard > s.config.down_after:
                k.up, k.since = False, s.wall()
                self.dirty = True
                log.info("instance %s of %s at %s is down (no gossip for %.1fs)", k.member.node,
                         k.member.name, k.member.address, now - k.heard)
        targets: set[str] = set()
        up = [k for k in self.known.values() if k.up]
        down = [k for k in self.known.values() if not k.up]
        if up:
            targets.add(random.choice(up).member.address)
        if down and (not up or self.beat % 5 == 0):
            targets.add(random.choice(down).member.address)  # to find them again after a cut
        targets.update(seed for seed in self.seeds if seed not in self.heard_seeds)
        if now < self.announce_until:
            targets.update(k.member.address for k in self.known.values())
        frames = P.encode_gossip(s.node_id, self.table())
        for address in targets:
            if address in s.own:
                continue
            try:
                peer = self.roster.peer(address)
            except ValueError as exc:
                log.debug("not gossiping to %s: %s", address, exc)
                continue
            self.roster.send(peer, frames)
        s.counters["gossip_sent"] += len(targets)
        self.save()

    def save(self) -> None:
        """Store the table if it changed (in the turn's batch: a meta record, no fsync of
        its own; a crash that loses it loses what the next gossip tells again)."""
        if self.dirty:
            self.dirty = False
            self.s.out.batch.put_meta("members", pack(self.stored()))

    def set_seeds(self, addresses: list[str]) -> None:
        """The seeds as found now (engine/seeds.py: DNS, mDNS, and the static ones)."""
        found = []
        for address in addresses:
            try:
                found.append(validate_address(address, what="seed"))
            except ValueError as exc:
                log.warning("ignoring seed %r: %s", address[:200], exc)
        new = [a for a in found if a not in self.seeds]
        self.seeds = tuple(found)
        if new:
            self.next_gossip = 0.0  # ask them now
            log.info("new seeds: %s", ", ".join(new))

    def peer_up(self, address: str) -> None:
        """A connection just answered: a seed that did is asked at once."""
        if address in self.seeds and address not in self.heard_seeds:
            self.next_gossip = 0.0

    def table(self) -> list[dict[str, Any]]:
        out = [self.me().wire()] if self.name else []
        out += [k.member.wire() for k in self.known.values() if k.up][:MAX_MEMBERS - 1]
        return out

    def on_gossip(self, frame: P.Gossip, now: float, source: str | None, user: str | None,
                  ident: bytes | None = None, address: str | None = None) -> None:
        """Gossip to our ROUTER (``ident``: answered with our table) or an answer on our
        connection to ``address``."""
        s = self.s
        s.counters["gossip_received"] += 1
        if address is not None:
            self.heard_seeds.add(address)
        for member in frame.members:
            if member.node == s.node_id:
                continue
            self._merge(member, member.node == frame.sender, now, source, user, address)
        if ident is not None and not frame.reply:
            s.out.to_router.append((ident, P.encode_gossip(s.node_id, self.table(), reply=True)))
        self.save()

    def _refuse(self, member: Member, why: str) -> None:
        total = self.s.tally(self.s.counters, f"gossip_refused_{why}", "gossip_refused")
        if total is not None:
            log.warning("refused what gossip said of %s (%s at %s): %s; %d refused so far",
                        member.node, member.name, member.address[:200], why, total)

    def _believed(self, member: Member, first: bool, source: str | None, user: str | None,
                  connected: str | None) -> str | None:
        """Why ``member`` is not believed, or None. ``connected``: the address of our
        connection it came back on (an answer): the bus listening there speaks for itself."""
        s = self.s
        if s.trust is not None:
            entry = s.trust.peer_of(member.key)
            if entry is None:
                return "unknown_key"
            if first and member.key != user:
                return "not_its_key"
            if not entry.may_name(member.name):
                return "name_not_allowed"
            known = self.known.get(member.node)
            if known is not None and known.member.key not in (None, member.key):
                return "node_key_changed"
            return None
        if first:
            return None if member.address == connected else s.policy.refuse(member.address, source)
        return None if member.address.startswith("tcp://") else "not_tcp"

    def _merge(self, member: Member, first: bool, now: float, source: str | None, user: str | None,
               connected: str | None) -> None:
        s = self.s
        why = self._believed(member, first, source, user, connected)
        if why is not None:
            self._refuse(member, why)
            return
        k = self.known.get(member.node)
        if k is None:
            if len(self.known) >= MAX_MEMBERS:
                self._refuse(member, "table_full")
                return
            k = self.known[member.node] = Known(member, now, True, s.wall(), source if first else None)
            self.dirty = True
            log.info("found instance %s of %s at %s%s", member.node, member.name, member.address,
                     "" if first else " (told by another)")
            self._vouch(k, first)
            self.resolve(member.name)
            return
        old = k.member
        moved = first and member.address != old.address
        if member.age <= old.age and not moved:
            return
        if not first:
            member = replace(member, address=old.address)  # an address only first hand
        k.member, k.heard = member, now
        if first:
            k.via = source
        if not k.up:
            k.up, k.since = True, s.wall()
            self.dirty = True
            log.info("instance %s of %s at %s is up", member.node, member.name, member.address)
        if (old.name, old.key, old.publishes, old.subscribes, old.version) != \
                (member.name, member.key, member.publishes, member.subscribes, member.version):
            self.dirty = True
        self._vouch(k, first)
        if moved:
            self.dirty = True
            s.counters["instances_moved"] += 1
            log.warning("instance %s of %s moved from %s to %s: what is owed to it follows",
                        member.node, member.name, old.address, member.address)
            s.vouched.pop(old.address, None)
            self.roster.move(old.address, member.address, member.node)
            self._move_intents(old.address, member.address)
        if old.name != member.name:
            self.resolve(member.name)

    def _vouch(self, k: Known, first: bool = False) -> None:
        s = self.s
        s.services[k.member.node] = k.member.name
        if first or k.via is not None:
            s.vouched[k.member.address] = (k.via, k.member.key)
        if s.trust is not None and k.member.key is not None and not s.trust.server_keys(k.member.address):
            s.trust.learned[k.member.address] = (k.member.key,)  # connected to with its key

    # --- subscriptions to services ---------------------------------------------------------

    def load_intent(self, service: str, topic: str, record: IntentRecord) -> None:
        self.name_intents[(service, topic)] = Intent(SERVICE + service, topic, record["op"], record["id"],
                                                     True, group=record.get("group"),
                                                     ordered=bool(record.get("ordered")),
                                                     limit=record.get("limit"), start=record.get("start"))

    def subscribe(self, cmd: SubscribeCmd) -> None:
        """``subscribe("orders", topic)``: stored as an intent to the service; every
        instance of it known now or found later gets an intent of its own (``resolve``)."""
        s = self.s
        if not self.on:
            raise ValueError("subscribing to a service by name needs discovery: start this bus with "
                             "name=... and/or seeds=[...] (or subscribe to an address)")
        service = cmd.publisher[len(SERVICE):]
        key = (service, cmd.topic)
        if cmd.op == "unsubscribe":
            self.name_intents.pop(key, None)
            s.out.batch.delete_intent(cmd.publisher, cmd.topic)
            for (publisher, topic), intent in list(s.intents.items()):
                if topic == cmd.topic and intent.via == service and intent.op == "subscribe":
                    self.handshake.subscribe(SubscribeCmd(publisher, topic, "unsubscribe", None, cmd.confirmed))
        else:
            intent = Intent(cmd.publisher, cmd.topic, "subscribe", s.ids.next(), True, group=cmd.group,
                            ordered=cmd.ordered, limit=cmd.limit, start=cmd.start)
            intent.waiters = [cmd.confirmed] if cmd.confirmed is not None else []
            self.name_intents[key] = intent
            s.out.batch.put_intent(cmd.publisher, cmd.topic, intent.record(s.wall()))
            self.resolve(service)
        s.out.batch.sync = True
        s.out.release.append((cmd.future, True))

    def resolve(self, service: str) -> None:
        """Give every known instance of ``service`` the subscriptions asked of the service."""
        s = self.s
        for (name, topic), wanted in self.name_intents.items():
            if name != service:
                continue
            for k in self.instances(service):
                address = k.member.address
                if address in s.own:
                    continue
                have = s.intents.get((address, topic))
                if have is not None and have.op == "subscribe":
                    have.waiters.extend(wanted.waiters)
                    continue
                try:
                    self.handshake.subscribe(SubscribeCmd(address, topic, "subscribe", None, None, wanted.group,
                                                          wanted.ordered, wanted.limit, wanted.start), via=name)
                except ValueError as exc:
                    log.error("cannot subscribe to %s at %s (instance of %s): %s", topic, address, name, exc)
                    continue
                s.intents[(address, topic)].waiters.extend(wanted.waiters)
            if self.instances(service):
                wanted.waiters = []

    def _move_intents(self, old: str, new: str) -> None:
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

    # --- the fleet view and kicks ------------------------------------------------------------

    def view(self, now: float) -> list[dict[str, Any]]:
        rows = []
        if self.name:
            rows.append({**self.me().wire(), "up": True, "since": None, "self": True})
        for k in self.known.values():
            rows.append({**k.member.wire(), "up": k.up, "since": k.since, "via": k.via,
                         "silent": None if not k.heard else round(now - k.heard, 3),
                         "kicked": self.kicked.get(k.member.node) or self.kicked.get(SERVICE + k.member.name)})
        return rows

    def is_kicked(self, node: str) -> str | None:
        if not self.kicked:
            return None
        if node in self.kicked:
            return self.kicked[node]
        name = self.s.services.get(node)
        return None if name is None else self.kicked.get(SERVICE + name)

    def kick(self, target: str, why: str, handshake: Handshake) -> dict[str, Any]:
        """Remove the instance (node id, or address) or every instance of the service
        ``target`` from this publisher's subscribers: their subscriptions end, what they
        were owed is dropped (journaled ``dropped`` with reason ``kicked: why``), and their
        subscribes are refused until ``readmit``. Returns what was done."""
        s = self.s
        nodes = {k.member.node for k in self.known.values()
                 if target in (k.member.node, k.member.address, k.member.name)}
        if not nodes and not any(target == addr or target == rec.get("node")
                                 for (addr, _t), rec in s.subscriptions.items()):
            raise ValueError(f"{target!r} is no instance, address or service this bus knows")
        service = target if any(k.member.name == target for k in self.known.values()) else None
        key = SERVICE + service if service else target
        self.kicked[key] = why or "kicked by an operator"
        ended = []
        for (address, topic), record in list(s.subscriptions.items()):
            if address == target or record.get("node") in nodes or record.get("node") == target or \
                    (service is not None and s.services.get(str(record.get("node"))) == service):
                handshake.end(address, topic, f"kicked: {self.kicked[key]}")
                ended.append({"subscriber": address, "topic": topic})
        self.dirty = True
        self.save()
        self.s.out.batch.sync = True
        log.warning("kicked %s (%s): %d subscriptions ended", target, self.kicked[key], len(ended))
        return {"kicked": key, "why": self.kicked[key], "ended": ended}

    def readmit(self, target: str) -> dict[str, Any]:
        found = [k for k in (target, SERVICE + target) if k in self.kicked]
        for key in found:
            del self.kicked[key]
        if not found:
            raise ValueError(f"{target!r} is not kicked")
        self.dirty = True
        self.save()
        self.s.out.batch.sync = True
        return {"readmitted": found}
