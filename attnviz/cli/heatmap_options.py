"""`attnviz heatmap`'s own options, declared once as Annotated aliases so that the command's
signature stays one line per group of flags (names, defaults and help live here)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from attnviz.cli.options import path_arg, positive

# what to run on
Sentences = Annotated[list[str] | None, typer.Argument(help=(
    "One or more sentences (quote each). Tokens are words and punctuation marks."))]
File = Annotated[Path | None, typer.Option("--file", "-f", callback=path_arg, help=(
    "Read sentences from a text file, one per line ('-': standard input)."))]
Probe = Annotated[str | None, typer.Option("--probe", help=(
    "Run on a probe input instead of sentences: 'induction' (random words, each span "
    "repeated) makes induction heads show."))]

# which weights
Weights = Annotated[Path | None, typer.Option("--weights", "-w", callback=path_arg, help=(
    "A checkpoint; default: the bundled 2-layer model with induction heads."))]
Layer = Annotated[str | None, typer.Option("--layer", "-l", help=(
    "Bundled model and --model: all (default), N, -1 or A:B, numbered in the order the "
    "forward pass runs them. Encoder-decoder --model: 'enc N', 'dec N' (decoder "
    "self-attention), 'cross N' (cross-attention), each with N, -1, A:B or all, joined by "
    "commas ('enc -1,cross 0:2'); a bare N is the encoder's. Checkpoint: which attention "
    "layer."))]
Causal = Annotated[bool, typer.Option("--causal", help=(
    "Decoder-style masking: query i sees keys 0..i (the bundled model always is)."))]
Positions = Annotated[str, typer.Option("--positions", help=(
    "Standalone layers: add 'sinusoidal' position encodings to the inputs, or 'none'."))]
Device = Annotated[str, typer.Option("--device", help=(
    "auto (a GPU when present), cpu, cuda, cuda:N or mps."))]
Dtype = Annotated[str, typer.Option("--dtype", help=(
    "--model: float32, bfloat16 or float16."))]
DeviceMap = Annotated[str | None, typer.Option("--device-map", help=(
    "--model: 'auto' spreads a large model over devices (needs accelerate)."))]
Target = Annotated[list[str] | None, typer.Option("--target", "-t", help=(
    "--model, encoder-decoder: the decoder's text, one --target per sentence in order; "
    "runs the decoder too (its self-attention and its cross-attention over the "
    "sentence)."))]
Random = Annotated[bool, typer.Option("--random", help=(
    "Use a random nn.MultiheadAttention (with -E, -H, --kdim, --vdim, --seed)."))]

# what to show
Head = Annotated[int | None, typer.Option("--head", help="Show only this head.")]
Average = Annotated[bool, typer.Option("--average", help="Show the mean over heads.")]
Query = Annotated[str | None, typer.Option("--query", "-q", help=(
    "Break one query token down head by head: its q_h, each key's k_h, scores, weights "
    "(an index, or a word)."))]
Sentence = Annotated[int, typer.Option("--sentence", help=(
    "Which sentence --query refers to (1-based)."))]
Stats = Annotated[bool | None, typer.Option("--stats/--no-stats", help=(
    "Print the head-statistics table (default: on, except beside --model's overview)."))]
Maps = Annotated[bool | None, typer.Option("--maps/--no-maps", help=(
    "Print the terminal heatmaps (default: on, unless --out, --export or --html writes "
    "them to a file, or --model shows its overview)."))]
Overview = Annotated[str | None, typer.Option("--overview", help=(
    "Print a layers × heads grid, a cell per head: label (its type: prev, first, last, "
    "spec, self, dup, ind, broad, other) or a statistic (entropy, max, distance, first, "
    "previous, last, special, self, duplicate, induction); off: none. Default: label for "
    "--model without --layer, --head, --average or --maps (maps only when asked for)."))]
Quiet = Annotated[bool, typer.Option("--quiet", help=(
    "Print only the 'wrote …' lines (and errors): no header, maps or tables."))]
Rank = Annotated[bool, typer.Option("--rank", help=(
    "Rank the heads by type (previous-token, first/last-token, special-token, self, "
    "duplicate, induction, broad): the top 3 of each."))]
Scale = Annotated[str, typer.Option("--scale", help=(
    "Colour scale of maps and figures: max (0 to the largest weight shown), fixed (0 to "
    "1) or log (3 decades below the largest)."))]

# files written
Out = Annotated[Path | None, typer.Option("--out", "-o", callback=path_arg, help=(
    "Write a figure: a grid of heads per sentence (.png, .svg, .pdf)."))]
Export = Annotated[Path | None, typer.Option("--export", callback=path_arg, help=(
    "Write maps, inputs, mask and tokens to a .safetensors file."))]
Html = Annotated[Path | None, typer.Option("--html", callback=path_arg, help=(
    "Write an interactive page that works offline: head, model and query views (.html)."))]
Size = Annotated[float | None, typer.Option("--size", help=(
    "--out: the side of each heatmap panel in inches (default: room for every token's "
    "label, 2.5 to 6, smaller in big grids)."))]
Dpi = Annotated[int, typer.Option("--dpi", help=(
    "--out: dots per inch of a .png figure (its pixel size)."))]

# limits
MaxTokens = Annotated[int, typer.Option("--max-tokens", callback=positive, help=(
    "Longest sentence accepted (attention costs O(L²) per head)."))]
MaxSentences = Annotated[int, typer.Option("--max-sentences", callback=positive, help=(
    "Most sentences accepted in one batch."))]
MaxPanels = Annotated[int, typer.Option("--max-panels", callback=positive, help=(
    "Most heatmap panels in one --out figure."))]
MemoryBudget = Annotated[str | None, typer.Option("--memory-budget", help=(
    "Memory for attention maps, e.g. 512MB or 2GB (default 256MB). Inputs whose full maps "
    "(sentences × heads × L × S × 4 bytes) fit are computed whole; longer ones in blocks "
    "of query rows sized to fit it, each reduced at once to display maps and statistics "
    "(--export: written to the file). --weights and --random layers."))]
