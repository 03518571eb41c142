// orchestrator ui: draws the JSON answers of /api/*. Every text from a job (its name, arguments,
// log lines, reasons) is put in the page with text nodes, never as markup: a "<script>" in a log
// line shows as those characters. Charts are plotly.js (served by this server from the plotly
// Python package). The page polls its JSON every data-refresh-ms and redraws without a reload.
"use strict";

const body = document.body;
const PAGE = body.dataset.page;
const ID = body.dataset.id;
// The server refuses a --refresh outside 0.5 s..1 h; kept in range here too (a browser's timer fires at
// once past 2^31 ms, which would poll nonstop).
const REFRESH_MS = Math.min(3600000, Math.max(500, Number(body.dataset.refreshMs) || 5000));
const main = document.getElementById("main");

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "href") node.setAttribute("href", safeHref(v));
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function safeHref(v) {
  // Only this dashboard's own pages are linked.
  return String(v).startsWith("/") ? String(v) : "#";
}

async function getJSON(url) {
  const res = await fetch(url, { credentials: "same-origin", cache: "no-store" });
  const data = await res.json();
  if (!res.ok) throw new Error(data.error || res.statusText);
  return data;
}

function fmtNum(v, digits) {
  if (v === null || v === undefined) return "-";
  return Number(v).toPrecision(digits || 4);
}
function fmtRate(v) {
  if (v === null || v === undefined) return "-";
  if (v >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (v >= 1e4) return (v / 1e3).toFixed(1) + "k";
  return v.toFixed(0);
}
function fmtDur(s) {
  if (s === null || s === undefined) return "-";
  s = Math.max(0, Math.round(s));
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s";
  if (s < 86400) return Math.floor(s / 3600) + "h" + String(Math.floor((s % 3600) / 60)).padStart(2, "0") + "m";
  return Math.floor(s / 86400) + "d" + String(Math.floor((s % 86400) / 3600)).padStart(2, "0") + "h";
}
function stateText(row) {
  let s = row.state;
  if (row.state_detail) s += " (" + row.state_detail + ")";
  if (row.stale) s += " (stale)";
  if (row.continued_as) s += " -> " + row.continued_as + " " + row.run_state;
  return s;
}
function stateBadge(row) {
  return el("span", { class: "state s-" + String(row.run_state || row.state).toLowerCase() }, stateText(row));
}
function stepText(row) {
  if (row.step === null || row.step === undefined) return "-";
  return row.max_steps ? row.step + "/" + row.max_steps : String(row.step);
}
function liveText(row) {
  const l = row.liveness;
  if (!l) return "-";
  const parts = [];
  if (l.silent_s !== undefined && l.silent_s !== null) parts.push("quiet " + fmtDur(l.silent_s));
  const s = l.stragglers;
  if (s && s.flagged_ranks && s.flagged_ranks.length) parts.push("straggler rank " + s.slowest_rank + " on " + s.slowest_host);
  return parts.length ? parts.join(", ") : "-";
}
function stamp(error) {
  const u = document.getElementById("updated");
  u.textContent = error ? "update failed: " + error : "updated " + new Date().toLocaleTimeString();
  u.className = error ? "error" : "muted";
}
function replace(id, node) {
  const old = document.getElementById(id);
  node.id = id;
  if (old) old.replaceWith(node);
  else main.append(node);
}
function poll(fn) {
  const tick = async () => {
    try {
      await fn();
      stamp(null);
    } catch (e) {
      stamp(e.message);
    }
    setTimeout(tick, REFRESH_MS);
  };
  tick();
}

// ------------------------------------------------------------------------------------ jobs
const filters = { state: "", q: "", page: 0 };

function jobsPage() {
  document.getElementById("title").textContent = "jobs";
  const states = ["", "PENDING", "RUNNING", "REQUEUED", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
    "PREEMPTED", "NODE_FAIL", "OUT_OF_MEMORY"];
  const sel = el("select", { id: "filter-state", onchange: (e) => { filters.state = e.target.value; filters.page = 0; refresh(); } },
    states.map((s) => el("option", { value: s }, s || "any state")));
  const text = el("input", { id: "filter-text", placeholder: "job id or name", oninput: (e) => { filters.q = e.target.value; filters.page = 0; refresh(); } });
  main.append(el("div", { class: "filters" }, sel, " ", text));
  async function refresh() {
    const p = new URLSearchParams({ state: filters.state, q: filters.q, page: String(filters.page) });
    const data = await getJSON("/api/jobs?" + p.toString());
    const head = el("tr", {}, ["job", "name", "state", "strategy", "nodes", "step", "loss", "tok/s", "ETA",
      "requeues", "liveness"].map((h) => el("th", {}, h)));
    const rows = data.jobs.map((r) => el("tr", { "data-job": r.job_id },
      el("td", {}, el("a", { href: "/job/" + encodeURIComponent(r.job_id) }, r.job_id)),
      el("td", { class: "name" }, r.name),
      el("td", {}, stateBadge(r)),
      el("td", {}, r.strategy),
      el("td", {}, r.nodes + "x" + r.procs_per_node),
      el("td", {}, stepText(r)),
      el("td", {}, fmtNum(r.loss)),
      el("td", {}, fmtRate(r.tokens_per_s)),
      el("td", {}, fmtDur(r.eta_s)),
      el("td", {}, r.requeues),
      el("td", {}, liveText(r))));
    const pages = Math.max(1, Math.ceil(data.total / data.page_size));
    const nav = el("div", { class: "pager" },
      el("button", { disabled: data.page === 0, onclick: () => { filters.page--; refresh(); } }, "newer"),
      " page " + (data.page + 1) + " of " + pages + " (" + data.total + " jobs) ",
      el("button", { disabled: data.page + 1 >= pages, onclick: () => { filters.page++; refresh(); } }, "older"));
    replace("jobs", el("section", {}, el("table", { class: "jobs" }, el("thead", {}, head), el("tbody", {}, rows)), nav,
      data.stale_note ? el("p", { class: "muted" }, data.stale_note) : null));
    replace("sweeps", el("section", {}, el("h2", {}, "sweeps"), data.sweeps.length ? el("ul", {},
      data.sweeps.map((s) => el("li", {}, el("a", { href: "/sweep/" + encodeURIComponent(s.sweep_id) }, s.sweep_id),
        " " + s.name + " (" + s.tasks + " tasks)"))) : el("p", { class: "muted" }, "no sweeps")));
  }
  poll(refresh);
}

// ------------------------------------------------------------------------------------ one job
const log = { node: "", rank: "", q: "" };

function axisType(ys) {
  // A loss falling by orders of magnitude reads on a log axis; anything else on a linear one.
  const pos = ys.filter((y) => y > 0);
  if (pos.length !== ys.length || !pos.length) return "linear";
  return Math.max(...pos) / Math.min(...pos) > 1000 ? "log" : "linear";
}

function chartLayout(title, yTitle, resumes, ys) {
  return {
    title: { text: title },
    margin: { t: 40, r: 20, b: 40, l: 60 },
    height: 300,
    xaxis: { title: { text: "step" } },
    yaxis: { title: { text: yTitle }, type: axisType(ys || []), exponentformat: "power" },
    shapes: resumes.map((r) => ({ type: "line", x0: r.step, x1: r.step, yref: "paper", y0: 0, y1: 1,
      line: { color: "#c0392b", dash: "dash", width: 1.5 } })),
    annotations: resumes.map((r) => ({ x: r.step, yref: "paper", y: 1, text: "resume @ " + r.step,
      showarrow: false, font: { color: "#c0392b", size: 10 }, xanchor: "left", yanchor: "top" })),
    showlegend: true,
    uirevision: "keep", // zoom and pan survive the redraws
  };
}

function drawCharts(chart) {
  const c = chart.curves;
  const lossTraces = [];
  if (c.loss) lossTraces.push({ x: c.loss.x, y: c.loss.y, name: "train loss", mode: "lines", line: { color: "#1f77b4" } });
  if (c.val_loss) lossTraces.push({ x: c.val_loss.x, y: c.val_loss.y, name: "val loss", mode: "lines+markers", line: { color: "#ff7f0e" } });
  const rate = c.tokens_per_s ? ["tokens/s", c.tokens_per_s] : c.steps_per_s ? ["steps/s", c.steps_per_s] : null;
  const config = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["sendDataToCloud"] };
  let box = document.getElementById("charts");
  if (!box) {
    box = el("section", { id: "charts" }, el("div", { id: "chart-loss", class: "chart" }), el("div", { id: "chart-rate", class: "chart" }),
      el("p", { id: "chart-note", class: "muted" }));
    main.append(box);
  }
  const loss = document.getElementById("chart-loss");
  if (lossTraces.length) Plotly.react(loss, lossTraces, chartLayout("loss", "loss", chart.resumes, lossTraces.flatMap((t) => t.y)), config);
  else loss.textContent = "no train or eval events yet";
  const rateBox = document.getElementById("chart-rate");
  if (rate) Plotly.react(rateBox, [{ x: rate[1].x, y: rate[1].y, name: rate[0], mode: "lines", line: { color: "#2ca02c" } }],
    chartLayout("throughput", rate[0], chart.resumes), config);
  const shown = c.loss ? c.loss.points : 0;
  document.getElementById("chart-note").textContent = chart.events + " metric events; " + shown +
    " train steps" + (c.loss && c.loss.x.length < shown ? " (" + c.loss.x.length + " points drawn)" : "") +
    (chart.resumes.length ? "; resumed " + chart.resumes.length + " time(s), dashed lines" : "");
  loss.dataset.points = c.loss ? String(c.loss.x.length) : "0";
}

