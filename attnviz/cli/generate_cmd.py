"""`attnviz generate`: the model writes after each sentence, and the maps cover prompt + generated
tokens (the use case: attnviz.app.generate). Its options are heatmap's where they apply, declared
once in heatmap_options / options, plus how to write; the run goes through heatmap's
`run_command` with the request's `generate` measure."""

from __future__ import annotations

from typing import Annotated

import typer

from attnviz.cli.compound import (
    AVERAGE_RENAMED,
    BUDGET_KEYS,
    BUDGET_RENAMED,
    FIGURE_KEYS,
    FIGURE_RENAMED,
    Budget,
    Figure,
    HeadOrMean,
    head_or_mean,
    key_values,
    old_spellings,
)
from attnviz.cli.heatmap_cmd import run_command
from attnviz.cli.heatmap_options import (
    Device,
    Dtype,
    Export,
    File,
    Html,
    Layer,
    Maps,
    Out,
    Overview,
    Probe,
    Quiet,
    Rank,
    Scale,
    Sentences,
    Stats,
)
from attnviz.cli.options import Json, Model
from attnviz.core import choices
from attnviz.core.request import MAX_SEED

DEFAULT_NEW_TOKENS = 8

MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", "-n", min=1, help=(
    "Write up to N tokens after each sentence (stops earlier at end-of-sequence); the maps show "
    "a row per generated token. --budget tokens= counts prompt + generated tokens."))]
Sample = Annotated[bool, typer.Option("--sample", help=(
    "Sample the next token instead of taking the most likely (greedy, the default)."))]
Temperature = Annotated[float | None, typer.Option("--temperature", help=(
    "With --sample: divide the logits by T before sampling (default 1)."))]
TopP = Annotated[float | None, typer.Option("--top-p", help=(
    "With --sample: sample from the smallest set of tokens holding this much "
    "probability (default 1: all)."))]
SampleSeed = Annotated[int | None, typer.Option("--seed", min=0, max=MAX_SEED, help=(
    "With --sample: the seed of the draw, for a reproducible sample (default 0)."))]


@old_spellings(*BUDGET_RENAMED, *FIGURE_RENAMED, AVERAGE_RENAMED)
def generate(
    sentences: Sentences = None, file: File = None, probe: Probe = None, model: Model = None,
    device: Device = "auto", dtype: Dtype = choices.Dtype.FLOAT32,
    max_new_tokens: MaxNewTokens = DEFAULT_NEW_TOKENS, sample: Sample = False,
    temperature: Temperature = None, top_p: TopP = None, seed: SampleSeed = None,
    layer: Layer = None, head: HeadOrMean = None,
    out: Out = None, export: Export = None, html: Html = None, as_json: Json = False,
    stats: Stats = None, maps: Maps = None, overview: Overview = None, rank: Rank = False,
    quiet: Quiet = False, scale: Scale = choices.ColorScale.MAX, figure: Figure = None,
    budget: Budget = None,
) -> None:
    """Let the bundled model, or a --model with a language-model head, write after each sentence
    and show attention over prompt + generated tokens: what each new token attends to."""
    if overview == "ablation":
        from attnviz.errors import UsageError

        raise UsageError("--overview ablation shows the causal head scorecard of "
                         "'attnviz ablate', not of a generation",
                         fix="choose another --overview, or run 'attnviz ablate'")
    run_command(sentences=sentences, file=file, probe=probe, model=model, device=device,
                dtype=dtype, generate=max_new_tokens, sample=sample, temperature=temperature,
                top_p=top_p, seed=seed, layer=layer, out=out, export=export, html=html,
                as_json=as_json, stats=stats, maps=maps, overview=overview, rank=rank,
                quiet=quiet, scale=scale, **head_or_mean(head),
                **key_values("--figure", figure, FIGURE_KEYS),
                **key_values("--budget", budget, BUDGET_KEYS))
