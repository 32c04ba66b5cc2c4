"""Batched attention on sentences: one standalone layer, or the bundled attention-only model.

Results hold per-head maps (B, H, L, S) with padding still in place; `Batch.lengths` says which
rows and columns are real. Renderers slice; they never recompute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from attnviz.compute import kernel, layer_stream, streaming
from attnviz.compute.forward import (
    LayerWeights,
    build_torch_mha,
    load_weights,
    per_head_forward,
    reshaped_forward,
    torch_mha_expressible,
)
from attnviz.compute.inputs import Batch, input_vectors, padding_mask
from attnviz.compute.positions import SCHEMES, positions_for, recompute_heads
from attnviz.compute.results import (
    SDPA_TOLERANCE,
    AttentionRun,
    CapturedScores,
    LayerAttention,
)
from attnviz.core.layer import AttentionLayer
from attnviz.errors import CheckFailed, UsageError
from attnviz.load import config as hfconfig
from attnviz.load.checkpoint import TensorStore


def resolve_device(spec: str) -> torch.device:
    """auto → the first CUDA GPU, else MPS, else the CPU; an absent device is a usage error."""
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise UsageError(f"unknown device {spec!r}", fix="use auto, cpu, cuda, cuda:N or mps",
                         option="--device") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("CUDA is not available on this machine (or this torch build)",
                             fix="use --device cpu or auto", option="--device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"there is no GPU {device.index}; this machine has "
                             f"{torch.cuda.device_count()}", fix="choose another index",
                             option="--device")
    elif device.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise UsageError("MPS is not available on this machine", fix="use --device cpu",
                             option="--device")
    elif device.type != "cpu":
        raise UsageError(f"unsupported device {spec!r}", fix="use auto, cpu, cuda, cuda:N or mps",
                         option="--device")
    return device


def layer_attention(layer: AttentionLayer, weights: LayerWeights, x: torch.Tensor,
                    key: torch.Tensor, value: torch.Tensor, pad: torch.Tensor,
                    causal: bool) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(output, per-head weights, method) for query inputs x (B, L, E) and key/value inputs."""
    L = x.shape[1]
    mask = kernel.causal_mask(L, device=x.device) if causal else None
    with torch.no_grad():
        if torch_mha_expressible(layer):
            mha = build_torch_mha(layer, weights)
            # An explicit mask, never is_causal: the fast path ignores is_causal.
            out, attn = mha(x, key, value, key_padding_mask=pad, attn_mask=mask,
                            need_weights=True, average_attn_weights=False)
            return out, attn, "torch.nn.MultiheadAttention (need_weights=True)"
        parts = per_head_forward(layer, weights, x, key, value, pad, mask)
        sdpa_out, _ = reshaped_forward(layer, weights, x, key, value, pad, mask)
    scale = max(1.0, sdpa_out.abs().max().item())
    diff = (parts.out - sdpa_out).abs().max().item()
    if diff > SDPA_TOLERANCE * scale:
        raise CheckFailed(f"the per-head computation differs from "
                          f"F.scaled_dot_product_attention by {diff:.2e}", fix="report this")
    return parts.out, parts.attn, ("explicit per head (output checked against "
                                   f"F.scaled_dot_product_attention: max |Δ| {diff:.1e})")


