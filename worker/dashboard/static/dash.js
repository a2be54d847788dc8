"use strict";
// chatstream's dashboard: one page, views by the address's #fragment. The overview arrives
// from api/live (Server-Sent Events, one per read of the server's single read loop); the
// other views ask the API when opened. Every value from Redis goes into the page as text
// (textContent), never as markup. The operator's key stays in this tab's sessionStorage
// and is sent only in the X-Chatstream-Dashboard-Key header.
const $ = (id) => document.getElementById(id);
const KEY_STORE = "chatstream-dashboard-key";
const KEY_HEADER = "X-Chatstream-Dashboard-Key";
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
let overview = null;
let overviewAt = 0;
let session = null;
let route = { view: "overview", arg: "", params: new URLSearchParams() };
let windowData = null;
let tenantRows = null;
let jobCursor = null;
let deadCursor = null;
let reply = null; // {id, controller}
let jobTimer = null;

// -- small helpers ---------------------------------------------------------------------

function h(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function num(value) {
  if (value === null || value === undefined) return "–";
  return Number(value).toLocaleString("en-US", { maximumFractionDigits: 2 });
}

function age(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const s = Math.max(0, Math.round(seconds));
  if (s < 120) return s + " s";
  if (s < 7200) return Math.round(s / 60) + " min";
  if (s < 172800) return (s / 3600).toFixed(1) + " h";
  return (s / 86400).toFixed(1) + " d";
}

function when(unix) {
  if (!unix) return "–";
  return new Date(unix * 1000).toISOString().replace("T", " ").slice(0, 19) + " UTC";
}

function ms(value) {
  return value === null || value === undefined ? "–" : Math.round(value) + " ms";
}

function badge(text, kind) {
  return h("span", { class: "badge " + (kind || text) }, text);
}

function bar(used, limit) {
  if (limit === null || limit === undefined) return h("span", {}, num(used) + " (no limit)");
  const share = limit > 0 ? Math.min(1, used / limit) : 1;
  const meter = h("span", { class: "bar" + (share >= 1 ? " full" : "") }, h("i", {}));
  meter.firstChild.style.width = Math.round(share * 100) + "%";
  return h("span", {}, meter, num(used) + " of " + num(limit));
}

function table(node, headers, rows, empty) {
  const head = h("tr", {}, headers.map((x) => h("th", { class: x.n ? "n" : null }, x.label)));
  const body = rows.map((row) =>
    h("tr", row.attrs || {}, row.cells.map((cell, i) =>
      h("td", { class: [headers[i].n ? "n" : "", headers[i].cls || ""].join(" ").trim() || null,
        "data-col": headers[i].col || null }, cell))));
  if (!rows.length) body.push(h("tr", {}, h("td", { colspan: headers.length, class: "hint" }, empty || "none")));
  node.replaceChildren(h("thead", {}, head), h("tbody", {}, body));
}

function key() {
  return sessionStorage.getItem(KEY_STORE) || "";
}

async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (key()) headers[KEY_HEADER] = key();
  const response = await fetch(path, { ...options, headers });
  const body = await response.json().catch(() => ({}));
  if (!response.ok) {
    const error = new Error((body.error && body.error.message) || response.statusText);
    error.status = response.status;
    throw error;
  }
  return body;
}

function link(text, hash) {
  return h("a", { href: hash }, text);
}

function jobLink(id) {
  return h("a", { href: "#/job/" + encodeURIComponent(id), class: "mono" }, id);
}

// -- the operator's key ------------------------------------------------------------------

async function loadSession() {
  try {
    session = await api("api/session");
  } catch (error) {
    session = null;
  }
  const operator = session && session.operator;
  $("where").textContent = session ? `${session.prefix} · ${session.redis} · v${session.version}` : "";
  $("operator").hidden = !operator;
  $("operator").textContent = operator ? "operator: " + operator : "";
  $("forget").hidden = !key();
  $("key-form").hidden = Boolean(operator);
  if (key() && !operator) $("key").placeholder = "not an operator key";
  render();
}

function canAct() {
  return Boolean(session && session.operator);
}

