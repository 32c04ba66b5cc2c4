"""The one piece of code behind every fused q/k/v layout: rows in groups, parts in order.

A `Packing` (see `model_types`) says how many groups the rows form and in which order each group
holds its parts; this module turns that into row ranges of the fused tensor, one `TensorRef` per
part, in head order. Stacked [q; k; v] is one group; GPT-NeoX, BLOOM and GPTBigCode (MHA) are
one group per head; Falcon's new architecture one per kv group; CodeGen four, ordered q, v, k.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnviz.core.tensor_ref import TensorRef
from attnviz.errors import LayoutError, printable
from attnviz.recognize.model_type_table import Packing

SIZES = {"q": "H·d", "k": "H_kv·d", "v": "H_kv·d"}


def split_groups(whole: TensorRef, order: str, groups: int, sizes: dict[str, int],
                 what: str, source: str) -> dict[str, TensorRef]:
    """References to each part of `whole`, whose rows are `groups` blocks of the parts in
    `order`, part p taking sizes[p] rows of each block."""
    per_group = sum(sizes[part] for part in order)
    if groups <= 0 or any(sizes[part] <= 0 for part in order) \
            or groups * per_group != whole.shape[0]:
        raise LayoutError(f"{what} needs {max(groups, 0) * per_group} rows", where=source)
    ranges: dict[str, list[tuple[int, int]]] = {part: [] for part in order}
    start = 0
    for _ in range(groups):
        for part in order:
            ranges[part].append((start, start + sizes[part]))
            start += sizes[part]
    return {part: whole.take(tuple(spans)) for part, spans in ranges.items()}


@dataclass(frozen=True)
class PackedLayout:
    """How a fused tensor's rows hold its parts."""

    packing: Packing
    heads: tuple[int, int, int] | None = None  # (H, H_kv, d): when `packing.needs_heads`
    square: int | None = None  # the input width, when each part must be exactly that tall
    #                            (nn.MHA, GPT-2's Conv1D)


def split_packed(whole: TensorRef, parts: str, layout: PackedLayout, storage: str,
                 source: str) -> dict[str, TensorRef]:
    """Each of `parts` (e.g. "qkv", "kv") of a fused tensor laid out as `layout` says."""
    packing, heads, square = layout.packing, layout.heads, layout.square
    order = "".join(part for part in packing.order if part in parts)
    rows = whole.shape[0]
    shape = _fmt(whole.stored_shape) + (" stored (in, out)" if whole.transposed else "")
    if not packing.needs_heads:  # equal parts: the row count alone locates them
        groups = packing.group_count(1, 1)
        if rows % (groups * len(order)) or (square is not None and rows != len(order) * square):
            wanted = f"{len(order)}·{square} = {len(order) * square}" if square is not None \
                else f"a multiple of {groups * len(order)}"
            raise LayoutError(f"{printable(whole.key)} has shape {shape}, but {storage} needs "
                              f"{wanted} rows", where=source)
        size = rows // (groups * len(order))
        return split_groups(whole, order, groups, dict.fromkeys(order, size), storage, source)
    assert heads is not None, "a head-dependent packing needs the head counts"
    H, H_kv, d = heads
    groups = packing.group_count(H, H_kv)
    need = sum((H if part == "q" else H_kv) * d for part in order)
    if groups <= 0 or H % groups or H_kv % groups or H_kv <= 0 or H % H_kv or rows != need:
        raise LayoutError(f"{printable(whole.key)} has shape {shape}, but {storage} with H={H}, "
                          f"H_kv={H_kv}, d={d} needs {need} rows",
                          fix="check the head counts in config.json or on the command line",
                          where=source)
    sizes = {"q": H // groups * d, "k": H_kv // groups * d, "v": H_kv // groups * d}
    return split_groups(whole, order, groups, sizes, storage, source)


def grouped(fused: TensorRef, num_heads: int, num_kv: int, head_dim: int, storage: str,
            source: str) -> tuple[TensorRef, TensorRef, TensorRef]:
    """q, k, v references into rows laid out as (H_kv, H/H_kv + 2, d), in head order."""
    from attnviz.recognize.model_type_table import PER_GROUP

    parts = split_packed(fused, "qkv", PackedLayout(PER_GROUP, (num_heads, num_kv, head_dim)),
                         storage, source)
    return parts["q"], parts["k"], parts["v"]


def _fmt(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"
