"""`attnviz generate` (the API's `run_model(generate=N)`): the use case. The bundled model or a
Hugging Face model with its language-model head writes N tokens after each sentence; the result
is the usual heatmap result over prompt + generated tokens, with what was generated and, per
generated token, the tokens its row attends to most."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from attnviz.compute.forward_pass.inputs import TokenLimit, length_problem
from attnviz.core.request import GenerateSpec, HeatmapRequest
from attnviz.errors import UsageError, option
from attnviz.sources.generate_spec import Focus, Generation

if TYPE_CHECKING:
    from attnviz.compute.forward_pass.results import AttentionRun, LayerAttention
    from attnviz.compute.measures.ranking import HeadRanking

TOP_K = 3  # tokens listed per generated token


def generate_spec(generate: int | None, sample: bool, temperature: float | None,
                  top_p: float | None, seed: int | None) -> GenerateSpec | None:
    """--generate and its sampling options, checked; None without --generate (when the others
    are usage errors)."""
    if generate is None:
        given = [option(name) for name, value in (("sample", sample), ("temperature", temperature),
                                                  ("top_p", top_p))
                 if value is not None and value is not False]  # 0.0 was given too
        if given:
            raise UsageError(f"{', '.join(given)} apply to {option('generate')} only",
                             fix=f"add {option('generate')} N, or drop them", option="generate")
        return None
    if seed is not None and not sample:
        raise UsageError(f"{option('seed')} seeds sampling, and {option('sample')} is not given",
                         fix=f"add {option('sample')}, or drop {option('seed')} (greedy decoding "
                         "draws nothing)", option="seed")
    spec = GenerateSpec(generate, sample, 1.0 if temperature is None else temperature,
                        1.0 if top_p is None else top_p, seed or 0)
    spec.check()
    return spec


def check_job(job: HeatmapRequest, spec: GenerateSpec) -> None:
    """What --generate cannot be combined with, refused before any work."""
    source = job.source
    refused = [option(name) + suffix for name, suffix, given in (
        ("weights", "", source.weights is not None), ("random", "", source.random is not None),
        ("target", "", job.inputs.targets is not None),
        ("query", "", job.selection.query is not None),
        ("memory_budget", "", job.limits.memory_budget is not None and source.model is None),
        ("device_map", "", source.device_map is not None),
        ("max_memory", "", source.max_memory is not None),
        ("weighting", " norm", job.measure.weighting != "attention"),
        ("ablate", "", job.measure.ablate is not None)) if given]
    if refused:
        verb = "does" if len(refused) == 1 else "do"
        raise UsageError(f"{option('generate')} runs the bundled model or {option('model')}; "
                         f"{', '.join(refused)} {verb} not apply to it",
                         fix=f"drop {', '.join(refused)}", option="generate")


def run_generate(job: HeatmapRequest, spec: GenerateSpec,
                 sentences_for: Callable[[TokenLimit | None], list[str]],
                 report: Callable[[str], None]) -> tuple[AttentionRun, Generation]:
    """The generation and its maps over prompt + generated tokens, for a request whose
    flags were checked (`sentences_for(limit)`: the job's sentences and --file's)."""
    check_job(job, spec)
    if job.source.model is not None:
        sentences = sentences_for(None)
        if not sentences:
            raise UsageError("no sentence given",
                             fix=f"pass one or more sentences, or {option('file')} FILE")
        if len(sentences) > job.limits.max_sentences:  # as make_batch says it for the others
            raise UsageError(f"{len(sentences)} sentences exceed {option('max_sentences')} "
                             f"{job.limits.max_sentences}",
                             fix=f"raise {option('max_sentences')} or pass fewer")
        return _generate_with_model(job, sentences, spec, report)
    return _run_bundled(job, spec, sentences_for, report)


def _generate_with_model(job: HeatmapRequest, sentences: list[str], spec: GenerateSpec,
               report: Callable[[str], None]) -> tuple[AttentionRun, Generation]:
    from attnviz.app.generate_stream import run_streamed, streams
    from attnviz.app.heatmap_sources import check_panels
    from attnviz.sources.hf.generate import load_lm
    from attnviz.sources.hf.generate_maps import run_generation
    from attnviz.sources.hf.inputs import check_length, encode
    from attnviz.sources.hf.layers import expected_shown
    from attnviz.sources.hf.load import check_load_options
    from attnviz.sources.registry import open_model_source

    check_load_options(job.source.device, job.source.dtype, None)
    opened = open_model_source(job.source)
    max_tokens = job.limits.max_tokens
    rows = [row["input_ids"] for row in encode(opened, sentences, None, max_tokens).rows]
    for i, row in enumerate(rows, 1):  # --max-tokens counts prompt + generated tokens
        n = (1 if opened.encoder_decoder else len(row)) + spec.max_new
        check_length(f"sentence {i} with {spec.max_new} generated tokens", n, max_tokens,
                     opened.position_limit)
    shown = expected_shown(opened, job.selection.layer, True)
    if shown is not None:
        check_panels(job, len(sentences), *shown)
    report(f"loading the model and generating {spec.max_new} tokens per sentence")
    loaded = load_lm(opened, job.source.device, job.source.dtype)
    budget = job.limits.memory_budget
    if streams(loaded, rows, spec, budget):  # long: bounded memory, two passes
        return run_streamed(loaded, job, sentences, rows, spec)
    return run_generation(loaded, sentences, rows, spec, job.selection.layer)


def _run_bundled(job: HeatmapRequest, spec: GenerateSpec,
                 sentences_for: Callable[[TokenLimit | None], list[str]],
                 report: Callable[[str], None]) -> tuple[AttentionRun, Generation]:
    from attnviz.app.heatmap_sources import check_panels
    from attnviz.compute.forward_pass.device import resolve_device
    from attnviz.compute.forward_pass.inputs import make_batch
    from attnviz.core.selection import parse_layers
    from attnviz.sources import bundled
    from attnviz.sources.bundled_generate import continue_text
    from attnviz.sources.registry import open_source

    store = open_source(job.source).store  # the bundled model, through the one registry
    limit = bundled.token_limit(store, "the bundled model")
    batch = make_batch(sentences_for(limit), job.limits.max_tokens,
                       job.limits.max_sentences, limit)
    for i, tokens in enumerate(batch.tokens, 1):  # --max-tokens counts prompt + generated
        problem = length_problem(f"sentence {i} with {spec.max_new} generated tokens",
                                 len(tokens) + spec.max_new, job.limits.max_tokens, limit)
        if problem is not None:
            raise UsageError(problem[0], fix=problem[1])
    layers = bundled.tiny_layers(store)
    chosen = parse_layers(job.selection.layer, len(layers))
    check_panels(job, len(batch.tokens), len(layers) if chosen is None else len(chosen),
                 max(layer.num_heads or 0 for layer in layers))
    report(f"generating {spec.max_new} tokens after each sentence")
    return continue_text(store, batch, spec, chosen, resolve_device(job.source.device))


def focus(run: AttentionRun, generation: Generation, head: int | None) -> list[Focus]:
    """Per generated token, the TOP_K tokens its row attends to most: in the last cross layer
    shown (an encoder-decoder: over the source), else the last decoder layer shown."""
    layer = _focus_layer(run)
    return [] if layer is None else focus_in(run, layer, generation, head)


def focus_in(run: AttentionRun, layer: LayerAttention, generation: Generation,
             head: int | None, top: int = TOP_K) -> list[Focus]:
    """Per generated token, the `top` keys its row in `layer` attends to most (one head, or the
    mean over heads); nothing for a streamed layer."""
    if layer.weights is None:
        return []
    out = []
    for b, generated in enumerate(generation.generated_tokens):
        keys = layer.columns_of(run.batch)[b]
        first = generation.prompt_lengths[b]
        for j, token in enumerate(generated):
            row = first + j
            maps = layer.weights[b, :, row, :len(keys)]  # (H, S)
            weights = maps.mean(0) if head is None else maps[head]
            values, positions = weights.topk(min(top, len(keys)))
            out.append(Focus(b, row, token, layer.label, head,
                             [(int(p), keys[int(p)], float(v))
                              for v, p in zip(values, positions, strict=True)]))
    return out


def ranked_focus(run: AttentionRun, generation: Generation, rankings: list[HeadRanking],
                 top: int = 2) -> list[tuple[list[str], list[Focus]]]:
    """The heads `rank_heads` puts first, one per head type (a head first in several types
    once, with all of them), each with its focus per generated token; only heads of layers
    whose rows include the generated tokens (a decoder's, not an encoder's)."""
    picked: dict[tuple[int, int], list[str]] = {}
    for ranking in rankings:
        if ranking.heads and ranking.heads[0].score > 0:  # a pattern some head shows
            best = ranking.heads[0]
            picked.setdefault((best.layer, best.head), []).append(ranking.head_type)
    layers = {layer.index: layer for layer in run.layers
              if layer.kind != "self" or run.target is None}
    return [(types, focus_in(run, layers[index], generation, head, top))
            for (index, head), types in picked.items() if index in layers]


def _focus_layer(run: AttentionRun) -> LayerAttention | None:
    for kind in ("cross", "decoder-self", "self"):
        found = [layer for layer in run.layers if layer.kind == kind]
        if found and (kind != "self" or run.target is None):
            return found[-1]
    return None

