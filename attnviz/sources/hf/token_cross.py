"""`attnviz tokens --model … --target …`: the decoder's view of the source. One padded forward
of the whole encoder-decoder gives each sentence's encoder, decoder and cross-attention maps
(compute/tokenflow/cross.py carries a decoder position back through them) and, for the families
in DECODERS, what each decoder sublayer's per-source terms are made of (hooks on the decoder's
own modules; compute/tokenflow/cross_parts.py composes them); the encoder's blocks come from
token_contributions' own trace of the encoder (BLOCKS). Leave-one-out erases source tokens
through the encoder's attention mask (or a baseline token) on stacked copies and measures the
decoder position: log p of the token the model predicts there with an LM head, its final hidden
state otherwise."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from attnviz.compute.tokenflow.cross_parts import CrossBlocks
from attnviz.compute.tokenflow.decompose import BlockTerms, PostNorm
from attnviz.compute.tokenflow.trace import CrossTrace, Erasures
from attnviz.errors import CheckpointError, option, printable
from attnviz.sources.hf import guard
from attnviz.sources.hf.load import TOLERANCE
from attnviz.sources.hf.token_contributions import (
    EraseSpec,
    ModelRunner,
    effect,
    erased_copies,
    padded_batch,
    traces,
)


@dataclass(frozen=True)
class Sublayer:
    """Where one decoder attention sublayer sits, relative to one decoder layer module."""

    value: str  # the value projection (its output: the value states, bias included)
    out: str  # the output projection W_O (nn.Linear: (out, in))
    read: str  # where the sublayer's output (residual included) is read
    read_input: bool  # True: the input of `read` (a pre-LN model's next norm); else its output
    residual: str = ""  # the module whose input is the sublayer's residual ("": the layer)
    post_norm: str | None = None  # post-LN: the norm after the residual sum


@dataclass(frozen=True)
class DecoderRow:
    layers: str  # the decoder's ModuleList of layers
    self_attn: Sublayer
    cross: Sublayer


# T5: layer.0 self-attention, layer.1 cross-attention, each x + attn(norm(x)), read at its output
_T5 = DecoderRow("block",
                 Sublayer("layer.0.SelfAttention.v", "layer.0.SelfAttention.o", "layer.0", False,
                          residual="layer.0"),
                 Sublayer("layer.1.EncDecAttention.v", "layer.1.EncDecAttention.o", "layer.1",
                          False, residual="layer.1"))
# post-LN (BART, Marian, PLBart): LN(x + attn(x)) after each sublayer, read at that norm's output
_POST = DecoderRow("layers",
                   Sublayer("self_attn.v_proj", "self_attn.out_proj", "self_attn_layer_norm",
                            False, post_norm="self_attn_layer_norm"),
                   Sublayer("encoder_attn.v_proj", "encoder_attn.out_proj",
                            "encoder_attn_layer_norm", False, residual="encoder_attn",
                            post_norm="encoder_attn_layer_norm"))
# pre-LN fairseq names (mBART, Pegasus, M2M100, Blenderbot): x + attn(norm(x)), read at the
# input of the next sublayer's norm; the cross sublayer's residual is its own norm's input
_PRE = DecoderRow("layers",
                  Sublayer("self_attn.v_proj", "self_attn.out_proj", "encoder_attn_layer_norm",
                           True),
                  Sublayer("encoder_attn.v_proj", "encoder_attn.out_proj", "final_layer_norm",
                           True, residual="encoder_attn_layer_norm"))
# model_type → its decoder; every row is checked at run time (Σ_j T_ij = the sublayer's output)
DECODERS: dict[str, DecoderRow] = {
    "t5": _T5, "mt5": _T5,
    **dict.fromkeys(("bart", "marian", "plbart"), _POST),
    **dict.fromkeys(("mbart", "pegasus", "m2m_100", "blenderbot"), _PRE),
}


def decoder_row(runner: ModelRunner) -> DecoderRow | None:
    """The decoder's row where the encoder's blocks are known too (both sides decompose)."""
    if runner.block is None:
        return None
    return DECODERS.get(str(runner.config.model_type))


class _Captured:
    """Per decoder layer and sublayer ("self", "cross"): the residual, the value states and
    the sublayer's output, each the first call's (hooks on the model's own modules)."""

    def __init__(self, row: DecoderRow, layers: list[Any], source: str) -> None:
        self.row, self.layers, self.source = row, layers, source
        self.seen: dict[tuple[str, str, int], torch.Tensor] = {}
        self.handles: list[Any] = []

    def __enter__(self) -> _Captured:
        for i, layer in enumerate(self.layers):
            for name, sub in (("self", self.row.self_attn), ("cross", self.row.cross)):
                self._hook(layer.get_submodule(sub.residual) if sub.residual else layer,
                           (name, "residual", i), True)
                self._hook(layer.get_submodule(sub.value), (name, "value", i), False)
                self._hook(layer.get_submodule(sub.read), (name, "output", i), sub.read_input)
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()

    def _hook(self, module: Any, key: tuple[str, str, int], is_input: bool) -> None:
        def keep(_: Any, args: tuple, kwargs: dict, *output: Any) -> None:
            if is_input:
                value = args[0] if args else kwargs.get("hidden_states")
            else:
                value = output[0][0] if isinstance(output[0], tuple) else output[0]
            if key not in self.seen and isinstance(value, torch.Tensor):
                self.seen[key] = value.detach()

        if is_input:
            self.handles.append(module.register_forward_pre_hook(keep, with_kwargs=True))
        else:
            self.handles.append(module.register_forward_hook(keep, with_kwargs=True))

    def get(self, name: str, what: str, i: int) -> torch.Tensor:
        found = self.seen.get((name, what, i))
        if found is None:
            raise CheckpointError(f"decoder layer {i} did not run as attnviz expects its family "
                                  "to", fix=f"choose rollout or flow with {option('method')}",
                                  where=printable(self.source))
        return found

    def terms(self, name: str, i: int, b: int, maps: torch.Tensor) -> BlockTerms:
        """Sentence b's sublayer `name` of decoder layer i as a (rectangular) block: `maps`
        (H, Q, K) over its Q queries and K keys, U (H, K, E), the residual and the sublayer's
        own output (Q, E), b_O and the frozen post-norm."""
        sub = self.row.self_attn if name == "self" else self.row.cross
        layer = self.layers[i]
        H, Q, K = maps.shape
        out = layer.get_submodule(sub.out)
        W_o = out.weight.detach().float().cpu()  # (E, H·d)
        d = W_o.shape[1] // H
        v = self.get(name, "value", i)[b, :K].float().cpu()  # (K, H·d)
        per_head = v.view(K, H, d).transpose(0, 1)  # (H, K, d)
        U = torch.stack([per_head[h] @ W_o[:, h * d:(h + 1) * d].T for h in range(H)])
        output = self.get(name, "output", i)
        bias = getattr(out, "bias", None)
        norm = None if sub.post_norm is None else _frozen(layer.get_submodule(sub.post_norm))
        return BlockTerms(maps, U, self.get(name, "residual", i)[b, :Q].float().cpu(),
                          None if bias is None else bias.detach().float().cpu(), norm,
                          output[b, :Q].float().cpu(),
                          TOLERANCE.get(str(output.dtype).removeprefix("torch."), 1e-4))


def _frozen(module: Any) -> PostNorm:
    bias = getattr(module, "bias", None)
    eps = getattr(module, "eps", None) or getattr(module, "variance_epsilon", None) or 1e-12
    return PostNorm(module.weight.detach().float().cpu(),
                    None if bias is None else bias.detach().float().cpu(), float(eps))


def cross_traces(runner: ModelRunner, rows: list[list[int]], decoder: list[list[int]],
                 terms: bool = True) -> list[CrossTrace]:
    """Each sentence's encoder, decoder and cross maps from one padded forward of the whole
    encoder-decoder (sources and decoder inputs right-padded, each with its mask) and, for a
    family in DECODERS when `terms` (norms or ALTI will run), the decoder's sublayers' terms
    from hooks on that forward and the encoder's blocks from token_contributions' trace of the
    encoder."""
    from attnviz.sources.hf.token_names import token_names

    ids, mask = padded_batch(runner, rows)
    dec_ids, dec_mask = padded_batch(runner, decoder)
    row = decoder_row(runner) if terms else None
    captured = None
    if row is not None:
        captured = _Captured(row, list(runner.model.get_decoder().get_submodule(row.layers)),
                             runner.source)
    with torch.no_grad(), guard.silenced():
        def run() -> Any:
            return runner.model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec_ids,
                                decoder_attention_mask=dec_mask, output_attentions=True,
                                use_cache=False)
        if captured is not None:
            with captured:
                out = run()
        else:
            out = run()
    sources = [token_names(runner.tokenizer, r) for r in rows]
    encoded = traces(runner, rows, sources) if captured is not None else None
    found = []
    for b, (source, target) in enumerate(zip(rows, decoder, strict=True)):
        S, T = len(source), len(target)
        trace = CrossTrace(
            sources[b], token_names(runner.tokenizer, target),
            [m[b, :, :S, :S].float().cpu() for m in out.encoder_attentions],
            [m[b, :, :T, :T].float().cpu() for m in out.decoder_attentions],
            [m[b, :, :T, :S].float().cpu() for m in out.cross_attentions])
        own = None if encoded is None else encoded[b].blocks
        if captured is not None and own is not None:
            layers = range(len(captured.layers))
            trace.blocks = CrossBlocks(
                own,
                [captured.terms("self", i, b, trace.decoder[i]) for i in layers],
                [captured.terms("cross", i, b, trace.cross[i]) for i in layers])
        found.append(trace)
    return found


