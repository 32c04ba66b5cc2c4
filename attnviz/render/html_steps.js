// attnviz step view of a --generate run: the generated text, and for a chosen generated token its
// row (the one computed when the token was fed back in) over every token before it, each head's
// row, and the full map with the prompt/generated boundary. Runs after html_view.js, whose
// helpers it takes from window.attnviz.view; reads doc.generation (attnviz/render/html_steps.py).
// Data goes on the page only as text (textContent, title, canvas); no network.
(function () {
  "use strict";

  const api = window.attnviz && window.attnviz.view;
  if (!api || !api.doc.generation) return;
  const { doc, state, el, fmt, headColor, colorOf, decoded, weight, layerName, mapIndex } = api;
  const gen = doc.generation;
  const $ = (id) => document.getElementById(id);
  const BOUNDARY = "#ff2d2d";
  const TOP = 5; // keys listed under the row

  const rowIndex = new Map();
  for (const entry of gen.rows) rowIndex.set(entry.sentence + ":" + entry.layer, entry);
  const layers = [];
  for (const entry of gen.rows) {
    if (!layers.some((l) => l.index === entry.layer)) {
      layers.push({ index: entry.layer, kind: entry.kind });
    }
  }
  const crosses = layers.filter((l) => l.kind === "cross");
  const step = {
    // as the terminal's focus table: the last cross layer, else the last layer
    layer: layers.length ? (crosses.length ? crosses : layers).slice(-1)[0].index : null,
    head: "mean",
    index: 0,
    preview: null,
  };

  function current() {
    const entry = rowIndex.get(state.sentence + ":" + step.layer);
    return entry ? decoded(entry) : null;
  }

  function sentence() {
    return gen.sentences[state.sentence];
  }

  // the shown row of generated token j: one head's, or the mean over heads (NaN = masked)
  function shownRow(entry, j) {
    const out = new Float32Array(entry.cols);
    if (step.head !== "mean") {
      const hi = entry.heads.indexOf(step.head);
      for (let k = 0; k < entry.cols; k++) out[k] = weight(entry, hi, j, k);
      return out;
    }
    for (let k = 0; k < entry.cols; k++) {
      let sum = 0, seen = false;
      for (let hi = 0; hi < entry.heads.length; hi++) {
        const w = weight(entry, hi, j, k);
        if (!Number.isNaN(w)) { sum += w; seen = true; }
      }
      out[k] = seen ? sum / entry.heads.length : NaN;
    }
    return out;
  }

  // keys a generated token's row can see: all of the source (cross), else up to itself
  function visible(entry, j) {
    return entry.kind === "cross" ? entry.cols : Math.min(entry.cols, entry.first + j + 1);
  }

  // ---- controls ----------------------------------------------------------------------------

  function buildControls() {
    const layerSelect = $("step-layer");
    for (const l of layers) {
      layerSelect.append(el("option", { value: String(l.index), text: layerName(l.index) +
        (l.kind === "cross" ? " (cross: over the source)" : "") }));
    }
    if (step.layer !== null) layerSelect.value = String(step.layer);
    layerSelect.addEventListener("change", () => {
      step.layer = Number(layerSelect.value);
      renderHeads();
      renderStep();
    });
    $("step-head").addEventListener("change", (event) => {
      const value = event.target.value;
      step.head = value === "mean" ? "mean" : Number(value);
      renderStep();
    });
    $("step-prev").addEventListener("click", () => select(step.index - 1, true));
    $("step-next").addEventListener("click", () => select(step.index + 1, true));
    $("sentence-select").addEventListener("change", () => {
      step.index = 0;
      step.preview = null;
      renderText();
      renderHeads();
      renderStep();
    });
  }

  function renderHeads() {
    const select = $("step-head");
    const entry = current();
    const before = step.head;
    select.replaceChildren(el("option", { value: "mean", text: "mean over heads" }));
    if (!entry) return;
    for (const h of entry.heads) select.append(el("option", { value: String(h), text: "head " + h }));
    if (before !== "mean" && !entry.heads.includes(before)) step.head = "mean";
    select.value = String(step.head);
  }

  function select(j, focus) {
    const count = sentence().tokens.length;
    if (!count) return;
    step.index = Math.max(0, Math.min(count - 1, j));
    step.preview = null;
    renderStep();
    if (focus) {
      const button = document.querySelector('#step-text .gtok[data-step="' + step.index + '"]');
      if (button && document.activeElement !== $("step-prev") &&
        document.activeElement !== $("step-next")) button.focus();
    }
  }

  // ---- the text ----------------------------------------------------------------------------

  function renderText() {
    const box = $("step-text");
    box.replaceChildren();
    const s = sentence();
    const tokens = doc.sentences[state.sentence].tokens;
    const prompt = gen.encoder_decoder ? tokens : tokens.slice(0, s.first);
    box.append(el("span", { cls: "step-label", text: gen.encoder_decoder ? "source" : "prompt" }));
    prompt.forEach((t, i) => box.append(el("span", { cls: "ptok", text: t, title: "token " + i })));
    if (gen.encoder_decoder) {
      box.append(el("br"), el("span", { cls: "step-label", text: "written" }));
    }
    box.append(el("span", { cls: "boundary", text: "│", title: "prompt/generated boundary" }));
    s.tokens.forEach((t, j) => {
      const button = el("button", {
        type: "button", cls: "gtok", text: t, title: "generated token " + (j + 1) + ", row " +
          (s.first + j), dataset: { step: String(j) },
      });
      button.addEventListener("click", () => select(j, false));
      button.addEventListener("mouseenter", () => { step.preview = j; renderStep(); });
      button.addEventListener("mouseleave", () => { step.preview = null; renderStep(); });
      button.addEventListener("focus", () => { if (step.index !== j) select(j, false); });
      button.addEventListener("keydown", (event) => {
        const moves = { ArrowRight: 1, ArrowDown: 1, ArrowLeft: -1, ArrowUp: -1 };
        if (event.key in moves) {
          event.preventDefault();
          select(j + moves[event.key], true);
        } else if (event.key === "Home" || event.key === "End") {
          event.preventDefault();
          select(event.key === "Home" ? 0 : s.tokens.length - 1, true);
        }
      });
      box.append(button);
    });
    if (!s.tokens.length) box.append(el("span", { cls: "ptok", text: "(nothing generated)" }));
  }

  // ---- the chosen step ---------------------------------------------------------------------

  function renderStep() {
    const s = sentence();
    const j = step.preview === null ? step.index : step.preview;
    for (const button of document.querySelectorAll("#step-text .gtok")) {
      const k = Number(button.dataset.step);
      button.classList.toggle("current", k === step.index);
      button.classList.toggle("preview", k === step.preview);
      button.setAttribute("aria-pressed", String(k === step.index));
      button.tabIndex = k === step.index ? 0 : -1;
    }
    const entry = current();
    const row = $("step-row");
    row.replaceChildren();
    $("step-top").replaceChildren();
    const view = $("step-view");
    if (!entry || !s.tokens.length) {
      $("step-status").textContent = !s.tokens.length ? "nothing was generated" :
        "no step rows in this page for this layer" + (gen.left_out.length ? " (left out: " +
          gen.left_out.join(", ") + ")" : "");
      return;
    }
    const values = shownRow(entry, j);
    const n = visible(entry, j);
    let max = 0;
    for (let k = 0; k < n; k++) if (values[k] > max) max = values[k];
    for (let k = 0; k < n; k++) {
      if (entry.kind !== "cross" && k === entry.first) {
        row.append(el("span", { cls: "boundary", text: "│", title: "prompt/generated boundary" }));
      }
      const w = values[k];
      const masked = Number.isNaN(w);
      const chip = el("span", {
        cls: "key" + (masked ? " masked" : ""), text: entry.key_labels[k],
        title: "position " + k + " “" + entry.key_labels[k] + "”: " + (masked ? "masked" :
          "weight " + w.toFixed(4)),
        dataset: { position: String(k), weight: masked ? "" : String(w) },
      });
      if (!masked && max > 0) {
        chip.style.background = "rgba(255, 196, 0, " + Math.min(1, w / max).toFixed(3) + ")";
      }
      row.append(chip);
    }
    const order = Array.from({ length: n }, (_, k) => k).filter((k) => !Number.isNaN(values[k]))
      .sort((a, b) => values[b] - values[a]).slice(0, TOP);
    for (const k of order) {
      $("step-top").append(el("li", { text: k + " “" + entry.key_labels[k] + "” " +
        fmt(values[k], 3) }));
    }
    const next = j + 1 < s.tokens.length ? "; it writes “" + s.tokens[j + 1] + "”" : "";
    const who = step.head === "mean" ? "mean over " + entry.heads.length + " heads" :
      "head " + step.head;
    $("step-status").textContent = "sentence " + (state.sentence + 1) + " · generated token " +
      (j + 1) + " of " + s.tokens.length + " “" + s.tokens[j] + "” · " +
      (gen.encoder_decoder ? "decoder " : "") + "row " + (entry.first + j) + " · " +
      layerName(entry.layer) + " · " + who + " — its row when fed back in" + next +
      (entry.kind === "cross" ? "; keys: the source" : "");
    view.dataset.step = String(j);
    view.dataset.row = String(entry.first + j);
    drawHeads(entry, j, n);
    drawMap(entry, j);
  }

  // each head's row at step j: one strip per head, coloured by that row's own maximum
  function drawHeads(entry, j, n) {
    const canvas = $("step-heads");
    const H = entry.heads.length;
    const cell = Math.max(2, Math.min(24, Math.floor(640 / Math.max(1, n))));
    const left = 36, rowH = 14;
    canvas.width = left + n * cell + 4;
    canvas.height = H * rowH + 4;
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#ffffff";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    const rgba = new Uint8Array(4);
    ctx.font = "11px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    for (let hi = 0; hi < H; hi++) {
      let max = 0;
      for (let k = 0; k < n; k++) {
        const w = weight(entry, hi, j, k);
        if (w > max) max = w;
      }
      for (let k = 0; k < n; k++) {
        colorOf(weight(entry, hi, j, k), max || 1, rgba, 0);
        ctx.fillStyle = "rgb(" + rgba[0] + "," + rgba[1] + "," + rgba[2] + ")";
        ctx.fillRect(left + k * cell, 2 + hi * rowH, cell, rowH - 2);
      }
      ctx.fillStyle = headColor(entry.heads[hi]);
      ctx.fillText("h" + entry.heads[hi], 2, 2 + hi * rowH + rowH / 2);
      if (step.head === entry.heads[hi]) {
        ctx.strokeStyle = "#1d1d1f";
        ctx.lineWidth = 2;
        ctx.strokeRect(left - 1, 1 + hi * rowH, n * cell + 2, rowH);
      }
    }
    if (entry.kind !== "cross" && entry.first < n) {
      ctx.strokeStyle = BOUNDARY;
      ctx.lineWidth = 2;
      ctx.beginPath();
      ctx.moveTo(left + entry.first * cell, 0);
      ctx.lineTo(left + entry.first * cell, canvas.height);
      ctx.stroke();
    }
  }

  // the cell of a token along a map's axis (a downsampled map: the block holding it)
  function cellOf(spans, token, cells) {
    if (!spans) return Math.min(token, cells);
    const i = spans.findIndex(([, stop]) => stop > token);
    return i < 0 ? cells : i;
  }

  // the (sentence, layer) map for the chosen head or the mean, boundary and chosen row marked
  function drawMap(stepEntry, j) {
    const canvas = $("step-map");
    const found = mapIndex.get(state.sentence + ":" + stepEntry.layer);
    const ctx = canvas.getContext("2d");
    if (!found) { ctx.clearRect(0, 0, canvas.width, canvas.height); return; }
    const entry = decoded(found);
    const R = entry.rows, C = entry.cols;
    const image = ctx.createImageData(C, R);
    const hi = step.head === "mean" ? -1 : entry.heads.indexOf(step.head);
    let vmax = 0;
    const cells = new Float32Array(R * C);
    for (let k = 0; k < R * C; k++) {
      let value;
      if (hi >= 0) value = entry.values[hi * R * C + k];
      else {
        let sum = 0, seen = false;
        for (let h = 0; h < entry.heads.length; h++) {
          const w = entry.values[h * R * C + k];
          if (!Number.isNaN(w)) { sum += w; seen = true; }
        }
        value = seen ? sum / entry.heads.length : NaN;
      }
      cells[k] = value;
      if (value > vmax) vmax = value;
    }
    for (let k = 0; k < R * C; k++) colorOf(cells[k], vmax || 1, image.data, 4 * k);
    const small = el("canvas", { width: C, height: R });
    small.getContext("2d").putImageData(image, 0, 0);
    const side = 400, pad = 10;
    const cw = side / C, ch = side / R;
    canvas.width = side + 2 * pad;
    canvas.height = side + 2 * pad;
    ctx.fillStyle = "#ffffff";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(small, pad, pad, side, side);
    const boundary = cellOf(entry.row_spans, stepEntry.first, R);
    const chosen = cellOf(entry.row_spans, stepEntry.first + j, R);
    ctx.strokeStyle = BOUNDARY;
    ctx.lineWidth = 2;
    ctx.beginPath();
    ctx.moveTo(pad, pad + boundary * ch);
    ctx.lineTo(pad + side, pad + boundary * ch);
    ctx.stroke();
    if (stepEntry.kind !== "cross") {
      const col = cellOf(entry.col_spans, stepEntry.first, C);
      ctx.setLineDash([4, 3]);
      ctx.beginPath();
      ctx.moveTo(pad + col * cw, pad);
      ctx.lineTo(pad + col * cw, pad + side);
      ctx.stroke();
      ctx.setLineDash([]);
    }
    ctx.strokeStyle = "#ffffff";
    ctx.lineWidth = 2;
    ctx.strokeRect(pad, pad + chosen * ch, side, Math.max(2, ch));
    canvas.dataset.boundaryRow = String(boundary);
    canvas.dataset.chosenRow = String(chosen);
    $("step-map-caption").textContent = layerName(stepEntry.layer) + ", " +
      (hi >= 0 ? "head " + step.head : "mean over heads") + ": the full map (" + R + " × " + C +
      (entry.downsampled ? ", downsampled" : "") + "); red: the prompt/generated boundary" +
      "; outlined: the chosen row";
  }

  function main() {
    buildControls();
    renderText();
    renderHeads();
    renderStep();
    if (gen.left_out.length) {
      $("step-view").append(el("p", { cls: "help", text: "Step rows left out of this page " +
        "(too large, or streamed): layer " + gen.left_out.join(", ") + "; the maps still show " +
        "them." }));
    }
    window.attnviz.step = { select: (j) => select(j, false) };
    document.body.dataset.stepReady = "1";
  }

  try {
    main();
  } catch (error) {
    document.body.prepend(el("p", { id: "fatal", text: "attnviz step view failed: " + error }));
    throw error;
  }
})();
