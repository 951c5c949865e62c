"""Edit-and-replay of a dead letter: the operator fixes a poison payload and replays it, with
`servicebus replay DATADIR ID --payload JSON` (a stopped bus, or a live one over its admin
endpoint: the "replay" operation's ``payload`` arg) or ``Bus.replay(id, payload=...)``. The
CLI runs in a subprocess; the buses it talks to run in this one, or are stopped."""

import json

import pytest

from servicebus import Bus
from servicebus.testing import free_address, wait_until

from ..conftest import subscriber_gone
from .test_cli import TOPIC, _store_by_hand, cli, cli_json, journal_lines

NOTHING_MATCHED, USAGE = 6, 1
FIXED = {"n": 1, "fixed": True}


def picky(got: list):
    """A handler that fails on a payload not marked ``fixed`` and records the others."""

    def handler(payload, message):
        if not payload.get("fixed"):
            raise ValueError("poison payload")
        got.append((payload, message.id, (message.headers or {}).get("h")))

    return handler


def poisoned(make_bus, **options):
    """A publisher, a subscriber whose handler failed (one attempt) on the one event it
    got, with header h=v, now a dead letter; what it handles later goes to ``got``."""
    pub = make_bus("pub")
    sub = make_bus("sub", max_attempts=1, **options)
    got: list = []
    sub.every(TOPIC, picky(got))
    sub.subscribe(pub.address, TOPIC, wait=10)
    mid = pub.publish(TOPIC, {"n": 1}, headers={"h": "v"})
    wait_until(lambda: sub.status().deadletters == 1, 10)
    return pub, sub, got, mid


def journaled(datadir, name):
    """{id: error} of the journal's events ``name``."""
    return {e["id"]: e.get("error") for e in journal_lines(datadir) if e["event"] == name}


def letter_payloads(datadir):
    return [(r["id"], r["payload"]) for r in cli_json("deadletters", datadir)]


# --- an edited letter is handled with its new payload, once ----------------------------------


def test_an_edited_letter_replayed_with_the_bus_stopped_is_handled_with_its_new_payload_once(make_bus):
    pub, sub, got, mid = poisoned(make_bus)
    sub.close()
    rows = cli_json("replay", sub.datadir, mid, "--payload", json.dumps(FIXED))
    assert [(r["id"], r["result"], r["to"]) for r in rows] == [(mid, "replayed", "incoming")]
    assert letter_payloads(sub.datadir) == []
    assert journaled(sub.datadir, "replayed") == {mid: "edited"}  # an audit tells it was edited
    with Bus(free_address(), sub.datadir) as again:
        again.every(TOPIC, picky(got))
        wait_until(lambda: got, 10)
        assert again.drain(5)
        assert again.deadletters() == []
    assert got == [(FIXED, mid, "v")]


def test_an_edited_letter_replayed_through_a_live_bus_is_handled_with_its_new_payload_once(make_bus, tmp_path):
    pub, sub, got, mid = poisoned(make_bus)
    (tmp_path / "fixed.json").write_text(json.dumps(FIXED))
    rows = cli_json("replay", sub.datadir, mid, "--payload", f"@{tmp_path / 'fixed.json'}")
    assert [(r["id"], r["result"], r["to"]) for r in rows] == [(mid, "replayed", "incoming")]
    wait_until(lambda: got, 20)
    assert sub.drain(5)
    assert got == [(FIXED, mid, "v")] and sub.deadletters() == []
    wait_until(lambda: journaled(sub.datadir, "replayed") == {mid: "edited"}, 20)


def test_bus_replay_with_a_payload_handles_the_letter_with_it_once(make_bus):
    pub, sub, got, mid = poisoned(make_bus)
    assert sub.replay(mid, payload=FIXED) == 1
    wait_until(lambda: got, 20)
    assert sub.drain(5)
    assert got == [(FIXED, mid, "v")] and sub.deadletters() == []


def test_an_edited_expired_command_goes_back_to_outgoing_under_a_new_id_and_is_delivered(make_bus, tmp_path):
    address = free_address()
    client = make_bus("client")
    client.send(address, "audit.record", {"n": 1}, ttl=0.1, headers={"h": "v"})
    wait_until(lambda: client.status().deadletters == 1, 10)
    (mid,) = [d.id for d in client.deadletters()]
    client.close()
    rows = cli_json("replay", tmp_path / "client", mid, "--payload", json.dumps(FIXED))
    assert rows[0]["result"] == "replayed" and rows[0]["to"] == f"outgoing to {address}"
    new_id = rows[0]["new_id"]
    assert journaled(tmp_path / "client", "replayed") == {mid: f"as {new_id}, edited"}  # the sender's
    got: list = []
    server = make_bus("server", address)
    server.handle("audit.record", lambda p, m: got.append((p, m.id, m.headers.get("h"))))
    with Bus(free_address(), tmp_path / "client"):
        wait_until(lambda: got, 15)
    assert got == [(FIXED, new_id, "v")]


