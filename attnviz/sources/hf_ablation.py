"""The causal head scorecard of a Hugging Face model, through the model's own forward pass.

The model is loaded again with its LM head where config.json's `architectures` names one
(…ForCausalLM / …LMHeadModel: next-token loss; …ForMaskedLM and an encoder-decoder's
…ForConditionalGeneration: KL of the output distributions), else the base model runs (hidden
states only). A forward pre-hook on each shown layer's output projection (the module holding
attnviz's W_O, wherever the packing stores it: Linear or GPT-2's Conv1D) removes one head per copy
of the batch: its input columns o_cols(h) zeroed, or set to their mean over the real tokens of the
unablated run. Heads are stacked along the batch dimension, many per forward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from attnviz.compute.ablation_measures import (
    CAUSAL_LOSS,
    KL,
    AblationReport,
    HeadEffect,
    hidden_change,
    kl_divergence,
    next_token_losses,
)
from attnviz.core.layer import AttentionLayer
from attnviz.errors import CheckpointError, option, printable
from attnviz.load.paths import library_path
from attnviz.sources import hf_guard
from attnviz.sources.hf.layers import ModelLayer, Plan
from attnviz.sources.hf.load import COMMON, FILES_FIX, LoadedModel, input_device
from attnviz.sources.value_states import recognized_layers

COPY_BUDGET_BYTES = 256 * 2**20  # hidden states of the stacked copies, roughly
MAX_COPIES = 128
LM_SUFFIXES = {"ForCausalLM": "causal", "LMHeadModel": "causal", "ForMaskedLM": "masked",
               "ForConditionalGeneration": "seq2seq"}


def lm_class(config: Any) -> tuple[str | None, str | None]:
    """(transformers class, kind) of the LM head config.json's `architectures` names."""
    import transformers

    for arch in getattr(config, "architectures", None) or []:
        for suffix, kind in LM_SUFFIXES.items():
            if str(arch).endswith(suffix) and hasattr(transformers, str(arch)):
                if kind == "seq2seq" and not getattr(config, "is_encoder_decoder", False):
                    continue
                return str(arch), kind
    return None, None


def _load_lm(loaded: LoadedModel) -> tuple[Any, str | None, list[str]]:
    """(model to run, LM kind or None, notes)."""
    arch, kind = lm_class(loaded.config)
    if arch is None or loaded.tower is not None:
        return loaded.model, None, ["no LM head in config.json's architectures: hidden-state "
                                    "changes only"]
    import transformers

    where = printable(str(loaded.folder))
    with hf_guard.silenced(stderr=True), \
            hf_guard.contained("transformers cannot load the model's LM head", FILES_FIX, where):
        model, info = getattr(transformers, arch).from_pretrained(
            library_path(loaded.folder), attn_implementation="eager", output_loading_info=True,
            dtype=getattr(torch, loaded.dtype), **COMMON)
    if info.get("missing_keys"):
        return loaded.model, None, ["the folder lacks the LM head's weights: hidden-state "
                                    "changes only"]
    model = model.eval().to(input_device(loaded.model))
    return model, kind, [f"LM head: {arch}"]


def _o_modules(model: Any, loaded: LoadedModel, shown: list[ModelLayer]
               ) -> dict[int, tuple[Any, AttentionLayer]]:
    """Shown call index → (the module whose input is W_O's, attnviz's layer)."""
    from attnviz.sources.hf.verify import module_of, parameter_of

    described = recognized_layers(loaded, shown)
    found = {}
    for call in shown:
        layer = described.get(call.index)
        if layer is None:
            raise CheckpointError(f"attnviz does not recognize the W_O of layer "
                                  f"{printable(call.display_name)!r}, which the scorecard "
                                  "needs", fix=f"drop {option('ablate')}; 'attnviz inspect' "
                                  "shows which layers attnviz recognizes")
        name, _ = parameter_of(model, layer.o_weight.key)
        found[call.index] = (module_of(model, name)[1], layer)
    return found


def _real(plan: Plan, decoder: bool) -> torch.Tensor:
    """(B, L) bool: the real tokens of the sequence whose outputs are measured."""
    prepared = plan.prepared
    batch = prepared.target if decoder and prepared.target is not None else prepared.batch
    starts = (prepared.target_offsets or [0] * len(batch.tokens)) if decoder \
        else prepared.offsets
    key = "decoder_input_ids" if decoder else "input_ids"
    width = prepared.feed[key].shape[1] if key in prepared.feed else batch.max_len
    real = torch.zeros(len(batch.tokens), width, dtype=torch.bool)
    for b, (start, tokens) in enumerate(zip(starts, batch.tokens, strict=True)):
        real[b, start:start + len(tokens)] = True
    return real


