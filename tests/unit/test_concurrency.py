"""How many workers run handlers at once (handling/concurrency.py): one while handlers
compute and keep finishing, more once they wait or stall."""

from servicebus.handling.concurrency import BLOCKED, STALL, Concurrency


def test_a_worker_may_always_start_when_none_runs():
    c = Concurrency(8, now=0.0)
    assert c.may_start(0.0)
    c.started()
    c.finished(0.001, wall=0.001, waited=0.0)
    assert c.active == 0 and c.may_start(0.001)


def test_a_second_worker_waits_while_the_first_keeps_finishing_runs_that_compute():
    c = Concurrency(8, now=0.0)
    c.started()
    for step in range(1, 100):
        now = step * STALL / 4
        c.finished(now, wall=STALL / 4, waited=0.0)
        c.started()
        assert not c.may_start(now + STALL / 8)
    assert c.wake(50, 16, now) == 0  # the running one takes new work next


def test_one_more_worker_starts_once_no_run_finished_for_the_stall_time():
    c = Concurrency(8, now=0.0)
    c.started()  # a slow or hung handler
    assert not c.may_start(STALL / 2)
    assert c.recheck_in(STALL / 2) == STALL / 2
    assert c.may_start(STALL)


def test_runs_that_mostly_wait_let_every_worker_run_up_to_the_limit():
    c = Concurrency(4, now=0.0)
    c.started()
    for step in range(1, 20):  # each run: 10 ms in a handler's network call, 1 ms computing
        c.finished(step * 0.011, wall=0.011, waited=0.010)
        c.started()
    assert c.blocked >= BLOCKED
    now = 20 * 0.011
    for _ in range(3):
        assert c.may_start(now)
        c.started()
    assert c.active == 4 and not c.may_start(now + 10)  # never past the limit
    assert c.wake(100, 16, now) == 0


def test_new_work_wakes_one_worker_when_handlers_compute_and_several_when_they_wait():
    computing = Concurrency(8, now=0.0)
    assert computing.wake(100, 16, 0.0) == 1
    waiting = Concurrency(8, now=0.0)
    for _ in range(20):
        waiting.started()
        waiting.finished(0.0, wall=0.01, waited=0.0095)
    assert waiting.wake(100, 16, 0.0) == 7  # ceil(100 / 16)
