"""`attnviz tokens`: which input tokens reach one output position through all layers.

For each sentence the source hands a `TokenTrace` (per-layer maps and per-source terms) and its
leave-one-out `Erasures`; here every asked method turns them into one vector over the input
tokens (`chain[0]`, with `chain[k]` the same for the representations entering layer k), and each
method's Spearman correlation with the erasure effects is computed. Request in, result out."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from attnviz.compute.tokenflow.token_result import (  # noqa: F401 - the use case's result
    SentenceTokens,
    TokensResult,
)
from attnviz.core.choices import Dtype, Erase, HeadReduce, TokenMethod
from attnviz.core.memory import budget_bytes
from attnviz.core.request import DEFAULT_MAX_SENTENCES, DEFAULT_MAX_TOKENS
from attnviz.errors import UsageError, option

if TYPE_CHECKING:
    import torch

    from attnviz.compute.tokenflow.trace import CrossTrace, Erasures, TokenTrace
    from attnviz.sources.hf.token_contributions import EraseSpec, ModelRunner

METHODS = tuple(TokenMethod)


@dataclass(frozen=True)
class TokensRequest:
    sentences: list[str]
    model: str | None = None  # None: the bundled model
    position: str | None = None  # index or word; None: last (causal) / first (encoder)
    methods: tuple[TokenMethod, ...] | None = None  # None: every method the input allows
    heads: HeadReduce = HeadReduce.MEAN
    residual_weight: float = 0.5
    check: bool = True  # leave-one-out and the correlations
    erase: Erase = Erase.MASK
    baseline: str | None = None  # the baseline token for --erase baseline
    memory_budget: int | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    max_sentences: int = DEFAULT_MAX_SENTENCES
    device: str = "cpu"
    dtype: Dtype = Dtype.FLOAT32
    targets: tuple[str, ...] | None = None  # encoder-decoder: the decoder's text per sentence
    # keep each layer's L × L matrices in the result (--json, --export, --html and the API
    # read them; the terminal and the figure read the chains only)
    keep_matrices: bool = True

    def check_values(self) -> None:
        if not 0.0 <= self.residual_weight <= 1.0:
            raise UsageError(f"{option('residual_weight')} must lie in [0, 1], got "
                             f"{self.residual_weight}", fix="0.5 mixes attention and identity "
                             "equally (Abnar & Zuidema)", option="residual_weight")
        if self.baseline is not None and self.erase is not Erase.BASELINE:
            raise UsageError(f"{option('baseline')} applies to {option('erase')} baseline",
                             fix=f"drop {option('baseline')} or add {option('erase')} baseline",
                             option="baseline")
        if self.targets is not None and self.model is None:
            raise UsageError(f"{option('target')} applies to an encoder-decoder "
                             f"{option('model')}", fix=f"drop {option('target')}",
                             option="target")
        if self.erase is Erase.BASELINE and not self.check:
            raise UsageError(f"{option('erase')} applies to the leave-one-out check",
                             fix=f"drop {option('erase')} or {option('no_check')}",
                             option="erase")


# a tokenizer's word markers (GPT-2's Ġ, sentencepiece's ▁, WordPiece's ##, byte-level Ċ):
# `--position the` finds "The", "Ġthe" and "▁the"; `--position Ġthe` only "Ġthe"
WORD_MARKERS = ("Ġ", "▁", "##", "Ċ")


def _bare(token: str) -> str:
    for marker in WORD_MARKERS:
        token = token.replace(marker, "")
    return token


def word_matches(tokens: list[str], word: str) -> list[int]:
    """The indices of the tokens that are `word`, case aside, as written or once a tokenizer's
    word markers are stripped from them."""
    wanted = word.lower()
    return [i for i, t in enumerate(tokens)
            if wanted and wanted in (t.lower(), _bare(t).lower())]


def output_position(tokens: list[str], spec: str | None, causal: bool,
                    sentence: int | None = None) -> int:
    """--position: an index (negative from the end) or a word (its last occurrence for a causal
    model, where later tokens are out of its reach, else its first); default the last token
    (causal) or the first (encoder). `sentence` (0-based), where there are several: named in
    the refusal."""
    where = "the sentence" if sentence is None else f"sentence {sentence + 1}"
    if spec is None:
        return len(tokens) - 1 if causal else 0
    try:
        index = int(spec)
    except ValueError:
        found = word_matches(tokens, spec)
        if not found:
            from attnviz.errors import printable

            shown = ", ".join(printable(t) for t in dict.fromkeys(tokens))
            raise UsageError(f"token {printable(spec)!r} is not in {where}",
                             fix=f"choose one of {shown}", option="position") from None
        return found[-1] if causal else found[0]
    if not -len(tokens) <= index < len(tokens):
        raise UsageError(f"position {index} is out of range",
                         fix=f"{where} has {len(tokens)} tokens", option="position")
    return index % len(tokens)


def repeated_word_note(tokens: list[str], spec: str | None, position: int, sentence: int
                       ) -> str | None:
    """A note when --position names a word found more than once: which one is traced."""
    if spec is None:
        return None
    try:
        int(spec)
        return None
    except ValueError:
        found = word_matches(tokens, spec)
    if len(found) < 2:
        return None
    from attnviz.errors import printable

    which = "last" if position == found[-1] else "first"
    return (f"sentence {sentence + 1}: {printable(spec)!r} occurs at "
            f"{', '.join(map(str, found))}; traced {position}, its {which} occurrence (the "
            f"last on a causal model or a decoder, the first on an encoder); give "
            f"{option('position')} an index for another")


def chosen_methods(request: TokensRequest, longest: int, layers: int, can_decompose: bool
                   ) -> tuple[tuple[TokenMethod, ...], list[str]]:
    """The methods to run, and notes on those left out; asked-for methods that cannot run are
    refused up front, with the reason."""
    from attnviz.compute.tokenflow.maxflow import flow_problem

    notes = []
    asked = request.methods
    wanted = list(METHODS if asked is None else asked)
    problem = flow_problem(longest, layers)
    if TokenMethod.FLOW in wanted and problem is not None:
        if asked is not None:
            raise UsageError(problem, fix=f"drop flow from {option('method')}, or pass a "
                             "shorter sentence", option="method")
        wanted.remove(TokenMethod.FLOW)
        notes.append(f"flow left out: {problem}")
    contributions = {TokenMethod.NORMS, TokenMethod.ALTI}
    if not can_decompose and contributions & set(wanted):
        if asked is not None:
            raise UsageError("this model's attention blocks cannot be decomposed into "
                             "per-source terms by attnviz", fix=f"choose rollout or flow with "
                             f"{option('method')}", option="method")
        wanted = [m for m in wanted if m not in contributions]
        notes.append("norms and alti left out: attnviz does not decompose this model's "
                     "attention blocks")
    return tuple(dict.fromkeys(wanted)), notes


def analyse(request: TokensRequest, trace: TokenTrace, position: int,
            methods: tuple[TokenMethod, ...], erasures: Erasures | None) -> SentenceTokens:
    """Every method on one sentence's trace, and each one's correlation with erasure."""
    import torch

    from attnviz.compute.tokenflow import decompose, maxflow, rollout

    if request.keep_matrices or TokenMethod.FLOW in methods:  # Ã_l as matrices
        chain, matrices = rollout.rollout(trace.maps, position, request.heads,
                                          request.residual_weight)
    else:  # the row vector alone: no L × L matrix formed (the same chain, tested)
        chain = rollout.rollout_chain(trace.maps, position, request.heads,
                                      request.residual_weight)
        matrices = []
    chains: dict[TokenMethod, torch.Tensor] = {}
    own: dict[TokenMethod, list[torch.Tensor]] = {}
    if TokenMethod.ROLLOUT in methods:
        chains[TokenMethod.ROLLOUT] = chain
    if TokenMethod.FLOW in methods:
        # flow is computed from the inputs only (one max flow per input token): the rows
        # between are NaN (not computed), the top row the output itself
        flow = maxflow.attention_flow(matrices, position)
        between = torch.full_like(chain[1:-1], float("nan"))
        chains[TokenMethod.FLOW] = torch.cat([flow[None], between, chain[-1:]])
    if {TokenMethod.NORMS, TokenMethod.ALTI} & set(methods):
        assert trace.blocks is not None
        composed = decompose.compose(trace.blocks, position, budget_bytes(request.memory_budget),
                                     methods, keep=request.keep_matrices)
        for m in (TokenMethod.NORMS, TokenMethod.ALTI):
            if m in methods:
                chains[m], own[m] = composed[m]
    if not request.keep_matrices:
        matrices, own = [], {}
    result = SentenceTokens(trace.tokens, position, trace.layer_names,
                            {m: chains[m] for m in methods}, matrices,
                            {m: own.get(m, matrices) for m in methods})
    return _checked(result, erasures, chains, methods)


def _checked(result: SentenceTokens, erasures: Erasures | None,
             chains: dict[TokenMethod, torch.Tensor], methods: tuple[TokenMethod, ...]
             ) -> SentenceTokens:
    """The sentence with leave-one-out's effect per token (NaN where nothing was erased) and
    each method's Spearman ρ with it."""
    import torch

    from attnviz.compute.tokenflow import faithfulness

    if erasures is None:
        return result
    effects = torch.full((len(result.tokens),), float("nan"), dtype=torch.float64)
    effects[erasures.erased] = erasures.effects
    result.effects, result.erasures = effects, erasures
    for m in methods:
        result.correlations[m] = faithfulness.spearman(chains[m][0][erasures.erased],
                                                       erasures.effects)
    return result


