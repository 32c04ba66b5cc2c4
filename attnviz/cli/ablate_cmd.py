"""`attnviz ablate`: the causal head scorecard — remove each shown head and rerun the model's own
forward (the use case: attnviz.app.ablate; the scorecard's renderers: render/ablation_terminal,
render/ablation_figure). Its options are heatmap's where they apply, declared once in
heatmap_options / options, plus --mode; the run goes through heatmap's `run_command` with the
request's `ablate` measure."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from attnviz.cli.heatmap_cmd import run_command
from attnviz.cli.heatmap_options import (
    Causal,
    Device,
    DeviceMap,
    Dpi,
    Dtype,
    File,
    Head,
    Layer,
    Maps,
    MaxMemory,
    MaxPanels,
    MaxSentences,
    MaxTokens,
    MemoryBudget,
    Overview,
    Positions,
    Probe,
    Quiet,
    Random,
    Sentences,
    Size,
    Stats,
    Weights,
)
from attnviz.cli.options import (
    EmbedDim,
    HeadDim,
    Json,
    KDim,
    Model,
    NumHeads,
    NumKvHeads,
    Seed,
    VDim,
    choice_option,
    path_arg,
)
from attnviz.core import choices
from attnviz.core.choices import AblationMode
from attnviz.errors import UsageError

Mode = Annotated[AblationMode, choice_option(AblationMode, "--mode", help=(
    "What replaces a removed head's slice of the input to W_O: zero, or mean (its mean over "
    "the batch's real tokens)."))]
Out = Annotated[Path | None, typer.Option("--out", "-o", callback=path_arg, help=(
    "Write figures: the maps of the heads scored (.png, .svg, .pdf), and the scorecard beside "
    "it (NAME.ablation.png)."))]
Rank = Annotated[bool, typer.Option("--rank", help=(
    "Rank the heads by causal effect and by type (previous-token, first/last-token, "
    "special-token, self, duplicate, induction, next-token, punctuation, broad): the top 3 "
    "of each."))]


def ablate(
    sentences: Sentences = None, file: File = None, probe: Probe = None,
    weights: Weights = None, model: Model = None, random: Random = False, device: Device = "auto",
    embed_dim: EmbedDim = None, kdim: KDim = None, vdim: VDim = None, seed: Seed = None,
    num_heads: NumHeads = None, num_kv_heads: NumKvHeads = None, head_dim: HeadDim = None,
    causal: Causal = False, positions: Positions = choices.Positions.NONE,
    dtype: Dtype = choices.Dtype.FLOAT32,
    device_map: DeviceMap = None, max_memory: MaxMemory = None,
    layer: Layer = None, head: Head = None, mode: Mode = AblationMode.ZERO,
    out: Out = None, as_json: Json = False, stats: Stats = None, maps: Maps = None,
    overview: Overview = None, rank: Rank = False, quiet: Quiet = False, size: Size = None,
    dpi: Dpi = 100, max_tokens: MaxTokens = 256, max_sentences: MaxSentences = 64,
    max_panels: MaxPanels = 256, memory_budget: MemoryBudget = None,
) -> None:
    """Remove each shown head in turn and rerun the model's own forward: what the head costs the
    final hidden states and, with an LM head, the loss or the output distribution (KL)."""
    if quiet and out is None:  # the scorecard is printed, unless --out draws it
        raise UsageError("--quiet prints no tables, and without --out the scorecard is only "
                         "printed", fix="add --out FILE.png, or drop --quiet")
    run_command(sentences=sentences, file=file, probe=probe, weights=weights, model=model,
                random=random, device=device, embed_dim=embed_dim, kdim=kdim, vdim=vdim,
                seed=seed, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                causal=causal, positions=positions, dtype=dtype, device_map=device_map,
                max_memory=max_memory, layer=layer, head=head, ablate=mode,
                out=out, as_json=as_json, stats=stats, maps=maps, overview=overview, rank=rank,
                quiet=quiet, size=size, dpi=dpi, max_tokens=max_tokens,
                max_sentences=max_sentences, max_panels=max_panels, memory_budget=memory_budget)