def ablate_model(loaded: LoadedModel, plan: Plan, shown: list[ModelLayer],
                 heads: list[tuple[int, str, int]], mode: str,
                 report: Callable[[str], None]) -> AblationReport:
    """The scorecard of `heads` (call index, label, head) of the shown layers."""
    model, kind, notes = _load_lm(loaded)
    runner = plan.prepared.runner if kind is None else model
    decoder = plan.prepared.target is not None
    if kind == "seq2seq" and not decoder:
        runner, kind = model.get_encoder(), None
        notes.append(f"encoder-decoder model without {option('target')}: its encoder's hidden "
                     "states only")
    modules = _o_modules(model if runner is not plan.prepared.runner else loaded.model,
                         loaded, shown)
    real = _real(plan, decoder and kind != "masked")
    run = _Runner(runner, plan.prepared.feed, modules, real)
    ids = plan.prepared.feed.get("decoder_input_ids" if decoder else "input_ids")
    B = real.shape[0]
    width = max(layer.embed_dim or 1 for _, layer in modules.values())
    per = max(1, min(MAX_COPIES, COPY_BUDGET_BYTES // max(1, B * real.shape[1] * width * 4 * 8)))
    effects: list[HeadEffect] = []
    with torch.no_grad(), hf_guard.silenced():
        # the unablated run is copy 0 of the first forward: the means of `mean` come from it,
        # layer by layer, before the same layer's ablated copies need them
        first = heads[:per - 1]
        report(f"ablating heads 1-{len(first)} of {len(heads)}" if first else
               "running the model unablated")
        means: dict[int, torch.Tensor] = {}
        hidden, logits = run.ablated(first, mode, means, with_base=True)
        base_hidden, base_logits = hidden[:B], None if logits is None else logits[:B]
        base_loss = base_repeat = None
        if kind == "causal" and base_logits is not None and ids is not None:
            base_loss, base_repeat = next_token_losses(base_logits, ids.cpu(), real)
        scored = _Scored(kind, base_hidden, base_logits, base_loss, base_repeat, ids, real)
        effects += scored.effects(first, hidden[B:], None if logits is None else logits[B:])
        for start in range(len(first), len(heads), per):
            chunk = heads[start:start + per]
            report(f"ablating heads {start + 1}-{start + len(chunk)} of {len(heads)}")
            hidden, logits = run.ablated(chunk, mode, means)
            effects += scored.effects(chunk, hidden, logits)
    loss_kind = CAUSAL_LOSS if kind == "causal" else None if kind is None else KL
    return AblationReport(mode, loss_kind, effects, base_loss, base_repeat, per, notes)


@dataclass
class _Scored:
    """Each ablated copy's measures against the unablated run."""

    kind: str | None
    base_hidden: torch.Tensor
    base_logits: torch.Tensor | None
    base_loss: float | None
    base_repeat: float | None
    ids: torch.Tensor | None
    real: torch.Tensor

    def effects(self, chunk: list[tuple[int, str, int]], hidden: torch.Tensor,
                logits: torch.Tensor | None) -> list[HeadEffect]:
        B, real, ids = self.base_hidden.shape[0], self.real, self.ids
        found = []
        for c, (index, label, head) in enumerate(chunk):
            part = slice(c * B, (c + 1) * B)
            loss = repeat = None
            if self.kind == "causal" and logits is not None and self.base_loss is not None \
                    and ids is not None:
                loss_c, repeat_c = next_token_losses(logits[part], ids.cpu(), real)
                loss = loss_c - self.base_loss
                repeat = None if repeat_c is None or self.base_repeat is None \
                    else repeat_c - self.base_repeat
            elif self.kind is not None and logits is not None and self.base_logits is not None:
                loss = kl_divergence(self.base_logits, logits[part], real)
            found.append(HeadEffect(index, label, head,
                                    hidden_change(self.base_hidden, hidden[part], real),
                                    loss, repeat))
        return found


class _Runner:
    """The model's forward on copies of the feed, with W_O-input edits by pre-hooks."""

    def __init__(self, model: Any, feed: dict[str, torch.Tensor],
                 modules: dict[int, tuple[Any, AttentionLayer]], real: torch.Tensor) -> None:
        self.model, self.feed, self.modules, self.real = model, feed, modules, real

    def _forward(self, copies: int, edit: Callable[[int, torch.Tensor], torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        handles = []
        for index, (module, _) in self.modules.items():
            def hook(module: Any, args: tuple, index: int = index) -> tuple | None:
                if not args or not isinstance(args[0], torch.Tensor):
                    return None
                return (edit(index, args[0]), *args[1:])
            handles.append(module.register_forward_pre_hook(hook))
        feed = {name: value.repeat(copies, *[1] * (value.ndim - 1))
                if isinstance(value, torch.Tensor) else value for name, value in self.feed.items()}
        try:
            outputs = self.model(**feed, output_hidden_states=True, use_cache=False) \
                if _accepts_cache(self.model) else self.model(**feed, output_hidden_states=True)
        finally:
            for handle in handles:
                handle.remove()
        return _final_hidden(outputs).float().cpu(), _logits(outputs)

    def ablated(self, chunk: list[tuple[int, str, int]], mode: str,
                means: dict[int, torch.Tensor], with_base: bool = False,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward of a copy per head of `chunk`, each with its head removed, after an
        unablated copy 0 `with_base`, which fills `means` (each layer's mean W_O input over
        the real tokens) as the forward reaches each layer."""
        B = next(iter(self.feed.values())).shape[0]
        offset = B if with_base else 0

        def edit(index: int, x: torch.Tensor) -> torch.Tensor:
            if with_base and x.shape[1] == self.real.shape[1]:
                means[index] = x[:B][self.real.to(x.device)].mean(0)
            x = x.clone()
            for c, (call, _, head) in enumerate(chunk):
                if call != index:
                    continue
                cols = slice(*self.modules[index][1].o_cols(head))
                rows = slice(offset + c * B, offset + (c + 1) * B)
                x[rows, ..., cols] = 0.0 if mode == "zero" else means[index][cols]
            return x
        return self._forward(len(chunk) + int(with_base), edit)


def _accepts_cache(model: Any) -> bool:
    import inspect

    return "use_cache" in inspect.signature(model.forward).parameters


def _final_hidden(outputs: Any) -> torch.Tensor:
    for name in ("decoder_hidden_states", "hidden_states"):
        states = getattr(outputs, name, None)
        if states:
            return states[-1]
    return outputs[0]


def _logits(outputs: Any) -> torch.Tensor | None:
    logits = getattr(outputs, "logits", None)
    return None if logits is None else logits.float().cpu()