def summarize(sentences: list[SentenceTokens], methods: tuple[TokenMethod, ...]
              ) -> dict[TokenMethod, tuple[float | None, float | None, int]]:
    from attnviz.compute.tokenflow.faithfulness import mean_spread

    return {m: mean_spread([s.correlations.get(m) for s in sentences]) for m in methods}


def run_tokens(request: TokensRequest) -> TokensResult:
    """The use case: open the source, trace each sentence, run the methods and the check."""
    request.check_values()
    if request.model is not None:
        return _run_model(request)
    return _run_bundled(request)


@dataclass
class _Traced:
    """What a source handed over, before the methods run."""

    source: str
    causal: bool
    traces: list[TokenTrace]
    can_decompose: bool
    notes: list[str]


def _finish(request: TokensRequest, traced: _Traced,
            erase: Callable[[int, TokenTrace, int], Erasures] | None) -> TokensResult:
    """Positions, methods, the check and the correlations, for any source."""
    several = len(traced.traces) > 1
    positions = [output_position(t.tokens, request.position, traced.causal,
                                 b if several else None)
                 for b, t in enumerate(traced.traces)]
    repeated = [repeated_word_note(t.tokens, request.position, p, b)
                for b, (t, p) in enumerate(zip(traced.traces, positions, strict=True))]
    longest = max(len(t.tokens) for t in traced.traces)
    methods, left_out = chosen_methods(request, longest, len(traced.traces[0].maps),
                                       traced.can_decompose)
    sentences = []
    for b, (trace, p) in enumerate(zip(traced.traces, positions, strict=True)):
        erased = erase(b, trace, p) if erase is not None and request.check else None
        sentences.append(analyse(request, trace, p, methods, erased))
    first = sentences[0].erasures
    return TokensResult(traced.source, traced.causal, methods, sentences,
                        summarize(sentences, methods), request.heads, request.residual_weight,
                        None if first is None else first.measure,
                        None if first is None else first.how,
                        traced.notes + [n for n in repeated if n is not None] + left_out)


