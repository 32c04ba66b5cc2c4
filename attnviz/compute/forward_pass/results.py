"""What a run produces: per-layer captured attention and the run around it.

Results hold per-head maps (B, H, L, S) with padding still in place; `Batch.lengths` says which
rows and columns are real. Renderers slice; they never recompute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attnviz.compute.display.views import MapView
from attnviz.compute.forward_pass.inputs import Batch
from attnviz.core.choices import LayerKind
from attnviz.core.layer import AttentionLayer
from attnviz.load.store import TensorStore

if TYPE_CHECKING:
    from pathlib import Path

    from attnviz.compute.measures.stats import HeadStats

SDPA_TOLERANCE = 1e-4  # explicit per-head output vs F.scaled_dot_product_attention, relative


@dataclass(frozen=True)
class CapturedScores:
    """What a model's own attention call received for one layer (attnviz.sources.hf.capture with
    keep_qk), in the padded batch's coordinates: enough to recompute its scores head by head
    with no knowledge of the family's positions (q and k are taken after rotary)."""

    query: torch.Tensor  # (B, H, L, d) per query head, after rotary
    key: torch.Tensor  # (B, H_kv, S, d) per key/value head, before repeat_kv
    scaling: float  # multiplies q·kᵀ
    mask: torch.Tensor | None  # additive (B|1, 1|H, L, S), or boolean (True = attend)
    position_bias: torch.Tensor | None = None  # additive (B|1, H, L, S): T5's relative bias
    softcap: float | None = None  # tanh(s / c) · c before bias and mask (Gemma 2)
    sinks: torch.Tensor | None = None  # (H,) one extra logit per head, dropped after softmax
    query_offsets: tuple[int, ...] = ()  # per sentence: padded index of its real token 0
    key_offsets: tuple[int, ...] = ()


@dataclass(frozen=True)
class StreamedMaps:
    """What a streamed layer keeps instead of its full maps
    (attnviz.compute.forward_pass.streaming): display
    views, summable statistics and, for --query, that query's row of every head."""

    views: list[MapView]
    stats: list[HeadStats]
    query_row: tuple[int, int] | None = None  # (sentence, query) of query_weights
    query_weights: torch.Tensor | None = None  # (H, S) the query's row of every head


@dataclass(frozen=True)
class ModelCall:
    """What a layer captured from a model's forward pass (attnviz.sources.hf) has besides its
    maps: the query's and key's tokens where they are not the batch's (decoder rows are target
    tokens), and for --query what its attention call received."""

    query_tokens: list[list[str]] | None = None
    key_tokens: list[list[str]] | None = None
    scores: CapturedScores | None = None


@dataclass(frozen=True)
class ValueWeighting:
    """--weighting norm (attnviz.compute.measures.value_norms): per key ‖W_O^h v_j‖, and the
    attention
    maps themselves once `LayerAttention.weights` holds the normalized value-weighted maps."""

    value_norms: torch.Tensor  # (B, H, S)
    attention_weights: torch.Tensor | None = None  # (B, H, L, S); None: not yet weighted


@dataclass(frozen=True)
class LayerAttention:
    """One shown layer's attention. Every layer has the fields up to `causal`, and its maps as
    exactly one of two kinds: full maps (`weights`) or, when streamed, what `streamed` keeps.
    A layer captured from a model has `call`; --weighting norm adds `weighting`.
    Frozen: a changed layer is a new one (`dataclasses.replace`)."""

    index: int  # position of the layer in the model (0 for a standalone layer)
    name: str  # the module's name (a standalone layer: its checkpoint prefix)
    label: str  # how the layer is shown: "3", "enc 0", "cross 1"
    heads: int  # query heads (0: not known, a streamed layer whose count nobody reported)
    kind: LayerKind
    method: str  # which computation produced the weights
    causal: bool  # no query attends to a later key (a model layer: observed on its maps)
    weights: torch.Tensor | None  # (B, H, L, S) float32 on the CPU; None exactly when streamed
    streamed: StreamedMaps | None = None
    layer: AttentionLayer | None = None  # attnviz's description; None for a model's layer
    # (B, L, E) the vectors entering the layer; None for a streamed model layer before the last
    inputs: torch.Tensor | None = None
    key_inputs: torch.Tensor | None = None  # (B, S, kdim) when kdim ≠ E, else None (= inputs)
    value_inputs: torch.Tensor | None = None
    call: ModelCall | None = None
    weighting: ValueWeighting | None = None

    def __post_init__(self) -> None:
        if (self.weights is None) == (self.streamed is None):
            raise ValueError(f"layer {self.label} needs exactly one of full maps and streamed "
                             "maps")

    def stack_label(self) -> str | None:
        """The label when the layer is not labelled by its number ("enc 0", "cross 1"), else
        None: statistics and --query carry only those."""
        return None if self.label == str(self.index) else self.label

    def rows_of(self, batch: Batch) -> list[list[str]]:
        """Each sentence's query tokens (the map's rows)."""
        tokens = None if self.call is None else self.call.query_tokens
        return tokens if tokens is not None else batch.tokens

    def columns_of(self, batch: Batch) -> list[list[str]]:
        """Each sentence's key tokens (the map's columns)."""
        tokens = None if self.call is None else self.call.key_tokens
        return tokens if tokens is not None else batch.tokens


def heads_seen(reported: int | None, weights: torch.Tensor | None) -> int:
    """Query heads: as described or reported, else the maps', else 0 (streamed, not known)."""
    if reported is not None:
        return reported
    return 0 if weights is None else int(weights.shape[1])


def standalone_layer(index: int, layer: AttentionLayer, maps: torch.Tensor | StreamedMaps,
                     inputs: torch.Tensor | None, method: str, causal: bool) -> LayerAttention:
    """A layer attnviz computed from its own description: named by its checkpoint prefix,
    labelled by its index, self-attention; `maps`: full (B, H, L, S) or streamed."""
    weights = maps if isinstance(maps, torch.Tensor) else None
    streamed = maps if isinstance(maps, StreamedMaps) else None
    return LayerAttention(index, layer.name, str(index), heads_seen(layer.num_heads, weights),
                          LayerKind.SELF, method, causal, weights, streamed, layer, inputs)


@dataclass(frozen=True)
class AttentionRun:
    """A run's shown layers and what they were computed from. Frozen: a changed run is a new
    one (`dataclasses.replace`)."""

    batch: Batch
    layers: tuple[LayerAttention, ...]
    source: str
    inputs_described: str
    device: str
    causal: bool
    store: TensorStore | None  # where the layers' weights are read from (None: a model run)
    notes: tuple[str, ...] = ()
    # how closely a float32 recomputation from the slices must match these maps (looser for a
    # model run in half precision)
    tolerance: float = SDPA_TOLERANCE
    exported: Path | None = None  # the --export path a streamed run already wrote, block by block
    target: Batch | None = None  # an encoder-decoder run's decoder inputs, per sentence
    path: str | None = None  # a model run: how the maps were obtained (capture path)
    weighting: str = "attention"  # what the maps show: "attention", or "norm" (value-weighted)

    def layer(self, index: int) -> LayerAttention:
        return next(layer for layer in self.layers if layer.index == index)
