// The dashboard's scripts: one function per page (the <body>'s data-page), no build step.
// They call the API with the session cookie; a request that changes something carries the page's
// CSRF token in X-CSRF-Token (api/auth.py). Charts are uPlot (static/vendor/uplot, see VERSIONS).
"use strict";

const $ = (sel, root = document) => root.querySelector(sel);
const csrfToken = () => ($('meta[name="csrf-token"]') || {}).content || "";

// fetch() against the API: the JSON answer, or an Error with the API's message.
async function api(method, url, body) {
  const headers = {"X-CSRF-Token": csrfToken()};
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(url, {method, headers, credentials: "same-origin",
                                     body: body === undefined ? undefined : JSON.stringify(body)});
  const text = await response.text();
  const data = text ? JSON.parse(text) : null;
  if (!response.ok) throw new Error(data && data.error ? data.error.message : `${response.status} ${response.statusText}`);
  return data;
}

function say(id, text, isError) {
  const el = document.getElementById(id);
  if (!el) return;
  el.textContent = text;
  el.classList.toggle("error", !!isError);
}

function confirmThen(text, action) {
  const dialog = $("#confirm");
  $("#confirm-text").textContent = text;
  dialog.returnValue = "";
  dialog.addEventListener("close", () => { if (dialog.returnValue === "ok") action(); }, {once: true});
  dialog.showModal();
}

// ---- charts -------------------------------------------------------------------------------------
const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777", "#4b5563", "#65a30d"];

function themeColors() {
  const style = getComputedStyle(document.body);
  return {text: style.getPropertyValue("--text").trim() || "#111", grid: style.getPropertyValue("--grid").trim() || "#ddd",
          muted: style.getPropertyValue("--muted").trim() || "#5b6470"};
}

// Tick steps of an axis of whole numbers (a trial's number): uPlot's defaults include 0.1 and 0.5.
const INTEGER_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000];

// A live line chart: series by name, points (step, value) added at any time, redrawn once per frame.
class LiveChart {
  constructor(el, {points = false, marks = null, scatter = false, xLabel = "step", integerX = false, logX = false, colors = {},
                   lastStep = null, xTicks = null, order = []} = {}) {
    this.el = el;
    this.lastStep = lastStep;  // () => a job's total steps (or null): the x axis runs from 0 to it, on every chart of the job
    this.logX = logX;          // a log-scale x axis (a learning rate sampled on a log scale)
    el.dataset.xScale = logX ? "log" : "linear";
    this.xTicks = xTicks;      // [x, ...] ascending: the x ticks exactly, the axis spanning them all (a batch size's choices)
    if (xTicks) el.dataset.xTicks = xTicks.join(",");
    this.colors = colors;      // series name -> its colour, its points filled (told apart by shape too); the others take PALETTE's in turn
    this.order = order;        // series names whose PALETTE colour is their place here, in every chart of a page (compare's jobs)
    this.scatter = scatter;    // points only, no lines (a sweep's trials)
    this.xLabel = xLabel;
    this.integerX = integerX;  // x ticks at whole numbers only
    this.points = points;      // evaluation series: points joined by lines
    this.marks = marks;        // () => {lines: [steps], stars: [[step, value]]}
    this.names = [];
    this.byStep = new Map();   // step -> {name: value}; a scatter keeps every point instead (dots)
    this.dots = [];            // a scatter's [x, name, value]: trials may share an x (a batch size, a latency)
    this.count = 0;
    this.plot = null;
    this.pending = false;
  }

  add(name, step, value) {
    if (value === null || value === undefined) return;
    if (!this.names.includes(name)) { this.names.push(name); this.rebuild = true; }
    if (this.scatter) { this.dots.push([step, name, value]); this.count++; this.schedule(); return; }
    let row = this.byStep.get(step);
    if (!row) { row = {}; this.byStep.set(step, row); }
    if (!(name in row)) this.count++;
    row[name] = value;
    this.schedule();
  }

