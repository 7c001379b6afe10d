"""The swarm health page: one self-contained HTML document, no external assets (no CDN).

The page carries the current ``/status.json`` document inline and draws everything from it with
inline JavaScript: the stage map with the bottleneck, a table of peers, and SVG plots of loss and
tokens/s over time. It then re-reads ``status.json`` every few seconds and redraws. Every string
from the network (peer ids, versions) reaches the page as data and is inserted with
``textContent``, never as markup, and the inline JSON has ``<`` escaped, so a hostile record cannot
inject script.
"""

from __future__ import annotations

import json
from typing import Any

REFRESH_PERIOD = 3.0  # seconds between the page's reloads of status.json


def embed_json(doc: Any) -> str:
    """``doc`` as JSON that is safe inside a ``<script>`` element (no ``</script>``, no ``<!--``)."""
    text = json.dumps(doc, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_health_page(doc: dict[str, Any]) -> str:
    """The HTML page for the ``/status.json`` document ``doc`` (see :func:`peer.status.swarm.swarm_status`)."""
    return (_PAGE.replace("__DATA__", embed_json(doc))
            .replace("__REFRESH_MS__", str(int(REFRESH_PERIOD * 1000))))


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Murmuration swarm health</title>
<style>
body { font: 14px/1.4 system-ui, "DejaVu Sans", sans-serif; margin: 0; background: #f4f5f7; color: #1d2330; }
header { background: #1d2330; color: #fff; padding: 10px 20px; display: flex; gap: 24px; align-items: baseline; }
header h1 { font-size: 18px; margin: 0; }
header .sub { color: #aab3c5; font-size: 12px; }
main { padding: 14px 20px; }
section { background: #fff; border-radius: 6px; padding: 10px 14px; margin-bottom: 14px; box-shadow: 0 1px 2px #0002; }
h2 { font-size: 15px; margin: 0 0 8px; }
.cards { display: flex; gap: 12px; flex-wrap: wrap; }
.card { background: #fff; border-radius: 6px; padding: 8px 14px; min-width: 130px; box-shadow: 0 1px 2px #0002; }
.card .v { font-size: 22px; font-weight: 600; }
.card .k { font-size: 12px; color: #5a6478; }
.stages { display: flex; gap: 10px; flex-wrap: wrap; }
.stage { border: 2px solid #c9d1e0; border-radius: 6px; padding: 8px 10px; min-width: 200px; flex: 1; }
.stage.bottleneck { border-color: #d9534f; background: #fff5f5; }
.stage .title { font-weight: 600; }
.stage .tag { color: #d9534f; font-size: 12px; font-weight: 600; margin-left: 6px; }
.bar { height: 8px; background: #e3e8f0; border-radius: 4px; margin: 6px 0; }
.bar > div { height: 8px; background: #3b7dd8; border-radius: 4px; }
.stage.bottleneck .bar > div { background: #d9534f; }
.chip { display: inline-block; font: 12px monospace; background: #eef2f8; border-radius: 3px; padding: 1px 5px; margin: 2px 3px 0 0; }
.plots { display: flex; gap: 14px; flex-wrap: wrap; }
.plot { flex: 1; min-width: 360px; }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid #e3e8f0; }
th { color: #5a6478; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.state { border-radius: 3px; padding: 1px 6px; font-size: 12px; color: #fff; }
.state-training { background: #2e9d57; } .state-syncing { background: #3b7dd8; }
.state-joining { background: #c79a16; } .state-leaving { background: #8a8f99; } .state-paused { background: #8e44ad; }
.mono { font-family: monospace; }
.legend { font-size: 12px; color: #5a6478; display: flex; gap: 14px; margin-left: 58px; }
.swatch { display: inline-block; width: 22px; vertical-align: middle; margin-right: 5px; }
.muted { color: #8a93a6; }
.sample { font: 13px/1.5 monospace; white-space: pre-wrap; }
.sample .prompt { font-weight: 600; }
</style></head>
<body>
<header><h1>Murmuration swarm health</h1><span class="sub" id="subtitle">loading…</span></header>
<main>
<div class="cards" id="cards"></div>
<section><h2>Stage map</h2><div class="stages" id="stage-map"></div></section>
<section><h2>Over time</h2><div class="plots">
  <div class="plot"><div class="muted">loss (nats/token): training, last stage (solid); held-out, through the pipeline (dashed)</div><svg id="plot-loss" width="100%" height="190" viewBox="0 0 560 190"></svg></div>
  <div class="plot"><div class="muted">tokens/s</div><svg id="plot-throughput" width="100%" height="190" viewBox="0 0 560 190"></svg><div class="legend" id="legend"></div></div>
</div></section>
<section id="sample-section" hidden><h2>What the model writes</h2><div class="sample" id="sample"></div></section>
<section><h2>Peers</h2><table><thead><tr><th>peer</th><th>stage</th><th>state</th><th>role</th><th>version</th>
<th>tokens/s</th><th>loss</th><th>samples</th><th>step</th><th>sent</th><th>received</th></tr></thead>
<tbody id="peers"></tbody></table></section>
</main>
<script id="initial-data" type="application/json">__DATA__</script>
<script>
"use strict";
const STAGE_COLORS = ["#3b7dd8", "#e07b1a", "#2e9d57", "#9b59b6", "#d9534f", "#17a2b8", "#8c6d31", "#e377c2"];
const LOSS_COLOR = "#1f5fbf";
const SVG_NS = "http://www.w3.org/2000/svg";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}
function svg(tag, attrs) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}
function fmt(x, digits) {
  if (x === null || x === undefined) return "–";
  return Number(x).toLocaleString("en-US", {maximumFractionDigits: digits === undefined ? 0 : digits});
}
function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}
function shortId(id) { return id ? "…" + id.slice(-8) : "–"; }

function renderCards(doc) {
  const cards = document.getElementById("cards");
  const b = doc.bottleneck;
  const items = [
    [fmt(doc.totals.tokens_per_s), "swarm tokens/s"],
    [fmt(doc.totals.loss, 3), "loss (last stage)"],
    [doc.totals.num_training + " / " + doc.totals.num_peers, "peers training / live"],
    [b === null ? "–" : "stage " + b, "bottleneck"],
  ];
  cards.replaceChildren(...items.map(([v, k]) => el("div", {class: "card"}, el("div", {class: "v"}, v), el("div", {class: "k"}, k))));
}

function renderStageMap(doc) {
  const map = document.getElementById("stage-map");
  const top = Math.max(1, ...doc.stages.map(s => s.capacity_tokens_per_s));
  map.replaceChildren(...doc.stages.map(s => {
    const isBottleneck = s.stage === doc.bottleneck;
    const title = el("div", {class: "title"}, "stage " + s.stage);
    if (isBottleneck) title.append(el("span", {class: "tag"}, "BOTTLENECK"));
    const bar = el("div", {class: "bar"}, el("div", {style: "width:" + (100 * s.capacity_tokens_per_s / top).toFixed(1) + "%"}));
    const chips = el("div", {}, ...s.peer_ids.map(id => el("span", {class: "chip", title: id}, id)));
    return el("div", {class: "stage" + (isBottleneck ? " bottleneck" : ""), "data-stage": s.stage},
      title,
      el("div", {}, s.num_peers + " peers (" + s.num_training + " training)"),
      el("div", {}, fmt(s.tokens_per_s) + " tokens/s measured"),
      bar,
      el("div", {class: "muted"}, fmt(s.capacity_tokens_per_s) + " tokens/s capacity"),
      chips);
  }));
}

function renderPeers(doc) {
  const body = document.getElementById("peers");
  const local = doc.local && doc.local.peer_id;
  body.replaceChildren(...doc.peers.map(p => el("tr", {"data-peer": p.peer_id},
    el("td", {class: "mono", title: p.peer_id}, p.peer_id + (p.peer_id === local ? " (this peer)" : "")),
    el("td", {class: "num"}, p.stage < 0 ? "–" : p.stage),
    el("td", {}, el("span", {class: "state state-" + p.state}, p.state)),
    el("td", {}, p.role),
    el("td", {}, p.software_version || "–"),
    el("td", {class: "num"}, fmt(p.tokens_per_s)),
    el("td", {class: "num"}, fmt(p.loss, 3)),
    el("td", {class: "num"}, fmt(p.num_samples)),
    el("td", {class: "num"}, fmt(p.step)),
    el("td", {class: "num"}, bytes(p.bytes_sent)),
    el("td", {class: "num"}, bytes(p.bytes_received)))));
}

function plot(id, times, series) {
  const root = document.getElementById(id);
  const W = 560, H = 190, L = 58, R = 10, T = 10, B = 24;
  const values = series.flatMap(s => s.values).filter(v => v !== null && isFinite(v));
  root.replaceChildren(svg("rect", {x: L, y: T, width: W - L - R, height: H - T - B, fill: "#fafbfd", stroke: "#c9d1e0"}));
  if (times.length < 2 || values.length < 2) {
    const text = svg("text", {x: W / 2, y: H / 2, "text-anchor": "middle", fill: "#8a93a6", "font-size": 13});
    text.textContent = "collecting data…";
    root.append(text);
    return;
  }
  let lo = Math.min(...values), hi = Math.max(...values);
  if (hi - lo < 1e-9) { hi += 1; lo = Math.max(0, lo - 1); }
  const t0 = times[0], t1 = times[times.length - 1];
  const x = t => L + (W - L - R) * (t - t0) / (t1 - t0);
  const y = v => T + (H - T - B) * (1 - (v - lo) / (hi - lo));
  for (const [v, label] of [[hi, fmt(hi, hi < 10 ? 2 : 0)], [lo, fmt(lo, lo < 10 ? 2 : 0)]]) {
    const text = svg("text", {x: L - 6, y: y(v) + 4, "text-anchor": "end", fill: "#5a6478", "font-size": 11});
    text.textContent = label;
    root.append(text);
  }
  const span = svg("text", {x: W - R, y: H - 6, "text-anchor": "end", fill: "#5a6478", "font-size": 11});
  span.textContent = "last " + Math.round(t1 - t0) + " s";
  root.append(span);
  for (const s of series) {
    const points = times.map((t, i) => [t, s.values[i]]).filter(([, v]) => v !== null && isFinite(v));
    if (points.length < 2) continue;
    root.append(svg("polyline", {points: points.map(([t, v]) => x(t).toFixed(1) + "," + y(v).toFixed(1)).join(" "),
      fill: "none", stroke: s.color, "stroke-width": s.width || 2, "stroke-linejoin": "round",
      "stroke-dasharray": s.dash || "none", class: "series"}));
  }
}

function renderLegend(numStages) {
  const swatch = (color, dashed) => el("span", {class: "swatch", style: "border-top: 3px " + (dashed ? "dashed " : "solid ") + color}, "");
  const items = [el("span", {}, swatch("#111", true), "swarm (last stage)")];
  for (let k = 0; k < numStages; k++) items.push(el("span", {}, swatch(STAGE_COLORS[k % STAGE_COLORS.length], false), "stage " + k));
  document.getElementById("legend").replaceChildren(...items);
}

function renderSample(sample) {
  document.getElementById("sample-section").hidden = !sample;
  if (!sample) return;
  const age = Math.round(sample.age_s / 60);
  document.getElementById("sample").replaceChildren(
    el("span", {class: "prompt"}, sample.prompt), el("span", {}, sample.text),
    el("div", {class: "muted"}, "step " + sample.step + " · " + (age < 1 ? "less than a minute" : age + " min") + " ago · the newest state of every stage, a fixed prompt and seed"));
}

function render(doc) {
  const local = doc.local;
  const who = local ? "served by peer " + shortId(local.peer_id) + " (" + (local.activity || "stage " + local.stage + ", " + local.state) + ")" : "served by the bootstrap";
  document.getElementById("subtitle").textContent = "run " + doc.run_id + " · " + doc.num_stages + " stages · " + who +
    " · updated " + new Date(doc.time * 1000).toLocaleTimeString();
  renderCards(doc);
  renderStageMap(doc);
  renderPeers(doc);
  const times = doc.history.map(p => p.t);
  plot("plot-loss", times, [{values: doc.history.map(p => p.loss), color: LOSS_COLOR, width: 2.5},
                            {values: doc.history.map(p => p.val_loss === undefined ? null : p.val_loss), color: LOSS_COLOR, width: 2, dash: "6 4"}]);
  const perStage = Array.from({length: doc.num_stages}, (_, k) => ({
    values: doc.history.map(p => p.stage_tokens_per_s[k] === undefined ? null : p.stage_tokens_per_s[k]),
    color: STAGE_COLORS[k % STAGE_COLORS.length], width: 1.5}));
  plot("plot-throughput", times, [...perStage, {values: doc.history.map(p => p.tokens_per_s), color: "#111", width: 2, dash: "6 4"}]);
  renderLegend(doc.num_stages);
  renderSample(doc.sample);
  document.body.setAttribute("data-rendered", "yes");
}

render(JSON.parse(document.getElementById("initial-data").textContent));
setInterval(() => {
  fetch("status.json", {cache: "no-store"}).then(r => r.ok ? r.json() : null).then(doc => { if (doc) render(doc); })
    .catch(() => { document.getElementById("subtitle").textContent += " · (connection lost)"; });
}, __REFRESH_MS__);
</script>
</body></html>
"""