function actionButton(label, title, act) {
  const allowed = canAct();
  return h("button", {
    type: "button",
    disabled: !allowed,
    title: allowed ? title : "needs an operator key (read-only)",
    onclick: async (event) => {
      event.target.disabled = true;
      try {
        await act();
      } catch (error) {
        alert(label + ": " + error.message);
      } finally {
        event.target.disabled = false;
      }
    },
  }, label);
}

// -- live overview -----------------------------------------------------------------------

function connect() {
  const source = new EventSource("api/live");
  source.addEventListener("overview", (event) => {
    overview = JSON.parse(event.data);
    overviewAt = Date.now();
    renderLive();
  });
  source.onerror = () => liveLabel();
}

function liveLabel() {
  const label = $("live");
  const seconds = (Date.now() - overviewAt) / 1000;
  const fresh = overview && !overview.error && seconds < 5;
  label.className = "live " + (fresh ? "ok" : "down");
  label.textContent = fresh ? "live" : overview && overview.error ? "Redis unreachable"
    : overviewAt ? "stale " + age(seconds) : "connecting…";
}

function renderLive() {
  liveLabel();
  renderAlerts();
  if (!overview || overview.error) return;
  $("nav-dead").textContent = overview.totals.dead ? num(overview.totals.dead) : "";
  if (route.view === "overview") renderOverview();
  if (route.view === "upstreams") renderUpstreams();
  if (route.view === "workers") renderWorkers();
}

function alertsOf(o) {
  if (o.error) return [["bad", "Cannot read the fleet: " + o.error]];
  const found = [];
  const t = o.totals;
  if (!t.workers_alive && (t.waiting || t.running || t.workers)) {
    found.push(["bad", `No live worker: ${num(t.waiting)} jobs wait, ${num(t.running)} were running`]);
  }
  for (const u of o.upstreams) {
    if (u.kind === "target") {
      if (u.down) found.push(["bad", `Route target ${u.name} skipped by every worker for ${age(o.now - u.down.since)} (${u.down.error})`]);
      continue;
    }
    if (u.kind === "route") {
      if (u.targets_down === u.targets) found.push(["bad", `Route ${u.name}: every target is down; ${num(u.waiting)} jobs wait`]);
      if (u.paused_since) found.push(["warn", `Route ${u.name} paused for the fleet since ${when(u.paused_since)}; ${num(u.waiting)} jobs held`]);
      continue;
    }
    if (u.down) {
      const on = u.down.workers === 1 ? "1 worker" : `${u.down.workers} workers`;
      found.push(["bad", `Upstream ${u.name} down on ${on} for ${age(o.now - u.down.since)}`
        + ` (${u.down.error}); ${num(u.down.waiting)} jobs wait for it in workers, ${num(u.waiting)} queued`]);
    }
    if (u.paused_since) found.push(["warn", `Upstream ${u.name} paused for the fleet since ${when(u.paused_since)}; ${num(u.waiting)} jobs held`]);
    if (u.cooling_ms > 0) found.push(["warn", `Upstream ${u.name} answered 429: nothing goes to it for ${age(u.cooling_ms / 1000)}`]);
  }
  for (const w of o.workers) {
    if (w.state !== "alive") found.push(["warn", `Worker ${w.name} silent for ${age(w.beat_age)} (${w.state})`]);
  }
  if (t.oldest_waiting_seconds > 60) found.push(["warn", `The oldest waiting job has waited ${age(t.oldest_waiting_seconds)}`]);
  if (t.dead) found.push(["warn", t.dead === 1 ? "1 dead letter" : `${num(t.dead)} dead letters`]);
  return found;
}

function renderAlerts() {
  const rows = overview ? alertsOf(overview) : [];
  $("alerts").replaceChildren(...rows.map(([kind, text]) => h("div", { class: kind }, text)));
}

function tile(label, value, id, bad) {
  return h("div", { class: "tile" + (bad ? " bad" : "") }, h("div", { class: "v", id }, value), h("div", { class: "k" }, label));
}

