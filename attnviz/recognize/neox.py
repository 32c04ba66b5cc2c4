"""Fused query_key_value layouts: GPT-NeoX/Pythia, BLOOM and Falcon's three variants.

All of them are one nn.Linear whose output rows form groups (H_kv, H/H_kv + 2, d): each group
holds its query heads, then its key head, then its value head. That single picture covers
- GPT-NeoX `attention.query_key_value`: `view(B, L, H, 3·d)`, then q, k, v = thirds (H_kv = H);
- BLOOM and old Falcon `self_attention.query_key_value`: `view(B, L, H, 3, d)` (H_kv = H);
- Falcon multi_query: `view(B, L, H + 2, d)`: all query heads, one key, one value (H_kv = 1);
- Falcon new_decoder_architecture: `view(B, L, H_kv, H/H_kv + 2, d)`.
Which one applies is read from config.json (model_type, multi_query, new_decoder_architecture,
num_kv_heads), never from shapes; BLOOM and Falcon share key names, so without config.json neither
is recognized. W_q therefore has one row range per head (or per group), not rows 0:E.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from attnviz.core.layer import AttentionLayer, TensorRef
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

FAMILY = "neox"
NEOX_TYPES = (None, "gpt_neox")  # None: no config.json; the key names are NeoX's own
FALCON_TYPES = ("falcon", "RefinedWeb", "RefinedWebModel")  # the latter two: pre-transformers code
INTERLEAVED = "interleaved per head query_key_value (H, 3, d): [q_h; k_h; v_h] for each head h"


@dataclass(frozen=True)
class Layout:
    family: str
    storage: str
    positions: str
    kv_heads: str  # "all" (H_kv = H), "one" (multi-query) or "config" (grouped)
    notes: tuple[str, ...] = ()


KEYS = ("query_key_value.weight", "query_key_value.bias", "dense.weight", "dense.bias")


def find(store: TensorStore, hints: HeadHints) -> list[AttentionLayer | Unresolved]:
    config = store.config
    heads = head_counts(store, hints, config, heads_keys=("num_attention_heads", "n_head"),
                        kv_keys=("num_kv_heads", "n_head_kv"), dim_keys=())
    found: list[AttentionLayer | Unresolved] = []
    for prefix in prefixes_with(store.keys(), "query_key_value.weight"):
        if prefix + "dense.weight" not in store:
            continue
        layout = _layout(prefix, config)
        if layout is None and _shared_by_bloom_and_falcon(prefix, config):
            found.append(unresolved(
                store, prefix, "bloom or falcon", KEYS, "BLOOM and Falcon both name a fused "
                "self_attention.query_key_value, with different row layouts",
                "open the model folder with its config.json (model_type says which)"))
        elif layout is not None and heads.num_heads is None:
            found.append(unresolved(
                store, prefix, layout.family, KEYS, "query_key_value fuses q, k and v per head: "
                "which rows are W_q depends on the number of heads",
                "pass --num-heads, or open the model folder with its config.json"))
        elif layout is not None:
            found.append(_layer(store, prefix, layout, heads, hints))
    return found


def _shared_by_bloom_and_falcon(prefix: str, config: dict[str, Any]) -> bool:
    module = prefix.rstrip(".").rsplit(".", 1)[-1]
    return module == "self_attention" and hfconfig.model_type(config) is None


def _layout(prefix: str, config: dict[str, Any]) -> Layout | None:
    """The fused layout of the module at `prefix`, as config.json declares it."""
    module, kind = prefix.rstrip(".").rsplit(".", 1)[-1], hfconfig.model_type(config)
    if module == "attention" and kind in NEOX_TYPES:
        fraction = hfconfig.rotary_fraction(config, "rotary_pct", "partial_rotary_factor",
                                            default=0.25)  # GPTNeoXConfig's default rotary_pct
        notes = ("no config.json: GPT-NeoX layout assumed from the key names, rotary_pct 0.25",
                 ) if kind is None else ()
        return Layout("gpt-neox", "interleaved per head query_key_value (H, 3·d): "
                      "[q_h | k_h | v_h] for each head h", hfconfig.rope_label(fraction), "all",
                      notes)
    if module != "self_attention":
        return None
    if kind == "bloom":
        return Layout("bloom", INTERLEAVED, "alibi", "all",
                      ("ALiBi: m_h · (key position) is added to the scaled scores",))
    if kind not in FALCON_TYPES:
        return None
    positions = "alibi" if hfconfig.flag(config, "alibi", False) else "rope"
    # The old RefinedWeb code (falcon-40b) always used the grouped layout, as the converter says.
    if hfconfig.flag(config, "new_decoder_architecture", kind == "RefinedWeb"):
        return Layout("falcon", "grouped query_key_value (H_kv, H/H_kv + 2, d): per group its "
                      "query heads, one k, one v", positions, "config")
    if hfconfig.flag(config, "multi_query", True):  # FalconConfig defaults to multi_query
        return Layout("falcon", "multi-query query_key_value (H + 2, d): all query heads, then "
                      "one k and one v", positions, "one")
    return Layout("falcon", INTERLEAVED, positions, "all")


def _layer(store: TensorStore, prefix: str, layout: Layout, heads: HeadHints,
           hints: HeadHints) -> AttentionLayer:
    fused = ref(store, prefix + "query_key_value.weight")
    o_weight = ref(store, prefix + "dense.weight")
    embed_dim = o_weight.shape[0]
    num_heads = heads.num_heads
    assert num_heads is not None  # find() lists layers without it as Unresolved
    head_dim = heads.head_dim or _head_dim(embed_dim, num_heads, o_weight, store.source)
    kv_heads = {"all": num_heads, "one": 1, "config": heads.num_kv_heads or num_heads}
    num_kv = hints.num_kv_heads or kv_heads[layout.kv_heads]
    q_weight, k_weight, v_weight = grouped(fused, num_heads, num_kv, head_dim, layout.storage,
                                           store.source)
    bias = optional_ref(store, prefix + "query_key_value.bias")
    q_bias, k_bias, v_bias = grouped(bias, num_heads, num_kv, head_dim, layout.storage,
                                     store.source) if bias else (None, None, None)
    layer = AttentionLayer(
        name=prefix.rstrip("."), family=layout.family, embed_dim=fused.shape[1],
        kdim=fused.shape[1], vdim=fused.shape[1], num_heads=None, num_kv_heads=None,
        head_dim=None, q_weight=q_weight, k_weight=k_weight, v_weight=v_weight,
        o_weight=o_weight, q_bias=q_bias, k_bias=k_bias, v_bias=v_bias,
        o_bias=optional_ref(store, prefix + "dense.bias"), causal=True,
        positions=layout.positions, storage=layout.storage, notes=layout.notes,
    )
    return finish(layer, HeadHints(num_heads, num_kv, head_dim), store.source)


def _head_dim(embed_dim: int, num_heads: int, o_weight: TensorRef, source: str) -> int:
    if embed_dim % num_heads:
        raise LayoutError(f"{printable(o_weight.key)} gives hidden size {embed_dim}, not "
                          f"divisible by {num_heads} heads", fix="check num_attention_heads in "
                          "config.json or --num-heads", where=source)
    return embed_dim // num_heads


def grouped(fused: TensorRef, num_heads: int, num_kv: int, head_dim: int, storage: str,
            source: str) -> tuple[TensorRef, TensorRef, TensorRef]:
    """q, k, v references into rows laid out as (H_kv, H/H_kv + 2, d), in head order."""
    rows = (num_heads + 2 * num_kv) * head_dim
    if num_kv <= 0 or num_heads % num_kv or fused.shape[0] != rows:
        raise LayoutError(f"{printable(fused.key)} has shape {fused.shape}, but {storage} with "
                          f"H={num_heads}, H_kv={num_kv}, d={head_dim} needs {rows} rows",
                          fix="check the head counts in config.json or on the command line",
                          where=source)
    group = num_heads // num_kv
    q, k, v = [], [], []
    for g in range(num_kv):
        start = g * (group + 2) * head_dim
        q.append((start, start + group * head_dim))
        k.append((start + group * head_dim, start + (group + 1) * head_dim))
        v.append((start + (group + 1) * head_dim, start + (group + 2) * head_dim))
    return fused.take(tuple(q)), fused.take(tuple(k)), fused.take(tuple(v))
