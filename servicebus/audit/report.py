"""report.html for the delivery audit: a readable page with the verdict, the classes, a
latency histogram and a throughput-over-time plot (PNG images embedded, no external files)."""

from __future__ import annotations

import base64
import html
import io
from datetime import datetime, timezone
from typing import Any

CLASSES = ("handled", "handled_more_than_once", "in_flight", "deadlettered", "dropped", "lost")


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _plots(histogram: list[tuple[float, int]], timeline: list[tuple[int, int, int]]) -> dict[str, str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    images = {}
    if histogram:
        fig, ax = plt.subplots(figsize=(8, 3.2))
        lows = [b for b, _ in histogram]
        ax.bar(lows, [n for _, n in histogram], width=[b * 0.25 for b in lows], align="edge", color="#3b6ea5")
        ax.set_xscale("log")
        ax.set_xlabel("latency published -> handled (ms, log scale)")
        ax.set_ylabel("messages")
        ax.set_title("End-to-end latency")
        images["latency"] = _png(fig)
        plt.close(fig)
    if timeline:
        fig, ax = plt.subplots(figsize=(8, 3.2))
        start = timeline[0][0]
        xs = [s - start for s, _, _ in timeline]
        ax.step(xs, [p for _, p, _ in timeline], where="post", label="published/s", color="#3b6ea5")
        ax.step(xs, [h for _, _, h in timeline], where="post", label="handled/s", color="#d0743c")
        ax.set_xlabel(f"seconds since {datetime.fromtimestamp(start, tz=timezone.utc):%Y-%m-%d %H:%M:%S} UTC")
        ax.set_ylabel("messages per second")
        ax.set_title("Throughput over time")
        ax.legend()
        images["timeline"] = _png(fig)
        plt.close(fig)
    return images


def _table(rows: list[dict], key: str) -> str:
    if not rows:
        return "<p>none</p>"
    cols = [key, "messages", *CLASSES, "latency_p50_ms", "latency_p95_ms", "latency_p99_ms",
            "latency_max_ms", "retries", "max_attempts"]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape('-' if r.get(c) is None else str(r.get(c)))}</td>" for c in cols) + "</tr>"
        for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render(summary: dict[str, Any], histogram: list[tuple[float, int]],
           timeline: list[tuple[int, int, int]]) -> str:
    images = _plots(histogram, timeline)
    verdict = ("Nothing lost or duplicated." if summary["ok"] else "Problems found: see below.")
    classes = "".join(f"<tr><td>{c}</td><td>{summary['classes'][c]:,}</td></tr>" for c in CLASSES)
    problems = ""
    for klass, ids in summary["problems"].items():
        if ids:
            items = "".join(f"<li><code>{html.escape(i['id'])}</code> to {html.escape(i['receiver'] or '?')}</li>"
                            for i in ids)
            problems += f"<h3>{klass} (first {len(ids)})</h3><ul>{items}</ul>"
    lat = summary["latency_ms"]
    img = lambda name, alt: (f'<img alt="{alt}" src="data:image/png;base64,{images[name]}">'  # noqa: E731
                             if name in images else f"<p>({alt}: no data or matplotlib missing)</p>")
    reasons = "".join(f"<li>{html.escape(str(k))}: {v}</li>" for k, v in summary["deadletter_reasons"].items())
    attempts = ", ".join(f"{k}: {v}" for k, v in summary["attempts"].items())
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>servicebus delivery audit</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:70em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:.2em .5em;text-align:right}}th{{background:#eee}}
.ok{{color:#16632b}}.bad{{color:#a31515}}</style></head><body>
<h1>servicebus delivery audit</h1>
<p class="{'ok' if summary['ok'] else 'bad'}"><b>{verdict}</b></p>
<p>{summary['events']:,} journal events from {html.escape(', '.join(summary['inputs']))};
{summary['messages']:,} (message, receiver) pairs. Grace for in-flight messages:
{summary['grace_ms'] / 1000:g}s.</p>
<h2>Classes</h2><table>{classes}</table>
{problems}
<h2>Latency</h2>
<p>p50 {lat['p50']} ms, p95 {lat['p95']} ms, p99 {lat['p99']} ms, max {lat['max']} ms
(handled on the receiver's clock minus published on the sender's; negative values from clock
skew count as 0).</p>
{img('latency', 'latency histogram')}
<h2>Throughput</h2>
{img('timeline', 'throughput over time')}
<h2>Retries and dead letters</h2>
<p>Handler retries: {summary['retries']:,}. Attempts per message: {attempts or '-'}.</p>
<ul>{reasons or '<li>no dead letters</li>'}</ul>
<h2>By topic</h2>{_table(summary.get('by_topic') or [], 'topic')}
<h2>By receiver</h2>{_table(summary.get('by_receiver') or [], 'receiver')}
</body></html>
"""
