"""`attnviz lens`: the logit lens — each layer's residual (the embeddings, then each layer's
output) passed through the model's own final norm (its own statistics per layer, never the last
layer's) and unembedding, and the model's logit transform (a softcap as the model applies it):
per layer × position, the top tokens and the answer's rank and probability. The last row is
the model's own output. The math: compute/logit/lens_grid."""

from __future__ import annotations

from dataclasses import dataclass, field

from attnviz.app.logit_source import (
    BUNDLED_PROMPT,
    MAX_PROMPTS,
    encode,
    open_logit_source,
    resolve_position,
)
from attnviz.compute.logit.lens_grid import lens_grid
from attnviz.compute.logit.lens_result import Cell, LensResult, PromptLens
from attnviz.core.choices import Dtype
from attnviz.errors import UsageError, option

MAX_TOP = 20


@dataclass(frozen=True)
class LensRequest:
    prompts: list[str] = field(default_factory=list)  # none: the bundled model's prompt
    model: str | None = None
    answer: str | None = None  # None: the model's own top prediction at the last position
    positions: list[int] = field(default_factory=list)  # none: every position
    top: int = 3
    device: str = "auto"
    dtype: Dtype = Dtype.FLOAT32
    targets: list[str] = field(default_factory=list)  # encoder-decoders: the decoder's texts


def run_lens(request: LensRequest) -> LensResult:
    """The lens of every prompt at the chosen positions."""
    if not 1 <= request.top <= MAX_TOP:
        raise UsageError(f"{option('top')} must be from 1 to {MAX_TOP}", option="top")
    source = open_logit_source(request.model, request.device, request.dtype)
    texts = request.prompts or ([BUNDLED_PROMPT] if request.model is None else [])
    if not texts:
        raise UsageError(f"{option('model')} needs a prompt", fix="give one or more prompts")
    if len(texts) > MAX_PROMPTS:
        raise UsageError(f"{len(texts)} prompts; the lens shows at most {MAX_PROMPTS}",
                         fix="split them over several runs")
    encoded = encode(source, texts, -1, request.targets)
    columns = [_columns(request.positions, len(ids), n)
               for n, ids in enumerate(encoded.ids)]
    run = source.run(encoded, columns)
    assert run.lens is not None
    notes = list(run.notes)
    if request.answer is not None:
        answers = [source.token_id(request.answer, "answer")] * len(texts)
    else:
        answers = run.logits.argmax(-1).tolist()
        notes.append("no answer given: the answer is the model's own top prediction at each "
                     "prompt's last position")
    found = []
    for b in range(len(texts)):
        grid = lens_grid(run.lens.rows(b), columns[b], answers[b], request.top)
        rows = ["embeddings"] + [f"layer {i}" for i in range(grid.rows - 1)]
        cells = [[Cell([(source.name_of(int(i)), float(p)) for i, p in
                        zip(grid.top_ids[r, c].tolist(), grid.top_probs[r, c].tolist(),
                            strict=True)],
                       None if grid.answer_rank is None else int(grid.answer_rank[r, c]),
                       None if grid.answer_prob is None else float(grid.answer_prob[r, c]))
                  for c in range(len(columns[b]))] for r in range(grid.rows)]
        found.append(PromptLens(encoded.texts[b], encoded.tokens[b], columns[b], rows, cells,
                                (answers[b], source.name_of(answers[b]))))
    return LensResult(run.model, run.norm.kind.value + f", {run.norm_name}",
                      run.transform.describe(), found, notes)


def _columns(positions: list[int], length: int, n: int) -> list[int]:
    """The chosen positions of prompt n (every position when none are given)."""
    if not positions:
        return list(range(length))
    return [resolve_position(p, length, f"prompt {n + 1}") for p in positions]
