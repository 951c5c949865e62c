"""A received segment of several messages handed to ``Runner.run`` (handling/segmentrun.py),
on the in-memory fakes: each message runs once, in order, its progress written as it
finishes (``c/<key>``); a crash mid-segment resumes at the next message; a failing message
goes on by itself (split off, ``n/<id>`` and its run state) while the others go on; one
that cannot be handled is a dead letter of its own; the segment's "handled" event names
every message it handled."""

import pytest

from servicebus.errors import StoreError
from servicebus.handling.segmentrun import PAUSE
from servicebus.model.delivery import ORDER_HEADER
from servicebus.model.segments import make_blob
from servicebus.model.stored import Progress
from servicebus.testing.handling import RunnerRig
from servicebus.wire.payload import encode_payload

TOPIC = "orders"
RAW = b"\x81\x92\x01\x02\x03"  # {[1, 2]: 3}: a payload with a key no receiver can hash


def recording(seen, fail=(), crash=None, rig=None):
    """A handler noting (payload, attempt); raising on its first attempt at a payload in
    ``fail``; ending the process (``rig.store.crash()``) at payload ``crash[0]``, if any
    (a list: the test changes it between runs)."""
    def handle(payload, message):
        seen.append((payload, message.attempt))
        if crash and payload == crash[0]:
            rig.store.crash()  # os._exit, the OOM killer: nothing after lands
        if payload in fail and message.attempt == 1:
            raise ValueError(f"no {payload}")
    return handle


def handled_events(rig):
    return [(e.id, e.ids) for e in rig.log.seen if e.name == "handled"]


# --- every message once, in order, its progress written as it goes ---------------------------


def test_a_segment_runs_each_message_once_in_order_writing_its_progress_after_each():
    rig = RunnerRig()
    seen = []
    rig.add(TOPIC, recording(seen))
    key, ids = rig.receive_segment(TOPIC, "a", "b", "c")

    assert rig.run(key) is None
    assert seen == [("a", 1), ("b", 1), ("c", 1)]
    # The start of the run, then one small write as each message finishes (it also marks
    # the next one started); the last one's write takes the segment out.
    assert rig.store.ops("put_progress", key) == [
        (key, 0, Progress(0, 1, [])), (key, 0, Progress(1, 1, [])), (key, 0, Progress(2, 1, []))]
    assert rig.store.ops("complete_incoming", key) == [(key, 0, [0])]
    assert key in rig.store.handled and not rig.store.incoming and not rig.store.runs
    assert not rig.store.runstate and not rig.store.letters


def test_the_handled_event_of_a_finished_segment_names_every_message_it_handled():
    rig = RunnerRig()
    rig.add(TOPIC, lambda payload, message: None)
    key, ids = rig.receive_segment(TOPIC, *range(5))

    assert rig.run(key) is None
    assert handled_events(rig) == [(key, tuple(ids))]
    # It rides in the write that takes the segment out, with it.
    assert ("complete_incoming", (key, 0, [0])) in rig.store.write_of("complete_incoming", key)


def test_the_write_that_finishes_a_message_marks_the_next_segment_started_and_its_run_writes_no_start():
    rig = RunnerRig()
    seen = []
    rig.add(TOPIC, recording(seen))
    first = rig.receive(TOPIC, "x")
    key, ids = rig.receive_segment(TOPIC, "a", "b")
    nxt = rig.item(key)  # as the dispatcher took it, before either ran

    assert rig.runner.run(rig.item(first), False, nxt) == (None, True)
    assert ("put_progress", (key, 0, Progress(0, 1, []))) in rig.store.write_of("complete_incoming", first)
    writes = len(rig.store.written)
    assert rig.runner.run(nxt, True) == (None, False)
    assert len(rig.store.written) == writes + 2  # one per message: no start of its own
    assert seen == [("x", 1), ("a", 1), ("b", 1)]  # the marker counts this run, once


def test_a_crash_mid_segment_resumes_at_the_message_it_was_running_not_at_a_finished_one():
    rig = RunnerRig()
    seen, crash = [], ["b"]
    rig.add(TOPIC, recording(seen, crash=crash, rig=rig))
    key, ids = rig.receive_segment(TOPIC, "a", "b", "c", "d")
    with pytest.raises(StoreError):
        rig.run(key)  # "b"'s handler ended the process: its finishing write never landed
    assert seen == [("a", 1), ("b", 1)]
    assert rig.store.runs == {(key, 0): Progress(1, 1, [])}  # "a" done, a run of "b" begun

    rig.restart()
    crash[0] = None  # it does not crash this time
    assert rig.run(key) is None
    # "a" is not run again; "b" is, as its second attempt (the crash counted); then the rest.
    assert seen == [("a", 1), ("b", 1), ("b", 2), ("c", 1), ("d", 1)]
    assert key in rig.store.handled and not rig.store.incoming and not rig.store.runs
    assert handled_events(rig) == [(key, tuple(ids))]


