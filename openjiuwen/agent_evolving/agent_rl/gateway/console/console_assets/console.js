// The read-only console: a hash-routed single page over /console/api (session cookie, same origin).
// Everything is built with DOM calls and textContent, never innerHTML, so no record field can inject markup.
"use strict";
(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const view = document.getElementById("view");
  const TASK_COLORS = {
    created: "#64748b", capture_reserved: "#93c5fd", capture_committed: "#2f6fed", capture_discarded: "#f59e0b",
    turn_publishing: "#a78bfa", turn_published: "#7c3aed", turn_failed: "#c0362c", finalized: "#16803c",
    aborted: "#c0362c", reward_recorded: "#0d9488", reward_expired: "#b7791f",
  };
  const TASK_LANES = [
    ["lifecycle", ["created", "finalized", "aborted"]],
    ["captures", ["capture_reserved", "capture_committed", "capture_discarded"]],
    ["turns", ["turn_publishing", "turn_published", "turn_failed"]],
    ["rewards", ["reward_recorded", "reward_expired"]],
  ];
  const STAGE_COLORS = { queued: "#f59e0b", training: "#2f6fed", activating: "#7c3aed" };
  const END_EVENTS = ["succeeded", "failed", "canceled"];

  // ------------------------------------------------------------------ helpers

  function h(tag, attrs) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined) continue;
      if (k === "text") el.textContent = v;
      else if (k === "on") for (const [ev, fn] of Object.entries(v)) el.addEventListener(ev, fn);
      else el.setAttribute(k, v);
    }
    for (let i = 2; i < arguments.length; i++) append(el, arguments[i]);
    return el;
  }
  function append(el, child) {
    if (child === null || child === undefined || child === false) return;
    if (Array.isArray(child)) child.forEach(function (c) { append(el, c); });
    else el.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  function s(tag, attrs) {
    const el = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") el.textContent = v; else el.setAttribute(k, v);
    }
    for (let i = 2; i < arguments.length; i++) if (arguments[i]) el.appendChild(arguments[i]);
    return el;
  }
  function pill(value) { return h("span", { class: "pill " + String(value || ""), text: value || "-" }); }
  function num(value, digits) {
    if (value === null || value === undefined || value === "") return "-";
    if (typeof value !== "number") return String(value);
    return Number.isInteger(value) ? String(value) : value.toFixed(digits === undefined ? 3 : digits);
  }
  function ms(t) { const v = Date.parse(t); return Number.isNaN(v) ? null : v; }
  function when(t) {
    const v = ms(t);
    return v === null ? "-" : new Date(v).toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z");
  }
  function short(t) {  // tables: month-day and UTC time
    const v = ms(t);
    return v === null ? "-" : new Date(v).toISOString().slice(5, 19).replace("T", " ");
  }
  function secs(delta) {
    if (delta === null || delta === undefined || Number.isNaN(delta)) return "-";
    const v = delta / 1000;
    return v < 1 ? (delta.toFixed(0) + " ms") : v < 120 ? v.toFixed(2) + " s" : (v / 60).toFixed(1) + " min";
  }
  function dataText(data) {
    if (!data || typeof data !== "object") return "";
    return Object.entries(data).map(function (kv) {
      const v = kv[1];
      return kv[0] + "=" + (v !== null && typeof v === "object" ? JSON.stringify(v) : String(v));
    }).join("  ");
  }
  // A capture's sampling (common/sampling.py): the temperature, then what differs from vLLM's neutral values, then
  // the kinds of what constrained it (common/constraints.py).
  function samplingText(sp) {
    if (!sp || typeof sp !== "object") return "-";
    const parts = ["T " + sp.temperature];
    if (sp.top_p !== 1) parts.push("top_p " + sp.top_p);
    if (sp.top_k > 0) parts.push("top_k " + sp.top_k);
    if (sp.min_p > 0) parts.push("min_p " + sp.min_p);
    const kinds = Object.keys(sp.constraints || {});
    if (kinds.length) parts.push("[" + kinds.join(", ") + "]");
    return parts.join(" ");
  }
  function countsText(counts) {
    const entries = Object.entries(counts || {});
    return entries.length ? entries.map(function (kv) { return kv[0] + "×" + kv[1]; }).join(", ") : "-";
  }
  function runSamplingText(rep) {
    if (!rep || typeof rep !== "object") return "-";
    const temps = Object.entries(rep.temperatures || {}).map(function (kv) { return kv[0] + "×" + kv[1]; }).join(", ");
    return "T " + (temps || "-") + " · truncated " + num(rep.truncated_samples) + " · |captured − recomputed| mean "
      + num(rep.logprob_mismatch_mean, 4) + ", max " + num(rep.logprob_mismatch_max, 4) + " · ratios clipped "
      + num(100 * rep.ratio_clipped_share, 1) + "% (" + rep.correction + ")"
      + (rep.constrained_samples ? " · constrained " + num(rep.constrained_samples) : "");
  }
  function link(href, text, cls) { return h("a", { href: href, text: text, class: cls }); }
  function fields(rows) {
    return h("dl", { class: "fields" }, rows.map(function (r) {
      return [h("dt", { text: r[0] }), h("dd", {}, r[1] === null || r[1] === undefined || r[1] === "" ? "-" : r[1])];
    }));
  }
  function table(headers, rows, empty) {
    if (!rows.length) return h("p", { class: "muted", text: empty || "Nothing yet." });
    return h("table", {},
      h("thead", {}, h("tr", {}, headers.map(function (c) {
        return h("th", { class: c.endsWith("#") ? "num" : null, text: c.replace(/#$/, "") });
      }))),
      h("tbody", {}, rows.map(function (r) {
        return h("tr", {}, r.map(function (cell, i) {
          return h("td", { class: headers[i].endsWith("#") ? "num" : null }, cell);
        }));
      })));
  }
  function card(k, v, sub, cls) {
    return h("div", { class: "card" }, h("div", { class: "k", text: k }), h("div", { class: "v " + (cls || "") }, v),
      sub ? h("div", { class: "s" }, sub) : null);
  }
  function setView() {
    view.replaceChildren();
    append(view, Array.from(arguments));
    view.dataset.loads = String(Number(view.dataset.loads || 0) + 1);
    document.getElementById("updated").textContent = "Loaded " + new Date().toISOString().replace(/\.\d+Z$/, "Z");
  }
  function problem(answer) {
    const err = answer.body && answer.body.error;
    const text = err ? err.code + ": " + err.message : "HTTP " + answer.status;
    return h("p", { class: "bad", text: text });
  }

  async function api(path) {
    const resp = await fetch("/console/api/" + path, { credentials: "same-origin", headers: { accept: "application/json" } });
    if (resp.status === 401) {
      window.location.replace("/console/login");
      throw new Error("session expired");
    }
    let body = null;
    try { body = await resp.json(); } catch (e) { body = null; }
    return { ok: resp.ok, status: resp.status, body: body };
  }
  async function allTasks(limit) {
    const answer = await api("rl/tasks?limit=" + limit);
    return answer.ok ? answer.body.items : [];
  }

  // ------------------------------------------------------------------ lineage selector (docs/lineages.md)

  // Which views follow the selected lineage: what the RL API answers per lineage. The others say so in #scope.
  const SCOPES = {
    policies: "lineage", loras: "lineage",
    rollout: "lineage",
    tasks: "lineage", runs: "lineage",
    record: "one record, of the lineage its fields name",
    overview: "the service; its LoRA card is the default lineage's",
  };
  const DEFAULT_LINEAGE = "default";
  const picker = document.getElementById("lineage");
  const morePicker = document.getElementById("lineage-more");
  const lines = {};  // lineage -> its line, as listed
  const states = {};  // lineage -> its lifecycle state as listed (docs/lineages.md "Lifecycle"); absent: live
  let lineagesSupported = false, lineageCursor = null;
  let lineage = sessionStorage.getItem("console.lineage") || DEFAULT_LINEAGE;  // kept across reloads of the tab

  function lineOf(name) { return lines[name] || lines[DEFAULT_LINEAGE] + ":" + name; }
  // The `?lineage=` of a per-lineage RL read: never sent to an RL Service without lineages.
  function lineageQuery(sep) { return lineagesSupported ? sep + "lineage=" + encodeURIComponent(lineage) : ""; }
  function lineageCell(item) {
    const name = item.lineage || DEFAULT_LINEAGE;  // records carry `lineage` only when it is not the default
    return h("span", { class: "mono" + (name === lineage ? " sel" : ""), text: name });
  }

  async function loadLineages(more) {
    const answer = await api("lineages?limit=100" + (more && lineageCursor ? "&cursor=" + encodeURIComponent(lineageCursor) : ""));
    if (!answer.ok) return;  // the RL Service is down: the default lineage alone, its line from the overview
    lineagesSupported = answer.body.lineages_supported !== false;
    lineageCursor = answer.body.next_cursor || null;
    answer.body.items.forEach(function (item) {
      // A lineage being deleted is going away (its records answer 404): not offered. An archived one is, marked.
      if (lines[item.lineage] || item.state === "deleting") return;
      lines[item.lineage] = item.line;
      states[item.lineage] = item.state || "live";
      const label = states[item.lineage] === "live" ? item.lineage : item.lineage + " (" + states[item.lineage] + ")";
      picker.appendChild(h("option", { value: item.lineage, text: label, "data-state": states[item.lineage] }));
    });
    morePicker.hidden = !lineageCursor;
  }

  async function initLineages(model) {
    lines[DEFAULT_LINEAGE] = model;
    picker.appendChild(h("option", { value: DEFAULT_LINEAGE, text: DEFAULT_LINEAGE }));
    await loadLineages(false);
    if (!lines[lineage] || !lineagesSupported) lineage = DEFAULT_LINEAGE;  // a lineage no longer listed: the first
    picker.value = lineage;
    picker.addEventListener("change", function () {
      lineage = picker.value;
      sessionStorage.setItem("console.lineage", lineage);
      route();
    });
    morePicker.addEventListener("click", function () { loadLineages(true); });
  }

  // ------------------------------------------------------------------ charts (inline SVG)

  function lineChart(title, points, opts) {
    // points: [{x: label, y: number, lo?, hi?}]
    const W = (opts && opts.width) || 560, H = (opts && opts.height) || 220, L = 48, R = 40, T = 26, B = 34;
    const svg = s("svg", { class: "chart", viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": title });
    svg.appendChild(s("text", { x: L, y: 16, text: title }));
    const ys = [];
    points.forEach(function (p) { [p.y, p.lo, p.hi].forEach(function (v) { if (typeof v === "number") ys.push(v); }); });
    if (!ys.length) { svg.appendChild(s("text", { x: L, y: H / 2, text: "no data yet" })); return svg; }
    let lo = opts && opts.min !== undefined ? Math.min(opts.min, Math.min.apply(null, ys)) : Math.min.apply(null, ys);
    let hi = opts && opts.max !== undefined ? Math.max(opts.max, Math.max.apply(null, ys)) : Math.max.apply(null, ys);
    if (hi - lo < 1e-9) { hi += 0.5; lo -= 0.5; }
    const px = function (i) { return points.length === 1 ? (L + W - R) / 2 : L + i * (W - L - R) / (points.length - 1); };
    const py = function (v) { return T + (hi - v) * (H - T - B) / (hi - lo); };
    for (let g = 0; g <= 4; g++) {
      const v = lo + g * (hi - lo) / 4;
      svg.appendChild(s("line", { class: "grid", x1: L, x2: W - R, y1: py(v), y2: py(v) }));
      svg.appendChild(s("text", { x: L - 6, y: py(v) + 4, "text-anchor": "end", text: v.toFixed(2) }));
    }
    svg.appendChild(s("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
    const path = [];
    points.forEach(function (p, i) {
      if (typeof p.lo === "number" && typeof p.hi === "number") {
        svg.appendChild(s("line", { class: "ci", x1: px(i), x2: px(i), y1: py(p.lo), y2: py(p.hi) }));
      }
      if (typeof p.y === "number") path.push((path.length ? "L" : "M") + px(i).toFixed(1) + " " + py(p.y).toFixed(1));
      svg.appendChild(s("text", { x: px(i), y: H - B + 16, "text-anchor": "middle", text: p.x }));
    });
    svg.appendChild(s("path", { class: "line", d: path.join(" ") }));
    points.forEach(function (p, i) {
      if (typeof p.y !== "number") return;
      svg.appendChild(s("circle", { class: "dot", cx: px(i), cy: py(p.y), r: 4 },
        s("title", { text: p.x + ": " + p.y.toFixed(3) + (typeof p.lo === "number" ? " [" + p.lo.toFixed(3) + ", " + p.hi.toFixed(3) + "]" : "") })));
    });
    return svg;
  }

  function eventTimeline(events, lanes, colors, t0, t1) {
    // One row per lane, one mark per event at its time; hover shows the type and data.
    const W = 900, L = 90, R = 20, row = 28, H = 30 + lanes.length * row;
    const span = Math.max(t1 - t0, 1);
    const x = function (t) { return L + (t - t0) * (W - L - R) / span; };
    const svg = s("svg", { class: "chart", viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": "timeline" });
    lanes.forEach(function (lane, i) {
      const y = 16 + i * row;
      svg.appendChild(s("text", { x: 8, y: y + 12, text: lane[0] }));
      svg.appendChild(s("line", { class: "grid", x1: L, x2: W - R, y1: y + 8, y2: y + 8 }));
    });
    events.forEach(function (e) {
      const lane = lanes.findIndex(function (l) { return l[1].indexOf(e.type) >= 0; });
      const t = ms(e.at);
      if (lane < 0 || t === null) return;
      const y = 16 + lane * row;
      svg.appendChild(s("rect", { x: x(t) - 3, y: y, width: 6, height: 16, rx: 2, fill: colors[e.type] || "#667085" },
        s("title", { text: e.type + " +" + secs(t - t0) + " " + dataText(e.data) })));
    });
    svg.appendChild(s("text", { x: L, y: H - 2, text: "0" }));
    svg.appendChild(s("text", { x: W - R, y: H - 2, "text-anchor": "end", text: "+" + secs(span) }));
    return svg;
  }

  function legend(colors) {
    return h("div", { class: "legend" }, Object.entries(colors).map(function (kv) {
      const sw = h("i", {}); sw.style.background = kv[1];
      return h("span", {}, sw, kv[0]);
    }));
  }

  // ------------------------------------------------------------------ pages

  async function overview() {
    const [ov, tasks, runs] = await Promise.all([api("overview"), api("rl/tasks?limit=5"), api("rl/runs?limit=5")]);
    if (!ov.ok) return setView(h("h1", { text: "Overview" }), problem(ov));
    const o = ov.body, lora = o.lora, traj = o.trajectories || {};
    const byStatus = traj.by_status || {};
    document.getElementById("model").textContent = "model " + o.model_id;
    setView(
      h("h1", { text: "Overview" }),
      h("div", { class: "cards" },
        card("RL Service", pill(o.service.status), o.service.failure_reason),
        card("Policy", lora.active_lora ? lora.active_lora.lora_name : "base", pill(lora.status)),
        card("Instances", lora.instances.ready + " ready", lora.instances.failed + " failed"),
        card("Samples", num(traj.total), "pending " + num(byStatus.pending) + " · trained " + num(byStatus.trained)),
        card("Stale / expired", num(traj.stale) + " / " + num(traj.expired_unrewarded), "pending excluded / unrewarded")),
      h("h2", {}, link("#/runs", "Latest Training Runs")), runs.ok ? runTable(runs.body.items) : problem(runs),
      h("h2", {}, link("#/tasks", "Latest Tasks")), tasks.ok ? taskTable(tasks.body.items) : problem(tasks));
  }

  function taskTable(items) {
    return table(["Task", "status", "lineage", "policy", "mode", "created (UTC)", "finished", "reason"], items.map(function (t) {
      return [link("#/tasks/" + encodeURIComponent(t.rl_task_id), t.rl_task_id, "mono"), pill(t.status), lineageCell(t),
        h("span", { class: "mono", text: t.policy_lora_name }), t.reward_mode, short(t.created_at), short(t.finished_at),
        t.finish_reason || "-"];
    }), "No Tasks yet.");
  }

  // Freshness of a run (docs/training.md "Freshness"): its line's eligible-to-run wait, and each trained sample's
  // creation to the moment the version trained on it became the line's policy (activation or promotion).
  function waitText(f) { return f && typeof f.eligible_wait_seconds === "number" ? secs(f.eligible_wait_seconds * 1000) : "-"; }
  function latencyText(f, full) {
    const l = f && f.sample_to_policy_seconds;
    if (!l) return "-";
    const text = secs(l.p50 * 1000) + " / " + secs(l.p95 * 1000);
    return full ? text + " (max " + secs(l.max * 1000) + ", " + l.count + " samples, by " + f.policy_via + ")" : text;
  }
  // A verl run whose Ray resources are taken by other runs waits in stage `training` (docs/training.md "Concurrent verl
  // runs"): its record's metrics.placement says so.
  function stageText(r) {
    const p = (r.metrics || {}).placement;
    return p && p.state === "waiting" && r.status === "running" ? r.stage + " (waiting for " + p.waiting_for + ")" : r.stage;
  }
  function placementText(p) {
    if (!p) return "-";
    if (p.state === "waiting") return "waiting for " + p.waiting_for;
    return "placed after " + secs((p.waited_seconds || 0) * 1000) + " (" + (p.nproc || 1) + " × " + dataText(p.bundle)
      + (p.gpu_ids ? ", GPUs " + p.gpu_ids.join(",") : "") + ")";
  }
  function runTable(items) {
    return table(["Run", "status", "lineage", "stage", "samples#", "LoRA", "created (UTC)", "finished", "eligible → run",
      "sample → policy p50 / p95"], items.map(function (r) {
      return [link("#/runs/" + encodeURIComponent(r.training_run_id), r.training_run_id, "mono"), pill(r.status),
        lineageCell(r), stageText(r), num(r.sample_count), h("span", { class: "mono", text: r.lora_name || "-" }), short(r.created_at),
        short(r.finished_at), waitText(r.freshness), latencyText(r.freshness, false)];
    }), "No Training Runs yet.");
  }

  async function listPage(title, route, render, statuses) {
    let status = "", cursor = null, items = [];
    const body = h("div", {});
    const more = h("button", { type: "button", text: "Load more" });
    const select = statuses ? h("select", { "aria-label": "status" },
      [h("option", { value: "", text: "all" })].concat(statuses.map(function (x) { return h("option", { value: x, text: x }); }))) : null;
    async function load(reset) {
      if (reset) { cursor = null; items = []; }
      const q = ["limit=50"];
      if (status) q.push("status=" + encodeURIComponent(status));
      if (cursor) q.push("cursor=" + encodeURIComponent(cursor));
      const lq = lineageQuery("");  // the selected lineage's records only (RL listings take ?lineage=)
      if (lq) q.push(lq);
      const answer = await api(route + "?" + q.join("&"));
      if (!answer.ok) { body.replaceChildren(problem(answer)); return; }
      items = items.concat(answer.body.items);
      cursor = answer.body.next_cursor;
      body.replaceChildren(render(items));
      more.hidden = !cursor;
    }
    more.addEventListener("click", function () { load(false); });
    if (select) select.addEventListener("change", function () { status = select.value; load(true); });
    await load(true);
    setView(h("h1", { text: title }), h("div", { class: "bar" }, select ? ["status", select] : null), body, h("p", {}, more));
  }

  function rewardFlow(task, events) {
    // Where each reward came from and how long after the work it rewards it arrived.
    const finalized = events.find(function (e) { return e.type === "finalized"; });
    const lastCommit = {};
    const rows = [];
    events.forEach(function (e) {
      const d = e.data || {};
      if (e.type === "capture_committed") lastCommit[d.agent_turn_id || ""] = ms(e.at);
      if (e.type === "reward_recorded") {
        const ref = finalized ? ms(finalized.at) : null;
        rows.push([short(e.at), d.source || "terminal (POST /reward)", num(d.reward), num(d.sample_count),
          ref === null ? "-" : secs(ms(e.at) - ref) + " after finalize"]);
      } else if (e.type === "turn_published") {
        const ref = lastCommit[d.agent_turn_id || ""];
        rows.push([short(e.at), d.source || "judge (delayed feedback, turn " + (d.agent_turn_id || "?") + ")",
          num(d.reward), num(d.samples), ref === undefined ? "-" : secs(ms(e.at) - ref) + " after last capture"]);
      } else if (e.type === "reward_expired" || e.type === "turn_failed") {
        rows.push([short(e.at), e.type.replace("_", " "), "-", num(d.dropped_samples), "-"]);
      }
    });
    return table(["at", "source", "reward#", "samples#", "latency"], rows,
      task.reward_mode === "terminal" ? "No reward yet: POST /v1/rl/tasks/{id}/reward after the Task is finalized."
        : "No turn published yet.");
  }

  async function taskPage(id) {
    const enc = encodeURIComponent(id);
    const [task, ev] = await Promise.all([api("rl/tasks/" + enc), api("rl/tasks/" + enc + "/events")]);
    if (!task.ok) return setView(h("h1", { text: "Task " + id }), problem(task));
    const t = task.body, events = ev.ok ? ev.body.items : [];
    const t0 = ms(t.created_at) || (events.length ? ms(events[0].at) : Date.now());
    const t1 = events.reduce(function (m, e) { return Math.max(m, ms(e.at) || m); }, t0);
    const committed = events.filter(function (e) { return e.type === "capture_committed"; });
    const captures = committed.length;
    const samplings = committed.map(function (e) { return samplingText(e.data.sampling); })
      .filter(function (x, i, all) { return all.indexOf(x) === i; });
    setView(
      h("h1", {}, "Task ", h("span", { class: "mono", text: id }), " ", pill(t.status)),
      h("div", { class: "panel" }, fields([
        ["session", t.agent_session_id], ["lineage", t.lineage || DEFAULT_LINEAGE], ["policy", t.policy_lora_name], ["policy model", t.policy_model],
        ["reward mode", t.reward_mode], ["created", when(t.created_at)], ["finished", when(t.finished_at)],
        ["finish reason", t.finish_reason], ["captures committed", String(captures)],
        ["sampling of the captures", samplings.join(" · ") || "-"]])),
      h("h2", { text: "Capture timeline" }), ev.ok ? [eventTimeline(events, TASK_LANES, TASK_COLORS, t0, t1), legend(TASK_COLORS)] : problem(ev),
      h("h2", { text: "Reward flow" }), rewardFlow(t, events),
      h("h2", { text: "Events" }),
      table(["+time", "type", "data"], events.map(function (e) {
        return [secs(ms(e.at) - t0), h("span", { class: "mono", text: e.type }), h("span", { class: "mono", text: dataText(e.data) })];
      }), "No events."));
  }

  function stageChart(run, events) {
    const at = function (type) { const e = events.find(function (x) { return x.type === type; }); return e ? ms(e.at) : null; };
    const end = events.filter(function (e) { return END_EVENTS.indexOf(e.type) >= 0; }).map(function (e) { return ms(e.at); })[0]
      || ms(run.finished_at) || Date.now();
    const created = at("created") || ms(run.created_at);
    const started = at("training_started") || ms(run.started_at);
    const artifact = at("artifact_published");
    const segs = [];
    if (created !== null) segs.push(["queued", created, started || end]);
    if (started !== null) segs.push(["training", started, artifact || end]);
    if (artifact !== null) segs.push(["activating", artifact, end]);
    const W = 900, L = 90, R = 20, H = 64;
    const t0 = created || end, span = Math.max(end - t0, 1);
    const x = function (t) { return L + (t - t0) * (W - L - R) / span; };
    const svg = s("svg", { class: "chart", viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": "stage timeline" });
    svg.appendChild(s("text", { x: 8, y: 30, text: "stages" }));
    segs.forEach(function (g) {
      const w = Math.max(x(g[2]) - x(g[1]), 2);
      svg.appendChild(s("rect", { class: "seg", x: x(g[1]), y: 16, width: w, height: 20, fill: STAGE_COLORS[g[0]] },
        s("title", { text: g[0] + ": " + secs(g[2] - g[1]) })));
    });
    svg.appendChild(s("text", { x: L, y: H - 6, text: "0" }));
    svg.appendChild(s("text", { x: W - R, y: H - 6, "text-anchor": "end", text: run.status + " at +" + secs(span) }));
    return [svg, legend(STAGE_COLORS), table(["stage", "duration"], segs.map(function (g) { return [g[0], secs(g[2] - g[1])]; }))];
  }

  function stepCharts(run, events) {
    let steps = (run.metrics && run.metrics.step_metrics) || [];
    if (!steps.length) steps = events.filter(function (e) { return e.type === "ppo_step"; }).map(function (e) { return e.data; });
    if (!steps.length) return h("p", { class: "muted", text: "No training steps reported." });
    const keys = [];
    steps.forEach(function (st) {
      Object.keys(st).forEach(function (k) { if (k !== "step" && typeof st[k] === "number" && keys.indexOf(k) < 0) keys.push(k); });
    });
    return h("div", { class: "two" }, keys.slice(0, 6).map(function (k) {
      return lineChart(k + " per step", steps.map(function (st, i) { return { x: String(st.step || i + 1), y: st[k] }; }));
    }));
  }

  async function runPage(id) {
    const enc = encodeURIComponent(id);
    const [run, ev] = await Promise.all([api("rl/runs/" + enc), api("rl/runs/" + enc + "/events")]);
    if (!run.ok) return setView(h("h1", { text: "Run " + id }), problem(run));
    const r = run.body, events = ev.ok ? ev.body.items : [];
    const m = r.metrics || {};
    const t0 = ms(r.created_at);
    setView(
      h("h1", {}, "Training Run ", h("span", { class: "mono", text: id }), " ", pill(r.status)),
      h("div", { class: "panel" }, fields([
        ["lineage", r.lineage || DEFAULT_LINEAGE], ["stage", stageText(r)], ["samples", num(r.sample_count)], ["policy versions of the samples", dataText(r.policy_versions)],
        ["LoRA", r.lora_name], ["LoRA path", r.lora_path], ["created", when(r.created_at)], ["started", when(r.started_at)],
        ["finished", when(r.finished_at)], ["failure", r.failure_reason], ["Ray placement", placementText(m.placement)],
        ["steps", num(m.steps)], ["dropped / truncated", num(m.dropped_samples) + " / " + num(m.prompt_truncated_samples) + " prompt, "
          + num(m.response_truncated_samples) + " response"], ["stale excluded", num(m.stale_excluded)],
        ["sampling", runSamplingText(m.sampling)], ["constrained samples by kind", countsText(m.constraints)],
        ["eligible → run wait", waitText(r.freshness)],
        ["sample → policy p50 / p95", latencyText(r.freshness, true)],
        ["policy since", r.freshness && r.freshness.policy_at ? when(r.freshness.policy_at) : "-"]])),
      h("h2", { text: "Stage timeline" }), stageChart(r, events),
      h("h2", { text: "Training metrics" }), stepCharts(r, events),
      h("h2", { text: "Events" }),
      table(["+time", "type", "data"], events.map(function (e) {
        return [secs(ms(e.at) - t0), h("span", { class: "mono", text: e.type }), h("span", { class: "mono", text: dataText(e.data) })];
      }), "No events."));
  }

  async function policiesPage() {
    const [pol, ln, tasks] = await Promise.all([api("rl/policies" + lineageQuery("?")),
      api("loras/" + encodeURIComponent(lineOf(lineage))), allTasks(200)]);
    const title = "Policies of lineage " + lineage;
    if (!pol.ok) return setView(h("h1", { text: title }), problem(pol));
    const items = pol.body.items, cmp = pol.body.comparison;
    const leases = ln.ok ? ln.body.leases : {};
    const active = ln.ok && ln.body.active_lora ? ln.body.active_lora.lora_name : "base";
    const points = items.map(function (p) {
      const r = p.reward || {};
      const ci = Array.isArray(r.ci95) ? r.ci95 : null;
      return { x: p.policy_version, y: r.mean, lo: ci ? ci[0] : undefined, hi: ci ? ci[1] : undefined };
    });
    const byPolicy = {};
    tasks.forEach(function (t) { (byPolicy[t.policy_lora_name] = byPolicy[t.policy_lora_name] || []).push(t); });
    const lat = function (l) { return l ? num(l.p50, 0) + " / " + num(l.p95, 0) : "-"; };
    setView(
      h("h1", { text: title }),
      h("div", { class: "wide" }, lineChart("mean reward per policy version (bars: 95% CI)", points,
        { min: 0, max: 1, width: 900, height: 260 })),
      cmp ? h("p", {}, "Latest ", h("span", { class: "mono", text: cmp.latest }), " vs parent ",
        h("span", { class: "mono", text: cmp.parent }), ": reward delta ", h("b", { text: num(cmp.reward_delta) }),
        Array.isArray(cmp.ci95) ? " (95% CI " + num(cmp.ci95[0]) + " … " + num(cmp.ci95[1]) + ")" : "") : null,
      h("h2", { text: "Versions" }),
      table(["version", "parent", "Tasks#", "samples#", "reward n#", "mean#", "95% CI", "evaluation n / mean / 95% CI",
        "sources", "judge agreement#", "tokens/completion#", "latency p50/p95 ms#", "pinned now#"], items.map(function (p) {
        const r = p.reward || {};
        // Evaluation Tasks alone (never trained on): the held-out measure of the version.
        const e = (p.evaluation || {}).reward || {};
        const evalText = e.n ? num(e.n) + " / " + num(e.mean) + (Array.isArray(e.ci95) ? " / " + num(e.ci95[0]) + " … " +
          num(e.ci95[1]) : "") : "-";
        return [h("span", { class: "mono" }, p.policy_version, p.policy_version === active ? [" ", pill("active")] : null),
          h("span", { class: "mono", text: p.parent_version || "-" }), num(p.tasks), num(p.samples), num(r.n),
          num(r.mean), Array.isArray(r.ci95) ? num(r.ci95[0]) + " … " + num(r.ci95[1]) : "-", evalText,
          dataText(p.reward_sources),
          num(p.judge_agreement), num(p.tokens_per_completion, 1), lat(p.completion_latency_ms),
          num((leases || {})[p.policy_version] || 0)];
      }), "No policy versions yet."),
      h("h2", { text: "Tasks per version" }),
      items.length ? items.map(function (p, i) {
        const own = byPolicy[p.policy_version] || [];
        return h("details", { class: "panel", open: i === items.length - 1 ? "" : null }, h("summary", {}, h("span", { class: "mono", text: p.policy_version }),
          " — " + own.length + " recent Tasks, " + own.filter(function (t) { return t.status === "active"; }).length + " active (pinned)"),
        taskTable(own));
      }) : h("p", { class: "muted", text: "No Tasks yet." }));
  }

  function armRows(arms) {
    return ["candidate", "active"].filter(function (k) { return arms && arms[k]; }).map(function (k) {
      const a = arms[k], r = a.reward || {};
      return [k, h("span", { class: "mono", text: a.lora_name }), num(a.tasks), num(a.ended), num(a.failed),
        num(a.failure_share), num(r.n), num(r.mean), Array.isArray(r.ci95) ? num(r.ci95[0]) + " … " + num(r.ci95[1]) : "-",
        num(a.evaluation_tasks)];
    });
  }

  async function rolloutPage() {
    // Each lineage rolls out its own versions (docs/lineages.md): the RL Service answers per lineage.
    const st = await api("rl/rollout" + lineageQuery("?"));
    if (!st.ok) return setView(h("h1", { text: "Rollout" }), problem(st));
    const cur = st.body.current || (st.body.recent || [])[0] || null;
    const events = cur ? await api("rl/rollout/" + encodeURIComponent(cur.rollout_id) + "/events") : null;
    const d = cur ? (cur.decision || cur.evaluation || null) : null;
    const arms = d ? d.arms || {} : {};
    const points = ["candidate", "active"].filter(function (k) { return arms[k]; }).map(function (k) {
      const r = arms[k].reward || {}, ci = Array.isArray(r.ci95) ? r.ci95 : null;
      return { x: k + " " + arms[k].lora_name, y: r.mean, lo: ci ? ci[0] : undefined, hi: ci ? ci[1] : undefined };
    });
    setView(
      h("h1", {}, lineage === DEFAULT_LINEAGE ? "Rollout " : "Rollout of lineage " + lineage + " ", pill(st.body.mode)),
      cur === null ? h("p", { class: "muted", text: "No rollout yet: with mode immediate a new version is activated at once." }) : [
        h("h2", {}, st.body.current ? "Current: " : "Latest: ", h("span", { class: "mono", text: cur.rollout_id }), " ", pill(cur.status)),
        h("div", { class: "panel" }, fields([
          ["kind", cur.kind + " (" + cur.mode + ")"],
          ["candidate", h("span", { class: "mono", text: cur.candidate.lora_name })],
          ["against", h("span", { class: "mono", text: cur.baseline.lora_name })],
          ["share", cur.kind === "canary" ? num(cur.share, 2) : null],
          ["window", when(cur.window_started_at) + (cur.ended_at ? " → " + when(cur.ended_at) : " → now")],
          ["training run", cur.training_run_id ? link("#/runs/" + encodeURIComponent(cur.training_run_id), cur.training_run_id, "mono") : null]])),
        d ? h("div", { class: "panel decision", "data-action": d.action },
          h("b", { text: (cur.decision ? "Decision: " : "Would decide: ") + d.action }), " — ",
          h("span", { class: "mono", text: d.reason }), ": ", d.detail || "",
          cur.decision && cur.decision.by ? " (by " + cur.decision.by + ")" : "",
          d.reward_delta !== null && d.reward_delta !== undefined ? h("p", {}, "candidate − active: ",
            h("b", { text: num(d.reward_delta, 4) }), Array.isArray(d.ci95) ? " (95% CI " + num(d.ci95[0], 4) + " … " + num(d.ci95[1], 4) + ")" : "") : null) : null,
        points.length ? h("div", { class: "wide" }, lineChart("mean reward per Task of each arm (bars: 95% CI)", points,
          { min: 0, max: 1, width: 600, height: 220 })) : null,
        h("h2", { text: "Arms" }),
        table(["arm", "version", "Tasks#", "ended#", "failed#", "failed share#", "rewarded#", "mean#", "95% CI", "evaluation#"],
          armRows(arms), "No Tasks in the window yet."),
        h("h2", { text: "Timeline" }),
        table(["time", "type", "data"], (events && events.ok ? events.body.items : []).map(function (e) {
          return [short(e.at), h("span", { class: "mono", text: e.type }), h("span", { class: "mono", text: dataText(e.data) })];
        }), "No events."),
      ],
      h("h2", { text: "Recent rollouts" }),
      table(["created", "rollout", "kind", "candidate", "against", "status", "reason"], (st.body.recent || []).map(function (r) {
        return [short(r.created_at), h("span", { class: "mono", text: r.rollout_id }), r.kind,
          h("span", { class: "mono", text: r.candidate.lora_name }), h("span", { class: "mono", text: r.baseline.lora_name }),
          pill(r.status), r.decision ? r.decision.reason : "-"];
      }), "No rollouts yet."));
  }

  async function lorasPage() {
    const ln = await api("loras/" + encodeURIComponent(lineOf(lineage)));
    if (!ln.ok) return setView(h("h1", { text: "LoRA" }), problem(ln));
    const lora = ln.body;
    setView(
      h("h1", {}, "LoRA state of ", h("span", { class: "mono", text: lora.model }), " ", pill(lora.status)),
      h("div", { class: "panel" }, fields([
        ["active LoRA", lora.active_lora ? lora.active_lora.lora_name : "base"],
        ["path", lora.active_lora ? lora.active_lora.lora_path : null],
        ["instances", lora.instances.ready + " ready, " + lora.instances.failed + " failed"],
        ["canary candidate", lora.candidate ? h("span", {}, h("span", { class: "mono", text: lora.candidate.lora_name }),
          " for " + num(lora.candidate.share * 100, 0) + "% of new Tasks (", link("#/rollout", "rollout"), ")") : null]])),
      h("p", { class: "hint", text: "Instances serve every lineage of the model: adapters of other lines are listed too." }),
      h("h2", { text: "Instances" }),
      table(["instance", "address", "adapters loaded", "active loaded", "in flight#"], lora.instance_list.map(function (i) {
        const want = lora.active_lora ? lora.active_lora.lora_name : null;
        const ok = want === null || i.loaded.indexOf(want) >= 0;
        return [h("span", { class: "mono", text: i.name }), h("span", { class: "mono", text: i.address }),
          h("span", { class: "mono", text: i.loaded.join(", ") || "(none)" }),
          pill(want === null ? "base" : ok ? "ready" : i.failed ? "failed" : "pending"), num(i.inflight)];
      }), "No instances registered."),
      h("h2", { text: "Leases (Tasks pinned to a version)" }),
      table(["version", "leases#"], Object.entries(lora.leases).map(function (kv) {
        return [h("span", { class: "mono", text: kv[0] }), num(kv[1])];
      }), "No leased versions."));
  }

  // ------------------------------------------------------------------ routing

  const ROUTES = [
    [/^\/?$/, "overview", overview],
    [/^\/tasks$/, "tasks", function () { return listPage("Tasks", "rl/tasks", taskTable, ["active", "finalized", "aborted"]); }],
    [/^\/tasks\/(.+)$/, "tasks", function (m) { return taskPage(decodeURIComponent(m[1])); }, "record"],
    [/^\/runs$/, "runs", function () { return listPage("Training Runs", "rl/runs", runTable, null); }],
    [/^\/runs\/(.+)$/, "runs", function (m) { return runPage(decodeURIComponent(m[1])); }, "record"],
    [/^\/policies$/, "policies", policiesPage],
    [/^\/loras$/, "loras", lorasPage],
    [/^\/rollout$/, "rollout", rolloutPage],
  ];

  async function route() {
    const path = window.location.hash.replace(/^#/, "") || "/";
    for (const [re, page, render, kind] of ROUTES) {
      const m = path.match(re);
      if (!m) continue;
      document.querySelectorAll("#nav a").forEach(function (a) { a.classList.toggle("on", a.dataset.page === page); });
      view.setAttribute("data-page", page);
      view.setAttribute("aria-busy", "true");
      delete view.dataset.route;
      const scope = SCOPES[kind || page] || "lineage";
      const archived = states[lineage] === "archived" ? ", archived: no new Tasks or Training Runs until restored" : "";
      document.getElementById("scope").textContent = scope === "lineage"
        ? "This view: lineage " + lineage + " (" + lineOf(lineage) + ")" + archived + "."
        : "This view is not per lineage: " + scope + ".";
      try {
        await render(m);
      } catch (err) {
        if (String(err && err.message) !== "session expired") setView(h("p", { class: "bad", text: "Could not load: " + err }));
      }
      view.setAttribute("aria-busy", "false");
      view.dataset.route = path;  // what is on screen (tests wait for it)
      view.dataset.lineage = lineage;
      return;
    }
    setView(h("p", { class: "bad", text: "No such page." }));
  }

  document.getElementById("logout").addEventListener("click", function () {
    fetch("/console/logout", { method: "POST", credentials: "same-origin" }).then(function () {
      window.location.replace("/console/login");
    });
  });
  document.getElementById("refresh").addEventListener("click", route);  // the console never polls on its own
  window.addEventListener("hashchange", route);
  // The selector needs the model's line before the first page reads a lineage's state.
  api("overview").then(async function (a) {
    if (a.ok) document.getElementById("model").textContent = "model " + a.body.model_id;
    await initLineages(a.ok ? a.body.model_id : "");
    route();
  }, function () {});
})();
