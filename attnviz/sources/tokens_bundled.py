"""The bundled model's run for `attnviz tokens`: per layer its maps and its attention block's
per-source terms, and leave-one-out over its own logits.

The forward is the bundled model's (`bundled.run_tiny`): x = embed[ids] + pos; per layer
x ← x + MHA(LN(x)), causal; written out head by head so that each head's value U^h_j =
W_O[:, cols(h)] (W_V^h LN(x_j) + b_V^h) is at hand. Erasing token j masks it as the model masks
padding (a key no query sees); a query with no key left (token 0 erased, reading itself) writes
nothing instead of NaN. The output measured is the log-probability, at the output position, of
the token the unerased model predicts there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnviz.compute.forward_pass.forward import LayerWeights, load_weights
from attnviz.compute.tokenflow.decompose import BlockTerms
from attnviz.compute.tokenflow.trace import Erasures, TokenTrace
from attnviz.core.layer import AttentionLayer
from attnviz.core.words import hashed_ids
from attnviz.errors import CheckpointError
from attnviz.load.store import TensorStore
from attnviz.recognize.base import metadata_int
from attnviz.sources import bundled

BASELINE_WORD = "<pad>"  # the bundled model has no pad id: any word hashes to some row


@dataclass
class _Captured:
    maps: torch.Tensor  # (B, H, L, L)
    values: torch.Tensor  # (B, H, L, E)
    residual: torch.Tensor  # (B, L, E) the block's input (its residual)
    output: torch.Tensor  # (B, L, E) x + attention: the block's output
    out_bias: torch.Tensor | None


class TinyModel:
    """The bundled model's weights, read once; its forward head by head."""

    def __init__(self, store: TensorStore, device: torch.device) -> None:
        self.store, self.device = store, device
        self.layers = bundled.tiny_layers(store)
        bundled.check_shapes(store, self.layers)
        vocab = metadata_int(store, "vocab_size")
        if vocab is None:
            raise CheckpointError("the model's metadata lacks vocab_size", where=store.source)
        self.vocab = vocab
        self.weights = [load_weights(layer, store, device=str(device)) for layer in self.layers]
        self.params = {name: store.read(name).float().to(device) for name in (
            "embed.weight", "pos_embed.weight", "ln_f.weight", "ln_f.bias", "unembed.weight",
            *(f"layers.{i}.ln.{p}" for i in range(len(self.layers)) for p in ("weight", "bias")))}

    def ids(self, tokens: list[str]) -> list[int]:
        return hashed_ids(tokens, self.vocab)

    def forward(self, ids: torch.Tensor, erased: torch.Tensor, keep: bool = False
                ) -> tuple[torch.Tensor, list[_Captured]]:
        """(final residual (B, L, E), per-layer captures if `keep`) for ids (B, L); `erased`
        (B, L) True at keys no query may read (padding, erased tokens)."""
        L = ids.shape[1]
        p = self.params
        x = p["embed.weight"][ids] + p["pos_embed.weight"][:L][None]  # (B, L, E)
        causal = torch.ones(L, L, dtype=torch.bool, device=self.device).triu(1)
        mask = causal[None] | erased[:, None, :]  # (B, L, L) True = masked
        captured = []
        with torch.no_grad():
            for i, (layer, w) in enumerate(zip(self.layers, self.weights, strict=True)):
                h = F.layer_norm(x, (x.shape[-1],), p[f"layers.{i}.ln.weight"],
                                 p[f"layers.{i}.ln.bias"], eps=1e-5)
                maps, values = _heads(layer, w, h, mask)  # (B, H, L, L), (B, H, L, E)
                out = torch.einsum("bhij,bhje->bie", maps, values)
                if w.b_o is not None:
                    out = out + w.b_o
                if keep:
                    captured.append(_Captured(maps, values, x, x + out, w.b_o))
                x = x + out
        return x, captured

    def log_probs(self, x: torch.Tensor) -> torch.Tensor:
        """(…, V) log-softmax of the logits from final residuals (…, E)."""
        p = self.params
        h = F.layer_norm(x, (x.shape[-1],), p["ln_f.weight"], p["ln_f.bias"], eps=1e-5)
        return torch.log_softmax(h @ p["unembed.weight"].T, dim=-1)


