// The Ember console: one page, no build step. Every call carries the signed-in key (X-API-Key,
// or Authorization: Bearer for the OpenAI-compatible routes), so the page sees what that key's SDK
// sees. Data is inserted as text (never as HTML).
"use strict";

const KEY = "ember.apiKey";
const REFRESH_MS = 3000;
const state = { key: sessionStorage.getItem(KEY), tab: "runs", run: null, points: [], lastSeq: 0,
                prev: null, timer: null, models: [] };

const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "onclick") node.addEventListener("click", v);
    else if (v !== null && v !== undefined) node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(c ?? ""));
  return node;
}

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function call(path, opts = {}, bearer = false) {
  const auth = bearer ? { Authorization: `Bearer ${state.key}` } : { "X-API-Key": state.key };
  const res = await fetch(path, { ...opts, headers: { ...auth, ...(opts.headers || {}) } });
  if (res.ok) return res;
  let message = res.statusText;
  try {
    const body = await res.json();
    const detail = body.detail ?? body.error?.message;
    if (detail !== undefined) message = typeof detail === "string" ? detail : JSON.stringify(detail);
  } catch { /* not JSON */ }
  throw new ApiError(res.status, `${res.status}: ${message}`);
}

const api = async (path, opts) => (await call(path, opts)).json();
const enc = encodeURIComponent;

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function when(iso) {
  if (!iso) return "–";
  const d = new Date(iso.endsWith("Z") || iso.includes("+") ? iso : `${iso}Z`);
  return d.toLocaleString();
}

function fill(tableId, rows, onRow, selected) {
  const body = $(tableId).querySelector("tbody");
  body.replaceChildren(...rows.map(({ id, cells }) => {
    const tr = el("tr", { "data-id": id, class: onRow ? `clickable${id === selected ? " selected" : ""}` : null },
                  ...cells.map((c) => el("td", {}, c)));
    if (onRow) tr.addEventListener("click", () => onRow(id));
    return tr;
  }));
  return rows.length;
}

// -- sign-in ------------------------------------------------------------------------------------

async function signIn(key) {
  state.key = key;
  try {
    const overview = await api("/console/api/overview");
    sessionStorage.setItem(KEY, key);
    $("signin").hidden = true;
    $("tabs").hidden = $("signout").hidden = false;
    $("who").textContent = `signed in as ${overview.owner}`;
    render(overview);
    showTab(state.tab);
    loadModels();
    clearInterval(state.timer);
    state.timer = setInterval(refresh, REFRESH_MS);
  } catch (e) {
    state.key = null;
    sessionStorage.removeItem(KEY);
    $("signin-error").textContent = e.status === 401 ? "That API key was not accepted." : e.message;
  }
}

function signOut() {
  clearInterval(state.timer);
  sessionStorage.removeItem(KEY);
  location.reload();
}

function showTab(tab) {
  state.tab = tab;
  for (const b of $("tabs").querySelectorAll("button")) b.classList.toggle("active", b.dataset.tab === tab);
  for (const s of document.querySelectorAll("section.tab")) s.hidden = s.id !== tab;
}

async function refresh() {
  try {
    render(await api("/console/api/overview"));
    if (state.run) await Promise.all([loadMetrics(), loadCheckpoints()]);
  } catch (e) {
    if (e.status === 401) signOut();
  }
}

// -- overview tables ----------------------------------------------------------------------------

function render(o) {
  const runs = fill("runs-table", o.training_runs.map((r) => ({
    id: r.training_run_id,
    cells: [el("code", {}, r.training_run_id), r.base_model, String(r.lora_rank), r.status,
            when(r.created_at), when(r.last_request_time)],
  })), selectRun, state.run);
  $("runs-empty").hidden = runs > 0;
  fill("sessions-table", o.sessions.map((s) => ({
    id: s.session_id,
    cells: [el("code", {}, s.session_id), s.display_name || "–", s.status, when(s.created_at), when(s.last_heartbeat)],
  })));
  fill("samplers-table", o.samplers.map((s) => ({
    id: s.sampler_id,
    cells: [el("code", {}, s.sampler_id), s.base_model, s.model_path ? el("code", {}, s.model_path) : "base model",
            when(s.created_at)],
  })));
  renderEngines(o);
  const mine = o.queue.mine;
  $("my-queue").textContent = `${mine.pending || 0} queued, ${mine.running || 0} running`;
}

