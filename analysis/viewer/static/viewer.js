// kvsnap view: the head grid, one head's attention map with the weight each key receives, the
// keys a compression method keeps, the token view, K/V norms. Text from a file is only ever set
// with textContent. window.kvsnap exposes the state and the last answers (for tests and users).
const config = JSON.parse(document.getElementById("kvsnap-config").textContent);
const embedded = JSON.parse(document.getElementById("kvsnap-data").textContent);
const $ = (id) => document.getElementById(id);
const DEFINITIONS = {
  sink_mass: "sink_mass: mean weight of the queries on key positions 0-3 (StreamingLLM's attention sinks, Xiao et al. 2023).",
  local_mass: "local_mass: mean weight on the keys at most 63 positions back.",
  entropy_normalized: "entropy_normalized: each query's entropy over the log of the number of keys it sees (1 = uniform).",
  retrieval_score: "retrieval_score: of the generated tokens that copy a token of the context, the share whose query's top-1 key holds it (Wu et al. 2024, retrieval heads).",
  streaming_error: "streaming_error: relative error of the head's output if it saw only the 4 sinks and the last 256 positions (DuoAttention's question).",
};
const state = { file: 0, layer: null, head: null, query: null, span: null, info: null, map: null, row: null, grid: null, kept: null };
window.kvsnap = state;

function status(text) { $("status").textContent = text || ""; }

// One request in flight per kind of answer (map, row, kept, kv, grid): a newer one aborts the
// older, and an answer that arrives for a request no longer the latest is dropped, so the page
// always shows the answer to the last thing asked (a head clicked, mean ticked, a zoom).
class Superseded extends Error {}
const inFlight = {};

async function api(name, params = {}, slot = name) {
  if (embedded) return fromEmbedded(name, params);
  const query = new URLSearchParams({ ...params, token: config.token });
  if (inFlight[slot]) inFlight[slot].abort();
  const controller = new AbortController();
  inFlight[slot] = controller;
  let answer, body;
  try {
    answer = await fetch(`/api/${name}?${query}`, { signal: controller.signal });
    body = await answer.json();
  } catch (error) {
    if (controller.signal.aborted) throw new Superseded(name);
    throw error;
  } finally {
    if (inFlight[slot] === controller) delete inFlight[slot];
  }
  if (controller.signal.aborted) throw new Superseded(name);
  if (!answer.ok) throw new Error(body.error || answer.statusText);
  return body;
}

// A failed request's message in the status line; a superseded one says nothing (its successor
// draws). Returns whether the request is still the one to show.
function failed(error) {
  if (error instanceof Superseded) return false;
  status(error.message);
  return true;
}

function fromEmbedded(name, p) {
  const key = `${p.file}:${p.layer}:${p.head}`;
  if (name === "files") return embedded.files;
  if (name === "grid") {
    const grids = embedded.grids[String(p.file)];
    if (!grids) throw new Error("this file holds no queries");
    return grids[p.score];
  }
  if (name === "map") {
    if (!embedded.maps[key]) throw new Error(`layer ${p.layer} head ${p.head} is not in this page (kvsnap view --html --layers/--heads)`);
    return embedded.maps[key];
  }
  if (name === "kv") {
    if (!embedded.kv[key]) throw new Error("not in this page");
    return embedded.kv[key];
  }
  if (name === "row") {
    const map = embedded.maps[key];
    if (!map || !map.exact) throw new Error("a query's row needs the exact map (a short capture) or kvsnap view");
    const i = p.query - map.queries[0];
    const keys = [], weights = [];
    map.tiles[i].forEach((w, j) => { if (w >= 0) { keys.push(map.keys[0] + j); weights.push(w); } });
    return { query: p.query, keys, weights };
  }
  if (name === "diff") return embedded.diff;
  if (name === "qk") {
    if (!embedded.qk || !embedded.qk[key]) throw new Error("this head's projection is not in this page");
    return embedded.qk[key];
  }
  throw new Error(`${name} needs kvsnap view (a server)`);
}

// viridis, five stops
const STOPS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
function interpolated(t) {
  const x = Math.min(Math.max(t, 0), 1) * (STOPS.length - 1);
  const i = Math.min(Math.floor(x), STOPS.length - 2), f = x - i;
  return STOPS[i].map((c, k) => Math.round(c + (STOPS[i + 1][k] - c) * f));
}
const SHADES = Array.from({ length: 1024 }, (_, i) => interpolated(i / 1023));  // a map draws 250k cells
function colour(t) {
  return SHADES[Math.round(Math.min(Math.max(t, 0), 1) * 1023) || 0];
}
function scaled(w) {
  if ($("scale").value === "linear") return w;
  return (Math.log10(Math.max(w, 1e-6)) + 6) / 6;
}

