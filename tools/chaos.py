"""tools/chaos: real buses in real processes under real faults, counted Jepsen-style.

    tools/chaos [--long] [--only KIND ...] [--seed N] [--json] [--keep] [--no-audit]

Each fault kind gets a run of its own: a publisher and a subscriber process (tools/
chaos_node.py) on their own data directories, publishing about 500 messages a second,
while the fault is injected again and again at random moments and healed. Then publishing
stops, everything is healed and the subscriber is given time to receive the rest. Counted
per run, from what the processes wrote down (nothing is taken from the buses' word):

- acknowledged: publishes that returned (the bus promised these);
- handled: acknowledged messages a handler ran for;
- handled, publish never returned: messages a handler ran for whose publish did not return
  (its process was killed or lost its power while the fsync ran: the bus may send a message
  during its fsync; README, Guarantees); not counted as lost or duplicated;
- lost: acknowledged, never handled, not a dead letter and not reported lost by a repair;
- duplicated: handled more than once, other than the one rerun the README documents (a
  handler whose process was killed with SIGKILL after it ran and before its completion
  reached the OS runs again after the restart: shown apart, as "reruns after kill -9");
- reported lost: messages `servicebus check --repair` reported it could not recover
  after store damage that destroys data (a truncated table, flipped bits);
- dead letters: at either bus (e.g. a message whose stored record was damaged).

Faults: kill -9 of either side; a subscriber by service name (``Bus(name=, seeds=)``) killed
with -9 and started again with its data directory at a new address (another port), where
the publisher must find it by discovery and move what it owes it; SIGSTOP/SIGCONT; a network partition between two network
namespaces joined by a veth pair (link down, then iptables random drop), healed; disk full
on a small tmpfs, then freed; the wall clock moved back (publisher) and forward past the
dedupe window (subscriber) with libfaketime; store damage (missing CURRENT, a garbage
record, a truncated table, flipped bits) followed by `servicebus check --repair`; kill -9
of a member of a two-member subscriber group (or of the publisher); a power cut (either
side's data directory on powerfs, tests/powerfs.py, a FUSE file system that keeps what was
not fsynced in memory: the side's processes are killed and everything not fsynced is
dropped, then they restart on what survived), to the subscriber, the publisher or both at
once, every other cut after the stream paused for longer than that bound, where a handler
may run again only for a run that ended within the bound the README
states (less than RERUN_BOUND before the cut: "reruns after power cut"; older ones count as
duplicated), every journal event moved to a segment before a cut must be in one at the end
and each bus must come back as itself (the same node id: not a silently empty store), or it
counts as a state error; kill -9 of either side
of an ordered subscription, where "out of order" counts messages first handled after one
published later (must be 0); kill -9 of a subscriber whose handler counts in
``message.kv`` and publishes a forwarded event in its transaction (or of its publisher),
where a third bus (the sink) must get exactly one forwarded event per acknowledged message
and the stored count must equal the messages handled: a forwarded event missing counts as
lost, a second one as duplicated, a count off as a state error, reruns after kill -9
notwithstanding (a rerun's staged writes die with the run that was killed). In a group, a message the killed member had stored but not
acknowledged is also given to the other member: counted apart ("group handovers"), the
bound the README states. Faults
that need root or a kernel feature this machine lacks are skipped with a note saying why.

Each run's journals are then audited (servicebus/audit, one Spark session for the whole
invocation) and the audit's classes compared, message by message, with the counts above
(tools/chaos_audit.py says what must agree); a disagreement fails the run, printed and in
the JSON (``audit``: classes, disagreements, seconds). Without pyspark or Java 17+ the audit
is skipped, said on stderr and in the JSON (``audit.skipped``); ``--no-audit`` skips it on
purpose. Exit code 0 when nothing was lost or duplicated and the audit agreed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.faults import (  # noqa: E402
    Partition, PowerLossDisk, SmallDisk, cannot_cut_power, cannot_drop_packets, cannot_mount,
    cannot_partition, forget_moved_clock, libfaketime, moved_clock_env)
from tools.chaos_audit import Auditor, write_facts  # noqa: E402
from servicebus.hooks.segments import is_segment, read_segment  # noqa: E402

NODE = str(ROOT / "tools" / "chaos_node.py")
CLI = str(Path(sys.executable).parent / "servicebus")

# kind -> (faults in the short profile, in the long one). The long one is >= 100 faults.
KINDS = {
    "kill-subscriber": (2, 18),
    "kill-publisher": (2, 16),
    "pause": (2, 14),
    "partition": (1, 10),
    "packet-loss": (1, 8),
    "disk-full": (2, 12),
    "clock": (2, 12),
    "store-damage": (4, 12),
    # A subscriber group of two members, one of them (or the publisher) killed with SIGKILL.
    "group-kill": (2, 10),
    # An ordered subscription, either side killed with SIGKILL: handled in publish order.
    "ordered-kill": (2, 10),
    # A handler's kv count and forwarded event in its transaction; the subscriber (mostly) killed.
    "transaction-kill": (2, 10),
    # The power goes under the subscriber, the publisher or both: what was not fsynced is lost.
    "power-loss": (2, 12),
    # A retaining publisher publishes before the subscriber exists; the subscriber starts at
    # "earliest" and is slower than the publisher, so it replays a backlog throughout; either
    # side is killed with SIGKILL during that replay.
    "replay-kill": (2, 10),
    # Services by name: the subscriber (subscribed by name, from a seed) is killed with
    # SIGKILL and started again with the same data directory at a NEW address (another
    # port); discovery tells the publisher, and what was owed to it follows it there.
    "move-subscriber": (2, 10),
    # The HTTP gateway: the publisher publishes through its own gateway over HTTP (POST
    # ?many=true, acknowledged = a 201's ids), and the process is killed with SIGKILL at
    # random instants (gateway and bus together); every 201 must be handled once.
    "gateway-kill": (2, 10),
}
# move-subscriber: discovery at a test's pace (Bus(gossip_interval=, down_after=)).
NAMED_GOSSIP = ("--gossip-interval", "0.2", "--down-after", "1.0")
# A handler may run again after a power cut only if its run ended less than this before the
# cut: the bus syncs unsynced writes SYNC_INTERVAL (0.2 s) after they were made, plus an
# engine turn and a synced write (here through a FUSE file system in Python, on 2 shared
# cores), or while LevelDB writes out a full memtable (README, Guarantees).
RERUN_BOUND = 1.0
DAMAGE = ("missing CURRENT", "garbage record", "truncated table", "flipped bits")


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# --- one bus process -----------------------------------------------------------------------------


class Node:
    def __init__(self, role: str, work: Path, bind: str, prefix: list[str], peer: str | None = None,
                 disk: SmallDisk | PowerLossDisk | None = None, name: str | None = None,
                 options: tuple[str, ...] = (), handled: str = "handled") -> None:
        self.role, self.bind, self.prefix, self.peer, self.disk = role, bind, prefix, peer, disk
        self.name, self.options = name or role, options
        base = disk.path if disk is not None else work
        self.datadir = base / self.name
        self.ready = work / f"{self.name}.ready"
        self.log = work / f"{self.name}.log"
        self.stop_file = work / f"{self.name}.stop"
        self.quiet = work / f"{self.name}.quiet"
        self.acks = work / "acks"
        self.handled = work / handled
        self.proc: subprocess.Popen | None = None
        self.killed: set[int] = set()  # pids ended with SIGKILL
        self.powered_off: set[int] = set()  # pids ended by a power cut (SIGKILL, then the cut)
        self.pids: set[int] = set()  # every pid it ran as
        self.clock = ""  # libfaketime offset of the running process

    def start(self, wait: bool = True) -> bool:
        self.ready.unlink(missing_ok=True)
        env = {**os.environ, **(moved_clock_env(self.clock) if self.clock else {})}
        cmd = [*self.prefix, sys.executable, NODE, "--role", self.role, "--bind", self.bind,
               "--datadir", str(self.datadir), "--ready", str(self.ready), "--stop", str(self.stop_file)]
        if self.role in ("sub", "sink"):
            cmd += ["--peer", self.peer, "--handled", str(self.handled), *self.options]
        else:
            cmd += ["--acks", str(self.acks), "--quiet", str(self.quiet), *self.options]
        with open(self.log, "ab") as out:
            # Its own process group: every signal goes to the group, so nothing the node
            # started (the netns prefix's child included) outlives it.
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=out, env=env,
                                         start_new_session=True)
        return self.wait_ready() if wait else True

    def wait_ready(self, timeout: float = 60.0) -> bool:
        """True once ready; False if the process exited first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready.exists():
                self.pids.add(self.pid)
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.02)
        raise TimeoutError(f"{self.role} not ready within {timeout}s; log:\n{self.tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.killpg(self.proc.pid, sig)

    @property
    def pid(self) -> int:
        """The bus's own pid (the one its handler runs record), as its ready file says, in
        case a prefix forked rather than exec'ed it."""
        try:
            return int(self.ready.read_text())
        except (OSError, ValueError):
            return self.proc.pid

    def kill(self) -> None:
        if self.alive():
            self.killed.add(self.pid)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            forget_moved_clock(self.pid)

    def stop(self, timeout: float = 30.0) -> None:
        if not self.alive():
            return
        self.stop_file.touch()
        try:
            self.proc.wait(timeout)
            forget_moved_clock(self.pid)  # a node may end with os._exit, past libfaketime's cleanup
        except subprocess.TimeoutExpired:
            self.kill()
        self.stop_file.unlink(missing_ok=True)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""


# --- faults --------------------------------------------------------------------------------------


@dataclass
class Run:
    kind: str
    faults: int = 0
    acknowledged: int = 0
    handled: int = 0
    unacknowledged_handled: int = 0  # handled, though its publish never returned (killed, power cut)
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    reruns_after_kill: int = 0
    reruns_after_power_cut: int = 0  # within RERUN_BOUND of the cut (the README's bound)
    handovers_after_kill: int = 0  # group: stored by a member killed before it acked, also given to another
    out_of_order: int = 0  # ordered: handled (first time) after a message published later
    state_errors: list[str] = field(default_factory=list)  # transaction: kv count != messages handled
    reported_lost: set[str] = field(default_factory=set)
    deadletters: set[str] = field(default_factory=set)
    repairs: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    skipped: str | None = None
    # The ids behind the counts, for the delivery audit's comparison (tools/chaos_audit.py;
    # WORK/counts.json with --keep); not in the JSON output.
    facts: dict = field(default_factory=dict)
    audit: dict | None = None  # the audit's classes and its disagreements with the counts


class Chaos:
    def __init__(self, kind: str, work: Path, rng: random.Random, env: "Environment") -> None:
        self.kind, self.work, self.rng, self.env = kind, work, rng, env
        self.run = Run(kind)
        self.sub: Node = None  # type: ignore[assignment]
        self.pub: Node = None  # type: ignore[assignment]
        self.subs: list[Node] = []  # every subscriber process (two members for group-kill)
        self.sink: Node | None = None  # transaction-kill: receives what the subscriber forwards
        self.power: dict[str, PowerLossDisk] = {}  # power-loss: each side's disk
        self.cuts: list[float] = []  # power-loss: wall time of each cut
        self.cut_sides: list[str] = []
        self.dropped = 0  # bytes the cuts dropped (written, not fsynced)
        self.quiet_cuts = 0  # cuts after the stream paused
        self.moved: set[str] = set()  # journal lines in segments at some cut

    # -- the workload --

    def setup(self, stack: ExitStack) -> None:
        part, disks = self.env.partition, {}
        if self.kind == "power-loss":
            # Entered before the nodes' stop callback: they stop first, then it unmounts.
            for role in ("pub", "sub"):
                self.power[role] = stack.enter_context(PowerLossDisk(self.work / f"{role}-power"))
            disks = dict(self.power)
        elif self.env.can_mount:
            for role in ("pub", "sub"):
                disks[role] = stack.enter_context(SmallDisk(self.work / f"{role}-disk", 64))
        port = self.rng.randrange(20000, 60000)
        if part is not None:
            pub_bind, sub_bind = f"tcp://{part.ip['a']}:{port}", f"tcp://{part.ip['b']}:{port + 1}"
            pub_prefix, sub_prefix = part.prefix("a"), part.prefix("b")
        else:
            pub_bind, sub_bind = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"
            pub_prefix = sub_prefix = []
        options: tuple[str, ...] = {
            "group-kill": ("--group", "workers"), "ordered-kill": ("--ordered",),
            "transaction-kill": ("--transact", "--kv-out", str(self.work / "kv-count")),
            "replay-kill": ("--start", "earliest", "--handler-ms", "2.5"),
        }.get(self.kind, ())
        pub_options: tuple[str, ...] = {"replay-kill": ("--retention", "3600"),
                                        "gateway-kill": ("--http",)}.get(self.kind, ())
        peer = pub_bind
        if self.kind == "move-subscriber":  # by name: the subscriber knows the publisher's name and a seed
            pub_options, peer = ("--name", "chaos-pub", *NAMED_GOSSIP), "chaos-pub"
            options = ("--name", "chaos-sub", "--seed", pub_bind, *NAMED_GOSSIP)
        self.pub = Node("pub", self.work, pub_bind, pub_prefix, disk=disks.get("pub"), options=pub_options)
        self.sub = Node("sub", self.work, sub_bind, sub_prefix, peer=peer, disk=disks.get("sub"),
                        options=options)
        self.subs = [self.sub]
        if self.kind == "group-kill":
            bind2 = sub_bind.rsplit(":", 1)[0] + f":{port + 2}"
            self.subs.append(Node("sub", self.work, bind2, sub_prefix, peer=pub_bind, name="sub2",
                                  options=options))
        if self.kind == "transaction-kill":
            bind3 = sub_bind.rsplit(":", 1)[0] + f":{port + 2}"
            self.sink = Node("sink", self.work, bind3, sub_prefix, peer=sub_bind, handled="sink-handled")
        stack.callback(self._stop_all)
        if self.kind == "replay-kill":  # the publisher alone first: what it retains is replayed
            if not self.pub.start():
                raise RuntimeError(f"the publisher did not start:\n{self.pub.tail()}")
            time.sleep(2.0)
            before = len(self.pub.acks.read_text().split()) if self.pub.acks.exists() else 0
            self.run.notes.append(f"{before} acknowledged before the subscriber existed (retained, "
                                  "replayed from earliest)")
        if not self.pub.alive():
            self.pub.start(wait=False)
        for sub in self.subs + ([self.sink] if self.sink else []):
            if not sub.start():
                raise RuntimeError(f"the {sub.name} did not start:\n{sub.tail()}")
        if not self.pub.wait_ready():
            raise RuntimeError(f"the publisher did not start:\n{self.pub.tail()}")

    @property
    def nodes(self) -> list[Node]:
        return [n for n in (self.pub, *self.subs, self.sink) if n is not None]

    def _stop_all(self) -> None:
        for node in self.nodes:
            node.stop()

    def supervise(self) -> None:
        """A node that exited on its own (a store damaged while running, found after the
        fault) is repaired and restarted: what a careful operator would do."""
        for node in self.nodes:
            if node.alive():
                continue
            if node.proc.returncode == 3:
                self.repair(node)
            else:  # it crashed: say so loudly, and go on as an operator's restart would
                self.run.notes.append(f"the {node.role} exited with {node.proc.returncode}: "
                                      f"{node.tail()[-300:]!r}")
            self.restart(node)

    def restart(self, node: Node) -> None:
        for _ in range(3):
            if node.start():
                return
            if node.proc.returncode == 3:  # its store is damaged: repair, then start again
                self.repair(node)
        raise RuntimeError(f"{node.role} does not start:\n{node.tail()}")

    def repair(self, node: Node) -> None:
        checked = subprocess.run([CLI, "check", str(node.datadir)], capture_output=True, text=True)
        if checked.returncode not in (0, 4):
            self.run.notes.append(f"check exited {checked.returncode}: {checked.stderr.strip()[:200]}")
        repaired = subprocess.run([CLI, "check", str(node.datadir), "--repair", "--json"],
                                  capture_output=True, text=True)
        self.run.repairs += 1
        if repaired.returncode != 0:
            raise RuntimeError(f"check --repair of {node.role} failed: {repaired.stderr.strip()}")
        for line in repaired.stdout.splitlines():
            row = json.loads(line)
            if row["problem"].startswith("lost") or row["action"].startswith("dropped: LOST"):
                self.run.reported_lost.add(row["key"].split("\x00")[-1])  # outgoing keys: stream NUL id

    # -- one fault of each kind --

    def inject(self, i: int) -> None:
        getattr(self, "fault_" + self.kind.replace("-", "_"))(i)
        self.run.faults += 1
        self.supervise()

    def fault_kill_subscriber(self, i: int) -> None:
        self.sub.kill()
        self.restart(self.sub)

    def fault_kill_publisher(self, i: int) -> None:
        self.pub.kill()
        self.restart(self.pub)

    def fault_gateway_kill(self, i: int) -> None:
        self.fault_kill_publisher(i)

    def fault_group_kill(self, i: int) -> None:
        node = self.rng.choice((*self.subs, *self.subs, self.pub))  # mostly a member
        node.kill()
        time.sleep(self.rng.uniform(0.0, 2.0))  # the other member takes over meanwhile
        self.restart(node)

    def fault_ordered_kill(self, i: int) -> None:
        node = (self.sub, self.pub)[i % 2]
        node.kill()
        self.restart(node)

    def fault_transaction_kill(self, i: int) -> None:
        node = self.rng.choice((self.sub, self.sub, self.sub, self.pub))  # mostly mid-transaction
        node.kill()
        self.restart(node)

    def fault_replay_kill(self, i: int) -> None:
        node = (self.sub, self.pub)[i % 2]
        node.kill()
        self.restart(node)

    def fault_move_subscriber(self, i: int) -> None:
        """kill -9, then the same data directory at another port: the same instance (node
        id) at a new address, which it gossips to the instances it knows (its table is
        stored). The publisher moves its backlog and cursors there (Roster.move)."""
        self.sub.kill()
        host, port = self.sub.bind.rsplit(":", 1)
        self.sub.bind = f"{host}:{int(port) + 100 + i}"
        self.run.notes.append(f"subscriber moved to {self.sub.bind}")
        self.restart(self.sub)

    def fault_power_loss(self, i: int) -> None:
        side = ("sub", "both", "pub")[i % 3]
        nodes = {"sub": [self.sub], "pub": [self.pub], "both": [self.pub, self.sub]}[side]
        quiet = i % 2 == 1
        if quiet:
            # Every other cut comes after the stream paused for longer than the rerun bound:
            # with no new message to fsync, the last runs' completions must be synced anyway.
            self.pub.quiet.touch()
            time.sleep(self.rng.uniform(1.2, 2.0))
            self.quiet_cuts += 1
        for node in nodes:  # the power goes: both die at the same instant, then the disk forgets
            node.powered_off.add(node.pid)
            node.kill()
        self.cuts.append(time.time())  # a run that ended before this ended before the cut
        self.cut_sides.append(side)
        self.moved |= journal_lines(self.pub.datadir) | journal_lines(self.sub.datadir)
        for node in nodes:
            self.dropped += self.power[node.role].cut()["dropped_bytes"]
        for node in nodes:
            node.start(wait=False)  # the publisher waits for its subscriber, which waits for it
        for node in nodes:
            if not node.wait_ready():
                self.run.state_errors.append(f"the {node.role} did not start after a power cut: "
                                             f"{node.tail()[-300:]!r}")
                self.restart(node)
        if quiet:
            self.pub.quiet.unlink(missing_ok=True)

    def fault_pause(self, i: int) -> None:
        node = self.rng.choice((self.pub, self.sub))
        node.signal(signal.SIGSTOP)
        time.sleep(self.rng.uniform(0.5, 3.0))
        node.signal(signal.SIGCONT)

    def fault_partition(self, i: int) -> None:
        self.env.partition.cut()
        time.sleep(self.rng.uniform(1.0, 6.0))  # shorter and longer than peer_timeout (3 s)
        self.env.partition.heal()

    def fault_packet_loss(self, i: int) -> None:
        self.env.partition.lossy(0.3)
        time.sleep(self.rng.uniform(2.0, 5.0))
        self.env.partition.clear()

    def fault_disk_full(self, i: int) -> None:
        node = (self.pub, self.sub)[i % 2]
        node.disk.fill()
        time.sleep(self.rng.uniform(1.0, 3.0))
        node.disk.free()

    def fault_clock(self, i: int) -> None:
        # The publisher's clock goes back an hour more each time; the subscriber's forward
        # past the 7-day dedupe window. libfaketime moves a process's clock from its start.
        node = (self.pub, self.sub)[i % 2]
        node.clock = f"-{i // 2 + 1}h" if node is self.pub else f"+{8 * (i // 2 + 1)}d"
        node.stop()
        self.restart(node)

    def fault_store_damage(self, i: int) -> None:
        node = (self.sub, self.pub)[i % 2]
        how = DAMAGE[i % len(DAMAGE)]  # each kind of damage, on both sides in turn
        node.kill()
        what = damage(node.datadir / "store", how, self.rng)
        lost_before = len(self.run.reported_lost)
        opened = node.start()
        if opened and how in ("missing CURRENT", "garbage record"):
            self.run.notes.append(f"{how}: the {node.role} opened a damaged store")
        if not node.alive():
            self.repair(node)
            self.restart(node)
        self.run.notes.append(
            f"{how} in the {node.role}'s {what}: {'opened (damage not read at start)' if opened else 'refused to start'}"
            f"{'' if opened else f', repaired, {len(self.run.reported_lost) - lost_before} reported lost'}")

    # -- counting --

    def count(self) -> None:
        acked = self.pub.acks.read_text().split() if self.pub.acks.exists() else []
        handlings: dict[str, list[int]] = {}
        order: list[str] = []  # ids in the order they were first handled
        ended: dict[tuple[str, int], float] = {}  # (id, pid) -> when that run ended
        if self.sub.handled.exists():
            for line in self.sub.handled.read_text().splitlines():
                parts = line.split()
                if len(parts) == 3:  # id, pid, wall time
                    if parts[0] not in handlings:
                        order.append(parts[0])
                    handlings.setdefault(parts[0], []).append(int(parts[1]))
                    ended[parts[0], int(parts[1])] = float(parts[2])
        run = self.run
        run.acknowledged = len(acked)
        run.handled = sum(1 for mid in acked if mid in handlings)
        run.unacknowledged_handled = len(set(handlings) - set(acked))
        listings = [subprocess.Popen([CLI, "deadletters", str(node.datadir), "--json", "--limit", "0"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                    for node in self.nodes]  # all at once: each is a CLI's start-up
        for listing in listings:
            stdout, _ = listing.communicate()
            run.deadletters |= {json.loads(line)["id"] for line in stdout.splitlines()}
        run.lost = [mid for mid in acked if mid not in handlings
                    and mid not in run.reported_lost and mid not in run.deadletters]
        killed = {pid for sub in self.subs for pid in sub.killed} - self.sub.powered_off
        powered_off = self.sub.powered_off
        members = {pid: sub.name for sub in self.subs for pid in sub.pids}
        for mid, pids in handlings.items():
            for earlier, later in zip(pids, pids[1:]):
                if earlier in powered_off:
                    at = ended.get((mid, earlier), 0.0)
                    cut = next((c for c in self.cuts if c >= at), None)
                    if cut is not None and cut - at <= RERUN_BOUND:
                        run.reruns_after_power_cut += 1  # within the README's bound
                    else:
                        run.duplicated.append(mid)
                elif earlier in killed:
                    run.reruns_after_kill += 1  # the documented window (see the docstring)
                elif members.get(earlier) != members.get(later) and killed:
                    run.handovers_after_kill += 1  # the documented group bound (README)
                else:
                    run.duplicated.append(mid)
        if self.kind == "ordered-kill":
            run.out_of_order = sum(1 for a, b in zip(order, order[1:]) if b < a)
        if self.kind == "power-loss":
            self.count_power_loss(handlings, ended)
        forwarded = self.count_effects(acked, handlings) if self.sink is not None else []
        run.facts = {"acknowledged": acked, "handled": sorted(handlings), "forwarded": forwarded,
                     "lost": list(run.lost), "duplicated": list(run.duplicated),
                     "reported_lost": sorted(run.reported_lost), "deadletters": sorted(run.deadletters)}
        if len(self.subs) > 1:  # proof that the group shared the work
            share = {sub.name: sum(1 for pids in handlings.values() if members.get(pids[0]) == sub.name)
                     for sub in self.subs}
            run.notes.append("first handled by member: " + ", ".join(f"{k} {v}" for k, v in share.items()))

    def count_power_loss(self, handlings: dict[str, list[int]], ended: dict[tuple[str, int], float]) -> None:
        """What power-loss checks beyond lost and duplicated: journal events moved out before
        a cut are still in a segment, each bus came back as itself (a store that came back
        empty would start a new node), and the figures that prove the cuts were real."""
        run = self.run
        vanished = self.moved - journal_lines(self.pub.datadir) - journal_lines(self.sub.datadir)
        if vanished:
            run.state_errors.append(f"{len(vanished)} journal events moved to a segment before a cut are gone")
        for node in (self.pub, self.sub):
            ids = set(re.findall(r"bus ([0-9a-f]{16}) up at", node.log.read_text(errors="replace")))
            if len(ids) != 1:
                run.state_errors.append(f"the {node.role} came back as another node ({sorted(ids)}): "
                                        "its store was replaced")
        ages = []
        for mid, pids in handlings.items():
            for earlier in pids[:-1]:
                at = ended.get((mid, earlier), 0.0)
                cut = next((c for c in self.cuts if c >= at), None)
                if earlier in self.sub.powered_off and cut is not None:
                    ages.append(cut - at)
        sides = {side: self.cut_sides.count(side) for side in ("sub", "pub", "both")}
        run.notes.append(
            f"{len(self.cuts)} power cuts (subscriber {sides['sub']}, publisher {sides['pub']}, both "
            f"{sides['both']}; {self.quiet_cuts} after the stream paused 1.2-2 s), {self.dropped // 1024} KiB written and not fsynced dropped; "
            f"{len(self.moved)} journal events moved out before a cut, {len(vanished)} gone; reruns: "
            f"{len(ages)}, the oldest ended {max(ages, default=0.0):.3f} s before its cut")

    def count_effects(self, acked: list[str], handlings: dict[str, list[int]]) -> list[str]:
        """A transacting handler's effects: one forwarded event per acknowledged message at the
        sink (never killed, so any second one is a duplicate), and the stored count equal to
        the distinct messages handled, whatever reruns a kill -9 caused. Returns the ids of
        the forwarded events the sink handled."""
        forwarded: dict[str, list[str]] = {}
        if self.sink is not None and self.sink.handled.exists():
            for line in self.sink.handled.read_text().splitlines():
                parts = line.split()
                if len(parts) == 3:
                    forwarded.setdefault(parts[0], []).append(parts[1])
        run = self.run
        run.lost += [f"forward of {mid}" for mid in acked if mid in handlings and mid not in forwarded]
        run.duplicated += [f"forward of {mid}" for mid, ids in forwarded.items() if len(ids) > 1]
        counted = self.work / "kv-count"
        stored = int(counted.read_text()) if counted.exists() else None
        handled = len(handlings)
        if stored != handled:
            run.state_errors.append(f"kv count {stored} != {handled} messages handled")
        run.notes.append(f"forwarded events at the sink: {len(forwarded)} for {handled} messages handled "
                         f"({sum(len(p) - 1 for p in handlings.values())} handler reruns); kv count {stored}")
        return sorted({fid for ids in forwarded.values() for fid in ids})

    def evidence(self) -> None:
        """What the buses themselves logged about the faults: proof they were real."""
        logs = "".join(n.log.read_text(errors="replace") for n in (self.pub, *self.subs) if n.log.exists())
        seen = {
            "disk-full": ("the store cannot be written", "store failures logged"),
            "partition": ("is down", "peers seen down"),
            "packet-loss": ("is down", "peers seen down"),
            "move-subscriber": ("what is owed to it follows", "moves seen by the publisher"),
            "gateway-kill": ("gateway for tcp://", "gateway starts"),
        }.get(self.kind)
        if seen:
            self.run.notes.append(f"{logs.count(seen[0])} {seen[1]}")
        if "kill" in self.kind or self.kind == "move-subscriber":
            killed = len(self.pub.killed) + sum(len(sub.killed) for sub in self.subs)
            self.run.notes.append(f"{killed} processes killed with SIGKILL")

    def settle(self, timeout: float = 120.0) -> None:
        """Stop publishing and wait until every acknowledged message is accounted for.

        The acks are read only once the publisher said it is quiet (or is not running): a
        publish under way when the quiet file appeared is appended after it, and counting
        before that stopped the subscriber with that batch still owed (CI saw 10 "lost")."""
        seen = Path(f"{self.pub.quiet}.seen")
        seen.unlink(missing_ok=True)
        self.pub.quiet.touch()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.supervise()
            if not seen.exists() and self.pub.alive():
                time.sleep(0.05)
                continue
            acked = set(self.pub.acks.read_text().split()) if self.pub.acks.exists() else set()
            # A group's members write to one file (appends of a line each are atomic).
            done = {line.split()[0] for line in self.sub.handled.read_text().splitlines() if line.strip()} \
                if self.sub.handled.exists() else set()
            if self.sink is not None:  # and what the handlers forwarded reached the sink
                done &= {line.split()[0] for line in self.sink.handled.read_text().splitlines() if line.strip()} \
                    if self.sink.handled.exists() else set()
            if acked <= done | self.run.reported_lost:
                return
            time.sleep(0.1)
        self.run.notes.append(f"not everything arrived within {timeout:.0f}s of healing")


def journal_lines(datadir: Path) -> set[str]:
    """Every event of a bus's journal segments, of either format (hooks/segments.py: the
    columnar .jcol a bus writes, the .jsonl of older ones), each as one JSON string (a
    segment is whole: written, fsynced, renamed)."""
    journal = datadir / "journal"
    if not journal.is_dir():
        return set()
    return {json.dumps(e, sort_keys=True, ensure_ascii=False)
            for path in journal.iterdir() if is_segment(path.name) for e in read_segment(path)}


def damage(store: Path, how: str, rng: random.Random) -> str:
    """Damage a stopped bus's store the way disks and people do; say what was hit."""
    import plyvel

    if how == "missing CURRENT":
        (store / "CURRENT").unlink(missing_ok=True)
        return "CURRENT file"
    if how == "garbage record":
        db = plyvel.DB(str(store))
        keys = [k for prefix in (b"s/", b"d/", b"i/") for k in db.iterator(prefix=prefix, include_value=False)]
        victim = rng.choice(keys) if keys else b"m/node"
        db.put(victim, b"\xc1 garbage")
        db.close()
        return f"record {victim[:2].decode()}…"
    files = sorted(store.glob("*.ldb"), key=lambda p: p.stat().st_size) or sorted(store.glob("*.log"))
    if not files:
        return "nothing (no file)"
    victim = files[-1]
    data = bytearray(victim.read_bytes())
    if how == "truncated table":
        victim.write_bytes(bytes(data[: len(data) // 2]))
    else:  # flipped bits
        for _ in range(8):
            at = rng.randrange(len(data))
            data[at] ^= 1 << rng.randrange(8)
        victim.write_bytes(bytes(data))
    return f"{victim.name} ({len(data) // 1024} KiB)"


# --- the environment and the table -----------------------------------------------------------------


@dataclass
class Environment:
    partition: Partition | None
    can_mount: bool
    why_not: dict[str, str]


def environment(stack: ExitStack) -> Environment:
    why_not: dict[str, str] = {}
    no_mount = cannot_mount()
    if no_mount:
        why_not["disk-full"] = no_mount
    no_netns = cannot_partition()
    partition = None
    if no_netns:
        why_not["partition"] = why_not["packet-loss"] = no_netns
    else:
        partition = stack.enter_context(Partition())
        no_drop = cannot_drop_packets()
        if no_drop:
            why_not["packet-loss"] = no_drop
    if libfaketime() is None:
        why_not["clock"] = "libfaketime is not installed (Debian package faketime)"
    no_power = cannot_cut_power()
    if no_power:
        why_not["power-loss"] = no_power
    return Environment(partition, not no_mount, why_not)


def keep_journals(nodes: list, to: Path) -> None:
    """Copy each node's journal (its delivery events) out of its data directory, which may
    be on a tmpfs mount the run takes down: ``servicebus audit WORK/journals --out ...``
    then audits the run. A bus flushes its journal when it closes (the nodes stopped)."""
    for node in nodes:
        source = node.datadir / "journal"
        if source.is_dir():
            shutil.copytree(source, to / node.name / "journal", dirs_exist_ok=True)


def run_kind(kind: str, count: int, env: Environment, rng: random.Random, keep: bool,
             auditor: Auditor | None = None) -> Run:
    """One kind's run; then, with an ``auditor`` that can, the delivery audit of its journals
    compared with its counts (``run.audit``). Its work directory is removed unless ``keep``."""
    if kind in env.why_not:
        run = Run(kind)
        run.skipped = env.why_not[kind]
        return run
    work = Path(tempfile.mkdtemp(prefix=f"chaos-{kind}-"))
    began = time.monotonic()
    chaos = Chaos(kind, work, rng, env)
    try:
        with ExitStack() as stack:
            chaos.setup(stack)
            for i in range(count):
                time.sleep(rng.uniform(0.5, 1.5))  # the workload runs between faults
                chaos.inject(i)
            time.sleep(1.0)
            chaos.settle()
            # The publisher and the subscribers at once (each polls its stop file, then
            # closes its bus); the sink after them: a subscriber writes its count at stop,
            # once what it forwarded reached the sink.
            with ThreadPoolExecutor() as stopping:
                list(stopping.map(Node.stop, [n for n in chaos.nodes if n is not chaos.sink]))
            if chaos.sink is not None:
                chaos.sink.stop()
            chaos.count()
            chaos.evidence()
            # Before the stack unmounts the small disks the data directories are on.
            keep_journals(chaos.nodes, work / "journals")
        chaos.run.seconds = time.monotonic() - began
        if keep:
            write_facts(work, chaos.run.facts)
        if auditor is not None:
            chaos.run.audit = auditor.audit(work, chaos.run.facts, report=keep)
    finally:
        chaos.run.seconds = chaos.run.seconds or time.monotonic() - began
        if env.partition is not None:
            env.partition.heal()
            env.partition.clear()
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            chaos.run.notes.append(f"kept {work}")
    return chaos.run


def audit_cell(audit: dict | None) -> str:
    if not audit:
        return "-"
    if audit.get("skipped"):
        return "skipped"
    if not audit["agrees"]:
        return f"{len(audit['disagreements'])} disagree"
    return f"agrees ({audit['seconds']:.0f} s)"


def table(runs: list[Run]) -> str:
    head = ("fault", "injected", "acknowledged", "handled", "handled, publish never returned", "lost", "duplicated",
            "reruns after kill -9", "reruns after power cut", "group handovers after kill -9", "out of order",
            "reported lost by repair", "state errors", "dead letters", "seconds", "audit")
    rows = []
    for r in runs:
        if r.skipped:
            rows.append((r.kind, "skipped: " + r.skipped, *[""] * (len(head) - 2)))
            continue
        rows.append((r.kind, r.faults, r.acknowledged, r.handled, r.unacknowledged_handled, len(r.lost), len(r.duplicated),
                     r.reruns_after_kill, r.reruns_after_power_cut, r.handovers_after_kill, r.out_of_order,
                     len(r.reported_lost), len(r.state_errors), len(r.deadletters), f"{r.seconds:.0f}",
                     audit_cell(r.audit)))
    done = [r for r in runs if not r.skipped]
    rows.append(("total", sum(r.faults for r in done), sum(r.acknowledged for r in done),
                 sum(r.handled for r in done), sum(r.unacknowledged_handled for r in done),
                 sum(len(r.lost) for r in done),
                 sum(len(r.duplicated) for r in done), sum(r.reruns_after_kill for r in done),
                 sum(r.reruns_after_power_cut for r in done), sum(r.handovers_after_kill for r in done), sum(r.out_of_order for r in done),
                 sum(len(r.reported_lost) for r in done), sum(len(r.state_errors) for r in done),
                 sum(len(r.deadletters) for r in done),
                 f"{sum(r.seconds for r in done):.0f}",
                 f"{sum(len(r.audit.get('disagreements', ())) for r in done if r.audit)} disagree"))
    widths = [max(len(str(row[i])) for row in [head, *rows]) for i in range(len(head))]
    line = lambda row: "| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--long", action="store_true", help="at least 100 faults (minutes); default: a short profile")
    ap.add_argument("--only", action="append", choices=list(KINDS), help="only this kind of fault")
    ap.add_argument("--seed", type=int, default=None, help="random seed (printed; repeat a run with it)")
    ap.add_argument("--json", action="store_true", help="print the runs as JSON")
    ap.add_argument("--keep", action="store_true",
                    help="keep each run's work directory: a copy of every journal in WORK/journals, the "
                         "counts' ids in WORK/counts.json, the audit's tables and report in WORK/audit")
    ap.add_argument("--no-audit", action="store_true",
                    help="skip the delivery audit of each run's journals (PySpark; compared with the counts)")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    log(f"tools/chaos: seed {seed}, {'long' if args.long else 'short'} profile")
    runs = []
    auditor = Auditor(not args.no_audit, log)
    with ExitStack() as stack:
        stack.callback(auditor.close)
        env = environment(stack)
        for kind in args.only or KINDS:
            count = KINDS[kind][1 if args.long else 0]
            log(f"== {kind}: {count} fault(s)")
            run = run_kind(kind, count, env, rng, args.keep, auditor)
            log(f"   {run.skipped and 'skipped: ' + run.skipped or f'acknowledged {run.acknowledged}, lost {len(run.lost)}, duplicated {len(run.duplicated)}, out of order {run.out_of_order}'}")
            if run.audit and not run.audit.get("skipped"):
                log(f"   audit ({run.audit.get('seconds', '?')} s): {run.audit.get('classes')}; "
                    + ("agrees with the counts" if run.audit["agrees"] else "DISAGREES: " + "; ".join(run.audit["disagreements"])))
            runs.append(run)
    if args.json:
        print(json.dumps({"seed": seed, "audit": {"skipped": auditor.skipped} if auditor.skipped else {"skipped": None},
                          "runs": [{
            **{k: v for k, v in r.__dict__.items() if k not in ("reported_lost", "deadletters", "lost", "duplicated", "facts")},
            "lost": r.lost[:50], "duplicated": r.duplicated[:50], "reported_lost": len(r.reported_lost),
            "deadletters": len(r.deadletters)} for r in runs]}, indent=1))
    else:
        print(f"tools/chaos, {time.strftime('%Y-%m-%d')}, seed {seed}, {os.cpu_count()} cores")
        print(table(runs))
        for r in runs:
            for note in r.notes:
                print(f"note ({r.kind}): {note}")
            if r.lost:
                print(f"LOST ({r.kind}): {' '.join(r.lost[:20])}")
            if r.duplicated:
                print(f"DUPLICATED ({r.kind}): {' '.join(r.duplicated[:20])}")
            for error in r.state_errors:
                print(f"STATE ({r.kind}): {error}")
            if r.audit and r.audit.get("classes"):
                print(f"audit ({r.kind}): " + ", ".join(f"{k} {v}" for k, v in r.audit["classes"].items() if v))
            for disagreement in (r.audit or {}).get("disagreements", []):
                print(f"AUDIT DISAGREES ({r.kind}): {disagreement}")
        if auditor.skipped:
            print(f"the delivery audit was skipped: {auditor.skipped}")
    bad = any(r.lost or r.duplicated or r.out_of_order or r.state_errors or (r.audit and r.audit.get("disagreements"))
              for r in runs)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
