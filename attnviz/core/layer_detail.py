"""What `inspect --layer` found in one layer's tensors: each head's rows and columns and the norms
of its slices. Plain data, drawn by render and computed by app."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from attnviz.core.layer import AttentionLayer


@dataclass(frozen=True)
class HeadRow:
    head: int
    q_rows: tuple[int, int]
    o_cols: tuple[int, int]
    kv_head: int
    kv_rows: tuple[int, int]
    q_norm: float  # Frobenius norm of W_q[q_rows]
    k_norm: float  # of W_k[kv_rows] (shared by the kv group)
    v_norm: float
    o_norm: float  # of W_o[:, o_cols]


@dataclass(frozen=True)
class LayerDetail:
    layer: AttentionLayer
    heads: list[HeadRow]
    non_finite: dict[str, int]  # tensor description → count of NaN/Inf values

    def to_json(self) -> dict[str, Any]:
        return {
            "heads": [
                {"head": h.head, "q_rows": list(h.q_rows), "o_cols": list(h.o_cols),
                 "kv_head": h.kv_head, "kv_rows": list(h.kv_rows), "q_norm": h.q_norm,
                 "k_norm": h.k_norm, "v_norm": h.v_norm, "o_norm": h.o_norm}
                for h in self.heads
            ],
            "non_finite": self.non_finite,
        }