async function start() {
  for (const [name] of Object.entries(DEFINITIONS)) {
    const option = document.createElement("option");
    option.value = name; option.textContent = name;
    $("score").appendChild(option);
  }
  const files = await api("files");
  files.forEach((info, i) => {
    const option = document.createElement("option");
    option.value = String(i); option.textContent = info.name;
    $("file").appendChild(option);
  });
  state.files = files;
  $("file").addEventListener("change", () => { state.file = Number($("file").value); load(); });
  $("score").addEventListener("change", drawGrid);
  $("scale").addEventListener("change", () => { drawMap(); });
  $("method").addEventListener("change", loadKept);
  $("budget").addEventListener("change", loadKept);
  $("reset").addEventListener("click", () => { state.span = null; loadMap(); });
  $("mean").addEventListener("change", loadRow);
  $("compare").addEventListener("change", () => loadCompare());
  $("qk-panel").addEventListener("toggle", loadQk);
  $("qk-colour").addEventListener("change", drawQk);
  setupGrid(); setupMap(); setupQk();
  if (files.length === 2) { loadDiff(); $("compare-label").hidden = Boolean(embedded); }
  await load();
}

async function load() {
  state.info = state.files[state.file];
  state.layer = null; state.head = null; state.query = null; state.span = null;
  if (!state.info.has_queries) {
    $("kv-note").textContent = "This capture holds no queries: attention needs a capture with --queries (kvsnap capture ... --queries window:64). K and V norms per position below.";
    $("grid-what").textContent = "(no queries)";
    const first = state.info.layers.find((l) => l.present);
    if (first) await loadKv(first.layer, 0);
    return;
  }
  $("kv-note").textContent = "";
  // The first head's map first; then the grid, which the server computes on its first request
  if (embedded) {  // a standalone page: the first head whose map it holds
    const key = Object.keys(embedded.maps).find((k) => k.startsWith(`${state.file}:`));
    if (key) { const [, layer, head] = key.split(":").map(Number); await select(layer, head); }
  } else {
    const first = state.info.layers.find((l) => l.query_heads > 0);
    await select(first.layer, 0);
  }
  await drawGrid();
}

async function drawGrid() {
  if (!state.info.has_queries) return;
  const score = $("score").value;
  $("definition").textContent = DEFINITIONS[score];
  $("grid-what").textContent = "(computing...)";
  try {
    state.grid = await api("grid", { file: state.file, score });
  } catch (error) { failed(error); return; }
  $("grid-what").textContent = `(${score}, layers × query heads)`;
  paintGrid($("grid"), state.grid.layers);
}

// The grid's margins (px): layer numbers on the left, head numbers above, the colour legend below.
const GRID = { left: 30, top: 22, legend: 34 };

function ticks(count, cell) {
  // every n-th index, n chosen so that labels sit at least 14 px apart
  const every = Math.max(1, Math.ceil(14 / cell));
  return [...Array(count).keys()].filter((i) => i % every === 0);
}

