"""The write side of a handler's run, unit-tested on in-memory fakes: what a handler staged
(``message.kv``/``publish``/``send``) lands with its completion or not at all, a write
that fails is tried until it is made (never by running the handler again), and the
dispatcher and ordered lanes around the runner run each message once, in order."""

import threading

import pytest

from servicebus.handling.dispatch import Dispatcher
from servicebus.handling.lanes import Lanes
from servicebus.handling.requests import PendingRequests
from servicebus.hooks.base import Hooks
from servicebus.model.config import BusConfig
from servicebus.model.delivery import KEY_HEADER, ORDER_HEADER, PRIORITY_HEADER
from servicebus.model.segments import make_blob
from servicebus.model.stored import Incoming, IncomingRecord, RunState
from servicebus.testing import FakeClock, wait_until
from servicebus.testing.handling import HandlingStore, RunnerRig
from servicebus.wire.payload import decode_payload, encode_payload
from servicebus.wire.protocol import Kind

TOPIC = "orders"
INVOICING = "tcp://127.0.0.1:5999"


def stages_all(seen, fail_first=False):
    """A handler staging a kv write, a kv update, an event and a command; with
    ``fail_first`` its first attempt raises after staging them."""
    def handle(payload, message):
        seen.append(message.attempt)
        message.kv["order:" + payload["id"]] = "shipped"
        message.kv.update("shipped", lambda n: n + 1, 0)
        message.publish("shipments", {"order": payload["id"]})
        message.send(INVOICING, "invoice", {"order": payload["id"]})
        if fail_first and message.attempt == 1:
            raise TimeoutError("carrier did not answer")
    return handle


# --- what a handler staged ------------------------------------------------------------------


def test_what_a_handler_staged_is_written_in_the_write_that_completes_it():
    rig = RunnerRig()
    rig.add(TOPIC, stages_all([]))
    mid = rig.receive(TOPIC, {"id": "A1"})

    assert rig.run(mid) is None
    ops = {name for name, _args in rig.store.write_of("complete_incoming", mid)}
    assert {"put_kv", "put_outgoing", "put_outbox"} <= ops  # one atomic write
    assert dict(rig.store.kv_items()) == {"order:A1": "shipped", "shipped": 1}
    assert rig.publisher.published("shipments") == [{"order": "A1"}]
    ((key, send),) = rig.store.sends.items()
    assert key.startswith(mid + "\x00") and (send.address, send.command) == (INVOICING, "invoice")
    assert rig.publisher.queued == [(key, send)]  # handed on once written
    assert decode_payload(send.body) == {"order": "A1"}


def test_what_a_failing_run_staged_is_dropped_and_its_retry_applies_it_once():
    rig = RunnerRig()
    seen = []
    rig.add(TOPIC, stages_all(seen, fail_first=True))
    mid = rig.receive(TOPIC, {"id": "A1"})

    assert rig.run(mid) is not None
    assert not rig.store.kv and not rig.store.streams and not rig.store.sends and not rig.publisher.queued
    assert rig.store.runstate[mid][:3] == (1, [], "TimeoutError: carrier did not answer")

    assert rig.run(mid) is None
    assert seen == [1, 2]
    assert dict(rig.store.kv_items()) == {"order:A1": "shipped", "shipped": 1}
    assert rig.publisher.published("shipments") == [{"order": "A1"}]
    assert len(rig.store.sends) == len(rig.publisher.queued) == 1


def test_a_kv_update_function_that_raises_fails_the_run_and_writes_none_of_it():
    rig = RunnerRig()

    def handle(payload, message):
        message.kv["seen"] = True
        message.kv.update("total", lambda total: total / 0, 10)

    rig.add(TOPIC, handle)
    mid = rig.receive(TOPIC)

    assert rig.run(mid) is not None
    assert not rig.store.kv and mid not in rig.store.handled
    state = rig.store.runstate[mid]
    assert (state.attempts, state.last_error) == (1, "kv update: ZeroDivisionError: division by zero")
    assert rig.log.names(mid) == ["handler_failed", "retried"]


def test_a_request_handlers_staged_kv_lands_with_its_reply_and_not_when_it_raises():
    rig = RunnerRig()

    def reserve(payload, message):
        message.kv["held:" + payload["sku"]] = payload["qty"]
        if payload["qty"] > 5:
            raise ValueError("not that many")
        return "held"

    rig.add("reserve", reserve, kind=Kind.COMMAND)
    ok, refused = rig.request("reserve", {"sku": "a", "qty": 2}), rig.request("reserve", {"sku": "b", "qty": 9})

    assert rig.run(ok) is None and rig.run(refused) is None
    assert ("put_kv", ("held:a", encode_payload(2))) in rig.store.write_of("complete_with_reply", ok)
    assert dict(rig.store.kv_items()) == {"held:a": 2}
    assert rig.reply(refused) == {"ok": False, "type": "ValueError", "message": "not that many"}


