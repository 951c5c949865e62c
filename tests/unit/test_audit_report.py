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
