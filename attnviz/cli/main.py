"""The command line: the Typer app, its global options, and the one place where errors become
`error: …` lines and exit codes. The commands live beside it (split_cmd, inspect_cmd, heatmap_cmd).

Only typer and rich are imported at start-up; torch and matplotlib load inside commands, so
`attnviz --help` stays instant.
"""

from __future__ import annotations

import signal
import sys
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from attnviz import __version__
from attnviz.cli.examples import epilog
from attnviz.cli.heatmap_cmd import heatmap
from attnviz.cli.inspect_cmd import inspect
from attnviz.cli.split_cmd import split
from attnviz.errors import AttnvizError, ExitCode, Interrupted

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
            result = super().main(*args, standalone_mode=False, **kwargs)  # type: ignore[misc]
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
            message = exc.format_message()  # type: ignore[attr-defined]
            _fail(message + hint, ExitCode.USAGE if code == 2 else ExitCode.DATA)
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


app.command(epilog=epilog("split"))(split)
app.command(epilog=epilog("inspect"))(inspect)
app.command(epilog=epilog("heatmap"))(heatmap)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
