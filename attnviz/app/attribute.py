"""`attnviz attribute`: direct logit attribution — each head's, each layer's attention and MLP
output's and the embeddings' direct contribution to the metric (logit(answer) − logit(wrong) at
the chosen position, or logit(answer)), through the final norm with its scale frozen at the run
being decomposed. The parts, their sum and the remainder against the model's own metric; with
`corrupt`, the difference clean − corrupted part by part. The math: compute/logit."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attnviz.app.logit_source import (
    BUNDLED_PROMPT,
    MAX_PROMPTS,
    LogitSource,
    encode,
    open_logit_source,
)
from attnviz.compute.logit.attribute_result import (
    PART_FIELDS,
    AttributeResult,
    Parts,
    PromptAttribution,
)
from attnviz.compute.logit.direct_attribution import Attribution, Unembedding, attribute
from attnviz.compute.logit.lens_grid import uncap
from attnviz.compute.logit.logit_run import LogitRun
from attnviz.core.choices import Dtype
from attnviz.errors import UsageError, option


@dataclass(frozen=True)
class AttributeRequest:
    """Prompts (none: the bundled model's built-in induction prompt) and the metric."""

    prompts: list[str] = field(default_factory=list)
    model: str | None = None
    answer: str | None = None  # None: the model's top prediction
    wrong: str | None = None  # None: the runner-up when answer is None, else no wrong token
    position: int = -1
    corrupt: list[str] = field(default_factory=list)  # one per prompt, or none
    pairs: Path | None = None  # a TSV / JSON-lines file of clean, corrupt, answer[, wrong]
    device: str = "auto"
    dtype: Dtype = Dtype.FLOAT32
    top: int = 10  # the parts listed by size
    targets: list[str] = field(default_factory=list)  # encoder-decoders: the decoder's texts


def run_attribute(request: AttributeRequest) -> AttributeResult:
    """Direct logit attribution of every prompt (and its corrupted twin), MAX_PROMPTS
    prompts a forward."""
    _check(request)
    return attribute_opened(open_logit_source(request.model, request.device, request.dtype),
                            request)


def attribute_opened(source: LogitSource, request: AttributeRequest) -> AttributeResult:
    """`run_attribute` on a source already opened (benchmarks/run.py times this part against
    one forward of the same model)."""
    work = _work(source, request)
    results: list[PromptAttribution] = []
    for start in range(0, len(work.texts), MAX_PROMPTS):
        chunk = slice(start, start + MAX_PROMPTS)
        clean = encode(source, work.texts[chunk], request.position, work.targets[chunk])
        run = source.run(clean, None)
        answers, wrongs = _targets(source, request, run, work, chunk)
        found = _decompose(source, run, answers, wrongs, clean.texts)
        if work.corrupt:
            corrupt = encode(source, work.corrupt[chunk], request.position,
                             work.targets[chunk])
            other = source.run(corrupt, None)
            twins = _decompose(source, other, answers, wrongs, corrupt.texts)
            found = [_with_corrupt(c, t) for c, t in zip(found, twins, strict=True)]
        results += found
    notes = list(run.notes)
    if work.corrupt:
        notes.append("the difference is clean − corrupted, part by part, each run decomposed "
                     "at its own frozen final-norm scale")
    if request.answer is None and request.pairs is None:
        notes.append("no answer given: the answer is the model's top prediction and the wrong "
                     "token its runner-up, per prompt")
    metric = "logit(answer)" if wrongs is None else "logit(answer) − logit(wrong)"
    softcapped = run.transform.softcap is not None
    if softcapped:
        notes.append("the model softcaps its logits (nonlinear): the parts add up to the "
                     "logits before the softcap (cap·atanh(logit/cap) of the model's own); the "
                     "model's own metric after the softcap is shown beside them")
    return AttributeResult(run.model, metric + " at the chosen position", run.norm.kind.value
                           + f", {run.norm_name}", run.transform.describe(), softcapped,
                           results, request.top, notes)


@dataclass(frozen=True)
class _Work:
    """The prompts to decompose, their corrupted twins, and (pairs) each one's answer and
    wrong token ids."""

    texts: list[str]
    corrupt: list[str]
    targets: list[str]  # an encoder-decoder's decoder texts, one per prompt (else none)
    answers: list[int] | None = None
    wrongs: list[int] | None = None


def _work(source: LogitSource, request: AttributeRequest) -> _Work:
    """The prompts given, the bundled model's built-in one, or the pairs of a file (read and
    tokenized with the patch command's rules: equal lengths, one-token answers)."""
    if request.pairs is None:
        texts = request.prompts or ([BUNDLED_PROMPT] if request.model is None else [])
        if not texts:
            raise UsageError(f"{option('model')} needs a prompt", fix="give one or more prompts")
        return _Work(texts, request.corrupt, request.targets)
    from attnviz.compute.patching.pairs import read_pairs, tokenize_pair
    from attnviz.core.choices import PatchMetric

    pairs = read_pairs(request.pairs)
    if len({p.wrong is None for p in pairs}) > 1:
        raise UsageError("some pairs give a wrong answer and some do not: the metric is one "
                         "for all", fix="give every pair a wrong answer, or none",
                         option="pairs")
    metric = PatchMetric.LOGPROB if pairs[0].wrong is None else PatchMetric.LOGIT_DIFF
    tokenized = [tokenize_pair(pair, source, metric, n + 1) for n, pair in enumerate(pairs)]
    if request.targets:
        raise UsageError(f"{option('pairs')} and {option('target')} do not go together yet",
                         fix=f"give the pair on the command line with {option('target')}",
                         option="target")
    return _Work([p.clean for p in pairs], [p.corrupt for p in pairs], [],
                 [t.answer[0] for t in tokenized],
                 None if metric is PatchMetric.LOGPROB else [t.wrong or 0 for t in tokenized])


def _check(request: AttributeRequest) -> None:
    if request.pairs is not None:
        given = [name for name, value in (("corrupt", request.corrupt), ("answer",
                 request.answer), ("wrong", request.wrong)) if value]
        if request.prompts or given:
            raise UsageError(f"{option('pairs')} gives the prompts, corrupted prompts and "
                             f"answers itself", fix="drop "
                             + (", ".join(option(n) for n in given) or "the prompts"),
                             option="pairs")
    if request.wrong is not None and request.answer is None:
        raise UsageError(f"{option('wrong')} needs {option('answer')}",
                         fix=f"give {option('answer')} too", option="wrong")
    if request.corrupt and len(request.corrupt) != max(1, len(request.prompts)):
        raise UsageError(f"{len(request.corrupt)} corrupted prompts for "
                         f"{max(1, len(request.prompts))} prompts", fix="give one "
                         f"{option('corrupt')} per prompt", option="corrupt")
    if request.top < 1:
        raise UsageError(f"{option('top')} must be positive", option="top")


def _targets(source: LogitSource, request: AttributeRequest, run: LogitRun, work: _Work,
             chunk: slice) -> tuple[list[int], list[int] | None]:
    """Each prompt's answer id and wrong id (None: the metric is the answer's logit)."""
    B = len(run.positions)
    if work.answers is not None:
        return work.answers[chunk], None if work.wrongs is None else work.wrongs[chunk]
    if request.answer is None:
        top = run.logits.topk(2, dim=-1).indices  # (B, 2)
        return top[:, 0].tolist(), top[:, 1].tolist()
    answer = source.token_id(request.answer, "answer")
    if request.wrong is None:
        return [answer] * B, None
    wrong = source.token_id(request.wrong, "wrong")
    if wrong == answer:
        raise UsageError("the answer and the wrong token are the same token",
                         fix="give two different tokens", option="wrong")
    return [answer] * B, [wrong] * B


def _decompose(source: LogitSource, run: LogitRun, answers: list[int],
               wrongs: list[int] | None, texts: list[str]) -> list[PromptAttribution]:
    """Each prompt's attribution; the target is the model's own metric (un-softcapped)."""
    rows = torch.arange(len(answers))
    a = torch.tensor(answers)
    U, b_U = run.unembed_weight, run.unembed_bias
    direction = U[a].double()
    bias = torch.zeros(len(answers), dtype=torch.float64) if b_U is None else b_U[a].double()
    own = uncap(run.logits.double(), run.transform.softcap)  # (B, V)
    target = own[rows, a]
    metric = run.logits.double()[rows, a]
    if wrongs is not None:
        w = torch.tensor(wrongs)
        direction = direction - U[w].double()
        if b_U is not None:
            bias = bias - b_U[w].double()
        target = target - own[rows, w]
        metric = metric - run.logits.double()[rows, w]
    found = attribute(run.parts, run.norm, Unembedding(direction, bias, run.transform.factor),
                      target)
    return [PromptAttribution(
        texts[b], run.tokens[b], run.positions[b], (answers[b], source.name_of(answers[b])),
        None if wrongs is None else (wrongs[b], source.name_of(wrongs[b])),
        float(found.scale[b]), float(metric[b]), _parts(found, b))
        for b in range(len(answers))]


def _parts(found: Attribution, b: int) -> Parts:
    def column(t: torch.Tensor | None) -> Any:
        return None if t is None else t[..., b].tolist()

    return Parts(float(found.embed[b]), column(found.attn), column(found.mlp),
                 column(found.heads), column(found.attn_bias), float(found.norm_bias[b]),
                 float(found.head_bias[b]), float(found.total[b]), float(found.target[b]),
                 float(found.remainder[b]), column(found.cross), column(found.cross_heads),
                 column(found.cross_bias))


def _with_corrupt(clean: PromptAttribution, corrupt: PromptAttribution) -> PromptAttribution:
    from dataclasses import replace

    return replace(clean, corrupt=corrupt, difference=_minus(clean.parts, corrupt.parts))


def _minus(a: Parts, b: Parts) -> Parts:
    def each(x: Any, y: Any) -> Any:
        if x is None or y is None:
            return None
        if isinstance(x, list):
            return [each(u, v) for u, v in zip(x, y, strict=True)]
        return x - y

    return Parts(*(each(getattr(a, f), getattr(b, f)) for f in PART_FIELDS))


EXPORT_SUFFIXES = (".json", ".safetensors")


def export_attribution(result: AttributeResult, path: Path, document: str) -> None:
    """--export: the --json document (`document`, .json), or (.safetensors) every part as
    tensors — per prompt p: embed (P,), attn (P, N), mlp (P, N), heads (P, N, H), wo_bias
    (P, N), final_norm_bias, unembedding_bias, sum, model_metric, remainder (P,), the same
    with a `difference.` prefix for clean − corrupted — and the document as metadata."""
    from attnviz.app.outputs import write_output

    if path.suffix.lower() == ".json":
        write_output(path, lambda tmp: tmp.write_text(document, encoding="utf-8"))
        return
    from safetensors.torch import save_file

    tensors = _tensors("", [p.parts for p in result.prompts])
    differences = [p.difference for p in result.prompts]
    if all(d is not None for d in differences):
        tensors.update(_tensors("difference.", [d for d in differences if d is not None]))
    write_output(path, lambda tmp: save_file(tensors, str(tmp), metadata={
        "attnviz": "attribute", "document": document}))


def _tensors(prefix: str, parts: list[Parts]) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for name, value in parts[0].to_json().items():
        if value is not None:
            found[prefix + name] = torch.tensor([p.to_json()[name] for p in parts],
                                                dtype=torch.float64)
    return found
