"""What a model must offer to be patched: its forward on a padded batch of ids, calling one hook
at every site with the activation in attnviz's layout, and using what the hook returns.

Sites and their layouts (TransformerLens's names; one convention everywhere):

    resid    (N, L, E)      the residual stream entering layer i (the layer's input)
    q        (N, L, H, d)   each query head's query (after rotary, as attention reads it)
    k, v     (N, L, Hkv, d) each key/value head's key and value (before grouped-query repeat)
    pattern  (N, H, L, L)   each head's attention weights, query × key
    z        (N, L, H, d)   each head's output: its slice of the input to W_O

The Hugging Face model (attnviz.sources.hf.patching) computes them with the model's own modules
and attention function; the bundled model (attnviz.sources.patch_bundled) with its own forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from attnviz.compute.patching.pairs import Tokenizer

SITES = ("resid", "q", "k", "v", "pattern", "z")  # in the order a layer computes them
# hook(site, layer, activation) -> the activation the forward goes on with
Hook = Callable[[str, int, torch.Tensor], torch.Tensor]


class PatchModel(Protocol):
    """A model that can be run with a hook at every site."""

    name: str  # the model, as the output names it
    n_layers: int
    n_heads: int
    n_kv_heads: int
    device: torch.device
    notes: list[str]
    layer_labels: list[str]  # each layer's row label: L0, L1, … (enc 0, dec 0, cross 0, …)
    # one stream of layers, so copies may be made where the residual stream enters a layer
    # (an encoder-decoder's cross-attention reads the encoder's one-row output: not there)
    shares_prefix: bool

    @property
    def sites(self) -> tuple[str, ...]:
        """The sites this model's hook reaches."""
        ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    def forward(self, ids: torch.Tensor, real: torch.Tensor, read: torch.Tensor,
                hook: Hook | None) -> torch.Tensor:
        """(N, K, V) logits at positions `read` (N, K) of ids (N, L), `real` (N, L) marking
        real tokens (right padding), with `hook` called at every site it reaches."""
        ...

    def row_bytes(self, length: int) -> int:
        """Roughly the memory one row of `length` tokens takes in a forward (for chunking)."""
        ...


@dataclass(frozen=True)
class Shortcut:
    """Work a forward may leave out because its result is known or thrown away; a model that
    does all the work anyway computes the same numbers.

    start, state: `state` (rows, L, E) is the residual stream entering layer `start` — the
    unpatched run's, recorded by the engine, when no copy patches a layer before it — so the
    layers before `start` need not run (their sites are not hooked).
    frozen: layers whose head outputs (site z) the hook replaces in every row at every head
    and position, so their attention (scores, pattern, its product with the values) need not
    be computed; their q, k, v are still passed through the hook.
    """

    start: int = 0
    state: torch.Tensor | None = None
    frozen: frozenset[int] = frozenset()


@runtime_checkable
class Shortcuts(Protocol):
    """A PatchModel whose forward can take a `Shortcut`."""

    def forward_from(self, ids: torch.Tensor, real: torch.Tensor, read: torch.Tensor,
                     hook: Hook | None, shortcut: Shortcut) -> torch.Tensor:
        """`forward`, leaving out what `shortcut` allows."""
        ...
