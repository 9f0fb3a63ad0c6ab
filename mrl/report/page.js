"use strict";
// The run report: the headline, the evaluations and saved summary, the curves (inline SVG, redrawn
// in place when the smoothing changes), the traced-sample table and the config, from the JSON block
// mrl/report/collect.py wrote into the page. No library, nothing fetched.
// The address keeps the reader's choices (#smooth=0.9&q=...&step=...), so a link reproduces a view.

const DATA = JSON.parse(document.getElementById("run-data").textContent);
const MAX_ROWS = 500; // rows drawn at once; the search narrows the rest
const HASH_KEYS = ["smooth", "q", "step"];
const STATE = Object.fromEntries(HASH_KEYS.map(k => [k, new URLSearchParams(location.hash.slice(1)).get(k) || ""]));

// --- curves ---------------------------------------------------------------------------------------

const COLORS = ["#2c6fbb", "#d9622b", "#2f9e5a", "#8b50b8", "#c23b4e", "#7a6a2d", "#1b9aa6", "#b35d93", "#5b6472"];
const W = 440, H = 190, M = { l: 54, r: 10, t: 8, b: 22 };
const SVG_NS = "http://www.w3.org/2000/svg";
const REDRAWS = []; // one per chart: redraw(weight) sets its curves for a smoothing weight

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  for (const c of children) node.append(c);
  return node;
}

function svgEl(tag, attrs = {}) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

function fmt(v) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v) && Math.abs(v) < 1e6) return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(2).replace(/\.?0+e/, "e");
  return String(Number(v.toPrecision(4)));
}

// About `count` round tick values covering [lo, hi].
function ticks(lo, hi, count) {
  const span = hi - lo, raw = span / count, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map(f => f * mag).find(s => span / s <= count) || 10 * mag;
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(Number(t.toPrecision(12)));
  return out;
}

function range(values) {
  let lo = Math.min(...values), hi = Math.max(...values);
  if (lo === hi) { const pad = Math.abs(lo) * 0.1 || 1; lo -= pad; hi += pad; }
  else { const pad = (hi - lo) * 0.06; lo -= pad; hi += pad; }
  return [lo, hi];
}

// Exponential moving average with TensorBoard's debiasing (the first point is the first value);
// a step without a value stays without one. Weight 0: the values themselves.
function ema(values, weight) {
  if (!weight) return values;
  let acc = 0, n = 0;
  return values.map(v => {
    if (v === null) return null;
    acc = weight * acc + (1 - weight) * v;
    n += 1;
    return acc / (1 - Math.pow(weight, n));
  });
}

// Per key, [bottom, top] at each step of a stacked chart: each phase on top of the ones before it.
function stacked(chart, part, weight) {
  const base = part.steps.map(() => 0), tops = {};
  for (const key of chart.keys) {
    tops[key] = ema(part.series[key], weight).map((v, i) => [base[i], (base[i] += v || 0)]);
  }
  return tops;
}

function pathD(steps, values, x, y) {
  return steps.map((s, i) => [s, values[i]]).filter(([, v]) => v !== null)
    .map(([s, v], i) => `${i ? "L" : "M"}${x(s).toFixed(1)},${y(v).toFixed(1)}`).join("");
}

