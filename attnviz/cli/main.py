"""The command line: parse options, call the library, render, map errors to exit codes.

Only typer and rich are imported at start-up; torch and matplotlib load inside commands, so
`attnviz --help` stays instant.
"""

from __future__ import annotations

import errno
import signal
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from attnviz import __version__
from attnviz.errors import AttnvizError, ExitCode, Interrupted, UsageError

_state = {"debug": False}
# Typer vendors click in newer releases and re-exports click in older ones; find the base class of
# its command-line errors without importing either by name.
_CLI_ERROR: type[Exception] = next(
    c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


class AttnvizGroup(TyperGroup):
    """Every failure becomes one `error: …` line on stderr and an exit code; --debug re-raises."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        from attnviz.render.safe import check_terminal_size, prepare_streams

        argv = kwargs.get("args")
        argv = sys.argv[1:] if argv is None else argv
        _state["debug"] = _leading_debug(list(argv))
        prepare_streams()
        try:
            check_terminal_size()
            result = super().main(*args, standalone_mode=False, **kwargs)
            sys.stdout.flush()  # a full disk or closed pipe on stdout is reported here
        except typer.Exit as exc:
            sys.exit(exc.exit_code)
        except typer.Abort:
            _fail("aborted", ExitCode.USAGE)
        except (KeyboardInterrupt, Interrupted) as exc:
            if _state["debug"]:
                raise
            signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
            _fail(f"interrupted by {signal.Signals(signum).name}; no partial output was left",
                  128 + signum)
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
        except BrokenPipeError:  # `attnviz … | head`: the reader has all it wanted
            _quiet_stdout()
            sys.exit(128 + signal.SIGPIPE)
        except Exception as exc:
            if _state["debug"]:
                raise
            _fail_known(exc)
        sys.exit(result if isinstance(result, int) else 0)


def _leading_debug(argv: list[str]) -> bool:
    """--debug counts only among the global options before the command: after `--`, after the
    command name, or inside a sentence, the same word is text."""
    for arg in argv:
        if arg == "--debug":
            return True
        if arg == "--" or not arg.startswith("-"):
            return False
    return False


def _fail_known(exc: Exception) -> None:
    """Failures of the environment in attnviz's words; anything else is a bug to report."""
    from attnviz.errors import from_os_error
    from attnviz.render.safe import stdout_problem

    problem = stdout_problem(exc)
    if problem is not None:
        _quiet_stdout()
        _fail(problem.one_line(), problem.exit_code)
    if isinstance(exc, OSError):
        on_stdout = exc.filename is None and exc.errno in (errno.ENOSPC, errno.EIO, errno.EFBIG)
        if on_stdout:
            _quiet_stdout()
        error = from_os_error(exc, "cannot write to stdout" if on_stdout else "")
        _fail(error.one_line(), error.exit_code)
    _fail(f"unexpected {type(exc).__name__}: {exc}", ExitCode.DATA,
          "rerun with --debug for the traceback, and please report it")


def _quiet_stdout() -> None:
    """After stdout failed, send what is still buffered nowhere, so that the interpreter's own
    flush at exit cannot print a second complaint."""
    import contextlib
    import os

    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _fail(message: str, code: int, fix: str = "") -> None:
    from attnviz.errors import one_line

    typer.echo(f"error: {one_line(message + (' — ' + fix if fix else ''))}", err=True)
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


def _path_arg(param: typer.CallbackParam, value: Any) -> Any:
    """Paths (and --model ids) no file system can hold are usage errors, before any use."""
    if value is not None:
        from attnviz.load.paths import check_path_text

        name = (param.opts or [param.name or "path"])[0]
        check_path_text(value, name if name.startswith("-") else name.upper())
    return value


def _positive(param: typer.CallbackParam, value: Any) -> Any:
    """Counts and sizes given on the command line are positive: -H 0 is a mistake, not 'unset'."""
    if value is not None and value <= 0:
        name = (param.opts or [param.name or "the value"])[0]
        raise UsageError(f"{name} must be a positive integer, got {value}", "", name)
    return value


MAX_SEED = 2**64 - 1  # torch.manual_seed's range
NumHeads = Annotated[int | None, typer.Option("--num-heads", "-H", callback=_positive, help=(
    "Query heads (default 8 for random init; for checkpoints, overrides config/metadata)."))]
NumKvHeads = Annotated[int | None, typer.Option("--num-kv-heads", callback=_positive, help=(
    "Key/value heads, for grouped-query layers (default: from the config, else = H)."))]
HeadDim = Annotated[int | None, typer.Option("--head-dim", callback=_positive, help=(
    "Head dimension d, for layouts where H·d ≠ E (default: from the config, else rows / H)."))]
Weights = Annotated[Path | None, typer.Option("--weights", "-w", callback=_path_arg, help=(
    "A checkpoint (.safetensors, .pt/.pth/.bin, or a model folder) instead of random init."))]
LayerSpec = Annotated[str | None, typer.Option("--layer", "-l", help=(
    "Which attention layer of the checkpoint: an index from 'attnviz inspect' or its name."))]


def _strict_json(doc: dict[str, Any]) -> str:
    from attnviz.render.json_out import strict_json

    return strict_json(doc)


def _console(stderr: bool = False) -> Any:
    from attnviz.render.safe import console

    return console(stderr)


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
    seed: Annotated[int, typer.Option(min=0, max=MAX_SEED, help=(
        "Seed of the random init and of the proof's batch."))] = 0,
    png: Annotated[Path | None, typer.Option("--png", callback=_path_arg, help=(
        "Also write a figure of W_q, W_k, W_v, W_o with head boundaries (.png, .svg, .pdf)."))]
    = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the facts as one JSON document.")]
    = False,
    model: Annotated[str | None, typer.Option("--model", "-m", callback=_path_arg, help=(
        "A Hugging Face model folder or cached hub id; --layer is its layer index."))] = None,
    verify: Annotated[bool, typer.Option("--verify", help=(
        "--model: recompute the layer's attention from attnviz's slices and compare with the "
        "model's own weights (needs attnviz[hf])."))] = False,
) -> None:
    """Show how the heads split W_q, W_k, W_v (by rows) and W_o (by columns), and prove it
    against torch's own forward."""
    from attnviz.app.outputs import check_output_path
    from attnviz.recognize.base import HeadHints
    from attnviz.render.figure import FIGURE_SUFFIXES
    from attnviz.sources import layers as sources

    png_path = check_output_path(png, FIGURE_SUFFIXES, inputs_read(weights, model, None, False),
                                 "--png") if png else None
    if verify and model is None:
        raise UsageError("--verify needs --model", "pass a Hugging Face model folder")
    if model is not None:
        if weights is not None or embed_dim is not None:
            raise UsageError("--model excludes --weights and the random-init options", "")
        split_model(model, layer, HeadHints(num_heads, num_kv_heads, head_dim), seed, png_path,
                    as_json, verify)
        return
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


