"""tools/chaos_audit.compare: what the delivery audit of a chaos run must agree on with the
run's own counts (no Spark here: the audit's rows are given)."""

import sys

from tools.chaos_audit import compare

SUB, SUB2, SINK = "tcp://127.0.0.1:2", "tcp://127.0.0.1:3", "tcp://127.0.0.1:4"
EV, FW = "chaos.event", "chaos.forwarded"


def facts(**over):
    base = {"acknowledged": ["a", "b", "c"], "handled": ["a", "b", "c"], "forwarded": [], "lost": [],
            "duplicated": [], "reported_lost": [], "deadletters": []}
    return {**base, **over}


def rows(*pairs):
    return [(mid, receiver, topic, klass) for mid, receiver, topic, klass in pairs]


CLEAN = rows(("a", SUB, EV, "handled"), ("b", SUB, EV, "handled"), ("c", SUB, EV, "handled"))


def test_a_clean_run_agrees():
    assert compare(facts(), CLEAN) == []


def test_an_acknowledged_message_in_no_journal_disagrees():
    absent, unhandled = compare(facts(), CLEAN[:2])
    assert absent == "1 acknowledged messages are in no journal: c"
    assert unhandled == "1 messages a handler ran for are not handled in the audit (its classes: absent): c"


def test_a_loss_or_a_duplicate_only_the_audit_sees_disagrees():
    lost = compare(facts(handled=["a", "b"], acknowledged=["a", "b"]), CLEAN[:2] + rows(("c", SUB, EV, "lost")))
    assert lost == ["1 messages the audit finds lost, the harness not: c"]
    dup = compare(facts(), CLEAN[:2] + rows(("c", SUB, EV, "handled_more_than_once")))
    assert dup == ["1 messages the audit finds handled more than once, the harness once: c"]


def test_what_the_harness_counts_lost_duplicated_or_reported_lost_may_be_so_in_the_audit():
    assert compare(facts(handled=["a", "b"], lost=["c"]), CLEAN[:2] + rows(("c", SUB, EV, "lost"))) == []
    assert compare(facts(handled=["a", "b"], lost=["c"]), CLEAN[:2] + rows(("c", SUB, EV, "owed"))) == []
    assert compare(facts(handled=["a", "b"], reported_lost=["c"]), CLEAN[:2] + rows(("c", SUB, EV, "lost"))) == []
    assert compare(facts(duplicated=["c"]), CLEAN[:2] + rows(("c", SUB, EV, "handled_more_than_once"))) == []


def test_handled_must_be_the_same_messages_on_both_sides():
    # The harness saw a handler run the audit did not, and the other way round.
    (why,) = compare(facts(), CLEAN[:2] + rows(("c", SUB, EV, "in_flight")))
    assert why.startswith("1 messages a handler ran for are not handled in the audit (its classes: in_flight)")
    (why,) = compare(facts(handled=["a", "b"], lost=["c"]), CLEAN)
    assert why.startswith("1 messages handled in the audit ran no handler the harness saw: c")


def test_a_message_published_without_an_acknowledgement_may_be_handled_or_still_owed():
    assert compare(facts(handled=["a", "b", "c", "d"]), CLEAN + rows(("d", SUB, EV, "handled"))) == []
    for klass in ("owed", "in_flight"):
        assert compare(facts(), CLEAN + rows(("d", SUB, EV, klass))) == []


def test_a_group_handover_or_a_moved_subscriber_is_handled_at_one_receiver_each():
    handover = rows(("c", SUB, EV, "handled"), ("c", SUB2, EV, "handled"))
    assert compare(facts(), CLEAN[:2] + handover) == []
    moved = rows(("c", SUB, EV, "dropped"), ("c", SUB2, EV, "handled"), ("b", SUB2, EV, "dropped"))
    assert compare(facts(), CLEAN[:2] + moved) == []


def test_dead_letters_must_be_the_same_messages_on_both_sides():
    dead = rows(("c", SUB, EV, "deadlettered"))
    assert compare(facts(handled=["a", "b"], deadletters=["c"]), CLEAN[:2] + dead) == []
    (why,) = compare(facts(handled=["a", "b"]), CLEAN[:2] + dead)
    assert why.startswith("1 messages dead-lettered in the audit are no dead letter at any bus: c")
    (why,) = compare(facts(handled=["a", "b"], deadletters=["c"], lost=[]), CLEAN[:2] + rows(("c", SUB, EV, "owed")))
    assert why.startswith("1 dead letters at the buses are not dead-lettered in the audit: c")


def test_forwarded_events_are_handled_at_the_sink_and_their_loss_is_the_harness_s_forward_loss():
    sink = rows(("f1", SINK, FW, "handled"), ("f2", SINK, FW, "handled"))
    assert compare(facts(forwarded=["f1", "f2"]), CLEAN + sink) == []
    lost = rows(("f1", SINK, FW, "handled"), ("f2", SINK, FW, "lost"))
    (why,) = compare(facts(forwarded=["f1"]), CLEAN + lost)
    assert why.startswith("1 messages the audit finds lost, the harness not: f2")
    assert compare(facts(forwarded=["f1"], lost=["forward of c"]), CLEAN + lost) == []


def test_without_pyspark_the_audit_says_why_it_cannot_run(monkeypatch):
    from tools import chaos_audit

    monkeypatch.setitem(sys.modules, "pyspark", None)  # import pyspark raises ImportError
    assert chaos_audit.spark_problem() == "pyspark is not installed (pip install 'servicebus[audit]')"
    said = []
    auditor = chaos_audit.Auditor(True, said.append)
    assert auditor.skipped == chaos_audit.spark_problem() and "pyspark is not installed" in said[0]
    assert auditor.audit(None, {}, report=False) == {"skipped": auditor.skipped}
    assert chaos_audit.Auditor(False, said.append).skipped == "--no-audit"
