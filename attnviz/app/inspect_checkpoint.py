"""What `attnviz inspect` reports: every attention layer's geometry from headers alone, and, for one
layer on request, per-head slices with their norms (the only part that reads tensor data)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnviz.core.layer import AttentionLayer
from attnviz.core.layer_detail import HeadRow, LayerDetail
from attnviz.core.request import HeadHints
from attnviz.core.tensor_ref import TensorRef
from attnviz.errors import CheckpointError, UsageError, option
from attnviz.load.store import TensorStore
from attnviz.recognize import Inventory

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

PROJECTIONS = ("q", "k", "v", "o")


def weight_refs(layer: AttentionLayer) -> dict[str, TensorRef]:
    return {"q": layer.q_weight, "k": layer.k_weight, "v": layer.v_weight, "o": layer.o_weight}


def bias_refs(layer: AttentionLayer) -> dict[str, TensorRef]:
    refs = {"q": layer.q_bias, "k": layer.k_bias, "v": layer.v_bias, "o": layer.o_bias,
            "bias_k": layer.bias_k, "bias_v": layer.bias_v}
    return {name: r for name, r in refs.items() if r is not None}


def parameter_count(layer: AttentionLayer) -> int:
    return sum(r.numel for r in (*weight_refs(layer).values(), *bias_refs(layer).values()))


def layer_summary(layer: AttentionLayer, index: int) -> dict[str, Any]:
    """Header-only facts about one layer, JSON-ready."""
    weights = weight_refs(layer)
    return {
        "index": index,
        "name": layer.name,
        "family": layer.family,
        "embed_dim": layer.embed_dim,
        "num_heads": layer.num_heads,
        "num_kv_heads": layer.num_kv_heads,
        "head_dim": layer.head_dim,
        "kdim": layer.kdim,
        "vdim": layer.vdim,
        "shapes": {name: list(r.shape) for name, r in weights.items()},
        "stored_at": {name: r.describe() for name, r in weights.items()},
        "stored_shapes": {name: list(r.stored_shape) for name, r in weights.items()},
        "transposed": any(r.transposed for r in weights.values()),
        "storage": layer.storage,
        "bias": list(bias_refs(layer)),
        "dtype": layer.q_weight.dtype,
        "params": parameter_count(layer),
        "positions": layer.positions,
        "causal": layer.causal,
        "scale": layer.effective_scale if layer.heads_known else layer.scale,
        "notes": list(layer.notes),
    }


def inventory_json(inventory: Inventory, store: TensorStore) -> dict[str, Any]:
    layers = [layer_summary(layer, i) for i, layer in enumerate(inventory.layers)]
    return {
        "source": store.source,
        "format": store.format,
        # the keys leading to a pickle's nested state dict ({"model": sd, "epoch": 7}); [] bare
        "entry": list(getattr(store, "entry", ())),
        "layers": layers,
        "unclassified": inventory.unclassified,
        "unresolved": [{"name": item.name, "family": item.family, "keys": list(item.keys),
                        "reason": item.reason, "fix": item.fix} for item in inventory.unresolved],
        "skipped": skipped_tensors(store),
        "summary": summary(inventory, store),
    }


def skipped_tensors(store: TensorStore) -> list[dict[str, str]]:
    """Tensors of a dtype attnviz computes nothing with (C64, F8_E8M0, F4, …), by name: the
    file's other tensors are read as usual, and a command refuses only one it needs."""
    from attnviz.load.store import skipped_dtype

    found = []
    for key in store.keys():
        dtype = store.info(key).dtype
        if skipped_dtype(dtype):
            found.append({"name": key, "dtype": dtype})
    return found