def inputs_read(weights: Path | None, model: str | None, file: Path | None,
                bundled: bool) -> Any:
    """Every file a run will read (a --weights/--model folder whole), for the output checks."""
    from attnviz.app.outputs import read_set

    files = [p for p in (weights, file) if p is not None]
    folders = [p for p in files if p.is_dir()]
    if model is not None:
        folder = Path(model).expanduser()
        if not folder.is_dir():  # a hub id: its snapshot folder in the local cache
            from attnviz.sources import hf

            folder = hf.resolve_folder(model)
        folders.append(folder)
    if bundled:
        from attnviz.sources.bundled import BUNDLED

        files.append(BUNDLED)
    return read_set(files, folders)


VERIFY_SENTENCES = ["the cat sat on the mat and the cat slept",
                    "heads split the projection, not the input"]


def split_model(model: str, layer: str | None, hints: Any, seed: int, png_path: Path | None,
                as_json: bool, verify: bool) -> None:
    """split on one layer of a Hugging Face model, optionally verified against the model."""
    from attnviz.recognize import select_layer
    from attnviz.sources import layers as sources

    folder = Path(model)
    if not folder.is_dir() or verify:
        from attnviz.sources import hf

        folder = hf.resolve_folder(model)
    inventory, store = sources.open_inventory(folder, hints)
    attn_layer = select_layer(inventory, layer if layer is not None else "0", store.source)
    result = None
    if verify:
        from attnviz.sources import hf

        loaded = hf.load_model(str(folder))
        result = hf.verify_layer(loaded, hf.model_index(loaded, attn_layer), VERIFY_SENTENCES)
    run_split(attn_layer, store, seed, png_path, as_json, result)


