"""`attnviz tokens --model … --target …`: the decoder's view of the source. One padded forward
of the whole encoder-decoder gives each sentence's encoder, decoder and cross-attention maps
(compute/tokenflow/cross.py carries a decoder position back through them); leave-one-out erases
source tokens through the encoder's attention mask (or a baseline token) on stacked copies and
measures the decoder position: log p of the token the model predicts there with an LM head, its
final hidden state otherwise."""

from __future__ import annotations

import torch

from attnviz.compute.tokenflow.trace import CrossTrace, Erasures
from attnviz.errors import printable
from attnviz.sources.hf import guard
from attnviz.sources.hf.token_contributions import EraseSpec, ModelRunner, padded_batch


def cross_traces(runner: ModelRunner, rows: list[list[int]], decoder: list[list[int]]
                 ) -> list[CrossTrace]:
    """Each sentence's encoder, decoder and cross maps from one padded forward of the whole
    encoder-decoder (sources and decoder inputs right-padded, each with its mask)."""
    from attnviz.sources.hf.token_names import token_names

    ids, mask = padded_batch(runner, rows)
    dec_ids, dec_mask = padded_batch(runner, decoder)
    with torch.no_grad(), guard.silenced():
        out = runner.model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec_ids,
                           decoder_attention_mask=dec_mask, output_attentions=True)
    found = []
    for b, (row, target) in enumerate(zip(rows, decoder, strict=True)):
        S, T = len(row), len(target)
        found.append(CrossTrace(
            token_names(runner.tokenizer, row), token_names(runner.tokenizer, target),
            [m[b, :, :S, :S].float().cpu() for m in out.encoder_attentions],
            [m[b, :, :T, :T].float().cpu() for m in out.decoder_attentions],
            [m[b, :, :T, :S].float().cpu() for m in out.cross_attentions]))
    return found


def cross_erasures(runner: ModelRunner, row: list[int], target: list[int], position: int,
                   spec: EraseSpec) -> Erasures:
    """Leave-one-out of each source token, for one decoder position: copies of the source
    stacked along the batch (the decoder input the same in each)."""
    baseline, budget, baseline_name = spec.baseline, spec.budget, spec.name
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
    target_id = int(base.argmax()) if runner.seq2seq_lm else -1
    config = runner.config
    E = int(getattr(config, "d_model", None) or getattr(config, "hidden_size", 64) or 64)
    vocab = int(getattr(config, "vocab_size", 0) or 0) if runner.seq2seq_lm else 0
    per_copy = 4 * (3 * 16 * (len(row) + len(target)) ** 2 + 12 * (len(row) + len(target)) * E
                    + vocab * len(target))
    step = max(1, budget // max(1, per_copy))
    erased, effects = list(range(len(row))), []
    for start in range(0, len(erased), step):
        chunk = erased[start:start + step]
        copies, masks = ids.repeat(len(chunk), 1), mask.repeat(len(chunk), 1)
        for c, j in enumerate(chunk):
            if baseline is None:
                masks[c, j] = 0
            else:
                copies[c, j] = baseline
        got = measure(copies, masks)
        if runner.seq2seq_lm:
            effects.append((base[target_id] - got[:, target_id]).double().cpu())
        else:
            effects.append(((got - base).norm(dim=-1) / base.norm().clamp(min=1e-30))
                           .double().cpu())
    how = ("masked through the encoder's attention mask, as padding" if baseline is None else
           f"replaced by the token {printable(baseline_name)!r} (id {baseline})")
    measure_text = (f"drop in log p(next token) at the decoder position, for the token the "
                    f"model predicts there (id {target_id})" if runner.seq2seq_lm else
                    "relative change ‖h′ − h‖ / ‖h‖ of the decoder's final hidden state there")
    return Erasures(erased, torch.cat(effects) if effects else torch.zeros(0, dtype=torch.float64),
                    measure_text, how,
                    float(base[target_id]) if runner.seq2seq_lm else None)
