"""The split proof (`split --model --verify`): attnviz's head slicing checked through the
model's own forward pass, by negating one head's rows at a time.

Nothing is recomputed, so no family's position scheme, norm or scaling has to be known: for
each head, the rows attnviz assigns to it (its AttentionLayer: q_rows / kv_rows, wherever the
packing stores them) are negated in the model's own parameters, the model runs again, and
only that head may change:

- W_q rows (and bias) of query head h → head h's map changes, every other head's map stays
  equal to float round-off. Negation, unlike zeroing, keeps any norm over the whole projection
  unchanged (OLMo 2 normalizes the full query vector), and passes through RoPE and per-head norms;
- W_k rows (and bias) of key/value head g → exactly the query heads of group g change;
- W_v rows (and bias) of key/value head g → exactly those heads' slices of the input to W_o
  (attnviz's o_cols, captured by a forward pre-hook on the output projection) change.

A head whose map is uniform either way (all scores equal) cannot show a change: it is reported
as untestable, not passed. Packed storage is perturbed where it lives: fused qkv rows,
interleaved NeoX/BLOOM/Falcon rows, and Conv1D (stored (in, out)) columns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from attnviz.core.layer import AttentionLayer
from attnviz.core.tensor_ref import TensorRef
from attnviz.errors import CheckpointError, printable
from attnviz.sources.hf import capture, collect, guard, layers, run
from attnviz.sources.hf.layers import ModelLayer, ModelRun, Plan, RunInputs, plan_run
from attnviz.sources.hf.load import LoadedModel
from attnviz.sources.hf.split_proof_result import (
    CHANGED_FACTOR,
    UNCHANGED,
    UNIFORM,
    HeadCheck,
    ProofResult,
)
from attnviz.sources.hf.verify import call_of, module_of, parameter_of


class _Stop(Exception):
    """Raised once the layer's output projection has its input: later layers need not run."""


class _Observer:
    """Runs the model and returns one layer's maps and the input of its output projection,
    both realigned to each sentence's real tokens."""

    def __init__(self, loaded: LoadedModel, plan: Plan, call: ModelLayer,
                 o_module: Any) -> None:
        self.loaded, self.call, self.o_module = loaded, call, o_module
        self.plan = Plan(plan.prepared, plan.layers, [call])
        self.early = loaded.path == capture.CapturePath.INTERFACE

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        collector = collect.Collector(self.plan, {})
        seen: list[torch.Tensor | None] = []

        def hook(module: Any, args: tuple, kwargs: dict) -> None:
            x = args[0] if args else next(iter(kwargs.values()), None)
            seen.append(x.detach().float().cpu() if isinstance(x, torch.Tensor) else None)
            if len(seen) > self.call.occurrence and self.early:
                raise _Stop

        handle = self.o_module.register_forward_pre_hook(hook, with_kwargs=True)
        prepared = self.plan.prepared
        try:
            with guard.silenced():
                capture.capture(prepared.runner, prepared.feed, [self.call.index], None, collector)
        except _Stop:
            pass
        finally:
            handle.remove()
        maps = collector.maps.get(self.call.index)
        if maps is None:
            raise CheckpointError(f"the forward pass did not reach {self.call.full_name!r}",
                                  fix="report this model to attnviz")
        o_input = seen[self.call.occurrence] if len(seen) > self.call.occurrence else None
        if o_input is not None:
            offsets, _ = layers.offsets(self.plan, self.call)
            lengths = [len(t) for t in layers.rows_tokens(self.plan, self.call)]
            if o_input.ndim != 3 or o_input.shape[0] != len(lengths):
                o_input = None
            else:
                o_input = run.realign_rows(o_input, offsets, lengths)
        return maps, o_input


def _rows_text(ref: TensorRef, start: int, stop: int) -> str:
    return ref.take(((start, stop),)).describe()