def _run_bundled(request: TokensRequest) -> TokensResult:
    from attnviz.compute.forward_pass.device import resolve_device
    from attnviz.compute.forward_pass.inputs import make_batch
    from attnviz.core.request import SourceSpec
    from attnviz.sources import bundled, tokens_bundled
    from attnviz.sources.registry import open_source

    if request.dtype is not Dtype.FLOAT32:
        raise UsageError(f"{option('dtype')} applies to {option('model')}",
                         fix=f"drop {option('dtype')}", option="dtype")
    store = open_source(SourceSpec()).store
    batch = make_batch(request.sentences, request.max_tokens, request.max_sentences,
                       bundled.token_limit(store, "the bundled model"))
    model = tokens_bundled.TinyModel(store, resolve_device(request.device))
    budget = budget_bytes(request.memory_budget)
    baseline = None
    if request.erase is Erase.BASELINE:
        baseline = request.baseline or tokens_bundled.BASELINE_WORD

    def erase(_: int, trace: TokenTrace, p: int) -> Erasures:
        per_pass = tokens_bundled.copies_per_pass(model, len(trace.tokens), budget)
        return tokens_bundled.erasures(model, trace.tokens, p, baseline, per_pass)

    traced = _Traced(str(store.source), True, tokens_bundled.traces(model, batch.tokens), True,
                     [])
    return _finish(request, traced, erase)


