import os

import pytest

from servicebus.errors import LockedError
from servicebus.model.ids import IdGenerator, id_millis
from servicebus.store.lockfile import DataDirLock, probe, read_owner
from servicebus.wire.topics import validate_topic


@pytest.mark.parametrize("topic", ["a", "user.signup", "x" * 255, "é.ü"])
def test_good_topics(topic):
    assert validate_topic(topic) == topic


@pytest.mark.parametrize("topic", ["", "x" * 256, "é" * 128, "a b", "a\x00b", "tab\t"])
def test_bad_topics_raise_value_error(topic):
    with pytest.raises(ValueError):
        validate_topic(topic)


def test_non_string_topic_raises_type_error():
    with pytest.raises(TypeError):
        validate_topic(5)


def test_ids_are_unique_and_sorted_in_creation_order():
    gen = IdGenerator()
    ids = gen.many(50_000)
    assert len(set(ids)) == len(ids)
    assert ids == sorted(ids)
    assert abs(id_millis(ids[0]) - __import__("time").time() * 1000) < 5000


def test_two_starts_that_read_the_same_clock_and_counter_make_different_ids_by_their_epoch(monkeypatch):
    """A crash may lose the write of ids already sent (one fsync on the latency path), so
    the next start's highest id can be below them and its clock can land on their
    milliseconds (a clock set back): only the epoch then keeps the ids apart."""
    monkeypatch.setattr(os, "urandom", lambda n: bytes(n))  # the same counter start each time
    starts = [IdGenerator(after=None, wall=lambda: 1_700_000_000_000, monotonic=lambda: 5.0, epoch=epoch)
              for epoch in (7, 8)]
    first, second = (gen.many(1000) for gen in starts)
    assert not set(first) & set(second)
    assert [i[:18] for i in first] == [i[:18] for i in second]  # same clock, same counter
    assert {i[18:] for i in first} == {"000007"} and {i[18:] for i in second} == {"000008"}


def test_each_open_of_a_store_counts_its_epoch_up_durably(tmp_path):
    from servicebus.store import Store

    store = Store.open(tmp_path / "store")
    try:
        assert [store.next_epoch() for _ in range(3)] == [1, 2, 3]
    finally:
        store.close()
    store = Store.open(tmp_path / "store")
    try:
        assert store.next_epoch() == 4
    finally:
        store.close()


def test_a_restarted_bus_makes_ids_of_its_next_epoch(tmp_path):
    from servicebus import Bus
    from servicebus.testing import free_address

    epochs = []
    for _ in range(2):
        bus = Bus(free_address(), tmp_path / "bus")
        try:
            epochs.append(int(bus.publish("t.nobody", {"n": 1})[18:], 16))
        finally:
            bus.close()
    assert epochs[1] == epochs[0] + 1


def test_lock_names_its_owner_and_refuses_a_second_holder(tmp_path):
    lock = DataDirLock.acquire(tmp_path, "tcp://127.0.0.1:1")
    owner, alive = probe(tmp_path)
    assert alive and owner.pid == os.getpid() and owner.address == "tcp://127.0.0.1:1"
    with pytest.raises(LockedError, match=f"pid {os.getpid()}") as info:
        DataDirLock.acquire(tmp_path, "tcp://127.0.0.1:2")
    assert info.value.owner["address"] == "tcp://127.0.0.1:1"
    lock.release()
    assert read_owner(tmp_path) is None
    assert probe(tmp_path) == (None, False)


def test_a_stale_lock_file_is_taken_over(tmp_path, caplog):
    (tmp_path / "LOCK").write_text('{"pid": 999999, "host": "h", "address": "a", "started": 1}')
    owner, alive = probe(tmp_path)
    assert owner.pid == 999999 and not alive
    with caplog.at_level("WARNING", logger="servicebus"):
        lock = DataDirLock.acquire(tmp_path, "tcp://127.0.0.1:3")
    assert "stale lock" in caplog.text and "999999" in caplog.text
    assert read_owner(tmp_path).pid == os.getpid()
    lock.release()
