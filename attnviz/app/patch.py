"""`attnviz patch`: activation patching between a clean and a corrupted prompt — which heads,
layers and positions carry the difference in the answer. Request in, result out; the loop is
attnviz.compute.patching, the models attnviz.sources.patch_bundled (the bundled model, default)
and attnviz.sources.hf.patching (--model: a causal LM's own forward, hooked)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from attnviz.compute.patching.pairs import PromptPair
from attnviz.compute.patching.result import EffectGrid, PatchResult
from attnviz.core.choices import Dtype, PatchDirection, PatchMetric, PatchSite
from attnviz.errors import UsageError, option

if TYPE_CHECKING:
    from attnviz.compute.patching.model import PatchModel

DEFAULT_SITES = (PatchSite.HEADS, PatchSite.RESIDUAL)
PER_POSITION_AUTO = 1024  # head × position copies patched by default at most
DEFAULT_BUDGET = 256 * 2**20


@dataclass(frozen=True)
class PatchRequest:
    """One patching run. No prompt and no --pairs: the bundled model's built-in pair."""

    clean: str | None = None
    corrupt: str | None = None
    answer: str | None = None
    wrong: str | None = None
    pairs: Path | None = None  # a TSV or JSON-lines file of pairs
    model: str | None = None  # None: the bundled model
    metric: PatchMetric = PatchMetric.LOGIT_DIFF
    directions: tuple[PatchDirection, ...] = (PatchDirection.DENOISING,)
    sites: tuple[PatchSite, ...] = DEFAULT_SITES
    per_position: bool | None = None  # heads at each position (None: when small)
    receivers: str | None = None  # path patching: 'logits' (None) or LAYER.HEAD[,…]
    receiver_input: PatchSite | None = None  # q (None), k or v of the receiver heads
    device: str = "auto"
    dtype: Dtype = Dtype.FLOAT32
    memory_budget: int | None = None  # bytes of activations per forward (default 256 MiB)
    target: str | None = None  # an encoder-decoder's decoder prefix; the answer follows it


def run_patch(request: PatchRequest, report: Callable[[str], None] = lambda _: None
              ) -> PatchResult:
    """Baselines, then each asked sweep in each asked direction."""
    from attnviz.compute.patching.engine import Engine, pair_batch
    from attnviz.compute.patching.metric import EXPLAINED
    from attnviz.compute.patching.pairs import tokenize_pair
    from attnviz.compute.patching.result import PairView
    from attnviz.compute.patching.sweeps import baseline_runs

    model = _open(request)
    request = _for_decoder_side(request, model)
    pairs, built_in = _pairs(request, model)
    tokenized = [tokenize_pair(p, model.tokenizer, request.metric, n + 1)
                 for n, p in enumerate(pairs)]
    batch = pair_batch(tokenized, request.metric)
    limit = getattr(model, "position_limit", None)
    if limit is not None and batch.length > limit:
        raise UsageError(f"a pair runs {batch.length} tokens, more than the model's {limit} "
                         "positions", fix="shorten the prompts (or the continuation)")
    _check_sites(request, model)
    receivers = _receivers(request.receivers or "logits", model)
    engine = Engine(model, batch, request.memory_budget or DEFAULT_BUDGET)
    report("running the clean and the corrupted prompts")
    runs = baseline_runs(engine, _recorded(request, model), EXPLAINED[request.metric])
    equal = len(set(batch.lengths)) == 1
    same = equal and not _two_stacks(model)
    positions = _position_labels(tokenized[0].clean_names, tokenized[0].corrupt_names,
                                 batch.length)
    notes = list(model.notes)
    if not equal:
        notes.append("the pairs differ in length: per-position grids (and the residual "
                     "stream, which over every position is the whole run) are left out")
    grids: list[EffectGrid] = []
    plan = _Plan(request, positions, same, receivers, report)
    for direction in request.directions:
        grids += _sweeps(plan, runs, direction)
    views = [PairView(t.clean_names, t.corrupt_names, t.answer_names, t.wrong_name)
             for t in tokenized]
    result = PatchResult(model.name, request.metric, views, runs.baselines, grids,
                         (model.n_layers, model.n_heads, model.n_kv_heads), engine.forwards,
                         engine.per_forward, notes)
    if not built_in:
        return result
    # the built-in pair's note names its heads' roles, read from the finished grids
    return replace(result, notes=[*result.notes, *roles(result, tokenized[0].clean_names,
                                                        tokenized[0].corrupt_names)])