# --- writes that fail --------------------------------------------------------------------------


def test_a_completion_write_that_fails_is_retried_until_made_and_the_handler_runs_once():
    rig = RunnerRig()
    seen = []

    def handle(payload, message):
        seen.append(message.attempt)
        rig.store.fail_writes(3)  # the disk fills while it runs

    rig.add(TOPIC, handle)
    mid = rig.receive(TOPIC)

    assert rig.run(mid) is None
    assert seen == [1]
    assert rig.store.waits == 3  # waited for the store before each try again
    assert mid in rig.store.handled and mid not in rig.store.incoming
    assert len(rig.store.ops("complete_incoming", mid)) == 1


def test_a_failed_write_that_was_applied_anyway_is_not_made_again():
    rig = RunnerRig()
    rig.add(TOPIC, lambda payload, message: rig.store.fail_writes(1, applied=True))
    mid = rig.receive(TOPIC)

    assert rig.run(mid) is None
    assert len(rig.store.ops("complete_incoming", mid)) == 1
    assert mid in rig.store.handled


def test_a_start_marker_that_cannot_be_written_leaves_the_message_unrun_and_uses_no_attempt():
    rig = RunnerRig()
    seen = []
    rig.add(TOPIC, lambda payload, message: seen.append(message.attempt))
    mid = rig.receive(TOPIC)

    rig.store.fail_writes(1)
    assert rig.run(mid) is not None  # tried again later
    assert not seen and mid not in rig.store.runstate and mid in rig.store.incoming

    assert rig.run(mid) is None
    assert seen == [1]


def test_a_finishing_write_lost_with_a_failed_write_is_redone_without_running_the_handler():
    rig = RunnerRig()
    seen = []
    rig.add(TOPIC, lambda payload, message: seen.append(message.id))
    mid = rig.receive(TOPIC)
    record = rig.store.incoming[mid]
    assert rig.run(mid) is None

    # The reopen after a failed write dropped the unsynced writes after it, this one too.
    rig.store.incoming[mid] = record
    rig.store.runstate[mid] = RunState(1, [], None, 0)
    del rig.store.handled[mid]
    redo = rig.runner.redo_for(mid)
    assert redo is not None and rig.runner.redo_for("never-ran") is None
    redo()

    assert seen == [mid]
    assert mid in rig.store.handled and mid not in rig.store.incoming and mid not in rig.store.runstate


# --- the dispatcher and ordered lanes ------------------------------------------------------------


@pytest.fixture
def dispatching():
    """A dispatcher with one worker on a ``HandlingStore``; ``idle`` is set when it runs
    out of work."""
    store, idle = HandlingStore(), threading.Event()
    d = Dispatcher(store, BusConfig(workers=1), on_idle=idle.set, requests=PendingRequests(),
                   on_reply=lambda mid, reply: None, hooks=Hooks(), clock=FakeClock())
    yield d, store, idle
    d.close(5.0)


def incoming(store, mid, payload, headers=None):
    """A received message, stored as the engine stores it (a segment of one), as handed over."""
    record = IncomingRecord(int(Kind.EVENT), TOPIC, "peer-node", "ipc://peer", 0, 1, None, None,
                            headers, [mid], make_blob([encode_payload(payload)]))
    store.incoming[mid] = record
    return Incoming(mid, record, None)


def test_a_message_handed_to_the_dispatcher_twice_is_run_once(dispatching):
    d, store, idle = dispatching
    seen = []
    d.register(Kind.EVENT, TOPIC, lambda payload, message: seen.append(payload))
    item = incoming(store, "m1", "once")
    d.submit([item, item])
    d.submit([item])  # a resend handed over again while it waits

    d.start()  # its scan of the store finds it already queued
    assert idle.wait(5.0)
    d.refill()
    wait_until(lambda: d.idle, 5.0)
    assert seen == ["once"]
    assert store.ops("complete_incoming", "m1") == [("m1", 0)]


def test_a_scan_finding_a_message_whose_finishing_write_was_lost_redoes_it_not_the_handler(dispatching):
    d, store, idle = dispatching
    seen = []
    d.register(Kind.EVENT, TOPIC, lambda payload, message: seen.append(payload))
    d.start()
    item = incoming(store, "m1", "once")  # stored by the engine, then handed over
    d.submit([item])
    assert idle.wait(5.0)

    store.incoming["m1"] = item.record  # the reopen after a failed write dropped its completion
    del store.handled["m1"]
    d.refill()
    wait_until(lambda: d.idle, 5.0)
    assert seen == ["once"]
    assert "m1" in store.handled and "m1" not in store.incoming
    assert len(store.ops("complete_incoming", "m1")) == 2


