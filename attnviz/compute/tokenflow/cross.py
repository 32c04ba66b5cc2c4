"""The decoder's view of the source: attention rollout through an encoder-decoder, from one
decoder position back to the source tokens.

Each decoder layer is two attention sublayers, self-attention then cross-attention, each with
its residual. Going down from the output (e_p over the decoder's tokens), the cross sublayer
keeps w of each decoder token's share on itself and sends (1 − w) through its (head-reduced,
row-normalized) cross map to the encoder's outputs; the self sublayer mixes the decoder's share
as rollout does. What reached the encoder's outputs is then carried down the encoder's layers.
With mean maps the mass is conserved: the source's share plus the decoder's share is 1.

Shapes: encoder maps (H, S, S), decoder self maps (H, T, T), cross maps (H, T, S)."""

from __future__ import annotations

import torch

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
        C = reduce_heads(cross_maps.double(), how)  # (T, S)
        total = C.sum(-1, keepdim=True)
        C = torch.where(total > 0, C / total.clamp(min=torch.finfo(C.dtype).tiny), 0.0)
        v_enc = v_enc + (1.0 - w) * (v_dec @ C)
        v_dec = w * v_dec
        v_dec = v_dec @ mixed(self_maps, how, w)
    matrices = [mixed(m, how, w) for m in encoder]
    rows = [v_enc]
    for M in reversed(matrices):
        rows.append(rows[-1] @ M)
    return torch.stack(rows[::-1]), v_dec, matrices
