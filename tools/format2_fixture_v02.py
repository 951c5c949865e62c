"""Run by tools/format2_fixture.py with servicebus v0.2's code first on sys.path (NOT this
tree's): real v0.2 buses leave stopped data directories holding what store format 2 can
hold, and ``manifest.json`` says what is in them.

    python format2_fixture_v02.py OUT PUB_PORT,SUB_PORT,MEMBER_PORT,NOWHERE_PORT COMMIT

``pub/`` (a publisher, tcp://127.0.0.1:PUB_PORT), whose subscriber ``sub/`` is down:
  - events owed to it: plain (publish_many), with headers, with a long TTL, of priority 3,
    delayed, stored with a publish dedupe key, published in a ``bus.transaction()``, and to
    an ordered subscription with a key; commands to it (one with headers and a TTL);
  - one event it handled but whose acks were lost (``dedupe.t``: the subscriber's acks of
    it were dropped, so the publisher still owes it and will resend it);
  - events owed to a subscriber group (``billing``, its one member ``member/`` down);
  - dead letters made here (origin outgoing, reason expired): an event whose TTL passed
    while its subscriber was down, a command to an address nobody answers;
  - commands received and not handled (no handler), one handled (a handled id);
  - ``bus.kv`` values (str, int, a map, bytes);
  - every journal record still in the store (``j/``): its journal's moves to segment
    files were stopped, as a crash before the first flush leaves them.
``sub/`` (the subscriber, tcp://127.0.0.1:SUB_PORT):
  - events and a command received and not handled (no handler registered for them);
  - one whose handler raised ``Retry(after=30)``: a run state (1 attempt, the error);
  - handled ids (dedupe), among them ``dedupe.t``'s;
  - dead letters: ``handler_failed``, ``rejected``, ``invalid`` and ``undecodable`` (the
    last two from a raw frame off the wire, as an older or hostile sender sends them);
  - a command its handler sent (``message.send``) still in the outbox (the engine's move
    of it into its stream was stopped), and the handler's ``message.kv`` write;
  - ``bus.kv`` values; journal segment files (flushed as usual).
``member/``: a group member (subscribed, down).

Every payload carries a unique ``tag``; the manifest maps tags to ids where the API
returned one.
"""

from __future__ import annotations

import base64
import json
import sys
import threading
import time
from pathlib import Path

import msgpack
import zmq

import servicebus
from servicebus import Bus, Reject, Retry
from servicebus import engine as E
from servicebus import journal as J
from servicebus import protocol as P
from servicebus.core import receiver as R

OUT = Path(sys.argv[1])
PUB, SUB, MEMBER, NOWHERE = (f"tcp://127.0.0.1:{p}" for p in sys.argv[2].split(","))
COMMIT = sys.argv[3]
assert Path(servicebus.__file__).resolve().is_relative_to(Path.cwd().resolve()), (
    f"not the exported v0.2 code: {servicebus.__file__}")
YEARS = 10 * 365 * 86400.0  # a TTL that does not run out before the test runs


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


# --- what v0.2 is stopped from doing, to leave records it would otherwise move on ---------------

_flush = J.Journal.flush


def flush(self: J.Journal) -> int:
    """The publisher's journal is never moved to segment files: its records stay in j/."""
    return 0 if self.dir == OUT / "pub" / "journal" else _flush(self)


_queue_sends = E.Engine.queue_sends


def queue_sends(self: E.Engine, sends: list) -> None:
    """The subscriber's engine never moves a handler's commands out of the outbox."""
    if self.address != SUB:
        _queue_sends(self, sends)


_on_batch = R.Receiver.on_batch


def on_batch(self: R.Receiver, ident: bytes, frame: P.Batch, source=None, user=None) -> None:
    """The acks of ``dedupe.t`` are lost: its publisher keeps it as owed (and resends it)."""
    _on_batch(self, ident, frame, source, user)
    lost = {env.id for env in frame.messages if env.topic == "dedupe.t"}
    acks = self.s.out.acks.get(ident)
    if lost and acks:
        acks[:] = [mid for mid in acks if mid not in lost]


J.Journal.flush = flush
E.Engine.queue_sends = queue_sends
R.Receiver.on_batch = on_batch

# --- the buses ----------------------------------------------------------------------------------

manifest: dict = {"made_by": COMMIT, "made_at_ms": int(time.time() * 1000), "datadirs": ["pub", "sub", "member"],
                  "addresses": {"pub": PUB, "sub": SUB, "member": MEMBER, "nowhere": NOWHERE}}