def run_layer(layer: AttentionLayer, store: TensorStore | None, batch: Batch, causal: bool,
              positions: str, device: torch.device, weights_store: TensorStore,
              allow_stream: bool = True, query_row: tuple[int, int] | None = None,
              budget: int | None = None, sink: layer_stream.RowSink | None = None
              ) -> AttentionRun:
    """One standalone layer on a padded batch; inputs whose full maps exceed the memory budget
    stream in blocks of query rows (keeping the (sentence, query) row of every head for
    --query, and handing every full row to `sink`, which --export writes as it comes)."""
    x, described = input_vectors(batch, layer.embed_dim, store, positions)
    # Self-attention over the same sentence; kdim/vdim ≠ E layers get vectors of their width.
    key = x if layer.kdim == layer.embed_dim else input_vectors(batch, layer.kdim, None,
                                                                positions)[0]
    value = x if layer.vdim == layer.embed_dim else input_vectors(batch, layer.vdim, None,
                                                                  positions)[0]
    pad = padding_mask(batch)
    notes = []
    extra = 1 if layer.bias_k is not None else 0
    if allow_stream and streaming.streams(batch, layer.num_heads or 0, extra, budget):
        if sink is not None:
            sink.begin(described, x)
        streamed = layer_stream.stream_layer(layer, weights_store, batch, x, key, causal, device,
                                          query_row, budget, sink)
        streamed.key_inputs = None if key is x else key
        streamed.value_inputs = None if value is x else value
        notes.append("long input: maps computed one head and sentence at a time, in blocks of "
                     "query rows, and kept only at display size "
                     f"(≤ {streaming.DISPLAY_CELLS} per side); --export "
                     + ("wrote every full map block by block" if sink is not None else
                        "writes the full maps block by block"))
        return AttentionRun(batch, [streamed], weights_store.source, described, str(device),
                            causal, weights_store, notes)
    if sink is not None:
        raise ValueError("a row sink needs a streamed run")
    weights = load_weights(layer, weights_store, device=str(device))
    _, attn, method = layer_attention(layer, weights, x.to(device), key.to(device),
                                      value.to(device), pad.to(device), causal)
    if layer.positions not in ("none", "learned", "sinusoidal"):
        notes.append(f"this layer uses {layer.positions} positions inside attention; a standalone "
                     "layer runs without them (use --positions sinusoidal to add absolute "
                     "positions to the inputs)")
    result = LayerAttention(0, layer, attn.float().cpu(), x, method,
                            None if key is x else key, None if value is x else value)
    return AttentionRun(batch, [result], weights_store.source, described, str(device), causal,
                        weights_store, notes)


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
    if captured.scores is not None:
        return captured_breakdown(run, captured, sentence, query)
    layer = captured.layer
    if layer is None or run.store is None:
        raise UsageError("--query needs the q and k the model's attention receives, and this "
                         "run did not keep them", fix="drop --query", option="--query")
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
    scores_in = captured.scores
    assert scores_in is not None
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
                          captured.label, "; ".join(added))


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
        if captured.query_row != (sentence, query) or captured.query_weights is None:
            raise UsageError("this streamed run kept no weights for that query",
                             fix="pass --query to the run that streams")
        return captured.query_weights
    columns = captured.columns_of(batch)
    width = max(len(t) for t in columns)
    expected = captured.weights[sentence, :, query, :len(columns[sentence])]
    extra = captured.weights.shape[-1] - width  # bias_k columns sit after the padding
    if extra:
        expected = torch.cat([expected, captured.weights[sentence, :, query, -extra:]], -1)
    return expected


def _model_positions(run: AttentionRun, captured: LayerAttention, length: int) -> Any:
    """How positions enter a model's attention (RoPE, sliding windows), for a --model run of a
    family attnviz can recompute; None where the inputs already carry them."""
    if not captured.method.startswith("transformers") or run.store is None \
            or captured.layer is None:
        return None
    kind = hfconfig.model_type(run.store.config)
    if kind in SCHEMES:
        return positions_for(run.store.config, captured.layer, captured.index, length)
    if captured.layer.positions not in ("none", "learned", "sinusoidal"):
        raise UsageError(f"--query does not recompute {captured.layer.positions} positions of "
                         f"model_type {kind!r}",
                         fix=f"supported: {', '.join(sorted(SCHEMES))}", option="--query")
    return None


def check_finite_maps(run: AttentionRun) -> None:
    """NaN/Inf in the maps (from NaN weights or overflow) are reported, never drawn."""
    for captured in run.layers:
        if captured.weights is None:
            continue  # streamed maps were checked head by head as they were computed
        rows, columns = captured.rows_of(run.batch), captured.columns_of(run.batch)
        for b, (row_tokens, column_tokens) in enumerate(zip(rows, columns, strict=True)):
            n, m = len(row_tokens), len(column_tokens)
            maps = captured.weights[b, :, :n, :m]
            # Softmax weights lie in [0, 1], so a row sum cannot overflow: it is finite exactly
            # when the row is (one pass of additions instead of isfinite on every entry); only
            # a map that fails is counted entry by entry, for the message.
            if bool(torch.isfinite(maps.sum(-1)).all()):
                continue
            bad = int((~torch.isfinite(maps)).sum())
            if bad:
                raise CheckFailed(f"layer {captured.index} produced {bad} non-finite attention "
                                  f"weights for sentence {b + 1}",
                                  fix="check the weights with 'attnviz inspect --scan'")
