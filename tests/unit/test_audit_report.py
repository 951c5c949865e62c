"""The audit report (issue 17): per-second throughput with the empty seconds drawn as
zero, wide tables that scroll in their box, and a PNG of the plots beside the page."""

import re

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


def test_the_buses_files_are_found_beside_the_segments_and_name_each_address():
    from servicebus.audit.journals import bus_globs, parse_bus_file

    assert bus_globs(["/f/journal/*.jsonl", "/f/*/journal/*.jsonl", "/f/journal/n-000000000001.jsonl",
                      "hdfs://nn/f/{journal,*/journal}/*.jsonl"]) == [
        "/f/*/journal/*.bus.json", "/f/journal/*.bus.json", "hdfs://nn/f/{journal,*/journal}/*.bus.json"]
    described = '{"node": "n", "datadir": "/srv/email", "addresses": {"tcp://a:1": "email", "tcp://a:2": null}}'
    assert parse_bus_file(described, "file:/copy/email/journal") == {
        "tcp://a:1": {"name": "email", "datadir": "/srv/email"}, "tcp://a:2": {"name": None, "datadir": "/srv/email"}}
    # Without its data directory: the one the file was found in.
    assert parse_bus_file('{"addresses": {"tcp://a:1": "email"}}', "/copy/email/journal") == {
        "tcp://a:1": {"name": "email", "datadir": "/copy/email"}}
    for junk in ("", "[]", '{"addresses": 3}', '{"node": "n"}', "{"):  # a power cut, a hand edit
        assert parse_bus_file(junk, "/x/journal") == {}


def _pairs(n: int, **fields) -> list[dict]:
    return [{"id": f"{n:024d}", "topic": "t", "sender": "tcp://s:1", "sender_name": "shop", "receiver": "tcp://r:1",
             "receiver_name": "email", "last_event": "acked", "last_ts": 1_790_000_000_000,
             "command": f"servicebus check /srv/email{n}", **fields} for n in range(n)]


def test_the_problem_list_embeds_its_rows_safely_and_says_what_is_cut():
    import json

    from servicebus.audit import reportlist

    hostile = "</script><script>alert(1)</script><!--"
    problems = {"lost": _pairs(3, topic=hostile), "owed": _pairs(2)}
    counts = {"lost": 3, "handled_more_than_once": 0, "deadlettered": 0, "in_flight": 0, "owed": 2500}
    page, _png = report.render({**SUMMARY, "problems": problems, "problem_counts": counts, "by_topic": []}, [], [])
    assert hostile not in page and "alert(1)" in page
    data = re.search(r'<script type="application/json" id="problem-data">(.*?)</script>', page, re.S)
    rows = json.loads(data.group(1))
    assert [r[0] for r in rows] == ["lost"] * 3 + ["owed"] * 2
    assert rows[0][2] == hostile and rows[0][6] == "email" and rows[0][8] == "2026-09-21 14:13:20.000 UTC"
    assert rows[0][9] == "servicebus check /srv/email0"
    assert "<td>2,500</td><td>2</td>" in page  # the true count beside what is listed
    assert "the table <code>problems</code>" in page
    assert reportlist.section({"problems": {}, "problem_counts": {}}).endswith("<p>None.</p>")


def test_the_printed_summary_names_the_services_and_prints_20_ids_of_a_longer_list():
    import io

    from servicebus.audit import job

    lost = _pairs(1000)
    summary = {**SUMMARY, "ok": False, "retries": 0, "by_topic": [], "problems": {"lost": lost, "handled_more_than_once": []},
               "problem_counts": {"lost": 1000, "handled_more_than_once": 0}}
    out = io.StringIO()
    job.print_summary(summary, "DIR", file=out)
    line = next(x for x in out.getvalue().splitlines() if x.strip().startswith("lost (first"))
    assert line.strip().startswith("lost (first 20 of 1,000): ")
    assert line.count("->") == 20 and f"{0:024d}->tcp://r:1 (email)" in line
    assert "the command that acts on it" in out.getvalue()


def test_the_receivers_table_names_each_receiver_and_puts_latency_first():
    rows = [{"receiver": "tcp://10.0.1.0:6000", "receiver_name": "email", "messages": 6, "latency_p50_ms": 1.5,
             "latency_p95_ms": 2.0, "latency_p99_ms": 1234.5, "latency_max_ms": 98765},
            {"receiver": "tcp://10.0.1.1:6000", "receiver_name": None, "messages": 1}]
    page, _png = report.render({**SUMMARY, "by_receiver": rows, "by_receiver_count": 300}, [], [])
    table = page[page.index("<h2>By receiver</h2>"):]
    assert "<b>email</b><br><small>tcp://10.0.1.0:6000</small>" in table
    assert "<td class=\"text key\"><small>tcp://10.0.1.1:6000</small>" in table  # no name known: none shown
    heads = re.findall(r"<th>([^<]+)</th>", table)
    assert heads[:5] == ["messages", "p50 ms", "p95 ms", "p99 ms", "max ms"]
    assert "<td>1.5</td><td>2.0</td><td>1,234</td><td>98,765</td>" in table
    assert "The first 2 of 300; the table by_receiver has every one." in table
