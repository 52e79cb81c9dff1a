// agl dashboard: vanilla JS over the JSON API at ./api. Views are chosen by the URL hash; while "live"
// is on, the current view re-reads its data every 2 s and redraws only what changed.
"use strict";

const POLL_MS = 2000;
const STATUSES = ["queuing", "preparing", "running", "requeuing", "succeeded", "failed", "cancelled"];
const TOKEN_KEY = "agl.dashboard.token";

// The token comes once as ?token=..., is kept for this tab only, and leaves the address bar.
(function takeToken() {
  const query = new URLSearchParams(location.search);
  if (query.has("token")) {
    sessionStorage.setItem(TOKEN_KEY, query.get("token"));
    history.replaceState(null, "", location.pathname + location.hash);
  }
})();

class Unauthorized extends Error {}

async function api(path) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const response = await fetch("api/" + path, { headers: token ? { Authorization: "Bearer " + token } : {} });
  const body = await response.json().catch(() => ({}));
  if (response.status === 401) throw new Unauthorized(body.error ? body.error.message : "unauthorized");
  if (!response.ok) throw new Error(body.error ? body.error.message : "HTTP " + response.status);
  return body;
}

// ----- tiny DOM helpers (text always goes through textContent, never innerHTML) -----------------
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else if (key === "class") el.className = value;
    else el.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}
const svgNS = "http://www.w3.org/2000/svg";
function s(tag, attrs, ...children) {
  const el = document.createElementNS(svgNS, tag);
  for (const [key, value] of Object.entries(attrs || {})) el.setAttribute(key, value);
  for (const child of children) el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return el;
}
const badge = (status) => h("span", { class: "badge s-" + status }, status);
const fmtReward = (r) => (r === null || r === undefined ? "–" : Number(r).toFixed(3));
const fmtTime = (t) => (t ? new Date(t * 1000).toLocaleTimeString() : "–");
const fmtMs = (ms) => (ms >= 1000 ? (ms / 1000).toFixed(2) + " s" : ms.toFixed(1) + " ms");
const short = (id) => (id ? String(id).slice(0, 14) : "–");
function preview(value, n = 80) {
  const text = typeof value === "string" ? value : JSON.stringify(value);
  return text && text.length > n ? text.slice(0, n) + "…" : text || "";
}
function pretty(value) {
  if (typeof value === "string") {
    try { return JSON.stringify(JSON.parse(value), null, 2); } catch (e) { return value; }
  }
  return JSON.stringify(value, null, 2);
}

// ----- routing and polling ------------------------------------------------------------------------
const view = document.getElementById("view");
let current = null; // {render, key}: the view on screen and the data it last drew

function route() {
  const [path, query] = (location.hash.slice(1) || "/rollouts").split("?");
  const parts = path.split("/").filter(Boolean);
  const params = new URLSearchParams(query || "");
  document.querySelectorAll("[data-nav]").forEach((a) =>
    a.classList.toggle("active", a.dataset.nav === (parts[0] === "rollout" ? "rollouts" : parts[0])));
  if (parts[0] === "rollout" && parts[1]) return rolloutView(decodeURIComponent(parts[1]), params);
  if (parts[0] === "resources") return resourcesView(parts[1] ? decodeURIComponent(parts[1]) : null);
  if (parts[0] === "curves") return curvesView();
  return rolloutsView(params);
}

async function show(next) {
  current = next; // each view drew its own skeleton; its data comes next
  await refresh(true);
}

async function refresh(force) {
  const mine = current;
  if (!mine) return;
  try {
    const [data, summary] = await Promise.all([mine.load(), api("summary")]);
    hideBanner();
    drawCounts(summary.statistics);
    document.getElementById("updated").textContent = new Date().toLocaleTimeString();
    const key = JSON.stringify(data);
    if (mine !== current || (!force && key === mine.key)) return; // nothing new: keep scroll and selection
    mine.key = key;
    mine.draw(data);
  } catch (err) {
    if (err instanceof Unauthorized) askToken(err.message);
    else showBanner("Could not load: " + err.message);
  }
}

