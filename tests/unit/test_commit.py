import threading

import pytest

from servicebus.engine.commit import GroupCommit
from servicebus.errors import StoreError
from servicebus.testing import wait_until


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


def test_an_early_commit_is_reported_after_its_unsynced_write_and_before_its_fsync(store, monkeypatch):
    """One fsync on the latency path: the engine hears of a plain publish while its fsync
    runs, and can read it from the store; its caller returns only once the fsync is done."""
    seen: list[tuple[str, object]] = []
    committer = GroupCommit(store, lambda results: seen.append(("reported", results,
                                                                store.stream_ids("e:t", limit=10))))
    real_sync, real_write = store.sync, store.write_many

    def write_many(batches, *, sync):
        seen.append(("write", sync))
        real_write(batches, sync=sync)

    def sync():
        seen.append(("fsync", None))
        real_sync()

    monkeypatch.setattr(store, "write_many", write_many)
    monkeypatch.setattr(store, "sync", sync)

    def build(batch):
        batch.put_outgoing("e:t", "00000001", b"x")
        return 1

    assert committer.commit(build, early=True) == 1
    assert seen == [("write", False), ("reported", [1], ["00000001"]), ("fsync", None)]
    assert committer.fsyncs == 1


def test_an_early_commit_whose_fsync_fails_was_reported_and_its_caller_gets_the_error(store, monkeypatch):
    """The README's "a message may be delivered although its publish raised"."""
    committer, groups, build = _committer(store)

    def broken():
        raise StoreError("fsync failed")

    monkeypatch.setattr(store, "sync", broken)
    with pytest.raises(StoreError, match="fsync failed"):
        committer.commit(build, early=True)
    assert groups == [[0]] and committer.fsyncs == 0


def test_a_transaction_is_reported_only_once_durable_even_behind_an_early_publish(store, monkeypatch):
    """Entries not marked early (a handler's transaction) wait for the fsync: if it fails,
    nothing of theirs was reported, so nothing went out under ids a retry will not use."""
    committer, groups, build = _committer(store)
    in_sync = [threading.Event(), threading.Event()]  # the 1st, 2nd fsync has begun
    go_on = [threading.Event(), threading.Event()]  # the 1st, 2nd fsync may finish
    calls = iter(range(2))
    real_sync = store.sync

    def held_sync():
        n = next(calls)
        in_sync[n].set()
        assert go_on[n].wait(10)
        real_sync()

    monkeypatch.setattr(store, "sync", held_sync)
    threads = [threading.Thread(target=committer.commit, args=(build,), kwargs={"early": True})]
    threads[0].start()
    assert in_sync[0].wait(10)
    # While the leader's group is in its fsync, an early publish then a transaction queue:
    # the next group, in that order.
    for early in (True, False):
        queued = len(committer._queue)  # noqa: SLF001
        threads.append(threading.Thread(target=committer.commit, args=(build,), kwargs={"early": early}))
        threads[-1].start()
        wait_until(lambda q=queued: len(committer._queue) > q, 10)  # noqa: SLF001
    go_on[0].set()
    assert in_sync[1].wait(10)
    assert groups == [[0], [1]]  # the early publish was reported before the fsync, the transaction not
    go_on[1].set()
    for t in threads:
        t.join(10)
    assert groups == [[0], [1], [2]]


def test_quiet_waits_until_every_batch_built_before_it_is_in_the_store_and_holds_new_builds(store, monkeypatch):
    committer, groups, build = _committer(store)
    writing, release = threading.Event(), threading.Event()
    real = store.write_many

    def slow(batches, *, sync):
        writing.set()
        release.wait(10)  # built (under the lock) and not written yet
        real(batches, sync=sync)

    monkeypatch.setattr(store, "write_many", slow)
    first = threading.Thread(target=committer.commit, args=(build,))
    first.start()
    writing.wait(10)
    seen: list[list[str]] = []

    def engine():
        with committer.quiet():
            seen.append(store.stream_ids("e:t", limit=10))
            second.start()  # a build asked for meanwhile waits for quiet() to end
            seen.append(store.stream_ids("e:t", limit=10))

    second = threading.Thread(target=committer.commit, args=(build,))
    quiet = threading.Thread(target=engine)
    quiet.start()
    wait_until(lambda: quiet.is_alive(), 5)
    assert not seen  # quiet() waits for the batch being written
    monkeypatch.setattr(store, "write_many", real)
    release.set()
    quiet.join(10)
    first.join(10)
    second.join(10)
    assert seen == [["00000000"], ["00000000"]]  # the first in the store; the second not built
    assert store.stream_ids("e:t", limit=10) == ["00000000", "00000001"]
