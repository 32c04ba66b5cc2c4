"""The JSON-able document of a run that the HTML page draws (`attnviz.render.html`).

Maps: one entry per (sentence, layer) holding every head, over each sentence's real tokens only
(padding cut away; a bias_k key, if any, is the last column). A map larger than `max_cells` per
side is downsampled as the figures do (`attnviz.compute.display.views.downsample`: key blocks
summed, query
blocks averaged, so each row still sums to 1) and its rows and columns carry the token spans they
cover.

Quantization (8 bits per weight), per head and per displayed row r of R rows × C columns:
- scale[r] = the largest weight of the row, as a float32 (little-endian) → "scales", base64 of
  H·R float32 in (head, row) order;
- a weight w that is exactly 0.0 is *masked* and gets the reserved code 255. Softmax gives exactly
  0 to a key masked with −inf (causal mask, padding, sliding window), or, in float32, to a score
  more than ~104 below its row's maximum; a downsampled block is masked when all its cells are;
- any other weight gets code q = round(254 · w / scale[r]) in 0..254 and decodes to
  w' = q / 254 · scale[r], so |w' − w| ≤ scale[r] / 508 ≤ 1/508 (a tiny positive weight can decode
  to 0 but stays apart from masked) → "codes", base64 of H·R·C uint8 in (head, row, column)
  order. A row whose weights are all exactly 0 has scale 0 and only code 255.
Non-finite weights raise ValueError (the CLI refuses them earlier, in check_finite_maps).

Colours: matplotlib's viridis from 0 to `vmax`, the largest weight of all maps in the page, as
the figures' colour bar (the page can also scale each map to its own maximum); masked cells are
grey, apart from every weight. The query view's numbers (QueryBreakdown: q_h·k_h, the scaled
scores and the weights, the first KEY_COMPONENTS components of each k_h) are kept as numbers
rounded to 6 significant digits, not quantized. Head statistics travel as one table,
{"fields": [...HeadStats.to_json() keys], "rows": [[...], ...]}, rounded to 4 digits.
In the page, `window.attnviz.weight(sentence, layer, head, row, col)` returns a decoded weight
(null where masked), for scripts and tests.
"""

from __future__ import annotations

import base64
import math
from dataclasses import asdict, is_dataclass
from typing import TYPE_CHECKING, Any, SupportsFloat, cast

# attnviz internals used here (the only ones): display views of a run
from attnviz.compute.display.maps import select_maps
from attnviz.compute.display.views import downsample
from attnviz.render.html_codes import LEVELS, MASKED, b64, dequantize, quantize

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

    from attnviz.compute.display.views import MapView
    from attnviz.compute.forward_pass.results import AttentionRun
    from attnviz.compute.measures.breakdown import QueryBreakdown
    from attnviz.compute.measures.stats import HeadStats
    from attnviz.sources.generate_spec import Generation

FORMAT = "attnviz-html/1"
MAX_CELLS = 128  # maps larger than this per side are downsampled
KEY_COMPONENTS = 4  # components of each k_h kept for the query view (as the terminal shows)
_DIGITS = 6


def document_from_run(run: AttentionRun, head_stats: list[HeadStats] | list[dict[str, Any]],
                      breakdown: QueryBreakdown | dict[str, Any] | None = None,
                      max_cells: int = MAX_CELLS, generation: Generation | None = None
                      ) -> dict[str, Any]:
    """A JSON-able document of an AttentionRun: every head's map (full maps in
    `captured.weights` (B, H, L, S) or streamed display views in `captured.views`), the head
    statistics (HeadStats, or their to_json() dicts), an optional QueryBreakdown, and for a
    `--generate` run its Generation (the step view, `attnviz.render.html_steps`)."""
    maps, vmax = _map_entries(run, max_cells)
    stats: list[dict[str, Any]] = [s if isinstance(s, dict) else s.to_json() for s in head_stats]
    fields = list(dict.fromkeys(k for s in stats for k in s))
    doc: dict[str, Any] = {
        "format": FORMAT,
        "source": str(run.source),
        "device": str(run.device),
        "inputs": str(run.inputs_described),
        "causal": bool(run.causal),
        "notes": [str(n) for n in run.notes],
        "sentences": [{"text": str(text), "tokens": [str(t) for t in tokens]}
                      for text, tokens in zip(run.batch.sentences, run.batch.tokens,
                                              strict=True)],
        "layers": [{"index": c.index, "name": str(c.name),
                    "num_heads": int(c.heads), "method": str(c.method)}
                   for c in run.layers],
        # HeadStats as a table: one row per (layer, head), values rounded to 4 digits
        "stats": {"fields": fields, "rows": [[_round(s.get(k), 4) if isinstance(s.get(k), float)
                                              else s.get(k) for k in fields] for s in stats]},
        "vmax": _round(vmax) or 1.0,
        "quantization": {"levels": LEVELS, "masked": MASKED, "max_cells": max_cells},
        "colormap": _viridis_hex(),
        "maps": maps,
        "query": None if breakdown is None else _query_json(breakdown, run.batch.tokens),
        "generation": None,
    }
    if generation is not None:
        from attnviz.render.html_steps import boundary_notes, generation_document

        doc["generation"] = generation_document(run, generation)
        doc["notes"] += boundary_notes(generation)
    return doc