function drawCounts(stats) {
  const by = stats.rollouts_by_status || {};
  const total = Object.values(by).reduce((a, b) => a + b, 0);
  document.getElementById("counts").textContent =
    `${total} rollouts · ` + STATUSES.filter((k) => by[k]).map((k) => `${by[k]} ${k}`).join(" · ") +
    ` · ${stats.spans} spans · ${stats.resources} resources versions`;
}

const banner = document.getElementById("banner");
function showBanner(...content) { banner.replaceChildren(...content); banner.hidden = false; }
function hideBanner() { banner.hidden = true; }
function askToken(message) {
  if (!banner.hidden && document.getElementById("token-input")) return; // keep what is being typed
  const input = h("input", { type: "password", placeholder: "store token", id: "token-input" });
  const save = () => { sessionStorage.setItem(TOKEN_KEY, input.value); hideBanner(); refresh(true); };
  showBanner(h("b", {}, "This store needs a token. "), message + " ", input, " ", h("button", { onclick: save }, "Use token"));
}

// ----- rollouts list ------------------------------------------------------------------------------
function rolloutsView(params) {
  const statuses = new Set((params.get("status") || "").split(",").filter(Boolean));
  const mode = params.get("mode") || "";
  const cursors = [null]; // cursors of the pages seen, for "newer"
  let page = 0;
  let next = null;
  const go = (changes) => {
    const q = new URLSearchParams({ status: [...statuses].join(","), mode, ...changes });
    for (const [k, v] of [...q]) if (!v) q.delete(k);
    location.hash = "#/rollouts" + (q.toString() ? "?" + q : "");
  };
  const chips = STATUSES.map((st) => h("button", {
    class: "chip" + (statuses.has(st) ? " on" : ""), "data-status": st,
    onclick: () => { statuses.has(st) ? statuses.delete(st) : statuses.add(st); go({}); },
  }, st));
  const modeSelect = h("select", { id: "mode", onchange: (e) => go({ mode: e.target.value }) },
    ["", "train", "val", "test"].map((m) => h("option", { value: m, selected: m === mode }, m || "all modes")));
  const body = h("tbody");
  const older = h("button", { id: "older", disabled: true, onclick: () => { cursors.push(next); page += 1; refresh(true); } }, "Older →");
  const newer = h("button", { id: "newer", disabled: true, onclick: () => { cursors.pop(); page -= 1; refresh(true); } }, "← Newer");
  const pageLabel = h("span", { class: "mute" });
  view.replaceChildren(
    h("h2", {}, "Rollouts"),
    h("div", { class: "filters" }, h("span", { class: "mute" }, "status:"), chips,
      statuses.size ? h("button", { class: "chip", onclick: () => { statuses.clear(); go({}); } }, "clear") : null,
      h("span", { class: "mute" }, " mode:"), modeSelect),
    h("table", { id: "rollouts" },
      h("thead", {}, h("tr", {}, ["rollout", "status", "mode", "reward", "attempts", "resources", "created", "input"].map((c) => h("th", {}, c)))),
      body),
    h("div", { class: "pager" }, newer, older, pageLabel));
  return {
    load: () => api("rollouts?" + new URLSearchParams({ status: [...statuses].join(","), mode, limit: 50, cursor: cursors[cursors.length - 1] || "" })),
    draw: (data) => {
      next = data.next_cursor;
      older.disabled = !next;
      newer.disabled = page === 0;
      pageLabel.textContent = `page ${page + 1}`;
      body.replaceChildren(...data.items.map((r) => h("tr", {
        class: "link", "data-rollout": r.rollout_id, onclick: () => { location.hash = "#/rollout/" + encodeURIComponent(r.rollout_id); },
      },
        h("td", { class: "mono" }, r.rollout_id), h("td", {}, badge(r.status)), h("td", {}, r.mode),
        h("td", { class: "reward" }, fmtReward(r.reward)), h("td", {}, r.num_attempts),
        h("td", { class: "mono" }, short(r.resources_id)), h("td", {}, fmtTime(r.created_at)),
        h("td", { class: "mono mute" }, preview(r.input)))));
      if (!data.items.length) body.append(h("tr", {}, h("td", { colspan: 8, class: "empty" }, "No rollouts match.")));
    },
  };
}