def summary(inventory: Inventory, store: TensorStore) -> dict[str, Any]:
    layers = inventory.layers
    families = sorted({layer.family for layer in layers})
    return {
        "attention_layers": len(layers),
        "families": families,
        "heads_known": all(layer.heads_known for layer in layers),
        "attention_params": sum(parameter_count(layer) for layer in layers),
        "tensors": len(store.keys()),
        "unclassified": len(inventory.unclassified),
        "unresolved": len(inventory.unresolved),
        "skipped": len(skipped_tensors(store)),
    }


def layer_detail(layer: AttentionLayer, store: TensorStore) -> LayerDetail:
    """Per-head slices and their norms, streaming one head's slice at a time."""
    H, H_kv = layer.num_heads, layer.num_kv_heads
    assert H is not None and H_kv is not None
    non_finite: dict[str, int] = {}
    norms: dict[str, list[float]] = {}
    for name, r in weight_refs(layer).items():
        if name == "q":
            spans = [layer.q_rows(h) for h in range(H)]
        elif name == "o":
            spans = [layer.o_cols(h) for h in range(H)]
        else:
            spans = [layer.kv_rows(g) for g in range(H_kv)]
        norms[name], non_finite[r.describe()] = slice_norms(store, r, spans, name == "o")
    for r in bias_refs(layer).values():
        non_finite[r.describe()] = slice_norms(store, r, [(0, r.shape[0])], False)[1]
    heads = [HeadRow(h, layer.q_rows(h), layer.o_cols(h), layer.kv_head_of(h),
                     layer.kv_rows(layer.kv_head_of(h)), norms["q"][h],
                     norms["k"][layer.kv_head_of(h)], norms["v"][layer.kv_head_of(h)],
                     norms["o"][h]) for h in range(H)]
    return LayerDetail(layer, heads, non_finite)


CHUNK_ELEMENTS = 1 << 22  # values read (and widened to float64) at a time: 32 MB


def slice_norms(store: TensorStore, ref: TensorRef, spans: list[tuple[int, int]],
                by_columns: bool) -> tuple[list[float], int]:
    """Frobenius norms (of the finite values) of row or column spans that together cover
    `ref`, and its NaN/Inf count.

    Safetensors data is read through a numpy memory map in blocks of stored rows (no torch
    import, no whole-tensor copy); each block is reduced to per-row or per-column sums of
    squares, and each span's norm is a difference of their prefix sums, so the cost is one pass
    over the tensor plus O(1) per head: tens of thousands of heads cost no more than a few.
    Other formats go through torch.
    """
    view: NDArray[np.generic] | None = store.numpy_view(ref.key)  # a memmap, then reshaped
    if view is None:
        return _torch_norms(store, ref, spans, by_columns)
    import numpy as np

    if ref.flatten or view.ndim == 1:
        view, keep_rows = view.reshape(-1, 1), True  # one value per canonical row
    else:  # canonical rows are stored rows, or stored columns when the tensor is transposed
        keep_rows = ref.transposed == by_columns
    squares, bad = _line_sums(view, keep_rows, ref.dtype)
    sq_prefix = np.concatenate([[0.0], np.cumsum(squares)])
    bad_prefix = np.concatenate([[0], np.cumsum(bad)])
    norms, non_finite = [], 0
    for start, stop in spans:
        ranges = ((start, stop),) if by_columns else (
            ref.take(((start, stop),)).row_ranges or ((start, stop),))
        norms.append(max(0.0, float(sum(sq_prefix[b] - sq_prefix[a] for a, b in ranges))) ** 0.5)
        non_finite += int(sum(bad_prefix[b] - bad_prefix[a] for a, b in ranges))
    return norms, non_finite  # the spans cover the whole reference, so this counts all of it


