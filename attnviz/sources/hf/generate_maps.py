"""A generation's captured rows joined into full maps over prompt + generated tokens, realigned
so each sentence's real tokens sit at 0..n-1, and wrapped as an AttentionRun (so the usual
maps, overview, export and JSON apply), with a Generation record beside it."""

from __future__ import annotations

import torch

from attnviz.compute.forward_pass.inputs import Batch
from attnviz.compute.forward_pass.results import (
    AttentionRun,
    LayerAttention,
    ModelCall,
    heads_seen,
)
from attnviz.core.choices import LayerKind
from attnviz.core.request import GenerateSpec
from attnviz.errors import CheckpointError, printable
from attnviz.sources.generate_spec import Generation
from attnviz.sources.hf import capture
from attnviz.sources.hf.generate import METHOD_OUTPUT_ATTENTIONS, Steps, eos_ids, generate
from attnviz.sources.hf.generate_settings import aside_note
from attnviz.sources.hf.layers import ModelLayer, select
from attnviz.sources.hf.load import PATHS, STACK_OF, TOLERANCE, LoadedModel, input_device
from attnviz.sources.hf.token_names import decoded_text, token_names


def run_generation(loaded: LoadedModel, sentences: list[str], prompts: list[list[int]],
                   spec: GenerateSpec, layer: str | None = None
                   ) -> tuple[AttentionRun, Generation]:
    """Generate from each prompt and return the maps of the layers `layer` names."""
    shown = _shown(loaded, layer)
    steps = generate(loaded, prompts, spec, shown=shown)
    record = generation_record(loaded, steps, prompts, spec)
    generated, gen_tokens, texts = record.generated_ids, record.generated_tokens, record.texts
    width = steps.sequences.shape[1] - steps.prompt_width  # T: steps generate took
    tokenizer = loaded.tokenizer
    prompt_tokens = [token_names(tokenizer, ids) for ids in prompts]
    layers = _layers(loaded, steps)  # with `shown`, only those layers were captured
    layers = layers if shown is not None else select(layers, layer)
    if loaded.encoder_decoder:
        start = int(steps.sequences[0, 0])
        lengths = [1 + len(g) for g in generated]
        target = Batch(texts, [token_names(tokenizer, [start]) + t for t in gen_tokens])
        batch = Batch(list(sentences), prompt_tokens)
        results = [_layer(layer, steps, target, lengths, (width, 1)) for layer in layers]
    else:
        lengths = [len(p) + len(g) for p, g in zip(prompts, generated, strict=True)]
        batch = Batch(list(sentences), [p + g for p, g in zip(prompt_tokens, gen_tokens,
                                                               strict=True)])
        target = None
        results = [_layer(layer, steps, None, lengths, (width, steps.prompt_width),
                          [len(p) for p in prompts]) for layer in layers]
    note = aside_note(steps.set_aside, spec.sample)
    notes = (f"generation: {steps.method}",) + (() if note is None else (note,))
    run = AttentionRun(batch, tuple(results), printable(str(loaded.folder)),
                       "the model's own hidden states entering each attention module, step by "
                       "step through its own KV cache", str(input_device(loaded.model)),
                       not loaded.encoder_decoder, None, notes, TOLERANCE[loaded.dtype],
                       target=target, path=PATHS[loaded.path])
    return run, record


def generation_record(loaded: LoadedModel, steps: Steps, prompts: list[list[int]],
                      spec: GenerateSpec) -> Generation:
    """What was generated (each sentence's ids up to its first end-of-sequence token)."""
    stops = eos_ids(loaded)
    generated = [_until_eos(row[steps.prompt_width:].tolist(), stops)
                 for row in steps.sequences]
    tokenizer = loaded.tokenizer
    return Generation(prompts, generated,
                      [token_names(tokenizer, ids) for ids in generated],  # `<id N>`: no token
                      [decoded_text(tokenizer, ids) for ids in generated],
                      [1 if loaded.encoder_decoder else len(p) for p in prompts], spec,
                      steps.method, loaded.encoder_decoder, list(steps.set_aside))


def _shown(loaded: LoadedModel, layer: str | None) -> set[int] | None:
    """The layer numbers a --layer spec names in a decoder-only model (whose forward calls one
    attention module per layer, in order), by config.json's layer count; None (capture every
    call) for all layers, an encoder-decoder, a model off the attention interface (its maps
    come back whole from output_attentions) or a count config.json does not give."""
    from attnviz.core.selection import parse_layers
    from attnviz.sources.hf.layers import LAYER_FIELDS, config_count

    count = config_count(loaded.config, LAYER_FIELDS)
    if loaded.encoder_decoder or loaded.path != capture.CapturePath.INTERFACE or not count or \
            layer is None or layer.strip() == "all":
        return None
    chosen = parse_layers(layer.strip(), count)
    return None if chosen is None else set(chosen)


def _until_eos(ids: list[int], stops: set[int]) -> list[int]:
    for i, token in enumerate(ids):
        if token in stops:
            return ids[:i + 1]
    return ids


