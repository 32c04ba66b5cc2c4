"""Does attnviz's split of a layer give, head by head, what the model's own forward computes?

`check_heads(model, store, layer, inputs, scalings, family)`: q_h from attnviz's W_q rows on the
projection's captured input equals the model's query of head h, and k likewise for the kv head
attnviz pairs it with. The model's side comes from its attention call through
`attnviz.sources.hf.capture` (keep_qk) or, for models outside the attention interface, from the
module's own head-splitting method on its projection output. Rotary embeddings are compared at
position 0, where they rotate nothing; q/k norms inside the module are applied as the module
applies them; q is compared after each side's scaling (OPT scales q before the interface).
Shared by tests/test_zoo_support.py and tests/test_discover.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from attnviz.core.layer import AttentionLayer
from attnviz.sources.hf import capture as cap
from attnviz.sources.hf import capture_eager

ATOL, RTOL = 1e-4, 1e-5
# Families outside the attention interface whose module splits its projection's output into heads
# inline, as x.view(B, L, -1, d).transpose(1, 2), d being its attention_head_size or head_dim.
VIEW_TRANSPOSE = {"mpnet", "roformer", "megatron_bert", "big_bird", "xlm", "xglm"}


@contextlib.contextmanager
def interface_scalings() -> Iterator[dict[str, float | None]]:
    """The `scaling` each module passes to the attention interface, by module name."""
    seen: dict[str, float | None] = {}
    attend = capture_eager.Session.attend

    def spy(self: Any, module: Any, query: Any, key: Any, value: Any, mask: Any, args: tuple,
            kwargs: dict) -> Any:
        seen.setdefault(self.names.get(id(module), ""), kwargs.get("scaling"))
        return attend(self, module, query, key, value, mask, args, kwargs)

    capture_eager.Session.attend = spy  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        capture_eager.Session.attend = attend  # type: ignore[method-assign]


def owner(model: Any, stored: torch.Tensor) -> str:
    """The module whose weight is this checkpoint tensor (names may differ: transformers renames
    some parameters when it saves)."""
    found = [name for name, module in model.named_modules()
             if isinstance(getattr(module, "weight", None), torch.Tensor)
             and module.weight.shape == stored.shape and torch.equal(module.weight, stored)]
    assert len(found) == 1, found
    return found[0]


class Inputs:
    """The inputs of the modules holding W_q and W_k during one forward."""

    def __init__(self, model: Any, names: dict[str, str]) -> None:
        self.seen: dict[str, torch.Tensor] = {}
        self.outputs: dict[str, torch.Tensor] = {}
        self.handles = []
        for part, name in names.items():
            module = model.get_submodule(name)
            self.handles.append(module.register_forward_hook(self._hook(part)))

    def _hook(self, part: str) -> Any:
        def hook(module: Any, args: tuple, output: Any) -> None:
            if part not in self.seen:  # ALBERT calls its shared module once per layer
                self.seen[part] = args[0].detach()
                self.outputs[part] = output.detach()
        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def model_heads(model: Any, family: str, attention: str, result: cap.CaptureResult | None,
                seen: Inputs, layer: AttentionLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own per-head query (B, H, L, d) and key (B, H_kv or H, S, d)."""
    if result is not None:  # the attention interface: what the module passed to it
        call = next(c for c in result.layers if c.name == attention)
        assert call.query is not None and call.key is not None
        return call.query, call.key
    module = model.get_submodule(attention)
    q_out, k_out = seen.outputs["q"], seen.outputs["k"]
    if family == "bloom":
        q, k, _ = module._reshape(q_out)  # (B, H, L, d)
        return q, k
    if family == "falcon":
        q, k, _ = module._split_heads(q_out)  # (B, L, H, d), k broadcast to the query heads
        return q.transpose(1, 2), k.transpose(1, 2)
    if family == "gpt_neo":
        return (module._split_heads(q_out, module.num_heads, module.head_dim),
                module._split_heads(k_out, module.num_heads, module.head_dim))
    if family == "deberta_v2":
        H = module.num_attention_heads
        q, k = (module.transpose_for_scores(t, H) for t in (q_out, k_out))  # (B·H, L, d)
        return q.view(-1, H, *q.shape[1:]), k.view(-1, H, *k.shape[1:])
    if family in VIEW_TRANSPOSE:  # e.g. MPNet: self.q(x).view(B, L, -1, d).transpose(1, 2)
        d = next(getattr(module, name) for name in ("attention_head_size", "head_dim")
                 if hasattr(module, name))
        q, k = (t.view(*t.shape[:2], -1, d).transpose(1, 2) for t in (q_out, k_out))
        return q, k
    raise AssertionError(f"no way to read {family}'s heads")