def _map_entries(run: AttentionRun, max_cells: int) -> tuple[list[dict[str, Any]], float]:
    """One entry per (sentence, layer) with every head's map quantized, and the largest weight
    of them all."""
    import numpy as np

    groups: dict[tuple[int, int], list[MapView]] = {}
    for view in select_maps(run, None, False):  # per (sentence, layer, head), real tokens only
        groups.setdefault((view.sentence, view.layer), []).append(
            downsample(view, max_cells, max_cells))
    maps, vmax = [], 0.0
    for (sentence, layer), views in sorted(groups.items()):
        views.sort(key=lambda v: cast(int, v.head))  # every head's own map: never None
        values = np.stack([np.asarray(v.values, dtype=np.float32) for v in views])
        if not np.isfinite(values).all():
            raise ValueError(f"non-finite attention weights in layer {layer}, sentence "
                             f"{sentence + 1}")
        codes, scales = quantize(values)
        vmax = max(vmax, float(values.max(initial=0.0)))
        first = views[0]
        maps.append({
            "sentence": sentence, "layer": layer, "heads": [v.head for v in views],
            "rows": int(values.shape[1]), "cols": int(values.shape[2]),
            "row_labels": list(first.row_labels), "col_labels": list(first.col_labels),
            "row_spans": _spans(first.row_spans), "col_spans": _spans(first.col_spans),
            "downsampled": bool(first.downsampled),
            "scales": b64(scales.astype("<f4").tobytes()),
            "codes": b64(codes.tobytes()),
        })
    return maps, vmax


def decode_map(entry: dict[str, Any]) -> NDArray[np.float32]:
    """The (heads, rows, cols) float32 weights of one document map entry, NaN where masked."""
    import numpy as np

    heads, rows, cols = len(entry["heads"]), entry["rows"], entry["cols"]
    codes = np.frombuffer(base64.b64decode(entry["codes"]), dtype=np.uint8)
    scales = np.frombuffer(base64.b64decode(entry["scales"]), dtype="<f4")
    return dequantize(codes.reshape(heads, rows, cols), scales.reshape(heads, rows))


def _spans(spans: tuple[tuple[int, int], ...] | None) -> list[list[int]] | None:
    return None if spans is None else [[int(a), int(b)] for a, b in spans]


def _round(value: SupportsFloat | None, digits: int = _DIGITS) -> float | None:
    if value is None:
        return None
    value = float(value)
    return float(f"{value:.{digits}g}") if math.isfinite(value) else None


def _query_json(breakdown: QueryBreakdown | dict[str, Any],
                tokens: list[list[str]]) -> dict[str, Any]:
    b = asdict(breakdown) if is_dataclass(breakdown) and not isinstance(breakdown, type) \
        else dict(cast("dict[str, Any]", breakdown))
    sentence_tokens = [str(t) for t in tokens[b["sentence"]]]
    heads = []
    for h in b["heads"]:
        heads.append({
            "head": h["head"], "kv_head": h["kv_head"], "q_rows": list(h["q_rows"]),
            "q": [_round(v) for v in h["q"]],
            "keys": [[_round(v) for v in k[:KEY_COMPONENTS]] for k in h["keys"]],
            "key_dim": len(h["keys"][0]) if h["keys"] else 0,
            "dots": [_round(v) for v in h["dots"]],
            "scores": [_round(v) for v in h["scores"]],
            # exact zeros stay exact: the page shows them as masked
            "weights": [0.0 if v == 0.0 else _round(v) for v in h["weights"]],
        })
    extra = len(heads[0]["weights"]) - len(sentence_tokens) if heads else 0
    return {"sentence": b["sentence"], "query": b["query"], "token": str(b["token"]),
            "layer": b["layer"], "scale": _round(b["scale"]), "max_diff": _round(b["max_diff"]),
            "positions": str(b.get("positions", "none")),
            "key_labels": sentence_tokens + ["<bias_k>"] * max(0, extra), "heads": heads}


def _viridis_hex() -> str:
    """The figures' colour map, 256 entries as one string of rrggbb."""
    import matplotlib

    cmap = matplotlib.colormaps["viridis"].resampled(256)
    return "".join("{:02x}{:02x}{:02x}".format(*(round(255 * c) for c in cmap(i)[:3]))
                   for i in range(256))
