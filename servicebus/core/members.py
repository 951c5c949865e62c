"""Discovery and services by name, in the core (sans I/O; the entries: model/members.py).

Every ``gossip_interval`` this bus raises its beat and sends what it knows (itself and the
*confirmed* instances it sees up) to one instance it knows, to one it has business with,
to its seeds until they answer, to at most two addresses it was told of, and, for a while
after its own address changed, to every instance it knows. The one asked answers with its
own table. An instance whose (epoch, beat) stops growing for ``down_after`` seconds of our
clock is down; it stays in the table (stored: a restart needs no seed) until kicked.

What is believed from whom (a hostile review of issue 30 found each of these open):
- An instance is *confirmed* only first hand: its own gossip to us, or its answer on our
  connection to its address. Only confirmed instances are subscribed to, sent commands by
  name, vouched for and told to others. What others say of one we never heard is a hint we
  ask ourselves (100 at most, 16 new a frame, two asked a turn, forgotten unanswered).
- An instance proves itself to us with HMAC(its secret, our node id), the same every time,
  sent only where it knows we are (proofs.py). We keep the first one (trust on first use);
  a first-hand frame with another is refused, a move needs it.
- Second hand, a confirmed instance's entry only keeps it alive, if its age grew plausibly
  (one more start at most, no more beats than time allows); its name, key, topics and
  address change only first hand; a new address heard second hand is asked there.
- A first-hand address must be on the host the frame came from (or the one we connected
  to); with CURVE the key must be the frame's and peers.toml must allow it the name.

When an instance moves, what is owed to it follows (``Roster.move``: subscriptions, cursors,
backlogs, queued commands) and this bus's subscriptions to it are asked again there."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import random
from dataclasses import replace
from collections.abc import Callable
from typing import Any

from ..model.members import MAX_MEMBERS, Member
from ..model.packer import pack
from ..model.stored import IntentRecord
from ..wire import protocol as P
from ..wire.validation import validate_address
from .commands import SubscribeCmd
from .handshake import Handshake
from .peers import Roster
from .proofs import partners, proof_targets, prove_now, remember_answer
from .services import (Known, ServiceIntents, fleet_view, is_kicked, kick_target, load_table, pick_instance,
                       readmit, stored_table)
from .state import State

__all__ = ["Directory", "Known"]

log = logging.getLogger("servicebus")

VERSION = "0.3"  # told in gossip (the fleet view shows it)
MAX_HINTS = 100  # instances heard of second hand and not confirmed yet, at most
NEW_PER_FRAME = 16  # of them taken from one frame
PROBES = 2  # of them asked per turn
TABLE_BYTES = 256 << 10  # a gossip frame's table at most (a receiver takes 3 MiB)


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
        self.spread = False  # a new instance wrote to us: tell every instance at once
        self.last_tick = self.last_beat = -1e9
        self.dirty = False
        self.kicked: dict[str, str] = {}  # node id, address or "svc:<name>" -> why (kick)
        self.secret = os.urandom(16)
        self.hints: dict[str, list[Any]] = {}  # address -> [node, times asked]: asked there (3 times)
        # address -> node id of the bus that answered there: a seed or a publisher without a
        # name is in no table, yet it must get our proof, or our moves are refused there
        self.answered: dict[str, str] = {}
        self.prove_soon: set[str] = set()  # answered just now: our proof goes there (proofs.py)
        self.services = ServiceIntents(state, roster, handshake, self)
        self.found: Callable[[str], Any] = lambda name: None  # set by the core (machine.py)
        self._turn = 0
        self._saved_me: Any = None

    # --- the table -----------------------------------------------------------------------

    def load(self, stored: dict[str, Any] | None, wall: int) -> None:
        """The table as the bus left it (all down until they gossip again)."""
        load_table(self, stored, wall)

    def stored(self) -> dict[str, Any]:
        return stored_table(self)

    def save(self) -> None:
        """Store the table if it changed (in the turn's batch: a meta record, no fsync of
        its own; a crash that loses it loses what the next gossip tells again)."""
        if self.dirty:
            self.dirty = False
            self.s.out.batch.put_meta("members", pack(self.stored()))

    def me(self) -> Member:
        s = self.s
        publishes = sorted({topic for _addr, topic in s.subscriptions} | set(s.routes.retention.rules))
        subscribes = sorted({topic for _p, topic in s.intents} | self.services.topics())
        key = s.trust.public.decode() if s.trust is not None else None
        return Member(s.node_id, self.name or "", s.address, self.epoch, self.beat, key,
                      tuple(publishes[:200]), tuple(subscribes[:200]), VERSION)

    def proof(self, node: str) -> str:
        """What this bus proves itself with to ``node`` (see the module's docstring)."""
        return hmac.new(self.secret, node.encode(), hashlib.sha256).hexdigest()[:32]

    def addresses(self, service: str) -> list[str]:
        return [k.member.address for k in self.known.values() if k.confirmed and k.member.name == service]
    def pick(self, name: str) -> str:
        """The address of one instance of ``name`` for a command or request (services.py)."""
        self._turn += 1
        return pick_instance(self, name, self._turn)

    # --- gossip ----------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        if not self.on or now < self.next_gossip:
            return
        s, cfg = self.s, self.s.config
        self.next_gossip = now + cfg.gossip_interval
        if now - self.last_beat >= cfg.gossip_interval * 0.99:  # an early turn raises no beat
            self.beat += 1
            self.last_beat = now
        self.last_tick = now
        if self.moved:
            self.moved, self.announce_until, self.dirty = False, now + cfg.down_after, True
        for node, k in list(self.known.items()):
            if not k.confirmed:
                if now - k.heard > 3 * cfg.down_after:  # told of, never answered: forgotten
                    del self.known[node]
                    self.roster.drop_if_unused(k.member.address)
                continue
            if k.up and now - k.heard > cfg.down_after:
                k.up, k.since = False, s.wall()
                self.dirty = True
                log.info("instance %s of %s at %s is down (no gossip for %.1fs)", k.member.node,
                         k.member.name, k.member.address, now - k.heard)
        targets: dict[str, str] = {}
        confirmed = [k for k in self.known.values() if k.confirmed]
        up = [k for k in confirmed if k.up]
        down = [k for k in confirmed if not k.up]
        if up:
            k = random.choice(up)
            targets[k.member.address] = k.member.node
        if down and (not up or self.beat % 5 == 0):
            k = random.choice(down)  # to find them again after a cut
            targets[k.member.address] = k.member.node
        by_address = {k.member.address: k.member.node for k in confirmed}
        for address, node in proof_targets(self, by_address, self.beat, now).items():  # proofs.py
            if node or address not in targets:
                targets[address] = node
        if now < self.announce_until or self.spread:
            targets.update(by_address)
            self.spread = False
        asked = 0
        for address, node in [(a, h[0]) for a, h in self.hints.items()] + [
                (k.member.address, k.member.node) for k in self.known.values() if not k.confirmed]:
            if asked >= PROBES:
                break
            hinted = self.known.get(node)
            if hinted is not None and not hinted.confirmed:
                if now - hinted.probed < cfg.down_after:
                    continue
                hinted.probed = now
            hint = self.hints.get(address)
            if hint is not None:
                hint[1] += 1
                if hint[1] >= 3:  # the first may go before the connection is made: three tries
                    del self.hints[address]
            targets.setdefault(address, node)
            asked += 1
        table = self.table()
        for address, node in targets.items():
            if address in s.own:
                continue
            try:
                peer = self.roster.peer(address)
            except ValueError as exc:
                log.debug("not gossiping to %s: %s", address, exc)
                continue
            self.roster.send(peer, P.encode_gossip(s.node_id, table, proof=self.proof(node) if node else None))
        s.counters["gossip_sent"] += len(targets)
        mine = self.me().wire()
        mine.pop("beat")
        if mine != self._saved_me:
            self._saved_me, self.dirty = mine, True
        self.save()

    def table(self) -> list[dict[str, Any]]:
        out = [self.me().wire()] if self.name else []
        size = 0
        for k in self.known.values():
            if k.up and k.confirmed and len(out) < MAX_MEMBERS:
                entry = k.member.wire()
                size += 100 + sum(len(t) for t in (*k.member.publishes, *k.member.subscribes))
                if size > TABLE_BYTES:
                    break
                out.append(entry)
        return out

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

    def leave(self) -> None:
        """A clean stop: every instance up is told (they mark this one down at once, so
        that commands and requests by name go to the others meanwhile)."""
        if not self.on or not self.name:
            return
        farewell = [replace(self.me(), beat=self.beat + 1, left=True).wire()]
        for k in self.known.values():
            peer = self.s.peers.get(k.member.address)
            if k.confirmed and k.up and peer is not None:
                self.roster.send(peer, P.encode_gossip(self.s.node_id, farewell, proof=self.proof(k.member.node)))

    def soon(self, now: float) -> None:
        """Gossip at the next turn, but not within 0.1 s of the last (a flood of news must
        not make this bus gossip without end)."""
        self.next_gossip = min(self.next_gossip, max(now, self.last_tick + 0.1))

    def peer_up(self, address: str, node: str = "") -> None:
        """A connection's pong (naming ``node``): a partner gets our proof now (proofs.py);
        one not heard yet, or an address whose ask ZeroMQ dropped, is asked at once."""
        if node and remember_answer(self, address, node):
            self.dirty = True
            prove_now(self, address)
        if address not in self.heard_seeds and address in partners(self):
            self.next_gossip = 0.0
        for k in self.known.values():
            if not k.confirmed and k.member.address == address:
                k.probed = -1e9
                self.soon(self.s.now)

    def hint(self, address: str) -> None:
        """A sender we know nothing of (channel roles held its messages): ask who it is."""
        if len(self.hints) < MAX_HINTS and address.startswith("tcp://"):
            self.hints.setdefault(address, ["", 0])
            self.soon(self.s.now)

    def on_gossip(self, frame: P.Gossip, now: float, source: str | None, user: str | None,
                  ident: bytes | None = None, address: str | None = None) -> None:
        """Gossip to our ROUTER (``ident``: answered with our table) or an answer on our
        connection to ``address``."""
        s = self.s
        s.counters["gossip_received"] += 1
        if address is not None:
            self.heard_seeds.add(address)
            self.hints.pop(address, None)
            if remember_answer(self, address, frame.sender):
                self.dirty = True
                self.soon(now)  # our proof to it: until it has it, a move of ours is refused
                prove_now(self, address)
        new = 0
        for member in frame.members:
            if member.node == s.node_id:
                continue
            if member.node == frame.sender:
                self._first_hand(member, frame.proof, now, source, user, address)
            elif self._second_hand(member, now, new < NEW_PER_FRAME):
                new += 1
        if ident is not None and not frame.reply:
            # No proof in an answer: whoever writes to us may name any node id (proofs.py).
            s.out.to_router.append((ident, P.encode_gossip(s.node_id, self.table(), reply=True)))
        self.save()

    def _refuse(self, member: Member, why: str) -> None:
        total = self.s.tally(self.s.counters, f"gossip_refused_{why}", "gossip_refused")
        if total is not None:
            log.warning("refused what gossip said of %s (%s at %s): %s; %d refused so far",
                        member.node, member.name, member.address[:200], why, total)

    def _believed(self, member: Member, source: str | None, user: str | None, connected: str | None) -> str | None:
        """Why a first-hand ``member`` is not believed, or None. ``connected``: the address
        of our connection it came back on (an answer): the bus listening there speaks."""
        s = self.s
        if s.trust is not None:
            entry = s.trust.peer_of(member.key)
            if entry is None:
                return "unknown_key"
            if member.key != user if connected is None else member.key not in s.trust.server_keys(connected):
                return "not_its_key"
            if not entry.may_name(member.name):
                return "name_not_allowed"
            known = self.known.get(member.node)
            if known is not None and known.confirmed and known.member.key not in (None, member.key):
                return "node_key_changed"
            return None
        return None if member.address == connected else s.policy.refuse(member.address, source)

    def _first_hand(self, member: Member, proof: str | None, now: float, source: str | None,
                    user: str | None, connected: str | None) -> None:
        s = self.s
        why = self._believed(member, source, user, connected)
        k = self.known.get(member.node)
        # An answer on our connection to the address it names needs none: it is whoever
        # listens there (and answers carry none: proofs.py).
        answer = proof is None and connected is not None and member.address == connected
        if why is None and k is not None and k.proof is not None and proof != k.proof and not answer:
            why = "bad_proof"  # not the instance that wrote to us before
        if why is None and k is not None and k.confirmed and member.address != k.member.address and \
                (k.proof is None or proof != k.proof):
            why = "move_unproven"
        if why in ("host_name_not_allowed", "not_source_host") and connected is None:
            self._ask(member)  # believed once it answers there itself (ZeroMQ resolves names)
            return
        if why is not None:
            self._refuse(member, why)
            return
        if k is None:
            if len(self.known) >= MAX_MEMBERS and not self._evict():
                self._refuse(member, "table_full")
                return
            k = self.known[member.node] = Known(member, now, False, s.wall())
        old, was = k.member, k.confirmed
        if k.proof is None and proof is not None:
            k.proof, self.dirty = proof, True
            s.counters["instances_proven"] += 1
        k.member, k.heard, k.via, k.confirmed = member, now, source, True
        if member.left:
            if k.up:
                k.up, k.since, self.dirty = False, s.wall(), True
                log.info("instance %s of %s at %s left", member.node, member.name, member.address)
            return
        if not k.up:
            k.up, k.since, self.dirty = True, s.wall(), True
            log.info("instance %s of %s at %s is up%s", member.node, member.name, member.address,
                     "" if was else " (found)")
        if not was or (old.name, old.key, old.publishes, old.subscribes, old.version, old.address) != \
                (member.name, member.key, member.publishes, member.subscribes, member.version, member.address):
            self.dirty = True
        self._vouch(k, True)
        if was and member.address != old.address:
            s.counters["instances_moved"] += 1
            log.warning("instance %s of %s moved from %s to %s: what is owed to it follows",
                        member.node, member.name, old.address, member.address)
            s.vouched.pop(old.address, None)
            self.roster.move(old.address, member.address, member.node)
            self.services.moved(old.address, member.address)
        if not was:  # our proof to it where it is, this turn; if it wrote first, tell all now
            prove_now(self, member.address, member.node)
            self.spread = self.spread or connected is None
            self.soon(now)
        if not was or old.name != member.name:
            self.services.resolve(member.name)
            self.found(member.name)  # handlers' commands that waited for an instance of it

    def _plausible(self, k: Known, member: Member, now: float) -> bool:
        """A second-hand age no instance could have made up: one more start at most, and
        no more beats than the time since we last heard of it allows (twice over)."""
        room = 10 + 2 * max(0.0, now - k.heard) / self.s.config.gossip_interval
        if member.epoch == k.member.epoch:
            return k.member.beat < member.beat <= k.member.beat + room
        return member.epoch == k.member.epoch + 1 and member.beat <= room

    def _second_hand(self, member: Member, now: float, may_add: bool) -> bool:
        """What another says of ``member``; True if it was new to us (a hint taken)."""
        s = self.s
        k = self.known.get(member.node)
        if k is None:
            hints = sum(1 for x in self.known.values() if not x.confirmed)
            if not may_add or hints >= MAX_HINTS or not member.address.startswith("tcp://") or \
                    len(self.known) >= MAX_MEMBERS or (s.trust is not None and self._believed(member, None, None, "")):
                s.counters["gossip_hints_dropped"] += 1
                return False
            self.known[member.node] = Known(member, now, False, s.wall())
            self._ask(member, probe=False)
            self.soon(now)  # asked at once
            return True
        if not k.confirmed:
            return False
        if self._plausible(k, member, now):
            k.member, k.heard = replace(k.member, epoch=member.epoch, beat=member.beat), now
            if not k.up:
                k.up, k.since, self.dirty = True, s.wall(), True
            if member.address != k.member.address and member.address.startswith("tcp://"):
                self._ask(member)  # moved, they say: ask it there
        return False

    def _ask(self, member: Member, probe: bool = True) -> None:
        """Ask ``member.address`` who listens there (next turn, if ``probe``); with CURVE,
        with the key ``member`` names, which the answer must then show."""
        s = self.s
        if s.trust is not None and member.key is not None and not s.trust.server_keys(member.address):
            s.trust.learned[member.address] = (member.key,)
        if probe and len(self.hints) < MAX_HINTS:
            self.hints[member.address] = [member.node, 0]

    def _evict(self) -> bool:
        """Room for an instance heard first hand: the oldest hint goes."""
        hints = [(k.heard, node) for node, k in self.known.items() if not k.confirmed]
        if not hints:
            return False
        del self.known[min(hints)[1]]
        return True

    def _vouch(self, k: Known, first: bool) -> None:
        s = self.s
        s.services[k.member.node] = k.member.name
        s.vouched[k.member.address] = (k.via, k.member.key)
        if s.trust is not None and k.member.key is not None and not s.trust.server_keys(k.member.address):
            s.trust.learned[k.member.address] = (k.member.key,)  # connected to with its key

    # --- subscriptions to services, kicks, the view ---------------------------------------------

    def load_intent(self, service: str, topic: str, record: IntentRecord) -> None:
        self.services.load(service, topic, record)

    def subscribe(self, cmd: SubscribeCmd) -> None:
        """``subscribe("orders", topic)``: services.py."""
        if not self.on:
            raise ValueError("subscribing to a service by name needs discovery: start this bus with "
                             "name=... and/or seeds=[...] (or subscribe to an address)")
        self.services.subscribe(cmd)

    def view(self, now: float) -> list[dict[str, Any]]:
        return fleet_view(self, now)

    def is_kicked(self, node: str, address: str = "") -> str | None:
        return is_kicked(self.s, self.kicked, node, address)

    def kick(self, target: str, why: str, handshake: Handshake) -> dict[str, Any]:
        return kick_target(self, target, why, handshake)

    def readmit(self, target: str) -> dict[str, Any]:
        return readmit(self, target)