function paintGrid(canvas, layers) {
  const heads = Math.max(1, ...layers.map((l) => l.length));
  const cell = Math.max(4, Math.min(16, Math.floor(300 / Math.max(heads, layers.length))));
  const width = heads * cell, height = layers.length * cell;
  canvas.width = GRID.left + Math.max(width, 140); canvas.height = GRID.top + height + GRID.legend;
  canvas.dataset.cell = String(cell);
  canvas.dataset.left = String(GRID.left); canvas.dataset.top = String(GRID.top);
  const values = layers.flat().filter((v) => v !== null);
  const low = Math.min(...values), high = Math.max(...values);
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, canvas.width, canvas.height);
  ctx.fillStyle = "#eee"; ctx.fillRect(GRID.left, GRID.top, width, height);
  layers.forEach((row, l) => row.forEach((v, h) => {
    if (v === null) return;
    const [r, g, b] = colour(high > low ? (v - low) / (high - low) : 0.5);
    ctx.fillStyle = `rgb(${r},${g},${b})`;
    ctx.fillRect(GRID.left + h * cell, GRID.top + l * cell, cell - 1, cell - 1);
  }));
  // axes: query heads across, layers down
  ctx.fillStyle = "#444"; ctx.font = "10px system-ui, sans-serif";
  ctx.textAlign = "center"; ctx.textBaseline = "bottom";
  ticks(heads, cell).forEach((h) => ctx.fillText(String(h), GRID.left + h * cell + cell / 2, GRID.top - 2));
  ctx.textAlign = "left"; ctx.fillText("head", 0, 10);
  ctx.textAlign = "right"; ctx.textBaseline = "middle";
  ticks(layers.length, cell).forEach((l) => ctx.fillText(String(l), GRID.left - 4, GRID.top + l * cell + cell / 2));
  // the legend: the colour scale from the lowest value shown to the highest
  const bar = GRID.top + height + 8, span = Math.max(width, 140);
  for (let x = 0; x < span; x++) {
    const [r, g, b] = colour(x / Math.max(1, span - 1));
    ctx.fillStyle = `rgb(${r},${g},${b})`; ctx.fillRect(GRID.left + x, bar, 1, 8);
  }
  ctx.fillStyle = "#444"; ctx.textBaseline = "top";
  const label = (v) => (values.length ? v.toPrecision(3) : "n/a");
  ctx.textAlign = "left"; ctx.fillText(label(low), GRID.left, bar + 10);
  ctx.textAlign = "right"; ctx.fillText(label(high), GRID.left + span, bar + 10);
  ctx.textAlign = "right"; ctx.textBaseline = "middle"; ctx.fillText("layer", GRID.left - 4, 10 + GRID.top / 2);
  canvas.dataset.low = String(low); canvas.dataset.high = String(high);
}

function setupGrid() {
  const canvas = $("grid");
  const at = (event) => {
    const cell = Number(canvas.dataset.cell || 1), box = canvas.getBoundingClientRect();
    const x = event.clientX - box.left - Number(canvas.dataset.left || 0);
    const y = event.clientY - box.top - Number(canvas.dataset.top || 0);
    return [x < 0 || y < 0 ? -1 : Math.floor(y / cell), x < 0 ? -1 : Math.floor(x / cell)];
  };
  canvas.addEventListener("mousemove", (event) => {
    if (!state.grid) return;
    const [l, h] = at(event), row = state.grid.layers[l];
    if (!row || h >= row.length) return;
    const v = row[h];
    $("grid-hover").textContent = `layer ${l} head ${h}: ${state.grid.score} = ${v === null ? "n/a" : v.toFixed(4)}`;
  });
  canvas.addEventListener("click", (event) => {
    const [l, h] = at(event);
    if (state.grid && state.grid.layers[l] && h < state.grid.layers[l].length) select(l, h);
  });
}

async function select(layer, head) {
  state.layer = layer; state.head = head; state.span = null; state.query = null;
  const current = () => state.layer === layer && state.head === head;
  const spec = state.info.layers[layer];
  const kvHead = spec.kv_of[head] ?? Math.min(head, spec.kv_heads - 1);  // the KV head it reads
  await loadMap();
  if (!current()) return;  // another head was selected meanwhile: its own select draws it
  state.headShownAt = performance.now();
  await loadKept();
  if (!current()) return;
  await loadKv(layer, kvHead);
  if (!current()) return;
  await loadQk();
}

async function loadMap() {
  const params = { file: state.file, layer: state.layer, head: state.head, rows: 280, columns: 900, encoding: "f32" };
  if (state.span) Object.assign(params, state.span);
  state.mapParams = params;
  const started = performance.now();
  try {
    state.map = decodeTiles(await api("map", params));
  } catch (error) { failed(error); return; }
  status(state.map.refused ? `${state.map.refused} queries left out: their keys are in no snapshot of the file` : "");
  drawMap();
  state.mapMs = performance.now() - started;
  state.mapsDrawn = (state.mapsDrawn || 0) + 1;
  state.mapDrawnAt = performance.now();
  $("map").dataset.layer = String(state.map.layer); $("map").dataset.head = String(state.map.head);
  $("map").dataset.ms = state.mapMs.toFixed(1);
  if (state.query === null) { state.query = state.map.queries[1] - 1; }
  await Promise.all([loadRow(), loadCompare()]);
}