function renderOverview() {
  const t = overview.totals;
  $("tiles").replaceChildren(
    tile("waiting", num(t.waiting), "total-waiting"),
    tile("running", num(t.running), "total-running"),
    tile("dead letters", num(t.dead), "total-dead", t.dead > 0),
    tile("workers alive", `${t.workers_alive} / ${t.workers}`, "total-workers", t.workers_alive === 0),
    tile("oldest wait", age(t.oldest_waiting_seconds), "total-oldest"),
    tile("finished / s (5 min)", num(t.finished_per_second), "total-rate"),
    tile("tokens / s (5 min)", num(t.tokens_per_second), "total-tokens"),
    tile("first token p50 / p95 (1 h)", `${num(t.ttft_p50_ms === null ? null : Math.round(t.ttft_p50_ms))} / ${ms(t.ttft_p95_ms)}`, "total-ttft"),
    tile("failed (1 h)", `${num(t.failed_last_hour)} of ${num(t.finished_last_hour)}`, "total-failed", t.failed_last_hour > 0),
  );
  renderCharts(windowData && Number($("window").value) > 60 ? windowData : overview.activity);
  table($("shards"), [
    { label: "shard" }, { label: "stream key" }, { label: "waiting", n: 1, col: "waiting" },
    { label: "high", n: 1 }, { label: "normal", n: 1 }, { label: "low", n: 1 },
    { label: "in stream", n: 1 }, { label: "running", n: 1, col: "running" },
    { label: "tenants waiting", n: 1 }, { label: "oldest wait", n: 1 },
  ], overview.shards.map((s) => ({
    attrs: { "data-shard": s.shard },
    cells: [s.shard, h("span", { class: "mono" }, s.key), num(s.waiting), num(s.by_priority.high),
      num(s.by_priority.normal), num(s.by_priority.low), num(s.in_stream), num(s.running),
      num(s.tenants_waiting), age(s.oldest_waiting_seconds)],
  })));
  const lag = overview.waiting_at ? overview.now - overview.waiting_at : 0;
  $("tenant-count").textContent = `(${num(t.tenants)} with jobs waiting, running, dead or ended in the last hour`
    + (lag > 2 ? `; high/normal/low as of ${age(lag)} ago` : "")
    + (overview.dead_seen < t.dead ? `; dead counted among the newest ${num(overview.dead_seen)}` : "") + ")";
  renderTenants($("tenant-filter").value ? tenantRows || [] : overview.tenants);
}

function renderTenants(rows) {
  table($("tenants"), [
    { label: "tenant" }, { label: "waiting", n: 1, col: "waiting" }, { label: "high", n: 1, col: "high" },
    { label: "normal", n: 1, col: "normal" }, { label: "low", n: 1, col: "low" },
    { label: "running", n: 1, col: "running" }, { label: "dead", n: 1, col: "dead" },
    { label: "oldest wait", n: 1 }, { label: "ended (1 h)", n: 1 }, { label: "failed (1 h)", n: 1, col: "failed" },
    { label: "tokens (1 h)", n: 1 },
  ], rows.map((r) => ({
    attrs: { "data-tenant": r.name },
    cells: [link(r.name, "#/jobs?tenant=" + encodeURIComponent(r.name)), num(r.waiting),
      num(r.by_priority.high), num(r.by_priority.normal), num(r.by_priority.low), num(r.running),
      num(r.dead), age(r.oldest_waiting_seconds), num(r.last_hour.n), num(r.last_hour.f),
      num(r.last_hour.tok)],
  })), "no tenant has jobs");
}

// -- charts (SVG, drawn here) --------------------------------------------------------------

const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#2e90fa", "#f04438", "#12b76a", "#f79009", "#7a5af8", "#ee46bc", "#667085"];

function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
  return node;
}