def test_a_message_that_crashes_the_process_every_time_is_a_dead_letter_and_the_others_go_on():
    rig = RunnerRig(max_attempts=2)
    seen = []
    rig.add(TOPIC, recording(seen, crash=["poison"], rig=rig))
    key, ids = rig.receive_segment(TOPIC, "a", "poison", "c")
    for _ in range(2):
        with pytest.raises(StoreError):
            rig.run(key)
        rig.restart()
    assert rig.run(key) is None

    assert seen == [("a", 1), ("poison", 1), ("poison", 2), ("c", 1)]  # no third run of it
    letter = rig.store.letters[ids[1]]
    assert (letter["reason"], letter["attempts"]) == ("handler_crashed", 2)
    assert letter["record"].ids == [ids[1]] and letter["record"].blob == make_blob([encode_payload("poison")])
    assert list(rig.store.letters) == [ids[1]]
    assert handled_events(rig) == [(key, (ids[0], ids[2]))]


def test_a_long_segment_pauses_between_two_messages_without_counting_an_attempt():
    rig = RunnerRig()
    seen = []
    rig.add(TOPIC, recording(seen))
    key, ids = rig.receive_segment(TOPIC, *range(20))

    assert rig.run(key) == PAUSE  # its place in the queue is kept (dispatch.py)
    assert [p for p, _ in seen] == list(range(16))
    assert rig.store.runs == {(key, 0): Progress(16, 0, [])}  # the 17th not begun
    assert rig.run(key) is None
    assert seen == [(n, 1) for n in range(20)]
    assert handled_events(rig) == [(key, tuple(ids))]


# --- one message alone: split off, or a dead letter of its own --------------------------------


@pytest.mark.parametrize("failing", ["b", "c"], ids=["in the middle", "the last"])
def test_a_failing_message_is_split_off_with_its_run_state_and_the_others_go_on(failing):
    rig = RunnerRig(retry_initial=1.0, retry_max=1.0)
    seen = []
    rig.add(TOPIC, recording(seen, fail=[failing]))
    key, ids = rig.receive_segment(TOPIC, "a", "b", "c")
    mid = ids["abc".index(failing)]
    record = rig.store.incoming[key]

    assert rig.run(key) is None  # the segment is done: its failing message goes on alone
    assert seen == [("a", 1), ("b", 1), ("c", 1)]
    alone = rig.store.incoming[mid]  # n/<id>: a segment of one, under its own id
    assert (alone.ids, alone.blob) == ([mid], make_blob([encode_payload(failing)]))
    assert alone[:9] == record[:9]  # the segment's topic, sender, times, headers
    state = rig.store.runstate[mid]
    assert (state.attempts, state.done, state.last_error) == (1, [], f"ValueError: no {failing}")
    assert state.next_ms > rig.clock.wall_ms()  # retried after a backoff
    assert list(rig.store.incoming) == [mid] and key in rig.store.handled
    assert [(item.id, item.record.ids) for item, _due in rig.spawned] == [(mid, [mid])]
    assert handled_events(rig) == [(key, tuple(m for m in ids if m != mid))]
    assert [e.name for e in rig.log.about(mid)] == ["handler_failed", "retried"]

    rig.clock.advance(2)
    assert rig.run(mid) is None  # its retry, by itself
    assert seen[-1] == (failing, 2)
    assert mid in rig.store.handled and not rig.store.incoming and not rig.store.runstate
    assert rig.log.names(mid)[-1] == "handled"


def test_a_segment_of_an_ordered_subscription_retries_a_failing_message_where_it_is():
    # An ordered lane must not go past a failing message: it is not split off, the segment
    # waits at it and runs again from it, the messages after it only once it succeeded.
    rig = RunnerRig(retry_initial=1.0, retry_max=1.0)
    seen = []
    rig.add(TOPIC, recording(seen, fail=["b"]))
    key, ids = rig.receive_segment(TOPIC, "a", "b", "c", headers={ORDER_HEADER: "e:" + TOPIC})

    assert rig.run(key) is not None  # to run again later, from "b"
    assert seen == [("a", 1), ("b", 1)]
    assert list(rig.store.incoming) == [key] and not rig.spawned
    assert rig.store.runstate[ids[1]][:3] == (1, [], "ValueError: no b")
    rig.clock.advance(2)
    assert rig.run(key) is None
    assert seen == [("a", 1), ("b", 1), ("b", 2), ("c", 1)]
    assert key in rig.store.handled and not rig.store.runstate and not rig.store.runs


