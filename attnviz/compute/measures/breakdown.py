"""--query: one query's attention recomputed head by head, term by term (q_h, k_h, q_h·k_h, the
scaled scores, the weights), through the kernel, and checked against the maps the run produced.
Standalone layers recompute from attnviz's weight slices (with the model's positions where it
has them); captured models from the q_h and k_h their own attention function received.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnviz.compute.forward_pass import kernel
from attnviz.compute.forward_pass.forward import load_weights, per_head_forward
from attnviz.compute.forward_pass.inputs import Batch
from attnviz.compute.forward_pass.positions import (
    SCHEMES,
    Positions,
    positions_for,
    recompute_heads,
)
from attnviz.compute.forward_pass.results import AttentionRun, CapturedScores, LayerAttention
from attnviz.errors import CheckFailed, UsageError, option
from attnviz.load.config import model_type


@dataclass(frozen=True)
class HeadBreakdown:
    head: int
    kv_head: int
    q_rows: tuple[int, int]
    q: list[float]  # q_h of the query token: its slice of the projected query (d,)
    keys: list[list[float]]  # k_h of every key token (S, d)
    dots: list[float]  # q_h · k_h
    scores: list[float]  # scale · q_h · k_h (before mask and softmax)
    weights: list[float]  # after mask and softmax


@dataclass(frozen=True)
class QueryBreakdown:
    sentence: int
    query: int
    token: str
    layer: int
    scale: float
    heads: list[HeadBreakdown]
    max_diff: float  # recomputed weights vs the run's weights
    positions: str = "none"  # what was applied to q_h and k_h besides projection (RoPE, …)
    # "slices": recomputed from attnviz's W_q/W_k slices; "captured": from the q_h and k_h the
    # model's own attention function received (after its own positions, whatever they are)
    source: str = "slices"
    layer_label: str | None = None
    added: str = ""  # what the model adds to the scores before softmax besides the mask


def query_breakdown(run: AttentionRun, layer_index: int, sentence: int,
                    query: int) -> QueryBreakdown:
    """Recompute one query's attention head by head from the weight slices, and check it
    against the maps the run produced."""
    captured = run.layer(layer_index)
    if captured.call is not None and captured.call.scores is not None:
        return captured_breakdown(run, captured, sentence, query)
    layer = captured.layer
    if layer is None or run.store is None:
        raise UsageError(f"{option('query')} needs the q and k the model's attention receives, "
                         "and this run did not keep them", fix=f"drop {option('query')}",
                         option="query")
    n = run.batch.lengths[sentence]
    assert captured.inputs is not None  # the last layer always keeps its inputs
    x = captured.inputs[sentence : sentence + 1, :n]
    key = x if captured.key_inputs is None else captured.key_inputs[sentence : sentence + 1, :n]
    value = x if captured.value_inputs is None else \
        captured.value_inputs[sentence : sentence + 1, :n]
    weights = load_weights(layer, run.store)
    positions = _model_positions(run, captured, n)
    with torch.no_grad():
        if positions is None:
            mask = kernel.causal_mask(n) if run.causal else None
            parts = per_head_forward(layer, weights, x, key, value, None, mask)
            q, k, scores, attn = parts.q, parts.k, parts.scores, parts.attn
        else:
            recomputed = recompute_heads(layer, weights, x, [n], positions)
            q, k, scores, attn = (recomputed.q, recomputed.k, recomputed.scores,
                                  recomputed.weights)
    expected = _run_weights_of(captured, run.batch, sentence, query)
    got = attn[0, :, query]  # (H, S)
    max_diff = (got - expected).abs().max().item()
    if max_diff > run.tolerance:
        raise CheckFailed(f"recomputing query {query} from the slices differs from the run by "
                          f"{max_diff:.2e}", fix="report this")
    dots = scores[0, :, query] / layer.effective_scale
    heads = [HeadBreakdown(h, layer.kv_head_of(h), layer.q_rows(h), q[0, h, query].tolist(),
                           k[0, h].tolist(), dots[h].tolist(), scores[0, h, query].tolist(),
                           got[h].tolist())
             for h in range(layer.num_heads or 0)]
    return QueryBreakdown(sentence, query, run.batch.tokens[sentence][query], layer_index,
                          layer.effective_scale, heads, max_diff,
                          "none" if positions is None else positions.described)


def captured_breakdown(run: AttentionRun, captured: LayerAttention, sentence: int,
                       query: int) -> QueryBreakdown:
    """One query's scores head by head from the q_h and k_h the model's attention received:
    scaling · q_h·k_h (softcapped, plus any position bias, then the mask, as eager applies
    them), softmax; checked against the maps the run captured."""
    assert captured.call is not None and captured.call.scores is not None
    scores_in = captured.call.scores
    keys = len(captured.columns_of(run.batch)[sentence])
    p = scores_in.query_offsets[sentence] + query  # the query's row in the padded batch
    k0 = scores_in.key_offsets[sentence]
    with torch.no_grad():
        q = scores_in.query[sentence, :, p].float()  # (H, d)
        heads, groups = q.shape[0], q.shape[0] // scores_in.key.shape[1]
        k = scores_in.key[sentence].float().repeat_interleave(groups, dim=0)  # (H, S, d)
        dots = torch.einsum("hd,hsd->hs", q, k)  # (H, S)
        scores, added = _captured_scores(scores_in, dots, sentence, p)
        attn = _captured_softmax(scores_in, scores, sentence, p)
        if scores_in.sinks is not None:
            added.append("one sink logit per head")
    got = attn[:, k0:k0 + keys]  # (H, keys) real keys
    expected = _run_weights_of(captured, run.batch, sentence, query)
    max_diff = (got - expected).abs().max().item()
    if max_diff > run.tolerance:
        raise CheckFailed(f"recomputing query {query} from the captured q_h and k_h differs "
                          f"from the run by {max_diff:.2e}", fix="report this model to attnviz")
    d = q.shape[1]
    heads_out = [HeadBreakdown(h, h // groups, (h * d, (h + 1) * d), q[h].tolist(),
                               k[h, k0:k0 + keys].tolist(), dots[h, k0:k0 + keys].tolist(),
                               scores[h, k0:k0 + keys].tolist(), got[h].tolist())
                 for h in range(heads)]
    tokens = captured.rows_of(run.batch)[sentence]
    return QueryBreakdown(sentence, query, tokens[query], captured.index, scores_in.scaling,
                          heads_out, max_diff,
                          "the model's own: q_h and k_h as its attention function received "
                          "them (after its position scheme, if any)", "captured",
                          captured.stack_label(), "; ".join(added))


def _captured_scores(scores_in: CapturedScores, dots: torch.Tensor, sentence: int,
                     p: int) -> tuple[torch.Tensor, list[str]]:
    """The scores (H, S) before the mask, as eager builds them from dots: scaled, softcapped,
    plus any position bias; and what was added besides the scaling."""
    logits = dots * scores_in.scaling
    added = []
    if scores_in.softcap is not None:
        logits = torch.tanh(logits / scores_in.softcap) * scores_in.softcap
        added.append(f"softcap {scores_in.softcap:g}: tanh(s / c) · c")
    if scores_in.position_bias is not None:
        bias = scores_in.position_bias
        logits = logits + bias[min(sentence, bias.shape[0] - 1), :, p].float()
        added.append("the model's position bias (its mask included)")
    return logits, added


def _captured_softmax(scores_in: CapturedScores, scores: torch.Tensor, sentence: int,
                      p: int) -> torch.Tensor:
    """The kernel's masked softmax of one query row (H, S) under the model's own mask: a bool
    mask is Hugging Face's (True = may attend), flipped here; a float mask is added."""
    mask, sinks = scores_in.mask, scores_in.sinks
    masked = None
    if mask is not None:
        row = mask[min(sentence, mask.shape[0] - 1), :, p]  # (1|H, S)
        if row.dtype == torch.bool:
            masked = ~row
        else:
            scores = scores + row.float()
    return kernel.masked_softmax(scores, masked,
                                 None if sinks is None else sinks.float().reshape(-1, 1))