def normed(module: Any, t: torch.Tensor, names: tuple[str, ...], heads: int) -> torch.Tensor:
    """t (B, L, H·d) through the module's q/k norm, if it has one: per head or whole."""
    norm = next((getattr(module, n) for n in names if getattr(module, n, None) is not None), None)
    if norm is None or not hasattr(norm, "weight"):
        return t
    if norm.weight.numel() == t.shape[-1]:
        return norm(t)
    return norm(t.view(*t.shape[:2], heads, -1)).flatten(2)


def check_heads(model: Any, store: Any, layer: AttentionLayer, weights: Any,
                inputs: dict[str, torch.Tensor], family: str) -> None:
    """Compare every head of `layer` (split by attnviz into `weights`) with the model's own
    forward on `inputs`; raises AssertionError where they differ."""
    names = {"q": owner(model, store.read(layer.q_weight.key)),
             "k": owner(model, store.read(layer.k_weight.key))}
    seen = Inputs(model, names)
    try:
        with interface_scalings() as scalings:
            if cap.uses_interface(model):
                result = cap.capture(model, inputs, keep_qk=True)
                attention = next(c.name for c in result.layers
                                 if names["q"].startswith(c.name + "."))
            else:
                with torch.no_grad():
                    model(**inputs)
                result = None
                attention = next(name for name, module in model.named_modules()
                                 if names["q"].startswith(name + ".")
                                 and "Attention" in type(module).__name__
                                 and not any("Attention" in type(c).__name__
                                             for c in module.children()))
    finally:
        seen.close()
    q_model, k_model = model_heads(model, family, attention, result, seen, layer)
    module = model.get_submodule(attention)
    H, d, w = layer.num_heads, layer.head_dim, weights
    assert H is not None and d is not None and q_model.shape[1] == H
    # every head's projection from attnviz's rows alone, then the module's own norms
    q_all = normed(module, torch.cat([_rows(seen.seen["q"], w.W_q, w.b_q, layer.q_rows(h))
                                      for h in range(H)], -1), ("q_norm", "q_layernorm"), H)
    kv_heads = layer.num_kv_heads or H
    k_all = normed(module, torch.cat([_rows(seen.seen["k"], w.W_k, w.b_k, layer.kv_rows(g))
                                      for g in range(kv_heads)], -1), ("k_norm", "k_layernorm"),
                   kv_heads)
    rows = slice(0, 1) if layer.positions.startswith("rope") else slice(None)
    if result is not None:  # scores = scaling · q·kᵀ on both sides
        scaling = scalings[attention]
        q_model = q_model * (d ** -0.5 if scaling is None else scaling)
        q_all = q_all * layer.effective_scale
    for h in range(H):
        torch.testing.assert_close(q_all[..., h * d:(h + 1) * d][:, rows], q_model[:, h, rows],
                                   atol=ATOL, rtol=RTOL)
        g = layer.kv_head_of(h)
        theirs_k = k_model[:, g if k_model.shape[1] == kv_heads else h]
        torch.testing.assert_close(k_all[..., g * d:(g + 1) * d][:, rows], theirs_k[:, rows],
                                   atol=ATOL, rtol=RTOL)


def _rows(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None,
          rows: tuple[int, int]) -> torch.Tensor:
    span = slice(*rows)
    return F.linear(x, W[span], None if b is None else b[span])  # (B, L, d)