@dataclass(frozen=True)
class _Plan:
    """What every direction's sweeps share."""

    request: PatchRequest
    positions: list[str]  # the column labels of per-position grids
    same: bool  # every pair has the same length (per-position grids defined)
    receivers: list[tuple[int, int]]  # path patching's receiver heads (none: the logits)
    report: Callable[[str], None]


def _sweeps(plan: _Plan, runs: object, direction: PatchDirection) -> list[EffectGrid]:
    from attnviz.compute.patching import sweeps

    assert isinstance(runs, sweeps.Runs)
    request, positions, same, receivers, report = \
        plan.request, plan.positions, plan.same, plan.receivers, plan.report
    grids: list[EffectGrid] = []
    exact: dict[str, EffectGrid] = {}
    L = runs.engine.batch.length
    wanted = set(request.sites)
    for site in request.sites:
        if site is PatchSite.HEADS or (site is PatchSite.ATTRIBUTION
                                       and PatchSite.HEADS not in wanted):  # its exact twin
            grid = sweeps.head_sweep(runs, direction, "z", report)
            grids.append(grid)
            exact["heads"] = grid
            per = request.per_position
            if per is None:
                per = runs.layers * runs.heads * L <= PER_POSITION_AUTO
            if per and same:
                grid = sweeps.position_sweep(runs, direction, "z", positions, report)
                grids.append(grid)
                exact["head-positions"] = grid
        if site is PatchSite.RESIDUAL and same:
            grid = sweeps.position_sweep(runs, direction, "resid", positions, report)
            grids.append(grid)
            exact["residual"] = grid
        if site in (PatchSite.Q, PatchSite.K, PatchSite.V, PatchSite.PATTERN):
            grids.append(sweeps.head_sweep(runs, direction, str(site), report))
        if site is PatchSite.PATH:
            grids.append(sweeps.path_sweep(runs, direction, receivers,
                                           str(request.receiver_input or PatchSite.Q), report))
    if PatchSite.ATTRIBUTION in wanted:
        report("attribution patching: one forward and backward")
        grids += sweeps.attribution_grids(runs, direction, positions if same else [], exact)
    return grids


def _two_stacks(model: PatchModel) -> bool:
    return bool(getattr(model, "target", None) is not None)


def _for_decoder_side(request: PatchRequest, model: PatchModel) -> PatchRequest:
    """An encoder-decoder patches heads over all positions (its stacks run over different
    tokens): the default sites become heads alone; per-position grids and the loss over a
    continuation are refused."""
    import dataclasses

    if not _two_stacks(model):
        return request
    if request.per_position:
        raise UsageError(f"{option('per_position')} has no single set of positions in an "
                         "encoder-decoder (its encoder and decoder run over different tokens)",
                         fix=f"drop {option('per_position')}", option="per_position")
    if request.metric is PatchMetric.LOSS:
        raise UsageError(f"{option('metric')} loss scores a continuation of the prompt; an "
                         "encoder-decoder's answer follows its decoder prefix",
                         fix=f"use {option('metric')} logit-diff or logprob, and put the "
                         f"continuation's start in {option('target')}", option="metric")
    if request.sites is DEFAULT_SITES:
        return dataclasses.replace(request, sites=(PatchSite.HEADS,))
    return request