def _line_sums(view: NDArray[np.generic], keep_rows: bool,
               dtype: str) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    """Per stored row (keep_rows) or per stored column: the sum of squares of the finite values
    and the count of NaN/Inf, reading blocks of stored rows of at most CHUNK_ELEMENTS."""
    import numpy as np

    from attnviz.load.safetensors_file import as_float32

    rows, cols = view.shape
    size = rows if keep_rows else cols
    squares, bad = np.zeros(size), np.zeros(size, dtype=np.int64)
    step = max(1, CHUNK_ELEMENTS // max(cols, 1))
    for start in range(0, rows, step):
        values = as_float32(view[start : start + step], dtype).astype(np.float64)
        finite = np.isfinite(values)
        values[~finite] = 0.0
        axis = 1 if keep_rows else 0  # reduce across the other axis
        part_sq, part_bad = np.square(values).sum(axis), (~finite).sum(axis)
        if keep_rows:
            squares[start : start + step], bad[start : start + step] = part_sq, part_bad
        else:
            squares += part_sq
            bad += part_bad
    return squares, bad


def _torch_norms(store: TensorStore, ref: TensorRef, spans: list[tuple[int, int]],
                 by_columns: bool) -> tuple[list[float], int]:
    import torch

    from attnviz.compute.forward_pass.forward import read_ref

    tensor = read_ref(store, ref).double()
    bad = int((~torch.isfinite(tensor)).sum().item())
    if tensor.ndim == 1:
        tensor = tensor[:, None]
    if by_columns:
        tensor = tensor.T
    clean = torch.nan_to_num(tensor, nan=0.0, posinf=0.0, neginf=0.0)
    prefix = torch.cat([torch.zeros(1, dtype=torch.float64), clean.square().sum(1).cumsum(0)])
    return [max(0.0, (prefix[b] - prefix[a]).item()) ** 0.5 for a, b in spans], bad


def scan_non_finite(inventory: Inventory, store: TensorStore) -> dict[str, int]:
    """NaN/Inf counts of every attention tensor, one tensor in memory at a time."""
    import torch

    counts: dict[str, int] = {}
    keys = [key for layer in inventory.layers for key in sorted(
        {r.key for r in (*weight_refs(layer).values(), *bias_refs(layer).values())})]
    keys += [key for item in inventory.unresolved for key in item.keys]  # known, just not split
    for key in keys:
        if key not in counts:
            counts[key] = int((~torch.isfinite(store.read(key).float())).sum().item())
    return counts


@dataclass(frozen=True)
class InspectRequest:
    path: Path
    layer: str | None = None  # one layer's per-head slices and norms (reads its tensors)
    hints: HeadHints = HeadHints()
    scan: bool = False  # read every attention tensor and count NaN/Inf


@dataclass
class InspectResult:
    doc: dict[str, Any]  # the JSON document `--json` prints
    detail: LayerDetail | None = None
    non_finite: dict[str, int] | None = None


def inspect_checkpoint(request: InspectRequest) -> InspectResult:
    """Every attention layer of a checkpoint, from headers alone unless a layer or scan asks."""
    from attnviz.core.request import SourceSpec
    from attnviz.recognize import select_layer
    from attnviz.sources.registry import open_source

    opened = open_source(SourceSpec(weights=request.path, hints=request.hints))
    inventory, store = opened.inventory, opened.store
    unusable = inventory.unresolved
    if not inventory.layers and unusable and all(item.data for item in unusable):
        # every attention layer has a tensor attnviz cannot compute with: nothing to show
        raise CheckpointError(unusable[0].what, fix=unusable[0].fix, where=store.source)
    doc = inventory_json(inventory, store)
    detail = None
    if request.layer is not None:
        chosen = select_layer(inventory, request.layer, store.source)
        if not chosen.heads_known:
            raise UsageError(f"the number of heads of layer {chosen.name!r} is unknown",
                             fix=f"pass {option('num_heads')} (and {option('num_kv_heads')} for "
                                 "grouped-query layers)",
                             option="layer")
        detail = layer_detail(chosen, store)
        doc["layer_detail"] = {"name": chosen.name, **detail.to_json()}
    non_finite = scan_non_finite(inventory, store) if request.scan else None
    if non_finite is not None:
        doc["non_finite"] = non_finite
    return InspectResult(doc, detail, non_finite)
