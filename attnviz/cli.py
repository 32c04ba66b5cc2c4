"""The command line: parse options, call the library, render, map errors to exit codes.

Only typer and rich are imported at start-up; torch and matplotlib load inside commands, so
`attnviz --help` stays instant.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from attnviz import __version__
from attnviz.errors import AttnvizError, ExitCode, UsageError

_state = {"debug": False}
# Typer vendors click in newer releases and re-exports click in older ones; find the base class of
# its command-line errors without importing either by name.
_CLI_ERROR: type[Exception] = next(
    c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


class AttnvizGroup(TyperGroup):
    """Every failure becomes one `error: …` line on stderr and an exit code; --debug re-raises."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        argv = kwargs.get("args")
        argv = sys.argv[1:] if argv is None else argv
        _state["debug"] = "--debug" in list(argv)
        try:
            result = super().main(*args, standalone_mode=False, **kwargs)
        except typer.Exit as exc:
            sys.exit(exc.exit_code)
        except typer.Abort:
            _fail("aborted", ExitCode.USAGE)
        except _CLI_ERROR as exc:
            if _state["debug"]:
                raise
            hint = ""
            ctx = getattr(exc, "ctx", None)
            if ctx is not None:
                hint = f" — see '{ctx.command_path} --help'"
            code = getattr(exc, "exit_code", 2)
            _fail(exc.format_message() + hint, ExitCode.USAGE if code == 2 else ExitCode.DATA)
        except AttnvizError as exc:
            if _state["debug"]:
                raise
            _fail(exc.one_line(), exc.exit_code)
        except Exception as exc:
            if _state["debug"]:
                raise
            _fail(f"unexpected {type(exc).__name__}: {exc}", ExitCode.DATA,
                  "rerun with --debug for the traceback, and please report it")
        sys.exit(result if isinstance(result, int) else 0)


def _fail(message: str, code: int, fix: str = "") -> None:
    text = " ".join(f"{message}{' — ' + fix if fix else ''}".split())
    typer.echo(f"error: {text}", err=True)
    sys.exit(int(code))


app = typer.Typer(
    cls=AttnvizGroup,
    name="attnviz",
    help="See how multi-head attention splits W_q, W_k, W_v and W_o into heads, on any weights.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"attnviz {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
) -> None:
    """attnviz: inspect and visualize multi-head attention in PyTorch weights."""


NumHeads = Annotated[int | None, typer.Option("--num-heads", "-H", help=(
    "Query heads (default 8 for random init; for checkpoints, overrides config/metadata)."))]
NumKvHeads = Annotated[int | None, typer.Option("--num-kv-heads", help=(
    "Key/value heads, for grouped-query layers (default: from the config, else = H)."))]
HeadDim = Annotated[int | None, typer.Option("--head-dim", help=(
    "Head dimension d, for layouts where H·d ≠ E (default: from the config, else rows / H)."))]
Weights = Annotated[Path | None, typer.Option("--weights", "-w", help=(
    "A checkpoint (.safetensors, .pt/.pth/.bin, or a model folder) instead of random init."))]
LayerSpec = Annotated[str | None, typer.Option("--layer", "-l", help=(
    "Which attention layer of the checkpoint: an index from 'attnviz inspect' or its name."))]


def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=False)


@app.command()
def split(
    weights: Weights = None,
    layer: LayerSpec = None,
    embed_dim: Annotated[int | None, typer.Option("--embed-dim", "-E", help=(
        "Random init: embed_dim E (default 64)."))] = None,
    num_heads: NumHeads = None,
    num_kv_heads: NumKvHeads = None,
    head_dim: HeadDim = None,
    kdim: Annotated[int | None, typer.Option(help="Random init: key input width (default E).")]
    = None,
    vdim: Annotated[int | None, typer.Option(help="Random init: value input width (default E).")]
    = None,
    bias: Annotated[bool, typer.Option("--bias/--no-bias", help="Random init: with biases.")]
    = True,
    seed: Annotated[int, typer.Option(help="Seed of the random init and of the proof's batch.")]
    = 0,
    png: Annotated[Path | None, typer.Option("--png", help=(
        "Also write a figure of W_q, W_k, W_v, W_o with head boundaries (.png, .svg, .pdf)."))]
    = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the facts as one JSON document.")]
    = False,
) -> None:
    """Show how the heads split W_q, W_k, W_v (by rows) and W_o (by columns), and prove it
    against torch's own forward."""
    from attnviz import sources
    from attnviz.layouts.base import HeadHints
    from attnviz.output import check_output_path
    from attnviz.render.figure import FIGURE_SUFFIXES

    inputs = [weights] if weights else []
    png_path = check_output_path(png, FIGURE_SUFFIXES, inputs, "--png") if png else None
    if weights is None:
        if layer is not None or num_kv_heads is not None or head_dim is not None:
            raise UsageError("--layer, --num-kv-heads and --head-dim need --weights", "")
        spec = sources.RandomSpec(
            sources.DEFAULT_EMBED_DIM if embed_dim is None else embed_dim,
            sources.DEFAULT_NUM_HEADS if num_heads is None else num_heads,
            kdim, vdim, bias, seed=seed)
        attn_layer, store = sources.random_mha(spec)
    else:
        if embed_dim is not None or kdim is not None or vdim is not None:
            raise UsageError("--embed-dim, --kdim and --vdim apply to random init only; a "
                             "checkpoint's shapes come from its weights", "drop them")
        attn_layer, store = sources.checkpoint_layer(
            weights, layer, HeadHints(num_heads, num_kv_heads, head_dim))
    run_split(attn_layer, store, seed, png_path, as_json)