// ----- one rollout: attempts, span tree + waterfall, transcript -------------------------------------
function rolloutView(rolloutId, params) {
  let attemptId = params.get("attempt") || "";
  let selected = null;
  view.replaceChildren(h("div", { class: "empty" }, "loading…"));
  return {
    load: () => api("rollouts/" + encodeURIComponent(rolloutId) + (attemptId ? "?attempt_id=" + encodeURIComponent(attemptId) : "")),
    draw: (data) => {
      const r = data.rollout;
      const attempts = h("table", { id: "attempts" },
        h("thead", {}, h("tr", {}, ["#", "attempt", "status", "worker", "started", "ended", "error"].map((c) => h("th", {}, c)))),
        h("tbody", {}, data.attempts.map((a) => h("tr", {
          class: "link" + (a.attempt_id === data.attempt_id ? " selected" : ""),
          onclick: () => { attemptId = a.attempt_id; refresh(true); },
        }, h("td", {}, a.attempt_number), h("td", { class: "mono" }, a.attempt_id), h("td", {}, badge(a.status)),
          h("td", { class: "mono" }, a.worker_id || "–"), h("td", {}, fmtTime(a.started_at)), h("td", {}, fmtTime(a.ended_at)),
          h("td", { class: "mono" }, a.error ? preview(a.error, 120) : "")))));
      view.replaceChildren(
        h("h2", {}, h("a", { href: "#/rollouts" }, "Rollouts"), " / ", h("span", { class: "mono" }, r.rollout_id), " ", badge(r.status)),
        h("div", { class: "panel kv" },
          h("span", {}, "reward"), h("span", { class: "reward", id: "rollout-reward" }, fmtReward(r.reward)),
          h("span", {}, "mode"), h("span", {}, r.mode),
          h("span", {}, "resources"), h("span", { class: "mono" }, r.resources_id
            ? h("a", { href: "#/resources/" + encodeURIComponent(r.resources_id) }, r.resources_id) : "–"),
          h("span", {}, "group"), h("span", { class: "mono" }, r.group_id || "–"),
          h("span", {}, "created / ended"), h("span", {}, fmtTime(r.created_at) + " / " + fmtTime(r.ended_at)),
          h("span", {}, "input"), h("pre", {}, pretty(r.input))),
        h("h3", {}, `Attempts (${data.attempts.length})`), attempts,
        h("h3", {}, `Span tree and timeline (${data.spans_truncated ? "the first " : ""}${data.spans.length} span${data.spans.length === 1 ? "" : "s"})`),
        data.spans.length ? traceTable(data.spans, (id) => { selected = id; flash(id); }) : h("div", { class: "empty" }, "No spans."),
        h("h3", {}, "Transcript"),
        h("div", { id: "transcript" }, data.spans.filter((sp) => sp.category !== "other" && sp.category !== "llm_trace")
          .sort((a, b) => a.start_ns - b.start_ns || a.sequence_id - b.sequence_id).map(card)));
      if (selected) flash(selected, false);
    },
  };
}