function chart(title, series, stacked, format) {
  const width = 600, height = 110, points = series[0].values.length;
  const totals = series[0].values.map((_, i) => stacked
    ? series.reduce((sum, s) => sum + (s.values[i] || 0), 0)
    : Math.max(...series.map((s) => s.values[i] || 0)));
  const top = Math.max(...totals, 0) || 1;
  const box = svg("svg", { viewBox: `0 0 ${width} ${height}`, preserveAspectRatio: "none", role: "img" });
  const step = width / points;
  series.forEach((s, index) => {
    if (stacked) {
      s.values.forEach((value, i) => {
        if (!value) return;
        const below = series.slice(0, index).reduce((sum, o) => sum + (o.values[i] || 0), 0);
        box.append(svg("rect", { x: i * step + 0.5, width: Math.max(step - 1, 1),
          y: height - ((below + value) / top) * height, height: (value / top) * height, fill: s.color }));
      });
    } else {
      const xy = s.values.map((v, i) => (v === null ? null : [i * step + step / 2, height - (v / top) * height]));
      const path = xy.filter(Boolean).map(([x, y]) => `${x},${y}`).join(" ");
      if (path) box.append(svg("polyline", { points: path, fill: "none", stroke: s.color, "stroke-width": 2 }));
      for (const point of xy.filter(Boolean)) {
        box.append(svg("circle", { cx: point[0], cy: point[1], r: 3, fill: s.color }));
      }
    }
  });
  const legend = h("div", { class: "legend" }, series.map((s) => {
    const last = s.values.length > 1 ? s.values[s.values.length - 2] : s.values[0]; // the last whole step
    const swatch = h("i", {});
    swatch.style.background = s.color;
    return h("span", {}, swatch, `${s.name} ${format(last)}`);
  }));
  return h("div", { class: "chart" }, h("div", { class: "t" }, `${title} (top: ${format(top)})`), box, legend);
}

function renderCharts(a) {
  if (!a) return;
  // per second; the current step so far over the seconds it has run
  const sofar = Math.max(1, (overview ? overview.now : Date.now() / 1000) - (a.start + (a.finished.length - 1) * a.step_seconds));
  const perSecond = (values) => values.map((v, i) => v / (i === values.length - 1 ? Math.min(sofar, a.step_seconds) : a.step_seconds));
  const ok = a.finished.map((v, i) => v - a.failed[i]);
  const codes = Object.keys(a.failures);
  const rate = (v) => (v === null || v === undefined ? "–" : num(v) + "/s");
  $("charts").replaceChildren(
    chart("jobs ended per second", [
      { name: "ok or cancelled", values: perSecond(ok), color: COLORS[0] },
      { name: "failed", values: perSecond(a.failed), color: COLORS[1] },
    ], true, rate),
    chart("completion tokens per second", [{ name: "tokens", values: perSecond(a.tokens), color: COLORS[2] }], true, rate),
    chart("time to first token", [
      { name: "p50", values: a.ttft_p50_ms, color: COLORS[0] },
      { name: "p95", values: a.ttft_p95_ms, color: COLORS[3] },
    ], false, ms),
    chart("failures by code, per step", codes.length ? codes.map((code, i) => ({
      name: code, values: a.failures[code], color: COLORS[(i + 1) % COLORS.length],
    })) : [{ name: "none", values: a.failed, color: COLORS[1] }], true, num),
  );
}

async function loadWindow() {
  const minutes = Number($("window").value);
  windowData = minutes > 60 ? await api("api/activity?minutes=" + minutes).catch(() => null) : null;
  if (overview && !overview.error && route.view === "overview") renderOverview();
}

async function filterTenants() {
  const query = $("tenant-filter").value;
  tenantRows = query ? (await api("api/tenants?q=" + encodeURIComponent(query))).tenants : null;
  if (overview && !overview.error) renderOverview();
}

// -- upstreams and workers -----------------------------------------------------------------

function targetState(u, now) {
  if (u.down && u.down.probing) return [badge(`probing, down ${age(now - u.down.since)}`, "down")];
  if (u.down) {
    const what = u.down.whole_upstream ? "upstream down" : "down";
    return [badge(`${what} ${age(now - u.down.since)}, next probe in ${age(Math.max(u.down.until - now, 0))}`, "down")];
  }
  return [u.answered ? badge("ok", "ok") : badge("no answer lately", "paused")];
}