  schedule() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => { this.pending = false; this.draw(); });
  }

  data() {
    if (this.scatter) {  // one row per point, x ascending (repeated where points share it): uPlot's aligned data
      const dots = [...this.dots].sort((a, b) => a[0] - b[0]);
      return [dots.map(d => d[0]), ...this.names.map(n => dots.map(d => (d[1] === n ? d[2] : null)))];
    }
    const steps = [...this.byStep.keys()].sort((a, b) => a - b);
    return [steps, ...this.names.map(n => steps.map(s => { const v = this.byStep.get(s)[n]; return v === undefined ? null : v; }))];
  }

  options() {
    const c = themeColors();
    const marks = this.marks;
    const free = this.names.filter(n => !(n in this.colors));
    const ticks = this.xTicks;
    // labelled with as many decimals as the closest two need (a lone tick: as a value on its own)
    const gap = ticks && ticks.length > 1 ? Math.min(...ticks.slice(1).map((v, i) => v - ticks[i])) : undefined;
    return {
      width: Math.max(280, this.el.clientWidth), height: 220,
      scales: {x: {time: false, ...(this.logX ? {distr: 3, log: 10} : {}), ...(this.lastStep ? {range: (u, min, max) => {
        // one evaluation (at step 101) drew an axis from 0 to 200 (uPlot pads a single x), beside a
        // loss chart from 1 to 101: the data's own last step, not max, past the job's last
        const last = this.lastStep(), xs = u.data[0];
        return last ? [0, Math.max(xs.length ? xs[xs.length - 1] : last, last)] : [min, max];
      }} : {}), ...(ticks ? {range: () => tickRange(ticks)} : {})}},
      legend: {show: true},
      axes: [{stroke: c.text, grid: {stroke: c.grid}, label: this.xLabel, values: tickLabels,
              ...(this.integerX ? {incrs: INTEGER_INCRS} : {}), ...(this.logX ? {filter: logTicks} : {}),
              ...(ticks ? {splits: () => ticks, values: (u, splits) => tickLabels(u, splits, 0, 0, gap)} : {})},
             {stroke: c.text, grid: {stroke: c.grid}, size: 64, values: tickLabels}],
      series: [{label: this.xLabel}, ...this.names.map(n => {
        const fill = n in this.colors ? {fill: this.colors[n]} : {};  // its points and legend marker
        const slot = this.order.includes(n) ? this.order.indexOf(n) : this.order.length + free.indexOf(n);
        return {label: n, stroke: this.colors[n] || PALETTE[slot % PALETTE.length], width: 1.5, spanGaps: true, ...fill,
                points: {show: this.points || this.scatter, size: 7, ...fill}, ...(this.scatter ? {paths: () => null} : {})};
      })],
      hooks: {setScale: [(u, key) => { if (key === "x") this.el.dataset.xMax = String(u.scales.x.max); }],
              ...(marks ? {draw: [u => drawMarks(u, marks(), c.text)]} : {})},
    };
  }

  draw() {
    if (this.names.length === 0) return;
    const data = this.data();
    if (!this.plot || this.rebuild) {
      if (this.plot) this.plot.destroy();
      this.el.textContent = "";
      this.plot = new uPlot(this.options(), data, this.el);
      this.rebuild = false;
    } else {
      this.plot.setData(data);
    }
    this.el.dataset.points = String(this.count);
  }

  resize() { if (this.plot) this.plot.setSize({width: Math.max(280, this.el.clientWidth), height: 220}); }
}

// The labelled ticks of a log axis (uPlot's `filter`; null: a tick without a label): every one where
// a decade is wide, else the mantissas 1, 2 and 5, else the powers of ten (uPlot's own labels only
// the powers of ten: a sweep's learning rates, within a decade, had one label). A label ("8e-4")
// takes about 34 px: 8 and 9 lie log10(9/8) of a decade apart, 5 and 10 log10(2), so every
// mantissa needs 700 px a decade (at 300, 6e-5 to 9e-5 overlapped), 1, 2 and 5 need 120.
function logTicks(u, splits) {
  const {min, max} = u.scales.x;
  const perDecade = u.bbox.width / devicePixelRatio / Math.max(Math.log10(max / min), 1e-9);
  const shown = perDecade >= 700 ? [1, 2, 3, 4, 5, 6, 7, 8, 9] : perDecade >= 120 ? [1, 2, 5] : [1];
  return splits.map(v => (shown.includes(Math.round(v / 10 ** Math.floor(Math.log10(v) + 1e-9))) ? v : null));
}

