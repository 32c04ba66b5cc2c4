"""What a run produces: per-layer captured attention and the run around it.

Results hold per-head maps (B, H, L, S) with padding still in place; `Batch.lengths` says which
rows and columns are real. Renderers slice; they never recompute.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from attnviz.compute.display.views import MapView
from attnviz.compute.forward_pass.inputs import Batch
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
    """A layer captured from a model's forward pass (attnviz.sources.hf): the module's name and
    head count as the pass reported them, what kind of attention it is (self, decoder-self,
    cross), its label ("3", "enc 0", "cross 1"), and the query's and key's tokens where they are
    not the batch's (decoder rows are target tokens)."""

    name: str
    num_heads: int | None
    kind: str = "self"
    label: str | None = None
    query_tokens: list[list[str]] | None = None
    key_tokens: list[list[str]] | None = None
    scores: CapturedScores | None = None  # for --query: what its attention received
    causal: bool | None = None  # observed on the maps (None: not known)


@dataclass(frozen=True)
class ValueWeighting:
    """--weighting norm (attnviz.compute.measures.value_norms): per key ‖W_O^h v_j‖, and the
    attention
    maps themselves once `LayerAttention.weights` holds the normalized value-weighted maps."""

    value_norms: torch.Tensor  # (B, H, S)
    attention_weights: torch.Tensor | None = None  # (B, H, L, S); None: not yet weighted


@dataclass(frozen=True)
class LayerAttention:
    """One shown layer's attention: its full maps (`weights`), or, when streamed, what
    `streamed` keeps; with `call` for a layer captured from a model and `weighting` for
    --weighting norm. Frozen: a changed layer is a new one (`dataclasses.replace`)."""

    index: int  # position of the layer in the model (0 for a standalone layer)
    layer: AttentionLayer | None  # attnviz's description; None for a layer captured from a model
    weights: torch.Tensor | None  # (B, H, L, S) float32 on the CPU; None when streamed
    # (B, L, E) the vectors entering the layer; None for a streamed model layer before the last
    inputs: torch.Tensor | None
    method: str  # which computation produced the weights
    key_inputs: torch.Tensor | None = None  # (B, S, kdim) when kdim ≠ E, else None (= inputs)
    value_inputs: torch.Tensor | None = None
    streamed: StreamedMaps | None = None
    call: ModelCall | None = None
    weighting: ValueWeighting | None = None

    @property
    def views(self) -> list[MapView] | None:
        return None if self.streamed is None else self.streamed.views

    @property
    def stats(self) -> list[HeadStats] | None:
        return None if self.streamed is None else self.streamed.stats

    @property
    def query_row(self) -> tuple[int, int] | None:
        return None if self.streamed is None else self.streamed.query_row

    @property
    def query_weights(self) -> torch.Tensor | None:
        return None if self.streamed is None else self.streamed.query_weights

    @property
    def name(self) -> str | None:
        return None if self.call is None else self.call.name

    @property
    def num_heads(self) -> int | None:
        return None if self.call is None else self.call.num_heads

    @property
    def kind(self) -> str:
        return "self" if self.call is None else self.call.kind

    @property
    def label(self) -> str | None:
        return None if self.call is None else self.call.label

    @property
    def query_tokens(self) -> list[list[str]] | None:
        return None if self.call is None else self.call.query_tokens

    @property
    def key_tokens(self) -> list[list[str]] | None:
        return None if self.call is None else self.call.key_tokens

    @property
    def scores(self) -> CapturedScores | None:
        return None if self.call is None else self.call.scores

    @property
    def causal(self) -> bool | None:
        return None if self.call is None else self.call.causal

    @property
    def value_norms(self) -> torch.Tensor | None:
        return None if self.weighting is None else self.weighting.value_norms

    @property
    def attention_weights(self) -> torch.Tensor | None:
        return None if self.weighting is None else self.weighting.attention_weights

    @property
    def heads(self) -> int:
        """Query heads: attnviz's description, else what the model reported, else the maps'."""
        if self.num_heads is not None:
            return self.num_heads
        if self.layer is not None and self.layer.num_heads is not None:
            return self.layer.num_heads
        return 0 if self.weights is None else int(self.weights.shape[1])

    @property
    def display_name(self) -> str:
        return self.name if self.name is not None else (
            self.layer.name if self.layer is not None else "")

    @property
    def display_label(self) -> str:
        return self.label if self.label is not None else str(self.index)

    def rows_of(self, batch: Batch) -> list[list[str]]:
        """Each sentence's query tokens (the map's rows)."""
        return self.query_tokens if self.query_tokens is not None else batch.tokens

    def columns_of(self, batch: Batch) -> list[list[str]]:
        """Each sentence's key tokens (the map's columns)."""
        return self.key_tokens if self.key_tokens is not None else batch.tokens


@dataclass
class AttentionRun:
    batch: Batch
    layers: list[LayerAttention]
    source: str
    inputs_described: str
    device: str
    causal: bool
    store: TensorStore | None  # where the layers' weights are read from (None: a model run)
    notes: list[str] = field(default_factory=list)
    # how closely a float32 recomputation from the slices must match these maps (looser for a
    # model run in half precision)
    tolerance: float = SDPA_TOLERANCE
    exported: Path | None = None  # the --export path a streamed run already wrote, block by block
    target: Batch | None = None  # an encoder-decoder run's decoder inputs, per sentence
    path: str | None = None  # a model run: how the maps were obtained (capture path)
    weighting: str = "attention"  # what the maps show: "attention", or "norm" (value-weighted)

    def layer(self, index: int) -> LayerAttention:
        return next(layer for layer in self.layers if layer.index == index)
