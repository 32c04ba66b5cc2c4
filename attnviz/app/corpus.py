"""`attnviz corpus`: head statistics over a corpus, streamed. A CorpusRequest in, a
CorpusResult out (no typer, no rich).

API (stable; `attnviz compare` builds on it):
- `CorpusRequest(corpus=Path, model=None | str, ...)`: what to run (see its fields).
- `run_corpus(request, progress=None) -> CorpusResult`: reads the corpus a lookahead window at a
  time, tokenizes each example alone, batches each window by length within the memory budget,
  runs heatmap's forward path (`app.corpus_engines`), and adds each example's own sums into
  `compute.corpus.corpus_sums.CorpusSums` (float64). `progress(CorpusProgress)` hears after
  every batch.
- `CorpusResult` (`compute.corpus.corpus_result`): `.sums` (Σ s_i, Σ s_i², Σ c_i, Σ c_i²,
  Σ s_i c_i per layer, head and statistic; the Poisson-bootstrap and band sums), `.layers`
  (LayerInfo per layer), `.counts`, `.summary` (`compute.corpus.corpus_summary`: per head, each
  statistic's mean with its 95 % interval over examples, query and example counts, the head
  type, its stability and settle point), `.to_json()`, `.rows()` (the CSV's per-head rows).
- The parts, for a caller that drives its own loop (two models over the same examples):
  `app.corpus_engines.open_engine(spec, budget, norm)` (`.tokenize(examples, max_tokens,
  long)`, `.run(batch) -> AttentionRun`), `app.corpus_input.examples/windows/buckets`, and
  `compute.corpus.corpus_examples.example_sums(run, heads) -> (sums (B, L, H, S), counts
  (B, L, S))`, the per-example values every sum above is made of.

Under torchrun each rank takes the examples whose ordinal % world is its rank; the sums are
all-reduced at the end and every rank returns the same result (rank 0 writes the outputs)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnviz.app.corpus_input import PrefixHash, buckets, corpus_identity, examples, windows
from attnviz.compute.corpus.corpus_result import DEFAULT_MAX_TOKENS, CorpusResult, Counts
from attnviz.core.choices import Dtype, LongExamples, Weighting
from attnviz.core.request import SourceSpec
from attnviz.errors import CheckFailed, UsageError, option

if TYPE_CHECKING:
    from attnviz.app.corpus_dist import World
    from attnviz.app.corpus_engines import Engine, Tokenized
    from attnviz.compute.corpus.corpus_examples import LayerInfo
    from attnviz.compute.corpus.corpus_sums import CorpusSums

DEFAULT_BUDGET = 256 * 2**20  # bytes of maps a batch may hold
LOOKAHEAD = 512  # examples read ahead and sorted by length
MAX_BATCH = 256
DEFAULT_SAVE_EVERY = 50


@dataclass(frozen=True)
class CorpusRequest:
    corpus: Path  # a text file (one example per line), JSON lines (with `field`), or '-'
    model: str | None = None  # a Hugging Face folder or cached id; None: the bundled model
    field: str | None = None  # JSON lines: the string field holding each example's text
    device: str = "auto"
    dtype: Dtype = Dtype.FLOAT32
    device_map: str | None = None
    max_memory: int | None = None
    weighting: Weighting = Weighting.ATTENTION
    max_tokens: int = DEFAULT_MAX_TOKENS
    long: LongExamples = LongExamples.TRUNCATE
    memory_budget: int | None = None  # bytes of maps per batch (None: DEFAULT_BUDGET)
    limit: int | None = None  # the first N examples (of the sample)
    sample: int | None = None  # N examples drawn uniformly (reservoir sampling)
    seed: int = 0  # the sample's and the bootstrap's
    resamples: int = 200  # bootstrap resamples for the type's stability
    state: Path | None = None  # partial sums saved here every `save_every` batches
    resume: bool = False  # continue from `state`
    save_every: int | None = None  # None: DEFAULT_SAVE_EVERY (given, it needs `state`)
    lookahead: int = LOOKAHEAD  # examples sorted by length per window

    def source(self) -> SourceSpec:
        return SourceSpec(model=self.model, device=self.device, dtype=self.dtype,
                          device_map=self.device_map, max_memory=self.max_memory)

    def fingerprint_options(self, world: int) -> dict[str, Any]:
        """The options a resumed run must share (not --limit: a limited run resumes past it)."""
        return {"weighting": str(self.weighting), "max_tokens": self.max_tokens,
                "long": str(self.long), "field": self.field, "sample": self.sample,
                "seed": self.seed, "resamples": self.resamples, "dtype": str(self.dtype),
                "world_size": world}


@dataclass(frozen=True)
class CorpusProgress:
    done: int  # examples this rank has added (times the ranks: an estimate of all)
    read: int  # examples read
    total: int | None  # examples the run will read, when known (--limit, --sample)
    batches: int


def check_request(request: CorpusRequest) -> None:
    for name in ("limit", "sample", "max_tokens", "resamples", "save_every", "lookahead"):
        value = getattr(request, name)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise UsageError(f"{option(name)} must be a positive whole number, not {value!r}",
                             option=name)
    if request.save_every is not None and request.state is None:
        raise UsageError(f"{option('save_every')} says how often {option('state')} is saved",
                         fix=f"name the state file with {option('state')}, or drop "
                         f"{option('save_every')}", option="save_every")
    if request.resume and request.state is None:
        raise UsageError(f"{option('resume')} continues from a state file",
                         fix=f"name it with {option('state')}", option="resume")
    if request.field is not None and not request.field:
        raise UsageError(f"{option('field')} is empty", fix="name the JSON field of the text",
                         option="field")
    if request.model is None and (request.dtype != Dtype.FLOAT32 or request.device_map
                                  or request.max_memory):
        raise UsageError(f"{option('dtype')}, {option('device_map')} and "
                         f"{option('max_memory')} apply to {option('model')}",
                         fix="drop them, or pass a model")


def run_corpus(request: CorpusRequest,
               progress: Callable[[CorpusProgress], None] | None = None) -> CorpusResult:
    """Head statistics of every example of the corpus (see the module docstring)."""
    from dataclasses import replace

    from attnviz.app.corpus_dist import join_world, leave_world, local_device
    from attnviz.app.corpus_engines import open_engine

    check_request(request)
    world = join_world(request.device)
    try:
        if world.size > 1 and str(request.corpus) == "-":  # each rank reads the whole stream
            raise UsageError(f"standard input cannot be read by {world.size} processes at once",
                             fix="pass the corpus as a file every rank can read")
        request = replace(request, device=local_device(world, request.device))
        engine = open_engine(request.source(), request.memory_budget,
                             request.weighting == Weighting.NORM)
        return _run(request, engine, world, progress)
    finally:
        leave_world(world)


def _run(request: CorpusRequest, engine: Engine, world: World,
         progress: Callable[[CorpusProgress], None] | None) -> CorpusResult:
    from attnviz.app.corpus_state import (
        RunState,
        check_resumable,
        load_state,
        save_state,
        state_path,
    )
    from attnviz.compute.corpus.corpus_examples import LayerInfo
    from attnviz.compute.corpus.corpus_sums import CorpusSums

    started = time.perf_counter()
    identity = RunState(engine.identity(), corpus_identity(request.corpus),
                        request.fingerprint_options(world.size), 0, "", [], {})
    loop = _Loop(request, engine, world, progress)
    start = 0
    path = None if request.state is None else state_path(request.state, world.rank, world.size)
    saved_prefix = ""
    if request.resume and path is not None:
        sums, saved = load_state(path)
        check_resumable(saved, identity)
        loop.sums = sums if sums.shape[1] else None  # no layer: nothing had run
        start, saved_prefix = saved.consumed, saved.prefix
        loop.layers = [LayerInfo(**info) for info in saved.layers]
        loop.counts = Counts(**saved.counts)
    prefix = PrefixHash()

    def save(consumed: int) -> None:
        if path is None:
            return
        state = RunState(identity.model, identity.corpus, identity.options, consumed,
                         prefix.hexdigest(), [info.__dict__ for info in loop.layers],
                         loop.counts.to_json())
        # a rank that has run nothing yet saves empty sums: its resume starts from them too
        save_state(path, loop.sums or CorpusSums.zeros(0, 0, request.resamples), state)

    stream = examples(request.corpus, request.field, request.limit, request.sample,
                      request.seed)
    since_save = 0
    for window in windows(_checked(stream, prefix, start, saved_prefix), request.lookahead):
        todo = [e for e in window if e.ordinal >= start]
        loop.counts.read = max(loop.counts.read, window[-1].ordinal + 1)
        if not todo:
            continue
        since_save += loop.window([e for e in todo if e.ordinal % world.size == world.rank])
        if since_save >= (request.save_every or DEFAULT_SAVE_EVERY):
            save(window[-1].ordinal + 1)
            since_save = 0
    if loop.counts.read < start:
        raise UsageError(f"the corpus holds {loop.counts.read} examples, fewer than the "
                         f"{start} the state file says were done", option="resume",
                         fix=f"drop {option('resume')} to start afresh")
    save(loop.counts.read)
    return _finish(request, engine, world, loop, start, time.perf_counter() - started)


def _checked(stream: Iterator[Any], prefix: PrefixHash, start: int,
             saved_prefix: str) -> Iterator[Any]:
    """The stream, hashed as it goes; a resumed run's first `start` examples must hash as the
    interrupted run's did."""
    for example in stream:
        if example.ordinal == start and start and prefix.hexdigest() != saved_prefix:
            _changed(start)
        prefix.add(example.text)
        yield example
    if start and prefix.count == start and prefix.hexdigest() != saved_prefix:
        _changed(start)


