"""Position schemes inside attention, as Hugging Face families apply them, from config.json alone.

Used to recompute a real model's attention weights head by head from attnviz's weight slices:
RoPE in the rotate_half convention (LLaMA, Mistral, Qwen2: all dims; GPT-NeoX: the first
`rotary_ndims = int(d · rotary_pct)` dims, the rest passed through), sliding windows, causal and
padding masks. Nothing here imports transformers: the frequencies are computed from the raw
config.json, so agreement with the model is evidence, not an echo of the model's own tables.
Shapes: x (B, L, E); per-head q/k (B, L, d); maps (B, H, L, S).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from attnviz.compute.forward_pass import kernel
from attnviz.compute.forward_pass.forward import LayerWeights
from attnviz.core.layer import AttentionLayer
from attnviz.errors import LayoutError, UsageError, printable
from attnviz.load.config import model_type, number
from attnviz.recognize import model_type_table, model_types

# model_type → where positions enter attention, for the types whose positions attnviz recomputes
# (split --verify, heatmap --query). Read from the one model-type table; causal masking and the
# scale come from the layer.
SCHEMES = {kind: "rope" if entry.positions == "rope" else "none"
           for kind, entry in model_type_table.MODEL_TYPES.items() if entry.verify}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class Positions:
    """What happens to q and k of one layer besides projection, for positions 0..L-1."""

    described: str
    rope: tuple[torch.Tensor, torch.Tensor, int] | None = None  # cos (L, r), sin (L, r), r dims
    window: int | None = None  # keys per query under a sliding window


def positions_for(config: dict[str, Any], layer: AttentionLayer, index: int,
                  length: int) -> Positions:
    """The position scheme of layer `index` of a model with this config.json."""
    kind = model_type(config)
    if kind not in SCHEMES:
        raise UsageError(f"verification does not support model_type {kind!r}",
                         fix=f"supported: {', '.join(sorted(SCHEMES))}")
    window = sliding_window(config, kind, index)
    suffix = f"; sliding window of {window} keys" if window is not None else ""
    if SCHEMES[kind] == "none":
        return Positions(f"none inside attention ({kind}: absolute position embeddings are part "
                         "of the captured input)" + suffix)
    rope, described = rope_tables(config, kind, layer.head_dim or 0, length)
    return Positions(described + suffix, rope, window)


def rope_tables(config: dict[str, Any], kind: str, head_dim: int, length: int
                ) -> tuple[tuple[torch.Tensor, torch.Tensor, int], str]:
    """((cos, sin, rotated dims), description) for positions 0..length-1."""
    entry = model_types.lookup(kind) or model_type_table.GENERIC
    dims = int(head_dim * model_types.layer_rotary_fraction(entry, config, head_dim))
    # transformers 5 writes rope_parameters; 4.x wrote rope_theta (rotary_emb_base for NeoX) and
    # an optional rope_scaling dict.
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    params = params if isinstance(params, dict) else {}
    theta = next((value for value in (number(params, "rope_theta", None),
                                      number(config, "rope_theta", None),
                                      number(config, "rotary_emb_base", None))
                  if value is not None), 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    inv_freq = 1.0 / theta ** (torch.arange(0, dims, 2, dtype=torch.int64).float() / dims)
    if rope_type == "linear":
        inv_freq = inv_freq / _required(params, "factor")
    elif rope_type == "llama3":
        inv_freq = llama3_frequencies(inv_freq, params)
    elif rope_type != "default":
        raise UsageError(f"attnviz does not recompute rope_type {printable(str(rope_type))!r} "
                         "yet", fix=f"supported: {', '.join(ROPE_TYPES)}")
    freqs = torch.arange(length).float()[:, None] * inv_freq[None]  # (L, dims/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (L, dims): rotate_half pairs j and j + dims/2
    described = (f"RoPE recomputed from config.json: rotate_half on {dims} of {head_dim} dims "
                 f"per head, θ={theta:g}, rope_type {rope_type}")
    return (emb.cos(), emb.sin(), dims), described


def _required(params: dict[str, Any], name: str) -> float:
    """A positive number the rope parameters must hold."""
    value = number(params, name, None)
    if value is None:
        raise LayoutError(f"config.json's rope parameters lack {name!r}", fix="fix config.json")
    return value


def llama3_frequencies(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling (modeling_rope_utils._compute_llama3_parameters)."""
    factor, low, high = (_required(params, k) for k in ("factor", "low_freq_factor",
                                                         "high_freq_factor"))
    old = _required(params, "original_max_position_embeddings")
    if high == low:
        raise LayoutError("config.json's rope scaling has low_freq_factor = high_freq_factor",
                          fix="fix config.json")
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dims: int) -> torch.Tensor:
    """x (B, L, d): the first `dims` dims rotated (rotate_half), the rest passed through."""
    rot, rest = x[..., :dims], x[..., dims:]
    half = dims // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


