"""GPT-2's Conv1D attention (GPT-2, DistilGPT-2, ImageGPT, …), self- and cross-attention.

Conv1D stores its weight as (in, out) and computes x · W + b. Self-attention: `attn.c_attn.weight`
(E, 3E) whose output columns are [q | k | v] (`split(E, dim=2)`), then each viewed as (B, L, H, d);
`attn.c_proj.weight` (H·d, E). Cross-attention: `crossattention.q_attn` (E, E) for q and
`crossattention.c_attn` (E, 2E) with columns [k | v]. The buffers `attn.bias` (a causal mask) and
`attn.masked_bias` are not parameters and are never read as biases.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from attnviz.core.layer import AttentionLayer, TensorRef
from attnviz.errors import LayoutError, printable
from attnviz.load import config as hfconfig
from attnviz.load.checkpoint import TensorStore
from attnviz.recognize.base import (
    HeadHints,
    finish,
    head_counts,
    layer_index,
    optional_ref,
    prefixes_with,
    ref,
    split_rows,
)

FAMILY = "gpt2"
LINEAR_C_ATTN = ("gpt_bigcode",)  # same key names, but c_attn is an nn.Linear: see gpt_bigcode.py


def find(store: TensorStore, hints: HeadHints) -> list[AttentionLayer]:
    config = store.config
    if hfconfig.model_type(config) in LINEAR_C_ATTN:
        return []
    heads = head_counts(store, hints, config, heads_keys=("n_head", "num_attention_heads"),
                        kv_keys=(), dim_keys=())
    layers = []
    for prefix in prefixes_with(store.keys(), "c_attn.weight"):
        if prefix + "c_proj.weight" not in store:
            continue
        layer = finish(_layer(store, prefix, config), heads, store.source)
        layers.append(_scaled(layer, prefix, config))
    return layers


def _layer(store: TensorStore, prefix: str, config: dict[str, Any]) -> AttentionLayer:
    cross = prefix + "q_attn.weight" in store
    c_attn = _conv1d(store, prefix + "c_attn.weight", 2 if cross else 3)
    c_bias = optional_ref(store, prefix + "c_attn.bias")
    embed_dim = c_attn.shape[1]
    if cross:
        q_weight = _conv1d(store, prefix + "q_attn.weight", 1)
        q_bias = optional_ref(store, prefix + "q_attn.bias")
        k_weight, v_weight = split_rows(c_attn, [embed_dim] * 2)
        k_bias, v_bias = split_rows(c_bias, [embed_dim] * 2) if c_bias else (None, None)
        storage = "Conv1D q_attn (E, E) + c_attn (in, out) = (E, 2E), [k | v] columns"
    else:
        q_weight, k_weight, v_weight = split_rows(c_attn, [embed_dim] * 3)
        q_bias, k_bias, v_bias = split_rows(c_bias, [embed_dim] * 3) if c_bias else (None,) * 3
        storage = "Conv1D c_attn (in, out) = (E, 3E), [q | k | v] columns"
    return AttentionLayer(
        name=prefix.rstrip("."),
        family=FAMILY,
        embed_dim=embed_dim,
        kdim=k_weight.shape[1],
        vdim=v_weight.shape[1],
        num_heads=None,
        num_kv_heads=None,
        head_dim=None,
        q_weight=q_weight,
        k_weight=k_weight,
        v_weight=v_weight,
        o_weight=ref(store, prefix + "c_proj.weight", transposed=True),
        q_bias=q_bias,
        k_bias=k_bias,
        v_bias=v_bias,
        o_bias=optional_ref(store, prefix + "c_proj.bias"),
        causal=not cross,
        positions="learned",
        storage=storage,
        notes=("cross-attention: keys and values come from the encoder",) if cross else (),
    )


def _conv1d(store: TensorStore, key: str, parts: int) -> TensorRef:
    """A Conv1D weight, checked to be (in, out) = (E, parts·E) before it is read transposed."""
    stored = store.info(key).shape
    expected = f"(E, {parts}·E)" if parts > 1 else "(E, E)"
    if len(stored) != 2 or stored[1] != parts * stored[0]:
        raise LayoutError(f"{printable(key)} has shape {tuple(stored)}, but GPT-2's Conv1D stores "
                          f"(in, out) = {expected}",
                          fix="if c_attn is an nn.Linear (GPTBigCode/StarCoder), open the model "
                          "folder with its config.json (model_type gpt_bigcode)",
                          where=store.source)
    return ref(store, key, transposed=True)


def _scaled(layer: AttentionLayer, prefix: str, config: dict[str, Any]) -> AttentionLayer:
    """GPT2Attention's optional scalings: none at all, or an extra 1/(layer_idx + 1)."""
    if not hfconfig.flag(config, "scale_attn_weights", True):
        return replace(layer, scale=1.0, notes=(*layer.notes, "scale_attn_weights is false: "
                                                "q·kᵀ is not divided by √d"))
    index = layer_index(prefix)
    if hfconfig.flag(config, "scale_attn_by_inverse_layer_idx", False) and index is not None:
        if layer.head_dim is None:
            return replace(layer, notes=(*layer.notes, f"scores are also divided by layer_idx + "
                                         f"1 = {index + 1}"))
        return replace(layer, scale=1.0 / (math.sqrt(layer.head_dim) * (index + 1)))
    return layer