function jobSummary(data) {
  const r = data.job;
  const facts = [["state", stateBadge(r)], ["name", r.name], ["strategy", r.strategy], ["nodes", r.nodes + " x " + r.procs_per_node],
    ["step", stepText(r)], ["loss", fmtNum(r.loss)], ["tokens/s", fmtRate(r.tokens_per_s)], ["ETA", fmtDur(r.eta_s)],
    ["requeues", String(r.requeues)], ["resumes", String(r.resumes)], ["checkpoint", r.checkpoint_step === null ? "-" : String(r.checkpoint_step)],
    ["node list", r.node_list || "-"], ["exit code", r.exit_code || "-"], ["liveness", liveText(r)],
    ["command", data.command.join(" ")], ["run directory", r.run_dir]];
  const dl = el("dl", { class: "facts" }, facts.map(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
  const parts = [dl];
  if (r.reason && (r.state !== "RUNNING")) {
    parts.push(el("div", { id: "reason", class: r.terminal && r.state !== "COMPLETED" ? "reason bad" : "reason" },
      el("strong", {}, r.state + ": "), el("span", { id: "reason-text" }, r.reason),
      r.reason_command ? el("div", {}, "see: ", el("code", { id: "reason-command" }, r.reason_command)) : null));
  }
  if (r.started_from) parts.push(el("p", {}, "newest attempt " + r.started_from));
  for (const line of data.liveness_lines) parts.push(el("p", { class: "warn" }, line));
  return el("section", {}, parts);
}

function attemptsTable(details) {
  const rows = details.attempts.map((a) => el("tr", {},
    el("td", {}, String(a.attempt)),
    el("td", {}, (a.start_step === null ? "-" : "step " + a.start_step) + (a.restarted_after ? " (restarted in the allocation: " + a.restarted_after + ")" : "")),
    el("td", {}, a.nodes.map((n) => "node " + n.node + (n.exit_code === null ? " (running)" : " exit " + n.exit_code)).join(", ") || "-")));
  const parts = [el("h2", {}, "attempts"), el("table", { class: "attempts" },
    el("thead", {}, el("tr", {}, el("th", {}, "attempt"), el("th", {}, "started from"), el("th", {}, "nodes"))), el("tbody", {}, rows))];
  if (details.stragglers.length) parts.push(el("p", { class: "warn" }, "straggler rank(s): " + details.stragglers.join(", ")));
  const h = details.hang;
  if (h) {
    parts.push(el("h2", {}, "hang report (attempt " + h.attempt + ")"), el("p", { class: "reason bad" }, h.reason || "-"));
    for (const [rank, text] of Object.entries(h.stacks)) {
      const culprit = String(h.culprit_rank) === rank;
      parts.push(el("details", { open: culprit }, el("summary", { class: culprit ? "bad" : "" }, "rank " + rank + (culprit ? " (differs)" : "")), el("pre", {}, text)));
    }
  }
  return el("section", {}, parts);
}

function costTable(bill) {
  const parts = [el("h2", {}, "where the hours went")];
  if (!bill.attempts.length) return el("section", {}, parts, el("p", { class: "muted" }, "no bill: " + (bill.notes[0] || "no allocation recorded")));
  const unit = bill.unit.toUpperCase();
  parts.push(el("p", { id: "cost-total" }, bill.allocated_hours.toFixed(4) + " " + unit + "-hours allocated" +
    (bill.goodput === null ? "" : ", goodput " + (100 * bill.goodput).toFixed(1) + " %") +
    (bill.money ? ", " + bill.money.allocated.toFixed(2) + " at " + bill.price_per_hour + "/hour" : "")));
  const rows = Object.entries(bill.labels).filter(([k]) => k === "productive" || bill.hours[k] > 0).map(([k, label]) => el("tr", {},
    el("td", {}, label), el("td", {}, bill.hours[k].toFixed(4) + " h"),
    el("td", {}, bill.allocated_hours ? (100 * bill.hours[k] / bill.allocated_hours).toFixed(1) + " %" : "-")));
  parts.push(el("table", { class: "attempts" }, el("tbody", {}, rows)),
    el("p", { class: "muted" }, "not billed: queue wait " + Math.round(bill.unbilled_s.queue_wait) + " s, requeue gaps " +
      Math.round(bill.unbilled_s.requeue_gap) + " s"));
  return el("section", {}, parts);
}

function logsBox(nodes) {
  const nodeSel = el("select", { id: "log-node", onchange: (e) => { log.node = e.target.value; refreshLogs(); } },
    el("option", { value: "" }, "all nodes"), Array.from({ length: nodes }, (_, i) => el("option", { value: String(i) }, "node " + i)));
  const rank = el("input", { id: "log-rank", placeholder: "rank", size: 5, onchange: (e) => { log.rank = e.target.value; refreshLogs(); } });
  const search = el("input", { id: "log-search", placeholder: "search the log", onchange: (e) => { log.q = e.target.value; refreshLogs(); } });
  return el("section", { id: "logs-box" }, el("h2", {}, "logs"), el("div", { class: "filters" }, nodeSel, " ", rank, " ", search),
    el("div", { class: "muted" }, el("code", { id: "log-command" }, "")), el("pre", { id: "log-lines", class: "log" }, ""));
}

async function refreshLogs() {
  const p = new URLSearchParams({ node: log.node, rank: log.rank, q: log.q });
  const data = await getJSON("/api/job/" + encodeURIComponent(ID) + "/logs?" + p.toString());
  document.getElementById("log-lines").textContent = data.lines.concat(data.notes).join("\n");
  document.getElementById("log-command").textContent = data.command;
}

function jobPage() {
  document.getElementById("title").textContent = "job " + ID;
  let built = false;
  poll(async () => {
    const data = await getJSON("/api/job/" + encodeURIComponent(ID));
    replace("summary", jobSummary(data));
    drawCharts(data.chart);
    replace("attempts", attemptsTable(data.details));
    replace("cost", costTable(await getJSON("/api/job/" + encodeURIComponent(ID) + "/cost")));
    if (!built) {
      main.append(logsBox(data.job.nodes));
      built = true;
    }
    await refreshLogs();
  });
}

// ------------------------------------------------------------------------------------ one sweep
function sweepPage() {
  document.getElementById("title").textContent = "sweep " + ID;
  let metric = "loss";
  const sel = el("select", { id: "sweep-metric", onchange: (e) => { metric = e.target.value; refresh(); } },
    ["loss", "val_loss", "tokens_per_s"].map((m) => el("option", { value: m }, m)));
  main.append(el("div", { class: "filters" }, "best by ", sel));
  async function refresh() {
    const data = await getJSON("/api/sweep/" + encodeURIComponent(ID) + "?metric=" + metric);
    const counts = Object.entries(data.counts).map(([s, n]) => n + " " + s).join(", ");
    const head = el("tr", {}, el("th", {}, "task"), data.axes.map((a) => el("th", {}, a)), el("th", {}, "job"), el("th", {}, "state"),
      el("th", {}, "step"), el("th", {}, data.metric));
    const rows = data.tasks.map((t) => el("tr", { class: t.task === data.best_task ? "best" : "", "data-task": t.task },
      el("td", {}, String(t.task), t.task === data.best_task ? el("span", { class: "badge" }, "best") : null),
      data.axes.map((a) => el("td", {}, t.params[a] === undefined ? "-" : t.params[a])),
      el("td", {}, el("a", { href: "/job/" + encodeURIComponent(t.row.job_id) }, t.row.job_id)),
      el("td", {}, stateBadge(t.row)),
      el("td", {}, stepText(t.row)),
      el("td", {}, t.metric === null ? "-" : fmtNum(t.metric))));
    const waiting = data.waiting.map((t) => el("tr", { "data-task": t.task }, el("td", {}, String(t.task)),
      data.axes.map((a) => el("td", {}, t.params[a] === undefined ? "-" : t.params[a])), el("td", {}, "-"),
      el("td", {}, el("span", { class: "state s-" + t.state.toLowerCase() }, t.state)), el("td", {}, t.reason || "-"), el("td", {}, "-")));
    replace("sweep-summary", el("p", {}, data.total + " tasks (" + counts + ")", data.best_task === null ? "" : "; best task " + data.best_task +
      " by " + data.metric + (data.higher_is_better ? " (highest)" : " (lowest)")));
    replace("sweep-table", el("table", { class: "jobs" }, el("thead", {}, head), el("tbody", {}, rows, waiting)));
    let charts = document.getElementById("sweep-charts");
    if (!charts) {
      charts = el("section", { id: "sweep-charts" });
      main.append(charts);
    }
    for (const axis of data.axes) {
      const id = "sweep-chart-" + data.axes.indexOf(axis);
      let box = document.getElementById(id);
      if (!box) { box = el("div", { id, class: "chart" }); charts.append(box); }
      const scored = data.tasks.filter((t) => t.metric !== null);
      const xs = scored.map((t) => t.params[axis]);
      const numeric = xs.every((x) => x !== undefined && x !== "" && !isNaN(Number(x)));
      Plotly.react(box, [{
        x: numeric ? xs.map(Number) : xs, y: scored.map((t) => t.metric), mode: "markers", type: "scatter",
        text: scored.map((t) => "task " + t.task), name: data.metric,
        marker: { size: scored.map((t) => (t.task === data.best_task ? 16 : 10)), color: scored.map((t) => (t.task === data.best_task ? "#c0392b" : "#1f77b4")) },
      }], { title: { text: data.metric + " vs " + axis }, height: 280, margin: { t: 40, r: 20, b: 40, l: 60 },
        xaxis: { title: { text: axis }, type: numeric ? "linear" : "category" },
        yaxis: { title: { text: data.metric }, type: axisType(scored.map((t) => t.metric)), exponentformat: "power" },
        uirevision: "keep" },
      { displaylogo: false, responsive: true });
    }
  }
  poll(refresh);
}

if (PAGE === "jobs") jobsPage();
else if (PAGE === "job") jobPage();
else if (PAGE === "sweep") sweepPage();
