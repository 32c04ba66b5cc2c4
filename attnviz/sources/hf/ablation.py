"""The causal head scorecard of a Hugging Face model, through the model's own forward pass.

The model is loaded again with its LM head where config.json's `architectures` names one
(…ForCausalLM / …LMHeadModel: next-token loss; …ForMaskedLM and an encoder-decoder's
…ForConditionalGeneration: KL of the output distributions), else the base model runs (hidden
states only). A forward pre-hook on each shown layer's output projection (the module holding
attnviz's W_O, wherever the packing stores it: Linear or GPT-2's Conv1D) removes one head per copy
of the batch: its input columns o_cols(h) zeroed, or set to their mean over the real tokens of the
unablated run. The unablated run goes first, alone: it measures what one copy costs, and the
ablated copies are stacked along the batch dimension as many per forward as `--memory-budget`
holds (attnviz.sources.copy_budget). Where exact, a copy reruns only the blocks from its head's
layer on, the blocks below returning the unablated run's outputs (sources/hf/ablation_prefix).

Interventions edit CALLS, not modules: a module can run more than once per forward (ALBERT runs
one shared attention module for every layer), so each hook counts its module's calls within a
forward and edits (or reads the mean of) only the call of the shown layer — the n-th call of
that module, n the number of earlier attention calls of the same attention module. A W_O module
that runs a different number of times than its attention module is refused, named. Each layer's
mean and mask come from the stream its W_O input runs over: an encoder layer's from the
source's real tokens, a decoder self- or cross-attention layer's from the target's (its W_O
input is per query); the measured output stays the decoder's.

The LM-head model is loaded with the same placement as the first load (--max-memory's offload,
--device-map auto), so the scorecard keeps the memory bound the run was given.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from attnviz.compute.measures.ablation_measures import (
    CAUSAL_LOSS,
    KL,
    AblationReport,
    HeadEffect,
    difference,
    hidden_change,
    kl_divergence,
    next_token_losses,
    repeat_targets,
    undefined_measures,
)
from attnviz.core.layer import AttentionLayer
from attnviz.errors import CheckpointError, option, printable
from attnviz.load.paths import library_path
from attnviz.sources.copy_budget import (
    CopyCost,
    CostMeter,
    copies_per_forward,
    release_freed_memory,
    tensor_bytes,
)
from attnviz.sources.hf import guard
from attnviz.sources.hf.ablation_prefix import Prefix, Skip
from attnviz.sources.hf.layers import ModelLayer, Plan
from attnviz.sources.hf.load import COMMON, FILES_FIX, LoadedModel, dtype_keyword, input_device
from attnviz.sources.hf.value_states import recognized_layers

MAX_COPIES = 128  # most copies of the batch in one forward (copy_budget.MAX_COPIES)
# MTModel: Marian's translation model (MarianMTModel, every Helsinki-NLP opus-mt checkpoint)
LM_SUFFIXES = {"ForCausalLM": "causal", "LMHeadModel": "causal", "ForMaskedLM": "masked",
               "ForConditionalGeneration": "seq2seq", "MTModel": "seq2seq"}


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


def _load_lm(loaded: LoadedModel) -> tuple[Any, str | None, list[str], Any]:
    """(model to run, LM kind or None, notes, the offload folder to keep while it runs)."""
    arch, kind = lm_class(loaded.config)
    if arch is None or loaded.tower is not None:
        return loaded.model, None, ["no LM head in config.json's architectures: hidden-state "
                                    "changes only"], None
    import transformers

    where = printable(str(loaded.folder))
    placement, offload = _lm_placement(loaded)
    with guard.silenced(stderr=True), \
            guard.contained("transformers cannot load the model's LM head", FILES_FIX, where):
        model, info = getattr(transformers, arch).from_pretrained(
            library_path(loaded.folder), attn_implementation="eager", output_loading_info=True,
            **{dtype_keyword(): getattr(torch, loaded.dtype)}, **placement, **COMMON)
    if info.get("missing_keys"):
        return loaded.model, None, ["the folder lacks the LM head's weights: hidden-state "
                                    "changes only"], None
    model = model.eval()
    notes = [f"LM head: {arch}"]
    if not placement:
        model = model.to(input_device(loaded.model))
    elif loaded.max_memory is not None:
        device_map = getattr(model, "hf_device_map", None) or {}
        disk = [name for name, where in device_map.items() if where == "disk"]
        what = "the whole model" if disk == [""] else \
            f"{len(disk)} module{'s' * (len(disk) != 1)}"
        notes.append(f"the LM-head model is loaded under the same {option('max_memory')}: "
                     + (f"{what} offloaded to disk" if disk else "none offloaded (it fits)"))
    return model, kind, notes, offload


def _lm_placement(loaded: LoadedModel) -> tuple[dict[str, Any], Any]:
    """from_pretrained's placement keywords for the LM-head model: the first load's (its
    --max-memory limits, a fresh offload folder; or --device-map auto), else none (moved to the
    first load's device)."""
    if loaded.max_memory is not None:
        import tempfile

        # as hf.load placed the first load: the limit on the CPU and on the device it runs on
        target = input_device(loaded.model)
        limits: dict[int | str, int] = {"cpu": loaded.max_memory}
        if target.type == "cuda":
            limits[target.index or 0] = loaded.max_memory
        offload = tempfile.TemporaryDirectory(prefix="attnviz-offload-")
        return {"device_map": "auto", "max_memory": limits, "offload_folder": offload.name}, \
            offload
    if getattr(loaded.model, "hf_device_map", None):
        return {"device_map": "auto"}, None
    return {}, None


@dataclass(frozen=True)
class _Site:
    """Where one shown layer's W_O input is edited: the `call`-th call (0 first) within one
    forward of `module`, over the stream whose real tokens `real` marks."""

    index: int  # the shown attention call's index
    name: str  # the W_O module's name, for messages
    module: Any
    call: int
    layer: AttentionLayer
    real: torch.Tensor  # (B, L) bool
    display: str  # the layer as messages name it


def _sites(model: Any, loaded: LoadedModel, plan: Plan, shown: list[ModelLayer]
           ) -> tuple[list[_Site], dict[int, int]]:
    """Each shown layer's edit site, and each W_O module's (by id) expected calls per forward."""
    from attnviz.sources.hf.verify import module_of, parameter_of

    described = recognized_layers(loaded, shown)
    every = plan.layers if plan.layers is not None else shown
    sites: list[_Site] = []
    expected: dict[int, int] = {}
    owners: dict[int, str] = {}  # W_O module → the attention module it serves
    for call in shown:
        layer = described.get(call.index)
        if layer is None:
            raise CheckpointError(f"attnviz does not recognize the W_O of layer "
                                  f"{printable(call.full_name)!r}, which the scorecard "
                                  "needs", fix=f"drop {option('ablate')}; 'attnviz inspect' "
                                  "shows which layers attnviz recognizes")
        parameter, _ = parameter_of(model, layer.o_weight.key)
        name, module = module_of(model, parameter)
        # calls of one attention module run in order; the shown call is the n-th
        number = sum(1 for c in every if c.name == call.name and c.index < call.index)
        if owners.setdefault(id(module), call.name) != call.name:
            raise CheckpointError(
                f"the output projection {printable(name)!r} serves two attention modules, "
                f"{printable(owners[id(module)])!r} and {printable(call.name)!r}: attnviz "
                "cannot tell which of its calls is which layer",
                fix=f"drop {option('ablate')}")
        expected[id(module)] = sum(1 for c in every if c.name == call.name)
        sites.append(_Site(call.index, name, module, number, layer, _stream_real(plan, call),
                           call.full_name))
    return sites, expected


def _stream_real(plan: Plan, call: ModelLayer) -> torch.Tensor:
    """(B, L) bool: the real tokens of the stream a layer's W_O input runs over — the source's
    for an encoder (or single-stack) layer, the target's for decoder self- and cross-attention
    (the W_O input is per query)."""
    return _real(plan, call.stack in ("dec", "cross") and plan.prepared.target is not None)


def _real(plan: Plan, decoder: bool) -> torch.Tensor:
    """(B, L) bool: the real tokens of the source (or, `decoder`, of the target)."""
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
    release_freed_memory()  # the heatmap run's, before the LM head and the copies take more
    model, kind, notes, offload = _load_lm(loaded)
    try:
        runner = plan.prepared.runner if kind is None else model
        decoder = plan.prepared.target is not None
        if kind == "seq2seq" and not decoder:
            runner, kind = model.get_encoder(), None
            notes.append(f"encoder-decoder model without {option('target')}: its encoder's "
                         "hidden states only")
        owner = model if runner is not plan.prepared.runner else loaded.model  # names sites
        sites, expected = _sites(owner, loaded, plan, shown)
        real = _real(plan, decoder and kind != "masked")  # the measured output's tokens
        run = _Runner(runner, plan.prepared.feed, sites, expected)
        run.prefix = Prefix(owner, {site.index: site.name for site in sites},
                            {site.index: expected[id(site.module)] == 1 for site in sites})
        ids = plan.prepared.feed.get("decoder_input_ids" if decoder else "input_ids")
        with torch.no_grad(), guard.silenced():
            effects, scored, per = _effects(run, heads, mode, plan.how.memory_budget, report,
                                            _Scored(kind, real, ids))
    finally:
        del model  # before its offload folder goes
        if offload is not None:
            offload.cleanup()
    loss_kind = CAUSAL_LOSS if kind == "causal" else None if kind is None else KL
    return AblationReport(mode, loss_kind, effects, scored.base_loss, scored.base_repeat, per,
                          notes, undefined_measures(loss_kind, scored.base_loss,
                                                    scored.base_repeat))


def _effects(run: _Runner, heads: list[tuple[int, str, int]], mode: str, budget: int | None,
             report: Callable[[str], None], scored: _Scored
             ) -> tuple[list[HeadEffect], _Scored, int]:
    """Every head's effect, `scored` filled with the unablated run, and the most copies one
    forward ran: as many as `budget` holds at the unablated run's measured cost per copy."""
    report("running the model unablated")
    means: dict[int, torch.Tensor] = {}
    hidden, logits, cost = run.unablated(means)
    scored.set_base(hidden, logits)
    per = copies_per_forward(cost, budget, run.on_cpu(), MAX_COPIES)
    run.prove(hidden, logits, min(2, per))
    effects: list[HeadEffect] = []
    most = 1
    for chunk, skip in run.chunks(heads, per):
        report(f"ablating heads {len(effects) + 1}-{len(effects) + len(chunk)} of {len(heads)}")
        hidden, logits = run.ablated(chunk, mode, means, skip=skip)
        effects += scored.effects(chunk, hidden, logits)
        most = max(most, len(chunk))
    return effects, scored, most


@dataclass
class _Scored:
    """Each ablated copy's measures against the unablated run (`set_base`)."""

    kind: str | None
    real: torch.Tensor  # (B, L) the measured output's real tokens
    ids: torch.Tensor | None
    base_hidden: torch.Tensor | None = None
    base_logits: torch.Tensor | None = None
    base_loss: float | None = None
    base_repeat: float | None = None
    repeats: torch.Tensor | None = None  # repeat_targets of the ids, computed once

    def set_base(self, hidden: torch.Tensor, logits: torch.Tensor | None) -> None:
        self.base_hidden, self.base_logits = hidden, logits
        if self.kind == "causal" and logits is not None and self.ids is not None:
            self.repeats = repeat_targets(self.ids.cpu(), self.real.cpu())
            self.base_loss, self.base_repeat = next_token_losses(
                logits, self.ids.cpu(), self.real, self.repeats)

    def effects(self, chunk: list[tuple[int, str, int]], hidden: torch.Tensor,
                logits: torch.Tensor | None) -> list[HeadEffect]:
        assert self.base_hidden is not None  # set_base first
        B, real, ids = self.base_hidden.shape[0], self.real, self.ids
        found = []
        for c, (index, label, head) in enumerate(chunk):
            part = slice(c * B, (c + 1) * B)
            loss = repeat = None
            if self.kind == "causal" and logits is not None and self.base_loss is not None \
                    and ids is not None:
                loss_c, repeat_c = next_token_losses(logits[part], ids.cpu(), real,
                                                     self.repeats)
                loss, repeat = difference(loss_c, self.base_loss), \
                    difference(repeat_c, self.base_repeat)
            elif self.kind in ("masked", "seq2seq") and logits is not None \
                    and self.base_logits is not None:
                loss = kl_divergence(self.base_logits, logits[part], real)
            found.append(HeadEffect(index, label, head,
                                    hidden_change(self.base_hidden, hidden[part], real),
                                    loss, repeat))
        return found


class _Runner:
    """The model's forward on copies of the feed, with W_O-input edits by pre-hooks that count
    their module's calls: each edit reaches one call (one layer), never every call of a shared
    module. With a `prefix`, a forward may skip the blocks below its edits."""

    def __init__(self, model: Any, feed: dict[str, torch.Tensor], sites: list[_Site],
                 expected: dict[int, int]) -> None:
        self.model, self.feed, self.sites, self.expected = model, feed, sites, expected
        self.at = {(id(site.module), site.call): site for site in sites}
        self.modules = {id(site.module): site.module for site in sites}
        self.prefix: Prefix | None = None
        self.batch = next(v for v in feed.values() if isinstance(v, torch.Tensor)).shape[0]

    def on_cpu(self) -> bool:
        parameter = next(self.model.parameters(), None)
        return parameter is None or parameter.device.type == "cpu"

    def _call(self, copies: int, edit: Callable[[_Site, torch.Tensor], torch.Tensor],
              skip: Skip | None = None) -> Any:
        """The model's own outputs on `copies` copies of the feed."""
        calls: Counter[int] = Counter()
        handles = []
        for key, module in self.modules.items():
            def hook(module: Any, args: tuple, key: int = key) -> tuple | None:
                number = calls[key]
                calls[key] += 1
                site = self.at.get((key, number))
                if site is None or not args or not isinstance(args[0], torch.Tensor):
                    return None
                return (edit(site, args[0]), *args[1:])
            handles.append(module.register_forward_pre_hook(hook))
        feed = {name: value.repeat(copies, *[1] * (value.ndim - 1))
                if isinstance(value, torch.Tensor) else value for name, value in self.feed.items()}
        skipping = self.prefix.skipping(skip, copies, self.batch) if self.prefix is not None \
            else nullcontext()
        try:
            with skipping:
                outputs = self.model(**feed, output_hidden_states=True, use_cache=False) \
                    if _accepts_cache(self.model) else \
                    self.model(**feed, output_hidden_states=True)
        finally:
            for handle in handles:
                handle.remove()
        self._check_calls(calls, skip)
        return outputs

    def _forward(self, copies: int, edit: Callable[[_Site, torch.Tensor], torch.Tensor],
                 skip: Skip | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(final hidden states, logits or None) of `copies` copies, on the CPU."""
        outputs = self._call(copies, edit, skip)
        return _final_hidden(outputs).cpu(), _logits(outputs)

    def _check_calls(self, calls: Counter[int], skip: Skip | None = None) -> None:
        """Refuse a W_O module that ran other than once per call of its attention module: its
        calls could not be matched to layers (a skipped block's do not run)."""
        for site in self.sites:
            key = id(site.module)
            expected = self.expected[key]
            if skip is not None and self.prefix is not None:
                where = self.prefix.where.get(site.index)
                if where is not None and where[0] is skip.stack and where[1] < skip.below:
                    expected = 0
            if calls[key] != expected:
                raise CheckpointError(
                    f"the output projection {printable(site.name)!r} of layer "
                    f"{printable(site.display)!r} ran {calls[key]} times in one forward pass, "
                    f"its attention module {expected}: attnviz cannot tell which "
                    "call is which layer", fix=f"drop {option('ablate')}")

    def unablated(self, means: dict[int, torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor | None, CopyCost]:
        """The unablated forward, alone: (final hidden states, logits, what a copy costs);
        `means` filled (each shown call's mean W_O input over its stream's real tokens), each
        block's output recorded where a prefix is given (`prove` it before use)."""
        def record(site: _Site, x: torch.Tensor) -> torch.Tensor:
            _check_positions(site, x)
            means[site.index] = x[site.real.to(x.device)].mean(0)
            return x
        meter = CostMeter()
        recording = self.prefix.recording() if self.prefix is not None else nullcontext()
        with meter.measuring(), recording:
            outputs = self._call(1, record)
        cost = CopyCost(tensor_bytes(outputs), meter.largest)
        hidden, logits = _final_hidden(outputs).cpu(), _logits(outputs)
        return hidden, logits, cost

    def prove(self, hidden: torch.Tensor, logits: torch.Tensor | None, copies: int) -> None:
        """Keep the prefix only where skipping reproduces the unablated run on `copies` copies
        (two where the forwards stack copies: a block output's batch dimension is then
        checked too; one where they do not, so the proof costs no more memory than they)."""
        if self.prefix is not None:
            self.prefix.confirm(lambda skip: self._forward(copies, lambda s, x: x, skip),
                                hidden, logits)

    def chunks(self, heads: list[tuple[int, str, int]], per: int
               ) -> Iterator[tuple[list[tuple[int, str, int]], Skip | None]]:
        """`heads` in forwards of at most `per` copies, each with the blocks it may skip: where
        a head's block can be skipped to, its chunk keeps to that block (skipping those below),
        else chunks run whole forwards."""
        chunk: list[tuple[int, str, int]] = []
        key: object = None
        for head in heads:
            where = self._where(head[0])
            here = None if where is None else (id(where[0]), where[1])
            if chunk and (len(chunk) == per or here != key):
                yield chunk, self._skip(chunk)
                chunk = []
            chunk.append(head)
            key = here
        if chunk:
            yield chunk, self._skip(chunk)

    def _where(self, index: int) -> tuple[Any, int] | None:
        return None if self.prefix is None else self.prefix.position(index)

    def _skip(self, chunk: list[tuple[int, str, int]]) -> Skip | None:
        wheres = [self._where(index) for index, _, _ in chunk]
        if any(where is None for where in wheres):
            return None
        below = min(where[1] for where in wheres if where is not None)
        first = wheres[0]
        return Skip(first[0], below) if first is not None and below > 0 else None

    def ablated(self, chunk: list[tuple[int, str, int]], mode: str,
                means: dict[int, torch.Tensor], with_base: bool = False,
                skip: Skip | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward of a copy per head of `chunk`, each with its head removed, after an
        unablated copy 0 `with_base`, which fills `means` (each shown call's mean W_O input
        over its stream's real tokens) as the forward reaches each call; `skip`: the blocks
        below the chunk's return the unablated run's outputs (`unablated` recorded them)."""
        B = self.batch
        offset = B if with_base else 0

        def edit(site: _Site, x: torch.Tensor) -> torch.Tensor:
            _check_positions(site, x)
            if with_base:
                means[site.index] = x[:B][site.real.to(x.device)].mean(0)
            x = x.clone()
            for c, (call, _, head) in enumerate(chunk):
                if call != site.index:
                    continue
                cols = slice(*site.layer.o_cols(head))
                rows = slice(offset + c * B, offset + (c + 1) * B)
                x[rows, ..., cols] = 0.0 if mode == "zero" else means[site.index][cols]
            return x
        return self._forward(len(chunk) + int(with_base), edit, skip)


def _check_positions(site: _Site, x: torch.Tensor) -> None:
    if x.shape[1] != site.real.shape[1]:
        raise CheckpointError(
            f"the W_O input of layer {printable(site.display)!r} has "
            f"{x.shape[1]} positions, its stream {site.real.shape[1]}",
            fix=f"drop {option('ablate')}; report this model to attnviz")


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
    # kept in the model's dtype: the measures cast to float64 themselves
    logits = getattr(outputs, "logits", None)
    return None if logits is None else logits.cpu()
