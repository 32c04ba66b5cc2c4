"""A recognized layer's W_q, W_k, W_v and biases as references: separate tensors taken whole,
fused ones split by their packing (`attnviz.recognize.packing`), with the row's own fix added to
any layout error."""

from __future__ import annotations

from dataclasses import dataclass

import attnviz.recognize.model_type_table as model_type_table
from attnviz.core.request import HeadHints
from attnviz.core.tensor_ref import TensorRef
from attnviz.errors import HeadCountError, LayoutError, option, printable
from attnviz.load.store import TensorStore
from attnviz.recognize.base import optional_ref
from attnviz.recognize.conventions import Convention
from attnviz.recognize.packing import PackedLayout, split_packed


@dataclass(frozen=True)
class Splitter:
    """What splitting a fused tensor (or bias) into its q/k/v parts needs."""

    packing: model_type_table.Packing | None
    shape_heads: tuple[int, int, int] | None
    storage: str
    row: Convention
    source: str

    def __call__(self, whole: TensorRef, held: str, square: int | None) -> dict[str, TensorRef]:
        layout = PackedLayout(self.packing or model_type_table.THIRDS, self.shape_heads, square)
        try:
            return split_packed(whole, held, layout, self.storage, self.source)
        except LayoutError as error:
            if self.row.fix and not error.fix:
                error.fix = self.row.fix
            raise


def weight_parts(weights: dict[str, TensorRef], row: Convention,
                  split: Splitter) -> dict[str, TensorRef]:
    """W_q, W_k, W_v by part name, fused tensors split by their packing."""
    parts: dict[str, TensorRef] = {}
    for key, held in row.weights:
        whole = weights[key]
        square = whole.shape[1] if row.square else None
        if len(held) == 1:
            _check_square(whole, square, split.storage, row, split.source)
            parts[held] = whole
        else:
            assert split.packing is not None
            parts.update(split(whole, held, square))
    return parts


def bias_parts(store: TensorStore, row: Convention, prefix: str,
                split: Splitter) -> dict[str, TensorRef]:
    """b_q, b_k, b_v where present, by part name; a fused bias split like its weight (stacked
    thirds where the weight has no packing)."""
    biases: dict[str, TensorRef] = {}
    for key, held in row.bias_parts():
        bias = optional_ref(store, prefix + key)
        if bias is None or any(part in biases for part in held):
            continue
        if len(held) == 1:
            biases[held] = bias
        else:
            biases.update(split(bias, held, None))
    return biases


def packed_heads(heads: HeadHints, hints: HeadHints, packing: model_type_table.Packing,
                  o_weight: TensorRef, source: str) -> tuple[int, int, int]:
    """(H, H_kv, d) for a head-dependent packing. H_kv: the command line, else the packing's
    rule (all heads, one, or config.json's count); d: given, else W_o's H·d columns / H."""
    H = heads.num_heads
    assert H is not None
    kv = hints.num_kv_heads or {"all": H, "one": 1}.get(packing.kv) or heads.num_kv_heads or H
    d = heads.head_dim
    if d is None:
        columns = o_weight.shape[1]  # W_o is (E, H·d)
        if columns % H:
            raise HeadCountError(f"{printable(o_weight.describe())} has {columns} columns (H·d), "
                              f"not divisible by {H} heads",
                              fix="check the number of heads in config.json or "
                                  f"{option('num_heads')}",
                              where=source)
        d = columns // H
    return H, kv, d


def _check_square(whole: TensorRef, square: int | None, storage: str, row: Convention,
                  source: str) -> None:
    if square is not None and whole.shape[0] != square:
        raise LayoutError(f"{printable(whole.key)} has shape {whole.stored_shape}, but {storage} "
                          f"needs {square} rows", fix=row.fix, where=source)
