"""Handler names: stable across restarts, distinct where they must be, and asked for only
when two handlers of one topic really cannot be told apart."""

from __future__ import annotations

import functools

import pytest

from servicebus.handling.handlers import Handlers, handler_name
from servicebus.wire.protocol import Kind


def log(payload, message):
    return None


def names(handlers: Handlers, topic: str) -> list[str]:
    return [n for n, _ in handlers.get((int(Kind.EVENT), topic)) or []]


def test_two_lambdas_on_disjoint_patterns_need_no_name_and_are_named_by_their_topics():
    handlers = Handlers()
    handlers.add(Kind.EVENT, "orders.*", lambda p, m: None)
    handlers.add(Kind.EVENT, "audit.>", lambda p, m: None)
    [orders] = names(handlers, "orders.placed")
    [audit] = names(handlers, "audit.x.y")
    assert orders.startswith(__name__) and orders.endswith(".<lambda>@orders.*")
    assert audit.startswith(__name__) and audit.endswith(".<lambda>@audit.>")


def test_one_function_on_two_patterns_is_named_by_each_of_its_topics():
    handlers = Handlers()
    handlers.add(Kind.EVENT, "orders.*", log)
    handlers.add(Kind.EVENT, "orders.>", log)
    assert names(handlers, "orders.placed") == [f"{handler_name(log)}@orders.*", f"{handler_name(log)}@orders.>"]


def test_the_same_registrations_after_a_restart_give_the_same_names():
    def register() -> list[str]:
        handlers = Handlers()
        handlers.add(Kind.EVENT, "orders.*", log)
        handlers.add(Kind.EVENT, "orders.>", log)
        handlers.add(Kind.EVENT, "orders.placed", lambda p, m: None)
        return names(handlers, "orders.placed")

    first = register()
    assert first == register() and len(set(first)) == 3


def test_two_lambdas_on_one_topic_are_a_real_clash_that_asks_for_names():
    handlers = Handlers()
    handlers.add(Kind.EVENT, "orders.placed", lambda p, m: None)
    with pytest.raises(ValueError, match="name="):
        handlers.add(Kind.EVENT, "orders.placed", lambda p, m: None)


def test_one_function_twice_on_one_topic_is_a_real_clash():
    handlers = Handlers()
    handlers.add(Kind.EVENT, "orders.*", log)
    with pytest.raises(ValueError, match="name="):
        handlers.add(Kind.EVENT, "orders.*", log)


def test_a_name_given_by_the_caller_is_never_changed_and_must_be_free():
    handlers = Handlers()
    handlers.add(Kind.EVENT, "orders.*", log, "a")
    with pytest.raises(ValueError, match="stable name"):
        handlers.add(Kind.EVENT, "audit.>", log, "a")
    handlers.add(Kind.EVENT, "audit.>", log, "b")
    assert names(handlers, "audit.x") == ["b"]


def test_a_partial_has_no_stable_name_beside_a_pattern_handler():
    handlers = Handlers()
    handlers.add(Kind.EVENT, "orders.*", log)
    with pytest.raises(ValueError, match="stable name"):
        handlers.add(Kind.EVENT, "orders.placed", functools.partial(log))


def test_the_name_derived_from_the_users_function_wins_over_the_wrappers():
    handlers = Handlers()

    def wrapper(payload, message):
        return log(payload, message)

    handlers.add(Kind.EVENT, "orders.*", wrapper, derived=handler_name(log))
    assert names(handlers, "orders.x") == [f"{handler_name(log)}@orders.*"]


def test_a_handlers_derived_name_does_not_depend_on_what_else_is_registered():
    def v1() -> list[str]:
        handlers = Handlers()
        handlers.add(Kind.EVENT, "c.y", log)
        handlers.add(Kind.EVENT, "a.x", log)
        return names(handlers, "a.x")

    def v2() -> list[str]:  # the next deploy adds a pattern handler elsewhere
        handlers = Handlers()
        handlers.add(Kind.EVENT, "z.*", lambda p, m: None)
        handlers.add(Kind.EVENT, "c.y", log)
        handlers.add(Kind.EVENT, "a.x", log)
        return names(handlers, "a.x")

    assert v1() == v2()