def _open(request: PatchRequest) -> PatchModel:
    """The model, through the source registry."""
    from attnviz.compute.forward_pass.device import resolve_device
    from attnviz.core.request import SourceSpec
    from attnviz.sources.registry import open_model_source, open_source

    if request.model is None:
        from attnviz.sources.patch_bundled import BundledPatchModel

        if request.dtype is not Dtype.FLOAT32:
            raise UsageError(f"{option('dtype')} applies to {option('model')} only",
                             fix=f"drop {option('dtype')}", option="dtype")
        if request.target is not None:
            raise UsageError(f"{option('target')} is an encoder-decoder model's decoder "
                             "prefix", fix=f"drop {option('target')}", option="target")
        opened = open_source(SourceSpec())
        return BundledPatchModel(opened.store, resolve_device(request.device))
    from attnviz.sources.hf.patching import load_patch_model

    spec = SourceSpec(model=request.model, device=request.device, dtype=request.dtype)
    device = resolve_device(request.device)
    return load_patch_model(open_model_source(spec), device, str(request.dtype),
                            request.target)


def _pairs(request: PatchRequest, model: PatchModel) -> tuple[list[PromptPair], bool]:
    """The pairs asked for, and whether they are the bundled model's built-in one."""
    from attnviz.compute.patching.pairs import pair_from_options, read_pairs

    if request.pairs is not None:
        given = [n for n in ("clean", "corrupt", "answer", "wrong")
                 if getattr(request, n) is not None]
        if given:
            raise UsageError(f"{option('pairs')} holds the prompts and answers",
                             fix=f"drop {option(given[0])} or {option('pairs')}",
                             option=given[0])
        return read_pairs(request.pairs), False
    if request.clean is not None:
        return [pair_from_options(request.clean, request.corrupt, request.answer,
                                  request.wrong)], False
    given = [n for n in ("corrupt", "answer", "wrong") if getattr(request, n) is not None]
    if given:
        raise UsageError(f"{option(given[0])} needs a clean prompt",
                         fix="give the clean prompt first", option=given[0])
    if request.model is not None:
        raise UsageError(f"{option('model')} has no built-in pair",
                         fix=f"give a clean prompt, {option('corrupt')} and {option('answer')}, "
                         f"or {option('pairs')} FILE")
    from attnviz.sources.patch_bundled import BUILT_IN

    pair = BUILT_IN
    if request.metric is not PatchMetric.LOGIT_DIFF:
        pair = PromptPair(pair.clean, pair.corrupt, pair.answer, None)
    return [pair], True


def _receivers(text: str, model: PatchModel) -> list[tuple[int, int]]:
    """'logits' (none), or LAYER.HEAD[,LAYER.HEAD…]."""
    if text.strip().lower() == "logits":
        return []
    found = []
    for part in text.split(","):
        layer, dot, head = part.strip().partition(".")
        if not dot or not layer.strip().isdigit() or not head.strip().isdigit():
            raise UsageError(f"unknown {option('receivers')} {part.strip()!r}",
                             fix="use logits, or LAYER.HEAD[,LAYER.HEAD…] such as 1.0,1.1",
                             option="receivers")
        at = (int(layer), int(head))
        if at[0] >= model.n_layers or at[1] >= model.n_heads:
            raise UsageError(f"no head {at[0]}.{at[1]}: the model has {model.n_layers} layers "
                             f"of {model.n_heads} heads", fix="count from 0",
                             option="receivers")
        if at[0] == 0:
            raise UsageError(f"a {option('receivers')} head in layer 0 has no sender before it",
                             fix="choose a receiver in a later layer", option="receivers")
        found.append(at)
    return found


