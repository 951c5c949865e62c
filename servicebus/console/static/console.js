// The servicebus console's page: polls /api/state, draws the plots, and sends the actions.
// Everything a bus sends (payloads, errors, topics, names) is put in the page as text,
// never as markup: a hostile payload must not run in the operator's browser.
"use strict";

const token = (() => {
  const m = location.hash.match(/token=([^&]+)/);
  if (m) { sessionStorage.setItem("servicebus-token", decodeURIComponent(m[1])); history.replaceState(null, "", location.pathname); }
  return sessionStorage.getItem("servicebus-token");
})();
let state = null;
let shown = null; // the dead-letter group whose letters are listed: {bus, reason, topic, cause}

async function api(path, body) {
  const headers = {};
  if (token) headers.Authorization = "Bearer " + token;
  const init = { headers, cache: "no-store" };
  if (body !== undefined) {
    init.method = "POST";
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const res = await fetch(path, init);
  let data = null;
  try { data = await res.json(); } catch (e) { data = { error: res.statusText }; }
  if (!res.ok) throw new Error(data && data.error ? data.error : res.status + " " + res.statusText);
  return data;
}

function el(tag, attrs, ...kids) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "text") node.textContent = v;
    else if (k === "onclick") node.addEventListener("click", v);
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const kid of kids) if (kid !== null && kid !== undefined) node.append(kid);
  return node;
}

const fmt = {
  n: (v) => (v === null || v === undefined ? "–" : Number(v).toLocaleString("en")),
  age: (s) => {
    if (s === null || s === undefined) return "–";
    if (s < 60) return s.toFixed(1) + " s";
    if (s < 3600) return (s / 60).toFixed(1) + " min";
    if (s < 172800) return (s / 3600).toFixed(1) + " h";
    return (s / 86400).toFixed(1) + " d";
  },
  rate: (v) => (v === null || v === undefined ? "–" : v.toFixed(v < 10 ? 1 : 0) + "/s"),
  when: (ms) => new Date(ms).toLocaleTimeString(),
};

function stateBadge(up, read) {
  if (!read) return el("span", { class: "badge", text: "reading…" });
  return up ? el("span", { class: "badge up", text: "up" }) : el("span", { class: "badge stopped", text: "stopped" });
}

// --- plots: a polyline per series on a shared scale, drawn as SVG -----------------------------

