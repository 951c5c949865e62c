// The HTTP side of tools/bench_gateway: blockqueue-like clients on Node 20's built-in fetch
// (undici, keep-alive, one connection per request in flight), no packages.
//
//   node tools/bench_gateway_client.mjs '{"mode": "publish", "url": "http://127.0.0.1:PORT", ...}'
//
// Every mode runs `warmup` seconds, prints {"phase": "measure"} (the parent samples the
// gateway's CPU then), runs `seconds` more, and prints one JSON line of results. Only
// requests that end inside the measured window count. Modes:
//   publish  `concurrency` loops, each POST /topics/{topic}/messages with `batch` messages
//            (1: one JSON object per POST; more: a JSON array with ?many=true); 201 expected
//   pull     `concurrency` loops, each GET .../subscribers/{sub}?max=100&timeout=1s, then
//            DELETE .../messages?ids=... for what it read (a pre-filled queue)
//   null-server  no client: a Node HTTP server answering 201 at once (the client's ceiling)
//   idle     opens `polls` long polls (GET ...?timeout=60s on `subs` subscribers), then
//            GET /health every `interval_ms` and times it; the polls are aborted at the end
import { setMaxListeners } from "node:events";
import http from "node:http";

const args = JSON.parse(process.argv[2]);
const base = args.url;
const pad = "x".repeat(240);
const now = () => performance.now();
const out = (obj) => process.stdout.write(JSON.stringify(obj) + "\n");

let measureStart = Infinity;
let measureEnd = Infinity;
let stopAt = Infinity;
const latencies = [];
let counted = 0;
let errors = 0;
let firstError = null;
let lastDone = 0;

function inWindow(t) {
  return t >= measureStart && t <= measureEnd;
}

function failed(what) {
  errors += 1;
  if (firstError === null) firstError = String(what).slice(0, 300);
}

function schedule() {
  const t0 = now();
  measureStart = t0 + args.warmup * 1000;
  measureEnd = measureStart + args.seconds * 1000;
  stopAt = measureEnd;
  setTimeout(() => out({ phase: "measure" }), args.warmup * 1000);
}

function percentile(sorted, q) {
  if (!sorted.length) return null;
  return sorted[Math.min(sorted.length - 1, Math.floor(sorted.length * q))];
}

function latencySummary() {
  const sorted = Float64Array.from(latencies).sort();
  return { p50_us: percentile(sorted, 0.5) * 1000, p99_us: percentile(sorted, 0.99) * 1000,
           samples: sorted.length };
}

async function publishLoop(worker) {
  const many = args.batch > 1;
  const url = `${base}/topics/${args.topic}/messages${many ? "?many=true" : ""}`;
  let n = worker * 1e9;
  while (now() < stopAt) {
    let body;
    if (many) {
      const items = [];
      for (let i = 0; i < args.batch; i++) items.push({ n: n++, pad });
      body = JSON.stringify(items);
    } else {
      body = JSON.stringify({ n: n++, pad });
    }
    const t0 = now();
    try {
      const r = await fetch(url, { method: "POST", body, headers: { "content-type": "application/json" } });
      await r.arrayBuffer();
      if (r.status !== 201) { failed(`POST ${r.status}`); continue; }
    } catch (e) { failed(e); continue; }
    const t1 = now();
    if (inWindow(t1)) {
      counted += args.batch;
      latencies.push(t1 - t0);
    }
  }
}

