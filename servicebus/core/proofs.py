"""Where this bus sends its proof (sans I/O; core/members.py's docstring: a move needs it).

A bus proves itself to another with HMAC(its secret, that bus's node id). Whoever holds it
can tell that bus "I moved" in this bus's name and take what it owes this bus, so it goes
only where this bus itself chose to gossip, and only for the node id it knows there:
- an instance it confirmed first hand, at the address it confirmed it at;
- a seed, a publisher it subscribes to by address or one of its subscribers (its
  *partners*: they may owe it messages and have no name, so be in no table), for the node
  id that answered on this bus's own connection to that address (``Directory.answered``),
  if no other address answered with that node id and no confirmed instance has it
  elsewhere (a hostile seed naming a publisher's node id gets nothing).
Never in an answer to gossip: whoever writes to this bus may name any node id.

Partners are asked who they are (a gossip without a proof) until they answer, and each
gets the proof in turn, one a turn, so that a proof lost with its frame is sent again.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..wire import protocol as P

__all__ = ["MAX_ANSWERED", "partners", "remember_answer", "proof_targets", "prove_now"]

MAX_ANSWERED = 100  # addresses whose node id this bus keeps (where it gossips unasked)
ASK_PER_TURN = 8  # partners not heard from yet, asked who they are per turn at most


def partners(d: Any) -> list[str]:
    """Seeds, publishers subscribed to by address, subscribers: sorted, tcp only."""
    s = d.s
    found = set(d.seeds) | {p for p, _t in s.intents} | {a for a, _t in s.subscriptions}
    return sorted(a for a in found if a.startswith("tcp://") and a not in s.own)


def remember_answer(d: Any, address: str, node: str) -> bool:
    """``node`` answered on our connection to ``address``: kept if ``address`` is a partner
    (a stranger's answers cannot grow the map). True if that is news."""
    if d.answered.get(address) == node or node == d.s.node_id:
        return False
    if address not in d.answered and (len(d.answered) >= MAX_ANSWERED or address not in partners(d)):
        return False
    d.answered[address] = node
    d.prove_soon.add(address)
    return True


def _subscribed(d: Any) -> set[str]:
    """Addresses we subscribe to: the ones we chose to take events from."""
    return {p for p, _t in d.s.intents}


def _provable(d: Any, partnered: set[str] | None = None) -> dict[str, str]:
    """``answered`` entries our proof may go to: address -> node id. A node id that
    answered at several addresses: only at the one we subscribe to, if one (a seed that
    names a publisher's node id is lying), else nowhere."""
    if partnered is not None:  # no longer a partner: forgotten
        d.answered = {a: n for a, n in d.answered.items() if a in partnered}
    subscribed = _subscribed(d)
    claimed = Counter(d.answered.values())
    chosen = Counter(n for a, n in d.answered.items() if a in subscribed)
    out = {}
    for address, node in d.answered.items():
        known = d.known.get(node)
        if known is not None and known.confirmed and known.member.address != address:
            continue
        if claimed[node] > 1 and not (chosen[node] == 1 and address in subscribed):
            continue
        out[address] = node
    return out


def prove_now(d: Any, address: str, node: str | None = None) -> None:
    """Our proof to ``address`` in this turn (the sooner it has it, the shorter the time a
    move of ours would be refused there): to ``node``, an instance just confirmed there
    first hand; without ``node``, to the node id that just answered there if it is a
    publisher we subscribe to and the proof may go there (others: ``proof_targets``)."""
    if node is None:
        node = _provable(d).get(address) if address in _subscribed(d) else None
    if node and address not in d.s.own:
        try:
            peer = d.roster.peer(address)
        except ValueError:  # not an address this bus may connect to (policy.py): not now
            return
        d.prove_soon.discard(address)
        d.roster.send(peer, P.encode_gossip(d.s.node_id, d.table(), proof=d.proof(node)))
        d.s.counters["gossip_sent"] += 1


def proof_targets(d: Any, by_address: dict[str, str], beat: int, now: float) -> dict[str, str]:
    """This turn's gossip to partners: address -> the node id to prove ourselves to there
    ("" : no proof, asking who it is).

    A seed we do not subscribe to gets our proof for the node id it named only once every
    partner told its own (a partner that never answers holds that back): a hostile seed that
    answers first with a publisher's node id would otherwise get the proof meant for it
    before the publisher's own answer showed that node id elsewhere."""
    listed = partners(d)
    provable = _provable(d, set(listed))
    targets: dict[str, str] = {}
    # Not heard yet (no answer to our gossip since this bus started; a pong tells the node
    # id but not the table): asked, with our proof if it may go there already.
    unheard = [a for a in listed if a not in by_address and a not in d.heard_seeds]
    # Every partner's node id known (an answer or a pong): a seed naming another's is seen.
    settled = all(a in by_address or a in d.answered for a in listed)
    subscribed = _subscribed(d)
    for address in unheard[:ASK_PER_TURN]:
        targets[address] = provable.get(address, "") if settled or address in subscribed else ""
    for address in [a for a in d.prove_soon if a in provable and (settled or a in subscribed)]:
        targets[address] = provable[address]  # it answered just now: our proof there now
        d.prove_soon.discard(address)
    d.prove_soon &= set(provable)
    # Each in turn, again and again (a gossip is not acknowledged); all at once for a while
    # after this bus moved, as every instance it knows is told (members.py).
    turn = listed if now < d.announce_until else listed[beat % len(listed):][:1] if listed else []
    for address in turn:
        node = by_address.get(address) or (provable.get(address) if settled or address in subscribed else None)
        if node:
            targets[address] = node
    return targets