pub = Bus(PUB, OUT / "pub")
sub = Bus(SUB, OUT / "sub", max_attempts=2, retry_initial=0.05, retry_max=0.1)
member = Bus(MEMBER, OUT / "member")
member.subscribe(PUB, "billing.t", group="billing", wait=10)
member.close()

ran: dict[str, list] = {}
lock = threading.Lock()


def note(payload, message) -> None:
    with lock:
        ran.setdefault(message.topic, []).append((payload["tag"], message.id, message.attempt))


def fails(payload, message) -> None:
    note(payload, message)
    raise ValueError("fixture: always fails")


def rejects(payload, message) -> None:
    note(payload, message)
    raise Reject("fixture: rejected")


def later(payload, message) -> None:
    note(payload, message)
    raise Retry("fixture: later", after=30)


def sends(payload, message) -> None:
    note(payload, message)
    message.send(PUB, "cmd.back", {"tag": "cmd.back", "for": payload["tag"]}, headers={"via": "outbox"})
    message.kv.put("sub:sent", payload["tag"])


sub.every("handled.t", note)
sub.every("fails.t", fails)
sub.every("rejects.t", rejects)
sub.every("retry.t", later)
sub.every("sends.t", sends)
sub.every("dedupe.t", note)
pub.handle("ping.p", note)
for topic in ("handled.t", "fails.t", "rejects.t", "retry.t", "sends.t", "dedupe.t", "unhandled.t", "orders.t"):
    sub.subscribe(PUB, topic, wait=10)
sub.subscribe(PUB, "ordered.t", ordered=True, wait=10)

# Phase 1, both up: what the subscriber handles, fails, parks and keeps.
handled = pub.publish_many("handled.t", [{"tag": f"handled-{n}"} for n in range(3)])
failed = pub.publish("fails.t", {"tag": "fails"})
rejected = pub.publish("rejects.t", {"tag": "rejects"})
retried = pub.publish("retry.t", {"tag": "retry"})
sent = pub.publish("sends.t", {"tag": "sends"})
dedupe = pub.publish("dedupe.t", {"tag": "dedupe"})
parked = pub.publish_many("unhandled.t", [{"tag": f"unhandled-{n}"} for n in range(3)], headers={"h": "parked"})
parked_cmd = pub.send(SUB, "unhandled.cmd", {"tag": "unhandled.cmd"})
at_pub = [sub.send(PUB, "unhandled.p", {"tag": f"unhandled.p-{n}"}) for n in range(2)]
pinged = sub.send(PUB, "ping.p", {"tag": "ping"})

# A raw frame, as an older or hostile sender writes it: one message whose topic is not a
# topic (invalid), one whose payload no receiver can decode (undecodable), one good one.
raw_ids = [f"{k:024x}" for k in (0xF0001, 0xF0002, 0xF0003)]
envs = [P.Envelope(raw_ids[0], "bad topic", 1_700_000_000_000, P.encode_payload({"tag": "invalid"})),
        P.Envelope(raw_ids[1], "unhandled.t", 1_700_000_000_000, msgpack.packb({(1, 2): 3})),
        P.Envelope(raw_ids[2], "unhandled.t", 1_700_000_000_000, P.encode_payload({"tag": "raw-good"}))]
ctx = zmq.Context()
dealer = ctx.socket(zmq.DEALER)
dealer.setsockopt(zmq.LINGER, 0)
dealer.connect(SUB)
dealer.send_multipart(P.encode_batch(P.Kind.EVENT, "hostile", "tcp://127.0.0.1:9", envs))
acked: set[str] = set()


def raw_acked() -> bool:
    while dealer.poll(0):
        reply = P.decode(dealer.recv_multipart(), max_payload=1 << 20)
        acked.update(getattr(reply, "ids", ()))
    return acked >= set(raw_ids)


wait_until(raw_acked, 20, "the raw frame's acks")
dealer.close()
ctx.term()

sub.kv.put("sub:config", {"version": 2, "flags": ["a", "b"]})
sub.kv.put("sub:counter", 7)
pub.kv.put("pub:cursor", "xyz")
pub.kv.put("pub:bytes", b"\x00\x01\xff")