@contextlib.contextmanager
def negated(model: Any, refs: list[tuple[TensorRef, int, int]]) -> Iterator[None]:
    """Rows start:stop (of each reference's canonical (out, in) view) negated in the model's own
    parameters for the duration; negation is exact, so undoing it restores every bit."""
    touched = []
    with torch.no_grad():
        for ref, start, stop in refs:
            _, param = parameter_of(model, ref.key)
            # the reference's own decoder, on the parameter: views, so negation lands in it
            for part in ref.take(((start, stop),)).row_blocks(ref.oriented(param)):
                part.neg_()
                touched.append(part)
    try:
        yield
    finally:
        with torch.no_grad():
            for part in touched:
                part.neg_()


def _check_parameters(loaded: LoadedModel, refs: list[TensorRef]) -> None:
    """The model must hold exactly the checkpoint's tensors where attnviz points (transformers
    may convert weights on load; then attnviz's rows would not be the model's)."""
    for ref in {ref.key: ref for ref in refs}.values():
        name, param = parameter_of(loaded.model, ref.key)
        if tuple(param.shape) != tuple(ref.stored_shape):
            raise CheckpointError(f"the model's parameter {printable(name)!r} has shape "
                                  f"{tuple(param.shape)}, the checkpoint's "
                                  f"{printable(ref.key)!r} {tuple(ref.stored_shape)}",
                                  fix="report this model to attnviz")
        stored = loaded.store.read(ref.key).to(param.dtype)
        if not torch.equal(stored, param.detach().cpu()):
            raise CheckpointError(f"the model's parameter {printable(name)!r} differs from the "
                                  f"checkpoint's {printable(ref.key)!r}: transformers converted "
                                  "it on load", fix="report this model to attnviz")


def _map_deltas(base: torch.Tensor, other: torch.Tensor) -> tuple[float, ...]:
    """Per head: max |Δ| over every sentence's real rows and columns (padding is zero in both)."""
    return tuple((base - other).abs().transpose(0, 1).flatten(1).amax(1).tolist())


def _spread(maps: torch.Tensor, head: int) -> float:
    """How far head `head`'s rows are from uniform over their unmasked keys (0: uniform)."""
    w = maps[:, head]  # (B, n, m)
    positive = w > 0
    top = w.masked_fill(~positive, float("-inf")).amax(-1)
    bottom = w.masked_fill(~positive, float("inf")).amin(-1)
    spread = torch.where(positive.any(-1), top - bottom, torch.zeros_like(top))
    return float(spread.max())


def prove_split(loaded: LoadedModel, layer: AttentionLayer, sentences: list[str],
                targets: list[str] | None = None, *,
                described: AttentionLayer | None = None) -> ProofResult:
    """The split proof of attnviz's `layer` (found in the model by its W_q's module);
    `described` replaces the description whose rows are perturbed (tests: a wrong one)."""
    used = described or layer
    heads = used.num_heads or 0
    plan = plan_run(loaded, RunInputs(sentences,
                                      targets if loaded.encoder_decoder else None),
                       None, ModelRun(need_layers=True))
    call = call_of(plan.layers, loaded.model, layer)
    if call.num_heads is not None and call.num_heads != heads:
        raise CheckpointError(f"attnviz describes {heads} query heads, the model's attention "
                              f"call has {call.num_heads}", fix="report this model to attnviz")
    o_name, _ = parameter_of(loaded.model, used.o_weight.key)
    _, o_module = module_of(loaded.model, o_name)
    _check_parameters(loaded, [ref for ref in (used.q_weight, used.q_bias, used.k_weight,
                                               used.k_bias, used.v_weight, used.v_bias)
                               if ref is not None])
    observe = _Observer(loaded, plan, call, o_module)
    base_maps, base_o = observe()
    unchanged = UNCHANGED[loaded.dtype]
    judge = _MapJudge(base_maps, unchanged, unchanged * CHANGED_FACTOR)
    checks = _map_checks(loaded.model, used, observe, judge)
    notes = []
    if base_o is None:
        notes.append("the input of the output projection was not captured: W_v not checked")
    else:
        checks += _value_checks(loaded.model, used, observe, base_o, judge)
    return ProofResult(call.index, call.label, call.full_name, used, checks, unchanged,
                       judge.changed, len(sentences), notes)


