"""Where a Hugging Face decoder's residual stream is written: its list of decoder layers, its
final norm, and in each layer the modules whose outputs are added to the residual — the
attention module (the owner of W_O, found as attnviz recognizes the layer, as the scorecard
finds it), an encoder-decoder's cross-attention, the MLP — and Gemma-2/OLMo-2's norms between
a branch and the residual. Names are data (FINAL_NORMS, MLP_NAMES, SANDWICH); whether the
modules found really add up to the residual is checked on every run
(`compute.logit.residual_parts_data.check_parts`), never assumed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from attnviz.errors import CheckpointError, printable
from attnviz.sources.hf.load import OpenedModel

FINAL_NORMS = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "norm_f", "layer_norm")
# in order of preference: an MLP module, else its output projection (OPT's fc2 in the layer)
MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "ffn", "DenseReluDense", "fc2")
SANDWICH = ("post_attention_layernorm", "post_feedforward_layernorm")  # Gemma-2, OLMo-2


@dataclass(frozen=True)
class Branch:
    """One attention branch of a layer: its module, W_O's module and each head's columns of
    W_O's input; `writer` is what adds it to the residual (the module, or a post-norm)."""

    attention: Any
    o_proj: Any
    o_name: str
    cols: list[tuple[int, int]]
    writer: Any
    post_norm: Any | None


@dataclass(frozen=True)
class Layer:
    attn: Branch
    cross: Branch | None  # an encoder-decoder's decoder layer: attention over the encoder
    mlp_writer: Any | None


@dataclass(frozen=True)
class Anatomy:
    blocks_name: str
    blocks: Any  # the ModuleList of layers
    norm_name: str
    norm: Any  # the final norm module
    layers: list[Layer]


def find_anatomy(model: Any, opened: OpenedModel, stack: Any, count: int | None) -> Anatomy:
    """The anatomy of `stack` (the model, or an encoder-decoder's decoder) inside `model`;
    `count`: its layers, as config.json says."""
    from attnviz.recognize import find_layers
    from attnviz.recognize.match import role_of
    from attnviz.sources.hf.verify import module_of, parameter_of

    prefix = next(name for name, module in model.named_modules() if module is stack)
    blocks_name, blocks = _layer_list(stack, prefix, count)
    norm_name, norm = _final_norm(stack, prefix, blocks_name)
    owned: dict[int, dict[str, Branch]] = {}
    params = dict(model.named_parameters())
    for layer in find_layers(opened.store).layers:
        try:
            o_name, _ = parameter_of(model, layer.o_weight.key)
        except CheckpointError:
            continue
        index = _index(o_name, blocks_name)
        if index is None or o_name not in params:
            continue
        module_name, o_proj = module_of(model, o_name)
        attention = model.get_submodule(module_name.rsplit(".", 1)[0])
        H = layer.num_heads or 0
        role = "cross" if role_of(layer.name) == "cross" else "attn"
        owned.setdefault(index, {})[role] = Branch(
            attention, o_proj, module_name, [layer.o_cols(h) for h in range(H)], attention,
            None)
    layers = []
    for index, block in enumerate(blocks):
        found = owned.get(index, {})
        if "attn" not in found:
            raise CheckpointError(f"attnviz does not recognize the output projection W_O of "
                                  f"decoder layer {index}, which direct logit attribution "
                                  "needs", fix="'attnviz inspect' shows which layers attnviz "
                                  "recognizes")
        layers.append(_layer(block, found["attn"], found.get("cross")))
    return Anatomy(blocks_name, blocks, norm_name, norm, layers)


def _layer(block: Any, attn: Branch, cross: Branch | None) -> Layer:
    children = dict(block.named_children())
    if all(name in children for name in SANDWICH):  # a norm between branch and residual
        post, after = children[SANDWICH[0]], children[SANDWICH[1]]
        return Layer(Branch(attn.attention, attn.o_proj, attn.o_name, attn.cols, post, post),
                     cross, after)
    named = dict(block.named_modules())
    mlp = next((named[n] for wanted in MLP_NAMES for n in named
                if n.rsplit(".", 1)[-1] == wanted), None)
    return Layer(attn, cross, mlp)


def _index(name: str, blocks_name: str) -> int | None:
    """The layer number of a parameter under `blocks_name`, else None."""
    if not name.startswith(blocks_name + "."):
        return None
    head = name[len(blocks_name) + 1:].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _layer_list(stack: Any, prefix: str, count: int | None) -> tuple[str, Any]:
    """The outermost ModuleList of the stack `count` long: its layers."""
    for name, module in stack.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count and count:
            return (f"{prefix}.{name}" if prefix else name), module
    raise CheckpointError("attnviz finds no list of decoder layers in the model",
                          fix="report this model to attnviz")


def _final_norm(stack: Any, prefix: str, blocks: str) -> tuple[str, Any]:
    """The one final norm: a module of the stack named as FINAL_NORMS says, outside its
    layers."""
    found = []
    for name, module in stack.named_modules():
        full = f"{prefix}.{name}" if prefix else name
        if name.rsplit(".", 1)[-1] in FINAL_NORMS and not full.startswith(blocks + "."):
            found.append((full, module))
    if not found:
        raise CheckpointError("the model has no final norm after its last layer: a post-norm "
                              "model (BART, Marian) normalizes the residual inside each layer, "
                              "so no direct attribution adds up there, and its last layer's "
                              "output is already normalized", fix="use a pre-norm model "
                              "(GPT-2, LLaMA, NeoX, T5, mBART, ...)")
    if len(found) != 1:
        raise CheckpointError(f"attnviz finds {len(found)} final norms in the model "
                              f"({', '.join(printable(n) for n, _ in found)})",
                              fix="report this model to attnviz")
    return found[0]
