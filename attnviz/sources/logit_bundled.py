"""The bundled model decomposed for direct logit attribution and the logit lens.

Its forward is `bundled.run_tiny`'s (x = embed[ids] + pos; x += MHA_i(LN_i(x)); logits =
LN_f(x) · W_Uᵀ), with each layer's attention output taken from torch's own
nn.MultiheadAttention and each head's share computed from its value slice, its weights and its
W_O columns (z_h · W_O[:, cols(h)]ᵀ); the two are checked against each other
(`check_parts`). An attention-only model: no MLP parts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnviz.compute.forward_pass import kernel
from attnviz.compute.forward_pass.attention import layer_attention
from attnviz.compute.forward_pass.forward import (
    LayerWeights,
    head_attention,
    load_weights,
    merged_mask,
)
from attnviz.compute.logit.frozen_norm import NormParams, fit_norm
from attnviz.compute.logit.logit_run import LensRows, LogitRun, LogitTransform, Prompts
from attnviz.compute.logit.residual_parts_data import ResidualParts, check_parts
from attnviz.core.layer import AttentionLayer
from attnviz.core.words import hashed_ids, split_words
from attnviz.errors import CheckpointError, UsageError, option, quoted
from attnviz.load.store import TensorStore
from attnviz.recognize.base import metadata_int
from attnviz.sources import bundled
from attnviz.sources.generate_spec import unnamed

NAME = "the bundled model"
LN_EPS = 1e-5  # the bundled model's LayerNorms (sample_weights/train_induction.py)


class BundledLogits:
    """Tokenizing, naming and running the bundled model for `attribute` and `lens`."""

    encoder_decoder = False

    def __init__(self, store: TensorStore, device: torch.device) -> None:
        self.store, self.device = store, device
        vocab = metadata_int(store, "vocab_size")
        if vocab is None:
            raise CheckpointError("the model's metadata lacks vocab_size", where=store.source)
        self.vocab = vocab
        self.limit = bundled.token_limit(store, NAME)
        self.layers = bundled.tiny_layers(store)
        bundled.check_shapes(store, self.layers)
        self.weights = [load_weights(layer, store, device=str(device)) for layer in self.layers]
        self.names: dict[int, str] = {}

    def param(self, name: str) -> torch.Tensor:
        return self.store.read(name).float().to(self.device)

    def tokenize(self, text: str) -> tuple[list[int], list[str]]:
        """Hashed ids and the words they came from (ids are remembered as their words)."""
        words = split_words(text)
        if not words:
            raise UsageError("a prompt holds no word", fix="give a prompt with words")
        if len(words) > self.limit.tokens:
            raise UsageError(f"a prompt of {len(words)} words is longer than the bundled "
                             f"model's {self.limit.tokens} positions", fix="shorten it")
        ids = hashed_ids(words, self.vocab)
        for i, word in zip(ids, words, strict=True):
            self.names.setdefault(i, word)
        return ids, words

    def prompt(self, text: str) -> tuple[list[int], list[str]]:
        """The pairs' tokenizer (attnviz.compute.patching.pairs): words are the tokens."""
        return self.tokenize(text)

    def piece(self, text: str) -> tuple[list[int], list[str]]:
        return self.tokenize(text)

    def target(self, text: str) -> tuple[list[int], list[str]]:
        raise UsageError(f"{option('target')} applies to encoder-decoder models only",
                         option="target")

    def token_id(self, text: str, what: str) -> int:
        """The id of one word (the answer or the wrong token)."""
        words = split_words(text)
        if len(words) != 1:
            raise UsageError(f"the {what} {quoted(text)} is {len(words)} words; the bundled "
                             "model predicts one word at a time", fix="give one word",
                             option=what)
        i = hashed_ids(words, self.vocab)[0]
        self.names.setdefault(i, words[0])
        return i

    def name_of(self, token_id: int) -> str:
        return self.names.get(int(token_id), unnamed(int(token_id)))

    def run(self, given: Prompts, lens_positions: list[list[int]] | None) -> LogitRun:
        """One right-padded forward over the prompts: each one's residual parts at its
        position, the final norm frozen there, the logits, and (lens_positions) each
        layer's residual rows at those positions."""
        prompts, tokens, positions = given.ids, given.tokens, given.positions
        B, L = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(B, L, dtype=torch.long, device=self.device)
        for b, row in enumerate(prompts):
            ids[b, :len(row)] = torch.tensor(row)
        pad = torch.arange(L, device=self.device)[None] >= torch.tensor(
            [len(p) for p in prompts], device=self.device)[:, None]  # (B, L) True = padding
        at = torch.tensor(positions, device=self.device)
        rows = torch.arange(B, device=self.device)

        def pick(t: torch.Tensor) -> torch.Tensor:  # (B, L, E) -> (B, E) at each position
            return t[rows, at].cpu()  # the decomposition runs on the CPU, in float64

        with torch.no_grad():
            x = self.param("embed.weight")[ids] + self.param("pos_embed.weight")[:L][None]
            hidden, embed = [x], pick(x)
            attn, heads, biases = [], [], []
            for i, (layer, weights) in enumerate(zip(self.layers, self.weights, strict=True)):
                h = F.layer_norm(x, (x.shape[-1],), self.param(f"layers.{i}.ln.weight"),
                                 self.param(f"layers.{i}.ln.bias"), eps=LN_EPS)
                out, _, _ = layer_attention(layer, weights, (h, h, h), pad, causal=True)
                heads.append(self._heads(layer, weights, h, pad, at).cpu())
                biases.append(torch.zeros_like(embed) if weights.b_o is None
                              else weights.b_o.cpu().expand_as(embed))
                attn.append(pick(out))
                x = x + out
                hidden.append(x)
            gain, shift = self.param("ln_f.weight"), self.param("ln_f.bias")
            normed = F.layer_norm(x, (x.shape[-1],), gain, shift, eps=LN_EPS)
            unembed = self.param("unembed.weight")  # (V, E)
            logits = pick(normed) @ unembed.cpu().T  # (B, V)
            parts = ResidualParts(embed, torch.stack(attn), None, torch.stack(heads),
                                  torch.stack(biases), pick(x))
            check_parts(parts, NAME)
            norm = fit_norm(pick(x), pick(normed),
                            NormParams(gain.cpu(), shift.cpu(), LN_EPS), "the final LayerNorm")
            lens = None
            if lens_positions is not None:
                def to_logits(rows: torch.Tensor) -> torch.Tensor:  # (P, E) -> (P, V)
                    return F.layer_norm(rows, (rows.shape[-1],), gain, shift,
                                        eps=LN_EPS) @ unembed.T

                lens = LensRows([torch.stack([state[b, cols] for state in hidden])
                                 for b, cols in enumerate(lens_positions)], to_logits)
        return LogitRun(NAME, tokens, positions, parts, norm, logits, unembed.cpu(), None,
                        LogitTransform(), "ln_f", lens, lens_positions,
                        ["an attention-only model: its parts are the embeddings (token + "
                         "position) and each head's output, through W_O"],
                        dict(self.names))

    def _heads(self, layer: AttentionLayer, weights: LayerWeights, h: torch.Tensor,
               pad: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """(H, B, E) each head's z_h · W_O[:, cols(h)]ᵀ at each prompt's position."""
        mask = merged_mask(pad, kernel.causal_mask(h.shape[1], device=h.device), False)
        rows = torch.arange(h.shape[0], device=h.device)
        found = []
        for head in range(layer.num_heads or 0):
            _, _, v_h, _, a_h = head_attention(layer, weights, head, (h, h, h), mask)
            z = (a_h @ v_h)[rows, at]  # (B, d)
            c0, c1 = layer.o_cols(head)
            found.append(z @ weights.W_o[:, c0:c1].T)  # (B, E)
        return torch.stack(found)
