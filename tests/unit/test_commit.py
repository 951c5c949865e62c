import threading

import pytest

from servicebus.commit import GroupCommit
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