def _run_model(request: TokensRequest) -> TokensResult:
    from attnviz.sources.hf import token_contributions
    from attnviz.sources.hf.load import check_load_options

    assert request.model is not None
    check_load_options(request.device, str(request.dtype), None)
    opened, rows, tokens, decoder = token_contributions.open_inputs(
        request.model, request.sentences,
        None if request.targets is None else list(request.targets), request.max_tokens,
        request.max_sentences)
    _refuse_flow_early(request, rows, decoder)
    runner = token_contributions.load_runner(opened, request.device, str(request.dtype))
    baseline = None
    if request.check and request.erase is Erase.BASELINE:
        baseline = token_contributions.baseline_id(runner, request.baseline)
    name = "" if baseline is None else \
        request.baseline or token_contributions.baseline_name(runner, baseline)
    spec = token_contributions.EraseSpec(baseline, name, budget_bytes(request.memory_budget))
    if decoder is not None:
        return _run_cross(request, runner, rows, decoder, spec)
    found = token_contributions.traces(runner, rows, tokens)
    runner.causal = token_contributions.seen_causal(runner, found)

    def erase(b: int, _: TokenTrace, p: int) -> Erasures:
        return token_contributions.erasures(runner, rows[b], p, spec)

    traced = _Traced(str(opened.folder), runner.causal, found, runner.block is not None,
                     token_contributions.notes(runner))
    return _finish(request, traced, erase)


def _refuse_flow_early(request: TokensRequest, rows: list[list[int]],
                       decoder: list[list[int]] | None) -> None:
    """--method flow past its token limit, refused before the weights load: the token counts
    are known then. The layers are not (a hybrid model's config counts layers that return no
    map), so the graph's edges are checked after the forward, with the maps in hand."""
    from attnviz.compute.tokenflow.maxflow import FLOW_MAX_TOKENS

    if request.methods is None or TokenMethod.FLOW not in request.methods:
        return
    if decoder is None:
        nodes = max(len(r) for r in rows)
    else:
        nodes = max(len(r) + len(d) for r, d in zip(rows, decoder, strict=True))
    if nodes > FLOW_MAX_TOKENS:
        raise UsageError(f"attention flow solves one exact max flow per input token over "
                         f"layers × L² edges in plain Python; {nodes} tokens is past its limit "
                         f"of {FLOW_MAX_TOKENS} tokens", fix=f"drop flow from "
                         f"{option('method')}, or pass a shorter sentence", option="method")


