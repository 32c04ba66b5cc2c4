"""Norms (Kobayashi et al. 2021) and ALTI (Ferrando et al. 2022) for the decoder's view of the
source: from one decoder position through the decoder's self- and cross-attention sublayers,
then the encoder, composed like the encoder side (compute/tokenflow/decompose.py).

The contributions run over T + S joint nodes [decoder input tokens (T); source positions (S)].
Per decoder layer, going down from the output:
- the cross-attention sublayer writes, for decoder token t,
      y_t = Σ_j T_tj + r_t,  T_tj = Σ_h α^h_tj U^h_j + ᾱ_tj b_O   (j over the encoder outputs)
  with U^h_j = W_O^h W_V^h enc_j (value bias included) and r_t its residual (a post-LN norm
  frozen as decompose.py does). That is a self-attention block over the joint nodes whose
  decoder rows read only encoder keys and keep their residual on themselves (`cross_block`),
  so decompose's terms, identity check, norms and ALTI serve it unchanged: its rows (T, T + S)
  are normalized like any block's, the decoder part being the residual's share;
- the self-attention sublayer mixes the decoder tokens (a causal block over T);
- the MLP and the norms between sublayers act per token and are not traced (as on the encoder
  side).
What reached the encoder outputs is carried down the encoder's composed contributions (the
encoder's final norm, per token, aside). Each step carries a row vector through row-normalized
rows, so the source's share plus what is left on the decoder's own tokens is 1.

Shapes: cross maps (H, T, S), values (H, S, E), residual (T, E); one sentence."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from attnviz.compute.tokenflow.decompose import (
    CONTRIBUTION_METHODS,
    BlockTerms,
    contribution_rows,
)
from attnviz.core.choices import TokenMethod


def cross_block(sub: BlockTerms) -> BlockTerms:
    """The cross-attention sublayer `sub` (maps (H, T, S), values (H, S, E) over the encoder
    outputs, residual and output (T, E)) as one block over the joint nodes [decoder (T);
    encoder outputs (S)]: decoder row t reads key T + j with weight α^h_tj, and key t (itself)
    only through its residual; the encoder rows are never queried (zero maps and residual)."""
    H, T, S = sub.maps.shape
    E = sub.residual.shape[-1]
    N = T + S
    maps = torch.zeros(H, N, N, dtype=sub.maps.dtype)
    maps[:, :T, T:] = sub.maps
    values = torch.zeros(H, N, E, dtype=sub.values.dtype)
    values[:, T:] = sub.values
    residual = torch.zeros(N, E, dtype=sub.residual.dtype)
    residual[:T] = sub.residual
    output = None
    if sub.output is not None:
        output = torch.zeros(N, E, dtype=sub.output.dtype)
        output[:T] = sub.output
    return replace(sub, maps=maps, values=values, residual=residual, output=output)


@dataclass(frozen=True)
class CrossBlocks:
    """One sentence's per-source terms for the decoder's view, each list bottom layer first."""

    encoder: list[BlockTerms]  # the encoder's self-attention blocks (over S)
    decoder: list[BlockTerms]  # the decoder's self-attention blocks (over T, causal)
    # its cross-attention sublayers as rectangular blocks: maps (H, T, S), values (H, S, E),
    # residual and output (T, E); `cross_block` makes each the joint block, one at a time
    cross: list[BlockTerms]


@dataclass(frozen=True)
class CrossComposed:
    """One method's decoder view of the source for one output position."""

    chain: torch.Tensor  # (n_enc + 1, S): row k the source share entering encoder layer k
    decoder_share: torch.Tensor  # (T,): the share left on the decoder's input tokens
    matrices: list[torch.Tensor]  # per encoder layer (S, S) (empty unless kept)


def _reached(vectors: dict[TokenMethod, torch.Tensor]) -> torch.Tensor:
    """The indices where any method's vector is not 0: the only rows worth computing."""
    reached = torch.zeros_like(next(iter(vectors.values())), dtype=torch.bool)
    for v in vectors.values():
        reached |= v != 0
    return reached.nonzero().flatten()


def _step(block: BlockTerms, vectors: dict[TokenMethod, torch.Tensor], budget: int,
          width: int) -> dict[TokenMethod, torch.Tensor]:
    """v ← v C over the block's rows that v reaches; C (rows, width) its contribution rows."""
    rows = _reached(vectors)
    if len(rows) == 0:
        return {m: torch.zeros(width, dtype=torch.float64) for m in vectors}
    computed = contribution_rows(block, rows, budget, tuple(vectors))
    return {m: v[rows] @ computed[m] for m, v in vectors.items()}


def compose_cross(blocks: CrossBlocks, position: int, budget: int,
                  methods: tuple[TokenMethod, ...] = CONTRIBUTION_METHODS, keep: bool = True
                  ) -> dict[TokenMethod, CrossComposed]:
    """Each asked contribution method's decoder view of the source for decoder position
    `position`; `keep` False: no encoder matrices, the chains alone."""
    encoder, decoder, cross = blocks.encoder, blocks.decoder, blocks.cross
    asked = tuple(m for m in CONTRIBUTION_METHODS if m in methods)
    T = decoder[0].residual.shape[0]
    S = encoder[0].residual.shape[0]
    start = torch.zeros(T, dtype=torch.float64)
    start[position] = 1.0
    dec = {m: start.clone() for m in asked}
    enc = {m: torch.zeros(S, dtype=torch.float64) for m in asked}
    for self_block, cross_sub in zip(reversed(decoder), reversed(cross), strict=True):
        joint = _step(cross_block(cross_sub), dec, budget, T + S)  # (T + S,) per method
        for m in asked:
            enc[m] = enc[m] + joint[m][T:]
            dec[m] = joint[m][:T]
        dec = _step(self_block, dec, budget, T)
    chains = {m: [v] for m, v in enc.items()}
    matrices: dict[TokenMethod, list[torch.Tensor]] = {m: [] for m in asked}
    for block in reversed(encoder):
        current = {m: c[-1] for m, c in chains.items()}
        rows = _reached(current)
        computed = contribution_rows(block, rows, budget, asked) if len(rows) else {}
        for m in asked:
            if len(rows):
                chains[m].append(current[m][rows] @ computed[m])
            else:
                chains[m].append(torch.zeros(S, dtype=torch.float64))
            if keep:
                full = torch.zeros(S, S, dtype=torch.float64)
                if len(rows):
                    full[rows] = computed[m]
                matrices[m].append(full)
    return {m: CrossComposed(torch.stack(chains[m][::-1]), dec[m], matrices[m][::-1])
            for m in asked}
