"""The audit report in a real browser (no Spark: the page is rendered from a summary made
here, as the audit makes it): the problem pairs paged and filtered, and every table, the
latency columns included, within a 1,300 px window."""

from servicebus.audit import report
from servicebus.audit.problems import LISTED

from ..browser import screenshot

T0 = 1_790_000_000_000
SERVICES = ["billing", "email", "search", None]  # None: an old journal, no name known


def receiver(n: int) -> str:
    return f"tcp://10.0.1.{n}:6000"


COMMANDS = {"lost": "servicebus check {rcv}", "handled_more_than_once": "servicebus journal events {rcv} --id {id}",
            "deadlettered": "servicebus replay {rcv} {id}", "in_flight": "servicebus incoming {rcv} --topic {topic}",
            "owed": "servicebus outgoing /srv/shop --subscriber {address}"}


def pair(klass: str, n: int) -> dict:
    r = n % len(SERVICES)
    datadir = f"/srv/{SERVICES[r]}" if SERVICES[r] else f"<data directory of {receiver(r)}>"
    mid, topic = f"{T0 + n:012x}{n:06x}abcdef", f"orders.t{n % 3}"
    return {"id": mid, "topic": topic, "sender": "tcp://10.0.0.1:5000",
            "sender_name": "shop", "receiver": receiver(r), "receiver_name": SERVICES[r],
            "last_event": "deadlettered" if klass == "deadlettered" else "acked", "last_ts": T0 + n * 1000,
            "published_ts": T0 + n * 1000, "handled_count": 0, "attempts": 3, "deadletter_reason": None,
            "command": COMMANDS[klass].format(rcv=datadir, id=mid, topic=topic, address=receiver(r))}


def sample_summary() -> dict:
    listed = {"lost": 3, "handled_more_than_once": 2, "deadlettered": 130, "in_flight": 4, "owed": 40}
    problems = {k: [pair(k, i * 10 + n) for i in range(listed[k])] for n, k in enumerate(LISTED)}
    counts = {**listed, "owed": 2500}  # more owed than listed: the table has the rest
    lat = {"latency_p50_ms": 12.3, "latency_p95_ms": 180.0, "latency_p99_ms": 1230.0, "latency_max_ms": 98765}
    classes = {c: 100_000 for c in report.CLASSES} | counts

    def row(key: str, value: str, **more) -> dict:
        return {key: value, **more, "messages": 1_234_567, **classes, **lat, "retries": 12_345, "max_attempts": 5}

    return {
        "ok": False, "classes": classes, "problems": problems, "problem_counts": counts,
        "latency_ms": {"p50": 12.3, "p95": 180.0, "p99": 1230.0, "max": 98765}, "retries": 12_345,
        "deadletter_reasons": {"ValueError: bad order": 130}, "attempts": {"1": 10, "3": 130},
        "events": 9_876_543, "inputs": ["/srv/fleet"], "messages": 1_234_567, "grace_ms": 60_000,
        "owed": [{"receiver": receiver(1), "receiver_name": "email", "messages": 2500, "since_ms": T0}],
        "by_topic": [row("topic", f"orders.region-{n}.created.v2") for n in range(4)],
        "by_receiver": [row("receiver", receiver(n), receiver_name=SERVICES[n % 4]) for n in range(6)],
    }


def test_the_report_pages_and_filters_the_problem_pairs_and_fits_1300_px(page, tmp_path):
    summary = sample_summary()
    listed = sum(len(v) for v in summary["problems"].values())
    html, _png = report.render(summary, [(1.0, 3), (10.0, 2)], [(100, 5, 4), (103, 2, 2)])
    path = tmp_path / "report.html"
    path.write_text(html)
    page.goto(path.as_uri())
    rows = page.locator("#problems tbody tr")
    first_cells = lambda: rows.locator("td:first-child").all_inner_texts()  # noqa: E731
    assert rows.count() == 50 and first_cells()[0] == "1"
    assert page.inner_text("#ppos") == f"rows 1-50 of {listed}"
    page.click("#pnext")
    assert first_cells() == [str(n) for n in range(51, 101)]
    assert page.inner_text("#ppos") == f"rows 51-100 of {listed}"
    page.click("#pprev")
    assert first_cells()[0] == "1"

    # Every word typed must match: the service name and a topic.
    page.fill("#pfilter", "billing orders.t1")
    expected = [p for k in LISTED for p in summary["problems"][k]
                if p["receiver_name"] == "billing" and p["topic"] == "orders.t1"]
    assert 0 < len(expected) < 50
    assert page.inner_text("#ppos") == f"rows 1-{len(expected)} of {len(expected)}"
    assert all("billing" in text for text in rows.locator("td:nth-child(6)").all_inner_texts())
    page.fill("#pfilter", "")
    page.select_option("#pclass", "lost")
    assert rows.count() == 3 and set(rows.locator("td:nth-child(2)").all_inner_texts()) == {"lost"}
    page.fill("#pfilter", "no-such-thing")
    assert rows.count() == 0 and page.inner_text("#ppos") == "no pair matches"
    page.fill("#pfilter", "")
    page.select_option("#pclass", "")

    # Nothing is wider than the window, nor scrolls in its own box; p50..max are in view.
    assert page.evaluate("document.documentElement.scrollWidth") <= 1300
    widest = page.evaluate("Math.max(...[...document.querySelectorAll('table')]"
                           ".map(t => t.getBoundingClientRect().right))")
    assert widest <= 1300
    assert page.evaluate("[...document.querySelectorAll('.wide')].every(b => b.scrollWidth <= b.clientWidth)")
    for header in ("p50 ms", "p95 ms", "p99 ms", "max ms"):
        edges = page.locator(f"th:text-is('{header}')")
        assert edges.count() == 2  # by topic and by receiver
        for n in range(2):
            box = edges.nth(n).bounding_box()
            assert box is not None and box["x"] + box["width"] <= 1300, header
    assert "billing" in page.locator("table").filter(has_text="p99 ms").nth(1).inner_text()
    screenshot(page, "audit-report")
