"""The causal head scorecard for attnviz's own forwards: the bundled model and a standalone layer.

Each removed head gets its own copy of the batch (heads stacked along the batch dimension, as many
per forward as the memory budget holds at the unablated run's cost per copy:
attnviz.sources.copy_budget); in its copy the head's slice of the input to W_O (its o_cols) is
zeroed, or replaced by that slice's mean over the batch's real tokens (`mean`). The forward is the
one `attnviz.sources.bundled.run_tiny` runs (embeddings + positions, pre-LayerNorm attention
blocks, then the final LayerNorm and the unembedding the bundled model was trained with); a
standalone layer is its own model: its output is the hidden state, and there is no LM head. The
bundled model's copies start at their lowest head's layer from the unablated run's hidden states
there (the layers below compute the same thing in every copy).
Hugging Face models take `attnviz.sources.hf.ablation` (the model's own forward, hooked).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from attnviz.compute.forward_pass import kernel
from attnviz.compute.forward_pass.forward import (
    LayerWeights,
    head_attention,
    load_weights,
    merged_mask,
)
from attnviz.compute.forward_pass.inputs import padding_mask
from attnviz.compute.forward_pass.results import AttentionRun
from attnviz.compute.measures.ablation_measures import (
    CAUSAL_LOSS,
    AblationReport,
    HeadEffect,
    difference,
    hidden_change,
    next_token_losses,
    repeat_targets,
    undefined_measures,
)
from attnviz.core.layer import AttentionLayer
from attnviz.core.words import hashed_ids
from attnviz.load.store import TensorStore
from attnviz.recognize.base import metadata_int
from attnviz.sources import bundled
from attnviz.sources.copy_budget import (
    CopyCost,
    copies_per_forward,
    release_freed_memory,
    tensor_bytes,
)

# An edit of the W_O input of layer i: edit(i, ctx (N, L, W)) changes ctx in place.
Edit = Callable[[int, torch.Tensor], None]
MAX_COPIES = 128  # most copies of the batch in one forward pass (copy_budget.MAX_COPIES)


def context(layer: AttentionLayer, weights: LayerWeights, query: torch.Tensor,
            key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The input of W_O (N, L, W): each head's softmax(q kᵀ) v at its o_cols."""
    ctx = query.new_zeros(*query.shape[:-1], weights.W_o.shape[1])
    for h in range(layer.num_heads or 0):
        *_, v_h, _, a_h = head_attention(layer, weights, h, (query, key, value), mask)
        ctx[..., slice(*layer.o_cols(h))] = a_h @ v_h  # (N, L, d)
    return ctx


