"""`attnviz heatmap`: the use case. A HeatmapJob (sentences, one source, what to show) in, a
HeatmapResult (the run, head statistics, the selected maps, the --query breakdown) out; the
sources themselves live in `heatmap_sources`, the JSON document in `heatmap_json`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnviz.app.ablate import ablate_hf, ablate_standalone, check_mode
from attnviz.app.export import export
from attnviz.app.heatmap_json import run_json
from attnviz.app.heatmap_sources import (
    HeatmapRequest,
    check_panels,
    open_store,
    parse_memory_budget,
    run,
    run_model,
    source_limit,
)
from attnviz.app.naming import run_title
from attnviz.app.weighting import check_weighting, weigh_run
from attnviz.compute.inputs import DEFAULT_MAX_SENTENCES, DEFAULT_MAX_TOKENS, TokenLimit
from attnviz.errors import UsageError, printable
from attnviz.recognize.base import HeadHints
from attnviz.sources.layers import RandomSpec

if TYPE_CHECKING:
    from attnviz.compute.ablation_measures import AblationReport
    from attnviz.compute.breakdown import QueryBreakdown
    from attnviz.compute.maps import MapView
    from attnviz.compute.overview import Overview
    from attnviz.compute.ranking import HeadRanking
    from attnviz.compute.results import AttentionRun
    from attnviz.compute.stats import HeadStats
    from attnviz.sources.generate_spec import Focus, GenerateSpec, Generation

# the runners, re-exported: scripts and tests reach them through this module
__all__ = ["HeatmapJob", "HeatmapRequest", "HeatmapResult", "check_applicable", "check_panels",
           "parse_memory_budget", "run", "run_heatmap", "run_json", "run_model", "summarize"]


@dataclass(frozen=True)
class HeatmapJob:
    """Everything `attnviz heatmap` was asked for: the sentences, one source (the bundled model
    unless `weights`, `model` or `random` is given) and what to show."""

    sentences: list[str]
    weights: Path | None = None
    model: str | None = None
    random: RandomSpec | None = None
    layer: str | None = None
    hints: HeadHints = HeadHints()
    causal: bool = False
    positions: str = "none"
    device: str = "auto"
    dtype: str = "float32"  # --model only
    device_map: str | None = None  # --model only
    head: int | None = None
    average: bool = False
    query: str | None = None
    sentence: int = 1  # which sentence --query refers to, 1-based
    keep_full_maps: bool = False  # --export needs every head's full map
    export_path: Path | None = None  # --export: long inputs are written block by block into it
    memory_budget: int | None = None  # bytes for attention maps (None: the default budget)
    max_tokens: int = DEFAULT_MAX_TOKENS
    max_sentences: int = DEFAULT_MAX_SENTENCES
    max_panels: int | None = None  # the figure's panel limit, when a figure is asked for
    targets: list[str] | None = None  # --model, encoder-decoder: the decoder's text per sentence
    sentence_file: Path | None = None  # --file: more sentences, one per line ('-': stdin)
    weighting: str = "attention"  # "norm": value-weighted maps (attnviz.app.weighting)
    ablate: str | None = None  # "zero" or "mean": the causal head scorecard (attnviz.app.ablate)
    generate: GenerateSpec | None = None  # --generate: continue each sentence (app.generate)


@dataclass
class HeatmapResult:
    run: AttentionRun
    head_stats: list[HeadStats]  # per (layer, head)
    views: list[MapView]  # the selected maps, per (sentence, layer, head)
    breakdown: QueryBreakdown | None = None  # for --query
    warnings: list[str] = field(default_factory=list)  # for stderr: the run went on
    ablation: AblationReport | None = None  # --ablate: the causal head scorecard
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
        return doc

    def overview(self, shows: str = "label") -> Overview:
        """A row per layer, a cell per head (its type, or `shows`)."""
        from attnviz.compute.overview import build_overview

        if shows == "ablation":
            from attnviz.app.ablation_view import ablation_overview

            return ablation_overview(self.head_stats, self.ablation)
        return build_overview(self.head_stats, shows)

    def ranking(self, top: int = 3) -> list[HeadRanking]:
        """A HeadRanking per head type: the `top` heads of each."""
        from attnviz.compute.ranking import rank_heads

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


def check_applicable(job: HeatmapJob) -> None:
    """A flag that does not apply to the chosen source is a usage error, never ignored."""
    if sum((job.random is not None, job.weights is not None, job.model is not None)) > 1:
        raise UsageError("‹random›, ‹weights› and ‹model› exclude each other", fix="choose one")
    if job.model is not None:
        ignored = [flag for flag, given in (
            ("‹causal›", job.causal), ("‹positions›", job.positions != "none"),
            ("‹num_heads›", job.hints.num_heads is not None),
            ("‹num_kv_heads›", job.hints.num_kv_heads is not None),
            ("‹head_dim›", job.hints.head_dim is not None)) if given]
        if ignored:
            raise UsageError(f"{', '.join(ignored)} do{'es' if len(ignored) == 1 else ''} not "
                             "apply to ‹model›: the model's own config decides",
                             fix=f"drop {', '.join(ignored)}")
    elif job.dtype != "float32" or job.device_map is not None:
        raise UsageError("‹dtype› and ‹device_map› apply to ‹model› only",
                         fix="drop them, or pass ‹model›")
    if job.model is None and job.weights is None and job.random is None:
        _check_bundled(job)
    if job.targets is not None and job.model is None:
        raise UsageError("‹target› applies to ‹model› (an encoder-decoder model) only",
                         fix="drop ‹target›, or pass ‹model›", option="target")
    if job.random is not None and job.layer not in (None, "0", "-1", "all"):
        raise UsageError(f"‹layer› {printable(job.layer, 24)!r} is not a layer of the random "
                         "layer", fix="a random nn.MultiheadAttention is one layer: drop ‹layer›",
                         option="layer")
    for what, texts in (("sentence", job.sentences), ("target", job.targets or [])):
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


def _check_bundled(job: HeatmapJob) -> None:
    """The bundled model fixes its own heads (2 per layer) and is small enough to run whole."""
    ignored = [flag for flag, given in (
        ("‹num_heads›", job.hints.num_heads is not None),
        ("‹num_kv_heads›", job.hints.num_kv_heads is not None),
        ("‹head_dim›", job.hints.head_dim is not None),
        ("‹memory_budget›", job.memory_budget is not None)) if given]
    if ignored:
        raise UsageError(f"{', '.join(ignored)} do{'es' if len(ignored) == 1 else ''} not apply "
                         "to the bundled model: it has its own 2 heads per layer and runs whole",
                         fix=f"drop {', '.join(ignored)}, or pass ‹weights›, ‹random› or "
                         "‹model›")


def run_heatmap(job: HeatmapJob, progress: Callable[[str], None] | None = None
                ) -> HeatmapResult:
    """The attention maps, statistics and --query breakdown a heatmap job asks for (all limits
    and flags checked before any weight is read). `progress` hears, in words, each step as it
    starts (the CLI shows them beside a spinner). A model's maps that come out non-finite, on
    any path (whole, streamed, exported, generated), name its config.json fields too."""
    from attnviz.sources.config_guard import naming_config

    with naming_config(job.model):
        return _run_heatmap(job, progress)


def _run_heatmap(job: HeatmapJob, progress: Callable[[str], None] | None) -> HeatmapResult:
    if job.generate is not None:
        return _generate_job(job, job.generate, progress)
    check_applicable(job)
    check_weighting(job.weighting)
    check_mode(job.ablate)
    report = progress or (lambda message: None)
    warnings: list[str] = []
    ablation: list[AblationReport] = []

    def after(loaded: Any, plan: Any, finished: AttentionRun) -> None:
        if job.ablate is not None:
            ablation.append(ablate_hf(loaded, plan, finished, job.ablate, job.head, report))
    if job.model is not None:  # the model's own tokenizer decides the tokens
        sentences = job.sentences + _file_sentences(job, None)
        if not sentences:
            raise UsageError("no sentence given", fix="pass one or more sentences, or ‹file› FILE")
        if len(sentences) > job.max_sentences:  # as make_batch says it for the other sources
            raise UsageError(f"{len(sentences)} sentences exceed ‹max_sentences› "
                             f"{job.max_sentences}", fix="raise ‹max_sentences› or pass fewer")
        _check_sentence(job, len(sentences))
        report(f"loading the model and running it on {_count(len(sentences), 'sentence')}")
        attention_run = run_model(
            job.model, sentences, job.layer, job.device, job.dtype, job.device_map,
            job.max_tokens, job.head is not None or job.average, job.max_panels,
            keep_full_maps=job.keep_full_maps,
            query=None if job.query is None else (job.sentence - 1, job.query),
            targets=job.targets, export_path=job.export_path, memory_budget=job.memory_budget,
            values=job.weighting == "norm", after=after if job.ablate is not None else None)
    else:
        attention_run = _run_standalone_job(job, report, warnings.append)
        if job.ablate is not None:
            ablation.append(ablate_standalone(attention_run, job.ablate, job.head, report))
    report("computing head statistics")
    result = summarize(attention_run, job.head, job.average, job.query, job.sentence - 1,
                       job.weighting)
    result.warnings = warnings
    result.ablation = ablation[0] if ablation else None
    return result


def _generate_job(job: HeatmapJob, spec: GenerateSpec,
                  progress: Callable[[str], None] | None) -> HeatmapResult:
    """--generate (attnviz.app.generate): the maps over prompt + generated tokens, their
    statistics, and what each generated token attends to."""
    from attnviz.app.generate import focus, run_generate

    check_applicable(job)
    report = progress or (lambda message: None)
    attention_run, generation = run_generate(
        job, spec, lambda limit: job.sentences + _file_sentences(job, limit), report)
    report("computing head statistics")
    result = summarize(attention_run, job.head, job.average, None, 0)
    result.generation, result.focus = generation, focus(attention_run, generation, job.head)
    return result


def _run_standalone_job(job: HeatmapJob, report: Callable[[str], None],
                        warn: Callable[[str], None]) -> AttentionRun:
    """The bundled model, a checkpoint layer or a random layer on the job's sentences: every
    limit (--max-sentences, --max-tokens, the source's own positions) checked at once, from
    the checkpoint's header, before any tensor is read."""
    from attnviz.compute.inputs import find_query, make_batch

    store = open_store(job.weights) if job.random is None else None
    limit = None if store is None else source_limit(store, job.weights)
    batch = make_batch(job.sentences + _file_sentences(job, limit), job.max_tokens,
                       job.max_sentences, limit)
    _check_sentence(job, len(batch.tokens))
    query_row = None
    if job.query is not None:  # fail before any work
        query_row = job.sentence - 1, find_query(batch.tokens[job.sentence - 1], job.query)
    report(f"running attention on {_count(len(batch.tokens), 'sentence')} "
           f"({_count(sum(batch.lengths), 'token')})")
    return run(HeatmapRequest(
        batch, job.weights, job.layer, job.random, job.hints, job.causal, job.positions,
        job.device, keep_full_maps=job.keep_full_maps, export_path=job.export_path,
        memory_budget=job.memory_budget, query_row=query_row, max_panels=job.max_panels,
        panels_per_map=1 if job.head is not None or job.average else None), warn, store)


def _file_sentences(job: HeatmapJob, limit: TokenLimit | None) -> list[str]:
    """--file's sentences, read within the job's limits (and the source's own)."""
    if job.sentence_file is None:
        return []
    from attnviz.app.sentence_file import read_sentences

    return read_sentences(job.sentence_file, job.max_tokens, job.max_sentences,
                          len(job.sentences), limit)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _check_sentence(job: HeatmapJob, count: int) -> None:
    if not 1 <= job.sentence <= count:
        raise UsageError(f"‹sentence› {job.sentence} is out of range",
                         fix=f"choose 1..{count}", option="sentence")


def summarize(attention_run: AttentionRun, head: int | None, average: bool, query: str | None,
              sentence_index: int, weighting: str = "attention") -> HeatmapResult:
    """Statistics, the selected maps and the --query breakdown of a finished run (of its
    value-weighted maps with weighting "norm")."""
    from attnviz.compute import maps
    from attnviz.compute import stats as stats_mod
    from attnviz.compute.attention import check_finite_maps
    from attnviz.compute.breakdown import query_breakdown
    from attnviz.compute.inputs import find_query

    for captured in attention_run.layers:
        maps.check_head(head, captured.heads)
    check_finite_maps(attention_run)
    if weighting == "norm" and attention_run.weighting != "norm":
        weigh_run(attention_run)
    head_stats: list[HeadStats] = []
    batch = attention_run.batch
    for captured in attention_run.layers:
        if captured.weights is None:
            head_stats += captured.stats or []
            continue
        cross = captured.kind == "cross"
        found = stats_mod.head_stats(captured.weights, captured.rows_of(batch), captured.index,
                                     key_tokens=captured.columns_of(batch) if cross else None)
        if captured.label is not None:
            found = [replace(s, layer_label=captured.label) for s in found]
        head_stats += found
    if head is not None:  # --head shows one head: its statistics alone, as its map
        head_stats = [s for s in head_stats if s.head == head]
    selected = maps.select_maps(attention_run, head, average)
    breakdown = None
    if query is not None:
        last = attention_run.layers[-1]
        query_index = find_query(last.rows_of(batch)[sentence_index], query)
        breakdown = query_breakdown(attention_run, last.index, sentence_index, query_index)
    return HeatmapResult(attention_run, head_stats, selected, breakdown)
