"""The web console (servicebus console) attacked as a hostile or unlucky user would: bulk
actions that must touch only what they name, input the bus sends that the page must survive,
odd requests, a bus starting while the console reads its store, a frozen bus."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("aiohttp", reason="the console needs aiohttp (pip install 'servicebus[console]')")

from servicebus import Bus  # noqa: E402
from servicebus.console import Console  # noqa: E402
from servicebus.ops.letters import read_view  # noqa: E402
from servicebus.testing import free_address, wait_until  # noqa: E402

from .test_console import Subscriber, _http  # noqa: E402


@pytest.fixture
def two_causes(tmp_path):
    """A subscriber bus ``sub`` (in this process) with two dead letters of one topic and
    one reason (handler_failed) but two causes: ValueError (k 1) and KeyError (k 2). The
    ValueError one's payload holds what JSON cannot say: NaN, and an integer above 2**53."""
    pub = Bus(free_address(), tmp_path / "pub", name="pub")
    sub = Bus(free_address(), tmp_path / "sub", name="sub", max_attempts=1)

    @sub.every("order.placed")
    def handle(payload, message):
        if payload["k"] == 1:
            raise ValueError("no customer")
        raise KeyError("k")

    try:
        sub.subscribe(pub.address, "order.placed", wait=20)
        pub.publish("order.placed", {"k": 1, "x": float("nan"), "big": 12345678901234567891})
        pub.publish("order.placed", {"k": 2})
        wait_until(lambda: len(read_view(sub.datadir, "deadletters", {})) == 2, 20, message="two dead letters")
        yield pub, sub
    finally:
        sub.close()
        pub.close()


def _not_json(word: str) -> None:
    raise AssertionError(f"{word} is not JSON: a browser's JSON.parse refuses it")


def _causes(datadir: Path) -> list[str]:
    return sorted(str(letter["error"]).split(":")[0] for letter in read_view(datadir, "deadletters", {}))


def test_purge_all_of_one_cause_leaves_the_letters_of_another_cause_alone(two_causes, page):
    pub, sub = two_causes
    with Console([sub.datadir], listen="127.0.0.1:0", write=True, interval=0.3) as console:
        page.goto(console.url)
        row = page.locator("#groups tr[data-cause='ValueError']")
        row.wait_for()
        page.wait_for_selector("#groups tr[data-cause='KeyError']")
        row.locator("button:text('Purge all')").click()
        page.click("#confirm-ok")
        page.wait_for_selector("#action-result:text('purged')")
        assert "purged 1 " in page.text_content("#action-result")
    assert _causes(sub.datadir) == ["KeyError"]  # the other cause's letter is still there


def test_what_a_bus_sends_that_json_cannot_say_still_reaches_the_page(two_causes, page):
    pub, sub = two_causes
    with Console([sub.datadir], listen="127.0.0.1:0", interval=0.3) as console:
        with urllib.request.urlopen(console.url + "api/letters?bus=0", timeout=20) as res:
            json.loads(res.read(), parse_constant=_not_json)  # strict JSON: as a browser parses it
        page.goto(console.url)
        page.click("#groups tr[data-cause='ValueError'] button:text('Show')")
        shown = page.locator("#letter-list tr[data-id]")
        shown.wait_for()
        text = page.text_content("#letter-list")
        assert "NaN" in text and "12345678901234567891" in text  # as they are, not rounded
        assert not page.is_visible("#action-result.problem")


def test_a_bus_index_that_only_looks_like_a_number_is_refused_with_a_reason(two_causes):
    pub, sub = two_causes
    with Console([sub.datadir], listen="127.0.0.1:0") as console:
        for raw in ("%C2%B2", "%D9%A3", "-0", "0x0", "%2B0", "%200"):
            status, reply = _http(console.url + f"api/history?bus={raw}")
            assert status == 400 and "bus must be" in reply.get("error", ""), (raw, status, reply)
        status, reply = _http(console.url + "api/replay", method="POST", body={"bus": "²", "ids": ["x"]})
        assert status in (400, 403) and reply.get("error"), reply
        status, reply = _http(console.url + "api/state")
        assert status == 200 and json.dumps(reply)