// The x range of an axis ticked at `ticks` (ascending; a numeric categorical parameter's choices):
// every one of them, though the trials so far took one, and 5% of their span (a lone tick: of its
// value) either side, so that the points on the first and the last are not cut in half.
function tickRange(ticks) {
  const low = ticks[0], high = ticks[ticks.length - 1], pad = 0.05 * (high - low || Math.abs(low) || 1);
  return [low - pad, high + pad];
}

// A value on its own (a reference line's label): 3 significant digits, small values (a learning
// rate) in exponent form.
function tick(v) {
  if (v === null || v === undefined) return "";
  return v !== 0 && Math.abs(v) < 1e-2 ? v.toExponential(1) : String(+v.toPrecision(3));
}

// An axis's tick labels (uPlot's axis `values`: the ticks, and `step`, the increment between them):
// as many decimals as the step needs, so that adjacent ticks read differently (latencies 0.001 ms
// apart: 1.508, 1.509, never 1.51 twice), trailing zeros dropped (whole numbers read 2, not 2.00);
// small values (a learning rate) in exponent form, with as many mantissa digits.
function tickLabels(u, splits, axisIdx, space, step) {
  if (!(step > 0)) return splits.map(tick);  // no step found: as values on their own
  let decimals = 0;  // the step's decimals (0.25: 2; 5: 0), float noise (0.1 + 0.2) aside
  while (decimals < 20 && Math.abs(step * 10 ** decimals - Math.round(step * 10 ** decimals)) > 1e-6 * step * 10 ** decimals) decimals++;
  return splits.map(v => {
    if (v === null || v === undefined) return "";
    // at least the value's own first digit: a log axis's steps are its decades' (0.01 read "0" at step 0.1)
    if (v === 0) return "0";
    if (Math.abs(v) >= 1e-2) return String(+v.toFixed(Math.max(decimals, -Math.floor(Math.log10(Math.abs(v))))));
    const digits = Math.min(20, Math.max(0, decimals + Math.floor(Math.log10(Math.abs(v)))));
    return (+v.toExponential(digits)).toExponential();
  });
}

// Checkpoints as dashed vertical lines, the best evaluation as a star, reference values (the
// zero-shot score) as labelled dashed horizontal lines.
function drawMarks(u, {lines = [], stars = [], levels = []}, color) {
  const ctx = u.ctx;
  ctx.save();
  for (const {value, label, stroke} of levels) {
    const y = u.valToPos(value, "y", true);
    ctx.strokeStyle = stroke;
    ctx.fillStyle = stroke;
    ctx.lineWidth = devicePixelRatio;
    ctx.setLineDash([6 * devicePixelRatio, 4 * devicePixelRatio]);
    ctx.beginPath(); ctx.moveTo(u.bbox.left, y); ctx.lineTo(u.bbox.left + u.bbox.width, y); ctx.stroke();
    ctx.font = `${Math.round(12 * devicePixelRatio)}px sans-serif`;
    ctx.textAlign = "right";
    ctx.textBaseline = "bottom";
    ctx.fillText(label, u.bbox.left + u.bbox.width - 4 * devicePixelRatio, y - 2 * devicePixelRatio);
  }
  ctx.strokeStyle = color;
  ctx.globalAlpha = 0.5;
  ctx.setLineDash([4, 4]);
  for (const step of lines) {
    const x = u.valToPos(step, "x", true);
    if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
    ctx.beginPath(); ctx.moveTo(x, u.bbox.top); ctx.lineTo(x, u.bbox.top + u.bbox.height); ctx.stroke();
  }
  ctx.setLineDash([]);
  ctx.globalAlpha = 1;
  ctx.fillStyle = "#ca8a04";
  ctx.font = `${Math.round(18 * devicePixelRatio)}px sans-serif`;
  ctx.textAlign = "center";
  ctx.textBaseline = "middle";
  for (const [step, value] of stars) ctx.fillText("★", u.valToPos(step, "x", true), u.valToPos(value, "y", true));
  ctx.restore();
}

