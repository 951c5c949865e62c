"""The examples run: the asyncio one shows one trace id from the publisher to the handler
and a metrics scrape; the outbox one bills each committed order once; the hooks one counts
failures and alerts on a dead letter."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent


def test_the_async_example_carries_each_trace_from_publisher_to_handler_and_scrapes_metrics():
    pytest.importorskip("opentelemetry.sdk", reason="OpenTelemetry SDK not installed (pip install -e '.[dev]')")
    pytest.importorskip("prometheus_client", reason="prometheus_client not installed (pip install -e '.[dev]')")
    ran = subprocess.run([sys.executable, str(ROOT / "examples" / "async_service" / "main.py")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert ran.returncode == 0, ran.stderr[-3000:]
    published = dict(re.findall(r"web: +order (\d) published in trace ([0-9a-f]{32})", ran.stdout))
    handled = dict(re.findall(r"billing: order (\d) handled in trace +([0-9a-f]{32})", ran.stdout))
    assert len(published) == 3 and handled == published
    assert re.search(r'servicebus_handler_seconds_count\{.*topic="order.placed"\} 3\.0', ran.stdout)


def test_the_outbox_example_announces_committed_orders_once_and_bills_each_once():
    pytest.importorskip("sqlalchemy", reason="SQLAlchemy not installed (pip install -e '.[dev]')")
    ran = subprocess.run([sys.executable, str(ROOT / "examples" / "outbox" / "main.py")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert re.findall(r"ledger:  invoice for order (\d)", ran.stdout) == ["1", "2", "3"]
    assert "billing: total 92 " in ran.stdout
    assert "orders:  3 outbox rows relayed" in ran.stdout


def test_the_hooks_example_counts_failures_and_alerts_on_the_dead_letter():
    ran = subprocess.run([sys.executable, str(ROOT / "examples" / "hooks" / "main.py")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert re.findall(r"ALERT: order.placed \w+ is a dead letter: Reject: order 6 has no customer",
                      ran.stdout), ran.stdout
    assert "billed orders [1, 2, 3, 4, 5, 7, 8, 9]" in ran.stdout
    # nine first runs; 3 and 9 fail once and run again, 6 is rejected: 3 failures, 11 runs
    assert "handler failures by topic: {'order.placed': 3}" in ran.stdout
    assert "handler runs: 11," in ran.stdout


def test_the_late_joiner_example_replays_what_billing_missed_once_with_typed_orders():
    pytest.importorskip("msgspec", reason="msgspec not installed (pip install -e '.[dev]')")
    ran = subprocess.run([sys.executable, str(ROOT / "examples" / "late_joiner" / "main.py")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "orders: 4 orders published before billing existed, retained" in ran.stdout
    assert re.findall(r"charged order (\d)", ran.stdout) == ["1", "2", "3", "5", "6"]
    assert "the malformed order is a dead letter invalid: ValidationError" in ran.stdout
    assert "billed orders [1, 2, 3, 5, 6], each once" in ran.stdout


def test_the_fleet_example_finds_everyone_by_name_from_one_seed_and_a_redeployed_subscriber_misses_nothing():
    ran = subprocess.run([sys.executable, str(ROOT / "examples" / "fleet" / "main.py")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-8000:]
    assert "fleet: every order reached every subscriber once, by name only" in ran.stdout
    assert re.search(r"email: got orders( \d){6}$", ran.stdout, re.M)