def settled() -> bool:
    with lock:
        done = {t: len(v) for t, v in ran.items()}
    s = sub.status()
    return (done.get("handled.t") == 3 and done.get("sends.t") == 1 and done.get("dedupe.t") == 1
            and done.get("fails.t") == 2 and done.get("rejects.t") == 1 and done.get("retry.t") == 1
            and done.get("ping.p") == 1 and s.deadletters == 4 and s.incoming == 6
            and sub._store.count("outbox") == 1 and sub._store.count("runstate") >= 1
            and pub.status().incoming == 2)


wait_until(settled, 30, f"the subscriber to settle ({ran}, {sub.status()})")
time.sleep(1.5)  # a resend or two of dedupe.t, deduplicated (its acks are dropped)
sub.close()

# Phase 2, the subscriber down: what the publisher owes it.
owed: dict[str, str | None] = {}  # tag -> id (None: a transaction's publish returns none)


def publish(tag: str, topic: str = "orders.t", **options) -> str:
    owed[tag] = mid = pub.publish(topic, {"tag": tag}, **options)
    return mid


for n, mid in enumerate(pub.publish_many("orders.t", [{"tag": f"plain-{n}"} for n in range(5)])):
    owed[f"plain-{n}"] = mid
publish("headers", headers={"trace": "abc", "n": 1})
publish("ttl", ttl=YEARS)
for n, mid in enumerate(pub.publish_many("orders.t", [{"tag": f"prio-{n}"} for n in range(2)], priority=3)):
    owed[f"prio-{n}"] = mid
publish("delayed", delay=2.0)
publish("dedupe-key", dedupe_key="order-77")
assert pub.publish("orders.t", {"tag": "dedupe-key-again"}, dedupe_key="order-77") == owed["dedupe-key"]
for n, mid in enumerate(pub.publish_many("ordered.t", [{"tag": f"ordered-{n}"} for n in range(3)], key="acct-1")):
    owed[f"ordered-{n}"] = mid
owed["cmd-0"] = pub.send(SUB, "orders.cmd", {"tag": "cmd-0"})
owed["cmd-1"] = pub.send(SUB, "orders.cmd", {"tag": "cmd-1"}, headers={"h": "v"}, ttl=YEARS)
with pub.transaction() as tx:
    tx.kv.put("pub:tx", {"in": "transaction"})
    tx.publish("orders.t", {"tag": "tx"})
owed["tx"] = None
group = pub.publish_many("billing.t", [{"tag": f"billing-{n}"} for n in range(3)])
expiring = pub.publish("orders.t", {"tag": "expiring"}, ttl=1.0)
nowhere = pub.send(NOWHERE, "nowhere.cmd", {"tag": "nowhere"}, ttl=0.5)
wait_until(lambda: pub.status().deadletters == 2, 30, f"the publisher's expired dead letters ({pub.status()})")
time.sleep(2.5)  # the delayed one is due: the publisher holds it for its subscriber
pub.close()

with lock:
    run = {t: [tag for tag, _mid, _attempt in v] for t, v in ran.items()}
manifest["pub"] = {
    "owed_to_sub": owed, "dedupe": {"tag": "dedupe", "id": dedupe},
    "owed_to_group": dict(zip((f"billing-{n}" for n in range(3)), group)),
    "deadletters": {expiring: ["outgoing", "expired", "expiring"], nowhere: ["outgoing", "expired", "nowhere"]},
    "incoming": {mid: f"unhandled.p-{n}" for n, mid in enumerate(at_pub)},
    "handled": [pinged],
    "kv": {"pub:cursor": "xyz", "pub:bytes": {"base64": base64.b64encode(b"\x00\x01\xff").decode()},
           "pub:tx": {"in": "transaction"}},
}
manifest["sub"] = {
    "handled": handled + [sent, dedupe],
    "incoming": {**{mid: f"unhandled-{n}" for n, mid in enumerate(parked)}, parked_cmd: "unhandled.cmd",
                 raw_ids[2]: "raw-good", retried: "retry"},
    "retry": {"id": retried, "attempts": 1},
    "deadletters": {failed: ["incoming", "handler_failed", "fails"], rejected: ["incoming", "rejected", "rejects"],
                    raw_ids[0]: ["incoming", "invalid", "invalid"], raw_ids[1]: ["incoming", "undecodable", None]},
    "kv": {"sub:config": {"version": 2, "flags": ["a", "b"]}, "sub:counter": 7, "sub:sent": "sends"},
    "outbox": [{"address": PUB, "command": "cmd.back", "tag": "cmd.back"}],
    "ran": run,
}
manifest["member"] = {"group": "billing", "topic": "billing.t"}
(OUT / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
print(f"built with {servicebus.__file__}")
