"""The web console (servicebus console) in a real headless Chromium, over real buses: a
subscriber in its own process whose handler fails, a publisher in this one. Screenshots
of the pages go to tests/screenshots/ (tests/browser.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("aiohttp", reason="the console needs aiohttp (pip install 'servicebus[console]')")

from servicebus import Bus  # noqa: E402
from servicebus.console import Console  # noqa: E402
from servicebus.ops.letters import read_view  # noqa: E402
from servicebus.testing import free_address, wait_until  # noqa: E402

from ..browser import screenshot  # noqa: E402
from ..journals import journal_events  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CLI = str(Path(sys.executable).parent / "servicebus")


class Subscriber:
    """tests/consoleproc.py: handles order.placed, failing bad orders while ``fail`` exists."""

    def __init__(self, tmp_path: Path, publisher: str, *, failing: bool = True) -> None:
        self.datadir = tmp_path / "emails"
        self.out, self.ready, self.fail = tmp_path / "emails.out", tmp_path / "emails.ready", tmp_path / "fail"
        if failing:
            self.fail.touch()
        with open(tmp_path / "emails.log", "wb") as log:
            self.proc = subprocess.Popen(
                    [sys.executable, "-m", "tests.consoleproc", "--bind", free_address(), "--datadir", str(self.datadir),
                 "--ready", str(self.ready), "--publisher", publisher, "--out", str(self.out),
                 "--fail-file", str(self.fail)], cwd=ROOT, stderr=log)
        wait_until(lambda: self.ready.exists() or self.proc.poll() is not None, 30, message="the subscriber to start")
        assert self.proc.poll() is None, (tmp_path / "emails.log").read_text()

    def done(self) -> dict[int, dict]:
        lines = self.out.read_text().splitlines() if self.out.exists() else []
        return {int(n): json.loads(p) for _, n, p in (line.split(" ", 2) for line in lines)}

    def letters(self) -> list[dict]:
        return list(read_view(self.datadir, "deadletters", {}))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def fleet(tmp_path):
    """A publisher ``orders`` (here) and a subscriber ``emails`` (its own process) for which
    orders 1 and 3 of 0..5 became dead letters."""
    pub = Bus(free_address(), tmp_path / "orders", name="orders")
    sub = Subscriber(tmp_path, pub.address)
    try:
        for n in range(6):
            pub.publish("order.placed", {"n": n, "bad": n in (1, 3), "customer": None if n in (1, 3) else f"c{n}"})
        wait_until(lambda: len(sub.letters()) == 2 and len(sub.done()) == 4, 30, message="two dead letters")
        yield pub, sub
    finally:
        sub.stop()
        pub.close()


def _journaled(datadir: Path, mid: str, event: str) -> bool:
    return any(e["id"] == mid and e["event"] == event for e in journal_events(datadir))


def test_replay_clicked_on_a_dead_letter_is_handled_and_journaled(fleet, tmp_path, page):
    pub, sub = fleet
    by_n = {letter["payload"]["n"]: letter["id"] for letter in sub.letters()}
    with Console([pub.datadir, sub.datadir], listen="127.0.0.1:0", write=True, interval=0.3) as console:
        page.goto(console.url)
        page.wait_for_selector("#groups tr[data-cause='ValueError']")
        for n in range(10, 40):  # traffic while it watches: the plots have something to draw
            pub.publish("order.placed", {"n": n, "bad": False, "customer": f"c{n}"})
        wait_until(lambda: len(sub.done()) == 34, 30, message="the new orders handled")
        page.wait_for_selector("#bus-0 svg.plot polyline")
        page.wait_for_selector("#services td:text('emails')")
        page.wait_for_selector(f"#bus-0 tr[data-subscriber='{sub_address(sub)}'] td:text('emails')")
        screenshot(page, "console-overview")

        sub.fail.unlink()  # the cause is mended: a replay now succeeds
        page.click("#groups tr[data-cause='ValueError'] button:text('Show')")
        row = page.locator(f"#letter-list tr[data-id='{by_n[1]}']")
        row.wait_for()
        screenshot(page, "console-dead-letters")
        row.locator("button:text('Replay')").first.click()
        wait_until(lambda: 1 in sub.done(), 20, message="the replayed order to be handled")
        page.wait_for_selector(f"#letter-list tr[data-id='{by_n[1]}']", state="detached")
        assert "replayed 1" in page.text_content("#action-result")
        assert sub.done()[1]["n"] == 1
        wait_until(lambda: _journaled(sub.datadir, by_n[1], "replayed"), 20, message="replayed in the journal")
        screenshot(page, "console-after-replay")


def test_a_poison_payload_edited_in_the_browser_and_replayed_is_handled_with_the_new_payload(fleet, page):
    pub, sub = fleet
    by_n = {letter["payload"]["n"]: letter["id"] for letter in sub.letters()}
    with Console([sub.datadir], listen="127.0.0.1:0", write=True, interval=0.3) as console:
        page.goto(console.url)
        page.click("#groups tr[data-cause='ValueError'] button:text('Show')")
        row = page.locator(f"#letter-list tr[data-id='{by_n[3]}']")
        row.locator("button:text('Edit & replay')").click()
        area = page.locator("#edit-payload")
        assert json.loads(area.input_value()) == {"n": 3, "bad": True, "customer": None}
        area.fill("{not json")  # refused in the page: the dialog stays, saying why
        page.click("#edit-ok")
        assert "not JSON" in page.text_content("#edit-error") and page.locator("#edit[open]").count() == 1
        area.fill(json.dumps({"n": 3, "bad": False, "customer": "c3"}))
        screenshot(page, "console-edit-and-replay")
        page.click("#edit-ok")
        wait_until(lambda: 3 in sub.done(), 20, message="the edited order to be handled")
        assert sub.done()[3] == {"n": 3, "bad": False, "customer": "c3"}  # while bad ones still fail
        page.wait_for_selector(f"#letter-list tr[data-id='{by_n[3]}']", state="detached")
        wait_until(lambda: _journaled(sub.datadir, by_n[3], "replayed"), 20, message="replayed in the journal")
        assert [letter["id"] for letter in sub.letters()] == [by_n[1]]


def sub_address(sub: Subscriber) -> str:
    return read_view(sub.datadir, "status", {})[0]["lock"]["address"]


def _http(url: str, *, method: str = "GET", body: object = None, headers: dict | None = None,
          raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    hdrs = {"Content-Type": "application/json"} if data is not None else {}
    hdrs.update(headers or {})
    req = urllib.request.Request(url, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=20) as res:
            status, text = res.status, res.read()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read()
    try:
        return status, json.loads(text or b"null")
    except ValueError:
        return status, {"text": text.decode(errors="replace")}


def test_a_read_only_console_shows_no_working_button_and_refuses_every_action(fleet, page):
    pub, sub = fleet
    mid = sub.letters()[0]["id"]
    with Console([sub.datadir], listen="127.0.0.1:0") as console:
        base = console.url
        page.goto(base)
        page.click("#groups tr[data-cause='ValueError'] button:text('Show')")
        page.locator(f"#letter-list tr[data-id='{mid}']").wait_for()
        buttons = page.locator("#letter-list button, #groups button:not(:text('Show'))")
        assert buttons.count() >= 5 and all(buttons.nth(i).is_disabled() for i in range(buttons.count()))
        assert page.text_content("#mode") == "read-only"
        for action in ("replay", "purge"):
            status, reply = _http(base + f"api/{action}", method="POST", body={"bus": 0, "ids": [mid]})
            assert status == 403 and "read-only" in reply["error"]
    assert [letter["id"] for letter in sub.letters()].count(mid) == 1  # nothing changed


def test_hostile_requests_are_refused_with_a_reason_and_change_nothing(fleet, tmp_path):
    pub, sub = fleet
    before = sorted(letter["id"] for letter in sub.letters())
    mid = before[0]
    secret = tmp_path / "audit" / ".." / "secret.txt"
    (tmp_path / "audit").mkdir()
    secret.write_text("not for the console")
    with Console([sub.datadir], listen="127.0.0.1:0", write=True, audit=tmp_path / "audit") as console:
        base = console.url
        port = base.rsplit(":", 1)[1].strip("/")
        cases = [
            # (what, request kwargs, status expected)
            ("another host name (DNS rebinding)", {"path": "api/state", "headers": {"Host": f"evil.example:{port}"}}, 421),
            ("a form post", {"path": "api/purge", "method": "POST", "raw": b"bus=0&all=true",
                             "headers": {"Content-Type": "application/x-www-form-urlencoded"}}, 415),
            ("another origin", {"path": "api/purge", "method": "POST", "body": {"bus": 0, "all": True},
                                "headers": {"Origin": "http://evil.example"}}, 403),
            ("another site", {"path": "api/purge", "method": "POST", "body": {"bus": 0, "all": True},
                              "headers": {"Sec-Fetch-Site": "cross-site"}}, 403),
            ("not JSON", {"path": "api/replay", "method": "POST", "raw": b"{nope"}, 400),
            ("a JSON list", {"path": "api/replay", "method": "POST", "body": [1, 2]}, 400),
            ("no bus", {"path": "api/replay", "method": "POST", "body": {"ids": [mid]}}, 400),
            ("a bus out of range", {"path": "api/replay", "method": "POST", "body": {"bus": 7, "ids": [mid]}}, 400),
            ("a bus that is true", {"path": "api/replay", "method": "POST", "body": {"bus": True, "ids": [mid]}}, 400),
            ("ids not a list", {"path": "api/replay", "method": "POST", "body": {"bus": 0, "ids": mid}}, 400),
            ("ids of numbers", {"path": "api/replay", "method": "POST", "body": {"bus": 0, "ids": [1, 2]}}, 400),
            ("too many ids", {"path": "api/purge", "method": "POST", "body": {"bus": 0, "ids": ["x"] * 1001}}, 400),
            ("nothing named", {"path": "api/purge", "method": "POST", "body": {"bus": 0}}, 400),
            ("all and ids", {"path": "api/purge", "method": "POST", "body": {"bus": 0, "all": True, "ids": [mid]}}, 400),
            ("an unknown field", {"path": "api/purge", "method": "POST", "body": {"bus": 0, "ids": [mid], "x": 1}}, 400),
            ("a payload for two", {"path": "api/replay", "method": "POST",
                                   "body": {"bus": 0, "ids": before, "payload": {"n": 1}}}, 400),
            ("a payload for a purge", {"path": "api/purge", "method": "POST",
                                       "body": {"bus": 0, "ids": [mid], "payload": {"n": 1}}}, 400),
            ("a body too big", {"path": "api/replay", "method": "POST", "raw": b'{"bus": 0, "x": "' + b"a" * (5 << 20) + b'"}'}, 413),
            ("a limit of letters that is not a number", {"path": "api/letters?bus=0&limit=lots"}, 400),
            ("a limit of letters too big", {"path": "api/letters?bus=0&limit=100000"}, 400),
            ("a path out of the audit folder", {"path": "audit/..%2fsecret.txt"}, 404),
            ("an unknown action", {"path": "api/delete", "method": "POST", "body": {"bus": 0, "all": True}}, 404),
            ("an unknown asset", {"path": "static/..%2f..%2fbus.py"}, 404),
        ]
        for what, kw, expected in cases:
            status, reply = _http(base + kw.pop("path"), **kw)
            assert status == expected, (what, status, reply)
            if 400 <= status < 500 and status not in (404, 413):
                assert reply.get("error"), (what, reply)
        status, reply = _http(base + "api/replay", method="POST", body={"bus": 0, "ids": ["01aaaaaaaaaaaaaaaaaaaaaaaa"]})
        assert status == 200 and reply["rows"][0]["result"] == "skipped"  # no such dead letter: said, not done
    assert sorted(letter["id"] for letter in sub.letters()) == before


def test_a_console_with_a_token_refuses_requests_without_it(fleet):
    pub, sub = fleet
    token = "t" * 24
    with Console([sub.datadir], listen="127.0.0.1:0", write=True, token=token) as console:
        base = console.url.split("#")[0]
        assert console.url.endswith(f"#token={token}")
        assert _http(base + "api/state")[0] == 401
        assert _http(base + "api/state", headers={"Authorization": "Bearer " + "u" * 24})[0] == 401
        assert _http(base + "api/purge", method="POST", body={"bus": 0, "all": True})[0] == 401
        assert _http(base + "api/state", headers={"Authorization": "Bearer " + token})[0] == 200
        assert _http(base)[0] == 200  # the page itself holds nothing: it asks with the token
    assert len(sub.letters()) == 2
    assert Console([sub.datadir], listen="192.0.2.1:0").token  # beyond loopback: made up if not given
    with pytest.raises(ValueError, match="token"):
        Console([sub.datadir], token="short")


def test_a_payload_made_to_attack_the_page_is_shown_as_text(tmp_path, page):
    pub = Bus(free_address(), tmp_path / "orders", name="orders")
    sub = Subscriber(tmp_path, pub.address)
    try:
        attack = '<img src=x onerror="document.title=\'pwned\'"><script>document.title="pwned"</script>'
        pub.publish("order.placed", {"n": 9, "bad": True, "customer": attack})
        wait_until(lambda: len(sub.letters()) == 1, 30, message="a dead letter")
        with Console([sub.datadir], listen="127.0.0.1:0") as console:
            page.goto(console.url)
            page.click("#groups tr[data-cause='ValueError'] button:text('Show')")
            page.locator("#letter-list tr[data-id]").wait_for()
            assert attack.replace('"', '\\"') in page.text_content("#letter-list")
            assert page.locator("#letter-list img, #letter-list script").count() == 0
            assert page.title() == "servicebus console"
    finally:
        sub.stop()
        pub.close()


def test_a_stopped_bus_is_read_from_its_store_and_its_dead_letters_replayed_there(fleet, tmp_path):
    pub, sub = fleet
    by_n = {letter["payload"]["n"]: letter["id"] for letter in sub.letters()}
    sub.stop()
    with Console([pub.datadir, sub.datadir], listen="127.0.0.1:0", write=True, interval=0.3) as console:
        base = console.url
        assert console.wait_sampled()
        wait_until(lambda: _http(base + "api/state")[1]["buses"][1]["up"] is False, 10, message="seen stopped")
        state = _http(base + "api/state")[1]
        assert state["buses"][1]["letters"] == 2 and state["buses"][1]["groups"][0]["cause"] == "ValueError"
        status, reply = _http(base + "api/replay", method="POST", body={"bus": 1, "ids": [by_n[3]]})
        assert status == 200 and reply["rows"][0]["result"] == "replayed", reply
        assert _journaled(sub.datadir, by_n[3], "replayed")
        wait_until(lambda: _http(base + "api/state")[1]["buses"][1]["letters"] == 1, 10, message="read again")
    sub.fail.unlink()  # the cause is mended
    again = Subscriber(tmp_path, pub.address, failing=False)  # its next start handles what was put back
    try:
        wait_until(lambda: 3 in again.done(), 30, message="the replayed order to be handled at restart")
    finally:
        again.stop()


def test_the_console_command_serves_until_sigterm_and_says_what_is_wrong(tmp_path):
    pub = Bus(free_address(), tmp_path / "orders", name="orders")
    try:
        port = free_address().rsplit(":", 1)[1]
        proc = subprocess.Popen([CLI, "console", str(pub.datadir),
                                 "--listen", f"127.0.0.1:{port}"], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline()
            assert f"http://127.0.0.1:{port}/" in line and "read-only" in line, (line, proc.stderr.read()
                                                                                 if proc.poll() is not None else "")
            wait_until(lambda: _http(f"http://127.0.0.1:{port}/api/state")[1]["buses"][0].get("read"), 20,
                       message="the bus read")
            state = _http(f"http://127.0.0.1:{port}/api/state")[1]
            assert state["buses"][0]["up"] and state["buses"][0]["service"] == "orders" and not state["write"]
        finally:
            proc.terminate()
            assert proc.wait(20) == 0
            proc.stdout.close()
            proc.stderr.close()
    finally:
        pub.close()
    for args, code, says in ((["console", str(tmp_path / "nope")], 2, "no such data directory"),
                             (["console", str(pub.datadir), "--listen", "nowhere"], 1, "host:port"),
                             (["console", str(pub.datadir), "--interval", "0"], 1, "interval"),
                             (["console", str(pub.datadir), "--audit", str(tmp_path / "none")], 1, "no such folder")):
        done = subprocess.run([CLI, *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == code and says in done.stderr, (args, done.returncode, done.stderr)


def test_the_latest_audit_verdict_links_to_its_report_with_the_token(tmp_path, page):
    pub = Bus(free_address(), tmp_path / "orders", name="orders")
    audit = tmp_path / "audit"
    audit.mkdir()
    (audit / "summary.json").write_text(json.dumps({
        "ok": False, "events": 1234, "messages": 200,
        "classes": {"ok": 196, "lost": 1, "deadlettered": 3, "owed": 0},
        "problems": {"lost": [{"id": "01aaaaaaaaaaaaaaaaaaaaaaaa", "receiver": "tcp://127.0.0.1:9"}],
                     "deadlettered": []}}))
    (audit / "report.html").write_text("<!doctype html><title>delivery audit</title><h1>the report</h1>")
    token = "k" * 24
    try:
        with Console([pub.datadir], listen="127.0.0.1:0", token=token, audit=audit) as console:
            page.goto(console.url)
            page.wait_for_selector("#audit .verdict-bad")
            assert page.text_content("#audit-badge") == "audit: PROBLEMS"
            text = page.text_content("#audit")
            assert "1 lost" in text.replace(",", "") or "1 lost" in " ".join(text.split()), text
            assert "01aaaaaaaaaaaaaaaaaaaaaaaa" in text
            with page.context.expect_page() as opened:
                page.click("#audit-link")
            report = opened.value
            report.wait_for_load_state()
            assert report.text_content("h1") == "the report"
            screenshot(page, "console-audit")
            base = console.url.split("#")[0]
            assert _http(base + "audit/report.html")[0] == 401  # not without the token
    finally:
        pub.close()


def test_the_token_in_a_query_opens_only_the_audit_files(tmp_path):
    pub = Bus(free_address(), tmp_path / "orders", name="orders")
    (tmp_path / "audit").mkdir()
    (tmp_path / "audit" / "report.html").write_text("<h1>report</h1>")
    token = "q" * 24
    try:
        with Console([pub.datadir], listen="127.0.0.1:0", token=token, audit=tmp_path / "audit") as console:
            base = console.url.split("#")[0]
            assert _http(base + f"audit/report.html?token={token}")[0] == 200
            assert _http(base + f"api/state?token={token}")[0] == 401  # a URL is logged, shared, kept
    finally:
        pub.close()


def test_the_brief_dead_letter_view_the_console_polls_decodes_no_payload(fleet):
    pub, sub = fleet
    brief = list(read_view(sub.datadir, "deadletters", {"brief": True}))
    assert len(brief) == 2 and all(r["payload"] is None and r["error"].startswith("ValueError") for r in brief)
    assert all(r["payload"]["bad"] for r in read_view(sub.datadir, "deadletters", {}))
