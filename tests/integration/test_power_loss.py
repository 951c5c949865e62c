"""Power loss (DESIGN.md section 3, rule 12): real bus processes whose data directories are
on a file system that keeps every write in memory until it is fsynced and drops it at a
"power cut" (tests/powerfs.py). SIGKILL keeps the page cache; a power cut does not, so these
are the tests where an unsynced write the design relies on can actually be lost.

Counted Jepsen-style from what the processes wrote down outside the cut disk (the world the
bus acts on): acknowledged = ids whose publish returned; handled = ids a handler finished;
lost = acknowledged, never handled, not a dead letter. A handler may run a second time only
if its first run finished within the bound stated in the README (Guarantees, power loss):
less than ``SYNC_INTERVAL`` plus one synced write before the cut, which these tests check
with room for a loaded machine (``RERUN_BOUND``)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from servicebus.store import Store
from servicebus.testing import wait_until

from ..conftest import BusProcess
from ..faults import PowerLossDisk, cannot_cut_power
from ..journals import event_counts

TOPIC = "power.event"
CLI = str(Path(sys.executable).parent / "servicebus")
# The bus syncs unsynced writes at most SYNC_INTERVAL (0.2 s) after they were made; on this
# shared 2-core machine, through a FUSE file system in Python, an engine turn and a synced
# write can take a few hundred ms more. A rerun of a run that ended longer ago than this
# before the cut is a duplicate beyond the bound.
RERUN_BOUND = 1.0


@pytest.fixture
def power(tmp_path):
    """``power(name)`` mounts a PowerLossDisk; every one is unmounted at the end, whatever
    happened (requested before ``bus_process``, so its processes are killed first)."""
    why = cannot_cut_power()
    if why:
        pytest.skip(why)
    with ExitStack() as stack:
        yield lambda name: stack.enter_context(PowerLossDisk(tmp_path / f"{name}-disk"))


def on(disk: PowerLossDisk, proc: BusProcess) -> BusProcess:
    proc.datadir = disk.path / proc.name
    return proc


def cut_power(disk: PowerLossDisk, *procs: BusProcess) -> int:
    """The processes on ``disk`` die with the power, then what was not fsynced is gone.
    Returns the bytes the cut dropped (the proof that it lost something). The cut comes
    before waiting for them to end: one may be held in a write the disk stalls, which only
    the cut ends (it fails: the power is gone)."""
    for proc in procs:
        if proc.proc is not None and proc.proc.poll() is None:
            os.killpg(proc.proc.pid, signal.SIGKILL)
    dropped = disk.cut()["dropped_bytes"]
    for proc in procs:
        proc.kill()  # waits for it
    return dropped


@dataclass
class Tally:
    acknowledged: list[str]
    runs: dict[str, list[float]]  # id -> wall times its handler runs finished
    datadir: Path  # the subscriber's
    cuts: list[float] = field(default_factory=list)  # wall times of the power cuts
    deadletters: set[str] = field(default_factory=set)
    journal: set[str] = field(default_factory=set)  # segment events seen before a cut (event_key)
    journal_lost: int = 0  # of those, missing at the end
    nodes: dict[str, set[str]] = field(default_factory=dict)  # name -> node ids it started as

    @property
    def handled(self) -> int:
        return sum(1 for mid in self.acknowledged if mid in self.runs)

    @property
    def lost(self) -> list[str]:
        return [mid for mid in self.acknowledged if mid not in self.runs and mid not in self.deadletters]

    def reruns(self) -> list[tuple[str, float]]:
        """(id, how long before the next cut its earlier run had finished) per second run."""
        out = []
        for mid, times in self.runs.items():
            for earlier, later in zip(times, times[1:]):
                cut = next((c for c in self.cuts if earlier <= c <= later), None)
                out.append((mid, float("inf") if cut is None else cut - earlier))
        return out

    def beyond_bound(self) -> list[tuple[str, float]]:
        return [(mid, age) for mid, age in self.reruns() if age > RERUN_BOUND]

    def summary(self) -> str:
        ages = [age for _, age in self.reruns()]
        return (f"acknowledged {len(self.acknowledged)}, handled {self.handled}, lost {len(self.lost)}, "
                f"reruns {len(ages)} (oldest {max(ages, default=0):.3f} s before its cut), "
                f"cuts {len(self.cuts)}, journal events moved before a cut {len(self.journal)} "
                f"(vanished {self.journal_lost})")


def handler_runs(proc: BusProcess) -> dict[str, list[float]]:
    runs: dict[str, list[float]] = defaultdict(list)
    for parts in proc.lines("done"):
        runs[parts[1]].append(float(parts[3]))
    return runs


def deadletters(datadir: Path) -> set[str]:
    listed = subprocess.run([CLI, "deadletters", str(datadir), "--json", "--limit", "0"],
                            capture_output=True, text=True)
    return {json.loads(line)["id"] for line in listed.stdout.splitlines()}


def stream_under_power_cuts(power, bus_process, *, cut: str, cuts: int, seed: int,
                            count: int = 2500, sub_args: tuple[str, ...] = ()) -> Tally:
    """A publisher streams ``count`` messages (~500/s) to a subscriber; the power is cut
    ``cuts`` times at random instants to ``cut`` ("sub", "pub" or "both"), each side
    restarted on what survived. Returns the tally once every acknowledged message is
    accounted for, both sides stopped."""
    rng = random.Random(seed)
    sub_disk = power("sub") if cut in ("sub", "both") else None
    pub_disk = power("pub") if cut in ("pub", "both") else None
    pub = bus_process("pub")
    sub = bus_process("sub", "--subscribe", pub.address, TOPIC, "--handle", TOPIC, *sub_args)
    if sub_disk:
        on(sub_disk, sub)
    if pub_disk:
        on(pub_disk, pub)
    publishing = ("--publish", TOPIC, "--batch", "10", "--rate", "500")
    pub.start(*publishing, "--count", str(count), wait_ready=False)  # it waits for a subscriber
    sub.start()
    pub.wait_ready()
    tally = Tally([], {}, sub.datadir)
    for _ in range(cuts):
        time.sleep(rng.uniform(0.4, 1.2))  # the fault's random instant, not a synchronisation
        on_the_cut_disks = [proc for proc, disk in ((pub, pub_disk), (sub, sub_disk)) if disk]
        for proc in on_the_cut_disks:  # the power goes: they stop at once, together
            proc.kill()  # (nothing stalls here: waiting for them is safe)
        tally.cuts.append(time.time())  # every handler run that ended before this ended before the cut
        for proc in (pub, sub):  # what the journals had moved out: it must all be there at the end
            tally.journal |= segment_lines(proc.datadir)
        for disk in (pub_disk, sub_disk):
            if disk:
                assert cut_power(disk) > 0, "the cut dropped nothing: it proved nothing"
        if pub_disk:  # on with the rest of the stream; ids are what it counted as acknowledged
            done = len(pub.published_ids())
            pub.start(*publishing, "--count", str(max(0, count - done)),
                      "--first", str(1_000_000 * len(tally.cuts)), wait_ready=False)
        if sub_disk:
            sub.start()  # ready once its subscription is confirmed: the publisher is up
        if pub_disk:
            pub.wait_ready()
    wait_until(lambda: len(pub.published_ids()) >= count, 60,
               message=lambda: f"{len(pub.published_ids())} of {count} published")
    acknowledged = pub.published_ids()
    wait_until(lambda: set(acknowledged) <= set(handler_runs(sub)), 60,
               message=lambda: f"{len(set(acknowledged) & set(handler_runs(sub)))} of {len(acknowledged)} handled")
    sub.stop()
    pub.stop()
    tally.acknowledged, tally.runs = acknowledged, handler_runs(sub)
    tally.deadletters = deadletters(sub.datadir) | deadletters(pub.datadir)
    tally.journal_lost = len(tally.journal - segment_lines(sub.datadir) - segment_lines(pub.datadir))
    for proc in (pub, sub):  # a store that came back empty would have started a new node
        tally.nodes[proc.name] = set(re.findall(r"bus ([0-9a-f]{16}) up at", proc.log.read_text()))
    return tally


def check(tally: Tally) -> None:
    print(tally.summary())  # the figures, with -s
    assert tally.lost == [], tally.summary()
    assert not tally.deadletters, tally.summary()
    assert tally.beyond_bound() == [], (tally.summary(), tally.beyond_bound()[:10])
    assert tally.journal and tally.journal_lost == 0, tally.summary()
    assert all(len(ids) == 1 for ids in tally.nodes.values()), f"a store came back empty: {tally.nodes}"


# --- the tests --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_power_cuts_to_the_subscriber_mid_stream_lose_no_acknowledged_message(power, bus_process):
    check(stream_under_power_cuts(power, bus_process, cut="sub", cuts=3, seed=11))


@pytest.mark.slow
def test_power_cuts_to_the_publisher_mid_stream_lose_nothing_and_run_no_handler_twice(power, bus_process):
    tally = stream_under_power_cuts(power, bus_process, cut="pub", cuts=3, seed=12)
    check(tally)
    # The subscriber kept its memory: what the publisher resends after losing its acked
    # deletes and cursors is acked again and not handled again.
    assert tally.reruns() == []


@pytest.mark.slow
def test_power_cuts_to_both_sides_at_once_lose_no_acknowledged_message(power, bus_process):
    check(stream_under_power_cuts(power, bus_process, cut="both", cuts=3, seed=13))


@pytest.mark.slow
def test_a_handlers_kv_count_equals_the_messages_it_handled_across_power_cuts(power, bus_process):
    """message.kv without events is committed with the completion in one unsynced write:
    lost together with it, redone with the rerun, never counted twice."""
    tally = stream_under_power_cuts(power, bus_process, cut="sub", cuts=3, seed=14, count=1500,
                                    sub_args=("--kv-count",))
    check(tally)
    store = Store.open(tally.datadir / "store", create=False)
    try:
        count = store.get_kv("count")
        marks = {key for key, _ in store.kv_items("n:")}
    finally:
        store.close()
    assert count == len(tally.runs), f"kv count {count} for {len(tally.runs)} messages handled"
    assert len(marks) == len(tally.runs)



def test_a_handler_that_finished_a_second_before_a_power_cut_does_not_run_again(power, bus_process):
    """A completion is not fsynced on its own. Under a stream the next message's synced
    receipt makes it durable; after the last message nothing else would, however long the
    bus then stays idle: the bus syncs it within SYNC_INTERVAL."""
    disk = power("sub")
    pub = bus_process("pub")
    sub = on(disk, bus_process("sub", "--subscribe", pub.address, TOPIC, "--handle", TOPIC))
    pub.start("--publish", TOPIC, "--batch", "10", "--count", "50", wait_ready=False)
    sub.start()
    wait_until(lambda: len(sub.done_counts()) == 50, 20, message=lambda: f"{len(sub.done_counts())} of 50")
    time.sleep(RERUN_BOUND)  # the scenario: time passes, nothing new arrives
    cut_power(disk, sub)
    store = Store.open(sub.datadir / "store", create=False)
    try:
        waiting = store.count("incoming")
    finally:
        store.close()
    assert waiting == 0, f"{waiting} of 50 handled messages are back in the store, to run again"
    sub.start()
    pub.stop()
    sub.stop()
    assert set(sub.done_counts().values()) == {1}


def test_a_message_sent_while_its_publish_fsync_hangs_may_arrive_and_its_id_is_never_made_again(
        power, bus_process, tmp_path):
    """The README's one-fsync promise, both halves: the publisher may send a message while
    its fsync runs, so a message can be delivered although its publish never returned (here
    the fsync hangs, then the power goes and takes the unsynced write with it); and the
    restarted publisher, which lost every trace of that message, does not make its id again
    (a new message under it would be taken for a duplicate by the subscriber, which handled
    the first, and be lost). Without the epoch a clash here would also need the same
    millisecond and counter: tests/unit/test_topics_ids_lock.py shows that the epoch alone
    keeps two starts' ids apart when those match."""
    disk = power("pub")
    go = tmp_path / "go"
    pub = on(disk, bus_process("pub"))
    sub = bus_process("sub", "--subscribe", pub.address, TOPIC, "--handle", TOPIC)
    pub.start("--publish", TOPIC, "--count", "1", "--publish-when", str(go), wait_ready=False)
    sub.start()
    pub.wait_ready()
    disk.stall("fsync:*.log")  # LevelDB's log writes go on; their fsyncs hang
    go.touch()
    wait_until(lambda: len(handler_runs(sub)) == 1, 30, message="the early-sent message handled")
    early = set(handler_runs(sub))
    assert pub.published_ids() == [], "its publish returned although its fsync hangs"
    assert cut_power(disk, pub) > 0, "the cut dropped nothing: it proved nothing"
    pub.start("--publish", TOPIC, "--count", "20", "--first", "100")  # its subscriber is remembered
    wait_until(lambda: len(pub.published_ids()) == 20, 30,
               message=lambda: f"{len(pub.published_ids())} of 20 published after the cut")
    acknowledged = set(pub.published_ids())
    wait_until(lambda: acknowledged <= set(handler_runs(sub)), 30,
               message=lambda: f"{len(acknowledged & set(handler_runs(sub)))} of 20 handled "
                               f"(ids made again: {sorted(acknowledged & early)})")
    sub.stop()
    pub.stop()
    assert not acknowledged & early, "an id sent before the cut was made again after it"
    assert sorted(sub.done_counts()) == [0] + list(range(100, 120))
    assert set(sub.done_counts().values()) == {1}