def test_a_bus_starting_while_the_console_reads_its_stopped_store_starts(tmp_path, monkeypatch):
    """The console reads a stopped bus's store (LevelDB open, its lock held for as long as
    the read takes); a bus started on it at that moment must start, not fail as locked."""
    import servicebus.ops.letters as letters

    datadir = tmp_path / "orders"
    Bus(free_address(), datadir, name="orders").close()
    reading, held = threading.Event(), threading.Event()
    real = letters.run_view

    def slow_read(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread() and not held.is_set():
            held.set()
            reading.set()
            threading.Event().wait(0.6)  # a read that takes a while: a big store, a slow disk
        return real(*args, **kwargs)

    monkeypatch.setattr(letters, "run_view", slow_read)
    with Console([datadir], listen="127.0.0.1:0", interval=0.3):
        assert reading.wait(20)
        bus = Bus(free_address(), datadir, name="orders")  # LockedError: the store is in use
        try:
            bus.publish("order.placed", {"n": 1})
        finally:
            bus.close()


def _at(base: str, bus: int) -> float:
    status, state = _http(base + "api/state")
    assert status == 200, state
    return state["buses"][bus].get("at") or 0.0


def test_a_frozen_bus_holds_up_neither_the_page_nor_the_other_buses(tmp_path):
    pub = Bus(free_address(), tmp_path / "orders", name="orders")
    sub = Subscriber(tmp_path, pub.address, failing=False)
    askers: list[threading.Thread] = []
    try:
        with Console([pub.datadir, sub.datadir], listen="127.0.0.1:0", interval=0.3) as console:
            base = console.url
            assert console.wait_sampled()
            os.kill(sub.proc.pid, signal.SIGSTOP)  # alive, holding its lock, answering nothing
            try:
                for _ in range(6):  # an operator clicking Show on it, again and again
                    askers.append(threading.Thread(target=_http, args=(base + "api/letters?bus=1",), daemon=True))
                    askers[-1].start()
                start = time.monotonic()
                first = _at(base, 0)
                assert time.monotonic() - start < 3, "the page's state waited for the frozen bus"
                seen = [first]
                wait_until(lambda: seen.append(_at(base, 0)) or len(set(seen)) >= 4, 5,
                           message="the other bus to be read again and again")
            finally:
                os.kill(sub.proc.pid, signal.SIGCONT)
            for t in askers:
                t.join(30)
    finally:
        sub.stop()
        pub.close()


def test_a_data_directory_that_cannot_be_read_stops_nothing_else(tmp_path):
    good = tmp_path / "orders"
    Bus(free_address(), good, name="orders").close()
    loop = tmp_path / "loop"
    loop.symlink_to(loop)  # a symlink loop: every path under it is ELOOP
    with Console([loop, good], listen="127.0.0.1:0", interval=0.3) as console:
        base = console.url
        wait_until(lambda: _http(base + "api/state")[1]["buses"][0].get("error"), 5,
                   message="the loop said to be unreadable")
        seen = [_at(base, 1)]
        wait_until(lambda: seen.append(_at(base, 1)) or len(set(seen)) >= 3, 5,
                   message="the other directory to be read again and again")


def test_the_audit_report_opens_styled_and_paged_and_sends_no_token_to_another_site(tmp_path, page):
    from servicebus.audit import report as audit_report

    from .test_audit_report_page import sample_summary

    good = tmp_path / "orders"
    Bus(free_address(), good, name="orders").close()
    audit = tmp_path / "audit"
    audit.mkdir()
    summary = sample_summary()
    (audit / "summary.json").write_text(json.dumps(summary))
    # The report as audit/report.py writes it: its style and its paging script inline.
    html, _png = audit_report.render(summary, [(1.0, 3), (10.0, 2)], [(100, 5, 4), (103, 2, 2)])
    (audit / "report.html").write_text(html.replace("</body>", "<a href='https://example.com/'>out</a></body>"))
    with Console([good], listen="127.0.0.1:0", audit=audit, token="k" * 20) as console:
        page.goto(console.url)
        page.wait_for_selector("#audit-link")
        with page.context.expect_page() as opened:
            page.click("#audit-link")
        report = opened.value
        report.wait_for_load_state()
        assert report.evaluate("getComputedStyle(document.body).fontFamily") != "Times New Roman"
        listed = sum(len(v) for v in summary["problems"].values())
        assert report.inner_text("#ppos") == f"rows 1-50 of {listed}"  # its script ran
        report.click("#pnext")
        assert report.inner_text("#ppos") == f"rows 51-100 of {listed}"
        res = report.request.get(report.url)
        assert res.headers.get("referrer-policy") == "no-referrer"  # the token is in this URL
        report.close()


def test_many_dead_letters_of_two_causes_are_grouped_shown_and_replayed_in_steps(tmp_path):
    """2,100 KeyError letters, then 2,100 ValueError ones (more of each than one sample
    scans or one page lists), on a stopped bus: both groups with their exact counts, Show
    lists the ValueError ones, Replay all takes them in steps saying more are left."""
    pub = Bus(free_address(), tmp_path / "pub", name="pub")
    sub = Bus(free_address(), tmp_path / "sub", name="sub", max_attempts=1)

    @sub.every("order.placed")
    def handle(payload, message):
        raise (ValueError if payload["k"] == 1 else KeyError)("no")

    try:
        sub.subscribe(pub.address, "order.placed", wait=20)
        pub.publish_many("order.placed", [{"k": 2, "n": n} for n in range(2100)])
        pub.publish_many("order.placed", [{"k": 1, "n": n} for n in range(2100)])
        wait_until(lambda: sub.status().deadletters == 4200, 60, message="4,200 dead letters")
    finally:
        sub.close()
        pub.close()
    with Console([sub.datadir], listen="127.0.0.1:0", write=True, interval=0.3) as console:
        base = console.url
        assert console.wait_sampled()
        bus = _http(base + "api/state")[1]["buses"][0]
        assert bus["letters"] == 4200
        assert sorted((g["cause"], g["count"]) for g in bus["groups"]) == [("KeyError", 2100), ("ValueError", 2100)]
        group = next(g for g in bus["groups"] if g["cause"] == "ValueError")
        query = {"bus": 0, "topic": group["topic"], "reason": group["reason"], "cause": "ValueError"}
        status, shown = _http(base + "api/letters?" + urllib.parse.urlencode(query))
        assert status == 200 and len(shown["letters"]) == 500
        assert {letter["payload"]["k"] for letter in shown["letters"]} == {1}
        replayed = []
        for _ in range(4):
            status, reply = _http(base + "api/replay", method="POST", body=query)
            assert status == 200, reply
            replayed += [row["id"] for row in reply["rows"] if row["result"] == "replayed"]
            if not reply["more"]:
                break
        assert len(replayed) == len(set(replayed)) == 2100 and not reply["more"]
    letters = read_view(sub.datadir, "deadletters", {"brief": True})
    assert len(letters) == 2100 and {str(r["error"]).split(":")[0] for r in letters} == {"KeyError"}


def test_show_of_dead_letters_of_a_mebibyte_each_lists_a_page_bounded_in_bytes(tmp_path):
    pub = Bus(free_address(), tmp_path / "pub", name="pub")
    sub = Bus(free_address(), tmp_path / "sub", name="sub", max_attempts=1)

    @sub.every("order.placed")
    def handle(payload, message):
        raise ValueError("no")

    try:
        sub.subscribe(pub.address, "order.placed", wait=20)
        pub.publish_many("order.placed", [{"n": n, "pad": "x" * 1_000_000} for n in range(8)])
        wait_until(lambda: sub.status().deadletters == 8, 60, message="8 dead letters")
    finally:
        sub.close()
        pub.close()
    with Console([sub.datadir], listen="127.0.0.1:0", interval=0.3) as console:
        assert console.wait_sampled()
        query = urllib.parse.urlencode({"bus": 0, "topic": "order.placed", "cause": "ValueError"})
        with urllib.request.urlopen(console.url + "api/letters?" + query, timeout=30) as res:
            body = res.read()
        shown = json.loads(body)
        assert len(body) < 6 << 20 and 1 <= len(shown["letters"]) < 8 and shown["total"] == 8
