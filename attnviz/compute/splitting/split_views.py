"""Display data of a layer's head split: the terminal band picture of W_q, the figure panels of
the four projections, and plain-language sentences tied to the layer's numbers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from attnviz.core.layer import AttentionLayer

if TYPE_CHECKING:
    import numpy as np
    import torch
    from numpy.typing import NDArray

    from attnviz.compute.forward_pass.forward import LayerWeights


@dataclass(frozen=True)
class BandLine:
    head: int
    rows: tuple[int, int]  # rows of W_q this line summarizes
    head_rows: tuple[int, int]  # all rows of the head
    cells: list[float]  # mean |W_q| over each column block, scaled to [0, 1]


@dataclass(frozen=True)
class BandPicture:
    """W_q downsampled for the terminal: one line per block of rows, grouped by head."""

    lines: list[BandLine]
    col_blocks: list[tuple[int, int]]  # input features each cell covers
    scale: float  # the mean |W_q| that maps to 1.0


MAX_BAND_HEADS = 32  # heads drawn in the terminal band picture (the first ones)


def band_picture(layer: AttentionLayer, W_q: torch.Tensor, max_lines: int = 16,
                 max_cols: int = 48, max_heads: int = MAX_BAND_HEADS) -> BandPicture:
    """Block means of |W_q|, never mixing two heads in one line; the first `max_heads` heads."""
    H, d = layer.num_heads, layer.head_dim
    assert H is not None and d is not None
    lines_per_head = max(1, min(d, max_lines // H))
    col_blocks = _blocks(W_q.shape[1], max_cols)
    raw: list[tuple[int, tuple[int, int], list[float]]] = []
    for h in range(min(H, max_heads)):
        for r0, r1 in _blocks(d, lines_per_head):
            rows = (h * d + r0, h * d + r1)
            block = W_q[rows[0] : rows[1]].abs()
            raw.append((h, rows, [block[:, c0:c1].mean().item() for c0, c1 in col_blocks]))
    scale = max((max(cells) for _, _, cells in raw), default=0.0) or 1.0
    lines = [BandLine(h, rows, layer.q_rows(h), [c / scale for c in cells])
             for h, rows, cells in raw]
    return BandPicture(lines, col_blocks, scale)


def _blocks(n: int, parts: int) -> list[tuple[int, int]]:
    """Split range(n) into min(n, parts) nearly equal consecutive blocks."""
    parts = max(1, min(n, parts))
    edges = [round(i * n / parts) for i in range(parts + 1)]
    return [(edges[i], edges[i + 1]) for i in range(parts)]


def explanation(layer: AttentionLayer) -> list[str]:
    """Plain-language sentences tied to this layer's numbers."""
    E, H, H_kv, d = layer.embed_dim, layer.num_heads, layer.num_kv_heads, layer.head_dim
    assert H is not None and H_kv is not None and d is not None
    h = min(3, H - 1)
    r0, r1 = layer.q_rows(h)
    lines = [
        f"Each head sees every input feature: head {h} computes q_{h} = x · W_q[{r0}:{r1}]ᵀ"
        + (f" + b_q[{r0}:{r1}]" if layer.q_bias is not None else "")
        + f", a ({d} × {E}) map of the whole {E}-feature input. The heads split the "
        "projection's output features, not the input.",
        f"torch.nn.MultiheadAttention reshapes the projected query (L, {layer.q_out}) into "
        f"({H} heads, L, {d}): head h takes features h·{d}:(h+1)·{d}, i.e. rows h·{d}:(h+1)·{d} "
        f"of W_q; W_o reads head h back through its columns h·{d}:(h+1)·{d}.",
    ]
    if layer.is_square:
        lines.append(f"W_q is square because H · d = {H} · {d} = {E} = E. That is PyTorch's "
                     f"choice (d = E / H), which is why E must be divisible by the number of "
                     f"heads; other implementations choose d freely.")
    else:
        lines.append(f"Here H · d = {H} · {d} = {layer.q_out} ≠ E = {E}, so W_q is "
                     f"{layer.q_out} × {E}, not square: this layout chooses d freely, which "
                     "torch.nn.MultiheadAttention cannot express.")
    if H_kv != H:
        lines.append(f"Grouped-query attention: W_k and W_v have only H_kv · d = {H_kv} · {d} = "
                     f"{layer.kv_out} rows; each of the {H_kv} key/value heads is shared by "
                     f"{H // H_kv} query heads (query head h uses kv head h // {H // H_kv}).")
    if layer.kdim != E or layer.vdim != E:
        lines.append(f"kdim = {layer.kdim}, vdim = {layer.vdim}: W_k is {layer.kv_out} × "
                     f"{layer.kdim} and W_v is {layer.v_weight.shape[0]} × {layer.vdim}, not "
                     "square; they map the key and value inputs into the same per-head "
                     "features as the query.")
    return lines


@dataclass(frozen=True)
class MatrixPanel:
    title: str
    values: NDArray[np.float32]  # 2-D, already downsampled for display
    shape: tuple[int, int]  # true (out, in) shape
    boundaries: list[int]  # head boundaries on the split axis, in true coordinates
    axis: str  # "rows" or "columns"
    labels: list[str]  # one per head block


def display_matrix(tensor: torch.Tensor, max_side: int = 512) -> NDArray[np.float32]:
    """A float32 numpy copy, block-averaged so neither side exceeds `max_side` pixels."""
    import torch.nn.functional as F

    rows, cols = tensor.shape
    if rows > max_side or cols > max_side:
        size = (min(rows, max_side), min(cols, max_side))
        tensor = F.adaptive_avg_pool2d(tensor[None, None].float(), size)[0, 0]
    return tensor.float().cpu().numpy()


def matrix_panels(layer: AttentionLayer, weights: LayerWeights) -> list[MatrixPanel]:
    """The four projections as figure panels, head boundaries in true coordinates."""
    H, H_kv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    assert H is not None and H_kv is not None and d is not None
    q_edges = [h * d for h in range(H + 1)]
    kv_edges = [g * d for g in range(H_kv + 1)]
    q_labels = [f"h{h}" for h in range(H)]
    kv_labels = [f"kv{g}" if H_kv != H else f"h{g}" for g in range(H_kv)]
    specs = (("W_q", weights.W_q, q_edges, "rows", q_labels),
             ("W_k", weights.W_k, kv_edges, "rows", kv_labels),
             ("W_v", weights.W_v, kv_edges, "rows", kv_labels),
             ("W_o", weights.W_o, q_edges, "columns", q_labels))
    return [MatrixPanel(title, display_matrix(t), (t.shape[0], t.shape[1]), edges, axis, labels)
            for title, t, edges, axis, labels in specs]