async function pullLoop() {
  const subUrl = `${base}/topics/${args.topic}/subscribers/${args.sub}`;
  const seen = args.seen;
  while (now() < stopAt) {
    let messages;
    const t0 = now();
    try {
      const r = await fetch(`${subUrl}?max=${args.batch}&timeout=1s`);
      const body = await r.json();
      if (r.status !== 200) { failed(`GET ${r.status} ${JSON.stringify(body)}`); continue; }
      messages = body.messages;
    } catch (e) { failed(e); continue; }
    if (!messages.length) {
      if (now() >= measureStart) args.drained = true;
      break;  // pre-filled: empty means drained
    }
    const ids = messages.map((m) => m.id);
    try {
      const r = await fetch(`${subUrl}/messages?ids=${ids.join(",")}`, { method: "DELETE" });
      const body = await r.json();
      if (r.status !== 200 || body.acked !== ids.length) { failed(`DELETE ${r.status} ${JSON.stringify(body)}`); continue; }
    } catch (e) { failed(e); continue; }
    const t1 = now();
    for (const id of ids) {
      if (seen.has(id)) args.duplicates += 1;
      seen.add(id);
    }
    if (inWindow(t1)) {
      counted += ids.length;
      latencies.push(t1 - t0);
      lastDone = t1;
    }
  }
}

async function idle() {
  const controller = new AbortController();
  setMaxListeners(0, controller.signal);  // one listener per long poll
  let opened = 0;
  let answered = 0;
  const polls = [];
  for (let i = 0; i < args.polls; i++) {
    const url = `${base}/topics/${args.topic}/subscribers/${args.sub}${i % args.subs}?max=100&timeout=60s`;
    polls.push(fetch(url, { signal: controller.signal })
      .then(async (r) => { await r.arrayBuffer(); answered += 1; })
      .catch((e) => { if (e.name !== "AbortError") failed(e); }));
    opened += 1;
    if (i % 500 === 499) await new Promise((res) => setTimeout(res, 10));  // not one SYN flood
  }
  out({ phase: "opened", polls: opened });
  // The parent waits until the gateway holds them (its open sockets), then says "go".
  await new Promise((res) => process.stdin.once("data", res));
  schedule();
  while (now() < stopAt) {
    const t0 = now();
    try {
      const r = await fetch(`${base}/health`);
      await r.arrayBuffer();
      if (r.status !== 200) failed(`health ${r.status}`);
    } catch (e) { failed(e); }
    const t1 = now();
    if (inWindow(t1)) {
      latencies.push(t1 - t0);
      counted += 1;
    }
    await new Promise((res) => setTimeout(res, args.interval_ms));
  }
  const early = answered;  // long polls that came back before their 60 s: none should
  controller.abort();
  await Promise.allSettled(polls);
  return { answered_early: early };
}

function nullServer() {
  // The client's own ceiling: a Node server that answers 201 at once, stored nothing.
  const server = http.createServer((req, res) => {
    req.resume();
    req.on("end", () => {
      res.writeHead(201, { "content-type": "application/json" });
      res.end('{"id":"0"}');
    });
  });
  server.listen(0, "127.0.0.1", () => out({ url: `http://127.0.0.1:${server.address().port}` }));
  process.stdin.on("end", () => process.exit(0));
  process.stdin.resume();
}

async function main() {
  if (args.mode === "null-server") return nullServer();
  let extra = {};
  if (args.mode === "idle") {
    extra = await idle();
  } else {
    schedule();
    const loops = [];
    if (args.mode === "publish") {
      for (let w = 0; w < args.concurrency; w++) loops.push(publishLoop(w));
    } else {
      Object.assign(args, { seen: new Set(), duplicates: 0, drained: false });
      for (let w = 0; w < args.concurrency; w++) loops.push(pullLoop());
    }
    await Promise.all(loops);
    if (args.mode === "pull") {
      extra = { duplicates: args.duplicates, drained: args.drained, received: args.seen.size };
    }
  }
  // A pull run that emptied the queue before the window ended is timed to its last ack.
  const end = args.mode === "pull" && args.drained && lastDone ? lastDone : measureEnd;
  const seconds = (end - measureStart) / 1000;
  out({ count: counted, seconds, value: counted / seconds, errors, first_error: firstError,
        ...latencySummary(), ...extra });
  process.exit(0);
}

main().catch((e) => { out({ fatal: String(e && e.stack || e) }); process.exit(1); });
