"""The page's step view of a `--generate` run (`attnviz.render.html_steps.js` draws it): per
sentence, what was generated and where it starts, and per (sentence, layer) the generated tokens'
rows over their keys at full key resolution (the map itself may be downsampled).

`doc["generation"]`:
- "encoder_decoder": the rows are decoder rows; "cross" layers' keys are the source's tokens;
- "sentences": per sentence {"first": the row of the first generated token, "tokens": the
  generated tokens, "text": them decoded};
- "rows": per (sentence, layer) with generated rows {"sentence", "layer", "kind", "heads",
  "rows": T generated tokens, "cols": K keys, "first", "key_labels", "scales", "codes"}: the
  rows first..first+T-1 of every head, quantized as the maps are (8 bits, see html_document);
- "left_out": labels of layers without step rows (streamed, or past the page's size budget).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnviz.render.html_codes import b64, quantize

if TYPE_CHECKING:
    from attnviz.compute.forward_pass.results import AttentionRun, LayerAttention
    from attnviz.sources.generate_spec import Generation

STEP_CELLS = 8_000_000  # weights kept for the step view at most (one byte each in the page)


def step_layers(run: AttentionRun) -> list[LayerAttention]:
    """The layers whose rows include generated tokens: a decoder's (self and cross), not an
    encoder's."""
    return [layer for layer in run.layers
            if layer.kind in ("cross", "decoder-self") or
            (layer.kind == "self" and run.target is None)]


def generation_document(run: AttentionRun, generation: Generation,
                        budget: int = STEP_CELLS) -> dict[str, Any]:
    """The step view's part of the page's document (see the module docstring)."""
    entries: list[dict[str, Any]] = []
    left_out: list[str] = []
    used = 0
    for layer in step_layers(run):
        if layer.weights is None:
            left_out.append(layer.label)
            continue
        rows = [_rows(run, layer, generation, b) for b in range(len(generation.generated_ids))]
        cells = sum(len(r["heads"]) * r["rows"] * r["cols"] for r in rows)
        if used + cells > budget:
            left_out.append(layer.label)
            continue
        used += cells
        entries += rows
    sentences = [{"first": int(first), "tokens": [str(t) for t in tokens], "text": str(text)}
                 for first, tokens, text in zip(generation.prompt_lengths,
                                                generation.generated_tokens, generation.texts,
                                                strict=True)]
    return {"encoder_decoder": bool(generation.encoder_decoder), "sentences": sentences,
            "rows": entries, "left_out": left_out}


def boundary_notes(generation: Generation) -> list[str]:
    """Per sentence, where its generated tokens start (the page's notes)."""
    notes = []
    for b, tokens in enumerate(generation.generated_tokens, 1):
        first = generation.prompt_lengths[b - 1]
        rows = f"row {first}" if len(tokens) == 1 else f"rows {first}-{first + len(tokens) - 1}"
        stack = "decoder " if generation.encoder_decoder else ""
        notes.append(f"generated, sentence {b}: {stack}{rows} ({' '.join(tokens)}); the "
                     f"prompt/generated boundary is above {stack}row {first}")
    return notes


def _rows(run: AttentionRun, layer: LayerAttention, generation: Generation,
          b: int) -> dict[str, Any]:
    """One sentence's generated rows of one layer, every head, quantized."""
    import numpy as np

    assert layer.weights is not None
    keys = layer.columns_of(run.batch)[b]
    first, count = generation.prompt_lengths[b], len(generation.generated_ids[b])
    rows = layer.weights[b, :, first:first + count, :len(keys)]  # (H, T, K)
    values = np.ascontiguousarray(rows.numpy(), dtype=np.float32)
    if not np.isfinite(values).all():
        raise ValueError(f"non-finite attention weights in layer {layer.label}")
    codes, scales = quantize(values)
    return {"sentence": b, "layer": layer.index, "kind": layer.kind,
            "heads": list(range(values.shape[0])), "rows": count, "cols": len(keys),
            "first": first, "key_labels": [str(k) for k in keys],
            "scales": b64(scales.astype("<f4").tobytes()), "codes": b64(codes.tobytes())}