function traceTable(spans, onSelect) {
  const t0 = Math.min(...spans.map((sp) => sp.start_ns));
  const t1 = Math.max(...spans.map((sp) => sp.end_ns));
  const total = Math.max(t1 - t0, 1);
  return h("table", { class: "trace", id: "trace" },
    h("thead", {}, h("tr", {}, h("th", {}, "span"), h("th", {}, "duration"), h("th", {}, `timeline (${fmtMs(total / 1e6)})`))),
    h("tbody", {}, spans.map((sp) => h("tr", { class: "link", "data-span": sp.span_id, onclick: () => onSelect(sp.span_id) },
      h("td", { class: "name", style: `padding-left:${8 + sp.depth * 18}px` },
        h("span", { class: "cat c-" + sp.category }), spanLabel(sp), sp.status === "error" ? [" ", badge("error")] : null),
      h("td", { class: "mute" }, fmtMs(sp.duration_ms)),
      h("td", { class: "bar-cell" }, h("div", {
        class: "bar c-" + sp.category,
        style: `left:${(100 * (sp.start_ns - t0)) / total}%;width:${(100 * (sp.end_ns - sp.start_ns)) / total}%`,
      }))))));
}

function spanLabel(sp) {
  const d = sp.detail;
  if (sp.category === "reward") return `${sp.name} = ${fmtReward(d.value)}`;
  if (sp.category === "llm") return `${sp.name} ${d.model || ""}`;
  if (sp.category === "llm_trace") return `${sp.name} ${d.model || ""} (client trace)`;
  if (sp.category === "operation") return d.name && d.name !== sp.name ? `${sp.name} ${d.name}` : sp.name;
  if (sp.category === "message") return `${sp.name}: ${preview(d.text, 40)}`;
  return sp.name;
}

function flash(spanId, scroll = true) {
  document.querySelectorAll(".card.flash, tr.selected[data-span]").forEach((el) => el.classList.remove("flash", "selected"));
  const row = document.querySelector(`tr[data-span="${spanId}"]`);
  if (row) row.classList.add("selected");
  const target = document.getElementById("span-" + spanId);
  if (target) { target.classList.add("flash"); if (scroll) target.scrollIntoView({ behavior: "smooth", block: "center" }); }
}

function message(m) {
  return h("div", { class: "msg " + m.role },
    h("div", { class: "role" }, m.role + (m.tool_call_id ? ` (${m.tool_call_id})` : "")),
    m.content ? h("pre", {}, m.content) : null,
    (m.tool_calls || []).map(toolCall));
}
const toolCall = (c) => h("div", { class: "tool-call" }, h("b", {}, "tool call "),
  `${c.name}(${typeof c.arguments === "string" ? c.arguments : JSON.stringify(c.arguments)})`);

function card(sp) {
  const d = sp.detail;
  const head = (title, extra) => h("div", { class: "title" }, title, extra ? h("span", { class: "mute" }, "  " + extra) : null);
  let body;
  if (sp.category === "llm") {
    const usage = d.usage && d.usage.total_tokens ? `${d.usage.prompt_tokens}+${d.usage.completion_tokens} tokens` : "";
    body = [head("LLM call · " + (d.model || "?"), [usage, fmtMs(sp.duration_ms), d.finish_reason].filter(Boolean).join(" · ")),
      d.messages.map(message),
      d.response ? message(d.response) : null,
      !d.response && d.tool_calls.length ? d.tool_calls.map(toolCall) : null,
      d.error ? h("pre", { class: "mute" }, "error: " + preview(d.error, 400)) : null];
  } else if (sp.category === "reward") {
    const values = Object.entries(d.values || {});
    const extra = values.length > 1 ? values.map(([k, v]) => `${k}=${fmtReward(v)}`).join("  ") : "";
    body = [head("Reward", extra), h("div", { class: "big-reward" }, fmtReward(d.value))];
  } else if (sp.category === "message") {
    body = [head("Message"), h("pre", {}, d.text || "")];
  } else if (sp.category === "operation") {
    body = [head("Operation · " + d.name), h("div", { class: "tool-call" }, h("b", {}, "in "), preview(d.input, 400)),
      d.output !== null && d.output !== undefined ? h("div", { class: "tool-call" }, h("b", {}, "out "), preview(d.output, 400)) : null];
  } else if (sp.category === "exception") {
    body = [head("Exception · " + d.type, d.message), h("pre", { class: "mute" }, d.stacktrace || "")];
  } else {
    body = [head(sp.name), h("pre", {}, pretty(d.value))];
  }
  return h("div", { class: "card " + sp.category, id: "span-" + sp.span_id }, body);
}

