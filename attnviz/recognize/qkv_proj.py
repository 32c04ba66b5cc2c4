"""Separate `q_proj`/`k_proj`/`v_proj` nn.Linear projections with `o_proj`, `out_proj` or `dense`.

Covers LLaMA, Mistral, Qwen2/3, Gemma 1/2/3, Phi, GPT-J, GPT-Neo, OPT (`o_proj`/`out_proj`),
HF CLIP/SigLIP towers, BART, mBART, Marian, Pegasus, M2M100 and Whisper (`self_attn`,
`encoder_attn`). All reshape q_proj(x) as (B, L, H, d): head h = rows h·d…; k/v have H_kv·d rows
(GQA: num_key_value_heads) and query head h uses kv head h // (H / H_kv) (repeat_kv); d may be an
explicit head_dim with H·d ≠ E (Gemma, Qwen3). Positions, causal masking and scale come from the
config's model_type; an unknown model_type keeps the defaults and says so in the notes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from attnviz.core.layer import AttentionLayer
from attnviz.load import config as hfconfig
from attnviz.load.checkpoint import TensorStore
from attnviz.recognize.base import HeadHints, finish, head_counts, optional_ref, prefixes_with, ref

FAMILY = "qkv_proj"
O_NAMES = ("o_proj", "out_proj", "dense")
HEADS_KEYS = ("num_attention_heads", "n_head", "num_heads")
# Encoder-decoder configs give each side its own count; cross-attention belongs to the decoder.
ROLE_HEADS = {"encoder": ("encoder_attention_heads",), "decoder": ("decoder_attention_heads",),
              "cross": ("decoder_attention_heads",)}
ROPE = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
                  "gemma", "gemma2", "gemma3", "olmo", "olmo2", "starcoder2", "cohere", "granite",
                  "stablelm", "phi", "gptj"})
ROPE_FRACTION = {"phi": 0.5, "stablelm": 0.25}  # their configs' partial_rotary_factor defaults
LEARNED_DECODERS = frozenset({"opt", "gpt_neo"})
ENCODER_DECODERS = {"bart": "learned", "mbart": "learned", "plbart": "learned",
                    "blenderbot": "learned", "blenderbot-small": "learned",
                    "marian": "sinusoidal", "pegasus": "sinusoidal", "m2m_100": "sinusoidal",
                    "whisper": "learned"}  # decoder side; Whisper's encoder is sinusoidal
TOWER_MODELS = {"clip": True, "siglip": False}  # → whether the text tower is causal
KNOWN = ROPE | LEARNED_DECODERS | set(ENCODER_DECODERS) | set(TOWER_MODELS)
SLIDING = frozenset({"mistral", "mixtral", "qwen2", "starcoder2", "gemma2", "gemma3"})


def find(store: TensorStore, hints: HeadHints) -> list[AttentionLayer]:
    layers = []
    for prefix in prefixes_with(store.keys(), "q_proj.weight"):
        o_name = next((n for n in O_NAMES if f"{prefix}{n}.weight" in store), None)
        if o_name is None or not all(f"{prefix}{n}.weight" in store for n in ("k_proj", "v_proj")):
            continue
        tower, config = hfconfig.tower_config(store.config, prefix)
        role = _role(prefix)
        heads = head_counts(store, hints, config, heads_keys=ROLE_HEADS.get(role, ()) + HEADS_KEYS,
                            kv_keys=("num_key_value_heads", "num_kv_heads"),
                            dim_keys=("head_dim",))
        layer = finish(_layer(store, prefix, o_name), heads, store.source)
        layers.append(_describe(layer, store, prefix, config, tower, role))
    return layers


def _role(prefix: str) -> str:
    """encoder, decoder, cross (encoder-decoder attention) or self (decoder-only models)."""
    parts = prefix.rstrip(".").split(".")
    if parts[-1] in ("encoder_attn", "cross_attn"):
        return "cross"
    return next((p for p in reversed(parts) if p in ("encoder", "decoder")), "self")


def _layer(store: TensorStore, prefix: str, o_name: str) -> AttentionLayer:
    q, k, v = (ref(store, f"{prefix}{n}_proj.weight") for n in "qkv")
    return AttentionLayer(
        name=prefix.rstrip("."), family=FAMILY, embed_dim=q.shape[1], kdim=k.shape[1],
        vdim=v.shape[1], num_heads=None, num_kv_heads=None, head_dim=None, q_weight=q,
        k_weight=k, v_weight=v, o_weight=ref(store, f"{prefix}{o_name}.weight"),
        q_bias=optional_ref(store, f"{prefix}q_proj.bias"),
        k_bias=optional_ref(store, f"{prefix}k_proj.bias"),
        v_bias=optional_ref(store, f"{prefix}v_proj.bias"),
        o_bias=optional_ref(store, f"{prefix}{o_name}.bias"),
        storage=f"separate q_proj/k_proj/v_proj + {o_name}, nn.Linear (out, in)",
    )


def _kind(config: dict[str, Any], top: dict[str, Any],
          tower: str | None) -> tuple[str | None, str | None]:
    """(base model_type, tower): clip_text_model → (clip, text), gemma3_text → (gemma3, …)."""
    kind = hfconfig.model_type(config) or hfconfig.model_type(top)
    for suffix, name in (("_text_model", "text"), ("_vision_model", "vision"), ("_text", "text")):
        if kind and kind.endswith(suffix):
            return kind[: -len(suffix)], tower or name
    return kind, tower


def _describe(layer: AttentionLayer, store: TensorStore, prefix: str, config: dict[str, Any],
              tower: str | None, role: str) -> AttentionLayer:
    """Positions, causal masking, scale and notes, from what the model_type is known to do."""
    (kind, tower), d = _kind(config, store.config, tower), layer.head_dim
    notes: list[str] = []
    positions, causal, scale = "none", False, None
    if kind in ROPE:
        fraction = hfconfig.rotary_fraction(config, "partial_rotary_factor",
                                            default=ROPE_FRACTION.get(kind, 1.0))
        if kind == "gptj" and d:
            fraction = hfconfig.number(config, "rotary_dim", 64.0) / d  # GPTJConfig's default
            notes.append("GPT-J rotates interleaved pairs (2j, 2j+1), not rotate_half")
        positions, causal = hfconfig.rope_label(fraction), True
    elif kind in LEARNED_DECODERS:
        positions, causal = "learned", True
    elif kind in ENCODER_DECODERS:
        positions = ENCODER_DECODERS[kind]
        if kind == "whisper" and role == "encoder":
            positions = "sinusoidal"
        causal = role == "decoder"
    elif kind in TOWER_MODELS:
        positions, causal = "learned", tower == "text" and TOWER_MODELS[kind]
    elif kind is None:
        notes.append("no config.json model_type: positions, causal masking and scale are not "
                     "known, shown as none, not causal, 1/√d")
    else:
        notes.append(f"model_type {kind!r} is not known to attnviz: positions, causal masking "
                     "and scale are shown as none, not causal, 1/√d")
    if kind in ("gemma2", "gemma3"):
        scale = hfconfig.number(config, "query_pre_attn_scalar", 256.0) ** -0.5
        cap = config.get("attn_logit_softcapping")
        if cap:
            notes.append(f"scores are soft-capped: s ← {cap}·tanh(s/{cap})")
    if kind == "granite":  # GraniteAttention: scaling = config.attention_multiplier
        scale = hfconfig.number(config, "attention_multiplier", 1.0)
    if kind == "gpt_neo":
        scale = 1.0
        notes.append("GPT-Neo does not scale q·kᵀ; some layers attend locally (window_size)")
    window = config.get("sliding_window")
    if kind in SLIDING and window and config.get("use_sliding_window", True):
        notes.append(f"sliding-window attention over {window} keys on some or all layers")
    if f"{prefix}q_norm.weight" in store:
        notes.append("q and k pass through RMSNorm (q_norm, k_norm) before RoPE")
    if role == "cross":
        notes.append("cross-attention: keys and values come from the encoder")
    return replace(layer, family=kind if kind in KNOWN else FAMILY,
                   positions=positions, causal=causal, scale=scale,
                   notes=(*layer.notes, *notes))
