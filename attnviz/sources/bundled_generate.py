"""The bundled model continues a text: it is a trained next-token model (an attention-only
transformer whose unembedding maps the final LayerNorm's output to logits over its 1,024 hashed
word ids, see sample_weights/train_induction.py), so greedy decoding (or sampling) continues a
sentence with the ids its induction heads copy.

Each step runs the model over the whole sequence so far (it has no KV cache) and takes the next
id from the logits at the last real token. The maps are then one forward over prompt + generated
ids: the model is causal, so row i is exactly the row computed when token i was fed in. A
generated id names the prompt word that hashes to it; an id that is no prompt word is `<id N>`,
as an id without a token is everywhere.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from attnviz.compute.forward_pass.attention import layer_attention
from attnviz.compute.forward_pass.forward import load_weights
from attnviz.compute.forward_pass.inputs import Batch, length_problem
from attnviz.compute.forward_pass.results import AttentionRun, LayerAttention, standalone_layer
from attnviz.core.request import GenerateSpec
from attnviz.core.words import hashed_ids
from attnviz.errors import CheckpointError, UsageError
from attnviz.load.store import TensorStore
from attnviz.recognize.base import metadata_int
from attnviz.sources import bundled
from attnviz.sources.generate_spec import Generation, unnamed

METHOD = ("greedy decoding over the bundled model's own logits (final LayerNorm, unembedding), "
          "the whole sequence run at each step; maps from one causal forward over prompt + "
          "generated ids")


def continue_text(store: TensorStore, batch: Batch, spec: GenerateSpec,
                  layer_indices: list[int] | None, device: torch.device
                  ) -> tuple[AttentionRun, Generation]:
    """The run over prompt + generated tokens, and what was generated."""
    spec.check()
    vocab = metadata_int(store, "vocab_size")
    if vocab is None:
        raise CheckpointError("the model's metadata lacks vocab_size", where=store.source)
    limit = bundled.token_limit(store, "the bundled model")
    for b, tokens in enumerate(batch.tokens):
        problem = length_problem(f"sentence {b + 1} with {spec.max_new} generated tokens",
                                 len(tokens) + spec.max_new, None, limit)
        if problem is not None:
            raise UsageError(problem[0], fix=problem[1])
    model = _Model(store, device)
    generated, names = [], []
    for tokens in batch.tokens:
        ids = hashed_ids(tokens, vocab)
        words = {i: w for i, w in zip(ids, tokens, strict=True)}
        made = _generate(model, ids, spec)
        generated.append(made)
        names.append([words.get(i, unnamed(i)) for i in made])
    full = Batch(batch.sentences, [t + n for t, n in zip(batch.tokens, names, strict=True)])
    all_ids = [hashed_ids(t, vocab) + g for t, g in zip(batch.tokens, generated, strict=True)]
    run = model.run(full, all_ids, layer_indices)
    method = METHOD.replace("greedy decoding", "sampling") if spec.sample else METHOD
    run = replace(run, notes=(*run.notes, f"generation: {method}"))
    prompts = [hashed_ids(t, vocab) for t in batch.tokens]
    return run, Generation(prompts, generated, names, [" ".join(n) for n in names],
                           [len(t) for t in batch.tokens], spec, method)


def _generate(model: _Model, ids: list[int], spec: GenerateSpec) -> list[int]:
    """Up to spec.max_new ids after `ids` (one sentence, no padding)."""
    generator = torch.Generator().manual_seed(spec.seed)
    sequence = list(ids)
    for _ in range(spec.max_new):
        logits = model.logits(torch.tensor([sequence], device=model.device))[0, -1]  # (V,)
        sequence.append(pick(logits, spec, generator))
    return sequence[len(ids):]


def pick(logits: torch.Tensor, spec: GenerateSpec, generator: torch.Generator) -> int:
    """The next id: the most likely, or one drawn from softmax(logits / T) within top-p."""
    if not spec.sample:
        return int(logits.argmax())
    probs = torch.softmax(logits.double().cpu() / spec.temperature, dim=-1)
    ordered, order = probs.sort(descending=True)
    keep = ordered.cumsum(0) - ordered < spec.top_p  # the smallest set holding top_p
    kept = torch.zeros_like(probs)
    kept[order[keep]] = ordered[keep]
    return int(torch.multinomial(kept / kept.sum(), 1, generator=generator))


class _Model:
    """The bundled model's forward, as `bundled.run_tiny` computes it, with its logits."""

    def __init__(self, store: TensorStore, device: torch.device) -> None:
        self.store, self.device = store, device
        self.layers = bundled.tiny_layers(store)
        self.weights = [load_weights(layer, store, device=str(device)) for layer in self.layers]

    def param(self, name: str) -> torch.Tensor:
        return self.store.read(name).float().to(self.device)

    def forward(self, ids: torch.Tensor, pad: torch.Tensor, keep: set[int] | None = None
                ) -> tuple[torch.Tensor, list[LayerAttention]]:
        """(final residual (B, L, E), captured layers) for ids (B, L), padding `pad` (B, L)."""
        x = self.param("embed.weight")[ids] + self.param("pos_embed.weight")[:ids.shape[1]][None]
        captured = []
        with torch.no_grad():
            for i, (layer, weights) in enumerate(zip(self.layers, self.weights, strict=True)):
                h = F.layer_norm(x, (x.shape[-1],), self.param(f"layers.{i}.ln.weight"),
                                 self.param(f"layers.{i}.ln.bias"), eps=1e-5)
                out, attn, method = layer_attention(layer, weights, (h, h, h), pad, causal=True)
                if keep is not None and i in keep:
                    captured.append(standalone_layer(i, layer, attn.float().cpu(),
                                                     h.float().cpu(), method, True))
                x = x + out
        return x, captured

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, L, V): the final LayerNorm's output times the unembedding."""
        pad = torch.zeros(ids.shape, dtype=torch.bool, device=self.device)
        x, _ = self.forward(ids, pad)
        with torch.no_grad():
            x = F.layer_norm(x, (x.shape[-1],), self.param("ln_f.weight"),
                             self.param("ln_f.bias"), eps=1e-5)
            return x @ self.param("unembed.weight").T

    def run(self, batch: Batch, ids: list[list[int]], layer_indices: list[int] | None
            ) -> AttentionRun:
        """One forward over each sentence's prompt + generated ids, right-padded."""
        from attnviz.compute.forward_pass.inputs import padding_mask

        padded = torch.zeros(len(ids), batch.max_len, dtype=torch.long)
        for b, row in enumerate(ids):
            padded[b, :len(row)] = torch.tensor(row)
        keep = set(range(len(self.layers)) if layer_indices is None else layer_indices)
        _, captured = self.forward(padded.to(self.device), padding_mask(batch).to(self.device),
                                   keep)
        described = ("the bundled model's own embeddings of hashed word ids (generated ids as "
                     "they are), plus its learned positions; each layer's input is LayerNorm "
                     "of the residual stream")
        return AttentionRun(batch, tuple(captured), self.store.source, described,
                            str(self.device), True, self.store)
