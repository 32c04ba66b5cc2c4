"""Where a Hugging Face decoder's residual stream is written: its list of decoder layers, its
final norm, and in each layer the modules whose outputs are added to the residual — the
attention module (the owner of W_O, found as attnviz recognizes the layer, as the scorecard
finds it), an encoder-decoder's cross-attention, the MLP — and Gemma-2/OLMo-2's norms between
a branch and the residual. Names are data (FINAL_NORMS, MLP_NAMES, SANDWICH); a final norm no
name finds (CTRL's `transformer.layernorm`) is found on the model itself: the one norm module
that runs after the last layer and before the LM head in a one-token forward. Whether the
modules found really add up to the residual is checked on every run
(`compute.logit.residual_parts_data.check_parts`), never assumed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from attnviz.errors import CheckpointError, printable
from attnviz.sources.hf.known_layers import attention_layers
from attnviz.sources.hf.load import OpenedModel, input_device

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
    from attnviz.recognize.match import role_of
    from attnviz.sources.hf.verify import module_of, parameter_of

    prefix = next(name for name, module in model.named_modules() if module is stack)
    blocks_name, blocks = _layer_list(stack, prefix, count)
    norm_name, norm = _final_norm(model, stack, prefix, blocks_name)
    owned: dict[int, dict[str, Branch]] = {}
    params = dict(model.named_parameters())
    for layer in attention_layers(opened.store):
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


def _final_norm(model: Any, stack: Any, prefix: str, blocks: str) -> tuple[str, Any]:
    """The one final norm: a module of the stack named as FINAL_NORMS says, outside its
    layers; where no name matches, the norm module that runs after the last layer
    (`norms_after_layers`)."""
    found = []
    for name, module in stack.named_modules():
        full = f"{prefix}.{name}" if prefix else name
        if name.rsplit(".", 1)[-1] in FINAL_NORMS and not full.startswith(blocks + "."):
            found.append((full, module))
    if not found:
        found = norms_after_layers(model, stack, prefix, blocks)
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


def is_norm(module: Any) -> bool:
    """A LayerNorm or RMSNorm, torch's or a family's own (T5LayerNorm, LlamaRMSNorm, ...)."""
    name = type(module).__name__
    return isinstance(module, torch.nn.LayerNorm) or name.endswith(("LayerNorm", "RMSNorm"))


def norms_after_layers(model: Any, stack: Any, prefix: str, blocks: str
                        ) -> list[tuple[str, Any]]:
    """The stack's norm modules (outside its layers) that run after its last layer and before
    the LM head, in the order they run: hooks record one forward of one token. Registration
    order would not do: OPT registers its final norm before its layers, BART its embedding
    norm (which runs first) after them. A post-norm model (BART, Marian) has none."""
    candidates = [(f"{prefix}.{name}" if prefix else name, module)
                  for name, module in stack.named_modules()
                  if name and is_norm(module)
                  and not (f"{prefix}.{name}" if prefix else name).startswith(blocks + ".")]
    if not candidates:
        return []
    last = model.get_submodule(blocks)[-1]
    head = model.get_output_embeddings()
    events: list[int] = []  # -1: the last layer ran, -2: the head ran, i: candidate i ran
    watched = [(last, -1), *([(head, -2)] if head is not None else []),
               *((module, i) for i, (_, module) in enumerate(candidates))]
    handles = [module.register_forward_hook(
        lambda *_, mark=mark: events.append(mark)) for module, mark in watched]
    try:
        ids = torch.zeros((1, 1), dtype=torch.long, device=input_device(model))
        feed = {"input_ids": ids}
        if getattr(model.config, "is_encoder_decoder", False):
            feed["decoder_input_ids"] = ids
        with torch.no_grad():
            model(**feed)
    except Exception as error:  # noqa: BLE001 - the model's own failure, reworded
        raise CheckpointError("attnviz cannot run the model on one token to find its final "
                              f"norm: {printable(str(error), 160)}",
                              fix="report this model to attnviz") from error
    finally:
        for handle in handles:
            handle.remove()
    if -1 not in events:
        return []
    after = events[len(events) - 1 - events[::-1].index(-1) + 1:]
    if -2 in after:
        after = after[:after.index(-2)]
    ran = list(dict.fromkeys(after))  # each norm once, in the order it ran
    return [candidates[i] for i in ran]