def test_bus_replay_of_an_edited_expired_event_delivers_the_new_payload_to_its_subscriber(make_bus):
    pub = make_bus("pub")
    address, subdir = subscriber_gone(make_bus, pub, TOPIC, known_down=True)
    pub.publish(TOPIC, {"n": 1}, ttl=0.1)
    wait_until(lambda: pub.status().deadletters == 1, 10)
    (mid,) = [d.id for d in pub.deadletters()]
    got: list = []
    sub = make_bus("back", address, subdir)
    sub.every(TOPIC, picky(got))
    assert pub.replay([mid], payload=FIXED) == 1
    wait_until(lambda: got, 20)
    assert sub.drain(5)
    assert [(p, h) for p, _id, h in got] == [(FIXED, None)] and got[0][1] != mid
    assert pub.deadletters() == []


# --- hostile: refused clearly, nothing changed ------------------------------------------------


def test_edits_the_cli_refuses_leave_the_letter_as_it_was_live_and_stopped(make_bus, tmp_path):
    pub, sub, got, mid = poisoned(make_bus, max_payload=2000)
    other = "0" * 24
    (tmp_path / "big.json").write_text(json.dumps({"fixed": True, "pad": "x" * 3000}))
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    refused = [
        ((mid, other, "--payload", "{}"), USAGE, "one dead letter"),
        ((mid, "--topic", TOPIC, "--payload", "{}"), USAGE, "one dead letter"),
        (("--all", "--payload", "{}"), USAGE, "one dead letter"),
        ((mid, "--payload", "{not json"), USAGE, "not JSON"),
        ((mid, "--payload", "@" + str(tmp_path / "missing.json")), USAGE, "missing.json"),
        ((mid, "--payload", "@" + str(tmp_path / "big.json")), USAGE, "max_payload is 2000"),
        ((mid, "--payload", "@" + str(tmp_path / "deep.json")), USAGE, "nested"),
        ((other, "--payload", "{}"), NOTHING_MATCHED, f"no such dead letter: {other}"),
    ]
    for when in ("live", "stopped"):
        for args, code, says in refused:
            result = cli("replay", sub.datadir, *args)
            assert result.returncode == code, (when, args, result.stdout, result.stderr)
            assert says in result.stderr and "Traceback" not in result.stderr, (when, args, result.stderr)
        if when == "live":
            assert [(d.id, d.attempts) for d in sub.deadletters()] == [(mid, 1)]
            sub.close()
    assert letter_payloads(sub.datadir) == [(mid, {"n": 1})]
    assert "replayed" not in {e["event"] for e in journal_lines(sub.datadir)}


def test_edits_bus_replay_refuses_leave_the_letter_as_it_was(make_bus):
    pub, sub, got, mid = poisoned(make_bus, max_payload=2000)
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ValueError, match="one dead letter"):
        sub.replay([mid, "0" * 24], payload=FIXED)
    with pytest.raises(ValueError, match="one dead letter"):
        sub.replay(topic=TOPIC, payload=FIXED)
    with pytest.raises(ValueError, match="max_payload is 2000"):
        sub.replay(mid, payload={"fixed": True, "pad": "x" * 3000})
    with pytest.raises(TypeError):
        sub.replay(mid, payload=deep)
    with pytest.raises(TypeError):
        sub.replay(mid, payload={"fixed": object()})
    with pytest.raises(ValueError, match="no such dead letter"):
        sub.replay("0" * 24, payload=FIXED)
    assert [(d.id, d.attempts) for d in sub.deadletters()] == [(mid, 1)]
    assert got == []
    sub.close()
    assert letter_payloads(sub.datadir) == [(mid, {"n": 1})]
    assert "replayed" not in {e["event"] for e in journal_lines(sub.datadir)}


def test_an_edit_of_a_letter_not_replayable_is_refused_and_of_a_damaged_one_skipped(tmp_path):
    from servicebus.model.segments import make_blob

    invalid, damaged = (f"{n:024x}" for n in (0xD1, 0xD2))
    store = _store_by_hand(tmp_path / "sub")
    b = store.batch()
    b.put_deadletter(invalid, {"origin": "incoming", "reason": "invalid", "error": "x", "at": 1,
                               "not_replayable": "its fields are not valid", "body": make_blob([b"\x01"])})
    b.put_deadletter(damaged, {"origin": "incoming", "reason": "handler_failed", "at": 1,
                               "error": "undecodable record"})
    store.write(b, sync=True)
    store.close()
    refused = cli("replay", tmp_path / "sub", invalid, "--payload", json.dumps(FIXED))
    assert refused.returncode == USAGE and "not replayable: its fields are not valid" in refused.stderr, refused.stderr
    rows = cli_json("replay", tmp_path / "sub", damaged, "--payload", json.dumps(FIXED))
    assert rows[0]["result"] == "skipped" and "its record is damaged" in rows[0]["detail"]
    assert sorted(r["id"] for r in cli_json("deadletters", tmp_path / "sub")) == [invalid, damaged]
