"""The command line: the Typer app, its global options, and the one place where errors become
`error: …` lines and exit codes. The commands live beside it (split_cmd, inspect_cmd, heatmap_cmd,
generate_cmd, ablate_cmd, circuits_cmd, corpus_cmd).

Only typer and rich are imported at start-up; torch and matplotlib load inside commands, so
`attnviz --help` stays instant.
"""

from __future__ import annotations

import errno
import signal
import sys
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from attnviz import __version__
from attnviz.cli.ablate_cmd import ablate
from attnviz.cli.attribute_cmd import attribute
from attnviz.cli.circuits_cmd import circuits
from attnviz.cli.compare_cmd import compare
from attnviz.cli.compound import command_of, spell_as
from attnviz.cli.corpus_cmd import corpus
from attnviz.cli.examples import epilog, summary
from attnviz.cli.generate_cmd import generate
from attnviz.cli.heatmap_cmd import heatmap
from attnviz.cli.inspect_cmd import inspect
from attnviz.cli.lens_cmd import lens
from attnviz.cli.options import flag_of
from attnviz.cli.panels import PanelledCommand, assign_panels
from attnviz.cli.patch_cmd import patch
from attnviz.cli.split_cmd import split
from attnviz.cli.tokens_cmd import tokens
from attnviz.errors import AttnvizError, ExitCode, Interrupted

_state = {"debug": False}
# Typer vendors click in newer releases and re-exports click in older ones; find the base class of
# its command-line errors without importing either by name.
_CLI_ERROR: type[Exception] = next(
    c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


class AttnvizGroup(TyperGroup):
    """Every failure becomes one `error: …` line on stderr and an exit code; --debug re-raises."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        argv = kwargs.get("args")
        argv = sys.argv[1:] if argv is None else argv
        # how the command's messages name options (cli/compound.py), for this run only
        spelled = spell_as(command_of(list(argv)))
        try:
            return self._run(*args, **kwargs)
        finally:
            spell_as(None, spelled)

    def _run(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        from attnviz.render.safe import check_terminal_size, prepare_streams, stdout_closed

        argv = kwargs.get("args")
        argv = sys.argv[1:] if argv is None else argv
        _state["debug"] = _leading_debug(list(argv))
        for note in prepare_streams() + check_terminal_size():
            typer.echo(f"note: {note}", err=True)
        for name, command in self.commands.items():
            assign_panels(name, command)
        try:
            result = super().main(*args, standalone_mode=False, **kwargs)  # type: ignore[misc]
            sys.stdout.flush()  # a full disk or closed pipe on stdout is reported here
            if stdout_closed():  # files were written; what stdout should have shown was not
                _fail("cannot write to stdout: it is closed", ExitCode.DATA,
                      "files the command writes were written; run it with stdout open to "
                      "see the rest")
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
            if not message.strip():  # bare `attnviz`: the help was printed, nothing else to say
                sys.exit(int(ExitCode.USAGE))
            _fail(message + hint, ExitCode.USAGE if code == 2 else ExitCode.DATA)
        except AttnvizError as exc:
            if _state["debug"]:
                raise
            _fail(exc.one_line(flag_of), exc.exit_code)
        except BrokenPipeError:  # `attnviz … | head`: the reader has all it wanted, a success
            _quiet_stdout()
            sys.exit(0)
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

    if _out_of_memory(exc):
        _fail("out of memory: an allocation failed", ExitCode.DATA,
              f"lower {flag_of('memory_budget')} (attention maps are then computed in smaller "
              "blocks), or "
              "pass fewer or shorter sentences, fewer layers (--layer) or heads (--head)")
    problem = stdout_problem(exc)
    if problem is not None:
        _quiet_stdout()
        _fail(problem.one_line(flag_of), problem.exit_code)
    if isinstance(exc, OSError):
        on_stdout = exc.filename is None and exc.errno in (errno.ENOSPC, errno.EIO, errno.EFBIG)
        if on_stdout:
            _quiet_stdout()
        error = from_os_error(exc, "cannot write to stdout" if on_stdout else "")
        _fail(error.one_line(flag_of), error.exit_code)
    _fail(f"unexpected {type(exc).__name__}: {exc}", ExitCode.DATA,
          "rerun with --debug for the traceback, and please report it")


def _out_of_memory(exc: BaseException) -> bool:
    """An allocator failure anywhere: Python's MemoryError, torch's OutOfMemoryError, or the
    RuntimeError torch's CPU allocator raises ("DefaultCPUAllocator: can't allocate memory")."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)[:500]


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
    # typer's default, spelled out: before 0.20.1 typer kept the default's placeholder instead
    # of "rich", so help text was not read as markup (`attnviz\\[hf]` showed its backslash).
    rich_markup_mode="rich",
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


for _command in (split, inspect, heatmap, generate, ablate, circuits, patch, attribute,
                 lens, tokens, corpus, compare):
    app.command(cls=PanelledCommand, help=summary(_command.__name__, _command.__doc__),
                epilog=epilog(_command.__name__))(_command)


def main() -> None:
    """The console entry point: the commands run in a supervised child process, so that even a
    death by signal inside a library ends as one `error:` line (cli/supervisor.py); --debug runs
    them in this process, where faulthandler and core dumps see the crash as it is."""
    from attnviz.cli.supervisor import supervised

    if _leading_debug(sys.argv[1:]):
        app()
    else:
        supervised(app)


if __name__ == "__main__":
    main()