def _changed(start: int) -> None:
    raise UsageError(f"cannot resume: the corpus's first {start} examples differ from those "
                     "the interrupted run read", option="resume",
                     fix=f"resume on the same corpus, or drop {option('resume')}")


class _Loop:
    """The accumulation: each window's examples tokenized, bucketed, run, added."""

    def __init__(self, request: CorpusRequest, engine: Engine, world: World,
                 progress: Callable[[CorpusProgress], None] | None) -> None:
        self.request, self.engine, self.world = request, engine, world
        self.sums: CorpusSums | None = None
        self.counts = Counts()
        self.layers: list[LayerInfo] = []
        self.progress = progress
        self.budget = request.memory_budget or DEFAULT_BUDGET
        self.total = request.limit if request.sample is None else (
            min(request.sample, request.limit or request.sample))

    def cost(self, size: int, length: int) -> int:
        """Bytes of a batch's maps: every layer's (B, H, L, L) float32, twice when weighed."""
        factor = 2 if self.request.weighting == Weighting.NORM else 1
        return factor * 4 * size * length * length * self.engine.heads * self.engine.layers

    def window(self, todo: list[Any]) -> int:
        """Run one window's share; the number of batches run."""
        items: list[Tokenized] = []
        for example, item in zip(todo, self.engine.tokenize(todo, self.request.max_tokens,
                                                            self.request.long), strict=True):
            if item is None:
                empty = not example.text.strip()
                self.counts.skipped_empty += empty
                self.counts.skipped_long += not empty
                continue
            self.counts.truncated += item.truncated
            items.append(item)
        batches = buckets(items, lambda i: i.length, self.cost, self.budget, MAX_BATCH)
        for batch in batches:
            self.batch(batch)
        return len(batches)

    def batch(self, batch: list[Tokenized]) -> None:
        import torch

        from attnviz.compute.corpus.corpus_examples import example_sums, run_layers
        from attnviz.compute.corpus.corpus_sums import CorpusSums

        run = self.engine.run(batch)
        found = run_layers(run)
        if self.sums is None:
            self.layers = found
            self.sums = CorpusSums.zeros(len(found), max(i.heads for i in found),
                                         self.request.resamples)
        elif [(i.index, i.heads) for i in found] != [(i.index, i.heads) for i in self.layers]:
            raise UsageError("the model ran different attention layers on two batches",
                             fix="report this model to attnviz")
        sums, counts = example_sums(run, self.sums.shape[2])
        if not bool(torch.isfinite(sums).all()):  # NaN/Inf maps: named, never averaged
            from attnviz.compute.forward_pass.attention import check_finite_maps

            check_finite_maps(run)
            raise CheckFailed("a batch's head statistics came out non-finite",
                              fix="check the model's weights with 'attnviz inspect "
                              f"{option('scan')}'")
        lengths = [i.length for i in batch]
        self.sums.add([i.ordinal for i in batch], sums, counts, sum(lengths), self.request.seed)
        self.counts.used += len(batch)
        self.counts.batches += 1
        self.counts.padding += len(batch) * max(lengths) - sum(lengths)
        if self.progress is not None:
            self.progress(CorpusProgress(self.counts.used * self.world.size, self.counts.read,
                                         self.total, self.counts.batches))


