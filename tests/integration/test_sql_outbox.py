"""The SQL outbox (issue 16): messages written as rows in the service's own database
transaction reach the bus only if that transaction commits, each exactly once, even when
the relay stops between moving rows into the bus and deleting them."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

sa = pytest.importorskip("sqlalchemy", reason="the sql extra (SQLAlchemy) is not installed")

from servicebus.sql import SqlOutbox  # noqa: E402
from servicebus.testing import wait_until  # noqa: E402

TOPIC = "order.placed"


@pytest.fixture
def service(make_bus, tmp_path):
    """A service with its own SQLite database and an outbox into its bus, a subscriber of
    its events that handles its commands too, and the runs of each by ``n``."""
    bus = make_bus("svc")
    sub = make_bus("sub")
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'svc.db'}")
    orders = sa.Table("orders", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True))
    orders.create(engine)
    outbox = SqlOutbox(bus, engine)
    outbox.create_table()
    events, notes = Counter(), Counter()
    lock = threading.Lock()

    def count(into):
        def handler(payload, message):
            with lock:
                into[payload["n"]] += 1
        return handler

    sub.every(TOPIC, count(events))
    sub.handle("order.note", count(notes))
    sub.subscribe(bus.address, TOPIC, wait=10)
    yield bus, sub, engine, orders, outbox, events, notes
    outbox.stop()
    engine.dispose()


def test_rows_of_a_committed_transaction_reach_the_bus_and_of_a_rolled_back_one_never(service):
    bus, sub, engine, orders, outbox, events, notes = service
    for n in range(10):
        with engine.begin() as conn:
            conn.execute(orders.insert().values(id=n))
            outbox.publish(conn, TOPIC, {"n": n})
            outbox.send(conn, sub.address, "order.note", {"n": n}, headers={"by": "sql"})
    with pytest.raises(RuntimeError):
        with engine.begin() as conn:
            conn.execute(orders.insert().values(id=99))
            outbox.publish(conn, TOPIC, {"n": 99})
            raise RuntimeError("the service's transaction fails")
    assert outbox.relay() == 20
    wait_until(lambda: len(events) == 10 and len(notes) == 10, 15,
               message=lambda: f"{len(events)} events, {len(notes)} notes")
    assert set(events.values()) == {1} and set(notes.values()) == {1} and 99 not in events
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(outbox.table)).scalar() == 0
    assert bus.kv.items("sb-sql-outbox:") == []  # no marks left


def test_rows_moved_before_the_relay_stopped_are_not_moved_again(service, monkeypatch):
    bus, sub, engine, orders, outbox, events, notes = service
    with engine.begin() as conn:
        for n in range(5):
            outbox.publish(conn, TOPIC, {"n": n})
    # The relay stops after the rows went into the bus and before they left the table.
    def stopped(self, *args, **kwargs):
        raise RuntimeError("stopped here")

    monkeypatch.setattr(sa.Table, "delete", stopped)
    with pytest.raises(RuntimeError, match="stopped here"):
        outbox.relay()
    monkeypatch.undo()
    again = SqlOutbox(bus, engine)  # as after a restart
    assert again.relay() == 0  # the rows were marked: deleted, not moved again
    wait_until(lambda: len(events) == 5, 15, message=lambda: f"{len(events)} of 5 events")
    assert sub.drain(10)
    assert set(events.values()) == {1}
    assert bus.kv.items("sb-sql-outbox:") == []


def test_marks_of_rows_already_deleted_are_forgotten_at_start(service):
    bus, sub, engine, orders, outbox, events, notes = service
    bus.kv.put("sb-sql-outbox:servicebus_outbox:12345", True)  # a crash between the deletes
    assert outbox.forget_stale_marks() == 1
    assert bus.kv.items("sb-sql-outbox:") == []


def test_the_relay_thread_moves_rows_as_they_are_committed(service):
    bus, sub, engine, orders, outbox, events, notes = service
    outbox.start()
    with engine.begin() as conn:
        outbox.publish(conn, TOPIC, {"n": 1})
    outbox.wake()
    wait_until(lambda: events[1] == 1, 15, message="the event")
    assert outbox.relayed == 1


def test_bad_input_is_refused_in_the_services_transaction_not_at_the_relay(service):
    bus, sub, engine, orders, outbox, events, notes = service
    with engine.begin() as conn:
        with pytest.raises(ValueError):
            outbox.publish(conn, "bad topic with spaces", {"n": 1})
        with pytest.raises(ValueError):
            outbox.send(conn, "not-an-address", "order.note", {"n": 1})
        with pytest.raises(TypeError):
            outbox.publish(conn, TOPIC, object())
    with pytest.raises(ValueError, match="batch"):
        SqlOutbox(bus, engine, batch=0)