function readJSON(id) { const el = document.getElementById(id); return el ? JSON.parse(el.textContent) : {}; }

function formatProgress(job) {
  const p = job.progress;
  let text = `step ${p.step}${p.total_steps ? " / " + p.total_steps : ""} · epoch ${p.epoch.toFixed(2)}`;
  if (p.eta_seconds !== null && p.eta_seconds !== undefined && job.status === "running") text += ` · ETA ${Math.round(p.eta_seconds)} s`;
  return text;
}

function showStatus(status) {
  const el = $("#job-status");
  el.textContent = status;
  el.className = `status status-${status}`;
}

// The stream starts at the job's beginning: its first "events" message replaces the events the
// server rendered (the same ones, and any written since); later ones are appended.
let eventsReplaced = false;
function appendEvents(events) {
  const list = $("#events");
  if (!eventsReplaced) { list.textContent = ""; eventsReplaced = true; }
  for (const e of events) {
    const li = document.createElement("li");
    li.className = `level-${e.level}`;
    const time = document.createElement("time");
    time.textContent = e.time.slice(11, 19);
    const code = document.createElement("code");
    code.textContent = e.code;
    li.append(time, " ", code, " ", e.message);
    list.append(li);
  }
}

function wireCancelDelete(afterDelete) {
  const cancel = $("#cancel-job");
  if (cancel) cancel.addEventListener("click", () => confirmThen("Cancel this job? A running job stops after its current step.", async () => {
    try { await api("POST", cancel.dataset.url); cancel.disabled = true; say("action-message", "Cancellation requested."); }
    catch (e) { say("action-message", e.message, true); }
  }));
  const del = $("#delete-job");
  if (del) del.addEventListener("click", () => confirmThen("Delete this job's model, checkpoints, metrics and events? This cannot be undone.", async () => {
    try { await api("DELETE", del.dataset.url); location.assign(afterDelete); }
    catch (e) { say("action-message", e.message, true); }
  }));
}

// A browser opens at most 6 HTTP/1.1 connections to a host, and each open stream holds one: a tab
// in the background closes its stream, and reloads (catching up) when it is shown again.
function releaseWhenHidden(stream) {
  document.addEventListener("visibilitychange", () => {
    if (document.hidden && stream.readyState !== EventSource.CLOSED) { stream.close(); stream.released = true; }
    else if (!document.hidden && stream.released) location.reload();
  });
}

// ---- pages --------------------------------------------------------------------------------------
const pages = {};

pages.jobs = () => {
  const picks = () => [...document.querySelectorAll("input.pick:checked")].map(i => i.value);
  const button = $("#compare-selected");
  const update = () => { const n = picks().length; button.disabled = n < 2 || n > 10; button.textContent = `Compare selected (${n})`; };
  document.addEventListener("change", e => { if (e.target.matches("input.pick")) update(); });
  button.addEventListener("click", () => location.assign(`/ui/compare?jobs=${picks().map(encodeURIComponent).join(",")}`));
  // The page's queued and running jobs (data-live) follow their jobs through one stream of them
  // all, closed once each has ended: no polling.
  const live = $("#jobs-table").dataset.live;
  if (!live) return;
  const pending = new Set(live.split(","));
  const stream = new EventSource(`/ui/jobs/live?ids=${encodeURIComponent(live)}`);
  releaseWhenHidden(stream);
  const show = e => {
    const job = JSON.parse(e.data);
    const row = document.querySelector(`tr[data-job="${CSS.escape(job.id)}"]`);
    if (!row) return;
    const status = $(".status", row);
    status.textContent = job.status;
    status.className = `status status-${job.status}`;
    $("progress", row).value = job.progress.fraction;
    $(".percent", row).textContent = `${Math.round(job.progress.fraction * 100)}%`;
  };
  const done = e => {  // the server ends the stream after the last one: it must not reconnect
    pending.delete(JSON.parse(e.data).id);
    if (pending.size === 0) stream.close();
  };
  stream.addEventListener("progress", show);
  stream.addEventListener("end", e => { show(e); done(e); });
  stream.addEventListener("gone", done);  // deleted meanwhile: its row stays as it was
};

