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
// replaceChildren without the null/false placeholders of optional parts (it would print "null")
const fill = (el, ...children) => el.replaceChildren(...children.flat(Infinity).filter((c) => c !== null && c !== undefined && c !== false));
const badge = (status) => h("span", { class: "badge s-" + status }, status);
// What GRPO does with a group: a validation (or test) group is never trained, whatever its rewards.
// The group page's own badge (long) explains zero variance.
function groupBadge(mode, zeroVariance, trained, long) {
  if (mode && mode !== "train") return h("span", { class: "badge s-cancelled not-trained" }, (mode === "val" ? "validation" : mode) + ": not trained");
  if (zeroVariance) return h("span", { class: "badge s-failed", id: long ? "zero-variance" : null }, "skipped: zero variance" + (long ? " (every reward equal, no learning signal)" : ""));
  return h("span", { class: "badge s-succeeded" }, trained || "trained");
}
// A reward's colour: green above 0, red below, grey at 0 or none (a 0 is no success).
const rewardTone = (r) => (r === null || r === undefined || Number(r) === 0 ? "zero" : Number(r) > 0 ? "pos" : "neg");
const fmtReward = (r) => (r === null || r === undefined ? "–" : Number(r).toFixed(3));
const pad2 = (n) => String(n).padStart(2, "0");
// Times carry their date (runs span days); the same clock everywhere: local time, 24 h.
function fmtTime(t) {
  if (!t) return "–";
  const d = new Date(t * 1000);
  return `${d.getFullYear()}-${pad2(d.getMonth() + 1)}-${pad2(d.getDate())} ${pad2(d.getHours())}:${pad2(d.getMinutes())}:${pad2(d.getSeconds())}`;
}
const fmtMs = (ms) => (ms >= 1000 ? (ms / 1000).toFixed(2) + " s" : ms.toFixed(1) + " ms");
function fmtDur(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  if (seconds < 60) return fmtMs(seconds * 1000);
  const m = Math.floor(seconds / 60);
  return m < 60 ? `${m} min ${Math.round(seconds - m * 60)} s` : `${Math.floor(m / 60)} h ${m % 60} min`;
}
const fmtNum = (v, digits = 3) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits));
// An id in a narrow column: the whole id is the text (what a copy gets); a long one is cut on screen
// with an ellipsis by CSS, and its title shows it in full.
const idText = (id) => (id ? h("span", { class: "mono id", title: String(id) }, String(id)) : "–");
// a rollout with no task: production traffic the gateway recorded has its conversation, not an input
function noInput(r) { return r.mode === "online" ? "– (a recorded conversation)" : "–"; }
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
    a.classList.toggle("active", a.dataset.nav === ({ rollout: "rollouts", group: "rollouts", step: "curves", task: "changes" }[parts[0]] || parts[0])));
  if (parts[0] === "rollout" && parts[1]) return rolloutView(decodeURIComponent(parts[1]), params);
  if (parts[0] === "group" && parts[1]) return groupView(decodeURIComponent(parts[1]));
  if (parts[0] === "step" && parts[1]) return stepView(decodeURIComponent(parts[1]), params.get("run"));
  if (parts[0] === "resources") return resourcesView(parts[1] ? decodeURIComponent(parts[1]) : null, params.get("against"));
  if (parts[0] === "curves") return curvesView();
  if (parts[0] === "changes") return changesView(params);
  if (parts[0] === "task" && parts[1]) return taskView(decodeURIComponent(parts[1]), params.get("mode"));
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
    document.getElementById("updated").textContent = fmtTime(Date.now() / 1000).slice(11);
    const key = JSON.stringify(data);
    if (mine !== current || (!force && key === mine.key)) return; // nothing new: keep scroll and selection
    mine.key = key;
    mine.draw(data);
  } catch (err) {
    if (err instanceof Unauthorized) askToken(err.message);
    else {
      showBanner("Could not load: " + err.message);
      // a view that never drew (an unknown rollout id) says so instead of "loading…"
      if (mine === current && mine.key === undefined) fill(view, h("div", { class: "empty error", id: "load-error" }, "Could not load: " + err.message));
    }
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

// ----- rollouts list: search, sort and filters ------------------------------------------------------
function rolloutsView(params) {
  const statuses = new Set((params.get("status") || "").split(",").filter(Boolean));
  const f = {};
  for (const k of ["mode", "q", "sort", "order", "resources_id", "group_id", "agent", "error", "flagged", "reward_min", "reward_max", "calls_min", "calls_max"]) f[k] = params.get(k) || "";
  const cursors = [null]; // cursors of the pages seen, for "newer"
  let page = 0;
  let next = null;
  const query = (changes) => {
    const q = new URLSearchParams({ status: [...statuses].join(","), ...f, ...changes });
    for (const [k, v] of [...q]) if (!v) q.delete(k);
    return q;
  };
  const go = (changes) => { const q = query(changes); location.hash = "#/rollouts" + (q.toString() ? "?" + q : ""); };
  const chips = STATUSES.map((st) => h("button", {
    class: "chip" + (statuses.has(st) ? " on" : ""), "data-status": st,
    onclick: () => { statuses.has(st) ? statuses.delete(st) : statuses.add(st); go({}); },
  }, st));
  const select = (id, key, options) => h("select", { id, onchange: (e) => go({ [key]: e.target.value }) },
    options.map(([value, label]) => h("option", { value, selected: value === f[key] }, label)));
  const text = (id, key, placeholder) => {
    const input = h("input", { type: "text", id, placeholder, value: f[key] });
    input.addEventListener("keydown", (e) => { if (e.key === "Enter") go({ [key]: input.value.trim() }); });
    input.addEventListener("change", () => go({ [key]: input.value.trim() }));
    return input;
  };
  const versionSelect = select("resources", "resources_id", [["", "all versions"]]);
  // the error types the store has seen, with their counts (the one chosen stays listed even if gone)
  const errorSelect = select("error", "error", [["", "any error"], ...(f.error ? [[f.error, f.error]] : [])]);
  api("error_types").then((seen) => errorSelect.append(...seen.items.filter((e) => e.error_type !== f.error)
    .map((e) => h("option", { value: e.error_type }, `${e.error_type} (${e.rollouts})`)))).catch(() => {});
  api("resources").then((list) => versionSelect.append(...list.items.map((v) => h("option",
    { value: v.resources_id, selected: v.resources_id === f.resources_id }, versionLabel(v))))).catch(() => {});
  const body = h("tbody");
  const older = h("button", { id: "older", disabled: true, onclick: () => { cursors.push(next); page += 1; refresh(true); } }, "Older →");
  const newer = h("button", { id: "newer", disabled: true, onclick: () => { cursors.pop(); page -= 1; refresh(true); } }, "← Newer");
  const pageLabel = h("span", { class: "mute" });
  fill(view, 
    h("h2", {}, "Rollouts"),
    h("div", { class: "filters" }, text("search", "q", "search id, input or output text…"),
      h("span", { class: "mute" }, "sort:"),
      select("sort", "sort", [["", "created"], ["reward", "reward"], ["duration", "duration"], ["calls", "calls"]]),
      select("order", "order", [["", "descending"], ["asc", "ascending"]]),
      h("span", { class: "mute" }, " mode:"), select("mode", "mode", ["", "train", "val", "test", "online"].map((m) => [m, m || "all modes"])),
      h("span", { class: "mute" }, " resources:"), versionSelect),
    h("div", { class: "filters" }, h("span", { class: "mute" }, "status:"), chips,
      statuses.size ? h("button", { class: "chip", onclick: () => { statuses.clear(); go({}); } }, "clear") : null,
      text("group", "group_id", "group id"), text("agent", "agent", "agent name"), h("span", { class: "mute" }, " error:"), errorSelect,
      h("span", { class: "mute" }, " reward ≥"), text("reward-min", "reward_min", "min"),
      h("span", { class: "mute" }, "≤"), text("reward-max", "reward_max", "max"),
      h("span", { class: "mute" }, " calls ≥"), text("calls-min", "calls_min", "min"), h("span", { class: "mute" }, "≤"), text("calls-max", "calls_max", "max"),
      h("button", { class: "chip" + (f.flagged ? " on" : ""), id: "flagged-only", onclick: () => go({ flagged: f.flagged ? "" : "1" }) }, "★ flagged only")),
    exportBar(() => query({})),
    h("table", { id: "rollouts" },
      h("thead", {}, h("tr", {}, ["", "rollout", "status", "mode", "reward", "agent", "calls", "tool calls", "completion tokens", "attempts", "resources", "created", "duration", "input"].map((c) => h("th", {}, c)))),
      body),
    h("div", { class: "pager" }, newer, older, pageLabel));
  return {
    load: () => api("rollouts?" + query({ limit: 50, cursor: cursors[cursors.length - 1] || "" })),
    draw: (data) => {
      next = data.next_cursor;
      older.disabled = !next;
      newer.disabled = page === 0;
      pageLabel.textContent = `page ${page + 1}` + (data.total !== undefined ? ` · ${data.total} match` : "");
      body.replaceChildren(...data.items.map((r) => h("tr", {
        class: "link", "data-rollout": r.rollout_id, onclick: () => { location.hash = "#/rollout/" + encodeURIComponent(r.rollout_id); },
      },
        h("td", {}, flagButton(r)), h("td", { class: "mono" }, r.rollout_id), h("td", {}, badge(r.status)), h("td", {}, r.mode),
        h("td", { class: "reward" }, fmtReward(r.reward)), h("td", { class: "agent" }, r.agent || "–"),
        h("td", { class: "calls" }, r.calls), h("td", { class: "tool-calls" }, r.tool_calls), h("td", { class: "tokens" }, r.completion_tokens), h("td", {}, r.num_attempts),
        h("td", { class: "mono resources" }, idText(r.resources_id)), h("td", { class: "nowrap" }, fmtTime(r.created_at)),
        h("td", { class: "nowrap duration" }, fmtDur(r.duration_s)),
        h("td", { class: "mono mute" }, r.input === null ? noInput(r) : preview(r.input)))));
      if (!data.items.length) body.append(h("tr", {}, h("td", { colspan: 14, class: "empty" }, "No rollouts match.")));
    },
  };
}

// a resources version by number, the label it was published under (agl eval's model names) and its weights
const versionNumber = (v) => `v${v.version}` + (v.label ? ` (${v.label})` : "");
const versionName = (v) => (v ? versionNumber(v) + (v.model_version ? ` · weights ${v.model_version}` : "") : "–");
const versionLabel = (v) => versionName(v) + ` · ${v.resources_id}`;

// ----- one rollout: attempts, span tree + waterfall + detail panel, what was trained, transcript ------
function rolloutView(rolloutId, params) {
  let attemptId = params.get("attempt") || "";
  let selected = null;
  // The training view is read beside the rollout, never before it (it may import torch or wait for a
  // tokenizer): the rollout draws at once and the section is swapped in place when its answer comes
  // (the rest of the page, and what a person opened on it, stays). It is read again while the rollout
  // runs or while its tokenizer loads; the group's spans do not change after.
  let training = null;
  let reading = false;
  let drawn = null; // the span index and select action of the page on screen (the section's links use them)
  const section = () => trainingSection(training ? training.data : null, drawn.byId, drawn.select);
  const readTraining = (status) => {
    reading = true;
    api("rollouts/" + encodeURIComponent(rolloutId) + "/training").catch((e) => ({ error: e.message }))
      .then((t) => {
        training = { status, data: t };
        if (current !== mine) return;
        const old = document.getElementById("training");
        if (old && drawn) old.replaceWith(section());
        if (t.tokenizer_loading) setTimeout(() => current === mine && readTraining(status), 400);
        else reading = false;
      });
  };
  fill(view, h("div", { class: "empty" }, "loading…"));
  const mine = {
    load: async () => {
      const data = await api("rollouts/" + encodeURIComponent(rolloutId) + (attemptId ? "?attempt_id=" + encodeURIComponent(attemptId) : ""));
      const stale = !training || !["succeeded", "failed", "cancelled"].includes(training.status);
      if (stale && !reading) readTraining(data.rollout.status);
      return data;
    },
    draw: (data) => {
      const r = data.rollout;
      const attempts = h("table", { id: "attempts" },
        h("thead", {}, h("tr", {}, ["#", "attempt", "status", "worker", "started", "ended", "duration", "error"].map((c) => h("th", {}, c)))),
        h("tbody", {}, data.attempts.map((a) => h("tr", {
          class: "link" + (a.attempt_id === data.attempt_id ? " selected" : ""),
          onclick: () => { attemptId = a.attempt_id; refresh(true); },
        }, h("td", {}, a.attempt_number), h("td", { class: "mono" }, a.attempt_id), h("td", {}, badge(a.status)),
          h("td", { class: "mono" }, a.worker_id || "–"), h("td", { class: "nowrap" }, fmtTime(a.started_at)), h("td", { class: "nowrap" }, fmtTime(a.ended_at)),
          h("td", {}, a.ended_at && a.started_at ? fmtDur(a.ended_at - a.started_at) : "–"),
          // the failure class the runner stored (infra, agent, reward) leads the error
          h("td", { class: "mono" }, a.error ? preview((a.metadata && a.metadata.failure_class ? a.metadata.failure_class + ": " : "") + a.error, 120) : "")))));
      const byId = Object.fromEntries(data.spans.map((sp) => [sp.span_id, sp]));
      const detail = h("div", { id: "span-detail", class: "panel", hidden: true });
      const select = (id) => { selected = id; flash(id); showSpan(detail, rolloutId, byId[id]); };
      drawn = { byId, select };
      fill(view, 
        h("h2", {}, h("a", { href: "#/rollouts" }, "Rollouts"), " / ", h("span", { class: "mono" }, r.rollout_id), " ", badge(r.status), " ", flagButton(r)),
        h("div", { class: "panel kv" },
          h("span", {}, "reward"), h("span", { class: "reward", id: "rollout-reward" }, fmtReward(r.reward)),
          h("span", {}, "mode"), h("span", {}, r.mode),
          h("span", {}, "agent"), h("span", {}, r.agent || "–"),
          h("span", {}, "resources"), h("span", { id: "rollout-resources" }, r.resources_id
            ? [h("a", { href: "#/resources/" + encodeURIComponent(r.resources_id), class: "mono" }, r.resources_id),
              r.resources_version ? ` (resources v${r.resources_version}` + (r.model_version ? ` · weights ${r.model_version})` : ")") : ""] : "–"),
          h("span", {}, "group"), h("span", { class: "mono" }, r.group_id ? h("a", { href: "#/group/" + encodeURIComponent(r.group_id), id: "group-link" }, r.group_id) : "–"),
          h("span", {}, "created / ended"), h("span", { id: "rollout-times" }, fmtTime(r.created_at) + " → " + fmtTime(r.ended_at) + (r.duration_s !== null ? ` (${fmtDur(r.duration_s)})` : "")),
          h("span", {}, "input"), r.input === null ? h("span", { class: "mute" }, noInput(r)) : h("pre", {}, pretty(r.input))),
        h("h3", {}, `Attempts (${data.attempts.length})`), attempts,
        h("h3", {}, `Span tree and timeline (${data.spans_truncated ? "the first " : ""}${data.spans.length} span${data.spans.length === 1 ? "" : "s"}) · click a span for all its attributes`),
        h("div", { class: "trace-wrap" }, data.spans.length ? traceTable(data.spans, select) : h("div", { class: "empty" }, "No spans."), detail),
        section(),
        h("h3", {}, "Transcript"),
        h("div", { id: "transcript" }, transcript(data.spans)));
      if (selected && byId[selected]) { flash(selected, false); showSpan(detail, rolloutId, byId[selected]); }
    },
  };
  return mine;
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
  if (sp.category === "llm" && sp.twin_name) return `${sp.twin_name} ${d.model || ""} (client + gateway)`; // one call, recorded twice
  if (sp.category === "llm") return `${sp.name} ${d.model || ""}`;
  if (sp.category === "llm_trace") return `${sp.name} ${d.model || ""} (client trace)`;
  if (sp.category === "operation") return d.name && d.name !== sp.name ? `${sp.name} ${d.name}` : sp.name;
  if (sp.category === "message") return `${sp.name}: ${preview(d.text, 40)}`;
  if (sp.category === "command") return `${sp.name}: ${(d.argv || []).join(" ")} → exit ${d.exit_code}`;
  return sp.name;
}

function flash(spanId, scroll = true) {
  document.querySelectorAll(".card.flash, tr.selected[data-span]").forEach((el) => el.classList.remove("flash", "selected"));
  const row = document.querySelector(`tr[data-span="${spanId}"]`);
  if (row) row.classList.add("selected");
  const target = document.getElementById("span-" + spanId);
  if (target) { target.classList.add("flash"); if (scroll) target.scrollIntoView({ behavior: "smooth", block: "center" }); }
}

// The span detail panel: its card, every attribute, and the raw JSON (fetched in full) with a copy button.
function showSpan(panel, rolloutId, sp) {
  if (!sp) return;
  panel.hidden = false;
  const raw = h("pre", { class: "raw", id: "span-raw" }, "loading the raw span…");
  const copy = h("button", { id: "copy-raw", onclick: async () => {
    try { await navigator.clipboard.writeText(raw.textContent); copy.textContent = "Copied"; }
    catch (e) { copy.textContent = "Copy failed: " + e.message; }
  } }, "Copy JSON");
  const attrs = Object.entries(sp.attributes).sort(([a], [b]) => a.localeCompare(b));
  panel.replaceChildren(
    h("div", { class: "title" }, h("b", {}, sp.name), h("span", { class: "mute" }, `  ${sp.category} · ${fmtMs(sp.duration_ms)} · span ${sp.span_id}`),
      h("button", { class: "close", onclick: () => { panel.hidden = true; } }, "×")),
    card(sp, null, true),
    h("table", { class: "attrs", id: "span-attrs" }, h("tbody", {}, attrs.map(([k, v]) =>
      h("tr", {}, h("td", { class: "mono key" }, k), h("td", { class: "mono" }, typeof v === "string" ? v : JSON.stringify(v)))))),
    h("div", { class: "title" }, h("b", {}, "Raw JSON "), copy), raw);
  api(`rollouts/${encodeURIComponent(rolloutId)}/spans/${encodeURIComponent(sp.span_id)}`)
    .then((body) => { raw.textContent = JSON.stringify(body.span, null, 2); })
    .catch((e) => { raw.textContent = "Could not load: " + e.message; });
}

// ----- what GRPO trains on: each call trained or skipped (and why), the merged samples' tokens ------
// where a training view's verdicts come from: the run's own record, or a re-simulation (then say so)
function sourceBanner(source, settings) {
  const shown = Object.entries(settings || {}).map(([k, v]) => `${k}=${typeof v === "string" ? v : JSON.stringify(v)}`).join(" · ");
  if (source === "record") return h("div", { class: "mute source-note", "data-source": "record" }, "As the run's training record says (settings: " + shown + ")");
  const text = source === "what_if"
    ? "What-if: re-simulated with the settings asked for, not the run's recorded ones (" + shown + ")"
    : "Re-simulated: this store has no training record for these rollouts, so they are shown as GRPO with these settings would train them (" + shown + "); advantages and trained flags may differ from what the run did";
  return h("div", { class: "banner source-banner", "data-source": source }, text);
}

function trainingSection(t, byId, select) {
  const box = h("div", { id: "training" }, h("h3", {}, "What was trained (GRPO)"));
  if (!t) return box.appendChild(h("div", { class: "empty", id: "training-pending" }, "analysing what GRPO trains on…")) && box;
  if (t.error) return box.appendChild(h("div", { class: "empty" }, "Could not analyse: " + t.error)) && box;
  box.append(sourceBanner(t.source, t.settings));
  const g = t.group;
  const mine = g.rollouts.find((row) => row.rollout_id === t.rollout_id) || {};
  const skipWord = mine.mode && mine.mode !== "train" ? "not trained" : "skipped"; // GRPO never trains val rollouts
  box.append(h("div", { class: "panel kv", id: "training-summary" },
    h("span", {}, "group"), h("span", {}, t.group_id ? h("a", { href: "#/group/" + encodeURIComponent(t.group_id) }, `${t.group_id} (${g.rollouts.length} rollouts)`) : "none (a rollout of its own)",
      g.zero_variance || (mine.mode && mine.mode !== "train") ? [" ", groupBadge(mine.mode, g.zero_variance)] : null),
    h("span", {}, "group reward"), h("span", {}, `mean ${fmtNum(g.mean)} · std ${fmtNum(g.std)}`),
    h("span", {}, "this rollout"), h("span", { id: "training-verdict" }, mine.trained ? h("span", { class: "badge s-succeeded" }, "trained") : h("span", { class: "badge s-cancelled" }, "not trained"),
      ` advantage ${fmtNum(mine.advantage)}`, mine.reason ? " · " + mine.reason : "")));
  if (!t.calls.length) return box.appendChild(h("div", { class: "empty" }, "No model calls.")) && box;
  box.append(h("table", { id: "training-calls" },
    h("thead", {}, h("tr", {}, ["call", "agent", "model version", "prompt + completion tokens", "sample", "trained?"].map((c) => h("th", {}, c)))),
    h("tbody", {}, t.calls.map((c) => h("tr", { class: "link", "data-call-span": c.span_id, onclick: () => byId[c.span_id] && select(c.span_id) },
      h("td", {}, "#" + (c.index + 1)), h("td", {}, c.agent || "–"), h("td", { class: "mono" }, c.model_version || "–"),
      h("td", {}, c.prompt_tokens === null ? "no token ids" : `${c.prompt_tokens} + ${c.completion_tokens}`),
      h("td", {}, c.sample === null ? "–" : "#" + (c.sample + 1)),
      h("td", { class: "verdict" }, c.trained ? h("span", { class: "badge s-succeeded" }, "trained") : [h("span", { class: "badge s-cancelled" }, skipWord), " ", c.reason]))))));
  for (const sm of t.samples) box.append(sampleStrip(sm, t.tokenizer, t.tokenizer_loading, skipWord));
  return box;
}

// A heat strip of one merged sample: context tokens grey, completion tokens (loss mask 1) coloured by
// their logprob (green: likely, red: unlikely); each call's completion starts at a marked token.
function sampleStrip(sm, decoded, loading, skipWord) {
  const starts = new Map(sm.call_spans.map(([a], i) => [a, i]));
  const ends = new Set(sm.call_spans.map(([, b]) => b - 1));
  const tokens = sm.input_ids.map((id, i) => {
    const gen = sm.loss_mask[i] === 1;
    const lp = sm.logprobs ? sm.logprobs[i] : null;
    const text = sm.texts ? sm.texts[i] : String(id);
    const p = gen && lp !== null ? Math.exp(lp) : null;
    const style = p === null ? "" : `background:hsl(${Math.round(120 * p)},70%,${gen ? 80 : 92}%)`;
    const tip = `token ${i} · id ${id}` + (sm.texts ? ` · ${JSON.stringify(text)}` : "") + (gen ? ` · completion (trained) · logprob ${lp === null ? "–" : lp.toFixed(4)}` : " · context (masked)");
    return h("span", {
      class: "tok " + (gen ? "gen" : "ctx") + (starts.has(i) ? " call-start" : "") + (ends.has(i) ? " call-end" : ""),
      style, title: tip, "data-i": i, "data-call": starts.has(i) ? starts.get(i) + 1 : null,
    }, text.replace(/\n/g, "↵\n") || "·");
  });
  return h("div", { class: "panel sample", "data-sample": sm.index },
    h("div", { class: "title" }, h("b", {}, `Sample #${sm.index + 1}`), h("span", { class: "mute" },
      `  ${sm.length} tokens · ${sm.model_tokens} completion tokens ${sm.trained ? "trained on" : "(not trained)"} · ${sm.num_calls} call${sm.num_calls === 1 ? "" : "s"} merged` +
      (sm.agent ? ` · agent ${sm.agent}` : "") + ` · advantage ${fmtNum(sm.advantage)}` + (sm.loss_weight !== null && sm.loss_weight !== undefined ? ` · loss weight ${fmtNum(sm.loss_weight)}` : "")),
      " ", sm.trained ? h("span", { class: "badge s-succeeded" }, "trained") : h("span", { class: "badge s-cancelled", title: sm.reason }, `${skipWord}: ${sm.reason}`)),
    sm.mismatch ? h("div", { class: "mismatch" }, `Starts a new sample: prefix mismatch (${sm.mismatch.class}) with the previous sample at token ${sm.mismatch.at}.`) : null,
    sm.reconciled_calls ? h("div", { class: "mute reconciled" }, `${sm.reconciled_calls} call${sm.reconciled_calls === 1 ? "" : "s"} merged although ${sm.reconciled_calls === 1 ? "its" : "their"} prompt re-rendered the previous reply (a parsed tool call templated anew): the strip holds the model's own reply, as trained.`) : null,
    h("div", { class: "legend" }, h("span", { class: "tok ctx" }, "context (mask 0)"), h("span", { class: "tok gen", style: "background:hsl(100,70%,80%)" }, "completion, likely"),
      h("span", { class: "tok gen", style: "background:hsl(10,70%,80%)" }, "completion, unlikely"), h("span", { class: "tok gen call-start" }, "a call's first token"),
      decoded ? "" : h("span", { class: "mute tokenizer-note" }, loading ? " (the tokenizer is loading: token ids shown until it is ready)" : " (no tokenizer next to the weights: token ids shown)")),
    h("div", { class: "strip" }, tokens),
    sm.cut ? h("div", { class: "mute" }, `… the first ${sm.input_ids.length} of ${sm.length} tokens shown`) : null);
}

// ----- transcript: each message once ------------------------------------------------------------
function transcript(spans) {
  const shown = spans.filter((sp) => sp.category !== "other" && sp.category !== "llm_trace")
    .sort((a, b) => a.start_ns - b.start_ns || a.sequence_id - b.sequence_id);
  let context = []; // the previous call's messages plus its reply, as JSON strings
  return shown.map((sp) => {
    if (sp.category !== "llm") return card(sp);
    const msgs = sp.detail.messages.map((m) => JSON.stringify(m));
    let known = 0;
    while (known < msgs.length && known < context.length && msgs[known] === context[known]) known += 1;
    if (known < context.length) known = 0; // the context was rewritten: show it all
    context = [...msgs, sp.detail.response ? JSON.stringify({ role: sp.detail.response.role, content: sp.detail.response.content, ...(sp.detail.response.tool_calls ? { tool_calls: sp.detail.response.tool_calls } : {}) }) : ""];
    return card(sp, known);
  });
}

function message(m) {
  const empty = !m.content && !(m.tool_calls || []).length;
  return h("div", { class: "msg " + m.role },
    h("div", { class: "role" }, m.role === "tool" ? "tool result" : m.role, m.tool_name ? h("span", { class: "tool-name mono" }, " " + m.tool_name) : null,
      m.tool_call_id ? h("span", { class: "call-id mono" }, " " + m.tool_call_id) : null),
    m.content ? h("pre", {}, m.content) : null,
    empty ? h("div", { class: "mute empty-msg" }, m.role === "assistant" ? "(empty completion)" : "(empty message)") : null,
    (m.tool_calls || []).map(toolCall));
}
const toolCall = (c) => h("div", { class: "tool-call" }, h("b", {}, "tool call "),
  `${c.name}(${typeof c.arguments === "string" ? c.arguments : JSON.stringify(c.arguments)})`, c.id ? h("span", { class: "call-id mute" }, "  " + c.id) : null);

const usageText = (u) => (u && (u.prompt_tokens !== null && u.prompt_tokens !== undefined) ? `${u.prompt_tokens}+${u.completion_tokens} tokens` : "");
const settingsText = (d) => [...Object.entries(d.settings || {}).map(([k, v]) => `${k}=${typeof v === "string" ? v : JSON.stringify(v)}`),
  d.tools && d.tools.length ? "tools: " + d.tools.join(", ") : null].filter(Boolean).join(" · ");

// known: how many leading messages the previous call already showed (folded behind a toggle)
function card(sp, known, inPanel) {
  const d = sp.detail;
  const head = (title, extra) => h("div", { class: "title" }, title, extra ? h("span", { class: "mute" }, "  " + extra) : null);
  let body;
  if (sp.category === "llm" || sp.category === "llm_trace") {
    const earlier = known ? d.messages.slice(0, known) : [];
    const fresh = known ? d.messages.slice(known) : d.messages;
    const folded = earlier.length ? h("div", { class: "context", hidden: true }, earlier.map(message)) : null;
    body = [head("LLM call · " + (d.model || "?"), [usageText(d.usage), fmtMs(sp.duration_ms), d.finish_reason, d.model_version ? "weights " + d.model_version : null,
      d.prompt_token_ids !== null && d.prompt_token_ids !== undefined ? `token ids ${d.prompt_token_ids}+${d.completion_token_ids}` : (d.has_token_ids === false ? "no token ids" : null)].filter(Boolean).join(" · ")),
      settingsText(d) ? h("div", { class: "settings mute" }, settingsText(d)) : null,
      folded ? [h("button", { class: "link-button show-context", onclick: (e) => { folded.hidden = !folded.hidden; e.target.textContent = (folded.hidden ? "show" : "hide") + ` the ${earlier.length} earlier message${earlier.length === 1 ? "" : "s"}`; } },
        `show the ${earlier.length} earlier message${earlier.length === 1 ? "" : "s"}`), folded] : null,
      fresh.map(message),
      d.response ? message(d.response) : (!d.error && !d.tool_calls.length ? message({ role: "assistant", content: "" }) : null),
      !d.response && d.tool_calls.length ? d.tool_calls.map(toolCall) : null,
      d.error ? h("pre", { class: "mute" }, "error: " + preview(d.error, 400)) : null,
      sp.category === "llm" && !inPanel ? replayBox(sp) : null];
  } else if (sp.category === "reward") {
    const values = Object.entries(d.values || {});
    const extra = values.length > 1 ? values.map(([k, v]) => `${k}=${fmtReward(v)}`).join("  ") : "";
    body = [head("Reward", extra), h("div", { class: "big-reward " + rewardTone(d.value) }, fmtReward(d.value))];
  } else if (sp.category === "message") {
    body = [head("Message"), h("pre", {}, d.text || "")];
  } else if (sp.category === "operation") {
    body = [head("Operation · " + d.name), h("div", { class: "tool-call" }, h("b", {}, "in "), preview(d.input, 400)),
      d.output !== null && d.output !== undefined ? h("div", { class: "tool-call" }, h("b", {}, "out "), preview(d.output, 400)) : null];
  } else if (sp.category === "exception") {
    body = [head("Exception · " + d.type, d.message), h("pre", { class: "mute" }, d.stacktrace || "")];
  } else if (sp.category === "command") {
    body = [head("Command", `exit code ${d.exit_code}`), h("div", { class: "tool-call" }, h("b", {}, "argv "), (d.argv || []).join(" ")),
      d.stderr ? [h("div", { class: "mute" }, "stderr (tail)"), h("pre", { class: "stderr" }, d.stderr)] : h("div", { class: "mute" }, "(no stderr)")];
  } else if (sp.category === "annotation") {
    body = [head("Annotation"), h("pre", {}, pretty(d.value))];
  } else if (sp.category === "object") {
    body = [head("Object"), h("pre", {}, pretty(d.value))];
  } else {
    body = [head(sp.name, d.agent ? "agent " + d.agent : ""), h("div", { class: "mute" }, `${Object.keys(sp.attributes).length} attributes`)];
  }
  return h("div", { class: "card " + sp.category, id: inPanel ? null : "span-" + sp.span_id }, body);
}

// ----- a GRPO group side by side; the groups of one step --------------------------------------------
function groupView(groupId) {
  fill(view, h("div", { class: "empty" }, "loading…"));
  return {
    load: () => api("groups/" + encodeURIComponent(groupId)),
    draw: (g) => {
      fill(view, 
        h("h2", {}, h("a", { href: "#/rollouts?group_id=" + encodeURIComponent(groupId) }, "Group"), " ", h("span", { class: "mono" }, groupId), " ",
          groupBadge(g.mode, g.zero_variance, `trained: ${g.trained_samples} sample${g.trained_samples === 1 ? "" : "s"}`, true)),
        sourceBanner(g.source, g.settings),
        h("div", { class: "panel kv", id: "group-summary" },
          h("span", {}, "task"), h("pre", {}, pretty(g.input)),
          h("span", {}, "resources"), h("span", {}, g.resources_id ? [h("a", { href: "#/resources/" + encodeURIComponent(g.resources_id), class: "mono" }, g.resources_id),
            ` (resources v${g.resources_version}` + (g.model_version ? ` · weights ${g.model_version})` : ")")] : "–"),
          h("span", {}, "step · mode"), h("span", {}, g.step !== null && g.step !== undefined ? [h("a", { href: "#/step/" + g.step }, "step " + g.step), " · " + g.mode] : g.mode),
          h("span", {}, "reward"), h("span", {}, `mean ${fmtNum(g.mean)} · std ${fmtNum(g.std)}` + (g.settings.scale_by_std && g.settings.scale_by_std !== "none" ? " · advantage = (reward − mean) / std" : " · advantage = reward − mean"))),
        h("div", { class: "group-grid", id: "group-grid" }, g.rollouts.map((r) => h("div", {
          class: "panel member link" + (r.trained ? " trained" : " skipped"), "data-rollout": r.rollout_id,
          onclick: () => { location.hash = "#/rollout/" + encodeURIComponent(r.rollout_id); },
        },
          h("div", { class: "mono" }, r.rollout_id, " ", badge(r.status)),
          h("div", { class: "kv" }, h("span", {}, "reward"), h("span", { class: "reward" }, fmtReward(r.reward)),
            h("span", {}, "advantage"), h("span", { class: "advantage " + (r.advantage > 0 ? "pos" : r.advantage < 0 ? "neg" : "zero") }, fmtNum(r.advantage)),
            h("span", {}, "trained"), h("span", {}, r.trained ? `yes (${r.samples} sample${r.samples === 1 ? "" : "s"})` : "no: " + r.reason)),
          h("pre", { class: "output" }, r.output || "(no reply)")))));
    },
  };
}

// run: the metrics run whose point was clicked; another run's step lives in that run's own store.
function stepView(step, run) {
  fill(view, h("div", { class: "empty" }, "loading…"));
  return {
    load: () => api("groups?step=" + encodeURIComponent(step) + (run ? "&run=" + encodeURIComponent(run) : "")),
    draw: (data) => {
      const title = [h("a", { href: "#/curves" }, "Curves"), run ? [" / run ", h("span", { class: "mono", id: "step-run" }, run)] : null, ` / step ${step}`];
      if (data.elsewhere) {
        return fill(view, h("h2", {}, title), h("div", { class: "panel mismatch", id: "step-elsewhere" },
          `Step ${step} of run ${run} is in that run's own store, not in the store this dashboard reads: `,
          h("span", { class: "mono" }, data.elsewhere), ". To see its groups, serve that store: ",
          h("code", {}, `agl store serve --backend sqlite:///${data.elsewhere} --metrics-dir …`)));
      }
      fill(view,
        h("h2", {}, title, `: ${data.items.length} group${data.items.length === 1 ? "" : "s"}`),
        h("table", { id: "step-groups" },
          h("thead", {}, h("tr", {}, ["group", "task", "rollouts", "rewards", "mean", "GRPO"].map((c) => h("th", {}, c)))),
          h("tbody", {}, data.items.map((g) => h("tr", { class: "link", "data-group": g.group_id, onclick: () => { location.hash = "#/group/" + encodeURIComponent(g.group_id); } },
            h("td", { class: "mono" }, g.group_id), h("td", { class: "mono" }, preview(g.input, 60)), h("td", {}, g.rollouts),
            h("td", { class: "mono" }, g.rewards.map(fmtReward).join("  ")), h("td", { class: "reward" }, fmtReward(g.mean)),
            h("td", {}, groupBadge(g.mode, g.zero_variance)))))),
        data.items.some((g) => g.mode === "train") && data.items.filter((g) => g.mode === "train").every((g) => g.zero_variance)
          ? h("div", { class: "panel mismatch", id: "no-update" }, `Step ${step} made no update: every group got one reward only, so GRPO had no sample to train on.`) : null,
        data.items.length ? null : h("div", { class: "empty" }, "No training groups recorded this step."));
    },
  };
}

// ----- resources versions and diffs ------------------------------------------------------------------
function resourcesView(selectedId, against) {
  return {
    load: async () => {
      const list = await api("resources");
      const id = selectedId || (list.items[0] && list.items[0].resources_id);
      const diff = id ? await api("resources/" + encodeURIComponent(id) + "/diff" + (against ? "?against=" + encodeURIComponent(against) : "")) : null;
      return { list, id, diff };
    },
    draw: ({ list, id, diff }) => {
      const chosen = list.items.find((v) => v.resources_id === id);
      fill(view, 
        h("h2", {}, "Resources versions"),
        h("p", { class: "mute" }, "A resources version (v1, v2, …) is what rollouts run with; GRPO's weights inside it carry their own version (weights v0, v1, …), the one LLM-call spans record as model_version."),
        h("table", { id: "versions" },
          h("thead", {}, h("tr", {}, ["version", "weights", "resources", "APO round", "val reward", "train reward", "diffed against", "created"].map((c) => h("th", {}, c)))),
          h("tbody", {}, list.items.map((v) => h("tr", {
            class: "link" + (v.resources_id === id ? " selected" : ""), "data-resources": v.resources_id,
            onclick: () => { location.hash = "#/resources/" + encodeURIComponent(v.resources_id); },
          }, h("td", {}, versionNumber(v)), h("td", { class: "mono" }, v.model_version || "–"), h("td", { class: "mono" }, v.resources_id),
            h("td", {}, v.apo ? v.apo.round : "–"), h("td", { class: "reward" }, fmtReward(v.val_reward)),
            h("td", { class: "reward" }, fmtReward(v.train_reward)), h("td", { class: "mono parent" }, idText(v.diff_parent_id)),
            h("td", { class: "nowrap" }, fmtTime(v.created_at)))))),
        chosen ? versionDetail(chosen, diff, list.items) : h("div", { class: "empty" }, "No resources versions yet."));
    },
  };
}

function versionDetail(v, diff, versions) {
  const pick = h("select", { id: "diff-against", onchange: (e) => {
    location.hash = "#/resources/" + encodeURIComponent(v.resources_id) + (e.target.value ? "?against=" + encodeURIComponent(e.target.value) : "");
  } }, h("option", { value: "" }, "its parent / the previous version"),
  versions.filter((o) => o.resources_id !== v.resources_id).map((o) => h("option", { value: o.resources_id, selected: diff.against === o.resources_id && diff.against !== v.diff_parent_id }, versionLabel(o))));
  const against = versions.find((o) => o.resources_id === diff.against);
  return h("div", { id: "version-detail" },
    h("h3", {}, versionLabel(v)),
    v.apo && v.apo.critique ? h("div", { class: "panel" }, h("b", {}, "APO critique: "), h("pre", {}, v.apo.critique)) : null,
    h("div", { class: "filters" }, h("span", { class: "mute" }, "diff against:"), pick),
    h("h3", { id: "diff-title" }, diff.against ? ["Changes against ", h("a", { href: "#/resources/" + encodeURIComponent(diff.against), class: "mono" }, against ? versionLabel(against) : diff.against)] : "First version: everything is new"),
    diff.diff.map((d) => h("div", { class: "panel" },
      h("div", { class: "title" }, h("b", {}, d.name), h("span", { class: "mute" }, `  ${d.resource_type || ""}${d.changed ? "" : " · unchanged"}`)),
      d.changed ? h("div", { class: "diff" }, d.lines.map((l) => h("div", { class: l.op === "+" ? "add" : l.op === "-" ? "del" : "same" }, l.text || " "))) : null)));
}

// ----- curves: key metrics first, runs overlaid, steps without an update marked -------------------------
const MODE_COLORS = { train: "#2f6fde", val: "#2db36b", test: "#e69a3b" }; // one colour per mode on every chart
const RUN_COLORS = ["#2f6fde", "#e0553a", "#2db36b", "#b07ae0", "#e69a3b", "#3bb5c9"];
const KEY_METRICS = ["reward_mean", "val_reward", "loss", "samples", "zero_variance_groups", "kl", "clip_fraction"];
const openGroups = new Set(); // the folded metric groups a person opened (kept across redraws)
// Metrics logged on some steps only (validation every eval_every steps): their points are joined over
// the steps between; any other missing value (no loss on a step without an update) stays a gap.
const sparse = (column) => column.startsWith("val_");
const hiddenRuns = new Set();

// A step made no policy update when it had no sample to train on (every group zero variance, all failed).
const noUpdate = (row) => row.step > 0 && (row.samples === 0 || (row.samples === null && row.loss === null && row.reward_mean !== null));

function curvesView() {
  return {
    load: async () => {
      const [curves, metrics] = await Promise.all([api("curves"), api("metrics")]);
      return { curves, metrics };
    },
    draw: ({ curves, metrics }) => {
      const byVersion = curves.by_version.filter((row) => row.version !== null);
      const versionSeries = ["train", "val"].map((mode) => ({
        name: mode + " mean reward", color: MODE_COLORS[mode],
        points: byVersion.filter((row) => row[mode + "_mean"] !== null).map((row) => [row.version, row[mode + "_mean"]]),
      })).filter((sr) => sr.points.length);
      const modes = [...new Set(curves.points.map((p) => p.mode))].sort();
      const timeSeries = modes.map((mode, i) => ({
        name: mode, color: MODE_COLORS[mode] || RUN_COLORS[(i + 3) % RUN_COLORS.length], dots: true,
        points: curves.points.filter((p) => p.mode === mode).map((p) => [p.t, p.reward]),
      }));
      const runs = metrics.runs.map((run, i) => ({ ...run, color: RUN_COLORS[i % RUN_COLORS.length] }));
      const shownRuns = runs.filter((run) => !hiddenRuns.has(run.name));
      const steps = shownRuns.flatMap((run) => run.rows.map((row) => row.step).filter((x) => x !== null));
      const xRange = steps.length ? [Math.min(...steps), Math.max(...steps)] : null; // one x range: steps line up
      const markers = shownRuns.flatMap((run) => run.rows.filter(noUpdate).map((row) => ({ x: row.step, run: run.name, color: run.color, label: `${run.name}: step ${row.step} made no update (no sample to train on)` })));
      const columns = [...new Set(runs.flatMap((run) => run.columns.filter((c) => c !== "step")))];
      const seriesOf = (column) => shownRuns.filter((run) => run.columns.includes(column)).map((run) => ({
        name: run.name, color: run.color,
        points: run.rows.filter((row) => row.step !== null && (!sparse(column) || (row[column] !== null && row[column] !== undefined)))
          .map((row) => [row.step, row[column]]),
      }));
      // a key metric that is zero on every step of every run (kl without a KL term) says nothing up there
      const flat = (column) => seriesOf(column).every((sr) => sr.points.every(([, y]) => y === null || y === undefined || y === 0));
      const key = KEY_METRICS.filter((c) => columns.includes(c) && !flat(c));
      const flatKey = KEY_METRICS.filter((c) => columns.includes(c) && flat(c));
      const metricChart = (column) => chart(column, seriesOf(column), { xLabel: "step", integerX: true, xRange, markers,
        onClickX: (x, run) => { location.hash = "#/step/" + x + "?run=" + encodeURIComponent(run); }, key: key.includes(column) });
      // the rest folded, grouped by the name's first word (time_*, memory_*, ratio_*); lone ones as "other"
      const rest = columns.filter((c) => !key.includes(c));
      const prefix = (c) => c.split(/[_/.]/)[0];
      const counts = {};
      for (const c of rest) counts[prefix(c)] = (counts[prefix(c)] || 0) + 1;
      const groups = {};
      for (const c of rest) (groups[counts[prefix(c)] > 1 ? prefix(c) : "other"] ||= []).push(c);
      const folded = Object.entries(groups).sort(([a], [b]) => (a === "other") - (b === "other") || a.localeCompare(b)).map(([name, cols]) => {
        const box = h("details", { class: "metric-group", "data-group": name, open: openGroups.has(name) },
          h("summary", {}, `${name} (${cols.length})`), h("div", { class: "charts" }, cols.map(metricChart)));
        box.addEventListener("toggle", () => { box.open ? openGroups.add(name) : openGroups.delete(name); });
        return box;
      });
      const metricCharts = columns.length ? [
        h("div", { class: "charts", id: "key-charts" }, key.map(metricChart)),
        flatKey.length ? h("div", { class: "mute", id: "flat-key" }, `zero on every step, so folded below: ${flatKey.join(", ")}`) : null,
        folded] : [];
      const runPicker = runs.length > 1 ? h("div", { class: "filters", id: "runs" }, h("span", { class: "mute" }, "runs:"), runs.map((run) => h("label", { class: "chip" },
        h("input", { type: "checkbox", checked: !hiddenRuns.has(run.name), onchange: (e) => { e.target.checked ? hiddenRuns.delete(run.name) : hiddenRuns.add(run.name); refresh(true); } }),
        h("span", { style: `color:${run.color}` }, " ● "), run.name))) : null;
      fill(view, 
        h("h2", {}, "Training curves"),
        h("div", { class: "charts" },
          chart("Mean reward per resources version", versionSeries, { xLabel: "resources version", xFormat: (v) => "v" + v, integerX: true }),
          chart("Reward of finished rollouts over time", timeSeries, { xLabel: "time", xFormat: (t) => fmtTime(t).slice(11), time: true })),
        h("h3", {}, "Per-step metrics (metrics.csv) · key metrics first · click a point to see that step's groups"),
        runPicker,
        metricCharts.length ? h("div", { id: "metric-charts" }, metricCharts)
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
  return { ticks, step };
}

// Enough decimals that neighbouring ticks differ (ratio_mean moves in the 7th decimal).
function tickFormat(step) {
  const decimals = Math.min(12, Math.max(0, Math.ceil(-Math.log10(step) - 1e-9)));
  return (t) => (Math.abs(t) >= 1e5 ? t.toExponential(2) : t.toFixed(decimals));
}
const fmtValue = (v) => (v === null || v === undefined ? "–" : Math.abs(v) >= 1e5 || (v !== 0 && Math.abs(v) < 1e-3) ? v.toExponential(4) : +v.toPrecision(8) + "");

// A line (or dot) chart drawn as inline SVG; series are [{name, color, points: [[x, y|null]], dots}].
// A null y breaks the line. opts: xLabel, xFormat, integerX, xRange (shared), markers [{x, label}], onClickX.
function chart(title, series, opts = {}) {
  const W = 440, H = 230, L = 62, R = 12, T = 10, B = 34;
  const all = series.flatMap((sr) => sr.points).filter((p) => p[1] !== null && p[1] !== undefined);
  const box = h("div", { class: "panel chart" + (opts.key ? " key" : ""), "data-title": title }, h("div", { class: "title" }, h("b", {}, title)));
  if (!all.length) return box.appendChild(h("div", { class: "empty" }, "No data yet.")) && box;
  let [x0, x1] = opts.xRange || [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { const d = Math.abs(y0) * 0.1 || 0.5; y0 -= d; y1 += d; }
  const pad = (y1 - y0) * 0.08; y0 -= pad; y1 += pad;
  const X = (x) => L + 8 + ((x - x0) / (x1 - x0)) * (W - L - R - 16);
  const Y = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const svg = s("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
  const yt = niceTicks(y0, y1);
  const yLabel = tickFormat(yt.step);
  for (const t of yt.ticks) {
    svg.append(s("line", { class: "grid", x1: L, x2: W - R, y1: Y(t), y2: Y(t) }),
      s("text", { x: L - 6, y: Y(t) + 4, "text-anchor": "end", class: "ytick" }, yLabel(t)));
  }
  const xt = niceTicks(x0, x1, 4);
  const xLabel = opts.xFormat || tickFormat(xt.step);
  const shown = new Set(); // ticks finer than the format (seconds of a short run) would repeat a label
  for (const t of xt.ticks.filter((t) => !opts.integerX || Number.isInteger(t))) {
    const label = xLabel(t);
    if (shown.has(label)) continue;
    shown.add(label);
    svg.append(s("text", { x: X(t), y: H - B + 16, "text-anchor": "middle", class: "xtick" }, label));
  }
  // a marker belongs to its run: drawn in its colour, and only where that run's series is drawn
  const markers = (opts.markers || []).filter((m) => m.x >= x0 && m.x <= x1 && (!m.run || series.some((sr) => sr.name === m.run)));
  for (const m of markers) {
    svg.append(s("line", { class: "no-update", "data-run": m.run || "", "data-x": m.x, x1: X(m.x), x2: X(m.x), y1: T, y2: H - B, style: m.color ? `stroke:${m.color}` : "" }, s("title", {}, m.label)),
      s("text", { class: "no-update-mark", "data-run": m.run || "", x: X(m.x), y: H - B - 3, "text-anchor": "middle", style: m.color ? `fill:${m.color}` : "" }, "×", s("title", {}, m.label)));
  }
  svg.append(s("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }),
    s("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }),
    s("text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle" }, opts.xLabel || ""));
  const readout = h("div", { class: "readout mute" }, opts.onClickX ? "hover a point for its value; click it for that step's groups" : "hover a point for its value");
  for (const sr of series) {
    const pts = [...sr.points].sort((a, b) => a[0] - b[0]);
    if (!sr.dots) {
      let run = [];
      const flush = () => { if (run.length > 1) svg.append(s("polyline", { points: run.join(" "), fill: "none", stroke: sr.color, "stroke-width": 2, "data-series": sr.name })); run = []; };
      for (const [x, y] of pts) { if (y === null || y === undefined) flush(); else run.push(`${X(x)},${Y(y)}`); }
      flush();
    }
    for (const [x, y] of pts) {
      if (y === null || y === undefined) continue;
      const label = `${sr.name} · ${opts.xFormat ? opts.xFormat(x) : (opts.xLabel || "x") + " " + x}: ${fmtValue(y)}`;
      const dot = s("circle", { "data-series": sr.name, cx: X(x), cy: Y(y), r: sr.dots ? 3 : 3.5, fill: sr.color, "fill-opacity": sr.dots ? 0.6 : 1, "data-x": x, class: opts.onClickX ? "clickable" : "" }, s("title", {}, label));
      dot.addEventListener("mouseenter", () => { readout.textContent = label; });
      if (opts.onClickX) dot.addEventListener("click", () => opts.onClickX(x, sr.name));
      svg.append(dot);
    }
  }
  box.append(svg, h("div", { class: "legend" }, series.map((sr) => h("span", {}, h("span", { style: `color:${sr.color}` }, "●"), " " + sr.name)),
    markers.length ? h("span", { class: "no-update-legend" }, "× step without an update (in its run's colour)") : null), readout);
  return box;
}

// ----- what it learned, or hacked: the tasks whose reward moved between two versions, one task across all --
const deltaText = (d) => (d > 0 ? "+" : "") + fmtNum(d);

function changesView(params) {
  fill(view, h("div", { class: "empty" }, "loading…"));
  const mode = params.get("mode") || "val";
  const pick = (name, value) => { const q = new URLSearchParams(params); q.set(name, value); location.hash = "#/changes?" + q; };
  return {
    load: () => api("changes?" + params),
    draw: (c) => {
      const byId = Object.fromEntries(c.versions.map((v) => [v.resources_id, v]));
      const picker = (name) => h("select", { id: "changes-" + name, onchange: (e) => pick(name, e.target.value) },
        c.versions.map((v) => h("option", { value: v.resources_id, selected: v.resources_id === c[name] }, `${versionName(v)} · mean ${fmtReward(v.mean)} over ${v.tasks} tasks`)));
      const reply = (cell) => h("td", { class: "reply" }, h("div", { class: "reward" }, fmtReward(cell.reward) + (cell.n > 1 ? ` (mean of ${cell.n})` : "")),
        h("a", { href: "#/rollout/" + encodeURIComponent(cell.rollout_id) }, h("pre", {}, preview(cell.reply || "(no reply)", 600))));
      fill(view,
        h("h2", {}, "What changed ", h("span", { class: "mute" }, mode === "val" ? "(held-out tasks)" : `(${mode} tasks)`)),
        c.versions.length < 2 ? h("div", { class: "empty", id: "changes-empty" }, `Fewer than two versions ran ${mode} tasks: nothing to compare yet.`)
          : [h("div", { class: "filters" }, "from ", picker("before"), " to ", picker("after"),
            h("label", { class: "chip" }, h("input", { type: "radio", name: "mode", checked: mode === "val", onchange: () => pick("mode", "val") }), " held-out"),
            h("label", { class: "chip" }, h("input", { type: "radio", name: "mode", checked: mode === "train", onchange: () => pick("mode", "train") }), " train")),
          h("div", { class: "mute", id: "changes-summary" }, `${c.changed.length} task${c.changed.length === 1 ? "" : "s"} changed reward (${c.changed.filter((x) => x.delta > 0).length} up, ${c.changed.filter((x) => x.delta < 0).length} down), ${c.same} the same, from ${versionName(byId[c.before])} to ${versionName(byId[c.after])}`),
          c.steps.length > 1 ? h("table", { id: "changes-steps", class: "compact" },
            h("thead", {}, h("tr", {}, ["each version against the one before", "up", "down"].map((x) => h("th", {}, x)))),
            h("tbody", {}, c.steps.map((st) => h("tr", { class: "link" + (st.before === c.before && st.after === c.after ? " selected" : ""), "data-after": st.after,
              onclick: () => { const q = new URLSearchParams(params); q.set("before", st.before); q.set("after", st.after); location.hash = "#/changes?" + q; } },
              h("td", {}, `${versionName(byId[st.before])} → ${versionName(byId[st.after])}`), h("td", { class: "delta pos" }, st.up), h("td", { class: "delta neg" }, st.down))))) : null,
          c.changed.length ? h("table", { id: "changes-table" },
            h("thead", {}, h("tr", {}, ["task", "change", "before: reward and reply", "after: reward and reply"].map((x) => h("th", {}, x)))),
            h("tbody", {}, c.changed.map((row) => h("tr", { "data-task": row.task, class: row.delta > 0 ? "up" : "down" },
              h("td", {}, h("a", { href: `#/task/${encodeURIComponent(row.after.rollout_id)}?mode=${mode}` }, h("pre", {}, preview(typeof row.input === "string" ? row.input : JSON.stringify(row.input), 200)))),
              h("td", { class: "delta " + (row.delta > 0 ? "pos" : "neg") }, deltaText(row.delta)),
              reply(row.before), reply(row.after))))) : null]);
    },
  };
}

function taskView(rolloutId, mode) {
  fill(view, h("div", { class: "empty" }, "loading…"));
  return {
    load: () => api("rollouts/" + encodeURIComponent(rolloutId) + "/task" + (mode ? "?mode=" + encodeURIComponent(mode) : "")),
    draw: (t) => fill(view,
      h("h2", {}, h("a", { href: "#/changes" + (mode ? "?mode=" + mode : "") }, "What changed"), " · one task across versions"),
      h("div", { class: "panel kv" }, h("span", {}, "task"), h("pre", {}, typeof t.input === "string" ? t.input : JSON.stringify(t.input, null, 2))),
      h("table", { id: "task-history" },
        h("thead", {}, h("tr", {}, ["version", "mode", "reward", "calls", "tool calls", "reply"].map((x) => h("th", {}, x)))),
        h("tbody", {}, t.rollouts.map((r) => h("tr", { class: "link", "data-rollout": r.rollout_id, onclick: () => { location.hash = "#/rollout/" + encodeURIComponent(r.rollout_id); } },
          h("td", {}, r.version === null ? "–" : versionNumber(r) + (r.model_version ? ` · ${r.model_version}` : "")), h("td", {}, r.mode),
          h("td", { class: "reward" }, fmtReward(r.reward)), h("td", {}, r.calls), h("td", {}, r.tool_calls),
          h("td", { class: "reply" }, h("pre", {}, preview(r.reply || "(no reply)", 400)))))))),
  };
}

// ----- start ---------------------------------------------------------------------------------------
window.addEventListener("hashchange", () => show(route()));
setInterval(() => { if (document.getElementById("live").checked) refresh(false); }, POLL_MS);
show(route());