def cross_erasures(runner: ModelRunner, row: list[int], target: list[int], position: int,
                   spec: EraseSpec) -> Erasures:
    """Leave-one-out of each source token, for one decoder position: copies of the source
    stacked along the batch (the decoder input the same in each)."""
    ids, mask = padded_batch(runner, [row])
    dec = torch.tensor([target], device=runner.device)

    def measure(copies: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), guard.silenced():
            out = runner.model(input_ids=copies, attention_mask=masks,
                               decoder_input_ids=dec.expand(len(copies), -1))
        if runner.seq2seq_lm:
            return torch.log_softmax(out.logits[:, position].float(), -1)
        return out.last_hidden_state[:, position].float()

    base = measure(ids, mask)[0]
    target_id = int(base.argmax()) if runner.seq2seq_lm else None
    config = runner.config
    E = int(getattr(config, "d_model", None) or getattr(config, "hidden_size", 64) or 64)
    vocab = int(getattr(config, "vocab_size", 0) or 0) if runner.seq2seq_lm else 0
    per_copy = 4 * (3 * 16 * (len(row) + len(target)) ** 2 + 12 * (len(row) + len(target)) * E
                    + vocab * len(target))
    erased = list(range(len(row)))
    effects = [effect(base, measure(copies, masks), target_id)
               for copies, masks in erased_copies(ids, mask, erased,
                                                  max(1, spec.budget // max(1, per_copy)),
                                                  spec.baseline)]
    how = ("masked through the encoder's attention mask, as padding" if spec.baseline is None
           else f"replaced by the token {printable(spec.name)!r} (id {spec.baseline})")
    measure_text = (f"drop in log p(next token) at the decoder position, for the token the "
                    f"model predicts there (id {target_id})" if target_id is not None else
                    "relative change ‖h′ − h‖ / ‖h‖ of the decoder's final hidden state there")
    return Erasures(erased, torch.cat(effects) if effects else torch.zeros(0, dtype=torch.float64),
                    measure_text, how, None if target_id is None else float(base[target_id]))