pages.job = () => {
  const info = readJSON("chart-data");
  const lowerIsBetter = ["loss", "mse"].includes(info.best_metric);
  const bestName = `eval_${info.best_metric}`;
  let best = null;
  let zeroShot = null;  // the metric for the best model at step 0: an embedding job's base model, before training
  // the star goes on the chart that shows the metric for the best model: loss with the training loss
  const marks = onLossChart => () => ({lines: info.checkpoints,
                                       stars: best && (bestName === "eval_loss") === onLossChart ? [best] : [],
                                       levels: zeroShot === null || onLossChart ? [] : [{
                                         value: zeroShot, label: `zero-shot ${info.best_metric} ${tick(zeroShot)}`,
                                         stroke: PALETTE[Math.max(0, charts.eval.names.indexOf(bestName)) % PALETTE.length]}]});
  let totalSteps = info.total_steps;  // null until the job has started: its progress events say
  const lastStep = () => totalSteps;
  const charts = {
    loss: new LiveChart($("#chart-loss"), {marks: marks(true), lastStep}),
    eval: new LiveChart($("#chart-eval"), {points: true, marks: marks(false), lastStep}),
    lr: new LiveChart($("#chart-lr"), {lastStep}),
    speed: new LiveChart($("#chart-speed"), {lastStep}),
    padding: new LiveChart($("#chart-padding"), {lastStep}),
  };
  const chartOf = name => name === "train_loss" || name === "eval_loss" ? charts.loss
    : name.startsWith("eval_") ? charts.eval : name === "learning_rate" ? charts.lr
    : name === "tokens_per_second" ? charts.speed : name === "padding_efficiency" ? charts.padding : null;
  addEventListener("resize", () => Object.values(charts).forEach(c => c.resize()));
  wireCancelDelete("/ui/jobs");
  wirePromote();

  const wasActive = ["queued", "running"].includes(info.status);
  const stream = new EventSource(`/jobs/${encodeURIComponent(info.job)}/stream`);
  releaseWhenHidden(stream);
  stream.addEventListener("metrics", e => {
    for (const m of JSON.parse(e.data).data) {
      const chart = chartOf(m.name);
      if (chart) chart.add(m.name, m.step, m.value);
      if (m.name === bestName && m.step === 0 && m.value !== null) {
        zeroShot = m.value;
        charts.eval.el.dataset.zeroShot = String(m.value);
      }
      if (m.name === bestName && m.value !== null && (!best || (lowerIsBetter ? m.value < best[1] : m.value > best[1]))) {
        best = [m.step, m.value];
        charts.loss.schedule(); charts.eval.schedule();
      }
    }
  });
  stream.addEventListener("events", e => appendEvents(JSON.parse(e.data).data));
  stream.addEventListener("progress", e => {
    const job = JSON.parse(e.data);
    if (job.progress.total_steps && job.progress.total_steps !== totalSteps) {
      totalSteps = job.progress.total_steps;
      Object.values(charts).forEach(c => c.schedule());
    }
    $("#job-progress").value = job.progress.fraction;
    $("#job-progress-text").textContent = formatProgress(job);
    showStatus(job.status);
  });
  stream.addEventListener("end", e => {
    stream.close();
    showStatus(JSON.parse(e.data).status);
    // Checkpoints, artifacts and final metrics are on the server-rendered page: show them.
    if (wasActive) location.reload();
  });
  stream.addEventListener("error", e => {
    if (e.data) { stream.close(); say("action-message", JSON.parse(e.data).error.message, true); }
  });
};