// The chart's SVG and x scale; registers its redraw. The y range is the raw values' (smoothed ones
// lie within it), so changing the smoothing moves the curves, not the axes.
function drawChart(chart, part) {
  const steps = part.steps, s0 = steps[0], s1 = steps[steps.length - 1];
  const stack = chart.kind === "stack";
  const values = [];
  if (stack) {
    const tops = stacked(chart, part, 0);
    for (const k of chart.keys) tops[k].forEach(([, top]) => values.push(top));
    values.push(0);
  }
  for (const k of stack ? [chart.total].filter(Boolean) : chart.keys) {
    part.series[k].forEach(v => v !== null && values.push(v));
  }
  const [lo, hi] = range(values);
  const x = s => M.l + (s1 === s0 ? 0.5 : (s - s0) / (s1 - s0)) * (W - M.l - M.r);
  const y = v => H - M.b - (v - lo) / (hi - lo) * (H - M.t - M.b);
  const svg = svgEl("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, "data-title": chart.title });

  for (const t of ticks(lo, hi, 4)) {
    svg.append(svgEl("line", { class: "grid", x1: M.l, x2: W - M.r, y1: y(t), y2: y(t) }));
    const label = svgEl("text", { x: M.l - 4, y: y(t) + 3, "text-anchor": "end" });
    label.textContent = fmt(t);
    svg.append(label);
  }
  for (const t of ticks(s0, Math.max(s1, s0 + 1), 6).filter(t => Number.isInteger(t) && t >= s0 && t <= s1)) {
    const label = svgEl("text", { x: x(t), y: H - 6, "text-anchor": "middle" });
    label.textContent = t;
    svg.append(label);
  }
  svg.append(svgEl("line", { class: "axis", x1: M.l, x2: M.l, y1: M.t, y2: H - M.b }));
  svg.append(svgEl("line", { class: "axis", x1: M.l, x2: W - M.r, y1: H - M.b, y2: H - M.b }));

  const shapes = chart.keys.map((key, n) => {
    const color = COLORS[n % COLORS.length];
    if (stack) {
      const area = svgEl("polygon", { class: "series area", "data-key": key, style: `fill:${color}` });
      svg.append(area);
      return { key, area };
    }
    // The raw curve stays, faint, under a smoothed one; the dots mark the logged values.
    const raw = svgEl("path", { class: "raw", d: pathD(steps, part.series[key], x, y), stroke: color,
                                visibility: "hidden" });
    const line = svgEl("path", { class: "series", "data-key": key, d: "", stroke: color });
    svg.append(raw, line);
    const points = steps.map((s, i) => [s, part.series[key][i]]).filter(([, v]) => v !== null);
    if (points.length <= 60) {
      for (const [s, v] of points) svg.append(svgEl("circle", { cx: x(s), cy: y(v), r: 2.2, fill: color }));
    }
    return { key, raw, line };
  });
  const total = stack && chart.total ? svgEl("path", { class: "total" }) : null;
  if (total) svg.append(total);

  REDRAWS.push(weight => {
    const tops = stack ? stacked(chart, part, weight) : null;
    for (const shape of shapes) {
      if (stack) {
        const upper = steps.map((s, i) => `${x(s)},${y(tops[shape.key][i][1])}`);
        const lower = steps.map((s, i) => `${x(s)},${y(tops[shape.key][i][0])}`).reverse();
        shape.area.setAttribute("points", [...upper, ...lower].join(" "));
      } else {
        shape.line.setAttribute("d", pathD(steps, ema(part.series[shape.key], weight), x, y));
        shape.raw.setAttribute("visibility", weight ? "visible" : "hidden");
      }
    }
    if (total) total.setAttribute("d", pathD(steps, ema(part.series[chart.total], weight), x, y));
  });
  return [svg, x];
}

function chartCard(chart, part) {
  const [svg, x] = drawChart(chart, part);
  const prefix = chart.kind === "stack" ? "timing_s/" : chart.title;
  const label = key => (key.startsWith(prefix) && key !== prefix ? key.slice(prefix.length).replace(/^[/_]/, "") : key);
  const legend = el("div", { class: "legend" });
  if (chart.keys.length > 1) {  // a single curve is named by the title
    chart.keys.forEach((key, n) => legend.append(el("span", {}, el("i", { style: `background:${COLORS[n % COLORS.length]}` }), label(key))));
  }
  if (chart.total) legend.append(el("span", {}, "- - step total"));
  const readout = el("div", { class: "readout" });
  const cursor = svgEl("line", { class: "cursor", y1: M.t, y2: H - M.b, visibility: "hidden" });
  svg.append(cursor);
  svg.addEventListener("mousemove", event => {
    const box = svg.getBoundingClientRect(), px = (event.clientX - box.left) * W / box.width;
    let best = 0;
    part.steps.forEach((s, i) => { if (Math.abs(x(s) - px) < Math.abs(x(part.steps[best]) - px)) best = i; });
    cursor.setAttribute("x1", x(part.steps[best]));
    cursor.setAttribute("x2", x(part.steps[best]));
    cursor.setAttribute("visibility", "visible");
    // The logged values, whatever the smoothing.
    const parts = [...chart.keys, chart.total].filter(Boolean).map(k => `${label(k)} ${fmt(part.series[k][best])}`);
    readout.textContent = `step ${part.steps[best]} · ${parts.join(" · ")}`;
  });
  svg.addEventListener("mouseleave", () => { cursor.setAttribute("visibility", "hidden"); readout.textContent = ""; });
  return el("div", { class: "card" }, el("h3", {}, chart.title), el("div", { class: "note" }, chart.note), svg, legend, readout);
}

// A part's sections of charts, then one line naming its metrics that never changed.
function drawPart(part, name, root, toc) {
  part.sections.forEach(section => {
    const id = `section-${root.querySelectorAll("h2").length}`;
    root.append(el("h2", { id }, section.title));
    const grid = el("div", { class: "charts" });
    section.charts.forEach(chart => grid.append(chartCard(chart, part)));
    root.append(grid);
    toc.append(el("a", { href: `#${id}` }, section.title));
  });
  if (part.constant.length) {
    const text = part.constant.map(([k, v]) => `${k}=${fmt(v)}`).join(", ");
    root.append(el("p", { class: "constant", "data-part": name }, el("b", {}, `${name} constant: `), text));
  }
}

function setSmoothing(weight) {
  document.getElementById("curves").setAttribute("data-smoothing", String(weight));
  for (const redraw of REDRAWS) redraw(weight);
}

// --- the page -------------------------------------------------------------------------------------

function remember(updates) {
  Object.assign(STATE, updates);
  const hash = new URLSearchParams();
  for (const k of HASH_KEYS) if (STATE[k]) hash.set(k, STATE[k]);
  history.replaceState(null, "", hash.toString() ? `#${hash}` : location.pathname + location.search);
}

function drawCurves() {
  const root = document.getElementById("curves-body"), toc = document.getElementById("toc");
  toc.append(el("a", { href: "#evaluations" }, "Evaluations"), el("a", { href: "#run-summary" }, "Summary"));
  if (DATA.sft) drawPart(DATA.sft, "SFT", root, toc);
  drawPart(DATA, "RL", root, toc);
  toc.append(el("a", { href: "#samples" }, "Traced samples"), el("a", { href: "#config" }, "Config"));
  const select = document.getElementById("smoothing");
  select.value = [...select.options].some(o => o.value === STATE.smooth) ? STATE.smooth : "0";
  setSmoothing(Number(select.value));
  select.addEventListener("change", () => {
    setSmoothing(Number(select.value));
    remember({ smooth: select.value === "0" ? "" : select.value });
  });
}

function last(key) {
  const values = (DATA.series[key] || []).filter(v => v !== null);
  return values.length ? values[values.length - 1] : null;
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  if (seconds < 120) return `${seconds.toFixed(0)} s`;
  const minutes = Math.floor(seconds / 60);
  if (minutes < 120) return `${minutes} min ${(seconds % 60).toFixed(0)} s`;
  return `${Math.floor(minutes / 60)} h ${minutes % 60} min`;
}

function drawHeadline() {
  document.getElementById("run-name").textContent = `mrl run: ${DATA.run}`;
  document.getElementById("run-path").textContent = DATA.path;
  const summary = DATA.summary || {};
  const inSteps = (DATA.series["timing_s/step"] || []).reduce((a, v) => a + (v || 0), 0);
  const items = [
    ["steps", `${DATA.steps[0]} – ${DATA.steps[DATA.steps.length - 1]}`],
    ["last score (mean)", fmt(last("critic/score/mean"))],
    ["last held-out accuracy", fmt(last("eval/accuracy"))],
    ["run wall time", DATA.summary ? duration(summary.seconds) : "– (no summary.json)"],
    ["time in RL steps", inSteps ? duration(inSteps) : "–"],
  ];
  if (summary.sft) items.push(["SFT", `${summary.sft.steps} steps, ${duration(summary.sft.seconds)}`]);
  else if (DATA.sft) items.push(["SFT", `${DATA.sft.steps.length} steps`]);
  if (summary.stopped) items.push(["stopped", `${summary.stopped.signal} after step ${summary.stopped.step}`]);
  items.push(["traced samples", String(DATA.samples.length)]);
  const root = document.getElementById("headline");
  for (const [name, value] of items) {
    root.append(el("div", { class: "muted", "data-item": name }, name, el("b", {}, value)));
  }
}

function drawEvaluations() {
  const body = document.querySelector("#eval-table tbody");
  if (!DATA.evaluations.length) {
    document.getElementById("eval-note").textContent =
      "No held-out evaluation was recorded (no held-out split, or none ran yet).";
  }
  for (const row of DATA.evaluations) {
    const gap = `; log-prob gap to the run's engine ${fmt(row.gap)} (merged_hf_logprob_gap)`;
    const source = row.gap === null ? row.source : row.source + gap;
    body.append(el("tr", { class: "evaluation" }, el("td", {}, row.when), el("td", { class: "num" }, fmt(row.step)),
                   el("td", { class: "num" }, fmt(row.greedy)), el("td", { class: "num" }, fmt(row.sampled)),
                   el("td", { class: "source" }, source)));
  }
}

function drawRunSummary() {
  const source = document.getElementById("summary-source");
  source.textContent = DATA.summary ? `from ${DATA.summary_source}` : DATA.summary_source;
  const body = document.querySelector("#summary-table tbody");
  for (const [key, value] of DATA.summary_rows) {
    const text = value !== null && typeof value === "object" ? JSON.stringify(value) : fmt(value);
    body.append(el("tr", { class: "summary-row" }, el("th", {}, key), el("td", {}, text)));
  }
}

// --- traced samples ---------------------------------------------------------------------------

const COLUMNS = [
  ["step", r => r.step, "num"], ["#", r => r.sample, "num"], ["prompt", r => cut(r, "prompt"), "text"],
  ["response", r => r.conversation ? conversation(r) : cut(r, "response"), "text"], ["answer", r => cut(r, "ground_truth"), "text"],
  ["score", r => fmt(r.score), "num"], ["reward details", details, "text"], ["advantage", r => fmt(r.advantage), "num"],
  ["drift mean", r => fmt(r.logprob_drift_mean), "num"], ["drift max", r => fmt(r.logprob_drift_max), "num"],
  ["tokens", r => r.response_tokens, "num"], ["finish", r => r.finish_reason ?? "–", "tag"],
  ["weights", r => `v${r.weight_version ?? "?"} · step ${r.policy_step ?? "–"}`, "tag"],
];

// A text field, with a mark when the trace cut it (logging.trace_chars).
function cut(record, field) {
  const text = record[field] ?? "–", full = (record.truncated || {})[field];
  return full ? [text, el("span", { class: "cut", title: `cut from ${full} characters` }, ` ✂ ${full}`)] : [text];
}

// An agent's episode: its messages by role; the policy's turns (the tokens that train) are marked.
function conversation(record) {
  const turns = record.conversation.map(m => el("div", { class: m.trains ? "turn trains" : "turn" },
    el("b", {}, `${m.role}${m.trains ? " (trains)" : ""}: `), m.content));
  const a = record.agent || {};
  const note = `${a.turns ?? "?"} turns, ${a.tool_calls ?? 0} tool calls (${a.tool_errors ?? 0} failed)` +
    (a.truncated ? ", cut by a limit" : "") + (a.error ? `, failed: ${a.error}` : "");
  return [...turns, el("div", { class: "cut" }, note)];
}

function details(record) {
  const parts = [];
  if (record.reward_error) parts.push(el("span", { class: "error" }, `error: ${record.reward_error}`));
  const info = record.reward_info;
  if (info && (typeof info === "string" || Object.keys(info).length)) parts.push(typeof info === "string" ? info : JSON.stringify(info));
  if (record.reward !== null && record.reward !== undefined && record.reward !== record.score) parts.push(` reward ${fmt(record.reward)}`);
  if (record.truncated && record.truncated.reward_info) parts.push(el("span", { class: "cut" }, ` ✂ ${record.truncated.reward_info}`));
  if (record.kept === false) parts.push(" (group dropped by dynamic sampling)");
  return parts.length ? parts : ["–"];
}

function haystack(r) {
  const said = (r.conversation || []).map(m => m.content);
  return [r.prompt, r.response, r.ground_truth, JSON.stringify(r.reward_info), r.reward_error, r.finish_reason, ...said]
    .filter(Boolean).join("\n").toLowerCase();
}

function drawSamples() {
  const samples = DATA.samples.map(r => ({ record: r, text: haystack(r) }));
  const select = document.getElementById("trace-step"), search = document.getElementById("trace-search");
  const body = document.querySelector("#trace-table tbody"), count = document.getElementById("trace-count");
  const steps = [...new Set(DATA.samples.map(r => r.step))];
  const note = document.getElementById("samples-note");
  if (!steps.length) {
    note.textContent = "No traced samples: run with logging.trace_every=N to write <output_dir>/rollouts/step_XXXXXX.jsonl.";
  } else {
    note.textContent = `Steps traced: ${steps.join(", ")}. A step's file keeps at most logging.trace_samples samples and ` +
      `logging.trace_chars characters per text field (✂ marks a cut field, with its full length).`;
  }
  select.append(el("option", { value: "" }, "all"));
  for (const step of steps) {
    const rows = DATA.samples.filter(r => r.step === step);
    select.append(el("option", { value: String(step) }, `${step} (${rows.length} of ${rows[0].of})`));
  }
  document.querySelector("#trace-table thead").append(el("tr", {}, ...COLUMNS.map(([name]) => el("th", {}, name))));

  search.value = STATE.q;
  select.value = steps.map(String).includes(STATE.step) ? STATE.step : "";

  // Draw the rows that match; keep the search in the address (#q=...&step=...) for a link to it.
  function update(keep = true) {
    const query = search.value.trim().toLowerCase(), step = select.value;
    const matches = samples.filter(s => (!step || String(s.record.step) === step) && (!query || s.text.includes(query)));
    body.replaceChildren(...matches.slice(0, MAX_ROWS).map(({ record }) => {
      const cells = COLUMNS.map(([, value, kind]) => {
        const content = value(record);
        return el("td", { class: kind }, ...(Array.isArray(content) ? content : [String(content)]));
      });
      return el("tr", { class: record.kept === false ? "sample dropped" : "sample" }, ...cells);
    }));
    const shown = Math.min(matches.length, MAX_ROWS);
    count.textContent = `${shown} of ${matches.length} matching samples shown (${samples.length} traced)`;
    if (keep) remember({ q: search.value.trim(), step });
  }
  search.addEventListener("input", () => update());
  select.addEventListener("change", () => update());
  update(false);  // the address may hold a section anchor (#samples): leave it for the browser to scroll to
}

function drawConfig() {
  document.getElementById("config-source").textContent = DATA.config ? `from ${DATA.config_source}` : DATA.config_source;
  document.getElementById("config-text").textContent = DATA.config || "(none)";
}

drawHeadline();
drawEvaluations();
drawRunSummary();
drawCurves();
drawSamples();
drawConfig();
