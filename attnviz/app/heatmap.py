"""`attnviz heatmap`: the use case. A HeatmapRequest (attnviz.core.request) in, a HeatmapResult
(the run, head statistics, the selected maps, the --query breakdown) out. The request's source
kind picks the source (`attnviz.app.source_table`), which checks it before any weight is read
and runs it; the JSON document lives in `heatmap_json`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnviz.app.export import export
from attnviz.app.heatmap_json import run_json
from attnviz.app.heatmap_sources import check_panels, parse_memory_budget, request_sentences
from attnviz.app.naming import run_title
from attnviz.app.source_layers import run_on_batch
from attnviz.app.weighting import weigh_run
from attnviz.core.choices import LayerKind
from attnviz.core.request import HeatmapRequest, Selection
from attnviz.errors import (
    CheckFailed,
    CheckpointError,
    UsageError,
    option,
    printable,
    printable_path,
    quoted,
)

if TYPE_CHECKING:
    from attnviz.compute.display.views import MapView
    from attnviz.compute.forward_pass.results import AttentionRun
    from attnviz.compute.measures.ablation_measures import AblationReport
    from attnviz.compute.measures.breakdown import QueryBreakdown
    from attnviz.compute.measures.overview import Overview
    from attnviz.compute.measures.ranking import HeadRanking
    from attnviz.compute.measures.stats import HeadStats
    from attnviz.core.request import GenerateSpec
    from attnviz.sources.generate_spec import Focus, Generation

# scripts and tests reach the request and the standalone runner through this module
__all__ = ["HeatmapRequest", "HeatmapResult", "check_applicable", "check_panels",
           "parse_memory_budget", "run_heatmap", "run_json", "run_on_batch", "summarize"]


@dataclass
class HeatmapResult:
    run: AttentionRun
    head_stats: list[HeadStats]  # per (layer, head)
    views: list[MapView]  # the selected maps, per (sentence, layer, head)
    breakdown: QueryBreakdown | None = None  # for --query
    warnings: list[str] = field(default_factory=list)  # for stderr: the run went on
    ablation: AblationReport | None = None  # attnviz ablate: the causal head scorecard
    generation: Generation | None = None  # --generate: what was generated
    focus: list[Focus] = field(default_factory=list)  # --generate: each token's top keys

    def to_json(self, ranked: bool = False, overview: str | None = "label") -> dict[str, Any]:
        """The --json document; `overview` (None: left out) is what its overview shows."""
        doc = run_json(self.run, self.head_stats, self.breakdown)
        doc["weighting"] = self.run.weighting
        if self.ablation is not None:
            doc["ablation"] = [effect.to_json() for effect in self.ablation.effects]
            doc["ablation_run"] = self.ablation.to_json()
        if self.generation is not None:
            doc["generation"] = {**self.generation.to_json(),
                                 "focus": [f.to_json() for f in self.focus]}
        if overview is not None:
            doc["overview"] = self.overview(overview).to_json()
        if ranked:
            doc["ranking"] = [r.to_json() for r in self.ranking()]
            if self.generation is not None:  # what the first-ranked heads attend to
                from attnviz.app.generate import ranked_focus

                doc["generation"]["focus_by_rank"] = [
                    {"types": types, "focus": [f.to_json() for f in items]} for types, items in
                    ranked_focus(self.run, self.generation, self.ranking())]
        return doc

    def overview(self, shows: str = "label") -> Overview:
        """A row per layer, a cell per head (its type, or `shows`)."""
        from attnviz.compute.measures.overview import build_overview

        if shows == "ablation":
            from attnviz.app.ablation_view import ablation_overview

            return ablation_overview(self.head_stats, self.ablation)
        return build_overview(self.head_stats, shows)

    def ranking(self, top: int = 3) -> list[HeadRanking]:
        """A HeadRanking per head type: the `top` heads of each."""
        from attnviz.compute.measures.ranking import rank_heads

        rankings = rank_heads(self.head_stats, top)
        if self.ablation is not None:
            from attnviz.app.ablation_view import causal_ranking

            rankings.append(causal_ranking(self.ablation, top))
        return rankings

    def export(self, path: Path) -> None:
        export(self.run, path, None if self.generation is None else
               self.generation.export_metadata())

    def title(self) -> str:
        """A figure's title: the model (not a raw path) and the layers shown."""
        if self.run.weighting == "norm":
            return run_title(self.run) + " · value-weighted ‖α·W_O v‖"
        return run_title(self.run)


def check_applicable(request: HeatmapRequest) -> None:
    """A flag that does not apply to the chosen source, or to the other options given, is a
    usage error, never ignored: the table in `attnviz.core.option_rules` says which applies
    where."""
    from attnviz.core.option_rules import check_request
    from attnviz.sources.registry import source_kind

    source, selection = request.source, request.selection
    source_kind(source)  # more than one source: refused by the registry, once for every command
    check_request(request)
    if source.random is not None and selection.layer not in (None, "0", "-1", "all"):
        raise UsageError(f"{option('layer')} {printable(selection.layer, 24)!r} is not a layer "
                         "of the random layer", fix="a random nn.MultiheadAttention is one "
                         f"layer: drop {option('layer')}", option="layer")
    for what, texts in (("sentence", request.inputs.sentences),
                        ("target", request.inputs.targets or ())):
        for number, text in enumerate(texts, 1):
            check_text(text, f"{what} {number}")


