// The fleet status page: renders each snapshot the gateway sends (server-sent events)
// and keeps a few minutes of them for the charts. No framework, no build step.
"use strict";

const HISTORY = 300; // snapshots kept for the charts (one a second)
const MIN_SPAN = 60; // the charts show at least this many seconds, the newest at the right
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"];

const state = { history: [], snapshots: 0, last: null };
window.natsllmDashboard = state; // for people poking around, and for the browser test

function fmt(value, digits = 1) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  return Number(value).toFixed(digits);
}

function seconds(value) {
  if (value === null || value === undefined) return "–";
  if (value < 60) return `${Math.round(value)}s`;
  if (value < 3600) return `${Math.round(value / 60)}m`;
  return `${(value / 3600).toFixed(1)}h`;
}

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function stateClass(text) {
  if (text === "serving") return "serving";
  if (text === "silent") return "silent";
  return "waiting";
}

// What a replica is doing, in a few words, from the counters its status carries.
function load(service) {
  const i = service.info || {};
  switch (service.service) {
    case "gateway": return `${i.open_requests ?? 0} open requests`;
    case "tokenizer": return `${i.num_requests ?? 0} prompts, ${i.num_rejected ?? 0} refused`;
    case "detokenizer": return `${i.num_outputs ?? 0} outputs`;
    case "scheduler": return `engine ${i.engine_id}: ${i.num_requests_running ?? 0} running, ` +
      `${i.num_requests_waiting ?? 0} waiting, KV ${fmt(100 * (i.kv_cache_usage_perc ?? 0), 0)}%`;
    case "worker": return `engine ${i.engine_id} rank ${i.rank}: ${i.num_steps ?? 0} steps, ` +
      `${i.num_sampled_tokens ?? 0} tokens`;
    default: return "";
  }
}

function renderServices(services) {
  const body = document.querySelector("#services tbody");
  body.replaceChildren();
  for (const s of services) {
    const row = body.insertRow();
    row.dataset.service = s.service;
    row.dataset.state = s.state;
    cell(row, s.service);
    cell(row, s.instance_id);
    cell(row, s.state, `state ${stateClass(s.state)}`);
    cell(row, load(s));
    cell(row, seconds(s.uptime_s), "num");
    cell(row, `${fmt(s.seen_s)}s ago`, "num");
    cell(row, s.host || "");
    cell(row, s.metrics_port ? `:${s.metrics_port}` : (s.service === "gateway" ? "/metrics" : "–"));
  }
  const counts = {};
  for (const s of services) counts[s.service] = (counts[s.service] || 0) + 1;
  document.getElementById("service-count").textContent =
    "(" + Object.entries(counts).map(([k, v]) => `${v} ${k}`).join(", ") + ")";
}

function renderEngines(engines) {
  const body = document.querySelector("#engines tbody");
  body.replaceChildren();
  for (const e of engines) {
    const row = body.insertRow();
    row.dataset.engine = e.engine_id;
    cell(row, e.engine_id);
    cell(row, e.kv_role || "both");
    cell(row, e.ready ? "serving" : "waiting", `state ${e.ready ? "serving" : "waiting"}`);
    cell(row, e.running, "num");
    cell(row, e.waiting, "num");
    cell(row, `${fmt(100 * e.kv_cache_usage, 1)}%`, "num");
    cell(row, e.prefix_hit_rate === null ? "–" : `${fmt(100 * e.prefix_hit_rate, 0)}%`, "num");
    cell(row, e.generation_tokens, "num");
    cell(row, (e.lora_running || []).join(", "));
  }
}

// A line chart of series [{name, values}] over the kept snapshots, on a canvas.
function drawChart(canvas, series) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  canvas.width = width * ratio;
  canvas.height = height * ratio;
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  ctx.clearRect(0, 0, width, height);
  const left = 44, right = 8, top = 18, bottom = 14;
  const values = series.flatMap(s => s.values).filter(v => v !== null && v !== undefined);
  const max = Math.max(1e-9, ...values) * 1.1;
  const digits = max >= 20 ? 0 : max >= 2 ? 1 : 3;
  const points = Math.max(0, ...series.map(s => s.values.length));
  const span = Math.max(MIN_SPAN, points);
  ctx.strokeStyle = "#ddd";
  ctx.fillStyle = "#777";
  ctx.font = "10px sans-serif";
  for (let i = 0; i <= 4; i++) {
    const y = top + (height - top - bottom) * (1 - i / 4);
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(width - right, y); ctx.stroke();
    ctx.fillText(fmt(max * i / 4, digits), 2, y + 3);
  }
  series.forEach((s, k) => {
    ctx.strokeStyle = COLORS[k % COLORS.length];
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let started = false;
    s.values.forEach((v, i) => {
      if (v === null || v === undefined) { started = false; return; }
      const x = left + (width - left - right) * (span - points + i) / Math.max(span - 1, 1);
      const y = top + (height - top - bottom) * (1 - v / max);
      if (started) ctx.lineTo(x, y); else ctx.moveTo(x, y);
      started = true;
    });
    ctx.stroke();
    ctx.fillStyle = COLORS[k % COLORS.length];
    ctx.fillText(s.name, left + 4 + k * 90, 10);
  });
}

function column(path) {
  return state.history.map(snapshot => path(snapshot));
}

function renderCharts() {
  drawChart(document.getElementById("throughput-chart"), [
    { name: "generated", values: column(s => s.throughput.generation_tokens_per_s) },
    { name: "prompt", values: column(s => s.throughput.prompt_tokens_per_s) },
  ]);
  drawChart(document.getElementById("latency-chart"), [
    { name: "TTFT p50", values: column(s => s.latency.ttft_p50) },
    { name: "TTFT p95", values: column(s => s.latency.ttft_p95) },
    { name: "ITL p50", values: column(s => s.latency.itl_p50) },
    { name: "e2e p50", values: column(s => s.latency.e2e_p50) },
  ]);
  drawChart(document.getElementById("requests-chart"), [
    { name: "running", values: column(s => s.engines.reduce((n, e) => n + e.running, 0)) },
    { name: "waiting", values: column(s => s.engines.reduce((n, e) => n + e.waiting, 0)) },
  ]);
}

function render(snapshot) {
  state.last = snapshot;
  state.snapshots += 1;
  state.history.push(snapshot);
  if (state.history.length > HISTORY) state.history.shift();
  document.getElementById("model").textContent = `${snapshot.model} · gateway ${snapshot.gateway_id}`;
  renderServices(snapshot.services);
  renderEngines(snapshot.engines);
  renderCharts();
}

function connect() {
  const connection = document.getElementById("connection");
  const events = new EventSource("/dashboard/events");
  events.onopen = () => { connection.textContent = "live"; connection.className = "state live"; };
  events.onmessage = message => render(JSON.parse(message.data));
  // EventSource reconnects by itself (after a gateway restart too).
  events.onerror = () => { connection.textContent = "reconnecting"; connection.className = "state lost"; };
}

window.addEventListener("resize", renderCharts);
connect();