function renderEngines(o) {
  const prev = state.prev;
  const dt = prev ? (Date.parse(o.time) - Date.parse(prev.time)) / 1000 : 0;
  const before = Object.fromEntries((prev?.engines || []).map((e) => [e.base_model, e]));
  fill("engines-table", o.engines.map((e) => {
    const p = before[e.base_model];
    const rate = (field) => (p && dt > 0 && p.generation === e.generation ? (e[field] - p[field]) / dt : null);
    const busy = rate("busy_seconds");
    const passes = rate("passes");
    const tokens = rate("tokens");
    const q = o.queue.by_base_model[e.base_model] || {};
    return {
      id: e.base_model,
      cells: [e.base_model, e.status, busy === null ? "–" : `${Math.min(100, 100 * busy).toFixed(0)} %`,
              passes === null ? "–" : passes.toFixed(2), tokens === null ? "–" : tokens.toFixed(0),
              bytes(e.memory_bytes), String(e.passes), String(e.tokens), String(q.pending || 0), String(q.running || 0)],
    };
  }));
  state.prev = o;
}

// -- a training run: its curves and checkpoints -------------------------------------------------

async function selectRun(id) {
  state.run = id;
  state.points = [];
  state.lastSeq = 0;
  $("run").hidden = false;
  $("run-id").textContent = id;
  $("metric").replaceChildren();
  for (const tr of $("runs-table").querySelectorAll("tbody tr")) tr.classList.toggle("selected", tr.dataset.id === id);
  await Promise.all([loadMetrics(), loadCheckpoints()]);
}

async function loadMetrics() {
  const run = state.run;
  let more = true;
  while (more && run === state.run) {
    const page = await api(`/console/api/training_runs/${enc(run)}/metrics?after_seq=${state.lastSeq}`);
    if (run !== state.run) return;
    state.points.push(...page.points);
    if (page.points.length) state.lastSeq = page.points[page.points.length - 1].seq_id;
    more = page.more;
  }
  updateMetricChoices();
  drawChart();
}

function updateMetricChoices() {
  const names = [...new Set(state.points.flatMap((p) => Object.keys(p.metrics)))].sort();
  const select = $("metric");
  const have = [...select.options].map((o) => o.value);
  if (names.join() === have.join()) return;
  const current = select.value;
  select.replaceChildren(...names.map((n) => el("option", { value: n }, n)));
  const preferred = ["loss:sum", "loss:mean"].find((n) => names.includes(n));
  select.value = names.includes(current) ? current : preferred || names[0] || "";
}

function series(metric) {
  // per request kind: the mean of the metric over the requests of each step
  const byOp = {};
  for (const p of state.points) {
    const v = p.metrics[metric];
    if (v === undefined) continue;
    const steps = (byOp[p.op] ??= new Map());
    const acc = steps.get(p.step) || [0, 0];
    steps.set(p.step, [acc[0] + v, acc[1] + 1]);
  }
  return Object.entries(byOp).map(([op, steps]) => ({
    op, points: [...steps.entries()].sort((a, b) => a[0] - b[0]).map(([s, [sum, n]]) => [s, sum / n]),
  }));
}

