"""Nothing that orders or forgets messages trusts the wall clock (DESIGN.md rule 8)."""

import time

import pytest

from servicebus.model.clock import BusClock
from servicebus.model.ids import IdGenerator, id_millis
from servicebus.hooks.journal import Journal
from servicebus.store import FORMAT_VERSION, Store
from servicebus.testing import FakeClock

from ..journals import journal_events, segment_events, segment_files


def test_ids_made_with_the_clock_set_back_sort_after_every_earlier_id():
    earlier = IdGenerator().many(10)
    later = IdGenerator(after=max(earlier), wall=lambda: int(time.time() * 1000) - 3_600_000).many(10)
    assert min(later) > max(earlier)
    assert later == sorted(later)


def test_ids_keep_increasing_when_the_clock_goes_back_while_running():
    clock = FakeClock()
    gen = IdGenerator(wall=clock.wall_ms, monotonic=clock.monotonic)
    first = gen.many(5)
    clock.wall -= 3_600_000
    clock.advance(0.001)
    assert min(gen.many(5)) > max(first)


def test_a_delay_made_after_a_run_with_the_clock_ahead_counts_from_the_publish():
    # A run two days ahead left ids two days in the future; back on the real clock, a
    # 30 s delay is due 30 s of running time later, not at once (issue 26).
    clock = FakeClock()
    ahead = IdGenerator(wall=lambda: clock.wall + 2 * 86_400_000, monotonic=clock.monotonic).next()
    gen = IdGenerator(after=ahead, wall=clock.wall_ms, monotonic=clock.monotonic)
    delayed, = gen.delayed(1, clock.wall + 30_000)
    assert delayed.endswith("~") and delayed > ahead
    assert id_millis(delayed) - gen.now_ms() == 30_000
    clock.advance(29.9)
    assert delayed > f"{gen.now_ms() + 1:012x}"  # not due yet (State.not_due)
    clock.advance(0.2)
    assert delayed <= f"{gen.now_ms() + 1:012x}"


def test_the_id_clock_does_not_follow_a_wall_clock_step_while_running():
    clock = FakeClock()
    gen = IdGenerator(wall=clock.wall_ms, monotonic=clock.monotonic)
    delayed, = gen.delayed(1, clock.wall + 60_000)
    clock.wall += 3_600_000  # stepped an hour forward: the delay still has its minute to go
    clock.advance(1)
    assert delayed > f"{gen.now_ms() + 1:012x}"


def test_the_highest_own_id_outlives_the_messages_a_cursor_passed(store):
    gen = IdGenerator()
    a, b, c = gen.many(3)
    batch = store.batch()
    batch.put_outgoing("e:t", a, b"x")
    batch.put_delivery("tcp://127.0.0.1:1", "e:t", {"floor": b, "acked": [], "attempts": {}})
    batch.put_subscription("tcp://127.0.0.1:1", "t", {"since": a})
    store.write(batch, sync=False)
    assert store.highest_own_id() == b  # the message b was acked and collected: only the cursor knows it
    batch = store.batch()
    batch.put_intent("tcp://127.0.0.1:2", "u", {"op": "subscribe", "id": c, "confirmed": False})
    store.write(batch, sync=False)
    assert store.highest_own_id() == c


def test_an_empty_store_has_no_highest_id(store):
    assert store.highest_own_id() is None
    assert id_millis(IdGenerator(after=None).next()) > 0


def test_the_bus_clock_continues_from_the_stored_time_and_ignores_the_wall_clock(tmp_path):
    store = Store.open(tmp_path / "store")
    clock = store.bus_clock()
    assert 0 <= clock.now() < 1000
    batch = store.batch()
    batch.put_clock(BusClock(123_456))
    store.write(batch, sync=True)
    store.close()
    store = Store.open(tmp_path / "store")
    assert 123_456 <= store.bus_clock().now() < 124_456
    store.close()


def test_handled_ids_are_pruned_by_when_they_were_handled_not_by_their_id(store):
    gen = IdGenerator()
    old_id, new_id = gen.many(2)
    batch = store.batch()
    batch.put_handled(new_id, 1_000)  # the newer id was handled first
    batch.put_handled(old_id, 5_000)
    store.write(batch, sync=False)
    assert store.handled_before(2_000, 10) == [(new_id, 1_000)]
    assert store.handled_before(9_000, 10) == [(new_id, 1_000), (old_id, 5_000)]
    batch = store.batch()
    batch.forget_handled(new_id, 1_000)
    store.write(batch, sync=False)
    assert store.seen_many([new_id, old_id]) == [False, True]
    assert store.handled_before(9_000, 10) == [(old_id, 5_000)]