def _finish(request: CorpusRequest, engine: Engine, world: World, loop: _Loop, start: int,
            seconds: float) -> CorpusResult:
    from attnviz.app.corpus_dist import all_max, all_reduce
    from attnviz.compute.corpus.corpus_examples import LayerInfo
    from attnviz.compute.corpus.corpus_sums import CorpusSums

    # a rank that saw no example still takes part: shapes from the others
    layers_count = all_max(world, len(loop.layers))
    heads = all_max(world, max((i.heads for i in loop.layers), default=0))
    if layers_count == 0:
        raise UsageError("the corpus gave no example to run (every one empty or skipped)",
                         fix=f"check the corpus, {option('field')}, or use "
                         f"{option('long')} truncate")
    sums = loop.sums or CorpusSums.zeros(layers_count, heads, request.resamples)
    counts = loop.counts
    numbers = [float(counts.used), float(counts.truncated), float(counts.skipped_long),
               float(counts.skipped_empty), float(counts.batches), float(counts.padding)]
    import torch

    packed = torch.tensor(numbers, dtype=torch.float64)
    all_reduce(world, [*sums.tensors().values(), packed])
    used, truncated, skipped_long, skipped_empty, batches, padding = (int(x) for x in packed)
    total = Counts(counts.read, used, truncated, skipped_long, skipped_empty, batches, padding)
    layers = loop.layers
    if not layers:  # this rank ran nothing: the layers as rank 0 numbers them
        layers = [LayerInfo(i, str(i), heads) for i in range(layers_count)]
    notes = []
    if truncated:
        notes.append(f"{truncated} example(s) longer than {option('max_tokens')} "
                     f"{request.max_tokens} truncated to it")
    if skipped_long:
        notes.append(f"{skipped_long} example(s) longer than {option('max_tokens')} "
                     f"{request.max_tokens} skipped ({option('long')} skip)")
    return CorpusResult(engine.name(), str(request.corpus), str(request.weighting), sums, layers,
                        total, world.size, seconds, start, request.seed, str(request.long),
                        request.max_tokens, notes)
