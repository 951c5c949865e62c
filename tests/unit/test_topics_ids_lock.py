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