// Two files: the other file's map of the same head over the same span, and the difference of
// their weights (the other minus this), zoom and selection shared.
async function loadCompare() {
  const on = state.files.length === 2 && !embedded && $("compare").checked && state.mapParams;
  $("compare-panel").hidden = !on;
  if (!on) { state.mapB = null; state.mapDiff = null; return; }
  const params = state.mapParams, other = 1 - params.file;
  try {
    const [b, d] = await Promise.all([
      api("map", { ...params, file: other }, "map-b"),
      api("mapdiff", { ...params, other }, "mapdiff"),
    ]);
    state.mapB = decodeTiles(b); state.mapDiff = decodeTiles(d);
  } catch (error) {
    if (!failed(error)) return;
    state.mapB = null; state.mapDiff = null;
  }
  drawCompare();
}

// tiles sent as float32 bytes (encoding=f32): back to rows of numbers, NaN as null
function decodeTiles(map) {
  if (!map || map.tiles_f32 === undefined) return map;
  const text = atob(map.tiles_f32), bytes = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
  const values = new Float32Array(bytes.buffer), [rows, cols] = map.shape;
  map.tiles = Array.from({ length: rows }, (_, i) => {
    const row = new Array(cols);
    for (let j = 0; j < cols; j++) { const v = values[i * cols + j]; row[j] = Number.isNaN(v) ? null : v; }
    return row;
  });
  delete map.tiles_f32;
  return map;
}

const WHITE = [255, 255, 255];
const weightInk = (w) => (w < 0 ? WHITE : colour(scaled(w)));  // masked and absent cells: white

function paintTiles(canvas, map, ink) {
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  if (!map) return;
  const rows = map.tiles.length, cols = rows ? map.tiles[0].length : 0;
  const image = ctx.createImageData(cols, rows);
  const pixels = image.data;
  for (let i = 0; i < rows; i++) {
    const row = map.tiles[i];
    for (let j = 0, at = 4 * i * cols; j < cols; j++, at += 4) {
      const [r, g, b] = ink(row[j]);
      pixels[at] = r; pixels[at + 1] = g; pixels[at + 2] = b; pixels[at + 3] = 255;
    }
  }
  const off = new OffscreenCanvas(Math.max(cols, 1), Math.max(rows, 1));
  off.getContext("2d").putImageData(image, 0, 0);
  ctx.imageSmoothingEnabled = false;
  ctx.drawImage(off, 0, 0, canvas.width, canvas.height);
}

// blue (the other file lower) through white to red (higher), linear in the signed difference
function diverging(d, largest) {
  if (d === null) return [240, 240, 240];
  const t = Math.min(1, Math.abs(d) / Math.max(largest, 1e-12));
  const end = d < 0 ? [33, 102, 172] : [178, 24, 43];
  return end.map((c) => Math.round(255 + (c - 255) * t));
}

function drawCompare() {
  const name = (i) => state.files[i].name;
  const other = 1 - state.file;
  paintTiles($("map-b"), state.mapB, weightInk);
  paintTiles($("map-diff"), state.mapDiff, (d) => diverging(d, state.mapDiff.largest));
  $("map-b-title").textContent = `${name(other)}: the same head`;
  $("map-diff-title").textContent = state.mapDiff
    ? `${name(other)} − ${name(state.file)}: largest |difference| ${state.mapDiff.largest.toPrecision(3)}${state.mapDiff.exact ? "" : " (each cell the difference of largest magnitude)"}`
    : "Difference";
}

function drawMap() {
  const map = state.map;
  if (!map) return;
  $("map-title").textContent = `Attention: layer ${map.layer}, query head ${map.head} — queries ${map.queries[0]}..${map.queries[1] - 1}, keys ${map.keys[0]}..${map.keys[1] - 1}${map.exact ? " (exact)" : ` (each cell the largest of ${map.step[0]} × ${map.step[1]})`}`;
  paintTiles($("map"), map, weightInk);
  if (state.mapB) drawCompare();
  const strip = $("received"), sctx = strip.getContext("2d");
  sctx.clearRect(0, 0, strip.width, strip.height);
  const top = Math.max(...map.received, 1e-9);
  const width = strip.width / map.received.length;
  sctx.fillStyle = "#6a3d9a";
  map.received.forEach((v, j) => {
    const h = (v / top) * (strip.height - 12);
    sctx.fillRect(j * width, strip.height - h, Math.max(width, 1), h);
  });
  const best = map.received.indexOf(top);
  sctx.fillStyle = "#222";
  sctx.fillText(`weight received (mean over queries); largest at key ${map.keys[0] + best * map.step[1]}: ${top.toFixed(3)}`, 4, 10);
  drawKept();
}

