"""report.html for the delivery audit: a readable page with the verdict, the classes, a
latency histogram and a throughput-over-time plot (PNG images embedded, no external files),
and report.png: both plots in one image, for a terminal or a ticket."""

from __future__ import annotations

import base64
import html
import io
from datetime import datetime, timezone
from collections.abc import Callable
from typing import Any

from . import reportlist
from .classify import CLASSES  # the table's rows, in the order the job prints them


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return buf.getvalue()


def _per_second(timeline: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Every second from the first to the last, the ones without messages as 0: a plot
    of only the seconds that had some would draw a straight line across a gap."""
    if not timeline or timeline[-1][0] - timeline[0][0] > 100_000:
        return timeline
    have = {s: (p, h) for s, p, h in timeline}
    return [(s, *have.get(s, (0, 0))) for s in range(timeline[0][0], timeline[-1][0] + 1)]


def _draw_latency(ax, histogram: list[tuple[float, int]]) -> None:
    lows = [b for b, _ in histogram]
    ax.bar(lows, [n for _, n in histogram], width=[b * 0.25 for b in lows], align="edge", color="#3b6ea5")
    ax.set_xscale("log")
    ax.set_xlabel("latency published -> handled (ms, log scale)")
    ax.set_ylabel("messages")
    ax.set_title("End-to-end latency")


def _draw_timeline(ax, timeline: list[tuple[int, int, int]]) -> None:
    timeline = _per_second(timeline)
    start = timeline[0][0]
    # Steps one second wide, filled: each is what happened in that second (one artist per
    # series: a bar per second costs seconds to draw for a long run).
    edges = [s - start for s, _, _ in timeline] + [timeline[-1][0] - start + 1]
    ax.stairs([p for _, p, _ in timeline], edges, fill=True, label="published/s", color="#3b6ea5", alpha=0.5)
    ax.stairs([h for _, _, h in timeline], edges, fill=True, label="handled/s", color="#d0743c", alpha=0.5)
    ax.set_xlabel(f"seconds since {datetime.fromtimestamp(start, tz=timezone.utc):%Y-%m-%d %H:%M:%S} UTC")
    ax.set_ylabel("messages per second")
    ax.set_title("Throughput over time")
    ax.legend()


def preload() -> None:
    """Import the plotting library (half a second): ``servicebus audit`` does it on a
    thread while the JVM starts, rather than after the audit."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except Exception:  # noqa: BLE001 - _plots says so, if it matters
        pass


def _plots(histogram: list[tuple[float, int]],
           timeline: list[tuple[int, int, int]]) -> tuple[dict[str, str], bytes | None]:
    """The two plots as base64 PNGs for the page, and both in one PNG (None: no data or
    no matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}, None
    images = {}
    draw: list[tuple[str, Callable[[Any], None]]] = []
    if histogram:
        draw.append(("latency", lambda ax: _draw_latency(ax, histogram)))
    if timeline:
        draw.append(("timeline", lambda ax: _draw_timeline(ax, timeline)))
    for name, fn in draw:
        fig, ax = plt.subplots(figsize=(8, 3.2))
        fn(ax)
        images[name] = base64.b64encode(_png(fig)).decode()
        plt.close(fig)
    if not draw:
        return images, None
    fig, axes = plt.subplots(len(draw), 1, figsize=(8, 3.4 * len(draw)), squeeze=False)
    for ax, (_name, fn) in zip(axes[:, 0], draw):
        fn(ax)
    fig.tight_layout()
    both = _png(fig)
    plt.close(fig)
    return images, both


# Column names as a person reads them (summary.json keeps the keys).
SHOWN = {"handled_more_than_once": "handled twice+", "in_flight": "in flight", "deadlettered": "dead letters",
         "latency_p50_ms": "p50 ms", "latency_p95_ms": "p95 ms", "latency_p99_ms": "p99 ms",
         "latency_max_ms": "max ms", "max_attempts": "most attempts"}


def _who(address: Any, name: Any) -> str:
    """An address with its service's name above it, when the journals said it."""
    shown = f"<b>{html.escape(str(name))}</b><br>" if name else ""
    return f"{shown}<small>{html.escape('?' if address is None else str(address))}</small>"


def _table(rows: list[dict], key: str) -> str:
    """Per topic or receiver: latency first (p50 to max), then the classes. It fits the
    page: header cells wrap and a long key breaks, rather than hide columns to the right."""
    if not rows:
        return "<p>none</p>"
    cols = ["messages", "latency_p50_ms", "latency_p95_ms", "latency_p99_ms", "latency_max_ms",
            *CLASSES, "retries", "max_attempts"]
    head = f'<th class="text">{key}</th>' + "".join(f"<th>{html.escape(SHOWN.get(c, c))}</th>" for c in cols)
    cell = lambda v: ("-" if v is None else f"{v:,}" if isinstance(v, int)  # noqa: E731
                      else f"{v:,.{1 if v < 1000 else 0}f}" if isinstance(v, float) else str(v))
    first = (lambda r: _who(r.get(key), r.get("receiver_name"))) if key == "receiver" else (  # noqa: E731
        lambda r: html.escape(str(r.get(key))))
    body = "".join(
        f'<tr><td class="text key">{first(r)}</td>'
        + "".join(f"<td>{html.escape(cell(r.get(c)))}</td>" for c in cols) + "</tr>"
        for r in rows)
    # In a box that scrolls, should a key too long to break still widen it: its own, not the page.
    return f'<div class="wide"><table><thead><tr>{head}</tr></thead>{body}</table></div>'


def _cut(summary: dict[str, Any], name: str) -> str:
    total, shown = summary.get(f"{name}_count"), len(summary.get(name) or [])
    return f"<p>The first {shown:,} of {total:,}; the table {name} has every one.</p>" if total and total > shown else ""


def render(summary: dict[str, Any], histogram: list[tuple[float, int]],
           timeline: list[tuple[int, int, int]]) -> tuple[str, bytes | None]:
    """The page, and the PNG of its plots (None without data or matplotlib)."""
    images, png = _plots(histogram, timeline)
    verdict = ("Nothing lost or duplicated." if summary["ok"] else "Problems found: see below.")
    classes = "".join(f"<tr><td>{SHOWN.get(c, c)}</td><td>{summary['classes'][c]:,}</td></tr>" for c in CLASSES)
    owed = "".join(f"<li>{r['messages']:,} waiting on {html.escape(str(r['receiver']))}"
                   + (f" (<b>{html.escape(r['receiver_name'])}</b>)" if r.get("receiver_name") else "") + " since "
                   f"{html.escape(reportlist.when(r['since_ms']))} (publisher's clock)</li>"
                   for r in summary.get("owed") or [])
    lat = summary["latency_ms"]
    img = lambda name, alt: (f'<img alt="{alt}" src="data:image/png;base64,{images[name]}">'  # noqa: E731
                             if name in images else f"<p>({alt}: no data or matplotlib missing)</p>")
    reasons = "".join(
        f"<li>{html.escape(str(c['cause']))}: {c['messages']}<br><small>"
        + "<br>".join(html.escape(e) for e in c["examples"]) + "</small></li>"
        for c in summary.get("deadletter_causes") or [{"cause": k, "messages": v, "examples": []}
                                                      for k, v in summary["deadletter_reasons"].items()])
    attempts = ", ".join(f"{k}: {v}" for k, v in summary["attempts"].items())
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>servicebus delivery audit</title>
<style>body{{font-family:sans-serif;margin:1.5em}}table{{border-collapse:collapse;margin:.3em 0}}
td,th{{border:1px solid #ccc;padding:.2em .5em;text-align:right;vertical-align:top}}th{{background:#eee}}
td{{white-space:nowrap}}.text{{text-align:left}}td.text{{white-space:normal}}
.wide{{max-width:100%;overflow-x:auto}}table.list{{width:100%}}.wide table{{font-size:.92em}}.key{{overflow-wrap:anywhere;min-width:14em}}
td.nowrap,.nowrap{{white-space:nowrap}}
td.cmd{{text-align:left;white-space:normal;overflow-wrap:anywhere;min-width:18em}}
.list code{{font-size:.85em}}small{{color:#555}}img{{max-width:100%}}
.pager{{margin:.6em 0}}.pager input{{width:24em}}
.ok{{color:#16632b}}.bad{{color:#a31515}}</style></head><body>
<h1>servicebus delivery audit</h1>
<p class="{'ok' if summary['ok'] else 'bad'}"><b>{verdict}</b></p>
<p>{summary['events']:,} journal events from {html.escape(', '.join(summary['inputs']))};
{summary['messages']:,} (message, receiver) pairs. Grace for in-flight messages:
{summary['grace_ms'] / 1000:g}s.</p>
<h2>Classes</h2><table>{classes}</table>
{reportlist.section(summary)}
{'<h3>owed (the senders still hold them; not a problem)</h3><ul>' + owed + '</ul>' if owed else ''}
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
<h2>By topic</h2>{_table(summary.get('by_topic') or [], 'topic')}{_cut(summary, 'by_topic')}
<h2>By receiver</h2>{_table(summary.get('by_receiver') or [], 'receiver')}{_cut(summary, 'by_receiver')}
</body></html>
"""
    return page, png
