"""T5-style attention (T5, mT5, UMT5, Flan-T5): `SelfAttention.{q,k,v,o}` and `EncDecAttention.*`.

nn.Linear without biases: q (H·d_kv, d_model), o (d_model, H·d_kv); H·d_kv may differ from
d_model (t5-3b: 32·128 = 4096 vs 1024). q(x) is viewed as (B, L, H, d_kv). No 1/√d scaling (it is
folded into the initialization); self-attention adds a learned relative position bias, stored as
`relative_attention_bias` in the first block only and reused by the later ones.
"""

from __future__ import annotations

from attnviz.core.layer import AttentionLayer
from attnviz.load.checkpoint import TensorStore
from attnviz.recognize.base import HeadHints, finish, head_counts, prefixes_with, ref

FAMILY = "t5"
MODULES = ("SelfAttention", "EncDecAttention")


def find(store: TensorStore, hints: HeadHints) -> list[AttentionLayer]:
    heads = None  # config's num_heads is read only for T5 layers: other models (Swin) use the
    # name for other things, such as one count per stage
    layers = []
    for prefix in prefixes_with(store.keys(), "q.weight"):
        module = prefix.rstrip(".").rsplit(".", 1)[-1]
        if module in MODULES and all(f"{prefix}{n}.weight" in store for n in "kvo"):
            if heads is None:
                heads = head_counts(store, hints, store.config, heads_keys=("num_heads",),
                                    kv_keys=(), dim_keys=("d_kv",))
            layers.append(finish(_layer(store, prefix, module), heads, store.source))
    return layers


def _layer(store: TensorStore, prefix: str, module: str) -> AttentionLayer:
    q, k, v, o = (ref(store, f"{prefix}{n}.weight") for n in "qkvo")
    cross = module == "EncDecAttention"
    decoder = "decoder" in prefix.split(".")
    notes = []
    if cross:
        notes.append("cross-attention: keys and values come from the encoder; no position bias")
    elif f"{prefix}relative_attention_bias.weight" not in store:
        notes.append("adds the relative position bias computed by the first block's "
                     "relative_attention_bias")
    return AttentionLayer(
        name=prefix.rstrip("."), family=FAMILY, embed_dim=q.shape[1], kdim=k.shape[1],
        vdim=v.shape[1], num_heads=None, num_kv_heads=None, head_dim=None, q_weight=q,
        k_weight=k, v_weight=v, o_weight=o, scale=1.0, causal=decoder and not cross,
        positions="none" if cross else "relative bias",
        storage=f"separate {module}.{{q,k,v,o}} nn.Linear (out, in), no bias", notes=tuple(notes),
    )
