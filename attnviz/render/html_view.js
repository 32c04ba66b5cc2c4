// attnviz offline attention view: head view, model view, query view, head statistics.
// Reads the document from the JSON script element #attnviz-data (see attnviz/render/html.py for
// its format and the 8-bit scheme) and puts data on the page only as text: textContent, title,
// canvas fillText. No network, no innerHTML, no eval.
(function () {
  "use strict";

  const MASKED_RGB = [205, 205, 205];
  const HATCH = "rgba(120, 120, 120, 0.55)";
  const ROW = 20; // px per token row in the head view (matches --row in the CSS)
  const SMALL = 64; // px side of a model-view thumbnail
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
    "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896",
    "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5"];
  const OVERVIEW_LINES = 40000; // draw every line at rest below this many

  const $ = (id) => document.getElementById(id);

  function el(tag, props, children) {
    const node = document.createElement(tag);
    if (props) {
      for (const [key, value] of Object.entries(props)) {
        if (key === "text") node.textContent = value;
        else if (key === "cls") node.className = value;
        else if (key === "dataset") Object.assign(node.dataset, value);
        else if (key === "style") Object.assign(node.style, value);
        else node[key] = value;
      }
    }
    for (const child of children || []) node.append(child);
    return node;
  }

  function fmt(value, digits) {
    if (value === null || value === undefined || Number.isNaN(value)) return "–";
    return value.toFixed(digits === undefined ? 3 : digits);
  }

  function signed(value, digits) {
    if (value === null || value === undefined) return "–";
    return (value >= 0 ? "+" : "") + value.toFixed(digits === undefined ? 3 : digits);
  }

  function shorten(text, most) {
    // by code points: cutting UTF-16 units could leave half of an emoji, a lone surrogate
    const chars = Array.from(text);
    return chars.length > most ? chars.slice(0, most - 1).join("") + "…" : text;
  }

  function headColor(head) {
    if (head < PALETTE.length) return PALETTE[head];
    return "hsl(" + ((head * 137.508) % 360).toFixed(1) + ", 65%, 42%)";
  }

  // ---- the document ------------------------------------------------------------------------

  const doc = JSON.parse($("attnviz-data").textContent);
  const LEVELS = doc.quantization.levels;
  const MASKED = doc.quantization.masked;
  const LUT = new Uint8Array(256 * 3);
  for (let i = 0; i < 256 * 3; i++) LUT[i] = parseInt(doc.colormap.substr(2 * i, 2), 16);

  const mapIndex = new Map();
  for (const entry of doc.maps) mapIndex.set(entry.sentence + ":" + entry.layer, entry);
  // head statistics arrive as a table (fields, rows); one object per (layer, head)
  const stats = doc.stats.rows.map((row) => {
    const s = {};
    doc.stats.fields.forEach((field, i) => { s[field] = row[i]; });
    return s;
  });
  const statIndex = new Map();
  for (const s of stats) statIndex.set(s.layer + ":" + s.head, s);

  function bytes(base64) {
    const binary = atob(base64);
    const out = new Uint8Array(binary.length);
    for (let i = 0; i < binary.length; i++) out[i] = binary.charCodeAt(i);
    return out;
  }

  // weights (heads × rows × cols, NaN = masked), row scales and each head's maximum
  function decoded(entry) {
    if (entry.values) return entry;
    const H = entry.heads.length, R = entry.rows, C = entry.cols;
    const codes = bytes(entry.codes);
    const scaleBytes = bytes(entry.scales);
    const view = new DataView(scaleBytes.buffer);
    const values = new Float32Array(H * R * C);
    const scales = new Float32Array(H * R);
    const headMax = new Float32Array(H);
    for (let hr = 0; hr < H * R; hr++) {
      const scale = view.getFloat32(hr * 4, true);
      scales[hr] = scale;
      const h = Math.floor(hr / R);
      for (let c = 0, k = hr * C; c < C; c++, k++) {
        const code = codes[k];
        values[k] = code === MASKED ? NaN : (code / LEVELS) * scale;
      }
      if (scale > headMax[h]) headMax[h] = scale;
    }
    entry.values = values;
    entry.rowScales = scales;
    entry.headMax = headMax;
    return entry;
  }

  function weight(entry, hi, r, c) {
    return entry.values[(hi * entry.rows + r) * entry.cols + c];
  }

  function layerInfo(index) {
    return doc.layers.find((l) => l.index === index);
  }

  function layerName(index) {
    const info = layerInfo(index);
    return "layer " + index + (info && info.name ? " · " + info.name : "");
  }

  // "token 3 'cat'", or for a downsampled block "tokens 12–15: a b c d"
  function spanName(entry, axis, i) {
    const spans = axis === "row" ? entry.row_spans : entry.col_spans;
    const labels = axis === "row" ? entry.row_labels : entry.col_labels;
    const tokens = doc.sentences[entry.sentence].tokens;
    if (!spans) {
      return i < tokens.length ? "token " + i + " “" + labels[i] + "”" : labels[i];
    }
    const [a, b] = spans[i];
    const words = [];
    for (let t = a; t < Math.min(b, a + 6); t++) words.push(t < tokens.length ? tokens[t] :
      "<bias_k>");
    if (b - a === 1) return "token " + a + " “" + words[0] + "”";
    return "tokens " + a + "–" + (b - 1) + " (" + (b - a) + "): " + words.join(" ") +
      (b - a > 6 ? " …" : "");
  }

  function colorOf(value, vmax, rgba, offset) {
    if (Number.isNaN(value)) {
      rgba[offset] = MASKED_RGB[0]; rgba[offset + 1] = MASKED_RGB[1];
      rgba[offset + 2] = MASKED_RGB[2];
    } else {
      let t = vmax > 0 ? value / vmax : 0;
      t = t < 0 ? 0 : t > 1 ? 1 : t;
      const i = Math.round(t * 255) * 3;
      rgba[offset] = LUT[i]; rgba[offset + 1] = LUT[i + 1]; rgba[offset + 2] = LUT[i + 2];
    }
    rgba[offset + 3] = 255;
  }

  function vmaxFor(entry, hi) {
    return state.ownScale ? entry.headMax[hi] || 1 : doc.vmax;
  }

  // one head's map at one pixel per cell
  function mapImage(entry, hi) {
    decoded(entry);
    const canvas = el("canvas", { width: entry.cols, height: entry.rows });
    const ctx = canvas.getContext("2d");
    const image = ctx.createImageData(entry.cols, entry.rows);
    const vmax = vmaxFor(entry, hi);
    const base = hi * entry.rows * entry.cols;
    for (let k = 0; k < entry.rows * entry.cols; k++) {
      colorOf(entry.values[base + k], vmax, image.data, 4 * k);
    }
    ctx.putImageData(image, 0, 0);
    return canvas;
  }

  // ---- state and controls ------------------------------------------------------------------

  const state = {
    tab: doc.generation ? "step-view" : "head-view", // a --generate run opens on its steps
    sentence: 0,
    layer: doc.layers.length ? doc.layers[0].index : 0,
    enabled: new Set(),
    hover: null, // {side: "q" | "k", index}
    locked: null,
    ownScale: false,
    detail: null, // {layer, head}
  };
  const allHeads = new Set();
  for (const entry of doc.maps) for (const h of entry.heads) allHeads.add(h);
  for (const h of allHeads) state.enabled.add(h);

  function currentEntry(layer) {
    const entry = mapIndex.get(state.sentence + ":" + (layer === undefined ? state.layer : layer));
    return entry ? decoded(entry) : null;
  }

  function buildMeta() {
    const meta = $("meta");
    const rows = [["source", doc.source], ["inputs", doc.inputs], ["device", doc.device]];
    const geometry = doc.layers.map((l) => l.num_heads).join(", ");
    rows.push(["layers", doc.layers.length + " (heads: " + geometry + ")" +
      (doc.causal ? "; causal" : "")]);
    for (const l of doc.layers) rows.push([layerName(l.index), l.method]);
    for (const note of doc.notes) rows.push(["note", note]);
    for (const [key, value] of rows) meta.append(el("dt", { text: key }), el("dd", { text: value }));
  }

  function buildTabs() {
    const tabs = $("tabs");
    for (const section of document.querySelectorAll("section.view")) {
      if (section.id === "query-view" && !doc.query) continue;
      if (section.id === "step-view" && !doc.generation) continue;
      const button = el("button", {
        id: "tab-" + section.id, type: "button", text: section.dataset.title,
      });
      button.setAttribute("role", "tab");
      button.addEventListener("click", () => { state.tab = section.id; showTab(); });
      tabs.append(button);
    }
  }

  function showTab() {
    for (const section of document.querySelectorAll("section.view")) {
      section.hidden = section.id !== state.tab;
      const button = $("tab-" + section.id);
      if (button) button.setAttribute("aria-selected", String(section.id === state.tab));
    }
    $("layer-control").hidden = state.tab !== "head-view";
    $("sentence-control").hidden = doc.sentences.length < 2 ||
      !(state.tab === "head-view" || state.tab === "model-view" || state.tab === "step-view");
    $("scale-control").hidden = state.tab !== "model-view";
  }

  function buildControls() {
    const sentences = $("sentence-select");
    doc.sentences.forEach((s, i) => {
      sentences.append(el("option", {
        value: String(i), text: (i + 1) + ": " + shorten(s.text, 70) + " (" + s.tokens.length +
          " tokens)",
      }));
    });
    sentences.addEventListener("change", () => {
      state.sentence = Number(sentences.value);
      state.hover = state.locked = null;
      state.detail = null;
      renderHeadView();
      renderModelView();
    });
    const layers = $("layer-select");
    for (const l of doc.layers) {
      layers.append(el("option", { value: String(l.index), text: layerName(l.index) }));
    }
    layers.addEventListener("change", () => {
      state.layer = Number(layers.value);
      renderHeadView();
    });
    $("own-scale").addEventListener("change", (event) => {
      state.ownScale = event.target.checked;
      renderModelView();
      renderLegend();
    });
  }

  // ---- head view ---------------------------------------------------------------------------

  function statLine(s) {
    if (!s) return "";
    return "entropy " + fmt(s.entropy, 2) + " · max " + fmt(s.max_weight, 2) + " · dist " +
      fmt(s.distance, 1);
  }

  function statTitle(s) {
    if (!s) return "";
    return "layer " + s.layer + " head " + s.head + "\nentropy " + fmt(s.entropy, 3) +
      " nats\nmax weight " + fmt(s.max_weight, 3) + "\nmean distance " + fmt(s.distance, 2) +
      "\nfirst " + fmt(s.first) + "  previous " + fmt(s.previous) + "  self " + fmt(s.self) +
      "\nduplicate " + fmt(s.duplicate) + "  induction " + fmt(s.induction) +
      (s.label ? "\nlabel: " + s.label : "");
  }

  function renderHeadToggles(entry) {
    const box = $("head-toggles");
    box.replaceChildren();
    const all = el("button", { type: "button", text: "all heads" });
    const none = el("button", { type: "button", text: "none" });
    all.addEventListener("click", () => {
      for (const h of entry.heads) state.enabled.add(h);
      renderHeadView();
    });
    none.addEventListener("click", () => {
      for (const h of entry.heads) state.enabled.delete(h);
      renderHeadView();
    });
    box.append(el("div", { cls: "buttons" }, [all, none]));
    for (const h of entry.heads) {
      const s = statIndex.get(entry.layer + ":" + h);
      const input = el("input", { type: "checkbox", checked: state.enabled.has(h) });
      input.dataset.head = String(h);
      input.addEventListener("change", () => {
        if (input.checked) state.enabled.add(h); else state.enabled.delete(h);
        drawLines();
      });
      const parts = [input, el("span", { cls: "swatch", style: { background: headColor(h) } }),
        el("span", { text: "head " + h })];
      parts.push(s && s.label ? el("span", { cls: "badge", text: s.label }) : el("span"));
      parts.push(el("span", { cls: "nums", text: statLine(s) }));
      box.append(el("label", { cls: "head-toggle", title: statTitle(s),
        dataset: { head: String(h) } }, parts));
    }
  }

  function tokenColumn(box, entry, side) {
    box.replaceChildren();
    const labels = side === "q" ? entry.row_labels : entry.col_labels;
    labels.forEach((label, i) => {
      const node = el("div", {
        cls: "tok", text: label, title: spanName(entry, side === "q" ? "row" : "col", i),
        dataset: { index: String(i), side },
      });
      node.addEventListener("mouseenter", () => { state.hover = { side, index: i }; drawLines(); });
      node.addEventListener("mouseleave", () => { state.hover = null; drawLines(); });
      node.addEventListener("click", () => {
        const same = state.locked && state.locked.side === side && state.locked.index === i;
        state.locked = same ? null : { side, index: i };
        drawLines();
      });
      box.append(node);
    });
  }

  function renderHeadView() {
    const entry = currentEntry();
    if (!entry) return;
    renderHeadToggles(entry);
    tokenColumn($("hv-left"), entry, "q");
    tokenColumn($("hv-right"), entry, "k");
    const canvas = $("hv-lines");
    const n = Math.max(entry.rows, entry.cols);
    canvas.width = 240;
    canvas.height = n * ROW;
    canvas.style.width = "240px";
    canvas.style.height = n * ROW + "px";
    drawLines();
  }

  function drawLines() {
    const entry = currentEntry();
    if (!entry) return;
    const canvas = $("hv-lines");
    const ctx = canvas.getContext("2d");
    const W = canvas.width;
    ctx.clearRect(0, 0, W, canvas.height);
    ctx.lineWidth = 2;
    const heads = [];
    entry.heads.forEach((h, hi) => { if (state.enabled.has(h)) heads.push([h, hi]); });
    const active = state.hover || state.locked;
    const left = $("hv-left").children, right = $("hv-right").children;
    for (const node of left) node.classList.remove("active", "locked", "masked");
    for (const node of right) node.classList.remove("active", "locked", "masked");
    for (const node of left) node.style.background = "";
    for (const node of right) node.style.background = "";
    if (state.locked) {
      const column = state.locked.side === "q" ? left : right;
      if (column[state.locked.index]) column[state.locked.index].classList.add("locked");
    }
    let lines = 0;
    const line = (r, c, w, color) => {
      ctx.globalAlpha = Math.min(1, w);
      ctx.strokeStyle = color;
      ctx.beginPath();
      ctx.moveTo(0, r * ROW + ROW / 2);
      ctx.lineTo(W, c * ROW + ROW / 2);
      ctx.stroke();
      lines++;
    };
    const status = $("hv-status");
    if (!active) {
      if (entry.rows * entry.cols * heads.length <= OVERVIEW_LINES) {
        for (const [h, hi] of heads) {
          const color = headColor(h);
          for (let r = 0; r < entry.rows; r++) {
            for (let c = 0; c < entry.cols; c++) {
              const w = weight(entry, hi, r, c);
              if (w > 0) line(r, c, 0.35 * w, color);
            }
          }
        }
      }
      ctx.globalAlpha = 1;
      canvas.dataset.lines = String(lines);
      status.textContent = layerName(entry.layer) + ", sentence " + (entry.sentence + 1) + ": " +
        heads.length + " of " + entry.heads.length + " heads shown; hover over a token.";
      return;
    }
    const i = active.index;
    const own = active.side === "q" ? left : right;
    const other = active.side === "q" ? right : left;
    if (own[i]) own[i].classList.add("active");
    const count = active.side === "q" ? entry.cols : entry.rows;
    const strongest = new Float32Array(count);
    const masked = new Array(count).fill(heads.length > 0);
    const best = [];
    for (const [h, hi] of heads) {
      const color = headColor(h);
      let top = -1, topWeight = -1;
      for (let t = 0; t < count; t++) {
        const w = active.side === "q" ? weight(entry, hi, i, t) : weight(entry, hi, t, i);
        if (Number.isNaN(w)) continue;
        masked[t] = false;
        if (w > strongest[t]) strongest[t] = w;
        if (w > topWeight) { topWeight = w; top = t; }
        if (w > 0) {
          if (active.side === "q") line(i, t, w, color); else line(t, i, w, color);
        }
      }
      if (top >= 0) best.push("h" + h + " → " + shorten(other[top].textContent, 16) + " " +
        topWeight.toFixed(3));
    }
    ctx.globalAlpha = 1;
    for (let t = 0; t < count; t++) {
      if (!other[t]) continue;
      if (masked[t]) other[t].classList.add("masked");
      else if (strongest[t] > 0) {
        other[t].style.background = "rgba(255, 196, 0, " + Math.min(1, strongest[t]).toFixed(3) +
          ")";
      }
    }
    canvas.dataset.lines = String(lines);
    const what = active.side === "q" ? "query " : "key ";
    const name = spanName(entry, active.side === "q" ? "row" : "col", i);
    status.textContent = what + name + (state.locked ? " (clicked)" : "") + " — " +
      (active.side === "q" ? "strongest key per head: " : "strongest query per head: ") +
      (best.length ? best.join(", ") : "no head selected");
  }

  // ---- model view --------------------------------------------------------------------------

  function renderModelView() {
    const grid = $("mv-grid");
    grid.replaceChildren();
    const heads = Array.from(allHeads).sort((a, b) => a - b);
    grid.style.gridTemplateColumns = "max-content repeat(" + heads.length + ", max-content)";
    grid.append(el("div", { cls: "hdr" }));
    for (const h of heads) grid.append(el("div", { cls: "hdr", text: "head " + h }));
    for (const l of doc.layers) {
      grid.append(el("div", { cls: "rowhdr", text: "layer " + l.index }));
      const entry = currentEntry(l.index);
      for (const h of heads) {
        const hi = entry ? entry.heads.indexOf(h) : -1;
        if (hi < 0) { grid.append(el("div")); continue; }
        const s = statIndex.get(l.index + ":" + h);
        const canvas = mapImage(entry, hi);
        canvas.className = "map";
        const cell = el("div", {
          cls: "cell", title: "layer " + l.index + " · head " + h + "\n" + statTitle(s),
          dataset: { layer: String(l.index), head: String(h) },
        }, [canvas]);
        if (s && s.label) cell.append(el("span", { cls: "badge", text: s.label }));
        cell.addEventListener("click", () => openDetail(l.index, h));
        grid.append(cell);
      }
    }
    if (state.detail) openDetail(state.detail.layer, state.detail.head);
    else $("mv-detail").hidden = true;
  }

  const large = { base: null, entry: null, hi: 0, cell: 1, left: 0, top: 0 };

  function openDetail(layer, head) {
    const entry = currentEntry(layer);
    if (!entry) return;
    const hi = entry.heads.indexOf(head);
    if (hi < 0) return;
    state.detail = { layer, head };
    for (const node of document.querySelectorAll("#mv-grid .cell")) {
      node.classList.toggle("selected", Number(node.dataset.layer) === layer &&
        Number(node.dataset.head) === head);
    }
    const R = entry.rows, C = entry.cols;
    const cell = Math.max(2, Math.min(28, Math.floor(640 / Math.max(R, C))));
    const margin = 96;
    const left = margin, top = margin;
    const canvas = $("mv-large");
    canvas.width = left + C * cell + 12;
    canvas.height = top + R * cell + 12;
    const base = el("canvas", { width: canvas.width, height: canvas.height });
    const ctx = base.getContext("2d");
    ctx.fillStyle = "#ffffff";
    ctx.fillRect(0, 0, base.width, base.height);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(mapImage(entry, hi), left, top, C * cell, R * cell);
    if (cell >= 6) { // hatch masked cells so they read as "no weight at all"
      ctx.strokeStyle = HATCH;
      ctx.lineWidth = 1;
      ctx.beginPath();
      for (let r = 0; r < R; r++) {
        for (let c = 0; c < C; c++) {
          if (!Number.isNaN(weight(entry, hi, r, c))) continue;
          ctx.moveTo(left + c * cell + 1, top + (r + 1) * cell - 1);
          ctx.lineTo(left + (c + 1) * cell - 1, top + r * cell + 1);
        }
      }
      ctx.stroke();
    }
    ctx.fillStyle = "#1d1d1f";
    ctx.font = "11px system-ui, sans-serif";
    const every = Math.max(1, Math.ceil(12 / cell));
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let r = 0; r < R; r += every) {
      ctx.fillText(shorten(entry.row_labels[r], 13), left - 4, top + r * cell + cell / 2);
    }
    ctx.save();
    ctx.translate(left, top - 4);
    ctx.rotate(-Math.PI / 2);
    ctx.textAlign = "left";
    for (let c = 0; c < C; c += every) {
      ctx.fillText(shorten(entry.col_labels[c], 13), 0, c * cell + cell / 2);
    }
    ctx.restore();
    ctx.fillStyle = "#6b6b70";
    ctx.textAlign = "left";
    ctx.fillText("keys →", 4, 12);
    ctx.fillText("queries ↓", 4, 28);
    Object.assign(large, { base, entry, hi, cell, left, top });
    canvas.getContext("2d").drawImage(base, 0, 0);
    const s = statIndex.get(layer + ":" + head);
    $("mv-title").textContent = "sentence " + (entry.sentence + 1) + " · " + layerName(layer) +
      " · head " + head + (s && s.label ? " · " + s.label : "") + (s ? " · " + statLine(s) : "") +
      (entry.downsampled ? " · downsampled: rows are query blocks (mean), columns key " +
        "blocks (sum)" : "");
    $("mv-readout").textContent = "Move the cursor over the map.";
    $("mv-detail").hidden = false;
  }

  function detailMove(event) {
    if (!large.entry) return;
    const canvas = $("mv-large");
    const box = canvas.getBoundingClientRect();
    const x = (event.clientX - box.left) * (canvas.width / box.width);
    const y = (event.clientY - box.top) * (canvas.height / box.height);
    const { entry, hi, cell, left, top } = large;
    const c = Math.floor((x - left) / cell), r = Math.floor((y - top) / cell);
    const ctx = canvas.getContext("2d");
    ctx.drawImage(large.base, 0, 0);
    if (r < 0 || c < 0 || r >= entry.rows || c >= entry.cols) {
      $("mv-readout").textContent = "Move the cursor over the map.";
      return;
    }
    ctx.strokeStyle = "#ff2d55";
    ctx.lineWidth = 2;
    ctx.strokeRect(left + c * cell, top + r * cell, cell, cell);
    const w = weight(entry, hi, r, c);
    const scale = entry.rowScales[hi * entry.rows + r];
    const value = Number.isNaN(w) ? "masked (weight exactly 0)" : "weight " + w.toFixed(4) +
      " (±" + (scale / (2 * LEVELS)).toPrecision(2) + ", 8-bit)";
    const rowWhat = entry.downsampled ? "queries " : "query ";
    const colWhat = entry.downsampled ? "keys " : "key ";
    $("mv-readout").textContent = rowWhat + spanName(entry, "row", r) + " → " + colWhat +
      spanName(entry, "col", c) + ": " + value;
  }

  // ---- query view --------------------------------------------------------------------------

  function renderQueryView() {
    const section = $("query-view");
    const q = doc.query;
    if (!q) return;
    const d = q.heads.length ? q.heads[0].q.length : 0;
    section.append(el("h2", {
      text: "query " + q.query + " “" + q.token + "” of sentence " + (q.sentence + 1) + ", " +
        layerName(q.layer),
    }));
    section.append(el("p", {
      cls: "qv-intro", text: "Each head works on its own d = " + d + " features of the " +
        "projected query and key: q_h · k_h, times the scale " + q.scale + ", then softmax " +
        "over the keys. Recomputed from the weight slices; max |Δ| against the maps: " +
        (q.max_diff === null ? "–" : q.max_diff.toExponential(1)) +
        (q.positions !== "none" ? ". Positions: " + q.positions + " (q_h and k_h are after it)" :
          "") + ". k_h shows its first " + (q.heads.length ? q.heads[0].keys[0].length : 0) +
        " components.",
    }));
    const heads = el("div", { cls: "qv-heads" });
    for (const h of q.heads) {
      const card = el("div", { cls: "qv-head", dataset: { head: String(h.head) } });
      card.append(el("h3", {
        text: "head " + h.head + (h.kv_head !== h.head ? " (kv head " + h.kv_head + ")" : "") +
          " · W_q rows " + h.q_rows[0] + ":" + h.q_rows[1],
        style: { color: headColor(h.head) },
      }));
      card.append(el("div", { cls: "qvec", text: "q_" + h.head + " = [" +
        h.q.slice(0, 8).map((v) => signed(v, 2)).join(", ") + (h.q.length > 8 ? ", …" : "") +
        "]" }));
      const table = el("table", { cls: "num" });
      const head = el("tr");
      for (const [title, cls] of [["key", "text"], ["k_h", "text"], ["q_h·k_h", ""],
        ["× scale", ""], ["weight", ""], ["", "text"]]) {
        head.append(el("th", { text: title, cls }));
      }
      table.append(head);
      let best = 0;
      h.weights.forEach((w, j) => { if (w > h.weights[best]) best = j; });
      h.weights.forEach((w, j) => {
        const isMasked = w === 0 && h.scores[j] !== 0;
        const row = el("tr", { cls: j === best ? "best" : "" });
        row.append(el("td", { cls: "text", text: j + " " + shorten(q.key_labels[j] || "", 14),
          title: q.key_labels[j] || "" }));
        row.append(el("td", { cls: "text mono", text: "[" + h.keys[j].map((v) => signed(v, 2))
          .join(", ") + (h.key_dim > h.keys[j].length ? ", …" : "") + "]" }));
        row.append(el("td", { text: signed(h.dots[j]) }));
        row.append(el("td", { text: signed(h.scores[j]) }));
        row.append(el("td", { cls: isMasked ? "masked weight" : "weight",
          text: isMasked ? "masked" : fmt(w) }));
        const bar = el("span", { cls: "bar" });
        const rgba = new Uint8Array(4);
        colorOf(isMasked ? NaN : w, 1, rgba, 0);
        bar.style.width = Math.round(80 * (isMasked ? 0 : w)) + "px";
        bar.style.background = "rgb(" + rgba[0] + ", " + rgba[1] + ", " + rgba[2] + ")";
        row.append(el("td", { cls: "text" }, [bar]));
        table.append(row);
      });
      card.append(table);
      heads.append(card);
    }
    section.append(heads);
  }

  // ---- statistics --------------------------------------------------------------------------

  function renderStatsView() {
    const section = $("stats-view");
    section.append(el("p", {
      cls: "help", text: "Means over the real query positions of every sentence; entropy in " +
        "nats, dist = mean attended distance in tokens; first/prev/self = weight on token " +
        "0 / i−1 / i; dup = on earlier copies of the query's token; induct = on the token " +
        "after an earlier copy. A head is labelled when one pattern takes ≥ 0.5 of its " +
        "attention.",
    }));
    const table = el("table", { cls: "num", id: "stats-table" });
    const header = el("tr");
    const columns = [["layer", "layer", 0], ["head", "head", 0], ["entropy", "entropy", 2],
      ["max", "max_weight", 2], ["dist", "distance", 1], ["first", "first", 2],
      ["prev", "previous", 2], ["self", "self", 2], ["dup", "duplicate", 2],
      ["induct", "induction", 2]];
    for (const [title] of columns) header.append(el("th", { text: title }));
    header.append(el("th", { text: "label", cls: "text" }));
    table.append(header);
    for (const s of stats) {
      const row = el("tr");
      for (const [, key, digits] of columns) {
        row.append(el("td", { text: digits ? fmt(s[key], digits) : String(s[key]) }));
      }
      row.append(el("td", { cls: "text" }, s.label ? [el("span", { cls: "badge",
        text: s.label })] : []));
      table.append(row);
    }
    section.append(table);
  }

  // ---- legend ------------------------------------------------------------------------------

  function renderLegend() {
    const legend = $("legend");
    legend.replaceChildren();
    const bar = el("canvas", { width: 256, height: 1 });
    const ctx = bar.getContext("2d");
    const image = ctx.createImageData(256, 1);
    for (let i = 0; i < 256; i++) {
      image.data[4 * i] = LUT[3 * i]; image.data[4 * i + 1] = LUT[3 * i + 1];
      image.data[4 * i + 2] = LUT[3 * i + 2]; image.data[4 * i + 3] = 255;
    }
    ctx.putImageData(image, 0, 0);
    legend.append(el("span", { text: "weight 0" }), bar,
      el("span", { text: state.ownScale ? "each map's max" : fmt(doc.vmax, 3) }),
      el("span", { cls: "swatch-masked" }), el("span", { text: "masked (weight exactly 0)" }));
    const downsampled = doc.maps.some((m) => m.downsampled);
    legend.append(el("span", {
      text: "· weights stored in 8 bits per cell (255 levels of each row's max)" +
        (downsampled ? " · long inputs downsampled to " + doc.quantization.max_cells +
          " blocks per side: key blocks summed, query blocks averaged" : ""),
    }));
  }

  // ---- start -------------------------------------------------------------------------------

  function main() {
    buildMeta();
    buildTabs();
    buildControls();
    renderHeadView();
    renderModelView();
    renderQueryView();
    renderStatsView();
    renderLegend();
    showTab();
    $("mv-large").addEventListener("mousemove", detailMove);
    // for scripts and tests: the decoded weight of a cell (null where masked)
    window.attnviz = {
      weight(sentence, layer, head, row, col) {
        const entry = mapIndex.get(sentence + ":" + layer);
        const w = weight(decoded(entry), entry.heads.indexOf(head), row, col);
        return Number.isNaN(w) ? null : w;
      },
      // for the step view (html_steps.js, which runs next): the page's own helpers and state
      view: { doc, state, el, fmt, shorten, headColor, colorOf, decoded, weight, mapImage,
        layerName, mapIndex, LUT },
    };
    document.body.dataset.ready = "1";
  }

  try {
    main();
  } catch (error) {
    document.body.prepend(el("p", { id: "fatal", text: "attnviz view failed: " + error }));
    throw error;
  }
})();