def test_a_payload_that_does_not_decode_is_a_dead_letter_of_its_own_and_the_others_are_handled():
    # Moved here from the receiver (test_core.py, test_protocol.py): a payload is decoded
    # only when its handler would get it; one that does not decode is a dead letter for
    # that message alone.
    rig = RunnerRig()
    seen = []
    rig.add(TOPIC, recording(seen))
    key, ids = rig.receive_segment(TOPIC, bodies=[encode_payload(0), RAW, encode_payload(2)])

    assert rig.run(key) is None
    assert seen == [(0, 1), (2, 1)]
    letter = rig.store.letters[ids[1]]
    assert (letter["reason"], letter["origin"]) == ("undecodable", "incoming")
    assert "unhashable" in letter["error"]
    assert (letter["record"].ids, letter["record"].blob) == ([ids[1]], make_blob([RAW]))
    assert list(rig.store.letters) == [ids[1]] and key in rig.store.handled and not rig.store.incoming
    assert handled_events(rig) == [(key, (ids[0], ids[2]))]
    assert "deadlettered" in [e.name for e in rig.log.about(ids[1])]


def test_a_message_alone_whose_payload_does_not_decode_is_a_dead_letter_unrun():
    rig = RunnerRig()
    seen = []
    rig.add(TOPIC, recording(seen))
    mid = rig.receive(TOPIC, body=RAW)

    assert rig.run(mid) is None
    assert seen == []
    letter = rig.store.letters[mid]
    assert letter["reason"] == "undecodable" and "unhashable" in letter["error"]
    assert mid not in rig.store.incoming and mid not in rig.store.handled


def test_an_expired_segment_makes_each_message_not_run_yet_a_dead_letter_in_one_write():
    rig = RunnerRig()
    seen = []
    rig.add(TOPIC, recording(seen))
    key, ids = rig.receive_segment(TOPIC, "a", "b", "c", ttl=1.0)
    rig.clock.advance(2)

    assert rig.run(key) is None
    assert seen == []
    assert sorted(rig.store.letters) == ids
    assert all(rig.store.letters[m]["reason"] == "expired" for m in ids)
    assert [rig.store.letters[m]["record"].ids for m in ids] == [[m] for m in ids]
    write = rig.store.write_of("complete_incoming", key)
    assert sum(op == "put_deadletter" for op, _ in write) == 3  # with the segment's removal
    assert [(e.id, e.ids) for e in rig.log.seen if e.name == "expired"] == [(key, tuple(ids))]


# --- several handlers on a topic: a message's finished handlers are not run again -------------


def several(rig, ran, fail=None, crash=None):
    """Handlers "ship", "bill" and "audit", noting (name, payload, attempt); "bill" raises at
    its first attempt at payload ``fail`` and ends the process at payload ``crash[0]``."""
    def ship(payload, message):
        ran.append(("ship", payload, message.attempt))

    def bill(payload, message):
        ran.append(("bill", payload, message.attempt))
        if crash and payload == crash[0]:
            rig.store.crash()
        if payload == fail and message.attempt == 1:
            raise ConnectionError("billing down")

    def audit(payload, message):
        ran.append(("audit", payload, message.attempt))

    rig.add(TOPIC, ship, name="ship")
    rig.add(TOPIC, bill, name="bill")
    rig.add(TOPIC, audit, name="audit")


def test_a_message_split_off_a_segment_runs_only_its_handlers_not_done_when_retried():
    rig = RunnerRig(retry_initial=1.0, retry_max=1.0)
    ran = []
    several(rig, ran, fail="b")
    key, ids = rig.receive_segment(TOPIC, "a", "b", "c")

    assert rig.run(key) is None
    assert rig.store.runstate[ids[1]][:3] == (1, ["ship", "audit"], "ConnectionError: billing down")
    rig.clock.advance(2)
    assert rig.run(ids[1]) is None
    assert [r for r in ran if r[1] == "b"] == [("ship", "b", 1), ("bill", "b", 1), ("audit", "b", 1),
                                               ("bill", "b", 2)]
    assert [r for r in ran if r[1] != "b"] == [(h, p, 1) for p in "ac" for h in ("ship", "bill", "audit")]
    assert set(rig.store.handled) == {key, ids[1]} and not rig.store.incoming and not rig.store.runstate


def test_after_a_crash_in_one_handler_of_a_segments_message_only_the_handlers_not_done_run_again():
    rig = RunnerRig()
    ran, crash = [], ["b"]
    several(rig, ran, crash=crash)
    key, ids = rig.receive_segment(TOPIC, "a", "b", "c")
    with pytest.raises(StoreError):
        rig.run(key)  # "ship" finished "b" (recorded), "bill" ended the process
    rig.restart()
    crash[0] = None
    assert rig.run(key) is None
    assert [r for r in ran if r[1] == "b"] == [("ship", "b", 1), ("bill", "b", 1), ("bill", "b", 2),
                                               ("audit", "b", 2)]
    assert [r for r in ran if r[1] != "b"] == [(h, p, 1) for p in "ac" for h in ("ship", "bill", "audit")]
    assert key in rig.store.handled and not rig.store.incoming and not rig.store.runstate
    assert handled_events(rig) == [(key, tuple(ids))]