function routeState(u, now) {
  const states = [];
  if (u.targets_down === u.targets) states.push(badge("every target down", "down"));
  else if (u.targets_down) states.push(badge(`${u.targets_down} of ${u.targets} targets down`, "cooling"));
  if (u.paused_since) states.push(badge(`paused ${age(now - u.paused_since)}`, "paused"));
  if (!states.length) states.push(badge("ok", "ok"));
  return states;
}

function upstreamRow(u, now) {
  const dash = "—";
  if (u.kind === "target") {
    return [u.kind, u.name, targetState(u, now), dash, dash, dash, "", "", "", u.down ? u.down.error : "", ""];
  }
  const pause = u.paused_since
    ? actionButton("Resume", "dispatch to it again", () => upstreamAction(u.name, "resume"))
    : actionButton("Pause", "dispatch nothing more to it, for the whole fleet", () => upstreamAction(u.name, "pause"));
  if (u.kind === "route") {
    const hour = `${num(u.last_hour.n)} / ${num(u.last_hour.f)}, ${num(u.last_hour.fb || 0)} fallbacks`;
    return [u.kind, `${u.name} (${u.target})`, routeState(u, now), dash, dash, dash,
      num(u.waiting), num(u.running), hour, "", pause];
  }
  return [u.kind, u.name, upstreamState(u, now), bar(u.use.permits, u.limits.max_concurrent),
    bar(u.use.requests_last_minute, u.limits.requests_per_minute),
    bar(u.use.tokens_last_minute, u.limits.tokens_per_minute), num(u.waiting), num(u.running),
    `${num(u.last_hour.n)} / ${num(u.last_hour.f)}`, u.down ? u.down.error : "", pause];
}

function upstreamState(u, now) {
  const states = [];
  if (u.down) states.push(badge(`down ${age(now - u.down.since)}`, "down"));
  if (u.paused_since) states.push(badge(`paused ${age(now - u.paused_since)}`, "paused"));
  if (u.cooling_ms > 0) states.push(badge(`cooling ${age(u.cooling_ms / 1000)}`, "cooling"));
  if (!states.length) states.push(badge("ok", "ok"));
  if (!u.served) states.push(badge("not served by any worker", "warn"));
  return states;
}

function renderUpstreams() {
  const now = overview.now;
  table($("upstreams"), [
    { label: "kind" }, { label: "name" }, { label: "state" }, { label: "streams (max_concurrent)" },
    { label: "requests, last minute" }, { label: "tokens, last minute" },
    { label: "waiting", n: 1, col: "waiting" }, { label: "running", n: 1, col: "running" },
    { label: "ended / failed (1 h)", n: 1 }, { label: "last error" }, { label: "" },
  ], overview.upstreams.map((u) => ({
    attrs: { "data-upstream": u.name, "data-kind": u.kind },
    cells: upstreamRow(u, now),
  })), "no upstream seen yet");
}

async function upstreamAction(name, verb) {
  if (verb === "pause" && !confirm(`Pause ${name} for the whole fleet?`)) return;
  await api(`api/upstreams/${encodeURIComponent(name)}/${verb}`, { method: "POST" });
}

function renderWorkers() {
  const now = overview.now;
  table($("workers"), [
    { label: "worker" }, { label: "state" }, { label: "last heartbeat", n: 1 }, { label: "version" },
    { label: "started" }, { label: "slots in use" }, { label: "waiting for a down upstream", n: 1, col: "waiting" },
    { label: "queue entries held", n: 1, col: "pending" }, { label: "jobs run", n: 1 }, { label: "finds down" },
  ], overview.workers.map((w) => ({
    attrs: { "data-worker": w.name },
    cells: [h("span", { class: "mono" }, w.name), [badge(w.state), w.stopping ? badge("stopping", "warn") : null],
      age(w.beat_age) + " ago", w.version || "?",
      w.started ? `${when(w.started)} (${age(now - w.started)})` : "?",
      w.slots === null ? "?" : bar(w.busy, w.slots), num(w.waiting), num(w.pending), num(w.processed),
      w.down.join(", ")],
  })), "no worker has beaten on this prefix");
}

