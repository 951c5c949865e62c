"""The report's list of problem pairs: every pair summary.json lists (problems.py), 50 a page,
with a filter box and a class menu. The rows travel as JSON inside the page and a small
inline script draws them: no external file, no network (the report is mailed and opened
from disk)."""

from __future__ import annotations

import html
import json
from datetime import datetime, timezone
from typing import Any

from .problems import LISTED, MEANING

PAGE = 50
SHOWN = {"handled_more_than_once": "handled twice+", "in_flight": "in flight", "deadlettered": "dead letter"}


def when(ms: int | None) -> str:
    """Milliseconds since the epoch as UTC, to the millisecond ('' for none)."""
    if ms is None:
        return ""
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def _rows(problems: dict[str, list[dict[str, Any]]]) -> list[list[Any]]:
    """One array per pair, in the order the script reads it."""
    return [[SHOWN.get(klass, klass), p.get("id"), p.get("topic"), p.get("sender"), p.get("sender_name"),
             p.get("receiver"), p.get("receiver_name"), p.get("last_event"), when(p.get("last_ts")),
             p.get("command")]
            for klass in LISTED for p in problems.get(klass) or []]


def _script_json(value: Any) -> str:
    # Inside <script>: no "<", ">" or "&" may close it or open a comment, whatever a topic says.
    return json.dumps(value).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


_SCRIPT = """
(function () {
  var all = JSON.parse(document.getElementById('problem-data').textContent);
  var PAGE = %d, page = 0, rows = all;
  var body = document.querySelector('#problems tbody'), pos = document.getElementById('ppos');
  var prev = document.getElementById('pprev'), next = document.getElementById('pnext');
  var box = document.getElementById('pfilter'), menu = document.getElementById('pclass');
  var esc = function (s) {
    return String(s == null ? '' : s).replace(/[&<>"]/g, function (c) {
      return {'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;'}[c];
    });
  };
  var who = function (address, name) {
    return (name ? '<b>' + esc(name) + '</b><br>' : '') + '<small>' + esc(address || '?') + '</small>';
  };
  function draw() {
    var pages = Math.max(1, Math.ceil(rows.length / PAGE));
    page = Math.max(0, Math.min(page, pages - 1));
    var start = page * PAGE, out = [];
    rows.slice(start, start + PAGE).forEach(function (r, i) {
      out.push('<tr><td>' + (start + i + 1) + '</td><td class="text nowrap">' + esc(r[0]) + '</td><td class="text">'
        + '<code>' + esc(r[1]) + '</code></td><td class="text">' + esc(r[2]) + '</td><td class="text">'
        + who(r[3], r[4]) + '</td><td class="text">' + who(r[5], r[6]) + '</td><td class="text">'
        + esc(r[7]) + '<br><small class="nowrap">' + esc(r[8]) + '</small></td><td class="cmd"><code>'
        + esc(r[9]) + '</code></td></tr>');
    });
    body.innerHTML = out.join('');
    pos.textContent = rows.length ? 'rows ' + (start + 1) + '-' + (start + out.length) + ' of '
      + rows.length : 'no pair matches';
    prev.disabled = page === 0;
    next.disabled = page >= pages - 1;
  }
  function refilter() {
    var words = box.value.toLowerCase().split(/\\s+/).filter(Boolean), klass = menu.value;
    rows = all.filter(function (r) {
      if (klass && r[0] !== klass) return false;
      var text = r.join(' ').toLowerCase();
      return words.every(function (w) { return text.indexOf(w) >= 0; });
    });
    page = 0;
    draw();
  }
  prev.addEventListener('click', function () { page -= 1; draw(); });
  next.addEventListener('click', function () { page += 1; draw(); });
  box.addEventListener('input', refilter);
  menu.addEventListener('change', refilter);
  draw();
})();
""" % PAGE


def section(summary: dict[str, Any]) -> str:
    """The "Problems to act on" section of report.html."""
    problems = summary.get("problems") or {}
    counts = summary.get("problem_counts") or {k: len(problems.get(k) or []) for k in LISTED}
    rows = _rows(problems)
    head = "".join(
        f"<tr><td class=\"text nowrap\">{SHOWN.get(k, k)}</td><td>{counts.get(k, 0):,}</td>"
        f"<td>{len(problems.get(k) or []):,}</td><td class=\"text\">{html.escape(MEANING[k])}</td></tr>"
        for k in LISTED)
    cut = any(counts.get(k, 0) > len(problems.get(k) or []) for k in LISTED)
    note = ("<p>A class with more pairs than listed here (and in summary.json: the oldest ids "
            "first) has every one in the table <code>problems</code> beside this report.</p>" if cut else "")
    if not rows:
        return f"<h2>Problems to act on</h2><table>{head}</table><p>None.</p>"
    options = "".join(f'<option value="{SHOWN.get(k, k)}">{SHOWN.get(k, k)}</option>'
                      for k in LISTED if problems.get(k))
    return f"""<h2>Problems to act on</h2>
<table><tr><th class="text">class</th><th>pairs</th><th>listed</th><th class="text">what it means</th></tr>{head}</table>
{note}<div class="pager"><input id="pfilter" type="search" placeholder="filter: id, topic, service, address, event"
 aria-label="filter"> <select id="pclass" aria-label="class"><option value="">every class</option>{options}</select>
 <button id="pprev" type="button">&larr; prev</button> <span id="ppos"></span>
 <button id="pnext" type="button">next &rarr;</button></div>
<table id="problems" class="list"><thead><tr><th>#</th><th class="text">class</th><th class="text">message id</th><th class="text">topic</th>
<th class="text">sender</th><th class="text">receiver</th><th class="text">last event</th>
<th class="text">command that acts on it</th></tr></thead><tbody></tbody></table>
<noscript><p>The list needs JavaScript; summary.json has the same pairs.</p></noscript>
<script type="application/json" id="problem-data">{_script_json(rows)}</script>
<script>{_SCRIPT}</script>"""
