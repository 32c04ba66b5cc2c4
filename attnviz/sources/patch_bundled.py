"""The bundled model as a `PatchModel` (attnviz.compute.patching.model): the forward
`attnviz.sources.bundled_generate` runs (embeddings of hashed word ids + learned positions;
per layer x += W_O·softmax(q·kᵀ/√d + causal mask)·v of LayerNorm(x); final LayerNorm;
unembedding), written per head so that each site (resid, q, k, v, pattern, z) is a tensor the
hook sees and replaces.

Its built-in pair: an induction prompt (a span of words, then the span again up to its last
word), whose answer is the span's next word; the corrupted prompt changes the first span's
word before the answer, so the repeat no longer tells what comes next. The wrong answer of the
logit difference is the span's word after the answer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnviz.compute.forward_pass.forward import load_weights
from attnviz.compute.patching.pairs import PromptPair
from attnviz.core.words import hashed_ids, split_words
from attnviz.errors import CheckpointError, UsageError
from attnviz.load.store import TensorStore
from attnviz.recognize.base import metadata_int
from attnviz.sources import bundled

# span: "river cat stone window forest money"; the corrupted span breaks "stone → window"
BUILT_IN = PromptPair("river cat stone window forest money music river cat stone",
                      "river cat bird window forest money music river cat stone",
                      "window", "forest")


class WordTokenizer:
    """The bundled model's tokenizer: lower-cased words and punctuation, hashed to ids."""

    def __init__(self, vocab: int, limit: int) -> None:
        self.vocab, self.limit = vocab, limit

    def prompt(self, text: str) -> tuple[list[int], list[str]]:
        words = split_words(text)
        if len(words) > self.limit:
            raise UsageError(f"the prompt is {len(words)} words, more than the bundled model's "
                             f"{self.limit} positions", fix="shorten it")
        return hashed_ids(words, self.vocab), words

    def piece(self, text: str) -> tuple[list[int], list[str]]:
        return self.prompt(text)


class BundledPatchModel:
    """The bundled model's forward with a hook at every site."""

    name = "the bundled model (attnviz-tiny)"
    sites: tuple[str, ...] = ("resid", "q", "k", "v", "pattern", "z")

    def __init__(self, store: TensorStore, device: torch.device) -> None:
        self.store, self.device = store, device
        vocab = metadata_int(store, "vocab_size")
        if vocab is None:
            raise CheckpointError("the model's metadata lacks vocab_size", where=store.source)
        self.layers = bundled.tiny_layers(store)
        bundled.check_shapes(store, self.layers)
        self.weights = [load_weights(layer, store, device=str(device)) for layer in self.layers]
        self.param = {name: store.read(name).float().to(device) for name in store.keys()
                      if not name.startswith("layers.") or ".ln." in name}
        first = self.layers[0]
        assert first.num_heads is not None and first.num_kv_heads is not None
        self.n_layers, self.n_heads, self.n_kv_heads = \
            len(self.layers), first.num_heads, first.num_kv_heads
        self.head_dim = first.head_dim or self.param["embed.weight"].shape[1] // self.n_heads
        limit = bundled.token_limit(store).tokens
        self.tokenizer = WordTokenizer(vocab, limit)
        self.position_limit = limit  # learned positions: a continuation counts too
        self.notes: list[str] = []
        self.layer_labels = [f"L{i}" for i in range(self.n_layers)]
        self.shares_prefix = True

    def row_bytes(self, length: int) -> int:
        E = self.param["embed.weight"].shape[1]
        return 4 * length * (8 * E + 3 * self.n_heads * length) + 4 * 1024

    def forward(self, ids: torch.Tensor, real: torch.Tensor, read: torch.Tensor,
                hook: object = None) -> torch.Tensor:
        """(N, K, V) logits at `read` (N, K)."""
        def at(site: str, layer: int, x: torch.Tensor) -> torch.Tensor:
            return x if hook is None else hook(site, layer, x)  # type: ignore[operator]

        p, (N, L) = self.param, ids.shape
        H, Hkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        x = p["embed.weight"][ids] + p["pos_embed.weight"][:L][None]  # (N, L, E)
        causal = torch.ones(L, L, dtype=torch.bool, device=ids.device).tril()
        allowed = causal[None, None] & real[:, None, None, :]  # (N, 1, L, L)
        for i, (layer, w) in enumerate(zip(self.layers, self.weights, strict=True)):
            x = at("resid", i, x)
            N = x.shape[0]  # the hook may have made copies of a one-row batch
            h = F.layer_norm(x, (x.shape[-1],), p[f"layers.{i}.ln.weight"],
                             p[f"layers.{i}.ln.bias"], eps=1e-5)
            q = at("q", i, F.linear(h, w.W_q, w.b_q).view(N, L, H, d))  # (N, L, H, d)
            k = at("k", i, F.linear(h, w.W_k, w.b_k).view(N, L, Hkv, d))
            v = at("v", i, F.linear(h, w.W_v, w.b_v).view(N, L, Hkv, d))
            group = H // Hkv
            kh = k.repeat_interleave(group, dim=2).transpose(1, 2)  # (N, H, L, d)
            vh = v.repeat_interleave(group, dim=2).transpose(1, 2)
            scores = q.transpose(1, 2) @ kh.transpose(-1, -2) * layer.effective_scale
            scores = scores.masked_fill(~allowed, float("-inf"))  # (N, H, L, L)
            pattern = at("pattern", i, torch.softmax(scores, dim=-1).nan_to_num(0.0))
            z = at("z", i, (pattern @ vh).transpose(1, 2))  # (N, L, H, d)
            x = x + F.linear(z.reshape(N, L, H * d), w.W_o, w.b_o)
        final = F.layer_norm(x, (x.shape[-1],), p["ln_f.weight"], p["ln_f.bias"], eps=1e-5)
        picked = final.gather(1, read[..., None].expand(-1, -1, final.shape[-1]))  # (N, K, E)
        return picked @ p["unembed.weight"].T


def open_bundled_patch(device: torch.device) -> BundledPatchModel:
    """The bundled model, ready to patch."""
    return BundledPatchModel(bundled.open_bundled(), device)