def run_split(attn_layer: Any, store: Any, seed: int, png_path: Path | None,
              as_json: bool, verified: Any = None) -> None:
    from attnviz.compute import split as split_mod

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
        if verified is not None:
            doc["verify"] = {"layer": verified.layer_index, "max_abs_diff": verified.max_diff,
                             "per_head": verified.per_head, "tolerance": verified.tolerance,
                             "positions": verified.positions, "passed": verified.passed,
                             "sentences": VERIFY_SENTENCES}
        typer.echo(_strict_json(doc))
    else:
        from attnviz.render.split_terminal import LABEL_WIDTH, print_split

        console = _console()
        picture = split_mod.band_picture(attn_layer, layer_weights.W_q,
                                         max_cols=max(8, min(console.width, 120) - LABEL_WIDTH))
        print_split(console, report, picture, split_mod.explanation(attn_layer), store.source)
        if verified is not None:
            from attnviz.render.split_terminal import verify_lines

            console.print(verify_lines(verified, VERIFY_SENTENCES))
        if png_path is not None:
            console.print(Text_(f"wrote {png_path}"))
    if verified is not None and not verified.passed:
        from attnviz.errors import CheckFailed

        raise CheckFailed(f"attnviz's per-head recomputation differs from the model's own "
                          f"attention by {verified.max_diff:.2e}, above {verified.tolerance:.0e}",
                          "report this with the model")
    if report.proof is not None and not report.proof.passed:
        from attnviz.errors import CheckFailed

        raise CheckFailed(f"the per-head recomputation differs from the reference by "
                          f"{report.proof.max_abs_diff:.2e}, above the tolerance",
                          "report this with the checkpoint")