// "Promote": point an alias (PUT /models/aliases/{alias}) at this job, then list it with the job's aliases.
function wirePromote() {
  const form = $("#promote-form");
  if (!form) return;
  form.addEventListener("submit", async e => {
    e.preventDefault();
    const alias = form.alias.value.trim();
    say("promote-message", "Promoting…");
    try {
      const answer = await api("PUT", `/models/aliases/${encodeURIComponent(alias)}`, {job_id: form.dataset.job});
      const moved = answer.history.length ? answer.history[0].from_job_id : null;
      say("promote-message", moved && moved !== form.dataset.job ? `${alias} now points at this job (it pointed at ${moved}).`
        : `${alias} points at this job.`);
      const list = $("#job-aliases");
      if (![...list.querySelectorAll("code")].some(c => c.textContent === alias)) {
        const none = list.querySelector(".none");
        if (none) none.remove();
        const code = document.createElement("code");
        code.className = "alias";
        code.textContent = alias;
        list.append(code, " ");
      }
    } catch (err) { say("promote-message", err.message, true); }
  });
}

pages.compare = () => {
  const {jobs} = readJSON("chart-data");
  const box = $("#compare-charts");
  const charts = new Map();
  const chartFor = name => {
    if (!charts.has(name)) {
      const figure = document.createElement("figure");
      const caption = document.createElement("figcaption");
      caption.textContent = name;
      const el = document.createElement("div");
      el.className = "chart";
      el.dataset.points = "0";
      el.dataset.metric = name;
      figure.append(caption, el);
      box.append(figure);
      // one colour per job in every chart (a chart's series took the palette in their own order)
      charts.set(name, new LiveChart(el, {points: name.startsWith("eval_"), order: jobs}));
    }
    return charts.get(name);
  };
  const order = ["train_loss", "eval_loss"];
  Promise.all(jobs.map(id => api("GET", `/jobs/${encodeURIComponent(id)}/metrics?limit=100000`))).then(answers => {
    const rank = n => (order.includes(n) ? order.indexOf(n) : order.length);
    const names = [...new Set(answers.flatMap(a => a.data.map(m => m.name)))]
      .sort((a, b) => (rank(a) - rank(b)) || a.localeCompare(b));
    for (const name of names) chartFor(name);
    answers.forEach((answer, i) => { for (const m of answer.data) chartFor(m.name).add(jobs[i], m.step, m.value); });
    if (names.length === 0) box.textContent = "None of these jobs has written metrics yet.";
  }).catch(e => { box.textContent = e.message; });
};

pages.datasets = () => {
  $("#upload-form").addEventListener("submit", e => {
    e.preventDefault();
    const file = $("#upload-file").files[0];
    if (!file) return;
    const bar = $("#upload-progress");
    bar.hidden = false; bar.value = 0;
    const body = new FormData();
    body.append("file", file, file.name);
    const xhr = new XMLHttpRequest();  // fetch() reports no upload progress
    xhr.open("POST", "/datasets");
    xhr.setRequestHeader("X-CSRF-Token", csrfToken());
    xhr.upload.addEventListener("progress", p => { if (p.lengthComputable) bar.value = p.loaded / p.total; });
    xhr.addEventListener("load", () => {
      let data = null;
      try { data = JSON.parse(xhr.responseText); } catch (_) { /* not JSON: reported below */ }
      if (xhr.status === 201) { bar.value = 1; location.assign(`/ui/datasets/${encodeURIComponent(data.id)}`); }
      else say("upload-message", data && data.error ? data.error.message : `upload failed (${xhr.status})`, true);
    });
    xhr.addEventListener("error", () => say("upload-message", "the upload was interrupted", true));
    say("upload-message", `Uploading ${file.name}…`);
    xhr.send(body);
  });
};

// The POST /jobs body of the new-job form: its enabled fields (those of the chosen task), empty ones left out.
function jobSpec(form) {
  const spec = {training_dataset: form.dataset.dataset, hyperparameters: {}};
  for (const el of form.elements) {
    if (!el.name || el.disabled) continue;
    if (el.multiple) {
      const values = [...el.selectedOptions].map(o => o.value);
      if (values.length) spec[el.name] = values;
    } else if (el.name.startsWith("hp.")) {
      const value = el.type === "number" ? Number(el.value) : el.value;
      if (el.value !== "") spec.hyperparameters[el.name.slice(3)] = value;
    } else if (el.value !== "") spec[el.name] = el.value;
  }
  return spec;
}