def sliding_window(config: dict[str, Any], kind: str | None, index: int) -> int | None:
    """The sliding window of layer `index`, or None for full attention (the model-type table's
    rule: always, opt-in with use_sliding_window, or per layer_types)."""
    return model_types.sliding_window(config, kind, index)


@dataclass(frozen=True)
class RecomputedHeads:
    """Every query head recomputed from its slices, positions applied."""

    q: torch.Tensor  # (B, H, L, d) each head's projected query, after RoPE
    k: torch.Tensor  # (B, H, L, d) the key head each query head uses, after RoPE
    scores: torch.Tensor  # (B, H, L, L) scale · q kᵀ, before masks
    weights: torch.Tensor  # (B, H, L, L) after masks and softmax


def recompute_heads(layer: AttentionLayer, weights: LayerWeights, x: torch.Tensor,
                    lengths: list[int], positions: Positions) -> RecomputedHeads:
    """softmax(scale · q_h k_hᵀ + masks) head by head from the weight slices.

    x is right-padded: sentence b's real tokens are rows 0..lengths[b]-1, at positions 0..n-1.
    """
    mask = position_mask(layer, lengths, x.shape[1], positions.window)  # (B, 1|L, L)
    qs, ks, scores, maps = [], [], [], []
    for h in range(layer.num_heads or 0):
        q = kernel.project(x, weights.W_q, weights.b_q, layer.q_rows(h))  # (B, L, d)
        k = kernel.project(x, weights.W_k, weights.b_k, layer.kv_rows(layer.kv_head_of(h)))
        if positions.rope is not None:
            q, k = apply_rope(q, *positions.rope), apply_rope(k, *positions.rope)
        s, a = kernel.head_weights(q, k, layer.effective_scale, mask)  # (B, L, L) each
        qs.append(q)
        ks.append(k)
        scores.append(s)
        maps.append(a)
    stack = lambda xs: torch.stack(xs, dim=1)  # noqa: E731
    return RecomputedHeads(stack(qs), stack(ks), stack(scores), stack(maps))


def position_mask(layer: AttentionLayer, lengths: list[int], length: int,
                  window: int | None) -> torch.Tensor:
    """(B, 1 or L, L) bool, True = masked: right padding, then the causal mask and the sliding
    window where the layer has them."""
    mask = kernel.padding_mask(lengths, length)[:, None, :]  # (B, 1, L)
    if layer.causal:
        mask = mask | kernel.causal_mask(length)[None]  # (B, L, L)
    if window is not None:  # query i sees keys j with i - j < window
        mask = mask | kernel.window_mask(length, window)[None]
    return mask


def recompute_weights(layer: AttentionLayer, weights: LayerWeights, x: torch.Tensor,
                      lengths: list[int], positions: Positions) -> torch.Tensor:
    """The (B, H, L, L) attention weights of recompute_heads."""
    return recompute_heads(layer, weights, x, lengths, positions).weights