@app.command()
def inspect(
    checkpoint: Annotated[Path, typer.Argument(callback=_path_arg, help=(
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
    from attnviz.app import inspect_checkpoint as inspect_mod
    from attnviz.recognize import select_layer
    from attnviz.recognize.base import HeadHints
    from attnviz.sources import layers as sources

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
        typer.echo(_strict_json(doc))
        return
    from attnviz.render.inspect_tables import print_detail, print_inventory

    console = _console()
    print_inventory(console, doc, non_finite, data_read=detail is not None)
    if detail is not None:
        print_detail(console, detail)


@app.command()
def heatmap(
    sentences: Annotated[list[str] | None, typer.Argument(help=(
        "One or more sentences (quote each). Tokens are words and punctuation marks."))] = None,
    file: Annotated[Path | None, typer.Option("--file", "-f", callback=_path_arg, help=(
        "Read sentences from a text file, one per line."))] = None,
    weights: Annotated[Path | None, typer.Option("--weights", "-w", callback=_path_arg, help=(
        "A checkpoint; default: the bundled 2-layer model with induction heads."))] = None,
    layer: Annotated[str | None, typer.Option("--layer", "-l", help=(
        "Bundled model: all (default), N, -1 or A:B. Checkpoint: which attention layer."))]
    = None,
    head: Annotated[int | None, typer.Option("--head", help="Show only this head.")] = None,
    average: Annotated[bool, typer.Option("--average", help="Show the mean over heads.")]
    = False,
    out: Annotated[Path | None, typer.Option("--out", "-o", callback=_path_arg, help=(
        "Write a figure: a grid of heads per sentence (.png, .svg, .pdf)."))] = None,
    query: Annotated[str | None, typer.Option("--query", "-q", help=(
        "Break one query token down head by head: its q_h, each key's k_h, scores, weights "
        "(an index, or a word)."))] = None,
    sentence: Annotated[int, typer.Option("--sentence", help=(
        "Which sentence --query refers to (1-based)."))] = 1,
    export: Annotated[Path | None, typer.Option("--export", callback=_path_arg, help=(
        "Write maps, inputs, mask and tokens to a .safetensors file."))] = None,
    stats: Annotated[bool, typer.Option("--stats/--no-stats", help=(
        "Print the head-statistics table."))] = True,
    maps: Annotated[bool, typer.Option("--maps/--no-maps", help=(
        "Print the terminal heatmaps."))] = True,
    as_json: Annotated[bool, typer.Option("--json", help=(
        "Print tokens and head statistics as one JSON document."))] = False,
    causal: Annotated[bool, typer.Option("--causal", help=(
        "Decoder-style masking: query i sees keys 0..i (the bundled model always is)."))]
    = False,
    positions: Annotated[str, typer.Option("--positions", help=(
        "Standalone layers: add 'sinusoidal' position encodings to the inputs, or 'none'."))]
    = "none",
    device: Annotated[str, typer.Option("--device", help=(
        "auto (a GPU when present), cpu, cuda, cuda:N or mps."))] = "auto",
    model: Annotated[str | None, typer.Option("--model", "-m", callback=_path_arg, help=(
        "A Hugging Face model folder or a hub id in the local cache (needs attnviz[hf])."))]
    = None,
    dtype: Annotated[str, typer.Option("--dtype", help=(
        "--model: float32, bfloat16 or float16."))] = "float32",
    device_map: Annotated[str | None, typer.Option("--device-map", help=(
        "--model: 'auto' spreads a large model over devices (needs accelerate)."))] = None,
    random: Annotated[bool, typer.Option("--random", help=(
        "Use a random nn.MultiheadAttention (with -E, -H, --kdim, --vdim, --seed)."))] = False,
    embed_dim: Annotated[int, typer.Option("--embed-dim", "-E", help="Random init: E.")] = 64,
    num_heads: NumHeads = None,
    num_kv_heads: NumKvHeads = None,
    head_dim: HeadDim = None,
    kdim: Annotated[int | None, typer.Option(help="Random init: key width.")] = None,
    vdim: Annotated[int | None, typer.Option(help="Random init: value width.")] = None,
    seed: Annotated[int, typer.Option(min=0, max=MAX_SEED, help="Random init: seed.")] = 0,
    max_tokens: Annotated[int, typer.Option("--max-tokens", callback=_positive, help=(
        "Longest sentence accepted (attention costs O(L²) per head)."))] = 256,
    max_sentences: Annotated[int, typer.Option("--max-sentences", callback=_positive, help=(
        "Most sentences accepted in one batch."))] = 64,
    max_panels: Annotated[int, typer.Option("--max-panels", callback=_positive, help=(
        "Most heatmap panels in one --out figure."))] = 256,
) -> None:
    """Run attention on sentences (one padded batch) and show every head's map, its statistics,
    and a figure."""
    from attnviz.app import heatmap as heatmap_mod
    from attnviz.app.outputs import check_distinct, check_output_path
    from attnviz.compute import inputs
    from attnviz.recognize.base import HeadHints
    from attnviz.render.figure import FIGURE_SUFFIXES
    from attnviz.sources import layers as sources

    texts = list(sentences or []) + (inputs.read_sentences(
        file, max_tokens, max_sentences, len(sentences or [])) if file else [])
    batch = inputs.make_batch(texts, max_tokens, max_sentences)
    if sum((random, weights is not None, model is not None)) > 1:
        raise UsageError("--random, --weights and --model exclude each other", "choose one")
    if out or export:  # every file the run reads is known before anything is computed
        reads = inputs_read(weights, model, file, not (random or weights or model))
        out_path = check_output_path(out, FIGURE_SUFFIXES, reads) if out else None
        export_path = (check_output_path(export, (".safetensors",), reads, "--export")
                       if export else None)
        check_distinct(out_path, export_path)
    else:
        out_path = export_path = None
    if not 1 <= sentence <= len(batch.tokens):
        raise UsageError(f"--sentence {sentence} is out of range",
                         f"choose 1..{len(batch.tokens)}", "--sentence")
    query_row = None
    if model is None and query is not None:  # fail before any work
        query_row = sentence - 1, inputs.find_query(batch.tokens[sentence - 1], query)
    if model is not None:  # the model's own tokenizer decides the tokens
        attention_run = heatmap_mod.run_model(
            model, texts, layer, device, dtype, device_map, max_tokens,
            head is not None or average, max_panels if out_path else None,
            keep_full_maps=export is not None,
            query=None if query is None else (sentence - 1, query))
        render_heatmap(attention_run, head, average, out_path, export_path, query,
                       sentence - 1, stats, maps, as_json)
        return
    spec = sources.RandomSpec(embed_dim, sources.DEFAULT_NUM_HEADS if num_heads is None
                              else num_heads, kdim, vdim, True, seed=seed) if random else None
    request = heatmap_mod.HeatmapRequest(batch, weights, layer, spec,
                                         HeadHints(num_heads, num_kv_heads, head_dim), causal,
                                         positions, device,
                                         keep_full_maps=export is not None,
                                         query_row=query_row,
                                         max_panels=max_panels if out_path else None,
                                         panels_per_map=1 if head is not None or average
                                         else None)
    attention_run = heatmap_mod.run(request)
    render_heatmap(attention_run, head, average, out_path, export_path, query,
                   sentence - 1, stats, maps, as_json)


def render_heatmap(attention_run: Any, head: int | None, average: bool, out_path: Path | None,
                   export_path: Path | None, query: str | None, sentence_index: int,
                   show_stats: bool, show_maps: bool, as_json: bool) -> None:
    from attnviz.app import heatmap as heatmap_mod
    from attnviz.compute import maps as views
    from attnviz.compute import stats as stats_mod
    from attnviz.compute.attention import check_finite_maps, query_breakdown
    from attnviz.compute.inputs import find_query

    for captured in attention_run.layers:
        views.check_head(head, captured.layer.num_heads or 0)
    check_finite_maps(attention_run)
    head_stats = [s for captured in attention_run.layers for s in (
        captured.stats if captured.weights is None else stats_mod.head_stats(
            captured.weights, attention_run.batch.tokens, captured.index))]
    selected = views.select_maps(attention_run, head, average)
    breakdown = None
    if query is not None:
        query_index = find_query(attention_run.batch.tokens[sentence_index], query)
        layer_index = attention_run.layers[-1].index
        breakdown = query_breakdown(attention_run, layer_index, sentence_index, query_index)
    if export_path is not None:
        heatmap_mod.export(attention_run, export_path)
    if out_path is not None:
        from attnviz.render.figure import heatmap_figure, save_figure

        save_figure(heatmap_figure(selected, attention_run.source), out_path)
    if as_json:
        typer.echo(_strict_json(heatmap_mod.run_json(attention_run, head_stats, breakdown)))
        return
    from attnviz.render import maps_terminal as render

    console = _console()
    console.print(Text_(f"source  {attention_run.source}   device {attention_run.device}"))
    console.print(Text_(f"inputs  {attention_run.inputs_described}"))
    for captured in attention_run.layers:
        console.print(Text_(f"layer {captured.index} ({captured.layer.name or 'top level'}): "
                            f"{captured.method}" + ("; causal" if attention_run.causal else "")))
    for note in attention_run.notes:
        console.print(Text_(f"note: {note}"))
    console.print()
    if show_maps:
        fitted = [views.downsample(v, 48, max(8, console.width - 10)) for v in selected]
        render.print_maps(console, fitted, attention_run.batch.sentences)
    if show_stats:
        console.print()
        render.print_stats(console, head_stats)
    if breakdown is not None:
        console.print()
        tokens = attention_run.batch.tokens[sentence_index]
        render.print_query(console, breakdown, tokens)
    for path in (out_path, export_path):
        if path is not None:
            console.print(Text_(f"wrote {path}"))


def Text_(text: str) -> Any:  # noqa: N802 - strings from files and users, shown literally
    from attnviz.render.safe import safe_text

    return safe_text(text)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