class TinyForward:
    """The bundled model's forward on a padded batch, any number of copies at once."""

    def __init__(self, store: TensorStore, run: AttentionRun, device: torch.device) -> None:
        self.store, self.device = store, device
        self.layers = bundled.tiny_layers(store)
        self.weights = [load_weights(layer, store, device=str(device)) for layer in self.layers]
        vocab = metadata_int(store, "vocab_size") or 0
        batch = run.batch
        ids = torch.zeros(len(batch.tokens), batch.max_len, dtype=torch.long)
        for b, tokens in enumerate(batch.tokens):
            ids[b, :len(tokens)] = torch.tensor(hashed_ids(tokens, vocab))
        self.ids, self.real = ids, ~padding_mask(batch)
        self.param = {name: store.read(name).float().to(device) for name in store.keys()
                      if not name.startswith("layers.") or ".ln." in name}
        self.lm = "unembed.weight" in self.param and "ln_f.weight" in self.param
        self.inputs: list[torch.Tensor] = []  # each layer's input in the unablated run (B, L, E)

    def __call__(self, copies: int, edit: Edit, start: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(final hidden states (copies·B, L, E), logits or None) with `edit` at every W_O from
        layer `start` on (the layers below: the unablated run's, which the first call, the
        unablated run, records)."""
        ids = self.ids.repeat(copies, 1).to(self.device)
        L = ids.shape[1]
        p = self.param
        if start == 0:
            x = p["embed.weight"][ids] + p["pos_embed.weight"][:L][None]  # (N, L, E)
        else:
            x = self.inputs[start].repeat(copies, 1, 1)  # (N, L, E)
        pad = (~self.real).repeat(copies, 1).to(self.device)
        mask = merged_mask(pad, kernel.causal_mask(L, device=self.device), False)
        record = not self.inputs  # the first call: the unablated run
        for i, (layer, weights) in enumerate(zip(self.layers, self.weights, strict=True)):
            if i < start:
                continue
            if record:
                self.inputs.append(x)
            h = F.layer_norm(x, (x.shape[-1],), p[f"layers.{i}.ln.weight"],
                             p[f"layers.{i}.ln.bias"], eps=1e-5)
            ctx = context(layer, weights, h, h, h, mask)
            edit(i, ctx)
            x = x + F.linear(ctx, weights.W_o, weights.b_o)
        if not self.lm:
            return x, None
        final = F.layer_norm(x, (x.shape[-1],), p["ln_f.weight"], p["ln_f.bias"], eps=1e-5)
        return final, final @ p["unembed.weight"].T


class LayerForward:
    """A standalone layer as its own model: its output (N, L, E) is the hidden state."""

    def __init__(self, run: AttentionRun, device: torch.device) -> None:
        captured = run.layers[0]
        assert captured.layer is not None and captured.inputs is not None and run.store
        self.layer = captured.layer
        self.weights = load_weights(self.layer, run.store, device=str(device))
        self.x = captured.inputs.float().to(device)
        self.key = (captured.key_inputs if captured.key_inputs is not None
                    else captured.inputs).float().to(device)
        self.value = (captured.value_inputs if captured.value_inputs is not None
                      else captured.inputs).float().to(device)
        self.real = ~padding_mask(run.batch)
        self.causal, self.index, self.device = run.causal, captured.index, device
        self.lm = False

    def __call__(self, copies: int, edit: Edit, start: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the layer's output (copies·B, L, E), None) with `edit` at its W_O."""
        L = self.x.shape[1]
        pad = (~self.real).repeat(copies, 1).to(self.device)
        causal = kernel.causal_mask(L, device=self.device) if self.causal else None
        mask = merged_mask(pad, causal, self.weights.bias_k is not None)
        grow = lambda t: t.repeat(copies, 1, 1)  # noqa: E731
        ctx = context(self.layer, self.weights, grow(self.x), grow(self.key), grow(self.value),
                      mask)
        edit(self.index, ctx)
        return F.linear(ctx, self.weights.W_o, self.weights.b_o), None


def ablate_run(run: AttentionRun, heads: list[tuple[int, str, AttentionLayer, int]], mode: str,
               device: torch.device, report: Callable[[str], None],
               memory_budget: int | None = None) -> AblationReport:
    """The scorecard of `heads` (layer index, label, layer, head) of a bundled-model or
    standalone run; copies per forward within `memory_budget` (None: the default)."""
    assert run.store is not None
    release_freed_memory()  # the attention run's, before the copies take more
    forward: TinyForward | LayerForward = TinyForward(run.store, run, device) \
        if bundled.is_tiny_model(run.store) else LayerForward(run, device)
    real = forward.real
    means: dict[int, torch.Tensor] = {}

    def record(i: int, ctx: torch.Tensor) -> None:
        means[i] = ctx[real.to(ctx.device)].mean(0)  # (W,) over real tokens

    with torch.no_grad():
        base_hidden, base_logits = forward(1, record)
        ids = forward.ids if isinstance(forward, TinyForward) else None
        base_loss = base_repeat = None
        repeats = None if ids is None else repeat_targets(ids, real)  # once, for every copy
        if base_logits is not None and ids is not None:
            base_loss, base_repeat = next_token_losses(base_logits, ids, real, repeats)
        per = copies_per_forward(_cost(forward, base_hidden, base_logits), memory_budget,
                                 device.type == "cpu", MAX_COPIES)
        effects: list[HeadEffect] = []
        B = base_hidden.shape[0]
        for start in range(0, len(heads), per):
            chunk = heads[start:start + per]
            report(f"ablating heads {start + 1}-{start + len(chunk)} of {len(heads)}")
            first = min(index for index, *_ in chunk) if isinstance(forward, TinyForward) else 0
            hidden, logits = forward(len(chunk), _editor(chunk, B, mode, means), first)
            for c, (index, label, _, head) in enumerate(chunk):
                part = slice(c * B, (c + 1) * B)
                loss = repeat = None
                if logits is not None and ids is not None and base_loss is not None:
                    loss, repeat = next_token_losses(logits[part], ids, real, repeats)
                effects.append(HeadEffect(
                    index, label, head, hidden_change(base_hidden, hidden[part], real),
                    difference(loss, base_loss), difference(repeat, base_repeat)))
    loss_kind = CAUSAL_LOSS if forward.lm else None
    return AblationReport(mode, loss_kind, effects, base_loss, base_repeat,
                          min(per, max(1, len(heads))),
                          undefined=undefined_measures(loss_kind, base_loss, base_repeat))


def _cost(forward: TinyForward | LayerForward, hidden: torch.Tensor,
          logits: torch.Tensor | None) -> CopyCost:
    """One copy's cost: its outputs and each layer's input, kept; the largest temporary one
    head's scores (B, L, L) or a layer's W_O input (B, L, W)."""
    B, L, E = hidden.shape
    layers = forward.layers if isinstance(forward, TinyForward) else [forward.layer]
    width = max(layer.o_weight.shape[1] for layer in layers)
    kept = tensor_bytes((hidden, logits)) + len(layers) * B * L * E * 4
    return CopyCost(kept, max(B * L * (L + 1), B * L * width) * 4)


def _editor(chunk: list[tuple[int, str, AttentionLayer, int]], B: int, mode: str,
            means: dict[int, torch.Tensor]) -> Edit:
    """The edit that removes chunk[c]'s head in copy c."""
    def edit(i: int, ctx: torch.Tensor) -> None:
        for c, (index, _, layer, head) in enumerate(chunk):
            if index != i:
                continue
            cols = slice(*layer.o_cols(head))
            ctx[c * B:(c + 1) * B, :, cols] = 0.0 if mode == "zero" else means[i][cols]
    return edit
