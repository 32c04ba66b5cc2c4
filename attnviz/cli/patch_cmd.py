"""`attnviz patch`: parse → PatchRequest → run_patch → render (the use case: attnviz.app.patch;
the renderers: render/patch_terminal, render/patch_figure)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from attnviz.cli.heatmap_options import Device, Dtype, MemoryBudget
from attnviz.cli.options import Json, Model, choice_option, console, path_arg, plain, strict_json
from attnviz.core import choices
from attnviz.core.choices import PatchDirection, PatchMetric, PatchSite

Clean = Annotated[str | None, typer.Argument(help=(
    "The clean prompt (default: the bundled model's built-in induction pair)."))]
Corrupt = Annotated[str | None, typer.Option("--corrupt", "-c", help=(
    "The corrupted prompt: as many tokens as the clean one."))]
Answer = Annotated[str | None, typer.Option("--answer", "-a", help=(
    "The clean prompt's answer, one token (' Mary'); with --metric loss, the continuation "
    "scored."))]
Wrong = Annotated[str | None, typer.Option("--wrong", help=(
    "The other answer of the logit difference (the corrupted prompt's), one token."))]
Pairs = Annotated[Path | None, typer.Option("--pairs", "-p", callback=path_arg, help=(
    "Many pairs from a file: TSV 'clean<TAB>corrupt<TAB>answer[<TAB>wrong]' or JSON lines "
    "with clean, corrupt, answer, wrong; effects are means ± spread over the pairs."))]
Metric = Annotated[PatchMetric, choice_option(PatchMetric, "--metric", help=(
    "logit-diff: logit(answer) − logit(wrong) at the last token; logprob: log p(answer); "
    "loss: mean next-token loss over the answer as a continuation."))]
Direction = Annotated[str, typer.Option("--direction", help=(
    "denoising (the corrupted run, patched from the clean one), noising (the clean run, "
    "patched from the corrupted one), or both."))]
Site = Annotated[str | None, typer.Option("--site", "-s", help=(
    "What is patched, comma-separated (default heads,residual): heads (each head's output), "
    "residual (each layer × position), q, k, v, pattern (per head; k and v per key/value "
    "head), path (exact path patching to --receivers), attribution (first-order, beside "
    "exact)."))]
PerPosition = Annotated[bool | None, typer.Option("--per-position/--no-per-position", help=(
    "Also patch each head at each position (default: when at most 1024 such patches)."))]
Receivers = Annotated[str | None, typer.Option("--receivers", help=(
    "--site path: 'logits' (default), or receiver heads LAYER.HEAD[,LAYER.HEAD…] whose "
    "--receiver-input the senders reach."))]
ReceiverInput = Annotated[PatchSite | None, choice_option(PatchSite, "--receiver-input", help=(
    "--site path with receiver heads: their q (default), k or v."))]
Target = Annotated[str | None, typer.Option("--target", "-t", help=(
    "An encoder-decoder --model: the decoder's prefix (may be ''); the prompts are the "
    "encoder's input and the answer follows the prefix."))]
Out = Annotated[Path | None, typer.Option("--out", "-o", callback=path_arg, help=(
    "Write a figure of every grid (.png, .svg, .pdf)."))]
Export = Annotated[Path | None, typer.Option("--export", callback=path_arg, help=(
    "Write every number, the metric, the directions and the baselines to a .json file."))]
Html = Annotated[Path | None, typer.Option("--html", callback=path_arg, help=(
    "Write an offline page of every grid; click a head to see its effect at each position "
    "(.html)."))]


def patch(
    clean: Clean = None, corrupt: Corrupt = None, answer: Answer = None, wrong: Wrong = None,
    pairs: Pairs = None, model: Model = None, metric: Metric = PatchMetric.LOGIT_DIFF,
    direction: Direction = "denoising", site: Site = None, per_position: PerPosition = None,
    receivers: Receivers = None, receiver_input: ReceiverInput = None,
    target: Target = None, device: Device = "auto", dtype: Dtype = choices.Dtype.FLOAT32,
    memory_budget: MemoryBudget = None, out: Out = None, export: Export = None,
    html: Html = None, as_json: Json = False,
) -> None:
    """Activation patching: which heads, layers and positions carry the difference between a
    clean and a corrupted prompt's answer (default: the bundled model's induction pair)."""
    from attnviz.app.heatmap_sources import parse_memory_budget
    from attnviz.app.outputs import check_output_path
    from attnviz.app.patch import PatchRequest, run_patch
    from attnviz.cli.paths import inputs_read
    from attnviz.render.figure_io import FIGURE_SUFFIXES

    read = inputs_read(None, model, pairs, model is None)
    out_path = check_output_path(out, FIGURE_SUFFIXES, read) if out else None
    export_path = check_output_path(export, (".json",), read, "export") if export else None
    html_path = check_output_path(html, (".html",), read, "html") if html else None
    request = PatchRequest(clean, corrupt, answer, wrong, pairs, model, metric,
                           parse_directions(direction), parse_sites(site), per_position,
                           receivers, receiver_input, device, dtype,
                           parse_memory_budget(memory_budget), target)
    result = run_patch(request)
    if out_path is not None:
        from attnviz.cli.paths import write_figure
        from attnviz.render.patch_figure import patch_figure

        write_figure(patch_figure(result), out_path)
    if export_path is not None:
        from attnviz.cli.paths import write_page

        write_page(strict_json(result.to_json()) + "\n", export_path)
    if html_path is not None:
        from attnviz.cli.paths import write_page
        from attnviz.render.patch_html import patch_html

        write_page(patch_html(result), html_path)
    if as_json:
        typer.echo(strict_json(result.to_json()))
        return
    from attnviz.render.patch_terminal import print_patch

    shown = console()
    print_patch(shown, result)
    for path in (out_path, export_path, html_path):
        if path is not None:
            shown.print(plain(f"wrote {path}"), soft_wrap=True)


def parse_directions(text: str) -> tuple[PatchDirection, ...]:
    """denoising, noising or both."""
    if text == "both":
        return (PatchDirection.DENOISING, PatchDirection.NOISING)
    from attnviz.errors import UsageError

    if text not in PatchDirection.values():
        raise UsageError(f"unknown --direction {text!r}", fix="use denoising, noising, both",
                         option="direction")
    return (PatchDirection(text),)


def parse_sites(text: str | None) -> tuple[PatchSite, ...]:
    """Comma-separated --site values, each once, in the order given."""
    from attnviz.app.patch import DEFAULT_SITES

    if text is None:
        return DEFAULT_SITES
    parts = [p.strip() for p in text.split(",") if p.strip()]
    return tuple(dict.fromkeys(PatchSite.parse(p, "site") for p in parts)) or DEFAULT_SITES
