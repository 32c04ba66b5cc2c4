"""The vocabulary of a capture: how maps were obtained, what kind of layer made them, what
one call of the attention interface looked like."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from attnviz.core.choices import LayerKind

NAME = "attnviz"  # must not contain "sdpa", "flash", "flex" or "/": transformers treats those apart
# on_block(layer index, first query row, weights (B, H, rows, S)); called once per block.
OnBlock = Callable[[int, int, torch.Tensor], None]
# kwargs sdpa cannot honour: it refuses softcap and silently ignores sinks.
SDPA_UNSUPPORTED = ("softcap", "s_aux", "sinks")
# kwargs of the attention call that change its scores; kept with the query and key (keep_qk).
SCORE_KWARGS = ("scaling", "softcap", "position_bias", "s_aux", "sinks")
# Module-name parts of cross-attention (BART family, T5, BERT as a decoder, ...).
CROSS_PARTS = {"encoder_attn", "EncDecAttention", "crossattention", "cross_attn",
                "cross_attention"}


class CapturePath(str, Enum):
    """How the maps were obtained."""

    INTERFACE = "attention interface"  # attnviz's function, the module's own eager per block
    OUTPUT_ATTENTIONS = "output_attentions (eager)"  # the model's own returned maps


@dataclass
class CapturedLayer:
    """One attention call of the forward pass."""

    index: int  # call order: the index `shown_layers` and `on_block` use
    name: str  # the module's name in model.named_modules(), e.g. "encoder.layer.3.attention.self"
    kind: LayerKind
    shown: bool  # its maps went to on_block
    computed_with: str  # "eager" (the module's own), "sdpa", or "output_attentions"
    num_heads: int | None = None  # query heads H
    num_kv_heads: int | None = None  # key/value heads H_kv (< H with grouped-query attention)
    query_length: int | None = None  # L (T for cross-attention)
    key_length: int | None = None  # S
    query: torch.Tensor | None = None  # (B, H, L, d) after rotary, when keep_qk (interface only)
    key: torch.Tensor | None = None  # (B, H_kv, S, d) before repeat_kv, when keep_qk
    value: torch.Tensor | None = None  # (B, H_kv, S, d) before repeat_kv, when keep_qk
    # With keep_qk also what else enters the scores: the additive mask (B|1, 1|H, L, S) eager
    # received, and the call's scaling, softcap, position_bias and sinks kwargs, where given.
    mask: torch.Tensor | None = None
    score_kwargs: dict[str, Any] = field(default_factory=dict)
    # The dtype q/k/v arrived in when the eager blocks ran on float32 copies (half precision on
    # a CPU, whose matmuls in bfloat16/float16 run ~10x slower than in float32); else None.
    upcast_from: str | None = None


@dataclass
class CaptureResult:
    path: CapturePath
    layers: list[CapturedLayer]  # every attention call, in order
    outputs: Any  # the model's own output object (last_hidden_state, ...)

    @property
    def shown(self) -> list[CapturedLayer]:
        return [layer for layer in self.layers if layer.shown]


@dataclass
class MapCollector:
    """An `on_block` that keeps every block and joins them: for small inputs and for tests."""

    blocks: dict[int, list[tuple[int, torch.Tensor]]] = field(
        default_factory=lambda: defaultdict(list))

    def __call__(self, layer: int, row_start: int, weights: torch.Tensor) -> None:
        self.blocks[layer].append((row_start, weights))

    def maps(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s full maps (B, H, L, S), rows in order."""
        return torch.cat([w for _, w in sorted(self.blocks[layer], key=lambda b: b[0])], dim=2)

