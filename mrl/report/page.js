"use strict";
// The run report: draws the curves (inline SVG), the traced-sample table and the config from the
// JSON block mrl/report/collect.py wrote into the page. No library, nothing fetched.

const DATA = JSON.parse(document.getElementById("run-data").textContent);
const COLORS = ["#2c6fbb", "#d9622b", "#2f9e5a", "#8b50b8", "#c23b4e", "#7a6a2d", "#1b9aa6", "#b35d93", "#5b6472"];
const MAX_ROWS = 500; // rows drawn at once; the search narrows the rest
const W = 440, H = 190, M = { l: 54, r: 10, t: 8, b: 22 };
const SVG_NS = "http://www.w3.org/2000/svg";

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

// Per key, the values of a stacked chart: each phase on top of the ones before it.
function stacked(chart) {
  const base = DATA.steps.map(() => 0), tops = {};
  for (const key of chart.keys) {
    tops[key] = DATA.series[key].map((v, i) => [base[i], (base[i] += v || 0)]);
  }
  return tops;
}

function drawChart(chart) {
  const steps = DATA.steps, s0 = steps[0], s1 = steps[steps.length - 1];
  const tops = chart.kind === "stack" ? stacked(chart) : null;
  const values = [];
  if (tops) { for (const k of chart.keys) tops[k].forEach(([, top]) => values.push(top)); values.push(0); }
  for (const k of tops ? [chart.total].filter(Boolean) : chart.keys) DATA.series[k].forEach(v => v !== null && values.push(v));
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

  chart.keys.forEach((key, n) => {
    const color = COLORS[n % COLORS.length];
    if (tops) {
      const upper = steps.map((s, i) => `${x(s)},${y(tops[key][i][1])}`);
      const lower = steps.map((s, i) => `${x(s)},${y(tops[key][i][0])}`).reverse();
      svg.append(svgEl("polygon", { class: "series area", "data-key": key, points: [...upper, ...lower].join(" "),
                                     style: `fill:${color}` }));
      return;
    }
    const points = steps.map((s, i) => [s, DATA.series[key][i]]).filter(([, v]) => v !== null);
    const d = points.map(([s, v], i) => `${i ? "L" : "M"}${x(s).toFixed(1)},${y(v).toFixed(1)}`).join("");
    svg.append(svgEl("path", { class: "series", "data-key": key, d, stroke: color }));
    if (points.length <= 60) {
      for (const [s, v] of points) svg.append(svgEl("circle", { cx: x(s), cy: y(v), r: 2.2, fill: color }));
    }
  });
  if (tops && chart.total) {
    const d = steps.map((s, i) => [s, DATA.series[chart.total][i]]).filter(([, v]) => v !== null)
      .map(([s, v], i) => `${i ? "L" : "M"}${x(s).toFixed(1)},${y(v).toFixed(1)}`).join("");
    svg.append(svgEl("path", { class: "total", d }));
  }
  return [svg, x];
}

function chartCard(chart) {
  const [svg, x] = drawChart(chart);
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
    DATA.steps.forEach((s, i) => { if (Math.abs(x(s) - px) < Math.abs(x(DATA.steps[best]) - px)) best = i; });
    cursor.setAttribute("x1", x(DATA.steps[best]));
    cursor.setAttribute("x2", x(DATA.steps[best]));
    cursor.setAttribute("visibility", "visible");
    const parts = [...chart.keys, chart.total].filter(Boolean).map(k => `${label(k)} ${fmt(DATA.series[k][best])}`);
    readout.textContent = `step ${DATA.steps[best]} · ${parts.join(" · ")}`;
  });
  svg.addEventListener("mouseleave", () => { cursor.setAttribute("visibility", "hidden"); readout.textContent = ""; });
  return el("div", { class: "card" }, el("h3", {}, chart.title), el("div", { class: "note" }, chart.note), svg, legend, readout);
}

function drawCurves() {
  const root = document.getElementById("curves"), toc = document.getElementById("toc");
  DATA.sections.forEach((section, n) => {
    const id = `section-${n}`;
    root.append(el("h2", { id }, section.title));
    const grid = el("div", { class: "charts" });
    section.charts.forEach(chart => grid.append(chartCard(chart)));
    root.append(grid);
    toc.append(el("a", { href: `#${id}` }, section.title));
  });
  toc.append(el("a", { href: "#samples" }, "Traced samples"), el("a", { href: "#config" }, "Config"));
}

function last(key) {
  const values = (DATA.series[key] || []).filter(v => v !== null);
  return values.length ? values[values.length - 1] : null;
}

function drawSummary() {
  document.getElementById("run-name").textContent = `mrl run: ${DATA.run}`;
  document.getElementById("run-path").textContent = DATA.path;
  const seconds = (DATA.series["timing_s/step"] || []).reduce((a, v) => a + (v || 0), 0);
  const items = [
    ["steps", `${DATA.steps[0]} – ${DATA.steps[DATA.steps.length - 1]}`],
    ["last score (mean)", fmt(last("critic/score/mean"))],
    ["last held-out accuracy", fmt(last("eval/accuracy"))],
    ["time in RL steps", seconds ? `${seconds.toFixed(0)} s` : "–"],
    ["traced samples", String(DATA.samples.length)],
  ];
  const root = document.getElementById("summary");
  for (const [name, value] of items) root.append(el("div", { class: "muted" }, name, el("b", {}, value)));
}

// --- traced samples ---------------------------------------------------------------------------

const COLUMNS = [
  ["step", r => r.step, "num"], ["#", r => r.sample, "num"], ["prompt", r => cut(r, "prompt"), "text"],
  ["response", r => cut(r, "response"), "text"], ["answer", r => cut(r, "ground_truth"), "text"],
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
  return [r.prompt, r.response, r.ground_truth, JSON.stringify(r.reward_info), r.reward_error, r.finish_reason]
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

  const params = new URLSearchParams(location.hash.slice(1));
  search.value = params.get("q") || "";
  select.value = steps.map(String).includes(params.get("step")) ? params.get("step") : "";

  // Draw the rows that match; keep the search in the address (#q=...&step=...) for a link to it.
  function update(remember = true) {
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
    if (!remember) return;
    const hash = new URLSearchParams();
    if (query) hash.set("q", search.value.trim());
    if (step) hash.set("step", step);
    history.replaceState(null, "", hash.toString() ? `#${hash}` : location.pathname + location.search);
  }
  search.addEventListener("input", () => update());
  select.addEventListener("change", () => update());
  update(false);  // the address may hold a section anchor (#samples): leave it for the browser to scroll to
}

function drawConfig() {
  document.getElementById("config-source").textContent = DATA.config ? `from ${DATA.config_source}` : DATA.config_source;
  document.getElementById("config-text").textContent = DATA.config || "(none)";
}

drawSummary();
drawCurves();
drawSamples();
drawConfig();
