import threading

import pytest

from servicebus.engine.commit import GroupCommit
from servicebus.errors import StoreError


def _committer(store):
    groups: list[list[int]] = []
    committer = GroupCommit(store, groups.append)
    counter = iter(range(1_000_000))

    def build(batch):
        n = next(counter)  # runs under the commit lock: n is the commit order
        batch.put_outgoing("e:t", f"{n:08d}", b"x")
        return n

    return committer, groups, build


def test_concurrent_commits_share_fsyncs_and_are_reported_in_build_order(store):
    committer, groups, build = _committer(store)
    results: list[int] = []
    lock = threading.Lock()

    def worker():
        for _ in range(60):
            n = committer.commit(build)
            with lock:
                results.append(n)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == list(range(480))
    reported = [n for group in groups for n in group]
    assert reported == list(range(480))  # every commit once, groups in order
    assert committer.fsyncs == len(groups) < 480  # some callers shared an fsync
    assert store.stream_ids("e:t", limit=1000) == [f"{n:08d}" for n in range(480)]


def test_a_failed_write_fails_its_callers_reports_nothing_and_the_next_commit_works(store, monkeypatch):
    committer, groups, build = _committer(store)

    def broken(batches, *, sync):
        raise StoreError("disk on fire")

    monkeypatch.setattr(store, "write_many", broken)
    with pytest.raises(StoreError, match="disk on fire"):
        committer.commit(build)
    assert groups == [] and committer.fsyncs == 0
    monkeypatch.undo()
    assert committer.commit(build) == 1
    assert groups == [[1]] and committer.fsyncs == 1
    assert store.stream_ids("e:t", limit=10) == ["00000001"]


def _commit_in_thread(committer, build, timeout=5.0):
    """commit() on another thread; its result or exception, or TimeoutError if it hangs."""
    out: list = []

    def run():
        try:
            out.append(committer.commit(build))
        except BaseException as exc:  # noqa: BLE001
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError("commit() hangs")
    return out[0]


def test_a_commit_whose_report_raises_fails_its_caller_and_the_caller_queued_behind_it_commits(
        store, monkeypatch):
    import time

    calls = []

    def on_commit(results):
        calls.append(results)
        if len(calls) == 1:
            raise RuntimeError("the engine refused the notice")

    committer = GroupCommit(store, on_commit)
    build = lambda batch: batch.put_outgoing("e:t", f"{time.monotonic_ns()}", b"x") or len(calls)  # noqa: E731
    real = store.write_many
    writing = threading.Event()

    def slow_write(batches, sync):
        writing.set()
        time.sleep(0.3)  # the second caller queues behind this group meanwhile
        return real(batches, sync=sync)

    monkeypatch.setattr(store, "write_many", slow_write)
    first: list = []
    leader = threading.Thread(target=lambda: first.append(_commit_in_thread(committer, build)))
    leader.start()
    assert writing.wait(5)
    second = _commit_in_thread(committer, build)
    leader.join(10)
    assert isinstance(first[0], RuntimeError)
    assert second == 0 and len(calls) == 2  # built while the first group was written


def test_an_interrupted_write_leaves_later_commits_working(store, monkeypatch):
    committer, groups, build = _committer(store)
    real = store.write_many
    monkeypatch.setattr(store, "write_many", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert isinstance(_commit_in_thread(committer, build), KeyboardInterrupt)
    monkeypatch.setattr(store, "write_many", real)
    assert _commit_in_thread(committer, build) == 1


def test_a_caller_interrupted_while_waiting_does_not_stall_the_commits_after_it(store, monkeypatch):
    import os
    import signal
    import time

    committer, groups, build = _committer(store)
    real = store.write_many
    first = threading.Event()

    def slow_write(batches, sync):
        first.set()
        time.sleep(0.5)  # a slow fsync: the next caller queues behind it
        return real(batches, sync=sync)

    monkeypatch.setattr(store, "write_many", slow_write)
    leader = threading.Thread(target=committer.commit, args=(build,), daemon=True)
    leader.start()
    assert first.wait(5)
    # Ctrl-C reaches the main thread while it waits behind the leader for its turn.
    timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        committer.commit(build)
    leader.join(5)
    monkeypatch.setattr(store, "write_many", real)
    assert _commit_in_thread(committer, build) is not None
