"""`attnviz compare`: two models with the same head geometry, head by head. A CompareRequest in,
a CompareResult out (no typer, no rich).

First the weights (`compute.comparison.head_weights`): which heads are byte-identical in the
two models and how far each head's slices of W_q, W_k, W_v, W_o moved, read one tensor of each
model at a time. Then, given a corpus, the same examples through both models (the corpus
engine's forward paths, `app.corpus_engines`): each example's per-head sums of every statistic
in each model, paired, streamed into `compute.comparison.paired.PairedMoments`, giving each
head's difference (B − A) per statistic with a 95 % interval over examples. Each model's own
corpus summary (its head types) comes along from the corpus engine's sums.

Under torchrun each rank takes the examples whose ordinal % world is its rank, as `attnviz
corpus` does; the sums are all-reduced at the end."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnviz.compute.comparison.compare_result import (
    CompareResult,
    CorpusComparison,
    PairCounts,
)
from attnviz.core.choices import Dtype, LongExamples, Weighting
from attnviz.core.request import HeadHints, SourceSpec
from attnviz.errors import UsageError, option

if TYPE_CHECKING:
    from attnviz.app.corpus_dist import World
    from attnviz.app.corpus_engines import Engine, Tokenized
    from attnviz.compute.comparison.paired import PairedMoments
    from attnviz.compute.corpus.corpus_examples import LayerInfo
    from attnviz.compute.corpus.corpus_sums import CorpusSums

DEFAULT_MAX_TOKENS = 128
DEFAULT_BUDGET = 256 * 2**20  # bytes of one model's maps a batch may hold
LOOKAHEAD = 512  # examples read ahead and sorted by length
MAX_BATCH = 256
# Each model's own summary gives its head types; their bootstrap stability is `attnviz
# corpus`'s to show, so compare draws no resamples (and --seed seeds --sample alone).
RESAMPLES = 0


@dataclass(frozen=True)
class CompareRequest:
    """Model A (`model`, or `weights` for a checkpoint: the weights alone) against model B
    (`against`, of the same kind); with `corpus`, the corpus through both."""

    against: str  # model B: a folder or cached hub id (--model), a checkpoint (--weights)
    model: str | None = None  # model A: a Hugging Face folder or cached hub id
    weights: Path | None = None  # model A: a checkpoint (weights only, no corpus)
    corpus: Path | None = None  # a text file, JSON lines (with `field`), or '-'
    hints: HeadHints = HeadHints()  # checkpoints: head counts where config.json has none
    field: str | None = None
    device: str = "auto"
    dtype: Dtype = Dtype.FLOAT32
    weighting: Weighting = Weighting.ATTENTION
    max_tokens: int = DEFAULT_MAX_TOKENS
    long: LongExamples = LongExamples.TRUNCATE
    memory_budget: int | None = None  # bytes of one model's maps per batch
    limit: int | None = None
    sample: int | None = None
    seed: int = 0
    lookahead: int = LOOKAHEAD

    def sides(self) -> tuple[str, str]:
        """The two models as messages name them (neutral option references)."""
        return (option("model") if self.weights is None else option("weights"),
                option("against"))

    def spec(self, source: str | Path) -> SourceSpec:
        if self.weights is not None:
            return SourceSpec(weights=Path(source), hints=self.hints)
        return SourceSpec(model=str(source), device=self.device, dtype=self.dtype)


ProgressHook = Callable[[int, int | None], None]  # (examples done, total when known)


def check_request(request: CompareRequest) -> None:
    if (request.model is None) == (request.weights is None):
        raise UsageError(f"compare needs model A: {option('model')} or {option('weights')}, "
                         "one of them", fix=f"pass {option('model')} A {option('against')} B",
                         option="model")
    if not request.against:
        raise UsageError(f"{option('against')} names model B", option="against")
    for name in ("limit", "sample", "max_tokens", "lookahead"):
        value = getattr(request, name)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise UsageError(f"{option(name)} must be a positive whole number, not {value!r}",
                             option=name)
    if request.weights is not None:
        if request.corpus is not None:
            raise UsageError("a corpus runs through the models' own forward pass, which a "
                             f"checkpoint ({option('weights')}) does not have",
                             fix=f"pass model folders with {option('model')} and "
                             f"{option('against')}, or drop the corpus to compare weights",
                             option="weights")
        if request.dtype != Dtype.FLOAT32:
            raise UsageError(f"{option('dtype')} applies to {option('model')}: weights are "
                             "compared as stored", fix="drop it", option="dtype")
    elif request.hints != HeadHints():
        from attnviz.app.circuits_source import refuse_head_hints

        refuse_head_hints(request.hints, "model")
    if request.seed != 0 and request.sample is None and request.corpus is not None:
        raise UsageError(f"{option('seed')} seeds {option('sample')}'s draw of examples",
                         fix=f"add {option('sample')} N, or drop {option('seed')}",
                         option="seed")
    if request.corpus is None:
        corpus_only = {"field": request.field is not None, "limit": request.limit is not None,
                       "sample": request.sample is not None,
                       "weighting": request.weighting != Weighting.ATTENTION,
                       "max_tokens": request.max_tokens != DEFAULT_MAX_TOKENS,
                       "long": request.long != LongExamples.TRUNCATE,
                       "memory_budget": request.memory_budget is not None,
                       "seed": request.seed != 0, "device": request.device != "auto",
                       "dtype": request.dtype != Dtype.FLOAT32}
        given = [name for name, set_ in corpus_only.items() if set_]
        if given:
            names = ", ".join(option(name) for name in given)
            raise UsageError(f"{names} {'apply' if len(given) > 1 else 'applies'} to a corpus "
                             "run: without one only the weights are compared",
                             fix="name a corpus file, or drop "
                             f"{'them' if len(given) > 1 else 'it'}", option=given[0])


def run_compare(request: CompareRequest, progress: ProgressHook | None = None) -> CompareResult:
    """The weights compared, then (with a corpus) both models over it."""
    from attnviz.compute.comparison.head_weights import compare_weights
    from attnviz.sources.registry import open_source

    check_request(request)
    a_source = request.weights if request.weights is not None else request.model
    assert a_source is not None
    opened = [open_source(request.spec(source)) for source in (a_source, request.against)]
    for side in opened:
        side.require_layers()
    weights = compare_weights(opened[0].layers, opened[0].store, opened[1].layers,
                              opened[1].store, request.sides())
    del opened  # headers only; the corpus run loads the models for their forward pass
    notes = ["every attention tensor of the two models is byte-identical: their heads "
             "cannot differ on any input (unless other weights do)"] if weights.all_identical \
        else []
    corpus = None
    if request.corpus is not None:
        assert request.model is not None
        corpus = run_paired(request, progress)
    return CompareResult(str(a_source), request.against, weights, corpus, tuple(notes))


# ---------------------------------------------------------------------------------------------
# the corpus through both models


def run_paired(request: CompareRequest, progress: ProgressHook | None = None
               ) -> CorpusComparison:
    """Both models over the corpus, example by example, the pairs' sums streamed."""
    from dataclasses import replace

    from attnviz.app.corpus_dist import join_world, leave_world, local_device
    from attnviz.app.corpus_engines import open_engine

    world = join_world(request.device)
    try:
        request = replace(request, device=local_device(world, request.device))
        norm = request.weighting == Weighting.NORM
        assert request.model is not None
        engines = (open_engine(request.spec(request.model), request.memory_budget, norm),
                   open_engine(request.spec(request.against), request.memory_budget, norm))
        return _Paired(request, engines, world, progress).run()
    finally:
        leave_world(world)