def _run_cross(request: TokensRequest, runner: ModelRunner, rows: list[list[int]],
               decoder: list[list[int]], spec: EraseSpec) -> TokensResult:
    """The decoder's view of the source: every method from a decoder position through the
    decoder's self- and cross-attention and the encoder, checked by erasing source tokens."""
    from attnviz.compute.tokenflow.cross import cross_levels
    from attnviz.sources.hf import token_cross

    contributions = {TokenMethod.NORMS, TokenMethod.ALTI}
    wanted = request.methods is None or bool(contributions & set(request.methods))
    found = token_cross.cross_traces(runner, rows, decoder, terms=wanted)
    longest = max(len(t.source) + len(t.target) for t in found)
    levels = cross_levels(len(found[0].encoder), len(found[0].decoder))
    decomposed = token_cross.decoder_row(runner) is not None
    methods, left_out = chosen_methods(request, longest, levels, decomposed)
    sentences = []
    for b, trace in enumerate(found):
        p = output_position(trace.target, request.position, True,
                            b if len(found) > 1 else None)
        repeated = repeated_word_note(trace.target, request.position, p, b)
        if repeated is not None:
            left_out.append(repeated)
        erased = token_cross.cross_erasures(runner, rows[b], decoder[b], p, spec) \
            if request.check else None
        sentences.append(analyse_cross(request, trace, p, methods, erased))
    first = sentences[0].erasures
    notes = [f"the decoder's view of the source: each method from the decoder position through "
             f"the decoder's self- and cross-attention, then the encoder (drop "
             f"{option('target')} for the encoder's own)"]
    if not decomposed:
        from attnviz.errors import printable

        notes.append(f"model type {printable(str(runner.config.model_type))!r}: attnviz does "
                     "not decompose this encoder-decoder's sublayers")
    return TokensResult(str(runner.source), False, methods, sentences,
                        summarize(sentences, methods), request.heads, request.residual_weight,
                        None if first is None else first.measure,
                        None if first is None else first.how, notes + left_out)


def analyse_cross(request: TokensRequest, trace: CrossTrace, position: int,
                  methods: tuple[TokenMethod, ...], erasures: Erasures | None
                  ) -> SentenceTokens:
    """Every method on one sentence's decoder view: per method a chain over the source tokens
    down the encoder's layers (row 0 the source tokens) and the share left on the decoder's
    own tokens; each one's correlation with erasing source tokens."""
    import torch

    from attnviz.compute.tokenflow import cross, cross_parts, decompose

    chains: dict[TokenMethod, torch.Tensor] = {}
    shares: dict[TokenMethod, torch.Tensor] = {}
    own: dict[TokenMethod, list[torch.Tensor]] = {}
    chain, share, matrices = cross.cross_rollout(trace.encoder, trace.decoder, trace.cross,
                                                 position, request.heads,
                                                 request.residual_weight)
    if TokenMethod.ROLLOUT in methods:
        chains[TokenMethod.ROLLOUT], shares[TokenMethod.ROLLOUT] = chain, share
    if TokenMethod.FLOW in methods:
        # from the inputs only (one max flow per source and decoder token): the rows between
        # and at the encoder's output are NaN (not computed)
        flow, kept = cross.cross_flow(trace.encoder, trace.decoder, trace.cross, position,
                                      request.heads, request.residual_weight)
        chains[TokenMethod.FLOW] = torch.cat([flow[None],
                                              torch.full_like(chain[1:], float("nan"))])
        shares[TokenMethod.FLOW] = kept
    asked = tuple(m for m in methods if m in decompose.CONTRIBUTION_METHODS)
    if asked:
        assert trace.blocks is not None
        composed = cross_parts.compose_cross(trace.blocks, position,
                                             budget_bytes(request.memory_budget), asked,
                                             keep=request.keep_matrices)
        for m, c in composed.items():
            chains[m], shares[m], own[m] = c.chain, c.decoder_share, c.matrices
    if not request.keep_matrices:
        matrices, own = [], {}
    s = SentenceTokens(trace.source, position,
                       [f"encoder layer {i}" for i in range(len(trace.encoder))],
                       {m: chains[m] for m in methods}, matrices,
                       {m: own.get(m, matrices) for m in methods}, output_tokens=trace.target,
                       decoder_share=shares.get(TokenMethod.ROLLOUT),
                       decoder_shares={m: shares[m] for m in methods})
    return _checked(s, erasures, chains, methods)
