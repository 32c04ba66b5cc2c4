"""BERT-style attention (BERT, RoBERTa, ELECTRA, MiniLM, …) and Hugging Face ViT/DeiT/DINOv2.

BERT: `<block>.self.{query,key,value}` + `<block>.output.dense`, each an nn.Linear (out, in);
HF ViT: `<block>.attention.{query,key,value}` + `<block>.output.dense`. `<block>` is the attention
module (e.g. `encoder.layer.0.attention`, or `crossattention` in decoders). Heads come from
config.json's num_attention_heads; d = E / H. Both reshape q as (B, L, H, d): head h = rows h·d….
"""

from __future__ import annotations

import re
from typing import Any

from attnviz.core.layer import AttentionLayer
from attnviz.load import config as hfconfig
from attnviz.load.checkpoint import TensorStore
from attnviz.recognize.base import HeadHints, finish, head_counts, optional_ref, prefixes_with, ref

FAMILY = "bert"
INNER = {"self.": "bert", "attention.": "vit"}  # name of the q/k/v module → family shown
RELATIVE = ("relative_key", "relative_key_query")


def find(store: TensorStore, hints: HeadHints) -> list[AttentionLayer]:
    config = store.config
    heads = head_counts(store, hints, config, heads_keys=("num_attention_heads",), kv_keys=(),
                        dim_keys=())
    layers = []
    for inner in prefixes_with(store.keys(), "query.weight"):
        block, module = _block(inner)
        if block is None or not all(k in store for k in (inner + "key.weight",
                                                           inner + "value.weight",
                                                           block + "output.dense.weight")):
            continue
        layer_heads = heads if heads.num_heads else _stage_heads(config, block, heads)
        layers.append(finish(_layer(store, inner, block, module, config), layer_heads,
                             store.source))
    return layers


def _stage_heads(config: dict[str, Any], block: str, heads: HeadHints) -> HeadHints:
    """Swin-style configs give one head count per stage (`num_heads: [3, 6, 12, 24]`); a layer
    under `layers.{stage}.` takes its stage's. Anything else leaves the count unknown."""
    per_stage = config.get("num_heads")
    match = re.search(r"(?:^|\.)layers\.(\d+)\.", block)
    if not (isinstance(per_stage, list) and match and "swin" in str(config.get("model_type"))):
        return heads
    stage = int(match.group(1))
    value = per_stage[stage] if stage < len(per_stage) else None
    if type(value) is not int or value <= 0:
        return heads
    return HeadHints(value, heads.num_kv_heads, heads.head_dim)


def _block(inner: str) -> tuple[str | None, str]:
    """(attention block prefix, q/k/v module name) for a q/k/v module prefix; None if not BERT's."""
    for name in INNER:
        if inner == name or inner.endswith("." + name):
            return inner[: -len(name)], name
    return None, ""


def _layer(store: TensorStore, inner: str, block: str, module: str,
           config: dict[str, Any]) -> AttentionLayer:
    q_weight = ref(store, inner + "query.weight")
    k_weight, v_weight = ref(store, inner + "key.weight"), ref(store, inner + "value.weight")
    positions, notes = _positions(store, inner, config)
    cross = block.rstrip(".").endswith("crossattention")
    # Decoders (is_decoder) mask their self-attention causally; cross-attention never is.
    causal = hfconfig.flag(config, "is_decoder", False) and not cross
    return AttentionLayer(
        name=block.rstrip("."),
        family=INNER[module],
        embed_dim=q_weight.shape[1],
        kdim=k_weight.shape[1],
        vdim=v_weight.shape[1],
        num_heads=None,
        num_kv_heads=None,
        head_dim=None,
        q_weight=q_weight,
        k_weight=k_weight,
        v_weight=v_weight,
        o_weight=ref(store, block + "output.dense.weight"),
        q_bias=optional_ref(store, inner + "query.bias"),
        k_bias=optional_ref(store, inner + "key.bias"),
        v_bias=optional_ref(store, inner + "value.bias"),
        o_bias=optional_ref(store, block + "output.dense.bias"),
        causal=causal,
        positions=positions,
        storage=f"separate {module}{{query,key,value}} + output.dense, nn.Linear (out, in)",
        notes=notes,
    )


def _positions(store: TensorStore, inner: str,
               config: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
    kind = config.get("position_embedding_type", "absolute")
    if kind in RELATIVE or inner + "distance_embedding.weight" in store:
        return "relative bias", (f"position_embedding_type {kind!r}: a learned distance "
                                 "embedding enters q·kᵀ (distance_embedding.weight)",)
    return "learned", ()
