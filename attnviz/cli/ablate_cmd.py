"""`attnviz ablate`: the causal head scorecard — remove each shown head and rerun the model's own
forward (the use case: attnviz.app.ablate; the scorecard's renderers: render/ablation_terminal,
render/ablation_figure). Its options are heatmap's where they apply, declared once in
heatmap_options / options, plus --mode; the run goes through heatmap's `run_command` with the
request's `ablate` measure."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from attnviz.cli.compound import (
    BUDGET_KEYS,
    BUDGET_RENAMED,
    FIGURE_KEYS,
    FIGURE_RENAMED,
    SPEC_KEYS,
    SPEC_RENAMED,
    Budget,
    Figure,
    Spec,
    key_values,
    old_spellings,
)
from attnviz.cli.heatmap_cmd import run_command
from attnviz.cli.heatmap_options import (
    Causal,
    Device,
    DeviceMap,
    Dtype,
    File,
    Head,
    Layer,
    Maps,
    MaxMemory,
    Overview,
    Probe,
    Quiet,
    RandomLayer,
    Sentences,
    Stats,
    Weights,
)
from attnviz.cli.options import (
    Json,
    Model,
    NumHeads,
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


@old_spellings(*SPEC_RENAMED, *BUDGET_RENAMED, *FIGURE_RENAMED)
def ablate(
    sentences: Sentences = None, file: File = None, probe: Probe = None,
    weights: Weights = None, model: Model = None, random: RandomLayer = False,
    device: Device = "auto", num_heads: NumHeads = None, causal: Causal = False,
    spec: Spec = None, dtype: Dtype = choices.Dtype.FLOAT32,
    device_map: DeviceMap = None, max_memory: MaxMemory = None,
    layer: Layer = None, head: Head = None, mode: Mode = AblationMode.ZERO,
    out: Out = None, as_json: Json = False, stats: Stats = None, maps: Maps = None,
    overview: Overview = None, rank: Rank = False, quiet: Quiet = False, figure: Figure = None,
    budget: Budget = None,
) -> None:
    """Remove each shown head in turn and rerun the model's own forward: what the head costs the
    final hidden states and, with an LM head, the loss or the output distribution (KL)."""
    if quiet and out is None:  # the scorecard is printed, unless --out draws it
        raise UsageError("--quiet prints no tables, and without --out the scorecard is only "
                         "printed", fix="add --out FILE.png, or drop --quiet")
    run_command(sentences=sentences, file=file, probe=probe, weights=weights, model=model,
                random=random, device=device, num_heads=num_heads, causal=causal, dtype=dtype,
                device_map=device_map, max_memory=max_memory, layer=layer, head=head,
                ablate=mode, out=out, as_json=as_json, stats=stats, maps=maps,
                overview=overview, rank=rank, quiet=quiet,
                **key_values("--spec", spec, SPEC_KEYS),
                **key_values("--figure", figure, FIGURE_KEYS),
                **key_values("--budget", budget, BUDGET_KEYS))