// ----- resources versions and prompt diffs --------------------------------------------------------
function resourcesView(selectedId) {
  return {
    load: async () => {
      const list = await api("resources");
      const id = selectedId || (list.items[0] && list.items[0].resources_id);
      const diff = id ? await api("resources/" + encodeURIComponent(id) + "/diff") : null;
      return { list, id, diff };
    },
    draw: ({ list, id, diff }) => {
      const chosen = list.items.find((v) => v.resources_id === id);
      view.replaceChildren(
        h("h2", {}, "Resources versions"),
        h("table", { id: "versions" },
          h("thead", {}, h("tr", {}, ["version", "resources", "APO round", "val reward", "train reward", "parent", "created"].map((c) => h("th", {}, c)))),
          h("tbody", {}, list.items.map((v) => h("tr", {
            class: "link" + (v.resources_id === id ? " selected" : ""), "data-resources": v.resources_id,
            onclick: () => { location.hash = "#/resources/" + encodeURIComponent(v.resources_id); },
          }, h("td", {}, "v" + v.version), h("td", { class: "mono" }, v.resources_id),
            h("td", {}, v.apo ? v.apo.round : "–"), h("td", { class: "reward" }, fmtReward(v.val_reward)),
            h("td", { class: "reward" }, fmtReward(v.train_reward)), h("td", { class: "mono" }, short(v.diff_parent_id)),
            h("td", {}, fmtTime(v.created_at)))))),
        chosen ? versionDetail(chosen, diff) : h("div", { class: "empty" }, "No resources versions yet."));
    },
  };
}

function versionDetail(v, diff) {
  return h("div", { id: "version-detail" },
    h("h3", {}, `v${v.version} · ${v.resources_id}`),
    v.apo && v.apo.critique ? h("div", { class: "panel" }, h("b", {}, "APO critique: "), h("pre", {}, v.apo.critique)) : null,
    h("h3", {}, diff.against ? ["Changes against ", h("a", { href: "#/resources/" + encodeURIComponent(diff.against), class: "mono" }, diff.against)] : "First version: everything is new"),
    diff.diff.map((d) => h("div", { class: "panel" },
      h("div", { class: "title" }, h("b", {}, d.name), h("span", { class: "mute" }, `  ${d.resource_type || ""}${d.changed ? "" : " · unchanged"}`)),
      d.changed ? h("div", { class: "diff" }, d.lines.map((l) => h("div", { class: l.op === "+" ? "add" : l.op === "-" ? "del" : "same" }, l.text || " "))) : null)));
}

// ----- curves: reward by version, reward over time, metrics.csv ------------------------------------
function curvesView() {
  return {
    load: async () => {
      const [curves, metrics] = await Promise.all([api("curves"), api("metrics")]);
      return { curves, metrics };
    },
    draw: ({ curves, metrics }) => {
      const byVersion = curves.by_version.filter((row) => row.version !== null);
      const versionSeries = ["train", "val"].map((mode, i) => ({
        name: mode + " mean reward", color: i ? "#2db36b" : "#2f6fde",
        points: byVersion.filter((row) => row[mode + "_mean"] !== null).map((row) => [row.version, row[mode + "_mean"]]),
      })).filter((sr) => sr.points.length);
      const modes = [...new Set(curves.points.map((p) => p.mode))];
      const colors = ["#2f6fde", "#2db36b", "#e69a3b", "#b07ae0"];
      const timeSeries = modes.map((mode, i) => ({
        name: mode, color: colors[i % colors.length], dots: true,
        points: curves.points.filter((p) => p.mode === mode).map((p) => [p.t, p.reward]),
      }));
      const metricCharts = metrics.runs.flatMap((run) => run.columns.filter((c) => c !== "step").map((column) =>
        chart(`${run.name}: ${column}`, [{ name: column, color: "#2f6fde",
          points: run.rows.filter((row) => row[column] !== null && row.step !== null).map((row) => [row.step, row[column]]) }], "step")));
      view.replaceChildren(
        h("h2", {}, "Training curves"),
        h("div", { class: "charts" },
          chart("Mean reward per resources version", versionSeries, "resources version", (v) => "v" + v, true),
          chart("Reward of finished rollouts over time", timeSeries, "time", fmtTime)),
        h("h3", {}, "Per-step metrics (metrics.csv)"),
        metricCharts.length ? h("div", { class: "charts", id: "metric-charts" }, metricCharts)
          : h("div", { class: "empty" }, metrics.configured ? "No metrics.csv yet in the metrics directory."
            : "Start the server with --metrics-dir DIR (a training output directory) to chart its metrics.csv."));
    },
  };
}