// -- jobs ----------------------------------------------------------------------------------

function jobFilters() {
  const params = new URLSearchParams();
  const pairs = [["status", $("f-status").value], ["tenant", $("f-tenant").value], ["upstream", $("f-upstream").value]];
  for (const [name, value] of pairs) if (value) params.set(name, value.trim());
  for (const [name, id] of [["since", "f-since"], ["before", "f-before"]]) {
    if ($(id).value) params.set(name, String(Date.parse($(id).value + "Z") / 1000));
  }
  return params;
}

function setJobFilters(params) {
  $("f-status").value = params.get("status") || "";
  $("f-tenant").value = params.get("tenant") || "";
  $("f-upstream").value = params.get("upstream") || "";
  for (const [name, id] of [["since", "f-since"], ["before", "f-before"]]) {
    const value = params.get(name);
    $(id).value = value ? new Date(Number(value) * 1000).toISOString().slice(0, 16) : "";
  }
}

async function loadJobs(more) {
  const params = jobFilters();
  if (more && jobCursor !== null) params.set("before", String(jobCursor));
  params.set("limit", "50");
  let page;
  try {
    page = await api("api/jobs?" + params);
  } catch (error) {
    $("jobs-note").textContent = error.message;
    return;
  }
  jobCursor = page.next_before;
  $("jobs-more").hidden = jobCursor === null;
  $("jobs-note").textContent = page.jobs.length ? "" : "no job matches (the index is searched 10,000 entries at a time: Older goes on)";
  const rows = page.jobs.map((j) => ({
    attrs: { "data-job": j.id },
    cells: [when(j.created_at), jobLink(j.id), badge(j.status), j.tenant, j.upstream, j.priority,
      num(j.attempt), j.error ? `${j.error.code || ""}: ${j.error.message || ""}` : ""],
  }));
  const headers = [{ label: "enqueued" }, { label: "job" }, { label: "status" }, { label: "tenant" },
    { label: "upstream" }, { label: "priority" }, { label: "attempt", n: 1 }, { label: "error" }];
  if (more) {
    const body = $("jobs").querySelector("tbody");
    for (const row of rows) body.append(h("tr", row.attrs, row.cells.map((c) => h("td", {}, c))));
  } else {
    table($("jobs"), headers, rows, "no job matches");
  }
}

// -- one job -------------------------------------------------------------------------------

async function loadJob(id, again) {
  let job;
  try {
    job = await api("api/jobs/" + encodeURIComponent(id));
  } catch (error) {
    $("job-id").textContent = id;
    $("job-status").textContent = error.status === 404 ? "not found" : error.message;
    return;
  }
  const r = job.record;
  $("job-id").textContent = id;
  $("job-status").replaceChildren(badge(r.status || "?"));
  $("job-cancel").hidden = TERMINAL.has(r.status);
  $("job-requeue").hidden = r.status !== "failed";
  for (const button of [$("job-cancel"), $("job-requeue")]) {
    button.disabled = !canAct();
    button.title = canAct() ? "" : "needs an operator key (read-only)";
  }
  $("job-facts").replaceChildren(...jobFacts(r));
  $("job-error").hidden = !r.error;
  $("job-error").textContent = r.error ? JSON.stringify(r.error, null, 2) : "";
  table($("job-attempts"), [{ label: "attempt", n: 1 }, { label: "first entry" }, { label: "last entry" },
    { label: "deltas", n: 1 }, { label: "waited", n: 1 }, { label: "ended" }, { label: "started over because" }],
  job.attempts.map((a) => ({ cells: [a.attempt, when(a.first), when(a.last), num(a.deltas), num(a.waiting), a.end || "–", a.reset_reason || ""] })),
  "no entry in its events stream yet");
  const fields = Object.entries(r).filter(([, value]) => value !== null && value !== "");
  table($("job-record"), [{ label: "field" }, { label: "value" }], fields.map(([name, value]) => ({
    attrs: { "data-field": name },
    cells: [name, fieldText(name, value)],
  })));
  if (!again) startReply(id, job.content_shown);
  clearTimeout(jobTimer);
  if (!TERMINAL.has(r.status) && route.view === "job" && route.arg === id) {
    jobTimer = setTimeout(() => loadJob(id, true), 2000);
  }
}