// Show the column fields of the chosen task only (their data-tasks); hidden ones are disabled, so not sent.
function showTaskFields(form) {
  const task = form.task.value;
  // loss is no objective of the retrieval tasks: their first own metric instead (and back)
  const metric = form["hp.metric_for_best_model"];
  const retrieval = {embedding: "ndcg@10", reranking: "ndcg@10"}[task];
  if (retrieval && metric.value === "loss") metric.value = retrieval;
  else if (!retrieval && metric.value === "ndcg@10") metric.value = "loss";
  for (const el of form.querySelectorAll("[data-tasks]")) {
    const shown = el.dataset.tasks.split(" ").includes(task);
    el.hidden = !shown;
    if (el.tagName !== "LABEL") el.disabled = !shown;
  }
}

pages.dataset = () => {
  const form = $("#job-form");
  showTaskFields(form);
  form.task.addEventListener("change", () => showTaskFields(form));
  let lengthsChart = null;
  $("#plan-job").addEventListener("click", async () => {
    say("job-message", "Planning…");
    try {
      const {plan} = await api("POST", "/jobs?dry_run=true", jobSpec(form));
      say("job-message", "");
      $("#plan").hidden = false;
      const n = x => x.toLocaleString("en-US");
      const est = plan.estimated_seconds === null ? "no estimate yet (no finished job on this model)" : `about ${n(Math.round(plan.estimated_seconds))} s`;
      $("#plan-summary").textContent = `${n(plan.examples)} training examples · ${n(plan.steps_per_epoch)} steps per epoch, ` +
        `${n(plan.total_steps)} in all · ${(plan.truncated_fraction * 100).toFixed(1)}% truncated at max_length · ${est}` +
        plan.notes.map(note => ` · ${note}`).join("");  // a sampled plan, rows without labels
      let edges = plan.token_lengths.bin_edges, counts = plan.token_lengths.counts;
      if (counts.length === 1) {  // one length (all cut at max_length): empty bins beside it, or its bar fills the chart
        edges = [2 * edges[0] - edges[1], ...edges, 2 * edges[1] - edges[0]];
        counts = [0, counts[0], 0];
      }
      const c = themeColors();
      const el = $("#chart-lengths");
      if (lengthsChart) lengthsChart.destroy();
      el.textContent = "";
      lengthsChart = new uPlot({
        width: Math.max(280, el.clientWidth), height: 220,
        scales: {x: {time: false, range: () => [edges[0] - 0.5, edges[edges.length - 1] - 0.5]},  // whole bars
                 y: {range: (u, min, max) => [0, max * 1.1]}},  // bars start at 0
        axes: [{stroke: c.text, grid: {stroke: c.grid}, label: "tokens", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]},  // whole tokens
               {stroke: c.text, grid: {stroke: c.grid}, label: "examples", size: 80}],  // room for 1,000,000
        series: [{label: "tokens"}, {label: "examples", fill: "#2563eb88", stroke: "#2563eb", points: {show: false},
                                     paths: uPlot.paths.bars({size: [0.9]})}],
      }, [counts.map((_, i) => (edges[i] + edges[i + 1] - 1) / 2), counts], el);  // each bar at the middle of its whole tokens
      const bars = $("#plan-padding");
      bars.textContent = "";
      for (const [strategy, eff] of Object.entries(plan.padding_efficiency)) {
        const row = document.createElement("div");
        row.className = "bar-row";
        const label = document.createElement("span");
        label.textContent = strategy;
        const meter = document.createElement("meter");
        meter.min = 0; meter.max = 1; meter.value = eff.unrounded;
        meter.setAttribute("aria-label", `padding efficiency of ${strategy} batching`);
        const value = document.createElement("span");
        value.textContent = `${(eff.unrounded * 100).toFixed(1)}%`;
        row.append(label, meter, value);
        bars.append(row);
      }
    } catch (e) { say("job-message", e.message, true); }
  });
  form.addEventListener("submit", async e => {
    e.preventDefault();
    say("job-message", "Creating…");
    try {
      const job = await api("POST", "/jobs", jobSpec(form));
      location.assign(`/ui/jobs/${encodeURIComponent(job.id)}`);
    } catch (err) { say("job-message", err.message, true); }
  });
};