def run_split(attn_layer: Any, store: Any, seed: int, png_path: Path | None,
              as_json: bool) -> None:
    from attnviz import split as split_mod

    report, layer_weights = split_mod.make_report(attn_layer, store, seed)
    if png_path is not None:
        from attnviz.render.figure import save_figure, split_figure

        title = f"{attn_layer.name or store.source}: {attn_layer.num_heads} heads × d = " \
                f"{attn_layer.head_dim}"
        save_figure(split_figure(split_mod.matrix_panels(attn_layer, layer_weights), title),
                    png_path)
    if as_json:
        doc = report.to_json()
        doc["source"] = store.source
        typer.echo(json.dumps(doc, indent=2))
    else:
        from attnviz.render.terminal import LABEL_WIDTH, print_split

        console = _console()
        picture = split_mod.band_picture(attn_layer, layer_weights.W_q,
                                         max_cols=max(8, min(console.width, 120) - LABEL_WIDTH))
        print_split(console, report, picture, split_mod.explanation(attn_layer), store.source)
        if png_path is not None:
            console.print(f"wrote {png_path}")
    if report.proof is not None and not report.proof.passed:
        from attnviz.errors import CheckFailed

        raise CheckFailed(f"the per-head recomputation differs from the reference by "
                          f"{report.proof.max_abs_diff:.2e}, above the tolerance",
                          "report this with the checkpoint")


@app.command()
def inspect(
    checkpoint: Annotated[Path, typer.Argument(help=(
        "A .safetensors or .pt/.pth/.bin file, or a Hugging Face model folder."))],
    layer: Annotated[str | None, typer.Option("--layer", "-l", help=(
        "Show per-head slices and norms of one layer (index or name); reads its tensors."))]
    = None,
    num_heads: NumHeads = None,
    num_kv_heads: NumKvHeads = None,
    head_dim: HeadDim = None,
    scan: Annotated[bool, typer.Option("--scan", help=(
        "Read every attention tensor (one at a time) and count NaN/Inf values."))] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document.")] = False,
) -> None:
    """List every attention layer in a checkpoint: geometry, weight shapes, heads (headers only)."""
    from attnviz import inspect as inspect_mod
    from attnviz import sources
    from attnviz.layouts import select_layer
    from attnviz.layouts.base import HeadHints

    inventory, store = sources.open_inventory(checkpoint,
                                              HeadHints(num_heads, num_kv_heads, head_dim))
    doc = inspect_mod.inventory_json(inventory, store)
    detail = None
    if layer is not None:
        chosen = select_layer(inventory, layer, store.source)
        if not chosen.heads_known:
            raise UsageError(f"the number of heads of layer {chosen.name!r} is unknown",
                             "pass --num-heads (and --num-kv-heads for grouped-query layers)",
                             "--layer")
        detail = inspect_mod.layer_detail(chosen, store)
        doc["layer_detail"] = {"name": chosen.name, **detail.to_json()}
    non_finite = inspect_mod.scan_non_finite(inventory, store) if scan else None
    if non_finite is not None:
        doc["non_finite"] = non_finite
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        return
    from attnviz.render.tables import print_detail, print_inventory

    console = _console()
    print_inventory(console, doc, non_finite if non_finite is not None else
                    (detail.non_finite if detail else None))
    if detail is not None:
        print_detail(console, detail)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