// The three maps (this file's, the other file's, their difference) share one span: a drag on any
// of them zooms all three, a click on any shows that query's row.
function setupMap() {
  attachMap($("map"), "map", "map-hover", (w) => (w < 0 ? "masked" : w.toPrecision(4)));
  attachMap($("map-b"), "mapB", "compare-hover", (w) => (w < 0 ? "masked" : `${w.toPrecision(4)} in the other file`));
  attachMap($("map-diff"), "mapDiff", "compare-hover", (d) => (d === null ? "masked" : `the other file ${d >= 0 ? "+" : ""}${d.toPrecision(3)}`));
}

function attachMap(canvas, which, hover, describe) {
  let down = null;
  const cellAt = (event) => {
    const map = state[which], box = canvas.getBoundingClientRect();
    const rows = map.tiles.length, cols = map.tiles[0].length;
    const i = Math.min(rows - 1, Math.floor(((event.clientY - box.top) / box.height) * rows));
    const j = Math.min(cols - 1, Math.floor(((event.clientX - box.left) / box.width) * cols));
    return [i, j, map.queries[0] + i * map.step[0], map.keys[0] + j * map.step[1]];
  };
  canvas.addEventListener("mousedown", (event) => { if (state[which]) down = cellAt(event); });
  canvas.addEventListener("mousemove", (event) => {
    if (!state[which]) return;
    const [i, j, q, k] = cellAt(event);
    $(hover).textContent = `query ${q}, key ${k}: ${describe(state[which].tiles[i][j])}`;
  });
  canvas.addEventListener("mouseup", async (event) => {
    if (!down || !state[which]) return;
    const up = cellAt(event), start = down; down = null;
    if (up[0] === start[0] && up[1] === start[1]) {  // a click: that query's row
      state.query = up[2]; await loadRow(); return;
    }
    const step = state[which].step;
    state.span = {
      q0: Math.min(start[2], up[2]), q1: Math.max(start[2], up[2]) + step[0],
      k0: Math.min(start[3], up[3]), k1: Math.max(start[3], up[3]) + step[1],
    };
    await loadMap();
  });
}

async function loadKept() {
  const method = $("method").value;
  state.kept = null;
  if (method && state.layer !== null && !embedded) {
    try {
      state.kept = await api("kept", { file: state.file, layer: state.layer, head: state.head, method, budget: $("budget").value });
    } catch (error) { if (!failed(error)) return; }
  }
  drawKept();
}

function drawKept() {
  const canvas = $("kept"), ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  if (!state.kept || !state.map) return;
  const [k0, k1] = state.map.keys, width = canvas.width / (k1 - k0);
  state.kept.keys.forEach((p, i) => {
    if (p < k0 || p >= k1) return;
    ctx.fillStyle = state.kept.kept[i] ? "#9fd89f" : "#333";
    ctx.fillRect((p - k0) * width, 0, Math.max(width, 1), canvas.height);
  });
}

async function loadRow() {
  if (state.layer === null || state.query === null) return;
  if (state.qk) drawQk();
  const head = $("mean").checked ? -1 : state.head;
  try {
    state.row = await api("row", { file: state.file, layer: state.layer, head, query: state.query });
  } catch (error) {
    if (!failed(error)) return;
    state.row = null;
  }
  drawTokens();
}

// The token view holds at most MAX_TOKENS tokens: every token of a short capture; of a long one,
// the keys the query's row lists (the nearest and the heaviest) with the gaps between them named.
const MAX_TOKENS = 4096;

function shownPositions(count) {
  if (count <= MAX_TOKENS) return [...Array(count).keys()];
  const wanted = new Set(state.row ? state.row.keys : []);
  if (state.query !== null && state.query < count) wanted.add(state.query);
  if (!wanted.size) for (let p = count - MAX_TOKENS; p < count; p++) wanted.add(p);
  return [...wanted].sort((a, b) => a - b);
}

