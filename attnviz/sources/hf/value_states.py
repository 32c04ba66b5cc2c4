"""--weighting norm on a Hugging Face model: the per-head value states its own attention call
received (captured through the attention interface, before repeat_kv) and the W_O columns
attnviz recognizes for that layer give each key's ‖W_O[:, cols(h)] v_j^{g(h)}‖
(attnviz.compute.measures.value_norms), realigned like the maps to each sentence's real keys."""

from __future__ import annotations

from dataclasses import replace

import torch

from attnviz.compute.forward_pass.forward import read_ref
from attnviz.compute.forward_pass.results import LayerAttention, ValueWeighting
from attnviz.compute.measures.value_norms import state_norms
from attnviz.core.layer import AttentionLayer
from attnviz.errors import CheckpointError, UsageError, option, printable
from attnviz.sources.hf import capture
from attnviz.sources.hf.layers import ModelLayer, Plan, cols_tokens, model_layers, offsets
from attnviz.sources.hf.load import LoadedModel


def check_values(loaded: LoadedModel) -> None:
    """Value states come from the attention interface only."""
    if loaded.path != capture.CapturePath.INTERFACE:
        raise UsageError(f"{option('weighting')} norm needs the value states the model's attention "
                         "receives, which only models using transformers' attention interface "
                         f"hand out; {type(loaded.model).__name__} returns its maps through "
                         "output_attentions", fix=f"drop {option('weighting')}", option="weighting")


def recognized_layers(loaded: LoadedModel, calls: list[ModelLayer]) -> dict[int, AttentionLayer]:
    """Call index → attnviz's description of the layer it runs: the layer whose W_q lives in
    the calling module (innermost), for every call of that module (ALBERT shares one)."""
    from attnviz.sources.hf.known_layers import attention_layers

    params = [name for name, _ in loaded.model.named_parameters()]
    found: dict[int, AttentionLayer] = {}
    for layer in attention_layers(loaded.store):
        key = layer.q_weight.key  # as hf.verify.parameter_of matches it (prefixes may differ)
        names = [key] if key in params else \
            [n for n in params if key.endswith("." + n) or n.endswith("." + key)]
        if len(names) != 1:
            continue
        q_name = names[0]
        owners = [call for call in calls if q_name.startswith(call.full_name + ".")]
        if not owners:
            continue
        longest = max(len(call.full_name) for call in owners)
        for call in owners:
            if len(call.full_name) == longest:
                found[call.index] = layer
    return found


def attach_value_norms(loaded: LoadedModel, plan: Plan, calls: list[capture.CapturedLayer],
                       shown: list[ModelLayer], results: list[LayerAttention]) -> None:
    """Each shown layer's `value_norms` (B, H, S) from its captured value states."""
    numbered = plan.layers if plan.layers is not None else \
        model_layers(loaded, plan.prepared, calls)
    described = recognized_layers(loaded, numbered)
    by_index = {call.index: call for call in calls}
    for i, (layer, result) in enumerate(zip(shown, results, strict=True)):
        call = by_index[layer.index]
        own = described.get(layer.index)
        if own is None or call.value is None or result.weights is None:
            raise CheckpointError(f"attnviz does not recognize the W_O of layer "
                                  f"{printable(layer.full_name)!r}, which {option('weighting')} "
                                  "norm needs",
                                  fix=f"drop {option('weighting')}; 'attnviz inspect' shows which "
                                  "layers attnviz recognizes")
        norms = _norms(loaded, plan, layer, own, call.value, result.weights.shape[-1])
        results[i] = replace(result, weighting=ValueWeighting(norms))


def _norms(loaded: LoadedModel, plan: Plan, layer: ModelLayer, own: AttentionLayer,
           values: torch.Tensor, width: int) -> torch.Tensor:
    H, H_kv = own.num_heads or 0, own.num_kv_heads or 0
    if values.ndim != 4 or values.shape[1] != H_kv or values.shape[-1] != own.head_dim:
        raise CheckpointError(f"the value states of {printable(layer.full_name)!r} have shape "
                              f"{tuple(values.shape)}, not (B, {H_kv}, S, {own.head_dim}) as "
                              "attnviz reads the layer", fix="report this model to attnviz")
    W_o = read_ref(loaded.store, own.o_weight).float()  # (E, H·d)
    norms = state_norms(values.float().cpu(), W_o, own.o_cols, own.kv_head_of, H)  # (B, H, S)
    key_offsets = offsets(plan, layer)[1]
    lengths = [len(t) for t in cols_tokens(plan, layer)]
    out = torch.zeros(norms.shape[0], H, width)
    for b, (start, n) in enumerate(zip(key_offsets, lengths, strict=True)):
        out[b, :, :n] = norms[b, :, start:start + n]
    return out

