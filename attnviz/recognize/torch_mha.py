"""torch.nn.MultiheadAttention at any prefix (nn.Transformer*, torchvision ViT, OpenAI CLIP).

Packed: `in_proj_weight (3E, E)` stacks W_q, W_k, W_v by rows, `in_proj_bias (3E,)` likewise.
kdim/vdim ≠ E: separate `q_proj_weight (E, E)`, `k_proj_weight (E, kdim)`, `v_proj_weight (E, vdim)`
with one packed `in_proj_bias`. Head counts are not stored: they come from --num-heads or metadata.
"""

from __future__ import annotations

from attnviz.core.layer import AttentionLayer
from attnviz.load.checkpoint import TensorStore
from attnviz.recognize.base import (
    HeadHints,
    finish,
    head_counts,
    natural_key,
    optional_ref,
    prefixes_with,
    ref,
)
from attnviz.recognize.base import split_rows as split

FAMILY = "torch-mha"


def find(store: TensorStore, hints: HeadHints) -> list[AttentionLayer]:
    keys = store.keys()
    prefixes = set(prefixes_with(keys, "in_proj_weight"))
    prefixes |= set(prefixes_with(keys, "q_proj_weight"))
    heads = head_counts(store, hints, None)
    layers = []
    for prefix in sorted(prefixes, key=natural_key):
        if prefix + "out_proj.weight" not in store:
            continue
        layers.append(finish(_layer(store, prefix), heads, store.source))
    return layers


def _layer(store: TensorStore, prefix: str) -> AttentionLayer:
    o_weight = ref(store, prefix + "out_proj.weight")
    embed_dim = o_weight.shape[0]
    packed = prefix + "in_proj_weight" in store
    if packed:
        q_weight, k_weight, v_weight = split(ref(store, prefix + "in_proj_weight"), [embed_dim] * 3)
        storage = "packed in_proj_weight [q; k; v]"
    else:
        q_weight = ref(store, prefix + "q_proj_weight")
        k_weight = ref(store, prefix + "k_proj_weight")
        v_weight = ref(store, prefix + "v_proj_weight")
        storage = "separate q/k/v_proj_weight (kdim/vdim ≠ E)"
    in_bias = optional_ref(store, prefix + "in_proj_bias")
    q_bias = k_bias = v_bias = None
    if in_bias is not None:
        q_bias, k_bias, v_bias = split(in_bias, [embed_dim] * 3)
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
        o_weight=o_weight,
        q_bias=q_bias,
        k_bias=k_bias,
        v_bias=v_bias,
        o_bias=optional_ref(store, prefix + "out_proj.bias"),
        bias_k=optional_ref(store, prefix + "bias_k", flatten=True),
        bias_v=optional_ref(store, prefix + "bias_v", flatten=True),
        storage=storage,
    )
