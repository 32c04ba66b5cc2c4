"""The heatmap source for a Hugging Face model (`--model`): its own forward pass, captured.

check: config.json, the tokenizer and the encoded inputs, every limit and the panel count (as
config.json counts the layers) checked before the weights load. run: the weights, the run's
plan, the capture (a long input's --export written block by block as the model computes), and
the causal scorecard when asked. A figure costs no extra forward: where config.json does not
count the layers, the use case checks the panels on the run's own layers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from attnviz.app.heatmap_sources import (
    Checked,
    Ran,
    check_panels,
    check_sentence,
    request_sentences,
)
from attnviz.core.request import HeatmapRequest
from attnviz.errors import UsageError, option

if TYPE_CHECKING:
    from attnviz.sources.hf.inputs import Encoded
    from attnviz.sources.hf.load import OpenedModel


@dataclass
class ModelPlan:
    """A model opened (config, tokenizer; no weights yet) and its inputs encoded."""

    sentences: list[str]
    opened: OpenedModel
    encoded: Encoded


class HfModel:
    """A Hugging Face model folder or cached hub id (`source.model`); never downloads."""

    def check(self, request: HeatmapRequest) -> Checked[ModelPlan]:
        from attnviz.sources.hf.inputs import encode
        from attnviz.sources.hf.layers import expected_shown
        from attnviz.sources.hf.load import check_load_options
        from attnviz.sources.registry import open_model_source

        sentences = request_sentences(request, None)  # the model's own tokenizer decides
        if not sentences:
            raise UsageError("no sentence given",
                             fix=f"pass one or more sentences, or {option('file')} FILE")
        limits, source = request.limits, request.source
        if len(sentences) > limits.max_sentences:  # as make_batch says it for the others
            raise UsageError(f"{len(sentences)} sentences exceed {option('max_sentences')} "
                             f"{limits.max_sentences}",
                             fix=f"raise {option('max_sentences')} or pass fewer")
        check_sentence(request, len(sentences))
        check_load_options(source.device, source.dtype, source.device_map, source.max_memory)
        assert source.model is not None  # the table picks this source for a model only
        opened = open_model_source(source)  # the folder through the one registry
        targets = _targets(request)
        encoded = encode(opened, sentences, targets, limits.max_tokens)
        shown = expected_shown(opened, request.selection.layer, targets is not None)
        return Checked(len(sentences), shown, ModelPlan(sentences, opened, encoded))

    def run(self, request: HeatmapRequest, checked: Checked[ModelPlan],
            report: Callable[[str], None]) -> Ran:
        from attnviz.app.export import run_model_exporting
        from attnviz.sources.hf.layers import ModelRun, RunInputs, plan_run
        from attnviz.sources.hf.load import load_weights
        from attnviz.sources.hf.run import run_plan

        state, source, limits = checked.state, request.source, request.limits
        values, ablate = request.measure.weighting == "norm", request.measure.ablate
        report(f"loading the model and running it on {_count(len(state.sentences))}")
        loaded = load_weights(state.opened, source.device, source.dtype, source.device_map,
                              source.max_memory)
        query = None if request.selection.query is None else (
            request.selection.sentence - 1, request.selection.query)
        how = ModelRun(not request.outputs.full_maps, query, limits.memory_budget, values,
                       need_layers=ablate is not None, views=request.outputs.views)
        text = RunInputs(state.sentences, _targets(request), limits.max_tokens, state.encoded)
        plan = plan_run(loaded, text, request.selection.layer, how)
        panels = None
        if plan.shown is not None and checked.panels is None:
            # numbered only now (a long input), config.json could not say: before the run
            panels = (len(plan.shown), max(shown.num_heads or 0 for shown in plan.shown))
            check_panels(request, checked.sentences, *panels)
        export = request.outputs.export
        if export is not None and not values:
            exported = run_model_exporting(loaded, plan, export)
            if exported is not None:
                return Ran(exported, panels=panels)
        attention_run = run_plan(loaded, plan)
        if ablate is None:
            return Ran(attention_run, panels=panels)
        from attnviz.app.ablate import ablate_hf

        return Ran(attention_run, ablate_hf(loaded, plan, attention_run, ablate,
                                            request.selection.head, report), panels)


def _targets(request: HeatmapRequest) -> list[str] | None:
    targets = request.inputs.targets
    return None if targets is None else list(targets)


def _count(n: int) -> str:
    return f"{n} sentence{'' if n == 1 else 's'}"