function niceTicks(lo, hi, n = 5) {
  if (lo === hi) { lo -= 1; hi += 1; }
  const raw = (hi - lo) / n;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((st) => st >= raw);
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(+t.toPrecision(12));
  return ticks;
}

// A line (or dot) chart drawn as inline SVG; series are [{name, color, points: [[x, y]], dots}].
function chart(title, series, xLabel, xFormat, integerX) {
  const W = 440, H = 230, L = 48, R = 12, T = 10, B = 34;
  const all = series.flatMap((sr) => sr.points);
  const box = h("div", { class: "panel chart", "data-title": title }, h("div", { class: "title" }, h("b", {}, title)));
  if (!all.length) return box.appendChild(h("div", { class: "empty" }, "No data yet.")) && box;
  let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
  const pad = (y1 - y0) * 0.08; y0 -= pad; y1 += pad;
  const X = (x) => L + 8 + ((x - x0) / (x1 - x0)) * (W - L - R - 16);
  const Y = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const svg = s("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
  for (const t of niceTicks(y0, y1)) {
    svg.append(s("line", { class: "grid", x1: L, x2: W - R, y1: Y(t), y2: Y(t) }),
      s("text", { x: L - 6, y: Y(t) + 4, "text-anchor": "end" }, +t.toFixed(4)));
  }
  const shown = new Set(); // ticks finer than the format (seconds of a short run) would repeat a label
  for (const t of niceTicks(x0, x1, 4).filter((t) => !integerX || Number.isInteger(t))) {
    const label = xFormat ? xFormat(t) : String(+t.toFixed(4));
    if (shown.has(label)) continue;
    shown.add(label);
    svg.append(s("text", { x: X(t), y: H - B + 16, "text-anchor": "middle" }, label));
  }
  svg.append(s("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }),
    s("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }),
    s("text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle" }, xLabel));
  for (const sr of series) {
    const pts = [...sr.points].sort((a, b) => a[0] - b[0]);
    if (sr.dots) {
      for (const [x, y] of pts) svg.append(s("circle", { cx: X(x), cy: Y(y), r: 3, fill: sr.color, "fill-opacity": 0.6 }));
    } else {
      svg.append(s("polyline", { points: pts.map(([x, y]) => `${X(x)},${Y(y)}`).join(" "), fill: "none", stroke: sr.color, "stroke-width": 2 }));
      for (const [x, y] of pts) svg.append(s("circle", { cx: X(x), cy: Y(y), r: 3, fill: sr.color }));
    }
  }
  box.append(svg, h("div", { class: "legend" }, series.map((sr) => h("span", {}, h("span", { style: `color:${sr.color}` }, "●"), " " + sr.name))));
  return box;
}

// ----- start ---------------------------------------------------------------------------------------
window.addEventListener("hashchange", () => show(route()));
setInterval(() => { if (document.getElementById("live").checked) refresh(false); }, POLL_MS);
show(route());
