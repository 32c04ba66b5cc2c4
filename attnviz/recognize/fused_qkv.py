"""timm-style fused attention (ViT, DeiT, DINOv2, BEiT, Swin, SAM, …): `attn.qkv` + `attn.proj`.

`qkv.weight` (3·H·d, E) stacks W_q, W_k, W_v by rows: timm computes
`qkv(x).reshape(B, N, 3, H, d).permute(2, 0, 3, 1, 4)`, so row s·H·d + h·d + j is part s ∈ (q, k, v)
of head h, exactly like nn.MultiheadAttention's in_proj_weight. `proj.weight` is (E, H·d).
BEiT-style models keep `q_bias` and `v_bias` instead of `qkv.bias` (k has no bias).
timm stores no head count: it comes from --num-heads or safetensors metadata (`num_heads`).
"""

from __future__ import annotations

from dataclasses import replace

from attnviz.core.layer import AttentionLayer
from attnviz.errors import LayoutError, printable
from attnviz.load.checkpoint import TensorStore
from attnviz.recognize.base import (
    HeadHints,
    finish,
    head_counts,
    optional_ref,
    prefixes_with,
    ref,
    split_rows,
)

FAMILY = "timm"
UNKNOWN_HEADS = ("timm stores no head count: pass --num-heads (e.g. 12 for vit_base), or add "
                 "num_heads to the safetensors metadata")


def find(store: TensorStore, hints: HeadHints) -> list[AttentionLayer]:
    heads = head_counts(store, hints, None)  # config.json, if any, is not timm's
    learned = any(key == "pos_embed" or key.endswith(".pos_embed") for key in store.keys())
    layers = []
    for prefix in prefixes_with(store.keys(), "qkv.weight"):
        if prefix + "proj.weight" in store:
            layer = finish(_layer(store, prefix, learned), heads, store.source)
            if not layer.heads_known:
                layer = replace(layer, notes=(*layer.notes, UNKNOWN_HEADS))
            layers.append(layer)
    return layers


def _layer(store: TensorStore, prefix: str, learned: bool) -> AttentionLayer:
    fused = ref(store, prefix + "qkv.weight")
    if fused.shape[0] % 3:
        raise LayoutError(f"{printable(fused.key)} has shape {fused.shape}: {fused.shape[0]} rows "
                          "cannot be stacked [q; k; v] thirds", where=store.source)
    third = fused.shape[0] // 3
    q_weight, k_weight, v_weight = split_rows(fused, [third] * 3)
    q_bias = k_bias = v_bias = None
    bias = optional_ref(store, prefix + "qkv.bias")
    if bias is not None:
        q_bias, k_bias, v_bias = split_rows(bias, [third] * 3)
    elif prefix + "q_bias" in store:  # BEiT / data2vec-vision: learned q and v biases, k none
        q_bias, v_bias = ref(store, prefix + "q_bias"), optional_ref(store, prefix + "v_bias")
    notes = []
    positions = "learned" if learned else "none"
    if prefix + "relative_position_bias_table" in store:
        positions = "relative bias"
    if prefix + "q_norm.weight" in store:
        notes.append("q and k are LayerNorm-ed per head (q_norm, k_norm) before the scores")
    return AttentionLayer(
        name=prefix.rstrip("."), family=FAMILY, embed_dim=fused.shape[1], kdim=fused.shape[1],
        vdim=fused.shape[1], num_heads=None, num_kv_heads=None, head_dim=None,
        q_weight=q_weight, k_weight=k_weight, v_weight=v_weight,
        o_weight=ref(store, prefix + "proj.weight"), q_bias=q_bias, k_bias=k_bias,
        v_bias=v_bias, o_bias=optional_ref(store, prefix + "proj.bias"), positions=positions,
        storage="fused qkv (3·H·d, E), stacked [q; k; v] rows, each (H, d)", notes=tuple(notes),
    )