def test_a_format_1_store_is_upgraded_and_keeps_every_handled_id_for_a_whole_window(tmp_path):
    store = Store.open(tmp_path / "store")
    mids = IdGenerator().many(3)
    batch = store.batch()
    for mid in mids:
        batch._put(b"h/" + mid.encode(), (1_600_000_000_000).to_bytes(8, "big"))  # format 1: wall ms
    batch.put_meta("format", b"1")
    batch.put_clock(FakeClock(50_000))
    store.write(batch, sync=True)
    store.close()
    store = Store.open(tmp_path / "store")
    assert store.get_meta("format") == str(FORMAT_VERSION).encode()  # upgraded to this version
    assert store.handled_before(50_000, 10) == []
    assert sorted(store.handled_before(50_001, 10)) == sorted((m, 50_000) for m in mids)
    store.close()


def record(journal, store, n):
    batch = store.batch()
    journal.record(batch, [("published", 1, f"{n:024x}", "t", "event", "tcp://127.0.0.1:1", 0, None)])
    store.write(batch, sync=False)
    journal.flush()


def test_segments_are_deleted_after_the_retention_counted_on_the_bus_clock(store, tmp_path):
    clock = FakeClock(1_000_000)
    journal = Journal(store, tmp_path, "node", "tcp://127.0.0.1:9", retention=60, clock=clock)
    record(journal, store, 1)
    clock.advance(40)
    record(journal, store, 2)
    first, second = segment_files(tmp_path)
    assert first.suffix == second.suffix == ".jcol"
    clock.advance(30)  # the first is 70 s old, the second 30 s
    assert journal.apply_retention() == 1
    assert not first.exists() and second.exists()
    clock.advance(31)
    assert journal.apply_retention() == 1
    assert not second.exists()
    assert store.segments() == []


@pytest.mark.parametrize("suffix", [".jcol", ".jsonl"])  # a segment of this version's format, of an older one
def test_a_segment_the_store_has_no_time_for_starts_counting_when_first_seen(store, tmp_path, suffix):
    clock = FakeClock(1_000_000)
    journal = Journal(store, tmp_path, "node", "tcp://127.0.0.1:9", retention=60, clock=clock)
    (tmp_path / "journal").mkdir()
    foreign = tmp_path / "journal" / f"x-000000000001{suffix}"
    foreign.write_text("{}\n")
    assert journal.apply_retention() == 0
    clock.advance(59)
    assert journal.apply_retention() == 0 and foreign.exists()
    clock.advance(2)
    assert journal.apply_retention() == 1 and not foreign.exists()


def test_journal_events_round_trip_through_a_segment(store, tmp_path):
    journal = Journal(store, tmp_path, "node", "tcp://127.0.0.1:9", clock=FakeClock())
    record(journal, store, 7)
    (segment,) = segment_files(tmp_path)
    assert segment.name == "node-000000000001.jcol"
    (e,) = segment_events(segment)
    assert e == {"event": "published", "ts": 1, "node": "node", "address": "tcp://127.0.0.1:9",
                 "id": "000000000000000000000007", "topic": "t", "kind": "event", "peer": "tcp://127.0.0.1:1",
                 "attempt": 0, "role": "sender"}


def test_a_flush_under_a_steady_stream_moves_what_was_there_and_leaves_the_rest_for_the_next(
        store, tmp_path, monkeypatch):
    """Records keep coming while a flush runs (a bus under load): it must not go on writing a
    segment of the few that came meanwhile, with its three fsyncs, after every one."""
    journal = Journal(store, tmp_path, "node", "tcp://127.0.0.1:9", clock=FakeClock())
    for n in range(10):
        batch = store.batch()
        journal.record(batch, [("published", 1, f"{n:024x}", "t", "event", "tcp://127.0.0.1:1", 0, None)])
        store.write(batch, sync=False)
    write = store.write
    more = iter(range(10, 60))

    def write_while_the_stream_goes_on(batch, sync):
        write(batch, sync=sync)
        n = next(more, None) if sync else None
        if n is not None:  # a record arrives during each of the flush's fsyncs
            extra = store.batch()
            journal.record(extra, [("published", 1, f"{n:024x}", "t", "event", "tcp://127.0.0.1:1", 0, None)])
            write(extra, sync=False)

    monkeypatch.setattr(store, "write", write_while_the_stream_goes_on)
    journal.flush()
    assert len(segment_files(tmp_path)) == 1
    monkeypatch.undo()
    journal.flush()  # the next flush takes the rest
    recorded = 60 - len(list(more))  # the first 10, and one per fsync of the first flush
    ids = [e["id"] for e in journal_events(tmp_path)]  # each record's one event, once
    assert sorted(ids) == [f"{n:024x}" for n in range(recorded)] and store.journal_records(100, 1 << 20) == []