def _run_weights_of(captured: LayerAttention, batch: Batch, sentence: int,
                    query: int) -> torch.Tensor:
    """The run's weights of one query row, every head: (H, S) over real keys (+ bias_k)."""
    if captured.weights is None:
        kept = captured.streamed
        if kept is None or kept.query_row != (sentence, query) or kept.query_weights is None:
            raise UsageError("this streamed run kept no weights for that query",
                             fix=f"pass {option('query')} to the run that streams")
        return kept.query_weights
    columns = captured.columns_of(batch)
    width = max(len(t) for t in columns)
    expected = captured.weights[sentence, :, query, :len(columns[sentence])]
    extra = captured.weights.shape[-1] - width  # bias_k columns sit after the padding
    if extra:
        expected = torch.cat([expected, captured.weights[sentence, :, query, -extra:]], -1)
    return expected


def _model_positions(run: AttentionRun, captured: LayerAttention,
                     length: int) -> Positions | None:
    """How positions enter a model's attention (RoPE, sliding windows), for a --model run of a
    family attnviz can recompute; None where the inputs already carry them."""
    if not captured.method.startswith("transformers") or run.store is None \
            or captured.layer is None:
        return None
    kind = model_type(run.store.config)
    if kind in SCHEMES:
        return positions_for(run.store.config, captured.layer, captured.index, length)
    if captured.layer.positions not in ("none", "learned", "sinusoidal"):
        raise UsageError(f"{option('query')} does not recompute {captured.layer.positions} "
                         f"positions of model_type {kind!r}",
                         fix=f"supported: {', '.join(sorted(SCHEMES))}", option="query")
    return None