pages.predictions = () => {
  const form = $("#prediction-form");
  form.addEventListener("submit", async e => {
    e.preventDefault();
    const body = {model: form.model.value, dataset: form.dataset.value, text_column: form.text_column.value,
                  batch_size: Number(form.batch_size.value)};
    say("prediction-message", "Starting…");
    try { const p = await api("POST", "/predictions", body); location.assign(`/ui/predictions/${encodeURIComponent(p.id)}`); }
    catch (err) { say("prediction-message", err.message, true); }
  });
};

pages.prediction = () => {
  const head = $("#prediction-head");
  wireCancelDelete("/ui/predictions");
  if (!["queued", "running"].includes(head.dataset.status)) return;
  const stream = new EventSource(`/predictions/${encodeURIComponent(head.dataset.id)}/stream`);
  releaseWhenHidden(stream);
  stream.addEventListener("progress", e => {
    const p = JSON.parse(e.data);
    $("#job-progress").value = p.progress.fraction;
    $("#job-progress-text").textContent = `${p.progress.rows_done} / ${p.progress.total_rows ?? "?"} rows`;
    showStatus(p.status);
  });
  stream.addEventListener("events", e => appendEvents(JSON.parse(e.data).data));
  stream.addEventListener("end", () => { stream.close(); location.reload(); });
  stream.addEventListener("error", e => { if (e.data) { stream.close(); say("action-message", JSON.parse(e.data).error.message, true); } });
};

// A warm start's history (earlier sweeps' trials, not this sweep's): grey, added first so that it
// is drawn beneath the sweep's own points and listed first, as the report's pictures do.
const EARLIER = "earlier sweeps";

pages.sweep = () => {
  const {metric, params, log, choices, trials, objectives, front, history} = readJSON("chart-data");
  const scored = trials.filter(t => t.value !== null);
  const series = t => (t.status === "pruned" ? "pruned" : "trials");
  const colors = {[EARLIER]: themeColors().muted};
  if (objectives.length > 1) {  // the Pareto front: the second objective across, the first up
    // the report's picture's colours (shared.jobs.sweep_report): the trials blue, the front red
    const chart = new LiveChart($("#chart-front"), {scatter: true, xLabel: objectives[1],
                                                    colors: {...colors, trials: PALETTE[0], front: PALETTE[1]}});
    for (const h of history.filter(h => h.values)) chart.add(EARLIER, h.values[1], h.values[0]);
    for (const t of trials.filter(t => t.status === "succeeded" && !t.values.includes(null))) {
      chart.add(front.includes(t.number) ? "front" : "trials", t.values[1], t.values[0]);
    }
  }
  const xLabel = history.length ? "trial (earlier sweeps' before 0)" : "trial";
  const byTrial = new LiveChart($("#chart-trials"), {scatter: true, xLabel, integerX: true, colors});
  history.forEach((h, i) => byTrial.add(EARLIER, i - history.length, h.value));  // at -n to -1
  for (const t of scored) byTrial.add(series(t), t.number, t.value);
  const box = $("#sweep-charts");
  for (const name of params) {  // each numeric parameter against the objective, the history's grey beneath
    const points = scored.filter(t => typeof t.params[name] === "number");
    const earlier = history.filter(h => typeof h.params[name] === "number");
    if (points.length + earlier.length === 0) continue;
    const figure = document.createElement("figure");
    const caption = document.createElement("figcaption");
    caption.textContent = `${metric} against ${name}`;
    const el = document.createElement("div");
    el.className = "chart";
    figure.append(caption, el);
    box.append(figure);
    const chart = new LiveChart(el, {scatter: true, xLabel: name, logX: log.includes(name), xTicks: choices[name] || null,
                                     colors});
    for (const h of earlier) chart.add(EARLIER, h.params[name], h.value);
    for (const t of points) chart.add(series(t), t.params[name], t.value);
  }
};

const init = pages[document.body.dataset.page];
if (init) init();