class _Paired:
    """The accumulation: each window's examples tokenized by both models, bucketed, run
    through each, their per-example sums added as pairs."""

    def __init__(self, request: CompareRequest, engines: tuple[Engine, Engine], world: World,
                 progress: ProgressHook | None) -> None:
        self.request, self.engines, self.world, self.progress = request, engines, world, progress
        self.budget = request.memory_budget or DEFAULT_BUDGET
        self.counts = PairCounts()
        self.layers: list[LayerInfo] = []
        self.moments: PairedMoments | None = None
        self.sums: tuple[CorpusSums, CorpusSums] | None = None
        self.total = request.limit if request.sample is None else (
            min(request.sample, request.limit or request.sample))

    def cost(self, size: int, length: int) -> int:
        """Bytes of one model's maps for a batch (the two run one after the other)."""
        factor = 2 if self.request.weighting == Weighting.NORM else 1
        heads = max(e.heads for e in self.engines)
        layers = max(e.layers for e in self.engines)
        return factor * 4 * size * length * length * heads * layers

    def run(self) -> CorpusComparison:
        from attnviz.app.corpus_input import examples, windows

        started = time.perf_counter()
        r = self.request
        assert r.corpus is not None
        stream = examples(r.corpus, r.field, r.limit, r.sample, r.seed)
        for window in windows(stream, r.lookahead):
            self.counts.read = window[-1].ordinal + 1
            self.window([e for e in window if e.ordinal % self.world.size == self.world.rank])
        return self.finish(time.perf_counter() - started)

    def window(self, todo: list[Any]) -> None:
        from attnviz.app.corpus_input import buckets

        r = self.request
        pairs: list[tuple[Tokenized, Tokenized]] = []
        tokenized = [e.tokenize(todo, r.max_tokens, r.long) for e in self.engines]
        for a, b in zip(*tokenized, strict=True):
            if a is None or b is None:  # empty, or too long with long=skip, in either model
                self.counts.skipped += 1
                continue
            self.counts.truncated += a.truncated or b.truncated
            pairs.append((a, b))
        for batch in buckets(pairs, lambda p: max(p[0].length, p[1].length), self.cost,
                             self.budget, MAX_BATCH):
            self.batch(batch)

    def batch(self, batch: list[tuple[Tokenized, Tokenized]]) -> None:
        from attnviz.compute.comparison.paired import PairedMoments
        from attnviz.compute.corpus.corpus_examples import example_sums, run_layers
        from attnviz.compute.corpus.corpus_sums import STATISTICS, CorpusSums

        runs = [engine.run([pair[side] for pair in batch])
                for side, engine in enumerate(self.engines)]
        found = [run_layers(run) for run in runs]
        shape = [[(i.index, i.heads) for i in layers] for layers in found]
        if shape[0] != shape[1]:
            raise UsageError("the two models ran different attention layers on the same "
                             f"examples ({len(shape[0])} and {len(shape[1])} layers)",
                             fix="compare two models of one architecture and size")
        if self.moments is None:
            self.layers = found[0]
            heads = max(i.heads for i in found[0])
            self.moments = PairedMoments.zeros((len(found[0]), heads, len(STATISTICS)))
            self.sums = (CorpusSums.zeros(len(found[0]), heads, RESAMPLES),
                         CorpusSums.zeros(len(found[0]), heads, RESAMPLES))
        elif shape[0] != [(i.index, i.heads) for i in self.layers]:
            raise UsageError("the model ran different attention layers on two batches",
                             fix="report this model to attnviz")
        assert self.sums is not None
        H = self.moments.sums.shape[2]
        (sums_a, counts_a), (sums_b, counts_b) = (example_sums(run, H) for run in runs)
        # counts are per layer and statistic: every head of a layer averages the same queries
        per_head = [c[:, :, None, :].expand_as(sums_a) for c in (counts_a, counts_b)]
        self.moments.add(sums_a, sums_b, per_head[0], per_head[1])
        ordinals = [pair[0].ordinal for pair in batch]
        for side, (sums, counts) in enumerate(((sums_a, counts_a), (sums_b, counts_b))):
            tokens = sum(pair[side].length for pair in batch)
            self.sums[side].add(ordinals, sums, counts, tokens, self.request.seed)
        self.counts.used += len(batch)
        self.counts.batches += 1
        if self.progress is not None:
            self.progress(self.counts.used * self.world.size, self.total)

    def finish(self, seconds: float) -> CorpusComparison:
        import torch

        from attnviz.app.corpus_dist import all_max, all_reduce
        from attnviz.compute.comparison.paired import PairedMoments
        from attnviz.compute.corpus.corpus_examples import LayerInfo
        from attnviz.compute.corpus.corpus_summary import summarize_sums
        from attnviz.compute.corpus.corpus_sums import STATISTICS, CorpusSums

        world = self.world
        layers = all_max(world, len(self.layers))
        heads = all_max(world, max((i.heads for i in self.layers), default=0))
        if layers == 0:
            raise UsageError("the corpus gave no example to run through both models (every "
                             "one empty or skipped)", fix=f"check the corpus, {option('field')}, "
                             f"or use {option('long')} truncate")
        moments = self.moments or PairedMoments.zeros((layers, heads, len(STATISTICS)))
        sums = self.sums or (CorpusSums.zeros(layers, heads, RESAMPLES),
                             CorpusSums.zeros(layers, heads, RESAMPLES))
        c = self.counts
        packed = torch.tensor([float(c.used), float(c.truncated), float(c.skipped),
                               float(c.batches)], dtype=torch.float64)
        all_reduce(world, [moments.sums, *sums[0].tensors().values(),
                           *sums[1].tensors().values(), packed])
        used, truncated, skipped, batches = (int(x) for x in packed)
        counts = PairCounts(c.read, used, truncated, skipped, batches)
        infos = self.layers or [LayerInfo(i, str(i), heads) for i in range(layers)]
        summaries = (summarize_sums(sums[0], infos, c.read), summarize_sums(sums[1], infos, c.read))
        return CorpusComparison(infos, STATISTICS, moments.result(), summaries, counts,
                                world.size, seconds)


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    """Rows as CSV through the one output writer (atomic). Numbers and the model's own layer
    labels only; None is an empty cell."""
    import csv

    from attnviz.app.outputs import write_output

    def write(tmp: Path) -> None:
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["layer", "head"])
            writer.writeheader()
            for row in rows:
                writer.writerow({k: ("" if v is None else v) for k, v in row.items()})

    write_output(path, write)