const TIME_FIELDS = new Set(["created_at", "dispatched_at", "started_at", "finished_at", "requeued_at", "replica_check"]);

function fieldText(name, value) {
  if (TIME_FIELDS.has(name) && Number(value)) return `${value}  (${when(Number(value))})`;
  return typeof value === "string" ? value : JSON.stringify(value, null, 1);
}

function jobFacts(r) {
  const span = (from, to) => (from && to ? age(Number(to) - Number(from)) : "–");
  const facts = [
    ["tenant", r.tenant || "default"], ["priority", r.priority || "normal"], ["upstream", r.upstream || "default"],
    ["model", r.model || (r.request_summary && r.request_summary.model) || "–"], ["attempt", r.attempt || "0"],
    ["worker", r.worker || "–"], ["enqueued", when(Number(r.created_at))],
    ["waited", span(r.created_at, r.dispatched_at || r.started_at)],
    ["ran", span(r.started_at, r.finished_at || (overview && overview.now))],
  ];
  if (r.usage) facts.push(["tokens", `${num(r.usage.prompt_tokens)} in, ${num(r.usage.completion_tokens)} out`]);
  if (r.finish_reason) facts.push(["finish", r.finish_reason]);
  return facts.map(([label, value]) => h("span", { class: "fact" }, h("b", {}, label), " ", String(value)));
}

function stopReply() {
  if (reply) reply.controller.abort();
  reply = null;
}

function startReply(id, shown) {
  stopReply();
  $("job-reply").textContent = "";
  $("job-reply").hidden = !shown;
  $("reply-note").textContent = shown ? "streaming from the job's events stream (replayed, then live)"
    : "The reply is job content: enter an operator key to see it.";
  if (shown) {
    reply = { id, controller: new AbortController(), last: "0-0", text: "" };
    readReply(reply);
  }
}

async function readReply(state) {
  while (reply === state) {
    try {
      const response = await fetch(`api/jobs/${encodeURIComponent(state.id)}/events?after=${state.last}`,
        { headers: { [KEY_HEADER]: key() }, signal: state.controller.signal });
      if (!response.ok) {
        $("reply-note").textContent = "cannot read the reply: " + response.status;
        return;
      }
      if (await readFrames(state, response.body.getReader())) return;
    } catch (error) {
      if (state.controller.signal.aborted) return;
    }
    await new Promise((resolve) => setTimeout(resolve, 1000)); // cut off: resume after `last`
  }
}

async function readFrames(state, reader) {
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return state.ended;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (data) applyEntry(state, JSON.parse(data));
    }
  }
}

function applyEntry(state, entry) {
  if (entry.id) state.last = entry.id;
  const data = entry.data || {};
  if (entry.type === "delta") state.text += (data.content || "") + (data.refusal || "");
  else if (entry.type === "reset") state.text = "";
  else if (["done", "error", "cancelled"].includes(entry.type)) {
    state.ended = true;
    $("reply-note").textContent = `ended: ${entry.type}` + (data.finish_reason ? ` (${data.finish_reason})` : "");
    if (route.view === "job" && route.arg === state.id) loadJob(state.id, true);
  } else if (entry.type === "waiting") {
    $("reply-note").textContent = "waiting: " + (data.detail || data.reason || "");
  }
  $("job-reply").textContent = state.text;
}

async function jobAction(verb) {
  const id = route.arg;
  const done = await api(`api/jobs/${encodeURIComponent(id)}/${verb}`, { method: "POST" });
  $("job-said").textContent = `${verb}: ${done.status}`;
  await loadJob(id, verb !== "requeue");
  if (verb === "requeue") startReply(id, canAct());
}

// -- dead letters --------------------------------------------------------------------------