def _check_sites(request: PatchRequest, model: PatchModel) -> None:
    """Each site reachable in the model; the receiver options only with path patching (and
    --receiver-input only with receiver heads)."""
    if request.per_position is not None and PatchSite.HEADS not in request.sites:
        raise UsageError(f"{option('per_position')} is about head patching",
                         fix=f"add heads to {option('site')}, or drop {option('per_position')}",
                         option="per_position")
    path = PatchSite.PATH in request.sites
    heads = request.receivers is not None and request.receivers.strip().lower() != "logits"
    if request.receivers is not None and not path:
        raise UsageError(f"{option('receivers')} names path patching's receivers",
                         fix=f"add {option('site')} path, or drop {option('receivers')}",
                         option="receivers")
    if request.receiver_input is not None:
        if not (path and heads):
            raise UsageError(f"{option('receiver_input')} is the input of receiver heads",
                             fix=f"add {option('site')} path {option('receivers')} "
                             f"LAYER.HEAD, or drop {option('receiver_input')}",
                             option="receiver_input")
        if request.receiver_input not in (PatchSite.Q, PatchSite.K, PatchSite.V):
            raise UsageError(f"{option('receiver_input')} takes q, k or v",
                             fix="use q, k or v", option="receiver_input")
    needs = {PatchSite.RESIDUAL: "resid", PatchSite.Q: "q", PatchSite.K: "k", PatchSite.V: "v",
             PatchSite.PATTERN: "pattern"}
    if path and heads:
        needs = {**needs, PatchSite.PATH: str(request.receiver_input or PatchSite.Q)}
    for site in request.sites:
        if site in needs and needs[site] not in model.sites:
            raise UsageError(f"{option('site')} {site} is not reachable in this model: "
                             + "; ".join(model.notes), fix=f"drop {option('site')} {site}",
                             option="site")


def _recorded(request: PatchRequest, model: PatchModel) -> set[str]:
    sites = {"z"}
    for site in request.sites:
        sites |= {PatchSite.RESIDUAL: {"resid"}, PatchSite.Q: {"q"}, PatchSite.K: {"k"},
                  PatchSite.V: {"v"}, PatchSite.PATTERN: {"pattern"},
                  PatchSite.ATTRIBUTION: {"resid"} & set(model.sites)}.get(site, set())
    return sites


def _position_labels(clean: list[str], corrupt: list[str], length: int) -> list[str]:
    """Each position as the clean token, 'clean→corrupt' where they differ."""
    labels = []
    for i in range(length):
        a = clean[i] if i < len(clean) else "·"
        b = corrupt[i] if i < len(corrupt) else "·"
        labels.append(f"{i}:{a}" if a == b else f"{i}:{a}→{b}")
    return labels


def roles(result: PatchResult, clean: list[str], corrupt: list[str],
          threshold: float = 0.2) -> list[str]:
    """The heads that carry the built-in pair's difference, named by where their effect sits:
    one position after the corrupted token (a previous-token head: it moves that token one
    position on) or at the last token of a later layer (an induction head: it completes the
    repeat from there)."""
    heads = result.grid("heads")
    at = result.grid("head-positions")
    if heads is None or at is None or heads.direction is not PatchDirection.DENOISING:
        return []
    changed = [i for i, (a, b) in enumerate(zip(clean, corrupt, strict=True)) if a != b]
    last = len(clean) - 1
    found = []
    for i, row in enumerate(heads.mean):
        for h, effect in enumerate(row):
            if not effect > threshold:
                continue
            cells = at.mean[at.rows.index(f"L{i}H{h}")]
            peak = max(range(len(cells)), key=lambda p: cells[p])
            if peak - 1 in changed:
                found.append(f"L{i}H{h} is the previous-token head: patching it restores "
                             f"{effect:.2f} of the answer, at {at.cols[peak]!r}, the token after "
                             "the corrupted one")
            elif peak == last and i > 0:
                found.append(f"L{i}H{h} is an induction head: patching it restores "
                             f"{effect:.2f} of the answer, at the last token {at.cols[peak]!r}, "
                             "where the repeat is completed")
    return found
