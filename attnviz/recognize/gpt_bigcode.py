"""GPTBigCode / StarCoder: GPT-2's key names, but `attn.c_attn` is an nn.Linear (E + 2·kv_dim, E).

multi_query (the default): `c_attn(x).split((E, 2·d))`, then key_value.split((d, d)): rows 0:E are
the query heads, then one key head and one value head. Otherwise `view(B, L, H, 3·d)` interleaved
per head, like GPT-NeoX. Recognized only when config.json says model_type gpt_bigcode, since the
key names alone would read as GPT-2's Conv1D.
"""

from __future__ import annotations

from attnviz.core.layer import AttentionLayer
from attnviz.errors import LayoutError, printable
from attnviz.load import config as hfconfig
from attnviz.load.checkpoint import TensorStore
from attnviz.recognize.base import (
    HeadHints,
    Unresolved,
    finish,
    head_counts,
    optional_ref,
    prefixes_with,
    ref,
    unresolved,
)
from attnviz.recognize.neox import grouped

FAMILY = "gpt_bigcode"


def find(store: TensorStore, hints: HeadHints) -> list[AttentionLayer | Unresolved]:
    config = store.config
    if hfconfig.model_type(config) != FAMILY:
        return []
    heads = head_counts(store, hints, config, heads_keys=("n_head", "num_attention_heads"),
                        kv_keys=(), dim_keys=())
    multi_query = hfconfig.flag(config, "multi_query", True)  # GPTBigCodeConfig's default
    found: list[AttentionLayer | Unresolved] = []
    for prefix in prefixes_with(store.keys(), "c_attn.weight"):
        if prefix + "c_proj.weight" not in store or prefix + "q_attn.weight" in store:
            continue
        if heads.num_heads is None:
            found.append(unresolved(
                store, prefix, FAMILY, ("c_attn.weight", "c_attn.bias", "c_proj.weight",
                                        "c_proj.bias"),
                "c_attn fuses q, k and v: where W_q ends depends on the number of heads",
                "pass --num-heads, or add n_head to config.json"))
        else:
            found.append(_layer(store, prefix, heads, multi_query))
    return found


def _layer(store: TensorStore, prefix: str, heads: HeadHints, multi_query: bool) -> AttentionLayer:
    fused = ref(store, prefix + "c_attn.weight")
    o_weight = ref(store, prefix + "c_proj.weight")
    embed_dim, num_heads = fused.shape[1], heads.num_heads
    assert num_heads is not None  # find() lists layers without it as Unresolved
    if embed_dim % num_heads:
        raise LayoutError(f"{printable(fused.key)} is split by the number of heads, which "
                          f"must divide E = {embed_dim} (got {num_heads})",
                          fix="check n_head in config.json or pass --num-heads", where=store.source)
    head_dim = embed_dim // num_heads
    num_kv = 1 if multi_query else num_heads
    storage = ("multi-query c_attn (E + 2·d, E): rows 0:E the query heads, then one k, one v"
               if multi_query else "interleaved per head c_attn (H, 3·d), like GPT-NeoX")
    q, k, v = grouped(fused, num_heads, num_kv, head_dim, storage, store.source)
    bias = optional_ref(store, prefix + "c_attn.bias")
    qb, kb, vb = grouped(bias, num_heads, num_kv, head_dim, storage, store.source) if bias \
        else (None, None, None)
    layer = AttentionLayer(
        name=prefix.rstrip("."), family=FAMILY, embed_dim=embed_dim, kdim=embed_dim,
        vdim=embed_dim, num_heads=None, num_kv_heads=None, head_dim=None, q_weight=q,
        k_weight=k, v_weight=v, o_weight=o_weight, q_bias=qb, k_bias=kb, v_bias=vb,
        o_bias=optional_ref(store, prefix + "c_proj.bias"), causal=True, positions="learned",
        storage=storage,
    )
    return finish(layer, HeadHints(num_heads, num_kv, head_dim), store.source)