function drawChart() {
  const svg = $("chart");
  const NS = "http://www.w3.org/2000/svg";
  const node = (tag, attrs, text) => {
    const n = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
    if (text !== undefined) n.textContent = text;
    return n;
  };
  const metric = $("metric").value;
  const all = metric ? series(metric) : [];
  const pts = all.flatMap((s) => s.points);
  svg.replaceChildren();
  if (!pts.length) {
    svg.append(node("text", { x: 360, y: 150, "text-anchor": "middle" }, "No metrics yet: train a step."));
    $("chart-note").textContent = "";
    return;
  }
  const [W, H, L, R, T, B] = [720, 300, 64, 16, 16, 36];
  let [x0, x1] = [Math.min(...pts.map((p) => p[0])), Math.max(...pts.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...pts.map((p) => p[1])), Math.max(...pts.map((p) => p[1]))];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
  const X = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const Y = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
  for (let i = 0; i <= 4; i++) {
    const y = y0 + ((y1 - y0) * i) / 4;
    svg.append(node("line", { class: "grid", x1: L, x2: W - R, y1: Y(y), y2: Y(y) }),
               node("text", { x: L - 6, y: Y(y) + 4, "text-anchor": "end" }, y.toPrecision(4)));
  }
  // steps are whole numbers: up to 6 whole-number ticks
  const every = Math.max(1, Math.ceil((x1 - x0) / 5));
  for (let x = Math.ceil(x0); x <= x1; x += every) {
    svg.append(node("text", { x: X(x), y: H - B + 16, "text-anchor": "middle" }, String(x)));
  }
  svg.append(node("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }),
             node("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }),
             node("text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle" }, "step"));
  for (const s of all) {
    const d = s.points.map(([x, y]) => `${X(x).toFixed(1)},${Y(y).toFixed(1)}`).join(" ");
    svg.append(node("polyline", { class: `series-${s.op}`, "data-op": s.op, "data-points": s.points.length, points: d }));
    for (const [x, y] of s.points) svg.append(node("circle", { cx: X(x), cy: Y(y), r: 2.5, class: `series-${s.op}` }));
  }
  const last = all.map((s) => `${s.op}: ${s.points[s.points.length - 1][1].toPrecision(5)}`).join(" · ");
  $("chart-note").textContent = `${pts.length} points · last ${last}`;
}

async function loadCheckpoints() {
  const run = state.run;
  const { checkpoints } = await api(`/api/v1/training_runs/${enc(run)}/checkpoints`);
  if (run !== state.run) return;
  const n = fill("ckpt-table", checkpoints.map((c) => ({
    id: c.tinker_path,
    cells: [el("code", {}, c.tinker_path), c.checkpoint_type, bytes(c.size_bytes), when(c.time), actions(run, c)],
  })));
  $("ckpt-empty").hidden = n > 0;
}

function actions(run, c) {
  const files = el("span", { class: "files" });
  const download = async () => {
    try {
      const { files: list } = await api(`/console/api/checkpoint_files?path=${enc(c.tinker_path)}`);
      files.replaceChildren(...list.map((f) => el("a", { href: f.url, download: f.name, class: "file" },
                                                  `${f.name} (${bytes(f.size_bytes)}) `)));
    } catch (e) { files.textContent = e.message; }
  };
  const copy = async (ev) => {
    try { await navigator.clipboard.writeText(c.tinker_path); ev.target.textContent = "Copied"; }
    catch { window.prompt("tinker:// path", c.tinker_path); }
  };
  const remove = async () => {
    if (!window.confirm(`Delete ${c.tinker_path}? This cannot be undone.`)) return;
    try {
      await call(`/api/v1/training_runs/${enc(run)}/checkpoints/${c.checkpoint_id.split("/").map(enc).join("/")}`,
                 { method: "DELETE" });
      await loadCheckpoints();
    } catch (e) { files.textContent = e.message; }
  };
  return el("span", {}, el("button", { onclick: download, class: "download" }, "Download"),
            el("button", { onclick: copy, class: "copy" }, "Copy path"),
            el("button", { onclick: remove, class: "delete" }, "Delete"), files);
}

// -- the playground: the OpenAI-compatible endpoints --------------------------------------------

async function loadModels() {
  try {
    const [models, ckpts] = await Promise.all([(await call("/oai/api/v1/models", {}, true)).json(),
                                               api("/api/v1/checkpoints?limit=1000")]);
    const paths = ckpts.checkpoints.filter((c) => c.checkpoint_type !== "external").map((c) => c.tinker_path);
    const names = [...models.data.map((m) => m.id), ...paths];
    if (names.join() === state.models.join()) return;
    state.models = names;
    const select = $("play-model");
    const current = select.value;
    select.replaceChildren(...names.map((n) => el("option", { value: n }, n)));
    if (names.includes(current)) select.value = current;
  } catch (e) { $("play-error").textContent = e.message; }
}

async function play(ev) {
  ev.preventDefault();
  const chat = $("play-mode").value === "chat";
  const text = $("play-prompt").value;
  const body = { model: $("play-model").value, max_tokens: Number($("play-max").value),
                 temperature: Number($("play-temp").value), stream: true,
                 ...(chat ? { messages: [{ role: "user", content: text }] } : { prompt: text }) };
  const out = $("play-out");
  out.textContent = "";
  delete out.dataset.done;
  $("play-error").textContent = "";
  try {
    const res = await call(`/oai/api/v1/${chat ? "chat/completions" : "completions"}`,
                           { method: "POST", body: JSON.stringify(body), headers: { "content-type": "application/json" } },
                           true);
    const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const line = buffer.slice(0, cut).replace(/^data: /, "");
        buffer = buffer.slice(cut + 2);
        if (line === "[DONE]") continue;
        const choice = JSON.parse(line).choices[0];
        if (choice) out.textContent += (chat ? choice.delta?.content : choice.text) || "";
      }
    }
    out.dataset.done = "true";
  } catch (e) { $("play-error").textContent = e.message; }
}

// -- wiring -------------------------------------------------------------------------------------

$("signin-form").addEventListener("submit", (ev) => { ev.preventDefault(); signIn($("key").value.trim()); });
$("signout").addEventListener("click", signOut);
$("metric").addEventListener("change", drawChart);
$("play-form").addEventListener("submit", play);
for (const b of $("tabs").querySelectorAll("button")) {
  b.addEventListener("click", () => { showTab(b.dataset.tab); if (b.dataset.tab === "playground") loadModels(); });
}
if (state.key) signIn(state.key);
