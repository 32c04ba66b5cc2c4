"""The attention layers the Hugging Face commands (attribute, lens, patch, ablate, --weighting
norm) read W_O from: the same inventory `attnviz inspect` lists, i.e. the naming table and, for
what no row names, discovery (the model built from config.json on the meta device,
`attnviz.sources.discover`). Reading the table alone refused CTRL, whose attention
(`multi_head_attention` with Wq, Wk, Wv, dense) only discovery finds."""

from __future__ import annotations

from attnviz.core.layer import AttentionLayer
from attnviz.load.store import TensorStore


def attention_layers(store: TensorStore) -> list[AttentionLayer]:
    """Every attention layer of the checkpoint, as inspect lists it (no head-count hints: the
    model's own config says them)."""
    from attnviz.recognize import find_layers
    from attnviz.sources.discover import discover_modules

    return find_layers(store, discover=discover_modules).layers
