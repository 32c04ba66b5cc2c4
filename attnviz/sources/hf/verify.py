"""Finding attnviz's AttentionLayer in the loaded model, and the recompute proof."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from attnviz.core.choices import LayerKind
from attnviz.core.layer import AttentionLayer
from attnviz.core.request import DEFAULT_MAX_TOKENS
from attnviz.errors import (
    CheckFailed,
    CheckpointError,
    UsageError,
    option,
    printable,
)
from attnviz.sources.hf.layers import ModelLayer, ModelRun, Plan, RunInputs, plan_run
from attnviz.sources.hf.load import TOLERANCE, LoadedModel
from attnviz.sources.hf.run import run_plan

# --- finding attnviz's layer in the model ------------------------------------------------------

def parameter_of(model: Any, key: str) -> tuple[str, torch.nn.Parameter]:
    """The model's parameter holding checkpoint tensor `key` (prefixes such as `model.` differ
    between checkpoint keys and AutoModel's base model)."""
    params = dict(model.named_parameters())
    if key in params:
        return key, params[key]
    found = [(name, p) for name, p in params.items()
             if key.endswith("." + name) or name.endswith("." + key)]
    if len(found) != 1:
        raise CheckpointError(f"checkpoint tensor {printable(key)!r} matches {len(found)} "
                              "parameters of the loaded model",
                              fix="report this model to attnviz")
    return found[0]


def module_of(model: Any, parameter_name: str) -> tuple[str, Any]:
    """The module owning a parameter (its name without the last part)."""
    name = parameter_name.rsplit(".", 1)[0] if "." in parameter_name else ""
    return name, model.get_submodule(name)


def call_of(layers: list[ModelLayer] | None, model: Any, layer: AttentionLayer) -> ModelLayer:
    """The attention call that runs attnviz's `layer`: the call whose module holds its W_q (the
    innermost such module; its first call when the module runs several times)."""
    if layers is None:  # a plan made with need_layers numbers them; without, nothing to match
        raise CheckFailed("the run did not number the model's attention layers",
                          fix="report this")
    q_name, _ = parameter_of(model, layer.q_weight.key)
    owners = [call for call in layers if q_name.startswith(call.full_name + ".")]
    if not owners:
        raise CheckpointError(f"no attention call of the model's forward pass holds "
                              f"{printable(layer.q_weight.key)!r}",
                              fix="report this model to attnviz")
    longest = max(len(call.full_name) for call in owners)
    return next(call for call in owners if len(call.full_name) == longest)


# --- the recompute proof -----------------------------------------------------------------------

@dataclass(frozen=True)
class VerifyResult:
    layer_index: int
    layer: AttentionLayer
    per_head: list[float]  # max |Δ| per query head, over real query rows and all key columns
    tolerance: float
    positions: str  # how positions entered the recomputation
    notes: list[str] = field(default_factory=list)
    label: str = ""

    @property
    def max_diff(self) -> float:
        return max(self.per_head)

    @property
    def passed(self) -> bool:
        return self.max_diff <= self.tolerance


def recompute_supported(loaded: LoadedModel, call: ModelLayer) -> str | None:
    """Why the recompute proof cannot run on this layer, or None when it can."""
    from attnviz.compute.forward_pass.positions import SCHEMES
    from attnviz.load.config import model_type

    kind = model_type(loaded.store.config)
    if kind not in SCHEMES:
        return (f"attnviz does not recompute the positions of model_type {kind!r} (supported: "
                f"{', '.join(sorted(SCHEMES))})")
    if call.kind != LayerKind.SELF:
        return "the recompute proof covers self-attention over the source only"
    return None


def verify_layer(loaded: LoadedModel, layer: AttentionLayer, sentences: list[str], *,
                 described: AttentionLayer | None = None, plan: Plan | None = None,
                 max_tokens: int = DEFAULT_MAX_TOKENS) -> VerifyResult:
    """Recompute one layer's weights from its captured input with attnviz's slices; compare.

    `described` replaces attnviz's own description in the recomputation (tests use it to prove a
    wrong slicing fails); `plan` reuses a plan (its tokens and numbered layers).
    """
    from attnviz.compute.forward_pass.forward import load_weights
    from attnviz.compute.forward_pass.positions import positions_for, recompute_weights

    plan = plan or plan_run(loaded, RunInputs(sentences, max_tokens=max_tokens), None,
                            ModelRun(need_layers=True))
    call = call_of(plan.layers, loaded.model, layer)
    reason = recompute_supported(loaded, call)
    if reason is not None:
        raise UsageError(f"the recompute proof does not apply: {reason}",
                         fix=f"the split proof (split {option('verify')}) needs no "
                             "per-family math")
    run = run_plan(loaded, Plan(plan.prepared, plan.layers, [call]))
    captured = run.layer(call.index)
    if captured.inputs is None or captured.weights is None:
        raise CheckFailed(f"the input of {printable(call.full_name)!r} was not captured",
                          fix="report this model to attnviz")
    used = described or layer
    positions = positions_for(loaded.store.config, used, call.stack_index,
                              captured.inputs.shape[1])
    recomputed = recompute_weights(used, load_weights(used, loaded.store), captured.inputs,
                                   run.batch.lengths, positions)
    per_head = torch.zeros(recomputed.shape[1])
    for b, n in enumerate(run.batch.lengths):
        diff = (recomputed[b, :, :n] - captured.weights[b, :, :n]).abs()  # (H, n, L)
        per_head = torch.maximum(per_head, diff.flatten(1).amax(1))
    notes = []
    if positions.rope is not None and not used.positions.startswith("rope"):
        notes.append(f"attnviz describes this layer's positions as {used.positions!r}")
    return VerifyResult(call.index, used, per_head.tolist(), TOLERANCE[loaded.dtype],
                        positions.described, notes, call.label)
