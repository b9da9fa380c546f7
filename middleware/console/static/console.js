// The steptap console: polls the proxy's /console/api and draws it. Everything an agent sent is put in the
// page as text (textContent, never innerHTML): a <script> in a message stays a string.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { role: null, open: null, filters: "" };

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c ?? "")));
  return node;
}

async function api(path, body) {
  const init = { credentials: "same-origin", headers: { "X-Steptap-Console": "1" } };
  if (body !== undefined) {
    init.method = "POST";
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const r = await fetch(path, init);
  const data = await r.json().catch(() => ({}));
  if (r.status === 401) showLogin();
  if (!r.ok) throw new Error((data.error && data.error.message) || r.statusText);
  return data;
}

// ---- login: a one-time code from the link's fragment (never sent in a URL), or a pasted token ----------
async function login(body) {
  const r = await api("/console/api/login", body);
  start(r.role);
}

function showLogin() {
  $("main").hidden = true;
  $("login").hidden = false;
  $("logout").hidden = true;
}

function start(role) {
  state.role = role;
  $("role").textContent = role;
  $("login").hidden = true;
  $("main").hidden = false;
  $("logout").hidden = false;
  $("actions").hidden = role !== "control";
  refresh();
}

// ---- the overview -----------------------------------------------------------------------------------
function fmt(v, digits) {
  if (v === null || v === undefined) return "-";
  return typeof v === "number" ? v.toFixed(digits ?? 0) : String(v);
}

function curve(svg, points) {
  svg.replaceChildren();
  const ns = "http://www.w3.org/2000/svg";
  const mk = (tag, attrs) => {
    const n = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
    return n;
  };
  svg.append(mk("line", { x1: 30, y1: 120, x2: 310, y2: 120, class: "axis" }));
  if (!points.length) return;
  const ys = points.map((p) => p.mean);
  const lo = Math.min(...ys, 0), hi = Math.max(...ys, lo + 1e-9);
  const maxV = Math.max(...points.map((p) => p.version), 1);
  const xy = points.map((p) => [30 + (280 * p.version) / maxV, 120 - (100 * (p.mean - lo)) / (hi - lo)]);
  svg.append(mk("polyline", { points: xy.map((q) => q.join(",")).join(" "), class: "line" }));
  points.forEach((p, i) => {
    const c = mk("circle", { cx: xy[i][0], cy: xy[i][1], r: 3, class: "point" });
    const t = mk("title", {});
    t.textContent = `version ${p.version}: ${p.mean.toFixed(3)} (${p.n})`;
    c.append(t);
    svg.append(c);
  });
  const label = mk("text", { x: 32, y: 12 });
  label.textContent = `${hi.toFixed(2)} max, ${lo.toFixed(2)} min, v0..v${maxV}`;
  svg.append(label);
}

function table(node, header, rows) {
  node.replaceChildren(el("tr", {}, ...header.map((h) => el("th", {}, h))));
  for (const r of rows) node.append(el("tr", {}, ...r.map((c) => el("td", {}, c))));
}

// The run's health (docs/health.md): what is wrong, in words, and the figures behind it
function health(h) {
  const l = h.learner || {}, p = h.proxy || {};
  const pct = (v) => (v === null || v === undefined ? "-" : (100 * v).toFixed(0) + "%");
  const figures = `groups with reward variance ${pct(l.groups_varied)}, tokens in the loss ` +
    `${pct(l.tokens_trained)}, replies cut ${pct(l.replies_cut)}, logprob gap ${fmt(l.logprob_gap, 3)}, ` +
    `version lag ${fmt(l.version_lag, 1)}; sessions ${p.opened} opened, ${p.finished} finished, ` +
    `${p.aborted} aborted, ${p.open} open, ${p.held} pending`;
  const items = h.findings.map((f) => el("li", { class: f.level, "data-cause": f.cause },
    el("b", {}, `${f.level} (${f.cause})`), " ", f.text));
  if (h.stopped) items.unshift(el("li", { class: "stop", "data-cause": h.stopped.cause },
    el("b", {}, "the learner stopped the run"), " ", h.stopped.text));
  $("health").replaceChildren(el("h3", {}, items.length ? "run health" : "run health: nothing to name"),
    el("ul", {}, ...items), el("p", { class: "muted" }, figures));
}

async function overview() {
  const s = await api("/console/api/summary");
  health(s.health);
  const last = s.learner.length ? s.learner[s.learner.length - 1] : {};
  const cards = [
    ["sessions open", s.sessions_open], ["finished", s.sessions_finished], ["calls/s", fmt(s.calls_per_s, 1)],
    ["steps", s.steps], ["policy version", s.policy_version], ["swaps", s.swaps.count],
    ["last pause", s.swaps.last_paused_s === null ? "-" : fmt(s.swaps.last_paused_s, 2) + " s"],
    ["updates", fmt(last.update)], ["log disk", fmt(s.log.disk_bytes / 1048576, 1) + " MiB"],
    ["replicas up", `${s.replicas.filter((r) => r.healthy).length}/${s.replicas.length}`],
  ];
  $("cards").replaceChildren(...cards.map(([k, v]) => el("div", { class: "card" }, k, el("b", {}, v))));
  curve($("reward-curve"), s.reward_curve);
  curve($("eval-curve"), s.eval_curve);
  table($("learner"), ["update", "loss", "kl", "grad norm", "clip", "reward", "dropped by curation"],
    s.learner.slice(-8).map((r) => [r.update, fmt(r.loss, 4), fmt(r.ppo_kl, 4), fmt(r.grad_norm, 3),
      fmt(r.pg_clipfrac, 3), fmt(r.reward_mean, 3),
      ((r.counts || {}).dropped_curated || 0) + ((r.counts || {}).dropped_curated_steps || 0)]));
  table($("swaps"), ["version", "at", "paused (s)"], s.swaps.history.slice(-8).map((w) =>
    [w.version, w.at ? new Date(w.at * 1000).toLocaleTimeString() : "-", fmt(w.paused_s, 3)]));
  table($("replicas"), ["#", "state", "in flight", "calls"], s.replicas.map((r, i) =>
    [i + 1, r.state, r.in_flight, r.calls]));
  $("status").textContent = `updated ${new Date(s.time * 1000).toLocaleTimeString()}`;
}

// ---- the task solve grid (steptap tasks: docs/tasks.md) --------------------------------------------
async function taskGrid() {
  const g = await api("/console/api/tasks");
  $("tasks").hidden = !g.tasks.length;
  if (!g.tasks.length) return;
  $("tasks-note").textContent = `solved: a reward of at least ${g.solved_at}; an infrastructure error is ` +
    "counted apart, never as a failure";
  table($("task-grid"), ["task", "mode", ...g.versions.map((v) => `v${v}`)], g.tasks.map((t) =>
    [`${t.dataset}/${t.name} #${t.hash.slice(0, 8)}`, t.mode, ...g.versions.map((v) => {
      const c = t.versions[String(v)];
      if (!c) return "";
      return `${c.solved}/${c.episodes}` + (c.infra_errors ? ` (+${c.infra_errors} infra)` : "");
    })]));
}

// ---- the list ---------------------------------------------------------------------------------------
async function sessions() {
  const data = await api("/console/api/sessions?" + state.filters);
  const body = $("session-table").tBodies[0];
  body.replaceChildren();
  for (const s of data.sessions) {
    const cur = s.curation || {};
    const marks = [cur.excluded ? "excluded" : "", ...(cur.tags || [])].filter(Boolean).join(" ");
    const row = el("tr", { "data-id": s.id, class: cur.excluded ? "excluded" : "" },
      el("td", {}, s.id), el("td", {}, s.group_id ?? ""), el("td", {}, s.status), el("td", {}, fmt(s.reward, 3)),
      el("td", {}, s.steps), el("td", {}, s.version ?? ""), el("td", {}, marks));
    row.addEventListener("click", () => openTrajectory(s.id));
    body.append(row);
  }
}

// ---- one trajectory ---------------------------------------------------------------------------------
function bucket(lp) {
  const p = Math.exp(lp);
  return p > 0.9 ? 0 : p > 0.6 ? 1 : p > 0.3 ? 2 : p > 0.1 ? 3 : p > 0.01 ? 4 : 5;
}

function content(c) {
  return typeof c === "string" ? c : JSON.stringify(c, null, 1);
}

function stepNode(step, cur) {
  const excluded = (cur.excluded_steps || []).includes(step.index);
  const head = el("div", { class: "step-head" + (excluded ? " excluded" : "") },
    `step ${step.index}`, el("span", { class: "tag" }, `class ${step.call_class}`),
    el("span", { class: "tag" }, `prefix ${step.prefix}`), el("span", { class: "tag" }, `v${step.policy_version}`),
    el("span", { class: "tag" }, `status ${step.status}`),
    el("span", { class: "tag" }, `rewards ${JSON.stringify(step.rewards)}`));
  const node = el("div", { class: "step", "data-index": step.index }, head);
  if (state.role === "control") {
    const b = el("button", { type: "button", class: "step-exclude" }, excluded ? "include step" : "exclude step");
    b.addEventListener("click", () => mark({ action: excluded ? "include" : "exclude", step: step.index }));
    head.append(" ", b);
  }
  const req = step.request || {};
  for (const m of req.messages || []) {
    node.append(el("div", { class: "msg-role" }, m.role), el("pre", { class: "msg" }, content(m.content ?? "")));
    for (const tc of m.tool_calls || []) node.append(el("pre", { class: "tool-call" }, content(tc)));
  }
  if (req.prompt !== undefined) node.append(el("pre", { class: "msg" }, content(req.prompt)));
  const resp = step.response || {};
  node.append(el("div", { class: "msg-role" }, "response"), el("pre", { class: "response" }, content(resp.content ?? "")));
  for (const tc of resp.tool_calls || []) node.append(el("pre", { class: "tool-call" }, content(tc)));
  const toks = el("div", { class: "tokens" });
  step.response_token_ids.forEach((id, i) => {
    const lp = step.response_logprobs[i];
    const span = el("span", { class: `tok lp${bucket(lp ?? 0)}`, title: `logprob ${lp}` }, id);
    toks.append(span);
  });
  node.append(toks);
  return node;
}

async function openTrajectory(id) {
  const t = await api("/console/api/sessions/" + encodeURIComponent(id));
  if (state.open !== id) $("action-result").textContent = "";
  state.open = id;
  const cur = t.curation || {};
  $("trajectory").hidden = false;
  $("traj-id").textContent = id;
  $("traj-head").textContent = `status ${t.status}, reward ${fmt(t.reward, 3)} ${JSON.stringify(t.rewards)}, ` +
    `group ${t.group_id ?? "-"}, mode ${t.mode}, metadata ${JSON.stringify(t.metadata)}` +
    (cur.excluded ? ", EXCLUDED" : "") + (cur.tags && cur.tags.length ? `, tags ${cur.tags.join(" ")}` : "");
  $("traj-head").className = cur.excluded ? "excluded" : "muted";
  // held (finished, its reward pending): a person's rating releases it to the learner
  $("rate").hidden = !t.pending;
  $("traj-pending").textContent = t.pending ? "reward pending until " +
    new Date(t.pending.deadline_at * 1000).toLocaleTimeString() + ` (then ${t.pending.on_deadline})` : "";
  taskRun(t);
  $("steps").replaceChildren(...t.steps.map((s) => stepNode(s, cur)));
}

// A task episode's agent and verifier as they ended, beside its steps (their output as text only)
function taskRun(t) {
  const run = t.task_run || {};
  const parts = [];
  if (t.status === "infra_error") {
    parts.push(el("div", { class: "error" }, `infrastructure error (${t.infra_cause || "other"}): ${t.error || ""}`));
  }
  for (const [name, end] of [["agent", run.agent], ["verifier", run.verifier]]) {
    if (!end) continue;
    const how = end.timed_out ? "killed at its timeout" : `exit ${fmt(end.exit_code)}`;
    parts.push(el("div", { class: "msg-role" }, `${name}: ${how}, ${fmt(end.seconds, 1)} s`),
      el("pre", { class: `run-output ${name}-output` }, end.output || ""));
  }
  $("traj-task").replaceChildren(...parts);
}

async function mark(body) {
  const r = await api(`/console/api/sessions/${encodeURIComponent(state.open)}/curation`, body);
  $("action-result").textContent = `marked: ${r.mark.action}` + (r.mark.step !== null ? ` step ${r.mark.step}` : "");
  await openTrajectory(state.open);
  await sessions();
}

async function rateOpen() {
  const raw = $("rate-value").value.trim();
  const value = Number(raw);
  if (raw === "" || !Number.isFinite(value)) {
    $("action-result").textContent = "a rating is a number";
    return;
  }
  const id = state.open;
  const r = await api(`/console/api/sessions/${encodeURIComponent(id)}/rewards`, { value });
  $("rate-value").value = "";
  $("action-result").textContent = `rated ${r.value}: ` + (r.released ? "released to the learner" :
    r.late ? "recorded late (already streamed: not trained)" : "recorded on the open session");
  await openTrajectory(id);
  await sessions();
}

// ---- wiring -----------------------------------------------------------------------------------------
async function refresh() {
  try {
    await overview();
    await taskGrid();
    await sessions();
  } catch (e) {
    $("status").textContent = String(e.message || e);
  }
}

document.addEventListener("DOMContentLoaded", async () => {
  $("login-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    try { await login({ token: $("login-token").value }); } catch (e) { $("login-error").textContent = e.message; }
    $("login-token").value = "";
  });
  $("logout").addEventListener("click", async () => { await api("/console/api/logout", {}); showLogin(); });
  $("filters").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const q = new URLSearchParams();
    for (const [k, v] of new FormData($("filters"))) if (v) q.set(k, v);
    state.filters = q.toString();
    sessions();
  });
  $("exclude").addEventListener("click", () => mark({ action: "exclude", reason: "excluded in the console" }));
  $("include").addEventListener("click", () => mark({ action: "include" }));
  $("set-reward").addEventListener("click", () => mark({ action: "reward", value: Number($("reward-value").value) }));
  $("add-tag").addEventListener("click", () => mark({ action: "tag", tags: [$("tag-value").value] }));
  $("rate-send").addEventListener("click", () => rateOpen().catch((e) => {
    $("action-result").textContent = String(e.message || e);
  }));
  const code = new URLSearchParams(location.hash.slice(1)).get("code");
  history.replaceState(null, "", location.pathname);  // the code leaves the address bar and the history
  try {
    if (code) await login({ code });
    else start((await api("/console/api/me")).role);
  } catch (e) {
    showLogin();
    if (code) $("login-error").textContent = e.message;
  }
  setInterval(() => { if (state.role) refresh(); }, 2000);
});