def incoming_segment(store, key, payloads, headers=None):
    """A received segment of several messages (one publish), stored and as handed over."""
    ids = [key] + [f"{key}.{n}" for n in range(1, len(payloads))]
    record = IncomingRecord(int(Kind.EVENT), TOPIC, "peer-node", "ipc://peer", 0, 1, None, None,
                            headers, ids, make_blob([encode_payload(p) for p in payloads]))
    store.incoming[key] = record
    return Incoming(key, record, None, {})


def test_a_segment_handed_to_the_dispatcher_twice_runs_each_of_its_messages_once(dispatching):
    d, store, idle = dispatching
    seen = []
    d.register(Kind.EVENT, TOPIC, lambda payload, message: seen.append((message.id, payload)))
    item = incoming_segment(store, "s1", ["a", "b", "c"])
    d.submit([item, item])
    d.submit([item])  # a resend handed over again while it waits

    d.start()  # its scan of the store finds it already queued
    assert idle.wait(5.0)
    d.refill()
    wait_until(lambda: d.idle, 5.0)
    assert seen == [("s1", "a"), ("s1.1", "b"), ("s1.2", "c")]
    assert store.ops("complete_incoming", "s1") == [("s1", 0, [0])]
    assert "s1" in store.handled and not store.incoming and not store.runs


def test_a_scan_finding_a_segment_whose_finishing_write_was_lost_redoes_it_not_the_handlers(dispatching):
    d, store, idle = dispatching
    seen = []
    d.register(Kind.EVENT, TOPIC, lambda payload, message: seen.append(payload))
    d.start()
    item = incoming_segment(store, "s1", ["a", "b"])
    d.submit([item])
    assert idle.wait(5.0)

    store.incoming["s1"] = item.record  # the reopen after a failed write dropped its completion
    del store.handled["s1"]
    d.refill()
    wait_until(lambda: d.idle, 5.0)
    assert seen == ["a", "b"]
    assert "s1" in store.handled and "s1" not in store.incoming
    assert len(store.ops("complete_incoming", "s1")) == 2


def test_a_long_segment_pauses_at_its_place_in_the_queue_so_a_higher_priority_message_goes_first(dispatching):
    d, store, idle = dispatching
    seen = []

    def handle(payload, message):
        seen.append(payload)
        if payload == 2:  # while the segment runs, an urgent message arrives
            d.submit([incoming(store, "u1", "urgent", headers={PRIORITY_HEADER: 9})])

    d.register(Kind.EVENT, TOPIC, handle)
    d.start()
    d.submit([incoming_segment(store, "s1", list(range(40)))])
    assert idle.wait(5.0)
    wait_until(lambda: d.idle, 5.0)
    # The segment's run stops after 16 messages and goes back in the queue: the urgent
    # message, queued as if it had waited longer, runs before the segment's 17th.
    assert seen == [*range(16), "urgent", *range(16, 40)]
    assert store.ops("complete_incoming", "s1") == [("s1", 0, [0])]
    assert "u1" in store.handled and not store.incoming


def test_an_ordered_lane_lets_one_message_go_at_a_time_in_id_order():
    def item(mid, key):
        record = IncomingRecord(int(Kind.EVENT), TOPIC, "pub", "ipc://pub", 0, 1, None, None,
                                {ORDER_HEADER: "sub", KEY_HEADER: key}, [mid], make_blob([encode_payload(None)]))
        return Incoming(mid, record, None)

    lanes = Lanes()
    first, third, second, other = item("m1", "k"), item("m3", "k"), item("m2", "k"), item("m4", "j")
    lane = ("ipc://pub", "sub", "k")
    assert lanes.admit(first, 1.0, lane)  # heads its lane: runs now
    assert not lanes.admit(third, 3.0, lane) and not lanes.admit(second, 2.0, lane)
    assert lanes.admit(other, 4.0, ("ipc://pub", "sub", "j"))  # another key's lane is its own

    assert lanes.done(first) == (2.0, second)
    assert lanes.done(second) == (3.0, third)
    assert lanes.done(third) is None and lanes.done(other) is None
    assert len(lanes) == 0


def test_commands_sent_by_one_of_several_handlers_are_stored_apart_for_each_message():
    rig = RunnerRig()

    def notify(payload, message):
        message.send(INVOICING, "invoice", {"order": payload["id"]})

    rig.add(TOPIC, notify, name="notify")
    rig.add(TOPIC, lambda payload, message: None, name="audit")
    first, second = rig.receive(TOPIC, {"id": "A1"}), rig.receive(TOPIC, {"id": "A2"})

    assert rig.run(first) is None and rig.run(second) is None  # neither moved yet by the engine
    stored = {key.split("\x00")[0]: decode_payload(send.body) for key, send in rig.store.sends.items()}
    assert stored == {first: {"order": "A1"}, second: {"order": "A2"}}