JOURNAL_BEFORE_THE_CUT = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from servicebus.hooks.journal import Journal
    from servicebus.store import Store

    datadir = Path(sys.argv[1])
    datadir.mkdir()
    store = Store.open(datadir / "store")
    journal = Journal(store, datadir, "node", "tcp://127.0.0.1:1")

    def change(n, sync):  # a state change and its journal event, in one write, as the bus does
        batch = store.batch()
        batch.put_meta(f"change{n}", b"")
        journal.record(batch, [("handled", 1000 + n, f"m{n:04d}", "t", "event", "tcp://p:1", 1, None)])
        store.write(batch, sync=sync)

    change(0, True)  # fsynced (a receipt)
    for n in range(1, 50):
        change(n, False)  # not fsynced (completions)
    journal.flush()  # the segment file is fsynced; the delete from LevelDB is not
    print("flushed", flush=True)
    os._exit(0)  # the power goes: no close
""")


SYNC_ACROSS_A_LOG_SWITCH = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from servicebus.store import Store

    store = Store.open(Path(sys.argv[1]) / "store")
    batch = store.batch()
    batch.put_meta("written-unsynced", b"A")
    store.write(batch, sync=False)  # a publish or a receipt: in LevelDB, then the engine acts
    logs = lambda: {p.name for p in (Path(sys.argv[1]) / "store").glob("*.log")}
    first = logs()
    n = 0
    while logs() <= first:  # more unsynced writes, until LevelDB starts a new log
        batch = store.batch()
        batch.put_meta(f"filler{n}", os.urandom(64 << 10))
        store.write(batch, sync=False)
        n += 1
    store.sync()  # what publish and the receiver's ack wait for: every earlier write durable
    print("synced", flush=True)
    time.sleep(60)  # the power goes meanwhile
""")