def _heads(layer: AttentionLayer, w: LayerWeights, h: torch.Tensor, mask: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head maps (B, H, L, L) and written values U (B, H, L, E)."""
    assert layer.num_heads is not None
    maps, values = [], []
    for head in range(layer.num_heads):
        q0, q1 = layer.q_rows(head)
        k0, k1 = layer.kv_rows(layer.kv_head_of(head))
        c0, c1 = layer.o_cols(head)
        q = F.linear(h, w.W_q[q0:q1], None if w.b_q is None else w.b_q[q0:q1])  # (B, L, d)
        k = F.linear(h, w.W_k[k0:k1], None if w.b_k is None else w.b_k[k0:k1])
        v = F.linear(h, w.W_v[k0:k1], None if w.b_v is None else w.b_v[k0:k1])
        scores = (q * layer.effective_scale) @ k.transpose(-1, -2)  # (B, L, L)
        a = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        maps.append(torch.nan_to_num(a, nan=0.0))  # a query with no key left reads nothing
        values.append(v @ w.W_o[:, c0:c1].T)  # (B, L, E)
    return torch.stack(maps, 1), torch.stack(values, 1)


def traces(model: TinyModel, sentences: list[list[str]]) -> list[TokenTrace]:
    """Each sentence's trace from one padded forward (right padding, masked as keys)."""
    ids, pad = _padded(model, sentences)
    _, captured = model.forward(ids, pad, keep=True)
    out = []
    for b, tokens in enumerate(sentences):
        n = len(tokens)
        blocks = [BlockTerms(c.maps[b, :, :n, :n].cpu(), c.values[b, :, :n].cpu(),
                             c.residual[b, :n].cpu(), None if c.out_bias is None else
                             c.out_bias.cpu(), output=c.output[b, :n].cpu())
                  for c in captured]
        out.append(TokenTrace(list(tokens), [blk.maps for blk in blocks], blocks,
                              [c.output[b, :n].cpu() for c in captured],
                              [layer.name for layer in model.layers]))
    return out


def _padded(model: TinyModel, sentences: list[list[str]]) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(t) for t in sentences)
    ids = torch.zeros(len(sentences), L, dtype=torch.long)
    pad = torch.ones(len(sentences), L, dtype=torch.bool)
    for b, tokens in enumerate(sentences):
        ids[b, :len(tokens)] = torch.tensor(model.ids(tokens))
        pad[b, :len(tokens)] = False
    return ids.to(model.device), pad.to(model.device)


def erasures(model: TinyModel, tokens: list[str], position: int, baseline: str | None,
             copies_per_pass: int) -> Erasures:
    """Leave-one-out for tokens 0..position (later ones cannot reach a causal output): one copy
    of the sentence per erased token, `copies_per_pass` copies per forward. Masking cannot erase
    the output token itself (its own query still runs, its embedding in its residual), so with
    the mask it is left out."""
    ids = torch.tensor([model.ids(tokens)], device=model.device)
    clear = torch.zeros_like(ids, dtype=torch.bool)
    x, _ = model.forward(ids, clear)
    base = model.log_probs(x[0, position])
    target = int(base.argmax())
    erased = list(range(position + 1 if baseline is not None else position))
    drops = []
    for start in range(0, len(erased), max(1, copies_per_pass)):
        chunk = erased[start:start + max(1, copies_per_pass)]
        copies = ids.repeat(len(chunk), 1)
        mask = clear.repeat(len(chunk), 1)
        for c, j in enumerate(chunk):
            if baseline is None:
                mask[c, j] = True
            else:
                copies[c, j] = model.ids([baseline])[0]
        xs, _ = model.forward(copies, mask)
        drops.append(base[target] - model.log_probs(xs[:, position])[:, target])
    how = ("masked as the model masks padding (no query reads it; the output token itself, "
           "whose query still runs, is not erased)" if baseline is None else
           f"replaced by the baseline word {baseline!r}")
    effects = torch.cat(drops).double().cpu() if drops else torch.zeros(0, dtype=torch.float64)
    return Erasures(erased, effects,
                    f"drop in log p(next token) at the output, for the token the model "
                    f"predicts there (id {target})", how, float(base[target]))


def copies_per_pass(model: TinyModel, length: int, budget: int) -> int:
    """Copies of a sentence one forward holds within `budget` bytes (maps and values of one
    layer at a time, float32)."""
    H = max(layer.num_heads or 1 for layer in model.layers)
    E = model.layers[0].embed_dim
    per_copy = 4 * (2 * H * length * length + (H + 4) * length * E)
    return max(1, budget // per_copy)