def check_text(text: str, what: str) -> None:
    """Text the user passed must be text: a non-UTF-8 argument (a Latin-1 shell) arrives with
    its undecodable bytes as lone surrogates, which no tokenizer or output can carry."""
    bad = next((i for i, ch in enumerate(text) if "\ud800" <= ch <= "\udfff"), None)
    if bad is not None:
        code = ord(text[bad])
        byte = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else "a lone surrogate"
        raise UsageError(f"{what} is not UTF-8 text: {byte} at character {bad + 1} "
                         f"({printable(text, 40)})",
                         fix="pass UTF-8 text (convert it with iconv -f latin1 -t utf-8)")


def run_heatmap(request: HeatmapRequest, progress: Callable[[str], None] | None = None
                ) -> HeatmapResult:
    """The attention maps, statistics and --query breakdown a request asks for (all limits
    and flags checked before any weight is read). `progress` hears, in words, each step as it
    starts (the CLI shows them beside a spinner). A model's maps that come out non-finite, on
    any path (whole, streamed, exported, generated), name its config.json fields too."""
    from attnviz.sources.hf.config_guard import naming_config

    with naming_config(request.source.model), naming_weights(request):
        return _run_heatmap(request, progress)


@contextlib.contextmanager
def naming_weights(request: HeatmapRequest) -> Iterator[None]:
    """A --model's maps that come out non-finite name the attention tensor that holds NaN or
    Inf, when one does (a checkpoint layer's weights were refused by name before its forward:
    compute.forward_pass.forward.load_weights). The model's attention tensors are scanned only
    then, one in
    memory at a time, as `attnviz inspect --scan` does."""
    try:
        yield
    except CheckFailed as error:
        if request.source.model is None or "finite" not in error.what:
            raise
        from attnviz.app.inspect_checkpoint import scan_non_finite
        from attnviz.sources.registry import open_source

        opened = open_source(request.source)
        bad = {key: n for key, n in scan_non_finite(opened.inventory, opened.store).items() if n}
        if not bad:
            raise
        key, count = next(iter(bad.items()))
        more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        raise CheckpointError(f"tensor {quoted(key)} holds {count} non-finite values{more}, "
                              f"and the model's maps came out non-finite: {error.what}",
                              fix="repair or re-export the checkpoint", where=error.where
                              or printable_path(str(opened.folder))) from None


def _run_heatmap(request: HeatmapRequest, progress: Callable[[str], None] | None
                 ) -> HeatmapResult:
    from attnviz.app.source_table import SOURCES

    report = progress or (lambda message: None)
    if request.measure.generate is not None:
        return _generate(request, request.measure.generate, report)
    check_applicable(request)
    source = SOURCES[request.source.kind]
    checked = source.check(request)
    if checked.panels is not None:  # known before the run: refused before any work
        check_panels(request, checked.sentences, *checked.panels)
    ran = source.run(request, checked, report)
    layers = ran.run.layers
    # `heads`: the layer's own count (`num_heads` is only what a model's call reported)
    counted = (len(layers), max((layer.heads for layer in layers), default=0))
    if counted not in (checked.panels, ran.panels):  # known only now, or other than foreseen
        check_panels(request, checked.sentences, *counted)
    report("computing head statistics")
    result = summarize(ran.run, request.selection, request.measure.weighting,
                       request.outputs.views)
    result.warnings = checked.warnings
    result.ablation = ran.ablation
    return result


def _generate(request: HeatmapRequest, spec: GenerateSpec,
              report: Callable[[str], None]) -> HeatmapResult:
    """--generate (attnviz.app.generate): the maps over prompt + generated tokens, their
    statistics, and what each generated token attends to."""
    from attnviz.app.generate import focus, run_generate

    check_applicable(request)
    attention_run, generation = run_generate(
        request, spec, lambda limit: request_sentences(request, limit), report)
    report("computing head statistics")
    head = request.selection.head
    result = summarize(attention_run, replace(request.selection, query=None, sentence=1),
                       views=request.outputs.views)
    result.generation, result.focus = generation, focus(attention_run, generation, head)
    return result


def summarize(attention_run: AttentionRun, selection: Selection, weighting: str = "attention",
              views: bool = True) -> HeatmapResult:
    """Statistics, the selected maps (views: False, none) and the --query breakdown of a
    finished run (of its value-weighted maps with weighting "norm")."""
    from attnviz.compute.display import maps
    from attnviz.compute.forward_pass.attention import check_finite_maps
    from attnviz.compute.forward_pass.inputs import find_query
    from attnviz.compute.measures import stats
    from attnviz.compute.measures.breakdown import query_breakdown

    head, average, query = selection.head, selection.average, selection.query
    sentence_index = selection.sentence - 1

    for captured in attention_run.layers:
        maps.check_head(head, captured.heads)
    check_finite_maps(attention_run)
    if weighting == "norm" and attention_run.weighting != "norm":
        attention_run = weigh_run(attention_run)
    head_stats: list[HeadStats] = []
    batch = attention_run.batch
    for captured in attention_run.layers:
        if captured.weights is None:
            head_stats += [] if captured.streamed is None else captured.streamed.stats
            continue
        cross = captured.kind == LayerKind.CROSS
        found = stats.head_stats(captured.weights, captured.rows_of(batch), captured.index,
                                     key_tokens=captured.columns_of(batch) if cross else None)
        label = captured.stack_label()
        if label is not None:
            found = [replace(s, layer_label=label) for s in found]
        head_stats += found
    if head is not None:  # --head shows one head: its statistics alone, as its map
        head_stats = [s for s in head_stats if s.head == head]
    selected = maps.select_maps(attention_run, head, average) if views else []
    breakdown = None
    if query is not None:
        last = attention_run.layers[-1]
        query_index = find_query(last.rows_of(batch)[sentence_index], query)
        breakdown = query_breakdown(attention_run, last.index, sentence_index, query_index)
    return HeatmapResult(attention_run, head_stats, selected, breakdown)