async function loadDead(more) {
  const params = new URLSearchParams({ limit: "50" });
  if (more && deadCursor) params.set("before", deadCursor);
  const page = await api("api/dead?" + params);
  deadCursor = page.next_before;
  $("dead-more").hidden = !deadCursor;
  $("dead-count").textContent = overview && overview.totals ? `(${num(overview.totals.dead)})` : "";
  const rows = page.dead_letters.map((d) => ({
    attrs: { "data-entry": d.entry, "data-job": d.job },
    cells: [when(Number(d.entry.split("-")[0]) / 1000), jobLink(d.job),
      d.reason ? `${d.reason.code || ""}${d.reason.attempts ? ` after ${d.reason.attempts} attempts` : ""}` : "",
      d.record ? d.record.tenant || "" : "(record expired)", d.record ? d.record.upstream || "" : "",
      d.record ? badge(d.record.status || "?") : "", d.error ? `${d.error.code || ""}: ${d.error.message || ""}` : "",
      [actionButton("Requeue", "run it again with a fresh attempt budget", () => deadAction(d, "requeue")), " ",
        actionButton("Delete", "remove this dead letter", () => deadAction(d, "delete"))]],
  }));
  const headers = [{ label: "died" }, { label: "job" }, { label: "why" }, { label: "tenant" }, { label: "upstream" },
    { label: "status now" }, { label: "error" }, { label: "" }];
  if (more) {
    const body = $("dead").querySelector("tbody");
    for (const row of rows) body.append(h("tr", row.attrs, row.cells.map((c) => h("td", {}, c))));
  } else {
    table($("dead"), headers, rows, "no dead letter");
  }
}

async function deadAction(letter, verb) {
  if (verb === "delete" && !confirm(`Delete the dead letter of job ${letter.job}?`)) return;
  const path = verb === "requeue" ? `api/jobs/${encodeURIComponent(letter.job)}/requeue`
    : `api/dead/${encodeURIComponent(letter.entry)}/delete`;
  await api(path, { method: "POST" });
  await loadDead(false);
}

// -- views ---------------------------------------------------------------------------------

function parseRoute() {
  const [path, query] = location.hash.slice(2).split("?");
  const [view, ...rest] = (path || "overview").split("/");
  return { view: view || "overview", arg: decodeURIComponent(rest.join("/")), params: new URLSearchParams(query || "") };
}

function render() {
  route = parseRoute();
  const view = $("view-" + route.view) ? route.view : "overview";
  for (const section of document.querySelectorAll(".view")) section.hidden = section.id !== "view-" + view;
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.view === view || (view === "job" && a.dataset.view === "jobs"));
  if (view !== "job") {
    stopReply();
    clearTimeout(jobTimer);
  }
  if (view === "jobs") {
    setJobFilters(route.params);
    loadJobs(false);
  }
  if (view === "job") loadJob(route.arg, false);
  if (view === "dead") loadDead(false);
  if (overview && !overview.error) renderLive();
}

function start() {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY_STORE, $("key").value);
    $("key").value = "";
    loadSession();
  });
  $("forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORE);
    loadSession();
  });
  $("job-filters").addEventListener("submit", (event) => {
    event.preventDefault();
    location.hash = "#/jobs?" + jobFilters();
  });
  $("job-search").addEventListener("submit", (event) => {
    event.preventDefault();
    const id = $("search-id").value.trim();
    if (id) location.hash = "#/job/" + encodeURIComponent(id);
  });
  $("jobs-more").addEventListener("click", () => loadJobs(true));
  $("dead-more").addEventListener("click", () => loadDead(true));
  $("job-cancel").addEventListener("click", () => jobAction("cancel").catch((e) => alert(e.message)));
  $("job-requeue").addEventListener("click", () => jobAction("requeue").catch((e) => alert(e.message)));
  $("window").addEventListener("change", loadWindow);
  let typing = null;
  $("tenant-filter").addEventListener("input", () => {
    clearTimeout(typing);
    typing = setTimeout(filterTenants, 250);
  });
  setInterval(liveLabel, 1000);
  setInterval(() => {
    if ($("tenant-filter").value) filterTenants();
    if (Number($("window").value) > 60) loadWindow();
  }, 30000);
  window.addEventListener("hashchange", render);
  loadSession();
  connect();
}

start();
