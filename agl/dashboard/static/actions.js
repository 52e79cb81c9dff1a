// What a person does from the page, beyond reading: flag rollouts, export the flagged (or filtered) ones
// as a data set, and replay a recorded model call. Loaded before app.js; it uses app.js's helpers (h, api,
// refresh, message, TOKEN_KEY) only when called, never while loading.
"use strict";

const FLAG_KEY = "agl.flag"; // rollout metadata: 1 flagged, 0 not
const isFlagged = (r) => !!(r && r.metadata && r.metadata[FLAG_KEY] === 1);

function authHeaders(extra) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  return { ...(token ? { Authorization: "Bearer " + token } : {}), ...(extra || {}) };
}

// A JSON POST to the API (the token in its header, never in the URL); errors carry the API's message.
async function apiPost(path, body) {
  const response = await fetch("api/" + path, { method: "POST", headers: authHeaders({ "Content-Type": "application/json" }), body: JSON.stringify(body) });
  const answer = await response.json().catch(() => ({}));
  if (response.status === 401) throw new Unauthorized(answer.error ? answer.error.message : "unauthorized");
  if (!response.ok) throw new Error(answer.error ? answer.error.message : "HTTP " + response.status);
  return answer;
}

// A star that flags or unflags a rollout (kept in the store, so every browser sees it); in a list row it
// does not open the rollout.
function flagButton(r) {
  const on = isFlagged(r);
  return h("button", {
    class: "flag" + (on ? " on" : ""), "data-flag": r.rollout_id, "aria-pressed": on ? "true" : "false",
    title: on ? "flagged for export: click to unflag" : "flag for export",
    onclick: async (e) => {
      e.stopPropagation();
      e.currentTarget.disabled = true;
      try { await apiPost(`rollouts/${encodeURIComponent(r.rollout_id)}/flag`, { flagged: !on }); }
      catch (err) { showBanner("Could not flag: " + err.message); }
      refresh(true);
    },
  }, on ? "★" : "☆");
}

// Export the flagged rollouts, or those the list's filters match, as SFT JSONL or as agl eval tasks.
// The file comes through fetch (the token is a header a plain link cannot send) and is saved from a blob.
function exportBar(filters) {
  const scope = h("select", { id: "export-scope" },
    h("option", { value: "flagged" }, "the flagged rollouts"), h("option", { value: "filtered" }, "the rollouts these filters match"));
  const note = h("span", { class: "mute", id: "export-note" });
  const run = (format) => async () => {
    const params = scope.value === "flagged" ? new URLSearchParams({ flagged: "1" }) : filters();
    params.set("format", format);
    note.textContent = "exporting…";
    try { note.textContent = await download("export?" + params); }
    catch (err) { note.textContent = "Could not export: " + err.message; }
  };
  return h("div", { class: "filters export-bar" }, h("span", { class: "mute" }, "export"), scope, " as ",
    h("button", { id: "export-sft", title: "OpenAI chat JSONL with tools: WarmStart.from_jsonl, SFT", onclick: run("sft") }, "SFT JSONL"),
    h("button", { id: "export-eval", title: "one task input a line: agl eval --tasks", onclick: run("eval") }, "eval tasks"), note);
}

async function download(path) {
  const response = await fetch("api/" + path, { headers: authHeaders() });
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    if (response.status === 401) throw new Unauthorized(body.error ? body.error.message : "unauthorized");
    throw new Error(body.error ? body.error.message : "HTTP " + response.status);
  }
  const name = (/filename="([^"]+)"/.exec(response.headers.get("Content-Disposition") || "") || [])[1] || "export.jsonl";
  const link = h("a", { href: URL.createObjectURL(await response.blob()), download: name, hidden: true });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 60_000);
  return `${response.headers.get("X-Agl-Exported")} written (of ${response.headers.get("X-Agl-Matched")} matching) to ${name}`;
}

// ----- replay: a recorded call resent to an endpoint, model or policy version, its reply beside the recorded one
const replays = new Map(); // span id -> its replay box: kept across redraws with what was typed and answered

function replayBox(sp) {
  if (replays.has(sp.span_id)) return replays.get(sp.span_id);
  const d = sp.detail;
  const settings = d.settings || {};
  const input = (name, attrs) => h("input", { name, class: "replay-" + name.replace("_", "-"), ...attrs });
  const endpoint = input("endpoint", { type: "text", size: 36, placeholder: "endpoint (default: the call's gateway)" });
  const model = input("model", { type: "text", placeholder: "model (default: " + (d.model || "as recorded") + ")" });
  const key = input("api_key", { type: "password", size: 14, placeholder: "API key (optional)", autocomplete: "off" });
  const version = h("select", { name: "resources_id", class: "replay-version" }, h("option", { value: "" }, "policy: the rollout's own"));
  const temperature = input("temperature", { type: "number", step: "0.1", min: "0", max: "2", value: settings.temperature ?? "" });
  const maxTokens = input("max_tokens", { type: "number", min: "1", value: settings.max_tokens ?? settings.max_completion_tokens ?? "" });
  const out = h("div", { class: "replay-out" });
  const number = (el) => (el.value === "" ? undefined : Number(el.value));
  const run = h("button", { class: "replay-run", onclick: async () => {
    run.disabled = true;
    out.replaceChildren(h("div", { class: "mute" }, "replaying…"));
    try {
      const answer = await apiPost("replay", {
        rollout_id: sp.rollout_id, span_id: sp.span_id, endpoint: endpoint.value.trim() || undefined, model: model.value.trim() || undefined,
        resources_id: version.value || undefined, api_key: key.value || undefined, temperature: number(temperature), max_tokens: number(maxTokens),
      });
      out.replaceChildren(replayPair(answer));
    } catch (err) {
      out.replaceChildren(h("div", { class: "replay-error" }, "Replay failed: " + err.message));
    }
    run.disabled = false;
  } }, "Replay");
  const form = h("div", { class: "replay-form", hidden: true },
    h("div", { class: "filters" }, endpoint, key, model, version, h("label", {}, "temperature ", temperature), h("label", {}, "max tokens ", maxTokens), run), out);
  let listed = false;
  const toggle = h("button", { class: "link-button replay-toggle", onclick: () => {
    form.hidden = !form.hidden;
    if (!form.hidden && !listed) {
      listed = true;
      api("resources").then((list) => version.append(...list.items.map((v) => h("option", { value: v.resources_id }, "policy: " + versionLabel(v))))).catch(() => {});
    }
  } }, "replay this call…");
  const box = h("div", { class: "replay", "data-replay": sp.span_id }, toggle, form);
  replays.set(sp.span_id, box);
  return box;
}

function replayPair(answer) {
  const side = (title, reply, extra) => h("div", { class: "replay-side " + title },
    h("div", { class: "title" }, h("b", {}, title), h("span", { class: "mute" }, "  " + [reply.model, reply.finish_reason, usageText(reply.usage), extra].filter(Boolean).join(" · "))),
    reply.message ? message(reply.message) : h("div", { class: "mute" }, "(no message)"));
  const r = answer.replayed;
  const sent = Object.entries(r.request || {}).map(([k, v]) => `${k}=${v}`).join(" ");
  return h("div", { class: "replay-pair" }, side("recorded", answer.recorded, ""),
    side("replayed", r, `${fmtMs(r.latency_ms)} · ${r.endpoint} · ${sent}`));
}