function drawTokens() {
  const box = $("tokens");
  box.replaceChildren();
  const tokens = state.info.tokens;
  if (!tokens) { box.textContent = "(the file records no token text)"; return; }
  const weights = new Map();
  if (state.row) state.row.keys.forEach((p, i) => weights.set(p, state.row.weights[i]));
  let top = 1e-9;
  for (const w of weights.values()) top = Math.max(top, w);
  let previous = -1;
  const pieces = [];
  for (const p of shownPositions(tokens.length)) {
    if (p > previous + 1) {
      const gap = document.createElement("em");
      gap.className = "gap";
      gap.textContent = `… ${p - previous - 1} tokens …`;
      pieces.push(gap);
    }
    previous = p;
    const span = document.createElement("span");
    span.textContent = tokens[p];  // text, never markup
    span.dataset.position = String(p);
    const w = weights.get(p);
    if (w !== undefined) {
      span.dataset.weight = String(w);
      span.style.background = `rgba(106, 61, 154, ${Math.min(1, w / top).toFixed(3)})`;
      span.title = `position ${p}: weight ${w.toPrecision(4)}`;
    }
    if (p === state.query) span.className = "query";
    span.addEventListener("click", () => { state.query = p; loadRow(); });
    pieces.push(span);
  }
  if (previous < tokens.length - 1) {
    const gap = document.createElement("em");
    gap.className = "gap";
    gap.textContent = `… ${tokens.length - previous - 1} tokens …`;
    pieces.push(gap);
  }
  box.append(...pieces);
}

async function loadKv(layer, head) {
  let view;
  try { view = await api("kv", { file: state.file, layer, head }); } catch (error) { failed(error); return; }
  state.kv = view;
  const each = view.step > 1 ? ` (each point the largest of ${view.step} positions)` : "";
  $("kv-title").textContent = `K and V: layer ${layer}, KV head ${head} — ||k||, ||v|| per position; channel ${view.channel} of k (its largest on average)${each}`;
  const canvas = $("kv"), ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const series = [[view.k_norm, "#1f77b4"], [view.v_norm, "#ff7f0e"], [view.k_channel.map((x) => (x === null ? null : Math.abs(x))), "#2ca02c"]];
  const top = Math.max(1e-9, ...series.flatMap(([values]) => values.filter((x) => x !== null)));
  const n = view.positions.length;
  series.forEach(([values, ink]) => {
    ctx.strokeStyle = ink; ctx.beginPath();
    values.forEach((v, i) => {
      if (v === null) return;
      const x = (i / Math.max(n - 1, 1)) * canvas.width, y = canvas.height - (v / top) * (canvas.height - 4);
      i ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
    });
    ctx.stroke();
  });
}

async function loadDiff() {
  try {
    const diff = await api("diff", { file: 0, other: 1 });
    if (!diff) return;
    $("diff-title").hidden = false; $("diff").hidden = false;
    state.diff = diff;
    paintGrid($("diff"), diff.layers);
  } catch (error) { failed(error); }
}

// -- queries and keys in one plane (AttentionViz's joint view) -----------------------------------

const PALETTE = [[31, 119, 180], [255, 127, 14], [44, 160, 44], [214, 39, 40], [148, 103, 189],
  [140, 86, 75], [227, 119, 194], [127, 127, 127], [188, 189, 34], [23, 190, 207]];

function tokenColour(p) {
  const tokens = state.info.tokens;
  if (!tokens || tokens[p] === undefined) return PALETTE[7];
  let h = 0;
  for (let i = 0; i < tokens[p].length; i++) h = (h * 31 + tokens[p].charCodeAt(i)) | 0;
  return PALETTE[Math.abs(h) % PALETTE.length];
}

async function loadQk() {
  if (!$("qk-panel").open || state.layer === null || !state.info.has_queries) return;
  const started = performance.now();
  try {
    state.qk = await api("qk", { file: state.file, layer: state.layer, head: state.head });
  } catch (error) {
    if (!failed(error)) return;
    state.qk = null;
  }
  drawQk();
  state.qkMs = performance.now() - started;
  state.qkDrawn = (state.qkDrawn || 0) + 1;
}

