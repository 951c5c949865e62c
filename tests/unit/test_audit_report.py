"""The audit report (issue 17): per-second throughput with the empty seconds drawn as
zero, wide tables that scroll in their box, and a PNG of the plots beside the page."""

import pytest

from servicebus.audit import report

SUMMARY = {"ok": True, "classes": {c: 1 for c in report.CLASSES}, "problems": {},
           "latency_ms": {"p50": 1, "p95": 2, "p99": 3, "max": 4}, "deadletter_reasons": {},
           "attempts": {}, "events": 10, "inputs": ["fleet"], "messages": 6, "grace_ms": 60_000,
           "retries": 0, "by_topic": [{"topic": "t", "messages": 6}]}


def test_seconds_without_messages_are_plotted_as_zero_not_bridged():
    assert report._per_second([(100, 5, 4), (103, 2, 2)]) == [
        (100, 5, 4), (101, 0, 0), (102, 0, 0), (103, 2, 2)]


def test_the_report_has_both_plots_a_png_of_them_and_tables_that_scroll():
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install 'servicebus[audit]')")
    page, png = report.render(SUMMARY, [(1.0, 3), (10.0, 2)], [(100, 5, 4), (103, 2, 2)])
    assert page.count("data:image/png;base64,") == 2
    assert png is not None and png.startswith(b"\x89PNG\r\n\x1a\n")
    assert '<div class="wide"><table>' in page and "overflow-x:auto" in page


def test_a_report_without_data_has_no_png():
    page, png = report.render({**SUMMARY, "by_topic": []}, [], [])
    assert png is None and "no data or matplotlib missing" in page


def test_dead_letter_reasons_are_grouped_by_cause_with_examples():
    """Issue 32: reasons were keyed by the full error text (38 entries for one cause)."""
    from servicebus.audit.classify import causes

    reasons = {f"ValueError: bad order {n}": 1 for n in range(38)}
    reasons |= {"expired": 4, "KeyError: 'sku'": 2, "not acknowledged: 3 reads": 1}
    grouped = causes(reasons)
    assert [(g["cause"], g["messages"]) for g in grouped] == [
        ("ValueError", 38), ("expired", 4), ("KeyError", 2), ("not acknowledged: 3 reads", 1)]  # not a type
    assert grouped[0]["examples"] == ["ValueError: bad order 0", "ValueError: bad order 1",
                                      "ValueError: bad order 2"]
    page, _png = report.render({**SUMMARY, "deadletter_reasons": reasons, "deadletter_causes": grouped,
                                "by_topic": []}, [], [])
    assert "ValueError: 38" in page and page.count("bad order") == 3


def test_the_report_uses_the_full_width_readable_column_names_and_lists_what_is_owed():
    rows = [{"topic": "t", "messages": 6, **{c: 1 for c in report.CLASSES}, "latency_p99_ms": 3.0}]
    owed = [{"receiver": "tcp://10.0.0.2:5555", "messages": 960, "since_ms": 1_790_000_000_000}]
    page, _png = report.render({**SUMMARY, "by_topic": rows, "owed": owed}, [], [])
    assert "max-width:70em" not in page  # not a narrow column with the tables scrolling beside it
    assert "<th>handled twice+</th>" in page and "<th>p99 ms</th>" in page
    assert "handled_more_than_once</th>" not in page
    assert "960 waiting on tcp://10.0.0.2:5555" in page