def _layers(loaded: LoadedModel, steps: Steps) -> list[ModelLayer]:
    """The attention modules in call order, numbered per stack as `heatmap --model` numbers
    them (a bare number; 'enc N', 'dec N', 'cross N' for encoder-decoders)."""
    order = {LayerKind.SELF: 0, LayerKind.DECODER_SELF: 1, LayerKind.CROSS: 1}
    names = sorted(steps.kinds, key=lambda n: order[steps.kinds[n]])  # stable: call order
    counts: dict[str, int] = {}
    layers = []
    for index, name in enumerate(names):
        kind = steps.kinds[name]
        stack = STACK_OF[kind] if loaded.encoder_decoder else ""
        if name in steps.calls and not loaded.encoder_decoder:  # only some layers captured
            index = steps.calls[name]
            counts[stack] = index
        layers.append(ModelLayer(index, name, name, kind, stack, counts.get(stack, 0),
                                 steps.heads[name], None, 0))
        counts[stack] = counts.get(stack, 0) + 1
    return layers


def _layer(layer: ModelLayer, steps: Steps, target: Batch | None, row_lengths: list[int],
           widths: tuple[int, int], prompt_lengths: list[int] | None = None
           ) -> LayerAttention:
    """One layer's maps (B, H, rows, cols), each sentence's real tokens at 0..n-1; widths:
    (generation steps, the padded prompt's width)."""
    width, prompt_width = widths
    blocks = steps.blocks[layer.name]
    if layer.kind == LayerKind.SELF and target is not None:  # an encoder: one forward
        maps = torch.cat(blocks, dim=2)  # (B, H, S, S), right-padded already
        return _result(layer, maps, "the module's own eager attention (encoder, once)",
                       target.tokens)
    full = _join(layer, blocks, prompt_width, width)  # (B, H, P, P|S)
    offsets = [0] * len(row_lengths) if prompt_lengths is None else \
        [prompt_width - n for n in prompt_lengths]
    cross = layer.kind == LayerKind.CROSS
    heads = full.shape[1]
    out = torch.zeros(full.shape[0], heads, max(row_lengths),
                      full.shape[3] if cross else max(row_lengths))
    for b, (offset, rows) in enumerate(zip(offsets, row_lengths, strict=True)):
        cols = full.shape[3] if cross else rows
        col0 = 0 if cross else offset
        out[b, :, :rows, :cols] = full[b, :, offset:offset + rows, col0:col0 + cols]
    if not cross and float(out.triu(1).abs().max()) > 1e-6:  # real tokens only
        raise CheckpointError(f"{layer.name} attends to later tokens: the model is not causal "
                              "(an encoder with a language-model head), so what it writes "
                              "depends on tokens it has not written yet",
                              fix="use a decoder (…ForCausalLM) or an encoder-decoder")
    tokens = None if target is None else target.tokens
    how = "output_attentions (eager)" if steps.method == METHOD_OUTPUT_ATTENTIONS else \
        "the module's own eager attention"
    return _result(layer, out, f"{how}, one row per generated token", tokens)


def _join(layer: ModelLayer, blocks: list[torch.Tensor], prompt_width: int, width: int
          ) -> torch.Tensor:
    """Prefill rows, then one row per step, in one (B, H, P, K) map over the padded sequence;
    a step whose cache kept fewer keys (a sliding window) covers the most recent ones."""
    if len(blocks) != width + 1:
        raise CheckpointError(f"{layer.name} made {len(blocks)} attention calls over "
                              f"{width} generation steps, not one per step",
                              fix="report this model to attnviz")
    first = blocks[0]  # (B, H, L, L) prefill; (B, H, 1, S) cross
    batch, heads = first.shape[:2]
    total = prompt_width + width
    keys = first.shape[3] if layer.kind == LayerKind.CROSS else total
    full = torch.zeros(batch, heads, total, keys)
    full[:, :, :prompt_width, :first.shape[3]] = first
    for step, block in enumerate(blocks[1:], 1):  # (B, H, 1, K)
        row = prompt_width + step - 1
        k = block.shape[3]
        if layer.kind == LayerKind.CROSS:
            full[:, :, row, :k] = block[:, :, 0]
        else:
            full[:, :, row, row + 1 - k:row + 1] = block[:, :, 0]
    return full


def _result(layer: ModelLayer, maps: torch.Tensor, method: str,
            target_tokens: list[list[str]] | None) -> LayerAttention:
    decoder = layer.kind != LayerKind.SELF
    decoder_only = target_tokens is None  # a decoder-only model's self-attention is causal
    return LayerAttention(
        layer.index, layer.full_name, layer.label if layer.stack else str(layer.index),
        heads_seen(layer.num_heads, maps), layer.kind, method,
        decoder_only or layer.kind == LayerKind.DECODER_SELF, maps, call=ModelCall(
            query_tokens=target_tokens if decoder else None,
            key_tokens=target_tokens if layer.kind == LayerKind.DECODER_SELF else None))
