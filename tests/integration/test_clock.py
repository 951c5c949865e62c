"""A wall clock that jumps (set back by an operator, NTP stepping, a VM restored from a
snapshot) must not lose or duplicate anything: buses under libfaketime."""

import json
import time
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from servicebus.model.clock import wall_ms
from servicebus.ops.admin import query_live
from servicebus.testing import free_address, wait_until

from ..conftest import counting_handler, faketime

pytestmark = pytest.mark.slow

TOPIC = "user.signup"


def test_messages_published_after_a_restart_with_the_clock_set_back_are_delivered(make_bus, bus_process):
    sub = make_bus("sub")
    sent: dict[int, int] = {}
    got = counting_handler(sub, TOPIC, lambda p, m: sent.__setitem__(p["n"], m.sent_ms))
    pub = bus_process("pub", "--publish", TOPIC, "--batch", "10")
    sub.subscribe(pub.address, TOPIC)
    pub.start("--count", "100")
    wait_until(lambda: len(got) == 100, 30, message=lambda: f"{len(got)} of 100 before the clock moved")
    pub.stop()

    env = faketime("-1h")
    pub.start("--count", "100", "--first", "100", env=env)
    wait_until(lambda: len(pub.published_ids()) == 200, 30)
    wait_until(lambda: len(got) == 200, 30, message=lambda: f"{len(got)} of 200 after the clock went back an hour")
    assert set(got.values()) == {1}
    # The fault was real: the publisher stamped the second hundred an hour in the past.
    assert max(sent[n] for n in range(100, 200)) < wall_ms() - 50 * 60_000
    second = pub.published_ids()[100:]
    assert min(second) > max(pub.published_ids()[:100]), "ids must keep increasing whatever the clock does"


def offline_status(datadir) -> dict:
    out = subprocess.run([str(Path(sys.executable).parent / "servicebus"), "status", str(datadir), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_clock_jumping_past_the_dedupe_window_does_not_make_a_resend_handled_twice(make_bus, bus_process):
    # The subscriber handles 50 messages; the publisher then loses their acks (its data
    # directory is put back as it was before), and the subscriber comes back with its
    # wall clock 8 days ahead, past the 7-day dedupe window. The resends must be acked
    # and not handled again: the window counts the bus's own running time.
    address = free_address()
    pub = make_bus("pub", address)
    sub = bus_process("sub", "--handle", TOPIC)
    sub.start("--subscribe", pub.address, TOPIC)
    sub.stop()
    pub.publish_many(TOPIC, [{"n": n} for n in range(50)])
    pub.close()
    snapshot = pub.datadir.with_name("pub-before-acks")
    shutil.copytree(pub.datadir, snapshot)

    pub = make_bus("pub", address)
    sub.start()
    wait_until(lambda: len(sub.done_counts()) == 50, 30, message=lambda: f"{len(sub.done_counts())} of 50")
    assert pub.drain(10)
    pub.close()
    sub.stop()
    shutil.rmtree(pub.datadir)
    shutil.copytree(snapshot, pub.datadir)  # the acks are lost
    # Read from the stopped store: once the publisher is open its resends may be acked
    # before a status() call gets its turn (seen under load).
    assert offline_status(pub.datadir)["pending"] == 50

    env = faketime("+8d")
    sub.start(env=env)
    for _ in range(2):  # a live answer comes from the engine loop: its first timers ran
        status = query_live(sub.datadir, "status", {})[0]
    assert status["handled"] == 1  # the key of the one segment publish_many made, remembered
    pub = make_bus("pub", address)
    assert pub.drain(20), "the resends were not acknowledged"
    assert sub.done_counts() == Counter({n: 1 for n in range(50)})
    assert query_live(sub.datadir, "status", {})[0]["handled"] == 1


@pytest.mark.parametrize("offset, expires", [("-1h", False), ("+1h", True)])
def test_a_ttl_counts_on_the_receivers_clock_from_receipt_whatever_the_senders_clock_says(
        make_bus, bus_process, offset, expires):
    receiver = make_bus("receiver")
    env = faketime(offset)
    sender = bus_process("sender")
    sender.start("--send", receiver.address, "audit.record", "--ttl", "3", env=env)
    wait_until(lambda: receiver.status().incoming == 1 or receiver.status().deadletters == 1, 20)
    if expires:
        # Sent by a clock an hour ahead with 3 s to live: it expires 3 s after receipt,
        # not an hour later.
        wait_until(lambda: receiver.status().deadletters == 1, 10)
        assert receiver.status().incoming == 0
        return
    # Sent by a clock an hour behind: it was not already an hour dead on arrival.
    assert receiver.status().deadletters == 0
    got = []
    receiver.handle("audit.record", lambda payload, message: got.append(message.expires_ms))
    wait_until(lambda: got, 10)
    assert got[0] > wall_ms(), "the handler sees the expiry in the receiver's clock"


def test_a_retry_scheduled_before_a_restart_with_the_clock_set_back_waits_at_most_retry_max(
        make_bus, bus_process):
    pub = make_bus("pub")
    sub = bus_process("sub", "--handle", TOPIC, "--subscribe", pub.address, TOPIC,
                      "--fail-first", "--retry-initial", "4", "--retry-max", "4")
    sub.start()
    pub.publish(TOPIC, {"n": 1})
    # Attempt 1 failed and its retry, 4 s away, is stored.
    wait_until(lambda: any(row["next_attempt_ms"] for row in query_live(sub.datadir, "incoming", {})), 10)
    sub.kill()
    env = faketime("-1h")
    sub.start(env=env)
    # Its retry time, read on a clock an hour behind, is an hour and 4 s away: it must
    # still run within retry_max.
    wait_until(lambda: sub.done_counts() == Counter({1: 1}), 15,
               message=lambda: f"handled {dict(sub.done_counts())}")


def test_a_delay_published_after_a_run_with_the_clock_ahead_is_not_sent_early(make_bus, bus_process):
    # A run with the clock two days ahead leaves ids two days in the future in the store;
    # back on the real clock, a publish(delay=5) must still wait 5 s, not go at once.
    sub = make_bus("sub")
    handled: dict[int, float] = {}
    counting_handler(sub, TOPIC, lambda p, m: handled.__setitem__(p["n"], time.monotonic()))
    pub = bus_process("pub", "--publish", TOPIC)
    sub.subscribe(pub.address, TOPIC)
    pub.start("--count", "3", env=faketime("+2d"))
    wait_until(lambda: len(handled) == 3, 30, message=lambda: f"{len(handled)} of 3 handled")
    pub.stop()

    pub.start("--count", "1", "--first", "3", "--delay", "5")
    ready = time.monotonic()  # the publish is made after the process said it was ready
    wait_until(lambda: 3 in handled, 30, message="the delayed message")
    assert handled[3] - ready >= 4.5, f"handled {handled[3] - ready:.2f} s after a 5 s delay"