def test_a_sync_after_leveldb_switched_logs_makes_the_writes_in_the_old_log_durable(power, tmp_path):
    """One fsync on the latency path writes a publish (or a receipt) unsynced, lets the
    engine act on it, then makes it durable with Store.sync(). When LevelDB starts a new log
    between the two (its memtable full), it leaves the old log without an fsync: a synced
    LevelDB write to the new log does not make the old log's tail durable, and a power cut
    then loses an acknowledged publish (or a receipt already acked). The table the old log
    becomes is held back (its writes stalled), as when the cut comes before it is written."""
    disk = power("store")
    datadir = disk.path / "node"
    datadir.mkdir()
    disk.stall("*.ldb")
    proc = subprocess.Popen([sys.executable, "-c", SYNC_ACROSS_A_LOG_SWITCH, str(datadir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "synced", proc.stderr.read() if proc.poll() is not None else line
        os.killpg(proc.pid, signal.SIGKILL)  # the power goes: the process with it
        assert disk.cut()["dropped_bytes"] > 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()
    store = Store.open(datadir / "store", create=False)
    try:
        assert store.get_meta("written-unsynced") == b"A", "a write made before a sync was lost"
    finally:
        store.close()


SECRET_AT_START = textwrap.dedent("""
    import sys
    from servicebus import Bus
    from servicebus.testing import free_address
    bus = Bus(free_address(), sys.argv[1], name="svc", seeds=[free_address()])
    print(bus._engine.core.members.secret.hex(), flush=True)  # it may prove itself from now on
    sys.stdin.read()
""")


def test_the_secret_a_bus_proves_itself_with_survives_a_power_cut_right_after_it_started(power):
    """Discovery's proof (core/members.py) is HMAC(the bus's secret, the receiver's node
    id), kept by every bus it wrote to; one with another is refused for good. The secret
    is made at the first start: if a power cut lost it after a proof went out (a gossip
    answer goes at once), the bus would come back with another and be refused everywhere."""
    disk = power("secret")
    datadir = disk.path / "node"
    proc = subprocess.Popen([sys.executable, "-c", SECRET_AT_START, str(datadir)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        secret = proc.stdout.readline().strip()
        assert len(secret) == 32, proc.stderr.read() if proc.poll() is not None else secret
        os.killpg(proc.pid, signal.SIGKILL)  # the power goes: the process with it
        disk.cut()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            f.close()
    store = Store.open(datadir / "store", create=False)
    try:
        stored = store.meta("members") or {}
    finally:
        store.close()
    assert isinstance(stored.get("secret"), bytes) and stored["secret"].hex() == secret, \
        f"the secret after the cut: {stored.get('secret')!r}, before: {secret}"


def segment_lines(datadir: Path) -> set[str]:
    """The events of the journal's segments (either format), each as one string."""
    return set(event_counts(datadir))


def test_journal_events_moved_to_a_segment_before_a_power_cut_are_still_there_after_it(power):
    """The journal moves its events from LevelDB to a segment file (fsynced), then deletes
    them from LevelDB (not fsynced). After a power cut the store may have lost those events,
    their delete, or both; whatever it lost, a segment written before the cut must not be
    overwritten or shrunk by the flushes after it."""
    disk = power("journal")
    datadir = disk.path / "node"
    done = subprocess.run([sys.executable, "-c", JOURNAL_BEFORE_THE_CUT, str(datadir)],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "flushed", done.stderr
    moved = event_counts(datadir)  # each event with how many times the segments hold it
    assert len(moved) == 50 and set(moved.values()) == {1}
    assert disk.cut()["dropped_bytes"] > 0
    from servicebus.hooks.journal import Journal  # the restarted bus: new events, flushed

    store = Store.open(datadir / "store")
    try:
        journal = Journal(store, datadir, "node", "tcp://127.0.0.1:1")
        for n in range(5):
            batch = store.batch()
            journal.record(batch, [("handled", 5000 + n, f"r{n:04d}", "t", "event", "tcp://p:1", 2, None)])
            store.write(batch, sync=True)
        journal.flush()
    finally:
        store.close()
    after = event_counts(datadir)
    assert moved <= after, f"{len(moved - after)} of the {len(moved)} events moved before the cut vanished"
    twice = [e for e, n in after.items() if n > 1]
    assert not twice, f"{len(twice)} events are in the segments more than once, such as {twice[0]}"
    assert len(after) == 55 and after.total() == 55



@pytest.mark.slow
@pytest.mark.parametrize("effect", ["kv", "send"])
def test_what_a_handler_stored_or_sent_counts_once_when_the_power_goes_while_leveldb_writes_out_a_memtable(
        power, bus_process, effect):
    """LevelDB starts a new log file when its memtable is full and closes the old one
    without fsyncing it: the old log's unsynced tail becomes durable only once the memtable
    is written out as a table. A synced write to the new log meanwhile survives a cut that
    the old tail does not: the store loses a write but keeps later ones. Caught there (the
    table's writes stalled), a handler's lost run runs again; what it staged must count once:
    its kv update (the next one read the lost one's value) and its command (the engine moved
    the lost run's command into its stream, fsynced, before the cut)."""
    disk = power("sub")
    pub = bus_process("pub")
    sink = bus_process("sink", "--command", "tx.note")
    # What the runs stage is most of what the store writes, so that LevelDB's log switches
    # mostly come right after a run's (unsynced) write, not after a (synced) receipt.
    effect_args = ("--kv-count",) if effect == "kv" else ("--send-to", sink.address)
    effect_args += ("--stage-pad", "2000")
    sub = on(disk, bus_process("sub", "--subscribe", pub.address, TOPIC, "--handle", TOPIC, *effect_args))
    sink.start()
    pub.start("--publish", TOPIC, "--batch", "10", "--rate", "1000", "--pad", "100", "--count", "60000",
              wait_ready=False)
    sub.start()
    pub.wait_ready()
    store = disk.backing / "sub" / "store"

    def logs() -> dict[int, int]:
        """LevelDB's log files: number -> bytes on the disk (what was fsynced)."""
        return {int(p.stem): p.stat().st_size for p in store.glob("*.log")}

    dropped = 0
    for _ in range(3):  # the old log's tail holds a run's write most times, not every time
        wait_until(lambda: len(sub.done_counts()) >= 100, 30)
        newest = max(logs())
        disk.stall("*.ldb")  # the table of the next memtable written out does not reach the disk
        wait_until(lambda: any(n > newest and size >= 65536 for n, size in logs().items()), 60,
                   message="LevelDB to switch logs and fsync 64 KiB of the new one")
        dropped += cut_power(disk, sub)
        sub.start()
    acknowledged = set(pub.published_ids())
    pub.kill()  # enough published: restarted, it delivers what it acknowledged and publishes no more
    pub.start("--publish", TOPIC, "--count", "0")
    wait_until(lambda: acknowledged <= set(handler_runs(sub)), 60,
               message=lambda: f"{len(set(handler_runs(sub)))} of {len(acknowledged)} handled")
    handled = handler_runs(sub)
    reruns = sum(len(times) - 1 for times in handled.values())
    if effect == "send":
        wanted = {int(parts[2]) for parts in sub.lines("done")}
        wait_until(lambda: set(sink.done_counts()) >= wanted, 30,
                   message=lambda: f"{len(set(sink.done_counts()) & wanted)} of {len(wanted)} commands")
    sub.stop()
    if effect == "kv":
        kv = Store.open(sub.datadir / "store", create=False)
        try:
            count = kv.get_kv("count")
        finally:
            kv.close()
        print(f"kv count {count}, handled {len(handled)}, reruns {reruns}, dropped {dropped} bytes")
        assert count == len(handled), (f"kv count {count} for {len(handled)} messages handled "
                                       f"({reruns} handler runs again after the cuts)")
    else:
        sink.stop()
        twice = {n: times for n, times in sink.done_counts().items() if times > 1}
        print(f"commands {len(sink.done_counts())}, twice {len(twice)}, handled {len(handled)}, "
              f"reruns {reruns}, dropped {dropped} bytes")
        assert not twice, f"{len(twice)} commands arrived twice ({reruns} handler runs again after the cuts)"


@pytest.mark.slow
def test_power_cuts_to_a_groups_publisher_give_no_acknowledged_message_to_both_members(power, bus_process):
    """A subscriber group: the publisher gives each message to one member. Its record of
    which member has which message is not fsynced on its own; after a cut the publisher must
    not hand a message that one member acknowledged (and handled) to the other."""
    disk = power("pub")
    pub = on(disk, bus_process("pub"))
    members = [bus_process(f"member{i}", "--subscribe", pub.address, TOPIC, "--group", "workers",
                           "--handle", TOPIC) for i in (1, 2)]
    publishing = ("--publish", TOPIC, "--batch", "10", "--rate", "500")
    pub.start(*publishing, "--count", "2500", wait_ready=False)
    for member in members:
        member.start()
    pub.wait_ready()
    rng = random.Random(15)
    for cut in range(3):
        time.sleep(rng.uniform(0.4, 1.2))  # the fault's random instant, not a synchronisation
        cut_power(disk, pub)
        done = len(pub.published_ids())
        pub.start(*publishing, "--count", str(max(0, 2500 - done)), "--first", str(1_000_000 * (cut + 1)))
    wait_until(lambda: len(pub.published_ids()) >= 2500, 60)
    acknowledged = set(pub.published_ids())

    def by_member() -> dict[str, set[str]]:
        return {member.name: set(handler_runs(member)) for member in members}

    wait_until(lambda: acknowledged <= set().union(*by_member().values()), 60,
               message=lambda: f"{len(set().union(*by_member().values()) & acknowledged)} of {len(acknowledged)}")
    handled = by_member()
    both = handled["member1"] & handled["member2"]
    print(f"acknowledged {len(acknowledged)}, member1 {len(handled['member1'])}, "
          f"member2 {len(handled['member2'])}, handled by both {len(both)}")
    assert both == set(), f"{len(both)} messages were given to both members"