function drawQk() {
  const canvas = $("qk"), ctx = canvas.getContext("2d"), view = state.qk;
  const width = canvas.width, height = canvas.height, pad = 10;
  ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, width, height);
  if (!view) return;
  const groups = [view.keys, view.queries];
  let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
  for (const g of groups) for (let i = 0; i < g.x.length; i++) {
    x0 = Math.min(x0, g.x[i]); x1 = Math.max(x1, g.x[i]); y0 = Math.min(y0, g.y[i]); y1 = Math.max(y1, g.y[i]);
  }
  const unit = Math.min((width - 2 * pad) / Math.max(x1 - x0, 1e-12), (height - 2 * pad) / Math.max(y1 - y0, 1e-12));
  const byToken = $("qk-colour").value === "token", last = Math.max(1, state.info.seq_len - 1);
  const image = ctx.getImageData(0, 0, width, height), pixels = image.data;
  const put = (px, py, size, [r, g, b]) => {
    for (let dy = 0; dy < size; dy++) for (let dx = 0; dx < size; dx++) {
      const x = px + dx, y = py + dy;
      if (x < 0 || y < 0 || x >= width || y >= height) continue;
      const at = 4 * (y * width + x);
      pixels[at] = r; pixels[at + 1] = g; pixels[at + 2] = b; pixels[at + 3] = 255;
    }
  };
  state.qkPoints = groups.map((g) => {
    const xs = new Float32Array(g.x.length), ys = new Float32Array(g.x.length);
    for (let i = 0; i < g.x.length; i++) {
      xs[i] = pad + (g.x[i] - x0) * unit; ys[i] = height - pad - (g.y[i] - y0) * unit;
    }
    return { xs, ys, positions: g.positions };
  });
  const [keys, queries] = state.qkPoints;
  for (let i = 0; i < keys.xs.length; i++) {
    const p = keys.positions[i];
    put(Math.round(keys.xs[i]) - 1, Math.round(keys.ys[i]) - 1, 2, byToken ? tokenColour(p) : colour(p / last));
  }
  for (let i = 0; i < queries.xs.length; i++) {
    const p = queries.positions[i], x = Math.round(queries.xs[i]) - 3, y = Math.round(queries.ys[i]) - 3;
    put(x, y, 6, [20, 20, 20]);
    put(x + 1, y + 1, 4, byToken ? tokenColour(p) : colour(p / last));
  }
  ctx.putImageData(image, 0, 0);
  const chosen = queries.positions.indexOf(state.query);
  if (chosen >= 0) {
    ctx.strokeStyle = "#d33"; ctx.lineWidth = 2; ctx.beginPath();
    ctx.arc(queries.xs[chosen], queries.ys[chosen], 7, 0, 2 * Math.PI); ctx.stroke();
  }
  const every = (n) => (n > 1 ? ` (every ${n}th)` : "");
  $("qk-what").textContent = `— layer ${view.layer}, query head ${view.head}, KV head ${view.kv_head}: ${queries.xs.length} queries${every(view.step[0])}, ${keys.xs.length} keys${every(view.step[1])}; the axes hold ${(100 * view.explained[0]).toFixed(1)}% and ${(100 * view.explained[1]).toFixed(1)}% of the variance`;
}

function nearestQk(event, only) {
  if (!state.qkPoints) return null;
  const box = $("qk").getBoundingClientRect();
  const x = ((event.clientX - box.left) / box.width) * $("qk").width;
  const y = ((event.clientY - box.top) / box.height) * $("qk").height;
  let best = null, distance = 64;  // within 8 px
  state.qkPoints.forEach((g, kind) => {
    if (only !== undefined && kind !== only) return;
    for (let i = 0; i < g.xs.length; i++) {
      const d = (g.xs[i] - x) ** 2 + (g.ys[i] - y) ** 2;
      if (d < distance) { distance = d; best = [kind, g.positions[i]]; }
    }
  });
  return best;
}

function setupQk() {
  $("qk").addEventListener("mousemove", (event) => {
    const found = nearestQk(event);
    if (!found) { $("qk-hover").textContent = ""; return; }
    const [kind, p] = found, tokens = state.info.tokens;
    $("qk-hover").textContent = `${kind ? "query" : "key"} at position ${p}${tokens && tokens[p] !== undefined ? `: ${JSON.stringify(tokens[p])}` : ""}`;
  });
  $("qk").addEventListener("click", (event) => {
    const found = nearestQk(event, 1);
    if (found) { state.query = found[1]; loadRow(); }
  });
}

state.select = select;  // for notebooks, scripts and the benchmark: select(layer, head)
state.showQk = async () => {  // opens the plane (its toggle loads it) and waits until it is drawn
  const before = state.qkDrawn || 0;
  if ($("qk-panel").open) await loadQk(); else $("qk-panel").open = true;
  while ((state.qkDrawn || 0) === before) await new Promise((resolve) => setTimeout(resolve, 2));
};
state.zoom = (span) => { state.span = span; return loadMap(); };
start().catch((error) => status(error.message));