def _parts(weight: TensorRef, bias: TensorRef | None, start: int, stop: int
           ) -> list[tuple[TensorRef, int, int]]:
    return [(ref, start, stop) for ref in (weight, bias) if ref is not None]


def _group(used: AttentionLayer, g: int) -> tuple[int, ...]:
    """The query heads that attend with key/value head g."""
    return tuple(h for h in range(used.num_heads or 0) if used.kv_head_of(h) == g)


@dataclass(frozen=True)
class _MapJudge:
    """Whether negating some rows changed exactly the expected heads' maps."""

    base_maps: torch.Tensor
    unchanged: float
    changed: float

    def __call__(self, projection: str, head: int, rows: str, expected: tuple[int, ...],
                 maps: torch.Tensor) -> HeadCheck:
        deltas = _map_deltas(self.base_maps, maps)
        if any(d > self.unchanged for h, d in enumerate(deltas) if h not in expected):
            return HeadCheck(projection, head, rows, expected, deltas, "fail",
                             "a head attnviz does not assign these rows to changed")
        quiet = [h for h in expected if deltas[h] <= self.changed]
        if not quiet:
            return HeadCheck(projection, head, rows, expected, deltas, "pass")
        if all(max(_spread(self.base_maps, h), _spread(maps, h)) <= UNIFORM for h in quiet):
            return HeadCheck(projection, head, rows, expected, deltas, "untestable",
                             f"head {quiet[0]}'s map is uniform either way")
        return HeadCheck(projection, head, rows, expected, deltas, "fail",
                         f"head {quiet[0]}'s map did not change")


def _map_checks(model: Any, used: AttentionLayer, observe: _Observer,
                judge: _MapJudge) -> list[HeadCheck]:
    """W_q rows of each query head, then W_k rows of each key/value head, judged by the maps."""
    checks = []
    for h in range(used.num_heads or 0):
        start, stop = used.q_rows(h)
        with negated(model, _parts(used.q_weight, used.q_bias, start, stop)):
            maps, _ = observe()
        checks.append(judge("q", h, _rows_text(used.q_weight, start, stop), (h,), maps))
    for g in range(used.num_kv_heads or 0):
        start, stop = used.kv_rows(g)
        with negated(model, _parts(used.k_weight, used.k_bias, start, stop)):
            maps, _ = observe()
        checks.append(judge("k", g, _rows_text(used.k_weight, start, stop), _group(used, g),
                            maps))
    return checks


def _value_checks(model: Any, used: AttentionLayer, observe: _Observer, base_o: torch.Tensor,
                  judge: _MapJudge) -> list[HeadCheck]:
    """W_v rows of each key/value head, judged by each head's slice of the W_o input."""
    heads = used.num_heads or 0
    scale = max(1.0, float(base_o.abs().max()))
    unchanged, changed = judge.unchanged * scale, judge.changed * scale
    checks = []
    for g in range(used.num_kv_heads or 0):
        start, stop = used.kv_rows(g)
        group = _group(used, g)
        with negated(model, _parts(used.v_weight, used.v_bias, start, stop)):
            _, o_input = observe()
        assert o_input is not None
        deltas = tuple(float((base_o[..., a:b] - o_input[..., a:b]).abs().max())
                       for a, b in (used.o_cols(h) for h in range(heads)))
        if any(d > unchanged for h, d in enumerate(deltas) if h not in group):
            status, reason = "fail", "another head's slice of the W_o input changed"
        elif all(deltas[h] > changed for h in group):
            status, reason = "pass", ""
        elif all(float(base_o[..., slice(*used.o_cols(h))].abs().max()) <= changed
                 for h in group if deltas[h] <= changed):
            status, reason = "untestable", "the head's output is zero either way"
        else:
            status, reason = "fail", "the head's slice of the W_o input did not change"
        checks.append(HeadCheck("v", g, _rows_text(used.v_weight, start, stop), group, deltas,
                                status, reason))
    return checks