const SVGNS = "http://www.w3.org/2000/svg";
function svg(tag, attrs) {
  const node = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

function plot(cls, times, series, w, h) {
  const root = svg("svg", { class: cls, viewBox: `0 0 ${w} ${h}`, preserveAspectRatio: "none" });
  const values = series.flatMap((s) => s.filter((v) => v !== null && v !== undefined));
  if (times.length < 2 || values.length === 0) return root;
  const t0 = times[0], t1 = times[times.length - 1] || t0 + 1;
  const top = Math.max(1, ...values) * 1.1;
  series.forEach((s, i) => {
    const pts = [];
    s.forEach((v, j) => {
      if (v === null || v === undefined) return;
      const x = ((times[j] - t0) / (t1 - t0 || 1)) * (w - 2) + 1;
      const y = h - 2 - (v / top) * (h - 4);
      pts.push(x.toFixed(1) + "," + y.toFixed(1));
    });
    if (pts.length) root.append(svg("polyline", { points: pts.join(" "), fill: "none", "stroke-width": "1.5",
      stroke: ["#2f5fd0", "#17803d", "#b86e00"][i % 3], "vector-effect": "non-scaling-stroke" }));
  });
  const label = svg("text", { x: 4, y: 12, "font-size": 10, fill: "#677089" });
  label.textContent = "max " + fmt.n(Math.round(top / 1.1));
  root.append(label);
  return root;
}

// --- rendering --------------------------------------------------------------------------------

function renderServices(services) {
  const body = document.querySelector("#services tbody");
  body.replaceChildren(...(services.length ? services.map((s) => el("tr", {},
    el("td", { text: s.service || "(no name)" }),
    el("td", { text: s.node || "–" }),
    el("td", { text: s.address || "–" }),
    el("td", { text: s.datadir || "" }),
    el("td", {}, s.kicked ? el("span", { class: "badge warn", text: "kicked: " + s.kicked })
      : s.up ? el("span", { class: "badge up", text: "up" }) : el("span", { class: "badge down", text: "down" })),
  )) : [el("tr", {}, el("td", { colspan: 5, class: "muted", text: "no instance known yet" }))]));
}

async function renderBus(bus) {
  const card = el("div", { class: "bus", id: "bus-" + bus.id });
  const title = el("h3", {}, el("span", { text: bus.service ? bus.service : bus.label }), stateBadge(bus.up, bus.read),
    el("span", { class: "muted", text: [bus.address, bus.service ? bus.label : null].filter(Boolean).join(" · ") }));
  card.append(title);
  if (!bus.read) return card;
  if (bus.error) card.append(el("p", { class: "problem", text: bus.error }));
  const c = bus.counts || {};
  card.append(el("div", { class: "counts" },
    ...[["outgoing", fmt.n(c.outgoing)], ["pending", fmt.n(c.pending)], ["oldest pending", fmt.age(c.oldest_pending_age_s)],
        ["incoming", fmt.n(c.incoming)], ["dead letters", fmt.n(bus.letters)],
        ["published", fmt.rate(bus.rates && bus.rates.published)], ["acked", fmt.rate(bus.rates && bus.rates.acked)],
        ["received", fmt.rate(bus.rates && bus.rates.received)]]
      .map(([k, v]) => el("div", {}, el("b", { text: v }), el("span", { text: k })))));
  let hist = { t: [], series: {} };
  try { hist = await api("/api/history?bus=" + bus.id); } catch (e) { /* drawn empty */ }
  if (bus.up) {
    card.append(plot("plot", hist.t, ["rate published", "rate acked", "rate received"].map((k) => hist.series[k.slice(5)] || []), 600, 90));
    card.append(el("div", { class: "legend" }, ...["published/s", "acked by subscribers/s", "received/s"].map((k, i) =>
      el("span", {}, el("i", { class: "l" + i }), k))));
  }
  const subs = bus.subscribers || [];
  if (subs.length) {
    const rows = subs.map((s) => el("tr", { "data-subscriber": s.address },
      el("td", { text: s.service || "–" }), el("td", { text: s.address }),
      el("td", { text: (s.topics || []).join(", ") + (s.commands ? (s.topics.length ? ", " : "") + "(commands)" : "") }),
      el("td", { class: "num", text: fmt.n(s.pending) }), el("td", { class: "num", text: fmt.age(s.oldest_pending_age_s) }),
      el("td", {}, plot("spark", hist.t, [hist.series["backlog " + s.address] || []], 160, 28))));
    if (bus.subscribers_total > subs.length)
      card.append(el("p", { class: "muted", text: `the ${subs.length} most behind of ${fmt.n(bus.subscribers_total)} subscribers` }));
    card.append(el("table", { class: "subscribers" },
      el("thead", {}, el("tr", {}, ...["subscriber", "address", "topics", "backlog", "oldest pending", "backlog over time"]
        .map((h, i) => el("th", { class: i === 3 || i === 4 ? "num" : null, text: h })))),
      el("tbody", {}, ...rows)));
  } else {
    card.append(el("p", { class: "muted", text: "no subscriber here" }));
  }
  return card;
}

function renderGroups(buses) {
  const rows = [];
  for (const bus of buses) for (const g of bus.groups || []) {
    rows.push(el("tr", { "data-bus": bus.id, "data-cause": g.cause },
      el("td", { text: bus.service || bus.label }), el("td", { text: g.cause }), el("td", { text: g.reason }),
      el("td", { text: g.topic }), el("td", { class: "num", text: fmt.n(g.count) }),
      el("td", {}, el("pre", { text: g.example || "" })),
      el("td", {},
        el("button", { text: "Show", onclick: () => showLetters({ bus: bus.id, reason: g.reason, topic: g.topic, cause: g.cause }) }),
        actionButton("Replay all", () => confirmThen(`Replay the ${g.count} dead letters of ${g.topic} (${g.cause}) on ${bus.label}?`,
          () => run("replay", { bus: bus.id, topic: g.topic, reason: g.reason, cause: g.cause }))),
        actionButton("Purge all", () => confirmThen(`Delete the ${g.count} dead letters of ${g.topic} (${g.cause}) on ${bus.label}? This cannot be undone.`,
          () => run("purge", { bus: bus.id, topic: g.topic, reason: g.reason, cause: g.cause })), "danger"))));
  }
  document.querySelector("#groups tbody").replaceChildren(...(rows.length ? rows :
    [el("tr", {}, el("td", { colspan: 7, class: "muted", text: "no dead letters" }))]));
}

function actionButton(text, onclick, cls) {
  const b = el("button", { text, onclick, class: cls });
  if (!state || !state.write) { b.disabled = true; b.title = "read-only: start the console with --write"; }
  return b;
}

function renderAudit(audit) {
  const box = document.getElementById("audit");
  const badge = document.getElementById("audit-badge");
  if (!audit) { badge.hidden = true; return; }
  badge.hidden = false;
  if (audit.error) {
    box.replaceChildren(el("span", { class: "problem", text: audit.error }));
    badge.className = "badge warn"; badge.textContent = "audit: not read"; return;
  }
  const link = "/audit/report.html" + (token ? "?token=" + encodeURIComponent(token) : "");
  badge.className = "badge " + (audit.ok ? "up" : "down");
  badge.textContent = audit.ok ? "audit: OK" : "audit: PROBLEMS";
  const classes = Object.entries(audit.classes || {}).filter(([, n]) => n);
  const problems = Object.entries(audit.problems || {}).filter(([, ids]) => ids.length);
  box.replaceChildren(
    el("p", {}, el("span", { class: audit.ok ? "verdict-ok" : "verdict-bad",
      text: audit.ok ? "OK: nothing lost or duplicated" : "PROBLEMS FOUND" }),
      el("span", { class: "muted", text: ` · ${fmt.n(audit.events)} events, ${fmt.n(audit.messages)} (message, receiver) pairs · written ${new Date(audit.written * 1000).toLocaleString()} · ` }),
      audit.report ? el("a", { href: link, target: "_blank", rel: "noopener noreferrer", id: "audit-link", text: "open the report" }) : null),
    el("div", { class: "classes" }, ...classes.map(([k, n]) => el("span", {}, el("b", { text: fmt.n(n) + " " }), k))),
    ...problems.map(([k, pairs]) => el("p", {}, audit.report
      ? el("a", { href: link + "#problems", target: "_blank", rel: "noopener noreferrer", text: k + ": " })
      : el("b", { text: k + ": " }), el("span", {
      text: pairs.map((p) => (typeof p === "string" ? p : `${p.id} at ${p.receiver}`)).join(", ") }))));
}

async function refresh() {
  try {
    state = await api("/api/state");
    document.getElementById("problem").hidden = true;
  } catch (e) {
    const p = document.getElementById("problem");
    p.textContent = "The console does not answer: " + e.message; p.hidden = false;
    return;
  }
  const mode = document.getElementById("mode");
  mode.textContent = state.write ? "write" : "read-only";
  mode.className = "badge " + (state.write ? "warn" : "");
  renderServices(state.services || []);
  const cards = await Promise.all(state.buses.map(renderBus));
  document.getElementById("buses").replaceChildren(...cards);
  renderGroups(state.buses);
  renderAudit(state.audit);
  document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
}

// --- dead letters and actions -----------------------------------------------------------------

async function showLetters(group) {
  shown = group;
  const q = new URLSearchParams({ bus: group.bus, topic: group.topic, reason: group.reason, cause: group.cause });
  let data;
  try { data = await api("/api/letters?" + q); } catch (e) { return say(e.message, true); }
  const bus = state.buses[group.bus];
  document.getElementById("letters-title").textContent =
    `${group.cause} · ${group.topic} · ${bus ? bus.service || bus.label : ""}: ${data.letters.length} shown of ${data.total}`;
  document.querySelector("#letter-list tbody").replaceChildren(...(data.letters.length ? data.letters.map((l) => el("tr", { "data-id": l.id },
    el("td", { text: l.id }), el("td", { text: l.topic }), el("td", { class: "num", text: fmt.n(l.attempts) }),
    el("td", { class: "num", text: fmt.age(l.age_s) }), el("td", {}, el("pre", { text: l.error || l.reason })),
    // payload_text: the payload as the bus holds it (NaN, integers above 2**53: JSON.parse would lose them)
    el("td", {}, el("pre", { text: l.payload_text +
      (l.headers ? "\nheaders: " + JSON.stringify(l.headers) : "") +
      (l.origin === "outgoing" ? "\nundelivered to " + l.peer : "") +
      (l.not_replayable ? "\nnot replayable: " + l.not_replayable : "") })),
    el("td", {},
      actionButton("Replay", () => run("replay", { bus: group.bus, ids: [l.id] })),
      actionButton("Edit & replay", () => edit(group.bus, l)),
      actionButton("Purge", () => confirmThen(`Delete dead letter ${l.id}? This cannot be undone.`,
        () => run("purge", { bus: group.bus, ids: [l.id] })), "danger")))) :
    [el("tr", {}, el("td", { colspan: 7, class: "muted", text: "none left" }))]));
  document.getElementById("letters").hidden = false;
}

function say(text, bad) {
  const p = document.getElementById("action-result");
  p.textContent = text; p.hidden = false;
  p.className = bad ? "result problem" : "result";
}

async function run(action, body) {
  let data;
  try { data = await api("/api/" + action, body); } catch (e) { return say(action + " failed: " + e.message, true); }
  if (action === "purge") {
    const r = data.rows[0] || { removed: { deadletters: 0 } };
    say(`purged ${r.removed.deadletters} dead letter(s)` + (r.missing && r.missing.length ? `; not found: ${r.missing.join(", ")}` : "") +
      (data.more ? "; more may be left: purge again" : ""));
  } else {
    const done = data.rows.filter((r) => r.result === "replayed");
    const skipped = data.rows.filter((r) => r.result !== "replayed");
    say(`replayed ${done.length}: ${done.map((r) => r.id + " → " + r.to).join(", ")}` +
      (skipped.length ? `; skipped ${skipped.length}: ${skipped.map((r) => r.id + " (" + r.detail + ")").join(", ")}` : "") +
      (data.more ? "; more may be left: replay again" : ""),
      done.length === 0);
  }
  await refresh();
  if (shown) await showLetters(shown);
}

function confirmThen(text, then) {
  const d = document.getElementById("confirm");
  document.getElementById("confirm-text").textContent = text;
  d.onclose = () => { if (d.returnValue === "ok") then(); };
  d.returnValue = "";
  d.showModal();
}

function edit(bus, letter) {
  const d = document.getElementById("edit");
  const area = document.getElementById("edit-payload");
  const problem = document.getElementById("edit-error");
  document.getElementById("edit-title").textContent = "Edit and replay " + letter.id;
  area.value = letter.payload_text; // sent back as text: the console parses it, exactly
  problem.hidden = true;
  area.oninput = () => { problem.hidden = true; };
  d.returnValue = "";
  document.getElementById("edit-ok").onclick = (ev) => {
    const text = area.value;
    // Its syntax checked here, so the dialog stays open to mend it; its value is parsed by
    // the console (JSON.parse would round integers above 2**53).
    try { JSON.parse(text); } catch (e) {
      if (!/NaN|Infinity/.test(text)) {
        ev.preventDefault(); problem.textContent = "not JSON: " + e.message; problem.hidden = false; return;
      }
    }
    d.onclose = () => { if (d.returnValue === "ok") run("replay", { bus, ids: [letter.id], payload_text: text }); };
  };
  d.onclose = null;
  d.showModal();
}

// The next poll after the last one ended (a slow bus must not pile polls up); none while a
// dialog is open, so that what the operator is editing stays as it is.
async function poll() {
  if (!document.querySelector("dialog[open]")) await refresh();
  setTimeout(poll, ((state && state.interval) || 2) * 1000);
}
poll();
