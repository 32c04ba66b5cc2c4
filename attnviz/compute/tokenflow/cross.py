"""The decoder's view of the source: attention rollout through an encoder-decoder, from one
decoder position back to the source tokens.

Each decoder layer is two attention sublayers, self-attention then cross-attention, each with
its residual. Going down from the output (e_p over the decoder's tokens), the cross sublayer
keeps w of each decoder token's share on itself and sends (1 − w) through its (head-reduced,
row-normalized) cross map to the encoder's outputs; the self sublayer mixes the decoder's share
as rollout does. What reached the encoder's outputs is then carried down the encoder's layers.
With mean maps the mass is conserved: the source's share plus the decoder's share is 1.

Attention flow runs over the same graph, laid out as layers of joint nodes [decoder input
tokens (T); source positions (S)] (`joint_matrices`): first the encoder's layers (the decoder
tokens pass through), then per decoder layer its self sublayer (the source positions pass
through) and its cross sublayer. Each token's value is the exact max flow from its node to the
decoder position (compute/tokenflow/maxflow.py).

Shapes: encoder maps (H, S, S), decoder self maps (H, T, T), cross maps (H, T, S)."""

from __future__ import annotations

import torch

from attnviz.compute.tokenflow.maxflow import attention_flow
from attnviz.compute.tokenflow.rollout import mixed, reduce_heads
from attnviz.core.choices import HeadReduce


def cross_rollout(encoder: list[torch.Tensor], decoder: list[torch.Tensor],
                  cross: list[torch.Tensor], position: int, how: HeadReduce,
                  residual_weight: float
                  ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(source chain (n_enc + 1, S): row k the share of the source tokens entering encoder
    layer k; the share left on the decoder's input tokens (T,); the encoder's mixed matrices)."""
    w = residual_weight
    T = decoder[0].shape[-1] if decoder else position + 1
    S = cross[0].shape[-1]
    v_dec = torch.zeros(T, dtype=torch.float64)
    v_dec[position] = 1.0
    v_enc = torch.zeros(S, dtype=torch.float64)
    for self_maps, cross_maps in zip(reversed(decoder), reversed(cross), strict=True):
        v_enc = v_enc + (1.0 - w) * (v_dec @ cross_map(cross_maps, how))
        v_dec = w * v_dec
        v_dec = v_dec @ mixed(self_maps, how, w)
    matrices = [mixed(m, how, w) for m in encoder]
    rows = [v_enc]
    for M in reversed(matrices):
        rows.append(rows[-1] @ M)
    return torch.stack(rows[::-1]), v_dec, matrices


def cross_map(maps: torch.Tensor, how: HeadReduce) -> torch.Tensor:
    """(T, S) float64: the cross maps (H, T, S) reduced over heads, each row normalized."""
    C = reduce_heads(maps.double(), how)
    total = C.sum(-1, keepdim=True)
    return torch.where(total > 0, C / total.clamp(min=torch.finfo(C.dtype).tiny), 0.0)


def joint_matrices(encoder: list[torch.Tensor], decoder: list[torch.Tensor],
                   cross: list[torch.Tensor], how: HeadReduce, residual_weight: float
                   ) -> list[torch.Tensor]:
    """Bottom level first, (T + S, T + S) each over [decoder tokens; source positions]: the
    encoder's mixed matrices (decoder tokens pass through), then per decoder layer its self
    sublayer (rollout's mixed matrix on the decoder; the source positions pass through) and its
    cross sublayer (a decoder row keeps w on itself and sends 1 − w through `cross_map`). The
    vector carried down these is `cross_rollout`'s (the tests check it)."""
    w = residual_weight
    T, S = cross[0].shape[-2:]
    N = T + S
    out = []
    for maps in encoder:
        M = torch.eye(N, dtype=torch.float64)
        M[T:, T:] = mixed(maps, how, w)
        out.append(M)
    for self_maps, cross_maps in zip(decoder, cross, strict=True):
        M = torch.eye(N, dtype=torch.float64)
        M[:T, :T] = mixed(self_maps, how, w)
        out.append(M)
        X = torch.eye(N, dtype=torch.float64)
        X[:T, :T] *= w
        X[:T, T:] = (1.0 - w) * cross_map(cross_maps, how)
        out.append(X)
    return out


def cross_flow(encoder: list[torch.Tensor], decoder: list[torch.Tensor],
               cross: list[torch.Tensor], position: int, how: HeadReduce,
               residual_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the max flow from each source token (S,), from each decoder input token (T,)) to the
    decoder position, over `joint_matrices`' layered graph (flow's values are not shares: they
    need not add up to 1)."""
    T = cross[0].shape[-2]
    values = attention_flow(joint_matrices(encoder, decoder, cross, how, residual_weight),
                            position)
    return values[T:], values[:T]


def cross_levels(encoder_layers: int, decoder_layers: int) -> int:
    """The layers of the flow graph: one per encoder layer, two per decoder layer."""
    return encoder_layers + 2 * decoder_layers
